/* SPDX-License-Identifier: MIT */
/*
 * The Redis provider (libkeylock-redis): keyed FIFO locks shared by every
 * client of one Redis server.  The data model and its invariants are
 * described above the scripts in redis_scripts.c; this file and
 * redis_pool.c, redis_guard.c, redis_wait.c and redis_renew.c are the
 * client side.
 *
 * Acquire: one atomic script per attempt either grants the key, exclusive
 * or shared (KL_SHARED), by the W3C Web Locks rule on the key's one queue
 * (see redis_scripts.c), or puts the caller's random token in that queue.  A queued waiter then blocks on its own
 * connection in BLPOP on its wake list, in slices of WAKE_SLICE_MS so that
 * a fired cancel token or its deadline is noticed quickly, and tries again
 * when woken or every recheck interval, which also refreshes its heartbeat.
 * Giving up runs the leave script: out of the queue, and a key granted in a
 * race (a lost reply) is released and passed on, so each wait ends in
 * exactly one outcome.
 *
 * Leases: a provider thread renews every held lease at a third of its ttl
 * with a compare-and-PEXPIRE script.  A lease is lost when a renewal finds
 * the key gone or taken, when no renewal succeeded before the lease would
 * have expired, or when the server restarted (its INFO run_id changed) and
 * the restart marker shows that locks may be missing; the thread then
 * calls the lease's watch callback once, with no lock held.
 *
 * Restarts: a server that lost data (a restart from a snapshot, a wiped
 * data directory, a fresh server that cannot be told from one) may lack
 * locks whose old holders still believe they hold them, so no lock is
 * granted until the server has been up for the restart guard: by default
 * the longest ttl any client of the prefix recorded in the server (see
 * redis_guard.c).  Meanwhile acquires wait, as behind a holder.  Whether
 * data was lost is decided from evidence kept in the server itself, the
 * restart marker, never from the configuration of the new server run.  A
 * waiter whose connection breaks reconnects once; if the server restarted
 * meanwhile, the wait ends with KL_EPROVIDER.
 *
 * Connections: an idle pool of conf.pool connections, shared by all
 * threads; a waiter keeps its connection for its whole wait, so more are
 * opened while many wait.  A connection that failed or timed out is closed,
 * never put back.  The renewal thread has a connection of its own.
 *
 * Locking: one mutex, r->mu, guards the pool, the server identity (run_id,
 * epoch), the list of held leases and each lease's mutable state.  No
 * network I/O and no callback runs with it held.  r->cv wakes the renewal
 * thread and tells a releasing thread that a lost callback has returned.
 */
#include "config.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "redis_internal.h"

#define MIN_TTL_MS 100

/* ------------------------------------------------------------------ */
/* Names and leases                                                    */

static void
names_free(struct kl__rnames *n)
{
	free(n->buf);
	n->buf = NULL;
}

/* PREFIX{hex} and its companions; the wake list needs tok. */
static int
names_of_hex(const struct kl__redis *r, const char *hex, const char *tok,
	     struct kl__rnames *n)
{
	static const char *const suffix[KL_RK_COUNT] = {
		"", ":q", ":hb", ":f", ":s", ":sm", ":w:"
	};
	size_t base = r->conf.prefix_len + 66, total = 0, toklen;
	char *p;
	int i;

	toklen = tok != NULL ? strlen(tok) : 0;
	for (i = 0; i < KL_RK_COUNT; i++)
		total += base + strlen(suffix[i]) + 1;
	total += toklen;
	if ((n->buf = malloc(total)) == NULL)
		return KL_ENOMEM;
	p = n->buf;
	for (i = 0; i < KL_RK_COUNT; i++) {
		size_t sl = strlen(suffix[i]);

		n->k[i] = p;
		memcpy(p, r->conf.prefix, r->conf.prefix_len);
		p += r->conf.prefix_len;
		*p++ = '{';
		memcpy(p, hex, 64);
		p += 64;
		*p++ = '}';
		memcpy(p, suffix[i], sl);
		p += sl;
		if (i == KL_RK_WAKE && toklen > 0) {
			memcpy(p, tok, toklen);
			p += toklen;
		}
		n->len[i] = (size_t)(p - n->k[i]);
		*p++ = '\0';
	}
	return KL_OK;
}

