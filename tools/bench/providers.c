/* SPDX-License-Identifier: MIT */
/*
 * keylock-bench provider: the distributed providers (Redis, PostgreSQL)
 * against the raw client calls a program would make by hand, measured in
 * the same run (issue 5):
 *
 *  1. Acquire+release round trips per second through kl_lock_acquire and
 *     kl_lease_release, on one key and on distinct keys, beside the raw
 *     pair on its own connection: SET key token NX PX ttl then EVAL of a
 *     compare-and-delete script (Redis), pg_try_advisory_lock then
 *     pg_advisory_unlock (PostgreSQL).  Target: at least 0.8 times the
 *     raw rate for Redis, 0.9 for PostgreSQL (whose figures depend on
 *     the server's durability settings, printed with them).  Each
 *     figure is the median over --runs repetitions (every other one in
 *     reverse order); the ratio is the median of the
 *     per-repetition ratios, so a slow phase of the machine hits both
 *     sides alike.
 *
 *  2. The wait from a release to the next waiter's grant across processes.
 *     A waiter process (this program again, exec'd with --child) blocks on
 *     a key the bench holds; the bench records CLOCK_MONOTONIC just before
 *     it releases, the waiter when it is granted (the clock is the same for
 *     every process of the host) and sends it back on a pipe.  Beside it, a
 *     waiter that polls with the raw try call every 10 ms.  The release
 *     comes at a random point of the poll period.  Target: p50 under 2 ms
 *     with notification.  A grant seen before the release is a broken
 *     mutual exclusion and fails the run whatever the options.
 *
 * The raw clients are compiled in only where configure found hiredis or
 * libpq (KL_BENCH_HIREDIS, KL_BENCH_LIBPQ); without one, that scheme says
 * so and exits 77.  Their functions are looked up at run time in the
 * provider library (see raw_load), so the program never links them.  The
 * keylock side goes through kl_provider_open, which loads the provider
 * library with dlopen.  Single-threaded apart from the
 * providers' own threads.
 */
#include "bench.h"

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <inttypes.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifdef KL_BENCH_HIREDIS
#include <hiredis/hiredis.h>
#endif
#ifdef KL_BENCH_LIBPQ
#include <libpq-fe.h>
#endif

#include "keylock.h"

#define PROV_PROG PROG " provider"
#define EXIT_SKIP 77 /* no raw client for the scheme in this build */

#define TTL_MS 10000
#define POLL_MS 10
#define TARGET_RATIO_REDIS 0.8
#define TARGET_RATIO_PG 0.9
#define TARGET_P50_MS 2.0
#define LINE_LIMIT_MS 15000 /* the longest wait for a line of the child */

extern char **environ;

enum scheme { S_REDIS, S_PG };

static struct {
	const char *uri;
	bool json, quick, strict;
	int ops, runs, rounds;
	const char *child; /* "kl" or "poll": the waiter process */
} popt;

static enum scheme scheme;
static const char *scheme_name;
static double target_ratio = TARGET_RATIO_REDIS;
/* PostgreSQL: the version and the settings a fence's cost depends on. */
static char server_desc[200];

/* ------------------------------------------------------------------ */
/* Small things                                                        */

/* die() with an exit status: EXIT_BROKEN or EXIT_SKIP. */
static void __attribute__((noreturn, format(printf, 2, 3)))
fail(int status, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vsay(stderr, "provider: ", fmt, ap);
	va_end(ap);
	exit(status);
}

/* The q-quantile (0..1) of n values, sorted in place (nearest rank). */
static double
quantile(double *v, int n, double q)
{
	int i;

	if (n <= 0)
		return 0;
	qsort(v, (size_t)n, sizeof *v, cmp_double);
	i = (int)(q * n + 0.999999) - 1;
	if (i < 0)
		i = 0;
	if (i >= n)
		i = n - 1;
	return v[i];
}

static uint64_t
fnv1a(const char *s)
{
	uint64_t h = 0xcbf29ce484222325ULL;

	for (; *s != '\0'; s++)
		h = (h ^ (unsigned char)*s) * 0x100000001b3ULL;
	return h;
}

/* ------------------------------------------------------------------ */
/* The raw clients: try once, unlock                                    */

/*
 * keylock-bench links neither hiredis nor libpq (a package of it must not
 * depend on them): their functions are taken from the provider library,
 * whose dependencies they are (dlsym on its handle searches them too),
 * loaded as kl_provider_open loads it.  Only their headers are needed to
 * build.
 */
