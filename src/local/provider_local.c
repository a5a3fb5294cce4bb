/* SPDX-License-Identifier: MIT */
/*
 * The local provider: strict-FIFO locks across the processes of one host,
 * with no server, over files in one private directory.
 *
 * The directory.  It is opened name by name from "/" without following
 * links, and refused unless every ancestor is safe from other users
 * (local_path.c); a held lease remembers the directory's device and inode
 * and finds out, at the latest on release, that the path now leads
 * elsewhere (the directory renamed or removed while the key was held:
 * another process may have been granted the key in a fresh directory).
 * So does a provider whose directory's secret was removed or replaced
 * (a cleanup of the directory's files): a process opening the directory
 * afterwards makes a new secret and names the key's files differently.
 * The directory holds a random 16-byte "secret", made once (O_EXCL on a
 * temporary name, then an atomic no-replace rename), that keys the SipHash
 * naming the files: a reader of the directory cannot confirm a guessed key
 * name.  A collision only makes two keys share one queue.
 *
 * Each key has a queue file "q<hash>" holding a magic number, two ticket
 * counters, next and serving, and the last fence; each ticket n in use has
 * a ticket file "q<hash>.n" on which its owner keeps an exclusive flock(2)
 * for as long as it waits or holds.  The queue file's own flock guards the
 * counters and is held only for a few system calls at a time, but it is
 * never waited for blindly: a process stopped while holding it (SIGSTOP, a
 * debugger, a frozen cgroup) must not hang the others beyond their
 * timeouts, so it is taken with LOCK_NB and short sleeps bounded by the
 * caller's deadline and cancel token, and status reads without it.
 *
 * Invariants, all kept under the queue file's flock:
 * - a ticket file is created (and flocked by its owner) and unlinked only
 *   under the queue lock, so nobody ever sees a fresh unlocked ticket;
 * - ticket `serving` holds the key while its file is flocked; a ticket whose
 *   file is missing or can be flocked by someone else has no live owner
 *   (it gave up, released, or its process died and the kernel dropped the
 *   flock), and whoever looks next skips it: that is how a holder or a
 *   waiter killed with SIGKILL stops blocking the others, and how a
 *   release that could not take the queue lock in time still frees the key
 *   (it just closes its ticket);
 * - a queue file with no ticket left (serving == next) is removed by the
 *   one leaving it, under its lock, once its fence is behind the wall
 *   clock, with the file of ticket next that a process killed before
 *   counting it may have left: idle keys leave nothing behind.  Whoever opened it before the
 *   unlink sees, once it has the lock, that it has no link left and opens
 *   the name again.
 * Fences: a new queue file starts from the wall clock in microseconds and
 * each grant adds one.  The file is only removed when its fence is behind
 * the clock, so a key's fence never repeats or goes back, even across a
 * removed or replaced directory, as long as the wall clock does not go back
 * and a key is granted at most once per microsecond on average (a grant
 * costs several system calls).
 * Tickets are taken in arrival order at the queue lock and served in ticket
 * order: FIFO across processes.  Waiters sleep on inotify (a ticket file
 * unlinked, or closed by a dying process) with a short poll as a fallback,
 * so a lost event delays a waiter, never strands it.  Inotify descriptors
 * are kept in a small per-provider pool rather than closed after each wait:
 * closing one waits for an RCU grace period, milliseconds on the hand-off
 * path.
 *
 * Every file is opened relative to the directory with O_NOFOLLOW and
 * O_NOCTTY and checked to be a regular file of the caller's with one link,
 * so a planted symlink, FIFO, hard link or foreign file is refused instead
 * of followed, and what is read is validated: a damaged queue file is an
 * error naming it, never a hang.
 */
#include "config.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

#define POLL_MS 20      /* fallback re-check while waiting */
#define TRY_GRACE_MS 50 /* a try-once may wait this long for the queue lock */
#define RELEASE_GRACE_MS 200 /* release waits this long for it, then just
				* drops its ticket */
#define MAX_TICKETS (1u << 20) /* more tickets in use: damaged state */
#define QUEUE_MAGIC 0x314b4c51514b4c4bULL
#define POOL_MAX 4 /* inotify descriptors kept per provider */

