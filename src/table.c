/* SPDX-License-Identifier: MIT */
/*
 * The key table behind the memory provider.
 *
 * 64 shards, each a cache-line aligned mutex with its own chained hash table
 * that grows and shrinks by itself, so a resize stops one shard, never the
 * world.  The shard mutex is also the lock of every wait queue in the shard:
 * an entry's hand-off and its removal are decided under one lock.  Short
 * keys mostly live in a few slot entries per shard that are taken and given
 * back without the lock (see table_acquire.c).
 *
 * This file: the table's storage (making and freeing it, its hash, the
 * bucket arrays and their size) and the counts and queries that look at
 * every shard.  table_acquire.c takes keys and gives them back (the slot
 * protocol and its invariants, chained entries, the waiters);
 * table_check.c checks all of it in the test build.  table.h holds the
 * layout and the reads they share.
 *
 * Keys are hashed with a keyed multiply-fold hash (see hash_of; SipHash for
 * the buckets of a shard that meets a long chain); the top bits pick the
 * shard, the next ones the slot, the low bits the bucket.
 */
#include "config.h"

#include <unistd.h>

#define KL__TABLE_PRIVATE
#include "table.h"

/* Keys for the fast hash and for SipHash, from the process's seed: the
 * fast hash's are SipHash outputs of it, so that they give nothing away of
 * the key a strong shard uses, and tables made after
 * kl__test_set_hash_seed hash alike. */
static void
table_init(struct kl__table *t)
{
	uint64_t k0, k1;

	kl__hash_seed(&k0, &k1);
	for (int i = 0; i < 3; i++) {
		char tag[] = "keylock fast hash 0";

		tag[sizeof tag - 2] = (char)('0' + i);
		t->fk[i] = kl__siphash(k0, k1, tag, sizeof tag - 1) | 1;
	}
	for (int i = 0; i < NSHARDS; i++) {
		struct shard *s = &t->shards[i];

		pthread_mutex_init(&s->lock, NULL);
		atomic_init(&s->sleepers, 0);
		KL_ANNOTATE_ATOMIC(&s->sleepers);
		atomic_init(&s->slots, NULL);
		KL_ANNOTATE_ATOMIC(&s->slots);
		for (int j = 0; j < SLOTS; j++)
			KL_ANNOTATE_ATOMIC(&s->floor[j]);
		s->sk[0] = k0;
		s->sk[1] = k1;
	}
}

int
kl__table_new(struct kl__table **out)
{
	struct kl__table *t;

	*out = NULL;
	if ((t = kl__aligned_alloc(KL__CACHE_LINE, sizeof *t)) == NULL)
		return KL_ENOMEM;
	memset(t, 0, sizeof *t);
	table_init(t);
	*out = t;
	return KL_OK;
}

static struct kl__table shared_table;
static pthread_once_t shared_once = PTHREAD_ONCE_INIT;

static void
shared_init(void)
{
	table_init(&shared_table);
}

struct kl__table *
kl__table_shared(void)
{
	pthread_once(&shared_once, shared_init);
	return &shared_table;
}

void
kl__table_free(struct kl__table *t)
{
	if (t == NULL)
		return;
#ifdef KL_DEBUG
	if (kl__table_size(t) != 0)
		fprintf(stderr, "keylock: memory provider freed with %zu "
				"keys held\n", kl__table_size(t));
#endif
	for (int i = 0; i < NSHARDS; i++) {
		struct shard *s = &t->shards[i];

		/* Chained entries are freed by their last release. */
		pthread_mutex_destroy(&s->lock);
		kl__free(s->buckets);
		kl__free(atomic_load_explicit(&s->slots,
					      memory_order_relaxed));
	}
	kl__free(t);
}

uint32_t
kl__table_hash(const struct kl__table *t, const char *key, size_t len)
{
	return hash_of(t, key, len);
}

