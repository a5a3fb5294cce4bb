/* SPDX-License-Identifier: MIT */
/*
 * What the provider libraries share with libkeylock besides SipHash: the
 * messages of kl_error and the CLOCK_MONOTONIC deadlines.  The code
 * (klcommon.c) lives in the convenience library src/libklcommon.la, linked
 * into libkeylock, libkeylock-redis and libkeylock-pg, so that no library
 * exports it to another and none keeps a copy of its own: the functions
 * are hidden in each.
 */
#ifndef KL_KLCOMMON_H
#define KL_KLCOMMON_H

#include <stdint.h>

#include "keylock.h"

#ifndef KL_HIDDEN
#define KL_HIDDEN __attribute__((visibility("hidden")))
#endif

/* Fills err (may be NULL) with status and a printf-style message. */
KL_HIDDEN void kl__error_set(kl_error *err, int status, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));

/* CLOCK_MONOTONIC nanoseconds; INT64_MAX means "no deadline". */
#define KL_NO_DEADLINE INT64_MAX

KL_HIDDEN int64_t kl__now_ns(void);
/* Absolute deadline for timeout_ms from now, saturating at KL_NO_DEADLINE.
 * KL_FOREVER and values past the clock's range give KL_NO_DEADLINE. */
KL_HIDDEN int64_t kl__deadline_of(int64_t timeout_ms);

#endif
