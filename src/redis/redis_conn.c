/* SPDX-License-Identifier: MIT */
/*
 * One connection of the Redis provider, and the Lua scripts it runs.
 *
 * A connection is used by one thread at a time (the provider's pool hands
 * it out).  Commands go through hiredis's argv API only, so keys and values
 * are binary-safe and nothing is ever parsed out of a format string.  We do
 * the I/O ourselves and use hiredis for building commands and parsing
 * replies only: send() writes hiredis's output buffer (blocking socket,
 * with SO_SNDTIMEO as a bound), then recv() feeds its reader until the
 * replies are in by an absolute CLOCK_MONOTONIC deadline.  The socket's
 * SO_RCVTIMEO is a short slice (rcv_ns), so a blocking recv() never
 * outlasts a deadline that is two slices away; closer to the deadline we
 * poll() first.  So a signal (EINTR) never extends a deadline,
 * and a command that misses its deadline marks the connection broken: it
 * is closed, never reused, because a late reply would otherwise be read as
 * the answer to the next command (unless kl__rconn_drain read it first).
 * With rediss:// the same reads and writes go through an OpenSSL session
 * (redis_tls.c).
 *
 * Writing to a socket the server has closed raises SIGPIPE, which would
 * kill a program that did not ignore it: we send with MSG_NOSIGNAL.  Where
 * that flag is missing we block SIGPIPE in the calling thread around the
 * write and consume one that the write raised (the technique libpq uses).
 *
 * The process id (to tell a connection inherited over fork()) and the
 * random bytes for lease tokens are cached, the first per process and the
 * second per thread; a pthread_atfork() child handler drops both caches.
 */
#include "config.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#ifdef HAVE_SYS_RANDOM_H
#include <sys/random.h>
#endif

#include "redis_internal.h"

/* ------------------------------------------------------------------ */
/* Small helpers                                                       */

void
kl__redis_error(kl_error *err, int status, const char *fmt, ...)
{
	va_list ap;

	if (err == NULL)
		return;
	err->status = status;
	va_start(ap, fmt);
	vsnprintf(err->message, sizeof err->message, fmt, ap);
	va_end(ap);
}

int64_t
kl__redis_now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

int64_t
kl__redis_deadline(int64_t ms)
{
	int64_t now = kl__redis_now_ns();

	if (ms < 0 || ms >= (KL_R_NO_DEADLINE - now) / 1000000)
		return KL_R_NO_DEADLINE;
	return now + ms * 1000000;
}

static bool
random_fill(void *buf, size_t n)
{
	unsigned char *p = buf;
	ssize_t r;
	int fd;

#ifdef HAVE_GETRANDOM
	while (n > 0) {
		r = getrandom(p, n, 0);
		if (r < 0 && errno == EINTR)
			continue;
		if (r <= 0)
			break;
		p += r;
		n -= (size_t)r;
	}
	if (n == 0)
		return true;
#endif
	fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC | O_NOCTTY);
	if (fd < 0)
		return false;
	while (n > 0) {
		r = read(fd, p, n);
		if (r < 0 && errno == EINTR)
			continue;
		if (r <= 0)
			break;
		p += r;
		n -= (size_t)r;
	}
	close(fd);
	return n == 0;
}

/* Forks seen by this process's child handler, and the process id. */
static unsigned fork_gen;
static pid_t cached_pid;
static pthread_once_t fork_once = PTHREAD_ONCE_INIT;

/* Runs in the child of fork(), which has this one thread only. */
static void
fork_child(void)
{
	__atomic_store_n(&cached_pid, 0, __ATOMIC_RELAXED);
	__atomic_fetch_add(&fork_gen, 1, __ATOMIC_RELAXED);
}

static void
fork_init(void)
{
	pthread_atfork(NULL, NULL, fork_child);
}

pid_t
kl__redis_getpid(void)
{
	pid_t pid;

	pthread_once(&fork_once, fork_init);
	pid = __atomic_load_n(&cached_pid, __ATOMIC_RELAXED);
	if (pid == 0) {
		pid = getpid();
		__atomic_store_n(&cached_pid, pid, __ATOMIC_RELAXED);
	}
	return pid;
}

