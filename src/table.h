/* SPDX-License-Identifier: MIT */
/*
 * The key table: a sharded hash table from key bytes to a wait-queue entry.
 * A short key lives in one of a few slot entries per shard that are never
 * freed, so that a key taken over and over is taken and given back without
 * a lock; other keys live in bucket chains, in entries made on first use
 * and freed once no holder and no waiter remain (see table.c).
 */
#ifndef KL_TABLE_H
#define KL_TABLE_H

#include "internal.h"

struct kl__table;

/* Only table.c touches an entry's fields but key, state and lock; they
 * are here so that the accessors below are inlined.
 * 56 bytes and the key: with a key of up to 15 bytes an entry is one
 * 80-byte malloc chunk, the lease of kl_lock_acquire included (see
 * kl__entry_lock).  A slot entry (see table.c) has the same layout. */
struct kl__entry {
	struct kl__entry *next; /* bucket chain */
	uint32_t hash;          /* the key's hash >> 32: shard and bucket */
	uint32_t len;           /* key bytes */
	struct kl__waitq q;
	/* E_* flags in table.c, and the fence from KL__ENTRY_FENCE_SHIFT */
	atomic_uint_least64_t state;
	atomic_uint_least64_t owner_tid; /* kl__thread_id() of the holder */
	kl_lock *lock; /* for the holder's use: see kl__entry_lock */
	char key[];    /* len bytes and a NUL */
};

#define KL__ENTRY_FENCE_SHIFT 6

#define KL__TABLE_SHARDS 64
/* Slot entries of a shard: a key of up to 15 bytes lives in the slot its
 * hash picks while that slot is not held by another key (see table.c). */
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
/* Acquires key for the caller, waiting in FIFO order until deadline_ns
 * (KL_NO_DEADLINE: forever; a deadline in the past: try once) or c fires.
 * KL_OK with *out (the entry, to pass to release) and *fence (grows with
 * every grant of the key while the entry lives, and across entries: it is
 * taken from the key's shard's counter); KL_ETIMEDOUT, KL_ECANCELED, KL_EDEADLK
 * (flags KL_ERRORCHECK and this thread holds it), KL_ENOMEM. */
KL_HIDDEN int kl__table_acquire(struct kl__table *t, const char *key,
				size_t len, int64_t deadline_ns, kl_cancel *c,
				unsigned flags, struct kl__entry **out,
				uint64_t *fence);
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
/* Holders (0 or 1) and waiters of key. */
KL_HIDDEN int kl__table_status(struct kl__table *t, const char *key,
			       size_t len, size_t *holders, size_t *waiters);
/* Waiters queued on key (0 when the key has no entry). */
KL_HIDDEN size_t kl__table_queue_size(struct kl__table *t, const char *key,
				      size_t len);

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

#endif /* KL_TABLE_H */
