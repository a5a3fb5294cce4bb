/* SPDX-License-Identifier: MIT */
/*
 * kl_mutex (AsyncLock): one lock owned by a token, over a wait queue.
 *
 * m->state holds the owner's token id shifted left by two (0: free) and, in
 * bit 0, "someone may be queued" (bit 1 is for KL_EVENTUAL, below).
 * Without that bit, enter and leave are one compare-and-swap each and
 * never touch m->lock.  A thread that must queue
 * sets the bit under m->lock before it queues, so a holder that leaves
 * afterwards fails its fast-path CAS and takes the slow path, where it hands
 * the mutex straight to the head waiter by writing that waiter's id into
 * m->state.  The state is therefore never 0 while anyone waits: a newcomer
 * cannot barge, and try_enter fails whenever anyone waits.  A stale bit (its
 * waiters timed out) only sends one leave down the slow path, which clears
 * it.
 *
 * With KL_EVENTUAL a leave may release instead of handing over: the head
 * waiter is woken to compete (KL__RETRY), so a running thread may take the
 * mutex first (barging) and the lock changes owner without a sleep and a
 * wake-up in between.  While a woken waiter is on its way (WOKEN), leaves
 * wake nobody else and stay on the fast path; the woken waiter clears the
 * bit in the same CAS that takes the mutex or marks it QUEUED again.  A
 * head waiter that has waited STARVE_NS gets a direct hand-off, which
 * bounds every wait.
 * A woken waiter that loses goes back to the head of the queue.  In this
 * mode "free" is any state whose owner bits are 0.  The flag is fixed at
 * creation, as KL_ERRORCHECK is (kl_mutex_set_opts).
 *
 * m->lock guards the queue and the options.
 */
#include "config.h"

#include <string.h>

#include "annotate.h"
#include "internal.h"

#define QUEUED 1u
#define WOKEN 2u /* eventual: a woken waiter is on its way to compete */
#define OWNER_SHIFT 2
#define STARVE_NS 1000000 /* 1 ms, as Go's mutex starvation mode */

/*
 * A mutex has cache lines of its own (kl_mutex_new; three on x86-64 with
 * glibc): the state word with the lock that the slow paths take before
 * they change it; the queue, which they change under that lock; and the
 * options, which every fast path reads before its compare-and-swap on the
 * state and only kl_mutex_set_opts writes, so that the read hits.
 * KL_EVENTUAL against pthread_mutex on 2 CPUs, keylock-bench's contended
 * loop with an empty section, medians of 7 runs per batch:
 * - where malloc put it, 4 threads ran at 0.81x to 1.11x depending only
 *   on the allocations made before it (four placements: the options, or
 *   the state, on a line that another object or the queue wrote);
 * - the options beside the queue on aligned lines: 0.82x to 0.90x;
 * - the queue beside the state: 4 threads 1.12x to 1.61x, but 2 threads
 *   0.33x to 0.50x, where a quicker slow path let the waiter in between
 *   the holder's turns two to four times as often;
 * - as here, ten interleaved batches: 4 threads 0.89x to 1.30x, 2
 *   threads 0.56x to 0.73x.
 */
struct kl_mutex {
	_Atomic uint64_t state;
	pthread_mutex_t lock;
	uint64_t owner_tid; /* KL_ERRORCHECK: the holding thread, under lock */
	uint64_t aborts;    /* leaves with abort_pending, under lock */
	_Alignas(KL__CACHE_LINE) struct kl__waitq q;
	_Alignas(KL__CACHE_LINE) kl_queue_opts opts;
};

static pthread_mutex_t defaults_lock = PTHREAD_MUTEX_INITIALIZER;
static kl_queue_opts defaults = KL_QUEUE_OPTS_INIT;
static pthread_once_t defaults_once = PTHREAD_ONCE_INIT;

/* A child of fork() may create mutexes with the default options, so the
 * lock around them must not be inherited held: hold it across the fork. */
static void
defaults_prepare(void)
{
	pthread_mutex_lock(&defaults_lock);
}

static void
defaults_parent(void)
{
	pthread_mutex_unlock(&defaults_lock);
}

static void
defaults_child(void)
{
	pthread_mutex_init(&defaults_lock, NULL);
}

static void
defaults_init(void)
{
	(void)pthread_atfork(defaults_prepare, defaults_parent,
			     defaults_child);
}

#define KNOWN_FLAGS (KL_ERRORCHECK | KL_EVENTUAL)
/* The flags kl_mutex_set_opts may not change (see there). */
#define FIXED_FLAGS (KL_ERRORCHECK | KL_EVENTUAL)

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
	pthread_once(&defaults_once, defaults_init);
	pthread_mutex_lock(&defaults_lock);
	*out = defaults;
	pthread_mutex_unlock(&defaults_lock);
}

