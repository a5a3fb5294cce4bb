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
 * Each key has a queue file "q<hash>" holding a magic number, three ticket
 * counters, next, serving and granted, the last fence, and the key itself
 * (when at most KL_LOCAL_KEY_KEEP bytes; for kl_provider_snapshot); each
 * ticket n in use has a ticket file "q<hash>.n" on which its owner keeps
 * an exclusive flock(2) for as long as it waits or holds, and which
 * records its mode (shared or exclusive), pid, tid, a per-process nonce,
 * when it queued and, once granted, its fence and when.  The queue file's
 * own flock guards the counters and is held only for a few system calls
 * at a time, but it is never waited for blindly: a process stopped while
 * holding it (SIGSTOP, a debugger, a frozen cgroup) must not hang the
 * others beyond their timeouts, so it is taken with LOCK_NB and short
 * sleeps bounded by the caller's deadline and cancel token, and status
 * reads without it.
 *
 * Invariants, all kept under the queue file's flock:
 * - a ticket file is created (its record written, then flocked by its
 *   owner) and unlinked only under the queue lock, so nobody ever sees a
 *   fresh unlocked ticket;
 * - serving <= granted <= next; the live tickets below granted hold the
 *   key (one exclusive, or any number of shared ones), those from granted
 *   on wait, in arrival order (the grant rule, W3C Web Locks', is in
 *   local_queue.c: whoever has the queue lock after a change grants the
 *   waiters at the head that may be granted, so a run of shared requests
 *   is granted together and a shared one never passes an exclusive one);
 * - a ticket whose file is missing or can be flocked by someone else has
 *   no live owner (it gave up, released, or its process died and the
 *   kernel dropped the flock), and whoever looks next skips it: that is
 *   how a holder or a waiter killed with SIGKILL stops blocking the
 *   others, and how a release that could not take the queue lock in time
 *   still frees the key (it just closes its ticket);
 * - a request leaving from the end of the queue (a try-once, a timed-out
 *   wait, the newest shared holder) gives its number back, with those of
 *   the dead tickets just before it, so that a long holder does not make
 *   [serving, next) grow with every refused try (see reclaim_tail);
 * - a queue file with no ticket left (serving == next) is removed by the
 *   one leaving it, under its lock, once its fence is behind the wall
 *   clock, with the file of ticket next that a process killed before
 *   counting it may have left: idle keys leave nothing behind.  Whoever
 *   opened it before the unlink sees, once it has the lock, that it has
 *   no link left and opens the name again.
 * Fences: a new queue file starts from the wall clock in microseconds and
 * each grant, shared or exclusive, adds one.  The file is only removed
 * when its fence is behind the clock, so a key's fence never repeats or
 * goes back, even across a removed or replaced directory, as long as the
 * wall clock does not go back and a key is granted at most once per
 * microsecond on average (a grant costs several system calls).
 * Tickets are taken in arrival order at the queue lock and granted in
 * ticket order: FIFO across processes.  Waiters sleep on inotify (a ticket
 * file unlinked, written with a grant, or closed by a dying process) with
 * a short poll as a fallback, so a lost event delays a waiter, never
 * strands it.  Inotify descriptors are kept in a small per-provider pool
 * rather than closed after each wait: closing one waits for an RCU grace
 * period, milliseconds on the hand-off path.
 *
 * KL_ERRORCHECK: a live holder's record naming the calling thread (pid,
 * this process's random nonce, which tells apart equal pids of PID
 * namespaces sharing the directory, and kl__thread_id, which unlike a tid
 * is never reused by a later thread) makes the request KL_EDEADLK.
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

#include "local_internal.h"

