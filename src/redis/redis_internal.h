/* SPDX-License-Identifier: MIT */
/*
 * Private declarations of libkeylock-redis, shared by its modules:
 * redis_config.c (URI and password), redis_util.c (clocks,
 * process id, random bytes), redis_conn.c (one connection: connect,
 * authenticate, identify the server, load the scripts), redis_io.c (send
 * commands and read replies with deadlines), redis_scripts.c (the Lua
 * scripts, run by digest), redis_tls.c (rediss://, with OpenSSL),
 * redis_sha256.c (key digests), and the provider itself: provider_redis.c
 * (leases, the operations), redis_pool.c (its connections), redis_guard.c
 * (the restart guard), redis_wait.c (acquire and wait, release) and
 * redis_renew.c (the renewal thread).
 *
 * This library links libkeylock.so and so sees only its public kl_*
 * functions, and src/libklcommon.la for kl__error_set (klcommon.h); the
 * kl__redis_* helpers here are hidden by the build (-fvisibility=hidden
 * and src/libkeylock-redis.map).
 */
#ifndef KL_REDIS_INTERNAL_H
#define KL_REDIS_INTERNAL_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include <hiredis.h>

struct ssl_ctx_st;
struct kl__rtls;

#include "keylock.h"
#include "keylock/redis.h"
#include "klcommon.h"

#define KL_RHIDDEN __attribute__((visibility("hidden")))

#define KL_R_NO_DEADLINE INT64_MAX

/* ------------------------------------------------------------------ */
/* redis_config.c */

#define KL_R_GUARD_AUTO (-1)

struct kl__redis_conf {
	char *host;
	int port;
	int db;
	char *user;     /* NULL: AUTH with the password alone */
	char *pass;     /* NULL: no AUTH; wiped before it is freed */
	size_t pass_len;
	char *prefix;
	size_t prefix_len;
	size_t pool;
	int64_t ttl_ms;
	int64_t timeout_ms;
	int64_t connect_timeout_ms;
	int64_t heartbeat_ms;
	int64_t restart_guard_ms; /* KL_R_GUARD_AUTO or >= 0 */
	bool allow_eviction;      /* eviction=allow: maxmemory-policy unchecked */
	/* rediss://: TLS with certificate and host name verification. */
	bool tls;
	char *tls_ca;          /* NULL: OpenSSL's default CA store */
	char *tls_ca_dir;
	char *tls_cert;        /* client certificate and its key, or NULL */
	char *tls_key;
	char *tls_server_name; /* NULL: the host (SNI and verification) */
	struct ssl_ctx_st *tls_ctx; /* SSL_CTX of all the connections */
};

/* Parses uri into conf (zeroed first) and, for rediss://, makes its TLS
 * context.  KL_OK; KL_EINVAL for a malformed URI or option; KL_EPROVIDER
 * for TLS in a build without it, an unusable CA, certificate or key file,
 * or an unsafe or unreadable password file; KL_ENOMEM.  On failure conf
 * holds nothing. */
KL_RHIDDEN int kl__redis_conf_parse(struct kl__redis_conf *conf,
				    const char *uri, kl_error *err);
KL_RHIDDEN void kl__redis_conf_clear(struct kl__redis_conf *conf);

/* ------------------------------------------------------------------ */
/* Shared helpers (redis_util.c) */

/* CLOCK_MONOTONIC nanoseconds. */
/* now + ms, saturating at KL_R_NO_DEADLINE; KL_FOREVER gives it too. */
KL_RHIDDEN int64_t kl__redis_deadline(int64_t ms);
/* getpid(), cached per process (a fork() child finds it anew). */
KL_RHIDDEN pid_t kl__redis_getpid(void);
/* Fills buf with n random bytes; false when no randomness could be had.
 * Small requests come from a per-thread buffer of getrandom() bytes that
 * a child of fork() never reuses. */
KL_RHIDDEN bool kl__redis_random(void *buf, size_t n);
/* Overwrites n bytes so that the compiler cannot drop the stores. */
KL_RHIDDEN void kl__redis_wipe(void *p, size_t n);
/* v in decimal into buf (24 bytes hold any); its length. */
KL_RHIDDEN size_t kl__redis_num(char *buf, size_t size, int64_t v);

/* redis_tls.c (built with OpenSSL only: HAVE_REDIS_TLS).  The context
 * loads the CA, the client certificate and key of conf once; its messages
 * name the files, never what they hold.  KL_OK, KL_EPROVIDER, KL_ENOMEM. */
KL_RHIDDEN int kl__redis_tls_ctx_new(struct kl__redis_conf *conf,
				     kl_error *err);
KL_RHIDDEN void kl__redis_tls_ctx_free(struct kl__redis_conf *conf);

