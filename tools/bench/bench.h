/* SPDX-License-Identifier: MIT */
/*
 * keylock-bench: measures keylock against baselines in one process and one
 * run, so that the ratios it prints hold on a small, noisy machine even when
 * the absolute figures wander from one run to the next.
 *
 * Every workload is repeated --runs times.  Within a repetition the subjects
 * are measured back to back in a fixed order, and each ratio is the median of
 * the per-repetition ratios, so a slow phase of the machine hits numerator
 * and denominator alike.  An idle thread exists from the start: glibc takes
 * single-thread fast paths (malloc's arena lock, for one) while a process
 * has one thread, which would flatter whatever runs first.
 *
 * Baselines: a plain pthread mutex (barging, unfair), a table of 256 striped
 * pthread mutexes indexed by an FNV-1a hash of the key (the per-key lock
 * people write by hand) and a minimal strict-FIFO lock defined here (one
 * mutex, one condvar per waiter, direct hand-off): the fair lock keylock has
 * to beat.  Beside them the contended workloads run the same loop with no
 * lock at all (K_NONE): what the scheduler alone gives each thread.
 *
 * Threads and locking: the main thread drives every workload.  A contended
 * run starts worker threads sharing one struct cshared whose plain fields
 * (inside, counter, last_owner, changes) are touched only inside the
 * critical section of the lock under test; a second thread inside at the
 * same time shows up as a violation, which fails the process whatever the
 * options.  Start and stop flags are atomics; results are read after join.
 *
 * The files of tools/bench/: harness.c (options, clocks, spinning, CPU
 * pinning, statistics, histograms, system call and memory readings, shared
 * by every workload), subjects.c (the locks under test and the keys),
 * uncontended.c, contended.c (throughput, fairness, hand-off), rwlock.c
 * (readers and writers on one key, against pthread_rwlock_t), deadlock.c
 * (deadlock detection on against off), memory.c
 * (keys and memory), providers.c ("keylock-bench provider"), report.c
 * (targets, text report), output.c (JSON, SVG plot) and main.c (options,
 * the order of the run).  This header holds what they share.
 */
#ifndef KL_BENCH_H
#define KL_BENCH_H

#include "config.h"

#ifndef _GNU_SOURCE
#define _GNU_SOURCE 1 /* RUSAGE_THREAD, syscall(), malloc_trim() */
#endif

#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#if defined(__GLIBC__) &&                                                  \
	(__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 33))
#include <malloc.h>
#define BENCH_MALLINFO2 1
#endif

#ifdef __linux__
#include <linux/perf_event.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#define BENCH_PERF 1
#endif

#include "keylock.h"

#define PROG "keylock-bench"

/* providers.c: "keylock-bench provider --uri URI ...". */
int kl_bench_provider_main(int argc, char **argv);
/* transfer.c: "keylock-bench transfer ...". */
int kl_bench_transfer_main(int argc, char **argv);

#define EXIT_MISS 1   /* --strict and a target was missed */
#define EXIT_BROKEN 2 /* an invariant broke, a call or the plot failed */
#define EXIT_USAGE 64

#define KEY_STRIDE 16            /* bytes per generated key, NUL included */
#define KEY_INLINE 16            /* key bytes a lock may keep inline */
#define WORK_IN_NS 400           /* "real work": held */
#define WORK_OUT_NS 4000         /* and outside the lock */
#define HANDOFF_SLEEP_NS 100000  /* long enough for the waiter to park */
#define HANDOFF_SPIN_NS 2000     /* shorter than a spin phase worth having */
#define IDLE_SLACK_BYTES 65536   /* in-use bytes allowed after all keys go */
#define NSTRIPES 256

/* ------------------------------------------------------------------ */
/* Options and sizes                                                   */

