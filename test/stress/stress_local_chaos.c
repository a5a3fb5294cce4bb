/* SPDX-License-Identifier: MIT */
/*
 * Stress: the local provider under multi-process chaos.
 *
 * Each round runs CH_PROCS helper processes (this program exec'd again
 * with "chaos-child": a fresh process, never a fork of the threaded
 * runner), each with CH_THREADS threads taking keys of one local:
 * directory: a few hot keys and many cold ones, each used briefly, so that
 * idle queue files are removed and made again all the time.  Timeouts mix
 * try-once, short, long and KL_FOREVER.  Meanwhile the test's thread
 * SIGKILLs random helpers at random moments (a replacement takes the
 * killed one's place, up to a budget per round) and SIGSTOPs others for up
 * to 400 ms, then SIGCONTs them.
 *
 * A third of the acquires are KL_SHARED (issue 17).  Every grant is
 * recorded in a shared ledger (one O_APPEND file, one write a record):
 * "S key fence id t mode" just after the grant and "E ... t" just before
 * the release, t from CLOCK_MONOTONIC (one clock for the whole host).  A
 * holder killed before its E record holds until it dies, which is after
 * the moment the test sent SIGKILL: its interval is taken to end then,
 * which can only shorten it.  The checks, all on outcomes:
 * - per key, in fence order (which is grant order), an exclusive grant's
 *   recorded interval starts after every earlier grant's ended, and a
 *   shared one's after every earlier exclusive grant's ended (each
 *   recorded interval lies within the real one, so a failure is a double
 *   grant); fences never repeat;
 * - inside the section each exclusive holder writes its id into a per-key
 *   owner file, lets others run, and reads it back: another id is a double
 *   grant too;
 * - every acquire returns KL_OK or KL_ETIMEDOUT (anything else is a
 *   failure the helper records), and none outlives its timeout by more
 *   than CH_HANG_MS; a helper that does not finish within the round's hang
 *   guard is a hang (the test kills it and fails);
 * - at the end, after one more acquire and release of every key by a
 *   helper nobody kills, the directory holds only its secret (kl_provider(3):
 *   a key nobody holds or waits for leaves no file behind); before that,
 *   nothing but queue and ticket files.
 *
 * Every other round is cut short by killing all its helpers at once, so
 * that the next round starts from whatever state they left.
 * kl_provider_status calls are mixed in (they take shared flocks on
 * ticket files that acquirers then wait for).
 *
 * KL_TEST_SCALE scales the rounds and the operations per thread; the
 * default run takes about 20 s on a loaded 2-core machine.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <check.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <spawn.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#if defined(__linux__)
#include <sys/prctl.h>
#endif

#include "keylock.h"
#include "stress.h"

#define CH_PROCS 4
#define CH_THREADS 3
#define CH_HOT 3             /* contended keys */
#define CH_COLD 48           /* keys used briefly, mostly idle */
#define CH_ROUNDS 8
#define CH_OPS 80            /* per thread and round */
#define CH_KILLS 10          /* SIGKILLs per round, at most */
#define CH_HANG_MS 30000     /* an acquire past its timeout by this: hung */
#define CH_ROUND_HANG_S 240  /* a round not over by then: hung */
#define CH_MAX_REC 400000

extern char **environ;

static int64_t
mono_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void
key_of(char *buf, size_t size, int k)
{
	snprintf(buf, size, "%s%d", k < CH_HOT ? "hot" : "cold", k);
}

/* ------------------------------------------------------------------ */
/* The helper process */

struct child {
	const char *dir, *ledger;
	kl_provider *shared;
	int lfd, ops;
	uint64_t seed;
	long serial; /* which spawn of the run this is */
};

struct child_thread {
	struct child *c;
	int tid;
};

