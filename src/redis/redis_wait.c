/* SPDX-License-Identifier: MIT */
/*
 * Acquiring with the Redis provider: the attempt script, the wait in the
 * key's queue, leaving the queue when a wait ends without the key, and the
 * release script.  A waiter blocks on its own connection in BLPOP on its
 * wake list, in slices, and tries again when woken or every recheck
 * interval; it keeps that connection for its whole wait.  A connection
 * left with a command unanswered is kept for the undo queue
 * (redis_renew.c) rather than closed.  No lock is held here but r->mu,
 * briefly, for the ttl figures.
 */
#include "config.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "redis_internal.h"

#define WAKE_SLICE_MS 50    /* longest BLPOP: bounds the cancel latency */
#define RECHECK_MAX_MS 250  /* longest time between two attempts */
#define RECHECK_MIN_MS 25
#define MAX_RECONNECTS 2    /* consecutive, within one wait */
#define LEAVE_MIN_MS 10     /* the least time a leave gets after a wait */

/* One attempt; queued when the caller may have joined the queue before
 * (the script then also clears its heartbeat and wake list on a fast-path
 * grant).  *granted and *fence on KL_OK; *sent_ns is when it was sent (a
 * grant's ttl runs from no earlier than that). */
static int
attempt(struct kl__redis *r, struct kl__rconn *c, struct kl__rlease *l,
	bool try_only, bool queued, int64_t deadline, bool *granted,
	uint64_t *fence, int64_t *sent_ns, kl_error *err)
{
	char ttl[24], hb[24], keep[24], guard[24];
	const char *keys[9] = { l->n.k[KL_RK_LOCK],   l->n.k[KL_RK_QUEUE],
				l->n.k[KL_RK_HB],     l->n.k[KL_RK_FENCE],
				l->n.k[KL_RK_WAKE],   r->gkey[0],
				r->gkey[1],	      l->n.k[KL_RK_SHARED],
				l->n.k[KL_RK_SMETA] };
	size_t klens[9] = { l->n.len[KL_RK_LOCK],   l->n.len[KL_RK_QUEUE],
			    l->n.len[KL_RK_HB],     l->n.len[KL_RK_FENCE],
			    l->n.len[KL_RK_WAKE],   r->gkey_len[0],
			    r->gkey_len[1],	    l->n.len[KL_RK_SHARED],
			    l->n.len[KL_RK_SMETA] };
	const char *args[8];
	size_t alens[8];
	redisReply *rep, *e0, *e1;
	int64_t need;
	bool use_rec, refresh;
	int rc;

	*granted = false;
	kl__redis_guard_need(r, l->ttl_ms, &need, &use_rec, &refresh);
	args[0] = l->tok;
	alens[0] = strlen(l->tok);
	args[1] = ttl;
	alens[1] = kl__redis_num(ttl, sizeof ttl, l->ttl_ms);
	args[2] = hb;
	alens[2] = kl__redis_num(hb, sizeof hb, r->conf.heartbeat_ms);
	args[3] = try_only ? "try" : queued ? "wait" : "join";
	alens[3] = strlen(args[3]);
	args[4] = keep;
	alens[4] = kl__redis_num(keep, sizeof keep, KL_R_FENCE_KEEP_MS);
	args[5] = guard;
	alens[5] = kl__redis_num(guard, sizeof guard, need);
	args[6] = use_rec ? "1" : "0";
	alens[6] = 1;
	args[7] = refresh ? "1" : "0";
	alens[7] = 1;
	*sent_ns = kl__now_ns();
	rc = kl__rconn_script(c, deadline, KL_RS_ATTEMPT, 9, keys, klens, 8,
			      args, alens, &rep, err);
	if (rc != KL_OK)
		return rc;
	if (rep->type != REDIS_REPLY_ARRAY || rep->elements < 3 ||
	    rep->element[0]->type != REDIS_REPLY_INTEGER ||
	    rep->element[2]->type != REDIS_REPLY_INTEGER) {
		freeReplyObject(rep);
		kl__error_set(err, KL_EPROVIDER,
				"redis provider: unexpected reply to an "
				"attempt");
		return KL_EPROVIDER;
	}
	e0 = rep->element[0];
	e1 = rep->element[1];
	pthread_mutex_lock(&r->mu);
	if (rep->element[2]->integer > r->seen_ttl_ms)
		r->seen_ttl_ms = rep->element[2]->integer;
	pthread_mutex_unlock(&r->mu);
	l->guard_left_ms = 0;
	if (e0->integer == 1) {
		*granted = true;
		if (e1->type == REDIS_REPLY_STRING)
			*fence = strtoull(e1->str, NULL, 10);
		else if (e1->type == REDIS_REPLY_INTEGER)
			*fence = (uint64_t)e1->integer;
	} else if (rep->elements > 3 &&
		   rep->element[3]->type == REDIS_REPLY_INTEGER) {
		l->guard_left_ms = rep->element[3]->integer;
	}
	freeReplyObject(rep);
	return KL_OK;
}

