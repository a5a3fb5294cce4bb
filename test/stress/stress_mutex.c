/* SPDX-License-Identifier: MIT */
/*
 * Stress: mutual exclusion and strict FIFO (TESTPLAN T01, T02, and T28's
 * single-CPU reruns of both).
 *
 * T01 (a): 8 threads enter and leave one kl_mutex (strict, and again with
 * KL_EVENTUAL), odd iterations with try_enter; inside, 10 non-atomic
 * increments of a shared counter, a check that it is 10, 10 decrements and
 * a check that it is 0 (CK validate.h); now and then the holder yields its
 * CPU, so that the others queue and leave hands over.
 * (b): 16 threads run kl_lock_run over 64 keys of a private memory
 * provider with the same check per key.  Final counters must be exact and
 * the provider empty.
 *
 * T02: 100 persistent waiter threads are released one at a time in a
 * random order, each confirmed in the queue (kl_mutex_queue_size) before
 * the next; then the holder leaves.  Each grant takes a number inside the
 * critical section: grant order must equal enqueue order.  A prober thread
 * loops on try_enter during the drain and the holder tries once right after
 * its leave: neither may get in while any of the 100 waits (a barge would
 * take a grant number below 100).  The ResetEvent part queues 100 waiters
 * the same way and checks that each set of an auto-reset event with count N
 * releases exactly the next N in FIFO order.
 *
 * Counts follow KL_TEST_SCALE times a per-test share (see st_scaled).
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <check.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "keylock.h"
#include "stress.h"

/* ------------------------------------------------------------------ */
/* T01 (a): one mutex                                                  */

#define T01A_THREADS 8
#define T01A_ITERS 125000 /* per thread: 10^6 in all */

struct t01a {
	kl_mutex *m;
	volatile long counter; /* only touched inside the mutex */
	long total;            /* grants, counted inside the mutex */
	long iters;
};

struct t01a_worker {
	struct t01a *sh;
	int idx;
	pthread_t th;
	long grants, busy, violations, errors;
};

static void *
t01a_main(void *arg)
{
	struct t01a_worker *w = arg;
	struct t01a *sh = w->sh;
	struct st_rng r;
	kl_token t;

	st_rng_init(&r, 0x01a00 + (uint64_t)w->idx);

	for (long i = 0; i < sh->iters; i++) {
		int rc = (i & 1) ? kl_mutex_try_enter(sh->m, &t)
				 : kl_mutex_enter(sh->m, KL_FOREVER, NULL, &t);

		if (rc == KL_ETIMEDOUT && (i & 1)) {
			w->busy++;
			continue;
		}
		if (rc != KL_OK) {
			w->errors++;
			continue;
		}
		for (int k = 0; k < 10; k++)
			sh->counter++;
		if (sh->counter != 10)
			w->violations++;
		/* Now and then give the CPU away while holding, so that
		 * the others queue and leave takes the hand-off path. */
		if (st_below(&r, 64) == 0)
			sched_yield();
		for (int k = 0; k < 10; k++)
			sh->counter--;
		if (sh->counter != 0)
			w->violations++;
		sh->total++;
		w->grants++;
		if (kl_mutex_leave(sh->m, t, false) != KL_OK)
			w->errors++;
	}
	return NULL;
}

