/* SPDX-License-Identifier: MIT */
/*
 * Tests of the Redis provider (libkeylock-redis, loaded by kl_provider_open
 * from KEYLOCK_PROVIDER_DIR) against a real server: KEYLOCK_TEST_REDIS_URI
 * names it (tools/test stage redis starts a throwaway one) and the suite
 * exits 77 (skip) when it is unset or the server does not answer.  Nothing
 * is faked.  KEYLOCK_TEST_REDIS_SERVER (the redis-server program),
 * KEYLOCK_TEST_REDIS_PORT and KEYLOCK_TEST_REDIS_DIR let the restart test
 * kill the server and start it again on the same port; without them that
 * test only says it did nothing.
 *
 * Covered: exports; the key digest; acquire and release; binary keys;
 * strict FIFO across threads (forced by the status op, never by sleeping);
 * mutual exclusion across 4 processes of 4 threads; timeouts and try-once
 * leaving nothing in Redis; cancellation; a holder killed with SIGKILL; a
 * dead waiter at the head of the queue; foreign and stale releases never
 * deleting another client's key; an external DEL reported as a lost lease
 * (KL_EV_LOST); renewal across several ttls; fences; passwords (wrong ones,
 * files, the environment, never shown in messages) and the ACL the manual
 * documents; unreachable servers; malformed URIs; a stalled server
 * (SIGSTOP); and a server restart while a lease is held and a waiter
 * waits.  Also: schemes in any case and options given twice; the message
 * of a timeout; servers that may evict keys refused; against a stalled
 * server, the bound on a wait past its timeout and the undoing of a grant
 * that the server makes to an acquire that gave up.
 *
 * Each test uses a key prefix of its own, so that it can list and check
 * every Redis key it made.  Worker threads never call ck_assert*: they
 * record, and the test's thread asserts after joining them.  Time bounds
 * are wide: they catch hangs and early returns, not speed.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif

#include <check.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <hiredis.h>

#include "keylock.h"
#include "redis/redis_internal.h" /* kl__redis_sha256_hex, as the provider */
#include "../util.h"

extern char **environ;

/* Slack added to every time bound: scheduling, connects, a loaded CI. */
#define SLACK_MS 1000

static const char *g_uri;  /* KEYLOCK_TEST_REDIS_URI */
static char g_host[256];
static int g_port;
static int g_db;
static char g_prefix[64]; /* this test's key prefix */
static pid_t g_stopped;    /* a server this test stopped (SIGSTOP) */
static pid_t g_server_pid; /* the server when the suite started */

/* ------------------------------------------------------------------ */
/* The server, reached directly                                        */

/* Host, port and database of g_uri (no password: the test server has
 * none).  False when it does not have that shape. */
static bool
parse_base(void)
{
	const char *s = g_uri + strlen("redis://");
	const char *colon, *end;
	size_t n;

	if (strncmp(g_uri, "redis://", 8) != 0 || strchr(s, '@') != NULL)
		return false;
	end = s + strcspn(s, "/?");
	colon = memchr(s, ':', (size_t)(end - s));
	n = (size_t)((colon != NULL ? colon : end) - s);
	if (n == 0 || n >= sizeof g_host)
		return false;
	memcpy(g_host, s, n);
	g_host[n] = '\0';
	g_port = colon != NULL ? atoi(colon + 1) : 6379;
	g_db = *end == '/' ? atoi(end + 1) : 0;
	return g_port > 0;
}

static redisContext *
raw_try(int timeout_ms)
{
	struct timeval tv = { timeout_ms / 1000, (timeout_ms % 1000) * 1000 };
	redisContext *c = redisConnectWithTimeout(g_host, g_port, tv);
	redisReply *r;

	if (c == NULL || c->err != 0) {
		if (c != NULL)
			redisFree(c);
		return NULL;
	}
	redisSetTimeout(c, (struct timeval){ 5, 0 });
	if (g_db != 0) {
		r = redisCommand(c, "SELECT %d", g_db);
		if (r == NULL || r->type == REDIS_REPLY_ERROR) {
			if (r != NULL)
				freeReplyObject(r);
			redisFree(c);
			return NULL;
		}
		freeReplyObject(r);
	}
	return c;
}

/* A direct connection; fails the test when there is none. */
static redisContext *
raw(void)
{
	redisContext *c = raw_try(2000);

	ck_assert_msg(c != NULL, "cannot connect to %s:%d", g_host, g_port);
	return c;
}

/* Runs one command given as argv strings; the reply must be no error. */
static redisReply *
rcmd(redisContext *c, int argc, const char **argv)
{
	redisReply *r = redisCommandArgv(c, argc, argv, NULL);

	ck_assert_msg(r != NULL, "%s: %s", argv[0], c->errstr);
	ck_assert_msg(r->type != REDIS_REPLY_ERROR, "%s: %s", argv[0],
		      r->str);
	return r;
}

static long long
rint_cmd(redisContext *c, int argc, const char **argv)
{
	redisReply *r = rcmd(c, argc, argv);
	long long v;

	ck_assert_int_eq(r->type, REDIS_REPLY_INTEGER);
	v = r->integer;
	freeReplyObject(r);
	return v;
}

/* A field of INFO server, as a number; false when it cannot be had.
 * Asserts nothing, so that main may use it. */
static bool
info_try(const char *field, long long *v)
{
	redisContext *c = raw_try(2000);
	redisReply *r;
	const char *p;
	bool ok = false;

	if (c == NULL)
		return false;
	r = redisCommand(c, "INFO server");
	if (r != NULL && r->type == REDIS_REPLY_STRING &&
	    (p = strstr(r->str, field)) != NULL) {
		*v = strtoll(p + strlen(field) + 1, NULL, 10);
		ok = true;
	}
	if (r != NULL)
		freeReplyObject(r);
	redisFree(c);
	return ok;
}

static long long
info_number(const char *field)
{
	long long v = 0;

	ck_assert_msg(info_try(field, &v), "no %s from INFO server", field);
	return v;
}

/* The Redis key names the provider uses for key (suffix "", ":q", ...). */
static void
key_name(char *buf, size_t size, const char *key, const char *suffix)
{
	char hex[65];

	kl__redis_sha256_hex(key, strlen(key), hex);
	snprintf(buf, size, "%s{%s}%s", g_prefix, hex, suffix);
}

/* How many Redis keys this test's prefix has, and whether each is one of
 * those allowed (by suffix after the "}").  The provider's two keys for
 * the whole prefix, the restart marker and the ttl record, do not
 * count. */
static int
count_keys(const char *allowed_csv)
{
	redisContext *c = raw();
	char pattern[96];
	const char *argv[2] = { "KEYS", pattern };
	redisReply *r;
	int n;

	snprintf(pattern, sizeof pattern, "%s*", g_prefix);
	r = rcmd(c, 2, argv);
	ck_assert_int_eq(r->type, REDIS_REPLY_ARRAY);
	n = (int)r->elements;
	for (size_t i = 0; i < r->elements; i++) {
		const char *k = r->element[i]->str;
		const char *close = strchr(k, '}');
		char want[64];

		if (strcmp(k + strlen(g_prefix), "guard") == 0 ||
		    strcmp(k + strlen(g_prefix), "maxttl") == 0) {
			n--;
			continue;
		}

		ck_assert_msg(close != NULL, "odd key %s", k);
		snprintf(want, sizeof want, ",%s,", close + 1);
		ck_assert_msg(strstr(allowed_csv, want) != NULL,
			      "key %s left behind (allowed: %s)", k,
			      allowed_csv);
	}
	freeReplyObject(r);
	redisFree(c);
	return n;
}

/* ------------------------------------------------------------------ */
/* URIs, providers, locks, events                                      */

/* g_uri with this test's prefix and opts ("a=b&c=d"). */
static void
uri_with(char *buf, size_t size, const char *opts)
{
	int n = snprintf(buf, size, "%s%cprefix=%s%s%s", g_uri,
			 strchr(g_uri, '?') != NULL ? '&' : '?', g_prefix,
			 opts[0] != '\0' ? "&" : "", opts);

	ck_assert(n > 0 && (size_t)n < size);
}

static kl_provider *
open_opts(const char *opts)
{
	char uri[1024];

	uri_with(uri, sizeof uri, opts);
	return test_provider_open(uri);
}

/* The usual provider: no restart guard (the test server is fresh). */
static kl_provider *
open_default(void)
{
	return open_opts("restart_guard=0");
}

struct hold {
	kl_lock *l;
	kl_lease *lease;
	struct test_events ev;
};

/* Acquires key on p into h; returns the status (h holds nothing unless
 * KL_OK).  ttl_ms 0: the provider's. */
static int
take_flags(kl_provider *p, const char *key, int64_t timeout_ms,
	   int64_t ttl_ms, kl_cancel *c, unsigned flags, struct hold *h,
	   kl_error *err)
{
	kl_lock_opts o = KL_LOCK_OPTS_INIT;
	kl_call call = { .key = NULL, .cancel = c };
	int rc;

	tev_init(&h->ev);
	o.flags = flags;
	o.provider = p;
	o.key = key;
	o.timeout_ms = timeout_ms;
	o.ttl_ms = ttl_ms;
	o.on_event = tev_record;
	o.event_arg = &h->ev;
	h->lease = NULL;
	ck_assert_int_eq(kl_lock_new(&h->l, &o), KL_OK);
	if (err != NULL)
		memset(err, 0, sizeof *err);
	rc = kl_lock_acquire(h->l, &call, &h->lease, err);
	if (rc != KL_OK)
		ck_assert_ptr_null(h->lease);
	else
		ck_assert_ptr_nonnull(h->lease);
	return rc;
}

static int
take(kl_provider *p, const char *key, int64_t timeout_ms, int64_t ttl_ms,
     kl_cancel *c, struct hold *h, kl_error *err)
{
	return take_flags(p, key, timeout_ms, ttl_ms, c, 0, h, err);
}

static void
take_ok(kl_provider *p, const char *key, int64_t ttl_ms, struct hold *h)
{
	kl_error err;
	int rc = take(p, key, 10000, ttl_ms, NULL, h, &err);

	ck_assert_msg(rc == KL_OK, "acquire %s: %s: %s", key, kl_strerror(rc),
		      err.message);
}

static void
drop(struct hold *h)
{
	kl_lease_release(h->lease);
	h->lease = NULL;
}

static void
hold_free(struct hold *h)
{
	if (h->lease != NULL)
		drop(h);
	kl_lock_free(h->l);
	h->l = NULL;
}

/* Polls until key has exactly holders and waiters. */
static void
wait_status(kl_provider *p, const char *key, size_t holders, size_t waiters)
{
	test_wait_status(p, key, holders, waiters, TEST_POLL_LIMIT_MS);
}

/* ------------------------------------------------------------------ */
/* Waiter threads                                                      */

struct waiter {
	kl_provider *p;
	const char *key;
	int64_t timeout_ms;
	kl_cancel *cancel;
	atomic_long *seq_src; /* grant numbers, taken inside the lock */
	bool keep;            /* keep the lease for the test to release */
	unsigned flags;       /* KL_SHARED */
	pthread_t t;
	/* Outputs, read after join. */
	int rc;
	long seq;
	uint64_t fence;
	int64_t start_ns, end_ns;
	char message[256];
	struct hold h;
};

static void *
waiter_main(void *arg)
{
	struct waiter *w = arg;
	kl_error err;

	w->seq = -1;
	w->start_ns = now_ns();
	w->rc = take_flags(w->p, w->key, w->timeout_ms, 0, w->cancel,
			   w->flags, &w->h, &err);
	w->end_ns = now_ns();
	memcpy(w->message, err.message, sizeof w->message);
	if (w->rc == KL_OK) {
		w->fence = kl_lease_fence(w->h.lease);
		if (w->seq_src != NULL)
			w->seq = atomic_fetch_add(w->seq_src, 1);
		if (!w->keep)
			drop(&w->h);
	}
	return NULL;
}

static void
waiter_start(struct waiter *w, kl_provider *p, const char *key,
	     int64_t timeout_ms, kl_cancel *c)
{
	w->p = p;
	w->key = key;
	w->timeout_ms = timeout_ms;
	w->cancel = c;
	w->rc = 1;
	test_thread_start(&w->t, waiter_main, w);
}

static void
waiter_join(struct waiter *w)
{
	test_thread_join(w->t);
}

/* ------------------------------------------------------------------ */
/* Helper processes (test/redis_helper)                                */

/* Starts redis_helper with args (NULL-terminated, after the program
 * name), with pipes to its stdin and from its stdout. */
static void
helper_spawn(struct test_helper *h, const char **args)
{
	test_helper_spawn(h, test_helper_path("test/redis", "redis_helper",
					      true),
			  args, NULL);
}

/* Waits for the helper to exit; returns its wait status. */
static int
helper_reap(struct test_helper *h)
{
	int status = test_helper_reap(h, 60000);

	test_helper_close(h);
	return status;
}

static void
helper_kill(struct test_helper *h)
{
	test_helper_kill(h);
	test_helper_close(h);
}

/* ------------------------------------------------------------------ */
/* Fixture                                                             */

static void
setup(void)
{
	static atomic_int counter;

	snprintf(g_prefix, sizeof g_prefix, "kltest:%d:%d:", (int)getpid(),
		 atomic_fetch_add(&counter, 1));
	unsetenv("KEYLOCK_REDIS_PASSWORD");
}

static void
teardown(void)
{
	if (g_stopped > 0) {
		kill(g_stopped, SIGCONT);
		g_stopped = 0;
	}
	test_helpers_kill();
}

/* In the runner's process, after the server tests: a test that failed
 * while the server was stopped ends in its forked child without its
 * checked teardown, so resume the server from here too. */
static void
resume_server(void)
{
	if (g_server_pid > 0)
		kill(g_server_pid, SIGCONT);
}

/* ------------------------------------------------------------------ */
/* Basics                                                              */

