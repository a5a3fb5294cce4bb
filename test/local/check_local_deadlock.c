/* SPDX-License-Identifier: MIT */
/*
 * Deadlock detection on the local: provider (src/local/local_deadlock.c):
 * cycles of waits between processes (two and three), between two threads
 * of one process (one provider or two on the directory), between a
 * thread and another process, through shared holders, and of one thread
 * waiting for a key it holds; each must end with exactly one KL_EDEADLK
 * (a REJECTED event with that status, a message naming the cycle's keys)
 * while the other members go on.  And no false victim: a chain that waits
 * for a holder busy longer than deadlock_ms, detection turned off (only
 * timeouts end a cycle then), the waits record of a process killed while
 * it waited, the record of a process stopped right after its grant, and
 * waits records planted so that believing them would close a cycle.
 *
 * Helper processes are test/local/local_helper ("pair": hold KEY1, then
 * on a line from the test ask for KEY2 and report the status), spawned
 * with KEYLOCK_DEADLOCK_MS in their environment; the test's own process
 * sets kl_deadlock_ms_set.  Outcomes are decided by who got which status,
 * never by timing: the members' timeouts (PAIR_TIMEOUT_MS) are far longer
 * than deadlock_ms, so a cycle that detection did not break ends with
 * KL_ETIMEDOUT, and the test fails on that.  Orders are forced by polling
 * kl_provider_status; the one sleep is the holder "busy" for 1.5 s.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif

#include <check.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include "local/local_internal.h"
#include "../util.h"

#define SECRET_NAME "secret"
#define SECRET_LEN 16

/* deadlock_ms in these tests, here and in the helpers. */
#define DL_MS 100
/* The timeout of every wait of a cycle: a cycle detection misses ends
 * with KL_ETIMEDOUT after this, and the test fails. */
#define PAIR_TIMEOUT_MS 20000
/* Waits for helpers and threads give up only after this long: a hang
 * guard, not a budget. */
#define HANG_GUARD_MS 120000

extern char **environ;

static char g_root[PATH_MAX];
static char g_parent[PATH_MAX];
static char g_dir[PATH_MAX];

static void
root_setup(void)
{
	test_private_root(g_root, "kl-check-ldl");
}

static void
root_teardown(void)
{
	if (g_root[0] != '\0')
		test_remove_tree(g_root);
	g_root[0] = '\0';
}

static void
setup(void)
{
	test_private_state(g_root, g_parent, g_dir);
	ck_assert_int_eq(kl_deadlock_ms_set(DL_MS), KL_OK);
}

static void
teardown(void)
{
	test_helpers_kill();
	if (g_parent[0] != '\0')
		test_remove_tree(g_parent);
	g_parent[0] = '\0';
	g_dir[0] = '\0';
}

static kl_provider *
open_dir(void)
{
	char uri[PATH_MAX + 16];
	int n = snprintf(uri, sizeof uri, "local:%s", g_dir);

	ck_assert(n > 0 && (size_t)n < sizeof uri);
	return test_provider_open(uri);
}

/* The queue file name of key in g_dir (a provider opened it already). */
static void
queue_name(char *buf, size_t size, const char *key)
{
	unsigned char secret[SECRET_LEN];
	char path[PATH_MAX + 128];
	uint64_t k0, k1;
	int fd;

	snprintf(path, sizeof path, "%s/%s", g_dir, SECRET_NAME);
	fd = open(path, O_RDONLY | O_CLOEXEC);
	ck_assert_msg(fd >= 0, "open %s: %s", path, strerror(errno));
	ck_assert_int_eq(read(fd, secret, sizeof secret),
			 (ssize_t)sizeof secret);
	close(fd);
	memcpy(&k0, secret, 8);
	memcpy(&k1, secret + 8, 8);
	snprintf(buf, size, "q%016" PRIx64,
		 kl__siphash(k0, k1, key, strlen(key)));
}

/* The record of ticket n of key, as its owner wrote it. */
static struct kl__local_trec
ticket_record(const char *key, uint64_t n)
{
	struct kl__local_trec rec;
	char q[KL_LOCAL_QNAME], path[PATH_MAX + 128];
	int fd;

	queue_name(q, sizeof q, key);
	snprintf(path, sizeof path, "%s/%s.%" PRIu64, g_dir, q, n);
	fd = open(path, O_RDONLY | O_CLOEXEC);
	ck_assert_msg(fd >= 0, "open %s: %s", path, strerror(errno));
	ck_assert_int_eq(pread(fd, &rec, sizeof rec, 0), (ssize_t)sizeof rec);
	close(fd);
	ck_assert_uint_eq(rec.ticket, n);
	return rec;
}

/* Waits records in the directory whose owner has written them whole: a
 * record is made empty (O_EXCL), then written, then flocked, and one
 * killed before the write names nobody (it goes only under the detector
 * lock, see kl__local_dl_forget). */
static int
waits_records_written(void)
{
	DIR *d = opendir(g_dir);
	struct dirent *e;
	struct stat st;
	int n = 0;

	ck_assert_ptr_nonnull(d);
	while ((e = readdir(d)) != NULL)
		if (e->d_name[0] == 'w' &&
		    fstatat(dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) ==
			    0 &&
		    st.st_size == (off_t)sizeof(struct kl__local_wrec))
			n++;
	closedir(d);
	return n;
}

