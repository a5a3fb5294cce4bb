/* SPDX-License-Identifier: MIT */
/*
 * The Redis provider's configuration: parsing its URI and options, and
 * finding the password (URI, password file, environment).
 *
 * A URI may hold a password, so no message here ever quotes the URI or a
 * part of it that could be the password: messages name the part that is
 * wrong instead.  Every copy of the password is wiped before it is freed.
 * No shared state: thread-safe.
 */
#include "config.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

#include "redis_internal.h"

#define DEFAULT_PORT 6379
#define DEFAULT_PREFIX "keylock:"
#define DEFAULT_POOL 4
#define MAX_POOL 1024
#define DEFAULT_TTL_MS 30000
#define MIN_TTL_MS 100
#define DEFAULT_TIMEOUT_MS 2000
#define DEFAULT_HEARTBEAT_MS 2000
#define MIN_HEARTBEAT_MS 100
#define MAX_HEARTBEAT_MS 3600000
#define MAX_PASSWORD 4096

#ifndef HAVE_SECURE_GETENV
static char *
secure_getenv(const char *name)
{
	return getuid() == geteuid() && getgid() == getegid() ? getenv(name)
							      : NULL;
}
#endif

static int
hexval(int c)
{
	if (c >= '0' && c <= '9')
		return c - '0';
	if (c >= 'a' && c <= 'f')
		return c - 'a' + 10;
	if (c >= 'A' && c <= 'F')
		return c - 'A' + 10;
	return -1;
}

/* A NUL-terminated, percent-decoded copy of s[0..n).  *out NULL and
 * KL_EINVAL for a bad escape, KL_ENOMEM; *len gets the decoded length. */
static int
decode(const char *s, size_t n, char **out, size_t *len)
{
	char *d;
	size_t i, j = 0;

	*out = NULL;
	if ((d = malloc(n + 1)) == NULL)
		return KL_ENOMEM;
	for (i = 0; i < n; i++) {
		int hi, lo;

		if (s[i] != '%') {
			d[j++] = s[i];
			continue;
		}
		hi = i + 2 < n ? hexval(s[i + 1]) : -1;
		lo = i + 2 < n ? hexval(s[i + 2]) : -1;
		if (hi < 0 || lo < 0) {
			kl__redis_wipe(d, j);
			free(d);
			return KL_EINVAL;
		}
		d[j++] = (char)(hi << 4 | lo);
		i += 2;
	}
	d[j] = '\0';
	*out = d;
	if (len != NULL)
		*len = j;
	return KL_OK;
}

static int
bad(kl_error *err, const char *what)
{
	kl__error_set(err, KL_EINVAL, "redis provider: %s", what);
	return KL_EINVAL;
}

/* A whole decimal number in [min, max]. */
static bool
parse_long(const char *s, size_t n, long min, long max, long *out)
{
	char buf[24], *end;
	long v;

	if (n == 0 || n >= sizeof buf)
		return false;
	memcpy(buf, s, n);
	buf[n] = '\0';
	for (size_t i = 0; i < n; i++)
		if (buf[i] < '0' || buf[i] > '9')
			return false;
	errno = 0;
	v = strtol(buf, &end, 10);
	if (errno != 0 || *end != '\0' || v < min || v > max)
		return false;
	*out = v;
	return true;
}

/* A duration option in [min, max] milliseconds ("forever" refused). */
static int
parse_duration(const char *name, const char *v, int64_t min, int64_t max,
	       int64_t *out, kl_error *err)
{
	int64_t ms;

	if (kl_duration_parse(v, &ms) != KL_OK || ms == KL_FOREVER ||
	    ms < min || ms > max) {
		kl__error_set(err, KL_EINVAL,
				"redis provider: option %s wants a duration "
				"from %lld ms to %lld ms (e.g. 250ms, 5s)",
				name, (long long)min, (long long)max);
		return KL_EINVAL;
	}
	*out = ms;
	return KL_OK;
}

/* Reads the password from path, refusing a file that others may read or
 * write (the rule libpq applies to .pgpass and client keys). */
