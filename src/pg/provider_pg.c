/* SPDX-License-Identifier: MIT */
/*
 * The PostgreSQL provider (libkeylock-pg): keys are session advisory locks
 * of a PostgreSQL server, so locks exclude across processes and hosts and
 * the server's lock queue grants them in arrival order.  It is a library
 * of its own so that libkeylock never links libpq; kl_provider_open loads
 * it with dlopen.  It uses only the public API of libkeylock.
 *
 * This file holds the provider's operations: key ids, the lock statements
 * and their answers, fences, leases, status, open and destroy.  The URI and
 * the messages are pg_config.c's, a connection and its queries pg_conn.c's,
 * the pool, the health thread and the aux connection pg_pool.c's, the
 * fence sequence's SQL pg_fence.c's; pg_internal.h declares what they
 * share.
 *
 * Connections.  Each wait and each held lease owns one connection of a
 * pool (at most p->pool_max at once; calls beyond that queue for one in
 * arrival order), because a session advisory lock belongs to the session
 * that took it: the lease's connection stays with it until release, and
 * closing the connection drops the lock.  That gives the one rule for
 * errors: a connection that failed, or whose state is in doubt (a cancel
 * request whose effect was not seen), is closed, never reused; whatever it
 * held goes with it.  One more connection (aux) serves kl_provider_status
 * and the setup.
 *
 * Acquiring first tries, with one prepared statement (SETUP_SQL makes it
 * in the session's first query string): pg_try_advisory_lock(id), and
 * nextval of the fence sequence only if that took the lock, so a free key
 * costs one round trip and one statement.  A taken key is then waited for
 * with one simple-query string: set lock_timeout to the time left (when the
 * session does not have it yet), then one statement that waits with
 * pg_advisory_lock(id) and only then draws nextval (so a fence is drawn
 * only after the grant and grows with every grant of a key).  Releasing is
 * one prepared statement too.  The server times the wait out (55P03: not
 * granted, connection still good; any lock the session got is dropped).
 * A cancel token is watched by polling the socket in short slices; when
 * it fires, PQcancel asks the server to stop the wait.  The answer
 * settles the outcome: 57014 means the wait ended ungranted (any
 * lock taken by a later statement is dropped with pg_advisory_unlock_all);
 * a grant that beat the cancel request is undone by closing the
 * connection, since the request may still be pending for it.  So a grant
 * racing a cancel ends in exactly one outcome, and no lock is left behind.
 *
 * Leases.  A health thread checks every held lease each health_interval
 * with SELECT 1 on its connection; a failure marks the lease lost
 * (kl_lease_valid false) and calls the watch callback once, with no lock
 * held.  A lease in use by the health thread is "busy": release waits for
 * it, so the callback never runs after release has returned (except when
 * release is called from the callback itself, which the thread detects).
 *
 * Modes.  KL_SHARED takes the key with the _shared advisory functions;
 * the server's one queue per key then orders both modes as the Web Locks
 * rule says (a request conflicting with a queued one waits behind it, a
 * release grants every request from the head that conflicts with nothing
 * ahead), so the provider adds no ordering of its own.  Every grant draws
 * its own fence after the grant, shared ones too.
 *
 * A session either waits for one key or holds one, never both, so the
 * server's deadlock detector never sees a cycle among the provider's own
 * sessions, nor one of threads that wait for each other's keys (the man
 * page says so).  It can see one through another client's session that
 * holds a lock while it waits (the fence floor's lock, say): its
 * deadlock_detected (40P01) is then KL_EDEADLK.
 *
 * kl_provider_snapshot reads pg_locks on the aux connection and names
 * the thread behind each of the provider's own sessions from the lease
 * list and p->waits.
 *
 * Locks: p->mu guards the pool, the lease list and the lease flags, and is
 * never held during a query, a connect or a callback.  p->aux_mu guards the
 * aux connection for the whole of its use (status calls take turns).  The
 * two are never held together.
 */
#include "config.h"

#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <libpq-fe.h>

#include "keylock.h"
#include "keylock/pg.h"
#include "pg_fence.h"
#include "pg_internal.h"
#include "siphash.h"

#define DEFAULT_POOL 8
#define DEFAULT_HEALTH_MS 1000
/* How long past its own lock_timeout the server may take to answer before
 * it is deemed unreachable (the connection is then dropped). */
#define ANSWER_GRACE_MS 1000

/* The prepared statements of each pooled session (SETUP_SQL). */
#define STMT_TRY "keylock_try"
#define STMT_UNLOCK "keylock_unlock"
#define STMT_TRY_SHARED "keylock_try_shared"
#define STMT_UNLOCK_SHARED "keylock_unlock_shared"

/* "keylock advisory" and "keylock errcheck" as little-endian words. */
#define ID_K0 0x206b636f6c79656bULL
#define ID_K1 0x79726f7369766461ULL
#define CHECK_K0 0x206b636f6c79656bULL
#define CHECK_K1 0x6b63656863727265ULL

/* A nonzero id of the calling thread, never reused in the process (a
 * pthread_t may be, once its thread has ended). */