/* The number of waits records ("w...") in g_dir. */
static int
waits_records(void)
{
	DIR *d = opendir(g_dir);
	struct dirent *e;
	int n = 0;

	ck_assert_ptr_nonnull(d);
	while ((e = readdir(d)) != NULL)
		if (e->d_name[0] == 'w')
			n++;
	closedir(d);
	return n;
}

struct hold {
	kl_lock *l;
	kl_lease *lease;
	struct test_events ev;
};

/* Acquires key on p into h (a fresh lock recording its events). */
static int
take(kl_provider *p, const char *key, int64_t timeout_ms, unsigned flags,
     struct hold *h, kl_error *err)
{
	kl_lock_opts o = KL_LOCK_OPTS_INIT;
	int rc;

	tev_init(&h->ev);
	o.provider = p;
	o.key = key;
	o.timeout_ms = timeout_ms;
	o.flags = flags;
	o.on_event = tev_record;
	o.event_arg = &h->ev;
	h->lease = NULL;
	ck_assert_int_eq(kl_lock_new(&h->l, &o), KL_OK);
	memset(err, 0, sizeof *err);
	rc = kl_lock_acquire(h->l, NULL, &h->lease, err);
	ck_assert(rc == KL_OK ? h->lease != NULL : h->lease == NULL);
	return rc;
}

static void
take_ok(kl_provider *p, const char *key, unsigned flags, struct hold *h)
{
	kl_error err;
	int rc = take(p, key, 0, flags, h, &err);

	ck_assert_msg(rc == KL_OK, "acquire '%s': %s", key, err.message);
}

static void
drop(struct hold *h)
{
	if (h->lease != NULL)
		kl_lease_release(h->lease);
	kl_lock_free(h->l);
	h->lease = NULL;
	h->l = NULL;
}

/* ------------------------------------------------------------------ */
/* Helper processes                                                    */

/* local_helper MODE g_dir KEY1 [KEY2 MODES TIMEOUT] with
 * KEYLOCK_DEADLOCK_MS=dl in its environment, and KL_STOP_AT=stop (the
 * provider's crash points, test build only) unless stop is NULL. */
static void
spawn_stop(struct test_helper *h, const char *const *args, const char *dl,
	   const char *stop)
{
	char var[64], stop_var[64], **envp;
	size_t n = 0, j = 0;

	while (environ[n] != NULL)
		n++;
	envp = calloc(n + 3, sizeof *envp);
	ck_assert_ptr_nonnull(envp);
	snprintf(var, sizeof var, "KEYLOCK_DEADLOCK_MS=%s", dl);
	envp[j++] = var;
	if (stop != NULL) {
		snprintf(stop_var, sizeof stop_var, "KL_STOP_AT=%s", stop);
		envp[j++] = stop_var;
	}
	for (size_t i = 0; i < n; i++)
		if (strncmp(environ[i], "KEYLOCK_DEADLOCK_MS=", 20) != 0 &&
		    strncmp(environ[i], "KL_CRASH_AT=", 12) != 0 &&
		    strncmp(environ[i], "KL_STOP_AT=", 11) != 0)
			envp[j++] = environ[i];
	test_helper_spawn(h, test_helper_path("test/local", "local_helper",
					      true),
			  args, envp);
	free(envp);
}

static void
spawn(struct test_helper *h, const char *const *args, const char *dl)
{
	spawn_stop(h, args, dl, NULL);
}

/* A "pair" helper holding key1 (granted when this returns), which asks
 * for key2 once told (go); stopped at the crash point stop (NULL: none). */
static void
pair_start_stop(struct test_helper *h, const char *key1, const char *key2,
		const char *modes, int64_t timeout_ms, const char *dl,
		const char *stop)
{
	char timeout[32];
	const char *args[7] = { "pair", g_dir, key1, key2, modes, timeout,
				NULL };

	snprintf(timeout, sizeof timeout, "%" PRId64, timeout_ms);
	spawn_stop(h, args, dl, stop);
	(void)test_helper_granted(h, HANG_GUARD_MS);
}

static void
pair_start(struct test_helper *h, const char *key1, const char *key2,
	   const char *modes, int64_t timeout_ms, const char *dl)
{
	pair_start_stop(h, key1, key2, modes, timeout_ms, dl, NULL);
}

static void
hold_start(struct test_helper *h, const char *key, bool shared)
{
	const char *args[4] = { shared ? "shold" : "hold", g_dir, key, NULL };
	char dl[32];

	snprintf(dl, sizeof dl, "%d", DL_MS);
	spawn(h, args, dl);
	(void)test_helper_granted(h, HANG_GUARD_MS);
}

static void
go(struct test_helper *h)
{
	ck_assert_int_eq(write(h->to, "go\n", 3), 3);
}