static struct {
#ifdef KL_BENCH_HIREDIS
	__typeof__(redisConnectWithTimeout) *redisConnectWithTimeout;
	__typeof__(redisCommand) *redisCommand;
	__typeof__(freeReplyObject) *freeReplyObject;
	__typeof__(redisFree) *redisFree;
#endif
#ifdef KL_BENCH_LIBPQ
	__typeof__(PQconnectdb) *PQconnectdb;
	__typeof__(PQstatus) *PQstatus;
	__typeof__(PQerrorMessage) *PQerrorMessage;
	__typeof__(PQexec) *PQexec;
	__typeof__(PQresultStatus) *PQresultStatus;
	__typeof__(PQresultErrorMessage) *PQresultErrorMessage;
	__typeof__(PQntuples) *PQntuples;
	__typeof__(PQgetvalue) *PQgetvalue;
	__typeof__(PQclear) *PQclear;
	__typeof__(PQfinish) *PQfinish;
#endif
	bool loaded;
} raw_fn;

#if defined(KL_BENCH_HIREDIS) || defined(KL_BENCH_LIBPQ)
static void *
load_symbol(void *h, const char *lib, const char *name)
{
	void *f = dlsym(h, name);

	if (f == NULL)
		fail(EXIT_BROKEN, "%s and its dependencies have no %s", lib,
		    name);
	return f;
}

#define LOAD(name) (*(void **)&raw_fn.name = load_symbol(h, lib, #name))
#endif

static void
raw_load(void)
{
	const char *lib = scheme == S_REDIS ? "libkeylock-redis.so.0"
					    : "libkeylock-pg.so.0";
	const char *dir = getenv("KEYLOCK_PROVIDER_DIR");
	char path[4096];
	void *h = NULL;

	if (raw_fn.loaded)
		return;
	if (dir != NULL && dir[0] != '\0' &&
	    (size_t)snprintf(path, sizeof path, "%s/%s", dir, lib) <
		    sizeof path)
		h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	if (h == NULL)
		h = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
	if (h == NULL)
		fail(EXIT_BROKEN, "the raw %s client needs %s: %s", scheme_name,
		    lib, dlerror());
#ifdef KL_BENCH_HIREDIS
	if (scheme == S_REDIS) {
		LOAD(redisConnectWithTimeout);
		LOAD(redisCommand);
		LOAD(freeReplyObject);
		LOAD(redisFree);
	}
#endif
#ifdef KL_BENCH_LIBPQ
	if (scheme == S_PG) {
		LOAD(PQconnectdb);
		LOAD(PQstatus);
		LOAD(PQerrorMessage);
		LOAD(PQexec);
		LOAD(PQresultStatus);
		LOAD(PQresultErrorMessage);
		LOAD(PQntuples);
		LOAD(PQgetvalue);
		LOAD(PQclear);
		LOAD(PQfinish);
	}
#endif
	raw_fn.loaded = true; /* the library stays loaded */
}

/* Each call dies on a failure of the server or the connection. */
struct raw {
#ifdef KL_BENCH_HIREDIS
	redisContext *redis;
#endif
#ifdef KL_BENCH_LIBPQ
	PGconn *pg;
#endif
	char err[256];
};

#ifdef KL_BENCH_HIREDIS
static const char cad_script[] =
	"if redis.call('get', KEYS[1]) == ARGV[1] then "
	"return redis.call('del', KEYS[1]) else return 0 end";
#endif

/* redis://[user:pass@]host[:port][/db][?...]: what hiredis needs. */
static void
redis_open(struct raw *r, const char *uri)
{
#ifdef KL_BENCH_HIREDIS
	char host[256] = "127.0.0.1", user[128] = "", pass[256] = "";
	const char *s = uri + strlen("redis://"), *at, *end, *colon;
	int port = 6379, db = 0;
	struct timeval tv = { .tv_sec = 5 };
	redisReply *rep;
	size_t n;

	end = s + strcspn(s, "/?");
	at = memchr(s, '@', (size_t)(end - s));
	if (at != NULL) {
		colon = memchr(s, ':', (size_t)(at - s));
		if (colon != NULL) {
			snprintf(user, sizeof user, "%.*s", (int)(colon - s),
				 s);
			snprintf(pass, sizeof pass, "%.*s",
				 (int)(at - colon - 1), colon + 1);
		} else {
			snprintf(pass, sizeof pass, "%.*s", (int)(at - s), s);
		}
		s = at + 1;
	}
	colon = memchr(s, ':', (size_t)(end - s));
	n = (size_t)((colon != NULL ? colon : end) - s);
	if (n > 0 && n < sizeof host)
		snprintf(host, sizeof host, "%.*s", (int)n, s);
	if (colon != NULL)
		port = (int)strtol(colon + 1, NULL, 10);
	if (*end == '/')
		db = (int)strtol(end + 1, NULL, 10);
	r->redis = raw_fn.redisConnectWithTimeout(host, port, tv);
	if (r->redis == NULL || r->redis->err)
		fail(EXIT_BROKEN,
		    "raw redis client: cannot connect to %s:%d: %s", host, port,
		    r->redis != NULL ? r->redis->errstr : "no memory");
	if (pass[0] != '\0') {
		if (user[0] != '\0')
			rep = raw_fn.redisCommand(r->redis, "AUTH %s %s", user,
						  pass);
		else
			rep = raw_fn.redisCommand(r->redis, "AUTH %s", pass);
		if (rep == NULL || rep->type == REDIS_REPLY_ERROR)
			fail(EXIT_BROKEN, "raw redis client: AUTH refused");
		raw_fn.freeReplyObject(rep);
	}
	rep = raw_fn.redisCommand(r->redis, "SELECT %d", db);
	if (rep == NULL || rep->type == REDIS_REPLY_ERROR)
		fail(EXIT_BROKEN, "raw redis client: SELECT %d refused", db);
	raw_fn.freeReplyObject(rep);
#else
	(void)r;
	fail(EXIT_SKIP, "no hiredis in this build (%s)", uri);
#endif
}

