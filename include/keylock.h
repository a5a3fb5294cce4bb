/* SPDX-License-Identifier: MIT */
/*
 * keylock: keyed FIFO locks for POSIX threads.
 *
 * This is the one installed header.  Every object is opaque; option structs
 * are filled by the caller, best from their *_INIT macro.  Every function that
 * can fail returns KL_OK or a negative KL_E* status; outputs are set to
 * NULL/0 on failure.  Nothing aborts the process on bad input and the library
 * never prints.
 *
 * Durations are int64_t milliseconds: KL_FOREVER (-1) waits without limit, 0
 * tries once without waiting, any other negative value is KL_EINVAL, and a
 * value too large for the clock (INT64_MAX) is treated as KL_FOREVER.
 *
 * Blocking calls (kl_mutex_enter, kl_reset_event_wait, kl_lock_acquire and the
 * *_run calls) are not pthread cancellation points: cancellation is disabled
 * while they wait, so a deferred pthread_cancel() takes effect at the
 * caller's next cancellation point, after the call has returned and left the
 * queue.  They are not interrupted by signals (EINTR is never returned); use a
 * kl_cancel token to stop a wait from another thread or a signal handler's
 * helper thread.  After fork() the child may only create new objects or exec:
 * objects inherited from the parent must not be used.
 */
#ifndef KEYLOCK_H
#define KEYLOCK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define KL_API __attribute__((visibility("default")))
#define KL_ATTR(x) __attribute__((x))
#else
#define KL_API
#define KL_ATTR(x)
#endif

#define KL_VERSION_MAJOR 0
#define KL_VERSION_MINOR 1
#define KL_VERSION_PATCH 0
#define KL_VERSION_STRING "0.1.0"

/* The version of the library at run time, e.g. "0.1.0".  Since 0.1. */
KL_API const char *kl_version(void);

/* ------------------------------------------------------------------ */
/* Status codes (explicit values, append-only)                         */

#define KL_OK 0
#define KL_ETIMEDOUT (-1)  /* not acquired in time (LockNotAcquiredError) */
#define KL_ECANCELED (-2)  /* cancel token fired, or aborted by the holder */
#define KL_EOVERFLOW (-3)  /* dropped by the queue's overflow strategy */
#define KL_ENOKEY (-4)     /* neither the lock nor the call has a key */
#define KL_EINVAL (-5)     /* bad argument or detectable misuse */
#define KL_ENOTFOUND (-6)  /* no such named lock */
#define KL_ENOMEM (-7)     /* out of memory */
#define KL_EDEADLK (-8)    /* this thread holds it (error-check), or a cycle */
#define KL_EPROVIDER (-9)  /* the provider could not be asked */

/* A static string naming status; total (unknown codes give a generic
 * string).  Since 0.1. */
KL_API const char *kl_strerror(int status);

#define KL_FOREVER ((int64_t)-1)

/* Parses "250ms", "5s", "1.5m", "2h", "1d", "forever" (KL_FOREVER) or a bare
 * number of milliseconds ("250") into *ms.  Fractions are exact to the
 * millisecond (truncated).  No sign, no spaces, no exponent.  Returns KL_OK,
 * or KL_EINVAL (text NULL, malformed or larger than INT64_MAX ms; *ms is then
 * 0).  Since 0.1. */
KL_API int kl_duration_parse(const char *text, int64_t *ms)
	KL_ATTR(warn_unused_result);

/* ------------------------------------------------------------------ */
/* Cancellation tokens (AbortSignal)                                   */

typedef struct kl_cancel kl_cancel;

/* A new token, not fired.  KL_ENOMEM.  Since 0.1. */
KL_API int kl_cancel_new(kl_cancel **out) KL_ATTR(warn_unused_result);
/* A token that fires by itself after_ms milliseconds from now: 0 is fired
 * from the start, KL_FOREVER never fires by itself.  Waits on it end with
 * KL_ECANCELED at that time.  KL_EINVAL for other negatives.  Since 0.1. */
