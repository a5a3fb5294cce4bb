/* SPDX-License-Identifier: MIT */
/*
 * Connections and queries of the PostgreSQL provider (libkeylock-pg): the
 * helpers of the monotonic clock its deadlines use (the clock itself is
 * klcommon.h's), opening and closing one session
 * (bounded by connect_timeout and a cancel token; a session inherited over
 * fork() is closed without a word to the server), and running a query
 * string or a prepared statement on it with a deadline, a cancel token
 * and cancel requests.  A connection is used by one thread at a time (the
 * pool, pg_pool.c, hands it out); nothing here takes a lock.
 */
#include "config.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <libpq-fe.h>

#include "keylock.h"
#include "pg_internal.h"

/* ------------------------------------------------------------------ */
/* Time                                                                */

/* Milliseconds (rounded up) from now to deadline, at most cap. */
static int
ms_until(int64_t deadline, int cap)
{
	int64_t left;

	if (deadline == KL__PG_NO_DEADLINE)
		return cap;
	left = deadline - kl__now_ns();
	if (left <= 0)
		return 0;
	left = (left + 999999) / 1000000;
	return left < cap ? (int)left : cap;
}

void
kl__pg_to_timespec(int64_t ns, struct timespec *ts)
{
	ts->tv_sec = (time_t)(ns / 1000000000);
	ts->tv_nsec = (long)(ns % 1000000000);
}

