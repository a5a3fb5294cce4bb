/* SPDX-License-Identifier: MIT */
/*
 * Stress: lost-wakeup and hang hunt (TESTPLAN T06, and T28's single-CPU
 * rerun).
 *
 * 8 threads run a random mix over 16 keys (4 of them KL_EVENTUAL mutexes)
 * for 20 s x KL_TEST_SCALE x a per-variant share: kl_mutex enter with
 * timeouts 0/1/10/100 ms/forever,
 * with or without a cancel token (fired at random by the other threads, or
 * self-firing); try_enter; kl_mutex_run; leave, now and then with
 * abort_pending; set_opts shrinking max_queue (which evicts); key-table
 * acquisitions through kl_lock on a private memory provider; waits, sets
 * and resets of four ResetEvents (manual, auto 1, auto 3, auto 8).  Each
 * key counts its holders: two at once is a violation.
 *
 * A watchdog thread samples every key and event each millisecond and fails
 * the test when, for more than 2 s without a break, a mutex is free while
 * waiters are queued (a waiter heads the queue of a free lock: a lost
 * grant), an event is signaled while waiters are queued (a lost release),
 * or a thread stays in one call more than its timeout plus 5 s (10 s for
 * forever).  It prints the state of every key, event and thread with the
 * seed, and the test fails at once without waiting for the stuck threads.
 *
 * Every 256 operations each thread runs the library's invariant checkers
 * (kl__test_check_invariants on the provider, kl__test_mutex_check on a
 * random key), and once more on everything after the threads stop: a
 * broken invariant fails the test even where no symptom showed.
 *
 * Variants: plain, with the library's debug yields (KL_DEBUG_YIELD=1), and
 * with the whole test pinned to one CPU (T28).
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <check.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "internal.h" /* kl__test_check_invariants, kl__test_mutex_check */
#include "keylock.h"
#include "stress.h"

#define H_THREADS 8
#define H_KEYS 16
#define H_STRICT_KEYS 12 /* the others are KL_EVENTUAL mutexes */
#define H_EVENTS 4
#define H_NOMINAL_MS 20000
#define H_TRIP_NS (2000 * ST_MS)
#define H_CHECK_EVERY 256 /* operations per thread between checks */

static const int64_t h_timeouts[] = { 0, 1, 10, 100, KL_FOREVER };
#define H_NTIMEOUTS 5

enum h_op {
	OP_IDLE,
	OP_ENTER,
	OP_TRY,
	OP_RUN,
	OP_ACQUIRE,
	OP_EVENT_WAIT,
	OP_LEAVE,
	OP_RELEASE,
	OP_OTHER,
	OP_COUNT
};

static const char *const op_names[OP_COUNT] = {
	"idle",	     "enter", "try_enter", "run",  "lock_acquire",
	"event_wait", "leave", "release",   "other"
};

struct h_key {
	kl_mutex *m;
	char name[16];
	atomic_int in_m, in_t;
	uint64_t last_fence; /* inside the table key only */
};

struct h_worker {
	struct hunt *h;
	int idx;
	pthread_t th;
	struct st_rng r;
	struct st_slot slot;
	/* What the thread is doing, for the watchdog. */
	atomic_int op, op_key;
	atomic_llong op_start, op_timeout;
	long ops[OP_COUNT];
	long outcomes[4]; /* OK, ETIMEDOUT, ECANCELED, EOVERFLOW */
};

struct hunt {
	struct h_key keys[H_KEYS];
	kl_reset_event *ev[H_EVENTS];
	kl_provider *p;
	kl_lock *locks[H_NTIMEOUTS];
	struct h_worker w[H_THREADS];
	atomic_bool stop, wd_stop, trip;
	atomic_long bad, early, violations, fence_errors, leave_errors;
	atomic_long invariant_errors;
	atomic_int exited;
	char trip_msg[4096];
	int64_t trip_ns;
	long wd_samples;
};

/* ------------------------------------------------------------------ */
/* Workers                                                             */

static void
op_begin(struct h_worker *w, enum h_op op, int key, int64_t timeout)
{
	atomic_store(&w->op_key, key);
	atomic_store(&w->op_timeout, timeout);
	atomic_store(&w->op_start, now_ns());
	atomic_store(&w->op, (int)op);
	w->ops[op]++;
}

static void
op_end(struct h_worker *w)
{
	atomic_store(&w->op, OP_IDLE);
}

