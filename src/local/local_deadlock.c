/* SPDX-License-Identifier: MIT */
/*
 * Deadlock detection for the local provider, across the threads and
 * processes that share a state directory; the memory provider's, in
 * deadlock.c, is the model.  Nothing happens while a wait is shorter than
 * deadlock_ms (kl_deadlock_ms, read as the wait starts).  A wait that has
 * lasted that long registers in the waits-for graph and walks it, and
 * again every deadlock_ms while it waits: waiting thread -> the key it
 * waits for -> the threads holding that key (every live ticket the queue
 * has granted, shared ones too, and one the next look will grant) -> the
 * keys they wait for -> ...  A walk that comes back to its own thread
 * ends that thread's wait with KL_EDEADLK: the thread that closes a cycle
 * is its one victim.
 *
 * The graph.  Ticket records already say who holds and who waits (pid,
 * process nonce and kl__thread_id); what they do not give is the way from
 * a holder to the key it waits for.  A registered waiter gives it in a
 * waits record named after its identity alone (kl__local_wrec), which
 * names its waiting ticket: queue file, number, and the time in its
 * record, which tells it from another ticket of that number.  The record
 * is only an index: an edge is believed only when that ticket is alive,
 * its record names the same thread and its queue says it waits.  So a
 * stale record (its owner dead, or granted and not yet removed), a
 * damaged or a planted one gives no edge and cannot make a victim.  Its
 * owner keeps an exclusive flock on it while it waits, so that a dead
 * owner's record can be told and removed.
 *
 * One walk at a time.  A check takes the directory's detector lock
 * without waiting: the flock of the secret file, which every provider of
 * the directory keeps open (a flock belongs to an open file, which a
 * provider's threads share, so they also take the provider's dl_lock).
 * When another walks, the check is tried again at the next look.  A
 * waits record is made under it, and one found unflocked removed under
 * it (but one that names the dead ticket its ticket file's remover found,
 * which no wait is making), so that no walk meets a record being made
 * and no record being made is taken for a dead one's; a victim removes
 * and closes its own record before dropping it.  So a later walk never
 * sees a victim's edge (it leaves its queue right after, as a timed-out
 * waiter does), and the cycle it closed is broken for every other member:
 * one victim per cycle, whatever process each member is in.  A process
 * stopped while it holds the detector lock delays detection in the
 * directory, never a wait: detection only ever ends a wait early.
 *
 * No false victim.  Queues are read without their locks, one at a time,
 * so the edges of a cycle are read at different moments, and every edge
 * of a cycle found is read a second time before it is believed.  An edge
 * "T's ticket a waits behind U's ticket b, which holds" names two ticket
 * instances, and a ticket only goes from waiting to holding to gone,
 * never back: seen the same in both passes, the edge held all along from
 * its first reading to its second, so at the moment between the two
 * passes every edge of the cycle held at once: the cycle was real.
 *
 * Cost: for a wait shorter than deadlock_ms, a clock read per look (at
 * most one per poll period); a check reads the queue of each key on the
 * way and the waits records of its holders, and allocates (a failure
 * only skips that check).  A dead owner's record goes when its ticket is
 * found dead (kl__local_dl_forget, as the ticket file goes), and the
 * directory is swept of any other when a wait registers, at most every
 * SWEEP_MS per provider.
 */
#include "config.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "local_internal.h"

#define SWEEP_MS 10000
/* Room for the cycle in a kl_error, after "lock '<key>': ". */
#define WHY_SIZE 176
/* Bytes of each key the message shows. */
#define SHOWN 40
#define NONE SIZE_MAX

/* A thread, as ticket and waits records name it. */
struct who {
	int64_t pid;
	uint64_t nonce, thread;
};

/* A waiting thread met by the walk, and the edge it was reached by. */
struct node {
	struct who who;
	char qname[KL_LOCAL_QNAME]; /* the key it waits for */
	uint64_t n;                 /* its ticket there */
	int64_t since_us;
	size_t from;                /* whose key it holds (NONE: the start) */
	uint64_t hold_n;            /* with this ticket of from's key */
	int64_t hold_since_us;
	size_t next;                /* the cycle, forward (second pass) */
};