static void
t01a_run(long iters, unsigned flags)
{
	static struct t01a_worker w[T01A_THREADS];
	struct t01a sh;
	long grants = 0, busy = 0, violations = 0, errors = 0;
	kl_token t;

	memset(&sh, 0, sizeof sh);
	memset(w, 0, sizeof w);
	sh.iters = iters;
	{
		kl_queue_opts o = KL_QUEUE_OPTS_INIT;

		o.flags = flags;
		st_assert(kl_mutex_new(&sh.m, &o) == KL_OK, "kl_mutex_new");
	}
	for (int i = 0; i < T01A_THREADS; i++) {
		w[i].sh = &sh;
		w[i].idx = i;
		st_thread_start(&w[i].th, 0, t01a_main, &w[i]);
	}
	for (int i = 0; i < T01A_THREADS; i++)
		st_thread_join(w[i].th);
	for (int i = 0; i < T01A_THREADS; i++) {
		grants += w[i].grants;
		busy += w[i].busy;
		violations += w[i].violations;
		errors += w[i].errors;
		st_assert(w[i].grants + w[i].busy == iters,
			  "thread %d: %ld grants + %ld busy != %ld", i,
			  w[i].grants, w[i].busy, iters);
	}
	st_note("%d threads x %ld: %ld grants, %ld try_enter busy, "
		"%ld violations, %ld errors",
		T01A_THREADS, iters, grants, busy, violations, errors);
	st_assert(violations == 0, "%ld in-CS violations", violations);
	st_assert(errors == 0, "%ld unexpected statuses", errors);
	st_assert(sh.total == grants, "counted %ld grants inside, %ld outside",
		  sh.total, grants);
	st_assert(sh.counter == 0, "counter %ld", sh.counter);
	/* Even iterations always enter: at least half were granted. */
	st_assert(grants >= T01A_THREADS * (iters / 2), "only %ld grants",
		  grants);
	st_assert(!kl_mutex_is_locked(sh.m) && kl_mutex_queue_size(sh.m) == 0,
		  "mutex left locked or queued");
	st_assert(kl_mutex_try_enter(sh.m, &t) == KL_OK, "mutex lost");
	st_assert(kl_mutex_leave(sh.m, t, false) == KL_OK, "leave");
	kl_mutex_free(sh.m);
}

START_TEST(test_t01_mutex_exclusion)
{
	st_begin("T01a mutex exclusion");
	t01a_run(st_scaled(T01A_ITERS, 1, 1000), 0);
}
END_TEST

START_TEST(test_t01_mutex_exclusion_eventual)
{
	st_begin("T01a mutex exclusion, KL_EVENTUAL");
	t01a_run(st_scaled(T01A_ITERS, 0.5, 1000), KL_EVENTUAL);
}
END_TEST

/* ------------------------------------------------------------------ */
/* T01 (b): kl_lock_run over 64 keys                                   */

#define T01B_THREADS 16
#define T01B_ITERS 62500
#define T01B_KEYS 64

struct t01b_key {
	volatile long counter;
	volatile int inside;
	long total;
	char name[16];
};

struct t01b {
	kl_provider *p;
	kl_lock *lock;
	long iters;
	struct t01b_key keys[T01B_KEYS];
};

struct t01b_worker {
	struct t01b *sh;
	int idx;
	pthread_t th;
	long grants[T01B_KEYS];
	long violations, errors;
	struct t01b_key *cur;
	struct st_rng r;
};

static int
t01b_fn(void *arg)
{
	struct t01b_worker *w = arg;
	struct t01b_key *k = w->cur;

	if (k->inside++ != 0)
		w->violations++;
	for (int i = 0; i < 10; i++)
		k->counter++;
	if (k->counter != 10)
		w->violations++;
	if (st_below(&w->r, 64) == 0)
		sched_yield();
	for (int i = 0; i < 10; i++)
		k->counter--;
	if (k->counter != 0)
		w->violations++;
	k->total++;
	if (--k->inside != 0)
		w->violations++;
	return 7;
}

static void *
t01b_main(void *arg)
{
	struct t01b_worker *w = arg;
	struct t01b *sh = w->sh;

	st_rng_init(&w->r, 0x01b00 + (uint64_t)w->idx);
	for (long i = 0; i < sh->iters; i++) {
		int k = (int)st_below(&w->r, T01B_KEYS), res = 0, rc;
		kl_call call = { .key = sh->keys[k].name, .cancel = NULL };

		w->cur = &sh->keys[k];
		rc = kl_lock_run(sh->lock, &call, t01b_fn, w, &res, NULL);
		if (rc != KL_OK || res != 7)
			w->errors++;
		else
			w->grants[k]++;
	}
	return NULL;
}

