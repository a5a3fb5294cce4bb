/* SPDX-License-Identifier: MIT */
/*
 * Tests of the providers through the public API: the shared memory provider
 * and private ones, kl_memory_provider_size, kl_provider_open by URI
 * (memory:, the separately built redis and postgresql libraries, local:,
 * garbage) and user providers made with kl_provider_new, driven through
 * kl_lock_run and kl_lock_acquire.
 *
 * Worker threads never call ck_assert*: they record statuses, and the test's
 * thread asserts after joining them.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* nftw, mkdtemp without config.h */
#endif

#include <check.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "internal.h" /* kl__test_alloc_bytes only */
#include "keylock.h"
#include "util.h"

static kl_lock *
lock_on(kl_provider *p, const char *key, int64_t timeout_ms)
{
	kl_lock_opts o = KL_LOCK_OPTS_INIT;
	kl_lock *l = NULL;

	o.provider = p;
	o.key = key;
	o.timeout_ms = timeout_ms;
	ck_assert_int_eq(kl_lock_new(&l, &o), KL_OK);
	ck_assert_ptr_nonnull(l);
	return l;
}

static int
fn_count(void *arg)
{
	atomic_fetch_add((atomic_int *)arg, 1);
	return 7;
}

/* Runs fn_count once under key on p, try-once; returns the status. */
static int
run_once(kl_provider *p, const char *key)
{
	kl_lock *l = lock_on(p, key, 0);
	atomic_int ran = 0;
	int res = 0, rc;

	rc = kl_lock_run(l, NULL, fn_count, &ran, &res, NULL);
	kl_lock_free(l);
	if (rc == KL_OK && (atomic_load(&ran) != 1 || res != 7))
		return 1; /* no KL_* value: fn did not run as it should */
	return rc;
}

/* ------------------------------------------------------------------ */
/* Keys of any size and any bytes (TESTPLAN T18)                       */

/* What the thread with a small stack saw, for the test thread to assert
 * (only it may call ck_assert). */
struct t18 {
	size_t len;
	int new_rc, acquire_rc, second_rc;
	bool key_same;
	size_t held, after;
	size_t copied; /* bytes the library allocated for lock and lease */
};

static const size_t t18_lens[] = {
	0, 1, 255, 4096, (size_t)1 << 20, (size_t)64 << 20
};
enum { T18_N = sizeof t18_lens / sizeof t18_lens[0] };

static void *
t18_thread(void *arg)
{
	struct t18 *r = arg;
	kl_provider *p = NULL;

	if (kl_memory_provider_new(&p) != KL_OK)
		return NULL;
	for (int i = 0; i < T18_N; i++, r++) {
		size_t len = t18_lens[i];
		char *key = malloc(len + 1);
		kl_lock_opts o = KL_LOCK_OPTS_INIT;
		kl_lock *l = NULL, *l2 = NULL;
		kl_lease *lease = NULL, *lease2 = NULL;

		r->len = len;
		if (key == NULL)
			break;
		/* Every byte but NUL, and invalid UTF-8 among them. */
		for (size_t j = 0; j < len; j++)
			key[j] = (char)(1 + j % 255);
		key[len] = '\0';
		o.provider = p;
		o.key = key;
		o.timeout_ms = 0;
		(void)kl__test_alloc_bytes();
		r->new_rc = kl_lock_new(&l, &o);
		if (r->new_rc == KL_OK)
			r->acquire_rc = kl_lock_acquire(l, NULL, &lease, NULL);
		r->copied = kl__test_alloc_bytes();
		if (r->new_rc == KL_OK && r->acquire_rc == KL_OK) {
			const char *k = kl_lease_key(lease);

			r->key_same = k != NULL && strlen(k) == len &&
				      memcmp(k, key, len) == 0;
			r->held = kl_memory_provider_size(p);
			if (kl_lock_new(&l2, &o) == KL_OK) {
				r->second_rc = kl_lock_acquire(l2, NULL,
							       &lease2, NULL);
				if (r->second_rc == KL_OK)
					kl_lease_release(lease2);
				kl_lock_free(l2);
			}
			kl_lease_release(lease);
			r->after = kl_memory_provider_size(p);
		}
		kl_lock_free(l);
		free(key);
	}
	kl_provider_free(p);
	return NULL;
}

