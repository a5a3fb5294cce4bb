/* SPDX-License-Identifier: MIT */
/*
 * kl_reset_event (ResetEvent of node-async-locks, translated to blocking
 * threads): set releases queued waiters in FIFO order, manual events stay
 * signaled, auto_reset_count N releases at most N and carries the unspent
 * budget to later waits, set on a signaled event and reset on a non-signaled
 * one do nothing, and bounded queues, timeouts and cancel tokens behave as
 * for kl_mutex.  Races between a set and a cancel or a timeout must spend
 * the budget on exactly one waiter.
 *
 * The release order of a manual set is not observable from the released
 * threads, so FIFO is checked with auto_reset_count 1: each set releases
 * exactly one waiter, which the test joins before the next set.  Waiter
 * threads only record; the test's thread asserts (util.h).
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <check.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "keylock.h"
#include "util.h"

#define MS (INT64_C(1000000)) /* nanoseconds */
#define SLOW_NS (INT64_C(5000) * MS)

static kl_reset_event *
new_event(bool signaled, size_t max_queue, kl_overflow overflow,
	  size_t auto_reset_count)
{
	kl_reset_opts o = KL_RESET_OPTS_INIT;
	kl_reset_event *e = NULL;

	o.max_queue = max_queue;
	o.overflow = overflow;
	o.auto_reset_count = auto_reset_count;
	ck_assert_int_eq(kl_reset_event_new(&e, signaled, &o), KL_OK);
	ck_assert_ptr_nonnull(e);
	return e;
}

static kl_reset_event *
new_manual(bool signaled)
{
	return new_event(signaled, KL_UNBOUNDED, KL_OVERFLOW_THIS,
			 KL_UNBOUNDED);
}

/* Waiter i has not returned and the queue holds exactly n. */
static void
assert_waiting(struct tw_group *g, int i, size_t n)
{
	ck_assert_uint_eq(kl_reset_event_queue_size(g->e), n);
	ck_assert_msg(!tw_finished(g, i),
		      "waiter %d returned %s", i, kl_strerror(g->w[i].status));
}

/* With auto_reset_count 1: each set releases exactly the next waiter of
 * order[] (n of them), and the event is non-signaled after each. */
static void
release_one_by_one(struct tw_group *g, const int *order, int n)
{
	for (int k = 0; k < n; k++) {
		kl_reset_event_set(g->e);
		ck_assert(!kl_reset_event_is_signaled(g->e));
		ck_assert_uint_eq(kl_reset_event_queue_size(g->e),
				  (size_t)(n - k - 1));
		tw_join(g, order[k]);
		ck_assert_int_eq(g->w[order[k]].status, KL_OK);
		for (int j = k + 1; j < n; j++)
			assert_waiting(g, order[j], (size_t)(n - k - 1));
	}
}

/* ------------------------------------------------------------------ */
/* Creation and state                                                  */

START_TEST(test_new_rejects_bad_opts)
{
	kl_reset_opts o = KL_RESET_OPTS_INIT;
	kl_reset_event *e;

	e = (kl_reset_event *)&o;
	o.auto_reset_count = 0;
	ck_assert_int_eq(kl_reset_event_new(&e, false, &o), KL_EINVAL);
	ck_assert_ptr_null(e);
	e = (kl_reset_event *)&o;
	ck_assert_int_eq(kl_reset_event_new(&e, true, &o), KL_EINVAL);
	ck_assert_ptr_null(e);

	e = (kl_reset_event *)&o;
	o.auto_reset_count = 1;
	o.overflow = (kl_overflow)3;
	ck_assert_int_eq(kl_reset_event_new(&e, false, &o), KL_EINVAL);
	ck_assert_ptr_null(e);
	ck_assert_int_eq(kl_reset_event_new(NULL, false, NULL), KL_EINVAL);

	/* NULL opts: a manual-reset event. */
	ck_assert_int_eq(kl_reset_event_new(&e, false, NULL), KL_OK);
	ck_assert(!kl_reset_event_is_signaled(e));
	ck_assert_uint_eq(kl_reset_event_queue_size(e), 0);
	kl_reset_event_set(e);
	for (int i = 0; i < 100; i++)
		ck_assert_int_eq(kl_reset_event_wait(e, 0, NULL), KL_OK);
	ck_assert(kl_reset_event_is_signaled(e));
	kl_reset_event_free(e);
	kl_reset_event_free(NULL);
}
END_TEST