/* PREFIX{sha256(key)} and its companions. */
static int
names_make(const struct kl__redis *r, const char *key, size_t key_len,
	   const char *tok, struct kl__rnames *n)
{
	char hex[65];

	kl__redis_sha256_hex(key, key_len, hex);
	return names_of_hex(r, hex, tok, n);
}

/* A shared request's token starts with "s", which no exclusive token (hex
 * digits) does: the scripts read the mode from it. */
static int
lease_new(struct kl__redis *r, const char *key, size_t key_len, int64_t ttl_ms,
	  bool shared, struct kl__rlease **out, kl_error *err)
{
	static const char hex[] = "0123456789abcdef";
	unsigned char raw[KL_R_TOKEN_BYTES];
	struct kl__rlease *l;
	char *tok;

	*out = NULL;
	if ((l = calloc(1, sizeof *l)) == NULL)
		return KL_ENOMEM;
	if (!kl__redis_random(raw, sizeof raw)) {
		free(l);
		kl__error_set(err, KL_EPROVIDER,
				"redis provider: no random bytes for a "
				"token");
		return KL_EPROVIDER;
	}
	l->shared = shared;
	tok = l->tok;
	if (shared)
		*tok++ = 's';
	for (int i = 0; i < KL_R_TOKEN_BYTES; i++) {
		tok[2 * i] = hex[raw[i] >> 4];
		tok[2 * i + 1] = hex[raw[i] & 15];
	}
	if (names_make(r, key, key_len, l->tok, &l->n) != KL_OK) {
		free(l);
		return KL_ENOMEM;
	}
	l->ttl_ms = ttl_ms;
	l->refs = 1;
	*out = l;
	return KL_OK;
}

/* Closes the connections an acquire left unanswered. */
static void
stale_close(struct kl__rlease *l)
{
	while (l->nstale > 0)
		kl__rconn_close(l->stale[--l->nstale]);
}

/* Drops a reference; mu held when the lease may be shared. */
void
kl__redis_lease_unref(struct kl__rlease *l)
{
	if (--l->refs > 0)
		return;
	stale_close(l);
	names_free(&l->n);
	free(l);
}

static void
lease_link(struct kl__redis *r, struct kl__rlease *l)
{
	l->prev = NULL;
	l->next = r->leases;
	if (r->leases != NULL)
		r->leases->prev = l;
	r->leases = l;
	l->linked = true;
}

static void
lease_unlink(struct kl__redis *r, struct kl__rlease *l)
{
	if (!l->linked)
		return;
	if (l->prev != NULL)
		l->prev->next = l->next;
	else
		r->leases = l->next;
	if (l->next != NULL)
		l->next->prev = l->prev;
	l->linked = false;
}

/* How long before its expiry in Redis a lease stops counting as valid:
 * allows for the two clocks running at slightly different rates. */
int64_t
kl__redis_drift_ns(int64_t ttl_ms)
{
	return (ttl_ms / 100 + 2) * KL_R_MS;
}

/* ------------------------------------------------------------------ */
/* Provider operations                                                 */

/* A wait that timed out while the restart guard held says so. */
static void
guard_said(const struct kl__rlease *l, kl_error *err)
{
	if (l->guard_left_ms > 0)
		kl__error_set(err, KL_ETIMEDOUT,
				"redis provider: no lock is granted for "
				"another %lld ms: the server may have lost "
				"locks (a restart, a flush, or a server or "
				"prefix not used before: restart_guard)",
				(long long)l->guard_left_ms);
}

/* A wait that timed out or was cancelled did not fail: a message left in
 * err by a command that failed and was retried on a new connection does
 * not describe it.  The lock words the message of rc. */
static int
not_failed(kl_error *err, int rc)
{
	if (err != NULL && (rc == KL_ETIMEDOUT || rc == KL_ECANCELED)) {
		err->status = rc;
		err->message[0] = '\0';
	}
	return rc;
}

