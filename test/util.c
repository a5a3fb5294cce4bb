/* SPDX-License-Identifier: MIT */
/*
 * Helpers shared by the Check suites (see util.h).  The waiter threads never
 * call ck_assert*: they only store their results under the group's mutex,
 * which the test's thread takes to read them before asserting.  Lock order:
 * the group's mutex is never held while calling into the library, except
 * for the non-blocking kl_mutex_queue_size and friends.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include "internal.h"
#include "util.h"

#include <check.h>
#include <errno.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define TEST_STACK_SIZE (512 * 1024)

double
kl_test_scale(void)
{
	const char *s = getenv("KL_TEST_SCALE");
	char *end;
	double v;

	if (s == NULL || *s == '\0')
		return 1.0;
	v = strtod(s, &end);
	if (end == s || *end != '\0' || !(v > 0.0))
		return 1.0;
	return v;
}

long
kl_test_scaled(long n, long min)
{
	double v = (double)n * kl_test_scale();

	if (v < (double)min)
		return min;
	if (v > 1e12)
		return 1000000000000L;
	return (long)v;
}

int64_t
now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

int64_t
now_ms(void)
{
	return now_ns() / 1000000;
}

void
test_sleep_ms(int64_t ms)
{
	struct timespec ts = {
		.tv_sec = ms / 1000,
		.tv_nsec = (long)(ms % 1000) * 1000000,
	};

	while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
		;
}

void
test_relax(unsigned *spins)
{
	struct timespec ts = { .tv_sec = 0, .tv_nsec = 50000 };

	if (++*spins < 64)
		sched_yield();
	else
		nanosleep(&ts, NULL);
}

void
test_poll(bool (*cond)(void *arg), void *arg, const char *what)
{
	int64_t limit = now_ms() + TEST_POLL_LIMIT_MS;
	unsigned spins = 0;

	while (!cond(arg)) {
		if (now_ms() > limit)
			ck_abort_msg("still waiting for %s after %d ms", what,
				     TEST_POLL_LIMIT_MS);
		test_relax(&spins);
	}
}

void
test_thread_start(pthread_t *t, void *(*fn)(void *arg), void *arg)
{
	pthread_attr_t attr;
	int rc;

	ck_assert_int_eq(pthread_attr_init(&attr), 0);
	ck_assert_int_eq(pthread_attr_setstacksize(&attr, TEST_STACK_SIZE), 0);
	rc = pthread_create(t, &attr, fn, arg);
	pthread_attr_destroy(&attr);
	ck_assert_msg(rc == 0, "pthread_create: %s", strerror(rc));
}

void
test_thread_join(pthread_t t)
{
	int rc = pthread_join(t, NULL);

	ck_assert_msg(rc == 0, "pthread_join: %s", strerror(rc));
}

void
tev_init(struct test_events *e)
{
	memset(e, 0, sizeof *e);
	pthread_mutex_init(&e->mu, NULL);
}

void
tev_record(const kl_event *ev, void *arg)
{
	struct test_events *e = arg;

	pthread_mutex_lock(&e->mu);
	if (ev->type <= KL_EV_LOST) {
		e->n[ev->type]++;
		e->status_of[ev->type] = ev->status;
	}
	if (ev->type == KL_EV_LOST && e->lost_ns == 0)
		e->lost_ns = now_ns();
	e->last_status = ev->status;
	pthread_mutex_unlock(&e->mu);
}

int
tev_count(struct test_events *e, kl_event_type t)
{
	int n;

	pthread_mutex_lock(&e->mu);
	n = e->n[t];
	pthread_mutex_unlock(&e->mu);
	return n;
}

int
tev_wait(struct test_events *e, kl_event_type t, int64_t limit_ms)
{
	int64_t limit = now_ms() + limit_ms;

	while (tev_count(e, t) == 0 && now_ms() < limit)
		test_sleep_ms(2);
	return tev_count(e, t);
}

struct queue_cond {
	kl_mutex *m;
	kl_reset_event *e;
	size_t n;
};

static bool
queue_is(void *arg)
{
	struct queue_cond *c = arg;
	size_t len = c->m != NULL ? kl_mutex_queue_size(c->m)
				  : kl_reset_event_queue_size(c->e);

	return len == c->n;
}

void
test_wait_mutex_queue(kl_mutex *m, size_t n)
{
	struct queue_cond c = { .m = m, .n = n };

	test_poll(queue_is, &c, "the mutex queue size");
	ck_assert_uint_eq(kl_mutex_queue_size(m), n);
}

#ifdef KL_TEST_HOOKS /* the provider suites link the installed library */
static bool
parked_at_least(void *arg)
{
	return kl__test_parked() >= *(const long *)arg;
}