/* Random bytes for small requests (tokens) come from a per-thread buffer,
 * refilled RANDOM_POOL bytes at a time; bytes handed out are wiped from it.
 * A child of fork() never reuses its parent's bytes: the generation the
 * buffer was filled in no longer matches. */
#define RANDOM_POOL 256
#define RANDOM_SMALL 64

static _Thread_local struct {
	unsigned char buf[RANDOM_POOL];
	size_t left; /* unused bytes, at the end of buf */
	unsigned gen;
} rnd;

bool
kl__redis_random(void *buf, size_t n)
{
	unsigned gen;

	if (n > RANDOM_SMALL)
		return random_fill(buf, n);
	pthread_once(&fork_once, fork_init);
	gen = __atomic_load_n(&fork_gen, __ATOMIC_RELAXED);
	if (rnd.gen != gen || rnd.left < n) {
		kl__redis_wipe(rnd.buf, sizeof rnd.buf);
		rnd.left = 0;
		if (!random_fill(rnd.buf, sizeof rnd.buf))
			return random_fill(buf, n);
		rnd.left = sizeof rnd.buf;
		rnd.gen = gen;
	}
	memcpy(buf, rnd.buf + sizeof rnd.buf - rnd.left, n);
	kl__redis_wipe(rnd.buf + sizeof rnd.buf - rnd.left, n);
	rnd.left -= n;
	return true;
}

void
kl__redis_wipe(void *p, size_t n)
{
	volatile unsigned char *v = p;

	while (n-- > 0)
		*v++ = 0;
}

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

/* ------------------------------------------------------------------ */
/* The scripts                                                         */

/*
 * Data of one lock key, all under PREFIX{SHA256(key)} so that a Redis
 * Cluster hash tag would keep them in one slot:
 *   PREFIX{h}        the holder's random token, with PX = its ttl
 *   PREFIX{h}:q      ZSET of waiter tokens, score = arrival rank (FIFO)
 *   PREFIX{h}:hb     HASH waiter token -> heartbeat deadline (server ms)
 *   PREFIX{h}:f      the last fence handed out
 *   PREFIX{h}:w:TOK  LIST a waiter blocks on (BLPOP) to be woken
 *
 * Invariants kept by running every change as one script (atomic):
 * - the key is granted only when no token holds it and the caller is the
 *   first live waiter, or nobody live waits: strict FIFO, no barging;
 * - a waiter is live while its heartbeat deadline is ahead of the server
 *   clock; dead ones are removed when met at the head, so a waiter that died
 *   blocks the others at most for its heartbeat;
 * - only the owner's token deletes or extends the key (compare-and-delete,
 *   compare-and-PEXPIRE);
 * - whoever frees the key (release, a waiter leaving) wakes the first live
 *   waiter; waiters also re-check on a timer, so a lost wake-up only delays;
 * - the fence is a counter started from the server's time in microseconds,
 *   started anew from it after a restart that may have lost or rolled back
 *   counters (see NEXT_FENCE): it grows with every grant, whatever the
 *   server restored;
 * - no grant while the restart guard holds (see script_attempt);
 * - the queue, heartbeats and wake lists expire by themselves (PEXPIRE at
 *   twice the heartbeat, refreshed by live waiters), so nothing is left
 *   behind by clients that died.
 * Numbers are written with %.0f: Lua's default formatting would turn a
 * 16-digit microsecond count into an exponent.
 */
#define PRELUDE                                                            \
	"local t = redis.call('TIME')\n"                                   \
	"local now = tonumber(t[1]) * 1000 + "                             \
	"math.floor(tonumber(t[2]) / 1000)\n"                              \
	"local function head(lock, q, hb)\n"                               \
	"  while true do\n"                                                \
	"    local h = redis.call('ZRANGE', q, 0, 0)[1]\n"                 \
	"    if not h then return nil end\n"                               \
	"    if tonumber(redis.call('HGET', hb, h) or '0') > now then\n"   \
	"      return h\n"                                                 \
	"    end\n"                                                        \
	"    redis.call('ZREM', q, h)\n"                                   \
	"    redis.call('HDEL', hb, h)\n"                                  \
	"    redis.call('DEL', lock .. ':w:' .. h)\n"                      \
	"  end\n"                                                          \
	"end\n"                                                            \
	"local function wake(lock, h, ms)\n"                               \
	"  local w = lock .. ':w:' .. h\n"                                 \
	"  if redis.call('LLEN', w) == 0 then\n"                           \
	"    redis.call('LPUSH', w, '1')\n"                                \
	"    redis.call('PEXPIRE', w, ms)\n"                               \
	"  end\n"                                                          \
	"end\n"

