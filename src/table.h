/* SPDX-License-Identifier: MIT */
/*
 * The key table: a sharded hash table from key bytes to a wait-queue entry.
 * A short key lives in one of a few slot entries per shard that are never
 * freed, so that a key taken over and over is taken and given back without
 * a lock; other keys live in bucket chains, in entries made on first use
 * and freed once no holder and no waiter remain (see table_acquire.c).
 */
#ifndef KL_TABLE_H
#define KL_TABLE_H

#include "internal.h"

struct kl__table;

struct kl__entry;

/* A holder of a key taken KL_SHARED (kl__table_acquire_shared).  The
 * caller owns the memory; the table fills it and links it into the key's
 * entry for as long as the key is held, under the shard lock, so that the
 * identities of every shared holder can be read there (errorcheck,
 * snapshots, deadlock detection). */
struct kl__holder {
	struct kl__holder *next, *prev; /* the entry's ring, shard lock */
	struct kl__entry *entry;
	uint64_t tid;     /* kl__thread_id() of the holder */
	int64_t os_tid;   /* its gettid() */
	uint64_t fence;   /* of this grant */
	int64_t since_ns; /* when granted (coarse clock) */
	kl_lock *lock;    /* for the holder's use, as kl__entry_lock */
};

/* Only the table's files touch an entry's fields but key, state and lock;
 * they are here so that the accessors below are inlined.
 * 56 bytes and the key: with a key of up to 15 bytes an entry is one
 * 80-byte malloc chunk, the lease of kl_lock_acquire included (see
 * kl__entry_lock).  A slot entry (see table_acquire.c) has the same
 * layout.
 *
 * Modes: a key is held exclusively (E_HELD, owner_tid its holder, lock
 * its holder's), or shared (E_HELD and E_SOLO or E_SHARED or both): by a
 * lone holder that took the free key without the lock (E_SOLO, named by
 * owner_tid), and by the ring of holder records in shared (E_SHARED), in
 * lock's place (a shared holder's lease is never in the entry).  Only
 * the E_SOLO holder takes or gives back a shared key without the lock, and
 * only while it is alone: whoever joins it marks the word E_WAITERS first,
 * so that the word changes under the lock only from then on. */
struct kl__entry {
	union {
		struct kl__entry *next; /* bucket chain (chained entries) */
		/* A slot (never chained) held by a lone shared holder
		 * (E_SOLO): a word for that holder's use until it gives
		 * the key back (kl__entry_solo). */
		kl_lock *solo;
	};
	uint32_t hash;          /* the key's hash >> 32: shard and bucket */
	uint32_t len;           /* key bytes */
	struct kl__waitq q;
	/* E_* flags (below), and the fence from KL__ENTRY_FENCE_SHIFT */
	atomic_uint_least64_t state;
	atomic_uint_least64_t owner_tid; /* kl__thread_id() of the holder */
	union {
		/* Held exclusively: for the holder's use (kl__entry_lock). */
		kl_lock *lock;
		/* Held shared (E_SHARED): its holders, a ring, the oldest
		 * first.  Shard lock. */
		struct kl__holder *shared;
	};
	char key[]; /* len bytes and a NUL */
};

#define KL__ENTRY_FENCE_SHIFT 8

#define KL__TABLE_SHARDS 64
/* Slot entries of a shard: a key of up to 15 bytes lives in the slot its
 * hash picks while that slot is not held by another key (see
 * table_acquire.c). */
#define KL__TABLE_SLOTS 4

/* The slot of a key with hash h (kl__table_hash) in its shard: the bits
 * below the shard's. */
static inline unsigned
kl__table_slot_of(uint32_t h)
{
	return (h >> 23) & (KL__TABLE_SLOTS - 1);
}

struct kl__table_stats {
	size_t entries;    /* keys held (waited for only when held) */
	size_t idle;       /* slots that keep a key nobody holds */
	size_t chained;    /* keys held in bucket chains, not in slots */
	size_t buckets;    /* buckets over all shards */
	size_t max_chain;  /* longest bucket chain now */
	uint64_t lookups;  /* lookups since the table was made */
	uint64_t probes;   /* entries compared during those lookups */
	size_t strong;     /* shards that index buckets by SipHash */
};