START_TEST(test_t18_key_sizes_small_stack)
{
	struct t18 r[T18_N];
	pthread_attr_t attr;
	pthread_t t;

	memset(r, 0, sizeof r);
	ck_assert_int_eq(pthread_attr_init(&attr), 0);
	ck_assert_int_eq(pthread_attr_setstacksize(&attr, 64 * 1024), 0);
	ck_assert_int_eq(pthread_create(&t, &attr, t18_thread, r), 0);
	pthread_attr_destroy(&attr);
	ck_assert_int_eq(pthread_join(t, NULL), 0);
	for (int i = 0; i < T18_N; i++) {
		ck_assert_msg(r[i].len == t18_lens[i], "key %d not tried", i);
		ck_assert_int_eq(r[i].new_rc, KL_OK);
		ck_assert_int_eq(r[i].acquire_rc, KL_OK);
		ck_assert_msg(r[i].key_same, "lease key of %zu bytes differs",
			      r[i].len);
		ck_assert_uint_eq(r[i].held, 1);
		ck_assert_int_eq(r[i].second_rc, KL_ETIMEDOUT);
		ck_assert_uint_eq(r[i].after, 0);
		/* The lock's copy and the held key's: twice, never more. */
		ck_assert_msg(r[i].copied <= 2 * r[i].len + 4096,
			      "%zu-byte key: %zu bytes allocated", r[i].len,
			      r[i].copied);
	}
}
END_TEST

/* ------------------------------------------------------------------ */
/* The shared provider and private ones                                */

START_TEST(test_shared_is_one)
{
	kl_provider *p = kl_memory_provider();
	kl_provider *q = NULL;
	kl_error err;

	ck_assert_ptr_nonnull(p);
	ck_assert_ptr_eq(kl_memory_provider(), p);
	kl_provider_free(p); /* does nothing */
	ck_assert_ptr_eq(kl_memory_provider(), p);
	ck_assert_int_eq(run_once(p, "pm:shared:after-free"), KL_OK);

	memset(&err, 0, sizeof err);
	ck_assert_int_eq(kl_provider_open(&q, "memory:", &err), KL_OK);
	ck_assert_ptr_eq(q, p);
	kl_provider_free(q); /* does nothing either */
	ck_assert_int_eq(run_once(kl_memory_provider(), "pm:shared:open"),
			 KL_OK);
	ck_assert_uint_eq(kl_memory_provider_size(p), 0);
}
END_TEST

START_TEST(test_private_independent)
{
	kl_provider *a = NULL, *b = NULL, *s = kl_memory_provider();
	kl_lock *la, *la2, *lb, *ls;
	kl_lease *lease_a = NULL, *lease_b = NULL, *lease_s = NULL;
	size_t shared_before = kl_memory_provider_size(s);

	ck_assert_int_eq(kl_memory_provider_new(&a), KL_OK);
	ck_assert_int_eq(kl_memory_provider_new(&b), KL_OK);
	ck_assert_ptr_nonnull(a);
	ck_assert_ptr_nonnull(b);
	ck_assert_ptr_ne(a, b);
	ck_assert_ptr_ne(a, s);
	ck_assert_uint_eq(kl_memory_provider_size(a), 0);

	la = lock_on(a, "pm:same", 0);
	la2 = lock_on(a, "pm:same", 0);
	lb = lock_on(b, "pm:same", 0);
	ls = lock_on(NULL, "pm:same", 0);
	ck_assert_int_eq(kl_lock_acquire(la, NULL, &lease_a, NULL), KL_OK);
	/* The same key in another provider does not exclude. */
	ck_assert_int_eq(kl_lock_acquire(lb, NULL, &lease_b, NULL), KL_OK);
	ck_assert_int_eq(kl_lock_acquire(ls, NULL, &lease_s, NULL), KL_OK);
	/* In the same provider it does. */
	ck_assert_int_eq(run_once(a, "pm:same"), KL_ETIMEDOUT);
	ck_assert_uint_eq(kl_memory_provider_size(a), 1);
	ck_assert_uint_eq(kl_memory_provider_size(b), 1);
	ck_assert_uint_eq(kl_memory_provider_size(s), shared_before + 1);

	kl_lease_release(lease_a);
	ck_assert_uint_eq(kl_memory_provider_size(a), 0);
	ck_assert_uint_eq(kl_memory_provider_size(b), 1);
	ck_assert_int_eq(run_once(a, "pm:same"), KL_OK);
	kl_lease_release(lease_b);
	kl_lease_release(lease_s);
	ck_assert_uint_eq(kl_memory_provider_size(b), 0);
	ck_assert_uint_eq(kl_memory_provider_size(s), shared_before);

	kl_lock_free(la);
	kl_lock_free(la2);
	kl_lock_free(lb);
	kl_lock_free(ls);
	kl_provider_free(a);
	kl_provider_free(b);
}
END_TEST

