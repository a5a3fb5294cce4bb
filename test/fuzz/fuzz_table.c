/* SPDX-License-Identifier: MIT */
/*
 * libFuzzer target for the key table under the memory provider (TESTPLAN
 * T19; keys of any bytes as in T16).  Built by test/fuzz/run.sh with ASan,
 * UBSan and -DKL_TEST_HOOKS.  The input is a program of operations on one
 * table, run in one thread against a model that says which keys are held:
 *   op & 3 == 0  take a key given inline (a length byte, 0..40, and the
 *                bytes), trying once: KL_OK exactly when the model says it
 *                is free, else KL_ETIMEDOUT (KL_EDEADLK with op & 4, the
 *                error-check flag); with op & 8, also take up to 63 more
 *                keys (the next byte says how many) that fall in the same
 *                shard, so that slots are taken over and keys chained
 *                behind held slots;
 *   op & 3 == 1  release the held key the next byte picks;
 *   op & 3 == 2  take a key seen before again (the next byte picks it);
 *   op & 3 == 3  check: kl__table_check, the count of held keys, and the
 *                holders and waiters of a key.
 * It also checks that a grant's fence is larger than every earlier fence
 * of its key and that the entry holds the key's bytes.  At the end it
 * releases every key, checks that the table is empty, that no key stays
 * chained and at most SLOTS idle slots a shard stay, and frees it
 * (LeakSanitizer then reports any entry left behind).  A failed check
 * aborts, which libFuzzer reports as a crash with the input.
 */
#include "config.h"

#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "table.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define POOL 512
#define KEY_MAX 40

struct key {
	uint8_t b[KEY_MAX];
	size_t len;
	struct kl__entry *e; /* non-NULL while held */
	uint64_t fence;      /* the last one granted */
};

struct run {
	const uint8_t *p, *end;
	struct kl__table *t;
	struct key pool[POOL];
	size_t npool, held;
};

static void
fail(const char *what, const struct key *k, int rc)
{
	fprintf(stderr, "fuzz_table: %s (key of %zu bytes, rc %d)\n", what,
		k != NULL ? k->len : 0, rc);
	abort();
}

static unsigned
next(struct run *r)
{
	return r->p < r->end ? *r->p++ : 0;
}

/* k, added to the pool (or found there). */
static struct key *
pooled(struct run *r, const struct key *kp)
{
	struct key k = *kp;

	for (size_t i = 0; i < r->npool; i++)
		if (r->pool[i].len == k.len &&
		    memcmp(r->pool[i].b, k.b, k.len) == 0)
			return &r->pool[i];
	if (r->npool == POOL)
		return &r->pool[next(r) % POOL];
	k.e = NULL;
	k.fence = 0;
	r->pool[r->npool] = k;
	return &r->pool[r->npool++];
}

/* The key given inline, in the pool. */
static struct key *
inline_key(struct run *r)
{
	struct key k;

	k.len = next(r) % (KEY_MAX + 1);
	for (size_t i = 0; i < k.len; i++)
		k.b[i] = (uint8_t)next(r);
	return pooled(r, &k);
}

static void
take(struct run *r, struct key *k, unsigned flags)
{
	struct kl__entry *e = NULL;
	uint64_t fence = 0;
	/* 0 is a deadline in the past: try once. */
	int rc = kl__table_acquire(r->t, (const char *)k->b, k->len, 0, NULL,
				   flags, &e, &fence);

	if (k->e != NULL) {
		if (rc != ((flags & KL_ERRORCHECK) ? KL_EDEADLK : KL_ETIMEDOUT))
			fail("a held key was not refused", k, rc);
		return;
	}
	if (rc != KL_OK)
		fail("a free key was refused", k, rc);
	if (fence <= k->fence)
		fail("the fence did not grow", k, rc);
	if (memcmp(kl__entry_key(e), k->b, k->len) != 0 ||
	    kl__entry_key(e)[k->len] != '\0' ||
	    kl__entry_fence(e) != fence)
		fail("the entry does not hold the key", k, rc);
	k->e = e;
	k->fence = fence;
	r->held++;
}

/* Takes n keys of k's shard: k's bytes (cut to 32) and a counter. */
static void
take_shard(struct run *r, const struct key *k, unsigned n)
{
	uint32_t shard = kl__table_hash(r->t, (const char *)k->b, k->len) >>
			 26;
	struct key c;
	size_t base = k->len < 32 ? k->len : 32;
	char num[16];

	memcpy(c.b, k->b, base);
	for (uint32_t i = 0; n > 0 && r->npool < POOL; i++) {
		int m = snprintf(num, sizeof num, "%" PRIu32, i);

		c.len = base + (size_t)m > KEY_MAX ? KEY_MAX : base + (size_t)m;
		memcpy(c.b + base, num, c.len - base);
		if (kl__table_hash(r->t, (const char *)c.b, c.len) >> 26 !=
		    shard)
			continue;
		take(r, pooled(r, &c), 0);
		n--;
	}
}

static void
give_back(struct run *r, unsigned pick)
{
	size_t n = 0;

	if (r->held == 0)
		return;
	pick %= r->held;
	for (size_t i = 0; i < r->npool; i++) {
		struct key *k = &r->pool[i];

		if (k->e != NULL && n++ == pick) {
			kl__table_release(r->t, k->e);
			k->e = NULL;
			r->held--;
			return;
		}
	}
	fail("the model lost a held key", NULL, 0);
}

static void
check(struct run *r, struct key *k)
{
	size_t holders, waiters;

	if (kl__table_check(r->t) != KL_OK)
		fail("an invariant broke", k, 0);
	if (kl__table_size(r->t) != r->held)
		fail("the table counts other keys held", k, 0);
	if (k != NULL) {
		kl__table_status(r->t, (const char *)k->b, k->len, &holders,
				 &waiters);
		if (holders != (k->e != NULL) || waiters != 0)
			fail("the key's status is wrong", k, (int)holders);
	}
}

int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct run r;
	struct kl__table_stats st;

	static bool seeded;

	/* One seed for every run: an input does the same each time. */
	if (!seeded) {
		kl__test_set_hash_seed(0x6b65796c6f636b21ULL, 0x66757a7a21ULL);
		seeded = true;
	}
	memset(&r, 0, sizeof r);
	r.p = data;
	r.end = data + size;
	if (kl__table_new(&r.t) != KL_OK)
		return 0; /* out of memory before anything happened */
	while (r.p < r.end) {
		unsigned op = next(&r);

		switch (op & 3) {
		case 0: {
			struct key *k = inline_key(&r);

			take(&r, k, (op & 4) ? KL_ERRORCHECK : 0);
			if (op & 8)
				take_shard(&r, k, next(&r) % 64);
			break;
		}
		case 1:
			give_back(&r, next(&r));
			break;
		case 2:
			if (r.npool > 0)
				take(&r, &r.pool[next(&r) % r.npool],
				     (op & 4) ? KL_ERRORCHECK : 0);
			break;
		default:
			check(&r, r.npool > 0 ? &r.pool[next(&r) % r.npool]
					      : NULL);
			break;
		}
	}
	check(&r, NULL);
	while (r.held > 0)
		give_back(&r, 0);
	check(&r, NULL);
	kl__table_stats(r.t, &st);
	if (st.entries != 0 || st.chained != 0 ||
	    st.idle > (size_t)KL__TABLE_SHARDS * KL__TABLE_SLOTS)
		fail("the released table is not empty", NULL, (int)st.idle);
	kl__table_free(r.t);
	return 0;
}