KL_API int kl_cancel_new_timeout(kl_cancel **out, int64_t after_ms)
	KL_ATTR(warn_unused_result);
/* Fires the token from any thread.  Every wait using it (on any mutex,
 * event or lock) ends with KL_ECANCELED; once this returns, no later grant
 * goes to a waiter using the token.  Firing twice does nothing.  Does not
 * block on any lock holder.  Since 0.1. */
KL_API void kl_cancel_fire(kl_cancel *c);
KL_API bool kl_cancel_fired(const kl_cancel *c);
/* Frees the token.  No wait may still be using it.  NULL is ignored. */
KL_API void kl_cancel_free(kl_cancel *c);

/* ------------------------------------------------------------------ */
/* AsyncLock: one FIFO lock owned by a token                           */

typedef enum {
	KL_OVERFLOW_THIS = 0,  /* reject the newcomer */
	KL_OVERFLOW_FIRST = 1, /* evict the oldest waiter */
	KL_OVERFLOW_LAST = 2   /* evict the newest waiter */
} kl_overflow;

/* flags: the holding thread entering again gets KL_EDEADLK.  Fixed at
 * creation for a kl_mutex (kl_mutex_set_opts).  For kl_lock: honoured by the
 * memory, local: and PostgreSQL providers in both modes; the Redis provider
 * returns KL_EINVAL (its leases are not tied to a thread). */
#define KL_ERRORCHECK 0x1u
/* flags: eventual fairness instead of strict FIFO (kl_mutex only).  A leave
 * wakes the head waiter to compete instead of handing over, so a running
 * thread may take the mutex first; a head waiter that has waited 1 ms gets
 * a direct hand-off, which bounds every wait.  Much higher throughput on a
 * saturated lock.  Fixed at creation. */
#define KL_EVENTUAL 0x2u
/* flags of kl_lock_opts: take keys shared (W3C Web Locks "shared").  One
 * FIFO queue per key holds both modes; a request is granted when it is
 * first in the queue and, exclusive, the key has no holder, or, shared, no
 * exclusive holder.  A run of shared requests at the head is granted
 * together, the next exclusive one stops it, and a shared request never
 * passes a queued exclusive one.  Every grant of either mode gets a larger
 * fence.  A provider that cannot take keys shared returns KL_EINVAL (the
 * memory, local:, Redis and PostgreSQL providers all can).  kl_mutex and
 * the registry have one mode.  Since 0.1. */
#define KL_SHARED 0x4u
#define KL_UNBOUNDED SIZE_MAX

typedef struct {
	size_t max_queue;     /* waiters, not the holder; KL_UNBOUNDED */
	kl_overflow overflow; /* which waiter goes when the queue is full */
	unsigned flags;       /* KL_ERRORCHECK */
} kl_queue_opts;

#define KL_QUEUE_OPTS_INIT                                                 \
	{                                                                  \
		.max_queue = KL_UNBOUNDED, .overflow = KL_OVERFLOW_THIS,   \
		.flags = 0                                                 \
	}

/* A token is a value: copy it freely.  Ids are unique in the process and
 * never reused; id 0 is never issued. */
typedef struct {
	uint64_t id;
	int64_t start_ns; /* CLOCK_MONOTONIC(_COARSE) time enter was called */
} kl_token;

typedef struct kl_mutex kl_mutex;

/* The process-wide defaults used when opts is NULL (AsyncLock.defaultOptions)
 * and for new named locks.  Thread-safe.  set_default returns nothing and
 * ignores NULL or invalid options (a bad overflow value, unknown flags).
 * Since 0.1. */
KL_API void kl_queue_opts_default(kl_queue_opts *out);
KL_API void kl_queue_opts_set_default(const kl_queue_opts *in);

/* A new unlocked mutex; opts NULL means the current defaults.  KL_EINVAL for
 * an unknown overflow strategy or unknown flags, KL_ENOMEM.  Since 0.1. */
