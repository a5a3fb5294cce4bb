/* SPDX-License-Identifier: MIT */
/*
 * The wait queue: a FIFO of parked threads, each on its own stack, parked
 * on a word of its own and woken one at a time by direct hand-off.
 *
 * Invariants (all under the queue's lock, w->lock of its waiters):
 * - a waiter is in the list exactly when its state is KL_W_WAITING, and
 *   q->len counts the list;
 * - a waiter's state leaves WAITING once, to GRANTED or DONE, and the thread
 *   that moves it also unlinks it and publishes the outcome (settle);
 * - so whoever settles first (granter, timer, canceller, evictor) decides
 *   the outcome; the others find a final state and do nothing.
 * Because a grant goes only to a WAITING waiter and the waiter honours any
 * grant it finds, a grant is never lost: a waiter that timed out first is
 * already unlinked and the grant goes to the next one.
 *
 * The parking word: 0 while the waiter is awake, 2 once it has announced it
 * sleeps, 3 when it was woken early to spin as the new head (see
 * kl__waitq_prod), 1 when its outcome is published.  The settler writes
 * the outcome fields, then exchanges 1 into the word with release order;
 * the waiter reads the fields only after loading 1 with acquire order, so
 * it needs the lock no more, and the settler never touches the waiter after
 * the exchange except to wake it, and only when the old value says it
 * sleeps (a prodded one is its prodder's to wake).  Waking a
 * futex word whose frame has since returned is harmless: a private futex
 * wake only names an address, and every parker re-checks its word.
 *
 * Before parking, the head waiter spins briefly when there are spare CPUs:
 * a short critical section ends sooner than a sleeping thread wakes; so
 * does a shared request near the head (kl__waiter.shared).  When
 * more threads than CPUs waited lately, a thread that asks again for the
 * lock it has just handed on yields the CPU once first, or, behind the
 * head, between its looks instead of sleeping; so does a waiter among
 * readers (see kl__waitq_wait and neighbours).  A waiter that becomes the
 * head while parked is woken at once by the grant that made it the head,
 * so that it is already running, and spinning, when its own grant comes;
 * one that is awake then is marked headed, and if it spins behind the
 * head it keeps its CPU from then on.
 */
#include "config.h"

#include <errno.h>
#include <sched.h>
#include <time.h>
#include <unistd.h>
#ifdef HAVE_LINUX_FUTEX_H
#include <linux/futex.h>
#include <sys/syscall.h>
#endif

#include "annotate.h"
#include "internal.h"

#define W_AWAKE 0u
#define W_SETTLED 1u
#define W_PARKED 2u
#define W_PRODDED 3u /* was parked, woken to spin as the new head */

#define SPIN_NS 20000 /* about one sleeping wake-up on a loaded VM */
/* Looks at the outcome between two yields of a spinner that gives its CPU
 * away (spin): 1 to 8 measured alike, 64 lost a fifth. */
#define SPIN_LOOKS_PER_YIELD 4
/* A spinner's yield longer than this ran a thread that kept the CPU for
 * about a time slice, most likely another process's (see neighbours):
 * beside a busy process they took 3 ms and more, among the process's own
 * threads alone almost all under 100 us and none over 1 ms in a quick
 * harness.  The cures it turns off stay off for NEIGHBOURS_NS (about 134
 * ms: such a yield costs a time slice at most once in that long). */
#define GIVE_SLOW_NS 1000000
#define NEIGHBOURS_NS (INT64_C(1) << 27)
/* A thread that asks for a queue's lock again within this long of handing
 * it on does little else (see kl__waitq_wait): it came back from the
 * release path and its own loop, 0.1 to 0.5 us on a 2-CPU VM, where one
 * with a few microseconds of work between them has not. */
#define ASKS_AGAIN_NS 2000
/* Such a thread spins behind the head only while the waiters, itself
 * included, are at most this many times the CPUs: further back its turn
 * is far off, and the yields of many such waiters kept the granted
 * thread from a CPU (32 to 64 threads on 2 CPUs, a review's harness:
 * 0.55x the grants of parking at once; with this bound 1.11x and 0.99x,
 * 16 threads 1.29x, in a quick harness beside a CI run). */
#define BEHIND_CPUS 4
/* A lone waiter that would spin parks at once once this many such spins
 * on its queue in a row ended parked: the lock is held for longer than a
 * spin there, and the spin only burned SPIN_NS of CPU per wait.  It cost the
 * wait more than that: a thread that spun before it parked is woken with
 * less of a claim to its CPU, and on a CPU kept busy by its waker it ran
 * when that thread gave way (a sleeping waiter's hand-off on 2 CPUs, 6
 * runs of 200: 90th percentile 43 to 47 us with the spin, 3.1 to 6.0 us
 * without, once the waiter shared its waker's CPU).  One such wait in
 * SPIN_PROBE spins anyway, so that the queue notices when the holds get
 * short again; a spin that sees its grant starts the count over. */
#define SPIN_MISSES 4
#define SPIN_PROBE 16
/* The period of the waiting-thread count, as a power of two of ns: about
 * 17 ms, a few time slices. */
