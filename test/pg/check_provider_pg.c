/* SPDX-License-Identifier: MIT */
/*
 * Tests of the PostgreSQL provider (src/pg/, libkeylock-pg)
 * against a real server: KEYLOCK_TEST_PG_URI names it (tools/test stage pg
 * starts a throwaway one).  Without it, or when the server cannot be
 * reached, the suite exits 77 (skip): it never fakes a server.
 *
 * Covered: the key id seen in pg_locks, fences, try-once, timeouts and
 * cancellation leaving no lock or waiter on the server, strict FIFO across
 * threads (queued one at a time, confirmed through kl_provider_status),
 * mutual exclusion across 4 processes x 4 threads, a holder killed with
 * SIGKILL, a holder's backend terminated (lease invalid, KL_EV_LOST, then
 * KL_EV_RELEASE_FAILED), a dead idle connection replaced, the pool bound,
 * KL_ERRORCHECK, unreachable servers, bad URIs and authentication failures
 * whose messages never show the password; TESTPLAN T24 (a) to (f): a
 * killed holder (50 rounds), a stopped one under idle_session_timeout, a
 * terminated backend, the 500 ms timeout bound, the release of a lock the
 * session lost, and last, the server stopped with pg_ctl -m immediate and
 * started again (KEYLOCK_TEST_PG_CTL, _DATA, _LOG, _OPTS, _RUNAS; not run
 * without them); T14's provider variant: a forked child using the
 * inherited provider opens backends of its own and leaves the parent's
 * alone.  Lock modes (KL_SHARED): each case of the Web Locks rule as the
 * server's queue decides it, fences of mixed and concurrent shared
 * grants, KL_ERRORCHECK in both modes, kl_provider_snapshot against known
 * states, the server's 40P01 as KL_EDEADLK, and the cycle of two threads
 * the server cannot see.  With KEYLOCK_TEST_PG_AUTH_URI
 * (a role with a password, checked by scram or md5) the wrong-password case
 * runs against real password authentication.
 *
 * Each test opens its own admin connection (libpq) to look at pg_locks and
 * pg_stat_activity, and uses keys unique to the test and process, so runs
 * do not disturb each other.  Other processes are test/pg/pg_helper, spawned
 * with posix_spawn and killed by the teardown if still running.  Worker
 * threads never call ck_assert*; orders are forced by polling the server's
 * lock queue, never by sleeping; time bounds are wide.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* pipe2, environ without config.h */
#endif

#include <arpa/inet.h>
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <spawn.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <libpq-fe.h>

#include "keylock.h"
#include "keylock/pg.h"
#include "../util.h"

/* Bounds on waits that must not hang. */
#define WAIT_BOUND_MS 30000
/* Health checks in the tests that lose a lease. */
#define HEALTH_MS 200

static const char *g_uri;      /* KEYLOCK_TEST_PG_URI */
static const char *g_auth_uri; /* KEYLOCK_TEST_PG_AUTH_URI, may be NULL */
static PGconn *g_admin;        /* per test */
static int g_keyno;


/* ------------------------------------------------------------------ */
/* Fixture and the admin connection                                    */

static void
setup(void)
{
	g_admin = PQconnectdb(g_uri);
	ck_assert_msg(PQstatus(g_admin) == CONNECTION_OK,
		      "admin connection: %s", PQerrorMessage(g_admin));
}

static void
teardown(void)
{
	test_helpers_kill();
	PQfinish(g_admin);
	g_admin = NULL;
}

/* A key unique to this test and process. */
static const char *
new_key(const char *what)
{
	static char keys[16][96];
	char *k = keys[g_keyno++ % 16];

	snprintf(k, sizeof keys[0], "check-pg/%s/%d/%d", what, (int)getpid(),
		 g_keyno);
	return k;
}

/* One integer from the admin connection. */
static long long
admin_int(const char *sql)
{
	PGresult *r = PQexec(g_admin, sql);
	long long v;

	ck_assert_msg(PQresultStatus(r) == PGRES_TUPLES_OK && PQntuples(r) == 1,
		      "%s: %s", sql, PQresultErrorMessage(r));
	v = PQgetisnull(r, 0, 0) ? -1 : strtoll(PQgetvalue(r, 0, 0), NULL, 10);
	PQclear(r);
	return v;
}

/* One text value (NULL: "") from the admin connection, into buf. */
static void
admin_text(const char *sql, char *buf, size_t size)
{
	PGresult *r = PQexec(g_admin, sql);

	ck_assert_msg(PQresultStatus(r) == PGRES_TUPLES_OK && PQntuples(r) == 1,
		      "%s: %s", sql, PQresultErrorMessage(r));
	snprintf(buf, size, "%s", PQgetvalue(r, 0, 0));
	PQclear(r);
}

/* What pg_locks shows for key, found from kl_pg_key_id independently of
 * the provider's own status query: granted and waiting entries. */
static void
server_locks(const char *key, long long *granted, long long *waiting)
{
	uint64_t id = (uint64_t)kl_pg_key_id(key, strlen(key));
	char sql[512];

	snprintf(sql, sizeof sql,
		 "SELECT count(*) FILTER (WHERE %s) FROM pg_locks WHERE "
		 "locktype = 'advisory' AND classid = %" PRIu32
		 "::bigint::text::oid AND objid = %" PRIu32
		 "::bigint::text::oid AND objsubid = 1",
		 "granted", (uint32_t)(id >> 32), (uint32_t)id);
	*granted = admin_int(sql);
	snprintf(sql, sizeof sql,
		 "SELECT count(*) FILTER (WHERE %s) FROM pg_locks WHERE "
		 "locktype = 'advisory' AND classid = %" PRIu32
		 "::bigint::text::oid AND objid = %" PRIu32
		 "::bigint::text::oid AND objsubid = 1",
		 "NOT granted", (uint32_t)(id >> 32), (uint32_t)id);
	*waiting = admin_int(sql);
}

/* Polls pg_locks until key has exactly granted and waiting entries: a
 * closed session's locks go as its backend exits, a moment later. */
static void
wait_server_locks(const char *key, long long granted, long long waiting)
{
	int64_t limit = now_ms() + TEST_POLL_LIMIT_MS;
	long long g, w;

	for (;;) {
		server_locks(key, &g, &w);
		if (g == granted && w == waiting)
			return;
		ck_assert_msg(now_ms() < limit,
			      "pg_locks for '%s': %lld granted, %lld waiting; "
			      "expected %lld and %lld",
			      key, g, w, granted, waiting);
		test_sleep_ms(5);
	}
}

/* The pid of the backend holding key. */
static long long
holder_pid(const char *key)
{
	uint64_t id = (uint64_t)kl_pg_key_id(key, strlen(key));
	char sql[512];

	snprintf(sql, sizeof sql,
		 "SELECT min(pid) FROM pg_locks WHERE locktype = 'advisory' "
		 "AND granted AND classid = %" PRIu32
		 "::bigint::text::oid AND objid = %" PRIu32
		 "::bigint::text::oid AND objsubid = 1",
		 (uint32_t)(id >> 32), (uint32_t)id);
	return admin_int(sql);
}

/* ------------------------------------------------------------------ */
/* Providers, locks, events                                            */

/* g_uri with the query parameters extra (may be NULL) added. */
static void
uri_with(char *buf, size_t size, const char *base, const char *extra)
{
	int n;

	if (extra == NULL || extra[0] == '\0')
		n = snprintf(buf, size, "%s", base);
	else
		n = snprintf(buf, size, "%s%c%s", base,
			     strchr(base, '?') != NULL ? '&' : '?', extra);
	ck_assert(n > 0 && (size_t)n < size);
}

static kl_provider *
open_with(const char *base, const char *extra)
{
	char uri[1024];

	uri_with(uri, sizeof uri, base, extra);
	return test_provider_open(uri);
}

static kl_provider *
open_pg(const char *extra)
{
	return open_with(g_uri, extra);
}

/* Opening uri must fail with status within bound_ms; returns the
 * message in msg. */
static void
open_fails(const char *uri, int status, int64_t bound_ms, char *msg,
	   size_t size)
{
	kl_provider *p = (kl_provider *)&p; /* must be reset to NULL */
	kl_error err;
	int64_t t0 = now_ms(), took;
	int rc;

	memset(&err, 0, sizeof err);
	rc = kl_provider_open(&p, uri, &err);
	took = now_ms() - t0;
	ck_assert_msg(rc == status, "kl_provider_open gave %s, expected %s: %s",
		      kl_strerror(rc), kl_strerror(status), err.message);
	ck_assert_ptr_null(p);
	ck_assert_int_eq(err.status, status);
	ck_assert_msg(err.message[0] != '\0', "no message");
	ck_assert_msg(took <= bound_ms, "took %lld ms (bound %lld): %s",
		      (long long)took, (long long)bound_ms, err.message);
	snprintf(msg, size, "%s", err.message);
}

/* Runs sql on c; it must succeed. */
static void
exec_ok(PGconn *c, const char *sql)
{
	PGresult *r = PQexec(c, sql);

	ck_assert_msg(PQresultStatus(r) == PGRES_COMMAND_OK ||
			      PQresultStatus(r) == PGRES_TUPLES_OK,
		      "%s: %s", sql, PQresultErrorMessage(r));
	PQclear(r);
}

/* One integer from sql on c. */
static long long
int_on(PGconn *c, const char *sql)
{
	PGresult *r = PQexec(c, sql);
	long long v;

	ck_assert_msg(PQresultStatus(r) == PGRES_TUPLES_OK && PQntuples(r) == 1,
		      "%s: %s", sql, PQresultErrorMessage(r));
	v = PQgetisnull(r, 0, 0) ? -1 : strtoll(PQgetvalue(r, 0, 0), NULL, 10);
	PQclear(r);
	return v;
}

/* base with user and database replaced (any password dropped), and the
 * query parameters extra (may be NULL) added. */
static void
uri_user_db(char *buf, size_t size, const char *base, const char *user,
	    const char *db, const char *extra)
{
	const char *s = strstr(base, "://"), *at, *end, *q;
	char tmp[1024];
	int n;

	ck_assert_ptr_nonnull(s);
	s += 3;
	end = s + strcspn(s, "/?");
	at = s;
	for (const char *p = s; p < end; p++)
		if (*p == '@')
			at = p + 1;
	q = strchr(end, '?');
	n = snprintf(tmp, sizeof tmp, "postgresql://%s@%.*s/%s%s", user,
		     (int)(end - at), at, db, q != NULL ? q : "");
	ck_assert(n > 0 && (size_t)n < sizeof tmp);
	uri_with(buf, size, tmp, extra);
}

/* The server's clock in microseconds since the epoch. */
static long long
server_us(void)
{
	return admin_int("SELECT (EXTRACT(epoch FROM clock_timestamp()) * "
			 "1000000)::bigint");
}

struct hold {
	kl_lock *l;
	kl_lease *lease;
};

/* Acquires key on p into h; returns the status.  h holds nothing unless
 * KL_OK.  ev (may be NULL) receives the lock's events. */
static int
take_ev(kl_provider *p, const char *key, int64_t timeout_ms, kl_cancel *c,
	unsigned flags, struct test_events *ev, struct hold *h, kl_error *err)
{
	kl_lock_opts o = KL_LOCK_OPTS_INIT;
	kl_call call = { .key = NULL, .cancel = c };
	int rc;

	o.provider = p;
	o.key = key;
	o.timeout_ms = timeout_ms;
	o.flags = flags;
	if (ev != NULL) {
		o.on_event = tev_record;
		o.event_arg = ev;
	}
	h->l = NULL;
	h->lease = NULL;
	if (kl_lock_new(&h->l, &o) != KL_OK)
		return KL_ENOMEM;
	if (err != NULL)
		memset(err, 0, sizeof *err);
	rc = kl_lock_acquire(h->l, &call, &h->lease, err);
	if (rc != KL_OK) {
		kl_lock_free(h->l);
		h->l = NULL;
		h->lease = NULL;
	}
	return rc;
}

static int
take(kl_provider *p, const char *key, int64_t timeout_ms, kl_cancel *c,
     struct hold *h, kl_error *err)
{
	return take_ev(p, key, timeout_ms, c, 0, NULL, h, err);
}

static void
take_ok(kl_provider *p, const char *key, struct hold *h)
{
	kl_error err;
	int rc = take(p, key, WAIT_BOUND_MS, NULL, h, &err);

	ck_assert_msg(rc == KL_OK, "acquire '%s': %s: %s", key,
		      kl_strerror(rc), err.message);
	ck_assert_ptr_nonnull(h->lease);
}

static void
drop(struct hold *h)
{
	kl_lease_release(h->lease);
	kl_lock_free(h->l);
	h->lease = NULL;
	h->l = NULL;
}

/* Polls kl_provider_status until key has exactly holders and waiters. */
static void
wait_status(kl_provider *p, const char *key, size_t holders, size_t waiters)
{
	test_wait_status(p, key, holders, waiters, TEST_POLL_LIMIT_MS);
}

/* ------------------------------------------------------------------ */
/* Waiter threads                                                      */

struct shared {
	atomic_int seq;
	atomic_int inside;
	atomic_int overlaps;
};

struct waiter {
	kl_provider *p;
	const char *key;
	int64_t timeout_ms;
	kl_cancel *cancel;
	bool release;
	struct shared *sh;
	int iters; /* > 1: acquire and release that many times */
	unsigned flags; /* KL_SHARED, KL_ERRORCHECK */
	struct test_bg bg;
	struct hold h;
	int rc;
	kl_error err;
	int rank;
	int64_t start_ns, end_ns;
	atomic_llong tid; /* gettid() of the thread */
	uint64_t fence;
};

static void
waiter_main(void *arg)
{
	struct waiter *w = arg;
	int n = w->iters > 0 ? w->iters : 1;

	w->rank = -1;
	atomic_store(&w->tid, (long long)syscall(SYS_gettid));
	for (int i = 0; i < n; i++) {
		w->start_ns = now_ns();
		w->rc = take_ev(w->p, w->key, w->timeout_ms, w->cancel,
				w->flags, NULL, &w->h, &w->err);
		w->end_ns = now_ns();
		if (w->rc != KL_OK)
			break;
		w->fence = kl_lease_fence(w->h.lease);
		if (w->sh != NULL) {
			w->rank = atomic_fetch_add(&w->sh->seq, 1);
			if (atomic_fetch_add(&w->sh->inside, 1) != 0)
				atomic_fetch_add(&w->sh->overlaps, 1);
			sched_yield();
			atomic_fetch_sub(&w->sh->inside, 1);
		}
		if (!w->release)
			break;
		drop(&w->h);
	}
}