/* The URI without keylock's own parameters, which libpq would refuse. */
static void
pg_open(struct raw *r, const char *uri)
{
#ifdef KL_BENCH_LIBPQ
	static const char *const ours[] = { "pool=", "health_interval=",
					    "fence_sequence=" };
	char *u = strdup(uri), *q, *p, *next;
	size_t len;

	if (u == NULL)
		fail(EXIT_BROKEN, "out of memory");
	q = strchr(u, '?');
	for (p = q != NULL ? q + 1 : NULL; p != NULL && *p != '\0'; p = next) {
		bool drop = false;

		len = strcspn(p, "&");
		next = p[len] == '&' ? p + len + 1 : p + len;
		for (size_t i = 0; i < sizeof ours / sizeof ours[0]; i++)
			drop |= strncmp(p, ours[i], strlen(ours[i])) == 0;
		if (drop) {
			memmove(p, next, strlen(next) + 1);
			next = p;
		}
	}
	len = strlen(u);
	while (len > 0 && (u[len - 1] == '&' || u[len - 1] == '?'))
		u[--len] = '\0';
	r->pg = raw_fn.PQconnectdb(u);
	free(u);
	if (raw_fn.PQstatus(r->pg) != CONNECTION_OK) {
		snprintf(r->err, sizeof r->err, "%s",
			 raw_fn.PQerrorMessage(r->pg));
		r->err[strcspn(r->err, "\n")] = '\0';
		fail(EXIT_BROKEN, "raw postgresql client: %s", r->err);
	}
#else
	(void)r;
	fail(EXIT_SKIP, "no libpq in this build (%s)", uri);
#endif
}

/* The boolean answer of the one-row query "SELECT fn(id of key)". */
static bool
pg_bool(struct raw *r, const char *fn, const char *key)
{
	int64_t id = (int64_t)(fnv1a(key) >> 1);
#ifdef KL_BENCH_LIBPQ
	PGresult *res;
	char sql[96];
	bool v;

	snprintf(sql, sizeof sql, "SELECT %s(%" PRId64 ")", fn, id);
	res = raw_fn.PQexec(r->pg, sql);
	if (raw_fn.PQresultStatus(res) != PGRES_TUPLES_OK ||
	    raw_fn.PQntuples(res) != 1) {
		snprintf(r->err, sizeof r->err, "%s",
			 raw_fn.PQresultErrorMessage(res));
		r->err[strcspn(r->err, "\n")] = '\0';
		fail(EXIT_BROKEN, "raw %s failed: %s", fn, r->err);
	}
	v = raw_fn.PQgetvalue(res, 0, 0)[0] == 't';
	raw_fn.PQclear(res);
	return v;
#else
	(void)r;
	fail(EXIT_SKIP, "no libpq in this build (%s %" PRId64 " for %s)", fn,
	    id, key);
#endif
}

/* SET key token NX PX ttl: whether it was set. */
static bool
redis_set_nx(struct raw *r, const char *key, const char *token)
{
#ifdef KL_BENCH_HIREDIS
	redisReply *rep = raw_fn.redisCommand(r->redis, "SET %s %s NX PX %d",
					      key, token, TTL_MS);
	bool got;

	if (rep == NULL || rep->type == REDIS_REPLY_ERROR)
		fail(EXIT_BROKEN, "raw SET NX failed: %s",
		    rep != NULL ? rep->str : r->redis->errstr);
	got = rep->type == REDIS_REPLY_STATUS;
	raw_fn.freeReplyObject(rep);
	return got;
#else
	(void)r;
	fail(EXIT_SKIP, "no hiredis in this build (%s %s)", key, token);
#endif
}

/* EVAL compare-and-delete: whether token held key. */
static bool
redis_cad(struct raw *r, const char *key, const char *token)
{
#ifdef KL_BENCH_HIREDIS
	redisReply *rep = raw_fn.redisCommand(r->redis, "EVAL %s 1 %s %s",
					      cad_script, key, token);
	bool ok;

	if (rep == NULL || rep->type == REDIS_REPLY_ERROR)
		fail(EXIT_BROKEN, "raw EVAL failed: %s",
		    rep != NULL ? rep->str : r->redis->errstr);
	ok = rep->type == REDIS_REPLY_INTEGER && rep->integer == 1;
	raw_fn.freeReplyObject(rep);
	return ok;
#else
	(void)r;
	fail(EXIT_SKIP, "no hiredis in this build (%s %s)", key, token);
#endif
}