#define CROWD_SHIFT 24

/* ------------------------------------------------------------------ */
/* Parking */

#ifdef HAVE_LINUX_FUTEX_H
/* Sleeps while *word is W_PARKED, until the absolute CLOCK_MONOTONIC time
 * expire_ns (KL_NO_DEADLINE: no limit).  Returns on a wake, a signal, a
 * spurious wake-up or the time: the caller re-checks everything. */
static void
park(atomic_uint *word, int64_t expire_ns)
{
	struct timespec ts, *tp = NULL;

	if (expire_ns != KL_NO_DEADLINE) {
		ts.tv_sec = (time_t)(expire_ns / 1000000000);
		ts.tv_nsec = (long)(expire_ns % 1000000000);
		tp = &ts;
	}
	/* FUTEX_WAIT_BITSET takes an absolute time on CLOCK_MONOTONIC. */
	syscall(SYS_futex, (unsigned *)word,
		FUTEX_WAIT_BITSET | FUTEX_PRIVATE_FLAG, W_PARKED, tp, NULL,
		FUTEX_BITSET_MATCH_ANY);
}

void
kl__unpark(void *wake)
{
	if (wake != NULL)
		syscall(SYS_futex, (unsigned *)wake,
			FUTEX_WAKE | FUTEX_PRIVATE_FLAG, 1, NULL, NULL, 0);
}
#else
/* Portable parker: a fixed table of mutex+condvar buckets chosen by the
 * word's address.  The unparker takes the bucket lock after publishing, the
 * parker checks the word under it, so no wake-up is lost. */
#define NBUCKETS 64

static struct {
	pthread_mutex_t lock;
	pthread_cond_t cond;
} buckets[NBUCKETS];
static pthread_once_t buckets_once = PTHREAD_ONCE_INIT;

static void
buckets_reset(void)
{
	for (int i = 0; i < NBUCKETS; i++) {
		pthread_mutex_init(&buckets[i].lock, NULL);
		pthread_cond_init(&buckets[i].cond, kl__condattr());
	}
}

/* Every object shares these buckets, so a bucket lock that another thread
 * held at fork() would hang the child's own new objects: hold them all
 * across the fork, and give the child fresh ones (it has no waiters). */
static void
buckets_prepare(void)
{
	for (int i = 0; i < NBUCKETS; i++)
		pthread_mutex_lock(&buckets[i].lock);
}

static void
buckets_parent(void)
{
	for (int i = NBUCKETS - 1; i >= 0; i--)
		pthread_mutex_unlock(&buckets[i].lock);
}

static void
buckets_init(void)
{
	buckets_reset();
	(void)pthread_atfork(buckets_prepare, buckets_parent, buckets_reset);
}

static size_t
bucket_of(const void *word)
{
	return ((uintptr_t)word >> 4) % NBUCKETS;
}

static void
park(atomic_uint *word, int64_t expire_ns)
{
	size_t b = bucket_of(word);
	struct timespec ts;

	pthread_once(&buckets_once, buckets_init);
	pthread_mutex_lock(&buckets[b].lock);
	if (atomic_load_explicit(word, memory_order_acquire) == W_PARKED) {
		if (expire_ns == KL_NO_DEADLINE) {
			pthread_cond_wait(&buckets[b].cond, &buckets[b].lock);
		} else {
			ts.tv_sec = (time_t)(expire_ns / 1000000000);
			ts.tv_nsec = (long)(expire_ns % 1000000000);
			pthread_cond_timedwait(&buckets[b].cond,
					       &buckets[b].lock, &ts);
		}
	}
	pthread_mutex_unlock(&buckets[b].lock);
}

void
kl__unpark(void *wake)
{
	size_t b;

	if (wake == NULL)
		return;
	b = bucket_of(wake);
	pthread_once(&buckets_once, buckets_init);
	pthread_mutex_lock(&buckets[b].lock);
	pthread_cond_broadcast(&buckets[b].cond);
	pthread_mutex_unlock(&buckets[b].lock);
}
#endif

/* Online CPUs.  Not the calling thread's affinity: threads pinned one to a
 * CPU each (a common server layout) still gain from spinning, and the first
 * caller's mask would decide for every thread.  A process confined to one
 * CPU loses at most SPIN_NS per wait, or, asking again at once behind the
 * head, the yields of SPIN_NS per waiter ahead of it (see BEHIND_CPUS). */
static long
ncpu(void)
{
	static atomic_long cached;
	long n = atomic_load_explicit(&cached, memory_order_relaxed);

	if (n == 0) {
		n = sysconf(_SC_NPROCESSORS_ONLN);
		if (n < 1)
			n = 1;
		atomic_store_explicit(&cached, n, memory_order_relaxed);
	}
	return n;
}

/* Until when the process's CPUs are taken to be shared with busy threads
 * of others (see neighbours). */
static atomic_int_fast64_t neighbours_until;

/* The queue this thread last handed on by a release that took its lock,
 * and when (kl__waitq_released).  The pointer is only compared, never
 * followed: the queue may be gone. */
