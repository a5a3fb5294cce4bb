/* SPDX-License-Identifier: MIT */
/*
 * The table's invariant checker and test hooks, in the test build
 * (KL_TEST_HOOKS) only: kl__table_check walks every shard under its lock
 * and judges the chains, the slots (read atomically, judged only when they
 * stood still) and the queues against each other (TESTPLAN T06, T29).
 */
#include "config.h"

#define KL__TABLE_PRIVATE
#include "table.h"

#ifdef KL_TEST_HOOKS
/* GCOVR_EXCL_START: invariant checks of the test build; their failure
 * branches run only on a broken invariant, and users never get them. */
/* The modes of entry e, held or not in word st (read when it stood still):
 * shared holders only on a held key, each linked both ways and naming e,
 * with no exclusive holder beside them; and with the key held shared, no
 * queued request that could have it (a shared one at the head).  Lock
 * held. */
static int
check_modes(struct kl__entry *e, uint64_t st, const char *what)
{
	const struct kl__holder *h = shared_of(e, st);
	size_t n = 0;

	if ((st & (E_SHARED | E_SOLO)) && !(st & E_HELD)) {
		kl__test_report("%s: shared but not held, state %#llx", what,
				(unsigned long long)st);
		return KL_EINVAL;
	}
	if ((st & E_SHARED) && h == NULL) {
		kl__test_report("%s: a ring of nobody, state %#llx", what,
				(unsigned long long)st);
		return KL_EINVAL;
	}
	if ((st & E_SOLO) && !(st & E_SLOT)) {
		kl__test_report("%s: a lone shared holder of a chained key",
				what);
		return KL_EINVAL;
	}
	if ((st & E_SOLO) && h != NULL && !(st & E_WAITERS)) {
		kl__test_report("%s: a lone shared holder beside others, not "
				"marked: state %#llx",
				what, (unsigned long long)st);
		return KL_EINVAL;
	}
	if (h != NULL && !(st & E_SOLO) &&
	    atomic_load_explicit(&e->owner_tid, memory_order_relaxed) != 0) {
		kl__test_report("%s: shared holders and an owner %llu", what,
				(unsigned long long)atomic_load_explicit(
					&e->owner_tid, memory_order_relaxed));
		return KL_EINVAL;
	}
	if (h != NULL)
		do {
			if (++n > 1000000 || h->entry != e ||
			    h->next == NULL || h->prev == NULL ||
			    h->next->prev != h || h->prev->next != h ||
			    h->tid == 0 || h->fence > fence_of(st) ||
			    h->fence == 0) {
				kl__test_report("%s: shared holder %zu badly "
						"linked or named",
						what, n);
				return KL_EINVAL;
			}
			h = h->next;
		} while (h != e->shared);
	if (held_shared(st) && e->q.head != NULL &&
	    twaiter_of(e->q.head)->h != NULL &&
	    e->q.head->expire_ns > kl__now_ns()) {
		kl__test_report("%s: held shared, and a shared request "
				"waits at the head",
				what);
		return KL_EINVAL;
	}
	return KL_OK;
}

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
	if ((st & E_FLAGS & ~(uint64_t)(E_WAITERS | E_SHARED)) != E_HELD ||
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
	if (atomic_load_explicit(&e->owner_tid, memory_order_relaxed) == 0 &&
	    shared_of(e, st) == NULL) {
		kl__test_report("shard %d: entry '%s' has no holder", i,
				shown);
		return KL_EINVAL;
	}
	snprintf(what, sizeof what, "shard %d: entry '%s'", i, shown);
	if (check_modes(e, st, what) != KL_OK)
		return KL_EINVAL;
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
		bad = (st & (E_HELD | E_WAITERS | E_SHARED)) || qlen != 0;
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
	snprintf(what, sizeof what, "shard %d: slot %u", i, j);
	if (check_modes(e, st, what) != KL_OK)
		return KL_EINVAL;
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
