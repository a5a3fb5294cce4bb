/* SPDX-License-Identifier: MIT */
/*
 * Stress: timed waits, races of a grant with a timeout or a cancel, signals
 * and pthread_cancel (TESTPLAN T03, T04, T05, T07, T12).
 *
 * T03: timed waits are never early; lateness is reported as p50/p99/max
 * and bounded by the larger of KL_TEST_LATE_P99_MS (default 50 ms) and four
 * times a plain condvar's p99 measured in the same run, so that a loaded CI
 * box does not fail it; edge timeout values behave as DESIGN
 * says.  T04/T05: two waiters queue behind the test's hold; the test leaves
 * at the first waiter's deadline plus an offset (T04) or races a cancel
 * fired from a third thread (T05); each round must end in exactly one
 * outcome with the lock passed on, and a third thread's try_enter must
 * then succeed at once.  T07: waiters are hit by SIGUSR1 (no SA_RESTART)
 * while they wait.  T12: a thread blocked in a wait is pthread_cancel'ed;
 * the wait is not a cancellation point, so it ends normally and the thread
 * dies at its next cancellation point with the queue intact.
 *
 * Debug-yield variants (KL_DEBUG_YIELD=1, seeded by KL_TEST_SEED) run T04
 * and T05 again; they set the variable before their first call into the
 * library, which works when each test runs in its own child (CK_FORK,
 * the default).
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <check.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "keylock.h"
#include "stress.h"

static int64_t
late_p99_bound_ns(void)
{
	const char *s = getenv("KL_TEST_LATE_P99_MS");
	long v = s != NULL ? strtol(s, NULL, 10) : 0;

	return (v > 0 ? v : 50) * ST_MS;
}

static kl_mutex *
new_mutex(void)
{
	kl_mutex *m = NULL;

	st_assert(kl_mutex_new(&m, NULL) == KL_OK, "kl_mutex_new");
	return m;
}

/* ------------------------------------------------------------------ */
/* T03: timed-wait accuracy                                            */

#define T03_THREADS 8
#define T03_WAITS 200
#define T03_WAIT_MS 10

struct t03 {
	kl_mutex *m;
	long waits;
	int64_t *late; /* T03_THREADS x waits */
	atomic_long early, bad;
};

struct t03_worker {
	struct t03 *x;
	int idx;
	pthread_t th;
};

static void *
t03_main(void *arg)
{
	struct t03_worker *w = arg;
	struct t03 *x = w->x;
	kl_token t;

	for (long i = 0; i < x->waits; i++) {
		int64_t t0 = now_ns(), d;
		int rc = kl_mutex_enter(x->m, T03_WAIT_MS, NULL, &t);

		d = now_ns() - t0 - T03_WAIT_MS * ST_MS;
		if (rc != KL_ETIMEDOUT)
			atomic_fetch_add(&x->bad, 1);
		if (d < 0)
			atomic_fetch_add(&x->early, 1);
		x->late[(long)w->idx * x->waits + i] = d;
	}
	return NULL;
}

/* The same waits on a pthread condvar that is never signalled: what the
 * scheduler alone makes of a 10 ms timed wait at this moment.  On a loaded
 * machine that is far worse than any fixed bound, so kl_mutex's lateness
 * is judged against it, measured in the same run. */
struct t03_base {
	pthread_mutex_t mu;
	pthread_cond_t cv;
	long waits;
	int64_t *late;
};

struct t03_base_worker {
	struct t03_base *b;
	int idx;
	pthread_t th;
};

static void *
t03_base_main(void *arg)
{
	struct t03_base_worker *w = arg;
	struct t03_base *b = w->b;

	for (long i = 0; i < b->waits; i++) {
		int64_t t0 = now_ns(), end = t0 + T03_WAIT_MS * ST_MS;
		struct timespec ts = { (time_t)(end / 1000000000),
				       (long)(end % 1000000000) };
		int rc;

		pthread_mutex_lock(&b->mu);
		do
			rc = pthread_cond_timedwait(&b->cv, &b->mu, &ts);
		while (rc == 0 && now_ns() < end);
		pthread_mutex_unlock(&b->mu);
		b->late[(long)w->idx * b->waits + i] = now_ns() - end;
	}
	return NULL;
}

/* The p99 lateness of the condvar baseline with T03_THREADS threads. */
static int64_t
t03_base_p99(long waits)
{
	static struct t03_base_worker w[T03_THREADS];
	struct t03_base b;
	pthread_condattr_t ca;
	size_t n = (size_t)(T03_THREADS * waits);
	int64_t p99;

	memset(&b, 0, sizeof b);
	b.waits = waits;
	b.late = calloc(n, sizeof *b.late);
	st_assert(b.late != NULL, "out of memory");
	st_assert(pthread_mutex_init(&b.mu, NULL) == 0, "mutex");
	st_assert(pthread_condattr_init(&ca) == 0 &&
			  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC) == 0 &&
			  pthread_cond_init(&b.cv, &ca) == 0,
		  "condvar");
	pthread_condattr_destroy(&ca);
	for (int i = 0; i < T03_THREADS; i++) {
		w[i].b = &b;
		w[i].idx = i;
		st_thread_start(&w[i].th, 0, t03_base_main, &w[i]);
	}
	for (int i = 0; i < T03_THREADS; i++)
		st_thread_join(w[i].th);
	p99 = st_percentile(b.late, n, 99);
	pthread_cond_destroy(&b.cv);
	pthread_mutex_destroy(&b.mu);
	free(b.late);
	return p99;
}

START_TEST(test_t03_timed_wait_accuracy)
{
	static struct t03_worker w[T03_THREADS];
	struct t03 x;
	kl_token held;
	int64_t p50, p99, max, base, bound = late_p99_bound_ns();
	size_t n;

	st_begin("T03a timed-wait accuracy");
	memset(&x, 0, sizeof x);
	x.m = new_mutex();
	x.waits = st_scaled(T03_WAITS, 1, 50);
	n = (size_t)(T03_THREADS * x.waits);
	x.late = calloc(n, sizeof *x.late);
	st_assert(x.late != NULL, "out of memory");
	st_assert(kl_mutex_try_enter(x.m, &held) == KL_OK, "hold");
	for (int i = 0; i < T03_THREADS; i++) {
		w[i].x = &x;
		w[i].idx = i;
		st_thread_start(&w[i].th, 0, t03_main, &w[i]);
	}
	for (int i = 0; i < T03_THREADS; i++)
		st_thread_join(w[i].th);
	/* The baseline before and after would bracket the load better, but
	 * one pass after is enough to tell a loaded machine from a slow
	 * library: the bound is four times the scheduler's own p99, never
	 * below the fixed one. */
	base = t03_base_p99(x.waits);
	if (4 * base > bound)
		bound = 4 * base;
	max = st_percentile(x.late, n, 100);
	p99 = st_percentile(x.late, n, 99);
	p50 = st_percentile(x.late, n, 50);
	st_note("%d threads x %ld waits of %d ms: %ld early, lateness p50 "
		"%.3f ms, p99 %.3f ms, max %.3f ms (p99 bound %.0f ms; a "
		"condvar's p99 %.3f ms)",
		T03_THREADS, x.waits, T03_WAIT_MS, atomic_load(&x.early),
		(double)p50 / ST_MS, (double)p99 / ST_MS, (double)max / ST_MS,
		(double)bound / ST_MS, (double)base / ST_MS);
	st_assert(atomic_load(&x.bad) == 0, "%ld waits did not time out",
		  atomic_load(&x.bad));
	st_assert(atomic_load(&x.early) == 0, "%ld waits returned early",
		  atomic_load(&x.early));
	st_assert(p99 <= bound, "p99 lateness %.3f ms > %.0f ms",
		  (double)p99 / ST_MS, (double)bound / ST_MS);
	st_assert(kl_mutex_queue_size(x.m) == 0, "timed-out waiters queued");
	st_assert(kl_mutex_leave(x.m, held, false) == KL_OK, "leave");
	free(x.late);
	kl_mutex_free(x.m);
}
END_TEST