static _Thread_local uintptr_t handed_q;
static _Thread_local int64_t handed_ns;

#ifdef KL_TEST_HOOKS
static atomic_long test_parked, test_prods, test_readers_hinted;
static atomic_long test_behind, test_headed, test_kept, test_spins_skipped;
static atomic_int test_crowd = -1;
static atomic_int_fast64_t test_asks_again_ns = ASKS_AGAIN_NS;
static atomic_int_fast64_t test_behind_ns = -1, test_head_spin_ns = -1;
static atomic_bool test_slow_yields_ignored;

long
kl__test_parked(void)
{
	return atomic_load(&test_parked);
}

long
kl__test_prods(void)
{
	return atomic_load(&test_prods);
}

long
kl__test_readers_hinted(void)
{
	return atomic_load(&test_readers_hinted);
}

void
kl__test_neighbours(int how)
{
	atomic_store(&test_slow_yields_ignored, how < 0);
	atomic_store(&neighbours_until, how > 0 ? INT64_MAX : 0);
}

void
kl__test_crowd(int how)
{
	atomic_store(&test_crowd, how);
}

void
kl__test_asks_again_ns(int64_t ns)
{
	atomic_store(&test_asks_again_ns, ns < 0 ? ASKS_AGAIN_NS : ns);
}

void
kl__test_behind_ns(int64_t ns)
{
	atomic_store(&test_behind_ns, ns);
}

long
kl__test_behind(void)
{
	return atomic_load(&test_behind);
}

long
kl__test_headed(void)
{
	return atomic_load(&test_headed);
}

long
kl__test_kept(void)
{
	return atomic_load(&test_kept);
}

void
kl__test_head_spin_ns(int64_t ns)
{
	atomic_store(&test_head_spin_ns, ns);
}

long
kl__test_spins_skipped(void)
{
	return atomic_load(&test_spins_skipped);
}
#define TEST_COUNT(c, d) atomic_fetch_add(&(c), (d))
#define SLOW_YIELDS_IGNORED() atomic_load(&test_slow_yields_ignored)
#else
#define TEST_COUNT(c, d) ((void)0)
#define SLOW_YIELDS_IGNORED() false
#endif

/* ------------------------------------------------------------------ */
/* The queue */

void
kl__waitq_init(struct kl__waitq *q, pthread_mutex_t *lock)
{
	(void)lock; /* each waiter keeps the lock: see struct kl__waiter */
	q->head = NULL;
	q->len = 0;
	q->spin_misses = 0;
	q->spin_probe = 0;
	atomic_init(&q->readers, false);
	KL_ANNOTATE_ATOMIC(&q->readers);
}

bool
kl__overflow_valid(kl_overflow o)
{
	return o == KL_OVERFLOW_THIS || o == KL_OVERFLOW_FIRST ||
	       o == KL_OVERFLOW_LAST;
}

static void
unlink_waiter(struct kl__waitq *q, struct kl__waiter *w)
{
	if (w->next == w) {
		q->head = NULL;
	} else {
		w->prev->next = w->next;
		w->next->prev = w->prev;
		if (q->head == w)
			q->head = w->next;
	}
	w->next = w->prev = NULL;
	q->len--;
}

void *
kl__waiter_settle(struct kl__waiter *w)
{
	unsigned old;

	KL_YIELD("hand-off");
	KL_ANNOTATE_HAPPENS_BEFORE(&w->word);
	old = atomic_exchange_explicit(&w->word, W_SETTLED,
						memory_order_release);

	/* W_PRODDED: whoever prodded it wakes it, right after dropping the
	 * lock it prodded under. */
	return old == W_PARKED ? (void *)&w->word : NULL;
}

void
kl__waiter_fail(struct kl__waiter *w, int status)
{
	bool queued = w->state == KL_W_WAITING;

	if (!queued && w->state != KL_W_INIT)
		return;
	if (queued)
		unlink_waiter(w->q, w);
	w->state = KL_W_DONE;
	w->status = status;
	if (queued)
		kl__unpark(kl__waiter_settle(w));
}

/* The hook by which a firing cancel token fails w: called by kl_cancel_fire
 * with the token's lock held, which comes before the queue's. */
static void
cancel_fired(void *arg)
{
	struct kl__waiter *w = arg;
	struct kl__waitq *q;
	void (*left)(struct kl__waitq *q);

	pthread_mutex_lock(w->lock);
	/* Read before the fail: once settled, w may be gone. */
	q = w->state == KL_W_WAITING ? w->q : NULL;
	left = w->left;
	kl__waiter_fail(w, KL_ECANCELED);
	if (q != NULL && left != NULL)
		left(q);
	pthread_mutex_unlock(w->lock);
}

