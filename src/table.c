/* SPDX-License-Identifier: MIT */
/*
 * The key table behind the memory provider.
 *
 * 64 shards, each a cache-line aligned mutex with its own chained hash table
 * that grows and shrinks by itself, so a resize stops one shard, never the
 * world.  The shard mutex is also the lock of every wait queue in the shard:
 * an entry's hand-off and its removal are decided under one lock.
 *
 * Slots.  Most keys are short, and most acquires take a key nobody holds.
 * So each shard also has SLOTS slot entries, made with the shard's first
 * short key and never freed while the table lives, and a key of up to 15
 * bytes lives in the slot its hash picks (kl__table_slot_of) unless another
 * key holds that slot.  A slot keeps its key after release ("idle"), and
 * taking the key again, or giving it back, is one compare-and-swap on the
 * slot's state word, without the shard lock: the memory a lock-free reader
 * looks at is never freed, and the word says whether what it read still
 * holds.  A key
 * whose slot is held by another key, and every longer key, gets an entry in
 * the shard's bucket chains ("chained"), made on first use and freed when
 * the last holder leaves with nobody waiting, all under the lock.
 *
 * A key has one entry at most, in its slot or in a chain, never both:
 * - only the lock's holder puts a key in a chain, after it found the key in
 *   neither place and marked the slot E_CHAIN;
 * - a slot marked E_CHAIN (some chained key has its index) is given a new
 *   key only under the lock, after the chains were searched for it;
 * - the mark goes when the last chained key of its index does.
 *
 * The state word of an entry: E_* flags and, from FENCE_SHIFT up, the fence
 * of its latest grant.  Every grant adds one to the fence, and a slot given
 * to a new key keeps counting, so a slot's fence only grows; a chained short
 * key starts above its slot's fence and its floor, and raises the floor to
 * its last fence when it goes; a new key of the slot starts above both.  So
 * a key's fences grow across all the entries it ever has.  (Long keys use
 * the shard's counter as the floor.)
 *
 * Lock-free, a slot moves: idle -> held (its key taken again), idle or
 * empty without E_CHAIN -> busy -> held (a new key written in: "stolen"),
 * held without E_WAITERS -> idle (given back).  Everything else changes a
 * slot under the lock, by compare-and-swap against the word it validated
 * (so that a decision made on a key read from a slot is void if the slot
 * changed meanwhile: the fence changes with every move), or by a store
 * where only the lock's holder can change the word: a held slot with
 * E_WAITERS, released by its holder.  A waiter sets
 * E_WAITERS before it queues, and a marked slot is given back only under
 * the lock, which hands it over in FIFO order.  A reader that finds a slot
 * busy waits for the stealer to finish (a few instructions, unless it was
 * preempted).  Waiters queue only on a held key.  A waiter that times out
 * or is cancelled only unlinks itself; the key is still held then, so it
 * never has to free anything.
 *
 * Keys are hashed with a keyed multiply-fold hash (see hash_of; SipHash for
 * the buckets of a shard that meets a long chain); the top bits pick the
 * shard, the next ones the slot, the low bits the bucket.
 */
#include "config.h"

#include <sched.h>
#include <string.h>

#include "annotate.h"
#include "table.h"

#define NSHARDS KL__TABLE_SHARDS
#define SLOTS KL__TABLE_SLOTS
#define MIN_BUCKETS 8
/* Key bytes (NUL included) every slot has room for; shorter keys of a
 * chained entry get as much, so that its malloc chunk is the same 80
 * bytes a held slot stands for. */
#define INLINE_KEY 16
#define SLOT_SIZE (sizeof(struct kl__entry) + INLINE_KEY)
/* The state word of an entry. */
#define E_HELD 1u    /* a holder has the key */
#define E_WAITERS 2u /* a waiter may be queued: release under the lock */
#define E_SLOT 4u    /* a slot entry, for good */
#define E_USED 8u    /* slot: has a key */
#define E_CHAIN 16u  /* slot: a chained key may have its index */
#define E_BUSY 32u   /* slot: a stealer is writing its key */
#define E_FLAGS 63u
#define FENCE_SHIFT KL__ENTRY_FENCE_SHIFT
#define FENCE_ONE ((uint64_t)1 << FENCE_SHIFT)

_Static_assert(E_FLAGS < FENCE_ONE, "flags below the fence");
_Static_assert(SLOT_SIZE % 8 == 0, "slots stay aligned for their words");
_Static_assert((SLOTS & (SLOTS - 1)) == 0 && SLOTS <= 8,
	       "kl__table_slot_of takes up to 3 bits");

struct shard {
	pthread_mutex_t lock;
	/* SLOTS slot entries of SLOT_SIZE bytes, made under the lock and
	 * read without it. */
	_Atomic(struct kl__entry *) slots;
	struct kl__entry **buckets;
	uint32_t nchain[SLOTS]; /* chained short keys of each slot index */
	/* The largest fence a chained key of each slot index had when it
	 * went: the slot's next key starts above it (see the top).  Written
	 * under the lock, read atomically by stealers. */
	uint64_t floor[SLOTS];
	size_t count;           /* chained entries */
	size_t mask;            /* buckets - 1; 0 while no bucket array */
	uint64_t fence;         /* long keys' fences: see above */
	uint64_t lookups, probes;
	/* Buckets by SipHash (see hash_of), keyed with sk. */
	bool strong;
	uint64_t sk[2];
} __attribute__((aligned(64)));

/* No global count of entries: every acquire and release on any key would
 * write its cache line from every CPU.  kl__table_size counts the shards
 * with all of them locked at once. */
struct kl__table {
	struct shard shards[NSHARDS];
	/* Keys of the fast hash, drawn from kl__hash's seed: see hash_of. */
	uint64_t fk[3];
};

