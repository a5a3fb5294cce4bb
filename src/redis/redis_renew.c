/* SPDX-License-Identifier: MIT */
/*
 * The Redis provider's renewal thread.  It renews every held lease at a
 * third of its ttl with a compare-and-PEXPIRE script; marks a lease lost
 * when a renewal finds the key gone or taken, or when no renewal succeeded
 * before the lease would have expired; calls each lost lease's watch
 * callback once, with no lock held; and undoes acquires that gave up while
 * an attempt of theirs was unanswered (the undo queue, r->undos).  It has
 * a connection of its own, r->rconn.
 */
#include "config.h"

#include <pthread.h>
#include <signal.h>
#include <string.h>
#include <time.h>

#include "redis_internal.h"

#define IDLE_LINGER_MS 250  /* the renewal thread's nap with no lease */
#define RETRY_GAP_MAX_MS 250 /* between renewal attempts after an error */
#define UNDO_MAX 32         /* abandoned acquires waiting to be undone */
#define UNDO_SLICE_MS 50    /* the renewal thread's wait for their replies */
#define UNDO_RETRY_MS 100   /* between two tries while the server is silent */

/* ------------------------------------------------------------------ */
/* The undo queue                                                      */

/* Keeps *cp, if a command of l's wait on it is still unanswered, rather
 * than let kl__redis_conn_replace or kl__redis_conn_put close it: closing would
 * not stop the server from running an attempt once it reads it, nor end the
 * wait's place in the queue (see kl__redis_undo_later). */
void
kl__redis_stash(struct kl__rlease *l, struct kl__rconn **cp)
{
	if (*cp == NULL || !(*cp)->broken || (*cp)->owed == 0 ||
	    l->nstale == KL_R_STALE_MAX)
		return;
	l->stale[l->nstale++] = *cp;
	*cp = NULL;
}

/* Takes l, an acquire that gave up, from its thread.  A server that was
 * stalled runs the attempts it had not answered when it resumes, and one
 * of them may grant the key to l's token, which nobody holds: the key
 * would stay taken for a whole ttl.  Or the token stays queued, and blocks
 * the waiters behind it for its heartbeat.  The renewal thread undoes both
 * as soon as the server answers again (undo_try).  Past UNDO_MAX waiting,
 * l is dropped: such a grant expires with its ttl, such a waiter with its
 * heartbeat. */
static void
undo_queue(struct kl__redis *r, struct kl__rlease *l)
{
	pthread_mutex_lock(&r->mu);
	if (r->nundos < UNDO_MAX && r->thread_started &&
	    r->pid == kl__redis_getpid()) {
		l->undo_next = NULL;
		*r->undo_tail = l;
		r->undo_tail = &l->undo_next;
		r->nundos++;
		pthread_cond_broadcast(&r->cv);
	} else {
		/* Under mu: a released lease may still be the renewal
		 * thread's. */
		kl__redis_lease_unref(l);
	}
	pthread_mutex_unlock(&r->mu);
}

void
kl__redis_undo_later(struct kl__redis *r, struct kl__rlease *l)
{
	if (l->nstale == 0) {
		kl__redis_lease_unref(l);
		return;
	}
	undo_queue(r, l);
}

/* A release that failed because the server did not answer (stopped,
 * unreachable) leaves the key held for up to its ttl, which may be long,
 * after the server is back; a key set that failed would then keep the
 * keys it had taken.  The leave script of undo_try also frees a key that
 * l's token holds, so the renewal thread releases l as soon as the server
 * answers, until its ttl has passed (then the key expired anyway).  The
 * release's unanswered connection is in l->stale: undo_try waits for it
 * in slices, where a new connection to the silent server would hold the
 * thread (renewals, lost callbacks, kl_provider_free) for a timeout. */
void
kl__redis_release_later(struct kl__redis *r, struct kl__rlease *l)
{
	undo_queue(r, l);
}

/* ------------------------------------------------------------------ */
/* The renewal thread                                                  */

/* One compare-and-PEXPIRE: 1 renewed, 0 the key is not ours, -1 the
 * server could not be asked.  Only the renewal thread calls it. */
