/* SPDX-License-Identifier: MIT */
/*
 * The local provider's state files and the grant rule of its queues (the
 * protocol is described at the top of provider_local.c).
 *
 * A key's queue is the range of tickets [serving, next) of its queue
 * file; granted splits it: the live tickets below granted hold the key,
 * those from granted on wait, in ticket (arrival) order.  Holders are
 * either one exclusive ticket or any number of shared ones, and they are
 * always the first live tickets: grants are made in ticket order only.
 * Whoever has the queue lock after a change (a ticket taken or given
 * back, a waiter woken) grants, from granted on, every request that the
 * W3C Web Locks rule allows: the first waiter, when it is exclusive and
 * nothing is held, or shared and nothing is held exclusively, and so on
 * until one is not grantable.  A shared request never passes a waiting
 * exclusive one.  A grant writes the ticket's fence into its file first
 * and moves granted after, so a process killed in between leaves a
 * ticket that is simply granted again; the owner only believes its grant
 * once granted has moved past its ticket.  A dead ticket (see
 * kl__local_ticket_alive) is skipped on the way; dead tickets below
 * serving's first live one are removed as serving moves past them.  A
 * long run of numbers without a file (short requests that came and went
 * behind a long holder) is crossed with one directory scan
 * (kl__local_ticket_files), not one look per number.
 *
 * Ticket files also record who asked (pid, tid, a random per-process
 * nonce), in which mode and since when, which status, snapshot and
 * KL_ERRORCHECK read back; the queue file records the key itself.
 */
#include "config.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <sys/file.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "local_internal.h"

#define QUEUE_MAGIC 0x324b4c51514b4c4bULL  /* "KLQQKL2" with a version */
#define TICKET_MAGIC 0x314b4c54544b4c4bULL /* "KLTTKL1" */
#define GRANT_MAGIC 0x9e3779b97f4a7c15ULL

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

void
kl__local_crash_point(const char *name)
{
	pthread_once(&crash_once, crash_init);
	if (crash_at != NULL && strcmp(crash_at, name) == 0)
		kill(getpid(), SIGKILL);
	if (stop_at != NULL && strcmp(stop_at, name) == 0)
		kill(getpid(), SIGSTOP);
}
#endif

/* strerror, thread-safe (GNU strerror_r: the text lives in buf or is
 * static). */
#define ERRTEXT(e) strerror_r((e), errbuf, sizeof errbuf)

int
kl__local_fail(kl_error *err, int rc, const char *what, int errnum)
{
	char errbuf[128];

	if (errnum != 0)
		kl__error_set(err, rc, "local provider: %s: %s", what,
			      ERRTEXT(errnum));
	else
		kl__error_set(err, rc, "local provider: %s", what);
	return rc;
}

int
kl__local_fail_file(struct local *lp, kl_error *err, const char *what,
		    const char *name, int errnum)
{
	char errbuf[128];

	kl__error_set(err, KL_EPROVIDER, "local provider: %s %s/%s%s%s", what,
		      lp->path, name, errnum != 0 ? ": " : "",
		      errnum != 0 ? ERRTEXT(errnum) : "");
	return KL_EPROVIDER;
}

/* The wall clock in microseconds: for fences that must not repeat once a
 * key's state is gone (see provider_local.c), and for the times snapshot
 * reports, which processes of one host must agree on. */
uint64_t
kl__local_wall_us(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_REALTIME, &ts);
	return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

int
kl__local_open_checked(struct local *lp, const char *name, int flags,
		       kl_error *err)
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

void
kl__local_ticket_name(char *buf, size_t size, const char *qname, uint64_t n)
{
	snprintf(buf, size, "%s.%" PRIu64, qname, n);
}

void
kl__local_key_name(struct local *lp, char *buf, size_t size, const char *key,
		   size_t len)
{
	snprintf(buf, size, "q%016" PRIx64,
		 kl__siphash(lp->k0, lp->k1, key, len));
}

int
kl__local_read_state(struct local *lp, const char *name, int qfd,
		     struct kl__local_qstate *st, kl_error *err)
{
	ssize_t n = pread(qfd, st, sizeof *st, 0);