KL_HIDDEN int kl__table_new(struct kl__table **out);
/* The table of the process-wide memory provider, made on first use. */
KL_HIDDEN struct kl__table *kl__table_shared(void);
/* No entry may be live. */
KL_HIDDEN void kl__table_free(struct kl__table *t);
/* Acquires key for the caller exclusively (flags' KL_SHARED is ignored:
 * see kl__table_acquire_shared), waiting in FIFO order until deadline_ns
 * (KL_NO_DEADLINE: forever; a deadline in the past: try once) or c fires.
 * KL_OK with *out (the entry, to pass to release) and *fence (grows with
 * every grant of the key while the entry lives, and across entries: it is
 * taken from the key's shard's counter); KL_ETIMEDOUT, KL_ECANCELED, KL_EDEADLK
 * (flags KL_ERRORCHECK and this thread holds it; or the wait closed a cycle
 * of waits, deadlock.c, and kl__deadlock_take says which), KL_ENOMEM. */
KL_HIDDEN int kl__table_acquire(struct kl__table *t, const char *key,
				size_t len, int64_t deadline_ns, kl_cancel *c,
				unsigned flags, struct kl__entry **out,
				uint64_t *fence);
/* kl__table_acquire for a shared holder h (memory of the caller's, valid
 * until kl__table_release_shared(t, h) has returned): the key is granted
 * when nobody holds it exclusively and nobody waits before (W3C Web Locks'
 * rule; see table_acquire.c).  Same statuses; KL_EDEADLK with
 * KL_ERRORCHECK when this thread holds the key in either mode. */
KL_HIDDEN int kl__table_acquire_shared(struct kl__table *t, const char *key,
				       size_t len, int64_t deadline_ns,
				       kl_cancel *c, unsigned flags,
				       struct kl__holder *h, uint64_t *fence);
KL_HIDDEN void kl__table_release_shared(struct kl__table *t,
					struct kl__holder *h);
/* The shared take without the lock: a key of up to 15 bytes that nobody
 * holds or waits for is taken shared by the caller alone (E_SOLO), the
 * entry standing for its holder, as an exclusive take does.  False when
 * that does not do: kl__table_acquire_shared then.  Given back with
 * kl__table_release_solo. */
KL_HIDDEN bool kl__table_acquire_solo(struct kl__table *t, const char *key,
				      size_t len, struct kl__entry **out,
				      uint64_t *fence);
KL_HIDDEN void kl__table_release_solo(struct kl__table *t,
				      struct kl__entry *e);
/* kl__table_release_solo for a caller that no longer knows the table:
 * the slot finds its shard itself. */
KL_HIDDEN void kl__table_release_solo_slot(struct kl__entry *e);
/* Calls fn once per holder and waiter of every key, as
 * kl_provider_snapshot says, with no lock held: each shard's entries are
 * copied under its lock first.  KL_OK or KL_ENOMEM. */
KL_HIDDEN int kl__table_snapshot(struct kl__table *t, kl_snapshot_fn fn,
				 void *arg);
/* The entry of a held key, for its holder: the key (NUL-terminated), the
 * holder's fence, and a word the holder may use as it likes until it
 * releases (lock.c keeps the lease of kl_lock_acquire there, so that a held
 * key costs one allocation).  kl__entry_of_lock is the inverse of
 * kl__entry_lock. */
static inline const char *
kl__entry_key(const struct kl__entry *e)
{
	return e->key;
}

static inline uint64_t
kl__entry_fence(struct kl__entry *e)
{
	return atomic_load_explicit(&e->state, memory_order_relaxed) >>
	       KL__ENTRY_FENCE_SHIFT;
}

static inline kl_lock **
kl__entry_lock(struct kl__entry *e)
{
	return &e->lock;
}

static inline struct kl__entry *
kl__entry_of_lock(kl_lock **word)
{
	return (struct kl__entry *)(void *)((char *)word -
					    offsetof(struct kl__entry, lock));
}
/* The word of the lone shared holder of slot e (kl__table_acquire_solo),
 * for its use until it releases: the union word of the entry may hold the
 * ring of those who join it, and the fence in the state word moves with
 * their grants (lock.c keeps the fence of the lone holder's grant here,
 * so that its lease needs no allocation).  kl__entry_of_solo is the
 * inverse. */
static inline kl_lock **
kl__entry_solo(struct kl__entry *e)
{
	return &e->solo;
}

