/* SPDX-License-Identifier: MIT */
/*
 * TLS for the Redis provider (rediss://), with OpenSSL.
 *
 * hiredis is used for building commands and parsing replies only (see
 * redis_io.c), so its own TLS layer (hiredis_ssl, missing from hiredis
 * 0.14 anyway) would not be in the path: the session is OpenSSL's, over a
 * BIO of our own that sends with MSG_NOSIGNAL (a closed connection must not
 * raise SIGPIPE) and that can be made not to block, so that the handshake
 * and the reads close to a deadline never wait past it.
 *
 * Verification is always on: the server's chain must lead to a CA of
 * tls_ca / tls_ca_dir (default: OpenSSL's default store), and its
 * certificate must name the host of the URI, or tls_server_name (a DNS
 * name, also sent as SNI, or an IP address, matched against the IP
 * addresses of the certificate; SNI never carries an address).
 *
 * Messages name the files and the reason OpenSSL gives, never what a file
 * holds, and never the password (the URI is never quoted).
 */
#include "config.h"

#include <arpa/inet.h>
#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>

#include "redis_internal.h"

#ifndef MSG_NOSIGNAL
/* redis_io.c blocks SIGPIPE around its writes there. */
#define MSG_NOSIGNAL 0
#endif

struct kl__rtls {
	SSL *ssl;
	int fd;
	bool nowait; /* the BIO neither sends nor receives blocking */
	char why[160];
};

/* The reason of the first error in OpenSSL's queue (the root cause), which
 * is then emptied. */
static const char *
ssl_reason(char *buf, size_t size)
{
	unsigned long e = ERR_get_error();
	const char *r = e != 0 ? ERR_reason_error_string(e) : NULL;

	if (e == 0)
		snprintf(buf, size, "no reason given");
	else if (r != NULL)
		snprintf(buf, size, "%s", r);
	else
		ERR_error_string_n(e, buf, size);
	ERR_clear_error();
	return buf;
}

/* ------------------------------------------------------------------ */
/* The BIO                                                             */

static BIO_METHOD *bio_method;
static pthread_once_t bio_once = PTHREAD_ONCE_INIT;

static int
bio_write(BIO *b, const char *p, int n)
{
	struct kl__rtls *t = BIO_get_data(b);
	ssize_t r;

	BIO_clear_retry_flags(b);
	r = send(t->fd, p, (size_t)n,
		 MSG_NOSIGNAL | (t->nowait ? MSG_DONTWAIT : 0));
	if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK ||
		      errno == EINTR))
		BIO_set_retry_write(b);
	return (int)r;
}

static int
bio_read(BIO *b, char *p, int n)
{
	struct kl__rtls *t = BIO_get_data(b);
	ssize_t r;

	BIO_clear_retry_flags(b);
	r = recv(t->fd, p, (size_t)n, t->nowait ? MSG_DONTWAIT : 0);
	/* EAGAIN also ends a blocking recv(): SO_RCVTIMEO's slice. */
	if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK ||
		      errno == EINTR))
		BIO_set_retry_read(b);
	return (int)r;
}

static long
bio_ctrl(BIO *b, int cmd, long num, void *ptr)
{
	(void)b;
	(void)num;
	(void)ptr;
	/* Nothing is buffered here: a flush is done at once. */
	return cmd == BIO_CTRL_FLUSH ? 1 : 0;
}

static int
bio_create(BIO *b)
{
	BIO_set_init(b, 1);
	return 1;
}

static void
bio_init(void)
{
	BIO_METHOD *m = BIO_meth_new(BIO_get_new_index() | BIO_TYPE_SOURCE_SINK,
				     "keylock-redis socket");

	if (m == NULL)
		return;
	if (!BIO_meth_set_write(m, bio_write) ||
	    !BIO_meth_set_read(m, bio_read) ||
	    !BIO_meth_set_ctrl(m, bio_ctrl) ||
	    !BIO_meth_set_create(m, bio_create)) {
		BIO_meth_free(m);
		return;
	}
	bio_method = m;
}

/* ------------------------------------------------------------------ */
/* The context                                                         */

/* An encrypted key would make OpenSSL ask on the terminal: refuse it. */
static int
no_passphrase(char *buf, int size, int rwflag, void *arg)
{
	(void)buf;
	(void)size;
	(void)rwflag;
	(void)arg;
	return 0;
}

static int
ctx_error(kl_error *err, const char *what, const char *path)
{
	char why[160];

	kl__error_set(err, KL_EPROVIDER, "redis provider: cannot %s %s: %s",
			what, path, ssl_reason(why, sizeof why));
	return KL_EPROVIDER;
}

/* The key file may be read by its owner only (root-owned keys may be
 * readable by their group, as Debian's ssl-cert group has them): the rule
 * libpq applies to client keys. */
