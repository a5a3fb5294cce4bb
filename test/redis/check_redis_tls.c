/* SPDX-License-Identifier: MIT */
/*
 * TLS (rediss://) in the Redis provider (issue 16 item 8), against real
 * TLS-only redis-servers: KEYLOCK_TEST_REDIS_SERVER names the program
 * (tools/test stage redis sets it); the suite makes a throwaway CA, a
 * second unrelated CA, a server certificate for 127.0.0.1 and localhost and
 * a client certificate with openssl(1), and starts two servers of its own
 * on free ports: one that asks for no client certificate, one that requires
 * it.  It exits 77 (skip) without redis-server or openssl.
 *
 * Covered: a lock round trip over TLS (by address and by name: SNI);
 * a wrong CA refused with KL_EPROVIDER naming the verification failure, and
 * no password in the message; host name and address mismatches refused;
 * plain redis:// to a TLS-only port failing at once with a hint, not by a
 * timeout; a handshake with a server that never answers ending by the
 * timeout; renewal over TLS; a stopped server (SIGSTOP) failing a command
 * by its deadline and a new TLS connection afterwards; client
 * certificates; the tls_* options' errors.  A build
 * without OpenSSL runs one test instead: rediss:// is refused with
 * KL_EPROVIDER saying that TLS is not compiled in.
 */
#include "config.h"

#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "keylock.h"
#include "../util.h"

#ifdef HAVE_REDIS_TLS
static const char *g_server_bin;
static char g_dir[PATH_MAX];
/* TLS-only servers: no client certificate asked; one required. */
static int g_port, g_port_mtls;
static pid_t g_pid, g_pid_mtls;

/* ------------------------------------------------------------------ */
/* Set-up, in main (before the tests fork)                            */

/* test_server_spawn's ready: arg is the port, open for connections. */
static bool
port_open(void *arg)
{
	struct sockaddr_in a = { .sin_family = AF_INET };
	int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
	bool ok;

	if (fd < 0)
		return false;
	a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	a.sin_port = htons((uint16_t)*(const int *)arg);
	ok = connect(fd, (struct sockaddr *)&a, sizeof a) == 0;
	close(fd);
	return ok;
}

