/* SPDX-License-Identifier: MIT */
/*
 * Stress: the key table's entry lifecycle under the memory provider
 * (TESTPLAN T08).
 *
 * (a) 8 threads acquire 10^6 distinct keys through kl_lock_acquire, each
 * keeping at most 125 leases alive (so at most 1000 keys live), releasing
 * the oldest first: the provider never counts more than 1000 keys, returns
 * to 0, and the resident size does not grow between a warm-up and the main
 * run (entries are freed on last release).
 *
 * (b) 8 threads hammer 4 hot keys with kl_lock_run and timed or try-once
 * kl_lock_acquire, so that the last release (which frees the entry) races
 * new acquisitions (which make a new one).  Per-key in-CS counters never
 * exceed 1 (two entries for one key would let two holders in) and fences
 * grow with every grant of a key.  Run again with debug yields at the
 * free and hand-off points.
 *
 * (c) The last release racing the only waiter's deadline (see below).
 *
 * (a) and (b) also run the library's invariant checker on the provider
 * (kl__test_check_invariants) every few hundred operations per thread,
 * while other threads use it, and all three once the provider is idle.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "internal.h" /* kl__test_check_invariants */
#include "keylock.h"
#include "stress.h"

/* Operations per thread between two runs of the invariant checker. */
#define CHECK_EVERY 512

/* ------------------------------------------------------------------ */
/* T08 (a): distinct keys, bounded live set                            */

#define T08A_THREADS 8
#define T08A_LIVE 125 /* per thread: 1000 in all */
#define T08A_OPS 1000000

struct t08a {
	kl_provider *p;
	kl_lock *l;
	long ops; /* per thread */
	atomic_long max_size, errors, invariant_errors;
	int phase;
};

struct t08a_worker {
	struct t08a *x;
	int idx;
	pthread_t th;
};

static void *
t08a_main(void *arg)
{
	struct t08a_worker *w = arg;
	struct t08a *x = w->x;
	kl_lease *ring[T08A_LIVE];
	int head = 0, live = 0;
	char key[48];

	for (long i = 0; i < x->ops; i++) {
		kl_call call = { .key = key, .cancel = NULL };
		size_t size;

		if (live == T08A_LIVE) {
			kl_lease_release(ring[head]);
			live--;
			head = (head + 1) % T08A_LIVE;
		}
		snprintf(key, sizeof key, "p%d-t%d-%ld", x->phase, w->idx, i);
		if (kl_lock_acquire(x->l, &call, &ring[(head + live) %
						       T08A_LIVE],
				    NULL) != KL_OK) {
			atomic_fetch_add(&x->errors, 1);
			continue;
		}
		live++;
		if (i % CHECK_EVERY == CHECK_EVERY - 1 &&
		    kl__test_check_invariants(x->p) != KL_OK)
			atomic_fetch_add(&x->invariant_errors, 1);
		size = kl_memory_provider_size(x->p);
		if ((long)size > atomic_load_explicit(&x->max_size,
						      memory_order_relaxed))
			atomic_store(&x->max_size, (long)size);
	}
	while (live > 0) {
		kl_lease_release(ring[head]);
		live--;
		head = (head + 1) % T08A_LIVE;
	}
	return NULL;
}

static void
t08a_phase(struct t08a *x, int phase, long ops)
{
	static struct t08a_worker w[T08A_THREADS];

	x->phase = phase;
	x->ops = ops;
	for (int i = 0; i < T08A_THREADS; i++) {
		w[i].x = x;
		w[i].idx = i;
		st_thread_start(&w[i].th, 0, t08a_main, &w[i]);
	}
	for (int i = 0; i < T08A_THREADS; i++)
		st_thread_join(w[i].th);
}