/*
 * Crash points (KL_CRASH_POINT, local_internal.h), in the order a process
 * meets them; test/local/check_provider_local kills helper processes at
 * each and checks that the next acquirer repairs the state, and stops one
 * with the queue lock held to check that nobody hangs:
 *   queue-opened      queue file open, queue lock not taken
 *   queue-locked      queue lock held, nothing changed
 *   ticket-unlinked   a leftover file of the new number removed
 *   ticket-created    ticket file created with its record, not flocked,
 *                     not counted
 *   ticket-flocked    ticket file flocked, not counted
 *   ticket-counted    ticket counted (next written), queue lock held
 *   waiting           about to drop the queue lock and sleep
 *   dead-skipped      a dead ticket's file removed, the counters not
 *                     written (local_queue.c)
 *   granting          a ticket (maybe another's) about to be granted,
 *                     nothing written (local_queue.c)
 *   grant-recorded    its fence written in its file, the counters not
 *                     (local_queue.c)
 *   granted           the owner found its grant, queue lock held
 *   granted-registered  the same, queue lock dropped, for a wait that
 *                     registered for deadlock detection: its waits
 *                     record not removed yet (local_deadlock.c)
 *   release-locked    releasing: queue lock held, nothing changed
 *   release-unlinked  releasing: ticket file removed, the queue not
 *                     processed
 *   release-advanced  releasing: the queue processed (or the idle queue
 *                     file removed), queue lock held
 */

#define POLL_MS 20      /* fallback re-check while waiting */
#define RELEASE_GRACE_MS 200 /* release waits this long for it, then just
				* drops its ticket */

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
	char tname[KL_LOCAL_TNAME];
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
	kl__local_ticket_name(tname, sizeof tname, l->name, l->ticket);
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

/* Gives the numbers of the dead tickets at the end of the queue back
 * (ours among them), so that the next ticket taken reuses them.  serving
 * cannot pass a live holder, so without this every try-once or timed-out
 * wait behind a long holder would leave a dead number in the range
 * [serving, next) for as long as it holds (those that a newer live
 * ticket keeps there are skipped by kl__local_ticket_files).  A reused
 * number is a fresh ticket file, told from the old one as after an idle
 * queue file is made again (see acquire).  Queue lock held; st written
 * back when it changed. */
static int
reclaim_tail(struct local *lp, const struct local_lease *l,
	     struct kl__local_qstate *st, kl_error *err)
{
	uint64_t next = st->next, dead = 0, first, last;
	char tname[KL_LOCAL_TNAME];

	/* Only from our own ticket: the hand-off path (a holder at the
	 * head, its waiters behind) looks at nothing more. */
	if (next == 0 || next - 1 != l->ticket)
		return KL_OK;
	while (next > st->serving &&
	       !kl__local_ticket_alive(lp, l->name, next - 1, true)) {
		next--;
		if (++dead % KL_LOCAL_DEAD_RUN == 0 && next > st->serving &&
		    kl__local_ticket_files(lp, l->name, st->serving, next,
					   &first, &last))
			next = last == next ? st->serving : last + 1;
	}
	if (next == st->next)
		return KL_OK;
	/* A file numbered next is nobody's (a process killed between
	 * making its ticket file and counting it; see leave): once next is
	 * lowered, no ticket taken and no idle queue's cleanup would look
	 * at that number again. */
	kl__local_ticket_name(tname, sizeof tname, l->name, st->next);
	unlinkat(lp->dirfd, tname, 0);
	st->next = next;
	if (st->granted > next)
		st->granted = next;
	if (kl__local_write_state(l->qfd, st) != 0)
		return kl__local_fail_file(lp, err, "cannot update", l->name,
					   errno);
	return KL_OK;
}

/* Leaves the queue: removes the ticket, passes the key on when it was
 * ours, and removes the queue file when nobody is left in it.  Queue lock
 * held on entry, released on return; the files are closed. */