START_TEST(test_t03_uncontended_timeout_fast)
{
	long rounds = st_scaled(1000, 1, 100);
	int64_t *d = calloc((size_t)rounds, sizeof *d), p99, max;
	kl_mutex *m = new_mutex();
	long bad = 0;

	st_begin("T03c uncontended enter with timeout 2000 ms");
	st_assert(d != NULL, "out of memory");
	for (long i = 0; i < rounds; i++) {
		kl_token t;
		int64_t t0 = now_ns();
		int rc = kl_mutex_enter(m, 2000, NULL, &t);

		d[i] = now_ns() - t0;
		if (rc != KL_OK || kl_mutex_leave(m, t, false) != KL_OK)
			bad++;
	}
	max = st_percentile(d, (size_t)rounds, 100);
	p99 = st_percentile(d, (size_t)rounds, 99);
	st_note("%ld enters: p99 %.3f ms, max %.3f ms", rounds,
		(double)p99 / ST_MS, (double)max / ST_MS);
	st_assert(bad == 0, "%ld failed enters", bad);
	st_assert(max <= 100 * ST_MS, "an uncontended enter took %.3f ms",
		  (double)max / ST_MS);
	free(d);
	kl_mutex_free(m);
}
END_TEST

/* T03 (d): edge values of timeout_ms on a free and on a held mutex, an
 * event, a lock and a self-firing token. */
struct t03d_wait {
	kl_mutex *m;
	int64_t timeout;
	int rc;
	atomic_bool done;
	int64_t t_end;
};

static void *
t03d_main(void *arg)
{
	struct t03d_wait *a = arg;
	kl_token t;

	a->rc = kl_mutex_enter(a->m, a->timeout, NULL, &t);
	a->t_end = now_ns();
	if (a->rc == KL_OK)
		kl_mutex_leave(a->m, t, false);
	atomic_store(&a->done, true);
	return NULL;
}

/* A wait that must not end by itself: still queued after 100 ms, then
 * granted by the holder's leave. */
static void
t03d_forever(kl_mutex *m, kl_token held, int64_t timeout)
{
	struct t03d_wait a;
	pthread_t th;
	int64_t t_leave;

	memset(&a, 0, sizeof a);
	a.m = m;
	a.timeout = timeout;
	st_thread_start(&th, 0, t03d_main, &a);
	st_assert(st_poll_queue(m, 1, 10000), "timeout %lld: not queued",
		  (long long)timeout);
	test_sleep_ms(100);
	st_assert(!atomic_load(&a.done),
		  "timeout %lld ended by itself with %s", (long long)timeout,
		  kl_strerror(a.rc));
	t_leave = now_ns();
	st_assert(kl_mutex_leave(m, held, false) == KL_OK, "leave");
	st_thread_join(th);
	st_assert(a.rc == KL_OK, "timeout %lld: %s", (long long)timeout,
		  kl_strerror(a.rc));
	st_assert(a.t_end >= t_leave, "granted before the leave");
}

START_TEST(test_t03_edge_timeouts)
{
	static char sentinel; /* outputs must be reset from this */
	static const int64_t invalid[] = { -2, -3, -1000, INT64_MIN,
					   INT64_MIN + 1 };
	static const int64_t forever[] = { KL_FOREVER, INT64_MAX,
					   INT64_MAX - 1, INT64_MAX / 1000000,
					   INT64_MAX / 1000 };
	kl_mutex *m = new_mutex();
	kl_reset_event *e;
	kl_cancel *c;
	kl_token held, t;
	kl_lock *l;
	kl_lock_opts lo = KL_LOCK_OPTS_INIT;
	int64_t t0, d;
	int rc;

	st_begin("T03d edge timeout values");
	st_assert(kl_reset_event_new(&e, false, NULL) == KL_OK, "event");
	/* 0: try once, free or held. */
	st_assert(kl_mutex_enter(m, 0, NULL, &held) == KL_OK, "0 on free");
	t0 = now_ns();
	rc = kl_mutex_enter(m, 0, NULL, &t);
	d = now_ns() - t0;
	st_assert(rc == KL_ETIMEDOUT, "0 on held: %s", kl_strerror(rc));
	st_assert(d < 100 * ST_MS, "0 on held took %.3f ms",
		  (double)d / ST_MS);
	st_assert(kl_reset_event_wait(e, 0, NULL) == KL_ETIMEDOUT,
		  "event 0");
	/* Other negatives: KL_EINVAL at once, free or held, nothing
	 * queued. */
	for (size_t i = 0; i < sizeof invalid / sizeof invalid[0]; i++) {
		kl_mutex *f = new_mutex();
		kl_cancel *ct = (kl_cancel *)(void *)&sentinel;

		st_assert(kl_mutex_enter(m, invalid[i], NULL, &t) == KL_EINVAL,
			  "%lld on held", (long long)invalid[i]);
		st_assert(t.id == 0, "token set on KL_EINVAL");
		st_assert(kl_mutex_enter(f, invalid[i], NULL, &t) == KL_EINVAL,
			  "%lld on free", (long long)invalid[i]);
		st_assert(!kl_mutex_is_locked(f), "taken on KL_EINVAL");
		st_assert(kl_reset_event_wait(e, invalid[i], NULL) ==
				  KL_EINVAL,
			  "event %lld", (long long)invalid[i]);
		st_assert(kl_cancel_new_timeout(&ct, invalid[i]) == KL_EINVAL &&
				  ct == NULL,
			  "cancel_new_timeout %lld", (long long)invalid[i]);
		lo.timeout_ms = invalid[i];
		l = (kl_lock *)(void *)&sentinel;
		st_assert(kl_lock_new(&l, &lo) == KL_EINVAL && l == NULL,
			  "kl_lock_new timeout %lld", (long long)invalid[i]);
		kl_mutex_free(f);
	}
	st_assert(kl_mutex_queue_size(m) == 0, "queued after KL_EINVAL");
	/* 1 ms: times out, never early. */
	t0 = now_ns();
	rc = kl_mutex_enter(m, 1, NULL, &t);
	d = now_ns() - t0;
	st_assert(rc == KL_ETIMEDOUT, "1 on held: %s", kl_strerror(rc));
	st_assert(d >= ST_MS, "1 ms wait returned after %lld ns",
		  (long long)d);
	/* Forever and huge values: wait until granted, no overflow. */
	for (size_t i = 0; i < sizeof forever / sizeof forever[0]; i++) {
		t03d_forever(m, held, forever[i]);
		st_assert(kl_mutex_try_enter(m, &held) == KL_OK, "re-hold");
	}
	/* Self-firing tokens with huge times never fire. */
	for (size_t i = 0; i < sizeof forever / sizeof forever[0]; i++) {
		st_assert(kl_cancel_new_timeout(&c, forever[i]) == KL_OK,
			  "cancel_new_timeout %lld", (long long)forever[i]);
		st_assert(!kl_cancel_fired(c), "%lld fired",
			  (long long)forever[i]);
		st_assert(kl_mutex_enter(m, 5, c, &t) == KL_ETIMEDOUT,
			  "token %lld", (long long)forever[i]);
		kl_cancel_free(c);
		lo.timeout_ms = forever[i];
		st_assert(kl_lock_new(&l, &lo) == KL_OK, "kl_lock_new %lld",
			  (long long)forever[i]);
		kl_lock_free(l);
	}
	st_assert(kl_mutex_leave(m, held, false) == KL_OK, "leave");
	st_assert(kl_mutex_queue_size(m) == 0 && !kl_mutex_is_locked(m),
		  "state left behind");
	kl_reset_event_free(e);
	kl_mutex_free(m);
}
END_TEST