/* The next fence of KEYS[4], whose key lives ARGV[5] ms from its creation:
 * the counter's next value, or the server's time in microseconds when
 * there was no counter (new key, expired) or the counter is not above the
 * marker's floor.  A counter started from the clock at T counts at most
 * one per grant, and a grant takes two scripts, far more than a
 * microsecond of the server's time, so the value stays below the clock.
 * The floor is the server's time in microseconds when locks were found
 * possibly missing (see script_mark in provider_redis.c): a restart that
 * lost data or rolled it back to a snapshot, a marker gone.  Every fence
 * issued before that is below the floor, so a counter the server restored
 * (older, or none) is drawn anew from the clock, above every fence before
 * it, as long as the clock does not go back.  INCR keeps the key's
 * expiry, so the fast path costs one command; only a new counter pays
 * TIME and SET. */
#define NEXT_FENCE                                                         \
	"  local fence = redis.call('INCR', KEYS[4])\n"                     \
	"  if fence == 1 or fence <= floor then\n"                          \
	"    local ft = redis.call('TIME')\n"                               \
	"    fence = string.format('%.0f', tonumber(ft[1]) * 1000000 + "    \
	"tonumber(ft[2]))\n"                                                \
	"    redis.call('SET', KEYS[4], fence, 'PX', ARGV[5])\n"            \
	"  end\n"

/* KEYS: lock, q, hb, f, own wake list, the restart marker, the ttl
 * record.  ARGV: token, ttl ms, heartbeat ms, mode ("try": never queue;
 * "join": join the queue, a first attempt; "wait": stay in the queue, the
 * caller may have joined it before), ms to keep the fence and the ttl
 * record, the restart guard in ms (-1: off), "1" when the guard is at
 * least the ttl record, "1" to raise the ttl record to our ttl and renew
 * its expiry (the client does so now and then: it spares the fast path
 * two commands).  Returns {1, fence, record} when granted (also when the
 * key is already ours: a retry after a lost reply), else {0, rank or -1,
 * record, ms the restart guard still holds}; the record is 0 when it was
 * not read.  A retry sets the ttl again: the caller counts the lease from
 * when it sent the retry, so the key must not expire a ttl after the
 * first, unanswered attempt.
 *
 * The ttl record is the longest ttl any client asked for, kept for a day
 * after the last refresh; it is read whenever the guard may hold.  The
 * restart marker (HASH run, dur, start, floor; see provider_redis.c) says
 * since when, in server ms, the server may lack locks that old holders
 * still believe they hold (0: it lacks none), and the fence floor.  While
 * start + the guard is ahead of the server clock nothing is granted: the
 * caller queues and waits as behind a holder.  A marker that vanished
 * while the server ran (FLUSHALL, DEL) took the locks with it: the guard
 * and the floor run from now.
 *
 * Fast path, the uncontended case: no queue key means nobody waits (Redis
 * deletes a queue emptied by its last ZREM, and a queue that expired had
 * only dead waiters), so a free key is granted by SET NX at once, without
 * the queue, heartbeat and wake keys.  Only a "wait" caller (its queue
 * expired meanwhile) also drops its heartbeat and wake list.  Anything
 * else (held, ours already, a queue, the guard) takes the full way
 * below. */
