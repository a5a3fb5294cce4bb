/* SPDX-License-Identifier: MIT */
/*
 * keylock/pg.h: the PostgreSQL provider, in its own library so that
 * libkeylock never links libpq (libkeylock-pg, pkg-config keylock-pg).
 *
 * Most programs never include this header: kl_provider_open() with a
 * "postgresql://" or "postgres://" URI loads libkeylock-pg on demand and
 * calls kl_pg_provider_open() itself.  Include it (and link -lkeylock-pg)
 * to open the provider without dlopen, or to compute the advisory lock id
 * of a key.
 *
 * Keys are session advisory locks of the server, one 64-bit lock id per
 * key (kl_pg_key_id), in the database of the URI.  The server's lock queue
 * grants them in arrival order.  The lock id is SipHash-2-4 of the key's
 * bytes under a fixed 16-byte key, so every process and host computes the
 * same id; two keys whose ids collide merely share one lock (more
 * serialization, never less exclusion).
 *
 * URI: a libpq connection URI,
 *	postgresql://[user[:password]@]host[:port][/dbname][?param=value&...]
 * with libpq's own parameters (connect_timeout, sslmode, keepalives,
 * application_name, ...; libpq's environment variables and password file
 * apply as usual) and these of keylock, removed before libpq sees the URI:
 *	pool=N		most connections used for locks at once: one per
 *			held lease and one per waiting call; 1..1024,
 *			default 8.  Calls beyond it wait, in arrival order,
 *			for a connection to come back.
 *	health_interval=D
 *			how often held leases are checked (a duration for
 *			kl_duration_parse, 10ms..1h, default 1s).
 * connect_timeout (seconds) defaults to 5 and bounds every connection
 * attempt; one more connection is kept for kl_provider_status().
 *
 * A lease lasts until it is released or its connection ends (the server
 * restarted, pg_terminate_backend, a network failure); ttl_ms is ignored.
 * A lost lease is seen by the next health check: kl_lease_valid() turns
 * false and KL_EV_LOST is raised.  Fences come from the sequence
 * keylock_fence, created when missing (CREATE on the schema is needed
 * then; else create it beforehand and grant USAGE on it).  KL_ERRORCHECK
 * is honoured per provider object, in both modes: a thread that holds a
 * key through this provider and asks for it again gets KL_EDEADLK.
 * KL_SHARED takes keys with pg_advisory_lock_shared; the server's queue
 * orders both modes (a shared request never passes a queued exclusive
 * one).  The server's deadlock_detected is KL_EDEADLK, but it sees no
 * cycle of threads that wait for each other's keys (each wait and lease
 * has its own session).  kl_provider_snapshot lists pg_locks' advisory
 * locks of the database, with key NULL (only the id reaches the server).  Passwords never appear
 * in error messages.  After fork() the child should open its own
 * provider; one inherited never writes on the parent's connections (it
 * opens new ones), and a lease the parent held cannot be released there.
 * See kl_pg_provider_open(3).
 */
#ifndef KEYLOCK_PG_H
#define KEYLOCK_PG_H

#include <keylock.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Opens the PostgreSQL provider for uri (see above): connects once, checks
 * the fence sequence (creating it if missing) and starts the health-check
 * thread.  On KL_OK *out holds the provider (free it with
 * kl_provider_free).  KL_EINVAL for NULL arguments or a malformed URI or
 * option; KL_EPROVIDER when the server cannot be reached or refuses the
 * connection (unreachable, authentication, missing database, no right to
 * create the sequence); KL_ENOMEM.  err (may be NULL) says why, naming the
 * host, port and database but never the password.  Blocks for at most
 * connect_timeout per connection attempt.  Thread-safe.  Since 0.1. */
KL_API int kl_pg_provider_open(kl_provider **out, const char *uri,
			       kl_error *err) KL_ATTR(warn_unused_result);

/* The advisory lock id of a key of len bytes (key may be NULL when len is
 * 0): SipHash-2-4 of the bytes with the ASCII key "keylock advisory",
 * read as a two's-complement int64.  It is what pg_advisory_lock(bigint)
 * is given, so pg_locks shows it as classid (high 32 bits) and objid (low
 * 32 bits) with objsubid 1.  The same on every host and version.  Since
 * 0.1. */
KL_API int64_t kl_pg_key_id(const char *key, size_t len);

#ifdef __cplusplus
}
#endif

#endif /* KEYLOCK_PG_H */
