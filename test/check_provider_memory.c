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
#include <sys/syscall.h>
#include <unistd.h>

#include "annotate.h" /* the req gates, for the helgrind stage */
#include "internal.h" /* kl__test_alloc_bytes, kl__test_check_invariants */
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
/* KL_SHARED on the memory provider (W3C Web Locks' grantable rule)    */

/* A thread that takes key on p in the mode of its lock, records the
 * outcome, its fence, its gettid() and the order of its grant, holds the
 * key until told, then releases it. */
struct req {
	pthread_t th;
	kl_lock *l;
	kl_cancel *cancel;
	const char *key;
	int rc;
	uint64_t fence;
	long seq;      /* grant order, from req_seq */
	int64_t tid;   /* gettid() */
	atomic_int st; /* 0 started, 1 holds, 2 finished */
	atomic_bool go; /* release now */
};

static atomic_long req_seq;

static void *
req_main(void *arg)
{
	struct req *r = arg;
	kl_call call = { .key = r->key, .cancel = r->cancel };
	kl_lease *lease = NULL;

	r->tid = (int64_t)syscall(SYS_gettid);
	r->rc = kl_lock_acquire(r->l, &call, &lease, NULL);
	if (r->rc == KL_OK) {
		r->fence = kl_lease_fence(lease);
		r->seq = atomic_fetch_add(&req_seq, 1);
		/* Helgrind does not see C11 atomics: the fields written
		 * above are read by the test thread once st says so. */
		KL_ANNOTATE_HAPPENS_BEFORE(&r->st);
		atomic_store(&r->st, 1);
		while (!atomic_load(&r->go))
			test_sleep_ms(1);
		kl_lease_release(lease);
	}
	KL_ANNOTATE_HAPPENS_BEFORE(&r->st);
	atomic_store(&r->st, 2);
	return NULL;
}

static kl_lock *
mode_lock(kl_provider *p, unsigned flags, int64_t timeout_ms)
{
	kl_lock_opts o = KL_LOCK_OPTS_INIT;
	kl_lock *l = NULL;

	o.provider = p;
	o.timeout_ms = timeout_ms;
	o.flags = flags;
	ck_assert_int_eq(kl_lock_new(&l, &o), KL_OK);
	return l;
}

static void
req_start(struct req *r, kl_lock *l, const char *key, kl_cancel *c)
{
	memset(r, 0, sizeof *r);
	r->l = l;
	r->key = key;
	r->cancel = c;
	r->seq = -1;
	test_thread_start(&r->th, req_main, r);
}

static bool
req_holds(void *arg)
{
	struct req *r = arg;

	if (atomic_load(&r->st) != 1)
		return false;
	KL_ANNOTATE_HAPPENS_AFTER(&r->st);
	return true;
}

static bool
req_finished(void *arg)
{
	struct req *r = arg;

	if (atomic_load(&r->st) != 2)
		return false;
	KL_ANNOTATE_HAPPENS_AFTER(&r->st);
	return true;
}

static void
req_end(struct req *r)
{
	atomic_store(&r->go, true);
	test_poll(req_finished, r, "a request to finish");
	test_thread_join(r->th);
}

struct qwait {
	kl_provider *p;
	const char *key;
	size_t holders, waiters;
};

static bool
status_is(void *arg)
{
	struct qwait *q = arg;
	size_t h = 0, w = 0;

	if (kl_provider_status(q->p, q->key, &h, &w, NULL) != KL_OK)
		return false;
	return h == q->holders && w == q->waiters;
}

/* Polls until key on p has exactly holders and waiters. */
static void
wait_status(kl_provider *p, const char *key, size_t holders, size_t waiters)
{
	struct qwait q = { p, key, holders, waiters };

	test_poll(status_is, &q, "the key's holders and waiters");
}

static void
assert_status(kl_provider *p, const char *key, size_t holders,
	      size_t waiters)
{
	size_t h = 99, w = 99;

	ck_assert_int_eq(kl_provider_status(p, key, &h, &w, NULL), KL_OK);
	ck_assert_uint_eq(h, holders);
	ck_assert_uint_eq(w, waiters);
}

struct qdone {
	struct qwait q;
	struct req *r;
};

static bool
queued_or_done(void *arg)
{
	struct qdone *d = arg;

	return req_finished(d->r) || status_is(&d->q);
}

/* Polls until key on p has one holder and waiters waiting, or r is
 * done. */
static void
wait_queued_or_done(kl_provider *p, const char *key, size_t waiters,
		    struct req *r)
{
	struct qdone d = { { p, key, 1, waiters }, r };

	test_poll(queued_or_done, &d, "the readers to queue");
}

/* Three threads hold one key shared at once, each with a fence of its
 * own; the provider counts them all. */
START_TEST(test_shared_holders_together)
{
	kl_provider *p = NULL;
	kl_lock *sh;
	struct req r[3];

	ck_assert_int_eq(kl_memory_provider_new(&p), KL_OK);
	sh = mode_lock(p, KL_SHARED, KL_FOREVER);
	for (int i = 0; i < 3; i++)
		req_start(&r[i], sh, "sh:k", NULL);
	for (int i = 0; i < 3; i++)
		test_poll(req_holds, &r[i], "every reader to hold the key");
	assert_status(p, "sh:k", 3, 0);
	ck_assert_uint_eq(kl_memory_provider_size(p), 1);
	ck_assert_int_eq(kl__test_check_invariants(p), KL_OK);
	ck_assert_uint_ne(r[0].fence, r[1].fence);
	ck_assert_uint_ne(r[1].fence, r[2].fence);
	ck_assert_uint_ne(r[0].fence, r[2].fence);
	for (int i = 0; i < 3; i++)
		req_end(&r[i]);
	for (int i = 0; i < 3; i++)
		ck_assert_int_eq(r[i].rc, KL_OK);
	assert_status(p, "sh:k", 0, 0);
	ck_assert_uint_eq(kl_memory_provider_size(p), 0);
	kl_lock_free(sh);
	kl_provider_free(p);
}
END_TEST