/* ------------------------------------------------------------------ */
/* Bucket arrays: where a key lives that its slot cannot take (a long key,
 * or a short one whose slot another key holds).  An array doubles at one
 * entry per bucket and halves at a quarter; a chain of CHAIN_LIMIT makes
 * its shard index buckets by SipHash (see hash_of in table.h).  The
 * entries themselves are made and freed by table_acquire.c (insert,
 * unlink_entry), which calls here only when the array must change. */

/* Rebuilds the bucket array with n buckets (a power of two).  On allocation
 * failure the old array stays: a full table is slower, never wrong. */
static bool
rehash(struct shard *s, size_t n)
{
	struct kl__entry **nb = kl__calloc(n, sizeof *nb);
	size_t old = s->buckets != NULL ? s->mask + 1 : 0;

	if (nb == NULL)
		return false;
	s->mask = n - 1;
	for (size_t i = 0; i < old; i++) {
		struct kl__entry *e = s->buckets[i], *next;

		for (; e != NULL; e = next) {
			size_t b = bucket_of(s, e->hash, e->key, e->len);

			next = e->next;
			e->next = nb[b];
			nb[b] = e;
		}
	}
	kl__free(s->buckets);
	s->buckets = nb;
	return true;
}

/* A chain of CHAIN_LIMIT in a shard that trusts the fast hash: index the
 * buckets by SipHash from now on (see hash_of).  Lock held. */
static void
check_chain(struct shard *s, size_t chain)
{
	if (s->strong || chain < CHAIN_LIMIT)
		return;
	s->strong = true;
	if (!rehash(s, s->mask + 1))
		s->strong = false; /* out of memory: try again next time */
}

/* Shrink lazily (a quarter full), never below MIN_BUCKETS: a shard whose
 * only chained key comes and goes keeps its small array instead of
 * allocating it on every acquire.  Lock held. */
void
kl__chain_shrink(struct shard *s)
{
	while (s->mask + 1 > MIN_BUCKETS && s->count < (s->mask + 1) / 4) {
		if (!rehash(s, (s->mask + 1) / 2))
			break; /* out of memory: stay as is */
	}
}

int
kl__chain_grow(struct shard *s, size_t chain)
{
	if (s->buckets == NULL)
		return rehash(s, MIN_BUCKETS) ? KL_OK : KL_ENOMEM;
	if (s->count >= s->mask + 1 && s->mask + 1 < MAX_BUCKETS)
		rehash(s, (s->mask + 1) * 2); /* out of memory: fuller */
	else
		check_chain(s, chain);
	return KL_OK;
}

/* ------------------------------------------------------------------ */
/* Counts */

/* Held, idle and chained entries of s.  Lock held. */
static void
count_entries(struct shard *s, size_t *held, size_t *idle, size_t *chained)
{
	struct kl__entry *slots =
		atomic_load_explicit(&s->slots, memory_order_relaxed);

	*held += s->count; /* a chained entry is always held */
	*chained += s->count;
	for (unsigned i = 0; slots != NULL && i < SLOTS; i++) {
		uint64_t st = state_of(slot_at(slots, i),
				       memory_order_relaxed);

		if (st & E_HELD)
			++*held;
		else if (st & E_USED)
			++*idle;
	}
}

/* Keys held now: the chains, stood still under all the locks, and the
 * slots, which lock-free takers and releasers change meanwhile.  A slot
 * counts when it was held with the same word in two scans: held through
 * the moment between them, so that a release in a shard already counted
 * and a take in one not yet counted never add up to more keys than were
 * ever held at once.  A slot that changed between the scans is left out,
 * as a key given back during the count may be. */
size_t
kl__table_size(struct kl__table *t)
{
	uint64_t first[NSHARDS][SLOTS] = { { 0 } };
	size_t held = 0;

	for (int i = 0; i < NSHARDS; i++)
		pthread_mutex_lock(&t->shards[i].lock);
	for (int pass = 0; pass < 2; pass++)
		for (int i = 0; i < NSHARDS; i++) {
			struct shard *s = &t->shards[i];
			struct kl__entry *slots = atomic_load_explicit(
				&s->slots, memory_order_relaxed);

			for (unsigned j = 0; slots != NULL && j < SLOTS; j++) {
				uint64_t st = state_of(slot_at(slots, j),
						       memory_order_acquire);

				if (pass == 0)
					first[i][j] = st;
				else if (st == first[i][j] && (st & E_HELD))
					held++;
			}
			if (pass == 1)
				held += s->count;
		}
	for (int i = NSHARDS - 1; i >= 0; i--)
		pthread_mutex_unlock(&t->shards[i].lock);
	return held;
}