static int
read_password_file(struct kl__redis_conf *conf, const char *path,
		   kl_error *err)
{
	char buf[MAX_PASSWORD + 2];
	struct stat st;
	ssize_t n;
	size_t len = 0;
	int fd, rc = KL_OK;

	fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NOCTTY);
	if (fd < 0) {
		kl__error_set(err, KL_EPROVIDER,
				"redis provider: cannot open the password "
				"file %s: %s",
				path, strerror(errno));
		return KL_EPROVIDER;
	}
	if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
		kl__error_set(err, KL_EPROVIDER,
				"redis provider: the password file %s is not "
				"a regular file",
				path);
		rc = KL_EPROVIDER;
	} else if ((st.st_mode & (S_IRWXG | S_IRWXO)) != 0) {
		kl__error_set(err, KL_EPROVIDER,
				"redis provider: the password file %s has "
				"mode %04o: it must not be accessible by group "
				"or others (chmod 0600 it)",
				path, (unsigned)(st.st_mode & 07777));
		rc = KL_EPROVIDER;
	} else if (st.st_uid != geteuid() && st.st_uid != 0) {
		kl__error_set(err, KL_EPROVIDER,
				"redis provider: the password file %s belongs "
				"to another user",
				path);
		rc = KL_EPROVIDER;
	}
	while (rc == KL_OK && len < sizeof buf) {
		n = read(fd, buf + len, sizeof buf - len);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0) {
			kl__error_set(err, KL_EPROVIDER,
					"redis provider: cannot read the "
					"password file %s: %s",
					path, strerror(errno));
			rc = KL_EPROVIDER;
		}
		if (n <= 0)
			break;
		len += (size_t)n;
	}
	close(fd);
	if (rc == KL_OK) {
		/* The first line is the password. */
		char *nl = memchr(buf, '\n', len);

		if (nl != NULL)
			len = (size_t)(nl - buf);
		if (len > 0 && buf[len - 1] == '\r')
			len--;
		if (len == 0 || len > MAX_PASSWORD) {
			kl__error_set(err, KL_EPROVIDER,
					"redis provider: the password file %s "
					"holds no password, or one longer than "
					"%d bytes",
					path, MAX_PASSWORD);
			rc = KL_EPROVIDER;
		} else if ((conf->pass = malloc(len + 1)) == NULL) {
			rc = KL_ENOMEM;
		} else {
			memcpy(conf->pass, buf, len);
			conf->pass[len] = '\0';
			conf->pass_len = len;
		}
	}
	kl__redis_wipe(buf, sizeof buf);
	return rc;
}

/* A TLS option's value: a path, or a server name; given once. */
static int
tls_option(char **field, const char *name, char **v, size_t vlen,
	   kl_error *err)
{
	if (vlen == 0) {
		kl__error_set(err, KL_EINVAL,
				"redis provider: option %s is empty", name);
		return KL_EINVAL;
	}
	if (*field != NULL) {
		kl__error_set(err, KL_EINVAL,
				"redis provider: option %s is given twice",
				name);
		return KL_EINVAL;
	}
	*field = *v;
	*v = NULL;
	return KL_OK;
}