static int
leave(struct local *lp, struct local_lease *l, kl_error *err)
{
	char tname[KL_LOCAL_TNAME];
	struct kl__local_qstate st;
	struct stat qst;
	int rc;

	/* The ticket file goes first: a process dying between the two
	 * steps leaves a ticket without a file, which the next one skips,
	 * rather than a file nobody would ever remove. */
	kl__local_ticket_name(tname, sizeof tname, l->name, l->ticket);
	unlink_own(lp, tname, l->tdev, l->tino);
	KL_CRASH_POINT("release-unlinked");
	rc = kl__local_read_state(lp, l->name, l->qfd, &st, err);
	if (rc == KL_OK) {
		/* Past our own ticket and any dead one, granting the
		 * waiters at the head that may be granted now. */
		rc = kl__local_process(lp, l->name, l->qfd, &st, NULL, err);
		if (rc == KL_OK)
			rc = reclaim_tail(lp, l, &st, err);
		if (rc == KL_OK && st.serving == st.next &&
		    st.fence < kl__local_wall_us() &&
			 fstatat(lp->dirfd, l->name, &qst,
				 AT_SYMLINK_NOFOLLOW) == 0 &&
			 same_file(&qst, l->qdev, l->qino)) {
			/* A process killed between making its ticket file
			 * and counting it left one numbered next, which
			 * only the next ticket taken would replace: once
			 * the queue file is gone, none will. */
			kl__local_ticket_name(tname, sizeof tname, l->name,
					      st.next);
			unlinkat(lp->dirfd, tname, 0);
			unlinkat(lp->dirfd, l->name, 0);
		}
	}
	KL_CRASH_POINT("release-advanced");
	kl__local_qunlock(l->qfd);
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
	if (lp->npool < KL_LOCAL_POOL_MAX) {
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
		l->qfd = kl__local_open_checked(lp, l->name, O_RDWR | O_CREAT, err);
		if (l->qfd == -EAGAIN && tries < 1000)
			continue;
		if (l->qfd < 0)
			return l->qfd == -EPERM
				       ? KL_EPROVIDER
				       : kl__local_fail_file(lp, err, "cannot open",
						   l->name, -l->qfd);
		KL_CRASH_POINT("queue-opened");
		if ((rc = kl__local_qlock(l->qfd, qdeadline, cancel)) != KL_OK) {
			if (rc == KL_EPROVIDER)
				kl__local_fail_file(lp, err, "cannot lock", l->name,
					  errno);
			close(l->qfd);
			return rc;
		}
		if (fstat(l->qfd, &st) != 0) {
			rc = kl__local_fail_file(lp, err, "cannot stat", l->name, errno);
			close(l->qfd);
			return rc;
		}
		/* Unlinked as idle by its last user between our open and
		 * our lock: the live queue is under the name again. */
		if (st.st_nlink == 0 && tries < 1000) {
			kl__local_qunlock(l->qfd);
			close(l->qfd);
			continue;
		}
		l->qdev = st.st_dev;
		l->qino = st.st_ino;
		return KL_OK;
	}
}

/* KL_ERRORCHECK: whether a live holder of the queue is the calling
 * thread (a walk's callback; arg is this thread's record). */
static int
held_by_me(const struct kl__local_ticket *t, void *arg)
{
	const struct kl__local_trec *me = arg;

	return t->holds && t->has_grant && t->known &&
	       t->rec.pid == me->pid && t->rec.nonce == me->nonce &&
	       t->rec.thread == me->thread;
}

/* The end of a wait chosen to break a deadlock (out of the graph
 * already): leaves the queue as a timed-out waiter does, passing the key
 * on if it came to us meanwhile. */
static int
deadlock_victim(struct local *lp, struct local_lease *l)
{
	if (kl__local_qlock(l->qfd, kl__deadline(RELEASE_GRACE_MS), NULL) ==
	    KL_OK) {
		leave(lp, l, NULL);
	} else {
		/* Its holder is stuck: dropping the ticket is enough. */
		close(l->tfd);
		close(l->qfd);
	}
	kl__free(l);
	return KL_EDEADLK;
}

