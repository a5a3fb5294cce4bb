/* SPDX-License-Identifier: MIT */
/*
 * The Lock strategy: resolve the key, ask the provider, report events, run
 * the caller's function, release on every path.
 *
 * No internal lock is held here: events are raised from this file only, after
 * the provider call has returned, so a callback may itself take locks.
 * kl_lock_run and kl_lock_run_lease share one body (run) and keep their
 * lease on the stack or in the key's entry: they allocate nothing, nor
 * does kl_lock_acquire on a memory provider when the key is free (the
 * lease in the table: in_entry, acquire_shared).
 * kl_lock_run_many goes through the same body with a key set, whose lease
 * (struct lease_set) is one allocation holding a struct kl_lease per key.
 */
#include "config.h"

#include <limits.h>
#include <string.h>

#include "internal.h"
#include "table.h"

struct kl_lock {
	/* Aligned so that a pointer to it leaves the lease marks clear. */
	_Alignas(8) kl_provider *provider;
	/* The provider's table when leases live in its entries (see
	 * in_entry), else NULL: one load on every acquire and release. */
	struct kl__table *table;
	/* The same for a KL_SHARED lock whose kl_lock_acquire leases live
	 * in the table (see is_solo), else NULL. */
	struct kl__table *shared_table;
	char *key; /* NULL: each call's key */
	size_t key_len;
	int64_t timeout_ms;
	int64_t ttl_ms;
	kl_event_fn on_event;
	void *event_arg;
	unsigned flags;
};

struct kl_lease {
	kl_lock *lock;
	void *handle;
	uint64_t fence;
	int64_t granted_ns;
	const char *key;
	size_t key_len;
	unsigned lent; /* LEASE_LENT, LEASE_RELEASED: see lent_release */
};

/*
 * The lease of a key set: word is the lock with LEASE_SET (and the lent
 * marks) in its low bits, so that lease_lock() reads it like any lease.
 * held[0..n-1] are the distinct keys in canonical order, each a lease of
 * its own from the provider (never in an entry); held[0..taken-1] are held.
 * The keys point into the caller's array (run) or into the copy that
 * follows held[] (kl_lock_acquire_many).
 */
struct lease_set {
	kl_lock *word;
	size_t n;
	size_t taken;
	bool heap; /* allocated, else in kl_lock_run_many's frame */
	struct kl_lease held[];
};

/* Sets of up to this many keys given to kl_lock_run_many live on its stack:
 * the common pairs and triples allocate nothing. */
#define SET_ON_STACK 4

#define KNOWN_FLAGS (KL_ERRORCHECK | KL_SHARED)

/*
 * A lease of kl_lock_acquire from a memory provider, on a lock without an
 * event hook, lives in the key's table entry: a held key costs one
 * allocation.  Such a lease is the entry's lock word (kl__entry_lock), which
 * holds the kl_lock just as a struct kl_lease holds it in its first member,
 * so lease_lock() reads either kind and the lock says which kind it is.
 * Its key and fence are the entry's; it ends with the release, like the
 * entry may.  A lock with a hook keeps the separate lease: its events need
 * the key after the release.
 */
static bool
in_entry(const kl_lock *l)
{
	return l->table != NULL;
}

/*
 * The lease that run() lends to the fn of kl_lock_run_lease is marked
 * LEASE_LENT, so that a kl_lease_release of it by fn (which the contract
 * forbids) neither frees a lease that lives on run()'s stack nor releases
 * the key twice: it only adds LEASE_RELEASED, the key stays held until fn
 * returns, and run() then releases it as always and reports the misuse.
 * A struct kl_lease keeps the marks in its lent member; a lease in an entry
 * has no room but its lock word, so it keeps them in the word's low bits,
 * which a kl_lock pointer leaves clear.  Only the lent lease's holder (fn's
 * thread, or one fn handed it to before returning) touches the marks.
 */
#define LEASE_LENT 1u
#define LEASE_RELEASED 2u
#define LEASE_SET 4u /* a struct lease_set */
#define LEASE_MARKS ((uintptr_t)(LEASE_LENT | LEASE_RELEASED | LEASE_SET))
/* The marks of a shared lease in the table (see is_solo): no lent
 * lease is marked LEASE_RELEASED without LEASE_LENT, so these two are
 * free.  LEASE_IN_TABLE tells both from every other lease, LEASE_SET
 * then the record from the slot. */
