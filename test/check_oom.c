/* SPDX-License-Identifier: MIT */
/*
 * Allocation failure sweep.  For each scenario and k = 1, 2, ... the test
 * hook of src/internal.h (KL_TEST_HOOKS) fails the k-th allocation from
 * now; the scenario must return KL_ENOMEM with its outputs NULL (or absorb
 * the failure and return KL_OK), leave no trace behind, and an immediately
 * repeated run without failure must succeed.  The sweep ends once a run
 * succeeds having made fewer than k allocations.  Leaks are caught by
 * LeakSanitizer in the ASan stage, so every scenario frees what it made.
 *
 * The hook counts allocations of the whole process, so scenarios here are
 * single-threaded and set up everything they do not test before arming.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <check.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h" /* kl__test_fail_alloc_at only */
#include "keylock.h"
#include "util.h"

#ifndef KL_TEST_HOOKS
#error "check_oom needs -DKL_TEST_HOOKS and a library built with the hooks"
#endif

/* No scenario makes this many allocations: a sweep that gets here is
 * stuck. */
#define MAX_K 10000

/* A non-NULL value that outputs must be reset from. */
#define SENTINEL ((void *)&sentinel_storage)
static char sentinel_storage;

struct oom_ctx {
	/* Set up before arming, freed by teardown. */
	kl_provider *provider;
	kl_registry *registry;
	kl_lock *lock;
	kl_lock *other; /* a second lock, with held and held2 its leases */
	kl_lease *held, *held2;
	/* Outputs of the armed run. */
	kl_mutex *m;
	kl_reset_event *e;
	kl_cancel *c;
	kl_provider *p;
	kl_lease *lease;
	kl_error err;
	int fn_calls;
	int fn_result;
};

static void
sweep(const struct oom_scenario *s)
{
	long n, failures;

	test_oom_sweep(s, sizeof(struct oom_ctx), MAX_K, &n, &failures);
	fprintf(stderr, "%s: %ld allocations, %ld runs failed\n", s->name, n,
		failures);
}

/* ------------------------------------------------------------------ */
/* Objects                                                             */

static int
run_mutex_new(struct oom_ctx *x)
{
	kl_queue_opts o = KL_QUEUE_OPTS_INIT;
	int rc;

	o.max_queue = 4;
	x->m = SENTINEL;
	rc = kl_mutex_new(&x->m, &o);
	if (rc != KL_OK)
		ck_assert_ptr_null(x->m);
	return rc;
}

static void
teardown_mutex(struct oom_ctx *x)
{
	kl_token t;

	if (x->m != NULL) {
		/* The mutex made works. */
		ck_assert_int_eq(kl_mutex_try_enter(x->m, &t), KL_OK);
		ck_assert_int_eq(kl_mutex_leave(x->m, t, false), KL_OK);
	}
	kl_mutex_free(x->m);
}

START_TEST(test_oom_mutex_new)
{
	static const struct oom_scenario s = {
		.name = "kl_mutex_new",
		.run = run_mutex_new,
		.teardown = teardown_mutex,
	};

	sweep(&s);
}
END_TEST

static int
run_reset_event_new(struct oom_ctx *x)
{
	kl_reset_opts o = KL_RESET_OPTS_INIT;
	int rc;

	o.auto_reset_count = 2;
	x->e = SENTINEL;
	rc = kl_reset_event_new(&x->e, true, &o);
	if (rc != KL_OK)
		ck_assert_ptr_null(x->e);
	return rc;
}

static void
teardown_reset_event(struct oom_ctx *x)
{
	if (x->e != NULL)
		ck_assert_int_eq(kl_reset_event_wait(x->e, 0, NULL), KL_OK);
	kl_reset_event_free(x->e);
}

START_TEST(test_oom_reset_event_new)
{
	static const struct oom_scenario s = {
		.name = "kl_reset_event_new",
		.run = run_reset_event_new,
		.teardown = teardown_reset_event,
	};

	sweep(&s);
}
END_TEST

