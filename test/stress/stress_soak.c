/* SPDX-License-Identifier: MIT */
/*
 * Soak: a long mixed workload (TESTPLAN T27, tier P2: tools/test --soak).
 *
 * 16 threads over 64 keys for KL_SOAK_MINUTES (default 30; fractions
 * allowed, so KL_SOAK_MINUTES=0.2 is the 12 s smoke run of the stress
 * stage).  Keys 0-15 are kl_mutexes (enter with timeouts 0/1/10/100
 * ms/forever, with or without a cancel token that other threads fire,
 * try_enter, kl_mutex_run, leave with abort_pending now and then;
 * max_queue limits with each overflow strategy, changed at run time by
 * set_opts; four of them KL_EVENTUAL).  Keys 16-31 are memory-provider
 * keys through kl_lock (kl_lock_run and kl_lock_acquire/kl_lease_release,
 * timeouts 0, 10 ms and forever) with an events hook.  Keys 32-47 are
 * named locks of a private registry (kl_named_run, kl_named_run_cancel,
 * kl_named_set_opts, kl_named_remove).  Keys 48-63 are auto-reset
 * ResetEvents with a budget of one used as binary semaphores (wait is
 * acquire, set is release).  Besides, threads set, reset and wait (with
 * short timeouts) on four free events (manual, auto 1, 3, 8).
 *
 * Each key counts the threads inside it: two at once is a violation, and
 * inside, ten non-atomic increments then a check (CK's 10-step counter).
 * Criteria: 0 violations and 0 unexpected statuses; a watchdog thread
 * fails the run, dumping every thread and key, when no operation finished
 * for 10 s or one thread stayed 10 s (x st_slow) in one call; after a
 * warm-up (5 min, a third of shorter runs) RSS, sampled every 10 s (every
 * run/60, at least 0.5 s, in short runs) from /proc/self/statm, grows by
 * at most 1 MiB per 10 min (the least-squares slope; for runs shorter than
 * 10 min, at most 8 MiB from the first sample to the last; plain builds
 * only, see the end of test_t27_soak); the number of open descriptors
 * (/proc/self/fd) is the same at the end as at the start; every ACQUIRED
 * event has its RELEASED; nothing is left held or queued.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <check.h>
#include <dirent.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "keylock.h"
#include "stress.h"

#define S_THREADS 16
#define S_KEYS 64
#define S_GROUP 16 /* keys per API: mutex, lock, named, event */
#define S_FREE_EVENTS 4
#define S_STALL_NS (10000 * ST_MS)
#define S_RSS_EVERY_NS (10000 * ST_MS)
#define S_MAX_SAMPLES 4096

static const int64_t s_timeouts[] = { 0, 1, 10, 100, KL_FOREVER };
#define S_NTIMEOUTS 5
static const int64_t s_lock_timeouts[] = { 0, 10, KL_FOREVER };
#define S_NLOCKS 3

enum s_op {
	OP_IDLE,
	OP_ENTER,
	OP_TRY,
	OP_MUTEX_RUN,
	OP_LOCK_RUN,
	OP_LOCK_ACQUIRE,
	OP_NAMED,
	OP_EVENT_LOCK,
	OP_EVENT_FREE,
	OP_OTHER,
	OP_COUNT
};

static const char *const op_names[OP_COUNT] = {
	"idle",	     "mutex_enter", "mutex_try",  "mutex_run",
	"lock_run",  "lock_acquire", "named_run", "event_lock",
	"event_free", "other"
};

struct s_key {
	char name[24];
	atomic_int inside;
	long count; /* non-atomic, only inside */
	long entries;
};

struct soak;

struct s_worker {
	struct soak *s;
	int idx;
	pthread_t th;
	struct st_rng r;
	struct st_slot slot;
	atomic_int op, op_key;
	atomic_llong op_start;
	long ops[OP_COUNT];
	long outcomes[4]; /* OK, ETIMEDOUT, ECANCELED, EOVERFLOW */
};