#define LEASE_IN_TABLE LEASE_RELEASED
#define LEASE_SOLO LEASE_RELEASED
#define LEASE_RING (LEASE_RELEASED | LEASE_SET)
#define SOLO_FENCE_SHIFT 3

_Static_assert(_Alignof(kl_lock) > LEASE_MARKS,
	       "a kl_lock pointer has room for the lease marks");
/* A fence has up to 64 - KL__ENTRY_FENCE_SHIFT bits: a 32-bit word would
 * lose the high ones of a lone holder's, and its fences would go back. */
_Static_assert(sizeof(uintptr_t) * CHAR_BIT >=
		       64 - KL__ENTRY_FENCE_SHIFT + SOLO_FENCE_SHIFT,
	       "the solo word has room for a fence and the lease marks");

static uintptr_t
lease_word(const kl_lease *lease)
{
	return (uintptr_t)*(kl_lock *const *)(const void *)lease;
}

static kl_lock *
lease_lock(const kl_lease *lease)
{
	return (kl_lock *)(lease_word(lease) & ~LEASE_MARKS);
}

/* LEASE_SOLO or LEASE_RING for a shared lease in the table, else 0. */
static uintptr_t
in_table(const kl_lease *lease)
{
	uintptr_t w = lease_word(lease);

	if ((w & (LEASE_LENT | LEASE_RELEASED)) != LEASE_IN_TABLE)
		return 0;
	return w & LEASE_MARKS;
}

static bool
is_set(const kl_lease *lease)
{
	return (lease_word(lease) & LEASE_SET) != 0 && !in_table(lease);
}

static struct lease_set *
set_of(const kl_lease *lease)
{
	return (struct lease_set *)(void *)(uintptr_t)lease;
}

static struct kl__entry *
lease_entry(const kl_lease *lease)
{
	return kl__entry_of_lock((kl_lock **)(void *)(uintptr_t)lease);
}

/*
 * A lease of kl_lock_acquire on a KL_SHARED lock without an event hook, of
 * a memory provider (l->shared_table), lives in the table too, so that an
 * uncontended shared take allocates nothing, as an exclusive one does:
 * - taken by a lone holder (kl__table_acquire_solo), it is the slot's
 *   solo word (kl__entry_solo), which keeps the fence of the grant, shifted
 *   by SOLO_FENCE_SHIFT, under the marks LEASE_SOLO instead of a lock (no
 *   room for both; the release needs no lock: the slot finds its shard);
 * - else it is the lock member of the holder record the table links into
 *   the key's ring (one allocation, which the lease through the provider
 *   made besides its own), marked LEASE_RING.
 * Its key is the entry's, and it ends with the release.  run() lends a
 * lease of its stack through the provider, as before, never one of
 * these: the marks, not the lock, say which a lease is.
 */
static bool
is_solo(const kl_lease *lease)
{
	return in_table(lease) == LEASE_SOLO;
}

static bool
is_ring(const kl_lease *lease)
{
	return in_table(lease) == LEASE_RING;
}

static struct kl__entry *
solo_entry(const kl_lease *lease)
{
	return kl__entry_of_solo((kl_lock **)(void *)(uintptr_t)lease);
}

static struct kl__holder *
lease_holder(const kl_lease *lease)
{
	return kl__holder_of_lock((kl_lock **)(void *)(uintptr_t)lease);
}

int
kl_lock_new(kl_lock **out, const kl_lock_opts *opts)
{
	static const kl_lock_opts def = KL_LOCK_OPTS_INIT;
	kl_lock *l;

	if (out == NULL)
		return KL_EINVAL;
	*out = NULL;
	if (opts == NULL)
		opts = &def;
	if (kl__check_timeout(opts->timeout_ms) != KL_OK || opts->ttl_ms < 0 ||
	    (opts->flags & ~KNOWN_FLAGS) != 0)
		return KL_EINVAL;
	if ((l = kl__calloc(1, sizeof *l)) == NULL)
		return KL_ENOMEM;
	if (opts->key != NULL) {
		l->key_len = strlen(opts->key);
		if ((l->key = kl__strndup(opts->key, l->key_len)) == NULL) {
			kl__free(l);
			return KL_ENOMEM;
		}
	}
	l->provider =
		opts->provider != NULL ? opts->provider : kl_memory_provider();
	l->timeout_ms = opts->timeout_ms;
	l->ttl_ms = opts->ttl_ms;
	l->on_event = opts->on_event;
	l->event_arg = opts->event_arg;
	l->flags = opts->flags;
	/* A shared holder's lease is the slot's solo word or a holder
	 * record (see is_solo), not the entry's lock word. */
	l->table = l->on_event == NULL && !(l->flags & KL_SHARED)
			   ? l->provider->table
			   : NULL;
	l->shared_table = l->on_event == NULL && (l->flags & KL_SHARED)
				  ? l->provider->table
				  : NULL;
	*out = l;
	return KL_OK;
}

