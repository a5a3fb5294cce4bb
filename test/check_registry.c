/* SPDX-License-Identifier: MIT */
/*
 * Tests of the Wrapper (kl_registry, kl_named_*): named locks that persist,
 * the process-wide registry behind NULL, exclusion and FIFO order of
 * kl_named_run, is_locked / exists / queue_size as the holder sees them,
 * options (defaults, get, set creating a name, lowering max_queue evicting
 * at once), removal while in use, timeouts, cancellation and bad arguments.
 *
 * Worker threads never call ck_assert*: inside the section they record what
 * they saw, and the test's thread asserts after joining them.  Orders are
 * forced by polling kl_named_queue_size and flags the workers set, never by
 * sleeping.
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

#include "keylock.h"
#include "util.h"

/* ------------------------------------------------------------------ */
/* A thread in kl_named_run(_cancel)                                   */

struct nw {
	pthread_t th;
	kl_registry *r;
	const char *name;
	int64_t timeout_ms;
	kl_cancel *c;
	atomic_int *next_seq; /* grant ranks, may be NULL */
	atomic_int *inside;   /* threads in the section, may be NULL */
	atomic_bool *gate;    /* fn waits for it, may be NULL */
	/* Outputs. */
	int rc;
	int seq;
	int ran;
	int fn_result;
	bool overlap;       /* another thread was in the section */
	bool locked_inside; /* kl_named_is_locked in the section */
	size_t queue_inside; /* kl_named_queue_size in the section */
	atomic_bool entered;
	atomic_bool done;
};

static int
nw_fn(void *arg)
{
	struct nw *w = arg;
	unsigned spins = 0;

	if (w->inside != NULL && atomic_fetch_add(w->inside, 1) != 0)
		w->overlap = true;
	if (w->next_seq != NULL)
		w->seq = atomic_fetch_add(w->next_seq, 1);
	w->ran++;
	atomic_store(&w->entered, true);
	if (w->gate != NULL) {
		while (!atomic_load(w->gate))
			test_relax(&spins);
	}
	w->locked_inside = kl_named_is_locked(w->r, w->name);
	w->queue_inside = kl_named_queue_size(w->r, w->name);
	if (w->inside != NULL)
		atomic_fetch_sub(w->inside, 1);
	return 5;
}

static void *
nw_main(void *arg)
{
	struct nw *w = arg;

	w->rc = kl_named_run_cancel(w->r, w->name, w->timeout_ms, w->c, nw_fn,
				    w, &w->fn_result);
	atomic_store(&w->done, true);
	return NULL;
}

static void
nw_start(struct nw *w, kl_registry *r, const char *name, int64_t timeout_ms)
{
	w->r = r;
	w->name = name;
	w->timeout_ms = timeout_ms;
	w->rc = 1; /* no KL_* value: never returned */
	w->seq = -1;
	w->ran = 0;
	w->overlap = false;
	atomic_init(&w->entered, false);
	atomic_init(&w->done, false);
	test_thread_start(&w->th, nw_main, w);
}

static bool
nw_entered(void *arg)
{
	struct nw *w = arg;

	return atomic_load(&w->entered);
}

static bool
nw_done(void *arg)
{
	struct nw *w = arg;

	return atomic_load(&w->done);
}

static void
nw_join(struct nw *w)
{
	test_poll(nw_done, w, "a named-lock thread to finish");
	test_thread_join(w->th);
}

struct qcond {
	kl_registry *r;
	const char *name;
	size_t n;
};

static bool
queue_is(void *arg)
{
	struct qcond *c = arg;

	return kl_named_queue_size(c->r, c->name) == c->n;
}

static void
wait_queue(kl_registry *r, const char *name, size_t n)
{
	struct qcond c = { .r = r, .name = name, .n = n };

	test_poll(queue_is, &c, "the named lock's queue size");
}

/* Starts a thread that takes name and holds it until *gate is set. */
static void
hold(struct nw *h, kl_registry *r, const char *name, atomic_bool *gate)
{
	memset(h, 0, sizeof *h);
	h->gate = gate;
	nw_start(h, r, name, KL_FOREVER);
	test_poll(nw_entered, h, "the holder to enter");
}

