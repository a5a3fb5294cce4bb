/* SPDX-License-Identifier: MIT */
/*
 * Private declarations of the local provider, shared by its files:
 * provider_local.c (acquire, release, status, open), local_queue.c (the
 * state files and the queue's grant rule) and local_snapshot.c (listing
 * the locks).  The protocol is described at the top of provider_local.c.
 */
#ifndef KL_LOCAL_INTERNAL_H
#define KL_LOCAL_INTERNAL_H

#include <sys/types.h>

#include "internal.h"

#define KL_LOCAL_TRY_GRACE_MS 50 /* a try-once may wait this long for the
				  * queue lock */
/* A wider range of tickets [serving, next): damaged.  Not a count of
 * tickets in use: a long holder with short requests that overlap behind
 * it widens the range by one each (see kl__local_ticket_files). */
#define KL_LOCAL_MAX_TICKETS ((uint64_t)1 << 48)
#define KL_LOCAL_DEAD_RUN 64 /* dead tickets looked at one by one before
			      * kl__local_ticket_files */
/* Keys up to this many bytes are recorded in their queue file (for
 * kl_provider_snapshot); a longer one only by its length. */
#define KL_LOCAL_KEY_KEEP 65536
#define KL_LOCAL_QNAME 24  /* "q" + 16 hex digits + NUL, rounded up */
#define KL_LOCAL_TNAME 48  /* a ticket file's name */
#define KL_LOCAL_POOL_MAX 4 /* inotify descriptors kept per provider */

/*
 * Crash points (test build only): KL_CRASH_POINT("name") kills the process
 * with SIGKILL when the environment variable KL_CRASH_AT, read once, names
 * that point, and stops it with SIGSTOP when KL_STOP_AT names it (see
 * provider_local.c for the list).
 */
#ifdef KL_TEST_HOOKS
KL_HIDDEN void kl__local_crash_point(const char *name);
#define KL_CRASH_POINT(name) kl__local_crash_point(name)
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
	int pool[KL_LOCAL_POOL_MAX]; /* idle inotify descriptors */
	int npool;
	/* Deadlock detection (local_deadlock.c): one walk at a time among
	 * this provider's threads (the secret's flock, which it takes too,
	 * is one per open file, shared by them), and when it last removed
	 * dead waits records. */
	pthread_mutex_t dl_lock;
	int64_t dl_swept_ns;
};

/* The queue file: this header, then the key's bytes when key_len is at
 * most KL_LOCAL_KEY_KEEP (written once, with the first header). */
struct kl__local_qstate {
	uint64_t magic;
	uint64_t next;    /* the next ticket to hand out */
	uint64_t serving; /* no live ticket below it */
	uint64_t granted; /* live tickets below it hold, from it on wait */
	uint64_t fence;   /* the last grant's */
	uint64_t key_len;
};

/* A ticket file: this record, written by its owner before it takes the
 * file's flock, then the grant, written by whoever grants the ticket
 * (under the queue lock, before the queue file says so). */
#define KL_LOCAL_TICKET_SHARED 0x1u
struct kl__local_trec {
	uint64_t magic;
	uint64_t ticket; /* its number, as in its name */
	uint32_t mode;   /* KL_LOCAL_TICKET_SHARED */
	uint32_t pad;
	int64_t pid, tid; /* the owner as it sees itself (its namespace) */
	uint64_t nonce;   /* its process's random id (kl__local_self) */
	uint64_t thread;  /* kl__thread_id(): never reused in the process,
			     unlike tid */
	int64_t since_us; /* wall clock when queued */
};

struct kl__local_tgrant {
	uint64_t fence;
	int64_t at_us;  /* wall clock at the grant */
	uint64_t check; /* ties it to the ticket (see grant_check) */
};