void
kl_lock_free(kl_lock *l)
{
	if (l == NULL)
		return;
	kl__free(l->key);
	kl__free(l);
}

static void
emit(const kl_lock *l, kl_event_type type, const char *key, int status,
     int64_t waited_ms, int64_t held_ms)
{
	kl_event ev;

	if (l->on_event == NULL)
		return;
	ev.type = type;
	ev.key = key;
	ev.status = status;
	ev.waited_ms = waited_ms;
	ev.held_ms = held_ms;
	l->on_event(&ev, l->event_arg);
}

static int64_t
ms_since(int64_t start_ns)
{
	int64_t d = kl__now_ns() - start_ns;

	return d < 0 ? 0 : d / 1000000;
}

/* Called by a provider when a held lease was lost. */
static void
lease_lost(void *ctx)
{
	struct kl_lease *lease = ctx;

	emit(lease->lock, KL_EV_LOST, lease->key, KL_EPROVIDER, 0,
	     ms_since(lease->granted_ns));
}

/* The key for l and call: the lock's wins.  KL_ENOKEY (raised as REJECTED)
 * when neither has one. */
static int
resolve_key(kl_lock *l, const kl_call *call, const char **key, size_t *len,
	    kl_error *err)
{
	if (l->key != NULL) {
		*key = l->key;
		*len = l->key_len;
		return KL_OK;
	}
	if (call != NULL && call->key != NULL) {
		*key = call->key;
		*len = strlen(call->key);
		return KL_OK;
	}
	kl__error_set(err, KL_ENOKEY, "neither the lock nor the call has a key");
	emit(l, KL_EV_REJECTED, NULL, KL_ENOKEY, 0, 0);
	return KL_ENOKEY;
}

/* Fills err for a failure rc to acquire key; detail is the provider's
 * message ("" for none; for a key of a table, the cycle that deadlock
 * detection found, taken here, err or not). */
static __attribute__((noinline, cold)) void
rejected(const kl_lock *l, const char *key, size_t len, int rc,
	 const char *detail, kl_error *err)
{
	char shown[72], cycle[sizeof err->message];

	if (rc == KL_EDEADLK && detail[0] == '\0' &&
	    kl__deadlock_take(cycle, sizeof cycle))
		detail = cycle;
	if (err == NULL)
		return;
	kl__key_printable(shown, sizeof shown, key, len);
	if (detail[0] != '\0')
		kl__error_set(err, rc, "lock '%s': %s", shown, detail);
	else if (rc == KL_ETIMEDOUT)
		kl__error_set(err, rc, "lock '%s' not acquired within %lld ms",
			      shown, (long long)l->timeout_ms);
	else
		kl__error_set(err, rc, "lock '%s': %s", shown,
			      kl_strerror(rc));
}

/* kl_lock_acquire with the lease in the key's entry (see in_entry): no
 * event to raise.  marks: 0, or LEASE_LENT for run(). */
static int
acquire_in_entry(kl_lock *l, const kl_call *call, const char *key,
		 size_t len, unsigned marks, kl_lease **out, kl_error *err)
{
	struct kl__entry *e;
	uint64_t fence;
	int rc;

	rc = kl__table_acquire(l->table, key, len,
			       kl__deadline(l->timeout_ms),
			       call != NULL ? call->cancel : NULL, l->flags,
			       &e, &fence);
	if (rc != KL_OK) {
		rejected(l, key, len, rc, "", err);
		return rc;
	}
	*kl__entry_lock(e) = (kl_lock *)((uintptr_t)l | marks);
	*out = (kl_lease *)(void *)kl__entry_lock(e);
	if (err != NULL) {
		err->status = KL_OK;
		err->message[0] = '\0';
	}
	return KL_OK;
}

