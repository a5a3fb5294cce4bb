/* SPDX-License-Identifier: MIT */
/*
 * Time for every wait: CLOCK_MONOTONIC only, so that stepping the wall clock
 * never shortens or stretches a timeout.  A timeout is turned once into an
 * absolute deadline; all arithmetic saturates at KL_NO_DEADLINE.
 */
#include "config.h"

#include <time.h>

#include "internal.h"

int64_t
kl__now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

int
kl__check_timeout(int64_t timeout_ms)
{
	return timeout_ms >= 0 || timeout_ms == KL_FOREVER ? KL_OK : KL_EINVAL;
}

int64_t
kl__deadline(int64_t timeout_ms)
{
	int64_t now;

	if (timeout_ms < 0 || timeout_ms > INT64_MAX / 1000000)
		return KL_NO_DEADLINE;
	now = kl__now_ns();
	if (now > INT64_MAX - timeout_ms * 1000000)
		return KL_NO_DEADLINE;
	return now + timeout_ms * 1000000;
}

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

/* Relaxed is enough: only uniqueness matters, never ordering with other
 * memory. */
static atomic_uint_fast64_t next_id = 1;

uint64_t
kl__next_id(void)
{
	return atomic_fetch_add_explicit(&next_id, 1, memory_order_relaxed);
}