static int
renew_once(struct kl__redis *r, struct kl__rlease *l, int64_t cap,
	   int64_t *sent_ns)
{
	int64_t deadline;
	char ttl[24];
	const char *args[2] = { l->tok, ttl };
	size_t alens[2] = { strlen(l->tok),
			    kl__redis_num(ttl, sizeof ttl, l->ttl_ms) };
	static const int which[3] = { KL_RK_LOCK, KL_RK_SHARED, KL_RK_SMETA };
	const char *keys[3];
	size_t klens[3];
	redisReply *rep;
	int rc, res;

	kl__rnames_pick(&l->n, which, 3, keys, klens);
	if (r->rconn != NULL && r->rconn->broken) {
		kl__rconn_close(r->rconn);
		r->rconn = NULL;
	}
	/* An answer after the lease ran out would come too late anyway: stop
	 * waiting then, so that its loss is reported at once. */
	if (cap < kl__now_ns() + 10 * KL_R_MS)
		cap = kl__now_ns() + 10 * KL_R_MS;
	if (r->rconn == NULL &&
	    kl__redis_conn_new(r, cap, &r->rconn, NULL) != KL_OK)
		return -1;
	deadline = kl__redis_cmd_deadline(r, KL_R_NO_DEADLINE, 0);
	if (cap < deadline)
		deadline = cap;
	*sent_ns = kl__now_ns();
	rc = kl__rconn_script(r->rconn, deadline, KL_RS_RENEW, 3, keys, klens,
			      2, args, alens, &rep, NULL);
	if (rc != KL_OK)
		return -1;
	res = rep->type == REDIS_REPLY_INTEGER && rep->integer == 1 ? 1 : 0;
	freeReplyObject(rep);
	return res;
}

/* One try at undoing l, an acquire that gave up with attempts unanswered
 * (see kl__redis_undo_later), or a lease whose release went unanswered
 * (kl__redis_release_later).  Once each connection it left has answered all it
 * owed, no attempt of l's is still to run in the server, whatever the
 * order in which the server reads its connections; then the leave script
 * takes l's token out of the queue and frees the key if an attempt granted
 * it.  True when done (or the server refused it: nothing more to try);
 * false while the server does not answer.  Only the renewal thread calls
 * it, without mu: l is off every list meanwhile. */
static bool
undo_try(struct kl__redis *r, struct kl__rlease *l)
{
	struct kl__rconn *c = NULL;
	int i, rc;

	for (i = 0; i < l->nstale; i++) {
		rc = kl__rconn_drain(l->stale[i],
				     kl__now_ns() +
					     UNDO_SLICE_MS * KL_R_MS);
		if (rc == KL_ETIMEDOUT)
			return false;
		if (rc != KL_OK) {
			/* The server closed it, or it broke: nothing more of
			 * it will run. */
			kl__rconn_close(l->stale[i]);
			l->stale[i--] = l->stale[--l->nstale];
		}
	}
	if (l->nstale > 0) {
		c = l->stale[--l->nstale];
	} else {
		/* Every connection the attempts went on is closed: a grant
		 * they made was made by now, and expires a ttl later. */
		if (l->undo_until == 0)
			l->undo_until = kl__redis_deadline(l->ttl_ms);
		if (kl__now_ns() >= l->undo_until)
			return true;
		if (kl__redis_conn_new(
			    r, kl__redis_cmd_deadline(r, KL_R_NO_DEADLINE, 0),
			    &c, NULL) != KL_OK)
			return false;
	}
	rc = kl__redis_leave(
		r, c, l, kl__redis_cmd_deadline(r, KL_R_NO_DEADLINE, 0), NULL);
	if (rc != KL_OK && c->broken) {
		kl__redis_stash(l, &c);
		kl__rconn_close(c);
		return false;
	}
	kl__redis_conn_put(r, c);
	return true;
}

static void
set_abs(struct timespec *ts, int64_t ns)
{
	ts->tv_sec = (time_t)(ns / 1000000000);
	ts->tv_nsec = (long)(ns % 1000000000);
}

/*
 * Loop, mu held except around network I/O and callbacks: mark leases whose
 * validity ran out as lost, deliver one pending lost callback, renew the
 * most urgent lease that is due, else sleep until the next due time.  A
 * lease in use by the thread has a reference, so a release meanwhile
 * cannot free it.
 */