/* Runs a shell command in g_dir; false when it failed. */
static bool
sh(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

static bool
sh(const char *fmt, ...)
{
	char cmd[4096];
	int n, st;
	va_list ap;

	n = snprintf(cmd, sizeof cmd, "cd '%s' && ( ", g_dir);
	va_start(ap, fmt);
	n += vsnprintf(cmd + n, sizeof cmd - (size_t)n, fmt, ap);
	va_end(ap);
	snprintf(cmd + n, sizeof cmd - (size_t)n, " ) >>openssl.log 2>&1");
	st = system(cmd);
	if (st != 0)
		fprintf(stderr, "check_redis_tls: failed (%d): %s\n", st, cmd);
	return st == 0;
}

#define EC "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes"

/* A CA (name.crt, name.key) and certificates it signs. */
static bool
make_certs(void)
{
	return sh("openssl req -x509 " EC " -keyout ca.key -out ca.crt "
		  "-days 2 -subj /CN=keylock-test-ca "
		  "-addext basicConstraints=critical,CA:TRUE "
		  "-addext keyUsage=critical,keyCertSign,cRLSign") &&
	       sh("openssl req -x509 " EC " -keyout badca.key "
		  "-out badca.crt -days 2 -subj /CN=keylock-other-ca "
		  "-addext basicConstraints=critical,CA:TRUE "
		  "-addext keyUsage=critical,keyCertSign,cRLSign") &&
	       sh("openssl req " EC " -keyout server.key -out server.csr "
		  "-subj /CN=localhost && "
		  "printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\\n"
		  "extendedKeyUsage=serverAuth\\n' >server.ext && "
		  "openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key "
		  "-CAcreateserial -days 2 -extfile server.ext "
		  "-out server.crt") &&
	       sh("openssl req " EC " -keyout client.key -out client.csr "
		  "-subj /CN=keylock-client && "
		  "printf 'extendedKeyUsage=clientAuth\\n' >client.ext && "
		  "openssl x509 -req -in client.csr -CA ca.crt -CAkey ca.key "
		  "-CAcreateserial -days 2 -extfile client.ext "
		  "-out client.crt && chmod 600 client.key && "
		  "cp client.key client-open.key && "
		  "chmod 644 client-open.key");
}

/* A TLS-only redis-server on a free port; its pid, 0 on failure. */
static pid_t
start_server(int *port_out, bool mtls)
{
	for (int attempt = 0; attempt < 5; attempt++) {
		char port[16], log[PATH_MAX + 32], crt[PATH_MAX + 16],
			key[PATH_MAX + 16], ca[PATH_MAX + 16];
		const char *argv[] = { g_server_bin,
				       "--port", "0",
				       "--tls-port", port,
				       "--bind", "127.0.0.1",
				       "--tls-cert-file", crt,
				       "--tls-key-file", key,
				       "--tls-ca-cert-file", ca,
				       "--tls-auth-clients", mtls ? "yes" : "no",
				       "--save", "",
				       "--appendonly", "no",
				       "--daemonize", "no",
				       "--dir", g_dir,
				       "--logfile", log,
				       NULL };
		int port_n = test_free_port();
		pid_t pid;

		if (port_n < 0)
			return 0;
		snprintf(port, sizeof port, "%d", port_n);
		snprintf(log, sizeof log, "%s/redis-%d.log", g_dir, port_n);
		snprintf(crt, sizeof crt, "%s/server.crt", g_dir);
		snprintf(key, sizeof key, "%s/server.key", g_dir);
		snprintf(ca, sizeof ca, "%s/ca.crt", g_dir);
		pid = test_server_spawn((char *const *)argv, port_open,
					&port_n, 10000);
		if (pid > 0) {
			*port_out = port_n;
			return pid;
		}
		fprintf(stderr, "check_redis_tls: redis-server with TLS did "
				"not start; its log:\n");
		{
			char cmd[PATH_MAX + 64];

			snprintf(cmd, sizeof cmd, "tail -n 5 '%s' >&2", log);
			if (system(cmd) != 0)
				fprintf(stderr, "(no log)\n");
		}
	}
	return 0;
}

static void
stop_servers(void)
{
	if (g_pid > 0) {
		kill(g_pid, SIGKILL);
		waitpid(g_pid, NULL, 0);
	}
	if (g_pid_mtls > 0) {
		kill(g_pid_mtls, SIGKILL);
		waitpid(g_pid_mtls, NULL, 0);
	}
	if (g_dir[0] != '\0') {
		char cmd[PATH_MAX + 16];

		snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
		if (system(cmd) != 0)
			fprintf(stderr, "check_redis_tls: cannot remove %s\n",
				g_dir);
	}
}

/* ------------------------------------------------------------------ */
/* Helpers                                                             */

#endif /* HAVE_REDIS_TLS */

/* kl_provider_open(uri); the status, err filled. */
static int
open_uri(kl_provider **p, kl_error *err, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));

static int
open_uri(kl_provider **p, kl_error *err, const char *fmt, ...)
{
	char uri[2048];
	va_list ap;
	int rc;

	va_start(ap, fmt);
	vsnprintf(uri, sizeof uri, fmt, ap);
	va_end(ap);
	memset(err, 0, sizeof *err);
	*p = NULL;
	rc = kl_provider_open(p, uri, err);
	printf("open %s: %s%s%s\n", uri, kl_strerror(rc),
	       rc != KL_OK ? ": " : "", rc != KL_OK ? err->message : "");
	return rc;
}

#ifdef HAVE_REDIS_TLS
/* Refused with KL_EPROVIDER and a message holding want. */
static void
refused(const char *want, const char *fmt, ...)
	__attribute__((format(printf, 2, 3)));

static void
refused(const char *want, const char *fmt, ...)
{
	char uri[2048];
	kl_provider *p;
	kl_error err;
	va_list ap;
	int rc;

	va_start(ap, fmt);
	vsnprintf(uri, sizeof uri, fmt, ap);
	va_end(ap);
	rc = open_uri(&p, &err, "%s", uri);
	if (p != NULL)
		kl_provider_free(p);
	ck_assert_int_eq(rc, KL_EPROVIDER);
	ck_assert_msg(strstr(err.message, want) != NULL,
		      "message '%s' lacks '%s'", err.message, want);
}

