/* SPDX-License-Identifier: MIT */
/*
 * Cancellation tokens: firing, self-firing after a delay, and their effect on
 * waits.  A fired token ends every wait using it with KL_ECANCELED, on any
 * mutex or event, and is refused at once when it has fired before the wait;
 * a grant made before the fire stands.  Waiter threads record, the test's
 * thread asserts (util.h).
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <check.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "keylock.h"
#include "util.h"

/* Generous upper bound on any wait that should end "at once" or after a
 * short delay: timing never decides a test, it only catches hangs. */
#define SLOW_NS (INT64_C(5000) * 1000000)

static kl_mutex *
new_held_mutex(kl_token *tok)
{
	kl_mutex *m;

	ck_assert_int_eq(kl_mutex_new(&m, NULL), KL_OK);
	ck_assert_int_eq(kl_mutex_try_enter(m, tok), KL_OK);
	return m;
}

START_TEST(test_new_fire_fired_free)
{
	kl_cancel *c = NULL;

	ck_assert_int_eq(kl_cancel_new(&c), KL_OK);
	ck_assert_ptr_nonnull(c);
	ck_assert(!kl_cancel_fired(c));
	kl_cancel_fire(c);
	ck_assert(kl_cancel_fired(c));
	kl_cancel_free(c);
	kl_cancel_free(NULL);
}
END_TEST

START_TEST(test_fire_twice)
{
	kl_cancel *c;

	ck_assert_int_eq(kl_cancel_new(&c), KL_OK);
	kl_cancel_fire(c);
	kl_cancel_fire(c);
	ck_assert(kl_cancel_fired(c));
	kl_cancel_free(c);
}
END_TEST

START_TEST(test_new_timeout_zero_is_fired)
{
	kl_cancel *c = NULL;

	ck_assert_int_eq(kl_cancel_new_timeout(&c, 0), KL_OK);
	ck_assert_ptr_nonnull(c);
	ck_assert(kl_cancel_fired(c));
	kl_cancel_fire(c);
	ck_assert(kl_cancel_fired(c));
	kl_cancel_free(c);
}
END_TEST

START_TEST(test_new_timeout_negative)
{
	static const int64_t bad[] = { -2, -1000, INT64_MIN };

	for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
		kl_cancel *c = (kl_cancel *)&c; /* must be reset to NULL */

		ck_assert_int_eq(kl_cancel_new_timeout(&c, bad[i]), KL_EINVAL);
		ck_assert_ptr_null(c);
	}
}
END_TEST

START_TEST(test_new_timeout_forever_never_fires)
{
	kl_token tok;
	kl_mutex *m = new_held_mutex(&tok);
	struct tw_group *g = tw_mutex(m, true);
	kl_cancel *c;

	ck_assert_int_eq(kl_cancel_new_timeout(&c, KL_FOREVER), KL_OK);
	ck_assert(!kl_cancel_fired(c));
	/* A wait with its own 100 ms timeout ends by that timeout, not by
	 * the token. */
	tw_start(g, 100, c);
	tw_join(g, 0);
	ck_assert_int_eq(g->w[0].status, KL_ETIMEDOUT);
	ck_assert_int_ge(tw_waited_ns(g, 0), INT64_C(100) * 1000000);
	ck_assert(!kl_cancel_fired(c));
	tw_free(g);

	/* It can still be fired by hand. */
	kl_cancel_fire(c);
	ck_assert(kl_cancel_fired(c));
	kl_cancel_free(c);
	ck_assert_int_eq(kl_mutex_leave(m, tok, false), KL_OK);
	kl_mutex_free(m);
}
END_TEST

static bool
token_fired(void *arg)
{
	return kl_cancel_fired(arg);
}

START_TEST(test_new_timeout_fires_by_itself)
{
	int64_t t0 = now_ns(), t1;
	kl_cancel *c;

	ck_assert_int_eq(kl_cancel_new_timeout(&c, 50), KL_OK);
	/* Not early: if it already shows fired, 50 ms have passed. */
	if (kl_cancel_fired(c))
		ck_assert_int_ge(now_ns() - t0, INT64_C(50) * 1000000);
	test_poll(token_fired, c, "the token to fire by itself");
	t1 = now_ns();
	ck_assert_int_ge(t1 - t0, INT64_C(50) * 1000000);
	ck_assert_int_lt(t1 - t0, SLOW_NS);
	kl_cancel_free(c);
}
END_TEST

