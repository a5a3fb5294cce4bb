/* SPDX-License-Identifier: MIT */
/*
 * The bucket chains of a shard: where a key lives that its slot cannot
 * take (a long key, or a short one whose slot another key holds).  An
 * entry is made on first use and freed with its last release, under the
 * shard lock; the bucket array doubles at one entry per bucket, halves at a
 * quarter, and a chain of CHAIN_LIMIT switches the shard to SipHash
 * (hash_of in table.h).  Everything here runs with the shard lock held.
 */
#include "config.h"

#define KL__TABLE_PRIVATE
#include "table.h"

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

int
kl__chain_insert(struct shard *s, uint32_t h, const char *key, size_t len,
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

void
kl__chain_unlink(struct shard *s, struct kl__entry *e)
{
	struct kl__entry **pp =
		&s->buckets[bucket_of(s, e->hash, e->key, e->len)];

	while (*pp != e)
		pp = &(*pp)->next;
	*pp = e->next;
	s->count--;
	maybe_shrink(s);
}
