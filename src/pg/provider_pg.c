/* SPDX-License-Identifier: MIT */
/*
 * The PostgreSQL provider (libkeylock-pg): keys are session advisory locks
 * of a PostgreSQL server, so locks exclude across processes and hosts and
 * the server's lock queue grants them in arrival order.  It is a library
 * of its own so that libkeylock never links libpq; kl_provider_open loads
 * it with dlopen.  It uses only the public API of libkeylock.
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
 * A session either waits for one key or holds one, never both, so the
 * server's deadlock detector never sees a cycle (nor breaks one).
 *
 * Locks: p->mu guards the pool, the lease list and the lease flags, and is
 * never held during a query, a connect or a callback.  p->aux_mu guards the
 * aux connection for the whole of its use (status calls take turns).  The
 * two are never held together.
 */
#include "config.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <libpq-fe.h>

#include "keylock.h"
#include "keylock/pg.h"
#include "pg_fence.h"
#include "siphash.h"

#define DEFAULT_POOL 8
#define MAX_POOL 1024
#define DEFAULT_HEALTH_MS 1000
#define MIN_HEALTH_MS 10
#define MAX_HEALTH_MS 3600000
#define DEFAULT_CONNECT_TIMEOUT "5"
/* How often a wait looks at its cancel token. */
#define SLICE_MS 10
/* How long past its own lock_timeout the server may take to answer before
 * it is deemed unreachable (the connection is then dropped). */
#define ANSWER_GRACE_MS 1000
/* Bound on the short queries: unlock, SELECT 1, status, setup, and on the
 * answer to a cancel request. */
#define SHORT_OP_MS 5000

/* The prepared statements of each pooled session (SETUP_SQL). */
#define STMT_TRY "keylock_try"
#define STMT_UNLOCK "keylock_unlock"

#define NO_DEADLINE INT64_MAX

/* "keylock advisory" and "keylock errcheck" as little-endian words. */
#define ID_K0 0x206b636f6c79656bULL
#define ID_K1 0x79726f7369766461ULL
#define CHECK_K0 0x206b636f6c79656bULL
#define CHECK_K1 0x6b63656863727265ULL

struct conn {
	PGconn *pg;
	struct conn *next; /* in the idle list */
	pid_t pid;         /* the process that opened it */
	bool broken;       /* must be closed, not reused */
	bool prepared;     /* SETUP_SQL has run: the session has
			      statement_timeout 0 and the statements
			      STMT_TRY and STMT_UNLOCK */
	/* The session's settings as the last wait left them, so that the
	 * next wait sends only what differs: statement_timeout is 0, and
	 * lock_timeout (ms; -1: unknown). */
	bool no_statement_timeout;
	int64_t lock_timeout_ms;
};

/* A call waiting for a pool slot, on its own stack.  Granted (with an
 * idle connection, or NULL: open one) only under p->mu. */
struct slot_waiter {
	struct slot_waiter *next;
	pthread_cond_t cond;
	bool granted;
	struct conn *conn;
};

struct pg_lease {
	struct pg_lease *next, *prev; /* p->leases */
	struct conn *conn;
	int64_t id;
	uint64_t check; /* a second hash of the key, for KL_ERRORCHECK */
	uint64_t owner; /* thread_id() of the thread that acquired it */
	/* Under p->mu. */
	bool lost;
	bool busy;      /* the health thread pings it or reports it lost */
	bool releasing; /* release has started */
	bool free_me;   /* released from its own lost callback */
	bool notified;
	unsigned round; /* the last health round that looked at it */
	void (*lost_fn)(void *ctx);
	void *lost_ctx;
	char why[160]; /* why it was lost */
};

struct pg {
	/* Connection parameters, fixed after open. */
	const char **keys, **vals; /* for PQconnectStartParams */
	PQconninfoOption *opts;    /* owns what keys and vals point to */
	char *password;            /* decoded, to keep out of messages */
	char *raw_password;        /* as written in the URI */
	char where[192];           /* "host H port P database D" */
	int64_t connect_timeout_ms; /* 0: none */
	int64_t health_ms;
	size_t pool_max;

	pthread_mutex_t mu;
	pthread_cond_t wake;      /* the health thread's sleep; stop */
	pthread_cond_t idle_cond; /* a lease stopped being busy */
	size_t in_use;            /* pool slots taken */
	struct conn *idle;
	struct slot_waiter *wq_head, *wq_tail;
	struct pg_lease *leases;
	unsigned round;
	bool stop;
	pthread_t health;
	bool health_started;
	pid_t pid; /* the process that opened the provider */

	pthread_mutex_t aux_mu;
	struct conn *aux;

	struct kl__pg_fence fence;
	/* The server's clock in microseconds when the sequence was checked:
	 * every session floors the sequence at its clock before its first
	 * draw, later, so a fence below this comes from a sequence dropped
	 * and created again, or set back, behind a session's floor. */
	int64_t fence_min;
	/* What a new session runs, once, in front of its first STMT_TRY. */
	char setup_sql[4096];
};

/* ------------------------------------------------------------------ */
/* Time                                                                */

static int64_t
now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* The absolute deadline ms from now; KL_FOREVER (or any negative) and
 * values past the clock's range give NO_DEADLINE. */
static int64_t
deadline_after(int64_t ms)
{
	int64_t now = now_ns();

	if (ms < 0 || ms > (NO_DEADLINE - now) / 1000000)
		return NO_DEADLINE;
	return now + ms * 1000000;
}

/* Milliseconds (rounded up) from now to deadline, at most cap. */
static int
ms_until(int64_t deadline, int cap)
{
	int64_t left;

	if (deadline == NO_DEADLINE)
		return cap;
	left = deadline - now_ns();
	if (left <= 0)
		return 0;
	left = (left + 999999) / 1000000;
	return left < cap ? (int)left : cap;
}

static void
to_timespec(int64_t ns, struct timespec *ts)
{
	ts->tv_sec = (time_t)(ns / 1000000000);
	ts->tv_nsec = (long)(ns % 1000000000);
}

static int
cond_init(pthread_cond_t *c)
{
	pthread_condattr_t a;
	int rc;

	if (pthread_condattr_init(&a) != 0)
		return -1;
	rc = pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
	if (rc == 0)
		rc = pthread_cond_init(c, &a);
	pthread_condattr_destroy(&a);
	return rc == 0 ? 0 : -1;
}

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

/* ------------------------------------------------------------------ */
/* Messages: never the password                                        */

/* Copies src into dst (size bytes), cut short if need be. */
static void
copy_str(char *dst, size_t size, const char *src)
{
	size_t n = strlen(src);

	if (n >= size)
		n = size - 1;
	memcpy(dst, src, n);
	dst[n] = '\0';
}

/* Appends src to the string in dst (size bytes), cut short if need be. */
static void
append(char *dst, size_t size, const char *src)
{
	size_t n = strlen(dst);

	if (n + 1 < size)
		copy_str(dst + n, size - n, src);
}