static uint64_t
thread_id(void)
{
	static atomic_uint_fast64_t next = 1;
	static _Thread_local uint64_t id;

	if (id == 0)
		id = atomic_fetch_add(&next, 1);
	return id;
}

/* ------------------------------------------------------------------ */
/* Key ids: SipHash-2-4 (Aumasson and Bernstein), fixed key             */

/*
 * The output is an interface: kl_pg_key_id must give the same lock id in
 * every process, host and version (test_key_id_stable and test/check_siphash
 * pin it), so it is SipHash-2-4 under a fixed public key, never the table
 * hash (SipHash-1-3 under a per-process seed).  The one SipHash of the tree
 * (src/siphash.c) is linked into this library from src/libklcommon.la and
 * stays hidden in it.
 */

int64_t
kl_pg_key_id(const char *key, size_t len)
{
	uint64_t h;
	int64_t id;

	if (key == NULL)
		len = 0;
	h = kl__siphash24(ID_K0, ID_K1, key, len);
	/* Two's complement, spelled out: converting a uint64_t above
	 * INT64_MAX to int64_t is implementation-defined. */
	memcpy(&id, &h, sizeof id);
	return id;
}

static uint64_t
key_check(const char *key, size_t len)
{
	return kl__siphash24(CHECK_K0, CHECK_K1, key, len);
}

/* A printable, shortened form of key for a message (size > 8); the
 * library's own is hidden in libkeylock. */
static void
printable(char *buf, size_t size, const char *key, size_t len)
{
	size_t i, n = 0, room = size - 4;

	for (i = 0; key != NULL && i < len && n < room; i++) {
		unsigned char ch = (unsigned char)key[i];

		buf[n++] = (char)(ch >= 0x20 && ch < 0x7f ? ch : '?');
	}
	if (key != NULL && i < len) {
		memcpy(buf + n, "...", 3);
		n += 3;
	}
	buf[n] = '\0';
}

/* ------------------------------------------------------------------ */
/* Acquire                                                             */

/* What a failed statement of lock_on means: KL_EPROVIDER, with c->broken
 * set (a lock it may hold goes with it). */
static int
lock_error(struct kl__pg *p, struct kl__pg_conn *c,
	   const struct kl__pg_answer *a, kl_error *err)
{
	c->broken = true;
	if (strcmp(a->sqlstate, "42P01") == 0)
		return kl__pg_fail(p, err, KL_EPROVIDER,
				   "the fence sequence %s is missing: %s",
				   p->fence.name, a->message);
	return kl__pg_fail(p, err, KL_EPROVIDER, "%s%s%s", a->message,
			   a->sqlstate[0] != '\0' ? " SQLSTATE " : "",
			   a->sqlstate);
}

/*
 * What a new session runs, once, in front of its first STMT_TRY (in the
 * same query string, one transaction: no round trip of its own):
 * statement_timeout 0 (a server default must not cut a wait the caller
 * allowed), synchronous_commit off (a fence must not wait for a WAL
 * flush: src/pg/pg_fence.c says why that is safe), two prepared statements
 * (SQL PREPARE makes them for PQsendQueryPrepared too), so that an
 * uncontended acquire and a release are then one statement each, bound
 * and run without being parsed again, and the floor of the fence
 * sequence.  STMT_TRY takes the lock only if it is free
 * (pg_try_advisory_lock does not barge past queued waiters) and, in the
 * same statement, draws a fence only once it has it (CASE); STMT_UNLOCK
 * releases.
 */
#define TRY_SQL                                                              \
	"SELECT CASE WHEN pg_catalog.pg_try_advisory_lock%s(%s) THEN %s END"

static int
make_setup_sql(struct kl__pg *p)
{
	char try[sizeof p->fence.draw + 80], try_s[sizeof try];
	int n;

	n = snprintf(try, sizeof try, TRY_SQL, "", "$1", p->fence.draw);
	if (n < 0 || (size_t)n >= sizeof try)
		return -1;
	n = snprintf(try_s, sizeof try_s, TRY_SQL, "_shared", "$1",
		     p->fence.draw);
	if (n < 0 || (size_t)n >= sizeof try_s)
		return -1;
	n = snprintf(p->setup_sql, sizeof p->setup_sql,
		     "SET statement_timeout = 0; SET synchronous_commit = off; "
		     "PREPARE " STMT_TRY "(bigint) AS %s; "
		     "PREPARE " STMT_TRY_SHARED "(bigint) AS %s; "
		     "PREPARE " STMT_UNLOCK "(bigint) AS SELECT "
		     "pg_catalog.pg_advisory_unlock($1)::int; "
		     "PREPARE " STMT_UNLOCK_SHARED "(bigint) AS SELECT "
		     "pg_catalog.pg_advisory_unlock_shared($1)::int; %s",
		     try, try_s, p->fence.floor);
	return n < 0 || (size_t)n >= sizeof p->setup_sql ? -1 : 0;
}

/* lock_answer: the try found the key taken (not a KL_* status). */
#define NOT_GRANTED 1