void
kl_queue_opts_set_default(const kl_queue_opts *in)
{
	if (in == NULL || !opts_valid(in))
		return;
	pthread_once(&defaults_once, defaults_init);
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
	if ((m = kl__aligned_alloc(KL__CACHE_LINE, sizeof *m)) == NULL)
		return KL_ENOMEM;
	memset(m, 0, sizeof *m);
	atomic_init(&m->state, 0);
	KL_ANNOTATE_ATOMIC(&m->state);
	pthread_mutex_init(&m->lock, NULL);
	kl__waitq_init(&m->q, &m->lock);
	m->opts = o;
	KL_ANNOTATE_ATOMIC(&m->opts.flags);
	*out = m;
	return KL_OK;
}

void
kl_mutex_free(kl_mutex *m)
{
	if (m == NULL)
		return;
#ifdef KL_DEBUG
	if (atomic_load(&m->state) != 0 || m->q.len != 0)
		fprintf(stderr, "keylock: kl_mutex_free: mutex %s\n",
			m->q.len != 0 ? "has waiters" : "is held");
#endif
	pthread_mutex_destroy(&m->lock);
	kl__free(m);
}

/* An error-check mutex always takes the lock, so that the holding thread
 * is recorded together with the owner; without the flag the fast paths
 * record nothing, which is why the flag is fixed at creation.  Read
 * without the lock, with relaxed atomics only because set_opts stores the
 * whole flags word. */
static bool
errorcheck(kl_mutex *m)
{
	return __atomic_load_n(&m->opts.flags, __ATOMIC_RELAXED) &
	       KL_ERRORCHECK;
}

static bool
eventual(const kl_mutex *m)
{
	/* Fixed at creation; atomic only because set_opts stores the word. */
	return __atomic_load_n(&m->opts.flags, __ATOMIC_RELAXED) & KL_EVENTUAL;
}

/* One attempt to take a free mutex.  Acquire order pairs with the release
 * of the leave that freed it.  Only an eventual mutex can be free with the
 * QUEUED bit set; strict mode needs the whole word 0 (no waiters). */
static bool
try_take(kl_mutex *m, uint64_t id)
{
	uint64_t s = eventual(m) ? atomic_load_explicit(&m->state,
							 memory_order_relaxed)
				 : 0;

	return (s >> OWNER_SHIFT) == 0 &&
	       atomic_compare_exchange_strong_explicit(&m->state, &s,
						       s | id << OWNER_SHIFT,
						       memory_order_acquire,
						       memory_order_relaxed);
}

/* Takes m or marks it QUEUED, so that its holder will hand it over, and
 * clears WOKEN either way (only a woken waiter or a newcomer calls this;
 * a newcomer clearing it merely lets the next leave wake someone).  Lock
 * held.  KL_OK (taken) or KL_ETIMEDOUT (must queue). */
static int
take_or_mark(kl_mutex *m, uint64_t id)
{
	uint64_t s = atomic_load_explicit(&m->state, memory_order_relaxed);

	for (;;) {
		if ((s >> OWNER_SHIFT) == 0) {
			if (atomic_compare_exchange_weak_explicit(
				    &m->state, &s,
				    (s & QUEUED) | id << OWNER_SHIFT,
				    memory_order_acquire, memory_order_relaxed)) {
				m->owner_tid = kl__thread_id();
				KL_ANNOTATE_HAPPENS_AFTER(&m->state);
				return KL_OK;
			}
			continue;
		}
		if ((s & (QUEUED | WOKEN)) == QUEUED)
			return KL_ETIMEDOUT;
		if (atomic_compare_exchange_weak_explicit(
			    &m->state, &s, (s | QUEUED) & ~(uint64_t)WOKEN,
			    memory_order_relaxed, memory_order_relaxed))
			return KL_ETIMEDOUT;
	}
}

/* Gives up ownership, which the caller had, to the head waiter: a direct
 * hand-off, or (eventual, head not starving) a wake-up to compete.  Lock
 * held.  Returns what to kl__unpark after dropping it, and in *prod the
 * new head's early wake-up after a direct hand-off (kl__waitq_prod). */
