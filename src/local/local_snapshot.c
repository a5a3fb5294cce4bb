/* SPDX-License-Identifier: MIT */
/*
 * kl_provider_snapshot for the local provider: every queue file of the
 * state directory, its live tickets as status judges them (a dead holder
 * or waiter is not listed; a waiter that the next look will grant is
 * listed holding, with fence 0 and elapsed_ms -1).
 *
 * Each key is read under its queue lock, taken with a short bound
 * (KL_LOCAL_TRY_GRACE_MS) and without changing anything: its entries are
 * those of one moment.  A queue lock held by a stopped process is not
 * waited for: that key is read without it, checked as status checks.
 * What is read is untrusted: the key recorded in the queue file is
 * believed only when it hashes (with the directory's secret) to the
 * file's name, so a file being written or damaged lists its key as NULL,
 * never a wrong one; tickets whose record does not check are listed with
 * pid and tid 0.  fn runs after the key's files are closed and unlocked.
 */
#include "config.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "local_internal.h"

struct collect {
	struct kl__local_ticket *v;
	size_t n, cap;
	bool nomem;
	int unsure; /* errno of a ticket whose life could not be told */
};

static int
collect(const struct kl__local_ticket *t, void *arg)
{
	struct collect *c = arg;

	/* Counted alive only because we could not look (out of
	 * descriptors): it may be dead, and listing it would mislead. */
	if (t->unsure != 0) {
		c->unsure = t->unsure;
		return 1;
	}
	if (c->n == c->cap) {
		size_t cap = c->cap != 0 ? c->cap * 2 : 8;
		struct kl__local_ticket *v = kl__malloc(cap * sizeof *v);

		if (v == NULL) {
			c->nomem = true;
			return 1;
		}
		if (c->n != 0)
			memcpy(v, c->v, c->n * sizeof *v);
		kl__free(c->v);
		c->v = v;
		c->cap = cap;
	}
	c->v[c->n++] = *t;
	return 0;
}

/* The hash a queue file's name carries: "q" and 16 lowercase hex digits,
 * nothing else.  false for any other name. */
static bool
queue_hash(const char *name, uint64_t *hash)
{
	uint64_t h = 0;

	if (name[0] != 'q')
		return false;
	for (int i = 1; i <= 16; i++) {
		char c = name[i];

		if (c >= '0' && c <= '9')
			h = h << 4 | (uint64_t)(c - '0');
		else if (c >= 'a' && c <= 'f')
			h = h << 4 | (uint64_t)(c - 'a' + 10);
		else
			return false;
	}
	if (name[17] != '\0')
		return false;
	*hash = h;
	return true;
}

/* The key recorded in the queue file, if it is whole: a fresh string
 * (kl__free it) in *key, or NULL.  KL_OK or KL_ENOMEM. */
static int
read_key(struct local *lp, int qfd, const struct kl__local_qstate *st,
	 uint64_t hash, char **key)
{
	size_t len = (size_t)st->key_len;
	char *buf;

	*key = NULL;
	if (st->key_len > KL_LOCAL_KEY_KEEP)
		return KL_OK;
	if ((buf = kl__malloc(len + 1)) == NULL)
		return KL_ENOMEM;
	if (pread(qfd, buf, len, sizeof *st) != (ssize_t)len ||
	    kl__siphash(lp->k0, lp->k1, buf, len) != hash) {
		kl__free(buf);
		return KL_OK;
	}
	buf[len] = '\0';
	*key = buf;
	return KL_OK;
}

static int64_t
ms_since(uint64_t now_us, int64_t then_us)
{
	if (then_us <= 0 || (uint64_t)then_us > now_us)
		return -1;
	return (int64_t)((now_us - (uint64_t)then_us) / 1000u);
}

/* Lists the queue file name; *stop set when fn asked to stop.  KL_OK
 * (also for a file gone meanwhile), KL_ENOMEM or KL_EPROVIDER. */