/* The pair helper's answer for key2: its status, its message into msg. */
static int
pair_result(struct test_helper *h, char *msg, size_t size)
{
	char line[400];
	int rc, off = 0;

	ck_assert_msg(test_helper_line(h, line, sizeof line, HANG_GUARD_MS),
		      "helper %d ended without an answer", (int)h->pid);
	ck_assert_msg(sscanf(line, "A %d %n", &rc, &off) == 1 && off > 0,
		      "helper %d: %s", (int)h->pid, line);
	snprintf(msg, size, "%s", line + off);
	return rc;
}

/* The pair helper releases, says "R" and exits 0. */
static void
pair_end(struct test_helper *h)
{
	char line[64];
	int status;

	ck_assert(test_helper_line(h, line, sizeof line, HANG_GUARD_MS));
	ck_assert_str_eq(line, "R");
	status = test_helper_reap(h, HANG_GUARD_MS);
	ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0,
		      "helper %d: status 0x%x", (int)h->pid,
		      (unsigned)status);
	test_helper_close(h);
}

/* A hold helper releases and exits. */
static void
hold_end(struct test_helper *h)
{
	char line[64];
	int status;

	ck_assert_int_eq(write(h->to, "x\n", 2), 2);
	ck_assert(test_helper_line(h, line, sizeof line, HANG_GUARD_MS));
	ck_assert_str_eq(line, "R");
	status = test_helper_reap(h, HANG_GUARD_MS);
	ck_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0);
	test_helper_close(h);
}

static void
assert_names(const char *msg, const char *const *keys, size_t n)
{
	char quoted[64];

	ck_assert_msg(strncmp(msg, "deadlock: waits for '", 21) == 0 ||
			      strstr(msg, ": deadlock: waits for '") != NULL,
		      "message: %s", msg);
	for (size_t i = 0; i < n; i++) {
		snprintf(quoted, sizeof quoted, "'%s'", keys[i]);
		ck_assert_msg(strstr(msg, quoted) != NULL,
			      "message without %s: %s", quoted, msg);
	}
}

/* Waits until key has holders and waiters on p. */
static void
wait_status(kl_provider *p, const char *key, size_t holders,
	    size_t waiters)
{
	test_wait_status(p, key, holders, waiters, HANG_GUARD_MS);
}

/* ------------------------------------------------------------------ */
/* Waiting threads of the test's process                               */

struct member {
	kl_provider *p;
	const char *first, *second; /* held, then asked for */
	unsigned flags1, flags2;
	int64_t timeout_ms;
	atomic_int *held; /* bumped once first is held */
	atomic_bool *go;  /* second is asked for once set */
	/* Outputs, read after the join. */
	struct test_bg bg;
	int rc1, rc2;
	kl_error err;
	struct test_events ev; /* the second lock's */
};

static void
member_main(void *arg)
{
	struct member *m = arg;
	kl_lock_opts o = KL_LOCK_OPTS_INIT;
	kl_lock *l1 = NULL, *l2 = NULL;
	kl_lease *a = NULL, *b = NULL;
	unsigned spins = 0;

	o.provider = m->p;
	o.key = m->first;
	o.flags = m->flags1;
	m->rc1 = kl_lock_new(&l1, &o);
	if (m->rc1 == KL_OK)
		m->rc1 = kl_lock_acquire(l1, NULL, &a, NULL);
	atomic_fetch_add(m->held, 1);
	if (m->rc1 != KL_OK)
		goto out;
	while (!atomic_load(m->go))
		test_relax(&spins);
	o.key = m->second;
	o.flags = m->flags2;
	o.timeout_ms = m->timeout_ms;
	o.on_event = tev_record;
	o.event_arg = &m->ev;
	m->rc2 = kl_lock_new(&l2, &o);
	if (m->rc2 == KL_OK)
		m->rc2 = kl_lock_acquire(l2, NULL, &b, &m->err);
	if (b != NULL)
		kl_lease_release(b);
out:
	if (a != NULL)
		kl_lease_release(a);
	kl_lock_free(l2);
	kl_lock_free(l1);
}

static struct member *
member_start(kl_provider *p, const char *first, unsigned flags1,
	     const char *second, unsigned flags2, atomic_int *held,
	     atomic_bool *gop)
{
	struct member *m = calloc(1, sizeof *m);

	ck_assert_ptr_nonnull(m);
	m->p = p;
	m->first = first;
	m->second = second;
	m->flags1 = flags1;
	m->flags2 = flags2;
	m->timeout_ms = PAIR_TIMEOUT_MS;
	m->held = held;
	m->go = gop;
	tev_init(&m->ev);
	test_bg_start(&m->bg, member_main, m);
	return m;
}

static void
member_join(struct member *m)
{
	test_bg_join(&m->bg, "a member of a cycle to return");
	ck_assert_int_eq(m->rc1, KL_OK);
}

struct held_arg {
	atomic_int *held;
	int n;
};

static bool
all_held(void *arg)
{
	struct held_arg *h = arg;

	return atomic_load(h->held) >= h->n;
}

/* ------------------------------------------------------------------ */
/* Cycles                                                              */

/* Two processes, ABBA: exactly one KL_EDEADLK naming both keys, the
 * other gets its key. */