static inline uint64_t
state_of(struct kl__entry *e, memory_order mo)
{
	return atomic_load_explicit(&e->state, mo);
}

static inline uint64_t
fence_of(uint64_t st)
{
	return st >> FENCE_SHIFT;
}

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

/* An entry keeps 32 bits of its key's hash: the top 6 pick the shard, the
 * next 1-3 the slot, the low ones the bucket (a shard never grows past
 * MAX_BUCKETS, so shard and bucket never overlap; bucket and slot may, which
 * only means that a huge shard's chained keys of one bucket share a
 * slot). */
#define MAX_BUCKETS ((size_t)1 << 26)

/* The table's hash.  SipHash of every key cost a keyed acquire about a
 * third of its time, so the table hashes with a keyed multiply-fold hash
 * instead: 128-bit products of key words and secret words, folded.  It is
 * not a proven PRF, so a shard does not trust it: a bucket chain of
 * CHAIN_LIMIT entries (about 1e-9 likely per insert with random keys, as
 * shards grow at one entry per bucket) makes the shard index its buckets by
 * SipHash of the key from then on ("strong"), so that keys crafted to
 * collide under the fast hash spread out again.  The shard itself still
 * comes from the fast hash: a flood can crowd one shard's lock, never
 * lengthen its chains. */
#define CHAIN_LIMIT 12

static inline uint64_t
fold(uint64_t a, uint64_t b)
{
	unsigned __int128 p = (unsigned __int128)a * b;

	return (uint64_t)p ^ (uint64_t)(p >> 64);
}

/* Keys of up to 16 bytes, the common case, take two multiplications: the
 * first and last 8 (or 4) bytes, overlapping, with the length. */
static inline __attribute__((always_inline)) uint32_t
hash_of(const struct kl__table *t, const char *key, size_t len)
{
	uint64_t a, b, h, total = len;

	if (__builtin_expect(len > 16, 0)) {
		h = t->fk[2];
		for (; len > 16; key += 16, len -= 16)
			h = fold(kl__load_le64(key) ^ t->fk[0],
				 kl__load_le64(key + 8) ^ h);
		/* The last 1..16 bytes below, mixed with h. */
	} else {
		h = 0;
	}
	if (len >= 8) {
		a = kl__load_le64(key);
		b = kl__load_le64(key + len - 8);
	} else if (len >= 4) {
		a = kl__load_le32(key);
		b = kl__load_le32(key + len - 4);
	} else if (len > 0) {
		a = ((uint64_t)(unsigned char)key[0] << 16) |
		    ((uint64_t)(unsigned char)key[len >> 1] << 8) |
		    (unsigned char)key[len - 1];
		b = 0;
	} else {
		a = b = 0;
	}
	h = fold(a ^ t->fk[0], b ^ t->fk[1] ^ h ^ total);
	return (uint32_t)(fold(h, t->fk[2]) >> 32);
}

/* The bucket of a key with hash h in s.  Lock held. */
static inline size_t
bucket_of(const struct shard *s, uint32_t h, const char *key, size_t len)
{
	if (__builtin_expect(s->strong, 0))
		return (size_t)kl__siphash(s->sk[0], s->sk[1], key, len) &
		       s->mask;
	return h & s->mask;
}

static struct shard *
shard_of(struct kl__table *t, uint32_t h)
{
	return &t->shards[h >> 26];
}

uint32_t
kl__table_hash(const struct kl__table *t, const char *key, size_t len)
{
	return hash_of(t, key, len);
}

/* Most keys are short ids: compared with a few word loads inline, they
 * spare a call to memcmp on every lookup. */
static inline bool
same_bytes(const char *a, const char *b, size_t len)
{
	uint64_t x, y;
	uint32_t u, v;

	if (len > 16)
		return memcmp(a, b, len) == 0;
	if (len >= 8) {
		memcpy(&x, a, 8);
		memcpy(&y, b, 8);
		if (x != y)
			return false;
		memcpy(&x, a + len - 8, 8);
		memcpy(&y, b + len - 8, 8);
		return x == y;
	}
	if (len >= 4) {
		memcpy(&u, a, 4);
		memcpy(&v, b, 4);
		if (u != v)
			return false;
		memcpy(&u, a + len - 4, 4);
		memcpy(&v, b + len - 4, 4);
		return u == v;
	}
	for (size_t i = 0; i < len; i++)
		if (a[i] != b[i])
			return false;
	return true;
}

/* ------------------------------------------------------------------ */
/* Slots */

static inline struct kl__entry *
slot_at(struct kl__entry *slots, unsigned i)
{
	return (struct kl__entry *)(void *)((char *)slots + i * SLOT_SIZE);
}

/* A slot's key is read without the lock while a stealer may write it, so
 * both only ever access it as two words, atomically. */
static inline uint64_t *
slot_words(struct kl__entry *e)
{
	return (uint64_t *)(void *)e->key;
}

/* The two words a slot holds for a key of len < INLINE_KEY bytes: its
 * bytes, a NUL and zeros. */
static inline void
key_words(const char *key, size_t len, uint64_t w[2])
{
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
	/* Overlapping loads of the key alone, shifted into place. */
	if (len >= 8) {
		w[0] = kl__load_le64(key);
		w[1] = len > 8 ? kl__load_le64(key + len - 8) >> (8 * (16 - len))
			       : 0;
	} else if (len >= 4) {
		w[0] = (uint64_t)kl__load_le32(key) |
		       (uint64_t)kl__load_le32(key + len - 4) << (8 * (len - 4));
		w[1] = 0;
	} else {
		w[0] = 0;
		for (size_t i = 0; i < len; i++)
			w[0] |= (uint64_t)(unsigned char)key[i] << (8 * i);
		w[1] = 0;
	}
#else
	char b[INLINE_KEY] = { 0 };

	memcpy(b, key, len);
	memcpy(w, b, sizeof b);
#endif
}

