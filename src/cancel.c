/* SPDX-License-Identifier: MIT */
/*
 * Cancellation tokens.  A token keeps the list of waiters registered on it.
 *
 * Lock order: a token's lock, then a queue's lock.  kl_cancel_fire holds the
 * token lock while it settles each registered waiter under that waiter's
 * queue lock; a waiter registers and unregisters only while holding no queue
 * lock.  Because unregistering needs the token lock, a waiter's node (on its
 * stack) and its queue stay alive for as long as fire may look at them.
 *
 * A token made with kl_cancel_new_timeout fires by itself without a thread:
 * its deadline bounds every wait that uses it (the waiter wakes then and
 * reports KL_ECANCELED) and kl_cancel_fired compares it with the clock.
 */
#include "config.h"

#include <pthread.h>

#include "internal.h"
#include "annotate.h"

struct kl_cancel {
	pthread_mutex_t lock;
	atomic_bool fired;
	int64_t deadline_ns; /* fires by itself then; KL_NO_DEADLINE: never */
	struct kl__waiter *waiters;
};

static int
cancel_make(kl_cancel **out, int64_t deadline_ns)
{
	kl_cancel *c;

	if ((c = kl__calloc(1, sizeof *c)) == NULL)
		return KL_ENOMEM;
	pthread_mutex_init(&c->lock, NULL);
	atomic_init(&c->fired, false);
	KL_ANNOTATE_ATOMIC(&c->fired);
	c->deadline_ns = deadline_ns;
	*out = c;
	return KL_OK;
}

int
kl_cancel_new(kl_cancel **out)
{
	if (out == NULL)
		return KL_EINVAL;
	*out = NULL;
	return cancel_make(out, KL_NO_DEADLINE);
}

int
kl_cancel_new_timeout(kl_cancel **out, int64_t after_ms)
{
	if (out == NULL)
		return KL_EINVAL;
	*out = NULL;
	if (kl__check_timeout(after_ms) != KL_OK)
		return KL_EINVAL;
	/* after_ms 0 gives a deadline of now, which has passed by the time
	 * anyone looks: fired from the start. */
	return cancel_make(out, kl__deadline(after_ms));
}

bool
kl_cancel_fired(const kl_cancel *c)
{
	if (c == NULL)
		return false;
	/* Acquire pairs with the release in kl_cancel_fire so a thread that
	 * sees the flag also sees what the firing thread did before. */
	if (atomic_load_explicit(&c->fired, memory_order_acquire))
		return true;
	return c->deadline_ns != KL_NO_DEADLINE &&
	       kl__now_ns() >= c->deadline_ns;
}

/* Settles a registered waiter as canceled unless it already has an outcome.
 * Called with the token lock held. */
static void
settle(struct kl__waiter *w)
{
	pthread_mutex_lock(w->lock);
	kl__waiter_fail(w, KL_ECANCELED);
	pthread_mutex_unlock(w->lock);
}

void
kl_cancel_fire(kl_cancel *c)
{
	if (c == NULL)
		return;
	KL_YIELD("cancel");
	pthread_mutex_lock(&c->lock);
	if (!atomic_load_explicit(&c->fired, memory_order_relaxed)) {
		atomic_store_explicit(&c->fired, true, memory_order_release);
		for (struct kl__waiter *w = c->waiters; w != NULL; w = w->cnext)
			settle(w);
	}
	pthread_mutex_unlock(&c->lock);
}

void
kl_cancel_free(kl_cancel *c)
{
	if (c == NULL)
		return;
#ifdef KL_DEBUG
	if (c->waiters != NULL)
		fprintf(stderr, "keylock: kl_cancel_free: token still in use\n");
#endif
	pthread_mutex_destroy(&c->lock);
	kl__free(c);
}

int64_t
kl__cancel_deadline(const kl_cancel *c)
{
	return c == NULL ? KL_NO_DEADLINE : c->deadline_ns;
}

bool
kl__cancel_register(kl_cancel *c, struct kl__waiter *w)
{
	bool ok;

	pthread_mutex_lock(&c->lock);
	ok = !kl_cancel_fired(c);
	if (ok) {
		w->cancel = c;
		w->cprev = NULL;
		w->cnext = c->waiters;
		if (c->waiters != NULL)
			c->waiters->cprev = w;
		c->waiters = w;
	}
	pthread_mutex_unlock(&c->lock);
	return ok;
}

void
kl__cancel_unregister(kl_cancel *c, struct kl__waiter *w)
{
	pthread_mutex_lock(&c->lock);
	if (w->cprev != NULL)
		w->cprev->cnext = w->cnext;
	else
		c->waiters = w->cnext;
	if (w->cnext != NULL)
		w->cnext->cprev = w->cprev;
	pthread_mutex_unlock(&c->lock);
	w->cancel = NULL;
}