static inline struct kl__entry *
kl__entry_of_solo(kl_lock **word)
{
	return (struct kl__entry *)(void *)((char *)word -
					    offsetof(struct kl__entry, solo));
}

/* The holder record whose lock member is word (the inverse of
 * &h->lock). */
static inline struct kl__holder *
kl__holder_of_lock(kl_lock **word)
{
	return (struct kl__holder *)(void *)((char *)word -
					     offsetof(struct kl__holder, lock));
}

/* Hands the key to the next waiter, or leaves the entry idle or frees it
 * when none waits. */
KL_HIDDEN void kl__table_release(struct kl__table *t, struct kl__entry *e);
KL_HIDDEN size_t kl__table_size(struct kl__table *t);
KL_HIDDEN void kl__table_stats(struct kl__table *t,
			       struct kl__table_stats *out);
/* The 32 bits of key's hash that t keeps: the top 6 pick the shard, the
 * next ones the slot (kl__table_slot_of), the low ones the bucket (for
 * tests that fill one shard, slot or bucket). */
KL_HIDDEN uint32_t kl__table_hash(const struct kl__table *t, const char *key,
				  size_t len);
/* Holders (0, 1 or, held shared, every one) and waiters of key. */
KL_HIDDEN int kl__table_status(struct kl__table *t, const char *key,
			       size_t len, size_t *holders, size_t *waiters);
/* Waiters queued on key (0 when the key has no entry). */
KL_HIDDEN size_t kl__table_queue_size(struct kl__table *t, const char *key,
				      size_t len);

/* One holder of a key, for the deadlock detector (deadlock.c): the thread
 * that took it (kl__thread_id) and its grant, a number the key never gives
 * to two grants (today its fence), so that a holder seen with the same
 * grant twice held the key all along in between. */
typedef void kl__holder_fn(void *arg, uint64_t tid, uint64_t grant);
/* While w waits in the queue of a key (KL_W_WAITING, read under w->lock,
 * which this takes and drops): calls fn once for each holder of the key,
 * with the lock held (fn takes no lock), writes a printable form of the
 * key to shown (size bytes; not when NULL) and returns true.  False,
 * calling nothing, once w no longer waits.  The one place that knows who
 * holds a key: the exclusive holder, a lone shared one (E_SOLO), and
 * every holder record of the shared ring. */
KL_HIDDEN bool kl__table_waited_holders(struct kl__waiter *w,
					kl__holder_fn *fn, void *arg,
					char *shown, size_t size);

/*
 * deadlock.c: the waits-for graph of the tables' waiters.  A waiter of a
 * key arms its wait (kl__deadlock_arm, before kl__waitq_wait): when
 * detection is on, the wait queue calls the detector once the wait has
 * lasted the process's deadlock_ms, and again every deadlock_ms after
 * that.  Only then does the waiter register in the graph and walk it.
 * kl__deadlock_disarm, after the wait, unregisters it; both cost a branch
 * or two while the wait stays shorter.  The record lives on the waiting
 * thread's stack, beside its waiter, and must outlive disarm.
 */
struct kl__dl_wait {
	struct kl__dl_wait *next, *prev; /* the registry (detector's lock) */
	struct kl__waiter *w;
	bool registered; /* written under the detector's lock by its thread */
	bool victim;     /* its thread's own: the detector chose it */
	/* A walk's scratch (detector's lock). */
	uint64_t walk;   /* the walk that reached it */
	struct kl__dl_wait *from, *to; /* the path: who waits for its key */
	uint64_t grant;  /* the grant by which it holds from's key */
};

/* Readies dw for w; sets w's check when detection is on. */
KL_HIDDEN void kl__deadlock_arm(struct kl__dl_wait *dw, struct kl__waiter *w);
KL_HIDDEN void kl__deadlock_leave(struct kl__dl_wait *dw, int rc);
/* After the wait, whose outcome is rc: takes dw out of the graph if it is
 * in it (a victim granted after all forgets why it was chosen). */
static inline void
kl__deadlock_disarm(struct kl__dl_wait *dw, int rc)
{
	if (__builtin_expect(dw->registered || dw->victim, 0))
		kl__deadlock_leave(dw, rc);
}

