/* SPDX-License-Identifier: MIT */
/*
 * Taking a key of the table and giving it back: the lock-free path of the
 * slots, the locked path, and the wait queues.
 *
 * The shard mutex is also the lock of every wait queue in the shard: an
 * entry's hand-off and its removal are decided under one lock.
 *
 * Slots.  Most keys are short, and most acquires take a key nobody holds.
 * So each shard also has SLOTS slot entries, made with the shard's first
 * short key and never freed while the table lives, and a key of up to 15
 * bytes lives in the slot its hash picks (kl__table_slot_of) unless another
 * key holds that slot.  A slot keeps its key after release ("idle"), and
 * taking the key again, or giving it back, is one compare-and-swap on the
 * slot's state word, without the shard lock: the memory a lock-free reader
 * looks at is never freed, and the word says whether what it read still
 * holds.  A key
 * whose slot is held by another key, and every longer key, gets an entry in
 * the shard's bucket chains ("chained"), made on first use and freed when
 * the last holder leaves with nobody waiting, all under the lock.
 *
 * A key has one entry at most, in its slot or in a chain, never both:
 * - only the lock's holder puts a key in a chain, after it found the key in
 *   neither place and marked the slot E_CHAIN;
 * - a slot marked E_CHAIN (some chained key has its index) is given a new
 *   key only under the lock, after the chains were searched for it;
 * - the mark goes when the last chained key of its index does;
 * - the mark is only ever set on a held slot (slot_mark_chained).  So a
 *   stealer that read a slot neither held nor marked and then swaps its
 *   word knows that no chained key came and went meanwhile, and the floor
 *   it read without the lock is still the floor (slot_claim).  The test
 *   build asserts both where they are relied on.
 *
 * The state word of an entry: E_* flags and, from FENCE_SHIFT up, the fence
 * of its latest grant.  Every grant adds one to the fence, and a slot given
 * to a new key keeps counting, so a slot's fence only grows; a chained short
 * key starts above its slot's fence and its floor, and raises the floor to
 * its last fence when it goes; a new key of the slot starts above both.  So
 * a key's fences grow across all the entries it ever has.  (Long keys use
 * the shard's counter as the floor.)
 *
 * Lock-free, a slot moves: idle -> held (its key taken again), idle or
 * empty without E_CHAIN -> busy -> held (a new key written in: "stolen"),
 * held without E_WAITERS -> idle (given back).  Everything else changes a
 * slot under the lock, by compare-and-swap against the word it validated
 * (so that a decision made on a key read from a slot is void if the slot
 * changed meanwhile: the fence changes with every move), or by a store
 * where only the lock's holder can change the word: a held slot with
 * E_WAITERS, released by its holder.  A waiter sets
 * E_WAITERS before it queues, and a marked slot is given back only under
 * the lock, which hands it over in FIFO order.  A reader that finds a slot
 * busy waits for the stealer to finish (a few instructions, unless it was
 * preempted).  Waiters queue only on a held key.  A waiter that times out
 * or is cancelled unlinks itself, and grants the shared requests behind it
 * when the key is held shared (waiter_left); the key is still held then,
 * so it never has to free anything.  A free key taken shared by a lone
 * holder (E_SOLO) moves lock-free as an exclusive one does: see Modes.
 */
#include "config.h"

#include <sys/syscall.h>
#include <unistd.h>

#define KL__TABLE_PRIVATE
#include "table.h"

/* Tries of shard_lock before it sleeps: a few microseconds at most. */
#define SHARD_SPINS 64

/*
 * The shard lock on the paths every contended take and give-back goes
 * through.  Held for a few hundred instructions, but by every reader that
 * joins or leaves a key held shared and by every hand-off, so threads
 * that merely overlap there would sleep in the kernel (4 threads, every
 * request shared: half a futex call per request).  So a taker spins a
 * little first, but only while nobody sleeps on the lock: spinners would
 * take it again and again ahead of a sleeper, which then waits before it
 * even reaches the key's FIFO queue (64 readers and a writer on 2 CPUs:
 * the writer's mean wait went from 0.7-2.8 ms to 16-21 ms with glibc's
 * adaptive mutex, which spins whoever sleeps; 0.6-1.1 ms with this).
 */
static void
shard_lock(struct shard *s)
{
	if (pthread_mutex_trylock(&s->lock) == 0)
		return;
	for (int i = 0; i < SHARD_SPINS &&
			atomic_load_explicit(&s->sleepers,
					     memory_order_relaxed) == 0;
	     i++) {
		kl__cpu_relax();
		if (pthread_mutex_trylock(&s->lock) == 0)
			return;
	}
	atomic_fetch_add_explicit(&s->sleepers, 1, memory_order_relaxed);
	pthread_mutex_lock(&s->lock);
	atomic_fetch_sub_explicit(&s->sleepers, 1, memory_order_relaxed);
}

/* Gives the caller slot e, which it found idle in state st holding the
 * caller's key, exclusively (mode 0) or as its lone shared holder (mode
 * E_SOLO: see Modes below).  False when the word changed meanwhile.  The
 * acquire pairs with the release that left the slot idle. */
static inline __attribute__((always_inline)) bool
slot_take(struct kl__entry *e, uint64_t st, uint64_t mode,
	  struct kl__entry **out, uint64_t *fence)
{
	uint64_t held = (st + FENCE_ONE) | E_HELD | mode;