/* An exclusive request waits for every shared holder, and gets a fence
 * above theirs; a long (chained) key and a short (slot) one alike. */
START_TEST(test_shared_exclusive_waits_for_all)
{
	static const char *const keys[] = {
		"sh:x", "sh:a key longer than any slot holds"
	};
	const char *key = keys[_i];
	kl_provider *p = NULL;
	kl_lock *sh, *ex;
	kl_call call = { .key = key, .cancel = NULL };
	kl_lease *a = NULL, *b = NULL;
	struct req x;

	ck_assert_int_eq(kl_memory_provider_new(&p), KL_OK);
	sh = mode_lock(p, KL_SHARED, 0);
	ex = mode_lock(p, 0, KL_FOREVER);
	ck_assert_int_eq(kl_lock_acquire(sh, &call, &a, NULL), KL_OK);
	ck_assert_int_eq(kl_lock_acquire(sh, &call, &b, NULL), KL_OK);
	ck_assert_uint_gt(kl_lease_fence(b), kl_lease_fence(a));
	req_start(&x, ex, key, NULL);
	wait_status(p, key, 2, 1);
	kl_lease_release(a);
	assert_status(p, key, 1, 1);
	ck_assert_int_eq(atomic_load(&x.st), 0);
	ck_assert_int_eq(kl__test_check_invariants(p), KL_OK);
	kl_lease_release(b);
	test_poll(req_holds, &x, "the writer to get the key");
	assert_status(p, key, 1, 0);
	req_end(&x);
	ck_assert_int_eq(x.rc, KL_OK);
	ck_assert_uint_eq(x.fence, 3);
	ck_assert_uint_eq(kl_memory_provider_size(p), 0);
	kl_lock_free(sh);
	kl_lock_free(ex);
	kl_provider_free(p);
}
END_TEST

/* Readers hold the key and a writer waits: a new reader queues behind the
 * writer (no barging), a try-once reader fails; when the readers leave,
 * the writer gets the key alone; when it leaves, the readers behind it
 * get it together, with fences above the writer's. */
START_TEST(test_shared_no_barging_and_runs)
{
	kl_provider *p = NULL;
	kl_lock *sh, *sh0, *ex;
	kl_call call = { .key = "sh:q", .cancel = NULL };
	kl_lease *a = NULL, *t = NULL;
	struct req x, s1, s2;
	uint64_t fa;

	ck_assert_int_eq(kl_memory_provider_new(&p), KL_OK);
	sh = mode_lock(p, KL_SHARED, KL_FOREVER);
	sh0 = mode_lock(p, KL_SHARED, 0);
	ex = mode_lock(p, 0, KL_FOREVER);
	ck_assert_int_eq(kl_lock_acquire(sh0, &call, &a, NULL), KL_OK);
	req_start(&x, ex, "sh:q", NULL);
	wait_status(p, "sh:q", 1, 1);
	req_start(&s1, sh, "sh:q", NULL);
	wait_status(p, "sh:q", 1, 2);
	req_start(&s2, sh, "sh:q", NULL);
	wait_status(p, "sh:q", 1, 3);
	ck_assert_int_eq(atomic_load(&s1.st), 0);
	ck_assert_int_eq(atomic_load(&s2.st), 0);
	/* Try once: not grantable, a writer waits first. */
	ck_assert_int_eq(kl_lock_acquire(sh0, &call, &t, NULL),
			 KL_ETIMEDOUT);
	ck_assert_ptr_null(t);
	ck_assert_int_eq(kl__test_check_invariants(p), KL_OK);
	fa = kl_lease_fence(a);
	kl_lease_release(a);
	test_poll(req_holds, &x, "the writer to get the key");
	assert_status(p, "sh:q", 1, 2);
	ck_assert_int_eq(atomic_load(&s1.st), 0);
	req_end(&x);
	test_poll(req_holds, &s1, "the first reader to get the key");
	test_poll(req_holds, &s2, "the second reader to get the key");
	assert_status(p, "sh:q", 2, 0);
	ck_assert_uint_gt(x.fence, fa);
	ck_assert_uint_gt(s1.fence, x.fence);
	ck_assert_uint_gt(s2.fence, s1.fence);
	/* Granted together: their fences say in which order, not when each
	 * thread ran. */
	ck_assert_int_lt(x.seq, s1.seq);
	ck_assert_int_lt(x.seq, s2.seq);
	req_end(&s1);
	req_end(&s2);
	ck_assert_int_eq(x.rc, KL_OK);
	ck_assert_int_eq(s1.rc, KL_OK);
	ck_assert_int_eq(s2.rc, KL_OK);
	ck_assert_uint_eq(kl_memory_provider_size(p), 0);
	kl_lock_free(sh);
	kl_lock_free(sh0);
	kl_lock_free(ex);
	kl_provider_free(p);
}
END_TEST

/* A reader holds the key; a writer queues, then readers behind it.  When
 * the writer's wait ends (_i 0: its timeout, 1: its cancel token), the
 * readers behind it get the key at once, beside the first reader. */
