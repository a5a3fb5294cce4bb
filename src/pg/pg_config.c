/* SPDX-License-Identifier: MIT */
/*
 * Configuration of the PostgreSQL provider (libkeylock-pg) and its
 * secrets: the provider URI is split into our own query options (pool,
 * health_interval, fence_sequence) and libpq's keywords, and every message
 * (kl__pg_fail) names the server as "host H port P database D", not by its
 * URI, with the password masked both as libpq decoded it and as it was
 * written in the URI (libpq may quote it undecoded).  Nothing here
 * takes a lock: the provider's fields it writes are fixed once open has
 * returned.
 */
#include "config.h"

#include <errno.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <libpq-fe.h>

#include "keylock.h"
#include "pg_fence.h"
#include "pg_internal.h"

#define MAX_POOL 1024
#define MIN_HEALTH_MS 10
#define MAX_HEALTH_MS 3600000
#define DEFAULT_CONNECT_TIMEOUT "5"

/* ------------------------------------------------------------------ */
/* Messages: never the password                                        */

/* Copies src into dst (size bytes), cut short if need be. */
void
kl__pg_copy_str(char *dst, size_t size, const char *src)
{
	size_t n = strlen(src);

	if (n >= size)
		n = size - 1;
	memcpy(dst, src, n);
	dst[n] = '\0';
}

/* Appends src to the string in dst (size bytes), cut short if need be. */
void
kl__pg_append(char *dst, size_t size, const char *src)
{
	size_t n = strlen(dst);

	if (n + 1 < size)
		kl__pg_copy_str(dst + n, size - n, src);
}

/* Replaces every occurrence of secret in buf (size bytes) by "***". */
static void
mask(char *buf, size_t size, const char *secret)
{
	char out[512];
	size_t n = 0, slen, i = 0;

	if (secret == NULL || (slen = strlen(secret)) == 0)
		return;
	if (size > sizeof out)
		size = sizeof out;
	while (buf[i] != '\0' && n + 1 < size) {
		if (strncmp(buf + i, secret, slen) == 0) {
			for (const char *s = "***"; *s != '\0' && n + 1 < size;
			     s++)
				out[n++] = *s;
			i += slen;
		} else {
			out[n++] = buf[i++];
		}
	}
	out[n] = '\0';
	memcpy(buf, out, n + 1);
}

/* libpq's messages end in newlines and indent with tabs: one line. */
static void
one_line(char *s)
{
	char *w = s;
	bool space = false;

	for (char *r = s; *r != '\0'; r++) {
		if (*r == '\n' || *r == '\t' || *r == '\r' || *r == ' ') {
			space = w != s;
			continue;
		}
		if (space)
			*w++ = ' ';
		space = false;
		*w++ = *r;
	}
	*w = '\0';
}

static void
scrub(const struct kl__pg *p, char *buf, size_t size)
{
	one_line(buf);
	if (p != NULL) {
		mask(buf, size, p->password);
		mask(buf, size, p->raw_password);
	}
}

/* Fills err with status and "postgresql (where): message".  For
 * KL_ETIMEDOUT and KL_ECANCELED with a NULL fmt only the status is set,
 * so that the lock layer words the message. */
int
kl__pg_fail(const struct kl__pg *p, kl_error *err, int status,
	    const char *fmt, ...)
{
	char msg[sizeof err->message];
	va_list ap;

	if (err == NULL)
		return status;
	err->status = status;
	err->message[0] = '\0';
	if (fmt == NULL)
		return status;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof msg, fmt, ap);
	va_end(ap);
	/* A message cut short is still worth having. */
	kl__pg_copy_str(err->message, sizeof err->message, "postgresql");
	if (p != NULL && p->where[0] != '\0') {
		kl__pg_append(err->message, sizeof err->message, " (");
		kl__pg_append(err->message, sizeof err->message, p->where);
		kl__pg_append(err->message, sizeof err->message, ")");
	}
	kl__pg_append(err->message, sizeof err->message, ": ");
	kl__pg_append(err->message, sizeof err->message, msg);
	scrub(p, err->message, sizeof err->message);
	return status;
}