START_TEST(test_new_timeout_ends_a_wait)
{
	kl_token tok;
	kl_mutex *m = new_held_mutex(&tok);
	struct tw_group *g = tw_mutex(m, true);
	int64_t t0 = now_ns();
	kl_cancel *c;

	ck_assert_int_eq(kl_cancel_new_timeout(&c, 50), KL_OK);
	tw_start(g, KL_FOREVER, c);
	tw_join(g, 0);
	ck_assert_int_eq(g->w[0].status, KL_ECANCELED);
	ck_assert_int_ge(g->w[0].end_ns - t0, INT64_C(50) * 1000000);
	ck_assert_int_lt(g->w[0].end_ns - t0, SLOW_NS);
	ck_assert(kl_cancel_fired(c));
	ck_assert_uint_eq(kl_mutex_queue_size(m), 0);
	/* The holder is not disturbed. */
	ck_assert(kl_mutex_is_locked(m));
	ck_assert_int_eq(kl_mutex_leave(m, tok, false), KL_OK);
	ck_assert(!kl_mutex_is_locked(m));
	tw_free(g);
	kl_cancel_free(c);
	kl_mutex_free(m);
}
END_TEST

START_TEST(test_fire_ends_a_wait)
{
	kl_token tok;
	kl_mutex *m = new_held_mutex(&tok);
	struct tw_group *g = tw_mutex(m, true);
	kl_cancel *c;

	ck_assert_int_eq(kl_cancel_new(&c), KL_OK);
	tw_start_queued(g, KL_FOREVER, c);
	/* Firing does not block although the mutex is held. */
	kl_cancel_fire(c);
	tw_join(g, 0);
	ck_assert_int_eq(g->w[0].status, KL_ECANCELED);
	ck_assert_int_eq(g->w[0].seq, -1);
	ck_assert_uint_eq(kl_mutex_queue_size(m), 0);
	ck_assert(kl_mutex_is_locked(m));
	ck_assert_int_eq(kl_mutex_leave(m, tok, false), KL_OK);
	ck_assert(!kl_mutex_is_locked(m));
	tw_free(g);
	kl_cancel_free(c);
	kl_mutex_free(m);
}
END_TEST

static void *
fire_main(void *arg)
{
	kl_cancel_fire(arg);
	return NULL;
}

START_TEST(test_fire_from_another_thread)
{
	kl_token tok;
	kl_mutex *m = new_held_mutex(&tok);
	struct tw_group *g = tw_mutex(m, true);
	kl_cancel *c;
	pthread_t t;

	ck_assert_int_eq(kl_cancel_new(&c), KL_OK);
	tw_start_queued(g, KL_FOREVER, c);
	test_thread_start(&t, fire_main, c);
	test_thread_join(t);
	tw_join(g, 0);
	ck_assert_int_eq(g->w[0].status, KL_ECANCELED);
	ck_assert_uint_eq(kl_mutex_queue_size(m), 0);
	ck_assert_int_eq(kl_mutex_leave(m, tok, false), KL_OK);
	tw_free(g);
	kl_cancel_free(c);
	kl_mutex_free(m);
}
END_TEST

#define NMUTEX 4