/* redis_sha256.c: the SHA-256 digest of data in lowercase hex. */
KL_RHIDDEN void kl__redis_sha256_hex(const void *data, size_t len,
				     char out[65]);

/* ------------------------------------------------------------------ */
/* One connection, used by one thread at a time: made by redis_conn.c,
 * commands sent by redis_io.c, scripts run by redis_scripts.c. */

enum kl__redis_script {
	KL_RS_ATTEMPT,
	KL_RS_RELEASE,
	KL_RS_LEAVE,
	KL_RS_RENEW,
	KL_RS_STATUS,
	KL_RS_SNAPSHOT,
	KL_RS_COUNT
};

struct kl__rconn {
	redisContext *ctx;
	pid_t pid;          /* the process that connected */
	bool broken;        /* failed or timed out: close, never reuse */
	int owed;           /* replies still due when a command timed out
			     * (0 when the connection failed otherwise) */
	int64_t rcv_ns;     /* SO_RCVTIMEO: the longest blocking recv() */
	int64_t up_ms;      /* server uptime by its INFO (a lower bound) */
	int64_t t0_ns;      /* our clock when INFO had answered */
	bool persistent;    /* appendonly yes and appendfsync always */
	uint64_t epoch;     /* the provider's count of restarts seen, when
			     * connected (set by redis_guard.c) */
	struct kl__rtls *tls; /* rediss://: the TLS session, or NULL */
	char run_id[41];    /* the server's INFO run_id */
	int version;        /* major * 100 + minor */
	char sha[KL_RS_COUNT][41];
};

/* Connects to conf's server within its connect timeout, authenticates,
 * selects the database, reads INFO and loads the scripts within its
 * command timeout, both cut short at cap_ns (KL_R_NO_DEADLINE: no cap).
 * KL_OK, KL_EPROVIDER (err says why: never the password), KL_ENOMEM. */
KL_RHIDDEN int kl__rconn_open(const struct kl__redis_conf *conf,
			      int64_t cap_ns, struct kl__rconn **out,
			      kl_error *err);
KL_RHIDDEN void kl__rconn_close(struct kl__rconn *c);
/* The server's uptime in milliseconds now, as estimated from the uptime
 * INFO gave when c connected and our clock since: never more than the
 * real uptime (INFO's whole seconds may be up to one too many). */
KL_RHIDDEN int64_t kl__rconn_uptime_ms(const struct kl__rconn *c);

/* redis_io.c.  A blocking recv() waits one SO_RCVTIMEO slice at most,
 * which kl__rconn_open sets to this many milliseconds or less. */
#define KL_R_RCV_SLICE_MS 100
/* 1 when fd is ready for events, 0 at deadline (kl__now_ns), -1 on
 * a poll error; EINTR never extends the deadline. */
KL_RHIDDEN int kl__redis_wait_fd(int fd, short events, int64_t deadline);
/* Writes the commands appended to c's hiredis context and reads their n
 * replies into rep by deadline_ns.  KL_OK, or KL_EPROVIDER with c->broken
 * set and rep all NULL (c->owed says how many replies are still due when
 * the deadline passed). */
KL_RHIDDEN int kl__rconn_roundtrip(struct kl__rconn *c, int64_t deadline_ns,
				   int n, redisReply **rep, kl_error *err);
/* Sends one command (argv API: binary-safe) and reads its reply by
 * deadline_ns.  KL_OK with *reply set (an error reply included), or
 * KL_EPROVIDER with c->broken set. */
KL_RHIDDEN int kl__rconn_command(struct kl__rconn *c, int64_t deadline_ns,
				 int argc, const char **argv,
				 const size_t *lens, redisReply **reply,
				 kl_error *err);
/* Reads and discards the c->owed replies of commands that timed out, by
 * deadline_ns; the server runs a connection's commands in order, so once
 * they are in, nothing sent on c before is still to run.  KL_OK (c is in
 * step again and no longer broken), KL_ETIMEDOUT (some are still due: call
 * again later), KL_EPROVIDER (the connection failed: close it). */
KL_RHIDDEN int kl__rconn_drain(struct kl__rconn *c, int64_t deadline_ns);

/* redis_scripts.c: the text of each script (kl__rconn_open loads them). */
KL_RHIDDEN extern const char *const kl__redis_scripts[KL_RS_COUNT];
/* Runs script id with keys and args (EVALSHA, then EVAL when the server
 * lost its script cache).  As kl__rconn_command; an error reply becomes
 * KL_EPROVIDER (the connection stays usable). */
KL_RHIDDEN int kl__rconn_script(struct kl__rconn *c, int64_t deadline_ns,
				enum kl__redis_script id, int nkeys,
				const char **keys, const size_t *klens,
				int nargs, const char **args,
				const size_t *alens, redisReply **reply,
				kl_error *err);