/*
 * Crash points (test build only): KL_CRASH_POINT("name") kills the process
 * with SIGKILL when the environment variable KL_CRASH_AT, read once, names
 * that point, and stops it with SIGSTOP when KL_STOP_AT names it.
 * test/local/check_provider_local kills helper processes at each step of queue
 * mutation this way and checks that the next acquirer repairs the state,
 * and stops one with the queue lock held to check that nobody hangs.  The
 * names, in the order a process meets them:
 *   queue-opened      queue file open, queue lock not taken
 *   queue-locked      queue lock held, nothing changed
 *   ticket-unlinked   a leftover file of the new number removed
 *   ticket-created    ticket file created, not flocked, not counted
 *   ticket-flocked    ticket file flocked, not counted
 *   ticket-counted    ticket counted (next written), queue lock held
 *   waiting           about to drop the queue lock and sleep
 *   dead-skipped      a dead ticket's file removed, serving not written
 *   granting          serving is ours, the new fence not written
 *   granted           fence written, queue lock held
 *   release-locked    releasing: queue lock held, nothing changed
 *   release-unlinked  releasing: ticket file removed, serving not moved
 *   release-advanced  releasing: serving moved on (or the idle queue file
 *                     removed), queue lock held
 */
#ifdef KL_TEST_HOOKS
#include <signal.h>

static const char *crash_at, *stop_at;
static pthread_once_t crash_once = PTHREAD_ONCE_INIT;

static void
crash_init(void)
{
	/* Read once, under pthread_once, in test builds only. */
	crash_at = getenv("KL_CRASH_AT"); /* NOLINT(concurrency-mt-unsafe) */
	stop_at = getenv("KL_STOP_AT");   /* NOLINT(concurrency-mt-unsafe) */
}

static void
crash_point(const char *name)
{
	pthread_once(&crash_once, crash_init);
	if (crash_at != NULL && strcmp(crash_at, name) == 0)
		kill(getpid(), SIGKILL);
	if (stop_at != NULL && strcmp(stop_at, name) == 0)
		kill(getpid(), SIGSTOP);
}
#define KL_CRASH_POINT(name) crash_point(name)
#else
#define KL_CRASH_POINT(name) ((void)0)
#endif

struct local {
	int dirfd;
	char *path; /* absolute, normalized */
	dev_t dev;  /* the directory as opened */
	ino_t ino;
	uint64_t k0, k1; /* the directory's secret */
	int sfd;         /* the secret's file, kept open (see lease_lost) */
	dev_t sdev;
	ino_t sino;
	pthread_mutex_t pool_lock;
	int pool[POOL_MAX]; /* idle inotify descriptors */
	int npool;
};

struct local_lease {
	int qfd, tfd;
	uint64_t ticket;
	dev_t qdev, tdev;
	ino_t qino, tino;
	void (*lost)(void *ctx);
	void *lost_ctx;
	char name[24]; /* "q" + 16 hex digits */
};

struct qstate {
	uint64_t magic, next, serving, fence;
};

static int
fail(kl_error *err, int rc, const char *what, int errnum)
{
	if (errnum != 0)
		kl__error_set(err, rc, "local provider: %s: %s", what,
			      strerror(errnum));
	else
		kl__error_set(err, rc, "local provider: %s", what);
	return rc;
}

/* Like fail, naming the file name of the directory. */
static int
fail_file(struct local *lp, kl_error *err, const char *what,
	  const char *name, int errnum)
{
	kl__error_set(err, KL_EPROVIDER, "local provider: %s %s/%s%s%s", what,
		      lp->path, name, errnum != 0 ? ": " : "",
		      errnum != 0 ? strerror(errnum) : "");
	return KL_EPROVIDER;
}

/* The wall clock in microseconds: the one place it is used, for fences
 * that must not repeat once a key's state is gone (see the top). */
static uint64_t
wall_us(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_REALTIME, &ts);
	return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

/* Opens name in the directory, refusing anything but a regular file of
 * ours with one link: fd, -EPERM (refused, err filled), -EAGAIN (removed
 * meanwhile) or -errno. */