int
kl__waiter_prepare(struct kl__waiter *w, pthread_mutex_t *lock,
		   struct kl_cancel *c)
{
	w->next = w->prev = NULL;
	w->q = NULL;
	w->lock = lock;
	atomic_init(&w->word, W_AWAKE);
	KL_ANNOTATE_ATOMIC(&w->word);
	w->state = KL_W_INIT;
	w->status = KL_OK;
	w->spin = false;
	w->lone = false;
	w->front = false;
	w->shared = false;
	w->mixed = false;
	atomic_init(&w->headed, false);
	KL_ANNOTATE_ATOMIC(&w->headed);
	w->since_ns = 0;
	w->cancel = NULL;
	w->tid = kl__thread_id();
	w->data = 0;
	w->left = NULL;
	w->expire_ns = KL_NO_DEADLINE;
	w->check = NULL;
	w->check_arg = NULL;
	w->check_ns = -1;
	if (c != NULL) {
		w->chook.fire = cancel_fired;
		w->chook.arg = w;
		if (!kl__cancel_register(c, &w->chook))
			return KL_ECANCELED;
		/* Set before the waiter queues: a granter reads it
		 * (expiry_status) under the queue lock, which the waiter
		 * takes to queue. */
		w->cancel = c;
	}
	return KL_OK;
}

void
kl__waiter_finish(struct kl__waiter *w)
{
	if (w->cancel != NULL) {
		kl__cancel_unregister(w->cancel, &w->chook);
		w->cancel = NULL;
	}
}

static void
append(struct kl__waitq *q, struct kl__waiter *w)
{
	struct kl__waiter *h = q->head;

	w->q = q;
	if (h == NULL) {
		w->next = w->prev = w;
		q->head = w;
	} else {
		/* Before the head is after the tail: a ring. */
		w->next = h;
		w->prev = h->prev;
		h->prev->next = w;
		h->prev = w;
		if (w->front)
			q->head = w;
	}
	q->len++;
	w->state = KL_W_WAITING;
}

/* The status for a waiter whose expiry has come: its cancel token's deadline
 * makes it a cancel, its own a timeout. */
static int
expiry_status(const struct kl__waiter *w, int64_t now)
{
	return now >= kl__cancel_deadline(w->cancel) ? KL_ECANCELED
						     : KL_ETIMEDOUT;
}

/* Whether w's outcome is published: a granter (kl__waiter_settle), a
 * failer or w's own timeout set its state and status under the lock, then
 * stored W_SETTLED.  The acquire makes them readable without the lock. */
static bool
outcome_published(struct kl__waiter *w)
{
	return atomic_load_explicit(&w->word, memory_order_acquire) ==
	       W_SETTLED;
}

/*
 * Which threads waited lately, process-wide: bit (thread id mod 64) of
 * crowd_now for this period, of crowd_before for the one before.  Returns
 * whether more threads than CPUs waited in the two.  Races between waiters
 * only blur the count for a moment; no lock depends on it.
 */
static atomic_uint_fast64_t crowd_now, crowd_before;
static atomic_uint crowd_period;

static bool
crowded(uint64_t tid)
{
	unsigned period = (unsigned)(kl__coarse_now_ns() >> CROWD_SHIFT);
	unsigned seen = atomic_load_explicit(&crowd_period,
					     memory_order_relaxed);
	uint64_t bit = (uint64_t)1 << (tid % 64), now;

	KL_ANNOTATE_ATOMIC(&crowd_now);
	KL_ANNOTATE_ATOMIC(&crowd_before);
	KL_ANNOTATE_ATOMIC(&crowd_period);
	if (seen != period &&
	    atomic_compare_exchange_strong_explicit(
		    &crowd_period, &seen, period, memory_order_relaxed,
		    memory_order_relaxed)) {
		/* A period skipped means nobody waited in it. */
		now = atomic_exchange_explicit(&crowd_now, 0,
					       memory_order_relaxed);
		atomic_store_explicit(&crowd_before,
				      period - seen == 1 ? now : 0,
				      memory_order_relaxed);
	}
	now = atomic_load_explicit(&crowd_now, memory_order_relaxed);
	if ((now & bit) == 0)
		now = atomic_fetch_or_explicit(&crowd_now, bit,
					       memory_order_relaxed) |
		      bit;
	now |= atomic_load_explicit(&crowd_before, memory_order_relaxed);
#ifdef KL_TEST_HOOKS
	if (atomic_load(&test_crowd) >= 0)
		return atomic_load(&test_crowd) > 0;
#endif
	return __builtin_popcountll(now) > ncpu();
}

/* t + d (d >= 0), saturating at KL_NO_DEADLINE. */
static int64_t
add_ns(int64_t t, int64_t d)
{
	return t > KL_NO_DEADLINE - d ? KL_NO_DEADLINE : t + d;
}

/* Whether w yields before it spins in a crowd (kl__waitq_wait). */
static bool
yields(const struct kl__waiter *w)
{
	return !w->shared && !w->mixed;
}

/*
 * Whether threads of other processes were seen keeping the CPUs lately.
 * The spin's two cures for readers and writers (a spinner that gives its
 * CPU away between looks, and an exclusive request that does not yield
 * before its spin on a key readers use) assume that the threads ready to
 * run are the process's own, which wait for the lock or hold it.  Beside
 * a busy process they hand it the CPU instead, for a whole time slice, or
 * keep it from the holder, and the granted waiter is off its CPU while
 * the lock stands idle (4 threads, 90% shared, 2 CPUs, beside CPU-bound
 * processes: 0.11 to 0.26 M requests a second with them, 0.86 M
 * without).  A yield that kept the CPU away for over GIVE_SLOW_NS says
 * so; both cures stay off for NEIGHBOURS_NS after one.
 */
