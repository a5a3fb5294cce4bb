/* SPDX-License-Identifier: MIT */
/*
 * The Wrapper: named kl_mutex objects that persist until removed.
 *
 * Lock order: the registry lock, then a named mutex's own lock (through the
 * kl_mutex calls).  The registry lock is never held while waiting: a run
 * pins its name (users++) under the registry lock, drops it, then waits on
 * the mutex; kl_named_remove refuses a pinned, held or waited-on name, so a
 * mutex is never freed under a thread about to use it.
 */
#include "config.h"

#include <string.h>

#include "internal.h"

struct named {
	struct named *next;
	uint64_t hash;
	kl_mutex *m;
	size_t users; /* runs in progress */
	size_t len;
	char name[];
};

struct kl_registry {
	pthread_mutex_t lock;
	struct named **buckets;
	size_t nbuckets; /* 0 or a power of two */
	size_t count;
};

static kl_registry global = { .lock = PTHREAD_MUTEX_INITIALIZER };

int
kl_registry_new(kl_registry **out)
{
	kl_registry *r;

	if (out == NULL)
		return KL_EINVAL;
	*out = NULL;
	if ((r = kl__calloc(1, sizeof *r)) == NULL)
		return KL_ENOMEM;
	pthread_mutex_init(&r->lock, NULL);
	*out = r;
	return KL_OK;
}

void
kl_registry_free(kl_registry *r)
{
	if (r == NULL || r == &global)
		return;
	for (size_t i = 0; i < r->nbuckets; i++) {
		struct named *n = r->buckets[i], *next;

		for (; n != NULL; n = next) {
			next = n->next;
			kl_mutex_free(n->m);
			kl__free(n);
		}
	}
	kl__free(r->buckets);
	pthread_mutex_destroy(&r->lock);
	kl__free(r);
}

static struct named *
find(kl_registry *r, const char *name, size_t len, uint64_t h)
{
	if (r->nbuckets == 0)
		return NULL;
	for (struct named *n = r->buckets[h & (r->nbuckets - 1)]; n != NULL;
	     n = n->next)
		if (n->hash == h && n->len == len &&
		    memcmp(n->name, name, len) == 0)
			return n;
	return NULL;
}

/* Doubles the bucket array; on failure the old one stays in use. */
static void
grow(kl_registry *r)
{
	size_t n = r->nbuckets ? r->nbuckets * 2 : 16;
	struct named **nb = kl__calloc(n, sizeof *nb);

	if (nb == NULL)
		return;
	for (size_t i = 0; i < r->nbuckets; i++) {
		struct named *e = r->buckets[i], *next;

		for (; e != NULL; e = next) {
			next = e->next;
			e->next = nb[e->hash & (n - 1)];
			nb[e->hash & (n - 1)] = e;
		}
	}
	kl__free(r->buckets);
	r->buckets = nb;
	r->nbuckets = n;
}

/* Finds name or creates it with opts (NULL: the defaults).  Lock held. */
static int
get(kl_registry *r, const char *name, const kl_queue_opts *opts,
    struct named **out)
{
	size_t len = strlen(name);
	uint64_t h = kl__hash(name, len);
	struct named *n;
	int rc;

	if ((*out = find(r, name, len, h)) != NULL)
		return KL_OK;
	if (r->count >= r->nbuckets)
		grow(r);
	if (r->nbuckets == 0)
		return KL_ENOMEM;
	if ((n = kl__malloc(sizeof *n + len + 1)) == NULL)
		return KL_ENOMEM;
	if ((rc = kl_mutex_new(&n->m, opts)) != KL_OK) {
		kl__free(n);
		return rc;
	}
	n->hash = h;
	n->users = 0;
	n->len = len;
	memcpy(n->name, name, len + 1);
	n->next = r->buckets[h & (r->nbuckets - 1)];
	r->buckets[h & (r->nbuckets - 1)] = n;
	r->count++;
	*out = n;
	return KL_OK;
}

static struct named *
lookup(kl_registry *r, const char *name)
{
	size_t len = strlen(name);

	return find(r, name, len, kl__hash(name, len));
}