/* redis_tls.c: the TLS session of c, whose socket is connected.  The
 * handshake (SNI, certificate and host name verification) ends by
 * deadline_ns.  KL_OK; KL_EPROVIDER with err naming the verification
 * failure; KL_ENOMEM.  kl__rtls_free never writes to the socket (no
 * close_notify), so a child of fork() may close an inherited session. */
KL_RHIDDEN int kl__rtls_start(struct kl__rconn *c,
			      const struct kl__redis_conf *conf,
			      int64_t deadline_ns, kl_error *err);
KL_RHIDDEN void kl__rtls_free(struct kl__rtls *t);
/* As send() and recv() on the socket (blocking, SO_SNDTIMEO and
 * SO_RCVTIMEO bound them; MSG_NOSIGNAL): > 0 bytes, 0 at the end of the
 * stream, -1 with errno (EAGAIN: try again; EPROTO: a TLS error, described
 * in buf by kl__rtls_error).  nowait: read only what has arrived. */
KL_RHIDDEN ssize_t kl__rtls_send(struct kl__rtls *t, const void *p,
				 size_t n);
KL_RHIDDEN ssize_t kl__rtls_recv(struct kl__rtls *t, void *p, size_t n,
				 bool nowait);
/* Whether decrypted bytes wait in the session (poll() cannot see them). */
KL_RHIDDEN bool kl__rtls_pending(struct kl__rtls *t);
/* The last TLS error of t, for a message. */
KL_RHIDDEN const char *kl__rtls_error(struct kl__rtls *t);

/* ------------------------------------------------------------------ */
/* The provider: provider_redis.c (leases, the operations, opening and
 * closing), redis_pool.c (its connections), redis_guard.c (the restart
 * guard), redis_wait.c (attempts, the wait in the queue, the release
 * script) and redis_renew.c (the renewal thread and the undo queue).
 * Locking: see provider_redis.c. */

#define KL_R_MS (INT64_C(1000000)) /* nanoseconds in a millisecond */
#define KL_R_GRACE_MS 100 /* a wait's commands end by its deadline + this */
#define KL_R_FENCE_KEEP_MS 86400000 /* the fence counter outlives idle keys */
#define KL_R_TOKEN_BYTES 16
#define KL_R_STALE_MAX 8 /* connections an acquire leaves unanswered */

enum {
	KL_RK_LOCK,
	KL_RK_QUEUE,
	KL_RK_HB,
	KL_RK_FENCE,
	KL_RK_SHARED, /* shared holders (ZSET) */
	KL_RK_SMETA,  /* their fences and grant times (HASH) */
	KL_RK_WAKE,   /* last: names_make appends the token */
	KL_RK_COUNT
};

/* The Redis key names of one lock key (KL_RK_WAKE only with a token). */
struct kl__rnames {
	char *buf;
	const char *k[KL_RK_COUNT];
	size_t len[KL_RK_COUNT];
};

/* The names of n listed in which[0..cnt-1], as a script's KEYS. */
static inline void
kl__rnames_pick(const struct kl__rnames *n, const int *which, int cnt,
		const char **k, size_t *len)
{
	for (int i = 0; i < cnt; i++) {
		k[i] = n->k[which[i]];
		len[i] = n->len[which[i]];
	}
}

struct kl__rlease {
	struct kl__rlease *prev, *next; /* r->leases, while held */
	bool linked;
	bool shared; /* KL_SHARED: the token starts with "s" */
	char tok[2 * KL_R_TOKEN_BYTES + 2];
	struct kl__rnames n;
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
	/* Connections on which an attempt of this acquire, or its release,
	 * timed out: the server may still run it, and grant the key to this
	 * token.  Owned by the acquiring (releasing) thread, then by
	 * r->undos (see undo_try in redis_renew.c). */
	struct kl__rconn *stale[KL_R_STALE_MAX];
	int nstale;
	struct kl__rlease *undo_next; /* r->undos */
	int64_t undo_until; /* ns: no use undoing after (0: not known yet) */
};

struct kl__redis {
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
	struct kl__rlease *leases;
	bool stopping;
	/* The restart marker and the ttl record (see script_mark in
	 * redis_guard.c). */
	char *gkey[2];
	size_t gkey_len[2];
	/* While the renewal thread sleeps: when it wakes by itself
	 * (KL_R_NO_DEADLINE: only when signalled); 0 while it runs, and so
	 * will look at every lease before it sleeps again.  A new lease due
	 * before then must wake it, any other need not. */
	int64_t sleep_until;
	/* Acquires that gave up while an attempt was unanswered, oldest
	 * first, and when the renewal thread next tries to undo them. */
	struct kl__rlease *undos, **undo_tail;
	size_t nundos;
	int64_t undo_at;
};

