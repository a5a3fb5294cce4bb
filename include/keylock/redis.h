/* SPDX-License-Identifier: MIT */
/*
 * keylock/redis.h: the Redis provider, in its own library libkeylock-redis
 * (pkg-config keylock-redis), so that libkeylock itself never links hiredis.
 *
 * Most programs need not include this header: kl_provider_open() with a
 * "redis://" URI loads libkeylock-redis with dlopen and calls
 * kl_redis_provider_open() for them.  Link with -lkeylock-redis and call it
 * directly to fail at link time rather than at run time when the library is
 * missing.
 *
 * URI:  redis[s]://[USER[:PASSWORD]@]HOST[:PORT][/DB][?OPTION=VALUE[&...]]
 *
 *   HOST is a name, an IPv4 address or [an IPv6 address]; PORT defaults to
 *   6379, DB to 0.  USER and PASSWORD may be percent-encoded; a USER names a
 *   Redis 6 ACL user (AUTH USER PASSWORD), none means AUTH PASSWORD.
 *   "rediss://" is TLS (OpenSSL, when the library was built with it: else
 *   KL_EPROVIDER says so), with the server's certificate and host name
 *   always verified.  Unix sockets, Sentinel and Cluster are not supported.
 *
 * The password comes from, in this order: the URI; the file named by the
 * password_file option, which must be a regular file of the caller's (or
 * root's) with no permission for group or others (0600 or stricter; 0644 is
 * refused), its first line being the password; the KEYLOCK_REDIS_PASSWORD
 * environment variable (ignored in setuid programs).  A URI password and a
 * password_file together are refused.  The password never appears in a
 * kl_error message or an event.
 *
 * Options (durations as for kl_duration_parse: "250ms", "5s"):
 *   ttl=D              lease time to live when the lock gives ttl_ms 0;
 *                      default 30s, at least 100ms.  A held lease is
 *                      renewed at a third of its ttl by a provider thread;
 *                      a renewal that fails (the key was deleted or taken,
 *                      or the server could not be reached before the lease
 *                      ran out) makes the lease lost: kl_lease_valid()
 *                      returns false and KL_EV_LOST is raised.
 *   timeout=D          bound on each command's round trip; default 2s.  A
 *                      connection that times out or fails is closed and
 *                      replaced, never reused.
 *   connect_timeout=D  bound on connecting; default 2s.
 *   pool=N             idle connections kept for reuse, 1 to 1024, default
 *                      4.  A waiter blocks on a connection of its own, so
 *                      more connections are opened while many wait.
 *   prefix=S           prefix of every Redis key; default "keylock:".  A
 *                      lock key K is stored under PREFIX{SHA256(K) in hex},
 *                      with companions PREFIX{...}:q (queue), :hb
 *                      (heartbeats), :f (fence) and :w:TOKEN (wake-ups).
 *   heartbeat=D        how long a waiter stays in the queue without
 *                      refreshing its entry; a waiter that died (SIGKILL)
 *                      blocks those behind it at most this long; default 2s,
 *                      100ms to 1h.  Use the same value in every client.
 *   restart_guard=D    after a server restart without durable persistence
 *                      every lock is gone while old holders may still run:
 *                      no lock is granted (KL_EPROVIDER) until the server
 *                      has been up for D.  "auto" (the default) is the
 *                      longest ttl this provider has used (at least its
 *                      default ttl), or 0 when the server runs with
 *                      appendonly yes and appendfsync always.  "0" turns
 *                      the guard off.  A fresh server is not told apart from
 *                      a restarted one: it grants nothing for D either.
 *                      Redis reports its uptime in whole seconds, so the
 *                      guard may last up to a second longer than D.
 *   password_file=P    read the password from the file P (see above).
 *   tls_ca=F           rediss:// only: the CA certificates (PEM) the
 *   tls_ca_dir=D       server's must lead to (a file, an "openssl rehash"
 *                      directory); default OpenSSL's default store.
 *   tls_cert=F         rediss:// only: a client certificate and its key
 *   tls_key=F          (PEM, not encrypted, mode 0600), both or neither.
 *   tls_server_name=N  rediss:// only: the name (SNI and verification) or
 *                      IP address the certificate must hold, when not HOST.
 *
 * Behaviour: strict FIFO per key across every client of the server (a
 * queue in Redis, waiters woken by a list push, with a bounded re-check so
 * that a lost wake-up or a restarted server never strands a waiter); timeout
 * 0 tries once and never queues; a fired cancel token ends a wait within
 * about 50 ms and leaves the queue; a wait with a timeout returns within
 * about 150 ms after it whatever the server does (a server that stops
 * answering gives KL_EPROVIDER, never KL_ETIMEDOUT); the fence grows with
 * every grant of a key, also across server restarts (it is at least the
 * server time in microseconds).  KL_ERRORCHECK is not supported
 * (KL_EINVAL): a lease is not tied to a thread.  Needs Redis 6.0 or later.
 * After fork() the child must not use a provider inherited from its
 * parent.
 */
#ifndef KEYLOCK_REDIS_H
#define KEYLOCK_REDIS_H

#include <keylock.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Opens the Redis provider for uri (above) and stores it in *out; free it
 * with kl_provider_free() once its leases are released.  Connects once to
 * check the address, the password and the server version, and starts the
 * provider's renewal thread.  Returns KL_OK; KL_EINVAL for a malformed URI
 * or option (err says which, never quoting the URI); KL_EPROVIDER when the
 * server cannot be reached in time, refuses the password ("authentication
 * failed"), is older than 6.0, or the password file is unsafe; KL_ENOMEM.
 * err may be NULL.  Thread-safe; blocks for at most the connect timeout
 * plus the command timeout.  Since 0.1. */
KL_API int kl_redis_provider_open(kl_provider **out, const char *uri,
				  kl_error *err) KL_ATTR(warn_unused_result);

#ifdef __cplusplus
}
#endif

#endif /* KEYLOCK_REDIS_H */