START_TEST(test_t08_distinct_keys)
{
	static struct t08a x;
	kl_lock_opts lo = KL_LOCK_OPTS_INIT;
	long ops = st_scaled(T08A_OPS, 1, 8000) / T08A_THREADS;
	long rss0, rss1;

	st_begin("T08a 10^6 distinct keys, <= 1000 live");
	memset(&x, 0, sizeof x);
	st_assert(kl_memory_provider_new(&x.p) == KL_OK, "provider");
	lo.provider = x.p;
	lo.timeout_ms = 0;
	st_assert(kl_lock_new(&x.l, &lo) == KL_OK, "lock");
	/* Warm-up: thread stacks, malloc arenas, bucket arrays. */
	t08a_phase(&x, 0, ops / 10 + T08A_LIVE);
	st_assert(kl_memory_provider_size(x.p) == 0, "size after warm-up");
	rss0 = st_rss_kib();
	t08a_phase(&x, 1, ops);
	rss1 = st_rss_kib();
	st_note("%d threads x %ld keys: provider max %ld keys, RSS %ld KiB "
		"-> %ld KiB (%+ld KiB), %ld errors",
		T08A_THREADS, ops, atomic_load(&x.max_size), rss0, rss1,
		rss1 - rss0, atomic_load(&x.errors));
	st_assert(atomic_load(&x.errors) == 0, "%ld failed acquisitions",
		  atomic_load(&x.errors));
	st_assert(atomic_load(&x.max_size) <= T08A_THREADS * T08A_LIVE,
		  "provider counted %ld keys", atomic_load(&x.max_size));
	st_assert(kl_memory_provider_size(x.p) == 0,
		  "provider keeps %zu keys", kl_memory_provider_size(x.p));
	if (kl__test_check_invariants(x.p) != KL_OK)
		atomic_fetch_add(&x.invariant_errors, 1);
	st_assert(atomic_load(&x.invariant_errors) == 0,
		  "%ld invariant checks failed (see stderr)",
		  atomic_load(&x.invariant_errors));
	/* Sanitizers keep freed memory in quarantine: bound plain builds. */
	if (st_slow() == 1)
		st_assert(rss1 - rss0 <= 4096, "RSS grew by %ld KiB",
			  rss1 - rss0);
	kl_lock_free(x.l);
	kl_provider_free(x.p);
}
END_TEST

/* ------------------------------------------------------------------ */
/* T08 (b): hot keys, last release racing a new acquire                */

#define T08B_THREADS 8
#define T08B_KEYS 4
#define T08B_ROUNDS 1000000

struct t08b_key {
	char name[8];
	atomic_int inside;
	uint64_t last_fence; /* inside the key only */
	long grants;         /* inside the key only */
};

struct t08b {
	kl_provider *p;
	kl_lock *forever, *try_once, *timed;
	struct t08b_key keys[T08B_KEYS];
	long rounds; /* per thread */
	atomic_long violations, fence_errors, errors, busy;
	atomic_long invariant_errors;
};

struct t08b_worker {
	struct t08b *x;
	int idx;
	pthread_t th;
	struct t08b_key *cur;
	uint64_t fence;
	long grants;
};

static void
t08b_inside(struct t08b *x, struct t08b_key *k, uint64_t fence)
{
	if (atomic_fetch_add(&k->inside, 1) != 0)
		atomic_fetch_add(&x->violations, 1);
	if (fence != 0) {
		if (fence <= k->last_fence)
			atomic_fetch_add(&x->fence_errors, 1);
		k->last_fence = fence;
	}
	k->grants++;
	atomic_fetch_sub(&k->inside, 1);
}

static int
t08b_fn(void *arg)
{
	struct t08b_worker *w = arg;

	/* kl_lock_run does not show the fence. */
	t08b_inside(w->x, w->cur, 0);
	return 0;
}

static void *
t08b_main(void *arg)
{
	struct t08b_worker *w = arg;
	struct t08b *x = w->x;
	struct st_rng r;

	st_rng_init(&r, 0x0800 + (uint64_t)w->idx);
	for (long i = 0; i < x->rounds; i++) {
		struct t08b_key *k = &x->keys[st_below(&r, T08B_KEYS)];
		kl_call call = { .key = k->name, .cancel = NULL };
		unsigned mode = (unsigned)st_below(&r, 4);
		kl_lease *lease;
		int rc;

		if (mode < 2) {
			w->cur = k;
			rc = kl_lock_run(x->forever, &call, t08b_fn, w, NULL,
					 NULL);
			if (rc == KL_OK)
				w->grants++;
			else
				atomic_fetch_add(&x->errors, 1);
			continue;
		}
		rc = kl_lock_acquire(mode == 2 ? x->try_once : x->timed,
				     &call, &lease, NULL);
		if (rc == KL_ETIMEDOUT) {
			atomic_fetch_add(&x->busy, 1);
			continue;
		}
		if (rc != KL_OK) {
			atomic_fetch_add(&x->errors, 1);
			continue;
		}
		t08b_inside(x, k, kl_lease_fence(lease));
		if (strcmp(kl_lease_key(lease), k->name) != 0)
			atomic_fetch_add(&x->errors, 1);
		/* Now and then with a key held (and others queued on it). */
		if (i % CHECK_EVERY == CHECK_EVERY - 1 &&
		    kl__test_check_invariants(x->p) != KL_OK)
			atomic_fetch_add(&x->invariant_errors, 1);
		w->grants++;
		kl_lease_release(lease);
	}
	return NULL;
}

