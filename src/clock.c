/* SPDX-License-Identifier: MIT */
/*
 * The rest of the time module of libkeylock: condition variables on
 * CLOCK_MONOTONIC, unique ids, the coarse clock.  The clock and deadlines
 * every wait uses (kl__now_ns, kl__deadline_of) are in klcommon.c, which
 * the provider libraries share.
 */
#include "config.h"

#include <time.h>

#include "internal.h"

static pthread_condattr_t condattr;
static pthread_once_t condattr_once = PTHREAD_ONCE_INIT;

static void
condattr_init(void)
{
	pthread_condattr_init(&condattr);
	pthread_condattr_setclock(&condattr, CLOCK_MONOTONIC);
}

const pthread_condattr_t *
kl__condattr(void)
{
	pthread_once(&condattr_once, condattr_init);
	return &condattr;
}

/* Ids are handed to each thread in blocks so that taking one is a
 * thread-local increment, not a shared atomic on every enter.  Relaxed is
 * enough: only uniqueness matters, never ordering with other memory. */
#define ID_BLOCK 1024

static atomic_uint_fast64_t next_block = 1;
static atomic_uint_fast64_t next_tid = 1;
KL_TLS uint64_t kl__id_next, kl__id_end, kl__tid;

/* The slow path of kl__next_id (internal.h): this thread's block is used
 * up (or it has none yet). */
uint64_t
kl__next_id_block(void)
{
	kl__id_next = atomic_fetch_add_explicit(&next_block, ID_BLOCK,
						memory_order_relaxed);
	kl__id_end = kl__id_next + ID_BLOCK;
	return kl__id_next++;
}

/* The slow path of kl__thread_id: this thread's first call. */
uint64_t
kl__thread_id_new(void)
{
	kl__tid = atomic_fetch_add_explicit(&next_tid, 1,
					    memory_order_relaxed);
	return kl__tid;
}

int64_t
kl__coarse_now_ns(void)
{
#ifdef CLOCK_MONOTONIC_COARSE
	struct timespec ts;

	if (clock_gettime(CLOCK_MONOTONIC_COARSE, &ts) == 0)
		return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
#endif
	return kl__now_ns();
}