/* ------------------------------------------------------------------ */
/* T04: timeout vs grant                                               */

#define T04_TIMEOUT_MS 2
#define T04_OFFSETS 61 /* -300 .. +300 us in 10 us steps */
#define T04_REPS 200

enum { R_FIRST, R_SECOND, R_PROBE, R_FIRE, R_CREW };

struct race {
	kl_mutex *m;
	int64_t first_timeout; /* ms, T04; KL_FOREVER in T05 */
	kl_cancel *c;          /* T05: the first waiter's token */
	int64_t fire_at;       /* T05: when the fire thread fires */
	/* Outputs of the round. */
	int rc[2], leave_rc[2];
	atomic_llong t0_first;
	int64_t t_end_first;
	int probe_rc;
	int64_t probe_ns;
	long fire_seq;
	size_t queue_after_fire;
	atomic_int inside;
	atomic_long violations;
	atomic_long seq;
};

static void
race_enter(struct race *x, int who)
{
	kl_token t;
	int64_t t0 = now_ns();
	int rc;

	/* Published before the call: the holder times its leave from it. */
	if (who == 0)
		atomic_store(&x->t0_first, t0);
	rc = kl_mutex_enter(x->m, who == 0 ? x->first_timeout : KL_FOREVER,
			    who == 0 ? x->c : NULL, &t);
	if (who == 0)
		x->t_end_first = now_ns();
	x->rc[who] = rc;
	x->leave_rc[who] = 1;
	if (rc == KL_OK) {
		if (atomic_fetch_add(&x->inside, 1) != 0)
			atomic_fetch_add(&x->violations, 1);
		atomic_fetch_sub(&x->inside, 1);
		x->leave_rc[who] = kl_mutex_leave(x->m, t, false);
	}
}

static void
race_job(struct st_crew *c, int i)
{
	struct race *x = c->arg;
	kl_token t;

	switch (i) {
	case R_FIRST:
	case R_SECOND:
		race_enter(x, i);
		break;
	case R_PROBE: {
		/* The lock must be free now: try_enter within 10 ms. */
		int64_t t0 = now_ns(), limit = t0 + 10 * ST_MS;
		int rc;

		while ((rc = kl_mutex_try_enter(x->m, &t)) != KL_OK &&
		       now_ns() < limit)
			sched_yield();
		x->probe_ns = now_ns() - t0;
		x->probe_rc = rc;
		if (rc == KL_OK && kl_mutex_leave(x->m, t, false) != KL_OK)
			x->probe_rc = KL_EINVAL;
		break;
	}
	case R_FIRE:
		st_wait_until_ns(x->fire_at);
		kl_cancel_fire(x->c);
		x->fire_seq = atomic_fetch_add(&x->seq, 1);
		x->queue_after_fire = kl_mutex_queue_size(x->m);
		break;
	}
}

/* Queues the first waiter then the second behind the test's hold.
 * Returns 2 when both are queued; 1 when the first one timed out before
 * the second queued; 0 when it timed out before it was seen queued (the
 * second was not started then).  Rounds other than 2 are void. */
static int
race_queue_two(struct race *x, struct st_crew *crew, long base)
{
	int64_t limit = now_ms() + 10000;
	unsigned spins = 0;

	st_crew_go(crew, R_FIRST);
	while (kl_mutex_queue_size(x->m) != 1) {
		if (atomic_load(&crew->done) > base)
			return 0;
		st_assert(now_ms() < limit, "first waiter not queued");
		test_relax(&spins);
	}
	st_crew_go(crew, R_SECOND);
	for (spins = 0;;) {
		if (kl_mutex_queue_size(x->m) == 2)
			return 2;
		if (atomic_load(&crew->done) > base)
			break; /* the first one finished: timed out */
		st_assert(now_ms() < limit, "second waiter not queued");
		test_relax(&spins);
	}
	st_assert(st_poll_queue(x->m, 1, 10000), "second waiter not queued");
	return 1;
}

/* Ends a round: both waiters done, then the probe.  Returns false if the
 * round is stuck. */
static void
race_finish(struct race *x, struct st_crew *crew, long *base, long round)
{
	bool ok = st_poll_count(&crew->done, *base + 2, 5000 * st_slow());

	st_assert(ok, "round %ld stuck: first %s, second %s, queue %zu, "
		      "locked %d",
		  round, x->rc[0] == 1 ? "waiting" : kl_strerror(x->rc[0]),
		  x->rc[1] == 1 ? "waiting" : kl_strerror(x->rc[1]),
		  kl_mutex_queue_size(x->m), kl_mutex_is_locked(x->m));
	*base += 2;
	st_crew_go(crew, R_PROBE);
	st_crew_wait(crew, *base + 1, 5000 * st_slow(), "probe");
	*base += 1;
	st_assert(x->probe_rc == KL_OK,
		  "round %ld: third thread's try_enter failed for %.3f ms "
		  "(first %s, second %s)",
		  round, (double)x->probe_ns / ST_MS, kl_strerror(x->rc[0]),
		  kl_strerror(x->rc[1]));
	st_assert(x->rc[1] == KL_OK && x->leave_rc[1] == KL_OK,
		  "round %ld: second waiter %s / leave %d", round,
		  kl_strerror(x->rc[1]), x->leave_rc[1]);
	st_assert(x->rc[0] != KL_OK || x->leave_rc[0] == KL_OK,
		  "round %ld: first waiter could not leave", round);
	st_assert(atomic_load(&x->violations) == 0,
		  "round %ld: two owners at once", round);
}