START_TEST(test_sha256_vectors)
{
	static const struct {
		const char *in;
		size_t repeat;
		const char *hex;
	} v[] = {
		{ "", 0,
		  "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b"
		  "7852b855" },
		{ "abc", 1,
		  "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61"
		  "f20015ad" },
		{ "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq",
		  1,
		  "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd4"
		  "19db06c1" },
		{ "a", 1000000,
		  "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39cc"
		  "c7112cd0" },
	};
	char hex[65];

	for (size_t i = 0; i < sizeof v / sizeof v[0]; i++) {
		size_t len = strlen(v[i].in) * v[i].repeat;
		char *buf = malloc(len + 1);

		ck_assert_ptr_nonnull(buf);
		for (size_t j = 0; j < v[i].repeat; j++)
			memcpy(buf + j * strlen(v[i].in), v[i].in,
			       strlen(v[i].in));
		kl__redis_sha256_hex(buf, len, hex);
		ck_assert_str_eq(hex, v[i].hex);
		free(buf);
	}
}
END_TEST

/* libkeylock-redis exports exactly src/libkeylock-redis.sym, and
 * libkeylock does not link hiredis. */
START_TEST(test_exports)
{
	const char *top = getenv("top_builddir"), *src = getenv("top_srcdir");
	const char *nm = getenv("NM");
	char cmd[PATH_MAX * 2], line[512], want[512];
	FILE *f, *sym;
	int n = 0;

	if (top == NULL || src == NULL) {
		fprintf(stderr, "test_exports: top_builddir or top_srcdir "
				"unset (not run by make check): nothing "
				"done\n");
		return;
	}
	snprintf(cmd, sizeof cmd,
		 "%s -D --defined-only %s/src/.libs/libkeylock-redis.so | "
		 "awk 'NF == 3 && $2 ~ /^[TDBR]$/ { sub(/@.*/, \"\", $3); "
		 "print $3 }' | LC_ALL=C sort -u",
		 nm != NULL && nm[0] != '\0' ? nm : "nm", top);
	f = popen(cmd, "r");
	ck_assert_ptr_nonnull(f);
	snprintf(want, sizeof want, "%s/src/libkeylock-redis.sym", src);
	sym = fopen(want, "r");
	ck_assert_msg(sym != NULL, "%s: %s", want, strerror(errno));
	while (fgets(line, sizeof line, f) != NULL) {
		ck_assert_msg(fgets(want, sizeof want, sym) != NULL,
			      "unexpected export %s", line);
		ck_assert_str_eq(line, want);
		ck_assert_msg(strncmp(line, "kl_redis_", 9) == 0,
			      "export %s", line);
		n++;
	}
	ck_assert_msg(fgets(want, sizeof want, sym) == NULL,
		      "missing export %s", want);
	ck_assert_int_eq(pclose(f), 0);
	fclose(sym);
	ck_assert_int_gt(n, 0);

	snprintf(cmd, sizeof cmd,
		 "readelf -d %s/src/.libs/libkeylock.so 2>/dev/null | "
		 "grep -c hiredis",
		 top);
	f = popen(cmd, "r");
	ck_assert_ptr_nonnull(f);
	ck_assert_ptr_nonnull(fgets(line, sizeof line, f));
	pclose(f);
	ck_assert_msg(atoi(line) == 0, "libkeylock.so links hiredis");
}
END_TEST

START_TEST(test_acquire_release)
{
	kl_provider *p = open_default();
	struct hold h;
	char lock[160], fence[160];
	redisContext *c = raw();
	const char *get[2] = { "GET", lock };
	const char *pttl[2] = { "PTTL", lock };
	redisReply *r;

	key_name(lock, sizeof lock, "alpha", "");
	key_name(fence, sizeof fence, "alpha", ":f");
	take_ok(p, "alpha", 0, &h);
	ck_assert(kl_lease_valid(h.lease));
	ck_assert_uint_gt(kl_lease_fence(h.lease), 0);
	test_assert_status(p, "alpha", 1, 0);
	/* The key holds a 32-hex-digit token and expires by itself. */
	r = rcmd(c, 2, get);
	ck_assert_int_eq(r->type, REDIS_REPLY_STRING);
	ck_assert_uint_eq(r->len, 32);
	freeReplyObject(r);
	ck_assert_int_gt(rint_cmd(c, 2, pttl), 0);
	ck_assert_int_le(rint_cmd(c, 2, pttl), 30000);
	drop(&h);
	ck_assert_int_eq(tev_count(&h.ev, KL_EV_ACQUIRED), 1);
	ck_assert_int_eq(tev_count(&h.ev, KL_EV_RELEASED), 1);
	ck_assert_int_eq(tev_count(&h.ev, KL_EV_RELEASE_FAILED), 0);
	test_assert_status(p, "alpha", 0, 0);
	/* Only the fence counter stays, and it expires too. */
	ck_assert_int_eq(count_keys(",:f,"), 1);
	hold_free(&h);
	redisFree(c);
	kl_provider_free(p);
}
END_TEST

/* The ids of the server's clients, as CLIENT LIST gives them. */
static size_t
client_ids(redisContext *c, long long *ids, size_t max)
{
	const char *argv[2] = { "CLIENT", "LIST" };
	redisReply *r = rcmd(c, 2, argv);
	size_t n = 0;

	ck_assert_int_eq(r->type, REDIS_REPLY_STRING);
	for (const char *at = r->str; (at = strstr(at, "id=")) != NULL;
	     at += 3)
		if ((at == r->str || at[-1] == '\n') && n < max)
			ids[n++] = strtoll(at + 3, NULL, 10);
	freeReplyObject(r);
	return n;
}

static bool
id_in(long long id, const long long *ids, size_t n)
{
	for (size_t i = 0; i < n; i++)
		if (ids[i] == id)
			return true;
	return false;
}

/* TESTPLAN T14, the Redis variant: a child of fork() that uses the
 * inherited provider must connect anew (a pid check), never write on the
 * parent's sockets: the parent's connections outlive the child, and the
 * parent's next operations (1000, scaled) get their own replies. */
START_TEST(test_fork_child_connects_anew)
{
	long long before[256], during[256];
	size_t nb, nd, fresh = 0;
	int ops = (int)kl_test_scaled(1000, 100), ctl[2], rep[2], status;
	uint64_t last, f;
	redisContext *c = raw();
	kl_provider *p = open_default();
	struct hold h;
	char ch = 0;
	pid_t pid;

	/* The parent has a pooled connection; its renewal thread, with no
	 * lease left, is asleep on its condition variable (it lingers
	 * 250 ms first), so no provider lock is held at the fork. */
	take_ok(p, "fork", 0, &h);
	last = kl_lease_fence(h.lease);
	hold_free(&h);
	test_sleep_ms(400);
	nb = client_ids(c, before, 256);
	ck_assert_uint_ge(nb, 2);

	ck_assert_int_eq(pipe2(ctl, O_CLOEXEC), 0);
	ck_assert_int_eq(pipe2(rep, O_CLOEXEC), 0);
	pid = fork();
	ck_assert_int_ge(pid, 0);
	if (pid == 0) {
		/* No ck_assert in the child: exit codes say what failed. */
		kl_lock_opts o = KL_LOCK_OPTS_INIT;
		kl_lock *l = NULL;
		kl_lease *lease = NULL;
		int r;

		o.provider = p;
		o.key = "forkchild";
		o.timeout_ms = 10000;
		if (kl_lock_new(&l, &o) != KL_OK)
			_exit(2);
		r = kl_lock_acquire(l, NULL, &lease, NULL);
		ch = r == KL_OK ? 'G' : 'E';
		if (write(rep[1], &ch, 1) != 1)
			_exit(3);
		if (r != KL_OK)
			_exit(4);
		if (read(ctl[0], &ch, 1) != 1)
			_exit(5);
		kl_lease_release(lease);
		kl_lock_free(l);
		kl_provider_free(p);
		_exit(0);
	}
	test_live_add(pid);
	close(ctl[0]);
	close(rep[1]);
	ck_assert_int_eq(read(rep[0], &ch, 1), 1);
	ck_assert_msg(ch == 'G', "the child could not take 'forkchild'");
	/* While the child holds its key: a client the server did not have
	 * before (the child's), and every one it had still there. */
	nd = client_ids(c, during, 256);
	for (size_t i = 0; i < nd; i++)
		fresh += !id_in(during[i], before, nb);
	for (size_t i = 0; i < nb; i++)
		ck_assert_msg(id_in(before[i], during, nd),
			      "client %lld is gone after the fork", before[i]);
	ck_assert_msg(fresh >= 1, "the child made no connection of its own");
	ck_assert_int_eq(write(ctl[1], "g", 1), 1);
	close(ctl[1]);
	close(rep[0]);
	status = test_helper_reap(&(struct test_helper){ .pid = pid },
				  TEST_POLL_LIMIT_MS);
	ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0,
		      "child status 0x%x", (unsigned)status);
	nd = client_ids(c, during, 256);
	for (size_t i = 0; i < nb; i++)
		ck_assert_msg(id_in(before[i], during, nd),
			      "client %lld is gone after the child", before[i]);
	/* The parent's sockets carry only its own requests and replies. */
	for (int i = 0; i < ops; i++) {
		take_ok(p, "fork", 0, &h);
		f = kl_lease_fence(h.lease);
		ck_assert_msg(f > last, "fence %" PRIu64 " after %" PRIu64,
			      f, last);
		last = f;
		hold_free(&h);
	}
	test_assert_status(p, "fork", 0, 0);
	test_assert_status(p, "forkchild", 0, 0);
	redisFree(c);
	kl_provider_free(p);
}
END_TEST

/* Keys of any bytes (and huge ones) map to fixed-length names under the
 * prefix: no key can name another Redis key or inject a command. */
START_TEST(test_binary_keys)
{
	static const char *const keys[] = {
		"",
		"a b\r\n*3\r\n$3\r\nDEL\r\n",
		"{other}",
		"\x01\x02\xff\xfe",
		"keylock:{x}:q",
	};
	kl_provider *p = open_default();
	struct hold h[5];
	size_t big_len = 1 << 20;
	char *big = malloc(big_len + 1);
	struct hold hb;

	for (size_t i = 0; i < 5; i++)
		take_ok(p, keys[i], 0, &h[i]);
	/* All held at once: distinct locks. */
	for (size_t i = 0; i < 5; i++)
		test_assert_status(p, keys[i], 1, 0);
	ck_assert_int_eq(count_keys(",,:f,"), 10);
	for (size_t i = 0; i < 5; i++)
		hold_free(&h[i]);
	ck_assert_ptr_nonnull(big);
	memset(big, 'k', big_len);
	big[big_len] = '\0';
	take_ok(p, big, 0, &hb);
	test_assert_status(p, big, 1, 0);
	hold_free(&hb);
	free(big);
	kl_provider_free(p);
}
END_TEST

/* A ttl out of the provider's range is refused with a message that says
 * the range and the ttl given: a huge one is not "less than 100 ms". */
START_TEST(test_ttl_out_of_range)
{
	static const int64_t bad[] = { 99, INT64_MAX / 4 + 1, INT64_MAX };
	kl_provider *p = open_default();
	char want[64];
	struct hold h;
	kl_error err;

	for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
		ck_assert_int_eq(take(p, "tr", 0, bad[i], NULL, &h, &err),
				 KL_EINVAL);
		snprintf(want, sizeof want, "from 100 ms to %lld ms, not %lld",
			 (long long)(INT64_MAX / 4), (long long)bad[i]);
		ck_assert_msg(strstr(err.message, want) != NULL,
			      "ttl %lld: '%s'", (long long)bad[i],
			      err.message);
		hold_free(&h);
	}
	test_assert_status(p, "tr", 0, 0);
	kl_provider_free(p);
}
END_TEST


START_TEST(test_errorcheck_refused)
{
	kl_provider *p = open_default();
	kl_lock_opts o = KL_LOCK_OPTS_INIT;
	kl_lease *lease = NULL;
	kl_lock *l;
	kl_error err;

	o.provider = p;
	o.key = "ec";
	o.flags = KL_ERRORCHECK;
	ck_assert_int_eq(kl_lock_new(&l, &o), KL_OK);
	ck_assert_int_eq(kl_lock_acquire(l, NULL, &lease, &err), KL_EINVAL);
	ck_assert_ptr_null(lease);
	ck_assert_ptr_nonnull(strstr(err.message, "not supported"));
	kl_lock_free(l);
	ck_assert_int_eq(count_keys(","), 0);
	kl_provider_free(p);
}
END_TEST

/* ------------------------------------------------------------------ */
/* FIFO and mutual exclusion                                           */

START_TEST(test_fifo_threads)
{
	kl_provider *p = open_default();
	struct waiter w[4];
	atomic_long seq;
	struct hold h;

	atomic_init(&seq, 0);
	memset(w, 0, sizeof w);
	take_ok(p, "fifo", 0, &h);
	/* Queued one at a time, each confirmed by the status op. */
	for (int i = 0; i < 4; i++) {
		w[i].seq_src = &seq;
		waiter_start(&w[i], p, "fifo", 20000, NULL);
		wait_status(p, "fifo", 1, (size_t)i + 1);
	}
	drop(&h);
	for (int i = 0; i < 4; i++)
		waiter_join(&w[i]);
	for (int i = 0; i < 4; i++) {
		ck_assert_msg(w[i].rc == KL_OK, "waiter %d: %s: %s", i,
			      kl_strerror(w[i].rc), w[i].message);
		ck_assert_msg(w[i].seq == i, "waiter %d granted as number %ld",
			      i, w[i].seq);
		if (i > 0)
			ck_assert_uint_gt(w[i].fence, w[i - 1].fence);
		hold_free(&w[i].h);
	}
	test_assert_status(p, "fifo", 0, 0);
	ck_assert_int_eq(count_keys(",:f,"), 1);
	hold_free(&h);
	kl_provider_free(p);
}
END_TEST

struct shared {
	volatile int64_t owner, count, violations;
	int64_t readers, max_readers, reads; /* redis_helper rw */
};

/* Runs 4 redis_helper processes in mode with key, n iterations of 4
 * threads each, over a struct shared in a file made from template (the
 * caller unmaps and unlinks it); fails the test unless each exits 0. */