struct holder {
	pthread_t th;
	kl_lock *l;
	int rc;
	atomic_bool done;
};

static bool
holder_done(void *arg)
{
	struct holder *h = arg;

	return atomic_load(&h->done);
}

static void *
holder_main(void *arg)
{
	struct holder *h = arg;
	kl_lease *lease = NULL;

	h->rc = kl_lock_acquire(h->l, NULL, &lease, NULL);
	if (h->rc == KL_OK)
		kl_lease_release(lease);
	atomic_store(&h->done, true);
	return NULL;
}

/* Keys held or waited for; a waiter on a held key adds none. */
START_TEST(test_size_counts_keys)
{
	kl_provider *p = NULL;
	kl_lock *l1, *l2;
	kl_lease *k1 = NULL, *k2 = NULL;
	struct holder h;

	ck_assert_int_eq(kl_memory_provider_new(&p), KL_OK);
	l1 = lock_on(p, "pm:k1", 30000);
	l2 = lock_on(p, "pm:k2", 30000);
	ck_assert_uint_eq(kl_memory_provider_size(p), 0);
	ck_assert_int_eq(kl_lock_acquire(l1, NULL, &k1, NULL), KL_OK);
	ck_assert_uint_eq(kl_memory_provider_size(p), 1);
	ck_assert_int_eq(kl_lock_acquire(l2, NULL, &k2, NULL), KL_OK);
	ck_assert_uint_eq(kl_memory_provider_size(p), 2);

	memset(&h, 0, sizeof h);
	h.l = l1;
	test_thread_start(&h.th, holder_main, &h);
	ck_assert_uint_eq(kl_memory_provider_size(p), 2);
	kl_lease_release(k1); /* the waiter (queued or not) gets it */
	test_poll(holder_done, &h, "the waiter to finish");
	test_thread_join(h.th);
	ck_assert_int_eq(h.rc, KL_OK);
	ck_assert_uint_eq(kl_memory_provider_size(p), 1);
	kl_lease_release(k2);
	ck_assert_uint_eq(kl_memory_provider_size(p), 0);

	/* Many distinct keys, then none. */
	for (int i = 0; i < 1000; i++) {
		char key[32];

		snprintf(key, sizeof key, "pm:many:%d", i);
		ck_assert_int_eq(run_once(p, key), KL_OK);
	}
	ck_assert_uint_eq(kl_memory_provider_size(p), 0);
	kl_lock_free(l1);
	kl_lock_free(l2);
	kl_provider_free(p);
}
END_TEST

/* ------------------------------------------------------------------ */
/* kl_provider_open                                                    */