static void
raw_open(struct raw *r, const char *uri)
{
	memset(r, 0, sizeof *r);
	raw_load();
	if (scheme == S_REDIS)
		redis_open(r, uri);
	else
		pg_open(r, uri);
}

static void
raw_close(struct raw *r)
{
#ifdef KL_BENCH_HIREDIS
	if (r->redis != NULL)
		raw_fn.redisFree(r->redis);
#endif
#ifdef KL_BENCH_LIBPQ
	if (r->pg != NULL)
		raw_fn.PQfinish(r->pg);
#endif
	memset(r, 0, sizeof *r);
}

/* Tries once to take key with token: whether it was taken. */
static bool
raw_try(struct raw *r, const char *key, const char *token)
{
	if (scheme == S_REDIS)
		return redis_set_nx(r, key, token);
	return pg_bool(r, "pg_try_advisory_lock", key);
}

/* Releases key, which token must hold. */
static void
raw_unlock(struct raw *r, const char *key, const char *token)
{
	bool ok;

	if (scheme == S_REDIS)
		ok = redis_cad(r, key, token);
	else
		ok = pg_bool(r, "pg_advisory_unlock", key);
	if (!ok)
		fail(EXIT_BROKEN, "raw unlock: '%s' was not held", key);
}

/* ------------------------------------------------------------------ */
/* The keylock side                                                    */

static kl_provider *
kl_open(void)
{
	kl_provider *p = NULL;
	kl_error err;
	int rc;

	memset(&err, 0, sizeof err);
	rc = kl_provider_open(&p, popt.uri, &err);
	if (rc != KL_OK)
		fail(EXIT_BROKEN, "kl_provider_open: %s: %s", kl_strerror(rc),
		    err.message);
	return p;
}

static kl_lock *
kl_lock_for(kl_provider *p, int64_t timeout_ms)
{
	kl_lock_opts o = KL_LOCK_OPTS_INIT;
	kl_lock *l = NULL;

	o.provider = p;
	o.timeout_ms = timeout_ms;
	o.ttl_ms = TTL_MS;
	if (kl_lock_new(&l, &o) != KL_OK)
		fail(EXIT_BROKEN, "kl_lock_new failed");
	return l;
}

static kl_lease *
kl_take(kl_lock *l, const char *key)
{
	kl_call call = { .key = key, .cancel = NULL };
	kl_lease *lease = NULL;
	kl_error err;
	int rc;

	memset(&err, 0, sizeof err);
	rc = kl_lock_acquire(l, &call, &lease, &err);
	if (rc != KL_OK)
		fail(EXIT_BROKEN, "kl_lock_acquire '%s': %s: %s", key,
		    kl_strerror(rc), err.message);
	return lease;
}

/* ------------------------------------------------------------------ */
/* 1. Round trips per second                                            */

enum { T_KL_ONE, T_KL_MANY, T_RAW_ONE, T_RAW_MANY, T_N };
static const char *const t_names[T_N] = {
	"keylock, one key", "keylock, distinct keys", "raw, one key",
	"raw, distinct keys"
};
static double rate[T_N];    /* ops/s, median over the runs */
static double ratio_one, ratio_many;
static long serial;         /* makes distinct keys distinct */

static double
measure(int what, kl_lock *l, struct raw *r)
{
	char key[96], token[48];
	int64_t t0 = now_ns(), t;

	snprintf(token, sizeof token, "tok-%d", (int)getpid());
	for (int i = 0; i < popt.ops; i++) {
		if (what == T_KL_ONE || what == T_RAW_ONE)
			snprintf(key, sizeof key, "kl-bench/one/%d/%d",
				 (int)getpid(), what);
		else
			snprintf(key, sizeof key, "kl-bench/many/%d/%ld",
				 (int)getpid(), serial++);
		if (what == T_KL_ONE || what == T_KL_MANY) {
			kl_lease_release(kl_take(l, key));
		} else {
			if (!raw_try(r, key, token))
				fail(EXIT_BROKEN, "raw try: '%s' is held", key);
			raw_unlock(r, key, token);
		}
	}
	t = now_ns() - t0;
	return t > 0 ? popt.ops * 1e9 / (double)t : 0;
}

/* Where figure t of repetition run goes in run_throughput's array. */
static size_t
at(int t, int run)
{
	return (size_t)t * (size_t)popt.runs + (size_t)run;
}