static int
run_cancel_new(struct oom_ctx *x)
{
	int rc;

	x->c = SENTINEL;
	rc = kl_cancel_new(&x->c);
	if (rc != KL_OK)
		ck_assert_ptr_null(x->c);
	return rc;
}

static void
teardown_cancel(struct oom_ctx *x)
{
	if (x->c != NULL) {
		kl_cancel_fire(x->c);
		ck_assert(kl_cancel_fired(x->c));
	}
	kl_cancel_free(x->c);
}

START_TEST(test_oom_cancel_new)
{
	static const struct oom_scenario s = {
		.name = "kl_cancel_new",
		.run = run_cancel_new,
		.teardown = teardown_cancel,
	};

	sweep(&s);
}
END_TEST

static int
run_cancel_new_timeout(struct oom_ctx *x)
{
	int rc;

	x->c = SENTINEL;
	rc = kl_cancel_new_timeout(&x->c, 60000);
	if (rc != KL_OK)
		ck_assert_ptr_null(x->c);
	else
		ck_assert(!kl_cancel_fired(x->c));
	return rc;
}

START_TEST(test_oom_cancel_new_timeout)
{
	static const struct oom_scenario s = {
		.name = "kl_cancel_new_timeout",
		.run = run_cancel_new_timeout,
		.teardown = teardown_cancel,
	};

	sweep(&s);
}
END_TEST

static int
run_cancel_new_timeout_zero(struct oom_ctx *x)
{
	int rc;

	x->c = SENTINEL;
	rc = kl_cancel_new_timeout(&x->c, 0);
	if (rc != KL_OK)
		ck_assert_ptr_null(x->c);
	else
		ck_assert(kl_cancel_fired(x->c));
	return rc;
}