static bool
neighbours(int64_t now)
{
	KL_ANNOTATE_ATOMIC(&neighbours_until);
	return now < atomic_load_explicit(&neighbours_until,
					  memory_order_relaxed);
}

/* How a waiter spins (spin). */
enum spin_how {
	SPIN_KEEP, /* keeps its CPU: the head, whose grant is next */
	SPIN_GIVE, /* yields between looks, or keeps it beside neighbours */
	/* Behind the head: yields between looks, or parks beside neighbours;
	 * keeps its CPU from when a grant makes it the head (headed). */
	SPIN_BEHIND
};

/* When a spin of w from now for budget_ns ends: not past the wait's end,
 * whose timeout is seen after the spin. */
static int64_t
spin_end(const struct kl__waiter *w, int64_t now, int64_t budget_ns)
{
	int64_t until = add_ns(now, budget_ns);

	return until < w->expire_ns ? until : w->expire_ns;
}

/* Spins until w's outcome is published or budget_ns pass, as how says. */
static void
spin(struct kl__waiter *w, enum spin_how how, int64_t budget_ns)
{
	int64_t now = kl__now_ns(), until = spin_end(w, now, budget_ns), before;
	bool give = how != SPIN_KEEP && !neighbours(now);
	int looks;

	if (how == SPIN_BEHIND) {
		if (!give)
			return;
		TEST_COUNT(test_behind, 1);
	}
	looks = give ? SPIN_LOOKS_PER_YIELD : 64;
	for (;;) {
		for (int i = 0; i < looks; i++) {
			if (outcome_published(w))
				return;
			kl__cpu_relax();
		}
		now = kl__now_ns();
		/* Before the budget: a waiter made the head as its budget
		 * ran out was not prodded (it was awake), and parked it
		 * would cost its grant a wake-up. */
		if (how == SPIN_BEHIND &&
		    atomic_load_explicit(&w->headed, memory_order_relaxed)) {
			/* Its grant is next: yielding now would leave the
			 * lock granted to a thread off its CPU, as a head's
			 * spin is meant to avoid. */
			TEST_COUNT(test_kept, 1);
			how = SPIN_KEEP;
			give = false;
			looks = 64;
			until = spin_end(w, now, SPIN_NS);
			continue;
		}
		if (now >= until)
			return;
		if (!give)
			continue;
		before = now;
		sched_yield();
		if ((now = kl__now_ns()) - before > GIVE_SLOW_NS &&
		    !SLOW_YIELDS_IGNORED()) {
			atomic_store_explicit(&neighbours_until,
					      now + NEIGHBOURS_NS,
					      memory_order_relaxed);
			/* Behind the head it parks; if a grant marked it
			 * headed meanwhile, its own grant wakes it, a
			 * wake-up paid beside busy neighbours only. */
			if (how == SPIN_BEHIND)
				return;
			give = false;
			looks = 64;
		}
	}
}

/* Whether this thread asks for q right after handing it on
 * (kl__waitq_released). */
static bool
asks_again(const struct kl__waitq *q)
{
#ifdef KL_TEST_HOOKS
	int64_t window = atomic_load(&test_asks_again_ns);
#else
	int64_t window = ASKS_AGAIN_NS;
#endif

	return handed_q == (uintptr_t)q && kl__now_ns() - handed_ns < window;
}

/* How long a waiter that asks again at once spins behind the head, len
 * waiters queued with it (kl__waitq_wait). */
static int64_t
behind_ns(size_t len)
{
#ifdef KL_TEST_HOOKS
	if (atomic_load(&test_behind_ns) >= 0)
		return atomic_load(&test_behind_ns);
#endif
	return SPIN_NS * (int64_t)len;
}

/* How long a head spins before it parks (kl__waitq_wait). */
static int64_t
head_spin_ns(void)
{
#ifdef KL_TEST_HOOKS
	if (atomic_load(&test_head_spin_ns) >= 0)
		return atomic_load(&test_head_spin_ns);
#endif
	return SPIN_NS;
}

/* Whether a waiter that would spin on q parks at once instead (see
 * SPIN_MISSES).  Lock held. */
static bool
spin_skipped(struct kl__waitq *q)
{
	if (q->spin_misses < SPIN_MISSES)
		return false;
	if (++q->spin_probe < SPIN_PROBE) {
		TEST_COUNT(test_spins_skipped, 1);
		return true;
	}
	q->spin_probe = 0;
	return false;
}

void
kl__waitq_released(const struct kl__waitq *q, void *prod)
{
	kl__unpark(prod);
	if (q != NULL) {
		handed_q = (uintptr_t)q;
		handed_ns = kl__now_ns();
	}
}