START_TEST(test_t01_lock_run_keys)
{
	static struct t01b_worker w[T01B_THREADS];
	static struct t01b sh;
	kl_lock_opts o = KL_LOCK_OPTS_INIT;
	long violations = 0, errors = 0, grants = 0;

	st_begin("T01b kl_lock_run over 64 keys");
	memset(&sh, 0, sizeof sh);
	memset(w, 0, sizeof w);
	sh.iters = st_scaled(T01B_ITERS, 1, 500);
	for (int k = 0; k < T01B_KEYS; k++)
		snprintf(sh.keys[k].name, sizeof sh.keys[k].name, "key-%d", k);
	st_assert(kl_memory_provider_new(&sh.p) == KL_OK, "provider");
	o.provider = sh.p;
	st_assert(kl_lock_new(&sh.lock, &o) == KL_OK, "kl_lock_new");
	for (int i = 0; i < T01B_THREADS; i++) {
		w[i].sh = &sh;
		w[i].idx = i;
		st_thread_start(&w[i].th, 0, t01b_main, &w[i]);
	}
	for (int i = 0; i < T01B_THREADS; i++)
		st_thread_join(w[i].th);
	for (int i = 0; i < T01B_THREADS; i++) {
		violations += w[i].violations;
		errors += w[i].errors;
	}
	for (int k = 0; k < T01B_KEYS; k++) {
		long sum = 0;

		for (int i = 0; i < T01B_THREADS; i++)
			sum += w[i].grants[k];
		grants += sum;
		st_assert(sh.keys[k].total == sum,
			  "key %d: %ld grants inside, %ld outside", k,
			  sh.keys[k].total, sum);
		st_assert(sh.keys[k].counter == 0 && sh.keys[k].inside == 0,
			  "key %d: counter %ld inside %d", k,
			  sh.keys[k].counter, sh.keys[k].inside);
	}
	st_note("%d threads x %ld over %d keys: %ld grants, %ld violations, "
		"%ld errors",
		T01B_THREADS, sh.iters, T01B_KEYS, grants, violations, errors);
	st_assert(violations == 0, "%ld in-CS violations", violations);
	st_assert(errors == 0, "%ld failed runs", errors);
	st_assert(grants == T01B_THREADS * sh.iters, "%ld grants", grants);
	st_assert(kl_memory_provider_size(sh.p) == 0,
		  "provider still has %zu keys", kl_memory_provider_size(sh.p));
	kl_lock_free(sh.lock);
	kl_provider_free(sh.p);
}
END_TEST

/* ------------------------------------------------------------------ */
/* T02: strict FIFO, no barging                                        */

#define T02_WAITERS 100
#define T02_REPS 1000

enum t02_mode { T02_MUTEX, T02_EVENT };

struct t02 {
	enum t02_mode mode;
	kl_mutex *m;
	kl_reset_event *e;
	struct st_crew crew;
	/* Grant numbers of the current rep, taken inside the mutex. */
	atomic_long seq;
	atomic_int order[T02_WAITERS]; /* order[seq] = waiter */
	atomic_long gen;               /* event: number of the current set */
	atomic_long released_at[T02_WAITERS];
	atomic_long errors;
	/* Prober: loops on try_enter while probing is set. */
	pthread_t prober;
	sem_t probe_go, probe_idle;
	atomic_bool probing, prober_stop;
	atomic_long barges, probe_grants, probe_tries;
};

