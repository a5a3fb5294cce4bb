/* SPDX-License-Identifier: MIT */
/*
 * Stress: allocation-failure sweeps beyond test/check_oom.c (TESTPLAN T13).
 *
 * For each scenario and k = 1, 2, ... the test hook fails the k-th library
 * allocation from now; the scenario must then return KL_ENOMEM (or absorb
 * the failure and complete), leave nothing behind (checked per scenario:
 * provider sizes, names, queue lengths, open descriptors), and the same
 * scenario repeated at once without a failure must succeed.  The sweep
 * ends once a run succeeds having made fewer than k allocations.  Scenarios
 * documented to allocate nothing (waits, hand-offs, evictions, resets,
 * opening "memory:") are run armed at k = 1 and must make no allocation.
 *
 * Scenarios: kl_lock_acquire on a new key, then a second one queueing
 * behind it; 40 keys forced into one shard of the table (its bucket array
 * grows on insert and shrinks on release, and either may fail); evictions
 * by kl_mutex_set_opts and kl_named_set_opts with waiters; the 17th name of
 * a registry (its bucket array grows); reset-event set, reset and waits
 * with waiters; kl_provider_open of "memory:", "local:DIR" with an absolute
 * and a relative DIR; acquire and release on the local provider; event
 * dispatch of kl_lock_run and kl_lock_acquire (a failure is reported once
 * as KL_EV_REJECTED with KL_ENOMEM, never as ACQUIRED).  The hook cannot
 * fail pthread_create or pthread_cond_init: the library makes no threads
 * and its waits use futexes.
 *
 * The hook counts the allocations of the whole process: helper threads
 * here only block in the library (which allocates nothing then).
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <check.h>
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "internal.h" /* kl__test_fail_alloc_at, kl__hash */
#include "keylock.h"
#include "stress.h"

#ifndef KL_TEST_HOOKS
#error "stress_oom needs -DKL_TEST_HOOKS and a library built with the hooks"
#endif

#define MAX_K 20000
#define SHARD_KEYS 40
#define NAMES 16
#define MAX_EVENTS 8

struct oom_ctx {
	kl_provider *p;
	kl_lock *l, *l2;
	kl_mutex *m;
	kl_reset_event *e;
	kl_registry *r;
	kl_cancel *c;
	kl_token held;
	struct tw_group *g;
	kl_lease *leases[SHARD_KEYS];
	int fds;
	/* Events seen by the hook. */
	int nev;
	kl_event_type ev_type[MAX_EVENTS];
	int ev_status[MAX_EVENTS];
	/* kl_named_run helpers */
	pthread_t holder, runners[3];
	sem_t hold_go, hold_in;
	int run_rc[3];
};

static int
count_fds(void)
{
	DIR *d = opendir("/proc/self/fd");
	struct dirent *de;
	int n = 0;

	if (d == NULL)
		return -1;
	while ((de = readdir(d)) != NULL)
		if (de->d_name[0] != '.')
			n++;
	closedir(d);
	return n;
}

static void
sweep(const struct oom_scenario *s)
{
	long n, failures;

	test_oom_sweep(s, sizeof(struct oom_ctx), MAX_K, &n, &failures);
	if (s->no_alloc)
		st_note("%s: no allocation", s->name);
	else
		st_note("%s: %ld allocations, %ld runs failed with KL_ENOMEM",
			s->name, n, failures);
}

static int
nop_fn(void *arg)
{
	(void)arg;
	return 0;
}

/* ------------------------------------------------------------------ */
/* The memory provider through kl_lock                                 */

static void
on_event(const kl_event *ev, void *arg)
{
	struct oom_ctx *x = arg;

	if (x->nev < MAX_EVENTS) {
		x->ev_type[x->nev] = ev->type;
		x->ev_status[x->nev] = ev->status;
	}
	x->nev++;
}