static struct waiter *
waiter_start_flags(kl_provider *p, const char *key, int64_t timeout_ms,
		   kl_cancel *c, bool release, struct shared *sh,
		   unsigned flags)
{
	struct waiter *w = calloc(1, sizeof *w);

	ck_assert_ptr_nonnull(w);
	w->p = p;
	w->key = key;
	w->timeout_ms = timeout_ms;
	w->cancel = c;
	w->release = release;
	w->sh = sh;
	w->flags = flags;
	test_bg_start(&w->bg, waiter_main, w);
	return w;
}

static struct waiter *
waiter_start(kl_provider *p, const char *key, int64_t timeout_ms,
	     kl_cancel *c, bool release, struct shared *sh)
{
	return waiter_start_flags(p, key, timeout_ms, c, release, sh, 0);
}

static bool
waiter_done(void *arg)
{
	return atomic_load(&((struct waiter *)arg)->bg.done);
}

static void
waiter_join(struct waiter *w)
{
	test_bg_join(&w->bg, "a waiter to return");
}

static void
waiter_free(struct waiter *w)
{
	if (w->h.lease != NULL)
		drop(&w->h);
	free(w);
}

/* ------------------------------------------------------------------ */
/* Helper processes (test/pg/pg_helper)                                */

/* Starts pg_helper with args (NULL-terminated): the libtool wrapper,
 * which finds the uninstalled libraries. */
static void
helper_spawn(struct test_helper *h, const char *const *args)
{
	test_helper_spawn(h, test_helper_path("test/pg", "pg_helper", false),
			  args, NULL);
}

/* Waits (bounded) for the helper to exit; returns its wait status. */
static int
helper_reap(struct test_helper *h, int64_t limit_ms)
{
	int status = test_helper_reap(h, limit_ms);

	test_helper_close(h);
	return status;
}

/* ------------------------------------------------------------------ */
/* Basics                                                              */

START_TEST(test_key_id_stable)
{
	/* The mapping is part of the interface: other processes, hosts and
	 * versions must compute the same ids (include/keylock/pg.h). */
	ck_assert(kl_pg_key_id("hello", 5) == INT64_C(-1861698501393448245));
	ck_assert(kl_pg_key_id("", 0) == INT64_C(-670436540291247412));
	ck_assert(kl_pg_key_id(NULL, 0) == kl_pg_key_id("", 0));
	ck_assert(kl_pg_key_id("a", 1) != kl_pg_key_id("b", 1));
}
END_TEST

START_TEST(test_lock_shows_in_pg_locks)
{
	kl_provider *p = open_pg(NULL);
	const char *key = new_key("pglocks");
	struct hold h;
	long long g, w;

	take_ok(p, key, &h);
	ck_assert(kl_lease_valid(h.lease));
	server_locks(key, &g, &w);
	ck_assert_int_eq(g, 1);
	ck_assert_int_eq(w, 0);
	wait_status(p, key, 1, 0);
	drop(&h);
	/* Released on a live connection: gone at once. */
	server_locks(key, &g, &w);
	ck_assert_int_eq(g, 0);
	ck_assert_int_eq(w, 0);
	wait_status(p, key, 0, 0);
	kl_provider_free(p);
}
END_TEST

START_TEST(test_binary_and_long_keys)
{
	kl_provider *p = open_pg(NULL);
	static char big[70000];
	char bin[256];
	struct hold h;

	for (int i = 0; i < 255; i++)
		bin[i] = (char)(i + 1);
	bin[255] = '\0';
	memset(big, 'k', sizeof big - 1);
	take_ok(p, bin, &h);
	drop(&h);
	take_ok(p, big, &h);
	drop(&h);
	take_ok(p, "", &h);
	drop(&h);
	kl_provider_free(p);
}
END_TEST