/* kl_lock_acquire of a lock with a shared_table: the lease in the table
 * (see is_solo).  Out of line: the exclusive take keeps its frame. */
static __attribute__((noinline)) int
acquire_shared(kl_lock *l, const kl_call *call, const char *key, size_t len,
	       kl_lease **out, kl_error *err)
{
	kl_cancel *cancel = call != NULL ? call->cancel : NULL;
	struct kl__holder *h;
	struct kl__entry *e;
	uint64_t fence;
	int rc;

	/* Without a token (one fired must fail even on a free key), as the
	 * provider does. */
	if (cancel == NULL &&
	    kl__table_acquire_solo(l->shared_table, key, len, &e, &fence)) {
		kl_lock **w = kl__entry_solo(e);

		*w = (kl_lock *)(uintptr_t)((fence << SOLO_FENCE_SHIFT) |
					    LEASE_SOLO);
		*out = (kl_lease *)(void *)w;
		goto granted;
	}
	if ((h = kl__malloc(sizeof *h)) == NULL) {
		kl__error_set(err, KL_ENOMEM, "out of memory for the lease");
		return KL_ENOMEM;
	}
	rc = kl__table_acquire_shared(l->shared_table, key, len,
				      kl__deadline(l->timeout_ms), cancel,
				      l->flags, h, &fence);
	if (rc != KL_OK) {
		kl__free(h);
		rejected(l, key, len, rc, "", err);
		return rc;
	}
	h->lock = (kl_lock *)((uintptr_t)l | LEASE_RING);
	*out = (kl_lease *)(void *)&h->lock;
granted:
	if (err != NULL) {
		err->status = KL_OK;
		err->message[0] = '\0';
	}
	return KL_OK;
}

/* Asks the provider for lease->key, waiting up to timeout_ms, and raises
 * ACQUIRED or REJECTED. */
static int
acquire(kl_lock *l, kl_cancel *cancel, int64_t timeout_ms,
	struct kl_lease *lease, kl_error *err)
{
	kl_provider *p = l->provider;
	kl_error perr;
	int64_t start;
	int rc, cs;

	lease->lock = l;
	/* Times are only reported through events: without a hook, spare the
	 * clock reads. */
	start = l->on_event != NULL ? kl__now_ns() : 0;
	perr.status = KL_OK;
	perr.message[0] = '\0';
	/* Not a cancellation point (kl_lock(3)), whatever the provider
	 * waits in: see kl__cancel_off. */
	cs = kl__cancel_off();
	rc = p->ops.acquire(p->impl, lease->key, lease->key_len, cancel,
			    timeout_ms, l->ttl_ms, l->flags, &lease->handle,
			    &lease->fence, &perr);
	kl__cancel_restore(cs);
	if (rc != KL_OK) {
		rejected(l, lease->key, lease->key_len, rc, perr.message,
			 err);
		emit(l, KL_EV_REJECTED, lease->key, rc,
		     l->on_event != NULL ? ms_since(start) : 0, 0);
		return rc;
	}
	lease->granted_ns = l->on_event != NULL ? kl__now_ns() : 0;
	if (p->ops.watch != NULL && l->on_event != NULL)
		p->ops.watch(p->impl, lease->handle, lease_lost, lease);
	if (err != NULL) {
		err->status = KL_OK;
		err->message[0] = '\0';
	}
	emit(l, KL_EV_ACQUIRED, lease->key, KL_OK,
	     (lease->granted_ns - start) / 1000000, 0);
	return KL_OK;
}

/* Releases and raises RELEASED or RELEASE_FAILED; the lease's key is still
 * valid during the events. */
static void
release(struct kl_lease *lease)
{
	kl_lock *l = lease->lock;
	kl_provider *p = l->provider;
	int64_t held = l->on_event != NULL ? ms_since(lease->granted_ns) : 0;
	kl_error perr;
	int rc, cs;

	perr.status = KL_OK;
	perr.message[0] = '\0';
	cs = kl__cancel_off();
	rc = p->ops.release(p->impl, lease->handle, &perr);
	kl__cancel_restore(cs);
	if (rc == KL_OK)
		emit(l, KL_EV_RELEASED, lease->key, KL_OK, 0, held);
	else
		emit(l, KL_EV_RELEASE_FAILED, lease->key, rc, 0, held);
}