START_TEST(test_two_processes)
{
	struct test_helper h[2];
	const char *keys[2] = { "ld:a", "ld:b" };
	char msg[2][300], dl[16];
	int rc[2], victims = 0, v = -1;
	int64_t t0, took;

	snprintf(dl, sizeof dl, "%d", DL_MS);
	pair_start(&h[0], keys[0], keys[1], "xx", PAIR_TIMEOUT_MS, dl);
	pair_start(&h[1], keys[1], keys[0], "xx", PAIR_TIMEOUT_MS, dl);
	t0 = now_ms();
	go(&h[0]);
	go(&h[1]);
	for (int i = 0; i < 2; i++) {
		rc[i] = pair_result(&h[i], msg[i], sizeof msg[i]);
		if (rc[i] == KL_EDEADLK) {
			victims++;
			v = i;
		} else {
			ck_assert_msg(rc[i] == KL_OK, "helper %d: %s: %s", i,
				      kl_strerror(rc[i]), msg[i]);
		}
	}
	took = now_ms() - t0;
	ck_assert_int_eq(victims, 1);
	assert_names(msg[v], keys, 2);
	/* The other member is another process: the message says which. */
	{
		char pid[32];

		snprintf(pid, sizeof pid, "pid %d", (int)h[1 - v].pid);
		ck_assert_msg(strstr(msg[v], pid) != NULL, "%s", msg[v]);
	}
	pair_end(&h[0]);
	pair_end(&h[1]);
	ck_assert_int_eq(waits_records(), 0);
	fprintf(stderr, "two processes: cycle broken within %" PRId64
		" ms of its start (deadlock_ms %d)\n", took, DL_MS);
}
END_TEST

/* Three processes, A -> B -> C -> A: exactly one victim; once it
 * releases, the others complete. */
START_TEST(test_three_processes)
{
	struct test_helper h[3];
	const char *keys[3] = { "ld:a", "ld:b", "ld:c" };
	char msg[3][300], dl[16];
	int rc, victims = 0, v = -1;
	int64_t t0;

	snprintf(dl, sizeof dl, "%d", DL_MS);
	for (int i = 0; i < 3; i++)
		pair_start(&h[i], keys[i], keys[(i + 1) % 3], "xx",
			   PAIR_TIMEOUT_MS, dl);
	t0 = now_ms();
	for (int i = 0; i < 3; i++)
		go(&h[i]);
	for (int i = 0; i < 3; i++) {
		rc = pair_result(&h[i], msg[i], sizeof msg[i]);
		if (rc == KL_EDEADLK) {
			victims++;
			v = i;
		} else {
			ck_assert_msg(rc == KL_OK, "helper %d: %s: %s", i,
				      kl_strerror(rc), msg[i]);
		}
	}
	ck_assert_int_eq(victims, 1);
	assert_names(msg[v], keys, 3);
	fprintf(stderr, "three processes: cycle broken and all done within "
		"%" PRId64 " ms of its start (deadlock_ms %d)\n",
		now_ms() - t0, DL_MS);
	for (int i = 0; i < 3; i++)
		pair_end(&h[i]);
	ck_assert_int_eq(waits_records(), 0);
}
END_TEST

/* Two threads of this process, ABBA, through one provider (_i 0) or
 * each its own on the directory (_i 1): one KL_EDEADLK, reported as a
 * REJECTED event with that status; the other thread gets its key. */
START_TEST(test_two_threads)
{
	kl_provider *p = open_dir(), *q = _i == 1 ? open_dir() : p;
	const char *keys[2] = { "ld:a", "ld:b" };
	atomic_int held;
	atomic_bool gop;
	struct held_arg ha = { &held, 2 };
	struct member *m[2];
	int victims = 0, v = -1;

	atomic_init(&held, 0);
	atomic_init(&gop, false);
	m[0] = member_start(p, keys[0], 0, keys[1], 0, &held, &gop);
	m[1] = member_start(q, keys[1], 0, keys[0], 0, &held, &gop);
	test_poll(all_held, &ha, "both members to hold their first key");
	atomic_store(&gop, true);
	for (int i = 0; i < 2; i++) {
		member_join(m[i]);
		if (m[i]->rc2 == KL_EDEADLK) {
			victims++;
			v = i;
		} else {
			ck_assert_msg(m[i]->rc2 == KL_OK, "member %d: %s: %s",
				      i, kl_strerror(m[i]->rc2),
				      m[i]->err.message);
		}
	}
	ck_assert_int_eq(victims, 1);
	ck_assert_int_eq(m[v]->err.status, KL_EDEADLK);
	assert_names(m[v]->err.message, keys, 2);
	ck_assert_msg(strstr(m[v]->err.message, "held by a thread waiting") !=
			      NULL,
		      "%s", m[v]->err.message);
	ck_assert_int_eq(tev_count(&m[v]->ev, KL_EV_REJECTED), 1);
	ck_assert_int_eq(m[v]->ev.status_of[KL_EV_REJECTED], KL_EDEADLK);
	ck_assert_int_eq(tev_count(&m[v]->ev, KL_EV_ACQUIRED), 0);
	ck_assert_int_eq(tev_count(&m[1 - v]->ev, KL_EV_ACQUIRED), 1);
	ck_assert_int_eq(tev_count(&m[1 - v]->ev, KL_EV_REJECTED), 0);
	for (int i = 0; i < 2; i++)
		free(m[i]);
	test_assert_status(p, keys[0], 0, 0);
	test_assert_status(p, keys[1], 0, 0);
	ck_assert_int_eq(waits_records(), 0);
	if (q != p)
		kl_provider_free(q);
	kl_provider_free(p);
}
END_TEST