static int
acquire(void *impl, const char *key, size_t key_len, kl_cancel *cancel,
	int64_t timeout_ms, int64_t ttl_ms, unsigned flags, void **out,
	uint64_t *fence, kl_error *err)
{
	struct local *lp = impl;
	struct local_lease *l;
	int64_t deadline = kl__deadline(timeout_ms);
	char tname[KL_LOCAL_TNAME];
	struct kl__local_qstate st;
	struct kl__local_dl dl;
	struct stat tst;
	bool fresh;
	int rc, ifd = -1;

	(void)ttl_ms; /* a local lock lasts while its process lives */
	*out = NULL;
	*fence = 0;
	if (kl_cancel_fired(cancel))
		return KL_ECANCELED;
	if ((l = kl__calloc(1, sizeof *l)) == NULL)
		return KL_ENOMEM;
	l->shared = (flags & KL_SHARED) != 0;
	kl__local_key_name(lp, l->name, sizeof l->name, key, key_len);
	/* The queue lock is only ever held for a few system calls: a try
	 * once may wait that long for it, not longer. */
	rc = open_queue(lp, l,
			timeout_ms == 0 ? kl__deadline(KL_LOCAL_TRY_GRACE_MS)
					: deadline,
			cancel, err);
	if (rc != KL_OK) {
		kl__free(l);
		return rc;
	}
	if ((rc = kl__local_read_state(lp, l->name, l->qfd, &st, err)) !=
	    KL_OK)
		goto fail_unlock;
	KL_CRASH_POINT("queue-locked");
	if (flags & KL_ERRORCHECK) {
		struct kl__local_trec me;

		kl__local_self(&me);
		if (kl__local_walk(lp, l->name, &st, held_by_me, &me) != 0) {
			rc = kl__local_fail(err, KL_EDEADLK,
					    "this thread holds the key already",
					    0);
			goto fail_unlock;
		}
	}
	fresh = st.next == 0;
	l->ticket = st.next++;
	kl__local_ticket_name(tname, sizeof tname, l->name, l->ticket);
	/* A leftover file of this number (a crash between creating it and
	 * counting it) has no owner: replace it. */
	unlinkat(lp->dirfd, tname, 0);
	KL_CRASH_POINT("ticket-unlinked");
	l->tfd = kl__local_open_checked(lp, tname, O_RDWR | O_CREAT | O_EXCL,
					err);
	if (l->tfd < 0) {
		rc = kl__local_fail_file(lp, err,
					 "cannot create the ticket file", tname,
					 l->tfd == -EPERM ? 0 : -l->tfd);
		goto fail_unlock;
	}
	/* Before the flock: whoever finds it flocked may read it. */
	if (kl__local_write_ticket(l->tfd, l->ticket, l->shared,
				   (int64_t)kl__local_wall_us()) != 0) {
		rc = kl__local_fail_file(lp, err, "cannot write the ticket file",
					 tname, errno);
		goto fail_ticket;
	}
	KL_CRASH_POINT("ticket-created");
	/* Status looks at tickets by name without the queue lock, with a
	 * shared flock held for a moment: one that read the counters before
	 * the idle queue file was removed and made again may be looking at
	 * this new file under its old name.  Wait for it as for the queue
	 * lock. */
	rc = kl__local_qlock(l->tfd,
			     timeout_ms == 0
				     ? kl__deadline(KL_LOCAL_TRY_GRACE_MS)
				     : deadline,
			     cancel);
	if (rc == KL_OK && fstat(l->tfd, &tst) != 0)
		rc = KL_EPROVIDER;
	if (rc != KL_OK) {
		if (rc == KL_EPROVIDER)
			kl__local_fail_file(lp, err, "cannot take the ticket",
					    tname, errno);
		goto fail_ticket;
	}
	l->tdev = tst.st_dev;
	l->tino = tst.st_ino;
	KL_CRASH_POINT("ticket-flocked");
	if (fresh) {
		st.key_len = key_len;
		rc = kl__local_write_first(l->qfd, &st, key, key_len);
	} else {
		rc = kl__local_write_state(l->qfd, &st);
	}
	if (rc != 0) {
		rc = kl__local_fail_file(lp, err, "cannot take a ticket in",
					 l->name, errno);
		goto fail_ticket;
	}
	KL_CRASH_POINT("ticket-counted");
	kl__local_dl_init(&dl);
	for (;;) {
		rc = kl__local_process(lp, l->name, l->qfd, &st, l, err);
		if (rc != KL_OK)
			break;
		/* The grant may have been made by another process, which
		 * cannot see our token: a token that fired before we
		 * look here must win (DESIGN: no grant after the fire
		 * returned), and leaving passes the key on. */
		if (kl_cancel_fired(cancel)) {
			rc = KL_ECANCELED;
			break;
		}
		if (l->ticket < st.granted) {
			/* Granted in a directory that is no longer the one
			 * the path leads to would be a grant nobody else
			 * sees. */
			if (lease_lost(lp, l)) {
				rc = lost_error(lp, err);
				break;
			}
			rc = kl__local_own_fence(lp, l, &st, fence, err);
			if (rc != KL_OK)
				break;
			KL_CRASH_POINT("granted");
			kl__local_qunlock(l->qfd);
			if (dl.wfd >= 0)
				KL_CRASH_POINT("granted-registered");
			kl__local_dl_end(lp, &dl);
			watch_put(lp, ifd);
			*out = l;
			return KL_OK;
		}
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
		kl__local_qunlock(l->qfd);
		/* Deadlock detection: nothing but a clock read before the
		 * wait has lasted deadlock_ms. */
		if (kl__local_dl_due(&dl) &&
		    kl__local_dl_check(lp, l, key, key_len, &dl, err) ==
			    KL_EDEADLK) {
			watch_put(lp, ifd);
			return deadlock_victim(lp, l);
		}
		nap(ifd, deadline == KL_NO_DEADLINE
				 ? POLL_MS
				 : (deadline - kl__now_ns()) / 1000000 + 1);
		if ((rc = kl__local_qlock(l->qfd, deadline, cancel)) != KL_OK) {
			/* The queue lock's holder is stuck: dropping our
			 * ticket is enough, whoever comes next skips it. */
			if (rc == KL_EPROVIDER)
				kl__local_fail_file(lp, err, "cannot lock",
						    l->name, errno);
			kl__local_dl_end(lp, &dl);
			watch_put(lp, ifd);
			close(l->tfd);
			close(l->qfd);
			kl__free(l);
			return rc;
		}
		if ((rc = kl__local_read_state(lp, l->name, l->qfd, &st,
					       err)) != KL_OK)
			break;
	}
	/* Timed out, cancelled or failed: leave, passing the key on if it
	 * came to us meanwhile. */
	kl__local_dl_end(lp, &dl);
	watch_put(lp, ifd);
	leave(lp, l, NULL);
	kl__free(l);
	return rc;

fail_ticket:
	unlinkat(lp->dirfd, tname, 0);
	close(l->tfd);
fail_unlock:
	kl__local_qunlock(l->qfd);
	close(l->qfd);
	kl__free(l);
	return rc;
}