START_TEST(test_oom_cancel_new_timeout_zero)
{
	static const struct oom_scenario s = {
		.name = "kl_cancel_new_timeout(0)",
		.run = run_cancel_new_timeout_zero,
		.teardown = teardown_cancel,
	};

	sweep(&s);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Registry                                                            */

static int
run_registry_set_opts(struct oom_ctx *x)
{
	kl_queue_opts o = KL_QUEUE_OPTS_INIT, got;
	int rc;

	x->registry = SENTINEL;
	rc = kl_registry_new(&x->registry);
	if (rc != KL_OK) {
		ck_assert_ptr_null(x->registry);
		return rc;
	}
	o.max_queue = 3;
	o.overflow = KL_OVERFLOW_LAST;
	rc = kl_named_set_opts(x->registry, "alpha", &o);
	if (rc != KL_OK)
		return rc;
	ck_assert(kl_named_exists(x->registry, "alpha"));
	ck_assert_int_eq(kl_named_get_opts(x->registry, "alpha", &got), KL_OK);
	ck_assert_uint_eq(got.max_queue, 3);
	ck_assert_int_eq(got.overflow, KL_OVERFLOW_LAST);
	return KL_OK;
}

static void
check_registry_failed(struct oom_ctx *x)
{
	kl_queue_opts got;

	if (x->registry == NULL)
		return;
	/* The name was not half made. */
	ck_assert(!kl_named_exists(x->registry, "alpha"));
	ck_assert_int_eq(kl_named_get_opts(x->registry, "alpha", &got),
			 KL_ENOTFOUND);
}

static void
teardown_registry(struct oom_ctx *x)
{
	kl_registry_free(x->registry);
}

START_TEST(test_oom_registry_set_opts)
{
	static const struct oom_scenario s = {
		.name = "kl_registry_new + kl_named_set_opts",
		.run = run_registry_set_opts,
		.check_failed = check_registry_failed,
		.teardown = teardown_registry,
	};

	sweep(&s);
}
END_TEST

static int
count_fn(void *arg)
{
	struct oom_ctx *x = arg;

	x->fn_calls++;
	return 42;
}

static void
setup_registry(struct oom_ctx *x)
{
	ck_assert_int_eq(kl_registry_new(&x->registry), KL_OK);
}

static int
run_named_run(struct oom_ctx *x)
{
	int rc;

	x->fn_result = -1;
	rc = kl_named_run(x->registry, "beta", KL_FOREVER, count_fn, x,
			  &x->fn_result);
	if (rc == KL_OK) {
		ck_assert_int_eq(x->fn_calls, 1);
		ck_assert_int_eq(x->fn_result, 42);
		ck_assert(!kl_named_is_locked(x->registry, "beta"));
	} else {
		ck_assert_int_eq(x->fn_calls, 0);
	}
	return rc;
}

static void
check_named_run_failed(struct oom_ctx *x)
{
	ck_assert(!kl_named_exists(x->registry, "beta"));
	ck_assert(!kl_named_is_locked(x->registry, "beta"));
}

START_TEST(test_oom_named_run)
{
	static const struct oom_scenario s = {
		.name = "kl_named_run",
		.setup = setup_registry,
		.run = run_named_run,
		.check_failed = check_named_run_failed,
		.teardown = teardown_registry,
	};

	sweep(&s);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Providers and locks                                                 */

static int
run_memory_provider_new(struct oom_ctx *x)
{
	int rc;

	x->p = SENTINEL;
	rc = kl_memory_provider_new(&x->p);
	if (rc != KL_OK)
		ck_assert_ptr_null(x->p);
	else
		ck_assert_uint_eq(kl_memory_provider_size(x->p), 0);
	return rc;
}

static void
teardown_provider(struct oom_ctx *x)
{
	kl_provider_free(x->p);
}

START_TEST(test_oom_memory_provider_new)
{
	static const struct oom_scenario s = {
		.name = "kl_memory_provider_new",
		.run = run_memory_provider_new,
		.teardown = teardown_provider,
	};

	sweep(&s);
}
END_TEST

static int
run_lock_new(struct oom_ctx *x)
{
	kl_lock_opts o = KL_LOCK_OPTS_INIT;
	char key[] = "a key that is copied";
	int rc;

	o.key = key;
	o.timeout_ms = 1000;
	x->lock = SENTINEL;
	rc = kl_lock_new(&x->lock, &o);
	if (rc != KL_OK)
		ck_assert_ptr_null(x->lock);
	memset(key, 'x', sizeof key - 1); /* the lock kept its own copy */
	return rc;
}

static void
teardown_lock(struct oom_ctx *x)
{
	kl_lock_free(x->lock);
	kl_provider_free(x->provider);
}

static void
teardown_lock_new(struct oom_ctx *x)
{
	kl_lease *lease;

	if (x->lock != NULL) {
		/* It locks its own copy of the key. */
		ck_assert_int_eq(kl_lock_acquire(x->lock, NULL, &lease, NULL),
				 KL_OK);
		ck_assert_str_eq(kl_lease_key(lease), "a key that is copied");
		kl_lease_release(lease);
	}
	kl_lock_free(x->lock);
}

static void
setup_lock_new(struct oom_ctx *x)
{
	/* The shared provider exists before arming. */
	ck_assert_ptr_nonnull(kl_memory_provider());
	(void)x;
}

START_TEST(test_oom_lock_new)
{
	static const struct oom_scenario s = {
		.name = "kl_lock_new",
		.setup = setup_lock_new,
		.run = run_lock_new,
		.teardown = teardown_lock_new,
	};

	sweep(&s);
}
END_TEST

/* A private provider and a lock without a key, made before arming. */
static void
setup_provider_lock(struct oom_ctx *x)
{
	kl_lock_opts o = KL_LOCK_OPTS_INIT;

	ck_assert_int_eq(kl_memory_provider_new(&x->provider), KL_OK);
	o.provider = x->provider;
	ck_assert_int_eq(kl_lock_new(&x->lock, &o), KL_OK);
}

static int
run_lock_acquire(struct oom_ctx *x)
{
	kl_call call = { .key = "gamma", .cancel = NULL };
	int rc;

	x->lease = SENTINEL;
	memset(&x->err, 0, sizeof x->err);
	rc = kl_lock_acquire(x->lock, &call, &x->lease, &x->err);
	if (rc != KL_OK) {
		ck_assert_ptr_null(x->lease);
		ck_assert_int_eq(x->err.status, rc);
		return rc;
	}
	ck_assert_uint_eq(kl_memory_provider_size(x->provider), 1);
	ck_assert_str_eq(kl_lease_key(x->lease), "gamma");
	ck_assert(kl_lease_valid(x->lease));
	kl_lease_release(x->lease);
	x->lease = NULL;
	ck_assert_uint_eq(kl_memory_provider_size(x->provider), 0);
	return KL_OK;
}

static void
check_provider_empty(struct oom_ctx *x)
{
	/* No entry was left behind for the key. */
	ck_assert_uint_eq(kl_memory_provider_size(x->provider), 0);
}

START_TEST(test_oom_lock_acquire)
{
	static const struct oom_scenario s = {
		.name = "kl_lock_acquire + kl_lease_release",
		.setup = setup_provider_lock,
		.run = run_lock_acquire,
		.check_failed = check_provider_empty,
		.teardown = teardown_lock,
	};

	sweep(&s);
}
END_TEST

/* The kl_lock_run* scenarios (one key or a set) make their armed call
 * between these two.  lock_run_begin: fn's result and err unset.
 * lock_run_end, with the call's status rc: on KL_OK fn ran once and
 * returned want; on a failure it never ran, its result is untouched and
 * err says rc; either way no key is left held.  It returns rc. */
static void
lock_run_begin(struct oom_ctx *x)
{
	x->fn_result = -1;
	memset(&x->err, 0, sizeof x->err);
}

static int
lock_run_end(struct oom_ctx *x, int rc, int want)
{
	if (rc == KL_OK) {
		ck_assert_int_eq(x->fn_calls, 1);
		ck_assert_int_eq(x->fn_result, want);
	} else {
		ck_assert_int_eq(x->fn_calls, 0);
		ck_assert_int_eq(x->fn_result, -1);
		ck_assert_int_eq(x->err.status, rc);
	}
	ck_assert_uint_eq(kl_memory_provider_size(x->provider), 0);
	return rc;
}

static int
run_lock_run(struct oom_ctx *x)
{
	kl_call call = { .key = "delta", .cancel = NULL };
	int rc;

	lock_run_begin(x);
	rc = kl_lock_run(x->lock, &call, count_fn, x, &x->fn_result, &x->err);
	return lock_run_end(x, rc, 42);
}

START_TEST(test_oom_lock_run)
{
	static const struct oom_scenario s = {
		.name = "kl_lock_run",
		.setup = setup_provider_lock,
		.run = run_lock_run,
		.check_failed = check_provider_empty,
		.teardown = teardown_lock,
	};

	sweep(&s);
}
END_TEST

static int
lease_fn(kl_lease *lease, void *arg)
{
	struct oom_ctx *x = arg;

	x->fn_calls++;
	/* fn is only called once the key is held: its lease is whole. */
	ck_assert_str_eq(kl_lease_key(lease), "epsilon: a key longer than "
					      "sixteen bytes");
	ck_assert(kl_lease_valid(lease));
	ck_assert_uint_gt(kl_lease_fence(lease), 0);
	return 43;
}

/* A key too long for a slot, so that its entry is allocated. */
static int
run_lock_run_lease(struct oom_ctx *x)
{
	kl_call call = {
		.key = "epsilon: a key longer than sixteen bytes",
		.cancel = NULL,
	};
	int rc;

	lock_run_begin(x);
	rc = kl_lock_run_lease(x->lock, &call, lease_fn, x, &x->fn_result,
			       &x->err);
	return lock_run_end(x, rc, 43);
}

START_TEST(test_oom_lock_run_lease)
{
	static const struct oom_scenario s = {
		.name = "kl_lock_run_lease",
		.setup = setup_provider_lock,
		.run = run_lock_run_lease,
		.check_failed = check_provider_empty,
		.teardown = teardown_lock,
	};

	sweep(&s);
}
END_TEST

/* Events, counted (the hook allocates nothing). */
static int hooked_events;

static void
count_event(const kl_event *ev, void *arg)
{
	(void)ev;
	(void)arg;
	hooked_events++;
}

/* As setup_provider_lock, with an event hook: the lease lent to fn is
 * then on run's stack, not in the key's entry. */
static void
setup_provider_hooked_lock(struct oom_ctx *x)
{
	kl_lock_opts o = KL_LOCK_OPTS_INIT;

	ck_assert_int_eq(kl_memory_provider_new(&x->provider), KL_OK);
	o.provider = x->provider;
	o.on_event = count_event;
	ck_assert_int_eq(kl_lock_new(&x->lock, &o), KL_OK);
	hooked_events = 0;
}

static int
run_lock_run_lease_hooked(struct oom_ctx *x)
{
	int rc = run_lock_run_lease(x);

	/* ACQUIRED and RELEASED, or REJECTED. */
	ck_assert_int_eq(hooked_events, rc == KL_OK ? 2 : 1);
	return rc;
}

START_TEST(test_oom_lock_run_lease_hooked)
{
	static const struct oom_scenario s = {
		.name = "kl_lock_run_lease with an event hook",
		.setup = setup_provider_hooked_lock,
		.run = run_lock_run_lease_hooked,
		.check_failed = check_provider_empty,
		.teardown = teardown_lock,
	};

	sweep(&s);
}
END_TEST

/* Key sets: three long keys (each entry allocated) given with a duplicate;
 * any failure leaves nothing held and no lease. */
static const char *const set_keys[] = {
	"zeta: a key longer than sixteen bytes",
	"eta: a key longer than sixteen bytes",
	"zeta: a key longer than sixteen bytes",
	"theta: a key longer than sixteen bytes",
};

static int
set_fn(kl_lease *lease, void *arg)
{
	struct oom_ctx *x = arg;

	x->fn_calls++;
	ck_assert_uint_eq(kl_lease_count(lease), 3);
	ck_assert_str_eq(kl_lease_key_at(lease, 0),
			 "eta: a key longer than sixteen bytes");
	ck_assert_uint_eq(kl_memory_provider_size(x->provider), 3);
	return 44;
}

static int
run_lock_run_many(struct oom_ctx *x)
{
	int rc;

	lock_run_begin(x);
	rc = kl_lock_run_many(x->lock, set_keys, 4, NULL, set_fn, x,
			      &x->fn_result, &x->err);
	return lock_run_end(x, rc, 44);
}

static int
run_lock_acquire_many(struct oom_ctx *x)
{
	int rc;

	x->lease = SENTINEL;
	memset(&x->err, 0, sizeof x->err);
	rc = kl_lock_acquire_many(x->lock, set_keys, 4, NULL, &x->lease,
				  &x->err);
	if (rc != KL_OK) {
		ck_assert_ptr_null(x->lease);
		ck_assert_int_eq(x->err.status, rc);
		ck_assert_uint_eq(kl_memory_provider_size(x->provider), 0);
		return rc;
	}
	ck_assert_uint_eq(kl_memory_provider_size(x->provider), 3);
	ck_assert_uint_eq(kl_lease_count(x->lease), 3);
	kl_lease_release(x->lease);
	x->lease = NULL;
	ck_assert_uint_eq(kl_memory_provider_size(x->provider), 0);
	return KL_OK;
}

START_TEST(test_oom_lock_run_many)
{
	static const struct oom_scenario s = {
		.name = "kl_lock_run_many",
		.setup = setup_provider_lock,
		.run = run_lock_run_many,
		.check_failed = check_provider_empty,
		.teardown = teardown_lock,
	};
	static const struct oom_scenario h = {
		.name = "kl_lock_run_many with an event hook",
		.setup = setup_provider_hooked_lock,
		.run = run_lock_run_many,
		.check_failed = check_provider_empty,
		.teardown = teardown_lock,
	};

	sweep(&s);
	sweep(&h);
}
END_TEST

START_TEST(test_oom_lock_acquire_many)
{
	static const struct oom_scenario s = {
		.name = "kl_lock_acquire_many + kl_lease_release",
		.setup = setup_provider_lock,
		.run = run_lock_acquire_many,
		.check_failed = check_provider_empty,
		.teardown = teardown_lock,
	};

	sweep(&s);
}
END_TEST

/* ------------------------------------------------------------------ */
/* KL_SHARED and snapshots on the memory provider                      */

/* A private provider and a KL_SHARED lock without a key. */
static void
setup_shared_lock(struct oom_ctx *x)
{
	kl_lock_opts o = KL_LOCK_OPTS_INIT;

	ck_assert_int_eq(kl_memory_provider_new(&x->provider), KL_OK);
	o.provider = x->provider;
	o.flags = KL_SHARED;
	ck_assert_int_eq(kl_lock_new(&x->lock, &o), KL_OK);
}

START_TEST(test_oom_shared_acquire)
{
	static const struct oom_scenario s = {
		.name = "kl_lock_acquire KL_SHARED + kl_lease_release",
		.setup = setup_shared_lock,
		.run = run_lock_acquire,
		.check_failed = check_provider_empty,
		.teardown = teardown_lock,
	};

	sweep(&s);
}
END_TEST

START_TEST(test_oom_shared_run_lease)
{
	static const struct oom_scenario s = {
		.name = "kl_lock_run_lease KL_SHARED, a chained key",
		.setup = setup_shared_lock,
		.run = run_lock_run_lease,
		.check_failed = check_provider_empty,
		.teardown = teardown_lock,
	};

	sweep(&s);
}
END_TEST

/* As setup_shared_lock, and another reader holds "gamma" and a long key
 * (a slot entry and a chained one) before arming. */
static void
setup_shared_held(struct oom_ctx *x)
{
	kl_call call = { .key = "gamma", .cancel = NULL };
	kl_lock_opts o = KL_LOCK_OPTS_INIT;
	setup_shared_lock(x);
	o.provider = x->provider;
	o.flags = KL_SHARED;
	ck_assert_int_eq(kl_lock_new(&x->other, &o), KL_OK);
	ck_assert_int_eq(kl_lock_acquire(x->other, &call, &x->held, NULL),
			 KL_OK);
	call.key = "gamma: a key too long for a slot";
	ck_assert_int_eq(kl_lock_acquire(x->other, &call, &x->held2, NULL),
			 KL_OK);
}

static void
teardown_shared_held(struct oom_ctx *x)
{
	kl_lease_release(x->held);
	kl_lease_release(x->held2);
	ck_assert_uint_eq(kl_memory_provider_size(x->provider), 0);
	kl_lock_free(x->other);
	teardown_lock(x);
}

static void
check_one_reader(struct oom_ctx *x)
{
	size_t h = 0, w = 0;

	ck_assert_int_eq(kl_provider_status(x->provider, "gamma", &h, &w,
					    NULL),
			 KL_OK);
	ck_assert_uint_eq(h, 1);
	ck_assert_uint_eq(w, 0);
	ck_assert_int_eq(kl__test_check_invariants(x->provider), KL_OK);
}

/* A second reader of a key held shared. */
static int
run_shared_beside(struct oom_ctx *x)
{
	kl_call call = { .key = "gamma", .cancel = NULL };
	size_t h = 0, w = 0;
	int rc;

	x->lease = SENTINEL;
	memset(&x->err, 0, sizeof x->err);
	rc = kl_lock_acquire(x->lock, &call, &x->lease, &x->err);
	if (rc != KL_OK) {
		ck_assert_ptr_null(x->lease);
		ck_assert_int_eq(x->err.status, rc);
		return rc;
	}
	ck_assert_int_eq(kl_provider_status(x->provider, "gamma", &h, &w,
					    NULL),
			 KL_OK);
	ck_assert_uint_eq(h, 2);
	kl_lease_release(x->lease);
	x->lease = NULL;
	check_one_reader(x);
	return KL_OK;
}

START_TEST(test_oom_shared_beside)
{
	static const struct oom_scenario s = {
		.name = "kl_lock_acquire KL_SHARED beside another reader",
		.setup = setup_shared_held,
		.run = run_shared_beside,
		.check_failed = check_one_reader,
		.teardown = teardown_shared_held,
	};

	sweep(&s);
}
END_TEST

static int
count_rows(const kl_lock_info *info, void *arg)
{
	(void)info;
	++*(int *)arg;
	return 0;
}

static int
run_snapshot(struct oom_ctx *x)
{
	int rows = 0, rc;

	memset(&x->err, 0, sizeof x->err);
	rc = kl_provider_snapshot(x->provider, count_rows, &rows, &x->err);
	if (rc != KL_OK) {
		ck_assert_int_eq(x->err.status, rc);
		return rc;
	}
	ck_assert_int_eq(rows, 2);
	return KL_OK;
}

START_TEST(test_oom_snapshot)
{
	static const struct oom_scenario s = {
		.name = "kl_provider_snapshot of the memory provider",
		.setup = setup_shared_held,
		.run = run_snapshot,
		.check_failed = check_one_reader,
		.teardown = teardown_shared_held,
	};

	sweep(&s);
}
END_TEST

START_TEST(test_hook_counts_allocations)
{
	kl_mutex *m;
	long n;

	/* The hook itself: it counts, and disarmed it fails nothing. */
	kl__test_fail_alloc_at(0);
	ck_assert_int_eq(kl_mutex_new(&m, NULL), KL_OK);
	n = kl__test_fail_alloc_at(0);
	ck_assert_int_ge(n, 1);
	kl_mutex_free(m);

	kl__test_fail_alloc_at(1);
	m = SENTINEL;
	ck_assert_int_eq(kl_mutex_new(&m, NULL), KL_ENOMEM);
	ck_assert_ptr_null(m);
	ck_assert_int_ge(kl__test_fail_alloc_at(0), 1);
	ck_assert_int_eq(kl_mutex_new(&m, NULL), KL_OK);
	kl_mutex_free(m);
}
END_TEST

static Suite *
oom_suite(void)
{
	Suite *s = suite_create("oom");
	TCase *tc;

	tc = tcase_create("objects");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_hook_counts_allocations);
	tcase_add_test(tc, test_oom_mutex_new);
	tcase_add_test(tc, test_oom_reset_event_new);
	tcase_add_test(tc, test_oom_cancel_new);
	tcase_add_test(tc, test_oom_cancel_new_timeout);
	tcase_add_test(tc, test_oom_cancel_new_timeout_zero);
	suite_add_tcase(s, tc);

	tc = tcase_create("registry");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_oom_registry_set_opts);
	tcase_add_test(tc, test_oom_named_run);
	suite_add_tcase(s, tc);

	tc = tcase_create("lock");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_oom_memory_provider_new);
	tcase_add_test(tc, test_oom_lock_new);
	tcase_add_test(tc, test_oom_lock_acquire);
	tcase_add_test(tc, test_oom_lock_run);
	tcase_add_test(tc, test_oom_lock_run_lease);
	tcase_add_test(tc, test_oom_lock_run_lease_hooked);
	tcase_add_test(tc, test_oom_lock_run_many);
	tcase_add_test(tc, test_oom_lock_acquire_many);
	tcase_add_test(tc, test_oom_shared_acquire);
	tcase_add_test(tc, test_oom_shared_run_lease);
	tcase_add_test(tc, test_oom_shared_beside);
	tcase_add_test(tc, test_oom_snapshot);
	suite_add_tcase(s, tc);
	return s;
}

int
main(void)
{
	return test_run_suite(oom_suite());
}