/* A live holder of the key being read. */
struct holder {
	struct who who;
	uint64_t n;
	int64_t since_us;
};

struct walk {
	struct local *lp;
	struct node *nodes;
	size_t nn, ncap;
	struct holder *hs; /* of the last queue read */
	size_t nh, hcap;
	bool nomem;
};

static bool
same_who(const struct who *a, const struct who *b)
{
	return a->pid == b->pid && a->nonce == b->nonce &&
	       a->thread == b->thread;
}

static void
waits_name(char *buf, size_t size, const struct who *w)
{
	snprintf(buf, size, "w%016" PRIx64 ".%" PRId64 ".%" PRIu64, w->nonce,
		 w->pid, w->thread);
}

/* Whether name has the form waits_name gives. */
static bool
waits_name_valid(const char *name)
{
	const char *s = name + 17;

	if (name[0] != 'w')
		return false;
	for (int i = 1; i <= 16; i++)
		if (!((name[i] >= '0' && name[i] <= '9') ||
		      (name[i] >= 'a' && name[i] <= 'f')))
			return false;
	for (int part = 0; part < 2; part++) {
		if (*s++ != '.' || *s < '0' || *s > '9')
			return false;
		while (*s >= '0' && *s <= '9')
			s++;
	}
	return *s == '\0';
}

/* Whether q is a queue file's name, "q" and 16 hex digits. */
static bool
qname_valid(const char *q, size_t size)
{
	if (size < 18 || q[0] != 'q' || q[17] != '\0')
		return false;
	for (int i = 1; i <= 16; i++)
		if (!((q[i] >= '0' && q[i] <= '9') ||
		      (q[i] >= 'a' && q[i] <= 'f')))
			return false;
	return true;
}

/* Removes name when it is still the file st describes. */
static void
unlink_same(struct local *lp, const char *name, const struct stat *st)
{
	struct stat now;

	if (fstatat(lp->dirfd, name, &now, AT_SYMLINK_NOFOLLOW) == 0 &&
	    now.st_dev == st->st_dev && now.st_ino == st->st_ino)
		unlinkat(lp->dirfd, name, 0);
}

/* Opens the waits record name for reading: a regular file of ours with
 * one link, or -1.  When no owner keeps its flock, removes it and
 * returns -1: records are only made under the detector lock, which the
 * caller holds, so this is no record being made but a dead owner's. */
static int
waits_open(struct local *lp, const char *name)
{
	struct stat st;
	int fd = openat(lp->dirfd, name,
			O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK |
				O_NOCTTY);

	if (fd < 0)
		return -1;
	if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) ||
	    st.st_uid != geteuid() || st.st_nlink != 1) {
		close(fd);
		return -1;
	}
	if (flock(fd, LOCK_SH | LOCK_NB) == 0) {
		unlink_same(lp, name, &st);
		close(fd);
		return -1;
	}
	/* Another failure (ENOLCK) does not tell: believed alive, which
	 * only lets its ticket be checked. */
	return fd;
}

/* Removes the records of dead owners, at most every SWEEP_MS (detector
 * lock held). */