START_TEST(test_shared_writer_leaves)
{
	kl_provider *p = NULL;
	kl_lock *sh, *ex;
	kl_call call = { .key = "sh:t", .cancel = NULL };
	kl_cancel *c = NULL;
	kl_lease *a = NULL;
	struct req x, s1, s2;

	ck_assert_int_eq(kl_memory_provider_new(&p), KL_OK);
	sh = mode_lock(p, KL_SHARED, KL_FOREVER);
	ex = mode_lock(p, 0, _i == 0 ? 2000 : KL_FOREVER);
	if (_i == 1)
		ck_assert_int_eq(kl_cancel_new(&c), KL_OK);
	ck_assert_int_eq(kl_lock_acquire(sh, &call, &a, NULL), KL_OK);
	req_start(&x, ex, "sh:t", c);
	wait_status(p, "sh:t", 1, 1);
	/* The readers queue behind the writer, unless a loaded machine let
	 * its 2 s pass first (then they get the key at once: the outcome
	 * checked below is the same). */
	req_start(&s1, sh, "sh:t", NULL);
	wait_queued_or_done(p, "sh:t", 2, &x);
	req_start(&s2, sh, "sh:t", NULL);
	wait_queued_or_done(p, "sh:t", 3, &x);
	if (c != NULL)
		kl_cancel_fire(c);
	test_poll(req_finished, &x, "the writer's wait to end");
	test_poll(req_holds, &s1, "the first reader behind to get the key");
	test_poll(req_holds, &s2, "the second reader behind to get it");
	ck_assert_int_eq(x.rc, _i == 0 ? KL_ETIMEDOUT : KL_ECANCELED);
	assert_status(p, "sh:t", 3, 0);
	ck_assert_int_eq(kl__test_check_invariants(p), KL_OK);
	ck_assert_uint_gt(s1.fence, kl_lease_fence(a));
	ck_assert_uint_gt(s2.fence, s1.fence);
	kl_lease_release(a);
	req_end(&x);
	req_end(&s1);
	req_end(&s2);
	ck_assert_uint_eq(kl_memory_provider_size(p), 0);
	kl_cancel_free(c);
	kl_lock_free(sh);
	kl_lock_free(ex);
	kl_provider_free(p);
}
END_TEST

/* Timeout 0 is Web Locks' ifAvailable, in both modes; fences grow over
 * mixed grants. */
START_TEST(test_shared_try_once_and_fences)
{
	kl_provider *p = NULL;
	kl_lock *sh, *ex;
	kl_call call = { .key = "sh:f", .cancel = NULL };
	kl_lease *a = NULL, *b = NULL, *t = NULL;
	uint64_t last = 0;

	ck_assert_int_eq(kl_memory_provider_new(&p), KL_OK);
	sh = mode_lock(p, KL_SHARED, 0);
	ex = mode_lock(p, 0, 0);
	for (int round = 0; round < 3; round++) {
		/* Free: either mode gets it. */
		ck_assert_int_eq(kl_lock_acquire(ex, &call, &a, NULL), KL_OK);
		ck_assert_uint_gt(kl_lease_fence(a), last);
		last = kl_lease_fence(a);
		/* Held exclusively: neither mode does. */
		ck_assert_int_eq(kl_lock_acquire(sh, &call, &t, NULL),
				 KL_ETIMEDOUT);
		ck_assert_int_eq(kl_lock_acquire(ex, &call, &t, NULL),
				 KL_ETIMEDOUT);
		kl_lease_release(a);
		ck_assert_int_eq(kl_lock_acquire(sh, &call, &a, NULL), KL_OK);
		ck_assert_uint_gt(kl_lease_fence(a), last);
		last = kl_lease_fence(a);
		/* Held shared, nobody waiting: shared yes, exclusive no. */
		ck_assert_int_eq(kl_lock_acquire(sh, &call, &b, NULL), KL_OK);
		ck_assert_uint_gt(kl_lease_fence(b), last);
		last = kl_lease_fence(b);
		ck_assert_int_eq(kl_lock_acquire(ex, &call, &t, NULL),
				 KL_ETIMEDOUT);
		ck_assert_ptr_null(t);
		assert_status(p, "sh:f", 2, 0);
		kl_lease_release(a);
		assert_status(p, "sh:f", 1, 0);
		kl_lease_release(b);
		assert_status(p, "sh:f", 0, 0);
	}
	ck_assert_uint_eq(kl_memory_provider_size(p), 0);
	ck_assert_int_eq(kl__test_check_invariants(p), KL_OK);
	kl_lock_free(sh);
	kl_lock_free(ex);
	kl_provider_free(p);
}
END_TEST

/* KL_ERRORCHECK: a thread asking again for a key it holds, in either mode,
 * gets KL_EDEADLK, also when other threads hold it shared beside it. */