static void *
pass_on(kl_mutex *m, void **prod)
{
	struct kl__waiter *w = kl__waitq_grant_head(&m->q);
	uint64_t queued = m->q.len != 0 ? QUEUED : 0;

	KL_ANNOTATE_HAPPENS_BEFORE(&m->state);
	if (w == NULL) {
		atomic_store_explicit(&m->state, 0, memory_order_release);
		m->owner_tid = 0;
		return NULL;
	}
	if (eventual(m) && kl__now_ns() - w->since_ns < STARVE_NS) {
		w->state = KL_W_DONE;
		w->status = KL__RETRY;
		atomic_store_explicit(&m->state, queued | WOKEN,
				      memory_order_release);
		m->owner_tid = 0;
	} else {
		atomic_store_explicit(&m->state,
				      (w->data << OWNER_SHIFT) | queued,
				      memory_order_release);
		m->owner_tid = w->tid;
		*prod = kl__waitq_prod(&m->q);
	}
	return kl__waiter_settle(w);
}

/* A waiter of an eventual mutex woken to compete: take the mutex if it is
 * still free, else go back to the head of the queue.  Returns like
 * kl__waitq_wait, lock released. */
static int
compete(kl_mutex *m, struct kl__waiter *w, uint64_t id, kl_cancel *c,
	int64_t deadline, uint64_t aborts)
{
	void *wake = NULL, *prod = NULL;

	pthread_mutex_lock(&m->lock);
	/* Cancelled or aborted on the way: once kl_cancel_fire or the
	 * aborting leave has returned, nothing may be granted to it.  It was
	 * the woken one, so it passes the wake-up on before it goes. */
	if (kl_cancel_fired(c) || m->aborts != aborts) {
		/* Taking it first makes the state ours to rewrite: a running
		 * thread may take a free eventual mutex without the lock, so
		 * storing over a free state could drop its ownership.  The
		 * caller never sees this ownership: it is passed on at once.
		 * Either way take_or_mark clears WOKEN. */
		if (take_or_mark(m, id) == KL_OK)
			wake = pass_on(m, &prod);
		pthread_mutex_unlock(&m->lock);
		kl__unpark(wake);
		kl__unpark(prod);
		return KL_ECANCELED;
	}
	if (take_or_mark(m, id) == KL_OK) {
		pthread_mutex_unlock(&m->lock);
		return KL_OK;
	}
	/* Back to INIT under the lock: a cancel from now on settles it. */
	w->state = KL_W_INIT;
	atomic_store_explicit(&w->word, 0, memory_order_relaxed);
	w->front = true;
	return kl__waitq_wait(&m->q, w, deadline, m->opts.max_queue,
			      m->opts.overflow);
}