static void
sweep(struct local *lp)
{
	int64_t now = kl__now_ns();
	struct dirent *e;
	DIR *d;
	int fd;

	if (lp->dl_swept_ns != 0 &&
	    now - lp->dl_swept_ns < (int64_t)SWEEP_MS * 1000000)
		return;
	lp->dl_swept_ns = now;
	fd = openat(lp->dirfd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (fd < 0)
		return;
	if ((d = fdopendir(fd)) == NULL) {
		close(fd);
		return;
	}
	/* The stream is this call's own: readdir is safe on it. */
	while ((e = readdir(d)) != NULL) { /* NOLINT(concurrency-mt-unsafe) */
		if (waits_name_valid(e->d_name) &&
		    (fd = waits_open(lp, e->d_name)) >= 0)
			close(fd);
	}
	closedir(d);
}

void
kl__local_dl_forget(struct local *lp, const char *qname, uint64_t n,
		    const struct kl__local_trec *rec)
{
	struct who u = { rec->pid, rec->nonce, rec->thread };
	char name[KL_LOCAL_WNAME];
	struct kl__local_wrec r;
	struct stat st;
	int fd;

	waits_name(name, sizeof name, &u);
	fd = openat(lp->dirfd, name,
		    O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
	if (fd < 0)
		return;
	if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) ||
	    st.st_uid != geteuid() || st.st_nlink != 1) {
		close(fd);
		return;
	}
	/* One that names this dead ticket goes without the detector lock:
	 * a walk holding it (maybe in a stopped process) would make us
	 * leave the record, and nothing but a later long wait's sweep would
	 * look for it again.  No record being made names it: a live thread
	 * whose ticket died (it gave up) makes one for a live ticket. */
	if (pread(fd, &r, sizeof r, 0) == (ssize_t)sizeof r &&
	    r.magic == KL_LOCAL_WAITS_MAGIC && r.pid == u.pid &&
	    r.nonce == u.nonce && r.thread == u.thread && r.ticket == n &&
	    r.since_us == rec->since_us &&
	    strncmp(r.qname, qname, sizeof r.qname) == 0) {
		if (flock(fd, LOCK_SH | LOCK_NB) == 0)
			unlink_same(lp, name, &st);
		close(fd);
		return;
	}
	close(fd);
	/* Another (its owner killed before it wrote it, or a live owner's
	 * next wait's), only under the detector lock, as records are
	 * made. */
	if (pthread_mutex_trylock(&lp->dl_lock) != 0)
		return;
	if (flock(lp->sfd, LOCK_EX | LOCK_NB) == 0) {
		if ((fd = waits_open(lp, name)) >= 0)
			close(fd);
		flock(lp->sfd, LOCK_UN);
	}
	pthread_mutex_unlock(&lp->dl_lock);
}

/* Makes l's waits record, flocked (detector lock held).  0 or -1. */
static int
waits_register(struct local *lp, const struct local_lease *l,
	       struct kl__local_dl *d)
{
	struct kl__local_ticket t;
	struct kl__local_wrec r;
	struct who self;
	struct stat st;
	int fd;

	memset(&t, 0, sizeof t);
	kl__local_read_ticket(l->tfd, l->ticket, &t);
	if (!t.known)
		return -1;
	memset(&r, 0, sizeof r);
	r.magic = KL_LOCAL_WAITS_MAGIC;
	r.pid = t.rec.pid;
	r.nonce = t.rec.nonce;
	r.thread = t.rec.thread;
	r.ticket = l->ticket;
	r.since_us = t.rec.since_us;
	memcpy(r.qname, l->name, sizeof r.qname);
	self.pid = r.pid;
	self.nonce = r.nonce;
	self.thread = r.thread;
	waits_name(d->wname, sizeof d->wname, &self);
	fd = kl__local_open_checked(lp, d->wname, O_RDWR | O_CREAT | O_EXCL,
				    NULL);
	if (fd == -EEXIST) {
		/* Our own, left by an earlier wait that could not remove
		 * it: nobody else has this thread's name. */
		unlinkat(lp->dirfd, d->wname, 0);
		fd = kl__local_open_checked(lp, d->wname,
					    O_RDWR | O_CREAT | O_EXCL, NULL);
	}
	if (fd < 0)
		return -1;
	if (pwrite(fd, &r, sizeof r, 0) != (ssize_t)sizeof r ||
	    flock(fd, LOCK_EX | LOCK_NB) != 0 || fstat(fd, &st) != 0) {
		unlinkat(lp->dirfd, d->wname, 0);
		close(fd);
		return -1;
	}
	d->wfd = fd;
	d->wdev = st.st_dev;
	d->wino = st.st_ino;
	return 0;
}