static int
redis_acquire(void *impl, const char *key, size_t key_len, kl_cancel *cancel,
	      int64_t timeout_ms, int64_t ttl_ms, unsigned flags, void **out,
	      uint64_t *fence, kl_error *err)
{
	struct kl__redis *r = impl;
	struct kl__rconn *c = NULL;
	struct kl__rlease *l;
	int64_t deadline, cap, sent = 0;
	bool granted = false, released;
	int rc;

	*out = NULL;
	*fence = 0;
	if (flags & KL_ERRORCHECK) {
		kl__error_set(err, KL_EINVAL,
				"redis provider: error-check mode "
				"(KL_ERRORCHECK) is not supported");
		return KL_EINVAL;
	}
	/* A flag of a later version would be a request we do not honour. */
	if (flags & ~(unsigned)(KL_ERRORCHECK | KL_SHARED)) {
		kl__error_set(err, KL_EINVAL,
				"redis provider: unknown flags 0x%x",
				flags & ~(unsigned)(KL_ERRORCHECK | KL_SHARED));
		return KL_EINVAL;
	}
	if (ttl_ms == 0)
		ttl_ms = r->conf.ttl_ms;
	if (timeout_ms < 0 && timeout_ms != KL_FOREVER) {
		kl__error_set(err, KL_EINVAL,
				"redis provider: bad timeout %lld ms",
				(long long)timeout_ms);
		return KL_EINVAL;
	}
	/* The bounds of the URI's ttl option, in the same words. */
	if (ttl_ms < MIN_TTL_MS || ttl_ms > INT64_MAX / 4) {
		kl__error_set(err, KL_EINVAL,
				"redis provider: the ttl must be from %d ms "
				"to %lld ms, not %lld ms",
				MIN_TTL_MS, (long long)(INT64_MAX / 4),
				(long long)ttl_ms);
		return KL_EINVAL;
	}
	if (kl_cancel_fired(cancel))
		return KL_ECANCELED;
	deadline = kl__redis_deadline(timeout_ms);
	/* Connecting, too, ends by the deadline plus grace; a try-once has
	 * the connect and command timeouts. */
	cap = timeout_ms == 0 || deadline == KL_R_NO_DEADLINE
		      ? KL_R_NO_DEADLINE
		      : deadline + KL_R_GRACE_MS * KL_R_MS;
	if ((rc = lease_new(r, key, key_len, ttl_ms, (flags & KL_SHARED) != 0,
			    &l, err)) != KL_OK)
		return rc;
	if ((rc = kl__redis_conn_get(r, cap, &c, err)) != KL_OK) {
		kl__redis_lease_unref(l);
		return rc;
	}
	rc = kl__redis_first_attempt(r, &c, l, timeout_ms == 0, deadline,
				     &granted, fence, &sent, err);
	if (rc == KL_OK && !granted) {
		if (timeout_ms == 0) {
			/* Tried once, never queued: nothing to undo but an
			 * attempt left unanswered on a replaced connection. */
			kl__redis_conn_put(r, c);
			rc = not_failed(err, KL_ETIMEDOUT);
			guard_said(l, err);
			kl__redis_undo_later(r, l);
			return rc;
		}
		rc = kl__redis_wait_queued(r, &c, l, cancel, deadline, fence,
					   &sent, err);
	}
	if (rc == KL_OK && kl_cancel_fired(cancel)) {
		/* Granted as the token fired: the cancel wins, and the key
		 * goes to the next waiter. */
		kl__redis_conn_put(r, c);
		c = NULL;
		kl__redis_release_key(r, l, &released, NULL);
		kl__redis_lease_unref(l);
		*fence = 0;
		return not_failed(err, KL_ECANCELED);
	}
	if (rc != KL_OK) {
		/* Also after a failure, once an attempt was sent: its reply
		 * may have been lost after the server queued or granted us. */
		if (sent != 0)
			kl__redis_leave_anyway(r, c, l, cap);
		kl__redis_stash(l, &c);
		kl__redis_conn_put(r, c);
		rc = not_failed(err, rc);
		if (rc == KL_ETIMEDOUT)
			guard_said(l, err);
		kl__redis_undo_later(r, l);
		*fence = 0;
		return rc;
	}
	/* Granted.  An attempt left unanswered on a replaced connection
	 * could only grant this same token; and the server, which answered
	 * a later command, has read it (it was sent first, to the same
	 * server), so it cannot run after the release. */
	stale_close(l);
	l->epoch = c->epoch;
	kl__redis_conn_put(r, c);
	pthread_mutex_lock(&r->mu);
	l->valid_until =
		sent + l->ttl_ms * KL_R_MS - kl__redis_drift_ns(l->ttl_ms);
	l->renew_at = sent + l->ttl_ms * KL_R_MS / 3;
	if (l->epoch < r->epoch)
		l->lost = true; /* the server restarted just after the grant */
	lease_link(r, l);
	if (l->lost || l->renew_at < r->sleep_until)
		pthread_cond_broadcast(&r->cv);
	pthread_mutex_unlock(&r->mu);
	*out = l;
	return KL_OK;
}

