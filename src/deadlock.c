/* SPDX-License-Identifier: MIT */
/*
 * Deadlock detection for the key tables (the memory provider), as
 * PostgreSQL does it: nothing while a wait is short; a wait that has lasted
 * deadlock_ms registers in the waits-for graph and walks it (waiting thread
 * -> the key it waits for -> the threads holding that key -> the keys they
 * wait for -> ...), and again every deadlock_ms while it waits.  A walk
 * that comes back to its own thread ends that thread's wait with
 * KL_EDEADLK: the thread that closes a cycle is its one victim.
 *
 * One victim per cycle.  Registering, walking and choosing happen under
 * one process-wide mutex, and a victim leaves the graph before that mutex
 * is dropped (it leaves its queue right after, as a timed-out waiter does,
 * unless a grant came first).  So a later walk never sees the victim's
 * edge, and the cycle it closed is broken for every other member.
 *
 * No false victim.  The graph changes while it is walked: a holder may
 * release, a waiter be granted or time out.  The walk reads each edge under
 * the lock of the shard of the key concerned, one shard lock at a time
 * (the detector's mutex comes before every shard lock, and nothing takes
 * it with a shard lock held), so the edges of a cycle are read at
 * different moments.  It therefore reads every edge of a cycle it found a
 * second time before it believes it.  An edge "T waits for K, held by U"
 * names what it saw: T's waiter, which leaves its queue once and never
 * comes back (the registry holds it until the wait is over), and U's grant
 * of K, which a key never gives twice (kl__table_waited_holders).  An edge
 * seen the same in both passes held all along from its first reading to
 * its second, so at the moment between the two passes every edge of the
 * cycle held at once: the cycle was real.  A change in between only makes
 * a pass fail, and the next check, deadlock_ms later, walks again.
 *
 * No allocation: a waiter's record (struct kl__dl_wait) lives on its
 * stack, beside its waiter, and carries the walk's scratch.  A walk costs
 * O(n * h) for n registered waiters and h holders seen, under the mutex;
 * only waits longer than deadlock_ms pay it.
 */
#include "config.h"

#include <stdio.h>
#include <unistd.h>

#include "annotate.h"
#include "table.h"

#define DEFAULT_MS 1000 /* PostgreSQL's deadlock_timeout */
#define UNSET INT64_MIN /* not read from the environment yet */
/* Room for the cycle in a kl_error, after "lock '<key>': ". */
#define WHY_SIZE 176
/* Bytes of each key the message shows. */
#define SHOWN 40

static atomic_int_least64_t setting = UNSET;

/* The registry of waiters that waited deadlock_ms, and the walks' count. */
static pthread_mutex_t dl_lock = PTHREAD_MUTEX_INITIALIZER;
static struct kl__dl_wait *waits;
static uint64_t walks;

/* Why this thread's wait was chosen, until a caller takes it.  Not
 * initial-exec: only the error path touches it. */
static _Thread_local char why[WHY_SIZE];

#ifndef HAVE_SECURE_GETENV
static char *
secure_getenv(const char *name)
{
	return getuid() == geteuid() && getgid() == getegid() ? getenv(name)
							      : NULL;
}
#endif

/* KEYLOCK_DEADLOCK_MS, read once unless kl_deadlock_ms_set came first.  A
 * value kl_duration_parse rejects leaves the default. */
static __attribute__((noinline)) int64_t
setting_init(void)
{
	int_least64_t unset = UNSET;
	int64_t ms = DEFAULT_MS, v;
	const char *env = secure_getenv("KEYLOCK_DEADLOCK_MS");

	if (env != NULL && kl_duration_parse(env, &v) == KL_OK)
		ms = v;
	atomic_compare_exchange_strong_explicit(&setting, &unset, ms,
						memory_order_relaxed,
						memory_order_relaxed);
	return atomic_load_explicit(&setting, memory_order_relaxed);
}

static inline int64_t
setting_ms(void)
{
	int64_t ms = atomic_load_explicit(&setting, memory_order_relaxed);

	return __builtin_expect(ms == UNSET, 0) ? setting_init() : ms;
}

int
kl_deadlock_ms_set(int64_t ms)
{
	if (kl__check_timeout(ms) != KL_OK)
		return KL_EINVAL;
	atomic_store_explicit(&setting, ms, memory_order_relaxed);
	return KL_OK;
}

int64_t
kl_deadlock_ms(void)
{
	return setting_ms();
}

/* ms in ns for a check's delay; -1 (no check) past the clock's range. */
static int64_t
delay_ns(int64_t ms)
{
	return ms > INT64_MAX / 1000000 ? -1 : ms * 1000000;
}

static void
link_wait(struct kl__dl_wait *dw)
{
	dw->walk = 0; /* walks count from 1 */
	dw->prev = NULL;
	dw->next = waits;
	if (waits != NULL)
		waits->prev = dw;
	waits = dw;
	dw->registered = true;
}

static void
unlink_wait(struct kl__dl_wait *dw)
{
	if (dw->prev != NULL)
		dw->prev->next = dw->next;
	else
		waits = dw->next;
	if (dw->next != NULL)
		dw->next->prev = dw->prev;
	dw->next = dw->prev = NULL;
	dw->registered = false;
}

