/* SPDX-License-Identifier: MIT */
/*
 * Stress: fork from a multithreaded process (TESTPLAN T14, the in-process
 * part; after glibc tst-atfork/tst-fork and liburcu test_urcu_fork).
 *
 * 4 threads hammer 16 keys, through kl_lock_run on the shared memory
 * provider and through 16 kl_mutex objects, while the test's thread forks
 * 200 times (x KL_TEST_SCALE, at least 10), 20 of them (one in ten) nested:
 * the child forks a grandchild that does the same.  The documented rule
 * (keylock(3), Fork) is: in the child of a multithreaded parent, use only
 * keylock objects made after the fork (a new kl_mutex, with the default
 * options, whose lock keylock holds across fork, or explicit ones; a new
 * provider from
 * kl_memory_provider_new, a lock naming that provider), never an object,
 * registry or the shared memory provider inherited from the parent, whose
 * internal locks may have been held by a thread that does not exist in the
 * child.  Each child, following the rule, must within 1 s make a kl_mutex,
 * enter and leave it, make a memory provider, lock and unlock a key on it,
 * and exit 0; the test kills a child that hangs (10 s, a deadlock) and
 * asserts every child's exit status.  The parent's workers must keep
 * working meanwhile and afterwards: mutual exclusion on every key (an
 * in-section counter never above 1) and exact counts (the grants counted
 * per key equal the operations counted per thread).
 *
 * The children run no stdio and leave with _exit: a worker could have held
 * a stdio lock at the fork, and at-exit handlers belong to the parent.
 *
 * ThreadSanitizer does not support fork from a multithreaded process (its
 * own runtime locks may be held in the child: die_after_fork), so a TSan
 * build skips the program (exit 77, counted as skipped by tools/test).
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <check.h>
#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include "keylock.h"
#include "stress.h"

#define T14_THREADS 4
#define T14_KEYS 16
#define T14_FORKS 200
#define T14_NEST_EVERY 10     /* 20 nested forks in 200 */
#define T14_CHILD_MS 1000     /* what a child must finish within */
#define T14_HANG_MS 10000     /* after this a child is killed as hung */
#define T14_AFTER_OPS 2000    /* per worker, after the last fork */

/* Exit statuses of a child: which step failed. */
enum {
	C_OK = 0,
	C_MUTEX_NEW = 10,
	C_MUTEX_ENTER,
	C_MUTEX_LEAVE,
	C_PROVIDER_NEW,
	C_LOCK_NEW,
	C_LOCK_ACQUIRE,
	C_SIZE_HELD,
	C_SIZE_FREED,
	C_FORK,
	C_SLOW,
	C_GRANDCHILD_HUNG,
	C_GRANDCHILD_BASE = 40 /* + the grandchild's own status */
};

struct t14 {
	kl_lock *lock;                  /* on the shared memory provider */
	kl_mutex *m[T14_KEYS];
	char keys[T14_KEYS][16];
	atomic_int lock_in[T14_KEYS], mutex_in[T14_KEYS];
	long lock_grants[T14_KEYS];     /* under the key's lock */
	long mutex_grants[T14_KEYS];    /* under the key's kl_mutex */
	atomic_long ops[T14_THREADS];   /* per worker */
	atomic_long violations, errors;
	atomic_bool stop;
};

struct t14_worker {
	struct t14 *x;
	int idx;
	pthread_t th;
};

struct cs_arg {
	struct t14 *x;
	int k;
};

static int
lock_section(void *arg)
{
	struct cs_arg *a = arg;
	struct t14 *x = a->x;

	if (atomic_fetch_add(&x->lock_in[a->k], 1) != 0)
		atomic_fetch_add(&x->violations, 1);
	x->lock_grants[a->k]++;
	atomic_fetch_sub(&x->lock_in[a->k], 1);
	return 0;
}