static void
open_fails(const char *uri, int want)
{
	kl_provider *p = (kl_provider *)&p; /* not NULL: must be reset */
	kl_error err;

	memset(&err, 0, sizeof err);
	ck_assert_int_eq(kl_provider_open(&p, uri, &err), want);
	ck_assert_ptr_null(p);
	ck_assert_int_eq(err.status, want);
	ck_assert_msg(err.message[0] != '\0', "no message for \"%s\"",
		      uri != NULL ? uri : "(null)");
	ck_assert_ptr_nonnull(memchr(err.message, '\0', sizeof err.message));
	/* err may be NULL. */
	p = (kl_provider *)&p;
	ck_assert_int_eq(kl_provider_open(&p, uri, NULL), want);
	ck_assert_ptr_null(p);
}

/* True when the separately built provider library loads from the usual
 * library path (installed), in which case opening its scheme would get
 * further than "not installed". */
static bool
library_installed(const char *base)
{
	char name[64];
	void *h;

	snprintf(name, sizeof name, "%s.so.0", base);
	h = dlopen(name, RTLD_LAZY | RTLD_LOCAL);
	if (h != NULL)
		dlclose(h);
	return h != NULL;
}

/* Opening a scheme whose library cannot be loaded: KL_EPROVIDER, with a
 * message naming the library.  The build tree's copy (KEYLOCK_PROVIDER_DIR,
 * set by make check) is hidden for the call; an installed copy makes the
 * case untestable here, and its own suite covers it (no call is made then:
 * it would go to the network). */
static void
open_needs_library(const char *uri, const char *library)
{
	const char *env = getenv("KEYLOCK_PROVIDER_DIR");
	char *saved = env != NULL ? strdup(env) : NULL;
	kl_provider *p = (kl_provider *)&p;
	kl_error err;
	int rc;

	if (library_installed(library)) {
		free(saved);
		return;
	}
	unsetenv("KEYLOCK_PROVIDER_DIR");
	memset(&err, 0, sizeof err);
	rc = kl_provider_open(&p, uri, &err);
	if (saved != NULL) {
		setenv("KEYLOCK_PROVIDER_DIR", saved, 1);
		free(saved);
	}
	ck_assert_int_eq(rc, KL_EPROVIDER);
	ck_assert_ptr_null(p);
	ck_assert_int_eq(err.status, KL_EPROVIDER);
	ck_assert_msg(strstr(err.message, library) != NULL,
		      "\"%s\": message \"%s\" does not name %s", uri,
		      err.message, library);
}

START_TEST(test_open_redis_needs_library)
{
	open_needs_library("redis://localhost:6379/0", "libkeylock-redis");
}
END_TEST

START_TEST(test_open_postgresql_needs_library)
{
	open_needs_library("postgresql://x", "libkeylock-pg");
}
END_TEST

/* The local provider is not built yet: KL_EPROVIDER with a message.  Once
 * it is, a working provider is just as right. */
START_TEST(test_open_local)
{
	char dir[] = "/tmp/kl-check-provider.XXXXXX";
	char uri[sizeof dir + 8];
	kl_provider *p = NULL;
	kl_error err;
	int rc;

	ck_assert_ptr_nonnull(mkdtemp(dir));
	snprintf(uri, sizeof uri, "local:%s", dir);
	memset(&err, 0, sizeof err);
	rc = kl_provider_open(&p, uri, &err);
	if (rc == KL_OK) {
		ck_assert_ptr_nonnull(p);
		ck_assert_int_eq(run_once(p, "pm:local"), KL_OK);
		kl_provider_free(p);
	} else {
		ck_assert_int_eq(rc, KL_EPROVIDER);
		ck_assert_ptr_null(p);
		ck_assert_int_eq(err.status, KL_EPROVIDER);
		ck_assert(err.message[0] != '\0');
	}
	test_remove_tree(dir);
}
END_TEST

