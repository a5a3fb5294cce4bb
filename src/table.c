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
 * (the entry stays) or, with no waiter left, unlinks and frees the entry.
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

struct kl__entry {
	struct kl__entry *next; /* bucket chain */
	uint64_t hash;
	struct kl__waitq q;
	uint64_t owner_tid; /* kl__thread_id() of the holder */
	size_t len;
	char key[]; /* len bytes and a NUL */
};

struct shard {
	pthread_mutex_t lock;
	struct kl__entry **buckets;
	size_t mask; /* buckets - 1; 0 while no bucket array exists */
	size_t count;
	uint64_t fence;
	uint64_t lookups, probes;
} __attribute__((aligned(64)));

struct kl__table {
	struct shard shards[NSHARDS];
	atomic_size_t size; /* entries over all shards */
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
	atomic_init(&t->size, 0);
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
	atomic_init(&shared_table.size, 0);
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
	if (atomic_load(&t->size) != 0)
		fprintf(stderr, "keylock: memory provider freed with %zu "
				"keys held\n", atomic_load(&t->size));
#endif
	for (int i = 0; i < NSHARDS; i++) {
		pthread_mutex_destroy(&t->shards[i].lock);
		kl__free(t->shards[i].buckets);
	}
	kl__free(t);
}

static struct shard *
shard_of(struct kl__table *t, uint64_t h)
{
	return &t->shards[h >> 58];
}

static struct kl__entry *
find(struct shard *s, uint64_t h, const char *key, size_t len)
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
insert(struct kl__table *t, struct shard *s, uint64_t h, const char *key,
       size_t len, struct kl__entry **out)
{
	struct kl__entry *e;
	size_t b;

	if (s->buckets == NULL) {
		rehash(s, MIN_BUCKETS);
		if (s->buckets == NULL)
			return KL_ENOMEM;
	} else if (s->count >= s->mask + 1) {
		rehash(s, (s->mask + 1) * 2);
	}
	if (len > SIZE_MAX - sizeof *e - 1 ||
	    (e = kl__malloc(sizeof *e + len + 1)) == NULL)
		return KL_ENOMEM;
	e->hash = h;
	kl__waitq_init(&e->q, &s->lock);
	e->owner_tid = kl__thread_id();
	e->len = len;
	memcpy(e->key, key, len);
	e->key[len] = '\0';
	b = h & s->mask;
	e->next = s->buckets[b];
	s->buckets[b] = e;
	s->count++;
	atomic_fetch_add_explicit(&t->size, 1, memory_order_relaxed);
	*out = e;
	return KL_OK;
}

static void
unlink_entry(struct kl__table *t, struct shard *s, struct kl__entry *e)
{
	struct kl__entry **pp = &s->buckets[e->hash & s->mask];

	while (*pp != e)
		pp = &(*pp)->next;
	*pp = e->next;
	s->count--;
	atomic_fetch_sub_explicit(&t->size, 1, memory_order_relaxed);
	/* Shrink lazily (a quarter full), never below MIN_BUCKETS: a shard
	 * whose only key comes and goes keeps its small array instead of
	 * allocating it on every acquire. */
	if (s->mask + 1 > MIN_BUCKETS && s->count < (s->mask + 1) / 4)
		rehash(s, (s->mask + 1) / 2);
}

int
kl__table_acquire(struct kl__table *t, const char *key, size_t len,
		  int64_t deadline_ns, kl_cancel *c, unsigned flags,
		  struct kl__entry **out, uint64_t *fence)
{
	uint64_t h = kl__hash(key, len);
	struct shard *s = shard_of(t, h);
	struct kl__waiter w;
	struct kl__entry *e;
	bool prepared = false;
	int rc;

	*out = NULL;
	*fence = 0;
	if (c != NULL) {
		/* The token's lock comes before the shard's. */
		if ((rc = kl__waiter_prepare(&w, &s->lock, c)) != KL_OK)
			return rc;
		prepared = true;
	}
	pthread_mutex_lock(&s->lock);
	/* A fire between registering and here settled the waiter already:
	 * once kl_cancel_fire has returned, nothing may be granted to it. */
	if (prepared && w.state == KL_W_DONE) {
		rc = w.status;
		goto unlock;
	}
	if ((e = find(s, h, key, len)) == NULL) {
		if ((rc = insert(t, s, h, key, len, &e)) == KL_OK) {
			*out = e;
			*fence = ++s->fence;
		}
		goto unlock;
	}
	if ((flags & KL_ERRORCHECK) && e->owner_tid == kl__thread_id()) {
		rc = KL_EDEADLK;
		goto unlock;
	}
	if (deadline_ns != KL_NO_DEADLINE && kl__now_ns() >= deadline_ns) {
		rc = KL_ETIMEDOUT;
		goto unlock;
	}
	if (!prepared) {
		kl__waiter_prepare(&w, &s->lock, NULL);
		prepared = true;
	}
	rc = kl__waitq_wait(&e->q, &w, deadline_ns, KL_UNBOUNDED,
			    KL_OVERFLOW_THIS);
	if (rc == KL_OK) {
		*out = e;
		*fence = w.data;
	}
	goto finish;
unlock:
	pthread_mutex_unlock(&s->lock);
finish:
	if (prepared)
		kl__waiter_finish(&w);
	return rc;
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
		w->data = ++s->fence;
		wake = kl__waiter_settle(w);
		e = NULL;
	} else {
		unlink_entry(t, s, e);
	}
	pthread_mutex_unlock(&s->lock);
	KL_YIELD("free");
	kl__unpark(wake);
	kl__free(e);
}

size_t
kl__table_size(struct kl__table *t)
{
	return atomic_load_explicit(&t->size, memory_order_relaxed);
}

int
kl__table_status(struct kl__table *t, const char *key, size_t len,
		 size_t *holders, size_t *waiters)
{
	uint64_t h = kl__hash(key, len);
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
