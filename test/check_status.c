/* SPDX-License-Identifier: MIT */
/*
 * Status codes, the version string and the duration parser: kl_strerror is
 * total and names every code distinctly, kl_version matches the header, and
 * kl_duration_parse accepts exactly the documented forms, exact to the
 * millisecond, rejecting signs, spaces, exponents and overflow with *ms = 0.
 * Single-threaded.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <check.h>
#include <limits.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "keylock.h"
#include "util.h"

static const int all_codes[] = {
	KL_OK,	      KL_ETIMEDOUT, KL_ECANCELED, KL_EOVERFLOW, KL_ENOKEY,
	KL_EINVAL,    KL_ENOTFOUND, KL_ENOMEM,    KL_EDEADLK,	KL_EPROVIDER,
};

#define NCODES (sizeof all_codes / sizeof all_codes[0])

START_TEST(test_status_values)
{
	/* Explicit, append-only values: the ABI. */
	ck_assert_int_eq(KL_OK, 0);
	ck_assert_int_eq(KL_ETIMEDOUT, -1);
	ck_assert_int_eq(KL_ECANCELED, -2);
	ck_assert_int_eq(KL_EOVERFLOW, -3);
	ck_assert_int_eq(KL_ENOKEY, -4);
	ck_assert_int_eq(KL_EINVAL, -5);
	ck_assert_int_eq(KL_ENOTFOUND, -6);
	ck_assert_int_eq(KL_ENOMEM, -7);
	ck_assert_int_eq(KL_EDEADLK, -8);
	ck_assert_int_eq(KL_EPROVIDER, -9);
	ck_assert_int_eq(KL_FOREVER, -1);
}
END_TEST

START_TEST(test_strerror_names_each_code)
{
	for (size_t i = 0; i < NCODES; i++) {
		const char *s = kl_strerror(all_codes[i]);

		ck_assert_ptr_nonnull(s);
		ck_assert_msg(strlen(s) > 0, "empty name for %d",
			      all_codes[i]);
		for (size_t j = 0; j < i; j++)
			ck_assert_msg(strcmp(s, kl_strerror(all_codes[j])) != 0,
				      "codes %d and %d share the name \"%s\"",
				      all_codes[i], all_codes[j], s);
	}
}
END_TEST

START_TEST(test_strerror_is_total)
{
	static const int unknown[] = { 1,	 2,	  -10,	     -11,
				       -100,	 100,	  INT_MAX,   INT_MIN,
				       INT_MIN + 1 };

	for (size_t i = 0; i < sizeof unknown / sizeof unknown[0]; i++) {
		const char *s = kl_strerror(unknown[i]);

		ck_assert_ptr_nonnull(s);
		ck_assert_msg(strlen(s) > 0, "empty name for %d", unknown[i]);
		/* An unknown code is not named like a known one. */
		for (size_t j = 0; j < NCODES; j++)
			ck_assert_msg(strcmp(s, kl_strerror(all_codes[j])) != 0,
				      "unknown %d named like %d", unknown[i],
				      all_codes[j]);
	}
}
END_TEST

START_TEST(test_version)
{
	const char *v = kl_version();

	ck_assert_ptr_nonnull(v);
	ck_assert_str_eq(v, KL_VERSION_STRING);
}
END_TEST

struct parse_ok {
	const char *text;
	int64_t ms;
};

static const struct parse_ok valid[] = {
	{ "250ms", 250 },
	{ "5s", 5000 },
	{ "1.5m", 90000 },
	{ "2h", 7200000 },
	{ "1d", 86400000 },
	{ "forever", KL_FOREVER },
	{ "250", 250 },
	{ "0", 0 },
	{ "0ms", 0 },
	{ "0s", 0 },
	{ "1ms", 1 },
	{ "1s", 1000 },
	{ "1m", 60000 },
	{ "1h", 3600000 },
	{ "7d", 604800000 },
	{ "007ms", 7 },
	/* Fractions are exact (no binary floating point) and truncated. */
	{ "1.001s", 1001 },
	{ "0.001s", 1 },
	{ "0.0015s", 1 },
	{ "0.0009s", 0 },
	{ "1.9999s", 1999 },
	{ "2.7ms", 2 },
	{ "0.1h", 360000 },
	{ "0.5d", 43200000 },
	{ "1.123456789s", 1123 },
	{ "0.000000000000000000000000000001s", 0 },
	{ "1.5", 1 },
	/* The edges of int64_t. */
	{ "9223372036854775807ms", INT64_MAX },
	{ "9223372036854775807", INT64_MAX },
	{ "9223372036854775.807s", INT64_MAX },
	{ "9223372036854775.8079s", INT64_MAX },
	{ "106751991167d", INT64_C(9223372036828800000) },
};