int
kl__waitq_wait(struct kl__waitq *q, struct kl__waiter *w,
	       int64_t deadline_ns, size_t max_queue, kl_overflow overflow)
{
	unsigned awake = W_AWAKE;
	int64_t check_at = KL_NO_DEADLINE, wake_at, now;
	int oldstate, status;
	size_t len;
	bool crowd, full, hinted, again;

	if (w->state == KL_W_DONE) { /* canceled before it could queue */
		pthread_mutex_unlock(w->lock);
		return w->status;
	}
	/* A waiter going back to the head was admitted before: no overflow
	 * check for it. */
	if (!w->front && q->len >= max_queue) {
		if (max_queue == 0 || overflow == KL_OVERFLOW_THIS) {
			pthread_mutex_unlock(w->lock);
			return KL_EOVERFLOW;
		}
		kl__waiter_fail(overflow == KL_OVERFLOW_FIRST
					? q->head
					: kl__waitq_tail(q),
				KL_EOVERFLOW);
	}
	w->expire_ns = kl__cancel_deadline(w->cancel);
	if (deadline_ns < w->expire_ns)
		w->expire_ns = deadline_ns;
	if (w->since_ns == 0)
		w->since_ns = kl__now_ns();
	if (w->check != NULL && w->check_ns >= 0)
		check_at = add_ns(w->since_ns, w->check_ns);
	append(q, w);
	/* An exclusive request on a key that shared requests use does not
	 * yield before its spin (it is mixed, see below) even when a writer
	 * holds the key now: the readers queue behind it next, and its
	 * yield away left them spinning on the CPU it needed once granted
	 * (a quick harness, 4 threads, 90% shared, on 2 CPUs: 0.37 M
	 * requests a second with that yield, 1.5 M without).  Not beside
	 * busy threads of other processes (neighbours).  The hint lasts
	 * while the queue's owner keeps the key: a slot's until it takes
	 * another key, a chained entry's until it is freed. */
	if (w->shared)
		atomic_store_explicit(&q->readers, true, memory_order_relaxed);
	hinted = !w->shared && !w->mixed &&
		 atomic_load_explicit(&q->readers, memory_order_relaxed);
	KL_YIELD("enqueue");
	/* Spin only while the holder and this waiter can both run at once,
	 * and only as the head, or as a shared request a few places behind
	 * it: that one is granted with the run of shared requests at the
	 * head, or right after the exclusive one there, a section or two
	 * away.  Parked instead, every reader behind a writer cost a
	 * wake-up (4 threads, 90% shared: 0.12x pthread_rwlock's throughput
	 * in keylock-bench; 0.33x with these spinning and the shard lock's
	 * own spin, table_acquire.c). */
	w->spin = ncpu() > 1 &&
		  (q->len == 1 || (w->shared && q->len <= 2 * (size_t)ncpu()));
	/* Only the lone waiter learns: a shared one behind a writer waits
	 * for the writer's section, however short the readers' are. */
	w->lone = w->spin && q->len == 1;
	if (w->lone && spin_skipped(q))
		w->spin = w->lone = false;
	len = q->len;
	full = len >= (size_t)ncpu();
	pthread_mutex_unlock(w->lock);
	/* Only this thread reads mixed (yields): set without the lock. */
	if (hinted && !neighbours(kl__now_ns())) {
		w->mixed = true;
		TEST_COUNT(test_readers_hinted, 1);
	}
	/* Every waiter counts in, spinning or not. */
	crowd = crowded(w->tid);
	again = crowd && yields(w) && asks_again(q);

	/* A waiter is not a cancellation point: being cancelled while parked
	 * would leave the node linked on a dead stack. */
	pthread_setcancelstate(PTHREAD_CANCEL_DISABLE, &oldstate);
	/* In a crowd (more threads than CPUs waited lately), threads that
	 * want the lock may be ready to run but without a CPU.  A thread
	 * that asks again for the lock it has just handed on (again: within
	 * ASKS_AGAIN_NS, so that little but the lock is in its loop) would
	 * take turns with the thread it handed to, the two keeping the CPUs
	 * between them while the others wait for a time slice (4 threads on
	 * 2 CPUs: the busiest thread took the key 2.3 times as often as the
	 * idlest).  As the head it yields once first, which lets such a
	 * thread run and queue (with nobody else ready it costs one system
	 * call).  Behind the head it does not sleep either, while the
	 * waiters are few enough (BEHIND_CPUS): it gives its CPU to the
	 * threads queued before it between its looks (SPIN_BEHIND), about
	 * SPIN_NS for each waiter there was, so that each grant goes
	 * to a thread that runs or gets a CPU at the next look of the
	 * thread on it, not to one that must be woken; once a grant makes
	 * it the head it keeps its CPU (keylock-bench, empty section,
	 * unpinned, two full runs each, max/min 1.00 to 1.03 throughout: 4
	 * threads 73 to 97 k grants a second before, 342 to 713 k so; 8
	 * threads 80 to 91 k before, 292 to 405 k).  A thread that did a
	 * few microseconds of work in between does neither: its yield handed
	 * the CPU to a thread in the middle of its own work, the grant then
	 * waited for that thread to give it back, and the next threads
	 * queued behind the grant, a convoy the lock seldom left (4 threads,
	 * 400 ns sections and 4 us between: 367 to 392 k grants a second
	 * with max/min 1.09 to 1.25 with the yield, 393 to 416 k and 1.06 to
	 * 1.09 without; spinning behind the head too, as every waiter in a
	 * crowd: 220 to 250 k).  The yield is a cure
	 * for turns taken one thread at a time, so a shared request, or one
	 * on a key held shared (mixed), does not yield first: readers are
	 * granted together and a writer waits for readers whose sections
	 * end anyway (with the yield: 0.17x and 0.27x pthread_rwlock in
	 * keylock-bench, 4 threads, 90% shared, on 2 CPUs; a writer among 8
	 * readers waited about 1.5 times as long on average without it, its
	 * longest wait no longer).  A shared waiter instead yields between
	 * its looks when the waiters, itself included, fill the CPUs (an
	 * exclusive one spins as the lone waiter, or behind the head when
	 * it asks again at once): then those it waits for, or those granted
	 * together with it, may be ready without a CPU, and a pure spin kept
	 * them off it until it ran out and the waiter slept, so that every
	 * writer's turn cost a wake-up.  With fewer waiters it spins without
	 * yielding: the yields only took turns with the running holders (3
	 * threads: 1.4 M requests a second yielding, 3.0 M not).  With the
	 * readers hint above, keylock-bench's 4 threads, 90% shared went
	 * from 0.16x pthread_rwlock to 0.53x to 0.85x, pinned 0.54x to
	 * 0.60x. */
	if (w->spin) {
		if (again)
			sched_yield();
		spin(w, crowd && !yields(w) && full ? SPIN_GIVE : SPIN_KEEP,
		     head_spin_ns());
	} else if (again && !w->front && ncpu() > 1 &&
		   len <= BEHIND_CPUS * (size_t)ncpu()) {
		spin(w, SPIN_BEHIND, behind_ns(len));
	}
	while (!outcome_published(w)) {
		wake_at = check_at < w->expire_ns ? check_at : w->expire_ns;
		if (atomic_compare_exchange_strong_explicit(
			    &w->word, &awake, W_PARKED, memory_order_acquire,
			    memory_order_acquire) ||
		    awake == W_PARKED) {
			TEST_COUNT(test_parked, 1);
			park(&w->word, wake_at);
			TEST_COUNT(test_parked, -1);
		}
		awake = W_PRODDED;
		if (atomic_compare_exchange_strong_explicit(
			    &w->word, &awake, W_AWAKE, memory_order_acquire,
			    memory_order_acquire)) {
			/* Now the head: spin as one, yielding first in a
			 * crowd, or, shared or mixed, between its looks
			 * (readers are granted with it or before it).  It
			 * yields first whether it asked again at once or
			 * not: woken one grant early, it most often lands
			 * on the CPU of a thread that holds the lock or is
			 * about to, and its spin kept that thread off it (8
			 * threads, 400 ns sections and 4 us between, on 2
			 * CPUs: 20 to 26 k grants a second without the
			 * yield, 60 to 71 k with it).  The crowd is counted
			 * again: this wait may be old. */
			crowd = crowded(w->tid);
			if (crowd && yields(w))
				sched_yield();
			spin(w, crowd && !yields(w) ? SPIN_GIVE : SPIN_KEEP,
			     SPIN_NS);
		}
		awake = W_AWAKE;
		if (outcome_published(w) || wake_at == KL_NO_DEADLINE)
			continue;
		/* Never early: trust the clock, not the wake-up. */
		now = kl__now_ns();
		if (now < wake_at)
			continue;
		if (now < w->expire_ns) {
			/* The check is due, not the deadline: the waiter
			 * stays queued while it runs, and a grant meanwhile
			 * wins over what it returns. */
			if ((status = w->check(w)) == KL_OK) {
				check_at = w->check_ns < 0
						   ? KL_NO_DEADLINE
						   : add_ns(kl__now_ns(),
								w->check_ns);
				continue;
			}
		} else {
			status = expiry_status(w, now);
		}
		KL_YIELD("timeout");
		/* Through w->lock, never q: once a granter has failed this
		 * waiter on its own, the queue's owner (a key table entry)
		 * may already be freed.  q is only valid while w is queued,
		 * which the state says under the lock. */
		pthread_mutex_lock(w->lock);
		if (w->state == KL_W_WAITING) {
			unlink_waiter(w->q, w);
			w->state = KL_W_DONE;
			w->status = status;
			atomic_store_explicit(&w->word, W_SETTLED,
					      memory_order_relaxed);
			if (w->left != NULL)
				w->left(w->q);
		}
		pthread_mutex_unlock(w->lock);
	}
	KL_ANNOTATE_HAPPENS_AFTER(&w->word);
	pthread_setcancelstate(oldstate, NULL);
	/* Read without the lock: whoever published the outcome had made
	 * state and status final first. */
	KL_ASSERT(w->state == KL_W_GRANTED || w->state == KL_W_DONE);
	return w->state == KL_W_GRANTED ? KL_OK : w->status;
}

