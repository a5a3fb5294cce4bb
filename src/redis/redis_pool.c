/* SPDX-License-Identifier: MIT */
/*
 * The Redis provider's connections: an idle pool of conf.pool connections,
 * shared by all threads, and new connections, each checked against the
 * restart marker (redis_guard.c) before use.  A connection that failed or
 * timed out is closed, never put back.  Also the deadline of one command.
 * r->mu guards the pool; no network I/O runs with it held.
 */
#include "config.h"

#include <pthread.h>

#include "redis_internal.h"

int
kl__redis_conn_new(struct kl__redis *r, int64_t cap_ns, struct kl__rconn **out,
		   kl_error *err)
{
	int rc = kl__rconn_open(&r->conf, cap_ns, out, err);

	if (rc == KL_OK &&
	    (rc = kl__redis_mark_server(r, *out, cap_ns, err)) != KL_OK) {
		kl__rconn_close(*out);
		*out = NULL;
	}
	return rc;
}

/* A pooled connection, else a new one made by cap_ns. */
int
kl__redis_conn_get(struct kl__redis *r, int64_t cap_ns, struct kl__rconn **out,
		   kl_error *err)
{
	struct kl__rconn *c = NULL;
	pid_t pid = kl__redis_getpid();

	pthread_mutex_lock(&r->mu);
	while (c == NULL && r->nidle > 0) {
		c = r->idle[--r->nidle];
		/* Inherited over fork(): the parent owns that socket. */
		if (c->pid != pid) {
			kl__rconn_close(c);
			c = NULL;
		}
	}
	pthread_mutex_unlock(&r->mu);
	if (c != NULL) {
		*out = c;
		return KL_OK;
	}
	return kl__redis_conn_new(r, cap_ns, out, err);
}

/* c came from kl__redis_conn_get or kl__redis_conn_new in this very call of the
 * provider, so in this process: no getpid() needed to tell a parent's
 * connection. */
void
kl__redis_conn_put(struct kl__redis *r, struct kl__rconn *c)
{
	if (c == NULL)
		return;
	if (!c->broken) {
		pthread_mutex_lock(&r->mu);
		if (r->nidle < r->conf.pool) {
			r->idle[r->nidle++] = c;
			c = NULL;
		}
		pthread_mutex_unlock(&r->mu);
	}
	kl__rconn_close(c);
}

/* Replaces a broken *cp with a new connection, made by cap_ns. */
int
kl__redis_conn_replace(struct kl__redis *r, struct kl__rconn **cp,
		       int64_t cap_ns, kl_error *err)
{
	kl__rconn_close(*cp);
	*cp = NULL;
	return kl__redis_conn_new(r, cap_ns, cp, err);
}

/* The deadline of one command of a wait: the command timeout, but no later
 * than KL_R_GRACE_MS after the wait's deadline or after the extra_ns the server
 * itself blocks, whichever is later, so that a stalled server cannot hold
 * a waiter much past its timeout.  A BLPOP never blocks past the deadline
 * (see kl__redis_wait_queued), so it too ends by the deadline plus
 * KL_R_GRACE_MS. */
int64_t
kl__redis_cmd_deadline(const struct kl__redis *r, int64_t wait_deadline,
		       int64_t extra_ns)
{
	int64_t now = kl__now_ns();
	int64_t d = now + extra_ns + r->conf.timeout_ms * KL_R_MS, cap;

	if (wait_deadline != KL_R_NO_DEADLINE) {
		cap = (wait_deadline > now + extra_ns ? wait_deadline
						      : now + extra_ns) +
		      KL_R_GRACE_MS * KL_R_MS;
		if (cap < d)
			d = cap;
	}
	return d;
}