/* Fills server_desc (PostgreSQL only). */
static void
describe_server(struct raw *r)
{
#ifdef KL_BENCH_LIBPQ
	PGresult *res;

	if (r->pg == NULL)
		return;
	res = raw_fn.PQexec(r->pg,
			    "SELECT 'PostgreSQL ' || current_setting("
			    "'server_version') || ', fsync ' || "
			    "current_setting('fsync') || ', synchronous_commit "
			    "' || current_setting('synchronous_commit') || "
			    "', wal_sync_method ' || "
			    "current_setting('wal_sync_method')");
	if (raw_fn.PQresultStatus(res) == PGRES_TUPLES_OK &&
	    raw_fn.PQntuples(res) == 1)
		snprintf(server_desc, sizeof server_desc, "%s",
			 raw_fn.PQgetvalue(res, 0, 0));
	raw_fn.PQclear(res);
	/* Kept out of the JSON string's way. */
	for (char *c = server_desc; *c != '\0'; c++)
		if (*c == '"' || *c == '\\' || (unsigned char)*c < 0x20)
			*c = ' ';
#else
	(void)r;
#endif
}

static void
run_throughput(kl_provider *p)
{
	double *v = calloc((size_t)popt.runs * (T_N + 2), sizeof *v);
	kl_lock *l = kl_lock_for(p, TTL_MS);
	struct raw r;

	if (v == NULL)
		fail(EXIT_BROKEN, "out of memory");
	raw_open(&r, popt.uri);
	describe_server(&r);
	/* Connections made and scripts cached before the first figure. */
	measure(T_KL_ONE, l, &r);
	measure(T_RAW_ONE, l, &r);
	for (int run = 0; run < popt.runs; run++) {
		double x[T_N];

		/* Every other repetition in reverse order: neither side
		 * always comes first. */
		for (int i = 0; i < T_N; i++) {
			int t = run % 2 == 0 ? i : T_N - 1 - i;

			x[t] = measure(t, l, &r);
			v[at(t, run)] = x[t];
		}
		v[at(T_N, run)] = x[T_KL_ONE] / x[T_RAW_ONE];
		v[at(T_N + 1, run)] = x[T_KL_MANY] / x[T_RAW_MANY];
		if (isatty(STDERR_FILENO))
			fprintf(stderr, "\r%s: run %d/%d", PROV_PROG, run + 1,
				popt.runs);
	}
	if (isatty(STDERR_FILENO))
		fputc('\n', stderr);
	for (int t = 0; t < T_N; t++)
		rate[t] = quantile(v + at(t, 0), popt.runs, 0.5);
	ratio_one = quantile(v + at(T_N, 0), popt.runs, 0.5);
	ratio_many = quantile(v + at(T_N + 1, 0), popt.runs, 0.5);
	raw_close(&r);
	kl_lock_free(l);
	free(v);
}

/* ------------------------------------------------------------------ */
/* 2. Release to grant across processes                                 */

struct child {
	pid_t pid;
	int to, from;
};

static void
child_start(struct child *c, const char *mode)
{
	posix_spawn_file_actions_t fa;
	char *argv[] = { (char *)"keylock-bench", (char *)"provider",
			 (char *)"--child", (char *)mode, (char *)"--uri",
			 (char *)popt.uri, NULL };
	int in[2], out[2], rc;

	if (pipe2(in, O_CLOEXEC) != 0 || pipe2(out, O_CLOEXEC) != 0)
		fail(EXIT_BROKEN, "pipe: %s", strerror(errno));
	posix_spawn_file_actions_init(&fa);
	posix_spawn_file_actions_adddup2(&fa, in[0], 0);
	posix_spawn_file_actions_adddup2(&fa, out[1], 1);
	rc = posix_spawn(&c->pid, "/proc/self/exe", &fa, NULL, argv, environ);
	posix_spawn_file_actions_destroy(&fa);
	close(in[0]);
	close(out[1]);
	if (rc != 0)
		fail(EXIT_BROKEN, "cannot start the waiter process: %s",
		    strerror(rc));
	c->to = in[1];
	c->from = out[0];
}

/* One line of the child into buf; dies on end of file or timeout. */
static void
child_line(struct child *c, char *buf, size_t size)
{
	int64_t limit = now_ns() + (int64_t)LINE_LIMIT_MS * 1000000;
	struct pollfd pfd = { .fd = c->from, .events = POLLIN };
	size_t n = 0;
	ssize_t got;
	char ch;

	for (;;) {
		int64_t left = (limit - now_ns()) / 1000000;

		if (left <= 0)
			fail(EXIT_BROKEN, "the waiter process did not answer "
					 "within %d ms", LINE_LIMIT_MS);
		if (poll(&pfd, 1, (int)left) <= 0)
			continue;
		got = read(c->from, &ch, 1);
		if (got < 0 && errno == EINTR)
			continue;
		if (got <= 0)
			fail(EXIT_BROKEN, "the waiter process ended");
		if (ch == '\n')
			break;
		if (n + 1 < size)
			buf[n++] = ch;
	}
	buf[n] = '\0';
	if (buf[0] == 'E')
		fail(EXIT_BROKEN, "waiter process: %s", buf + 1);
}

static void
child_say(struct child *c, const char *line)
{
	size_t len = strlen(line);

	if (write(c->to, line, len) != (ssize_t)len)
		fail(EXIT_BROKEN, "write to the waiter: %s", strerror(errno));
}

