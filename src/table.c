/* SPDX-License-Identifier: MIT */
/*
 * The key table behind the memory provider.
 *
 * 64 shards, each a cache-line aligned mutex with its own chained hash table
 * that grows and shrinks by itself, so a resize stops one shard, never the
 * world.  The shard mutex is also the lock of every wait queue in the shard:
 * an entry's hand-off and its removal are decided under one lock.
 *
 * An entry is linked while its key is held, and a few more stay linked
 * while idle: each shard keeps the entries of the last NKEPT keys released
 * ("kept"), so that a key taken and given back over and over costs no
 * insert, no unlink and no allocation, and its holder can give it back
 * without the shard lock.  Every other entry is unlinked by the release
 * that leaves it with no holder and no waiter, so idle memory stays
 * bounded by NKEPT entries per shard.
 *
 * An entry's state word (E_HELD, E_WAITERS, E_KEPT) changes under the shard
 * lock, with one exception: the holder of a kept entry with no waiter marked
 * releases it with one compare-and-swap, HELD|KEPT -> KEPT.  Everything else
 * is written so that this CAS cannot succeed when the lock-holder relies on
 * the word staying put: a waiter sets E_WAITERS (by CAS, as the holder may
 * be releasing) before it queues, and only a release under the lock clears
 * it.  A stale E_WAITERS (the waiter timed out) only sends the next release
 * through the lock, which finds nobody to hand to.  Acquirers take a free
 * entry under the lock, where nothing else can change a free entry, and an
 * eviction frees only a free kept entry, under the lock: after its CAS, a
 * releaser never touches the entry again.
 * Waiters queue only on a held key.  A waiter that times out or is cancelled
 * only unlinks itself; the key is still held then, so it never has to free
 * anything, and after failing it never touches the entry again (a release
 * may free it at once).
 *
 * Keys are hashed with seeded SipHash (hash.c); the top bits pick the shard,
 * the low bits the bucket.
 */
#include "config.h"

#include <string.h>

#include "annotate.h"
#include "table.h"

#define NSHARDS KL__TABLE_SHARDS
#define MIN_BUCKETS 8
/* Key bytes (NUL included) every entry has room for: entries of keys that
 * fit are all one size, so a shard keeps one of them spare (see release). */
#define INLINE_KEY 16
/* AddressSanitizer builds free every entry, so that a use after the last
 * release is reported instead of landing in the spare. */
#if defined(__SANITIZE_ADDRESS__)
#define KEEP_SPARE 0
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KEEP_SPARE 0
#endif
#endif
#ifndef KEEP_SPARE
#define KEEP_SPARE 1
#endif
#define NKEPT KL__TABLE_KEPT
#define KEEP_KEY_MAX KL__TABLE_KEEP_KEY_MAX

/* The state word of an entry. */
#define E_HELD 1u    /* a holder has the key */
#define E_WAITERS 2u /* a waiter may be queued: release under the lock */
#define E_KEPT 4u    /* in its shard's kept[]; free when not E_HELD */

struct shard {
	pthread_mutex_t lock;
	struct kl__entry **buckets;
	/* A freed entry with an inline-sized key, kept for the next insert:
	 * a key taken and given back over and over allocates nothing.  At
	 * most one per shard, so idle memory stays bounded. */
	struct kl__entry *spare;
	/* Linked entries kept while idle (NULL: a free slot), and the slot
	 * the next one replaces when none is free. */
	struct kl__entry *kept[NKEPT];
	unsigned kept_next;
	size_t mask; /* buckets - 1; 0 while no bucket array exists */
	size_t count; /* linked entries, kept idle ones included */
	uint64_t fence;
	uint64_t lookups, probes;
} __attribute__((aligned(64)));

/* No global count of entries: every acquire and release on any key would
 * write its cache line from every CPU.  kl__table_size sums the shards
 * with all of them locked at once, which is exact (a sum taken shard by
 * shard could count a key released in one and another taken in a second
 * as both live). */
struct kl__table {
	struct shard shards[NSHARDS];
	uint64_t k0, k1; /* kl__hash's seed (see kl__hash_seed) */
};