int
kl__pg_cond_init(pthread_cond_t *c)
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
void
kl__pg_conn_close(struct kl__pg_conn *c)
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
bool
kl__pg_conn_ours(const struct kl__pg_conn *c)
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
		ms = ms_until(deadline,
			      cancel != NULL ? KL__PG_SLICE_MS : INT_MAX);
		if (ms == 0 && deadline != KL__PG_NO_DEADLINE &&
		    kl__now_ns() >= deadline)
			return 0;
		rc = poll(&pfd, 1,
			  deadline == KL__PG_NO_DEADLINE && cancel == NULL
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
int
kl__pg_conn_open(struct kl__pg *p, kl_cancel *cancel, struct kl__pg_conn **out,
		 kl_error *err)
{
	PostgresPollingStatusType st = PGRES_POLLING_WRITING;
	int64_t deadline =
		p->connect_timeout_ms > 0
			? kl__deadline_of(p->connect_timeout_ms)
			: KL__PG_NO_DEADLINE;
	struct kl__pg_conn *c;
	PGconn *pg;
	int rc;

	*out = NULL;
	if ((c = calloc(1, sizeof *c)) == NULL)
		return kl__pg_fail(p, err, KL_ENOMEM, "out of memory");
	if ((pg = PQconnectStartParams(p->keys, p->vals, 0)) == NULL) {
		free(c);
		return kl__pg_fail(p, err, KL_ENOMEM, "out of memory");
	}
	c->pg = pg;
	c->pid = getpid();
	c->lock_timeout_ms = -1;
	PQsetNoticeProcessor(pg, quiet_notices, NULL);
	if (PQstatus(pg) == CONNECTION_BAD)
		st = PGRES_POLLING_FAILED;
	while (st != PGRES_POLLING_OK) {
		if (st == PGRES_POLLING_FAILED) {
			kl__pg_fail(p, err, KL_EPROVIDER, "cannot connect: %s",
				    PQerrorMessage(pg));
			kl__pg_conn_close(c);
			return KL_EPROVIDER;
		}
		rc = wait_fd(PQsocket(pg),
			     st == PGRES_POLLING_READING ? POLLIN : POLLOUT,
			     deadline, cancel);
		if (rc == -1) {
			kl__pg_conn_close(c);
			return kl__pg_fail(p, err, KL_ECANCELED, NULL);
		}
		if (rc == 0) {
			kl__pg_fail(p, err, KL_EPROVIDER,
				    "cannot connect: no answer within %lld ms "
				    "(connect_timeout)",
				    (long long)p->connect_timeout_ms);
			kl__pg_conn_close(c);
			return KL_EPROVIDER;
		}
		if (rc == -2) {
			kl__pg_fail(p, err, KL_EPROVIDER,
				    "cannot connect: poll: %s",
				    strerror(errno));
			kl__pg_conn_close(c);
			return KL_EPROVIDER;
		}
		st = PQconnectPoll(pg);
	}
	*out = c;
	return KL_OK;
}

/* ------------------------------------------------------------------ */
/* Queries                                                             */

/* Reads r into a; with rows, a set of rows is kept there (the last one
 * wins) and true returned: the caller must not clear r. */
static bool
take_result(struct kl__pg_answer *a, PGresult *r, PGresult **rows)
{
	const char *s;

	switch (PQresultStatus(r)) {
	case PGRES_COMMAND_OK:
		break;
	case PGRES_TUPLES_OK:
		if (rows != NULL) {
			PQclear(*rows);
			*rows = r;
			return true;
		}
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
	return false;
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
 * awaited, at most KL__PG_SHORT_OP_MS more; when deadline passes with late ==
 * KL_EPROVIDER the server is deemed gone.  Returns KL_OK when the server
 * answered (a->failed tells whether a statement failed), else KL_EPROVIDER
 * with c->broken set and err filled: the connection, and any lock it held,
 * must be dropped.
 */
static int
run_q(struct kl__pg *p, struct kl__pg_conn *c, const char *sql,
      const char *stmt, int64_t id, int64_t deadline, int late,
      kl_cancel *cancel, struct kl__pg_answer *a, PGresult **rows,
      kl_error *err)
{
	PGconn *pg = c->pg;
	int64_t give_up = KL__PG_NO_DEADLINE, until;
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
		return kl__pg_fail(p, err, KL_EPROVIDER, "connection lost: %s",
				   PQerrorMessage(pg));
	}
	for (;;) {
		while (!PQisBusy(pg)) {
			if ((r = PQgetResult(pg)) == NULL)
				goto done;
			if (!take_result(a, r, rows))
				PQclear(r);
		}
		if (a->stopped == 0) {
			if (kl_cancel_fired(cancel))
				a->stopped = KL_ECANCELED;
			else if (deadline != KL__PG_NO_DEADLINE &&
				 kl__now_ns() >= deadline) {
				if (late != KL_ETIMEDOUT) {
					c->broken = true;
					return kl__pg_fail(
						p, err, KL_EPROVIDER,
						"no answer from the server "
						"in time");
				}
				a->stopped = KL_ETIMEDOUT;
			}
			if (a->stopped != 0) {
				if (!send_cancel(pg)) {
					c->broken = true;
					return kl__pg_fail(
						p, err, KL_EPROVIDER,
						"cannot send a cancel "
						"request");
				}
				give_up = kl__deadline_of(
					KL__PG_SHORT_OP_MS);
			}
		}
		until = a->stopped != 0 ? give_up : deadline;
		rc = wait_fd(PQsocket(pg), POLLIN, until,
			     a->stopped != 0 ? NULL : cancel);
		if (rc == 0 && a->stopped != 0) {
			c->broken = true;
			return kl__pg_fail(p, err, KL_EPROVIDER,
					   "no answer to a cancel request");
		}
		if (rc == -2) {
			c->broken = true;
			return kl__pg_fail(p, err, KL_EPROVIDER, "poll: %s",
					   strerror(errno));
		}
		if (rc == 1 && !PQconsumeInput(pg)) {
			c->broken = true;
			return kl__pg_fail(p, err, KL_EPROVIDER,
					   "connection lost: %s",
					   PQerrorMessage(pg));
		}
	}
done:
	if (PQstatus(pg) != CONNECTION_OK) {
		c->broken = true;
		return kl__pg_fail(p, err, KL_EPROVIDER, "connection lost: %s",
				   a->failed ? a->message : PQerrorMessage(pg));
	}
	return KL_OK;
}

int
kl__pg_run_q(struct kl__pg *p, struct kl__pg_conn *c, const char *sql,
	     const char *stmt, int64_t id, int64_t deadline, int late,
	     kl_cancel *cancel, struct kl__pg_answer *a, kl_error *err)
{
	return run_q(p, c, sql, stmt, id, deadline, late, cancel, a, NULL,
		     err);
}

/* A short query of text sql whose rows the caller reads: KL_OK with *rows
 * (the last set of rows; the caller clears it), or KL_EPROVIDER with
 * *rows NULL and, unless the server refused the statement, c->broken
 * set. */
int
kl__pg_run_rows(struct kl__pg *p, struct kl__pg_conn *c, const char *sql,
		PGresult **rows, kl_error *err)
{
	struct kl__pg_answer a;
	int rc;

	*rows = NULL;
	rc = run_q(p, c, sql, NULL, 0, kl__deadline_of(KL__PG_SHORT_OP_MS),
		   KL_EPROVIDER, NULL, &a, rows, err);
	if (rc == KL_OK && (a.failed || *rows == NULL)) {
		rc = kl__pg_fail(p, err, KL_EPROVIDER, "%s",
				 a.failed ? a.message : "unexpected answer");
	}
	if (rc != KL_OK) {
		PQclear(*rows);
		*rows = NULL;
	}
	return rc;
}

/* kl__pg_run_q of the text sql. */
int
kl__pg_run(struct kl__pg *p, struct kl__pg_conn *c, const char *sql,
	   int64_t deadline, int late, kl_cancel *cancel,
	   struct kl__pg_answer *a, kl_error *err)
{
	return kl__pg_run_q(p, c, sql, NULL, 0, deadline, late, cancel, a, err);
}

/* A short query (text sql, or the prepared stmt of id) whose failure makes
 * the connection unusable: KL_OK, or KL_EPROVIDER with c->broken set. */
int
kl__pg_run_short_q(struct kl__pg *p, struct kl__pg_conn *c, const char *sql,
		   const char *stmt, int64_t id, struct kl__pg_answer *a,
		   kl_error *err)
{
	int rc = kl__pg_run_q(p, c, sql, stmt, id,
			      kl__deadline_of(KL__PG_SHORT_OP_MS),
			      KL_EPROVIDER, NULL, a, err);

	if (rc == KL_OK && a->failed) {
		c->broken = true;
		rc = kl__pg_fail(p, err, KL_EPROVIDER, "%s", a->message);
	}
	return rc;
}

int
kl__pg_run_short(struct kl__pg *p, struct kl__pg_conn *c, const char *sql,
		 struct kl__pg_answer *a, kl_error *err)
{
	return kl__pg_run_short_q(p, c, sql, NULL, 0, a, err);
}

/* Drops every advisory lock of the session; a connection serves one lease
 * at a time, so that is exactly the one in doubt. */
void
kl__pg_unlock_all(struct kl__pg *p, struct kl__pg_conn *c)
{
	struct kl__pg_answer a;

	kl__pg_run_short(p, c, "SELECT pg_catalog.pg_advisory_unlock_all()", &a,
			 NULL);
}