static const char script_attempt[] =
	"local tok = ARGV[1]\n"
	"local rec = 0\n"
	"if ARGV[8] == '1' then\n"
	"  rec = tonumber(redis.call('GET', KEYS[7]) or '0')\n"
	"  if rec < tonumber(ARGV[2]) then\n"
	"    rec = tonumber(ARGV[2])\n"
	"    redis.call('SET', KEYS[7], ARGV[2], 'PX', ARGV[5])\n"
	"  elseif redis.call('PTTL', KEYS[7]) < tonumber(ARGV[5]) / 2 then\n"
	"    redis.call('PEXPIRE', KEYS[7], ARGV[5])\n"
	"  end\n"
	"end\n"
	"local left = 0\n"
	"local need = tonumber(ARGV[6])\n"
	"local mk = redis.call('HMGET', KEYS[6], 'start', 'floor')\n"
	"local gs = mk[1]\n"
	"local floor = tonumber(mk[2] or '0')\n"
	"if not gs or (need > 0 and gs ~= '0') then\n"
	"  local gt = redis.call('TIME')\n"
	"  local gnow = tonumber(gt[1]) * 1000 + "
	"math.floor(tonumber(gt[2]) / 1000)\n"
	"  if not gs then\n"
	"    gs = string.format('%.0f', gnow)\n"
	"    floor = tonumber(gt[1]) * 1000000 + tonumber(gt[2])\n"
	"    redis.call('HSET', KEYS[6], 'run', '?', 'dur', '0', 'start', gs,\n"
	"               'floor', string.format('%.0f', floor))\n"
	"  end\n"
	"  if ARGV[7] == '1' then\n"
	"    if ARGV[8] ~= '1' then\n"
	"      rec = tonumber(redis.call('GET', KEYS[7]) or '0')\n"
	"    end\n"
	"    if rec > need then need = rec end\n"
	"  end\n"
	"  if need > 0 then left = tonumber(gs) + need - gnow end\n"
	"end\n"
	"if left <= 0 and redis.call('EXISTS', KEYS[2]) == 0 and\n"
	"   redis.call('SET', KEYS[1], tok, 'NX', 'PX', ARGV[2]) then\n"
	NEXT_FENCE
	"  if ARGV[4] == 'wait' then\n"
	"    redis.call('HDEL', KEYS[3], tok)\n"
	"    redis.call('DEL', KEYS[5])\n"
	"  end\n"
	"  return {1, fence, rec}\n"
	"end\n"
	"if left < 0 then left = 0 end\n"
	PRELUDE
	"local hbms = tonumber(ARGV[3])\n"
	"local holder = redis.call('GET', KEYS[1])\n"
	"if holder == tok then\n"
	"  redis.call('PEXPIRE', KEYS[1], ARGV[2])\n"
	"  return {1, redis.call('GET', KEYS[4]) or '0', rec}\n"
	"end\n"
	"local h = head(KEYS[1], KEYS[2], KEYS[3])\n"
	"if not holder and (not h or h == tok) and left == 0 then\n"
	NEXT_FENCE
	"  redis.call('SET', KEYS[1], tok, 'PX', ARGV[2])\n"
	"  redis.call('ZREM', KEYS[2], tok)\n"
	"  redis.call('HDEL', KEYS[3], tok)\n"
	"  redis.call('DEL', KEYS[5])\n"
	"  return {1, fence, rec}\n"
	"end\n"
	"if ARGV[4] == 'try' then return {0, -1, rec, left} end\n"
	"if not redis.call('ZSCORE', KEYS[2], tok) then\n"
	"  local last = redis.call('ZRANGE', KEYS[2], -1, -1, 'WITHSCORES')\n"
	"  local score = 1\n"
	"  if last[2] then score = tonumber(last[2]) + 1 end\n"
	"  redis.call('ZADD', KEYS[2], string.format('%.0f', score), tok)\n"
	"end\n"
	"redis.call('HSET', KEYS[3], tok, string.format('%.0f', now + hbms))\n"
	"local keep = hbms * 2\n"
	"for _, k in ipairs({KEYS[2], KEYS[3]}) do\n"
	"  if redis.call('PTTL', k) < keep then\n"
	"    redis.call('PEXPIRE', k, keep)\n"
	"  end\n"
	"end\n"
	"if not holder and h and h ~= tok and left == 0 then\n"
	"  wake(KEYS[1], h, keep)\n"
	"end\n"
	"return {0, redis.call('ZRANK', KEYS[2], tok), rec, left}\n";

/* KEYS: lock, q, hb.  ARGV: token, heartbeat ms.  Deletes the key only if
 * the token holds it and wakes the next waiter; returns 1, else 0.  With
 * no queue key nobody waits: GET, DEL and EXISTS, no wake-up work. */