static kl_registry *
registry_new(void)
{
	kl_registry *r = NULL;

	ck_assert_int_eq(kl_registry_new(&r), KL_OK);
	ck_assert_ptr_nonnull(r);
	return r;
}

static int
fn_count(void *arg)
{
	atomic_fetch_add((atomic_int *)arg, 1);
	return 9;
}

static void
assert_opts_eq(const kl_queue_opts *a, const kl_queue_opts *b)
{
	ck_assert_uint_eq(a->max_queue, b->max_queue);
	ck_assert_int_eq(a->overflow, b->overflow);
	ck_assert_uint_eq(a->flags, b->flags);
}

/* ------------------------------------------------------------------ */
/* Running under a named lock                                          */

START_TEST(test_null_registry_is_process_wide)
{
	const char *name = "registry:global";
	kl_registry *r = registry_new();
	atomic_int ran = 0;

	ck_assert(!kl_named_exists(NULL, name));
	ck_assert_int_eq(kl_named_run(NULL, name, KL_FOREVER, fn_count, &ran,
				      NULL),
			 KL_OK);
	ck_assert_int_eq(atomic_load(&ran), 1);
	ck_assert(kl_named_exists(NULL, name));
	ck_assert(!kl_named_exists(r, name)); /* a private one is apart */
	ck_assert_int_eq(kl_named_remove(NULL, name), KL_OK);
	ck_assert(!kl_named_exists(NULL, name));
	kl_registry_free(r);
	kl_registry_free(NULL);
}
END_TEST

START_TEST(test_private_registries_independent)
{
	kl_registry *a = registry_new(), *b = registry_new();
	atomic_bool gate = false;
	atomic_int ran = 0;
	struct nw h;

	hold(&h, a, "same", &gate);
	ck_assert_int_eq(kl_named_run(b, "same", 0, fn_count, &ran, NULL),
			 KL_OK);
	ck_assert_int_eq(kl_named_run(a, "same", 0, fn_count, &ran, NULL),
			 KL_ETIMEDOUT);
	ck_assert_int_eq(atomic_load(&ran), 1);
	atomic_store(&gate, true);
	nw_join(&h);
	ck_assert_int_eq(h.rc, KL_OK);
	kl_registry_free(a);
	kl_registry_free(b);
}
END_TEST

#define FIFO_N 6

/* One holder, then waiters queued one at a time: they run one by one, in
 * arrival order, and each sees the lock held and the waiters behind it. */
START_TEST(test_run_excludes_in_fifo_order)
{
	kl_registry *r = registry_new();
	atomic_int next = 0, inside = 0;
	atomic_bool gate = false;
	struct nw h, w[FIFO_N];

	memset(w, 0, sizeof w);
	hold(&h, r, "fifo", &gate);
	ck_assert(kl_named_is_locked(r, "fifo"));
	for (int i = 0; i < FIFO_N; i++) {
		w[i].next_seq = &next;
		w[i].inside = &inside;
		nw_start(&w[i], r, "fifo", 30000);
		wait_queue(r, "fifo", (size_t)i + 1);
	}
	for (int i = 0; i < FIFO_N; i++)
		ck_assert_int_eq(w[i].ran, 0);
	atomic_store(&gate, true);
	nw_join(&h);
	for (int i = 0; i < FIFO_N; i++)
		nw_join(&w[i]);
	ck_assert_int_eq(h.rc, KL_OK);
	/* The holder measured after every waiter had queued. */
	ck_assert(h.locked_inside);
	ck_assert_uint_eq(h.queue_inside, FIFO_N);
	for (int i = 0; i < FIFO_N; i++) {
		ck_assert_int_eq(w[i].rc, KL_OK);
		ck_assert_int_eq(w[i].ran, 1);
		ck_assert_int_eq(w[i].fn_result, 5);
		ck_assert_int_eq(w[i].seq, i);
		ck_assert(!w[i].overlap);
		ck_assert(w[i].locked_inside);
		ck_assert_uint_eq(w[i].queue_inside, (size_t)(FIFO_N - 1 - i));
	}
	ck_assert(!kl_named_is_locked(r, "fifo"));
	ck_assert_uint_eq(kl_named_queue_size(r, "fifo"), 0);
	kl_registry_free(r);
}
END_TEST