/*
 * Key sets.
 *
 * Every set call takes its distinct keys one by one in the canonical order
 * (bytewise: memcmp on the common length, then the shorter first), waiting
 * for each while it holds those before it.  Two set calls therefore never
 * wait for each other in a cycle: whichever holds the smaller of two keys
 * they share is never waiting for a key the other holds below it, the
 * argument of every lock ordering.  The order depends on the bytes alone,
 * so it is the same in every process and on every host that shares a
 * provider.  The set has one deadline, taken when the call starts, and one
 * cancel token; a failure on any key releases those already held, in
 * reverse order, so nothing stays held and no lease exists.
 */
static int
key_cmp(const void *a, const void *b)
{
	const struct kl_lease *x = a, *y = b;
	size_t m = x->key_len < y->key_len ? x->key_len : y->key_len;
	int c = memcmp(x->key, y->key, m);

	if (c != 0)
		return c;
	return (x->key_len > y->key_len) - (x->key_len < y->key_len);
}

/* The timeout left until deadline_ns, rounded up so that a key's wait never
 * ends before the set's deadline; 0 (try once) when it has passed. */
static int64_t
timeout_left(int64_t deadline_ns)
{
	int64_t left;

	if (deadline_ns == KL_NO_DEADLINE)
		return KL_FOREVER;
	left = deadline_ns - kl__now_ns();
	if (left <= 0)
		return 0;
	return left / 1000000 + (left % 1000000 != 0);
}

/* Releases held[taken-1] down to held[0] (the reverse of the order they
 * were taken in), raising RELEASED or RELEASE_FAILED for each. */
static void
release_set(struct lease_set *s)
{
	kl_lock *l = lease_lock((const kl_lease *)(void *)s);

	while (s->taken > 0) {
		struct kl_lease *h = &s->held[--s->taken];

		if (in_entry(l))
			kl__table_release(l->table, h->handle);
		else
			release(h);
	}
}

/* Takes key h->key for a set before deadline_ns (the first key with the
 * lock's own timeout): from the table itself when leases live in entries
 * (no hook, so no event), else through the provider with the time left. */
static int
acquire_member(kl_lock *l, kl_cancel *cancel, bool first, int64_t deadline_ns,
	       struct kl_lease *h, kl_error *err)
{
	struct kl__entry *e;
	int rc;

	h->lock = l;
	h->lent = 0;
	if (!in_entry(l))
		return acquire(l, cancel,
			       first ? l->timeout_ms : timeout_left(deadline_ns),
			       h, err);
	rc = kl__table_acquire(l->table, h->key, h->key_len, deadline_ns,
			       cancel, l->flags, &e, &h->fence);
	if (rc != KL_OK) {
		rejected(l, h->key, h->key_len, rc, "", err);
		return rc;
	}
	h->handle = e;
	return KL_OK;
}

/* Sorts held[0..n-1] into the canonical order: by insertion for the small
 * sets that are the rule (no call per comparison), else with qsort. */
static void
sort_keys(struct kl_lease *held, size_t n)
{
	if (n > 16) {
		qsort(held, n, sizeof *held, key_cmp);
		return;
	}
	for (size_t i = 1; i < n; i++) {
		struct kl_lease x = held[i];
		size_t j = i;

		for (; j > 0 && key_cmp(&held[j - 1], &x) > 0; j--)
			held[j] = held[j - 1];
		held[j] = x;
	}
}

/* Releases what set s holds and frees it when it was allocated. */
static void
end_set(struct lease_set *s)
{
	release_set(s);
	if (s->heap)
		kl__free(s);
}

/*
 * Validates keys[0..n-1], sorts and merges them into a struct lease_set
 * (in small, of small_size bytes, when it fits and copy is not set; else
 * allocated, with a copy of the keys when copy is set) and takes them all.
 * On any failure nothing is held, nothing stays allocated and *out is NULL.
 */
