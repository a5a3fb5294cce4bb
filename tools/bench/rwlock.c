/* SPDX-License-Identifier: MIT */
/*
 * keylock-bench, the readers/writers workload: RW_THREADS threads on one
 * key, each request shared with probability 9/10 and exclusive otherwise,
 * a short section (RW_WORK_NS of spinning) and no work outside.  keylock
 * takes the key through two kl_locks on one private memory provider, one
 * made with KL_SHARED, one without; the baseline is a pthread_rwlock_t
 * with default attributes (glibc's prefer readers), what people write by
 * hand.  Both run in the same repetition, and the ratio printed is the
 * median of the per-repetition throughput ratios.
 *
 * Every request is timed (a worst wait must not be missed by sampling),
 * into one histogram per mode.  What a strict FIFO queue promises and can
 * be seen cheaply: a counter of grants (every successful acquire adds
 * one); a writer reads it before it asks and after it is granted, and the
 * difference is how many requests were granted while it waited.  On one
 * FIFO queue with T threads that is at most about T - 1 (each other thread
 * is ahead of it at most once, plus the readers granted together with one
 * in front of it and the small window between the read and the request);
 * a lock that lets readers pass a waiting writer shows it growing with the
 * run's length.  A writer preempted between the read and its request sees
 * the others run meanwhile, so the maximum is the scheduler's as much as
 * the lock's: the median and the 99th percentile over every writer are
 * reported beside it.  Reported, never judged.
 *
 * Checks: a writer inside with anyone else inside, or a reader inside with
 * a writer, is a violation (atomic counts of readers and writers inside),
 * which fails the run.  The most readers seen inside at once is reported:
 * 1 means the provider granted KL_SHARED exclusively.
 *
 * Threads and locking: the counts of who is inside and the grant counter
 * are atomics; each worker's histograms and counters are its own, read
 * after the join.
 */
#include "bench.h"

#define RW_THREADS 4
#define RW_SHARED_PER_10 9
#define RW_WORK_NS 200 /* a short section */

const char *const rw_kind_name[RW_KINDS] = { "kl_lock", "pthread_rwlock" };
const char *const rw_kind_label[RW_KINDS] = { "kl_lock KL_SHARED",
					      "pthread_rwlock" };

struct rwres rwres[RW_KINDS];
double rw_ratio;

struct rwshared {
	int kind;
	kl_lock *kl_sh, *kl_ex;
	pthread_rwlock_t rw;
	atomic_int ready;
	atomic_bool go, stop;
	atomic_int readers, writers; /* inside now */
	atomic_int max_readers;
	atomic_ullong grants;
	atomic_long violations;
	atomic_long errors;
};

struct rwworker {
	struct rwshared *sh;
	pthread_t tid;
	uint64_t rng;
	uint64_t ops;
	struct hist passed; /* grants while a writer of ours waited */
	int64_t end_ns;
	struct hist h[2]; /* [0] shared, [1] exclusive */
};

static uint64_t
rw_rand(uint64_t *s)
{
	/* xorshift64*: cheap, and private to each worker. */
	*s ^= *s >> 12;
	*s ^= *s << 25;
	*s ^= *s >> 27;
	return *s * UINT64_C(2685821657736338717);
}

static bool
rw_acquire(struct rwshared *sh, bool excl, kl_lease **lease)
{
	kl_call call = { .key = hot_key, .cancel = NULL };

	if (sh->kind == RW_PTHREAD)
		return (excl ? pthread_rwlock_wrlock(&sh->rw)
			     : pthread_rwlock_rdlock(&sh->rw)) == 0;
	return kl_lock_acquire(excl ? sh->kl_ex : sh->kl_sh, &call, lease,
			       NULL) == KL_OK;
}

static void
rw_release(struct rwshared *sh, kl_lease *lease)
{
	if (sh->kind == RW_PTHREAD)
		pthread_rwlock_unlock(&sh->rw);
	else
		kl_lease_release(lease);
}

static void
rw_enter(struct rwshared *sh, bool excl)
{
	if (excl) {
		if (atomic_fetch_add(&sh->writers, 1) != 0 ||
		    atomic_load(&sh->readers) != 0)
			atomic_fetch_add(&sh->violations, 1);
	} else {
		int r = atomic_fetch_add(&sh->readers, 1) + 1;
		int m = atomic_load_explicit(&sh->max_readers,
					     memory_order_relaxed);

		if (atomic_load(&sh->writers) != 0)
			atomic_fetch_add(&sh->violations, 1);
		while (r > m && !atomic_compare_exchange_weak(&sh->max_readers,
							      &m, r))
			;
	}
}

static void
rw_leave(struct rwshared *sh, bool excl)
{
	if (excl)
		atomic_fetch_sub(&sh->writers, 1);
	else
		atomic_fetch_sub(&sh->readers, 1);
}

