/* SPDX-License-Identifier: MIT */
/*
 * libFuzzer target for kl_provider_open's URI handling (TESTPLAN T19).
 * Built and run by test/fuzz/run.sh with ASan and UBSan.
 *
 * The input, cut at its first NUL, is the URI, with two exceptions that
 * keep the fuzzer from touching the machine:
 * - "local:REST" becomes "local:TMP/dREST'", where TMP is a folder made for
 *   this run and REST' keeps only [A-Za-z0-9._-] of REST (at most 40 bytes),
 *   so the directory the provider creates is always one fresh name inside
 *   TMP; it is removed again after each input;
 * - redis:// and postgres(ql):// URIs are only opened when the provider
 *   library is not installed (kl_provider_open then fails in dlopen): with
 *   it, opening would connect to whatever host the input names.
 * Checks, besides crashes and leaks: KL_OK comes with a provider and every
 * other status with none, with err.status equal to the status and a
 * message; the message never repeats the credentials of a URI
 * ("scheme://USER:PASS@...").
 */
#include "config.h"

#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "keylock.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static char tmp[256];
static int plugins_present;

static void
cleanup(void)
{
	char secret[sizeof tmp + 16];

	if (tmp[0] != '\0') {
		snprintf(secret, sizeof secret, "%s/secret", tmp);
		unlink(secret);
		rmdir(tmp);
	}
}

static int
loadable(const char *lib)
{
	void *h = dlopen(lib, RTLD_NOW | RTLD_LOCAL);

	if (h == NULL)
		return 0;
	dlclose(h);
	return 1;
}

int
LLVMFuzzerInitialize(int *argc, char ***argv)
{
	const char *base = getenv("TMPDIR");

	(void)argc;
	(void)argv;
	/* The provider libraries are looked up here first: not in a fuzz
	 * run. */
	unsetenv("KEYLOCK_PROVIDER_DIR");
	plugins_present = loadable("libkeylock-redis.so.0") ||
			  loadable("libkeylock-pg.so.0");
	if (plugins_present)
		fprintf(stderr, "fuzz_uri: a provider library is installed: "
				"redis and postgresql URIs are not opened\n");
	snprintf(tmp, sizeof tmp, "%s/kl-fuzz-uri.XXXXXX",
		 base != NULL && base[0] == '/' ? base : "/tmp");
	if (mkdtemp(tmp) == NULL) {
		perror("fuzz_uri: mkdtemp");
		exit(1);
	}
	atexit(cleanup);
	return 0;
}

/* Schemes are case-insensitive: "lOcal:" opens the local provider too,
 * and must be confined to TMP like "local:". */
static int
has_prefix(const char *s, const char *prefix)
{
	return strncasecmp(s, prefix, strlen(prefix)) == 0;
}

static void
check(int ok, const char *what, const char *uri)
{
	if (!ok) {
		fprintf(stderr, "fuzz_uri: %s: URI \"%s\"\n", what, uri);
		abort();
	}
}

/* scheme://USER:PASS@host: the password must not show in the message.
 * It may appear there by chance ("sql:" is in every scheme list), so the
 * URI is opened again with the password's bytes changed: text that follows
 * the password is a leak, text that stays is the message's own. */
static void
check_secret(const char *uri, const char *message)
{
	const char *start = strstr(uri, "://"), *colon, *at;
	char *copy, *pw;
	kl_provider *p = NULL;
	kl_error err2;
	size_t len, i;

	if (start == NULL)
		return;
	start += 3;
	if ((at = strchr(start, '@')) == NULL)
		return;
	colon = memchr(start, ':', (size_t)(at - start));
	if (colon == NULL || at - (colon + 1) < 4)
		return;
	len = (size_t)(at - (colon + 1));
	if ((pw = strndup(colon + 1, len)) == NULL)
		return;
	if (strstr(message, pw) != NULL && (copy = strdup(uri)) != NULL) {
		for (i = 0; i < len; i++) /* a byte the password lacks */
			copy[colon + 1 - uri + i] =
				memchr(pw, 'Q', len) == NULL ? 'Q' : 'Z';
		memset(&err2, 0, sizeof err2);
		if (kl_provider_open(&p, copy, &err2) == KL_OK)
			kl_provider_free(p);
		else
			check(strstr(err2.message, pw) != NULL,
			      "err.message shows the URI's password", uri);
		free(copy);
	}
	free(pw);
}

int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	char *uri, *text, dir[512] = "";
	const char *rest;
	kl_provider *p = (kl_provider *)&p; /* must be overwritten */
	kl_error err;
	size_t n = 0, len;
	int rc;

	if ((text = malloc(size + 1)) == NULL)
		return 0;
	memcpy(text, data, size);
	text[size] = '\0';
	uri = text;

	if (has_prefix(text, "local:")) {
		rest = text + strlen("local:");
		len = (size_t)snprintf(dir, sizeof dir, "%s/d", tmp);
		for (; *rest != '\0' && n < 40; rest++) {
			char c = *rest;

			if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
			    (c >= '0' && c <= '9') || c == '.' || c == '_' ||
			    c == '-')
				dir[len + n++] = c;
		}
		dir[len + n] = '\0';
		if ((uri = malloc(strlen(dir) + sizeof "local:")) == NULL) {
			free(text);
			return 0;
		}
		strcpy(uri, "local:");
		strcat(uri, dir);
	} else if (plugins_present &&
		   (has_prefix(text, "redis") || has_prefix(text, "postgres"))) {
		free(text);
		return 0;
	}

	memset(&err, 0x5a, sizeof err);
	rc = kl_provider_open(&p, uri, &err);
	if (rc == KL_OK) {
		check(p != NULL, "KL_OK without a provider", uri);
		kl_provider_free(p);
	} else {
		check(p == NULL, "a failure left *out set", uri);
		check(err.status == rc, "err.status is not the status", uri);
		check(memchr(err.message, '\0', sizeof err.message) != NULL,
		      "err.message is not terminated", uri);
		check(err.message[0] != '\0', "err.message is empty", uri);
		check_secret(uri, err.message);
	}
	/* NULL arguments */
	check(kl_provider_open(NULL, uri, NULL) == KL_EINVAL, "NULL out", uri);
	check(kl_provider_open(&p, NULL, NULL) == KL_EINVAL && p == NULL,
	      "NULL uri", uri);

	if (dir[0] != '\0') {
		/* The provider made it, with its secret file and nothing
		 * else ("d.." names TMP itself). */
		char secret[sizeof dir + 16];

		snprintf(secret, sizeof secret, "%s/secret", dir);
		unlink(secret);
		rmdir(dir);
	}
	if (uri != text)
		free(uri);
	free(text);
	return 0;
}