/* Counts a wait's status; allowed lists what it may return. */
static void
outcome(struct h_worker *w, int rc, int64_t timeout, int64_t t0,
	bool overflow_ok)
{
	struct hunt *h = w->h;
	int i = st_outcome(rc);

	if (i >= 0)
		w->outcomes[i]++;
	if (i < 0 || (rc == KL_EOVERFLOW && !overflow_ok))
		atomic_fetch_add(&h->bad, 1);
	else if (rc == KL_ETIMEDOUT && timeout > 0 &&
		 now_ns() - t0 < timeout * ST_MS)
		atomic_fetch_add(&h->early, 1);
}

/* Fires the token of a worker picked at random. */
static void
fire_someone(struct h_worker *w)
{
	st_slot_fire(&w->h->w[st_below(&w->r, H_THREADS)].slot);
}

static void
event_touch(struct h_worker *w)
{
	kl_reset_event *e = w->h->ev[st_below(&w->r, H_EVENTS)];

	if (st_below(&w->r, 5) < 3)
		kl_reset_event_set(e);
	else
		kl_reset_event_reset(e);
}

static void
shrink_queue(struct h_worker *w)
{
	static const size_t sizes[] = { 0, 1, 2, 4, 8, KL_UNBOUNDED,
					KL_UNBOUNDED, KL_UNBOUNDED };
	struct h_key *k = &w->h->keys[st_below(&w->r, H_KEYS)];
	kl_queue_opts o = KL_QUEUE_OPTS_INIT;

	o.max_queue = sizes[st_below(&w->r, 8)];
	o.overflow = (kl_overflow)st_below(&w->r, 3);
	o.flags = k - w->h->keys >= H_STRICT_KEYS ? KL_EVENTUAL : 0;
	if (kl_mutex_set_opts(k->m, &o) != KL_OK)
		atomic_fetch_add(&w->h->bad, 1);
}

/* A short stay inside a key, with only non-blocking calls. */
static void
hold_a_little(struct h_worker *w, int self)
{
	unsigned n = (unsigned)st_below(&w->r, 4);

	for (unsigned i = 0; i < n; i++) {
		switch (st_below(&w->r, 4)) {
		case 0:
			event_touch(w);
			break;
		case 1:
			fire_someone(w);
			break;
		case 2: {
			int k = (int)st_below(&w->r, H_KEYS);
			kl_token t;

			if (k != self &&
			    kl_mutex_try_enter(w->h->keys[k].m, &t) == KL_OK)
				kl_mutex_leave(w->h->keys[k].m, t, false);
			break;
		}
		default:
			sched_yield();
			break;
		}
	}
	if (st_below(&w->r, 4) == 0)
		st_wait_until_ns(now_ns() + (int64_t)st_below(&w->r, 20) *
						    ST_US);
}

static void
in_mutex(struct h_worker *w, struct h_key *k)
{
	if (atomic_fetch_add(&k->in_m, 1) != 0)
		atomic_fetch_add(&w->h->violations, 1);
}

static void
out_mutex(struct h_key *k)
{
	atomic_fetch_sub(&k->in_m, 1);
}

struct run_arg {
	struct h_worker *w;
	struct h_key *k;
};

static int
run_fn(void *arg)
{
	struct run_arg *a = arg;

	in_mutex(a->w, a->k);
	hold_a_little(a->w, (int)(a->k - a->w->h->keys));
	out_mutex(a->k);
	return 0;
}

static void
do_enter(struct h_worker *w)
{
	int ki = (int)st_below(&w->r, H_KEYS);
	struct h_key *k = &w->h->keys[ki];
	int64_t to = h_timeouts[st_below(&w->r, H_NTIMEOUTS)], t0;
	kl_cancel *c = st_slot_token(&w->slot, &w->r);
	kl_token t;
	int rc;

	op_begin(w, OP_ENTER, ki, to);
	t0 = now_ns();
	rc = kl_mutex_enter(k->m, to, c, &t);
	op_end(w);
	outcome(w, rc, to, t0, true);
	if (rc != KL_OK)
		return;
	in_mutex(w, k);
	hold_a_little(w, ki);
	out_mutex(k);
	op_begin(w, OP_LEAVE, ki, 0);
	if (kl_mutex_leave(k->m, t, st_below(&w->r, 50) == 0) != KL_OK)
		atomic_fetch_add(&w->h->leave_errors, 1);
	op_end(w);
}

