/* SPDX-License-Identifier: MIT */
/*
 * keylock-bench, contended workloads: throughput and fairness across threads,
 * and hand-off latency (sleeping and spinning waiters).
 */
#include "bench.h"

/* ------------------------------------------------------------------ */
/* Contended workloads                                                 */

const int thread_counts[] = { 2, 4, 8 };

const char *const sec_name[NSEC] = { "empty", "work" };

struct cshared {
	struct subject *s;
	int64_t work_in, work_out; /* ns */
	bool count;
	bool locked; /* false: no lock (K_NONE), nothing shared to check */
	int nthreads;
	atomic_int ready, entered;
	atomic_bool go, stop, counting;
	int64_t window_ns; /* written before counting is set */
	atomic_long violations;
	/* Guarded by the lock under test; volatile so that each access
	 * really happens where the invariant is checked. */
	volatile int inside;
	volatile uint64_t counter;
	volatile int last_owner;
	volatile uint64_t changes;
};

struct cworker {
	struct cshared *sh;
	pthread_t tid;
	int id;
	uint64_t ops;
	uint64_t base; /* acquisitions before the window, 0 until it opens */
	int64_t end_ns;
	int64_t cpu0_ns, cpu1_ns; /* its CPU time when the window opened, at
				   * the end */
	struct csample c0, c1;
	struct hist h;
};

/* This thread's CPU time, 0 where the clock is missing.  With real work
 * outside the lock, how many grants a thread gets in a window followed
 * how much CPU the scheduler gave it (kl_lock, 4 threads on 2 CPUs:
 * grants max/min 1.0 to 2.1, CPU time max/min the same within 0.05,
 * grants per CPU second 1.01 to 1.08), so the bench shows both. */
static int64_t
thread_cpu_ns(void)
{
#ifdef CLOCK_THREAD_CPUTIME_ID
	struct timespec ts;

	if (clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts) != 0)
		return 0;
	return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
#else
	return 0;
#endif
}

/* After turn i of w's loop: the window opens when the last thread has
 * had its first turn; each thread counts from its next one. */
static inline void
window_step(struct cshared *sh, struct cworker *w, uint64_t i)
{
	if (i == 0 &&
	    atomic_fetch_add(&sh->entered, 1) == sh->nthreads - 1) {
		sh->window_ns = now_ns();
		atomic_store_explicit(&sh->counting, true,
				      memory_order_release);
	}
	if (w->base == 0 &&
	    atomic_load_explicit(&sh->counting, memory_order_relaxed)) {
		w->base = i + 1;
		/* Not in a run that counts system calls: it makes one. */
		if (!sh->count)
			w->cpu0_ns = thread_cpu_ns();
	}
}

/* The loop with no lock (K_NONE): the same work, nothing shared to check
 * and no wait to time.  A loop of its own, so that the locks' loop is
 * not slowed by a test of which it is: a barging lock's rate moves with a
 * few nanoseconds there. */
static uint64_t
unlocked_loop(struct cworker *w)
{
	struct cshared *sh = w->sh;
	uint64_t i;

	for (i = 0; !atomic_load_explicit(&sh->stop, memory_order_relaxed);
	     i++) {
		spin_for(sh->work_in);
		window_step(sh, w, i);
		spin_for(sh->work_out);
	}
	return i;
}

static uint64_t
locked_loop(struct cworker *w)
{
	struct cshared *sh = w->sh;
	union hold h;
	uint64_t i;

	/* Relaxed: stop only ends the loop, it publishes nothing. */
	for (i = 0; !atomic_load_explicit(&sh->stop, memory_order_relaxed);
	     i++) {
		/* One acquisition in 8 is timed: two clock reads per
		 * acquisition would halve a barging lock's throughput. */
		bool timed = (i & 7) == 0;
		int64_t t0 = timed ? now_ns() : 0;

		subject_acquire(sh->s, hot_key, &h);
		if (timed)
			hist_add(&w->h, now_ns() - t0);
		if (sh->inside++ != 0)
			atomic_fetch_add(&sh->violations, 1);
		sh->counter++;
		if (sh->last_owner != w->id) {
			sh->last_owner = w->id;
			sh->changes++;
		}
		spin_for(sh->work_in);
		if (--sh->inside != 0)
			atomic_fetch_add(&sh->violations, 1);
		subject_release(sh->s, &h);
		window_step(sh, w, i);
		spin_for(sh->work_out);
	}
	return i;
}