int
kl__table_new(struct kl__table **out)
{
	struct kl__table *t;

	*out = NULL;
	if ((t = kl__aligned_alloc(64, sizeof *t)) == NULL)
		return KL_ENOMEM;
	memset(t, 0, sizeof *t);
	for (int i = 0; i < NSHARDS; i++)
		pthread_mutex_init(&t->shards[i].lock, NULL);
	kl__hash_seed(&t->k0, &t->k1);
	*out = t;
	return KL_OK;
}

static struct kl__table shared_table;
static pthread_once_t shared_once = PTHREAD_ONCE_INIT;

static void
shared_init(void)
{
	for (int i = 0; i < NSHARDS; i++)
		pthread_mutex_init(&shared_table.shards[i].lock, NULL);
	kl__hash_seed(&shared_table.k0, &shared_table.k1);
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

		/* Only kept idle entries are still linked. */
		for (size_t b = 0; s->buckets != NULL && b <= s->mask; b++) {
			struct kl__entry *e = s->buckets[b], *next;

			for (; e != NULL; e = next) {
				next = e->next;
				kl__free(e);
			}
		}
		pthread_mutex_destroy(&s->lock);
		kl__free(s->buckets);
		kl__free(s->spare);
	}
	kl__free(t);
}

/* An entry keeps 32 bits of its key's hash: the top 6 pick the shard, the
 * low ones the bucket (a shard never grows past MAX_BUCKETS, so the two
 * never overlap). */
#define MAX_BUCKETS ((size_t)1 << 26)

static uint32_t
hash_of(const struct kl__table *t, const char *key, size_t len)
{
	return (uint32_t)(kl__siphash(t->k0, t->k1, key, len) >> 32);
}

static struct shard *
shard_of(struct kl__table *t, uint32_t h)
{
	return &t->shards[h >> 26];
}

