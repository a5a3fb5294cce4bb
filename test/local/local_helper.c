/* SPDX-License-Identifier: MIT */
/*
 * A helper process for check_provider_local and check_local_deadlock:
 * the suites spawn it (a fresh exec, never a bare fork of the threaded
 * test) to lock keys of a local: directory from another process.
 *
 *   local_helper hold DIR KEY
 *	acquires KEY, writes "G <fence>" on stdout, then keeps the key until
 *	a line or end of file arrives on stdin, releases, writes "R", exits 0.
 *   local_helper append DIR KEY FILE INDEX
 *	acquires KEY, appends "INDEX\n" to FILE, releases, exits 0.  While it
 *	holds the key it keeps the marker file FILE.in, made with O_EXCL: a
 *	marker already there means two holders at once, and it exits 5.
 *   local_helper shold DIR KEY
 *   local_helper sappend DIR KEY FILE INDEX
 *	the same with KL_SHARED (sappend keeps no marker: shared holders
 *	are together by design).
 *   local_helper mhold DIR KEY...
 *   local_helper smhold DIR KEY...
 *	hold for a key set (kl_lock_acquire_many), exclusive or shared;
 *	"G <fence>" gives the fence of the set's first key.
 *   local_helper mcount DIR FILE ROUNDS KEY...
 *	ROUNDS times kl_lock_run_many over the keys, in the order given:
 *	inside, keeps the marker FILE.in (exit 5 when another holder has
 *	it) and adds one to the decimal counter in FILE.  A set that fails
 *	(a deadlock among set calls ends in KL_ETIMEDOUT after
 *	SET_TIMEOUT_MS, or in KL_EDEADLK) writes "E ..." and exits 3.
 *   local_helper pair DIR KEY1 KEY2 MODES TIMEOUT_MS
 *	acquires KEY1, writes "G <fence>", waits for a line on stdin (end of
 *	file: releases and exits 0), then acquires KEY2 with TIMEOUT_MS and
 *	writes "A <status> <message>"; releases what it holds, writes "R",
 *	exits 0.  MODES is two letters, x (exclusive) or s (KL_SHARED), for
 *	KEY1 and KEY2.  For deadlock detection (check_local_deadlock), with
 *	KEYLOCK_DEADLOCK_MS in its environment.
 *
 * KL_CRASH_AT=<point> in the environment kills the helper with SIGKILL at
 * that crash point of the local provider (src/local/provider_local.c), and
 * KL_STOP_AT=<point> stops it there with SIGSTOP (e.g. "queue-locked": a
 * process stopped while it holds a queue file's lock).
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
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#if defined(__linux__)
#include <sys/prctl.h>
#endif

#include "keylock.h"

#define HELPER_TIMEOUT_MS 60000
/* mcount's bound on one set: far beyond the few milliseconds a round
 * holds, so that only a deadlock reaches it. */
#define SET_TIMEOUT_MS 20000

static int
usage(void)
{
	fprintf(stderr, "usage: local_helper hold|shold DIR KEY\n"
			"       local_helper append|sappend DIR KEY FILE "
			"INDEX\n"
			"       local_helper mhold|smhold DIR KEY...\n"
			"       local_helper mcount DIR FILE ROUNDS KEY...\n"
			"       local_helper pair DIR KEY1 KEY2 MODES "
			"TIMEOUT_MS\n");
	return 2;
}

static kl_lock *
lock_of(kl_provider *p, const char *key, char mode, int64_t timeout_ms)
{
	kl_lock_opts o = KL_LOCK_OPTS_INIT;
	kl_lock *l = NULL;

	o.provider = p;
	o.key = key;
	o.timeout_ms = timeout_ms;
	o.flags = mode == 's' ? KL_SHARED : 0;
	return kl_lock_new(&l, &o) == KL_OK ? l : NULL;
}