static int
redis_release(void *impl, void *lease, kl_error *err)
{
	struct kl__redis *r = impl;
	struct kl__rlease *l = lease;
	bool released = false;
	int rc;

	pthread_mutex_lock(&r->mu);
	l->released = true;
	lease_unlink(r, l);
	/* The lost callback never runs after release has returned: wait for
	 * one in progress, unless it is this very thread releasing from
	 * inside it. */
	while (l->in_cb && !pthread_equal(l->cb_thread, pthread_self()))
		pthread_cond_wait(&r->cv, &r->mu);
	/* Lost (kl_lease_valid() saw it, or a restart) but not reported yet:
	 * the renewal thread no longer sees the lease, so report it here,
	 * before release returns, or it would never be. */
	if (l->lost && l->lost_fn != NULL && !l->notified) {
		void (*fn)(void *) = l->lost_fn;
		void *ctx = l->ctx;

		l->notified = true;
		pthread_mutex_unlock(&r->mu);
		fn(ctx);
	} else {
		pthread_mutex_unlock(&r->mu);
	}

	rc = kl__redis_release_key(r, l, &released, err);
	if (rc != KL_OK) {
		/* Not answered: released by the renewal thread once the
		 * server answers (the release still reports the failure). */
		kl__redis_release_later(r, l);
		return rc;
	}
	if (!released) {
		kl__error_set(err, KL_EPROVIDER,
				"redis provider: the lease was already lost "
				"(expired, deleted or taken over)");
		rc = KL_EPROVIDER;
	}
	pthread_mutex_lock(&r->mu);
	kl__redis_lease_unref(l);
	pthread_mutex_unlock(&r->mu);
	return rc;
}

static bool
redis_valid(void *impl, void *lease)
{
	struct kl__redis *r = impl;
	struct kl__rlease *l = lease;
	bool valid;

	pthread_mutex_lock(&r->mu);
	if (!l->lost && kl__now_ns() >= l->valid_until) {
		l->lost = true;
		pthread_cond_broadcast(&r->cv);
	}
	valid = !l->lost;
	pthread_mutex_unlock(&r->mu);
	return valid;
}

static void
redis_watch(void *impl, void *lease, void (*lost)(void *ctx), void *ctx)
{
	struct kl__redis *r = impl;
	struct kl__rlease *l = lease;

	pthread_mutex_lock(&r->mu);
	l->lost_fn = lost;
	l->ctx = ctx;
	if (l->lost)
		pthread_cond_broadcast(&r->cv);
	pthread_mutex_unlock(&r->mu);
}