static void
do_try(struct h_worker *w)
{
	int ki = (int)st_below(&w->r, H_KEYS);
	struct h_key *k = &w->h->keys[ki];
	kl_token t;
	int rc;

	op_begin(w, OP_TRY, ki, 0);
	rc = kl_mutex_try_enter(k->m, &t);
	op_end(w);
	if (rc == KL_ETIMEDOUT)
		return;
	if (rc != KL_OK) {
		atomic_fetch_add(&w->h->bad, 1);
		return;
	}
	in_mutex(w, k);
	out_mutex(k);
	if (kl_mutex_leave(k->m, t, false) != KL_OK)
		atomic_fetch_add(&w->h->leave_errors, 1);
}

static void
do_run(struct h_worker *w)
{
	int ki = (int)st_below(&w->r, H_KEYS);
	struct run_arg a = { w, &w->h->keys[ki] };
	int64_t t0 = now_ns();
	int rc;

	op_begin(w, OP_RUN, ki, 10);
	rc = kl_mutex_run(a.k->m, 10, NULL, run_fn, &a, NULL);
	op_end(w);
	outcome(w, rc, 10, t0, true);
}

static void
do_acquire(struct h_worker *w)
{
	int ki = (int)st_below(&w->r, H_KEYS), ti;
	struct h_key *k = &w->h->keys[ki];
	kl_call call = { .key = k->name,
			 .cancel = st_slot_token(&w->slot, &w->r) };
	kl_lease *lease;
	int64_t t0;
	uint64_t fence;
	int rc;

	ti = (int)st_below(&w->r, H_NTIMEOUTS);
	op_begin(w, OP_ACQUIRE, ki, h_timeouts[ti]);
	t0 = now_ns();
	rc = kl_lock_acquire(w->h->locks[ti], &call, &lease, NULL);
	op_end(w);
	outcome(w, rc, h_timeouts[ti], t0, false);
	if (rc != KL_OK)
		return;
	if (atomic_fetch_add(&k->in_t, 1) != 0)
		atomic_fetch_add(&w->h->violations, 1);
	fence = kl_lease_fence(lease);
	if (fence <= k->last_fence)
		atomic_fetch_add(&w->h->fence_errors, 1);
	k->last_fence = fence;
	hold_a_little(w, -1);
	atomic_fetch_sub(&k->in_t, 1);
	op_begin(w, OP_RELEASE, ki, 0);
	kl_lease_release(lease);
	op_end(w);
}

static void
do_event_wait(struct h_worker *w)
{
	int ei = (int)st_below(&w->r, H_EVENTS);
	int64_t to = h_timeouts[st_below(&w->r, H_NTIMEOUTS)], t0;
	kl_cancel *c = st_slot_token(&w->slot, &w->r);
	int rc;

	op_begin(w, OP_EVENT_WAIT, ei, to);
	t0 = now_ns();
	rc = kl_reset_event_wait(w->h->ev[ei], to, c);
	op_end(w);
	outcome(w, rc, to, t0, false);
}

/* The library's invariant checkers, on the provider and one key. */
static void
h_check(struct h_worker *w)
{
	struct hunt *h = w->h;

	if (kl__test_check_invariants(h->p) != KL_OK)
		atomic_fetch_add(&h->invariant_errors, 1);
	if (kl__test_mutex_check(h->keys[st_below(&w->r, H_KEYS)].m) != KL_OK)
		atomic_fetch_add(&h->invariant_errors, 1);
}

static void *
h_main(void *arg)
{
	struct h_worker *w = arg;
	struct hunt *h = w->h;
	long n = 0;

	while (!atomic_load(&h->stop)) {
		unsigned dice = (unsigned)st_below(&w->r, 100);

		if (++n % H_CHECK_EVERY == 0)
			h_check(w);

		if (dice < 30) {
			do_enter(w);
		} else if (dice < 38) {
			do_try(w);
		} else if (dice < 43) {
			do_run(w);
		} else if (dice < 60) {
			do_acquire(w);
		} else if (dice < 65) {
			w->ops[OP_OTHER]++;
			fire_someone(w);
		} else if (dice < 70) {
			w->ops[OP_OTHER]++;
			shrink_queue(w);
		} else if (dice < 85) {
			do_event_wait(w);
		} else {
			w->ops[OP_OTHER]++;
			event_touch(w);
		}
	}
	atomic_fetch_add(&h->exited, 1);
	return NULL;
}

/* ------------------------------------------------------------------ */
/* Watchdog                                                            */