KL_API int kl_mutex_new(kl_mutex **out, const kl_queue_opts *opts)
	KL_ATTR(warn_unused_result);
/* Frees it.  Freeing a mutex that is held or waited on is a programming
 * error (debug builds report it).  NULL is ignored. */
KL_API void kl_mutex_free(kl_mutex *m);
/* Blocks until the mutex is granted to this call in strict arrival order,
 * the timeout passes (KL_ETIMEDOUT; 0 = try once), the cancel token fires
 * (KL_ECANCELED; a token fired before the call gives it at once), the waiter
 * is evicted by the overflow strategy (KL_EOVERFLOW) or aborted by a leave
 * with abort_pending (KL_ECANCELED).  KL_EDEADLK with KL_ERRORCHECK when the
 * calling thread holds it.  KL_EINVAL for a bad timeout or NULL out.  On
 * KL_OK *out holds the owner token.  c may be NULL.  Thread-safe; not a
 * cancellation point; a granted waiter owns the mutex even if its timeout
 * passed at the same moment.  Allocates nothing.  Since 0.1. */
KL_API int kl_mutex_enter(kl_mutex *m, int64_t timeout_ms, kl_cancel *c,
			  kl_token *out) KL_ATTR(warn_unused_result);
/* Takes it only if it is free and nobody waits (never barges; with
 * KL_EVENTUAL, whenever it is free): KL_OK or
 * KL_ETIMEDOUT; KL_EDEADLK as for enter; KL_EINVAL for NULL arguments.
 * Same as kl_mutex_enter(m, 0, NULL, out).  Since 0.1. */
KL_API int kl_mutex_try_enter(kl_mutex *m, kl_token *out)
	KL_ATTR(warn_unused_result);
/* Leaves with the owner's token (from any thread) and hands the mutex to the
 * head waiter.  With abort_pending every waiter ends with KL_ECANCELED and the
 * mutex becomes free.  KL_EINVAL when t does not hold it (foreign, stale or
 * zeroed token); nothing changes then.  Since 0.1. */
KL_API int kl_mutex_leave(kl_mutex *m, kl_token t, bool abort_pending);
/* Enters, calls fn(arg), leaves whatever fn returns.  *fn_result (if not
 * NULL) gets fn's value.  Returns the enter status.  Since 0.1. */
KL_API int kl_mutex_run(kl_mutex *m, int64_t timeout_ms, kl_cancel *c,
			int (*fn)(void *arg), void *arg, int *fn_result);
/* Whether a token holds it (false for NULL).  Since 0.1. */
KL_API bool kl_mutex_is_locked(kl_mutex *m);
/* Live waiters, not the holder (0 for NULL).  Since 0.1. */
KL_API size_t kl_mutex_queue_size(kl_mutex *m);
/* Replaces the options; lowering max_queue evicts at once (FIRST evicts the
 * oldest, THIS and LAST the newest) with KL_EOVERFLOW.  KL_EINVAL for NULL
 * arguments, a bad strategy, unknown flags or a change of KL_EVENTUAL or
 * KL_ERRORCHECK (both fixed at creation); nothing changes then.  Since
 * 0.1. */
KL_API int kl_mutex_set_opts(kl_mutex *m, const kl_queue_opts *opts);
/* Copies the options into *out.  KL_EINVAL for NULL arguments.  Since
 * 0.1. */
KL_API int kl_mutex_get_opts(kl_mutex *m, kl_queue_opts *out);
/* Milliseconds since enter was called with this token; never less than the
 * time that passed, possibly a few ms more (start_ns is read from the
 * coarse monotonic clock, which keeps enter cheap).  Since 0.1. */
KL_API int64_t kl_token_elapsed_ms(kl_token t);

/* ------------------------------------------------------------------ */
/* ResetEvent                                                          */

