/* SPDX-License-Identifier: MIT */
/*
 * libFuzzer target for the Redis provider's reply handling (TESTPLAN T19):
 * the input is what a Redis server answers.  Built and run by
 * test/fuzz/run.sh with ASan and UBSan, with the provider's sources
 * compiled in (no dlopen) and hiredis linked.
 *
 * A fake server, a thread listening on 127.0.0.1 on a port of its own,
 * writes the replies to every connection it accepts without waiting for the
 * commands, then shuts its side down and reads until the client closes:
 * the client reads the replies in order, and once they run out it sees the
 * end of the connection at once, never a timeout.  A connection the
 * provider opens again (after a failed one) gets the same replies again.
 *
 * Input: the first byte selects, the rest are the replies (raw RESP; a 0xFF
 * byte is dropped and splits the replies into separate writes):
 *   bit 0  the server starts with a valid handshake of its own (AUTH,
 *          SELECT, INFO of a Redis 7.0, the five SCRIPT LOAD digests, the
 *          restart marker's answer: no lock missing), so
 *          the input's replies are those to the attempt, the release and
 *          the status query;
 *   bit 1  the URI selects database 1 (a SELECT reply comes first);
 *   bit 2  the URI has a password (an AUTH reply comes before that).
 * Per input: kl_redis_provider_open() with 200 ms timeouts and the restart
 * guard off, a try-acquire (timeout 0) of a key and its release when
 * granted, kl_provider_status(), kl_provider_free().  Any status is fine;
 * crashes, sanitizer reports and leaks are findings.  Checks: KL_OK comes
 * with a provider and a lease, every other status with none and with
 * err.status equal to it; the URI's password never shows in a message
 * (unless a reply has it: a message may quote an error reply).
 */
#include "config.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include "keylock.h"
#include "keylock/redis.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define PASSWORD "fuzz-Secret-9q"

/* What the server answers now: set per input under mu. */
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static uint8_t *replies;
static size_t replies_len;
static int port;

struct conn {
	int fd;
	uint8_t *buf;
	size_t len;
};

static void
send_all(int fd, const uint8_t *p, size_t n)
{
	while (n > 0) {
		ssize_t w = send(fd, p, n, MSG_NOSIGNAL);

		if (w < 0 && errno == EINTR)
			continue;
		if (w <= 0)
			return;
		p += w;
		n -= (size_t)w;
	}
}