/* Acquire, check, release, twice, and a held key refusing a try-once. */
static void
round_trip(kl_provider *p, const char *key)
{
	kl_lock_opts o = KL_LOCK_OPTS_INIT;
	kl_lock *l = NULL, *l2 = NULL;
	kl_lease *a = NULL, *b = NULL;
	kl_error err;
	uint64_t f1, f2;

	o.provider = p;
	o.key = key;
	o.timeout_ms = 20000;
	o.ttl_ms = 5000;
	ck_assert_int_eq(kl_lock_new(&l, &o), KL_OK);
	o.timeout_ms = 0;
	ck_assert_int_eq(kl_lock_new(&l2, &o), KL_OK);
	memset(&err, 0, sizeof err);
	ck_assert_msg(kl_lock_acquire(l, NULL, &a, &err) == KL_OK, "%s",
		      err.message);
	ck_assert(kl_lease_valid(a));
	f1 = kl_lease_fence(a);
	ck_assert_uint_gt(f1, 0);
	ck_assert_int_eq(kl_lock_acquire(l2, NULL, &b, &err), KL_ETIMEDOUT);
	kl_lease_release(a);
	ck_assert_msg(kl_lock_acquire(l2, NULL, &b, &err) == KL_OK, "%s",
		      err.message);
	f2 = kl_lease_fence(b);
	ck_assert_uint_gt(f2, f1);
	kl_lease_release(b);
	kl_lock_free(l);
	kl_lock_free(l2);
}

/* Holds a key across several ttls: the renewal thread's commands go
 * over TLS on connections of the pool while the test's own try-once
 * acquires are refused. */
static void
renewal(kl_provider *p)
{
	kl_lock_opts o = KL_LOCK_OPTS_INIT;
	kl_lock *l = NULL, *l2 = NULL;
	kl_lease *a = NULL, *b = NULL;
	kl_error err;

	o.provider = p;
	o.key = "tls-renew";
	o.timeout_ms = 20000;
	/* 1.5 s: a renewal (every 500 ms) may come late on a loaded
	 * machine. */
	o.ttl_ms = 1500;
	ck_assert_int_eq(kl_lock_new(&l, &o), KL_OK);
	o.timeout_ms = 0;
	ck_assert_int_eq(kl_lock_new(&l2, &o), KL_OK);
	ck_assert_msg(kl_lock_acquire(l, NULL, &a, &err) == KL_OK, "%s",
		      err.message);
	for (int i = 0; i < 8; i++) {
		test_sleep_ms(500);
		ck_assert(kl_lease_valid(a));
		ck_assert_int_eq(kl_lock_acquire(l2, NULL, &b, &err),
				 KL_ETIMEDOUT);
	}
	kl_lease_release(a);
	kl_lock_free(l);
	kl_lock_free(l2);
}

/* ------------------------------------------------------------------ */
/* Tests                                                               */

START_TEST(test_round_trip)
{
	kl_provider *p;
	kl_error err;

	ck_assert_msg(open_uri(&p, &err,
			       "rediss://127.0.0.1:%d/0?tls_ca=%s/ca.crt&"
			       "prefix=tls-ip:&restart_guard=0",
			       g_port, g_dir) == KL_OK,
		      "%s", err.message);
	round_trip(p, "tls-key");
	renewal(p);
	kl_provider_free(p);
	/* By name: SNI, and the DNS name of the certificate. */
	ck_assert_msg(open_uri(&p, &err,
			       "rediss://localhost:%d/0?tls_ca=%s/ca.crt&"
			       "prefix=tls-name:&pool=2&restart_guard=0",
			       g_port, g_dir) == KL_OK,
		      "%s", err.message);
	round_trip(p, "tls-key");
	kl_provider_free(p);
	/* The CA from a directory (c_rehash names). */
	ck_assert(sh("mkdir -p cadir && cp ca.crt cadir/ && "
		     "openssl rehash cadir"));
	ck_assert_msg(open_uri(&p, &err,
			       "rediss://127.0.0.1:%d/0?tls_ca_dir=%s/cadir&"
			       "prefix=tls-dir:&restart_guard=0",
			       g_port, g_dir) == KL_OK,
		      "%s", err.message);
	round_trip(p, "tls-key");
	kl_provider_free(p);
}
END_TEST