static void *
renewer(void *arg)
{
	struct kl__redis *r = arg;
	bool lingered = false;

	pthread_mutex_lock(&r->mu);
	while (!r->stopping) {
		int64_t now = kl__now_ns(), next = KL_R_NO_DEADLINE;
		struct kl__rlease *l, *due = NULL, *cb = NULL;

		for (l = r->leases; l != NULL; l = l->next) {
			if (!l->lost && now >= l->valid_until)
				l->lost = true;
			if (l->lost) {
				if (l->lost_fn != NULL && !l->notified &&
				    cb == NULL)
					cb = l;
				continue;
			}
			if (due == NULL || l->renew_at < due->renew_at)
				due = l;
			if (l->renew_at < next)
				next = l->renew_at;
			if (l->valid_until < next)
				next = l->valid_until;
		}
		if (cb != NULL) {
			void (*fn)(void *) = cb->lost_fn;
			void *ctx = cb->ctx;

			cb->notified = true;
			cb->in_cb = true;
			cb->cb_thread = pthread_self();
			cb->refs++;
			pthread_mutex_unlock(&r->mu);
			fn(ctx);
			pthread_mutex_lock(&r->mu);
			cb->in_cb = false;
			kl__redis_lease_unref(cb);
			pthread_cond_broadcast(&r->cv);
			continue;
		}
		if (due != NULL && due->renew_at <= now) {
			int64_t sent = 0, gap;
			int res;

			int64_t until = due->valid_until;

			due->refs++;
			pthread_mutex_unlock(&r->mu);
			res = renew_once(r, due, until, &sent);
			pthread_mutex_lock(&r->mu);
			now = kl__now_ns();
			if (!due->released && !due->lost) {
				if (res == 1) {
					due->valid_until =
						sent + due->ttl_ms * KL_R_MS -
						kl__redis_drift_ns(due->ttl_ms);
					due->renew_at = sent + due->ttl_ms *
								KL_R_MS / 3;
				} else if (res == 0 ||
					   now >= due->valid_until) {
					due->lost = true;
				} else {
					/* The server did not answer: try
					 * again soon, while the key lives. */
					gap = due->ttl_ms / 10;
					if (gap > RETRY_GAP_MAX_MS)
						gap = RETRY_GAP_MAX_MS;
					due->renew_at = now + gap * KL_R_MS;
				}
			}
			kl__redis_lease_unref(due);
			continue;
		}
		if (r->undos != NULL && r->undo_at <= now) {
			struct kl__rlease *u = r->undos;
			bool done;

			if ((r->undos = u->undo_next) == NULL)
				r->undo_tail = &r->undos;
			pthread_mutex_unlock(&r->mu);
			done = undo_try(r, u);
			pthread_mutex_lock(&r->mu);
			if (done) {
				r->nundos--;
				kl__redis_lease_unref(u);
			} else {
				u->undo_next = NULL;
				*r->undo_tail = u;
				r->undo_tail = &u->undo_next;
				r->undo_at = kl__now_ns() +
					     UNDO_RETRY_MS * KL_R_MS;
			}
			continue;
		}
		if (r->undos != NULL && r->undo_at < next)
			next = r->undo_at;
		/* With no lease left, sleep a while before sleeping until
		 * signalled: a lease taken meanwhile and due later need not
		 * wake us, which spares a program that takes and releases
		 * locks in a loop a wake-up per acquire. */
		if (next != KL_R_NO_DEADLINE) {
			lingered = false;
		} else if (!lingered) {
			lingered = true;
			next = now + IDLE_LINGER_MS * KL_R_MS;
		}
		r->sleep_until = next;
		if (next == KL_R_NO_DEADLINE) {
			pthread_cond_wait(&r->cv, &r->mu);
		} else {
			struct timespec ts;

			set_abs(&ts, next);
			pthread_cond_timedwait(&r->cv, &r->mu, &ts);
		}
		r->sleep_until = 0;
	}
	pthread_mutex_unlock(&r->mu);
	return NULL;
}

/* Starts the renewal thread with every signal blocked, so that the
 * program's handlers never run on a thread it does not know about. */
int
kl__redis_start_thread(struct kl__redis *r)
{
	sigset_t all, old;
	int rc;

	sigfillset(&all);
	pthread_sigmask(SIG_SETMASK, &all, &old);
	rc = pthread_create(&r->thread, NULL, renewer, r);
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	if (rc != 0)
		return KL_ENOMEM;
	r->thread_started = true;
	return KL_OK;
}