unsigned
kl__table_shard_of(const struct kl__table *t, const char *key, size_t len)
{
	return hash_of(t, key, len) >> 26;
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

static struct kl__entry *
find(struct shard *s, uint32_t h, const char *key, size_t len)
{
	struct kl__entry *e;

	s->lookups++;
	if (s->buckets == NULL)
		return NULL;
	for (e = s->buckets[h & s->mask]; e != NULL; e = e->next) {
		s->probes++;
		if (e->hash == h && e->len == len &&
		    same_bytes(e->key, key, len))
			return e;
	}
	return NULL;
}

/* Rebuilds the bucket array with n buckets (a power of two).  On allocation
 * failure the old array stays: a full table is slower, never wrong. */
static void
rehash(struct shard *s, size_t n)
{
	struct kl__entry **nb = kl__calloc(n, sizeof *nb);
	size_t old = s->buckets != NULL ? s->mask + 1 : 0;

	if (nb == NULL)
		return;
	for (size_t i = 0; i < old; i++) {
		struct kl__entry *e = s->buckets[i], *next;

		for (; e != NULL; e = next) {
			next = e->next;
			e->next = nb[e->hash & (n - 1)];
			nb[e->hash & (n - 1)] = e;
		}
	}
	kl__free(s->buckets);
	s->buckets = nb;
	s->mask = n - 1;
}

static int
insert(struct shard *s, uint32_t h, const char *key,
       size_t len, struct kl__entry **out)
{
	struct kl__entry *e;
	size_t b, n = s->count;

	if (s->buckets == NULL) {
		rehash(s, MIN_BUCKETS);
		if (s->buckets == NULL)
			return KL_ENOMEM;
	} else if (n >= s->mask + 1 && s->mask + 1 < MAX_BUCKETS) {
		rehash(s, (s->mask + 1) * 2);
	}
	if (len < INLINE_KEY && s->spare != NULL) {
		e = s->spare;
		s->spare = NULL;
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
	atomic_store_explicit(&e->q.user, E_HELD, memory_order_relaxed);
	e->owner_tid = kl__thread_id();
	e->fence = 0;
	e->lock = NULL;
	memcpy(e->key, key, len);
	e->key[len] = '\0';
	b = h & s->mask;
	e->next = s->buckets[b];
	s->buckets[b] = e;
	s->count = n + 1;
	*out = e;
	return KL_OK;
}

static void
unlink_entry(struct shard *s, struct kl__entry *e)
{
	struct kl__entry **pp = &s->buckets[e->hash & s->mask];
	size_t n = s->count - 1;

	while (*pp != e)
		pp = &(*pp)->next;
	*pp = e->next;
	s->count = n;
	/* Shrink lazily (a quarter full), never below MIN_BUCKETS: a shard
	 * whose only key comes and goes keeps its small array instead of
	 * allocating it on every acquire. */
	if (s->mask + 1 > MIN_BUCKETS && n < (s->mask + 1) / 4)
		rehash(s, (s->mask + 1) / 2);
}

/* Takes a free key: a new entry, held by the caller.  Lock held. */
static int
take_new(struct kl__table *t, struct shard *s, uint32_t h, const char *key,
	 size_t len, struct kl__entry **out, uint64_t *fence)
{
	struct kl__entry *e;
	int rc;

	if ((rc = insert(s, h, key, len, &e)) == KL_OK) {
		*out = e;
		*fence = e->fence = ++s->fence;
	}
	return rc;
}

/* Takes e, a free kept entry, for the caller.  Lock held: nothing else
 * changes a free entry's state then.  The acquire load that found it free
 * pairs with the releaser's CAS, so its holder's writes are visible. */
static void
take_idle(struct shard *s, struct kl__entry *e, uint32_t st,
	  struct kl__entry **out, uint64_t *fence)
{
	KL_ANNOTATE_HAPPENS_AFTER(&e->q.user);
	e->owner_tid = kl__thread_id();
	e->lock = NULL;
	*fence = e->fence = ++s->fence;
	atomic_store_explicit(&e->q.user, st | E_HELD, memory_order_relaxed);
	*out = e;
}

/* Marks e as waited for before a waiter queues, so that its holder
 * releases through the lock.  Lock held.  Returns false, and the free
 * state in *st, when the holder gave the key back meanwhile. */
static bool
mark_waiting(struct kl__entry *e, uint32_t *st)
{
	uint32_t v = atomic_load_explicit(&e->q.user, memory_order_acquire);

	while (v & E_HELD) {
		if ((v & E_WAITERS) ||
		    atomic_compare_exchange_weak_explicit(
			    &e->q.user, &v, v | E_WAITERS, memory_order_acquire,
			    memory_order_acquire))
			return true;
	}
	*st = v;
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
	uint32_t st;
	int rc;

	if ((rc = refusal(e, deadline_ns, flags)) != KL_OK) {
		pthread_mutex_unlock(&s->lock);
		return rc;
	}
	if (!mark_waiting(e, &st)) {
		take_idle(s, e, st, out, fence);
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
acquire_cancellable(struct kl__table *t, struct shard *s, uint32_t h,
		    const char *key, size_t len, int64_t deadline_ns,
		    kl_cancel *c, unsigned flags, struct kl__entry **out,
		    uint64_t *fence)
{
	struct kl__waiter w;
	struct kl__entry *e;
	uint32_t st;
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
	} else if ((e = find(s, h, key, len)) == NULL) {
		rc = take_new(t, s, h, key, len, out, fence);
		pthread_mutex_unlock(&s->lock);
	} else if (!((st = atomic_load_explicit(&e->q.user,
					       memory_order_acquire)) &
		     E_HELD)) {
		take_idle(s, e, st, out, fence);
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
	struct kl__entry *e;
	uint32_t st;
	int rc;

	*out = NULL;
	*fence = 0;
	if (c != NULL)
		return acquire_cancellable(t, s, h, key, len, deadline_ns, c,
					   flags, out, fence);
	pthread_mutex_lock(&s->lock);
	if ((e = find(s, h, key, len)) == NULL) {
		rc = take_new(t, s, h, key, len, out, fence);
	} else if (!((st = atomic_load_explicit(&e->q.user,
					       memory_order_acquire)) &
		     E_HELD)) {
		take_idle(s, e, st, out, fence);
		rc = KL_OK;
	} else {
		return acquire_held(s, e, deadline_ns, flags, out, fence);
	}
	pthread_mutex_unlock(&s->lock);
	return rc;
}

/* What to free of e, just unlinked: nothing when it becomes the spare. */
static struct kl__entry *
to_spare(struct shard *s, struct kl__entry *e)
{
	if (KEEP_SPARE && e->len < INLINE_KEY && s->spare == NULL) {
		s->spare = e;
		return NULL;
	}
	return e;
}

/* e, just released with no waiter, and not kept: keeps it in a free slot
 * or in place of a free kept entry, else unlinks it.  Returns the entry to
 * free, if any.  Lock held. */
static struct kl__entry *
retire(struct shard *s, struct kl__entry *e)
{
	if (e->len < KEEP_KEY_MAX) {
		for (unsigned i = 0; i < NKEPT; i++) {
			unsigned slot = (s->kept_next + i) % NKEPT;
			struct kl__entry *v = s->kept[slot];

			if (v != NULL && atomic_load_explicit(
						 &v->q.user,
						 memory_order_acquire) != E_KEPT)
				continue; /* held: its holder may use it */
			s->kept[slot] = e;
			s->kept_next = (slot + 1) % NKEPT;
			atomic_store_explicit(&e->q.user, E_KEPT,
					      memory_order_relaxed);
			if (v == NULL)
				return NULL;
			KL_ANNOTATE_HAPPENS_AFTER(&v->q.user);
			unlink_entry(s, v);
			return to_spare(s, v);
		}
	}
	unlink_entry(s, e);
	return to_spare(s, e);
}

/* kl__table_release when the CAS cannot do: waiters marked, or not kept. */
static __attribute__((noinline)) void
release_locked(struct shard *s, struct kl__entry *e)
{
	struct kl__waiter *w;
	void *wake = NULL;
	uint32_t st;

	pthread_mutex_lock(&s->lock);
	/* Only this lock's holder changes the word now: the CAS of a
	 * releaser needs HELD|KEPT alone, and the caller is the holder. */
	st = atomic_load_explicit(&e->q.user, memory_order_relaxed);
	if ((w = kl__waitq_grant_head(&e->q)) != NULL) {
		e->owner_tid = w->tid;
		w->data = e->fence = ++s->fence;
		if (e->q.len == 0)
			atomic_store_explicit(&e->q.user, st & ~E_WAITERS,
					      memory_order_relaxed);
		wake = kl__waiter_settle(w);
		e = NULL;
	} else if (st & E_KEPT) {
		KL_ANNOTATE_HAPPENS_BEFORE(&e->q.user);
		atomic_store_explicit(&e->q.user, E_KEPT, memory_order_release);
		e = NULL;
	} else {
		e = retire(s, e);
	}
	pthread_mutex_unlock(&s->lock);
	KL_YIELD("free");
	kl__unpark(wake);
	kl__free(e);
}

void
kl__table_release(struct kl__table *t, struct kl__entry *e)
{
	uint32_t st = E_HELD | E_KEPT;

	KL_ANNOTATE_HAPPENS_BEFORE(&e->q.user);
	/* Release order: the next holder, which loads the word under the
	 * shard lock, sees what this one wrote.  After it, e may be freed. */
	if (atomic_compare_exchange_strong_explicit(&e->q.user, &st, E_KEPT,
						    memory_order_release,
						    memory_order_relaxed))
		return;
	release_locked(shard_of(t, e->hash), e);
}

/* Kept entries of s that are free.  Lock held. */
static size_t
idle_of(const struct shard *s)
{
	size_t n = 0;

	for (unsigned i = 0; i < NKEPT; i++)
		if (s->kept[i] != NULL &&
		    !(atomic_load_explicit(&s->kept[i]->q.user,
					   memory_order_relaxed) &
		      E_HELD))
			n++;
	return n;
}

size_t
kl__table_size(struct kl__table *t)
{
	size_t n = 0;

	for (int i = 0; i < NSHARDS; i++)
		pthread_mutex_lock(&t->shards[i].lock);
	for (int i = 0; i < NSHARDS; i++)
		n += t->shards[i].count - idle_of(&t->shards[i]);
	for (int i = NSHARDS - 1; i >= 0; i--)
		pthread_mutex_unlock(&t->shards[i].lock);
	return n;
}

int
kl__table_status(struct kl__table *t, const char *key, size_t len,
		 size_t *holders, size_t *waiters)
{
	uint32_t h = hash_of(t, key, len);
	struct shard *s = shard_of(t, h);
	struct kl__entry *e;

	pthread_mutex_lock(&s->lock);
	e = find(s, h, key, len);
	*holders = e != NULL && (atomic_load_explicit(&e->q.user,
						      memory_order_relaxed) &
				 E_HELD);
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
		out->entries += s->count - idle_of(s);
		out->idle += idle_of(s);
		out->lookups += s->lookups;
		out->probes += s->probes;
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
static bool
kept_slot(const struct shard *s, const struct kl__entry *e)
{
	for (unsigned i = 0; i < NKEPT; i++)
		if (s->kept[i] == e)
			return true;
	return false;
}

/* kept[]: no entry twice, each one linked (check_entry checks the rest). */
static int
check_kept(struct shard *s, int i)
{
	for (unsigned k = 0; k < NKEPT; k++) {
		struct kl__entry *v = s->kept[k], *e = NULL;

		if (v == NULL)
			continue;
		for (unsigned j = k + 1; j < NKEPT; j++)
			if (s->kept[j] == v) {
				kl__test_report("shard %d: kept[%u] and "
						"kept[%u] are one entry",
						i, k, j);
				return KL_EINVAL;
			}
		if (s->buckets != NULL)
			for (e = s->buckets[v->hash & s->mask];
			     e != NULL && e != v; e = e->next)
				;
		if (e == NULL) {
			kl__test_report("shard %d: kept[%u] is not linked", i,
					k);
			return KL_EINVAL;
		}
	}
	return KL_OK;
}

/* One entry of shard i, found in bucket b.  Lock held. */
static int
check_entry(struct kl__table *t, int i, size_t b, struct kl__entry *e)
{
	struct shard *s = &t->shards[i];
	char shown[72], what[112];
	unsigned st;

	kl__key_printable(shown, sizeof shown, e->key, e->len);
	if (e == s->spare) {
		kl__test_report("shard %d: spare entry '%s' is linked", i,
				shown);
		return KL_EINVAL;
	}
	if (shard_of(t, e->hash) != s || (e->hash & s->mask) != b) {
		kl__test_report("shard %d bucket %zu: entry '%s' belongs in "
				"shard %u bucket %zu",
				i, b, shown, (unsigned)(e->hash >> 26),
				(size_t)(e->hash & s->mask));
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
	st = atomic_load_explicit(&e->q.user, memory_order_acquire);
	if (st & ~(E_HELD | E_WAITERS | E_KEPT)) {
		kl__test_report("shard %d: entry '%s' has state %#x", i,
				shown, st);
		return KL_EINVAL;
	}
	if (!(st & E_KEPT) != !kept_slot(s, e)) {
		kl__test_report("shard %d: entry '%s' is %skept but %sin "
				"kept[]",
				i, shown, (st & E_KEPT) ? "" : "not ",
				kept_slot(s, e) ? "" : "not ");
		return KL_EINVAL;
	}
	/* A kept entry's holder may give it back at any moment, so only a
	 * word with waiters or without E_KEPT is stable here. */
	if (!(st & (E_HELD | E_KEPT)) ||
	    (!(st & E_HELD) && (st & E_WAITERS))) {
		kl__test_report("shard %d: entry '%s' is linked, free and "
				"not kept (state %#x)",
				i, shown, st);
		return KL_EINVAL;
	}
	if (e->q.len > 0 && st != (E_HELD | E_WAITERS) &&
	    st != (E_HELD | E_WAITERS | E_KEPT)) {
		kl__test_report("shard %d: entry '%s' has %zu waiters, state "
				"%#x",
				i, shown, (size_t)e->q.len, st);
		return KL_EINVAL;
	}
	if (e->owner_tid == 0) {
		kl__test_report("shard %d: entry '%s' has no holder", i,
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

/* Shard i.  Lock held. */
static int
check_shard(struct kl__table *t, int i)
{
	struct shard *s = &t->shards[i];
	size_t n = 0, count = s->count, nb = s->mask + 1;
	int rc = KL_OK;

	if (s->spare != NULL && s->spare->len >= INLINE_KEY) {
		kl__test_report("shard %d: spare of a %u-byte key", i,
				(unsigned)s->spare->len);
		rc = KL_EINVAL;
	}
	if (check_kept(s, i) != KL_OK)
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
	s->count += (size_t)delta;
	pthread_mutex_unlock(&s->lock);
}
/* GCOVR_EXCL_STOP */
#endif