/* Schemes are case-insensitive (RFC 3986, 3.1). */
START_TEST(test_open_scheme_case)
{
	char dir[] = "/tmp/kl-check-provider.XXXXXX";
	char uri[sizeof dir + 8];
	kl_provider *p = NULL;
	kl_error err;

	memset(&err, 0, sizeof err);
	ck_assert_int_eq(kl_provider_open(&p, "MEMORY:", &err), KL_OK);
	ck_assert_ptr_eq(p, kl_memory_provider());
	ck_assert_int_eq(kl_provider_open(&p, "Memory://", &err), KL_OK);
	ck_assert_ptr_eq(p, kl_memory_provider());
	ck_assert_ptr_nonnull(mkdtemp(dir));
	snprintf(uri, sizeof uri, "LOCAL:%s", dir);
	ck_assert_msg(kl_provider_open(&p, uri, &err) == KL_OK, "%s: %s", uri,
		      err.message);
	ck_assert_int_eq(run_once(p, "pm:LOCAL"), KL_OK);
	kl_provider_free(p);
	test_remove_tree(dir);
	open_needs_library("REDIS://localhost:6379/0", "libkeylock-redis");
	open_needs_library("PostgreSQL://x", "libkeylock-pg");
}
END_TEST

START_TEST(test_open_garbage)
{
	open_fails("foo", KL_EINVAL);
	open_fails("", KL_EINVAL);
	open_fails(NULL, KL_EINVAL);
}
END_TEST

/* ------------------------------------------------------------------ */
/* User providers                                                      */

/* test_up of util.h, its fences from 42 on. */

START_TEST(test_user_provider_gets_arguments)
{
	kl_lock_opts o = KL_LOCK_OPTS_INIT;
	kl_call call = { .key = "call-key", .cancel = NULL };
	atomic_int ran = 0;
	kl_provider *p;
	kl_lease *lease = NULL;
	kl_lock *l;
	kl_cancel *c;
	struct test_up u;
	int res = 0;

	test_up_init(&u, 41);
	p = test_up_provider(&u, &test_up_ops);
	ck_assert_int_eq(kl_cancel_new(&c), KL_OK);
	ck_assert_uint_eq(kl_memory_provider_size(p), 0);

	o.provider = p;
	o.key = "user-key";
	o.timeout_ms = 1234;
	o.ttl_ms = 5678;
	o.flags = KL_ERRORCHECK;
	ck_assert_int_eq(kl_lock_new(&l, &o), KL_OK);
	call.cancel = c;
	ck_assert_int_eq(kl_lock_run(l, &call, fn_count, &ran, &res, NULL),
			 KL_OK);
	ck_assert_int_eq(atomic_load(&ran), 1);
	ck_assert_int_eq(res, 7);
	ck_assert_int_eq(u.acquires, 1);
	ck_assert_int_eq(u.releases, 1);
	ck_assert_str_eq(u.key, "user-key");
	ck_assert_uint_eq(u.key_len, strlen("user-key"));
	/* The whole budget, or what is left of it a moment later. */
	ck_assert_int_le(u.timeout_ms, 1234);
	ck_assert_int_gt(u.timeout_ms, 234);
	ck_assert_int_eq(u.ttl_ms, 5678);
	ck_assert_uint_eq(u.flags & KL_ERRORCHECK, KL_ERRORCHECK);
	ck_assert_ptr_eq(u.released_lease, &u.lease_cookie);
	/* The call's token reaches the provider (as is, or wrapped). */
	ck_assert_ptr_nonnull(u.cancel);

	/* A lease: fence, validity and key come from the provider. */
	ck_assert_int_eq(kl_lock_acquire(l, NULL, &lease, NULL), KL_OK);
	ck_assert_uint_eq(kl_lease_fence(lease), 43);
	ck_assert(kl_lease_valid(lease));
	test_up_set_valid(&u, false);
	ck_assert(!kl_lease_valid(lease));
	ck_assert_str_eq(kl_lease_key(lease), "user-key");
	kl_lease_release(lease);
	ck_assert_int_eq(u.releases, 2);
	kl_lock_free(l);

	/* No lock key: the call's; timeout 0 and KL_FOREVER pass as they
	 * are; ttl 0 is the provider's default. */
	o.key = NULL;
	o.timeout_ms = 0;
	o.ttl_ms = 0;
	o.flags = 0;
	ck_assert_int_eq(kl_lock_new(&l, &o), KL_OK);
	call.cancel = NULL;
	ck_assert_int_eq(kl_lock_run(l, &call, fn_count, &ran, NULL, NULL),
			 KL_OK);
	ck_assert_str_eq(u.key, "call-key");
	ck_assert_int_eq(u.timeout_ms, 0);
	ck_assert_int_eq(u.ttl_ms, 0);
	ck_assert_uint_eq(u.flags & KL_ERRORCHECK, 0);
	kl_lock_free(l);
	o.timeout_ms = KL_FOREVER;
	ck_assert_int_eq(kl_lock_new(&l, &o), KL_OK);
	ck_assert_int_eq(kl_lock_run(l, &call, fn_count, &ran, NULL, NULL),
			 KL_OK);
	ck_assert_int_eq(u.timeout_ms, KL_FOREVER);
	ck_assert_int_eq(atomic_load(&ran), 3);
	kl_lock_free(l);

	/* Not a memory provider. */
	ck_assert_uint_eq(kl_memory_provider_size(p), 0);
	ck_assert_int_eq(u.destroys, 0);
	kl_provider_free(p);
	ck_assert_int_eq(u.destroys, 1);
	kl_cancel_free(c);
	test_up_fini(&u);
}
END_TEST