typedef struct {
	size_t max_queue;
	kl_overflow overflow;
	size_t auto_reset_count; /* KL_UNBOUNDED: manual reset; 0: KL_EINVAL */
} kl_reset_opts;

#define KL_RESET_OPTS_INIT                                                 \
	{                                                                  \
		.max_queue = KL_UNBOUNDED, .overflow = KL_OVERFLOW_THIS,   \
		.auto_reset_count = KL_UNBOUNDED                           \
	}

typedef struct kl_reset_event kl_reset_event;

/* A new event; opts NULL means KL_RESET_OPTS_INIT.  With auto_reset_count N
 * a set releases up to N waiters in FIFO order and becomes non-signaled after
 * the Nth release; an event created signaled starts with the budget N.
 * KL_EINVAL, KL_ENOMEM.  Since 0.1. */
KL_API int kl_reset_event_new(kl_reset_event **out, bool signaled,
			      const kl_reset_opts *opts)
	KL_ATTR(warn_unused_result);
KL_API void kl_reset_event_free(kl_reset_event *e);
/* Returns KL_OK at once when signaled (spending one of the budget), else
 * waits in FIFO order for a set: KL_ETIMEDOUT, KL_ECANCELED, KL_EOVERFLOW as
 * for kl_mutex_enter.  Since 0.1. */
KL_API int kl_reset_event_wait(kl_reset_event *e, int64_t timeout_ms,
			       kl_cancel *c) KL_ATTR(warn_unused_result);
/* Signals; does nothing when already signaled. */
KL_API void kl_reset_event_set(kl_reset_event *e);
/* Makes it non-signaled; does nothing when not signaled. */
KL_API void kl_reset_event_reset(kl_reset_event *e);
KL_API bool kl_reset_event_is_signaled(kl_reset_event *e);
KL_API size_t kl_reset_event_queue_size(kl_reset_event *e);

/* ------------------------------------------------------------------ */
/* Wrapper: named locks that persist                                   */

typedef struct kl_registry kl_registry;

/* A new, empty registry.  A NULL registry in the kl_named_* calls means the
 * process-wide one.  Since 0.1. */
KL_API int kl_registry_new(kl_registry **out) KL_ATTR(warn_unused_result);
/* Frees the registry and its locks; none may be in use. */
KL_API void kl_registry_free(kl_registry *r);
/* Runs fn under the named lock, creating the name with the default options
 * when missing.  Statuses as kl_mutex_run, plus KL_EINVAL for a NULL name.
 * Since 0.1. */
KL_API int kl_named_run(kl_registry *r, const char *name, int64_t timeout_ms,
			int (*fn)(void *arg), void *arg, int *fn_result);
/* Like kl_named_run with a cancel token.  Since 0.1. */
KL_API int kl_named_run_cancel(kl_registry *r, const char *name,
			       int64_t timeout_ms, kl_cancel *c,
			       int (*fn)(void *arg), void *arg, int *fn_result);
/* The state of a name: false / 0 for a missing or NULL name.  Since 0.1. */
KL_API bool kl_named_is_locked(kl_registry *r, const char *name);
KL_API bool kl_named_exists(kl_registry *r, const char *name);
KL_API size_t kl_named_queue_size(kl_registry *r, const char *name);
/* KL_ENOTFOUND for a missing name, KL_EINVAL for NULL arguments. */
KL_API int kl_named_get_opts(kl_registry *r, const char *name,
			     kl_queue_opts *out);
/* Sets the options of name, creating it if missing (with in, or with the
 * defaults when in is NULL; NULL leaves an existing name unchanged).
 * Lowering max_queue evicts at once.  KL_EINVAL for a NULL name or bad
 * options, or for an existing name a change of KL_EVENTUAL or
 * KL_ERRORCHECK (as kl_mutex_set_opts), KL_ENOMEM.  Since 0.1. */
KL_API int kl_named_set_opts(kl_registry *r, const char *name,
			     const kl_queue_opts *in);