/* Whether slot e holds the key of hash h, len bytes and words w.  Its
 * fields may change as they are read (see slot_take and slot_claim). */
static inline bool
slot_has(struct kl__entry *e, uint32_t h, size_t len, const uint64_t w[2])
{
	uint64_t *k = slot_words(e);

	return __atomic_load_n(&e->hash, __ATOMIC_RELAXED) == h &&
	       __atomic_load_n(&e->len, __ATOMIC_RELAXED) == len &&
	       __atomic_load_n(&k[0], __ATOMIC_RELAXED) == w[0] &&
	       __atomic_load_n(&k[1], __ATOMIC_RELAXED) == w[1];
}

/* Gives the caller slot e, which it found idle in state st holding the
 * caller's key.  False when the word changed meanwhile.  The acquire pairs
 * with the release that left the slot idle. */
static inline bool
slot_take(struct kl__entry *e, uint64_t st, struct kl__entry **out,
	  uint64_t *fence)
{
	uint64_t held = (st + FENCE_ONE) | E_HELD;

	KL_ASSERT((st & (E_SLOT | E_USED | E_HELD | E_BUSY)) ==
		  (E_SLOT | E_USED));
	if (!atomic_compare_exchange_strong_explicit(&e->state, &st, held,
						     memory_order_acquire,
						     memory_order_relaxed))
		return false;
	KL_ANNOTATE_HAPPENS_AFTER(&e->state);
	atomic_store_explicit(&e->owner_tid, kl__thread_id(),
			      memory_order_relaxed);
	e->lock = NULL;
	*out = e;
	*fence = fence_of(held);
	return true;
}

/* Writes the caller's key into slot e, found in state st neither held nor
 * busy, and gives it the slot, held.  False when the word changed
 * meanwhile.  Without the lock, st must not have E_CHAIN; with it, the
 * caller searched the chains for the key. */
static bool
slot_claim(struct shard *s, struct kl__entry *e, uint64_t st, uint32_t h,
	   size_t len, const uint64_t w[2], struct kl__entry **out,
	   uint64_t *fence)
{
	uint64_t f = fence_of(st), *k = slot_words(e), busy;
	unsigned i = kl__table_slot_of(h);
	/* Read after st, which came with acquire order: a floor raised
	 * before the mark that kept stealers off went is seen.  Without the
	 * lock, the floor cannot rise between this read and a successful
	 * compare-and-swap below: it rises only while the slot is marked
	 * E_CHAIN, and the mark is only ever set on a held word (see
	 * slot_mark_chained), so a mark set and gone after st was read
	 * means the word changed and the swap fails. */
	uint64_t lo = __atomic_load_n(&s->floor[i], __ATOMIC_RELAXED);

	KL_ASSERT(!(st & (E_HELD | E_BUSY)));
	busy = (((f > lo ? f : lo) + 1) << FENCE_SHIFT) | (st & E_CHAIN) |
	       E_SLOT | E_USED | E_HELD | E_BUSY;

	if (!atomic_compare_exchange_strong_explicit(&e->state, &st, busy,
						     memory_order_acquire,
						     memory_order_relaxed))
		return false;
	KL_ANNOTATE_HAPPENS_AFTER(&e->state);
	/* Busy now, so nobody marks the slot until the key is written: the
	 * floor read above is still the floor the new fence must pass. */
	KL_ASSERT(__atomic_load_n(&s->floor[i], __ATOMIC_RELAXED) == lo);
	/* A reader that sees any of the words below sees E_BUSY too (the
	 * fence pairs with the one in fast_acquire), so its own
	 * compare-and-swap against the old word fails. */
	atomic_thread_fence(memory_order_release);
	__atomic_store_n(&e->hash, h, __ATOMIC_RELAXED);
	__atomic_store_n(&e->len, (uint32_t)len, __ATOMIC_RELAXED);
	__atomic_store_n(&k[0], w[0], __ATOMIC_RELAXED);
	__atomic_store_n(&k[1], w[1], __ATOMIC_RELAXED);
	atomic_store_explicit(&e->owner_tid, kl__thread_id(),
			      memory_order_relaxed);
	e->lock = NULL;
	KL_YIELD("slot busy");
	/* Nobody else changes a busy word. */
	atomic_store_explicit(&e->state, busy & ~(uint64_t)E_BUSY,
			      memory_order_release);
	*out = e;
	*fence = fence_of(busy);
	return true;
}

/* The word of slot e once no stealer is writing it (E_BUSY clear), with
 * acquire order.  Lock held; a stealer never takes it, so waiting with it
 * held cannot deadlock.  Not the waiter's outcome (waitq.c,
 * outcome_published): this waits out a lock-free writer of a slot. */
static uint64_t
slot_wait_unbusy(struct kl__entry *e)
{
	uint64_t st;

	while ((st = state_of(e, memory_order_acquire)) & E_BUSY)
		sched_yield();
	return st;
}

/* Reads slot e, lock held: 1 when it holds the key of hash h, len bytes
 * and words w, 0 when it holds another key or none, with *st its word
 * then; -1 when a stealer wrote it as it was read (look again).  With the
 * lock held and E_CHAIN set, a slot's key stays as read: only a take or a
 * release of that key can change the word. */
static int
slot_read(struct kl__entry *e, uint32_t h, size_t len, const uint64_t w[2],
	  uint64_t *st)
{
	bool has;

	*st = slot_wait_unbusy(e);
	has = (*st & E_USED) && slot_has(e, h, len, w);
	/* Pairs with the stealer's fence: words it wrote mean a new word. */
	atomic_thread_fence(memory_order_acquire);
	if (state_of(e, memory_order_relaxed) != *st)
		return -1;
	/* The acquire in slot_wait_unbusy: a key given back by CAS and then taken
	 * under the lock in a chain (its slot taken over meanwhile) must
	 * see what its last holder wrote, and the slot's word is the only
	 * thing between them. */
	KL_ANNOTATE_HAPPENS_AFTER(&e->state);
	return has;
}

