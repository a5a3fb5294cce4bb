/* SPDX-License-Identifier: MIT */
/*
 * The I/O of one connection of the Redis provider, with deadlines.
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
 */
#include "config.h"

#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include "redis_internal.h"

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

/* The least time left beyond one SO_RCVTIMEO slice (KL_R_RCV_SLICE_MS at
 * most) for a blocking recv(), since the kernel may round the slice up to
 * its clock tick. */
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
		int64_t now = kl__now_ns(), ms;
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
		int64_t now = kl__now_ns();
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
		kl__error_set(err, KL_EPROVIDER, "redis provider: %s (%s)",
				what, c->ctx->errstr);
	else
		kl__error_set(err, KL_EPROVIDER, "redis provider: %s", what);
	return KL_EPROVIDER;
}

/* Writes what was appended to c and reads n replies by deadline. */
int
kl__rconn_roundtrip(struct kl__rconn *c, int64_t deadline, int n,
		    redisReply **rep, kl_error *err)
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
				kl__error_set(err, KL_EPROVIDER,
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
	return kl__rconn_roundtrip(c, deadline_ns, 1, reply, err);
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