/* This thread and another process: this thread holds A, the helper holds
 * B and waits for A, then this thread asks for B.  Exactly one of the two
 * gets KL_EDEADLK. */
START_TEST(test_thread_and_process)
{
	kl_provider *p = open_dir();
	const char *keys[2] = { "ld:a", "ld:b" };
	struct test_helper h;
	struct hold a, b;
	kl_error err;
	char msg[300], dl[16];
	int rc, hrc;

	snprintf(dl, sizeof dl, "%d", DL_MS);
	take_ok(p, keys[0], 0, &a);
	pair_start(&h, keys[1], keys[0], "xx", PAIR_TIMEOUT_MS, dl);
	go(&h);
	wait_status(p, keys[0], 1, 1);
	rc = take(p, keys[1], PAIR_TIMEOUT_MS, 0, &b, &err);
	if (rc == KL_EDEADLK) {
		/* The victim here: the message names the helper's pid. */
		char pid[32];

		assert_names(err.message, keys, 2);
		snprintf(pid, sizeof pid, "held by pid %d", (int)h.pid);
		ck_assert_msg(strstr(err.message, pid) != NULL, "%s",
			      err.message);
		ck_assert_int_eq(tev_count(&b.ev, KL_EV_REJECTED), 1);
		ck_assert_int_eq(b.ev.status_of[KL_EV_REJECTED], KL_EDEADLK);
		drop(&a);
		hrc = pair_result(&h, msg, sizeof msg);
		ck_assert_msg(hrc == KL_OK, "helper: %s: %s",
			      kl_strerror(hrc), msg);
		kl_lock_free(b.l);
	} else {
		ck_assert_msg(rc == KL_OK, "%s: %s", kl_strerror(rc),
			      err.message);
		hrc = pair_result(&h, msg, sizeof msg);
		ck_assert_msg(hrc == KL_EDEADLK, "helper: %s: %s",
			      kl_strerror(hrc), msg);
		assert_names(msg, keys, 2);
		drop(&b);
		drop(&a);
	}
	pair_end(&h);
	ck_assert_int_eq(waits_records(), 0);
	kl_provider_free(p);
}
END_TEST

/* Shared holders: P1 holds A shared and asks for B exclusive; P2 holds B
 * shared and asks for A exclusive, while P3 also holds A shared (not in
 * the cycle).  One of P1 and P2 is the victim; with P3 gone, the other
 * gets its key. */
START_TEST(test_shared_holders)
{
	kl_provider *p = open_dir();
	const char *keys[2] = { "ld:a", "ld:b" };
	struct test_helper h[2], third;
	char msg[2][300], dl[16];
	bool got[2] = { false, false };
	int rc[2], victims = 0, v = -1;

	snprintf(dl, sizeof dl, "%d", DL_MS);
	pair_start(&h[0], keys[0], keys[1], "sx", PAIR_TIMEOUT_MS, dl);
	hold_start(&third, keys[0], true);
	pair_start(&h[1], keys[1], keys[0], "sx", PAIR_TIMEOUT_MS, dl);
	test_assert_status(p, keys[0], 2, 0);
	go(&h[0]);
	go(&h[1]);
	/* The victim answers without P3 going; P2, when it is not the
	 * victim, only once P3 has gone. */
	for (int polls = 0; !got[0] && !got[1]; polls++) {
		struct pollfd pfd[2] = { { h[0].from, POLLIN, 0 },
					 { h[1].from, POLLIN, 0 } };

		ck_assert_msg(polls < HANG_GUARD_MS / 100, "no answer");
		if (poll(pfd, 2, 100) <= 0)
			continue;
		for (int i = 0; i < 2; i++)
			if (pfd[i].revents != 0) {
				rc[i] = pair_result(&h[i], msg[i],
						    sizeof msg[i]);
				got[i] = true;
			}
	}
	hold_end(&third);
	for (int i = 0; i < 2; i++) {
		if (!got[i])
			rc[i] = pair_result(&h[i], msg[i], sizeof msg[i]);
		if (rc[i] == KL_EDEADLK) {
			victims++;
			v = i;
		} else {
			ck_assert_msg(rc[i] == KL_OK, "helper %d: %s: %s", i,
				      kl_strerror(rc[i]), msg[i]);
		}
	}
	ck_assert_int_eq(victims, 1);
	assert_names(msg[v], keys, 2);
	pair_end(&h[0]);
	pair_end(&h[1]);
	ck_assert_int_eq(waits_records(), 0);
	kl_provider_free(p);
}
END_TEST

/* One thread waiting for a key it holds (no KL_ERRORCHECK): a cycle of
 * one, ended with KL_EDEADLK; the key stays held. */