static void *
rwworker_main(void *arg)
{
	struct rwworker *w = arg;
	struct rwshared *sh = w->sh;
	kl_lease *lease = NULL;
	uint64_t i;

	atomic_fetch_add(&sh->ready, 1);
	wait_true(&sh->go);
	for (i = 0; !atomic_load_explicit(&sh->stop, memory_order_relaxed);
	     i++) {
		bool excl = rw_rand(&w->rng) % 10 >= RW_SHARED_PER_10;
		unsigned long long g0 = atomic_load_explicit(
			&sh->grants, memory_order_relaxed);
		int64_t t0 = now_ns();

		if (!rw_acquire(sh, excl, &lease)) {
			atomic_fetch_add(&sh->errors, 1);
			break;
		}
		hist_add(&w->h[excl], now_ns() - t0);
		if (excl) {
			unsigned long long g1 = atomic_load_explicit(
				&sh->grants, memory_order_relaxed);

			hist_add(&w->passed, (int64_t)(g1 - g0));
		}
		atomic_fetch_add_explicit(&sh->grants, 1,
					  memory_order_relaxed);
		rw_enter(sh, excl);
		spin_for(RW_WORK_NS);
		rw_leave(sh, excl);
		rw_release(sh, lease);
	}
	w->ops = i;
	w->end_ns = now_ns();
	return NULL;
}

/* One run of kind for --duration; its figures go to repetition rep. */
static void
rw_run(struct rwshared *sh, int kind, int rep)
{
	struct rwworker w[RW_THREADS];
	struct rwres *r = &rwres[kind];
	uint64_t ops = 0;
	int64_t go_ns, end_ns = 0;
	int rc;

	sh->kind = kind;
	atomic_store(&sh->ready, 0);
	atomic_store(&sh->go, false);
	atomic_store(&sh->stop, false);
	atomic_store(&sh->max_readers, 0);
	atomic_store(&sh->grants, 0);
	memset(w, 0, sizeof w);
	for (int i = 0; i < RW_THREADS; i++) {
		pthread_attr_t a;

		w[i].sh = sh;
		w[i].rng = UINT64_C(0x9e3779b97f4a7c15) * (uint64_t)(i + 1) +
			   (uint64_t)rep;
		pinned_attr(&a, i);
		rc = pthread_create(&w[i].tid, &a, rwworker_main, &w[i]);
		pthread_attr_destroy(&a);
		if (rc != 0)
			die("pthread_create: %s", strerror(rc));
	}
	while (atomic_load(&sh->ready) < RW_THREADS)
		sched_yield();
	go_ns = now_ns();
	atomic_store(&sh->go, true);
	sleep_ns((int64_t)opt.duration_ms * 1000000);
	atomic_store(&sh->stop, true);
	for (int i = 0; i < RW_THREADS; i++)
		pthread_join(w[i].tid, NULL);
	for (int i = 0; i < RW_THREADS; i++) {
		ops += w[i].ops;
		if (w[i].end_ns > end_ns)
			end_ns = w[i].end_ns;
		hist_merge(&r->h[0], &w[i].h[0]);
		hist_merge(&r->h[1], &w[i].h[1]);
		hist_merge(&r->passed, &w[i].passed);
	}
	r->tput[rep] = (double)ops / ((double)(end_ns - go_ns) / 1e9);
	r->ops += ops;
	if ((int)atomic_load(&sh->max_readers) > r->max_readers)
		r->max_readers = atomic_load(&sh->max_readers);
	r->violations += atomic_load(&sh->violations);
	total_violations += atomic_load(&sh->violations);
	total_sections += ops;
	atomic_store(&sh->violations, 0);
	if (atomic_load(&sh->errors) != 0)
		die("readers/writers: %ld acquires failed",
		    atomic_load(&sh->errors));
}

void
run_rwlock(void)
{
	struct rwshared sh;
	kl_lock_opts o = KL_LOCK_OPTS_INIT;
	kl_provider *prov;
	int rc;

	progress("readers/writers");
	memset(&sh, 0, sizeof sh);
	if ((rc = kl_memory_provider_new(&prov)) != KL_OK)
		die("kl_memory_provider_new: %s", kl_strerror(rc));
	o.provider = prov;
	if ((rc = kl_lock_new(&sh.kl_ex, &o)) != KL_OK)
		die("kl_lock_new: %s", kl_strerror(rc));
	o.flags = KL_SHARED;
	if ((rc = kl_lock_new(&sh.kl_sh, &o)) != KL_OK)
		die("kl_lock_new (KL_SHARED): %s", kl_strerror(rc));
	if ((rc = pthread_rwlock_init(&sh.rw, NULL)) != 0)
		die("pthread_rwlock_init: %s", strerror(rc));
	for (int k = 0; k < RW_KINDS; k++)
		rwres[k].tput = xcalloc((size_t)opt.runs, sizeof(double));
	for (int i = 0; i < opt.runs; i++)
		for (int k = 0; k < RW_KINDS; k++)
			rw_run(&sh, k, i);
	rw_ratio = paired_ratio(rwres[RW_KL].tput, rwres[RW_PTHREAD].tput,
				opt.runs);
	rw_left = kl_memory_provider_size(prov);
	pthread_rwlock_destroy(&sh.rw);
	kl_lock_free(sh.kl_sh);
	kl_lock_free(sh.kl_ex);
	kl_provider_free(prov);
}

size_t rw_left;
const int rw_threads = RW_THREADS;
const int rw_shared_percent = RW_SHARED_PER_10 * 10;
const int rw_work_ns = RW_WORK_NS;