static const char *const invalid[] = {
	"",
	"-1s",
	"-0s",
	"-1",
	"+5s",
	"1e309h",
	"1e3ms",
	"1e3",
	" 5s",
	"5s ",
	"5 s",
	"5x",
	"5ss",
	"5sm",
	"s",
	"ms",
	"forever ",
	"forevers",
	"5forever",
	"9223372036854775808ms",
	"9223372036854775808",
	"99999999999999999999999999999ms",
	"9223372036854775807h",
	"9223372036854775807s",
	"9223372036854775.808s",
	"106751991168d",
	"inf",
	"nan",
	"0x10",
	"5.s.",
	"1..5s",
	"5\n",
};

START_TEST(test_duration_parse_valid)
{
	for (size_t i = 0; i < sizeof valid / sizeof valid[0]; i++) {
		int64_t ms = -12345;
		int rc = kl_duration_parse(valid[i].text, &ms);

		ck_assert_msg(rc == KL_OK, "\"%s\" rejected: %s", valid[i].text,
			      kl_strerror(rc));
		ck_assert_msg(ms == valid[i].ms,
			      "\"%s\" gave %lld, expected %lld", valid[i].text,
			      (long long)ms, (long long)valid[i].ms);
	}
}
END_TEST

START_TEST(test_duration_parse_invalid)
{
	for (size_t i = 0; i < sizeof invalid / sizeof invalid[0]; i++) {
		int64_t ms = -12345;
		int rc = kl_duration_parse(invalid[i], &ms);

		ck_assert_msg(rc == KL_EINVAL, "\"%s\" gave %s (%lld)",
			      invalid[i], kl_strerror(rc), (long long)ms);
		ck_assert_msg(ms == 0, "\"%s\" left *ms = %lld", invalid[i],
			      (long long)ms);
	}
}
END_TEST

START_TEST(test_duration_parse_null)
{
	int64_t ms = -12345;

	ck_assert_int_eq(kl_duration_parse(NULL, &ms), KL_EINVAL);
	ck_assert_int_eq(ms, 0);
}
END_TEST

START_TEST(test_duration_parse_embedded_nul)
{
	/* The text ends at its NUL: what follows is not read. */
	static const char text[] = "5s\0garbage";
	int64_t ms = 0;

	ck_assert_int_eq(kl_duration_parse(text, &ms), KL_OK);
	ck_assert_int_eq(ms, 5000);
}
END_TEST

START_TEST(test_duration_parse_long_input)
{
	/* Many leading zeros and fraction digits must not overflow a buffer
	 * or an intermediate. */
	size_t n = 100000;
	char *text = malloc(n + 16);
	int64_t ms = -1;

	ck_assert_ptr_nonnull(text);
	memset(text, '0', n);
	strcpy(text + n, "42ms");
	ck_assert_int_eq(kl_duration_parse(text, &ms), KL_OK);
	ck_assert_int_eq(ms, 42);

	text[0] = '1';
	text[1] = '.';
	strcpy(text + n, "9s");
	ck_assert_int_eq(kl_duration_parse(text, &ms), KL_OK);
	ck_assert_int_eq(ms, 1000);

	memset(text, '9', n);
	strcpy(text + n, "ms");
	ck_assert_int_eq(kl_duration_parse(text, &ms), KL_EINVAL);
	ck_assert_int_eq(ms, 0);
	free(text);
}
END_TEST

static Suite *
status_suite(void)
{
	Suite *s = suite_create("status");
	TCase *tc;

	tc = tcase_create("strerror");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_status_values);
	tcase_add_test(tc, test_strerror_names_each_code);
	tcase_add_test(tc, test_strerror_is_total);
	tcase_add_test(tc, test_version);
	suite_add_tcase(s, tc);

	tc = tcase_create("duration");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_duration_parse_valid);
	tcase_add_test(tc, test_duration_parse_invalid);
	tcase_add_test(tc, test_duration_parse_null);
	tcase_add_test(tc, test_duration_parse_embedded_nul);
	tcase_add_test(tc, test_duration_parse_long_input);
	suite_add_tcase(s, tc);
	return s;
}

int
main(void)
{
	return test_run_suite(status_suite());
}