struct soak {
	struct s_key keys[S_KEYS];
	kl_mutex *m[S_GROUP];
	kl_provider *p;
	kl_lock *locks[S_NLOCKS];
	kl_registry *reg;
	kl_reset_event *sem[S_GROUP];
	kl_reset_event *ev[S_FREE_EVENTS];
	struct s_worker w[S_THREADS];
	atomic_bool stop, wd_stop, trip;
	atomic_long progress, bad, violations, ev_acquired, ev_released,
		ev_rejected, ev_other;
	atomic_int exited;
	char trip_msg[8192];
	/* RSS samples after the warm-up: minutes since the start, KiB. */
	double rss_t[S_MAX_SAMPLES];
	long rss_kib[S_MAX_SAMPLES];
	int nrss;
	long rss_first, rss_max;
	int64_t t0, warmup_ns, nominal_ns;
};

static double
soak_minutes(void)
{
	const char *v = getenv("KL_SOAK_MINUTES");
	double m = 30;

	if (v != NULL && *v != '\0') {
		char *end;
		double d = strtod(v, &end);

		if (end != v && *end == '\0' && d > 0 && d < 100000)
			m = d;
	}
	return m;
}

static int
count_fds(void)
{
	DIR *d = opendir("/proc/self/fd");
	struct dirent *e;
	int n = 0;

	if (d == NULL)
		return -1;
	while ((e = readdir(d)) != NULL)
		if (e->d_name[0] != '.')
			n++;
	closedir(d);
	return n - 1; /* the directory's own descriptor */
}

/* ------------------------------------------------------------------ */
/* Critical sections                                                   */

static void
inside(struct soak *s, int k)
{
	struct s_key *key = &s->keys[k];

	if (atomic_fetch_add(&key->inside, 1) != 0)
		atomic_fetch_add(&s->violations, 1);
	for (int i = 0; i < 10; i++)
		key->count++;
	if (key->count % 10 != 0)
		atomic_fetch_add(&s->violations, 1);
	key->count -= 10;
	key->entries++;
	if (atomic_fetch_sub(&key->inside, 1) != 1)
		atomic_fetch_add(&s->violations, 1);
}

struct s_cs {
	struct soak *s;
	int key;
};

static int
cs_fn(void *arg)
{
	struct s_cs *cs = arg;

	inside(cs->s, cs->key);
	return 7;
}

/* ------------------------------------------------------------------ */
/* Workers                                                             */

static void
op_begin(struct s_worker *w, enum s_op op, int key)
{
	atomic_store(&w->op_key, key);
	atomic_store(&w->op_start, now_ns());
	atomic_store(&w->op, (int)op);
	w->ops[op]++;
}

static void
op_end(struct s_worker *w)
{
	atomic_store(&w->op, OP_IDLE);
	atomic_fetch_add(&w->s->progress, 1);
}

static void
outcome(struct s_worker *w, int rc)
{
	int i = st_outcome(rc);

	if (i >= 0)
		w->outcomes[i]++;
	else
		atomic_fetch_add(&w->s->bad, 1);
}

/* Fires the token of a worker picked at random. */
static void
fire_someone(struct s_worker *w)
{
	st_slot_fire(&w->s->w[st_below(&w->r, S_THREADS)].slot);
}