	KL_ASSERT((st & (E_SLOT | E_USED | E_HELD | E_BUSY)) ==
		  (E_SLOT | E_USED));
	if (!atomic_compare_exchange_strong_explicit(&e->state, &st, held,
						     memory_order_acquire,
						     memory_order_relaxed))
		return false;
	KL_ANNOTATE_HAPPENS_AFTER(&e->state);
	atomic_store_explicit(&e->owner_tid, kl__thread_id(),
			      memory_order_relaxed);
	/* A lone shared holder leaves the word alone: a reader joining it
	 * under the lock may already keep its ring there. */
	if (mode == 0)
		e->lock = NULL;
	*out = e;
	*fence = fence_of(held);
	return true;
}

/* Writes the caller's key into slot e, found in state st neither held nor
 * busy, and gives it the slot, held.  False when the word changed
 * meanwhile.  Without the lock, st must not have E_CHAIN; with it, the
 * caller searched the chains for the key. */
static bool
slot_claim(struct shard *s, struct kl__entry *e, uint64_t st, uint32_t h,
	   size_t len, const uint64_t w[2], uint64_t mode,
	   struct kl__entry **out, uint64_t *fence)
{
	uint64_t f = fence_of(st), *k = slot_words(e), busy;
	unsigned i = kl__table_slot_of(h);
	/* Read after st, which came with acquire order: a floor raised
	 * before the mark that kept stealers off went is seen.  Without the
	 * lock, the floor cannot rise between this read and a successful
	 * compare-and-swap below: it rises only while the slot is marked
	 * E_CHAIN, and the mark is only ever set on a held word (see
	 * slot_mark_chained), so a mark set and gone after st was read
	 * means the word changed and the swap fails. */
	uint64_t lo = __atomic_load_n(&s->floor[i], __ATOMIC_RELAXED);

	KL_ASSERT(!(st & (E_HELD | E_BUSY)));
	busy = (((f > lo ? f : lo) + 1) << FENCE_SHIFT) | (st & E_CHAIN) |
	       E_SLOT | E_USED | E_HELD | E_BUSY | mode;

	if (!atomic_compare_exchange_strong_explicit(&e->state, &st, busy,
						     memory_order_acquire,
						     memory_order_relaxed))
		return false;
	KL_ANNOTATE_HAPPENS_AFTER(&e->state);
	/* Busy now, so nobody marks the slot until the key is written: the
	 * floor read above is still the floor the new fence must pass. */
	KL_ASSERT(__atomic_load_n(&s->floor[i], __ATOMIC_RELAXED) == lo);
	/* A reader that sees any of the words below sees E_BUSY too (the
	 * fence pairs with the one in fast_acquire), so its own
	 * compare-and-swap against the old word fails. */
	atomic_thread_fence(memory_order_release);
	__atomic_store_n(&e->hash, h, __ATOMIC_RELAXED);
	__atomic_store_n(&e->len, (uint32_t)len, __ATOMIC_RELAXED);
	__atomic_store_n(&k[0], w[0], __ATOMIC_RELAXED);
	__atomic_store_n(&k[1], w[1], __ATOMIC_RELAXED);
	atomic_store_explicit(&e->owner_tid, kl__thread_id(),
			      memory_order_relaxed);
	e->lock = NULL;
	kl__waitq_forget_hints(&e->q);
	KL_YIELD("slot busy");
	/* Release: a waiter that queues under the lock on the key just
	 * claimed reads the queue's hints written above (spin_skipped);
	 * its acquire, and the annotation that pairs with this one, are in
	 * slot_read. */
	KL_ANNOTATE_HAPPENS_BEFORE(&e->state);
	/* Nobody else changes a busy word. */
	atomic_store_explicit(&e->state, busy & ~(uint64_t)E_BUSY,
			      memory_order_release);
	*out = e;
	*fence = fence_of(busy);
	return true;
}

/* The slots of s, made if need be (lock held).  NULL when out of
 * memory. */
static struct kl__entry *
slots_of(struct shard *s)
{
	struct kl__entry *slots =
		atomic_load_explicit(&s->slots, memory_order_relaxed);

	if (slots != NULL)
		return slots;
	if ((slots = kl__calloc(1, SLOTS_BYTES)) == NULL)
		return NULL;
	slots_tail_of(slots)->shard = s;
	for (unsigned i = 0; i < SLOTS; i++) {
		struct kl__entry *e = slot_at(slots, i);

		kl__waitq_init(&e->q, &s->lock);
		atomic_init(&e->state, E_SLOT);
		atomic_init(&e->owner_tid, 0);
		KL_ANNOTATE_ATOMIC(&e->state);
		KL_ANNOTATE_ATOMIC(&e->owner_tid);
		KL_ANNOTATE_ATOMIC(&e->hash);
		KL_ANNOTATE_ATOMIC(&e->len);
		KL_ANNOTATE_ATOMIC(&slot_words(e)[0]);
		KL_ANNOTATE_ATOMIC(&slot_words(e)[1]);
		/* The first taker, maybe lock-free, sees the slot made. */
		KL_ANNOTATE_HAPPENS_BEFORE(&e->state);
	}
	/* Release: a lock-free reader sees the slots made. */
	atomic_store_explicit(&s->slots, slots, memory_order_release);
	return slots;
}