START_TEST(test_one_thread)
{
	kl_provider *p = open_dir();
	struct hold a, again;
	kl_error err;

	take_ok(p, "ld:self", 0, &a);
	ck_assert_int_eq(take(p, "ld:self", PAIR_TIMEOUT_MS, 0, &again, &err),
			 KL_EDEADLK);
	ck_assert_str_eq(err.message,
			 "lock 'ld:self': deadlock: waits for 'ld:self', "
			 "held by this thread");
	test_assert_status(p, "ld:self", 1, 0);
	kl_lock_free(again.l);
	drop(&a);
	test_assert_status(p, "ld:self", 0, 0);
	ck_assert_int_eq(waits_records(), 0);
	kl_provider_free(p);
}
END_TEST

/* ------------------------------------------------------------------ */
/* No false victim                                                     */

/* A chain without a cycle whose head is held 1.5 s (15 x deadlock_ms):
 * this thread holds A; P1 holds B and waits for A; P2 holds C and waits
 * for B (shared); a thread here waits for C.  All get their keys. */
START_TEST(test_chain_busy_holder)
{
	kl_provider *p = open_dir();
	struct test_helper h[2];
	atomic_int held;
	atomic_bool gop;
	struct held_arg ha = { &held, 1 };
	struct member *m;
	struct hold a;
	char msg[300], dl[16];
	int rc;

	snprintf(dl, sizeof dl, "%d", DL_MS);
	atomic_init(&held, 0);
	atomic_init(&gop, false);
	take_ok(p, "ld:a", 0, &a);
	pair_start(&h[0], "ld:b", "ld:a", "xx", PAIR_TIMEOUT_MS, dl);
	pair_start(&h[1], "ld:c", "ld:b", "xs", PAIR_TIMEOUT_MS, dl);
	m = member_start(p, "ld:d", 0, "ld:c", 0, &held, &gop);
	test_poll(all_held, &ha, "the member to hold its first key");
	go(&h[0]);
	wait_status(p, "ld:a", 1, 1);
	go(&h[1]);
	wait_status(p, "ld:b", 1, 1);
	atomic_store(&gop, true);
	wait_status(p, "ld:c", 1, 1);
	/* Busy: every waiter checks the graph about 15 times meanwhile. */
	test_sleep_ms(1500);
	ck_assert_int_ge(waits_records(), 1);
	drop(&a);
	for (int i = 0; i < 2; i++) {
		rc = pair_result(&h[i], msg, sizeof msg);
		ck_assert_msg(rc == KL_OK, "helper %d: %s: %s", i,
			      kl_strerror(rc), msg);
		pair_end(&h[i]);
	}
	member_join(m);
	ck_assert_msg(m->rc2 == KL_OK, "member: %s: %s", kl_strerror(m->rc2),
		      m->err.message);
	free(m);
	ck_assert_int_eq(waits_records(), 0);
	kl_provider_free(p);
}
END_TEST

/* Detection off (KL_FOREVER here, KEYLOCK_DEADLOCK_MS=forever in the
 * helper): an ABBA cycle lasts until a timeout ends it. */
START_TEST(test_detection_off)
{
	kl_provider *p = open_dir();
	const char *keys[2] = { "ld:a", "ld:b" };
	struct test_helper h;
	struct hold a, b;
	kl_error err;
	char msg[300];
	int rc;

	ck_assert_int_eq(kl_deadlock_ms_set(KL_FOREVER), KL_OK);
	take_ok(p, keys[0], 0, &a);
	pair_start(&h, keys[1], keys[0], "xx", PAIR_TIMEOUT_MS, "forever");
	go(&h);
	wait_status(p, keys[0], 1, 1);
	/* 15 x the deadlock_ms of the other tests. */
	rc = take(p, keys[1], 1500, 0, &b, &err);
	ck_assert_msg(rc == KL_ETIMEDOUT, "%s: %s", kl_strerror(rc),
		      err.message);
	ck_assert_int_eq(waits_records(), 0);
	kl_lock_free(b.l);
	drop(&a);
	rc = pair_result(&h, msg, sizeof msg);
	ck_assert_msg(rc == KL_OK, "helper: %s: %s", kl_strerror(rc), msg);
	pair_end(&h);
	kl_provider_free(p);
}
END_TEST

/* Processes killed while they waited (registered) leave their waits
 * records, which make no victim: P1's goes with its dead ticket when the
 * key it waited for is next processed (released here); P2's, whose ticket
 * nobody looks at, is swept by a later wait's check. */
