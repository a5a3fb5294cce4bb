/* SPDX-License-Identifier: MIT */
/*
 * Deadlock detection of the memory provider (src/deadlock.c) through the
 * public API: cycles of two and three threads (also across two providers
 * and through a cancellable wait) end with exactly one KL_EDEADLK, whose
 * thread still holds its own key until it releases it, after which the
 * others are granted; a thread waiting for a key it holds; no victim among
 * long waits that form no cycle, nor among key sets checked at once; a
 * timeout shorter than deadlock_ms, and detection off, end KL_ETIMEDOUT;
 * the message names the cycle's keys; the REJECTED event; the setting;
 * detection allocates nothing.  With KL_SHARED: cycles through a shared
 * holder (alone or in the key's ring of records) and through shared
 * waits have one victim; many shared holders and a waiting writer, no
 * cycle, none; a reader queued behind a victim writer is granted as the
 * victim leaves.
 *
 * deadlock_ms is small here (150 ms) to keep the suite short; every wait
 * has a long timeout that only guards against a hang.  Outcomes are
 * counted, never timed, except that nothing ends before deadlock_ms.
 * Worker threads never call ck_assert*: they record, the test's thread
 * asserts after joining them.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <check.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h" /* kl__test_fail_alloc_at only */
#include "keylock.h"
#include "util.h"

#define DL_MS 150
#define GUARD_MS 30000 /* a wait's timeout: hang guard only */
#define MAXT 4

static kl_provider *
private_provider(void)
{
	kl_provider *p = NULL;

	ck_assert_int_eq(kl_memory_provider_new(&p), KL_OK);
	return p;
}

static kl_lock *
lock_make_flags(kl_provider *p, int64_t timeout_ms, unsigned flags,
		kl_event_fn fn, void *arg)
{
	kl_lock_opts o = KL_LOCK_OPTS_INIT;
	kl_lock *l = NULL;

	o.provider = p;
	o.flags = flags;
	o.timeout_ms = timeout_ms;
	o.on_event = fn;
	o.event_arg = arg;
	ck_assert_int_eq(kl_lock_new(&l, &o), KL_OK);
	return l;
}

static kl_lock *
lock_make(kl_provider *p, int64_t timeout_ms, kl_event_fn fn, void *arg)
{
	return lock_make_flags(p, timeout_ms, 0, fn, arg);
}

/* ------------------------------------------------------------------ */
/* A ring of n threads: thread i takes key[i], then, once all have theirs,
 * waits for key[(i + 1) % n]. */

struct ring;

struct member {
	struct ring *r;
	int i;
	int rc;           /* of the wait for the next key */
	kl_error err;
	int64_t waited_ns;
	size_t holders, waiters; /* of its own key, seen after KL_EDEADLK */
	bool saw_release;        /* granted after a victim released */
	pthread_t t;
};

struct ring {
	int n;
	kl_provider *p[MAXT]; /* key i lives in p[i] */
	kl_lock *own[MAXT];   /* for thread i's own key */
	kl_lock *l[MAXT];     /* for thread i's second key */
	const char *key[MAXT];
	kl_cancel *cancel;    /* thread 0's second wait, when set */
	/* KL_SHARED or 0: thread i's own key, its second key */
	unsigned own_flags[MAXT], next_flags[MAXT];
	/* Thread 0 takes its own key with it, when set: shared, that makes
	 * a holder record in the key's ring, not a lone holder. */
	kl_cancel *own_cancel;
	bool arm;             /* fail the next allocation once all hold */
	long allocs;          /* made since then, when armed */
	pthread_barrier_t all_hold, armed;
	atomic_bool victim_released;
	struct member m[MAXT];
};

static void *
member_run(void *arg)
{
	struct member *m = arg;
	struct ring *r = m->r;
	int j = (m->i + 1) % r->n;
	kl_lease *own = NULL, *next = NULL;
	kl_lock *mine = r->own[m->i];
	kl_call call = { .key = r->key[m->i],
			 .cancel = m->i == 0 ? r->own_cancel : NULL };
	int64_t t0;

	if (kl_lock_acquire(mine, &call, &own, NULL) != KL_OK) {
		m->rc = -1000;
		pthread_barrier_wait(&r->all_hold);
		pthread_barrier_wait(&r->armed);
		return NULL;
	}
	if (pthread_barrier_wait(&r->all_hold) ==
		    PTHREAD_BARRIER_SERIAL_THREAD &&
	    r->arm)
		kl__test_fail_alloc_at(1);
	pthread_barrier_wait(&r->armed);
	call.key = r->key[j];
	call.cancel = m->i == 0 ? r->cancel : NULL;
	t0 = now_ns();
	m->rc = kl_lock_acquire(r->l[m->i], &call, &next, &m->err);
	m->waited_ns = now_ns() - t0;
	if (m->rc == KL_OK) {
		m->saw_release = atomic_load(&r->victim_released);
		kl_lease_release(next);
	} else if (m->rc == KL_EDEADLK) {
		kl_provider_status(r->p[m->i], r->key[m->i], &m->holders,
				   &m->waiters, NULL);
		atomic_store(&r->victim_released, true);
	}
	kl_lease_release(own);
	return NULL;
}

/* Runs the ring, each second wait with timeout_ms, and counts how the
 * second waits ended. */
