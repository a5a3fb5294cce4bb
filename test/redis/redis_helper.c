/* SPDX-License-Identifier: MIT */
/*
 * A helper process for check_provider_redis: the suite spawns it (a fresh
 * exec, never a bare fork of the threaded test) to lock keys of a Redis
 * server from another process.
 *
 *   redis_helper hold URI KEY TTL_MS
 *	acquires KEY with a ttl of TTL_MS, writes "G <fence>" on stdout, then
 *	keeps the key (renewed by the provider) until a line or end of file
 *	arrives on stdin, releases, writes "R valid" or "R lost" (whether
 *	kl_lease_valid held just before the release), exits 0.
 *   redis_helper holdshared URI KEY TTL_MS
 *	as hold, with KEY taken shared (KL_SHARED).
 *   redis_helper wait URI KEY TIMEOUT_MS
 *	acquires KEY waiting at most TIMEOUT_MS, writes "G <fence>",
 *	releases, exits 0.  The suite kills it while it waits.
 *   redis_helper rw URI KEY FILE THREADS ITERS
 *	as mutex, but every third acquire of a thread is exclusive and the
 *	others are shared (KL_SHARED): a shared holder checks that no
 *	exclusive one is inside, an exclusive one that nobody is; the record
 *	also counts the shared holders inside at once.
 *   redis_helper mutex URI KEY FILE THREADS ITERS
 *	THREADS threads each acquire KEY ITERS times; inside the critical
 *	section each checks and bumps a record shared through FILE (mmap):
 *	no other owner may be inside, and the counter must not move while it
 *	is.  Exits 0, or 4 after a violation (written as "V ...").
 *
 * A failure to acquire writes "E <status> <message>" and exits 3; bad usage
 * exits 2.  Every wait is bounded and the helper asks to be killed when its
 * parent dies, so a failed test never strands one.
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
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#if defined(__linux__)
#include <sys/prctl.h>
#endif

#include "keylock.h"

#define HELPER_TIMEOUT_MS 60000
#define MAX_THREADS 64

/* The record shared by every process of a mutex run (the file's first
 * bytes).  Plain fields on purpose: the lock alone must order them. */
struct shared {
	volatile int64_t owner; /* 0: nobody inside */
	volatile int64_t count;
	volatile int64_t violations;
	/* rw only: shared holders inside now (atomic), the most seen at
	 * once, and shared sections run. */
	int64_t readers, max_readers, reads;
};

static kl_provider *g_provider;
static const char *g_key;
static struct shared *g_shared;
static long g_iters;
static atomic_int g_failed;

static int
usage(void)
{
	fprintf(stderr, "usage: redis_helper hold URI KEY TTL_MS\n"
			"       redis_helper holdshared URI KEY TTL_MS\n"
			"       redis_helper wait URI KEY TIMEOUT_MS\n"
			"       redis_helper mutex URI KEY FILE THREADS "
			"ITERS\n"
			"       redis_helper rw URI KEY FILE THREADS ITERS\n");
	return 2;
}

static long
number(const char *s)
{
	char *end;
	long v;

	errno = 0;
	v = strtol(s, &end, 10);
	return errno != 0 || *end != '\0' || v < 0 ? -1 : v;
}

static int
make_lock(kl_lock **l, int64_t timeout_ms, int64_t ttl_ms, unsigned flags)
{
	kl_lock_opts o = KL_LOCK_OPTS_INIT;

	o.flags = flags;
	o.provider = g_provider;
	o.key = g_key;
	o.timeout_ms = timeout_ms;
	o.ttl_ms = ttl_ms;
	return kl_lock_new(l, &o);
}

static bool g_rw; /* rw rather than mutex */

/* One shared section of rw: no exclusive holder may be inside. */
static void
reader_section(void)
{
	int64_t n = __atomic_add_fetch(&g_shared->readers, 1,
				       __ATOMIC_SEQ_CST);
	int64_t m = __atomic_load_n(&g_shared->max_readers, __ATOMIC_SEQ_CST);

	while (n > m && !__atomic_compare_exchange_n(&g_shared->max_readers,
						     &m, n, false,
						     __ATOMIC_SEQ_CST,
						     __ATOMIC_SEQ_CST))
		;
	if (__atomic_load_n(&g_shared->owner, __ATOMIC_SEQ_CST) != 0)
		__atomic_add_fetch(&g_shared->violations, 1, __ATOMIC_SEQ_CST);
	sched_yield();
	if (__atomic_load_n(&g_shared->owner, __ATOMIC_SEQ_CST) != 0)
		__atomic_add_fetch(&g_shared->violations, 1, __ATOMIC_SEQ_CST);
	__atomic_add_fetch(&g_shared->reads, 1, __ATOMIC_SEQ_CST);
	__atomic_sub_fetch(&g_shared->readers, 1, __ATOMIC_SEQ_CST);
}