/* Takes a short key that sits idle in its slot, or that can have its slot
 * (idle or empty, no chained key of its index), without the lock.  False
 * when that does not do: the caller takes the lock. */
static inline __attribute__((always_inline)) bool
fast_acquire(struct shard *s, uint32_t h, const char *key, size_t len,
	     uint64_t mode, struct kl__entry **out, uint64_t *fence)
{
	struct kl__entry *slots =
		atomic_load_explicit(&s->slots, memory_order_acquire);
	struct kl__entry *e;
	uint64_t st, w[2];
	bool mine;

	if (slots == NULL)
		return false;
	e = slot_at(slots, kl__table_slot_of(h));
	st = state_of(e, memory_order_acquire);
	if (st & (E_HELD | E_BUSY))
		return false;
	key_words(key, len, w);
	mine = (st & E_USED) && slot_has(e, h, len, w);
	/* Pairs with the stealer's fence (slot_claim): if the key read above
	 * was being replaced, the compare-and-swap below fails. */
	atomic_thread_fence(memory_order_acquire);
	if (mine)
		return slot_take(e, st, mode, out, fence);
	if (st & E_CHAIN)
		return false;
	/* Unmarked: no chained key has this slot's index, so the key can
	 * be in the slot only, and the slot's floor is read unlocked. */
	return slot_claim(s, e, st, h, len, w, mode, out, fence);
}

/* ------------------------------------------------------------------ */
/* Chained entries */

/* Links a new chained entry for key, held by the caller with fence; chain
 * is the length of its bucket.  Lock held. */
