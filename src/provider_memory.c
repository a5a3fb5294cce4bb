/* SPDX-License-Identifier: MIT */
/*
 * The memory provider: keys of the process, in arrival order, over the key
 * table; a key is held by one holder, or by many with KL_SHARED (W3C Web
 * Locks' rule: see table_acquire.c).  Every lock without a provider shares
 * the process-wide one, so two locks on one key exclude each other.
 *
 * A lease is the key's entry (an exclusive holder, or a lone shared one
 * that took a free key without the lock: SOLO_LEASE), or a shared holder's
 * record, allocated here (SHARED_LEASE); the low bits of the handle tell
 * them apart (both are at least 8-byte aligned).  kl_lock_acquire of a
 * KL_SHARED lock without an event hook keeps its lease in the table
 * itself and calls the table directly (see lock.c, is_solo); the
 * leases here are those of kl_lock_run and of locks with a hook.
 */
#include "config.h"

#include <string.h>

#include "table.h"

#define SHARED_LEASE ((uintptr_t)1)
#define SOLO_LEASE ((uintptr_t)2)
#define LEASE_KIND (SHARED_LEASE | SOLO_LEASE)

/* rc; for a wait chosen as the victim of deadlock detection, with the
 * cycle it closed in err. */
static int
deadlock_why(int rc, kl_error *err)
{
	if (rc == KL_EDEADLK && err != NULL &&
	    kl__deadlock_take(err->message, sizeof err->message))
		err->status = rc;
	return rc;
}

static int
mem_acquire(void *impl, const char *key, size_t key_len, kl_cancel *cancel,
	    int64_t timeout_ms, int64_t ttl_ms, unsigned flags, void **lease,
	    uint64_t *fence, kl_error *err)
{
	struct kl__entry *e;
	struct kl__holder *h;
	int rc;

	(void)ttl_ms; /* a memory lock cannot outlive its process anyway */
	if (flags & KL_SHARED) {
		/* Without a token (one fired must fail even on a free key),
		 * a free key is taken as an exclusive one is, without the
		 * lock or an allocation. */
		if (cancel == NULL &&
		    kl__table_acquire_solo(impl, key, key_len, &e, fence)) {
			*lease = (void *)((uintptr_t)e | SOLO_LEASE);
			return KL_OK;
		}
		*lease = NULL;
		*fence = 0;
		if ((h = kl__malloc(sizeof *h)) == NULL)
			return KL_ENOMEM;
		rc = kl__table_acquire_shared(impl, key, key_len,
					      kl__deadline(timeout_ms), cancel,
					      flags, h, fence);
		if (rc != KL_OK) {
			kl__free(h);
			return deadlock_why(rc, err);
		}
		*lease = (void *)((uintptr_t)h | SHARED_LEASE);
		return KL_OK;
	}
	rc = kl__table_acquire(impl, key, key_len, kl__deadline(timeout_ms),
			       cancel, flags, &e, fence);
	*lease = e;
	return deadlock_why(rc, err);
}

static int
mem_release(void *impl, void *lease, kl_error *err)
{
	void *p = (void *)((uintptr_t)lease & ~LEASE_KIND);

	(void)err;
	switch ((uintptr_t)lease & LEASE_KIND) {
	case SHARED_LEASE:
		kl__table_release_shared(impl, p);
		kl__free(p);
		break;
	case SOLO_LEASE:
		kl__table_release_solo(impl, p);
		break;
	default:
		kl__table_release(impl, p);
		break;
	}
	return KL_OK;
}

static int
mem_status(void *impl, const char *key, size_t key_len, size_t *holders,
	   size_t *waiters, kl_error *err)
{
	(void)err;
	return kl__table_status(impl, key, key_len, holders, waiters);
}

static int
mem_snapshot(void *impl, kl_snapshot_fn fn, void *arg, kl_error *err)
{
	int rc = kl__table_snapshot(impl, fn, arg);

	if (rc != KL_OK)
		kl__error_set(err, rc, "out of memory for the snapshot");
	return rc;
}

static void
mem_destroy(void *impl)
{
	kl__table_free(impl);
}

static const kl_provider_ops memory_ops = {
	.struct_size = sizeof(kl_provider_ops),
	.name = "memory",
	.acquire = mem_acquire,
	.release = mem_release,
	.valid = NULL,
	.destroy = mem_destroy,
	.status = mem_status,
	.snapshot = mem_snapshot,
};

static kl_provider shared_provider;
static pthread_once_t shared_once = PTHREAD_ONCE_INIT;

static void
shared_init(void)
{
	shared_provider.ops = memory_ops;
	shared_provider.table = kl__table_shared();
	shared_provider.impl = shared_provider.table;
	shared_provider.shared = true;
}

kl_provider *
kl_memory_provider(void)
{
	pthread_once(&shared_once, shared_init);
	return &shared_provider;
}

int
kl_memory_provider_new(kl_provider **out)
{
	struct kl__table *t;
	int rc;

	if (out == NULL)
		return KL_EINVAL;
	*out = NULL;
	if ((rc = kl__table_new(&t)) != KL_OK)
		return rc;
	if ((rc = kl_provider_new(out, &memory_ops, t)) != KL_OK) {
		kl__table_free(t);
		return rc;
	}
	(*out)->table = t;
	return KL_OK;
}

size_t
kl_memory_provider_size(kl_provider *p)
{
	return p != NULL && p->table != NULL ? kl__table_size(p->table) : 0;
}

size_t
kl_memory_provider_queue_size(kl_provider *p, const char *key)
{
	if (p == NULL || p->table == NULL || key == NULL)
		return 0;
	return kl__table_queue_size(p->table, key, strlen(key));
}

#ifdef KL_TEST_HOOKS
int
kl__test_check_invariants(kl_provider *p)
{
	if (p == NULL || p->table == NULL) {
		kl__test_report("not a memory provider");
		return KL_EINVAL;
	}
	return kl__table_check(p->table);
}

void
kl__test_table_skew(kl_provider *p, long delta)
{
	if (p != NULL && p->table != NULL)
		kl__table_skew(p->table, delta);
}
#endif
