/* SPDX-License-Identifier: MIT */
/*
 * Private declarations of libkeylock-pg, shared by its modules:
 * pg_config.c (the URI and its options, and messages that never show the
 * password), pg_conn.c (the clock, one connection: open, close, queries
 * bounded by deadlines and cancel requests), pg_pool.c (the pool of
 * sessions, the health thread, the aux connection), pg_fence.c (the fence
 * sequence) and provider_pg.c (the provider: key ids, lock statements,
 * fences, leases, open and destroy; its top comment says how the parts
 * work together, and which lock guards what).
 *
 * This library links libkeylock.so and so sees only its public kl_*
 * functions, and src/libklcommon.la for SipHash, kl__error_set and the
 * clock (klcommon.h); the kl__pg_* helpers here are hidden by the build
 * (-fvisibility=hidden and src/libkeylock-pg.map).
 */
#ifndef KL_PG_INTERNAL_H
#define KL_PG_INTERNAL_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <time.h>

#include <libpq-fe.h>

#include "keylock.h"
#include "klcommon.h"
#include "pg_fence.h"

#define KL__PG_HIDDEN __attribute__((visibility("hidden")))

#define KL__PG_NO_DEADLINE INT64_MAX
/* How often a wait looks at its cancel token. */
#define KL__PG_SLICE_MS 10
/* Bound on the short queries: unlock, SELECT 1, status, setup, and on the
 * answer to a cancel request. */
#define KL__PG_SHORT_OP_MS 5000

/* One session of the server. */
struct kl__pg_conn {
	PGconn *pg;
	struct kl__pg_conn *next; /* in the idle list */
	pid_t pid;                /* the process that opened it */
	bool broken;              /* must be closed, not reused */
	bool prepared;            /* SETUP_SQL has run: the session has
				     statement_timeout 0 and the statements
				     STMT_TRY, STMT_UNLOCK and their shared
				     twins (provider_pg.c) */
	/* The session's settings as the last wait left them, so that the
	 * next wait sends only what differs: statement_timeout is 0, and
	 * lock_timeout (ms; -1: unknown). */
	bool no_statement_timeout;
	int64_t lock_timeout_ms;
};

/* A call waiting for a pool slot (pg_pool.c). */
struct kl__pg_slot_waiter;

struct kl__pg_lease {
	struct kl__pg_lease *next, *prev; /* p->leases */
	struct kl__pg_conn *conn;
	int64_t id;
	uint64_t check; /* a second hash of the key, for KL_ERRORCHECK */
	uint64_t owner; /* thread_id() of the thread that acquired it */
	bool shared;    /* taken with KL_SHARED */
	/* For kl_provider_snapshot: who took it, and when. */
	int backend;     /* the server process of conn */
	int64_t tid;     /* gettid() of the thread that acquired it */
	int64_t granted_ns;
	uint64_t fence;
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

/* A call waiting for a key on its own session, on its stack, in
 * p->waits (under p->mu), so that kl_provider_snapshot can name the
 * thread behind the server process that waits. */
struct kl__pg_wait {
	struct kl__pg_wait *next;
	int backend;
	int64_t tid;
};

/* The provider. */
struct kl__pg {
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
	struct kl__pg_conn *idle;
	struct kl__pg_slot_waiter *wq_head, *wq_tail;
	struct kl__pg_lease *leases;
	struct kl__pg_wait *waits;
	unsigned round;
	bool stop;
	pthread_t health;
	bool health_started;
	pid_t pid; /* the process that opened the provider */

	pthread_mutex_t aux_mu;
	struct kl__pg_conn *aux;