/* The leave script: out of the queue, and the key passed on if it came to
 * us in a race. */
int
kl__redis_leave(struct kl__redis *r, struct kl__rconn *c, struct kl__rlease *l,
		int64_t deadline, kl_error *err)
{
	static const int which[6] = { KL_RK_LOCK, KL_RK_QUEUE, KL_RK_HB,
				      KL_RK_WAKE, KL_RK_SHARED, KL_RK_SMETA };
	const char *keys[6];
	size_t klens[6];
	char hb[24];
	const char *args[2] = { l->tok, hb };
	size_t alens[2] = { strlen(l->tok),
			    kl__redis_num(hb, sizeof hb,
					  r->conf.heartbeat_ms) };
	redisReply *rep;
	int rc;

	kl__rnames_pick(&l->n, which, 6, keys, klens);
	rc = kl__rconn_script(c, deadline, KL_RS_LEAVE, 6, keys, klens, 2,
			      args, alens, &rep, err);
	if (rc == KL_OK)
		freeReplyObject(rep);
	return rc;
}

/* Leaves after a failed or abandoned wait, when the connection still
 * works, by end (the wait's deadline plus grace) if it can: a wait ends
 * within its grace.  A leave that times out, like an attempt left
 * unanswered, is left to the renewal thread (kl__redis_undo_later); when the
 * server cannot be asked at all, the queue entry expires with its heartbeat. */
void
kl__redis_leave_anyway(struct kl__redis *r, struct kl__rconn *c,
		       struct kl__rlease *l, int64_t end)
{
	int64_t d, least = kl__now_ns() + LEAVE_MIN_MS * KL_R_MS;

	if (c == NULL || c->broken)
		return;
	d = kl__redis_cmd_deadline(r, kl__now_ns(), 0);
	if (end < d && least < d)
		d = end > least ? end : least;
	kl__redis_leave(r, c, l, d, NULL);
}

/* Compare-and-delete with l's token, retried once on a new connection.
 * *released tells whether the key was still ours.  A connection on which
 * the script went unanswered is kept in l (kl__redis_stash), so that the
 * renewal thread can wait for its answer in short slices rather than in a
 * new connection's whole timeout (kl__redis_release_later). */
