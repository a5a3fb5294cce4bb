/* SPDX-License-Identifier: MIT */
/*
 * The wait queue: a FIFO of parked threads, each on its own stack with its
 * own condvar, woken one at a time by direct hand-off.
 *
 * Invariants (all under q->lock):
 * - a waiter is in the list exactly when its state is KL_W_WAITING, and
 *   q->len counts the list;
 * - a waiter's state leaves WAITING once, to GRANTED or DONE, and the thread
 *   that moves it also unlinks it and signals its condvar;
 * - only the waiting thread reads its final state, after re-taking the lock,
 *   so whoever settles first (granter, timer, canceller, evictor) decides
 *   the outcome and the others see a final state and do nothing.
 * Because a grant goes only to a WAITING waiter and the waiter honours any
 * grant it finds, a grant is never lost: a waiter that timed out first is
 * already unlinked and the grant goes to the next one.
 */
#include "config.h"

#include <errno.h>
#include <time.h>

#include "internal.h"

void
kl__waitq_init(struct kl__waitq *q, pthread_mutex_t *lock)
{
	q->lock = lock;
	q->head = q->tail = NULL;
	q->len = 0;
}

bool
kl__overflow_valid(kl_overflow o)
{
	return o == KL_OVERFLOW_THIS || o == KL_OVERFLOW_FIRST ||
	       o == KL_OVERFLOW_LAST;
}

static void
unlink_waiter(struct kl__waitq *q, struct kl__waiter *w)
{
	if (w->prev != NULL)
		w->prev->next = w->next;
	else
		q->head = w->next;
	if (w->next != NULL)
		w->next->prev = w->prev;
	else
		q->tail = w->prev;
	w->next = w->prev = NULL;
	q->len--;
}

void
kl__waiter_fail(struct kl__waiter *w, int status)
{
	if (w->state == KL_W_WAITING) {
		unlink_waiter(w->q, w);
		pthread_cond_signal(&w->cond);
	} else if (w->state != KL_W_INIT) {
		return;
	}
	w->state = KL_W_DONE;
	w->status = status;
}

int
kl__waiter_prepare(struct kl__waiter *w, pthread_mutex_t *lock,
		   struct kl_cancel *c)
{
	w->next = w->prev = NULL;
	w->q = NULL;
	w->lock = lock;
	w->state = KL_W_INIT;
	w->status = KL_OK;
	w->cancel = NULL;
	w->cnext = w->cprev = NULL;
	w->self = pthread_self();
	w->data = 0;
	w->expire_ns = KL_NO_DEADLINE;
	if (c != NULL && !kl__cancel_register(c, w))
		return KL_ECANCELED;
	pthread_cond_init(&w->cond, kl__condattr());
	return KL_OK;
}

void
kl__waiter_finish(struct kl__waiter *w)
{
	if (w->cancel != NULL)
		kl__cancel_unregister(w->cancel, w);
	pthread_cond_destroy(&w->cond);
}

static void
append(struct kl__waitq *q, struct kl__waiter *w)
{
	w->q = q;
	w->next = NULL;
	w->prev = q->tail;
	if (q->tail != NULL)
		q->tail->next = w;
	else
		q->head = w;
	q->tail = w;
	q->len++;
	w->state = KL_W_WAITING;
}

/* The status for a waiter whose expiry has come: its cancel token's deadline
 * makes it a cancel, its own a timeout. */
static int
expiry_status(const struct kl__waiter *w, int64_t now)
{
	return now >= kl__cancel_deadline(w->cancel) ? KL_ECANCELED
						     : KL_ETIMEDOUT;
}

int
kl__waitq_wait(struct kl__waitq *q, struct kl__waiter *w,
	       int64_t deadline_ns, size_t max_queue, kl_overflow overflow)
{
	int oldstate, rc;
	struct timespec ts;

	if (w->state == KL_W_DONE) /* canceled before it could queue */
		return w->status;
	if (q->len >= max_queue) {
		if (max_queue == 0 || overflow == KL_OVERFLOW_THIS)
			return KL_EOVERFLOW;
		kl__waiter_fail(overflow == KL_OVERFLOW_FIRST ? q->head
							      : q->tail,
				KL_EOVERFLOW);
	}
	w->expire_ns = kl__cancel_deadline(w->cancel);
	if (deadline_ns < w->expire_ns)
		w->expire_ns = deadline_ns;
	append(q, w);

	/* A waiter is not a cancellation point: being cancelled inside
	 * pthread_cond_wait would leave the node linked on a dead stack. */
	pthread_setcancelstate(PTHREAD_CANCEL_DISABLE, &oldstate);
	if (w->expire_ns != KL_NO_DEADLINE) {
		ts.tv_sec = (time_t)(w->expire_ns / 1000000000);
		ts.tv_nsec = (long)(w->expire_ns % 1000000000);
	}
	while (w->state == KL_W_WAITING) {
		if (w->expire_ns == KL_NO_DEADLINE) {
			pthread_cond_wait(&w->cond, q->lock);
			continue;
		}
		rc = pthread_cond_timedwait(&w->cond, q->lock, &ts);
		if (rc == ETIMEDOUT && w->state == KL_W_WAITING) {
			/* Never early: trust the clock, not the return. */
			int64_t now = kl__now_ns();

			if (now >= w->expire_ns)
				kl__waiter_fail(w, expiry_status(w, now));
		}
	}
	pthread_setcancelstate(oldstate, NULL);
	return w->state == KL_W_GRANTED ? KL_OK : w->status;
}

struct kl__waiter *
kl__waitq_grant_head(struct kl__waitq *q)
{
	struct kl__waiter *w;
	int64_t now = 0;

	while ((w = q->head) != NULL) {
		/* A waiter whose deadline has passed but which has not yet
		 * woken does not get the lock: a token that fired by itself
		 * must not be granted afterwards. */
		if (w->expire_ns != KL_NO_DEADLINE) {
			if (now == 0)
				now = kl__now_ns();
			if (now >= w->expire_ns) {
				kl__waiter_fail(w, expiry_status(w, now));
				continue;
			}
		}
		unlink_waiter(q, w);
		w->state = KL_W_GRANTED;
		pthread_cond_signal(&w->cond);
		return w;
	}
	return NULL;
}

void
kl__waitq_fail_all(struct kl__waitq *q, int status)
{
	while (q->head != NULL)
		kl__waiter_fail(q->head, status);
}

void
kl__waitq_reduce(struct kl__waitq *q, size_t max_queue, kl_overflow overflow)
{
	while (q->len > max_queue)
		kl__waiter_fail(overflow == KL_OVERFLOW_FIRST ? q->head
							      : q->tail,
				KL_EOVERFLOW);
}