static const char script_release[] =
	"if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end\n"
	"redis.call('DEL', KEYS[1])\n"
	"if redis.call('EXISTS', KEYS[2]) == 0 then return 1 end\n"
	PRELUDE
	"local h = head(KEYS[1], KEYS[2], KEYS[3])\n"
	"if h then wake(KEYS[1], h, tonumber(ARGV[2]) * 2) end\n"
	"return 1\n";

/* KEYS: lock, q, hb, own wake list.  ARGV: token, heartbeat ms.  A waiter
 * giving up: leaves the queue and, if the key came to it after all (a lost
 * reply), releases it; wakes the next waiter when the key is free.  Returns
 * 1 when it released the key, else 0. */
static const char script_leave[] =
	PRELUDE
	"redis.call('ZREM', KEYS[2], ARGV[1])\n"
	"redis.call('HDEL', KEYS[3], ARGV[1])\n"
	"redis.call('DEL', KEYS[4])\n"
	"local r = 0\n"
	"local holder = redis.call('GET', KEYS[1])\n"
	"if holder == ARGV[1] then\n"
	"  redis.call('DEL', KEYS[1])\n"
	"  r = 1\n"
	"  holder = false\n"
	"end\n"
	"if not holder then\n"
	"  local h = head(KEYS[1], KEYS[2], KEYS[3])\n"
	"  if h then wake(KEYS[1], h, tonumber(ARGV[2]) * 2) end\n"
	"end\n"
	"return r\n";

/* KEYS: lock.  ARGV: token, ttl ms.  Extends the key only if the token
 * holds it: 1, else 0. */
static const char script_renew[] =
	"if redis.call('GET', KEYS[1]) == ARGV[1] then\n"
	"  redis.call('PEXPIRE', KEYS[1], ARGV[2])\n"
	"  return 1\n"
	"end\n"
	"return 0\n";

/* KEYS: lock, q, hb.  Returns {holders, live waiters}; changes nothing. */
static const char script_status[] =
	"local t = redis.call('TIME')\n"
	"local now = tonumber(t[1]) * 1000 + "
	"math.floor(tonumber(t[2]) / 1000)\n"
	"local w = 0\n"
	"for _, m in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do\n"
	"  if tonumber(redis.call('HGET', KEYS[3], m) or '0') > now then\n"
	"    w = w + 1\n"
	"  end\n"
	"end\n"
	"return {redis.call('EXISTS', KEYS[1]), w}\n";

static const char *const scripts[KL_RS_COUNT] = {
	[KL_RS_ATTEMPT] = script_attempt,
	[KL_RS_RELEASE] = script_release,
	[KL_RS_LEAVE] = script_leave,
	[KL_RS_RENEW] = script_renew,
	[KL_RS_STATUS] = script_status,
};

/* ------------------------------------------------------------------ */
/* I/O with deadlines                                                  */

#ifndef MSG_NOSIGNAL
struct pipe_guard {
	sigset_t old;
	bool pending; /* a SIGPIPE was pending before: not ours to take */
};

static void
pipe_block(struct pipe_guard *g)
{
	sigset_t set, pend;

	sigemptyset(&set);
	sigaddset(&set, SIGPIPE);
	pthread_sigmask(SIG_BLOCK, &set, &g->old);
	g->pending = false;
	if (sigismember(&g->old, SIGPIPE) && sigpending(&pend) == 0)
		g->pending = sigismember(&pend, SIGPIPE);
}

static void
pipe_unblock(struct pipe_guard *g, bool failed)
{
	sigset_t set, pend;
	struct timespec zero = { 0, 0 };

	if (failed && !g->pending && sigpending(&pend) == 0 &&
	    sigismember(&pend, SIGPIPE)) {
		sigemptyset(&set);
		sigaddset(&set, SIGPIPE);
		while (sigtimedwait(&set, NULL, &zero) < 0 && errno == EINTR)
			;
	}
	pthread_sigmask(SIG_SETMASK, &g->old, NULL);
}
#define KL_R_PIPE_GUARD 1
#define MSG_NOSIGNAL 0
#endif

/* The longest blocking recv(), in milliseconds; and the least time left
 * beyond one slice for a blocking recv(), since the kernel may round the
 * slice up to its clock tick. */
#define RCV_SLICE_MS 100
#define RCV_SLACK_NS INT64_C(20000000)

/* Notes an I/O failure in c's context, as hiredis would: what, or NULL
 * for errno's description (%m: strerror() is not thread-safe). */