/*
 * Settles the answer a to STMT_TRY or to a wait, rc being what kl__pg_run_q
 * returned.  KL_OK with *fence; NOT_GRANTED: the try found the key taken;
 * KL_ETIMEDOUT, KL_ECANCELED, KL_EDEADLK (the server's deadlock
 * detector ended the wait; err not filled) with c holding no lock;
 * KL_EPROVIDER.  c->broken is set when c must be closed (which drops any
 * lock it holds).
 */
static int
lock_answer(struct kl__pg *p, struct kl__pg_conn *c, int rc,
	    const struct kl__pg_answer *a, kl_cancel *cancel, uint64_t *fence,
	    kl_error *err)
{
	if (rc != KL_OK) {
		/* The connection goes, and any lock with it; a wait we had
		 * asked to stop ends as we asked. */
		if (a->stopped != 0)
			return kl__pg_fail(p, err, a->stopped, NULL);
		return rc;
	}
	if (a->failed) {
		if (a->stopped != 0 && strcmp(a->sqlstate, "57014") == 0) {
			/* Our cancel request ended the query.  It may have
			 * hit nextval after a grant: drop what the session
			 * holds. */
			kl__pg_unlock_all(p, c);
			return kl__pg_fail(p, err, a->stopped, NULL);
		}
		if (a->stopped != 0) {
			/* The cancel request may still be pending. */
			c->broken = true;
			return kl__pg_fail(p, err, a->stopped, NULL);
		}
		if (strcmp(a->sqlstate, "40P01") == 0) {
			/* deadlock_detected: the server chose this wait to
			 * break a cycle of sessions.  As for lock_timeout,
			 * the key may have been granted before the draw
			 * waited (a session lock outlives the failed
			 * transaction): drop what the session holds.  The
			 * caller names the key. */
			if (PQtransactionStatus(c->pg) != PQTRANS_IDLE)
				c->broken = true;
			else
				kl__pg_unlock_all(p, c);
			return KL_EDEADLK;
		}
		if (strcmp(a->sqlstate, "55P03") == 0) {
			/* lock_timeout.  Mostly the advisory lock's wait;
			 * but the draw may have waited too (for the
			 * floor's lock, src/pg/pg_fence.c) after the grant,
			 * and a session lock outlives its failed
			 * transaction: drop what the session holds, which
			 * can only be this key. */
			if (PQtransactionStatus(c->pg) != PQTRANS_IDLE)
				c->broken = true;
			else
				kl__pg_unlock_all(p, c);
			return kl__pg_fail(p, err, KL_ETIMEDOUT, NULL);
		}
		return lock_error(p, c, a, err);
	}
	if (a->nvals < 1) {
		c->broken = true;
		return kl__pg_fail(p, err, KL_EPROVIDER, "unexpected answer");
	}
	if (a->stopped != 0) {
		/* Answered (granted or not) before our cancel request
		 * arrived; the request may still be pending, so the
		 * connection goes, and any lock with it. */
		c->broken = true;
		return kl__pg_fail(p, err, a->stopped, NULL);
	}
	if (a->null[0])
		return NOT_GRANTED; /* pg_try_advisory_lock said no */
	if (kl_cancel_fired(cancel)) {
		/* Fired while the grant was on its way: once
		 * kl_cancel_fire has returned, no later grant. */
		kl__pg_unlock_all(p, c);
		return kl__pg_fail(p, err, KL_ECANCELED, NULL);
	}
	if (a->val[0] < p->fence_min) {
		/* Closing the session drops the key; the next session
		 * floors the sequence again. */
		c->broken = true;
		return kl__pg_fail(
			p, err, KL_EPROVIDER,
			"the fence sequence %s went back to %" PRId64
			", below the server's clock when the provider "
			"opened (was it dropped and created again, or set "
			"back?); the key was not granted",
			p->fence.name, a->val[0]);
	}
	*fence = (uint64_t)a->val[0];
	return KL_OK;
}

/*
 * Waits on c for lock id until deadline (KL__PG_NO_DEADLINE: forever; past: try
 * once) or cancel.  KL_OK with *fence; KL_ETIMEDOUT, KL_ECANCELED with c
 * holding no lock; KL_EPROVIDER.  c->broken is set when c must be closed
 * (which drops any lock it holds).
 *
 * First STMT_TRY: a key nobody holds or waits for costs one round trip and
 * one statement, and no setting.  Only when it is taken does the wait
 * follow, as one simple-query string.
 */