static void *
t14_main(void *arg)
{
	struct t14_worker *w = arg;
	struct t14 *x = w->x;
	struct st_rng r;

	st_rng_init(&r, 1400 + (uint64_t)w->idx);
	while (!atomic_load(&x->stop)) {
		int k = (int)st_below(&r, T14_KEYS);
		struct cs_arg a = { x, k };

		if (st_below(&r, 4) == 0) {
			/* Keeps the lock around the default options busy at
			 * the forks, which the child's kl_mutex_new(NULL)
			 * takes. */
			kl_queue_opts d;

			kl_queue_opts_default(&d);
			kl_queue_opts_set_default(&d);
		}
		if (st_below(&r, 2) == 0) {
			kl_call call = { .key = x->keys[k], .cancel = NULL };
			int res = -1;

			if (kl_lock_run(x->lock, &call, lock_section, &a, &res,
					NULL) != KL_OK ||
			    res != 0) {
				atomic_fetch_add(&x->errors, 1);
				continue;
			}
		} else {
			kl_token t;

			if (kl_mutex_enter(x->m[k], KL_FOREVER, NULL, &t) !=
			    KL_OK) {
				atomic_fetch_add(&x->errors, 1);
				continue;
			}
			if (atomic_fetch_add(&x->mutex_in[k], 1) != 0)
				atomic_fetch_add(&x->violations, 1);
			x->mutex_grants[k]++;
			atomic_fetch_sub(&x->mutex_in[k], 1);
			if (kl_mutex_leave(x->m[k], t, false) != KL_OK)
				atomic_fetch_add(&x->errors, 1);
		}
		atomic_fetch_add(&x->ops[w->idx], 1);
	}
	return NULL;
}

/* The child: only objects made after the fork (the documented rule). */
static int
child_body(void *arg)
{
	int depth = (int)(intptr_t)arg;
	int64_t t0 = now_ns();
	kl_queue_opts qo = KL_QUEUE_OPTS_INIT;
	kl_lock_opts lo = KL_LOCK_OPTS_INIT;
	kl_provider *p;
	kl_mutex *m;
	kl_lock *l;
	kl_lease *lease;
	kl_token t;

	/* The default options (their lock is held across fork), then
	 * explicit ones. */
	if (kl_mutex_new(&m, NULL) != KL_OK)
		return C_MUTEX_NEW;
	kl_mutex_free(m);
	if (kl_mutex_new(&m, &qo) != KL_OK)
		return C_MUTEX_NEW;
	if (kl_mutex_enter(m, T14_CHILD_MS, NULL, &t) != KL_OK)
		return C_MUTEX_ENTER;
	if (kl_mutex_leave(m, t, false) != KL_OK)
		return C_MUTEX_LEAVE;
	kl_mutex_free(m);

	if (kl_memory_provider_new(&p) != KL_OK)
		return C_PROVIDER_NEW;
	lo.provider = p;
	lo.key = "child";
	lo.timeout_ms = T14_CHILD_MS;
	if (kl_lock_new(&l, &lo) != KL_OK)
		return C_LOCK_NEW;
	if (kl_lock_acquire(l, NULL, &lease, NULL) != KL_OK)
		return C_LOCK_ACQUIRE;
	if (kl_memory_provider_size(p) != 1)
		return C_SIZE_HELD;
	kl_lease_release(lease);
	if (kl_memory_provider_size(p) != 0)
		return C_SIZE_FREED;
	kl_lock_free(l);
	kl_provider_free(p);

	if (depth == 1) {
		/* Nested: this child forks once more, with the same duty. */
		int st = st_child_quiet(child_body,
					(void *)(intptr_t)(depth + 1),
					(int64_t)T14_HANG_MS * st_slow());

		if (st == -2)
			return C_FORK;
		if (st == -1)
			return C_GRANDCHILD_HUNG;
		if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
			return C_GRANDCHILD_BASE +
			       (WIFEXITED(st) ? WEXITSTATUS(st) % 40 : 39);
	}
	if (now_ns() - t0 > (int64_t)T14_CHILD_MS * st_slow() * ST_MS)
		return C_SLOW;
	return C_OK;
}

static long
total_ops(struct t14 *x)
{
	long n = 0;

	for (int i = 0; i < T14_THREADS; i++)
		n += atomic_load(&x->ops[i]);
	return n;
}