/* Replaces every occurrence of secret in buf (size bytes) by "***". */
static void
mask(char *buf, size_t size, const char *secret)
{
	char out[512];
	size_t n = 0, slen, i = 0;

	if (secret == NULL || (slen = strlen(secret)) == 0)
		return;
	if (size > sizeof out)
		size = sizeof out;
	while (buf[i] != '\0' && n + 1 < size) {
		if (strncmp(buf + i, secret, slen) == 0) {
			for (const char *s = "***"; *s != '\0' && n + 1 < size;
			     s++)
				out[n++] = *s;
			i += slen;
		} else {
			out[n++] = buf[i++];
		}
	}
	out[n] = '\0';
	memcpy(buf, out, n + 1);
}

/* libpq's messages end in newlines and indent with tabs: one line. */
static void
one_line(char *s)
{
	char *w = s;
	bool space = false;

	for (char *r = s; *r != '\0'; r++) {
		if (*r == '\n' || *r == '\t' || *r == '\r' || *r == ' ') {
			space = w != s;
			continue;
		}
		if (space)
			*w++ = ' ';
		space = false;
		*w++ = *r;
	}
	*w = '\0';
}

static void
scrub(const struct pg *p, char *buf, size_t size)
{
	one_line(buf);
	if (p != NULL) {
		mask(buf, size, p->password);
		mask(buf, size, p->raw_password);
	}
}

/* Fills err with status and "postgresql (where): message".  For
 * KL_ETIMEDOUT and KL_ECANCELED with a NULL fmt only the status is set,
 * so that the lock layer words the message. */
static int
fail(const struct pg *p, kl_error *err, int status, const char *fmt, ...)
	__attribute__((format(printf, 4, 5)));

static int
fail(const struct pg *p, kl_error *err, int status, const char *fmt, ...)
{
	char msg[sizeof err->message];
	va_list ap;

	if (err == NULL)
		return status;
	err->status = status;
	err->message[0] = '\0';
	if (fmt == NULL)
		return status;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof msg, fmt, ap);
	va_end(ap);
	/* A message cut short is still worth having. */
	copy_str(err->message, sizeof err->message, "postgresql");
	if (p != NULL && p->where[0] != '\0') {
		append(err->message, sizeof err->message, " (");
		append(err->message, sizeof err->message, p->where);
		append(err->message, sizeof err->message, ")");
	}
	append(err->message, sizeof err->message, ": ");
	append(err->message, sizeof err->message, msg);
	scrub(p, err->message, sizeof err->message);
	return status;
}

/* ------------------------------------------------------------------ */
/* Connections                                                         */

static void
quiet_notices(void *arg, const char *message)
{
	/* The library never prints: pg_advisory_unlock of a lock not held
	 * warns, and the caller learns it from the result. */
	(void)arg;
	(void)message;
}

/* Closes c.  A connection inherited over fork() belongs to the parent's
 * session: PQfinish would write a Terminate message on the shared socket
 * and end it, so the child's descriptor is first pointed at /dev/null
 * (dup2 swaps it in one step, so no other thread can get that number in
 * between) and libpq says goodbye to nobody. */
static void
conn_close(struct conn *c)
{
	int fd, nul;

	if (c == NULL)
		return;
	if (c->pid != getpid() && (fd = PQsocket(c->pg)) >= 0) {
		nul = open("/dev/null", O_RDWR | O_CLOEXEC);
		if (nul >= 0) {
			dup2(nul, fd);
			close(nul);
		}
	}
	PQfinish(c->pg);
	free(c);
}

/* Whether c was opened by this process, not inherited over fork(). */
static bool
conn_ours(const struct conn *c)
{
	return c->pid == getpid();
}

/* Waits until fd is ready for events, cancel fires or deadline passes.
 * Returns 1 ready, 0 deadline, -1 canceled, -2 poll failed. */
static int
wait_fd(int fd, short events, int64_t deadline, kl_cancel *cancel)
{
	struct pollfd pfd = { .fd = fd, .events = events };
	int ms, rc;

	for (;;) {
		if (kl_cancel_fired(cancel))
			return -1;
		ms = ms_until(deadline, cancel != NULL ? SLICE_MS : INT_MAX);
		if (ms == 0 && deadline != NO_DEADLINE && now_ns() >= deadline)
			return 0;
		rc = poll(&pfd, 1, deadline == NO_DEADLINE && cancel == NULL
					   ? -1
					   : ms);
		if (rc > 0)
			return 1;
		if (rc < 0 && errno != EINTR)
			return -2;
	}
}

/* Opens a connection, bounded by connect_timeout (libpq does not enforce
 * it for PQconnectPoll) and the cancel token.  KL_OK, KL_ECANCELED,
 * KL_ENOMEM or KL_EPROVIDER. */
static int
conn_open(struct pg *p, kl_cancel *cancel, struct conn **out, kl_error *err)
{
	PostgresPollingStatusType st = PGRES_POLLING_WRITING;
	int64_t deadline = p->connect_timeout_ms > 0
				   ? deadline_after(p->connect_timeout_ms)
				   : NO_DEADLINE;
	struct conn *c;
	PGconn *pg;
	int rc;

	*out = NULL;
	if ((c = calloc(1, sizeof *c)) == NULL)
		return fail(p, err, KL_ENOMEM, "out of memory");
	if ((pg = PQconnectStartParams(p->keys, p->vals, 0)) == NULL) {
		free(c);
		return fail(p, err, KL_ENOMEM, "out of memory");
	}
	c->pg = pg;
	c->pid = getpid();
	c->lock_timeout_ms = -1;
	PQsetNoticeProcessor(pg, quiet_notices, NULL);
	if (PQstatus(pg) == CONNECTION_BAD)
		st = PGRES_POLLING_FAILED;
	while (st != PGRES_POLLING_OK) {
		if (st == PGRES_POLLING_FAILED) {
			fail(p, err, KL_EPROVIDER, "cannot connect: %s",
			     PQerrorMessage(pg));
			conn_close(c);
			return KL_EPROVIDER;
		}
		rc = wait_fd(PQsocket(pg),
			     st == PGRES_POLLING_READING ? POLLIN : POLLOUT,
			     deadline, cancel);
		if (rc == -1) {
			conn_close(c);
			return fail(p, err, KL_ECANCELED, NULL);
		}
		if (rc == 0) {
			fail(p, err, KL_EPROVIDER,
			     "cannot connect: no answer within %lld ms "
			     "(connect_timeout)",
			     (long long)p->connect_timeout_ms);
			conn_close(c);
			return KL_EPROVIDER;
		}
		if (rc == -2) {
			fail(p, err, KL_EPROVIDER, "cannot connect: poll: %s",
			     strerror(errno));
			conn_close(c);
			return KL_EPROVIDER;
		}
		st = PQconnectPoll(pg);
	}
	*out = c;
	return KL_OK;
}