void
kl__local_dl_unregister(struct local *lp, struct kl__local_dl *d)
{
	struct stat st;

	/* Nobody else removes or makes this name while we keep the flock,
	 * but the directory's files may have been replaced (see
	 * lease_lost): only our own file goes. */
	if (fstatat(lp->dirfd, d->wname, &st, AT_SYMLINK_NOFOLLOW) == 0 &&
	    st.st_dev == d->wdev && st.st_ino == d->wino)
		unlinkat(lp->dirfd, d->wname, 0);
	close(d->wfd);
	d->wfd = -1;
}

/* Where u waits, from its waits record, into x (who, qname, n,
 * since_us): false when it has none that a live owner keeps and that
 * names u. */
static bool
waits_of(struct local *lp, const struct who *u, struct node *x)
{
	char name[KL_LOCAL_WNAME];
	struct kl__local_wrec r;
	bool ok;
	int fd;

	waits_name(name, sizeof name, u);
	if ((fd = waits_open(lp, name)) < 0)
		return false;
	ok = pread(fd, &r, sizeof r, 0) == (ssize_t)sizeof r &&
	     r.magic == KL_LOCAL_WAITS_MAGIC && r.pid == u->pid &&
	     r.nonce == u->nonce && r.thread == u->thread &&
	     qname_valid(r.qname, sizeof r.qname);
	close(fd);
	if (!ok)
		return false;
	memset(x, 0, sizeof *x);
	x->who = *u;
	memcpy(x->qname, r.qname, sizeof x->qname);
	x->n = r.ticket;
	x->since_us = r.since_us;
	return true;
}

/* What read_edges's walk looks for. */
struct look {
	struct walk *w;
	const struct node *x;
	bool waits;
};

static int
look_ticket(const struct kl__local_ticket *t, void *arg)
{
	struct look *k = arg;
	struct walk *w = k->w;
	struct holder *h;

	if (t->n >= k->x->n) {
		/* Holders come first: nothing after x's ticket holds it
		 * back. */
		k->waits = t->n == k->x->n && !t->holds && t->known &&
			   t->unsure == 0 && t->rec.pid == k->x->who.pid &&
			   t->rec.nonce == k->x->who.nonce &&
			   t->rec.thread == k->x->who.thread &&
			   t->rec.since_us == k->x->since_us;
		return 1;
	}
	/* A holder whose record could not be read, or counted alive only
	 * because we could not look, is nobody we can name: no edge. */
	if (!t->holds || !t->known || t->unsure != 0)
		return 0;
	if (w->nh == w->hcap) {
		size_t cap = w->hcap != 0 ? w->hcap * 2 : 8;

		if ((h = kl__malloc(cap * sizeof *h)) == NULL) {
			w->nomem = true;
			return 1;
		}
		if (w->nh != 0)
			memcpy(h, w->hs, w->nh * sizeof *h);
		kl__free(w->hs);
		w->hs = h;
		w->hcap = cap;
	}
	h = &w->hs[w->nh++];
	h->who.pid = t->rec.pid;
	h->who.nonce = t->rec.nonce;
	h->who.thread = t->rec.thread;
	h->n = t->n;
	h->since_us = t->rec.since_us;
	return 0;
}

/* The key of the queue file qfd (named qname) into shown, printable, when
 * it is recorded whole; else the file's name. */
static void
key_shown(struct local *lp, int qfd, const char *qname,
	  const struct kl__local_qstate *st, char *shown, size_t size)
{
	size_t len = (size_t)st->key_len;
	uint64_t hash = strtoull(qname + 1, NULL, 16);
	char *buf;

	snprintf(shown, size, "%s", qname);
	if (st->key_len > KL_LOCAL_KEY_KEEP ||
	    (buf = kl__malloc(len + 1)) == NULL)
		return;
	if (pread(qfd, buf, len, sizeof *st) == (ssize_t)len &&
	    kl__siphash(lp->k0, lp->k1, buf, len) == hash)
		kl__key_printable(shown, size, buf, len);
	kl__free(buf);
}

