/* SPDX-License-Identifier: MIT */
/*
 * Stress: readers and writers of the memory provider (KL_SHARED, the W3C
 * Web Locks rule: one FIFO queue per key for both modes).
 *
 * Readers take two keys (one that lives in a slot, one chained) with
 * KL_SHARED, writers exclusively, through kl_lock_run and kl_lock_acquire,
 * waiting forever, trying once, with 1 ms timeouts and with cancel tokens
 * that other threads fire or that fire by themselves, so that queued
 * writers leave from between queued readers.  Inside, each counts itself
 * in its key's counters and checks:
 * - exclusion: never a writer together with anyone (a writer sees itself
 *   alone; a reader sees no writer);
 * - fences: a writer's fence is above every fence granted before it (the
 *   largest any holder saw), a reader's above the last writer's.
 * The test starts with every reader holding the first key at once (all
 * inside together, which an exclusive-only provider cannot do), and ends
 * only when every writer has had its quota of grants while the readers kept
 * coming: no writer starves behind readers.  It asserts on counts, never on
 * times (the bounds are hang guards).  Then the provider is empty and its
 * invariants hold (also checked now and then during the run).
 *
 * Then the same checks on keys that share slots: groups of short keys that
 * all hash to one slot of one shard, and a long key in that shard, taken in
 * both modes by every thread, so that lone shared takes without the lock
 * (E_SOLO) race steals of the idle slot by the other keys of its group,
 * chain marks, unchains and the floors of fences; now and then a holder
 * asks for its own key again with KL_ERRORCHECK, which must say
 * KL_EDEADLK in either mode.
 *
 * Meanwhile a watcher takes snapshots of the provider over and over, and
 * checks every key's queue state in each (its rows are read under its
 * shard's lock, at one moment): an exclusive holder is the only holder;
 * nobody waits for a key nobody holds; and with the key held shared, the
 * head of its queue wants it exclusively (a shared request there is
 * grantable: once a holder gave the key back or a queued writer left
 * before it, it must have been granted already, not left parked).  In the
 * first test it also keeps one FIFO queue per key honest through the
 * fences: a request it saw waiting in a snapshot was queued before every
 * request of that key that began after the snapshot (an epoch counter
 * tells which), so if both were granted, its fence is the smaller, in
 * whichever modes (no reader passes a queued writer, nor anyone another).
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <check.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "internal.h" /* kl__test_check_invariants */
#include "table.h"    /* kl__table_hash, kl__table_new */
#include "keylock.h"
#include "stress.h"

#define READERS 6
#define WRITERS 3
#define NKEYS 2
#define CHECK_EVERY 256
/* Writer grants each writer must get, before scaling. */
#define WRITER_QUOTA 20000

static const char *const key_names[NKEYS] = {
	"rw:slot", "rw: a key too long to live in a slot"
};

struct rw_key {
	atomic_int readers, writers;
	atomic_ulong max_fence;  /* the largest fence any holder saw */
	atomic_ulong last_write; /* the fence of the latest writer */
	atomic_long reads, writes;
	atomic_int max_readers; /* most readers seen inside together */
};

struct rw {
	kl_provider *p;
	kl_lock *r_forever, *r_once, *r_timed;
	kl_lock *w_forever, *w_once, *w_timed;
	struct rw_key keys[NKEYS];
	struct st_slot slots[WRITERS];
	long quota;
	atomic_int start_inside; /* readers inside the first key at start */
	atomic_bool started;     /* writers may start */
	atomic_int writers_done;
	atomic_bool stop;
	atomic_long violations, fence_errors, errors, invariant_errors;
	atomic_long timeouts, cancels;
	struct rw_watch *watch;
};

/* The snapshot watcher (see the top): the rows of the key being read and
 * what they broke.  A key's rows come together, its holders first. */
struct rw_watch {
	kl_provider *p;
	pthread_t th;
	atomic_bool stop;
	char key[64]; /* the key whose rows are being read ("" none) */
	size_t holders, exclusive, waiters, pos;
	bool head_shared, order_bad;
	long snapshots, keys_seen, shared_heads_seen;
	atomic_long bad;
	char first[200]; /* the first bad state, for the message */
	/* The FIFO check (ntracks 0: none): the epoch, and the workers'
	 * requests in kl_lock_acquire before the snapshot. */
	struct rw_track *tracks[16];
	int ntracks;
	atomic_ulong epoch;
	long pre[16];
	long sightings;
};

/* A request of kl_lock_acquire that a worker logs for the FIFO check
 * (see the top). */