static void
do_mutex(struct s_worker *w)
{
	struct soak *s = w->s;
	int k = (int)st_below(&w->r, S_GROUP);
	kl_mutex *m = s->m[k];
	uint64_t pick = st_below(&w->r, 100);
	kl_token t;
	int rc;

	if (pick < 10) {
		op_begin(w, OP_TRY, k);
		rc = kl_mutex_try_enter(m, &t);
		if (rc == KL_OK) {
			inside(s, k);
			if (kl_mutex_leave(m, t, false) != KL_OK)
				atomic_fetch_add(&s->bad, 1);
		} else if (rc != KL_ETIMEDOUT) {
			atomic_fetch_add(&s->bad, 1);
		}
		op_end(w);
	} else if (pick < 25) {
		struct s_cs cs = { s, k };
		int res = 0;

		op_begin(w, OP_MUTEX_RUN, k);
		rc = kl_mutex_run(m, s_timeouts[st_below(&w->r, S_NTIMEOUTS)],
				  st_slot_token(&w->slot, &w->r), cs_fn, &cs,
				  &res);
		outcome(w, rc);
		if (rc == KL_OK && res != 7)
			atomic_fetch_add(&s->bad, 1);
		op_end(w);
	} else if (pick < 28) {
		kl_queue_opts o;

		/* Another limit and strategy; the flags stay. */
		op_begin(w, OP_OTHER, k);
		if (kl_mutex_get_opts(m, &o) != KL_OK)
			atomic_fetch_add(&s->bad, 1);
		o.max_queue = st_below(&w->r, 3) == 0
				      ? KL_UNBOUNDED
				      : (size_t)st_below(&w->r, 6);
		o.overflow = (kl_overflow)st_below(&w->r, 3);
		if (kl_mutex_set_opts(m, &o) != KL_OK)
			atomic_fetch_add(&s->bad, 1);
		op_end(w);
	} else {
		op_begin(w, OP_ENTER, k);
		rc = kl_mutex_enter(m, s_timeouts[st_below(&w->r, S_NTIMEOUTS)],
				    st_slot_token(&w->slot, &w->r), &t);
		outcome(w, rc);
		if (rc == KL_OK) {
			inside(s, k);
			if (kl_mutex_leave(m, t, st_below(&w->r, 50) == 0) !=
			    KL_OK)
				atomic_fetch_add(&s->bad, 1);
		}
		op_end(w);
	}
}

static void
on_event(const kl_event *ev, void *arg)
{
	struct soak *s = arg;

	switch (ev->type) {
	case KL_EV_ACQUIRED:
		atomic_fetch_add(&s->ev_acquired, 1);
		if (ev->waited_ms < 0 || ev->key == NULL)
			atomic_fetch_add(&s->bad, 1);
		break;
	case KL_EV_RELEASED:
		atomic_fetch_add(&s->ev_released, 1);
		if (ev->held_ms < 0)
			atomic_fetch_add(&s->bad, 1);
		break;
	case KL_EV_REJECTED:
		atomic_fetch_add(&s->ev_rejected, 1);
		if (ev->status != KL_ETIMEDOUT && ev->status != KL_ECANCELED)
			atomic_fetch_add(&s->bad, 1);
		break;
	default:
		atomic_fetch_add(&s->ev_other, 1);
		break;
	}
}

static void
do_lock(struct s_worker *w)
{
	struct soak *s = w->s;
	int k = (int)st_below(&w->r, S_GROUP);
	kl_call call = { s->keys[S_GROUP + k].name,
			 st_slot_token(&w->slot, &w->r) };
	kl_lock *l = s->locks[st_below(&w->r, S_NLOCKS)];
	kl_error err;
	int rc;

	if (st_below(&w->r, 2) == 0) {
		struct s_cs cs = { s, S_GROUP + k };
		int res = 0;

		op_begin(w, OP_LOCK_RUN, S_GROUP + k);
		rc = kl_lock_run(l, &call, cs_fn, &cs, &res, &err);
		outcome(w, rc);
		if (rc == KL_OK && res != 7)
			atomic_fetch_add(&s->bad, 1);
	} else {
		kl_lease *lease;

		op_begin(w, OP_LOCK_ACQUIRE, S_GROUP + k);
		rc = kl_lock_acquire(l, &call, &lease, &err);
		outcome(w, rc);
		if (rc == KL_OK) {
			if (!kl_lease_valid(lease) ||
			    strcmp(kl_lease_key(lease), call.key) != 0)
				atomic_fetch_add(&s->bad, 1);
			inside(s, S_GROUP + k);
			kl_lease_release(lease);
		}
	}
	op_end(w);
}