/* KL_ENOTFOUND when missing, KL_EINVAL while held or waited on. */
KL_API int kl_named_remove(kl_registry *r, const char *name);

/* ------------------------------------------------------------------ */
/* Providers and the Lock strategy                                     */

typedef struct kl_provider kl_provider;
typedef struct kl_lock kl_lock;
typedef struct kl_lease kl_lease;

typedef struct {
	int status;
	char message[256];
} kl_error;

/* One holder or one waiter of a key, as kl_provider_snapshot reports it
 * (W3C Web Locks query(), PostgreSQL's pg_locks, lslocks).  The strings are
 * valid during the callback only. */
typedef struct {
	const char *key;    /* NUL-terminated; NULL when the provider cannot
			       recover the name (detail says what it has) */
	size_t key_len;     /* bytes of key; 0 when key is NULL */
	const char *detail; /* the provider's own name for the lock, or NULL */
	bool waiting;       /* false: holds the key; true: waits for it */
	bool shared;        /* held or wanted KL_SHARED */
	int64_t pid;        /* the process; 0 when unknown */
	int64_t tid;        /* the thread, as gettid(2) names it; 0 unknown */
	uint64_t fence;     /* a holder's grant; 0 for waiters or unknown */
	int64_t elapsed_ms; /* held or waited so far; -1 when unknown */
	size_t position;    /* a waiter's place in its key's queue (0: the
			       head); 0 for holders */
} kl_lock_info;

/* Called once per entry of a snapshot; non-zero stops the walk. */
typedef int (*kl_snapshot_fn)(const kl_lock_info *info, void *arg);

/*
 * The provider interface, for writing a provider of one's own.  The library
 * calls acquire from many threads at once; an implementation is thread-safe.
 *
 * acquire: take key (key_len bytes, NUL-terminated) for the caller.  Wait at
 *   most timeout_ms (KL_FOREVER: until cancel fires; 0: try once), give up
 *   with KL_ECANCELED as soon as cancel (may be NULL) fires.  ttl_ms 0 means
 *   the provider's default.  flags may hold KL_ERRORCHECK and KL_SHARED
 *   (a provider that cannot take a key shared returns KL_EINVAL; one that
 *   ignored KL_SHARED would grant exclusively, which is safe but slower).
 *   On KL_OK set
 *   *lease to the provider's handle and *fence to a number that grows with
 *   every grant of that key.  Otherwise KL_ETIMEDOUT, KL_ECANCELED,
 *   KL_EDEADLK, KL_EINVAL (a request it does not support, such as
 *   KL_ERRORCHECK), KL_ENOMEM or KL_EPROVIDER, with err (may be NULL)
 *   filled.
 * release: give the lease back; KL_OK or a status with err filled.  The
 *   handle is invalid afterwards whatever the status.
 * valid: false once a lease was lost (NULL member: always true).
 * destroy: free impl when the provider is freed (NULL member: nothing).
 * status: how many hold key (every holder: a key held shared may have
 *   many) and how many wait for it, as far as the provider can tell; KL_OK,
 *   or KL_EPROVIDER with err filled (NULL member: the provider cannot
 *   tell).
 * watch: asks to be told when lease is lost (a distributed lease that could
 *   not be renewed): the provider then calls lost(ctx) once, from any
 *   thread, with none of its locks held, and never after release of that
 *   lease has returned.  NULL member: leases are never lost.
 * snapshot: calls fn once per holder and per waiter of every key the
 *   provider knows of (kl_provider_snapshot says in which order), with none
 *   of the provider's locks held, and stops when fn returns non-zero; KL_OK,
 *   KL_ENOMEM or KL_EPROVIDER with err filled (NULL member: the provider
 *   cannot list its locks).  Since 0.1.
 */