/* One live ticket of a key, as kl__local_walk reports it. */
struct kl__local_ticket {
	uint64_t n;
	bool holds;  /* holds, or is granted by whoever looks next */
	bool known;  /* rec was read and is valid */
	bool shared; /* rec says shared (false when not known) */
	bool has_grant; /* grant read and valid (real holders) */
	int unsure;     /* errno when its owner's life could not be told
			 * (out of descriptors): counted alive, to be safe */
	struct kl__local_trec rec;
	struct kl__local_tgrant grant;
};

struct local_lease {
	int qfd, tfd;
	uint64_t ticket;
	bool shared;
	dev_t qdev, tdev;
	ino_t qino, tino;
	void (*lost)(void *ctx);
	void *lost_ctx;
	char name[KL_LOCAL_QNAME]; /* "q" + 16 hex digits */
};

/* local_queue.c */
KL_HIDDEN int kl__local_fail(kl_error *err, int rc, const char *what,
			     int errnum);
KL_HIDDEN int kl__local_fail_file(struct local *lp, kl_error *err,
				  const char *what, const char *name,
				  int errnum);
KL_HIDDEN uint64_t kl__local_wall_us(void);
KL_HIDDEN int kl__local_open_checked(struct local *lp, const char *name,
				     int flags, kl_error *err);
KL_HIDDEN void kl__local_ticket_name(char *buf, size_t size,
				     const char *qname, uint64_t n);
KL_HIDDEN void kl__local_key_name(struct local *lp, char *buf, size_t size,
				  const char *key, size_t len);
KL_HIDDEN int kl__local_read_state(struct local *lp, const char *name,
				   int qfd, struct kl__local_qstate *st,
				   kl_error *err);
KL_HIDDEN int kl__local_write_state(int qfd,
				    const struct kl__local_qstate *st);
KL_HIDDEN int kl__local_write_first(int qfd,
				    const struct kl__local_qstate *st,
				    const char *key, size_t len);
KL_HIDDEN int kl__local_qlock(int fd, int64_t deadline, kl_cancel *cancel);
KL_HIDDEN void kl__local_qunlock(int fd);
/* This process and thread as ticket records name them (pid, tid, nonce
 * and thread of rec; the rest is left alone). */
KL_HIDDEN void kl__local_self(struct kl__local_trec *rec);
KL_HIDDEN int kl__local_write_ticket(int tfd, uint64_t n, bool shared,
				     int64_t since_us);
KL_HIDDEN bool kl__local_ticket_alive(struct local *lp, const char *qname,
				      uint64_t n, bool locked);
/* The lowest and the highest number in [lo, hi) that has a ticket file
 * of qname, in *min and *max (both hi when none has): after a long run of
 * dead tickets, one look at the directory instead of one at each number.
 * Under the queue lock the scan sees every ticket file of the queue (none
 * is made or removed without it).  false when the directory cannot be
 * read whole (out of descriptors or memory): look at each number then. */
KL_HIDDEN bool kl__local_ticket_files(struct local *lp, const char *qname,
				      uint64_t lo, uint64_t hi, uint64_t *min,
				      uint64_t *max);
/* Grants every request at the head of the queue that the rule allows
 * (see provider_local.c), skipping dead tickets; mine (may be NULL) is
 * the caller's own ticket.  Queue lock held; st is written back when it
 * changed.  KL_OK or KL_EPROVIDER with err filled. */
KL_HIDDEN int kl__local_process(struct local *lp, const char *qname, int qfd,
				struct kl__local_qstate *st,
				const struct local_lease *mine,
				kl_error *err);
/* The fence of l's grant, from its ticket file.  Queue lock held. */
KL_HIDDEN int kl__local_own_fence(struct local *lp, struct local_lease *l,
				  const struct kl__local_qstate *st,
				  uint64_t *fence, kl_error *err);
/* Calls fn on every live ticket of the queue st describes, in ticket
 * order: the holders, then the waiters; a waiter that the rule would
 * grant at once (its grant is only waiting for someone to look) is
 * reported holding.  Changes nothing; takes shared flocks on ticket files
 * for a moment.  fn's non-zero return stops the walk and is returned.
 * Also what deadlock detection can read: each ticket's pid, tid and
 * process nonce, and mode. */