static int
acquire_set(kl_lock *l, const char *const *keys, size_t n, kl_cancel *cancel,
	    bool copy, void *small, size_t small_size, struct lease_set **out,
	    kl_error *err)
{
	struct lease_set *s;
	size_t i, m, bytes = 0, size;
	int64_t deadline;
	char *buf;
	int rc;

	*out = NULL;
	if (keys == NULL || n == 0) {
		kl__error_set(err, KL_EINVAL,
			      "a key set needs at least one key (keys %s, n %zu)",
			      keys == NULL ? "NULL" : "given", n);
		return KL_EINVAL;
	}
	if (l->key != NULL) {
		kl__error_set(err, KL_EINVAL,
			      "the lock has its own key; a key set needs a "
			      "lock without one");
		return KL_EINVAL;
	}
	for (i = 0; i < n; i++) {
		if (keys[i] == NULL) {
			kl__error_set(err, KL_EINVAL,
				      "key %zu of the set is NULL", i);
			return KL_EINVAL;
		}
		if (copy) {
			size_t len = strlen(keys[i]) + 1;

			if (bytes > SIZE_MAX - len)
				goto nomem;
			bytes += len;
		}
	}
	if (bytes > SIZE_MAX - sizeof *s ||
	    n > (SIZE_MAX - sizeof *s - bytes) / sizeof s->held[0])
		goto nomem;
	size = sizeof *s + n * sizeof s->held[0] + bytes;
	if (!copy && size <= small_size) {
		s = small;
		s->heap = false;
	} else if ((s = kl__malloc(size)) != NULL) {
		s->heap = true;
	} else {
		goto nomem;
	}
	buf = (char *)&s->held[n];
	for (i = 0; i < n; i++) {
		struct kl_lease *h = &s->held[i];

		h->key_len = strlen(keys[i]);
		if (copy) {
			memcpy(buf, keys[i], h->key_len + 1);
			h->key = buf;
			buf += h->key_len + 1;
		} else {
			h->key = keys[i];
		}
	}
	sort_keys(s->held, n);
	for (i = 1, m = 1; i < n; i++)
		if (key_cmp(&s->held[m - 1], &s->held[i]) != 0)
			s->held[m++] = s->held[i];
	s->word = (kl_lock *)((uintptr_t)l | LEASE_SET);
	s->n = m;
	s->taken = 0;
	deadline = kl__deadline(l->timeout_ms);
	for (i = 0; i < m; i++) {
		rc = acquire_member(l, cancel, i == 0, deadline, &s->held[i],
				    err);
		if (rc != KL_OK) {
			end_set(s);
			return rc;
		}
		s->taken = i + 1;
	}
	if (err != NULL) {
		err->status = KL_OK;
		err->message[0] = '\0';
	}
	*out = s;
	return KL_OK;
nomem:
	kl__error_set(err, KL_ENOMEM, "out of memory for the key set");
	emit(l, KL_EV_REJECTED, keys[0], KL_ENOMEM, 0, 0);
	return KL_ENOMEM;
}

/*
 * kl_lock_run_lease, and kl_lock_run through run_plain: the lease lent to
 * fn lives in the key's entry (in_entry) or on this stack, marked
 * LEASE_LENT either way (see lent_release).  Always inlined, so that
 * kl_lock_run pays no call to run on top of its call to fn.
 */
static inline __attribute__((always_inline)) int
run(kl_lock *l, const kl_call *call, bool many, const char *const *keys,
    size_t n, void *small, size_t small_size, kl_lease_fn fn, void *arg,
    int *fn_result, kl_error *err)
{
	struct kl_lease stack;
	struct lease_set *set = NULL;
	kl_lease *lease;
	bool misused;
	int rc, r;

	if (l == NULL || fn == NULL) {
		kl__error_set(err, KL_EINVAL, "no lock or no function given");
		return KL_EINVAL;
	}
	if (many) {
		/* call carries the set's cancel token only. */
		rc = acquire_set(l, keys, n, call != NULL ? call->cancel : NULL,
				 false, small, small_size, &set, err);
		if (rc != KL_OK)
			return rc;
		set->word = (kl_lock *)((uintptr_t)set->word | LEASE_LENT);
		lease = (kl_lease *)(void *)set;
	} else {
		rc = resolve_key(l, call, &stack.key, &stack.key_len, err);
		if (rc != KL_OK)
			return rc;
		if (in_entry(l)) {
			rc = acquire_in_entry(l, call, stack.key,
					      stack.key_len, LEASE_LENT,
					      &lease, err);
		} else {
			stack.lent = LEASE_LENT;
			lease = &stack;
			rc = acquire(l, call != NULL ? call->cancel : NULL,
				     l->timeout_ms, lease, err);
		}
		if (rc != KL_OK)
			return rc;
	}
	r = fn(lease, arg);
	if (fn_result != NULL)
		*fn_result = r;
	if (many) {
		misused = (lease_word(lease) & LEASE_RELEASED) != 0;
		end_set(set);
	} else if (in_entry(l)) {
		misused = (lease_word(lease) & LEASE_RELEASED) != 0;
		kl__table_release(l->table, lease_entry(lease));
	} else {
		misused = (stack.lent & LEASE_RELEASED) != 0;
		release(&stack);
	}
	if (misused) {
		kl__error_set(err, KL_EINVAL,
			      "the function released the lease it was lent; "
			      "the key was held until it returned");
		return KL_EINVAL;
	}
	return KL_OK;
}