START_TEST(test_non_signaled_blocks)
{
	kl_reset_event *e = new_manual(false);
	int64_t t0, d;

	ck_assert(!kl_reset_event_is_signaled(e));
	ck_assert_int_eq(kl_reset_event_wait(e, 0, NULL), KL_ETIMEDOUT);
	t0 = now_ns();
	ck_assert_int_eq(kl_reset_event_wait(e, 30, NULL), KL_ETIMEDOUT);
	d = now_ns() - t0;
	ck_assert_int_ge(d, 30 * MS);
	ck_assert_int_lt(d, 30 * MS + SLOW_NS);
	ck_assert_uint_eq(kl_reset_event_queue_size(e), 0);
	ck_assert(!kl_reset_event_is_signaled(e));
	kl_reset_event_free(e);
}
END_TEST

START_TEST(test_bad_timeouts)
{
	static const int64_t bad[] = { -2, -1000, INT64_MIN };
	kl_reset_event *e = new_manual(false);

	for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
		ck_assert_int_eq(kl_reset_event_wait(e, bad[i], NULL),
				 KL_EINVAL);
		ck_assert_uint_eq(kl_reset_event_queue_size(e), 0);
	}
	kl_reset_event_set(e);
	for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
		ck_assert_int_eq(kl_reset_event_wait(e, bad[i], NULL),
				 KL_EINVAL);
	ck_assert_int_eq(kl_reset_event_wait(NULL, 0, NULL), KL_EINVAL);
	kl_reset_event_free(e);
}
END_TEST

START_TEST(test_set_releases_all)
{
	enum { N = 8 };
	kl_reset_event *e = new_manual(false);
	struct tw_group *g = tw_event(e);

	tw_start_n_queued(g, N, KL_FOREVER, NULL);
	tw_start_queued(g, INT64_MAX, NULL);
	ck_assert(!kl_reset_event_is_signaled(e));
	kl_reset_event_set(e);
	ck_assert(kl_reset_event_is_signaled(e));
	ck_assert_uint_eq(kl_reset_event_queue_size(e), 0);
	tw_join_all(g);
	for (int i = 0; i <= N; i++)
		ck_assert_int_eq(g->w[i].status, KL_OK);

	/* Manual reset: it stays signaled and later waits return at once. */
	for (int i = 0; i < 10; i++)
		ck_assert_int_eq(kl_reset_event_wait(e, KL_FOREVER, NULL),
				 KL_OK);
	ck_assert(kl_reset_event_is_signaled(e));
	tw_free(g);
	kl_reset_event_free(e);
}
END_TEST

START_TEST(test_reset)
{
	kl_reset_event *e = new_manual(true);
	struct tw_group *g = tw_event(e);

	ck_assert(kl_reset_event_is_signaled(e));
	ck_assert_int_eq(kl_reset_event_wait(e, 0, NULL), KL_OK);
	kl_reset_event_reset(e);
	ck_assert(!kl_reset_event_is_signaled(e));
	ck_assert_int_eq(kl_reset_event_wait(e, 0, NULL), KL_ETIMEDOUT);

	/* reset on a non-signaled event does nothing: waiters stay. */
	tw_start_n_queued(g, 2, KL_FOREVER, NULL);
	kl_reset_event_reset(e);
	ck_assert(!kl_reset_event_is_signaled(e));
	assert_waiting(g, 0, 2);
	assert_waiting(g, 1, 2);

	/* set on a signaled event does nothing either. */
	kl_reset_event_set(e);
	kl_reset_event_set(e);
	ck_assert(kl_reset_event_is_signaled(e));
	tw_join_all(g);
	ck_assert_int_eq(g->w[0].status, KL_OK);
	ck_assert_int_eq(g->w[1].status, KL_OK);
	kl_reset_event_reset(e);
	kl_reset_event_reset(e);
	ck_assert(!kl_reset_event_is_signaled(e));
	ck_assert_int_eq(kl_reset_event_wait(e, 0, NULL), KL_ETIMEDOUT);
	tw_free(g);
	kl_reset_event_free(e);

	/* NULL is harmless. */
	kl_reset_event_set(NULL);
	kl_reset_event_reset(NULL);
	ck_assert(!kl_reset_event_is_signaled(NULL));
	ck_assert_uint_eq(kl_reset_event_queue_size(NULL), 0);
}
END_TEST

