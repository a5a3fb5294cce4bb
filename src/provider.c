/* SPDX-License-Identifier: MIT */
/*
 * Providers: the ops table every provider implements, user-written ones
 * through kl_provider_new, and kl_provider_open's URI dispatch.
 */
#include "config.h"

#include <ctype.h>
#include <dlfcn.h>
#include <stdarg.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "internal.h"

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

		buf[n++] = ch >= 0x20 && ch < 0x7f ? (char)ch : '?';
	}
	if (i < len) {
		memcpy(buf + n, "...", 3);
		n += 3;
	}
	buf[n] = '\0';
}

#define MIN_OPS_SIZE                                                       \
	(offsetof(kl_provider_ops, destroy) + sizeof(void (*)(void)))

int
kl_provider_new(kl_provider **out, const kl_provider_ops *ops, void *impl)
{
	kl_provider *p;

	if (out == NULL)
		return KL_EINVAL;
	*out = NULL;
	/* A provider built against an older, shorter kl_provider_ops is
	 * accepted; members it does not know stay NULL. */
	if (ops == NULL || ops->struct_size < MIN_OPS_SIZE ||
	    ops->struct_size > sizeof *ops || ops->acquire == NULL ||
	    ops->release == NULL)
		return KL_EINVAL;
	if ((p = kl__calloc(1, sizeof *p)) == NULL)
		return KL_ENOMEM;
	memcpy(&p->ops, ops, ops->struct_size);
	p->impl = impl;
	*out = p;
	return KL_OK;
}

int
kl_provider_status(kl_provider *p, const char *key, size_t *holders,
		   size_t *waiters, kl_error *err)
{
	if (holders != NULL)
		*holders = 0;
	if (waiters != NULL)
		*waiters = 0;
	if (p == NULL || key == NULL || holders == NULL || waiters == NULL) {
		kl__error_set(err, KL_EINVAL, "no provider, key or output");
		return KL_EINVAL;
	}
	if (p->ops.status == NULL) {
		kl__error_set(err, KL_EPROVIDER,
			      "the %s provider cannot tell a key's status",
			      p->ops.name != NULL ? p->ops.name : "user");
		return KL_EPROVIDER;
	}
	return p->ops.status(p->impl, key, strlen(key), holders, waiters, err);
}

void
kl_provider_free(kl_provider *p)
{
	if (p == NULL || p->shared)
		return;
	if (p->ops.destroy != NULL)
		p->ops.destroy(p->impl);
	kl__free(p);
}

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

int
kl_provider_open(kl_provider **out, const char *uri, kl_error *err)
{
	if (out != NULL)
		*out = NULL;
	if (out == NULL || uri == NULL) {
		kl__error_set(err, KL_EINVAL, "no provider URI given");
		return KL_EINVAL;
	}
	if (strcasecmp(uri, "memory:") == 0 ||
	    strcasecmp(uri, "memory://") == 0) {
		*out = kl_memory_provider();
		return KL_OK;
	}
	if (has_prefix(uri, "redis://") || has_prefix(uri, "rediss://"))
		return open_plugin("libkeylock-redis.so.0",
				   "kl_redis_provider_open", "redis", out, uri,
				   err);
	if (has_prefix(uri, "postgresql://") || has_prefix(uri, "postgres://"))
		return open_plugin("libkeylock-pg.so.0", "kl_pg_provider_open",
				   "postgresql", out, uri, err);
	if (has_prefix(uri, "local:"))
		return kl__local_provider_open(out, uri + strlen("local:"), err);
	kl__error_set(err, KL_EINVAL,
		      "unknown provider URI scheme (expected memory:, local:, "
		      "redis:// or postgresql://)");
	return KL_EINVAL;
}