static void *
mutex_main(void *arg)
{
	int64_t me = (int64_t)(intptr_t)arg;
	kl_lock *l = NULL, *ls = NULL;
	kl_lease *lease;
	kl_error err;
	int rc;

	if (make_lock(&l, HELPER_TIMEOUT_MS, 0, 0) != KL_OK ||
	    (g_rw && make_lock(&ls, HELPER_TIMEOUT_MS, 0, KL_SHARED) != KL_OK)) {
		atomic_store(&g_failed, 1);
		kl_lock_free(l);
		return NULL;
	}
	for (long i = 0; i < g_iters; i++) {
		bool sh = g_rw && (i + me) % 3 != 0;
		int64_t c;

		rc = kl_lock_acquire(sh ? ls : l, NULL, &lease, &err);
		if (rc != KL_OK) {
			printf("E %d %s\n", rc, err.message);
			atomic_store(&g_failed, 1);
			break;
		}
		if (sh) {
			reader_section();
			kl_lease_release(lease);
			continue;
		}
		if (g_shared->owner != 0 ||
		    __atomic_load_n(&g_shared->readers, __ATOMIC_SEQ_CST) != 0)
			g_shared->violations++;
		g_shared->owner = me;
		c = g_shared->count;
		sched_yield();
		g_shared->count = c + 1;
		if (g_shared->owner != me ||
		    __atomic_load_n(&g_shared->readers, __ATOMIC_SEQ_CST) != 0)
			g_shared->violations++;
		g_shared->owner = 0;
		kl_lease_release(lease);
	}
	kl_lock_free(l);
	kl_lock_free(ls);
	return NULL;
}

static int
run_mutex(const char *file, long threads)
{
	pthread_t t[MAX_THREADS];
	long i;
	int fd;

	if (threads < 1 || threads > MAX_THREADS || g_iters < 1)
		return usage();
	fd = open(file, O_RDWR | O_CLOEXEC);
	if (fd < 0) {
		printf("E 0 open %s: %s\n", file, strerror(errno));
		return 3;
	}
	g_shared = mmap(NULL, sizeof *g_shared, PROT_READ | PROT_WRITE,
			MAP_SHARED, fd, 0);
	close(fd);
	if (g_shared == MAP_FAILED) {
		printf("E 0 mmap: %s\n", strerror(errno));
		return 3;
	}
	for (i = 0; i < threads; i++)
		if (pthread_create(&t[i], NULL, mutex_main,
				   (void *)(intptr_t)((long)getpid() * 100 +
						      i + 1)) != 0)
			break;
	threads = i;
	for (i = 0; i < threads; i++)
		pthread_join(t[i], NULL);
	if (g_shared->violations != 0) {
		printf("V %" PRId64 "\n", (int64_t)g_shared->violations);
		return 4;
	}
	return atomic_load(&g_failed) ? 3 : 0;
}

int
main(int argc, char **argv)
{
	kl_lock *l = NULL;
	kl_lease *lease = NULL;
	kl_error err;
	char buf[64];
	long v;
	bool hold;
	int rc;

#if defined(__linux__)
	prctl(PR_SET_PDEATHSIG, SIGKILL);
#endif
	if (argc < 5)
		return usage();
	setvbuf(stdout, NULL, _IONBF, 0);
	memset(&err, 0, sizeof err);
	if ((rc = kl_provider_open(&g_provider, argv[2], &err)) != KL_OK) {
		printf("E %d %s\n", rc, err.message);
		return 3;
	}
	g_key = argv[3];
	if ((strcmp(argv[1], "mutex") == 0 || strcmp(argv[1], "rw") == 0) &&
	    argc == 7) {
		g_rw = argv[1][0] == 'r';
		g_iters = number(argv[6]);
		rc = run_mutex(argv[4], number(argv[5]));
		kl_provider_free(g_provider);
		return rc;
	}
	hold = strcmp(argv[1], "hold") == 0 ||
	       strcmp(argv[1], "holdshared") == 0;
	if (argc != 5 || (v = number(argv[4])) < 0 ||
	    (!hold && strcmp(argv[1], "wait") != 0)) {
		kl_provider_free(g_provider);
		return usage();
	}
	if (hold)
		rc = make_lock(&l, HELPER_TIMEOUT_MS, v,
			       argv[1][4] == 's' ? KL_SHARED : 0);
	else
		rc = make_lock(&l, v, 0, 0);
	if (rc == KL_OK)
		rc = kl_lock_acquire(l, NULL, &lease, &err);
	if (rc != KL_OK) {
		printf("E %d %s\n", rc, err.message);
		kl_lock_free(l);
		kl_provider_free(g_provider);
		return 3;
	}
	printf("G %" PRIu64 "\n", kl_lease_fence(lease));
	if (hold) {
		/* Held until the test says so or goes away. */
		while (read(STDIN_FILENO, buf, sizeof buf) < 0 &&
		       errno == EINTR)
			;
	}
	if (hold) {
		bool valid = kl_lease_valid(lease);

		kl_lease_release(lease);
		printf("R %s\n", valid ? "valid" : "lost");
	} else {
		kl_lease_release(lease);
		printf("R\n");
	}
	kl_lock_free(l);
	kl_provider_free(g_provider);
	return 0;
}
