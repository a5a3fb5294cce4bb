/* SPDX-License-Identifier: MIT */
/*
 * Private declarations shared by the modules of libkeylock.  Nothing here is
 * installed.  Layers, lowest first (src/README): alloc/status/clock, cancel,
 * waitq, mutex/reset_event, hash/table, registry, provider, the providers,
 * lock.  A lower layer never calls a higher (test/pkg/layers.sh checks).
 */
#ifndef KL_INTERNAL_H
#define KL_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "keylock.h"

#ifdef KL_DEBUG
#include <stdio.h> /* misuse reports of debug builds */
#endif

#define KL_HIDDEN __attribute__((visibility("hidden")))

/* The cache line that objects written from several CPUs are aligned to,
 * so that no other object's writes share their lines (table shards,
 * mutexes). */
#define KL__CACHE_LINE 64

/* KL_ASSERT(x): an invariant that the code next to it relies on, checked
 * in the test build (KL_TEST_HOOKS) only.  A broken one is reported on
 * stderr and aborts the test program (kl__test_assert_record lets a test
 * count it instead).  Elsewhere x is not evaluated, and nothing aborts. */
#ifdef KL_TEST_HOOKS
KL_HIDDEN void kl__test_assert_failed(const char *file, int line,
				      const char *expr);