int
kl__table_status(struct kl__table *t, const char *key, size_t len,
		 size_t *holders, size_t *waiters)
{
	uint32_t h = hash_of(t, key, len);
	struct shard *s = shard_of(t, h);
	struct kl__entry *slots, *e = NULL;
	uint64_t st = 0, w[2];
	size_t chain;
	int has;

	pthread_mutex_lock(&s->lock);
	slots = atomic_load_explicit(&s->slots, memory_order_relaxed);
	if (len < INLINE_KEY && slots != NULL) {
		e = slot_at(slots, kl__table_slot_of(h));
		key_words(key, len, w);
		while ((has = slot_read(e, h, len, w, &st)) < 0)
			;
		if (!has)
			e = NULL; /* another key's, or none */
	}
	if (e == NULL && (e = find(s, h, key, len, &chain)) != NULL)
		st = state_of(e, memory_order_relaxed);
	*holders = e != NULL ? holder_count(e, st) : 0;
	*waiters = e != NULL ? e->q.len : 0;
	pthread_mutex_unlock(&s->lock);
	return KL_OK;
}

bool
kl__table_waited_holders(struct kl__waiter *w, kl__holder_fn *fn, void *arg,
			 char *shown, size_t size)
{
	struct kl__entry *e;
	uint64_t st, tid;

	pthread_mutex_lock(w->lock);
	if (w->state != KL_W_WAITING) {
		pthread_mutex_unlock(w->lock);
		return false;
	}
	/* A queued waiter's queue is its entry's, which stays while it has
	 * waiters, held: its holder hands it over under this lock. */
	e = (struct kl__entry *)(void *)((char *)w->q -
					 offsetof(struct kl__entry, q));
	/* Acquire: what a lock-free taker wrote before it took the key (its
	 * key, when it stole the slot). */
	st = state_of(e, memory_order_acquire);
	tid = atomic_load_explicit(&e->owner_tid, memory_order_relaxed);
	/* A key taken without the lock gets its holder's id just after the
	 * take, and had 0 before (no thread's id): for that moment no holder
	 * is seen, which can only miss a cycle until the next check, never
	 * make one up.  The grant of an exclusive holder is the fence: one
	 * per grant of the key.
	 *
	 * A lone shared holder (E_SOLO) keeps no fence of its own once
	 * others joined it (the word's is the latest grant's), so its grant
	 * is the word's fence as read now.  That still names one hold: every
	 * grant of the key raises the fence, and the key stays held while w
	 * waits, so the same fence at two readings means nothing was granted
	 * in between, E_SOLO included (only a grant sets it): the same lone
	 * holder held all along.  A fence that moved only makes the second
	 * pass fail.  With an exclusive request at the head of the queue
	 * (the key held shared and someone waits), nothing is granted until
	 * a holder leaves, so a real cycle keeps its fence. */
	if ((st & E_HELD) && tid != 0 && (!held_shared(st) || (st & E_SOLO)))
		fn(arg, tid, fence_of(st));
	/* Each shared holder in the ring by the fence of its own grant. */
	if (shared_of(e, st) != NULL) {
		const struct kl__holder *h = e->shared;

		do {
			fn(arg, h->tid, h->fence);
			h = h->next;
		} while (h != e->shared);
	}
	if (shown != NULL)
		kl__key_printable(shown, size, e->key, e->len);
	pthread_mutex_unlock(w->lock);
	return true;
}

size_t
kl__table_queue_size(struct kl__table *t, const char *key, size_t len)
{
	size_t holders, waiters;

	kl__table_status(t, key, len, &holders, &waiters);
	return waiters;
}