typedef struct {
	size_t struct_size; /* sizeof(kl_provider_ops): lets it grow */
	const char *name;
	int (*acquire)(void *impl, const char *key, size_t key_len,
		       kl_cancel *cancel, int64_t timeout_ms, int64_t ttl_ms,
		       unsigned flags, void **lease, uint64_t *fence,
		       kl_error *err);
	int (*release)(void *impl, void *lease, kl_error *err);
	bool (*valid)(void *impl, void *lease);
	void (*destroy)(void *impl);
	int (*status)(void *impl, const char *key, size_t key_len,
		      size_t *holders, size_t *waiters, kl_error *err);
	void (*watch)(void *impl, void *lease, void (*lost)(void *ctx),
		      void *ctx);
	int (*snapshot)(void *impl, kl_snapshot_fn fn, void *arg,
			kl_error *err);
} kl_provider_ops;

/* Wraps a user provider.  ops is copied (name must stay valid).  KL_EINVAL
 * when ops lacks acquire or release or struct_size is smaller than this
 * version's first kl_provider_ops or larger than the current one; destroy is
 * not called then.  Since 0.1. */
KL_API int kl_provider_new(kl_provider **out, const kl_provider_ops *ops,
			   void *impl) KL_ATTR(warn_unused_result);

/* The shared process-wide memory provider (never freed; kl_provider_free on
 * it does nothing). */
KL_API kl_provider *kl_memory_provider(void);
/* A private memory provider.  Since 0.1. */
KL_API int kl_memory_provider_new(kl_provider **out)
	KL_ATTR(warn_unused_result);
/* Keys held or waited for; 0 for a provider that is not a memory one. */
KL_API size_t kl_memory_provider_size(kl_provider *p);
/* Threads waiting for key (not its holder); 0 when the key is free or p is
 * not a memory provider.  Since 0.1. */
KL_API size_t kl_memory_provider_queue_size(kl_provider *p, const char *key);
/* Opens a provider by URI: "memory:" (the shared one), "local:DIR",
 * "redis://...", "postgresql://...".  KL_EINVAL for a malformed URI,
 * KL_EPROVIDER when the scheme's library is not available; err (may be NULL)
 * says why.  Since 0.1. */
KL_API int kl_provider_open(kl_provider **out, const char *uri, kl_error *err)
	KL_ATTR(warn_unused_result);
/* Holders (every one: a key held shared may have many) and waiters of key
 * as the provider sees them.  KL_OK;
 * KL_EINVAL for NULL arguments; KL_EPROVIDER when the provider cannot tell
 * or could not be asked (err says which).  Since 0.1. */
KL_API int kl_provider_status(kl_provider *p, const char *key,
			      size_t *holders, size_t *waiters, kl_error *err);
/* Lists the locks the provider knows of: fn(info, arg) once per holder and
 * per waiter, a key's holders first and then its waiters in queue order,
 * the entries of one key read at one moment (keys not at the same moment).
 * fn runs in the calling thread with none of the library's locks held and
 * may call keylock; it stops the walk by returning non-zero (KL_OK still).
 * Allocates nothing per entry on the caller's side.  KL_OK; KL_EINVAL for
 * NULL p or fn; KL_ENOMEM; KL_EPROVIDER when the provider cannot list its
 * locks or could not be asked (err says which).  Since 0.1. */
KL_API int kl_provider_snapshot(kl_provider *p, kl_snapshot_fn fn, void *arg,
				kl_error *err);
/* Frees a provider; no lease may be outstanding.  NULL is ignored. */
KL_API void kl_provider_free(kl_provider *p);

typedef enum {
	KL_EV_REJECTED = 0,
	KL_EV_ACQUIRED = 1,
	KL_EV_RELEASED = 2,
	KL_EV_RELEASE_FAILED = 3,
	KL_EV_LOST = 4
} kl_event_type;

/* Events are raised in the thread that called kl_lock_run, kl_lock_acquire
 * or kl_lease_release, with no internal lock held: ACQUIRED at grant time
 * (waited_ms), RELEASED (held_ms), REJECTED for every failure to acquire
 * (status says why; key is NULL for KL_ENOKEY), RELEASE_FAILED (status),
 * LOST when a distributed lease could not be kept. */