/* ------------------------------------------------------------------ */
/* The URI                                                             */

/* The password as written in the URI (between the first ':' of the
 * user info and its '@'), or NULL: libpq may quote it undecoded when it
 * cannot parse it. */
static char *
raw_password_of(const char *uri)
{
	const char *s = strstr(uri, "://"), *end, *colon;

	if (s == NULL)
		return NULL;
	s += 3;
	end = s + strcspn(s, "/?#");
	colon = memchr(s, ':', (size_t)(end - s));
	for (const char *at = end; at > s; at--) {
		if (at[-1] == '@') {
			if (colon == NULL || colon >= at - 1)
				return NULL;
			return strndup(colon + 1, (size_t)(at - 1 - colon - 1));
		}
	}
	return NULL;
}

/* Parses one of our options.  KL_OK or KL_EINVAL. */
static int
take_option(struct kl__pg *p, const char *name, size_t nlen, const char *val,
	    size_t vlen, bool *ours, kl_error *err)
{
	char buf[32];
	char *end;
	int64_t ms;
	long n;

	*ours = false;
	if (nlen == 14 && memcmp(name, "fence_sequence", 14) == 0) {
		*ours = true;
		if (kl__pg_fence_init(&p->fence, val, vlen) != 0)
			return kl__pg_fail(
				NULL, err, KL_EINVAL,
				"bad fence_sequence '%.*s' (schema.name)",
				(int)(vlen < 140 ? vlen : 140), val);
		return KL_OK;
	}
	if (vlen >= sizeof buf)
		vlen = sizeof buf - 1;
	memcpy(buf, val, vlen);
	buf[vlen] = '\0';
	if (nlen == 4 && memcmp(name, "pool", 4) == 0) {
		*ours = true;
		errno = 0;
		n = strtol(buf, &end, 10);
		if (buf[0] < '0' || buf[0] > '9' || *end != '\0' ||
		    errno != 0 || n < 1 || n > MAX_POOL)
			return kl__pg_fail(NULL, err, KL_EINVAL,
					   "bad pool size '%s' (1..%d)", buf,
					   MAX_POOL);
		p->pool_max = (size_t)n;
	} else if (nlen == 15 && memcmp(name, "health_interval", 15) == 0) {
		*ours = true;
		if (kl_duration_parse(buf, &ms) != KL_OK ||
		    ms < MIN_HEALTH_MS || ms > MAX_HEALTH_MS)
			return kl__pg_fail(
				NULL, err, KL_EINVAL,
				"bad health_interval '%s' (10ms..1h)", buf);
		p->health_ms = ms;
	}
	return KL_OK;
}

/* Copies uri into *out without our query parameters, reading them into p.
 * KL_OK, KL_EINVAL or KL_ENOMEM. */
static int
strip_options(struct kl__pg *p, const char *uri, char **out, kl_error *err)
{
	const char *q = strchr(uri, '?'), *s, *amp, *eq;
	size_t len = strlen(uri), n;
	char *res;
	bool ours, first = true;
	int rc;

	*out = NULL;
	if ((res = malloc(len + 1)) == NULL)
		return kl__pg_fail(NULL, err, KL_ENOMEM, "out of memory");
	if (q == NULL) {
		memcpy(res, uri, len + 1);
		*out = res;
		return KL_OK;
	}
	n = (size_t)(q - uri);
	memcpy(res, uri, n);
	for (s = q + 1; *s != '\0'; s = *amp != '\0' ? amp + 1 : amp) {
		amp = s + strcspn(s, "&");
		eq = memchr(s, '=', (size_t)(amp - s));
		if (eq != NULL) {
			rc = take_option(p, s, (size_t)(eq - s), eq + 1,
					 (size_t)(amp - eq - 1), &ours, err);
			if (rc != KL_OK) {
				free(res);
				return rc;
			}
			if (ours)
				continue;
		}
		res[n++] = first ? '?' : '&';
		first = false;
		memcpy(res + n, s, (size_t)(amp - s));
		n += (size_t)(amp - s);
	}
	res[n] = '\0';
	*out = res;
	return KL_OK;
}