static int
redis_status(void *impl, const char *key, size_t key_len, size_t *holders,
	     size_t *waiters, kl_error *err)
{
	struct kl__redis *r = impl;
	struct kl__rconn *c = NULL;
	static const int which[4] = { KL_RK_LOCK, KL_RK_QUEUE, KL_RK_HB,
				      KL_RK_SHARED };
	struct kl__rnames n;
	const char *keys[4];
	size_t klens[4];
	redisReply *rep = NULL;
	int rc, tries = 0;

	*holders = *waiters = 0;
	if (names_make(r, key, key_len, NULL, &n) != KL_OK)
		return KL_ENOMEM;
	kl__rnames_pick(&n, which, 4, keys, klens);
	rc = kl__redis_conn_get(r, KL_R_NO_DEADLINE, &c, err);
	while (rc == KL_OK) {
		rc = kl__rconn_script(
			c, kl__redis_cmd_deadline(r, KL_R_NO_DEADLINE, 0),
			KL_RS_STATUS, 4, keys, klens, 0, NULL, NULL, &rep, err);
		if (rc == KL_OK || !c->broken || ++tries > 1)
			break;
		rc = kl__redis_conn_replace(r, &c, KL_R_NO_DEADLINE, err);
	}
	kl__redis_conn_put(r, c);
	names_free(&n);
	if (rc != KL_OK)
		return rc;
	if (rep->type == REDIS_REPLY_ARRAY && rep->elements == 2 &&
	    rep->element[0]->type == REDIS_REPLY_INTEGER &&
	    rep->element[1]->type == REDIS_REPLY_INTEGER) {
		*holders = (size_t)rep->element[0]->integer;
		*waiters = (size_t)rep->element[1]->integer;
	} else {
		kl__error_set(err, KL_EPROVIDER,
				"redis provider: unexpected reply to status");
		rc = KL_EPROVIDER;
	}
	freeReplyObject(rep);
	return rc;
}

/* ------------------------------------------------------------------ */
/* Snapshot                                                            */

#define SCAN_COUNT "256" /* keys the server looks at per SCAN call */

/* The hashes a snapshot found, sorted and unique at the end. */
struct hashes {
	char (*h)[65];
	size_t n, cap;
};

/* SCAN's MATCH pattern of the prefix's lock keys: the prefix with its
 * glob characters escaped, then "{*". */
static char *
match_pattern(const struct kl__redis *r, size_t *len)
{
	char *buf = malloc(2 * r->conf.prefix_len + 3), *p;

	if (buf == NULL)
		return NULL;
	p = buf;
	for (size_t i = 0; i < r->conf.prefix_len; i++) {
		char ch = r->conf.prefix[i];

		if (ch == '*' || ch == '?' || ch == '[' || ch == ']' ||
		    ch == '\\')
			*p++ = '\\';
		*p++ = ch;
	}
	*p++ = '{';
	*p++ = '*';
	*p = '\0';
	*len = (size_t)(p - buf);
	return buf;
}

/* Whether k is PREFIX{64 hex digits} alone or with ":q" or ":s" (a key
 * held exclusive, waited for, or held shared); its digits into hex.
 * Anything else, such as another prefix that ours begins, is not ours. */
static bool
key_hash(const struct kl__redis *r, const char *k, size_t len, char *hex)
{
	size_t p = r->conf.prefix_len, rl;
	const char *rest;

	if (len < p + 66 || memcmp(k, r->conf.prefix, p) != 0 ||
	    k[p] != '{' || k[p + 65] != '}')
		return false;
	for (size_t i = 1; i <= 64; i++)
		if (!((k[p + i] >= '0' && k[p + i] <= '9') ||
		      (k[p + i] >= 'a' && k[p + i] <= 'f')))
			return false;
	rest = k + p + 66;
	rl = len - p - 66;
	if (rl != 0 && !(rl == 2 && (memcmp(rest, ":q", 2) == 0 ||
				     memcmp(rest, ":s", 2) == 0)))
		return false;
	memcpy(hex, k + p + 1, 64);
	hex[64] = '\0';
	return true;
}

static int
hashes_add(struct hashes *hs, const char *hex)
{
	if (hs->n == hs->cap) {
		size_t cap = hs->cap != 0 ? 2 * hs->cap : 64;
		char (*h)[65];

		if (cap > SIZE_MAX / sizeof *h ||
		    (h = realloc(hs->h, cap * sizeof *h)) == NULL)
			return KL_ENOMEM;
		hs->h = h;
		hs->cap = cap;
	}
	memcpy(hs->h[hs->n++], hex, 65);
	return KL_OK;
}