/* One "name=value" of the query.  *pwfile gets a password_file value. */
static int
option(struct kl__redis_conf *conf, const char *s, size_t n, char **pwfile,
       kl_error *err)
{
	const char *eq = memchr(s, '=', n);
	char name[24], *v = NULL;
	size_t nlen, vlen;
	long num;
	int rc;

	if (eq == NULL)
		return bad(err, "an option is not NAME=VALUE");
	nlen = (size_t)(eq - s);
	if (nlen == 0 || nlen >= sizeof name)
		return bad(err, "unknown option");
	memcpy(name, s, nlen);
	name[nlen] = '\0';
	if ((rc = decode(eq + 1, n - nlen - 1, &v, &vlen)) != KL_OK)
		return rc == KL_EINVAL ? bad(err, "bad %-escape in an option")
				       : rc;
	/* The prefix too: kl_provider_snapshot names each lock by its Redis
	 * key, a C string (kl_lock_info.detail), which would end at the
	 * NUL, before the key's digest, and so name every lock alike. */
	if (strlen(v) != vlen) {
		free(v);
		return bad(err, "NUL byte in an option value");
	}
	if (strcmp(name, "ttl") == 0) {
		rc = parse_duration(name, v, MIN_TTL_MS, INT64_MAX / 4,
				    &conf->ttl_ms, err);
	} else if (strcmp(name, "timeout") == 0) {
		rc = parse_duration(name, v, 1, INT32_MAX, &conf->timeout_ms,
				    err);
	} else if (strcmp(name, "connect_timeout") == 0) {
		rc = parse_duration(name, v, 1, INT32_MAX,
				    &conf->connect_timeout_ms, err);
	} else if (strcmp(name, "heartbeat") == 0) {
		rc = parse_duration(name, v, MIN_HEARTBEAT_MS, MAX_HEARTBEAT_MS,
				    &conf->heartbeat_ms, err);
	} else if (strcmp(name, "restart_guard") == 0) {
		if (strcmp(v, "auto") == 0)
			conf->restart_guard_ms = KL_R_GUARD_AUTO;
		else
			rc = parse_duration(name, v, 0, INT64_MAX / 4,
					    &conf->restart_guard_ms, err);
	} else if (strcmp(name, "eviction") == 0) {
		if (strcmp(v, "refuse") == 0 || strcmp(v, "allow") == 0)
			conf->allow_eviction = strcmp(v, "allow") == 0;
		else
			rc = bad(err, "option eviction wants refuse or allow");
	} else if (strcmp(name, "pool") == 0) {
		if (parse_long(v, vlen, 1, MAX_POOL, &num))
			conf->pool = (size_t)num;
		else
			rc = bad(err, "option pool wants a number from 1 to "
				      "1024");
	} else if (strcmp(name, "prefix") == 0) {
		free(conf->prefix);
		conf->prefix = v;
		conf->prefix_len = vlen;
		v = NULL;
	} else if (strcmp(name, "password_file") == 0) {
		if (vlen == 0) {
			rc = bad(err, "option password_file is empty");
		} else {
			free(*pwfile);
			*pwfile = v;
			v = NULL;
		}
	} else if (strcmp(name, "tls_ca") == 0) {
		rc = tls_option(&conf->tls_ca, name, &v, vlen, err);
	} else if (strcmp(name, "tls_ca_dir") == 0) {
		rc = tls_option(&conf->tls_ca_dir, name, &v, vlen, err);
	} else if (strcmp(name, "tls_cert") == 0) {
		rc = tls_option(&conf->tls_cert, name, &v, vlen, err);
	} else if (strcmp(name, "tls_key") == 0) {
		rc = tls_option(&conf->tls_key, name, &v, vlen, err);
	} else if (strcmp(name, "tls_server_name") == 0) {
		rc = tls_option(&conf->tls_server_name, name, &v, vlen, err);
	} else {
		kl__error_set(err, KL_EINVAL,
				"redis provider: unknown option '%s' (known: "
				"ttl, timeout, connect_timeout, pool, prefix, "
				"heartbeat, restart_guard, password_file, "
				"eviction, tls_ca, tls_ca_dir, tls_cert, "
				"tls_key, tls_server_name)",
				name);
		rc = KL_EINVAL;
	}
	free(v);
	return rc;
}

