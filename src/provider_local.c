/* SPDX-License-Identifier: MIT */
/*
 * The local provider: strict-FIFO locks across the processes of one host,
 * with no server, over files in one private directory.
 *
 * Each key has a queue file "q<hash>" holding two ticket counters, next and
 * serving, and a fence; each ticket n in use has a ticket file "q<hash>.n"
 * on which its owner keeps an exclusive flock(2) for as long as it waits or
 * holds.  The queue file's own flock guards the counters and is held only
 * for a few system calls at a time.
 *
 * Invariants, all kept under the queue file's flock:
 * - a ticket file is created (and flocked by its owner) and unlinked only
 *   under the queue lock, so nobody ever sees a fresh unlocked ticket;
 * - ticket `serving` holds the key while its file is flocked; a ticket whose
 *   file is missing or can be flocked by someone else has no live owner
 *   (it gave up, released, or its process died and the kernel dropped the
 *   flock), and whoever looks next skips it: that is how a holder or a
 *   waiter killed with SIGKILL stops blocking the others.
 * Tickets are taken in arrival order at the queue lock and served in ticket
 * order: FIFO across processes.  Waiters sleep on inotify (a ticket file
 * unlinked, or closed by a dying process) with a short poll as a fallback,
 * so a lost event delays a waiter, never strands it.
 *
 * The directory must belong to the caller and be writable by nobody else;
 * every file is opened relative to it with O_NOFOLLOW and checked to be a
 * regular file of the caller's, so a planted symlink, FIFO or foreign file
 * is refused instead of followed.
 */
#include "config.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/file.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <unistd.h>

#include "internal.h"

/* Fixed SipHash key: every process must name a key's files alike.  A
 * collision only makes two keys share one queue (more exclusion, never
 * less). */
#define NAME_K0 0x6b65796c6f636b31ULL
#define NAME_K1 0x6c6f63616c717565ULL

#define POLL_MS 20 /* fallback re-check while waiting */

/*
 * Crash points (test build only): KL_CRASH_POINT("name") kills the process
 * with SIGKILL when the environment variable KL_CRASH_AT, read once, names
 * that point.  test/check_provider_local kills helper processes at each
 * step of queue mutation this way and checks that the next acquirer repairs
 * the state.  The names, in the order a process meets them:
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
 *   release-advanced  releasing: serving moved on, queue lock held
 */
#ifdef KL_TEST_HOOKS
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>

static const char *crash_at;
static pthread_once_t crash_once = PTHREAD_ONCE_INIT;

static void
crash_init(void)
{
	/* Read once, under pthread_once, in test builds only. */
	crash_at = getenv("KL_CRASH_AT"); /* NOLINT(concurrency-mt-unsafe) */
}

static void
crash_point(const char *name)
{
	pthread_once(&crash_once, crash_init);
	if (crash_at != NULL && strcmp(crash_at, name) == 0)
		kill(getpid(), SIGKILL);
}
#define KL_CRASH_POINT(name) crash_point(name)
#else
#define KL_CRASH_POINT(name) ((void)0)
#endif

struct local {
	int dirfd;
	char *path;
};

struct local_lease {
	int qfd, tfd;
	uint64_t ticket;
	char name[24]; /* "q" + 16 hex digits */
};

struct qstate {
	uint64_t next, serving, fence;
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

/* Opens name in the directory, refusing anything but a regular file of
 * ours. */
static int
open_checked(struct local *lp, const char *name, int flags, kl_error *err)
{
	struct stat st;
	int fd = openat(lp->dirfd, name,
			flags | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK, 0600);

	if (fd < 0)
		return -errno;
	if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) ||
	    st.st_uid != geteuid()) {
		close(fd);
		fail(err, KL_EPROVIDER, "refusing a state file that is not a "
					"regular file of ours",
		     0);
		return -EPERM;
	}
	return fd;
}