static void
t04_run(long reps)
{
	static struct race x;
	struct st_crew crew;
	struct st_rng r;
	long granted[T04_OFFSETS], timedout[T04_OFFSETS];
	long base = 0, rounds = 0, voided = 0, early = 0, late_grants = 0;
	kl_token held;

	memset(&x, 0, sizeof x);
	memset(granted, 0, sizeof granted);
	memset(timedout, 0, sizeof timedout);
	x.m = new_mutex();
	x.first_timeout = T04_TIMEOUT_MS;
	st_rng_init(&r, 0x0400);
	st_crew_start(&crew, R_PROBE + 1, 0, race_job, &x);
	for (long rep = 0; rep < reps; rep++) {
		int order[T04_OFFSETS];

		/* Offsets in a random order, so drift over time does not
		 * line up with them. */
		st_shuffle(&r, order, T04_OFFSETS);
		for (int k = 0; k < T04_OFFSETS; k++) {
			int o = order[k];
			int64_t off = (int64_t)(o - 30) * 10 * ST_US, t_leave;
			int64_t t0;

			x.rc[0] = x.rc[1] = 1;
			st_assert(kl_mutex_try_enter(x.m, &held) == KL_OK,
				  "round %ld: the mutex is not free", rounds);
			switch (race_queue_two(&x, &crew, base)) {
			case 0:
				/* The first one timed out, alone. */
				voided++;
				st_assert(kl_mutex_leave(x.m, held, false) ==
						  KL_OK,
					  "leave");
				base++;
				continue;
			case 1:
				/* It timed out before the second queued. */
				voided++;
				st_assert(kl_mutex_leave(x.m, held, false) ==
						  KL_OK,
					  "leave");
				race_finish(&x, &crew, &base, rounds);
				continue;
			default:
				break;
			}
			t0 = atomic_load(&x.t0_first);
			st_wait_until_ns(t0 + T04_TIMEOUT_MS * ST_MS + off);
			t_leave = now_ns();
			st_assert(kl_mutex_leave(x.m, held, false) == KL_OK,
				  "leave");
			race_finish(&x, &crew, &base, rounds);
			rounds++;
			if (x.rc[0] == KL_OK) {
				granted[o]++;
				/* Granted although the leave began well
				 * after its deadline: report only. */
				if (t_leave > t0 + T04_TIMEOUT_MS * ST_MS +
						      200 * ST_US)
					late_grants++;
			} else {
				st_assert(x.rc[0] == KL_ETIMEDOUT,
					  "round %ld: first waiter: %s",
					  rounds, kl_strerror(x.rc[0]));
				timedout[o]++;
				if (x.t_end_first - t0 <
				    T04_TIMEOUT_MS * ST_MS)
					early++;
			}
		}
	}
	st_crew_stop(&crew);
	st_note("%ld rounds (%ld void: timed out before the second queued), "
		"%ld early timeouts, %ld grants after deadline+200us; "
		"granted/timed out at -300us %ld/%ld, -100us %ld/%ld, "
		"0 %ld/%ld, +100us %ld/%ld, +300us %ld/%ld",
		rounds, voided, early, late_grants, granted[0], timedout[0],
		granted[20], timedout[20], granted[30], timedout[30],
		granted[40], timedout[40], granted[60], timedout[60]);
	st_assert(early == 0, "%ld timeouts before the deadline", early);
	st_assert(!kl_mutex_is_locked(x.m) && kl_mutex_queue_size(x.m) == 0,
		  "state left behind");
	kl_mutex_free(x.m);
}

START_TEST(test_t04_timeout_vs_grant)
{
	st_begin("T04 timeout vs grant sweep");
	t04_run(st_scaled(T04_REPS, 1, 2));
}
END_TEST

START_TEST(test_t04_timeout_vs_grant_yield)
{
	st_debug_yield_on();
	st_begin("T04 timeout vs grant sweep, debug yields");
	t04_run(st_scaled(T04_REPS, 0.1, 1));
}
END_TEST

/* ------------------------------------------------------------------ */
/* T05: cancel vs grant                                                */

static void
t05a_run(long rounds_n)
{
	static struct race x;
	struct st_crew crew;
	struct st_rng r;
	long base = 0, granted = 0, canceled = 0, after_fire = 0;
	long queue_stale = 0;
	kl_token held;

	memset(&x, 0, sizeof x);
	x.m = new_mutex();
	x.first_timeout = KL_FOREVER;
	st_rng_init(&r, 0x0500);
	st_crew_start(&crew, R_CREW, 0, race_job, &x);
	for (long round = 0; round < rounds_n; round++) {
		int64_t t_base, t_leave;
		long leave_seq;

		x.rc[0] = x.rc[1] = 1;
		st_assert(kl_cancel_new(&x.c) == KL_OK, "kl_cancel_new");
		st_assert(kl_mutex_try_enter(x.m, &held) == KL_OK,
			  "round %ld: the mutex is not free", round);
		st_assert(race_queue_two(&x, &crew, base) == 2,
			  "a waiter without timeout timed out");
		t_base = now_ns() + 20 * ST_US;
		x.fire_at = t_base + (int64_t)st_below(&r, 100) * ST_US;
		t_leave = t_base + (int64_t)st_below(&r, 100) * ST_US;
		st_crew_go(&crew, R_FIRE);
		st_wait_until_ns(t_leave);
		leave_seq = atomic_fetch_add(&x.seq, 1);
		st_assert(kl_mutex_leave(x.m, held, false) == KL_OK, "leave");
		/* Both waiters, then the fire thread. */
		st_assert(st_poll_count(&crew.done, base + 3,
					5000 * st_slow()),
			  "round %ld stuck: first %s, second %s, queue %zu",
			  round,
			  x.rc[0] == 1 ? "waiting" : kl_strerror(x.rc[0]),
			  x.rc[1] == 1 ? "waiting" : kl_strerror(x.rc[1]),
			  kl_mutex_queue_size(x.m));
		base += 1; /* race_finish counts the two waiters */
		race_finish(&x, &crew, &base, round);
		if (x.rc[0] == KL_OK) {
			granted++;
			/* Once fire has returned, no later grant. */
			if (leave_seq > x.fire_seq)
				after_fire++;
		} else {
			st_assert(x.rc[0] == KL_ECANCELED,
				  "round %ld: first waiter: %s", round,
				  kl_strerror(x.rc[0]));
			canceled++;
		}
		/* Right after fire, the first waiter is out of the queue. */
		if (x.queue_after_fire > 1)
			queue_stale++;
		kl_cancel_free(x.c);
		x.c = NULL;
	}
	st_crew_stop(&crew);
	st_note("%ld rounds: %ld granted, %ld canceled, %ld granted by a "
		"leave that began after fire returned, %ld stale queue sizes",
		rounds_n, granted, canceled, after_fire, queue_stale);
	st_assert(after_fire == 0,
		  "%ld grants to a fired token after fire returned",
		  after_fire);
	st_assert(queue_stale == 0,
		  "%ld times the queue still counted a canceled waiter",
		  queue_stale);
	kl_mutex_free(x.m);
}

START_TEST(test_t05_cancel_vs_grant)
{
	st_begin("T05a cancel vs grant");
	t05a_run(st_scaled(100000, 1, 200));
}
END_TEST

START_TEST(test_t05_cancel_vs_grant_yield)
{
	st_debug_yield_on();
	st_begin("T05a cancel vs grant, debug yields");
	t05a_run(st_scaled(100000, 0.05, 100));
}
END_TEST

/* (b) A token fired before the call: KL_ECANCELED at once, nothing
 * queued, held or free, on every kind of wait. */