START_TEST(test_wrong_ca)
{
	/* The password must not show, whatever fails. */
	/* The reason depends on the chain the server sends ("unable to
	 * get local issuer certificate", "self-signed certificate in
	 * certificate chain"). */
	refused("certificate verification failed: ",
		"rediss://:Pw-s3cret-xyz@127.0.0.1:%d/0?tls_ca=%s/badca.crt",
		g_port, g_dir);
	{
		kl_provider *p;
		kl_error err;

		ck_assert_int_eq(open_uri(&p, &err,
					  "rediss://:Pw-s3cret-xyz@127.0.0.1:"
					  "%d/0?tls_ca=%s/badca.crt",
					  g_port, g_dir),
				 KL_EPROVIDER);
		ck_assert_ptr_null(strstr(err.message, "s3cret"));
	}
	/* The default store does not hold the throwaway CA either. */
	{
		kl_provider *p;
		kl_error err;

		ck_assert_int_eq(open_uri(&p, &err, "rediss://127.0.0.1:%d/0",
					  g_port),
				 KL_EPROVIDER);
		ck_assert_ptr_nonnull(strstr(err.message, "verification "
							  "failed"));
	}
}
END_TEST

START_TEST(test_name_mismatch)
{
	refused("certificate verification failed: hostname mismatch",
		"rediss://127.0.0.1:%d/0?tls_ca=%s/ca.crt&tls_server_name=%s",
		g_port, g_dir, "redis.example.com");
	refused("certificate verification failed: IP address mismatch",
		"rediss://127.0.0.1:%d/0?tls_ca=%s/ca.crt&tls_server_name=%s",
		g_port, g_dir, "127.0.0.2");
	/* A name the certificate has, while connecting by address. */
	{
		kl_provider *p;
		kl_error err;

		ck_assert_msg(open_uri(&p, &err,
				       "rediss://127.0.0.1:%d/0?tls_ca=%s/"
				       "ca.crt&tls_server_name=localhost",
				       g_port, g_dir) == KL_OK,
			      "%s", err.message);
		kl_provider_free(p);
	}
}
END_TEST

START_TEST(test_plain_to_tls_port)
{
	kl_provider *p;
	kl_error err;

	/* The server closes the connection: a failure at once, not the
	 * timeout's "no reply in time" (the timeout is only a hang guard). */
	ck_assert_int_eq(open_uri(&p, &err,
				  "redis://127.0.0.1:%d/0?timeout=60s&"
				  "connect_timeout=60s",
				  g_port),
			 KL_EPROVIDER);
	ck_assert_ptr_null(p);
	ck_assert_msg(strstr(err.message, "use rediss://") != NULL,
		      "message: %s", err.message);
}
END_TEST