static void
ticket_name(char *buf, size_t size, const char *qname, uint64_t n)
{
	snprintf(buf, size, "%s.%" PRIu64, qname, n);
}

static int
read_state(int qfd, struct qstate *st)
{
	ssize_t n = pread(qfd, st, sizeof *st, 0);

	if (n == 0) {
		memset(st, 0, sizeof *st);
		return 0;
	}
	return n == (ssize_t)sizeof *st ? 0 : -1;
}

static int
write_state(int qfd, const struct qstate *st)
{
	return pwrite(qfd, st, sizeof *st, 0) == (ssize_t)sizeof *st ? 0 : -1;
}

static int
qlock(int qfd)
{
	while (flock(qfd, LOCK_EX) != 0)
		if (errno != EINTR)
			return -1;
	return 0;
}

static void
qunlock(int qfd)
{
	flock(qfd, LOCK_UN);
}

/* Whether ticket n has a live owner.  Queue lock held.  A dead ticket's
 * file is removed. */
static bool
ticket_alive(struct local *lp, const char *qname, uint64_t n)
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
		    O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
	if (fd < 0)
		return false;
	if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) ||
	    st.st_uid != geteuid()) {
		/* Not a ticket of ours: no live owner can hold it. */
		close(fd);
		unlinkat(lp->dirfd, tname, 0);
		return false;
	}
	alive = flock(fd, LOCK_EX | LOCK_NB) != 0 && errno == EWOULDBLOCK;
	if (!alive)
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

	while (st->serving < mine && !ticket_alive(lp, qname, st->serving)) {
		KL_CRASH_POINT("dead-skipped");
		st->serving++;
	}
	if (st->serving != from && write_state(qfd, st) != 0)
		return -1;
	return 0;
}

static void
key_name(char *buf, size_t size, const char *key, size_t len)
{
	snprintf(buf, size, "q%016" PRIx64,
		 kl__siphash(NAME_K0, NAME_K1, key, len));
}

/* Leaves the queue: passes the key on when it was ours, removes the
 * ticket.  Queue lock held on entry, released on return. */