static struct shared *
helpers_run(char *file, const char *mode, const char *key, long n)
{
	char uri[1024], iters[16];
	const char *args[7];
	struct test_helper h[4];
	struct shared *sh;
	int fd;

	uri_with(uri, sizeof uri, "restart_guard=0");
	fd = mkstemp(file);
	ck_assert_int_ge(fd, 0);
	ck_assert_int_eq(ftruncate(fd, 4096), 0);
	sh = mmap(NULL, sizeof *sh, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	ck_assert(sh != MAP_FAILED);
	close(fd);
	snprintf(iters, sizeof iters, "%ld", n);
	args[0] = mode;
	args[1] = uri;
	args[2] = key;
	args[3] = file;
	args[4] = "4";
	args[5] = iters;
	args[6] = NULL;
	for (int i = 0; i < 4; i++)
		helper_spawn(&h[i], args);
	for (int i = 0; i < 4; i++) {
		char line[300] = "";
		int st = helper_reap(&h[i]);

		if (!(WIFEXITED(st) && WEXITSTATUS(st) == 0)) {
			ck_abort_msg("helper %d: status 0x%x: %s", i,
				     (unsigned)st,
				     read(h[i].from, line, sizeof line - 1) >
						     0
					     ? line
					     : "");
		}
	}
	return sh;
}

START_TEST(test_mutual_exclusion_processes)
{
	char file[] = "/tmp/kl-redis-mutex.XXXXXX";
	struct shared *sh;
	long n = kl_test_scaled(25, 5);

	sh = helpers_run(file, "mutex", "mx", n);
	ck_assert_int_eq(sh->violations, 0);
	ck_assert_int_eq(sh->count, 16 * n);
	munmap(sh, sizeof *sh);
	unlink(file);
	ck_assert_int_eq(count_keys(",:f,"), 1);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Timeouts, try-once, cancellation                                    */

START_TEST(test_timeout)
{
	kl_provider *p = open_default();
	struct hold h, t;
	kl_error err;
	int64_t t0, ms;

	take_ok(p, "to", 0, &h);
	t0 = now_ms();
	ck_assert_int_eq(take(p, "to", 300, 0, NULL, &t, &err), KL_ETIMEDOUT);
	ms = now_ms() - t0;
	ck_assert_int_ge(ms, 300);
	ck_assert_int_le(ms, 300 + SLACK_MS);
	ck_assert_int_eq(tev_count(&t.ev, KL_EV_REJECTED), 1);
	ck_assert_int_eq(t.ev.last_status, KL_ETIMEDOUT);
	/* Nothing of the waiter is left: no queue, heartbeat or wake list. */
	test_assert_status(p, "to", 1, 0);
	ck_assert_int_eq(count_keys(",,:f,"), 2);
	hold_free(&t);
	hold_free(&h);
	kl_provider_free(p);
}
END_TEST

START_TEST(test_try_once)
{
	kl_provider *p = open_default();
	struct hold h, t;
	kl_error err;
	int64_t t0;

	take_ok(p, "try", 0, &h);
	t0 = now_ms();
	ck_assert_int_eq(take(p, "try", 0, 0, NULL, &t, &err), KL_ETIMEDOUT);
	ck_assert_int_le(now_ms() - t0, SLACK_MS);
	/* Never queued. */
	test_assert_status(p, "try", 1, 0);
	ck_assert_int_eq(count_keys(",,:f,"), 2);
	hold_free(&t);
	drop(&h);
	ck_assert_int_eq(take(p, "try", 0, 0, NULL, &t, &err), KL_OK);
	hold_free(&t);
	hold_free(&h);
	kl_provider_free(p);
}
END_TEST

START_TEST(test_cancel)
{
	kl_provider *p = open_default();
	struct waiter w;
	kl_cancel *c;
	struct hold h;
	int64_t t0;

	memset(&w, 0, sizeof w);
	ck_assert_int_eq(kl_cancel_new(&c), KL_OK);
	take_ok(p, "cx", 0, &h);
	waiter_start(&w, p, "cx", 20000, c);
	wait_status(p, "cx", 1, 1);
	t0 = now_ns();
	kl_cancel_fire(c);
	waiter_join(&w);
	ck_assert_int_eq(w.rc, KL_ECANCELED);
	/* Noticed within a slice of its BLPOP, not at its timeout. */
	ck_assert_int_le((w.end_ns - t0) / 1000000, 500);
	test_assert_status(p, "cx", 1, 0);
	ck_assert_int_eq(count_keys(",,:f,"), 2);
	hold_free(&w.h);
	/* A token fired before the call: at once, nothing queued. */
	ck_assert_int_eq(take(p, "cx", 20000, 0, c, &w.h, NULL), KL_ECANCELED);
	test_assert_status(p, "cx", 1, 0);
	hold_free(&w.h);
	hold_free(&h);
	kl_cancel_free(c);
	kl_provider_free(p);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Dead clients                                                        */

START_TEST(test_holder_killed)
{
	char uri[1024];
	const char *args[] = { "hold", uri, "dead", "1000", NULL };
	kl_provider *p = open_default();
	struct test_helper hp;
	struct waiter w;
	int64_t t0;

	memset(&w, 0, sizeof w);
	uri_with(uri, sizeof uri, "restart_guard=0");
	helper_spawn(&hp, args);
	test_helper_granted(&hp, TEST_POLL_LIMIT_MS);
	waiter_start(&w, p, "dead", 20000, NULL);
	wait_status(p, "dead", 1, 1);
	t0 = now_ns();
	helper_kill(&hp);
	waiter_join(&w);
	ck_assert_msg(w.rc == KL_OK, "%s: %s", kl_strerror(w.rc), w.message);
	/* Within the ttl (1 s, from the last renewal) plus slack. */
	ck_assert_int_le((w.end_ns - t0) / 1000000, 1000 + SLACK_MS);
	hold_free(&w.h);
	kl_provider_free(p);
}
END_TEST

START_TEST(test_dead_waiter_at_head)
{
	char uri[1024];
	const char *args[] = { "wait", uri, "head", "60000", NULL };
	kl_provider *p = open_opts("restart_guard=0&heartbeat=500ms");
	struct test_helper hp;
	struct waiter w;
	struct hold h;
	int64_t t0;

	memset(&w, 0, sizeof w);
	uri_with(uri, sizeof uri, "restart_guard=0&heartbeat=500ms");
	take_ok(p, "head", 0, &h);
	helper_spawn(&hp, args);
	wait_status(p, "head", 1, 1);
	waiter_start(&w, p, "head", 20000, NULL);
	wait_status(p, "head", 1, 2);
	helper_kill(&hp);
	t0 = now_ns();
	drop(&h);
	waiter_join(&w);
	ck_assert_msg(w.rc == KL_OK, "%s: %s", kl_strerror(w.rc), w.message);
	/* The dead head blocks it for at most its heartbeat. */
	ck_assert_int_le((w.end_ns - t0) / 1000000, 500 + SLACK_MS);
	hold_free(&w.h);
	hold_free(&h);
	test_assert_status(p, "head", 0, 0);
	kl_provider_free(p);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Ownership                                                           */

/* A lease whose key was deleted (or expired) and taken by another client:
 * its release must not delete the other client's key. */
START_TEST(test_foreign_release)
{
	kl_provider *a = open_default(), *b = open_default();
	char lock[160], holder[64];
	const char *del[2] = { "DEL", lock };
	const char *get[2] = { "GET", lock };
	const char *pexpire[3] = { "PEXPIRE", lock, "1" };
	redisContext *c = raw();
	int rounds = (int)kl_test_scaled(20, 4);

	key_name(lock, sizeof lock, "own", "");
	for (int i = 0; i < rounds; i++) {
		struct hold ha, hb;
		redisReply *r;

		take_ok(a, "own", 0, &ha);
		if (i % 2 == 0) {
			ck_assert_int_eq(rint_cmd(c, 2, del), 1);
		} else {
			ck_assert_int_eq(rint_cmd(c, 3, pexpire), 1);
			test_sleep_ms(5);
		}
		take_ok(b, "own", 0, &hb);
		r = rcmd(c, 2, get);
		ck_assert_int_eq(r->type, REDIS_REPLY_STRING);
		snprintf(holder, sizeof holder, "%s", r->str);
		freeReplyObject(r);
		/* A's release is a foreign one now. */
		drop(&ha);
		ck_assert_int_eq(tev_count(&ha.ev, KL_EV_RELEASE_FAILED), 1);
		ck_assert_int_eq(ha.ev.last_status, KL_EPROVIDER);
		r = rcmd(c, 2, get);
		ck_assert_int_eq(r->type, REDIS_REPLY_STRING);
		ck_assert_str_eq(r->str, holder);
		freeReplyObject(r);
		test_assert_status(b, "own", 1, 0);
		ck_assert(kl_lease_valid(hb.lease));
		drop(&hb);
		ck_assert_int_eq(tev_count(&hb.ev, KL_EV_RELEASED), 1);
		hold_free(&ha);
		hold_free(&hb);
	}
	redisFree(c);
	kl_provider_free(a);
	kl_provider_free(b);
}
END_TEST

static bool
lease_invalid(void *arg)
{
	return !kl_lease_valid(arg);
}

START_TEST(test_external_del_is_lost)
{
	kl_provider *p = open_default();
	char lock[160];
	const char *del[2] = { "DEL", lock };
	redisContext *c = raw();
	struct hold h;
	int64_t t0, lost;

	key_name(lock, sizeof lock, "gone", "");
	take_ok(p, "gone", 600, &h);
	ck_assert(kl_lease_valid(h.lease));
	ck_assert_int_eq(rint_cmd(c, 2, del), 1);
	t0 = now_ns();
	test_poll(lease_invalid, h.lease, "the lease to be lost");
	lost = (now_ns() - t0) / 1000000;
	/* The next renewal (a third of the ttl) reports it. */
	ck_assert_int_le(lost, 200 + SLACK_MS);
	for (int i = 0; i < 1000 && tev_count(&h.ev, KL_EV_LOST) == 0; i++)
		test_sleep_ms(2);
	ck_assert_int_eq(tev_count(&h.ev, KL_EV_LOST), 1);
	drop(&h);
	ck_assert_int_eq(tev_count(&h.ev, KL_EV_RELEASE_FAILED), 1);
	ck_assert_int_eq(tev_count(&h.ev, KL_EV_LOST), 1);
	hold_free(&h);
	redisFree(c);
	kl_provider_free(p);
}
END_TEST

START_TEST(test_renewal_keeps_lease)
{
	kl_provider *p = open_default(), *q = open_default();
	struct hold h, t;
	kl_error err;
	char lock[160];
	const char *pttl[2] = { "PTTL", lock };
	redisContext *c = raw();

	key_name(lock, sizeof lock, "renew", "");
	/* 600 ms: a renewal may come 400 ms late on a loaded machine. */
	take_ok(p, "renew", 600, &h);
	for (int i = 0; i < 12; i++) {
		test_sleep_ms(150);
		ck_assert(kl_lease_valid(h.lease));
		ck_assert_int_eq(take(q, "renew", 0, 0, NULL, &t, &err),
				 KL_ETIMEDOUT);
		hold_free(&t);
	}
	ck_assert_int_gt(rint_cmd(c, 2, pttl), 0);
	ck_assert_int_eq(tev_count(&h.ev, KL_EV_LOST), 0);
	drop(&h);
	ck_assert_int_eq(tev_count(&h.ev, KL_EV_RELEASED), 1);
	ck_assert_int_eq(tev_count(&h.ev, KL_EV_RELEASE_FAILED), 0);
	hold_free(&h);
	redisFree(c);
	kl_provider_free(p);
	kl_provider_free(q);
}
END_TEST

START_TEST(test_fence_increasing)
{
	kl_provider *p[2] = { open_default(), open_default() };
	uint64_t last = 0;
	int n = (int)kl_test_scaled(200, 20);

	for (int i = 0; i < n; i++) {
		struct hold h;
		uint64_t f;

		take_ok(p[i % 2], "fence", 0, &h);
		f = kl_lease_fence(h.lease);
		ck_assert_msg(f > last, "fence %" PRIu64 " after %" PRIu64, f,
			      last);
		last = f;
		hold_free(&h);
	}
	kl_provider_free(p[0]);
	kl_provider_free(p[1]);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Shared mode (KL_SHARED): the Web Locks rule on one FIFO queue       */

static void
take_shared_ok(kl_provider *p, const char *key, int64_t timeout_ms,
	       struct hold *h)
{
	kl_error err;
	int rc = take_flags(p, key, timeout_ms, 0, NULL, KL_SHARED, h, &err);

	ck_assert_msg(rc == KL_OK, "acquire %s shared: %s: %s", key,
		      kl_strerror(rc), err.message);
}

static void
waiter_start_mode(struct waiter *w, kl_provider *p, const char *key,
		  int64_t timeout_ms, unsigned flags, atomic_long *seq)
{
	w->flags = flags;
	w->keep = true;
	w->seq_src = seq;
	waiter_start(w, p, key, timeout_ms, NULL);
}

static void
waiter_ok(struct waiter *w, const char *what)
{
	ck_assert_msg(w->rc == KL_OK, "%s: %s: %s", what, kl_strerror(w->rc),
		      w->message);
}

/* Two providers (two clients) hold one key shared at once: the second
 * even with a try-once; status counts both; each grant a larger fence. */
START_TEST(test_shared_together)
{
	kl_provider *p = open_default(), *q = open_default();
	struct hold a, b, x;
	kl_error err;

	take_shared_ok(p, "sh", 10000, &a);
	take_shared_ok(q, "sh", 0, &b);
	test_assert_status(p, "sh", 2, 0);
	ck_assert_uint_gt(kl_lease_fence(b.lease), kl_lease_fence(a.lease));
	ck_assert(kl_lease_valid(a.lease));
	ck_assert(kl_lease_valid(b.lease));
	/* Exclusive, try-once: refused while either holds. */
	ck_assert_int_eq(take(p, "sh", 0, 0, NULL, &x, &err), KL_ETIMEDOUT);
	hold_free(&x);
	drop(&a);
	ck_assert_int_eq(take(q, "sh", 0, 0, NULL, &x, &err), KL_ETIMEDOUT);
	hold_free(&x);
	test_assert_status(p, "sh", 1, 0);
	drop(&b);
	ck_assert_int_eq(tev_count(&a.ev, KL_EV_RELEASED), 1);
	ck_assert_int_eq(tev_count(&b.ev, KL_EV_RELEASED), 1);
	test_assert_status(p, "sh", 0, 0);
	/* Nothing of the shared holders is left. */
	ck_assert_int_eq(count_keys(",:f,"), 1);
	take_ok(p, "sh", 0, &x);
	ck_assert_uint_gt(kl_lease_fence(x.lease), kl_lease_fence(b.lease));
	hold_free(&x);
	hold_free(&a);
	hold_free(&b);
	kl_provider_free(p);
	kl_provider_free(q);
}
END_TEST

/* Queue order with both modes: X waits for every shared holder; S3, asked
 * after X was queued, waits behind X although the key is held shared; S4
 * queues behind S3; X's release grants S3 and S4 together. */
START_TEST(test_shared_queue_order)
{
	kl_provider *p = open_default(), *q = open_default();
	struct waiter x, s3, s4;
	struct hold s1, s2, t;
	atomic_long seq;
	kl_error err;

	atomic_init(&seq, 0);
	memset(&x, 0, sizeof x);
	memset(&s3, 0, sizeof s3);
	memset(&s4, 0, sizeof s4);
	take_shared_ok(p, "so", 10000, &s1);
	take_shared_ok(q, "so", 0, &s2);
	waiter_start_mode(&x, p, "so", 30000, 0, &seq);
	wait_status(p, "so", 2, 1);
	waiter_start_mode(&s3, q, "so", 30000, KL_SHARED, &seq);
	wait_status(p, "so", 2, 2);
	/* A shared try-once never passes the queued exclusive X. */
	ck_assert_int_eq(take_flags(p, "so", 0, 0, NULL, KL_SHARED, &t, &err),
			 KL_ETIMEDOUT);
	hold_free(&t);
	/* X waits for the last shared holder, not the first. */
	drop(&s1);
	wait_status(p, "so", 1, 2);
	ck_assert_int_eq(atomic_load(&seq), 0);
	drop(&s2);
	/* X alone; S3 still queued, then S4 behind it. */
	wait_status(p, "so", 1, 1);
	waiter_start_mode(&s4, p, "so", 30000, KL_SHARED, &seq);
	wait_status(p, "so", 1, 2);
	ck_assert_int_eq(atomic_load(&seq), 1);
	waiter_join(&x);
	waiter_ok(&x, "exclusive X");
	ck_assert_int_eq(x.seq, 0);
	ck_assert_uint_gt(x.fence, kl_lease_fence(s2.lease));
	/* Its release grants the shared run S3, S4 at once: both hold. */
	drop(&x.h);
	waiter_join(&s3);
	waiter_join(&s4);
	waiter_ok(&s3, "shared S3");
	waiter_ok(&s4, "shared S4");
	test_assert_status(p, "so", 2, 0);
	ck_assert_uint_gt(s3.fence, x.fence);
	ck_assert_uint_gt(s4.fence, x.fence);
	ck_assert_uint_ne(s3.fence, s4.fence);
	hold_free(&s3.h);
	hold_free(&s4.h);
	hold_free(&x.h);
	hold_free(&s1);
	hold_free(&s2);
	test_assert_status(p, "so", 0, 0);
	ck_assert_int_eq(count_keys(",:f,"), 1);
	kl_provider_free(p);
	kl_provider_free(q);
}
END_TEST

/* A queued exclusive request that times out lets the shared request
 * queued behind it through, the key still held shared. */
START_TEST(test_shared_behind_timed_out_exclusive)
{
	kl_provider *p = open_default();
	struct waiter x, s;
	struct hold h;

	memset(&x, 0, sizeof x);
	memset(&s, 0, sizeof s);
	take_shared_ok(p, "st", 10000, &h);
	waiter_start_mode(&x, p, "st", 1500, 0, NULL);
	wait_status(p, "st", 1, 1);
	waiter_start_mode(&s, p, "st", 60000, KL_SHARED, NULL);
	waiter_join(&x);
	ck_assert_int_eq(x.rc, KL_ETIMEDOUT);
	waiter_join(&s);
	waiter_ok(&s, "shared behind X");
	/* Not before X's timeout: it waited behind X. */
	ck_assert_int_ge((s.end_ns - x.start_ns) / 1000000, 1500);
	test_assert_status(p, "st", 2, 0);
	hold_free(&s.h);
	hold_free(&x.h);
	hold_free(&h);
	test_assert_status(p, "st", 0, 0);
	kl_provider_free(p);
}
END_TEST

/* A shared holder whose process dies (SIGKILL: no renewal, no release)
 * expires alone: the other shared holder keeps its lease, the exclusive
 * waiter still waits for it, and gets the key once it is released. */
START_TEST(test_shared_holder_expires)
{
	char uri[1024];
	const char *args[] = { "holdshared", uri, "sx", "1000", NULL };
	kl_provider *p = open_default();
	struct test_helper hp;
	struct waiter x;
	struct hold h;
	atomic_long seq;
	uint64_t hf;

	atomic_init(&seq, 0);
	memset(&x, 0, sizeof x);
	uri_with(uri, sizeof uri, "restart_guard=0");
	helper_spawn(&hp, args);
	hf = test_helper_granted(&hp, TEST_POLL_LIMIT_MS);
	take_shared_ok(p, "sx", 10000, &h);
	ck_assert_uint_gt(kl_lease_fence(h.lease), hf);
	hf = kl_lease_fence(h.lease);
	test_assert_status(p, "sx", 2, 0);
	waiter_start_mode(&x, p, "sx", 60000, 0, &seq);
	wait_status(p, "sx", 2, 1);
	helper_kill(&hp);
	/* The dead holder's lease runs out (1 s); ours is renewed. */
	wait_status(p, "sx", 1, 1);
	ck_assert(kl_lease_valid(h.lease));
	ck_assert_int_eq(atomic_load(&seq), 0);
	drop(&h);
	ck_assert_int_eq(tev_count(&h.ev, KL_EV_RELEASED), 1);
	waiter_join(&x);
	waiter_ok(&x, "exclusive after the expiry");
	ck_assert_uint_gt(x.fence, hf);
	test_assert_status(p, "sx", 1, 0);
	hold_free(&x.h);
	hold_free(&h);
	kl_provider_free(p);
}
END_TEST

/* A shared holder's process stopped (SIGSTOP) for longer than its ttl,
 * then continued: meanwhile an exclusive acquire is granted, once the
 * stopped holder's lease ran out; continued, the old holder finds its
 * lease lost (its renewal thread neither revives nor extends it), and
 * its release takes nothing from the exclusive holder. */
START_TEST(test_shared_holder_paused)
{
	char uri[1024], line[64];
	const char *args[] = { "holdshared", uri, "sp", "1000", NULL };
	kl_provider *p = open_default();
	struct test_helper hp;
	struct hold x;
	kl_error err;
	uint64_t hf;
	int rc;

	uri_with(uri, sizeof uri, "restart_guard=0");
	helper_spawn(&hp, args);
	hf = test_helper_granted(&hp, TEST_POLL_LIMIT_MS);
	ck_assert_int_eq(kill(hp.pid, SIGSTOP), 0);
	rc = take(p, "sp", 20000, 0, NULL, &x, &err);
	ck_assert_msg(rc == KL_OK, "%s: %s", kl_strerror(rc), err.message);
	ck_assert_uint_gt(kl_lease_fence(x.lease), hf);
	ck_assert_int_eq(kill(hp.pid, SIGCONT), 0);
	ck_assert_int_eq(write(hp.to, "\n", 1), 1);
	ck_assert(test_helper_line(&hp, line, sizeof line,
				   TEST_POLL_LIMIT_MS));
	ck_assert_str_eq(line, "R lost");
	ck_assert_int_eq(WEXITSTATUS(helper_reap(&hp)), 0);
	/* The exclusive holder alone, and still valid a ttl on. */
	test_assert_status(p, "sp", 1, 0);
	ck_assert(kl_lease_valid(x.lease));
	hold_free(&x);
	ck_assert_int_eq(tev_count(&x.ev, KL_EV_RELEASED), 1);
	test_assert_status(p, "sp", 0, 0);
	kl_provider_free(p);
}
END_TEST

/* A shared holder that died (SIGKILL: no release) is swept out of the
 * shared holders' keys by the next shared grant: with shared grants
 * alone, and at least one a ttl, its entry would otherwise stay in :s and
 * :sm for ever (their expiry is pushed back by every grant), one more per
 * holder that dies. */
START_TEST(test_shared_dead_holder_swept)
{
	char uri[1024], sk[160], smk[160];
	const char *args[] = { "holdshared", uri, "sd", "1000", NULL };
	const char *zc[2] = { "ZCARD", sk };
	const char *hl[2] = { "HLEN", smk };
	kl_provider *p = open_default();
	struct test_helper hp;
	struct hold a, b;
	redisContext *c = raw();

	uri_with(uri, sizeof uri, "restart_guard=0");
	key_name(sk, sizeof sk, "sd", ":s");
	key_name(smk, sizeof smk, "sd", ":sm");
	helper_spawn(&hp, args);
	test_helper_granted(&hp, TEST_POLL_LIMIT_MS);
	take_shared_ok(p, "sd", 10000, &a);
	helper_kill(&hp);
	/* The dead holder's lease runs out (1 s). */
	wait_status(p, "sd", 1, 0);
	/* Shared grants and releases only, as a readers-only workload. */
	take_shared_ok(p, "sd", 10000, &b);
	hold_free(&b);
	ck_assert_int_eq(rint_cmd(c, 2, zc), 1);
	ck_assert_int_eq(rint_cmd(c, 2, hl), 1);
	hold_free(&a);
	ck_assert_int_eq(count_keys(",:f,"), 1);
	redisFree(c);
	kl_provider_free(p);
}
END_TEST

/* Try-once in both modes: shared with shared holders, never past an
 * exclusive holder; exclusive only on a free key. */
START_TEST(test_shared_try_once)
{
	kl_provider *p = open_default();
	struct hold a, b, x;
	kl_error err;

	take_shared_ok(p, "sy", 0, &a);
	take_shared_ok(p, "sy", 0, &b);
	ck_assert_int_eq(take(p, "sy", 0, 0, NULL, &x, &err), KL_ETIMEDOUT);
	hold_free(&x);
	test_assert_status(p, "sy", 2, 0);
	hold_free(&a);
	hold_free(&b);
	ck_assert_int_eq(take(p, "sy", 0, 0, NULL, &x, &err), KL_OK);
	ck_assert_int_eq(take_flags(p, "sy", 0, 0, NULL, KL_SHARED, &a, &err),
			 KL_ETIMEDOUT);
	hold_free(&a);
	test_assert_status(p, "sy", 1, 0);
	hold_free(&x);
	/* ERRORCHECK stays refused, in either mode; unknown flags too. */
	ck_assert_int_eq(take_flags(p, "sy", 0, 0, NULL,
				    KL_SHARED | KL_ERRORCHECK, &a, &err),
			 KL_EINVAL);
	hold_free(&a);
	test_assert_status(p, "sy", 0, 0);
	ck_assert_int_eq(count_keys(",:f,"), 1);
	kl_provider_free(p);
}
END_TEST

/* Fences over mixed grants, from two clients: every grant larger. */
START_TEST(test_shared_fences_mixed)
{
	kl_provider *p[2] = { open_default(), open_default() };
	uint64_t last = 0;
	int n = (int)kl_test_scaled(60, 12);
	struct hold held[3];

	for (int i = 0; i < n; i++) {
		int k = 1 + i % 3;

		/* k shared grants held together, then one exclusive. */
		for (int j = 0; j < k; j++) {
			take_shared_ok(p[j % 2], "sf", 10000, &held[j]);
			ck_assert_uint_gt(kl_lease_fence(held[j].lease), last);
			last = kl_lease_fence(held[j].lease);
		}
		test_assert_status(p[0], "sf", (size_t)k, 0);
		for (int j = 0; j < k; j++)
			hold_free(&held[j]);
		take_ok(p[i % 2], "sf", 0, &held[0]);
		ck_assert_uint_gt(kl_lease_fence(held[0].lease), last);
		last = kl_lease_fence(held[0].lease);
		hold_free(&held[0]);
	}
	kl_provider_free(p[0]);
	kl_provider_free(p[1]);
}
END_TEST

/* 4 processes of 4 threads, two thirds of their acquires shared: no
 * shared holder ever meets an exclusive one, no exclusive one meets
 * anybody, and every section ran. */
START_TEST(test_shared_exclusion_processes)
{
	char file[] = "/tmp/kl-redis-rw.XXXXXX";
	struct shared *sh;
	long n = kl_test_scaled(24, 6);
	kl_provider *p;

	sh = helpers_run(file, "rw", "rw", n);
	ck_assert_int_eq(sh->violations, 0);
	ck_assert_int_eq(sh->count + sh->reads, 16 * n);
	ck_assert_int_gt(sh->count, 0);
	ck_assert_int_gt(sh->reads, 0);
	printf("shared/exclusive across 4 processes: %lld exclusive, %lld "
	       "shared sections, at most %lld shared holders at once\n",
	       (long long)sh->count, (long long)sh->reads,
	       (long long)sh->max_readers);
	munmap(sh, sizeof *sh);
	unlink(file);
	p = open_default();
	test_assert_status(p, "rw", 0, 0);
	kl_provider_free(p);
	ck_assert_int_eq(count_keys(",:f,"), 1);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Snapshot                                                            */

#define SNAP_MAX 16

struct snap_entry {
	char detail[200];
	bool has_key, waiting, shared;
	uint64_t fence;
	int64_t elapsed;
	size_t position;
};

struct snap {
	struct snap_entry e[SNAP_MAX];
	int n;
	int stop_after; /* 0: never stop */
	int calls;
};

static int
snap_fn(const kl_lock_info *info, void *arg)
{
	struct snap *s = arg;

	s->calls++;
	if (s->n < SNAP_MAX) {
		struct snap_entry *e = &s->e[s->n++];

		snprintf(e->detail, sizeof e->detail, "%s",
			 info->detail != NULL ? info->detail : "");
		e->has_key = info->key != NULL;
		e->waiting = info->waiting;
		e->shared = info->shared;
		e->fence = info->fence;
		e->elapsed = info->elapsed_ms;
		e->position = info->position;
	}
	return s->stop_after != 0 && s->calls >= s->stop_after;
}

/* The entries of one key, in the order the snapshot gave them. */
static int
snap_of(const struct snap *s, const char *key, const struct snap_entry **out,
	int max)
{
	char name[160];
	int n = 0;

	key_name(name, sizeof name, key, "");
	for (int i = 0; i < s->n; i++)
		if (strcmp(s->e[i].detail, name) == 0 && n < max)
			out[n++] = &s->e[i];
	return n;
}

/* A known state: key "ka" held exclusive; key "kb" held shared by two,
 * then waited for by X (exclusive) and S (shared), in that order; and a
 * key of another prefix, never listed. */
START_TEST(test_snapshot)
{
	kl_provider *p = open_default(), *other;
	struct hold a, b1, b2, o;
	struct waiter x, s;
	struct snap sn;
	const struct snap_entry *e[8];
	char save[64];
	kl_error err;
	int rc;

	memset(&x, 0, sizeof x);
	memset(&s, 0, sizeof s);
	memset(&sn, 0, sizeof sn);
	/* Another prefix that ours is a prefix of. */
	snprintf(save, sizeof save, "%s", g_prefix);
	ck_assert_uint_lt(strlen(save) + 1, sizeof g_prefix);
	memcpy(g_prefix, save, strlen(save));
	memcpy(g_prefix + strlen(save), "x", 2);
	other = open_default();
	take_ok(other, "ko", 0, &o);
	snprintf(g_prefix, sizeof g_prefix, "%s", save);

	memset(&err, 0, sizeof err);
	ck_assert_int_eq(kl_provider_snapshot(p, snap_fn, &sn, &err), KL_OK);
	ck_assert_msg(sn.n == 0, "%d entries of an empty prefix", sn.n);

	take_ok(p, "ka", 0, &a);
	take_shared_ok(p, "kb", 0, &b1);
	take_shared_ok(p, "kb", 0, &b2);
	waiter_start_mode(&x, p, "kb", 30000, 0, NULL);
	wait_status(p, "kb", 2, 1);
	waiter_start_mode(&s, p, "kb", 30000, KL_SHARED, NULL);
	wait_status(p, "kb", 2, 2);

	rc = kl_provider_snapshot(p, snap_fn, &sn, &err);
	ck_assert_msg(rc == KL_OK, "%s: %s", kl_strerror(rc), err.message);
	ck_assert_int_eq(sn.n, 5);
	ck_assert_int_eq(snap_of(&sn, "ka", e, 8), 1);
	ck_assert(!e[0]->waiting && !e[0]->shared && !e[0]->has_key);
	ck_assert_uint_eq(e[0]->fence, kl_lease_fence(a.lease));
	ck_assert_int_eq(snap_of(&sn, "kb", e, 8), 4);
	/* Holders first, then the waiters in queue order. */
	ck_assert(!e[0]->waiting && e[0]->shared);
	ck_assert(!e[1]->waiting && e[1]->shared);
	ck_assert((e[0]->fence == kl_lease_fence(b1.lease) &&
		   e[1]->fence == kl_lease_fence(b2.lease)) ||
		  (e[1]->fence == kl_lease_fence(b1.lease) &&
		   e[0]->fence == kl_lease_fence(b2.lease)));
	ck_assert_int_ge(e[0]->elapsed, 0);
	ck_assert(e[2]->waiting && !e[2]->shared);
	ck_assert_uint_eq(e[2]->position, 0);
	ck_assert_uint_eq(e[2]->fence, 0);
	ck_assert_int_ge(e[2]->elapsed, 0);
	ck_assert(e[3]->waiting && e[3]->shared);
	ck_assert_uint_eq(e[3]->position, 1);
	/* X waited longer than S, which came after it. */
	ck_assert_int_ge(e[2]->elapsed, e[3]->elapsed);

	/* A non-zero return stops the walk. */
	memset(&sn, 0, sizeof sn);
	sn.stop_after = 2;
	ck_assert_int_eq(kl_provider_snapshot(p, snap_fn, &sn, &err), KL_OK);
	ck_assert_int_eq(sn.calls, 2);

	hold_free(&b1);
	hold_free(&b2);
	waiter_join(&x);
	waiter_ok(&x, "X");
	hold_free(&x.h);
	waiter_join(&s);
	waiter_ok(&s, "S");
	memset(&sn, 0, sizeof sn);
	ck_assert_int_eq(kl_provider_snapshot(p, snap_fn, &sn, &err), KL_OK);
	ck_assert_int_eq(sn.n, 2);
	ck_assert_int_eq(snap_of(&sn, "kb", e, 8), 1);
	ck_assert(!e[0]->waiting && e[0]->shared);
	ck_assert_uint_eq(e[0]->fence, s.fence);
	hold_free(&s.h);
	hold_free(&a);
	memset(&sn, 0, sizeof sn);
	ck_assert_int_eq(kl_provider_snapshot(p, snap_fn, &sn, &err), KL_OK);
	ck_assert_int_eq(sn.n, 0);
	hold_free(&o);
	kl_provider_free(other);
	kl_provider_free(p);
}
END_TEST

/* The entries of a snapshot, all of them. */
struct snap_all {
	size_t n, bad;
	char (*detail)[200];
};

static int
snap_all_fn(const kl_lock_info *info, void *arg)
{
	struct snap_all *s = arg;

	if (info->detail == NULL || s->n == 400) {
		s->bad++;
		return 0;
	}
	snprintf(s->detail[s->n++], 200, "%s", info->detail);
	return 0;
}

static int
detail_cmp(const void *a, const void *b)
{
	return strcmp(a, b);
}

/* A prefix made of every glob character of SCAN MATCH, a backslash and a
 * control byte; 300 keys held, more than a page of SCAN, and one more
 * held shared by two and waited for.  The snapshot lists every entry
 * under the Redis key name of its own key, and nothing of a prefix that
 * the pattern would match were its characters not escaped. */
START_TEST(test_snapshot_hostile_prefix)
{
	char save[64], want[96], uri[1024], other[1024], name[160];
	static struct hold h[300];
	static char details[400][200];
	struct snap_all sn = { 0, 0, details };
	struct hold s1, s2, o;
	struct waiter x;
	kl_provider *p, *q;
	kl_error err;
	size_t distinct = 1;
	int rc, n;

	memset(&x, 0, sizeof x);
	snprintf(save, sizeof save, "%s", g_prefix);
	snprintf(uri, sizeof uri, "%s%cprefix=%s%%5B%%2A%%3F%%5D%%5C%%01:"
		 "&restart_guard=0",
		 g_uri, strchr(g_uri, '?') != NULL ? '&' : '?', save);
	/* Matched by "[*?]\\\x01:{*" unescaped (a class, then an escaped
	 * control byte). */
	snprintf(other, sizeof other, "%s%cprefix=%s%%3F%%01:&restart_guard=0",
		 g_uri, strchr(g_uri, '?') != NULL ? '&' : '?', save);
	p = test_provider_open(uri);
	q = test_provider_open(other);
	take_ok(q, "k0", 0, &o);
	for (int i = 0; i < 300; i++) {
		char key[16];

		snprintf(key, sizeof key, "k%d", i);
		take_ok(p, key, 30000, &h[i]);
	}
	take_shared_ok(p, "w", 0, &s1);
	take_shared_ok(p, "w", 0, &s2);
	waiter_start_mode(&x, p, "w", 30000, 0, NULL);
	wait_status(p, "w", 2, 1);

	memset(&err, 0, sizeof err);
	rc = kl_provider_snapshot(p, snap_all_fn, &sn, &err);
	ck_assert_msg(rc == KL_OK, "%s: %s", kl_strerror(rc), err.message);
	ck_assert_uint_eq(sn.bad, 0);
	ck_assert_uint_eq(sn.n, 303);
	n = snprintf(want, sizeof want, "%s[*?]\\\x01:", save);
	ck_assert(n > 0 && (size_t)n < sizeof g_prefix);
	memcpy(g_prefix, want, (size_t)n + 1);
	for (size_t i = 0; i < sn.n; i++)
		ck_assert_msg(strncmp(sn.detail[i], g_prefix,
				      strlen(g_prefix)) == 0 &&
				      strlen(sn.detail[i]) ==
					      strlen(g_prefix) + 66,
			      "not a lock of the prefix: %s", sn.detail[i]);
	qsort(sn.detail, sn.n, sizeof *sn.detail, detail_cmp);
	for (size_t i = 1; i < sn.n; i++)
		distinct += strcmp(sn.detail[i], sn.detail[i - 1]) != 0;
	ck_assert_uint_eq(distinct, 301);
	key_name(name, sizeof name, "w", "");
	ck_assert_ptr_nonnull(bsearch(name, sn.detail, sn.n, sizeof *sn.detail,
				      detail_cmp));
	snprintf(g_prefix, sizeof g_prefix, "%s", save);

	hold_free(&s1);
	hold_free(&s2);
	waiter_join(&x);
	waiter_ok(&x, "X");
	hold_free(&x.h);
	for (int i = 0; i < 300; i++)
		hold_free(&h[i]);
	hold_free(&o);
	sn.n = 0;
	ck_assert_int_eq(kl_provider_snapshot(p, snap_all_fn, &sn, &err),
			 KL_OK);
	ck_assert_uint_eq(sn.n, 0);
	kl_provider_free(q);
	kl_provider_free(p);
}
END_TEST

/* A pooled connection that the server closed meanwhile (its idle
 * "timeout", CLIENT KILL, a restart) costs a snapshot nothing, as it
 * costs status and release nothing: the command is sent again on a new
 * connection.  The key held shares the pool's connection's life. */
START_TEST(test_snapshot_after_idle_close)
{
	long long before[256], after[256];
	size_t nb, na;
	redisContext *c = raw();
	kl_provider *p;
	struct hold a;
	struct snap sn;
	kl_error err;
	int rc;

	memset(&sn, 0, sizeof sn);
	nb = client_ids(c, before, 256);
	p = open_default();
	take_ok(p, "ic", 0, &a);
	/* A status leaves a second connection in the pool. */
	test_assert_status(p, "ic", 1, 0);
	na = client_ids(c, after, 256);
	for (size_t i = 0; i < na; i++) {
		char id[32];
		const char *kill[4] = { "CLIENT", "KILL", "ID", id };

		if (id_in(after[i], before, nb))
			continue;
		snprintf(id, sizeof id, "%lld", after[i]);
		rint_cmd(c, 4, kill);
	}
	memset(&err, 0, sizeof err);
	rc = kl_provider_snapshot(p, snap_fn, &sn, &err);
	ck_assert_msg(rc == KL_OK, "%s: %s", kl_strerror(rc), err.message);
	ck_assert_int_eq(sn.n, 1);
	ck_assert(!sn.e[0].waiting && !sn.e[0].shared);
	ck_assert_uint_eq(sn.e[0].fence, kl_lease_fence(a.lease));
	hold_free(&a);
	redisFree(c);
	kl_provider_free(p);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Passwords and failures to connect                                   */

#define CANARY "Canary-7f3a9c-Secret"

/* Creates (or deletes) an ACL user with the password CANARY: full rights,
 * or only those the manual page lists, on this test's keys. */
static void
acl_user(const char *user, bool create, bool restricted)
{
	redisContext *c = raw();
	char keys[80];
	const char *set[] = { "ACL",   "SETUSER", user,     "reset",
			      "on",    ">" CANARY, "~*",    "+@all" };
	const char *setr[] = { "ACL",	   "SETUSER", user,   "reset",
			       "on",	   ">" CANARY, keys,   "+@read",
			       "+@write", "+@scripting", "+info", "+time",
			       "+select" };
	const char *del[] = { "ACL", "DELUSER", user };
	redisReply *r;

	snprintf(keys, sizeof keys, "~%s*", g_prefix);
	if (!create)
		r = rcmd(c, 3, del);
	else if (restricted)
		r = rcmd(c, 13, setr);
	else
		r = rcmd(c, 8, set);
	freeReplyObject(r);
	redisFree(c);
}

/* Opening uri fails with status within bound_ms, saying something that
 * contains want, never the canary. */
static void
open_fails(const char *uri, int status, const char *want, int64_t bound_ms)
{
	kl_provider *p = (kl_provider *)&p;
	kl_error err;
	int64_t t0 = now_ms();
	int rc;

	memset(&err, 0, sizeof err);
	rc = kl_provider_open(&p, uri, &err);
	ck_assert_msg(rc == status, "open gave %s (%s)", kl_strerror(rc),
		      err.message);
	ck_assert_ptr_null(p);
	ck_assert_int_le(now_ms() - t0, bound_ms);
	ck_assert_msg(strstr(err.message, want) != NULL,
		      "message '%s' lacks '%s'", err.message, want);
	ck_assert_msg(strstr(err.message, "Canary") == NULL,
		      "the password shows in '%s'", err.message);
}

static void
base_with_auth(char *buf, size_t size, const char *userinfo,
	       const char *opts)
{
	int n = snprintf(buf, size, "redis://%s@%s:%d/%d?prefix=%s%s%s",
			 userinfo, g_host, g_port, g_db, g_prefix,
			 opts[0] != '\0' ? "&" : "", opts);

	ck_assert(n > 0 && (size_t)n < size);
}

START_TEST(test_auth)
{
	char user[64], info[160], uri[1024], file[] = "/tmp/kl-redis-pw.XXXXXX";
	kl_provider *p;
	kl_error err;
	struct hold h;
	int fd;

	snprintf(user, sizeof user, "kltest%d", (int)getpid());
	acl_user(user, true, false);

	/* Wrong password: refused quickly, never shown. */
	snprintf(info, sizeof info, "%s:Wrong-%s", user, CANARY);
	base_with_auth(uri, sizeof uri, info, "");
	open_fails(uri, KL_EPROVIDER, "auth", 1000);

	/* Right password in the URI. */
	snprintf(info, sizeof info, "%s:%s", user, CANARY);
	base_with_auth(uri, sizeof uri, info, "restart_guard=0");
	memset(&err, 0, sizeof err);
	ck_assert_int_eq(kl_provider_open(&p, uri, &err), KL_OK);
	take_ok(p, "auth", 0, &h);
	hold_free(&h);
	kl_provider_free(p);

	/* From the environment. */
	base_with_auth(uri, sizeof uri, user, "restart_guard=0");
	ck_assert_int_eq(setenv("KEYLOCK_REDIS_PASSWORD", CANARY, 1), 0);
	ck_assert_int_eq(kl_provider_open(&p, uri, &err), KL_OK);
	kl_provider_free(p);
	ck_assert_int_eq(setenv("KEYLOCK_REDIS_PASSWORD", "Canary-wrong", 1),
			 0);
	open_fails(uri, KL_EPROVIDER, "auth", 1000);
	unsetenv("KEYLOCK_REDIS_PASSWORD");

	/* No password at all for a user that needs one. */
	open_fails(uri, KL_EPROVIDER, "auth", 1000);

	/* From a file of mode 0600; refused at 0644. */
	fd = mkstemp(file);
	ck_assert_int_ge(fd, 0);
	ck_assert_int_eq(write(fd, CANARY "\n", strlen(CANARY) + 1),
			 (ssize_t)strlen(CANARY) + 1);
	close(fd);
	ck_assert_int_eq(chmod(file, 0600), 0);
	snprintf(info, sizeof info, "restart_guard=0&password_file=%s", file);
	base_with_auth(uri, sizeof uri, user, info);
	ck_assert_int_eq(kl_provider_open(&p, uri, &err), KL_OK);
	kl_provider_free(p);
	ck_assert_int_eq(chmod(file, 0644), 0);
	open_fails(uri, KL_EPROVIDER, "0644", 1000);
	unlink(file);

	acl_user(user, false, false);
}
END_TEST

/* The ACL the manual page documents is enough: acquire, wait (BLPOP),
 * status, renew and release. */
START_TEST(test_restricted_acl_user)
{
	char user[64], info[160], uri[1024];
	struct waiter w;
	kl_provider *p;
	kl_error err;
	struct hold h;

	memset(&w, 0, sizeof w);
	snprintf(user, sizeof user, "kltestr%d", (int)getpid());
	acl_user(user, true, true);
	snprintf(info, sizeof info, "%s:%s", user, CANARY);
	base_with_auth(uri, sizeof uri, info, "restart_guard=0&ttl=300ms");
	memset(&err, 0, sizeof err);
	ck_assert_msg(kl_provider_open(&p, uri, &err) == KL_OK, "%s",
		      err.message);
	take_ok(p, "acl", 0, &h);
	waiter_start(&w, p, "acl", 10000, NULL);
	wait_status(p, "acl", 1, 1);
	test_sleep_ms(250); /* a renewal or two */
	ck_assert(kl_lease_valid(h.lease));
	drop(&h);
	ck_assert_int_eq(tev_count(&h.ev, KL_EV_RELEASED), 1);
	waiter_join(&w);
	ck_assert_msg(w.rc == KL_OK, "%s: %s", kl_strerror(w.rc), w.message);
	hold_free(&w.h);
	hold_free(&h);
	kl_provider_free(p);
	acl_user(user, false, false);
}
END_TEST

START_TEST(test_unreachable)
{
	struct sockaddr_in a = { .sin_family = AF_INET };
	socklen_t len = sizeof a;
	char uri[256];
	int s = socket(AF_INET, SOCK_STREAM, 0);

	/* A port nobody listens on: bound, then closed. */
	a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	ck_assert_int_eq(bind(s, (struct sockaddr *)&a, sizeof a), 0);
	ck_assert_int_eq(getsockname(s, (struct sockaddr *)&a, &len), 0);
	close(s);
	snprintf(uri, sizeof uri, "redis://:Canary-x@127.0.0.1:%d/0",
		 ntohs(a.sin_port));
	open_fails(uri, KL_EPROVIDER, "connect", 1000);
}
END_TEST

START_TEST(test_bad_uris)
{
	static const char *const bad[] = {
		"redis://u:Canary-1@127.0.0.1:99999/0",
		"redis://u:Canary-2@127.0.0.1:6379/x",
		"redis://u:Canary-3@127.0.0.1:6379/0?pool=0",
		"redis://u:Canary-4@127.0.0.1:6379/0?ttl=5",
		"redis://u:Canary-5@127.0.0.1:6379/0?nosuch=1",
		"redis://u:Canary-6%zz@127.0.0.1:6379/0",
		"redis://u:Canary-7@[::1/0",
		"redis://u:Canary-8@127.0.0.1:6379/0?heartbeat=forever",
		/* A snapshot could not name the locks of this prefix: each
		 * detail would end at the NUL, before the key's digest. */
		"redis://u:Canary-9@127.0.0.1:6379/0?prefix=kl%00x:",
	};

	for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
		open_fails(bad[i], KL_EINVAL, "redis provider", 100);
	/* TLS (check_redis_tls tests it): an unusable CA file, or a build
	 * without TLS, is refused before connecting. */
	open_fails("rediss://u:Canary-10@127.0.0.1:6379/0?tls_ca=/nonexistent/"
		   "ca.pem",
		   KL_EPROVIDER, "redis provider", 1000);
}
END_TEST

/* kl_redis_provider_open itself, from the library kl_provider_open
 * loads. */
static int
open_direct(kl_provider **p, const char *uri, kl_error *err)
{
	const char *dir = getenv("KEYLOCK_PROVIDER_DIR");
	int (*fn)(kl_provider **, const char *, kl_error *);
	char path[PATH_MAX];
	void *h;

	snprintf(path, sizeof path, "%s/libkeylock-redis.so.0",
		 dir != NULL ? dir : ".");
	h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	ck_assert_msg(h != NULL, "dlopen %s: %s", path, dlerror());
	*(void **)&fn = dlsym(h, "kl_redis_provider_open");
	ck_assert_ptr_nonnull(fn);
	return fn(p, uri, err);
}

/* Schemes are case-insensitive, through kl_provider_open and directly;
 * an option given twice is refused with a message naming it. */
START_TEST(test_uri_case_and_duplicates)
{
	static const char *const scheme[] = { "REDIS", "Redis", "rEdIs" };
	char uri[1024];
	kl_provider *p;
	kl_error err;
	struct hold h;
	int rc;

	for (size_t i = 0; i < sizeof scheme / sizeof scheme[0]; i++) {
		uri_with(uri, sizeof uri, "restart_guard=0");
		memcpy(uri, scheme[i], 5);
		memset(&err, 0, sizeof err);
		rc = kl_provider_open(&p, uri, &err);
		ck_assert_msg(rc == KL_OK, "%s: %s: %s", uri, kl_strerror(rc),
			      err.message);
		take_ok(p, "case", 0, &h);
		hold_free(&h);
		kl_provider_free(p);
		rc = open_direct(&p, uri, &err);
		ck_assert_msg(rc == KL_OK, "direct %s: %s: %s", uri,
			      kl_strerror(rc), err.message);
		kl_provider_free(p);
	}
	/* uri_with gives prefix= already. */
	uri_with(uri, sizeof uri, "ttl=1s&restart_guard=0&ttl=2s");
	open_fails(uri, KL_EINVAL, "option ttl is given twice", 1000);
	uri_with(uri, sizeof uri, "prefix=other");
	open_fails(uri, KL_EINVAL, "option prefix is given twice", 1000);
	uri_with(uri, sizeof uri, "eviction=allow&pool=2&eviction=refuse");
	open_fails(uri, KL_EINVAL, "option eviction is given twice", 1000);
	/* Refused by the library itself too. */
	uri_with(uri, sizeof uri, "pool=2&pool=2");
	p = (kl_provider *)&p;
	ck_assert_int_eq(open_direct(&p, uri, &err), KL_EINVAL);
	ck_assert_ptr_null(p);
	ck_assert_ptr_nonnull(strstr(err.message, "option pool is given "
						  "twice"));
}
END_TEST

/* A KL_ETIMEDOUT says that the wait timed out, not what went wrong on the
 * way: here the server drops every connection during the wait, and the
 * waiter connects anew and waits on until its timeout. */
START_TEST(test_timeout_message)
{
	const char *kill_all[] = { "CLIENT", "KILL", "TYPE", "normal",
				   "SKIPME", "yes" };
	kl_provider *p = open_default(), *q = open_default();
	redisContext *c;
	struct waiter w;
	struct hold h;

	memset(&w, 0, sizeof w);
	take_ok(p, "tomsg", 0, &h);
	waiter_start(&w, q, "tomsg", 1500, NULL);
	wait_status(p, "tomsg", 1, 1);
	c = raw();
	ck_assert_int_ge(rint_cmd(c, 6, kill_all), 1);
	redisFree(c);
	waiter_join(&w);
	ck_assert_msg(w.rc == KL_ETIMEDOUT, "waiter: %s: %s",
		      kl_strerror(w.rc), w.message);
	ck_assert_msg(strstr(w.message, "not acquired within 1500 ms") !=
				      NULL &&
			      strstr(w.message, "redis provider") == NULL,
		      "the timeout says '%s'", w.message);
	hold_free(&w.h);
	hold_free(&h);
	kl_provider_free(p);
	kl_provider_free(q);
}
END_TEST

/* ------------------------------------------------------------------ */
/* A server that may evict keys                                        */

/* The server's maxmemory settings, put back after the eviction test, also
 * when it failed in its forked child (the runner's copies keep the
 * defaults of the stage's server, which the test checks). */
static char g_maxmemory[32] = "0", g_policy[64] = "noeviction";

static void
config_set(const char *name, const char *value)
{
	redisContext *c = raw_try(2000);
	redisReply *r;

	if (c == NULL)
		return;
	r = redisCommand(c, "CONFIG SET %s %s", name, value);
	if (r != NULL)
		freeReplyObject(r);
	redisFree(c);
}

static void
config_get(const char *name, char *buf, size_t size)
{
	redisContext *c = raw();
	redisReply *r = redisCommand(c, "CONFIG GET %s", name);

	ck_assert_msg(r != NULL && r->type == REDIS_REPLY_ARRAY &&
			      r->elements == 2,
		      "CONFIG GET %s", name);
	snprintf(buf, size, "%s", r->element[1]->str);
	freeReplyObject(r);
	redisFree(c);
}

static void
eviction_restore(void)
{
	config_set("maxmemory-policy", g_policy);
	config_set("maxmemory", g_maxmemory);
}

/* A server with maxmemory and a policy that may evict lock keys (every
 * one has an expiry, so volatile-* policies count too) is refused at
 * open, unless the URI says eviction=allow; noeviction, or no maxmemory,
 * is accepted. */
START_TEST(test_eviction_refused)
{
	static const char *const evicting[] = { "allkeys-random",
						"allkeys-lru", "volatile-lru",
						"volatile-ttl" };
	char uri[1024];
	kl_provider *p;
	struct hold h;

	config_get("maxmemory", g_maxmemory, sizeof g_maxmemory);
	config_get("maxmemory-policy", g_policy, sizeof g_policy);
	ck_assert_str_eq(g_policy, "noeviction");
	/* No maxmemory: Redis evicts nothing, whatever the policy. */
	config_set("maxmemory", "0");
	config_set("maxmemory-policy", "allkeys-random");
	p = open_default();
	kl_provider_free(p);
	config_set("maxmemory", "1gb");
	for (size_t i = 0; i < sizeof evicting / sizeof evicting[0]; i++) {
		config_set("maxmemory-policy", evicting[i]);
		uri_with(uri, sizeof uri, "restart_guard=0");
		open_fails(uri, KL_EPROVIDER, evicting[i], 5000);
		open_fails(uri, KL_EPROVIDER, "eviction=allow", 5000);
	}
	/* The escape hatch, documented. */
	p = open_opts("restart_guard=0&eviction=allow");
	take_ok(p, "evict", 0, &h);
	hold_free(&h);
	kl_provider_free(p);
	/* maxmemory with noeviction: writes fail when full, nothing is
	 * deleted. */
	config_set("maxmemory-policy", "noeviction");
	p = open_default();
	kl_provider_free(p);
	eviction_restore();
}
END_TEST

/* ------------------------------------------------------------------ */
/* A stalled server (SIGSTOP) and a restarted one                      */


/* With the server stopped, a waiter still returns close to its timeout,
 * and a holder sees its lease invalid no later than its ttl; all works
 * again once the server resumes. */
START_TEST(test_stalled_server)
{
	kl_provider *p = open_default(), *q = open_default();
	struct waiter w;
	struct hold h, t;
	int64_t t0, lost_ms;

	memset(&w, 0, sizeof w);
	take_ok(p, "stall", 1000, &h);
	waiter_start(&w, q, "stall", 800, NULL);
	wait_status(p, "stall", 1, 1);
	g_stopped = (pid_t)info_number("process_id");
	t0 = now_ns();
	ck_assert_int_eq(kill(g_stopped, SIGSTOP), 0);

	waiter_join(&w);
	ck_assert_msg(w.rc == KL_ETIMEDOUT || w.rc == KL_EPROVIDER,
		      "waiter: %s: %s", kl_strerror(w.rc), w.message);
	/* Its timeout, one BLPOP slice and 100 ms of grace, plus slack. */
	ck_assert_int_le((w.end_ns - w.start_ns) / 1000000, 800 + 150 + 350);
	test_poll(lease_invalid, h.lease, "the stalled lease to be invalid");
	lost_ms = (now_ns() - t0) / 1000000;
	ck_assert_int_le(lost_ms, 1000 + 300);

	ck_assert_int_eq(kill(g_stopped, SIGCONT), 0);
	g_stopped = 0;
	for (int i = 0; i < 1000 && tev_count(&h.ev, KL_EV_LOST) == 0; i++)
		test_sleep_ms(2);
	ck_assert_int_eq(tev_count(&h.ev, KL_EV_LOST), 1);
	hold_free(&w.h);
	drop(&h);
	hold_free(&h);
	/* The server works again: the key was lost with the stall. */
	take_ok(q, "stall", 0, &t);
	hold_free(&t);
	kl_provider_free(p);
	kl_provider_free(q);
}
END_TEST

/* An acquire that gave up against a stalled server leaves no grant
 * behind: the server runs the attempt it had not answered once it
 * resumes, which takes the free key for a token nobody has, and the
 * provider undoes that as soon as the server answers again.  Otherwise the
 * key would stay taken for the ttl (20 s), far longer than the next
 * acquire waits (5 s). */
START_TEST(test_stalled_late_grant)
{
	kl_provider *p = open_opts("restart_guard=0&ttl=20s"), *q;
	struct hold h, t;
	kl_error err;
	int rc;

	g_stopped = (pid_t)info_number("process_id");
	ck_assert_int_eq(kill(g_stopped, SIGSTOP), 0);
	rc = take(p, "late", 300, 0, NULL, &h, &err);
	ck_assert_msg(rc == KL_EPROVIDER || rc == KL_ETIMEDOUT, "%s: %s",
		      kl_strerror(rc), err.message);
	hold_free(&h);
	ck_assert_int_eq(kill(g_stopped, SIGCONT), 0);
	g_stopped = 0;

	q = open_default();
	rc = take(q, "late", 5000, 0, NULL, &t, &err);
	ck_assert_msg(rc == KL_OK, "the key is still taken: %s: %s",
		      kl_strerror(rc), err.message);
	/* Nothing of p's token is left: no queue entry, no heartbeat. */
	test_assert_status(q, "late", 1, 0);
	hold_free(&t);
	ck_assert_int_eq(count_keys(",:f,"), 1);
	kl_provider_free(q);
	kl_provider_free(p);
}
END_TEST

/* The same with a shared request: a shared grant the stalled server makes
 * to an acquire that gave up is undone too, or it would keep an exclusive
 * request out for its whole ttl (20 s). */
START_TEST(test_stalled_late_shared_grant)
{
	kl_provider *p = open_opts("restart_guard=0&ttl=20s"), *q;
	struct hold h, t;
	kl_error err;
	int rc;

	g_stopped = (pid_t)info_number("process_id");
	ck_assert_int_eq(kill(g_stopped, SIGSTOP), 0);
	rc = take_flags(p, "lates", 300, 0, NULL, KL_SHARED, &h, &err);
	ck_assert_msg(rc == KL_EPROVIDER || rc == KL_ETIMEDOUT, "%s: %s",
		      kl_strerror(rc), err.message);
	hold_free(&h);
	ck_assert_int_eq(kill(g_stopped, SIGCONT), 0);
	g_stopped = 0;

	q = open_default();
	rc = take(q, "lates", 5000, 0, NULL, &t, &err);
	ck_assert_msg(rc == KL_OK, "the key is still held shared: %s: %s",
		      kl_strerror(rc), err.message);
	test_assert_status(q, "lates", 1, 0);
	hold_free(&t);
	ck_assert_int_eq(count_keys(",:f,"), 1);
	kl_provider_free(q);
	kl_provider_free(p);
}
END_TEST

/* A waiter that gave up against a stalled server leaves the queue when the
 * server resumes, rather than block the waiters behind it for its
 * heartbeat (10 s here, more than the next acquire waits). */
START_TEST(test_stalled_waiter_leaves)
{
	kl_provider *p = open_opts("restart_guard=0&heartbeat=10s"), *q;
	struct waiter w;
	struct hold h, t;
	kl_error err;
	int rc;

	memset(&w, 0, sizeof w);
	q = open_default();
	take_ok(q, "gone", 0, &h);
	waiter_start(&w, p, "gone", 800, NULL);
	wait_status(q, "gone", 1, 1);
	g_stopped = (pid_t)info_number("process_id");
	ck_assert_int_eq(kill(g_stopped, SIGSTOP), 0);
	waiter_join(&w);
	ck_assert_msg(w.rc == KL_EPROVIDER || w.rc == KL_ETIMEDOUT,
		      "waiter: %s: %s", kl_strerror(w.rc), w.message);
	hold_free(&w.h);
	ck_assert_int_eq(kill(g_stopped, SIGCONT), 0);
	g_stopped = 0;

	drop(&h);
	rc = take(q, "gone", 5000, 0, NULL, &t, &err);
	ck_assert_msg(rc == KL_OK, "still queued behind the waiter: %s: %s",
		      kl_strerror(rc), err.message);
	test_assert_status(q, "gone", 1, 0);
	hold_free(&t);
	hold_free(&h);
	kl_provider_free(q);
	kl_provider_free(p);
}
END_TEST

/* Against a server that stopped answering, an acquire returns within the
 * grace (100 ms) after its timeout, plus scheduling delays: the least of
 * eight overshoots is below 190 ms.  (Connecting again after an attempt
 * that had used up the grace used to add another 100 ms every time.)  Each
 * try has a provider of its own, with a pooled connection made before the
 * stall. */
START_TEST(test_stalled_timeout_bound)
{
	enum { TRIES = 8, TIMEOUT_MS = 300 };
	kl_provider *p[TRIES];
	int64_t best = INT64_MAX, over;
	char key[16];
	struct hold h;
	kl_error err;
	int64_t t0;
	int rc;

	for (int i = 0; i < TRIES; i++)
		p[i] = open_default();
	g_stopped = (pid_t)info_number("process_id");
	ck_assert_int_eq(kill(g_stopped, SIGSTOP), 0);
	for (int i = 0; i < TRIES; i++) {
		snprintf(key, sizeof key, "bound%d", i);
		t0 = now_ns();
		rc = take(p[i], key, TIMEOUT_MS, 0, NULL, &h, &err);
		over = (now_ns() - t0) / 1000000 - TIMEOUT_MS;
		ck_assert_msg(rc == KL_EPROVIDER || rc == KL_ETIMEDOUT,
			      "%s: %s", kl_strerror(rc), err.message);
		hold_free(&h);
		ck_assert_int_ge(over, 0);
		if (over < best)
			best = over;
	}
	ck_assert_int_eq(kill(g_stopped, SIGCONT), 0);
	g_stopped = 0;
	ck_assert_msg(best < 190, "overshoot %lld ms", (long long)best);
	for (int i = 0; i < TRIES; i++)
		kl_provider_free(p[i]);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Server restart                                                      */

/* Starts redis-server on the test port as the stage did, detached from
 * this process's descriptors. */
static pid_t
server_start(const char *server, const char *port, const char *dir)
{
	char pidfile[PATH_MAX], logfile[PATH_MAX];
	pid_t pid;

	snprintf(pidfile, sizeof pidfile, "%s/redis.pid", dir);
	snprintf(logfile, sizeof logfile, "%s/redis-restarted.log", dir);
	pid = fork();
	ck_assert_int_ge(pid, 0);
	if (pid == 0) {
		/* Only async-signal-safe calls until exec. */
		int fd = open(logfile, O_WRONLY | O_CREAT | O_APPEND, 0600);
		int nul = open("/dev/null", O_RDONLY);

		if (fd < 0 || nul < 0)
			_exit(127);
		dup2(nul, 0);
		dup2(fd, 1);
		dup2(fd, 2);
		for (int i = 3; i < 1024; i++)
			close(i);
		setsid();
		execl(server, server, "--port", port, "--bind", "127.0.0.1",
		      "--save", "", "--appendonly", "no", "--daemonize", "no",
		      "--dir", dir, "--pidfile", pidfile, (char *)NULL);
		_exit(127);
	}
	return pid;
}

static bool
server_answers(void *arg)
{
	redisContext *c = raw_try(200);
	redisReply *r;
	bool ok = false;

	(void)arg;
	if (c == NULL)
		return false;
	r = redisCommand(c, "PING");
	ok = r != NULL && r->type == REDIS_REPLY_STATUS;
	if (r != NULL)
		freeReplyObject(r);
	redisFree(c);
	return ok;
}

static bool
server_gone(void *arg)
{
	redisContext *c = raw_try(200);

	(void)arg;
	if (c == NULL)
		return true;
	redisFree(c);
	return false;
}

START_TEST(test_restart)
{
	const char *server = getenv("KEYLOCK_TEST_REDIS_SERVER");
	const char *port = getenv("KEYLOCK_TEST_REDIS_PORT");
	const char *dir = getenv("KEYLOCK_TEST_REDIS_DIR");
	const char *opts = "ttl=1500ms&heartbeat=500ms";
	kl_provider *p, *q, *fresh;
	struct waiter w;
	struct hold h, t;
	kl_error err;
	int64_t t_up, lost_ms;
	uint64_t f1;
	pid_t pid, child;
	int rc;

	if (server == NULL || port == NULL || atoi(port) != g_port) {
		fprintf(stderr, "test_restart: KEYLOCK_TEST_REDIS_SERVER or "
				"KEYLOCK_TEST_REDIS_PORT unset: nothing "
				"done\n");
		return;
	}
	if (dir == NULL)
		dir = "/tmp";
	memset(&w, 0, sizeof w);
	/* The automatic guard holds 1.5 s from the first connection of this
	 * new prefix (it cannot be told from a flushed one): take_ok waits
	 * it out. */
	p = open_opts(opts);
	q = open_opts(opts);
	take_ok(p, "boot", 0, &h);
	f1 = kl_lease_fence(h.lease);
	waiter_start(&w, q, "boot", 2000, NULL);
	wait_status(p, "boot", 1, 1);

	pid = (pid_t)info_number("process_id");
	ck_assert_int_eq(kill(pid, SIGKILL), 0);
	test_poll(server_gone, NULL, "the server to die");
	test_sleep_ms(200);
	child = server_start(server, port, dir);
	test_poll(server_answers, NULL, "the restarted server");
	t_up = now_ns();

	/* The waiter ends by its timeout + slack, with a lease or
	 * KL_EPROVIDER, never hanging. */
	waiter_join(&w);
	ck_assert_msg(w.rc == KL_OK || w.rc == KL_EPROVIDER, "waiter: %s: %s",
		      kl_strerror(w.rc), w.message);
	ck_assert_int_le((w.end_ns - w.start_ns) / 1000000, 2000 + SLACK_MS);

	/* The old lease is lost within a renewal interval (500 ms). */
	test_poll(lease_invalid, h.lease, "the old lease to be lost");
	lost_ms = (now_ns() - t_up) / 1000000;
	ck_assert_int_le(lost_ms, 500 + SLACK_MS);
	for (int i = 0; i < 1000 && tev_count(&h.ev, KL_EV_LOST) == 0; i++)
		test_sleep_ms(2);
	ck_assert_int_eq(tev_count(&h.ev, KL_EV_LOST), 1);
	/* No double grant: the waiter got the key only after the old lease
	 * was known lost. */
	if (w.rc == KL_OK)
		ck_assert_int_ge(w.end_ns, h.ev.lost_ns);
	hold_free(&w.h);

	/* New grants wait for the guard (uptime >= the longest ttl): a
	 * try-once in it times out, saying why. */
	fresh = open_opts(opts);
	rc = take(fresh, "boot", 0, 0, NULL, &t, &err);
	if (info_number("uptime_in_seconds") < 1) {
		ck_assert_msg(rc == KL_ETIMEDOUT, "%s after a restart",
			      kl_strerror(rc));
		ck_assert_ptr_nonnull(strstr(err.message, "restart_guard"));
	} else if (rc == KL_OK) {
		drop(&t);
	}
	hold_free(&t);
	while (info_number("uptime_in_seconds") < 3)
		test_sleep_ms(100);
	take_ok(fresh, "boot", 0, &t);
	/* The fence still grows across the restart. */
	ck_assert_uint_gt(kl_lease_fence(t.lease), f1);
	hold_free(&t);
	drop(&h);
	ck_assert_int_eq(tev_count(&h.ev, KL_EV_RELEASE_FAILED), 1);
	hold_free(&h);
	kl_provider_free(fresh);
	kl_provider_free(p);
	kl_provider_free(q);
	/* The server stays up for later tests; the stage stops it through
	 * its pidfile. */
	(void)child;
}
END_TEST

/* ------------------------------------------------------------------ */
/* Key sets (issue 18): a property of the Lock strategy over Redis     */

/* Clients (each its own provider, so its own connections) taking the
 * same three keys as sets, each given them in another order (two exactly
 * opposite), all finish with every round done once and no two inside at
 * once.  Redis detects no deadlock: taken in the given order, two clients
 * soon hold one end each and wait for the other's until the 20 s
 * timeout of a round. */
START_TEST(test_set_orders_clients)
{
	enum { N = 4 };
	static const char *const keys[3] = { "set:a", "set:b", "set:c" };
	kl_provider *q[N], *p = open_default();

	for (int i = 0; i < N; i++)
		q[i] = open_default();
	test_sets_in_orders(q, N, keys, kl_test_scaled(30, 8));
	for (int i = 0; i < N; i++)
		kl_provider_free(q[i]);
	for (int k = 0; k < 3; k++)
		test_assert_status(p, keys[k], 0, 0);
	/* Only the three fence counters stay. */
	ck_assert_int_eq(count_keys(",:f,"), 3);
	kl_provider_free(p);
}
END_TEST

/* kl_lock_acquire_many in a thread of its own (test_bg). */
struct set_call {
	kl_lock *l;
	const char *const *keys;
	size_t n;
	int rc;
	kl_lease *lease;
	kl_error err;
};

static void
set_call_main(void *arg)
{
	struct set_call *c = arg;

	c->rc = kl_lock_acquire_many(c->l, c->keys, c->n, NULL, &c->lease,
				     &c->err);
}

static int
set_fn_never(kl_lease *lease, void *arg)
{
	(void)lease;
	(void)arg;
	ck_abort_msg("the function of a failed set ran");
	return 0;
}

/* All or nothing on timeout: a set whose second key (canonical order)
 * another client holds takes the first, waits out its deadline on the
 * second and gives the first back: no holder of the first key seen from
 * the server (status through another client, and that client's try-once
 * succeeds), no lease, the error names the second key, one ACQUIRED and
 * one RELEASED for the first key, one REJECTED. */
START_TEST(test_set_timeout_holds_nothing)
{
	const char *first = "set:first", *second = "set:second";
	const char *keys[] = { second, first };
	kl_provider *p = open_default(), *q = open_default(),
		    *t = open_default();
	struct test_events ev;
	kl_lock *l = test_set_lock(p, 400, 0, &ev);
	kl_lease *lease = (kl_lease *)&lease;
	struct hold hs, hf;
	kl_error err;
	int rc, r = -1;

	take_ok(q, second, 0, &hs);
	memset(&err, 0, sizeof err);
	rc = kl_lock_acquire_many(l, keys, 2, NULL, &lease, &err);
	ck_assert_msg(rc == KL_ETIMEDOUT, "set: %s: %s", kl_strerror(rc),
		      err.message);
	ck_assert_ptr_null(lease);
	ck_assert_msg(strstr(err.message, second) != NULL, "message: %s",
		      err.message);
	ck_assert_int_eq(tev_count(&ev, KL_EV_ACQUIRED), 1);
	ck_assert_int_eq(tev_count(&ev, KL_EV_RELEASED), 1);
	ck_assert_int_eq(tev_count(&ev, KL_EV_REJECTED), 1);
	test_assert_status(t, first, 0, 0);
	wait_status(t, second, 1, 0);

	rc = kl_lock_run_many(l, keys, 2, NULL, set_fn_never, NULL, &r, &err);
	ck_assert_msg(rc == KL_ETIMEDOUT, "run_many: %s", kl_strerror(rc));
	ck_assert_int_eq(r, -1);
	test_assert_status(t, first, 0, 0);

	rc = take(t, first, 0, 0, NULL, &hf, &err);
	ck_assert_msg(rc == KL_OK, "third party try-once: %s: %s",
		      kl_strerror(rc), err.message);
	hold_free(&hf);
	hold_free(&hs);
	kl_lock_free(l);
	kl_provider_free(p);
	kl_provider_free(q);
	kl_provider_free(t);
}
END_TEST

/* Releases the struct hold arg after 2 s (a duration under test). */
static void *
release_later(void *arg)
{
	test_sleep_ms(2000);
	drop(arg);
	return NULL;
}

/* One deadline for the set: the first key is held by another client for
 * 2 s of the set's 3 s, the last key for longer; the set ends
 * KL_ETIMEDOUT about 3 s after it began (not 3 s after it began to wait
 * for the last key, 5 s), holding nothing; its keys and fences are in
 * the canonical order when it is granted. */
START_TEST(test_set_one_deadline)
{
	const char *keys[] = { "set:d3", "set:d2", "set:d1" };
	kl_provider *p = open_default(), *q = open_default();
	struct test_events ev;
	kl_lock *l = test_set_lock(p, 3000, 0, &ev);
	struct hold h1, h3;
	kl_lease *lease = NULL;
	pthread_t t;
	kl_error err;
	int64_t t0, ms;
	int rc;

	take_ok(q, "set:d1", 0, &h1);
	take_ok(q, "set:d3", 0, &h3);
	t0 = now_ns();
	/* The set waits on set:d1 here; another thread releases it 2 s
	 * into the set's 3 s. */
	test_thread_start(&t, release_later, &h1);
	rc = kl_lock_acquire_many(l, keys, 3, NULL, &lease, &err);
	ms = (now_ns() - t0) / 1000000;
	test_thread_join(t);
	ck_assert_msg(rc == KL_ETIMEDOUT, "set: %s: %s", kl_strerror(rc),
		      err.message);
	ck_assert_ptr_null(lease);
	ck_assert_int_ge(ms, 3000);
	ck_assert_msg(ms < 4500, "the set took %lld ms", (long long)ms);
	ck_assert_int_eq(tev_count(&ev, KL_EV_ACQUIRED), 2);
	ck_assert_int_eq(tev_count(&ev, KL_EV_RELEASED), 2);
	test_assert_status(q, "set:d1", 0, 0);
	test_assert_status(q, "set:d2", 0, 0);
	wait_status(q, "set:d3", 1, 0);
	hold_free(&h3);

	rc = kl_lock_acquire_many(l, keys, 3, NULL, &lease, &err);
	ck_assert_msg(rc == KL_OK, "set: %s: %s", kl_strerror(rc),
		      err.message);
	ck_assert_uint_eq(kl_lease_count(lease), 3);
	for (size_t i = 0; i < 3; i++) {
		ck_assert_str_eq(kl_lease_key_at(lease, i), keys[2 - i]);
		ck_assert_uint_gt(kl_lease_fence_at(lease, i), 0);
		test_assert_status(q, keys[i], 1, 0);
	}
	kl_lease_release(lease);
	for (size_t i = 0; i < 3; i++)
		test_assert_status(q, keys[i], 0, 0);
	hold_free(&h1);
	kl_lock_free(l);
	kl_provider_free(p);
	kl_provider_free(q);
}
END_TEST

/* A set that fails because the server stops under it leaves nothing
 * held once the server is back: the set holds its first key and waits
 * for its second (held by another client) when the server is stopped;
 * the set ends (KL_ETIMEDOUT or KL_EPROVIDER) within its deadline plus
 * the provider's bounds, without a lease; after SIGCONT the first key
 * has no holder long before its ttl (60 s) could have freed it, the
 * second has only its own holder, and a try-once on the first
 * succeeds. */
START_TEST(test_set_server_stopped)
{
	const char *first = "set:stop1", *second = "set:stop2";
	const char *keys[] = { first, second };
	kl_provider *p = open_opts("restart_guard=0&ttl=60s"),
		    *q = open_opts("restart_guard=0&ttl=60s");
	struct test_events ev;
	kl_lock *l = test_set_lock(p, 2500, 0, &ev);
	struct set_call *c = calloc(1, sizeof *c);
	struct hold hs, hf;
	struct test_bg bg;
	kl_error err;
	int rc;

	ck_assert_ptr_nonnull(c);
	take_ok(q, second, 0, &hs);
	c->l = l;
	c->keys = keys;
	c->n = 2;
	c->rc = 1;
	test_bg_start(&bg, set_call_main, c);
	wait_status(q, second, 1, 1);
	test_assert_status(q, first, 1, 0);
	g_stopped = (pid_t)info_number("process_id");
	ck_assert_int_eq(kill(g_stopped, SIGSTOP), 0);
	test_bg_join(&bg, "the set to give up on the stopped server");
	ck_assert_msg(c->rc == KL_ETIMEDOUT || c->rc == KL_EPROVIDER,
		      "set: %s: %s", kl_strerror(c->rc), c->err.message);
	ck_assert_ptr_null(c->lease);
	ck_assert_int_eq(kill(g_stopped, SIGCONT), 0);
	g_stopped = 0;
	test_wait_status(q, first, 0, 0, 20000);
	wait_status(q, second, 1, 0);
	ck_assert(kl_lease_valid(hs.lease));
	rc = take(q, first, 0, 0, NULL, &hf, &err);
	ck_assert_msg(rc == KL_OK, "try-once on the first key: %s: %s",
		      kl_strerror(rc), err.message);
	hold_free(&hf);
	hold_free(&hs);
	kl_lock_free(l);
	free(c);
	kl_provider_free(p);
	kl_provider_free(q);
}
END_TEST

/* A release the stopped server did not answer is left to the renewal
 * thread, which must not then sit in a new connection's whole timeout (4 s
 * here) against the silent server: that held up kl_provider_free (and the
 * renewals and lost callbacks of other leases) for the timeout.  It waits
 * for the release's own connection in short slices instead. */
START_TEST(test_release_unanswered_free_prompt)
{
	/* A timeout far above the bound below: the old renewal thread took
	 * nearly all of it, the fixed one a few 50 ms slices, and a loaded
	 * machine must not bring the two together. */
	kl_provider *p = open_opts("restart_guard=0&timeout=10s&ttl=60s");
	struct hold h;
	int64_t t0, free_ms;

	take_ok(p, "relfree", 0, &h);
	g_stopped = (pid_t)info_number("process_id");
	ck_assert_int_eq(kill(g_stopped, SIGSTOP), 0);
	drop(&h);
	ck_assert_int_eq(tev_count(&h.ev, KL_EV_RELEASE_FAILED), 1);
	/* Time for the renewal thread to take up the release (a free before
	 * that only lets the test pass). */
	test_sleep_ms(300);
	t0 = now_ns();
	kl_lock_free(h.l);
	kl_provider_free(p);
	free_ms = (now_ns() - t0) / 1000000;
	ck_assert_int_eq(kill(g_stopped, SIGCONT), 0);
	g_stopped = 0;
	ck_assert_msg(free_ms < 5000,
		      "kl_provider_free took %lld ms: the renewal thread was "
		      "stuck connecting to the stopped server",
		      (long long)free_ms);
}
END_TEST

static TCase *
tcase_new(Suite *s, const char *name, int timeout)
{
	return test_tcase(s, name, timeout, setup, teardown);
}

static Suite *
provider_redis_suite(void)
{
	Suite *s = suite_create("provider_redis");
	TCase *tc;

	tc = tcase_new(s, "basic", 60);
	tcase_add_test(tc, test_sha256_vectors);
	tcase_add_test(tc, test_exports);
	tcase_add_test(tc, test_acquire_release);
	tcase_add_test(tc, test_binary_keys);
	tcase_add_test(tc, test_errorcheck_refused);
	tcase_add_test(tc, test_ttl_out_of_range);

	tc = tcase_new(s, "fifo", 120);
	tcase_add_test(tc, test_fifo_threads);
	tcase_add_test(tc, test_mutual_exclusion_processes);

	tc = tcase_new(s, "waits", 60);
	tcase_add_test(tc, test_timeout);
	tcase_add_test(tc, test_try_once);
	tcase_add_test(tc, test_cancel);
	tcase_add_test(tc, test_timeout_message);

	tc = tcase_new(s, "dead", 60);
	tcase_add_test(tc, test_holder_killed);
	tcase_add_test(tc, test_dead_waiter_at_head);

	tc = tcase_new(s, "ownership", 60);
	tcase_add_test(tc, test_foreign_release);
	tcase_add_test(tc, test_external_del_is_lost);
	tcase_add_test(tc, test_renewal_keeps_lease);
	tcase_add_test(tc, test_fence_increasing);
	tcase_add_test(tc, test_fork_child_connects_anew);

	tc = tcase_new(s, "shared", 120);
	tcase_add_test(tc, test_shared_together);
	tcase_add_test(tc, test_shared_queue_order);
	tcase_add_test(tc, test_shared_behind_timed_out_exclusive);
	tcase_add_test(tc, test_shared_holder_expires);
	tcase_add_test(tc, test_shared_dead_holder_swept);
	tcase_add_test(tc, test_shared_holder_paused);
	tcase_add_test(tc, test_shared_try_once);
	tcase_add_test(tc, test_shared_fences_mixed);
	tcase_add_test(tc, test_shared_exclusion_processes);
	tcase_add_test(tc, test_snapshot);
	tcase_add_test(tc, test_snapshot_after_idle_close);
	tcase_add_test(tc, test_snapshot_hostile_prefix);
	tc = tcase_new(s, "sets", 300);
	tcase_add_test(tc, test_set_orders_clients);
	tcase_add_test(tc, test_set_timeout_holds_nothing);
	tcase_add_test(tc, test_set_one_deadline);
	tc = tcase_new(s, "secrets", 60);
	tcase_add_test(tc, test_auth);
	tcase_add_test(tc, test_restricted_acl_user);
	tcase_add_test(tc, test_unreachable);
	tcase_add_test(tc, test_bad_uris);
	tcase_add_test(tc, test_uri_case_and_duplicates);

	tc = tcase_new(s, "eviction", 60);
	tcase_add_unchecked_fixture(tc, NULL, eviction_restore);
	tcase_add_test(tc, test_eviction_refused);

	/* Last: they stop and restart the server. */
	tc = tcase_new(s, "server", 60);
	tcase_add_unchecked_fixture(tc, NULL, resume_server);
	tcase_add_test(tc, test_stalled_server);
	tcase_add_test(tc, test_stalled_late_grant);
	tcase_add_test(tc, test_stalled_late_shared_grant);
	tcase_add_test(tc, test_stalled_waiter_leaves);
	tcase_add_test(tc, test_stalled_timeout_bound);
	tcase_add_test(tc, test_set_server_stopped);
	tcase_add_test(tc, test_release_unanswered_free_prompt);
	tcase_add_test(tc, test_restart);

	return s;
}

int
main(void)
{
	redisContext *c;
	long long pid;

	g_uri = getenv("KEYLOCK_TEST_REDIS_URI");
	if (g_uri == NULL || g_uri[0] == '\0') {
		printf("SKIP: KEYLOCK_TEST_REDIS_URI is not set (tools/test "
		       "--only redis starts a server)\n");
		return 77;
	}
	if (!parse_base()) {
		printf("SKIP: KEYLOCK_TEST_REDIS_URI must be "
		       "redis://HOST:PORT/DB (no password)\n");
		return 77;
	}
	if ((c = raw_try(1000)) == NULL) {
		printf("SKIP: no Redis server answers at %s:%d\n", g_host,
		       g_port);
		return 77;
	}
	redisFree(c);
	if (info_try("process_id", &pid))
		g_server_pid = (pid_t)pid;
	test_provider_dir();
	return test_run_suite(provider_redis_suite());
}