static void
t02_job(struct st_crew *c, int i)
{
	struct t02 *x = c->arg;
	kl_token t;
	int rc;

	if (x->mode == T02_MUTEX) {
		rc = kl_mutex_enter(x->m, KL_FOREVER, NULL, &t);
		if (rc != KL_OK) {
			atomic_fetch_add(&x->errors, 1);
			return;
		}
		long s = atomic_fetch_add(&x->seq, 1);

		if (s >= 0 && s < T02_WAITERS)
			atomic_store(&x->order[s], i);
		else
			atomic_fetch_add(&x->errors, 1);
		if (kl_mutex_leave(x->m, t, false) != KL_OK)
			atomic_fetch_add(&x->errors, 1);
	} else {
		rc = kl_reset_event_wait(x->e, KL_FOREVER, NULL);
		if (rc != KL_OK) {
			atomic_fetch_add(&x->errors, 1);
			return;
		}
		atomic_store(&x->released_at[i], atomic_load(&x->gen));
	}
}

static void *
t02_prober(void *arg)
{
	struct t02 *x = arg;
	kl_token t;

	for (;;) {
		while (sem_wait(&x->probe_go) != 0)
			;
		if (atomic_load(&x->prober_stop))
			break;
		while (atomic_load(&x->probing)) {
			atomic_fetch_add(&x->probe_tries, 1);
			if (kl_mutex_try_enter(x->m, &t) == KL_OK) {
				long s = atomic_fetch_add(&x->seq, 1);

				/* Every one of the 100 queued before the
				 * drain began: a number below 100 is a
				 * barge. */
				if (s < T02_WAITERS)
					atomic_fetch_add(&x->barges, 1);
				atomic_fetch_add(&x->probe_grants, 1);
				if (kl_mutex_leave(x->m, t, false) != KL_OK)
					atomic_fetch_add(&x->errors, 1);
			}
			sched_yield();
		}
		sem_post(&x->probe_idle);
	}
	return NULL;
}

static void
t02_setup(struct t02 *x, enum t02_mode mode, size_t auto_reset)
{
	memset(x, 0, sizeof *x);
	x->mode = mode;
	if (mode == T02_MUTEX) {
		st_assert(kl_mutex_new(&x->m, NULL) == KL_OK, "kl_mutex_new");
		sem_init(&x->probe_go, 0, 0);
		sem_init(&x->probe_idle, 0, 0);
		st_thread_start(&x->prober, 0, t02_prober, x);
	} else {
		kl_reset_opts o = KL_RESET_OPTS_INIT;

		o.auto_reset_count = auto_reset;
		st_assert(kl_reset_event_new(&x->e, false, &o) == KL_OK,
			  "kl_reset_event_new");
	}
	st_crew_start(&x->crew, T02_WAITERS, 64 * 1024, t02_job, x);
}

static void
t02_teardown(struct t02 *x)
{
	st_crew_stop(&x->crew);
	if (x->mode == T02_MUTEX) {
		atomic_store(&x->prober_stop, true);
		sem_post(&x->probe_go);
		st_thread_join(x->prober);
		sem_destroy(&x->probe_go);
		sem_destroy(&x->probe_idle);
		kl_mutex_free(x->m);
	} else {
		kl_reset_event_free(x->e);
	}
}

/* One rep on the mutex; returns the inversions (grants out of enqueue
 * order). */
static long
t02_mutex_rep(struct t02 *x, struct st_rng *r, long *holder_barges)
{
	int perm[T02_WAITERS];
	long base = atomic_load(&x->crew.done), inversions = 0;
	kl_token held, t;

	st_shuffle(r, perm, T02_WAITERS);
	atomic_store(&x->seq, 0);
	for (int i = 0; i < T02_WAITERS; i++)
		atomic_store(&x->order[i], -1);
	st_assert(kl_mutex_try_enter(x->m, &held) == KL_OK,
		  "the mutex is not free at the start of a rep");
	for (int i = 0; i < T02_WAITERS; i++) {
		st_crew_go(&x->crew, perm[i]);
		st_assert(st_poll_queue(x->m, (size_t)i + 1, 10000),
			  "waiter %d (the %d-th) did not queue: queue %zu",
			  perm[i], i, kl_mutex_queue_size(x->m));
	}
	atomic_store(&x->probing, true);
	sem_post(&x->probe_go);
	st_assert(kl_mutex_leave(x->m, held, false) == KL_OK, "leave");
	/* Right after the hand-off, 99 still wait: no way in, unless this
	 * thread was descheduled until all 100 were served (then its grant
	 * number is at least 100). */
	if (kl_mutex_try_enter(x->m, &t) == KL_OK) {
		if (atomic_fetch_add(&x->seq, 1) < T02_WAITERS)
			(*holder_barges)++;
		kl_mutex_leave(x->m, t, false);
	}
	st_crew_wait(&x->crew, base + T02_WAITERS, 10000 * st_slow(),
		     "T02 drain");
	atomic_store(&x->probing, false);
	while (sem_wait(&x->probe_idle) != 0)
		;
	for (int i = 0; i < T02_WAITERS; i++)
		if (atomic_load(&x->order[i]) != perm[i])
			inversions++;
	return inversions;
}