static void
io_error(struct kl__rconn *c, int type, const char *what)
{
	c->ctx->err = type;
#ifdef HAVE_REDIS_TLS
	if (what == NULL && c->tls != NULL && errno == EPROTO)
		what = kl__rtls_error(c->tls);
#endif
	if (what != NULL)
		snprintf(c->ctx->errstr, sizeof c->ctx->errstr, "%s", what);
	else
		snprintf(c->ctx->errstr, sizeof c->ctx->errstr, "%m");
}

/* send() and recv() on c's socket, or through its TLS session.  nowait:
 * poll() said readable, so read what is there and do not block (a TLS
 * record may have come in part only). */
static ssize_t
conn_send(struct kl__rconn *c, const char *p, size_t n)
{
#ifdef HAVE_REDIS_TLS
	if (c->tls != NULL)
		return kl__rtls_send(c->tls, p, n);
#endif
	return send(c->ctx->fd, p, n, MSG_NOSIGNAL);
}

static ssize_t
conn_recv(struct kl__rconn *c, char *buf, size_t n, bool nowait)
{
#ifdef HAVE_REDIS_TLS
	if (c->tls != NULL)
		return kl__rtls_recv(c->tls, buf, n, nowait);
#endif
	(void)nowait;
	return recv(c->ctx->fd, buf, n, 0);
}

/* Writes hiredis's output buffer: true when all of it went. */
static bool
send_all(struct kl__rconn *c)
{
	const char *p = c->ctx->obuf;
	size_t left = sdslen(c->ctx->obuf);
	bool ok = true;
#ifdef KL_R_PIPE_GUARD
	struct pipe_guard g;

	pipe_block(&g);
#endif
	while (left > 0) {
		ssize_t n = conn_send(c, p, left);

		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0) {
			io_error(c, REDIS_ERR_IO,
				 n < 0 ? NULL : "nothing written");
			ok = false;
			break;
		}
		p += n;
		left -= (size_t)n;
	}
#ifdef KL_R_PIPE_GUARD
	pipe_unblock(&g, !ok);
#endif
	sdsclear(c->ctx->obuf);
	return ok;
}

/* 1 when fd is ready for events, 0 at the deadline, -1 on a poll error.
 * Shared with the TLS handshake (redis_tls.c). */
int
kl__redis_wait_fd(int fd, short events, int64_t deadline)
{
	struct pollfd p = { .fd = fd, .events = events };

	for (;;) {
		int64_t now = kl__redis_now_ns(), ms;
		int r;

		if (now >= deadline)
			return 0;
		ms = (deadline - now + 999999) / 1000000;
		r = poll(&p, 1, ms > INT_MAX ? INT_MAX : (int)ms);
		if (r > 0)
			return 1;
		if (r < 0 && errno != EINTR)
			return -1;
	}
}

/* As kl__redis_wait_fd for POLLIN, at once when c's TLS session holds
 * decrypted bytes already (poll() cannot see them). */
static int
conn_readable(struct kl__rconn *c, int64_t deadline)
{
#ifdef HAVE_REDIS_TLS
	if (c->tls != NULL && kl__rtls_pending(c->tls))
		return 1;
#endif
	return kl__redis_wait_fd(c->ctx->fd, POLLIN, deadline);
}

/* Reads what the server sent into hiredis's reader by deadline: 1 when
 * something was read, 0 at the deadline, -1 when the connection failed.
 * A blocking recv() waits one SO_RCVTIMEO slice at most, so it is used
 * only while the deadline is two slices (and at least one slice and
 * RCV_SLACK_NS) away; closer, poll() waits for the reply first. */