START_TEST(test_t14_fork_while_hammering)
{
	struct t14 *x;
	struct t14_worker w[T14_THREADS];
	kl_lock_opts lo = KL_LOCK_OPTS_INIT;
	long forks = st_scaled(T14_FORKS, 1.0, 10);
	long nested = 0, granted = 0, lock_sum = 0, mutex_sum = 0;
	long before[T14_THREADS];
	int64_t worst_ns = 0;

	st_begin("t14_fork_while_hammering");
	x = calloc(1, sizeof *x);
	ck_assert_ptr_nonnull(x);
	ck_assert_int_eq(kl_lock_new(&x->lock, &lo), KL_OK);
	for (int k = 0; k < T14_KEYS; k++) {
		snprintf(x->keys[k], sizeof x->keys[k], "fork-%d", k);
		ck_assert_int_eq(kl_mutex_new(&x->m[k], NULL), KL_OK);
	}
	for (int i = 0; i < T14_THREADS; i++) {
		w[i] = (struct t14_worker){ .x = x, .idx = i };
		st_thread_start(&w[i].th, 0, t14_main, &w[i]);
	}
	/* Let the workers get going, so forks land mid-operation. */
	st_assert(st_poll_count(&x->ops[0], 100, 30000 * st_slow()),
		  "worker 0 made no progress");

	for (long f = 0; f < forks; f++) {
		bool nest = f % T14_NEST_EVERY == T14_NEST_EVERY - 1;
		int64_t t0 = now_ns();
		char what[128];
		int st;

		st = st_child(child_body, (void *)(intptr_t)(nest ? 1 : 0),
			      (int64_t)T14_HANG_MS * st_slow() *
				      (nest ? 2 : 1));
		if (now_ns() - t0 > worst_ns)
			worst_ns = now_ns() - t0;
		nested += nest;
		st_describe_status(st, what, sizeof what);
		st_assert(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0,
			  "fork %ld (%s): child %s (exit codes: 10-18 a step "
			  "failed in the child, 19 too slow, 20 grandchild "
			  "hung, 40+ the grandchild's code)",
			  f, nest ? "nested" : "plain", what);
	}

	/* The workers keep working after the last fork. */
	for (int i = 0; i < T14_THREADS; i++)
		before[i] = atomic_load(&x->ops[i]);
	for (int i = 0; i < T14_THREADS; i++)
		st_assert(st_poll_count(&x->ops[i], before[i] + T14_AFTER_OPS,
					60000 * st_slow()),
			  "worker %d stalled after the forks (%ld ops)", i,
			  atomic_load(&x->ops[i]));
	atomic_store(&x->stop, true);
	for (int i = 0; i < T14_THREADS; i++)
		st_thread_join(w[i].th);

	for (int k = 0; k < T14_KEYS; k++) {
		lock_sum += x->lock_grants[k];
		mutex_sum += x->mutex_grants[k];
	}
	granted = lock_sum + mutex_sum;
	st_note("%ld forks (%ld nested), slowest %lld ms; %ld ops "
		"(%ld lock, %ld mutex)",
		forks, nested, (long long)(worst_ns / ST_MS), total_ops(x),
		lock_sum, mutex_sum);
	st_assert(atomic_load(&x->violations) == 0,
		  "%ld mutual-exclusion violations",
		  atomic_load(&x->violations));
	st_assert(atomic_load(&x->errors) == 0, "%ld failed operations",
		  atomic_load(&x->errors));
	st_assert(granted == total_ops(x),
		  "grants counted per key %ld != ops counted per thread %ld",
		  granted, total_ops(x));
	st_assert(kl_memory_provider_size(kl_memory_provider()) == 0,
		  "the shared provider keeps %zu keys",
		  kl_memory_provider_size(kl_memory_provider()));
	for (int k = 0; k < T14_KEYS; k++) {
		st_assert(!kl_mutex_is_locked(x->m[k]), "mutex %d held", k);
		kl_mutex_free(x->m[k]);
	}
	kl_lock_free(x->lock);
	free(x);
}
END_TEST

static Suite *
stress_fork_suite(void)
{
	Suite *s = suite_create("stress_fork");
	TCase *tc;

	tc = tcase_create("fork");
	tcase_set_timeout(tc, ST_TIMEOUT);
	tcase_add_test(tc, test_t14_fork_while_hammering);
	suite_add_tcase(s, tc);
	return s;
}

int
main(void)
{
	if (st_tsan()) {
		fprintf(stderr, "stress_fork: skipped under ThreadSanitizer "
				"(fork from a threaded process: "
				"die_after_fork)\n");
		return 77;
	}
	return st_run(stress_fork_suite());
}