/* The slots of s, made if need be (lock held).  NULL when out of
 * memory. */
static struct kl__entry *
slots_of(struct shard *s)
{
	struct kl__entry *slots =
		atomic_load_explicit(&s->slots, memory_order_relaxed);

	if (slots != NULL)
		return slots;
	if ((slots = kl__calloc(SLOTS, SLOT_SIZE)) == NULL)
		return NULL;
	for (unsigned i = 0; i < SLOTS; i++) {
		struct kl__entry *e = slot_at(slots, i);

		kl__waitq_init(&e->q, &s->lock);
		atomic_init(&e->state, E_SLOT);
		atomic_init(&e->owner_tid, 0);
		KL_ANNOTATE_ATOMIC(&e->state);
		KL_ANNOTATE_ATOMIC(&e->owner_tid);
		KL_ANNOTATE_ATOMIC(&e->hash);
		KL_ANNOTATE_ATOMIC(&e->len);
		KL_ANNOTATE_ATOMIC(&slot_words(e)[0]);
		KL_ANNOTATE_ATOMIC(&slot_words(e)[1]);
		/* The first taker, maybe lock-free, sees the slot made. */
		KL_ANNOTATE_HAPPENS_BEFORE(&e->state);
	}
	/* Release: a lock-free reader sees the slots made. */
	atomic_store_explicit(&s->slots, slots, memory_order_release);
	return slots;
}

/* Takes a short key that sits idle in its slot, or that can have its slot
 * (idle or empty, no chained key of its index), without the lock.  False
 * when that does not do: the caller takes the lock. */
static inline __attribute__((always_inline)) bool
fast_acquire(struct shard *s, uint32_t h, const char *key, size_t len,
	     struct kl__entry **out, uint64_t *fence)
{
	struct kl__entry *slots =
		atomic_load_explicit(&s->slots, memory_order_acquire);
	struct kl__entry *e;
	uint64_t st, w[2];
	bool mine;

	if (slots == NULL)
		return false;
	e = slot_at(slots, kl__table_slot_of(h));
	st = state_of(e, memory_order_acquire);
	if (st & (E_HELD | E_BUSY))
		return false;
	key_words(key, len, w);
	mine = (st & E_USED) && slot_has(e, h, len, w);
	/* Pairs with the stealer's fence (slot_claim): if the key read above
	 * was being replaced, the compare-and-swap below fails. */
	atomic_thread_fence(memory_order_acquire);
	if (mine)
		return slot_take(e, st, out, fence);
	if (st & E_CHAIN)
		return false;
	/* Unmarked: no chained key has this slot's index, so the key can
	 * be in the slot only, and the slot's floor is read unlocked. */
	return slot_claim(s, e, st, h, len, w, out, fence);
}

/* ------------------------------------------------------------------ */
/* Chains */

/* The chained entry of key, or NULL; *chain gets the length of its
 * bucket.  Lock held. */
static inline struct kl__entry *
find(struct shard *s, uint32_t h, const char *key, size_t len, size_t *chain)
{
	struct kl__entry *e;
	size_t n = 0;

	s->lookups++;
	*chain = 0;
	if (s->buckets == NULL)
		return NULL;
	for (e = s->buckets[bucket_of(s, h, key, len)]; e != NULL;
	     e = e->next) {
		n++;
		if (e->hash == h && e->len == len &&
		    same_bytes(e->key, key, len))
			break;
	}
	s->probes += n;
	*chain = n;
	return e;
}

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
static void
maybe_shrink(struct shard *s)
{
	while (s->mask + 1 > MIN_BUCKETS && s->count < (s->mask + 1) / 4) {
		if (!rehash(s, (s->mask + 1) / 2))
			break; /* out of memory: stay as is */
	}
}

/* Links a new chained entry for key, held by the caller with fence; chain
 * is the length of its bucket.  Lock held. */
static int
insert(struct shard *s, uint32_t h, const char *key, size_t len,
       size_t chain, uint64_t fence, struct kl__entry **out)
{
	struct kl__entry *e;
	size_t b;

	if (s->buckets == NULL) {
		if (!rehash(s, MIN_BUCKETS))
			return KL_ENOMEM;
	} else if (s->count >= s->mask + 1 && s->mask + 1 < MAX_BUCKETS) {
		rehash(s, (s->mask + 1) * 2);
	} else {
		check_chain(s, chain);
	}
	if (len >= UINT32_MAX || len > SIZE_MAX - sizeof *e - 1 ||
		   (e = kl__malloc(sizeof *e + (len < INLINE_KEY
							? INLINE_KEY
							: len + 1))) == NULL) {
		return KL_ENOMEM;
	}
	e->hash = h;
	e->len = (uint32_t)len;
	kl__waitq_init(&e->q, &s->lock);
	atomic_init(&e->state, (fence << FENCE_SHIFT) | E_HELD);
	atomic_init(&e->owner_tid, kl__thread_id());
	KL_ANNOTATE_ATOMIC(&e->state);
	KL_ANNOTATE_ATOMIC(&e->owner_tid);
	e->lock = NULL;
	memcpy(e->key, key, len);
	e->key[len] = '\0';
	b = bucket_of(s, h, key, len);
	e->next = s->buckets[b];
	s->buckets[b] = e;
	s->count++;
	*out = e;
	return KL_OK;
}