START_TEST(test_t05_prefired)
{
	long rounds = st_scaled(2000, 1, 200), slow_calls = 0, calls = 0;
	kl_mutex *free_m = new_mutex(), *held_m = new_mutex();
	kl_reset_event *e, *signaled;
	kl_provider *p;
	kl_lock *l;
	kl_lock_opts lo = KL_LOCK_OPTS_INIT;
	kl_lease *hold, *lease;
	kl_cancel *fired, *zero;
	kl_token held, t;
	int64_t worst = 0;

	st_begin("T05b pre-fired token");
	st_assert(kl_mutex_try_enter(held_m, &held) == KL_OK, "hold");
	st_assert(kl_reset_event_new(&e, false, NULL) == KL_OK, "event");
	st_assert(kl_reset_event_new(&signaled, true, NULL) == KL_OK, "event");
	st_assert(kl_memory_provider_new(&p) == KL_OK, "provider");
	lo.provider = p;
	st_assert(kl_lock_new(&l, &lo) == KL_OK, "lock");
	{
		kl_call hc = { .key = "held", .cancel = NULL };

		st_assert(kl_lock_acquire(l, &hc, &hold, NULL) == KL_OK,
			  "hold key");
	}
	st_assert(kl_cancel_new(&fired) == KL_OK, "token");
	kl_cancel_fire(fired);
	st_assert(kl_cancel_new_timeout(&zero, 0) == KL_OK, "token 0");
	for (long i = 0; i < rounds; i++) {
		kl_cancel *c = (i & 1) ? zero : fired;
		kl_call call = { .key = (i & 2) ? "held" : "free",
				 .cancel = c };
		int rc[6];
		int64_t t0 = now_ns(), d;

		rc[0] = kl_mutex_enter(free_m, KL_FOREVER, c, &t);
		rc[1] = kl_mutex_enter(held_m, KL_FOREVER, c, &t);
		rc[2] = kl_reset_event_wait(e, KL_FOREVER, c);
		rc[3] = kl_reset_event_wait(signaled, 1000, c);
		rc[4] = kl_lock_acquire(l, &call, &lease, NULL);
		rc[5] = kl_mutex_enter(held_m, 1000, c, &t);
		d = now_ns() - t0;
		calls += 6;
		if (d > worst)
			worst = d;
		if (d >= ST_MS)
			slow_calls++;
		for (int k = 0; k < 6; k++)
			st_assert(rc[k] == KL_ECANCELED,
				  "round %ld call %d: %s", i, k,
				  kl_strerror(rc[k]));
		st_assert(lease == NULL, "lease set");
		st_assert(kl_mutex_queue_size(held_m) == 0 &&
				  kl_reset_event_queue_size(e) == 0 &&
				  kl_memory_provider_queue_size(p, "held") ==
					  0,
			  "round %ld: something queued", i);
		st_assert(!kl_mutex_is_locked(free_m), "free mutex taken");
		st_assert(kl_memory_provider_size(p) == 1, "provider size %zu",
			  kl_memory_provider_size(p));
	}
	st_note("%ld calls: rounds of 6 over 1 ms: %ld, slowest round %.3f ms",
		calls, slow_calls, (double)worst / ST_MS);
	/* < 1 ms each; a preempted round now and then is the box, not the
	 * library. */
	st_assert(slow_calls <= rounds / 100 + 1,
		  "%ld of %ld rounds took over 1 ms", slow_calls, rounds);
	st_assert(worst < 100 * ST_MS * st_slow(), "a round took %.3f ms",
		  (double)worst / ST_MS);
	kl_lease_release(hold);
	st_assert(kl_memory_provider_size(p) == 0, "provider not empty");
	kl_lock_free(l);
	kl_provider_free(p);
	kl_cancel_free(fired);
	kl_cancel_free(zero);
	st_assert(kl_mutex_leave(held_m, held, false) == KL_OK, "leave");
	kl_reset_event_free(e);
	kl_reset_event_free(signaled);
	kl_mutex_free(free_m);
	kl_mutex_free(held_m);
}
END_TEST

/* (c) Fire right after the leave that granted: no effect on the grant. */
START_TEST(test_t05_fire_after_grant)
{
	static struct race x;
	struct st_crew crew;
	long rounds = st_scaled(5000, 1, 200), base = 0;
	kl_token held;

	st_begin("T05c fire after grant");
	memset(&x, 0, sizeof x);
	x.m = new_mutex();
	x.first_timeout = KL_FOREVER;
	st_crew_start(&crew, R_CREW, 0, race_job, &x);
	for (long round = 0; round < rounds; round++) {
		kl_token t;

		x.rc[0] = 1;
		st_assert(kl_cancel_new(&x.c) == KL_OK, "token");
		st_assert(kl_mutex_try_enter(x.m, &held) == KL_OK, "hold");
		st_crew_go(&crew, R_FIRST);
		st_assert(st_poll_queue(x.m, 1, 10000), "not queued");
		st_assert(kl_mutex_leave(x.m, held, false) == KL_OK, "leave");
		/* The grant is decided: this races only the wake-up. */
		kl_cancel_fire(x.c);
		st_crew_wait(&crew, base + 1, 5000 * st_slow(), "waiter");
		base++;
		st_assert(x.rc[0] == KL_OK && x.leave_rc[0] == KL_OK,
			  "round %ld: waiter %s, leave %d after a grant", round,
			  kl_strerror(x.rc[0]), x.leave_rc[0]);
		/* The token stays fired for later waits. */
		st_assert(kl_mutex_enter(x.m, KL_FOREVER, x.c, &t) ==
				  KL_ECANCELED,
			  "fired token entered");
		kl_cancel_free(x.c);
		x.c = NULL;
	}
	st_crew_stop(&crew);
	st_note("%ld rounds", rounds);
	st_assert(!kl_mutex_is_locked(x.m), "left locked");
	kl_mutex_free(x.m);
}
END_TEST

/* (d) One token shared by 32 waiters on 8 keys of the memory provider. */
#define T05D_WAITERS 32
#define T05D_KEYS 8

struct t05d {
	kl_lock *l;
	kl_cancel *c;
	char keys[T05D_KEYS][8];
	int rc[T05D_WAITERS];
	int64_t t_end[T05D_WAITERS];
};

static void
t05d_job(struct st_crew *c, int i)
{
	struct t05d *x = c->arg;
	kl_call call = { .key = x->keys[i % T05D_KEYS], .cancel = x->c };
	kl_lease *lease = NULL;

	x->rc[i] = kl_lock_acquire(x->l, &call, &lease, NULL);
	x->t_end[i] = now_ns();
	if (lease != NULL)
		kl_lease_release(lease);
}