struct bench_opt {
	bool quick, json, strict;
	bool pin;         /* --pin: contended workloads pinned */
	const char *plot;
	int runs;
	int duration_ms;
	long iters_lock;  /* pthread, striped, fifo, kl_mutex per repetition */
	long iters_keyed; /* kl_lock with 1 and 1,000 keys */
	size_t nkeys;     /* 1,000,000 (100,000 with --quick) */
	size_t nfresh;    /* new keys per repetition while nkeys are held */
	int hand_sleep;   /* hand-off samples per repetition */
	int hand_spin;
	long iters_sys;   /* operations counted for system calls */
};
extern struct bench_opt opt;

/* ------------------------------------------------------------------ */
/* Time, spinning and statistics                                      */

/* Tells the CPU this thread spins (the contended workers inline it). */
static inline void
cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
	__builtin_ia32_pause();
#elif defined(__aarch64__)
	__asm__ __volatile__("yield" ::: "memory");
#endif
}

struct summary {
	double med, min, max;
};

/*
 * A log-linear histogram of nanoseconds: 16 buckets per power of two, so a
 * percentile is exact to about 6%, in 8 KB per thread whatever the count.
 * Values below 16 have a bucket each; bucket (e - 3) * 16 + s holds the
 * values whose leading bit is e and whose next four bits are s.
 */
#define HSUB 16
#define HBUCKETS (61 * HSUB)

struct hist {
	uint64_t n[HBUCKETS];
	uint64_t count;
	int64_t max;
};

/* ------------------------------------------------------------------ */
/* System call counting                                                */

/*
 * Per-thread counters on the syscalls:sys_enter_futex and
 * raw_syscalls:sys_enter tracepoints through perf_event_open(2): exact, no
 * extra package, root or perf_event_paranoid <= 1, and tracefs mounted (its
 * event ids are needed).  Without them the figures fall back to
 * getrusage(RUSAGE_THREAD) context switches, and futex counts are n/a.
 */
struct bench_sysm {
	int futex_id, all_id;
	bool ok;
	uint64_t all_overhead; /* syscalls made by one sample itself */
	char method[200];
};
extern struct bench_sysm sysm;

struct counters {
	int futex_fd, all_fd;
};

struct csample {
	uint64_t futex, all;
	long vcsw, ivcsw;
};

/* ------------------------------------------------------------------ */
/* Baselines                                                           */

/*
 * The strict-FIFO baseline.  held is true while someone owns the lock; a
 * release with waiters keeps it true and marks the head granted, so a
 * newcomer can never barge.  A waiter lives on its own stack with its own
 * condvar, exactly one is signalled per release.
 */
struct fifo_waiter {
	struct fifo_waiter *next;
	pthread_cond_t cond;
	bool granted;
};

struct fifo {
	pthread_mutex_t lock;
	bool held;
	struct fifo_waiter *head, *tail;
};

/* ------------------------------------------------------------------ */
/* Subjects: every lock behind one interface for the threaded workloads */

enum kind {
	K_PTHREAD,
	K_STRIPED,
	K_FIFO,
	K_KL_MUTEX,
	K_KL_LOCK,
	K_KL_EVENTUAL,
	/* No lock at all, work alone: how the scheduler shares the CPUs
	 * among threads that never block, a reference for fairness. */
	K_NONE,
	NKINDS
};

struct subject {
	enum kind kind;
	pthread_mutex_t pm;
	struct fifo fifo;
	kl_mutex *km;
	kl_provider *prov;
	kl_lock *kl;
};

union hold {
	kl_token tok;
	kl_lease *lease;
	pthread_mutex_t *stripe;
};

/* ------------------------------------------------------------------ */
/* Uncontended workloads: direct calls, no dispatch in the loop        */

enum urow {
	U_PTHREAD,
	U_STRIPED,
	U_FIFO,
	U_KL_MUTEX,
	U_KEYS1,
	U_KEYS1K,
	U_KEYSN,
	U_HELD,
	NUROWS
};

/* ------------------------------------------------------------------ */
/* System calls                                                        */

struct sysres {
	bool done;
	double futex, all, vcsw, ivcsw; /* per operation */
	double futex_per_change;
	uint64_t n;
};

#define NSYSU 5 /* uncontended rows counted */
#define NSYST 2 /* thread counts counted */

