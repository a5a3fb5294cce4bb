/* SPDX-License-Identifier: MIT */
/*
 * Chaos tests of the Redis provider (TESTPLAN T21, T22, T23) against real
 * redis-server processes that this suite starts, kills (SIGKILL), pauses
 * (SIGSTOP) and partitions (through a TCP proxy of its own) itself.  The
 * program comes from KEYLOCK_TEST_REDIS_SERVER (tools/test stage redis sets
 * it); without it the suite exits 77 (skip).  Each server listens on
 * 127.0.0.1 on a free port below the ephemeral range, in a temporary
 * folder of its own, and dies with the test (PR_SET_PDEATHSIG).
 *
 * T21: 16 holders (ttl 3 s, renewed) and 16 queued waiters (timeout 2 s)
 * on 16 keys; the server is killed with SIGKILL and restarted 0.2 s later,
 * 50 cycles, with appendfsync always and without persistence, both modes
 * at once; then 10 cycles restarting from a snapshot taken before the
 * cycle's grants (fences and locks rolled back) and from a wiped data
 * folder of an appendfsync always server, also at once.  Restarts that
 * lose data, one property each (issue 16): fences after a snapshot
 * restart; a wiped durable server; the guard covering the longest ttl of
 * any client; a fresh server making acquires wait, not fail.  T22: the
 * server paused for twice the ttl; a 1 s black hole
 * between some clients and the server; a black hole armed to swallow the
 * reply of a grant; 8 clients doing read-modify-write of a set in a side
 * store with 0-200 ms latency, with fencing (0 lost updates) and without
 * (lost updates must be seen: the harness is sensitive); a SIGUSR1 storm
 * (every 20 ms, no SA_RESTART) on the waiting threads.  T23: 10^4
 * releases, renewals, leaves and attempts with wrong or stale tokens, sent
 * with the provider's own scripts on a raw connection; external PEXPIRE
 * and DEL; 10^4 grants by 8 clients with strictly increasing fences, also
 * across a restart with appendfsync always.
 *
 * Safety is judged by a ledger shared by every client of a test: each grant
 * is recorded with its fence and its interval [returned, last moment the
 * holder saw kl_lease_valid() true] on CLOCK_MONOTONIC; intervals of one
 * key must never overlap, fences must grow with every grant, and a fenced
 * side store rejects writes with a fence lower than the highest it saw.
 *
 * Worker and driver threads never call ck_assert*: they note failures
 * (fail_note), and the test's thread asserts that there were none.  Time
 * bounds are the documented ones plus slack for a loaded 2-CPU machine.
 * KL_TEST_SCALE scales cycles, operations and durations.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif

#include <arpa/inet.h>
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <hiredis.h>

#include "keylock.h"
#include "redis/redis_internal.h" /* the provider's scripts and key digest */
#include "../util.h"

#define MS (INT64_C(1000000))
/* Scheduling slack on a loaded machine, added to documented bounds. */
#define SLACK_MS 1000
/* The provider's promise: a wait's commands end by its deadline + this. */
#define GRACE_MS 100
/* Extra allowance for a thread to be scheduled after its deadline (a
 * 2-CPU machine at load 20 stalls whole processes for 700 ms). */
#define SCHED_MS 1000

static const char *g_server_bin;

/* ------------------------------------------------------------------ */
/* Failures noted by any thread                                        */

static struct {
	pthread_mutex_t mu;
	int n;
	char first[4][320];
} g_fails = { .mu = PTHREAD_MUTEX_INITIALIZER };

