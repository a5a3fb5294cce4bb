/* SPDX-License-Identifier: MIT */
/*
 * Connecting to the Redis server: a new connection of the provider, made
 * within the connect timeout, then in one pipelined round trip
 * authenticated, its database selected, the server identified by its INFO
 * (run_id, uptime, version, eviction policy, persistence) and the scripts
 * loaded (redis_scripts.c).  The I/O is in redis_io.c; with rediss://, the
 * TLS handshake comes first (redis_tls.c).  A message never shows the
 * password.
 */
#include "config.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include "redis_internal.h"

static struct timeval
tv_ms(int64_t ms)
{
	struct timeval tv;

	if (ms > INT32_MAX)
		ms = INT32_MAX;
	tv.tv_sec = (time_t)(ms / 1000);
	tv.tv_usec = (suseconds_t)(ms % 1000) * 1000;
	return tv;
}

void
kl__rconn_close(struct kl__rconn *c)
{
	if (c == NULL)
		return;
#ifdef HAVE_REDIS_TLS
	kl__rtls_free(c->tls);
#endif
	/* redisFree only closes the socket: no QUIT is written, so closing
	 * a connection inherited over fork() does not disturb the parent. */
	if (c->ctx != NULL)
		redisFree(c->ctx);
	free(c);
}

/* The value of "name:" in an INFO text, copied into buf. */
static bool
info_field(const char *info, const char *name, char *buf, size_t size)
{
	size_t n = strlen(name);
	const char *p = info;

	while ((p = strstr(p, name)) != NULL) {
		if ((p == info || p[-1] == '\n') && p[n] == ':') {
			size_t len = strcspn(p + n + 1, "\r\n");

			if (len >= size)
				return false;
			memcpy(buf, p + n + 1, len);
			buf[len] = '\0';
			return true;
		}
		p += n;
	}
	return false;
}

/* Whether the text s (n bytes) contains the password: then it is not
 * shown. */
static bool
mentions(const char *s, size_t n, const struct kl__redis_conf *conf)
{
	if (conf->pass == NULL || conf->pass_len == 0 || n < conf->pass_len)
		return false;
	for (size_t i = 0; i + conf->pass_len <= n; i++)
		if (memcmp(s + i, conf->pass, conf->pass_len) == 0)
			return true;
	return false;
}

static int
auth_failed(struct kl__rconn *c, const struct kl__redis_conf *conf,
	    const redisReply *r, kl_error *err)
{
	bool show = r != NULL && r->type == REDIS_REPLY_ERROR &&
		    !mentions(r->str, r->len, conf);

	c->broken = true;
	if (conf->pass == NULL)
		kl__error_set(err, KL_EPROVIDER,
				"redis provider: authentication required by "
				"the server, and no password was given (URI, "
				"password_file or KEYLOCK_REDIS_PASSWORD)");
	else
		kl__error_set(err, KL_EPROVIDER,
				"redis provider: authentication failed%s%s%s "
				"(%.120s)",
				conf->user != NULL ? " for user '" : "",
				conf->user != NULL ? conf->user : "",
				conf->user != NULL ? "'" : "",
				show ? r->str : "the server refused it");
	return KL_EPROVIDER;
}

static int
identify(struct kl__rconn *c, const redisReply *r, kl_error *err)
{
	char buf[64], *end;
	long long secs;
	long major = 0, minor = 0;

	if (r->type != REDIS_REPLY_STRING) {
		c->broken = true;
		kl__error_set(err, KL_EPROVIDER,
				"redis provider: INFO failed: %.160s",
				r->type == REDIS_REPLY_ERROR ? r->str : "?");
		return KL_EPROVIDER;
	}
	if (!info_field(r->str, "run_id", c->run_id, sizeof c->run_id) ||
	    !info_field(r->str, "uptime_in_seconds", buf, sizeof buf)) {
		c->broken = true;
		kl__error_set(err, KL_EPROVIDER,
				"redis provider: the server's INFO lacks "
				"run_id or uptime_in_seconds");
		return KL_EPROVIDER;
	}
	/* Redis counts whole seconds of the wall clock between its start
	 * and now (floor(now) - floor(start)), up to a second more than it
	 * has really been up: take one off, so that the estimate stays a
	 * lower bound and the restart guard never ends early. */
	secs = strtoll(buf, NULL, 10);
	/* A bogus uptime must not overflow here or in kl__rconn_uptime_ms:
	 * 2^40 s is over 34000 years. */
	if (secs > INT64_C(1) << 40)
		secs = INT64_C(1) << 40;
	c->up_ms = secs > 0 ? secs * 1000 - 1000 : 0;
	/* Our clock from after the reply: INFO ran before it. */
	c->t0_ns = kl__now_ns();
	if (!info_field(r->str, "redis_version", buf, sizeof buf)) {
		snprintf(buf, sizeof buf, "of no stated version");
	} else {
		/* strtol, not sscanf: an out-of-range number is no UB. */
		major = strtol(buf, &end, 10);
		if (*end == '.')
			minor = strtol(end + 1, NULL, 10);
	}
	/* Clamped, so that a bogus version cannot overflow. */
	major = major < 0 ? 0 : major > 9999 ? 9999 : major;
	minor = minor < 0 ? 0 : minor > 99 ? 99 : minor;
	c->version = (int)(major * 100 + minor);
	if (c->version < 600) {
		c->broken = true;
		kl__error_set(err, KL_EPROVIDER,
				"redis provider: the server is Redis %s; "
				"6.0 or later is needed",
				buf);
		return KL_EPROVIDER;
	}
	c->persistent = info_field(r->str, "aof_enabled", buf, sizeof buf) &&
			strcmp(buf, "1") == 0;
	return KL_OK;
}