#ifdef KL_TEST_HOOKS
/* Checks every shard of t under its lock: bucket array shape, each chained
 * entry in its hash's shard and bucket, its hash matching its key, no key
 * twice (in a chain, or in a chain and its slot), every state word valid
 * and consistent with its queue, slot marks matching the chained keys of
 * each slot, the count matching the chains, every queue consistent
 * (kl__waitq_check).  KL_OK or KL_EINVAL after reporting to stderr. */
KL_HIDDEN int kl__table_check(struct kl__table *t);
/* Sets and takes off again the E_CHAIN mark of key's slot the way a key
 * chained beside it would, whatever the slot's word: on a slot that is not
 * held, the KL_ASSERT of that invariant fires (see kl__test_assert_record).
 * Returns whether the slot was held.  Only while no other thread uses t. */
KL_HIDDEN bool kl__table_mark_slot(struct kl__table *t, const char *key,
				   size_t len);
/* See kl__test_table_skew. */
KL_HIDDEN void kl__table_skew(struct kl__table *t, long delta);
#endif

#ifdef KL__TABLE_PRIVATE
/*
 * Shared by the table's files only (table.c, table_acquire.c,
 * table_check.c), which define KL__TABLE_PRIVATE before including this
 * header: the layout of a shard, the state word, the hash, and the reads
 * of slots and chains that the lock-free path and the locked one both
 * make.  Inline here, so that kl__table_acquire's lock-free take
 * (table_acquire.c, with the swaps it calls) still compiles to one
 * function without a call out of its file, as it did before the split.
 */
#include <sched.h>
#include <string.h>

#include "annotate.h"

#define NSHARDS KL__TABLE_SHARDS
#define SLOTS KL__TABLE_SLOTS
#define MIN_BUCKETS 8
/* Key bytes (NUL included) every slot has room for; shorter keys of a
 * chained entry get as much, so that its malloc chunk is the same 80
 * bytes a held slot stands for. */
#define INLINE_KEY 16
#define SLOT_SIZE (sizeof(struct kl__entry) + INLINE_KEY)
/* A shard's slots, and after them the shard they belong to (slot_shard):
 * a slots_tail, 8-aligned as the slots are. */
struct slots_tail {
	struct shard *shard;
};
#define SLOTS_BYTES (SLOTS * SLOT_SIZE + sizeof(struct slots_tail))
/* The state word of an entry. */
#define E_HELD 1u    /* a holder has the key */
#define E_WAITERS 2u /* a waiter may be queued: release under the lock */
#define E_SLOT 4u    /* a slot entry, for good */
#define E_USED 8u    /* slot: has a key */
#define E_CHAIN 16u  /* slot: a chained key may have its index */
#define E_BUSY 32u   /* slot: a stealer is writing its key */
#define E_SHARED 64u /* held shared, the ring valid: see struct kl__entry */
#define E_SOLO 128u  /* held shared by the entry's own holder (owner_tid) */
#define E_FLAGS 255u
#define FENCE_SHIFT KL__ENTRY_FENCE_SHIFT
#define FENCE_ONE ((uint64_t)1 << FENCE_SHIFT)

_Static_assert(E_FLAGS < FENCE_ONE, "flags below the fence");
_Static_assert(SLOT_SIZE % 8 == 0, "slots stay aligned for their words");
_Static_assert((SLOTS & (SLOTS - 1)) == 0 && SLOTS <= 8,
	       "kl__table_slot_of takes up to 3 bits");

struct shard {
	pthread_mutex_t lock;
	/* Threads in pthread_mutex_lock on it (shard_lock): a hint */
	atomic_uint sleepers;
	/* SLOTS slot entries of SLOT_SIZE bytes, made under the lock and
	 * read without it. */
	_Atomic(struct kl__entry *) slots;
	struct kl__entry **buckets;
	uint32_t nchain[SLOTS]; /* chained short keys of each slot index */
	/* The largest fence a chained key of each slot index had when it
	 * went: the slot's next key starts above it (see table_acquire.c).
	 * Written under the lock, read atomically by stealers. */
	uint64_t floor[SLOTS];
	size_t count;           /* chained entries */
	size_t mask;            /* buckets - 1; 0 while no bucket array */
	uint64_t fence;         /* long keys' fences: see table_acquire.c */
	uint64_t lookups, probes;
	/* Buckets by SipHash (see hash_of), keyed with sk. */
	bool strong;
	uint64_t sk[2];
} __attribute__((aligned(KL__CACHE_LINE)));

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