START_TEST(test_shared_errorcheck)
{
	kl_provider *p = NULL;
	kl_lock *sh, *ex, *shc, *exc;
	kl_call call = { .key = "sh:e", .cancel = NULL };
	kl_lease *a = NULL, *t = NULL;
	struct req other;

	ck_assert_int_eq(kl_memory_provider_new(&p), KL_OK);
	sh = mode_lock(p, KL_SHARED, KL_FOREVER);
	ex = mode_lock(p, 0, 0);
	shc = mode_lock(p, KL_SHARED | KL_ERRORCHECK, 0);
	exc = mode_lock(p, KL_ERRORCHECK, 0);
	/* Another reader holds the key first. */
	req_start(&other, sh, "sh:e", NULL);
	test_poll(req_holds, &other, "the other reader to hold the key");
	ck_assert_int_eq(kl_lock_acquire(shc, &call, &a, NULL), KL_OK);
	ck_assert_int_eq(kl_lock_acquire(shc, &call, &t, NULL), KL_EDEADLK);
	ck_assert_int_eq(kl_lock_acquire(exc, &call, &t, NULL), KL_EDEADLK);
	ck_assert_ptr_null(t);
	kl_lease_release(a);
	/* Only the other reader now: this thread waits, try-once. */
	ck_assert_int_eq(kl_lock_acquire(exc, &call, &t, NULL), KL_ETIMEDOUT);
	req_end(&other);
	/* Held exclusively by this thread: either mode is refused. */
	ck_assert_int_eq(kl_lock_acquire(ex, &call, &a, NULL), KL_OK);
	ck_assert_int_eq(kl_lock_acquire(shc, &call, &t, NULL), KL_EDEADLK);
	ck_assert_int_eq(kl_lock_acquire(exc, &call, &t, NULL), KL_EDEADLK);
	kl_lease_release(a);
	ck_assert_uint_eq(kl_memory_provider_size(p), 0);
	kl_lock_free(sh);
	kl_lock_free(ex);
	kl_lock_free(shc);
	kl_lock_free(exc);
	kl_provider_free(p);
}
END_TEST

/* A free key of a slot is taken shared without the lock by a lone
 * holder; others join it under the lock, it leaves before or after them,
 * a writer queued behind it gets the key when it leaves, and errorcheck
 * knows it. */
START_TEST(test_shared_lone_holder)
{
	kl_provider *p = NULL;
	kl_lock *sh, *shc, *ex0, *ex;
	kl_call call = { .key = "sh:lone", .cancel = NULL };
	kl_lease *a = NULL, *t = NULL;
	struct req b, x;
	uint64_t fa;

	ck_assert_int_eq(kl_memory_provider_new(&p), KL_OK);
	sh = mode_lock(p, KL_SHARED, KL_FOREVER);
	shc = mode_lock(p, KL_SHARED | KL_ERRORCHECK, 0);
	ex0 = mode_lock(p, 0, 0);
	ex = mode_lock(p, 0, KL_FOREVER);
	ck_assert_int_eq(run_once(p, "sh:lone"), KL_OK); /* makes the slot */
	for (int round = 0; round < 2; round++) {
		ck_assert_int_eq(kl_lock_acquire(shc, &call, &a, NULL), KL_OK);
		assert_status(p, "sh:lone", 1, 0);
		ck_assert_int_eq(kl_lock_acquire(shc, &call, &t, NULL),
				 KL_EDEADLK);
		ck_assert_int_eq(kl_lock_acquire(ex0, &call, &t, NULL),
				 KL_ETIMEDOUT);
		req_start(&b, sh, "sh:lone", NULL);
		test_poll(req_holds, &b, "a reader to join the lone one");
		assert_status(p, "sh:lone", 2, 0);
		ck_assert_uint_gt(b.fence, kl_lease_fence(a));
		ck_assert_int_eq(kl__test_check_invariants(p), KL_OK);
		if (round == 0) {
			/* The lone holder leaves first. */
			kl_lease_release(a);
			assert_status(p, "sh:lone", 1, 0);
			ck_assert_int_eq(kl__test_check_invariants(p), KL_OK);
			req_end(&b);
		} else {
			req_end(&b);
			assert_status(p, "sh:lone", 1, 0);
			ck_assert_int_eq(kl__test_check_invariants(p), KL_OK);
			kl_lease_release(a);
		}
		assert_status(p, "sh:lone", 0, 0);
		ck_assert_uint_eq(kl_memory_provider_size(p), 0);
	}
	/* A writer behind a lone holder. */
	ck_assert_int_eq(kl_lock_acquire(sh, &call, &a, NULL), KL_OK);
	fa = kl_lease_fence(a);
	req_start(&x, ex, "sh:lone", NULL);
	wait_status(p, "sh:lone", 1, 1);
	ck_assert_int_eq(kl__test_check_invariants(p), KL_OK);
	kl_lease_release(a);
	test_poll(req_holds, &x, "the writer to get the key");
	ck_assert_uint_gt(x.fence, fa);
	req_end(&x);
	ck_assert_int_eq(x.rc, KL_OK);
	ck_assert_uint_eq(kl_memory_provider_size(p), 0);
	ck_assert_int_eq(kl__test_check_invariants(p), KL_OK);
	kl_lock_free(sh);
	kl_lock_free(shc);
	kl_lock_free(ex0);
	kl_lock_free(ex);
	kl_provider_free(p);
}
END_TEST

/* The lease of kl_lock_acquire with KL_SHARED lives in the table, as an
 * exclusive one does: a lone holder of a free short key allocates
 * nothing, and its lease still says its key, its fence and its count. */
