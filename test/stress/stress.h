/* SPDX-License-Identifier: MIT */
/*
 * Helpers of the stress suites (test/stress/, run by make check-stress):
 * the run's seed, scaled workloads, seeded random streams, a crew of
 * persistent threads driven one job at a time, CPU pinning, forked
 * children, and a failure macro that names the seed.
 *
 * Replaying: every run has one seed, KL_TEST_SEED from the environment or a
 * fresh one.  It is put back into the environment before any test runs, so
 * the library's debug yields (KL_DEBUG_YIELD=1) draw from the same seed, and
 * it is printed at the start of every test and in every failure message:
 * rerun the program with KL_TEST_SEED=<that value> (and CK_RUN_CASE /
 * CK_RUN_TEST to pick one test) to replay the same random choices.  Thread
 * interleavings only replay as far as the scheduler allows.
 *
 * As in the other suites, only the test's own thread calls ck_assert* or
 * st_assert: workers count what they saw, the test asserts after joining
 * or after observing a counter (libcheck/check#18).
 */
#ifndef KL_STRESS_H
#define KL_STRESS_H

#include <check.h>
#include <pthread.h>
#include <semaphore.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "keylock.h"
#include "../util.h"

/* Check timeout of every stress TCase, in seconds (CK_TIMEOUT_MULTIPLIER
 * applies on top). */
#define ST_TIMEOUT 900

#define ST_MS (INT64_C(1000000)) /* nanoseconds per millisecond */
#define ST_US (INT64_C(1000))    /* nanoseconds per microsecond */

/* ------------------------------------------------------------------ */
/* Running a suite                                                     */

/* Runs s (CK_ENV verbosity) after settling the seed; returns the exit
 * status for main. */
int st_run(Suite *s);
/* The run's seed (KL_TEST_SEED). */
uint64_t st_seed(void);
/* Whether the tests run in forked children (CK_FORK is not "no"). */
bool st_forked(void);
/* How much slower than a plain build this one runs: 1 plain, more under
 * ThreadSanitizer or AddressSanitizer.  Multiplies time bounds that are
 * not about the library's own timing. */
int st_slow(void);
/* True in a ThreadSanitizer build. */
bool st_tsan(void);

/* Starts a test: prints its name, the seed and the scale, starts the clock
 * that st_note reports, and settles the library's debug-yield switch from
 * KL_DEBUG_YIELD in this thread, before any worker starts (the library
 * reads it once per process, lazily, and not thread-safely). */
void st_begin(const char *name);
/* Asks for the library's debug yields in this test: call before
 * st_begin.  Works when each test runs in its own child (CK_FORK, the
 * default); returns false (and says so) when the switch was settled for
 * the whole process already. */
bool st_debug_yield_on(void);
/* Prints "stress: NAME: <message> (N ms)" to stderr. */
void st_note(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* n x KL_TEST_SCALE x factor, at least min.  factor is the per-test share
 * that keeps the whole stage within its time budget. */
long st_scaled(long n, double factor, long min);

/* Formats a failure message and appends the seed. */
void st_msg(char *buf, size_t size, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));

/* Called by st_assert before it fails the test.  Under CK_FORK=no a
 * failed check longjmps out of the test function; a worker still running
 * (started by st_thread_start, not yet joined) would go on using the
 * test's stack frame, freed under it, and crash the runner later.  So in
 * that case this prints the message and ends the process with status 2
 * (a failed check) instead. */
void st_fail_prepare(const char *expr, const char *msg);

