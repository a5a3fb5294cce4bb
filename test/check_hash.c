/* SPDX-License-Identifier: MIT */
/*
 * Tests of the keyed hash (src/hash.c) against hash flooding (TESTPLAN
 * T16), through the memory provider's key table (src/table.c).
 *
 * (a) Two processes (this program exec'd again with --print-layout) hash
 *     the same 32 keys: their hashes and their shard layouts differ, since
 *     each process draws its own seed (P(same layout) = 2^-192).  Where
 *     strace(1) is installed and may trace, it shows the seed coming from
 *     getrandom(2) (16 bytes); otherwise that part is skipped, said so.
 * (b) A committed fixture (test/data/fnv1a32-collide16.txt, made by
 *     test/data/gen_fnv_collide.c) of 20 000 keys that collide mod 2^16
 *     under unkeyed 32-bit FNV-1a, held at once as live entries of a
 *     memory provider: the longest bucket chain stays <= 16.  Time is not
 *     asserted.
 * (c) The worst case once the seed is known (the test hook
 *     kl__test_set_hash_seed fixes it): 20 000 keys brute-forced to share
 *     one shard and the bucket of a 64-bucket shard under the table's fast
 *     hash (12 bits, about 4096 tries a key).  Left alone, the chains would
 *     grow to about n * 64 / B for B buckets; the shard notices a chain of
 *     12 and indexes its buckets by SipHash from then on.  The test
 *     asserts that exactly one shard did so and that the longest chain
 *     stays <= 16, as with random keys.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* pipe2, environ */
#endif

#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "internal.h"
#include "table.h"
#include "util.h"

#define LAYOUT_KEYS 32
#define FIXTURE "test/data/fnv1a32-collide16.txt"
#define FIXTURE_KEYS 20000
#define FIXTURE_TARGET 0x4b4cu
#define FLOOD_BITS 12 /* shard (6) and bucket of a 64-bucket shard (6) */

/* The shard of a layout value (see print_layout), as src/table.c picks
 * it: the top 6 bits of the table's hash. */
static unsigned
shard_of(uint64_t h)
{
	return (unsigned)(h >> 58);
}

/* --print-layout: for each layout key, this process's table hash (the
 * top 32 bits) and the low 32 bits of its kl__hash, one a line. */
static int
print_layout(void)
{
	struct kl__table *t;
	char key[32];

	if (kl__table_new(&t) != KL_OK)
		return 1;
	for (int i = 0; i < LAYOUT_KEYS; i++) {
		int n = snprintf(key, sizeof key, "layout-%d", i);
		uint64_t v = (uint64_t)kl__table_hash(t, key, (size_t)n) << 32 |
			     (uint32_t)kl__hash(key, (size_t)n);

		printf("%016" PRIx64 "\n", v);
	}
	kl__table_free(t);
	return fflush(stdout) == 0 ? 0 : 1;
}

/* Runs argv (argv[0] the program) and reads its stdout into buf; returns
 * its wait status. */
static int
run_capture(char *const argv[], char *buf, size_t size)
{
	posix_spawn_file_actions_t fa;
	size_t got = 0;
	int out[2], status = 0;
	pid_t pid;
	ssize_t r;

	ck_assert_int_eq(pipe2(out, O_CLOEXEC), 0);
	ck_assert_int_eq(posix_spawn_file_actions_init(&fa), 0);
	ck_assert_int_eq(posix_spawn_file_actions_adddup2(&fa, out[1], 1), 0);
	ck_assert_int_eq(posix_spawn(&pid, argv[0], &fa, NULL, argv, environ),
			 0);
	posix_spawn_file_actions_destroy(&fa);
	close(out[1]);
	while ((r = read(out[0], buf + got, size - 1 - got)) != 0) {
		if (r < 0 && errno == EINTR)
			continue;
		ck_assert_int_gt(r, 0);
		got += (size_t)r;
		ck_assert_uint_lt(got, size - 1);
	}
	buf[got] = '\0';
	close(out[0]);
	while (waitpid(pid, &status, 0) < 0)
		ck_assert_int_eq(errno, EINTR);
	return status;
}