/* ------------------------------------------------------------------ */
/* The walk (detector's mutex held) */

struct walk {
	struct kl__dl_wait *me;
	struct kl__dl_wait *cur;  /* whose key's holders are being read */
	struct kl__dl_wait *tail; /* of the breadth-first queue (->to) */
	uint64_t id;
	/* The first pass: the waiter whose key this thread holds, and by
	 * which grant. */
	struct kl__dl_wait *closer;
	uint64_t close_grant;
	/* The second pass: the holder looked for, and whether it was. */
	uint64_t want_tid, want_grant;
	bool seen;
};

/* A holder of cur's key: this thread closes a cycle; a registered waiter
 * not reached yet joins the queue. */
static void
visit(void *arg, uint64_t tid, uint64_t grant)
{
	struct walk *k = arg;
	struct kl__dl_wait *r;

	if (k->closer != NULL)
		return;
	if (tid == k->me->w->tid) {
		k->closer = k->cur;
		k->close_grant = grant;
		return;
	}
	for (r = waits; r != NULL; r = r->next)
		if (r->w->tid == tid)
			break; /* a thread waits once at a time */
	if (r == NULL || r->walk == k->id)
		return;
	r->walk = k->id;
	r->from = k->cur;
	r->grant = grant;
	r->to = NULL;
	k->tail->to = r;
	k->tail = r;
}

static void
confirm(void *arg, uint64_t tid, uint64_t grant)
{
	struct walk *k = arg;

	if (tid == k->want_tid && grant == k->want_grant)
		k->seen = true;
}

/* Whether me's wait closes a cycle of the graph, read twice (see the
 * top); *msg then names its keys. */
static bool
closes_cycle(struct kl__dl_wait *me, char *msg, size_t size)
{
	struct walk k = { .me = me, .tail = me, .id = ++walks };
	struct kl__dl_wait *r;
	char shown[SHOWN], part[SHOWN + 48];
	size_t n = 0;
	bool room = true;

	/* Breadth first, so the shortest cycle through me is named. */
	me->walk = k.id;
	me->from = me->to = NULL;
	for (r = me; r != NULL && k.closer == NULL; r = r->to) {
		k.cur = r;
		(void)kl__table_waited_holders(r->w, visit, &k, NULL, 0);
	}
	if (k.closer == NULL)
		return false;
	/* The path me -> ... -> closer, forward through ->to. */
	k.closer->to = NULL;
	for (r = k.closer; r != me; r = r->from)
		r->from->to = r;
	msg[0] = '\0';
	for (r = me; r != NULL; r = r->to) {
		k.want_tid = r->to != NULL ? r->to->w->tid : me->w->tid;
		k.want_grant = r->to != NULL ? r->to->grant : k.close_grant;
		k.seen = false;
		if (!kl__table_waited_holders(r->w, confirm, &k, shown,
					      sizeof shown) ||
		    !k.seen)
			return false;
		if (!room)
			continue;
		snprintf(part, sizeof part,
			 r == me ? "deadlock: waits for '%s'"
				 : ", held by a thread waiting for '%s'",
			 shown);
		room = kl__msg_append(msg, size, &n, part);
	}
	if (room)
		(void)kl__msg_append(msg, size, &n, ", held by this thread");
	return true;
}

/* w's check (kl__waiter.check): due once w has waited deadlock_ms, then
 * every deadlock_ms. */
static int
check(struct kl__waiter *w)
{
	struct kl__dl_wait *dw = w->check_arg;
	int64_t ms = setting_ms();
	char msg[WHY_SIZE];
	int rc = KL_OK;

	/* Turned off meanwhile: out of the graph, no more checks. */
	w->check_ns = ms < 0 ? -1 : delay_ns(ms > 0 ? ms : 1);
	pthread_mutex_lock(&dl_lock);
	if (w->check_ns < 0) {
		if (dw->registered)
			unlink_wait(dw);
	} else {
		if (!dw->registered)
			link_wait(dw);
		if (closes_cycle(dw, msg, sizeof msg)) {
			unlink_wait(dw);
			rc = KL_EDEADLK;
		}
	}
	pthread_mutex_unlock(&dl_lock);
	if (rc == KL_EDEADLK) {
		memcpy(why, msg, sizeof why);
		dw->victim = true;
	}
	return rc;
}

void
kl__deadlock_arm(struct kl__dl_wait *dw, struct kl__waiter *w)
{
	int64_t ms = setting_ms();

	dw->w = w;
	dw->registered = false;
	dw->victim = false;
	if (ms < 0)
		return;
	w->check = check;
	w->check_arg = dw;
	w->check_ns = delay_ns(ms);
}

void
kl__deadlock_leave(struct kl__dl_wait *dw, int rc)
{
	if (dw->victim && rc != KL_EDEADLK)
		why[0] = '\0'; /* granted after all */
	dw->victim = false;
	if (dw->registered) {
		pthread_mutex_lock(&dl_lock);
		unlink_wait(dw);
		pthread_mutex_unlock(&dl_lock);
	}
}

bool
kl__deadlock_take(char *buf, size_t size)
{
	if (why[0] == '\0')
		return false;
	snprintf(buf, size, "%s", why);
	why[0] = '\0';
	return true;
}