static int
read_some(struct kl__rconn *c, int64_t deadline)
{
	char buf[16 * 1024];

	for (;;) {
		int64_t now = kl__redis_now_ns();
		bool polled = false;
		ssize_t n;
		int r;

		if (now >= deadline)
			return 0;
		if (deadline - now < c->rcv_ns + (c->rcv_ns > RCV_SLACK_NS
							   ? c->rcv_ns
							   : RCV_SLACK_NS)) {
			r = conn_readable(c, deadline);
			if (r <= 0) {
				if (r < 0)
					io_error(c, REDIS_ERR_IO, NULL);
				return r;
			}
			polled = true;
		}
		n = conn_recv(c, buf, sizeof buf, polled);
		if (n > 0) {
			if (redisReaderFeed(c->ctx->reader, buf, (size_t)n) !=
			    REDIS_OK) {
				io_error(c, REDIS_ERR_PROTOCOL,
					 c->ctx->reader->errstr);
				return -1;
			}
			return 1;
		}
		if (n == 0) {
			io_error(c, REDIS_ERR_EOF,
				 "Server closed the connection");
			return -1;
		}
		/* EAGAIN: the slice ended (SO_RCVTIMEO); EINTR: a signal. */
		if (errno != EINTR && errno != EAGAIN &&
		    errno != EWOULDBLOCK) {
			io_error(c, REDIS_ERR_IO, NULL);
			return -1;
		}
	}
}

static int
broken(struct kl__rconn *c, kl_error *err, const char *what)
{
	c->broken = true;
	if (c->ctx->errstr[0] != '\0')
		kl__redis_error(err, KL_EPROVIDER, "redis provider: %s (%s)",
				what, c->ctx->errstr);
	else
		kl__redis_error(err, KL_EPROVIDER, "redis provider: %s", what);
	return KL_EPROVIDER;
}

/* Writes what was appended to c and reads n replies by deadline. */
static int
roundtrip(struct kl__rconn *c, int64_t deadline, int n, redisReply **rep,
	  kl_error *err)
{
	int i, r;

	for (i = 0; i < n; i++)
		rep[i] = NULL;
	if (c->broken)
		return broken(c, err, "connection already failed");
	if (!send_all(c))
		return broken(c, err, "cannot send the command");
	for (i = 0; i < n; i++) {
		void *reply = NULL;

		for (;;) {
			if (redisGetReplyFromReader(c->ctx, &reply) !=
			    REDIS_OK) {
				r = broken(c, err, "bad reply");
				goto fail;
			}
			if (reply != NULL)
				break;
			r = read_some(c, deadline);
			if (r == 0) {
				c->broken = true;
				/* Sent, so the server may still run them:
				 * kl__rconn_drain waits for that. */
				c->owed = n - i;
				kl__redis_error(err, KL_EPROVIDER,
						"redis provider: no reply "
						"from the server in time");
				r = KL_EPROVIDER;
				goto fail;
			}
			if (r < 0) {
				r = broken(c, err, "connection lost");
				goto fail;
			}
		}
		rep[i] = reply;
	}
	return KL_OK;
fail:
	for (i = 0; i < n; i++) {
		if (rep[i] != NULL)
			freeReplyObject(rep[i]);
		rep[i] = NULL;
	}
	return r;
}

int
kl__rconn_command(struct kl__rconn *c, int64_t deadline_ns, int argc,
		  const char **argv, const size_t *lens, redisReply **reply,
		  kl_error *err)
{
	*reply = NULL;
	if (c->broken)
		return broken(c, err, "connection already failed");
	if (redisAppendCommandArgv(c->ctx, argc, argv, lens) != REDIS_OK)
		return broken(c, err, "cannot build the command");
	return roundtrip(c, deadline_ns, 1, reply, err);
}

#define MAX_SCRIPT_ARGS 16