static int
lock_on(struct kl__pg *p, struct kl__pg_conn *c, int64_t id, bool shared,
	int64_t deadline, kl_cancel *cancel, uint64_t *fence, kl_error *err)
{
	struct kl__pg_answer a;
	char sql[sizeof p->setup_sql + sizeof p->fence.draw + 160], set[96],
		idbuf[24];
	int64_t left_ms, client_deadline;
	int late, rc;
	bool try_once, setup, sent_st, sent_lt, ok;

	if (kl_cancel_fired(cancel))
		return kl__pg_fail(p, err, KL_ECANCELED, NULL);
	try_once =
		deadline != KL__PG_NO_DEADLINE && deadline <= kl__now_ns();
	if ((setup = !c->prepared)) {
		snprintf(idbuf, sizeof idbuf, "%" PRId64, id);
		snprintf(sql, sizeof sql, "%s" TRY_SQL, p->setup_sql,
			 shared ? "_shared" : "", idbuf, p->fence.draw);
		rc = kl__pg_run(p, c, sql,
				kl__deadline_of(KL__PG_SHORT_OP_MS),
				KL_EPROVIDER, cancel, &a, err);
		if (rc == KL_OK && !a.failed && a.stopped == 0) {
			c->prepared = true;
			c->no_statement_timeout = true;
		}
	} else {
		rc = kl__pg_run_q(p, c, NULL,
				  shared ? STMT_TRY_SHARED : STMT_TRY, id,
				  kl__deadline_of(KL__PG_SHORT_OP_MS),
				  KL_EPROVIDER, cancel, &a, err);
	}
	rc = lock_answer(p, c, rc, &a, cancel, fence, err);
	/* A PREPARE is not undone with its failed transaction: a session
	 * whose setup did not complete is not used again. */
	if (setup && !c->prepared)
		c->broken = true;
	if (rc == KL_ETIMEDOUT) {
		/* The lock_timeout an earlier wait left (or a server
		 * default) cut the draw short: a new session was flooring
		 * the sequence.  The
		 * key was dropped; not the caller's timeout: wait as for a
		 * taken key. */
		rc = c->broken ? kl__pg_fail(p, err, KL_EPROVIDER,
					     "the fence sequence %s is locked "
					     "(lock_timeout)",
					     p->fence.name)
			       : NOT_GRANTED;
	}
	if (rc != NOT_GRANTED)
		return rc;
	if (try_once)
		return kl__pg_fail(p, err, KL_ETIMEDOUT, NULL);
	if (kl_cancel_fired(cancel))
		return kl__pg_fail(p, err, KL_ECANCELED, NULL);

	/* The server times the wait out with lock_timeout (ms, an int, 0 =
	 * none).  Past INT_MAX ms it waits without limit and the client
	 * cancels at the deadline instead. */
	left_ms = deadline == KL__PG_NO_DEADLINE
			  ? 0
			  : (deadline - kl__now_ns() + 999999) / 1000000;
	if (left_ms < 1 && deadline != KL__PG_NO_DEADLINE)
		left_ms = 1;
	if (left_ms > INT_MAX) {
		left_ms = 0;
		client_deadline = deadline;
		late = KL_ETIMEDOUT;
	} else if (left_ms == 0) {
		client_deadline = KL__PG_NO_DEADLINE;
		late = KL_EPROVIDER;
	} else {
		client_deadline = deadline + ANSWER_GRACE_MS * 1000000LL;
		late = KL_EPROVIDER;
	}
	/* One round trip, one implicit transaction, one statement for the
	 * lock and the fence: the CTE (never inlined: it calls a volatile
	 * function) is read before the draw (a subquery, run when the row
	 * is), so the fence is drawn, and the floor's lock taken, only once
	 * the lock is granted, and not at all when the wait fails.  A
	 * SET, a statement of its own, is sent only when the session may
	 * not have that value yet. */
	sent_st = !c->no_statement_timeout;
	sent_lt = c->lock_timeout_ms != left_ms;
	set[0] = '\0';
	if (sent_st)
		kl__pg_append(set, sizeof set, "SET statement_timeout = 0; ");
	if (sent_lt)
		snprintf(set + strlen(set), sizeof set - strlen(set),
			 "SET lock_timeout = %" PRId64 "; ", left_ms);
	snprintf(sql, sizeof sql,
		 "%sWITH l AS (SELECT pg_catalog.pg_advisory_lock%s(%" PRId64
		 ")) SELECT %s FROM l",
		 set, shared ? "_shared" : "", id, p->fence.draw);
	rc = kl__pg_run(p, c, sql, client_deadline, late, cancel, &a, err);
	/* A failed statement rolls the implicit transaction back, and the
	 * SETs sent in it: those settings are then unknown.  Those of
	 * earlier transactions stay. */
	ok = rc == KL_OK && !a.failed && a.stopped == 0;
	if (sent_st)
		c->no_statement_timeout = ok;
	if (sent_lt)
		c->lock_timeout_ms = ok ? left_ms : -1;
	rc = lock_answer(p, c, rc, &a, cancel, fence, err);
	if (rc == NOT_GRANTED) {
		/* nextval is never NULL. */
		c->broken = true;
		rc = kl__pg_fail(p, err, KL_EPROVIDER, "unexpected answer");
	}
	return rc;
}

static bool
held_by_caller(struct kl__pg *p, int64_t id, uint64_t check)
{
	uint64_t self = thread_id();
	bool found = false;

	pthread_mutex_lock(&p->mu);
	for (struct kl__pg_lease *l = p->leases; l != NULL; l = l->next)
		if (l->id == id && l->check == check && !l->releasing &&
		    l->owner == self) {
			found = true;
			break;
		}
	pthread_mutex_unlock(&p->mu);
	return found;
}