/* ------------------------------------------------------------------ */
/* auto_reset_count                                                    */

START_TEST(test_auto_reset_one_is_fifo)
{
	enum { N = 10 };
	kl_reset_event *e =
		new_event(false, KL_UNBOUNDED, KL_OVERFLOW_THIS, 1);
	struct tw_group *g = tw_event(e);
	int order[N];

	tw_start_n_queued(g, N, KL_FOREVER, NULL);
	for (int i = 0; i < N; i++)
		order[i] = i;
	release_one_by_one(g, order, N);
	tw_free(g);
	kl_reset_event_free(e);
}
END_TEST

START_TEST(test_auto_reset_releases_first_n)
{
	enum { N = 3, M = 7 };
	kl_reset_event *e =
		new_event(false, KL_UNBOUNDED, KL_OVERFLOW_THIS, N);
	struct tw_group *g = tw_event(e);

	tw_start_n_queued(g, M, KL_FOREVER, NULL);
	kl_reset_event_set(e);
	/* Exactly the first N, and non-signaled after the Nth. */
	ck_assert(!kl_reset_event_is_signaled(e));
	ck_assert_uint_eq(kl_reset_event_queue_size(e), M - N);
	for (int i = 0; i < N; i++) {
		tw_join(g, i);
		ck_assert_int_eq(g->w[i].status, KL_OK);
	}
	for (int i = N; i < M; i++)
		assert_waiting(g, i, M - N);
	ck_assert_int_eq(kl_reset_event_wait(e, 0, NULL), KL_ETIMEDOUT);

	/* The next set: the next N, in order. */
	kl_reset_event_set(e);
	ck_assert(!kl_reset_event_is_signaled(e));
	ck_assert_uint_eq(kl_reset_event_queue_size(e), M - 2 * N);
	for (int i = N; i < 2 * N; i++) {
		tw_join(g, i);
		ck_assert_int_eq(g->w[i].status, KL_OK);
	}
	assert_waiting(g, M - 1, M - 2 * N);

	/* Fewer than N left: all go, the rest of the budget stays. */
	kl_reset_event_set(e);
	tw_join(g, M - 1);
	ck_assert_int_eq(g->w[M - 1].status, KL_OK);
	ck_assert(kl_reset_event_is_signaled(e));
	for (int i = 0; i < N - (M - 2 * N); i++)
		ck_assert_int_eq(kl_reset_event_wait(e, 0, NULL), KL_OK);
	ck_assert(!kl_reset_event_is_signaled(e));
	ck_assert_int_eq(kl_reset_event_wait(e, 0, NULL), KL_ETIMEDOUT);
	tw_free(g);
	kl_reset_event_free(e);
}
END_TEST