static int
insert(struct shard *s, uint32_t h, const char *key, size_t len,
       size_t chain, uint64_t fence, struct kl__entry **out)
{
	struct kl__entry *e;
	size_t b;

	if (chain_room(s, chain) != KL_OK)
		return KL_ENOMEM; /* its only failure, said so for analyzers */
	if (len >= UINT32_MAX || len > SIZE_MAX - sizeof *e - 1 ||
	    (e = kl__malloc(sizeof *e + (len < INLINE_KEY ? INLINE_KEY
							  : len + 1))) == NULL)
		return KL_ENOMEM;
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

static void
unlink_entry(struct shard *s, struct kl__entry *e)
{
	struct kl__entry **pp =
		&s->buckets[bucket_of(s, e->hash, e->key, e->len)];

	while (*pp != e)
		pp = &(*pp)->next;
	*pp = e->next;
	s->count--;
	if (s->mask + 1 > MIN_BUCKETS && s->count < (s->mask + 1) / 4)
		kl__chain_shrink(s);
}

/* A chained short key of slot index i is gone with fence f: the floor of
 * the slot rises to it, and the slot loses its mark with the last such
 * key.  Lock held; the slot cannot be busy (it is marked), but its key
 * may be taken or given back meanwhile. */
static void
slot_unchain(struct shard *s, unsigned i, uint64_t f)
{
	struct kl__entry *e = slot_at(
		atomic_load_explicit(&s->slots, memory_order_relaxed), i);
	uint64_t st;

	if (s->floor[i] < f)
		__atomic_store_n(&s->floor[i], f, __ATOMIC_RELAXED);
	if (--s->nchain[i] != 0)
		return;
	/* Release: a stealer that sees the mark gone sees the floor, and
	 * what the chained key's last holder (maybe this thread) wrote
	 * before it gave the key back under the lock, for the stealer may
	 * take that key without the lock. */
	KL_ANNOTATE_HAPPENS_BEFORE(&e->state);
	st = state_of(e, memory_order_relaxed);
	/* A stealer never takes a marked slot, and the lock keeps the
	 * other writers of its key off: the swap below only races with
	 * takes and releases of the key the slot holds. */
	KL_ASSERT((st & (E_CHAIN | E_BUSY)) == E_CHAIN);
	while (!atomic_compare_exchange_weak_explicit(
		&e->state, &st, st & ~(uint64_t)E_CHAIN, memory_order_release,
		memory_order_relaxed))
		;
}

/* Unlinks chained entry e, released with fence f and nobody waiting, and
 * passes its fence on (see the top).  Lock held. */
static void
unchain(struct shard *s, struct kl__entry *e, uint64_t f)
{
	unlink_entry(s, e);
	if (e->len < INLINE_KEY)
		slot_unchain(s, kl__table_slot_of(e->hash), f);
	else if (s->fence < f)
		s->fence = f;
}

/* ------------------------------------------------------------------ */
/* Acquire and release */

/* Marks slot e, read held by another key in word *st, E_CHAIN: a chained
 * key of its index may come.  False when the word changed meanwhile (*st
 * gets it).  Lock held.
 *
 * The mark is only ever set on a held word.  This is what makes the
 * stealer's floor read in slot_claim safe without the lock: a stealer
 * that read the slot idle or empty and unmarked can only succeed if the
 * word never changed since, so no mark came and went, so the floor did
 * not rise.  A mark set on an idle word would let a chained key come and
 * go (raising the floor) without the stealer's swap failing. */
static bool
slot_mark_chained(struct kl__entry *e, uint64_t *st)
{
	KL_ASSERT((*st & (E_HELD | E_BUSY)) == E_HELD);
	if (*st & E_CHAIN)
		return true;
	return atomic_compare_exchange_strong_explicit(
		&e->state, st, *st | E_CHAIN, memory_order_relaxed,
		memory_order_relaxed);
}

/* take_locked's outcome when another holds the key. */
#define KEY_HELD 1

/* Takes key for the caller if nobody holds it: KL_OK with *out and *fence;
 * KEY_HELD with *out the entry that is held and *st its word then;
 * KL_ENOMEM.  Lock held. */
static int
take_locked(struct shard *s, uint32_t h, const char *key, size_t len,
	    struct kl__entry **out, uint64_t *st, uint64_t *fence)
{
	struct kl__entry *slots, *e, *c;
	uint64_t w[2], f;
	unsigned i = kl__table_slot_of(h);
	size_t chain;
	int rc, has;

	if (len >= INLINE_KEY) {
		if ((c = find(s, h, key, len, &chain)) != NULL) {
			*out = c;
			*st = state_of(c, memory_order_relaxed);
			return KEY_HELD;
		}
		rc = insert(s, h, key, len, chain, s->fence + 1, out);
		if (rc == KL_OK)
			*fence = ++s->fence;
		return rc;
	}
	if ((slots = slots_of(s)) == NULL)
		return KL_ENOMEM;
	e = slot_at(slots, i);
	key_words(key, len, w);
	for (;;) {
		if ((has = slot_read(e, h, len, w, st)) < 0)
			continue;
		if (has) {
			if (*st & E_HELD) {
				*out = e;
				return KEY_HELD;
			}
			if (slot_take(e, *st, 0, out, fence))
				return KL_OK;
			continue; /* taken or stolen meanwhile */
		}
		if ((c = find(s, h, key, len, &chain)) != NULL) {
			*out = c;
			*st = state_of(c, memory_order_relaxed);
			return KEY_HELD;
		}
		if (!(*st & E_HELD)) {
			/* The chains were searched: E_CHAIN does not stop
			 * the lock's holder. */
			if (slot_claim(s, e, *st, h, len, w, 0, out, fence))
				return KL_OK;
			continue;
		}
		/* Another key holds the slot: the key goes in a chain, and
		 * the mark keeps stealers off the slot meanwhile. */
		if (slot_mark_chained(e, st))
			break;
	}
	/* Above every fence the key had: in the slot (its fences never
	 * pass the slot's) or chained before (the floor). */
	f = fence_of(*st) > s->floor[i] ? fence_of(*st) : s->floor[i];
	rc = insert(s, h, key, len, chain, f + 1, &c);
	s->nchain[i]++;
	if (rc == KL_OK) {
		*out = c;
		*fence = f + 1;
	} else {
		slot_unchain(s, i, 0); /* drops the mark if it was the only */
	}
	return rc;
}

/* Marks e, found held in word st, as waited for, so that its holder
 * releases through the lock.  False when the word changed meanwhile (the
 * key may be free now, or e another key's): look again.  Lock held. */
static bool
mark_waiting(struct kl__entry *e, uint64_t st)
{
	uint64_t want = st | E_WAITERS;

	if (atomic_compare_exchange_strong_explicit(&e->state, &st, want,
						    memory_order_relaxed,
						    memory_order_relaxed))
		return true;
	return st == want; /* another waiter marked it: the same holder */
}

/* ------------------------------------------------------------------ */
/* Modes
 *
 * One FIFO queue per key holds both modes (W3C Web Locks).  A request is
 * grantable when it is first in the queue (or the queue is empty) and,
 * exclusive: nobody holds the key; shared: nobody holds it exclusively.
 * Whenever the key is given back or a waiter leaves its queue (timeout,
 * cancel), the queue is granted from its head while the head's request is
 * grantable (pass_on): a run of shared requests at the head is granted
 * together, and the next exclusive one stops it.  So a shared newcomer
 * never passes a queued exclusive request, even while readers hold the
 * key, and a queued request never waits on a key it could have: with the
 * key held shared, the head of its queue (when one waits) wants it
 * exclusively.
 *
 * Who holds a key shared must be readable under the shard lock
 * (errorcheck, status, snapshots, deadlock detection): a holder record
 * linked in the entry's ring, or the entry itself for a lone holder
 * (E_SOLO, owner_tid).  A lone holder is what makes an uncontended shared
 * take as cheap as an exclusive one (with the whole take under the lock
 * and a record, kl_lock_acquire + release cost 3.4 times an exclusive
 * pair; lone, with the lease in the slot's solo word, about as much as
 * one): a free key of a slot is taken shared by
 * compare-and-swap, E_HELD | E_SOLO, and given back the same way while
 * nobody joined it.  Whoever joins it, or queues behind it, does so under
 * the lock and marks the word E_WAITERS first (mark_waiting), so that from
 * then on the lone holder gives the key back under the lock too and the
 * word changes there only.  Every other shared take (a token, a long or
 * chained key, a key held) is made under the lock with a record.  A slot
 * held shared is held (E_HELD): an exclusive lock-free taker leaves it to
 * the lock, as before.
 */

/* gettid() of the calling thread, for snapshots: asked once per thread
 * (forgotten in a child of fork, whose thread has a new one). */
static KL_TLS int64_t os_tid_cached;
static pthread_once_t os_tid_once = PTHREAD_ONCE_INIT;

static void
os_tid_forget(void)
{
	os_tid_cached = 0;
}

static void
os_tid_init(void)
{
	(void)pthread_atfork(NULL, NULL, os_tid_forget);
}

static int64_t
os_tid(void)
{
	if (os_tid_cached == 0) {
		pthread_once(&os_tid_once, os_tid_init);
#ifdef SYS_gettid
		os_tid_cached = (int64_t)syscall(SYS_gettid);
#endif
	}
	return os_tid_cached;
}

/* Links h into the shared holders of e (shared NULL first when e was not
 * held shared), granted with fence f to thread tid.  Lock held. */
static void
holder_link(struct kl__entry *e, struct kl__holder *h, uint64_t tid,
	    int64_t ostid, uint64_t f)
{
	h->entry = e;
	h->tid = tid;
	h->os_tid = ostid;
	h->fence = f;
	h->since_ns = kl__coarse_now_ns();
	h->lock = NULL;
	if (e->shared == NULL) {
		h->next = h->prev = h;
		e->shared = h;
	} else {
		h->next = e->shared;
		h->prev = e->shared->prev;
		h->prev->next = h;
		e->shared->prev = h;
	}
}

static void
holder_unlink(struct kl__entry *e, struct kl__holder *h)
{
	if (h->next == h) {
		e->shared = NULL;
	} else {
		h->prev->next = h->next;
		h->next->prev = h->prev;
		if (e->shared == h)
			e->shared = h->next;
	}
	h->next = h->prev = NULL;
}

/* Wake-ups of granted waiters, made after the lock is dropped where the
 * caller can; past WAKES of them, at once (a futex wake under the lock
 * only costs the time it takes). */
#define WAKES 8

struct wakes {
	void *w[WAKES];
	int n;
};

static void
wakes_add(struct wakes *k, void *wake)
{
	if (wake == NULL)
		return;
	if (k->n == WAKES)
		kl__unpark(wake);
	else
		k->w[k->n++] = wake;
}

static void
wakes_run(struct wakes *k)
{
	for (int i = 0; i < k->n; i++)
		kl__unpark(k->w[i]);
	k->n = 0;
}

/* Grants e's queue from its head while the head's request is grantable
 * (see Modes above), e being in word st, the key free (shared false and
 * no holder) or held shared (shared true).  *f is the fence of the latest
 * grant, and gets that of the last one made here.  Returns how many were
 * granted; *held says whether the key is held after, and *granted lists
 * the granted waiters (through next, out of the queue now), for
 * settle_all once the caller has written the word (held_word, with the
 * ring in e->shared, valid after this call): a granted holder may read its
 * fence from the word as soon as it is settled.  Lock held. */
static unsigned
pass_on(struct kl__entry *e, uint64_t st, uint64_t *f, bool shared,
	bool *held, struct kl__waiter **granted)
{
	struct kl__waiter *w, **tail = granted;
	unsigned n = 0;

	*held = shared;
	*granted = NULL;
	if (!(st & E_SHARED))
		e->shared = NULL; /* lock's place: see struct kl__entry */
	while ((w = kl__waitq_live_head(&e->q)) != NULL) {
		struct twaiter *tw = twaiter_of(w);

		if (tw->h == NULL && *held)
			break;
		kl__waitq_grant(&e->q, w);
		w->data = ++*f;
		*tail = w;
		tail = &w->next;
		n++;
		*held = true;
		if (tw->h == NULL) {
			atomic_store_explicit(&e->owner_tid, w->tid,
					      memory_order_relaxed);
			break;
		}
		/* owner_tid names the lone holder (E_SOLO) if there is
		 * one, else nobody. */
		if (!(st & E_SOLO))
			atomic_store_explicit(&e->owner_tid, 0,
					      memory_order_relaxed);
		holder_link(e, tw->h, w->tid, tw->os_tid, *f);
	}
	return n;
}

/* Publishes their grant to the waiters pass_on listed.  Lock held. */
static void
settle_all(struct kl__waiter *granted, struct wakes *k)
{
	while (granted != NULL) {
		struct kl__waiter *w = granted;

		/* Read first: once settled, w may be gone. */
		granted = w->next;
		w->next = NULL;
		wakes_add(k, kl__waiter_settle(w));
	}
}

/* The word of held entry e with fence f, from st, its word before (its
 * E_SOLO kept), once e->shared is valid (pass_on): E_SHARED when the ring
 * is not empty, E_WAITERS while anyone waits or a lone holder (E_SOLO)
 * has others beside it, so that it gives the key back through the lock.
 * Lock held.  Stored with release order: a lone holder left alone gives
 * the key back by compare-and-swap, without the lock, and its next taker
 * must see what was written under the lock before (the ring's word in
 * the entry). */
static uint64_t
held_word(const struct kl__entry *e, uint64_t st, uint64_t f)
{
	bool ring = e->shared != NULL;

	return (f << FENCE_SHIFT) |
	       (st & (E_SLOT | E_USED | E_CHAIN | E_SOLO)) | E_HELD |
	       (ring ? E_SHARED : 0) |
	       (e->q.len != 0 || ((st & E_SOLO) && ring) ? E_WAITERS : 0);
}

static struct kl__entry *
entry_of_queue(struct kl__waitq *q)
{
	return (struct kl__entry *)(void *)((char *)q -
					    offsetof(struct kl__entry, q));
}

/* A waiter left q by its timeout or its cancel token (kl__waiter.left):
 * with the key held shared, the shared requests behind it may be
 * grantable now.  Held exclusively, nothing is.  Lock held; the key is
 * held (a waiter only queues on a held key, marked E_WAITERS, so the word
 * stands still), so the entry stays. */
static void
waiter_left(struct kl__waitq *q)
{
	struct kl__entry *e = entry_of_queue(q);
	struct wakes k = { .n = 0 };
	struct kl__waiter *granted;
	uint64_t st = state_of(e, memory_order_relaxed), f = fence_of(st);
	bool held;

	if (!held_shared(st))
		return;
	if (pass_on(e, st, &f, true, &held, &granted) != 0)
		atomic_store_explicit(&e->state, held_word(e, st, f),
				      memory_order_release);
	settle_all(granted, &k);
	/* Called inside the wait queue's own code, with the lock held
	 * until it returns. */
	wakes_run(&k);
}

/* Whether tid holds e, in either mode.  Lock held. */
static bool
holds(struct kl__entry *e, uint64_t tid)
{
	uint64_t st = state_of(e, memory_order_relaxed);
	const struct kl__holder *h = shared_of(e, st);

	if ((h == NULL || (st & E_SOLO)) &&
	    atomic_load_explicit(&e->owner_tid, memory_order_relaxed) == tid)
		return true;
	if (h != NULL)
		do {
			if (h->tid == tid)
				return true;
			h = h->next;
		} while (h != e->shared);
	return false;
}

/* share_now's outcome when the word changed under it: look again. */
#define KEY_MOVED 2

/* A shared request that finds e held in word *st: grants the key at once
 * when it is held shared and nobody waits (after granting those at the
 * head that can be: a waiter whose expiry came but that has not woken
 * yet may have stood before them).  KL_OK with *fence, KEY_HELD to wait,
 * KEY_MOVED when a lone holder gave the key back meanwhile.  Lock held. */
static int
share_now(struct kl__entry *e, struct twaiter *tw, uint64_t *st,
	  uint64_t *fence)
{
	struct wakes k = { .n = 0 };
	struct kl__waiter *granted;
	uint64_t f;
	bool held;
	int rc = KEY_HELD;

	if (!held_shared(*st))
		return KEY_HELD; /* held exclusively */
	/* A lone holder (E_SOLO) gives the key back by compare-and-swap
	 * unless marked: marked, the word stands still under the lock. */
	if (!(*st & E_WAITERS)) {
		if (!mark_waiting(e, *st))
			return KEY_MOVED;
		*st |= E_WAITERS;
	}
	f = fence_of(*st);
	(void)pass_on(e, *st, &f, true, &held, &granted);
	if (e->q.len == 0) {
		holder_link(e, tw->h, tw->w.tid, tw->os_tid, ++f);
		*fence = f;
		rc = KL_OK;
	}
	*st = held_word(e, *st, f);
	atomic_store_explicit(&e->state, *st, memory_order_release);
	settle_all(granted, &k);
	wakes_run(&k);
	return rc;
}

/* Takes key, or waits for it as tw (prepared; tw->h set for a shared
 * request).  Lock held on entry, released on return. */
static int
take_or_wait(struct shard *s, uint32_t h, const char *key, size_t len,
	     struct twaiter *tw, int64_t deadline_ns, unsigned flags,
	     struct kl__entry **out, uint64_t *fence)
{
	struct kl__entry *e = NULL;
	uint64_t st = 0;
	int rc;

	tw->w.left = waiter_left;
	tw->w.shared = tw->h != NULL;
	for (;;) {
		rc = take_locked(s, h, key, len, &e, &st, fence);
		if (rc != KEY_HELD) {
			if (rc == KL_OK) {
				*out = e;
				if (tw->h != NULL) {
					/* Taken as if exclusively, under
					 * the lock: nobody else changes
					 * the word now. */
					atomic_store_explicit(
						&e->owner_tid, 0,
						memory_order_relaxed);
					e->shared = NULL;
					holder_link(e, tw->h, tw->w.tid,
						    tw->os_tid, *fence);
					st = state_of(e, memory_order_relaxed);
					atomic_store_explicit(
						&e->state,
						held_word(e, st, *fence),
						memory_order_release);
				}
			}
			break;
		}
		if ((flags & KL_ERRORCHECK) && holds(e, tw->w.tid)) {
			rc = KL_EDEADLK;
			break;
		}
		if (tw->h != NULL) {
			rc = share_now(e, tw, &st, fence);
			if (rc == KL_OK) {
				*out = e;
				break;
			}
			if (rc == KEY_MOVED)
				continue;
		}
		if (deadline_ns != KL_NO_DEADLINE &&
		    kl__now_ns() >= deadline_ns) {
			rc = KL_ETIMEDOUT;
			break;
		}
		if (mark_waiting(e, st)) {
			struct kl__dl_wait dw;

			tw->w.mixed = held_shared(st);
			/* Waiters queue only on a held key, marked, so its
			 * holder releases through the lock and hands over. */
			KL_ASSERT(st & E_HELD);
			kl__deadlock_arm(&dw, &tw->w);
			rc = kl__waitq_wait(&e->q, &tw->w, deadline_ns,
					    KL_UNBOUNDED, KL_OVERFLOW_THIS);
			kl__deadlock_disarm(&dw, rc);
			if (rc == KL_OK) {
				*out = e;
				*fence = tw->w.data;
			}
			return rc;
		}
	}
	pthread_mutex_unlock(&s->lock);
	return rc;
}

/* kl__table_acquire of a held key without a cancel token.  Lock held on
 * entry, released on return.  Out of line: the waiter would make the
 * frame of every acquire big. */
static __attribute__((noinline)) int
acquire_held(struct shard *s, uint32_t h, const char *key, size_t len,
	     int64_t deadline_ns, unsigned flags, struct kl__entry **out,
	     uint64_t *fence)
{
	struct twaiter tw;
	int rc;

	kl__waiter_prepare(&tw.w, &s->lock, NULL);
	tw.h = NULL;
	tw.os_tid = os_tid();
	rc = take_or_wait(s, h, key, len, &tw, deadline_ns, flags, out,
			  fence);
	kl__waiter_finish(&tw.w);
	return rc;
}

/* kl__table_acquire with a cancel token, and every shared request (holder
 * set). */
static __attribute__((noinline)) int
acquire_locked(struct shard *s, uint32_t h, const char *key, size_t len,
	       int64_t deadline_ns, kl_cancel *c, unsigned flags,
	       struct kl__holder *holder, struct kl__entry **out,
	       uint64_t *fence)
{
	struct twaiter tw;
	int rc;

	/* The token's lock comes before the shard's. */
	if ((rc = kl__waiter_prepare(&tw.w, &s->lock, c)) != KL_OK)
		return rc;
	tw.h = holder;
	tw.os_tid = os_tid();
	shard_lock(s);
	if (tw.w.state == KL_W_DONE) {
		/* A fire between registering and here settled the waiter
		 * already: once kl_cancel_fire has returned, nothing may be
		 * granted to it. */
		rc = tw.w.status;
		pthread_mutex_unlock(&s->lock);
	} else {
		rc = take_or_wait(s, h, key, len, &tw, deadline_ns, flags, out,
				  fence);
	}
	kl__waiter_finish(&tw.w);
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
	uint64_t st;
	int rc;

	*out = NULL;
	*fence = 0;
	if (c != NULL)
		return acquire_locked(s, h, key, len, deadline_ns, c, flags,
				      NULL, out, fence);
	if (len < INLINE_KEY && fast_acquire(s, h, key, len, 0, out, fence))
		return KL_OK;
	shard_lock(s);
	rc = take_locked(s, h, key, len, &e, &st, fence);
	if (rc == KEY_HELD)
		return acquire_held(s, h, key, len, deadline_ns, flags, out,
				    fence);
	pthread_mutex_unlock(&s->lock);
	if (rc == KL_OK)
		*out = e;
	return rc;
}

int
kl__table_acquire_shared(struct kl__table *t, const char *key, size_t len,
			 int64_t deadline_ns, kl_cancel *c, unsigned flags,
			 struct kl__holder *holder, uint64_t *fence)
{
	uint32_t h = hash_of(t, key, len);
	struct kl__entry *e = NULL;

	*fence = 0;
	return acquire_locked(shard_of(t, h), h, key, len, deadline_ns, c,
			      flags, holder, &e, fence);
}

/* kl__table_release (and kl__table_release_solo, solo true) when the
 * compare-and-swap cannot do (waiters marked, a chained entry), and every
 * release of a shared holder's record (h): the key passes on to whom its
 * queue's head makes grantable, or is left idle or freed. */
static __attribute__((noinline)) void
release_locked(struct shard *s, struct kl__entry *e, struct kl__holder *h,
	       bool solo)
{
	struct wakes k = { .n = 0 };
	struct kl__waiter *granted;
	/* The queue passed on, if any: only compared once e may be freed
	 * (kl__waitq_released); a shared holder's release that leaves the
	 * key held or idle notes nothing, and reads no clock. */
	const struct kl__waitq *handed = NULL;
	void *prod = NULL;
	uint64_t st, f;
	bool held = false;

	shard_lock(s);
	/* Only this lock's holder changes a held word now (a lock-free
	 * taker needs it free, the caller is a holder, and a lone shared
	 * holder beside others was marked E_WAITERS), so plain stores do. */
	st = state_of(e, memory_order_relaxed);
	KL_ASSERT((st & (E_HELD | E_BUSY)) == E_HELD);
	KL_ASSERT(h == NULL || ((st & E_SHARED) && h->entry == e));
	KL_ASSERT(!solo || (st & E_SOLO));
	KL_ASSERT(solo || h != NULL || !held_shared(st));
	f = fence_of(st);
	if (solo) {
		st &= ~(uint64_t)E_SOLO;
		held = (st & E_SHARED) != 0;
	} else if (h != NULL) {
		holder_unlink(e, h);
		held = e->shared != NULL || (st & E_SOLO);
	}
	if (pass_on(e, st, &f, held, &held, &granted) != 0) {
		atomic_store_explicit(&e->state, held_word(e, st, f),
				      memory_order_release);
		settle_all(granted, &k);
		prod = kl__waitq_prod(&e->q);
		handed = &e->q;
		e = NULL;
	} else if (held) {
		/* Other shared holders remain; the lone one among them may
		 * release without the lock (release_cas) after the writes
		 * above: an edge for Helgrind as for a lock-free taker. */
		KL_ANNOTATE_HAPPENS_BEFORE(&e->state);
		atomic_store_explicit(&e->state, held_word(e, st, f),
				      memory_order_release);
		e = NULL;
	} else if (st & E_SLOT) {
		/* Waiters came and went: idle, as after a CAS release.  A
		 * lock-free taker or stealer (slot_claim) sees what the
		 * waiters and this release wrote under the lock through this
		 * store alone, so Helgrind must see the edge too. */
		atomic_store_explicit(&e->owner_tid, 0, memory_order_relaxed);
		KL_ANNOTATE_HAPPENS_BEFORE(&e->state);
		atomic_store_explicit(&e->state,
				      st & ~(uint64_t)(E_HELD | E_WAITERS |
						       E_SHARED | E_SOLO),
				      memory_order_release);
		e = NULL;
	} else {
		unchain(s, e, f);
	}
	pthread_mutex_unlock(&s->lock);
	KL_YIELD("free");
	wakes_run(&k);
	kl__waitq_released(handed, prod);
	kl__free(e);
}

/* Gives back slot e, held by the caller (exclusively, or alone and shared:
 * mode E_SOLO), by compare-and-swap while no mark asks for the lock: true;
 * false when the caller must release it under the lock. */
static inline __attribute__((always_inline)) bool
release_cas(struct kl__entry *e, uint64_t mode)
{
	uint64_t st = state_of(e, memory_order_relaxed);

	/* Before a slot is free: a caller with KL_ERRORCHECK that meets its
	 * next holder (who writes its id after taking it) must never see
	 * this thread's id there.  A chained entry's id only changes under
	 * the lock. */
	if (st & E_SLOT)
		atomic_store_explicit(&e->owner_tid, 0, memory_order_relaxed);
	KL_ANNOTATE_HAPPENS_BEFORE(&e->state);
	/* Release order: the next holder, which takes the word with an
	 * acquire, sees what this one wrote.  After it, the slot may be
	 * taken or stolen at once.  A failure means a mark came meanwhile
	 * (E_CHAIN or E_WAITERS): look again. */
	while ((st & (E_SLOT | E_WAITERS)) == E_SLOT)
		if (atomic_compare_exchange_weak_explicit(
			    &e->state, &st, st & ~(uint64_t)(E_HELD | mode),
			    memory_order_release, memory_order_relaxed))
			return true;
	return false;
}

static inline __attribute__((always_inline)) void
release_mode(struct kl__table *t, struct kl__entry *e, uint64_t mode)
{
	if (!release_cas(e, mode))
		release_locked(shard_of(t, __atomic_load_n(&e->hash,
							   __ATOMIC_RELAXED)),
			       e, NULL, mode != 0);
}

void
kl__table_release(struct kl__table *t, struct kl__entry *e)
{
	release_mode(t, e, 0);
}

bool
kl__table_acquire_solo(struct kl__table *t, const char *key, size_t len,
		       struct kl__entry **out, uint64_t *fence)
{
	uint32_t h = hash_of(t, key, len);

	*out = NULL;
	*fence = 0;
	return len < INLINE_KEY &&
	       fast_acquire(shard_of(t, h), h, key, len, E_SOLO, out, fence);
}

void
kl__table_release_solo(struct kl__table *t, struct kl__entry *e)
{
	release_mode(t, e, E_SOLO);
}

void
kl__table_release_solo_slot(struct kl__entry *e)
{
	/* Only slots are taken by a lone holder (kl__table_acquire_solo). */
	KL_ASSERT(state_of(e, memory_order_relaxed) & E_SLOT);
	if (!release_cas(e, E_SOLO))
		release_locked(slot_shard(e), e, NULL, true);
}

void
kl__table_release_shared(struct kl__table *t, struct kl__holder *h)
{
	struct kl__entry *e = h->entry;

	KL_ANNOTATE_HAPPENS_BEFORE(&e->state);
	release_locked(shard_of(t, __atomic_load_n(&e->hash,
						   __ATOMIC_RELAXED)),
		       e, h, false);
}

#ifdef KL_TEST_HOOKS
bool
kl__table_mark_slot(struct kl__table *t, const char *key, size_t len)
{
	uint32_t h = hash_of(t, key, len);
	struct shard *s = shard_of(t, h);
	struct kl__entry *slots, *e;
	uint64_t st = 0;

	pthread_mutex_lock(&s->lock);
	slots = atomic_load_explicit(&s->slots, memory_order_relaxed);
	if (len < INLINE_KEY && slots != NULL) {
		e = slot_at(slots, kl__table_slot_of(h));
		st = slot_wait_unbusy(e);
		/* A mark that was there already is not this call's to take
		 * off. */
		if (!(st & E_CHAIN) && s->nchain[kl__table_slot_of(h)] == 0) {
			while (!slot_mark_chained(e, &st))
				;
			atomic_fetch_and_explicit(&e->state,
						  ~(uint64_t)E_CHAIN,
						  memory_order_relaxed);
		}
	}
	pthread_mutex_unlock(&s->lock);
	return (st & E_HELD) != 0;
}
#endif
