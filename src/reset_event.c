/* SPDX-License-Identifier: MIT */
/*
 * kl_reset_event (ResetEvent), over a wait queue.  e->lock guards the struct.
 *
 * With auto_reset_count N, the event carries a budget while signaled: each
 * release (a queued waiter woken by set, or a wait that finds the event
 * signaled) spends one, and the event becomes non-signaled when the budget
 * reaches 0.  A manual-reset event (N = KL_UNBOUNDED) has no budget.
 */
#include "config.h"

#include "internal.h"

struct kl_reset_event {
	pthread_mutex_t lock;
	struct kl__waitq q;
	bool signaled;
	size_t budget;
	kl_reset_opts opts;
};

static bool
is_manual(const kl_reset_event *e)
{
	return e->opts.auto_reset_count == KL_UNBOUNDED;
}

int
kl_reset_event_new(kl_reset_event **out, bool signaled,
		   const kl_reset_opts *opts)
{
	static const kl_reset_opts def = KL_RESET_OPTS_INIT;
	kl_reset_event *e;

	if (out == NULL)
		return KL_EINVAL;
	*out = NULL;
	if (opts == NULL)
		opts = &def;
	if (!kl__overflow_valid(opts->overflow) || opts->auto_reset_count == 0)
		return KL_EINVAL;
	if ((e = kl__calloc(1, sizeof *e)) == NULL)
		return KL_ENOMEM;
	pthread_mutex_init(&e->lock, NULL);
	kl__waitq_init(&e->q, &e->lock);
	e->opts = *opts;
	e->signaled = signaled;
	e->budget = signaled ? opts->auto_reset_count : 0;
	*out = e;
	return KL_OK;
}

void
kl_reset_event_free(kl_reset_event *e)
{
	if (e == NULL)
		return;
#ifdef KL_DEBUG
	if (e->q.len != 0)
		fprintf(stderr, "keylock: kl_reset_event_free: has waiters\n");
#endif
	pthread_mutex_destroy(&e->lock);
	kl__free(e);
}

/* One release while signaled.  Lock held. */
static void
spend(kl_reset_event *e)
{
	if (!is_manual(e) && --e->budget == 0)
		e->signaled = false;
}

int
kl_reset_event_wait(kl_reset_event *e, int64_t timeout_ms, kl_cancel *c)
{
	struct kl__waiter w;
	int64_t deadline;
	int rc;

	if (e == NULL || kl__check_timeout(timeout_ms) != KL_OK)
		return KL_EINVAL;
	if (kl_cancel_fired(c))
		return KL_ECANCELED;
	deadline = kl__deadline(timeout_ms);

	pthread_mutex_lock(&e->lock);
	if (e->signaled) {
		spend(e);
		pthread_mutex_unlock(&e->lock);
		return KL_OK;
	}
	if (timeout_ms == 0) {
		pthread_mutex_unlock(&e->lock);
		return KL_ETIMEDOUT;
	}
	if (c != NULL) {
		/* Token lock before ours: register unlocked, look again. */
		pthread_mutex_unlock(&e->lock);
		if ((rc = kl__waiter_prepare(&w, &e->lock, c)) != KL_OK)
			return rc;
		pthread_mutex_lock(&e->lock);
		/* A fire since registering settled it: no release now. */
		if (w.state == KL_W_DONE) {
			pthread_mutex_unlock(&e->lock);
			kl__waiter_finish(&w);
			return w.status;
		}
		if (e->signaled) {
			spend(e);
			pthread_mutex_unlock(&e->lock);
			kl__waiter_finish(&w);
			return KL_OK;
		}
	} else {
		kl__waiter_prepare(&w, &e->lock, NULL);
	}
	rc = kl__waitq_wait(&e->q, &w, deadline, e->opts.max_queue,
			    e->opts.overflow);
	kl__waiter_finish(&w);
	return rc;
}

void
kl_reset_event_set(kl_reset_event *e)
{
	if (e == NULL)
		return;
	pthread_mutex_lock(&e->lock);
	if (!e->signaled) {
		e->signaled = true;
		e->budget = e->opts.auto_reset_count;
		struct kl__waiter *w;

		while (e->signaled && (w = kl__waitq_grant_head(&e->q))) {
			kl__unpark(kl__waiter_settle(w));
			spend(e);
		}
	}
	pthread_mutex_unlock(&e->lock);
}

void
kl_reset_event_reset(kl_reset_event *e)
{
	if (e == NULL)
		return;
	pthread_mutex_lock(&e->lock);
	e->signaled = false;
	e->budget = 0;
	pthread_mutex_unlock(&e->lock);
}

bool
kl_reset_event_is_signaled(kl_reset_event *e)
{
	bool s;

	if (e == NULL)
		return false;
	pthread_mutex_lock(&e->lock);
	s = e->signaled;
	pthread_mutex_unlock(&e->lock);
	return s;
}

size_t
kl_reset_event_queue_size(kl_reset_event *e)
{
	size_t n;

	if (e == NULL)
		return 0;
	pthread_mutex_lock(&e->lock);
	n = e->q.len;
	pthread_mutex_unlock(&e->lock);
	return n;
}