/* Optional members left NULL: valid is then always true, and free has
 * nothing to destroy. */
START_TEST(test_user_provider_optional_members)
{
	kl_provider_ops ops = test_up_ops;
	kl_provider *p;
	kl_lease *lease = NULL;
	kl_lock *l;
	struct test_up u;

	test_up_init(&u, 41);
	ops.valid = NULL;
	ops.destroy = NULL;
	ops.name = NULL;
	p = test_up_provider(&u, &ops);
	ops.acquire = NULL; /* ops was copied */
	test_up_set_valid(&u, false);
	l = lock_on(p, "opt", KL_FOREVER);
	ck_assert_int_eq(kl_lock_acquire(l, NULL, &lease, NULL), KL_OK);
	ck_assert(kl_lease_valid(lease));
	kl_lease_release(lease);
	ck_assert_int_eq(u.acquires, 1);
	ck_assert_int_eq(u.releases, 1);
	kl_lock_free(l);
	kl_provider_free(p);
	ck_assert_int_eq(u.destroys, 0);
	test_up_fini(&u);
}
END_TEST

static void
new_fails(const kl_provider_ops *ops)
{
	kl_provider *p = (kl_provider *)&p;
	struct test_up u;

	test_up_init(&u, 41);
	ck_assert_int_eq(kl_provider_new(&p, ops, &u), KL_EINVAL);
	ck_assert_ptr_null(p);
	test_up_fini(&u);
}

START_TEST(test_user_provider_bad_ops)
{
	kl_provider_ops ops;

	ops = test_up_ops;
	ops.acquire = NULL;
	new_fails(&ops);
	ops = test_up_ops;
	ops.release = NULL;
	new_fails(&ops);
	ops = test_up_ops;
	ops.struct_size = 0;
	new_fails(&ops);
	ops = test_up_ops;
	ops.struct_size = 1;
	new_fails(&ops);
	new_fails(NULL);
}
END_TEST


/* A user provider's snapshot member, listing two fixed entries. */
static int
up_snapshot(void *impl, kl_snapshot_fn fn, void *arg, kl_error *err)
{
	kl_lock_info info = { .key = "k", .key_len = 1, .fence = 9,
			      .elapsed_ms = -1 };

	(void)err;
	*(int *)impl += 1;
	if (fn(&info, arg) != 0)
		return KL_OK;
	info.waiting = true;
	info.shared = true;
	info.fence = 0;
	(void)fn(&info, arg);
	return KL_OK;
}

struct seen {
	int n;
	int stop_after;
	bool second_waits_shared;
};

static int
count_entry(const kl_lock_info *info, void *arg)
{
	struct seen *s = arg;

	s->n++;
	if (s->n == 2)
		s->second_waits_shared = info->waiting && info->shared;
	return s->n == s->stop_after;
}

/* kl_provider_snapshot passes on to the member and its callback; without
 * the member (or from a provider built before it existed) it says the
 * provider cannot list; KL_SHARED reaches acquire. */