static void
child_end(struct child *c)
{
	int status;

	close(c->to);
	close(c->from);
	if (waitpid(c->pid, &status, 0) != c->pid || !WIFEXITED(status) ||
	    WEXITSTATUS(status) != 0)
		fail(EXIT_BROKEN, "the waiter process failed (status 0x%x)",
		    (unsigned)status);
}

static double lat_p50[2], lat_p99[2]; /* [0] keylock, [1] polling */
static long violations;

/* Until the provider shows a waiter for key. */
static void
wait_queued(kl_provider *p, const char *key)
{
	int64_t limit = now_ns() + (int64_t)LINE_LIMIT_MS * 1000000;
	size_t h, w;
	kl_error err;

	for (;;) {
		if (kl_provider_status(p, key, &h, &w, &err) != KL_OK) {
			/* Cannot tell: give the waiter time to queue. */
			sleep_ns(50000000);
			return;
		}
		if (w > 0)
			return;
		if (now_ns() > limit)
			fail(EXIT_BROKEN, "the waiter never queued on '%s'",
			    key);
		sleep_ns(200000);
	}
}

static void
run_latency(kl_provider *p, int which)
{
	double *v = calloc((size_t)popt.rounds, sizeof *v);
	kl_lock *l = kl_lock_for(p, TTL_MS);
	unsigned seed = (unsigned)getpid() * 2654435761u;
	char key[96], line[128], token[48];
	struct child c;
	struct raw r;

	if (v == NULL)
		fail(EXIT_BROKEN, "out of memory");
	snprintf(token, sizeof token, "holder-%d", (int)getpid());
	if (which == 1)
		raw_open(&r, popt.uri);
	child_start(&c, which == 0 ? "kl" : "poll");
	child_line(&c, line, sizeof line); /* ready */
	for (int i = 0; i < popt.rounds; i++) {
		kl_lease *lease = NULL;
		int64_t t0, granted;
		char *end;

		snprintf(key, sizeof key, "kl-bench/lat/%d/%d/%d",
			 (int)getpid(), which, i);
		if (which == 0)
			lease = kl_take(l, key);
		else if (!raw_try(&r, key, token))
			fail(EXIT_BROKEN, "raw try: '%s' is held", key);
		snprintf(line, sizeof line, "W %s\n", key);
		child_say(&c, line);
		if (which == 0)
			wait_queued(p, key);
		else
			child_line(&c, line, sizeof line); /* tried once */
		/* At a random point of the poll period. */
		seed = seed * 1103515245u + 12345u;
		sleep_ns((int64_t)(seed >> 8) % ((int64_t)POLL_MS * 1000000));
		t0 = now_ns();
		if (which == 0)
			kl_lease_release(lease);
		else
			raw_unlock(&r, key, token);
		child_line(&c, line, sizeof line);
		errno = 0;
		granted = strtoll(line + 1, &end, 10);
		if (line[0] != 'G' || errno != 0 || end == line + 1)
			fail(EXIT_BROKEN, "waiter process said '%s'", line);
		if (granted < t0)
			violations++;
		v[i] = (double)(granted - t0) / 1e6;
	}
	child_end(&c);
	if (which == 1)
		raw_close(&r);
	lat_p50[which] = quantile(v, popt.rounds, 0.5);
	lat_p99[which] = quantile(v, popt.rounds, 0.99);
	kl_lock_free(l);
	free(v);
}

/* The waiter process: "W key" on stdin, blocks for key, prints "G ns"
 * (CLOCK_MONOTONIC at the grant), releases; "kl" waits in
 * kl_lock_acquire, "poll" tries every POLL_MS and prints "T" after its
 * first refusal. */
static int
child_main(void)
{
	bool poll_mode = strcmp(popt.child, "poll") == 0;
	char line[256], token[48];
	kl_provider *p = NULL;
	kl_lock *l = NULL;
	struct raw r;

	setvbuf(stdout, NULL, _IOLBF, 0);
	snprintf(token, sizeof token, "waiter-%d", (int)getpid());
	if (poll_mode) {
		raw_open(&r, popt.uri);
	} else {
		p = kl_open();
		l = kl_lock_for(p, LINE_LIMIT_MS);
	}
	printf("R\n");
	while (fgets(line, sizeof line, stdin) != NULL) {
		char *key = line + 2;
		int64_t granted;
		bool said = false;

		key[strcspn(key, "\n")] = '\0';
		if (line[0] != 'W')
			continue;
		if (!poll_mode) {
			kl_lease *lease = kl_take(l, key);

			granted = now_ns();
			printf("G %" PRId64 "\n", granted);
			kl_lease_release(lease);
			continue;
		}
		for (;;) {
			if (raw_try(&r, key, token))
				break;
			if (!said) {
				printf("T\n");
				said = true;
			}
			sleep_ns((int64_t)POLL_MS * 1000000);
		}
		granted = now_ns();
		printf("G %" PRId64 "\n", granted);
		raw_unlock(&r, key, token);
	}
	if (poll_mode) {
		raw_close(&r);
	} else {
		kl_lock_free(l);
		kl_provider_free(p);
	}
	return 0;
}