/* Reads the queue x waits in: whether x's ticket waits there, with the
 * holders ahead of it in w->hs; the key into shown (when not NULL). */
static bool
read_edges(struct walk *w, const struct node *x, char *shown, size_t size)
{
	struct kl__local_qstate st;
	struct look k = { w, x, false };
	int qfd, rc = KL_EPROVIDER;

	w->nh = 0;
	qfd = kl__local_open_checked(w->lp, x->qname, O_RDONLY, NULL);
	if (qfd < 0)
		return false;
	/* Read without the queue lock, as status reads: again when a read
	 * raced with a write. */
	for (int tries = 0; tries < 4; tries++) {
		struct timespec ts = { 0, 1000000 };

		rc = kl__local_read_state(w->lp, x->qname, qfd, &st, NULL);
		if (rc == KL_OK)
			break;
		nanosleep(&ts, NULL);
	}
	if (rc == KL_OK && x->n >= st.serving && x->n < st.next) {
		(void)kl__local_walk(w->lp, x->qname, &st, look_ticket, &k);
		if (k.waits && shown != NULL)
			key_shown(w->lp, qfd, x->qname, &st, shown, size);
	}
	close(qfd);
	return k.waits && !w->nomem;
}

static bool
push(struct walk *w, const struct node *x)
{
	if (w->nn == w->ncap) {
		size_t cap = w->ncap != 0 ? w->ncap * 2 : 8;
		struct node *v = kl__malloc(cap * sizeof *v);

		if (v == NULL)
			return false;
		if (w->nn != 0)
			memcpy(v, w->nodes, w->nn * sizeof *v);
		kl__free(w->nodes);
		w->nodes = v;
		w->ncap = cap;
	}
	w->nodes[w->nn++] = *x;
	return true;
}

static bool
visited(const struct walk *w, const struct who *u)
{
	for (size_t i = 0; i < w->nn; i++)
		if (same_who(&w->nodes[i].who, u))
			return true;
	return false;
}

static bool
has_holder(const struct walk *w, const struct holder *want)
{
	for (size_t i = 0; i < w->nh; i++)
		if (w->hs[i].n == want->n &&
		    w->hs[i].since_us == want->since_us &&
		    same_who(&w->hs[i].who, &want->who))
			return true;
	return false;
}

/* The second pass over the cycle through w->nodes[closer], whose key me
 * holds with cl; msg then names its keys. */
static bool
confirm(struct walk *w, size_t closer, const struct holder *cl,
	const char *key, size_t key_len, char *msg, size_t size)
{
	char shown[SHOWN], part[SHOWN + 64];
	const struct who *me = &w->nodes[0].who;
	size_t n = 0;
	bool room = true;

	w->nodes[closer].next = NONE;
	for (size_t i = closer; i != 0; i = w->nodes[i].from)
		w->nodes[w->nodes[i].from].next = i;
	msg[0] = '\0';
	for (size_t i = 0; i != NONE; i = w->nodes[i].next) {
		const struct node *x = &w->nodes[i];
		struct holder want;

		if (x->next != NONE) {
			want.who = w->nodes[x->next].who;
			want.n = w->nodes[x->next].hold_n;
			want.since_us = w->nodes[x->next].hold_since_us;
		} else {
			want = *cl;
		}
		if (!read_edges(w, x, shown, sizeof shown) ||
		    !has_holder(w, &want))
			return false;
		if (!room)
			continue;
		if (i == 0) {
			kl__key_printable(shown, sizeof shown, key, key_len);
			snprintf(part, sizeof part, "deadlock: waits for '%s'",
				 shown);
		} else if (x->who.pid == me->pid &&
			   x->who.nonce == me->nonce) {
			snprintf(part, sizeof part,
				 ", held by a thread waiting for '%s'", shown);
		} else {
			snprintf(part, sizeof part,
				 ", held by pid %" PRId64 " waiting for '%s'",
				 x->who.pid, shown);
		}
		room = kl__msg_append(msg, size, &n, part);
	}
	if (room)
		(void)kl__msg_append(msg, size, &n, ", held by this thread");
	return true;
}