START_TEST(test_silent_server)
{
	struct sockaddr_in a = { .sin_family = AF_INET };
	socklen_t len = sizeof a;
	int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
	kl_provider *p;
	kl_error err;
	int64_t t0;

	/* Listens (the kernel completes connections) but never answers. */
	ck_assert_int_ge(fd, 0);
	a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	ck_assert_int_eq(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
	ck_assert_int_eq(listen(fd, 8), 0);
	ck_assert_int_eq(getsockname(fd, (struct sockaddr *)&a, &len), 0);
	t0 = now_ms();
	ck_assert_int_eq(open_uri(&p, &err,
				  "rediss://127.0.0.1:%d/0?timeout=300ms",
				  ntohs(a.sin_port)),
			 KL_EPROVIDER);
	ck_assert_msg(strstr(err.message, "did not finish in time") != NULL,
		      "message: %s", err.message);
	ck_assert_int_ge(now_ms() - t0, 300);
	close(fd);
}
END_TEST

START_TEST(test_stalled_server)
{
	kl_lock_opts o = KL_LOCK_OPTS_INIT;
	kl_provider *p;
	kl_lock *l = NULL, *l2 = NULL, *l0 = NULL;
	kl_lease *a = NULL, *a0 = NULL;
	kl_error err, err0;
	int64_t t0, took, took0;
	int rc, rc0, rc2;

	ck_assert_msg(open_uri(&p, &err,
			       "rediss://127.0.0.1:%d/0?tls_ca=%s/ca.crt&"
			       "prefix=tls-stall:&restart_guard=0&"
			       "timeout=500ms",
			       g_port, g_dir) == KL_OK,
		      "%s", err.message);
	o.provider = p;
	o.key = "tls-stall";
	o.timeout_ms = 0;
	ck_assert_int_eq(kl_lock_new(&l0, &o), KL_OK);
	o.timeout_ms = 1000;
	ck_assert_int_eq(kl_lock_new(&l, &o), KL_OK);
	/* A TLS read that waits for a server that does not answer ends by
	 * its deadline (the try-once, on the connection the open left), and
	 * so does a new connection's handshake (the bounds here are only
	 * hang guards). */
	ck_assert_int_eq(kill(g_pid, SIGSTOP), 0);
	t0 = now_ms();
	rc0 = kl_lock_acquire(l0, NULL, &a0, &err0);
	took0 = now_ms() - t0;
	t0 = now_ms();
	rc = kl_lock_acquire(l, NULL, &a, &err);
	took = now_ms() - t0;
	kill(g_pid, SIGCONT);
	printf("try-once from a stopped server: %s in %lld ms: %s\n",
	       kl_strerror(rc0), (long long)took0, err0.message);
	printf("acquire from a stopped server: %s in %lld ms: %s\n",
	       kl_strerror(rc), (long long)took, err.message);
	if (rc0 == KL_OK)
		kl_lease_release(a0);
	if (rc == KL_OK)
		kl_lease_release(a);
	ck_assert_msg(rc0 == KL_EPROVIDER, "try-once from a stopped server "
					   "gave %s", kl_strerror(rc0));
	ck_assert_msg(rc == KL_EPROVIDER || rc == KL_ETIMEDOUT,
		      "acquire from a stopped server gave %s",
		      kl_strerror(rc));
	ck_assert_int_lt(took0, 30000);
	ck_assert_int_lt(took, 30000);
	/* The broken connection is replaced by a new TLS one.  Another key:
	 * the stopped server may still run the first attempt when it
	 * resumes, granting that key to nobody for a while. */
	o.key = "tls-stall-2";
	o.timeout_ms = 20000;
	ck_assert_int_eq(kl_lock_new(&l2, &o), KL_OK);
	rc2 = kl_lock_acquire(l2, NULL, &a, &err);
	ck_assert_msg(rc2 == KL_OK, "%s: %s", kl_strerror(rc2), err.message);
	kl_lease_release(a);
	kl_lock_free(l);
	kl_lock_free(l0);
	kl_lock_free(l2);
	kl_provider_free(p);
}
END_TEST

START_TEST(test_client_cert)
{
	kl_provider *p;
	kl_error err;

	ck_assert_msg(open_uri(&p, &err,
			       "rediss://127.0.0.1:%d/0?tls_ca=%s/ca.crt&"
			       "tls_cert=%s/client.crt&tls_key=%s/client.key&"
			       "prefix=tls-mtls:&restart_guard=0",
			       g_port_mtls, g_dir, g_dir, g_dir) == KL_OK,
		      "%s", err.message);
	round_trip(p, "tls-key");
	kl_provider_free(p);
	/* Without it the server refuses (TLS 1.3: after the handshake). */
	ck_assert_int_eq(open_uri(&p, &err,
				  "rediss://127.0.0.1:%d/0?tls_ca=%s/ca.crt&"
				  "timeout=60s",
				  g_port_mtls, g_dir),
			 KL_EPROVIDER);
	ck_assert_ptr_null(strstr(err.message, "in time"));
	/* A key others may read is refused, and its content never shown. */
	refused("must be a regular file of yours, mode 0600",
		"rediss://127.0.0.1:%d/0?tls_ca=%s/ca.crt&tls_cert=%s/"
		"client.crt&tls_key=%s/client-open.key",
		g_port_mtls, g_dir, g_dir, g_dir);
}
END_TEST

START_TEST(test_options)
{
	static const char *const einval[] = {
		"redis://127.0.0.1:1/0?tls_ca=/etc/ssl/certs/ca-certificates.crt",
		"redis://127.0.0.1:1/0?tls_server_name=x",
		"rediss://127.0.0.1:1/0?tls_cert=/x.crt",
		"rediss://127.0.0.1:1/0?tls_key=/x.key",
		"rediss://127.0.0.1:1/0?tls_ca=/a&tls_ca=/b",
		"rediss://127.0.0.1:1/0?tls_ca=",
		"rediss://127.0.0.1:1/0?tls_verify=none",
	};
	kl_provider *p;
	kl_error err;

	for (size_t i = 0; i < sizeof einval / sizeof *einval; i++)
		ck_assert_int_eq(open_uri(&p, &err, "%s", einval[i]),
				 KL_EINVAL);
	ck_assert_int_eq(open_uri(&p, &err,
				  "rediss://127.0.0.1:1/0?tls_ca=%s/none.crt",
				  g_dir),
			 KL_EPROVIDER);
	ck_assert_ptr_nonnull(strstr(err.message, "none.crt"));
	ck_assert_int_eq(open_uri(&p, &err,
				  "rediss://127.0.0.1:1/0?tls_ca_dir=%s/none",
				  g_dir),
			 KL_EPROVIDER);
	ck_assert_ptr_nonnull(strstr(err.message, "is not a directory"));
	/* A key that does not match the certificate. */
	ck_assert_int_eq(open_uri(&p, &err,
				  "rediss://127.0.0.1:1/0?tls_cert=%s/"
				  "client.crt&tls_key=%s/server.key",
				  g_dir, g_dir),
			 KL_EPROVIDER);
	ck_assert_ptr_nonnull(strstr(err.message, "mismatch"));
}
END_TEST

#else /* !HAVE_REDIS_TLS */

START_TEST(test_not_compiled)
{
	kl_provider *p;
	kl_error err;

	ck_assert_int_eq(open_uri(&p, &err, "rediss://127.0.0.1:1/0"),
			 KL_EPROVIDER);
	ck_assert_ptr_nonnull(strstr(err.message, "not compiled"));
}
END_TEST
#endif

static Suite *
redis_tls_suite(void)
{
	Suite *s = suite_create("redis_tls");
	TCase *tc = tcase_create("tls");
	double scale = kl_test_scale();

	tcase_set_timeout(tc, 120 * (scale > 1 ? scale : 1));
#ifdef HAVE_REDIS_TLS
	tcase_add_test(tc, test_round_trip);
	tcase_add_test(tc, test_wrong_ca);
	tcase_add_test(tc, test_name_mismatch);
	tcase_add_test(tc, test_plain_to_tls_port);
	tcase_add_test(tc, test_silent_server);
	tcase_add_test(tc, test_stalled_server);
	tcase_add_test(tc, test_client_cert);
	tcase_add_test(tc, test_options);
#else
	tcase_add_test(tc, test_not_compiled);
#endif
	suite_add_tcase(s, tc);
	return s;
}

int
main(void)
{
	int rc;

	srandom((unsigned)getpid() ^ (unsigned)now_ns());
	test_provider_dir();
	setvbuf(stdout, NULL, _IOLBF, 0);
#ifdef HAVE_REDIS_TLS
	const char *tmp = getenv("TMPDIR");

	g_server_bin = getenv("KEYLOCK_TEST_REDIS_SERVER");
	if (g_server_bin == NULL || g_server_bin[0] == '\0' ||
	    access(g_server_bin, X_OK) != 0) {
		printf("SKIP: KEYLOCK_TEST_REDIS_SERVER does not name a "
		       "redis-server (tools/test --only redis sets it)\n");
		return 77;
	}
	if (system("openssl version >/dev/null 2>&1") != 0) {
		printf("SKIP: no openssl(1) to make the certificates\n");
		return 77;
	}
	snprintf(g_dir, sizeof g_dir, "%s/keylock-tls.XXXXXX",
		 tmp != NULL && tmp[0] != '\0' ? tmp : "/tmp");
	if (mkdtemp(g_dir) == NULL) {
		perror("mkdtemp");
		return EXIT_FAILURE;
	}
	if (!make_certs() || (g_pid = start_server(&g_port, false)) == 0 ||
	    (g_pid_mtls = start_server(&g_port_mtls, true)) == 0) {
		fprintf(stderr, "check_redis_tls: set-up failed\n");
		stop_servers();
		return EXIT_FAILURE;
	}
	printf("TLS redis-servers on 127.0.0.1:%d and :%d (client "
	       "certificates), files in %s\n",
	       g_port, g_port_mtls, g_dir);
#endif
	rc = test_run_suite(redis_tls_suite());
#ifdef HAVE_REDIS_TLS
	stop_servers();
#endif
	return rc;
}
