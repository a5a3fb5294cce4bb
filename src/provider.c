/* SPDX-License-Identifier: MIT */
/*
 * Providers: the ops table every provider implements, and user-written
 * ones through kl_provider_new.  The built-in providers are above this
 * layer; kl_provider_open, which knows them, is in provider_open.c.
 */
#include "config.h"

#include <string.h>

#include "internal.h"

#define MIN_OPS_SIZE                                                       \
	(offsetof(kl_provider_ops, destroy) + sizeof(void (*)(void)))

int
kl_provider_new(kl_provider **out, const kl_provider_ops *ops, void *impl)
{
	kl_provider *p;

	if (out == NULL)
		return KL_EINVAL;
	*out = NULL;
	/* A provider built against an older, shorter kl_provider_ops is
	 * accepted; members it does not know stay NULL. */
	if (ops == NULL || ops->struct_size < MIN_OPS_SIZE ||
	    ops->struct_size > sizeof *ops || ops->acquire == NULL ||
	    ops->release == NULL)
		return KL_EINVAL;
	if ((p = kl__calloc(1, sizeof *p)) == NULL)
		return KL_ENOMEM;
	memcpy(&p->ops, ops, ops->struct_size);
	p->impl = impl;
	*out = p;
	return KL_OK;
}

int
kl_provider_status(kl_provider *p, const char *key, size_t *holders,
		   size_t *waiters, kl_error *err)
{
	int rc, cs;

	if (holders != NULL)
		*holders = 0;
	if (waiters != NULL)
		*waiters = 0;
	if (p == NULL || key == NULL || holders == NULL || waiters == NULL) {
		kl__error_set(err, KL_EINVAL, "no provider, key or output");
		return KL_EINVAL;
	}
	if (p->ops.status == NULL) {
		kl__error_set(err, KL_EPROVIDER,
			      "the %s provider cannot tell a key's status",
			      p->ops.name != NULL ? p->ops.name : "user");
		return KL_EPROVIDER;
	}
	cs = kl__cancel_off();
	rc = p->ops.status(p->impl, key, strlen(key), holders, waiters, err);
	kl__cancel_restore(cs);
	return rc;
}

int
kl_provider_snapshot(kl_provider *p, kl_snapshot_fn fn, void *arg,
		     kl_error *err)
{
	int rc, cs;

	if (p == NULL || fn == NULL) {
		kl__error_set(err, KL_EINVAL, "no provider or callback");
		return KL_EINVAL;
	}
	if (p->ops.snapshot == NULL) {
		kl__error_set(err, KL_EPROVIDER,
			      "the %s provider cannot list its locks",
			      p->ops.name != NULL ? p->ops.name : "user");
		return KL_EPROVIDER;
	}
	if (err != NULL)
		err->status = KL_OK;
	cs = kl__cancel_off();
	rc = p->ops.snapshot(p->impl, fn, arg, err);
	kl__cancel_restore(cs);
	return rc;
}

void
kl_provider_free(kl_provider *p)
{
	int cs;

	if (p == NULL || p->shared)
		return;
	/* A cancel acted on in a destroy (a thread joined, a socket or
	 * lock file closed) would leave the provider half freed. */
	cs = kl__cancel_off();
	if (p->ops.destroy != NULL)
		p->ops.destroy(p->impl);
	kl__free(p);
	kl__cancel_restore(cs);
}
