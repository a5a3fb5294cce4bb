/* SPDX-License-Identifier: MIT */
/*
 * kl_mutex (AsyncLock of node-async-locks, translated to blocking threads):
 * strict FIFO with direct hand-off, token ownership, bounded queues and
 * their overflow strategies, timeouts, abort_pending, error-check mode,
 * kl_mutex_run, and races between a grant and a cancel, a timeout or an
 * eviction, each of which must end in exactly one outcome without losing
 * the lock.
 *
 * Waiter threads only record (index, status, grant sequence taken inside the
 * critical section); the test's thread forces orders by polling queue sizes
 * and asserts after joining (util.h).  Loop counts follow KL_TEST_SCALE.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <check.h>
#include <limits.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "keylock.h"
#include "util.h"

#define MS (INT64_C(1000000)) /* nanoseconds */
#define SLOW_NS (INT64_C(5000) * MS)

static kl_mutex *
new_mutex(size_t max_queue, kl_overflow overflow, unsigned flags)
{
	kl_queue_opts o = KL_QUEUE_OPTS_INIT;
	kl_mutex *m = NULL;

	o.max_queue = max_queue;
	o.overflow = overflow;
	o.flags = flags;
	ck_assert_int_eq(kl_mutex_new(&m, &o), KL_OK);
	ck_assert_ptr_nonnull(m);
	return m;
}

static kl_mutex *
new_held_mutex(size_t max_queue, kl_overflow overflow, kl_token *held)
{
	kl_mutex *m = new_mutex(max_queue, overflow, 0);

	ck_assert_int_eq(kl_mutex_try_enter(m, held), KL_OK);
	return m;
}

/* Asserts the mutex is free and not lost: a fresh try_enter gets it. */
static void
assert_free(kl_mutex *m)
{
	kl_token t;

	ck_assert(!kl_mutex_is_locked(m));
	ck_assert_uint_eq(kl_mutex_queue_size(m), 0);
	ck_assert_int_eq(kl_mutex_try_enter(m, &t), KL_OK);
	ck_assert(kl_mutex_is_locked(m));
	ck_assert_int_eq(kl_mutex_leave(m, t, false), KL_OK);
	ck_assert_int_eq(kl_mutex_leave(m, t, false), KL_EINVAL);
	ck_assert(!kl_mutex_is_locked(m));
}

static void
spin(unsigned n)
{
	for (volatile unsigned i = 0; i < n; i++)
		;
}

/* ------------------------------------------------------------------ */
/* Creation and options                                                */

START_TEST(test_new_rejects_bad_opts)
{
	kl_queue_opts o = KL_QUEUE_OPTS_INIT;
	kl_mutex *m;

	m = (kl_mutex *)&o;
	o.overflow = (kl_overflow)3;
	ck_assert_int_eq(kl_mutex_new(&m, &o), KL_EINVAL);
	ck_assert_ptr_null(m);

	m = (kl_mutex *)&o;
	o.overflow = (kl_overflow)-1;
	ck_assert_int_eq(kl_mutex_new(&m, &o), KL_EINVAL);
	ck_assert_ptr_null(m);

	m = (kl_mutex *)&o;
	o.overflow = KL_OVERFLOW_THIS;
	o.flags = 0x100;
	ck_assert_int_eq(kl_mutex_new(&m, &o), KL_EINVAL);
	ck_assert_ptr_null(m);

	ck_assert_int_eq(kl_mutex_new(NULL, NULL), KL_EINVAL);

	/* Every valid strategy and KL_ERRORCHECK are accepted. */
	for (int s = KL_OVERFLOW_THIS; s <= KL_OVERFLOW_LAST; s++) {
		o.overflow = (kl_overflow)s;
		o.flags = KL_ERRORCHECK;
		o.max_queue = (size_t)s;
		ck_assert_int_eq(kl_mutex_new(&m, &o), KL_OK);
		{
			kl_queue_opts got;

			ck_assert_int_eq(kl_mutex_get_opts(m, &got), KL_OK);
			ck_assert_uint_eq(got.max_queue, (size_t)s);
			ck_assert_int_eq(got.overflow, s);
			ck_assert_uint_eq(got.flags, KL_ERRORCHECK);
		}
		kl_mutex_free(m);
	}
	kl_mutex_free(NULL);
}
END_TEST

START_TEST(test_opts_default)
{
	kl_queue_opts saved, d, got, o = KL_QUEUE_OPTS_INIT;
	kl_token held;
	kl_mutex *m;
	struct tw_group *g;

	kl_queue_opts_default(&saved);
	ck_assert_uint_eq(saved.max_queue, KL_UNBOUNDED);
	ck_assert_int_eq(saved.overflow, KL_OVERFLOW_THIS);
	ck_assert_uint_eq(saved.flags, 0);

	o.max_queue = 2;
	o.overflow = KL_OVERFLOW_FIRST;
	kl_queue_opts_set_default(&o);
	kl_queue_opts_default(&d);
	ck_assert_uint_eq(d.max_queue, 2);
	ck_assert_int_eq(d.overflow, KL_OVERFLOW_FIRST);

	/* NULL and an invalid strategy are ignored. */
	kl_queue_opts_set_default(NULL);
	o.overflow = (kl_overflow)7;
	kl_queue_opts_set_default(&o);
	kl_queue_opts_default(&d);
	ck_assert_uint_eq(d.max_queue, 2);
	ck_assert_int_eq(d.overflow, KL_OVERFLOW_FIRST);

	/* A mutex made with NULL opts picks the new default, and behaves
	 * by it: a third waiter evicts the first. */
	ck_assert_int_eq(kl_mutex_new(&m, NULL), KL_OK);
	ck_assert_int_eq(kl_mutex_get_opts(m, &got), KL_OK);
	ck_assert_uint_eq(got.max_queue, 2);
	ck_assert_int_eq(got.overflow, KL_OVERFLOW_FIRST);
	kl_queue_opts_set_default(&saved);

	/* Changing the default later does not touch existing mutexes. */
	ck_assert_int_eq(kl_mutex_get_opts(m, &got), KL_OK);
	ck_assert_uint_eq(got.max_queue, 2);

	g = tw_mutex(m, true);
	ck_assert_int_eq(kl_mutex_try_enter(m, &held), KL_OK);
	tw_start_n_queued(g, 2, KL_FOREVER, NULL);
	tw_start(g, KL_FOREVER, NULL);
	tw_join(g, 0);
	ck_assert_int_eq(g->w[0].status, KL_EOVERFLOW);
	tw_wait_queue(g, 2);
	ck_assert_int_eq(kl_mutex_leave(m, held, false), KL_OK);
	tw_join_all(g);
	ck_assert_int_eq(g->w[1].seq, 0);
	ck_assert_int_eq(g->w[2].seq, 1);
	assert_free(m);
	tw_free(g);
	kl_mutex_free(m);

	kl_queue_opts_default(&d);
	ck_assert_uint_eq(d.max_queue, KL_UNBOUNDED);
	ck_assert_int_eq(d.overflow, KL_OVERFLOW_THIS);
	ck_assert_uint_eq(d.flags, 0);
}
END_TEST

START_TEST(test_set_opts_rejects_bad_opts)
{
	kl_mutex *m = new_mutex(5, KL_OVERFLOW_LAST, 0);
	kl_queue_opts o = KL_QUEUE_OPTS_INIT, got;

	o.overflow = (kl_overflow)3;
	ck_assert_int_eq(kl_mutex_set_opts(m, &o), KL_EINVAL);
	ck_assert_int_eq(kl_mutex_set_opts(m, NULL), KL_EINVAL);
	ck_assert_int_eq(kl_mutex_get_opts(m, &got), KL_OK);
	ck_assert_uint_eq(got.max_queue, 5);
	ck_assert_int_eq(got.overflow, KL_OVERFLOW_LAST);

	o.overflow = KL_OVERFLOW_FIRST;
	o.max_queue = 9;
	ck_assert_int_eq(kl_mutex_set_opts(m, &o), KL_OK);
	ck_assert_int_eq(kl_mutex_get_opts(m, &got), KL_OK);
	ck_assert_uint_eq(got.max_queue, 9);
	ck_assert_int_eq(got.overflow, KL_OVERFLOW_FIRST);
	kl_mutex_free(m);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Basic state                                                         */

static int
inside_fn(void *arg)
{
	kl_mutex *m = arg;

	/* Packs what the section saw: locked, queue size. */
	return (kl_mutex_is_locked(m) ? 100 : 0) +
	       (int)kl_mutex_queue_size(m);
}

START_TEST(test_is_locked_and_queue_size)
{
	kl_mutex *m = new_mutex(KL_UNBOUNDED, KL_OVERFLOW_THIS, 0);
	struct tw_group *g = tw_mutex(m, false);
	kl_token t;
	int res = -1;

	ck_assert(!kl_mutex_is_locked(m));
	ck_assert_uint_eq(kl_mutex_queue_size(m), 0);
	ck_assert_int_eq(kl_mutex_run(m, KL_FOREVER, NULL, inside_fn, m, &res),
			 KL_OK);
	ck_assert_int_eq(res, 100);

	ck_assert_int_eq(kl_mutex_enter(m, KL_FOREVER, NULL, &t), KL_OK);
	ck_assert(kl_mutex_is_locked(m));
	ck_assert_uint_eq(kl_mutex_queue_size(m), 0); /* the holder is not */
	tw_start_n_queued(g, 2, KL_FOREVER, NULL);
	ck_assert(kl_mutex_is_locked(m));
	ck_assert_uint_eq(kl_mutex_queue_size(m), 2);

	ck_assert_int_eq(kl_mutex_leave(m, t, false), KL_OK);
	ck_assert(kl_mutex_is_locked(m));
	ck_assert_uint_eq(kl_mutex_queue_size(m), 1);
	ck_assert_int_eq(tw_pass(g), 0);
	ck_assert_uint_eq(kl_mutex_queue_size(m), 0);
	ck_assert(kl_mutex_is_locked(m));
	ck_assert_int_eq(tw_pass(g), 1);
	ck_assert(!kl_mutex_is_locked(m));
	ck_assert_uint_eq(kl_mutex_queue_size(m), 0);
	tw_free(g);
	kl_mutex_free(m);

	/* NULL is harmless. */
	ck_assert(!kl_mutex_is_locked(NULL));
	ck_assert_uint_eq(kl_mutex_queue_size(NULL), 0);
}
END_TEST

START_TEST(test_try_enter)
{
	kl_mutex *m = new_mutex(KL_UNBOUNDED, KL_OVERFLOW_THIS, 0);
	kl_token t, t2;

	ck_assert_int_eq(kl_mutex_try_enter(m, &t), KL_OK);
	ck_assert_uint_ne(t.id, 0);
	ck_assert_int_eq(kl_mutex_try_enter(m, &t2), KL_ETIMEDOUT);
	ck_assert_uint_eq(kl_mutex_queue_size(m), 0);
	ck_assert_int_eq(kl_mutex_leave(m, t, false), KL_OK);
	ck_assert_int_eq(kl_mutex_try_enter(m, &t2), KL_OK);
	ck_assert_uint_ne(t2.id, t.id);
	ck_assert_int_eq(kl_mutex_leave(m, t2, false), KL_OK);
	ck_assert_int_eq(kl_mutex_try_enter(m, NULL), KL_EINVAL);
	ck_assert(!kl_mutex_is_locked(m));
	kl_mutex_free(m);
}
END_TEST

START_TEST(test_timeout_zero_tries_once)
{
	kl_mutex *m = new_mutex(KL_UNBOUNDED, KL_OVERFLOW_THIS, 0);
	kl_token t, t2;
	int64_t t0;

	ck_assert_int_eq(kl_mutex_enter(m, 0, NULL, &t), KL_OK);
	ck_assert(kl_mutex_is_locked(m));
	t0 = now_ns();
	ck_assert_int_eq(kl_mutex_enter(m, 0, NULL, &t2), KL_ETIMEDOUT);
	ck_assert_int_lt(now_ns() - t0, SLOW_NS);
	ck_assert_uint_eq(kl_mutex_queue_size(m), 0);
	ck_assert_uint_eq(t2.id, 0); /* no token on failure */
	ck_assert_int_eq(kl_mutex_leave(m, t, false), KL_OK);
	assert_free(m);
	kl_mutex_free(m);
}
END_TEST

START_TEST(test_bad_timeouts)
{
	static const int64_t bad[] = { -2, -3, -1000, INT64_MIN + 1,
				       INT64_MIN };
	kl_mutex *m = new_mutex(KL_UNBOUNDED, KL_OVERFLOW_THIS, 0);
	kl_token t, held;

	for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
		ck_assert_int_eq(kl_mutex_enter(m, bad[i], NULL, &t),
				 KL_EINVAL);
		ck_assert(!kl_mutex_is_locked(m));
	}
	ck_assert_int_eq(kl_mutex_enter(m, KL_FOREVER, NULL, NULL), KL_EINVAL);
	ck_assert(!kl_mutex_is_locked(m));

	ck_assert_int_eq(kl_mutex_try_enter(m, &held), KL_OK);
	for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
		ck_assert_int_eq(kl_mutex_enter(m, bad[i], NULL, &t),
				 KL_EINVAL);
		ck_assert_uint_eq(kl_mutex_queue_size(m), 0);
	}
	ck_assert_int_eq(kl_mutex_run(m, -2, NULL, inside_fn, m, NULL),
			 KL_EINVAL);
	ck_assert_int_eq(kl_mutex_leave(m, held, false), KL_OK);
	assert_free(m);
	kl_mutex_free(m);
}
END_TEST