/* ------------------------------------------------------------------ */
/* Output                                                              */

static const char *
verdict(bool pass)
{
	return popt.quick ? "not judged (--quick)" : pass ? "PASS" : "MISS";
}

static void
print_provider_text(void)
{
	printf("%s: %s (%s)\n", PROV_PROG, popt.uri, scheme_name);
	if (server_desc[0] != '\0')
		printf("server: %s\n", server_desc);
	printf("\n");
	printf("Acquire+release round trips per second (median of %d runs "
	       "of %d):\n",
	       popt.runs, popt.ops);
	for (int t = 0; t < T_N; t++)
		printf("  %-26s %10.0f\n", t_names[t], rate[t]);
	printf("  raw is %s\n", scheme == S_REDIS
					? "SET key token NX PX ttl + EVAL "
					  "compare-and-delete"
					: "pg_try_advisory_lock + "
					  "pg_advisory_unlock");
	printf("  ratio, one key           %6.2fx  target >= %.1fx  %s\n",
	       ratio_one, target_ratio, verdict(ratio_one >= target_ratio));
	printf("  ratio, distinct keys     %6.2fx  target >= %.1fx  %s\n\n",
	       ratio_many, target_ratio, verdict(ratio_many >= target_ratio));
	printf("Release to grant in another process (%d rounds), ms:\n",
	       popt.rounds);
	printf("  %-26s p50 %7.3f  p99 %7.3f\n", "keylock (notification)",
	       lat_p50[0], lat_p99[0]);
	printf("  %-26s p50 %7.3f  p99 %7.3f\n", "polling every 10 ms",
	       lat_p50[1], lat_p99[1]);
	printf("  target p50 < %.1f ms  %s\n", TARGET_P50_MS,
	       verdict(lat_p50[0] < TARGET_P50_MS));
	printf("Mutual exclusion violations: %ld\n", violations);
}

static void
print_provider_json(void)
{
	printf("{\"scheme\":\"%s\",\"server\":\"%s\",\"quick\":%s,"
	       "\"runs\":%d,\"ops\":%d,\"rounds\":%d,",
	       scheme_name, server_desc, popt.quick ? "true" : "false", popt.runs,
	       popt.ops, popt.rounds);
	printf("\"ops_per_s\":{\"keylock_one_key\":%.0f,"
	       "\"keylock_distinct_keys\":%.0f,\"raw_one_key\":%.0f,"
	       "\"raw_distinct_keys\":%.0f},",
	       rate[T_KL_ONE], rate[T_KL_MANY], rate[T_RAW_ONE],
	       rate[T_RAW_MANY]);
	printf("\"ratio_one_key\":%.3f,\"ratio_distinct_keys\":%.3f,"
	       "\"ratio_target\":%.1f,",
	       ratio_one, ratio_many, target_ratio);
	printf("\"handoff_ms\":{\"keylock_p50\":%.3f,\"keylock_p99\":%.3f,"
	       "\"polling_p50\":%.3f,\"polling_p99\":%.3f},"
	       "\"handoff_target_p50_ms\":%.1f,",
	       lat_p50[0], lat_p99[0], lat_p50[1], lat_p99[1], TARGET_P50_MS);
	printf("\"verdicts\":{\"ratio_one_key\":\"%s\","
	       "\"ratio_distinct_keys\":\"%s\",\"handoff_p50\":\"%s\"},"
	       "\"violations\":%ld}\n",
	       verdict(ratio_one >= target_ratio),
	       verdict(ratio_many >= target_ratio),
	       verdict(lat_p50[0] < TARGET_P50_MS), violations);
}

/* ------------------------------------------------------------------ */
/* Options                                                             */

static void
usage(void)
{
	printf("Usage: keylock-bench provider --uri URI [options]\n\n"
	       "Measure a Redis or PostgreSQL provider against the raw "
	       "client calls in one\nrun: acquire+release round trips per "
	       "second (target: at least %.1fx the raw\nrate; %.1fx for "
	       "PostgreSQL) and release to grant across processes\n(target: "
	       "p50 under %.0f ms, "
	       "beside a %d ms polling loop).\n\n"
	       "Options:\n"
	       "  -u, --uri URI        redis://host:port/db or "
	       "postgresql://... (required)\n"
	       "  -q, --quick          a seconds-long smoke pass; never "
	       "judges speed\n"
	       "  -j, --json           print JSON instead of the table\n"
	       "  -r, --runs N         repetitions of the round trip figures "
	       "(default 5)\n"
	       "  -n, --ops N          round trips per repetition (default "
	       "2000)\n"
	       "  -R, --rounds N       release to grant rounds (default "
	       "100)\n"
	       "  -s, --strict         exit 1 when a target is missed\n"
	       "  -h, --help           show this help and exit\n\n"
	       "Exit status: 0 done, 1 a target missed with --strict, 2 a "
	       "call failed or\nmutual exclusion broke, 64 usage error, 77 "
	       "this build has no client for\nthe URI's scheme (configure "
	       "found no hiredis or libpq).\n",
	       TARGET_RATIO_REDIS, TARGET_RATIO_PG, TARGET_P50_MS, POLL_MS);
}