/* local_helper pair (see the top). */
static int
pair(kl_provider *p, char **argv)
{
	const char *modes = argv[5];
	char *end;
	long long timeout = strtoll(argv[6], &end, 10);
	kl_lock *l1, *l2;
	kl_lease *a = NULL, *b = NULL;
	kl_error err;
	char buf[64];
	ssize_t n;
	int rc;

	if (strlen(modes) != 2 || strspn(modes, "xs") != 2 || *end != '\0' ||
	    timeout < -1)
		return usage();
	l1 = lock_of(p, argv[3], modes[0], HELPER_TIMEOUT_MS);
	l2 = lock_of(p, argv[4], modes[1], timeout);
	if (l1 == NULL || l2 == NULL) {
		printf("E %d kl_lock_new\n", KL_ENOMEM);
		return 3;
	}
	memset(&err, 0, sizeof err);
	if ((rc = kl_lock_acquire(l1, NULL, &a, &err)) != KL_OK) {
		printf("E %d %s\n", rc, err.message);
		return 3;
	}
	printf("G %" PRIu64 "\n", kl_lease_fence(a));
	while ((n = read(STDIN_FILENO, buf, sizeof buf)) < 0 && errno == EINTR)
		;
	if (n > 0) {
		memset(&err, 0, sizeof err);
		rc = kl_lock_acquire(l2, NULL, &b, &err);
		printf("A %d %s\n", rc, rc == KL_OK ? "" : err.message);
		if (rc == KL_OK)
			kl_lease_release(b);
	}
	kl_lease_release(a);
	printf("R\n");
	kl_lock_free(l2);
	kl_lock_free(l1);
	return 0;
}

/* Made on grant, removed before release: 0, or -1 when another holder
 * has it. */
