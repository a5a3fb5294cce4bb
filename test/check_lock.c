/* SPDX-License-Identifier: MIT */
/*
 * Tests of the Lock strategy (kl_lock_*, kl_lease_*) through the public API:
 * key resolution (the lock's key wins, then the call's, else KL_ENOKEY),
 * exclusion through the shared memory provider, arrival-order grants,
 * timeouts and cancellation (also racing a grant), events and their
 * delivery with no internal lock held, run-under-lock on every path, leases,
 * fences, non-reentrancy and error-check, user providers that fail, option
 * copying and validation, run-under-lock with the lease (kl_lock_run_lease:
 * the lease fn gets, events, every path, a release by fn, a fenced store),
 * and a mutual exclusion stress.
 *
 * Orders are forced through kl_memory_provider_queue_size (a public probe
 * of the memory provider: threads waiting for a key), never by sleeping.
 * Worker threads and event callbacks never call ck_assert*: they record,
 * and the test's thread asserts after joining them.
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
#include <unistd.h>

#include "keylock.h"
#include "util.h"

/* ------------------------------------------------------------------ */
/* Helpers                                                             */

static kl_lock *
lock_make(kl_provider *p, const char *key, int64_t timeout_ms,
	  unsigned flags, kl_event_fn on_event, void *event_arg)
{
	kl_lock_opts o = KL_LOCK_OPTS_INIT;
	kl_lock *l = NULL;

	o.provider = p;
	o.key = key;
	o.timeout_ms = timeout_ms;
	o.flags = flags;
	o.on_event = on_event;
	o.event_arg = event_arg;
	ck_assert_int_eq(kl_lock_new(&l, &o), KL_OK);
	ck_assert_ptr_nonnull(l);
	return l;
}

static kl_provider *
private_provider(void)
{
	kl_provider *p = NULL;

	ck_assert_int_eq(kl_memory_provider_new(&p), KL_OK);
	ck_assert_ptr_nonnull(p);
	return p;
}

struct qcond {
	kl_provider *p;
	const char *key;
	size_t n;
};

static bool
queue_is(void *arg)
{
	struct qcond *c = arg;

	return kl_memory_provider_queue_size(c->p, c->key) == c->n;
}

static void
wait_queue(kl_provider *p, const char *key, size_t n)
{
	struct qcond c = { .p = p, .key = key, .n = n };

	test_poll(queue_is, &c, "the key's queue size");
}

/* True when key is free on p: another lock takes it at once. */
static bool
key_free(kl_provider *p, const char *key)
{
	kl_lock *l = lock_make(p, key, 0, 0, NULL, NULL);
	kl_lease *lease = NULL;
	int rc = kl_lock_acquire(l, NULL, &lease, NULL);

	if (rc == KL_OK)
		kl_lease_release(lease);
	kl_lock_free(l);
	return rc == KL_OK;
}

static int
fn_count(void *arg)
{
	atomic_fetch_add((atomic_int *)arg, 1);
	return 7;
}

/* Events, recorded by the callback (any thread) for the test to check. */
#define EV_MAX 32

struct ev {
	kl_event_type type;
	bool key_null;
	char key[64];
	int status;
	int64_t waited_ms, held_ms;
};

struct evlog {
	pthread_mutex_t mu;
	int n;
	struct ev ev[EV_MAX];
};

static void
evlog_init(struct evlog *g)
{
	memset(g, 0, sizeof *g);
	pthread_mutex_init(&g->mu, NULL);
}

static void
evlog_fini(struct evlog *g)
{
	pthread_mutex_destroy(&g->mu);
}

static void
evlog_fn(const kl_event *e, void *arg)
{
	struct evlog *g = arg;

	pthread_mutex_lock(&g->mu);
	if (g->n < EV_MAX) {
		struct ev *v = &g->ev[g->n];

		v->type = e->type;
		v->key_null = e->key == NULL;
		snprintf(v->key, sizeof v->key, "%s",
			 e->key != NULL ? e->key : "");
		v->status = e->status;
		v->waited_ms = e->waited_ms;
		v->held_ms = e->held_ms;
	}
	g->n++;
	pthread_mutex_unlock(&g->mu);
}

static void
check_event(struct evlog *g, int i, kl_event_type type, const char *key,
	    int status)
{
	ck_assert_int_gt(g->n, i);
	ck_assert_int_eq(g->ev[i].type, type);
	if (key == NULL) {
		ck_assert(g->ev[i].key_null);
	} else {
		ck_assert(!g->ev[i].key_null);
		ck_assert_str_eq(g->ev[i].key, key);
	}
	ck_assert_int_eq(g->ev[i].status, status);
}

/* A thread in kl_lock_run (or kl_lock_acquire then release). */
struct lw {
	pthread_t th;
	kl_lock *l;
	kl_call call;
	atomic_int *next_seq; /* grant ranks, may be NULL */
	bool lease_fn;        /* kl_lock_run_lease instead of kl_lock_run */
	/* Outputs. */
	int rc;
	int seq;
	int ran;
	int fn_result;
	kl_error err;
	int64_t start_ns, end_ns;
	atomic_bool done;
};

static int
lw_fn(void *arg)
{
	struct lw *w = arg;

	if (w->next_seq != NULL)
		w->seq = atomic_fetch_add(w->next_seq, 1);
	w->ran++;
	return 11;
}

static int
lw_lease_fn(kl_lease *lease, void *arg)
{
	struct lw *w = arg;

	if (lease == NULL || !kl_lease_valid(lease))
		return -1;
	return lw_fn(w);
}

static void *
lw_main(void *arg)
{
	struct lw *w = arg;

	w->start_ns = now_ns();
	if (w->lease_fn)
		w->rc = kl_lock_run_lease(w->l, &w->call, lw_lease_fn, w,
					  &w->fn_result, &w->err);
	else
		w->rc = kl_lock_run(w->l, &w->call, lw_fn, w, &w->fn_result,
				    &w->err);
	w->end_ns = now_ns();
	atomic_store(&w->done, true);
	return NULL;
}

/* With lease_fn, the thread calls kl_lock_run_lease (whose fn checks that
 * its lease is valid, then does what lw_fn does). */
static void
lw_start_as(struct lw *w, kl_lock *l, const char *call_key, kl_cancel *c,
	    bool lease_fn)
{
	w->lease_fn = lease_fn;
	w->l = l;
	w->call.key = call_key;
	w->call.cancel = c;
	w->rc = 1; /* no KL_* value: never returned */
	w->seq = -1;
	w->ran = 0;
	memset(&w->err, 0, sizeof w->err);
	atomic_init(&w->done, false);
	test_thread_start(&w->th, lw_main, w);
}

static void
lw_start(struct lw *w, kl_lock *l, const char *call_key, kl_cancel *c)
{
	lw_start_as(w, l, call_key, c, false);
}

static bool
lw_done(void *arg)
{
	struct lw *w = arg;

	return atomic_load(&w->done);
}

static void
lw_join(struct lw *w)
{
	test_poll(lw_done, w, "a lock thread to finish");
	test_thread_join(w->th);
}

/* Joins w[0..n-1], which must all have run, granted in index order. */
static void
lw_join_in_order(struct lw *w, int n)
{
	for (int i = 0; i < n; i++)
		lw_join(&w[i]);
	for (int i = 0; i < n; i++) {
		ck_assert_int_eq(w[i].rc, KL_OK);
		ck_assert_int_eq(w[i].seq, i);
	}
}

/* ------------------------------------------------------------------ */
/* Keys                                                                */

/* Every lock without a provider shares kl_memory_provider(). */
START_TEST(test_same_key_excludes)
{
	kl_lock *a = lock_make(NULL, "reports", KL_FOREVER, 0, NULL, NULL);
	kl_lock *b = lock_make(NULL, "reports", KL_FOREVER, 0, NULL, NULL);
	kl_lock *b0 = lock_make(NULL, "reports", 0, 0, NULL, NULL);
	kl_provider *s = kl_memory_provider();
	kl_lease *lease = NULL;
	atomic_int ran = 0;
	struct lw w;

	memset(&w, 0, sizeof w);
	ck_assert_int_eq(kl_lock_acquire(a, NULL, &lease, NULL), KL_OK);
	ck_assert_int_eq(kl_lock_run(b0, NULL, fn_count, &ran, NULL, NULL),
			 KL_ETIMEDOUT);
	ck_assert_int_eq(atomic_load(&ran), 0);
	lw_start(&w, b, NULL, NULL);
	wait_queue(s, "reports", 1);
	ck_assert_int_eq(w.ran, 0); /* still waiting */
	kl_lease_release(lease);
	lw_join(&w);
	ck_assert_int_eq(w.rc, KL_OK);
	ck_assert_int_eq(w.ran, 1);
	ck_assert_int_eq(w.fn_result, 11);
	ck_assert(key_free(s, "reports"));
	kl_lock_free(a);
	kl_lock_free(b);
	kl_lock_free(b0);
}
END_TEST

START_TEST(test_lock_key_wins)
{
	kl_provider *p = private_provider();
	kl_lock *l = lock_make(p, "lockkey", KL_FOREVER, 0, NULL, NULL);
	kl_call call = { .key = "callkey", .cancel = NULL };
	kl_lease *lease = NULL;

	ck_assert_int_eq(kl_lock_acquire(l, &call, &lease, NULL), KL_OK);
	ck_assert_str_eq(kl_lease_key(lease), "lockkey");
	ck_assert(!key_free(p, "lockkey"));
	ck_assert(key_free(p, "callkey"));
	ck_assert_uint_eq(kl_memory_provider_size(p), 1);
	kl_lease_release(lease);
	ck_assert_uint_eq(kl_memory_provider_size(p), 0);
	kl_lock_free(l);
	kl_provider_free(p);
}
END_TEST

START_TEST(test_call_key_used)
{
	kl_provider *p = private_provider();
	kl_lock *l = lock_make(p, NULL, KL_FOREVER, 0, NULL, NULL);
	char buf[16] = "callkey";
	kl_call call = { .key = buf, .cancel = NULL };
	kl_lease *lease = NULL;

	ck_assert_int_eq(kl_lock_acquire(l, &call, &lease, NULL), KL_OK);
	memset(buf, 'x', sizeof buf - 1); /* the lease keeps its own key */
	ck_assert_str_eq(kl_lease_key(lease), "callkey");
	ck_assert(!key_free(p, "callkey"));
	kl_lease_release(lease);
	ck_assert_uint_eq(kl_memory_provider_size(p), 0);
	kl_lock_free(l);
	kl_provider_free(p);
}
END_TEST

/* Neither key: KL_ENOKEY, err filled, one REJECTED event without a key,
 * fn never runs. */
START_TEST(test_no_key)
{
	kl_call nokey = { .key = NULL, .cancel = NULL };
	kl_lease *lease = (kl_lease *)&lease;
	atomic_int ran = 0;
	struct evlog g;
	kl_error err;
	kl_lock *l;

	evlog_init(&g);
	l = lock_make(NULL, NULL, KL_FOREVER, 0, evlog_fn, &g);
	memset(&err, 0, sizeof err);
	ck_assert_int_eq(kl_lock_run(l, NULL, fn_count, &ran, NULL, &err),
			 KL_ENOKEY);
	ck_assert_int_eq(err.status, KL_ENOKEY);
	ck_assert(err.message[0] != '\0');
	ck_assert_int_eq(g.n, 1);
	check_event(&g, 0, KL_EV_REJECTED, NULL, KL_ENOKEY);

	ck_assert_int_eq(kl_lock_run(l, &nokey, fn_count, &ran, NULL, NULL),
			 KL_ENOKEY);
	ck_assert_int_eq(kl_lock_acquire(l, &nokey, &lease, NULL), KL_ENOKEY);
	ck_assert_ptr_null(lease);
	ck_assert_int_eq(atomic_load(&ran), 0);
	ck_assert_int_eq(g.n, 3);
	check_event(&g, 1, KL_EV_REJECTED, NULL, KL_ENOKEY);
	check_event(&g, 2, KL_EV_REJECTED, NULL, KL_ENOKEY);
	kl_lock_free(l);
	evlog_fini(&g);
}
END_TEST

/* kl_lock_new copies opts and the key: changing or freeing the caller's
 * copies afterwards changes nothing. */
START_TEST(test_new_copies_opts_and_key)
{
	kl_provider *p = private_provider(), *q = private_provider();
	kl_lock_opts o = KL_LOCK_OPTS_INIT;
	char *key = strdup("copied");
	kl_lease *lease = NULL;
	kl_lock *l;

	ck_assert_ptr_nonnull(key);
	o.provider = p;
	o.key = key;
	o.timeout_ms = KL_FOREVER;
	ck_assert_int_eq(kl_lock_new(&l, &o), KL_OK);
	memset(key, 'z', strlen(key));
	free(key);
	o.provider = q;
	o.key = "other";
	o.timeout_ms = 0;

	ck_assert_int_eq(kl_lock_acquire(l, NULL, &lease, NULL), KL_OK);
	ck_assert_str_eq(kl_lease_key(lease), "copied");
	ck_assert_uint_eq(kl_memory_provider_size(p), 1);
	ck_assert_uint_eq(kl_memory_provider_size(q), 0);
	ck_assert(!key_free(p, "copied"));
	kl_lease_release(lease);
	ck_assert_uint_eq(kl_memory_provider_size(p), 0);
	kl_lock_free(l);
	kl_provider_free(p);
	kl_provider_free(q);
}
END_TEST

static void
new_fails(kl_lock_opts *o)
{
	kl_lock *l = (kl_lock *)&l;

	ck_assert_int_eq(kl_lock_new(&l, o), KL_EINVAL);
	ck_assert_ptr_null(l);
}