START_TEST(test_fence_strictly_increasing)
{
	kl_provider *a = open_pg(NULL), *b = open_pg("pool=2");
	const char *key = new_key("fence");
	uint64_t last = 0, f;
	struct hold h;

	for (int i = 0; i < 20; i++) {
		take_ok(i % 2 == 0 ? a : b, key, &h);
		f = kl_lease_fence(h.lease);
		ck_assert_msg(f > last, "fence %" PRIu64 " after %" PRIu64, f,
			      last);
		last = f;
		drop(&h);
	}
	kl_provider_free(a);
	kl_provider_free(b);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Waiting: try once, timeout, cancel, FIFO                            */

START_TEST(test_try_once)
{
	kl_provider *p = open_pg(NULL);
	const char *key = new_key("try");
	struct hold h, h2;
	kl_error err;
	long long g, w;
	int64_t t0;
	int rc;

	take_ok(p, key, &h);
	t0 = now_ms();
	rc = take(p, key, 0, NULL, &h2, &err);
	ck_assert_msg(rc == KL_ETIMEDOUT, "try on a held key: %s: %s",
		      kl_strerror(rc), err.message);
	ck_assert_int_lt(now_ms() - t0, 2000);
	server_locks(key, &g, &w);
	ck_assert_int_eq(g, 1);
	ck_assert_int_eq(w, 0);
	drop(&h);
	rc = take(p, key, 0, NULL, &h2, &err);
	ck_assert_msg(rc == KL_OK, "try on a free key: %s: %s",
		      kl_strerror(rc), err.message);
	drop(&h2);
	kl_provider_free(p);
}
END_TEST

START_TEST(test_timeout_leaves_nothing)
{
	kl_provider *p = open_pg(NULL);
	const char *key = new_key("timeout");
	struct hold h, h2;
	kl_error err;
	long long g, w;
	int64_t t0, took;
	int rc;

	take_ok(p, key, &h);
	t0 = now_ms();
	rc = take(p, key, 500, NULL, &h2, &err);
	took = now_ms() - t0;
	ck_assert_msg(rc == KL_ETIMEDOUT, "%s: %s", kl_strerror(rc),
		      err.message);
	ck_assert_msg(took >= 490 && took <= 500 + 1500,
		      "timed out after %lld ms", (long long)took);
	/* No waiter left queued on the server, the holder untouched. */
	server_locks(key, &g, &w);
	ck_assert_int_eq(g, 1);
	ck_assert_int_eq(w, 0);
	drop(&h);
	wait_server_locks(key, 0, 0);
	kl_provider_free(p);
}
END_TEST

START_TEST(test_cancel_from_another_thread)
{
	kl_provider *p = open_pg(NULL);
	const char *key = new_key("cancel");
	struct hold h, h2;
	struct waiter *w;
	kl_cancel *c;
	kl_error err;
	long long g, wt;
	int64_t fired;
	int rc;

	ck_assert_int_eq(kl_cancel_new(&c), KL_OK);
	take_ok(p, key, &h);
	w = waiter_start(p, key, KL_FOREVER, c, false, NULL);
	wait_status(p, key, 1, 1);
	fired = now_ns();
	kl_cancel_fire(c);
	waiter_join(w);
	ck_assert_msg(w->rc == KL_ECANCELED, "%s: %s", kl_strerror(w->rc),
		      w->err.message);
	ck_assert_msg(w->end_ns - fired < 2000000000LL,
		      "canceled wait ended %lld ms after the fire",
		      (long long)((w->end_ns - fired) / 1000000));
	server_locks(key, &g, &wt);
	ck_assert_int_eq(g, 1);
	ck_assert_int_eq(wt, 0);
	/* A token fired already: KL_ECANCELED at once, held or free. */
	rc = take(p, key, KL_FOREVER, c, &h2, &err);
	ck_assert_int_eq(rc, KL_ECANCELED);
	drop(&h);
	rc = take(p, key, KL_FOREVER, c, &h2, &err);
	ck_assert_int_eq(rc, KL_ECANCELED);
	wait_server_locks(key, 0, 0);
	/* The connection the canceled wait used is still good. */
	take_ok(p, key, &h);
	drop(&h);
	waiter_free(w);
	kl_cancel_free(c);
	kl_provider_free(p);
}
END_TEST

START_TEST(test_cancel_token_timeout)
{
	kl_provider *p = open_pg(NULL);
	const char *key = new_key("canceltimer");
	struct hold h, h2;
	kl_cancel *c;
	kl_error err;
	int64_t t0, took;
	int rc;

	ck_assert_int_eq(kl_cancel_new_timeout(&c, 300), KL_OK);
	take_ok(p, key, &h);
	t0 = now_ms();
	rc = take(p, key, KL_FOREVER, c, &h2, &err);
	took = now_ms() - t0;
	ck_assert_int_eq(rc, KL_ECANCELED);
	ck_assert_msg(took >= 250 && took < 2300, "took %lld ms",
		      (long long)took);
	wait_server_locks(key, 1, 0);
	drop(&h);
	kl_cancel_free(c);
	kl_provider_free(p);
}
END_TEST

START_TEST(test_fifo_across_threads)
{
	kl_provider *p = open_pg(NULL);
	const char *key = new_key("fifo");
	struct shared sh = { 0 };
	struct waiter *w[4];
	struct hold h;

	take_ok(p, key, &h);
	for (int i = 0; i < 4; i++) {
		w[i] = waiter_start(p, key, WAIT_BOUND_MS, NULL, true, &sh);
		/* Queued on the server before the next one starts. */
		wait_status(p, key, 1, (size_t)i + 1);
	}
	drop(&h);
	for (int i = 0; i < 4; i++)
		waiter_join(w[i]);
	for (int i = 0; i < 4; i++) {
		ck_assert_msg(w[i]->rc == KL_OK, "waiter %d: %s: %s", i,
			      kl_strerror(w[i]->rc), w[i]->err.message);
		ck_assert_msg(w[i]->rank == i, "waiter %d granted as %d", i,
			      w[i]->rank);
		waiter_free(w[i]);
	}
	ck_assert_int_eq(atomic_load(&sh.overlaps), 0);
	wait_server_locks(key, 0, 0);
	kl_provider_free(p);
}
END_TEST

START_TEST(test_threads_share_provider)
{
	kl_provider *p = open_pg("pool=4");
	const char *keys[2] = { new_key("shareA"), new_key("shareB") };
	struct shared sh[2] = { { 0 }, { 0 } };
	struct waiter *w[8];
	int iters = (int)kl_test_scaled(15, 3);

	/* 8 threads on 4 connections: half of them wait for one at any
	 * time, in the pool's queue. */
	for (int i = 0; i < 8; i++) {
		w[i] = calloc(1, sizeof *w[i]);
		ck_assert_ptr_nonnull(w[i]);
		w[i]->p = p;
		w[i]->key = keys[i % 2];
		w[i]->timeout_ms = WAIT_BOUND_MS;
		w[i]->release = true;
		w[i]->sh = &sh[i % 2];
		w[i]->iters = iters;
		test_bg_start(&w[i]->bg, waiter_main, w[i]);
	}
	for (int i = 0; i < 8; i++)
		waiter_join(w[i]);
	for (int i = 0; i < 8; i++) {
		ck_assert_msg(w[i]->rc == KL_OK, "thread %d: %s: %s", i,
			      kl_strerror(w[i]->rc), w[i]->err.message);
		waiter_free(w[i]);
	}
	for (int k = 0; k < 2; k++) {
		ck_assert_int_eq(atomic_load(&sh[k].overlaps), 0);
		ck_assert_int_eq(atomic_load(&sh[k].seq), 4 * iters);
	}
	kl_provider_free(p);
}
END_TEST

START_TEST(test_pool_bound)
{
	kl_provider *p = open_pg("pool=1");
	const char *a = new_key("poolA"), *b = new_key("poolB");
	struct hold h, h2;
	kl_cancel *c;
	kl_error err;
	int64_t t0, took;
	int rc;

	/* The one connection is held: a call for another key waits for it
	 * and times out or is canceled like any wait. */
	take_ok(p, a, &h);
	t0 = now_ms();
	rc = take(p, b, 300, NULL, &h2, &err);
	took = now_ms() - t0;
	ck_assert_int_eq(rc, KL_ETIMEDOUT);
	ck_assert_msg(took >= 290 && took < 2300, "took %lld ms",
		      (long long)took);
	ck_assert_int_eq(kl_cancel_new_timeout(&c, 200), KL_OK);
	rc = take(p, b, KL_FOREVER, c, &h2, &err);
	ck_assert_int_eq(rc, KL_ECANCELED);
	kl_cancel_free(c);
	drop(&h);
	take_ok(p, b, &h2);
	drop(&h2);
	kl_provider_free(p);
}
END_TEST

START_TEST(test_errorcheck)
{
	kl_provider *p = open_pg(NULL);
	const char *key = new_key("errcheck");
	struct hold h, h2;
	struct waiter *w;
	kl_error err;
	int rc;

	rc = take_ev(p, key, WAIT_BOUND_MS, NULL, KL_ERRORCHECK, NULL, &h,
		     &err);
	ck_assert_int_eq(rc, KL_OK);
	rc = take_ev(p, key, WAIT_BOUND_MS, NULL, KL_ERRORCHECK, NULL, &h2,
		     &err);
	ck_assert_msg(rc == KL_EDEADLK, "%s: %s", kl_strerror(rc),
		      err.message);
	/* Another thread is not refused, it waits. */
	w = waiter_start(p, key, 200, NULL, false, NULL);
	waiter_join(w);
	ck_assert_int_eq(w->rc, KL_ETIMEDOUT);
	waiter_free(w);
	drop(&h);
	kl_provider_free(p);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Other processes                                                     */

START_TEST(test_mutual_exclusion_processes)
{
	const char *key = new_key("mutex");
	long iters = kl_test_scaled(25, 5);
	char file[] = "/tmp/kl-check-pg.XXXXXX", its[24], line[300];
	const char *args[7];
	struct test_helper hs[4];
	int64_t st[3] = { 0, 0, 0 };
	int fd, status;

	fd = mkstemp(file);
	ck_assert_int_ge(fd, 0);
	ck_assert_int_eq(pwrite(fd, st, sizeof st, 0), (ssize_t)sizeof st);
	snprintf(its, sizeof its, "%ld", iters);
	args[0] = "count";
	args[1] = g_uri;
	args[2] = key;
	args[3] = file;
	args[4] = "4";
	args[5] = its;
	args[6] = NULL;
	for (int i = 0; i < 4; i++)
		helper_spawn(&hs[i], args);
	for (int i = 0; i < 4; i++) {
		bool got = test_helper_line(&hs[i], line, sizeof line, 120000);

		status = helper_reap(&hs[i], 10000);
		ck_assert_msg(got && WIFEXITED(status) &&
				      WEXITSTATUS(status) == 0,
			      "helper %d: status 0x%x: %s", i,
			      (unsigned)status, got ? line : "(no output)");
	}
	ck_assert_int_eq(pread(fd, st, sizeof st, 0), (ssize_t)sizeof st);
	close(fd);
	unlink(file);
	ck_assert_int_eq(st[0], 4 * 4 * iters);
	ck_assert_int_eq(st[1], 0);
}
END_TEST

/* Starts pg_helper hold on key with uri and waits for its grant. */
static void
holder_start(struct test_helper *hp, const char *uri, const char *key)
{
	const char *args[] = { "hold", uri, key, NULL };
	char line[300];

	helper_spawn(hp, args);
	ck_assert_msg(test_helper_line(hp, line, sizeof line,
				       TEST_POLL_LIMIT_MS) &&
			      line[0] == 'G',
		      "helper: %s", line);
}

START_TEST(test_killed_holder_frees_the_key)
{
	kl_provider *p = open_pg(NULL);
	const char *key = new_key("killed");
	int rounds = (int)kl_test_scaled(50, 10);
	struct test_helper hp;
	struct waiter *w;
	int64_t killed;

	/* TESTPLAN T24 (a), 50 rounds: the kernel closes a dead holder's
	 * socket and the server ends its session at once. */
	for (int i = 0; i < rounds; i++) {
		holder_start(&hp, g_uri, key);
		w = waiter_start(p, key, WAIT_BOUND_MS, NULL, false, NULL);
		wait_status(p, key, 1, 1);
		killed = now_ns();
		kill(hp.pid, SIGKILL);
		waiter_join(w);
		ck_assert_msg(w->rc == KL_OK, "%s: %s", kl_strerror(w->rc),
			      w->err.message);
		ck_assert_msg(w->end_ns - killed < 1000000000LL,
			      "round %d: granted %lld ms after the kill", i,
			      (long long)((w->end_ns - killed) / 1000000));
		helper_reap(&hp, 10000);
		waiter_free(w);
	}
	wait_server_locks(key, 0, 0);
	kl_provider_free(p);
}
END_TEST

START_TEST(test_stopped_holder_and_idle_session_timeout)
{
	kl_provider *p = open_pg(NULL);
	const char *key = new_key("stopped");
	char uri[1024];
	struct test_helper hp;
	struct waiter *w;
	int64_t stopped;

	/* TESTPLAN T24 (b): a holder that stops without dying keeps its
	 * session, unless the server ends idle sessions.  Its health checks
	 * (every 500 ms) keep a live holder's session busy enough. */
	uri_with(uri, sizeof uri, g_uri,
		 "options=-c%20idle_session_timeout%3D2000&"
		 "health_interval=500ms");
	holder_start(&hp, uri, key);
	test_sleep_ms(3000); /* longer than idle_session_timeout */
	wait_status(p, key, 1, 0);
	w = waiter_start(p, key, WAIT_BOUND_MS, NULL, false, NULL);
	wait_status(p, key, 1, 1);
	stopped = now_ns();
	kill(hp.pid, SIGSTOP);
	waiter_join(w);
	kill(hp.pid, SIGKILL);
	kill(hp.pid, SIGCONT);
	helper_reap(&hp, 10000);
	ck_assert_msg(w->rc == KL_OK, "%s: %s", kl_strerror(w->rc),
		      w->err.message);
	ck_assert_msg(w->end_ns - stopped < 3000000000LL,
		      "granted %lld ms after the stop",
		      (long long)((w->end_ns - stopped) / 1000000));
	waiter_free(w);
	wait_server_locks(key, 0, 0);
	kl_provider_free(p);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Lost sessions                                                       */

START_TEST(test_terminated_backend_loses_the_lease)
{
	char extra[64];
	kl_provider *p;
	const char *key = new_key("terminate");
	struct test_events ev;
	struct hold h;
	kl_error err;
	char sql[128];
	long long pid;
	int64_t t0, took;
	int rc;

	tev_init(&ev);
	snprintf(extra, sizeof extra, "health_interval=%dms", HEALTH_MS);
	p = open_pg(extra);
	rc = take_ev(p, key, WAIT_BOUND_MS, NULL, 0, &ev, &h, &err);
	ck_assert_msg(rc == KL_OK, "%s: %s", kl_strerror(rc), err.message);
	ck_assert_int_eq(tev_count(&ev, KL_EV_ACQUIRED), 1);
	pid = holder_pid(key);
	ck_assert_int_gt(pid, 0);
	snprintf(sql, sizeof sql, "SELECT pg_terminate_backend(%lld)::int",
		 pid);
	t0 = now_ms();
	ck_assert_int_eq(admin_int(sql), 1);
	while (kl_lease_valid(h.lease)) {
		ck_assert_msg(now_ms() - t0 < 10 * HEALTH_MS + 3000,
			      "lease still valid");
		test_sleep_ms(5);
	}
	took = now_ms() - t0;
	/* One health interval, plus the time to notice, on a loaded box. */
	ck_assert_msg(took <= HEALTH_MS + 1500, "lost after %lld ms",
		      (long long)took);
	ck_assert_msg(tev_wait(&ev, KL_EV_LOST, TEST_POLL_LIMIT_MS) > 0,
		      "no KL_EV_LOST");
	ck_assert_int_eq(tev_count(&ev, KL_EV_LOST), 1);
	ck_assert_int_eq(ev.status_of[KL_EV_LOST], KL_EPROVIDER);
	wait_server_locks(key, 0, 0);
	/* Releasing what is no longer held is reported, and harmless. */
	drop(&h);
	ck_assert_int_eq(tev_count(&ev, KL_EV_RELEASE_FAILED), 1);
	ck_assert_int_eq(ev.status_of[KL_EV_RELEASE_FAILED], KL_EPROVIDER);
	ck_assert_int_eq(tev_count(&ev, KL_EV_RELEASED), 0);
	ck_assert_int_eq(tev_count(&ev, KL_EV_LOST), 1);
	/* The key is free, and the provider works on. */
	take_ok(p, key, &h);
	ck_assert(kl_lease_valid(h.lease));
	drop(&h);
	kl_provider_free(p);
}
END_TEST

START_TEST(test_dead_idle_connection_replaced)
{
	char extra[96], sql[256];
	const char *key = new_key("idle");
	kl_provider *p;
	struct hold h;
	long long n;

	snprintf(extra, sizeof extra, "application_name=kl-idle-%d",
		 (int)getpid());
	p = open_pg(extra);
	take_ok(p, key, &h);
	drop(&h);
	/* The pooled connection (and the status one) die while idle. */
	snprintf(sql, sizeof sql,
		 "SELECT count(pg_terminate_backend(pid)) FROM "
		 "pg_stat_activity WHERE application_name = 'kl-idle-%d'",
		 (int)getpid());
	n = admin_int(sql);
	ck_assert_int_ge(n, 1);
	take_ok(p, key, &h);
	ck_assert(kl_lease_valid(h.lease));
	drop(&h);
	wait_status(p, key, 0, 0);
	kl_provider_free(p);
}
END_TEST

START_TEST(test_timeout_bound_t24d)
{
	kl_provider *p = open_pg(NULL);
	const char *key = new_key("t24d");
	struct test_events ev;
	struct hold h, h2;
	kl_error err;
	long long g, w, holder;
	int64_t t0, took, worst = 0;
	int rc;

	tev_init(&ev);
	/* TESTPLAN T24 (d): a waiter with timeout 500 ms on a held key gets
	 * KL_ETIMEDOUT within 500 + 100 ms and leaves nothing on the server:
	 * pg_locks shows the holder's lock and no waiting entry.  Three
	 * rounds, the first on a new connection, the others on the one the
	 * timed-out wait gave back to the pool. */
	take_ok(p, key, &h);
	holder = holder_pid(key);
	for (int i = 0; i < 3; i++) {
		t0 = now_ms();
		rc = take_ev(p, key, 500, NULL, 0, &ev, &h2, &err);
		took = now_ms() - t0;
		ck_assert_msg(rc == KL_ETIMEDOUT, "round %d: %s: %s", i,
			      kl_strerror(rc), err.message);
		ck_assert_int_eq(err.status, KL_ETIMEDOUT);
		ck_assert_msg(took >= 490, "round %d: timed out after %lld ms",
			      i, (long long)took);
		if (took > worst)
			worst = took;
		server_locks(key, &g, &w);
		ck_assert_int_eq(g, 1);
		ck_assert_int_eq(w, 0);
		ck_assert_int_eq(holder_pid(key), holder);
	}
	ck_assert_msg(worst <= 600, "KL_ETIMEDOUT after %lld ms (bound 600)",
		      (long long)worst);
	ck_assert_int_eq(tev_count(&ev, KL_EV_REJECTED), 3);
	ck_assert_int_eq(ev.status_of[KL_EV_REJECTED], KL_ETIMEDOUT);
	ck_assert_int_eq(tev_count(&ev, KL_EV_ACQUIRED), 0);
	drop(&h);
	/* Nothing left for that key once the holder is gone. */
	wait_server_locks(key, 0, 0);
	kl_provider_free(p);
}
END_TEST

START_TEST(test_release_not_held_t24e)
{
	kl_provider *p = open_pg("health_interval=1h");
	const char *key = new_key("t24e");
	struct test_events ev;
	struct hold h;
	kl_error err;
	char sql[128];
	long long pid;
	int rc;

	tev_init(&ev);
	/* TESTPLAN T24 (e): release of a key the session no longer holds,
	 * before any health check could notice (health_interval 1h): the
	 * server ended the session under the lease.  KL_EV_RELEASE_FAILED
	 * with KL_EPROVIDER, no KL_EV_RELEASED, no crash, and the provider
	 * works on. */
	rc = take_ev(p, key, WAIT_BOUND_MS, NULL, 0, &ev, &h, &err);
	ck_assert_msg(rc == KL_OK, "%s: %s", kl_strerror(rc), err.message);
	pid = holder_pid(key);
	ck_assert_int_gt(pid, 0);
	snprintf(sql, sizeof sql, "SELECT pg_terminate_backend(%lld)::int",
		 pid);
	ck_assert_int_eq(admin_int(sql), 1);
	wait_server_locks(key, 0, 0);
	ck_assert(kl_lease_valid(h.lease)); /* not checked yet */
	drop(&h);
	ck_assert_int_eq(tev_count(&ev, KL_EV_RELEASE_FAILED), 1);
	ck_assert_int_eq(ev.status_of[KL_EV_RELEASE_FAILED], KL_EPROVIDER);
	ck_assert_int_eq(tev_count(&ev, KL_EV_RELEASED), 0);
	/* The broken connection was not put back: the next calls work. */
	for (int i = 0; i < 3; i++) {
		take_ok(p, key, &h);
		ck_assert(kl_lease_valid(h.lease));
		drop(&h);
	}
	wait_status(p, key, 0, 0);
	kl_provider_free(p);
}
END_TEST

/* ------------------------------------------------------------------ */
/* The fence sequence (issue 16, items 9 and 10)                       */

/*
 * Two roles, each with a schema of its own (CREATE SCHEMA AUTHORIZATION,
 * the default search_path "$user", public) and there a keylock_fence left
 * by an older version, share one fence sequence: public.keylock_fence, by
 * its schema-qualified name.  Fences alternate between the roles and must
 * grow strictly (resolved through search_path, each role had a sequence
 * of its own: fence 1 twice).  Then what open refuses, naming the
 * sequence: one the role cannot create, a table, one without USAGE or
 * UPDATE, one with CACHE 10; and a name that needs quoting.
 */
START_TEST(test_roles_share_one_fence_sequence)
{
	char db[48], ra[48], rb[48], sql[1024], ua[1024], ub[1024], base[1024],
		msg[400];
	const char *key = new_key("roles");
	struct {
		const char *extra, *want;
	} refused[] = {
		{ "fence_sequence=public.kl_missing", "cannot create" },
		{ "fence_sequence=public.kl_table", "not a sequence" },
		{ "fence_sequence=public.kl_nogrant", "USAGE" },
		{ "fence_sequence=public.kl_usage", "UPDATE" },
		{ "fence_sequence=public.kl_cached", "CACHE 1" },
	};
	kl_provider *pa, *pb;
	struct hold h;
	uint64_t last = 0, f;
	PGconn *dbc;

	snprintf(db, sizeof db, "kl_roles_%d", (int)getpid());
	snprintf(ra, sizeof ra, "kl_role_a_%d", (int)getpid());
	snprintf(rb, sizeof rb, "kl_role_b_%d", (int)getpid());
	snprintf(sql, sizeof sql, "DROP DATABASE IF EXISTS %s", db);
	exec_ok(g_admin, sql);
	snprintf(sql, sizeof sql, "DROP ROLE IF EXISTS %s, %s", ra, rb);
	exec_ok(g_admin, sql);
	snprintf(sql, sizeof sql, "CREATE ROLE %s LOGIN", ra);
	exec_ok(g_admin, sql);
	snprintf(sql, sizeof sql, "CREATE ROLE %s LOGIN", rb);
	exec_ok(g_admin, sql);
	snprintf(sql, sizeof sql, "CREATE DATABASE %s", db);
	exec_ok(g_admin, sql);
	uri_user_db(base, sizeof base, g_uri, "postgres", db, NULL);
	dbc = PQconnectdb(base);
	ck_assert_msg(PQstatus(dbc) == CONNECTION_OK, "%s",
		      PQerrorMessage(dbc));
	/* PostgreSQL 15's default, made explicit for older servers. */
	exec_ok(dbc, "REVOKE CREATE ON SCHEMA public FROM PUBLIC");
	snprintf(sql, sizeof sql,
		 "CREATE SCHEMA AUTHORIZATION %s; CREATE SCHEMA AUTHORIZATION "
		 "%s; SET ROLE %s; CREATE SEQUENCE keylock_fence; RESET ROLE; "
		 "SET ROLE %s; CREATE SEQUENCE keylock_fence; RESET ROLE",
		 ra, rb, ra, rb);
	exec_ok(dbc, sql);
	snprintf(sql, sizeof sql,
		 "CREATE SEQUENCE public.keylock_fence; GRANT USAGE, UPDATE "
		 "ON SEQUENCE public.keylock_fence TO %s, %s",
		 ra, rb);
	exec_ok(dbc, sql);

	uri_user_db(ua, sizeof ua, g_uri, ra, db, NULL);
	uri_user_db(ub, sizeof ub, g_uri, rb, db, NULL);
	pa = open_with(ua, NULL);
	pb = open_with(ub, NULL);
	for (int i = 0; i < 40; i++) {
		take_ok(i % 2 == 0 ? pa : pb, key, &h);
		f = kl_lease_fence(h.lease);
		drop(&h);
		ck_assert_msg(f > last,
			      "grant %d (role %s): fence %" PRIu64
			      " after %" PRIu64,
			      i, i % 2 == 0 ? "a" : "b", f, last);
		last = f;
	}
	ck_assert_int_ge(int_on(dbc, "SELECT last_value FROM "
				     "public.keylock_fence"),
			 (long long)last);
	kl_provider_free(pa);
	kl_provider_free(pb);

	/* Refusals: KL_EPROVIDER naming the sequence and the fix. */
	snprintf(sql, sizeof sql,
		 "CREATE TABLE public.kl_table (); "
		 "CREATE SEQUENCE public.kl_nogrant; "
		 "CREATE SEQUENCE public.kl_usage; "
		 "GRANT USAGE ON SEQUENCE public.kl_usage TO %s; "
		 "CREATE SEQUENCE public.kl_cached CACHE 10; "
		 "GRANT USAGE, UPDATE ON SEQUENCE public.kl_cached TO %s",
		 rb, rb);
	exec_ok(dbc, sql);
	for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++) {
		uri_user_db(ub, sizeof ub, g_uri, rb, db, refused[i].extra);
		open_fails(ub, KL_EPROVIDER, 10000, msg, sizeof msg);
		printf("refused: %s\n", msg);
		ck_assert_msg(strstr(msg, strchr(refused[i].extra, '=') + 1) !=
					      NULL &&
				      strstr(msg, refused[i].want) != NULL,
			      "%s: %s", refused[i].extra, msg);
	}
	/* Never created where the role could: its own schema. */
	ck_assert_int_eq(int_on(dbc, "SELECT count(*) FROM pg_class WHERE "
				     "relname = 'kl_missing'"),
			 0);
	uri_user_db(ub, sizeof ub, g_uri, rb, db, "fence_sequence=nodot");
	open_fails(ub, KL_EINVAL, 1000, msg, sizeof msg);

	/* A name that needs quoting: schema <kl "Odd' S>, sequence
	 * <Fe.nce> (split at the first dot). */
	snprintf(sql, sizeof sql,
		 "CREATE SCHEMA \"kl \"\"Odd' S\"; GRANT USAGE ON SCHEMA "
		 "\"kl \"\"Odd' S\" TO %s; CREATE SEQUENCE "
		 "\"kl \"\"Odd' S\".\"Fe.nce\"; GRANT USAGE, UPDATE ON "
		 "SEQUENCE \"kl \"\"Odd' S\".\"Fe.nce\" TO %s",
		 ra, ra);
	exec_ok(dbc, sql);
	uri_user_db(ua, sizeof ua, g_uri, ra, db,
		    "fence_sequence=kl%20%22Odd'%20S.Fe.nce");
	pa = open_with(ua, NULL);
	take_ok(pa, key, &h);
	f = kl_lease_fence(h.lease);
	drop(&h);
	kl_provider_free(pa);
	ck_assert_int_eq(int_on(dbc, "SELECT last_value FROM "
				     "\"kl \"\"Odd' S\".\"Fe.nce\""),
			 (long long)f);

	PQfinish(dbc);
	snprintf(sql, sizeof sql, "DROP DATABASE %s WITH (FORCE)", db);
	exec_ok(g_admin, sql);
	snprintf(sql, sizeof sql, "DROP ROLE %s, %s", ra, rb);
	exec_ok(g_admin, sql);
}
END_TEST

/* A fence sequence dropped and created again while sessions that floored
 * the old one stay open: their next draw, 1, is below every fence before.
 * The provider refuses it (the session goes, and the key with it), and
 * the next session floors the new sequence. */
START_TEST(test_sequence_recreated_at_runtime)
{
	kl_provider *p;
	const char *key = new_key("recreated");
	struct hold h;
	kl_error err;
	uint64_t f1;
	int rc;

	exec_ok(g_admin, "DROP SEQUENCE IF EXISTS public.kl_recreated");
	p = open_pg("fence_sequence=public.kl_recreated&pool=1");
	take_ok(p, key, &h);
	f1 = kl_lease_fence(h.lease);
	drop(&h);
	exec_ok(g_admin, "DROP SEQUENCE public.kl_recreated");
	exec_ok(g_admin, "CREATE SEQUENCE public.kl_recreated");
	rc = take(p, key, WAIT_BOUND_MS, NULL, &h, &err);
	ck_assert_msg(rc != KL_OK || kl_lease_fence(h.lease) > f1,
		      "fence %" PRIu64 " after %" PRIu64,
		      kl_lease_fence(h.lease), f1);
	ck_assert_int_eq(rc, KL_EPROVIDER);
	ck_assert_msg(strstr(err.message, "went back") != NULL, "%s",
		      err.message);
	/* The backend ends soon after its connection closes. */
	wait_server_locks(key, 0, 0);
	take_ok(p, key, &h);
	ck_assert_uint_gt(kl_lease_fence(h.lease), f1);
	drop(&h);
	kl_provider_free(p);
	exec_ok(g_admin, "DROP SEQUENCE public.kl_recreated");
}
END_TEST

/*
 * A fence costs no WAL flush of its own (issue 16, item 10): 1280 grants
 * draw 40 WAL-logged sequence advances, and a commit that waited for each
 * would write the WAL 40 times.  Counted in pg_stat_wal.wal_write, which
 * also counts the WAL writer's rounds (at most one per wal_writer_delay)
 * and a little background work: allowed 8 plus two per wal_writer_delay
 * elapsed.  And the first fence of a new session is floored at the
 * server's clock in microseconds.
 */
START_TEST(test_fence_needs_no_wal_flush)
{
	char extra[96], app[48], sql[256];
	const char *key = new_key("wal");
	long long w0, w1, delay_ms, t0_us, allowed;
	int64_t t0, elapsed;
	kl_provider *p;
	struct hold h;
	uint64_t last = 0, f;

	delay_ms = admin_int("SELECT setting::bigint FROM pg_settings WHERE "
			     "name = 'wal_writer_delay'");
	snprintf(app, sizeof app, "kl-wal-%d", (int)getpid());
	snprintf(extra, sizeof extra, "application_name=%s&pool=1", app);
	t0_us = server_us();
	p = open_pg(extra);
	take_ok(p, key, &h);
	f = kl_lease_fence(h.lease);
	drop(&h);
	ck_assert_msg(f >= (uint64_t)t0_us,
		      "first fence %" PRIu64 " below the server clock %lld us",
		      f, t0_us);
	exec_ok(g_admin, "SELECT pg_stat_clear_snapshot()");
	w0 = admin_int("SELECT wal_write FROM pg_stat_wal");
	t0 = now_ms();
	for (int i = 0; i < 1280; i++) {
		take_ok(p, key, &h);
		f = kl_lease_fence(h.lease);
		drop(&h);
		ck_assert_msg(f > last, "fence %" PRIu64 " after %" PRIu64, f,
			      last);
		last = f;
	}
	elapsed = now_ms() - t0;
	kl_provider_free(p);
	/* A backend hands its counts over as it exits. */
	snprintf(sql, sizeof sql,
		 "SELECT count(*) FROM pg_stat_activity WHERE "
		 "application_name = '%s'",
		 app);
	t0 = now_ms();
	while (admin_int(sql) != 0) {
		ck_assert_msg(now_ms() - t0 < TEST_POLL_LIMIT_MS,
			      "the provider's backends did not exit");
		test_sleep_ms(10);
	}
	exec_ok(g_admin, "SELECT pg_stat_clear_snapshot()");
	w1 = admin_int("SELECT wal_write FROM pg_stat_wal");
	allowed = 8 + 2 * (elapsed / (delay_ms > 0 ? delay_ms : 200));
	printf("fence WAL writes: %lld for 1280 grants in %lld ms "
	       "(wal_writer_delay %lld ms, allowed %lld)\n",
	       w1 - w0, (long long)elapsed, delay_ms, allowed);
	ck_assert_msg(w1 - w0 <= allowed,
		      "%lld WAL writes for 1280 grants (allowed %lld)", w1 - w0,
		      allowed);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Failures to connect, bad URIs, secrets                              */

/* A TCP port of 127.0.0.1 that nothing listens on (just released). */
static int
closed_port(void)
{
	struct sockaddr_in a = { .sin_family = AF_INET };
	socklen_t len = sizeof a;
	int fd = socket(AF_INET, SOCK_STREAM, 0), port;

	ck_assert_int_ge(fd, 0);
	a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	ck_assert_int_eq(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
	ck_assert_int_eq(getsockname(fd, (struct sockaddr *)&a, &len), 0);
	port = ntohs(a.sin_port);
	close(fd);
	return port;
}

START_TEST(test_unreachable_server)
{
	char uri[256], msg[300], portstr[16];
	int port = closed_port();

	snprintf(uri, sizeof uri,
		 "postgresql://kl_user:canary-Pw-7781@127.0.0.1:%d/keylock",
		 port);
	open_fails(uri, KL_EPROVIDER, 3000, msg, sizeof msg);
	snprintf(portstr, sizeof portstr, "%d", port);
	ck_assert_msg(strstr(msg, "127.0.0.1") != NULL &&
			      strstr(msg, portstr) != NULL,
		      "message does not name the server: %s", msg);
	ck_assert_msg(strstr(msg, "canary-Pw-7781") == NULL,
		      "password in: %s", msg);
	/* TEST-NET-1: nothing answers (or the network is unreachable);
	 * connect_timeout bounds the attempt. */
	open_fails("postgresql://u:canary-Pw-7781@192.0.2.1:5432/"
		   "keylock?connect_timeout=2",
		   KL_EPROVIDER, 2000 + 2500, msg, sizeof msg);
	ck_assert_msg(strstr(msg, "canary-Pw-7781") == NULL,
		      "password in: %s", msg);
}
END_TEST

START_TEST(test_bad_uris)
{
	char msg[300];

	open_fails("postgresql://h/db?pool=0", KL_EINVAL, 1000, msg,
		   sizeof msg);
	open_fails("postgresql://h/db?pool=abc", KL_EINVAL, 1000, msg,
		   sizeof msg);
	open_fails("postgresql://h/db?pool=100000", KL_EINVAL, 1000, msg,
		   sizeof msg);
	open_fails("postgresql://h/db?health_interval=1ms", KL_EINVAL, 1000,
		   msg, sizeof msg);
	open_fails("postgresql://h/db?health_interval=soon", KL_EINVAL, 1000,
		   msg, sizeof msg);
	open_fails("postgresql://h/db?no_such_option=1", KL_EINVAL, 1000, msg,
		   sizeof msg);
	open_fails("postgresql://h/db?connect_timeout=x", KL_EINVAL, 1000, msg,
		   sizeof msg);
	/* fence_sequence is schema.name, each part 1 to 63 bytes. */
	open_fails("postgresql://h/db?fence_sequence=keylock_fence", KL_EINVAL,
		   1000, msg, sizeof msg);
	open_fails("postgresql://h/db?fence_sequence=public.", KL_EINVAL, 1000,
		   msg, sizeof msg);
	open_fails("postgresql://h/db?fence_sequence=.keylock_fence",
		   KL_EINVAL, 1000, msg, sizeof msg);
	open_fails("postgresql://h/db?fence_sequence=public.a%zz", KL_EINVAL,
		   1000, msg, sizeof msg);
	open_fails("postgresql://h/db?fence_sequence=public.a%00b", KL_EINVAL,
		   1000, msg, sizeof msg);
	open_fails("postgresql://h/db?fence_sequence=public."
		   "a123456789b123456789c123456789d123456789e123456789"
		   "f123456789abcd",
		   KL_EINVAL, 1000, msg, sizeof msg);
	/* A password libpq cannot decode is quoted in its message: masked. */
	open_fails("postgresql://u:canary%zzSecret@h/db", KL_EINVAL, 1000, msg,
		   sizeof msg);
	ck_assert_msg(strstr(msg, "canary") == NULL, "password in: %s", msg);
}
END_TEST

/* g_uri's server with user and password instead of its own. */
static void
uri_as(char *buf, size_t size, const char *base, const char *user,
       const char *password)
{
	const char *s = strstr(base, "://"), *at, *end;
	int n;

	ck_assert_ptr_nonnull(s);
	s += 3;
	end = s + strcspn(s, "/?");
	at = s;
	for (const char *q = s; q < end; q++)
		if (*q == '@')
			at = q + 1;
	n = snprintf(buf, size, "postgresql://%s:%s@%s", user, password, at);
	ck_assert(n > 0 && (size_t)n < size);
}

START_TEST(test_authentication_failures)
{
	char uri[1024], msg[300];
	const char *user, *pw;
	PQconninfoOption *o, *opts;
	kl_provider *p;

	/* A role that does not exist, with a password: refused, quickly,
	 * and the message names the server but not the password. */
	uri_as(uri, sizeof uri, g_uri, "kl_no_such_role", "canary-Pw-5512");
	open_fails(uri, KL_EPROVIDER, 3000, msg, sizeof msg);
	ck_assert_msg(strstr(msg, "canary-Pw-5512") == NULL, "password in: %s",
		      msg);
	if (g_auth_uri == NULL)
		return; /* no role with password authentication set up */

	/* The right password works and never shows in a message. */
	opts = PQconninfoParse(g_auth_uri, NULL);
	ck_assert_ptr_nonnull(opts);
	user = pw = NULL;
	for (o = opts; o->keyword != NULL; o++) {
		if (strcmp(o->keyword, "user") == 0)
			user = o->val;
		if (strcmp(o->keyword, "password") == 0)
			pw = o->val;
	}
	ck_assert_ptr_nonnull(user);
	ck_assert_ptr_nonnull(pw);
	p = open_with(g_auth_uri, NULL);
	kl_provider_free(p);
	/* The wrong password: KL_EPROVIDER saying "authentication", in
	 * well under a second on a local server. */
	uri_as(uri, sizeof uri, g_auth_uri, user, "canary-Wrong-9034");
	open_fails(uri, KL_EPROVIDER, 3000, msg, sizeof msg);
	ck_assert_msg(strstr(msg, "authentication") != NULL,
		      "not an authentication failure: %s", msg);
	ck_assert_msg(strstr(msg, "canary-Wrong-9034") == NULL,
		      "password in: %s", msg);
	ck_assert_msg(strstr(msg, pw) == NULL, "password in: %s", msg);
	/* The right password, a missing database: no password either. */
	{
		char base[1024];
		int n = snprintf(base, sizeof base, "%s", g_auth_uri);
		char *slash;

		ck_assert(n > 0 && (size_t)n < sizeof base);
		slash = strrchr(base, '/');
		ck_assert_ptr_nonnull(slash);
		snprintf(slash, sizeof base - (size_t)(slash - base),
			 "/kl_no_such_db");
		open_fails(base, KL_EPROVIDER, 3000, msg, sizeof msg);
		ck_assert_msg(strstr(msg, pw) == NULL, "password in: %s", msg);
	}
	PQconninfoFree(opts);
}
END_TEST

/*
 * sslmode=verify-full end to end (issue 16, item 11), against a server
 * with a certificate for 127.0.0.1 and localhost signed by a throwaway CA
 * (tools/test stage pg makes them: KEYLOCK_TEST_PG_SSL_CA, and
 * KEYLOCK_TEST_PG_SSL_WRONG_CA, a CA that signed nothing).  The sessions
 * of a provider that trusts the CA use TLS; one that trusts the other CA,
 * or reaches the server by a name the certificate does not carry, is
 * refused with KL_EPROVIDER saying why, and no password.
 */
START_TEST(test_tls_verify_full)
{
	const char *ca = getenv("KEYLOCK_TEST_PG_SSL_CA"),
		   *wrong = getenv("KEYLOCK_TEST_PG_SSL_WRONG_CA"),
		   *key = new_key("tls"), *base, *pw = "canary-Pw-4471";
	char extra[1200], app[48], sql[512], uri[2400], msg[400];
	kl_provider *p;
	struct hold h, h2;
	struct waiter *w;
	kl_cancel *c;
	kl_error err;
	int rc;

	if (ca == NULL || ca[0] == '\0' || wrong == NULL || wrong[0] == '\0') {
		printf("note: KEYLOCK_TEST_PG_SSL_CA or _WRONG_CA unset: the "
		       "TLS test is not run\n");
		return;
	}
	snprintf(app, sizeof app, "kl-tls-%d", (int)getpid());
	snprintf(extra, sizeof extra,
		 "sslmode=verify-full&sslrootcert=%s&application_name=%s", ca,
		 app);
	p = open_pg(extra);
	take_ok(p, key, &h);
	snprintf(sql, sizeof sql,
		 "SELECT count(*) FILTER (WHERE s.ssl) * 1000 + "
		 "count(*) FILTER (WHERE NOT s.ssl) FROM pg_stat_ssl s JOIN "
		 "pg_stat_activity a USING (pid) WHERE a.application_name = "
		 "'%s'",
		 app);
	ck_assert_int_eq(admin_int(sql), 2000); /* the lease's and aux */
	/* A wait timed out by the server, and one canceled by PQcancel
	 * (whose request goes on a connection of its own), over TLS. */
	rc = take(p, key, 200, NULL, &h2, &err);
	ck_assert_msg(rc == KL_ETIMEDOUT, "%s: %s", kl_strerror(rc),
		      err.message);
	ck_assert_int_eq(kl_cancel_new(&c), KL_OK);
	w = waiter_start(p, key, KL_FOREVER, c, false, NULL);
	wait_status(p, key, 1, 1);
	kl_cancel_fire(c);
	waiter_join(w);
	ck_assert_msg(w->rc == KL_ECANCELED, "%s: %s", kl_strerror(w->rc),
		      w->err.message);
	waiter_free(w);
	kl_cancel_free(c);
	drop(&h);
	wait_server_locks(key, 0, 0);
	take_ok(p, key, &h);
	ck_assert_int_eq(admin_int(sql) % 1000, 0); /* all TLS */
	drop(&h);
	kl_provider_free(p);

	/* The other CA: refused.  With the password-checked role when there
	 * is one, so that the URI carries a real password. */
	base = g_auth_uri != NULL ? g_auth_uri : g_uri;
	snprintf(extra, sizeof extra, "sslmode=verify-full&sslrootcert=%s",
		 wrong);
	uri_with(uri, sizeof uri, base, extra);
	open_fails(uri, KL_EPROVIDER, 10000, msg, sizeof msg);
	printf("wrong CA: %s\n", msg);
	ck_assert_msg(strstr(msg, "certificate") != NULL, "%s", msg);
	if (g_auth_uri != NULL) {
		PQconninfoOption *o = PQconninfoParse(g_auth_uri, NULL);

		ck_assert_ptr_nonnull(o);
		for (PQconninfoOption *q = o; q->keyword != NULL; q++)
			if (strcmp(q->keyword, "password") == 0 &&
			    q->val != NULL)
				ck_assert_msg(strstr(msg, q->val) == NULL,
					      "password in: %s", msg);
		PQconninfoFree(o);
	}
	uri_as(sql, sizeof sql, g_uri, "kl_user", pw);
	uri_with(uri, sizeof uri, sql, extra);
	open_fails(uri, KL_EPROVIDER, 10000, msg, sizeof msg);
	ck_assert_msg(strstr(msg, pw) == NULL, "password in: %s", msg);

	/* The right CA, a name the certificate does not carry (the address
	 * is 127.0.0.1 all the same). */
	snprintf(extra, sizeof extra,
		 "sslmode=verify-full&sslrootcert=%s&host=kl-not-in-cert."
		 "invalid&hostaddr=127.0.0.1",
		 ca);
	uri_with(uri, sizeof uri, g_uri, extra);
	open_fails(uri, KL_EPROVIDER, 10000, msg, sizeof msg);
	ck_assert_msg(strstr(msg, "kl-not-in-cert.invalid") != NULL, "%s",
		      msg);
}
END_TEST

/* ------------------------------------------------------------------ */
/* fork() (TESTPLAN T14, provider variant)                             */

START_TEST(test_fork_child_opens_its_own_sessions)
{
	char extra[128], app[48], sql[1024], mine[512], left[512];
	const char *key = new_key("fork"), *ckey = new_key("forkchild");
	int ops = (int)kl_test_scaled(1000, 100), ctl[2], rep[2], status;
	long long child_backend;
	uint64_t last = 0, f;
	kl_provider *p;
	struct hold h;
	size_t hs, ws;
	char c = 0;
	pid_t pid;

	/* The parent has an idle pooled connection and the status one when
	 * it forks.  A child that uses the inherited provider must open
	 * sessions of its own (a pid check), never write on the parent's,
	 * not even the Terminate message of PQfinish: the parent's backends
	 * outlive the child, and its next ops are fine.  health_interval
	 * 1h: the health thread holds no lock at the fork. */
	snprintf(app, sizeof app, "kl-fork-%d", (int)getpid());
	snprintf(extra, sizeof extra, "application_name=%s&"
		 "health_interval=1h", app);
	p = open_pg(extra);
	take_ok(p, key, &h);
	last = kl_lease_fence(h.lease);
	drop(&h);
	wait_status(p, key, 0, 0);
	snprintf(sql, sizeof sql,
		 "SELECT coalesce(string_agg(pid::text, ',' ORDER BY pid), '')"
		 " FROM pg_stat_activity WHERE application_name = '%s'", app);
	admin_text(sql, mine, sizeof mine);
	ck_assert_msg(strchr(mine, ',') != NULL,
		      "expected two backends of the parent, got '%s'", mine);

	ck_assert_int_eq(pipe2(ctl, O_CLOEXEC), 0);
	ck_assert_int_eq(pipe2(rep, O_CLOEXEC), 0);
	pid = fork();
	ck_assert_int_ge(pid, 0);
	if (pid == 0) {
		struct hold ch;
		kl_error e;
		int r = take(p, ckey, 10000, NULL, &ch, &e);

		c = r == KL_OK ? 'G' : 'E';
		if (write(rep[1], &c, 1) != 1)
			_exit(3);
		if (r == KL_OK) {
			if (read(ctl[0], &c, 1) != 1)
				_exit(4);
			drop(&ch);
		}
		r = r == KL_OK ? kl_provider_status(p, ckey, &hs, &ws, &e)
			       : r;
		kl_provider_free(p);
		_exit(r == KL_OK ? 0 : 1);
	}
	test_live_add(pid);
	close(ctl[0]);
	close(rep[1]);
	ck_assert_int_eq(read(rep[0], &c, 1), 1);
	ck_assert_msg(c == 'G', "the child could not take '%s'", ckey);
	/* The child holds ckey on a backend the parent never had, made
	 * with the provider's parameters. */
	child_backend = holder_pid(ckey);
	ck_assert_int_gt(child_backend, 0);
	snprintf(sql, sizeof sql,
		 "SELECT count(*) FROM pg_stat_activity WHERE pid = %lld AND "
		 "application_name = '%s' AND %lld <> ALL "
		 "(string_to_array('%s', ',')::int[])",
		 child_backend, app, child_backend, mine);
	ck_assert_msg(admin_int(sql) == 1,
		      "the child's lock is on backend %lld (parent's: %s)",
		      child_backend, mine);
	ck_assert_int_eq(write(ctl[1], "g", 1), 1);
	close(ctl[1]);
	close(rep[0]);
	status = test_helper_reap(&(struct test_helper){ .pid = pid },
				  TEST_POLL_LIMIT_MS);
	ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0,
		      "child status 0x%x", (unsigned)status);
	/* The parent's backends are all still there, and only they. */
	wait_server_locks(ckey, 0, 0);
	snprintf(sql, sizeof sql,
		 "SELECT coalesce(string_agg(pid::text, ',' ORDER BY pid), '')"
		 " FROM pg_stat_activity WHERE application_name = '%s'", app);
	for (int64_t limit = now_ms() + TEST_POLL_LIMIT_MS;;) {
		admin_text(sql, left, sizeof left);
		if (strcmp(left, mine) == 0)
			break;
		ck_assert_msg(now_ms() < limit,
			      "backends before the fork: %s; after: %s", mine,
			      left);
		test_sleep_ms(5);
	}
	/* The parent's next ops, on its own connections. */
	for (int i = 0; i < ops; i++) {
		take_ok(p, key, &h);
		f = kl_lease_fence(h.lease);
		ck_assert_msg(f > last,
			      "op %d: fence %" PRIu64 " after %" PRIu64, i, f,
			      last);
		last = f;
		drop(&h);
	}
	wait_status(p, key, 0, 0);
	admin_text(sql, left, sizeof left);
	ck_assert_str_eq(left, mine);
	kl_provider_free(p);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Server restart (TESTPLAN T24 f)                                     */

/* KEYLOCK_TEST_PG_CTL, _DATA, _LOG and _OPTS (tools/test stage pg sets
 * them, and _RUNAS when it runs as root) let the suite stop and start the
 * server.  Without them the restart test is not run. */
static bool
restart_env(void)
{
	static const char *const names[] = {
		"KEYLOCK_TEST_PG_CTL", "KEYLOCK_TEST_PG_DATA",
		"KEYLOCK_TEST_PG_LOG", "KEYLOCK_TEST_PG_OPTS"
	};

	for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
		const char *v = getenv(names[i]);

		if (v == NULL || v[0] == '\0')
			return false;
	}
	return true;
}

/* pg_ctl -D DATA verb [-m immediate | -l LOG -o OPTS] -w, as the server's
 * user; its exit status, or -1 when it could not be run. */
static int
pg_ctl(const char *verb)
{
	const char *runas = getenv("KEYLOCK_TEST_PG_RUNAS");
	posix_spawn_file_actions_t fa;
	const char *argv[20];
	int n = 0, status;
	pid_t pid;

	if (runas != NULL && runas[0] != '\0') {
		argv[n++] = "runuser";
		argv[n++] = "-u";
		argv[n++] = runas;
		argv[n++] = "--";
	}
	argv[n++] = getenv("KEYLOCK_TEST_PG_CTL");
	argv[n++] = "-D";
	argv[n++] = getenv("KEYLOCK_TEST_PG_DATA");
	argv[n++] = "-w";
	argv[n++] = "-t";
	argv[n++] = "60";
	if (strcmp(verb, "stop") == 0) {
		argv[n++] = "-m";
		argv[n++] = "immediate";
	} else if (strcmp(verb, "start") == 0) {
		argv[n++] = "-l";
		argv[n++] = getenv("KEYLOCK_TEST_PG_LOG");
		argv[n++] = "-o";
		argv[n++] = getenv("KEYLOCK_TEST_PG_OPTS");
	}
	argv[n++] = verb;
	argv[n] = NULL;
	if (posix_spawn_file_actions_init(&fa) != 0)
		return -1;
	posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
	if (posix_spawnp(&pid, argv[0], &fa, NULL, (char *const *)argv,
			 environ) != 0) {
		posix_spawn_file_actions_destroy(&fa);
		return -1;
	}
	posix_spawn_file_actions_destroy(&fa);
	if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status))
		return -1;
	return WEXITSTATUS(status);
}

/* Unchecked teardown of the restart case, in the runner's process: the
 * server runs again whatever the test did (pg_ctl status: 3 when not
 * running), for the stage's later steps. */
static void
restart_teardown(void)
{
	if (restart_env() && pg_ctl("status") == 3 && pg_ctl("start") != 0)
		fprintf(stderr, "check_provider_pg: could not start the "
				"server again\n");
}

START_TEST(test_server_restart_t24f)
{
	static const int64_t down_timeouts[] = { 0, 300, 1000 };
	const char *key = new_key("t24f"), *other = new_key("t24f-other");
	struct test_events ev;
	struct waiter *w[2];
	struct hold h, h2;
	kl_provider *p;
	kl_error err;
	uint64_t fence;
	int64_t t0, took;
	size_t hs, ws;
	int rc;

	tev_init(&ev);
	if (!restart_env()) {
		printf("note: KEYLOCK_TEST_PG_CTL, _DATA, _LOG or _OPTS unset: "
		       "the server restart (T24 f) is not run\n");
		return;
	}
	/* TESTPLAN T24 (f): the server stops (-m immediate: no goodbye to
	 * the clients) while a lease is held and two calls wait.  Every call
	 * returns KL_EPROVIDER or a lease within its timeout + 100 ms, the
	 * lease is reported lost, and once the server is back the provider
	 * reconnects by itself. */
	p = open_pg("health_interval=200ms&connect_timeout=2");
	rc = take_ev(p, key, WAIT_BOUND_MS, NULL, 0, &ev, &h, &err);
	ck_assert_msg(rc == KL_OK, "%s: %s", kl_strerror(rc), err.message);
	fence = kl_lease_fence(h.lease);
	for (int i = 0; i < 2; i++) {
		w[i] = waiter_start(p, key, 5000, NULL, false, NULL);
		wait_status(p, key, 1, (size_t)i + 1);
	}
	ck_assert_int_eq(pg_ctl("stop"), 0);
	for (int i = 0; i < 2; i++) {
		waiter_join(w[i]);
		took = (w[i]->end_ns - w[i]->start_ns) / 1000000;
		ck_assert_msg(w[i]->rc == KL_EPROVIDER || w[i]->rc == KL_OK,
			      "waiter %d: %s: %s", i, kl_strerror(w[i]->rc),
			      w[i]->err.message);
		ck_assert_msg(took <= 5000 + 100, "waiter %d: %lld ms", i,
			      (long long)took);
	}
	/* While the server is down: tries, short and longer waits. */
	for (size_t i = 0; i < 3; i++) {
		t0 = now_ms();
		rc = take(p, other, down_timeouts[i], NULL, &h2, &err);
		took = now_ms() - t0;
		ck_assert_msg(rc == KL_EPROVIDER, "timeout %lld: %s: %s",
			      (long long)down_timeouts[i], kl_strerror(rc),
			      err.message);
		ck_assert_msg(took <= down_timeouts[i] + 100,
			      "timeout %lld: KL_EPROVIDER after %lld ms",
			      (long long)down_timeouts[i], (long long)took);
	}
	rc = kl_provider_status(p, other, &hs, &ws, &err);
	ck_assert_int_eq(rc, KL_EPROVIDER);
	/* The lease held before is reported lost. */
	t0 = now_ms();
	while (kl_lease_valid(h.lease)) {
		ck_assert_msg(now_ms() - t0 < TEST_POLL_LIMIT_MS,
			      "lease still valid");
		test_sleep_ms(5);
	}
	ck_assert_msg(tev_wait(&ev, KL_EV_LOST, TEST_POLL_LIMIT_MS) > 0,
		      "no KL_EV_LOST");
	ck_assert_int_eq(ev.status_of[KL_EV_LOST], KL_EPROVIDER);

	ck_assert_int_eq(pg_ctl("start"), 0);
	/* Reconnects: the key is free (the old session is gone), fences go
	 * on growing, status answers again. */
	rc = take(p, key, 5000, NULL, &h2, &err);
	ck_assert_msg(rc == KL_OK, "after the restart: %s: %s",
		      kl_strerror(rc), err.message);
	ck_assert(kl_lease_valid(h2.lease));
	ck_assert_msg(kl_lease_fence(h2.lease) > fence,
		      "fence %" PRIu64 " after the restart, %" PRIu64
		      " before",
		      kl_lease_fence(h2.lease), fence);
	wait_status(p, key, 1, 0);
	drop(&h2);
	/* Releasing the lost lease is reported, and harmless. */
	drop(&h);
	ck_assert_int_eq(tev_count(&ev, KL_EV_RELEASE_FAILED), 1);
	ck_assert_int_eq(tev_count(&ev, KL_EV_RELEASED), 0);
	ck_assert_int_eq(tev_count(&ev, KL_EV_LOST), 1);
	for (int i = 0; i < 2; i++)
		waiter_free(w[i]);
	take_ok(p, other, &h2);
	drop(&h2);
	wait_status(p, key, 0, 0);
	kl_provider_free(p);
}
END_TEST

/*
 * Fences grow across a crash of the server (issue 16, item 10): they are
 * drawn without waiting for a WAL flush, so the advances of the last
 * moments before pg_ctl stop -m immediate are lost (tools/test runs the
 * server with wal_writer_delay 10 s, so nothing flushes them), and the
 * sequence comes back behind fences already handed out.  The first
 * session after the restart floors it at the server's clock.
 */
START_TEST(test_fences_grow_across_a_crash)
{
	const char *key = new_key("crash");
	kl_provider *p;
	struct hold h;
	uint64_t last = 0, f;
	kl_error err;
	int rc;

	if (!restart_env()) {
		printf("note: KEYLOCK_TEST_PG_CTL, _DATA, _LOG or _OPTS unset: "
		       "the crash test is not run\n");
		return;
	}
	p = open_pg("connect_timeout=2");
	for (int i = 0; i < 200; i++) {
		take_ok(p, key, &h);
		f = kl_lease_fence(h.lease);
		drop(&h);
		ck_assert_msg(f > last, "fence %" PRIu64 " after %" PRIu64, f,
			      last);
		last = f;
	}
	PQfinish(g_admin);
	g_admin = NULL;
	ck_assert_int_eq(pg_ctl("stop"), 0);
	ck_assert_int_eq(pg_ctl("start"), 0);
	g_admin = PQconnectdb(g_uri);
	rc = take(p, key, 5000, NULL, &h, &err);
	ck_assert_msg(rc == KL_OK, "after the crash: %s: %s", kl_strerror(rc),
		      err.message);
	f = kl_lease_fence(h.lease);
	drop(&h);
	ck_assert_msg(f > last,
		      "fence %" PRIu64 " after the crash, %" PRIu64 " before",
		      f, last);
	kl_provider_free(p);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Lock modes (KL_SHARED), snapshot, deadlocks                         */

/* How many entries pg_locks has for key in mode, granted or waiting. */
static long long
server_mode_count(const char *key, const char *mode, bool granted)
{
	uint64_t id = (uint64_t)kl_pg_key_id(key, strlen(key));
	char sql[512];

	snprintf(sql, sizeof sql,
		 "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
		 "AND classid = %" PRIu32 "::bigint::text::oid AND objid = %" PRIu32
		 "::bigint::text::oid AND objsubid = 1 AND mode = '%s' AND %s",
		 (uint32_t)(id >> 32), (uint32_t)id, mode,
		 granted ? "granted" : "NOT granted");
	return admin_int(sql);
}

static int
take_mode(kl_provider *p, const char *key, int64_t timeout_ms, unsigned flags,
	  struct hold *h, kl_error *err)
{
	return take_ev(p, key, timeout_ms, NULL, flags, NULL, h, err);
}

static void
take_mode_ok(kl_provider *p, const char *key, int64_t timeout_ms,
	     unsigned flags, struct hold *h)
{
	kl_error err;
	int rc = take_mode(p, key, timeout_ms, flags, h, &err);

	ck_assert_msg(rc == KL_OK, "acquire '%s' (flags %u): %s: %s", key,
		      flags, kl_strerror(rc), err.message);
}

/* Releases what a joined waiter holds, keeping its record. */
static void
waiter_drop(struct waiter *w)
{
	if (w->h.lease != NULL)
		drop(&w->h);
}

/* A waiter that must have been granted: joined, KL_OK. */
static void
waiter_granted(struct waiter *w, const char *what)
{
	waiter_join(w);
	ck_assert_msg(w->rc == KL_OK, "%s: %s: %s", what, kl_strerror(w->rc),
		      w->err.message);
}

/* Shared requests are granted together, each with its own fence (the
 * later grant the larger), counted by status, shown as ShareLock; an
 * exclusive request is not grantable until every one has gone. */
START_TEST(test_shared_holders_together)
{
	kl_provider *p = open_pg(NULL);
	const char *key = new_key("shared");
	struct hold s1, s2, x;
	kl_error err;
	uint64_t f1, f2;
	int rc;

	take_mode_ok(p, key, 0, KL_SHARED, &s1);
	/* Timeout 0 (ifAvailable): grantable at once beside a shared
	 * holder. */
	take_mode_ok(p, key, 0, KL_SHARED, &s2);
	f1 = kl_lease_fence(s1.lease);
	f2 = kl_lease_fence(s2.lease);
	ck_assert_msg(f1 > 0 && f2 > f1, "fences %" PRIu64 ", %" PRIu64, f1,
		      f2);
	wait_status(p, key, 2, 0);
	ck_assert_int_eq(server_mode_count(key, "ShareLock", true), 2);
	rc = take_mode(p, key, 0, 0, &x, &err);
	ck_assert_msg(rc == KL_ETIMEDOUT, "%s", kl_strerror(rc));
	drop(&s1);
	rc = take_mode(p, key, 0, 0, &x, &err);
	ck_assert_msg(rc == KL_ETIMEDOUT, "%s", kl_strerror(rc));
	drop(&s2);
	take_mode_ok(p, key, 0, 0, &x);
	ck_assert_uint_gt(kl_lease_fence(x.lease), f2);
	ck_assert_int_eq(server_mode_count(key, "ExclusiveLock", true), 1);
	drop(&x);
	wait_server_locks(key, 0, 0);
	kl_provider_free(p);
}
END_TEST

/* A shared request never passes a queued exclusive one: not with a wait,
 * nor with timeout 0, though the key is held shared only. */
START_TEST(test_shared_waits_behind_queued_exclusive)
{
	kl_provider *p = open_pg(NULL);
	const char *key = new_key("nobarge");
	struct hold s1, s2, t;
	struct waiter *wx, *ws;
	uint64_t fs;
	kl_error err;
	int rc;

	take_mode_ok(p, key, 0, KL_SHARED, &s1);
	take_mode_ok(p, key, 0, KL_SHARED, &s2);
	fs = kl_lease_fence(s2.lease);
	wx = waiter_start_flags(p, key, WAIT_BOUND_MS, NULL, false, NULL, 0);
	wait_status(p, key, 2, 1);
	rc = take_mode(p, key, 0, KL_SHARED, &t, &err);
	ck_assert_msg(rc == KL_ETIMEDOUT, "a shared try passed a queued "
		      "exclusive request: %s", kl_strerror(rc));
	ws = waiter_start_flags(p, key, WAIT_BOUND_MS, NULL, false, NULL,
				KL_SHARED);
	wait_status(p, key, 2, 2);
	/* One shared holder left: the shared waiter still waits behind the
	 * exclusive one (else the state would be 2 holders, 1 waiter). */
	drop(&s1);
	wait_status(p, key, 1, 2);
	drop(&s2);
	waiter_granted(wx, "exclusive waiter");
	wait_status(p, key, 1, 1);
	ck_assert(!waiter_done(ws));
	ck_assert_uint_gt(wx->fence, fs);
	waiter_drop(wx);
	waiter_granted(ws, "shared waiter");
	ck_assert_uint_gt(ws->fence, wx->fence);
	waiter_free(wx);
	waiter_free(ws);
	wait_server_locks(key, 0, 0);
	kl_provider_free(p);
}
END_TEST

/* Queue [S, S, X, S] behind an exclusive holder: its release grants the
 * run of two shared requests together and stops at the exclusive one; the
 * shared one behind it comes last. */
START_TEST(test_shared_run_granted_together)
{
	kl_provider *p = open_pg(NULL);
	const char *key = new_key("run");
	const unsigned mode[4] = { KL_SHARED, KL_SHARED, 0, KL_SHARED };
	struct waiter *w[4];
	struct hold x;
	uint64_t fx;

	take_mode_ok(p, key, WAIT_BOUND_MS, 0, &x);
	fx = kl_lease_fence(x.lease);
	for (int i = 0; i < 4; i++) {
		w[i] = waiter_start_flags(p, key, WAIT_BOUND_MS, NULL, false,
					  NULL, mode[i]);
		wait_status(p, key, 1, (size_t)i + 1);
	}
	drop(&x);
	wait_status(p, key, 2, 2);
	waiter_granted(w[0], "shared 0");
	waiter_granted(w[1], "shared 1");
	ck_assert(!waiter_done(w[2]) && !waiter_done(w[3]));
	ck_assert_uint_gt(w[0]->fence, fx);
	ck_assert_uint_gt(w[1]->fence, fx);
	ck_assert_uint_ne(w[0]->fence, w[1]->fence);
	waiter_drop(w[0]);
	wait_status(p, key, 1, 2);
	ck_assert(!waiter_done(w[2]));
	waiter_drop(w[1]);
	waiter_granted(w[2], "exclusive 2");
	wait_status(p, key, 1, 1);
	ck_assert(!waiter_done(w[3]));
	ck_assert_uint_gt(w[2]->fence, w[0]->fence);
	ck_assert_uint_gt(w[2]->fence, w[1]->fence);
	waiter_drop(w[2]);
	waiter_granted(w[3], "shared 3");
	ck_assert_uint_gt(w[3]->fence, w[2]->fence);
	for (int i = 0; i < 4; i++)
		waiter_free(w[i]);
	wait_server_locks(key, 0, 0);
	kl_provider_free(p);
}
END_TEST

/* An exclusive waiter that leaves (cancelled; then timed out by the
 * server's lock_timeout) lets the shared request queued behind it join
 * the shared holder. */
START_TEST(test_exclusive_waiter_leaving_lets_shared_in)
{
	kl_provider *p = open_pg(NULL);
	const char *key = new_key("leave");
	struct waiter *wx, *ws, *wx2, *ws2;
	struct hold s;
	kl_cancel *c;

	take_mode_ok(p, key, 0, KL_SHARED, &s);
	ck_assert_int_eq(kl_cancel_new(&c), KL_OK);
	wx = waiter_start_flags(p, key, KL_FOREVER, c, false, NULL, 0);
	wait_status(p, key, 1, 1);
	ws = waiter_start_flags(p, key, WAIT_BOUND_MS, NULL, false, NULL,
				KL_SHARED);
	wait_status(p, key, 1, 2);
	kl_cancel_fire(c);
	waiter_join(wx);
	ck_assert_int_eq(wx->rc, KL_ECANCELED);
	waiter_granted(ws, "shared waiter behind a cancelled one");
	wait_status(p, key, 2, 0);

	/* The server's own timeout: 5 s, a hang guard more than a time
	 * bound (the shared request is queued long before). */
	wx2 = waiter_start_flags(p, key, 5000, NULL, false, NULL, 0);
	wait_status(p, key, 2, 1);
	ws2 = waiter_start_flags(p, key, WAIT_BOUND_MS, NULL, false, NULL,
				 KL_SHARED);
	wait_status(p, key, 2, 2);
	waiter_join(wx2);
	ck_assert_int_eq(wx2->rc, KL_ETIMEDOUT);
	waiter_granted(ws2, "shared waiter behind a timed-out one");
	wait_status(p, key, 3, 0);
	waiter_free(wx);
	waiter_free(wx2);
	waiter_free(ws);
	waiter_free(ws2);
	drop(&s);
	kl_cancel_free(c);
	wait_server_locks(key, 0, 0);
	kl_provider_free(p);
}
END_TEST

/* Fences over mixed grants: four concurrent shared holders each get a
 * distinct fence, all above the exclusive grant before them and below
 * the one after. */
START_TEST(test_fences_mixed_modes)
{
	kl_provider *p = open_pg(NULL);
	const char *key = new_key("mixfence");
	struct waiter *w[4];
	struct hold h;
	uint64_t last, max = 0;

	take_mode_ok(p, key, 0, 0, &h);
	last = kl_lease_fence(h.lease);
	drop(&h);
	for (int i = 0; i < 4; i++)
		w[i] = waiter_start_flags(p, key, WAIT_BOUND_MS, NULL, false,
					  NULL, KL_SHARED);
	for (int i = 0; i < 4; i++)
		waiter_granted(w[i], "concurrent shared holder");
	wait_status(p, key, 4, 0);
	for (int i = 0; i < 4; i++) {
		ck_assert_uint_gt(w[i]->fence, last);
		for (int j = 0; j < i; j++)
			ck_assert_uint_ne(w[i]->fence, w[j]->fence);
		if (w[i]->fence > max)
			max = w[i]->fence;
	}
	/* An exclusive request waits for all four. */
	for (int i = 0; i < 4; i++) {
		struct hold t;
		kl_error err;

		ck_assert_int_eq(take_mode(p, key, 0, 0, &t, &err),
				 KL_ETIMEDOUT);
		waiter_free(w[i]);
	}
	take_mode_ok(p, key, 0, 0, &h);
	ck_assert_uint_gt(kl_lease_fence(h.lease), max);
	last = kl_lease_fence(h.lease);
	drop(&h);
	take_mode_ok(p, key, 0, KL_SHARED, &h);
	ck_assert_uint_gt(kl_lease_fence(h.lease), last);
	drop(&h);
	kl_provider_free(p);
}
END_TEST

/* KL_ERRORCHECK in either mode: the holder asking again, shared or
 * exclusive, gets KL_EDEADLK; another thread may share. */
START_TEST(test_errorcheck_shared)
{
	kl_provider *p = open_pg(NULL);
	const char *key = new_key("errshared");
	struct hold h, h2;
	struct waiter *w;
	kl_error err;
	int rc;

	take_mode_ok(p, key, 0, KL_SHARED | KL_ERRORCHECK, &h);
	rc = take_mode(p, key, 0, KL_SHARED | KL_ERRORCHECK, &h2, &err);
	ck_assert_msg(rc == KL_EDEADLK, "%s: %s", kl_strerror(rc),
		      err.message);
	rc = take_mode(p, key, WAIT_BOUND_MS, KL_ERRORCHECK, &h2, &err);
	ck_assert_msg(rc == KL_EDEADLK, "%s: %s", kl_strerror(rc),
		      err.message);
	w = waiter_start_flags(p, key, 0, NULL, false, NULL,
			       KL_SHARED | KL_ERRORCHECK);
	waiter_granted(w, "another thread, shared");
	wait_status(p, key, 2, 0);
	waiter_free(w);
	drop(&h);
	/* An exclusive holder asked for it shared. */
	take_mode_ok(p, key, 0, KL_ERRORCHECK, &h);
	rc = take_mode(p, key, WAIT_BOUND_MS, KL_SHARED | KL_ERRORCHECK, &h2,
		       &err);
	ck_assert_msg(rc == KL_EDEADLK, "%s: %s", kl_strerror(rc),
		      err.message);
	drop(&h);
	kl_provider_free(p);
}
END_TEST

#define SNAP_MAX 256

struct snap_entry {
	bool key_null, waiting, shared;
	size_t key_len, position;
	int64_t pid, tid, elapsed_ms;
	uint64_t fence;
	char detail[160];
};

struct snap {
	int n, calls, stop_after;
	struct snap_entry e[SNAP_MAX];
};

static int
snap_collect(const kl_lock_info *info, void *arg)
{
	struct snap *s = arg;
	struct snap_entry *e;

	s->calls++;
	if (s->n < SNAP_MAX) {
		e = &s->e[s->n++];
		e->key_null = info->key == NULL;
		e->key_len = info->key_len;
		e->waiting = info->waiting;
		e->shared = info->shared;
		e->position = info->position;
		e->pid = info->pid;
		e->tid = info->tid;
		e->elapsed_ms = info->elapsed_ms;
		e->fence = info->fence;
		snprintf(e->detail, sizeof e->detail, "%s",
			 info->detail != NULL ? info->detail : "");
	}
	return s->stop_after > 0 && s->calls >= s->stop_after;
}

/* The entries of key, in the order reported. */
static int
snap_of(const struct snap *s, const char *key, const struct snap_entry **out,
	int max)
{
	char prefix[64];
	int n = 0;

	snprintf(prefix, sizeof prefix, "advisory lock %" PRId64 " ",
		 kl_pg_key_id(key, strlen(key)));
	for (int i = 0; i < s->n; i++)
		if (strncmp(s->e[i].detail, prefix, strlen(prefix)) == 0 &&
		    n < max)
			out[n++] = &s->e[i];
	return n;
}

/* kl_provider_snapshot against known states: an exclusive holder of this
 * process, an exclusive and a shared waiter queued behind it, and a key
 * held shared by a session that is not the provider's. */
START_TEST(test_snapshot)
{
	kl_provider *p = open_pg(NULL);
	const char *key = new_key("snap"), *other = new_key("snapother");
	const struct snap_entry *e[8];
	struct snap *s = calloc(1, sizeof *s);
	struct waiter *wx, *ws;
	struct hold h;
	PGconn *f;
	char sql[128], want[64];
	kl_error err;
	int n;

	ck_assert_ptr_nonnull(s);
	take_mode_ok(p, key, 0, 0, &h);
	wx = waiter_start_flags(p, key, WAIT_BOUND_MS, NULL, false, NULL, 0);
	wait_status(p, key, 1, 1);
	ws = waiter_start_flags(p, key, WAIT_BOUND_MS, NULL, false, NULL,
				KL_SHARED);
	wait_status(p, key, 1, 2);
	f = PQconnectdb(g_uri);
	ck_assert_msg(PQstatus(f) == CONNECTION_OK, "%s", PQerrorMessage(f));
	snprintf(sql, sizeof sql, "SELECT pg_advisory_lock_shared(%" PRId64 ")",
		 kl_pg_key_id(other, strlen(other)));
	exec_ok(f, sql);

	memset(&err, 0, sizeof err);
	ck_assert_msg(kl_provider_snapshot(p, snap_collect, s, &err) == KL_OK,
		      "%s", err.message);
	n = snap_of(s, key, e, 8);
	ck_assert_int_eq(n, 3);
	for (int i = 0; i < 3; i++) {
		ck_assert(e[i]->key_null);
		ck_assert_uint_eq(e[i]->key_len, 0);
		ck_assert_int_eq(e[i]->pid, (int64_t)getpid());
	}
	ck_assert(!e[0]->waiting && !e[0]->shared);
	ck_assert_int_eq(e[0]->tid, (int64_t)syscall(SYS_gettid));
	ck_assert_uint_eq(e[0]->fence, kl_lease_fence(h.lease));
	ck_assert_int_ge(e[0]->elapsed_ms, 0);
	ck_assert_uint_eq(e[0]->position, 0);
	snprintf(want, sizeof want, "server process %lld", holder_pid(key));
	ck_assert_msg(strstr(e[0]->detail, want) != NULL, "%s", e[0]->detail);
	ck_assert(e[1]->waiting && !e[1]->shared);
	ck_assert_int_eq(e[1]->tid, atomic_load(&wx->tid));
	ck_assert_uint_eq(e[1]->fence, 0);
	ck_assert_uint_eq(e[1]->position, 0);
	ck_assert(e[2]->waiting && e[2]->shared);
	ck_assert_int_eq(e[2]->tid, atomic_load(&ws->tid));
	ck_assert_uint_eq(e[2]->position, 1);

	/* Another session's lock: its server process, no thread, no
	 * fence. */
	n = snap_of(s, other, e, 8);
	ck_assert_int_eq(n, 1);
	ck_assert(!e[0]->waiting && e[0]->shared && e[0]->key_null);
	ck_assert_int_eq(e[0]->pid, (int64_t)PQbackendPID(f));
	ck_assert_int_eq(e[0]->tid, 0);
	ck_assert_uint_eq(e[0]->fence, 0);

	/* A non-zero return stops the walk. */
	memset(s, 0, sizeof *s);
	s->stop_after = 1;
	ck_assert_int_eq(kl_provider_snapshot(p, snap_collect, s, &err),
			 KL_OK);
	ck_assert_int_eq(s->calls, 1);

	PQfinish(f);
	drop(&h);
	waiter_granted(wx, "exclusive waiter");
	waiter_free(wx);
	waiter_granted(ws, "shared waiter");
	waiter_free(ws);
	wait_server_locks(key, 0, 0);
	free(s);
	kl_provider_free(p);
}
END_TEST

/*
 * The server's deadlock_detected (40P01) is KL_EDEADLK naming the key.
 * The provider's own sessions never form a cycle (each waits for one key
 * holding nothing, the man page says so), so this builds one with a
 * session of the test: it holds the fence sequence's floor lock
 * (src/pg/pg_fence.c) and waits for the key right behind the provider's
 * waiter, which, once granted, waits for the floor lock to draw its
 * fence.  The test session's deadlock_timeout is an hour, so the
 * provider's session is the one that finds the cycle and gives way.
 */
START_TEST(test_server_deadlock_is_edeadlk)
{
	kl_provider *p = open_pg(NULL);
	const char *key = new_key("deadlock");
	int64_t id = kl_pg_key_id(key, strlen(key));
	PGconn *holder, *t;
	PGresult *r;
	struct waiter *w;
	char sql[128];
	bool ok = false;

	holder = PQconnectdb(g_uri);
	t = PQconnectdb(g_uri);
	ck_assert(PQstatus(holder) == CONNECTION_OK &&
		  PQstatus(t) == CONNECTION_OK);
	snprintf(sql, sizeof sql, "SELECT pg_advisory_lock(%" PRId64 ")", id);
	exec_ok(holder, sql);
	w = waiter_start(p, key, WAIT_BOUND_MS, NULL, false, NULL);
	wait_server_locks(key, 1, 1);
	exec_ok(t, "SET deadlock_timeout = '1h'");
	exec_ok(t, "BEGIN");
	exec_ok(t, "SELECT pg_advisory_xact_lock(1802266213, 1851999521)");
	ck_assert(PQsendQuery(t, sql) == 1);
	wait_server_locks(key, 1, 2);
	snprintf(sql, sizeof sql, "SELECT pg_advisory_unlock(%" PRId64 ")",
		 id);
	exec_ok(holder, sql);
	waiter_join(w);
	ck_assert_msg(w->rc == KL_EDEADLK, "%s: %s", kl_strerror(w->rc),
		      w->err.message);
	ck_assert_msg(strstr(w->err.message, key) != NULL &&
			      strstr(w->err.message, "deadlock") != NULL,
		      "%s", w->err.message);
	/* The victim kept nothing: the test session got the key. */
	while ((r = PQgetResult(t)) != NULL) {
		ok = ok || PQresultStatus(r) == PGRES_TUPLES_OK;
		PQclear(r);
	}
	ck_assert(ok);
	exec_ok(t, "COMMIT");
	wait_server_locks(key, 1, 0);
	ck_assert_int_eq(holder_pid(key), PQbackendPID(t));
	exec_ok(t, sql);
	wait_server_locks(key, 0, 0);
	waiter_free(w);
	PQfinish(t);
	PQfinish(holder);
	kl_provider_free(p);
}
END_TEST

struct cross {
	kl_provider *p;
	const char *mine, *theirs;
	atomic_int *ready;
	int rc_mine, rc_theirs;
	pthread_t th;
	atomic_bool done;
};

static void *
cross_main(void *arg)
{
	struct cross *x = arg;
	struct hold a, b;
	kl_error err;

	x->rc_mine = take(x->p, x->mine, WAIT_BOUND_MS, NULL, &a, &err);
	atomic_fetch_add(x->ready, 1);
	while (atomic_load(x->ready) < 2)
		test_sleep_ms(2);
	if (x->rc_mine == KL_OK) {
		x->rc_theirs = take(x->p, x->theirs, 3000, NULL, &b, &err);
		/* Held until both waits have ended, so that neither ends
		 * by the other's giving up. */
		atomic_fetch_add(x->ready, 1);
		while (atomic_load(x->ready) < 4)
			test_sleep_ms(2);
		if (x->rc_theirs == KL_OK)
			drop(&b);
		drop(&a);
	} else {
		atomic_fetch_add(x->ready, 1);
	}
	atomic_store(&x->done, true);
	return NULL;
}

static bool
cross_done(void *arg)
{
	return atomic_load(&((struct cross *)arg)->done);
}

/* The limitation kl_pg_provider_open(3) documents: two threads of one
 * provider, each holding one key and waiting for the other's, wait on
 * four sessions, none of which holds what it waits for behind another
 * that waits, so the server sees no cycle: both waits end by timeout,
 * neither with KL_EDEADLK. */
START_TEST(test_client_cycle_not_seen_by_server)
{
	kl_provider *p = open_pg(NULL);
	const char *a = new_key("cycleA"), *b = new_key("cycleB");
	atomic_int ready = 0;
	struct cross x[2] = { { .p = p, .mine = a, .theirs = b },
			      { .p = p, .mine = b, .theirs = a } };

	for (int i = 0; i < 2; i++) {
		x[i].ready = &ready;
		atomic_init(&x[i].done, false);
		test_thread_start(&x[i].th, cross_main, &x[i]);
	}
	for (int i = 0; i < 2; i++) {
		test_poll(cross_done, &x[i], "a crossing thread");
		test_thread_join(x[i].th);
		ck_assert_int_eq(x[i].rc_mine, KL_OK);
		ck_assert_msg(x[i].rc_theirs == KL_ETIMEDOUT, "%s",
			      kl_strerror(x[i].rc_theirs));
	}
	wait_server_locks(a, 0, 0);
	wait_server_locks(b, 0, 0);
	kl_provider_free(p);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Key sets (issue 18): a property of the Lock strategy over PostgreSQL */

/* Clients (each its own provider, so its own sessions) taking the same
 * three keys as sets, each given them in another order (two exactly
 * opposite), all finish, every round once and none two at a time.  The
 * provider waits for each key on a session that holds nothing, so the
 * server sees no cycle: taken in the given order, two clients soon hold
 * one end each and wait for the other's until a round's 20 s timeout. */
START_TEST(test_set_orders_clients)
{
	enum { N = 4 };
	const char *keys[3] = { new_key("setA"), new_key("setB"),
				new_key("setC") };
	kl_provider *p[N];

	for (int i = 0; i < N; i++)
		p[i] = open_pg(NULL);
	test_sets_in_orders(p, N, keys, kl_test_scaled(20, 6));
	for (int i = 0; i < N; i++)
		kl_provider_free(p[i]);
	for (int k = 0; k < 3; k++)
		wait_server_locks(keys[k], 0, 0);
}
END_TEST

/* A set failing on its second key (canonical order) gives the first
 * back: the set waits out its deadline on the second, held by another
 * session; afterwards pg_locks shows no lock on the first key (granted
 * or waiting) and only the other session's on the second, the error names
 * the second key, and the events are one ACQUIRED and one RELEASED (the
 * first key) and one REJECTED. */
START_TEST(test_set_second_fails_releases_first)
{
	char k1[96], k2[96];
	const char *keys[2];
	kl_provider *p = open_pg(NULL), *q = open_pg(NULL);
	struct test_events ev;
	kl_lock *l = test_set_lock(p, 400, 0, &ev);
	kl_lease *lease = (kl_lease *)&lease;
	struct hold h;
	kl_error err;
	int rc;

	snprintf(k1, sizeof k1, "%s/1", new_key("set"));
	snprintf(k2, sizeof k2, "%.*s/2", (int)strlen(k1) - 2, k1);
	keys[0] = k2;
	keys[1] = k1;
	take_ok(q, k2, &h);
	wait_server_locks(k2, 1, 0);
	memset(&err, 0, sizeof err);
	rc = kl_lock_acquire_many(l, keys, 2, NULL, &lease, &err);
	ck_assert_msg(rc == KL_ETIMEDOUT, "set: %s: %s", kl_strerror(rc),
		      err.message);
	ck_assert_ptr_null(lease);
	ck_assert_msg(strstr(err.message, k2) != NULL, "message: %s",
		      err.message);
	ck_assert_int_eq(tev_count(&ev, KL_EV_ACQUIRED), 1);
	ck_assert_int_eq(tev_count(&ev, KL_EV_RELEASED), 1);
	ck_assert_int_eq(tev_count(&ev, KL_EV_REJECTED), 1);
	wait_server_locks(k1, 0, 0);
	wait_server_locks(k2, 1, 0);
	kl_lease_release(h.lease);
	kl_lock_free(h.l);
	wait_server_locks(k2, 0, 0);

	/* Now granted: both keys held, in the canonical order. */
	rc = kl_lock_acquire_many(l, keys, 2, NULL, &lease, &err);
	ck_assert_msg(rc == KL_OK, "set: %s: %s", kl_strerror(rc),
		      err.message);
	ck_assert_uint_eq(kl_lease_count(lease), 2);
	ck_assert_str_eq(kl_lease_key_at(lease, 0), k1);
	ck_assert_str_eq(kl_lease_key_at(lease, 1), k2);
	ck_assert_uint_gt(kl_lease_fence_at(lease, 0), 0);
	ck_assert_uint_gt(kl_lease_fence_at(lease, 1), 0);
	wait_server_locks(k1, 1, 0);
	wait_server_locks(k2, 1, 0);
	kl_lease_release(lease);
	wait_server_locks(k1, 0, 0);
	wait_server_locks(k2, 0, 0);
	kl_lock_free(l);
	kl_provider_free(p);
	kl_provider_free(q);
}
END_TEST

/* kl_lock_acquire_many in a thread of its own (test_bg). */
struct set_call {
	kl_lock *l;
	const char *const *keys;
	size_t n;
	int rc;
	kl_lease *lease;
	kl_error err;
};

static void
set_call_main(void *arg)
{
	struct set_call *c = arg;

	c->rc = kl_lock_acquire_many(c->l, c->keys, c->n, NULL, &c->lease,
				     &c->err);
}

/* The server's deadlock_detected (40P01) on a set's second key is the
 * set's KL_EDEADLK, naming that key, and the set keeps nothing: the
 * cycle is built as in test_server_deadlock_is_edeadlk (a test session
 * holding the fence sequence's floor lock waits for the key right behind
 * the provider's session), while the set already holds its first key;
 * afterwards pg_locks shows nothing on the first key. */
START_TEST(test_set_deadlock_releases_first)
{
	kl_provider *p = open_pg(NULL);
	char k1[96], k2[96], sql[128];
	const char *keys[2];
	struct set_call *c = calloc(1, sizeof *c);
	struct test_events ev;
	kl_lock *l = test_set_lock(p, WAIT_BOUND_MS, 0, &ev);
	struct test_bg bg;
	PGconn *holder, *t;
	PGresult *r;
	int64_t id;
	bool ok = false;

	ck_assert_ptr_nonnull(c);
	snprintf(k1, sizeof k1, "%s/1", new_key("setdl"));
	snprintf(k2, sizeof k2, "%.*s/2", (int)strlen(k1) - 2, k1);
	keys[0] = k2;
	keys[1] = k1;
	id = kl_pg_key_id(k2, strlen(k2));
	holder = PQconnectdb(g_uri);
	t = PQconnectdb(g_uri);
	ck_assert(PQstatus(holder) == CONNECTION_OK &&
		  PQstatus(t) == CONNECTION_OK);
	snprintf(sql, sizeof sql, "SELECT pg_advisory_lock(%" PRId64 ")", id);
	exec_ok(holder, sql);
	c->l = l;
	c->keys = keys;
	c->n = 2;
	c->rc = 1;
	test_bg_start(&bg, set_call_main, c);
	wait_server_locks(k1, 1, 0);
	wait_server_locks(k2, 1, 1);
	exec_ok(t, "SET deadlock_timeout = '1h'");
	exec_ok(t, "BEGIN");
	exec_ok(t, "SELECT pg_advisory_xact_lock(1802266213, 1851999521)");
	ck_assert(PQsendQuery(t, sql) == 1);
	wait_server_locks(k2, 1, 2);
	snprintf(sql, sizeof sql, "SELECT pg_advisory_unlock(%" PRId64 ")",
		 id);
	exec_ok(holder, sql);
	test_bg_join(&bg, "the set to end in the server's deadlock");
	ck_assert_msg(c->rc == KL_EDEADLK, "%s: %s", kl_strerror(c->rc),
		      c->err.message);
	ck_assert_msg(strstr(c->err.message, k2) != NULL &&
			      strstr(c->err.message, "deadlock") != NULL,
		      "%s", c->err.message);
	ck_assert_ptr_null(c->lease);
	ck_assert_int_eq(tev_count(&ev, KL_EV_ACQUIRED), 1);
	ck_assert_int_eq(tev_count(&ev, KL_EV_RELEASED), 1);
	ck_assert_int_eq(tev_count(&ev, KL_EV_REJECTED), 1);
	wait_server_locks(k1, 0, 0);
	while ((r = PQgetResult(t)) != NULL) {
		ok = ok || PQresultStatus(r) == PGRES_TUPLES_OK;
		PQclear(r);
	}
	ck_assert(ok);
	exec_ok(t, "COMMIT");
	wait_server_locks(k2, 1, 0);
	ck_assert_int_eq(holder_pid(k2), PQbackendPID(t));
	exec_ok(t, sql);
	wait_server_locks(k2, 0, 0);
	wait_server_locks(k1, 0, 0);
	PQfinish(t);
	PQfinish(holder);
	kl_lock_free(l);
	free(c);
	kl_provider_free(p);
}
END_TEST

static Suite *
provider_pg_suite(void)
{
	Suite *s = suite_create("provider_pg");
	TCase *tc;

	tc = tcase_create("basics");
	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_key_id_stable);
	tcase_add_test(tc, test_lock_shows_in_pg_locks);
	tcase_add_test(tc, test_binary_and_long_keys);
	tcase_add_test(tc, test_fence_strictly_increasing);
	suite_add_tcase(s, tc);

	tc = tcase_create("fence");
	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_set_timeout(tc, 120);
	tcase_add_test(tc, test_roles_share_one_fence_sequence);
	tcase_add_test(tc, test_sequence_recreated_at_runtime);
	tcase_add_test(tc, test_fence_needs_no_wal_flush);
	suite_add_tcase(s, tc);

	tc = tcase_create("waiting");
	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_try_once);
	tcase_add_test(tc, test_timeout_leaves_nothing);
	tcase_add_test(tc, test_timeout_bound_t24d);
	tcase_add_test(tc, test_cancel_from_another_thread);
	tcase_add_test(tc, test_cancel_token_timeout);
	tcase_add_test(tc, test_fifo_across_threads);
	tcase_add_test(tc, test_threads_share_provider);
	tcase_add_test(tc, test_pool_bound);
	tcase_add_test(tc, test_errorcheck);
	suite_add_tcase(s, tc);

	tc = tcase_create("modes");
	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_set_timeout(tc, 90);
	tcase_add_test(tc, test_shared_holders_together);
	tcase_add_test(tc, test_shared_waits_behind_queued_exclusive);
	tcase_add_test(tc, test_shared_run_granted_together);
	tcase_add_test(tc, test_exclusive_waiter_leaving_lets_shared_in);
	tcase_add_test(tc, test_fences_mixed_modes);
	tcase_add_test(tc, test_errorcheck_shared);
	tcase_add_test(tc, test_snapshot);
	tcase_add_test(tc, test_server_deadlock_is_edeadlk);
	tcase_add_test(tc, test_client_cycle_not_seen_by_server);
	suite_add_tcase(s, tc);

	tc = tcase_create("sets");
	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_set_timeout(tc, 300);
	tcase_add_test(tc, test_set_orders_clients);
	tcase_add_test(tc, test_set_second_fails_releases_first);
	tcase_add_test(tc, test_set_deadlock_releases_first);
	suite_add_tcase(s, tc);

	tc = tcase_create("processes");
	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_set_timeout(tc, 180);
	tcase_add_test(tc, test_mutual_exclusion_processes);
	tcase_add_test(tc, test_killed_holder_frees_the_key);
	tcase_add_test(tc, test_stopped_holder_and_idle_session_timeout);
	suite_add_tcase(s, tc);

	tc = tcase_create("lost");
	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_terminated_backend_loses_the_lease);
	tcase_add_test(tc, test_dead_idle_connection_replaced);
	tcase_add_test(tc, test_release_not_held_t24e);
	suite_add_tcase(s, tc);

	tc = tcase_create("failures");
	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_unreachable_server);
	tcase_add_test(tc, test_bad_uris);
	tcase_add_test(tc, test_authentication_failures);
	tcase_add_test(tc, test_tls_verify_full);
	suite_add_tcase(s, tc);

	tc = tcase_create("fork");
	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_set_timeout(tc, 120);
	tcase_add_test(tc, test_fork_child_opens_its_own_sessions);
	suite_add_tcase(s, tc);

	/* Last: it stops and starts the server. */
	tc = tcase_create("restart");
	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_add_unchecked_fixture(tc, NULL, restart_teardown);
	tcase_set_timeout(tc, 180);
	tcase_add_test(tc, test_server_restart_t24f);
	tcase_add_test(tc, test_fences_grow_across_a_crash);
	suite_add_tcase(s, tc);
	return s;
}

int
main(void)
{
	PGconn *c;

	g_uri = getenv("KEYLOCK_TEST_PG_URI");
	if (g_uri == NULL || g_uri[0] == '\0') {
		printf("SKIP: KEYLOCK_TEST_PG_URI is not set (tools/test "
		       "--only pg starts a server and sets it)\n");
		return 77;
	}
	g_auth_uri = getenv("KEYLOCK_TEST_PG_AUTH_URI");
	if (g_auth_uri != NULL && g_auth_uri[0] == '\0')
		g_auth_uri = NULL;
	/* Checked before any test, and closed before the runner forks. */
	c = PQconnectdb(g_uri);
	if (PQstatus(c) != CONNECTION_OK) {
		printf("SKIP: no PostgreSQL server at KEYLOCK_TEST_PG_URI: %s",
		       PQerrorMessage(c));
		PQfinish(c);
		return 77;
	}
	PQfinish(c);
	return test_run_suite(provider_pg_suite());
}