START_TEST(test_user_provider_snapshot)
{
	kl_provider_ops ops = test_up_ops;
	kl_lock_opts o = KL_LOCK_OPTS_INIT;
	struct seen seen = { 0, 0, false };
	kl_provider *p;
	kl_error err;
	kl_lock *l;
	struct test_up u;
	atomic_int ran = 0;
	int calls = 0;

	test_up_init(&u, 41);
	p = test_up_provider(&u, &ops);
	ck_assert_int_eq(kl_provider_snapshot(p, count_entry, &seen, &err),
			 KL_EPROVIDER);
	ck_assert_int_eq(err.status, KL_EPROVIDER);
	ck_assert_ptr_nonnull(strstr(err.message, "cannot list"));
	ck_assert_int_eq(kl_provider_snapshot(p, NULL, NULL, &err), KL_EINVAL);
	ck_assert_int_eq(kl_provider_snapshot(NULL, count_entry, &seen, NULL),
			 KL_EINVAL);
	o.provider = p;
	o.key = "s";
	o.flags = KL_SHARED;
	ck_assert_int_eq(kl_lock_new(&l, &o), KL_OK);
	ck_assert_int_eq(kl_lock_run(l, NULL, fn_count, &ran, NULL, NULL),
			 KL_OK);
	ck_assert_int_eq(atomic_load(&ran), 1);
	ck_assert_uint_eq(u.flags & KL_SHARED, KL_SHARED);
	kl_lock_free(l);
	kl_provider_free(p);
	test_up_fini(&u);

	/* impl is now a counter, not a test_up. */
	ops.destroy = NULL;
	ops.snapshot = up_snapshot;
	ck_assert_int_eq(kl_provider_new(&p, &ops, &calls), KL_OK);
	ck_assert_int_eq(kl_provider_snapshot(p, count_entry, &seen, &err),
			 KL_OK);
	ck_assert_int_eq(err.status, KL_OK);
	ck_assert_int_eq(calls, 1);
	ck_assert_int_eq(seen.n, 2);
	ck_assert(seen.second_waits_shared);
	seen.n = 0;
	seen.stop_after = 1;
	ck_assert_int_eq(kl_provider_snapshot(p, count_entry, &seen, NULL),
			 KL_OK);
	ck_assert_int_eq(seen.n, 1);
	kl_provider_free(p);

	/* Built against the kl_provider_ops before snapshot. */
	ops.struct_size = offsetof(kl_provider_ops, snapshot);
	ck_assert_int_eq(kl_provider_new(&p, &ops, &calls), KL_OK);
	ck_assert_int_eq(kl_provider_snapshot(p, count_entry, &seen, NULL),
			 KL_EPROVIDER);
	ck_assert_int_eq(calls, 2); /* not called */
	kl_provider_free(p);
}
END_TEST

/* ------------------------------------------------------------------ */

static Suite *
provider_memory_suite(void)
{
	Suite *s = suite_create("provider_memory");
	TCase *tc;

	tc = tcase_create("memory");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_shared_is_one);
	tcase_add_test(tc, test_private_independent);
	tcase_add_test(tc, test_size_counts_keys);
	tcase_add_test(tc, test_t18_key_sizes_small_stack);
	suite_add_tcase(s, tc);

	tc = tcase_create("open");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_open_redis_needs_library);
	tcase_add_test(tc, test_open_postgresql_needs_library);
	tcase_add_test(tc, test_open_local);
	tcase_add_test(tc, test_open_scheme_case);
	tcase_add_test(tc, test_open_garbage);
	suite_add_tcase(s, tc);

	tc = tcase_create("user");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_user_provider_gets_arguments);
	tcase_add_test(tc, test_user_provider_optional_members);
	tcase_add_test(tc, test_user_provider_bad_ops);
	tcase_add_test(tc, test_user_provider_snapshot);
	suite_add_tcase(s, tc);

	return s;
}

int
main(void)
{
	return test_run_suite(provider_memory_suite());
}