static int64_t
gettid_now(void)
{
	return (int64_t)syscall(SYS_gettid);
}

static int
pg_acquire(void *impl, const char *key, size_t key_len, kl_cancel *cancel,
	   int64_t timeout_ms, int64_t ttl_ms, unsigned flags, void **lease,
	   uint64_t *fence, kl_error *err)
{
	struct kl__pg *p = impl;
	struct kl__pg_lease *l;
	struct kl__pg_conn *c;
	struct kl__pg_wait w, **pw;
	int64_t deadline;
	uint64_t got = 0;
	bool fresh, stale;
	int rc;

	(void)ttl_ms; /* held until released or the session ends */
	*lease = NULL;
	*fence = 0;
	if (kl_cancel_fired(cancel))
		return kl__pg_fail(p, err, KL_ECANCELED, NULL);
	deadline = kl__deadline_of(timeout_ms);
	/* Made first, so that nothing can fail once the key is held. */
	if ((l = calloc(1, sizeof *l)) == NULL)
		return kl__pg_fail(p, err, KL_ENOMEM, "out of memory");
	l->id = kl_pg_key_id(key, key_len);
	l->check = key_check(key, key_len);
	l->owner = thread_id();
	l->shared = (flags & KL_SHARED) != 0;
	l->tid = gettid_now();
	/* Either mode: a thread that holds the key, shared or not, and
	 * asks again would wait for itself (or, shared twice, hold it
	 * twice). */
	if ((flags & KL_ERRORCHECK) != 0 &&
	    held_by_caller(p, l->id, l->check)) {
		free(l);
		return kl__pg_fail(p, err, KL_EDEADLK,
				   "this thread already holds the key");
	}
	if ((rc = kl__pg_slot_get(p, deadline, cancel, &c)) != KL_OK) {
		free(l);
		return kl__pg_fail(p, err, rc, NULL);
	}
	w.tid = l->tid;
	for (;;) {
		fresh = c == NULL;
		if (fresh &&
		    (rc = kl__pg_conn_open(p, cancel, &c, err)) != KL_OK) {
			kl__pg_slot_put(p, NULL);
			free(l);
			return rc;
		}
		w.backend = PQbackendPID(c->pg);
		pthread_mutex_lock(&p->mu);
		w.next = p->waits;
		p->waits = &w;
		pthread_mutex_unlock(&p->mu);
		rc = lock_on(p, c, l->id, l->shared, deadline, cancel, &got,
			     err);
		pthread_mutex_lock(&p->mu);
		for (pw = &p->waits; *pw != &w; pw = &(*pw)->next)
			;
		*pw = w.next;
		pthread_mutex_unlock(&p->mu);
		/* An idle connection that died meanwhile (a server
		 * restart) held nothing: try once more on a new one. */
		stale = !fresh && c->broken && rc == KL_EPROVIDER &&
			PQstatus(c->pg) != CONNECTION_OK;
		if (!stale)
			break;
		kl__pg_conn_close(c);
		c = NULL;
	}
	if (rc == KL_EDEADLK) {
		char shown[72];

		printable(shown, sizeof shown, key, key_len);
		kl__pg_fail(p, err, KL_EDEADLK,
			    "deadlock detected by the server while waiting "
			    "for key '%s' (advisory lock %" PRId64
			    "); this wait was chosen to break it",
			    shown, l->id);
	}
	if (rc != KL_OK) {
		kl__pg_slot_put(p, c);
		free(l);
		return rc;
	}
	l->conn = c;
	l->backend = PQbackendPID(c->pg);
	l->granted_ns = kl__now_ns();
	l->fence = got;
	pthread_mutex_lock(&p->mu);
	l->next = p->leases;
	if (p->leases != NULL)
		p->leases->prev = l;
	p->leases = l;
	pthread_mutex_unlock(&p->mu);
	*lease = l;
	*fence = got;
	return KL_OK;
}

/* ------------------------------------------------------------------ */
/* Release, validity, loss                                             */