static int
hash_cmp(const void *a, const void *b)
{
	return memcmp(a, b, 64);
}

/* Every key of the prefix that is held or waited for, by SCAN: each call
 * bounded (SCAN_COUNT keys), none blocking the server. */
static int
snapshot_scan(struct kl__redis *r, struct kl__rconn **cp, struct hashes *hs,
	      kl_error *err)
{
	char cursor[32] = "0", hex[65];
	const char *argv[6] = { "SCAN", cursor, "MATCH", NULL, "COUNT",
				SCAN_COUNT };
	size_t lens[6] = { 4, 1, 5, 0, 5, sizeof SCAN_COUNT - 1 };
	redisReply *rep;
	char *pat;
	int rc = KL_OK;

	if ((pat = match_pattern(r, &lens[3])) == NULL)
		return KL_ENOMEM;
	argv[3] = pat;
	do {
		redisReply *keys;

		/* A pooled connection the server closed while idle (its
		 * timeout, a restart) is replaced once, as status does: SCAN
		 * keeps no state in the connection, so the same cursor goes
		 * on the new one. */
		for (int tries = 0;; tries++) {
			rc = kl__rconn_command(
				*cp,
				kl__redis_cmd_deadline(r, KL_R_NO_DEADLINE, 0),
				6, argv, lens, &rep, err);
			if (rc == KL_OK || !(*cp)->broken || tries > 0 ||
			    (rc = kl__redis_conn_replace(
				     r, cp, KL_R_NO_DEADLINE, err)) != KL_OK)
				break;
		}
		if (rc != KL_OK)
			break;
		if (rep->type != REDIS_REPLY_ARRAY || rep->elements != 2 ||
		    rep->element[0]->type != REDIS_REPLY_STRING ||
		    rep->element[0]->len >= sizeof cursor ||
		    rep->element[1]->type != REDIS_REPLY_ARRAY) {
			kl__error_set(err, KL_EPROVIDER,
					"redis provider: unexpected reply to "
					"SCAN: %.160s",
					rep->type == REDIS_REPLY_ERROR
						? rep->str
						: "odd reply");
			freeReplyObject(rep);
			rc = KL_EPROVIDER;
			break;
		}
		memcpy(cursor, rep->element[0]->str, rep->element[0]->len);
		cursor[rep->element[0]->len] = '\0';
		lens[1] = rep->element[0]->len;
		keys = rep->element[1];
		for (size_t i = 0; i < keys->elements && rc == KL_OK; i++)
			if (keys->element[i]->type == REDIS_REPLY_STRING &&
			    key_hash(r, keys->element[i]->str,
				     keys->element[i]->len, hex))
				rc = hashes_add(hs, hex);
		freeReplyObject(rep);
	} while (rc == KL_OK && strcmp(cursor, "0") != 0);
	free(pat);
	if (rc == KL_OK && hs->n > 1) {
		size_t j = 1;

		/* SCAN may return a key twice, and a key held both ways
		 * and waited for has three names found. */
		qsort(hs->h, hs->n, sizeof *hs->h, hash_cmp);
		for (size_t i = 1; i < hs->n; i++)
			if (memcmp(hs->h[i], hs->h[j - 1], 64) != 0)
				memcpy(hs->h[j++], hs->h[i], 65);
		hs->n = j;
	}
	return rc;
}

static bool
snap_str(const redisReply *e)
{
	return e->type == REDIS_REPLY_STRING && e->len >= 1;
}

/* The entries of one key (the snapshot script's reply) to fn; *stop when
 * fn asked to stop. */
