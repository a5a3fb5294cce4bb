/* SPDX-License-Identifier: MIT */
/*
 * kl_mutex (AsyncLock): one lock owned by a token, over a wait queue.
 *
 * m->lock guards everything in the struct.  The owner is the id of the
 * holding token (0: free).  Leaving hands the mutex straight to the head
 * waiter by writing its token id into m->owner before the waiter wakes, so
 * a newcomer can never take a mutex that has waiters (no barging), and
 * try_enter fails whenever anyone waits.
 */
#include "config.h"

#include <string.h>

#include "internal.h"

struct kl_mutex {
	pthread_mutex_t lock;
	struct kl__waitq q;
	uint64_t owner;
	pthread_t owner_thread;
	kl_queue_opts opts;
};

static pthread_mutex_t defaults_lock = PTHREAD_MUTEX_INITIALIZER;
static kl_queue_opts defaults = KL_QUEUE_OPTS_INIT;

#define KNOWN_FLAGS KL_ERRORCHECK

static bool
opts_valid(const kl_queue_opts *o)
{
	return kl__overflow_valid(o->overflow) && (o->flags & ~KNOWN_FLAGS) == 0;
}

void
kl_queue_opts_default(kl_queue_opts *out)
{
	if (out == NULL)
		return;
	pthread_mutex_lock(&defaults_lock);
	*out = defaults;
	pthread_mutex_unlock(&defaults_lock);
}

void
kl_queue_opts_set_default(const kl_queue_opts *in)
{
	if (in == NULL || !opts_valid(in))
		return;
	pthread_mutex_lock(&defaults_lock);
	defaults = *in;
	pthread_mutex_unlock(&defaults_lock);
}

int
kl_mutex_new(kl_mutex **out, const kl_queue_opts *opts)
{
	kl_mutex *m;
	kl_queue_opts o;

	if (out == NULL)
		return KL_EINVAL;
	*out = NULL;
	if (opts == NULL)
		kl_queue_opts_default(&o);
	else
		o = *opts;
	if (!opts_valid(&o))
		return KL_EINVAL;
	if ((m = kl__calloc(1, sizeof *m)) == NULL)
		return KL_ENOMEM;
	pthread_mutex_init(&m->lock, NULL);
	kl__waitq_init(&m->q, &m->lock);
	m->opts = o;
	*out = m;
	return KL_OK;
}

void
kl_mutex_free(kl_mutex *m)
{
	if (m == NULL)
		return;
#ifdef KL_DEBUG
	if (m->owner != 0 || m->q.len != 0)
		fprintf(stderr, "keylock: kl_mutex_free: mutex %s\n",
			m->q.len != 0 ? "has waiters" : "is held");
#endif
	pthread_mutex_destroy(&m->lock);
	kl__free(m);
}

/* Takes a free mutex that nobody waits for.  Lock held. */
static int
take(kl_mutex *m, uint64_t id, pthread_t self)
{
	if (m->owner == 0 && m->q.len == 0) {
		m->owner = id;
		m->owner_thread = self;
		return KL_OK;
	}
	if ((m->opts.flags & KL_ERRORCHECK) && m->owner != 0 &&
	    pthread_equal(m->owner_thread, self))
		return KL_EDEADLK;
	return KL_ETIMEDOUT;
}

