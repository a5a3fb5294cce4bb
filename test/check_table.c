/* SPDX-License-Identifier: MIT */
/*
 * Tests of the key table (src/table.h), the internal layer under the memory
 * provider: entries made on first use and freed on last release, slots that
 * short keys take over and give back without the lock, strict FIFO per key,
 * independence of keys, fences, try-once deadlines, error-check,
 * cancellation, keys of any bytes and length, memory that does not grow with
 * distinct keys, and resistance to keys crafted to collide under an unkeyed
 * hash.  Built with -DKL_TEST_HOOKS -I include -I src: it calls kl__*.
 *
 * Worker threads never call ck_assert*: they record statuses, grant ranks and
 * violation counts, and the test's thread asserts after joining them.  Orders
 * are forced by polling kl__table_queue_size, never by sleeping.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <check.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "internal.h"
#include "table.h"
#include "util.h"

/* Sanitizer runtimes keep freed memory in quarantine and map shadow memory,
 * so the resident set says nothing about leaks there (LSan checks those). */
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define UNDER_SANITIZER 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) ||    \
	__has_feature(memory_sanitizer)
#define UNDER_SANITIZER 1
#endif
#endif
#ifndef UNDER_SANITIZER
#define UNDER_SANITIZER 0
#endif

/* Deadlines: a bounded one fails a lost wake-up instead of hanging. */
static int64_t
past(void)
{
	return now_ns() - 1;
}

static int64_t
in_ms(int64_t ms)
{
	return now_ns() + ms * 1000000;
}

static struct kl__table *
table_new(void)
{
	struct kl__table *t = NULL;

	ck_assert_int_eq(kl__table_new(&t), KL_OK);
	ck_assert_ptr_nonnull(t);
	ck_assert_uint_eq(kl__table_size(t), 0);
	return t;
}

/* ------------------------------------------------------------------ */
/* A thread that acquires one key, records what happened and releases. */

struct tthread {
	pthread_t th;
	struct kl__table *t;
	const char *key;
	size_t len;
	int64_t deadline;
	kl_cancel *cancel;
	unsigned flags;
	atomic_int *next_seq; /* grant rank counter, may be NULL */
	/* Outputs. */
	int rc;
	int seq;
	uint64_t fence;
	int64_t start_ns, end_ns;
	atomic_bool done;
};

static void *
tthread_main(void *arg)
{
	struct tthread *w = arg;
	struct kl__entry *e = NULL;
	struct kl__holder h;

	w->start_ns = now_ns();
	if (w->flags & KL_SHARED)
		w->rc = kl__table_acquire_shared(w->t, w->key, w->len,
						 w->deadline, w->cancel,
						 w->flags, &h, &w->fence);
	else
		w->rc = kl__table_acquire(w->t, w->key, w->len, w->deadline,
					  w->cancel, w->flags, &e, &w->fence);
	w->end_ns = now_ns();
	if (w->rc == KL_OK) {
		if (w->next_seq != NULL)
			w->seq = atomic_fetch_add(w->next_seq, 1);
		if (w->flags & KL_SHARED)
			kl__table_release_shared(w->t, &h);
		else
			kl__table_release(w->t, e);
	}
	atomic_store(&w->done, true);
	return NULL;
}

static void
tthread_start(struct tthread *w, struct kl__table *t, const void *key,
	      size_t len, int64_t deadline)
{
	w->t = t;
	w->key = key;
	w->len = len;
	w->deadline = deadline;
	w->rc = 1; /* no KL_* value: never returned */
	w->seq = -1;
	w->fence = 0;
	atomic_init(&w->done, false);
	test_thread_start(&w->th, tthread_main, w);
}

static bool
tthread_done(void *arg)
{
	struct tthread *w = arg;

	return atomic_load(&w->done);
}

static void
tthread_join(struct tthread *w)
{
	test_poll(tthread_done, w, "a table thread to finish");
	test_thread_join(w->th);
}

/* Tries key once from another thread (so that it is not the holder) and
 * returns the status; releases at once when it got the key. */
static int
other_try(struct kl__table *t, const void *key, size_t len, unsigned flags)
{
	struct tthread w;

	memset(&w, 0, sizeof w);
	w.flags = flags;
	tthread_start(&w, t, key, len, past());
	tthread_join(&w);
	return w.rc;
}

struct qcond {
	struct kl__table *t;
	const char *key;
	size_t len;
	size_t n;
};

static bool
queue_is(void *arg)
{
	struct qcond *c = arg;

	return kl__table_queue_size(c->t, c->key, c->len) == c->n;
}

static void
wait_queue(struct kl__table *t, const void *key, size_t len, size_t n)
{
	struct qcond c = { .t = t, .key = key, .len = len, .n = n };

	test_poll(queue_is, &c, "the key's queue size");
}

static int
acquire(struct kl__table *t, const void *key, size_t len, int64_t deadline,
	struct kl__entry **e, uint64_t *fence)
{
	uint64_t f;

	return kl__table_acquire(t, key, len, deadline, NULL, 0, e,
				 fence != NULL ? fence : &f);
}

/* ------------------------------------------------------------------ */
/* Entry lifecycle                                                     */

START_TEST(test_entry_freed_on_last_release)
{
	struct kl__table *t = table_new();
	struct kl__table_stats st;
	struct kl__entry *a, *b;
	struct tthread w;

	memset(&w, 0, sizeof w);
	ck_assert_uint_eq(kl__table_queue_size(t, "a", 1), 0);
	ck_assert_uint_eq(kl__table_size(t), 0); /* asking made nothing */

	ck_assert_int_eq(acquire(t, "a", 1, past(), &a, NULL), KL_OK);
	ck_assert_uint_eq(kl__table_size(t), 1);
	ck_assert_uint_eq(kl__table_queue_size(t, "a", 1), 0);
	ck_assert_int_eq(acquire(t, "b", 1, past(), &b, NULL), KL_OK);
	ck_assert_uint_eq(kl__table_size(t), 2);

	/* A waiter on a held key adds no entry. */
	tthread_start(&w, t, "a", 1, in_ms(10000));
	wait_queue(t, "a", 1, 1);
	ck_assert_uint_eq(kl__table_size(t), 2);
	ck_assert_uint_eq(kl__table_queue_size(t, "missing", 7), 0);
	ck_assert_uint_eq(kl__table_size(t), 2);

	kl__table_release(t, b);
	ck_assert_uint_eq(kl__table_size(t), 1);
	kl__table_release(t, a); /* hands "a" to the waiter, which releases */
	tthread_join(&w);
	ck_assert_int_eq(w.rc, KL_OK);
	ck_assert_uint_eq(kl__table_size(t), 0);
	ck_assert_uint_eq(kl__table_queue_size(t, "a", 1), 0);
	kl__table_stats(t, &st);
	ck_assert_uint_eq(st.entries, 0);
	kl__table_free(t);
}
END_TEST