static void
ring_run(struct ring *r, int64_t timeout_ms, int *deadlk, int *ok,
	 int *timedout)
{
	*deadlk = *ok = *timedout = 0;
	ck_assert_int_eq(pthread_barrier_init(&r->all_hold, NULL,
					      (unsigned)r->n),
			 0);
	ck_assert_int_eq(pthread_barrier_init(&r->armed, NULL,
					      (unsigned)r->n),
			 0);
	atomic_init(&r->victim_released, false);
	for (int i = 0; i < r->n; i++) {
		r->m[i].r = r;
		r->m[i].i = i;
		r->own[i] = lock_make_flags(r->p[i], GUARD_MS,
					    r->own_flags[i], NULL, NULL);
		r->l[i] = lock_make_flags(r->p[(i + 1) % r->n], timeout_ms,
					  r->next_flags[i], NULL, NULL);
		test_thread_start(&r->m[i].t, member_run, &r->m[i]);
	}
	for (int i = 0; i < r->n; i++) {
		test_thread_join(r->m[i].t);
		kl_lock_free(r->l[i]);
		kl_lock_free(r->own[i]);
		*deadlk += r->m[i].rc == KL_EDEADLK;
		*ok += r->m[i].rc == KL_OK;
		*timedout += r->m[i].rc == KL_ETIMEDOUT;
	}
	pthread_barrier_destroy(&r->all_hold);
	pthread_barrier_destroy(&r->armed);
	if (r->arm)
		r->allocs = kl__test_fail_alloc_at(0);
	for (int i = 0; i < r->n; i++)
		ck_assert_uint_eq(kl_memory_provider_size(r->p[i]), 0);
}

/* A ring over one private provider with keys[0..n-1]. */
static void
ring_init(struct ring *r, int n, const char *const *keys)
{
	memset(r, 0, sizeof *r);
	r->n = n;
	r->p[0] = private_provider();
	for (int i = 0; i < n; i++) {
		r->p[i] = r->p[0];
		r->key[i] = keys[i];
	}
}

static void
ring_fini(struct ring *r)
{
	for (int i = 0; i < r->n; i++)
		if (i == 0 || r->p[i] != r->p[0])
			kl_provider_free(r->p[i]);
}

/* The victim of a ring: exactly one, still holding its key with its
 * predecessor waiting for it; the others granted after it released. */
static void
assert_one_victim_after(struct ring *r, int deadlk, int ok, int64_t min_ms)
{
	ck_assert_int_eq(deadlk, 1);
	ck_assert_int_eq(ok, r->n - 1);
	for (int i = 0; i < r->n; i++) {
		struct member *m = &r->m[i];

		if (m->rc == KL_EDEADLK) {
			ck_assert_uint_eq(m->holders, 1);
			ck_assert_uint_eq(m->waiters, 1);
			ck_assert_int_ge(m->waited_ns, min_ms * 1000000LL);
			ck_assert_int_eq(m->err.status, KL_EDEADLK);
			ck_assert_msg(strstr(m->err.message, "deadlock") !=
					      NULL,
				      "message: %s", m->err.message);
		} else {
			ck_assert(m->saw_release);
		}
	}
}

static void
assert_one_victim(struct ring *r, int deadlk, int ok)
{
	assert_one_victim_after(r, deadlk, ok, DL_MS);
}

START_TEST(test_two_cycle)
{
	static const char *const keys[] = { "alpha", "beta" };
	struct ring r;
	int deadlk, ok, to;

	ck_assert_int_eq(kl_deadlock_ms_set(DL_MS), KL_OK);
	ring_init(&r, 2, keys);
	ring_run(&r, GUARD_MS, &deadlk, &ok, &to);
	assert_one_victim(&r, deadlk, ok);
	/* The message names both keys of the cycle. */
	for (int i = 0; i < 2; i++)
		if (r.m[i].rc == KL_EDEADLK) {
			ck_assert_msg(strstr(r.m[i].err.message, "'alpha'") &&
					      strstr(r.m[i].err.message,
						     "'beta'"),
				      "message: %s", r.m[i].err.message);
			ck_assert_msg(strstr(r.m[i].err.message,
					     "held by this thread"),
				      "message: %s", r.m[i].err.message);
		}
	ring_fini(&r);
}
END_TEST

START_TEST(test_three_cycle)
{
	/* A long key lives in a bucket chain, the others in slots. */
	static const char *const keys[] = {
		"k0", "k1", "a key long enough to live in a bucket chain"
	};
	struct ring r;
	int deadlk, ok, to;

	ck_assert_int_eq(kl_deadlock_ms_set(DL_MS), KL_OK);
	ring_init(&r, 3, keys);
	ring_run(&r, GUARD_MS, &deadlk, &ok, &to);
	assert_one_victim(&r, deadlk, ok);
	/* Every key of the cycle named, a long one shortened. */
	for (int i = 0; i < 3; i++)
		if (r.m[i].rc == KL_EDEADLK)
			for (int k = 0; k < 3; k++) {
				char want[24];

				snprintf(want, sizeof want, "'%s", keys[k]);
				ck_assert_msg(strstr(r.m[i].err.message,
						     want) != NULL,
					      "message: %s",
					      r.m[i].err.message);
			}
	ring_fini(&r);
}
END_TEST

/* The graph spans providers (tables), and a wait with a cancel token. */
START_TEST(test_cycle_across_providers)
{
	static const char *const keys[] = { "x", "x" };
	struct ring r;
	int deadlk, ok, to;

	ck_assert_int_eq(kl_deadlock_ms_set(DL_MS), KL_OK);
	ring_init(&r, 2, keys);
	r.p[1] = private_provider();
	ck_assert_int_eq(kl_cancel_new(&r.cancel), KL_OK);
	ring_run(&r, GUARD_MS, &deadlk, &ok, &to);
	assert_one_victim(&r, deadlk, ok);
	kl_cancel_free(r.cancel);
	ring_fini(&r);
}
END_TEST