/* ------------------------------------------------------------------ */
/* Queries                                                             */

/* What the server answered to one query string. */
struct answer {
	bool failed;       /* one of its statements failed (the first kept) */
	char sqlstate[6];
	char message[200];
	int nvals;         /* columns read from the last row returned */
	bool null[2];
	int64_t val[2];
	int stopped;       /* a cancel request was sent: KL_ECANCELED or
			      KL_ETIMEDOUT, why */
};

static void
take_result(struct answer *a, PGresult *r)
{
	const char *s;

	switch (PQresultStatus(r)) {
	case PGRES_COMMAND_OK:
		break;
	case PGRES_TUPLES_OK:
		a->nvals = 0;
		if (PQntuples(r) < 1)
			break;
		for (int i = 0; i < PQnfields(r) && i < 2; i++) {
			a->null[i] = PQgetisnull(r, 0, i);
			a->val[i] = a->null[i] ? 0
					       : strtoll(PQgetvalue(r, 0, i),
							 NULL, 10);
			a->nvals = i + 1;
		}
		break;
	default:
		if (a->failed)
			break;
		a->failed = true;
		s = PQresultErrorField(r, PG_DIAG_SQLSTATE);
		snprintf(a->sqlstate, sizeof a->sqlstate, "%s",
			 s != NULL ? s : "");
		s = PQresultErrorField(r, PG_DIAG_MESSAGE_PRIMARY);
		if (s == NULL)
			s = PQresultErrorMessage(r);
		snprintf(a->message, sizeof a->message, "%s",
			 s != NULL && s[0] != '\0' ? s : "unexpected result");
		break;
	}
}

static bool
send_cancel(PGconn *pg)
{
	PGcancel *pc = PQgetCancel(pg);
	char buf[256];
	bool ok;

	if (pc == NULL)
		return false;
	ok = PQcancel(pc, buf, sizeof buf) == 1;
	PQfreeCancel(pc);
	return ok;
}

/*
 * Sends sql on c (or, with stmt, runs the session's prepared statement
 * stmt with id as its one parameter: no text to parse, no plan to make)
 * and reads every result into a.  Until the answer comes:
 * when cancel fires, or deadline passes with late == KL_ETIMEDOUT, a
 * cancel request is sent (a->stopped says why) and the answer still
 * awaited, at most SHORT_OP_MS more; when deadline passes with late ==
 * KL_EPROVIDER the server is deemed gone.  Returns KL_OK when the server
 * answered (a->failed tells whether a statement failed), else KL_EPROVIDER
 * with c->broken set and err filled: the connection, and any lock it held,
 * must be dropped.
 */
static int
run_q(struct pg *p, struct conn *c, const char *sql, const char *stmt,
      int64_t id, int64_t deadline, int late, kl_cancel *cancel,
      struct answer *a, kl_error *err)
{
	PGconn *pg = c->pg;
	int64_t give_up = NO_DEADLINE, until;
	char idbuf[24];
	const char *params[1] = { idbuf };
	PGresult *r;
	int rc, sent;

	memset(a, 0, sizeof *a);
	sent = 0;
	if (PQstatus(pg) == CONNECTION_OK) {
		if (stmt != NULL) {
			snprintf(idbuf, sizeof idbuf, "%" PRId64, id);
			sent = PQsendQueryPrepared(pg, stmt, 1, params, NULL,
						   NULL, 0);
		} else {
			sent = PQsendQuery(pg, sql);
		}
	}
	if (!sent) {
		c->broken = true;
		return fail(p, err, KL_EPROVIDER, "connection lost: %s",
			    PQerrorMessage(pg));
	}
	for (;;) {
		while (!PQisBusy(pg)) {
			if ((r = PQgetResult(pg)) == NULL)
				goto done;
			take_result(a, r);
			PQclear(r);
		}
		if (a->stopped == 0) {
			if (kl_cancel_fired(cancel))
				a->stopped = KL_ECANCELED;
			else if (deadline != NO_DEADLINE &&
				 now_ns() >= deadline) {
				if (late != KL_ETIMEDOUT) {
					c->broken = true;
					return fail(p, err, KL_EPROVIDER,
						    "no answer from the server "
						    "in time");
				}
				a->stopped = KL_ETIMEDOUT;
			}
			if (a->stopped != 0) {
				if (!send_cancel(pg)) {
					c->broken = true;
					return fail(p, err, KL_EPROVIDER,
						    "cannot send a cancel "
						    "request");
				}
				give_up = deadline_after(SHORT_OP_MS);
			}
		}
		until = a->stopped != 0 ? give_up : deadline;
		rc = wait_fd(PQsocket(pg), POLLIN, until,
			     a->stopped != 0 ? NULL : cancel);
		if (rc == 0 && a->stopped != 0) {
			c->broken = true;
			return fail(p, err, KL_EPROVIDER,
				    "no answer to a cancel request");
		}
		if (rc == -2) {
			c->broken = true;
			return fail(p, err, KL_EPROVIDER, "poll: %s",
				    strerror(errno));
		}
		if (rc == 1 && !PQconsumeInput(pg)) {
			c->broken = true;
			return fail(p, err, KL_EPROVIDER, "connection lost: %s",
				    PQerrorMessage(pg));
		}
	}
done:
	if (PQstatus(pg) != CONNECTION_OK) {
		c->broken = true;
		return fail(p, err, KL_EPROVIDER, "connection lost: %s",
			    a->failed ? a->message : PQerrorMessage(pg));
	}
	return KL_OK;
}

/* run_q of the text sql. */
static int
run(struct pg *p, struct conn *c, const char *sql, int64_t deadline,
    int late, kl_cancel *cancel, struct answer *a, kl_error *err)
{
	return run_q(p, c, sql, NULL, 0, deadline, late, cancel, a, err);
}

/* A short query (text sql, or the prepared stmt of id) whose failure makes
 * the connection unusable: KL_OK, or KL_EPROVIDER with c->broken set. */
static int
run_short_q(struct pg *p, struct conn *c, const char *sql, const char *stmt,
	    int64_t id, struct answer *a, kl_error *err)
{
	int rc = run_q(p, c, sql, stmt, id, deadline_after(SHORT_OP_MS),
		       KL_EPROVIDER, NULL, a, err);

	if (rc == KL_OK && a->failed) {
		/* c is never NULL: clang-analyzer takes aux_run's second
		 * conn_open for one that returns KL_OK without a connection. */
		/* NOLINTNEXTLINE(clang-analyzer-core.NullDereference) */
		c->broken = true;
		rc = fail(p, err, KL_EPROVIDER, "%s", a->message);
	}
	return rc;
}