int
kl__redis_release_key(struct kl__redis *r, struct kl__rlease *l, bool *released,
		      kl_error *err)
{
	char hb[24];
	const char *args[2] = { l->tok, hb };
	size_t alens[2] = { strlen(l->tok),
			    kl__redis_num(hb, sizeof hb,
					  r->conf.heartbeat_ms) };
	static const int which[5] = { KL_RK_LOCK, KL_RK_QUEUE, KL_RK_HB,
				      KL_RK_SHARED, KL_RK_SMETA };
	const char *keys[5];
	size_t klens[5];
	struct kl__rconn *c = NULL;
	redisReply *rep = NULL;
	int rc, tries = 0;

	*released = false;
	kl__rnames_pick(&l->n, which, 5, keys, klens);
	rc = kl__redis_conn_get(r, KL_R_NO_DEADLINE, &c, err);
	while (rc == KL_OK) {
		rc = kl__rconn_script(
			c, kl__redis_cmd_deadline(r, KL_R_NO_DEADLINE, 0),
			KL_RS_RELEASE, 5, keys, klens, 2, args, alens, &rep,
			err);
		if (rc == KL_OK || !c->broken || ++tries > 1)
			break;
		kl__redis_stash(l, &c);
		rc = kl__redis_conn_replace(r, &c, KL_R_NO_DEADLINE, err);
	}
	if (rc == KL_OK) {
		*released = rep->type == REDIS_REPLY_INTEGER &&
			    rep->integer == 1;
		freeReplyObject(rep);
	}
	kl__redis_stash(l, &c);
	kl__redis_conn_put(r, c);
	return rc;
}

/* BLPOP on the own wake list for slice_ms.  *woke when something came. */
static int
block(struct kl__redis *r, struct kl__rconn *c, struct kl__rlease *l,
      int64_t slice_ms, int64_t wait_deadline, bool *woke, kl_error *err)
{
	char secs[32];
	const char *argv[3] = { "BLPOP", l->n.k[KL_RK_WAKE], secs };
	size_t lens[3] = { 5, l->n.len[KL_RK_WAKE], 0 };
	redisReply *rep;
	int rc;

	*woke = false;
	lens[2] = (size_t)snprintf(secs, sizeof secs, "%" PRId64 ".%03" PRId64,
				   slice_ms / 1000, slice_ms % 1000);
	rc = kl__rconn_command(
		c, kl__redis_cmd_deadline(r, wait_deadline, slice_ms * KL_R_MS),
		3, argv, lens, &rep, err);
	if (rc != KL_OK)
		return rc;
	if (rep->type == REDIS_REPLY_ERROR) {
		kl__error_set(err, KL_EPROVIDER,
				"redis provider: BLPOP failed: %.160s",
				rep->str);
		rc = KL_EPROVIDER;
	}
	*woke = rep->type == REDIS_REPLY_ARRAY;
	freeReplyObject(rep);
	return rc;
}

/* After a broken connection in a wait: a new one to the same server run.
 * A restart lost the queue and maybe locks: the wait ends. */
static int
reconnect_in_wait(struct kl__redis *r, struct kl__rconn **cp, uint64_t epoch,
		  int64_t deadline, int *reconnects, kl_error *err)
{
	int64_t now = kl__now_ns();
	int rc;

	/* err already says why the last command failed.  Past the deadline
	 * the server did not answer in time: that is its failure, not a
	 * timeout of the wait. */
	if (++*reconnects > MAX_RECONNECTS || now >= deadline)
		return KL_EPROVIDER;
	rc = kl__redis_conn_replace(
		r, cp,
		deadline == KL_R_NO_DEADLINE
			? KL_R_NO_DEADLINE
			: deadline + KL_R_GRACE_MS * KL_R_MS,
		err);
	if (rc != KL_OK)
		return rc;
	if ((*cp)->epoch != epoch) {
		kl__error_set(err, KL_EPROVIDER,
				"redis provider: the server restarted during "
				"the wait (its run_id changed); its queue and "
				"locks may be lost");
		return KL_EPROVIDER;
	}
	return KL_OK;
}

/* Waits in the queue until granted (KL_OK), the deadline (KL_ETIMEDOUT),
 * the cancel token (KL_ECANCELED) or a server failure (KL_EPROVIDER). */