static void
t08b_run(long rounds)
{
	static struct t08b_worker w[T08B_THREADS];
	static struct t08b x;
	kl_lock_opts lo = KL_LOCK_OPTS_INIT;
	long grants = 0, inside = 0;

	memset(&x, 0, sizeof x);
	memset(w, 0, sizeof w);
	x.rounds = rounds / T08B_THREADS;
	for (int k = 0; k < T08B_KEYS; k++)
		snprintf(x.keys[k].name, sizeof x.keys[k].name, "hot%d", k);
	st_assert(kl_memory_provider_new(&x.p) == KL_OK, "provider");
	lo.provider = x.p;
	st_assert(kl_lock_new(&x.forever, &lo) == KL_OK, "lock");
	lo.timeout_ms = 0;
	st_assert(kl_lock_new(&x.try_once, &lo) == KL_OK, "lock");
	lo.timeout_ms = 1;
	st_assert(kl_lock_new(&x.timed, &lo) == KL_OK, "lock");
	for (int i = 0; i < T08B_THREADS; i++) {
		w[i].x = &x;
		w[i].idx = i;
		st_thread_start(&w[i].th, 0, t08b_main, &w[i]);
	}
	for (int i = 0; i < T08B_THREADS; i++) {
		st_thread_join(w[i].th);
		grants += w[i].grants;
	}
	for (int k = 0; k < T08B_KEYS; k++)
		inside += x.keys[k].grants;
	st_note("%d threads x %ld rounds on %d keys: %ld grants (%ld counted "
		"inside), %ld busy, %ld violations, %ld fence errors, %ld "
		"errors",
		T08B_THREADS, x.rounds, T08B_KEYS, grants, inside,
		atomic_load(&x.busy), atomic_load(&x.violations),
		atomic_load(&x.fence_errors), atomic_load(&x.errors));
	st_assert(atomic_load(&x.violations) == 0,
		  "%ld times two holders of one key",
		  atomic_load(&x.violations));
	st_assert(atomic_load(&x.fence_errors) == 0,
		  "%ld fences did not grow", atomic_load(&x.fence_errors));
	st_assert(atomic_load(&x.errors) == 0, "%ld unexpected statuses",
		  atomic_load(&x.errors));
	st_assert(grants == inside, "%ld grants, %ld inside", grants, inside);
	st_assert(kl_memory_provider_size(x.p) == 0,
		  "provider keeps %zu keys", kl_memory_provider_size(x.p));
	if (kl__test_check_invariants(x.p) != KL_OK)
		atomic_fetch_add(&x.invariant_errors, 1);
	st_assert(atomic_load(&x.invariant_errors) == 0,
		  "%ld invariant checks failed (see stderr)",
		  atomic_load(&x.invariant_errors));
	kl_lock_free(x.forever);
	kl_lock_free(x.try_once);
	kl_lock_free(x.timed);
	kl_provider_free(x.p);
}

START_TEST(test_t08_hot_keys)
{
	st_begin("T08b hot keys: last release races a new acquire");
	t08b_run(st_scaled(T08B_ROUNDS, 1, 8000));
}
END_TEST

START_TEST(test_t08_hot_keys_yield)
{
	st_debug_yield_on();
	st_begin("T08b hot keys, debug yields");
	t08b_run(st_scaled(T08B_ROUNDS, 0.2, 2000));
}
END_TEST

/* ------------------------------------------------------------------ */
/* T08 (c): a waiter's deadline racing the last release                */

/*
 * The holder releases the key from 200 us before to 80 us after the only
 * waiter's deadline, sleeping on a timer as the waiter does (a timer wakes
 * 50-100 us late).  Either the release grants the key to the waiter, or it
 * finds the waiter expired, fails it on its behalf and frees the entry,
 * while the waiter itself may be waking up at its deadline: after that,
 * the waiter must not touch the freed entry (a use-after-free that
 * ThreadSanitizer and AddressSanitizer report).  Each round must end with
 * the provider empty.
 */
struct t08c {
	kl_provider *p;
	kl_lock *hold, *timed;
	atomic_llong t0;
	int rc;
	uint64_t fence;
};