int
kl__rconn_script(struct kl__rconn *c, int64_t deadline_ns,
		 enum kl__redis_script id, int nkeys, const char **keys,
		 const size_t *klens, int nargs, const char **args,
		 const size_t *alens, redisReply **reply, kl_error *err)
{
	const char *argv[3 + MAX_SCRIPT_ARGS];
	size_t lens[3 + MAX_SCRIPT_ARGS];
	char nk[12];
	int argc = 0, rc;

	*reply = NULL;
	if (nkeys + nargs > MAX_SCRIPT_ARGS)
		return KL_EINVAL;
	snprintf(nk, sizeof nk, "%d", nkeys);
	argv[argc] = "EVALSHA";
	lens[argc++] = 7;
	argv[argc] = c->sha[id];
	lens[argc++] = strlen(c->sha[id]);
	argv[argc] = nk;
	lens[argc++] = strlen(nk);
	for (int i = 0; i < nkeys; i++, argc++) {
		argv[argc] = keys[i];
		lens[argc] = klens[i];
	}
	for (int i = 0; i < nargs; i++, argc++) {
		argv[argc] = args[i];
		lens[argc] = alens[i];
	}
	rc = kl__rconn_command(c, deadline_ns, argc, argv, lens, reply, err);
	if (rc == KL_OK && (*reply)->type == REDIS_REPLY_ERROR &&
	    strncmp((*reply)->str, "NOSCRIPT", 8) == 0) {
		/* The server lost its script cache (SCRIPT FLUSH): send the
		 * text, which also caches it again. */
		freeReplyObject(*reply);
		argv[0] = "EVAL";
		lens[0] = 4;
		argv[1] = scripts[id];
		lens[1] = strlen(scripts[id]);
		rc = kl__rconn_command(c, deadline_ns, argc, argv, lens, reply,
				       err);
	}
	if (rc == KL_OK && (*reply)->type == REDIS_REPLY_ERROR) {
		kl__redis_error(err, KL_EPROVIDER,
				"redis provider: the server refused a "
				"script: %.160s",
				(*reply)->str);
		freeReplyObject(*reply);
		*reply = NULL;
		return KL_EPROVIDER;
	}
	return rc;
}

int
kl__rconn_drain(struct kl__rconn *c, int64_t deadline_ns)
{
	while (c->owed > 0) {
		void *reply = NULL;
		int r;

		if (redisGetReplyFromReader(c->ctx, &reply) != REDIS_OK) {
			c->owed = 0;
			return KL_EPROVIDER;
		}
		if (reply != NULL) {
			freeReplyObject(reply);
			c->owed--;
			continue;
		}
		r = read_some(c, deadline_ns);
		if (r == 0)
			return KL_ETIMEDOUT;
		if (r < 0) {
			c->owed = 0;
			return KL_EPROVIDER;
		}
	}
	if (c->ctx->err != 0)
		return KL_EPROVIDER;
	c->broken = false;
	return KL_OK;
}

int64_t
kl__rconn_uptime_ms(const struct kl__rconn *c)
{
	int64_t d = kl__redis_now_ns() - c->t0_ns;

	return c->up_ms + (d > 0 ? d / 1000000 : 0);
}

/* ------------------------------------------------------------------ */
/* Connecting                                                          */

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
		kl__redis_error(err, KL_EPROVIDER,
				"redis provider: authentication required by "
				"the server, and no password was given (URI, "
				"password_file or KEYLOCK_REDIS_PASSWORD)");
	else
		kl__redis_error(err, KL_EPROVIDER,
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
		kl__redis_error(err, KL_EPROVIDER,
				"redis provider: INFO failed: %.160s",
				r->type == REDIS_REPLY_ERROR ? r->str : "?");
		return KL_EPROVIDER;
	}
	if (!info_field(r->str, "run_id", c->run_id, sizeof c->run_id) ||
	    !info_field(r->str, "uptime_in_seconds", buf, sizeof buf)) {
		c->broken = true;
		kl__redis_error(err, KL_EPROVIDER,
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
	c->t0_ns = kl__redis_now_ns();
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
		kl__redis_error(err, KL_EPROVIDER,
				"redis provider: the server is Redis %s; "
				"6.0 or later is needed",
				buf);
		return KL_EPROVIDER;
	}
	c->persistent = info_field(r->str, "aof_enabled", buf, sizeof buf) &&
			strcmp(buf, "1") == 0;
	return KL_OK;
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
	kl__redis_error(err, KL_EPROVIDER,
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
		left = (cap_ns - kl__redis_now_ns()) / 1000000;
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
		kl__redis_error(err, KL_EPROVIDER,
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

		if (slice_ms > RCV_SLICE_MS)
			slice_ms = RCV_SLICE_MS;
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
		const char *argv[] = { "SCRIPT", "LOAD", scripts[i] };
		size_t lens[] = { 6, 4, strlen(scripts[i]) };

		if (redisAppendCommandArgv(c->ctx, 3, argv, lens) != REDIS_OK)
			rc = KL_ENOMEM;
		n++;
	}
	if (rc == KL_OK)
		rc = roundtrip(c, deadline, n, rep, err);
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
			kl__redis_error(err, KL_EPROVIDER,
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
			kl__redis_error(err, KL_EPROVIDER,
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
