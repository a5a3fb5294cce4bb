/* SPDX-License-Identifier: MIT */
/*
 * A helper process for check_provider_pg: the suite spawns it (a fresh
 * exec, never a bare fork of the threaded test) to lock keys of a
 * PostgreSQL server from another process, through kl_provider_open (so
 * libkeylock-pg is loaded as applications load it).
 *
 *   pg_helper hold URI KEY
 *	acquires KEY, writes "G <fence>" on stdout, then keeps the key until
 *	a line or end of file arrives on stdin, releases, writes "R", exits 0.
 *   pg_helper count URI KEY FILE THREADS ITERS
 *	THREADS threads each acquire KEY ITERS times; under the lock each
 *	checks and updates FILE (three int64: count, inside, last fence):
 *	inside must be 0 and the fence above the last one, then count grows
 *	by one.  Writes "OK <grants>" and exits 0, or "E <what>" and exits 3.
 *
 * A failure to acquire writes "E <status> <message>" and exits 3; bad usage
 * exits 2.  Every wait is bounded (HELPER_TIMEOUT_MS) and the helper asks to
 * be killed when its parent dies, so a failed test never strands one.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#if defined(__linux__)
#include <sys/prctl.h>
#endif

#include "keylock.h"

#define HELPER_TIMEOUT_MS 60000
#define MAX_THREADS 64

static kl_provider *g_provider;
static const char *g_key;
static int g_fd;
static long g_iters;
static atomic_long g_grants;
static atomic_long g_bad;
static char g_why[256];
static pthread_mutex_t g_why_mu = PTHREAD_MUTEX_INITIALIZER;

static int
usage(void)
{
	fprintf(stderr, "usage: pg_helper hold URI KEY\n"
			"       pg_helper count URI KEY FILE THREADS ITERS\n");
	return 2;
}

static void bad(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* Counts a problem and keeps the first one's description. */
static void
bad(const char *fmt, ...)
{
	va_list ap;

	pthread_mutex_lock(&g_why_mu);
	if (g_why[0] == '\0') {
		va_start(ap, fmt);
		vsnprintf(g_why, sizeof g_why, fmt, ap);
		va_end(ap);
	}
	pthread_mutex_unlock(&g_why_mu);
	atomic_fetch_add(&g_bad, 1);
}

/* The critical section: the file's inside flag and fence order catch any
 * overlap between holders, in this process or another. */
static void
section(uint64_t fence)
{
	int64_t st[3], again[3];

	if (pread(g_fd, st, sizeof st, 0) != (ssize_t)sizeof st) {
		bad("read state: %s", strerror(errno));
		return;
	}
	if (st[1] != 0)
		bad("inside is %" PRId64 " on entry (count %" PRId64 ")",
		    st[1], st[0]);
	if ((uint64_t)st[2] >= fence)
		bad("fence %" PRIu64 " after %" PRId64, fence, st[2]);
	st[1] = 1;
	if (pwrite(g_fd, st, sizeof st, 0) != (ssize_t)sizeof st) {
		bad("write state: %s", strerror(errno));
		return;
	}
	sched_yield();
	if (pread(g_fd, again, sizeof again, 0) != (ssize_t)sizeof again ||
	    again[0] != st[0] || again[1] != 1)
		bad("state changed under the lock: count %" PRId64
		    " inside %" PRId64,
		    again[0], again[1]);
	st[0]++;
	st[1] = 0;
	st[2] = (int64_t)fence;
	if (pwrite(g_fd, st, sizeof st, 0) != (ssize_t)sizeof st)
		bad("write state: %s", strerror(errno));
}

static void *
counter_main(void *arg)
{
	kl_lock_opts o = KL_LOCK_OPTS_INIT;
	kl_lock *l = NULL;
	kl_lease *lease;
	kl_error err;
	int rc;

	(void)arg;
	o.provider = g_provider;
	o.key = g_key;
	o.timeout_ms = HELPER_TIMEOUT_MS;
	if (kl_lock_new(&l, &o) != KL_OK) {
		bad("kl_lock_new failed");
		return NULL;
	}
	for (long i = 0; i < g_iters; i++) {
		rc = kl_lock_acquire(l, NULL, &lease, &err);
		if (rc != KL_OK) {
			bad("acquire: %s", err.message);
			break;
		}
		section(kl_lease_fence(lease));
		atomic_fetch_add(&g_grants, 1);
		kl_lease_release(lease);
	}
	kl_lock_free(l);
	return NULL;
}

static int
count(const char *file, long threads, long iters)
{
	pthread_t th[MAX_THREADS];
	long i;

	if (threads < 1 || threads > MAX_THREADS || iters < 1)
		return usage();
	if ((g_fd = open(file, O_RDWR | O_CLOEXEC)) < 0) {
		printf("E open %s: %s\n", file, strerror(errno));
		return 3;
	}
	g_iters = iters;
	for (i = 0; i < threads; i++)
		if (pthread_create(&th[i], NULL, counter_main, NULL) != 0)
			break;
	for (long j = 0; j < i; j++)
		pthread_join(th[j], NULL);
	close(g_fd);
	if (i < threads) {
		printf("E pthread_create failed\n");
		return 3;
	}
	if (atomic_load(&g_bad) != 0) {
		printf("E %ld problems: %s\n", atomic_load(&g_bad), g_why);
		return 3;
	}
	printf("OK %ld\n", atomic_load(&g_grants));
	return 0;
}

static int
hold(void)
{
	kl_lock_opts o = KL_LOCK_OPTS_INIT;
	kl_lock *l = NULL;
	kl_lease *lease = NULL;
	kl_error err;
	char buf[64];
	int rc;

	o.provider = g_provider;
	o.key = g_key;
	o.timeout_ms = HELPER_TIMEOUT_MS;
	if ((rc = kl_lock_new(&l, &o)) != KL_OK) {
		printf("E %d kl_lock_new\n", rc);
		return 3;
	}
	if ((rc = kl_lock_acquire(l, NULL, &lease, &err)) != KL_OK) {
		printf("E %d %s\n", rc, err.message);
		kl_lock_free(l);
		return 3;
	}
	printf("G %" PRIu64 "\n", kl_lease_fence(lease));
	fflush(stdout);
	/* Holds until told (a line) or until the test is gone (EOF). */
	if (fgets(buf, sizeof buf, stdin) == NULL && ferror(stdin))
		clearerr(stdin);
	kl_lease_release(lease);
	kl_lock_free(l);
	printf("R\n");
	return 0;
}

int
main(int argc, char **argv)
{
	kl_error err;
	int rc;

#if defined(__linux__)
	prctl(PR_SET_PDEATHSIG, SIGKILL);
#endif
	setvbuf(stdout, NULL, _IOLBF, 0);
	if (argc < 4)
		return usage();
	g_key = argv[3];
	if (strcmp(argv[1], "hold") == 0 && argc == 4) {
		rc = 0;
	} else if (strcmp(argv[1], "count") == 0 && argc == 7) {
		rc = 1;
	} else {
		return usage();
	}
	if (kl_provider_open(&g_provider, argv[2], &err) != KL_OK) {
		printf("E %d %s\n", err.status, err.message);
		return 3;
	}
	if (rc == 0)
		rc = hold();
	else
		rc = count(argv[4], strtol(argv[5], NULL, 10),
			   strtol(argv[6], NULL, 10));
	kl_provider_free(g_provider);
	return rc;
}