static const char *
opt_value(const PQconninfoOption *o, const char *name)
{
	for (; o != NULL && o->keyword != NULL; o++)
		if (strcmp(o->keyword, name) == 0)
			return o->val != NULL && o->val[0] != '\0' ? o->val
								   : NULL;
	return NULL;
}

/* Reads the URI into p: options, keywords for libpq, the description used
 * in messages.  KL_OK, KL_EINVAL, KL_ENOMEM. */
int
kl__pg_parse_uri(struct kl__pg *p, const char *uri, kl_error *err)
{
	const PQconninfoOption *o;
	const char *host, *port, *db, *ct;
	char *stripped, *perr = NULL;
	size_t n = 0, cap = 3;
	int rc, len;

	p->raw_password = raw_password_of(uri);
	if ((rc = strip_options(p, uri, &stripped, err)) != KL_OK)
		return rc;
	p->opts = PQconninfoParse(stripped, &perr);
	free(stripped);
	if (p->opts == NULL) {
		if (perr == NULL)
			return kl__pg_fail(p, err, KL_ENOMEM, "out of memory");
		kl__pg_fail(p, err, KL_EINVAL, "malformed URI: %s", perr);
		PQfreemem(perr);
		return KL_EINVAL;
	}
	for (o = p->opts; o->keyword != NULL; o++)
		cap++;
	p->keys = calloc(cap, sizeof *p->keys);
	p->vals = calloc(cap, sizeof *p->vals);
	if (p->keys == NULL || p->vals == NULL)
		return kl__pg_fail(p, err, KL_ENOMEM, "out of memory");
	/* Our defaults first: libpq keeps the last value given for a key,
	 * so the URI's own win. */
	if (opt_value(p->opts, "connect_timeout") == NULL) {
		p->keys[n] = "connect_timeout";
		p->vals[n++] = DEFAULT_CONNECT_TIMEOUT;
	}
	if (opt_value(p->opts, "application_name") == NULL) {
		p->keys[n] = "application_name";
		p->vals[n++] = "keylock";
	}
	for (o = p->opts; o->keyword != NULL; o++) {
		if (o->val == NULL)
			continue;
		p->keys[n] = o->keyword;
		p->vals[n++] = o->val;
	}
	p->keys[n] = NULL;
	p->vals[n] = NULL;

	if (opt_value(p->opts, "password") != NULL &&
	    (p->password = strdup(opt_value(p->opts, "password"))) == NULL)
		return kl__pg_fail(p, err, KL_ENOMEM, "out of memory");
	ct = opt_value(p->opts, "connect_timeout");
	if (ct == NULL)
		ct = DEFAULT_CONNECT_TIMEOUT;
	else if (strspn(ct, "0123456789") != strlen(ct) || strlen(ct) > 6)
		return kl__pg_fail(p, err, KL_EINVAL,
				   "bad connect_timeout '%s'", ct);
	/* libpq's rule: seconds, 0 = none, 1 is taken as 2. */
	p->connect_timeout_ms = strtoll(ct, NULL, 10) * 1000;
	if (p->connect_timeout_ms == 1000)
		p->connect_timeout_ms = 2000;

	host = opt_value(p->opts, "host");
	if (host == NULL)
		host = opt_value(p->opts, "hostaddr");
	port = opt_value(p->opts, "port");
	db = opt_value(p->opts, "dbname");
	len = snprintf(p->where, sizeof p->where, "host %s port %s database %s",
		       host != NULL ? host : "(default)",
		       port != NULL ? port : "(default)",
		       db != NULL ? db : "(default)");
	if (len < 0)
		p->where[0] = '\0';
	scrub(p, p->where, sizeof p->where);
	return KL_OK;
}
