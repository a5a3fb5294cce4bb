/* SPDX-License-Identifier: MIT */
/*
 * Cancellation tokens.  A token keeps the list of hooks registered on it
 * (struct kl__cancel_hook, in internal.h): each is a function and its
 * argument, in the registrant's memory.  The token calls them and knows
 * nothing else of what waits on it (waitq.c registers one per waiter).
 *
 * Lock order: a token's lock, then whatever lock a hook takes (a queue's).
 * kl_cancel_fire holds the token lock while it calls each hook; a hook is
 * registered and unregistered only without such a lock held.  Because
 * unregistering needs the token lock, a hook (and what it points to) stays
 * alive for as long as fire may call it.
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
	struct kl__cancel_hook *hooks;
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

void
kl_cancel_fire(kl_cancel *c)
{
	if (c == NULL)
		return;
	KL_YIELD("cancel");
	pthread_mutex_lock(&c->lock);
	if (!atomic_load_explicit(&c->fired, memory_order_relaxed)) {
		atomic_store_explicit(&c->fired, true, memory_order_release);
		/* A hook never unregisters itself (that needs this lock), so
		 * the list stays as it is while it runs. */
		for (struct kl__cancel_hook *h = c->hooks; h != NULL;
		     h = h->next)
			h->fire(h->arg);
	}
	pthread_mutex_unlock(&c->lock);
}

void
kl_cancel_free(kl_cancel *c)
{
	if (c == NULL)
		return;
#ifdef KL_DEBUG
	if (c->hooks != NULL)
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
kl__cancel_register(kl_cancel *c, struct kl__cancel_hook *h)
{
	bool ok;

	pthread_mutex_lock(&c->lock);
	ok = !kl_cancel_fired(c);
	if (ok) {
		h->prev = NULL;
		h->next = c->hooks;
		if (c->hooks != NULL)
			c->hooks->prev = h;
		c->hooks = h;
	}
	pthread_mutex_unlock(&c->lock);
	return ok;
}

void
kl__cancel_unregister(kl_cancel *c, struct kl__cancel_hook *h)
{
	pthread_mutex_lock(&c->lock);
	if (h->prev != NULL)
		h->prev->next = h->next;
	else
		c->hooks = h->next;
	if (h->next != NULL)
		h->next->prev = h->prev;
	pthread_mutex_unlock(&c->lock);
}