struct settle {
	struct tw_group *g;
	int i;
	size_t queued;
};

static bool
queued_or_finished(void *arg)
{
	struct settle *s = arg;

	return tw_finished(s->g, s->i) ||
	       kl_mutex_queue_size(s->g->m) == s->queued;
}

START_TEST(test_huge_timeouts_wait_forever)
{
	/* Values whose deadline overflows the clock: as KL_FOREVER. */
	static const int64_t huge[] = {
		INT64_MAX,
		INT64_MAX - 1,
		INT64_MAX / 1000,
		INT64_MAX / 1000000 + 1,
		INT64_MAX / 1000000,
		INT64_C(9223372036854),
	};
	enum { NHUGE = sizeof huge / sizeof huge[0] };
	kl_token held;
	kl_mutex *m = new_held_mutex(KL_UNBOUNDED, KL_OVERFLOW_THIS, &held);
	struct tw_group *g = tw_mutex(m, true);

	for (int i = 0; i < NHUGE; i++) {
		struct settle s = { .g = g, .queued = (size_t)i + 1 };

		s.i = tw_start(g, huge[i], NULL);
		test_poll(queued_or_finished, &s, "a waiter to queue");
		ck_assert_msg(!tw_finished(g, i),
			      "timeout %lld returned %s at once",
			      (long long)huge[i],
			      kl_strerror(g->w[i].status));
	}
	/* Still all there a little later. */
	test_sleep_ms(20);
	ck_assert_uint_eq(kl_mutex_queue_size(m), NHUGE);
	ck_assert_int_eq(kl_mutex_leave(m, held, false), KL_OK);
	tw_join_all(g);
	for (int i = 0; i < NHUGE; i++) {
		ck_assert_int_eq(g->w[i].status, KL_OK);
		ck_assert_int_eq(g->w[i].seq, i);
		ck_assert_int_eq(g->w[i].leave_status, KL_OK);
	}
	assert_free(m);
	tw_free(g);
	kl_mutex_free(m);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Tokens                                                              */

#define ID_THREADS 4
#define ID_PER_THREAD 256

struct id_arg {
	kl_mutex *shared;
	uint64_t ids[ID_PER_THREAD];
	int errors;
};

static void *
id_main(void *arg)
{
	struct id_arg *a = arg;
	kl_mutex *own;
	kl_token t;

	if (kl_mutex_new(&own, NULL) != KL_OK) {
		a->errors++;
		return NULL;
	}
	for (int i = 0; i < ID_PER_THREAD; i++) {
		kl_mutex *m = i % 2 ? own : a->shared;

		if (kl_mutex_enter(m, KL_FOREVER, NULL, &t) != KL_OK) {
			a->errors++;
			continue;
		}
		a->ids[i] = t.id;
		if (kl_mutex_leave(m, t, false) != KL_OK)
			a->errors++;
	}
	kl_mutex_free(own);
	return NULL;
}

static int
cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;

	return (x > y) - (x < y);
}

START_TEST(test_token_ids_unique)
{
	static struct id_arg args[ID_THREADS];
	static uint64_t all[ID_THREADS * ID_PER_THREAD];
	pthread_t t[ID_THREADS];
	kl_mutex *m = new_mutex(KL_UNBOUNDED, KL_OVERFLOW_THIS, 0);
	size_t n = 0;

	memset(args, 0, sizeof args);
	for (int i = 0; i < ID_THREADS; i++) {
		args[i].shared = m;
		test_thread_start(&t[i], id_main, &args[i]);
	}
	for (int i = 0; i < ID_THREADS; i++)
		test_thread_join(t[i]);
	for (int i = 0; i < ID_THREADS; i++) {
		ck_assert_int_eq(args[i].errors, 0);
		for (int j = 0; j < ID_PER_THREAD; j++)
			all[n++] = args[i].ids[j];
	}
	qsort(all, n, sizeof all[0], cmp_u64);
	ck_assert_uint_ne(all[0], 0);
	for (size_t i = 1; i < n; i++)
		ck_assert_msg(all[i] != all[i - 1], "token id %llu reused",
			      (unsigned long long)all[i]);
	assert_free(m);
	kl_mutex_free(m);
}
END_TEST

START_TEST(test_token_elapsed_grows)
{
	kl_mutex *m = new_mutex(KL_UNBOUNDED, KL_OVERFLOW_THIS, 0);
	kl_token t;
	int64_t t0, t1, e0, e1;

	ck_assert_int_eq(kl_mutex_enter(m, KL_FOREVER, NULL, &t), KL_OK);
	t0 = now_ns();
	e0 = kl_token_elapsed_ms(t);
	ck_assert_int_ge(e0, 0);
	test_sleep_ms(30);
	t1 = now_ns();
	e1 = kl_token_elapsed_ms(t);
	/* The token started before t0, so it has seen at least t1 - t0. */
	ck_assert_int_ge(e1, (t1 - t0) / MS);
	ck_assert_int_ge(e1, e0);
	ck_assert_int_lt(e1, 5000 + (now_ns() - t0) / MS);
	ck_assert_int_eq(kl_mutex_leave(m, t, false), KL_OK);
	kl_mutex_free(m);
}
END_TEST

static kl_token
zero_token(void)
{
	kl_token z;

	memset(&z, 0, sizeof z);
	return z;
}

START_TEST(test_leave_rejects_bad_tokens)
{
	kl_mutex *m = new_mutex(KL_UNBOUNDED, KL_OVERFLOW_THIS, 0);
	kl_mutex *other = new_mutex(KL_UNBOUNDED, KL_OVERFLOW_THIS, 0);
	struct tw_group *g = tw_mutex(m, true);
	kl_token stale, t, foreign, forged;

	/* Leaving a free mutex. */
	ck_assert_int_eq(kl_mutex_leave(m, zero_token(), false), KL_EINVAL);
	ck_assert(!kl_mutex_is_locked(m));

	ck_assert_int_eq(kl_mutex_try_enter(m, &stale), KL_OK);
	ck_assert_int_eq(kl_mutex_leave(m, stale, false), KL_OK);
	ck_assert_int_eq(kl_mutex_leave(m, stale, false), KL_EINVAL);
	ck_assert_int_eq(kl_mutex_leave(m, stale, true), KL_EINVAL);
	ck_assert(!kl_mutex_is_locked(m));

	ck_assert_int_eq(kl_mutex_try_enter(m, &t), KL_OK);
	ck_assert_int_eq(kl_mutex_try_enter(other, &foreign), KL_OK);
	tw_start_n_queued(g, 2, KL_FOREVER, NULL);

	forged = t;
	forged.id = t.id + 1000000;
	ck_assert_int_eq(kl_mutex_leave(m, foreign, false), KL_EINVAL);
	ck_assert_int_eq(kl_mutex_leave(m, foreign, true), KL_EINVAL);
	ck_assert_int_eq(kl_mutex_leave(m, stale, false), KL_EINVAL);
	ck_assert_int_eq(kl_mutex_leave(m, stale, true), KL_EINVAL);
	ck_assert_int_eq(kl_mutex_leave(m, zero_token(), false), KL_EINVAL);
	ck_assert_int_eq(kl_mutex_leave(m, zero_token(), true), KL_EINVAL);
	ck_assert_int_eq(kl_mutex_leave(m, forged, true), KL_EINVAL);
	ck_assert_int_eq(kl_mutex_leave(NULL, t, false), KL_EINVAL);

	/* Nothing changed: still held, both still waiting. */
	ck_assert(kl_mutex_is_locked(m));
	ck_assert_uint_eq(kl_mutex_queue_size(m), 2);
	ck_assert(!tw_finished(g, 0));
	ck_assert(!tw_finished(g, 1));
	ck_assert(kl_mutex_is_locked(other));

	ck_assert_int_eq(kl_mutex_leave(m, t, false), KL_OK);
	tw_join_all(g);
	ck_assert_int_eq(g->w[0].status, KL_OK);
	ck_assert_int_eq(g->w[1].status, KL_OK);
	ck_assert_int_eq(g->w[0].seq, 0);
	ck_assert_int_eq(g->w[1].seq, 1);
	assert_free(m);
	ck_assert_int_eq(kl_mutex_leave(other, foreign, false), KL_OK);
	tw_free(g);
	kl_mutex_free(m);
	kl_mutex_free(other);
}
END_TEST