static int
run_short(struct pg *p, struct conn *c, const char *sql, struct answer *a,
	  kl_error *err)
{
	return run_short_q(p, c, sql, NULL, 0, a, err);
}

/* Drops every advisory lock of the session; a connection serves one lease
 * at a time, so that is exactly the one in doubt. */
static void
unlock_all(struct pg *p, struct conn *c)
{
	struct answer a;

	run_short(p, c, "SELECT pg_catalog.pg_advisory_unlock_all()", &a,
		  NULL);
}

/* ------------------------------------------------------------------ */
/* The pool                                                            */

/* Takes a pool slot, in arrival order, waiting until deadline or cancel:
 * *c is then an idle connection, or NULL (open one).  KL_OK, KL_ETIMEDOUT
 * or KL_ECANCELED. */
static int
slot_get(struct pg *p, int64_t deadline, kl_cancel *cancel, struct conn **c)
{
	struct slot_waiter w;
	struct timespec ts;
	int64_t until;
	int rc = KL_OK;

	*c = NULL;
	pthread_mutex_lock(&p->mu);
	if (p->wq_head == NULL && p->in_use < p->pool_max) {
		p->in_use++;
		if ((*c = p->idle) != NULL)
			p->idle = (*c)->next;
		pthread_mutex_unlock(&p->mu);
		goto got;
	}
	if (cond_init(&w.cond) != 0) {
		pthread_mutex_unlock(&p->mu);
		return KL_ENOMEM;
	}
	w.next = NULL;
	w.granted = false;
	w.conn = NULL;
	if (p->wq_tail != NULL)
		p->wq_tail->next = &w;
	else
		p->wq_head = &w;
	p->wq_tail = &w;
	while (!w.granted) {
		if (kl_cancel_fired(cancel))
			rc = KL_ECANCELED;
		else if (deadline != NO_DEADLINE && now_ns() >= deadline)
			rc = KL_ETIMEDOUT;
		if (rc != KL_OK)
			break;
		until = deadline;
		if (cancel != NULL) {
			int64_t slice = now_ns() + SLICE_MS * 1000000LL;

			if (slice < until)
				until = slice;
		}
		if (until == NO_DEADLINE) {
			pthread_cond_wait(&w.cond, &p->mu);
		} else {
			to_timespec(until, &ts);
			pthread_cond_timedwait(&w.cond, &p->mu, &ts);
		}
	}
	if (w.granted) {
		/* A grant settled under the lock wins over a timeout or a
		 * cancel seen after it. */
		rc = KL_OK;
		*c = w.conn;
	} else {
		struct slot_waiter **pp = &p->wq_head, *prev = NULL;

		while (*pp != &w) {
			prev = *pp;
			pp = &(*pp)->next;
		}
		*pp = w.next;
		if (p->wq_tail == &w)
			p->wq_tail = prev;
	}
	pthread_mutex_unlock(&p->mu);
	pthread_cond_destroy(&w.cond);
	if (rc != KL_OK)
		return rc;
got:
	/* The child of a fork() never writes on its parent's sessions: an
	 * inherited idle connection is dropped and a new one opened. */
	if (*c != NULL && !conn_ours(*c)) {
		conn_close(*c);
		*c = NULL;
	}
	return KL_OK;
}

/* Gives a slot back with its connection (NULL: closed), handing both to
 * the first waiter if any. */
static void
slot_put(struct pg *p, struct conn *c)
{
	struct slot_waiter *w;

	if (c != NULL && c->broken) {
		conn_close(c);
		c = NULL;
	}
	pthread_mutex_lock(&p->mu);
	if ((w = p->wq_head) != NULL) {
		p->wq_head = w->next;
		if (p->wq_head == NULL)
			p->wq_tail = NULL;
		w->granted = true;
		w->conn = c;
		pthread_cond_signal(&w->cond);
	} else {
		p->in_use--;
		if (c != NULL) {
			c->next = p->idle;
			p->idle = c;
		}
	}
	pthread_mutex_unlock(&p->mu);
}

/* ------------------------------------------------------------------ */
/* Acquire                                                             */

/* What a failed statement of lock_on means: KL_EPROVIDER, with c->broken
 * set (a lock it may hold goes with it). */
static int
lock_error(struct pg *p, struct conn *c, const struct answer *a,
	   kl_error *err)
{
	c->broken = true;
	if (strcmp(a->sqlstate, "42P01") == 0)
		return fail(p, err, KL_EPROVIDER,
			    "the fence sequence %s is missing: %s",
			    p->fence.name, a->message);
	return fail(p, err, KL_EPROVIDER, "%s%s%s", a->message,
		    a->sqlstate[0] != '\0' ? " SQLSTATE " : "", a->sqlstate);
}

/*
 * What a new session runs, once, in front of its first STMT_TRY (in the
 * same query string, one transaction: no round trip of its own):
 * statement_timeout 0 (a server default must not cut a wait the caller
 * allowed), synchronous_commit off (a fence must not wait for a WAL
 * flush: src/pg_fence.c says why that is safe), two prepared statements
 * (SQL PREPARE makes them for PQsendQueryPrepared too), so that an
 * uncontended acquire and a release are then one statement each, bound
 * and run without being parsed again, and the floor of the fence
 * sequence.  STMT_TRY takes the lock only if it is free
 * (pg_try_advisory_lock does not barge past queued waiters) and, in the
 * same statement, draws a fence only once it has it (CASE); STMT_UNLOCK
 * releases.
 */
#define TRY_SQL                                                              \
	"SELECT CASE WHEN pg_catalog.pg_try_advisory_lock(%s) THEN %s END"

static int
make_setup_sql(struct pg *p)
{
	char try[sizeof p->fence.draw + 80];
	int n;

	n = snprintf(try, sizeof try, TRY_SQL, "$1", p->fence.draw);
	if (n < 0 || (size_t)n >= sizeof try)
		return -1;
	n = snprintf(p->setup_sql, sizeof p->setup_sql,
		     "SET statement_timeout = 0; SET synchronous_commit = off; "
		     "PREPARE " STMT_TRY "(bigint) AS %s; PREPARE " STMT_UNLOCK
		     "(bigint) AS SELECT "
		     "pg_catalog.pg_advisory_unlock($1)::int; %s",
		     try, p->fence.floor);
	return n < 0 || (size_t)n >= sizeof p->setup_sql ? -1 : 0;
}

/* lock_answer: the try found the key taken (not a KL_* status). */
#define NOT_GRANTED 1

/*
 * Settles the answer a to STMT_TRY or to a wait, rc being what run_q
 * returned.  KL_OK with *fence; NOT_GRANTED: the try found the key taken;
 * KL_ETIMEDOUT, KL_ECANCELED with c holding no lock; KL_EPROVIDER.
 * c->broken is set when c must be closed (which drops any lock it holds).
 */