START_TEST(test_new_rejects_bad_opts)
{
	kl_lock_opts o = KL_LOCK_OPTS_INIT;
	kl_lock *l = NULL;
	atomic_int ran = 0;

	o.timeout_ms = -2;
	new_fails(&o);
	o.timeout_ms = INT64_MIN;
	new_fails(&o);
	o.timeout_ms = KL_FOREVER;
	o.ttl_ms = -2;
	new_fails(&o);
	o.ttl_ms = 0;
	o.flags = 0x80u;
	new_fails(&o);

	/* NULL opts are the defaults. */
	ck_assert_int_eq(kl_lock_new(&l, NULL), KL_OK);
	ck_assert_int_eq(kl_lock_run(l, &(kl_call){ .key = "lock:defaults" },
				     fn_count, &ran, NULL, NULL),
			 KL_OK);
	ck_assert_int_eq(atomic_load(&ran), 1);
	ck_assert_int_eq(kl_lock_run(l, NULL, NULL, NULL, NULL, NULL),
			 KL_EINVAL);
	kl_lock_free(l);
	kl_lock_free(NULL);
	kl_lease_release(NULL);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Arrival order                                                       */

#define FIFO_N 8

START_TEST(test_grants_in_arrival_order)
{
	kl_provider *p = private_provider();
	kl_lock *l = lock_make(p, "fifo", KL_FOREVER, 0, NULL, NULL);
	kl_lock *callers = lock_make(p, NULL, 30000, 0, NULL, NULL);
	struct lw w[FIFO_N];
	kl_lease *lease = NULL;
	atomic_int next = 0;

	memset(w, 0, sizeof w);
	ck_assert_int_eq(kl_lock_acquire(l, NULL, &lease, NULL), KL_OK);
	for (int i = 0; i < FIFO_N; i++) {
		w[i].next_seq = &next;
		/* Half through the lock's key, half through the call's;
		 * half in kl_lock_run, half in kl_lock_run_lease. */
		lw_start_as(&w[i], i % 2 ? l : callers, i % 2 ? NULL : "fifo",
			    NULL, i % 4 >= 2);
		wait_queue(p, "fifo", (size_t)i + 1);
	}
	ck_assert_uint_eq(kl_memory_provider_size(p), 1);
	kl_lease_release(lease);
	lw_join_in_order(w, FIFO_N);
	ck_assert_uint_eq(kl_memory_provider_size(p), 0);
	kl_lock_free(l);
	kl_lock_free(callers);
	kl_provider_free(p);
}
END_TEST

/* A grant wakes a parked new head at once (a prod, see the mutex suite):
 * three parked waiters, two prods, the first before release returns. */
START_TEST(test_grant_prods_parked_new_head)
{
	enum { N = 3 };
	kl_provider *p = private_provider();
	kl_lock *l = lock_make(p, "prod", KL_FOREVER, 0, NULL, NULL);
	bool cpus = sysconf(_SC_NPROCESSORS_ONLN) > 1;
	/* Without fork a parked thread of an earlier test would count. */
	long parked = test_parked();
	struct lw w[N];
	kl_lease *lease = NULL;
	atomic_int next = 0;
	long prods;

	memset(w, 0, sizeof w);
	ck_assert_int_eq(kl_lock_acquire(l, NULL, &lease, NULL), KL_OK);
	for (int i = 0; i < N; i++) {
		w[i].next_seq = &next;
		lw_start(&w[i], l, NULL, NULL);
		wait_queue(p, "prod", (size_t)i + 1);
	}
	test_wait_parked(parked + N);
	prods = test_prods();
	kl_lease_release(lease);
	/* At least: the first waiter may have released already. */
	ck_assert_int_ge(test_prods(), prods + (cpus ? 1 : 0));
	lw_join_in_order(w, N);
	ck_assert_int_eq(test_prods(), prods + (cpus ? 2 : 0));
	ck_assert_uint_eq(kl_memory_provider_size(p), 0);
	kl_lock_free(l);
	kl_provider_free(p);
}
END_TEST

/* A holder for test_asks_again_spins_behind: takes the key and says so
 * (state 1), gives it back when the test says (2), then, with again, asks
 * for it at once and holds it (3) until the test says (4); done (5). */
struct holder {
	kl_lock *l;
	bool again;
	atomic_int state;
	int rc[2];
};

static void *
holder_main(void *arg)
{
	struct holder *h = arg;
	kl_lease *lease = NULL;

	h->rc[0] = kl_lock_acquire(h->l, NULL, &lease, NULL);
	atomic_store(&h->state, 1);
	while (atomic_load(&h->state) != 2)
		sched_yield();
	kl_lease_release(lease);
	if (h->again) {
		h->rc[1] = kl_lock_acquire(h->l, NULL, &lease, NULL);
		atomic_store(&h->state, 3);
		while (atomic_load(&h->state) != 4)
			sched_yield();
		kl_lease_release(lease);
	}
	atomic_store(&h->state, 5);
	return NULL;
}

struct holder_cond {
	struct holder *h;
	int state;
	kl_provider *p; /* with n: the key's queue size too */
	size_t n;
	long behind, kept; /* at least */
};

static bool
holder_at(void *arg)
{
	struct holder_cond *c = arg;

	return atomic_load(&c->h->state) == c->state &&
	       test_behind() >= c->behind && test_kept() >= c->kept &&
	       (c->p == NULL ||
		kl_memory_provider_queue_size(c->p, "again") == c->n);
}

static void
holder_wait(struct holder *h, int state, kl_provider *p, size_t n,
	    long behind, long kept)
{
	struct holder_cond c = { h, state, p, n, behind, kept };

	test_poll(holder_at, &c, "a holder's step");
}

/* One wait of test_spin_learns: the test holds the key "learns" of l
 * (*lease), a thread queues for it alone, and the test releases once the
 * thread has parked; the thread runs and releases, the key is free, and
 * the test takes it again, in the slot that kept it.  Returns whether
 * the wait parked without the spin it would have made. */
static bool
lone_key_wait(kl_provider *p, kl_lock *l, kl_lease **lease)
{
	long parked = test_parked(), skipped = test_spins_skipped();
	struct lw w;

	memset(&w, 0, sizeof w);
	lw_start(&w, l, NULL, NULL);
	wait_queue(p, "learns", 1);
	test_wait_parked(parked + 1);
	kl_lease_release(*lease);
	lw_join(&w);
	ck_assert_int_eq(w.rc, KL_OK);
	ck_assert_int_eq(w.ran, 1);
	ck_assert_int_eq(kl_lock_acquire(l, NULL, lease, NULL), KL_OK);
	return test_spins_skipped() != skipped;
}

/* The key table's queues learn as kl_mutex's do (check_mutex,
 * test_spin_learns): four spins in a row that ended parked, then the
 * waits park at once; what was learnt stays while the slot keeps the
 * key, free in between. */
START_TEST(test_spin_learns)
{
	kl_provider *p = private_provider();
	kl_lock *l = lock_make(p, "learns", KL_FOREVER, 0, NULL, NULL);
	bool cpus = sysconf(_SC_NPROCESSORS_ONLN) > 1;
	kl_lease *lease = NULL;

	ck_assert_int_eq(kl_lock_acquire(l, NULL, &lease, NULL), KL_OK);
	for (int i = 0; i < 4; i++)
		ck_assert(!lone_key_wait(p, l, &lease));
	for (int i = 0; i < 3; i++)
		ck_assert(lone_key_wait(p, l, &lease) == cpus);
	kl_lease_release(lease);
	kl_lock_free(l);
	kl_provider_free(p);
}
END_TEST

/* The key table's release path notes the hand-off as kl_mutex's does
 * (the mutex suite has the other cases): H holds, A and B queue and
 * park; H gives the key back (A granted, B prodded) and asks again at
 * once, behind B, where it spins giving its CPU away; A gives it back
 * (B granted, H marked headed), H then keeps its CPU; B gives it back (H
 * granted).  The hooks force the crowd and widen "at once". */
START_TEST(test_asks_again_spins_behind)
{
	kl_provider *p = private_provider();
	kl_lock *l = lock_make(p, "again", KL_FOREVER, 0, NULL, NULL);
	long cpus = sysconf(_SC_NPROCESSORS_ONLN) > 1;
	long parked = test_parked(), behind, headed, kept, prods;
	struct holder h[3]; /* H, A, B */
	pthread_t th[3];

	memset(h, 0, sizeof h);
	test_crowd(1);
	test_asks_again_ns(INT64_C(60000000000));
	test_behind_ns(INT64_C(60000000000));
	test_neighbours(-1);
	for (int i = 0; i < 3; i++) {
		h[i].l = l;
		h[i].again = i == 0;
		atomic_init(&h[i].state, 0);
	}
	test_thread_start(&th[0], holder_main, &h[0]);
	holder_wait(&h[0], 1, NULL, 0, 0, 0);
	test_thread_start(&th[1], holder_main, &h[1]);
	wait_queue(p, "again", 1);
	test_thread_start(&th[2], holder_main, &h[2]);
	wait_queue(p, "again", 2);
	test_wait_parked(parked + 2);
	behind = test_behind();
	headed = test_headed();
	kept = test_kept();
	prods = test_prods();
	atomic_store(&h[0].state, 2);
	holder_wait(&h[1], 1, p, 2, behind + cpus, 0);
	atomic_store(&h[1].state, 2);
	holder_wait(&h[2], 1, NULL, 0, 0, kept + cpus);
	atomic_store(&h[2].state, 2);
	holder_wait(&h[0], 3, NULL, 0, 0, 0);
	atomic_store(&h[0].state, 4);
	for (int i = 0; i < 3; i++) {
		holder_wait(&h[i], 5, NULL, 0, 0, 0);
		test_thread_join(th[i]);
		ck_assert_int_eq(h[i].rc[0], KL_OK);
	}
	ck_assert_int_eq(h[0].rc[1], KL_OK);
	ck_assert_int_eq(test_behind() - behind, cpus);
	ck_assert_int_eq(test_kept() - kept, cpus);
	ck_assert_int_eq(test_headed() - headed, cpus); /* H, by A */
	ck_assert_int_eq(test_prods() - prods, cpus);   /* B, by H */
	ck_assert_uint_eq(kl_memory_provider_size(p), 0);
	kl_lock_free(l);
	kl_provider_free(p);
	test_spin_reset();
}
END_TEST

/* ------------------------------------------------------------------ */
/* Timeouts and cancellation                                           */

START_TEST(test_timeout_rejected)
{
	kl_provider *p = private_provider();
	kl_lock *h = lock_make(p, "slow", KL_FOREVER, 0, NULL, NULL);
	kl_lock *l;
	kl_lease *lease = NULL;
	atomic_int ran = 0;
	struct evlog g;
	kl_error err;
	int64_t t0, t1;

	evlog_init(&g);
	l = lock_make(p, "slow", 50, 0, evlog_fn, &g);
	ck_assert_int_eq(kl_lock_acquire(h, NULL, &lease, NULL), KL_OK);
	memset(&err, 0, sizeof err);
	t0 = now_ns();
	ck_assert_int_eq(kl_lock_run(l, NULL, fn_count, &ran, NULL, &err),
			 KL_ETIMEDOUT);
	t1 = now_ns();
	ck_assert_int_eq(atomic_load(&ran), 0);
	ck_assert_int_ge(t1 - t0, 50 * 1000000LL); /* never early */
	ck_assert_int_lt(t1 - t0, 5000 * 1000000LL);
	ck_assert_int_eq(err.status, KL_ETIMEDOUT);
	ck_assert(err.message[0] != '\0');
	ck_assert_int_eq(g.n, 1);
	check_event(&g, 0, KL_EV_REJECTED, "slow", KL_ETIMEDOUT);
	ck_assert_uint_eq(kl_memory_provider_queue_size(p, "slow"), 0);

	/* Timeout 0 tries once, with the same report. */
	kl_lock_free(l);
	l = lock_make(p, "slow", 0, 0, evlog_fn, &g);
	t0 = now_ns();
	ck_assert_int_eq(kl_lock_run(l, NULL, fn_count, &ran, NULL, &err),
			 KL_ETIMEDOUT);
	ck_assert_int_lt(now_ns() - t0, 5000 * 1000000LL);
	ck_assert_int_eq(atomic_load(&ran), 0);
	ck_assert_int_eq(g.n, 2);
	check_event(&g, 1, KL_EV_REJECTED, "slow", KL_ETIMEDOUT);
	kl_lease_release(lease);
	ck_assert(key_free(p, "slow"));
	ck_assert_int_eq(kl_lock_run(l, NULL, fn_count, &ran, NULL, &err),
			 KL_OK);
	kl_lock_free(h);
	kl_lock_free(l);
	kl_provider_free(p);
	evlog_fini(&g);
}
END_TEST

START_TEST(test_cancel_during_wait)
{
	kl_provider *p = private_provider();
	kl_lock *h = lock_make(p, "c", KL_FOREVER, 0, NULL, NULL);
	kl_lock *l;
	kl_lease *lease = NULL;
	struct evlog g;
	kl_cancel *c;
	struct lw w;

	evlog_init(&g);
	memset(&w, 0, sizeof w);
	l = lock_make(p, "c", KL_FOREVER, 0, evlog_fn, &g);
	ck_assert_int_eq(kl_cancel_new(&c), KL_OK);
	ck_assert_int_eq(kl_lock_acquire(h, NULL, &lease, NULL), KL_OK);
	lw_start(&w, l, NULL, c);
	wait_queue(p, "c", 1);
	kl_cancel_fire(c);
	lw_join(&w);
	ck_assert_int_eq(w.rc, KL_ECANCELED);
	ck_assert_int_eq(w.ran, 0);
	ck_assert_int_eq(w.err.status, KL_ECANCELED);
	ck_assert_uint_eq(kl_memory_provider_queue_size(p, "c"), 0);
	ck_assert_uint_eq(kl_memory_provider_size(p), 1);
	ck_assert_int_eq(g.n, 1);
	check_event(&g, 0, KL_EV_REJECTED, "c", KL_ECANCELED);
	kl_lease_release(lease);
	ck_assert_uint_eq(kl_memory_provider_size(p), 0);

	/* Fired before the call: KL_ECANCELED at once, free key or not. */
	memset(&w, 0, sizeof w);
	lw_start(&w, l, NULL, c);
	lw_join(&w);
	ck_assert_int_eq(w.rc, KL_ECANCELED);
	ck_assert_int_eq(w.ran, 0);
	ck_assert_uint_eq(kl_memory_provider_size(p), 0);

	kl_cancel_free(c);
	kl_lock_free(h);
	kl_lock_free(l);
	kl_provider_free(p);
	evlog_fini(&g);
}
END_TEST

/* A cancel racing the grant: the holder releases while a third thread
 * fires the queued waiter's token.  Exactly one outcome: fn ran once and
 * the call returned KL_OK, or fn never ran and it returned KL_ECANCELED;
 * the key is free afterwards either way. */
struct firer {
	pthread_t th;
	kl_cancel *c;
	atomic_bool ready;
	atomic_bool go;
};

static void *
firer_main(void *arg)
{
	struct firer *f = arg;

	atomic_store(&f->ready, true);
	while (!atomic_load(&f->go))
		; /* spin: the point is to race the release */
	kl_cancel_fire(f->c);
	return NULL;
}

static bool
firer_ready(void *arg)
{
	struct firer *f = arg;

	return atomic_load(&f->ready);
}

START_TEST(test_cancel_races_grant)
{
	kl_provider *p = private_provider();
	kl_lock *h = lock_make(p, "race", KL_FOREVER, 0, NULL, NULL);
	kl_lock *l = lock_make(p, "race", KL_FOREVER, 0, NULL, NULL);
	long rounds = kl_test_scaled(2000, 100);
	long granted = 0, cancelled = 0, bad = 0, stuck = 0;

	for (long i = 0; i < rounds; i++) {
		kl_lease *lease = NULL;
		struct firer f;
		struct lw w;

		memset(&w, 0, sizeof w);
		ck_assert_int_eq(kl_cancel_new(&f.c), KL_OK);
		atomic_init(&f.ready, false);
		atomic_init(&f.go, false);
		ck_assert_int_eq(kl_lock_acquire(h, NULL, &lease, NULL), KL_OK);
		lw_start(&w, l, NULL, f.c);
		wait_queue(p, "race", 1);
		test_thread_start(&f.th, firer_main, &f);
		test_poll(firer_ready, &f, "the firing thread to spin");
		atomic_store(&f.go, true);
		kl_lease_release(lease);
		lw_join(&w);
		test_thread_join(f.th);
		if (w.rc == KL_OK && w.ran == 1)
			granted++;
		else if (w.rc == KL_ECANCELED && w.ran == 0)
			cancelled++;
		else
			bad++;
		kl_cancel_free(f.c);
		if (!key_free(p, "race")) {
			stuck++;
			break; /* the next round could only hang */
		}
	}
	ck_assert_msg(bad == 0, "%ld rounds with a wrong outcome", bad);
	ck_assert_msg(stuck == 0, "%ld rounds left the key held", stuck);
	ck_assert_int_eq(granted + cancelled, rounds);
	ck_assert_uint_eq(kl_memory_provider_size(p), 0);
	kl_lock_free(h);
	kl_lock_free(l);
	kl_provider_free(p);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Events                                                              */

static int
fn_sleep_20(void *arg)
{
	(void)arg;
	test_sleep_ms(20); /* a duration under test: held_ms */
	return 3;
}

START_TEST(test_acquired_released_events)
{
	kl_provider *p = private_provider();
	kl_lock *h = lock_make(p, "ev", KL_FOREVER, 0, NULL, NULL);
	kl_lease *lease = NULL;
	struct evlog g;
	kl_lock *l;
	struct lw w;
	int res = 0;

	evlog_init(&g);
	l = lock_make(p, "ev", KL_FOREVER, 0, evlog_fn, &g);
	ck_assert_int_eq(kl_lock_run(l, NULL, fn_sleep_20, NULL, &res, NULL),
			 KL_OK);
	ck_assert_int_eq(res, 3);
	ck_assert_int_eq(g.n, 2);
	check_event(&g, 0, KL_EV_ACQUIRED, "ev", KL_OK);
	ck_assert_int_ge(g.ev[0].waited_ms, 0);
	check_event(&g, 1, KL_EV_RELEASED, "ev", KL_OK);
	ck_assert_int_ge(g.ev[1].held_ms, 20);
	ck_assert_int_lt(g.ev[1].held_ms, 5000);

	/* A waiter's ACQUIRED tells how long it waited. */
	memset(&w, 0, sizeof w);
	ck_assert_int_eq(kl_lock_acquire(h, NULL, &lease, NULL), KL_OK);
	lw_start(&w, l, NULL, NULL);
	wait_queue(p, "ev", 1);
	test_sleep_ms(30); /* a duration under test: waited_ms */
	kl_lease_release(lease);
	lw_join(&w);
	ck_assert_int_eq(w.rc, KL_OK);
	ck_assert_int_eq(g.n, 4);
	check_event(&g, 2, KL_EV_ACQUIRED, "ev", KL_OK);
	ck_assert_int_ge(g.ev[2].waited_ms, 30);
	ck_assert_int_lt(g.ev[2].waited_ms, 5000);
	check_event(&g, 3, KL_EV_RELEASED, "ev", KL_OK);
	ck_assert_int_ge(g.ev[3].held_ms, 0);

	/* kl_lock_acquire and kl_lease_release raise the same events. */
	ck_assert_int_eq(kl_lock_acquire(l, NULL, &lease, NULL), KL_OK);
	ck_assert_int_eq(g.n, 5);
	check_event(&g, 4, KL_EV_ACQUIRED, "ev", KL_OK);
	kl_lease_release(lease);
	ck_assert_int_eq(g.n, 6);
	check_event(&g, 5, KL_EV_RELEASED, "ev", KL_OK);

	kl_lock_free(h);
	kl_lock_free(l);
	kl_provider_free(p);
	evlog_fini(&g);
}
END_TEST

/* A callback that takes other locks (timeout 0) on many keys of the same
 * provider and asks its size: with an internal lock held (a shard lock of
 * the table, say) this would deadlock or fail. */
#define PROBE_KEYS 128

struct probe {
	kl_lock *other; /* no key, timeout 0, no callback */
	kl_provider *p;
	atomic_int calls;
	atomic_int failures;
	atomic_int types[5];
};

static void
probe_fn(const kl_event *e, void *arg)
{
	struct probe *pr = arg;

	atomic_fetch_add(&pr->calls, 1);
	if ((unsigned)e->type < 5)
		atomic_fetch_add(&pr->types[e->type], 1);
	for (int i = 0; i < PROBE_KEYS; i++) {
		char key[32];
		kl_call call = { .key = key, .cancel = NULL };
		kl_lease *lease = NULL;

		snprintf(key, sizeof key, "probe:%d", i);
		if (kl_lock_acquire(pr->other, &call, &lease, NULL) != KL_OK)
			atomic_fetch_add(&pr->failures, 1);
		else
			kl_lease_release(lease);
	}
	/* At ACQUIRED (and at REJECTED, in this test) e->key is held. */
	if (e->type != KL_EV_RELEASED && kl_memory_provider_size(pr->p) == 0)
		atomic_fetch_add(&pr->failures, 1);
	(void)kl_memory_provider_queue_size(pr->p, "ev:main");
}

START_TEST(test_events_without_internal_lock)
{
	kl_provider *s = kl_memory_provider();
	kl_lock *h = lock_make(NULL, "ev:main", KL_FOREVER, 0, NULL, NULL);
	kl_lease *lease = NULL;
	atomic_int ran = 0;
	struct probe pr;
	kl_lock *l, *l0;
	int calls, failures;

	memset(&pr, 0, sizeof pr);
	pr.p = s;
	pr.other = lock_make(NULL, NULL, 0, 0, NULL, NULL);
	l = lock_make(NULL, "ev:main", KL_FOREVER, 0, probe_fn, &pr);
	l0 = lock_make(NULL, "ev:main", 0, 0, probe_fn, &pr);

	/* ACQUIRED and RELEASED. */
	ck_assert_int_eq(kl_lock_run(l, NULL, fn_count, &ran, NULL, NULL),
			 KL_OK);
	ck_assert_int_eq(atomic_load(&pr.types[KL_EV_ACQUIRED]), 1);
	ck_assert_int_eq(atomic_load(&pr.types[KL_EV_RELEASED]), 1);
	/* REJECTED (the key is held by h, so size stays above 0). */
	ck_assert_int_eq(kl_lock_acquire(h, NULL, &lease, NULL), KL_OK);
	ck_assert_int_eq(kl_lock_run(l0, NULL, fn_count, &ran, NULL, NULL),
			 KL_ETIMEDOUT);
	ck_assert_int_eq(atomic_load(&pr.types[KL_EV_REJECTED]), 1);
	kl_lease_release(lease);

	calls = atomic_load(&pr.calls);
	failures = atomic_load(&pr.failures);
	ck_assert_int_eq(calls, 3);
	ck_assert_msg(failures == 0, "%d probes failed in callbacks",
		      failures);
	ck_assert_int_eq(atomic_load(&ran), 1);
	ck_assert(key_free(s, "ev:main"));
	kl_lock_free(h);
	kl_lock_free(l);
	kl_lock_free(l0);
	kl_lock_free(pr.other);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Run under lock, leases, fences                                      */

static int
fn_return(void *arg)
{
	return *(int *)arg;
}

START_TEST(test_run_releases_on_every_path)
{
	kl_provider *p = private_provider();
	kl_lock *l = lock_make(p, "run", KL_FOREVER, 0, NULL, NULL);
	const int values[] = { 0, 42, -1, KL_ETIMEDOUT, KL_EPROVIDER };
	kl_error err;

	for (size_t i = 0; i < sizeof values / sizeof values[0]; i++) {
		int v = values[i], res = 12345;

		memset(&err, 0x55, sizeof err);
		ck_assert_int_eq(kl_lock_run(l, NULL, fn_return, &v, &res,
					     &err),
				 KL_OK);
		ck_assert_int_eq(res, v);
		ck_assert_uint_eq(kl_memory_provider_size(p), 0);
		ck_assert(key_free(p, "run"));
		/* fn_result and err may be NULL. */
		ck_assert_int_eq(kl_lock_run(l, NULL, fn_return, &v, NULL,
					     NULL),
				 KL_OK);
		ck_assert_uint_eq(kl_memory_provider_size(p), 0);
	}
	kl_lock_free(l);
	kl_provider_free(p);
}
END_TEST

struct releaser {
	pthread_t th;
	kl_lease *lease;
};

static void *
releaser_main(void *arg)
{
	struct releaser *r = arg;

	kl_lease_release(r->lease);
	return NULL;
}

START_TEST(test_release_from_another_thread)
{
	kl_provider *p = private_provider();
	kl_lock *l = lock_make(p, "x", KL_FOREVER, 0, NULL, NULL);
	struct releaser r;

	ck_assert_int_eq(kl_lock_acquire(l, NULL, &r.lease, NULL), KL_OK);
	ck_assert(kl_lease_valid(r.lease));
	ck_assert_str_eq(kl_lease_key(r.lease), "x");
	ck_assert(!key_free(p, "x"));
	test_thread_start(&r.th, releaser_main, &r);
	test_thread_join(r.th);
	ck_assert_uint_eq(kl_memory_provider_size(p), 0);
	ck_assert(key_free(p, "x"));
	kl_lock_free(l);
	kl_provider_free(p);
}
END_TEST

START_TEST(test_fence_grows)
{
	kl_provider *p = private_provider();
	kl_lock *l = lock_make(p, "fence", KL_FOREVER, 0, NULL, NULL);
	kl_lease *lease = NULL, *first;
	uint64_t last = 0;
	struct lw w;

	for (int i = 0; i < 20; i++) {
		ck_assert_int_eq(kl_lock_acquire(l, NULL, &lease, NULL),
				 KL_OK);
		ck_assert_msg(i == 0 || kl_lease_fence(lease) > last,
			      "fence %llu after %llu",
			      (unsigned long long)kl_lease_fence(lease),
			      (unsigned long long)last);
		last = kl_lease_fence(lease);
		kl_lease_release(lease);
	}
	/* Across a hand-off too: the waiter's grant is a later one. */
	memset(&w, 0, sizeof w);
	ck_assert_int_eq(kl_lock_acquire(l, NULL, &first, NULL), KL_OK);
	ck_assert(kl_lease_fence(first) > last);
	last = kl_lease_fence(first);
	lw_start(&w, l, NULL, NULL);
	wait_queue(p, "fence", 1);
	kl_lease_release(first);
	lw_join(&w);
	ck_assert_int_eq(w.rc, KL_OK);
	ck_assert_int_eq(kl_lock_acquire(l, NULL, &lease, NULL), KL_OK);
	/* Two grants since "first": the waiter's, then this one. */
	ck_assert_uint_ge(kl_lease_fence(lease), last + 2);
	kl_lease_release(lease);
	kl_lock_free(l);
	kl_provider_free(p);
}
END_TEST

/* A memory provider keeps the lease of a lock without a hook inside the
 * key's entry, and a hooked lock's lease apart: the key passes between
 * the two kinds both ways, and each kind keeps its key and fence. */
START_TEST(test_lease_kinds_hand_off)
{
	static const char long_key[] = "a key much longer than sixteen bytes";
	kl_provider *p = private_provider();
	kl_lock *plain = lock_make(p, NULL, KL_FOREVER, 0, NULL, NULL);
	kl_lease *a = NULL, *b = NULL;
	char key[32] = "shared-key";
	kl_call call = { .key = key, .cancel = NULL };
	struct evlog g;
	kl_lock *hooked;
	uint64_t f;
	struct lw w;

	evlog_init(&g);
	hooked = lock_make(p, NULL, KL_FOREVER, 0, evlog_fn, &g);
	ck_assert_int_eq(kl_lock_acquire(plain, &call, &a, NULL), KL_OK);
	memset(key, 'x', 10); /* the lease keeps its own copy */
	ck_assert_str_eq(kl_lease_key(a), "shared-key");
	ck_assert(kl_lease_valid(a));
	f = kl_lease_fence(a);
	ck_assert_uint_gt(f, 0);
	call.key = long_key;
	ck_assert_int_eq(kl_lock_acquire(plain, &call, &b, NULL), KL_OK);
	ck_assert_str_eq(kl_lease_key(b), long_key);
	ck_assert_uint_eq(kl_memory_provider_size(p), 2);
	kl_lease_release(b);

	/* Plain holder, hooked waiter. */
	memset(&w, 0, sizeof w);
	lw_start(&w, hooked, "shared-key", NULL);
	wait_queue(p, "shared-key", 1);
	kl_lease_release(a);
	lw_join(&w);
	ck_assert_int_eq(w.rc, KL_OK);
	ck_assert_int_eq(g.n, 2);
	check_event(&g, 0, KL_EV_ACQUIRED, "shared-key", KL_OK);
	check_event(&g, 1, KL_EV_RELEASED, "shared-key", KL_OK);

	/* Hooked holder, plain waiter. */
	call.key = "shared-key";
	ck_assert_int_eq(kl_lock_acquire(hooked, &call, &a, NULL), KL_OK);
	ck_assert_str_eq(kl_lease_key(a), "shared-key");
	ck_assert_uint_ge(kl_lease_fence(a), f + 2);
	memset(&w, 0, sizeof w);
	lw_start(&w, plain, "shared-key", NULL);
	wait_queue(p, "shared-key", 1);
	kl_lease_release(a);
	lw_join(&w);
	ck_assert_int_eq(w.rc, KL_OK);
	ck_assert_int_eq(g.n, 4);
	check_event(&g, 3, KL_EV_RELEASED, "shared-key", KL_OK);
	ck_assert_uint_eq(kl_memory_provider_size(p), 0);
	kl_lock_free(hooked);
	kl_lock_free(plain);
	kl_provider_free(p);
	evlog_fini(&g);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Not reentrant                                                       */

struct nest {
	kl_lock *l;
	int inner_rc;
	int inner_ran;
	int64_t inner_ns;
};

static int
nest_inner(void *arg)
{
	((struct nest *)arg)->inner_ran++;
	return 0;
}

static int
nest_outer(void *arg)
{
	struct nest *n = arg;
	int64_t t0 = now_ns();

	n->inner_rc = kl_lock_run(n->l, NULL, nest_inner, n, NULL, NULL);
	n->inner_ns = now_ns() - t0;
	return 1;
}

START_TEST(test_nested_same_key_times_out)
{
	kl_provider *p = private_provider();
	struct nest n;
	int res = 0;

	memset(&n, 0, sizeof n);
	n.l = lock_make(p, "nest", 50, 0, NULL, NULL);
	ck_assert_int_eq(kl_lock_run(n.l, NULL, nest_outer, &n, &res, NULL),
			 KL_OK);
	ck_assert_int_eq(res, 1);
	ck_assert_int_eq(n.inner_rc, KL_ETIMEDOUT);
	ck_assert_int_eq(n.inner_ran, 0);
	ck_assert_int_ge(n.inner_ns, 50 * 1000000LL);
	ck_assert_int_lt(n.inner_ns, 5000 * 1000000LL);
	ck_assert_uint_eq(kl_memory_provider_size(p), 0);
	kl_lock_free(n.l);
	kl_provider_free(p);
}
END_TEST

START_TEST(test_nested_errorcheck_deadlk)
{
	kl_provider *p = private_provider();
	kl_lease *lease = NULL, *again = (kl_lease *)&again;
	struct evlog g;
	struct nest n;
	int res = 0;

	evlog_init(&g);
	memset(&n, 0, sizeof n);
	n.l = lock_make(p, "nest", 30000, KL_ERRORCHECK, evlog_fn, &g);
	ck_assert_int_eq(kl_lock_run(n.l, NULL, nest_outer, &n, &res, NULL),
			 KL_OK);
	ck_assert_int_eq(n.inner_rc, KL_EDEADLK);
	ck_assert_int_eq(n.inner_ran, 0);
	ck_assert_int_lt(n.inner_ns, 5000 * 1000000LL);
	ck_assert_int_eq(g.n, 3);
	check_event(&g, 0, KL_EV_ACQUIRED, "nest", KL_OK);
	check_event(&g, 1, KL_EV_REJECTED, "nest", KL_EDEADLK);
	check_event(&g, 2, KL_EV_RELEASED, "nest", KL_OK);
	ck_assert_uint_eq(kl_memory_provider_size(p), 0);

	/* The same through leases. */
	ck_assert_int_eq(kl_lock_acquire(n.l, NULL, &lease, NULL), KL_OK);
	ck_assert_int_eq(kl_lock_acquire(n.l, NULL, &again, NULL), KL_EDEADLK);
	ck_assert_ptr_null(again);
	kl_lease_release(lease);
	ck_assert_uint_eq(kl_memory_provider_size(p), 0);
	kl_lock_free(n.l);
	kl_provider_free(p);
	evlog_fini(&g);
}
END_TEST

/* ------------------------------------------------------------------ */
/* pthread_cancel during a provider call                               */

/*
 * A user provider whose calls block in read(2), a cancellation point, until
 * the test writes a byte: the calls of kl_lock(3) promise not to be
 * cancellation points, so a cancel that comes while a provider works must
 * wait until the call has returned.  Were it acted on inside read(), the
 * thread would unwind from the provider with the key half taken.
 */
enum { BP_ACQUIRE, BP_RELEASE, BP_STATUS, BP_SNAPSHOT, BP_OPS };

struct bp {
	int fd[BP_OPS][2];      /* a pipe per call */
	atomic_int entered[BP_OPS]; /* calls begun */
	atomic_int done[BP_OPS];    /* calls that returned */
	int token;
};

static void
bp_block(struct bp *b, int op)
{
	char c;

	atomic_fetch_add(&b->entered[op], 1);
	while (read(b->fd[op][0], &c, 1) != 1)
		;
	atomic_fetch_add(&b->done[op], 1);
}

static int
bp_acquire(void *impl, const char *key, size_t key_len, kl_cancel *cancel,
	   int64_t timeout_ms, int64_t ttl_ms, unsigned flags, void **lease,
	   uint64_t *fence, kl_error *err)
{
	struct bp *b = impl;

	(void)key, (void)key_len, (void)cancel, (void)timeout_ms;
	(void)ttl_ms, (void)flags, (void)err;
	bp_block(b, BP_ACQUIRE);
	*lease = &b->token;
	*fence = 1;
	return KL_OK;
}

static int
bp_release(void *impl, void *lease, kl_error *err)
{
	(void)lease, (void)err;
	bp_block(impl, BP_RELEASE);
	return KL_OK;
}

static int
bp_status(void *impl, const char *key, size_t key_len, size_t *holders,
	  size_t *waiters, kl_error *err)
{
	(void)key, (void)key_len, (void)err;
	bp_block(impl, BP_STATUS);
	*holders = 1;
	*waiters = 0;
	return KL_OK;
}

static int
bp_snapshot(void *impl, kl_snapshot_fn fn, void *arg, kl_error *err)
{
	(void)fn, (void)arg, (void)err;
	bp_block(impl, BP_SNAPSHOT);
	return KL_OK;
}

static const kl_provider_ops bp_ops = {
	.struct_size = sizeof(kl_provider_ops),
	.name = "blocking",
	.acquire = bp_acquire,
	.release = bp_release,
	.status = bp_status,
	.snapshot = bp_snapshot,
};

struct bp_thread {
	kl_provider *p;
	kl_lock *l;
	int rc[BP_OPS];   /* -100: not returned */
	atomic_bool exited; /* set by its cancellation cleanup */
};

static void
bp_exited(void *arg)
{
	struct bp_thread *t = arg;

	atomic_store(&t->exited, true);
}

static int
bp_entry(const kl_lock_info *info, void *arg)
{
	(void)info, (void)arg;
	return 0;
}

/* Calls each op in turn; after the last it reaches a cancellation point,
 * where the cancel sent while it was in the provider takes effect. */
static void *
bp_thread_main(void *arg)
{
	struct bp_thread *t = arg;
	kl_call call = { .key = "k", .cancel = NULL };
	kl_lease *lease = NULL;
	size_t h, w;

	pthread_cleanup_push(bp_exited, t);
	t->rc[BP_ACQUIRE] = kl_lock_acquire(t->l, &call, &lease, NULL);
	kl_lease_release(lease);
	t->rc[BP_RELEASE] = KL_OK;
	t->rc[BP_STATUS] = kl_provider_status(t->p, "k", &h, &w, NULL);
	t->rc[BP_SNAPSHOT] = kl_provider_snapshot(t->p, bp_entry, NULL, NULL);
	for (;;)
		pthread_testcancel();
	pthread_cleanup_pop(0);
	return NULL;
}

/* Waits until the thread has entered call op of the provider, or exited. */
static bool
bp_wait_entered(struct bp *b, struct bp_thread *t, int op)
{
	while (atomic_load(&b->entered[op]) == 0) {
		if (atomic_load(&t->exited))
			return false;
		test_sleep_ms(1);
	}
	return true;
}

/* For each call in turn: wait until the thread is inside the provider,
 * cancel it, let the provider return.  The thread must come out of every
 * call with its result and be cancelled only at its own testcancel. */
START_TEST(test_cancel_waits_for_provider_call)
{
	static const char *const name[BP_OPS] = { "acquire", "release",
						  "status", "snapshot" };
	struct bp b;
	struct bp_thread t;
	pthread_t th;
	void *ret = NULL;

	memset(&b, 0, sizeof b);
	for (int op = 0; op < BP_OPS; op++) {
		ck_assert_int_eq(pipe(b.fd[op]), 0);
		atomic_init(&b.entered[op], 0);
		atomic_init(&b.done[op], 0);
	}
	memset(&t, 0, sizeof t);
	ck_assert_int_eq(kl_provider_new(&t.p, &bp_ops, &b), KL_OK);
	t.l = lock_make(t.p, NULL, KL_FOREVER, 0, NULL, NULL);
	for (int op = 0; op < BP_OPS; op++)
		t.rc[op] = -100;
	atomic_init(&t.exited, false);
	ck_assert_int_eq(pthread_create(&th, NULL, bp_thread_main, &t), 0);
	for (int op = 0; op < BP_OPS; op++) {
		/* Inside the provider, about to block in read(); a thread
		 * cancelled inside the call before never gets here. */
		ck_assert_msg(bp_wait_entered(&b, &t, op),
			      "cancelled inside the provider's %s, before "
			      "the %s",
			      op > 0 ? name[op - 1] : "(none)", name[op]);
		ck_assert_int_eq(pthread_cancel(th), 0);
		ck_assert_int_eq(write(b.fd[op][1], "x", 1), 1);
	}
	ck_assert_int_eq(pthread_join(th, &ret), 0);
	ck_assert_ptr_eq(ret, PTHREAD_CANCELED);
	for (int op = 0; op < BP_OPS; op++) {
		ck_assert_int_eq(atomic_load(&b.done[op]), 1);
		ck_assert_msg(t.rc[op] == KL_OK,
			      "%s: cancelled inside the provider (rc %d)",
			      name[op], t.rc[op]);
	}
	kl_lock_free(t.l);
	kl_provider_free(t.p);
	for (int op = 0; op < BP_OPS; op++) {
		close(b.fd[op][0]);
		close(b.fd[op][1]);
	}
}
END_TEST

/* kl_provider_open and kl_provider_free of a local: provider, with a
 * cancel already pending: opening opens files and freeing closes them,
 * both cancellation points, where the thread was unwound with the
 * provider half made or half freed.  Both must return; the cancel then
 * acts at the thread's own testcancel. */
struct cof {
	const char *uri;
	int rc;
	atomic_bool opened, freed;
};

static void *
cof_main(void *arg)
{
	struct cof *c = arg;
	kl_provider *p = NULL;

	pthread_cancel(pthread_self());
	c->rc = kl_provider_open(&p, c->uri, NULL);
	atomic_store(&c->opened, true);
	kl_provider_free(p);
	atomic_store(&c->freed, true);
	for (;;)
		pthread_testcancel();
	return NULL;
}

START_TEST(test_cancel_pending_open_free)
{
	char dir[] = "/tmp/kl-cof.XXXXXX", uri[96], sub[64];
	struct cof c;
	pthread_t th;
	void *ret = NULL;

	ck_assert_ptr_nonnull(mkdtemp(dir));
	snprintf(sub, sizeof sub, "%s/state", dir);
	snprintf(uri, sizeof uri, "local:%s", sub);
	memset(&c, 0, sizeof c);
	c.uri = uri;
	c.rc = -100;
	atomic_init(&c.opened, false);
	atomic_init(&c.freed, false);
	ck_assert_int_eq(pthread_create(&th, NULL, cof_main, &c), 0);
	ck_assert_int_eq(pthread_join(th, &ret), 0);
	ck_assert_ptr_eq(ret, PTHREAD_CANCELED);
	ck_assert_msg(atomic_load(&c.opened),
		      "cancelled inside kl_provider_open");
	ck_assert_msg(c.rc == KL_OK, "open: rc %d", c.rc);
	ck_assert_msg(atomic_load(&c.freed),
		      "cancelled inside kl_provider_free");
	ck_assert_int_eq(test_remove_tree(dir), 0);
}
END_TEST

/* ------------------------------------------------------------------ */
/* User providers that fail                                            */

/* The user provider of util.h, fences from 1. */
static kl_provider *
up_new(struct test_up *u)
{
	test_up_init(u, 0);
	return test_up_provider(u, &test_up_ops);
}

static void
up_free(struct test_up *u, kl_provider *p)
{
	kl_provider_free(p);
	test_up_fini(u);
}

START_TEST(test_release_failure_event)
{
	kl_lease *lease = NULL;
	struct evlog g;
	kl_provider *p;
	struct test_up u;
	kl_lock *l;
	int v = 5, res = 0;

	evlog_init(&g);
	p = up_new(&u);
	u.release_status = KL_EPROVIDER;
	l = lock_make(p, "rf", KL_FOREVER, 0, evlog_fn, &g);
	ck_assert_int_eq(kl_lock_run(l, NULL, fn_return, &v, &res, NULL),
			 KL_OK);
	ck_assert_int_eq(res, 5);
	ck_assert_int_eq(u.releases, 1);
	ck_assert_int_eq(g.n, 2);
	check_event(&g, 0, KL_EV_ACQUIRED, "rf", KL_OK);
	check_event(&g, 1, KL_EV_RELEASE_FAILED, "rf", KL_EPROVIDER);

	ck_assert_int_eq(kl_lock_acquire(l, NULL, &lease, NULL), KL_OK);
	kl_lease_release(lease);
	ck_assert_int_eq(u.releases, 2);
	ck_assert_int_eq(g.n, 4);
	check_event(&g, 3, KL_EV_RELEASE_FAILED, "rf", KL_EPROVIDER);
	kl_lock_free(l);
	up_free(&u, p);
	evlog_fini(&g);
}
END_TEST

START_TEST(test_acquire_failure_provider)
{
	kl_lease *lease = (kl_lease *)&lease;
	atomic_int ran = 0;
	struct evlog g;
	kl_provider *p;
	kl_error err;
	struct test_up u;
	kl_lock *l;

	evlog_init(&g);
	p = up_new(&u);
	u.acquire_status = KL_EPROVIDER;
	l = lock_make(p, "af", KL_FOREVER, 0, evlog_fn, &g);
	memset(&err, 0, sizeof err);
	ck_assert_int_eq(kl_lock_run(l, NULL, fn_count, &ran, NULL, &err),
			 KL_EPROVIDER);
	ck_assert_int_eq(atomic_load(&ran), 0);
	ck_assert_int_eq(err.status, KL_EPROVIDER);
	ck_assert_msg(strstr(err.message, "server on fire") != NULL,
		      "message \"%s\"", err.message);
	ck_assert_int_eq(u.releases, 0);
	ck_assert_int_eq(g.n, 1);
	check_event(&g, 0, KL_EV_REJECTED, "af", KL_EPROVIDER);

	ck_assert_int_eq(kl_lock_acquire(l, NULL, &lease, NULL), KL_EPROVIDER);
	ck_assert_ptr_null(lease);
	ck_assert_int_eq(g.n, 2);
	check_event(&g, 1, KL_EV_REJECTED, "af", KL_EPROVIDER);
	kl_lock_free(l);
	up_free(&u, p);
	evlog_fini(&g);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Run with the lease                                                  */

/* What fn saw of the lease it was lent. */
struct seen {
	kl_provider *p;   /* a memory provider to probe, or NULL */
	struct evlog *g;  /* the lock's events, or NULL */
	int calls;
	bool lease_null;
	char key[64];
	uint64_t fence;
	bool valid;
	bool held;        /* another lock could not take the key */
	int events;       /* g->n while fn ran */
	int ret;          /* what fn returns */
	int releases;     /* kl_lease_release calls fn makes (misuse) */
	bool valid_after; /* kl_lease_valid after those releases */
	uint64_t fence_after;
	int64_t sleep_ms;
};

static int
fn_seen(kl_lease *lease, void *arg)
{
	struct seen *s = arg;

	s->calls++;
	s->lease_null = lease == NULL;
	if (lease == NULL)
		return s->ret;
	snprintf(s->key, sizeof s->key, "%s",
		 kl_lease_key(lease) != NULL ? kl_lease_key(lease) : "(null)");
	s->fence = kl_lease_fence(lease);
	s->valid = kl_lease_valid(lease);
	if (s->p != NULL)
		s->held = !key_free(s->p, s->key);
	if (s->g != NULL) {
		pthread_mutex_lock(&s->g->mu);
		s->events = s->g->n;
		pthread_mutex_unlock(&s->g->mu);
	}
	for (int i = 0; i < s->releases; i++)
		kl_lease_release(lease);
	if (s->releases > 0) {
		/* The lease still works: the key is held until fn returns. */
		s->valid_after = kl_lease_valid(lease);
		s->fence_after = kl_lease_fence(lease);
		if (s->p != NULL)
			s->held = s->held && !key_free(s->p, s->key);
	}
	if (s->sleep_ms > 0)
		test_sleep_ms(s->sleep_ms); /* a duration under test: held_ms */
	return s->ret;
}

/* fn gets a valid lease on the resolved key, the key is held while fn
 * runs, its fence grows with every run (also across kl_lock_acquire
 * grants), fn's value reaches *fn_result; on a lock without a hook (the
 * lease in the key's entry) and with one (the lease on the stack). */
START_TEST(test_run_lease_gets_lease)
{
	kl_provider *p = private_provider();
	struct evlog g;
	kl_lock *locks[3];

	evlog_init(&g);
	locks[0] = lock_make(p, NULL, KL_FOREVER, 0, NULL, NULL);
	locks[1] = lock_make(p, NULL, KL_FOREVER, 0, evlog_fn, &g);
	locks[2] = lock_make(p, "own key", KL_FOREVER, 0, NULL, NULL);
	for (int li = 0; li < 3; li++) {
		static const char *const keys[] = { "k", "a call key longer "
						      "than sixteen bytes" };
		kl_lock *l = locks[li];

		for (int ki = 0; ki < 2; ki++) {
			char key[64];
			kl_call call = { .key = key, .cancel = NULL };
			const char *want = li == 2 ? "own key" : keys[ki];
			uint64_t last = 0;

			snprintf(key, sizeof key, "%s", keys[ki]);
			for (int i = 0; i < 10; i++) {
				struct seen s = { .p = p, .ret = 100 + i };
				kl_lease *lease = NULL;
				kl_error err;
				int res = -1;

				memset(&err, 0x55, sizeof err);
				ck_assert_int_eq(kl_lock_run_lease(l, &call,
								   fn_seen, &s,
								   &res, &err),
						 KL_OK);
				ck_assert_int_eq(err.status, KL_OK);
				ck_assert_int_eq(s.calls, 1);
				ck_assert(!s.lease_null);
				ck_assert_str_eq(s.key, want);
				ck_assert(s.valid);
				ck_assert(s.held);
				ck_assert_msg(s.fence > last,
					      "lock %d: fence %llu after %llu",
					      li, (unsigned long long)s.fence,
					      (unsigned long long)last);
				ck_assert_int_eq(res, 100 + i);
				ck_assert(key_free(p, want));
				ck_assert_uint_eq(kl_memory_provider_size(p),
						  0);
				/* A grant by kl_lock_acquire in between
				 * counts too. */
				ck_assert_int_eq(kl_lock_acquire(l, &call,
								 &lease, NULL),
						 KL_OK);
				ck_assert_uint_gt(kl_lease_fence(lease),
						  s.fence);
				last = kl_lease_fence(lease);
				kl_lease_release(lease);
			}
		}
	}
	for (int li = 0; li < 3; li++)
		kl_lock_free(locks[li]);
	kl_provider_free(p);
	evlog_fini(&g);
}
END_TEST

static int
fn_lease_return(kl_lease *lease, void *arg)
{
	(void)lease;
	return *(int *)arg;
}

START_TEST(test_run_lease_releases_on_every_path)
{
	kl_provider *p = private_provider();
	const int values[] = { 0, 42, -1, KL_ETIMEDOUT, KL_EPROVIDER,
			       KL_EINVAL };
	struct evlog g;
	kl_lock *locks[2];

	evlog_init(&g);
	locks[0] = lock_make(p, "run", KL_FOREVER, 0, NULL, NULL);
	locks[1] = lock_make(p, "run", KL_FOREVER, 0, evlog_fn, &g);
	for (int li = 0; li < 2; li++) {
		for (size_t i = 0; i < sizeof values / sizeof values[0];
		     i++) {
			int v = values[i], res = 12345;
			kl_error err;

			memset(&err, 0x55, sizeof err);
			ck_assert_int_eq(kl_lock_run_lease(locks[li], NULL,
							   fn_lease_return, &v,
							   &res, &err),
					 KL_OK);
			ck_assert_int_eq(res, v);
			ck_assert_int_eq(err.status, KL_OK);
			ck_assert_uint_eq(kl_memory_provider_size(p), 0);
			ck_assert(key_free(p, "run"));
			/* fn_result and err may be NULL. */
			ck_assert_int_eq(kl_lock_run_lease(locks[li], NULL,
							   fn_lease_return, &v,
							   NULL, NULL),
					 KL_OK);
			ck_assert_uint_eq(kl_memory_provider_size(p), 0);
			ck_assert(key_free(p, "run"));
		}
	}
	/* Each run of the hooked lock: one ACQUIRED, one RELEASED. */
	ck_assert_int_eq(g.n, 4 * 6);
	for (int i = 0; i < g.n; i++)
		check_event(&g, i, i % 2 == 0 ? KL_EV_ACQUIRED : KL_EV_RELEASED,
			    "run", KL_OK);
	kl_lock_free(locks[0]);
	kl_lock_free(locks[1]);
	kl_provider_free(p);
	evlog_fini(&g);
}
END_TEST

/* The events of kl_lock_run: ACQUIRED before fn runs, RELEASED after it
 * returned, with held_ms covering fn's time; a waiter's ACQUIRED tells
 * how long it waited. */
START_TEST(test_run_lease_events)
{
	kl_provider *p = private_provider();
	kl_lock *h = lock_make(p, "ev", KL_FOREVER, 0, NULL, NULL);
	struct seen s = { .sleep_ms = 20, .ret = 3 };
	kl_lease *lease = NULL;
	struct evlog g;
	kl_lock *l;
	int res = 0;

	evlog_init(&g);
	s.g = &g;
	l = lock_make(p, "ev", KL_FOREVER, 0, evlog_fn, &g);
	ck_assert_int_eq(kl_lock_run_lease(l, NULL, fn_seen, &s, &res, NULL),
			 KL_OK);
	ck_assert_int_eq(res, 3);
	ck_assert_int_eq(s.events, 1); /* ACQUIRED only, while fn ran */
	ck_assert_int_eq(g.n, 2);
	check_event(&g, 0, KL_EV_ACQUIRED, "ev", KL_OK);
	ck_assert_int_ge(g.ev[0].waited_ms, 0);
	check_event(&g, 1, KL_EV_RELEASED, "ev", KL_OK);
	ck_assert_int_ge(g.ev[1].held_ms, 20);
	ck_assert_int_lt(g.ev[1].held_ms, 5000);

	/* A waiter: a thread in kl_lock_run_lease behind a holder. */
	ck_assert_int_eq(kl_lock_acquire(h, NULL, &lease, NULL), KL_OK);
	{
		struct lw w;

		memset(&w, 0, sizeof w);
		lw_start_as(&w, l, NULL, NULL, true);
		wait_queue(p, "ev", 1);
		test_sleep_ms(30); /* a duration under test: waited_ms */
		kl_lease_release(lease);
		lw_join(&w);
		ck_assert_int_eq(w.rc, KL_OK);
		ck_assert_int_eq(w.ran, 1);
		ck_assert_int_eq(w.fn_result, 11);
	}
	ck_assert_int_eq(g.n, 4);
	check_event(&g, 2, KL_EV_ACQUIRED, "ev", KL_OK);
	ck_assert_int_ge(g.ev[2].waited_ms, 30);
	ck_assert_int_lt(g.ev[2].waited_ms, 5000);
	check_event(&g, 3, KL_EV_RELEASED, "ev", KL_OK);
	kl_lock_free(h);
	kl_lock_free(l);
	kl_provider_free(p);
	evlog_fini(&g);
}
END_TEST

/* Not acquired: fn is not called, the status and err say why, REJECTED
 * is raised; bad arguments are KL_EINVAL. */
START_TEST(test_run_lease_not_acquired)
{
	kl_provider *p = private_provider();
	kl_lock *h = lock_make(p, "slow", KL_FOREVER, 0, NULL, NULL);
	kl_lock *nokey = lock_make(p, NULL, KL_FOREVER, 0, NULL, NULL);
	struct seen s = { .ret = 1 };
	kl_lease *lease = NULL;
	kl_cancel *c = NULL;
	struct evlog g;
	kl_error err;
	int64_t t0, t1;
	kl_lock *l;
	int res = 77;

	evlog_init(&g);
	ck_assert_int_eq(kl_lock_acquire(h, NULL, &lease, NULL), KL_OK);
	for (int timeout = 0; timeout <= 50; timeout += 50) {
		l = lock_make(p, "slow", timeout, 0, evlog_fn, &g);
		memset(&err, 0, sizeof err);
		t0 = now_ns();
		ck_assert_int_eq(kl_lock_run_lease(l, NULL, fn_seen, &s, &res,
						   &err),
				 KL_ETIMEDOUT);
		t1 = now_ns();
		ck_assert_int_ge(t1 - t0, timeout * 1000000LL); /* not early */
		ck_assert_int_lt(t1 - t0, 5000 * 1000000LL);
		ck_assert_int_eq(s.calls, 0);
		ck_assert_int_eq(res, 77);
		ck_assert_int_eq(err.status, KL_ETIMEDOUT);
		ck_assert(err.message[0] != '\0');
		kl_lock_free(l);
	}
	ck_assert_int_eq(g.n, 2);
	check_event(&g, 0, KL_EV_REJECTED, "slow", KL_ETIMEDOUT);
	check_event(&g, 1, KL_EV_REJECTED, "slow", KL_ETIMEDOUT);
	ck_assert_uint_eq(kl_memory_provider_queue_size(p, "slow"), 0);

	/* A fired cancel token: KL_ECANCELED, held key or not. */
	ck_assert_int_eq(kl_cancel_new(&c), KL_OK);
	kl_cancel_fire(c);
	l = lock_make(p, "slow", KL_FOREVER, 0, NULL, NULL);
	ck_assert_int_eq(kl_lock_run_lease(l, &(kl_call){ .cancel = c },
					   fn_seen, &s, &res, &err),
			 KL_ECANCELED);
	ck_assert_int_eq(err.status, KL_ECANCELED);
	kl_lease_release(lease);
	ck_assert_int_eq(kl_lock_run_lease(l, &(kl_call){ .cancel = c },
					   fn_seen, &s, &res, &err),
			 KL_ECANCELED);
	ck_assert_int_eq(s.calls, 0);
	ck_assert_int_eq(res, 77);

	/* No key; no lock; no function. */
	ck_assert_int_eq(kl_lock_run_lease(nokey, NULL, fn_seen, &s, &res,
					   &err),
			 KL_ENOKEY);
	ck_assert_int_eq(err.status, KL_ENOKEY);
	ck_assert_int_eq(kl_lock_run_lease(NULL, NULL, fn_seen, &s, &res,
					   &err),
			 KL_EINVAL);
	ck_assert_int_eq(err.status, KL_EINVAL);
	ck_assert_int_eq(kl_lock_run_lease(l, NULL, NULL, &s, &res, NULL),
			 KL_EINVAL);
	ck_assert_int_eq(s.calls, 0);
	ck_assert_int_eq(res, 77);
	ck_assert_uint_eq(kl_memory_provider_size(p), 0);
	kl_cancel_free(c);
	kl_lock_free(l);
	kl_lock_free(h);
	kl_lock_free(nokey);
	kl_provider_free(p);
	evlog_fini(&g);
}
END_TEST

/* A provider's leases (the lease on the stack): fn gets the fence the
 * provider issued for this grant and the provider's validity, which can
 * turn false while fn runs. */
static int
fn_loses(kl_lease *lease, void *arg)
{
	struct test_up *u = arg;
	int r = 0;

	if (kl_lease_valid(lease) && kl_lease_fence(lease) == u->fence)
		r |= 1;
	test_up_set_valid(u, false); /* the renewal failed, say */
	if (!kl_lease_valid(lease))
		r |= 2;
	return r;
}

START_TEST(test_run_lease_provider)
{
	struct evlog g;
	struct seen s;
	kl_provider *p;
	struct test_up u;
	kl_lock *l;
	int res = 0;

	evlog_init(&g);
	p = up_new(&u);
	l = lock_make(p, "up", KL_FOREVER, 0, evlog_fn, &g);
	for (uint64_t i = 1; i <= 3; i++) {
		memset(&s, 0, sizeof s);
		ck_assert_int_eq(kl_lock_run_lease(l, NULL, fn_seen, &s, &res,
						   NULL),
				 KL_OK);
		ck_assert_str_eq(s.key, "up");
		ck_assert_uint_eq(s.fence, i);
		ck_assert(s.valid);
	}
	ck_assert_int_eq(kl_lock_run_lease(l, NULL, fn_loses, &u, &res, NULL),
			 KL_OK);
	ck_assert_int_eq(res, 3);
	ck_assert_int_eq(u.releases, 4);
	ck_assert(!u.held);

	/* A failed release is reported and the result stands. */
	u.release_status = KL_EPROVIDER;
	memset(&s, 0, sizeof s);
	s.ret = 8;
	ck_assert_int_eq(kl_lock_run_lease(l, NULL, fn_seen, &s, &res, NULL),
			 KL_OK);
	ck_assert_int_eq(res, 8);
	ck_assert_int_eq(u.releases, 5);
	ck_assert_int_eq(g.n, 10);
	check_event(&g, 8, KL_EV_ACQUIRED, "up", KL_OK);
	check_event(&g, 9, KL_EV_RELEASE_FAILED, "up", KL_EPROVIDER);

	/* A provider that cannot be asked: REJECTED, fn not called. */
	u.acquire_status = KL_EPROVIDER;
	memset(&s, 0, sizeof s);
	ck_assert_int_eq(kl_lock_run_lease(l, NULL, fn_seen, &s, &res, NULL),
			 KL_EPROVIDER);
	ck_assert_int_eq(s.calls, 0);
	ck_assert_int_eq(g.n, 11);
	check_event(&g, 10, KL_EV_REJECTED, "up", KL_EPROVIDER);
	kl_lock_free(l);
	up_free(&u, p);
	evlog_fini(&g);
}
END_TEST

/* Misuse: fn releases the lease it was lent (twice).  That release does
 * nothing: the key stays held and the lease readable until fn returns;
 * then the key is released once, with one RELEASED event, and the call
 * returns KL_EINVAL with fn's result set.  The stack lease (hooked lock,
 * user provider) is not freed, the key not released twice. */
START_TEST(test_run_lease_fn_releases)
{
	kl_provider *p = private_provider();
	struct evlog g;
	kl_lock *locks[2];
	struct test_up u;
	kl_provider *up;
	kl_lock *ul;

	evlog_init(&g);
	locks[0] = lock_make(p, "mis", KL_FOREVER, 0, NULL, NULL);
	locks[1] = lock_make(p, "mis", KL_FOREVER, 0, evlog_fn, &g);
	for (int li = 0; li < 2; li++) {
		struct seen s = { .p = p, .releases = 2, .ret = 9 };
		kl_error err;
		int res = 0;

		memset(&err, 0, sizeof err);
		ck_assert_int_eq(kl_lock_run_lease(locks[li], NULL, fn_seen,
						   &s, &res, &err),
				 KL_EINVAL);
		ck_assert_int_eq(res, 9);
		ck_assert_int_eq(err.status, KL_EINVAL);
		ck_assert(strstr(err.message, "released") != NULL);
		ck_assert(s.held);
		ck_assert(s.valid_after);
		ck_assert_uint_eq(s.fence_after, s.fence);
		ck_assert_uint_eq(kl_memory_provider_size(p), 0);
		ck_assert(key_free(p, "mis"));
		/* The next run is a normal one. */
		s.releases = 0;
		ck_assert_int_eq(kl_lock_run_lease(locks[li], NULL, fn_seen,
						   &s, &res, &err),
				 KL_OK);
		ck_assert(key_free(p, "mis"));
	}
	ck_assert_int_eq(g.n, 4);
	check_event(&g, 0, KL_EV_ACQUIRED, "mis", KL_OK);
	check_event(&g, 1, KL_EV_RELEASED, "mis", KL_OK);

	up = up_new(&u);
	ul = lock_make(up, "mis", KL_FOREVER, 0, NULL, NULL);
	{
		struct seen s = { .releases = 3, .ret = 4 };
		int res = 0;

		ck_assert_int_eq(kl_lock_run_lease(ul, NULL, fn_seen, &s, &res,
						   NULL),
				 KL_EINVAL);
		ck_assert_int_eq(res, 4);
		ck_assert_int_eq(u.releases, 1);
		ck_assert(!u.held);
	}
	kl_lock_free(ul);
	up_free(&u, up);
	kl_lock_free(locks[0]);
	kl_lock_free(locks[1]);
	kl_provider_free(p);
	evlog_fini(&g);
}
END_TEST

/* Threads write through a fenced store (it refuses a fence not above the
 * last one it accepted) under kl_lock_run_lease on one key, with and
 * without a hook (both lease kinds hand the key to each other): no write
 * is refused and none is lost. */
#define FS_THREADS 4

struct fstore {
	pthread_mutex_t mu; /* the store's own lock, not the key's */
	uint64_t last_fence;
	long accepted, refused;
	long value; /* read-modify-write under the key only */
};

struct fs_worker {
	pthread_t th;
	kl_lock *l;
	struct fstore *st;
	long iters;
	atomic_long failures;
};

static int
fs_write(kl_lease *lease, void *arg)
{
	struct fstore *st = arg;
	uint64_t fence = kl_lease_fence(lease);
	long v = st->value; /* the protected read-modify-write */
	int ok;

	pthread_mutex_lock(&st->mu);
	ok = fence > st->last_fence;
	if (ok) {
		st->last_fence = fence;
		st->accepted++;
	} else {
		st->refused++;
	}
	pthread_mutex_unlock(&st->mu);
	if (ok)
		st->value = v + 1;
	return ok ? 0 : -1;
}

static void *
fs_main(void *arg)
{
	struct fs_worker *w = arg;

	for (long i = 0; i < w->iters; i++) {
		int res = 1;

		if (kl_lock_run_lease(w->l, &(kl_call){ .key = "store" },
				      fs_write, w->st, &res, NULL) != KL_OK ||
		    res != 0)
			atomic_fetch_add(&w->failures, 1);
	}
	return NULL;
}

static void
ev_ignore(const kl_event *ev, void *arg)
{
	(void)ev;
	(void)arg;
}

START_TEST(test_run_lease_fenced_store)
{
	kl_provider *p = private_provider();
	struct fs_worker w[FS_THREADS];
	struct fstore st;
	long iters = kl_test_scaled(20000, 200), failures = 0;

	memset(&st, 0, sizeof st);
	pthread_mutex_init(&st.mu, NULL);
	for (int i = 0; i < FS_THREADS; i++) {
		w[i].l = lock_make(p, NULL, KL_FOREVER, 0,
				   i % 2 == 0 ? NULL : ev_ignore, NULL);
		w[i].st = &st;
		w[i].iters = iters;
		atomic_init(&w[i].failures, 0);
		test_thread_start(&w[i].th, fs_main, &w[i]);
	}
	for (int i = 0; i < FS_THREADS; i++) {
		test_thread_join(w[i].th);
		failures += atomic_load(&w[i].failures);
		kl_lock_free(w[i].l);
	}
	ck_assert_msg(failures == 0, "%ld runs failed or were refused",
		      failures);
	ck_assert_int_eq(st.refused, 0);
	ck_assert_int_eq(st.accepted, iters * FS_THREADS);
	ck_assert_int_eq(st.value, iters * FS_THREADS);
	ck_assert_uint_eq(kl_memory_provider_size(p), 0);
	pthread_mutex_destroy(&st.mu);
	kl_provider_free(p);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Mutual exclusion stress                                             */

#define STRESS_THREADS 16
#define STRESS_KEYS 64

struct stress {
	kl_provider *p;
	long iters;
	char keys[STRESS_KEYS][16];
	volatile int counter[STRESS_KEYS]; /* plain: guarded by the key */
	long total[STRESS_KEYS];           /* plain: guarded by the key */
	atomic_long violations;
	atomic_long errors;
};

struct stress_arg {
	struct stress *s;
	int k;
};

static int
stress_fn(void *arg)
{
	struct stress_arg *a = arg;
	struct stress *s = a->s;

	for (int j = 0; j < 10; j++)
		s->counter[a->k]++;
	if (s->counter[a->k] != 10)
		atomic_fetch_add(&s->violations, 1);
	s->counter[a->k] = 0;
	s->total[a->k]++;
	return 0;
}

struct stress_worker {
	pthread_t th;
	struct stress *s;
	unsigned id;
};

static void *
stress_main(void *arg)
{
	struct stress_worker *sw = arg;
	struct stress *s = sw->s;
	kl_lock_opts o = KL_LOCK_OPTS_INIT;
	uint32_t x = 88172645u ^ (sw->id * 2654435761u);
	kl_lock *l;

	o.provider = s->p;
	if (kl_lock_new(&l, &o) != KL_OK) {
		atomic_fetch_add(&s->errors, 1);
		return NULL;
	}
	for (long i = 0; i < s->iters; i++) {
		struct stress_arg a = { .s = s };
		kl_call call = { .cancel = NULL };

		x ^= x << 13;
		x ^= x >> 17;
		x ^= x << 5;
		a.k = (int)(x % STRESS_KEYS);
		call.key = s->keys[a.k];
		if (kl_lock_run(l, &call, stress_fn, &a, NULL, NULL) != KL_OK)
			atomic_fetch_add(&s->errors, 1);
	}
	kl_lock_free(l);
	return NULL;
}

START_TEST(test_mutual_exclusion_stress)
{
	struct stress_worker w[STRESS_THREADS];
	struct stress *s = calloc(1, sizeof *s);
	long sum = 0, errors, violations;

	ck_assert_ptr_nonnull(s);
	s->p = private_provider();
	s->iters = kl_test_scaled(62500, 500);
	for (int k = 0; k < STRESS_KEYS; k++)
		snprintf(s->keys[k], sizeof s->keys[k], "stress:%d", k);
	for (int i = 0; i < STRESS_THREADS; i++) {
		w[i].s = s;
		w[i].id = (unsigned)i + 1;
		test_thread_start(&w[i].th, stress_main, &w[i]);
	}
	for (int i = 0; i < STRESS_THREADS; i++)
		test_thread_join(w[i].th);
	errors = atomic_load(&s->errors);
	violations = atomic_load(&s->violations);
	ck_assert_msg(errors == 0, "%ld runs failed", errors);
	ck_assert_msg(violations == 0, "%ld mutual exclusion violations",
		      violations);
	for (int k = 0; k < STRESS_KEYS; k++)
		sum += s->total[k];
	ck_assert_int_eq(sum, s->iters * STRESS_THREADS);
	ck_assert_uint_eq(kl_memory_provider_size(s->p), 0);
	kl_provider_free(s->p);
	free(s);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Key sets                                                            */

/* A provider that excludes nothing and counts what it holds; its acquire
 * number fail_at fails with KL_EPROVIDER, and the lease it handed out as
 * acquire number lost_at reports itself lost. */
struct fp {
	pthread_mutex_t mu;
	int acquires, releases, held;
	int fail_at;
	atomic_int lost_at;
	char cookies[16];
};

static int
fp_acquire(void *impl, const char *key, size_t key_len, kl_cancel *cancel,
	   int64_t timeout_ms, int64_t ttl_ms, unsigned flags, void **lease,
	   uint64_t *fence, kl_error *err)
{
	struct fp *f = impl;
	int n, rc = KL_OK;

	(void)key;
	(void)key_len;
	(void)cancel;
	(void)timeout_ms;
	(void)ttl_ms;
	(void)flags;
	pthread_mutex_lock(&f->mu);
	n = ++f->acquires;
	if (n == f->fail_at) {
		rc = KL_EPROVIDER;
		if (err != NULL) {
			err->status = rc;
			snprintf(err->message, sizeof err->message,
				 "fp: refused");
		}
	} else {
		f->held++;
		*lease = &f->cookies[n % 16];
		*fence = (uint64_t)n;
	}
	pthread_mutex_unlock(&f->mu);
	return rc;
}

static int
fp_release(void *impl, void *lease, kl_error *err)
{
	struct fp *f = impl;

	(void)lease;
	(void)err;
	pthread_mutex_lock(&f->mu);
	f->releases++;
	f->held--;
	pthread_mutex_unlock(&f->mu);
	return KL_OK;
}

static bool
fp_valid(void *impl, void *lease)
{
	struct fp *f = impl;

	return (char *)lease - f->cookies != atomic_load(&f->lost_at) % 16;
}

static const kl_provider_ops fp_ops = {
	.struct_size = sizeof(kl_provider_ops),
	.name = "fp",
	.acquire = fp_acquire,
	.release = fp_release,
	.valid = fp_valid,
};

static kl_provider *
fp_new(struct fp *f)
{
	kl_provider *p = NULL;

	memset(f, 0, sizeof *f);
	pthread_mutex_init(&f->mu, NULL);
	atomic_init(&f->lost_at, -1);
	ck_assert_int_eq(kl_provider_new(&p, &fp_ops, f), KL_OK);
	return p;
}

/* What fn saw of a set lease. */
struct set_seen {
	kl_provider *p;
	int calls;
	size_t count;
	char keys[8][16];
	uint64_t fences[8];
	bool all_held;
	bool release_it; /* misuse: fn releases the lease it was lent */
};

static int
fn_set_seen(kl_lease *lease, void *arg)
{
	struct set_seen *s = arg;

	s->calls++;
	s->count = kl_lease_count(lease);
	s->all_held = true;
	for (size_t i = 0; i < s->count && i < 8; i++) {
		snprintf(s->keys[i], sizeof s->keys[i], "%s",
			 kl_lease_key_at(lease, i));
		s->fences[i] = kl_lease_fence_at(lease, i);
		if (s->p != NULL && key_free(s->p, s->keys[i]))
			s->all_held = false;
	}
	if (s->release_it) {
		kl_lease_release(lease);
		for (size_t i = 0; i < s->count && s->p != NULL; i++)
			if (key_free(s->p, kl_lease_key_at(lease, i)))
				s->all_held = false;
	}
	return 11;
}

/* The distinct keys in bytewise order (memcmp, then the shorter first:
 * unsigned bytes, so 0xff sorts last), duplicates merged, on a lock that
 * keeps leases in entries (no hook) and on one that does not (a hook); the
 * set excludes single-key holders of each member and is released whole. */
START_TEST(test_many_canonical_order)
{
	static const char *const keys[] = { "b", "a\xff", "ab", "a",
					    "b", "B", "a" };
	static const char *const want[] = { "B", "a", "ab", "a\xff", "b" };
	struct evlog g;
	kl_provider *p = private_provider();

	evlog_init(&g);
	for (int hook = 0; hook < 2; hook++) {
		kl_lock *l = lock_make(p, NULL, KL_FOREVER, 0,
				       hook ? evlog_fn : NULL, &g);
		struct set_seen s = { .p = p };
		kl_lease *lease = NULL;
		int res = 0;

		ck_assert_int_eq(kl_lock_acquire_many(l, keys, 7, NULL, &lease,
						      NULL),
				 KL_OK);
		ck_assert_uint_eq(kl_lease_count(lease), 5);
		for (size_t i = 0; i < 5; i++) {
			ck_assert_str_eq(kl_lease_key_at(lease, i), want[i]);
			ck_assert_uint_gt(kl_lease_fence_at(lease, i), 0);
			ck_assert(!key_free(p, want[i]));
		}
		ck_assert_ptr_null(kl_lease_key_at(lease, 5));
		ck_assert_uint_eq(kl_lease_fence_at(lease, 5), 0);
		ck_assert_str_eq(kl_lease_key(lease), "B");
		ck_assert_uint_eq(kl_lease_fence(lease),
				  kl_lease_fence_at(lease, 0));
		ck_assert(kl_lease_valid(lease));
		kl_lease_release(lease);
		for (size_t i = 0; i < 5; i++)
			ck_assert(key_free(p, want[i]));

		ck_assert_int_eq(kl_lock_run_many(l, keys, 7, NULL,
						  fn_set_seen, &s, &res, NULL),
				 KL_OK);
		ck_assert_int_eq(res, 11);
		ck_assert_int_eq(s.calls, 1);
		ck_assert_uint_eq(s.count, 5);
		ck_assert(s.all_held);
		for (size_t i = 0; i < 5; i++)
			ck_assert_str_eq(s.keys[i], want[i]);
		for (size_t i = 0; i < 5; i++)
			ck_assert(key_free(p, want[i]));
		kl_lock_free(l);
	}
	/* A single-key lease is a set of one. */
	{
		kl_lock *l = lock_make(p, "solo", KL_FOREVER, 0, NULL, NULL);
		kl_lease *lease = NULL;

		ck_assert_int_eq(kl_lock_acquire(l, NULL, &lease, NULL), KL_OK);
		ck_assert_uint_eq(kl_lease_count(lease), 1);
		ck_assert_str_eq(kl_lease_key_at(lease, 0), "solo");
		ck_assert_uint_eq(kl_lease_fence_at(lease, 0),
				  kl_lease_fence(lease));
		ck_assert_ptr_null(kl_lease_key_at(lease, 1));
		kl_lease_release(lease);
		ck_assert_uint_eq(kl_lease_count(NULL), 0);
		kl_lock_free(l);
	}
	ck_assert_uint_eq(kl_memory_provider_size(p), 0);
	kl_provider_free(p);
	evlog_fini(&g);
}
END_TEST

/* Bad arguments are KL_EINVAL with a message saying what is wrong, and
 * nothing is held. */
START_TEST(test_many_einval)
{
	static const char *const with_null[] = { "x", NULL };
	static const char *const one[] = { "x" };
	kl_provider *p = private_provider();
	kl_lock *l = lock_make(p, NULL, KL_FOREVER, 0, NULL, NULL);
	kl_lock *own = lock_make(p, "own", KL_FOREVER, 0, NULL, NULL);
	kl_lease *lease = (kl_lease *)&lease;
	struct set_seen s = { 0 };
	kl_error err;

	ck_assert_int_eq(kl_lock_acquire_many(l, NULL, 1, NULL, &lease, &err),
			 KL_EINVAL);
	ck_assert_ptr_null(lease);
	ck_assert(strstr(err.message, "at least one key") != NULL);
	ck_assert_int_eq(kl_lock_acquire_many(l, one, 0, NULL, &lease, &err),
			 KL_EINVAL);
	ck_assert(strstr(err.message, "at least one key") != NULL);
	ck_assert_int_eq(kl_lock_acquire_many(l, with_null, 2, NULL, &lease,
					      &err),
			 KL_EINVAL);
	ck_assert_msg(strstr(err.message, "key 1") != NULL, "%s", err.message);
	ck_assert_int_eq(kl_lock_acquire_many(own, one, 1, NULL, &lease, &err),
			 KL_EINVAL);
	ck_assert(strstr(err.message, "its own key") != NULL);
	ck_assert_int_eq(kl_lock_acquire_many(NULL, one, 1, NULL, &lease,
					      &err),
			 KL_EINVAL);
	ck_assert_int_eq(kl_lock_acquire_many(l, one, 1, NULL, NULL, &err),
			 KL_EINVAL);
	ck_assert_int_eq(kl_lock_run_many(l, with_null, 2, NULL, fn_set_seen,
					  &s, NULL, &err),
			 KL_EINVAL);
	ck_assert_int_eq(kl_lock_run_many(own, one, 1, NULL, fn_set_seen, &s,
					  NULL, &err),
			 KL_EINVAL);
	ck_assert_int_eq(kl_lock_run_many(l, one, 1, NULL, NULL, NULL, NULL,
					  &err),
			 KL_EINVAL);
	ck_assert_int_eq(s.calls, 0);
	ck_assert(key_free(p, "x"));
	ck_assert_uint_eq(kl_memory_provider_size(p), 0);
	kl_lock_free(own);
	kl_lock_free(l);
	kl_provider_free(p);
}
END_TEST

/* Another holder keeps the second key: the set times out, the first key is
 * released again (its events say so), no lease exists, the message and the
 * one REJECTED event name the key that failed. */
START_TEST(test_many_timeout_all_or_nothing)
{
	static const char *const keys[] = { "t2", "t1" };
	kl_provider *p = private_provider();
	kl_lock *hold = lock_make(p, "t2", KL_FOREVER, 0, NULL, NULL);
	kl_lease *held = NULL, *lease = (kl_lease *)&lease;
	struct set_seen s = { 0 };
	struct evlog g;
	kl_error err;
	kl_lock *l;

	evlog_init(&g);
	l = lock_make(p, NULL, 100, 0, evlog_fn, &g);
	ck_assert_int_eq(kl_lock_acquire(hold, NULL, &held, NULL), KL_OK);
	ck_assert_int_eq(kl_lock_acquire_many(l, keys, 2, NULL, &lease, &err),
			 KL_ETIMEDOUT);
	ck_assert_ptr_null(lease);
	ck_assert_msg(strstr(err.message, "'t2'") != NULL, "%s", err.message);
	ck_assert(key_free(p, "t1"));
	ck_assert_int_eq(g.n, 3);
	check_event(&g, 0, KL_EV_ACQUIRED, "t1", KL_OK);
	check_event(&g, 1, KL_EV_REJECTED, "t2", KL_ETIMEDOUT);
	check_event(&g, 2, KL_EV_RELEASED, "t1", KL_OK);

	ck_assert_int_eq(kl_lock_run_many(l, keys, 2, NULL, fn_set_seen, &s,
					  NULL, NULL),
			 KL_ETIMEDOUT);
	ck_assert_int_eq(s.calls, 0);
	ck_assert(key_free(p, "t1"));
	ck_assert_int_eq(g.n, 6);
	kl_lease_release(held);
	ck_assert_uint_eq(kl_memory_provider_size(p), 0);
	kl_lock_free(hold);
	kl_lock_free(l);
	kl_provider_free(p);
	evlog_fini(&g);
}
END_TEST

struct set_call {
	pthread_t th;
	kl_lock *l;
	const char *const *keys;
	size_t n;
	kl_cancel *cancel;
	struct set_seen seen;
	int rc;
	int64_t start_ns, end_ns;
};

static void *
set_call_main(void *arg)
{
	struct set_call *c = arg;

	c->start_ns = now_ns();
	c->rc = kl_lock_run_many(c->l, c->keys, c->n, c->cancel, fn_set_seen,
				 &c->seen, NULL, NULL);
	c->end_ns = now_ns();
	return NULL;
}

/* A set waiting for its second key while it holds the first is cancelled:
 * KL_ECANCELED, fn not called, the first key free again. */
START_TEST(test_many_cancel_all_or_nothing)
{
	static const char *const keys[] = { "c2", "c1" };
	kl_provider *p = private_provider();
	kl_lock *hold = lock_make(p, "c2", KL_FOREVER, 0, NULL, NULL);
	kl_lease *held = NULL;
	struct set_call c = { .keys = keys, .n = 2 };

	c.l = lock_make(p, NULL, KL_FOREVER, 0, NULL, NULL);
	ck_assert_int_eq(kl_cancel_new(&c.cancel), KL_OK);
	ck_assert_int_eq(kl_lock_acquire(hold, NULL, &held, NULL), KL_OK);
	test_thread_start(&c.th, set_call_main, &c);
	wait_queue(p, "c2", 1); /* it holds c1 and waits for c2 */
	ck_assert(!key_free(p, "c1"));
	kl_cancel_fire(c.cancel);
	test_thread_join(c.th);
	ck_assert_int_eq(c.rc, KL_ECANCELED);
	ck_assert_int_eq(c.seen.calls, 0);
	ck_assert(key_free(p, "c1"));
	kl_lease_release(held);
	ck_assert_uint_eq(kl_memory_provider_size(p), 0);
	kl_cancel_free(c.cancel);
	kl_lock_free(hold);
	kl_lock_free(c.l);
	kl_provider_free(p);
}
END_TEST

/* A provider that fails on the second key of a set: KL_EPROVIDER with its
 * message, the first key released, nothing held; and a set lease is valid
 * only while every key's lease is. */
START_TEST(test_many_provider_failure)
{
	static const char *const keys[] = { "p3", "p1", "p2" };
	struct set_seen s = { 0 };
	kl_lease *lease = (kl_lease *)&lease;
	struct evlog g;
	struct fp f;
	kl_provider *p;
	kl_error err;
	kl_lock *l;

	evlog_init(&g);
	p = fp_new(&f);
	l = lock_make(p, NULL, KL_FOREVER, 0, evlog_fn, &g);
	f.fail_at = 2;
	ck_assert_int_eq(kl_lock_acquire_many(l, keys, 3, NULL, &lease, &err),
			 KL_EPROVIDER);
	ck_assert_ptr_null(lease);
	ck_assert_msg(strstr(err.message, "fp: refused") != NULL &&
			      strstr(err.message, "'p2'") != NULL,
		      "%s", err.message);
	ck_assert_int_eq(f.held, 0);
	ck_assert_int_eq(f.releases, 1);
	ck_assert_int_eq(g.n, 3);
	check_event(&g, 0, KL_EV_ACQUIRED, "p1", KL_OK);
	check_event(&g, 1, KL_EV_REJECTED, "p2", KL_EPROVIDER);
	check_event(&g, 2, KL_EV_RELEASED, "p1", KL_OK);

	f.fail_at = 5; /* the second key of the next run */
	ck_assert_int_eq(kl_lock_run_many(l, keys, 3, NULL, fn_set_seen, &s,
					  NULL, NULL),
			 KL_EPROVIDER);
	ck_assert_int_eq(s.calls, 0);
	ck_assert_int_eq(f.held, 0);

	f.fail_at = 0;
	ck_assert_int_eq(kl_lock_acquire_many(l, keys, 3, NULL, &lease, NULL),
			 KL_OK);
	ck_assert_int_eq(f.held, 3);
	ck_assert(kl_lease_valid(lease));
	atomic_store(&f.lost_at, f.acquires - 1); /* p2's lease */
	ck_assert(!kl_lease_valid(lease));
	kl_lease_release(lease);
	ck_assert_int_eq(f.held, 0);
	kl_lock_free(l);
	kl_provider_free(p);
	evlog_fini(&g);
}
END_TEST

struct timed_release {
	pthread_t th;
	int64_t start_ns;
	kl_lease *first, *second;
	int64_t first_ms, second_ms;
};

static void *
timed_release_main(void *arg)
{
	struct timed_release *t = arg;
	int64_t d;

	if ((d = t->start_ns / 1000000 + t->first_ms - now_ms()) > 0)
		test_sleep_ms(d);
	kl_lease_release(t->first);
	if ((d = t->start_ns / 1000000 + t->second_ms - now_ms()) > 0)
		test_sleep_ms(d);
	kl_lease_release(t->second);
	return NULL;
}

/* One deadline for the set: d1 is freed after 500 of the 1000 ms and d2
 * after 1400 ms.  A set that gave each key the whole timeout would get d2
 * (at 1400 < 500 + 1000); with one deadline it times out on d2, which is
 * released only after the deadline whatever the load, never early. */
START_TEST(test_many_one_deadline)
{
	static const char *const keys[] = { "d2", "d1" };
	kl_provider *p = private_provider();
	kl_lock *h1 = lock_make(p, "d1", KL_FOREVER, 0, NULL, NULL);
	kl_lock *h2 = lock_make(p, "d2", KL_FOREVER, 0, NULL, NULL);
	struct timed_release t = { .first_ms = 500, .second_ms = 1400 };
	struct set_seen s = { 0 };
	kl_lock *l = lock_make(p, NULL, 1000, 0, NULL, NULL);
	int64_t start;
	int rc;

	ck_assert_int_eq(kl_lock_acquire(h1, NULL, &t.first, NULL), KL_OK);
	ck_assert_int_eq(kl_lock_acquire(h2, NULL, &t.second, NULL), KL_OK);
	start = t.start_ns = now_ns();
	test_thread_start(&t.th, timed_release_main, &t);
	rc = kl_lock_run_many(l, keys, 2, NULL, fn_set_seen, &s, NULL, NULL);
	ck_assert_int_eq(rc, KL_ETIMEDOUT);
	ck_assert_int_eq(s.calls, 0);
	ck_assert_int_ge(now_ns() - start, 1000 * INT64_C(1000000));
	test_thread_join(t.th);
	ck_assert(key_free(p, "d1") && key_free(p, "d2"));
	ck_assert_uint_eq(kl_memory_provider_size(p), 0);
	kl_lock_free(l);
	kl_lock_free(h1);
	kl_lock_free(h2);
	kl_provider_free(p);
}
END_TEST

/* Events per key: ACQUIRED in canonical order, RELEASED in reverse. */
START_TEST(test_many_events)
{
	static const char *const keys[] = { "e2", "e1", "e2" };
	kl_provider *p = private_provider();
	struct set_seen s = { 0 };
	struct evlog g;
	kl_lease *lease = NULL;
	kl_lock *l;

	evlog_init(&g);
	l = lock_make(p, NULL, KL_FOREVER, 0, evlog_fn, &g);
	ck_assert_int_eq(kl_lock_run_many(l, keys, 3, NULL, fn_set_seen, &s,
					  NULL, NULL),
			 KL_OK);
	ck_assert_int_eq(g.n, 4);
	check_event(&g, 0, KL_EV_ACQUIRED, "e1", KL_OK);
	check_event(&g, 1, KL_EV_ACQUIRED, "e2", KL_OK);
	check_event(&g, 2, KL_EV_RELEASED, "e2", KL_OK);
	check_event(&g, 3, KL_EV_RELEASED, "e1", KL_OK);
	ck_assert_int_eq(kl_lock_acquire_many(l, keys, 3, NULL, &lease, NULL),
			 KL_OK);
	ck_assert_int_eq(g.n, 6);
	kl_lease_release(lease);
	ck_assert_int_eq(g.n, 8);
	check_event(&g, 6, KL_EV_RELEASED, "e2", KL_OK);
	check_event(&g, 7, KL_EV_RELEASED, "e1", KL_OK);
	kl_lock_free(l);
	kl_provider_free(p);
	evlog_fini(&g);
}
END_TEST

/* fn releasing the set it was lent: KL_EINVAL, every key held until fn
 * returns, then released. */
START_TEST(test_many_fn_releases)
{
	static const char *const keys[] = { "r1", "r2" };
	kl_provider *p = private_provider();
	kl_lock *l = lock_make(p, NULL, KL_FOREVER, 0, NULL, NULL);
	struct set_seen s = { .p = p, .release_it = true };
	int res = 0;

	ck_assert_int_eq(kl_lock_run_many(l, keys, 2, NULL, fn_set_seen, &s,
					  &res, NULL),
			 KL_EINVAL);
	ck_assert_int_eq(res, 11);
	ck_assert(s.all_held);
	ck_assert(key_free(p, "r1") && key_free(p, "r2"));
	kl_lock_free(l);
	kl_provider_free(p);
}
END_TEST

/* ABBA from many threads: sets of 2 or 3 of 4 keys in random orders (and
 * single-key runs between them), every wait without a timeout, so that a
 * deadlock would hang; a watchdog fails the test instead.  Inside, each
 * key's plain counter must be 0 on entry (exclusion). */
#define ABBA_THREADS 8
#define ABBA_KEYS 4

struct abba {
	kl_provider *p;
	kl_lock *l;
	long iters;
	int inside[ABBA_KEYS];
	long total[ABBA_KEYS];
	atomic_long violations, errors, done;
};

struct abba_worker {
	pthread_t th;
	struct abba *a;
	unsigned seed;
};

static const char *const abba_keys[ABBA_KEYS] = { "k0", "k1", "k2", "k3" };

static int
abba_fn(kl_lease *lease, void *arg)
{
	struct abba *a = arg;
	size_t n = kl_lease_count(lease);

	for (size_t i = 0; i < n; i++) {
		int k = kl_lease_key_at(lease, i)[1] - '0';

		if (a->inside[k]++ != 0)
			atomic_fetch_add(&a->violations, 1);
	}
	for (size_t i = 0; i < n; i++) {
		int k = kl_lease_key_at(lease, i)[1] - '0';

		a->total[k]++;
		if (--a->inside[k] != 0)
			atomic_fetch_add(&a->violations, 1);
	}
	return 0;
}

static void *
abba_main(void *arg)
{
	struct abba_worker *w = arg;
	struct abba *a = w->a;

	for (long it = 0; it < a->iters; it++) {
		const char *keys[3];
		size_t n = 2 + rand_r(&w->seed) % 2;
		int rc;

		for (size_t i = 0; i < n; i++)
			keys[i] = abba_keys[rand_r(&w->seed) % ABBA_KEYS];
		rc = kl_lock_run_many(a->l, keys, n, NULL, abba_fn, a, NULL,
				      NULL);
		if (rc != KL_OK)
			atomic_fetch_add(&a->errors, 1);
	}
	atomic_fetch_add(&a->done, 1);
	return NULL;
}

START_TEST(test_many_abba_no_deadlock)
{
	struct abba_worker w[ABBA_THREADS];
	struct abba *a = calloc(1, sizeof *a);
	int64_t limit;

	ck_assert_ptr_nonnull(a);
	a->p = private_provider();
	a->l = lock_make(a->p, NULL, KL_FOREVER, 0, NULL, NULL);
	a->iters = kl_test_scaled(4000, 200);
	for (int i = 0; i < ABBA_THREADS; i++) {
		w[i].a = a;
		w[i].seed = (unsigned)(i * 7919 + (int)(now_ns() & 0xffff));
		test_thread_start(&w[i].th, abba_main, &w[i]);
	}
	/* The watchdog: a deadlock would keep done below the count. */
	limit = now_ms() + 240000;
	while (atomic_load(&a->done) < ABBA_THREADS && now_ms() < limit)
		test_sleep_ms(20);
	ck_assert_msg(atomic_load(&a->done) == ABBA_THREADS,
		      "key sets deadlocked: %ld of %d threads finished",
		      atomic_load(&a->done), ABBA_THREADS);
	for (int i = 0; i < ABBA_THREADS; i++)
		test_thread_join(w[i].th);
	ck_assert_int_eq(atomic_load(&a->errors), 0);
	ck_assert_int_eq(atomic_load(&a->violations), 0);
	ck_assert_uint_eq(kl_memory_provider_size(a->p), 0);
	kl_lock_free(a->l);
	kl_provider_free(a->p);
	free(a);
}
END_TEST

/* ------------------------------------------------------------------ */

static Suite *
lock_suite(void)
{
	Suite *s = suite_create("lock");
	TCase *tc;

	tc = tcase_create("keys");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_same_key_excludes);
	tcase_add_test(tc, test_lock_key_wins);
	tcase_add_test(tc, test_call_key_used);
	tcase_add_test(tc, test_no_key);
	tcase_add_test(tc, test_new_copies_opts_and_key);
	tcase_add_test(tc, test_new_rejects_bad_opts);
	suite_add_tcase(s, tc);

	tc = tcase_create("order");
	/* test_asks_again_spins_behind's hooks, also after it failed
	 * without fork. */
	tcase_add_checked_fixture(tc, NULL, test_spin_reset);
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_grants_in_arrival_order);
	tcase_add_test(tc, test_grant_prods_parked_new_head);
	tcase_add_test(tc, test_asks_again_spins_behind);
	tcase_add_test(tc, test_spin_learns);
	suite_add_tcase(s, tc);

	tc = tcase_create("timeout_cancel");
	tcase_set_timeout(tc, 300);
	tcase_add_test(tc, test_timeout_rejected);
	tcase_add_test(tc, test_cancel_during_wait);
	tcase_add_test(tc, test_cancel_races_grant);
	suite_add_tcase(s, tc);

	tc = tcase_create("events");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_acquired_released_events);
	tcase_add_test(tc, test_events_without_internal_lock);
	suite_add_tcase(s, tc);

	tc = tcase_create("run_and_leases");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_run_releases_on_every_path);
	tcase_add_test(tc, test_release_from_another_thread);
	tcase_add_test(tc, test_fence_grows);
	tcase_add_test(tc, test_lease_kinds_hand_off);
	suite_add_tcase(s, tc);

	tc = tcase_create("reentry");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_nested_same_key_times_out);
	tcase_add_test(tc, test_nested_errorcheck_deadlk);
	suite_add_tcase(s, tc);

	tc = tcase_create("provider_failures");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_cancel_waits_for_provider_call);
	tcase_add_test(tc, test_cancel_pending_open_free);
	tcase_add_test(tc, test_release_failure_event);
	tcase_add_test(tc, test_acquire_failure_provider);
	suite_add_tcase(s, tc);

	tc = tcase_create("run_lease");
	tcase_set_timeout(tc, 300);
	tcase_add_test(tc, test_run_lease_gets_lease);
	tcase_add_test(tc, test_run_lease_releases_on_every_path);
	tcase_add_test(tc, test_run_lease_events);
	tcase_add_test(tc, test_run_lease_not_acquired);
	tcase_add_test(tc, test_run_lease_provider);
	tcase_add_test(tc, test_run_lease_fn_releases);
	tcase_add_test(tc, test_run_lease_fenced_store);
	suite_add_tcase(s, tc);

	tc = tcase_create("stress");
	tcase_set_timeout(tc, 900);
	tcase_add_test(tc, test_mutual_exclusion_stress);
	suite_add_tcase(s, tc);

	tc = tcase_create("key sets");
	tcase_set_timeout(tc, 300);
	tcase_add_test(tc, test_many_canonical_order);
	tcase_add_test(tc, test_many_einval);
	tcase_add_test(tc, test_many_timeout_all_or_nothing);
	tcase_add_test(tc, test_many_cancel_all_or_nothing);
	tcase_add_test(tc, test_many_provider_failure);
	tcase_add_test(tc, test_many_one_deadline);
	tcase_add_test(tc, test_many_events);
	tcase_add_test(tc, test_many_fn_releases);
	tcase_add_test(tc, test_many_abba_no_deadlock);
	suite_add_tcase(s, tc);

	return s;
}

int
main(void)
{
	return test_run_suite(lock_suite());
}