static int
pg_release(void *impl, void *handle, kl_error *err)
{
	struct kl__pg *p = impl;
	struct kl__pg_lease *l = handle;
	struct kl__pg_conn *c = l->conn;
	struct kl__pg_answer a;
	char why[sizeof l->why];
	bool lost, in_callback;
	int rc;

	pthread_mutex_lock(&p->mu);
	l->releasing = true;
	in_callback = kl__pg_on_health_thread(p);
	while (l->busy && !in_callback)
		pthread_cond_wait(&p->idle_cond, &p->mu);
	if (l->prev != NULL)
		l->prev->next = l->next;
	else
		p->leases = l->next;
	if (l->next != NULL)
		l->next->prev = l->prev;
	lost = l->lost;
	memcpy(why, l->why, sizeof why);
	in_callback = in_callback && l->busy;
	pthread_mutex_unlock(&p->mu);

	if (lost) {
		c->broken = true;
		rc = kl__pg_fail(p, err, KL_EPROVIDER, "the lock was lost: %s",
				 why);
	} else if (!kl__pg_conn_ours(c)) {
		/* A lease inherited over fork(): its session is the
		 * parent's, which keeps the lock. */
		c->broken = true;
		rc = kl__pg_fail(
			p, err, KL_EPROVIDER,
			"the lease belongs to the parent process (fork)");
	} else {
		/* lock_on readied the session (SETUP_SQL): one
		 * prepared statement. */
		rc = kl__pg_run_short_q(
			p, c, NULL, l->shared ? STMT_UNLOCK_SHARED : STMT_UNLOCK,
			l->id, &a, err);
		if (rc == KL_OK && (a.nvals < 1 || a.null[0])) {
			c->broken = true;
			rc = kl__pg_fail(p, err, KL_EPROVIDER,
					 "unexpected answer");
		} else if (rc == KL_OK && a.val[0] == 0) {
			rc = kl__pg_fail(
				p, err, KL_EPROVIDER,
				"the lock was not held by its session");
		} else if (rc != KL_OK) {
			/* The connection is closed below, which drops the
			 * lock all the same. */
		}
	}
	kl__pg_slot_put(p, c);
	if (in_callback) {
		pthread_mutex_lock(&p->mu);
		l->free_me = true;
		pthread_mutex_unlock(&p->mu);
	} else {
		free(l);
	}
	return rc;
}

static bool
pg_valid(void *impl, void *handle)
{
	struct kl__pg *p = impl;
	struct kl__pg_lease *l = handle;
	bool lost;

	pthread_mutex_lock(&p->mu);
	lost = l->lost;
	pthread_mutex_unlock(&p->mu);
	return !lost;
}

static void
pg_watch(void *impl, void *handle, void (*lost)(void *ctx), void *ctx)
{
	struct kl__pg *p = impl;
	struct kl__pg_lease *l = handle;

	pthread_mutex_lock(&p->mu);
	l->lost_fn = lost;
	l->lost_ctx = ctx;
	/* Lost before anyone watched: report it now rather than a whole
	 * interval later. */
	if (l->lost)
		pthread_cond_signal(&p->wake);
	pthread_mutex_unlock(&p->mu);
}

/* ------------------------------------------------------------------ */
/* Status                                                              */

static int
pg_status(void *impl, const char *key, size_t key_len, size_t *holders,
	  size_t *waiters, kl_error *err)
{
	struct kl__pg *p = impl;
	uint64_t id = (uint64_t)kl_pg_key_id(key, key_len);
	struct kl__pg_answer a;
	char sql[512];
	int rc;

	*holders = *waiters = 0;
	/* pg_advisory_lock(bigint) shows as classid = high half, objid =
	 * low half, objsubid = 1, in the current database. */
	snprintf(sql, sizeof sql,
		 "SELECT count(*) FILTER (WHERE granted), "
		 "count(*) FILTER (WHERE NOT granted) "
		 "FROM pg_catalog.pg_locks WHERE locktype = 'advisory' "
		 "AND database = (SELECT oid FROM pg_catalog.pg_database "
		 "WHERE datname = pg_catalog.current_database()) "
		 "AND classid = '%" PRIu32 "'::oid AND objid = '%" PRIu32
		 "'::oid AND objsubid = 1",
		 (uint32_t)(id >> 32), (uint32_t)id);
	if ((rc = kl__pg_aux_run(p, sql, true, &a, err)) != KL_OK)
		return rc;
	if (a.nvals < 2 || a.null[0] || a.null[1])
		return kl__pg_fail(p, err, KL_EPROVIDER, "unexpected answer");
	*holders = (size_t)a.val[0];
	*waiters = (size_t)a.val[1];
	return KL_OK;
}

/* ------------------------------------------------------------------ */
/* Snapshot                                                            */

/*
 * Every session advisory lock of the bigint key space (objsubid 1) in the
 * current database, from one read of pg_locks: a key's holders first,
 * then its waiters by the time each started to wait (pg_locks.waitstart,
 * PostgreSQL 14 and later; read through to_jsonb so that an older server,
 * which lacks it, gives NULL instead of an error).  PostgreSQL does not
 * show its queue itself; waitstart follows it.  A holder's time is the
 * lower bound pg_stat_activity gives: since its transaction began, or
 * since its last statement ended when it is idle; the provider's own
 * leases use their grant time instead.
 */
#define SNAPSHOT_SQL                                                          \
	"SELECT l.classid::bigint, l.objid::bigint, l.pid, "                    \
	"(l.mode = 'ShareLock')::int, l.granted::int, "                         \
	"(EXTRACT(epoch FROM pg_catalog.clock_timestamp() - CASE WHEN "         \
	"l.granted THEN COALESCE(a.xact_start, a.state_change) ELSE "           \
	"(pg_catalog.to_jsonb(l) ->> 'waitstart')::timestamptz END) * "         \
	"1000)::bigint "                                                        \
	"FROM pg_catalog.pg_locks l LEFT JOIN pg_catalog.pg_stat_activity a "   \
	"ON a.pid = l.pid WHERE l.locktype = 'advisory' AND l.objsubid = 1 "    \
	"AND l.database = (SELECT oid FROM pg_catalog.pg_database WHERE "       \
	"datname = pg_catalog.current_database()) "                             \
	"ORDER BY l.classid, l.objid, l.granted DESC, "                         \
	"(pg_catalog.to_jsonb(l) ->> 'waitstart')::timestamptz NULLS LAST, "    \
	"l.pid"