static size_t
dump_state(struct hunt *h, char *buf, size_t size)
{
	size_t n = 0;
	int64_t now = now_ns();

#define PUT(...)                                                           \
	do {                                                               \
		if (n < size)                                              \
			n += (size_t)snprintf(buf + n, size - n,           \
					      __VA_ARGS__);                \
	} while (0)
	PUT("keys:");
	for (int k = 0; k < H_KEYS; k++) {
		size_t holders = 0, waiters = 0;

		kl_provider_status(h->p, h->keys[k].name, &holders, &waiters,
				   NULL);
		PUT(" %d[m %s q%zu, t %zu/%zu]", k,
		    kl_mutex_is_locked(h->keys[k].m) ? "held" : "free",
		    kl_mutex_queue_size(h->keys[k].m), holders, waiters);
	}
	PUT("\nevents:");
	for (int e = 0; e < H_EVENTS; e++)
		PUT(" %d[%s q%zu]", e,
		    kl_reset_event_is_signaled(h->ev[e]) ? "set" : "unset",
		    kl_reset_event_queue_size(h->ev[e]));
	PUT("\nthreads:");
	for (int i = 0; i < H_THREADS; i++) {
		struct h_worker *w = &h->w[i];
		int op = atomic_load(&w->op);

		if (op == OP_IDLE)
			PUT(" %d[idle]", i);
		else
			PUT(" %d[%s #%d timeout %lld, %.3f s]", i,
			    op_names[op], atomic_load(&w->op_key),
			    (long long)atomic_load(&w->op_timeout),
			    (double)(now - atomic_load(&w->op_start)) /
				    1e9);
	}
#undef PUT
	return n;
}

static void
trip(struct hunt *h, const char *why)
{
	size_t n;

	if (atomic_load(&h->trip))
		return;
	n = (size_t)snprintf(h->trip_msg, sizeof h->trip_msg, "%s\n", why);
	if (n < sizeof h->trip_msg)
		dump_state(h, h->trip_msg + n, sizeof h->trip_msg - n);
	h->trip_ns = now_ns();
	fprintf(stderr,
		"stress: T06 watchdog (KL_TEST_SEED=%" PRIu64 "): %s\n",
		st_seed(), h->trip_msg);
	atomic_store(&h->trip, true);
}

static void *
h_watchdog(void *arg)
{
	struct hunt *h = arg;
	int64_t key_since[H_KEYS], ev_since[H_EVENTS];
	struct timespec ts = { 0, st_tsan() ? 2000000 : 1000000 };
	char why[256];

	memset(key_since, 0, sizeof key_since);
	memset(ev_since, 0, sizeof ev_since);
	while (!atomic_load(&h->wd_stop)) {
		int64_t now = now_ns();

		h->wd_samples++;
		for (int k = 0; k < H_KEYS; k++) {
			kl_mutex *m = h->keys[k].m;
			/* Free first, then queued: a waiter that queued in
			 * between finds the lock taken or takes it. */
			bool stuck = !kl_mutex_is_locked(m) &&
				     kl_mutex_queue_size(m) > 0;

			if (!stuck) {
				key_since[k] = 0;
			} else if (key_since[k] == 0) {
				key_since[k] = now;
			} else if (now - key_since[k] > H_TRIP_NS) {
				snprintf(why, sizeof why,
					 "key %d: mutex free with waiters "
					 "queued for %.3f s",
					 k, (double)(now - key_since[k]) / 1e9);
				trip(h, why);
			}
		}
		for (int e = 0; e < H_EVENTS; e++) {
			kl_reset_event *ev = h->ev[e];
			bool stuck = kl_reset_event_queue_size(ev) > 0 &&
				     kl_reset_event_is_signaled(ev);

			if (!stuck) {
				ev_since[e] = 0;
			} else if (ev_since[e] == 0) {
				ev_since[e] = now;
			} else if (now - ev_since[e] > H_TRIP_NS) {
				snprintf(why, sizeof why,
					 "event %d: signaled with waiters "
					 "queued for %.3f s",
					 e, (double)(now - ev_since[e]) / 1e9);
				trip(h, why);
			}
		}
		for (int i = 0; i < H_THREADS; i++) {
			struct h_worker *w = &h->w[i];
			int op = atomic_load(&w->op);
			int64_t to = atomic_load(&w->op_timeout), limit;

			if (op == OP_IDLE)
				continue;
			limit = (to < 0 ? 10000 : to + 5000) * ST_MS *
				st_slow();
			if (now - atomic_load(&w->op_start) > limit &&
			    atomic_load(&w->op) == op) {
				snprintf(why, sizeof why,
					 "thread %d: in %s for over %.1f s", i,
					 op_names[op], (double)limit / 1e9);
				trip(h, why);
			}
		}
		nanosleep(&ts, NULL);
	}
	return NULL;
}