static void
fail_note(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

static void
fail_note(const char *fmt, ...)
{
	va_list ap;

	pthread_mutex_lock(&g_fails.mu);
	if (g_fails.n < 50) {
		char msg[320];

		va_start(ap, fmt);
		vsnprintf(msg, sizeof msg, fmt, ap);
		va_end(ap);
		printf("FAILURE: %s\n", msg);
		if (g_fails.n < 4)
			memcpy(g_fails.first[g_fails.n], msg, sizeof msg);
	}
	g_fails.n++;
	pthread_mutex_unlock(&g_fails.mu);
}

static void
fails_reset(void)
{
	pthread_mutex_lock(&g_fails.mu);
	g_fails.n = 0;
	pthread_mutex_unlock(&g_fails.mu);
}

/* Test thread only. */
static void
fails_assert(void)
{
	int n;

	pthread_mutex_lock(&g_fails.mu);
	n = g_fails.n;
	pthread_mutex_unlock(&g_fails.mu);
	ck_assert_msg(n == 0, "%d failures: %s | %s | %s | %s", n,
		      g_fails.first[0], n > 1 ? g_fails.first[1] : "",
		      n > 2 ? g_fails.first[2] : "",
		      n > 3 ? g_fails.first[3] : "");
}

/* ------------------------------------------------------------------ */
/* Servers of our own                                                  */

struct srv {
	pid_t pid;
	int port;
	bool aof;
	char dir[PATH_MAX];
	int64_t spawned_ns; /* the current run started no earlier */
	int runs;
};

static redisContext *
connect_port(int port, int timeout_ms)
{
	struct timeval tv = { timeout_ms / 1000, (timeout_ms % 1000) * 1000 };
	redisContext *c = redisConnectWithTimeout("127.0.0.1", port, tv);

	if (c == NULL || c->err != 0) {
		if (c != NULL)
			redisFree(c);
		return NULL;
	}
	redisSetTimeout(c, (struct timeval){ 5, 0 });
	return c;
}

static bool
ping_port(int port)
{
	redisContext *c = connect_port(port, 200);
	redisReply *r;
	bool ok;

	if (c == NULL)
		return false;
	r = redisCommand(c, "PING");
	ok = r != NULL && r->type == REDIS_REPLY_STATUS;
	if (r != NULL)
		freeReplyObject(r);
	redisFree(c);
	return ok;
}

/* test_server_spawn's ready: arg is the port. */
static bool
ping_ready(void *arg)
{
	return ping_port(*(const int *)arg);
}

/* Starts one run of s on s->port; false when it did not answer (the port
 * may have been taken meanwhile). */
static bool
srv_spawn(struct srv *s)
{
	char port[16], log[PATH_MAX + 16];
	char *argv[24];
	int n = 0;
	pid_t pid;

	snprintf(port, sizeof port, "%d", s->port);
	snprintf(log, sizeof log, "%s/redis.log", s->dir);
	argv[n++] = (char *)g_server_bin;
	argv[n++] = (char *)"--port";
	argv[n++] = port;
	argv[n++] = (char *)"--bind";
	argv[n++] = (char *)"127.0.0.1";
	argv[n++] = (char *)"--save";
	argv[n++] = (char *)"";
	argv[n++] = (char *)"--appendonly";
	argv[n++] = (char *)(s->aof ? "yes" : "no");
	if (s->aof) {
		argv[n++] = (char *)"--appendfsync";
		argv[n++] = (char *)"always";
	}
	argv[n++] = (char *)"--daemonize";
	argv[n++] = (char *)"no";
	argv[n++] = (char *)"--dir";
	argv[n++] = s->dir;
	argv[n++] = (char *)"--logfile";
	argv[n++] = log;
	argv[n] = NULL;
	s->spawned_ns = now_ns();
	s->runs++;
	pid = test_server_spawn(argv, ping_ready, &s->port, 10000);
	s->pid = pid > 0 ? pid : 0;
	return pid > 0;
}

/* A new server in a folder of its own on a free port; any thread. */
static bool
srv_start(struct srv *s, bool aof)
{
	const char *tmp = getenv("TMPDIR");

	memset(s, 0, sizeof *s);
	s->aof = aof;
	snprintf(s->dir, sizeof s->dir, "%s/keylock-chaos.XXXXXX",
		 tmp != NULL && tmp[0] != '\0' ? tmp : "/tmp");
	if (mkdtemp(s->dir) == NULL)
		return false;
	for (int i = 0; i < 5; i++) {
		if ((s->port = test_free_port()) > 0 && srv_spawn(s))
			return true;
	}
	return false;
}

static void
srv_kill(struct srv *s)
{
	if (s->pid > 0) {
		kill(s->pid, SIGCONT);
		kill(s->pid, SIGKILL);
		waitpid(s->pid, NULL, 0);
		s->pid = 0;
	}
}

/* Starts the server again on its port and folder (AOF reloads). */
static bool
srv_restart(struct srv *s)
{
	for (int i = 0; i < 20; i++) {
		if (srv_spawn(s))
			return true;
		test_sleep_ms(100);
	}
	return false;
}

static void
srv_stop(struct srv *s)
{
	srv_kill(s);
	if (s->dir[0] != '\0')
		test_remove_tree(s->dir);
	s->dir[0] = '\0';
}

/* A snapshot (SAVE) of s's data into its folder, which a restart loads
 * (without AOF); false, noted, when it failed. */
static bool
srv_save(struct srv *s)
{
	redisContext *c = connect_port(s->port, 2000);
	redisReply *r = c != NULL ? redisCommand(c, "SAVE") : NULL;
	bool ok = r != NULL && r->type == REDIS_REPLY_STATUS;

	if (!ok)
		fail_note("SAVE on port %d failed: %s", s->port,
			  r != NULL && r->str != NULL ? r->str : "no reply");
	if (r != NULL)
		freeReplyObject(r);
	if (c != NULL)
		redisFree(c);
	return ok;
}

/* Deletes the data a stopped s left (AOF folder, snapshot): the next run
 * starts empty, as after a lost volume. */
static void
srv_wipe(struct srv *s)
{
	char path[PATH_MAX + 32];

	snprintf(path, sizeof path, "%s/appendonlydir", s->dir);
	test_remove_tree(path);
	snprintf(path, sizeof path, "%s/appendonly.aof", s->dir);
	remove(path);
	snprintf(path, sizeof path, "%s/dump.rdb", s->dir);
	remove(path);
}

/* The server under test, for the checked teardown. */
static struct srv g_srv[2];

static void
setup(void)
{
	fails_reset();
	memset(g_srv, 0, sizeof g_srv);
}

static void
teardown(void)
{
	srv_stop(&g_srv[0]);
	srv_stop(&g_srv[1]);
}

/* ------------------------------------------------------------------ */
/* Providers, locks, events                                            */

static kl_provider *
open_port(int port, const char *prefix, const char *opts)
{
	char uri[512];
	kl_provider *p = NULL;
	kl_error err;
	int rc;

	snprintf(uri, sizeof uri, "redis://127.0.0.1:%d/0?prefix=%s&%s", port,
		 prefix, opts);
	memset(&err, 0, sizeof err);
	rc = kl_provider_open(&p, uri, &err);
	if (rc != KL_OK) {
		fail_note("kl_provider_open %s: %s: %s", uri, kl_strerror(rc),
			  err.message);
		return NULL;
	}
	return p;
}

static kl_lock *
lock_make_flags(kl_provider *p, const char *key, int64_t timeout_ms,
		int64_t ttl_ms, unsigned flags, struct test_events *ev)
{
	kl_lock_opts o = KL_LOCK_OPTS_INIT;
	kl_lock *l = NULL;

	tev_init(ev);
	o.flags = flags;
	o.provider = p;
	o.key = key;
	o.timeout_ms = timeout_ms;
	o.ttl_ms = ttl_ms;
	o.on_event = tev_record;
	o.event_arg = ev;
	if (kl_lock_new(&l, &o) != KL_OK)
		fail_note("kl_lock_new failed");
	return l;
}

static kl_lock *
lock_make(kl_provider *p, const char *key, int64_t timeout_ms, int64_t ttl_ms,
	  struct test_events *ev)
{
	return lock_make_flags(p, key, timeout_ms, ttl_ms, 0, ev);
}

/* The Redis key name the provider uses for key (suffix "", ":q", ...). */
static void
key_name(char *buf, size_t size, const char *prefix, const char *key,
	 const char *suffix)
{
	char hex[65];

	kl__redis_sha256_hex(key, strlen(key), hex);
	snprintf(buf, size, "%s{%s}%s", prefix, hex, suffix);
}

/* ------------------------------------------------------------------ */
/* The ledger: grants, intervals, fences and a fenced side store        */

#define LEDGER_KEYS 16

struct grant {
	int key;
	int epoch;
	uint64_t fence;
	int64_t g_ns; /* acquire returned */
	int64_t e_ns; /* last time kl_lease_valid() was seen true (0: never) */
};

struct ledger {
	pthread_mutex_t mu;
	struct grant *g;
	size_t n, cap;
	uint64_t high[LEDGER_KEYS]; /* side store: highest fence written */
	long writes, rejected;
};

static void
ledger_init(struct ledger *L)
{
	memset(L, 0, sizeof *L);
	pthread_mutex_init(&L->mu, NULL);
}

static void
ledger_free(struct ledger *L)
{
	free(L->g);
	L->g = NULL;
}

static int
ledger_grant(struct ledger *L, int key, int epoch, uint64_t fence,
	     int64_t g_ns)
{
	int i = -1;

	pthread_mutex_lock(&L->mu);
	if (L->n == L->cap) {
		size_t cap = L->cap ? 2 * L->cap : 1024;
		struct grant *g = realloc(L->g, cap * sizeof *g);

		if (g != NULL) {
			L->g = g;
			L->cap = cap;
		}
	}
	if (L->n < L->cap) {
		i = (int)L->n++;
		L->g[i] = (struct grant){ key, epoch, fence, g_ns, 0 };
	}
	pthread_mutex_unlock(&L->mu);
	if (i < 0)
		fail_note("ledger: out of memory");
	return i;
}

/* The holder of grant i saw its lease valid at t (taken before the
 * check). */
static void
ledger_valid(struct ledger *L, int i, int64_t t)
{
	if (i < 0)
		return;
	pthread_mutex_lock(&L->mu);
	if (t > L->g[i].e_ns)
		L->g[i].e_ns = t;
	pthread_mutex_unlock(&L->mu);
}

/* A write to the fenced side store; false when rejected. */
static bool
ledger_write(struct ledger *L, int key, uint64_t fence)
{
	bool ok;

	pthread_mutex_lock(&L->mu);
	ok = fence >= L->high[key];
	if (ok) {
		L->high[key] = fence;
		L->writes++;
	} else {
		L->rejected++;
	}
	pthread_mutex_unlock(&L->mu);
	return ok;
}

static int
grant_cmp(const void *a, const void *b)
{
	const struct grant *x = a, *y = b;

	if (x->key != y->key)
		return x->key < y->key ? -1 : 1;
	if (x->g_ns != y->g_ns)
		return x->g_ns < y->g_ns ? -1 : 1;
	return 0;
}

/* Per key, in the order of grant: no interval overlaps an earlier one and
 * the fence grows (within an epoch; across epochs too when across).
 * Returns the number of overlaps found. */
static long
ledger_check(struct ledger *L, const char *what, bool across)
{
	long overlaps = 0, fence_bad = 0;

	pthread_mutex_lock(&L->mu);
	qsort(L->g, L->n, sizeof *L->g, grant_cmp);
	for (size_t i = 0; i < L->n;) {
		size_t j = i;
		int64_t max_end = INT64_MIN;
		uint64_t last = 0;
		int last_epoch = -1;

		while (j < L->n && L->g[j].key == L->g[i].key) {
			struct grant *g = &L->g[j];

			if (g->e_ns >= g->g_ns) {
				if (g->g_ns <= max_end) {
					if (overlaps++ == 0)
						fail_note(
							"%s: key %d granted "
							"at %" PRId64
							" ms while a holder "
							"saw its lease valid "
							"until %" PRId64
							" ms",
							what, g->key,
							g->g_ns / MS,
							max_end / MS);
				}
				if (g->e_ns > max_end)
					max_end = g->e_ns;
			}
			if ((across || g->epoch == last_epoch) &&
			    g->fence <= last) {
				if (fence_bad++ == 0)
					fail_note("%s: key %d: fence %" PRIu64
						  " granted after %" PRIu64,
						  what, g->key, g->fence,
						  last);
			}
			last = g->fence;
			last_epoch = g->epoch;
			j++;
		}
		i = j;
	}
	if (L->rejected != 0)
		fail_note("%s: the fenced store rejected %ld writes of holders "
			  "that saw their lease valid",
			  what, L->rejected);
	pthread_mutex_unlock(&L->mu);
	return overlaps;
}

/* ------------------------------------------------------------------ */
/* A SIGUSR1 storm on chosen threads                                    */

static atomic_long g_usr1;

static void
on_usr1(int sig)
{
	(void)sig;
	atomic_fetch_add(&g_usr1, 1);
}

#define STORM_MAX 32

struct storm {
	pthread_mutex_t mu;
	pthread_t th;
	pthread_t target[STORM_MAX];
	bool on[STORM_MAX];
	atomic_bool stop;
	long sent;
};

static void *
storm_main(void *arg)
{
	struct storm *s = arg;

	while (!atomic_load(&s->stop)) {
		pthread_mutex_lock(&s->mu);
		for (int i = 0; i < STORM_MAX; i++) {
			if (s->on[i] &&
			    pthread_kill(s->target[i], SIGUSR1) == 0)
				s->sent++;
		}
		pthread_mutex_unlock(&s->mu);
		test_sleep_ms(20);
	}
	return NULL;
}

static void
storm_start(struct storm *s)
{
	struct sigaction sa;

	memset(s, 0, sizeof *s);
	pthread_mutex_init(&s->mu, NULL);
	memset(&sa, 0, sizeof sa);
	sa.sa_handler = on_usr1;
	sigemptyset(&sa.sa_mask);
	sa.sa_flags = 0; /* no SA_RESTART: system calls see EINTR */
	sigaction(SIGUSR1, &sa, NULL);
	test_thread_start(&s->th, storm_main, s);
}

/* The calling thread joins (slot i) or leaves the storm. */
static void
storm_join(struct storm *s, int i)
{
	if (s == NULL)
		return;
	pthread_mutex_lock(&s->mu);
	s->target[i] = pthread_self();
	s->on[i] = true;
	pthread_mutex_unlock(&s->mu);
}

static void
storm_leave(struct storm *s, int i)
{
	if (s == NULL)
		return;
	pthread_mutex_lock(&s->mu);
	s->on[i] = false;
	pthread_mutex_unlock(&s->mu);
}

static long
storm_stop(struct storm *s)
{
	atomic_store(&s->stop, true);
	test_thread_join(s->th);
	return s->sent;
}

/* ------------------------------------------------------------------ */
/* A TCP proxy that can black-hole traffic                              */

enum { BH_OFF, BH_ON, BH_ARMED };

#define PROXY_PAIRS 128

struct proxy {
	int lfd, port, target;
	pthread_t th;
	atomic_int mode;        /* BH_* */
	atomic_bool stop;
	atomic_llong armed_ns;  /* when an armed black hole began */
	int fd[PROXY_PAIRS][2]; /* client side, server side; -1 unused */
};

static void
write_all(int fd, const char *p, size_t n)
{
	while (n > 0) {
		ssize_t w = write(fd, p, n);

		if (w < 0 && errno == EINTR)
			continue;
		if (w <= 0)
			return;
		p += w;
		n -= (size_t)w;
	}
}

static void *
proxy_main(void *arg)
{
	struct proxy *x = arg;
	static char buf[65536];

	while (!atomic_load(&x->stop)) {
		struct pollfd pfd[1 + 2 * PROXY_PAIRS];
		int map[1 + 2 * PROXY_PAIRS][2], n = 1;

		pfd[0] = (struct pollfd){ .fd = x->lfd, .events = POLLIN };
		for (int i = 0; i < PROXY_PAIRS; i++) {
			if (x->fd[i][0] < 0)
				continue;
			for (int s = 0; s < 2; s++) {
				pfd[n] = (struct pollfd){ .fd = x->fd[i][s],
							  .events = POLLIN };
				map[n][0] = i;
				map[n][1] = s;
				n++;
			}
		}
		if (poll(pfd, (nfds_t)n, 20) <= 0)
			continue;
		if (pfd[0].revents & POLLIN) {
			int c = accept4(x->lfd, NULL, NULL, SOCK_CLOEXEC);
			struct sockaddr_in a = { .sin_family = AF_INET };
			int s = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
			int slot = -1;

			a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
			a.sin_port = htons((uint16_t)x->target);
			for (int i = 0; i < PROXY_PAIRS && slot < 0; i++)
				if (x->fd[i][0] < 0)
					slot = i;
			if (c >= 0 && s >= 0 && slot >= 0 &&
			    connect(s, (struct sockaddr *)&a, sizeof a) == 0) {
				x->fd[slot][0] = c;
				x->fd[slot][1] = s;
			} else {
				if (c >= 0)
					close(c);
				if (s >= 0)
					close(s);
			}
		}
		for (int k = 1; k < n; k++) {
			int i = map[k][0], s = map[k][1];
			ssize_t r;
			int mode;

			if (!(pfd[k].revents & (POLLIN | POLLHUP | POLLERR)) ||
			    x->fd[i][0] < 0)
				continue;
			r = read(x->fd[i][s], buf, sizeof buf);
			if (r < 0 && errno == EINTR)
				continue;
			if (r <= 0) {
				close(x->fd[i][0]);
				close(x->fd[i][1]);
				x->fd[i][0] = x->fd[i][1] = -1;
				continue;
			}
			mode = atomic_load(&x->mode);
			if (mode == BH_ON)
				continue; /* swallowed */
			write_all(x->fd[i][1 - s], buf, (size_t)r);
			/* Armed: the first script a client sends reaches the
			 * server, and then nothing more passes. */
			if (mode == BH_ARMED && s == 0 &&
			    memmem(buf, (size_t)r, "EVALSHA", 7) != NULL) {
				atomic_store(&x->armed_ns, now_ns());
				atomic_store(&x->mode, BH_ON);
			}
		}
	}
	return NULL;
}

static bool
proxy_start(struct proxy *x, int target)
{
	struct sockaddr_in a = { .sin_family = AF_INET };
	socklen_t len = sizeof a;
	sigset_t all, old;

	memset(x, 0, sizeof *x);
	for (int i = 0; i < PROXY_PAIRS; i++)
		x->fd[i][0] = x->fd[i][1] = -1;
	x->target = target;
	a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	x->lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (x->lfd < 0 || bind(x->lfd, (struct sockaddr *)&a, sizeof a) != 0 ||
	    listen(x->lfd, 128) != 0 ||
	    getsockname(x->lfd, (struct sockaddr *)&a, &len) != 0)
		return false;
	x->port = ntohs(a.sin_port);
	/* No signal of the storm for the proxy's thread. */
	sigfillset(&all);
	pthread_sigmask(SIG_SETMASK, &all, &old);
	test_thread_start(&x->th, proxy_main, x);
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	return true;
}

static void
proxy_stop(struct proxy *x)
{
	atomic_store(&x->stop, true);
	test_thread_join(x->th);
	for (int i = 0; i < PROXY_PAIRS; i++) {
		if (x->fd[i][0] >= 0) {
			close(x->fd[i][0]);
			close(x->fd[i][1]);
		}
	}
	close(x->lfd);
}

/* ------------------------------------------------------------------ */
/* Raw access to a server                                               */

/* A command on c that must not fail; NULL (noted) when it does. */
static redisReply *
cmd(redisContext *c, int argc, const char **argv)
{
	redisReply *r = redisCommandArgv(c, argc, argv, NULL);

	if (r == NULL || r->type == REDIS_REPLY_ERROR) {
		fail_note("%s: %s", argv[0], r != NULL ? r->str : c->errstr);
		if (r != NULL)
			freeReplyObject(r);
		return NULL;
	}
	return r;
}

static long long
cmd_int(redisContext *c, int argc, const char **argv)
{
	redisReply *r = cmd(c, argc, argv);
	long long v = LLONG_MIN;

	if (r != NULL && r->type == REDIS_REPLY_INTEGER)
		v = r->integer;
	if (r != NULL)
		freeReplyObject(r);
	return v;
}

/* GET into buf ("" when missing). */
static void
cmd_get(redisContext *c, const char *key, char *buf, size_t size)
{
	const char *argv[2] = { "GET", key };
	redisReply *r = cmd(c, 2, argv);

	buf[0] = '\0';
	if (r != NULL && r->type == REDIS_REPLY_STRING)
		snprintf(buf, size, "%s", r->str);
	if (r != NULL)
		freeReplyObject(r);
}

/* ================================================================== */
/* T23: ownership                                                      */

/* One of the provider's scripts, run with token tok on a connection of
 * the provider's own code (src/redis/redis_conn.c, redis_scripts.c). */
static redisReply *
script(struct kl__rconn *c, enum kl__redis_script id, const char *prefix,
       const char *key, const char *tok, const char *num)
{
	char lock[200], q[200], hb[200], f[200], w[300], g[200], m[200];
	char sh[200], sm[200];
	const char *keys[9] = { lock, q, hb, f, w, g, m, sh, sm };
	size_t klens[9];
	const char *args[7] = { tok, num, "400", "try", "86400000", "-1",
				"0" };
	size_t alens[7];
	redisReply *rep = NULL;
	kl_error err;
	int nkeys, nargs;

	key_name(lock, sizeof lock, prefix, key, "");
	key_name(q, sizeof q, prefix, key, ":q");
	key_name(hb, sizeof hb, prefix, key, ":hb");
	key_name(f, sizeof f, prefix, key, ":f");
	snprintf(w, sizeof w, "%s:w:%s", lock, tok);
	snprintf(g, sizeof g, "%sguard", prefix);
	snprintf(m, sizeof m, "%smaxttl", prefix);
	key_name(sh, sizeof sh, prefix, key, ":s");
	key_name(sm, sizeof sm, prefix, key, ":sm");
	switch (id) {
	case KL_RS_ATTEMPT:
		nkeys = 9;
		nargs = 7;
		break;
	case KL_RS_RELEASE:
		/* KEYS lock, q, hb, shared holders, their fences. */
		keys[3] = sh;
		keys[4] = sm;
		nkeys = 5;
		nargs = 2;
		args[1] = "400";
		break;
	case KL_RS_LEAVE:
		/* KEYS lock, q, hb, own wake list, shared holders, their
		 * fences. */
		keys[3] = w;
		keys[4] = sh;
		keys[5] = sm;
		nkeys = 6;
		nargs = 2;
		args[1] = "400";
		break;
	default: /* KL_RS_RENEW: KEYS lock, shared holders, fences */
		keys[1] = sh;
		keys[2] = sm;
		nkeys = 3;
		nargs = 2;
		break;
	}
	for (int i = 0; i < nkeys; i++)
		klens[i] = strlen(keys[i]);
	for (int i = 0; i < nargs; i++)
		alens[i] = strlen(args[i]);
	memset(&err, 0, sizeof err);
	if (kl__rconn_script(c, kl__redis_deadline(5000), id, nkeys, keys,
			     klens, nargs, args, alens, &rep,
			     &err) != KL_OK) {
		fail_note("script %d: %s", (int)id, err.message);
		return NULL;
	}
	return rep;
}

/* 10^4 releases, renewals, leaves and try-attempts with wrong or stale
 * tokens while another client holds: none deletes, extends or takes the
 * key; the holder keeps a valid lease and releases it cleanly. */
START_TEST(test_t23_wrong_tokens)
{
	const char *prefix = "t23w:";
	struct kl__redis_conf conf;
	struct kl__rconn *rc = NULL;
	kl_provider *p, *q;
	kl_lock *l, *lq;
	kl_lease *lease, *tmp;
	struct test_events ev, evq;
	redisContext *c;
	char lock[200], holder[64], now[64], stale[8][64];
	const char *pttl[2] = { "PTTL", lock };
	long n = kl_test_scaled(10000, 500), bad = 0, ops[4] = { 0 };
	kl_error err;
	int64_t t0 = now_ms();

	ck_assert(srv_start(&g_srv[0], false));
	p = open_port(g_srv[0].port, prefix, "restart_guard=0&ttl=5s");
	q = open_port(g_srv[0].port, prefix, "restart_guard=0&ttl=5s");
	fails_assert();
	c = connect_port(g_srv[0].port, 2000);
	ck_assert_ptr_nonnull(c);
	key_name(lock, sizeof lock, prefix, "own", "");
	/* Stale tokens: holders of the key before. */
	lq = lock_make(q, "own", 5000, 0, &evq);
	for (int i = 0; i < 8; i++) {
		ck_assert_int_eq(kl_lock_acquire(lq, NULL, &tmp, &err), KL_OK);
		cmd_get(c, lock, stale[i], sizeof stale[i]);
		ck_assert_int_eq((int)strlen(stale[i]), 32);
		kl_lease_release(tmp);
	}
	l = lock_make(p, "own", 5000, 0, &ev);
	ck_assert_int_eq(kl_lock_acquire(l, NULL, &lease, &err), KL_OK);
	cmd_get(c, lock, holder, sizeof holder);
	ck_assert_int_eq((int)strlen(holder), 32);

	memset(&conf, 0, sizeof conf);
	conf.host = (char *)"127.0.0.1";
	conf.port = g_srv[0].port;
	conf.timeout_ms = 5000;
	conf.connect_timeout_ms = 2000;
	conf.heartbeat_ms = 400;
	memset(&err, 0, sizeof err);
	ck_assert_msg(kl__rconn_open(&conf, KL_R_NO_DEADLINE, &rc, &err) ==
			      KL_OK,
		      "%s", err.message);
	for (long i = 0; i < n; i++) {
		char tok[64];
		int kind = (int)(i % 4), op = (int)((i / 4) % 4);
		redisReply *r;
		long long left;

		switch (kind) {
		case 0: /* random */
			snprintf(tok, sizeof tok, "%08lx%08lx%08lx%08lx",
				 (unsigned long)random(),
				 (unsigned long)random(), (unsigned long)i,
				 (unsigned long)random());
			break;
		case 1: /* stale */
			snprintf(tok, sizeof tok, "%s", stale[i % 8]);
			break;
		case 2: /* one character off */
			snprintf(tok, sizeof tok, "%s", holder);
			tok[i % 32] = tok[i % 32] == 'a' ? 'b' : 'a';
			break;
		default: /* a prefix, or nothing */
			snprintf(tok, sizeof tok, "%.*s", (int)(i % 32),
				 holder);
			break;
		}
		if (strcmp(tok, holder) == 0)
			continue;
		ops[op]++;
		r = script(rc, op == 0   ? KL_RS_RELEASE
			       : op == 1 ? KL_RS_RENEW
			       : op == 2 ? KL_RS_LEAVE
					 : KL_RS_ATTEMPT,
			   prefix, "own", tok, "3600000");
		if (r == NULL)
			break;
		if (op == 3) {
			/* {0, -1, ttl record, restart guard left} */
			if (r->type != REDIS_REPLY_ARRAY || r->elements != 4 ||
			    r->element[0]->integer != 0)
				bad++;
		} else if (r->type != REDIS_REPLY_INTEGER || r->integer != 0) {
			bad++;
		}
		freeReplyObject(r);
		cmd_get(c, lock, now, sizeof now);
		left = cmd_int(c, 2, pttl);
		if (strcmp(now, holder) != 0 || left > 5000 || left < 0) {
			fail_note("after op %d with token '%s': holder '%s' "
				  "(was '%s'), pttl %lld",
				  op, tok, now, holder, left);
			break;
		}
	}
	kl__rconn_close(rc);
	ck_assert_int_eq(bad, 0);
	fails_assert();
	ck_assert(kl_lease_valid(lease));
	kl_lease_release(lease);
	ck_assert_int_eq(tev_count(&ev, KL_EV_RELEASED), 1);
	ck_assert_int_eq(tev_count(&ev, KL_EV_RELEASE_FAILED), 0);
	ck_assert_int_eq(tev_count(&ev, KL_EV_LOST), 0);
	printf("T23 wrong tokens: %ld release, %ld renew, %ld leave, %ld "
	       "attempt; 0 deletions or extensions (%lld ms)\n",
	       ops[0], ops[1], ops[2], ops[3], (long long)(now_ms() - t0));
	kl_lock_free(l);
	kl_lock_free(lq);
	redisFree(c);
	kl_provider_free(p);
	kl_provider_free(q);
}
END_TEST

/* An external PEXPIRE key 1 or DEL: the next renewal reports the lease
 * lost (KL_EV_LOST, kl_lease_valid false), or, released before that, the
 * release reports it (KL_EV_RELEASE_FAILED); never a silent success. */
START_TEST(test_t23_external_expiry)
{
	const char *prefix = "t23x:";
	kl_provider *p;
	redisContext *c;
	char lock[200];
	const char *del[2] = { "DEL", lock };
	const char *pexp[3] = { "PEXPIRE", lock, "1" };
	const char *exists[2] = { "EXISTS", lock };
	int rounds = (int)kl_test_scaled(12, 4);
	int64_t worst = 0;

	ck_assert(srv_start(&g_srv[0], false));
	p = open_port(g_srv[0].port, prefix, "restart_guard=0");
	fails_assert();
	c = connect_port(g_srv[0].port, 2000);
	ck_assert_ptr_nonnull(c);
	key_name(lock, sizeof lock, prefix, "x", "");
	for (int i = 0; i < rounds; i++) {
		struct test_events ev;
		kl_lock *l = lock_make(p, "x", 5000, 900, &ev);
		kl_lease *lease;
		kl_error err;
		bool wait_renew = (i / 2) % 2 == 0;
		int64_t t0;

		ck_assert_int_eq(kl_lock_acquire(l, NULL, &lease, &err),
				 KL_OK);
		if (i % 2 == 0)
			ck_assert_int_eq(cmd_int(c, 2, del), 1);
		else
			ck_assert_int_eq(cmd_int(c, 3, pexp), 1);
		/* Until the server let the key expire (1 ms). */
		for (int j = 0; j < 1000 && cmd_int(c, 2, exists) != 0; j++)
			test_sleep_ms(1);
		t0 = now_ns();
		if (wait_renew) {
			/* The next renewal (ttl/3 = 300 ms) finds it gone. */
			while (kl_lease_valid(lease) &&
			       now_ns() - t0 < (300 + SLACK_MS) * MS)
				test_sleep_ms(2);
			ck_assert_msg(!kl_lease_valid(lease),
				      "round %d: lease still valid %lld ms "
				      "after an external %s",
				      i, (long long)((now_ns() - t0) / MS),
				      i % 2 ? "PEXPIRE" : "DEL");
			if ((now_ns() - t0) / MS > worst)
				worst = (now_ns() - t0) / MS;
			ck_assert_int_eq(tev_wait(&ev, KL_EV_LOST, 3000), 1);
		}
		kl_lease_release(lease);
		ck_assert_msg(tev_count(&ev, KL_EV_RELEASED) == 0 &&
				      tev_count(&ev, KL_EV_RELEASE_FAILED) == 1,
			      "round %d: a release after an external %s "
			      "reported success",
			      i, i % 2 ? "PEXPIRE" : "DEL");
		kl_lock_free(l);
	}
	printf("T23 external expiry: %d rounds, loss seen within %lld ms\n",
	       rounds, (long long)worst);
	redisFree(c);
	kl_provider_free(p);
}
END_TEST

struct t23_client {
	kl_provider *p;
	struct ledger *L;
	long iters;
	unsigned seed;
	pthread_t th;
	long failed;
};

static const char *const t23_keys[4] = { "f0", "f1", "f2", "f3" };

static void *
t23_client_main(void *arg)
{
	struct t23_client *k = arg;
	struct test_events ev[4];
	kl_lock *l[4];

	for (int i = 0; i < 4; i++)
		l[i] = lock_make(k->p, t23_keys[i], 30000, 0, &ev[i]);
	for (long i = 0; i < k->iters; i++) {
		int key = (int)(rand_r(&k->seed) % 4), gi;
		kl_lease *lease;
		kl_error err;
		int64_t t;
		int rc = kl_lock_acquire(l[key], NULL, &lease, &err);

		if (rc != KL_OK) {
			if (k->failed++ == 0)
				fail_note("acquire %s: %s: %s", t23_keys[key],
					  kl_strerror(rc), err.message);
			continue;
		}
		gi = ledger_grant(k->L, key, 0, kl_lease_fence(lease),
				  now_ns());
		t = now_ns();
		if (kl_lease_valid(lease)) {
			ledger_valid(k->L, gi, t);
			ledger_write(k->L, key, kl_lease_fence(lease));
		}
		kl_lease_release(lease);
	}
	for (int i = 0; i < 4; i++) {
		if (tev_count(&ev[i], KL_EV_RELEASE_FAILED) != 0 ||
		    tev_count(&ev[i], KL_EV_LOST) != 0)
			fail_note("key %s: a release failed or a lease was "
				  "lost",
				  t23_keys[i]);
		kl_lock_free(l[i]);
	}
	return NULL;
}

/* 10^4 grants by 8 clients over 4 keys: fences strictly increase per key
 * and no two holders of a key overlap. */
START_TEST(test_t23_fences_8_clients)
{
	struct t23_client k[8];
	struct ledger L;
	long n = kl_test_scaled(10000, 400);
	int64_t t0 = now_ms();

	ck_assert(srv_start(&g_srv[0], false));
	ledger_init(&L);
	for (int i = 0; i < 8; i++) {
		k[i] = (struct t23_client){ .L = &L, .iters = n / 8,
					    .seed = (unsigned)i * 7919u + 1 };
		k[i].p = open_port(g_srv[0].port, "t23f:",
				   "restart_guard=0&pool=2");
	}
	fails_assert();
	for (int i = 0; i < 8; i++)
		test_thread_start(&k[i].th, t23_client_main, &k[i]);
	for (int i = 0; i < 8; i++)
		test_thread_join(k[i].th);
	ledger_check(&L, "T23 fences", true);
	printf("T23 fences: %zu grants by 8 clients on 4 keys, fences "
	       "strictly increasing (%lld ms)\n",
	       L.n, (long long)(now_ms() - t0));
	ck_assert_int_eq((long)L.n, 8 * (n / 8));
	fails_assert();
	for (int i = 0; i < 8; i++)
		kl_provider_free(k[i].p);
	ledger_free(&L);
}
END_TEST

/* With appendfsync always, fences keep growing across kill -9 and a
 * restart, and a lease held across it stays valid and releases cleanly. */
START_TEST(test_t23_fences_aof_restart)
{
	const char *prefix = "t23a:";
	kl_provider *p;
	struct test_events ev, evh;
	kl_lock *l, *lh;
	kl_lease *lease, *held;
	kl_error err;
	uint64_t last = 0;
	int n = (int)kl_test_scaled(100, 20);

	ck_assert(srv_start(&g_srv[0], true));
	/* The automatic guard holds on the new server (3 s), then never:
	 * the restarts keep every write. */
	p = open_port(g_srv[0].port, prefix, "ttl=3s");
	fails_assert();
	l = lock_make(p, "a", 5000, 0, &ev);
	lh = lock_make(p, "held", 5000, 0, &evh);
	ck_assert_int_eq(kl_lock_acquire(lh, NULL, &held, &err), KL_OK);
	for (int round = 0; round < 3; round++) {
		for (int i = 0; i < n; i++) {
			int rc = kl_lock_acquire(l, NULL, &lease, &err);

			ck_assert_msg(rc == KL_OK, "round %d: %s: %s", round,
				      kl_strerror(rc), err.message);
			ck_assert_msg(kl_lease_fence(lease) > last,
				      "round %d: fence %" PRIu64
				      " after %" PRIu64,
				      round, kl_lease_fence(lease), last);
			last = kl_lease_fence(lease);
			kl_lease_release(lease);
		}
		if (round == 2)
			break;
		srv_kill(&g_srv[0]);
		test_sleep_ms(200);
		ck_assert(srv_restart(&g_srv[0]));
	}
	ck_assert_int_eq(tev_count(&ev, KL_EV_RELEASE_FAILED), 0);
	ck_assert(kl_lease_valid(held));
	kl_lease_release(held);
	ck_assert_int_eq(tev_count(&evh, KL_EV_LOST), 0);
	ck_assert_int_eq(tev_count(&evh, KL_EV_RELEASED), 1);
	printf("T23 fences across 2 AOF restarts: %d grants, last fence "
	       "%" PRIu64 "\n",
	       3 * n, last);
	kl_lock_free(l);
	kl_lock_free(lh);
	kl_provider_free(p);
}
END_TEST

/* ================================================================== */
/* Restarts that lose data: fences and the restart guard (issue 16)     */

/* Acquires l into *lease; the status, with err filled. */
static int
grab(kl_lock *l, kl_lease **lease, kl_error *err)
{
	memset(err, 0, sizeof *err);
	*lease = NULL;
	return kl_lock_acquire(l, NULL, lease, err);
}

/* grab, asking again while the restart guard refuses with KL_EPROVIDER (as
 * a user of a provider that refused would): test_fresh_server_waits checks
 * that it never does; here only the guard's length counts. */
static int
grab_patiently(kl_lock *l, kl_lease **lease, kl_error *err)
{
	int64_t limit = now_ms() + 30000;
	int rc;

	while ((rc = grab(l, lease, err)) == KL_EPROVIDER &&
	       strstr(err->message, "restart_guard") != NULL &&
	       now_ms() < limit)
		test_sleep_ms(50);
	return rc;
}

/* A restart from a snapshot (Redis's default persistence) rolls the fence
 * counter back; the next fence is still above every fence issued before
 * the kill. */
START_TEST(test_fence_after_snapshot_restart)
{
	struct test_events ev;
	kl_provider *p;
	kl_lock *l;
	kl_lease *lease;
	kl_error err;
	uint64_t last = 0;
	int rc;

	ck_assert(srv_start(&g_srv[0], false));
	p = open_port(g_srv[0].port, "fs:", "restart_guard=0&ttl=2s");
	fails_assert();
	l = lock_make(p, "k", 5000, 0, &ev);
	for (int i = 0; i < 40; i++) {
		/* The snapshot holds the counter of grant 20. */
		if (i == 20)
			ck_assert(srv_save(&g_srv[0]));
		rc = grab(l, &lease, &err);
		ck_assert_msg(rc == KL_OK, "%s: %s", kl_strerror(rc),
			      err.message);
		ck_assert_uint_gt(kl_lease_fence(lease), last);
		last = kl_lease_fence(lease);
		kl_lease_release(lease);
	}
	srv_kill(&g_srv[0]);
	ck_assert(srv_restart(&g_srv[0]));
	for (int i = 0; i < 3; i++) {
		rc = grab(l, &lease, &err);
		ck_assert_msg(rc == KL_OK, "%s: %s", kl_strerror(rc),
			      err.message);
		ck_assert_msg(kl_lease_fence(lease) > last,
			      "fence %" PRIu64 " after the restart, %" PRIu64
			      " before it",
			      kl_lease_fence(lease), last);
		last = kl_lease_fence(lease);
		kl_lease_release(lease);
	}
	kl_lock_free(l);
	kl_provider_free(p);
}
END_TEST

/* Shared mode across a restart that loads an older snapshot: fences of
 * mixed grants (two shared held together, then one exclusive) keep
 * growing; a shared lease held across it is lost; while the automatic
 * restart guard holds, a shared try-once is refused as an exclusive one
 * is. */
START_TEST(test_shared_fences_snapshot_restart)
{
	struct test_events ev[3], evg;
	kl_provider *p, *g;
	kl_lock *l[3], *lg;
	kl_lease *lease[3], *held;
	kl_error err;
	uint64_t last = 0;
	int rc;

	ck_assert(srv_start(&g_srv[0], false));
	p = open_port(g_srv[0].port, "fsh:", "restart_guard=0&ttl=2s");
	g = open_port(g_srv[0].port, "fsh:", "ttl=30s");
	fails_assert();
	for (int j = 0; j < 3; j++)
		l[j] = lock_make_flags(p, "k", 5000, 0, j < 2 ? KL_SHARED : 0,
				       &ev[j]);
	lg = lock_make_flags(g, "k", 0, 0, KL_SHARED, &evg);
	for (int i = 0; i < 30; i++) {
		if (i == 15)
			ck_assert(srv_save(&g_srv[0]));
		for (int j = 0; j < 3; j++) {
			if (j == 2) {
				kl_lease_release(lease[0]);
				kl_lease_release(lease[1]);
			}
			rc = grab(l[j], &lease[j], &err);
			ck_assert_msg(rc == KL_OK, "%d/%d: %s: %s", i, j,
				      kl_strerror(rc), err.message);
			ck_assert_uint_gt(kl_lease_fence(lease[j]), last);
			last = kl_lease_fence(lease[j]);
		}
		kl_lease_release(lease[2]);
	}
	ck_assert_int_eq(grab(l[0], &held, &err), KL_OK);
	ck_assert_uint_gt(kl_lease_fence(held), last);
	last = kl_lease_fence(held);
	srv_kill(&g_srv[0]);
	ck_assert(srv_restart(&g_srv[0]));
	/* The restart lost data: the guard of g (its 30 s ttl, from the
	 * run's start) refuses at once. */
	rc = grab(lg, &lease[0], &err);
	ck_assert_msg(rc == KL_ETIMEDOUT &&
			      strstr(err.message, "restart_guard") != NULL,
		      "shared try-once under the guard: %s: %s",
		      kl_strerror(rc), err.message);
	for (int i = 0; i < 3; i++) {
		for (int j = 0; j < 3; j++) {
			if (j == 2) {
				kl_lease_release(lease[0]);
				kl_lease_release(lease[1]);
			}
			rc = grab(l[j], &lease[j], &err);
			ck_assert_msg(rc == KL_OK, "after: %d/%d: %s: %s", i,
				      j, kl_strerror(rc), err.message);
			ck_assert_msg(kl_lease_fence(lease[j]) > last,
				      "fence %" PRIu64
				      " after the restart, %" PRIu64
				      " before it",
				      kl_lease_fence(lease[j]), last);
			last = kl_lease_fence(lease[j]);
		}
		kl_lease_release(lease[2]);
	}
	/* The shared lease held across the restart is gone with the data. */
	ck_assert(!kl_lease_valid(held));
	kl_lease_release(held);
	for (int j = 0; j < 3; j++)
		kl_lock_free(l[j]);
	kl_lock_free(lg);
	kl_provider_free(g);
	kl_provider_free(p);
}
END_TEST

/* A durable server (appendfsync always) whose data folder was wiped:
 * the new run is durable too, but holds none of the old locks, so no
 * grant comes before the old holder's lease has run out. */
START_TEST(test_wiped_durable_server_guarded)
{
	struct test_events eva, evb;
	kl_provider *a, *b;
	kl_lock *la, *lb;
	kl_lease *held, *lease;
	kl_error err;
	int64_t t_kill, g;
	bool old_valid;
	int rc;

	ck_assert(srv_start(&g_srv[0], true));
	a = open_port(g_srv[0].port, "wd:", "ttl=3s");
	b = open_port(g_srv[0].port, "wd:", "ttl=3s");
	fails_assert();
	la = lock_make(a, "k", 20000, 0, &eva);
	lb = lock_make(b, "k", 20000, 0, &evb);
	rc = grab(la, &held, &err);
	ck_assert_msg(rc == KL_OK, "%s: %s", kl_strerror(rc), err.message);
	t_kill = now_ns();
	srv_kill(&g_srv[0]);
	srv_wipe(&g_srv[0]);
	ck_assert(srv_restart(&g_srv[0]));
	rc = grab(lb, &lease, &err);
	g = now_ns();
	old_valid = kl_lease_valid(held);
	ck_assert_msg(rc == KL_OK, "%s: %s", kl_strerror(rc), err.message);
	ck_assert_msg(!old_valid,
		      "granted %lld ms after the kill while the old holder's "
		      "lease was still valid",
		      (long long)((g - t_kill) / MS));
	/* The guard counts from the new run's start, after the kill. */
	ck_assert_int_ge((g - t_kill) / MS, 3000);
	kl_lease_release(lease);
	kl_lease_release(held);
	kl_lock_free(la);
	kl_lock_free(lb);
	kl_provider_free(a);
	kl_provider_free(b);
}
END_TEST

/* A server started durable whose AOF is turned off at runtime (CONFIG SET
 * appendonly no), then killed and started again with its configuration
 * file, reloads an AOF that lacks every write since the CONFIG SET, the
 * old holder's grant included, and whose restart marker says that the
 * old run kept every write: the marker cannot see a runtime change.
 * kl_redis_provider_open(3) has the operator mark the run as not
 * durable first (HSET PREFIXguard dur 0, while the AOF still keeps it);
 * then the restart is guarded and fenced as one that lost data. */
START_TEST(test_aof_off_at_runtime_marked)
{
	struct test_events eva, evb;
	kl_provider *a, *b;
	kl_lock *la, *lb;
	kl_lease *held, *lease;
	kl_error err;
	redisContext *c;
	const char *mark[4] = { "HSET", "ao:guard", "dur", "0" };
	const char *off[4] = { "CONFIG", "SET", "appendonly", "no" };
	uint64_t fa;
	bool old_valid;
	int rc;

	ck_assert(srv_start(&g_srv[0], true));
	a = open_port(g_srv[0].port, "ao:", "ttl=3s");
	fails_assert();
	la = lock_make(a, "k", 20000, 0, &eva);
	for (int i = 0; i < 3; i++) {
		rc = grab_patiently(la, &held, &err);
		ck_assert_msg(rc == KL_OK, "%s: %s", kl_strerror(rc),
			      err.message);
		kl_lease_release(held);
	}
	c = connect_port(g_srv[0].port, 2000);
	ck_assert(c != NULL);
	ck_assert_int_ge(cmd_int(c, 4, mark), 0);
	freeReplyObject(cmd(c, 4, off));
	redisFree(c);
	fails_assert();
	for (int i = 0; i < 3; i++) {
		rc = grab(la, &held, &err);
		ck_assert_msg(rc == KL_OK, "%s: %s", kl_strerror(rc),
			      err.message);
		if (i < 2)
			kl_lease_release(held);
	}
	fa = kl_lease_fence(held);
	srv_kill(&g_srv[0]);
	ck_assert(srv_restart(&g_srv[0]));
	b = open_port(g_srv[0].port, "ao:", "ttl=3s");
	fails_assert();
	lb = lock_make(b, "k", 20000, 0, &evb);
	rc = grab(lb, &lease, &err);
	old_valid = kl_lease_valid(held);
	ck_assert_msg(rc == KL_OK, "%s: %s", kl_strerror(rc), err.message);
	ck_assert_msg(kl_lease_fence(lease) > fa,
		      "fence %" PRIu64 " after the restart, %" PRIu64
		      " before it",
		      kl_lease_fence(lease), fa);
	ck_assert_msg(!old_valid, "granted while the old holder's lease "
				  "was still valid");
	kl_lease_release(lease);
	kl_lease_release(held);
	kl_lock_free(la);
	kl_lock_free(lb);
	kl_provider_free(a);
	kl_provider_free(b);
}
END_TEST

/* A durable server that lost its data (a wiped folder) runs briefly and
 * is killed; the next run loads that run's complete AOF, whose marker says
 * that it kept every write.  The locks lost with the wipe are missing
 * still, and the old holder may never have met the run between: the
 * guard of the loss goes on, rather than ending at the durable restart. */
START_TEST(test_durable_restart_keeps_guard)
{
	struct test_events eva, evb;
	kl_provider *a, *b, *m;
	kl_lock *la, *lb;
	kl_lease *held, *lease = NULL;
	kl_error err;
	int rc;

	ck_assert(srv_start(&g_srv[0], true));
	/* ttl 30 s: the holder renews every 10 s, after the runs below. */
	a = open_port(g_srv[0].port, "dg:", "restart_guard=0&ttl=30s");
	fails_assert();
	la = lock_make(a, "k", 20000, 0, &eva);
	rc = grab(la, &held, &err);
	ck_assert_msg(rc == KL_OK, "%s: %s", kl_strerror(rc), err.message);
	srv_kill(&g_srv[0]);
	srv_wipe(&g_srv[0]);
	ck_assert(srv_restart(&g_srv[0]));
	/* The run between: a client marks it, and it dies. */
	m = open_port(g_srv[0].port, "dg:", "ttl=1s");
	fails_assert();
	kl_provider_free(m);
	srv_kill(&g_srv[0]);
	ck_assert(srv_restart(&g_srv[0]));
	/* The record went with the wipe: a guard as the man page asks. */
	b = open_port(g_srv[0].port, "dg:", "ttl=1s&restart_guard=30s");
	fails_assert();
	lb = lock_make(b, "k", 2000, 0, &evb);
	rc = grab(lb, &lease, &err);
	ck_assert_msg(rc == KL_ETIMEDOUT,
		      "%s: %s (the old holder's lease is %s)",
		      kl_strerror(rc), err.message,
		      kl_lease_valid(held) ? "valid" : "lost");
	ck_assert_ptr_nonnull(strstr(err.message, "restart_guard"));
	kl_lease_release(held);
	kl_lock_free(la);
	kl_lock_free(lb);
	kl_provider_free(a);
	kl_provider_free(b);
}
END_TEST

/* The uptime of s's run in whole seconds (INFO), -1 when unknown. */
static long long
srv_uptime_s(struct srv *s)
{
	static const char field[] = "uptime_in_seconds:";
	redisContext *c = connect_port(s->port, 2000);
	redisReply *r = c != NULL ? redisCommand(c, "INFO server") : NULL;
	const char *p;
	long long v = -1;

	if (r != NULL && r->type == REDIS_REPLY_STRING &&
	    (p = strstr(r->str, field)) != NULL)
		v = strtoll(p + sizeof field - 1, NULL, 10);
	if (r != NULL)
		freeReplyObject(r);
	if (c != NULL)
		redisFree(c);
	return v;
}

/* FLUSHALL on a server that has run for longer than the guard takes the
 * locks with it, and the restart marker.  The first to find the marker
 * gone may be the first connection of a client started afterwards, which
 * cannot tell a flushed server from one never used: the guard must run
 * from then, not from the run's start, or that client takes the key at
 * once while the old holder's lease is still valid (its next renewal, a
 * third of the ttl later, has yet to find the key gone). */
START_TEST(test_flushall_guarded)
{
	struct test_events eva, evb, evc;
	kl_provider *a, *b;
	kl_lock *la, *lb, *lc;
	kl_lease *held, *lease = NULL;
	kl_error err;
	redisContext *c;
	const char *flush[1] = { "FLUSHALL" };
	bool old_valid;
	int rc;

	ck_assert(srv_start(&g_srv[0], false));
	/* ttl 3 s: the automatic guard is 3 s; the holder renews every
	 * second. */
	a = open_port(g_srv[0].port, "fl:", "ttl=3s");
	fails_assert();
	la = lock_make(a, "k", 20000, 0, &eva);
	/* A fresh server: granted once its run is 3 s old. */
	rc = grab(la, &held, &err);
	ck_assert_msg(rc == KL_OK, "%s: %s", kl_strerror(rc), err.message);
	/* The run is older than the guard, INFO's whole seconds included. */
	while (srv_uptime_s(&g_srv[0]) < 5)
		test_sleep_ms(100);
	c = connect_port(g_srv[0].port, 2000);
	ck_assert_ptr_nonnull(c);
	freeReplyObject(cmd(c, 1, flush));
	redisFree(c);
	fails_assert();

	b = open_port(g_srv[0].port, "fl:", "ttl=3s");
	fails_assert();
	lb = lock_make(b, "k", 0, 0, &evb);
	rc = grab(lb, &lease, &err);
	old_valid = kl_lease_valid(held);
	/* Refused by the guard, which the message names, and not as if
	 * the server had restarted. */
	ck_assert_msg(rc == KL_ETIMEDOUT &&
			      strstr(err.message, "restart_guard") != NULL &&
			      strstr(err.message, "flush") != NULL,
		      "a try-once just after FLUSHALL: %s: %s (the old "
		      "holder's lease is %s)",
		      kl_strerror(rc), err.message,
		      old_valid ? "valid" : "lost");
	/* Once the guard has passed: granted, the old lease lost by then. */
	lc = lock_make(b, "k", 20000, 0, &evc);
	rc = grab(lc, &lease, &err);
	old_valid = kl_lease_valid(held);
	ck_assert_msg(rc == KL_OK, "%s: %s", kl_strerror(rc), err.message);
	ck_assert_msg(!old_valid, "granted after FLUSHALL while the old "
				  "holder's lease was still valid");
	/* The counter went with the flush: the fence still grows. */
	ck_assert_uint_gt(kl_lease_fence(lease), kl_lease_fence(held));
	ck_assert_int_eq(tev_wait(&eva, KL_EV_LOST, 3000), 1);
	kl_lease_release(lease);
	kl_lease_release(held);
	kl_lock_free(la);
	kl_lock_free(lb);
	kl_lock_free(lc);
	kl_provider_free(a);
	kl_provider_free(b);
}
END_TEST

/* Two shared holders (two clients, ttl 6 s, no guard of their own)
 * across kill -9 and a restart of the server.  With appendfsync always
 * the restarted server still has them: once the guard has passed, an
 * exclusive try-once is still refused, for the holders, whose leases stay
 * valid (renewed on the new run) and whose releases succeed; then it is
 * granted, its fence above theirs.  Without persistence they are gone:
 * an exclusive acquire is granted only once both leases are known lost,
 * its fence above theirs. */
static void
shared_restart(bool aof)
{
	struct test_events ev[2], evx;
	kl_provider *p[2], *x;
	kl_lock *l[2], *lx;
	kl_lease *held[2], *lease = NULL;
	kl_error err;
	int64_t limit;
	uint64_t high = 0;
	int rc;

	ck_assert(srv_start(&g_srv[0], aof));
	for (int i = 0; i < 2; i++) {
		p[i] = open_port(g_srv[0].port, "sr:",
				 "restart_guard=0&ttl=6s");
		fails_assert();
		l[i] = lock_make_flags(p[i], "k", 20000, 0, KL_SHARED, &ev[i]);
		rc = grab(l[i], &held[i], &err);
		ck_assert_msg(rc == KL_OK, "%s: %s", kl_strerror(rc),
			      err.message);
		if (kl_lease_fence(held[i]) > high)
			high = kl_lease_fence(held[i]);
	}
	if (aof) {
		/* The new server's own guard (6 s from when it was first
		 * found without a marker) must have passed before the
		 * restart, or the restart falls within it and the holders'
		 * leases count as lost, rightly. */
		x = open_port(g_srv[0].port, "sr:", "ttl=6s");
		fails_assert();
		lx = lock_make(x, "probe", 20000, 0, &evx);
		rc = grab(lx, &lease, &err);
		ck_assert_msg(rc == KL_OK, "%s: %s", kl_strerror(rc),
			      err.message);
		kl_lease_release(lease);
		kl_lock_free(lx);
		kl_provider_free(x);
	}
	srv_kill(&g_srv[0]);
	ck_assert(srv_restart(&g_srv[0]));
	x = open_port(g_srv[0].port, "sr:", "ttl=6s");
	fails_assert();
	if (aof) {
		lx = lock_make(x, "k", 0, 0, &evx);
		/* Refused while the guard holds, and after it. */
		limit = now_ms() + 30000;
		while ((rc = grab(lx, &lease, &err)) == KL_ETIMEDOUT &&
		       strstr(err.message, "restart_guard") != NULL &&
		       now_ms() < limit)
			test_sleep_ms(100);
		ck_assert_msg(rc == KL_ETIMEDOUT &&
				      strstr(err.message, "restart_guard") ==
					      NULL,
			      "an exclusive try-once with two shared holders "
			      "restored: %s: %s",
			      kl_strerror(rc), err.message);
		for (int i = 0; i < 2; i++) {
			ck_assert_msg(kl_lease_valid(held[i]),
				      "shared lease %d lost in a durable "
				      "restart",
				      i);
			kl_lease_release(held[i]);
			ck_assert_int_eq(tev_count(&ev[i], KL_EV_RELEASED), 1);
			ck_assert_int_eq(tev_count(&ev[i], KL_EV_LOST), 0);
		}
		rc = grab(lx, &lease, &err);
		ck_assert_msg(rc == KL_OK, "%s: %s", kl_strerror(rc),
			      err.message);
	} else {
		lx = lock_make(x, "k", 30000, 0, &evx);
		rc = grab(lx, &lease, &err);
		ck_assert_msg(rc == KL_OK, "%s: %s", kl_strerror(rc),
			      err.message);
		for (int i = 0; i < 2; i++) {
			ck_assert_msg(!kl_lease_valid(held[i]),
				      "exclusive grant while shared lease %d "
				      "was still valid",
				      i);
			ck_assert_int_eq(tev_wait(&ev[i], KL_EV_LOST, 3000), 1);
			kl_lease_release(held[i]);
		}
	}
	ck_assert_uint_gt(kl_lease_fence(lease), high);
	kl_lease_release(lease);
	for (int i = 0; i < 2; i++) {
		kl_lock_free(l[i]);
		kl_provider_free(p[i]);
	}
	kl_lock_free(lx);
	kl_provider_free(x);
}

START_TEST(test_shared_durable_restart)
{
	shared_restart(true);
}
END_TEST

START_TEST(test_shared_lossy_restart)
{
	shared_restart(false);
}
END_TEST

/* Two ttls: the guard after a restart covers the longest any client
 * uses, not the ttl of the client that asks.  The ttl record survives in
 * a snapshot for a client that never saw it; after a wipe, a client
 * remembers the record it saw. */
START_TEST(test_guard_covers_longest_ttl)
{
	struct test_events eva, evb;
	kl_provider *a, *b;
	kl_lock *la, *lx, *ly;
	kl_lease *held, *lease;
	kl_error err;
	int64_t t_kill;
	int rc;

	ck_assert(srv_start(&g_srv[0], false));
	/* The long-ttl client: no guard for itself, so that it is granted
	 * at once; its attempts record its ttl all the same. */
	a = open_port(g_srv[0].port, "tt:", "restart_guard=0&ttl=5s");
	fails_assert();
	la = lock_make(a, "k", 20000, 0, &eva);
	rc = grab(la, &held, &err);
	ck_assert_msg(rc == KL_OK, "%s: %s", kl_strerror(rc), err.message);
	ck_assert(srv_save(&g_srv[0]));
	t_kill = now_ns();
	srv_kill(&g_srv[0]);
	ck_assert(srv_restart(&g_srv[0]));

	/* A short-ttl client that starts after the restart. */
	b = open_port(g_srv[0].port, "tt:", "ttl=1s");
	fails_assert();
	lx = lock_make(b, "x", 20000, 0, &evb);
	rc = grab_patiently(lx, &lease, &err);
	ck_assert_msg(rc == KL_OK, "%s: %s", kl_strerror(rc), err.message);
	ck_assert_msg(now_ns() - t_kill >= 5000 * MS,
		      "a ttl 1 s client granted %lld ms after the restart; "
		      "another client uses a ttl of 5 s",
		      (long long)((now_ns() - t_kill) / MS));
	kl_lease_release(lease);

	/* Everything lost, the record too: b remembers it. */
	t_kill = now_ns();
	srv_kill(&g_srv[0]);
	srv_wipe(&g_srv[0]);
	ck_assert(srv_restart(&g_srv[0]));
	ly = lock_make(b, "y", 20000, 0, &evb);
	rc = grab_patiently(ly, &lease, &err);
	ck_assert_msg(rc == KL_OK, "%s: %s", kl_strerror(rc), err.message);
	ck_assert_msg(now_ns() - t_kill >= 5000 * MS,
		      "after a wipe, a ttl 1 s client granted %lld ms after "
		      "the restart; another client uses a ttl of 5 s",
		      (long long)((now_ns() - t_kill) / MS));
	kl_lease_release(lease);
	kl_lease_release(held);
	kl_lock_free(la);
	kl_lock_free(lx);
	kl_lock_free(ly);
	kl_provider_free(a);
	kl_provider_free(b);
}
END_TEST

/* A server started just now, never used: with restart_guard=auto, grants
 * wait for the guard inside the caller's timeout (a server that lost its
 * data looks just the same), never fail with KL_EPROVIDER. */
START_TEST(test_fresh_server_waits)
{
	struct test_events ev;
	kl_provider *p;
	kl_lock *l;
	kl_lease *lease;
	kl_error err;
	int64_t spawned, timeouts[3] = { 0, 300, 20000 };
	int rc;

	ck_assert(srv_start(&g_srv[0], false));
	spawned = g_srv[0].spawned_ns;
	p = open_port(g_srv[0].port, "fr:", "ttl=2s");
	fails_assert();
	for (int i = 0; i < 3; i++) {
		l = lock_make(p, "k", timeouts[i], 0, &ev);
		rc = grab(l, &lease, &err);
		if (rc == KL_ETIMEDOUT && i < 2) {
			ck_assert_ptr_nonnull(strstr(err.message,
						     "restart_guard"));
		} else if (rc == KL_EPROVIDER && i == 1 &&
			   strstr(err.message, "no reply from the server in "
					       "time") != NULL) {
			/* At load 10 and more a 300 ms budget can run out
			 * before the server's reply is read: a slow server,
			 * not a refused guard, and still no grant. */
		} else {
			ck_assert_msg(rc == KL_OK,
				      "timeout %lld ms: %s: %s",
				      (long long)timeouts[i], kl_strerror(rc),
				      err.message);
			ck_assert_int_ge(now_ns() - spawned, 2000 * MS);
			kl_lease_release(lease);
		}
		kl_lock_free(l);
	}
	kl_provider_free(p);
}
END_TEST

/* ================================================================== */
/* T21: kill -9 with 16 holders and 16 waiters                         */

#define T21_KEYS 16
#define T21_CLIENTS 4
#define T21_TTL 3000
#define T21_WAIT 2000
#define T21_CONNECT 1000
#define T21_OPTS                                                           \
	"ttl=3s&connect_timeout=1s&heartbeat=500ms&restart_guard=auto"

struct t21;

struct t21_holder {
	struct t21 *t;
	int key;
	int epoch;
	pthread_t th;
	kl_lock *l;
	struct test_events ev;
	atomic_int state; /* 0 acquiring, 1 holding, 2 done */
	atomic_bool stop;
	int64_t invalid_ns;
	int delayed; /* granted only once the restart guard ended */
};

struct t21_waiter {
	struct t21 *t;
	int key;
	int epoch;
	pthread_t th;
	kl_lock *l;
	struct test_events ev;
	int rc;
	int64_t start_ns, end_ns;
	char msg[256];
};

struct t21 {
	const char *name;
	bool aof;   /* the server runs with appendfsync always */
	bool rdb;   /* a snapshot (SAVE) at the start of every cycle */
	bool wipe;  /* the data folder is wiped before each restart */
	bool keeps; /* locks survive a restart: aof and not wipe */
	int cycles;
	struct srv *s;
	kl_provider *hp[T21_CLIENTS], *wp[T21_CLIENTS];
	struct ledger L;
	int64_t up_ns; /* the current server run began no earlier */
	atomic_bool killed; /* this cycle's kill has begun */
	pthread_t th;
	/* Counts, by the driver. */
	long delayed, waiter_ok, waiter_eprov, waiter_early, lost, released,
		aof_lost;
	int64_t worst_wait_ms, worst_lost_ms;
	int done;
};

static void
t21_key(char *buf, size_t size, int key)
{
	snprintf(buf, size, "k%d", key);
}

static void *
t21_holder_main(void *arg)
{
	struct t21_holder *h = arg;
	struct t21 *t = h->t;
	int64_t limit = now_ns() + 40000 * MS, g, start;
	kl_lease *lease = NULL;
	kl_error err;
	uint64_t fence;
	int rc, gi;

	for (;;) {
		memset(&err, 0, sizeof err);
		start = now_ns();
		rc = kl_lock_acquire(h->l, NULL, &lease, &err);
		if (rc == KL_OK)
			break;
		if (now_ns() > limit) {
			fail_note("%s: holder %d not granted: %s: %s", t->name,
				  h->key, kl_strerror(rc), err.message);
			atomic_store(&h->state, 2);
			return NULL;
		}
		test_sleep_ms(50);
	}
	g = now_ns();
	fence = kl_lease_fence(lease);
	/* The restart guard delays grants (a wait, not a refusal). */
	if (start < t->up_ns + T21_TTL * MS && g >= t->up_ns + T21_TTL * MS)
		h->delayed++;
	/* When locks may be lost, a grant needs the server up for max ttl
	 * (a fresh server too: it cannot be told from a wiped one). */
	if ((!t->keeps || h->epoch == 0) && g < t->up_ns + T21_TTL * MS)
		fail_note("%s: key %d granted %lld ms after the server "
			  "started (restart_guard is %d ms)",
			  t->name, h->key, (long long)((g - t->up_ns) / MS),
			  T21_TTL);
	gi = ledger_grant(&t->L, h->key, h->epoch, fence, g);
	atomic_store(&h->state, 1);
	for (;;) {
		int64_t t0 = now_ns();

		if (!kl_lease_valid(lease)) {
			h->invalid_ns = now_ns();
			break;
		}
		ledger_valid(&t->L, gi, t0);
		ledger_write(&t->L, h->key, fence);
		if (atomic_load(&h->stop))
			break;
		test_sleep_ms(10);
	}
	kl_lease_release(lease);
	atomic_store(&h->state, 2);
	return NULL;
}

static void *
t21_waiter_main(void *arg)
{
	struct t21_waiter *w = arg;
	kl_lease *lease = NULL;
	kl_error err;

	/* Before the kill, a provider whose connection estimates a shorter
	 * uptime may still refuse (restart_guard): ask again, as a user
	 * would. */
	for (int i = 0; i < 500; i++) {
		memset(&err, 0, sizeof err);
		w->start_ns = now_ns();
		w->rc = kl_lock_acquire(w->l, NULL, &lease, &err);
		w->end_ns = now_ns();
		if (w->rc != KL_EPROVIDER || atomic_load(&w->t->killed) ||
		    strstr(err.message, "restart_guard") == NULL)
			break;
		test_sleep_ms(20);
	}
	snprintf(w->msg, sizeof w->msg, "%s", err.message);
	if (w->rc == KL_OK) {
		int gi = ledger_grant(&w->t->L, w->key, w->epoch,
				      kl_lease_fence(lease), w->end_ns);
		int64_t t0 = now_ns();

		if (kl_lease_valid(lease)) {
			ledger_valid(&w->t->L, gi, t0);
			ledger_write(&w->t->L, w->key, kl_lease_fence(lease));
		}
		kl_lease_release(lease);
	}
	return NULL;
}

/* Polls until every key has a holder and a waiter queued (or 5 s). */
static void
t21_wait_queued(struct t21 *t)
{
	int64_t limit = now_ms() + 10000;

	for (int k = 0; k < T21_KEYS; k++) {
		char key[16];

		t21_key(key, sizeof key, k);
		for (;;) {
			size_t h = 0, w = 0;
			kl_error err;

			if (kl_provider_status(t->hp[0], key, &h, &w, &err) ==
				    KL_OK &&
			    w >= 1)
				break;
			/* Under heavy load a waiter may time out first:
			 * its own check tells. */
			if (now_ms() > limit)
				return;
			test_sleep_ms(5);
		}
	}
}

/* One grant of every key, written through the fenced store and
 * released (asked again while an old provider refuses with
 * restart_guard). */
static bool
t21_warm(struct t21 *t, int cycle)
{
	for (int k = 0; k < T21_KEYS; k++) {
		int64_t limit = now_ns() + 40000 * MS, start = now_ns(), g;
		struct test_events ev;
		kl_lease *lease = NULL;
		kl_error err;
		char key[16];
		kl_lock *l;
		int rc, gi;

		t21_key(key, sizeof key, k);
		l = lock_make(t->hp[0], key, 10000, T21_TTL, &ev);
		for (;;) {
			memset(&err, 0, sizeof err);
			rc = kl_lock_acquire(l, NULL, &lease, &err);
			if (rc != KL_EPROVIDER ||
			    strstr(err.message, "restart_guard") == NULL ||
			    now_ns() > limit)
				break;
			test_sleep_ms(50);
		}
		if (rc != KL_OK) {
			fail_note("%s: warm-up of key %d: %s: %s", t->name, k,
				  kl_strerror(rc), err.message);
			kl_lock_free(l);
			return false;
		}
		g = now_ns();
		/* As in t21_holder_main: the guard holds every grant back. */
		if (start < t->up_ns + T21_TTL * MS &&
		    g >= t->up_ns + T21_TTL * MS)
			t->delayed++;
		if (g < t->up_ns + T21_TTL * MS)
			fail_note("%s: key %d granted %lld ms after the server "
				  "started (restart_guard is %d ms)",
				  t->name, k, (long long)((g - t->up_ns) / MS),
				  T21_TTL);
		gi = ledger_grant(&t->L, k, cycle, kl_lease_fence(lease), g);
		if (kl_lease_valid(lease)) {
			ledger_valid(&t->L, gi, now_ns());
			ledger_write(&t->L, k, kl_lease_fence(lease));
		}
		kl_lease_release(lease);
		kl_lock_free(l);
	}
	return true;
}

static bool
t21_cycle(struct t21 *t, int cycle)
{
	struct t21_holder h[T21_KEYS];
	struct t21_waiter w[T21_KEYS];
	int64_t limit, t_up, t_kill = 0;
	char key[16];
	bool ok = true;

	memset(h, 0, sizeof h);
	memset(w, 0, sizeof w);
	atomic_store(&t->killed, false);
	/* The snapshot the restart loads holds the fence counters of a
	 * first grant of each key, older than those the holders get next. */
	if (t->rdb && (!t21_warm(t, cycle) || !srv_save(t->s)))
		return false;
	for (int i = 0; i < T21_KEYS; i++) {
		t21_key(key, sizeof key, i);
		h[i].t = t;
		h[i].key = i;
		h[i].epoch = cycle;
		h[i].l = lock_make(t->hp[i % T21_CLIENTS], key, 10000, T21_TTL,
				   &h[i].ev);
		test_thread_start(&h[i].th, t21_holder_main, &h[i]);
	}
	limit = now_ms() + 60000;
	for (int i = 0; i < T21_KEYS; i++)
		while (atomic_load(&h[i].state) == 0 && now_ms() < limit)
			test_sleep_ms(10);
	for (int i = 0; i < T21_KEYS; i++)
		if (atomic_load(&h[i].state) != 1)
			ok = false;
	for (int i = 0; ok && i < T21_KEYS; i++) {
		t21_key(key, sizeof key, i);
		w[i].t = t;
		w[i].key = i;
		w[i].epoch = cycle;
		w[i].l = lock_make(t->wp[i % T21_CLIENTS], key, T21_WAIT,
				   T21_TTL, &w[i].ev);
		test_thread_start(&w[i].th, t21_waiter_main, &w[i]);
	}
	if (ok) {
		t21_wait_queued(t);
		atomic_store(&t->killed, true);
		t_kill = now_ns();
		srv_kill(t->s);
		if (t->wipe)
			srv_wipe(t->s);
		test_sleep_ms(200);
		if (!srv_restart(t->s)) {
			fail_note("%s: the server did not restart", t->name);
			ok = false;
		}
		t->up_ns = t->s->spawned_ns;
		t_up = now_ns();
		for (int i = 0; i < T21_KEYS; i++) {
			int64_t ms;

			test_thread_join(w[i].th);
			ms = (w[i].end_ns - w[i].start_ns) / MS;
			if (ms > t->worst_wait_ms)
				t->worst_wait_ms = ms;
			if (w[i].rc == KL_OK)
				t->waiter_ok++;
			else if (w[i].rc == KL_EPROVIDER)
				t->waiter_eprov++;
			else if (w[i].rc == KL_ETIMEDOUT &&
				 w[i].start_ns + T21_WAIT * MS <= t_kill)
				t->waiter_early++; /* before the kill */
			else
				fail_note("%s: waiter %d: %s: %s", t->name, i,
					  kl_strerror(w[i].rc), w[i].msg);
			if (ms > T21_WAIT + GRACE_MS + T21_CONNECT + SCHED_MS)
				fail_note("%s: waiter %d returned after %lld "
					  "ms (timeout %d ms)",
					  t->name, i, (long long)ms, T21_WAIT);
			kl_lock_free(w[i].l);
		}
		if (t->keeps) {
			/* Held across the restart and one renewal after it
			 * (a restart slower than the ttl loses it). */
			test_sleep_ms(T21_TTL / 3 + 300);
		} else {
			/* They end when they see their lease lost. */
			limit = now_ms() + T21_TTL / 3 + 3 * SLACK_MS;
			for (int i = 0; i < T21_KEYS; i++)
				while (atomic_load(&h[i].state) != 2 &&
				       now_ms() < limit)
					test_sleep_ms(10);
		}
		for (int i = 0; i < T21_KEYS; i++)
			atomic_store(&h[i].stop, true);
		for (int i = 0; i < T21_KEYS; i++) {
			test_thread_join(h[i].th);
			if (h[i].epoch > 0 || !t->keeps)
				t->delayed += h[i].delayed;
			if (t->keeps && h[i].invalid_ns != 0) {
				/* Not renewed in time: lost, and said so. */
				t->aof_lost++;
				/* The key may still be its own (then the
				 * release succeeds) or not. */
				int ends = tev_count(&h[i].ev,
							KL_EV_RELEASED) +
					   tev_count(&h[i].ev,
							KL_EV_RELEASE_FAILED);

				if (tev_wait(&h[i].ev, KL_EV_LOST, 3000) != 1 ||
				    ends != 1)
					fail_note("%s: key %d: lost but events "
						  "lost %d, released %d",
						  t->name, i,
						  tev_count(&h[i].ev,
							       KL_EV_LOST),
						  tev_count(&h[i].ev,
							       KL_EV_RELEASED));
				continue;
			}
			if (t->keeps) {
				if (tev_count(&h[i].ev, KL_EV_RELEASED) !=
					    1 ||
				    tev_count(&h[i].ev, KL_EV_LOST) != 0)
					fail_note("%s: key %d: released %d, "
						  "lost %d",
						  t->name, i,
						  tev_count(&h[i].ev,
							       KL_EV_RELEASED),
						  tev_count(&h[i].ev,
							       KL_EV_LOST));
				else
					t->released++;
				continue;
			}
			/* Without persistence the old leases are lost
			 * within one renewal interval (ttl/3). */
			if (h[i].invalid_ns == 0) {
				fail_note("%s: key %d: the lease stayed valid "
					  "after a restart without "
					  "persistence",
					  t->name, i);
				continue;
			}
			if ((h[i].invalid_ns - t_up) / MS > t->worst_lost_ms)
				t->worst_lost_ms =
					(h[i].invalid_ns - t_up) / MS;
			if (h[i].invalid_ns - t_up >
			    (T21_TTL / 3 + SLACK_MS) * MS)
				fail_note("%s: key %d: lease seen lost %lld ms "
					  "after the restart",
					  t->name, i,
					  (long long)((h[i].invalid_ns - t_up) /
						      MS));
			if (tev_wait(&h[i].ev, KL_EV_LOST, 3000) != 1 ||
			    tev_count(&h[i].ev, KL_EV_RELEASED) != 0 ||
			    tev_count(&h[i].ev, KL_EV_RELEASE_FAILED) != 1)
				fail_note("%s: key %d: lost %d, released %d, "
					  "release failed %d",
					  t->name, i,
					  tev_count(&h[i].ev, KL_EV_LOST),
					  tev_count(&h[i].ev,
						       KL_EV_RELEASED),
					  tev_count(&h[i].ev,
						       KL_EV_RELEASE_FAILED));
			else
				t->lost++;
		}
	} else {
		for (int i = 0; i < T21_KEYS; i++)
			atomic_store(&h[i].stop, true);
		for (int i = 0; i < T21_KEYS; i++)
			test_thread_join(h[i].th);
	}
	for (int i = 0; i < T21_KEYS; i++)
		kl_lock_free(h[i].l);
	return ok;
}

static void *
t21_driver(void *arg)
{
	struct t21 *t = arg;
	char prefix[32];

	snprintf(prefix, sizeof prefix, "t21%s%s%s:", t->aof ? "a" : "n",
		 t->rdb ? "r" : "", t->wipe ? "w" : "");
	for (int i = 0; i < T21_CLIENTS; i++) {
		t->hp[i] = open_port(t->s->port, prefix, T21_OPTS);
		t->wp[i] = open_port(t->s->port, prefix, T21_OPTS);
		if (t->hp[i] == NULL || t->wp[i] == NULL)
			return NULL;
	}
	t->up_ns = t->s->spawned_ns;
	for (int c = 0; c < t->cycles; c++) {
		if (!t21_cycle(t, c))
			break;
		t->done++;
	}
	for (int i = 0; i < T21_CLIENTS; i++) {
		kl_provider_free(t->hp[i]);
		kl_provider_free(t->wp[i]);
	}
	return NULL;
}

/* Two modes at once, each on a server of its own: kill -9 and restart
 * 0.2 s later, cycles times; the ledger checks every grant. */
static void
t21_run(struct t21 *t, int cycles)
{
	int64_t t0 = now_ms();

	for (int m = 0; m < 2; m++) {
		t[m].keeps = t[m].aof && !t[m].wipe;
		t[m].cycles = cycles;
		t[m].s = &g_srv[m];
		ledger_init(&t[m].L);
		ck_assert(srv_start(t[m].s, t[m].aof));
	}
	for (int m = 0; m < 2; m++)
		test_thread_start(&t[m].th, t21_driver, &t[m]);
	for (int m = 0; m < 2; m++)
		test_thread_join(t[m].th);
	for (int m = 0; m < 2; m++) {
		ledger_check(&t[m].L, t[m].name, true);
		printf("%s: %d/%d cycles, %zu grants, %ld writes, waiters "
		       "%ld granted %ld KL_EPROVIDER %ld timed out before the "
		       "kill (slowest %lld ms), "
		       "%ld released, %ld lost (slowest %lld ms after the "
		       "restart), %ld not renewed in time, %ld grants delayed "
		       "by the restart guard (%lld s)\n",
		       t[m].name, t[m].done, cycles, t[m].L.n, t[m].L.writes,
		       t[m].waiter_ok, t[m].waiter_eprov, t[m].waiter_early,
		       (long long)t[m].worst_wait_ms, t[m].released,
		       t[m].lost, (long long)t[m].worst_lost_ms, t[m].aof_lost,
		       t[m].delayed, (long long)((now_ms() - t0) / 1000));
	}
	fails_assert();
	for (int m = 0; m < 2; m++) {
		ck_assert_int_eq(t[m].done, cycles);
		ledger_free(&t[m].L);
		if (t[m].keeps) {
			ck_assert_int_eq(t[m].released + t[m].aof_lost,
					 (long)cycles * T21_KEYS);
		} else {
			/* The guard delayed grants (each was checked to
			 * come no earlier than the longest ttl). */
			ck_assert_int_ge(t[m].delayed, 1);
			ck_assert_int_eq(t[m].lost, (long)cycles * T21_KEYS);
		}
	}
}

START_TEST(test_t21_kill9_restart)
{
	struct t21 t[2];

	memset(t, 0, sizeof t);
	t[0].aof = true;
	t[0].name = "T21 appendfsync always";
	t[1].name = "T21 no persistence";
	t21_run(t, (int)kl_test_scaled(50, 3));
}
END_TEST

/* The same over restarts that load an older snapshot (fences and locks
 * rolled back: the snapshot is taken at the start of each cycle) and over
 * lost data (appendfsync always, the data folder wiped before each
 * restart: a durable new server that holds nothing). */
START_TEST(test_t21_snapshot_and_wiped)
{
	struct t21 t[2];

	memset(t, 0, sizeof t);
	t[0].rdb = true;
	t[0].name = "T21 snapshot restarts";
	t[1].aof = true;
	t[1].wipe = true;
	t[1].name = "T21 wiped appendfsync always";
	t21_run(t, (int)kl_test_scaled(10, 3));
}
END_TEST

/* ================================================================== */
/* T22: pause, partition, lost replies, lost updates, signals          */

#define T22_TTL 600
#define T22_OPTS                                                           \
	"ttl=600ms&timeout=300ms&connect_timeout=300ms&heartbeat=400ms&"   \
	"restart_guard=0"

struct sig_waiter {
	kl_provider *p;
	const char *key;
	int64_t timeout_ms;
	struct storm *storm;
	int slot;
	pthread_t th;
	int rounds;
	/* Outputs. */
	long ok, timedout, eprov;
	int64_t worst_late_ms;
};

/* Waits repeatedly on a key held by someone else, under the storm: each
 * wait ends by its timeout + GRACE_MS with KL_ETIMEDOUT (or KL_EPROVIDER
 * while the server cannot answer), never EINTR's doing. */
static void *
sig_waiter_main(void *arg)
{
	struct sig_waiter *w = arg;
	struct test_events ev;
	kl_lock *l = lock_make(w->p, w->key, w->timeout_ms, 0, &ev);

	storm_join(w->storm, w->slot);
	for (int i = 0; i < w->rounds; i++) {
		kl_lease *lease;
		kl_error err;
		int64_t t0 = now_ns(), late;
		int rc;

		memset(&err, 0, sizeof err);
		rc = kl_lock_acquire(l, NULL, &lease, &err);
		late = (now_ns() - t0) / MS - w->timeout_ms;
		if (late > w->worst_late_ms)
			w->worst_late_ms = late;
		if (rc == KL_OK) {
			w->ok++;
			kl_lease_release(lease);
		} else if (rc == KL_ETIMEDOUT) {
			w->timedout++;
		} else if (rc == KL_EPROVIDER) {
			w->eprov++;
		} else {
			fail_note("waiter on %s: %s: %s", w->key,
				  kl_strerror(rc), err.message);
		}
		if (strstr(err.message, "nterrupt") != NULL)
			fail_note("waiter on %s: EINTR seen: %s", w->key,
				  err.message);
		if (late > GRACE_MS + SCHED_MS)
			fail_note("waiter on %s: returned %lld ms after its "
				  "timeout (%s)",
				  w->key, (long long)late, kl_strerror(rc));
	}
	storm_leave(w->storm, w->slot);
	kl_lock_free(l);
	return NULL;
}

/* Polls kl_lease_valid(lease) every ms until false or until limit_ns:
 * *last_valid is the last time taken before a check that said true. */
static int64_t
watch_valid(kl_lease *lease, int64_t limit_ns, int64_t *last_valid)
{
	for (;;) {
		int64_t t = now_ns();

		if (!kl_lease_valid(lease))
			return now_ns();
		*last_valid = t;
		if (t > limit_ns)
			return 0;
		test_sleep_ms(1);
	}
}

/* When key's lock expires on the server, on our clock: [low, high]. */
static void
expiry_of(redisContext *c, const char *lock, int64_t *low, int64_t *high)
{
	const char *argv[2] = { "PTTL", lock };
	int64_t t0 = now_ns();
	long long left = cmd_int(c, 2, argv);
	int64_t t1 = now_ns();

	*low = t0 + (left - 1) * MS;
	*high = t1 + (left + 1) * MS;
}

/* Waits (up to 2 s) until the lock's ttl on the server jumps up: a
 * renewal just landed, so the next one is a third of the ttl away and a
 * fault injected now cannot race with one in flight. */
static void
after_renewal(redisContext *c, const char *lock)
{
	const char *argv[2] = { "PTTL", lock };
	long long last = cmd_int(c, 2, argv), left;
	int64_t limit = now_ms() + 2000;

	while (now_ms() < limit) {
		left = cmd_int(c, 2, argv);
		if (left > last + 20)
			return;
		last = left;
		test_sleep_ms(1);
	}
	fail_note("no renewal of %s seen in 2 s", lock);
}

/* SIGSTOP the server for twice the ttl: the holder sees its lease invalid
 * before the server could let it expire; waiters under a SIGUSR1 storm
 * return by their timeout + 100 ms; all works after SIGCONT. */
START_TEST(test_t22_pause)
{
	const char *prefix = "t22s:";
	struct sig_waiter w[4];
	struct storm storm;
	kl_provider *p, *q;
	struct test_events ev, evb;
	kl_lock *l, *lb;
	kl_lease *lease, *busy, *again;
	kl_error err;
	redisContext *c;
	char lock[200];
	int64_t low, high, t_stop, inv, last_valid = 0;
	int rounds = (int)kl_test_scaled(3, 1);

	ck_assert(srv_start(&g_srv[0], false));
	p = open_port(g_srv[0].port, prefix, T22_OPTS);
	q = open_port(g_srv[0].port, prefix, T22_OPTS);
	fails_assert();
	c = connect_port(g_srv[0].port, 2000);
	ck_assert_ptr_nonnull(c);
	key_name(lock, sizeof lock, prefix, "held", "");
	storm_start(&storm);
	lb = lock_make(q, "busy", 5000, 60000, &evb);
	ck_assert_int_eq(kl_lock_acquire(lb, NULL, &busy, &err), KL_OK);
	for (int r = 0; r < rounds; r++) {
		l = lock_make(p, "held", 5000, T22_TTL, &ev);
		ck_assert_int_eq(kl_lock_acquire(l, NULL, &lease, &err),
				 KL_OK);
		test_sleep_ms(T22_TTL / 2);
		for (int i = 0; i < 4; i++) {
			w[i] = (struct sig_waiter){ .p = i % 2 ? p : q,
						    .key = "busy",
						    .timeout_ms = 300 + 200 * i,
						    .storm = &storm,
						    .slot = i,
						    .rounds = 4 };
			test_thread_start(&w[i].th, sig_waiter_main, &w[i]);
		}
		after_renewal(c, lock);
		expiry_of(c, lock, &low, &high);
		t_stop = now_ns();
		ck_assert_int_eq(kill(g_srv[0].pid, SIGSTOP), 0);
		inv = watch_valid(lease, t_stop + 3 * T22_TTL * MS,
				  &last_valid);
		ck_assert_msg(inv != 0, "lease still valid with the server "
					"stopped");
		/* Safety: never valid past the server's expiry of it. */
		ck_assert_msg(last_valid < high,
			      "lease seen valid %lld ms after its key expired",
			      (long long)((last_valid - high) / MS));
		ck_assert_msg(inv <= t_stop + (T22_TTL + 300) * MS,
			      "lease seen invalid %lld ms after SIGSTOP "
			      "(ttl %d)",
			      (long long)((inv - t_stop) / MS), T22_TTL);
		test_sleep_ms(2 * T22_TTL - (now_ns() - t_stop) / MS);
		ck_assert_int_eq(kill(g_srv[0].pid, SIGCONT), 0);
		for (int i = 0; i < 4; i++)
			test_thread_join(w[i].th);
		ck_assert_int_eq(tev_wait(&ev, KL_EV_LOST, 3000), 1);
		kl_lease_release(lease);
		ck_assert_int_eq(tev_count(&ev, KL_EV_RELEASED), 0);
		kl_lock_free(l);
		/* The server works again, and the key expired. */
		l = lock_make(q, "held", 5000, T22_TTL, &ev);
		ck_assert_int_eq(kl_lock_acquire(l, NULL, &again, &err),
				 KL_OK);
		kl_lease_release(again);
		kl_lock_free(l);
		for (int i = 0; i < 4; i++) {
			ck_assert_int_eq(w[i].ok, 0);
			printf("T22 pause: waiter %d: %ld timed out, %ld "
			       "KL_EPROVIDER, at most %lld ms late\n",
			       i, w[i].timedout, w[i].eprov,
			       (long long)w[i].worst_late_ms);
		}
		printf("T22 pause: invalid %lld ms after SIGSTOP, %lld ms "
		       "before its key could expire\n",
		       (long long)((inv - t_stop) / MS),
		       (long long)((low - last_valid) / MS));
	}
	printf("T22 pause: %ld SIGUSR1 sent, %ld handled\n",
	       storm_stop(&storm), atomic_load(&g_usr1));
	fails_assert();
	kl_lease_release(busy);
	kl_lock_free(lb);
	redisFree(c);
	kl_provider_free(p);
	kl_provider_free(q);
}
END_TEST

/* A holder behind the proxy, partitioned (black hole) for 1 s: it sees
 * its lease invalid before the key expires on the server, and a waiter
 * connected directly gets the key only after that; waiters behind the
 * proxy under a SIGUSR1 storm return by their timeout + 100 ms. */
START_TEST(test_t22_partition)
{
	const char *prefix = "t22p:";
	struct sig_waiter w[4];
	struct storm storm;
	struct proxy x;
	kl_provider *pp, *dp;
	struct test_events ev, evc, evb;
	kl_lock *l, *lc, *lb;
	kl_lease *lease, *busy;
	kl_error err;
	redisContext *c;
	char lock[200];
	int rounds = (int)kl_test_scaled(3, 1);

	ck_assert(srv_start(&g_srv[0], false));
	ck_assert(proxy_start(&x, g_srv[0].port));
	pp = open_port(x.port, prefix, T22_OPTS);
	dp = open_port(g_srv[0].port, prefix, T22_OPTS);
	fails_assert();
	c = connect_port(g_srv[0].port, 2000);
	ck_assert_ptr_nonnull(c);
	key_name(lock, sizeof lock, prefix, "part", "");
	storm_start(&storm);
	lb = lock_make(dp, "busy", 5000, 60000, &evb);
	ck_assert_int_eq(kl_lock_acquire(lb, NULL, &busy, &err), KL_OK);
	for (int r = 0; r < rounds; r++) {
		kl_lease *theirs;
		int64_t low, high, t_part, inv, last_valid = 0, g;
		int rc;

		l = lock_make(pp, "part", 5000, T22_TTL, &ev);
		lc = lock_make(dp, "part", 5000, T22_TTL, &evc);
		ck_assert_int_eq(kl_lock_acquire(l, NULL, &lease, &err),
				 KL_OK);
		test_sleep_ms(T22_TTL / 2);
		for (int i = 0; i < 4; i++) {
			w[i] = (struct sig_waiter){ .p = pp,
						    .key = "busy",
						    .timeout_ms = 200 + 100 * i,
						    .storm = &storm,
						    .slot = i,
						    .rounds = 3 };
			test_thread_start(&w[i].th, sig_waiter_main, &w[i]);
		}
		after_renewal(c, lock);
		atomic_store(&x.mode, BH_ON);
		t_part = now_ns();
		expiry_of(c, lock, &low, &high);
		inv = watch_valid(lease, t_part + 3 * T22_TTL * MS,
				  &last_valid);
		ck_assert_msg(inv != 0, "lease still valid while partitioned");
		/* The direct client waits for the key's expiry. */
		rc = kl_lock_acquire(lc, NULL, &theirs, &err);
		g = now_ns();
		ck_assert_msg(rc == KL_OK, "direct client: %s: %s",
			      kl_strerror(rc), err.message);
		ck_assert_msg(last_valid < high && last_valid < g,
			      "partitioned lease seen valid %lld ms after "
			      "its key expired",
			      (long long)((last_valid - low) / MS));
		ck_assert_msg(inv <= t_part + (T22_TTL + 300) * MS,
			      "lease seen invalid %lld ms into the partition",
			      (long long)((inv - t_part) / MS));
		test_sleep_ms(1000 - (now_ns() - t_part) / MS);
		atomic_store(&x.mode, BH_OFF);
		for (int i = 0; i < 4; i++)
			test_thread_join(w[i].th);
		ck_assert_int_eq(tev_wait(&ev, KL_EV_LOST, 3000), 1);
		kl_lease_release(lease);
		ck_assert_int_eq(tev_count(&ev, KL_EV_RELEASED), 0);
		ck_assert(kl_lease_valid(theirs));
		kl_lease_release(theirs);
		ck_assert_int_eq(tev_count(&evc, KL_EV_RELEASED), 1);
		kl_lock_free(l);
		kl_lock_free(lc);
		for (int i = 0; i < 4; i++)
			ck_assert_int_eq(w[i].ok, 0);
		printf("T22 partition: invalid %lld ms into it, %lld ms "
		       "before the key could expire; the direct client got "
		       "it %lld ms in\n",
		       (long long)((inv - t_part) / MS),
		       (long long)((low - last_valid) / MS),
		       (long long)((g - t_part) / MS));
	}
	printf("T22 partition: %ld SIGUSR1 sent, %ld handled\n",
	       storm_stop(&storm), atomic_load(&g_usr1));
	fails_assert();
	kl_lease_release(busy);
	kl_lock_free(lb);
	redisFree(c);
	kl_provider_free(pp);
	kl_provider_free(dp);
	proxy_stop(&x);
}
END_TEST

struct lr_holder {
	kl_lock *l;
	pthread_t th;
	int rc;
	kl_lease *lease;
	int64_t g_ns;
	char msg[256];
};

static void *
lr_holder_main(void *arg)
{
	struct lr_holder *h = arg;
	kl_error err;

	memset(&err, 0, sizeof err);
	h->rc = kl_lock_acquire(h->l, NULL, &h->lease, &err);
	h->g_ns = now_ns();
	snprintf(h->msg, sizeof h->msg, "%s", err.message);
	return NULL;
}

/* The reply to the attempt that grants a waiter is lost (the proxy lets
 * the script through and then black-holes 1 s).  The waiter reconnects and
 * asks again; the server says the key is already its own.  Its lease must
 * not count as valid past the key's expiry on the server, and a direct
 * waiter queued behind must never hold the key at the same time. */
START_TEST(test_t22_lost_grant_reply)
{
	const char *prefix = "t22r:";
	const char *opts = "ttl=2s&timeout=1500ms&connect_timeout=500ms&"
			   "heartbeat=400ms&restart_guard=0";
	struct proxy x;
	kl_provider *pp, *dp;
	struct test_events evh, evw, evc;
	struct lr_holder w, cw;
	kl_lock *lh;
	kl_lease *first;
	kl_error err;
	redisContext *c;
	char lock[200];
	int rounds = (int)kl_test_scaled(2, 1);

	ck_assert(srv_start(&g_srv[0], false));
	ck_assert(proxy_start(&x, g_srv[0].port));
	pp = open_port(x.port, prefix, opts);
	dp = open_port(g_srv[0].port, prefix, opts);
	fails_assert();
	c = connect_port(g_srv[0].port, 2000);
	ck_assert_ptr_nonnull(c);
	key_name(lock, sizeof lock, prefix, "r", "");
	for (int r = 0; r < rounds; r++) {
		int64_t inv, last_valid = 0, low, high, t_arm;
		size_t nh, nw;

		lh = lock_make(dp, "r", 5000, 0, &evh);
		ck_assert_int_eq(kl_lock_acquire(lh, NULL, &first, &err),
				 KL_OK);
		memset(&w, 0, sizeof w);
		memset(&cw, 0, sizeof cw);
		w.l = lock_make(pp, "r", 20000, 0, &evw);
		cw.l = lock_make(dp, "r", 20000, 0, &evc);
		test_thread_start(&w.th, lr_holder_main, &w);
		for (int i = 0; i < 2000; i++) {
			if (kl_provider_status(dp, "r", &nh, &nw, &err) ==
				    KL_OK &&
			    nw == 1)
				break;
			test_sleep_ms(2);
		}
		ck_assert_int_eq((int)nw, 1);
		test_thread_start(&cw.th, lr_holder_main, &cw);
		for (int i = 0; i < 2000; i++) {
			if (kl_provider_status(dp, "r", &nh, &nw, &err) ==
				    KL_OK &&
			    nw == 2)
				break;
			test_sleep_ms(2);
		}
		ck_assert_int_eq((int)nw, 2);
		/* The waiter behind the proxy is next: its next script
		 * (the attempt after the wake-up) passes, its reply not. */
		atomic_store(&x.mode, BH_ARMED);
		kl_lease_release(first);
		kl_lock_free(lh);
		for (int i = 0; i < 3000 && atomic_load(&x.mode) != BH_ON;
		     i++)
			test_sleep_ms(1);
		ck_assert_int_eq(atomic_load(&x.mode), BH_ON);
		t_arm = atomic_load(&x.armed_ns);
		test_sleep_ms(1000 - (now_ns() - t_arm) / MS);
		atomic_store(&x.mode, BH_OFF);
		test_thread_join(w.th);
		ck_assert_msg(w.rc == KL_OK || w.rc == KL_EPROVIDER,
			      "proxied waiter: %s: %s", kl_strerror(w.rc),
			      w.msg);
		if (w.rc == KL_OK) {
			/* Granted: check when its key expires on the
			 * server, then watch the lease until it is lost or
			 * released. */
			expiry_of(c, lock, &low, &high);
			inv = watch_valid(w.lease, now_ns() + 6000 * MS,
					  &last_valid);
			if (inv == 0) {
				kl_lease_release(w.lease);
				test_thread_join(cw.th);
			} else {
				test_thread_join(cw.th);
				kl_lease_release(w.lease);
			}
			ck_assert_msg(cw.rc == KL_OK, "direct waiter: %s: %s",
				      kl_strerror(cw.rc), cw.msg);
			ck_assert_msg(last_valid < cw.g_ns,
				      "round %d: the proxied waiter saw its "
				      "lease valid %lld ms after the direct "
				      "waiter was granted the key (key "
				      "expiry %lld ms before)",
				      r,
				      (long long)((last_valid - cw.g_ns) / MS),
				      (long long)((last_valid - high) / MS));
			printf("T22 lost grant reply: granted %lld ms after "
			       "the reply was lost; %s\n",
			       (long long)((w.g_ns - t_arm) / MS),
			       inv == 0 ? "kept and released"
					: "lost before the next grant");
		} else {
			test_thread_join(cw.th);
			printf("T22 lost grant reply: %s\n", w.msg);
		}
		if (cw.rc == KL_OK)
			kl_lease_release(cw.lease);
		kl_lock_free(w.l);
		kl_lock_free(cw.l);
	}
	fails_assert();
	redisFree(c);
	kl_provider_free(pp);
	kl_provider_free(dp);
	proxy_stop(&x);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Read-modify-write of a set in a side store, with and without fencing */

#define RMW_CLIENTS 8
#define RMW_ELEMS 65536
#define RMW_TTL 400
#define RMW_OPTS                                                           \
	"ttl=400ms&timeout=300ms&connect_timeout=300ms&heartbeat=400ms&"   \
	"restart_guard=0"

struct rmw {
	bool fencing;
	int64_t end_ns;
	struct storm *storm;
	struct ledger L;
	pthread_mutex_t mu; /* the store */
	unsigned char set[RMW_ELEMS / 8];
	unsigned char acked[RMW_ELEMS / 8];
	uint64_t high;
	long writes, rejected;
	atomic_long next_elem;
	atomic_int holder; /* client index holding, -1 none */
	atomic_int holder_proxied;
	atomic_long grants;
	long acquired, timedout, eprov;
	int64_t worst_late_ms;
};

struct rmw_client {
	struct rmw *m;
	kl_provider *p;
	int idx;
	bool proxied;
	unsigned seed;
	pthread_t th;
	long acquired, timedout, eprov;
	int64_t worst_late_ms;
};

static void
store_read(struct rmw *m, uint64_t fence, unsigned char *out)
{
	pthread_mutex_lock(&m->mu);
	if (m->fencing && fence > m->high)
		m->high = fence;
	memcpy(out, m->set, sizeof m->set);
	pthread_mutex_unlock(&m->mu);
}

static bool
store_write(struct rmw *m, uint64_t fence, const unsigned char *in,
	    long elem)
{
	bool ok;

	pthread_mutex_lock(&m->mu);
	ok = !m->fencing || fence >= m->high;
	if (ok) {
		if (fence > m->high)
			m->high = fence;
		memcpy(m->set, in, sizeof m->set);
		m->acked[elem / 8] |= (unsigned char)(1u << (elem % 8));
		m->writes++;
	} else {
		m->rejected++;
	}
	pthread_mutex_unlock(&m->mu);
	return ok;
}

static void *
rmw_client_main(void *arg)
{
	struct rmw_client *k = arg;
	struct rmw *m = k->m;
	struct test_events ev;
	kl_lock *l = lock_make(k->p, "set", 1000, RMW_TTL, &ev);
	unsigned char *buf = malloc(RMW_ELEMS / 8);

	storm_join(m->storm, k->idx);
	while (now_ns() < m->end_ns && buf != NULL) {
		kl_lease *lease;
		kl_error err;
		int64_t t0 = now_ns(), late;
		uint64_t fence;
		int rc, gi, batch;

		memset(&err, 0, sizeof err);
		rc = kl_lock_acquire(l, NULL, &lease, &err);
		late = (now_ns() - t0) / MS - 1000;
		if (late > k->worst_late_ms)
			k->worst_late_ms = late;
		if (late > GRACE_MS + SCHED_MS)
			fail_note("client %d: returned %lld ms after its "
				  "timeout (%s)",
				  k->idx, (long long)late, kl_strerror(rc));
		if (strstr(err.message, "nterrupt") != NULL)
			fail_note("client %d: EINTR seen: %s", k->idx,
				  err.message);
		if (rc == KL_ETIMEDOUT) {
			k->timedout++;
			continue;
		}
		if (rc == KL_EPROVIDER) {
			k->eprov++;
			test_sleep_ms(20);
			continue;
		}
		if (rc != KL_OK) {
			fail_note("client %d: %s: %s", k->idx, kl_strerror(rc),
				  err.message);
			break;
		}
		k->acquired++;
		fence = kl_lease_fence(lease);
		gi = ledger_grant(&m->L, 0, 0, fence, now_ns());
		atomic_store(&m->holder_proxied, k->proxied);
		atomic_store(&m->holder, k->idx);
		atomic_fetch_add(&m->grants, 1);
		/* A job of 3 to 6 steps, trusting the renewal thread. */
		batch = 3 + (int)(rand_r(&k->seed) % 4);
		for (int b = 0; b < batch; b++) {
			long elem = atomic_fetch_add(&m->next_elem, 1);

			if (elem >= RMW_ELEMS)
				break;
			/* A careful client checks its lease before each
			 * step; a naive one (no fencing) only had it once. */
			t0 = now_ns();
			if (m->fencing && !kl_lease_valid(lease))
				break;
			if (m->fencing)
				ledger_valid(&m->L, gi, t0);
			store_read(m, fence, buf);
			test_sleep_ms(rand_r(&k->seed) % 201);
			buf[elem / 8] |= (unsigned char)(1u << (elem % 8));
			test_sleep_ms(rand_r(&k->seed) % 201);
			t0 = now_ns();
			if (m->fencing && !kl_lease_valid(lease))
				break;
			if (m->fencing)
				ledger_valid(&m->L, gi, t0);
			store_write(m, fence, buf, elem);
		}
		atomic_store(&m->holder, -1);
		kl_lease_release(lease);
	}
	storm_leave(m->storm, k->idx);
	free(buf);
	kl_lock_free(l);
	return NULL;
}

/* One run of the workload for secs seconds with the nemesis: pause the
 * server for twice the ttl; black-hole the proxy 1 s as soon as a client
 * behind it holds the key.  Returns the lost updates. */
static long
rmw_run(struct srv *s, struct proxy *x, bool fencing, bool pauses,
	int64_t secs, struct storm *storm, const char *prefix)
{
	struct rmw *m = calloc(1, sizeof *m);
	struct rmw_client k[RMW_CLIENTS];
	long lost = 0, acked = 0, bh = 0, stops = 0, targeted = 0;
	int64_t t0 = now_ns();

	ck_assert_ptr_nonnull(m);
	m->fencing = fencing;
	m->storm = storm;
	pthread_mutex_init(&m->mu, NULL);
	ledger_init(&m->L);
	atomic_store(&m->holder, -1);
	m->end_ns = now_ns() + secs * 1000 * MS;
	for (int i = 0; i < RMW_CLIENTS; i++) {
		k[i] = (struct rmw_client){ .m = m,
					    .idx = i,
					    .proxied = i % 2 == 1,
					    .seed = (unsigned)(i + 1) * 7777u };
		k[i].p = open_port(i % 2 ? x->port : s->port, prefix,
				   RMW_OPTS);
	}
	fails_assert();
	for (int i = 0; i < RMW_CLIENTS; i++)
		test_thread_start(&k[i].th, rmw_client_main, &k[i]);
	/* The nemesis. */
	while (now_ns() + 3000 * MS < m->end_ns) {
		int64_t limit = now_ns() + 3000 * MS;
		long g0;

		test_sleep_ms(300);
		/* A client behind the proxy was just granted the key. */
		g0 = atomic_load(&m->grants);
		while (now_ns() < limit &&
		       !(atomic_load(&m->grants) != g0 &&
			 atomic_load(&m->holder) >= 0 &&
			 atomic_load(&m->holder_proxied)))
			test_sleep_ms(1);
		if (atomic_load(&m->grants) != g0)
			targeted++;
		atomic_store(&x->mode, BH_ON);
		test_sleep_ms(1000);
		atomic_store(&x->mode, BH_OFF);
		bh++;
		test_sleep_ms(300);
		if (!pauses || now_ns() + 2000 * MS >= m->end_ns)
			continue;
		kill(s->pid, SIGSTOP);
		test_sleep_ms(2 * RMW_TTL);
		kill(s->pid, SIGCONT);
		stops++;
	}
	for (int i = 0; i < RMW_CLIENTS; i++) {
		test_thread_join(k[i].th);
		m->acquired += k[i].acquired;
		m->timedout += k[i].timedout;
		m->eprov += k[i].eprov;
		if (k[i].worst_late_ms > m->worst_late_ms)
			m->worst_late_ms = k[i].worst_late_ms;
		kl_provider_free(k[i].p);
	}
	for (long e = 0; e < RMW_ELEMS; e++) {
		bool a = m->acked[e / 8] & (1u << (e % 8));
		bool in = m->set[e / 8] & (1u << (e % 8));

		acked += a;
		lost += a && !in;
	}
	if (fencing)
		ledger_check(&m->L, "T22 fenced read-modify-write", true);
	printf("T22 read-modify-write, fencing %s, %lld s: %ld grants, %ld "
	       "timeouts, %ld KL_EPROVIDER (at most %lld ms late), %ld "
	       "acknowledged writes, %ld rejected, %ld lost updates; %ld "
	       "black holes (%ld on a new grant behind the proxy), %ld "
	       "pauses\n",
	       fencing ? "on" : "off", (long long)((now_ns() - t0) / MS / 1000),
	       m->acquired, m->timedout, m->eprov,
	       (long long)m->worst_late_ms, acked, m->rejected, lost, bh,
	       targeted, stops);
	ledger_free(&m->L);
	free(m);
	return lost;
}

/* 8 clients, half of them behind the proxy, read-modify-write a set under
 * the lock with 0-200 ms latency per step while the nemesis pauses and
 * partitions.  With fencing, 0 lost updates; without, the harness must
 * see some (up to 5 runs), or it could not tell. */
START_TEST(test_t22_lost_updates)
{
	struct storm storm;
	struct proxy x;
	int64_t secs = kl_test_scaled(20, 8);
	long lost_off = 0;
	int runs = 0;

	ck_assert(srv_start(&g_srv[0], false));
	ck_assert(proxy_start(&x, g_srv[0].port));
	storm_start(&storm);
	ck_assert_int_eq(rmw_run(&g_srv[0], &x, true, true, secs, &storm,
				 "t22f:"),
			 0);
	fails_assert();
	/* Partitions alone make the lost updates; a pause cannot (nobody
	 * is granted while the server is stopped). */
	while (lost_off == 0 && runs < 5) {
		lost_off = rmw_run(&g_srv[0], &x, false, false, secs / 2 + 2,
				   &storm, "t22n:");
		runs++;
	}
	printf("T22 read-modify-write: %ld SIGUSR1 sent, %ld handled\n",
	       storm_stop(&storm), atomic_load(&g_usr1));
	fails_assert();
	ck_assert_msg(lost_off > 0,
		      "no lost update without fencing in %d runs: the "
		      "harness cannot see what fencing prevents",
		      runs);
	proxy_stop(&x);
}
END_TEST

/* ------------------------------------------------------------------ */

static TCase *
tcase_new(Suite *s, const char *name, int timeout)
{
	double scale = kl_test_scale();

	return test_tcase(s, name, (double)timeout * (scale > 1 ? scale : 1),
			  setup, teardown);
}

static Suite *
redis_chaos_suite(void)
{
	Suite *s = suite_create("redis_chaos");
	TCase *tc;

	tc = tcase_new(s, "T23", 300);
	tcase_add_test(tc, test_t23_wrong_tokens);
	tcase_add_test(tc, test_t23_external_expiry);
	tcase_add_test(tc, test_t23_fences_8_clients);
	tcase_add_test(tc, test_t23_fences_aof_restart);

	tc = tcase_new(s, "restarts", 120);
	tcase_add_test(tc, test_fence_after_snapshot_restart);
	tcase_add_test(tc, test_shared_fences_snapshot_restart);
	tcase_add_test(tc, test_wiped_durable_server_guarded);
	tcase_add_test(tc, test_fresh_server_waits);
	tcase_add_test(tc, test_guard_covers_longest_ttl);
	tcase_add_test(tc, test_aof_off_at_runtime_marked);
	tcase_add_test(tc, test_durable_restart_keeps_guard);
	tcase_add_test(tc, test_flushall_guarded);
	tcase_add_test(tc, test_shared_durable_restart);
	tcase_add_test(tc, test_shared_lossy_restart);

	tc = tcase_new(s, "T22", 300);
	tcase_add_test(tc, test_t22_pause);
	tcase_add_test(tc, test_t22_partition);
	tcase_add_test(tc, test_t22_lost_grant_reply);
	tcase_add_test(tc, test_t22_lost_updates);

	tc = tcase_new(s, "T21", 900);
	tcase_add_test(tc, test_t21_kill9_restart);
	tcase_add_test(tc, test_t21_snapshot_and_wiped);
	return s;
}

int
main(void)
{

	srandom((unsigned)getpid() ^ (unsigned)now_ns());
	g_server_bin = getenv("KEYLOCK_TEST_REDIS_SERVER");
	if (g_server_bin == NULL || g_server_bin[0] == '\0' ||
	    access(g_server_bin, X_OK) != 0) {
		printf("SKIP: KEYLOCK_TEST_REDIS_SERVER does not name a "
		       "redis-server (tools/test --only redis sets it)\n");
		return 77;
	}
	test_provider_dir();
	setvbuf(stdout, NULL, _IOLBF, 0);
	return test_run_suite(redis_chaos_suite());
}