static int
lock_answer(struct pg *p, struct conn *c, int rc, const struct answer *a,
	    kl_cancel *cancel, uint64_t *fence, kl_error *err)
{
	if (rc != KL_OK) {
		/* The connection goes, and any lock with it; a wait we had
		 * asked to stop ends as we asked. */
		if (a->stopped != 0)
			return fail(p, err, a->stopped, NULL);
		return rc;
	}
	if (a->failed) {
		if (a->stopped != 0 && strcmp(a->sqlstate, "57014") == 0) {
			/* Our cancel request ended the query.  It may have
			 * hit nextval after a grant: drop what the session
			 * holds. */
			unlock_all(p, c);
			return fail(p, err, a->stopped, NULL);
		}
		if (a->stopped != 0) {
			/* The cancel request may still be pending. */
			c->broken = true;
			return fail(p, err, a->stopped, NULL);
		}
		if (strcmp(a->sqlstate, "55P03") == 0) {
			/* lock_timeout.  Mostly the advisory lock's wait;
			 * but the draw may have waited too (for the
			 * floor's lock, src/pg_fence.c) after the grant,
			 * and a session lock outlives its failed
			 * transaction: drop what the session holds, which
			 * can only be this key. */
			if (PQtransactionStatus(c->pg) != PQTRANS_IDLE)
				c->broken = true;
			else
				unlock_all(p, c);
			return fail(p, err, KL_ETIMEDOUT, NULL);
		}
		return lock_error(p, c, a, err);
	}
	if (a->nvals < 1) {
		c->broken = true;
		return fail(p, err, KL_EPROVIDER, "unexpected answer");
	}
	if (a->stopped != 0) {
		/* Answered (granted or not) before our cancel request
		 * arrived; the request may still be pending, so the
		 * connection goes, and any lock with it. */
		c->broken = true;
		return fail(p, err, a->stopped, NULL);
	}
	if (a->null[0])
		return NOT_GRANTED; /* pg_try_advisory_lock said no */
	if (kl_cancel_fired(cancel)) {
		/* Fired while the grant was on its way: once
		 * kl_cancel_fire has returned, no later grant. */
		unlock_all(p, c);
		return fail(p, err, KL_ECANCELED, NULL);
	}
	if (a->val[0] < p->fence_min) {
		/* Closing the session drops the key; the next session
		 * floors the sequence again. */
		c->broken = true;
		return fail(p, err, KL_EPROVIDER,
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
 * Waits on c for lock id until deadline (NO_DEADLINE: forever; past: try
 * once) or cancel.  KL_OK with *fence; KL_ETIMEDOUT, KL_ECANCELED with c
 * holding no lock; KL_EPROVIDER.  c->broken is set when c must be closed
 * (which drops any lock it holds).
 *
 * First STMT_TRY: a key nobody holds or waits for costs one round trip and
 * one statement, and no setting.  Only when it is taken does the wait
 * follow, as one simple-query string.
 */
static int
lock_on(struct pg *p, struct conn *c, int64_t id, int64_t deadline,
	kl_cancel *cancel, uint64_t *fence, kl_error *err)
{
	struct answer a;
	char sql[sizeof p->setup_sql + sizeof p->fence.draw + 160], set[96],
		idbuf[24];
	int64_t left_ms, client_deadline;
	int late, rc;
	bool try_once, setup, sent_st, sent_lt, ok;

	if (kl_cancel_fired(cancel))
		return fail(p, err, KL_ECANCELED, NULL);
	try_once = deadline != NO_DEADLINE && deadline <= now_ns();
	if ((setup = !c->prepared)) {
		snprintf(idbuf, sizeof idbuf, "%" PRId64, id);
		snprintf(sql, sizeof sql, "%s" TRY_SQL, p->setup_sql, idbuf,
			 p->fence.draw);
		rc = run(p, c, sql, deadline_after(SHORT_OP_MS), KL_EPROVIDER,
			 cancel, &a, err);
		if (rc == KL_OK && !a.failed && a.stopped == 0) {
			c->prepared = true;
			c->no_statement_timeout = true;
		}
	} else {
		rc = run_q(p, c, NULL, STMT_TRY, id,
			   deadline_after(SHORT_OP_MS), KL_EPROVIDER, cancel,
			   &a, err);
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
		rc = c->broken ? fail(p, err, KL_EPROVIDER,
				      "the fence sequence %s is locked "
				      "(lock_timeout)",
				      p->fence.name)
			       : NOT_GRANTED;
	}
	if (rc != NOT_GRANTED)
		return rc;
	if (try_once)
		return fail(p, err, KL_ETIMEDOUT, NULL);
	if (kl_cancel_fired(cancel))
		return fail(p, err, KL_ECANCELED, NULL);

	/* The server times the wait out with lock_timeout (ms, an int, 0 =
	 * none).  Past INT_MAX ms it waits without limit and the client
	 * cancels at the deadline instead. */
	left_ms = deadline == NO_DEADLINE
			  ? 0
			  : (deadline - now_ns() + 999999) / 1000000;
	if (left_ms < 1 && deadline != NO_DEADLINE)
		left_ms = 1;
	if (left_ms > INT_MAX) {
		left_ms = 0;
		client_deadline = deadline;
		late = KL_ETIMEDOUT;
	} else if (left_ms == 0) {
		client_deadline = NO_DEADLINE;
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
		append(set, sizeof set, "SET statement_timeout = 0; ");
	if (sent_lt)
		snprintf(set + strlen(set), sizeof set - strlen(set),
			 "SET lock_timeout = %" PRId64 "; ", left_ms);
	snprintf(sql, sizeof sql,
		 "%sWITH l AS (SELECT pg_catalog.pg_advisory_lock(%" PRId64
		 ")) SELECT %s FROM l",
		 set, id, p->fence.draw);
	rc = run(p, c, sql, client_deadline, late, cancel, &a, err);
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
		rc = fail(p, err, KL_EPROVIDER, "unexpected answer");
	}
	return rc;
}

static bool
held_by_caller(struct pg *p, int64_t id, uint64_t check)
{
	uint64_t self = thread_id();
	bool found = false;

	pthread_mutex_lock(&p->mu);
	for (struct pg_lease *l = p->leases; l != NULL; l = l->next)
		if (l->id == id && l->check == check && !l->releasing &&
		    l->owner == self) {
			found = true;
			break;
		}
	pthread_mutex_unlock(&p->mu);
	return found;
}

static int
pg_acquire(void *impl, const char *key, size_t key_len, kl_cancel *cancel,
	   int64_t timeout_ms, int64_t ttl_ms, unsigned flags, void **lease,
	   uint64_t *fence, kl_error *err)
{
	struct pg *p = impl;
	struct pg_lease *l;
	struct conn *c;
	int64_t deadline;
	uint64_t got = 0;
	bool fresh, stale;
	int rc;

	(void)ttl_ms; /* held until released or the session ends */
	*lease = NULL;
	*fence = 0;
	if (kl_cancel_fired(cancel))
		return fail(p, err, KL_ECANCELED, NULL);
	deadline = deadline_after(timeout_ms);
	/* Made first, so that nothing can fail once the key is held. */
	if ((l = calloc(1, sizeof *l)) == NULL)
		return fail(p, err, KL_ENOMEM, "out of memory");
	l->id = kl_pg_key_id(key, key_len);
	l->check = key_check(key, key_len);
	l->owner = thread_id();
	if ((flags & KL_ERRORCHECK) != 0 &&
	    held_by_caller(p, l->id, l->check)) {
		free(l);
		return fail(p, err, KL_EDEADLK,
			    "this thread already holds the key");
	}
	if ((rc = slot_get(p, deadline, cancel, &c)) != KL_OK) {
		free(l);
		return fail(p, err, rc, NULL);
	}
	for (;;) {
		fresh = c == NULL;
		if (fresh && (rc = conn_open(p, cancel, &c, err)) != KL_OK) {
			slot_put(p, NULL);
			free(l);
			return rc;
		}
		rc = lock_on(p, c, l->id, deadline, cancel, &got, err);
		/* An idle connection that died meanwhile (a server
		 * restart) held nothing: try once more on a new one. */
		stale = !fresh && c->broken && rc == KL_EPROVIDER &&
			PQstatus(c->pg) != CONNECTION_OK;
		if (!stale)
			break;
		conn_close(c);
		c = NULL;
	}
	if (rc != KL_OK) {
		slot_put(p, c);
		free(l);
		return rc;
	}
	l->conn = c;
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

static bool
on_health_thread(struct pg *p)
{
	return p->health_started && pthread_equal(pthread_self(), p->health);
}

static int
pg_release(void *impl, void *handle, kl_error *err)
{
	struct pg *p = impl;
	struct pg_lease *l = handle;
	struct conn *c = l->conn;
	struct answer a;
	char why[sizeof l->why];
	bool lost, in_callback;
	int rc;

	pthread_mutex_lock(&p->mu);
	l->releasing = true;
	in_callback = on_health_thread(p);
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
		rc = fail(p, err, KL_EPROVIDER, "the lock was lost: %s", why);
	} else if (!conn_ours(c)) {
		/* A lease inherited over fork(): its session is the
		 * parent's, which keeps the lock. */
		c->broken = true;
		rc = fail(p, err, KL_EPROVIDER,
			  "the lease belongs to the parent process (fork)");
	} else {
		/* lock_on readied the session (SETUP_SQL): one
		 * prepared statement. */
		rc = run_short_q(p, c, NULL, STMT_UNLOCK, l->id, &a, err);
		if (rc == KL_OK && (a.nvals < 1 || a.null[0])) {
			c->broken = true;
			rc = fail(p, err, KL_EPROVIDER, "unexpected answer");
		} else if (rc == KL_OK && a.val[0] == 0) {
			rc = fail(p, err, KL_EPROVIDER,
				  "the lock was not held by its session");
		} else if (rc != KL_OK) {
			/* The connection is closed below, which drops the
			 * lock all the same. */
		}
	}
	slot_put(p, c);
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
	struct pg *p = impl;
	struct pg_lease *l = handle;
	bool lost;

	pthread_mutex_lock(&p->mu);
	lost = l->lost;
	pthread_mutex_unlock(&p->mu);
	return !lost;
}

static void
pg_watch(void *impl, void *handle, void (*lost)(void *ctx), void *ctx)
{
	struct pg *p = impl;
	struct pg_lease *l = handle;

	pthread_mutex_lock(&p->mu);
	l->lost_fn = lost;
	l->lost_ctx = ctx;
	/* Lost before anyone watched: report it now rather than a whole
	 * interval later. */
	if (l->lost)
		pthread_cond_signal(&p->wake);
	pthread_mutex_unlock(&p->mu);
}

/* SELECT 1 on the lease's connection; false (and l->why) when it failed.
 * Called with l busy and no lock held. */
static bool
ping(struct pg *p, struct pg_lease *l)
{
	struct answer a;
	kl_error err;

	err.message[0] = '\0';
	if (run_short(p, l->conn, "SELECT 1", &a, &err) == KL_OK)
		return true;
	copy_str(l->why, sizeof l->why, err.message);
	return false;
}

/* One look at every lease: ping the held ones, report the lost ones.
 * p->mu held; dropped around each ping and callback, after which the scan
 * starts over (the list may have changed), skipping leases seen in this
 * round. */
static void
health_round(struct pg *p)
{
	struct pg_lease *l;
	void (*fn)(void *ctx);
	void *ctx;
	bool ok;

	p->round++;
again:
	for (l = p->leases; l != NULL && !p->stop; l = l->next) {
		if (l->round == p->round || l->releasing)
			continue;
		l->round = p->round;
		if (!l->lost) {
			l->busy = true;
			pthread_mutex_unlock(&p->mu);
			ok = ping(p, l);
			pthread_mutex_lock(&p->mu);
			l->busy = false;
			if (!ok)
				l->lost = true;
			pthread_cond_broadcast(&p->idle_cond);
		}
		if (l->lost && l->lost_fn != NULL && !l->notified &&
		    !l->releasing) {
			l->notified = true;
			l->busy = true;
			fn = l->lost_fn;
			ctx = l->lost_ctx;
			pthread_mutex_unlock(&p->mu);
			fn(ctx);
			pthread_mutex_lock(&p->mu);
			l->busy = false;
			pthread_cond_broadcast(&p->idle_cond);
			if (l->free_me)
				free(l); /* released by the callback */
		}
		goto again;
	}
}

/* Whether a lost lease waits for its callback.  p->mu held. */
static bool
report_pending(struct pg *p)
{
	for (struct pg_lease *l = p->leases; l != NULL; l = l->next)
		if (l->lost && l->lost_fn != NULL && !l->notified &&
		    !l->releasing)
			return true;
	return false;
}

static void *
health_main(void *arg)
{
	struct pg *p = arg;
	struct timespec ts;
	int64_t next;

	pthread_mutex_lock(&p->mu);
	next = now_ns() + p->health_ms * 1000000;
	while (!p->stop) {
		/* Sleeps until the next round, unless pg_watch wakes it
		 * for a lease that was lost before it was watched. */
		if (now_ns() < next && !report_pending(p)) {
			to_timespec(next, &ts);
			pthread_cond_timedwait(&p->wake, &p->mu, &ts);
			continue;
		}
		health_round(p);
		next = now_ns() + p->health_ms * 1000000;
	}
	pthread_mutex_unlock(&p->mu);
	return NULL;
}

/* ------------------------------------------------------------------ */
/* Status                                                              */

/* Runs sql on the aux connection, opening it when needed; with strict, a
 * failed statement is KL_EPROVIDER, else the caller reads a->failed.  A
 * broken connection is closed, to be opened again next time. */
static int
aux_run(struct pg *p, const char *sql, bool strict, struct answer *a,
	kl_error *err)
{
	struct conn *c;
	bool fresh, stale;
	int rc;

	pthread_mutex_lock(&p->aux_mu);
	if (p->aux != NULL && !conn_ours(p->aux)) {
		conn_close(p->aux); /* inherited over fork() */
		p->aux = NULL;
	}
	for (;;) {
		fresh = p->aux == NULL;
		if (fresh && (rc = conn_open(p, NULL, &p->aux, err)) != KL_OK)
			break;
		c = p->aux;
		if (strict)
			rc = run_short(p, c, sql, a, err);
		else
			rc = run(p, c, sql, deadline_after(SHORT_OP_MS),
				 KL_EPROVIDER, NULL, a, err);
		/* conn_open gives KL_OK only with a connection (see
		 * run_short_q). */
		/* NOLINTNEXTLINE(clang-analyzer-core.NullDereference) */
		if (!c->broken)
			break;
		/* One that died while idle is replaced, once. */
		stale = !fresh && PQstatus(c->pg) != CONNECTION_OK;
		conn_close(c);
		p->aux = NULL;
		if (!stale)
			break;
	}
	pthread_mutex_unlock(&p->aux_mu);
	return rc;
}

static int
pg_status(void *impl, const char *key, size_t key_len, size_t *holders,
	  size_t *waiters, kl_error *err)
{
	struct pg *p = impl;
	uint64_t id = (uint64_t)kl_pg_key_id(key, key_len);
	struct answer a;
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
	if ((rc = aux_run(p, sql, true, &a, err)) != KL_OK)
		return rc;
	if (a.nvals < 2 || a.null[0] || a.null[1])
		return fail(p, err, KL_EPROVIDER, "unexpected answer");
	*holders = (size_t)a.val[0];
	*waiters = (size_t)a.val[1];
	return KL_OK;
}

/* ------------------------------------------------------------------ */
/* Open and destroy                                                    */

static void
pg_free(struct pg *p)
{
	struct conn *c;
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
		conn_close(c);
	}
	conn_close(p->aux);
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

/* The password as written in the URI (between the first ':' of the
 * user info and its '@'), or NULL: libpq may quote it undecoded when it
 * cannot parse it. */
static char *
raw_password_of(const char *uri)
{
	const char *s = strstr(uri, "://"), *end, *colon;

	if (s == NULL)
		return NULL;
	s += 3;
	end = s + strcspn(s, "/?#");
	colon = memchr(s, ':', (size_t)(end - s));
	for (const char *at = end; at > s; at--) {
		if (at[-1] == '@') {
			if (colon == NULL || colon >= at - 1)
				return NULL;
			return strndup(colon + 1, (size_t)(at - 1 - colon - 1));
		}
	}
	return NULL;
}

/* Parses one of our options.  KL_OK or KL_EINVAL. */
static int
take_option(struct pg *p, const char *name, size_t nlen, const char *val,
	    size_t vlen, bool *ours, kl_error *err)
{
	char buf[32];
	char *end;
	int64_t ms;
	long n;

	*ours = false;
	if (nlen == 14 && memcmp(name, "fence_sequence", 14) == 0) {
		*ours = true;
		if (kl__pg_fence_init(&p->fence, val, vlen) != 0)
			return fail(NULL, err, KL_EINVAL,
				    "bad fence_sequence '%.*s' (schema.name)",
				    (int)(vlen < 140 ? vlen : 140), val);
		return KL_OK;
	}
	if (vlen >= sizeof buf)
		vlen = sizeof buf - 1;
	memcpy(buf, val, vlen);
	buf[vlen] = '\0';
	if (nlen == 4 && memcmp(name, "pool", 4) == 0) {
		*ours = true;
		errno = 0;
		n = strtol(buf, &end, 10);
		if (buf[0] < '0' || buf[0] > '9' || *end != '\0' ||
		    errno != 0 || n < 1 || n > MAX_POOL)
			return fail(NULL, err, KL_EINVAL,
				    "bad pool size '%s' (1..%d)", buf,
				    MAX_POOL);
		p->pool_max = (size_t)n;
	} else if (nlen == 15 && memcmp(name, "health_interval", 15) == 0) {
		*ours = true;
		if (kl_duration_parse(buf, &ms) != KL_OK ||
		    ms < MIN_HEALTH_MS || ms > MAX_HEALTH_MS)
			return fail(NULL, err, KL_EINVAL,
				    "bad health_interval '%s' (10ms..1h)",
				    buf);
		p->health_ms = ms;
	}
	return KL_OK;
}

/* Copies uri into *out without our query parameters, reading them into p.
 * KL_OK, KL_EINVAL or KL_ENOMEM. */
static int
strip_options(struct pg *p, const char *uri, char **out, kl_error *err)
{
	const char *q = strchr(uri, '?'), *s, *amp, *eq;
	size_t len = strlen(uri), n;
	char *res;
	bool ours, first = true;
	int rc;

	*out = NULL;
	if ((res = malloc(len + 1)) == NULL)
		return fail(NULL, err, KL_ENOMEM, "out of memory");
	if (q == NULL) {
		memcpy(res, uri, len + 1);
		*out = res;
		return KL_OK;
	}
	n = (size_t)(q - uri);
	memcpy(res, uri, n);
	for (s = q + 1; *s != '\0'; s = *amp != '\0' ? amp + 1 : amp) {
		amp = s + strcspn(s, "&");
		eq = memchr(s, '=', (size_t)(amp - s));
		if (eq != NULL) {
			rc = take_option(p, s, (size_t)(eq - s), eq + 1,
					 (size_t)(amp - eq - 1), &ours, err);
			if (rc != KL_OK) {
				free(res);
				return rc;
			}
			if (ours)
				continue;
		}
		res[n++] = first ? '?' : '&';
		first = false;
		memcpy(res + n, s, (size_t)(amp - s));
		n += (size_t)(amp - s);
	}
	res[n] = '\0';
	*out = res;
	return KL_OK;
}

static const char *
opt_value(const PQconninfoOption *o, const char *name)
{
	for (; o != NULL && o->keyword != NULL; o++)
		if (strcmp(o->keyword, name) == 0)
			return o->val != NULL && o->val[0] != '\0' ? o->val
								   : NULL;
	return NULL;
}

/* Reads the URI into p: options, keywords for libpq, the description used
 * in messages.  KL_OK, KL_EINVAL, KL_ENOMEM. */
static int
parse_uri(struct pg *p, const char *uri, kl_error *err)
{
	const PQconninfoOption *o;
	const char *host, *port, *db, *ct;
	char *stripped, *perr = NULL;
	size_t n = 0, cap = 3;
	int rc, len;

	p->raw_password = raw_password_of(uri);
	if ((rc = strip_options(p, uri, &stripped, err)) != KL_OK)
		return rc;
	p->opts = PQconninfoParse(stripped, &perr);
	free(stripped);
	if (p->opts == NULL) {
		if (perr == NULL)
			return fail(p, err, KL_ENOMEM, "out of memory");
		fail(p, err, KL_EINVAL, "malformed URI: %s", perr);
		PQfreemem(perr);
		return KL_EINVAL;
	}
	for (o = p->opts; o->keyword != NULL; o++)
		cap++;
	p->keys = calloc(cap, sizeof *p->keys);
	p->vals = calloc(cap, sizeof *p->vals);
	if (p->keys == NULL || p->vals == NULL)
		return fail(p, err, KL_ENOMEM, "out of memory");
	/* Our defaults first: libpq keeps the last value given for a key,
	 * so the URI's own win. */
	if (opt_value(p->opts, "connect_timeout") == NULL) {
		p->keys[n] = "connect_timeout";
		p->vals[n++] = DEFAULT_CONNECT_TIMEOUT;
	}
	if (opt_value(p->opts, "application_name") == NULL) {
		p->keys[n] = "application_name";
		p->vals[n++] = "keylock";
	}
	for (o = p->opts; o->keyword != NULL; o++) {
		if (o->val == NULL)
			continue;
		p->keys[n] = o->keyword;
		p->vals[n++] = o->val;
	}
	p->keys[n] = NULL;
	p->vals[n] = NULL;

	if (opt_value(p->opts, "password") != NULL &&
	    (p->password = strdup(opt_value(p->opts, "password"))) == NULL)
		return fail(p, err, KL_ENOMEM, "out of memory");
	ct = opt_value(p->opts, "connect_timeout");
	if (ct == NULL)
		ct = DEFAULT_CONNECT_TIMEOUT;
	else if (strspn(ct, "0123456789") != strlen(ct) || strlen(ct) > 6)
		return fail(p, err, KL_EINVAL, "bad connect_timeout '%s'", ct);
	/* libpq's rule: seconds, 0 = none, 1 is taken as 2. */
	p->connect_timeout_ms = strtoll(ct, NULL, 10) * 1000;
	if (p->connect_timeout_ms == 1000)
		p->connect_timeout_ms = 2000;

	host = opt_value(p->opts, "host");
	if (host == NULL)
		host = opt_value(p->opts, "hostaddr");
	port = opt_value(p->opts, "port");
	db = opt_value(p->opts, "dbname");
	len = snprintf(p->where, sizeof p->where, "host %s port %s database %s",
		       host != NULL ? host : "(default)",
		       port != NULL ? port : "(default)",
		       db != NULL ? db : "(default)");
	if (len < 0)
		p->where[0] = '\0';
	scrub(p, p->where, sizeof p->where);
	return KL_OK;
}

/* Makes sure the fence sequence exists and is one this role can draw
 * from and floor: the shared one, by its schema-qualified name.  Checked
 * before creating, so that a role without CREATE on the schema can use a
 * sequence made for it; losing a creation race to another process is
 * fine. */
static int
ensure_sequence(struct pg *p, kl_error *err)
{
	struct answer a;
	char sql[sizeof p->fence.ident + 64];
	int rc;

	for (int tries = 0;; tries++) {
		if ((rc = aux_run(p, p->fence.check, true, &a, err)) != KL_OK)
			return rc;
		if (a.nvals >= 2 && !a.null[0] && a.val[0] == KL__PG_FENCE_OK) {
			p->fence_min = a.null[1] ? 0 : a.val[1];
			return KL_OK;
		}
		if (a.nvals >= 1)
			return fail(p, err, KL_EPROVIDER,
				    "the fence sequence %s %s", p->fence.name,
				    kl__pg_fence_problem((int)a.val[0]));
		if (tries > 0)
			return fail(p, err, KL_EPROVIDER,
				    "the fence sequence %s was created but "
				    "cannot be found",
				    p->fence.name);
		snprintf(sql, sizeof sql, "CREATE SEQUENCE IF NOT EXISTS %s",
			 p->fence.ident);
		rc = aux_run(p, sql, false, &a, err);
		if (rc != KL_OK)
			return rc;
		if (a.failed && strcmp(a.sqlstate, "42P07") != 0 &&
		    strcmp(a.sqlstate, "23505") != 0)
			return fail(p, err, KL_EPROVIDER,
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
};

int
kl_pg_provider_open(kl_provider **out, const char *uri, kl_error *err)
{
	sigset_t all, old;
	struct pg *p;
	int rc;

	if (out != NULL)
		*out = NULL;
	if (out == NULL || uri == NULL)
		return fail(NULL, err, KL_EINVAL, "no provider URI given");
	if (!has_prefix(uri, "postgresql://") &&
	    !has_prefix(uri, "postgres://"))
		return fail(NULL, err, KL_EINVAL,
			    "not a postgresql:// or postgres:// URI");
	if (!PQisthreadsafe())
		return fail(NULL, err, KL_EPROVIDER,
			    "libpq was built without thread safety");
	if ((p = calloc(1, sizeof *p)) == NULL)
		return fail(NULL, err, KL_ENOMEM, "out of memory");
	p->pool_max = DEFAULT_POOL;
	p->health_ms = DEFAULT_HEALTH_MS;
	(void)kl__pg_fence_init(&p->fence, NULL, 0); /* fits */
	/* Only a system out of resources fails these (glibc's never do);
	 * the memory is freed, the half-made objects need nothing more. */
	if (pthread_mutex_init(&p->mu, NULL) != 0 ||
	    pthread_mutex_init(&p->aux_mu, NULL) != 0 ||
	    cond_init(&p->wake) != 0 || cond_init(&p->idle_cond) != 0) {
		free(p);
		return fail(NULL, err, KL_ENOMEM, "out of resources");
	}
	if ((rc = parse_uri(p, uri, err)) == KL_OK && make_setup_sql(p) != 0)
		rc = fail(p, err, KL_EINVAL, "fence_sequence too long");
	if (rc != KL_OK || (rc = ensure_sequence(p, err)) != KL_OK) {
		pg_free(p);
		return rc;
	}
	/* The health thread takes no signal meant for the application. */
	sigfillset(&all);
	pthread_sigmask(SIG_SETMASK, &all, &old);
	rc = pthread_create(&p->health, NULL, health_main, p);
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	if (rc != 0) {
		pg_free(p);
		return fail(NULL, err, KL_ENOMEM,
			    "cannot start the health-check thread: %s",
			    strerror(rc));
	}
	p->health_started = true;
	p->pid = getpid();
	if ((rc = kl_provider_new(out, &pg_ops, p)) != KL_OK) {
		pg_free(p);
		return fail(NULL, err, rc, "%s", kl_strerror(rc));
	}
	return KL_OK;
}