static int64_t
cell(const PGresult *r, int row, int col, int64_t null)
{
	if (PQgetisnull(r, row, col))
		return null;
	return strtoll(PQgetvalue(r, row, col), NULL, 10);
}

/* Fills in what the provider itself knows of the server process backend
 * that holds or waits for id: its own lease, or its own wait. */
static void
own_entry(struct kl__pg *p, int backend, int64_t id, kl_lock_info *info)
{
	pthread_mutex_lock(&p->mu);
	if (!info->waiting) {
		for (struct kl__pg_lease *l = p->leases; l != NULL;
		     l = l->next)
			if (l->backend == backend && l->id == id &&
			    !l->releasing && !l->lost) {
				info->pid = (int64_t)getpid();
				info->tid = l->tid;
				info->fence = l->fence;
				info->elapsed_ms = (kl__now_ns() -
						    l->granted_ns) /
						   1000000;
				break;
			}
	} else {
		for (struct kl__pg_wait *w = p->waits; w != NULL; w = w->next)
			if (w->backend == backend) {
				info->pid = (int64_t)getpid();
				info->tid = w->tid;
				break;
			}
	}
	pthread_mutex_unlock(&p->mu);
}

static int
pg_snapshot(void *impl, kl_snapshot_fn fn, void *arg, kl_error *err)
{
	struct kl__pg *p = impl;
	PGresult *r;
	kl_lock_info info;
	char detail[128];
	int64_t prev = 0, id;
	uint64_t u;
	size_t position = 0;
	int rc, backend;

	if ((rc = kl__pg_aux_rows(p, SNAPSHOT_SQL, &r, err)) != KL_OK)
		return rc;
	if (PQnfields(r) < 6) {
		PQclear(r);
		return kl__pg_fail(p, err, KL_EPROVIDER, "unexpected answer");
	}
	/* No lock of the provider is held from here on. */
	for (int i = 0; i < PQntuples(r); i++) {
		u = (uint64_t)cell(r, i, 0, 0) << 32 |
		    ((uint64_t)cell(r, i, 1, 0) & 0xffffffffu);
		memcpy(&id, &u, sizeof id);
		if (i == 0 || id != prev)
			position = 0;
		prev = id;
		backend = (int)cell(r, i, 2, 0);
		memset(&info, 0, sizeof info);
		info.key = NULL;
		info.key_len = 0;
		info.shared = cell(r, i, 3, 0) != 0;
		info.waiting = cell(r, i, 4, 1) == 0;
		info.pid = backend;
		info.tid = 0;
		info.fence = 0;
		info.elapsed_ms = cell(r, i, 5, -1);
		if (info.elapsed_ms < -1)
			info.elapsed_ms = 0; /* clocks of two moments */
		info.position = info.waiting ? position++ : 0;
		own_entry(p, backend, id, &info);
		snprintf(detail, sizeof detail,
			 "advisory lock %" PRId64 " (classid %" PRIu32
			 ", objid %" PRIu32 "), server process %d",
			 id, (uint32_t)(u >> 32), (uint32_t)u, backend);
		info.detail = detail;
		if (fn(&info, arg) != 0)
			break;
	}
	PQclear(r);
	return KL_OK;
}

/* ------------------------------------------------------------------ */
/* Open and destroy                                                    */

static void
pg_free(struct kl__pg *p)
{
	struct kl__pg_conn *c;
	bool child;

	if (p == NULL)
		return;
	child = p->health_started && p->pid != getpid();
	if (p->health_started) {
		pthread_mutex_lock(&p->mu);
		p->stop = true;
		pthread_cond_signal(&p->wake);
		pthread_mutex_unlock(&p->mu);
		/* A child of fork() has no health thread to join. */
		if (!child)
			pthread_join(p->health, NULL);
	}
	while ((c = p->idle) != NULL) {
		p->idle = c->next;
		kl__pg_conn_close(c);
	}
	kl__pg_conn_close(p->aux);
	/* In a child of fork(), the parent's health thread was waiting on
	 * p->wake: glibc's pthread_cond_destroy would wait for that waiter,
	 * which does not exist here, for ever.  They hold no resource. */
	if (!child) {
		pthread_mutex_destroy(&p->mu);
		pthread_mutex_destroy(&p->aux_mu);
		pthread_cond_destroy(&p->wake);
		pthread_cond_destroy(&p->idle_cond);
	}
	if (p->opts != NULL)
		PQconninfoFree(p->opts);
	free(p->keys);
	free(p->vals);
	free(p->password);
	free(p->raw_password);
	free(p);
}

static void
pg_destroy(void *impl)
{
	pg_free(impl);
}