static void *
cworker_main(void *arg)
{
	struct cworker *w = arg;
	struct cshared *sh = w->sh;
	struct counters ctr = { -1, -1 };

	if (sh->count)
		counters_open(&ctr);
	atomic_fetch_add(&sh->ready, 1);
	wait_true(&sh->go);
	if (sh->count)
		counters_sample(&ctr, &w->c0);
	w->ops = sh->locked ? locked_loop(w) : unlocked_loop(w);
	w->end_ns = now_ns();
	if (!sh->count)
		w->cpu1_ns = thread_cpu_ns();
	if (sh->count) {
		counters_sample(&ctr, &w->c1);
		counters_close(&ctr);
	}
	return NULL;
}

/* How long a contended run waits for its last thread to take the lock
 * once before it gives up and measures from the start (a starved thread
 * then shows as an infinite fairness). */
#define ENTRY_WAIT_MS 2000

/*
 * Throughput and fairness count only the window after every thread has
 * taken the lock once, and the window lasts --duration.  Before it the
 * figures measure how soon the scheduler first runs each new thread: on 2
 * CPUs the last of 8 threads could start 3 to 7 ms after the first, while
 * the others took the lock hundreds of times among themselves, and even
 * the FIFO baseline then scored max/min 1.1 to 1.6 though within the
 * window every thread had the same count.  The from-start figure is still
 * reported (JSON) beside it.
 */
void
run_contended(struct subject *s, int nthreads, int sec, bool count,
	      struct hist *into, struct crun *out)
{
	struct cshared sh;
	struct cworker *w = xcalloc((size_t)nthreads, sizeof *w);
	uint64_t min = UINT64_MAX, max = 0, amin = UINT64_MAX, amax = 0;
	uint64_t wops = 0;
	double rmin = INFINITY, rmax = 0;
	bool starved = false, cpu_unknown = false;
	int64_t go_ns, from_ns, end_ns = 0;
	bool windowed;
	int rc;

	memset(&sh, 0, sizeof sh);
	sh.s = s;
	sh.nthreads = nthreads;
	sh.work_in = sec ? WORK_IN_NS : 0;
	sh.work_out = sec ? WORK_OUT_NS : 0;
	sh.count = count;
	sh.locked = s->kind != K_NONE;
	atomic_init(&sh.ready, 0);
	atomic_init(&sh.entered, 0);
	atomic_init(&sh.go, false);
	atomic_init(&sh.stop, false);
	atomic_init(&sh.counting, false);
	atomic_init(&sh.violations, 0);
	sh.last_owner = -1;
	for (int i = 0; i < nthreads; i++) {
		pthread_attr_t a;

		w[i].sh = &sh;
		w[i].id = i;
		pinned_attr(&a, i);
		rc = pthread_create(&w[i].tid, &a, cworker_main, &w[i]);
		pthread_attr_destroy(&a);
		if (rc != 0)
			die("pthread_create: %s", strerror(rc));
	}
	while (atomic_load(&sh.ready) < nthreads)
		sched_yield();
	go_ns = now_ns();
	atomic_store(&sh.go, true);
	while (!atomic_load_explicit(&sh.counting, memory_order_acquire) &&
	       now_ns() - go_ns < (int64_t)ENTRY_WAIT_MS * 1000000)
		sleep_ns(100000);
	sleep_ns((int64_t)opt.duration_ms * 1000000);
	atomic_store(&sh.stop, true);

