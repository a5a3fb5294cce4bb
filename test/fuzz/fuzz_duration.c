/* SPDX-License-Identifier: MIT */
/*
 * libFuzzer target for kl_duration_parse (TESTPLAN T19).  Built and run by
 * test/fuzz/run.sh with ASan and UBSan.  Besides crashes, it checks:
 * - KL_OK comes with ms >= 0 or KL_FOREVER (and KL_FOREVER only from
 *   "forever"); anything else is KL_EINVAL with ms == 0;
 * - the result equals that of an independent reference parser, which reads
 *   the documented grammar (digits, an optional fraction, a unit) with exact
 *   arithmetic: every fraction digit counts, and the value is truncated to
 *   the millisecond;
 * - parse(format(x)) == x: the result printed as "<n>ms" (and as a bare
 *   "<n>") reads back as the same number.
 * A failed check aborts, which libFuzzer reports as a crash with the input.
 *
 * KL_FUZZ_ALLOW_FRACTION_TRUNCATION (set by run.sh while the known finding
 * test/fuzz/known/fuzz_duration/fraction-past-18-digits exists) also
 * accepts the result of the library's current shortcut, which ignores
 * fraction digits past the 18th and so can come out 1 ms short, e.g.
 * "0.0000166666666666666667m" gives 0 where the exact value is 1.000...
 */
#include "config.h"

#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "keylock.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void
fail(const char *what, const char *text, int rc, int64_t ms, int ref_rc,
     int64_t ref_ms)
{
	fprintf(stderr,
		"fuzz_duration: %s: input \"%s\": rc %d ms %" PRId64
		", reference rc %d ms %" PRId64 "\n",
		what, text, rc, ms, ref_rc, ref_ms);
	abort();
}

static int
is_digit(char c)
{
	return c >= '0' && c <= '9';
}

/* The reference: "forever", or DIGITS [ "." DIGITS ] UNIT with UNIT one of
 * "", "ms", "s", "m", "h", "d".  whole * unit + floor(0.FRAC * unit),
 * KL_EINVAL past INT64_MAX.  floor(0.FRAC * unit) is the carry out of the
 * long multiplication FRAC * unit, done digit by digit from the right. */
static int
reference(const char *text, size_t maxfrac, int64_t *ms)
{
	static const struct {
		const char *suffix;
		int64_t ms;
	} units[] = {
		{ "", 1 },
		{ "ms", 1 },
		{ "s", 1000 },
		{ "m", 60000 },
		{ "h", 3600000 },
		{ "d", 86400000 },
	};
	const char *p = text, *frac = NULL;
	size_t nfrac = 0, i;
	unsigned __int128 whole = 0, total, carry = 0;
	int64_t unit = 0;

	*ms = 0;
	if (strcmp(text, "forever") == 0) {
		*ms = KL_FOREVER;
		return KL_OK;
	}
	if (!is_digit(*p))
		return KL_EINVAL;
	for (; is_digit(*p); p++) {
		whole = whole * 10 + (unsigned)(*p - '0');
		if (whole > INT64_MAX)
			whole = (unsigned __int128)INT64_MAX + 1; /* saturate */
	}
	if (*p == '.') {
		p++;
		if (!is_digit(*p))
			return KL_EINVAL;
		frac = p;
		while (is_digit(*p))
			p++;
		nfrac = (size_t)(p - frac);
		if (nfrac > maxfrac)
			nfrac = maxfrac;
	}
	for (i = 0; i < sizeof units / sizeof units[0]; i++)
		if (strcmp(p, units[i].suffix) == 0)
			unit = units[i].ms;
	if (unit == 0)
		return KL_EINVAL;
	for (i = nfrac; i-- > 0;)
		carry = ((unsigned)(frac[i] - '0') * (unsigned __int128)unit +
			 carry) /
			10;
	total = whole * (unsigned __int128)unit + carry;
	if (total > INT64_MAX)
		return KL_EINVAL;
	*ms = (int64_t)total;
	return KL_OK;
}

int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	char *text, out[32];
	int64_t ms = 12345, ref_ms, back = -12345;
	int rc, ref_rc;
#ifdef KL_FUZZ_ALLOW_FRACTION_TRUNCATION
	int64_t short_ms;
#endif

	/* A heap copy of exactly size + 1 bytes: ASan sees any over-read. */
	if ((text = malloc(size + 1)) == NULL)
		return 0;
	memcpy(text, data, size);
	text[size] = '\0';

	rc = kl_duration_parse(text, &ms);
	ref_rc = reference(text, SIZE_MAX, &ref_ms);
	if (rc == KL_OK) {
		if (ms < 0 && ms != KL_FOREVER)
			fail("negative result", text, rc, ms, ref_rc, ref_ms);
		if (ms == KL_FOREVER && strcmp(text, "forever") != 0)
			fail("KL_FOREVER not from \"forever\"", text, rc, ms,
			     ref_rc, ref_ms);
	} else if (rc != KL_EINVAL || ms != 0) {
		fail("failure other than KL_EINVAL with ms 0", text, rc, ms,
		     ref_rc, ref_ms);
	}
#ifdef KL_FUZZ_ALLOW_FRACTION_TRUNCATION
	if (rc == KL_OK && ref_rc == KL_OK && ms != ref_ms &&
	    reference(text, 18, &short_ms) == KL_OK && ms == short_ms)
		ref_ms = ms; /* the known finding */
#endif
	if (rc != ref_rc || ms != ref_ms)
		fail("differs from the reference parser", text, rc, ms, ref_rc,
		     ref_ms);

	if (rc == KL_OK && ms >= 0) {
		snprintf(out, sizeof out, "%" PRId64 "ms", ms);
		if (kl_duration_parse(out, &back) != KL_OK || back != ms)
			fail("\"<n>ms\" does not read back", out, rc, back,
			     ref_rc, ms);
		snprintf(out, sizeof out, "%" PRId64, ms);
		if (kl_duration_parse(out, &back) != KL_OK || back != ms)
			fail("\"<n>\" does not read back", out, rc, back, ref_rc,
			     ms);
	}
	/* NULL arguments: KL_EINVAL, never a crash. */
	if (kl_duration_parse(NULL, &back) != KL_EINVAL || back != 0 ||
	    kl_duration_parse(text, NULL) != KL_EINVAL)
		fail("NULL argument", text, rc, back, ref_rc, ref_ms);
	free(text);
	return 0;
}