typedef struct {
	kl_event_type type;
	const char *key; /* valid during the callback only */
	int status;      /* REJECTED, RELEASE_FAILED: why */
	int64_t waited_ms;
	int64_t held_ms;
} kl_event;

typedef void (*kl_event_fn)(const kl_event *ev, void *arg);

typedef struct {
	kl_provider *provider; /* NULL: kl_memory_provider(); must outlive */
	const char *key;       /* NULL: each call's key */
	int64_t timeout_ms;    /* KL_FOREVER: as long as the cancel allows */
	int64_t ttl_ms;        /* 0: the provider's default; >= 0 */
	kl_event_fn on_event;
	void *event_arg;
	unsigned flags; /* KL_ERRORCHECK, KL_SHARED */
} kl_lock_opts;

#define KL_LOCK_OPTS_INIT                                                  \
	{                                                                  \
		.provider = NULL, .key = NULL, .timeout_ms = KL_FOREVER,   \
		.ttl_ms = 0, .on_event = NULL, .event_arg = NULL,          \
		.flags = 0                                                 \
	}

typedef struct {
	const char *key;   /* used when the lock has none */
	kl_cancel *cancel; /* may be NULL */
} kl_call;

/* A new lock; opts and its key are copied (opts NULL: KL_LOCK_OPTS_INIT).
 * KL_EINVAL for a bad timeout or ttl or unknown flags.  Since 0.1. */
KL_API int kl_lock_new(kl_lock **out, const kl_lock_opts *opts)
	KL_ATTR(warn_unused_result);
/* Frees it; its leases must have been released. */
KL_API void kl_lock_free(kl_lock *l);
/* Acquires the key (the lock's, else the call's), runs fn(arg), releases on
 * every path.  Returns KL_OK (fn ran; *fn_result gets its value) or why the
 * lock was not acquired: KL_ENOKEY, KL_ETIMEDOUT, KL_ECANCELED, KL_EDEADLK
 * (error-check, or a deadlock victim), KL_ENOMEM, KL_EPROVIDER, KL_EINVAL
 * (NULL l or fn, or a flag the provider refuses).  call may be NULL.  Since
 * 0.1. */
KL_API int kl_lock_run(kl_lock *l, const kl_call *call, int (*fn)(void *arg),
		       void *arg, int *fn_result, kl_error *err);
/* The function kl_lock_run_lease runs: it gets the lease it runs under and
 * the caller's arg. */
typedef int (*kl_lease_fn)(kl_lease *lease, void *arg);
/* kl_lock_run, but fn gets the lease (fence, valid, key); fn must not release
 * it.  fn may read it with kl_lease_fence (to pass to the store the lock
 * protects, which rejects smaller fences), kl_lease_valid and kl_lease_key
 * until it returns; the key is released when fn returns, on every path,
 * whatever fn returns, with the events of kl_lock_run.  Returns KL_OK (fn
 * ran; *fn_result gets its value) or why the lock was not acquired, as
 * kl_lock_run; KL_EINVAL when l or fn is NULL (fn not called) or when fn
 * released the lease anyway: that release does nothing, the key stays held
 * until fn returns and is released then, and *fn_result is set.  call may be
 * NULL.  Since 0.1. */
KL_API int kl_lock_run_lease(kl_lock *l, const kl_call *call, kl_lease_fn fn,
			     void *arg, int *fn_result, kl_error *err);
/* Acquires and returns a lease to release later (from any thread). */
KL_API int kl_lock_acquire(kl_lock *l, const kl_call *call, kl_lease **out,
			   kl_error *err) KL_ATTR(warn_unused_result);