/*
 * Without this, with more waiters than one, every grant goes to a parked
 * thread and costs a whole wake-up while the lock stays idle (on a 2-CPU
 * VM, 12 to 14 us: 4 threads on one key ran at the FIFO baseline's rate,
 * 70,000 grants a second, whether the section was empty or not).  Woken
 * one grant early, the head overlaps its wake-up with the section and the
 * hand-off before it.  It seldom costs an extra system call: the grant to
 * a spinning head needs no wake-up (only a head whose spin ran out before
 * its grant is woken twice).
 */
void *
kl__waitq_prod(struct kl__waitq *q)
{
	struct kl__waiter *h = q->head;
	unsigned parked = W_PARKED;

	if (h == NULL || ncpu() < 2)
		return NULL;
	/* Only a parked head: one that is awake is running already.  A
	 * grant that comes before the prodded head wakes finds W_PRODDED
	 * and leaves the wake-up to us. */
	if (atomic_compare_exchange_strong_explicit(&h->word, &parked,
						    W_PRODDED,
						    memory_order_relaxed,
						    memory_order_relaxed)) {
		TEST_COUNT(test_prods, 1);
		return &h->word;
	}
	/* Awake: running, or spinning behind the old head (spin).  Under
	 * the lock, while h is queued and so still waiting on its stack. */
	atomic_store_explicit(&h->headed, true, memory_order_relaxed);
	TEST_COUNT(test_headed, 1);
	return NULL;
}