/* Whether the wait d closes a cycle of the graph, read twice (see the
 * top); msg then names its keys.  Detector lock held, d registered. */
static bool
closes_cycle(struct local *lp, const struct local_lease *l, const char *key,
	     size_t key_len, const struct kl__local_dl *d, char *msg,
	     size_t size)
{
	struct walk w = { .lp = lp };
	struct kl__local_wrec r;
	struct holder cl = { { 0, 0, 0 }, 0, 0 };
	struct node me, y;
	size_t closer = NONE;
	bool found = false;

	if (pread(d->wfd, &r, sizeof r, 0) != (ssize_t)sizeof r)
		return false;
	memset(&me, 0, sizeof me);
	me.who.pid = r.pid;
	me.who.nonce = r.nonce;
	me.who.thread = r.thread;
	memcpy(me.qname, l->name, sizeof me.qname);
	me.n = l->ticket;
	me.since_us = r.since_us;
	me.from = NONE;
	if (!push(&w, &me))
		goto out;
	/* Breadth first, so the shortest cycle through this wait is
	 * named. */
	for (size_t i = 0; i < w.nn && closer == NONE; i++) {
		struct node x = w.nodes[i];

		if (!read_edges(&w, &x, NULL, 0))
			continue;
		for (size_t j = 0; j < w.nh; j++) {
			const struct holder *h = &w.hs[j];

			if (same_who(&h->who, &me.who)) {
				closer = i;
				cl = *h;
				break;
			}
			if (visited(&w, &h->who) || !waits_of(lp, &h->who, &y))
				continue;
			y.from = i;
			y.hold_n = h->n;
			y.hold_since_us = h->since_us;
			if (!push(&w, &y))
				goto out;
		}
	}
	if (closer != NONE)
		found = confirm(&w, closer, &cl, key, key_len, msg, size);
out:
	kl__free(w.nodes);
	kl__free(w.hs);
	return found;
}

/* ms from now in kl__now_ns, or -1 (never) past the clock's range. */
static int64_t
due_after(int64_t ms)
{
	int64_t now = kl__now_ns();

	return ms > (INT64_MAX - now) / 1000000 ? -1 : now + ms * 1000000;
}

bool
kl__local_dl_first(struct kl__local_dl *d)
{
	int64_t ms = kl_deadlock_ms();

	d->started = true;
	if (ms < 0) {
		d->due = -1;
		return false;
	}
	d->due = due_after(ms);
	return ms == 0;
}

int
kl__local_dl_check(struct local *lp, const struct local_lease *l,
		   const char *key, size_t key_len, struct kl__local_dl *d,
		   kl_error *err)
{
	int64_t ms = kl_deadlock_ms();
	char why[WHY_SIZE];
	bool victim = false;

	if (ms < 0) {
		/* Turned off meanwhile: out of the graph, no more checks. */
		kl__local_dl_end(lp, d);
		d->due = -1;
		return KL_OK;
	}
	/* Another walks (a thread of this provider, or any process): this
	 * check is tried again at the next look. */
	if (pthread_mutex_trylock(&lp->dl_lock) != 0)
		return KL_OK;
	if (flock(lp->sfd, LOCK_EX | LOCK_NB) != 0) {
		pthread_mutex_unlock(&lp->dl_lock);
		return KL_OK;
	}
	if (d->wfd < 0) {
		sweep(lp);
		(void)waits_register(lp, l, d);
	}
	if (d->wfd >= 0 &&
	    closes_cycle(lp, l, key, key_len, d, why, sizeof why)) {
		/* Out of the graph before another walk may start. */
		kl__local_dl_unregister(lp, d);
		victim = true;
	}
	flock(lp->sfd, LOCK_UN);
	pthread_mutex_unlock(&lp->dl_lock);
	d->due = due_after(ms > 0 ? ms : 1);
	if (!victim)
		return KL_OK;
	kl__error_set(err, KL_EDEADLK, "%s", why);
	return KL_EDEADLK;
}