struct rw_req {
	int key;
	bool shared;
	uint64_t epoch;	/* the watcher's epoch when it began */
	uint64_t fence;	/* of its grant; 0: not granted */
	atomic_ulong seen; /* the epoch after a snapshot that saw it wait */
};

#define RW_LOG 100000 /* requests each worker logs at most */

/* A worker's requests, for the FIFO check. */
struct rw_track {
	atomic_llong os_tid; /* gettid(), once it runs */
	/* 1 + the request of the log in kl_lock_acquire now; 0 none */
	atomic_long in_req;
	long nlog;
	struct rw_req *log;
};

struct rw_worker {
	struct rw *x;
	int idx;
	bool writer;
	pthread_t th;
	struct rw_key *cur;
	uint64_t fence;
	long grants;
	struct rw_track t;
};

static void
fence_max(atomic_ulong *v, uint64_t f)
{
	unsigned long old = atomic_load(v);

	while (old < f && !atomic_compare_exchange_weak(v, &old, f))
		;
}

/* The section of a reader (writer false) or a writer on k, with the fence
 * of its grant (0: not known, through kl_lock_run). */
static void
inside(struct rw *x, struct rw_key *k, bool writer, uint64_t fence)
{
	if (writer) {
		if (atomic_fetch_add(&k->writers, 1) != 0 ||
		    atomic_load(&k->readers) != 0)
			atomic_fetch_add(&x->violations, 1);
		if (fence != 0) {
			if (fence <= atomic_load(&k->max_fence))
				atomic_fetch_add(&x->fence_errors, 1);
			atomic_store(&k->last_write, fence);
		}
	} else {
		int n = atomic_fetch_add(&k->readers, 1) + 1, m;

		if (atomic_load(&k->writers) != 0)
			atomic_fetch_add(&x->violations, 1);
		if (fence != 0 && fence <= atomic_load(&k->last_write))
			atomic_fetch_add(&x->fence_errors, 1);
		m = atomic_load(&k->max_readers);
		while (n > m &&
		       !atomic_compare_exchange_weak(&k->max_readers, &m, n))
			;
	}
	if (fence != 0)
		fence_max(&k->max_fence, fence);
	sched_yield(); /* let others come and queue meanwhile */
	if (writer) {
		if (atomic_load(&k->readers) != 0)
			atomic_fetch_add(&x->violations, 1);
		atomic_fetch_add(&k->writes, 1);
		atomic_fetch_sub(&k->writers, 1);
	} else {
		if (atomic_load(&k->writers) != 0)
			atomic_fetch_add(&x->violations, 1);
		atomic_fetch_add(&k->reads, 1);
		atomic_fetch_sub(&k->readers, 1);
	}
}

static int
run_fn(void *arg)
{
	struct rw_worker *w = arg;

	inside(w->x, w->cur, w->writer, 0);
	return 0;
}

/* Checks the rows read of wt->key, and forgets them. */
static void
watch_key_end(struct rw_watch *wt)
{
	const char *why = NULL;

	if (wt->key[0] == '\0')
		return;
	wt->keys_seen++;
	if (wt->exclusive != 0 && wt->holders != 1)
		why = "an exclusive holder beside others";
	else if (wt->waiters != 0 && wt->holders == 0)
		why = "waiters and no holder";
	else if (wt->waiters != 0 && wt->exclusive == 0 && wt->head_shared)
		why = "held shared, and a shared request waits at the head";
	else if (wt->order_bad)
		why = "rows out of order (holders first, then positions "
		      "0, 1, ...)";
	if (wt->waiters != 0 && wt->exclusive == 0 && !wt->head_shared)
		wt->shared_heads_seen++;
	if (why != NULL && atomic_fetch_add(&wt->bad, 1) == 0)
		snprintf(wt->first, sizeof wt->first,
			 "key '%s': %s (%zu holders, %zu exclusive, %zu "
			 "waiters, head %s)",
			 wt->key, why, wt->holders, wt->exclusive,
			 wt->waiters, wt->head_shared ? "shared" : "exclusive");
	wt->key[0] = '\0';
}