struct kl__waiter *
kl__waitq_live_head(struct kl__waitq *q)
{
	struct kl__waiter *w;
	int64_t now = 0;

	while ((w = q->head) != NULL) {
		/* A waiter whose deadline has passed but which has not yet
		 * woken does not get the lock: a token that fired by itself
		 * must not be granted afterwards. */
		if (w->expire_ns != KL_NO_DEADLINE) {
			if (now == 0)
				now = kl__now_ns();
			if (now >= w->expire_ns) {
				kl__waiter_fail(w, expiry_status(w, now));
				continue;
			}
		}
		return w;
	}
	return NULL;
}

void
kl__waitq_grant(struct kl__waitq *q, struct kl__waiter *w)
{
	KL_ASSERT(w->state == KL_W_WAITING && w->q == q);
	/* A lone waiter still awake saw its grant coming (or is about to
	 * park on a grant it will find): see SPIN_MISSES. */
	if (w->lone) {
		if (atomic_load_explicit(&w->word, memory_order_relaxed) ==
		    W_AWAKE)
			q->spin_misses = 0;
		else if (q->spin_misses < UINT8_MAX)
			q->spin_misses++;
	}
	unlink_waiter(q, w);
	w->state = KL_W_GRANTED;
}

struct kl__waiter *
kl__waitq_grant_head(struct kl__waitq *q)
{
	struct kl__waiter *w = kl__waitq_live_head(q);

	if (w != NULL)
		kl__waitq_grant(q, w);
	return w;
}

#ifdef KL_TEST_HOOKS
/* GCOVR_EXCL_START: invariant checks of the test build; their failure
 * branches run only on a broken invariant, and users never get them. */
int
kl__waitq_check(const struct kl__waitq *q, const pthread_mutex_t *lock,
		const char *what)
{
	const struct kl__waiter *w = q->head;
	size_t n = 0;

	if (w == NULL) {
		if (q->len == 0)
			return KL_OK;
		kl__test_report("%s: empty but len %zu", what,
				(size_t)q->len);
		return KL_EINVAL;
	}
	do {
		if (++n > q->len) {
			kl__test_report("%s: more waiters than len %zu", what,
					(size_t)q->len);
			return KL_EINVAL;
		}
		if (w->next == NULL || w->prev == NULL ||
		    w->next->prev != w || w->prev->next != w) {
			kl__test_report("%s: waiter %zu badly linked", what,
					n);
			return KL_EINVAL;
		}
		if (w->q != q || w->lock != lock) {
			kl__test_report("%s: waiter %zu of another queue or "
					"lock",
					what, n);
			return KL_EINVAL;
		}
		if (w->state != KL_W_WAITING ||
		    atomic_load_explicit(&w->word, memory_order_relaxed) ==
			    W_SETTLED) {
			kl__test_report("%s: waiter %zu still queued in state "
					"%d (granted or failed)",
					what, n, w->state);
			return KL_EINVAL;
		}
		w = w->next;
	} while (w != q->head);
	if (n != q->len) {
		kl__test_report("%s: %zu waiters, len %zu", what, n,
				(size_t)q->len);
		return KL_EINVAL;
	}
	return KL_OK;
}
/* GCOVR_EXCL_STOP */
#endif

void
kl__waitq_fail_all(struct kl__waitq *q, int status)
{
	while (q->head != NULL)
		kl__waiter_fail(q->head, status);
}

void
kl__waitq_reduce(struct kl__waitq *q, size_t max_queue, kl_overflow overflow)
{
	while (q->len > max_queue)
		kl__waiter_fail(overflow == KL_OVERFLOW_FIRST
					? q->head
					: kl__waitq_tail(q),
				KL_EOVERFLOW);
}