static void
t08c_job(struct st_crew *c, int i)
{
	struct t08c *x = c->arg;
	kl_call call = { .key = "racy", .cancel = NULL };
	kl_lease *lease = NULL;

	(void)i;
	atomic_store(&x->t0, now_ns());
	x->rc = kl_lock_acquire(x->timed, &call, &lease, NULL);
	if (lease != NULL) {
		x->fence = kl_lease_fence(lease);
		kl_lease_release(lease);
	}
}

START_TEST(test_t08_deadline_races_last_release)
{
	static struct t08c x;
	struct st_crew crew;
	struct st_rng r;
	kl_lock_opts lo = KL_LOCK_OPTS_INIT;
	long rounds = st_scaled(20000, 0.5, 500), granted = 0, timedout = 0;
	long base = 0, unseen = 0;
	uint64_t last_fence = 0;

	st_begin("T08c a waiter's deadline races the last release");
	memset(&x, 0, sizeof x);
	st_rng_init(&r, 0x0830);
	st_assert(kl_memory_provider_new(&x.p) == KL_OK, "provider");
	lo.provider = x.p;
	st_assert(kl_lock_new(&x.hold, &lo) == KL_OK, "lock");
	lo.timeout_ms = 1;
	st_assert(kl_lock_new(&x.timed, &lo) == KL_OK, "lock");
	st_crew_start(&crew, 1, 0, t08c_job, &x);
	for (long round = 0; round < rounds; round++) {
		kl_call call = { .key = "racy", .cancel = NULL };
		int64_t off = ((int64_t)st_below(&r, 29) - 20) * 10 * ST_US;
		struct timespec ts;
		unsigned spins = 0;
		kl_lease *held;

		st_assert(kl_lock_acquire(x.hold, &call, &held, NULL) == KL_OK,
			  "round %ld: hold", round);
		last_fence = kl_lease_fence(held);
		x.rc = 1;
		atomic_store(&x.t0, 0);
		st_crew_go(&crew, 0);
		while (kl_memory_provider_queue_size(x.p, "racy") == 0 &&
		       atomic_load(&crew.done) == base) {
			st_assert(spins < 1000000, "round %ld: not queued",
				  round);
			test_relax(&spins);
		}
		if (atomic_load(&crew.done) != base)
			unseen++; /* timed out before it was seen queued */
		/* Sleep on a timer, as the waiter does: both wake from the
		 * same timer tick more often than not. */
		ts.tv_sec = (time_t)((atomic_load(&x.t0) + ST_MS + off) /
				     1000000000);
		ts.tv_nsec = (long)((atomic_load(&x.t0) + ST_MS + off) %
				    1000000000);
		while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts,
				       NULL) != 0)
			;
		kl_lease_release(held);
		st_crew_wait(&crew, base + 1, 5000 * st_slow(), "waiter");
		base++;
		if (x.rc == KL_OK) {
			granted++;
			st_assert(x.fence > last_fence, "round %ld: fence %llu "
							"after %llu",
				  round, (unsigned long long)x.fence,
				  (unsigned long long)last_fence);
		} else {
			st_assert(x.rc == KL_ETIMEDOUT, "round %ld: %s", round,
				  kl_strerror(x.rc));
			timedout++;
		}
		st_assert(kl_memory_provider_size(x.p) == 0,
			  "round %ld: provider keeps %zu keys", round,
			  kl_memory_provider_size(x.p));
	}
	st_assert(kl__test_check_invariants(x.p) == KL_OK,
		  "invariant check failed (see stderr)");
	st_crew_stop(&crew);
	st_note("%ld rounds: %ld granted, %ld timed out (%ld before seen "
		"queued)",
		rounds, granted, timedout, unseen);
	kl_lock_free(x.hold);
	kl_lock_free(x.timed);
	kl_provider_free(x.p);
}
END_TEST

static Suite *
stress_table_suite(void)
{
	Suite *s = suite_create("stress_table");
	TCase *tc;

	tc = tcase_create("lifecycle");
	tcase_set_timeout(tc, ST_TIMEOUT);
	tcase_add_test(tc, test_t08_distinct_keys);
	tcase_add_test(tc, test_t08_hot_keys);
	tcase_add_test(tc, test_t08_deadline_races_last_release);
	suite_add_tcase(s, tc);

	tc = tcase_create("lifecycle_yield");
	tcase_set_timeout(tc, ST_TIMEOUT);
	tcase_add_test(tc, test_t08_hot_keys_yield);
	suite_add_tcase(s, tc);
	return s;
}

int
main(void)
{
	return st_run(stress_table_suite());
}