static void
setup_two_locks(struct oom_ctx *x)
{
	kl_lock_opts lo = KL_LOCK_OPTS_INIT;

	st_assert(kl_memory_provider_new(&x->p) == KL_OK, "provider");
	lo.provider = x->p;
	lo.on_event = on_event;
	lo.event_arg = x;
	st_assert(kl_lock_new(&x->l, &lo) == KL_OK, "lock");
	lo.timeout_ms = 2;
	st_assert(kl_lock_new(&x->l2, &lo) == KL_OK, "lock");
}

static void
teardown_locks(struct oom_ctx *x)
{
	for (int i = 0; i < SHARD_KEYS; i++)
		if (x->leases[i] != NULL)
			kl_lease_release(x->leases[i]);
	st_assert(kl_memory_provider_size(x->p) == 0, "provider keeps %zu",
		  kl_memory_provider_size(x->p));
	kl_lock_free(x->l);
	kl_lock_free(x->l2);
	kl_provider_free(x->p);
}

static void
check_provider_empty(struct oom_ctx *x)
{
	st_assert(kl_memory_provider_size(x->p) == 0,
		  "an entry was left behind (%zu)",
		  kl_memory_provider_size(x->p));
	st_assert(kl_memory_provider_queue_size(x->p, "alpha") == 0,
		  "a waiter was left behind");
}

/* Events of a run: what a success or a failure must have raised. */
static void
check_events(struct oom_ctx *x, int rc, int from, const char *what)
{
	int n = x->nev - from;

	if (rc == KL_OK) {
		st_assert(n == 2 && x->ev_type[from] == KL_EV_ACQUIRED &&
				  x->ev_type[from + 1] == KL_EV_RELEASED,
			  "%s: %d events after a success", what, n);
	} else {
		st_assert(n == 1 && x->ev_type[from] == KL_EV_REJECTED &&
				  x->ev_status[from] == rc,
			  "%s: %d events after %s (first type %d status %d)",
			  what, n, kl_strerror(rc),
			  n > 0 ? (int)x->ev_type[from] : -1,
			  n > 0 ? x->ev_status[from] : 0);
	}
}

static int
run_acquire_then_queue(struct oom_ctx *x)
{
	kl_call call = { .key = "alpha", .cancel = NULL };
	kl_lease *second = (kl_lease *)x;
	int rc;

	rc = kl_lock_acquire(x->l, &call, &x->leases[0], NULL);
	if (rc != KL_OK) {
		st_assert(x->leases[0] == NULL, "lease set on failure");
		return rc;
	}
	st_assert(kl_memory_provider_size(x->p) == 1, "size");
	/* Queues behind the first (its lease is allocated first), then
	 * times out: both are completions. */
	rc = kl_lock_acquire(x->l2, &call, &second, NULL);
	st_assert(second == NULL, "second lease set");
	if (rc != KL_ETIMEDOUT && rc != KL_ENOMEM)
		st_assert(0, "second acquire: %s", kl_strerror(rc));
	st_assert(kl_memory_provider_queue_size(x->p, "alpha") == 0,
		  "the second waiter stayed queued");
	kl_lease_release(x->leases[0]);
	x->leases[0] = NULL;
	st_assert(kl_memory_provider_size(x->p) == 0, "size after release");
	return rc == KL_ETIMEDOUT ? KL_OK : rc;
}

START_TEST(test_oom_acquire_then_queue)
{
	static const struct oom_scenario s = {
		.name = "kl_lock_acquire on a new key, then one queued behind",
		.setup = setup_two_locks,
		.run = run_acquire_then_queue,
		.check_failed = check_provider_empty,
		.teardown = teardown_locks,
	};

	st_begin("T13 acquire then queue");
	sweep(&s);
}
END_TEST

/* Keys that land in the same shard as "alpha" (the top 6 bits of the
 * seeded hash pick the shard), found with the process's own seed. */
static char shard_keys[SHARD_KEYS][32];

static void
find_shard_keys(void)
{
	uint64_t want = kl__hash("alpha", 5) >> 58;
	int n = 0;

	for (int i = 0; n < SHARD_KEYS; i++) {
		char buf[32];

		snprintf(buf, sizeof buf, "shard-%d", i);
		if (kl__hash(buf, strlen(buf)) >> 58 == want)
			memcpy(shard_keys[n++], buf, sizeof buf);
	}
}