START_TEST(test_one_token_many_waits)
{
	kl_mutex *m[NMUTEX];
	kl_token tok[NMUTEX];
	struct tw_group *g[NMUTEX], *bystander, *ge;
	kl_reset_event *e;
	kl_cancel *c;

	ck_assert_int_eq(kl_cancel_new(&c), KL_OK);
	ck_assert_int_eq(kl_reset_event_new(&e, false, NULL), KL_OK);
	for (int i = 0; i < NMUTEX; i++) {
		m[i] = new_held_mutex(&tok[i]);
		g[i] = tw_mutex(m[i], true);
	}
	bystander = tw_mutex(m[0], true);
	ge = tw_event(e);

	/* 8 waiters on 4 mutexes (2 each), a waiter without the token
	 * between them on m[0], and 2 waiters on the event. */
	tw_start_queued(g[0], KL_FOREVER, c);
	tw_start_queued(bystander, KL_FOREVER, NULL);
	tw_start_queued(g[0], KL_FOREVER, c);
	for (int i = 1; i < NMUTEX; i++)
		tw_start_n_queued(g[i], 2, KL_FOREVER, c);
	tw_start_n_queued(ge, 2, KL_FOREVER, c);
	ck_assert_uint_eq(kl_mutex_queue_size(m[0]), 3);

	kl_cancel_fire(c);
	for (int i = 0; i < NMUTEX; i++) {
		tw_join_all(g[i]);
		for (int j = 0; j < 2; j++) {
			ck_assert_int_eq(g[i]->w[j].status, KL_ECANCELED);
			ck_assert_int_eq(g[i]->w[j].seq, -1);
		}
	}
	tw_join_all(ge);
	ck_assert_int_eq(ge->w[0].status, KL_ECANCELED);
	ck_assert_int_eq(ge->w[1].status, KL_ECANCELED);
	ck_assert_uint_eq(kl_reset_event_queue_size(e), 0);
	ck_assert(!kl_reset_event_is_signaled(e));

	/* Only the bystander is left, and it gets m[0] on release. */
	ck_assert_uint_eq(kl_mutex_queue_size(m[0]), 1);
	ck_assert(!tw_finished(bystander, 0));
	for (int i = 1; i < NMUTEX; i++) {
		ck_assert_uint_eq(kl_mutex_queue_size(m[i]), 0);
		ck_assert(kl_mutex_is_locked(m[i]));
		ck_assert_int_eq(kl_mutex_leave(m[i], tok[i], false), KL_OK);
	}
	ck_assert_int_eq(kl_mutex_leave(m[0], tok[0], false), KL_OK);
	tw_join_all(bystander);
	ck_assert_int_eq(bystander->w[0].status, KL_OK);
	ck_assert_int_eq(bystander->w[0].leave_status, KL_OK);
	ck_assert(!kl_mutex_is_locked(m[0]));

	tw_free(bystander);
	tw_free(ge);
	for (int i = 0; i < NMUTEX; i++) {
		tw_free(g[i]);
		kl_mutex_free(m[i]);
	}
	kl_reset_event_free(e);
	kl_cancel_free(c);
}
END_TEST

static int fn_calls;

static int
count_call(void *arg)
{
	(void)arg;
	fn_calls++;
	return 0;
}

START_TEST(test_prefired_token)
{
	kl_mutex *m;
	kl_reset_event *e;
	kl_token tok, held;
	kl_cancel *c;
	int64_t t0;
	int res = 7;

	ck_assert_int_eq(kl_cancel_new(&c), KL_OK);
	kl_cancel_fire(c);
	ck_assert_int_eq(kl_mutex_new(&m, NULL), KL_OK);

	/* Free mutex: refused, and left free. */
	t0 = now_ns();
	ck_assert_int_eq(kl_mutex_enter(m, KL_FOREVER, c, &tok), KL_ECANCELED);
	ck_assert(!kl_mutex_is_locked(m));
	ck_assert_int_eq(kl_mutex_enter(m, 0, c, &tok), KL_ECANCELED);
	ck_assert(!kl_mutex_is_locked(m));
	fn_calls = 0;
	ck_assert_int_eq(kl_mutex_run(m, KL_FOREVER, c, count_call, NULL, &res),
			 KL_ECANCELED);
	ck_assert_int_eq(fn_calls, 0);
	ck_assert(!kl_mutex_is_locked(m));

	/* Held mutex: refused at once, not queued. */
	ck_assert_int_eq(kl_mutex_try_enter(m, &held), KL_OK);
	ck_assert_int_eq(kl_mutex_enter(m, 5000, c, &tok), KL_ECANCELED);
	ck_assert_uint_eq(kl_mutex_queue_size(m), 0);
	ck_assert_int_lt(now_ns() - t0, SLOW_NS);
	ck_assert_int_eq(kl_mutex_leave(m, held, false), KL_OK);

	/* The same token from kl_cancel_new_timeout(0). */
	kl_cancel_free(c);
	ck_assert_int_eq(kl_cancel_new_timeout(&c, 0), KL_OK);
	ck_assert_int_eq(kl_mutex_enter(m, KL_FOREVER, c, &tok), KL_ECANCELED);
	ck_assert(!kl_mutex_is_locked(m));

	/* Reset event, signaled or not; a refused wait spends no budget. */
	{
		kl_reset_opts o = KL_RESET_OPTS_INIT;

		o.auto_reset_count = 1;
		ck_assert_int_eq(kl_reset_event_new(&e, true, &o), KL_OK);
	}
	ck_assert_int_eq(kl_reset_event_wait(e, KL_FOREVER, c), KL_ECANCELED);
	ck_assert(kl_reset_event_is_signaled(e));
	ck_assert_int_eq(kl_reset_event_wait(e, 0, NULL), KL_OK);
	ck_assert(!kl_reset_event_is_signaled(e));
	ck_assert_int_eq(kl_reset_event_wait(e, 5000, c), KL_ECANCELED);
	ck_assert_uint_eq(kl_reset_event_queue_size(e), 0);
	ck_assert_int_lt(now_ns() - t0, SLOW_NS);

	kl_reset_event_free(e);
	kl_cancel_free(c);
	kl_mutex_free(m);
}
END_TEST