/*
 * keylock(3): acquire, release, status and snapshot are not pthread_cancel
 * cancellation points, though they sleep, poll and read files: a thread
 * cancelled inside would vanish with its ticket file open and flocked, or
 * with the queue lock taken, and that flock lives as long as the process:
 * its place would stay live (the key, once passed to it, never free
 * again) and the whole key could stay locked.  A deferred cancel takes
 * effect at the caller's next cancellation point.
 */
static int
local_acquire(void *impl, const char *key, size_t key_len, kl_cancel *cancel,
	      int64_t timeout_ms, int64_t ttl_ms, unsigned flags, void **out,
	      uint64_t *fence, kl_error *err)
{
	int old, rc;

	pthread_setcancelstate(PTHREAD_CANCEL_DISABLE, &old);
	rc = acquire(impl, key, key_len, cancel, timeout_ms, ttl_ms, flags,
		     out, fence, err);
	pthread_setcancelstate(old, NULL);
	return rc;
}

static int
release(void *impl, void *lease, kl_error *err)
{
	struct local *lp = impl;
	struct local_lease *l = lease;
	bool lost = lease_lost(lp, l);
	int rc;

	rc = kl__local_qlock(l->qfd, kl__deadline(RELEASE_GRACE_MS), NULL);
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

static int
local_release(void *impl, void *lease, kl_error *err)
{
	int old, rc;

	pthread_setcancelstate(PTHREAD_CANCEL_DISABLE, &old);
	rc = release(impl, lease, err);
	pthread_setcancelstate(old, NULL);
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
/* A walk's callback: counts holders in counts[0], waiters in counts[1]. */
static int
count_ticket(const struct kl__local_ticket *t, void *arg)
{
	size_t *counts = arg;

	/* A ticket counted alive only because we could not look (out of
	 * descriptors) may be a dead one: no count rather than a wrong
	 * one. */
	if (t->unsure != 0)
		return t->unsure;
	counts[t->holds ? 0 : 1]++;
	return 0;
}

static int
status(void *impl, const char *key, size_t key_len, size_t *holders,
       size_t *waiters, kl_error *err)
{
	struct local *lp = impl;
	char name[KL_LOCAL_QNAME];
	struct kl__local_qstate st;
	size_t counts[2] = { 0, 0 };
	int qfd, rc;

	*holders = *waiters = 0;
	kl__local_key_name(lp, name, sizeof name, key, key_len);
	qfd = kl__local_open_checked(lp, name, O_RDONLY, err);
	if (qfd == -ENOENT || qfd == -EAGAIN)
		return KL_OK;
	if (qfd < 0)
		return qfd == -EPERM ? KL_EPROVIDER
				     : kl__local_fail_file(lp, err, "cannot open", name,
						 -qfd);
	for (int tries = 0;; tries++) {
		rc = kl__local_read_state(lp, name, qfd, &st, err);
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
	/* Dead tickets are not counted; a waiter that would be granted as
	 * soon as someone looks counts as holding. */
	if ((rc = kl__local_walk(lp, name, &st, count_ticket, counts)) != 0)
		return kl__local_fail_file(lp, err,
					   "cannot tell who holds the key of",
					   name, rc);
	*holders = counts[0];
	*waiters = counts[1];
	return KL_OK;
}

static int
local_status(void *impl, const char *key, size_t key_len, size_t *holders,
	     size_t *waiters, kl_error *err)
{
	int old, rc;

	pthread_setcancelstate(PTHREAD_CANCEL_DISABLE, &old);
	rc = status(impl, key, key_len, holders, waiters, err);
	pthread_setcancelstate(old, NULL);
	return rc;
}

static void
local_destroy(void *impl)
{
	struct local *lp = impl;

	for (int i = 0; i < lp->npool; i++)
		close(lp->pool[i]);
	pthread_mutex_destroy(&lp->pool_lock);
	pthread_mutex_destroy(&lp->dl_lock);
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
	.snapshot = kl__local_snapshot,
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
		rc = kl__local_fail(err, KL_EPROVIDER, "cannot stat the state directory",
			  errno);
		goto fail;
	}
	lp->dev = st.st_dev;
	lp->ino = st.st_ino;
	if ((rc = kl__local_secret(lp->dirfd, lp->path, &lp->k0, &lp->k1,
				   &lp->sfd, err)) != KL_OK)
		goto fail;
	if (fstat(lp->sfd, &st) != 0) {
		rc = kl__local_fail_file(lp, err, "cannot stat", KL_LOCAL_SECRET,
			       errno);
		goto fail;
	}
	lp->sdev = st.st_dev;
	lp->sino = st.st_ino;
	if (pthread_mutex_init(&lp->pool_lock, NULL) != 0) {
		rc = KL_ENOMEM;
		goto fail;
	}
	if (pthread_mutex_init(&lp->dl_lock, NULL) != 0) {
		pthread_mutex_destroy(&lp->pool_lock);
		rc = KL_ENOMEM;
		goto fail;
	}
	if ((rc = kl_provider_new(out, &local_ops, lp)) != KL_OK) {
		pthread_mutex_destroy(&lp->dl_lock);
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