static int
snapshot_key(const struct kl__rnames *n, const redisReply *rep,
	     kl_snapshot_fn fn, void *arg, bool *stop, kl_error *err)
{
	size_t nh, nw, at = 2;
	kl_lock_info info;

	if (rep->type != REDIS_REPLY_ARRAY || rep->elements < 2 ||
	    rep->element[0]->type != REDIS_REPLY_INTEGER ||
	    rep->element[1]->type != REDIS_REPLY_INTEGER ||
	    rep->element[0]->integer < 0 || rep->element[1]->integer < 0)
		goto odd;
	nh = (size_t)rep->element[0]->integer;
	nw = (size_t)rep->element[1]->integer;
	if (nh > (SIZE_MAX - 2) / 5 || nw > (SIZE_MAX - 2) / 5 ||
	    rep->elements != 2 + 3 * nh + 2 * nw)
		goto odd;
	for (size_t i = 0; i < nh + nw && !*stop; i++) {
		bool waiting = i >= nh;
		const redisReply *m = rep->element[at++];
		const redisReply *f = waiting ? NULL : rep->element[at++];
		const redisReply *e = rep->element[at++];

		if (!snap_str(m) || e->type != REDIS_REPLY_INTEGER ||
		    (f != NULL && f->type != REDIS_REPLY_STRING))
			goto odd;
		memset(&info, 0, sizeof info);
		/* Only the key's SHA-256 is in the server. */
		info.key = NULL;
		info.key_len = 0;
		info.detail = n->k[KL_RK_LOCK];
		info.waiting = waiting;
		info.shared = m->str[0] == 's';
		info.fence = f != NULL ? strtoull(f->str, NULL, 10) : 0;
		info.elapsed_ms = e->integer >= 0 ? e->integer : -1;
		info.position = waiting ? i - nh : 0;
		*stop = fn(&info, arg) != 0;
	}
	return KL_OK;
odd:
	kl__error_set(err, KL_EPROVIDER,
			"redis provider: unexpected reply to a snapshot");
	return KL_EPROVIDER;
}

/*
 * Lists the prefix's locks: SCAN (MATCH PREFIX{*, a bounded number of
 * keys per call) for every key held or waited for, then one script per key,
 * which reads its holders and live waiters at one moment.  fn runs between
 * the commands, with no lock of ours held; the connection is ours alone
 * meanwhile.  The key names are not in the server (only their digests):
 * info.key is NULL and info.detail the Redis key; pid and tid are not
 * recorded (0); an exclusive holder's time held is unknown (-1).
 */
static int
redis_snapshot(void *impl, kl_snapshot_fn fn, void *arg, kl_error *err)
{
	static const int which[6] = { KL_RK_LOCK,   KL_RK_QUEUE,
				      KL_RK_HB,	    KL_RK_FENCE,
				      KL_RK_SHARED, KL_RK_SMETA };
	struct kl__redis *r = impl;
	struct hashes hs = { NULL, 0, 0 };
	struct kl__rconn *c = NULL;
	bool stop = false;
	int rc;

	rc = kl__redis_conn_get(r, KL_R_NO_DEADLINE, &c, err);
	if (rc == KL_OK)
		rc = snapshot_scan(r, &c, &hs, err);
	for (size_t i = 0; rc == KL_OK && i < hs.n && !stop; i++) {
		struct kl__rnames n;
		const char *keys[6];
		size_t klens[6];
		redisReply *rep;

		if ((rc = names_of_hex(r, hs.h[i], NULL, &n)) != KL_OK)
			break;
		kl__rnames_pick(&n, which, 6, keys, klens);
		for (int tries = 0;; tries++) {
			rc = kl__rconn_script(
				c,
				kl__redis_cmd_deadline(r, KL_R_NO_DEADLINE, 0),
				KL_RS_SNAPSHOT, 6, keys, klens, 0, NULL, NULL,
				&rep, err);
			/* As status does: once more on a new connection. */
			if (rc == KL_OK || !c->broken || tries > 0 ||
			    (rc = kl__redis_conn_replace(
				     r, &c, KL_R_NO_DEADLINE, err)) != KL_OK)
				break;
		}
		if (rc == KL_OK) {
			rc = snapshot_key(&n, rep, fn, arg, &stop, err);
			freeReplyObject(rep);
		}
		names_free(&n);
	}
	kl__redis_conn_put(r, c);
	free(hs.h);
	return rc;
}

/* ------------------------------------------------------------------ */
/* Opening and closing                                                 */