	if (n < 0)
		return kl__local_fail_file(lp, err, "cannot read", name, errno);
	if (n == 0) {
		/* A fresh queue (next 0 says so), whose fences start
		 * from the wall clock. */
		memset(st, 0, sizeof *st);
		st->magic = QUEUE_MAGIC;
		st->fence = kl__local_wall_us();
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
	if (st->magic != QUEUE_MAGIC || st->serving > st->granted ||
	    st->granted > st->next ||
	    st->next - st->serving > KL_LOCAL_MAX_TICKETS ||
	    st->next > UINT64_MAX / 4 || st->fence > UINT64_MAX / 4) {
		kl__error_set(err, KL_EPROVIDER,
			      "local provider: the queue file %s/%s is damaged "
			      "or of another version of keylock (next %" PRIu64
			      ", serving %" PRIu64 ", granted %" PRIu64
			      ", fence %" PRIu64 "); remove it once no process "
			      "uses the key",
			      lp->path, name, st->next, st->serving,
			      st->granted, st->fence);
		return KL_EPROVIDER;
	}
	return KL_OK;
}

int
kl__local_write_state(int qfd, const struct kl__local_qstate *st)
{
	return pwrite(qfd, st, sizeof *st, 0) == (ssize_t)sizeof *st ? 0 : -1;
}

/* The first state of a queue file, with its key when it is short enough
 * to keep.  One write: a process killed in it leaves the header whole
 * (or none) and at worst part of the key, which snapshot finds out by
 * hashing it. */
int
kl__local_write_first(int qfd, const struct kl__local_qstate *st,
		      const char *key, size_t len)
{
	struct iovec iov[2] = {
		{ .iov_base = (void *)st, .iov_len = sizeof *st },
		{ .iov_base = (void *)key, .iov_len = len },
	};
	ssize_t n;

	n = pwritev(qfd, iov, len <= KL_LOCAL_KEY_KEEP ? 2 : 1, 0);
	return n >= (ssize_t)sizeof *st ? 0 : -1;
}

int
kl__local_qlock(int fd, int64_t deadline, kl_cancel *cancel)
{
	int64_t backoff = 20000, ns, now;
	struct timespec ts;

	/* The lock is normally held for microseconds: start with short
	 * sleeps, growing to 2 ms for a holder that is stuck. */
	for (;;) {
		if (flock(fd, LOCK_EX | LOCK_NB) == 0)
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

void
kl__local_qunlock(int fd)
{
	flock(fd, LOCK_UN);
}

static uint64_t self_nonce;
static pthread_once_t self_once = PTHREAD_ONCE_INIT;

static void
self_init(void)
{
	uint64_t v;

	/* Tells this process from one with the same pid in another PID
	 * namespace sharing the directory. */
	if (getrandom(&v, sizeof v, GRND_NONBLOCK) != (ssize_t)sizeof v)
		v = kl__local_wall_us() ^ ((uint64_t)getpid() << 32) ^
		    (uint64_t)(uintptr_t)&v;
	self_nonce = v | 1;
}

void
kl__local_self(struct kl__local_trec *rec)
{
	pthread_once(&self_once, self_init);
	rec->pid = getpid();
	rec->tid = gettid();
	rec->nonce = self_nonce;
	rec->thread = kl__thread_id();
}

int
kl__local_write_ticket(int tfd, uint64_t n, bool shared, int64_t since_us)
{
	struct kl__local_trec rec;

	memset(&rec, 0, sizeof rec);
	rec.magic = TICKET_MAGIC;
	rec.ticket = n;
	rec.mode = shared ? KL_LOCAL_TICKET_SHARED : 0;
	kl__local_self(&rec);
	rec.since_us = since_us;
	return pwrite(tfd, &rec, sizeof rec, 0) == (ssize_t)sizeof rec ? 0
									 : -1;
}

static uint64_t
grant_check(uint64_t n, uint64_t fence)
{
	return GRANT_MAGIC ^ n ^ (fence * 0xff51afd7ed558ccdULL);
}

/* What ticket n's file says, into t (known, shared, has_grant). */
void
kl__local_read_ticket(int fd, uint64_t n, struct kl__local_ticket *t)
{
	struct {
		struct kl__local_trec rec;
		struct kl__local_tgrant grant;
	} buf;
	ssize_t r = pread(fd, &buf, sizeof buf, 0);

	if (r < (ssize_t)sizeof buf.rec || buf.rec.magic != TICKET_MAGIC ||
	    buf.rec.ticket != n ||
	    (buf.rec.mode & ~KL_LOCAL_TICKET_SHARED) != 0)
		return;
	t->known = true;
	t->rec = buf.rec;
	t->shared = (buf.rec.mode & KL_LOCAL_TICKET_SHARED) != 0;
	if (r == (ssize_t)sizeof buf && buf.grant.fence != 0 &&
	    buf.grant.check == grant_check(n, buf.grant.fence)) {
		t->has_grant = true;
		t->grant = buf.grant;
	}
}

/* Whether ticket n has a live owner, and what its file says (t->known
 * false when it cannot be read: then it counts as exclusive, the safe
 * side).  Queue lock held (then a dead ticket's file is removed) or not
 * (then nothing changes). */
static bool
ticket_look(struct local *lp, const char *qname, uint64_t n, bool locked,
	    struct kl__local_ticket *t)
{
	char tname[KL_LOCAL_TNAME];
	struct stat st;
	bool alive;
	int fd;

	memset(t, 0, sizeof *t);
	t->n = n;
	kl__local_ticket_name(tname, sizeof tname, qname, n);
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
	if (fd < 0) {
		if (errno != EMFILE && errno != ENFILE && errno != ENOMEM &&
		    errno != EINTR)
			return false;
		t->unsure = errno;
		return true;
	}
	if (fstat(fd, &st) != 0) {
		t->unsure = errno;
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
	/* Shared, with the queue lock too: the only exclusive flock on a
	 * ticket file is its owner's, so a shared one fails exactly when
	 * the owner lives, and no looker (status, a snapshot, maybe stopped
	 * while it looks) can make a dead ticket look alive to another and
	 * keep a dead holder's key.  A failure other than EWOULDBLOCK
	 * (ENOLCK) does not tell either: alive. */
	alive = flock(fd, LOCK_SH | LOCK_NB) != 0;
	if (alive && errno != EWOULDBLOCK)
		t->unsure = errno;
	if (!alive && locked) {
		struct kl__local_ticket dead;

		/* A process killed while it waited may have left its waits
		 * record (deadlock detection): it goes with the ticket. */
		memset(&dead, 0, sizeof dead);
		kl__local_read_ticket(fd, n, &dead);
		if (dead.known)
			kl__local_dl_forget(lp, qname, n, &dead.rec);
		unlinkat(lp->dirfd, tname, 0);
	}
	/* Its owner wrote the record before it took the flock. */
	if (alive)
		kl__local_read_ticket(fd, n, t);
	close(fd);
	return alive;
}

bool
kl__local_ticket_alive(struct local *lp, const char *qname, uint64_t n,
		       bool locked)
{
	struct kl__local_ticket t;

	return ticket_look(lp, qname, n, locked, &t);
}

bool
kl__local_ticket_files(struct local *lp, const char *qname, uint64_t lo,
		       uint64_t hi, uint64_t *min, uint64_t *max)
{
	size_t qlen = strlen(qname);
	struct dirent *e;
	DIR *d;
	int fd;

	*min = *max = hi;
	fd = openat(lp->dirfd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (fd < 0)
		return false;
	if ((d = fdopendir(fd)) == NULL) {
		close(fd);
		return false;
	}
	for (;;) {
		const char *s;
		uint64_t n = 0;

		errno = 0;
		/* The stream is this call's own: readdir is safe on it. */
		e = readdir(d); /* NOLINT(concurrency-mt-unsafe) */
		if (e == NULL)
			break;
		if (strncmp(e->d_name, qname, qlen) != 0 ||
		    e->d_name[qlen] != '.')
			continue;
		/* Only the names kl__local_ticket_name gives: no sign, no
		 * leading zero. */
		s = e->d_name + qlen + 1;
		if (*s == '\0' || (*s == '0' && s[1] != '\0'))
			continue;
		for (; *s >= '0' && *s <= '9' && n <= UINT64_MAX / 10 - 1; s++)
			n = n * 10 + (uint64_t)(*s - '0');
		if (*s != '\0' || n < lo || n >= hi)
			continue;
		if (*min == hi || n < *min)
			*min = n;
		if (*max == hi || n > *max)
			*max = n;
	}
	/* A scan cut short may have missed a live ticket. */
	if (errno != 0) {
		closedir(d);
		return false;
	}
	closedir(d);
	return true;
}

/* Writes ticket n's grant: through mine's descriptor when it is the
 * caller's, else through the file (which its owner keeps flocked).  0 or
 * -1 (errno set). */
static int
grant_write(struct local *lp, const char *qname, uint64_t n, uint64_t fence,
	    const struct local_lease *mine)
{
	struct kl__local_tgrant g = { .fence = fence,
				      .at_us = (int64_t)kl__local_wall_us(),
				      .check = grant_check(n, fence) };
	char tname[KL_LOCAL_TNAME];
	struct stat st;
	ssize_t w;
	int fd;

	if (mine != NULL && mine->ticket == n)
		return pwrite(mine->tfd, &g, sizeof g,
			      sizeof(struct kl__local_trec)) ==
				       (ssize_t)sizeof g
			       ? 0
			       : -1;
	kl__local_ticket_name(tname, sizeof tname, qname, n);
	fd = openat(lp->dirfd, tname,
		    O_WRONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
	if (fd < 0)
		return -1;
	if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) ||
	    st.st_uid != geteuid() || st.st_nlink != 1) {
		close(fd);
		errno = EPERM;
		return -1;
	}
	/* Closing it raises IN_CLOSE_WRITE: the owner wakes to its grant. */
	w = pwrite(fd, &g, sizeof g, sizeof(struct kl__local_trec));
	close(fd);
	return w == (ssize_t)sizeof g ? 0 : -1;
}

int
kl__local_process(struct local *lp, const char *qname, int qfd,
		  struct kl__local_qstate *st, const struct local_lease *mine,
		  kl_error *err)
{
	struct kl__local_ticket t;
	bool changed = false, held = false, excl = false, own_failed = false;
	uint64_t dead = 0, lo, hi;
	int own_errno = 0;

	/* serving past the dead, up to the first live holder, whose mode
	 * is every holder's. */
	while (st->serving < st->granted) {
		if (mine != NULL && st->serving == mine->ticket) {
			held = true;
			excl = !mine->shared;
			break;
		}
		if (ticket_look(lp, qname, st->serving, true, &t)) {
			held = true;
			excl = !t.shared;
			break;
		}
		KL_CRASH_POINT("dead-skipped");
		st->serving++;
		changed = true;
		if (++dead % KL_LOCAL_DEAD_RUN == 0 &&
		    st->serving < st->granted &&
		    kl__local_ticket_files(lp, qname, st->serving, st->granted,
					   &lo, &hi))
			st->serving = lo;
	}
	while (st->granted < st->next) {
		uint64_t n = st->granted;
		bool shared;

		if (mine != NULL && n == mine->ticket) {
			shared = mine->shared;
		} else if (ticket_look(lp, qname, n, true, &t)) {
			shared = t.shared;
		} else {
			KL_CRASH_POINT("dead-skipped");
			if (st->serving == n)
				st->serving++;
			st->granted++;
			changed = true;
			if (++dead % KL_LOCAL_DEAD_RUN == 0 &&
			    st->granted < st->next &&
			    kl__local_ticket_files(lp, qname, st->granted,
						   st->next, &lo, &hi)) {
				if (st->serving == st->granted)
					st->serving = lo;
				st->granted = lo;
			}
			continue;
		}
		if (held && (excl || !shared))
			break;
		KL_CRASH_POINT("granting");
		if (grant_write(lp, qname, n, st->fence + 1, mine) != 0) {
			/* Another's ticket we cannot write (out of
			 * descriptors): its owner grants itself when it
			 * looks. */
			if (mine != NULL && n == mine->ticket) {
				own_failed = true;
				own_errno = errno;
			}
			break;
		}
		KL_CRASH_POINT("grant-recorded");
		st->fence++;
		st->granted++;
		changed = true;
		held = true;
		excl = !shared;
	}
	if (changed && kl__local_write_state(qfd, st) != 0)
		return kl__local_fail_file(lp, err, "cannot update", qname,
					   errno);
	if (own_failed) {
		char tname[KL_LOCAL_TNAME];

		kl__local_ticket_name(tname, sizeof tname, qname,
				      mine->ticket);
		return kl__local_fail_file(lp, err, "cannot write the grant to",
					   tname, own_errno);
	}
	return KL_OK;
}

int
kl__local_own_fence(struct local *lp, struct local_lease *l,
		    const struct kl__local_qstate *st, uint64_t *fence,
		    kl_error *err)
{
	struct kl__local_ticket t;
	char tname[KL_LOCAL_TNAME];

	memset(&t, 0, sizeof t);
	kl__local_read_ticket(l->tfd, l->ticket, &t);
	if (t.has_grant && t.grant.fence <= st->fence) {
		*fence = t.grant.fence;
		return KL_OK;
	}
	kl__local_ticket_name(tname, sizeof tname, l->name, l->ticket);
	kl__error_set(err, KL_EPROVIDER,
		      "local provider: the ticket file %s/%s is damaged (no "
		      "valid grant although the queue says granted)",
		      lp->path, tname);
	return KL_EPROVIDER;
}

int
kl__local_walk(struct local *lp, const char *qname,
	       const struct kl__local_qstate *st, kl__local_walk_fn fn,
	       void *arg)
{
	struct kl__local_ticket t;
	bool held = false, excl = false, blocked = false;
	uint64_t dead = 0, lo, hi;
	int rc;

	for (uint64_t n = st->serving; n < st->next; n++) {
		if (!ticket_look(lp, qname, n, false, &t)) {
			if (++dead % KL_LOCAL_DEAD_RUN == 0 &&
			    n + 1 < st->next &&
			    kl__local_ticket_files(lp, qname, n + 1, st->next,
						   &lo, &hi))
				n = lo - 1;
			continue;
		}
		if (n < st->granted) {
			t.holds = true;
			held = true;
			excl = excl || !t.shared;
		} else if (!blocked && !(held && (excl || !t.shared))) {
			/* Grantable now: the next look grants it. */
			t.holds = true;
			t.has_grant = false;
			held = true;
			excl = !t.shared;
		} else {
			blocked = true;
			t.has_grant = false;
		}
		if ((rc = fn(&t, arg)) != 0)
			return rc;
	}
	return 0;
}