long
test_parked(void)
{
	return kl__test_parked();
}

void
test_wait_parked(long n)
{
	test_poll(parked_at_least, &n, "waiters to park");
}

long
test_prods(void)
{
	return kl__test_prods();
}
#endif

void
test_wait_event_queue(kl_reset_event *e, size_t n)
{
	struct queue_cond c = { .e = e, .n = n };

	test_poll(queue_is, &c, "the reset event queue size");
	ck_assert_uint_eq(kl_reset_event_queue_size(e), n);
}

/* ------------------------------------------------------------------ */
/* Waiter groups                                                       */

static struct tw_group *
tw_new(enum tw_kind kind)
{
	struct tw_group *g = calloc(1, sizeof *g);

	ck_assert_ptr_nonnull(g);
	g->kind = kind;
	atomic_init(&g->next_seq, 0);
	ck_assert_int_eq(pthread_mutex_init(&g->mu, NULL), 0);
	for (int i = 0; i < TW_MAX; i++)
		g->order[i] = -1;
	return g;
}

struct tw_group *
tw_mutex(kl_mutex *m, bool leave)
{
	struct tw_group *g = tw_new(TW_MUTEX);

	g->m = m;
	g->leave = leave;
	return g;
}

struct tw_group *
tw_event(kl_reset_event *e)
{
	struct tw_group *g = tw_new(TW_EVENT);

	g->e = e;
	return g;
}

void
tw_free(struct tw_group *g)
{
	if (g == NULL)
		return;
	tw_join_all(g);
	pthread_mutex_destroy(&g->mu);
	free(g);
}

/*
 * Records the outcome of the call.  On a grant the sequence number is taken
 * here, inside the critical section for a mutex, so it is the true grant
 * order there (for an event it only counts).
 */
static void
record(struct tw_waiter *w, int rc, kl_token tok, int64_t end_ns)
{
	struct tw_group *g = w->g;

	pthread_mutex_lock(&g->mu);
	w->end_ns = end_ns;
	w->status = rc;
	w->token = tok;
	if (rc == KL_OK) {
		long seq = atomic_fetch_add(&g->next_seq, 1);

		w->seq = seq;
		if (seq >= 0 && seq < TW_MAX)
			g->order[seq] = w->index;
		g->granted++;
	}
	pthread_mutex_unlock(&g->mu);
}

static void *
tw_main(void *arg)
{
	struct tw_waiter *w = arg;
	struct tw_group *g = w->g;
	int leave_status = 1;
	kl_token tok;
	int rc;

	memset(&tok, 0, sizeof tok);
	w->start_ns = now_ns();
	if (g->kind == TW_MUTEX)
		rc = kl_mutex_enter(g->m, w->timeout_ms, w->cancel, &tok);
	else
		rc = kl_reset_event_wait(g->e, w->timeout_ms, w->cancel);
	record(w, rc, tok, now_ns());
	if (rc == KL_OK && g->kind == TW_MUTEX && g->leave)
		leave_status = kl_mutex_leave(g->m, tok, false);

	pthread_mutex_lock(&g->mu);
	w->leave_status = leave_status;
	w->finished = true;
	g->finished++;
	pthread_mutex_unlock(&g->mu);
	return NULL;
}

