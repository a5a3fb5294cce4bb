/* SPDX-License-Identifier: MIT */
/*
 * The key table behind the memory provider.
 *
 * 64 shards, each a cache-line aligned mutex with its own chained hash table
 * that grows and shrinks by itself, so a resize stops one shard, never the
 * world.  The shard mutex is also the lock of every wait queue in the shard:
 * an entry's hand-off and its removal are decided under one lock.
 *
 * Entries are made on first use.  A release that leaves a key with no
 * holder and no waiter either leaves its entry linked and free ("idle":
 * the key was taken while its shard had at most SMALL entries, see E_CAS
 * below) or unlinks it.  Idle entries cost a small shard little memory and
 * save the work that made them: a key taken again finds its entry, and a
 * new key takes over an idle entry it meets in its bucket, or one from the
 * shard's stash of unlinked ones.  A shard has at most SMALL idle
 * entries, so memory follows the keys held.  When a shard of SMALL to
 * SWEEP_MAX entries grows (at SMALL, and again at twice the count the last
 * sweep left), an insert first sweeps its idle entries out, so that a shard
 * whose keys come and go stays small; a shard that shrinks through
 * SWEEP_MAX is swept too, so that a table whose keys all go returns to
 * about its first size.
 *
 * An entry's state word (E_HELD, E_CAS, E_WAITERS, in the wait queue's
 * user word) changes under the shard lock, with one exception: the holder
 * of an entry taken while its shard was small (E_CAS) and not marked by a
 * waiter gives the key back with one compare-and-swap, HELD|CAS -> free,
 * without the lock (and without even finding the shard).  An entry only
 * gets E_CAS while its shard has at most SMALL entries linked, and keeps
 * it, or turns idle, while linked: so a shard's entries that are idle or
 * hold E_CAS never number more than SMALL, however big it grows
 * (kl__table_check checks it).  Everything else is
 * written so that this CAS cannot succeed when the lock-holder relies on
 * the word staying put: a waiter sets E_WAITERS (by CAS, as the holder may
 * be releasing) before it queues, and only a release under the lock clears
 * it.  A stale E_WAITERS (its waiter timed out) only sends the next release
 * through the lock, which finds nobody to hand to.  Nothing changes a free
 * entry but the lock's holder, so acquirers, sweeps and reuse act on free
 * entries under the lock; after its CAS, a releaser never touches the entry
 * again.
 * Waiters queue only on a held key.  A waiter that times out or is cancelled
 * only unlinks itself; the key is still held then, so it never has to free
 * anything, and after failing it never touches the entry again (a release
 * may free it at once).
 *
 * Keys are hashed with a keyed multiply-fold hash (see hash_of; SipHash for
 * the buckets of a shard that meets a long chain); the top bits pick the
 * shard, the low bits the bucket.
 */
#include "config.h"

#include <string.h>

#include "annotate.h"
#include "table.h"

#define NSHARDS KL__TABLE_SHARDS
#define MIN_BUCKETS 8
#define SMALL KL__TABLE_SMALL
#define SWEEP_MAX ((size_t)KL__TABLE_SWEEP_MAX)
/* Key bytes (NUL included) every entry has room for: entries of keys that
 * fit are all one size, so any of them can take another such key. */
#define INLINE_KEY 16
/* Unlinked entries a shard keeps for its next inserts.  AddressSanitizer
 * builds keep none, so that a use after a free is reported instead of
 * landing in the stash. */
#if defined(__SANITIZE_ADDRESS__)
#define STASH_MAX 0
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define STASH_MAX 0
#endif
#endif
#ifndef STASH_MAX
#define STASH_MAX 2
#endif

/* The state word of an entry (its q.user); 0 is free. */
#define E_HELD 1u    /* a holder has the key */
#define E_WAITERS 2u /* a waiter may be queued: release under the lock */
#define E_CAS 4u     /* with E_HELD: taken in a small shard, see above */