/* ------------------------------------------------------------------ */

static void
hunt_run(const char *name, double share)
{
	static struct hunt h;
	static const size_t counts[H_EVENTS] = { KL_UNBOUNDED, 1, 3, 8 };
	int64_t nominal = (int64_t)((double)H_NOMINAL_MS * kl_test_scale() *
				    share),
		t0, deadline, wall;
	kl_lock_opts lo = KL_LOCK_OPTS_INIT;
	pthread_t wd;
	long ops[OP_COUNT], outs[4];
	struct st_rng r;

	if (nominal < 500)
		nominal = 500;
	st_note("%s: %lld ms", name, (long long)nominal);
	memset(&h, 0, sizeof h);
	memset(ops, 0, sizeof ops);
	memset(outs, 0, sizeof outs);
	st_rng_init(&r, 0x0600);
	for (int k = 0; k < H_KEYS; k++) {
		kl_queue_opts qo = KL_QUEUE_OPTS_INIT;

		qo.flags = k >= H_STRICT_KEYS ? KL_EVENTUAL : 0;
		st_assert(kl_mutex_new(&h.keys[k].m, &qo) == KL_OK, "mutex");
		snprintf(h.keys[k].name, sizeof h.keys[k].name, "hunt-%d", k);
	}
	for (int e = 0; e < H_EVENTS; e++) {
		kl_reset_opts o = KL_RESET_OPTS_INIT;

		o.auto_reset_count = counts[e];
		st_assert(kl_reset_event_new(&h.ev[e], false, &o) == KL_OK,
			  "event");
	}
	st_assert(kl_memory_provider_new(&h.p) == KL_OK, "provider");
	lo.provider = h.p;
	for (int i = 0; i < H_NTIMEOUTS; i++) {
		lo.timeout_ms = h_timeouts[i];
		st_assert(kl_lock_new(&h.locks[i], &lo) == KL_OK, "lock");
	}
	/* Every slot is ready before any thread may fire it. */
	for (int i = 0; i < H_THREADS; i++) {
		struct h_worker *w = &h.w[i];

		w->h = &h;
		w->idx = i;
		st_rng_init(&w->r, 0x0610 + (uint64_t)i);
		st_slot_init(&w->slot);
	}
	st_thread_start(&wd, 0, h_watchdog, &h);
	t0 = now_ns();
	deadline = t0 + nominal * ST_MS;
	for (int i = 0; i < H_THREADS; i++)
		st_thread_start(&h.w[i].th, 0, h_main, &h.w[i]);
	/* Meanwhile, set an event now and then: threads may all be waiting
	 * on events, forever. */
	while (now_ns() < deadline && !atomic_load(&h.trip)) {
		test_sleep_ms(10);
		kl_reset_event_set(h.ev[st_below(&r, H_EVENTS)]);
	}
	atomic_store(&h.stop, true);
	if (!st_drain(&h.exited, H_THREADS, &h.trip, h.ev, H_EVENTS))
		trip(&h, "threads did not stop within 20 s");
	/* Stuck threads cannot be joined: this fails the test at once (and
	 * ends the process under CK_FORK=no: see st_fail_prepare). */
	st_assert(!atomic_load(&h.trip), "watchdog: %s", h.trip_msg);
	wall = (now_ns() - t0) / ST_MS;
	atomic_store(&h.wd_stop, true);
	st_thread_join(wd);
	for (int i = 0; i < H_THREADS; i++) {
		st_thread_join(h.w[i].th);
		for (int o = 0; o < OP_COUNT; o++)
			ops[o] += h.w[i].ops[o];
		for (int o = 0; o < 4; o++)
			outs[o] += h.w[i].outcomes[o];
	}
	st_note("%s: %lld ms (nominal %lld): enter %ld, try %ld, run %ld, "
		"acquire %ld, event wait %ld, other %ld; ok %ld, timed out "
		"%ld, canceled %ld, overflow %ld; %ld bad, %ld early, %ld "
		"violations, %ld fence errors, %ld leave errors; %ld watchdog "
		"samples",
		name, (long long)wall, (long long)nominal, ops[OP_ENTER],
		ops[OP_TRY], ops[OP_RUN], ops[OP_ACQUIRE], ops[OP_EVENT_WAIT],
		ops[OP_OTHER], outs[0], outs[1], outs[2], outs[3],
		atomic_load(&h.bad), atomic_load(&h.early),
		atomic_load(&h.violations), atomic_load(&h.fence_errors),
		atomic_load(&h.leave_errors), h.wd_samples);
	st_assert(atomic_load(&h.bad) == 0, "%ld unexpected statuses",
		  atomic_load(&h.bad));
	st_assert(atomic_load(&h.early) == 0, "%ld early timeouts",
		  atomic_load(&h.early));
	st_assert(atomic_load(&h.violations) == 0, "%ld in-CS violations",
		  atomic_load(&h.violations));
	st_assert(atomic_load(&h.fence_errors) == 0,
		  "%ld fences did not grow", atomic_load(&h.fence_errors));
	st_assert(atomic_load(&h.leave_errors) == 0,
		  "%ld leaves of held keys failed",
		  atomic_load(&h.leave_errors));
	/* Idle now: every checker once more. */
	if (kl__test_check_invariants(h.p) != KL_OK)
		atomic_fetch_add(&h.invariant_errors, 1);
	for (int k = 0; k < H_KEYS; k++)
		if (kl__test_mutex_check(h.keys[k].m) != KL_OK)
			atomic_fetch_add(&h.invariant_errors, 1);
	st_assert(atomic_load(&h.invariant_errors) == 0,
		  "%ld invariant checks failed (see stderr)",
		  atomic_load(&h.invariant_errors));
	st_assert(wall <= 2 * nominal + 5000 * st_slow(),
		  "ran %lld ms for %lld nominal", (long long)wall,
		  (long long)nominal);
	for (int k = 0; k < H_KEYS; k++) {
		st_assert(!kl_mutex_is_locked(h.keys[k].m) &&
				  kl_mutex_queue_size(h.keys[k].m) == 0,
			  "key %d left held or queued", k);
		kl_mutex_free(h.keys[k].m);
	}
	for (int e = 0; e < H_EVENTS; e++) {
		st_assert(kl_reset_event_queue_size(h.ev[e]) == 0,
			  "event %d has waiters", e);
		kl_reset_event_free(h.ev[e]);
	}
	st_assert(kl_memory_provider_size(h.p) == 0, "provider keeps %zu",
		  kl_memory_provider_size(h.p));
	for (int i = 0; i < H_NTIMEOUTS; i++)
		kl_lock_free(h.locks[i]);
	kl_provider_free(h.p);
	for (int i = 0; i < H_THREADS; i++) {
		st_slot_fini(&h.w[i].slot);
	}
}