int64_t
kl__rconn_uptime_ms(const struct kl__rconn *c)
{
	int64_t d = kl__now_ns() - c->t0_ns;

	return c->up_ms + (d > 0 ? d / 1000000 : 0);
}

/* Refuses a server that may evict keys: every key of a lock has an expiry,
 * so the volatile-* policies may evict them as well as the allkeys-* ones,
 * and a held lock evicted is granted again while its holder still believes
 * it holds it.  Without maxmemory (0) Redis evicts nothing, whatever the
 * policy; a server whose INFO does not tell its policy is taken as it is.
 * INFO is read again on every new connection, so a server reconfigured
 * later is refused from its next connection on. */
static int
check_eviction(struct kl__rconn *c, const struct kl__redis_conf *conf,
	       const char *info, kl_error *err)
{
	char policy[64], max[32];

	if (conf->allow_eviction ||
	    !info_field(info, "maxmemory_policy", policy, sizeof policy) ||
	    strcmp(policy, "noeviction") == 0)
		return KL_OK;
	if (info_field(info, "maxmemory", max, sizeof max) &&
	    strcmp(max, "0") == 0)
		return KL_OK;
	c->broken = true;
	kl__error_set(err, KL_EPROVIDER,
			"redis provider: the server may evict held locks "
			"(maxmemory-policy %s, maxmemory set): set "
			"maxmemory-policy noeviction, or add eviction=allow to "
			"the URI to accept the risk",
			policy);
	return KL_EPROVIDER;
}

/* With appendonly on, asks whether every write is fsynced: only then do
 * locks survive a crash of the server.  A server that refuses CONFIG (it
 * may be renamed) counts as not persistent. */
static int
check_fsync(struct kl__rconn *c, int64_t deadline, kl_error *err)
{
	const char *argv[] = { "CONFIG", "GET", "appendfsync" };
	size_t lens[] = { 6, 3, 11 };
	redisReply *r;
	int rc;

	rc = kl__rconn_command(c, deadline, 3, argv, lens, &r, err);
	if (rc != KL_OK)
		return rc;
	c->persistent = r->type == REDIS_REPLY_ARRAY && r->elements == 2 &&
			r->element[1]->type == REDIS_REPLY_STRING &&
			strcmp(r->element[1]->str, "always") == 0;
	freeReplyObject(r);
	return KL_OK;
}

int
kl__rconn_open(const struct kl__redis_conf *conf, int64_t cap_ns,
	       struct kl__rconn **out, kl_error *err)
{
	redisReply *rep[3 + KL_RS_COUNT];
	struct kl__rconn *c;
	int64_t deadline, connect_ms = conf->connect_timeout_ms, left;
	char db[16];
	int n = 0, i, rc, info;

	*out = NULL;
	if (cap_ns != KL_R_NO_DEADLINE) {
		left = (cap_ns - kl__now_ns()) / 1000000;
		if (left < connect_ms)
			connect_ms = left > 1 ? left : 1;
	}
	if ((c = calloc(1, sizeof *c)) == NULL)
		return KL_ENOMEM;
	c->pid = kl__redis_getpid();
	c->ctx = redisConnectWithTimeout(conf->host, conf->port,
					 tv_ms(connect_ms));
	if (c->ctx == NULL) {
		free(c);
		return KL_ENOMEM;
	}
	if (c->ctx->err != 0) {
		kl__error_set(err, KL_EPROVIDER,
				"redis provider: cannot connect to %s port "
				"%d: %s",
				conf->host, conf->port, c->ctx->errstr);
		kl__rconn_close(c);
		return KL_EPROVIDER;
	}
	redisSetTimeout(c->ctx, tv_ms(conf->timeout_ms));
	/* A blocking recv() waits one slice at most (see read_some). */
	{
		int64_t slice_ms = conf->timeout_ms / 4;
		struct timeval tv;

		if (slice_ms > KL_R_RCV_SLICE_MS)
			slice_ms = KL_R_RCV_SLICE_MS;
		if (slice_ms < 1)
			slice_ms = 1;
		tv = tv_ms(slice_ms);
		/* Failing that, every read polls first. */
		c->rcv_ns = setsockopt(c->ctx->fd, SOL_SOCKET, SO_RCVTIMEO,
				       &tv, sizeof tv) == 0
				    ? slice_ms * 1000000
				    : KL_R_NO_DEADLINE / 2;
	}
	redisEnableKeepAlive(c->ctx);
	deadline = kl__redis_deadline(conf->timeout_ms);
	if (cap_ns < deadline)
		deadline = cap_ns;
#ifdef HAVE_REDIS_TLS
	if (conf->tls &&
	    (rc = kl__rtls_start(c, conf, deadline, err)) != KL_OK) {
		kl__rconn_close(c);
		return rc;
	}
#endif