struct shard {
	pthread_mutex_t lock;
	struct kl__entry **buckets;
	/* Unlinked entries with room for an inline-sized key, chained
	 * through next: an insert takes one before it allocates. */
	struct kl__entry *stash;
	unsigned nstash;
	/* Linked entries, idle ones included.  Written under the lock; read
	 * without it by releasers, which give a key back by CAS only while
	 * the shard is small. */
	atomic_size_t count;
	size_t swept; /* the count a sweep left: see insert */
	size_t mask;  /* buckets - 1; 0 while no bucket array exists */
	uint64_t fence;
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

static size_t
count_of(struct shard *s)
{
	return atomic_load_explicit(&s->count, memory_order_relaxed);
}

/* Lock held. */
static void
set_count(struct shard *s, size_t n)
{
	atomic_store_explicit(&s->count, n, memory_order_relaxed);
}

static unsigned
state_of(struct kl__entry *e, memory_order mo)
{
	return atomic_load_explicit(&e->q.user, mo);
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
		KL_ANNOTATE_ATOMIC(&s->count);
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
		struct kl__entry *e, *next;

		/* Only idle entries are still linked. */
		for (size_t b = 0; s->buckets != NULL && b <= s->mask; b++)
			for (e = s->buckets[b]; e != NULL; e = next) {
				next = e->next;
				kl__free(e);
			}
		for (e = s->stash; e != NULL; e = next) {
			next = e->next;
			kl__free(e);
		}
		pthread_mutex_destroy(&s->lock);
		kl__free(s->buckets);
	}
	kl__free(t);
}

/* An entry keeps 32 bits of its key's hash: the top 6 pick the shard, the
 * low ones the bucket (a shard never grows past MAX_BUCKETS, so the two
 * never overlap). */
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

/* What a lookup that found no entry saw of the key's bucket. */
struct miss {
	struct kl__entry *reuse; /* an idle entry that can take the key */
	size_t chain;            /* the bucket's entries */
};

/* The entry of key, or NULL.  With m, what the bucket offers a new entry:
 * an idle entry that can take the key over (both inline-sized), if any,
 * and its length.  Lock held. */
static inline __attribute__((always_inline)) struct kl__entry *
find(struct shard *s, uint32_t h, const char *key, size_t len,
     struct miss *m)
{
	struct kl__entry *e;
	size_t n = 0;