static int
watch_row(const kl_lock_info *in, void *arg)
{
	struct rw_watch *wt = arg;

	if (in->key == NULL || strcmp(in->key, wt->key) != 0) {
		watch_key_end(wt);
		snprintf(wt->key, sizeof wt->key, "%s",
			 in->key != NULL ? in->key : "?");
		wt->holders = wt->exclusive = wt->waiters = wt->pos = 0;
		wt->head_shared = wt->order_bad = false;
	}
	if (!in->waiting) {
		if (wt->waiters != 0)
			wt->order_bad = true;
		wt->holders++;
		if (!in->shared)
			wt->exclusive++;
		return 0;
	}
	if (in->position != wt->pos++)
		wt->order_bad = true;
	for (int i = 0; i < wt->ntracks; i++) {
		struct rw_track *w = wt->tracks[i];

		/* In the same kl_lock_acquire before and after the snapshot
		 * (each waits once at a time): that request waited. */
		if (atomic_load(&w->os_tid) == in->tid && wt->pre[i] != 0 &&
		    atomic_load(&w->in_req) == wt->pre[i]) {
			struct rw_req *q = &w->log[wt->pre[i] - 1];

			/* The first snapshot that saw it says most. */
			if (atomic_load(&q->seen) == 0)
				atomic_store(&q->seen, UINT64_MAX);
			wt->sightings++;
		}
	}
	if (wt->waiters++ == 0)
		wt->head_shared = in->shared;
	return 0;
}

static void *
watch_main(void *arg)
{
	struct rw_watch *wt = arg;

	while (!atomic_load(&wt->stop)) {
		uint64_t epoch;

		wt->key[0] = '\0';
		for (int i = 0; i < wt->ntracks; i++)
			wt->pre[i] = atomic_load(&wt->tracks[i]->in_req);
		if (kl_provider_snapshot(wt->p, watch_row, wt, NULL) != KL_OK &&
		    atomic_fetch_add(&wt->bad, 1) == 0)
			snprintf(wt->first, sizeof wt->first,
				 "kl_provider_snapshot failed");
		watch_key_end(wt);
		/* Every request that reads the new epoch begins after the
		 * snapshot: behind those it saw waiting. */
		epoch = atomic_fetch_add(&wt->epoch, 1) + 1;
		for (int i = 0; i < wt->ntracks; i++) {
			struct rw_req *q;

			if (wt->pre[i] == 0)
				continue;
			q = &wt->tracks[i]->log[wt->pre[i] - 1];
			if (atomic_load(&q->seen) == UINT64_MAX)
				atomic_store(&q->seen, epoch);
		}
		wt->snapshots++;
		sched_yield();
	}
	return NULL;
}

/* Makes the log of track t. */
static void
track_init(struct rw_track *t)
{
	memset(t, 0, sizeof *t);
	t->log = calloc(RW_LOG, sizeof *t->log);
	st_assert(t->log != NULL, "out of memory");
}

/* Logs a request of key k in t before the call (NULL: not logged). */
static struct rw_req *
track_begin(struct rw_track *t, struct rw_watch *wt, int k, bool shared)
{
	struct rw_req *q;

	if (wt == NULL || t->nlog == RW_LOG)
		return NULL;
	q = &t->log[t->nlog++];
	q->key = k;
	q->shared = shared;
	q->fence = 0;
	atomic_store(&q->seen, 0);
	q->epoch = atomic_load(&wt->epoch);
	atomic_store(&t->in_req, t->nlog);
	return q;
}

/* Logs the outcome of request q (NULL: not logged) of t. */
static void
track_end(struct rw_track *t, struct rw_req *q, int rc, kl_lease *lease)
{
	atomic_store(&t->in_req, 0);
	if (rc == KL_OK && q != NULL)
		q->fence = kl_lease_fence(lease);
}

/* Starts the watcher of p; it looks for the requests of the n tracks in
 * snapshots (n 0: no FIFO check). */
static void
watch_start(struct rw_watch *wt, kl_provider *p, struct rw_track **tracks,
	    int n)
{
	memset(wt, 0, sizeof *wt);
	wt->p = p;
	st_assert(n <= (int)(sizeof wt->pre / sizeof wt->pre[0]),
		  "%d workers", n);
	for (int i = 0; i < n; i++)
		wt->tracks[i] = tracks[i];
	wt->ntracks = n;
	st_thread_start(&wt->th, 0, watch_main, wt);
}

static int
req_by_epoch(const void *a, const void *b)
{
	const struct rw_req *x = *(const struct rw_req *const *)a;
	const struct rw_req *y = *(const struct rw_req *const *)b;

	return x->epoch < y->epoch ? -1 : x->epoch > y->epoch;
}

/* The FIFO check of key k over the workers' logs (see the top): returns
 * how many requests broke it, the first in msg unless msg has a message
 * already; *pairs counts the requests seen waiting that were granted, and
 * *after those of them that a request begun after the sighting
 * followed. */