/* No victim: a ring's waits end by their timeouts, not before.  The
 * first to time out releases its key, which its predecessor may still be
 * granted if its own timeout has not come yet on a loaded machine. */
static void
assert_timed_out(struct ring *r, int deadlk, int ok, int to,
		 int64_t timeout_ms)
{
	ck_assert_int_eq(deadlk, 0);
	ck_assert_int_ge(to, 1);
	ck_assert_int_eq(to + ok, r->n);
	for (int i = 0; i < r->n; i++)
		if (r->m[i].rc == KL_ETIMEDOUT)
			ck_assert_int_ge(r->m[i].waited_ns,
					 timeout_ms * 1000000LL);
}

/* Checked as they start (0 ms), both waits of a two-cycle check at about
 * the same moment, round after round: one victim each time. */
START_TEST(test_cycles_checked_at_once)
{
	long rounds = kl_test_scaled(40, 10);
	struct ring r;
	int deadlk, ok, to;

	ck_assert_int_eq(kl_deadlock_ms_set(0), KL_OK);
	for (long i = 0; i < rounds; i++) {
		ring_init(&r, i % 2 == 0 ? 2 : 3,
			  (const char *const[]){ "p", "q", "r" });
		ring_run(&r, GUARD_MS, &deadlk, &ok, &to);
		assert_one_victim_after(&r, deadlk, ok, 0);
		ring_fini(&r);
	}
}
END_TEST

/* A timeout that comes before deadlock_ms ends the waits as before. */
START_TEST(test_timeout_first)
{
	static const char *const keys[] = { "a", "b" };
	struct ring r;
	int deadlk, ok, to;

	ck_assert_int_eq(kl_deadlock_ms_set(60000), KL_OK);
	ring_init(&r, 2, keys);
	ring_run(&r, 200, &deadlk, &ok, &to);
	assert_timed_out(&r, deadlk, ok, to, 200);
	ring_fini(&r);
}
END_TEST

/* Off, a cycle waits until its timeouts. */
START_TEST(test_off_waits_for_timeout)
{
	static const char *const keys[] = { "a", "b" };
	struct ring r;
	int deadlk, ok, to;

	ck_assert_int_eq(kl_deadlock_ms_set(KL_FOREVER), KL_OK);
	ck_assert_int_eq(kl_deadlock_ms(), KL_FOREVER);
	ring_init(&r, 2, keys);
	ring_run(&r, 3 * DL_MS, &deadlk, &ok, &to);
	assert_timed_out(&r, deadlk, ok, to, 3 * DL_MS);
	ring_fini(&r);
}
END_TEST

/* ------------------------------------------------------------------ */
/* A cycle of one                                                      */

struct nest {
	kl_lock *l;
	int rc;
	kl_error err;
	int64_t ns;
};

static int
nest_inner(void *arg)
{
	(void)arg;
	return 0;
}

static int
nest_outer(void *arg)
{
	struct nest *n = arg;
	kl_call call = { .key = "self", .cancel = NULL };
	int64_t t0 = now_ns();

	n->rc = kl_lock_run(n->l, &call, nest_inner, n, NULL, &n->err);
	n->ns = now_ns() - t0;
	return 0;
}

START_TEST(test_self_cycle)
{
	kl_provider *p = private_provider();
	kl_call call = { .key = "self", .cancel = NULL };
	struct nest n;
	kl_lease *a = NULL, *b = (kl_lease *)&b;
	kl_error err;
	int64_t t0;

	ck_assert_int_eq(kl_deadlock_ms_set(DL_MS), KL_OK);
	memset(&n, 0, sizeof n);
	n.l = lock_make(p, GUARD_MS, NULL, NULL);
	ck_assert_int_eq(kl_lock_run(n.l, &call, nest_outer, &n, NULL, NULL),
			 KL_OK);
	ck_assert_int_eq(n.rc, KL_EDEADLK);
	ck_assert_int_ge(n.ns, DL_MS * 1000000LL);
	ck_assert_int_lt(n.ns, (GUARD_MS / 2) * 1000000LL);
	ck_assert_msg(strstr(n.err.message, "'self'") != NULL &&
			      strstr(n.err.message, "held by this thread"),
		      "message: %s", n.err.message);

	/* Through leases; the first stays held. */
	ck_assert_int_eq(kl_lock_acquire(n.l, &call, &a, NULL), KL_OK);
	t0 = now_ns();
	ck_assert_int_eq(kl_lock_acquire(n.l, &call, &b, &err), KL_EDEADLK);
	ck_assert_int_ge(now_ns() - t0, DL_MS * 1000000LL);
	ck_assert_ptr_null(b);
	ck_assert_int_eq(err.status, KL_EDEADLK);
	test_assert_status(p, "self", 1, 0);
	kl_lease_release(a);
	ck_assert_uint_eq(kl_memory_provider_size(p), 0);
	kl_lock_free(n.l);

	/* KL_ERRORCHECK's refusal, at once, names no cycle (none left over
	 * from the waits above either). */
	{
		kl_lock_opts o = KL_LOCK_OPTS_INIT;

		o.provider = p;
		o.flags = KL_ERRORCHECK;
		ck_assert_int_eq(kl_lock_new(&n.l, &o), KL_OK);
	}
	ck_assert_int_eq(kl_lock_acquire(n.l, &call, &a, NULL), KL_OK);
	b = NULL;
	ck_assert_int_eq(kl_lock_acquire(n.l, &call, &b, &err), KL_EDEADLK);
	ck_assert_msg(strstr(err.message, "waits for") == NULL, "message: %s",
		      err.message);
	kl_lease_release(a);
	kl_lock_free(n.l);
	kl_provider_free(p);
}
END_TEST