/* The hashes another run of this program prints. */
static void
layout_of_child(uint64_t *h)
{
	char self[4096], buf[LAYOUT_KEYS * 20 + 64];
	char *argv[] = { self, (char *)"--print-layout", NULL };
	char *p = buf, *end;
	ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
	int status;

	ck_assert_int_gt(n, 0);
	self[n] = '\0';
	status = run_capture(argv, buf, sizeof buf);
	ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0,
		      "%s --print-layout: status 0x%x", self,
		      (unsigned)status);
	for (int i = 0; i < LAYOUT_KEYS; i++) {
		errno = 0;
		h[i] = strtoull(p, &end, 16);
		ck_assert_msg(errno == 0 && end != p && *end == '\n',
			      "bad layout line %d", i);
		p = end + 1;
	}
}

START_TEST(test_seed_per_process)
{
	uint64_t a[LAYOUT_KEYS], b[LAYOUT_KEYS];
	int same_hash = 0, same_shard = 0;

	layout_of_child(a);
	layout_of_child(b);
	for (int i = 0; i < LAYOUT_KEYS; i++) {
		same_hash += a[i] == b[i];
		same_shard += shard_of(a[i]) == shard_of(b[i]);
	}
	/* Independent seeds: each shard agrees with chance 1/64. */
	ck_assert_msg(same_shard < LAYOUT_KEYS,
		      "two processes put all %d keys in the same shards",
		      LAYOUT_KEYS);
	ck_assert_msg(same_hash <= 1, "%d of %d hashes equal in two processes",
		      same_hash, LAYOUT_KEYS);
}
END_TEST

/* With strace installed: the seed is read with getrandom(2), 16 bytes. */
START_TEST(test_seed_from_getrandom)
{
	static const char *const straces[] = { "/usr/bin/strace",
					       "/bin/strace" };
	const char *strace = NULL;
	char self[4096], trace[4096 + 32], out[LAYOUT_KEYS * 20 + 64];
	char *argv[9];
	char *text;
	ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
	FILE *f;
	long size;
	int status;

	for (size_t i = 0; i < sizeof straces / sizeof straces[0]; i++)
		if (access(straces[i], X_OK) == 0)
			strace = straces[i];
	if (strace == NULL) {
		fprintf(stderr, "check_hash: strace not installed: the "
				"getrandom check is skipped\n");
		return;
	}
	ck_assert_int_gt(n, 0);
	self[n] = '\0';
	strcpy(trace, "/tmp/kl-check-hash.XXXXXX");
	{
		int fd = mkstemp(trace);

		ck_assert_int_ge(fd, 0);
		close(fd);
	}
	argv[0] = (char *)strace;
	argv[1] = (char *)"-f";
	argv[2] = (char *)"-e";
	argv[3] = (char *)"trace=getrandom";
	argv[4] = (char *)"-o";
	argv[5] = trace;
	argv[6] = self;
	argv[7] = (char *)"--print-layout";
	argv[8] = NULL;
	/* LeakSanitizer cannot run under ptrace: keep it out of the traced
	 * run (this test runs in a child of its own, or its last). */
	{
		const char *was = getenv("ASAN_OPTIONS");
		char opts[1024];

		snprintf(opts, sizeof opts, "%s%sdetect_leaks=0",
			 was != NULL ? was : "",
			 was != NULL && was[0] != '\0' ? ":" : "");
		setenv("ASAN_OPTIONS", opts, 1);
	}
	status = run_capture(argv, out, sizeof out);
	if (!WIFEXITED(status) || WEXITSTATUS(status) != 0 ||
	    strlen(out) < LAYOUT_KEYS * 17) {
		/* No ptrace here (a container without CAP_SYS_PTRACE). */
		fprintf(stderr, "check_hash: strace cannot trace here (status "
				"0x%x): the getrandom check is skipped\n",
			(unsigned)status);
		unlink(trace);
		return;
	}
	f = fopen(trace, "r");
	ck_assert_ptr_nonnull(f);
	ck_assert_int_eq(fseek(f, 0, SEEK_END), 0);
	size = ftell(f);
	ck_assert_int_ge(size, 0);
	rewind(f);
	text = calloc(1, (size_t)size + 1);
	ck_assert_ptr_nonnull(text);
	ck_assert_uint_eq(fread(text, 1, (size_t)size, f), (size_t)size);
	fclose(f);
	unlink(trace);
	ck_assert_msg(strstr(text, "getrandom(") != NULL &&
			      strstr(text, ", 16, 0) = 16") != NULL,
		      "no 16-byte getrandom call in the trace:\n%s", text);
	free(text);
}
END_TEST