START_TEST(test_shared_lease_no_allocation)
{
	kl_provider *p = NULL;
	kl_lock *sh;
	kl_call call = { .key = "sh:na", .cancel = NULL };
	kl_lease *a = NULL;
	uint64_t last = 0;
	long allocs;

	ck_assert_int_eq(kl_memory_provider_new(&p), KL_OK);
	sh = mode_lock(p, KL_SHARED, 0);
	ck_assert_int_eq(run_once(p, "sh:na"), KL_OK); /* makes the slot */
	(void)kl__test_fail_alloc_at(0);
	for (int i = 0; i < 20; i++) {
		ck_assert_int_eq(kl_lock_acquire(sh, &call, &a, NULL), KL_OK);
		ck_assert_str_eq(kl_lease_key(a), "sh:na");
		ck_assert_uint_gt(kl_lease_fence(a), last);
		last = kl_lease_fence(a);
		ck_assert(kl_lease_valid(a));
		ck_assert_uint_eq(kl_lease_count(a), 1);
		ck_assert_str_eq(kl_lease_key_at(a, 0), "sh:na");
		ck_assert_uint_eq(kl_lease_fence_at(a, 0), last);
		ck_assert_ptr_null(kl_lease_key_at(a, 1));
		assert_status(p, "sh:na", 1, 0);
		kl_lease_release(a);
	}
	allocs = kl__test_fail_alloc_at(0);
	ck_assert_int_eq(allocs, 0);
	assert_status(p, "sh:na", 0, 0);
	ck_assert_uint_eq(kl_memory_provider_size(p), 0);
	kl_lock_free(sh);
	kl_provider_free(p);
}
END_TEST

#define COME_GO 40

/* A lone holder keeps the fence of its own grant while many shared
 * holders come and go beside it (the key's fence moves with each of
 * theirs); each of them costs one allocation, its holder record; a
 * newcomer does not pass a writer queued behind them all, and the lone
 * holder's release, last, hands the key to the writer. */
START_TEST(test_shared_many_come_and_go)
{
	kl_provider *p = NULL;
	kl_lock *sh, *ex;
	kl_call call = { .key = "sh:cg", .cancel = NULL };
	kl_lease *a = NULL, *b[COME_GO] = { NULL }, *t = NULL;
	uint64_t fa, fb[COME_GO], last;
	struct req x;
	long allocs;
	int i;

	ck_assert_int_eq(kl_memory_provider_new(&p), KL_OK);
	sh = mode_lock(p, KL_SHARED, 0);
	ex = mode_lock(p, 0, KL_FOREVER);
	ck_assert_int_eq(run_once(p, "sh:cg"), KL_OK); /* makes the slot */
	ck_assert_int_eq(kl_lock_acquire(sh, &call, &a, NULL), KL_OK);
	fa = last = kl_lease_fence(a);
	(void)kl__test_fail_alloc_at(0);
	for (int round = 0; round < 3; round++) {
		for (i = 0; i < COME_GO; i++) {
			ck_assert_int_eq(kl_lock_acquire(sh, &call, &b[i],
							 NULL),
					 KL_OK);
			fb[i] = kl_lease_fence(b[i]);
			ck_assert_uint_gt(fb[i], last);
			last = fb[i];
		}
		assert_status(p, "sh:cg", COME_GO + 1, 0);
		ck_assert_int_eq(kl__test_check_invariants(p), KL_OK);
		/* Every other one first, then the rest backwards. */
		for (i = 0; i < COME_GO; i += 2)
			kl_lease_release(b[i]);
		for (i = COME_GO - 1; i > 0; i -= 2) {
			ck_assert_uint_eq(kl_lease_fence(b[i]), fb[i]);
			ck_assert_str_eq(kl_lease_key(b[i]), "sh:cg");
			if (i > 2)
				kl_lease_release(b[i]);
		}
		ck_assert_uint_eq(kl_lease_fence(a), fa);
		ck_assert_str_eq(kl_lease_key(a), "sh:cg");
		assert_status(p, "sh:cg", 2, 0);
		kl_lease_release(b[1]);
		ck_assert_uint_eq(kl_lease_fence(a), fa);
		assert_status(p, "sh:cg", 1, 0);
	}
	allocs = kl__test_fail_alloc_at(0);
	ck_assert_int_eq(allocs, 3 * COME_GO);
	/* Two more beside it, and a writer behind them. */
	ck_assert_int_eq(kl_lock_acquire(sh, &call, &b[0], NULL), KL_OK);
	ck_assert_int_eq(kl_lock_acquire(sh, &call, &b[1], NULL), KL_OK);
	req_start(&x, ex, "sh:cg", NULL);
	wait_status(p, "sh:cg", 3, 1);
	/* Strict FIFO: a reader does not pass the queued writer. */
	ck_assert_int_eq(kl_lock_acquire(sh, &call, &t, NULL), KL_ETIMEDOUT);
	ck_assert_ptr_null(t);
	ck_assert_int_eq(kl__test_check_invariants(p), KL_OK);
	kl_lease_release(b[1]);
	kl_lease_release(b[0]);
	assert_status(p, "sh:cg", 1, 1);
	ck_assert_uint_eq(kl_lease_fence(a), fa);
	kl_lease_release(a);
	test_poll(req_holds, &x, "the writer to get the key");
	ck_assert_uint_gt(x.fence, last);
	req_end(&x);
	ck_assert_int_eq(x.rc, KL_OK);
	assert_status(p, "sh:cg", 0, 0);
	ck_assert_uint_eq(kl_memory_provider_size(p), 0);
	ck_assert_int_eq(kl__test_check_invariants(p), KL_OK);
	kl_lock_free(sh);
	kl_lock_free(ex);
	kl_provider_free(p);
}
END_TEST

/* Whether a shared take of key on l, made twice in a row while another
 * key is held, allocates both times: key's slot is the held key's, so
 * it goes to a chain (a new shard's first take allocates once, for the
 * slots, and then no more). */
static bool
takes_chained(kl_lock *l, const char *key)
{
	kl_call call = { .key = key, .cancel = NULL };
	kl_lease *t = NULL;
	long n = 0;

	for (int i = 0; i < 2; i++) {
		(void)kl__test_fail_alloc_at(0);
		ck_assert_int_eq(kl_lock_acquire(l, &call, &t, NULL), KL_OK);
		kl_lease_release(t);
		n = kl__test_fail_alloc_at(0);
	}
	return n > 0;
}

