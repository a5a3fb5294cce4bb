/* SPDX-License-Identifier: MIT */
/*
 * The Redis provider (libkeylock-redis): keyed FIFO locks shared by every
 * client of one Redis server.  The data model and its invariants are
 * described above the scripts in redis_conn.c; this file is the client side.
 *
 * Acquire: one atomic script per attempt either grants the key (the caller
 * is the first live waiter, or nobody live waits) or puts the caller's
 * random token in the key's queue.  A queued waiter then blocks on its own
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
 * mark_server).  Meanwhile acquires wait, as behind a holder.  Whether
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

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "redis_internal.h"

#define MIN_TTL_MS 100
#define WAKE_SLICE_MS 50    /* longest BLPOP: bounds the cancel latency */
#define RECHECK_MAX_MS 250  /* longest time between two attempts */
#define IDLE_LINGER_MS 250  /* the renewal thread's nap with no lease */
#define RECHECK_MIN_MS 25
#define GRACE_MS 100        /* a wait's commands end by its deadline + this */
#define RETRY_GAP_MAX_MS 250 /* between renewal attempts after an error */
#define FENCE_KEEP_MS 86400000 /* the fence counter outlives idle keys */
#define RECORD_REFRESH_MS 60000 /* how often attempts refresh the ttl
				 * record (also kept FENCE_KEEP_MS) */
#define TOKEN_BYTES 16
#define MAX_RECONNECTS 2    /* consecutive, within one wait */
#define STALE_MAX 8         /* connections an acquire leaves unanswered */
#define UNDO_MAX 32         /* abandoned acquires waiting to be undone */
#define UNDO_SLICE_MS 50    /* the renewal thread's wait for their replies */
#define UNDO_RETRY_MS 100   /* between two tries while the server is silent */
#define LEAVE_MIN_MS 10     /* the least time a leave gets after a wait */

#define MS (INT64_C(1000000))

enum { K_LOCK, K_QUEUE, K_HB, K_FENCE, K_WAKE, K_COUNT };

/* The Redis key names of one lock key (K_WAKE only with a token). */
struct names {
	char *buf;
	const char *k[K_COUNT];
	size_t len[K_COUNT];
};

struct lease {
	struct lease *prev, *next; /* r->leases, while held */
	bool linked;
	char tok[2 * TOKEN_BYTES + 1];
	struct names n;
	int64_t ttl_ms;
	int64_t guard_left_ms; /* the restart guard, at the last attempt */
	uint64_t epoch; /* r->epoch when granted */
	/* Under r->mu. */
	int64_t renew_at;    /* ns: next renewal */
	int64_t valid_until; /* ns: the key surely exists until then */
	bool lost, released, notified, in_cb;
	pthread_t cb_thread;
	void (*lost_fn)(void *ctx);
	void *ctx;
	int refs; /* the owner, plus the renewal thread while it uses it */
	/* Connections on which an attempt of this acquire timed out: the
	 * server may still run it, and grant the key to this token.  Owned
	 * by the acquiring thread, then by r->undos (see undo_try). */
	struct kl__rconn *stale[STALE_MAX];
	int nstale;
	struct lease *undo_next; /* r->undos */
	int64_t undo_until; /* ns: no use undoing after (0: not known yet) */
};

struct redis {
	struct kl__redis_conf conf;
	pthread_mutex_t mu;
	pthread_cond_t cv;
	pid_t pid;
	bool thread_started;
	pthread_t thread;
	struct kl__rconn *rconn; /* the renewal thread's alone */
	/* Under mu. */
	struct kl__rconn **idle;
	size_t nidle;
	char run_id[41];
	uint64_t epoch;     /* restarts seen */
	int64_t max_ttl_ms; /* longest ttl used: the automatic restart guard */
	int64_t seen_ttl_ms; /* longest ttl record the server showed us */
	int64_t rec_ns;      /* when an attempt last refreshed the record */
	struct lease *leases;
	bool stopping;
	/* The restart marker and the ttl record (see script_mark). */
	char *gkey[2];
	size_t gkey_len[2];
	/* While the renewal thread sleeps: when it wakes by itself
	 * (KL_R_NO_DEADLINE: only when signalled); 0 while it runs, and so
	 * will look at every lease before it sleeps again.  A new lease due
	 * before then must wake it, any other need not. */
	int64_t sleep_until;
	/* Acquires that gave up while an attempt was unanswered, oldest
	 * first, and when the renewal thread next tries to undo them. */
	struct lease *undos, **undo_tail;
	size_t nundos;
	int64_t undo_at;
};

/* ------------------------------------------------------------------ */
/* Names and leases                                                    */

static void
names_free(struct names *n)
{
	free(n->buf);
	n->buf = NULL;
}

/* PREFIX{sha256(key)} and its companions; the wake list needs tok. */
static int
names_make(const struct redis *r, const char *key, size_t key_len,
	   const char *tok, struct names *n)
{
	static const char *const suffix[K_COUNT] = { "", ":q", ":hb", ":f",
						     ":w:" };
	char hex[65];
	size_t base = r->conf.prefix_len + 66, total = 0, toklen;
	char *p;
	int i;

	toklen = tok != NULL ? strlen(tok) : 0;
	for (i = 0; i < K_COUNT; i++)
		total += base + strlen(suffix[i]) + 1;
	total += toklen;
	if ((n->buf = malloc(total)) == NULL)
		return KL_ENOMEM;
	kl__redis_sha256_hex(key, key_len, hex);
	p = n->buf;
	for (i = 0; i < K_COUNT; i++) {
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
		if (i == K_WAKE && toklen > 0) {
			memcpy(p, tok, toklen);
			p += toklen;
		}
		n->len[i] = (size_t)(p - n->k[i]);
		*p++ = '\0';
	}
	return KL_OK;
}

static int
lease_new(struct redis *r, const char *key, size_t key_len, int64_t ttl_ms,
	  struct lease **out, kl_error *err)
{
	static const char hex[] = "0123456789abcdef";
	unsigned char raw[TOKEN_BYTES];
	struct lease *l;