static int
snapshot_key(struct local *lp, const char *name, uint64_t hash,
	     kl_snapshot_fn fn, void *arg, bool *stop, kl_error *err)
{
	struct collect c = { NULL, 0, 0, false, 0 };
	struct kl__local_qstate st;
	char detail[128];
	char *key = NULL;
	struct stat qst;
	size_t pos = 0;
	uint64_t now;
	bool locked;
	int qfd, rc;

	qfd = kl__local_open_checked(lp, name, O_RDONLY, err);
	if (qfd == -ENOENT || qfd == -EAGAIN)
		return KL_OK;
	if (qfd < 0)
		return qfd == -EPERM ? KL_EPROVIDER
				     : kl__local_fail_file(lp, err,
							   "cannot open", name,
							   -qfd);
	locked = kl__local_qlock(qfd, kl__deadline(KL_LOCAL_TRY_GRACE_MS),
				 NULL) == KL_OK;
	if (locked && fstat(qfd, &qst) == 0 && qst.st_nlink == 0) {
		/* Removed as idle meanwhile. */
		rc = KL_OK;
		goto out;
	}
	for (int tries = 0;; tries++) {
		rc = kl__local_read_state(lp, name, qfd, &st, err);
		if (rc == KL_OK || locked || tries == 3)
			break;
		{
			struct timespec ts = { 0, 1000000 };
			nanosleep(&ts, NULL);
		}
	}
	if (rc != KL_OK || st.next == 0)
		goto out;
	if ((rc = read_key(lp, qfd, &st, hash, &key)) != KL_OK)
		goto out;
	kl__local_walk(lp, name, &st, collect, &c);
	if (c.nomem)
		rc = KL_ENOMEM;
	else if (c.unsure != 0)
		rc = kl__local_fail_file(lp, err,
					 "cannot tell who holds the key of",
					 name, c.unsure);
out:
	if (locked)
		kl__local_qunlock(qfd);
	close(qfd);
	if (rc != KL_OK || c.n == 0) {
		kl__free(c.v);
		kl__free(key);
		return rc;
	}
	if (key != NULL)
		snprintf(detail, sizeof detail, "%s", name);
	else if (st.key_len > KL_LOCAL_KEY_KEEP)
		snprintf(detail, sizeof detail,
			 "%s: a key of %" PRIu64 " bytes, longer than the %d "
			 "bytes recorded",
			 name, st.key_len, KL_LOCAL_KEY_KEEP);
	else
		snprintf(detail, sizeof detail, "%s: key not recorded", name);
	now = kl__local_wall_us();
	for (size_t i = 0; i < c.n && !*stop; i++) {
		const struct kl__local_ticket *t = &c.v[i];
		kl_lock_info info;

		memset(&info, 0, sizeof info);
		info.key = key;
		info.key_len = key != NULL ? (size_t)st.key_len : 0;
		info.detail = detail;
		info.waiting = !t->holds;
		info.shared = t->shared;
		info.pid = t->known ? t->rec.pid : 0;
		info.tid = t->known ? t->rec.tid : 0;
		if (t->holds) {
			info.fence = t->has_grant ? t->grant.fence : 0;
			info.elapsed_ms =
				t->has_grant ? ms_since(now, t->grant.at_us)
					     : -1;
		} else {
			info.elapsed_ms =
				t->known ? ms_since(now, t->rec.since_us) : -1;
			info.position = pos++;
		}
		if (fn(&info, arg) != 0)
			*stop = true;
	}
	kl__free(c.v);
	kl__free(key);
	return KL_OK;
}

static int
snapshot(void *impl, kl_snapshot_fn fn, void *arg, kl_error *err)
{
	struct local *lp = impl;
	kl_error kerr;
	struct dirent *e;
	bool stop = false;
	int fd, rc, first = KL_OK;
	DIR *d;

	/* A descriptor of its own: readdir's position is per open file. */
	fd = openat(lp->dirfd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (fd < 0)
		return kl__local_fail(err, KL_EPROVIDER,
				      "cannot read the state directory", errno);
	if ((d = fdopendir(fd)) == NULL) {
		rc = errno;
		close(fd);
		return rc == ENOMEM ? KL_ENOMEM
				    : kl__local_fail(err, KL_EPROVIDER,
						     "cannot read the state "
						     "directory",
						     rc);
	}
	/* A damaged or refused queue file does not hide the others: it is
	 * reported once all are listed. */
	while (!stop) {
		uint64_t hash;
		char name[KL_LOCAL_QNAME];

		errno = 0;
		/* The stream is this call's own: readdir is safe on it. */
		e = readdir(d); /* NOLINT(concurrency-mt-unsafe) */
		if (e == NULL) {
			if (errno != 0 && first == KL_OK)
				first = kl__local_fail(err, KL_EPROVIDER,
						       "cannot read the state "
						       "directory",
						       errno);
			break;
		}
		if (!queue_hash(e->d_name, &hash))
			continue;
		memcpy(name, e->d_name, 18);
		kerr.status = KL_OK;
		kerr.message[0] = '\0';
		rc = snapshot_key(lp, name, hash, fn, arg, &stop, &kerr);
		if (rc == KL_ENOMEM) {
			first = kl__local_fail(err, KL_ENOMEM,
					       "out of memory listing the locks",
					       0);
			break;
		}
		if (rc != KL_OK && first == KL_OK) {
			first = rc;
			if (err != NULL)
				*err = kerr;
		}
	}
	closedir(d);
	if (stop)
		return KL_OK;
	return first;
}

int
kl__local_snapshot(void *impl, kl_snapshot_fn fn, void *arg, kl_error *err)
{
	int old, rc;

	/* Not a cancellation point (see local_acquire), fn included: a
	 * thread cancelled in it would leave the listing's memory and
	 * directory stream behind. */
	pthread_setcancelstate(PTHREAD_CANCEL_DISABLE, &old);
	rc = snapshot(impl, fn, arg, err);
	pthread_setcancelstate(old, NULL);
	return rc;
}