static bool
has_prefix(const char *s, const char *prefix)
{
	return strncmp(s, prefix, strlen(prefix)) == 0;
}

/* Makes sure the fence sequence exists and is one this role can draw
 * from and floor: the shared one, by its schema-qualified name.  Checked
 * before creating, so that a role without CREATE on the schema can use a
 * sequence made for it; losing a creation race to another process is
 * fine. */
static int
ensure_sequence(struct kl__pg *p, kl_error *err)
{
	struct kl__pg_answer a;
	char sql[sizeof p->fence.ident + 64];
	int rc;

	for (int tries = 0;; tries++) {
		if ((rc = kl__pg_aux_run(p, p->fence.check, true, &a, err)) !=
		    KL_OK)
			return rc;
		if (a.nvals >= 2 && !a.null[0] && a.val[0] == KL__PG_FENCE_OK) {
			p->fence_min = a.null[1] ? 0 : a.val[1];
			return KL_OK;
		}
		if (a.nvals >= 1)
			return kl__pg_fail(p, err, KL_EPROVIDER,
					   "the fence sequence %s %s",
					   p->fence.name,
					   kl__pg_fence_problem((int)a.val[0]));
		if (tries > 0)
			return kl__pg_fail(
				p, err, KL_EPROVIDER,
				"the fence sequence %s was created but "
				"cannot be found",
				p->fence.name);
		snprintf(sql, sizeof sql, "CREATE SEQUENCE IF NOT EXISTS %s",
			 p->fence.ident);
		rc = kl__pg_aux_run(p, sql, false, &a, err);
		if (rc != KL_OK)
			return rc;
		if (a.failed && strcmp(a.sqlstate, "42P07") != 0 &&
		    strcmp(a.sqlstate, "23505") != 0)
			return kl__pg_fail(
				p, err, KL_EPROVIDER,
				"cannot create the fence sequence %s "
				"(have it created, and USAGE and UPDATE "
				"on it granted): %s",
				p->fence.name, a.message);
	}
}

static const kl_provider_ops pg_ops = {
	.struct_size = sizeof(kl_provider_ops),
	.name = "postgresql",
	.acquire = pg_acquire,
	.release = pg_release,
	.valid = pg_valid,
	.destroy = pg_destroy,
	.status = pg_status,
	.watch = pg_watch,
	.snapshot = pg_snapshot,
};

int
kl_pg_provider_open(kl_provider **out, const char *uri, kl_error *err)
{
	sigset_t all, old;
	struct kl__pg *p;
	int rc;

	if (out != NULL)
		*out = NULL;
	if (out == NULL || uri == NULL)
		return kl__pg_fail(NULL, err, KL_EINVAL,
				   "no provider URI given");
	if (!has_prefix(uri, "postgresql://") &&
	    !has_prefix(uri, "postgres://"))
		return kl__pg_fail(NULL, err, KL_EINVAL,
				   "not a postgresql:// or postgres:// URI");
	if (!PQisthreadsafe())
		return kl__pg_fail(NULL, err, KL_EPROVIDER,
				   "libpq was built without thread safety");
	if ((p = calloc(1, sizeof *p)) == NULL)
		return kl__pg_fail(NULL, err, KL_ENOMEM, "out of memory");
	p->pool_max = DEFAULT_POOL;
	p->health_ms = DEFAULT_HEALTH_MS;
	(void)kl__pg_fence_init(&p->fence, NULL, 0); /* fits */
	/* Only a system out of resources fails these (glibc's never do);
	 * the memory is freed, the half-made objects need nothing more. */
	if (pthread_mutex_init(&p->mu, NULL) != 0 ||
	    pthread_mutex_init(&p->aux_mu, NULL) != 0 ||
	    kl__pg_cond_init(&p->wake) != 0 ||
	    kl__pg_cond_init(&p->idle_cond) != 0) {
		free(p);
		return kl__pg_fail(NULL, err, KL_ENOMEM, "out of resources");
	}
	if ((rc = kl__pg_parse_uri(p, uri, err)) == KL_OK &&
	    make_setup_sql(p) != 0)
		rc = kl__pg_fail(p, err, KL_EINVAL, "fence_sequence too long");
	if (rc != KL_OK || (rc = ensure_sequence(p, err)) != KL_OK) {
		pg_free(p);
		return rc;
	}
	/* The health thread takes no signal meant for the application. */
	sigfillset(&all);
	pthread_sigmask(SIG_SETMASK, &all, &old);
	rc = pthread_create(&p->health, NULL, kl__pg_health_main, p);
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	if (rc != 0) {
		pg_free(p);
		return kl__pg_fail(NULL, err, KL_ENOMEM,
				   "cannot start the health-check thread: %s",
				   strerror(rc));
	}
	p->health_started = true;
	p->pid = getpid();
	if ((rc = kl_provider_new(out, &pg_ops, p)) != KL_OK) {
		pg_free(p);
		return kl__pg_fail(NULL, err, rc, "%s", kl_strerror(rc));
	}
	return KL_OK;
}