struct probe {
	kl_registry *r;
	const char *name;
	bool locked;
	bool exists;
	size_t queue;
	int remove_rc;
};

static int
probe_fn(void *arg)
{
	struct probe *p = arg;

	p->locked = kl_named_is_locked(p->r, p->name);
	p->exists = kl_named_exists(p->r, p->name);
	p->queue = kl_named_queue_size(p->r, p->name);
	p->remove_rc = kl_named_remove(p->r, p->name);
	return -3;
}

/* exists is false before the first use and stays true after it; is_locked
 * is true inside only; asking creates nothing. */
START_TEST(test_exists_and_is_locked)
{
	kl_registry *r = registry_new();
	struct probe p = { .r = r, .name = "n" };
	int res = 0;

	ck_assert(!kl_named_exists(r, "n"));
	ck_assert(!kl_named_is_locked(r, "n"));
	ck_assert_uint_eq(kl_named_queue_size(r, "n"), 0);
	ck_assert(!kl_named_exists(r, "n"));

	ck_assert_int_eq(kl_named_run(r, "n", KL_FOREVER, probe_fn, &p, &res),
			 KL_OK);
	ck_assert_int_eq(res, -3);
	ck_assert(p.locked);
	ck_assert(p.exists);
	ck_assert_uint_eq(p.queue, 0);
	ck_assert_int_eq(p.remove_rc, KL_EINVAL); /* held: in use */
	ck_assert(kl_named_exists(r, "n"));
	ck_assert(!kl_named_is_locked(r, "n"));
	/* fn_result may be NULL. */
	ck_assert_int_eq(kl_named_run(r, "n", 0, probe_fn, &p, NULL), KL_OK);
	ck_assert(kl_named_exists(r, "n"));
	kl_registry_free(r);
}
END_TEST

START_TEST(test_run_bad_arguments)
{
	kl_registry *r = registry_new();
	atomic_int ran = 0;

	ck_assert_int_eq(kl_named_run(r, NULL, KL_FOREVER, fn_count, &ran,
				      NULL),
			 KL_EINVAL);
	ck_assert_int_eq(kl_named_run(NULL, NULL, KL_FOREVER, fn_count, &ran,
				      NULL),
			 KL_EINVAL);
	ck_assert_int_eq(kl_named_run(r, "bad", -2, fn_count, &ran, NULL),
			 KL_EINVAL);
	ck_assert_int_eq(kl_named_run(r, "bad", INT64_MIN, fn_count, &ran,
				      NULL),
			 KL_EINVAL);
	ck_assert_int_eq(atomic_load(&ran), 0);
	ck_assert(!kl_named_exists(r, "bad"));
	ck_assert(!kl_named_exists(r, NULL));
	ck_assert(!kl_named_is_locked(r, NULL));
	ck_assert_uint_eq(kl_named_queue_size(r, NULL), 0);
	kl_registry_free(r);
}
END_TEST

START_TEST(test_run_timeout)
{
	kl_registry *r = registry_new();
	atomic_bool gate = false;
	atomic_int ran = 0;
	int64_t t0, t1;
	struct nw h;

	hold(&h, r, "t", &gate);
	t0 = now_ns();
	ck_assert_int_eq(kl_named_run(r, "t", 50, fn_count, &ran, NULL),
			 KL_ETIMEDOUT);
	t1 = now_ns();
	ck_assert_int_ge(t1 - t0, 50 * 1000000LL); /* never early */
	ck_assert_int_lt(t1 - t0, 5000 * 1000000LL);
	ck_assert_uint_eq(kl_named_queue_size(r, "t"), 0);
	ck_assert_int_eq(kl_named_run(r, "t", 0, fn_count, &ran, NULL),
			 KL_ETIMEDOUT);
	ck_assert_int_eq(atomic_load(&ran), 0);
	atomic_store(&gate, true);
	nw_join(&h);
	ck_assert_int_eq(kl_named_run(r, "t", 0, fn_count, &ran, NULL),
			 KL_OK);
	ck_assert_int_eq(atomic_load(&ran), 1);
	kl_registry_free(r);
}
END_TEST