static void
unlink_entry(struct shard *s, struct kl__entry *e)
{
	struct kl__entry **pp =
		&s->buckets[bucket_of(s, e->hash, e->key, e->len)];

	while (*pp != e)
		pp = &(*pp)->next;
	*pp = e->next;
	s->count--;
	maybe_shrink(s);
}

/* A chained short key of slot index i is gone with fence f: the floor of
 * the slot rises to it, and the slot loses its mark with the last such
 * key.  Lock held; the slot cannot be busy (it is marked), but its key
 * may be taken or given back meanwhile. */
static void
slot_unchain(struct shard *s, unsigned i, uint64_t f)
{
	struct kl__entry *e = slot_at(
		atomic_load_explicit(&s->slots, memory_order_relaxed), i);
	uint64_t st;

	if (s->floor[i] < f)
		__atomic_store_n(&s->floor[i], f, __ATOMIC_RELAXED);
	if (--s->nchain[i] != 0)
		return;
	/* Release: a stealer that sees the mark gone sees the floor, and
	 * what the chained key's last holder (maybe this thread) wrote
	 * before it gave the key back under the lock, for the stealer may
	 * take that key without the lock. */
	KL_ANNOTATE_HAPPENS_BEFORE(&e->state);
	st = state_of(e, memory_order_relaxed);
	/* A stealer never takes a marked slot, and the lock keeps the
	 * other writers of its key off: the swap below only races with
	 * takes and releases of the key the slot holds. */
	KL_ASSERT((st & (E_CHAIN | E_BUSY)) == E_CHAIN);
	while (!atomic_compare_exchange_weak_explicit(
		&e->state, &st, st & ~(uint64_t)E_CHAIN, memory_order_release,
		memory_order_relaxed))
		;
}

/* Unlinks chained entry e, released with fence f and nobody waiting, and
 * passes its fence on (see the top).  Lock held. */
static void
unchain(struct shard *s, struct kl__entry *e, uint64_t f)
{
	unlink_entry(s, e);
	if (e->len < INLINE_KEY)
		slot_unchain(s, kl__table_slot_of(e->hash), f);
	else if (s->fence < f)
		s->fence = f;
}

/* ------------------------------------------------------------------ */
/* Acquire and release */

/* Marks slot e, read held by another key in word *st, E_CHAIN: a chained
 * key of its index may come.  False when the word changed meanwhile (*st
 * gets it).  Lock held.
 *
 * The mark is only ever set on a held word.  This is what makes the
 * stealer's floor read in slot_claim safe without the lock: a stealer
 * that read the slot idle or empty and unmarked can only succeed if the
 * word never changed since, so no mark came and went, so the floor did
 * not rise.  A mark set on an idle word would let a chained key come and
 * go (raising the floor) without the stealer's swap failing. */
static bool
slot_mark_chained(struct kl__entry *e, uint64_t *st)
{
	KL_ASSERT((*st & (E_HELD | E_BUSY)) == E_HELD);
	if (*st & E_CHAIN)
		return true;
	return atomic_compare_exchange_strong_explicit(
		&e->state, st, *st | E_CHAIN, memory_order_relaxed,
		memory_order_relaxed);
}

/* take_locked's outcome when another holds the key. */
#define KEY_HELD 1

/* Takes key for the caller if nobody holds it: KL_OK with *out and *fence;
 * KEY_HELD with *out the entry that is held and *st its word then;
 * KL_ENOMEM.  Lock held. */
static int
take_locked(struct shard *s, uint32_t h, const char *key, size_t len,
	    struct kl__entry **out, uint64_t *st, uint64_t *fence)
{
	struct kl__entry *slots, *e, *c;
	uint64_t w[2], f;
	unsigned i = kl__table_slot_of(h);
	size_t chain;
	int rc, has;

	if (len >= INLINE_KEY) {
		if ((c = find(s, h, key, len, &chain)) != NULL) {
			*out = c;
			*st = state_of(c, memory_order_relaxed);
			return KEY_HELD;
		}
		if ((rc = insert(s, h, key, len, chain, s->fence + 1, out)) ==
		    KL_OK)
			*fence = ++s->fence;
		return rc;
	}
	if ((slots = slots_of(s)) == NULL)
		return KL_ENOMEM;
	e = slot_at(slots, i);
	key_words(key, len, w);
	for (;;) {
		if ((has = slot_read(e, h, len, w, st)) < 0)
			continue;
		if (has) {
			if (*st & E_HELD) {
				*out = e;
				return KEY_HELD;
			}
			if (slot_take(e, *st, out, fence))
				return KL_OK;
			continue; /* taken or stolen meanwhile */
		}
		if ((c = find(s, h, key, len, &chain)) != NULL) {
			*out = c;
			*st = state_of(c, memory_order_relaxed);
			return KEY_HELD;
		}
		if (!(*st & E_HELD)) {
			/* The chains were searched: E_CHAIN does not stop
			 * the lock's holder. */
			if (slot_claim(s, e, *st, h, len, w, out, fence))
				return KL_OK;
			continue;
		}
		/* Another key holds the slot: the key goes in a chain, and
		 * the mark keeps stealers off the slot meanwhile. */
		if (slot_mark_chained(e, st))
			break;
	}
	/* Above every fence the key had: in the slot (its fences never
	 * pass the slot's) or chained before (the floor). */
	f = fence_of(*st) > s->floor[i] ? fence_of(*st) : s->floor[i];
	rc = insert(s, h, key, len, chain, f + 1, &c);
	s->nchain[i]++;
	if (rc == KL_OK) {
		*out = c;
		*fence = f + 1;
	} else {
		slot_unchain(s, i, 0); /* drops the mark if it was the only */
	}
	return rc;
}

/* Marks e, found held in word st, as waited for, so that its holder
 * releases through the lock.  False when the word changed meanwhile (the
 * key may be free now, or e another key's): look again.  Lock held. */