static int
check_key_file(const char *path, kl_error *err)
{
	struct stat st;
	mode_t bad = S_IRWXG | S_IRWXO;

	if (stat(path, &st) != 0) {
		kl__error_set(err, KL_EPROVIDER,
				"redis provider: cannot read the tls_key "
				"file %s: %m",
				path);
		return KL_EPROVIDER;
	}
	if (st.st_uid == 0)
		bad = S_IWGRP | S_IXGRP | S_IRWXO;
	if (!S_ISREG(st.st_mode) || (st.st_mode & bad) != 0 ||
	    (st.st_uid != geteuid() && st.st_uid != 0)) {
		kl__error_set(err, KL_EPROVIDER,
				"redis provider: the tls_key file %s must be "
				"a regular file of yours, mode 0600 (it has "
				"%04o)",
				path, (unsigned)(st.st_mode & 07777));
		return KL_EPROVIDER;
	}
	return KL_OK;
}

int
kl__redis_tls_ctx_new(struct kl__redis_conf *conf, kl_error *err)
{
	SSL_CTX *ctx;
	struct stat st;
	int rc = KL_EPROVIDER;

	ERR_clear_error();
	if ((ctx = SSL_CTX_new(TLS_client_method())) == NULL) {
		ERR_clear_error();
		return KL_ENOMEM;
	}
	SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER, NULL);
	SSL_CTX_set_default_passwd_cb(ctx, no_passphrase);
	if (!SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION)) {
		ctx_error(err, "set the TLS version", "1.2");
		goto fail;
	}
	if (conf->tls_ca != NULL &&
	    !SSL_CTX_load_verify_locations(ctx, conf->tls_ca, NULL)) {
		ctx_error(err, "load the CA certificates of tls_ca",
			  conf->tls_ca);
		goto fail;
	}
	/* OpenSSL reads a directory only when verifying: look now. */
	if (conf->tls_ca_dir != NULL &&
	    (stat(conf->tls_ca_dir, &st) != 0 || !S_ISDIR(st.st_mode))) {
		kl__error_set(err, KL_EPROVIDER,
				"redis provider: tls_ca_dir %s is not a "
				"directory",
				conf->tls_ca_dir);
		goto fail;
	}
	if (conf->tls_ca_dir != NULL &&
	    !SSL_CTX_load_verify_locations(ctx, NULL, conf->tls_ca_dir)) {
		ctx_error(err, "use the CA directory tls_ca_dir",
			  conf->tls_ca_dir);
		goto fail;
	}
	if (conf->tls_ca == NULL && conf->tls_ca_dir == NULL &&
	    !SSL_CTX_set_default_verify_paths(ctx)) {
		ctx_error(err, "load", "OpenSSL's default CA certificates");
		goto fail;
	}
	if (conf->tls_cert != NULL) {
		if ((rc = check_key_file(conf->tls_key, err)) != KL_OK)
			goto fail;
		rc = KL_EPROVIDER;
		if (!SSL_CTX_use_certificate_chain_file(ctx, conf->tls_cert)) {
			ctx_error(err, "load the client certificate tls_cert",
				  conf->tls_cert);
			goto fail;
		}
		if (!SSL_CTX_use_PrivateKey_file(ctx, conf->tls_key,
						 SSL_FILETYPE_PEM)) {
			ctx_error(err,
				  "load the key (PEM, not encrypted) tls_key",
				  conf->tls_key);
			goto fail;
		}
		/* SSL_CTX_use_PrivateKey_file checks that the key
		 * matches the certificate: "key values mismatch". */
	}
	conf->tls_ctx = ctx;
	return KL_OK;
fail:
	ERR_clear_error();
	SSL_CTX_free(ctx);
	return rc;
}

void
kl__redis_tls_ctx_free(struct kl__redis_conf *conf)
{
	SSL_CTX_free(conf->tls_ctx);
	conf->tls_ctx = NULL;
}

/* ------------------------------------------------------------------ */
/* Sessions                                                            */

void
kl__rtls_free(struct kl__rtls *t)
{
	if (t == NULL)
		return;
	/* SSL_free writes nothing (SSL_shutdown would send close_notify). */
	SSL_free(t->ssl);
	free(t);
}

static int
handshake_failed(struct kl__rtls *t, const struct kl__redis_conf *conf,
		 int e, kl_error *err)
{
	long v = SSL_get_verify_result(t->ssl);
	char why[160];

	if (v != X509_V_OK) {
		kl__error_set(err, KL_EPROVIDER,
				"redis provider: TLS with %s port %d: "
				"certificate verification failed: %s",
				conf->host, conf->port,
				X509_verify_cert_error_string(v));
	} else if (e == SSL_ERROR_SYSCALL && ERR_peek_error() == 0) {
		/* %m: strerror() is not thread-safe. */
		if (errno != 0)
			kl__error_set(err, KL_EPROVIDER,
					"redis provider: TLS handshake with "
					"%s port %d failed: %m",
					conf->host, conf->port);
		else
			kl__error_set(err, KL_EPROVIDER,
					"redis provider: TLS handshake with "
					"%s port %d failed: the server closed "
					"the connection (is it a TLS port?)",
					conf->host, conf->port);
	} else {
		kl__error_set(err, KL_EPROVIDER,
				"redis provider: TLS handshake with %s port "
				"%d failed: %s (is it a TLS port?)",
				conf->host, conf->port,
				ssl_reason(why, sizeof why));
	}
	ERR_clear_error();
	return KL_EPROVIDER;
}