static inline struct shard *
shard_of(struct kl__table *t, uint32_t h)
{
	return &t->shards[h >> 26];
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
/* Slots: the reads the lock-free path and the locked one share */

static inline struct kl__entry *
slot_at(struct kl__entry *slots, unsigned i)
{
	return (struct kl__entry *)(void *)((char *)slots + i * SLOT_SIZE);
}

/* The tail of the slots that begin at slots. */
static inline struct slots_tail *
slots_tail_of(struct kl__entry *slots)
{
	return (struct slots_tail *)(void *)((char *)slots +
					     SLOTS * SLOT_SIZE);
}

/* The shard of slot e, which holds a key (its hash stays while it is
 * held): written after the slots when they were made. */
static inline struct shard *
slot_shard(struct kl__entry *e)
{
	unsigned i = kl__table_slot_of(__atomic_load_n(&e->hash,
						       __ATOMIC_RELAXED));

	return slots_tail_of((struct kl__entry *)(void *)((char *)e -
							  i * SLOT_SIZE))
		->shard;
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

/* The word of slot e once no stealer is writing it (E_BUSY clear), with
 * acquire order.  Lock held; a stealer never takes it, so waiting with it
 * held cannot deadlock.  Not the waiter's outcome (waitq.c,
 * outcome_published): this waits out a lock-free writer of a slot. */
static inline uint64_t
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
static inline int
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
	/* The acquire in slot_wait_unbusy: a key given back by CAS and then
	 * taken under the lock in a chain (its slot taken over meanwhile)
	 * must see what its last holder wrote, and the slot's word is the only
	 * thing between them. */
	KL_ANNOTATE_HAPPENS_AFTER(&e->state);
	return has;
}

/* ------------------------------------------------------------------ */
/* Waiters: every waiter of a key is one of these, on its thread's stack. */

struct twaiter {
	struct kl__waiter w;
	struct kl__holder *h; /* NULL: wants the key exclusively */
	int64_t os_tid;       /* gettid() of the waiting thread */
};

static inline struct twaiter *
twaiter_of(struct kl__waiter *w)
{
	return (struct twaiter *)(void *)((char *)w -
					  offsetof(struct twaiter, w));
}

/* The shared holders of e, found in word st: the ring, or NULL when the
 * key is held exclusively or free.  Lock held. */
static inline struct kl__holder *
shared_of(const struct kl__entry *e, uint64_t st)
{
	return (st & (E_HELD | E_SHARED)) == (E_HELD | E_SHARED) ? e->shared
								 : NULL;
}

/* Whether word st says its key is held shared. */
static inline bool
held_shared(uint64_t st)
{
	return (st & E_HELD) && (st & (E_SHARED | E_SOLO));
}

/* Holders of e, found in word st.  Lock held. */
static inline size_t
holder_count(const struct kl__entry *e, uint64_t st)
{
	const struct kl__holder *h = shared_of(e, st);
	size_t n = (st & E_SOLO) ? 1 : 0;

	if (!(st & E_HELD))
		return 0;
	if (!held_shared(st))
		return 1;
	if (h != NULL)
		do {
			n++;
			h = h->next;
		} while (h != e->shared);
	return n;
}

/* ------------------------------------------------------------------ */
/* Chains (table.c) */

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

/* Readies the bucket array of s for one more chained entry, whose bucket
 * holds chain entries (find): grows it, or makes the shard index its
 * buckets by SipHash.  KL_OK, or KL_ENOMEM when s had no array and none
 * could be made.  Lock held.  chain_room calls it only when there is
 * something to do. */
KL_HIDDEN int kl__chain_grow(struct shard *s, size_t chain);
/* Halves the bucket array of s while it is a quarter full, down to
 * MIN_BUCKETS.  Lock held. */
KL_HIDDEN void kl__chain_shrink(struct shard *s);

static inline int
chain_room(struct shard *s, size_t chain)
{
	if (s->buckets != NULL && s->count < s->mask + 1 &&
	    (s->strong || chain < CHAIN_LIMIT))
		return KL_OK;
	return kl__chain_grow(s, chain);
}
#endif /* KL__TABLE_PRIVATE */

#endif /* KL_TABLE_H */