static bool
mark_waiting(struct kl__entry *e, uint64_t st)
{
	uint64_t want = st | E_WAITERS;

	if (atomic_compare_exchange_strong_explicit(&e->state, &st, want,
						    memory_order_relaxed,
						    memory_order_relaxed))
		return true;
	return st == want; /* another waiter marked it: the same holder */
}

/* Whether a caller that finds e held must fail rather than wait: KL_EDEADLK,
 * KL_ETIMEDOUT, or KL_OK to wait.  Lock held. */
static int
refusal(struct kl__entry *e, int64_t deadline_ns, unsigned flags)
{
	if ((flags & KL_ERRORCHECK) &&
	    atomic_load_explicit(&e->owner_tid, memory_order_relaxed) ==
		    kl__thread_id())
		return KL_EDEADLK;
	if (deadline_ns != KL_NO_DEADLINE && kl__now_ns() >= deadline_ns)
		return KL_ETIMEDOUT;
	return KL_OK;
}

/* Takes key, or waits for it as w (prepared).  Lock held on entry,
 * released on return. */
static int
take_or_wait(struct shard *s, uint32_t h, const char *key, size_t len,
	     struct kl__waiter *w, int64_t deadline_ns, unsigned flags,
	     struct kl__entry **out, uint64_t *fence)
{
	struct kl__entry *e = NULL;
	uint64_t st = 0;
	int rc;

	for (;;) {
		rc = take_locked(s, h, key, len, &e, &st, fence);
		if (rc != KEY_HELD) {
			if (rc == KL_OK)
				*out = e;
			break;
		}
		if ((rc = refusal(e, deadline_ns, flags)) != KL_OK)
			break;
		if (mark_waiting(e, st)) {
			/* Waiters queue only on a held key, marked, so its
			 * holder releases through the lock and hands over. */
			KL_ASSERT(st & E_HELD);
			rc = kl__waitq_wait(&e->q, w, deadline_ns,
					    KL_UNBOUNDED, KL_OVERFLOW_THIS);
			if (rc == KL_OK) {
				*out = e;
				*fence = w->data;
			}
			return rc;
		}
	}
	pthread_mutex_unlock(&s->lock);
	return rc;
}

/* kl__table_acquire of a held key without a cancel token.  Lock held on
 * entry, released on return.  Out of line: the waiter would make the
 * frame of every acquire big. */
static __attribute__((noinline)) int
acquire_held(struct shard *s, uint32_t h, const char *key, size_t len,
	     int64_t deadline_ns, unsigned flags, struct kl__entry **out,
	     uint64_t *fence)
{
	struct kl__waiter w;
	int rc;

	kl__waiter_prepare(&w, &s->lock, NULL);
	rc = take_or_wait(s, h, key, len, &w, deadline_ns, flags, out, fence);
	kl__waiter_finish(&w);
	return rc;
}

/* kl__table_acquire with a cancel token. */
static __attribute__((noinline)) int
acquire_cancellable(struct shard *s, uint32_t h, const char *key, size_t len,
		    int64_t deadline_ns, kl_cancel *c, unsigned flags,
		    struct kl__entry **out, uint64_t *fence)
{
	struct kl__waiter w;
	int rc;

	/* The token's lock comes before the shard's. */
	if ((rc = kl__waiter_prepare(&w, &s->lock, c)) != KL_OK)
		return rc;
	pthread_mutex_lock(&s->lock);
	if (w.state == KL_W_DONE) {
		/* A fire between registering and here settled the waiter
		 * already: once kl_cancel_fire has returned, nothing may be
		 * granted to it. */
		rc = w.status;
		pthread_mutex_unlock(&s->lock);
	} else {
		rc = take_or_wait(s, h, key, len, &w, deadline_ns, flags, out,
				  fence);
	}
	kl__waiter_finish(&w);
	return rc;
}

int
kl__table_acquire(struct kl__table *t, const char *key, size_t len,
		  int64_t deadline_ns, kl_cancel *c, unsigned flags,
		  struct kl__entry **out, uint64_t *fence)
{
	uint32_t h = hash_of(t, key, len);
	struct shard *s = shard_of(t, h);
	struct kl__entry *e;
	uint64_t st;
	int rc;

	*out = NULL;
	*fence = 0;
	if (c != NULL)
		return acquire_cancellable(s, h, key, len, deadline_ns, c,
					   flags, out, fence);
	if (len < INLINE_KEY && fast_acquire(s, h, key, len, out, fence))
		return KL_OK;
	pthread_mutex_lock(&s->lock);
	rc = take_locked(s, h, key, len, &e, &st, fence);
	if (rc == KEY_HELD)
		return acquire_held(s, h, key, len, deadline_ns, flags, out,
				    fence);
	pthread_mutex_unlock(&s->lock);
	if (rc == KL_OK)
		*out = e;
	return rc;
}

/* kl__table_release when the compare-and-swap cannot do: waiters marked,
 * or a chained entry. */
static __attribute__((noinline)) void
release_locked(struct shard *s, struct kl__entry *e)
{
	struct kl__waiter *w;
	void *wake = NULL, *prod = NULL;
	uint64_t st, f;

	pthread_mutex_lock(&s->lock);
	/* Only this lock's holder changes a held word now (a lock-free
	 * taker needs it free, and the caller is the holder), so plain
	 * stores do. */
	st = state_of(e, memory_order_relaxed);
	KL_ASSERT((st & (E_HELD | E_BUSY)) == E_HELD);
	f = fence_of(st);
	if ((w = kl__waitq_grant_head(&e->q)) != NULL) {
		atomic_store_explicit(&e->owner_tid, w->tid,
				      memory_order_relaxed);
		w->data = f + 1;
		atomic_store_explicit(
			&e->state,
			((f + 1) << FENCE_SHIFT) |
				(st & (E_SLOT | E_USED | E_CHAIN)) | E_HELD |
				(e->q.len != 0 ? E_WAITERS : 0),
			memory_order_relaxed);
		wake = kl__waiter_settle(w);
		prod = kl__waitq_prod(&e->q);
		e = NULL;
	} else if (st & E_SLOT) {
		/* Waiters came and went: idle, as after a CAS release. */
		atomic_store_explicit(&e->owner_tid, 0, memory_order_relaxed);
		atomic_store_explicit(&e->state,
				      st & ~(uint64_t)(E_HELD | E_WAITERS),
				      memory_order_release);
		e = NULL;
	} else {
		unchain(s, e, f);
	}
	pthread_mutex_unlock(&s->lock);
	KL_YIELD("free");
	kl__unpark(wake);
	kl__unpark(prod);
	kl__free(e);
}