#define KL_ASSERT(x)                                                        \
	((x) ? (void)0 : kl__test_assert_failed(__FILE__, __LINE__, #x))
#else
#define KL_ASSERT(x) ((void)sizeof(!(x)))
#endif

#include "klcommon.h"
#include "siphash.h"

/* ------------------------------------------------------------------ */
/* Allocation: every allocation of the library goes through these, so the
 * test build (-DKL_TEST_HOOKS) can fail the k-th one. */

KL_HIDDEN void *kl__malloc(size_t n);
KL_HIDDEN void *kl__calloc(size_t n, size_t size);
KL_HIDDEN void *kl__aligned_alloc(size_t align, size_t n);
KL_HIDDEN void kl__free(void *p);
KL_HIDDEN char *kl__strndup(const char *s, size_t n);

/* ------------------------------------------------------------------ */
/* status.c: messages, for any layer (kl__error_set is in klcommon.h). */

/* Writes a printable, shortened form of key into buf (size > 8). */
KL_HIDDEN void kl__key_printable(char *buf, size_t size, const char *key,
				 size_t len);
/* Appends s to the message in buf (size bytes, *n used); false, with
 * "..." at the end, once it does not fit. */
KL_HIDDEN bool kl__msg_append(char *buf, size_t size, size_t *n,
			      const char *s);

/* ------------------------------------------------------------------ */
/* clock.c: CLOCK_MONOTONIC nanoseconds; INT64_MAX means "no deadline".
 * kl__now_ns, kl__deadline_of and KL_NO_DEADLINE are in klcommon.h. */

/* Inline, so that a lock that waits forever reads no clock and calls
 * nothing. */
static inline int64_t
kl__deadline(int64_t timeout_ms)
{
	return timeout_ms < 0 ? KL_NO_DEADLINE : kl__deadline_of(timeout_ms);
}
/* The calls of keylock(3) are not cancellation points, yet a provider
 * waits in poll(2), read(2) or a lock file's fcntl(2), which are: a cancel
 * acted on there would unwind the thread with a key half taken or half
 * released, a pool connection or a mutex left behind.  So cancellation is
 * off around every call into a provider, and a request made meanwhile
 * takes effect at the caller's next cancellation point.  Turning it back
 * on is not itself one. */
static inline int
kl__cancel_off(void)
{
	int old;

	pthread_setcancelstate(PTHREAD_CANCEL_DISABLE, &old);
	return old;
}

static inline void
kl__cancel_restore(int old)
{
	pthread_setcancelstate(old, NULL);
}

/* KL_OK when timeout_ms is KL_FOREVER or >= 0, else KL_EINVAL.  Inline:
 * every enter checks it. */
static inline int
kl__check_timeout(int64_t timeout_ms)
{
	return timeout_ms >= 0 || timeout_ms == KL_FOREVER ? KL_OK : KL_EINVAL;
}
/* pthread_condattr with CLOCK_MONOTONIC, made once. */
KL_HIDDEN const pthread_condattr_t *kl__condattr(void);
/* A unique, never reused, nonzero id (tokens, leases).  Inline, as it is
 * taken on every enter: a thread-local increment, and a shared atomic once
 * per block of ids (kl__next_id_block).  initial-exec TLS: a library loaded
 * at start-up (not by dlopen) may use it, and it spares every enter a
 * __tls_get_addr call. */
#define KL_TLS _Thread_local __attribute__((tls_model("initial-exec")))
extern KL_HIDDEN KL_TLS uint64_t kl__id_next, kl__id_end;
KL_HIDDEN uint64_t kl__next_id_block(void);

static inline uint64_t
kl__next_id(void)
{
	if (__builtin_expect(kl__id_next == kl__id_end, 0))
		return kl__next_id_block();
	return kl__id_next++;
}
/* A nonzero id of the calling thread, unique in the process.  Inline for
 * the same reason as kl__next_id. */
extern KL_HIDDEN KL_TLS uint64_t kl__tid;
KL_HIDDEN uint64_t kl__thread_id_new(void);

static inline uint64_t
kl__thread_id(void)
{
	if (__builtin_expect(kl__tid == 0, 0))
		return kl__thread_id_new();
	return kl__tid;
}
/* A spin-wait hint to the CPU. */
static inline void
kl__cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
	__builtin_ia32_pause();
#elif defined(__aarch64__)
	__asm__ __volatile__("yield");
#endif
}
/* CLOCK_MONOTONIC_COARSE nanoseconds: a few ms of resolution, a fraction of
 * the cost; for times only reported in milliseconds. */
KL_HIDDEN int64_t kl__coarse_now_ns(void);

/* ------------------------------------------------------------------ */
/* cancel.c: cancellation tokens.  What waits on a token registers a hook
 * on it, which kl_cancel_fire calls once, with the token's lock held: the
 * hook may take a lock of its own (a queue's) but never the token's, so a
 * token's lock comes before every lock a hook takes.  A hook is never
 * called after kl__cancel_unregister has returned.  It lives in the
 * registrant's memory (a waiter's stack): registering allocates nothing,
 * and the token knows nothing of what waits (waitq.c is above it). */

struct kl__cancel_hook {
	struct kl__cancel_hook *next, *prev; /* the token's list, its lock */
	void (*fire)(void *arg);
	void *arg;
};

/* The time at which c fires by itself, KL_NO_DEADLINE if never; NULL c gives
 * KL_NO_DEADLINE. */
KL_HIDDEN int64_t kl__cancel_deadline(const struct kl_cancel *c);
/* Registers h (fire and arg set) on c, or returns false when c has fired
 * (h is not registered then).  Call without any lock a hook takes. */
KL_HIDDEN bool kl__cancel_register(struct kl_cancel *c,
				   struct kl__cancel_hook *h);
/* Unregisters h; once it returns, h is never called.  Call without any
 * lock a hook takes. */
KL_HIDDEN void kl__cancel_unregister(struct kl_cancel *c,
				     struct kl__cancel_hook *h);

/* ------------------------------------------------------------------ */
/* waitq.c: the FIFO queue of parked threads.
 *
 * A waitq does not own a lock: every call below is made with the caller's
 * lock held (the lock given to kl__waitq_init and kl__waiter_prepare).
 * kl_mutex and kl_reset_event use a lock of their own; the key table uses
 * its shard lock for all queues of the shard, so that an entry's fate (free
 * it or not) is decided under the same lock as the hand-off.
 *
 * Each waiter lives on its waiting thread's stack and parks on a word of its
 * own (a futex on Linux).  Its state moves once from WAITING to a final
 * state, always under the queue lock; whoever makes that move (granter, timer,
 * canceller, evictor) decides the outcome, so a grant racing a timeout or
 * cancel ends in exactly one of them.  The outcome is then published in the
 * word, and the waiter reads it without taking the lock again.
 */

enum kl__wstate {
	KL_W_INIT = 0,    /* registered with its cancel token, not queued */
	KL_W_WAITING = 1, /* in the queue */
	KL_W_GRANTED = 2, /* final: owns what it waited for */
	KL_W_DONE = 3     /* final: failed, status in w->status */
};

struct kl__waitq;

struct kl__waiter {
	struct kl__waiter *next, *prev; /* queue links */
	struct kl__waitq *q;            /* valid while WAITING */
	pthread_mutex_t *lock;          /* the queue's lock */
	atomic_uint word;  /* 0 awake, 2 parked, 3 prodded, 1 published */
	int state;         /* enum kl__wstate */
	int status;        /* with KL_W_DONE */
	bool spin;         /* may spin before parking */
	bool lone;         /* spins as the only waiter: see SPIN_MISSES */
	bool front;        /* queue at the head (a woken waiter going back) */
	bool shared;       /* a shared request: may spin behind the head */
	bool mixed;        /* waits on a key held shared (see yields) */
	/* Set under the lock by a grant that made this waiter the head while
	 * it was awake (kl__waitq_prod): a hint to stop giving its CPU away. */
	atomic_bool headed;
	int64_t since_ns;  /* when it first queued (0: not yet) */
	int64_t expire_ns; /* min(own deadline, cancel token's deadline) */
	/* Registration on a cancel token: the token (NULL: none) and the
	 * hook by which its firing fails this waiter. */
	struct kl_cancel *cancel;
	struct kl__cancel_hook chook;
	uint64_t tid;  /* kl__thread_id() of the waiting thread */
	uint64_t data; /* for the queue's user: token id, fence */
	/* For the queue's user (NULL: none): called with the lock held right
	 * after this waiter left q on its own, by its timeout or by its
	 * cancel token, never after a grant or an eviction.  The key table
	 * grants the shared requests that this waiter stood in front of. */
	void (*left)(struct kl__waitq *q);
	/* A check the queue's user hands the waiter (NULL: none; the key
	 * table's deadlock detection): called by the waiting thread, with
	 * no lock held, check_ns after the wait starts and then check_ns
	 * after each call that returned KL_OK (check_ns < 0 after a call:
	 * no more calls).  Any other status ends the wait with it, as a
	 * timeout does, unless an outcome came first. */
	int (*check)(struct kl__waiter *w);
	void *check_arg;
	int64_t check_ns;
};

/* The waiters form a ring through next and prev: head->prev is the tail.
 * The queue keeps no lock pointer (each waiter has it), so that a key table
 * entry stays small. */
struct kl__waitq {
	struct kl__waiter *head;
	uint32_t len; /* waiting threads: far below 2^32 */
	/* A shared request has waited here since the queue's owner last
	 * changed keys (kl__waitq_forget_hints): a hint for the spin,
	 * see kl__waitq_wait. */
	atomic_bool readers; /* relaxed: a hint, written without the lock
			      * when a slot takes another key */
	/* The lone waiters' spins that ended parked in a row, and the
	 * waits since the last one that spun while those were many
	 * (spin_skipped in waitq.c).  Under the lock, or with nobody
	 * waiting. */
	uint8_t spin_misses, spin_probe;
};

/* lock: the caller's lock, which guards the queue (kept by the waiters). */
KL_HIDDEN void kl__waitq_init(struct kl__waitq *q, pthread_mutex_t *lock);

/* Forgets the readers hint and the spin's misses (struct kl__waitq): its
 * owner now serves another key.  Nobody waits on q. */
static inline void
kl__waitq_forget_hints(struct kl__waitq *q)
{
	atomic_store_explicit(&q->readers, false, memory_order_relaxed);
	q->spin_misses = 0;
	q->spin_probe = 0;
}

/* The newest waiter, NULL when the queue is empty.  Lock held. */
static inline struct kl__waiter *
kl__waitq_tail(const struct kl__waitq *q)
{
	return q->head != NULL ? q->head->prev : NULL;
}

/* Queues w at the tail and waits: lock held on entry, RELEASED on return.
 * The caller must have called kl__waiter_prepare(w, ...) first (before
 * taking the lock when it has a cancel token).  max_queue and overflow
 * decide what happens when the queue is full.  Returns KL_OK when granted
 * (by kl__waitq_grant_head), else KL_ETIMEDOUT, KL_ECANCELED, KL_EOVERFLOW,
 * or the status given to kl__waiter_fail.  The waiter is out of the queue
 * on return and its data is as the granter left it.  Not a cancellation
 * point, never interrupted by signals.  The caller must then call
 * kl__waiter_finish(w). */
/* An internal outcome: woken to compete for a lock that was released
 * rather than handed over (KL_EVENTUAL); the waiter has left the queue. */
#define KL__RETRY 1

KL_HIDDEN int kl__waitq_wait(struct kl__waitq *q, struct kl__waiter *w,
			     int64_t deadline_ns, size_t max_queue,
			     kl_overflow overflow);
/* Readies w and registers it on c (may be NULL).  With c, call without the
 * queue lock (the cancel lock comes first in the lock order); with NULL c it
 * may be called with the lock held.  KL_ECANCELED when c has fired already
 * (nothing to finish then). */
KL_HIDDEN int kl__waiter_prepare(struct kl__waiter *w, pthread_mutex_t *lock,
				 struct kl_cancel *c);
/* Unregisters w from its cancel token.  Call without the queue lock. */
KL_HIDDEN void kl__waiter_finish(struct kl__waiter *w);

/* Takes the head waiter out of the queue as GRANTED and returns it, or NULL
 * when the queue is empty.  Waiters whose deadline or cancel token's
 * deadline has passed are failed on the way instead of granted.  The caller
 * may set the waiter's data, then must call kl__waiter_settle(w) before it
 * drops the lock and kl__unpark() with its result after. */
KL_HIDDEN struct kl__waiter *kl__waitq_grant_head(struct kl__waitq *q);
/* The head waiter, left queued, after failing the expired ones in front of
 * it as kl__waitq_grant_head does; NULL when none is left.  Lock held.
 * kl__waitq_grant(q, w) then takes it out as GRANTED, to be settled as
 * after kl__waitq_grant_head. */
KL_HIDDEN struct kl__waiter *kl__waitq_live_head(struct kl__waitq *q);
KL_HIDDEN void kl__waitq_grant(struct kl__waitq *q, struct kl__waiter *w);
/* After a grant: wakes the new head early if it is parked, so that it spins
 * by the time its own grant comes.  Lock held.  Returns what to kl__unpark
 * after dropping it, besides the granted waiter's wake-up. */
KL_HIDDEN void *kl__waitq_prod(struct kl__waitq *q);
/* After a release that took the queue's lock, without the lock:
 * kl__unpark(prod), and, unless q is NULL (nothing was passed on), notes
 * that this thread has just handed q on, for its next wait (a thread that
 * asks again at once: see kl__waitq_wait). */
KL_HIDDEN void kl__waitq_released(const struct kl__waitq *q, void *prod);
/* Publishes w's outcome to it.  Lock held.  Returns what kl__unpark needs
 * to wake it (NULL when it is not parked), to be called after the lock is
 * dropped: waking outside the lock spares the woken thread a collision. */
KL_HIDDEN void *kl__waiter_settle(struct kl__waiter *w);
KL_HIDDEN void kl__unpark(void *wake);
/* Ends w with status unless it already has an outcome: out of the queue if
 * queued, woken at once.  Lock held. */
KL_HIDDEN void kl__waiter_fail(struct kl__waiter *w, int status);
/* Ends every waiter with status. */
KL_HIDDEN void kl__waitq_fail_all(struct kl__waitq *q, int status);
/* Evicts waiters with KL_EOVERFLOW until len <= max_queue: FIRST evicts the
 * oldest, THIS and LAST the newest. */
KL_HIDDEN void kl__waitq_reduce(struct kl__waitq *q, size_t max_queue,
				kl_overflow overflow);
KL_HIDDEN bool kl__overflow_valid(kl_overflow o);

/* ------------------------------------------------------------------ */
/* deadlock.c (with the key table): what the callers of kl__table_acquire
 * need of it. */

/* Copies why this thread's last acquire of a table key ended with
 * KL_EDEADLK by deadlock detection into buf and forgets it; false (buf
 * untouched) when it did not (KL_ERRORCHECK's refusal). */
KL_HIDDEN bool kl__deadlock_take(char *buf, size_t size);

/* ------------------------------------------------------------------ */
/* Little-endian loads of 8 and 4 bytes at any alignment, for the hashes
 * (siphash.c, below every layer, and hash.c). */

static inline uint64_t
kl__load_le64(const void *p)
{
	uint64_t v;

	memcpy(&v, p, sizeof v);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
	v = __builtin_bswap64(v);
#endif
	return v;
}

static inline uint64_t
kl__load_le32(const void *p)
{
	uint32_t v;

	memcpy(&v, p, sizeof v);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
	v = __builtin_bswap32(v);
#endif
	return v;
}

/* ------------------------------------------------------------------ */
/* hash.c: SipHash-1-3 keyed with a per-process random seed. */

KL_HIDDEN uint64_t kl__hash(const void *data, size_t len);
/* The seed of kl__hash, for a table that keeps a copy: kl__siphash with it
 * is kl__hash without the once-check on every call. */
KL_HIDDEN void kl__hash_seed(uint64_t *k0, uint64_t *k1);
/* kl__siphash (SipHash-1-3 with an explicit key) is in siphash.h. */

/* ------------------------------------------------------------------ */
/* provider.c: a provider is an ops table over an implementation. */

struct kl_provider {
	kl_provider_ops ops;
	void *impl;
	bool shared;         /* the process-wide memory provider: never freed */
	struct kl__table *table; /* set for memory providers */
};

/* ------------------------------------------------------------------ */
/* local/provider_local.c: opens the local provider on dir ("" = the
 * default); provider_open.c's scheme table calls it. */
KL_HIDDEN int kl__local_provider_open(kl_provider **out, const char *dir,
				      kl_error *err);
/* local/local_path.c: opens the state directory path (made, 0700, when only its
 * last name is missing) name by name without following links, refusing it
 * unless every ancestor is safe from other users; *abs gets its absolute
 * normalized path (kl__free it).  KL_OK, KL_ENOMEM or KL_EPROVIDER. */
KL_HIDDEN int kl__local_dir_open(const char *path, int *dirfd, char **abs,
				 kl_error *err);
/* The default state directory for this user (kl__free it); KL_EPROVIDER
 * with err filled when there is none. */
KL_HIDDEN int kl__local_default_dir(char **out, kl_error *err);
/* The random secret of the state directory (dirfd, named path in
 * messages) that keys its file names, made when missing; *fd gets the
 * file it was read from, kept open (close it) so that its inode number
 * cannot be reused by another file while it is compared. */
#define KL_LOCAL_SECRET "secret"
#define KL_LOCAL_SECRET_LEN 16
KL_HIDDEN int kl__local_secret(int dirfd, const char *path, uint64_t *k0,
			       uint64_t *k1, int *fd, kl_error *err);

/* ------------------------------------------------------------------ */
/* Test hooks: only in test/libkeylock-test.la, built with -DKL_TEST_HOOKS. */

#ifdef KL_TEST_HOOKS
/* Where the protocol is most likely to race, the test build may pause for a
 * random 0-50 us: set KL_DEBUG_YIELD=1 (and KL_TEST_SEED to replay). */
KL_API void kl__test_yield(const char *where);
#define KL_YIELD(where) kl__test_yield(where)
#else
#define KL_YIELD(where) ((void)0)
#endif

#ifdef KL_TEST_HOOKS
/* Fail the k-th allocation from now (1 = the next); 0 disables.  Returns
 * how many allocations were made since the last call. */
KL_API long kl__test_fail_alloc_at(long k);
/* Bytes the library asked to allocate since the last call. */
KL_API size_t kl__test_alloc_bytes(void);
KL_API void kl__test_set_hash_seed(uint64_t k0, uint64_t k1);

/* Invariant checkers (TESTPLAN T06, T29): each takes the locks of what it
 * checks, one at a time, so it may run while other threads use the object.
 * KL_OK, or KL_EINVAL after printing to stderr what broke.
 * kl__test_check_invariants: every shard of a memory provider's table
 * (KL_EINVAL also for a provider that is not a memory provider).
 * kl__test_mutex_check: a kl_mutex's state word against its queue. */
KL_API int kl__test_check_invariants(kl_provider *p);
KL_API int kl__test_mutex_check(kl_mutex *m);
/* Adds delta to the entry count of one shard of p's table, so that a test
 * can see the checker notice, then repair it with -delta.  Only while no
 * other thread uses p. */
KL_API void kl__test_table_skew(kl_provider *p, long delta);
/* Threads parked on their word now (counted from the CAS to parked until
 * the futex wait returns), and prods made (kl__waitq_prod) since the start
 * of the process: a test waits for its waiters to park, then counts. */
KL_API long kl__test_parked(void);
KL_API long kl__test_prods(void);
/* Exclusive waits that the readers hint (struct kl__waitq) marked mixed. */
KL_API long kl__test_readers_hinted(void);
/* Whether the spin takes the CPUs to be shared with busy threads of other
 * processes (waitq.c, neighbours): how > 0, seen for good; 0, not seen
 * until a slow yield says so; negative, never seen (slow yields are
 * ignored). */
KL_API void kl__test_neighbours(int how);
/* Whether more threads than CPUs waited lately (waitq.c, crowded): how >
 * 0, always; 0, never; negative, counted (the default). */
KL_API void kl__test_crowd(int how);
/* How soon after handing a queue on a thread that asks for it again
 * counts as asking at once (waitq.c, asks_again); 0: never; negative:
 * ASKS_AGAIN_NS, the default. */
KL_API void kl__test_asks_again_ns(int64_t ns);
/* How long a waiter that asked again at once spins behind the head
 * (waitq.c, behind_ns); negative: as it would. */
KL_API void kl__test_behind_ns(int64_t ns);
/* Waits that gave their CPU away behind the head (waitq.c, SPIN_BEHIND)
 * and grants that marked an awake new head (kl__waitq_prod), since the
 * start of the process. */
KL_API long kl__test_behind(void);
KL_API long kl__test_headed(void);
/* Waits that spun behind the head and, marked headed, then kept their
 * CPU (waitq.c, spin). */
KL_API long kl__test_kept(void);
/* How long the head spins before it parks (waitq.c, head_spin_ns);
 * negative: as it would. */
KL_API void kl__test_head_spin_ns(int64_t ns);
/* Waits that parked at once where they would have spun, their queue's
 * spins having ended parked too often (waitq.c, spin_skipped). */
KL_API long kl__test_spins_skipped(void);
/* From now on a broken KL_ASSERT is counted and the program goes on (on),
 * or aborts it (off, the default).  Returns how many broke since the last
 * call: how a test shows that an assertion fires. */
KL_API long kl__test_assert_record(bool on);
/* Prints "keylock: invariant broken: " and the message to stderr. */
KL_HIDDEN void kl__test_report(const char *fmt, ...)
	__attribute__((format(printf, 1, 2)));
/* Checks q's ring against q->len: every waiter linked both ways, WAITING
 * (none granted or failed while still queued), of q and of lock.  Lock
 * held.  what names q in reports. */
KL_HIDDEN int kl__waitq_check(const struct kl__waitq *q,
			      const pthread_mutex_t *lock, const char *what);
#endif

#endif /* KL_INTERNAL_H */