static long
fifo_check(struct rw_watch *wt, int k, char *msg, size_t size, long *pairs,
	   long *after)
{
	struct rw_req **g;
	uint64_t *min;
	size_t n = 0, m = 0;
	long bad = 0;

	for (int i = 0; i < wt->ntracks; i++)
		n += (size_t)wt->tracks[i]->nlog;
	g = calloc(n + 1, sizeof *g);
	min = calloc(n + 1, sizeof *min);
	st_assert(g != NULL && min != NULL, "out of memory");
	for (int i = 0; i < wt->ntracks; i++)
		for (long j = 0; j < wt->tracks[i]->nlog; j++) {
			struct rw_req *q = &wt->tracks[i]->log[j];

			if (q->key == k && q->fence != 0)
				g[m++] = q;
		}
	qsort(g, m, sizeof *g, req_by_epoch);
	/* min[i]: the smallest fence of the requests from i on. */
	min[m] = UINT64_MAX;
	for (size_t i = m; i-- > 0;)
		min[i] = g[i]->fence < min[i + 1] ? g[i]->fence : min[i + 1];
	for (size_t i = 0; i < m; i++) {
		uint64_t seen = atomic_load(&g[i]->seen);
		size_t lo = 0, hi = m;

		if (seen == 0 || seen == UINT64_MAX)
			continue;
		++*pairs;
		/* The first request that began at epoch seen or later. */
		while (lo < hi) {
			size_t mid = lo + (hi - lo) / 2;

			if (g[mid]->epoch < seen)
				lo = mid + 1;
			else
				hi = mid;
		}
		if (lo < m)
			++*after;
		if (min[lo] <= g[i]->fence && bad++ == 0 && msg[0] == '\0')
			snprintf(msg, size,
				 "key %d: a request seen waiting (%s) got "
				 "fence %llu, a request begun after that "
				 "snapshot got %llu",
				 k, g[i]->shared ? "shared" : "exclusive",
				 (unsigned long long)g[i]->fence,
				 (unsigned long long)min[lo]);
	}
	free(g);
	free(min);
	return bad;
}

/* Stops the watcher and asserts on what it saw. */
static void
watch_end(struct rw_watch *wt)
{
	atomic_store(&wt->stop, true);
	st_thread_join(wt->th);
	st_note("watcher: %ld snapshots, %ld key states, %ld with a writer "
		"at the head of readers, %ld bad",
		wt->snapshots, wt->keys_seen, wt->shared_heads_seen,
		atomic_load(&wt->bad));
	st_assert(atomic_load(&wt->bad) == 0, "%ld bad queue states, first: %s",
		  atomic_load(&wt->bad), wt->first);
}

/* fifo_check of keys 0 to n - 1, with its assertion. */
static void
fifo_check_all(struct rw_watch *wt, int n)
{
	char msg[200] = "";
	long bad = 0, pairs = 0, after = 0;

	for (int k = 0; k < n; k++)
		bad += fifo_check(wt, k, msg, sizeof msg, &pairs, &after);
	st_note("FIFO: %ld granted requests seen waiting, %ld of them "
		"before a request begun later, %ld out of order",
		pairs, after, bad);
	st_assert(bad == 0, "%ld requests passed one queued before them; "
		  "first: %s", bad, msg);
}

static bool
all_readers_inside(void *arg)
{
	struct rw *x = arg;

	return atomic_load(&x->start_inside) == READERS;
}

/* One acquisition of a random key in a random way; counts outcomes. */
static void
one_op(struct rw_worker *w, struct st_rng *r, long i)
{
	struct rw *x = w->x;
	int k = (int)st_below(r, NKEYS);
	kl_call call = { .key = key_names[k], .cancel = NULL };
	unsigned how = (unsigned)st_below(r, 8);
	kl_lease *lease = NULL;
	struct rw_req *q = NULL;
	kl_lock *l;
	int rc;

	w->cur = &x->keys[k];
	if (how < 3) {
		l = w->writer ? x->w_forever : x->r_forever;
		rc = kl_lock_run(l, &call, run_fn, w, NULL, NULL);
		if (rc == KL_OK)
			w->grants++;
		else
			atomic_fetch_add(&x->errors, 1);
		return;
	}
	if (how == 3)
		l = w->writer ? x->w_once : x->r_once;
	else if (how == 4)
		l = w->writer ? x->w_timed : x->r_timed;
	else
		l = w->writer ? x->w_forever : x->r_forever;
	/* Writers wait with tokens (that readers fire, or that fire by
	 * themselves), so that queued writers leave from before readers. */
	if (w->writer && how >= 5)
		call.cancel = st_slot_token(&x->slots[w->idx], r);
	if (!w->writer && how == 7)
		st_slot_fire(&x->slots[st_below(r, WRITERS)]);
	q = track_begin(&w->t, x->watch, k, !w->writer);
	rc = kl_lock_acquire(l, &call, &lease, NULL);
	track_end(&w->t, q, rc, lease);
	if (rc == KL_ETIMEDOUT) {
		atomic_fetch_add(&x->timeouts, 1);
		return;
	}
	if (rc == KL_ECANCELED) {
		atomic_fetch_add(&x->cancels, 1);
		return;
	}
	if (rc != KL_OK) {
		atomic_fetch_add(&x->errors, 1);
		return;
	}
	inside(x, w->cur, w->writer, kl_lease_fence(lease));
	if (i % CHECK_EVERY == CHECK_EVERY - 1 &&
	    kl__test_check_invariants(x->p) != KL_OK)
		atomic_fetch_add(&x->invariant_errors, 1);
	kl_lease_release(lease);
	w->grants++;
}