/* provider_redis.c: drops a reference to l, freeing it with the last;
 * r->mu held when the lease may be shared. */
KL_RHIDDEN void kl__redis_lease_unref(struct kl__rlease *l);
/* How long before its expiry in Redis a lease of ttl_ms stops counting as
 * valid. */
KL_RHIDDEN int64_t kl__redis_drift_ns(int64_t ttl_ms);

/* redis_pool.c.  A new connection, checked against the restart marker
 * (kl__redis_mark_server); or a pooled one, else a new one
 * (kl__redis_conn_get).  Made by cap_ns.  KL_OK, KL_EPROVIDER,
 * KL_ENOMEM. */
KL_RHIDDEN int kl__redis_conn_new(struct kl__redis *r, int64_t cap_ns,
				  struct kl__rconn **out, kl_error *err);
KL_RHIDDEN int kl__redis_conn_get(struct kl__redis *r, int64_t cap_ns,
				  struct kl__rconn **out, kl_error *err);
/* Back to the pool, or closed (broken, or the pool is full); NULL: no-op. */
KL_RHIDDEN void kl__redis_conn_put(struct kl__redis *r, struct kl__rconn *c);
/* Closes *cp and makes a new connection there by cap_ns. */
KL_RHIDDEN int kl__redis_conn_replace(struct kl__redis *r,
				      struct kl__rconn **cp, int64_t cap_ns,
				      kl_error *err);
/* The deadline of one command of a wait that ends at wait_deadline
 * (KL_R_NO_DEADLINE: none), the server blocking extra_ns. */
KL_RHIDDEN int64_t kl__redis_cmd_deadline(const struct kl__redis *r,
					  int64_t wait_deadline,
					  int64_t extra_ns);

/* redis_guard.c.  Checks the restart marker on the new connection c, by
 * cap_ns, and records which server run it reached. */
KL_RHIDDEN int kl__redis_mark_server(struct kl__redis *r, struct kl__rconn *c,
				     int64_t cap_ns, kl_error *err);
/* The restart guard an attempt of a ttl_ms lease asks for. */
KL_RHIDDEN void kl__redis_guard_need(struct kl__redis *r, int64_t ttl_ms,
				     int64_t *ms, bool *use_rec,
				     bool *refresh);

/* redis_wait.c.  The leave script for l on c, by deadline. */
KL_RHIDDEN int kl__redis_leave(struct kl__redis *r, struct kl__rconn *c,
			       struct kl__rlease *l, int64_t deadline,
			       kl_error *err);
/* The leave script after a wait that failed or was abandoned, if c works,
 * by end if it can. */
KL_RHIDDEN void kl__redis_leave_anyway(struct kl__redis *r,
				       struct kl__rconn *c,
				       struct kl__rlease *l, int64_t end);
/* Compare-and-delete with l's token: *released when the key was ours. */
KL_RHIDDEN int kl__redis_release_key(struct kl__redis *r, struct kl__rlease *l,
				     bool *released, kl_error *err);
/* The first attempt of an acquire (a pooled connection found dead is
 * replaced once): KL_OK with *granted, and *fence when granted; *sent_ns
 * is when the attempt was sent.  Not granted, kl__redis_wait_queued waits
 * in the queue: KL_OK (granted), KL_ETIMEDOUT, KL_ECANCELED or
 * KL_EPROVIDER. */
KL_RHIDDEN int kl__redis_first_attempt(struct kl__redis *r,
				       struct kl__rconn **cp,
				       struct kl__rlease *l, bool try_only,
				       int64_t deadline, bool *granted,
				       uint64_t *fence, int64_t *sent_ns,
				       kl_error *err);
KL_RHIDDEN int kl__redis_wait_queued(struct kl__redis *r, struct kl__rconn **cp,
				     struct kl__rlease *l, kl_cancel *cancel,
				     int64_t deadline, uint64_t *fence,
				     int64_t *sent_ns, kl_error *err);

/* redis_renew.c.  Keeps *cp in l if a command of l's wait on it is still
 * unanswered. */
KL_RHIDDEN void kl__redis_stash(struct kl__rlease *l, struct kl__rconn **cp);
/* Hands l, an acquire that gave up, to the renewal thread to undo. */
KL_RHIDDEN void kl__redis_undo_later(struct kl__redis *r, struct kl__rlease *l);
/* Hands l, a lease whose release the server did not answer, to the
 * renewal thread to release once the server answers again. */
KL_RHIDDEN void kl__redis_release_later(struct kl__redis *r,
					struct kl__rlease *l);
/* Starts the renewal thread; KL_OK or KL_ENOMEM. */
KL_RHIDDEN int kl__redis_start_thread(struct kl__redis *r);

#endif /* KL_REDIS_INTERNAL_H */