	/* One round trip: AUTH, SELECT, INFO and the scripts, pipelined. */
	rc = KL_OK;
	if (conf->pass != NULL) {
		const char *argv[3] = { "AUTH" };
		size_t lens[3] = { 4 };
		int argc = 1;

		if (conf->user != NULL) {
			argv[argc] = conf->user;
			lens[argc++] = strlen(conf->user);
		}
		argv[argc] = conf->pass;
		lens[argc++] = conf->pass_len;
		if (redisAppendCommandArgv(c->ctx, argc, argv, lens) !=
		    REDIS_OK)
			rc = KL_ENOMEM;
		n++;
	}
	if (conf->db != 0) {
		const char *argv[] = { "SELECT", db };
		size_t lens[2] = { 6, 0 };

		lens[1] = (size_t)snprintf(db, sizeof db, "%d", conf->db);
		if (redisAppendCommandArgv(c->ctx, 2, argv, lens) != REDIS_OK)
			rc = KL_ENOMEM;
		n++;
	}
	info = n;
	if (redisAppendCommand(c->ctx, "INFO") != REDIS_OK)
		rc = KL_ENOMEM;
	n++;
	for (i = 0; i < KL_RS_COUNT; i++) {
		const char *argv[] = { "SCRIPT", "LOAD", kl__redis_scripts[i] };
		size_t lens[] = { 6, 4, strlen(kl__redis_scripts[i]) };

		if (redisAppendCommandArgv(c->ctx, 3, argv, lens) != REDIS_OK)
			rc = KL_ENOMEM;
		n++;
	}
	if (rc == KL_OK)
		rc = kl__rconn_roundtrip(c, deadline, n, rep, err);
	/* A TLS port closes (or resets) on the first bytes of a plain
	 * client. */
	if (rc == KL_EPROVIDER && !conf->tls && err != NULL &&
	    (c->ctx->err == REDIS_ERR_EOF || c->ctx->err == REDIS_ERR_IO)) {
		size_t len = strlen(err->message);

		snprintf(err->message + len, sizeof err->message - len,
			 "; if the server wants TLS, use rediss://");
	}
	if (rc != KL_OK) {
		kl__rconn_close(c);
		return rc;
	}
	/* The first refusal tells: NOAUTH means no or a wrong password. */
	for (i = 0; rc == KL_OK && i <= info; i++) {
		redisReply *r = rep[i];

		if (r->type != REDIS_REPLY_ERROR)
			continue;
		if ((conf->pass != NULL && i == 0) ||
		    strncmp(r->str, "NOAUTH", 6) == 0 ||
		    strncmp(r->str, "WRONGPASS", 9) == 0)
			rc = auth_failed(c, conf, r, err);
		else if (i < info) {
			kl__error_set(err, KL_EPROVIDER,
					"redis provider: SELECT %d failed: "
					"%.120s",
					conf->db, r->str);
			rc = KL_EPROVIDER;
		}
	}
	if (rc == KL_OK)
		rc = identify(c, rep[info], err);
	if (rc == KL_OK)
		rc = check_eviction(c, conf, rep[info]->str, err);
	for (i = info + 1; rc == KL_OK && i < n; i++) {
		redisReply *r = rep[i];

		if (r->type != REDIS_REPLY_STRING || r->len != 40) {
			kl__error_set(err, KL_EPROVIDER,
					"redis provider: SCRIPT LOAD failed: "
					"%.160s",
					r->type == REDIS_REPLY_ERROR ? r->str
								     : "?");
			rc = KL_EPROVIDER;
			break;
		}
		memcpy(c->sha[i - info - 1], r->str, 41);
	}
	for (i = 0; i < n; i++)
		freeReplyObject(rep[i]);
	if (rc == KL_OK && c->persistent)
		rc = check_fsync(c, deadline, err);
	if (rc != KL_OK) {
		kl__rconn_close(c);
		return rc;
	}
	*out = c;
	return KL_OK;
}