static void
do_named(struct s_worker *w)
{
	struct soak *s = w->s;
	int k = (int)st_below(&w->r, S_GROUP);
	const char *name = s->keys[2 * S_GROUP + k].name;
	uint64_t pick = st_below(&w->r, 100);
	struct s_cs cs = { s, 2 * S_GROUP + k };
	int res = 0, rc;

	if (pick < 3) {
		kl_queue_opts o = KL_QUEUE_OPTS_INIT;

		op_begin(w, OP_OTHER, 2 * S_GROUP + k);
		o.max_queue = st_below(&w->r, 2) == 0
				      ? KL_UNBOUNDED
				      : 1 + (size_t)st_below(&w->r, 4);
		o.overflow = (kl_overflow)st_below(&w->r, 3);
		if (kl_named_set_opts(s->reg, name, &o) != KL_OK)
			atomic_fetch_add(&s->bad, 1);
		op_end(w);
		return;
	}
	if (pick < 5) {
		op_begin(w, OP_OTHER, 2 * S_GROUP + k);
		rc = kl_named_remove(s->reg, name);
		if (rc != KL_OK && rc != KL_ENOTFOUND && rc != KL_EINVAL)
			atomic_fetch_add(&s->bad, 1);
		op_end(w);
		return;
	}
	op_begin(w, OP_NAMED, 2 * S_GROUP + k);
	if (pick < 50)
		rc = kl_named_run(s->reg, name,
				  s_timeouts[st_below(&w->r, S_NTIMEOUTS)],
				  cs_fn, &cs, &res);
	else
		rc = kl_named_run_cancel(
			s->reg, name, s_timeouts[st_below(&w->r, S_NTIMEOUTS)],
			st_slot_token(&w->slot, &w->r), cs_fn, &cs, &res);
	outcome(w, rc);
	if (rc == KL_OK && res != 7)
		atomic_fetch_add(&s->bad, 1);
	op_end(w);
}

static void
do_event(struct s_worker *w)
{
	struct soak *s = w->s;
	uint64_t pick = st_below(&w->r, 100);
	int rc;

	if (pick < 60) {
		/* A binary semaphore: nobody else sets or resets these. */
		int k = (int)st_below(&w->r, S_GROUP);

		op_begin(w, OP_EVENT_LOCK, 3 * S_GROUP + k);
		rc = kl_reset_event_wait(
			s->sem[k], s_timeouts[st_below(&w->r, S_NTIMEOUTS)],
			st_slot_token(&w->slot, &w->r));
		outcome(w, rc);
		if (rc == KL_OK) {
			inside(s, 3 * S_GROUP + k);
			kl_reset_event_set(s->sem[k]);
		}
		op_end(w);
		return;
	}
	kl_reset_event *e = s->ev[st_below(&w->r, S_FREE_EVENTS)];

	op_begin(w, OP_EVENT_FREE, -1);
	if (pick < 75) {
		kl_reset_event_set(e);
	} else if (pick < 85) {
		kl_reset_event_reset(e);
	} else {
		/* At most 100 ms: the main thread sets them only now and
		 * then. */
		rc = kl_reset_event_wait(e, s_timeouts[st_below(&w->r, 4)],
					 st_slot_token(&w->slot, &w->r));
		outcome(w, rc);
		if (rc == KL_EOVERFLOW)
			atomic_fetch_add(&s->bad, 1);
	}
	op_end(w);
}