void
kl__table_release(struct kl__table *t, struct kl__entry *e)
{
	uint64_t st = state_of(e, memory_order_relaxed);

	/* Before a slot is free: a caller with KL_ERRORCHECK that meets its
	 * next holder (who writes its id after taking it) must never see
	 * this thread's id there.  A chained entry's id only changes under
	 * the lock. */
	if (st & E_SLOT)
		atomic_store_explicit(&e->owner_tid, 0, memory_order_relaxed);
	KL_ANNOTATE_HAPPENS_BEFORE(&e->state);
	/* Release order: the next holder, which takes the word with an
	 * acquire, sees what this one wrote.  After it, the slot may be
	 * taken or stolen at once.  A failure means a mark came meanwhile
	 * (E_CHAIN or E_WAITERS): look again. */
	while ((st & (E_SLOT | E_WAITERS)) == E_SLOT)
		if (atomic_compare_exchange_weak_explicit(
			    &e->state, &st, st & ~(uint64_t)E_HELD,
			    memory_order_release, memory_order_relaxed))
			return;
	release_locked(shard_of(t, __atomic_load_n(&e->hash,
						   __ATOMIC_RELAXED)),
		       e);
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

#ifdef KL_TEST_HOOKS
/* GCOVR_EXCL_START: invariant checks of the test build; their failure
 * branches run only on a broken invariant, and users never get them. */
/* Chained entry e of shard i, found in bucket b.  Lock held. */
static int
check_entry(struct kl__table *t, int i, size_t b, struct kl__entry *e)
{
	struct shard *s = &t->shards[i];
	struct kl__entry *slots =
		atomic_load_explicit(&s->slots, memory_order_relaxed);
	char shown[72], what[112];
	uint64_t st, w[2];

	kl__key_printable(shown, sizeof shown, e->key, e->len);
	if (shard_of(t, e->hash) != s ||
	    bucket_of(s, e->hash, e->key, e->len) != b) {
		kl__test_report("shard %d bucket %zu: entry '%s' belongs in "
				"shard %u bucket %zu",
				i, b, shown, (unsigned)(e->hash >> 26),
				bucket_of(s, e->hash, e->key, e->len));
		return KL_EINVAL;
	}
	if (hash_of(t, e->key, e->len) != e->hash || e->key[e->len] != '\0') {
		kl__test_report("shard %d: entry '%s': key bytes changed", i,
				shown);
		return KL_EINVAL;
	}
	for (struct kl__entry *o = e->next; o != NULL; o = o->next)
		if (o->hash == e->hash && o->len == e->len &&
		    memcmp(o->key, e->key, e->len) == 0) {
			kl__test_report("shard %d: key '%s' has two entries",
					i, shown);
			return KL_EINVAL;
		}
	/* Only the lock's holder changes a chained entry's word. */
	st = state_of(e, memory_order_relaxed);
	if ((st & E_FLAGS & ~(uint64_t)E_WAITERS) != E_HELD ||
	    fence_of(st) == 0) {
		kl__test_report("shard %d: chained '%s' has state %#llx", i,
				shown, (unsigned long long)st);
		return KL_EINVAL;
	}
	if (e->q.len > 0 && !(st & E_WAITERS)) {
		kl__test_report("shard %d: entry '%s' has %zu waiters, state "
				"%#llx",
				i, shown, (size_t)e->q.len,
				(unsigned long long)st);
		return KL_EINVAL;
	}
	if (atomic_load_explicit(&e->owner_tid, memory_order_relaxed) == 0) {
		kl__test_report("shard %d: entry '%s' has no holder", i,
				shown);
		return KL_EINVAL;
	}
	if (e->len < INLINE_KEY) {
		struct kl__entry *slot;

		if (slots == NULL) {
			kl__test_report("shard %d: short key '%s' chained "
					"without slots",
					i, shown);
			return KL_EINVAL;
		}
		slot = slot_at(slots, kl__table_slot_of(e->hash));
		st = slot_wait_unbusy(slot);
		key_words(e->key, e->len, w);
		if (!(st & E_CHAIN) ||
		    ((st & E_USED) && slot_has(slot, e->hash, e->len, w))) {
			kl__test_report("shard %d: chained '%s': its slot "
					"has state %#llx%s",
					i, shown, (unsigned long long)st,
					(st & E_CHAIN) ? " and the key too"
						       : "");
			return KL_EINVAL;
		}
	}
	snprintf(what, sizeof what, "shard %d: queue of '%s'", i, shown);
	return kl__waitq_check(&e->q, &s->lock, what);
}

/* Slot j of shard i.  Lock held; a lock-free taker may change the slot
 * meanwhile, so it is read atomically and judged only if it stood still. */
static int
check_slot(struct kl__table *t, int i, unsigned j, struct kl__entry *e)
{
	struct shard *s = &t->shards[i];
	uint64_t st = slot_wait_unbusy(e), w[2], k[2];
	uint32_t h = __atomic_load_n(&e->hash, __ATOMIC_RELAXED);
	uint32_t len = __atomic_load_n(&e->len, __ATOMIC_RELAXED);
	char key[INLINE_KEY], shown[72], what[112];
	size_t qlen = e->q.len;
	bool bad = false;

	k[0] = __atomic_load_n(&slot_words(e)[0], __ATOMIC_RELAXED);
	k[1] = __atomic_load_n(&slot_words(e)[1], __ATOMIC_RELAXED);
	atomic_thread_fence(memory_order_acquire);
	if (state_of(e, memory_order_relaxed) != st)
		return KL_OK;
	memcpy(key, k, sizeof key);
	if (!(st & E_SLOT) || (st & E_BUSY) ||
	    ((st & E_CHAIN) != 0) != (s->nchain[j] != 0)) {
		bad = true;
	} else if (!(st & E_USED)) {
		bad = (st & (E_HELD | E_WAITERS)) || qlen != 0;
	} else {
		key_words(key, len < INLINE_KEY ? len : 0, w);
		bad = len >= INLINE_KEY || w[0] != k[0] || w[1] != k[1] ||
		      shard_of(t, h) != s || kl__table_slot_of(h) != j ||
		      hash_of(t, key, len) != h || fence_of(st) == 0 ||
		      (!(st & E_HELD) && (st & E_WAITERS)) ||
		      (qlen > 0 && !(st & E_WAITERS));
	}
	if (bad) {
		kl__key_printable(shown, sizeof shown, key,
				  len < INLINE_KEY ? len : 0);
		kl__test_report("shard %d slot %u: '%s' (hash %#x) has state "
				"%#llx, %zu waiters, %u chained",
				i, j, shown, (unsigned)h,
				(unsigned long long)st, qlen,
				(unsigned)s->nchain[j]);
		return KL_EINVAL;
	}
	snprintf(what, sizeof what, "shard %d: queue of slot %u", i, j);
	return kl__waitq_check(&e->q, &s->lock, what);
}

/* Shard i.  Lock held. */
static int
check_shard(struct kl__table *t, int i)
{
	struct shard *s = &t->shards[i];
	struct kl__entry *slots =
		atomic_load_explicit(&s->slots, memory_order_relaxed);
	size_t n = 0, nb = s->mask + 1, short_keys[SLOTS] = { 0 };
	int rc = KL_OK;

	for (unsigned j = 0; slots != NULL && j < SLOTS; j++)
		if (check_slot(t, i, j, slot_at(slots, j)) != KL_OK)
			rc = KL_EINVAL;
	if (s->buckets == NULL) {
		if (s->count != 0 || s->mask != 0) {
			kl__test_report("shard %d: no buckets, count %zu, "
					"mask %zu",
					i, s->count, s->mask);
			rc = KL_EINVAL;
		}
		return rc;
	}
	if ((nb & s->mask) != 0 || nb < MIN_BUCKETS || nb > MAX_BUCKETS) {
		kl__test_report("shard %d: %zu buckets", i, nb);
		return KL_EINVAL;
	}
	for (size_t b = 0; b < nb; b++)
		for (struct kl__entry *e = s->buckets[b]; e != NULL;
		     e = e->next) {
			if (++n > s->count) {
				kl__test_report("shard %d: more entries than "
						"its count %zu (or a cycle)",
						i, s->count);
				return KL_EINVAL;
			}
			if (check_entry(t, i, b, e) != KL_OK)
				rc = KL_EINVAL;
			if (e->len < INLINE_KEY)
				short_keys[kl__table_slot_of(e->hash)]++;
		}
	if (n != s->count) {
		kl__test_report("shard %d: %zu entries, count %zu", i, n,
				s->count);
		rc = KL_EINVAL;
	}
	for (unsigned j = 0; j < SLOTS; j++)
		if (short_keys[j] != s->nchain[j]) {
			kl__test_report("shard %d: %zu short keys of slot %u "
					"chained, nchain %u",
					i, short_keys[j], j,
					(unsigned)s->nchain[j]);
			rc = KL_EINVAL;
		}
	return rc;
}

int
kl__table_check(struct kl__table *t)
{
	int rc = KL_OK;

	for (int i = 0; i < NSHARDS; i++) {
		struct shard *s = &t->shards[i];

		pthread_mutex_lock(&s->lock);
		if (check_shard(t, i) != KL_OK)
			rc = KL_EINVAL;
		pthread_mutex_unlock(&s->lock);
	}
	return rc;
}

bool
kl__table_mark_slot(struct kl__table *t, const char *key, size_t len)
{
	uint32_t h = hash_of(t, key, len);
	struct shard *s = shard_of(t, h);
	struct kl__entry *slots, *e;
	uint64_t st = 0;

	pthread_mutex_lock(&s->lock);
	slots = atomic_load_explicit(&s->slots, memory_order_relaxed);
	if (len < INLINE_KEY && slots != NULL) {
		e = slot_at(slots, kl__table_slot_of(h));
		st = slot_wait_unbusy(e);
		/* A mark that was there already is not this call's to take
		 * off. */
		if (!(st & E_CHAIN) && s->nchain[kl__table_slot_of(h)] == 0) {
			while (!slot_mark_chained(e, &st))
				;
			atomic_fetch_and_explicit(&e->state,
						  ~(uint64_t)E_CHAIN,
						  memory_order_relaxed);
		}
	}
	pthread_mutex_unlock(&s->lock);
	return (st & E_HELD) != 0;
}

void
kl__table_skew(struct kl__table *t, long delta)
{
	struct shard *s = &t->shards[0];

	pthread_mutex_lock(&s->lock);
	s->count += (size_t)delta;
	pthread_mutex_unlock(&s->lock);
}
/* GCOVR_EXCL_STOP */
#endif