static int
run_one_shard(struct oom_ctx *x)
{
	int i, rc = KL_OK;

	for (i = 0; i < SHARD_KEYS; i++) {
		kl_call call = { .key = shard_keys[i], .cancel = NULL };

		rc = kl_lock_acquire(x->l, &call, &x->leases[i], NULL);
		if (rc != KL_OK)
			break;
	}
	if (rc == KL_OK)
		st_assert(kl_memory_provider_size(x->p) == SHARD_KEYS,
			  "%zu keys held", kl_memory_provider_size(x->p));
	/* Releases shrink the bucket array: a failure there is absorbed. */
	while (i-- > 0) {
		kl_lease_release(x->leases[i]);
		x->leases[i] = NULL;
	}
	st_assert(kl_memory_provider_size(x->p) == 0, "size after release");
	return rc;
}

START_TEST(test_oom_one_shard_grow_shrink)
{
	static const struct oom_scenario s = {
		.name = "40 keys in one shard: bucket growth and shrinking",
		.setup = setup_two_locks,
		.run = run_one_shard,
		.check_failed = check_provider_empty,
		.teardown = teardown_locks,
	};

	st_begin("T13 one shard grows and shrinks");
	find_shard_keys();
	sweep(&s);
}
END_TEST

static int
run_events(struct oom_ctx *x)
{
	kl_call call = { .key = "alpha", .cancel = NULL };
	kl_lease *lease;
	int rc, from = x->nev;

	rc = kl_lock_run(x->l, &call, nop_fn, NULL, NULL,
			 NULL);
	check_events(x, rc, from, "kl_lock_run");
	if (rc != KL_OK)
		return rc;
	from = x->nev;
	rc = kl_lock_acquire(x->l, &call, &lease, NULL);
	if (rc == KL_OK) {
		kl_lease_release(lease);
	}
	check_events(x, rc, from, "kl_lock_acquire");
	return rc;
}

START_TEST(test_oom_event_dispatch)
{
	static const struct oom_scenario s = {
		.name = "event dispatch of kl_lock_run and kl_lock_acquire",
		.setup = setup_two_locks,
		.run = run_events,
		.check_failed = check_provider_empty,
		.teardown = teardown_locks,
	};

	st_begin("T13 event dispatch");
	sweep(&s);
}
END_TEST

/* Waiting for a held key with kl_lock_run keeps the lease on the stack. */
static void
setup_held_key(struct oom_ctx *x)
{
	kl_call call = { .key = "alpha", .cancel = NULL };

	setup_two_locks(x);
	st_assert(kl_lock_acquire(x->l, &call, &x->leases[0], NULL) == KL_OK,
		  "hold");
}

static int
run_wait_held_key(struct oom_ctx *x)
{
	kl_call call = { .key = "alpha", .cancel = NULL };
	int rc = kl_lock_run(x->l2, &call, nop_fn, NULL,
			     NULL, NULL);

	return rc == KL_ETIMEDOUT ? KL_OK : rc;
}