START_TEST(test_t06_hunt)
{
	st_begin("T06 lost-wakeup hunt");
	hunt_run("plain", 1);
}
END_TEST

START_TEST(test_t06_hunt_yield)
{
	st_debug_yield_on();
	st_begin("T06 lost-wakeup hunt, debug yields");
	hunt_run("KL_DEBUG_YIELD=1", 0.5);
}
END_TEST

START_TEST(test_t28_pinned_hunt)
{
	int cpu;

	st_begin("T28 T06 pinned to one CPU");
	cpu = st_pin_one_cpu();
	st_assert(cpu >= 0, "cannot pin to one CPU");
	st_note("pinned to CPU %d", cpu);
	hunt_run("one CPU", 0.5);
	st_unpin();
}
END_TEST

static Suite *
stress_hunt_suite(void)
{
	Suite *s = suite_create("stress_hunt");
	TCase *tc;

	tc = tcase_create("hunt");
	tcase_set_timeout(tc, ST_TIMEOUT);
	tcase_add_test(tc, test_t06_hunt);
	suite_add_tcase(s, tc);

	tc = tcase_create("hunt_yield");
	tcase_set_timeout(tc, ST_TIMEOUT);
	tcase_add_test(tc, test_t06_hunt_yield);
	suite_add_tcase(s, tc);

	tc = tcase_create("pinned");
	tcase_set_timeout(tc, ST_TIMEOUT);
	tcase_add_test(tc, test_t28_pinned_hunt);
	suite_add_tcase(s, tc);
	return s;
}

int
main(void)
{
	return st_run(stress_hunt_suite());
}