static int
marker_make(const char *file, char *marker, size_t size)
{
	struct timespec ts = { 0, 2000000 };
	int fd;

	snprintf(marker, size, "%s.in", file);
	fd = open(marker, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
	if (fd < 0)
		return -1;
	close(fd);
	/* Stay a little, so that an overlapping holder finds it. */
	nanosleep(&ts, NULL);
	return 0;
}

static int
append_line(const char *file, const char *text)
{
	char line[64];
	int fd, n, rc = 0;

	n = snprintf(line, sizeof line, "%s\n", text);
	if (n < 0 || (size_t)n >= sizeof line)
		return -1;
	fd = open(file, O_WRONLY | O_APPEND | O_CLOEXEC);
	if (fd < 0)
		return -1;
	if (write(fd, line, (size_t)n) != (ssize_t)n)
		rc = -1;
	if (close(fd) != 0)
		rc = -1;
	return rc;
}

/* One round of mcount: FILE's counter plus one, under the marker. */
static int
count_round(kl_lease *lease, void *arg)
{
	const char *file = arg;
	char marker[4096], num[32];
	long v = 0;
	ssize_t n;
	int fd, rc = 0;

	(void)lease;
	if (marker_make(file, marker, sizeof marker) != 0)
		return 5;
	fd = open(file, O_RDWR | O_CLOEXEC);
	if (fd < 0) {
		rc = 4;
		goto out;
	}
	n = pread(fd, num, sizeof num - 1, 0);
	if (n < 0) {
		rc = 4;
	} else {
		num[n] = '\0';
		v = strtol(num, NULL, 10);
		n = snprintf(num, sizeof num, "%ld\n", v + 1);
		if (pwrite(fd, num, (size_t)n, 0) != n)
			rc = 4;
	}
	close(fd);
out:
	unlink(marker);
	return rc;
}

/* mhold, smhold and mcount: argv[2] is DIR, the keys follow. */
static int
main_many(int argc, char **argv)
{
	kl_lock_opts o = KL_LOCK_OPTS_INIT;
	kl_provider *p = NULL;
	kl_lock *l = NULL;
	kl_lease *lease = NULL;
	kl_error err;
	char uri[4096], buf[64];
	const char *file = NULL;
	const char *const *keys;
	long rounds = 0;
	int rc, first, r = 0;

	if (strcmp(argv[1], "mcount") == 0) {
		if (argc < 6)
			return usage();
		file = argv[3];
		rounds = strtol(argv[4], NULL, 10);
		first = 5;
	} else {
		if (argc < 4)
			return usage();
		first = 3;
		if (argv[1][0] == 's')
			o.flags = KL_SHARED;
	}
	setvbuf(stdout, NULL, _IONBF, 0);
	snprintf(uri, sizeof uri, "local:%s", argv[2]);
	memset(&err, 0, sizeof err);
	if ((rc = kl_provider_open(&p, uri, &err)) != KL_OK) {
		printf("E %d %s\n", rc, err.message);
		return 3;
	}
	o.provider = p;
	o.timeout_ms = file != NULL ? SET_TIMEOUT_MS : HELPER_TIMEOUT_MS;
	if ((rc = kl_lock_new(&l, &o)) != KL_OK) {
		printf("E %d kl_lock_new\n", rc);
		kl_provider_free(p);
		return 3;
	}
	keys = (const char *const *)&argv[first];
	if (file != NULL) {
		for (long i = 0; i < rounds; i++) {
			rc = kl_lock_run_many(l, keys, (size_t)(argc - first),
					      NULL, count_round, (void *)file,
					      &r, &err);
			if (rc != KL_OK) {
				printf("E %d round %ld: %s\n", rc, i,
				       err.message);
				r = 3;
			}
			if (r != 0)
				break;
		}
		kl_lock_free(l);
		kl_provider_free(p);
		return r;
	}
	rc = kl_lock_acquire_many(l, keys, (size_t)(argc - first), NULL,
				  &lease, &err);
	if (rc != KL_OK) {
		printf("E %d %s\n", rc, err.message);
		kl_lock_free(l);
		kl_provider_free(p);
		return 3;
	}
	printf("G %" PRIu64 "\n", kl_lease_fence(lease));
	while (read(STDIN_FILENO, buf, sizeof buf) < 0 && errno == EINTR)
		;
	kl_lease_release(lease);
	printf("R\n");
	kl_lock_free(l);
	kl_provider_free(p);
	return 0;
}

int
main(int argc, char **argv)
{
	kl_lock_opts o = KL_LOCK_OPTS_INIT;
	kl_provider *p = NULL;
	kl_lock *l = NULL;
	kl_lease *lease = NULL;
	kl_error err;
	char uri[4096], buf[64];
	bool hold, shared = false;
	int rc;

#if defined(__linux__)
	prctl(PR_SET_PDEATHSIG, SIGKILL);
#endif
	if (argc < 4)
		return usage();
	if (strcmp(argv[1], "mhold") == 0 || strcmp(argv[1], "smhold") == 0 ||
	    strcmp(argv[1], "mcount") == 0)
		return main_many(argc, argv);
	if (argv[1][0] == 's') {
		shared = true;
		argv[1]++;
	}
	if (strcmp(argv[1], "pair") == 0 && argc == 7) {
		setvbuf(stdout, NULL, _IONBF, 0);
		snprintf(uri, sizeof uri, "local:%s", argv[2]);
		memset(&err, 0, sizeof err);
		if ((rc = kl_provider_open(&p, uri, &err)) != KL_OK) {
			printf("E %d %s\n", rc, err.message);
			return 3;
		}
		rc = pair(p, argv);
		kl_provider_free(p);
		return rc;
	}
	if (strcmp(argv[1], "hold") == 0 && argc == 4)
		hold = true;
	else if (strcmp(argv[1], "append") == 0 && argc == 6)
		hold = false;
	else
		return usage();
	setvbuf(stdout, NULL, _IONBF, 0);

	snprintf(uri, sizeof uri, "local:%s", argv[2]);
	memset(&err, 0, sizeof err);
	if ((rc = kl_provider_open(&p, uri, &err)) != KL_OK) {
		printf("E %d %s\n", rc, err.message);
		return 3;
	}
	o.provider = p;
	o.key = argv[3];
	o.timeout_ms = HELPER_TIMEOUT_MS;
	o.flags = shared ? KL_SHARED : 0;
	if ((rc = kl_lock_new(&l, &o)) != KL_OK) {
		printf("E %d kl_lock_new\n", rc);
		kl_provider_free(p);
		return 3;
	}
	if ((rc = kl_lock_acquire(l, NULL, &lease, &err)) != KL_OK) {
		printf("E %d %s\n", rc, err.message);
		kl_lock_free(l);
		kl_provider_free(p);
		return 3;
	}
	if (hold) {
		printf("G %" PRIu64 "\n", kl_lease_fence(lease));
		/* Held until the test says so or goes away. */
		while (read(STDIN_FILENO, buf, sizeof buf) < 0 &&
		       errno == EINTR)
			;
	} else {
		char marker[4096];

		if (shared) {
			if (append_line(argv[4], argv[5]) != 0)
				rc = 4;
		} else if (marker_make(argv[4], marker, sizeof marker) != 0) {
			rc = 5;
		} else {
			if (append_line(argv[4], argv[5]) != 0)
				rc = 4;
			unlink(marker);
		}
	}
	kl_lease_release(lease);
	if (hold)
		printf("R\n");
	kl_lock_free(l);
	kl_provider_free(p);
	return rc;
}