int
kl_mutex_enter(kl_mutex *m, int64_t timeout_ms, kl_cancel *c, kl_token *out)
{
	struct kl__waiter w;
	bool ec, prepared = false;
	int64_t deadline;
	uint64_t id;
	int rc;

	if (out != NULL)
		memset(out, 0, sizeof *out);
	if (m == NULL || out == NULL || kl__check_timeout(timeout_ms) != KL_OK)
		return KL_EINVAL;
	if (c != NULL && kl_cancel_fired(c))
		return KL_ECANCELED;
	id = kl__next_id();
	out->start_ns = kl__coarse_now_ns();
	ec = errorcheck(m);
	if (!ec && try_take(m, id)) {
		KL_ANNOTATE_HAPPENS_AFTER(&m->state);
		out->id = id;
		return KL_OK;
	}
	if (!ec && timeout_ms == 0) {
		rc = KL_ETIMEDOUT;
		goto done;
	}
	deadline = kl__deadline(timeout_ms);
	if (timeout_ms != 0) {
		/* The token's lock comes before ours: register first. */
		if ((rc = kl__waiter_prepare(&w, &m->lock, c)) != KL_OK)
			goto done;
		prepared = true;
	}
	pthread_mutex_lock(&m->lock);
	/* A fire between registering and here settled the waiter already:
	 * once kl_cancel_fire has returned, nothing may be granted to it. */
	if (prepared && w.state == KL_W_DONE) {
		pthread_mutex_unlock(&m->lock);
		rc = w.status;
	} else if ((rc = take_or_mark(m, id)) == KL_OK) {
		pthread_mutex_unlock(&m->lock);
	} else if (ec && m->owner_tid == kl__thread_id()) {
		pthread_mutex_unlock(&m->lock);
		rc = KL_EDEADLK;
	} else if (timeout_ms == 0) {
		pthread_mutex_unlock(&m->lock);
		rc = KL_ETIMEDOUT;
	} else {
		uint64_t aborts = m->aborts;

		w.data = id;
		rc = kl__waitq_wait(&m->q, &w, deadline, m->opts.max_queue,
				    m->opts.overflow);
		while (rc == KL__RETRY)
			rc = compete(m, &w, id, c, deadline, aborts);
	}
	if (prepared)
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
	uint64_t expected;
	void *wake = NULL, *prod = NULL;

	if (m == NULL || t.id == 0 || t.id > UINT64_MAX >> OWNER_SHIFT)
		return KL_EINVAL;
	/* Fast path: nobody queued, or (eventual) a woken waiter already on
	 * its way.  Release order publishes the critical section to the next
	 * owner. */
	KL_ANNOTATE_HAPPENS_BEFORE(&m->state);
	expected = atomic_load_explicit(&m->state, memory_order_relaxed);
	while (!abort_pending && !errorcheck(m) &&
	       expected >> OWNER_SHIFT == t.id &&
	       ((expected & QUEUED) == 0 || (expected & WOKEN) != 0)) {
		if (atomic_compare_exchange_weak_explicit(
			    &m->state, &expected,
			    expected & (QUEUED | WOKEN), memory_order_release,
			    memory_order_relaxed))
			return KL_OK;
	}
	pthread_mutex_lock(&m->lock);
	if ((atomic_load_explicit(&m->state, memory_order_relaxed) >>
	     OWNER_SHIFT) != t.id) {
		pthread_mutex_unlock(&m->lock);
		return KL_EINVAL;
	}
	if (abort_pending) {
		kl__waitq_fail_all(&m->q, KL_ECANCELED);
		m->aborts++;
	}
	wake = pass_on(m, &prod);
	pthread_mutex_unlock(&m->lock);
	kl__unpark(wake);
	kl__waitq_released(&m->q, prod);
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
	/* Owner bits only: an eventual mutex may be free with QUEUED or
	 * WOKEN set. */
	return m != NULL &&
	       (atomic_load_explicit(&m->state, memory_order_acquire) >>
		OWNER_SHIFT) != 0;
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
	/* Both flags are fixed at creation.  KL_ERRORCHECK too: without it
	 * the fast paths record no holding thread, so a mutex that turned
	 * it on would judge by a stale record (a thread that holds nothing
	 * would get KL_EDEADLK). */
	if (((opts->flags ^ m->opts.flags) & FIXED_FLAGS) != 0) {
		pthread_mutex_unlock(&m->lock);
		return KL_EINVAL;
	}
	m->opts.max_queue = opts->max_queue;
	m->opts.overflow = opts->overflow;
	__atomic_store_n(&m->opts.flags, opts->flags, __ATOMIC_RELAXED);
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
	out->max_queue = m->opts.max_queue;
	out->overflow = m->opts.overflow;
	out->flags = __atomic_load_n(&m->opts.flags, __ATOMIC_RELAXED);
	pthread_mutex_unlock(&m->lock);
	return KL_OK;
}

int64_t
kl_token_elapsed_ms(kl_token t)
{
	int64_t d;

	if (t.id == 0)
		return 0;
	/* start_ns came from the coarse clock, which lags the precise one by
	 * up to a tick: measuring to the precise now can only over-report,
	 * never say less time passed than did. */
	d = kl__now_ns() - t.start_ns;
	return d < 0 ? 0 : d / 1000000;
}

#ifdef KL_TEST_HOOKS
/* GCOVR_EXCL_START: invariant checks of the test build; their failure
 * branches run only on a broken invariant, and users never get them. */
int
kl__test_mutex_check(kl_mutex *m)
{
	uint64_t s;
	int rc = KL_OK;

	if (m == NULL)
		return KL_EINVAL;
	pthread_mutex_lock(&m->lock);
	s = atomic_load_explicit(&m->state, memory_order_relaxed);
	/* A waiter marks QUEUED under the lock before it queues, and only a
	 * pass_on that finds the queue empty clears it. */
	if (m->q.len != 0 && (s & QUEUED) == 0) {
		kl__test_report("kl_mutex: %zu waiters without QUEUED: a "
				"leave would not hand over",
				(size_t)m->q.len);
		rc = KL_EINVAL;
	}
	if (!eventual(m) && (s & WOKEN) != 0) {
		kl__test_report("kl_mutex: WOKEN in strict FIFO mode");
		rc = KL_EINVAL;
	}
	if (!eventual(m) && m->q.len != 0 && (s >> OWNER_SHIFT) == 0) {
		kl__test_report("kl_mutex: free with %zu waiters",
				(size_t)m->q.len);
		rc = KL_EINVAL;
	}
	if (kl__waitq_check(&m->q, &m->lock, "kl_mutex queue") != KL_OK)
		rc = KL_EINVAL;
	pthread_mutex_unlock(&m->lock);
	return rc;
}
/* GCOVR_EXCL_STOP */
#endif