int
kl__redis_wait_queued(struct kl__redis *r, struct kl__rconn **cp,
		      struct kl__rlease *l, kl_cancel *cancel, int64_t deadline,
		      uint64_t *fence, int64_t *sent_ns, kl_error *err)
{
	int64_t recheck = r->conf.heartbeat_ms / 4, next_check, now, slice;
	uint64_t epoch = (*cp)->epoch;
	int reconnects = 0, rc;
	bool woke, granted;

	if (recheck > RECHECK_MAX_MS)
		recheck = RECHECK_MAX_MS;
	if (recheck < RECHECK_MIN_MS)
		recheck = RECHECK_MIN_MS;
	next_check = kl__now_ns() + recheck * KL_R_MS;
	for (;;) {
		if (kl_cancel_fired(cancel))
			return KL_ECANCELED;
		now = kl__now_ns();
		if (now >= deadline)
			return KL_ETIMEDOUT;
		/* Rounded up: never a busy loop of zero-length BLPOPs. */
		slice = WAKE_SLICE_MS;
		if (deadline != KL_R_NO_DEADLINE &&
		    (deadline - now + KL_R_MS - 1) / KL_R_MS < slice)
			slice = (deadline - now + KL_R_MS - 1) / KL_R_MS;
		if ((next_check - now + KL_R_MS - 1) / KL_R_MS < slice)
			slice = (next_check - now + KL_R_MS - 1) / KL_R_MS;
		woke = false;
		if (slice > 0) {
			rc = block(r, *cp, l, slice, deadline, &woke, err);
			if (rc != KL_OK && !(*cp)->broken)
				return rc;
			if (rc != KL_OK) {
				/* The token stays queued, and live, until the
				 * leave at the end: kept for
				 * kl__redis_undo_later. */
				kl__redis_stash(l, cp);
				rc = reconnect_in_wait(r, cp, epoch,
						       deadline, &reconnects,
						       err);
				if (rc != KL_OK)
					return rc;
				next_check = 0; /* try again at once */
				continue;
			}
		}
		now = kl__now_ns();
		if (!woke && now < next_check)
			continue;
		rc = attempt(r, *cp, l, false, true,
			     kl__redis_cmd_deadline(r, deadline, 0), &granted,
			     fence, sent_ns, err);
		if (rc != KL_OK && !(*cp)->broken)
			return rc;
		if (rc != KL_OK) {
			kl__redis_stash(l, cp);
			rc = reconnect_in_wait(r, cp, epoch, deadline,
					       &reconnects, err);
			if (rc != KL_OK)
				return rc;
			next_check = 0;
			continue;
		}
		reconnects = 0;
		if (granted)
			return KL_OK;
		next_check = kl__now_ns() + recheck * KL_R_MS;
	}
}

/* The first attempt: the restart guard, then the script; a pooled
 * connection found dead is replaced once. */
int
kl__redis_first_attempt(struct kl__redis *r, struct kl__rconn **cp,
			struct kl__rlease *l, bool try_only, int64_t deadline,
			bool *granted, uint64_t *fence, int64_t *sent_ns,
			kl_error *err)
{
	int rc, tries = 0;

	for (;;) {
		rc = attempt(r, *cp, l, try_only, tries > 0,
			     try_only ? kl__redis_cmd_deadline(
						r, KL_R_NO_DEADLINE, 0)
				      : kl__redis_cmd_deadline(r, deadline, 0),
			     granted, fence, sent_ns, err);
		if (rc == KL_OK || !(*cp)->broken || ++tries > 1)
			return rc;
		kl__redis_stash(l, cp);
		/* Past its deadline the server did not answer in time: a new
		 * connection would only take the wait further past it. */
		if (!try_only && kl__now_ns() >= deadline)
			return rc;
		rc = kl__redis_conn_replace(
			r, cp,
			try_only || deadline == KL_R_NO_DEADLINE
				? KL_R_NO_DEADLINE
				: deadline + KL_R_GRACE_MS * KL_R_MS,
			err);
		if (rc != KL_OK)
			return rc;
	}
}