START_TEST(test_entry_reused_sequentially)
{
	struct kl__table *t = table_new();
	struct kl__entry *e;
	uint64_t fence, last = 0;

	for (int i = 0; i < 1000; i++) {
		ck_assert_int_eq(acquire(t, "seq", 3, past(), &e, &fence),
				 KL_OK);
		ck_assert_uint_eq(kl__table_size(t), 1);
		ck_assert_msg(i == 0 || fence > last,
			      "fence %llu after %llu at grant %d",
			      (unsigned long long)fence,
			      (unsigned long long)last, i);
		last = fence;
		kl__table_release(t, e);
		ck_assert_uint_eq(kl__table_size(t), 0);
	}
	kl__table_free(t);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Slots: a short key keeps its slot entry while idle                  */

static struct kl__table_stats
stats_of(struct kl__table *t)
{
	struct kl__table_stats st;

	kl__table_stats(t, &st);
	return st;
}

/* n keys "k<j>" whose hashes in t pick the shard of "k0" and, with
 * same_slot, its slot too. */
static void
keys_like_k0(struct kl__table *t, char keys[][24], int n, bool same_slot)
{
	uint32_t want = kl__table_hash(t, "k0", 2);

	snprintf(keys[0], 24, "k0");
	for (int i = 1, j = 1; i < n; j++) {
		uint32_t h;

		snprintf(keys[i], 24, "k%d", j);
		h = kl__table_hash(t, keys[i], strlen(keys[i]));
		if (h >> 26 == want >> 26 &&
		    (!same_slot ||
		     kl__table_slot_of(h) == kl__table_slot_of(want)))
			i++;
	}
}

/* The slots of one shard that keys[0..n-1] (all of that shard) pick. */
static size_t
slots_used(struct kl__table *t, char keys[][24], int n)
{
	bool used[KL__TABLE_SLOTS] = { false };
	size_t count = 0;

	for (int i = 0; i < n; i++) {
		uint32_t h = kl__table_hash(t, keys[i], strlen(keys[i]));

		if (!used[kl__table_slot_of(h)]) {
			used[kl__table_slot_of(h)] = true;
			count++;
		}
	}
	return count;
}

START_TEST(test_idle_entry_reused)
{
	struct kl__table *t = table_new();
	struct kl__entry *e, *again;
	uint64_t f1, f2;

	ck_assert_int_eq(acquire(t, "hot", 3, past(), &e, &f1), KL_OK);
	kl__table_release(t, e);
	ck_assert_uint_eq(kl__table_size(t), 0);
	ck_assert_uint_eq(stats_of(t).entries, 0);
	ck_assert_uint_eq(stats_of(t).idle, 1);
	ck_assert_uint_eq(kl__table_queue_size(t, "hot", 3), 0);
	ck_assert_int_eq(kl__table_check(t), KL_OK);

	/* Taken again: the same entry, held, a larger fence. */
	ck_assert_int_eq(acquire(t, "hot", 3, past(), &again, &f2), KL_OK);
	ck_assert_ptr_eq(again, e);
	ck_assert_uint_gt(f2, f1);
	ck_assert_uint_eq(kl__table_size(t), 1);
	ck_assert_uint_eq(stats_of(t).idle, 0);
	ck_assert_int_eq(other_try(t, "hot", 3, 0), KL_ETIMEDOUT);
	ck_assert_int_eq(kl__table_check(t), KL_OK);
	kl__table_release(t, again);
	ck_assert_uint_eq(kl__table_size(t), 0);
	ck_assert_int_eq(other_try(t, "hot", 3, 0), KL_OK);
	ck_assert_int_eq(kl__table_check(t), KL_OK);
	kl__table_free(t); /* frees the slots: LSan and Valgrind */
}
END_TEST

/* A new key takes over the idle slot of its index, which then belongs to
 * the new key only; the old key, taken while the slot is held, is
 * chained, and its fences keep growing across both entries. */
START_TEST(test_idle_slot_taken_over)
{
	struct kl__table *t = table_new();
	char keys[2][24];
	struct kl__entry *a, *b, *c;
	uint64_t fa, fb, fc, fd;

	keys_like_k0(t, keys, 2, true);
	ck_assert_int_eq(acquire(t, keys[0], strlen(keys[0]), past(), &a,
				 &fa),
			 KL_OK);
	kl__table_release(t, a);
	ck_assert_uint_eq(stats_of(t).idle, 1);
	ck_assert_int_eq(acquire(t, keys[1], strlen(keys[1]), past(), &b,
				 &fb),
			 KL_OK);
	ck_assert_ptr_eq(b, a);
	ck_assert_uint_gt(fb, fa);
	ck_assert_str_eq(kl__entry_key(b), keys[1]);
	ck_assert_uint_eq(stats_of(t).idle, 0);
	ck_assert_uint_eq(stats_of(t).entries, 1);
	ck_assert_uint_eq(stats_of(t).chained, 0);
	ck_assert_int_eq(kl__table_check(t), KL_OK);
	/* keys[0] has no entry now: it is chained while keys[1] holds the
	 * slot, with a fence past every one it had. */
	ck_assert_int_eq(acquire(t, keys[0], strlen(keys[0]), past(), &c,
				 &fc),
			 KL_OK);
	ck_assert_ptr_ne(c, a);
	ck_assert_uint_gt(fc, fa);
	ck_assert_uint_eq(stats_of(t).chained, 1);
	ck_assert_int_eq(kl__table_check(t), KL_OK);
	ck_assert_int_eq(other_try(t, keys[0], strlen(keys[0]), 0),
			 KL_ETIMEDOUT);
	ck_assert_int_eq(other_try(t, keys[1], strlen(keys[1]), 0),
			 KL_ETIMEDOUT);
	kl__table_release(t, c);
	ck_assert_uint_eq(stats_of(t).chained, 0);
	kl__table_release(t, b);
	ck_assert_uint_eq(kl__table_size(t), 0);
	ck_assert_int_eq(kl__table_check(t), KL_OK);
	/* Back in the slot, by taking it over from keys[1]. */
	ck_assert_int_eq(acquire(t, keys[0], strlen(keys[0]), past(), &a,
				 &fd),
			 KL_OK);
	ck_assert_ptr_eq(a, b);
	ck_assert_uint_gt(fd, fc);
	kl__table_release(t, a);
	ck_assert_int_eq(kl__table_check(t), KL_OK);
	kl__table_free(t);
}
END_TEST

/* Keys chained behind a held slot keep it marked until the last goes;
 * then a new key may take the slot again. */
#define CHAINED_N 5

START_TEST(test_chained_keys_mark_their_slot)
{
	struct kl__table *t = table_new();
	char keys[CHAINED_N + 1][24];
	struct kl__entry *e[CHAINED_N + 1];
	uint64_t f[CHAINED_N + 1], again;

	keys_like_k0(t, keys, CHAINED_N + 1, true);
	for (int i = 0; i < CHAINED_N; i++)
		ck_assert_int_eq(acquire(t, keys[i], strlen(keys[i]), past(),
					 &e[i], &f[i]),
				 KL_OK);
	ck_assert_uint_eq(stats_of(t).chained, CHAINED_N - 1);
	ck_assert_int_eq(kl__table_check(t), KL_OK);
	/* The slot's holder goes first: its slot stays idle, marked. */
	kl__table_release(t, e[0]);
	ck_assert_uint_eq(stats_of(t).idle, 1);
	for (int i = 1; i < CHAINED_N; i++) {
		ck_assert_int_eq(kl__table_check(t), KL_OK);
		kl__table_release(t, e[i]);
		ck_assert_uint_eq(stats_of(t).chained,
				  (size_t)(CHAINED_N - 1 - i));
	}
	ck_assert_int_eq(kl__table_check(t), KL_OK);
	/* Unmarked now: a new key takes the slot, with a fence past every
	 * fence a chained key of the slot had. */
	ck_assert_int_eq(acquire(t, keys[CHAINED_N],
				 strlen(keys[CHAINED_N]), past(),
				 &e[CHAINED_N], &again),
			 KL_OK);
	ck_assert_ptr_eq(e[CHAINED_N], e[0]);
	ck_assert_uint_eq(stats_of(t).chained, 0);
	for (int i = 0; i < CHAINED_N; i++)
		ck_assert_uint_gt(again, f[i]);
	kl__table_release(t, e[CHAINED_N]);
	ck_assert_uint_eq(kl__table_size(t), 0);
	ck_assert_int_eq(kl__table_check(t), KL_OK);
	kl__table_free(t);
}
END_TEST

/* An idle slot taken again, with waiters, must be handed over in order,
 * not given back by the holder's compare-and-swap. */
START_TEST(test_idle_entry_hands_off_in_order)
{
	struct kl__table *t = table_new();
	struct tthread w[3];
	struct kl__entry *e;
	atomic_int next = 0;

	ck_assert_int_eq(acquire(t, "k", 1, past(), &e, NULL), KL_OK);
	kl__table_release(t, e);
	ck_assert_int_eq(acquire(t, "k", 1, past(), &e, NULL), KL_OK);
	ck_assert_uint_eq(stats_of(t).idle, 0);
	for (int i = 0; i < 3; i++) {
		memset(&w[i], 0, sizeof w[i]);
		w[i].next_seq = &next;
		tthread_start(&w[i], t, "k", 1, in_ms(30000));
		wait_queue(t, "k", 1, (size_t)i + 1);
	}
	ck_assert_int_eq(kl__table_check(t), KL_OK);
	kl__table_release(t, e);
	for (int i = 0; i < 3; i++) {
		tthread_join(&w[i]);
		ck_assert_int_eq(w[i].rc, KL_OK);
		ck_assert_int_eq(w[i].seq, i);
	}
	ck_assert_uint_eq(kl__table_size(t), 0);
	ck_assert_uint_eq(stats_of(t).idle, 1);
	ck_assert_int_eq(kl__table_check(t), KL_OK);
	kl__table_free(t);
}
END_TEST

/* A waiter that times out leaves its mark on the slot: the next release
 * goes through the lock, finds nobody, and leaves the slot idle. */
START_TEST(test_idle_entry_after_waiter_timed_out)
{
	struct kl__table *t = table_new();
	struct tthread w;
	struct kl__entry *e;

	memset(&w, 0, sizeof w);
	ck_assert_int_eq(acquire(t, "k", 1, past(), &e, NULL), KL_OK);
	tthread_start(&w, t, "k", 1, in_ms(30));
	tthread_join(&w);
	ck_assert_int_eq(w.rc, KL_ETIMEDOUT);
	ck_assert_uint_eq(kl__table_queue_size(t, "k", 1), 0);
	ck_assert_int_eq(kl__table_check(t), KL_OK);
	kl__table_release(t, e);
	ck_assert_uint_eq(kl__table_size(t), 0);
	ck_assert_uint_eq(stats_of(t).idle, 1);
	ck_assert_int_eq(kl__table_check(t), KL_OK);
	ck_assert_int_eq(other_try(t, "k", 1, 0), KL_OK);
	/* And the mark is gone: a fresh holder and waiter work as ever. */
	ck_assert_int_eq(acquire(t, "k", 1, past(), &e, NULL), KL_OK);
	tthread_start(&w, t, "k", 1, in_ms(30000));
	wait_queue(t, "k", 1, 1);
	kl__table_release(t, e);
	tthread_join(&w);
	ck_assert_int_eq(w.rc, KL_OK);
	ck_assert_uint_eq(kl__table_size(t), 0);
	kl__table_free(t);
}
END_TEST

#define BIG_SHARD 40

START_TEST(test_idle_entries_bounded_per_shard)
{
	struct kl__table *t = table_new();
	char (*keys)[24] = malloc(200 * sizeof *keys);
	struct kl__entry *e[BIG_SHARD];
	struct kl__table_stats st;

	ck_assert_ptr_nonnull(keys);
	keys_like_k0(t, keys, 200, false);
	for (int i = 0; i < BIG_SHARD; i++)
		ck_assert_int_eq(acquire(t, keys[i], strlen(keys[i]), past(),
					 &e[i], NULL),
				 KL_OK);
	st = stats_of(t);
	ck_assert_uint_eq(st.entries, BIG_SHARD);
	ck_assert_uint_ge(st.chained, BIG_SHARD - KL__TABLE_SLOTS);
	ck_assert_int_eq(kl__table_check(t), KL_OK);
	/* Chained entries go with their key; slots stay, idle. */
	for (int i = BIG_SHARD - 1; i >= 0; i--) {
		kl__table_release(t, e[i]);
		ck_assert_uint_eq(stats_of(t).entries, (size_t)i);
		ck_assert_uint_le(stats_of(t).idle, KL__TABLE_SLOTS);
	}
	st = stats_of(t);
	ck_assert_uint_eq(st.chained, 0);
	/* One idle slot for each slot index the keys used. */
	ck_assert_uint_eq(st.idle, slots_used(t, keys, BIG_SHARD));
	ck_assert_int_eq(kl__table_check(t), KL_OK);
	/* New keys of the shard, one at a time: they take over slots, and
	 * nothing else stays. */
	for (int i = BIG_SHARD; i < 200; i++) {
		ck_assert_int_eq(acquire(t, keys[i], strlen(keys[i]), past(),
					 &e[0], NULL),
				 KL_OK);
		kl__table_release(t, e[0]);
		ck_assert_uint_le(stats_of(t).idle, KL__TABLE_SLOTS);
		ck_assert_uint_eq(kl__table_size(t), 0);
	}
	st = stats_of(t);
	ck_assert_uint_eq(st.chained, 0);
	ck_assert_uint_eq(st.buckets, 8); /* shrunk back to the minimum */
	ck_assert_int_eq(kl__table_check(t), KL_OK);
	for (int i = 0; i < 200; i++)
		ck_assert_int_eq(other_try(t, keys[i], strlen(keys[i]), 0),
				 KL_OK);
	free(keys);
	kl__table_free(t);
}
END_TEST

START_TEST(test_idle_entries_bounded_overall)
{
	struct kl__table *t = table_new();
	char key[32];

	for (int i = 0; i < 5000; i++) {
		struct kl__entry *e;
		int n = snprintf(key, sizeof key, "user:%d", i);

		ck_assert_int_eq(acquire(t, key, (size_t)n, past(), &e, NULL),
				 KL_OK);
		kl__table_release(t, e);
	}
	ck_assert_uint_eq(kl__table_size(t), 0);
	ck_assert_uint_le(stats_of(t).idle,
			  (size_t)KL__TABLE_SHARDS * KL__TABLE_SLOTS);
	ck_assert_uint_gt(stats_of(t).idle, 0);
	ck_assert_uint_eq(stats_of(t).chained, 0);
	ck_assert_int_eq(kl__table_check(t), KL_OK);
	kl__table_free(t); /* frees the slots: LSan and Valgrind */
}
END_TEST

/* ------------------------------------------------------------------ */
/* Order and independence                                              */

#define FIFO_N 8

START_TEST(test_fifo_per_key)
{
	struct kl__table *t = table_new();
	struct tthread w[FIFO_N];
	struct kl__entry *e;
	atomic_int next = 0;
	uint64_t f0;

	memset(w, 0, sizeof w);
	ck_assert_int_eq(acquire(t, "fifo", 4, past(), &e, &f0), KL_OK);
	for (int i = 0; i < FIFO_N; i++) {
		w[i].next_seq = &next;
		tthread_start(&w[i], t, "fifo", 4, in_ms(30000));
		wait_queue(t, "fifo", 4, (size_t)i + 1);
	}
	ck_assert_uint_eq(kl__table_size(t), 1);
	kl__table_release(t, e);
	for (int i = 0; i < FIFO_N; i++)
		tthread_join(&w[i]);
	for (int i = 0; i < FIFO_N; i++) {
		ck_assert_int_eq(w[i].rc, KL_OK);
		ck_assert_int_eq(w[i].seq, i);
		/* Every grant, hand-offs included, gets a greater fence. */
		ck_assert(w[i].fence > (i == 0 ? f0 : w[i - 1].fence));
	}
	ck_assert_uint_eq(kl__table_size(t), 0);
	kl__table_free(t);
}
END_TEST

START_TEST(test_keys_independent)
{
	struct kl__table *t = table_new();
	struct kl__entry *e;
	struct tthread w;

	memset(&w, 0, sizeof w);
	ck_assert_int_eq(acquire(t, "a", 1, past(), &e, NULL), KL_OK);
	ck_assert_int_eq(other_try(t, "b", 1, 0), KL_OK);
	/* A blocking acquire of another key returns while "a" is held. */
	tthread_start(&w, t, "b", 1, in_ms(10000));
	tthread_join(&w);
	ck_assert_int_eq(w.rc, KL_OK);
	ck_assert_uint_eq(kl__table_queue_size(t, "a", 1), 0);
	ck_assert_uint_eq(kl__table_size(t), 1);
	kl__table_release(t, e);
	ck_assert_uint_eq(kl__table_size(t), 0);
	kl__table_free(t);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Deadlines, error-check, cancellation                                */

START_TEST(test_past_deadline_tries_once)
{
	struct kl__table *t = table_new();
	const int64_t pasts[] = { 0, INT64_MIN, 1, -1 };
	struct kl__entry *e;
	struct tthread w;

	/* Free: a past deadline still takes it. */
	ck_assert_int_eq(acquire(t, "k", 1, past(), &e, NULL), KL_OK);
	/* Held: every past deadline fails at once without queueing. */
	ck_assert_int_eq(other_try(t, "k", 1, 0), KL_ETIMEDOUT);
	for (size_t i = 0; i < sizeof pasts / sizeof pasts[0]; i++) {
		memset(&w, 0, sizeof w);
		tthread_start(&w, t, "k", 1, pasts[i]);
		tthread_join(&w);
		ck_assert_int_eq(w.rc, KL_ETIMEDOUT);
	}
	ck_assert_uint_eq(kl__table_queue_size(t, "k", 1), 0);
	ck_assert_uint_eq(kl__table_size(t), 1);
	kl__table_release(t, e);
	ck_assert_uint_eq(kl__table_size(t), 0);
	kl__table_free(t);
}
END_TEST

START_TEST(test_deadline_times_out_and_leaves)
{
	struct kl__table *t = table_new();
	struct kl__entry *e;
	struct tthread w;
	int64_t deadline;

	memset(&w, 0, sizeof w);
	ck_assert_int_eq(acquire(t, "k", 1, past(), &e, NULL), KL_OK);
	deadline = in_ms(50);
	tthread_start(&w, t, "k", 1, deadline);
	tthread_join(&w);
	ck_assert_int_eq(w.rc, KL_ETIMEDOUT);
	/* Never early; late by less than a generous bound. */
	ck_assert_msg(w.end_ns >= deadline, "returned %lld ns early",
		      (long long)(deadline - w.end_ns));
	ck_assert_int_lt(w.end_ns - deadline, 5000 * 1000000LL);
	ck_assert_uint_eq(kl__table_queue_size(t, "k", 1), 0);
	ck_assert_uint_eq(kl__table_size(t), 1);
	kl__table_release(t, e);
	ck_assert_uint_eq(kl__table_size(t), 0);
	kl__table_free(t);
}
END_TEST

/* The holder re-entering: plain mode is not reentrant (try once times
 * out, no deadlock), error-check mode reports KL_EDEADLK at once; another
 * thread in error-check mode just waits. */
START_TEST(test_errorcheck_reacquire)
{
	struct kl__table *t = table_new();
	struct kl__entry *e, *e2 = NULL;
	uint64_t fence;
	int64_t t0;

	ck_assert_int_eq(kl__table_acquire(t, "k", 1, past(), NULL,
					   KL_ERRORCHECK, &e, &fence),
			 KL_OK);
	t0 = now_ns();
	ck_assert_int_eq(kl__table_acquire(t, "k", 1, in_ms(10000), NULL,
					   KL_ERRORCHECK, &e2, &fence),
			 KL_EDEADLK);
	ck_assert_int_lt(now_ns() - t0, 5000 * 1000000LL);
	ck_assert_int_eq(kl__table_acquire(t, "k", 1, past(), NULL, 0, &e2,
					   &fence),
			 KL_ETIMEDOUT);
	ck_assert_int_eq(other_try(t, "k", 1, KL_ERRORCHECK), KL_ETIMEDOUT);
	ck_assert_uint_eq(kl__table_queue_size(t, "k", 1), 0);
	ck_assert_uint_eq(kl__table_size(t), 1);
	kl__table_release(t, e);
	ck_assert_uint_eq(kl__table_size(t), 0);

	/* Held without the flag: the holding thread is still known. */
	ck_assert_int_eq(acquire(t, "k", 1, past(), &e, NULL), KL_OK);
	ck_assert_int_eq(kl__table_acquire(t, "k", 1, in_ms(10000), NULL,
					   KL_ERRORCHECK, &e2, &fence),
			 KL_EDEADLK);
	kl__table_release(t, e);

	/* Once released, the same thread takes it again. */
	ck_assert_int_eq(kl__table_acquire(t, "k", 1, past(), NULL,
					   KL_ERRORCHECK, &e, &fence),
			 KL_OK);
	kl__table_release(t, e);
	ck_assert_uint_eq(kl__table_size(t), 0);
	kl__table_free(t);
}
END_TEST

START_TEST(test_cancel_leaves_queue)
{
	struct kl__table *t = table_new();
	struct tthread w[3];
	struct kl__entry *e;
	kl_cancel *c;
	atomic_int next = 0;

	memset(w, 0, sizeof w);
	ck_assert_int_eq(kl_cancel_new(&c), KL_OK);
	ck_assert_int_eq(acquire(t, "k", 1, past(), &e, NULL), KL_OK);
	for (int i = 0; i < 3; i++) {
		w[i].next_seq = &next;
		w[i].cancel = i == 1 ? c : NULL;
		tthread_start(&w[i], t, "k", 1,
			      i == 1 ? KL_NO_DEADLINE : in_ms(30000));
		wait_queue(t, "k", 1, (size_t)i + 1);
	}
	kl_cancel_fire(c);
	tthread_join(&w[1]);
	ck_assert_int_eq(w[1].rc, KL_ECANCELED);
	ck_assert_uint_eq(kl__table_queue_size(t, "k", 1), 2);
	ck_assert_uint_eq(kl__table_size(t), 1);
	kl__table_release(t, e);
	tthread_join(&w[0]);
	tthread_join(&w[2]);
	ck_assert_int_eq(w[0].rc, KL_OK);
	ck_assert_int_eq(w[2].rc, KL_OK);
	ck_assert_int_eq(w[0].seq, 0);
	ck_assert_int_eq(w[2].seq, 1);
	ck_assert_int_eq(w[1].seq, -1);
	ck_assert_uint_eq(kl__table_size(t), 0);
	kl_cancel_free(c);
	kl__table_free(t);
}
END_TEST

/* A token that fires by itself ends the wait with KL_ECANCELED, not
 * KL_ETIMEDOUT, and never early. */
START_TEST(test_cancel_token_timeout)
{
	struct kl__table *t = table_new();
	struct kl__entry *e;
	struct tthread w;
	kl_cancel *c;
	int64_t fires;

	memset(&w, 0, sizeof w);
	ck_assert_int_eq(acquire(t, "k", 1, past(), &e, NULL), KL_OK);
	fires = now_ns() + 50 * 1000000LL;
	ck_assert_int_eq(kl_cancel_new_timeout(&c, 50), KL_OK);
	w.cancel = c;
	tthread_start(&w, t, "k", 1, KL_NO_DEADLINE);
	tthread_join(&w);
	ck_assert_int_eq(w.rc, KL_ECANCELED);
	ck_assert_int_ge(w.end_ns, fires);
	ck_assert_int_lt(w.end_ns - fires, 5000 * 1000000LL);
	ck_assert_uint_eq(kl__table_queue_size(t, "k", 1), 0);
	kl__table_release(t, e);
	ck_assert_uint_eq(kl__table_size(t), 0);
	kl_cancel_free(c);
	kl__table_free(t);
}
END_TEST

/* A token fired before the call: KL_ECANCELED at once, free key or not,
 * and no entry is left behind. */
START_TEST(test_cancel_prefired)
{
	struct kl__table *t = table_new();
	struct kl__entry *e = NULL;
	uint64_t fence;
	kl_cancel *c;

	ck_assert_int_eq(kl_cancel_new(&c), KL_OK);
	kl_cancel_fire(c);
	ck_assert_int_eq(kl__table_acquire(t, "k", 1, KL_NO_DEADLINE, c, 0, &e,
					   &fence),
			 KL_ECANCELED);
	ck_assert_uint_eq(kl__table_size(t), 0);
	kl_cancel_free(c);
	kl__table_free(t);
}
END_TEST

/* ------------------------------------------------------------------ */
/* The bug hunt: the last release (entry freed or idle) racing acquires */

#define RACE_THREADS 4
#define RACE_MAX_KEYS 4

struct race {
	struct kl__table *t;
	int nkeys;
	long rounds;
	bool mixed; /* also try once and wait 1 ms: marks left by waiters */
	const char *keys[RACE_MAX_KEYS];
	volatile int inside[RACE_MAX_KEYS]; /* plain: guarded by the key */
	uint64_t last_fence[RACE_MAX_KEYS]; /* plain: guarded by the key */
	atomic_long violations;
	atomic_long fence_errors;
	atomic_long errors;
};

struct race_worker {
	pthread_t th;
	struct race *r;
	unsigned id;
};

static const char *const race_keys[RACE_MAX_KEYS] = { "hot0", "hot1",
						      "hot2", "hot3" };

static void *
race_main(void *arg)
{
	struct race_worker *rw = arg;
	struct race *r = rw->r;
	uint32_t x = 2463534242u + rw->id * 7919u;

	for (long i = 0; i < r->rounds; i++) {
		struct kl__entry *e;
		uint64_t fence;
		int k;

		x ^= x << 13;
		x ^= x >> 17;
		x ^= x << 5;
		k = (int)(x % (uint32_t)r->nkeys);
		/* Bounded, so that a lost entry fails the test in 30 s
		 * instead of hanging it. */
		int64_t deadline = in_ms(30000);
		int rc;

		if (r->mixed && (x >> 8) % 3 == 0)
			deadline = past();
		else if (r->mixed && (x >> 8) % 3 == 1)
			deadline = in_ms(1);
		rc = kl__table_acquire(r->t, r->keys[k], strlen(r->keys[k]),
				       deadline, NULL, 0, &e, &fence);
		/* How many short tries fail depends on the schedule. */
		if (rc == KL_ETIMEDOUT && deadline < in_ms(2))
			continue;
		if (rc != KL_OK) {
			atomic_fetch_add(&r->errors, 1);
			continue;
		}
		if (++r->inside[k] != 1)
			atomic_fetch_add(&r->violations, 1);
		if (fence <= r->last_fence[k])
			atomic_fetch_add(&r->fence_errors, 1);
		r->last_fence[k] = fence;
		for (int j = 0; j < 4; j++) {
			if (r->inside[k] != 1)
				atomic_fetch_add(&r->violations, 1);
		}
		r->inside[k]--;
		kl__table_release(r->t, e);
	}
	return NULL;
}

/* With one_slot, the keys share a slot: one sits in it, the others are
 * chained behind it, and the slot changes keys all the time. */
static void
race_run(bool mixed, bool one_slot)
{
	struct race_worker w[RACE_THREADS];
	struct race r;
	struct kl__table_stats st;
	long errors, violations, fence_errors;
	char keys[RACE_MAX_KEYS][24];

	for (int nkeys = mixed ? 1 : 2; nkeys <= RACE_MAX_KEYS; nkeys++) {
		memset(&r, 0, sizeof r);
		r.t = table_new();
		r.nkeys = nkeys;
		r.mixed = mixed;
		if (one_slot)
			keys_like_k0(r.t, keys, RACE_MAX_KEYS, true);
		for (int k = 0; k < RACE_MAX_KEYS; k++)
			r.keys[k] = one_slot ? keys[k] : race_keys[k];
		r.rounds = kl_test_scaled(100000, 1000);
		for (int i = 0; i < RACE_THREADS; i++) {
			w[i].r = &r;
			w[i].id = (unsigned)i;
			test_thread_start(&w[i].th, race_main, &w[i]);
		}
		for (int i = 0; i < RACE_THREADS; i++)
			test_thread_join(w[i].th);
		errors = atomic_load(&r.errors);
		violations = atomic_load(&r.violations);
		fence_errors = atomic_load(&r.fence_errors);
		ck_assert_msg(errors == 0, "%ld acquires failed on %d keys",
			      errors, nkeys);
		ck_assert_msg(violations == 0,
			      "%ld mutual exclusion violations on %d keys",
			      violations, nkeys);
		ck_assert_msg(fence_errors == 0,
			      "%ld fences did not grow on %d keys",
			      fence_errors, nkeys);
		ck_assert_uint_eq(kl__table_size(r.t), 0);
		kl__table_stats(r.t, &st);
		ck_assert_uint_eq(st.entries, 0);
		for (int k = 0; k < nkeys; k++)
			ck_assert_int_eq(r.inside[k], 0);
		ck_assert_int_eq(kl__table_check(r.t), KL_OK);
		kl__table_free(r.t);
	}
}

START_TEST(test_last_release_races_acquire)
{
	race_run(false, false);
}
END_TEST

/* Entries given back by CAS while others try once or time out and
 * leave marks: still one holder at a time, every fence larger. */
START_TEST(test_cas_release_races_timeouts)
{
	race_run(true, false);
}
END_TEST

/* Keys of one slot: lock-free take-overs of the slot race chained inserts
 * and their removal under the lock, with and without marks left by
 * waiters.  Still one holder per key, and every fence larger. */
START_TEST(test_slot_takeover_races_chains)
{
	race_run(false, true);
	race_run(true, true);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Keys of any bytes and any length                                    */

/* Holds key (copied from buf), checks another thread cannot take an equal
 * key in a different buffer, that the table keeps its own copy after buf is
 * overwritten, and that the key is free after release. */
static void
check_key(struct kl__table *t, char *buf, size_t len)
{
	char *copy = malloc(len + 1);
	struct kl__entry *e;

	ck_assert_ptr_nonnull(copy);
	memcpy(copy, buf, len);
	copy[len] = '\0';
	ck_assert_int_eq(acquire(t, buf, len, past(), &e, NULL), KL_OK);
	ck_assert_uint_eq(kl__table_size(t), 1);
	memset(buf, 'Z', len); /* the table must hold its own copy */
	ck_assert_int_eq(other_try(t, copy, len, 0), KL_ETIMEDOUT);
	ck_assert_uint_eq(kl__table_queue_size(t, copy, len), 0);
	if (len > 0 && memcmp(buf, copy, len) != 0) {
		/* The overwritten bytes are another key. */
		ck_assert_int_eq(other_try(t, buf, len, 0), KL_OK);
	}
	ck_assert_uint_eq(kl__table_size(t), 1);
	kl__table_release(t, e);
	ck_assert_uint_eq(kl__table_size(t), 0);
	ck_assert_int_eq(other_try(t, copy, len, 0), KL_OK);
	memcpy(buf, copy, len);
	free(copy);
}

START_TEST(test_key_empty_and_one_byte)
{
	struct kl__table *t = table_new();
	char empty[1] = "";
	char one[2] = "x";
	struct kl__entry *e;

	check_key(t, empty, 0);
	check_key(t, one, 1);
	/* "" and "x" are different keys. */
	ck_assert_int_eq(acquire(t, "", 0, past(), &e, NULL), KL_OK);
	ck_assert_int_eq(other_try(t, "x", 1, 0), KL_OK);
	kl__table_release(t, e);
	ck_assert_uint_eq(kl__table_size(t), 0);
	kl__table_free(t);
}
END_TEST

START_TEST(test_key_long)
{
	const size_t sizes[] = { 4096, 1024 * 1024 };
	struct kl__table *t = table_new();

	for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
		size_t len = sizes[s];
		char *buf = malloc(len + 1);
		char *other = malloc(len + 1);
		struct kl__entry *e;

		ck_assert_ptr_nonnull(buf);
		ck_assert_ptr_nonnull(other);
		for (size_t i = 0; i < len; i++)
			buf[i] = (char)('a' + i % 26);
		buf[len] = '\0';
		check_key(t, buf, len);

		/* Differing only in the last byte: independent keys. */
		memcpy(other, buf, len + 1);
		other[len - 1] = '#';
		ck_assert_int_eq(acquire(t, buf, len, past(), &e, NULL),
				 KL_OK);
		ck_assert_int_eq(other_try(t, other, len, 0), KL_OK);
		/* A prefix is another key too. */
		ck_assert_int_eq(other_try(t, buf, len - 1, 0), KL_OK);
		kl__table_release(t, e);
		ck_assert_uint_eq(kl__table_size(t), 0);
		free(other);
		free(buf);
	}
	kl__table_free(t);
}
END_TEST

START_TEST(test_key_binary_bytes)
{
	struct kl__table *t = table_new();
	char bin[256], all[256];
	struct kl__entry *e;

	for (int i = 0; i < 255; i++)
		bin[i] = (char)(i + 1); /* 0x01 .. 0xFF */
	bin[255] = '\0';
	check_key(t, bin, 255);
	for (int i = 0; i < 256; i++)
		all[i] = (char)i; /* 0x00 .. 0xFF, NUL first */
	check_key(t, all, 256);

	/* Invalid UTF-8 differing in one high byte: different keys. */
	ck_assert_int_eq(acquire(t, "\xc3\x28", 2, past(), &e, NULL), KL_OK);
	ck_assert_int_eq(other_try(t, "\xc3\x29", 2, 0), KL_OK);
	ck_assert_int_eq(other_try(t, "\xc3\x28", 2, 0), KL_ETIMEDOUT);
	kl__table_release(t, e);
	ck_assert_uint_eq(kl__table_size(t), 0);
	kl__table_free(t);
}
END_TEST

/* The table takes a length, so NUL is an ordinary byte: "a", "a\0",
 * "a\0b" and "a\0c" are four different keys. */
START_TEST(test_key_embedded_nul)
{
	static const struct {
		const char *key;
		size_t len;
	} keys[] = { { "a", 1 }, { "a\0", 2 }, { "a\0b", 3 }, { "a\0c", 3 } };
	enum { N = sizeof keys / sizeof keys[0] };
	struct kl__table *t = table_new();
	struct kl__entry *e[N];

	for (int i = 0; i < N; i++) {
		ck_assert_int_eq(acquire(t, keys[i].key, keys[i].len, past(),
					 &e[i], NULL),
				 KL_OK);
		ck_assert_uint_eq(kl__table_size(t), (size_t)i + 1);
	}
	for (int i = 0; i < N; i++) {
		ck_assert_int_eq(other_try(t, keys[i].key, keys[i].len, 0),
				 KL_ETIMEDOUT);
		ck_assert_uint_eq(
			kl__table_queue_size(t, keys[i].key, keys[i].len), 0);
	}
	ck_assert_int_eq(other_try(t, "a\0d", 3, 0), KL_OK);
	for (int i = 0; i < N; i++)
		kl__table_release(t, e[i]);
	ck_assert_uint_eq(kl__table_size(t), 0);
	kl__table_free(t);
}
END_TEST

/* Many live keys that a C-string comparison, or one that ignores the
 * length, would confuse: they differ only after a NUL, or are prefixes of
 * one another.  Enough of them share buckets for such a comparison to be
 * hit. */
#define MANY_KEYS 2048

START_TEST(test_key_many_confusable)
{
	struct kl__table *t = table_new();
	struct kl__entry **e = malloc(2 * MANY_KEYS * sizeof *e);
	char *nul = malloc(MANY_KEYS * 8);
	char *prefix = malloc(MANY_KEYS);

	ck_assert_ptr_nonnull(e);
	ck_assert_ptr_nonnull(nul);
	ck_assert_ptr_nonnull(prefix);
	memset(prefix, 'p', MANY_KEYS);
	for (int i = 0; i < MANY_KEYS; i++) {
		char *k = nul + i * 8;

		k[0] = 'n';
		k[1] = '\0';
		memcpy(k + 2, &i, sizeof i);
		ck_assert_int_eq(acquire(t, k, 2 + sizeof i, past(), &e[i],
					 NULL),
				 KL_OK);
		/* Lengths 1 .. MANY_KEYS of the same bytes. */
		ck_assert_int_eq(acquire(t, prefix, (size_t)i + 1, past(),
					 &e[MANY_KEYS + i], NULL),
				 KL_OK);
	}
	ck_assert_uint_eq(kl__table_size(t), 2 * MANY_KEYS);
	for (int i = 0; i < 2 * MANY_KEYS; i++)
		kl__table_release(t, e[i]);
	ck_assert_uint_eq(kl__table_size(t), 0);
	kl__table_free(t);
	free(prefix);
	free(nul);
	free(e);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Scale: a million distinct keys leave nothing behind                 */

#define SCALE_THREADS 4
#define SCALE_LIVE 256 /* entries each thread holds at most at once */

struct scale_worker {
	pthread_t th;
	struct kl__table *t;
	const char *prefix;
	long first, end;
	long errors;
};

static void *
scale_main(void *arg)
{
	struct scale_worker *sw = arg;
	struct kl__entry *ring[SCALE_LIVE] = { NULL };
	char key[64];
	long pos = 0;

	for (long i = sw->first; i < sw->end; i++, pos++) {
		struct kl__entry **slot = &ring[pos % SCALE_LIVE];
		uint64_t fence;
		int n;

		if (*slot != NULL)
			kl__table_release(sw->t, *slot); /* the oldest */
		*slot = NULL;
		/* The same buffer for every key: the table copies it. */
		n = snprintf(key, sizeof key, "%s%ld", sw->prefix, i);
		if (kl__table_acquire(sw->t, key, (size_t)n, KL_NO_DEADLINE,
				      NULL, 0, slot, &fence) != KL_OK) {
			sw->errors++;
			*slot = NULL;
		}
	}
	for (int j = 0; j < SCALE_LIVE; j++) {
		if (ring[j] != NULL)
			kl__table_release(sw->t, ring[j]);
	}
	return NULL;
}

static long
run_scale(struct kl__table *t, const char *prefix, long n)
{
	struct scale_worker w[SCALE_THREADS];
	long errors = 0;

	for (int i = 0; i < SCALE_THREADS; i++) {
		w[i].t = t;
		w[i].prefix = prefix;
		w[i].first = n * i / SCALE_THREADS;
		w[i].end = n * (i + 1) / SCALE_THREADS;
		w[i].errors = 0;
		test_thread_start(&w[i].th, scale_main, &w[i]);
	}
	for (int i = 0; i < SCALE_THREADS; i++) {
		test_thread_join(w[i].th);
		errors += w[i].errors;
	}
	return errors;
}

static long
resident_bytes(void)
{
	long size = 0, resident = 0;
	FILE *f = fopen("/proc/self/statm", "r");

	if (f == NULL)
		return -1;
	if (fscanf(f, "%ld %ld", &size, &resident) != 2)
		resident = -1;
	fclose(f);
	return resident < 0 ? -1 : resident * sysconf(_SC_PAGESIZE);
}

static void
trim(void)
{
#ifdef __GLIBC__
	malloc_trim(0);
#endif
}

START_TEST(test_million_keys_memory)
{
	struct kl__table *t = table_new();
	long n = kl_test_scaled(1000000, 10000);
	long before, after;

	/* Warm up so that each thread's malloc arena exists already. */
	ck_assert_int_eq(run_scale(t, "warm:", 20000), 0);
	ck_assert_uint_eq(kl__table_size(t), 0);
	trim();
	before = resident_bytes();

	ck_assert_int_eq(run_scale(t, "user:", n), 0);
	ck_assert_uint_eq(kl__table_size(t), 0);
	trim();
	after = resident_bytes();

	if (!UNDER_SANITIZER && before > 0 && after > 0) {
		ck_assert_msg(after - before < 64L * 1024 * 1024,
			      "resident set grew by %ld KiB over %ld keys",
			      (after - before) / 1024, n);
	}
	kl__table_free(t);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Flooding: keys crafted to collide under an unkeyed hash             */

#define FNV_OFFSET 0xcbf29ce484222325ULL
#define FNV_PRIME 0x100000001b3ULL
#define FLOOD_BITS 16
#define FLOOD_MASK ((1ULL << FLOOD_BITS) - 1)
#define FLOOD_TARGET 0x5a5aULL
#define FLOOD_KEY_MAX 32

static uint64_t
fnv1a(const void *data, size_t len)
{
	const unsigned char *p = data;
	uint64_t h = FNV_OFFSET;

	for (size_t i = 0; i < len; i++)
		h = (h ^ p[i]) * FNV_PRIME;
	return h;
}

/* Writes "flood:<i>:" and three more bytes into buf so that the FNV-1a 64
 * hash of the key ends in FLOOD_TARGET (its low FLOOD_BITS bits), as an
 * attacker would against a table indexed by an unkeyed hash.  The low bits
 * of FNV-1a depend only on the low bits of its state, and the last step
 * multiplies by an odd number, so the state before the last byte must end
 * in FLOOD_TARGET * FNV_PRIME^-1: a brute force over two bytes finds a state
 * whose bits 8..15 match, and the last byte fixes the low 8.  Returns the
 * key's length, 0 when no suffix was found. */
static size_t
flood_key(char *buf, long i, uint64_t pre)
{
	int n = snprintf(buf, FLOOD_KEY_MAX, "flood:%ld:", i);
	uint64_t h0 = fnv1a(buf, (size_t)n);

	for (unsigned b1 = 1; b1 < 256; b1++) {
		uint64_t h1 = (h0 ^ b1) * FNV_PRIME;

		for (unsigned b2 = 1; b2 < 256; b2++) {
			uint64_t h2 = (h1 ^ b2) * FNV_PRIME;
			uint64_t b3 = (pre ^ h2) & FLOOD_MASK;

			if (b3 == 0 || b3 > 0xff)
				continue;
			buf[n] = (char)b1;
			buf[n + 1] = (char)b2;
			buf[n + 2] = (char)b3;
			buf[n + 3] = '\0';
			return (size_t)n + 3;
		}
	}
	return 0;
}

START_TEST(test_flooding_keys_probes)
{
	long n = kl_test_scaled(100000, 2000);
	char *keys = malloc((size_t)n * FLOOD_KEY_MAX);
	size_t *lens = malloc((size_t)n * sizeof *lens);
	struct kl__entry **e = malloc((size_t)n * sizeof *e);
	struct kl__table_stats st;
	struct kl__table *t;
	uint64_t inv = FNV_PRIME, pre;
	double avg;

	ck_assert_ptr_nonnull(keys);
	ck_assert_ptr_nonnull(lens);
	ck_assert_ptr_nonnull(e);
	for (int i = 0; i < 5; i++)
		inv *= 2 - FNV_PRIME * inv; /* Newton: inverse mod 2^64 */
	ck_assert(inv * FNV_PRIME == 1);
	pre = (FLOOD_TARGET * inv) & FLOOD_MASK;
	for (long i = 0; i < n; i++) {
		char *k = keys + i * FLOOD_KEY_MAX;

		lens[i] = flood_key(k, i, pre);
		ck_assert_uint_ne(lens[i], 0);
		/* The keys do collide under the unkeyed hash. */
		ck_assert_uint_eq(fnv1a(k, lens[i]) & FLOOD_MASK,
				  FLOOD_TARGET);
	}

	/* A fixed seed makes a failure reproducible. */
	kl__test_set_hash_seed(0x0706050403020100ULL, 0x0f0e0d0c0b0a0908ULL);
	t = table_new();
	for (long i = 0; i < n; i++) {
		ck_assert_int_eq(acquire(t, keys + i * FLOOD_KEY_MAX, lens[i],
					 past(), &e[i], NULL),
				 KL_OK);
	}
	ck_assert_uint_eq(kl__table_size(t), (size_t)n);
	/* Look each one up again while all are live. */
	for (long i = 0; i < n; i++) {
		ck_assert_uint_eq(kl__table_queue_size(
					  t, keys + i * FLOOD_KEY_MAX, lens[i]),
				  0);
	}
	kl__table_stats(t, &st);
	ck_assert_uint_eq(st.entries, (size_t)n);
	ck_assert_uint_ge(st.lookups, (uint64_t)n);
	avg = (double)st.probes / (double)st.lookups;
	ck_assert_msg(avg < 4.0, "%.2f probes per lookup (%llu / %llu)", avg,
		      (unsigned long long)st.probes,
		      (unsigned long long)st.lookups);
	ck_assert_msg(st.max_chain <= 16, "max chain %zu over %zu buckets",
		      st.max_chain, st.buckets);
	for (long i = 0; i < n; i++)
		kl__table_release(t, e[i]);
	ck_assert_uint_eq(kl__table_size(t), 0);
	kl__table_free(t);
	free(e);
	free(lens);
	free(keys);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Invariant checker (TESTPLAN T06, T29)                               */

START_TEST(test_invariants_hold)
{
	struct kl__table *t = table_new();
	static const char long_key[] = "a key longer than the inline room";
	struct kl__entry *a, *b, *l;
	struct tthread w[2];

	ck_assert_int_eq(kl__table_check(t), KL_OK);
	ck_assert_int_eq(acquire(t, "a", 1, KL_NO_DEADLINE, &a, NULL), KL_OK);
	ck_assert_int_eq(acquire(t, "b", 1, KL_NO_DEADLINE, &b, NULL), KL_OK);
	ck_assert_int_eq(acquire(t, long_key, sizeof long_key - 1,
				 KL_NO_DEADLINE, &l, NULL),
			 KL_OK);
	ck_assert_int_eq(kl__table_check(t), KL_OK);
	/* Two waiters queued on a held key. */
	memset(w, 0, sizeof w);
	tthread_start(&w[0], t, "a", 1, in_ms(10000));
	wait_queue(t, "a", 1, 1);
	tthread_start(&w[1], t, "a", 1, in_ms(10000));
	wait_queue(t, "a", 1, 2);
	ck_assert_int_eq(kl__table_check(t), KL_OK);
	kl__table_release(t, a); /* hand-offs down the queue */
	tthread_join(&w[0]);
	tthread_join(&w[1]);
	ck_assert_int_eq(w[0].rc, KL_OK);
	ck_assert_int_eq(w[1].rc, KL_OK);
	ck_assert_int_eq(kl__table_check(t), KL_OK);
	kl__table_release(t, b);
	kl__table_release(t, l);
	ck_assert_uint_eq(kl__table_size(t), 0);
	ck_assert_int_eq(kl__table_check(t), KL_OK);
	kl__table_free(t);
}
END_TEST

/* The readers hint (struct kl__waitq, waitq.c): an exclusive request
 * that waits on a key for which shared requests have waited is treated
 * as one on a key held shared (no yield before its spin), until the slot
 * takes another key.  Counted by kl__test_readers_hinted. */
static void
waits_behind(struct kl__table *t, const char *key, unsigned flags)
{
	struct kl__entry *e;
	struct tthread w;

	memset(&w, 0, sizeof w);
	ck_assert_int_eq(acquire(t, key, strlen(key), KL_NO_DEADLINE, &e,
				 NULL),
			 KL_OK);
	w.flags = flags;
	tthread_start(&w, t, key, strlen(key), in_ms(30000));
	wait_queue(t, key, strlen(key), 1);
	kl__table_release(t, e);
	tthread_join(&w);
	ck_assert_int_eq(w.rc, KL_OK);
}

START_TEST(test_readers_hint)
{
	struct kl__table *t = table_new();
	char keys[2][24];
	long hinted = kl__test_readers_hinted();

	kl__test_neighbours(0);
	keys_like_k0(t, keys, 2, true);
	/* Exclusive requests only: no hint. */
	waits_behind(t, keys[0], 0);
	waits_behind(t, keys[0], 0);
	ck_assert_int_eq(kl__test_readers_hinted(), hinted);
	/* A shared request waits; the exclusive ones after it are hinted,
	 * also once the key was idle in between. */
	waits_behind(t, keys[0], KL_SHARED);
	ck_assert_int_eq(kl__test_readers_hinted(), hinted);
	waits_behind(t, keys[0], 0);
	ck_assert_int_eq(kl__test_readers_hinted(), hinted + 1);
	waits_behind(t, keys[0], 0);
	ck_assert_int_eq(kl__test_readers_hinted(), hinted + 2);
	/* Another key takes the idle slot: the hint was the old key's. */
	waits_behind(t, keys[1], 0);
	ck_assert_int_eq(kl__test_readers_hinted(), hinted + 2);
	/* And the old key, back in the slot, starts without it. */
	waits_behind(t, keys[0], 0);
	ck_assert_int_eq(kl__test_readers_hinted(), hinted + 2);
	/* Beside busy threads of other processes the hint is not used. */
	waits_behind(t, keys[0], KL_SHARED);
	kl__test_neighbours(1);
	waits_behind(t, keys[0], 0);
	ck_assert_int_eq(kl__test_readers_hinted(), hinted + 2);
	kl__test_neighbours(0);
	waits_behind(t, keys[0], 0);
	ck_assert_int_eq(kl__test_readers_hinted(), hinted + 3);
	ck_assert_uint_eq(kl__table_size(t), 0);
	ck_assert_int_eq(kl__table_check(t), KL_OK);
	kl__table_free(t);
}
END_TEST

START_TEST(test_invariants_broken_detected)
{
	kl_lock_opts o = KL_LOCK_OPTS_INIT;
	kl_call call = { .key = "k", .cancel = NULL };
	kl_provider *p;
	kl_lease *lease;
	kl_lock *l;
	kl_mutex *m;
	kl_token tok;

	ck_assert_int_eq(kl__test_check_invariants(NULL), KL_EINVAL);
	ck_assert_int_eq(kl_memory_provider_new(&p), KL_OK);
	o.provider = p;
	ck_assert_int_eq(kl_lock_new(&l, &o), KL_OK);
	ck_assert_int_eq(kl__test_check_invariants(p), KL_OK);
	ck_assert_int_eq(kl_lock_acquire(l, &call, &lease, NULL), KL_OK);
	ck_assert_int_eq(kl__test_check_invariants(p), KL_OK);
	/* A count that disagrees with the chains (reported on stderr). */
	kl__test_table_skew(p, 1);
	ck_assert_int_eq(kl__test_check_invariants(p), KL_EINVAL);
	kl__test_table_skew(p, -1);
	ck_assert_int_eq(kl__test_check_invariants(p), KL_OK);
	kl_lease_release(lease);
	ck_assert_int_eq(kl__test_check_invariants(p), KL_OK);
	kl_lock_free(l);
	kl_provider_free(p);

	ck_assert_int_eq(kl_mutex_new(&m, NULL), KL_OK);
	ck_assert_int_eq(kl__test_mutex_check(m), KL_OK);
	ck_assert_int_eq(kl_mutex_enter(m, KL_FOREVER, NULL, &tok), KL_OK);
	ck_assert_int_eq(kl__test_mutex_check(m), KL_OK);
	ck_assert_int_eq(kl_mutex_leave(m, tok, false), KL_OK);
	ck_assert_int_eq(kl__test_mutex_check(m), KL_OK);
	kl_mutex_free(m);
}
END_TEST

/* The slot protocol's key invariant, asserted where the mark is set: the
 * chain mark goes on held slots only (the stealer's unlocked floor read in
 * slot_claim relies on it).  Marking an idle slot must fire the assertion;
 * marking a held one, as take_locked does, must not. */
START_TEST(test_chain_mark_on_idle_slot_asserts)
{
	struct kl__table *t;
	struct kl__entry *e;
	uint64_t fence;

	ck_assert_int_eq(kl__table_new(&t), KL_OK);
	ck_assert_int_eq(kl__table_acquire(t, "k", 1, KL_NO_DEADLINE, NULL, 0,
					   &e, &fence),
			 KL_OK);
	kl__table_release(t, e); /* "k" stays in its slot, idle */
	kl__test_assert_record(true);
	ck_assert(!kl__table_mark_slot(t, "k", 1));
	ck_assert_int_eq(kl__test_assert_record(false), 1);

	ck_assert_int_eq(kl__table_acquire(t, "k", 1, KL_NO_DEADLINE, NULL, 0,
					   &e, &fence),
			 KL_OK);
	kl__test_assert_record(true);
	ck_assert(kl__table_mark_slot(t, "k", 1));
	ck_assert_int_eq(kl__test_assert_record(false), 0);
	ck_assert_int_eq(kl__table_check(t), KL_OK);
	kl__table_release(t, e);
	ck_assert_int_eq(kl__table_check(t), KL_OK);
	kl__table_free(t);
}
END_TEST

/* ------------------------------------------------------------------ */

static Suite *
table_suite(void)
{
	Suite *s = suite_create("table");
	TCase *tc;

	tc = tcase_create("lifecycle");
	tcase_add_test(tc, test_entry_freed_on_last_release);
	tcase_add_test(tc, test_entry_reused_sequentially);
	tcase_add_test(tc, test_idle_entry_reused);
	tcase_add_test(tc, test_idle_slot_taken_over);
	tcase_add_test(tc, test_chained_keys_mark_their_slot);
	tcase_add_test(tc, test_idle_entry_hands_off_in_order);
	tcase_add_test(tc, test_idle_entry_after_waiter_timed_out);
	tcase_add_test(tc, test_idle_entries_bounded_per_shard);
	tcase_add_test(tc, test_idle_entries_bounded_overall);
	suite_add_tcase(s, tc);

	tc = tcase_create("order");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_fifo_per_key);
	tcase_add_test(tc, test_keys_independent);
	suite_add_tcase(s, tc);

	tc = tcase_create("waiting");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_past_deadline_tries_once);
	tcase_add_test(tc, test_deadline_times_out_and_leaves);
	tcase_add_test(tc, test_errorcheck_reacquire);
	tcase_add_test(tc, test_cancel_leaves_queue);
	tcase_add_test(tc, test_cancel_token_timeout);
	tcase_add_test(tc, test_cancel_prefired);
	tcase_add_test(tc, test_readers_hint);
	suite_add_tcase(s, tc);

	tc = tcase_create("race");
	tcase_set_timeout(tc, 600);
	tcase_add_test(tc, test_last_release_races_acquire);
	tcase_add_test(tc, test_cas_release_races_timeouts);
	tcase_add_test(tc, test_slot_takeover_races_chains);
	suite_add_tcase(s, tc);

	tc = tcase_create("keys");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_key_empty_and_one_byte);
	tcase_add_test(tc, test_key_long);
	tcase_add_test(tc, test_key_binary_bytes);
	tcase_add_test(tc, test_key_embedded_nul);
	tcase_add_test(tc, test_key_many_confusable);
	suite_add_tcase(s, tc);

	tc = tcase_create("scale");
	tcase_set_timeout(tc, 600);
	tcase_add_test(tc, test_million_keys_memory);
	tcase_add_test(tc, test_flooding_keys_probes);
	suite_add_tcase(s, tc);

	tc = tcase_create("invariants");
	tcase_add_test(tc, test_invariants_hold);
	tcase_add_test(tc, test_invariants_broken_detected);
	tcase_add_test(tc, test_chain_mark_on_idle_slot_asserts);
	suite_add_tcase(s, tc);

	return s;
}

int
main(void)
{
	return test_run_suite(table_suite());
}