	memset(out, 0, sizeof *out);
	for (int i = 0; i < nthreads; i++)
		pthread_join(w[i].tid, NULL);
	/* After the joins: every worker's writes are visible. */
	windowed = atomic_load(&sh.counting);
	from_ns = windowed ? sh.window_ns : go_ns;
	for (int i = 0; i < nthreads; i++) {
		/* A thread that never saw the window open took nothing in
		 * it. */
		uint64_t n = !windowed ? w[i].ops
			     : w[i].base != 0 ? w[i].ops - w[i].base
					      : 0;
		wops += n;
		/* Per CPU second: infinite when a thread starved in the
		 * window, as max/min is; unknown without the window or the
		 * clock. */
		if (windowed && n == 0) {
			starved = true;
		} else if (!windowed || w[i].cpu0_ns <= 0 ||
			   w[i].cpu1_ns <= w[i].cpu0_ns) {
			cpu_unknown = true;
		} else {
			double r = (double)n /
				   (double)(w[i].cpu1_ns - w[i].cpu0_ns);

			if (r < rmin)
				rmin = r;
			if (r > rmax)
				rmax = r;
		}
		if (n < min)
			min = n;
		if (n > max)
			max = n;
		if (w[i].ops < amin)
			amin = w[i].ops;
		if (w[i].ops > amax)
			amax = w[i].ops;
		out->ops += w[i].ops;
		if (w[i].end_ns > end_ns)
			end_ns = w[i].end_ns;
		if (into != NULL)
			hist_merge(into, &w[i].h);
		if (count) {
			out->sys.futex += w[i].c1.futex - w[i].c0.futex;
			out->sys.all += since(w[i].c0.all, w[i].c1.all);
			out->sys.vcsw += w[i].c1.vcsw - w[i].c0.vcsw;
			out->sys.ivcsw += w[i].c1.ivcsw - w[i].c0.ivcsw;
		}
	}
	out->changes = sh.changes;
	out->sections = sh.locked ? out->ops : 0;
	out->violations = atomic_load(&sh.violations);
	/* A lost update inside the section is a violation too. */
	if (sh.locked && sh.counter != out->ops)
		out->violations += 1;
	out->tput = (double)wops / ((double)(end_ns - from_ns) / 1e9);
	out->fair = min > 0 ? (double)max / (double)min : INFINITY;
	out->fair_all = amin > 0 ? (double)amax / (double)amin : INFINITY;
	out->fair_cpu = starved ? INFINITY : cpu_unknown ? NAN : rmax / rmin;
	out->chg = sh.locked && out->ops > 0
			   ? (double)out->changes / (double)out->ops
			   : NAN;
	free(w);
}

struct cres cres[NKINDS][NTHR][NSEC];
struct cres cres_hog[NKINDS][NTHR][NSEC];
struct cres cres_alt[NKINDS];
long total_violations;
uint64_t total_sections;

static void
record(struct cres *c, int i, const struct crun *r)
{
	c->tput[i] = r->tput;
	c->fair[i] = r->fair;
	c->fair_all[i] = r->fair_all;
	c->fair_cpu[i] = r->fair_cpu;
	c->chg[i] = r->chg;
	c->ops += r->ops;
	c->violations += r->violations;
	total_violations += r->violations;
	total_sections += r->sections;
}

/* Repetition i of every lock, thread count and section into into. */
static void
contended_pass(struct cres into[NKINDS][NTHR][NSEC], int i)
{
	struct crun r;

	for (int t = 0; t < NTHR; t++)
		for (int sec = 0; sec < NSEC; sec++)
			for (int k = 0; k < NKINDS; k++) {
				struct cres *c = &into[k][t][sec];

				run_contended(&subjects[k], thread_counts[t],
					      sec, false, &c->h, &r);
				record(c, i, &r);
			}
}

/*
 * Each repetition measures, back to back: every workload in the chosen mode
 * (unpinned unless --pin), 2 threads with an empty section in the other
 * mode, then every workload again in the chosen mode beside the background
 * CPU hog.  The hog is started and killed around its pass, so the other
 * passes run without it.
 */
void
run_contended_all(void)
{
	struct crun r;

	progress("contended");
	for (int i = 0; i < opt.runs; i++) {
		pin_now = opt.pin;
		contended_pass(cres, i);
		pin_now = !opt.pin;
		for (int k = 0; k < NKINDS; k++) {
			run_contended(&subjects[k], 2, 0, false,
				      &cres_alt[k].h, &r);
			record(&cres_alt[k], i, &r);
		}
		pin_now = opt.pin;
		hog_start();
		contended_pass(cres_hog, i);
		hog_stop();
	}
}

/* ------------------------------------------------------------------ */
/* Hand-off latency                                                    */

/*
 * Per sample: the main thread holds the lock and lets the waiter start; the
 * waiter notes the time and calls acquire.  For a sleeping waiter the holder
 * then sleeps HANDOFF_SLEEP_NS, long after any waiter has parked; for a
 * spinning one it releases HANDOFF_SPIN_NS after the waiter's call, while a
 * lock that spins before parking is still spinning (one that parks at once
 * is then asleep, or on its way).  The latency runs from just before the
 * release to the waiter's first instruction after acquire returns.
 */
struct hshared {
	struct subject *s;
	int samples;
	atomic_int go, arrived, done;
	_Atomic int64_t arrive_ns;
	int64_t rel_ns; /* written before release, read after acquire */
	int rel_cpu;    /* the same */
	double *lat;
	int beside; /* grants the waiter ran on the releaser's CPU */
};

static int
cpu_now(void)
{
#ifdef __linux__
	return sched_getcpu();
#else
	return -1;
#endif
}

/* Whether this thread runs on CPU rel, as far as it can tell. */
static bool
runs_on(int rel)
{
#ifdef __linux__
	return rel >= 0 && sched_getcpu() == rel;
#else
	(void)rel;
	return false;
#endif
}