	*out = NULL;
	if ((l = calloc(1, sizeof *l)) == NULL)
		return KL_ENOMEM;
	if (!kl__redis_random(raw, sizeof raw)) {
		free(l);
		kl__redis_error(err, KL_EPROVIDER,
				"redis provider: no random bytes for a "
				"token");
		return KL_EPROVIDER;
	}
	for (int i = 0; i < TOKEN_BYTES; i++) {
		l->tok[2 * i] = hex[raw[i] >> 4];
		l->tok[2 * i + 1] = hex[raw[i] & 15];
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
stale_close(struct lease *l)
{
	while (l->nstale > 0)
		kl__rconn_close(l->stale[--l->nstale]);
}

/* Drops a reference; mu held when the lease may be shared. */
static void
lease_unref(struct lease *l)
{
	if (--l->refs > 0)
		return;
	stale_close(l);
	names_free(&l->n);
	free(l);
}

static void
lease_link(struct redis *r, struct lease *l)
{
	l->prev = NULL;
	l->next = r->leases;
	if (r->leases != NULL)
		r->leases->prev = l;
	r->leases = l;
	l->linked = true;
}

static void
lease_unlink(struct redis *r, struct lease *l)
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
static int64_t
drift_ns(int64_t ttl_ms)
{
	return (ttl_ms / 100 + 2) * MS;
}

/* ------------------------------------------------------------------ */
/* Connections                                                         */

static size_t num(char *buf, size_t size, int64_t v);
static int64_t cmd_deadline(const struct redis *r, int64_t wait_deadline,
			    int64_t extra_ns);

/*
 * The restart marker, PREFIX "guard" (a HASH without expiry), keeps the
 * evidence of whether the server still has every lock it granted:
 *   run    the run_id of the server run that last checked it
 *   dur    "1" while that run kept every write (appendonly yes and
 *          appendfsync always), at every connection made to it
 *   start  server ms from which locks may be missing (the run's start,
 *          or when the marker was found gone), or 0: none are
 *   floor  the server's time in microseconds when locks were last found
 *          possibly missing: every fence issued before is below it, and
 *          a fence counter not above it starts anew from the clock
 * Every new connection runs this script.  No marker: the data is lost, or
 * the server is new, which cannot be told apart: guarded from the run's
 * start.  A marker of another run: the server restarted with the data of
 * that run, complete only if that run kept every write (dur); we ask the
 * new run to keep every write too, or a run started without AOF could
 * have loaded an older snapshot that holds an old durable marker.  So the
 * decision rests on what the old run was and what the new one loaded,
 * never on how the new run is configured alone.  A durable restart keeps
 * the old run's start while its guard may hold (by the ttl record, our
 * ttl and our guard): locks it lacked are still missing, and their
 * holders may never have met that run.  The script also raises
 * the ttl record, PREFIX "maxttl", to our longest ttl: a holder's renewal
 * thread connecting to a restarted server raises it again at once.
 *
 * KEYS: marker, ttl record.  ARGV: run_id, "1" when this run keeps every
 * write, its uptime in ms (a lower bound), our longest ttl, ms to keep the
 * record, our restart guard in ms.  Returns {start, record}.
 */
static const char script_mark[] =
	"local t = redis.call('TIME')\n"
	"local now = tonumber(t[1]) * 1000 + "
	"math.floor(tonumber(t[2]) / 1000)\n"
	"local g = { redis.call('HGET', KEYS[1], 'run'), "
	"redis.call('HGET', KEYS[1], 'dur'), "
	"redis.call('HGET', KEYS[1], 'start') }\n"
	"local floor = nil\n"
	"local start = now - tonumber(ARGV[3])\n"
	"local dur = ARGV[2]\n"
	"if start < 1 then start = 1 end\n"
	"if g[1] == ARGV[1] then\n"
	"  start = tonumber(g[3] or '1')\n"
	"  if g[2] ~= '1' then dur = '0' end\n"
	"elseif g[1] and g[1] ~= '?' and g[2] == '1' and dur == '1' then\n"
	"  start = tonumber(g[3] or '0')\n"
	"  local need = tonumber(redis.call('GET', KEYS[2]) or '0')\n"
	"  for _, v in ipairs({ARGV[4], ARGV[6]}) do\n"
	"    if need < tonumber(v) then need = tonumber(v) end\n"
	"  end\n"
	"  if start + need <= now then start = 0 end\n"
	"else\n"
	"  if g[1] == '?' and tonumber(g[3] or '0') > start then\n"
	"    start = tonumber(g[3])\n"
	"  end\n"
	"  floor = string.format('%.0f', tonumber(t[1]) * 1000000 + "
	"tonumber(t[2]))\n"
	"end\n"
	"start = string.format('%.0f', start)\n"
	"redis.call('HSET', KEYS[1], 'run', ARGV[1], 'dur', dur, "
	"'start', start)\n"
	"if floor then redis.call('HSET', KEYS[1], 'floor', floor) end\n"
	"local rec = tonumber(redis.call('GET', KEYS[2]) or '0')\n"
	"if rec < tonumber(ARGV[4]) then\n"
	"  rec = tonumber(ARGV[4])\n"
	"  redis.call('SET', KEYS[2], ARGV[4], 'PX', ARGV[5])\n"
	"end\n"
	"return {start, rec}\n";

/* Checks the restart marker on a new connection (see script_mark) and
 * records which server run c reached.  A changed run_id is a restart:
 * count it, and unless the marker shows that the server kept every lock,
 * the leases granted before it are gone. */
static int
mark_server(struct redis *r, struct kl__rconn *c, int64_t cap_ns,
	    kl_error *err)
{
	char up[24], ttl[24], keep[24], guard[24];
	const char *argv[11] = { "EVAL", script_mark, "2", r->gkey[0],
				 r->gkey[1], c->run_id,
				 c->persistent ? "1" : "0", up, ttl, keep,
				 guard };
	size_t lens[11] = { 4, sizeof script_mark - 1, 1, r->gkey_len[0],
			    r->gkey_len[1], strlen(c->run_id), 1 };
	redisReply *rep;
	int64_t deadline = cmd_deadline(r, KL_R_NO_DEADLINE, 0);
	bool trusted;
	int rc;

	if (cap_ns < deadline)
		deadline = cap_ns;
	pthread_mutex_lock(&r->mu);
	lens[8] = num(ttl, sizeof ttl, r->max_ttl_ms);
	lens[10] = num(guard, sizeof guard,
		       r->conf.restart_guard_ms != KL_R_GUARD_AUTO
			       ? r->conf.restart_guard_ms
		       : r->seen_ttl_ms > r->max_ttl_ms ? r->seen_ttl_ms
							 : r->max_ttl_ms);
	pthread_mutex_unlock(&r->mu);
	lens[7] = num(up, sizeof up, kl__rconn_uptime_ms(c));
	lens[9] = num(keep, sizeof keep, FENCE_KEEP_MS);
	rc = kl__rconn_command(c, deadline, 11, argv, lens, &rep, err);
	if (rc != KL_OK)
		return rc;
	if (rep->type != REDIS_REPLY_ARRAY || rep->elements != 2 ||
	    rep->element[0]->type != REDIS_REPLY_STRING ||
	    rep->element[1]->type != REDIS_REPLY_INTEGER) {
		kl__redis_error(err, KL_EPROVIDER,
				"redis provider: the restart marker could not "
				"be checked: %.160s",
				rep->type == REDIS_REPLY_ERROR ? rep->str
							       : "odd reply");
		freeReplyObject(rep);
		c->broken = true;
		return KL_EPROVIDER;
	}
	trusted = strcmp(rep->element[0]->str, "0") == 0;
	pthread_mutex_lock(&r->mu);
	if (rep->element[1]->integer > r->seen_ttl_ms)
		r->seen_ttl_ms = rep->element[1]->integer;
	if (r->run_id[0] == '\0') {
		memcpy(r->run_id, c->run_id, sizeof r->run_id);
	} else if (strcmp(r->run_id, c->run_id) != 0) {
		memcpy(r->run_id, c->run_id, sizeof r->run_id);
		r->epoch++;
		if (!trusted) {
			for (struct lease *l = r->leases; l != NULL;
			     l = l->next)
				if (l->epoch < r->epoch)
					l->lost = true;
			pthread_cond_broadcast(&r->cv);
		}
	}
	c->epoch = r->epoch;
	pthread_mutex_unlock(&r->mu);
	freeReplyObject(rep);
	return KL_OK;
}

static int
conn_new(struct redis *r, int64_t cap_ns, struct kl__rconn **out,
	 kl_error *err)
{
	int rc = kl__rconn_open(&r->conf, cap_ns, out, err);

	if (rc == KL_OK && (rc = mark_server(r, *out, cap_ns, err)) != KL_OK) {
		kl__rconn_close(*out);
		*out = NULL;
	}
	return rc;
}

/* A pooled connection, else a new one made by cap_ns. */
static int
conn_get(struct redis *r, int64_t cap_ns, struct kl__rconn **out,
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
	return conn_new(r, cap_ns, out, err);
}

/* c came from conn_get or conn_new in this very call of the provider, so
 * in this process: no getpid() needed to tell a parent's connection. */
static void
conn_put(struct redis *r, struct kl__rconn *c)
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
static int
conn_replace(struct redis *r, struct kl__rconn **cp, int64_t cap_ns,
	     kl_error *err)
{
	kl__rconn_close(*cp);
	*cp = NULL;
	return conn_new(r, cap_ns, cp, err);
}

/* Keeps *cp, if a command of l's wait on it is still unanswered, rather
 * than let conn_replace or conn_put close it: closing would not stop the
 * server from running an attempt once it reads it, nor end the wait's
 * place in the queue (see undo_later). */
static void
stash(struct lease *l, struct kl__rconn **cp)
{
	if (*cp == NULL || !(*cp)->broken || (*cp)->owed == 0 ||
	    l->nstale == STALE_MAX)
		return;
	l->stale[l->nstale++] = *cp;
	*cp = NULL;
}

/* Takes l, an acquire that gave up, from its thread.  A server that was
 * stalled runs the attempts it had not answered when it resumes, and one
 * of them may grant the key to l's token, which nobody holds: the key
 * would stay taken for a whole ttl.  Or the token stays queued, and blocks
 * the waiters behind it for its heartbeat.  The renewal thread undoes both
 * as soon as the server answers again (undo_try).  Past UNDO_MAX waiting,
 * l is dropped: such a grant expires with its ttl, such a waiter with its
 * heartbeat. */
static void
undo_later(struct redis *r, struct lease *l)
{
	if (l->nstale == 0) {
		lease_unref(l);
		return;
	}
	pthread_mutex_lock(&r->mu);
	if (r->nundos < UNDO_MAX && r->thread_started &&
	    r->pid == kl__redis_getpid()) {
		l->undo_next = NULL;
		*r->undo_tail = l;
		r->undo_tail = &l->undo_next;
		r->nundos++;
		l = NULL;
		pthread_cond_broadcast(&r->cv);
	}
	pthread_mutex_unlock(&r->mu);
	if (l != NULL)
		lease_unref(l);
}

/* The deadline of one command of a wait: the command timeout, but no later
 * than GRACE_MS after the wait's deadline or after the extra_ns the server
 * itself blocks, whichever is later, so that a stalled server cannot hold
 * a waiter much past its timeout.  A BLPOP never blocks past the deadline
 * (see wait_queued), so it too ends by the deadline plus GRACE_MS. */
static int64_t
cmd_deadline(const struct redis *r, int64_t wait_deadline, int64_t extra_ns)
{
	int64_t now = kl__redis_now_ns();
	int64_t d = now + extra_ns + r->conf.timeout_ms * MS, cap;

	if (wait_deadline != KL_R_NO_DEADLINE) {
		cap = (wait_deadline > now + extra_ns ? wait_deadline
						      : now + extra_ns) +
		      GRACE_MS * MS;
		if (cap < d)
			d = cap;
	}
	return d;
}

/* The restart guard an attempt asks for: *ms (-1: off), whether the
 * server's ttl record also counts, and whether to refresh the record. */
static void
guard_need(struct redis *r, int64_t ttl_ms, int64_t *ms, bool *use_rec,
	   bool *refresh)
{
	int64_t now = kl__redis_now_ns();

	pthread_mutex_lock(&r->mu);
	if (ttl_ms > r->max_ttl_ms)
		r->max_ttl_ms = ttl_ms;
	/* The record needs raising, or its expiry renewing now and then. */
	*refresh = ttl_ms > r->seen_ttl_ms || r->rec_ns == 0 ||
		   now - r->rec_ns >= RECORD_REFRESH_MS * MS;
	if (*refresh)
		r->rec_ns = now;
	if (r->conf.restart_guard_ms == KL_R_GUARD_AUTO) {
		*ms = r->max_ttl_ms > r->seen_ttl_ms ? r->max_ttl_ms
						     : r->seen_ttl_ms;
		*use_rec = true;
	} else {
		*ms = r->conf.restart_guard_ms > 0 ? r->conf.restart_guard_ms
						   : -1;
		*use_rec = false;
	}
	pthread_mutex_unlock(&r->mu);
}

/* ------------------------------------------------------------------ */
/* Scripts of a wait                                                   */

static size_t
num(char *buf, size_t size, int64_t v)
{
	return (size_t)snprintf(buf, size, "%" PRId64, v);
}

/* One attempt; queued when the caller may have joined the queue before
 * (the script then also clears its heartbeat and wake list on a fast-path
 * grant).  *granted and *fence on KL_OK; *sent_ns is when it was sent (a
 * grant's ttl runs from no earlier than that). */
static int
attempt(struct redis *r, struct kl__rconn *c, struct lease *l, bool try_only,
	bool queued, int64_t deadline, bool *granted, uint64_t *fence,
	int64_t *sent_ns, kl_error *err)
{
	char ttl[24], hb[24], keep[24], guard[24];
	const char *keys[7] = { l->n.k[K_LOCK], l->n.k[K_QUEUE], l->n.k[K_HB],
				l->n.k[K_FENCE], l->n.k[K_WAKE], r->gkey[0],
				r->gkey[1] };
	size_t klens[7] = { l->n.len[K_LOCK], l->n.len[K_QUEUE],
			    l->n.len[K_HB], l->n.len[K_FENCE],
			    l->n.len[K_WAKE], r->gkey_len[0],
			    r->gkey_len[1] };
	const char *args[8];
	size_t alens[8];
	redisReply *rep, *e0, *e1;
	int64_t need;
	bool use_rec, refresh;
	int rc;

	*granted = false;
	guard_need(r, l->ttl_ms, &need, &use_rec, &refresh);
	args[0] = l->tok;
	alens[0] = strlen(l->tok);
	args[1] = ttl;
	alens[1] = num(ttl, sizeof ttl, l->ttl_ms);
	args[2] = hb;
	alens[2] = num(hb, sizeof hb, r->conf.heartbeat_ms);
	args[3] = try_only ? "try" : queued ? "wait" : "join";
	alens[3] = strlen(args[3]);
	args[4] = keep;
	alens[4] = num(keep, sizeof keep, FENCE_KEEP_MS);
	args[5] = guard;
	alens[5] = num(guard, sizeof guard, need);
	args[6] = use_rec ? "1" : "0";
	alens[6] = 1;
	args[7] = refresh ? "1" : "0";
	alens[7] = 1;
	*sent_ns = kl__redis_now_ns();
	rc = kl__rconn_script(c, deadline, KL_RS_ATTEMPT, 7, keys, klens, 8,
			      args, alens, &rep, err);
	if (rc != KL_OK)
		return rc;
	if (rep->type != REDIS_REPLY_ARRAY || rep->elements < 3 ||
	    rep->element[0]->type != REDIS_REPLY_INTEGER ||
	    rep->element[2]->type != REDIS_REPLY_INTEGER) {
		freeReplyObject(rep);
		kl__redis_error(err, KL_EPROVIDER,
				"redis provider: unexpected reply to an "
				"attempt");
		return KL_EPROVIDER;
	}
	e0 = rep->element[0];
	e1 = rep->element[1];
	pthread_mutex_lock(&r->mu);
	if (rep->element[2]->integer > r->seen_ttl_ms)
		r->seen_ttl_ms = rep->element[2]->integer;
	pthread_mutex_unlock(&r->mu);
	l->guard_left_ms = 0;
	if (e0->integer == 1) {
		*granted = true;
		if (e1->type == REDIS_REPLY_STRING)
			*fence = strtoull(e1->str, NULL, 10);
		else if (e1->type == REDIS_REPLY_INTEGER)
			*fence = (uint64_t)e1->integer;
	} else if (rep->elements > 3 &&
		   rep->element[3]->type == REDIS_REPLY_INTEGER) {
		l->guard_left_ms = rep->element[3]->integer;
	}
	freeReplyObject(rep);
	return KL_OK;
}

/* The leave script: out of the queue, and the key passed on if it came to
 * us in a race. */
static int
leave(struct redis *r, struct kl__rconn *c, struct lease *l, int64_t deadline,
      kl_error *err)
{
	const char *keys[4] = { l->n.k[K_LOCK], l->n.k[K_QUEUE], l->n.k[K_HB],
				l->n.k[K_WAKE] };
	size_t klens[4] = { l->n.len[K_LOCK], l->n.len[K_QUEUE],
			    l->n.len[K_HB], l->n.len[K_WAKE] };
	char hb[24];
	const char *args[2] = { l->tok, hb };
	size_t alens[2] = { strlen(l->tok), num(hb, sizeof hb,
						 r->conf.heartbeat_ms) };
	redisReply *rep;
	int rc;

	rc = kl__rconn_script(c, deadline, KL_RS_LEAVE, 4, keys, klens, 2,
			      args, alens, &rep, err);
	if (rc == KL_OK)
		freeReplyObject(rep);
	return rc;
}

/* Leaves after a failed or abandoned wait, when the connection still
 * works, by end (the wait's deadline plus grace) if it can: a wait ends
 * within its grace.  A leave that times out, like an attempt left
 * unanswered, is left to the renewal thread (undo_later); when the server
 * cannot be asked at all, the queue entry expires with its heartbeat. */
static void
leave_anyway(struct redis *r, struct kl__rconn *c, struct lease *l,
	     int64_t end)
{
	int64_t d, least = kl__redis_now_ns() + LEAVE_MIN_MS * MS;

	if (c == NULL || c->broken)
		return;
	d = cmd_deadline(r, kl__redis_now_ns(), 0);
	if (end < d && least < d)
		d = end > least ? end : least;
	leave(r, c, l, d, NULL);
}

/* Compare-and-delete with l's token, retried once on a new connection.
 * *released tells whether the key was still ours. */
static int
release_key(struct redis *r, struct lease *l, bool *released, kl_error *err)
{
	char hb[24];
	const char *args[2] = { l->tok, hb };
	size_t alens[2] = { strlen(l->tok), num(hb, sizeof hb,
						 r->conf.heartbeat_ms) };
	struct kl__rconn *c = NULL;
	redisReply *rep = NULL;
	int rc, tries = 0;

	*released = false;
	rc = conn_get(r, KL_R_NO_DEADLINE, &c, err);
	while (rc == KL_OK) {
		rc = kl__rconn_script(c, cmd_deadline(r, KL_R_NO_DEADLINE, 0),
				      KL_RS_RELEASE, 3, l->n.k, l->n.len, 2,
				      args, alens, &rep, err);
		if (rc == KL_OK || !c->broken || ++tries > 1)
			break;
		rc = conn_replace(r, &c, KL_R_NO_DEADLINE, err);
	}
	if (rc == KL_OK) {
		*released = rep->type == REDIS_REPLY_INTEGER &&
			    rep->integer == 1;
		freeReplyObject(rep);
	}
	conn_put(r, c);
	return rc;
}

/* BLPOP on the own wake list for slice_ms.  *woke when something came. */
static int
block(struct redis *r, struct kl__rconn *c, struct lease *l,
      int64_t slice_ms, int64_t wait_deadline, bool *woke, kl_error *err)
{
	char secs[32];
	const char *argv[3] = { "BLPOP", l->n.k[K_WAKE], secs };
	size_t lens[3] = { 5, l->n.len[K_WAKE], 0 };
	redisReply *rep;
	int rc;

	*woke = false;
	lens[2] = (size_t)snprintf(secs, sizeof secs, "%" PRId64 ".%03" PRId64,
				   slice_ms / 1000, slice_ms % 1000);
	rc = kl__rconn_command(c, cmd_deadline(r, wait_deadline, slice_ms * MS),
			       3, argv, lens, &rep, err);
	if (rc != KL_OK)
		return rc;
	if (rep->type == REDIS_REPLY_ERROR) {
		kl__redis_error(err, KL_EPROVIDER,
				"redis provider: BLPOP failed: %.160s",
				rep->str);
		rc = KL_EPROVIDER;
	}
	*woke = rep->type == REDIS_REPLY_ARRAY;
	freeReplyObject(rep);
	return rc;
}

/* After a broken connection in a wait: a new one to the same server run.
 * A restart lost the queue and maybe locks: the wait ends. */
static int
reconnect_in_wait(struct redis *r, struct kl__rconn **cp, uint64_t epoch,
		  int64_t deadline, int *reconnects, kl_error *err)
{
	int64_t now = kl__redis_now_ns();
	int rc;

	/* err already says why the last command failed.  Past the deadline
	 * the server did not answer in time: that is its failure, not a
	 * timeout of the wait. */
	if (++*reconnects > MAX_RECONNECTS || now >= deadline)
		return KL_EPROVIDER;
	rc = conn_replace(r, cp,
			  deadline == KL_R_NO_DEADLINE
				  ? KL_R_NO_DEADLINE
				  : deadline + GRACE_MS * MS,
			  err);
	if (rc != KL_OK)
		return rc;
	if ((*cp)->epoch != epoch) {
		kl__redis_error(err, KL_EPROVIDER,
				"redis provider: the server restarted during "
				"the wait (its run_id changed); its queue and "
				"locks may be lost");
		return KL_EPROVIDER;
	}
	return KL_OK;
}

/* Waits in the queue until granted (KL_OK), the deadline (KL_ETIMEDOUT),
 * the cancel token (KL_ECANCELED) or a server failure (KL_EPROVIDER). */
static int
wait_queued(struct redis *r, struct kl__rconn **cp, struct lease *l,
	    kl_cancel *cancel, int64_t deadline, uint64_t *fence,
	    int64_t *sent_ns, kl_error *err)
{
	int64_t recheck = r->conf.heartbeat_ms / 4, next_check, now, slice;
	uint64_t epoch = (*cp)->epoch;
	int reconnects = 0, rc;
	bool woke, granted;

	if (recheck > RECHECK_MAX_MS)
		recheck = RECHECK_MAX_MS;
	if (recheck < RECHECK_MIN_MS)
		recheck = RECHECK_MIN_MS;
	next_check = kl__redis_now_ns() + recheck * MS;
	for (;;) {
		if (kl_cancel_fired(cancel))
			return KL_ECANCELED;
		now = kl__redis_now_ns();
		if (now >= deadline)
			return KL_ETIMEDOUT;
		/* Rounded up: never a busy loop of zero-length BLPOPs. */
		slice = WAKE_SLICE_MS;
		if (deadline != KL_R_NO_DEADLINE &&
		    (deadline - now + MS - 1) / MS < slice)
			slice = (deadline - now + MS - 1) / MS;
		if ((next_check - now + MS - 1) / MS < slice)
			slice = (next_check - now + MS - 1) / MS;
		woke = false;
		if (slice > 0) {
			rc = block(r, *cp, l, slice, deadline, &woke, err);
			if (rc != KL_OK && !(*cp)->broken)
				return rc;
			if (rc != KL_OK) {
				/* The token stays queued, and live, until the
				 * leave at the end: kept for undo_later. */
				stash(l, cp);
				rc = reconnect_in_wait(r, cp, epoch,
						       deadline, &reconnects,
						       err);
				if (rc != KL_OK)
					return rc;
				next_check = 0; /* try again at once */
				continue;
			}
		}
		now = kl__redis_now_ns();
		if (!woke && now < next_check)
			continue;
		rc = attempt(r, *cp, l, false, true,
			     cmd_deadline(r, deadline, 0), &granted, fence,
			     sent_ns, err);
		if (rc != KL_OK && !(*cp)->broken)
			return rc;
		if (rc != KL_OK) {
			stash(l, cp);
			rc = reconnect_in_wait(r, cp, epoch, deadline,
					       &reconnects, err);
			if (rc != KL_OK)
				return rc;
			next_check = 0;
			continue;
		}
		reconnects = 0;
		if (granted)
			return KL_OK;
		next_check = kl__redis_now_ns() + recheck * MS;
	}
}

/* The first attempt: the restart guard, then the script; a pooled
 * connection found dead is replaced once. */
static int
first_attempt(struct redis *r, struct kl__rconn **cp, struct lease *l,
	      bool try_only, int64_t deadline, bool *granted, uint64_t *fence,
	      int64_t *sent_ns, kl_error *err)
{
	int rc, tries = 0;

	for (;;) {
		rc = attempt(r, *cp, l, try_only, tries > 0,
			     try_only ? cmd_deadline(r, KL_R_NO_DEADLINE, 0)
				      : cmd_deadline(r, deadline, 0),
			     granted, fence, sent_ns, err);
		if (rc == KL_OK || !(*cp)->broken || ++tries > 1)
			return rc;
		stash(l, cp);
		/* Past its deadline the server did not answer in time: a new
		 * connection would only take the wait further past it. */
		if (!try_only && kl__redis_now_ns() >= deadline)
			return rc;
		rc = conn_replace(r, cp, try_only || deadline == KL_R_NO_DEADLINE
						 ? KL_R_NO_DEADLINE
						 : deadline + GRACE_MS * MS,
				  err);
		if (rc != KL_OK)
			return rc;
	}
}

/* ------------------------------------------------------------------ */
/* Provider operations                                                 */

/* A wait that timed out while the restart guard held says so. */
static void
guard_said(const struct lease *l, kl_error *err)
{
	if (l->guard_left_ms > 0)
		kl__redis_error(err, KL_ETIMEDOUT,
				"redis provider: no lock is granted for "
				"another %lld ms: the server may have lost "
				"locks in a restart (restart_guard)",
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
	struct redis *r = impl;
	struct kl__rconn *c = NULL;
	struct lease *l;
	int64_t deadline, cap, sent = 0;
	bool granted = false, released;
	int rc;

	*out = NULL;
	*fence = 0;
	if (flags & KL_ERRORCHECK) {
		kl__redis_error(err, KL_EINVAL,
				"redis provider: error-check mode "
				"(KL_ERRORCHECK) is not supported");
		return KL_EINVAL;
	}
	if (ttl_ms == 0)
		ttl_ms = r->conf.ttl_ms;
	if (ttl_ms < MIN_TTL_MS || ttl_ms > INT64_MAX / 4 ||
	    (timeout_ms < 0 && timeout_ms != KL_FOREVER)) {
		kl__redis_error(err, KL_EINVAL,
				"redis provider: the ttl must be at least "
				"%d ms",
				MIN_TTL_MS);
		return KL_EINVAL;
	}
	if (kl_cancel_fired(cancel))
		return KL_ECANCELED;
	deadline = kl__redis_deadline(timeout_ms);
	/* Connecting, too, ends by the deadline plus grace; a try-once has
	 * the connect and command timeouts. */
	cap = timeout_ms == 0 || deadline == KL_R_NO_DEADLINE
		      ? KL_R_NO_DEADLINE
		      : deadline + GRACE_MS * MS;
	if ((rc = lease_new(r, key, key_len, ttl_ms, &l, err)) != KL_OK)
		return rc;
	if ((rc = conn_get(r, cap, &c, err)) != KL_OK) {
		lease_unref(l);
		return rc;
	}
	rc = first_attempt(r, &c, l, timeout_ms == 0, deadline, &granted,
			   fence, &sent, err);
	if (rc == KL_OK && !granted) {
		if (timeout_ms == 0) {
			/* Tried once, never queued: nothing to undo but an
			 * attempt left unanswered on a replaced connection. */
			conn_put(r, c);
			rc = not_failed(err, KL_ETIMEDOUT);
			guard_said(l, err);
			undo_later(r, l);
			return rc;
		}
		rc = wait_queued(r, &c, l, cancel, deadline, fence, &sent,
				 err);
	}
	if (rc == KL_OK && kl_cancel_fired(cancel)) {
		/* Granted as the token fired: the cancel wins, and the key
		 * goes to the next waiter. */
		conn_put(r, c);
		c = NULL;
		release_key(r, l, &released, NULL);
		lease_unref(l);
		*fence = 0;
		return not_failed(err, KL_ECANCELED);
	}
	if (rc != KL_OK) {
		/* Also after a failure, once an attempt was sent: its reply
		 * may have been lost after the server queued or granted us. */
		if (sent != 0)
			leave_anyway(r, c, l, cap);
		stash(l, &c);
		conn_put(r, c);
		rc = not_failed(err, rc);
		if (rc == KL_ETIMEDOUT)
			guard_said(l, err);
		undo_later(r, l);
		*fence = 0;
		return rc;
	}
	/* Granted.  An attempt left unanswered on a replaced connection
	 * could only grant this same token; and the server, which answered
	 * a later command, has read it (it was sent first, to the same
	 * server), so it cannot run after the release. */
	stale_close(l);
	l->epoch = c->epoch;
	conn_put(r, c);
	pthread_mutex_lock(&r->mu);
	l->valid_until = sent + l->ttl_ms * MS - drift_ns(l->ttl_ms);
	l->renew_at = sent + l->ttl_ms * MS / 3;
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
	struct redis *r = impl;
	struct lease *l = lease;
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

	rc = release_key(r, l, &released, err);
	if (rc == KL_OK && !released) {
		kl__redis_error(err, KL_EPROVIDER,
				"redis provider: the lease was already lost "
				"(expired, deleted or taken over)");
		rc = KL_EPROVIDER;
	}
	pthread_mutex_lock(&r->mu);
	lease_unref(l);
	pthread_mutex_unlock(&r->mu);
	return rc;
}

static bool
redis_valid(void *impl, void *lease)
{
	struct redis *r = impl;
	struct lease *l = lease;
	bool valid;

	pthread_mutex_lock(&r->mu);
	if (!l->lost && kl__redis_now_ns() >= l->valid_until) {
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
	struct redis *r = impl;
	struct lease *l = lease;

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
	struct redis *r = impl;
	struct kl__rconn *c = NULL;
	struct names n;
	redisReply *rep = NULL;
	int rc, tries = 0;

	*holders = *waiters = 0;
	if (names_make(r, key, key_len, NULL, &n) != KL_OK)
		return KL_ENOMEM;
	rc = conn_get(r, KL_R_NO_DEADLINE, &c, err);
	while (rc == KL_OK) {
		rc = kl__rconn_script(c, cmd_deadline(r, KL_R_NO_DEADLINE, 0),
				      KL_RS_STATUS, 3, n.k, n.len, 0, NULL,
				      NULL, &rep, err);
		if (rc == KL_OK || !c->broken || ++tries > 1)
			break;
		rc = conn_replace(r, &c, KL_R_NO_DEADLINE, err);
	}
	conn_put(r, c);
	names_free(&n);
	if (rc != KL_OK)
		return rc;
	if (rep->type == REDIS_REPLY_ARRAY && rep->elements == 2 &&
	    rep->element[0]->type == REDIS_REPLY_INTEGER &&
	    rep->element[1]->type == REDIS_REPLY_INTEGER) {
		*holders = (size_t)rep->element[0]->integer;
		*waiters = (size_t)rep->element[1]->integer;
	} else {
		kl__redis_error(err, KL_EPROVIDER,
				"redis provider: unexpected reply to status");
		rc = KL_EPROVIDER;
	}
	freeReplyObject(rep);
	return rc;
}

/* ------------------------------------------------------------------ */
/* The renewal thread                                                  */

/* One compare-and-PEXPIRE: 1 renewed, 0 the key is not ours, -1 the
 * server could not be asked.  Only the renewal thread calls it. */
static int
renew_once(struct redis *r, struct lease *l, int64_t cap, int64_t *sent_ns)
{
	int64_t deadline;
	char ttl[24];
	const char *args[2] = { l->tok, ttl };
	size_t alens[2] = { strlen(l->tok), num(ttl, sizeof ttl, l->ttl_ms) };
	redisReply *rep;
	int rc, res;

	if (r->rconn != NULL && r->rconn->broken) {
		kl__rconn_close(r->rconn);
		r->rconn = NULL;
	}
	/* An answer after the lease ran out would come too late anyway: stop
	 * waiting then, so that its loss is reported at once. */
	if (cap < kl__redis_now_ns() + 10 * MS)
		cap = kl__redis_now_ns() + 10 * MS;
	if (r->rconn == NULL && conn_new(r, cap, &r->rconn, NULL) != KL_OK)
		return -1;
	deadline = cmd_deadline(r, KL_R_NO_DEADLINE, 0);
	if (cap < deadline)
		deadline = cap;
	*sent_ns = kl__redis_now_ns();
	rc = kl__rconn_script(r->rconn, deadline, KL_RS_RENEW, 1, l->n.k,
			      l->n.len, 2, args, alens, &rep, NULL);
	if (rc != KL_OK)
		return -1;
	res = rep->type == REDIS_REPLY_INTEGER && rep->integer == 1 ? 1 : 0;
	freeReplyObject(rep);
	return res;
}

/* One try at undoing l, an acquire that gave up with attempts unanswered
 * (see undo_later).  Once each connection it left has answered all it
 * owed, no attempt of l's is still to run in the server, whatever the
 * order in which the server reads its connections; then the leave script
 * takes l's token out of the queue and frees the key if an attempt granted
 * it.  True when done (or the server refused it: nothing more to try);
 * false while the server does not answer.  Only the renewal thread calls
 * it, without mu: l is off every list meanwhile. */
static bool
undo_try(struct redis *r, struct lease *l)
{
	struct kl__rconn *c = NULL;
	int i, rc;

	for (i = 0; i < l->nstale; i++) {
		rc = kl__rconn_drain(l->stale[i], kl__redis_now_ns() +
							  UNDO_SLICE_MS * MS);
		if (rc == KL_ETIMEDOUT)
			return false;
		if (rc != KL_OK) {
			/* The server closed it, or it broke: nothing more of
			 * it will run. */
			kl__rconn_close(l->stale[i]);
			l->stale[i--] = l->stale[--l->nstale];
		}
	}
	if (l->nstale > 0) {
		c = l->stale[--l->nstale];
	} else {
		/* Every connection the attempts went on is closed: a grant
		 * they made was made by now, and expires a ttl later. */
		if (l->undo_until == 0)
			l->undo_until = kl__redis_deadline(l->ttl_ms);
		if (kl__redis_now_ns() >= l->undo_until)
			return true;
		if (conn_new(r, cmd_deadline(r, KL_R_NO_DEADLINE, 0), &c,
			     NULL) != KL_OK)
			return false;
	}
	rc = leave(r, c, l, cmd_deadline(r, KL_R_NO_DEADLINE, 0), NULL);
	if (rc != KL_OK && c->broken) {
		stash(l, &c);
		kl__rconn_close(c);
		return false;
	}
	conn_put(r, c);
	return true;
}

static void
set_abs(struct timespec *ts, int64_t ns)
{
	ts->tv_sec = (time_t)(ns / 1000000000);
	ts->tv_nsec = (long)(ns % 1000000000);
}

/*
 * Loop, mu held except around network I/O and callbacks: mark leases whose
 * validity ran out as lost, deliver one pending lost callback, renew the
 * most urgent lease that is due, else sleep until the next due time.  A
 * lease in use by the thread has a reference, so a release meanwhile
 * cannot free it.
 */
static void *
renewer(void *arg)
{
	struct redis *r = arg;
	bool lingered = false;

	pthread_mutex_lock(&r->mu);
	while (!r->stopping) {
		int64_t now = kl__redis_now_ns(), next = KL_R_NO_DEADLINE;
		struct lease *l, *due = NULL, *cb = NULL;

		for (l = r->leases; l != NULL; l = l->next) {
			if (!l->lost && now >= l->valid_until)
				l->lost = true;
			if (l->lost) {
				if (l->lost_fn != NULL && !l->notified &&
				    cb == NULL)
					cb = l;
				continue;
			}
			if (due == NULL || l->renew_at < due->renew_at)
				due = l;
			if (l->renew_at < next)
				next = l->renew_at;
			if (l->valid_until < next)
				next = l->valid_until;
		}
		if (cb != NULL) {
			void (*fn)(void *) = cb->lost_fn;
			void *ctx = cb->ctx;

			cb->notified = true;
			cb->in_cb = true;
			cb->cb_thread = pthread_self();
			cb->refs++;
			pthread_mutex_unlock(&r->mu);
			fn(ctx);
			pthread_mutex_lock(&r->mu);
			cb->in_cb = false;
			lease_unref(cb);
			pthread_cond_broadcast(&r->cv);
			continue;
		}
		if (due != NULL && due->renew_at <= now) {
			int64_t sent = 0, gap;
			int res;

			int64_t until = due->valid_until;

			due->refs++;
			pthread_mutex_unlock(&r->mu);
			res = renew_once(r, due, until, &sent);
			pthread_mutex_lock(&r->mu);
			now = kl__redis_now_ns();
			if (!due->released && !due->lost) {
				if (res == 1) {
					due->valid_until =
						sent + due->ttl_ms * MS -
						drift_ns(due->ttl_ms);
					due->renew_at =
						sent + due->ttl_ms * MS / 3;
				} else if (res == 0 ||
					   now >= due->valid_until) {
					due->lost = true;
				} else {
					/* The server did not answer: try
					 * again soon, while the key lives. */
					gap = due->ttl_ms / 10;
					if (gap > RETRY_GAP_MAX_MS)
						gap = RETRY_GAP_MAX_MS;
					due->renew_at = now + gap * MS;
				}
			}
			lease_unref(due);
			continue;
		}
		if (r->undos != NULL && r->undo_at <= now) {
			struct lease *u = r->undos;
			bool done;

			if ((r->undos = u->undo_next) == NULL)
				r->undo_tail = &r->undos;
			pthread_mutex_unlock(&r->mu);
			done = undo_try(r, u);
			pthread_mutex_lock(&r->mu);
			if (done) {
				r->nundos--;
				lease_unref(u);
			} else {
				u->undo_next = NULL;
				*r->undo_tail = u;
				r->undo_tail = &u->undo_next;
				r->undo_at = kl__redis_now_ns() +
					     UNDO_RETRY_MS * MS;
			}
			continue;
		}
		if (r->undos != NULL && r->undo_at < next)
			next = r->undo_at;
		/* With no lease left, sleep a while before sleeping until
		 * signalled: a lease taken meanwhile and due later need not
		 * wake us, which spares a program that takes and releases
		 * locks in a loop a wake-up per acquire. */
		if (next != KL_R_NO_DEADLINE) {
			lingered = false;
		} else if (!lingered) {
			lingered = true;
			next = now + IDLE_LINGER_MS * MS;
		}
		r->sleep_until = next;
		if (next == KL_R_NO_DEADLINE) {
			pthread_cond_wait(&r->cv, &r->mu);
		} else {
			struct timespec ts;

			set_abs(&ts, next);
			pthread_cond_timedwait(&r->cv, &r->mu, &ts);
		}
		r->sleep_until = 0;
	}
	pthread_mutex_unlock(&r->mu);
	return NULL;
}

/* ------------------------------------------------------------------ */
/* Opening and closing                                                 */

static void
redis_destroy(void *impl)
{
	struct redis *r = impl;
	struct lease *l;

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
		lease_unref(l);
	}
	/* Leases still held are a caller's error; free them anyway. */
	while ((l = r->leases) != NULL) {
		lease_unlink(r, l);
		l->refs = 1;
		lease_unref(l);
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
};

/* Starts the renewal thread with every signal blocked, so that the
 * program's handlers never run on a thread it does not know about. */
static int
start_thread(struct redis *r)
{
	sigset_t all, old;
	int rc;

	sigfillset(&all);
	pthread_sigmask(SIG_SETMASK, &all, &old);
	rc = pthread_create(&r->thread, NULL, renewer, r);
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	if (rc != 0)
		return KL_ENOMEM;
	r->thread_started = true;
	return KL_OK;
}

int
kl_redis_provider_open(kl_provider **out, const char *uri, kl_error *err)
{
	pthread_condattr_t ca;
	struct kl__rconn *c = NULL;
	struct redis *r;
	int rc;

	if (out != NULL)
		*out = NULL;
	if (out == NULL || uri == NULL) {
		kl__redis_error(err, KL_EINVAL,
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
	if ((rc = conn_new(r, KL_R_NO_DEADLINE, &c, err)) != KL_OK)
		goto fail;
	conn_put(r, c);
	if ((rc = start_thread(r)) != KL_OK)
		goto fail;
	if ((rc = kl_provider_new(out, &redis_ops, r)) != KL_OK)
		goto fail;
	return KL_OK;
fail:
	redis_destroy(r);
	return rc;
}
