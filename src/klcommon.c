/* SPDX-License-Identifier: MIT */
/*
 * The messages of kl_error and the monotonic clock, once for every
 * library (klcommon.h says how).  Time for every wait is CLOCK_MONOTONIC
 * only, so that stepping the wall clock never shortens or stretches a
 * timeout.  A timeout is turned once into an absolute deadline; all
 * arithmetic saturates at KL_NO_DEADLINE.
 */
#include "config.h"

#include <stdarg.h>
#include <stdio.h>
#include <time.h>

#include "klcommon.h"

void
kl__error_set(kl_error *err, int status, const char *fmt, ...)
{
	va_list ap;

	if (err == NULL)
		return;
	err->status = status;
	va_start(ap, fmt);
	vsnprintf(err->message, sizeof err->message, fmt, ap);
	va_end(ap);
}

int64_t
kl__now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

int64_t
kl__deadline_of(int64_t timeout_ms)
{
	int64_t now;

	if (timeout_ms < 0 || timeout_ms > INT64_MAX / 1000000)
		return KL_NO_DEADLINE;
	now = kl__now_ns();
	if (now > INT64_MAX - timeout_ms * 1000000)
		return KL_NO_DEADLINE;
	return now + timeout_ms * 1000000;
}