	struct kl__pg_fence fence;
	/* The server's clock in microseconds when the sequence was checked:
	 * every session floors the sequence at its clock before its first
	 * draw, later, so a fence below this comes from a sequence dropped
	 * and created again, or set back, behind a session's floor. */
	int64_t fence_min;
	/* What a new session runs, once, in front of its first STMT_TRY. */
	char setup_sql[6144];
};

/* What the server answered to one query string. */
struct kl__pg_answer {
	bool failed;       /* one of its statements failed (the first kept) */
	char sqlstate[6];
	char message[200];
	int nvals;         /* columns read from the last row returned */
	bool null[2];
	int64_t val[2];
	int stopped;       /* a cancel request was sent: KL_ECANCELED or
			      KL_ETIMEDOUT, why */
};

/* ------------------------------------------------------------------ */
/* pg_config.c: the URI, and messages that never show the password */

/* Copies src into dst (size bytes), cut short if need be. */
KL__PG_HIDDEN void kl__pg_copy_str(char *dst, size_t size, const char *src);
/* Appends src to the string in dst (size bytes), cut short if need be. */
KL__PG_HIDDEN void kl__pg_append(char *dst, size_t size, const char *src);
/* Fills err with status and "postgresql (where): message".  For
 * KL_ETIMEDOUT and KL_ECANCELED with a NULL fmt only the status is set,
 * so that the lock layer words the message.  Returns status. */
KL__PG_HIDDEN int kl__pg_fail(const struct kl__pg *p, kl_error *err,
			      int status, const char *fmt, ...)
	__attribute__((format(printf, 4, 5)));
/* Reads the URI into p: options, keywords for libpq, the description used
 * in messages.  KL_OK, KL_EINVAL, KL_ENOMEM. */
KL__PG_HIDDEN int kl__pg_parse_uri(struct kl__pg *p, const char *uri,
				   kl_error *err);

/* ------------------------------------------------------------------ */
/* pg_conn.c: the clock, connections and queries */

/* The clock is klcommon.h's: kl__now_ns (CLOCK_MONOTONIC nanoseconds) and
 * kl__deadline_of (KL_FOREVER gives KL_NO_DEADLINE, KL__PG_NO_DEADLINE). */
KL__PG_HIDDEN void kl__pg_to_timespec(int64_t ns, struct timespec *ts);
/* A condition variable on CLOCK_MONOTONIC: 0, or -1. */
KL__PG_HIDDEN int kl__pg_cond_init(pthread_cond_t *c);

/* Opens a connection, bounded by connect_timeout and the cancel token.
 * KL_OK, KL_ECANCELED, KL_ENOMEM or KL_EPROVIDER. */
KL__PG_HIDDEN int kl__pg_conn_open(struct kl__pg *p, kl_cancel *cancel,
				   struct kl__pg_conn **out, kl_error *err);
/* Closes c (NULL: nothing), one inherited over fork() without a word to
 * the server. */
KL__PG_HIDDEN void kl__pg_conn_close(struct kl__pg_conn *c);
/* Whether c was opened by this process, not inherited over fork(). */
KL__PG_HIDDEN bool kl__pg_conn_ours(const struct kl__pg_conn *c);

/* Sends sql, or runs the prepared statement stmt of id, and reads the
 * answer into a; pg_conn.c says what deadline, late and cancel do.  KL_OK
 * when the server answered, else KL_EPROVIDER with c->broken set. */
KL__PG_HIDDEN int kl__pg_run_q(struct kl__pg *p, struct kl__pg_conn *c,
			       const char *sql, const char *stmt, int64_t id,
			       int64_t deadline, int late, kl_cancel *cancel,
			       struct kl__pg_answer *a, kl_error *err);
/* A short query of text sql whose rows the caller reads: KL_OK with *rows
 * (the last set of rows; the caller clears it), or KL_EPROVIDER with
 * *rows NULL. */
KL__PG_HIDDEN int kl__pg_run_rows(struct kl__pg *p, struct kl__pg_conn *c,
				  const char *sql, PGresult **rows,
				  kl_error *err);
/* kl__pg_run_q of the text sql. */
KL__PG_HIDDEN int kl__pg_run(struct kl__pg *p, struct kl__pg_conn *c,
			     const char *sql, int64_t deadline, int late,
			     kl_cancel *cancel, struct kl__pg_answer *a,
			     kl_error *err);
/* A short query (text sql, or the prepared stmt of id) whose failure makes
 * the connection unusable: KL_OK, or KL_EPROVIDER with c->broken set. */
KL__PG_HIDDEN int kl__pg_run_short_q(struct kl__pg *p, struct kl__pg_conn *c,
				     const char *sql, const char *stmt,
				     int64_t id, struct kl__pg_answer *a,
				     kl_error *err);
/* kl__pg_run_short_q of the text sql. */
KL__PG_HIDDEN int kl__pg_run_short(struct kl__pg *p, struct kl__pg_conn *c,
				   const char *sql, struct kl__pg_answer *a,
				   kl_error *err);
/* Drops every advisory lock of c's session. */
KL__PG_HIDDEN void kl__pg_unlock_all(struct kl__pg *p, struct kl__pg_conn *c);

/* ------------------------------------------------------------------ */
/* pg_pool.c: the pool, the health thread, the aux connection */

/* Takes a pool slot, in arrival order, waiting until deadline or cancel:
 * *c is then an idle connection, or NULL (open one).  KL_OK, KL_ETIMEDOUT
 * or KL_ECANCELED. */
KL__PG_HIDDEN int kl__pg_slot_get(struct kl__pg *p, int64_t deadline,
				  kl_cancel *cancel, struct kl__pg_conn **c);
/* Gives a slot back with its connection (NULL: closed; a broken one is
 * closed here), handing both to the first waiter if any. */
KL__PG_HIDDEN void kl__pg_slot_put(struct kl__pg *p, struct kl__pg_conn *c);
/* The health thread (pthread_create's start routine, arg the provider). */
KL__PG_HIDDEN void *kl__pg_health_main(void *arg);
/* Whether the caller is the health thread (in a lost callback). */
KL__PG_HIDDEN bool kl__pg_on_health_thread(struct kl__pg *p);
/* Runs sql on the aux connection, opening it when needed; with strict, a
 * failed statement is KL_EPROVIDER, else the caller reads a->failed. */
KL__PG_HIDDEN int kl__pg_aux_run(struct kl__pg *p, const char *sql,
				 bool strict, struct kl__pg_answer *a,
				 kl_error *err);

/* kl__pg_run_rows on the aux connection, opening it when needed. */
KL__PG_HIDDEN int kl__pg_aux_rows(struct kl__pg *p, const char *sql,
				  PGresult **rows, kl_error *err);

#endif /* KL_PG_INTERNAL_H */