int
kl_mutex_enter(kl_mutex *m, int64_t timeout_ms, kl_cancel *c, kl_token *out)
{
	struct kl__waiter w;
	pthread_t self = pthread_self();
	int64_t deadline;
	uint64_t id;
	int rc;

	if (out != NULL)
		memset(out, 0, sizeof *out);
	if (m == NULL || out == NULL || kl__check_timeout(timeout_ms) != KL_OK)
		return KL_EINVAL;
	if (kl_cancel_fired(c))
		return KL_ECANCELED;
	id = kl__next_id();
	out->start_ns = kl__now_ns();
	deadline = kl__deadline(timeout_ms);

	pthread_mutex_lock(&m->lock);
	rc = take(m, id, self);
	if (rc != KL_ETIMEDOUT || timeout_ms == 0) {
		pthread_mutex_unlock(&m->lock);
		goto done;
	}
	if (c != NULL) {
		/* The token's lock comes before ours: register unlocked,
		 * then look again, since the holder may have left. */
		pthread_mutex_unlock(&m->lock);
		if ((rc = kl__waiter_prepare(&w, &m->lock, c)) != KL_OK)
			goto done;
		pthread_mutex_lock(&m->lock);
		rc = take(m, id, self);
		if (rc != KL_ETIMEDOUT)
			goto unlock_finish;
	} else {
		kl__waiter_prepare(&w, &m->lock, NULL);
	}
	w.data = id;
	rc = kl__waitq_wait(&m->q, &w, deadline, m->opts.max_queue,
			    m->opts.overflow);
unlock_finish:
	pthread_mutex_unlock(&m->lock);
	kl__waiter_finish(&w);
done:
	if (rc == KL_OK)
		out->id = id;
	else
		memset(out, 0, sizeof *out);
	return rc;
}

int
kl_mutex_try_enter(kl_mutex *m, kl_token *out)
{
	return kl_mutex_enter(m, 0, NULL, out);
}

int
kl_mutex_leave(kl_mutex *m, kl_token t, bool abort_pending)
{
	struct kl__waiter *w;

	if (m == NULL || t.id == 0)
		return KL_EINVAL;
	pthread_mutex_lock(&m->lock);
	if (m->owner != t.id) {
		pthread_mutex_unlock(&m->lock);
		return KL_EINVAL;
	}
	if (abort_pending)
		kl__waitq_fail_all(&m->q, KL_ECANCELED);
	if ((w = kl__waitq_grant_head(&m->q)) != NULL) {
		m->owner = w->data;
		m->owner_thread = w->self;
	} else {
		m->owner = 0;
	}
	pthread_mutex_unlock(&m->lock);
	return KL_OK;
}

int
kl_mutex_run(kl_mutex *m, int64_t timeout_ms, kl_cancel *c,
	     int (*fn)(void *arg), void *arg, int *fn_result)
{
	kl_token t;
	int rc, r;

	if (fn == NULL)
		return KL_EINVAL;
	if ((rc = kl_mutex_enter(m, timeout_ms, c, &t)) != KL_OK)
		return rc;
	r = fn(arg);
	if (fn_result != NULL)
		*fn_result = r;
	kl_mutex_leave(m, t, false);
	return KL_OK;
}

bool
kl_mutex_is_locked(kl_mutex *m)
{
	bool locked;

	if (m == NULL)
		return false;
	pthread_mutex_lock(&m->lock);
	locked = m->owner != 0;
	pthread_mutex_unlock(&m->lock);
	return locked;
}

size_t
kl_mutex_queue_size(kl_mutex *m)
{
	size_t n;

	if (m == NULL)
		return 0;
	pthread_mutex_lock(&m->lock);
	n = m->q.len;
	pthread_mutex_unlock(&m->lock);
	return n;
}

int
kl_mutex_set_opts(kl_mutex *m, const kl_queue_opts *opts)
{
	if (m == NULL || opts == NULL || !opts_valid(opts))
		return KL_EINVAL;
	pthread_mutex_lock(&m->lock);
	m->opts = *opts;
	kl__waitq_reduce(&m->q, opts->max_queue, opts->overflow);
	pthread_mutex_unlock(&m->lock);
	return KL_OK;
}

int
kl_mutex_get_opts(kl_mutex *m, kl_queue_opts *out)
{
	if (m == NULL || out == NULL)
		return KL_EINVAL;
	pthread_mutex_lock(&m->lock);
	*out = m->opts;
	pthread_mutex_unlock(&m->lock);
	return KL_OK;
}

int64_t
kl_token_elapsed_ms(kl_token t)
{
	int64_t d;

	if (t.id == 0)
		return 0;
	d = kl__now_ns() - t.start_ns;
	return d < 0 ? 0 : d / 1000000;
}