int
kl__rtls_start(struct kl__rconn *c, const struct kl__redis_conf *conf,
	       int64_t deadline_ns, kl_error *err)
{
	const char *name = conf->tls_server_name != NULL ? conf->tls_server_name
							 : conf->host;
	unsigned char addr[16];
	struct kl__rtls *t;
	X509_VERIFY_PARAM *param;
	BIO *bio;
	bool ip;

	pthread_once(&bio_once, bio_init);
	if (bio_method == NULL || conf->tls_ctx == NULL)
		return KL_ENOMEM;
	if ((t = calloc(1, sizeof *t)) == NULL)
		return KL_ENOMEM;
	ERR_clear_error();
	t->fd = c->ctx->fd;
	if ((t->ssl = SSL_new(conf->tls_ctx)) == NULL ||
	    (bio = BIO_new(bio_method)) == NULL) {
		ERR_clear_error();
		kl__rtls_free(t);
		return KL_ENOMEM;
	}
	BIO_set_data(bio, t);
	SSL_set_bio(t->ssl, bio, bio);
	/* From here kl__rconn_close frees it. */
	c->tls = t;
	ip = inet_pton(AF_INET, name, addr) == 1 ||
	     inet_pton(AF_INET6, name, addr) == 1;
	param = SSL_get0_param(t->ssl);
	X509_VERIFY_PARAM_set_hostflags(param,
					X509_CHECK_FLAG_NO_PARTIAL_WILDCARDS);
	if (ip ? !X509_VERIFY_PARAM_set1_ip_asc(param, name)
	       : !X509_VERIFY_PARAM_set1_host(param, name, 0) ||
			 !SSL_set_tlsext_host_name(t->ssl, name)) {
		kl__error_set(err, KL_EPROVIDER,
				"redis provider: cannot verify TLS for the "
				"server name %s: %s",
				name, ssl_reason(t->why, sizeof t->why));
		return KL_EPROVIDER;
	}
	/* The handshake does not block: poll() keeps it to the deadline. */
	t->nowait = true;
	for (;;) {
		int r, e, w;

		ERR_clear_error();
		errno = 0;
		r = SSL_connect(t->ssl);
		if (r == 1)
			break;
		e = SSL_get_error(t->ssl, r);
		if (e != SSL_ERROR_WANT_READ && e != SSL_ERROR_WANT_WRITE)
			return handshake_failed(t, conf, e, err);
		w = kl__redis_wait_fd(t->fd,
				      e == SSL_ERROR_WANT_READ ? POLLIN
							       : POLLOUT,
				      deadline_ns);
		if (w <= 0) {
			kl__error_set(err, KL_EPROVIDER,
					"redis provider: TLS handshake with "
					"%s port %d %s",
					conf->host, conf->port,
					w == 0 ? "did not finish in time"
					       : "failed: poll() failed");
			return KL_EPROVIDER;
		}
	}
	t->nowait = false;
	return KL_OK;
}

/* What SSL_read or SSL_write's result r means, as send() and recv() say
 * it. */
static ssize_t
io_result(struct kl__rtls *t, int r)
{
	int e, saved = errno;

	if (r > 0)
		return r;
	e = SSL_get_error(t->ssl, r);
	switch (e) {
	case SSL_ERROR_ZERO_RETURN:
		return 0;
	case SSL_ERROR_WANT_READ:
	case SSL_ERROR_WANT_WRITE:
		errno = EAGAIN;
		return -1;
	case SSL_ERROR_SYSCALL:
		if (ERR_peek_error() == 0) {
			/* The socket's own failure, or the end of it. */
			if (saved == 0)
				return 0;
			errno = saved;
			return -1;
		}
		break;
	default:
		break;
	}
	ssl_reason(t->why, sizeof t->why);
	errno = EPROTO;
	return -1;
}

ssize_t
kl__rtls_send(struct kl__rtls *t, const void *p, size_t n)
{
	ERR_clear_error();
	errno = 0;
	return io_result(t, SSL_write(t->ssl, p, n > INT_MAX ? INT_MAX
							     : (int)n));
}

ssize_t
kl__rtls_recv(struct kl__rtls *t, void *p, size_t n, bool nowait)
{
	ssize_t r;

	ERR_clear_error();
	errno = 0;
	t->nowait = nowait;
	r = io_result(t, SSL_read(t->ssl, p, n > INT_MAX ? INT_MAX : (int)n));
	t->nowait = false;
	return r;
}

bool
kl__rtls_pending(struct kl__rtls *t)
{
	return SSL_pending(t->ssl) > 0;
}

const char *
kl__rtls_error(struct kl__rtls *t)
{
	return t->why[0] != '\0' ? t->why : "TLS error";
}