static void *
s_main(void *arg)
{
	struct s_worker *w = arg;
	struct soak *s = w->s;

	while (!atomic_load(&s->stop)) {
		uint64_t pick = st_below(&w->r, 100);

		if (pick < 2) {
			op_begin(w, OP_OTHER, -1);
			fire_someone(w);
			op_end(w);
		} else if (pick < 40) {
			do_mutex(w);
		} else if (pick < 60) {
			do_lock(w);
		} else if (pick < 80) {
			do_named(w);
		} else {
			do_event(w);
		}
	}
	atomic_fetch_add(&s->exited, 1);
	return NULL;
}

/* ------------------------------------------------------------------ */
/* Watchdog                                                            */

static void
trip(struct soak *s, const char *why)
{
	size_t n = 0;
	int64_t now = now_ns();

	if (atomic_exchange(&s->trip, true))
		return;
	n += (size_t)snprintf(s->trip_msg + n, sizeof s->trip_msg - n,
			      "%s after %.1f s;", why,
			      (double)(now - s->t0) / 1e9);
	for (int i = 0; i < S_THREADS && n < sizeof s->trip_msg; i++) {
		struct s_worker *w = &s->w[i];
		int op = atomic_load(&w->op);

		n += (size_t)snprintf(
			s->trip_msg + n, sizeof s->trip_msg - n,
			" t%d %s key %d for %lld ms;", i, op_names[op],
			atomic_load(&w->op_key),
			op == OP_IDLE ? 0LL
				      : (long long)((now -
						     atomic_load(&w->op_start)) /
						    ST_MS));
	}
	for (int k = 0; k < S_GROUP && n < sizeof s->trip_msg; k++)
		n += (size_t)snprintf(
			s->trip_msg + n, sizeof s->trip_msg - n,
			" m%d %s q%zu;", k,
			kl_mutex_is_locked(s->m[k]) ? "held" : "free",
			kl_mutex_queue_size(s->m[k]));
	for (int k = 0; k < S_GROUP && n < sizeof s->trip_msg; k++)
		n += (size_t)snprintf(
			s->trip_msg + n, sizeof s->trip_msg - n,
			" n%d %s q%zu; e%d %s q%zu;", k,
			kl_named_is_locked(s->reg, s->keys[2 * S_GROUP + k].name)
				? "held"
				: "free",
			kl_named_queue_size(s->reg,
					    s->keys[2 * S_GROUP + k].name),
			k, kl_reset_event_is_signaled(s->sem[k]) ? "set" : "unset",
			kl_reset_event_queue_size(s->sem[k]));
	if (n < sizeof s->trip_msg)
		snprintf(s->trip_msg + n, sizeof s->trip_msg - n,
			 " memory provider: %zu keys", kl_memory_provider_size(s->p));
	fprintf(stderr, "stress: T27 watchdog: %s\n", s->trip_msg);
}

static void
rss_sample(struct soak *s, int64_t now)
{
	long kib = st_rss_kib();

	if (kib > s->rss_max)
		s->rss_max = kib;
	if (now - s->t0 < s->warmup_ns || s->nrss >= S_MAX_SAMPLES)
		return;
	if (s->nrss == 0)
		s->rss_first = kib;
	s->rss_t[s->nrss] = (double)(now - s->t0) / 60e9;
	s->rss_kib[s->nrss] = kib;
	s->nrss++;
}

static void *
s_watchdog(void *arg)
{
	struct soak *s = arg;
	long last = atomic_load(&s->progress);
	int64_t last_change = now_ns(), next_rss = now_ns(),
		stall = S_STALL_NS * st_slow(), every = s->nominal_ns / 60;

	/* Every 10 s; more often in short runs, at most twice a second. */
	if (every > S_RSS_EVERY_NS)
		every = S_RSS_EVERY_NS;
	if (every < 500 * ST_MS)
		every = 500 * ST_MS;

	while (!atomic_load(&s->wd_stop) && !atomic_load(&s->trip)) {
		int64_t now = now_ns();
		long p = atomic_load(&s->progress);

		if (p != last) {
			last = p;
			last_change = now;
		} else if (now - last_change > stall) {
			trip(s, "no operation finished for 10 s");
			break;
		}
		for (int i = 0; i < S_THREADS; i++) {
			struct s_worker *w = &s->w[i];

			if (atomic_load(&w->op) != OP_IDLE &&
			    now - atomic_load(&w->op_start) > stall &&
			    atomic_load(&w->op) != OP_IDLE) {
				char why[96];

				snprintf(why, sizeof why,
					 "thread %d stayed 10 s in one call", i);
				trip(s, why);
				break;
			}
		}
		if (now >= next_rss) {
			rss_sample(s, now);
			next_rss = now + every;
		}
		test_sleep_ms(100);
	}
	return NULL;
}