START_TEST(test_fire_after_grant)
{
	kl_mutex *m;
	kl_token tok, held;
	kl_cancel *c;
	struct tw_group *g;

	/* Granted at once on a free mutex, then fired: still the owner. */
	ck_assert_int_eq(kl_cancel_new(&c), KL_OK);
	ck_assert_int_eq(kl_mutex_new(&m, NULL), KL_OK);
	ck_assert_int_eq(kl_mutex_enter(m, KL_FOREVER, c, &tok), KL_OK);
	kl_cancel_fire(c);
	ck_assert(kl_mutex_is_locked(m));
	ck_assert_int_eq(kl_mutex_try_enter(m, &held), KL_ETIMEDOUT);
	ck_assert_int_eq(kl_mutex_leave(m, tok, false), KL_OK);
	ck_assert(!kl_mutex_is_locked(m));
	kl_cancel_free(c);

	/* Granted by hand-off after waiting, then fired: the waiter keeps
	 * the mutex and its token still leaves it. */
	ck_assert_int_eq(kl_cancel_new(&c), KL_OK);
	g = tw_mutex(m, false);
	ck_assert_int_eq(kl_mutex_try_enter(m, &held), KL_OK);
	tw_start_queued(g, KL_FOREVER, c);
	ck_assert_int_eq(kl_mutex_leave(m, held, false), KL_OK);
	tw_wait_granted(g, 1);
	kl_cancel_fire(c);
	tw_join(g, 0);
	ck_assert_int_eq(g->w[0].status, KL_OK);
	ck_assert(kl_mutex_is_locked(m));
	ck_assert_int_eq(tw_pass(g), 0);
	ck_assert(!kl_mutex_is_locked(m));
	tw_free(g);
	kl_cancel_free(c);
	kl_mutex_free(m);
}
END_TEST

START_TEST(test_fire_only_affects_its_waits)
{
	kl_token tok;
	kl_mutex *m = new_held_mutex(&tok);
	struct tw_group *g = tw_mutex(m, true);
	kl_cancel *c1, *c2;

	/* Queue: [c1, c2, c1]; firing c1 leaves only the c2 waiter. */
	ck_assert_int_eq(kl_cancel_new(&c1), KL_OK);
	ck_assert_int_eq(kl_cancel_new(&c2), KL_OK);
	tw_start_queued(g, KL_FOREVER, c1);
	tw_start_queued(g, KL_FOREVER, c2);
	tw_start_queued(g, KL_FOREVER, c1);
	kl_cancel_fire(c1);
	tw_join(g, 0);
	tw_join(g, 2);
	ck_assert_int_eq(g->w[0].status, KL_ECANCELED);
	ck_assert_int_eq(g->w[2].status, KL_ECANCELED);
	ck_assert_uint_eq(kl_mutex_queue_size(m), 1);
	ck_assert(!kl_cancel_fired(c2));
	ck_assert_int_eq(kl_mutex_leave(m, tok, false), KL_OK);
	tw_join(g, 1);
	ck_assert_int_eq(g->w[1].status, KL_OK);
	ck_assert_int_eq(g->w[1].leave_status, KL_OK);
	ck_assert(!kl_mutex_is_locked(m));
	tw_free(g);
	kl_cancel_free(c1);
	kl_cancel_free(c2);
	kl_mutex_free(m);
}
END_TEST

START_TEST(test_token_reused_after_wait)
{
	kl_token tok, held;
	kl_mutex *m = new_held_mutex(&held);
	struct tw_group *g = tw_mutex(m, true);
	kl_cancel *c;

	/* A token not fired can serve many waits in turn (and at once). */
	ck_assert_int_eq(kl_cancel_new(&c), KL_OK);
	for (int i = 0; i < 10; i++) {
		ck_assert_int_eq(kl_mutex_enter(m, 0, c, &tok), KL_ETIMEDOUT);
		ck_assert_int_eq(kl_mutex_enter(m, 1, c, &tok), KL_ETIMEDOUT);
	}
	tw_start_n_queued(g, 3, KL_FOREVER, c);
	ck_assert_int_eq(kl_mutex_leave(m, held, false), KL_OK);
	tw_join_all(g);
	for (int i = 0; i < 3; i++) {
		ck_assert_int_eq(g->w[i].status, KL_OK);
		ck_assert_int_eq(g->w[i].seq, i);
	}
	ck_assert(!kl_cancel_fired(c));
	ck_assert(!kl_mutex_is_locked(m));
	tw_free(g);
	kl_cancel_free(c);
	kl_mutex_free(m);
}
END_TEST