static uint32_t
fnv1a32(const char *s, size_t len)
{
	uint32_t h = 2166136261u;

	for (size_t i = 0; i < len; i++)
		h = (h ^ (unsigned char)s[i]) * 16777619u;
	return h;
}

/* Reads the fixture: n keys, NUL-terminated, into one block. */
static char **
read_fixture(size_t *n)
{
	const char *top = getenv("top_srcdir");
	char path[4096], line[64];
	char **keys = calloc(FIXTURE_KEYS, sizeof *keys);
	FILE *f;

	ck_assert_ptr_nonnull(keys);
	snprintf(path, sizeof path, "%s/%s", top != NULL ? top : ".",
		 FIXTURE);
	f = fopen(path, "r");
	ck_assert_msg(f != NULL, "%s: %s (set top_srcdir)", path,
		      strerror(errno));
	*n = 0;
	while (fgets(line, sizeof line, f) != NULL) {
		size_t len = strcspn(line, "\n");

		ck_assert_uint_lt(*n, FIXTURE_KEYS);
		line[len] = '\0';
		keys[*n] = strdup(line);
		ck_assert_ptr_nonnull(keys[*n]);
		(*n)++;
	}
	fclose(f);
	return keys;
}

static void
free_keys(char **keys, size_t n)
{
	for (size_t i = 0; i < n; i++)
		free(keys[i]);
	free(keys);
}

/* Holds every key at once through a private memory provider and returns
 * the table's statistics; then releases them all. */
static void
hold_all(char **keys, size_t n, struct kl__table_stats *st)
{
	kl_lock_opts o = KL_LOCK_OPTS_INIT;
	kl_lease **leases = calloc(n, sizeof *leases);
	kl_provider *p;
	kl_lock *l;

	ck_assert_ptr_nonnull(leases);
	ck_assert_int_eq(kl_memory_provider_new(&p), KL_OK);
	ck_assert_ptr_nonnull(p->table);
	o.provider = p;
	o.timeout_ms = 0;
	ck_assert_int_eq(kl_lock_new(&l, &o), KL_OK);
	for (size_t i = 0; i < n; i++) {
		kl_call call = { .key = keys[i], .cancel = NULL };

		ck_assert_int_eq(kl_lock_acquire(l, &call, &leases[i], NULL),
				 KL_OK);
	}
	ck_assert_uint_eq(kl_memory_provider_size(p), n);
	kl__table_stats(p->table, st);
	for (size_t i = 0; i < n; i++)
		kl_lease_release(leases[i]);
	ck_assert_uint_eq(kl_memory_provider_size(p), 0);
	kl_lock_free(l);
	kl_provider_free(p);
	free(leases);
}