/* ck_assert_msg with the seed in the message.  Test's thread only. */
#define st_assert(expr, ...)                                               \
	do {                                                               \
		if (!(expr)) {                                             \
			char st_m_[768];                                   \
			st_msg(st_m_, sizeof st_m_, __VA_ARGS__);          \
			st_fail_prepare(#expr, st_m_);                     \
			ck_assert_msg(0, "%s: %s", #expr, st_m_);          \
		}                                                          \
	} while (0)

/* ------------------------------------------------------------------ */
/* Random streams: xoshiro-like, seeded from the run's seed and a stream
 * number (test and thread), so each thread's choices replay. */

struct st_rng {
	uint64_t s;
};

void st_rng_init(struct st_rng *r, uint64_t stream);
uint64_t st_rand(struct st_rng *r);
/* Uniform in [0, n), n > 0. */
uint64_t st_below(struct st_rng *r, uint64_t n);
/* A random permutation of 0..n-1 into v. */
void st_shuffle(struct st_rng *r, int *v, int n);

/* Where a wait's status is counted: 0 KL_OK, 1 KL_ETIMEDOUT, 2
 * KL_ECANCELED, 3 KL_EOVERFLOW; -1 for any other (a bad one). */
int st_outcome(int rc);

/* A worker's cancellation token, which other workers may fire. */
struct st_slot {
	pthread_mutex_t mu;
	kl_cancel *c;
};
void st_slot_init(struct st_slot *s);
/* Frees the token (after the workers are joined). */
void st_slot_fini(struct st_slot *s);
/* The token for the owner's next wait, renewed once fired (a timeout of
 * 1-20 ms a quarter of the time); NULL half of the time, and when none
 * could be made.  The owner's thread only, with its r. */
kl_cancel *st_slot_token(struct st_slot *s, struct st_rng *r);
/* Fires s's token, if there is one; any thread. */
void st_slot_fire(struct st_slot *s);

/* ------------------------------------------------------------------ */
/* Time and waiting */

/* Busy-waits (yielding) until CLOCK_MONOTONIC reaches t_ns; sleeps first
 * while more than 200 us remain. */
void st_wait_until_ns(int64_t t_ns);
/* Polls cond(arg) until true or limit_ms passed; returns whether it held.
 * Any thread. */
bool st_poll(bool (*cond)(void *arg), void *arg, int64_t limit_ms);
/* Polls until *v >= n or limit_ms passed; returns whether it held. */
bool st_poll_count(atomic_long *v, long n, int64_t limit_ms);
/* Polls until the mutex queue holds exactly n or limit_ms passed. */
bool st_poll_queue(kl_mutex *m, size_t n, int64_t limit_ms);
bool st_poll_event_queue(kl_reset_event *e, size_t n, int64_t limit_ms);

/* Sorts v ascending and returns its p-th percentile (0 < p <= 100). */
int64_t st_percentile(int64_t *v, size_t n, double p);

/* ------------------------------------------------------------------ */
/* Threads */

/* pthread_create with stack bytes (0: 256 KiB, raised under sanitizers
 * when below what they need).  Test's thread only (asserts). */
void st_thread_start(pthread_t *t, size_t stack, void *(*fn)(void *arg),
		     void *arg);
/* As st_thread_start, but returns the pthread_create error instead. */
int st_thread_try_start(pthread_t *t, size_t stack, void *(*fn)(void *arg),
			void *arg);
void st_thread_join(pthread_t t);
/* After telling workers to stop: waits until *exited reaches n or *tripped
 * is set, setting the nev events every millisecond (workers may all be
 * waiting on them).  Returns false when they did not stop within 20 s
 * (times st_slow): the caller trips its watchdog. */
bool st_drain(atomic_int *exited, int n, atomic_bool *tripped,
	      kl_reset_event *const *ev, int nev);

/*
 * A crew: n persistent threads, each running job(crew, i) once per
 * st_crew_go(crew, i).  done counts finished jobs (seq_cst, so results a
 * job wrote before finishing are visible to whoever reads done after).
 */
struct st_crew {
	int n;
	pthread_t *th;
	sem_t *go;
	atomic_long done;
	atomic_bool stop;
	void (*job)(struct st_crew *c, int i);
	void *arg;
};

void st_crew_start(struct st_crew *c, int n, size_t stack,
		   void (*job)(struct st_crew *c, int i), void *arg);
void st_crew_go(struct st_crew *c, int i);
void st_crew_go_all(struct st_crew *c);
/* Polls until done >= n; fails the test after limit_ms (test's thread). */
void st_crew_wait(struct st_crew *c, long n, int64_t limit_ms,
		  const char *what);
void st_crew_stop(struct st_crew *c);

/* ------------------------------------------------------------------ */
/* CPU pinning (T28): pins the calling thread, and so every thread it
 * creates afterwards, to one CPU it may run on; returns that CPU or -1. */

int st_pin_one_cpu(void);
/* Restores the affinity saved by st_pin_one_cpu. */
void st_unpin(void);

/* ------------------------------------------------------------------ */
/* Forked children (T11): runs fn(arg) in a child process that exits
 * with fn's value; waits at most limit_ms (then kills it).  Returns the
 * raw wait status, or -1 when it had to be killed.  Call while the
 * process has only the test's thread. */
int st_child(int (*fn)(void *arg), void *arg, int64_t limit_ms);
/* The same without touching stdio (no fflush), for a child of a threaded
 * process that forks again; both return -2 when fork failed. */
int st_child_quiet(int (*fn)(void *arg), void *arg, int64_t limit_ms);
/* Describes a wait status from st_child. */
void st_describe_status(int status, char *buf, size_t size);

/* Resident set size in KiB (from /proc/self/statm), 0 if unknown. */
long st_rss_kib(void);

#endif /* KL_STRESS_H */