static void
record(int lfd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void
record(int lfd, const char *fmt, ...)
{
	char line[512];
	va_list ap;
	int n;

	va_start(ap, fmt);
	n = vsnprintf(line, sizeof line, fmt, ap);
	va_end(ap);
	if (n > 0 && (size_t)n < sizeof line)
		(void)!write(lfd, line, (size_t)n);
}

/* Inside the section: our id in the key's owner file, read back after
 * letting others run. */
static bool
owner_check(const char *dir, int k, long id, long *other)
{
	char path[4096], buf[32];
	struct timespec ts = { 0, 200000 };
	ssize_t n;
	int fd;
	bool ok = true;

	snprintf(path, sizeof path, "%s.owner%d", dir, k);
	fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
	if (fd < 0)
		return true;
	snprintf(buf, sizeof buf, "%20ld\n", id);
	(void)!pwrite(fd, buf, 21, 0);
	sched_yield();
	nanosleep(&ts, NULL);
	n = pread(fd, buf, 21, 0);
	if (n == 21) {
		buf[20] = '\0';
		*other = strtol(buf, NULL, 10);
		ok = *other == id;
	}
	close(fd);
	return ok;
}

static void *
child_thread(void *arg)
{
	struct child_thread *t = arg;
	struct child *c = t->c;
	static const int64_t timeouts[] = { 0, 0, 20, 100, 500, 2000,
					    KL_FOREVER };
	struct st_rng rng;
	kl_provider *own = NULL, *p = c->shared;
	char uri[4096], key[32];
	long id = c->serial * 16 + t->tid;
	int k = 0, burst = 0;

	st_rng_init(&rng, c->seed * 1000003u + (uint64_t)t->tid);
	if (t->tid == 1) {
		/* Two providers of one directory in one process, too. */
		snprintf(uri, sizeof uri, "local:%s", c->dir);
		if (kl_provider_open(&own, uri, NULL) == KL_OK)
			p = own;
	}
	for (int op = 0; op < c->ops; op++) {
		kl_lock_opts o = KL_LOCK_OPTS_INIT;
		kl_lock *l = NULL;
		kl_lease *lease = NULL;
		kl_error err;
		int64_t to, t0, t1;
		uint64_t fence;
		long other = 0;
		int rc;

		/* A cold key for a short burst, then another; hot keys in
		 * between. */
		if (burst == 0) {
			k = st_below(&rng, 2) ? (int)st_below(&rng, CH_HOT)
					      : CH_HOT + (int)st_below(&rng,
								      CH_COLD);
			burst = 1 + (int)st_below(&rng, 3);
		}
		burst--;
		key_of(key, sizeof key, k);
		to = timeouts[st_below(&rng, sizeof timeouts /
						     sizeof timeouts[0])];
		o.provider = p;
		o.key = key;
		o.timeout_ms = to;
		o.flags = st_below(&rng, 3) == 0 ? KL_SHARED : 0;
		memset(&err, 0, sizeof err);
		if ((rc = kl_lock_new(&l, &o)) != KL_OK) {
			record(c->lfd, "F %d %ld %d kl_lock_new\n", k, id, rc);
			continue;
		}
		if (st_below(&rng, 8) == 0) {
			size_t h, w;

			/* Status looks at tickets with shared flocks, which
			 * acquirers then wait for. */
			if ((rc = kl_provider_status(p, key, &h, &w, &err)) !=
			    KL_OK)
				record(c->lfd, "F %d %ld %d status %zu %s\n", k,
				       id, rc, h, rc ? err.message : "");
		}
		t0 = mono_ns();
		rc = kl_lock_acquire(l, NULL, &lease, &err);
		t1 = mono_ns();
		if (to != KL_FOREVER &&
		    t1 - t0 > (to + (int64_t)CH_HANG_MS * st_slow()) * ST_MS)
			record(c->lfd, "H %d %ld %" PRId64 " %" PRId64 "\n", k,
			       id, to, (t1 - t0) / ST_MS);
		if (rc == KL_ETIMEDOUT) {
			record(c->lfd, "T %d %ld\n", k, id);
		} else if (rc != KL_OK) {
			record(c->lfd, "F %d %ld %d %s\n", k, id, rc,
			       err.message);
		} else {
			fence = kl_lease_fence(lease);
			record(c->lfd, "S %d %" PRIu64 " %ld %" PRId64 " %c\n",
			       k, fence, id, mono_ns(),
			       o.flags & KL_SHARED ? 's' : 'x');
			if (!(o.flags & KL_SHARED) &&
			    !owner_check(c->dir, k, id, &other))
				record(c->lfd, "X %d %ld %ld\n", k, id, other);
			if (st_below(&rng, 4) == 0) {
				struct timespec ts = {
					0, (long)st_below(&rng, 3000000)
				};
				nanosleep(&ts, NULL);
			}
			record(c->lfd, "E %d %" PRIu64 " %ld %" PRId64 "\n", k,
			       fence, id, mono_ns());
			kl_lease_release(lease);
		}
		kl_lock_free(l);
	}
	kl_provider_free(own);
	return NULL;
}

/* chaos-child DIR LEDGER OPS SEED SERIAL: the helper; OPS 0 sweeps every
 * key once. */
static int
child_main(int argc, char **argv)
{
	struct child c;
	struct child_thread t[CH_THREADS];
	pthread_t th[CH_THREADS];
	char uri[4096];
	int rc = 0;

#if defined(__linux__)
	prctl(PR_SET_PDEATHSIG, SIGKILL);
#endif
	if (argc != 7)
		return 2;
	memset(&c, 0, sizeof c);
	c.dir = argv[2];
	c.ledger = argv[3];
	c.ops = atoi(argv[4]);
	c.seed = strtoull(argv[5], NULL, 10);
	c.serial = atol(argv[6]);
	c.lfd = open(c.ledger, O_WRONLY | O_APPEND | O_CLOEXEC);
	if (c.lfd < 0)
		return 3;
	snprintf(uri, sizeof uri, "local:%s", c.dir);
	if (kl_provider_open(&c.shared, uri, NULL) != KL_OK) {
		record(c.lfd, "F -1 %ld -1 provider_open\n", c.serial * 16);
		return 3;
	}
	if (c.ops == 0) {
		/* The sweep: one acquire of every key, nobody else left. */
		for (int k = 0; k < CH_HOT + CH_COLD; k++) {
			kl_lock_opts o = KL_LOCK_OPTS_INIT;
			kl_lock *l = NULL;
			kl_lease *lease = NULL;
			kl_error err;
			char key[32];

			key_of(key, sizeof key, k);
			o.provider = c.shared;
			o.key = key;
			o.timeout_ms = 10000;
			memset(&err, 0, sizeof err);
			if (kl_lock_new(&l, &o) != KL_OK)
				return 4;
			if ((rc = kl_lock_acquire(l, NULL, &lease, &err)) !=
			    KL_OK) {
				record(c.lfd, "F %d %ld %d sweep %s\n", k,
				       c.serial * 16, rc, err.message);
			} else {
				record(c.lfd, "S %d %" PRIu64 " %ld %" PRId64
					      " x\n",
				       k, kl_lease_fence(lease),
				       c.serial * 16, mono_ns());
				record(c.lfd, "E %d %" PRIu64 " %ld %" PRId64
					      "\n",
				       k, kl_lease_fence(lease),
				       c.serial * 16, mono_ns());
				kl_lease_release(lease);
			}
			kl_lock_free(l);
		}
		kl_provider_free(c.shared);
		return 0;
	}
	for (int i = 0; i < CH_THREADS; i++) {
		t[i].c = &c;
		t[i].tid = i;
		if (pthread_create(&th[i], NULL, child_thread, &t[i]) != 0)
			return 4;
	}
	for (int i = 0; i < CH_THREADS; i++)
		pthread_join(th[i], NULL);
	kl_provider_free(c.shared);
	return 0;
}

/* ------------------------------------------------------------------ */
/* The test */

struct kill_rec {
	long serial;
	int64_t at;
};

struct chaos {
	char dir[4096], ledger[4096], self[4096];
	struct kill_rec kills[CH_ROUNDS * (CH_KILLS + CH_PROCS) * 64];
	int nkills;
	long grants, timeouts, stops, spawns;
};

/* Spawns a helper; its serial is ch->spawns after the call. */
static pid_t
spawn(struct chaos *ch, int ops, uint64_t seed)
{
	char sops[32], sseed[32], sserial[32], mode[] = "chaos-child";
	char *argv[] = { ch->self, mode,  ch->dir, ch->ledger,
			 sops,     sseed, sserial, NULL };
	pid_t pid;

	snprintf(sops, sizeof sops, "%d", ops);
	snprintf(sseed, sizeof sseed, "%" PRIu64, seed);
	snprintf(sserial, sizeof sserial, "%ld", ch->spawns + 1);
	if (posix_spawn(&pid, ch->self, NULL, NULL, argv, environ) != 0)
		return -1;
	ch->spawns++;
	return pid;
}

static int64_t
kill_time(struct chaos *ch, long id)
{
	for (int i = 0; i < ch->nkills; i++)
		if (ch->kills[i].serial == id / 16)
			return ch->kills[i].at;
	return -1;
}

struct grant {
	int key;
	uint64_t fence;
	long id;
	int64_t start, end;
	bool shared;
};

static int
grant_cmp(const void *a, const void *b)
{
	const struct grant *x = a, *y = b;

	if (x->key != y->key)
		return x->key < y->key ? -1 : 1;
	return x->fence < y->fence ? -1 : x->fence > y->fence;
}

/* Reads the ledger and checks it; a message in why when it fails. */
static bool
ledger_check(struct chaos *ch, char *why, size_t size)
{
	FILE *f = fopen(ch->ledger, "r");
	struct grant *g = calloc(CH_MAX_REC, sizeof *g);
	char line[512];
	int n = 0;
	bool ok = true;

	ck_assert_ptr_nonnull(f);
	ck_assert_ptr_nonnull(g);
	while (ok && fgets(line, sizeof line, f) != NULL) {
		int k;
		uint64_t fence;
		long id;
		int64_t t;
		char mode;

		if (line[0] == 'S' &&
		    sscanf(line, "S %d %" SCNu64 " %ld %" SCNd64 " %c", &k,
			   &fence, &id, &t, &mode) == 5) {
			if (n == CH_MAX_REC) {
				snprintf(why, size, "ledger too long");
				ok = false;
				break;
			}
			g[n].key = k;
			g[n].fence = fence;
			g[n].id = id;
			g[n].start = t;
			g[n].end = -1;
			g[n].shared = mode == 's';
			n++;
			ch->grants++;
		} else if (line[0] == 'E' &&
			   sscanf(line, "E %d %" SCNu64 " %ld %" SCNd64, &k,
				  &fence, &id, &t) == 4) {
			int i;

			for (i = n - 1; i >= 0; i--)
				if (g[i].key == k && g[i].fence == fence &&
				    g[i].id == id && g[i].end < 0)
					break;
			if (i < 0) {
				snprintf(why, size, "E without S: %s", line);
				ok = false;
			} else {
				g[i].end = t;
			}
		} else if (line[0] == 'T') {
			ch->timeouts++;
		} else {
			/* F (a failed call), X (another owner seen inside
			 * the section), H (a call past its timeout). */
			snprintf(why, size, "ledger: %s", line);
			ok = false;
		}
	}
	fclose(f);
	for (int i = 0; ok && i < n; i++) {
		if (g[i].end >= 0)
			continue;
		/* No E: the holder was killed while it held the key. */
		g[i].end = kill_time(ch, g[i].id);
		if (g[i].end < 0) {
			snprintf(why, size,
				 "key %d fence %" PRIu64 ": holder %ld neither "
				 "released nor was killed",
				 g[i].key, g[i].fence, g[i].id);
			ok = false;
		}
	}
	if (ok)
		qsort(g, (size_t)n, sizeof *g, grant_cmp);
	/* In fence order per key: the latest-ending earlier grant (all, and
	 * exclusive ones) must have ended before a grant that excludes it
	 * started. */
	for (int i = 0, all = -1, excl = -1; ok && i < n; i++) {
		int before;

		if (i == 0 || g[i].key != g[i - 1].key) {
			all = excl = -1;
		} else if (g[i].fence == g[i - 1].fence) {
			snprintf(why, size, "key %d: fence %" PRIu64 " twice",
				 g[i].key, g[i].fence);
			ok = false;
			break;
		}
		before = g[i].shared ? excl : all;
		if (before >= 0 && g[i].start < g[before].end) {
			snprintf(why, size,
				 "key %d held twice: fence %" PRIu64
				 " (%s) by %ld [%" PRId64 ", %" PRId64
				 "] and fence %" PRIu64 " (%s) by %ld from "
				 "%" PRId64,
				 g[i].key, g[before].fence,
				 g[before].shared ? "shared" : "exclusive",
				 g[before].id, g[before].start,
				 g[before].end, g[i].fence,
				 g[i].shared ? "shared" : "exclusive",
				 g[i].id, g[i].start);
			ok = false;
		}
		if (all < 0 || g[i].end > g[all].end)
			all = i;
		if (!g[i].shared && (excl < 0 || g[i].end > g[excl].end))
			excl = i;
	}
	free(g);
	return ok;
}

/* The directory's files: only the secret when swept, else also queue
 * and ticket files and the waits records of deadlock detection
 * ("w<16 hex>.<pid>.<thread>", left by a helper killed while it waited:
 * removed with its dead ticket).  Returns the number of files other than
 * the secret, or -1 with why set for a stray name. */
static int
dir_files(struct chaos *ch, char *why, size_t size)
{
	DIR *d = opendir(ch->dir);
	struct dirent *e;
	int n = 0;

	ck_assert_ptr_nonnull(d);
	while ((e = readdir(d)) != NULL) {
		const char *s = e->d_name;
		size_t hex = strspn(s + 1, "0123456789abcdef");

		if (strcmp(s, ".") == 0 || strcmp(s, "..") == 0 ||
		    strcmp(s, "secret") == 0)
			continue;
		if (s[0] == 'w' && hex == 16 && s[17] == '.' &&
		    strspn(s + 18, "0123456789.") == strlen(s + 18)) {
			n++;
			continue;
		}
		if (s[0] != 'q' || hex != 16 ||
		    (s[17] != '\0' &&
		     (s[17] != '.' || s[18] == '\0' ||
		      strspn(s + 18, "0123456789") != strlen(s + 18)))) {
			snprintf(why, size, "stray file %.300s/%.200s", ch->dir, s);
			n = -1;
			break;
		}
		n++;
	}
	closedir(d);
	return n;
}

static pid_t
reap(pid_t pid, int *status, bool wait)
{
	pid_t r;

	do
		r = waitpid(pid, status, wait ? 0 : WNOHANG);
	while (r < 0 && errno == EINTR);
	return r;
}

static void
sleep_ms(long ms)
{
	struct timespec ts = { ms / 1000, (ms % 1000) * 1000000 };

	nanosleep(&ts, NULL);
}

START_TEST(test_local_chaos)
{
	static struct chaos ch;
	struct st_rng rng;
	char why[1024] = "", tmpl[] = "/tmp/kl-chaos-XXXXXX";
	/* At most 64 x CH_ROUNDS: the kills array's size. */
	long rounds = st_scaled(CH_ROUNDS, 1.0, 2) < CH_ROUNDS * 64
			      ? st_scaled(CH_ROUNDS, 1.0, 2)
			      : CH_ROUNDS * 64;
	int ops = (int)st_scaled(CH_OPS, 1.0, 10);
	long total_kills = 0, left_before = 0;
	ssize_t len;
	int fd, status, hung = 0, bad_exit = 0;
	pid_t sweep;

	st_begin("local chaos");
	memset(&ch, 0, sizeof ch);
	st_rng_init(&rng, 9901);
	len = readlink("/proc/self/exe", ch.self, sizeof ch.self - 1);
	ck_assert_int_gt(len, 0);
	ch.self[len] = '\0';
	ck_assert_ptr_nonnull(mkdtemp(tmpl));
	snprintf(ch.dir, sizeof ch.dir, "%s/d", tmpl);
	ck_assert_int_eq(mkdir(ch.dir, 0700), 0);
	snprintf(ch.ledger, sizeof ch.ledger, "%s/ledger", tmpl);
	fd = open(ch.ledger, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
	ck_assert_int_ge(fd, 0);
	close(fd);

	for (long r = 0; r < rounds && hung == 0 && bad_exit == 0; r++) {
		pid_t pids[CH_PROCS];
		long serials[CH_PROCS];
		int64_t stopped_until[CH_PROCS];
		int live = CH_PROCS, kills = 0;
		int64_t hang_at = mono_ns() + (int64_t)CH_ROUND_HANG_S *
						      st_slow() * 1000 * ST_MS;
		/* Every other round is cut short: all its helpers are killed
		 * at once, wherever they are, and the next round (and the
		 * final sweep) must cope with what they left. */
		int64_t cut_at = r % 2 == 0 ? 0
					    : mono_ns() +
						      (int64_t)(200 +
								st_below(&rng,
									 1500)) *
							      ST_MS;

		for (int i = 0; i < CH_PROCS; i++) {
			pids[i] = spawn(&ch, ops, st_seed() + (uint64_t)r * 64 +
							  (uint64_t)i);
			ck_assert_int_gt(pids[i], 0);
			serials[i] = ch.spawns;
			stopped_until[i] = 0;
		}
		while (live > 0) {
			int i = (int)st_below(&rng, CH_PROCS);
			int64_t now = mono_ns();
			uint64_t act = st_below(&rng, 100);

			sleep_ms(1 + (long)st_below(&rng, 10));
			now = mono_ns();
			for (int j = 0; j < CH_PROCS; j++) {
				if (pids[j] <= 0)
					continue;
				if (stopped_until[j] != 0 &&
				    now >= stopped_until[j]) {
					kill(pids[j], SIGCONT);
					stopped_until[j] = 0;
				}
				if (reap(pids[j], &status, false) != pids[j])
					continue;
				if (!WIFSIGNALED(status) ||
				    WTERMSIG(status) != SIGKILL) {
					if (!WIFEXITED(status) ||
					    WEXITSTATUS(status) != 0)
						bad_exit = status ? status : -1;
				}
				pids[j] = 0;
				live--;
			}
			if (now >= hang_at) {
				hung = 1;
				break;
			}
			if (cut_at != 0 && now >= cut_at) {
				for (int j = 0; j < CH_PROCS; j++) {
					if (pids[j] <= 0)
						continue;
					ch.kills[ch.nkills].serial = serials[j];
					ch.kills[ch.nkills].at = mono_ns();
					ch.nkills++;
					kill(pids[j], SIGKILL);
					reap(pids[j], &status, true);
					pids[j] = 0;
					live--;
					total_kills++;
				}
				break;
			}
			if (pids[i] <= 0)
				continue;
			if (act < 12 && kills < CH_KILLS) {
				/* A replacement takes its place. */
				ch.kills[ch.nkills].serial = serials[i];
				ch.kills[ch.nkills].at = mono_ns();
				ch.nkills++;
				kill(pids[i], SIGKILL);
				reap(pids[i], &status, true);
				kills++;
				total_kills++;
				pids[i] = spawn(&ch, ops, st_rand(&rng));
				ck_assert_int_gt(pids[i], 0);
				serials[i] = ch.spawns;
				stopped_until[i] = 0;
			} else if (act < 40 && stopped_until[i] == 0) {
				kill(pids[i], SIGSTOP);
				/* Some past a release's 200 ms wait for the
				 * queue lock, so that it drops its ticket
				 * instead. */
				stopped_until[i] =
					mono_ns() +
					(int64_t)(1 + st_below(&rng, 400)) *
						ST_MS;
				ch.stops++;
			}
		}
		for (int j = 0; j < CH_PROCS; j++) {
			if (pids[j] <= 0)
				continue;
			kill(pids[j], SIGKILL);
			kill(pids[j], SIGCONT);
			reap(pids[j], &status, true);
		}
		{
			int left = dir_files(&ch, why, sizeof why);

			st_assert(left >= 0, "round %ld: %s", r, why);
			if (left > left_before)
				left_before = left;
		}
	}
	st_assert(hung == 0, "a round did not end within %d s: a helper hung",
		  CH_ROUND_HANG_S * st_slow());
	st_assert(bad_exit == 0, "a helper exited with status 0x%x",
		  (unsigned)bad_exit);

	/* Nobody is killed any more: one use of every key clears what the
	 * killed ones left. */
	sweep = spawn(&ch, 0, 1);
	ck_assert_int_gt(sweep, 0);
	reap(sweep, &status, true);
	st_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0,
		  "the sweep exited with status 0x%x", (unsigned)status);
	st_assert(ledger_check(&ch, why, sizeof why), "%s", why);
	{
		int left = dir_files(&ch, why, sizeof why);

		st_assert(left == 0,
			  "%d files left in %s after the sweep (%s); %ld "
			  "before it",
			  left, ch.dir, why, left_before);
	}
	st_note("%ld rounds, %ld spawns, %ld kills, %ld stops, %ld grants, "
		"%ld timeouts; at most %ld files left by the kills after a round",
		rounds, ch.spawns, total_kills, ch.stops, ch.grants,
		ch.timeouts, left_before);
	{
		char cmd[8300];

		snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpl);
		(void)!system(cmd);
	}
}
END_TEST

static Suite *
chaos_suite(void)
{
	Suite *s = suite_create("stress_local_chaos");
	TCase *tc = tcase_create("chaos");

	tcase_set_timeout(tc, ST_TIMEOUT);
	tcase_add_test(tc, test_local_chaos);
	suite_add_tcase(s, tc);
	return s;
}

int
main(int argc, char **argv)
{
	if (argc > 1 && strcmp(argv[1], "chaos-child") == 0)
		return child_main(argc, argv);
	return st_run(chaos_suite());
}