/* Splits "[user[:pass]@]host[:port]" (n bytes at s). */
static int
authority(struct kl__redis_conf *conf, const char *s, size_t n,
	  kl_error *err)
{
	const char *at = NULL, *end = s + n, *h, *p;
	bool bracket = false;
	long port;
	int rc;

	for (const char *q = s; q < end; q++)
		if (*q == '@')
			at = q;
	if (at != NULL) {
		const char *colon = memchr(s, ':', (size_t)(at - s));
		const char *uend = colon != NULL ? colon : at;

		if (uend > s) {
			rc = decode(s, (size_t)(uend - s), &conf->user, NULL);
			if (rc != KL_OK)
				return rc == KL_EINVAL
					       ? bad(err, "bad %-escape in "
							  "the user name")
					       : rc;
		}
		if (colon != NULL) {
			rc = decode(colon + 1, (size_t)(at - colon - 1),
				    &conf->pass, &conf->pass_len);
			if (rc != KL_OK)
				return rc == KL_EINVAL
					       ? bad(err, "bad %-escape in "
							  "the password")
					       : rc;
			if (conf->pass_len == 0) {
				kl__redis_wipe(conf->pass, 1);
				free(conf->pass);
				conf->pass = NULL;
			}
		}
		s = at + 1;
	}
	/* host: "[v6]" or up to the last ':' */
	if (s < end && *s == '[') {
		const char *close = memchr(s, ']', (size_t)(end - s));

		if (close == NULL)
			return bad(err, "unclosed [ in the host");
		h = s + 1;
		p = close + 1;
		bracket = true;
		if (p < end && *p != ':')
			return bad(err, "junk after the IPv6 address");
		n = (size_t)(close - h);
	} else {
		p = s;
		while (p < end && *p != ':')
			p++;
		h = s;
		n = (size_t)(p - s);
	}
	if (n == 0) {
		h = "127.0.0.1";
		n = strlen(h);
	}
	if ((conf->host = malloc(n + 1)) == NULL)
		return KL_ENOMEM;
	memcpy(conf->host, h, n);
	conf->host[n] = '\0';
	/* A '%' belongs only in an IPv6 zone ("[fe80::1%eth0]"). */
	if (!bracket && memchr(conf->host, '%', n) != NULL)
		return bad(err, "bad character in the host");
	conf->port = DEFAULT_PORT;
	if (p < end) {
		if (!parse_long(p + 1, (size_t)(end - p - 1), 1, 65535, &port))
			return bad(err, "the port must be a number from 1 "
					"to 65535");
		conf->port = (int)port;
	}
	return KL_OK;
}

/* Refuses a second NAME= of the option at opt among the options of the
 * query before it: which of the two was meant cannot be told.  Called once
 * option() accepted the name, so that only a known name is quoted. */
static int
once(const char *query, const char *opt, kl_error *err)
{
	size_t n = strcspn(opt, "=&");
	const char *s;

	for (s = query; s < opt; s += strcspn(s, "&") + 1) {
		if (strncmp(s, opt, n) == 0 && s[n] == '=') {
			kl__error_set(err, KL_EINVAL,
					"redis provider: option %.*s is given "
					"twice",
					(int)n, opt);
			return KL_EINVAL;
		}
	}
	return KL_OK;
}

void
kl__redis_conf_clear(struct kl__redis_conf *conf)
{
	if (conf->pass != NULL)
		kl__redis_wipe(conf->pass, conf->pass_len);
	free(conf->pass);
	free(conf->user);
	free(conf->host);
	free(conf->prefix);
	free(conf->tls_ca);
	free(conf->tls_ca_dir);
	free(conf->tls_cert);
	free(conf->tls_key);
	free(conf->tls_server_name);
#ifdef HAVE_REDIS_TLS
	kl__redis_tls_ctx_free(conf);
#endif
	memset(conf, 0, sizeof *conf);
}

