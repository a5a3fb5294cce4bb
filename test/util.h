/* SPDX-License-Identifier: MIT */
/*
 * Helpers shared by the Check suites: the workload scale, a monotonic clock,
 * bounded polling of observable state, and groups of waiter threads that
 * block in kl_mutex_enter or kl_reset_event_wait and record what happened to
 * them.
 *
 * Only the test's own thread calls ck_assert* (libcheck/check#18): waiter
 * threads record their index, status and a grant sequence number, and the
 * test asserts after joining them or after observing a counter they bump.
 * Orders are forced by waiting on observable state (queue sizes, counters),
 * never by sleeping; every such wait fails the test after TEST_POLL_LIMIT_MS.
 */
#ifndef KL_TEST_UTIL_H
#define KL_TEST_UTIL_H

#include <check.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "keylock.h"

/* How long any poll may wait for observable state before failing. */
#define TEST_POLL_LIMIT_MS 10000
/* Most waiters one group can hold. */
#define TW_MAX 256

/* KL_TEST_SCALE from the environment (default 1.0, must be > 0). */
double kl_test_scale(void);
/* n times the scale, at least min. */
long kl_test_scaled(long n, long min);

/* CLOCK_MONOTONIC in milliseconds and nanoseconds. */
int64_t now_ms(void);
int64_t now_ns(void);
/* Removes the tree at path (nftw, not following links); 0, else -1 at
 * the first entry that could not be removed. */
int test_remove_tree(const char *path);
/* Runs the suite (CK_ENV) and frees its runner; EXIT_SUCCESS when no
 * test failed, else EXIT_FAILURE. */
int test_run_suite(Suite *s);
/* A test case of s with a timeout (seconds) and a checked fixture (setup
 * and teardown may be NULL). */
TCase *test_tcase(Suite *s, const char *name, double timeout,
		  void (*setup)(void), void (*teardown)(void));
/* Run by hand from the build tree: the providers are loaded from
 * $top_builddir/src/.libs unless KEYLOCK_PROVIDER_DIR says otherwise. */
void test_provider_dir(void);
/* Lets time pass (only for durations under test, never to order threads). */
void test_sleep_ms(int64_t ms);
/* One step of a polling loop: sched_yield at first, short naps later. */
void test_relax(unsigned *spins);

/* Calls cond(arg) until it returns true; fails the test (with what in the
 * message) after TEST_POLL_LIMIT_MS.  Test thread only. */
void test_poll(bool (*cond)(void *arg), void *arg, const char *what);
/* Calls cond(arg) until it returns true or limit_ms passed; returns its
 * last answer.  Any thread. */
bool test_poll_for(bool (*cond)(void *arg), void *arg, int64_t limit_ms);
/* test_poll_for until the queue size of m (or e) is exactly n. */
bool test_poll_mutex_queue(kl_mutex *m, size_t n, int64_t limit_ms);
bool test_poll_event_queue(kl_reset_event *e, size_t n, int64_t limit_ms);

/* pthread_create with a modest stack; fails the test on error.  Test thread
 * only. */
void test_thread_start(pthread_t *t, void *(*fn)(void *arg), void *arg);
void test_thread_join(pthread_t t);
/* Runs fn(arg) in a thread and waits for it to return, failing the test
 * after TEST_POLL_LIMIT_MS (with what in the message), so that a call
 * that hangs fails the test instead of stalling it.  arg must outlive a
 * failed test (the thread may still run): allocate it.  Test thread
 * only. */
void test_run_bounded(void (*fn)(void *arg), void *arg, const char *what);
/* The same in two steps, for a call the test does things beside (a waiter
 * of a provider suite): test_bg_start runs fn(arg) in a thread of its own;
 * test_bg_join waits for fn to return, failing the test after
 * TEST_POLL_LIMIT_MS (with what in the message), then joins the thread.
 * b (and arg) must outlive a failed test: allocate them.  Test thread
 * only. */
struct test_bg {
	pthread_t th;
	void (*fn)(void *arg);
	void *arg;
	atomic_bool done;
};
void test_bg_start(struct test_bg *b, void (*fn)(void *arg), void *arg);
void test_bg_join(struct test_bg *b, const char *what);

/* A lock's events, recorded: kl_lock_opts.on_event = tev_record
 * with event_arg = the recorder.  Counts per type, when the first
 * KL_EV_LOST came (now_ns), and the last statuses.  Any thread. */