START_TEST(test_auto_reset_budget_spent_later)
{
	enum { N = 5 };
	kl_reset_event *e =
		new_event(false, KL_UNBOUNDED, KL_OVERFLOW_THIS, N);
	struct tw_group *g = tw_event(e);

	tw_start_n_queued(g, 2, KL_FOREVER, NULL);
	kl_reset_event_set(e);
	tw_join(g, 0);
	tw_join(g, 1);
	ck_assert_int_eq(g->w[0].status, KL_OK);
	ck_assert_int_eq(g->w[1].status, KL_OK);
	ck_assert(kl_reset_event_is_signaled(e));

	/* Three left: two waits here, one in another thread. */
	ck_assert_int_eq(kl_reset_event_wait(e, 0, NULL), KL_OK);
	ck_assert_int_eq(kl_reset_event_wait(e, KL_FOREVER, NULL), KL_OK);
	ck_assert(kl_reset_event_is_signaled(e));
	tw_start(g, KL_FOREVER, NULL);
	tw_join(g, 2);
	ck_assert_int_eq(g->w[2].status, KL_OK);
	ck_assert(!kl_reset_event_is_signaled(e));

	/* Spent: waits block again until the next set. */
	ck_assert_int_eq(kl_reset_event_wait(e, 0, NULL), KL_ETIMEDOUT);
	tw_start_queued(g, KL_FOREVER, NULL);
	assert_waiting(g, 3, 1);
	kl_reset_event_set(e);
	tw_join(g, 3);
	ck_assert_int_eq(g->w[3].status, KL_OK);
	ck_assert(kl_reset_event_is_signaled(e)); /* 4 of 5 left */
	tw_free(g);
	kl_reset_event_free(e);
}
END_TEST

START_TEST(test_created_signaled_has_budget)
{
	enum { N = 3 };
	kl_reset_event *e =
		new_event(true, KL_UNBOUNDED, KL_OVERFLOW_THIS, N);

	ck_assert(kl_reset_event_is_signaled(e));
	for (int i = 0; i < N; i++) {
		ck_assert(kl_reset_event_is_signaled(e));
		ck_assert_int_eq(kl_reset_event_wait(e, 0, NULL), KL_OK);
	}
	ck_assert(!kl_reset_event_is_signaled(e));
	ck_assert_int_eq(kl_reset_event_wait(e, 0, NULL), KL_ETIMEDOUT);
	kl_reset_event_free(e);

	/* With budget 1, one wait and it is spent. */
	e = new_event(true, KL_UNBOUNDED, KL_OVERFLOW_THIS, 1);
	ck_assert_int_eq(kl_reset_event_wait(e, KL_FOREVER, NULL), KL_OK);
	ck_assert(!kl_reset_event_is_signaled(e));
	ck_assert_int_eq(kl_reset_event_wait(e, 0, NULL), KL_ETIMEDOUT);
	kl_reset_event_free(e);
}
END_TEST