/* A key set in a cycle with a single key: one victim; a set that is the
 * victim gives back the key it took, and its function does not run. */
struct set_side {
	kl_lock *l;
	pthread_barrier_t holds, go;
	int rc, set_rc, ran;
	kl_error err, set_err;
	pthread_t t, s;
};

/* Holds "b", then waits for "a". */
static void *
single_side(void *arg)
{
	struct set_side *x = arg;
	kl_call call = { .key = "b", .cancel = NULL };
	kl_lease *b = NULL, *a = NULL;

	x->rc = kl_lock_acquire(x->l, &call, &b, NULL);
	pthread_barrier_wait(&x->holds);
	pthread_barrier_wait(&x->go);
	if (x->rc != KL_OK)
		return NULL;
	call.key = "a";
	x->rc = kl_lock_acquire(x->l, &call, &a, &x->err);
	kl_lease_release(a);
	kl_lease_release(b);
	return NULL;
}

static int
set_ran(kl_lease *lease, void *arg)
{
	(void)lease;
	((struct set_side *)arg)->ran++;
	return 0;
}

/* Takes "a", then waits for "b". */
static void *
set_side_run(void *arg)
{
	static const char *const keys[] = { "b", "a" };
	struct set_side *x = arg;

	x->set_rc = kl_lock_run_many(x->l, keys, 2, NULL, set_ran, x, NULL,
				     &x->set_err);
	return NULL;
}

START_TEST(test_set_in_cycle)
{
	kl_provider *p = private_provider();
	struct set_side x;

	memset(&x, 0, sizeof x);
	ck_assert_int_eq(kl_deadlock_ms_set(DL_MS), KL_OK);
	ck_assert_int_eq(pthread_barrier_init(&x.holds, NULL, 2), 0);
	ck_assert_int_eq(pthread_barrier_init(&x.go, NULL, 2), 0);
	x.l = lock_make(p, GUARD_MS, NULL, NULL);
	test_thread_start(&x.t, single_side, &x);
	pthread_barrier_wait(&x.holds);
	test_thread_start(&x.s, set_side_run, &x);
	/* The set holds "a" and waits for "b". */
	test_wait_status(p, "b", 1, 1, TEST_POLL_LIMIT_MS);
	pthread_barrier_wait(&x.go);
	test_thread_join(x.t);
	test_thread_join(x.s);
	ck_assert_int_eq((x.rc == KL_EDEADLK) + (x.set_rc == KL_EDEADLK), 1);
	ck_assert_int_eq((x.rc == KL_OK) + (x.set_rc == KL_OK), 1);
	ck_assert_int_eq(x.ran, x.set_rc == KL_OK);
	if (x.set_rc == KL_EDEADLK)
		ck_assert_msg(strstr(x.set_err.message, "'a'") &&
				      strstr(x.set_err.message, "'b'"),
			      "message: %s", x.set_err.message);
	ck_assert_uint_eq(kl_memory_provider_size(p), 0);
	pthread_barrier_destroy(&x.holds);
	pthread_barrier_destroy(&x.go);
	kl_lock_free(x.l);
	kl_provider_free(p);
}
END_TEST

/* A timeout shorter than deadlock_ms: KL_ETIMEDOUT, as before. */
START_TEST(test_self_timeout_first)
{
	kl_provider *p = private_provider();
	kl_lock *l = lock_make(p, 100, NULL, NULL);
	kl_call call = { .key = "self", .cancel = NULL };
	kl_lease *a = NULL, *b = NULL;
	kl_error err;

	ck_assert_int_eq(kl_deadlock_ms_set(5000), KL_OK);
	ck_assert_int_eq(kl_lock_acquire(l, &call, &a, NULL), KL_OK);
	ck_assert_int_eq(kl_lock_acquire(l, &call, &b, &err), KL_ETIMEDOUT);
	ck_assert_ptr_null(strstr(err.message, "deadlock"));
	kl_lease_release(a);
	kl_lock_free(l);
	kl_provider_free(p);
}
END_TEST

/* The victim's REJECTED event carries KL_EDEADLK; a lock with a hook goes
 * through the provider's operations, which name the cycle too. */
START_TEST(test_rejected_event)
{
	kl_provider *p = private_provider();
	struct test_events ev;
	kl_lock *l;
	kl_call call = { .key = "evt", .cancel = NULL };
	kl_lease *a = NULL, *b = NULL;
	kl_error err;

	tev_init(&ev);
	l = lock_make(p, GUARD_MS, tev_record, &ev);
	ck_assert_int_eq(kl_deadlock_ms_set(DL_MS), KL_OK);
	ck_assert_int_eq(kl_lock_acquire(l, &call, &a, NULL), KL_OK);
	ck_assert_int_eq(kl_lock_acquire(l, &call, &b, &err), KL_EDEADLK);
	ck_assert_int_eq(tev_count(&ev, KL_EV_ACQUIRED), 1);
	ck_assert_int_eq(tev_count(&ev, KL_EV_REJECTED), 1);
	ck_assert_int_eq(ev.status_of[KL_EV_REJECTED], KL_EDEADLK);
	ck_assert_msg(strstr(err.message, "'evt'") != NULL &&
			      strstr(err.message, "deadlock") != NULL,
		      "message: %s", err.message);
	kl_lease_release(a);
	ck_assert_int_eq(tev_count(&ev, KL_EV_RELEASED), 1);
	kl_lock_free(l);
	kl_provider_free(p);
}
END_TEST