struct test_events {
	pthread_mutex_t mu;
	int n[KL_EV_LOST + 1];
	int64_t lost_ns;
	int last_status;                 /* of the last event of any type */
	int status_of[KL_EV_LOST + 1];   /* of the last event of each type */
};
void tev_init(struct test_events *e);
void tev_record(const kl_event *ev, void *arg);
int tev_count(struct test_events *e, kl_event_type t);
/* Polls up to limit_ms until e has an event of type t; returns how many. */
int tev_wait(struct test_events *e, kl_event_type t, int64_t limit_ms);

/* Polls until the queue size is exactly n (test thread only). */
void test_wait_mutex_queue(kl_mutex *m, size_t n);
void test_wait_event_queue(kl_reset_event *e, size_t n);

/* The wait queue's counters (kl__test_parked, kl__test_prods): threads
 * parked on their words now; polls until at least n are; prods made so
 * far.  Test build only (KL_TEST_HOOKS). */
long test_parked(void);
void test_wait_parked(long n);
long test_prods(void);
/* The spin's test hooks (kl__test_crowd, kl__test_asks_again_ns,
 * kl__test_behind_ns, kl__test_head_spin_ns, kl__test_neighbours,
 * kl__test_behind, kl__test_headed, kl__test_kept,
 * kl__test_spins_skipped); test build only.  test_spin_reset puts the
 * settings back as they were. */
void test_crowd(int how);
void test_asks_again_ns(int64_t ns);
void test_behind_ns(int64_t ns);
void test_neighbours(int how);
long test_behind(void);
long test_headed(void);
long test_kept(void);
void test_head_spin_ns(int64_t ns);
long test_spins_skipped(void);
void test_spin_reset(void);

/* ------------------------------------------------------------------ */
/* Waiter groups                                                       */

enum tw_kind { TW_MUTEX, TW_EVENT };

struct tw_group;

struct tw_waiter {
	struct tw_group *g;
	int index;
	/* Inputs, set by tw_start. */
	int64_t timeout_ms;
	kl_cancel *cancel;
	pthread_t thread;
	bool joined;
	int64_t start_ns; /* just before the call */
	/* Outputs, written under g->mu: read them after tw_join,
	 * tw_wait_finished or tw_finished returned true. */
	int status;       /* what enter or wait returned */
	long seq;         /* grant sequence (-1: not granted) */
	kl_token token;   /* the owner token on KL_OK (mutex) */
	int leave_status; /* with leave mode, what leave returned */
	int64_t end_ns;   /* just after the call returned */
	bool finished;
};

/*
 * The results travel from waiter to test under a pthread mutex rather than
 * through atomics alone, so that helgrind, which does not model C11
 * atomics, sees the hand-over as well as TSan does.
 */
struct tw_group {
	enum tw_kind kind;
	kl_mutex *m;
	kl_reset_event *e;
	bool leave; /* mutex: leave right after recording the grant */
	int n;      /* waiters started (test's thread only) */
	int passed; /* grants handed on by tw_pass (test's thread only) */
	/* Grant numbers; atomic so that other threads of a test may take
	 * numbers from the same sequence inside the critical section. */
	atomic_long next_seq;
	pthread_mutex_t mu;  /* guards what follows and the outputs */
	int granted;         /* waiters that recorded a grant */
	int finished;        /* waiters whose call returned and are done */
	int order[TW_MAX];   /* order[seq] = index, -1 until known */
	struct tw_waiter w[TW_MAX];
};

/* A group of waiters on m.  With leave, each waiter leaves as soon as it has
 * recorded its grant; without, the test leaves on its behalf (tw_pass). */
struct tw_group *tw_mutex(kl_mutex *m, bool leave);
/* A group of waiters on e. */
struct tw_group *tw_event(kl_reset_event *e);
/* Joins every waiter not yet joined, then frees the group. */
void tw_free(struct tw_group *g);

/* Starts one waiter (kl_mutex_enter or kl_reset_event_wait with timeout_ms
 * and c) and returns its index, without waiting for it to queue. */
int tw_start(struct tw_group *g, int64_t timeout_ms, kl_cancel *c);
/* Starts one waiter and waits until the queue has grown by one, so that
 * waiters started this way queue in index order. */