/* The least-squares slope of the RSS samples, KiB per minute. */
static double
rss_slope(const struct soak *s)
{
	double mt = 0, mk = 0, num = 0, den = 0;

	if (s->nrss < 3)
		return 0;
	for (int i = 0; i < s->nrss; i++) {
		mt += s->rss_t[i];
		mk += (double)s->rss_kib[i];
	}
	mt /= s->nrss;
	mk /= s->nrss;
	for (int i = 0; i < s->nrss; i++) {
		num += (s->rss_t[i] - mt) * ((double)s->rss_kib[i] - mk);
		den += (s->rss_t[i] - mt) * (s->rss_t[i] - mt);
	}
	return den > 0 ? num / den : 0;
}

/* ------------------------------------------------------------------ */

START_TEST(test_t27_soak)
{
	static struct soak s;
	static const size_t counts[S_FREE_EVENTS] = { KL_UNBOUNDED, 1, 3, 8 };
	double minutes = soak_minutes();
	int64_t nominal_ns = (int64_t)(minutes * 60e9), deadline, wall_ms;
	kl_lock_opts lo = KL_LOCK_OPTS_INIT;
	pthread_t wd;
	long ops[OP_COUNT], outs[4], entries = 0;
	struct st_rng r;
	int fds0, fds1;
	double slope;

	st_begin("T27 soak");
	memset(&s, 0, sizeof s);
	memset(ops, 0, sizeof ops);
	memset(outs, 0, sizeof outs);
	st_rng_init(&r, 0x2700);
	fds0 = count_fds();
	for (int k = 0; k < S_KEYS; k++)
		snprintf(s.keys[k].name, sizeof s.keys[k].name, "soak-%d", k);
	for (int k = 0; k < S_GROUP; k++) {
		kl_queue_opts qo = KL_QUEUE_OPTS_INIT;
		kl_reset_opts ro = KL_RESET_OPTS_INIT;

		qo.flags = k % 4 == 3 ? KL_EVENTUAL : 0;
		qo.max_queue = k % 4 == 0 ? KL_UNBOUNDED : (size_t)(k % 4);
		qo.overflow = (kl_overflow)(k % 3);
		st_assert(kl_mutex_new(&s.m[k], &qo) == KL_OK, "mutex");
		ro.auto_reset_count = 1;
		st_assert(kl_reset_event_new(&s.sem[k], true, &ro) == KL_OK,
			  "semaphore event");
	}
	for (int e = 0; e < S_FREE_EVENTS; e++) {
		kl_reset_opts o = KL_RESET_OPTS_INIT;

		o.auto_reset_count = counts[e];
		st_assert(kl_reset_event_new(&s.ev[e], false, &o) == KL_OK,
			  "event");
	}
	st_assert(kl_memory_provider_new(&s.p) == KL_OK, "provider");
	st_assert(kl_registry_new(&s.reg) == KL_OK, "registry");
	lo.provider = s.p;
	lo.on_event = on_event;
	lo.event_arg = &s;
	for (int i = 0; i < S_NLOCKS; i++) {
		lo.timeout_ms = s_lock_timeouts[i];
		st_assert(kl_lock_new(&s.locks[i], &lo) == KL_OK, "lock");
	}
	for (int i = 0; i < S_THREADS; i++) {
		struct s_worker *w = &s.w[i];

		w->s = &s;
		w->idx = i;
		st_rng_init(&w->r, 0x2710 + (uint64_t)i);
		st_slot_init(&w->slot);
	}
	s.t0 = now_ns();
	s.nominal_ns = nominal_ns;
	s.warmup_ns = nominal_ns / 3 < 300000 * ST_MS ? nominal_ns / 3
						      : 300000 * ST_MS;
	st_note("%g minutes, %d threads, %d keys, warm-up %lld s; %d fds",
		minutes, S_THREADS, S_KEYS, (long long)(s.warmup_ns / 1000000000),
		fds0);
	st_thread_start(&wd, 0, s_watchdog, &s);
	deadline = s.t0 + nominal_ns;
	for (int i = 0; i < S_THREADS; i++)
		st_thread_start(&s.w[i].th, 0, s_main, &s.w[i]);
	/* Set a free event now and then, and report once a minute. */
	{
		int64_t next_note = s.t0 + 60000 * ST_MS;

		while (now_ns() < deadline && !atomic_load(&s.trip)) {
			test_sleep_ms(10);
			kl_reset_event_set(s.ev[st_below(&r, S_FREE_EVENTS)]);
			if (now_ns() >= next_note) {
				st_note("%ld operations, RSS %ld KiB, %ld "
					"violations, %ld bad",
					atomic_load(&s.progress), st_rss_kib(),
					atomic_load(&s.violations),
					atomic_load(&s.bad));
				next_note += 60000 * ST_MS;
			}
		}
	}
	atomic_store(&s.stop, true);
	if (!st_drain(&s.exited, S_THREADS, &s.trip, s.ev, S_FREE_EVENTS))
		trip(&s, "threads did not stop within 20 s");
	/* Stuck threads cannot be joined: this fails the test at once (and
	 * ends the process under CK_FORK=no: see st_fail_prepare). */
	st_assert(!atomic_load(&s.trip), "watchdog: %s", s.trip_msg);
	wall_ms = (now_ns() - s.t0) / ST_MS;
	atomic_store(&s.wd_stop, true);
	st_thread_join(wd);
	for (int i = 0; i < S_THREADS; i++) {
		st_thread_join(s.w[i].th);
		for (int o = 0; o < OP_COUNT; o++)
			ops[o] += s.w[i].ops[o];
		for (int o = 0; o < 4; o++)
			outs[o] += s.w[i].outcomes[o];
	}
	for (int k = 0; k < S_KEYS; k++)
		entries += s.keys[k].entries;
	slope = rss_slope(&s);
	st_note("%lld ms: mutex enter %ld, try %ld, run %ld; lock run %ld, "
		"acquire %ld; named %ld; event lock %ld, free %ld; other %ld; "
		"ok %ld, timed out %ld, canceled %ld, overflow %ld; %ld "
		"critical sections; events: %ld acquired, %ld released, %ld "
		"rejected, %ld other; %ld violations, %ld bad",
		(long long)wall_ms, ops[OP_ENTER], ops[OP_TRY],
		ops[OP_MUTEX_RUN], ops[OP_LOCK_RUN], ops[OP_LOCK_ACQUIRE],
		ops[OP_NAMED], ops[OP_EVENT_LOCK], ops[OP_EVENT_FREE],
		ops[OP_OTHER], outs[0], outs[1], outs[2], outs[3], entries,
		atomic_load(&s.ev_acquired), atomic_load(&s.ev_released),
		atomic_load(&s.ev_rejected), atomic_load(&s.ev_other),
		atomic_load(&s.violations), atomic_load(&s.bad));
	st_note("RSS: %d samples after the warm-up, first %ld KiB, last %ld "
		"KiB, max %ld KiB, slope %.1f KiB/min (%.1f KiB per 10 min)",
		s.nrss, s.rss_first, s.nrss > 0 ? s.rss_kib[s.nrss - 1] : 0,
		s.rss_max, slope, slope * 10);

	st_assert(atomic_load(&s.violations) == 0, "%ld in-CS violations",
		  atomic_load(&s.violations));
	st_assert(atomic_load(&s.bad) == 0, "%ld unexpected statuses",
		  atomic_load(&s.bad));
	st_assert(entries > 0, "no critical section ran");
	st_assert(atomic_load(&s.ev_acquired) == atomic_load(&s.ev_released),
		  "%ld ACQUIRED events, %ld RELEASED",
		  atomic_load(&s.ev_acquired), atomic_load(&s.ev_released));
	st_assert(atomic_load(&s.ev_other) == 0, "%ld LOST or RELEASE_FAILED",
		  atomic_load(&s.ev_other));
	/* Under ThreadSanitizer RSS holds the sanitizer's own shadow and
	 * metadata (its stack depot never shrinks), which keep growing slowly
	 * however flat the library is: 0.9 MiB per 10 min over a 30 min run,
	 * 1.8 over a 10 min one, where the plain build stays at 0 (2 CPUs,
	 * 2026-11): reported, not judged. */
	if (st_tsan()) {
		st_note("RSS not judged under ThreadSanitizer");
	} else if (minutes >= 10) {
		st_assert(slope * 10 <= 1024,
			  "RSS grows %.1f KiB per 10 min after the warm-up",
			  slope * 10);
	} else if (s.nrss > 0) {
		st_assert(s.rss_kib[s.nrss - 1] - s.rss_first <= 8192,
			  "RSS grew %ld KiB after the warm-up",
			  s.rss_kib[s.nrss - 1] - s.rss_first);
	}
	for (int k = 0; k < S_GROUP; k++) {
		st_assert(!kl_mutex_is_locked(s.m[k]) &&
				  kl_mutex_queue_size(s.m[k]) == 0,
			  "mutex %d left held or queued", k);
		st_assert(kl_reset_event_is_signaled(s.sem[k]) &&
				  kl_reset_event_queue_size(s.sem[k]) == 0,
			  "semaphore event %d left taken or waited on", k);
		st_assert(!kl_named_is_locked(s.reg,
					      s.keys[2 * S_GROUP + k].name),
			  "named lock %d left held", k);
		kl_mutex_free(s.m[k]);
		kl_reset_event_free(s.sem[k]);
	}
	for (int e = 0; e < S_FREE_EVENTS; e++) {
		st_assert(kl_reset_event_queue_size(s.ev[e]) == 0,
			  "event %d has waiters", e);
		kl_reset_event_free(s.ev[e]);
	}
	st_assert(kl_memory_provider_size(s.p) == 0, "provider keeps %zu",
		  kl_memory_provider_size(s.p));
	for (int i = 0; i < S_NLOCKS; i++)
		kl_lock_free(s.locks[i]);
	kl_provider_free(s.p);
	kl_registry_free(s.reg);
	for (int i = 0; i < S_THREADS; i++) {
		st_slot_fini(&s.w[i].slot);
	}
	fds1 = count_fds();
	st_note("descriptors: %d at the start, %d at the end", fds0, fds1);
	st_assert(fds0 == fds1, "%d descriptors at the start, %d at the end",
		  fds0, fds1);
}
END_TEST

static Suite *
stress_soak_suite(void)
{
	Suite *s = suite_create("stress_soak");
	TCase *tc = tcase_create("soak");

	/* The run plus a margin for stopping, joining and the sanitizers. */
	tcase_set_timeout(tc, soak_minutes() * 60 * 1.25 + 120);
	tcase_add_test(tc, test_t27_soak);
	suite_add_tcase(s, tc);
	return s;
}

int
main(void)
{
	return st_run(stress_soak_suite());
}