void
kl__table_stats(struct kl__table *t, struct kl__table_stats *out)
{
	memset(out, 0, sizeof *out);
	for (int i = 0; i < NSHARDS; i++) {
		struct shard *s = &t->shards[i];

		pthread_mutex_lock(&s->lock);
		count_entries(s, &out->entries, &out->idle, &out->chained);
		out->lookups += s->lookups;
		out->probes += s->probes;
		out->strong += s->strong;
		if (s->buckets != NULL) {
			out->buckets += s->mask + 1;
			for (size_t b = 0; b <= s->mask; b++) {
				size_t n = 0;

				for (struct kl__entry *e = s->buckets[b];
				     e != NULL; e = e->next)
					n++;
				if (n > out->max_chain)
					out->max_chain = n;
			}
		}
		pthread_mutex_unlock(&s->lock);
	}
}

/* ------------------------------------------------------------------ */
/* Snapshots */

/* A row of a snapshot: info, whose key is at key_off of the shard's key
 * bytes until the rows are handed out. */
struct snap_row {
	kl_lock_info info;
	size_t key_off;
};

/* A slot as it stood at one moment: its word, key and queue.  Lock held
 * (so its queue, and the word of a slot with waiters or held shared,
 * stand still; a lock-free holder may still give back a slot held
 * exclusively, and the copy then shows it held as it was). */
struct slot_copy {
	uint64_t st;
	uint32_t len;
	char key[INLINE_KEY];
};

static void
slot_copy(struct kl__entry *e, struct slot_copy *c)
{
	uint64_t k[2];

	do {
		c->st = slot_wait_unbusy(e);
		c->len = __atomic_load_n(&e->len, __ATOMIC_RELAXED);
		k[0] = __atomic_load_n(&slot_words(e)[0], __ATOMIC_RELAXED);
		k[1] = __atomic_load_n(&slot_words(e)[1], __ATOMIC_RELAXED);
		atomic_thread_fence(memory_order_acquire);
	} while (state_of(e, memory_order_relaxed) != c->st);
	memcpy(c->key, k, sizeof c->key);
	if (c->len >= INLINE_KEY)
		c->len = 0; /* cannot happen for a used slot */
}

/* Rows and key bytes entry e (held in word st) adds.  Lock held. */
static void
snap_count(struct kl__entry *e, uint64_t st, size_t len, size_t *rows,
	   size_t *bytes)
{
	if (!(st & E_HELD))
		return;
	*rows += holder_count(e, st) + e->q.len;
	*bytes += len + 1;
}

/* Writes the rows of entry e, held in word st, with key (len bytes) at
 * *bytes of keys.  Lock held. */
static void
snap_fill(struct kl__entry *e, uint64_t st, const char *key, size_t len,
	  struct snap_row *rows, size_t *n, char *keys, size_t *bytes,
	  int64_t pid, int64_t now, int64_t coarse)
{
	struct kl__waiter *w;
	size_t pos = 0;

	if (!(st & E_HELD))
		return;
	memcpy(keys + *bytes, key, len);
	keys[*bytes + len] = '\0';
	if (!held_shared(st) || (st & E_SOLO)) {
		struct snap_row *r = &rows[(*n)++];

		memset(r, 0, sizeof *r);
		r->key_off = *bytes;
		r->info.key_len = len;
		r->info.shared = held_shared(st);
		r->info.pid = pid;
		/* The lock-free path records no gettid() nor time, nor the
		 * fence of a lone shared holder (the word's is the latest
		 * grant's). */
		r->info.fence = held_shared(st) ? 0 : fence_of(st);
		r->info.elapsed_ms = -1;
	}
	if (shared_of(e, st) != NULL) {
		struct kl__holder *h = e->shared;

		do {
			struct snap_row *r = &rows[(*n)++];

			memset(r, 0, sizeof *r);
			r->key_off = *bytes;
			r->info.key_len = len;
			r->info.shared = true;
			r->info.pid = pid;
			r->info.tid = h->os_tid;
			r->info.fence = h->fence;
			r->info.elapsed_ms = coarse > h->since_ns
						     ? (coarse - h->since_ns) /
							       1000000
						     : 0;
			h = h->next;
		} while (h != e->shared);
	}
	if ((w = e->q.head) != NULL)
		do {
			struct twaiter *tw = twaiter_of(w);
			struct snap_row *r = &rows[(*n)++];

			memset(r, 0, sizeof *r);
			r->key_off = *bytes;
			r->info.key_len = len;
			r->info.waiting = true;
			r->info.shared = tw->h != NULL;
			r->info.pid = pid;
			r->info.tid = tw->os_tid;
			r->info.elapsed_ms = now > w->since_ns
						     ? (now - w->since_ns) /
							       1000000
						     : 0;
			r->info.position = pos++;
			w = w->next;
		} while (w != e->q.head);
	*bytes += len + 1;
}