static void *
reader_main(void *arg)
{
	struct rw_worker *w = arg;
	struct rw *x = w->x;
	kl_call call = { .key = key_names[0], .cancel = NULL };
	kl_lease *lease = NULL;
	struct st_rng r;
	long i = 0;

	atomic_store(&w->t.os_tid, (long long)syscall(SYS_gettid));
	st_rng_init(&r, 0x5200 + (uint64_t)w->idx);
	/* Every reader holds the first key at once before anything else. */
	if (kl_lock_acquire(x->r_forever, &call, &lease, NULL) != KL_OK) {
		atomic_fetch_add(&x->errors, 1);
	} else {
		atomic_fetch_add(&x->start_inside, 1);
		if (!st_poll(all_readers_inside, x, 20000 * st_slow()))
			atomic_fetch_add(&x->errors, 1);
		kl_lease_release(lease);
	}
	/* Readers keep coming until every writer had its quota. */
	while (!atomic_load(&x->stop))
		one_op(w, &r, i++);
	return NULL;
}

static bool
rw_started(void *arg)
{
	return atomic_load(&((struct rw *)arg)->started);
}

static void *
writer_main(void *arg)
{
	struct rw_worker *w = arg;
	struct rw *x = w->x;
	struct st_rng r;
	long i = 0;

	atomic_store(&w->t.os_tid, (long long)syscall(SYS_gettid));
	st_rng_init(&r, 0x5700 + (uint64_t)w->idx);
	if (!st_poll(rw_started, x, 60000 * st_slow()))
		atomic_fetch_add(&x->errors, 1);
	while (w->grants < x->quota && !atomic_load(&x->stop))
		one_op(w, &r, i++);
	atomic_fetch_add(&x->writers_done, 1);
	return NULL;
}

static bool
writers_finished(void *arg)
{
	return atomic_load(&((struct rw *)arg)->writers_done) == WRITERS;
}

static kl_lock *
rw_lock(kl_provider *p, unsigned flags, int64_t timeout_ms)
{
	kl_lock_opts o = KL_LOCK_OPTS_INIT;
	kl_lock *l = NULL;

	o.provider = p;
	o.flags = flags;
	o.timeout_ms = timeout_ms;
	st_assert(kl_lock_new(&l, &o) == KL_OK, "kl_lock_new");
	return l;
}

