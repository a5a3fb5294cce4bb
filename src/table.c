/* SPDX-License-Identifier: MIT */
/*
 * The key table behind the memory provider.
 *
 * 64 shards, each a cache-line aligned mutex with its own chained hash table
 * that grows and shrinks by itself, so a resize stops one shard, never the
 * world.  The shard mutex is also the lock of every wait queue in the shard:
 * an entry's hand-off and its removal are decided under one lock.
 *
 * Invariant: an entry exists exactly while its key is held.  Waiters queue
 * only on a held key, and a release either hands the key to the head waiter
 * (the entry stays) or, with no waiter left, unlinks and frees the entry
 * (or keeps it as its shard's one spare, not an entry any more).
 * A waiter that times out or is cancelled only unlinks itself; the key is
 * still held then, so it never has to free anything, and after failing it
 * never touches the entry again (a release may free it at once).
 *
 * Keys are hashed with seeded SipHash (hash.c); the top bits pick the shard,
 * the low bits the bucket.
 */
#include "config.h"

#include <string.h>

#include "table.h"

#define NSHARDS 64
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

/* 56 bytes and the key: with a key of up to 15 bytes an entry is one
 * 80-byte malloc chunk, the lease of kl_lock_acquire included (see
 * kl__entry_lock). */
struct kl__entry {
	struct kl__entry *next; /* bucket chain */
	uint32_t hash;          /* the key's hash >> 32: shard and bucket */
	uint32_t len;           /* key bytes */
	struct kl__waitq q;
	uint64_t owner_tid; /* kl__thread_id() of the holder */
	uint64_t fence;     /* the holder's fence */
	kl_lock *lock;      /* for the holder's use: see kl__entry_lock */
	char key[];         /* len bytes and a NUL */
};

struct shard {
	pthread_mutex_t lock;
	struct kl__entry **buckets;
	/* A freed entry with an inline-sized key, kept for the next insert:
	 * a key taken and given back over and over allocates nothing.  At
	 * most one per shard, so idle memory stays bounded. */
	struct kl__entry *spare;
	size_t mask; /* buckets - 1; 0 while no bucket array exists */
	size_t count; /* entries */
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
		pthread_mutex_destroy(&t->shards[i].lock);
		kl__free(t->shards[i].buckets);
		kl__free(t->shards[i].spare);
	}
	kl__free(t);
}

/* An entry keeps 32 bits of its key's hash: the top 6 pick the shard, the
 * low ones the bucket (a shard never grows past MAX_BUCKETS, so the two
 * never overlap). */
#define MAX_BUCKETS ((size_t)1 << 26)

static uint32_t
hash_of(const char *key, size_t len)
{
	return (uint32_t)(kl__hash(key, len) >> 32);
}

static struct shard *
shard_of(struct kl__table *t, uint32_t h)
{
	return &t->shards[h >> 26];
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
		    memcmp(e->key, key, len) == 0)
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

/* Waits as w (prepared) for e, held by another.  Lock held on entry,
 * released on return. */
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
	uint32_t h = hash_of(key, len);
	struct shard *s = shard_of(t, h);
	struct kl__entry *e;
	int rc;

	*out = NULL;
	*fence = 0;
	if (c != NULL)
		return acquire_cancellable(t, s, h, key, len, deadline_ns, c,
					   flags, out, fence);
	pthread_mutex_lock(&s->lock);
	if ((e = find(s, h, key, len)) != NULL)
		return acquire_held(s, e, deadline_ns, flags, out, fence);
	rc = take_new(t, s, h, key, len, out, fence);
	pthread_mutex_unlock(&s->lock);
	return rc;
}

const char *
kl__entry_key(const struct kl__entry *e)
{
	return e->key;
}

uint64_t
kl__entry_fence(const struct kl__entry *e)
{
	return e->fence;
}

kl_lock **
kl__entry_lock(struct kl__entry *e)
{
	return &e->lock;
}

struct kl__entry *
kl__entry_of_lock(kl_lock **word)
{
	return (struct kl__entry *)(void *)((char *)word -
					    offsetof(struct kl__entry, lock));
}

void
kl__table_release(struct kl__table *t, struct kl__entry *e)
{
	struct shard *s = shard_of(t, e->hash);
	struct kl__waiter *w;
	void *wake = NULL;

	pthread_mutex_lock(&s->lock);
	if ((w = kl__waitq_grant_head(&e->q)) != NULL) {
		e->owner_tid = w->tid;
		w->data = e->fence = ++s->fence;
		wake = kl__waiter_settle(w);
		e = NULL;
	} else {
		unlink_entry(s, e);
		if (KEEP_SPARE && e->len < INLINE_KEY && s->spare == NULL) {
			s->spare = e;
			e = NULL;
		}
	}
	pthread_mutex_unlock(&s->lock);
	KL_YIELD("free");
	kl__unpark(wake);
	kl__free(e);
}

size_t
kl__table_size(struct kl__table *t)
{
	size_t n = 0;

	for (int i = 0; i < NSHARDS; i++)
		pthread_mutex_lock(&t->shards[i].lock);
	for (int i = 0; i < NSHARDS; i++)
		n += t->shards[i].count;
	for (int i = NSHARDS - 1; i >= 0; i--)
		pthread_mutex_unlock(&t->shards[i].lock);
	return n;
}

int
kl__table_status(struct kl__table *t, const char *key, size_t len,
		 size_t *holders, size_t *waiters)
{
	uint32_t h = hash_of(key, len);
	struct shard *s = shard_of(t, h);
	struct kl__entry *e;

	pthread_mutex_lock(&s->lock);
	e = find(s, h, key, len);
	*holders = e != NULL;
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
		out->entries += s->count;
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
/* One entry of shard i, found in bucket b.  Lock held. */
static int
check_entry(struct kl__table *t, int i, size_t b, struct kl__entry *e)
{
	struct shard *s = &t->shards[i];
	char shown[72], what[112];

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
	if (hash_of(e->key, e->len) != e->hash || e->key[e->len] != '\0') {
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