struct plain_fn {
	int (*fn)(void *arg);
	void *arg;
};

static int
run_plain(kl_lease *lease, void *arg)
{
	const struct plain_fn *p = arg;

	(void)lease;
	return p->fn(p->arg);
}

int
kl_lock_run(kl_lock *l, const kl_call *call, int (*fn)(void *arg), void *arg,
	    int *fn_result, kl_error *err)
{
	struct plain_fn p = { .fn = fn, .arg = arg };

	return run(l, call, false, NULL, 0, NULL, 0,
		   fn != NULL ? run_plain : NULL, &p, fn_result, err);
}

int
kl_lock_run_lease(kl_lock *l, const kl_call *call, kl_lease_fn fn, void *arg,
		  int *fn_result, kl_error *err)
{
	return run(l, call, false, NULL, 0, NULL, 0, fn, arg, fn_result, err);
}

int
kl_lock_run_many(kl_lock *l, const char *const *keys, size_t n,
		 kl_cancel *cancel, kl_lease_fn fn, void *arg, int *fn_result,
		 kl_error *err)
{
	kl_call call = { .key = NULL, .cancel = cancel };
	union {
		struct lease_set s;
		char bytes[sizeof(struct lease_set) +
			   SET_ON_STACK * sizeof(struct kl_lease)];
	} small;

	return run(l, &call, true, keys, n, &small, sizeof small, fn, arg,
		   fn_result, err);
}

int
kl_lock_acquire_many(kl_lock *l, const char *const *keys, size_t n,
		     kl_cancel *cancel, kl_lease **out, kl_error *err)
{
	struct lease_set *s;
	int rc;

	if (out != NULL)
		*out = NULL;
	if (l == NULL || out == NULL) {
		kl__error_set(err, KL_EINVAL, "no lock or no lease pointer");
		return KL_EINVAL;
	}
	if ((rc = acquire_set(l, keys, n, cancel, true, NULL, 0, &s, err)) !=
	    KL_OK)
		return rc;
	*out = (kl_lease *)(void *)s;
	return KL_OK;
}

int
kl_lock_acquire(kl_lock *l, const kl_call *call, kl_lease **out,
		kl_error *err)
{
	struct kl_lease *lease;
	const char *key;
	size_t len;
	int rc;

	if (out != NULL)
		*out = NULL;
	if (l == NULL || out == NULL) {
		kl__error_set(err, KL_EINVAL, "no lock or no lease pointer");
		return KL_EINVAL;
	}
	if ((rc = resolve_key(l, call, &key, &len, err)) != KL_OK)
		return rc;
	if (in_entry(l))
		return acquire_in_entry(l, call, key, len, 0, out, err);
	if (l->shared_table != NULL)
		return acquire_shared(l, call, key, len, out, err);
	/* The call's key may not outlive the call: the lease keeps a copy,
	 * made first so that nothing can fail once the key is held. */
	if (len > SIZE_MAX - sizeof *lease - 1 ||
	    (lease = kl__malloc(sizeof *lease + len + 1)) == NULL) {
		kl__error_set(err, KL_ENOMEM, "out of memory for the lease");
		emit(l, KL_EV_REJECTED, key, KL_ENOMEM, 0, 0);
		return KL_ENOMEM;
	}
	/* The copy of the key follows the lease. */
	memcpy(lease + 1, key, len);
	((char *)(lease + 1))[len] = '\0';
	lease->key = (const char *)(lease + 1);
	lease->key_len = len;
	lease->lent = 0;
	if ((rc = acquire(l, call != NULL ? call->cancel : NULL,
			  l->timeout_ms, lease, err)) != KL_OK) {
		kl__free(lease);
		return rc;
	}
	*out = lease;
	return KL_OK;
}