START_TEST(test_run_cancel)
{
	kl_registry *r = registry_new();
	atomic_bool gate = false;
	atomic_int ran = 0;
	kl_cancel *fired, *c;
	struct nw h, w;

	ck_assert_int_eq(kl_cancel_new(&fired), KL_OK);
	ck_assert_int_eq(kl_cancel_new(&c), KL_OK);
	kl_cancel_fire(fired);
	/* A fired token: KL_ECANCELED at once, free or held. */
	ck_assert_int_eq(kl_named_run_cancel(r, "c", KL_FOREVER, fired,
					     fn_count, &ran, NULL),
			 KL_ECANCELED);
	hold(&h, r, "c", &gate);
	ck_assert_int_eq(kl_named_run_cancel(r, "c", KL_FOREVER, fired,
					     fn_count, &ran, NULL),
			 KL_ECANCELED);
	ck_assert_int_eq(atomic_load(&ran), 0);

	/* Fired during the wait: the waiter leaves the queue at once. */
	memset(&w, 0, sizeof w);
	w.c = c;
	nw_start(&w, r, "c", KL_FOREVER);
	wait_queue(r, "c", 1);
	kl_cancel_fire(c);
	nw_join(&w);
	ck_assert_int_eq(w.rc, KL_ECANCELED);
	ck_assert_int_eq(w.ran, 0);
	ck_assert_uint_eq(kl_named_queue_size(r, "c"), 0);
	ck_assert(kl_named_is_locked(r, "c"));
	atomic_store(&gate, true);
	nw_join(&h);
	ck_assert_int_eq(h.rc, KL_OK);
	ck_assert(!kl_named_is_locked(r, "c"));
	kl_cancel_free(fired);
	kl_cancel_free(c);
	kl_registry_free(r);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Options                                                             */

START_TEST(test_get_opts)
{
	kl_registry *r = registry_new();
	kl_queue_opts o, def;
	atomic_int ran = 0;

	ck_assert_int_eq(kl_named_get_opts(r, "o", &o), KL_ENOTFOUND);
	ck_assert(!kl_named_exists(r, "o"));
	ck_assert_int_eq(kl_named_run(r, "o", 0, fn_count, &ran, NULL),
			 KL_OK);
	kl_queue_opts_default(&def);
	memset(&o, 0x55, sizeof o);
	ck_assert_int_eq(kl_named_get_opts(r, "o", &o), KL_OK);
	assert_opts_eq(&o, &def);
	kl_registry_free(r);
}
END_TEST

/* set_opts creates a missing name with the defaults extended by the given
 * options (all of them, in C); NULL options create it with the defaults
 * (the reference's setOptions('foo')) and leave an existing one alone. */
START_TEST(test_set_opts_creates)
{
	kl_registry *r = registry_new();
	kl_queue_opts in = KL_QUEUE_OPTS_INIT, o, def;

	kl_queue_opts_default(&def);
	in.max_queue = 3;
	in.overflow = KL_OVERFLOW_FIRST;
	in.flags = KL_ERRORCHECK;
	ck_assert_int_eq(kl_named_set_opts(r, "s", &in), KL_OK);
	ck_assert(kl_named_exists(r, "s"));
	ck_assert(!kl_named_is_locked(r, "s"));
	ck_assert_int_eq(kl_named_get_opts(r, "s", &o), KL_OK);
	assert_opts_eq(&o, &in);

	/* Changing an existing name; KL_ERRORCHECK is fixed at creation
	 * (kl_mutex_set_opts): a change of it is refused, and changes
	 * nothing. */
	in.max_queue = 10;
	in.overflow = KL_OVERFLOW_LAST;
	in.flags = 0;
	ck_assert_int_eq(kl_named_set_opts(r, "s", &in), KL_EINVAL);
	ck_assert_int_eq(kl_named_get_opts(r, "s", &o), KL_OK);
	ck_assert_uint_eq(o.max_queue, 3);
	ck_assert_uint_eq(o.flags, KL_ERRORCHECK);
	in.flags = KL_ERRORCHECK;
	ck_assert_int_eq(kl_named_set_opts(r, "s", &in), KL_OK);
	ck_assert_int_eq(kl_named_get_opts(r, "s", &o), KL_OK);
	assert_opts_eq(&o, &in);
	ck_assert_int_eq(kl_named_set_opts(r, "s", NULL), KL_OK);
	ck_assert_int_eq(kl_named_get_opts(r, "s", &o), KL_OK);
	assert_opts_eq(&o, &in);

	ck_assert_int_eq(kl_named_set_opts(r, "d", NULL), KL_OK);
	ck_assert(kl_named_exists(r, "d"));
	ck_assert_int_eq(kl_named_get_opts(r, "d", &o), KL_OK);
	assert_opts_eq(&o, &def);

	/* Bad options change nothing. */
	in.overflow = (kl_overflow)99;
	ck_assert_int_eq(kl_named_set_opts(r, "s", &in), KL_EINVAL);
	ck_assert_int_eq(kl_named_set_opts(r, NULL, &in), KL_EINVAL);
	in.max_queue = 10;
	in.overflow = KL_OVERFLOW_LAST;
	ck_assert_int_eq(kl_named_get_opts(r, "s", &o), KL_OK);
	assert_opts_eq(&o, &in);
	kl_registry_free(r);
}
END_TEST

#define EVICT_N 4

/* Lowering max_queue evicts waiters at once (KL_EOVERFLOW, fn never runs):
 * THIS and LAST evict the newest, FIRST the oldest. */
static void
check_eviction(kl_overflow strategy)
{
	kl_registry *r = registry_new();
	kl_queue_opts in = KL_QUEUE_OPTS_INIT;
	atomic_bool gate = false;
	struct nw h, w[EVICT_N];
	int survivor = strategy == KL_OVERFLOW_FIRST ? EVICT_N - 1 : 0;

	memset(w, 0, sizeof w);
	hold(&h, r, "e", &gate);
	for (int i = 0; i < EVICT_N; i++) {
		nw_start(&w[i], r, "e", 30000);
		wait_queue(r, "e", (size_t)i + 1);
	}
	in.max_queue = 1;
	in.overflow = strategy;
	ck_assert_int_eq(kl_named_set_opts(r, "e", &in), KL_OK);
	ck_assert_uint_eq(kl_named_queue_size(r, "e"), 1);
	/* The evicted return while the holder still holds. */
	for (int i = 0; i < EVICT_N; i++) {
		if (i != survivor)
			nw_join(&w[i]);
	}
	ck_assert(!atomic_load(&w[survivor].done));
	atomic_store(&gate, true);
	nw_join(&h);
	nw_join(&w[survivor]);
	for (int i = 0; i < EVICT_N; i++) {
		if (i == survivor) {
			ck_assert_int_eq(w[i].rc, KL_OK);
			ck_assert_int_eq(w[i].ran, 1);
		} else {
			ck_assert_int_eq(w[i].rc, KL_EOVERFLOW);
			ck_assert_int_eq(w[i].ran, 0);
		}
	}
	ck_assert_uint_eq(kl_named_queue_size(r, "e"), 0);
	kl_registry_free(r);
}

START_TEST(test_set_opts_evicts_this)
{
	check_eviction(KL_OVERFLOW_THIS);
}
END_TEST

START_TEST(test_set_opts_evicts_last)
{
	check_eviction(KL_OVERFLOW_LAST);
}
END_TEST

START_TEST(test_set_opts_evicts_first)
{
	check_eviction(KL_OVERFLOW_FIRST);
}
END_TEST

/* New names take the process-wide defaults current at their creation. */
START_TEST(test_defaults_apply_to_new_names)
{
	kl_registry *r = registry_new();
	kl_queue_opts saved, mine = KL_QUEUE_OPTS_INIT, o;
	atomic_int ran = 0;

	kl_queue_opts_default(&saved);
	ck_assert_int_eq(kl_named_run(r, "before", 0, fn_count, &ran, NULL),
			 KL_OK);
	mine.max_queue = 7;
	mine.overflow = KL_OVERFLOW_LAST;
	mine.flags = 0;
	kl_queue_opts_set_default(&mine);

	ck_assert_int_eq(kl_named_run(r, "after", 0, fn_count, &ran, NULL),
			 KL_OK);
	ck_assert_int_eq(kl_named_get_opts(r, "after", &o), KL_OK);
	assert_opts_eq(&o, &mine);
	ck_assert_int_eq(kl_named_set_opts(r, "after2", NULL), KL_OK);
	ck_assert_int_eq(kl_named_get_opts(r, "after2", &o), KL_OK);
	assert_opts_eq(&o, &mine);
	/* An existing name keeps what it was made with. */
	ck_assert_int_eq(kl_named_get_opts(r, "before", &o), KL_OK);
	assert_opts_eq(&o, &saved);

	kl_queue_opts_set_default(&saved);
	ck_assert_int_eq(kl_named_run(r, "restored", 0, fn_count, &ran, NULL),
			 KL_OK);
	ck_assert_int_eq(kl_named_get_opts(r, "restored", &o), KL_OK);
	assert_opts_eq(&o, &saved);
	kl_registry_free(r);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Removal                                                             */

START_TEST(test_remove)
{
	kl_registry *r = registry_new();
	kl_queue_opts in = KL_QUEUE_OPTS_INIT, o, def;
	atomic_bool gate = false;
	struct nw h, w;

	kl_queue_opts_default(&def);
	ck_assert_int_eq(kl_named_remove(r, "x"), KL_ENOTFOUND);
	ck_assert_int_eq(kl_named_remove(r, NULL), KL_EINVAL);

	in.max_queue = 2;
	ck_assert_int_eq(kl_named_set_opts(r, "x", &in), KL_OK);
	ck_assert_int_eq(kl_named_remove(r, "x"), KL_OK);
	ck_assert(!kl_named_exists(r, "x"));
	ck_assert_int_eq(kl_named_get_opts(r, "x", &o), KL_ENOTFOUND);
	ck_assert_int_eq(kl_named_remove(r, "x"), KL_ENOTFOUND);

	/* Held by another thread, then also waited on: in use. */
	hold(&h, r, "x", &gate);
	ck_assert_int_eq(kl_named_remove(r, "x"), KL_EINVAL);
	memset(&w, 0, sizeof w);
	nw_start(&w, r, "x", 30000);
	wait_queue(r, "x", 1);
	ck_assert_int_eq(kl_named_remove(r, "x"), KL_EINVAL);
	ck_assert(kl_named_exists(r, "x"));
	atomic_store(&gate, true);
	nw_join(&h);
	nw_join(&w);
	ck_assert_int_eq(h.rc, KL_OK);
	ck_assert_int_eq(w.rc, KL_OK);

	/* Free again: removed, and a new use starts from the defaults. */
	ck_assert_int_eq(kl_named_remove(r, "x"), KL_OK);
	ck_assert(!kl_named_exists(r, "x"));
	ck_assert_int_eq(kl_named_set_opts(r, "x", NULL), KL_OK);
	ck_assert_int_eq(kl_named_get_opts(r, "x", &o), KL_OK);
	assert_opts_eq(&o, &def);
	kl_registry_free(r);
}
END_TEST

/* ------------------------------------------------------------------ */

static Suite *
registry_suite(void)
{
	Suite *s = suite_create("registry");
	TCase *tc;

	tc = tcase_create("run");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_null_registry_is_process_wide);
	tcase_add_test(tc, test_private_registries_independent);
	tcase_add_test(tc, test_run_excludes_in_fifo_order);
	tcase_add_test(tc, test_exists_and_is_locked);
	tcase_add_test(tc, test_run_bad_arguments);
	tcase_add_test(tc, test_run_timeout);
	tcase_add_test(tc, test_run_cancel);
	suite_add_tcase(s, tc);

	tc = tcase_create("options");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_get_opts);
	tcase_add_test(tc, test_set_opts_creates);
	tcase_add_test(tc, test_set_opts_evicts_this);
	tcase_add_test(tc, test_set_opts_evicts_last);
	tcase_add_test(tc, test_set_opts_evicts_first);
	tcase_add_test(tc, test_defaults_apply_to_new_names);
	suite_add_tcase(s, tc);

	tc = tcase_create("remove");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_remove);
	suite_add_tcase(s, tc);

	return s;
}

int
main(void)
{
	return test_run_suite(registry_suite());
}
