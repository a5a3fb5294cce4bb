/* SPDX-License-Identifier: MIT */
/*
 * Every allocation of the library goes through here, so that the test build
 * (KL_TEST_HOOKS) can fail the k-th one and prove each caller unwinds with
 * KL_ENOMEM and leaks nothing.  The release build calls libc directly.
 */
#include "config.h"

#include <sched.h>
#include <string.h>
#include <time.h>
#ifdef KL_TEST_HOOKS
#include <stdarg.h>
#include <stdio.h>
#endif

#include "internal.h"

#ifdef KL_TEST_HOOKS
/* Allocations made since the last kl__test_fail_alloc_at call, and the count
 * at which the next one fails (0: never).  Relaxed order is enough: a test
 * arms the hook, then runs its scenario in the same thread or in threads it
 * starts afterwards (thread creation orders memory). */
static atomic_long alloc_count;
static atomic_long fail_at;

long
kl__test_fail_alloc_at(long k)
{
	long n = atomic_exchange_explicit(&alloc_count, 0,
					  memory_order_relaxed);

	atomic_store_explicit(&fail_at, k, memory_order_relaxed);
	return n;
}

/* Debug yields: off unless KL_DEBUG_YIELD is set; the per-thread random
 * state is seeded from KL_TEST_SEED and the thread's id, so a failing run
 * replays with the same seed (as far as the scheduler allows). */
static bool yield_on;
static uint64_t yield_seed;
static pthread_once_t yield_once = PTHREAD_ONCE_INIT;
static _Thread_local uint64_t yield_state;

static void
yield_init(void)
{
	const char *e = getenv("KL_DEBUG_YIELD");
	const char *seed = getenv("KL_TEST_SEED");

	yield_seed = seed != NULL ? strtoull(seed, NULL, 0) : 1;
	yield_on = e != NULL && e[0] != '\0' && e[0] != '0';
}

void
kl__test_yield(const char *where)
{
	struct timespec ts;
	bool on;

	(void)where;
	pthread_once(&yield_once, yield_init);
	on = yield_on;
	if (!on)
		return;
	if (yield_state == 0)
		yield_state = (yield_seed ^ (kl__thread_id() *
					     0x9e3779b97f4a7c15ULL)) | 1;
	/* xorshift64 */
	yield_state ^= yield_state << 13;
	yield_state ^= yield_state >> 7;
	yield_state ^= yield_state << 17;
	switch (yield_state % 4) {
	case 0:
		break;
	case 1:
		sched_yield();
		break;
	default: {
		/* nanosleep is a cancellation point and keylock's calls are
		 * not: a thread cancelled here would die queued. */
		int old;

		ts.tv_sec = 0;
		ts.tv_nsec = (long)(yield_state % 50000);
		pthread_setcancelstate(PTHREAD_CANCEL_DISABLE, &old);
		nanosleep(&ts, NULL);
		pthread_setcancelstate(old, NULL);
		break;
	}
	}
}

void
kl__test_report(const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	fputs("keylock: invariant broken: ", stderr);
	vfprintf(stderr, fmt, ap);
	fputc('\n', stderr);
	va_end(ap);
}

static atomic_bool assert_record;
static atomic_long assert_broken;

long
kl__test_assert_record(bool on)
{
	atomic_store_explicit(&assert_record, on, memory_order_relaxed);
	return atomic_exchange_explicit(&assert_broken, 0,
					memory_order_relaxed);
}

/* The test build only: a test program that broke an invariant stops where
 * it broke, with a core to look at, unless it asked to count. */
void
kl__test_assert_failed(const char *file, int line, const char *expr)
{
	kl__test_report("%s:%d: %s", file, line, expr);
	atomic_fetch_add_explicit(&assert_broken, 1, memory_order_relaxed);
	if (!atomic_load_explicit(&assert_record, memory_order_relaxed))
		abort();
}

/* Bytes asked for since the last kl__test_alloc_bytes call: how a test
 * proves that a huge key is copied once, not once per layer. */
static atomic_size_t alloc_bytes;

size_t
kl__test_alloc_bytes(void)
{
	return atomic_exchange_explicit(&alloc_bytes, 0, memory_order_relaxed);
}

static bool
should_fail(size_t bytes)
{
	long n = atomic_fetch_add_explicit(&alloc_count, 1,
					   memory_order_relaxed) + 1;
	long k = atomic_load_explicit(&fail_at, memory_order_relaxed);

	atomic_fetch_add_explicit(&alloc_bytes, bytes, memory_order_relaxed);
	return k > 0 && n == k;
}
#else
static inline bool
should_fail(size_t bytes)
{
	(void)bytes;
	return false;
}
#endif

void *
kl__malloc(size_t n)
{
	return should_fail(n) ? NULL : malloc(n);
}

void *
kl__calloc(size_t n, size_t size)
{
	return should_fail(n * size) ? NULL : calloc(n, size);
}

void *
kl__aligned_alloc(size_t align, size_t n)
{
	void *p;

	if (should_fail(n) || posix_memalign(&p, align, n) != 0)
		return NULL;
	return p;
}

void
kl__free(void *p)
{
	free(p);
}

char *
kl__strndup(const char *s, size_t n)
{
	char *d = kl__malloc(n + 1);

	if (d == NULL)
		return NULL;
	memcpy(d, s, n);
	d[n] = '\0';
	return d;
}
