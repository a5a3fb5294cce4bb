/* SPDX-License-Identifier: MIT */
/*
 * Status names, the version, the duration parser and the printable form
 * of a key (kl_error's messages, kl__error_set, are in klcommon.c).  The
 * parser works on integers only (no strtod) so that "1.5m" is exact and no
 * input can produce a value past INT64_MAX or a floating-point surprise.
 */
#include "config.h"

#include <stdio.h>
#include <string.h>

#include "internal.h"

const char *
kl_version(void)
{
	return KL_VERSION_STRING;
}

const char *
kl_strerror(int status)
{
	switch (status) {
	case KL_OK:
		return "success";
	case KL_ETIMEDOUT:
		return "lock not acquired in time";
	case KL_ECANCELED:
		return "wait canceled";
	case KL_EOVERFLOW:
		return "dropped by the queue's overflow strategy";
	case KL_ENOKEY:
		return "no lock key given";
	case KL_EINVAL:
		return "invalid argument";
	case KL_ENOTFOUND:
		return "no such named lock";
	case KL_ENOMEM:
		return "out of memory";
	case KL_EDEADLK:
		return "deadlock: lock held by this thread, or a cycle of waits";
	case KL_EPROVIDER:
		return "lock provider failure";
	default:
		return "unknown keylock status";
	}
}

void
kl__key_printable(char *buf, size_t size, const char *key, size_t len)
{
	size_t i, n = 0, room = size - 4; /* room for "..." and NUL */

	if (key == NULL) {
		snprintf(buf, size, "(none)");
		return;
	}
	for (i = 0; i < len && n < room; i++) {
		unsigned char ch = (unsigned char)key[i];

		buf[n++] = (char)(ch >= 0x20 && ch < 0x7f ? ch : '?');
	}
	if (i < len) {
		memcpy(buf + n, "...", 3);
		n += 3;
	}
	buf[n] = '\0';
}

bool
kl__msg_append(char *buf, size_t size, size_t *n, const char *s)
{
	size_t len = strlen(s);

	if (*n + len + 4 > size) {
		memcpy(buf + *n, "...", 4);
		*n = size;
		return false;
	}
	memcpy(buf + *n, s, len + 1);
	*n += len;
	return true;
}

/* Milliseconds per unit, longest suffix first so "ms" is not read as "m". */
static const struct {
	const char *suffix;
	int64_t ms;
} units[] = {
	{ "ms", 1 },
	{ "s", 1000 },
	{ "m", 60 * 1000 },
	{ "h", 60 * 60 * 1000 },
	{ "d", 24 * 60 * 60 * 1000 },
	{ "", 1 },
};

int
kl_duration_parse(const char *text, int64_t *ms)
{
	int64_t whole = 0, add = 0, unit = 0;
	const char *p = text, *frac = NULL, *frac_end = NULL;
	size_t i;

	if (ms == NULL)
		return KL_EINVAL;
	*ms = 0;
	if (text == NULL)
		return KL_EINVAL;
	if (strcmp(text, "forever") == 0) {
		*ms = KL_FOREVER;
		return KL_OK;
	}
	if (*p < '0' || *p > '9')
		return KL_EINVAL;
	for (; *p >= '0' && *p <= '9'; p++) {
		if (whole > (INT64_MAX - (*p - '0')) / 10)
			return KL_EINVAL;
		whole = whole * 10 + (*p - '0');
	}
	if (*p == '.') {
		frac = ++p;
		while (*p >= '0' && *p <= '9')
			p++;
		frac_end = p;
		if (frac == frac_end)
			return KL_EINVAL;
	}
	for (i = 0; i < sizeof units / sizeof units[0]; i++) {
		if (strcmp(p, units[i].suffix) == 0) {
			unit = units[i].ms;
			break;
		}
	}
	if (unit == 0)
		return KL_EINVAL;
	if (whole > INT64_MAX / unit)
		return KL_EINVAL;
	whole *= unit;
	/* floor(0.d1..dn * unit), exactly: divide by ten digit by digit from
	 * the right, carrying the quotient (floor((a + floor(b / 10)) / 10)
	 * is floor((10a + b) / 100)).  unit < 10^8, so nothing overflows,
	 * however many digits there are. */
	for (const char *d = frac_end; frac != NULL && d > frac; d--)
		add = ((d[-1] - '0') * unit + add) / 10;
	if (whole > INT64_MAX - add)
		return KL_EINVAL;
	whole += add;
	*ms = whole;
	return KL_OK;
}