static void *
hwaiter_main(void *arg)
{
	struct hshared *sh = arg;
	union hold h;

	for (int i = 1; i <= sh->samples; i++) {
		wait_int(&sh->go, i);
		/* Relaxed: published by the release store of arrived. */
		atomic_store_explicit(&sh->arrive_ns, now_ns(),
				      memory_order_relaxed);
		atomic_store_explicit(&sh->arrived, i, memory_order_release);
		subject_acquire(sh->s, hot_key, &h);
		sh->lat[i - 1] = (double)(now_ns() - sh->rel_ns);
		if (runs_on(sh->rel_cpu))
			sh->beside++;
		subject_release(sh->s, &h);
		atomic_store_explicit(&sh->done, i, memory_order_release);
	}
	return NULL;
}

const char *const place_name[NPLACE] = { "unpinned", "other CPU",
					 "same CPU" };

/* Places this thread (the holder) and the waiter's attributes for p; the
 * holder's slot is 0.  Pinned placements pin whatever --pin says. */
static void
place(enum place p, pthread_attr_t *waiter)
{
	pin_now = p != P_UNPINNED;
	pin_self(0);
	pinned_attr(waiter, p == P_TOGETHER ? 0 : 1);
}

static void
run_handoff(struct subject *s, bool spinning, int samples, enum place p,
	    struct hres *into, int run)
{
	struct hshared sh;
	pthread_attr_t a;
	pthread_t t;
	union hold h;
	int rc;

	memset(&sh, 0, sizeof sh);
	sh.s = s;
	sh.samples = samples;
	atomic_init(&sh.go, 0);
	atomic_init(&sh.arrived, 0);
	atomic_init(&sh.done, 0);
	atomic_init(&sh.arrive_ns, 0);
	sh.lat = xcalloc((size_t)samples, sizeof *sh.lat);
	place(p, &a);
	rc = pthread_create(&t, &a, hwaiter_main, &sh);
	pthread_attr_destroy(&a);
	if (rc != 0)
		die("pthread_create: %s", strerror(rc));
	for (int i = 1; i <= samples; i++) {
		subject_acquire(s, hot_key, &h);
		atomic_store_explicit(&sh.go, i, memory_order_release);
		wait_int(&sh.arrived, i);
		if (spinning) {
			int64_t at = atomic_load_explicit(
				&sh.arrive_ns, memory_order_relaxed);

			while (now_ns() < at + HANDOFF_SPIN_NS)
				cpu_relax();
		} else {
			sleep_ns(HANDOFF_SLEEP_NS);
		}
		sh.rel_cpu = cpu_now();
		sh.rel_ns = now_ns();
		subject_release(s, &h);
		wait_int(&sh.done, i);
	}
	pthread_join(t, NULL);
	pin_now = opt.pin;
	pin_self(0);
	qsort(sh.lat, (size_t)samples, sizeof *sh.lat, cmp_double);
	into->p50[run] = sh.lat[(samples + 1) / 2 - 1];
	into->p99[run] = sh.lat[(int)ceil(0.99 * samples) - 1];
	into->beside[run] = (double)sh.beside / samples;
	if (!into->ran || sh.lat[samples - 1] > into->max)
		into->max = sh.lat[samples - 1];
	into->ran = true;
	free(sh.lat);
}

const enum kind hand_kinds[] = { K_PTHREAD, K_FIFO, K_KL_MUTEX,
					K_KL_LOCK };
const char *const hand_mode[2] = { "sleeping", "spinning" };

struct hres hres[NPLACE][NHAND][2];

/* A spinning waiter on its holder's CPU measures how long the scheduler
 * lets a spin keep the CPU the release needs (a tick, for a lock that
 * never yields), not a hand-off: that placement is for sleeping ones. */
void
run_handoff_all(void)
{
	progress("hand-off latency");
	for (int i = 0; i < opt.runs; i++)
		for (int p = 0; p < NPLACE; p++)
			for (int m = 0; m < 2; m++) {
				if (m == 1 && p == P_TOGETHER)
					continue;
				/* No second CPU to pin to (or no pinning):
				 * not measured rather than mislabelled. */
				if ((p == P_APART && ncpus < 2) ||
				    (p == P_TOGETHER && ncpus < 1))
					continue;
				for (int k = 0; k < NHAND; k++)
					run_handoff(&subjects[hand_kinds[k]],
						    m == 1,
						    m ? opt.hand_spin
						      : opt.hand_sleep,
						    (enum place)p,
						    &hres[p][k][m], i);
			}
}