static void *
enter_and_exit_main(void *arg)
{
	struct tw_waiter *w = arg;
	kl_token t;

	/* Enters and ends the thread without leaving. */
	w->status = kl_mutex_enter(w->g->m, KL_FOREVER, NULL, &t);
	w->token = t;
	return NULL;
}

START_TEST(test_leave_from_another_thread)
{
	kl_mutex *m = new_mutex(KL_UNBOUNDED, KL_OVERFLOW_THIS, 0);
	struct tw_group *g = tw_mutex(m, true);
	struct tw_waiter owner = { .g = g };
	pthread_t t;

	test_thread_start(&t, enter_and_exit_main, &owner);
	test_thread_join(t);
	ck_assert_int_eq(owner.status, KL_OK);
	ck_assert(kl_mutex_is_locked(m));

	tw_start_queued(g, KL_FOREVER, NULL);
	/* The test's thread leaves with the dead thread's token. */
	ck_assert_int_eq(kl_mutex_leave(m, owner.token, false), KL_OK);
	tw_join_all(g);
	ck_assert_int_eq(g->w[0].status, KL_OK);
	ck_assert_int_eq(g->w[0].leave_status, KL_OK);
	assert_free(m);
	tw_free(g);
	kl_mutex_free(m);
}
END_TEST

/* ------------------------------------------------------------------ */
/* FIFO and hand-off                                                   */

START_TEST(test_fifo_grant_order)
{
	enum { N = 12 };
	kl_token held;
	kl_mutex *m = new_held_mutex(KL_UNBOUNDED, KL_OVERFLOW_THIS, &held);
	struct tw_group *g = tw_mutex(m, true);

	tw_start_n_queued(g, N, KL_FOREVER, NULL);
	ck_assert_uint_eq(kl_mutex_queue_size(m), N);
	ck_assert_int_eq(kl_mutex_leave(m, held, false), KL_OK);
	tw_join_all(g);
	for (int i = 0; i < N; i++) {
		ck_assert_int_eq(g->w[i].status, KL_OK);
		ck_assert_int_eq(g->w[i].seq, i);
		ck_assert_int_eq(g->w[i].leave_status, KL_OK);
	}
	assert_free(m);
	tw_free(g);
	kl_mutex_free(m);
}
END_TEST

START_TEST(test_fifo_long_queues)
{
	enum { N = 100 };
	long reps = kl_test_scaled(50, 1);
	kl_mutex *m = new_mutex(KL_UNBOUNDED, KL_OVERFLOW_THIS, 0);

	for (long r = 0; r < reps; r++) {
		struct tw_group *g = tw_mutex(m, true);
		kl_token held;

		ck_assert_int_eq(kl_mutex_try_enter(m, &held), KL_OK);
		tw_start_n_queued(g, N, KL_FOREVER, NULL);
		ck_assert_int_eq(kl_mutex_leave(m, held, false), KL_OK);
		tw_join_all(g);
		for (int i = 0; i < N; i++) {
			ck_assert_int_eq(g->w[i].status, KL_OK);
			ck_assert_msg(g->w[i].seq == i,
				      "round %ld: waiter %d granted %ld-th", r,
				      i, g->w[i].seq);
		}
		assert_free(m);
		tw_free(g);
	}
	kl_mutex_free(m);
}
END_TEST

START_TEST(test_direct_hand_off)
{
	enum { N = 3 };
	kl_token held, t;
	kl_mutex *m = new_held_mutex(KL_UNBOUNDED, KL_OVERFLOW_THIS, &held);
	struct tw_group *g = tw_mutex(m, false);

	tw_start_n_queued(g, N, KL_FOREVER, NULL);
	ck_assert_int_eq(kl_mutex_leave(m, held, false), KL_OK);
	/* Handed to the head at once: still locked, a newcomer is refused
	 * and the old token no longer holds it. */
	ck_assert(kl_mutex_is_locked(m));
	ck_assert_uint_eq(kl_mutex_queue_size(m), N - 1);
	ck_assert_int_eq(kl_mutex_try_enter(m, &t), KL_ETIMEDOUT);
	ck_assert_int_eq(kl_mutex_enter(m, 0, NULL, &t), KL_ETIMEDOUT);
	ck_assert_int_eq(kl_mutex_leave(m, held, false), KL_EINVAL);

	for (int i = 0; i < N; i++) {
		ck_assert_int_eq(tw_pass(g), i);
		if (i < N - 1) {
			ck_assert(kl_mutex_is_locked(m));
			ck_assert_uint_eq(kl_mutex_queue_size(m), N - 2 - i);
			ck_assert_int_eq(kl_mutex_try_enter(m, &t),
					 KL_ETIMEDOUT);
		}
	}
	tw_join_all(g);
	for (int i = 0; i < N; i++)
		ck_assert_int_eq(g->w[i].seq, i);
	assert_free(m);
	tw_free(g);
	kl_mutex_free(m);
}
END_TEST

/* Each grant wakes the new head at once when it was parked (a prod), so
 * that it runs by the time its own grant comes; the last grant leaves no
 * head to prod.  Exact counts: the prods happen under the mutex's lock
 * before each leave returns, and a parked waiter's word stays parked. */
START_TEST(test_grant_prods_parked_new_head)
{
	enum { N = 3 };
	kl_token held;
	kl_mutex *m = new_held_mutex(KL_UNBOUNDED, KL_OVERFLOW_THIS, &held);
	struct tw_group *g = tw_mutex(m, false);
	bool cpus = sysconf(_SC_NPROCESSORS_ONLN) > 1;
	/* Without fork a parked thread of an earlier test would count. */
	long parked = test_parked();
	long prods;

	tw_start_n_queued(g, N, KL_FOREVER, NULL);
	test_wait_parked(parked + N);
	prods = test_prods();
	ck_assert_int_eq(kl_mutex_leave(m, held, false), KL_OK);
	/* One CPU: nothing to gain, no prod. */
	ck_assert_int_eq(test_prods(), prods + (cpus ? 1 : 0));
	ck_assert_int_eq(tw_pass(g), 0);
	ck_assert_int_eq(test_prods(), prods + (cpus ? 2 : 0));
	ck_assert_int_eq(tw_pass(g), 1);
	ck_assert_int_eq(tw_pass(g), 2);
	ck_assert_int_eq(test_prods(), prods + (cpus ? 2 : 0));
	/* tw_pass checked each grant's order and status. */
	tw_join_all(g);
	assert_free(m);
	tw_free(g);
	kl_mutex_free(m);
}
END_TEST

/* A thread that takes the mutex, waits for the test's word, then leaves
 * it and at once asks for it again. */
struct again {
	kl_mutex *m;
	kl_mutex *m2; /* NULL, or one more to hand on after m */
	atomic_int step; /* 1 holds, 2 (the test) go on, 3 holds again */
	kl_token tok;
	int rc[5];
};

static bool
again_holds(void *arg)
{
	return atomic_load(&((struct again *)arg)->step) == 1;
}

static bool
again_holds_again(void *arg)
{
	return atomic_load(&((struct again *)arg)->step) == 3;
}

static void *
again_main(void *arg)
{
	struct again *a = arg;
	kl_token t, t2;

	a->rc[0] = kl_mutex_enter(a->m, KL_FOREVER, NULL, &t);
	a->rc[3] = a->m2 == NULL ? KL_OK
				 : kl_mutex_enter(a->m2, KL_FOREVER, NULL, &t2);
	atomic_store(&a->step, 1);
	while (atomic_load(&a->step) != 2)
		sched_yield();
	a->rc[1] = kl_mutex_leave(a->m, t, false);
	a->rc[4] = a->m2 == NULL ? KL_OK : kl_mutex_leave(a->m2, t2, false);
	a->rc[2] = kl_mutex_enter(a->m, KL_FOREVER, NULL, &a->tok);
	atomic_store(&a->step, 3);
	return NULL;
}

struct behind_cond {
	kl_mutex *m;
	struct tw_group *g;
	long behind;
};

/* A granted (by H's leave), and two queued again: B and H. */
static bool
queued_behind(void *arg)
{
	struct behind_cond *c = arg;

	return tw_granted(c->g) == 1 && kl_mutex_queue_size(c->m) == 2 &&
	       test_behind() >= c->behind;
}

static bool
kept_at_least(void *arg)
{
	return test_kept() >= *(long *)arg;
}

/* One round of test_asks_again_spins_behind: H holds, A and B queue and
 * park; H leaves (A granted, B prodded) and asks again, behind B; A
 * leaves (B granted, H the head), B leaves (H granted) once want_kept
 * waits spun behind it kept their CPU as the head.  With other, H also
 * holds a second mutex, on which C waits, and hands it on between.
 * Returns how many waits spun behind the head.  Each of the two grants
 * that leave a new head marks it: prodded if parked, headed if awake;
 * *headed: how many were headed. */
static long
asks_again_round(bool cpus, bool other, long want_behind, long want_kept,
		 long *headed)
{
	kl_mutex *m = new_mutex(KL_UNBOUNDED, KL_OVERFLOW_THIS, 0);
	kl_mutex *m2 = other ? new_mutex(KL_UNBOUNDED, KL_OVERFLOW_THIS, 0)
			     : NULL;
	struct tw_group *g = tw_mutex(m, false);
	struct tw_group *g2 = other ? tw_mutex(m2, false) : NULL;
	struct again a = { .m = m, .m2 = m2 };
	struct behind_cond c = { .m = m, .g = g };
	pthread_t th;
	long parked = test_parked(), behind, prods, headed0;
	long kept = test_kept() + want_kept;

	atomic_init(&a.step, 0);
	test_thread_start(&th, again_main, &a);
	test_poll(again_holds, &a, "H to take the mutex");
	tw_start_n_queued(g, 2, KL_FOREVER, NULL); /* A, B */
	if (other)
		tw_start_queued(g2, KL_FOREVER, NULL); /* C, on m2 */
	test_wait_parked(parked + 2 + other);
	behind = test_behind();
	prods = test_prods();
	headed0 = test_headed();
	atomic_store(&a.step, 2);
	c.behind = behind + want_behind;
	test_poll(queued_behind, &c, "H to queue behind B");
	ck_assert_int_eq(tw_pass(g), 0); /* A leaves: B's turn */
	test_poll(kept_at_least, &kept, "H to keep its CPU as the head");
	ck_assert_int_eq(tw_pass(g), 1); /* B leaves: H's turn */
	test_poll(again_holds_again, &a, "H to hold the mutex again");
	test_thread_join(th);
	for (int i = 0; i < 5; i++)
		ck_assert_int_eq(a.rc[i], KL_OK);
	ck_assert_int_eq(kl_mutex_leave(m, a.tok, false), KL_OK);
	tw_join_all(g);
	assert_free(m);
	tw_free(g);
	kl_mutex_free(m);
	if (other) {
		ck_assert_int_eq(tw_pass(g2), 0); /* C, granted by H */
		tw_join_all(g2);
		assert_free(m2);
		tw_free(g2);
		kl_mutex_free(m2);
	}
	*headed = test_headed() - headed0;
	ck_assert_int_eq(test_prods() - prods + *headed, cpus ? 2 : 0);
	return test_behind() - behind;
}