/* ------------------------------------------------------------------ */
/* Memory: nkeys leases held at once                                   */

struct bench_mem {
	bool have_malloc, have_rss;
	size_t size_held, size_after;
	double malloc_per_key, rss_per_key;
	double fill_ns;
	long long inuse_after, rss_after, rss_after_trim; /* vs idle */
	long long rss_idle, rss_held;
};
extern struct bench_mem mem;

/* ------------------------------------------------------------------ */
/* Contended workloads and hand-off latency                            */

#define NTHR 3 /* thread counts: thread_counts[] */
#define NSEC 2 /* 0: empty critical section, 1: real work */

struct crun {
	double tput, fair, fair_all, chg;
	double fair_cpu; /* max/min of grants per CPU second, in the window */
	uint64_t ops, changes;
	uint64_t sections; /* ops under a lock: 0 with no lock (K_NONE) */
	long violations;
	struct csample sys; /* summed deltas over the workers */
};

struct cres {
	double *tput, *fair, *fair_all, *chg, *fair_cpu; /* per repetition */
	struct hist h;             /* waits over all repetitions */
	uint64_t ops;
	long violations;
};

#define NHAND 4

/* Where the hand-off's two threads run: wherever the scheduler puts
 * them, or pinned to two CPUs, or to one.  A waiter woken on a halted
 * CPU of a VM costs the hypervisor's wake-up, tens of microseconds for
 * every lock, and which CPU an unpinned waiter slept on decides a run's
 * median; the pinned placements compare the locks like for like. */
enum place { P_UNPINNED, P_APART, P_TOGETHER, NPLACE };

struct hres {
	double *p50, *p99;
	double *beside; /* share of grants run on the releaser's CPU */
	double max;
	bool ran;
};

/* ------------------------------------------------------------------ */
/* Readers/writers: kl_lock with KL_SHARED against pthread_rwlock_t     */

enum { RW_KL, RW_PTHREAD, RW_KINDS };

struct rwres {
	double *tput;         /* per repetition */
	struct hist h[2];     /* waits: [0] shared, [1] exclusive */
	uint64_t ops;
	struct hist passed;   /* grants while a writer waited, per writer */
	int max_readers;      /* most readers inside at once */
	long violations;
};

/* ------------------------------------------------------------------ */
/* Targets                                                             */

/* V_INFO: a figure shown against a limit for reference, never judged. */
enum verdict { V_NA, V_PASS, V_MISS, V_INFO };

struct target {
	char name[64];
	double value;
	bool at_most;     /* value <= limit, else value >= limit */
	double limit;
	double stretch;   /* NAN: none */
	const char *unit; /* "x", "B", "/op" */
	enum verdict v;
	bool stretch_met;
};

#define MAXTARGETS 30

/* The functions and variables the files share, by file. */

/* harness.c */
extern bool progress_on;
void progress(const char *what);
void __attribute__((noreturn, format(printf, 1, 2)))
die(const char *fmt, ...);
/* The line die() prints: "keylock-bench: ", part ("provider: "), the
 * message. */
void __attribute__((format(printf, 3, 0)))
vsay(FILE *f, const char *part, const char *fmt, va_list ap);
void *xcalloc(size_t n, size_t size);
extern char load_before[48], load_after[48];
void read_load(char *buf, size_t size);
int64_t now_ns(void);
void sleep_ns(int64_t ns);
void wait_int(atomic_int *v, int want);
void wait_true(atomic_bool *v);
void spin_for(int64_t ns);
extern int cpu_list[1024];
extern int ncpus;
extern bool pin_now; /* pinned_attr and pin_self pin (else: every CPU) */
void cpus_init(void);
void pinned_attr(pthread_attr_t *a, int slot);
void pin_self(int slot);
void hog_start(void);
void hog_stop(void);
int cmp_double(const void *a, const void *b);
struct summary summarize(const double *v, int n);
double paired_ratio(const double *a, const double *b, int n);
void hist_add(struct hist *h, int64_t v);
void hist_merge(struct hist *into, const struct hist *h);
double hist_pct(const struct hist *h, double q);
void counters_open(struct counters *c);
void counters_close(struct counters *c);
void counters_sample(const struct counters *c, struct csample *s);
uint64_t since(uint64_t before, uint64_t after);
void syscalls_detect(void);
long long rss_bytes(void);
long long heap_in_use(void);