START_TEST(test_t05_shared_token)
{
	static struct t05d x;
	struct st_crew crew;
	kl_lock_opts lo = KL_LOCK_OPTS_INIT;
	kl_lease *hold[T05D_KEYS];
	kl_provider *p;
	long rounds = st_scaled(200, 1, 20), base = 0;
	int64_t *worst = calloc((size_t)rounds, sizeof *worst), p50, max;
	int64_t bound = 50 * ST_MS * st_slow();

	st_begin("T05d one token, 32 waiters on 8 keys");
	st_assert(worst != NULL, "out of memory");
	memset(&x, 0, sizeof x);
	st_assert(kl_memory_provider_new(&p) == KL_OK, "provider");
	lo.provider = p;
	st_assert(kl_lock_new(&x.l, &lo) == KL_OK, "lock");
	for (int k = 0; k < T05D_KEYS; k++)
		snprintf(x.keys[k], sizeof x.keys[k], "k%d", k);
	st_crew_start(&crew, T05D_WAITERS, 64 * 1024, t05d_job, &x);
	for (long round = 0; round < rounds; round++) {
		int64_t t_fire;

		st_assert(kl_cancel_new(&x.c) == KL_OK, "token");
		for (int k = 0; k < T05D_KEYS; k++) {
			kl_call hc = { .key = x.keys[k], .cancel = NULL };

			st_assert(kl_lock_acquire(x.l, &hc, &hold[k], NULL) ==
					  KL_OK,
				  "hold %d", k);
		}
		for (int i = 0; i < T05D_WAITERS; i++) {
			x.rc[i] = 1;
			st_crew_go(&crew, i);
		}
		for (int k = 0; k < T05D_KEYS; k++) {
			struct {
				kl_provider *p;
				const char *key;
			} q = { p, x.keys[k] };
			unsigned spins = 0;
			int64_t limit = now_ms() + 10000;

			while (kl_memory_provider_queue_size(q.p, q.key) !=
			       T05D_WAITERS / T05D_KEYS) {
				st_assert(now_ms() < limit,
					  "key %d: %zu queued", k,
					  kl_memory_provider_queue_size(q.p,
									q.key));
				test_relax(&spins);
			}
		}
		t_fire = now_ns();
		kl_cancel_fire(x.c);
		for (int k = 0; k < T05D_KEYS; k++)
			st_assert(kl_memory_provider_queue_size(p, x.keys[k]) ==
					  0,
				  "round %ld key %d: still queued after fire",
				  round, k);
		st_crew_wait(&crew, base + T05D_WAITERS, 5000 * st_slow(),
			     "32 waiters after fire");
		base += T05D_WAITERS;
		for (int i = 0; i < T05D_WAITERS; i++) {
			st_assert(x.rc[i] == KL_ECANCELED,
				  "round %ld waiter %d: %s", round, i,
				  kl_strerror(x.rc[i]));
			if (x.t_end[i] - t_fire > worst[round])
				worst[round] = x.t_end[i] - t_fire;
		}
		for (int k = 0; k < T05D_KEYS; k++)
			kl_lease_release(hold[k]);
		st_assert(kl_memory_provider_size(p) == 0,
			  "round %ld: provider size %zu", round,
			  kl_memory_provider_size(p));
		kl_cancel_free(x.c);
		x.c = NULL;
	}
	st_crew_stop(&crew);
	max = st_percentile(worst, (size_t)rounds, 100);
	p50 = st_percentile(worst, (size_t)rounds, 50);
	st_note("%ld rounds: the last of 32 waiters returned %.3f ms after "
		"fire (median round), %.3f ms (slowest round); bound %.0f ms",
		rounds, (double)p50 / ST_MS, (double)max / ST_MS,
		(double)bound / ST_MS);
	/* Fire settles every wait before it returns (the queues were
	 * checked empty above); the wake-ups are the scheduler's. */
	st_assert(p50 <= bound, "the last waiter returned %.3f ms after fire "
				"in a median round",
		  (double)p50 / ST_MS);
	st_assert(max <= 40 * bound, "a waiter returned %.3f ms after fire",
		  (double)max / ST_MS);
	free(worst);
	kl_lock_free(x.l);
	kl_provider_free(p);
}
END_TEST

/* ------------------------------------------------------------------ */
/* T07: signals                                                        */

#define T07_WAITERS 8
#define T07_ROUNDS 100000

static atomic_long t07_signals;

static void
t07_handler(int sig)
{
	(void)sig;
	atomic_fetch_add_explicit(&t07_signals, 1, memory_order_relaxed);
}

struct t07 {
	kl_mutex *own[T07_WAITERS]; /* held by the test */
	kl_mutex *shared;           /* contended by the waiters */
	long rounds;
	pthread_t th[T07_WAITERS];
	atomic_int finished;
	atomic_bool release, stop;
	atomic_int inside;
	atomic_long bad, early, violations, grants, timeouts, cancels;
	int64_t *late; /* T07_WAITERS x rounds, -1: not a held wait */
};

struct t07_worker {
	struct t07 *x;
	int idx;
};

static void *
t07_main(void *arg)
{
	struct t07_worker *w = arg;
	struct t07 *x = w->x;
	struct st_rng r;

	st_rng_init(&r, 0x0700 + (uint64_t)w->idx);
	for (long i = 0; i < x->rounds; i++) {
		unsigned kind = (unsigned)st_below(&r, 4);
		int64_t *late = &x->late[(long)w->idx * x->rounds + i];
		int64_t t0 = now_ns(), d;
		kl_cancel *c = NULL;
		kl_token t;
		int rc;

		*late = -1;
		if (kind == 0 || kind == 1) {
			/* Held by the test: only a timeout is possible. */
			rc = kl_mutex_enter(x->own[w->idx], 1, NULL, &t);
			d = now_ns() - t0;
			if (rc != KL_ETIMEDOUT)
				atomic_fetch_add(&x->bad, 1);
			else if (d < ST_MS)
				atomic_fetch_add(&x->early, 1);
			*late = d - ST_MS;
			atomic_fetch_add(&x->timeouts, 1);
		} else if (kind == 2) {
			/* A token that fires by itself after 1 ms. */
			if (kl_cancel_new_timeout(&c, 1) != KL_OK) {
				atomic_fetch_add(&x->bad, 1);
				continue;
			}
			rc = kl_mutex_enter(x->own[w->idx], KL_FOREVER, c, &t);
			d = now_ns() - t0;
			if (rc != KL_ECANCELED)
				atomic_fetch_add(&x->bad, 1);
			else if (d < ST_MS)
				atomic_fetch_add(&x->early, 1);
			atomic_fetch_add(&x->cancels, 1);
			kl_cancel_free(c);
		} else {
			/* Contended: granted (and then owned) or timed
			 * out. */
			rc = kl_mutex_enter(x->shared, 1, NULL, &t);
			d = now_ns() - t0;
			if (rc == KL_OK) {
				if (atomic_fetch_add(&x->inside, 1) != 0)
					atomic_fetch_add(&x->violations, 1);
				atomic_fetch_sub(&x->inside, 1);
				if (kl_mutex_leave(x->shared, t, false) !=
				    KL_OK)
					atomic_fetch_add(&x->violations, 1);
				atomic_fetch_add(&x->grants, 1);
			} else if (rc == KL_ETIMEDOUT) {
				if (d < ST_MS)
					atomic_fetch_add(&x->early, 1);
				atomic_fetch_add(&x->timeouts, 1);
			} else {
				atomic_fetch_add(&x->bad, 1);
			}
		}
	}
	atomic_fetch_add(&x->finished, 1);
	/* Stay signalable until the helper has stopped. */
	while (!atomic_load(&x->release))
		test_sleep_ms(1);
	return NULL;
}

struct t07_kicker {
	struct t07 *x;
	atomic_long sent;
};

static void *
t07_kick(void *arg)
{
	struct t07_kicker *k = arg;
	struct t07 *x = k->x;
	struct timespec ts = { 0, 30000 };

	while (!atomic_load(&x->stop)) {
		for (int i = 0; i < T07_WAITERS; i++)
			if (pthread_kill(x->th[i], SIGUSR1) == 0)
				atomic_fetch_add(&k->sent, 1);
		nanosleep(&ts, NULL);
	}
	return NULL;
}