static void
t02_mutex_run(long reps)
{
	static struct t02 x;
	struct st_rng r;
	long inversions = 0, holder_barges = 0, first_bad = -1;

	t02_setup(&x, T02_MUTEX, 0);
	st_rng_init(&r, 0x0200);
	for (long rep = 0; rep < reps; rep++) {
		long inv = t02_mutex_rep(&x, &r, &holder_barges);

		if (inv != 0 && first_bad < 0)
			first_bad = rep;
		inversions += inv;
		if (atomic_load(&x.barges) != 0 || holder_barges != 0 ||
		    atomic_load(&x.errors) != 0)
			break;
	}
	st_note("%ld reps x %d waiters: %ld out-of-order grants (first in "
		"rep %ld), %ld prober barges in %ld tries (%ld legit "
		"grants), %ld holder barges, %ld errors",
		reps, T02_WAITERS, inversions, first_bad,
		atomic_load(&x.barges), atomic_load(&x.probe_tries),
		atomic_load(&x.probe_grants), holder_barges,
		atomic_load(&x.errors));
	st_assert(atomic_load(&x.errors) == 0, "%ld unexpected statuses",
		  atomic_load(&x.errors));
	st_assert(inversions == 0, "%ld grants out of enqueue order (rep %ld)",
		  inversions, first_bad);
	st_assert(atomic_load(&x.barges) == 0,
		  "try_enter barged in %ld times while waiters queued",
		  atomic_load(&x.barges));
	st_assert(holder_barges == 0,
		  "try_enter right after leave won %ld times", holder_barges);
	t02_teardown(&x);
}

START_TEST(test_t02_fifo_mutex)
{
	st_begin("T02 FIFO and no barging (mutex)");
	t02_mutex_run(st_scaled(T02_REPS, 1, 10));
}
END_TEST