static int
open_checked(struct local *lp, const char *name, int flags, kl_error *err)
{
	struct stat st;
	int fd = openat(lp->dirfd, name,
			flags | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK | O_NOCTTY,
			0600);

	if (fd < 0)
		return -errno;
	if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) ||
	    st.st_uid != geteuid() || st.st_nlink > 1) {
		close(fd);
		kl__error_set(err, KL_EPROVIDER,
			      "local provider: refusing %s/%s: not a regular "
			      "file of uid %lu with a single link (planted?); "
			      "remove it",
			      lp->path, name, (unsigned long)geteuid());
		return -EPERM;
	}
	if (st.st_nlink == 0) {
		close(fd);
		return -EAGAIN;
	}
	return fd;
}

static void
ticket_name(char *buf, size_t size, const char *qname, uint64_t n)
{
	snprintf(buf, size, "%s.%" PRIu64, qname, n);
}

/* Reads and checks the queue file's state; an empty file is a fresh
 * queue, whose fences start from the wall clock. */
static int
read_state(struct local *lp, const char *name, int qfd, struct qstate *st,
	   kl_error *err)
{
	char buf[sizeof *st + 1];
	ssize_t n = pread(qfd, buf, sizeof buf, 0);

	if (n < 0)
		return fail_file(lp, err, "cannot read", name, errno);
	if (n == 0) {
		st->magic = QUEUE_MAGIC;
		st->next = st->serving = 0;
		st->fence = wall_us();
		return KL_OK;
	}
	if (n != (ssize_t)sizeof *st) {
		kl__error_set(err, KL_EPROVIDER,
			      "local provider: the queue file %s/%s is damaged "
			      "(%zd bytes, not %zu); remove it once no process "
			      "uses the key",
			      lp->path, name, n, sizeof *st);
		return KL_EPROVIDER;
	}
	memcpy(st, buf, sizeof *st);
	if (st->magic != QUEUE_MAGIC || st->serving > st->next ||
	    st->next - st->serving > MAX_TICKETS || st->next > UINT64_MAX / 4 ||
	    st->fence > UINT64_MAX / 4) {
		kl__error_set(err, KL_EPROVIDER,
			      "local provider: the queue file %s/%s is damaged "
			      "(next %" PRIu64 ", serving %" PRIu64
			      ", fence %" PRIu64 "); remove it once no process "
			      "uses the key",
			      lp->path, name, st->next, st->serving, st->fence);
		return KL_EPROVIDER;
	}
	return KL_OK;
}

static int
write_state(int qfd, const struct qstate *st)
{
	return pwrite(qfd, st, sizeof *st, 0) == (ssize_t)sizeof *st ? 0 : -1;
}

/* Takes the queue lock by the deadline (KL_NO_DEADLINE: none) unless
 * cancel fires first.  Never a blocking flock: its holder may be stopped. */
static int
qlock(int qfd, int64_t deadline, kl_cancel *cancel)
{
	int64_t backoff = 20000, ns, now;
	struct timespec ts;

	/* The lock is normally held for microseconds: start with short
	 * sleeps, growing to 2 ms for a holder that is stuck. */
	for (;;) {
		if (flock(qfd, LOCK_EX | LOCK_NB) == 0)
			return KL_OK;
		if (errno == EINTR)
			continue;
		if (errno != EWOULDBLOCK)
			return KL_EPROVIDER;
		if (kl_cancel_fired(cancel))
			return KL_ECANCELED;
		now = kl__now_ns();
		if (deadline != KL_NO_DEADLINE && now >= deadline)
			return KL_ETIMEDOUT;
		ns = backoff;
		if (deadline != KL_NO_DEADLINE && deadline - now < ns)
			ns = deadline - now;
		ts.tv_sec = 0;
		ts.tv_nsec = (long)ns;
		nanosleep(&ts, NULL);
		if (backoff < 2000000)
			backoff *= 2;
	}
}

static void
qunlock(int qfd)
{
	flock(qfd, LOCK_UN);
}

/* Whether ticket n has a live owner.  Queue lock held (then a dead
 * ticket's file is removed) or, for status, not (then nothing changes). */
