/* SPDX-License-Identifier: MIT */
/*
 * keylock-bench, uncontended workloads (one thread, direct calls) and the
 * system calls an operation makes, alone and under contention.
 */
#include "bench.h"

double *ures[NUROWS];

double
per_op(int64_t t0, long n)
{
	return (double)(now_ns() - t0) / (double)n;
}

static double
u_pthread(long n)
{
	pthread_mutex_t *m = &subjects[K_PTHREAD].pm;
	int64_t t0 = now_ns();

	for (long i = 0; i < n; i++) {
		pthread_mutex_lock(m);
		pthread_mutex_unlock(m);
	}
	return per_op(t0, n);
}

static double
u_striped(long n)
{
	int64_t t0 = now_ns();

	for (long i = 0; i < n; i++) {
		pthread_mutex_t *m = stripe_of(hot_key);

		pthread_mutex_lock(m);
		pthread_mutex_unlock(m);
	}
	return per_op(t0, n);
}

static double
u_fifo(long n)
{
	struct fifo *f = &subjects[K_FIFO].fifo;
	int64_t t0 = now_ns();

	for (long i = 0; i < n; i++) {
		fifo_acquire(f);
		fifo_release(f);
	}
	return per_op(t0, n);
}

static double
u_kl_mutex(long n)
{
	kl_mutex *m = subjects[K_KL_MUTEX].km;
	kl_token t;
	int64_t t0 = now_ns();
	int rc;

	for (long i = 0; i < n; i++) {
		if ((rc = kl_mutex_enter(m, KL_FOREVER, NULL, &t)) != KL_OK)
			die("kl_mutex_enter: %s", kl_strerror(rc));
		kl_mutex_leave(m, t, false);
	}
	return per_op(t0, n);
}

/* n acquire+release pairs cycling over keys first .. first + nk - 1. */
double
u_kl_lock(kl_lock *l, size_t first, size_t nk, long n)
{
	kl_call call = { .key = NULL, .cancel = NULL };
	kl_lease *lease;
	size_t j = 0;
	int64_t t0 = now_ns();
	int rc;

	for (long i = 0; i < n; i++) {
		call.key = key_at(first + j);
		if (++j == nk)
			j = 0;
		if ((rc = kl_lock_acquire(l, &call, &lease, NULL)) != KL_OK)
			die("kl_lock_acquire: %s", kl_strerror(rc));
		kl_lease_release(lease);
	}
	return per_op(t0, n);
}

static double
u_row(enum urow r, long scale)
{
	kl_lock *l = subjects[K_KL_LOCK].kl;

	switch (r) {
	case U_PTHREAD:
		return u_pthread(opt.iters_lock / scale);
	case U_STRIPED:
		return u_striped(opt.iters_lock / scale);
	case U_FIFO:
		return u_fifo(opt.iters_lock / scale);
	case U_KL_MUTEX:
		return u_kl_mutex(opt.iters_lock / scale);
	case U_KEYS1:
		return u_kl_lock(l, 0, 1, opt.iters_keyed / scale);
	case U_KEYS1K:
		return u_kl_lock(l, 0, 1000, opt.iters_keyed / scale);
	case U_KEYSN:
		return u_kl_lock(l, 0, opt.nkeys, (long)opt.nkeys / scale);
	default:
		return NAN;
	}
}

void
run_uncontended(void)
{
	progress("uncontended");
	/* A short pass first: faults the keys in, warms malloc's bins. */
	for (int r = 0; r < U_HELD; r++)
		u_row((enum urow)r, 10);
	for (int i = 0; i < opt.runs; i++)
		for (int r = 0; r < U_HELD; r++)
			ures[r][i] = u_row((enum urow)r, 1);
}

const enum urow sys_urows[] = { U_PTHREAD, U_FIFO, U_KL_MUTEX,
				       U_KEYS1, U_KEYS1K };
struct sysres sys_un[NSYSU];
const int sys_threads[] = { 2, 4 };
struct sysres sys_ct[NKINDS][NSYST];

void
run_syscalls(void)
{
	struct counters c;
	struct csample a, b;
	struct crun r;
	long saved_lock = opt.iters_lock, saved_keyed = opt.iters_keyed;

	progress("system calls");
	counters_open(&c);
	opt.iters_lock = opt.iters_keyed = opt.iters_sys;
	for (int i = 0; i < NSYSU; i++) {
		struct sysres *s = &sys_un[i];

		u_row(sys_urows[i], 10); /* warm: no first-time brk */
		counters_sample(&c, &a);
		u_row(sys_urows[i], 1);
		counters_sample(&c, &b);
		s->done = true;
		s->n = (uint64_t)opt.iters_sys;
		s->futex = (double)(b.futex - a.futex) / (double)s->n;
		s->all = (double)since(a.all, b.all) / (double)s->n;
		s->vcsw = (double)(b.vcsw - a.vcsw) / (double)s->n;
		s->ivcsw = (double)(b.ivcsw - a.ivcsw) / (double)s->n;
	}
	opt.iters_lock = saved_lock;
	opt.iters_keyed = saved_keyed;
	counters_close(&c);

	/* Not K_NONE: a loop with no lock makes no system call. */
	for (int t = 0; t < NSYST; t++)
		for (int k = 0; k < K_NONE; k++) {
			struct sysres *s = &sys_ct[k][t];

			run_contended(&subjects[k], sys_threads[t], 0, true,
				      NULL, &r);
			total_violations += r.violations;
			total_sections += r.sections;
			s->done = true;
			s->n = r.ops;
			s->futex = (double)r.sys.futex / (double)r.ops;
			s->all = (double)r.sys.all / (double)r.ops;
			s->vcsw = (double)r.sys.vcsw / (double)r.ops;
			s->ivcsw = (double)r.sys.ivcsw / (double)r.ops;
			s->futex_per_change =
				r.changes ? (double)r.sys.futex /
						    (double)r.changes
					  : NAN;
		}
}