START_TEST(test_fnv_collisions_fixture)
{
	struct kl__table_stats st;
	size_t n;
	char **keys = read_fixture(&n);
	int64_t t0;

	ck_assert_uint_eq(n, FIXTURE_KEYS);
	/* The fixture does what it claims. */
	for (size_t i = 0; i < n; i++)
		ck_assert_uint_eq(fnv1a32(keys[i], strlen(keys[i])) & 0xffffu,
				  FIXTURE_TARGET);
	t0 = now_ms();
	hold_all(keys, n, &st);
	fprintf(stderr,
		"check_hash: %zu FNV-1a colliding keys held: %zu buckets, "
		"max chain %zu, %.2f probes a lookup, %lld ms\n",
		n, st.buckets, st.max_chain,
		st.lookups != 0 ? (double)st.probes / (double)st.lookups : 0.0,
		(long long)(now_ms() - t0));
	ck_assert_uint_eq(st.entries, n);
	ck_assert_msg(st.max_chain <= 16, "max chain %zu over %zu buckets",
		      st.max_chain, st.buckets);
	free_keys(keys, n);
}
END_TEST

/* "w" and the hex digits of i, into key (room for 18 bytes); returns the
 * length.  Cheaper than snprintf in the brute-force loop. */
static size_t
hex_key(char *key, uint64_t i)
{
	static const char hex[] = "0123456789abcdef";
	size_t len = 1;

	key[0] = 'w';
	do {
		key[len++] = hex[i & 15];
		i >>= 4;
	} while (i != 0);
	key[len] = '\0';
	return len;
}

START_TEST(test_known_seed_worst_case)
{
	const uint32_t mask = ((uint32_t)1 << (FLOOD_BITS - 6)) - 1;
	size_t n = (size_t)kl_test_scaled(FIXTURE_KEYS, 1000), found = 0;
	char **keys = calloc(n, sizeof *keys);
	struct kl__table_stats st;
	struct kl__table *probe;
	uint64_t tries = 0;
	char key[32];
	int64_t t0 = now_ms();

	ck_assert_ptr_nonnull(keys);
	kl__test_set_hash_seed(0x0706050403020100ULL, 0x0f0e0d0c0b0a0908ULL);
	/* Made after the seed is set, it hashes as hold_all's provider will.
	 * Shard 0, and bucket 0 of a shard of 2^(FLOOD_BITS - 6) buckets
	 * under the fast hash: src/table.c picks the shard with its top 6
	 * bits and the bucket with its low bits. */
	ck_assert_int_eq(kl__table_new(&probe), KL_OK);
	while (found < n) {
		size_t len = hex_key(key, tries++);
		uint32_t h = kl__table_hash(probe, key, len);

		if ((h >> 26) != 0 || (h & mask) != 0)
			continue;
		keys[found] = strdup(key);
		ck_assert_ptr_nonnull(keys[found]);
		found++;
	}
	kl__table_free(probe);
	hold_all(keys, n, &st);
	fprintf(stderr,
		"check_hash: %zu keys in one shard and fast-hash bucket class "
		"(%" PRIu64 " tries, %lld ms): %zu buckets, %zu strong "
		"shard(s), max chain %zu, %.2f probes a lookup\n",
		n, tries, (long long)(now_ms() - t0), st.buckets, st.strong,
		st.max_chain,
		st.lookups != 0 ? (double)st.probes / (double)st.lookups : 0.0);
	ck_assert_uint_eq(st.entries, n);
	/* The flooded shard, and only it, went over to SipHash buckets, and
	 * its chains are as short as random keys make them. */
	ck_assert_uint_eq(st.strong, 1);
	ck_assert_msg(st.max_chain <= 16, "max chain %zu over %zu buckets",
		      st.max_chain, st.buckets);
	free_keys(keys, n);
}
END_TEST

static Suite *
hash_suite(void)
{
	Suite *s = suite_create("hash");
	TCase *tc;

	tc = tcase_create("seed");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_seed_per_process);
	tcase_add_test(tc, test_seed_from_getrandom);
	suite_add_tcase(s, tc);

	tc = tcase_create("flooding");
	tcase_set_timeout(tc, 600);
	tcase_add_test(tc, test_fnv_collisions_fixture);
	tcase_add_test(tc, test_known_seed_worst_case);
	suite_add_tcase(s, tc);
	return s;
}

int
main(int argc, char **argv)
{
	if (argc == 2 && strcmp(argv[1], "--print-layout") == 0)
		return print_layout();
	return test_run_suite(hash_suite());
}