static int
parse_count(const char *s, const char *name)
{
	char *end;
	long v;

	errno = 0;
	v = strtol(s, &end, 10);
	if (errno != 0 || end == s || *end != '\0' || v < 1 || v > 10000000) {
		fprintf(stderr,
			"%s: invalid %s '%s' (1 to 10000000)\nTry "
			"'keylock-bench provider --help' for more "
			"information.\n",
			PROV_PROG, name, s);
		exit(EXIT_USAGE);
	}
	return (int)v;
}

static void __attribute__((noreturn))
usage_error(const char *what)
{
	fprintf(stderr,
		"%s: %s\nTry 'keylock-bench provider --help' for more "
		"information.\n",
		PROV_PROG, what);
	exit(EXIT_USAGE);
}

int
kl_bench_provider_main(int argc, char **argv)
{
	static const struct option longopts[] = {
		{ "uri", required_argument, NULL, 'u' },
		{ "quick", no_argument, NULL, 'q' },
		{ "json", no_argument, NULL, 'j' },
		{ "runs", required_argument, NULL, 'r' },
		{ "ops", required_argument, NULL, 'n' },
		{ "rounds", required_argument, NULL, 'R' },
		{ "strict", no_argument, NULL, 's' },
		{ "child", required_argument, NULL, 'C' },
		{ "help", no_argument, NULL, 'h' },
		{ NULL, 0, NULL, 0 },
	};
	int c, runs = 0, ops = 0, rounds = 0;
	kl_provider *p;
	bool missed;

	optind = 1;
	while ((c = getopt_long(argc, argv, "+u:qjr:n:R:sh", longopts,
				NULL)) != -1) {
		switch (c) {
		case 'u':
			popt.uri = optarg;
			break;
		case 'q':
			popt.quick = true;
			break;
		case 'j':
			popt.json = true;
			break;
		case 'r':
			runs = parse_count(optarg, "run count");
			break;
		case 'n':
			ops = parse_count(optarg, "op count");
			break;
		case 'R':
			rounds = parse_count(optarg, "round count");
			break;
		case 's':
			popt.strict = true;
			break;
		case 'C':
			popt.child = optarg;
			break;
		case 'h':
			usage();
			return EXIT_SUCCESS;
		default:
			fprintf(stderr, "Try 'keylock-bench provider --help' "
					"for more information.\n");
			return EXIT_USAGE;
		}
	}
	popt.runs = runs > 0 ? runs : popt.quick ? 1 : 5;
	popt.ops = ops > 0 ? ops : popt.quick ? 50 : 2000;
	popt.rounds = rounds > 0 ? rounds : popt.quick ? 5 : 100;
	if (optind < argc)
		usage_error("unexpected argument");
	if (popt.uri == NULL)
		usage_error("--uri is required");
	if (strncmp(popt.uri, "redis://", 8) == 0) {
		scheme = S_REDIS;
		scheme_name = "redis";
#ifndef KL_BENCH_HIREDIS
		fprintf(stderr, "%s: skipped: this keylock-bench was built "
				"without hiredis (configure --with-redis)\n",
			PROV_PROG);
		return EXIT_SKIP;
#endif
	} else if (strncmp(popt.uri, "postgresql://", 13) == 0 ||
		   strncmp(popt.uri, "postgres://", 11) == 0) {
		scheme = S_PG;
		scheme_name = "postgresql";
		target_ratio = TARGET_RATIO_PG;
#ifndef KL_BENCH_LIBPQ
		fprintf(stderr, "%s: skipped: this keylock-bench was built "
				"without libpq (configure --with-postgresql)\n",
			PROV_PROG);
		return EXIT_SKIP;
#endif
	} else {
		usage_error("the URI must start with redis:// or "
			    "postgresql://");
	}
	if (popt.child != NULL)
		return child_main();
	signal(SIGPIPE, SIG_IGN);
	p = kl_open();
	run_throughput(p);
	run_latency(p, 0);
	run_latency(p, 1);
	kl_provider_free(p);
	if (popt.json)
		print_provider_json();
	else
		print_provider_text();
	fflush(stdout);
	if (violations != 0) {
		fprintf(stderr, "%s: mutual exclusion broke: %ld grants "
				"before the release\n",
			PROV_PROG, violations);
		return EXIT_BROKEN;
	}
	missed = ratio_one < target_ratio || ratio_many < target_ratio ||
		 lat_p50[0] >= TARGET_P50_MS;
	if (popt.strict && missed && !popt.quick)
		return EXIT_MISS;
	return EXIT_SUCCESS;
}