/* A thread that asks for the mutex again right after handing it on, with
 * others queued before it, gives its CPU to them between looks (waitq.c,
 * spin, SPIN_BEHIND) in a crowd: only then, not beside busy threads of
 * other processes.  The hooks take the timing out: the crowd is forced
 * and "at once" widened to a minute, so that a preempted test thread
 * still asks at once; in the first round H spins behind until a grant
 * makes it the head, which marks it headed (B, parked, was prodded), and
 * then keeps its CPU; slow yields under load are not taken for
 * neighbours there. */
START_TEST(test_asks_again_spins_behind)
{
	bool cpus = sysconf(_SC_NPROCESSORS_ONLN) > 1;
	long headed, kept = test_kept();

	test_crowd(1);
	test_asks_again_ns(INT64_C(60000) * MS);
	test_behind_ns(INT64_C(60000) * MS);
	test_neighbours(-1);
	ck_assert_int_eq(asks_again_round(cpus, false, cpus ? 1 : 0,
					  cpus ? 1 : 0, &headed),
			 cpus ? 1 : 0);
	ck_assert_int_eq(headed, cpus ? 1 : 0);
	/* and, marked, it kept its CPU as the head. */
	ck_assert_int_eq(test_kept() - kept, cpus ? 1 : 0);
	/* As it would spin behind: for a while, then it parks. */
	test_behind_ns(-1);
	test_neighbours(0);
	ck_assert_int_eq(asks_again_round(cpus, false, cpus ? 1 : 0, 0,
					  &headed),
			 cpus ? 1 : 0);
	/* Another mutex handed on since: not asking again. */
	ck_assert_int_eq(asks_again_round(cpus, true, 0, 0, &headed), 0);
	/* Not at once: no spin behind the head. */
	test_asks_again_ns(0);
	ck_assert_int_eq(asks_again_round(cpus, false, 0, 0, &headed), 0);
	/* Beside busy neighbours it parks instead. */
	test_asks_again_ns(INT64_C(60000) * MS);
	test_neighbours(1);
	ck_assert_int_eq(asks_again_round(cpus, false, 0, 0, &headed), 0);
	test_neighbours(0);
	/* Without a crowd neither. */
	test_crowd(0);
	ck_assert_int_eq(asks_again_round(cpus, false, 0, 0, &headed), 0);
	test_spin_reset();
}
END_TEST

/* One wait of test_spin_learns: the test holds m (*held), a waiter queues
 * alone, and the test leaves once the waiter has parked (parks) or at
 * once; the waiter, granted, leaves, and the test takes m back.  Returns
 * whether the wait parked without the spin it would have made. */
static bool
lone_wait(kl_mutex *m, struct tw_group *g, kl_token *held, bool parks)
{
	long parked = test_parked(), skipped = test_spins_skipped();
	int i = tw_start_queued(g, KL_FOREVER, NULL);

	if (parks)
		test_wait_parked(parked + 1);
	ck_assert_int_eq(kl_mutex_leave(m, *held, false), KL_OK);
	tw_join(g, i);
	ck_assert_int_eq(g->w[i].status, KL_OK);
	ck_assert_int_eq(kl_mutex_try_enter(m, held), KL_OK);
	return test_spins_skipped() != skipped;
}

/* Where the lock is held for longer than a spin, the lone waiter's spin
 * only burns CPU: after four spins in a row that ended parked, waiters
 * park at once, but one in sixteen spins to see whether the holds got
 * short; one whose spin sees its grant starts the count over (waitq.c,
 * SPIN_MISSES).  Order alone decides: the test leaves only once the
 * waiter has parked, or, with a spin that lasts ten seconds, while it is
 * certainly still spinning. */
START_TEST(test_spin_learns)
{
	kl_token held;
	kl_mutex *m = new_held_mutex(KL_UNBOUNDED, KL_OVERFLOW_THIS, &held);
	struct tw_group *g = tw_mutex(m, true);
	bool cpus = sysconf(_SC_NPROCESSORS_ONLN) > 1; /* else none spins */
	int i;

	for (i = 0; i < 4; i++)
		ck_assert(!lone_wait(m, g, &held, true));
	for (i = 0; i < 15; i++)
		ck_assert(lone_wait(m, g, &held, true) == cpus);
	/* The probe spins, and parks: still long. */
	ck_assert(!lone_wait(m, g, &held, true));
	for (i = 0; i < 15; i++)
		ck_assert(lone_wait(m, g, &held, true) == cpus);
	/* This probe sees its grant while it spins. */
	test_head_spin_ns(INT64_C(10000) * MS);
	ck_assert(!lone_wait(m, g, &held, false));
	test_head_spin_ns(-1);
	for (i = 0; i < 4; i++)
		ck_assert(!lone_wait(m, g, &held, true));
	ck_assert(lone_wait(m, g, &held, true) == cpus);
	ck_assert_int_eq(kl_mutex_leave(m, held, false), KL_OK);
	assert_free(m);
	tw_free(g);
	kl_mutex_free(m);
}
END_TEST

START_TEST(test_timed_out_waiter_leaves_queue)
{
	kl_token held;
	kl_mutex *m = new_held_mutex(KL_UNBOUNDED, KL_OVERFLOW_THIS, &held);
	struct tw_group *g = tw_mutex(m, true);

	/* [A, B (500 ms), C, D] */
	tw_start_queued(g, KL_FOREVER, NULL);
	tw_start_queued(g, 500, NULL);
	tw_start_queued(g, KL_FOREVER, NULL);
	tw_start_queued(g, 10000000, NULL);
	tw_join(g, 1);
	ck_assert_int_eq(g->w[1].status, KL_ETIMEDOUT);
	ck_assert_int_ge(tw_waited_ns(g, 1), 500 * MS);
	ck_assert_int_lt(tw_waited_ns(g, 1), 500 * MS + SLOW_NS);
	/* Gone at once, the others still there. */
	ck_assert_uint_eq(kl_mutex_queue_size(m), 3);
	ck_assert(kl_mutex_is_locked(m));

	ck_assert_int_eq(kl_mutex_leave(m, held, false), KL_OK);
	tw_join_all(g);
	ck_assert_int_eq(g->w[0].seq, 0);
	ck_assert_int_eq(g->w[1].seq, -1);
	ck_assert_int_eq(g->w[2].seq, 1);
	ck_assert_int_eq(g->w[3].seq, 2);
	ck_assert_int_eq(g->w[3].status, KL_OK);
	assert_free(m);
	tw_free(g);
	kl_mutex_free(m);
}
END_TEST

START_TEST(test_timeout_not_early)
{
	kl_token held, t;
	kl_mutex *m = new_held_mutex(KL_UNBOUNDED, KL_OVERFLOW_THIS, &held);
	int64_t t0, d;

	for (int ms = 1; ms <= 50; ms *= 7) {
		t0 = now_ns();
		ck_assert_int_eq(kl_mutex_enter(m, ms, NULL, &t), KL_ETIMEDOUT);
		d = now_ns() - t0;
		ck_assert_int_ge(d, ms * MS);
		ck_assert_int_lt(d, ms * MS + SLOW_NS);
		ck_assert_uint_eq(kl_mutex_queue_size(m), 0);
	}
	ck_assert_int_eq(kl_mutex_leave(m, held, false), KL_OK);
	assert_free(m);
	kl_mutex_free(m);
}
END_TEST