/* A kl_lease_release of a lent lease: marks it (see LEASE_LENT) and
 * returns true; false for any other lease. */
static bool
lent_release(kl_lease *lease, const kl_lock *l)
{
	uintptr_t w;

	if (is_set(lease) || in_entry(l)) {
		if (((w = lease_word(lease)) & LEASE_LENT) == 0)
			return false;
		*(kl_lock **)(void *)lease = (kl_lock *)(w | LEASE_RELEASED);
		return true;
	}
	if ((lease->lent & LEASE_LENT) == 0)
		return false;
	lease->lent |= LEASE_RELEASED;
	return true;
}

void
kl_lease_release(kl_lease *lease)
{
	kl_lock *l;

	if (lease == NULL)
		return;
	/* The most common lease first: kl_lock_acquire's in an entry,
	 * which nothing marks. */
	if ((lease_word(lease) & LEASE_MARKS) == 0 &&
	    in_entry(l = lease_lock(lease))) {
		kl__table_release(l->table, lease_entry(lease));
		return;
	}
	if (in_table(lease) != 0) {
		if (is_solo(lease)) {
			kl__table_release_solo_slot(solo_entry(lease));
		} else {
			struct kl__holder *h = lease_holder(lease);
			kl_lock *lk = lease_lock(lease);

			kl__table_release_shared(lk->shared_table, h);
			kl__free(h);
		}
		return;
	}
	l = lease_lock(lease);
	if (lent_release(lease, l))
		return;
	if (is_set(lease)) {
		end_set(set_of(lease));
		return;
	}
	/* An entry's lease is unmarked unless lent: both went above. */
	release(lease);
	kl__free(lease);
}

uint64_t
kl_lease_fence(const kl_lease *lease)
{
	if (lease == NULL)
		return 0;
	if (is_solo(lease))
		return (uint64_t)(lease_word(lease) >> SOLO_FENCE_SHIFT);
	if (is_ring(lease))
		return lease_holder(lease)->fence;
	if (is_set(lease))
		return set_of(lease)->held[0].fence;
	if (in_entry(lease_lock(lease)))
		return kl__entry_fence(lease_entry(lease));
	return lease->fence;
}

bool
kl_lease_valid(const kl_lease *lease)
{
	kl_provider *p;

	if (lease == NULL)
		return false;
	if (in_table(lease))
		return true; /* a memory lease is never lost */
	p = lease_lock(lease)->provider;
	if (is_set(lease)) {
		const struct lease_set *s = set_of(lease);

		/* Valid while every key's lease is. */
		for (size_t i = 0; i < s->n && p->ops.valid != NULL; i++)
			if (!p->ops.valid(p->impl, s->held[i].handle))
				return false;
		return true;
	}
	if (in_entry(lease_lock(lease)))
		return true; /* a memory lease is never lost */
	return p->ops.valid == NULL || p->ops.valid(p->impl, lease->handle);
}

const char *
kl_lease_key(const kl_lease *lease)
{
	if (lease == NULL)
		return NULL;
	if (is_solo(lease))
		return kl__entry_key(solo_entry(lease));
	if (is_ring(lease))
		return kl__entry_key(lease_holder(lease)->entry);
	if (is_set(lease))
		return set_of(lease)->held[0].key;
	if (in_entry(lease_lock(lease)))
		return kl__entry_key(lease_entry(lease));
	return lease->key;
}

size_t
kl_lease_count(const kl_lease *lease)
{
	if (lease == NULL)
		return 0;
	return is_set(lease) ? set_of(lease)->n : 1;
}

const char *
kl_lease_key_at(const kl_lease *lease, size_t i)
{
	if (lease == NULL || i >= kl_lease_count(lease))
		return NULL;
	return is_set(lease) ? set_of(lease)->held[i].key : kl_lease_key(lease);
}

uint64_t
kl_lease_fence_at(const kl_lease *lease, size_t i)
{
	if (lease == NULL || i >= kl_lease_count(lease))
		return 0;
	return is_set(lease) ? set_of(lease)->held[i].fence
			     : kl_lease_fence(lease);
}
