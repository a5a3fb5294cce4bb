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
	if ((t = kl__aligned_alloc(64, sizeof *t)) == NULL)
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
	*holders = e != NULL && (st & E_HELD);
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
	 * make one up.  The grant is the fence: one per grant of the key. */
	if ((st & E_HELD) && tid != 0)
		fn(arg, tid, fence_of(st));
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
