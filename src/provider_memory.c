/* SPDX-License-Identifier: MIT */
/*
 * The memory provider: one holder per key within the process, in arrival
 * order, over the key table.  Every lock without a provider shares the
 * process-wide one, so two locks on one key exclude each other.
 */
#include "config.h"

#include <string.h>

#include "table.h"

static int
mem_acquire(void *impl, const char *key, size_t key_len, kl_cancel *cancel,
	    int64_t timeout_ms, int64_t ttl_ms, unsigned flags, void **lease,
	    uint64_t *fence, kl_error *err)
{
	struct kl__entry *e;
	int rc;

	(void)ttl_ms; /* a memory lock cannot outlive its process anyway */
	rc = kl__table_acquire(impl, key, key_len, kl__deadline(timeout_ms),
			       cancel, flags, &e, fence);
	*lease = e;
	/* The cycle that made this wait the victim of deadlock detection. */
	if (rc == KL_EDEADLK && err != NULL &&
	    kl__deadlock_take(err->message, sizeof err->message))
		err->status = rc;
	return rc;
}

static int
mem_release(void *impl, void *lease, kl_error *err)
{
	(void)err;
	kl__table_release(impl, lease);
	return KL_OK;
}

static int
mem_status(void *impl, const char *key, size_t key_len, size_t *holders,
	   size_t *waiters, kl_error *err)
{
	(void)err;
	return kl__table_status(impl, key, key_len, holders, waiters);
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