/* Auto-reset N: each set releases exactly the next N waiters in FIFO. */
static void
t02_event_run(size_t n, long reps)
{
	static struct t02 x;
	struct st_rng r;
	long wrong = 0, first_bad = -1;

	t02_setup(&x, T02_EVENT, n);
	st_rng_init(&r, 0x0210 + n);
	for (long rep = 0; rep < reps; rep++) {
		int perm[T02_WAITERS];
		long base = atomic_load(&x.crew.done);
		size_t left = T02_WAITERS;
		long sets = 0;

		st_shuffle(&r, perm, T02_WAITERS);
		for (int i = 0; i < T02_WAITERS; i++)
			atomic_store(&x.released_at[i], -1);
		for (int i = 0; i < T02_WAITERS; i++) {
			st_crew_go(&x.crew, perm[i]);
			st_assert(st_poll_event_queue(x.e, (size_t)i + 1,
						      10000),
				  "waiter %d did not queue", perm[i]);
		}
		while (left > 0) {
			size_t k = left < n ? left : n;

			atomic_store(&x.gen, ++sets);
			kl_reset_event_set(x.e);
			/* Released waiters left the queue inside set. */
			st_assert(kl_reset_event_queue_size(x.e) == left - k,
				  "set %ld (N=%zu): queue %zu, expected %zu",
				  sets, n, kl_reset_event_queue_size(x.e),
				  left - k);
			st_assert(kl_reset_event_is_signaled(x.e) ==
					  (left < n),
				  "set %ld (N=%zu): signaled %d with %zu "
				  "queued",
				  sets, n, kl_reset_event_is_signaled(x.e),
				  left);
			left -= k;
			st_crew_wait(&x.crew,
				     base + (long)(T02_WAITERS - left),
				     10000 * st_slow(), "T02 event release");
		}
		kl_reset_event_reset(x.e);
		for (int p = 0; p < T02_WAITERS; p++) {
			long want = (long)((size_t)p / n) + 1;

			if (atomic_load(&x.released_at[perm[p]]) != want) {
				wrong++;
				if (first_bad < 0)
					first_bad = rep;
			}
		}
		if (atomic_load(&x.errors) != 0)
			break;
	}
	st_note("N=%zu: %ld reps x %d waiters, %ld released by the wrong "
		"set (first in rep %ld)",
		n, reps, T02_WAITERS, wrong, first_bad);
	st_assert(atomic_load(&x.errors) == 0, "%ld unexpected statuses",
		  atomic_load(&x.errors));
	st_assert(wrong == 0,
		  "N=%zu: %ld waiters released out of FIFO order (rep %ld)", n,
		  wrong, first_bad);
	t02_teardown(&x);
}

START_TEST(test_t02_fifo_event)
{
	static const size_t ns[] = { 1, 3, 7 };
	long reps = st_scaled(T02_REPS, 0.1, 3);

	st_begin("T02 auto-reset releases the first N in FIFO");
	for (size_t i = 0; i < sizeof ns / sizeof ns[0]; i++)
		t02_event_run(ns[i], reps);
}
END_TEST

/* ------------------------------------------------------------------ */
/* T28: the same on one CPU                                            */

START_TEST(test_t28_pinned_t01)
{
	int cpu;

	st_begin("T28 T01a pinned to one CPU");
	cpu = st_pin_one_cpu();
	st_assert(cpu >= 0, "cannot pin to one CPU");
	st_note("pinned to CPU %d", cpu);
	t01a_run(st_scaled(T01A_ITERS, 0.5, 500), 0);
	st_unpin();
}
END_TEST

START_TEST(test_t28_pinned_t02)
{
	int cpu;

	st_begin("T28 T02 pinned to one CPU");
	cpu = st_pin_one_cpu();
	st_assert(cpu >= 0, "cannot pin to one CPU");
	st_note("pinned to CPU %d", cpu);
	t02_mutex_run(st_scaled(T02_REPS, 0.5, 5));
	st_unpin();
}
END_TEST

static Suite *
stress_mutex_suite(void)
{
	Suite *s = suite_create("stress_mutex");
	TCase *tc;

	tc = tcase_create("exclusion");
	tcase_set_timeout(tc, ST_TIMEOUT);
	tcase_add_test(tc, test_t01_mutex_exclusion);
	tcase_add_test(tc, test_t01_mutex_exclusion_eventual);
	tcase_add_test(tc, test_t01_lock_run_keys);
	suite_add_tcase(s, tc);

	tc = tcase_create("fifo");
	tcase_set_timeout(tc, ST_TIMEOUT);
	tcase_add_test(tc, test_t02_fifo_mutex);
	tcase_add_test(tc, test_t02_fifo_event);
	suite_add_tcase(s, tc);

	tc = tcase_create("pinned");
	tcase_set_timeout(tc, ST_TIMEOUT);
	tcase_add_test(tc, test_t28_pinned_t01);
	tcase_add_test(tc, test_t28_pinned_t02);
	suite_add_tcase(s, tc);
	return s;
}

int
main(void)
{
	return st_run(stress_mutex_suite());
}