static void *
serve(void *arg)
{
	struct conn *c = arg;
	struct timeval tv = { .tv_sec = 5 };
	char sink[4096];
	size_t start = 0, i;

	/* The replies, one write per 0xFF-separated piece. */
	for (i = 0; i <= c->len; i++) {
		if (i == c->len || c->buf[i] == 0xFF) {
			if (i > start)
				send_all(c->fd, c->buf + start, i - start);
			start = i + 1;
		}
	}
	shutdown(c->fd, SHUT_WR);
	/* Read the commands until the client closes (closing with unread
	 * data would reset the connection and could drop replies the client
	 * has not read yet). */
	setsockopt(c->fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
	while (recv(c->fd, sink, sizeof sink, 0) > 0)
		;
	close(c->fd);
	free(c->buf);
	free(c);
	return NULL;
}

static void *
server(void *arg)
{
	int lfd = (int)(intptr_t)arg;

	for (;;) {
		struct conn *c;
		pthread_t t;
		int fd = accept(lfd, NULL, NULL);

		if (fd < 0)
			continue;
		if ((c = calloc(1, sizeof *c)) == NULL) {
			close(fd);
			continue;
		}
		c->fd = fd;
		pthread_mutex_lock(&mu);
		c->len = replies_len;
		c->buf = malloc(replies_len + 1);
		if (c->buf != NULL && replies_len > 0)
			memcpy(c->buf, replies, replies_len);
		pthread_mutex_unlock(&mu);
		if (c->buf == NULL ||
		    pthread_create(&t, NULL, serve, c) != 0) {
			close(fd);
			free(c->buf);
			free(c);
			continue;
		}
		pthread_detach(t);
	}
	return NULL;
}

int
LLVMFuzzerInitialize(int *argc, char ***argv)
{
	struct sockaddr_in a = { .sin_family = AF_INET };
	socklen_t alen = sizeof a;
	pthread_t t;
	int lfd;

	(void)argc;
	(void)argv;
	unsetenv("KEYLOCK_REDIS_PASSWORD");
	a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	if ((lfd = socket(AF_INET, SOCK_STREAM, 0)) < 0 ||
	    bind(lfd, (struct sockaddr *)&a, sizeof a) != 0 ||
	    listen(lfd, 64) != 0 ||
	    getsockname(lfd, (struct sockaddr *)&a, &alen) != 0) {
		perror("fuzz_resp: listen on 127.0.0.1");
		exit(1);
	}
	port = ntohs(a.sin_port);
	if (pthread_create(&t, NULL, server, (void *)(intptr_t)lfd) != 0) {
		fprintf(stderr, "fuzz_resp: cannot start the server thread\n");
		exit(1);
	}
	pthread_detach(t);
	return 0;
}

static void
check(int ok, const char *what)
{
	if (!ok) {
		fprintf(stderr, "fuzz_resp: %s\n", what);
		abort();
	}
}

/* Whether the password may show in a message: only the URI has it, and
 * the server's replies do not (a message may quote an error reply). */
static int secret;

static void
check_err(int rc, const kl_error *err, const char *what)
{
	if (rc == KL_OK)
		return;
	check(err->status == rc, what);
	check(memchr(err->message, '\0', sizeof err->message) != NULL,
	      "err.message is not terminated");
	check(!secret || strstr(err->message, PASSWORD) == NULL,
	      "err.message shows the URI's password");
}

/* A handshake a Redis 7.0 would give: INFO and five script digests. */
static const char info_text[] =
	"# Server\r\nredis_version:7.0.11\r\nrun_id:"
	"0123456789abcdef0123456789abcdef01234567\r\n"
	"uptime_in_seconds:1000\r\n# Persistence\r\naof_enabled:0\r\n";
static const char sha_reply[] =
	"$40\r\n0123456789abcdef0123456789abcdef01234567\r\n";
/* The restart marker script: {start 0, ttl record 30000}. */
static const char mark_reply[] = "*2\r\n$1\r\n0\r\n:30000\r\n";

static size_t
append(uint8_t *buf, size_t at, const void *p, size_t n)
{
	memcpy(buf + at, p, n);
	return at + n;
}

int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	char uri[200], head[32];
	kl_provider *p = (kl_provider *)&p; /* must be overwritten */
	kl_lock_opts o = KL_LOCK_OPTS_INIT;
	kl_call call = { .key = "fuzz-key", .cancel = NULL };
	kl_lock *l = NULL;
	kl_lease *lease = (kl_lease *)&lease;
	kl_error err;
	size_t holders, waiters, n = 0;
	uint8_t mode, *buf;
	int rc, i;

	if (size == 0)
		return 0;
	mode = data[0];
	data++;
	size--;
	if ((buf = malloc(size + 512)) == NULL)
		return 0;
	if (mode & 1) {
		if (mode & 4)
			n = append(buf, n, "+OK\r\n", 5);
		if (mode & 2)
			n = append(buf, n, "+OK\r\n", 5);
		snprintf(head, sizeof head, "$%zu\r\n", sizeof info_text - 1);
		n = append(buf, n, head, strlen(head));
		n = append(buf, n, info_text, sizeof info_text - 1);
		n = append(buf, n, "\r\n", 2);
		for (i = 0; i < 5; i++)
			n = append(buf, n, sha_reply, sizeof sha_reply - 1);
		n = append(buf, n, mark_reply, sizeof mark_reply - 1);
	}
	if (size > 0)
		n = append(buf, n, data, size);
	secret = (mode & 4) != 0 &&
		 memmem(data, size, PASSWORD, sizeof PASSWORD - 1) == NULL;
	pthread_mutex_lock(&mu);
	replies = buf;
	replies_len = n;
	pthread_mutex_unlock(&mu);

	snprintf(uri, sizeof uri,
		 "redis://%s127.0.0.1:%d/%d?restart_guard=0&timeout=200ms"
		 "&connect_timeout=200ms",
		 mode & 4 ? ":" PASSWORD "@" : "", port, mode & 2 ? 1 : 0);
	memset(&err, 0x5a, sizeof err);
	rc = kl_redis_provider_open(&p, uri, &err);
	if (rc != KL_OK) {
		check(p == NULL, "a failed open left *out set");
		check_err(rc, &err, "open: err.status is not the status");
		goto out;
	}
	check(p != NULL, "KL_OK without a provider");

	o.provider = p;
	o.timeout_ms = 0;
	if (kl_lock_new(&l, &o) == KL_OK) {
		memset(&err, 0x5a, sizeof err);
		rc = kl_lock_acquire(l, &call, &lease, &err);
		if (rc == KL_OK) {
			check(lease != NULL, "KL_OK without a lease");
			(void)kl_lease_fence(lease);
			(void)kl_lease_valid(lease);
			kl_lease_release(lease);
		} else {
			check_err(rc, &err,
				  "acquire: err.status is not the status");
		}
		kl_lock_free(l);
	}
	memset(&err, 0x5a, sizeof err);
	rc = kl_provider_status(p, "fuzz-key", &holders, &waiters, &err);
	check_err(rc, &err, "status: err.status is not the status");
	kl_provider_free(p);
out:
	pthread_mutex_lock(&mu);
	replies = NULL;
	replies_len = 0;
	pthread_mutex_unlock(&mu);
	free(buf);
	return 0;
}