struct settle {
	struct tw_group *g;
	size_t queued;
};

static bool
queued_or_first_finished(void *arg)
{
	struct settle *s = arg;
	size_t q = kl_mutex_queue_size(s->g->m);

	return q == s->queued ||
	       (tw_finished(s->g, 0) && q == s->queued - 1);
}

/*
 * A token that fired by itself is fired for everyone from its deadline on:
 * a leave made after kl_cancel_fired() showed true must not grant a waiter
 * using it, even when that waiter has not yet woken to notice; the lock
 * goes to the next waiter instead.
 */
START_TEST(test_self_fired_token_never_granted)
{
	long rounds = kl_test_scaled(500, 10);
	kl_mutex *m;
	long woke_first = 0;

	ck_assert_int_eq(kl_mutex_new(&m, NULL), KL_OK);
	for (long r = 0; r < rounds; r++) {
		struct tw_group *g = tw_mutex(m, true);
		struct settle s1 = { .g = g, .queued = 1 };
		struct settle s2 = { .g = g, .queued = 2 };
		kl_token held;
		kl_cancel *c;

		ck_assert_int_eq(kl_mutex_try_enter(m, &held), KL_OK);
		ck_assert_int_eq(kl_cancel_new_timeout(&c, 1 + r % 3), KL_OK);
		tw_start(g, KL_FOREVER, c); /* W1, with the token */
		test_poll(queued_or_first_finished, &s1, "W1 to queue");
		tw_start(g, KL_FOREVER, NULL); /* W2 */
		test_poll(queued_or_first_finished, &s2, "W2 to queue");
		while (!kl_cancel_fired(c))
			;
		if (tw_finished(g, 0))
			woke_first++;
		ck_assert_int_eq(kl_mutex_leave(m, held, false), KL_OK);
		tw_join_all(g);
		ck_assert_msg(g->w[0].status == KL_ECANCELED,
			      "round %ld: W1 got %s after its token fired", r,
			      kl_strerror(g->w[0].status));
		ck_assert_int_eq(g->w[1].status, KL_OK);
		ck_assert_int_eq(g->w[1].seq, 0);
		ck_assert_int_eq(g->w[1].leave_status, KL_OK);
		ck_assert(!kl_mutex_is_locked(m));
		tw_free(g);
		kl_cancel_free(c);
	}
	fprintf(stderr, "self-fired token: W1 had woken first in %ld of %ld\n",
		woke_first, rounds);
	kl_mutex_free(m);
}
END_TEST

static Suite *
cancel_suite(void)
{
	Suite *s = suite_create("cancel");
	TCase *tc;

	tc = tcase_create("token");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_new_fire_fired_free);
	tcase_add_test(tc, test_fire_twice);
	tcase_add_test(tc, test_new_timeout_zero_is_fired);
	tcase_add_test(tc, test_new_timeout_negative);
	tcase_add_test(tc, test_new_timeout_forever_never_fires);
	tcase_add_test(tc, test_new_timeout_fires_by_itself);
	suite_add_tcase(s, tc);

	tc = tcase_create("waits");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_new_timeout_ends_a_wait);
	tcase_add_test(tc, test_fire_ends_a_wait);
	tcase_add_test(tc, test_fire_from_another_thread);
	tcase_add_test(tc, test_one_token_many_waits);
	tcase_add_test(tc, test_prefired_token);
	tcase_add_test(tc, test_fire_after_grant);
	tcase_add_test(tc, test_fire_only_affects_its_waits);
	tcase_add_test(tc, test_token_reused_after_wait);
	suite_add_tcase(s, tc);

	tc = tcase_create("races");
	tcase_set_timeout(tc, 300);
	tcase_add_test(tc, test_self_fired_token_never_granted);
	suite_add_tcase(s, tc);
	return s;
}

int
main(void)
{
	return test_run_suite(cancel_suite());
}