START_TEST(test_t07_signals)
{
	static struct t07_worker w[T07_WAITERS];
	static struct t07 x;
	static struct t07_kicker kick;
	struct sigaction sa, old;
	kl_token held[T07_WAITERS];
	pthread_t kicker;
	int64_t p99, max, bound = late_p99_bound_ns();
	size_t n = 0;
	int64_t *late;

	st_begin("T07 signals during waits");
	memset(&x, 0, sizeof x);
	memset(&kick, 0, sizeof kick);
	atomic_store(&t07_signals, 0);
	x.rounds = st_scaled(T07_ROUNDS, 1, 500) / T07_WAITERS;
	x.late = calloc((size_t)(T07_WAITERS * x.rounds), sizeof *x.late);
	late = calloc((size_t)(T07_WAITERS * x.rounds), sizeof *late);
	st_assert(x.late != NULL && late != NULL, "out of memory");
	x.shared = new_mutex();
	for (int i = 0; i < T07_WAITERS; i++) {
		x.own[i] = new_mutex();
		st_assert(kl_mutex_try_enter(x.own[i], &held[i]) == KL_OK,
			  "hold");
	}
	memset(&sa, 0, sizeof sa);
	sa.sa_handler = t07_handler;
	sigemptyset(&sa.sa_mask);
	sa.sa_flags = 0; /* no SA_RESTART */
	st_assert(sigaction(SIGUSR1, &sa, &old) == 0, "sigaction");
	for (int i = 0; i < T07_WAITERS; i++) {
		w[i].x = &x;
		w[i].idx = i;
		st_thread_start(&x.th[i], 0, t07_main, &w[i]);
	}
	kick.x = &x;
	st_thread_start(&kicker, 0, t07_kick, &kick);
	while (atomic_load(&x.finished) < T07_WAITERS)
		test_sleep_ms(5);
	atomic_store(&x.stop, true);
	st_thread_join(kicker);
	atomic_store(&x.release, true);
	for (int i = 0; i < T07_WAITERS; i++)
		st_thread_join(x.th[i]);
	sigaction(SIGUSR1, &old, NULL);
	for (long i = 0; i < T07_WAITERS * x.rounds; i++)
		if (x.late[i] >= 0)
			late[n++] = x.late[i];
	max = st_percentile(late, n, 100);
	p99 = st_percentile(late, n, 99);
	st_note("%d waiters x %ld rounds of 1 ms: %ld signals sent, %ld "
		"handled; %ld timeouts, %ld self-fired cancels, %ld grants, "
		"%ld bad statuses, %ld early, %ld violations; held-wait "
		"lateness p99 %.3f ms max %.3f ms",
		T07_WAITERS, x.rounds, atomic_load(&kick.sent),
		atomic_load(&t07_signals), atomic_load(&x.timeouts),
		atomic_load(&x.cancels), atomic_load(&x.grants),
		atomic_load(&x.bad), atomic_load(&x.early),
		atomic_load(&x.violations), (double)p99 / ST_MS,
		(double)max / ST_MS);
	st_assert(atomic_load(&t07_signals) > 0, "no signal was handled");
	st_assert(atomic_load(&x.bad) == 0,
		  "%ld waits returned something else than KL_OK, "
		  "KL_ETIMEDOUT or KL_ECANCELED as expected",
		  atomic_load(&x.bad));
	st_assert(atomic_load(&x.early) == 0, "%ld waits ended early",
		  atomic_load(&x.early));
	st_assert(atomic_load(&x.violations) == 0,
		  "%ld grants without ownership", atomic_load(&x.violations));
	st_assert(p99 <= bound, "p99 lateness %.3f ms > %.0f ms",
		  (double)p99 / ST_MS, (double)bound / ST_MS);
	for (int i = 0; i < T07_WAITERS; i++) {
		st_assert(kl_mutex_queue_size(x.own[i]) == 0, "queued");
		st_assert(kl_mutex_leave(x.own[i], held[i], false) == KL_OK,
			  "leave");
		kl_mutex_free(x.own[i]);
	}
	st_assert(!kl_mutex_is_locked(x.shared), "shared mutex left held");
	kl_mutex_free(x.shared);
	free(x.late);
	free(late);
}
END_TEST

/* ------------------------------------------------------------------ */
/* T12: pthread_cancel of a blocked waiter                             */

enum t12_kind {
	T12_GRANT,   /* granted by the holder's leave */
	T12_TIMEOUT, /* its own timeout */
	T12_TOKEN,   /* its cancel token */
	T12_ABORT,   /* leave with abort_pending */
	T12_LOCK,    /* kl_lock_acquire on the memory provider, granted */
	T12_EVENT,   /* kl_reset_event_wait, set */
	T12_HOLDER,  /* a holder cancelled at a cancellation point */
	T12_KINDS
};

struct t12 {
	enum t12_kind kind;
	kl_mutex *m;
	kl_cancel *c;
	kl_lock *l;
	kl_reset_event *e;
	int rc, leave_rc;
	atomic_bool returned, holding, survived;
};

struct t12_holder {
	kl_mutex *m;
	kl_token t;
	int leave_rc;
};

static void
t12_holder_cleanup(void *arg)
{
	struct t12_holder *h = arg;

	h->leave_rc = kl_mutex_leave(h->m, h->t, false);
}

static void *
t12_main(void *arg)
{
	struct t12 *x = arg;
	kl_call call = { .key = "t12", .cancel = NULL };
	kl_lease *lease = NULL;
	kl_token t;

	x->leave_rc = KL_OK;
	switch (x->kind) {
	case T12_GRANT:
	case T12_ABORT:
		x->rc = kl_mutex_enter(x->m, KL_FOREVER, NULL, &t);
		break;
	case T12_TIMEOUT:
		x->rc = kl_mutex_enter(x->m, 10, NULL, &t);
		break;
	case T12_TOKEN:
		x->rc = kl_mutex_enter(x->m, KL_FOREVER, x->c, &t);
		break;
	case T12_LOCK:
		x->rc = kl_lock_acquire(x->l, &call, &lease, NULL);
		if (lease != NULL)
			kl_lease_release(lease);
		break;
	case T12_EVENT:
		x->rc = kl_reset_event_wait(x->e, KL_FOREVER, NULL);
		break;
	case T12_HOLDER: {
		static struct t12_holder h;

		h.m = x->m;
		x->rc = kl_mutex_enter(x->m, KL_FOREVER, NULL, &h.t);
		if (x->rc != KL_OK)
			break;
		pthread_cleanup_push(t12_holder_cleanup, &h);
		atomic_store(&x->holding, true);
		for (;;)
			test_sleep_ms(1000); /* nanosleep: a cancellation
						point */
		pthread_cleanup_pop(0);
		break;
	}
	default:
		break;
	}
	if (x->rc == KL_OK && (x->kind == T12_GRANT || x->kind == T12_ABORT ||
			       x->kind == T12_TIMEOUT || x->kind == T12_TOKEN))
		x->leave_rc = kl_mutex_leave(x->m, t, false);
	atomic_store(&x->returned, true);
	/* The main thread cancels every round, but a timed wait may end
	 * before it does: wait for the cancel at cancellation points, for
	 * 10 s at most (then "survived" fails the round, not a hang). */
	for (int i = 0; i < 10000; i++) {
		pthread_testcancel();
		test_sleep_ms(1);
	}
	atomic_store(&x->survived, true);
	return NULL;
}