int
kl_named_run_cancel(kl_registry *r, const char *name, int64_t timeout_ms,
		    kl_cancel *c, int (*fn)(void *arg), void *arg,
		    int *fn_result)
{
	struct named *n;
	int rc;

	if (r == NULL)
		r = &global;
	if (name == NULL || fn == NULL ||
	    kl__check_timeout(timeout_ms) != KL_OK)
		return KL_EINVAL;
	pthread_mutex_lock(&r->lock);
	if ((rc = get(r, name, NULL, &n)) == KL_OK)
		n->users++;
	pthread_mutex_unlock(&r->lock);
	if (rc != KL_OK)
		return rc;
	rc = kl_mutex_run(n->m, timeout_ms, c, fn, arg, fn_result);
	pthread_mutex_lock(&r->lock);
	n->users--;
	pthread_mutex_unlock(&r->lock);
	return rc;
}

int
kl_named_run(kl_registry *r, const char *name, int64_t timeout_ms,
	     int (*fn)(void *arg), void *arg, int *fn_result)
{
	return kl_named_run_cancel(r, name, timeout_ms, NULL, fn, arg,
				   fn_result);
}

bool
kl_named_is_locked(kl_registry *r, const char *name)
{
	struct named *n;
	bool locked = false;

	if (r == NULL)
		r = &global;
	if (name == NULL)
		return false;
	pthread_mutex_lock(&r->lock);
	if ((n = lookup(r, name)) != NULL)
		locked = kl_mutex_is_locked(n->m);
	pthread_mutex_unlock(&r->lock);
	return locked;
}

bool
kl_named_exists(kl_registry *r, const char *name)
{
	bool found;

	if (r == NULL)
		r = &global;
	if (name == NULL)
		return false;
	pthread_mutex_lock(&r->lock);
	found = lookup(r, name) != NULL;
	pthread_mutex_unlock(&r->lock);
	return found;
}

size_t
kl_named_queue_size(kl_registry *r, const char *name)
{
	struct named *n;
	size_t size = 0;

	if (r == NULL)
		r = &global;
	if (name == NULL)
		return 0;
	pthread_mutex_lock(&r->lock);
	if ((n = lookup(r, name)) != NULL)
		size = kl_mutex_queue_size(n->m);
	pthread_mutex_unlock(&r->lock);
	return size;
}

int
kl_named_get_opts(kl_registry *r, const char *name, kl_queue_opts *out)
{
	struct named *n;
	int rc = KL_ENOTFOUND;

	if (r == NULL)
		r = &global;
	if (name == NULL || out == NULL)
		return KL_EINVAL;
	pthread_mutex_lock(&r->lock);
	if ((n = lookup(r, name)) != NULL)
		rc = kl_mutex_get_opts(n->m, out);
	pthread_mutex_unlock(&r->lock);
	return rc;
}

int
kl_named_set_opts(kl_registry *r, const char *name, const kl_queue_opts *in)
{
	struct named *n;
	int rc;

	if (r == NULL)
		r = &global;
	if (name == NULL)
		return KL_EINVAL;
	pthread_mutex_lock(&r->lock);
	/* NULL options only make sure the name exists (setOptions('foo')). */
	if ((rc = get(r, name, in, &n)) == KL_OK && in != NULL)
		rc = kl_mutex_set_opts(n->m, in);
	pthread_mutex_unlock(&r->lock);
	return rc;
}

int
kl_named_remove(kl_registry *r, const char *name)
{
	struct named **pp, *n;
	size_t len;
	uint64_t h;
	int rc = KL_ENOTFOUND;

	if (r == NULL)
		r = &global;
	if (name == NULL)
		return KL_EINVAL;
	len = strlen(name);
	h = kl__hash(name, len);
	pthread_mutex_lock(&r->lock);
	if ((n = find(r, name, len, h)) != NULL) {
		if (n->users != 0 || kl_mutex_is_locked(n->m) ||
		    kl_mutex_queue_size(n->m) != 0) {
			rc = KL_EINVAL;
		} else {
			pp = &r->buckets[h & (r->nbuckets - 1)];
			while (*pp != n)
				pp = &(*pp)->next;
			*pp = n->next;
			r->count--;
			kl_mutex_free(n->m);
			kl__free(n);
			rc = KL_OK;
		}
	}
	pthread_mutex_unlock(&r->lock);
	return rc;
}