START_TEST(test_dead_waiter_record)
{
	kl_provider *p = open_dir();
	struct test_helper h1, h2, c;
	struct hold b, d, a2, cc;
	kl_error err;
	char dl[16];

	snprintf(dl, sizeof dl, "%d", DL_MS);
	take_ok(p, "ld:b", 0, &b);
	take_ok(p, "ld:d", 0, &d);
	/* Both registered before either dies: a wait's first check
	 * sweeps the dead records. */
	pair_start(&h1, "ld:a", "ld:b", "xx", PAIR_TIMEOUT_MS, dl);
	pair_start(&h2, "ld:e", "ld:d", "xx", PAIR_TIMEOUT_MS, dl);
	go(&h1);
	go(&h2);
	for (int polls = 0; waits_records_written() < 2; polls++) {
		ck_assert_msg(polls < HANG_GUARD_MS / 10,
			      "no records of P1 and P2");
		test_sleep_ms(10);
	}
	test_helper_kill(&h1);
	test_helper_close(&h1);
	test_helper_kill(&h2);
	test_helper_close(&h2);
	ck_assert_int_eq(waits_records(), 2);
	drop(&b);
	ck_assert_int_eq(waits_records(), 1);
	/* P1's key is free again. */
	take_ok(p, "ld:a", 0, &a2);
	/* This thread holds A and D, which the dead processes held, and
	 * their records said they waited for B and D: a wait here
	 * registers, sweeps P2's record, and times out: no victim. */
	hold_start(&c, "ld:c", false);
	ck_assert_int_eq(take(p, "ld:c", 800, 0, &cc, &err), KL_ETIMEDOUT);
	kl_lock_free(cc.l);
	ck_assert_int_eq(waits_records(), 0);
	hold_end(&c);
	drop(&a2);
	drop(&d);
	kl_provider_free(p);
}
END_TEST

/* The waits record of a process killed while it waited goes with its
 * dead ticket even when the detector lock is taken at that moment (by a
 * walk of another process, which may be stopped: here the test holds the
 * secret's flock): else it would stay, as nothing but a later long wait
 * would look for it again.  P1 holds A and waits for B, which this thread
 * holds; P1 is killed; B's release finds its dead ticket. */
START_TEST(test_dead_waiter_record_locked)
{
	kl_provider *p = open_dir();
	struct test_helper h1;
	struct hold b, a2;
	char dl[16], path[PATH_MAX + 128];
	int lfd;

	snprintf(dl, sizeof dl, "%d", DL_MS);
	take_ok(p, "ld:b", 0, &b);
	pair_start(&h1, "ld:a", "ld:b", "xx", PAIR_TIMEOUT_MS, dl);
	go(&h1);
	/* Written whole: this test is about a record that names its dead
	 * ticket (killed between the creation and the write, under load,
	 * it would name nobody and rightly wait for the detector lock). */
	for (int polls = 0; waits_records_written() < 1; polls++) {
		ck_assert_msg(polls < HANG_GUARD_MS / 10, "no record of P1");
		test_sleep_ms(10);
	}
	test_helper_kill(&h1);
	test_helper_close(&h1);
	snprintf(path, sizeof path, "%s/%s", g_dir, SECRET_NAME);
	lfd = open(path, O_RDONLY | O_CLOEXEC);
	ck_assert_int_ge(lfd, 0);
	ck_assert_int_eq(flock(lfd, LOCK_EX | LOCK_NB), 0);
	drop(&b);
	test_assert_status(p, "ld:b", 0, 0);
	ck_assert_int_eq(waits_records(), 0);
	close(lfd);
	take_ok(p, "ld:a", 0, &a2);
	drop(&a2);
	kl_provider_free(p);
}
END_TEST

/* Waits records planted under the name of a live holder that waits for
 * nothing, each of which, believed, would close a cycle: this thread
 * holds B shared and waits for A, held by helper H; W, a thread here,
 * waits for B exclusively (ticket 1 of B).  The record says H waits with
 * W's ticket (whose holder is this thread): 0, with nobody keeping its
 * flock; 1, flocked by the test (a live owner), naming W's ticket; 2,
 * flocked, garbage.  Each time the wait here times out. */
START_TEST(test_planted_records)
{
	kl_provider *p = open_dir();
	struct test_helper h;
	struct kl__local_trec hrec, wrec;
	struct kl__local_wrec r;
	struct hold b, a;
	struct member *w;
	atomic_int held;
	atomic_bool gop;
	char name[KL_LOCAL_WNAME], path[PATH_MAX + 128];
	kl_error err;
	int fd, rc;

	atomic_init(&held, 0);
	atomic_init(&gop, true);
	hold_start(&h, "ld:a", false);
	take_ok(p, "ld:b", KL_SHARED, &b);
	/* W holds a key of its own first, then waits for B. */
	w = member_start(p, "ld:w", 0, "ld:b", 0, &held, &gop);
	wait_status(p, "ld:b", 1, 1);
	hrec = ticket_record("ld:a", 0);
	wrec = ticket_record("ld:b", 1);
	ck_assert_int_eq(hrec.pid, h.pid);
	memset(&r, 0, sizeof r);
	r.magic = KL_LOCAL_WAITS_MAGIC;
	r.pid = hrec.pid;
	r.nonce = hrec.nonce;
	r.thread = hrec.thread;
	r.ticket = 1;
	r.since_us = wrec.since_us;
	queue_name(r.qname, sizeof r.qname, "ld:b");
	snprintf(name, sizeof name, "w%016" PRIx64 ".%" PRId64 ".%" PRIu64,
		 hrec.nonce, hrec.pid, hrec.thread);
	snprintf(path, sizeof path, "%s/%s", g_dir, name);
	for (int i = 0; i < 3; i++) {
		fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
		ck_assert_msg(fd >= 0, "%s: %s", path, strerror(errno));
		if (i < 2) {
			ck_assert_int_eq(pwrite(fd, &r, sizeof r, 0),
					 (ssize_t)sizeof r);
		} else {
			char junk[sizeof r];

			memset(junk, 0xa5, sizeof junk);
			ck_assert_int_eq(pwrite(fd, junk, sizeof junk, 0),
					 (ssize_t)sizeof junk);
		}
		if (i > 0)
			ck_assert_int_eq(flock(fd, LOCK_EX | LOCK_NB), 0);
		rc = take(p, "ld:a", 800, 0, &a, &err);
		ck_assert_msg(rc == KL_ETIMEDOUT, "record %d: %s: %s", i,
			      kl_strerror(rc), err.message);
		kl_lock_free(a.l);
		/* The one no owner keeps was removed; the others stay. */
		ck_assert_int_eq(access(path, F_OK) == 0, i > 0);
		close(fd);
		unlink(path);
	}
	drop(&b);
	member_join(w);
	ck_assert_int_eq(w->rc2, KL_OK);
	free(w);
	hold_end(&h);
	ck_assert_int_eq(waits_records(), 0);
	kl_provider_free(p);
}
END_TEST

