/* SPDX-License-Identifier: MIT */
/*
 * The sessions of the PostgreSQL provider (libkeylock-pg): the pool that
 * hands a connection to each wait and each held lease (at most
 * p->pool_max at once; calls beyond that queue for a slot in arrival
 * order), the health thread that checks every held lease each
 * health_interval and reports the lost ones, and the aux connection that
 * serves kl_provider_status and the setup.  provider_pg.c's top comment
 * says why a lease keeps its connection and when one is closed.
 *
 * Locks: p->mu guards the pool, the lease list and the lease flags, and is
 * never held during a query, a connect or a callback.  p->aux_mu guards the
 * aux connection for the whole of its use (status calls take turns).  The
 * two are never held together.
 */
#include "config.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#include <libpq-fe.h>

#include "keylock.h"
#include "pg_internal.h"

/* ------------------------------------------------------------------ */
/* The pool                                                            */

/* A call waiting for a pool slot, on its own stack.  Granted (with an
 * idle connection, or NULL: open one) only under p->mu. */
struct kl__pg_slot_waiter {
	struct kl__pg_slot_waiter *next;
	pthread_cond_t cond;
	bool granted;
	struct kl__pg_conn *conn;
};

/* Takes a pool slot, in arrival order, waiting until deadline or cancel:
 * *c is then an idle connection, or NULL (open one).  KL_OK, KL_ETIMEDOUT
 * or KL_ECANCELED. */
int
kl__pg_slot_get(struct kl__pg *p, int64_t deadline, kl_cancel *cancel,
		struct kl__pg_conn **c)
{
	struct kl__pg_slot_waiter w;
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
	if (kl__pg_cond_init(&w.cond) != 0) {
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
		else if (deadline != KL__PG_NO_DEADLINE &&
			 kl__now_ns() >= deadline)
			rc = KL_ETIMEDOUT;
		if (rc != KL_OK)
			break;
		until = deadline;
		if (cancel != NULL) {
			int64_t slice =
				kl__now_ns() + KL__PG_SLICE_MS * 1000000LL;

			if (slice < until)
				until = slice;
		}
		if (until == KL__PG_NO_DEADLINE) {
			pthread_cond_wait(&w.cond, &p->mu);
		} else {
			kl__pg_to_timespec(until, &ts);
			pthread_cond_timedwait(&w.cond, &p->mu, &ts);
		}
	}
	if (w.granted) {
		/* A grant settled under the lock wins over a timeout or a
		 * cancel seen after it. */
		rc = KL_OK;
		*c = w.conn;
	} else {
		struct kl__pg_slot_waiter **pp = &p->wq_head, *prev = NULL;

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
	if (*c != NULL && !kl__pg_conn_ours(*c)) {
		kl__pg_conn_close(*c);
		*c = NULL;
	}
	return KL_OK;
}

/* Gives a slot back with its connection (NULL: closed), handing both to
 * the first waiter if any. */
void
kl__pg_slot_put(struct kl__pg *p, struct kl__pg_conn *c)
{
	struct kl__pg_slot_waiter *w;

	if (c != NULL && c->broken) {
		kl__pg_conn_close(c);
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
/* The health thread                                                   */

bool
kl__pg_on_health_thread(struct kl__pg *p)
{
	return p->health_started && pthread_equal(pthread_self(), p->health);
}

/* SELECT 1 on the lease's connection; false (and l->why) when it failed.
 * Called with l busy and no lock held. */
static bool
ping(struct kl__pg *p, struct kl__pg_lease *l)
{
	struct kl__pg_answer a;
	kl_error err;

	err.message[0] = '\0';
	if (kl__pg_run_short(p, l->conn, "SELECT 1", &a, &err) == KL_OK)
		return true;
	kl__pg_copy_str(l->why, sizeof l->why, err.message);
	return false;
}

/* One look at every lease: ping the held ones, report the lost ones.
 * p->mu held; dropped around each ping and callback, after which the scan
 * starts over (the list may have changed), skipping leases seen in this
 * round. */
static void
health_round(struct kl__pg *p)
{
	struct kl__pg_lease *l;
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
report_pending(struct kl__pg *p)
{
	for (struct kl__pg_lease *l = p->leases; l != NULL; l = l->next)
		if (l->lost && l->lost_fn != NULL && !l->notified &&
		    !l->releasing)
			return true;
	return false;
}

void *
kl__pg_health_main(void *arg)
{
	struct kl__pg *p = arg;
	struct timespec ts;
	int64_t next;

	pthread_mutex_lock(&p->mu);
	next = kl__now_ns() + p->health_ms * 1000000;
	while (!p->stop) {
		/* Sleeps until the next round, unless pg_watch wakes it
		 * for a lease that was lost before it was watched. */
		if (kl__now_ns() < next && !report_pending(p)) {
			kl__pg_to_timespec(next, &ts);
			pthread_cond_timedwait(&p->wake, &p->mu, &ts);
			continue;
		}
		health_round(p);
		next = kl__now_ns() + p->health_ms * 1000000;
	}
	pthread_mutex_unlock(&p->mu);
	return NULL;
}

/* ------------------------------------------------------------------ */
/* The aux connection                                                  */

/* Runs sql on the aux connection, opening it when needed; with strict, a
 * failed statement is KL_EPROVIDER, else the caller reads a->failed.  A
 * broken connection is closed, to be opened again next time. */
static int aux_do(struct kl__pg *p, const char *sql, bool strict,
		  struct kl__pg_answer *a, PGresult **rows, kl_error *err);

int
kl__pg_aux_run(struct kl__pg *p, const char *sql, bool strict,
	       struct kl__pg_answer *a, kl_error *err)
{
	return aux_do(p, sql, strict, a, NULL, err);
}

int
kl__pg_aux_rows(struct kl__pg *p, const char *sql, PGresult **rows,
		kl_error *err)
{
	struct kl__pg_answer a;

	return aux_do(p, sql, true, &a, rows, err);
}

static int
aux_do(struct kl__pg *p, const char *sql, bool strict,
       struct kl__pg_answer *a, PGresult **rows, kl_error *err)
{
	struct kl__pg_conn *c;
	bool fresh, stale;
	int rc;

	pthread_mutex_lock(&p->aux_mu);
	if (p->aux != NULL && !kl__pg_conn_ours(p->aux)) {
		kl__pg_conn_close(p->aux); /* inherited over fork() */
		p->aux = NULL;
	}
	for (;;) {
		fresh = p->aux == NULL;
		if (fresh &&
		    (rc = kl__pg_conn_open(p, NULL, &p->aux, err)) != KL_OK)
			break;
		c = p->aux;
		if (rows != NULL)
			rc = kl__pg_run_rows(p, c, sql, rows, err);
		else if (strict)
			rc = kl__pg_run_short(p, c, sql, a, err);
		else
			rc = kl__pg_run(
				p, c, sql,
				kl__deadline_of(KL__PG_SHORT_OP_MS),
				KL_EPROVIDER, NULL, a, err);
		if (!c->broken)
			break;
		/* One that died while idle is replaced, once. */
		stale = !fresh && PQstatus(c->pg) != CONNECTION_OK;
		kl__pg_conn_close(c);
		p->aux = NULL;
		if (!stale)
			break;
	}
	pthread_mutex_unlock(&p->aux_mu);
	return rc;
}