/* A slot whose lone shared holder left is reused by another key, itself
 * taken shared by a lone holder: the leases in the slot and in the chains
 * say their own key and fence throughout, and the slot's first key,
 * chained meanwhile, keeps its fences growing. */
START_TEST(test_shared_lease_slot_reused)
{
	kl_provider *p = NULL;
	kl_lock *sh, *ex;
	kl_call c1 = { .key = "sh:r1", .cancel = NULL };
	kl_call c2 = { .key = NULL, .cancel = NULL };
	kl_lease *a = NULL, *b = NULL, *c = NULL, *d = NULL;
	char k2[32];
	uint64_t fa, fb, fc, fd;
	int i;

	ck_assert_int_eq(kl_memory_provider_new(&p), KL_OK);
	sh = mode_lock(p, KL_SHARED, 0);
	ex = mode_lock(p, 0, 0);
	ck_assert_int_eq(run_once(p, "sh:r1"), KL_OK); /* makes the slot */
	ck_assert_int_eq(kl_lock_acquire(sh, &c1, &a, NULL), KL_OK);
	/* A key of sh:r1's slot: 4 slots in 64 shards, so one in 256 keys
	 * on average; a hash that spread none there in 100000 is broken. */
	for (i = 0; i < 100000; i++) {
		snprintf(k2, sizeof k2, "sh:r2-%d", i);
		if (takes_chained(sh, k2))
			break;
	}
	ck_assert_int_lt(i, 100000);
	c2.key = k2;
	fa = kl_lease_fence(a);
	ck_assert_int_eq(kl_lock_acquire(sh, &c2, &b, NULL), KL_OK);
	fb = kl_lease_fence(b);
	ck_assert_str_eq(kl_lease_key(a), "sh:r1");
	ck_assert_str_eq(kl_lease_key(b), k2);
	ck_assert_int_eq(kl__test_check_invariants(p), KL_OK);
	kl_lease_release(a);
	/* sh:r1 idle in its slot, taken again exclusively. */
	ck_assert_int_eq(kl_lock_acquire(ex, &c1, &a, NULL), KL_OK);
	ck_assert_uint_gt(kl_lease_fence(a), fa);
	fa = kl_lease_fence(a);
	kl_lease_release(a);
	ck_assert_str_eq(kl_lease_key(b), k2);
	ck_assert_uint_eq(kl_lease_fence(b), fb);
	kl_lease_release(b);
	/* The chain gone, k2 takes the slot over, a lone holder in the very
	 * word the lease of sh:r1 was. */
	ck_assert_int_eq(kl_lock_acquire(sh, &c2, &c, NULL), KL_OK);
	fc = kl_lease_fence(c);
	ck_assert_uint_gt(fc, fb);
	ck_assert_str_eq(kl_lease_key(c), k2);
	/* sh:r1 now goes to a chain, above every fence it had. */
	ck_assert_int_eq(kl_lock_acquire(sh, &c1, &d, NULL), KL_OK);
	fd = kl_lease_fence(d);
	ck_assert_uint_gt(fd, fa);
	ck_assert_str_eq(kl_lease_key(d), "sh:r1");
	ck_assert_int_eq(kl__test_check_invariants(p), KL_OK);
	kl_lease_release(c);
	ck_assert_str_eq(kl_lease_key(d), "sh:r1");
	ck_assert_uint_eq(kl_lease_fence(d), fd);
	assert_status(p, "sh:r1", 1, 0);
	assert_status(p, k2, 0, 0);
	kl_lease_release(d);
	ck_assert_uint_eq(kl_memory_provider_size(p), 0);
	ck_assert_int_eq(kl__test_check_invariants(p), KL_OK);
	kl_lock_free(sh);
	kl_lock_free(ex);
	kl_provider_free(p);
}
END_TEST

/* A shared lease may be given back by another thread than the one that
 * took it, lone or in the ring. */
static void *
release_elsewhere(void *arg)
{
	kl_lease_release(arg);
	return NULL;
}

START_TEST(test_shared_lease_released_elsewhere)
{
	kl_provider *p = NULL;
	kl_lock *sh, *ex;
	kl_call call = { .key = "sh:el", .cancel = NULL };
	kl_lease *a = NULL, *b = NULL, *t = NULL;
	pthread_t th;

	ck_assert_int_eq(kl_memory_provider_new(&p), KL_OK);
	sh = mode_lock(p, KL_SHARED, 0);
	ex = mode_lock(p, 0, 0);
	ck_assert_int_eq(run_once(p, "sh:el"), KL_OK);
	ck_assert_int_eq(kl_lock_acquire(sh, &call, &a, NULL), KL_OK);
	ck_assert_int_eq(kl_lock_acquire(sh, &call, &b, NULL), KL_OK);
	test_thread_start(&th, release_elsewhere, a);
	ck_assert_int_eq(pthread_join(th, NULL), 0);
	assert_status(p, "sh:el", 1, 0);
	test_thread_start(&th, release_elsewhere, b);
	ck_assert_int_eq(pthread_join(th, NULL), 0);
	assert_status(p, "sh:el", 0, 0);
	ck_assert_int_eq(kl_lock_acquire(ex, &call, &t, NULL), KL_OK);
	kl_lease_release(t);
	ck_assert_uint_eq(kl_memory_provider_size(p), 0);
	ck_assert_int_eq(kl__test_check_invariants(p), KL_OK);
	kl_lock_free(sh);
	kl_lock_free(ex);
	kl_provider_free(p);
}
END_TEST