START_TEST(test_t12_pthread_cancel_waiter)
{
	static struct t12 x;
	long rounds = st_scaled(1000, 1, 70);
	long count[T12_KINDS];
	kl_lock_opts lo = KL_LOCK_OPTS_INIT;
	kl_provider *p;
	kl_lease *hold = NULL;
	struct st_rng r;

	st_begin("T12 pthread_cancel of a blocked waiter");
	memset(count, 0, sizeof count);
	memset(&x, 0, sizeof x);
	st_rng_init(&r, 0x1200);
	x.m = new_mutex();
	st_assert(kl_reset_event_new(&x.e, false, NULL) == KL_OK, "event");
	st_assert(kl_memory_provider_new(&p) == KL_OK, "provider");
	lo.provider = p;
	st_assert(kl_lock_new(&x.l, &lo) == KL_OK, "lock");
	for (long round = 0; round < rounds; round++) {
		enum t12_kind kind = (enum t12_kind)(round % T12_KINDS);
		kl_call hc = { .key = "t12", .cancel = NULL };
		kl_token held, t;
		pthread_t th;
		void *ret = NULL;
		bool queued;
		int want = KL_OK;

		x.kind = kind;
		x.rc = 1;
		atomic_store(&x.returned, false);
		atomic_store(&x.holding, false);
		atomic_store(&x.survived, false);
		if (kind == T12_TOKEN)
			st_assert(kl_cancel_new(&x.c) == KL_OK, "token");
		if (kind == T12_LOCK)
			st_assert(kl_lock_acquire(x.l, &hc, &hold, NULL) ==
					  KL_OK,
				  "hold key");
		else if (kind != T12_EVENT && kind != T12_HOLDER)
			st_assert(kl_mutex_try_enter(x.m, &held) == KL_OK,
				  "round %ld: hold", round);
		st_thread_start(&th, 0, t12_main, &x);
		if (kind == T12_HOLDER) {
			unsigned spins = 0;
			int64_t limit = now_ms() + 10000;

			while (!atomic_load(&x.holding)) {
				st_assert(now_ms() < limit, "not holding");
				test_relax(&spins);
			}
		} else if (kind == T12_LOCK) {
			unsigned spins = 0;
			int64_t limit = now_ms() + 10000;

			while (kl_memory_provider_queue_size(p, "t12") != 1) {
				st_assert(now_ms() < limit, "not queued");
				test_relax(&spins);
			}
		} else if (kind == T12_EVENT) {
			st_assert(st_poll_event_queue(x.e, 1, 10000),
				  "not queued");
		} else {
			unsigned spins = 0;
			int64_t limit = now_ms() + 10000;

			/* A timed wait may end before it is seen queued. */
			while (kl_mutex_queue_size(x.m) != 1 &&
			       !(kind == T12_TIMEOUT &&
				 atomic_load(&x.returned))) {
				st_assert(now_ms() < limit,
					  "round %ld: not queued", round);
				test_relax(&spins);
			}
		}
		st_assert(pthread_cancel(th) == 0, "pthread_cancel");
		if (kind != T12_TIMEOUT && kind != T12_HOLDER &&
		    st_below(&r, 8) == 0) {
			/* Now and then, check the cancel did not end the
			 * wait: it is not a cancellation point. */
			test_sleep_ms(2);
			queued = kind == T12_LOCK
					 ? kl_memory_provider_queue_size(
						   p, "t12") == 1
				 : kind == T12_EVENT
					 ? kl_reset_event_queue_size(x.e) == 1
					 : kl_mutex_queue_size(x.m) == 1;
			st_assert(queued && !atomic_load(&x.returned),
				  "round %ld: the cancel ended the wait",
				  round);
		}
		switch (kind) {
		case T12_GRANT:
			st_assert(kl_mutex_leave(x.m, held, false) == KL_OK,
				  "leave");
			break;
		case T12_TIMEOUT:
			want = KL_ETIMEDOUT;
			break;
		case T12_TOKEN:
			kl_cancel_fire(x.c);
			want = KL_ECANCELED;
			break;
		case T12_ABORT:
			st_assert(kl_mutex_leave(x.m, held, true) == KL_OK,
				  "leave");
			want = KL_ECANCELED;
			break;
		case T12_LOCK:
			kl_lease_release(hold);
			break;
		case T12_EVENT:
			kl_reset_event_set(x.e);
			break;
		default:
			break;
		}
		st_assert(pthread_join(th, &ret) == 0, "pthread_join");
		st_assert(ret == PTHREAD_CANCELED,
			  "round %ld (kind %d): the thread was not cancelled",
			  round, kind);
		st_assert(!atomic_load(&x.survived), "survived testcancel");
		if (kind == T12_HOLDER) {
			st_assert(x.rc == KL_OK, "holder: %s",
				  kl_strerror(x.rc));
		} else {
			st_assert(atomic_load(&x.returned),
				  "round %ld (kind %d): cancelled inside the "
				  "wait",
				  round, kind);
			st_assert(x.rc == want,
				  "round %ld (kind %d): %s, expected %s", round,
				  kind, kl_strerror(x.rc), kl_strerror(want));
			st_assert(x.leave_rc == KL_OK, "waiter's leave");
		}
		if (kind == T12_TIMEOUT || kind == T12_TOKEN)
			st_assert(kl_mutex_leave(x.m, held, false) == KL_OK,
				  "leave");
		if (kind == T12_EVENT)
			kl_reset_event_reset(x.e);
		/* Nothing left queued; another thread enters at once. */
		st_assert(kl_mutex_queue_size(x.m) == 0 &&
				  kl_reset_event_queue_size(x.e) == 0 &&
				  kl_memory_provider_size(p) == 0,
			  "round %ld (kind %d): left behind: queue %zu, "
			  "event queue %zu, provider %zu",
			  round, kind, kl_mutex_queue_size(x.m),
			  kl_reset_event_queue_size(x.e),
			  kl_memory_provider_size(p));
		{
			int64_t limit = now_ns() + 10 * ST_MS * st_slow();
			int rc;

			while ((rc = kl_mutex_try_enter(x.m, &t)) != KL_OK &&
			       now_ns() < limit)
				sched_yield();
			st_assert(rc == KL_OK,
				  "round %ld (kind %d): mutex not free after "
				  "the round",
				  round, kind);
			st_assert(kl_mutex_leave(x.m, t, false) == KL_OK,
				  "leave");
		}
		if (kind == T12_TOKEN) {
			kl_cancel_free(x.c);
			x.c = NULL;
		}
		count[kind]++;
	}
	st_note("%ld rounds: %ld granted, %ld timed out, %ld token, %ld "
		"aborted, %ld lock, %ld event, %ld holders",
		rounds, count[T12_GRANT], count[T12_TIMEOUT], count[T12_TOKEN],
		count[T12_ABORT], count[T12_LOCK], count[T12_EVENT],
		count[T12_HOLDER]);
	kl_lock_free(x.l);
	kl_provider_free(p);
	kl_reset_event_free(x.e);
	kl_mutex_free(x.m);
}
END_TEST

static Suite *
stress_timing_suite(void)
{
	Suite *s = suite_create("stress_timing");
	TCase *tc;

	tc = tcase_create("timeouts");
	tcase_set_timeout(tc, ST_TIMEOUT);
	tcase_add_test(tc, test_t03_timed_wait_accuracy);
	tcase_add_test(tc, test_t03_uncontended_timeout_fast);
	tcase_add_test(tc, test_t03_edge_timeouts);
	suite_add_tcase(s, tc);

	tc = tcase_create("races");
	tcase_set_timeout(tc, ST_TIMEOUT);
	tcase_add_test(tc, test_t04_timeout_vs_grant);
	tcase_add_test(tc, test_t05_cancel_vs_grant);
	tcase_add_test(tc, test_t05_prefired);
	tcase_add_test(tc, test_t05_fire_after_grant);
	tcase_add_test(tc, test_t05_shared_token);
	suite_add_tcase(s, tc);

	tc = tcase_create("races_yield");
	tcase_set_timeout(tc, ST_TIMEOUT);
	tcase_add_test(tc, test_t04_timeout_vs_grant_yield);
	tcase_add_test(tc, test_t05_cancel_vs_grant_yield);
	suite_add_tcase(s, tc);

	tc = tcase_create("signals");
	tcase_set_timeout(tc, ST_TIMEOUT);
	tcase_add_test(tc, test_t07_signals);
	suite_add_tcase(s, tc);

	tc = tcase_create("pthread_cancel");
	tcase_set_timeout(tc, ST_TIMEOUT);
	tcase_add_test(tc, test_t12_pthread_cancel_waiter);
	suite_add_tcase(s, tc);
	return s;
}

int
main(void)
{
	return st_run(stress_timing_suite());
}