/* subjects.c */
void fifo_acquire(struct fifo *f);
void fifo_release(struct fifo *f);
void stripes_init(void);
pthread_mutex_t *stripe_of(const char *key);
extern const char *const kind_name[NKINDS];
extern const char *const kind_label[NKINDS];
extern const char *const kind_color[NKINDS];
extern struct subject subjects[NKINDS];
kl_lock *new_keyed_lock(kl_provider **prov);
void subjects_init(void);
void subjects_free(void);
void subject_acquire(struct subject *s, const char *key, union hold *h);
void subject_release(struct subject *s, union hold *h);
extern char *keybuf;
extern char hot_key[KEY_STRIDE];
const char *key_at(size_t i);
void keys_build(void);

/* uncontended.c */
extern double *ures[NUROWS];
double per_op(int64_t t0, long n);
double u_kl_lock(kl_lock *l, size_t first, size_t nk, long n);
void run_uncontended(void);
extern const enum urow sys_urows[];
extern struct sysres sys_un[NSYSU];
extern const int sys_threads[];
extern struct sysres sys_ct[NKINDS][NSYST];
void run_syscalls(void);

/* memory.c */
void run_memory(void);

/* contended.c */
extern const int thread_counts[];
extern const char *const sec_name[NSEC];
void run_contended(struct subject *s, int nthreads, int sec, bool count,
	struct hist *into, struct crun *out);
/* The chosen mode; the same beside the CPU hog; 2 threads, empty section,
 * in the other mode (pinned unless --pin). */
extern struct cres cres[NKINDS][NTHR][NSEC];
extern struct cres cres_hog[NKINDS][NTHR][NSEC];
extern struct cres cres_alt[NKINDS];
extern long total_violations;
extern uint64_t total_sections;
void run_contended_all(void);
extern const enum kind hand_kinds[];
extern const char *const hand_mode[2];
extern const char *const place_name[NPLACE];
extern struct hres hres[NPLACE][NHAND][2];
void run_handoff_all(void);

/* rwlock.c */
extern const char *const rw_kind_name[RW_KINDS];
extern const char *const rw_kind_label[RW_KINDS];
extern struct rwres rwres[RW_KINDS];
extern double rw_ratio; /* kl_lock / pthread_rwlock, median of runs */
extern size_t rw_left;  /* keys left in its provider after the runs */
extern const int rw_threads, rw_shared_percent, rw_work_ns;
void run_rwlock(void);

/* deadlock.c: detection on against off where waits are short.  The
 * contended setting has threads queue behind one another and park, which
 * is where a wait arms its check (a spinning wait is granted first). */
#define DL_THREADS 4
#define DL_SEC 1 /* the section with real work */
struct dlres {
	int64_t on_ms;   /* deadlock_ms while on */
	double *unc[2];  /* ns per acquire+release, [0] on, [1] off */
	double *tput[2]; /* contended ops/s */
	double unc_ratio, tput_ratio; /* on / off, medians of runs */
};
extern struct dlres dlres;
void run_deadlock_cost(void);
void print_deadlock_cost(void);

/* report.c */
extern const char *const verdict_name[];
extern struct target targets[MAXTARGETS];
extern int ntargets;
void target(const char *name, double value, bool at_most, double limit,
	double stretch, const char *unit);
void evaluate(void);
const char *mode_name(bool pinned);
extern const char *const urow_id[NUROWS];
const char *fmt(char *buf, size_t size, double v);
void print_urow_label(char *buf, size_t size, int r);
void print_table(void);

/* output.c */
void print_json(void);
int write_plot(const char *path);

#endif