START_TEST(test_oom_wait_held_key)
{
	static const struct oom_scenario s = {
		.name = "kl_lock_run waiting on a held key",
		.setup = setup_held_key,
		.run = run_wait_held_key,
		.teardown = teardown_locks,
		.no_alloc = true,
	};

	st_begin("T13 waiting allocates nothing");
	sweep(&s);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Mutex and event operations with waiters: nothing to allocate        */

static void
setup_waiters(struct oom_ctx *x)
{
	st_assert(kl_mutex_new(&x->m, NULL) == KL_OK, "mutex");
	st_assert(kl_mutex_try_enter(x->m, &x->held) == KL_OK, "hold");
	st_assert(kl_cancel_new(&x->c) == KL_OK, "token");
	x->g = tw_mutex(x->m, true);
	tw_start_n_queued(x->g, 3, KL_FOREVER, NULL);
}

static int
run_evict_and_wait(struct oom_ctx *x)
{
	kl_queue_opts o = KL_QUEUE_OPTS_INIT;
	kl_token t;
	int rc;

	o.max_queue = 1;
	o.overflow = KL_OVERFLOW_FIRST;
	if ((rc = kl_mutex_set_opts(x->m, &o)) != KL_OK)
		return rc;
	st_assert(kl_mutex_queue_size(x->m) == 1, "queue after eviction");
	/* A wait with a token, a timeout, and a fired token. */
	o.max_queue = KL_UNBOUNDED;
	st_assert(kl_mutex_set_opts(x->m, &o) == KL_OK, "raise");
	st_assert(kl_mutex_enter(x->m, 1, x->c, &t) == KL_ETIMEDOUT, "wait");
	kl_cancel_fire(x->c);
	st_assert(kl_mutex_enter(x->m, KL_FOREVER, x->c, &t) == KL_ECANCELED,
		  "fired");
	return KL_OK;
}

static void
teardown_waiters(struct oom_ctx *x)
{
	st_assert(kl_mutex_leave(x->m, x->held, false) == KL_OK, "leave");
	tw_join_all(x->g);
	st_assert(x->g->w[0].status == KL_EOVERFLOW &&
			  x->g->w[1].status == KL_EOVERFLOW &&
			  x->g->w[2].status == KL_OK,
		  "waiters: %d %d %d", x->g->w[0].status, x->g->w[1].status,
		  x->g->w[2].status);
	tw_free(x->g);
	kl_cancel_free(x->c);
	kl_mutex_free(x->m);
}

START_TEST(test_oom_evict)
{
	static const struct oom_scenario s = {
		.name = "kl_mutex_set_opts evicting, timed and cancelled waits",
		.setup = setup_waiters,
		.run = run_evict_and_wait,
		.teardown = teardown_waiters,
		.no_alloc = true,
	};

	st_begin("T13 evict");
	sweep(&s);
}
END_TEST

static void
setup_event_waiters(struct oom_ctx *x)
{
	kl_reset_opts o = KL_RESET_OPTS_INIT;

	o.auto_reset_count = 2;
	st_assert(kl_reset_event_new(&x->e, false, &o) == KL_OK, "event");
	x->g = tw_event(x->e);
	tw_start_n_queued(x->g, 3, KL_FOREVER, NULL);
}

static int
run_event_ops(struct oom_ctx *x)
{
	kl_reset_event_set(x->e); /* releases 2 */
	st_assert(kl_reset_event_queue_size(x->e) == 1, "queue after set");
	st_assert(!kl_reset_event_is_signaled(x->e), "budget spent");
	kl_reset_event_reset(x->e);
	st_assert(kl_reset_event_wait(x->e, 0, NULL) == KL_ETIMEDOUT, "try");
	st_assert(kl_reset_event_wait(x->e, 1, NULL) == KL_ETIMEDOUT, "wait");
	kl_reset_event_set(x->e); /* releases 1, one left in the budget */
	st_assert(kl_reset_event_is_signaled(x->e), "budget left");
	st_assert(kl_reset_event_wait(x->e, 0, NULL) == KL_OK, "spend");
	st_assert(!kl_reset_event_is_signaled(x->e), "spent");
	return KL_OK;
}

static void
teardown_event_waiters(struct oom_ctx *x)
{
	tw_join_all(x->g);
	for (int i = 0; i < 3; i++)
		st_assert(x->g->w[i].status == KL_OK, "waiter %d: %d", i,
			  x->g->w[i].status);
	tw_free(x->g);
	kl_reset_event_free(x->e);
}

START_TEST(test_oom_reset_event)
{
	static const struct oom_scenario s = {
		.name = "reset event set, reset and waits with waiters",
		.setup = setup_event_waiters,
		.run = run_event_ops,
		.teardown = teardown_event_waiters,
		.no_alloc = true,
	};

	st_begin("T13 reset event");
	sweep(&s);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Registry                                                            */

static int
block_fn(void *arg)
{
	struct oom_ctx *x = arg;

	sem_post(&x->hold_in);
	while (sem_wait(&x->hold_go) != 0)
		;
	return 0;
}

static void *
holder_main(void *arg)
{
	struct oom_ctx *x = arg;

	kl_named_run(x->r, "named", KL_FOREVER, block_fn, x, NULL);
	return NULL;
}

struct runner {
	struct oom_ctx *x;
	int i;
};

static struct runner runners[3];

static void *
runner_main(void *arg)
{
	struct runner *rn = arg;

	rn->x->run_rc[rn->i] =
		kl_named_run(rn->x->r, "named", KL_FOREVER, nop_fn, NULL, NULL);
	return NULL;
}

static void
setup_named_waiters(struct oom_ctx *x)
{
	int64_t limit = now_ms() + 10000;

	st_assert(kl_registry_new(&x->r) == KL_OK, "registry");
	sem_init(&x->hold_go, 0, 0);
	sem_init(&x->hold_in, 0, 0);
	st_thread_start(&x->holder, 0, holder_main, x);
	while (sem_wait(&x->hold_in) != 0)
		;
	for (int i = 0; i < 3; i++) {
		runners[i].x = x;
		runners[i].i = i;
		x->run_rc[i] = 1;
		st_thread_start(&x->runners[i], 0, runner_main, &runners[i]);
		while (kl_named_queue_size(x->r, "named") != (size_t)i + 1) {
			st_assert(now_ms() < limit, "runner %d not queued", i);
			sched_yield();
		}
	}
}

static int
run_named_evict(struct oom_ctx *x)
{
	kl_queue_opts o = KL_QUEUE_OPTS_INIT;
	int rc;

	o.max_queue = 1;
	o.overflow = KL_OVERFLOW_LAST;
	if ((rc = kl_named_set_opts(x->r, "named", &o)) != KL_OK)
		return rc;
	st_assert(kl_named_queue_size(x->r, "named") == 1, "queue %zu",
		  kl_named_queue_size(x->r, "named"));
	return KL_OK;
}

static void
teardown_named_waiters(struct oom_ctx *x)
{
	sem_post(&x->hold_go);
	st_thread_join(x->holder);
	for (int i = 0; i < 3; i++)
		st_thread_join(x->runners[i]);
	st_assert(x->run_rc[0] == KL_OK && x->run_rc[1] == KL_EOVERFLOW &&
			  x->run_rc[2] == KL_EOVERFLOW,
		  "runners: %d %d %d", x->run_rc[0], x->run_rc[1],
		  x->run_rc[2]);
	sem_destroy(&x->hold_go);
	sem_destroy(&x->hold_in);
	kl_registry_free(x->r);
}

START_TEST(test_oom_named_evict)
{
	static const struct oom_scenario s = {
		.name = "kl_named_set_opts evicting waiters of a name",
		.setup = setup_named_waiters,
		.run = run_named_evict,
		.teardown = teardown_named_waiters,
		.no_alloc = true,
	};

	st_begin("T13 named set_opts evicts");
	sweep(&s);
}
END_TEST

static void
setup_sixteen_names(struct oom_ctx *x)
{
	kl_queue_opts o = KL_QUEUE_OPTS_INIT;

	st_assert(kl_registry_new(&x->r) == KL_OK, "registry");
	for (int i = 0; i < NAMES; i++) {
		char name[16];

		snprintf(name, sizeof name, "name-%d", i);
		o.max_queue = (size_t)i;
		st_assert(kl_named_set_opts(x->r, name, &o) == KL_OK, "name");
	}
}

static int
run_seventeenth_name(struct oom_ctx *x)
{
	kl_queue_opts o = KL_QUEUE_OPTS_INIT, got;
	int rc;

	o.max_queue = 99;
	o.overflow = KL_OVERFLOW_FIRST;
	if ((rc = kl_named_set_opts(x->r, "name-16", &o)) != KL_OK)
		return rc;
	st_assert(kl_named_get_opts(x->r, "name-16", &got) == KL_OK &&
			  got.max_queue == 99,
		  "opts of the new name");
	return KL_OK;
}

static void
check_names_intact(struct oom_ctx *x)
{
	st_assert(!kl_named_exists(x->r, "name-16"), "half-made name");
	for (int i = 0; i < NAMES; i++) {
		kl_queue_opts got;
		char name[16];

		snprintf(name, sizeof name, "name-%d", i);
		st_assert(kl_named_get_opts(x->r, name, &got) == KL_OK &&
				  got.max_queue == (size_t)i,
			  "%s lost", name);
	}
}

static void
teardown_registry(struct oom_ctx *x)
{
	kl_registry_free(x->r);
}

START_TEST(test_oom_named_growth)
{
	static const struct oom_scenario s = {
		.name = "kl_named_set_opts creating the 17th name",
		.setup = setup_sixteen_names,
		.run = run_seventeenth_name,
		.check_failed = check_names_intact,
		.teardown = teardown_registry,
	};

	st_begin("T13 named set_opts grows the registry");
	sweep(&s);
}
END_TEST

/* ------------------------------------------------------------------ */
/* kl_provider_open                                                    */

static char local_dir[64], local_rel[64];

static void
make_local_dirs(void)
{
	snprintf(local_dir, sizeof local_dir, "/tmp/kl-stress-oom-XXXXXX");
	st_assert(mkdtemp(local_dir) != NULL, "mkdtemp");
	snprintf(local_rel, sizeof local_rel, "kl-stress-oom-XXXXXX");
	st_assert(mkdtemp(local_rel) != NULL, "mkdtemp (relative)");
}

static void
remove_local_dirs(void)
{
	test_remove_tree(local_dir);
	test_remove_tree(local_rel);
}

static void
setup_fds(struct oom_ctx *x)
{
	x->fds = count_fds();
}

static int
run_open_memory(struct oom_ctx *x)
{
	kl_error err;
	int rc = kl_provider_open(&x->p, "memory:", &err);

	st_assert(rc != KL_OK || x->p == kl_memory_provider(), "not shared");
	return rc;
}

static void
teardown_open(struct oom_ctx *x)
{
	kl_provider_free(x->p);
	st_assert(x->fds < 0 || count_fds() == x->fds,
		  "descriptors: %d before, %d after", x->fds, count_fds());
}

START_TEST(test_oom_open_memory)
{
	static const struct oom_scenario s = {
		.name = "kl_provider_open(\"memory:\")",
		.setup = setup_fds,
		.run = run_open_memory,
		.teardown = teardown_open,
		.no_alloc = true,
	};

	st_begin("T13 open memory:");
	sweep(&s);
}
END_TEST

static int
open_local(struct oom_ctx *x, const char *dir)
{
	char uri[128];
	kl_error err;
	int rc;

	snprintf(uri, sizeof uri, "local:%s", dir);
	x->p = (kl_provider *)(void *)x;
	memset(&err, 0, sizeof err);
	rc = kl_provider_open(&x->p, uri, &err);
	if (rc != KL_OK)
		st_assert(x->p == NULL, "provider set on failure");
	st_assert(rc == KL_OK || rc == KL_ENOMEM, "%s: %s (%s)", uri,
		  kl_strerror(rc), err.message);
	return rc;
}

static int
run_open_local(struct oom_ctx *x)
{
	return open_local(x, local_dir);
}

static int
run_open_local_relative(struct oom_ctx *x)
{
	return open_local(x, local_rel);
}

static void
check_no_fd(struct oom_ctx *x)
{
	st_assert(x->fds < 0 || count_fds() == x->fds,
		  "a descriptor leaked: %d before, %d after", x->fds,
		  count_fds());
}

START_TEST(test_oom_open_local)
{
	static const struct oom_scenario abs = {
		.name = "kl_provider_open(\"local:/abs/dir\")",
		.setup = setup_fds,
		.run = run_open_local,
		.check_failed = check_no_fd,
		.teardown = teardown_open,
	};
	static const struct oom_scenario rel = {
		.name = "kl_provider_open(\"local:relative/dir\")",
		.setup = setup_fds,
		.run = run_open_local_relative,
		.check_failed = check_no_fd,
		.teardown = teardown_open,
	};

	st_begin("T13 open local:");
	make_local_dirs();
	sweep(&abs);
	sweep(&rel);
	remove_local_dirs();
}
END_TEST

static void
setup_local_lock(struct oom_ctx *x)
{
	kl_lock_opts lo = KL_LOCK_OPTS_INIT;
	char uri[128];

	x->fds = count_fds();
	snprintf(uri, sizeof uri, "local:%s", local_dir);
	st_assert(kl_provider_open(&x->p, uri, NULL) == KL_OK, "open");
	lo.provider = x->p;
	lo.timeout_ms = 1000;
	st_assert(kl_lock_new(&x->l, &lo) == KL_OK, "lock");
}

static int
run_local_acquire(struct oom_ctx *x)
{
	kl_call call = { .key = "local key", .cancel = NULL };
	size_t holders = 9, waiters = 9;
	int rc = kl_lock_acquire(x->l, &call, &x->leases[0], NULL);

	if (rc != KL_OK)
		return rc;
	st_assert(kl_provider_status(x->p, "local key", &holders, &waiters,
				     NULL) == KL_OK &&
			  holders == 1,
		  "status: %zu holders", holders);
	kl_lease_release(x->leases[0]);
	x->leases[0] = NULL;
	return KL_OK;
}

static void
check_local_free(struct oom_ctx *x)
{
	size_t holders = 9, waiters = 9;

	st_assert(kl_provider_status(x->p, "local key", &holders, &waiters,
				     NULL) == KL_OK &&
			  holders == 0 && waiters == 0,
		  "left behind: %zu holders, %zu waiters", holders, waiters);
}

static void
teardown_local_lock(struct oom_ctx *x)
{
	kl_lock_free(x->l);
	kl_provider_free(x->p);
	st_assert(x->fds < 0 || count_fds() == x->fds,
		  "descriptors: %d before, %d after", x->fds, count_fds());
}

START_TEST(test_oom_local_acquire)
{
	static const struct oom_scenario s = {
		.name = "kl_lock_acquire and release on local:",
		.setup = setup_local_lock,
		.run = run_local_acquire,
		.check_failed = check_local_free,
		.teardown = teardown_local_lock,
	};

	st_begin("T13 local: acquire");
	make_local_dirs();
	sweep(&s);
	remove_local_dirs();
}
END_TEST

static Suite *
stress_oom_suite(void)
{
	Suite *s = suite_create("stress_oom");
	TCase *tc;

	tc = tcase_create("memory_provider");
	tcase_set_timeout(tc, ST_TIMEOUT);
	tcase_add_test(tc, test_oom_acquire_then_queue);
	tcase_add_test(tc, test_oom_one_shard_grow_shrink);
	tcase_add_test(tc, test_oom_event_dispatch);
	tcase_add_test(tc, test_oom_wait_held_key);
	suite_add_tcase(s, tc);

	tc = tcase_create("waiters");
	tcase_set_timeout(tc, ST_TIMEOUT);
	tcase_add_test(tc, test_oom_evict);
	tcase_add_test(tc, test_oom_reset_event);
	tcase_add_test(tc, test_oom_named_evict);
	tcase_add_test(tc, test_oom_named_growth);
	suite_add_tcase(s, tc);

	tc = tcase_create("providers");
	tcase_set_timeout(tc, ST_TIMEOUT);
	tcase_add_test(tc, test_oom_open_memory);
	tcase_add_test(tc, test_oom_open_local);
	tcase_add_test(tc, test_oom_local_acquire);
	suite_add_tcase(s, tc);
	return s;
}

int
main(void)
{
	return st_run(stress_oom_suite());
}