/* kl_lock_run and a key set with KL_SHARED on the memory provider: the
 * function runs while another reader holds every key. */
static int
fn_status_two(void *arg)
{
	struct qwait *q = arg;
	size_t h = 0, w = 0;

	kl_provider_status(q->p, q->key, &h, &w, NULL);
	q->holders = h;
	return 0;
}

static int
lease_fn_status(kl_lease *lease, void *arg)
{
	(void)lease;
	return fn_status_two(arg);
}

START_TEST(test_shared_run_and_sets)
{
	kl_provider *p = NULL;
	kl_lock *sh, *shk;
	const char *keys[] = { "sh:s2", "sh:s1" };
	kl_lock_opts o = KL_LOCK_OPTS_INIT;
	struct qwait q = { NULL, "sh:s1", 0, 0 };
	struct req r1, r2;

	ck_assert_int_eq(kl_memory_provider_new(&p), KL_OK);
	q.p = p;
	sh = mode_lock(p, KL_SHARED, 0);
	o.provider = p;
	o.key = "sh:s1";
	o.flags = KL_SHARED;
	o.timeout_ms = 0;
	ck_assert_int_eq(kl_lock_new(&shk, &o), KL_OK);
	req_start(&r1, mode_lock(p, KL_SHARED, KL_FOREVER), "sh:s1", NULL);
	req_start(&r2, mode_lock(p, KL_SHARED, KL_FOREVER), "sh:s2", NULL);
	test_poll(req_holds, &r1, "a reader of s1");
	test_poll(req_holds, &r2, "a reader of s2");
	ck_assert_int_eq(kl_lock_run(shk, NULL, fn_status_two, &q, NULL,
				     NULL),
			 KL_OK);
	ck_assert_uint_eq(q.holders, 2);
	q.holders = 0;
	ck_assert_int_eq(kl_lock_run_many(sh, keys, 2, NULL, lease_fn_status,
					  &q, NULL, NULL),
			 KL_OK);
	ck_assert_uint_eq(q.holders, 2);
	assert_status(p, "sh:s1", 1, 0);
	assert_status(p, "sh:s2", 1, 0);
	req_end(&r1);
	req_end(&r2);
	kl_lock_free(r1.l);
	kl_lock_free(r2.l);
	ck_assert_uint_eq(kl_memory_provider_size(p), 0);
	kl_lock_free(sh);
	kl_lock_free(shk);
	kl_provider_free(p);
}
END_TEST

/* Snapshots */

#define SNAP_MAX 16

struct snap {
	int n, stop_after;
	kl_lock_info row[SNAP_MAX];
	char key[SNAP_MAX][48];
};

static int
snap_fn(const kl_lock_info *info, void *arg)
{
	struct snap *s = arg;

	if (s->n < SNAP_MAX) {
		s->row[s->n] = *info;
		snprintf(s->key[s->n], sizeof s->key[0], "%s", info->key);
		s->row[s->n].key = s->key[s->n];
	}
	s->n++;
	return s->stop_after != 0 && s->n == s->stop_after;
}

/* The rows of key in s, in order: *first and their count. */
static int
snap_rows(const struct snap *s, const char *key, int *first)
{
	int n = 0;

	*first = -1;
	for (int i = 0; i < s->n && i < SNAP_MAX; i++)
		if (strcmp(s->key[i], key) == 0) {
			if (*first < 0)
				*first = i;
			n++;
		}
	return n;
}

/* A snapshot of known states: a key held shared twice with a writer and a
 * reader queued, a long key held exclusively, an idle key not listed;
 * holders first, then waiters in queue order; stopping on non-zero. */