static void
redis_destroy(void *impl)
{
	struct kl__redis *r = impl;
	struct kl__rlease *l;

	if (r->thread_started) {
		pthread_mutex_lock(&r->mu);
		r->stopping = true;
		pthread_cond_broadcast(&r->cv);
		pthread_mutex_unlock(&r->mu);
		/* A child of fork() has no renewal thread to join. */
		if (r->pid == getpid())
			pthread_join(r->thread, NULL);
	}
	/* Acquires not undone yet: their grants expire with their ttl. */
	while ((l = r->undos) != NULL) {
		r->undos = l->undo_next;
		kl__redis_lease_unref(l);
	}
	/* Leases still held are a caller's error; free them anyway. */
	while ((l = r->leases) != NULL) {
		lease_unlink(r, l);
		l->refs = 1;
		kl__redis_lease_unref(l);
	}
	while (r->nidle > 0)
		kl__rconn_close(r->idle[--r->nidle]);
	kl__rconn_close(r->rconn);
	free(r->idle);
	free(r->gkey[0]);
	free(r->gkey[1]);
	/* In a child of fork(), the parent's renewal thread may still count
	 * as a waiter of cv, and destroying it would wait for that thread
	 * for ever: leave both to the child's exit. */
	if (r->pid == getpid()) {
		pthread_cond_destroy(&r->cv);
		pthread_mutex_destroy(&r->mu);
	}
	kl__redis_conf_clear(&r->conf);
	free(r);
}

static const kl_provider_ops redis_ops = {
	.struct_size = sizeof(kl_provider_ops),
	.name = "redis",
	.acquire = redis_acquire,
	.release = redis_release,
	.valid = redis_valid,
	.destroy = redis_destroy,
	.status = redis_status,
	.watch = redis_watch,
	.snapshot = redis_snapshot,
};


int
kl_redis_provider_open(kl_provider **out, const char *uri, kl_error *err)
{
	pthread_condattr_t ca;
	struct kl__rconn *c = NULL;
	struct kl__redis *r;
	int rc;

	if (out != NULL)
		*out = NULL;
	if (out == NULL || uri == NULL) {
		kl__error_set(err, KL_EINVAL,
				"redis provider: no URI or no output given");
		return KL_EINVAL;
	}
	if ((r = calloc(1, sizeof *r)) == NULL)
		return KL_ENOMEM;
	if ((rc = kl__redis_conf_parse(&r->conf, uri, err)) != KL_OK) {
		free(r);
		return rc;
	}
	r->pid = getpid();
	r->max_ttl_ms = r->conf.ttl_ms;
	r->undo_tail = &r->undos;
	pthread_mutex_init(&r->mu, NULL);
	pthread_condattr_init(&ca);
	pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
	pthread_cond_init(&r->cv, &ca);
	pthread_condattr_destroy(&ca);
	if ((r->idle = calloc(r->conf.pool, sizeof *r->idle)) == NULL) {
		rc = KL_ENOMEM;
		goto fail;
	}
	for (int i = 0; i < 2; i++) {
		const char *what = i == 0 ? "guard" : "maxttl";

		r->gkey_len[i] = r->conf.prefix_len + strlen(what);
		if ((r->gkey[i] = malloc(r->gkey_len[i] + 1)) == NULL) {
			rc = KL_ENOMEM;
			goto fail;
		}
		memcpy(r->gkey[i], r->conf.prefix, r->conf.prefix_len);
		memcpy(r->gkey[i] + r->conf.prefix_len, what,
		       strlen(what) + 1);
	}
	/* Connect now, so a wrong address or password fails here. */
	if ((rc = kl__redis_conn_new(r, KL_R_NO_DEADLINE, &c, err)) != KL_OK)
		goto fail;
	kl__redis_conn_put(r, c);
	if ((rc = kl__redis_start_thread(r)) != KL_OK)
		goto fail;
	if ((rc = kl_provider_new(out, &redis_ops, r)) != KL_OK)
		goto fail;
	return KL_OK;
fail:
	redis_destroy(r);
	return rc;
}