int tw_start_queued(struct tw_group *g, int64_t timeout_ms, kl_cancel *c);
/* tw_start_queued n times. */
void tw_start_n_queued(struct tw_group *g, int n, int64_t timeout_ms,
		       kl_cancel *c);

/* Whether waiter i is done (its outputs are then readable). */
bool tw_finished(struct tw_group *g, int i);
/* How many waiters recorded a grant so far. */
int tw_granted(struct tw_group *g);
/* Polls until the group's queue size is n. */
void tw_wait_queue(struct tw_group *g, size_t n);
/* Polls until at least n waiters recorded a grant. */
void tw_wait_granted(struct tw_group *g, int n);
/* Polls until waiter i has finished. */
void tw_wait_finished(struct tw_group *g, int i);
/* Joins waiter i (or all of them). */
void tw_join(struct tw_group *g, int i);
void tw_join_all(struct tw_group *g);
/* Mutex groups without leave: waits for the next grant (in sequence
 * order), leaves with that waiter's token, asserts KL_OK and returns the
 * waiter's index. */
int tw_pass(struct tw_group *g);
/* Nanoseconds waiter i spent in its call. */
int64_t tw_waited_ns(const struct tw_group *g, int i);

/* ------------------------------------------------------------------ */
/* Provider status                                                     */

/* kl_provider_open that must succeed. */
kl_provider *test_provider_open(const char *uri);
/* kl_provider_status that must succeed. */
void test_status_of(kl_provider *p, const char *key, size_t *holders,
		    size_t *waiters);
/* Asserts key has exactly holders and waiters now. */
void test_assert_status(kl_provider *p, const char *key, size_t holders,
			size_t waiters);
/* Polls until key has exactly holders and waiters.  Any change of the
 * counts is progress: the test fails only after limit_ms without one, so
 * a slow queue on a loaded machine passes and a stuck one does not. */
void test_wait_status(kl_provider *p, const char *key, size_t holders,
		      size_t waiters, int64_t limit_ms);

/* ------------------------------------------------------------------ */
/* Helper processes                                                    */

/* A helper program of a provider suite, talked to through pipes. */
struct test_helper {
	pid_t pid;
	int to;   /* its stdin */
	int from; /* its stdout */
};

/* Where the helper program name is: beside this program when beside_self
 * and it is there, else $top_builddir/dir/name (with a libtool build, the
 * wrapper that finds the uninstalled libraries).  A static buffer. */
const char *test_helper_path(const char *dir, const char *name,
			     bool beside_self);
/* Starts path with args (NULL-terminated, after the program name, at most
 * 14) and envp (NULL: this environment), with pipes to its stdin and from
 * its stdout that no other helper inherits.  The child is registered for
 * test_helpers_kill. */
void test_helper_spawn(struct test_helper *h, const char *path,
		       const char *const *args, char *const *envp);
/* Reads one line into buf (without the newline); false at end of file.
 * Fails the test when no line comes within limit_ms. */
bool test_helper_line(struct test_helper *h, char *buf, size_t size,
		      int64_t limit_ms);
/* Reads the helper's "G <fence>" line; returns the fence. */
uint64_t test_helper_granted(struct test_helper *h, int64_t limit_ms);
/* Waits (bounded) for the helper to exit; returns its wait status.  The
 * pipes stay open (test_helper_close). */
int test_helper_reap(struct test_helper *h, int64_t limit_ms);
/* SIGKILLs the helper, reaps it and asserts it died of that signal. */
void test_helper_kill(struct test_helper *h);
void test_helper_close(struct test_helper *h);
/* Kills and reaps every helper still running (the fixture's teardown: a
 * failed test leaves none behind). */
void test_helpers_kill(void);
/* Registers or forgets a child process for test_helpers_kill. */
void test_live_add(pid_t pid);
void test_live_remove(pid_t pid);

/* ------------------------------------------------------------------ */
/* Servers of a suite's own                                            */

/* A loopback TCP port nothing is bound to now, below the kernel's
 * ephemeral range (an outgoing connection could otherwise be given it
 * while the server is down); -1 if none is found. */
int test_free_port(void);
/* Starts argv[0] with argv, its standard streams on /dev/null, no signal
 * blocked and killed when this process ends; polls ready(arg) until true
 * and returns the pid.  When the server exits first or limit_ms passes
 * (it is killed then), or fork fails: -1.  Any thread. */