START_TEST(test_snapshot_known_states)
{
	const char *lk = "snap: a key too long for any slot";
	kl_provider *p = NULL;
	kl_lock *sh, *ex;
	kl_call call = { .key = "snap:k", .cancel = NULL };
	kl_lease *a = NULL, *b = NULL, *c = NULL;
	int64_t me = (int64_t)syscall(SYS_gettid);
	struct snap s;
	struct req x, r;
	int f;

	ck_assert_int_eq(kl_memory_provider_new(&p), KL_OK);
	memset(&s, 0, sizeof s);
	ck_assert_int_eq(kl_provider_snapshot(p, snap_fn, &s, NULL), KL_OK);
	ck_assert_int_eq(s.n, 0);
	sh = mode_lock(p, KL_SHARED, KL_FOREVER);
	ex = mode_lock(p, 0, KL_FOREVER);
	ck_assert_int_eq(run_once(p, "snap:idle"), KL_OK);
	/* Taken once, the key sits idle in its slot: a takes it without the
	 * lock, as its lone shared holder, b joins it with a record. */
	ck_assert_int_eq(run_once(p, "snap:k"), KL_OK);
	ck_assert_int_eq(kl_lock_acquire(sh, &call, &a, NULL), KL_OK);
	ck_assert_int_eq(kl_lock_acquire(sh, &call, &b, NULL), KL_OK);
	call.key = lk;
	ck_assert_int_eq(kl_lock_acquire(ex, &call, &c, NULL), KL_OK);
	req_start(&x, ex, "snap:k", NULL);
	wait_status(p, "snap:k", 2, 1);
	req_start(&r, sh, "snap:k", NULL);
	wait_status(p, "snap:k", 2, 2);

	memset(&s, 0, sizeof s);
	ck_assert_int_eq(kl_provider_snapshot(p, snap_fn, &s, NULL), KL_OK);
	ck_assert_int_eq(s.n, 5);
	ck_assert_int_eq(snap_rows(&s, "snap:idle", &f), 0);
	ck_assert_int_eq(snap_rows(&s, "snap:k", &f), 4);
	for (int i = f; i < f + 4; i++) {
		ck_assert_uint_eq(s.row[i].key_len, strlen("snap:k"));
		ck_assert_int_eq(s.row[i].pid, (int64_t)getpid());
		ck_assert_ptr_null(s.row[i].detail);
		ck_assert_int_ge(s.row[i].elapsed_ms, i == f ? -1 : 0);
	}
	/* Holders first, in grant order, with their fences: the lone
	 * holder's thread, time and fence are not recorded. */
	ck_assert(!s.row[f].waiting && s.row[f].shared);
	ck_assert(!s.row[f + 1].waiting && s.row[f + 1].shared);
	ck_assert_uint_eq(s.row[f].fence, 0);
	ck_assert_int_eq(s.row[f].tid, 0);
	ck_assert_int_eq(s.row[f].elapsed_ms, -1);
	ck_assert_uint_eq(s.row[f + 1].fence, kl_lease_fence(b));
	ck_assert_uint_gt(kl_lease_fence(b), kl_lease_fence(a));
	ck_assert_int_eq(s.row[f + 1].tid, me);
	/* Then the writer, then the reader behind it. */
	ck_assert(s.row[f + 2].waiting && !s.row[f + 2].shared);
	ck_assert_uint_eq(s.row[f + 2].position, 0);
	ck_assert_int_eq(s.row[f + 2].tid, x.tid);
	ck_assert_uint_eq(s.row[f + 2].fence, 0);
	ck_assert(s.row[f + 3].waiting && s.row[f + 3].shared);
	ck_assert_uint_eq(s.row[f + 3].position, 1);
	ck_assert_int_eq(s.row[f + 3].tid, r.tid);
	ck_assert_int_eq(snap_rows(&s, lk, &f), 1);
	ck_assert(!s.row[f].waiting && !s.row[f].shared);
	ck_assert_uint_eq(s.row[f].fence, kl_lease_fence(c));
	ck_assert_uint_eq(s.row[f].key_len, strlen(lk));

	/* Non-zero stops the walk. */
	memset(&s, 0, sizeof s);
	s.stop_after = 2;
	ck_assert_int_eq(kl_provider_snapshot(p, snap_fn, &s, NULL), KL_OK);
	ck_assert_int_eq(s.n, 2);

	kl_lease_release(a);
	kl_lease_release(b);
	test_poll(req_holds, &x, "the writer to get the key");
	memset(&s, 0, sizeof s);
	ck_assert_int_eq(kl_provider_snapshot(p, snap_fn, &s, NULL), KL_OK);
	ck_assert_int_eq(snap_rows(&s, "snap:k", &f), 2);
	ck_assert(!s.row[f].waiting && !s.row[f].shared);
	ck_assert_uint_eq(s.row[f].fence, x.fence);
	ck_assert(s.row[f + 1].waiting && s.row[f + 1].shared);
	ck_assert_uint_eq(s.row[f + 1].position, 0);
	req_end(&x);
	req_end(&r);
	kl_lease_release(c);
	memset(&s, 0, sizeof s);
	ck_assert_int_eq(kl_provider_snapshot(p, snap_fn, &s, NULL), KL_OK);
	ck_assert_int_eq(s.n, 0);
	kl_lock_free(sh);
	kl_lock_free(ex);
	kl_provider_free(p);
}
END_TEST

/* fn may call keylock: no provider lock is held while it runs. */
static int
snap_relock(const kl_lock_info *info, void *arg)
{
	kl_provider *p = arg;

	(void)info;
	return run_once(p, "snap:k") == KL_OK ? 0 : 1;
}

START_TEST(test_snapshot_fn_may_lock)
{
	kl_provider *p = NULL;
	kl_lock *ex;
	kl_call call = { .key = "snap:other", .cancel = NULL };
	kl_lease *a = NULL;

	ck_assert_int_eq(kl_memory_provider_new(&p), KL_OK);
	ex = mode_lock(p, 0, 0);
	ck_assert_int_eq(kl_lock_acquire(ex, &call, &a, NULL), KL_OK);
	ck_assert_int_eq(kl_provider_snapshot(p, snap_relock, p, NULL),
			 KL_OK);
	kl_lease_release(a);
	ck_assert_uint_eq(kl_memory_provider_size(p), 0);
	kl_lock_free(ex);
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

	tc = tcase_create("shared");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_shared_holders_together);
	tcase_add_loop_test(tc, test_shared_exclusive_waits_for_all, 0, 2);
	tcase_add_test(tc, test_shared_no_barging_and_runs);
	tcase_add_loop_test(tc, test_shared_writer_leaves, 0, 2);
	tcase_add_test(tc, test_shared_try_once_and_fences);
	tcase_add_test(tc, test_shared_errorcheck);
	tcase_add_test(tc, test_shared_lone_holder);
	tcase_add_test(tc, test_shared_lease_no_allocation);
	tcase_add_test(tc, test_shared_many_come_and_go);
	tcase_add_test(tc, test_shared_lease_slot_reused);
	tcase_add_test(tc, test_shared_lease_released_elsewhere);
	tcase_add_test(tc, test_shared_run_and_sets);
	tcase_add_test(tc, test_snapshot_known_states);
	tcase_add_test(tc, test_snapshot_fn_may_lock);
	suite_add_tcase(s, tc);

	return s;
}

int
main(void)
{
	return test_run_suite(provider_memory_suite());
}
