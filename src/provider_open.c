/* SPDX-License-Identifier: MIT */
/*
 * kl_provider_open: a provider by URI, through the table of schemes below.
 * This file is the one that knows the built-in providers (memory:, local:)
 * and the provider libraries loaded on demand (redis://, postgresql://):
 * it sits above them all, so that provider.c, which every provider uses,
 * never calls up into one of them (src/README).
 */
#include "config.h"

#include <ctype.h>
#include <dlfcn.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "internal.h"

/* Schemes are case-insensitive (RFC 3986, 3.1). */
static bool
has_prefix(const char *s, const char *prefix)
{
	return strncasecmp(s, prefix, strlen(prefix)) == 0;
}

#ifndef HAVE_SECURE_GETENV
static char *
secure_getenv(const char *name)
{
	return getuid() == geteuid() && getgid() == getegid() ? getenv(name)
							      : NULL;
}
#endif

typedef int (*open_fn)(kl_provider **out, const char *uri, kl_error *err);

/* Calls fn with uri's scheme in lower case: a library's own parser (libpq's
 * among them) may know no other.  The copy may hold a password: it is
 * wiped before it is freed. */
static int
open_lower(open_fn fn, kl_provider **out, const char *uri, kl_error *err)
{
	size_t n = strcspn(uri, ":"), len, i;
	volatile char *v;
	char *copy;
	int rc;

	for (i = 0; i < n && !isupper((unsigned char)uri[i]); i++)
		;
	if (i == n)
		return fn(out, uri, err);
	len = strlen(uri);
	if ((copy = kl__malloc(len + 1)) == NULL) {
		kl__error_set(err, KL_ENOMEM, "out of memory");
		return KL_ENOMEM;
	}
	memcpy(copy, uri, len + 1);
	for (i = 0; i < n; i++)
		copy[i] = (char)tolower((unsigned char)copy[i]);
	rc = fn(out, copy, err);
	for (v = copy, i = 0; i < len; i++)
		v[i] = '\0';
	kl__free(copy);
	return rc;
}

/* Loads a provider library on demand, so that libkeylock itself never links
 * hiredis or libpq.  KEYLOCK_PROVIDER_DIR (ignored in setuid programs) is
 * searched first, for running from a build tree; then the usual library
 * path.  The library stays loaded for the life of the process: providers it
 * made may still be in use. */
static int
open_plugin(const char *lib, const char *sym, const char *what,
	    kl_provider **out, const char *uri, kl_error *err)
{
	const char *dir = secure_getenv("KEYLOCK_PROVIDER_DIR");
	void *handle = NULL;
	open_fn fn;
	char path[4096];

	if (dir != NULL && dir[0] != '\0' &&
	    (size_t)snprintf(path, sizeof path, "%s/%s", dir, lib) <
		    sizeof path)
		handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	if (handle == NULL)
		handle = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
	if (handle == NULL) {
		kl__error_set(err, KL_EPROVIDER,
			      "the %s provider needs %s, which is not "
			      "installed (%s)",
			      what, lib, dlerror());
		return KL_EPROVIDER;
	}
	*(void **)&fn = dlsym(handle, sym);
	if (fn == NULL) {
		kl__error_set(err, KL_EPROVIDER, "%s has no %s", lib, sym);
		dlclose(handle);
		return KL_EPROVIDER;
	}
	return open_lower(fn, out, uri, err);
}

struct scheme;
typedef int (*scheme_fn)(const struct scheme *s, kl_provider **out,
			 const char *uri, kl_error *err);

struct scheme {
	const char *prefix; /* case-insensitive (RFC 3986, 3.1) */
	bool whole;         /* the URI must be the prefix and nothing more */
	scheme_fn open;
	/* open_library's: the library, its open function, the name in
	 * messages. */
	const char *lib, *sym, *what;
};

static int
open_memory(const struct scheme *s, kl_provider **out, const char *uri,
	    kl_error *err)
{
	(void)s;
	(void)uri;
	(void)err;
	*out = kl_memory_provider();
	return KL_OK;
}

static int
open_local(const struct scheme *s, kl_provider **out, const char *uri,
	   kl_error *err)
{
	return kl__local_provider_open(out, uri + strlen(s->prefix), err);
}

static int
open_library(const struct scheme *s, kl_provider **out, const char *uri,
	     kl_error *err)
{
	return open_plugin(s->lib, s->sym, s->what, out, uri, err);
}

#define REDIS_LIB "libkeylock-redis.so.0", "kl_redis_provider_open", "redis"
#define PG_LIB "libkeylock-pg.so.0", "kl_pg_provider_open", "postgresql"

static const struct scheme schemes[] = {
	{ "memory:", true, open_memory, NULL, NULL, NULL },
	{ "memory://", true, open_memory, NULL, NULL, NULL },
	{ "redis://", false, open_library, REDIS_LIB },
	{ "rediss://", false, open_library, REDIS_LIB },
	{ "postgresql://", false, open_library, PG_LIB },
	{ "postgres://", false, open_library, PG_LIB },
	{ "local:", false, open_local, NULL, NULL, NULL },
};

int
kl_provider_open(kl_provider **out, const char *uri, kl_error *err)
{
	if (out != NULL)
		*out = NULL;
	if (out == NULL || uri == NULL) {
		kl__error_set(err, KL_EINVAL, "no provider URI given");
		return KL_EINVAL;
	}
	for (size_t i = 0; i < sizeof schemes / sizeof schemes[0]; i++) {
		const struct scheme *s = &schemes[i];
		int rc, cs;

		if (!(s->whole ? strcasecmp(uri, s->prefix) == 0
			       : has_prefix(uri, s->prefix)))
			continue;
		/* Opening connects, loads a library and opens files: a
		 * cancel acted on there would leak what was made so far. */
		cs = kl__cancel_off();
		rc = s->open(s, out, uri, err);
		kl__cancel_restore(cs);
		return rc;
	}
	kl__error_set(err, KL_EINVAL,
		      "unknown provider URI scheme (expected memory:, local:, "
		      "redis:// or postgresql://)");
	return KL_EINVAL;
}