START_TEST(test_set_on_signaled_keeps_budget)
{
	/* set on a signaled event does nothing: it does not refill. */
	kl_reset_event *e = new_event(true, KL_UNBOUNDED, KL_OVERFLOW_THIS, 3);

	ck_assert_int_eq(kl_reset_event_wait(e, 0, NULL), KL_OK);
	kl_reset_event_set(e);
	ck_assert_int_eq(kl_reset_event_wait(e, 0, NULL), KL_OK);
	ck_assert_int_eq(kl_reset_event_wait(e, 0, NULL), KL_OK);
	ck_assert(!kl_reset_event_is_signaled(e));
	ck_assert_int_eq(kl_reset_event_wait(e, 0, NULL), KL_ETIMEDOUT);

	/* reset then set refills. */
	kl_reset_event_set(e);
	ck_assert(kl_reset_event_is_signaled(e));
	ck_assert_int_eq(kl_reset_event_wait(e, 0, NULL), KL_OK);
	kl_reset_event_reset(e);
	ck_assert(!kl_reset_event_is_signaled(e));
	kl_reset_event_set(e);
	for (int i = 0; i < 3; i++)
		ck_assert_int_eq(kl_reset_event_wait(e, 0, NULL), KL_OK);
	ck_assert(!kl_reset_event_is_signaled(e));
	kl_reset_event_free(e);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Bounded queues                                                      */

/* The worked example: queue [A,B,C], max_queue 3, newcomer D; then sets
 * release the survivors one by one. */
static void
check_worked_example(kl_overflow overflow, int evicted, const int *order)
{
	kl_reset_event *e = new_event(false, 3, overflow, 1);
	struct tw_group *g = tw_event(e);

	tw_start_n_queued(g, 3, KL_FOREVER, NULL);
	tw_start(g, KL_FOREVER, NULL); /* D */
	tw_join(g, evicted);
	ck_assert_int_eq(g->w[evicted].status, KL_EOVERFLOW);
	tw_wait_queue(g, 3);
	release_one_by_one(g, order, 3);
	tw_free(g);
	kl_reset_event_free(e);
}

START_TEST(test_overflow_this)
{
	static const int order[] = { 0, 1, 2 };

	check_worked_example(KL_OVERFLOW_THIS, 3, order);
}
END_TEST

START_TEST(test_overflow_first)
{
	static const int order[] = { 1, 2, 3 };

	check_worked_example(KL_OVERFLOW_FIRST, 0, order);
}
END_TEST

START_TEST(test_overflow_last)
{
	static const int order[] = { 0, 1, 3 };

	check_worked_example(KL_OVERFLOW_LAST, 2, order);
}
END_TEST

START_TEST(test_max_queue_zero)
{
	for (int s = KL_OVERFLOW_THIS; s <= KL_OVERFLOW_LAST; s++) {
		kl_reset_event *e =
			new_event(false, 0, (kl_overflow)s, KL_UNBOUNDED);
		struct tw_group *g = tw_event(e);

		for (int i = 0; i < 3; i++)
			tw_start(g, KL_FOREVER, NULL);
		tw_join_all(g);
		for (int i = 0; i < 3; i++)
			ck_assert_int_eq(g->w[i].status, KL_EOVERFLOW);
		ck_assert_int_eq(kl_reset_event_wait(e, 5000, NULL),
				 KL_EOVERFLOW);
		ck_assert_uint_eq(kl_reset_event_queue_size(e), 0);
		/* A signaled event is still waited on. */
		kl_reset_event_set(e);
		ck_assert_int_eq(kl_reset_event_wait(e, KL_FOREVER, NULL),
				 KL_OK);
		tw_free(g);
		kl_reset_event_free(e);
	}
}
END_TEST

START_TEST(test_max_queue_counts_live_waiters)
{
	/* max_queue 2: a cancelled waiter frees its place at once. */
	kl_reset_event *e = new_event(false, 2, KL_OVERFLOW_THIS, 1);
	struct tw_group *g = tw_event(e);
	kl_cancel *c;
	static const int order[] = { 1, 2 };

	ck_assert_int_eq(kl_cancel_new(&c), KL_OK);
	tw_start_queued(g, KL_FOREVER, c);
	tw_start_queued(g, KL_FOREVER, NULL);
	kl_cancel_fire(c);
	tw_join(g, 0);
	ck_assert_int_eq(g->w[0].status, KL_ECANCELED);
	ck_assert_uint_eq(kl_reset_event_queue_size(e), 1);
	tw_start_queued(g, KL_FOREVER, NULL);
	ck_assert_uint_eq(kl_reset_event_queue_size(e), 2);
	release_one_by_one(g, order, 2);
	tw_free(g);
	kl_cancel_free(c);
	kl_reset_event_free(e);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Timeouts and cancellation                                           */

START_TEST(test_timed_out_waiter_leaves_queue)
{
	kl_reset_event *e =
		new_event(false, KL_UNBOUNDED, KL_OVERFLOW_THIS, 1);
	struct tw_group *g = tw_event(e);
	static const int order[] = { 0, 2, 3 };

	tw_start_queued(g, KL_FOREVER, NULL);
	tw_start_queued(g, 500, NULL);
	tw_start_queued(g, KL_FOREVER, NULL);
	tw_start_queued(g, INT64_MAX, NULL);
	tw_join(g, 1);
	ck_assert_int_eq(g->w[1].status, KL_ETIMEDOUT);
	ck_assert_int_ge(tw_waited_ns(g, 1), 500 * MS);
	ck_assert_int_lt(tw_waited_ns(g, 1), 500 * MS + SLOW_NS);
	ck_assert_uint_eq(kl_reset_event_queue_size(e), 3);
	/* The timed-out waiter spends no budget. */
	release_one_by_one(g, order, 3);
	tw_free(g);
	kl_reset_event_free(e);
}
END_TEST

START_TEST(test_cancel_ends_wait)
{
	kl_reset_event *e =
		new_event(false, KL_UNBOUNDED, KL_OVERFLOW_THIS, 2);
	struct tw_group *g = tw_event(e);
	kl_cancel *c;

	/* [A (c), B, C (c), D]: firing c leaves B and D, and a set with
	 * budget 2 releases both. */
	ck_assert_int_eq(kl_cancel_new(&c), KL_OK);
	tw_start_queued(g, KL_FOREVER, c);
	tw_start_queued(g, KL_FOREVER, NULL);
	tw_start_queued(g, KL_FOREVER, c);
	tw_start_queued(g, KL_FOREVER, NULL);
	kl_cancel_fire(c);
	tw_join(g, 0);
	tw_join(g, 2);
	ck_assert_int_eq(g->w[0].status, KL_ECANCELED);
	ck_assert_int_eq(g->w[2].status, KL_ECANCELED);
	ck_assert_uint_eq(kl_reset_event_queue_size(e), 2);
	ck_assert(!kl_reset_event_is_signaled(e));
	kl_reset_event_set(e);
	tw_join_all(g);
	ck_assert_int_eq(g->w[1].status, KL_OK);
	ck_assert_int_eq(g->w[3].status, KL_OK);
	ck_assert(!kl_reset_event_is_signaled(e));

	/* A fired token is refused at once, signaled or not, spending no
	 * budget. */
	ck_assert_int_eq(kl_reset_event_wait(e, KL_FOREVER, c), KL_ECANCELED);
	kl_reset_event_set(e);
	ck_assert_int_eq(kl_reset_event_wait(e, KL_FOREVER, c), KL_ECANCELED);
	ck_assert_int_eq(kl_reset_event_wait(e, 0, NULL), KL_OK);
	ck_assert_int_eq(kl_reset_event_wait(e, 0, NULL), KL_OK);
	ck_assert(!kl_reset_event_is_signaled(e));
	tw_free(g);
	kl_cancel_free(c);
	kl_reset_event_free(e);
}
END_TEST

START_TEST(test_cancel_timeout_token_ends_wait)
{
	kl_reset_event *e = new_manual(false);
	struct tw_group *g = tw_event(e);
	int64_t t0 = now_ns();
	kl_cancel *c;

	ck_assert_int_eq(kl_cancel_new_timeout(&c, 40), KL_OK);
	tw_start(g, KL_FOREVER, c);
	tw_join(g, 0);
	ck_assert_int_eq(g->w[0].status, KL_ECANCELED);
	ck_assert_int_ge(g->w[0].end_ns - t0, 40 * MS);
	ck_assert_int_lt(g->w[0].end_ns - t0, SLOW_NS);
	ck_assert_uint_eq(kl_reset_event_queue_size(e), 0);
	tw_free(g);
	kl_cancel_free(c);
	kl_reset_event_free(e);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Races: a set against a cancel or a timeout, with budget 1           */

struct racer {
	kl_reset_event *e;
	kl_cancel *c;
	atomic_bool ready;
	atomic_bool go;
	atomic_bool done;
	unsigned delay;
};

static void
spin(unsigned n)
{
	for (volatile unsigned i = 0; i < n; i++)
		;
}

static unsigned
race_delay(long round, int side)
{
	static const unsigned d[] = { 0, 0, 50, 200, 1000, 3000, 10 };

	return d[(round + side * 3) % (sizeof d / sizeof d[0])];
}

static void *
fire_racer_main(void *arg)
{
	struct racer *r = arg;
	unsigned n = 0;

	atomic_store(&r->ready, true);
	while (!atomic_load(&r->go))
		if (++n % 1024 == 0)
			sched_yield();
	spin(r->delay);
	kl_cancel_fire(r->c);
	atomic_store(&r->done, true);
	return NULL;
}

static bool
racer_ready(void *arg)
{
	struct racer *r = arg;

	return atomic_load(&r->ready);
}

/* After a set with budget 1 raced something that may end W1: exactly one
 * of W1 and W2 was released.  Releases W2 if needed and joins both. */
static bool
settle_one_release(struct tw_group *g, long round, int w1_failure)
{
	bool w1_released;

	ck_assert(!kl_reset_event_is_signaled(g->e));
	tw_wait_finished(g, 0);
	w1_released = g->w[0].status == KL_OK;
	if (w1_released) {
		/* The budget went to W1: W2 still waits. */
		assert_waiting(g, 1, 1);
		kl_reset_event_set(g->e);
	} else {
		ck_assert_msg(g->w[0].status == w1_failure,
			      "round %ld: W1 got %s", round,
			      kl_strerror(g->w[0].status));
	}
	tw_join_all(g);
	ck_assert_int_eq(g->w[1].status, KL_OK);
	ck_assert(!kl_reset_event_is_signaled(g->e));
	ck_assert_uint_eq(kl_reset_event_queue_size(g->e), 0);
	return w1_released;
}

START_TEST(test_race_cancel_and_set)
{
	long rounds = kl_test_scaled(2000, 20);
	kl_reset_event *e =
		new_event(false, KL_UNBOUNDED, KL_OVERFLOW_THIS, 1);
	long released = 0, canceled = 0;

	for (long r = 0; r < rounds; r++) {
		struct tw_group *g = tw_event(e);
		struct racer fr = { .e = e };
		bool fired_first;
		pthread_t t;

		ck_assert_int_eq(kl_cancel_new(&fr.c), KL_OK);
		tw_start_queued(g, KL_FOREVER, fr.c); /* W1 */
		tw_start_queued(g, KL_FOREVER, NULL); /* W2 */
		fr.delay = race_delay(r, 0);
		test_thread_start(&t, fire_racer_main, &fr);
		test_poll(racer_ready, &fr, "the racer to start");
		atomic_store(&fr.go, true);
		spin(race_delay(r, 1));
		fired_first = atomic_load(&fr.done);
		kl_reset_event_set(e);
		test_thread_join(t);

		if (settle_one_release(g, r, KL_ECANCELED)) {
			ck_assert_msg(!fired_first,
				      "round %ld: released after fire returned",
				      r);
			released++;
		} else {
			canceled++;
		}
		tw_free(g);
		kl_cancel_free(fr.c);
	}
	ck_assert_int_eq(released + canceled, rounds);
	fprintf(stderr, "race cancel/set: %ld released, %ld canceled\n",
		released, canceled);
	kl_reset_event_free(e);
}
END_TEST

struct settle {
	struct tw_group *g;
	size_t queued;
};

static bool
queued_or_w1_finished(void *arg)
{
	struct settle *s = arg;
	bool w1_done = tw_finished(s->g, 0);
	size_t q = kl_reset_event_queue_size(s->g->e);

	return q == s->queued || (w1_done && q == s->queued - 1);
}

START_TEST(test_race_timeout_and_set)
{
	static const int64_t offset_us[] = { -300, -100, -20, 0, 20, 100,
					     300 };
	long rounds = kl_test_scaled(2000, 20);
	kl_reset_event *e =
		new_event(false, KL_UNBOUNDED, KL_OVERFLOW_THIS, 1);
	long released = 0, timed_out = 0;

	for (long r = 0; r < rounds; r++) {
		struct tw_group *g = tw_event(e);
		struct settle s1 = { .g = g, .queued = 1 };
		struct settle s2 = { .g = g, .queued = 2 };
		int64_t timeout = 1 + r % 2, target;

		tw_start(g, timeout, NULL); /* W1 */
		test_poll(queued_or_w1_finished, &s1, "W1 to queue");
		tw_start(g, KL_FOREVER, NULL); /* W2, behind W1 */
		test_poll(queued_or_w1_finished, &s2, "W2 to queue");
		target = g->w[0].start_ns + timeout * MS +
			 offset_us[r % (sizeof offset_us /
					sizeof offset_us[0])] *
				 1000;
		while (now_ns() < target)
			;
		kl_reset_event_set(e);

		if (settle_one_release(g, r, KL_ETIMEDOUT)) {
			released++;
		} else {
			ck_assert_msg(tw_waited_ns(g, 0) >= timeout * MS,
				      "round %ld: timed out after %lld ns", r,
				      (long long)tw_waited_ns(g, 0));
			timed_out++;
		}
		tw_free(g);
	}
	ck_assert_int_eq(released + timed_out, rounds);
	fprintf(stderr, "race timeout/set: %ld released, %ld timed out\n",
		released, timed_out);
	kl_reset_event_free(e);
}
END_TEST

START_TEST(test_many_waiters_many_sets)
{
	/* Manual event, reset and set repeatedly with waiters arriving all
	 * the time: every wait returns KL_OK, none is lost. */
	enum { N = 16 };
	long rounds = kl_test_scaled(200, 5);
	kl_reset_event *e = new_manual(false);

	for (long r = 0; r < rounds; r++) {
		struct tw_group *g = tw_event(e);

		for (int i = 0; i < N; i++) {
			tw_start(g, KL_FOREVER, NULL);
			if (i % 4 == 3) {
				kl_reset_event_set(e);
				kl_reset_event_reset(e);
			}
		}
		kl_reset_event_set(e);
		tw_join_all(g);
		for (int i = 0; i < N; i++)
			ck_assert_int_eq(g->w[i].status, KL_OK);
		ck_assert_uint_eq(kl_reset_event_queue_size(e), 0);
		kl_reset_event_reset(e);
		tw_free(g);
	}
	kl_reset_event_free(e);
}
END_TEST

static Suite *
reset_event_suite(void)
{
	Suite *s = suite_create("reset_event");
	TCase *tc;

	tc = tcase_create("state");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_new_rejects_bad_opts);
	tcase_add_test(tc, test_non_signaled_blocks);
	tcase_add_test(tc, test_bad_timeouts);
	tcase_add_test(tc, test_set_releases_all);
	tcase_add_test(tc, test_reset);
	suite_add_tcase(s, tc);

	tc = tcase_create("auto_reset");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_auto_reset_one_is_fifo);
	tcase_add_test(tc, test_auto_reset_releases_first_n);
	tcase_add_test(tc, test_auto_reset_budget_spent_later);
	tcase_add_test(tc, test_created_signaled_has_budget);
	tcase_add_test(tc, test_set_on_signaled_keeps_budget);
	suite_add_tcase(s, tc);

	tc = tcase_create("overflow");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_overflow_this);
	tcase_add_test(tc, test_overflow_first);
	tcase_add_test(tc, test_overflow_last);
	tcase_add_test(tc, test_max_queue_zero);
	tcase_add_test(tc, test_max_queue_counts_live_waiters);
	suite_add_tcase(s, tc);

	tc = tcase_create("timeout_cancel");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_timed_out_waiter_leaves_queue);
	tcase_add_test(tc, test_cancel_ends_wait);
	tcase_add_test(tc, test_cancel_timeout_token_ends_wait);
	suite_add_tcase(s, tc);

	tc = tcase_create("races");
	tcase_set_timeout(tc, 300);
	tcase_add_test(tc, test_race_cancel_and_set);
	tcase_add_test(tc, test_race_timeout_and_set);
	tcase_add_test(tc, test_many_waiters_many_sets);
	suite_add_tcase(s, tc);
	return s;
}

int
main(void)
{
	return test_run_suite(reset_event_suite());
}