pid_t test_server_spawn(char *const *argv, bool (*ready)(void *arg),
			void *arg, int64_t limit_ms);

/* ------------------------------------------------------------------ */
/* A user provider                                                     */

/* A tiny provider (kl_provider_new with test_up_ops): one lock, a flag
 * under a pthread mutex, for every key; it records what the library
 * passed it and can be told to fail acquire or release. */
struct test_up {
	pthread_mutex_t mu;
	pthread_cond_t cv;
	bool held;
	/* What the last acquire was given. */
	char key[64];
	size_t key_len;
	kl_cancel *cancel;
	int64_t timeout_ms, ttl_ms;
	unsigned flags;
	/* Counts and results. */
	int acquires, releases, destroys;
	void *released_lease;
	uint64_t fence;     /* the last one handed out */
	bool valid;         /* what valid reports: test_up_set_valid */
	int acquire_status, release_status; /* forced failures */
	char lease_cookie;
};
extern const kl_provider_ops test_up_ops;
/* Initialises u: valid, not held, the first fence handed out fence + 1. */
void test_up_init(struct test_up *u, uint64_t fence);
void test_up_fini(struct test_up *u);
/* What u's valid operation reports from now on (under u->mu, which
 * helgrind sees, unlike C11 atomics). */
void test_up_set_valid(struct test_up *u, bool valid);
/* kl_provider_new(ops, u) that must succeed. */
kl_provider *test_up_provider(struct test_up *u, const kl_provider_ops *ops);

/* ------------------------------------------------------------------ */
/* Failures                                                            */

/* Called with a failed check's expression and message (which it may add
 * to, within size) by the helpers that a stress program runs too, before
 * they fail the test: the stress programs add their seed, and stop the
 * process when workers still run on the test's stack (stress.h).  NULL:
 * nothing. */
extern void (*test_failing)(const char *expr, char *msg, size_t size);

/* ------------------------------------------------------------------ */
/* Allocation-failure sweeps (test build only)                         */

/* What one scenario works on: each program defines its own. */
struct oom_ctx;

struct oom_scenario {
	const char *name;
	void (*setup)(struct oom_ctx *x); /* may be NULL */
	/* The armed part: returns its status; with KL_OK its outputs are
	 * kept for teardown. */
	int (*run)(struct oom_ctx *x);
	/* Checks the state after a KL_ENOMEM (may be NULL). */
	void (*check_failed)(struct oom_ctx *x);
	void (*teardown)(struct oom_ctx *x);
	bool no_alloc; /* documented to allocate nothing */
};

/*
 * For k = 1, 2, ... fails the k-th library allocation of s's run (on a
 * zeroed context of ctx_size bytes, set up first), which must return
 * KL_OK or KL_ENOMEM (the latter only having tried k allocations), then
 * runs it again without a failure, which must succeed.  Ends once a run
 * succeeds having made fewer than k allocations; fails the test when that
 * takes more than max_k or no run ever failed.  With s->no_alloc, one run
 * with the first allocation failing must succeed and allocate nothing.
 * Stores the allocations of the last run and the failed runs.
 */
void test_oom_sweep(const struct oom_scenario *s, size_t ctx_size,
		    long max_k, long *allocs, long *failures);

/* A private tree for local: tests: root = /tmp/NAME.XXXXXX (0700) once
 * per suite; then per test parent = root/t.XXXXXX and dir = parent/state,
 * both 0700 whatever the umask.  Buffers of PATH_MAX. */
void test_private_root(char *root, const char *name);
void test_private_state(const char *root, char *parent, char *dir);

/* A lock without a key on p, flags (KL_SHARED...), events into ev. */
kl_lock *test_set_lock(kl_provider *p, int64_t timeout_ms, unsigned flags,
		       struct test_events *ev);
/* Key sets from n clients at once, the providers p[0..n-1] (one each, so
 * their own sessions or connections), over keys[0..2] given in a
 * different order by each (the first two exactly opposite): every client
 * does each of its rounds once, with a timeout of 20 s a round, and no
 * two are ever inside at once.  n <= 4. */
void test_sets_in_orders(kl_provider *const *p, int n,
			 const char *const keys[3], long rounds);

#endif /* KL_TEST_UTIL_H */