	s->lookups++;
	if (s->buckets == NULL)
		return NULL;
	for (e = s->buckets[bucket_of(s, h, key, len)]; e != NULL;
	     e = e->next) {
		n++;
		if (e->hash == h && e->len == len &&
		    same_bytes(e->key, key, len))
			break;
		if (m != NULL && m->reuse == NULL && len < INLINE_KEY &&
		    e->len < INLINE_KEY &&
		    state_of(e, memory_order_acquire) == 0)
			m->reuse = e;
	}
	s->probes += n;
	if (m != NULL)
		m->chain = n;
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
 * only key comes and goes keeps its small array instead of allocating it
 * on every acquire.  Lock held. */
static void
maybe_shrink(struct shard *s)
{
	size_t n = count_of(s);

	while (s->mask + 1 > MIN_BUCKETS && n < (s->mask + 1) / 4) {
		if (!rehash(s, (s->mask + 1) / 2))
			break; /* out of memory: stay as is */
	}
}

/* What to free of e, just unlinked: nothing when the stash takes it. */
static struct kl__entry *
to_stash(struct shard *s, struct kl__entry *e)
{
	if (s->nstash < STASH_MAX && e->len < INLINE_KEY) {
		e->next = s->stash;
		s->stash = e;
		s->nstash++;
		return NULL;
	}
	return e;
}

/* Unlinks every idle entry of s.  Lock held: idle entries do not change
 * under it, and the acquire load pairs with the CAS that freed each. */
static void
sweep(struct shard *s)
{
	size_t n = count_of(s);

	for (size_t b = 0; s->buckets != NULL && b <= s->mask; b++) {
		struct kl__entry **pp = &s->buckets[b], *e;

		while ((e = *pp) != NULL) {
			if (state_of(e, memory_order_acquire) != 0) {
				pp = &e->next;
				continue;
			}
			KL_ANNOTATE_HAPPENS_AFTER(&e->q.user);
			*pp = e->next;
			n--;
			kl__free(to_stash(s, e));
		}
	}
	set_count(s, n);
	s->swept = n;
	maybe_shrink(s);
}

/* Links a new entry for key, held by the caller; chain is the length of
 * its bucket.  Lock held. */
static int
insert(struct shard *s, uint32_t h, const char *key, size_t len,
       size_t chain, struct kl__entry **out)
{
	struct kl__entry *e;
	size_t b, n = count_of(s);

	/* A shard has at most SMALL idle entries (see above), so only
	 * one of up to SWEEP_MAX entries is swept: at SMALL, and then at
	 * twice what each sweep left, so that sweeps cost each insert O(1)
	 * over time. */
	if (n >= SMALL && n < SWEEP_MAX && n >= 2 * s->swept) {
		sweep(s);
		n = count_of(s);
		chain = 0; /* shorter now, if anything */
	}
	if (s->buckets == NULL) {
		if (!rehash(s, MIN_BUCKETS))
			return KL_ENOMEM;
	} else if (n >= s->mask + 1 && s->mask + 1 < MAX_BUCKETS) {
		rehash(s, (s->mask + 1) * 2);
	} else {
		check_chain(s, chain);
	}
	if (len < INLINE_KEY && s->stash != NULL) {
		e = s->stash;
		s->stash = e->next;
		s->nstash--;
	} else if (len >= UINT32_MAX || len > SIZE_MAX - sizeof *e - 1 ||
		   (e = kl__malloc(sizeof *e + (len < INLINE_KEY
							? INLINE_KEY
							: len + 1))) == NULL) {
		return KL_ENOMEM;
	}
	e->hash = h;
	e->len = (uint32_t)len;
	kl__waitq_init(&e->q, &s->lock);
	KL_ANNOTATE_ATOMIC(&e->q.user);
	atomic_store_explicit(&e->q.user,
			      n + 1 <= SMALL ? E_HELD | E_CAS : E_HELD,
			      memory_order_relaxed);
	e->owner_tid = kl__thread_id();
	e->lock = NULL;
	memcpy(e->key, key, len);
	e->key[len] = '\0';
	b = bucket_of(s, h, key, len);
	e->next = s->buckets[b];
	s->buckets[b] = e;
	set_count(s, n + 1);
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
	set_count(s, count_of(s) - 1);
	if (s->swept > count_of(s))
		s->swept = count_of(s);
	maybe_shrink(s);
}

/* The state word of an entry just taken.  Lock held. */
static inline unsigned
held_word(struct shard *s)
{
	return count_of(s) <= SMALL ? E_HELD | E_CAS : E_HELD;
}

/* Takes e, free, for the caller (with key, when e is an idle entry of
 * another key that takes it over).  Lock held: nothing else changes a free
 * entry then.  The caller found it free with an acquire load, which pairs
 * with the releaser's CAS, so the last holder's writes are visible. */
static inline __attribute__((always_inline)) void
take_free(struct shard *s, struct kl__entry *e, uint32_t h, const char *key,
	  size_t len, struct kl__entry **out, uint64_t *fence)
{
	KL_ANNOTATE_HAPPENS_AFTER(&e->q.user);
	if (key != NULL) {
		e->hash = h;
		e->len = (uint32_t)len;
		memcpy(e->key, key, len);
		e->key[len] = '\0';
	}
	e->owner_tid = kl__thread_id();
	e->lock = NULL;
	*fence = e->fence = ++s->fence;
	atomic_store_explicit(&e->q.user, held_word(s), memory_order_relaxed);
	*out = e;
}

/* Takes a key with no entry for the caller: an idle entry of its bucket
 * taken over, or a new one.  Lock held. */
static int
take_new(struct shard *s, uint32_t h, const char *key, size_t len,
	 const struct miss *m, struct kl__entry **out, uint64_t *fence)
{
	struct kl__entry *e;
	int rc;

	if (m->reuse != NULL) {
		take_free(s, m->reuse, h, key, len, out, fence);
		return KL_OK;
	}
	if ((rc = insert(s, h, key, len, m->chain, &e)) == KL_OK) {
		*out = e;
		*fence = e->fence = ++s->fence;
	}
	return rc;
}

/* Marks e as waited for before a waiter queues, so that its holder
 * releases through the lock.  Lock held.  Returns false when the holder
 * gave the key back meanwhile. */
static bool
mark_waiting(struct kl__entry *e)
{
	unsigned v = state_of(e, memory_order_acquire);

	/* Acquire on failure too: a key found free is taken (take_free). */
	while (v & E_HELD) {
		if ((v & E_WAITERS) ||
		    atomic_compare_exchange_weak_explicit(
			    &e->q.user, &v, v | E_WAITERS,
			    memory_order_acquire, memory_order_acquire))
			return true;
	}
	return false;
}

/* Whether a caller that finds e held must fail rather than wait: KL_EDEADLK,
 * KL_ETIMEDOUT, or KL_OK to wait.  Lock held. */
static int
refusal(const struct kl__entry *e, int64_t deadline_ns, unsigned flags)
{
	if ((flags & KL_ERRORCHECK) && e->owner_tid == kl__thread_id())
		return KL_EDEADLK;
	if (deadline_ns != KL_NO_DEADLINE && kl__now_ns() >= deadline_ns)
		return KL_ETIMEDOUT;
	return KL_OK;
}

/* Waits as w (prepared) for e, found held.  Lock held on entry, released
 * on return. */
static int
wait_held(struct shard *s, struct kl__entry *e, struct kl__waiter *w,
	  int64_t deadline_ns, unsigned flags, struct kl__entry **out,
	  uint64_t *fence)
{
	int rc;

	if ((rc = refusal(e, deadline_ns, flags)) != KL_OK) {
		pthread_mutex_unlock(&s->lock);
		return rc;
	}
	if (!mark_waiting(e)) {
		take_free(s, e, 0, NULL, 0, out, fence);
		pthread_mutex_unlock(&s->lock);
		return KL_OK;
	}
	rc = kl__waitq_wait(&e->q, w, deadline_ns, KL_UNBOUNDED,
			    KL_OVERFLOW_THIS);
	if (rc == KL_OK) {
		*out = e;
		*fence = w->data;
	}
	return rc;
}

/* kl__table_acquire of a held key without a cancel token.  Lock held on
 * entry, released on return.  Out of line: the waiter would make the
 * frame of every acquire big. */
static __attribute__((noinline)) int
acquire_held(struct shard *s, struct kl__entry *e, int64_t deadline_ns,
	     unsigned flags, struct kl__entry **out, uint64_t *fence)
{
	struct kl__waiter w;
	int rc;

	kl__waiter_prepare(&w, &s->lock, NULL);
	rc = wait_held(s, e, &w, deadline_ns, flags, out, fence);
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
	struct miss m = { NULL, 0 };
	struct kl__entry *e;
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
	} else if ((e = find(s, h, key, len, &m)) == NULL) {
		rc = take_new(s, h, key, len, &m, out, fence);
		pthread_mutex_unlock(&s->lock);
	} else if (!(state_of(e, memory_order_acquire) & E_HELD)) {
		take_free(s, e, 0, NULL, 0, out, fence);
		rc = KL_OK;
		pthread_mutex_unlock(&s->lock);
	} else {
		rc = wait_held(s, e, &w, deadline_ns, flags, out, fence);
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
	struct miss m = { NULL, 0 };
	struct kl__entry *e;
	int rc = KL_OK;

	*out = NULL;
	*fence = 0;
	if (c != NULL)
		return acquire_cancellable(s, h, key, len, deadline_ns, c,
					   flags, out, fence);
	pthread_mutex_lock(&s->lock);
	if ((e = find(s, h, key, len, &m)) == NULL)
		rc = take_new(s, h, key, len, &m, out, fence);
	else if (!(state_of(e, memory_order_acquire) & E_HELD))
		take_free(s, e, 0, NULL, 0, out, fence);
	else
		return acquire_held(s, e, deadline_ns, flags, out, fence);
	pthread_mutex_unlock(&s->lock);
	return rc;
}

/* kl__table_release when the CAS cannot do: waiters marked, or a big
 * shard. */
static __attribute__((noinline)) void
release_locked(struct shard *s, struct kl__entry *e)
{
	struct kl__waiter *w;
	void *wake = NULL;

	pthread_mutex_lock(&s->lock);
	/* Only this lock's holder changes the word now: a releaser's CAS
	 * needs HELD|CAS alone, and the caller is the holder. */
	if ((w = kl__waitq_grant_head(&e->q)) != NULL) {
		e->owner_tid = w->tid;
		w->data = e->fence = ++s->fence;
		atomic_store_explicit(&e->q.user,
				      held_word(s) |
					      (e->q.len != 0 ? E_WAITERS : 0),
				      memory_order_relaxed);
		wake = kl__waiter_settle(w);
		e = NULL;
	} else {
		/* Given back through the lock: taken in a big shard, or
		 * waiters came and went.  Not worth keeping idle. */
		unlink_entry(s, e);
		e = to_stash(s, e);
		/* A shard shrinking through SWEEP_MAX drops the idle
		 * entries its E_CAS holders left while it was big. */
		if (count_of(s) == SWEEP_MAX)
			sweep(s);
	}
	pthread_mutex_unlock(&s->lock);
	KL_YIELD("free");
	kl__unpark(wake);
	kl__free(e);
}

void
kl__table_release(struct kl__table *t, struct kl__entry *e)
{
	unsigned st = E_HELD | E_CAS;

	KL_ANNOTATE_HAPPENS_BEFORE(&e->q.user);
	/* Release order: the next holder, which loads the word under the
	 * shard lock, sees what this one wrote.  After it, e may be taken
	 * over or freed. */
	if (atomic_compare_exchange_strong_explicit(&e->q.user, &st, 0,
						    memory_order_release,
						    memory_order_relaxed))
		return;
	release_locked(shard_of(t, e->hash), e);
}

/* Held and idle entries of s.  Lock held. */
static void
count_entries(struct shard *s, size_t *held, size_t *idle)
{
	for (size_t b = 0; s->buckets != NULL && b <= s->mask; b++)
		for (struct kl__entry *e = s->buckets[b]; e != NULL;
		     e = e->next) {
			if (state_of(e, memory_order_relaxed) & E_HELD)
				++*held;
			else
				++*idle;
		}
}

size_t
kl__table_size(struct kl__table *t)
{
	size_t held = 0, idle = 0;

	for (int i = 0; i < NSHARDS; i++)
		pthread_mutex_lock(&t->shards[i].lock);
	for (int i = 0; i < NSHARDS; i++)
		count_entries(&t->shards[i], &held, &idle);
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
	struct kl__entry *e;

	pthread_mutex_lock(&s->lock);
	e = find(s, h, key, len, NULL);
	*holders = e != NULL && (state_of(e, memory_order_relaxed) & E_HELD);
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
		count_entries(s, &out->entries, &out->idle);
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
/* One entry of shard i, found in bucket b.  Lock held. */
static int
check_entry(struct kl__table *t, int i, size_t b, struct kl__entry *e)
{
	struct shard *s = &t->shards[i];
	char shown[72], what[112];
	unsigned st;

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
	/* A holder may give its key back at any moment (HELD|CAS -> 0), so
	 * only a word with waiters marked, or a free one, is stable here. */
	st = state_of(e, memory_order_acquire);
	if (st != 0 && !(st & E_HELD)) {
		kl__test_report("shard %d: entry '%s' has state %#x", i,
				shown, st);
		return KL_EINVAL;
	}
	if (st & ~(E_HELD | E_WAITERS | E_CAS)) {
		kl__test_report("shard %d: entry '%s' has state %#x", i,
				shown, st);
		return KL_EINVAL;
	}
	if (e->q.len > 0 && (st & (E_HELD | E_WAITERS)) !=
				    (E_HELD | E_WAITERS)) {
		kl__test_report("shard %d: entry '%s' has %zu waiters, state "
				"%#x",
				i, shown, (size_t)e->q.len, st);
		return KL_EINVAL;
	}
	if (e->owner_tid == 0) {
		kl__test_report("shard %d: entry '%s' never had a holder", i,
				shown);
		return KL_EINVAL;
	}
	if (e->fence == 0 || e->fence > s->fence) {
		kl__test_report("shard %d: entry '%s' has fence %llu, shard "
				"issued %llu",
				i, shown, (unsigned long long)e->fence,
				(unsigned long long)s->fence);
		return KL_EINVAL;
	}
	snprintf(what, sizeof what, "shard %d: queue of '%s'", i, shown);
	return kl__waitq_check(&e->q, &s->lock, what);
}

/* The stash of shard i: nstash unlinked entries of inline size. */
static int
check_stash(struct shard *s, int i)
{
	unsigned n = 0;

	for (struct kl__entry *e = s->stash; e != NULL; e = e->next) {
		if (++n > s->nstash || n > STASH_MAX) {
			kl__test_report("shard %d: stash longer than %u (or "
					"a cycle)",
					i, s->nstash);
			return KL_EINVAL;
		}
		if (e->len >= INLINE_KEY) {
			kl__test_report("shard %d: stash has a %u-byte key",
					i, (unsigned)e->len);
			return KL_EINVAL;
		}
		for (size_t b = 0; s->buckets != NULL && b <= s->mask; b++)
			for (struct kl__entry *o = s->buckets[b]; o != NULL;
			     o = o->next)
				if (o == e) {
					kl__test_report("shard %d: stashed "
							"entry is linked",
							i);
					return KL_EINVAL;
				}
	}
	if (n != s->nstash) {
		kl__test_report("shard %d: %u stashed, nstash %u", i, n,
				s->nstash);
		return KL_EINVAL;
	}
	return KL_OK;
}

/* Shard i.  Lock held. */
static int
check_shard(struct kl__table *t, int i)
{
	struct shard *s = &t->shards[i];
	size_t n = 0, cas = 0, count = count_of(s), nb = s->mask + 1;
	unsigned st;
	int rc = KL_OK;

	if (check_stash(s, i) != KL_OK)
		rc = KL_EINVAL;
	if (s->buckets == NULL) {
		if (count != 0 || s->mask != 0) {
			kl__test_report("shard %d: no buckets, count %zu, "
					"mask %zu",
					i, count, s->mask);
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
			if (++n > count) {
				kl__test_report("shard %d: more entries than "
						"its count %zu (or a cycle)",
						i, count);
				return KL_EINVAL;
			}
			if (check_entry(t, i, b, e) != KL_OK)
				rc = KL_EINVAL;
			/* Both kinds count: a CAS may turn one into the
			 * other meanwhile, never add to the sum. */
			st = state_of(e, memory_order_relaxed);
			if (st == 0 || (st & E_CAS))
				cas++;
		}
	if (cas > SMALL) {
		kl__test_report("shard %d: %zu entries idle or taken with "
				"E_CAS, more than %d",
				i, cas, SMALL);
		rc = KL_EINVAL;
	}
	if (n != count) {
		kl__test_report("shard %d: %zu entries, count %zu", i, n,
				count);
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

void
kl__table_skew(struct kl__table *t, long delta)
{
	struct shard *s = &t->shards[0];

	pthread_mutex_lock(&s->lock);
	set_count(s, count_of(s) + (size_t)delta);
	pthread_mutex_unlock(&s->lock);
}
/* GCOVR_EXCL_STOP */
#endif