/* Copies the rows of shard s into *out (kl__free it; NULL when none),
 * *nrows of them with their keys.  Lock taken here.  KL_OK or
 * KL_ENOMEM. */
static int
snap_shard(struct shard *s, struct snap_row **out, size_t *nrows,
	   int64_t pid)
{
	struct slot_copy sc[SLOTS];
	struct kl__entry *slots;
	struct snap_row *rows;
	size_t n = 0, bytes = 0, nk = 0, kb = 0;
	int64_t now, coarse;
	char *keys;

	*out = NULL;
	*nrows = 0;
	pthread_mutex_lock(&s->lock);
	slots = atomic_load_explicit(&s->slots, memory_order_relaxed);
	for (unsigned i = 0; slots != NULL && i < SLOTS; i++) {
		slot_copy(slot_at(slots, i), &sc[i]);
		if (sc[i].st & E_USED)
			snap_count(slot_at(slots, i), sc[i].st, sc[i].len, &n,
				   &bytes);
	}
	for (size_t b = 0; s->buckets != NULL && b <= s->mask; b++)
		for (struct kl__entry *e = s->buckets[b]; e != NULL;
		     e = e->next)
			snap_count(e, state_of(e, memory_order_relaxed),
				   e->len, &n, &bytes);
	if (n == 0) {
		pthread_mutex_unlock(&s->lock);
		return KL_OK;
	}
	/* Under the lock: its entries must be read at one moment with
	 * the counts above. */
	if (n > (SIZE_MAX - bytes) / sizeof *rows ||
	    (rows = kl__malloc(n * sizeof *rows + bytes)) == NULL) {
		pthread_mutex_unlock(&s->lock);
		return KL_ENOMEM;
	}
	keys = (char *)(rows + n);
	now = kl__now_ns();
	coarse = kl__coarse_now_ns();
	for (unsigned i = 0; slots != NULL && i < SLOTS; i++)
		if (sc[i].st & E_USED)
			snap_fill(slot_at(slots, i), sc[i].st, sc[i].key,
				  sc[i].len, rows, &nk, keys, &kb, pid, now,
				  coarse);
	for (size_t b = 0; s->buckets != NULL && b <= s->mask; b++)
		for (struct kl__entry *e = s->buckets[b]; e != NULL;
		     e = e->next)
			snap_fill(e, state_of(e, memory_order_relaxed), e->key,
				  e->len, rows, &nk, keys, &kb, pid, now,
				  coarse);
	pthread_mutex_unlock(&s->lock);
	KL_ASSERT(nk == n && kb == bytes);
	for (size_t i = 0; i < n; i++)
		rows[i].info.key = keys + rows[i].key_off;
	*out = rows;
	*nrows = n;
	return KL_OK;
}

int
kl__table_snapshot(struct kl__table *t, kl_snapshot_fn fn, void *arg)
{
	int64_t pid = (int64_t)getpid();

	for (int i = 0; i < NSHARDS; i++) {
		struct snap_row *rows;
		size_t n;
		int rc, stop = 0;

		if ((rc = snap_shard(&t->shards[i], &rows, &n, pid)) != KL_OK)
			return rc;
		for (size_t j = 0; j < n && stop == 0; j++)
			stop = fn(&rows[j].info, arg);
		kl__free(rows);
		if (stop != 0)
			break;
	}
	return KL_OK;
}