int
kl__redis_conf_parse(struct kl__redis_conf *conf, const char *uri,
		     kl_error *err)
{
	const char *s, *auth_end, *q, *query;
	char *pwfile = NULL;
	size_t skip = 8;
	long db;
	int rc;

	memset(conf, 0, sizeof *conf);
	/* Schemes are case-insensitive (RFC 3986, 3.1). */
	if (strncasecmp(uri, "rediss://", 9) == 0) {
#ifdef HAVE_REDIS_TLS
		conf->tls = true;
		skip = 9;
#else
		kl__error_set(err, KL_EPROVIDER,
				"redis provider: TLS (rediss://) is not "
				"compiled into this libkeylock-redis: it "
				"was built without OpenSSL (Debian: "
				"libssl-dev)");
		return KL_EPROVIDER;
#endif
	} else if (strncasecmp(uri, "redis://", 8) != 0)
		return bad(err, "the URI must start with redis://");
	conf->pool = DEFAULT_POOL;
	conf->ttl_ms = DEFAULT_TTL_MS;
	conf->timeout_ms = DEFAULT_TIMEOUT_MS;
	conf->connect_timeout_ms = DEFAULT_TIMEOUT_MS;
	conf->heartbeat_ms = DEFAULT_HEARTBEAT_MS;
	conf->restart_guard_ms = KL_R_GUARD_AUTO;
	s = uri + skip;
	auth_end = s + strcspn(s, "/?#");
	if (*auth_end == '#') {
		rc = bad(err, "a URI fragment (#) is not allowed");
		goto fail;
	}
	if ((rc = authority(conf, s, (size_t)(auth_end - s), err)) != KL_OK)
		goto fail;
	s = auth_end;
	if (*s == '/') {
		size_t n = strcspn(s + 1, "?#");

		if (n > 0 && !parse_long(s + 1, n, 0, INT_MAX, &db)) {
			rc = bad(err, "the database (after /) must be a "
				      "number");
			goto fail;
		}
		conf->db = n > 0 ? (int)db : 0;
		s += 1 + n;
	}
	if (*s == '#') {
		rc = bad(err, "a URI fragment (#) is not allowed");
		goto fail;
	}
	if (*s == '?') {
		query = s + 1;
		for (s++; *s != '\0'; s = *q != '\0' ? q + 1 : q) {
			q = s + strcspn(s, "&");
			if (q == s)
				continue;
			if ((rc = option(conf, s, (size_t)(q - s), &pwfile,
					 err)) != KL_OK ||
			    (rc = once(query, s, err)) != KL_OK)
				goto fail;
		}
	}
	if (!conf->tls && (conf->tls_ca != NULL || conf->tls_ca_dir != NULL ||
			   conf->tls_cert != NULL || conf->tls_key != NULL ||
			   conf->tls_server_name != NULL)) {
		rc = bad(err, "the tls_* options need a rediss:// URI");
		goto fail;
	}
	if ((conf->tls_cert == NULL) != (conf->tls_key == NULL)) {
		rc = bad(err, "options tls_cert and tls_key go together");
		goto fail;
	}
	if (conf->prefix == NULL) {
		conf->prefix_len = strlen(DEFAULT_PREFIX);
		if ((conf->prefix = strdup(DEFAULT_PREFIX)) == NULL) {
			rc = KL_ENOMEM;
			goto fail;
		}
	}
	if (pwfile != NULL) {
		if (conf->pass != NULL) {
			rc = bad(err, "give the password either in the URI "
				      "or in password_file, not both");
			goto fail;
		}
		if ((rc = read_password_file(conf, pwfile, err)) != KL_OK)
			goto fail;
	} else if (conf->pass == NULL) {
		const char *env = secure_getenv("KEYLOCK_REDIS_PASSWORD");

		if (env != NULL && env[0] != '\0') {
			conf->pass_len = strlen(env);
			if ((conf->pass = strdup(env)) == NULL) {
				rc = KL_ENOMEM;
				goto fail;
			}
		}
	}
	if (conf->user != NULL && conf->pass == NULL) {
		kl__error_set(err, KL_EPROVIDER,
				"redis provider: authentication as user '%s' "
				"needs a password (in the URI, password_file "
				"or KEYLOCK_REDIS_PASSWORD)",
				conf->user);
		rc = KL_EPROVIDER;
		goto fail;
	}
#ifdef HAVE_REDIS_TLS
	if (conf->tls && (rc = kl__redis_tls_ctx_new(conf, err)) != KL_OK)
		goto fail;
#endif
	free(pwfile);
	return KL_OK;
fail:
	free(pwfile);
	kl__redis_conf_clear(conf);
	return rc;
}