START_TEST(test_readers_writers)
{
	static struct rw x;
	static struct rw_worker w[READERS + WRITERS];
	static struct rw_watch wt;
	struct rw_track *tracks[READERS + WRITERS];
	long reads = 0, writes = 0, wgrants = 0;
	bool done;

	st_begin("readers and writers: exclusion, fences, no starvation");
	memset(&x, 0, sizeof x);
	memset(w, 0, sizeof w);
	x.quota = st_scaled(WRITER_QUOTA, 1, 50);
	st_assert(kl_memory_provider_new(&x.p) == KL_OK, "provider");
	x.r_forever = rw_lock(x.p, KL_SHARED, KL_FOREVER);
	x.r_once = rw_lock(x.p, KL_SHARED, 0);
	x.r_timed = rw_lock(x.p, KL_SHARED, 1);
	x.w_forever = rw_lock(x.p, 0, KL_FOREVER);
	x.w_once = rw_lock(x.p, 0, 0);
	x.w_timed = rw_lock(x.p, 0, 1);
	for (int i = 0; i < WRITERS; i++)
		st_slot_init(&x.slots[i]);
	for (int i = 0; i < READERS + WRITERS; i++) {
		track_init(&w[i].t);
		tracks[i] = &w[i].t;
	}
	watch_start(&wt, x.p, tracks, READERS + WRITERS);
	x.watch = &wt;
	for (int i = 0; i < READERS + WRITERS; i++) {
		w[i].x = &x;
		w[i].writer = i >= READERS;
		w[i].idx = w[i].writer ? i - READERS : i;
		st_thread_start(&w[i].th, 0,
				w[i].writer ? writer_main : reader_main, &w[i]);
	}
	/* The writers start once every reader held the first key at once. */
	done = st_poll(all_readers_inside, &x, 20000 * st_slow());
	atomic_store(&x.started, true);
	if (done)
		done = st_poll(writers_finished, &x, 300000 * st_slow());
	atomic_store(&x.stop, true);
	for (int i = 0; i < WRITERS; i++)
		st_slot_fire(&x.slots[i]);
	for (int i = 0; i < READERS + WRITERS; i++) {
		st_thread_join(w[i].th);
		if (w[i].writer)
			wgrants += w[i].grants;
	}
	watch_end(&wt);
	fifo_check_all(&wt, NKEYS);
	for (int i = 0; i < READERS + WRITERS; i++)
		free(w[i].t.log);
	for (int k = 0; k < NKEYS; k++) {
		reads += atomic_load(&x.keys[k].reads);
		writes += atomic_load(&x.keys[k].writes);
	}
	st_note("%d readers, %d writers x %ld grants: %ld reads, %ld writes, "
		"%ld timeouts, %ld cancels, most readers together %d/%d, "
		"%ld violations, %ld fence errors, %ld errors",
		READERS, WRITERS, x.quota, reads, writes,
		atomic_load(&x.timeouts), atomic_load(&x.cancels),
		atomic_load(&x.keys[0].max_readers),
		atomic_load(&x.keys[1].max_readers),
		atomic_load(&x.violations), atomic_load(&x.fence_errors),
		atomic_load(&x.errors));
	st_assert(atomic_load(&x.start_inside) == READERS,
		  "only %d of %d readers held the key together",
		  atomic_load(&x.start_inside), READERS);
	st_assert(done, "the writers did not all get their %ld grants while "
			"readers kept coming (%ld writer grants)",
		  x.quota, wgrants);
	st_assert(atomic_load(&x.violations) == 0,
		  "%ld times a writer was not alone",
		  atomic_load(&x.violations));
	st_assert(atomic_load(&x.fence_errors) == 0,
		  "%ld fences did not grow past earlier grants",
		  atomic_load(&x.fence_errors));
	st_assert(atomic_load(&x.errors) == 0, "%ld unexpected statuses",
		  atomic_load(&x.errors));
	st_assert(wgrants == writes, "%ld writer grants, %ld counted inside",
		  wgrants, writes);
	st_assert(kl_memory_provider_size(x.p) == 0,
		  "provider keeps %zu keys", kl_memory_provider_size(x.p));
	if (kl__test_check_invariants(x.p) != KL_OK)
		atomic_fetch_add(&x.invariant_errors, 1);
	st_assert(atomic_load(&x.invariant_errors) == 0,
		  "%ld invariant checks failed (see stderr)",
		  atomic_load(&x.invariant_errors));
	for (int i = 0; i < WRITERS; i++)
		st_slot_fini(&x.slots[i]);
	kl_lock_free(x.r_forever);
	kl_lock_free(x.r_once);
	kl_lock_free(x.r_timed);
	kl_lock_free(x.w_forever);
	kl_lock_free(x.w_once);
	kl_lock_free(x.w_timed);
	kl_provider_free(x.p);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Keys that share slots                                               */

#define CL_THREADS 8
#define CL_GROUPS 4
#define CL_SHORT 4                         /* short keys per group */
#define CL_KEYS (CL_GROUPS * (CL_SHORT + 1)) /* and a long one */
#define CL_OPS 100000

struct cl {
	kl_provider *p;
	/* [shared][forever, once, 1 ms][KL_ERRORCHECK] */
	kl_lock *l[2][3][2];
	char names[CL_KEYS][48];
	struct rw_key keys[CL_KEYS];
	long ops;
	atomic_long violations, fence_errors, errors, errorcheck_errors,
		invariant_errors, grants;
	struct rw_watch *watch;
};

struct cl_worker {
	struct cl *x;
	int idx;
	pthread_t th;
	struct rw_track t;
};

/* Fills x->names: per group, CL_SHORT short keys that the provider's table
 * puts in one slot of one shard (its hash is the process's, as every
 * table's), and a long key of that shard. */
static void
cl_names(struct cl *x)
{
	struct kl__table *t;
	int n = 0;

	st_assert(kl__table_new(&t) == KL_OK, "table");
	for (int g = 0; g < CL_GROUPS; g++) {
		uint32_t shard = 0, slot = 0;
		int got = 0;

		for (int c = 0; got < CL_SHORT; c++) {
			char b[16];
			uint32_t h;

			snprintf(b, sizeof b, "cl%d.%d", g, c);
			h = kl__table_hash(t, b, strlen(b));
			if (got == 0) {
				/* Groups in different shards. */
				if ((h >> 26) % CL_GROUPS != (uint32_t)g)
					continue;
				shard = h >> 26;
				slot = kl__table_slot_of(h);
			} else if (h >> 26 != shard ||
				   kl__table_slot_of(h) != slot) {
				continue;
			}
			memcpy(x->names[n++], b, sizeof b);
			got++;
		}
		for (int c = 0;; c++) {
			char b[48];

			snprintf(b, sizeof b, "cl%d: a long key, %d", g, c);
			if (kl__table_hash(t, b, strlen(b)) >> 26 != shard)
				continue;
			memcpy(x->names[n++], b, sizeof b);
			break;
		}
	}
	kl__table_free(t);
}

/* The checks of inside(), on entering k's section with fence, and on
 * leaving it. */
static void
cl_begin(struct cl *x, struct rw_key *k, bool writer, uint64_t fence)
{
	if (writer) {
		if (atomic_fetch_add(&k->writers, 1) != 0 ||
		    atomic_load(&k->readers) != 0)
			atomic_fetch_add(&x->violations, 1);
		if (fence <= atomic_load(&k->max_fence))
			atomic_fetch_add(&x->fence_errors, 1);
		atomic_store(&k->last_write, fence);
	} else {
		atomic_fetch_add(&k->readers, 1);
		if (atomic_load(&k->writers) != 0)
			atomic_fetch_add(&x->violations, 1);
		if (fence <= atomic_load(&k->last_write))
			atomic_fetch_add(&x->fence_errors, 1);
	}
	fence_max(&k->max_fence, fence);
}

static void
cl_end(struct cl *x, struct rw_key *k, bool writer)
{
	if (atomic_load(writer ? &k->readers : &k->writers) != 0)
		atomic_fetch_add(&x->violations, 1);
	atomic_fetch_sub(writer ? &k->writers : &k->readers, 1);
}

static void *
cl_main(void *arg)
{
	struct cl_worker *w = arg;
	struct cl *x = w->x;
	struct st_rng r;
	struct st_slot tok;

	atomic_store(&w->t.os_tid, (long long)syscall(SYS_gettid));
	st_rng_init(&r, 0x5c00 + (uint64_t)w->idx);
	st_slot_init(&tok);
	for (long i = 0; i < x->ops; i++) {
		int k = (int)st_below(&r, CL_KEYS);
		bool sh = st_below(&r, 3) != 0;
		kl_call call = { .key = x->names[k], .cancel = NULL };
		kl_lease *lease = NULL, *again = NULL;
		kl_lock *l = x->l[sh][st_below(&r, 3)][st_below(&r, 4) == 0];
		struct rw_req *q;
		int rc;

		/* With a token, a shared request goes through the lock (no
		 * E_SOLO take); some fire before the call. */
		if (st_below(&r, 4) == 0) {
			call.cancel = st_slot_token(&tok, &r);
			if (st_below(&r, 2) == 0)
				st_slot_fire(&tok);
		}
		q = track_begin(&w->t, x->watch, k, sh);
		rc = kl_lock_acquire(l, &call, &lease, NULL);
		track_end(&w->t, q, rc, lease);
		if (rc == KL_ETIMEDOUT || rc == KL_ECANCELED)
			continue;
		if (rc != KL_OK) {
			atomic_fetch_add(&x->errors, 1);
			continue;
		}
		cl_begin(x, &x->keys[k], !sh, kl_lease_fence(lease));
		if (st_below(&r, 8) == 0)
			sched_yield(); /* let others come and queue */
		if (st_below(&r, 8) == 0) {
			/* This thread holds the key: a second request of it
			 * with KL_ERRORCHECK, in either mode, must fail. */
			call.cancel = NULL;
			rc = kl_lock_acquire(x->l[st_below(&r, 2)][1][1], &call,
					     &again, NULL);
			if (rc != KL_EDEADLK) {
				atomic_fetch_add(&x->errorcheck_errors, 1);
				if (rc == KL_OK)
					kl_lease_release(again);
			}
		}
		if (i % CHECK_EVERY == CHECK_EVERY - 1 &&
		    kl__test_check_invariants(x->p) != KL_OK)
			atomic_fetch_add(&x->invariant_errors, 1);
		cl_end(x, &x->keys[k], !sh);
		kl_lease_release(lease);
		atomic_fetch_add(&x->grants, 1);
	}
	st_slot_fini(&tok);
	return NULL;
}

START_TEST(test_colliding_keys)
{
	static struct cl x;
	static struct cl_worker w[CL_THREADS];
	static struct rw_watch wt;
	struct rw_track *tracks[CL_THREADS];
	const int64_t timeouts[3] = { KL_FOREVER, 0, 1 };

	st_begin("keys sharing slots: exclusion, fences, errorcheck");
	memset(&x, 0, sizeof x);
	x.ops = st_scaled(CL_OPS, 1, 500);
	cl_names(&x);
	st_assert(kl_memory_provider_new(&x.p) == KL_OK, "provider");
	for (int a = 0; a < 2; a++)
		for (int b = 0; b < 3; b++)
			for (int c = 0; c < 2; c++)
				x.l[a][b][c] = rw_lock(
					x.p,
					(a ? KL_SHARED : 0) |
						(c ? KL_ERRORCHECK : 0),
					timeouts[b]);
	for (int i = 0; i < CL_THREADS; i++) {
		track_init(&w[i].t);
		tracks[i] = &w[i].t;
	}
	watch_start(&wt, x.p, tracks, CL_THREADS);
	x.watch = &wt;
	for (int i = 0; i < CL_THREADS; i++) {
		w[i].x = &x;
		w[i].idx = i;
		st_thread_start(&w[i].th, 0, cl_main, &w[i]);
	}
	for (int i = 0; i < CL_THREADS; i++)
		st_thread_join(w[i].th);
	watch_end(&wt);
	fifo_check_all(&wt, CL_KEYS);
	for (int i = 0; i < CL_THREADS; i++)
		free(w[i].t.log);
	st_note("%d threads x %ld operations on %d keys: %ld grants, "
		"%ld violations, %ld fence errors, %ld errors, "
		"%ld errorcheck errors",
		CL_THREADS, x.ops, CL_KEYS, atomic_load(&x.grants),
		atomic_load(&x.violations), atomic_load(&x.fence_errors),
		atomic_load(&x.errors), atomic_load(&x.errorcheck_errors));
	st_assert(atomic_load(&x.violations) == 0,
		  "%ld times a writer was not alone",
		  atomic_load(&x.violations));
	st_assert(atomic_load(&x.fence_errors) == 0,
		  "%ld fences did not grow past earlier grants",
		  atomic_load(&x.fence_errors));
	st_assert(atomic_load(&x.errors) == 0, "%ld unexpected statuses",
		  atomic_load(&x.errors));
	st_assert(atomic_load(&x.errorcheck_errors) == 0,
		  "%ld times KL_ERRORCHECK let a holder ask for its key",
		  atomic_load(&x.errorcheck_errors));
	st_assert(kl_memory_provider_size(x.p) == 0,
		  "provider keeps %zu keys", kl_memory_provider_size(x.p));
	if (kl__test_check_invariants(x.p) != KL_OK)
		atomic_fetch_add(&x.invariant_errors, 1);
	st_assert(atomic_load(&x.invariant_errors) == 0,
		  "%ld invariant checks failed (see stderr)",
		  atomic_load(&x.invariant_errors));
	for (int a = 0; a < 2; a++)
		for (int b = 0; b < 3; b++)
			for (int c = 0; c < 2; c++)
				kl_lock_free(x.l[a][b][c]);
	kl_provider_free(x.p);
}
END_TEST

static Suite *
rw_suite(void)
{
	Suite *s = suite_create("stress_rw");
	TCase *tc = tcase_create("readers_writers");

	tcase_set_timeout(tc, ST_TIMEOUT);
	tcase_add_test(tc, test_readers_writers);
	suite_add_tcase(s, tc);
	tc = tcase_create("colliding_keys");
	tcase_set_timeout(tc, ST_TIMEOUT);
	tcase_add_test(tc, test_colliding_keys);
	suite_add_tcase(s, tc);
	return s;
}

int
main(void)
{
	return st_run(rw_suite());
}