int
tw_start(struct tw_group *g, int64_t timeout_ms, kl_cancel *c)
{
	struct tw_waiter *w;

	ck_assert_int_lt(g->n, TW_MAX);
	w = &g->w[g->n];
	w->g = g;
	w->index = g->n;
	w->timeout_ms = timeout_ms;
	w->cancel = c;
	w->joined = false;
	w->status = 1; /* no KL_* value: "never returned" */
	w->seq = -1;
	w->leave_status = 1;
	w->finished = false;
	test_thread_start(&w->thread, tw_main, w);
	return g->n++;
}

static size_t
tw_queue_size(struct tw_group *g)
{
	return g->kind == TW_MUTEX ? kl_mutex_queue_size(g->m)
				   : kl_reset_event_queue_size(g->e);
}

int
tw_start_queued(struct tw_group *g, int64_t timeout_ms, kl_cancel *c)
{
	size_t base = tw_queue_size(g);
	int i = tw_start(g, timeout_ms, c);

	tw_wait_queue(g, base + 1);
	return i;
}

void
tw_start_n_queued(struct tw_group *g, int n, int64_t timeout_ms,
		  kl_cancel *c)
{
	for (int i = 0; i < n; i++)
		tw_start_queued(g, timeout_ms, c);
}

void
tw_wait_queue(struct tw_group *g, size_t n)
{
	if (g->kind == TW_MUTEX)
		test_wait_mutex_queue(g->m, n);
	else
		test_wait_event_queue(g->e, n);
}

bool
tw_finished(struct tw_group *g, int i)
{
	bool done;

	pthread_mutex_lock(&g->mu);
	done = g->w[i].finished;
	pthread_mutex_unlock(&g->mu);
	return done;
}

int
tw_granted(struct tw_group *g)
{
	int n;

	pthread_mutex_lock(&g->mu);
	n = g->granted;
	pthread_mutex_unlock(&g->mu);
	return n;
}

struct count_cond {
	struct tw_group *g;
	int n;
};

static bool
count_reached(void *arg)
{
	struct count_cond *c = arg;

	return tw_granted(c->g) >= c->n;
}

void
tw_wait_granted(struct tw_group *g, int n)
{
	struct count_cond c = { .g = g, .n = n };

	test_poll(count_reached, &c, "waiters to be granted");
}

static bool
waiter_finished(void *arg)
{
	struct tw_waiter *w = arg;

	return tw_finished(w->g, w->index);
}

void
tw_wait_finished(struct tw_group *g, int i)
{
	ck_assert_int_lt(i, g->n);
	test_poll(waiter_finished, &g->w[i], "a waiter to finish");
}

void
tw_join(struct tw_group *g, int i)
{
	ck_assert_int_lt(i, g->n);
	if (g->w[i].joined)
		return;
	/* A bounded wait first, so a lost wake-up fails instead of hanging. */
	tw_wait_finished(g, i);
	test_thread_join(g->w[i].thread);
	g->w[i].joined = true;
}

void
tw_join_all(struct tw_group *g)
{
	for (int i = 0; i < g->n; i++)
		tw_join(g, i);
}

struct order_cond {
	struct tw_group *g;
	int seq;
};

static bool
order_known(void *arg)
{
	struct order_cond *c = arg;
	bool known;

	pthread_mutex_lock(&c->g->mu);
	known = c->g->order[c->seq] >= 0;
	pthread_mutex_unlock(&c->g->mu);
	return known;
}

int
tw_pass(struct tw_group *g)
{
	struct order_cond c = { .g = g, .seq = g->passed };
	kl_token tok;
	int i, st;

	ck_assert(g->kind == TW_MUTEX && !g->leave);
	ck_assert_int_lt(g->passed, TW_MAX);
	test_poll(order_known, &c, "the next grant");
	pthread_mutex_lock(&g->mu);
	i = g->order[g->passed];
	st = g->w[i].status;
	tok = g->w[i].token;
	pthread_mutex_unlock(&g->mu);
	ck_assert_int_eq(st, KL_OK);
	ck_assert_int_eq(kl_mutex_leave(g->m, tok, false), KL_OK);
	g->passed++;
	return i;
}

int64_t
tw_waited_ns(const struct tw_group *g, int i)
{
	return g->w[i].end_ns - g->w[i].start_ns;
}