START_TEST(test_leave_abort_pending)
{
	enum { N = 5 };
	kl_token held;
	kl_mutex *m = new_held_mutex(KL_UNBOUNDED, KL_OVERFLOW_THIS, &held);
	struct tw_group *g = tw_mutex(m, true);

	tw_start_n_queued(g, N, KL_FOREVER, NULL);
	ck_assert_int_eq(kl_mutex_leave(m, held, true), KL_OK);
	ck_assert(!kl_mutex_is_locked(m));
	ck_assert_uint_eq(kl_mutex_queue_size(m), 0);
	tw_join_all(g);
	for (int i = 0; i < N; i++) {
		ck_assert_int_eq(g->w[i].status, KL_ECANCELED);
		ck_assert_int_eq(g->w[i].seq, -1);
	}
	assert_free(m);

	/* With nobody waiting it just leaves. */
	ck_assert_int_eq(kl_mutex_try_enter(m, &held), KL_OK);
	ck_assert_int_eq(kl_mutex_leave(m, held, true), KL_OK);
	assert_free(m);
	tw_free(g);
	kl_mutex_free(m);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Overflow strategies                                                 */

/* The worked example: queue [A,B,C], max_queue 3, newcomer D.  Returns the
 * group after the mutex was released and every waiter joined. */
static struct tw_group *
worked_example(kl_overflow overflow, int evicted)
{
	kl_token held;
	kl_mutex *m = new_held_mutex(3, overflow, &held);
	struct tw_group *g = tw_mutex(m, true);

	tw_start_n_queued(g, 3, KL_FOREVER, NULL);
	tw_start(g, KL_FOREVER, NULL); /* D */
	tw_join(g, evicted);
	ck_assert_int_eq(g->w[evicted].status, KL_EOVERFLOW);
	tw_wait_queue(g, 3);
	ck_assert_int_eq(kl_mutex_leave(m, held, false), KL_OK);
	tw_join_all(g);
	for (int i = 0; i < 4; i++) {
		if (i != evicted) {
			ck_assert_int_eq(g->w[i].status, KL_OK);
			ck_assert_int_eq(g->w[i].leave_status, KL_OK);
		}
	}
	assert_free(m);
	return g;
}

START_TEST(test_overflow_this)
{
	struct tw_group *g = worked_example(KL_OVERFLOW_THIS, 3);

	ck_assert_int_eq(g->w[0].seq, 0);
	ck_assert_int_eq(g->w[1].seq, 1);
	ck_assert_int_eq(g->w[2].seq, 2);
	ck_assert_int_eq(g->w[3].seq, -1);
	kl_mutex_free(g->m);
	tw_free(g);
}
END_TEST

START_TEST(test_overflow_first)
{
	struct tw_group *g = worked_example(KL_OVERFLOW_FIRST, 0);

	ck_assert_int_eq(g->w[0].seq, -1);
	ck_assert_int_eq(g->w[1].seq, 0);
	ck_assert_int_eq(g->w[2].seq, 1);
	ck_assert_int_eq(g->w[3].seq, 2);
	kl_mutex_free(g->m);
	tw_free(g);
}
END_TEST

START_TEST(test_overflow_last)
{
	struct tw_group *g = worked_example(KL_OVERFLOW_LAST, 2);

	ck_assert_int_eq(g->w[0].seq, 0);
	ck_assert_int_eq(g->w[1].seq, 1);
	ck_assert_int_eq(g->w[2].seq, -1);
	ck_assert_int_eq(g->w[3].seq, 2);
	kl_mutex_free(g->m);
	tw_free(g);
}
END_TEST

START_TEST(test_max_queue_zero)
{
	for (int s = KL_OVERFLOW_THIS; s <= KL_OVERFLOW_LAST; s++) {
		kl_mutex *m = new_mutex(0, (kl_overflow)s, 0);
		struct tw_group *g = tw_mutex(m, true);
		kl_token t, t2;
		int res = 0;

		/* A free mutex is still entered. */
		ck_assert_int_eq(kl_mutex_enter(m, KL_FOREVER, NULL, &t),
				 KL_OK);
		/* Every waiter is rejected, whatever the strategy. */
		for (int i = 0; i < 3; i++)
			tw_start(g, KL_FOREVER, NULL);
		tw_join_all(g);
		for (int i = 0; i < 3; i++)
			ck_assert_int_eq(g->w[i].status, KL_EOVERFLOW);
		ck_assert_int_eq(kl_mutex_enter(m, 5000, NULL, &t2),
				 KL_EOVERFLOW);
		ck_assert_uint_eq(kl_mutex_queue_size(m), 0);
		ck_assert(kl_mutex_is_locked(m));
		ck_assert_int_eq(kl_mutex_leave(m, t, false), KL_OK);
		ck_assert_int_eq(kl_mutex_run(m, KL_FOREVER, NULL, inside_fn,
					      m, &res),
				 KL_OK);
		ck_assert_int_eq(res, 100);
		assert_free(m);
		tw_free(g);
		kl_mutex_free(m);
	}
}
END_TEST

/* Lowering max_queue from unbounded to 2 with four waiters queued. */
static void
check_set_opts_evicts(kl_overflow overflow, int first_kept)
{
	kl_queue_opts o = KL_QUEUE_OPTS_INIT;
	kl_token held;
	kl_mutex *m = new_held_mutex(KL_UNBOUNDED, KL_OVERFLOW_THIS, &held);
	struct tw_group *g = tw_mutex(m, true);

	tw_start_n_queued(g, 4, KL_FOREVER, NULL);
	o.max_queue = 2;
	o.overflow = overflow;
	ck_assert_int_eq(kl_mutex_set_opts(m, &o), KL_OK);
	/* At once, not at the next enter. */
	ck_assert_uint_eq(kl_mutex_queue_size(m), 2);
	for (int i = 0; i < 4; i++) {
		if (i == first_kept || i == first_kept + 1)
			continue;
		tw_join(g, i);
		ck_assert_int_eq(g->w[i].status, KL_EOVERFLOW);
	}
	ck_assert_int_eq(kl_mutex_leave(m, held, false), KL_OK);
	tw_join_all(g);
	ck_assert_int_eq(g->w[first_kept].seq, 0);
	ck_assert_int_eq(g->w[first_kept + 1].seq, 1);
	assert_free(m);
	tw_free(g);

	/* Lowering to 0 evicts everyone left. */
	g = tw_mutex(m, true);
	ck_assert_int_eq(kl_mutex_try_enter(m, &held), KL_OK);
	tw_start_n_queued(g, 2, KL_FOREVER, NULL);
	o.max_queue = 0;
	ck_assert_int_eq(kl_mutex_set_opts(m, &o), KL_OK);
	ck_assert_uint_eq(kl_mutex_queue_size(m), 0);
	tw_join_all(g);
	ck_assert_int_eq(g->w[0].status, KL_EOVERFLOW);
	ck_assert_int_eq(g->w[1].status, KL_EOVERFLOW);
	ck_assert(kl_mutex_is_locked(m));
	ck_assert_int_eq(kl_mutex_leave(m, held, false), KL_OK);
	assert_free(m);
	tw_free(g);
	kl_mutex_free(m);
}

START_TEST(test_set_opts_evicts_first)
{
	check_set_opts_evicts(KL_OVERFLOW_FIRST, 2);
}
END_TEST

START_TEST(test_set_opts_evicts_this)
{
	check_set_opts_evicts(KL_OVERFLOW_THIS, 0);
}
END_TEST

START_TEST(test_set_opts_evicts_last)
{
	check_set_opts_evicts(KL_OVERFLOW_LAST, 0);
}
END_TEST

START_TEST(test_set_opts_raise_keeps_waiters)
{
	kl_queue_opts o = KL_QUEUE_OPTS_INIT;
	kl_token held;
	kl_mutex *m = new_held_mutex(2, KL_OVERFLOW_THIS, &held);
	struct tw_group *g = tw_mutex(m, true);

	tw_start_n_queued(g, 2, KL_FOREVER, NULL);
	o.max_queue = 3;
	ck_assert_int_eq(kl_mutex_set_opts(m, &o), KL_OK);
	ck_assert_uint_eq(kl_mutex_queue_size(m), 2);
	tw_start_queued(g, KL_FOREVER, NULL);
	tw_start(g, KL_FOREVER, NULL);
	tw_join(g, 3);
	ck_assert_int_eq(g->w[3].status, KL_EOVERFLOW);
	ck_assert_int_eq(kl_mutex_leave(m, held, false), KL_OK);
	tw_join_all(g);
	for (int i = 0; i < 3; i++)
		ck_assert_int_eq(g->w[i].seq, i);
	assert_free(m);
	tw_free(g);
	kl_mutex_free(m);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Re-entry                                                            */

START_TEST(test_errorcheck_deadlk)
{
	kl_mutex *m = new_mutex(KL_UNBOUNDED, KL_OVERFLOW_THIS, KL_ERRORCHECK);
	struct tw_group *g = tw_mutex(m, true);
	kl_token t, t2;
	int64_t t0;

	ck_assert_int_eq(kl_mutex_enter(m, KL_FOREVER, NULL, &t), KL_OK);
	t0 = now_ns();
	ck_assert_int_eq(kl_mutex_enter(m, 5000, NULL, &t2), KL_EDEADLK);
	ck_assert_int_eq(kl_mutex_enter(m, KL_FOREVER, NULL, &t2),
			 KL_EDEADLK);
	ck_assert_int_lt(now_ns() - t0, 4000 * MS);
	ck_assert_uint_eq(kl_mutex_queue_size(m), 0);
	ck_assert(kl_mutex_is_locked(m));

	/* Another thread waits normally. */
	tw_start_queued(g, KL_FOREVER, NULL);
	ck_assert_int_eq(kl_mutex_leave(m, t, false), KL_OK);
	tw_join_all(g);
	ck_assert_int_eq(g->w[0].status, KL_OK);
	ck_assert_int_eq(g->w[0].leave_status, KL_OK);

	/* Free again: this thread may enter once more. */
	ck_assert_int_eq(kl_mutex_enter(m, KL_FOREVER, NULL, &t), KL_OK);
	ck_assert_int_eq(kl_mutex_leave(m, t, false), KL_OK);
	assert_free(m);
	tw_free(g);
	kl_mutex_free(m);
}
END_TEST

START_TEST(test_errorcheck_after_foreign_leave)
{
	/* After a hand-off the holding thread is the waiter's: the thread
	 * that left is a newcomer like any other and waits. */
	kl_mutex *m = new_mutex(KL_UNBOUNDED, KL_OVERFLOW_THIS, KL_ERRORCHECK);
	struct tw_group *g = tw_mutex(m, false);
	kl_token t, t2;

	ck_assert_int_eq(kl_mutex_enter(m, KL_FOREVER, NULL, &t), KL_OK);
	tw_start_queued(g, KL_FOREVER, NULL);
	ck_assert_int_eq(kl_mutex_leave(m, t, false), KL_OK);
	ck_assert_int_eq(kl_mutex_enter(m, 20, NULL, &t2), KL_ETIMEDOUT);
	ck_assert_int_eq(tw_pass(g), 0);
	ck_assert_int_eq(kl_mutex_enter(m, KL_FOREVER, NULL, &t2), KL_OK);
	ck_assert_int_eq(kl_mutex_leave(m, t2, false), KL_OK);
	assert_free(m);
	tw_free(g);
	kl_mutex_free(m);
}
END_TEST

/* KL_ERRORCHECK is fixed at creation, as KL_EVENTUAL is: a mutex without
 * it records its holding thread only on its slow path, so turning it on
 * later would judge by a stale record.  set_opts refuses a change either
 * way with KL_EINVAL and changes nothing; other options still change. */
START_TEST(test_errorcheck_fixed_at_creation)
{
	kl_mutex *m = new_mutex(5, KL_OVERFLOW_LAST, KL_ERRORCHECK);
	kl_queue_opts o = KL_QUEUE_OPTS_INIT, got;

	o.max_queue = 7;
	ck_assert_int_eq(kl_mutex_set_opts(m, &o), KL_EINVAL);
	ck_assert_int_eq(kl_mutex_get_opts(m, &got), KL_OK);
	ck_assert_uint_eq(got.max_queue, 5);
	ck_assert_int_eq(got.overflow, KL_OVERFLOW_LAST);
	ck_assert_uint_eq(got.flags, KL_ERRORCHECK);
	o.flags = KL_ERRORCHECK;
	ck_assert_int_eq(kl_mutex_set_opts(m, &o), KL_OK);
	ck_assert_int_eq(kl_mutex_get_opts(m, &got), KL_OK);
	ck_assert_uint_eq(got.max_queue, 7);
	ck_assert_uint_eq(got.flags, KL_ERRORCHECK);
	kl_mutex_free(m);

	m = new_mutex(5, KL_OVERFLOW_LAST, 0);
	ck_assert_int_eq(kl_mutex_set_opts(m, &o), KL_EINVAL);
	ck_assert_int_eq(kl_mutex_get_opts(m, &got), KL_OK);
	ck_assert_uint_eq(got.max_queue, 5);
	ck_assert_uint_eq(got.flags, 0);
	kl_mutex_free(m);
}
END_TEST

struct holder {
	kl_mutex *m;
	kl_token t;
	int rc;
};

static void *
holder_enter(void *arg)
{
	struct holder *h = arg;

	h->rc = kl_mutex_try_enter(h->m, &h->t);
	return NULL;
}

/* Leaves h->t once a waiter is queued (or after a minute: the test thread
 * then finds out why). */
static void *
holder_leave_when_queued(void *arg)
{
	struct holder *h = arg;
	int64_t limit = now_ms() + 60000;
	unsigned spins = 0;

	while (kl_mutex_queue_size(h->m) != 1 && now_ms() < limit)
		test_relax(&spins);
	h->rc = kl_mutex_leave(h->m, h->t, false);
	return NULL;
}

/* The false KL_EDEADLK of a live mutex whose KL_ERRORCHECK was turned on:
 * this thread took the mutex by hand-off (its slow path records it as the
 * holder), left on the fast path (which records nothing), and another
 * thread holds it now.  Turning the flag on must not make this thread,
 * which holds nothing, get KL_EDEADLK: the change is refused, and the
 * try is an ordinary KL_ETIMEDOUT. */
START_TEST(test_errorcheck_turned_on_no_false_deadlk)
{
	kl_mutex *m = new_mutex(KL_UNBOUNDED, KL_OVERFLOW_THIS, 0);
	kl_queue_opts o = KL_QUEUE_OPTS_INIT, got;
	struct holder a = { .m = m }, b = { .m = m };
	kl_token t;
	pthread_t th;
	int set_rc, try_rc;

	test_thread_start(&th, holder_enter, &a);
	test_thread_join(th);
	ck_assert_int_eq(a.rc, KL_OK);
	test_thread_start(&th, holder_leave_when_queued, &a);
	ck_assert_int_eq(kl_mutex_enter(m, 60000, NULL, &t), KL_OK);
	test_thread_join(th);
	ck_assert_int_eq(a.rc, KL_OK);
	ck_assert_int_eq(kl_mutex_leave(m, t, false), KL_OK);

	test_thread_start(&th, holder_enter, &b);
	test_thread_join(th);
	ck_assert_int_eq(b.rc, KL_OK);
	o.flags = KL_ERRORCHECK;
	set_rc = kl_mutex_set_opts(m, &o);
	try_rc = kl_mutex_try_enter(m, &t);
	ck_assert_int_eq(try_rc, KL_ETIMEDOUT);
	ck_assert_int_eq(set_rc, KL_EINVAL);
	ck_assert_int_eq(kl_mutex_get_opts(m, &got), KL_OK);
	ck_assert_uint_eq(got.flags, 0);
	ck_assert_int_eq(kl_mutex_leave(m, b.t, false), KL_OK);
	assert_free(m);
	kl_mutex_free(m);
}
END_TEST

START_TEST(test_reenter_without_errorcheck_times_out)
{
	kl_mutex *m = new_mutex(KL_UNBOUNDED, KL_OVERFLOW_THIS, 0);
	kl_token t, t2;
	int64_t t0, d;

	ck_assert_int_eq(kl_mutex_enter(m, KL_FOREVER, NULL, &t), KL_OK);
	t0 = now_ns();
	ck_assert_int_eq(kl_mutex_enter(m, 50, NULL, &t2), KL_ETIMEDOUT);
	d = now_ns() - t0;
	ck_assert_int_ge(d, 50 * MS);
	ck_assert_int_lt(d, 50 * MS + SLOW_NS);
	ck_assert_uint_eq(kl_mutex_queue_size(m), 0);
	ck_assert(kl_mutex_is_locked(m));
	ck_assert_int_eq(kl_mutex_leave(m, t, false), KL_OK);
	assert_free(m);
	kl_mutex_free(m);
}
END_TEST

/* ------------------------------------------------------------------ */
/* kl_mutex_run                                                        */

struct run_arg {
	kl_mutex *m;
	int calls;
	int ret;
	bool locked_inside;
};

static int
run_fn(void *arg)
{
	struct run_arg *a = arg;

	a->calls++;
	a->locked_inside = kl_mutex_is_locked(a->m);
	return a->ret;
}

START_TEST(test_run_releases_and_passes_result)
{
	static const int rets[] = { 0, 42, -1, KL_ENOMEM, 1 << 30 };
	kl_mutex *m = new_mutex(KL_UNBOUNDED, KL_OVERFLOW_THIS, 0);
	struct run_arg a = { .m = m };
	int res;

	for (size_t i = 0; i < sizeof rets / sizeof rets[0]; i++) {
		a.ret = rets[i];
		a.calls = 0;
		res = 12345;
		ck_assert_int_eq(kl_mutex_run(m, KL_FOREVER, NULL, run_fn, &a,
					      &res),
				 KL_OK);
		ck_assert_int_eq(a.calls, 1);
		ck_assert(a.locked_inside);
		ck_assert_int_eq(res, rets[i]);
		assert_free(m);

		/* fn_result may be NULL. */
		ck_assert_int_eq(kl_mutex_run(m, 0, NULL, run_fn, &a, NULL),
				 KL_OK);
		ck_assert_int_eq(a.calls, 2);
		assert_free(m);
	}
	kl_mutex_free(m);
}
END_TEST

START_TEST(test_run_not_acquired)
{
	kl_token held;
	kl_mutex *m = new_held_mutex(KL_UNBOUNDED, KL_OVERFLOW_THIS, &held);
	struct run_arg a = { .m = m, .ret = 5 };
	kl_cancel *c;
	int res = 12345;

	ck_assert_int_eq(kl_mutex_run(m, 0, NULL, run_fn, &a, &res),
			 KL_ETIMEDOUT);
	ck_assert_int_eq(kl_mutex_run(m, 20, NULL, run_fn, &a, &res),
			 KL_ETIMEDOUT);
	ck_assert_int_eq(kl_cancel_new_timeout(&c, 0), KL_OK);
	ck_assert_int_eq(kl_mutex_run(m, KL_FOREVER, c, run_fn, &a, &res),
			 KL_ECANCELED);
	kl_cancel_free(c);
	ck_assert_int_eq(a.calls, 0);
	ck_assert_uint_eq(kl_mutex_queue_size(m), 0);
	ck_assert(kl_mutex_is_locked(m));
	ck_assert_int_eq(kl_mutex_leave(m, held, false), KL_OK);
	assert_free(m);
	kl_mutex_free(m);
}
END_TEST

struct run_waiter {
	kl_mutex *m;
	struct run_arg a;
	int rc;
	int res;
};

static void *
run_waiter_main(void *arg)
{
	struct run_waiter *w = arg;

	w->rc = kl_mutex_run(w->m, KL_FOREVER, NULL, run_fn, &w->a, &w->res);
	return NULL;
}

START_TEST(test_run_waits_its_turn)
{
	kl_token held;
	kl_mutex *m = new_held_mutex(KL_UNBOUNDED, KL_OVERFLOW_THIS, &held);
	struct run_waiter w = { .m = m, .a = { .m = m, .ret = 9 } };
	pthread_t t;

	test_thread_start(&t, run_waiter_main, &w);
	test_wait_mutex_queue(m, 1);
	ck_assert_int_eq(kl_mutex_leave(m, held, false), KL_OK);
	test_thread_join(t);
	ck_assert_int_eq(w.rc, KL_OK);
	ck_assert_int_eq(w.res, 9);
	ck_assert_int_eq(w.a.calls, 1);
	ck_assert(w.a.locked_inside);
	assert_free(m);
	kl_mutex_free(m);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Races                                                               */

struct racer {
	kl_mutex *m;
	kl_cancel *c;
	atomic_bool ready;
	atomic_bool go;
	atomic_bool done;
	unsigned delay;
	kl_queue_opts opts;
	int rc;
};

static void
wait_go(struct racer *r)
{
	unsigned n = 0;

	atomic_store(&r->ready, true);
	while (!atomic_load(&r->go))
		if (++n % 1024 == 0)
			sched_yield();
	spin(r->delay);
}

static bool
racer_ready(void *arg)
{
	struct racer *r = arg;

	return atomic_load(&r->ready);
}

/* Starts the racer's thread, waits until it spins on go, then lets both
 * sides run, the test's side after delay spins. */
static void
race_start(struct racer *r, pthread_t *t, void *(*fn)(void *arg),
	   unsigned delay)
{
	test_thread_start(t, fn, r);
	test_poll(racer_ready, r, "the racer to start");
	atomic_store(&r->go, true);
	spin(delay);
}

static void *
fire_racer_main(void *arg)
{
	struct racer *r = arg;

	wait_go(r);
	kl_cancel_fire(r->c);
	atomic_store(&r->done, true);
	return NULL;
}

static void *
evict_racer_main(void *arg)
{
	struct racer *r = arg;

	wait_go(r);
	r->rc = kl_mutex_set_opts(r->m, &r->opts);
	atomic_store(&r->done, true);
	return NULL;
}

/* Spin counts that let either side of a race go first. */
static unsigned
race_delay(long round, int side)
{
	static const unsigned d[] = { 0, 0, 50, 200, 1000, 3000, 10 };

	return d[(round + side * 3) % (sizeof d / sizeof d[0])];
}

START_TEST(test_race_cancel_and_grant)
{
	long rounds = kl_test_scaled(2000, 20);
	kl_mutex *m = new_mutex(KL_UNBOUNDED, KL_OVERFLOW_THIS, 0);
	long granted = 0, canceled = 0;

	for (long r = 0; r < rounds; r++) {
		struct tw_group *g = tw_mutex(m, true);
		struct racer fr = { .m = m };
		kl_token held;
		bool fired_first;
		pthread_t t;

		ck_assert_int_eq(kl_mutex_try_enter(m, &held), KL_OK);
		ck_assert_int_eq(kl_cancel_new(&fr.c), KL_OK);
		tw_start_queued(g, KL_FOREVER, fr.c); /* W1: cancellable */
		tw_start_queued(g, KL_FOREVER, NULL); /* W2 */
		fr.delay = race_delay(r, 0);
		race_start(&fr, &t, fire_racer_main, race_delay(r, 1));
		fired_first = atomic_load(&fr.done);
		ck_assert_int_eq(kl_mutex_leave(m, held, false), KL_OK);
		test_thread_join(t);
		tw_join_all(g);

		if (g->w[0].status == KL_OK) {
			/* Granted before the fire: it owned and left. */
			ck_assert_msg(!fired_first,
				      "round %ld: granted after fire returned",
				      r);
			ck_assert_int_eq(g->w[0].leave_status, KL_OK);
			ck_assert_int_eq(g->w[0].seq, 0);
			ck_assert_int_eq(g->w[1].seq, 1);
			granted++;
		} else {
			ck_assert_msg(g->w[0].status == KL_ECANCELED,
				      "round %ld: W1 got %s", r,
				      kl_strerror(g->w[0].status));
			ck_assert_int_eq(g->w[0].seq, -1);
			ck_assert_int_eq(g->w[1].seq, 0);
			canceled++;
		}
		/* The lock was passed on either way. */
		ck_assert_int_eq(g->w[1].status, KL_OK);
		ck_assert_int_eq(g->w[1].leave_status, KL_OK);
		assert_free(m);
		tw_free(g);
		kl_cancel_free(fr.c);
	}
	ck_assert_int_eq(granted + canceled, rounds);
	fprintf(stderr, "race cancel/grant: %ld granted, %ld canceled\n",
		granted, canceled);
	kl_mutex_free(m);
}
END_TEST

static bool
both_queued_or_w1_done(void *arg)
{
	struct tw_group *g = arg;
	bool w1_done = tw_finished(g, 0);
	size_t q = kl_mutex_queue_size(g->m);

	return q == 2 || (w1_done && q == 1);
}

START_TEST(test_race_timeout_and_grant)
{
	static const int64_t offset_us[] = { -300, -100, -20, 0, 20, 100,
					     300 };
	long rounds = kl_test_scaled(2000, 20);
	kl_mutex *m = new_mutex(KL_UNBOUNDED, KL_OVERFLOW_THIS, 0);
	long granted = 0, timed_out = 0;

	for (long r = 0; r < rounds; r++) {
		struct tw_group *g = tw_mutex(m, true);
		struct settle s = { .g = g, .i = 0, .queued = 1 };
		int64_t timeout = 1 + r % 2, target;
		kl_token held;

		ck_assert_int_eq(kl_mutex_try_enter(m, &held), KL_OK);
		tw_start(g, timeout, NULL); /* W1 */
		test_poll(queued_or_finished, &s, "W1 to queue");
		tw_start(g, KL_FOREVER, NULL); /* W2, behind W1 */
		test_poll(both_queued_or_w1_done, g, "W2 to queue");

		/* Leave around W1's deadline. */
		target = g->w[0].start_ns + timeout * MS +
			 offset_us[r % (sizeof offset_us /
					sizeof offset_us[0])] *
				 1000;
		while (now_ns() < target)
			;
		ck_assert_int_eq(kl_mutex_leave(m, held, false), KL_OK);
		tw_join_all(g);

		if (g->w[0].status == KL_OK) {
			ck_assert_int_eq(g->w[0].leave_status, KL_OK);
			ck_assert_int_eq(g->w[0].seq, 0);
			ck_assert_int_eq(g->w[1].seq, 1);
			granted++;
		} else {
			ck_assert_msg(g->w[0].status == KL_ETIMEDOUT,
				      "round %ld: W1 got %s", r,
				      kl_strerror(g->w[0].status));
			ck_assert_msg(tw_waited_ns(g, 0) >= timeout * MS,
				      "round %ld: timed out after %lld ns", r,
				      (long long)tw_waited_ns(g, 0));
			ck_assert_int_eq(g->w[0].seq, -1);
			ck_assert_int_eq(g->w[1].seq, 0);
			timed_out++;
		}
		ck_assert_int_eq(g->w[1].status, KL_OK);
		ck_assert_int_eq(g->w[1].leave_status, KL_OK);
		assert_free(m);
		tw_free(g);
	}
	ck_assert_int_eq(granted + timed_out, rounds);
	fprintf(stderr, "race timeout/grant: %ld granted, %ld timed out\n",
		granted, timed_out);
	kl_mutex_free(m);
}
END_TEST

START_TEST(test_race_eviction_and_grant)
{
	long rounds = kl_test_scaled(2000, 20);
	kl_mutex *m = new_mutex(KL_UNBOUNDED, KL_OVERFLOW_THIS, 0);
	kl_queue_opts unbounded = KL_QUEUE_OPTS_INIT;
	long outcome[3] = { 0, 0, 0 }; /* W1 and W2 granted: 2, 1, 0 */

	for (long r = 0; r < rounds; r++) {
		struct tw_group *g = tw_mutex(m, true);
		struct racer er = { .m = m };
		kl_token held;
		bool evicted_first;
		pthread_t t;
		int ok;

		ck_assert_int_eq(kl_mutex_try_enter(m, &held), KL_OK);
		tw_start_n_queued(g, 2, KL_FOREVER, NULL);
		er.opts.max_queue = 0;
		er.opts.overflow = (kl_overflow)(r % 3);
		er.opts.flags = 0;
		er.delay = race_delay(r, 0);
		race_start(&er, &t, evict_racer_main, race_delay(r, 1));
		evicted_first = atomic_load(&er.done);
		ck_assert_int_eq(kl_mutex_leave(m, held, false), KL_OK);
		test_thread_join(t);
		tw_join_all(g);
		ck_assert_int_eq(er.rc, KL_OK);

		for (int i = 0; i < 2; i++) {
			int st = g->w[i].status;

			ck_assert_msg(st == KL_OK || st == KL_EOVERFLOW,
				      "round %ld: W%d got %s", r, i + 1,
				      kl_strerror(st));
			if (st == KL_OK)
				ck_assert_int_eq(g->w[i].leave_status, KL_OK);
		}
		/* FIFO: W2 can only have been granted after W1. */
		if (g->w[1].status == KL_OK) {
			ck_assert_int_eq(g->w[0].status, KL_OK);
			ck_assert_int_eq(g->w[0].seq, 0);
			ck_assert_int_eq(g->w[1].seq, 1);
		}
		/* set_opts returned before the leave: nobody was left. */
		if (evicted_first)
			ck_assert_msg(g->w[0].status == KL_EOVERFLOW &&
					      g->w[1].status == KL_EOVERFLOW,
				      "round %ld: granted after eviction", r);
		ok = (g->w[0].status == KL_OK) + (g->w[1].status == KL_OK);
		outcome[ok]++;

		ck_assert_uint_eq(kl_mutex_queue_size(m), 0);
		ck_assert_int_eq(kl_mutex_set_opts(m, &unbounded), KL_OK);
		assert_free(m);
		tw_free(g);
	}
	ck_assert_int_eq(outcome[0] + outcome[1] + outcome[2], rounds);
	fprintf(stderr,
		"race eviction/grant: both evicted %ld, W1 granted %ld, "
		"both granted %ld\n",
		outcome[0], outcome[1], outcome[2]);
	kl_mutex_free(m);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Stress                                                              */

#define STRESS_THREADS 8

static volatile long shared_counter; /* plain on purpose: mutual exclusion */

struct stress_arg {
	kl_mutex *m;
	long iters;
	long grants;
	long violations;
	long errors;
	long timeouts;
};

static void *
stress_main(void *arg)
{
	struct stress_arg *a = arg;
	kl_cancel *c = NULL;
	kl_token t;

	if (kl_cancel_new(&c) != KL_OK) {
		a->errors++;
		return NULL;
	}
	for (long i = 0; i < a->iters; i++) {
		int rc = KL_ETIMEDOUT;

		switch (i % 4) {
		case 0:
			rc = kl_mutex_enter(a->m, KL_FOREVER, NULL, &t);
			break;
		case 1:
			/* try_enter never barges: fall back to waiting. */
			for (int k = 0; k < 64 && rc == KL_ETIMEDOUT; k++) {
				rc = kl_mutex_try_enter(a->m, &t);
				if (rc == KL_ETIMEDOUT)
					sched_yield();
			}
			if (rc == KL_ETIMEDOUT)
				rc = kl_mutex_enter(a->m, KL_FOREVER, NULL,
						    &t);
			break;
		case 2:
			rc = kl_mutex_enter(a->m, 60000, NULL, &t);
			if (rc == KL_ETIMEDOUT) {
				a->timeouts++;
				continue;
			}
			break;
		default:
			rc = kl_mutex_enter(a->m, KL_FOREVER, c, &t);
			break;
		}
		if (rc != KL_OK) {
			a->errors++;
			continue;
		}
		a->grants++;
		for (int k = 0; k < 10; k++) {
			shared_counter++;
			/* Now and then give others the time to queue up. */
			if (k == 5 && i % 16 == 0)
				sched_yield();
		}
		if (shared_counter != 10)
			a->violations++;
		shared_counter = 0;
		if (kl_mutex_leave(a->m, t, false) != KL_OK)
			a->errors++;
	}
	kl_cancel_free(c);
	return NULL;
}

START_TEST(test_stress_mutual_exclusion)
{
	static struct stress_arg args[STRESS_THREADS];
	pthread_t t[STRESS_THREADS];
	long iters = kl_test_scaled(100000, 100);
	kl_mutex *m = new_mutex(KL_UNBOUNDED, KL_OVERFLOW_THIS, 0);
	long grants = 0;
	int64_t t0 = now_ms();

	shared_counter = 0;
	memset(args, 0, sizeof args);
	for (int i = 0; i < STRESS_THREADS; i++) {
		args[i].m = m;
		args[i].iters = iters;
		test_thread_start(&t[i], stress_main, &args[i]);
	}
	for (int i = 0; i < STRESS_THREADS; i++)
		test_thread_join(t[i]);
	for (int i = 0; i < STRESS_THREADS; i++) {
		ck_assert_int_eq(args[i].violations, 0);
		ck_assert_int_eq(args[i].errors, 0);
		ck_assert_int_eq(args[i].grants + args[i].timeouts, iters);
		grants += args[i].grants;
	}
	ck_assert_int_gt(grants, 0);
	ck_assert_int_eq(shared_counter, 0);
	fprintf(stderr, "stress: %ld grants in %lld ms\n", grants,
		(long long)(now_ms() - t0));
	assert_free(m);
	kl_mutex_free(m);
}
END_TEST

/*
 * FIFO under contention.  K waiters are queued in a known order (checked by
 * queue size) behind the test's hold; only then do the newcomers start, so
 * each of them arrives after all K.  Every grant, controlled or newcomer,
 * takes a number from one counter inside the critical section.  Strict FIFO
 * without barging means the K controlled waiters hold numbers 0..K-1 in
 * their queue order, and every newcomer's number is at least K, whether it
 * used enter or try_enter.
 */
#define NEWCOMERS 4

struct newcomer {
	struct tw_group *g;
	long iters;
	long min_seq;
	long grants;
	long errors;
};

static void *
newcomer_main(void *arg)
{
	struct newcomer *n = arg;
	kl_token t;

	for (long i = 0; i < n->iters; i++) {
		int rc;

		if (i % 2)
			rc = kl_mutex_try_enter(n->g->m, &t);
		else
			rc = kl_mutex_enter(n->g->m, KL_FOREVER, NULL, &t);
		if (rc == KL_ETIMEDOUT && i % 2)
			continue;
		if (rc != KL_OK) {
			n->errors++;
			continue;
		}
		{
			long seq = atomic_fetch_add(&n->g->next_seq, 1);

			if (seq < n->min_seq)
				n->min_seq = seq;
		}
		n->grants++;
		if (kl_mutex_leave(n->g->m, t, false) != KL_OK)
			n->errors++;
	}
	return NULL;
}

START_TEST(test_fifo_under_contention)
{
	enum { K = 16 };
	long reps = kl_test_scaled(20, 2);
	kl_mutex *m = new_mutex(KL_UNBOUNDED, KL_OVERFLOW_THIS, 0);

	for (long r = 0; r < reps; r++) {
		struct tw_group *g = tw_mutex(m, true);
		struct newcomer nc[NEWCOMERS];
		pthread_t t[NEWCOMERS];
		kl_token held;

		ck_assert_int_eq(kl_mutex_try_enter(m, &held), KL_OK);
		tw_start_n_queued(g, K, KL_FOREVER, NULL);
		for (int i = 0; i < NEWCOMERS; i++) {
			nc[i] = (struct newcomer){ .g = g, .iters = 200,
						   .min_seq = LONG_MAX };
			test_thread_start(&t[i], newcomer_main, &nc[i]);
		}
		/* Let some newcomers reach the queue (not required). */
		for (int k = 0; k < 100 && kl_mutex_queue_size(m) < K + 2;
		     k++)
			sched_yield();
		ck_assert_int_eq(kl_mutex_leave(m, held, false), KL_OK);
		for (int i = 0; i < NEWCOMERS; i++)
			test_thread_join(t[i]);
		tw_join_all(g);
		for (int i = 0; i < K; i++) {
			ck_assert_int_eq(g->w[i].status, KL_OK);
			ck_assert_msg(g->w[i].seq == i,
				      "round %ld: waiter %d granted %ld-th", r,
				      i, g->w[i].seq);
		}
		for (int i = 0; i < NEWCOMERS; i++) {
			ck_assert_int_eq(nc[i].errors, 0);
			ck_assert_int_ge(nc[i].grants, 100);
			ck_assert_msg(nc[i].min_seq >= K,
				      "round %ld: newcomer granted %ld-th", r,
				      nc[i].min_seq);
		}
		assert_free(m);
		tw_free(g);
	}
	kl_mutex_free(m);
}
END_TEST


/* ------------------------------------------------------------------ */
/* KL_EVENTUAL: barging allowed, starvation bounded */

static kl_mutex *
new_eventual(void)
{
	kl_queue_opts o = KL_QUEUE_OPTS_INIT;
	kl_mutex *m;

	o.flags = KL_EVENTUAL;
	ck_assert_int_eq(kl_mutex_new(&m, &o), KL_OK);
	return m;
}

struct ev_stress {
	kl_mutex *m;
	long iters;
	long counter; /* plain: guarded by m */
	atomic_long violations;
	atomic_long done;
};

static void *
ev_stress_worker(void *arg)
{
	struct ev_stress *st = arg;
	kl_token t;

	for (long i = 0; i < st->iters; i++) {
		if (kl_mutex_enter(st->m, KL_FOREVER, NULL, &t) != KL_OK) {
			atomic_fetch_add(&st->violations, 1);
			continue;
		}
		for (int k = 0; k < 10; k++)
			st->counter++;
		if (st->counter != 10)
			atomic_fetch_add(&st->violations, 1);
		st->counter = 0;
		if (kl_mutex_leave(st->m, t, false) != KL_OK)
			atomic_fetch_add(&st->violations, 1);
		atomic_fetch_add(&st->done, 1);
	}
	return NULL;
}

START_TEST(test_eventual_mutual_exclusion)
{
	struct ev_stress st = { .iters = kl_test_scaled(100000, 1000) };
	pthread_t t[4];

	st.m = new_eventual();
	atomic_init(&st.violations, 0);
	atomic_init(&st.done, 0);
	for (int i = 0; i < 4; i++)
		test_thread_start(&t[i], ev_stress_worker, &st);
	for (int i = 0; i < 4; i++)
		pthread_join(t[i], NULL);
	ck_assert_int_eq(atomic_load(&st.violations), 0);
	ck_assert_int_eq(atomic_load(&st.done), 4 * st.iters);
	ck_assert(!kl_mutex_is_locked(st.m));
	ck_assert_uint_eq(kl_mutex_queue_size(st.m), 0);
	kl_mutex_free(st.m);
}
END_TEST

START_TEST(test_eventual_starved_waiter_gets_hand_off)
{
	kl_mutex *m = new_eventual();
	struct tw_group *g = tw_mutex(m, false);
	kl_token t, t2;

	ck_assert_int_eq(kl_mutex_enter(m, 0, NULL, &t), KL_OK);
	tw_start_queued(g, KL_FOREVER, NULL);
	/* Past the 1 ms starvation bound, the leave must hand over. */
	while (now_ns() - g->w[0].start_ns < 3000000)
		test_sleep_ms(1);
	ck_assert_int_eq(kl_mutex_leave(m, t, false), KL_OK);
	ck_assert_int_eq(kl_mutex_try_enter(m, &t2), KL_ETIMEDOUT);
	ck_assert_int_eq(tw_pass(g), 0);
	tw_free(g);
	ck_assert(!kl_mutex_is_locked(m));
	kl_mutex_free(m);
}
END_TEST

START_TEST(test_eventual_serves_every_waiter)
{
	kl_mutex *m = new_eventual();
	struct tw_group *g = tw_mutex(m, true);
	kl_token t;

	ck_assert_int_eq(kl_mutex_enter(m, 0, NULL, &t), KL_OK);
	tw_start_n_queued(g, 8, KL_FOREVER, NULL);
	ck_assert_int_eq(kl_mutex_leave(m, t, false), KL_OK);
	tw_wait_granted(g, 8);
	tw_join_all(g);
	for (int i = 0; i < 8; i++) {
		ck_assert_int_eq(g->w[i].status, KL_OK);
		ck_assert_int_eq(g->w[i].leave_status, KL_OK);
	}
	tw_free(g);
	ck_assert(!kl_mutex_is_locked(m));
	ck_assert_uint_eq(kl_mutex_queue_size(m), 0);
	kl_mutex_free(m);
}
END_TEST

START_TEST(test_eventual_fixed_at_creation)
{
	kl_mutex *m = new_eventual(), *s;
	kl_queue_opts o = KL_QUEUE_OPTS_INIT;

	ck_assert_int_eq(kl_mutex_set_opts(m, &o), KL_EINVAL);
	o.flags = KL_EVENTUAL;
	o.max_queue = 4;
	ck_assert_int_eq(kl_mutex_set_opts(m, &o), KL_OK);
	ck_assert_int_eq(kl_mutex_new(&s, NULL), KL_OK);
	ck_assert_int_eq(kl_mutex_set_opts(s, &o), KL_EINVAL);
	kl_mutex_free(s);
	kl_mutex_free(m);
}
END_TEST

static Suite *
mutex_suite(void)
{
	Suite *s = suite_create("mutex");
	TCase *tc;

	tc = tcase_create("options");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_new_rejects_bad_opts);
	tcase_add_test(tc, test_opts_default);
	tcase_add_test(tc, test_set_opts_rejects_bad_opts);
	suite_add_tcase(s, tc);

	tc = tcase_create("state");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_is_locked_and_queue_size);
	tcase_add_test(tc, test_try_enter);
	tcase_add_test(tc, test_timeout_zero_tries_once);
	tcase_add_test(tc, test_bad_timeouts);
	tcase_add_test(tc, test_huge_timeouts_wait_forever);
	suite_add_tcase(s, tc);

	tc = tcase_create("tokens");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_token_ids_unique);
	tcase_add_test(tc, test_token_elapsed_grows);
	tcase_add_test(tc, test_leave_rejects_bad_tokens);
	tcase_add_test(tc, test_leave_from_another_thread);
	suite_add_tcase(s, tc);

	tc = tcase_create("fifo");
	tcase_set_timeout(tc, 120);
	/* test_asks_again_spins_behind's hooks, also after it failed
	 * without fork. */
	tcase_add_checked_fixture(tc, NULL, test_spin_reset);
	tcase_add_test(tc, test_fifo_grant_order);
	tcase_add_test(tc, test_fifo_long_queues);
	tcase_add_test(tc, test_direct_hand_off);
	tcase_add_test(tc, test_grant_prods_parked_new_head);
	tcase_add_test(tc, test_asks_again_spins_behind);
	tcase_add_test(tc, test_spin_learns);
	tcase_add_test(tc, test_timed_out_waiter_leaves_queue);
	tcase_add_test(tc, test_timeout_not_early);
	tcase_add_test(tc, test_leave_abort_pending);
	suite_add_tcase(s, tc);

	tc = tcase_create("overflow");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_overflow_this);
	tcase_add_test(tc, test_overflow_first);
	tcase_add_test(tc, test_overflow_last);
	tcase_add_test(tc, test_max_queue_zero);
	tcase_add_test(tc, test_set_opts_evicts_first);
	tcase_add_test(tc, test_set_opts_evicts_this);
	tcase_add_test(tc, test_set_opts_evicts_last);
	tcase_add_test(tc, test_set_opts_raise_keeps_waiters);
	suite_add_tcase(s, tc);

	tc = tcase_create("reentry");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_errorcheck_deadlk);
	tcase_add_test(tc, test_errorcheck_after_foreign_leave);
	tcase_add_test(tc, test_reenter_without_errorcheck_times_out);
	tcase_add_test(tc, test_errorcheck_fixed_at_creation);
	tcase_add_test(tc, test_errorcheck_turned_on_no_false_deadlk);
	suite_add_tcase(s, tc);

	tc = tcase_create("run");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_run_releases_and_passes_result);
	tcase_add_test(tc, test_run_not_acquired);
	tcase_add_test(tc, test_run_waits_its_turn);
	suite_add_tcase(s, tc);

	tc = tcase_create("races");
	tcase_set_timeout(tc, 300);
	tcase_add_test(tc, test_race_cancel_and_grant);
	tcase_add_test(tc, test_race_timeout_and_grant);
	tcase_add_test(tc, test_race_eviction_and_grant);
	suite_add_tcase(s, tc);

	tc = tcase_create("stress");
	tcase_set_timeout(tc, 300);
	tcase_add_test(tc, test_stress_mutual_exclusion);
	tcase_add_test(tc, test_fifo_under_contention);
	suite_add_tcase(s, tc);

	tc = tcase_create("eventual");
	tcase_set_timeout(tc, 300);
	tcase_add_test(tc, test_eventual_mutual_exclusion);
	tcase_add_test(tc, test_eventual_starved_waiter_gets_hand_off);
	tcase_add_test(tc, test_eventual_serves_every_waiter);
	tcase_add_test(tc, test_eventual_fixed_at_creation);
	suite_add_tcase(s, tc);
	return s;
}

int
main(void)
{
	return test_run_suite(mutex_suite());
}