/* ------------------------------------------------------------------ */
/* No false victim                                                     */

struct chain_waiter {
	kl_provider *p;
	const char *hold; /* NULL: holds nothing */
	const char *want;
	int rc;
	pthread_t t;
};

static void *
chain_run(void *arg)
{
	struct chain_waiter *c = arg;
	kl_lock_opts o = KL_LOCK_OPTS_INIT;
	kl_lock *l = NULL;
	kl_lease *held = NULL, *got = NULL;
	kl_call call = { .key = c->hold, .cancel = NULL };

	o.provider = c->p;
	o.timeout_ms = GUARD_MS;
	if ((c->rc = kl_lock_new(&l, &o)) != KL_OK)
		return NULL;
	if (c->hold != NULL &&
	    (c->rc = kl_lock_acquire(l, &call, &held, NULL)) != KL_OK) {
		kl_lock_free(l);
		return NULL;
	}
	call.key = c->want;
	c->rc = kl_lock_acquire(l, &call, &got, NULL);
	kl_lease_release(got);
	kl_lease_release(held);
	kl_lock_free(l);
	return NULL;
}

/* The test's thread holds "h" 1.5 s while a chain waits on it (c1 waits
 * for h holding c1, c2 for c1 holding c2, c3 for c2): many checks, no
 * cycle, no victim. */
START_TEST(test_long_chain_no_victim)
{
	kl_provider *p = private_provider();
	kl_lock *l = lock_make(p, GUARD_MS, NULL, NULL);
	kl_call call = { .key = "h", .cancel = NULL };
	struct chain_waiter c[3] = {
		{ .p = p, .hold = "c1", .want = "h" },
		{ .p = p, .hold = "c2", .want = "c1" },
		{ .p = p, .hold = NULL, .want = "c2" },
	};
	kl_lease *h = NULL;

	ck_assert_int_eq(kl_deadlock_ms_set(200), KL_OK);
	ck_assert_int_eq(kl_lock_acquire(l, &call, &h, NULL), KL_OK);
	for (int i = 0; i < 3; i++) {
		test_thread_start(&c[i].t, chain_run, &c[i]);
		test_wait_status(p, c[i].want, 1, 1, TEST_POLL_LIMIT_MS);
	}
	test_sleep_ms(1500);
	kl_lease_release(h);
	for (int i = 0; i < 3; i++) {
		test_thread_join(c[i].t);
		ck_assert_int_eq(c[i].rc, KL_OK);
	}
	ck_assert_uint_eq(kl_memory_provider_size(p), 0);
	kl_lock_free(l);
	kl_provider_free(p);
}
END_TEST

struct setter {
	kl_lock *l;
	int idx;
	long rounds;
	int bad;   /* outcomes other than KL_OK */
	int deadlk;
	pthread_t t;
};

static atomic_int set_inside;

static int
set_fn(kl_lease *lease, void *arg)
{
	(void)lease;
	(void)arg;
	atomic_fetch_add(&set_inside, 1);
	sched_yield();
	atomic_fetch_sub(&set_inside, 1);
	return 0;
}

static void *
setter_run(void *arg)
{
	static const char *const orders[4][3] = {
		{ "x", "y", "z" }, { "z", "y", "x" },
		{ "y", "z", "x" }, { "x", "z", "y" },
	};
	struct setter *s = arg;

	for (long i = 0; i < s->rounds; i++) {
		int rc = kl_lock_run_many(s->l, orders[(s->idx + i) % 4], 3,
					  NULL, set_fn, NULL, NULL, NULL);

		s->bad += rc != KL_OK;
		s->deadlk += rc == KL_EDEADLK;
	}
	return NULL;
}

/* Key sets never wait in a cycle: with every wait checked at once (0 ms),
 * thousands of waits on shared keys give no victim. */