static bool
ticket_alive(struct local *lp, const char *qname, uint64_t n, bool locked)
{
	char tname[48];
	struct stat st;
	bool alive;
	int fd;

	ticket_name(tname, sizeof tname, qname, n);
	/* Read-only: closing it must not raise the inotify event that
	 * waiters sleep on (IN_CLOSE_WRITE), or waiters would wake each
	 * other forever. */
	/* O_NONBLOCK: a FIFO planted in place of a ticket must not hang us
	 * (with the queue lock held, that would hang the key). */
	fd = openat(lp->dirfd, tname,
		    O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
	/* Missing, or a link or socket planted: no owner.  Out of
	 * descriptors or memory we cannot tell, and skipping a live holder
	 * would grant the key twice: count it alive, whoever looks next
	 * tells. */
	if (fd < 0)
		return errno == EMFILE || errno == ENFILE || errno == ENOMEM ||
		       errno == EINTR;
	if (fstat(fd, &st) != 0) {
		close(fd);
		return true;
	}
	if (!S_ISREG(st.st_mode) || st.st_uid != geteuid()) {
		/* Not a ticket of ours: no live owner can hold it. */
		close(fd);
		if (locked)
			unlinkat(lp->dirfd, tname, 0);
		return false;
	}
	/* Shared when only looking, so that two lookers cannot make a dead
	 * ticket look alive to each other.  A failure other than
	 * EWOULDBLOCK (ENOLCK) does not tell either: alive. */
	alive = flock(fd, (locked ? LOCK_EX : LOCK_SH) | LOCK_NB) != 0;
	if (!alive && locked)
		unlinkat(lp->dirfd, tname, 0);
	close(fd);
	return alive;
}

/* Moves serving past tickets without a live owner, up to mine.  Queue lock
 * held; st is written back when it changed. */
static int
advance(struct local *lp, const char *qname, int qfd, struct qstate *st,
	uint64_t mine)
{
	uint64_t from = st->serving;

	while (st->serving < mine &&
	       !ticket_alive(lp, qname, st->serving, true)) {
		KL_CRASH_POINT("dead-skipped");
		st->serving++;
	}
	if (st->serving != from && write_state(qfd, st) != 0)
		return -1;
	return 0;
}

static void
key_name(struct local *lp, char *buf, size_t size, const char *key,
	 size_t len)
{
	snprintf(buf, size, "q%016" PRIx64,
		 kl__siphash(lp->k0, lp->k1, key, len));
}

static bool
same_file(const struct stat *a, dev_t dev, ino_t ino)
{
	return a->st_dev == dev && a->st_ino == ino;
}

/* Whether the lease's files are no longer where the directory's path
 * leads: the directory was renamed, removed or replaced, or its files
 * were, and another process may have been granted the key since. */
static bool
lease_lost(struct local *lp, const struct local_lease *l)
{
	char tname[48];
	struct stat st;

	if (stat(lp->path, &st) != 0 || !same_file(&st, lp->dev, lp->ino))
		return true;
	/* A secret removed (a cleanup) and made again by another process
	 * names the key's files differently there: its grants are not
	 * ours to see. */
	if (fstatat(lp->dirfd, KL_LOCAL_SECRET, &st,
		    AT_SYMLINK_NOFOLLOW) != 0 ||
	    !same_file(&st, lp->sdev, lp->sino))
		return true;
	if (fstatat(lp->dirfd, l->name, &st, AT_SYMLINK_NOFOLLOW) != 0 ||
	    !same_file(&st, l->qdev, l->qino))
		return true;
	ticket_name(tname, sizeof tname, l->name, l->ticket);
	return fstatat(lp->dirfd, tname, &st, AT_SYMLINK_NOFOLLOW) != 0 ||
	       !same_file(&st, l->tdev, l->tino);
}

static int
lost_error(struct local *lp, kl_error *err)
{
	kl__error_set(err, KL_EPROVIDER,
		      "local provider: the state directory %s was removed, "
		      "renamed or replaced (or its files were, its secret "
		      "among them) while the key "
		      "was held, so another process may have held it too; "
		      "keep state directories away from tmp cleaners and "
		      "other users (see kl_provider(3))",
		      lp->path);
	return KL_EPROVIDER;
}

/* Removes name if it is still the file dev/ino: when the directory's
 * files were removed and made again under a lease, its names lead to
 * another process's live files. */
static void
unlink_own(struct local *lp, const char *name, dev_t dev, ino_t ino)
{
	struct stat st;

	if (fstatat(lp->dirfd, name, &st, AT_SYMLINK_NOFOLLOW) == 0 &&
	    same_file(&st, dev, ino))
		unlinkat(lp->dirfd, name, 0);
}

/* Leaves the queue: removes the ticket, passes the key on when it was
 * ours, and removes the queue file when nobody is left in it.  Queue lock
 * held on entry, released on return; the files are closed. */
static int
leave(struct local *lp, struct local_lease *l, kl_error *err)
{
	char tname[48];
	struct qstate st;
	struct stat qst;
	int rc;

	/* The ticket file goes first: a process dying between the two
	 * steps leaves a ticket without a file, which the next one skips,
	 * rather than a file nobody would ever remove. */
	ticket_name(tname, sizeof tname, l->name, l->ticket);
	unlink_own(lp, tname, l->tdev, l->tino);
	KL_CRASH_POINT("release-unlinked");
	rc = read_state(lp, l->name, l->qfd, &st, err);
	if (rc == KL_OK) {
		/* Past our own ticket and any dead one, up to a live one. */
		if (advance(lp, l->name, l->qfd, &st, st.next) != 0)
			rc = fail_file(lp, err, "cannot update", l->name,
				       errno);
		else if (st.serving == st.next && st.fence < wall_us() &&
			 fstatat(lp->dirfd, l->name, &qst,
				 AT_SYMLINK_NOFOLLOW) == 0 &&
			 same_file(&qst, l->qdev, l->qino)) {
			/* A process killed between making its ticket file
			 * and counting it left one numbered next, which
			 * only the next ticket taken would replace: once
			 * the queue file is gone, none will. */
			ticket_name(tname, sizeof tname, l->name, st.next);
			unlinkat(lp->dirfd, tname, 0);
			unlinkat(lp->dirfd, l->name, 0);
		}
	}
	KL_CRASH_POINT("release-advanced");
	qunlock(l->qfd);
	close(l->tfd);
	close(l->qfd);
	return rc;
}

/* An inotify descriptor watching the directory, from the pool or new; -1
 * when none can be had (waiters then poll). */
static int
watch_get(struct local *lp)
{
	char buf[4096];
	int ifd = -1;

	pthread_mutex_lock(&lp->pool_lock);
	if (lp->npool > 0)
		ifd = lp->pool[--lp->npool];
	pthread_mutex_unlock(&lp->pool_lock);
	if (ifd >= 0) {
		/* Events from before are of no interest. */
		while (read(ifd, buf, sizeof buf) > 0)
			;
		return ifd;
	}
	ifd = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
	if (ifd >= 0 &&
	    inotify_add_watch(ifd, lp->path, IN_DELETE | IN_CLOSE_WRITE) < 0) {
		close(ifd);
		ifd = -1;
	}
	return ifd;
}

/* Keeps ifd for the next wait instead of closing it on the hand-off path
 * (a close waits for an RCU grace period). */
static void
watch_put(struct local *lp, int ifd)
{
	if (ifd < 0)
		return;
	pthread_mutex_lock(&lp->pool_lock);
	if (lp->npool < POOL_MAX) {
		lp->pool[lp->npool++] = ifd;
		ifd = -1;
	}
	pthread_mutex_unlock(&lp->pool_lock);
	if (ifd >= 0)
		close(ifd);
}

/* Sleeps until something in the directory may have changed, or ms pass. */
static void
nap(int ifd, int64_t ms)
{
	char buf[4096];
	struct pollfd pfd = { .fd = ifd, .events = POLLIN };

	/* The deadline may have passed since the caller looked: a negative
	 * time would make poll wait without limit. */
	if (ms > POLL_MS)
		ms = POLL_MS;
	if (ms < 0)
		ms = 0;
	if (ifd < 0) {
		struct timespec ts = { 0, (long)ms * 1000000 };
		nanosleep(&ts, NULL);
		return;
	}
	if (poll(&pfd, 1, (int)ms) > 0)
		while (read(ifd, buf, sizeof buf) > 0)
			;
}

/* Opens key's queue file and takes its lock by qdeadline, again when it
 * was removed as idle meanwhile. */
static int
open_queue(struct local *lp, struct local_lease *l, int64_t qdeadline,
	   kl_cancel *cancel, kl_error *err)
{
	struct stat st;
	int rc;

	for (int tries = 0;; tries++) {
		l->qfd = open_checked(lp, l->name, O_RDWR | O_CREAT, err);
		if (l->qfd == -EAGAIN && tries < 1000)
			continue;
		if (l->qfd < 0)
			return l->qfd == -EPERM
				       ? KL_EPROVIDER
				       : fail_file(lp, err, "cannot open",
						   l->name, -l->qfd);
		KL_CRASH_POINT("queue-opened");
		if ((rc = qlock(l->qfd, qdeadline, cancel)) != KL_OK) {
			if (rc == KL_EPROVIDER)
				fail_file(lp, err, "cannot lock", l->name,
					  errno);
			close(l->qfd);
			return rc;
		}
		if (fstat(l->qfd, &st) != 0) {
			rc = fail_file(lp, err, "cannot stat", l->name, errno);
			close(l->qfd);
			return rc;
		}
		/* Unlinked as idle by its last user between our open and
		 * our lock: the live queue is under the name again. */
		if (st.st_nlink == 0 && tries < 1000) {
			qunlock(l->qfd);
			close(l->qfd);
			continue;
		}
		l->qdev = st.st_dev;
		l->qino = st.st_ino;
		return KL_OK;
	}
}

static int
local_acquire(void *impl, const char *key, size_t key_len, kl_cancel *cancel,
	      int64_t timeout_ms, int64_t ttl_ms, unsigned flags, void **out,
	      uint64_t *fence, kl_error *err)
{
	struct local *lp = impl;
	struct local_lease *l;
	int64_t deadline = kl__deadline(timeout_ms);
	char tname[48];
	struct qstate st;
	struct stat tst;
	int rc, ifd = -1;

	(void)ttl_ms; /* a local lock lasts while its process lives */
	*out = NULL;
	*fence = 0;
	if (flags & KL_ERRORCHECK)
		return fail(err, KL_EINVAL,
			    "error-check mode is not supported", 0);
	if (kl_cancel_fired(cancel))
		return KL_ECANCELED;
	if ((l = kl__calloc(1, sizeof *l)) == NULL)
		return KL_ENOMEM;
	key_name(lp, l->name, sizeof l->name, key, key_len);
	/* The queue lock is only ever held for a few system calls: a try
	 * once may wait that long for it, not longer. */
	rc = open_queue(lp, l,
			timeout_ms == 0 ? kl__deadline(TRY_GRACE_MS) : deadline,
			cancel, err);
	if (rc != KL_OK) {
		kl__free(l);
		return rc;
	}
	if ((rc = read_state(lp, l->name, l->qfd, &st, err)) != KL_OK)
		goto fail_unlock;
	KL_CRASH_POINT("queue-locked");
	l->ticket = st.next++;
	ticket_name(tname, sizeof tname, l->name, l->ticket);
	/* A leftover file of this number (a crash between creating it and
	 * counting it) has no owner: replace it. */
	unlinkat(lp->dirfd, tname, 0);
	KL_CRASH_POINT("ticket-unlinked");
	l->tfd = open_checked(lp, tname, O_RDWR | O_CREAT | O_EXCL, err);
	if (l->tfd < 0) {
		rc = fail_file(lp, err, "cannot create the ticket file", tname,
			       l->tfd == -EPERM ? 0 : -l->tfd);
		goto fail_unlock;
	}
	KL_CRASH_POINT("ticket-created");
	/* Status looks at tickets by name without the queue lock, with a
	 * shared flock held for a moment: one that read the counters before
	 * the idle queue file was removed and made again may be looking at
	 * this new file under its old name.  Wait for it as for the queue
	 * lock. */
	rc = qlock(l->tfd, timeout_ms == 0 ? kl__deadline(TRY_GRACE_MS)
					   : deadline, cancel);
	if (rc == KL_OK && fstat(l->tfd, &tst) != 0)
		rc = KL_EPROVIDER;
	if (rc != KL_OK) {
		if (rc == KL_EPROVIDER)
			fail_file(lp, err, "cannot take the ticket", tname,
				  errno);
		goto fail_ticket;
	}
	l->tdev = tst.st_dev;
	l->tino = tst.st_ino;
	KL_CRASH_POINT("ticket-flocked");
	if (write_state(l->qfd, &st) != 0) {
		rc = fail_file(lp, err, "cannot take a ticket in", l->name,
			       errno);
		goto fail_ticket;
	}
	KL_CRASH_POINT("ticket-counted");
	for (;;) {
		if (advance(lp, l->name, l->qfd, &st, l->ticket) != 0) {
			rc = fail_file(lp, err, "cannot update", l->name,
				       errno);
			break;
		}
		if (st.serving == l->ticket) {
			/* Granted in a directory that is no longer the one
			 * the path leads to would be a grant nobody else
			 * sees. */
			if (lease_lost(lp, l)) {
				rc = lost_error(lp, err);
				break;
			}
			KL_CRASH_POINT("granting");
			st.fence++;
			if (write_state(l->qfd, &st) != 0) {
				rc = fail_file(lp, err, "cannot update",
					       l->name, errno);
				break;
			}
			KL_CRASH_POINT("granted");
			qunlock(l->qfd);
			watch_put(lp, ifd);
			*fence = st.fence;
			*out = l;
			return KL_OK;
		}
		rc = KL_OK;
		if (kl_cancel_fired(cancel))
			rc = KL_ECANCELED;
		else if (deadline != KL_NO_DEADLINE &&
			 kl__now_ns() >= deadline)
			rc = KL_ETIMEDOUT;
		if (rc != KL_OK)
			break;
		/* Made before the queue lock drops, so no release between
		 * here and the nap goes unseen. */
		if (ifd < 0)
			ifd = watch_get(lp);
		KL_CRASH_POINT("waiting");
		qunlock(l->qfd);
		nap(ifd, deadline == KL_NO_DEADLINE
				 ? POLL_MS
				 : (deadline - kl__now_ns()) / 1000000 + 1);
		if ((rc = qlock(l->qfd, deadline, cancel)) != KL_OK) {
			/* The queue lock's holder is stuck: dropping our
			 * ticket is enough, whoever comes next skips it. */
			if (rc == KL_EPROVIDER)
				fail_file(lp, err, "cannot lock", l->name,
					  errno);
			watch_put(lp, ifd);
			close(l->tfd);
			close(l->qfd);
			kl__free(l);
			return rc;
		}
		if ((rc = read_state(lp, l->name, l->qfd, &st, err)) != KL_OK)
			break;
	}
	/* Timed out, cancelled or failed: leave, passing the key on if it
	 * came to us meanwhile. */
	watch_put(lp, ifd);
	leave(lp, l, NULL);
	kl__free(l);
	return rc;

fail_ticket:
	unlinkat(lp->dirfd, tname, 0);
	close(l->tfd);
fail_unlock:
	qunlock(l->qfd);
	close(l->qfd);
	kl__free(l);
	return rc;
}

static int
local_release(void *impl, void *lease, kl_error *err)
{
	struct local *lp = impl;
	struct local_lease *l = lease;
	bool lost = lease_lost(lp, l);
	int rc;

	rc = qlock(l->qfd, kl__deadline(RELEASE_GRACE_MS), NULL);
	if (rc != KL_OK) {
		/* Closing the ticket frees the key all the same: the next
		 * one to look finds it dead and skips it. */
		close(l->tfd);
		close(l->qfd);
		rc = KL_OK;
	} else {
		KL_CRASH_POINT("release-locked");
		rc = leave(lp, l, err);
	}
	if (lost) {
		if (l->lost != NULL)
			l->lost(l->lost_ctx);
		rc = lost_error(lp, err);
	}
	kl__free(l);
	return rc;
}

static bool
local_valid(void *impl, void *lease)
{
	return !lease_lost(impl, lease);
}

static void
local_watch(void *impl, void *lease, void (*lost)(void *ctx), void *ctx)
{
	struct local_lease *l = lease;

	(void)impl;
	l->lost = lost;
	l->lost_ctx = ctx;
}

/* Never waits for the queue lock (its holder may be stopped): reads the
 * state as it is, again when a read raced with a write. */
static int
local_status(void *impl, const char *key, size_t key_len, size_t *holders,
	     size_t *waiters, kl_error *err)
{
	struct local *lp = impl;
	char name[24];
	struct qstate st;
	int qfd, rc;

	*holders = *waiters = 0;
	key_name(lp, name, sizeof name, key, key_len);
	qfd = open_checked(lp, name, O_RDONLY, err);
	if (qfd == -ENOENT || qfd == -EAGAIN)
		return KL_OK;
	if (qfd < 0)
		return qfd == -EPERM ? KL_EPROVIDER
				     : fail_file(lp, err, "cannot open", name,
						 -qfd);
	for (int tries = 0;; tries++) {
		rc = read_state(lp, name, qfd, &st, err);
		if (rc == KL_OK || tries == 3)
			break;
		{
			struct timespec ts = { 0, 1000000 };
			nanosleep(&ts, NULL);
		}
	}
	close(qfd);
	if (rc != KL_OK)
		return rc;
	/* The first live ticket holds the key, or will as soon as its owner
	 * looks; dead ones are not counted. */
	for (uint64_t n = st.serving; n < st.next; n++) {
		if (!ticket_alive(lp, name, n, false))
			continue;
		if (*holders == 0)
			*holders = 1;
		else
			(*waiters)++;
	}
	return KL_OK;
}

static void
local_destroy(void *impl)
{
	struct local *lp = impl;

	for (int i = 0; i < lp->npool; i++)
		close(lp->pool[i]);
	pthread_mutex_destroy(&lp->pool_lock);
	close(lp->sfd);
	close(lp->dirfd);
	kl__free(lp->path);
	kl__free(lp);
}

static const kl_provider_ops local_ops = {
	.struct_size = sizeof(kl_provider_ops),
	.name = "local",
	.acquire = local_acquire,
	.release = local_release,
	.valid = local_valid,
	.destroy = local_destroy,
	.status = local_status,
	.watch = local_watch,
};

int
kl__local_provider_open(kl_provider **out, const char *dir, kl_error *err)
{
	struct local *lp;
	struct stat st;
	char *path;
	int rc;

	*out = NULL;
	if (dir[0] != '\0') {
		if ((path = kl__strndup(dir, strlen(dir))) == NULL)
			return KL_ENOMEM;
	} else if ((rc = kl__local_default_dir(&path, err)) != KL_OK) {
		return rc;
	}
	if ((lp = kl__calloc(1, sizeof *lp)) == NULL) {
		kl__free(path);
		return KL_ENOMEM;
	}
	lp->sfd = -1;
	rc = kl__local_dir_open(path, &lp->dirfd, &lp->path, err);
	kl__free(path);
	if (rc != KL_OK) {
		kl__free(lp);
		return rc;
	}
	if (fstat(lp->dirfd, &st) != 0) {
		rc = fail(err, KL_EPROVIDER, "cannot stat the state directory",
			  errno);
		goto fail;
	}
	lp->dev = st.st_dev;
	lp->ino = st.st_ino;
	if ((rc = kl__local_secret(lp->dirfd, lp->path, &lp->k0, &lp->k1,
				   &lp->sfd, err)) != KL_OK)
		goto fail;
	if (fstat(lp->sfd, &st) != 0) {
		rc = fail_file(lp, err, "cannot stat", KL_LOCAL_SECRET,
			       errno);
		goto fail;
	}
	lp->sdev = st.st_dev;
	lp->sino = st.st_ino;
	if (pthread_mutex_init(&lp->pool_lock, NULL) != 0) {
		rc = KL_ENOMEM;
		goto fail;
	}
	if ((rc = kl_provider_new(out, &local_ops, lp)) != KL_OK) {
		pthread_mutex_destroy(&lp->pool_lock);
		goto fail;
	}
	return KL_OK;
fail:
	if (lp->sfd >= 0)
		close(lp->sfd);
	close(lp->dirfd);
	kl__free(lp->path);
	kl__free(lp);
	return rc;
}
