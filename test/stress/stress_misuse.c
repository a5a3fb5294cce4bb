/* SPDX-License-Identifier: MIT */
/*
 * Stress: misuse never aborts the process (TESTPLAN T11).
 *
 * Each scenario runs in a forked child (st_child): exit 0 means every
 * misuse got the status DESIGN gives it and nothing aborted; a signal or a
 * hang shows up as such.  Children do not use Check: they print what went
 * wrong and exit with the line number.  Scenarios: leaving with a foreign,
 * stale, double-used, zeroed or random token, or on the wrong mutex
 * (KL_EINVAL, nothing changes); NULL and out-of-range arguments everywhere;
 * error-check re-entry (KL_EDEADLK at once); a rogue thread calling leave
 * in a loop with garbage and stale tokens while 2-9 legitimate waiters
 * queue and are all served in FIFO order; freeing a held mutex or a
 * provider with a held key, which the debug build reports on stderr.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <check.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "keylock.h"
#include "stress.h"

/* In a child: report and fail with the line number. */
#define CHILD_CHECK(cond, ...)                                             \
	do {                                                               \
		if (!(cond)) {                                             \
			fprintf(stderr, "stress: T11 child, line %d: %s: ",  \
				__LINE__, #cond);                          \
			fprintf(stderr, __VA_ARGS__);                      \
			fprintf(stderr, "\n");                             \
			return __LINE__ % 250 + 1;                         \
		}                                                          \
	} while (0)

static void
run_child(const char *what, int (*fn)(void *arg), void *arg, int64_t limit)
{
	char desc[128];
	int status = st_child(fn, arg, limit);

	st_describe_status(status, desc, sizeof desc);
	st_note("%s: %s", what, desc);
	st_assert(status >= 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0,
		  "%s: child %s", what, desc);
}

/* ------------------------------------------------------------------ */
/* Tokens                                                              */

static int
child_tokens(void *arg)
{
	struct st_rng r;
	kl_mutex *m1, *m2;
	kl_token t1, t2, t3, bad;
	long n = *(long *)arg;

	st_rng_init(&r, 0x1100);
	CHILD_CHECK(kl_mutex_new(&m1, NULL) == KL_OK, "new");
	CHILD_CHECK(kl_mutex_new(&m2, NULL) == KL_OK, "new");
	CHILD_CHECK(kl_mutex_enter(m1, KL_FOREVER, NULL, &t1) == KL_OK,
		    "enter");
	CHILD_CHECK(kl_mutex_enter(m2, KL_FOREVER, NULL, &t2) == KL_OK,
		    "enter");
	/* Wrong mutex, both ways, with and without abort_pending. */
	for (int ap = 0; ap < 2; ap++) {
		CHILD_CHECK(kl_mutex_leave(m2, t1, ap) == KL_EINVAL, "m2/t1");
		CHILD_CHECK(kl_mutex_leave(m1, t2, ap) == KL_EINVAL, "m1/t2");
	}
	/* Zeroed, out of range, neighbours, random. */
	memset(&bad, 0, sizeof bad);
	CHILD_CHECK(kl_mutex_leave(m1, bad, false) == KL_EINVAL, "zero");
	bad.id = UINT64_MAX;
	CHILD_CHECK(kl_mutex_leave(m1, bad, false) == KL_EINVAL, "max");
	bad.id = UINT64_MAX >> 1;
	CHILD_CHECK(kl_mutex_leave(m1, bad, true) == KL_EINVAL, "max/2");
	bad.id = t1.id + 1;
	CHILD_CHECK(kl_mutex_leave(m1, bad, false) == KL_EINVAL, "id+1");
	bad.id = t1.id - 1;
	CHILD_CHECK(kl_mutex_leave(m1, bad, false) == KL_EINVAL, "id-1");
	bad = t1;
	bad.id |= UINT64_C(1) << 63; /* shifted out by a sloppy check */
	CHILD_CHECK(kl_mutex_leave(m1, bad, false) == KL_EINVAL, "high bit");
	for (long i = 0; i < n; i++) {
		bad.id = st_rand(&r);
		bad.start_ns = (int64_t)st_rand(&r);
		if (bad.id == t1.id || bad.id == t2.id)
			continue;
		CHILD_CHECK(kl_mutex_leave(m1, bad, (i & 1) != 0) == KL_EINVAL,
			    "random id %llu", (unsigned long long)bad.id);
	}
	/* Nothing changed. */
	CHILD_CHECK(kl_mutex_is_locked(m1) && kl_mutex_queue_size(m1) == 0,
		    "state changed");
	CHILD_CHECK(kl_mutex_try_enter(m1, &t3) == KL_ETIMEDOUT, "taken");
	CHILD_CHECK(kl_mutex_leave(m1, t1, false) == KL_OK, "owner leave");
	/* Double use and stale after someone else took it. */
	CHILD_CHECK(kl_mutex_leave(m1, t1, false) == KL_EINVAL, "twice");
	CHILD_CHECK(kl_mutex_enter(m1, 0, NULL, &t3) == KL_OK, "re-enter");
	CHILD_CHECK(kl_mutex_leave(m1, t1, false) == KL_EINVAL, "stale");
	CHILD_CHECK(kl_mutex_leave(m1, t1, true) == KL_EINVAL, "stale abort");
	CHILD_CHECK(kl_mutex_is_locked(m1), "stale token freed it");
	CHILD_CHECK(kl_mutex_leave(m1, t3, false) == KL_OK, "leave");
	CHILD_CHECK(kl_mutex_leave(m2, t2, false) == KL_OK, "leave m2");
	CHILD_CHECK(!kl_mutex_is_locked(m1) && !kl_mutex_is_locked(m2),
		    "left locked");
	kl_mutex_free(m1);
	kl_mutex_free(m2);
	return 0;
}

START_TEST(test_t11_bad_tokens)
{
	long n = st_scaled(100000, 1, 1000);

	st_begin("T11 foreign, stale, double-used and random tokens");
	run_child("bad tokens", child_tokens, &n, 30000 * st_slow());
}
END_TEST

/* ------------------------------------------------------------------ */
/* Bad arguments                                                       */

static int
one_fn(void *arg)
{
	(void)arg;
	return 1;
}

static int
child_bad_args(void *arg)
{
	kl_queue_opts qo = KL_QUEUE_OPTS_INIT, bad = KL_QUEUE_OPTS_INIT;
	kl_reset_opts ro = KL_RESET_OPTS_INIT;
	kl_lock_opts lo = KL_LOCK_OPTS_INIT;
	kl_mutex *m;
	kl_reset_event *e = NULL;
	kl_lock *l = NULL;
	kl_lease *lease = NULL;
	kl_provider *p = NULL;
	kl_error err;
	kl_token t;
	int64_t ms;
	int res;

	(void)arg;
	CHILD_CHECK(kl_mutex_new(NULL, NULL) == KL_EINVAL, "new NULL");
	bad.overflow = (kl_overflow)7;
	CHILD_CHECK(kl_mutex_new(&m, &bad) == KL_EINVAL && m == NULL,
		    "bad overflow");
	bad = qo;
	bad.flags = 0x80;
	CHILD_CHECK(kl_mutex_new(&m, &bad) == KL_EINVAL, "bad flags");
	CHILD_CHECK(kl_mutex_new(&m, &qo) == KL_OK, "new");
	CHILD_CHECK(kl_mutex_enter(NULL, 0, NULL, &t) == KL_EINVAL, "NULL m");
	CHILD_CHECK(kl_mutex_enter(m, 0, NULL, NULL) == KL_EINVAL, "NULL out");
	CHILD_CHECK(kl_mutex_try_enter(NULL, &t) == KL_EINVAL, "try NULL");
	CHILD_CHECK(kl_mutex_leave(NULL, t, false) == KL_EINVAL, "leave NULL");
	CHILD_CHECK(kl_mutex_set_opts(m, NULL) == KL_EINVAL, "set NULL");
	CHILD_CHECK(kl_mutex_set_opts(NULL, &qo) == KL_EINVAL, "set NULL m");
	bad.flags = 0;
	bad.overflow = (kl_overflow)-1;
	CHILD_CHECK(kl_mutex_set_opts(m, &bad) == KL_EINVAL, "set bad");
	CHILD_CHECK(kl_mutex_get_opts(m, NULL) == KL_EINVAL, "get NULL");
	CHILD_CHECK(kl_mutex_run(m, 0, NULL, NULL, NULL, NULL) == KL_EINVAL,
		    "run NULL fn");
	CHILD_CHECK(kl_mutex_run(NULL, 0, NULL, one_fn, NULL, NULL) ==
			    KL_EINVAL,
		    "run NULL m");
	CHILD_CHECK(!kl_mutex_is_locked(NULL) && kl_mutex_queue_size(NULL) == 0,
		    "NULL state");
	CHILD_CHECK(!kl_mutex_is_locked(m), "m changed");
	kl_mutex_free(NULL);
	kl_mutex_free(m);

	ro.auto_reset_count = 0;
	CHILD_CHECK(kl_reset_event_new(&e, false, &ro) == KL_EINVAL &&
			    e == NULL,
		    "auto_reset_count 0");
	CHILD_CHECK(kl_reset_event_new(NULL, false, NULL) == KL_EINVAL,
		    "event NULL");
	CHILD_CHECK(kl_reset_event_wait(NULL, 0, NULL) == KL_EINVAL,
		    "wait NULL");
	kl_reset_event_set(NULL);
	kl_reset_event_reset(NULL);
	kl_reset_event_free(NULL);
	CHILD_CHECK(!kl_reset_event_is_signaled(NULL) &&
			    kl_reset_event_queue_size(NULL) == 0,
		    "NULL event state");

	kl_cancel_fire(NULL);
	kl_cancel_free(NULL);
	CHILD_CHECK(!kl_cancel_fired(NULL), "NULL fired");
	CHILD_CHECK(kl_cancel_new(NULL) == KL_EINVAL, "cancel NULL");

	CHILD_CHECK(kl_lock_new(NULL, NULL) == KL_EINVAL, "lock NULL");
	lo.ttl_ms = -5;
	CHILD_CHECK(kl_lock_new(&l, &lo) == KL_EINVAL && l == NULL, "ttl");
	lo.ttl_ms = 0;
	lo.flags = 0x40;
	CHILD_CHECK(kl_lock_new(&l, &lo) == KL_EINVAL, "lock flags");
	lo.flags = 0;
	CHILD_CHECK(kl_lock_new(&l, &lo) == KL_OK, "lock");
	CHILD_CHECK(kl_lock_run(NULL, NULL, one_fn, NULL, NULL, &err) ==
			    KL_EINVAL,
		    "run NULL lock");
	CHILD_CHECK(kl_lock_run(l, NULL, NULL, NULL, NULL, &err) == KL_EINVAL,
		    "run NULL fn");
	CHILD_CHECK(kl_lock_run(l, NULL, one_fn, NULL, &res, &err) ==
				    KL_ENOKEY &&
			    err.status == KL_ENOKEY,
		    "no key");
	CHILD_CHECK(kl_lock_acquire(l, NULL, NULL, NULL) == KL_EINVAL,
		    "acquire NULL out");
	CHILD_CHECK(kl_lock_acquire(l, NULL, &lease, NULL) == KL_ENOKEY &&
			    lease == NULL,
		    "acquire no key");
	kl_lease_release(NULL);
	CHILD_CHECK(kl_lease_fence(NULL) == 0 && !kl_lease_valid(NULL) &&
			    kl_lease_key(NULL) == NULL,
		    "NULL lease");
	kl_lock_free(l);
	kl_lock_free(NULL);

	CHILD_CHECK(kl_provider_open(NULL, "memory:", NULL) == KL_EINVAL,
		    "open NULL");
	CHILD_CHECK(kl_provider_open(&p, NULL, &err) == KL_EINVAL, "URI NULL");
	CHILD_CHECK(kl_provider_open(&p, "bogus:x", &err) == KL_EINVAL &&
			    p == NULL,
		    "bogus URI");
	CHILD_CHECK(kl_provider_open(&p, "", &err) == KL_EINVAL, "empty URI");
	CHILD_CHECK(kl_provider_status(NULL, "k", NULL, NULL, NULL) ==
			    KL_EINVAL,
		    "status NULL");
	CHILD_CHECK(kl_memory_provider_size(NULL) == 0 &&
			    kl_memory_provider_queue_size(NULL, "k") == 0 &&
			    kl_memory_provider_queue_size(kl_memory_provider(),
							  NULL) == 0,
		    "NULL provider");
	kl_provider_free(NULL);
	kl_provider_free(kl_memory_provider()); /* does nothing */

	CHILD_CHECK(kl_named_run(NULL, NULL, 0, one_fn, NULL, NULL) ==
			    KL_EINVAL,
		    "named NULL");
	CHILD_CHECK(kl_named_set_opts(NULL, NULL, NULL) == KL_EINVAL,
		    "named set NULL");
	CHILD_CHECK(kl_named_remove(NULL, "stress-misuse-missing") ==
			    KL_ENOTFOUND,
		    "remove missing");
	CHILD_CHECK(!kl_named_is_locked(NULL, NULL) &&
			    !kl_named_exists(NULL, NULL) &&
			    kl_named_queue_size(NULL, NULL) == 0,
		    "named NULL state");

	CHILD_CHECK(kl_duration_parse(NULL, &ms) == KL_EINVAL, "parse NULL");
	CHILD_CHECK(kl_duration_parse("-1s", &ms) == KL_EINVAL && ms == 0,
		    "parse negative");
	CHILD_CHECK(kl_duration_parse("99999999999999999999d", &ms) ==
			    KL_EINVAL,
		    "parse huge");
	for (int s = -1000; s <= 1000; s++)
		CHILD_CHECK(kl_strerror(s) != NULL, "strerror %d", s);
	return 0;
}

START_TEST(test_t11_bad_arguments)
{
	st_begin("T11 NULL and out-of-range arguments");
	run_child("bad arguments", child_bad_args, NULL, 30000 * st_slow());
}
END_TEST

/* ------------------------------------------------------------------ */
/* Error-check re-entry                                                */

struct ec_other {
	kl_mutex *m;
	kl_token t;
	int rc_enter, rc_leave;
};

static void *
ec_other_main(void *arg)
{
	struct ec_other *o = arg;
	kl_token t;

	o->rc_enter = kl_mutex_enter(o->m, 10, NULL, &t);
	/* Any thread may leave with the owner's token. */
	o->rc_leave = kl_mutex_leave(o->m, o->t, false);
	return NULL;
}

static int
child_errorcheck(void *arg)
{
	static const int64_t timeouts[] = { 0, 1, 10, 1000, KL_FOREVER };
	kl_queue_opts o = KL_QUEUE_OPTS_INIT;
	kl_lock_opts lo = KL_LOCK_OPTS_INIT;
	struct ec_other other;
	kl_call call = { .key = "stress-misuse-ec", .cancel = NULL };
	kl_lease *l1, *l2;
	kl_mutex *m;
	kl_lock *lk;
	kl_token t, t2;
	pthread_t th;
	long rounds = *(long *)arg;

	o.flags = KL_ERRORCHECK;
	CHILD_CHECK(kl_mutex_new(&m, &o) == KL_OK, "new");
	for (long i = 0; i < rounds; i++) {
		CHILD_CHECK(kl_mutex_enter(m, KL_FOREVER, NULL, &t) == KL_OK,
			    "enter");
		for (size_t k = 0; k < sizeof timeouts / sizeof timeouts[0];
		     k++) {
			int64_t t0 = now_ns();

			CHILD_CHECK(kl_mutex_enter(m, timeouts[k], NULL, &t2) ==
					    KL_EDEADLK,
				    "re-enter %lld", (long long)timeouts[k]);
			CHILD_CHECK(now_ns() - t0 < 500 * ST_MS,
				    "KL_EDEADLK waited");
		}
		CHILD_CHECK(kl_mutex_try_enter(m, &t2) == KL_EDEADLK, "try");
		CHILD_CHECK(kl_mutex_queue_size(m) == 0, "queued");
		/* Another thread waits and times out, then leaves for us. */
		memset(&other, 0, sizeof other);
		other.m = m;
		other.t = t;
		if (pthread_create(&th, NULL, ec_other_main, &other) != 0)
			return 2;
		pthread_join(th, NULL);
		CHILD_CHECK(other.rc_enter == KL_ETIMEDOUT, "other: %s",
			    kl_strerror(other.rc_enter));
		CHILD_CHECK(other.rc_leave == KL_OK, "foreign leave");
		CHILD_CHECK(!kl_mutex_is_locked(m), "still held");
		/* Left by another thread: entering again is fine. */
		CHILD_CHECK(kl_mutex_enter(m, 0, NULL, &t) == KL_OK,
			    "enter after foreign leave");
		CHILD_CHECK(kl_mutex_leave(m, t, false) == KL_OK, "leave");
	}
	kl_mutex_free(m);

	lo.flags = KL_ERRORCHECK;
	CHILD_CHECK(kl_lock_new(&lk, &lo) == KL_OK, "lock");
	CHILD_CHECK(kl_lock_acquire(lk, &call, &l1, NULL) == KL_OK, "acquire");
	CHILD_CHECK(kl_lock_acquire(lk, &call, &l2, NULL) == KL_EDEADLK &&
			    l2 == NULL,
		    "nested acquire");
	kl_lease_release(l1);
	CHILD_CHECK(kl_memory_provider_size(kl_memory_provider()) == 0,
		    "shared provider not empty");
	kl_lock_free(lk);
	return 0;
}

START_TEST(test_t11_errorcheck)
{
	long rounds = st_scaled(50, 1, 10);

	st_begin("T11 error-check re-entry");
	run_child("error-check", child_errorcheck, &rounds, 60000 * st_slow());
}
END_TEST

/* ------------------------------------------------------------------ */
/* A rogue thread leaving with garbage while legit waiters queue       */

#define ROGUE_MAX_WAITERS 9
#define ROGUE_STALE 64

struct rogue {
	kl_mutex *m, *other;
	int64_t until_ns;
	atomic_bool stop;
	/* Stale tokens of past grants, published after their leave. */
	atomic_ullong stale[ROGUE_STALE];
	atomic_long stale_n;
	atomic_long calls, wins, other_status;
	/* Legit waiters of the current round. */
	struct st_crew crew;
	atomic_long seq;
	atomic_int order[ROGUE_MAX_WAITERS];
	atomic_int rc[ROGUE_MAX_WAITERS];
};

static void
legit_job(struct st_crew *c, int i)
{
	struct rogue *x = c->arg;
	kl_token t;
	int rc = kl_mutex_enter(x->m, KL_FOREVER, NULL, &t);

	if (rc == KL_OK) {
		long s = atomic_fetch_add(&x->seq, 1);

		if (s < ROGUE_MAX_WAITERS)
			atomic_store(&x->order[s], i);
		if (kl_mutex_leave(x->m, t, false) != KL_OK)
			rc = KL_EINVAL;
		atomic_store(&x->stale[atomic_fetch_add(&x->stale_n, 1) %
				       ROGUE_STALE],
			     t.id);
	}
	atomic_store(&x->rc[i], rc);
}

static void *
rogue_main(void *arg)
{
	struct rogue *x = arg;
	struct st_rng r;
	kl_token t, mine;

	st_rng_init(&r, 0x1110);
	while (!atomic_load(&x->stop)) {
		long n = atomic_load(&x->stale_n);
		int rc;

		memset(&t, 0, sizeof t);
		switch (st_below(&r, 4)) {
		case 0: /* random */
			t.id = st_rand(&r);
			t.start_ns = (int64_t)st_rand(&r);
			break;
		case 1: /* stale */
			if (n > ROGUE_STALE)
				n = ROGUE_STALE;
			if (n > 0)
				t.id = atomic_load(
					&x->stale[st_below(&r, (uint64_t)n)]);
			break;
		case 2: /* foreign: held on another mutex */
			if (kl_mutex_enter(x->other, 0, NULL, &mine) == KL_OK) {
				t = mine;
				rc = kl_mutex_leave(x->m, t, st_below(&r, 2));
				atomic_fetch_add(&x->calls, 1);
				if (rc != KL_EINVAL)
					atomic_fetch_add(&x->wins, 1);
				if (kl_mutex_leave(x->other, mine, false) !=
				    KL_OK)
					atomic_fetch_add(&x->other_status, 1);
				continue;
			}
			break;
		default: /* zero */
			break;
		}
		rc = kl_mutex_leave(x->m, t, st_below(&r, 2) == 0);
		atomic_fetch_add(&x->calls, 1);
		if (rc != KL_EINVAL)
			atomic_fetch_add(&x->wins, 1);
	}
	return NULL;
}

/* Plain assertions for the child: no Check there. */
static int
rogue_round(struct rogue *x, struct st_rng *r, long *base)
{
	int k = 2 + (int)st_below(r, ROGUE_MAX_WAITERS - 1), perm[9];
	kl_token held;
	int64_t limit;

	st_shuffle(r, perm, k);
	atomic_store(&x->seq, 0);
	for (int i = 0; i < k; i++) {
		atomic_store(&x->order[i], -1);
		atomic_store(&x->rc[i], 1);
	}
	CHILD_CHECK(kl_mutex_enter(x->m, KL_FOREVER, NULL, &held) == KL_OK,
		    "hold");
	for (int i = 0; i < k; i++) {
		st_crew_go(&x->crew, perm[i]);
		CHILD_CHECK(st_poll_queue(x->m, (size_t)i + 1, 10000),
			    "waiter %d not queued: %zu", perm[i],
			    kl_mutex_queue_size(x->m));
	}
	CHILD_CHECK(kl_mutex_leave(x->m, held, false) == KL_OK, "leave");
	atomic_store(&x->stale[atomic_fetch_add(&x->stale_n, 1) % ROGUE_STALE],
		     held.id);
	limit = now_ms() + 10000;
	while (atomic_load(&x->crew.done) < *base + k) {
		CHILD_CHECK(now_ms() < limit, "waiters not served: %ld of %d",
			    atomic_load(&x->crew.done) - *base, k);
		sched_yield();
	}
	*base += k;
	for (int i = 0; i < k; i++) {
		CHILD_CHECK(atomic_load(&x->rc[i]) == KL_OK, "waiter %d: %s", i,
			    kl_strerror(atomic_load(&x->rc[i])));
		CHILD_CHECK(atomic_load(&x->order[i]) == perm[i],
			    "grant %d went to %d, not %d", i,
			    atomic_load(&x->order[i]), perm[i]);
	}
	return 0;
}

/* The rogue loops on leave while rounds of legit waiters are served.
 * (st_crew_start asserts through Check, which only matters if a thread
 * cannot be made.) */
static int
child_rogue(void *arg)
{
	static struct rogue x;
	struct st_rng r;
	pthread_t rogue;
	long base = 0, rounds = 0;
	int rc = 0;

	memset(&x, 0, sizeof x);
	x.until_ns = now_ns() + *(int64_t *)arg * ST_MS;
	st_rng_init(&r, 0x1120);
	CHILD_CHECK(kl_mutex_new(&x.m, NULL) == KL_OK, "new");
	CHILD_CHECK(kl_mutex_new(&x.other, NULL) == KL_OK, "new");
	st_crew_start(&x.crew, ROGUE_MAX_WAITERS, 0, legit_job, &x);
	if (pthread_create(&rogue, NULL, rogue_main, &x) != 0)
		return 3;
	while (now_ns() < x.until_ns && rc == 0) {
		rc = rogue_round(&x, &r, &base);
		rounds++;
	}
	atomic_store(&x.stop, true);
	pthread_join(rogue, NULL);
	fprintf(stderr,
		"stress: T11 rogue: %ld rounds, %ld legit grants, %ld rogue "
		"leaves, %ld accepted\n",
		rounds, base, atomic_load(&x.calls), atomic_load(&x.wins));
	if (rc != 0)
		return rc;
	CHILD_CHECK(atomic_load(&x.wins) == 0,
		    "the rogue's leave was accepted %ld times",
		    atomic_load(&x.wins));
	CHILD_CHECK(atomic_load(&x.other_status) == 0, "other mutex");
	CHILD_CHECK(atomic_load(&x.calls) > 0, "the rogue never ran");
	CHILD_CHECK(!kl_mutex_is_locked(x.m) && kl_mutex_queue_size(x.m) == 0,
		    "left held or queued");
	/* The crew's threads end with the process. */
	return 0;
}

START_TEST(test_t11_rogue_leaves)
{
	int64_t ms = (int64_t)(10000 * kl_test_scale());

	st_begin("T11 rogue leaves while legit waiters queue");
	if (ms < 500)
		ms = 500;
	run_child("rogue", child_rogue, &ms, ms + 30000 * st_slow());
}
END_TEST

/* ------------------------------------------------------------------ */
/* Freeing what is in use: reported by the debug build                 */

/* Runs fn with stderr sent to a file, returns what was written. */
static int
capture_stderr(void (*fn)(void), char *buf, size_t size)
{
	char path[] = "/tmp/kl-stress-misuse-XXXXXX";
	int fd = mkstemp(path), saved;
	ssize_t n;

	if (fd < 0)
		return -1;
	unlink(path);
	fflush(stderr);
	saved = dup(2);
	dup2(fd, 2);
	fn();
	fflush(stderr);
	dup2(saved, 2);
	close(saved);
	lseek(fd, 0, SEEK_SET);
	n = read(fd, buf, size - 1);
	close(fd);
	buf[n > 0 ? n : 0] = '\0';
	return 0;
}

static void
free_held_mutex(void)
{
	kl_mutex *m;
	kl_token t;

	if (kl_mutex_new(&m, NULL) != KL_OK ||
	    kl_mutex_enter(m, 0, NULL, &t) != KL_OK)
		return;
	kl_mutex_free(m);
}

static void
free_busy_provider(void)
{
	kl_lock_opts lo = KL_LOCK_OPTS_INIT;
	kl_call call = { .key = "busy", .cancel = NULL };
	kl_provider *p;
	kl_lease *lease;
	kl_lock *l;

	if (kl_memory_provider_new(&p) != KL_OK)
		return;
	lo.provider = p;
	if (kl_lock_new(&l, &lo) != KL_OK ||
	    kl_lock_acquire(l, &call, &lease, NULL) != KL_OK)
		return;
	/* The lease is abandoned with the provider (a programming error;
	 * the child exits right after). */
	kl_provider_free(p);
}

static int
child_free_in_use(void *arg)
{
	char out[1024];

	(void)arg;
	CHILD_CHECK(capture_stderr(free_held_mutex, out, sizeof out) == 0,
		    "capture");
	CHILD_CHECK(strstr(out, "kl_mutex_free") != NULL,
		    "freeing a held mutex was not reported: '%s'", out);
	CHILD_CHECK(capture_stderr(free_busy_provider, out, sizeof out) == 0,
		    "capture");
	CHILD_CHECK(strstr(out, "keys held") != NULL,
		    "freeing a provider with a held key was not reported: "
		    "'%s'",
		    out);
	return 0;
}

START_TEST(test_t11_free_in_use_reported)
{
	st_begin("T11 freeing a held object is reported");
	run_child("free in use", child_free_in_use, NULL, 30000 * st_slow());
}
END_TEST

static Suite *
stress_misuse_suite(void)
{
	Suite *s = suite_create("stress_misuse");
	TCase *tc;

	tc = tcase_create("misuse");
	tcase_set_timeout(tc, ST_TIMEOUT);
	tcase_add_test(tc, test_t11_bad_tokens);
	tcase_add_test(tc, test_t11_bad_arguments);
	tcase_add_test(tc, test_t11_errorcheck);
	tcase_add_test(tc, test_t11_rogue_leaves);
	tcase_add_test(tc, test_t11_free_in_use_reported);
	suite_add_tcase(s, tc);
	return s;
}

int
main(void)
{
	return st_run(stress_misuse_suite());
}
