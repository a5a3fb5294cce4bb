/* SPDX-License-Identifier: MIT */
/*
 * Small helpers shared by the modules of libkeylock-redis: CLOCK_MONOTONIC
 * deadlines, the process id and random bytes.
 *
 * The process id (to tell a connection inherited over fork()) and the
 * random bytes for lease tokens are cached, the first per process and the
 * second per thread; a pthread_atfork() child handler drops both caches.
 */
#include "config.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#ifdef HAVE_SYS_RANDOM_H
#include <sys/random.h>
#endif

#include "redis_internal.h"

int64_t
kl__redis_deadline(int64_t ms)
{
	int64_t now = kl__now_ns();

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

size_t
kl__redis_num(char *buf, size_t size, int64_t v)
{
	return (size_t)snprintf(buf, size, "%" PRId64, v);
}