static int
leave(struct local *lp, struct local_lease *l)
{
	char tname[48];
	struct qstate st;
	int rc = 0;

	/* The ticket file goes first: a process dying between the two
	 * steps leaves a ticket without a file, which the next one skips,
	 * rather than a file nobody would ever remove. */
	ticket_name(tname, sizeof tname, l->name, l->ticket);
	unlinkat(lp->dirfd, tname, 0);
	KL_CRASH_POINT("release-unlinked");
	if (read_state(l->qfd, &st) != 0)
		rc = -1;
	else if (st.serving == l->ticket) {
		st.serving++;
		rc = write_state(l->qfd, &st);
	}
	KL_CRASH_POINT("release-advanced");
	qunlock(l->qfd);
	close(l->tfd);
	close(l->qfd);
	return rc;
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
	key_name(l->name, sizeof l->name, key, key_len);
	l->qfd = open_checked(lp, l->name, O_RDWR | O_CREAT, err);
	if (l->qfd < 0) {
		rc = l->qfd == -EPERM ? KL_EPROVIDER
				      : fail(err, KL_EPROVIDER,
					     "cannot open the queue file",
					     -l->qfd);
		kl__free(l);
		return rc;
	}
	KL_CRASH_POINT("queue-opened");
	if (qlock(l->qfd) != 0 || read_state(l->qfd, &st) != 0) {
		rc = fail(err, KL_EPROVIDER, "cannot read the queue file",
			  errno);
		goto fail_close;
	}
	KL_CRASH_POINT("queue-locked");
	l->ticket = st.next++;
	ticket_name(tname, sizeof tname, l->name, l->ticket);
	/* A leftover file of this number (a crash between creating it and
	 * counting it) has no owner: replace it. */
	unlinkat(lp->dirfd, tname, 0);
	KL_CRASH_POINT("ticket-unlinked");
	l->tfd = open_checked(lp, tname, O_RDWR | O_CREAT | O_EXCL, err);
	if (l->tfd < 0) {
		rc = fail(err, KL_EPROVIDER, "cannot create a ticket file",
			  -l->tfd);
		goto fail_unlock;
	}
	KL_CRASH_POINT("ticket-created");
	if (flock(l->tfd, LOCK_EX | LOCK_NB) != 0) {
		rc = fail(err, KL_EPROVIDER, "cannot take a ticket", errno);
		goto fail_ticket;
	}
	KL_CRASH_POINT("ticket-flocked");
	if (write_state(l->qfd, &st) != 0) {
		rc = fail(err, KL_EPROVIDER, "cannot take a ticket", errno);
		goto fail_ticket;
	}
	KL_CRASH_POINT("ticket-counted");
	for (;;) {
		if (advance(lp, l->name, l->qfd, &st, l->ticket) != 0) {
			rc = fail(err, KL_EPROVIDER,
				  "cannot update the queue file", errno);
			break;
		}
		if (st.serving == l->ticket) {
			KL_CRASH_POINT("granting");
			st.fence++;
			if (write_state(l->qfd, &st) != 0) {
				rc = fail(err, KL_EPROVIDER,
					  "cannot update the queue file",
					  errno);
				break;
			}
			KL_CRASH_POINT("granted");
			qunlock(l->qfd);
			if (ifd >= 0)
				close(ifd);
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
		if (ifd < 0) {
			/* Made before the queue lock drops, so no release
			 * between here and the nap goes unseen. */
			ifd = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
			if (ifd >= 0 &&
			    inotify_add_watch(ifd, lp->path,
					      IN_DELETE | IN_CLOSE_WRITE) < 0) {
				close(ifd);
				ifd = -1;
			}
		}
		KL_CRASH_POINT("waiting");
		qunlock(l->qfd);
		nap(ifd, deadline == KL_NO_DEADLINE
				 ? POLL_MS
				 : (deadline - kl__now_ns()) / 1000000 + 1);
		if (qlock(l->qfd) != 0 || read_state(l->qfd, &st) != 0) {
			rc = fail(err, KL_EPROVIDER,
				  "cannot read the queue file", errno);
			qlock(l->qfd);
			break;
		}
	}
	/* Timed out, cancelled or failed: leave, passing the key on if it
	 * came to us meanwhile. */
	if (ifd >= 0)
		close(ifd);
	leave(lp, l);
	kl__free(l);
	return rc;

fail_ticket:
	unlinkat(lp->dirfd, tname, 0);
	close(l->tfd);
fail_unlock:
	qunlock(l->qfd);
fail_close:
	close(l->qfd);
	kl__free(l);
	return rc;
}

static int
local_release(void *impl, void *lease, kl_error *err)
{
	struct local_lease *l = lease;
	int rc = KL_OK;

	if (qlock(l->qfd) != 0) {
		rc = fail(err, KL_EPROVIDER, "cannot lock the queue file",
			  errno);
		close(l->tfd);
		close(l->qfd);
	} else {
		KL_CRASH_POINT("release-locked");
		if (leave(impl, l) != 0)
			rc = fail(err, KL_EPROVIDER,
				  "cannot update the queue file", errno);
	}
	kl__free(l);
	return rc;
}

static int
local_status(void *impl, const char *key, size_t key_len, size_t *holders,
	     size_t *waiters, kl_error *err)
{
	struct local *lp = impl;
	char name[24];
	struct qstate st;
	int qfd;

	*holders = *waiters = 0;
	key_name(name, sizeof name, key, key_len);
	qfd = open_checked(lp, name, O_RDWR, err);
	if (qfd == -ENOENT)
		return KL_OK;
	if (qfd < 0)
		return qfd == -EPERM ? KL_EPROVIDER
				     : fail(err, KL_EPROVIDER,
					    "cannot open the queue file",
					    -qfd);
	if (qlock(qfd) != 0 || read_state(qfd, &st) != 0) {
		close(qfd);
		return fail(err, KL_EPROVIDER, "cannot read the queue file",
			    errno);
	}
	/* Skip dead tickets first so the answer counts live owners only. */
	advance(lp, name, qfd, &st, st.next);
	for (uint64_t n = st.serving; n < st.next; n++) {
		if (!ticket_alive(lp, name, n))
			continue;
		if (n == st.serving)
			*holders = 1;
		else
			(*waiters)++;
	}
	qunlock(qfd);
	close(qfd);
	return KL_OK;
}

static void
local_destroy(void *impl)
{
	struct local *lp = impl;

	close(lp->dirfd);
	kl__free(lp->path);
	kl__free(lp);
}

static const kl_provider_ops local_ops = {
	.struct_size = sizeof(kl_provider_ops),
	.name = "local",
	.acquire = local_acquire,
	.release = local_release,
	.valid = NULL,
	.destroy = local_destroy,
	.status = local_status,
};

/* The default directory: $XDG_RUNTIME_DIR/keylock, else /run/lock/keylock
 * for root, else /tmp/keylock-UID. */
static char *
default_dir(void)
{
	const char *xdg = getenv("XDG_RUNTIME_DIR");
	char buf[4096];

	if (xdg != NULL && xdg[0] == '/')
		snprintf(buf, sizeof buf, "%s/keylock", xdg);
	else if (geteuid() == 0)
		snprintf(buf, sizeof buf, "/run/lock/keylock");
	else
		snprintf(buf, sizeof buf, "/tmp/keylock-%lu",
			 (unsigned long)geteuid());
	return kl__strndup(buf, strlen(buf));
}

int
kl__local_provider_open(kl_provider **out, const char *dir, kl_error *err)
{
	struct local *lp;
	struct stat st;
	int rc;

	*out = NULL;
	if ((lp = kl__calloc(1, sizeof *lp)) == NULL)
		return KL_ENOMEM;
	lp->dirfd = -1;
	lp->path = dir[0] != '\0' ? kl__strndup(dir, strlen(dir))
				  : default_dir();
	if (lp->path == NULL) {
		kl__free(lp);
		return KL_ENOMEM;
	}
	if (mkdir(lp->path, 0700) != 0 && errno != EEXIST) {
		rc = fail(err, KL_EPROVIDER, "cannot create the state directory",
			  errno);
		goto fail;
	}
	lp->dirfd = open(lp->path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW |
					   O_CLOEXEC);
	if (lp->dirfd >= 0 && lp->path[0] != '/') {
		/* inotify watches by path: make it independent of the
		 * working directory. */
		char *abs = realpath(lp->path, NULL);

		if (abs == NULL) {
			rc = KL_ENOMEM;
			goto fail;
		}
		kl__free(lp->path);
		lp->path = kl__strndup(abs, strlen(abs));
		free(abs);
		if (lp->path == NULL) {
			rc = KL_ENOMEM;
			goto fail;
		}
	}
	if (lp->dirfd < 0) {
		rc = fail(err, KL_EPROVIDER, "cannot open the state directory",
			  errno);
		goto fail;
	}
	/* Another user's directory, or one others may write to, could hold
	 * planted files: refuse it rather than trust it. */
	if (fstat(lp->dirfd, &st) != 0 || st.st_uid != geteuid() ||
	    (st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
		rc = fail(err, KL_EPROVIDER,
			  "the state directory must belong to this user and "
			  "be writable by nobody else",
			  0);
		goto fail;
	}
	if ((rc = kl_provider_new(out, &local_ops, lp)) != KL_OK)
		goto fail;
	return KL_OK;
fail:
	if (lp->dirfd >= 0)
		close(lp->dirfd);
	kl__free(lp->path);
	kl__free(lp);
	return rc;
}