/* Releases; a failure is reported as KL_EV_RELEASE_FAILED.  NULL ignored. */
KL_API void kl_lease_release(kl_lease *lease);
/* A number that grows with every grant of the lease's key. */
KL_API uint64_t kl_lease_fence(const kl_lease *lease);
/* False once a distributed lease is lost. */
KL_API bool kl_lease_valid(const kl_lease *lease);
/* The key the lease holds (valid until release). */
KL_API const char *kl_lease_key(const kl_lease *lease);

/* Every distinct key of keys[0..n-1] (NUL-terminated strings), all or
 * nothing, then fn(lease, arg) as kl_lock_run_lease does, releasing every key
 * on every path.  The keys are taken one at a time in the canonical order
 * (bytewise: memcmp on the common length, then the shorter first; duplicates
 * merged), each wait holding the keys already taken: two key-set calls never
 * deadlock, whatever order their keys were given in.  One deadline (the
 * lock's timeout, counted from the call) and one cancel token (may be NULL)
 * for the whole set.  On any failure the keys taken are released in reverse
 * order and fn is not called.  Events: ACQUIRED and RELEASED per key,
 * REJECTED once per failed call, naming the key that failed.  Returns KL_OK
 * (fn ran) or as kl_lock_run_lease; KL_EINVAL when keys is NULL, n is 0, a
 * key is NULL or the lock has a key of its own.  The lease's kl_lease_key
 * and kl_lease_fence are its first key's; kl_lease_valid is false once any
 * key's lease is lost.  Since 0.1. */
KL_API int kl_lock_run_many(kl_lock *l, const char *const *keys, size_t n,
			    kl_cancel *cancel, kl_lease_fn fn, void *arg,
			    int *fn_result, kl_error *err);
/* kl_lock_run_many's acquisition, returning a lease (keys copied) that
 * kl_lease_release releases whole, from any thread.  Since 0.1. */
KL_API int kl_lock_acquire_many(kl_lock *l, const char *const *keys, size_t n,
				kl_cancel *cancel, kl_lease **out,
				kl_error *err) KL_ATTR(warn_unused_result);
/* The keys a lease holds: 1 for a single key, the distinct keys of a set
 * (0 for NULL).  Since 0.1. */
KL_API size_t kl_lease_count(const kl_lease *lease);
/* Key i of the lease in canonical order (NULL when i >= count).  Since
 * 0.1. */
KL_API const char *kl_lease_key_at(const kl_lease *lease, size_t i);
/* The fence of key i (0 when i >= count).  Since 0.1. */
KL_API uint64_t kl_lease_fence_at(const kl_lease *lease, size_t i);

/* Deadlock detection of the memory provider (kl_lock over
 * kl_memory_provider() or kl_memory_provider_new(); not kl_mutex, not the
 * registry) and of the local: provider (across the processes sharing its
 * directory), process-wide, on by default.  A wait for a key that has lasted
 * deadlock_ms (default 1000, or KEYLOCK_DEADLOCK_MS read once at first use)
 * checks the waits-for graph (thread -> key it waits for -> the threads
 * that acquired that key, every shared holder -> ...), and again every
 * deadlock_ms.  Exactly one
 * waiter of a cycle ends with KL_EDEADLK (and a REJECTED event; the
 * kl_error names the cycle's keys); the others go on waiting; the victim's
 * own leases stay held until released.  A thread waiting for a key it holds
 * is a cycle of one.  A timeout that ends a wait first gives KL_ETIMEDOUT.
 * Shorter waits cost nothing.  kl_deadlock_ms_set: for waits that start
 * later, and for a wait already checking from its next check on; KL_FOREVER
 * turns detection off, 0 checks each wait as it starts; KL_EINVAL for other
 * negative values.  Since 0.1. */
KL_API int kl_deadlock_ms_set(int64_t ms);
/* The current deadlock_ms (KL_FOREVER when off).  Since 0.1. */
KL_API int64_t kl_deadlock_ms(void);

#ifdef __cplusplus
}
#endif

#endif /* KEYLOCK_H */
