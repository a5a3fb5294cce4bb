/* SPDX-License-Identifier: MIT */
/*
 * Helpers shared by the Check suites: the workload scale, a monotonic clock,
 * bounded polling of observable state, and groups of waiter threads that
 * block in kl_mutex_enter or kl_reset_event_wait and record what happened to
 * them.
 *
 * Only the test's own thread calls ck_assert* (libcheck/check#18): waiter
 * threads record their index, status and a grant sequence number, and the
 * test asserts after joining them or after observing a counter they bump.
 * Orders are forced by waiting on observable state (queue sizes, counters),
 * never by sleeping; every such wait fails the test after TEST_POLL_LIMIT_MS.
 */
#ifndef KL_TEST_UTIL_H
#define KL_TEST_UTIL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "keylock.h"

/* How long any poll may wait for observable state before failing. */
#define TEST_POLL_LIMIT_MS 10000
/* Most waiters one group can hold. */
#define TW_MAX 256

/* KL_TEST_SCALE from the environment (default 1.0, must be > 0). */
double kl_test_scale(void);
/* n times the scale, at least min. */
long kl_test_scaled(long n, long min);

/* CLOCK_MONOTONIC in milliseconds and nanoseconds. */
int64_t now_ms(void);
int64_t now_ns(void);
/* Lets time pass (only for durations under test, never to order threads). */
void test_sleep_ms(int64_t ms);
/* One step of a polling loop: sched_yield at first, short naps later. */
void test_relax(unsigned *spins);

/* Calls cond(arg) until it returns true; fails the test (with what in the
 * message) after TEST_POLL_LIMIT_MS.  Test thread only. */
void test_poll(bool (*cond)(void *arg), void *arg, const char *what);

/* pthread_create with a modest stack; fails the test on error.  Test thread
 * only. */
void test_thread_start(pthread_t *t, void *(*fn)(void *arg), void *arg);
void test_thread_join(pthread_t t);

/* A lock's events, recorded: kl_lock_opts.on_event = tev_record
 * with event_arg = the recorder.  Counts per type, when the first
 * KL_EV_LOST came (now_ns), and the last statuses.  Any thread. */
struct test_events {
	pthread_mutex_t mu;
	int n[KL_EV_LOST + 1];
	int64_t lost_ns;
	int last_status;                 /* of the last event of any type */
	int status_of[KL_EV_LOST + 1];   /* of the last event of each type */
};
void tev_init(struct test_events *e);
void tev_record(const kl_event *ev, void *arg);
int tev_count(struct test_events *e, kl_event_type t);
/* Polls up to limit_ms until e has an event of type t; returns how many. */
int tev_wait(struct test_events *e, kl_event_type t, int64_t limit_ms);

/* Polls until the queue size is exactly n (test thread only). */
void test_wait_mutex_queue(kl_mutex *m, size_t n);
void test_wait_event_queue(kl_reset_event *e, size_t n);

/* The wait queue's counters (kl__test_parked, kl__test_prods): threads
 * parked on their words now; polls until at least n are; prods made so
 * far.  Test build only (KL_TEST_HOOKS). */
long test_parked(void);
void test_wait_parked(long n);
long test_prods(void);

/* ------------------------------------------------------------------ */
/* Waiter groups                                                       */

enum tw_kind { TW_MUTEX, TW_EVENT };

struct tw_group;

struct tw_waiter {
	struct tw_group *g;
	int index;
	/* Inputs, set by tw_start. */
	int64_t timeout_ms;
	kl_cancel *cancel;
	pthread_t thread;
	bool joined;
	int64_t start_ns; /* just before the call */
	/* Outputs, written under g->mu: read them after tw_join,
	 * tw_wait_finished or tw_finished returned true. */
	int status;       /* what enter or wait returned */
	long seq;         /* grant sequence (-1: not granted) */
	kl_token token;   /* the owner token on KL_OK (mutex) */
	int leave_status; /* with leave mode, what leave returned */
	int64_t end_ns;   /* just after the call returned */
	bool finished;
};

/*
 * The results travel from waiter to test under a pthread mutex rather than
 * through atomics alone, so that helgrind, which does not model C11
 * atomics, sees the hand-over as well as TSan does.
 */
struct tw_group {
	enum tw_kind kind;
	kl_mutex *m;
	kl_reset_event *e;
	bool leave; /* mutex: leave right after recording the grant */
	int n;      /* waiters started (test's thread only) */
	int passed; /* grants handed on by tw_pass (test's thread only) */
	/* Grant numbers; atomic so that other threads of a test may take
	 * numbers from the same sequence inside the critical section. */
	atomic_long next_seq;
	pthread_mutex_t mu;  /* guards what follows and the outputs */
	int granted;         /* waiters that recorded a grant */
	int finished;        /* waiters whose call returned and are done */
	int order[TW_MAX];   /* order[seq] = index, -1 until known */
	struct tw_waiter w[TW_MAX];
};

/* A group of waiters on m.  With leave, each waiter leaves as soon as it has
 * recorded its grant; without, the test leaves on its behalf (tw_pass). */
struct tw_group *tw_mutex(kl_mutex *m, bool leave);
/* A group of waiters on e. */
struct tw_group *tw_event(kl_reset_event *e);
/* Joins every waiter not yet joined, then frees the group. */
void tw_free(struct tw_group *g);

/* Starts one waiter (kl_mutex_enter or kl_reset_event_wait with timeout_ms
 * and c) and returns its index, without waiting for it to queue. */
int tw_start(struct tw_group *g, int64_t timeout_ms, kl_cancel *c);
/* Starts one waiter and waits until the queue has grown by one, so that
 * waiters started this way queue in index order. */
int tw_start_queued(struct tw_group *g, int64_t timeout_ms, kl_cancel *c);
/* tw_start_queued n times. */
void tw_start_n_queued(struct tw_group *g, int n, int64_t timeout_ms,
		       kl_cancel *c);

/* Whether waiter i is done (its outputs are then readable). */
bool tw_finished(struct tw_group *g, int i);
/* How many waiters recorded a grant so far. */
int tw_granted(struct tw_group *g);
/* Polls until the group's queue size is n. */
void tw_wait_queue(struct tw_group *g, size_t n);
/* Polls until at least n waiters recorded a grant. */
void tw_wait_granted(struct tw_group *g, int n);
/* Polls until waiter i has finished. */
void tw_wait_finished(struct tw_group *g, int i);
/* Joins waiter i (or all of them). */
void tw_join(struct tw_group *g, int i);
void tw_join_all(struct tw_group *g);
/* Mutex groups without leave: waits for the next grant (in sequence
 * order), leaves with that waiter's token, asserts KL_OK and returns the
 * waiter's index. */
int tw_pass(struct tw_group *g);
/* Nanoseconds waiter i spent in its call. */
int64_t tw_waited_ns(const struct tw_group *g, int i);

#endif /* KL_TEST_UTIL_H */