START_TEST(test_key_sets_no_victim)
{
	kl_provider *p = private_provider();
	struct setter s[4];

	ck_assert_int_eq(kl_deadlock_ms_set(0), KL_OK);
	ck_assert_int_eq(kl_deadlock_ms(), 0);
	for (int i = 0; i < 4; i++) {
		s[i] = (struct setter){ .idx = i,
					.rounds = kl_test_scaled(2000, 200) };
		s[i].l = lock_make(p, GUARD_MS, NULL, NULL);
		test_thread_start(&s[i].t, setter_run, &s[i]);
	}
	for (int i = 0; i < 4; i++) {
		test_thread_join(s[i].t);
		ck_assert_int_eq(s[i].deadlk, 0);
		ck_assert_int_eq(s[i].bad, 0);
		kl_lock_free(s[i].l);
	}
	ck_assert_uint_eq(kl_memory_provider_size(p), 0);
	kl_provider_free(p);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Allocation and the setting                                          */

/* Detection allocates nothing: with the next allocation armed to fail
 * once both keys are held, the cycle is still broken, and no allocation
 * was even tried until every thread was done. */
START_TEST(test_no_allocation)
{
	static const char *const keys[] = { "a long key of a chained entry",
					    "b" };
	struct ring r;
	int deadlk, ok, to;

	ck_assert_int_eq(kl_deadlock_ms_set(DL_MS), KL_OK);
	ring_init(&r, 2, keys);
	r.arm = true;
	ring_run(&r, GUARD_MS, &deadlk, &ok, &to);
	assert_one_victim(&r, deadlk, ok);
	ck_assert_int_eq(r.allocs, 0);
	ring_fini(&r);
}
END_TEST

START_TEST(test_setting)
{
	const char *fork_mode = getenv("CK_FORK");

	/* Each test runs in a child of its own: the setting was never read
	 * there, so the environment decides it, once. */
	if (fork_mode == NULL || strcmp(fork_mode, "no") != 0) {
		ck_assert_int_eq(setenv("KEYLOCK_DEADLOCK_MS", "250ms", 1), 0);
		ck_assert_int_eq(kl_deadlock_ms(), 250);
		ck_assert_int_eq(setenv("KEYLOCK_DEADLOCK_MS", "5s", 1), 0);
		ck_assert_int_eq(kl_deadlock_ms(), 250);
	}
	ck_assert_int_eq(kl_deadlock_ms_set(-2), KL_EINVAL);
	ck_assert_int_eq(kl_deadlock_ms_set(INT64_MIN), KL_EINVAL);
	ck_assert_int_eq(kl_deadlock_ms_set(KL_FOREVER), KL_OK);
	ck_assert_int_eq(kl_deadlock_ms(), KL_FOREVER);
	ck_assert_int_eq(kl_deadlock_ms_set(0), KL_OK);
	ck_assert_int_eq(kl_deadlock_ms(), 0);
	ck_assert_int_eq(kl_deadlock_ms_set(1000), KL_OK);
	ck_assert_int_eq(kl_deadlock_ms(), 1000);
	ck_assert_int_eq(kl_deadlock_ms_set(INT64_MAX), KL_OK);
	ck_assert_int_eq(kl_deadlock_ms(), INT64_MAX);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Shared holders and shared waits (KL_SHARED)                         */

/* A ring whose member 0 holds its key shared: alone (E_SOLO), or, with a
 * cancel token, by a holder record in the key's ring; member 1 holds its
 * key exclusively.  Both then wait exclusively: one victim. */
START_TEST(test_cycle_shared_holder)
{
	static const char *const keys[] = { "read", "write" };
	struct ring r;
	int deadlk, ok, to;

	ck_assert_int_eq(kl_deadlock_ms_set(DL_MS), KL_OK);
	for (int ringed = 0; ringed < 2; ringed++) {
		ring_init(&r, 2, keys);
		r.own_flags[0] = KL_SHARED;
		if (ringed)
			ck_assert_int_eq(kl_cancel_new(&r.own_cancel), KL_OK);
		ring_run(&r, GUARD_MS, &deadlk, &ok, &to);
		assert_one_victim(&r, deadlk, ok);
		for (int i = 0; i < 2; i++)
			if (r.m[i].rc == KL_EDEADLK)
				ck_assert_msg(strstr(r.m[i].err.message,
						     "'read'") &&
						      strstr(r.m[i].err.message,
							     "'write'"),
					      "message: %s",
					      r.m[i].err.message);
		kl_cancel_free(r.own_cancel);
		ring_fini(&r);
	}
}
END_TEST

/* A shared request waits like an exclusive one.  Cycles with member 0's
 * wait shared (for a key held exclusively), with both waits shared, and
 * with member 0 holding its key shared (by a holder record: a token) and
 * waiting shared while member 1 waits for that key exclusively: one
 * victim each. */
START_TEST(test_cycle_shared_waiter)
{
	static const char *const keys[] = { "left", "right" };
	struct ring r;
	int deadlk, ok, to;

	ck_assert_int_eq(kl_deadlock_ms_set(DL_MS), KL_OK);
	for (int v = 0; v < 3; v++) {
		ring_init(&r, 2, keys);
		r.next_flags[0] = KL_SHARED;
		if (v == 1)
			r.next_flags[1] = KL_SHARED;
		if (v == 2) {
			r.own_flags[0] = KL_SHARED;
			ck_assert_int_eq(kl_cancel_new(&r.own_cancel), KL_OK);
		}
		ring_run(&r, GUARD_MS, &deadlk, &ok, &to);
		assert_one_victim(&r, deadlk, ok);
		kl_cancel_free(r.own_cancel);
		ring_fini(&r);
	}
}
END_TEST

/* No cycle through many shared holders: readers hold "k" (the first
 * alone, the others by records), one of them waits for "n", held by the
 * test's thread; a writer holding "m" waits for "k"; a reader waits for
 * "m".  Every wait is checked several times; none is a victim, and all
 * are granted once "n" is given back. */
#define NREAD 4

struct nv {
	kl_provider *p;
	kl_lock *rd, *wr;
	atomic_bool go;
	int rc[NREAD + 2];
	pthread_t t[NREAD + 2];
};

struct nv_arg {
	struct nv *v;
	int i;
};

static void
nv_wait_go(struct nv *v)
{
	for (int i = 0; i < GUARD_MS && !atomic_load(&v->go); i++)
		test_sleep_ms(1);
}

static void *
nv_reader(void *arg)
{
	struct nv_arg *a = arg;
	struct nv *v = a->v;
	kl_call call = { .key = "k", .cancel = NULL };
	kl_lease *k = NULL, *n = NULL;

	if ((a->v->rc[a->i] = kl_lock_acquire(v->rd, &call, &k, NULL)) !=
	    KL_OK)
		return NULL;
	if (a->i == 0) {
		call.key = "n";
		v->rc[a->i] = kl_lock_acquire(v->wr, &call, &n, NULL);
		if (n != NULL)
			kl_lease_release(n);
	} else {
		nv_wait_go(v);
	}
	kl_lease_release(k);
	return NULL;
}

static void *
nv_writer(void *arg)
{
	struct nv_arg *a = arg;
	struct nv *v = a->v;
	kl_call call = { .key = "m", .cancel = NULL };
	kl_lease *m = NULL, *k = NULL;

	if ((v->rc[a->i] = kl_lock_acquire(v->wr, &call, &m, NULL)) != KL_OK)
		return NULL;
	call.key = "k";
	if ((v->rc[a->i] = kl_lock_acquire(v->wr, &call, &k, NULL)) == KL_OK)
		kl_lease_release(k);
	kl_lease_release(m);
	return NULL;
}

static void *
nv_late_reader(void *arg)
{
	struct nv_arg *a = arg;
	kl_call call = { .key = "m", .cancel = NULL };
	kl_lease *m = NULL;

	if ((a->v->rc[a->i] = kl_lock_acquire(a->v->rd, &call, &m, NULL)) ==
	    KL_OK)
		kl_lease_release(m);
	return NULL;
}

START_TEST(test_shared_no_victim)
{
	struct nv v;
	struct nv_arg a[NREAD + 2];
	kl_lock_opts o = KL_LOCK_OPTS_INIT;
	kl_call call = { .key = "n", .cancel = NULL };
	kl_lease *n = NULL;

	ck_assert_int_eq(kl_deadlock_ms_set(DL_MS), KL_OK);
	memset(&v, 0, sizeof v);
	atomic_init(&v.go, false);
	v.p = private_provider();
	o.provider = v.p;
	o.timeout_ms = GUARD_MS;
	o.flags = KL_SHARED;
	ck_assert_int_eq(kl_lock_new(&v.rd, &o), KL_OK);
	v.wr = lock_make(v.p, GUARD_MS, NULL, NULL);
	ck_assert_int_eq(kl_lock_acquire(v.wr, &call, &n, NULL), KL_OK);
	for (int i = 0; i < NREAD + 2; i++) {
		a[i].v = &v;
		a[i].i = i;
	}
	for (int i = 0; i < NREAD; i++) {
		test_thread_start(&v.t[i], nv_reader, &a[i]);
		/* The first alone; then the others join it. */
		test_wait_status(v.p, "k", (size_t)i + 1, 0, GUARD_MS);
	}
	test_wait_status(v.p, "n", 1, 1, GUARD_MS);
	test_thread_start(&v.t[NREAD], nv_writer, &a[NREAD]);
	test_wait_status(v.p, "k", NREAD, 1, GUARD_MS);
	test_thread_start(&v.t[NREAD + 1], nv_late_reader, &a[NREAD + 1]);
	test_wait_status(v.p, "m", 1, 1, GUARD_MS);
	/* Several checks of every wait. */
	test_sleep_ms(4 * DL_MS);
	test_assert_status(v.p, "k", NREAD, 1);
	test_assert_status(v.p, "m", 1, 1);
	test_assert_status(v.p, "n", 1, 1);
	atomic_store(&v.go, true);
	kl_lease_release(n);
	for (int i = 0; i < NREAD + 2; i++)
		test_thread_join(v.t[i]);
	for (int i = 0; i < NREAD + 2; i++)
		ck_assert_msg(v.rc[i] == KL_OK, "thread %d: %s", i,
			      kl_strerror(v.rc[i]));
	kl_lock_free(v.rd);
	kl_lock_free(v.wr);
	ck_assert_uint_eq(kl_memory_provider_size(v.p), 0);
	kl_provider_free(v.p);
}
END_TEST

/* A reader queued behind a writer that is the victim of a cycle: X holds
 * "a" shared (by a record: a token) and waits for "b"; Y holds "b" and
 * then waits for "a" exclusively, R asks for "a" shared behind Y (Web
 * Locks: behind a queued writer).  Y's wait closes the cycle last, so it
 * is the victim; leaving, it grants R, which shares "a" with X while Y
 * still holds "b" (Y releases it only once R was granted).  A round where
 * R was not seen queued before Y left, or where X's check came first, is
 * run again. */
struct rb {
	kl_provider *p;
	kl_lock *rd, *wr;
	kl_cancel *tok;
	atomic_bool x_go, y_go, r_granted, y_done;
	int x_rc, y_rc, r_rc;
	bool y_saw_r;
	kl_error y_err;
};

static void
rb_wait(atomic_bool *b, int64_t limit_ms)
{
	for (int64_t i = 0; i < limit_ms && !atomic_load(b); i++)
		test_sleep_ms(1);
}

static void *
rb_x(void *arg)
{
	struct rb *r = arg;
	kl_call call = { .key = "a", .cancel = r->tok };
	kl_lease *a = NULL, *b = NULL;

	if ((r->x_rc = kl_lock_acquire(r->rd, &call, &a, NULL)) != KL_OK)
		return NULL;
	rb_wait(&r->x_go, GUARD_MS);
	call.key = "b";
	call.cancel = NULL;
	if ((r->x_rc = kl_lock_acquire(r->wr, &call, &b, NULL)) == KL_OK)
		kl_lease_release(b);
	kl_lease_release(a);
	return NULL;
}

static void *
rb_y(void *arg)
{
	struct rb *r = arg;
	kl_call call = { .key = "b", .cancel = NULL };
	kl_lease *a = NULL, *b = NULL;

	if ((r->y_rc = kl_lock_acquire(r->wr, &call, &b, NULL)) != KL_OK) {
		atomic_store(&r->y_done, true);
		return NULL;
	}
	rb_wait(&r->y_go, GUARD_MS);
	call.key = "a";
	r->y_rc = kl_lock_acquire(r->wr, &call, &a, &r->y_err);
	atomic_store(&r->y_done, true);
	if (r->y_rc == KL_OK) {
		kl_lease_release(a);
	} else if (r->y_rc == KL_EDEADLK) {
		/* A hang guard: R is granted at once, or never. */
		rb_wait(&r->r_granted, 10000);
		r->y_saw_r = atomic_load(&r->r_granted);
	}
	kl_lease_release(b);
	return NULL;
}

static void *
rb_r(void *arg)
{
	struct rb *r = arg;
	kl_call call = { .key = "a", .cancel = NULL };
	kl_lease *a = NULL;

	r->r_rc = kl_lock_acquire(r->rd, &call, &a, NULL);
	atomic_store(&r->r_granted, true);
	if (r->r_rc == KL_OK)
		kl_lease_release(a);
	return NULL;
}

START_TEST(test_reader_behind_victim)
{
	long rounds = 0, conclusive = 0;
	kl_lock_opts o = KL_LOCK_OPTS_INIT;

	ck_assert_int_eq(kl_deadlock_ms_set(DL_MS), KL_OK);
	while (conclusive == 0 && rounds++ < 8) {
		struct rb r;
		pthread_t x, y, rt;
		size_t holders = 0, waiters = 0;
		bool queued = false;

		memset(&r, 0, sizeof r);
		atomic_init(&r.x_go, false);
		atomic_init(&r.y_go, false);
		atomic_init(&r.r_granted, false);
		atomic_init(&r.y_done, false);
		r.p = private_provider();
		o.provider = r.p;
		o.timeout_ms = GUARD_MS;
		o.flags = KL_SHARED;
		ck_assert_int_eq(kl_lock_new(&r.rd, &o), KL_OK);
		r.wr = lock_make(r.p, GUARD_MS, NULL, NULL);
		ck_assert_int_eq(kl_cancel_new(&r.tok), KL_OK);
		test_thread_start(&x, rb_x, &r);
		test_wait_status(r.p, "a", 1, 0, GUARD_MS);
		test_thread_start(&y, rb_y, &r);
		test_wait_status(r.p, "b", 1, 0, GUARD_MS);
		atomic_store(&r.x_go, true);
		test_wait_status(r.p, "b", 1, 1, GUARD_MS);
		atomic_store(&r.y_go, true);
		test_wait_status(r.p, "a", 1, 1, GUARD_MS);
		test_thread_start(&rt, rb_r, &r);
		/* R queued behind Y while Y still waits, or not this round. */
		while (!atomic_load(&r.y_done)) {
			kl_provider_status(r.p, "a", &holders, &waiters, NULL);
			if (waiters == 2) {
				queued = true;
				break;
			}
			test_sleep_ms(1);
		}
		test_thread_join(y);
		test_thread_join(x);
		test_thread_join(rt);
		ck_assert_int_eq((r.x_rc == KL_EDEADLK) +
					 (r.y_rc == KL_EDEADLK),
				 1);
		ck_assert_int_eq(r.r_rc, KL_OK);
		if (queued && r.y_rc == KL_EDEADLK) {
			conclusive++;
			ck_assert_int_eq(r.x_rc, KL_OK);
			ck_assert_msg(r.y_saw_r,
				      "the reader behind the victim was not "
				      "granted while the victim held its key");
			ck_assert_int_eq(r.y_err.status, KL_EDEADLK);
			ck_assert_msg(strstr(r.y_err.message, "'a'") &&
					      strstr(r.y_err.message, "'b'"),
				      "message: %s", r.y_err.message);
		}
		kl_cancel_free(r.tok);
		kl_lock_free(r.rd);
		kl_lock_free(r.wr);
		ck_assert_uint_eq(kl_memory_provider_size(r.p), 0);
		kl_provider_free(r.p);
	}
	ck_assert_int_ge(conclusive, 1);
}
END_TEST

static Suite *
deadlock_suite(void)
{
	Suite *s = suite_create("deadlock");
	TCase *tc;

	tc = test_tcase(s, "cycles", 120, NULL, NULL);
	tcase_add_test(tc, test_two_cycle);
	tcase_add_test(tc, test_three_cycle);
	tcase_add_test(tc, test_cycle_across_providers);
	tcase_add_test(tc, test_self_cycle);
	tcase_add_test(tc, test_rejected_event);
	tcase_add_test(tc, test_set_in_cycle);
	tcase_add_test(tc, test_cycles_checked_at_once);
	tc = test_tcase(s, "shared", 120, NULL, NULL);
	tcase_add_test(tc, test_cycle_shared_holder);
	tcase_add_test(tc, test_cycle_shared_waiter);
	tcase_add_test(tc, test_reader_behind_victim);
	tc = test_tcase(s, "timeouts", 120, NULL, NULL);
	tcase_add_test(tc, test_timeout_first);
	tcase_add_test(tc, test_self_timeout_first);
	tcase_add_test(tc, test_off_waits_for_timeout);
	tc = test_tcase(s, "no victim", 300, NULL, NULL);
	tcase_add_test(tc, test_long_chain_no_victim);
	tcase_add_test(tc, test_key_sets_no_victim);
	tcase_add_test(tc, test_shared_no_victim);
	tc = test_tcase(s, "setting", 60, NULL, NULL);
	tcase_add_test(tc, test_setting);
	tcase_add_test(tc, test_no_allocation);
	return s;
}

int
main(void)
{
	return test_run_suite(deadlock_suite());
}