typedef int (*kl__local_walk_fn)(const struct kl__local_ticket *t,
				 void *arg);
KL_HIDDEN int kl__local_walk(struct local *lp, const char *qname,
			     const struct kl__local_qstate *st,
			     kl__local_walk_fn fn, void *arg);

/* Reads ticket n's record (and grant) from its file fd into t: known,
 * shared, has_grant; the rest of t is left alone. */
KL_HIDDEN void kl__local_read_ticket(int fd, uint64_t n,
				     struct kl__local_ticket *t);

/* local_deadlock.c: deadlock detection (the protocol is at its top).
 *
 * A waits record, "w<nonce>.<pid>.<thread>" (the nonce in 16 hex digits,
 * the others in decimal) in the state directory: a thread that has waited
 * deadlock_ms says which ticket it waits with, and keeps an exclusive
 * flock on the file while it waits. */
#define KL_LOCAL_WNAME 64
#define KL_LOCAL_WAITS_MAGIC 0x314b4c57574b4c4bULL /* "KLKWWLK1" (LE) */
struct kl__local_wrec {
	uint64_t magic;
	int64_t pid;       /* the waiting thread, as its tickets name it */
	uint64_t nonce;
	uint64_t thread;
	uint64_t ticket;   /* the ticket it waits with */
	int64_t since_us;  /* that ticket's record's */
	char qname[KL_LOCAL_QNAME]; /* the queue file of the key */
};

/* One wait's part in detection, on the waiting thread's stack. */
struct kl__local_dl {
	int64_t due; /* the next check (kl__now_ns), or -1: none */
	bool started;
	int wfd;     /* the waits record, while registered; else -1 */
	dev_t wdev;
	ino_t wino;
	char wname[KL_LOCAL_WNAME];
};

static inline void
kl__local_dl_init(struct kl__local_dl *d)
{
	d->started = false;
	d->due = -1;
	d->wfd = -1;
}

KL_HIDDEN bool kl__local_dl_first(struct kl__local_dl *d);

/* Whether the wait d is due for a check: never before it has lasted
 * deadlock_ms (read when it starts; KL_FOREVER: never), then every
 * deadlock_ms.  One clock read per call once started. */
static inline bool
kl__local_dl_due(struct kl__local_dl *d)
{
	if (__builtin_expect(!d->started, 0))
		return kl__local_dl_first(d);
	return d->due >= 0 && kl__now_ns() >= d->due;
}

/* The check of the wait d, l's, for key, queue lock not held: KL_OK, or
 * KL_EDEADLK with err saying which keys form the cycle this wait closes
 * (it has then left the graph: its caller leaves the queue). */
KL_HIDDEN int kl__local_dl_check(struct local *lp,
				 const struct local_lease *l,
				 const char *key, size_t key_len,
				 struct kl__local_dl *d, kl_error *err);

KL_HIDDEN void kl__local_dl_unregister(struct local *lp,
				       struct kl__local_dl *d);
/* Removes the waits record of the thread rec names, whose ticket n of
 * qname is dead, if no live owner keeps it: at once when it names that
 * ticket, else when the detector lock can be had at once. */
KL_HIDDEN void kl__local_dl_forget(struct local *lp, const char *qname,
				   uint64_t n,
				   const struct kl__local_trec *rec);

/* Ends the wait d's part in the graph (its waits record removed). */
static inline void
kl__local_dl_end(struct local *lp, struct kl__local_dl *d)
{
	if (__builtin_expect(d->wfd >= 0, 0))
		kl__local_dl_unregister(lp, d);
}

/* local_snapshot.c */
KL_HIDDEN int kl__local_snapshot(void *impl, kl_snapshot_fn fn, void *arg,
				 kl_error *err);

#endif