/* A waits record left by a live process whose wait is over: X, this
 * thread, holds B; T, a thread here, and then P, a helper holding A, ask
 * for B shared and wait (both register).  X releases: T and P are granted
 * B in one shared run, and P stops (SIGSTOP) right after its grant,
 * before it removes its record.  T then waits for A: P's record, believed,
 * would say that P waits for B behind T, which holds it, and close a
 * cycle.  It names P's ticket of B, which holds: no edge, and T's wait
 * times out.  P, continued, goes on. */
START_TEST(test_stopped_after_grant)
{
	kl_provider *p = open_dir();
	struct test_helper h;
	struct hold x;
	struct member *t;
	atomic_int held;
	atomic_bool gop;
	struct held_arg ha = { &held, 1 };
	char msg[300], dl[16];
	int status, rc;

	snprintf(dl, sizeof dl, "%d", DL_MS);
	atomic_init(&held, 0);
	atomic_init(&gop, false);
	take_ok(p, "ld:b", 0, &x);
	t = member_start(p, "ld:b", KL_SHARED, "ld:a", 0, &held, &gop);
	t->timeout_ms = 1500;
	wait_status(p, "ld:b", 1, 1);
	pair_start_stop(&h, "ld:a", "ld:b", "xs", PAIR_TIMEOUT_MS, dl,
			"granted-registered");
	go(&h);
	wait_status(p, "ld:b", 1, 2);
	for (int polls = 0; waits_records() < 2; polls++) {
		ck_assert_msg(polls < HANG_GUARD_MS / 10,
			      "no waits records of T and P");
		test_sleep_ms(10);
	}
	drop(&x);
	test_poll(all_held, &ha, "the thread to hold B");
	/* P stops at the point once granted. */
	for (int polls = 0;; polls++) {
		pid_t r = waitpid(h.pid, &status, WUNTRACED | WNOHANG);

		ck_assert_int_ge(r, 0);
		if (r == h.pid) {
			ck_assert(WIFSTOPPED(status));
			break;
		}
		ck_assert_msg(polls < HANG_GUARD_MS / 10, "P never stopped");
		test_sleep_ms(10);
	}
	test_assert_status(p, "ld:b", 2, 0);
	ck_assert_int_eq(waits_records(), 1);
	atomic_store(&gop, true);
	member_join(t);
	ck_assert_msg(t->rc2 == KL_ETIMEDOUT, "%s: %s", kl_strerror(t->rc2),
		      t->err.message);
	free(t);
	ck_assert_int_eq(kill(h.pid, SIGCONT), 0);
	rc = pair_result(&h, msg, sizeof msg);
	ck_assert_msg(rc == KL_OK, "helper: %s: %s", kl_strerror(rc), msg);
	pair_end(&h);
	ck_assert_int_eq(waits_records(), 0);
	kl_provider_free(p);
}
END_TEST

/* ------------------------------------------------------------------ */

static TCase *
tcase_new(Suite *s, const char *name, int timeout)
{
	TCase *tc = test_tcase(s, name, timeout, setup, teardown);

	tcase_add_unchecked_fixture(tc, root_setup, root_teardown);
	return tc;
}

static Suite *
local_deadlock_suite(void)
{
	Suite *s = suite_create("local_deadlock");
	TCase *tc;

	tc = tcase_new(s, "cycles", 150);
	tcase_add_test(tc, test_two_processes);
	tcase_add_test(tc, test_three_processes);
	tcase_add_loop_test(tc, test_two_threads, 0, 2);
	tcase_add_test(tc, test_thread_and_process);
	tcase_add_test(tc, test_shared_holders);
	tcase_add_test(tc, test_one_thread);

	tc = tcase_new(s, "no_false_victim", 150);
	tcase_add_test(tc, test_chain_busy_holder);
	tcase_add_test(tc, test_detection_off);
	tcase_add_test(tc, test_dead_waiter_record);
	tcase_add_test(tc, test_dead_waiter_record_locked);
	tcase_add_test(tc, test_planted_records);
	tcase_add_test(tc, test_stopped_after_grant);
	return s;
}

int
main(void)
{
	return test_run_suite(local_deadlock_suite());
}
