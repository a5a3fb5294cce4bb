/* SPDX-License-Identifier: MIT */
/*
 * fenced_store: code run under a lock passes its fence to the store the
 * lock protects, on the public API only.
 *
 * A lock can end without its holder knowing: a distributed lease whose ttl
 * passed while the holder was paused, a server that restarted.  The holder
 * then writes as if it still held the key, and overwrites the work of the
 * next one.  The fence is the cure: every grant of a key gets a larger one,
 * the holder sends it with each write, and the store refuses a write whose
 * fence is smaller than the last one it accepted.
 *
 * Two threads, each with a kl_lock of its own over one provider, add 1 to
 * an account's balance WORKERS x ROUNDS times by read-modify-write through
 * kl_lock_run_lease, each write carrying kl_lease_fence.  Then a holder
 * that kept its fence past its lease, as a paused one would, tries to
 * write after the next holder wrote: the store refuses it.  The provider is
 * a private memory provider, or the URI given as the only argument:
 *
 *   fenced_store                       memory provider
 *   fenced_store local:/tmp/x          processes of one host
 *   fenced_store redis://127.0.0.1:6379/0
 *
 * The store lives in this process's memory; a real one keeps the last
 * fence next to the data (a column, a key, a file header) and compares it
 * in the same transaction as the write.  Exits 0 when its checks hold.
 */
#ifndef _POSIX_C_SOURCE
#define _POSIX_C_SOURCE 200809L
#endif
#include <inttypes.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>

#include <keylock.h>

#define WORKERS 2
#define ROUNDS 1000
#define KEY "account:7"

/* The store: a balance and the last fence it accepted.  Its mutex only
 * makes each write atomic; the read-modify-write as a whole is the lock's
 * to protect. */
struct fenced_store {
	pthread_mutex_t mu;
	uint64_t fence;
	long balance;
	long accepted, refused;
};

static struct fenced_store store = { .mu = PTHREAD_MUTEX_INITIALIZER };

static long
store_read(struct fenced_store *s)
{
	long v;

	pthread_mutex_lock(&s->mu);
	v = s->balance;
	pthread_mutex_unlock(&s->mu);
	return v;
}

/* Writes balance unless fence is smaller than the last accepted fence
 * (an equal one is the same holder writing again).  0, or -1 refused. */
static int
store_write(struct fenced_store *s, uint64_t fence, long balance)
{
	int rc = 0;

	pthread_mutex_lock(&s->mu);
	if (fence < s->fence) {
		s->refused++;
		rc = -1;
	} else {
		s->fence = fence;
		s->balance = balance;
		s->accepted++;
	}
	pthread_mutex_unlock(&s->mu);
	return rc;
}

/* Runs under the lock, with the lease it holds: must not release it. */
static int
deposit(kl_lease *lease, void *arg)
{
	long *amount = arg;

	/* A distributed lease that is known lost: do not even try. */
	if (!kl_lease_valid(lease))
		return -1;
	return store_write(&store, kl_lease_fence(lease),
			   store_read(&store) + *amount);
}

struct worker {
	pthread_t th;
	kl_provider *provider;
	int failures;
	kl_error err;
};

static void *
worker_main(void *arg)
{
	struct worker *w = arg;
	kl_lock_opts opts = KL_LOCK_OPTS_INIT;
	kl_lock *lock;
	long one = 1;

	opts.provider = w->provider;
	opts.key = KEY;
	opts.timeout_ms = 30000;
	if (kl_lock_new(&lock, &opts) != KL_OK) {
		w->failures = ROUNDS;
		return NULL;
	}
	for (int i = 0; i < ROUNDS; i++) {
		int res = -1;

		if (kl_lock_run_lease(lock, NULL, deposit, &one, &res,
				      &w->err) != KL_OK ||
		    res != 0)
			w->failures++;
	}
	kl_lock_free(lock);
	return NULL;
}

/* Keeps a copy of its fence, as a holder that goes on working after its
 * lease ended would. */
static int
remember_fence(kl_lease *lease, void *arg)
{
	uint64_t *fence = arg;

	*fence = kl_lease_fence(lease);
	return store_write(&store, *fence, store_read(&store));
}

int
main(int argc, char **argv)
{
	struct worker w[WORKERS] = { { 0 } };
	kl_lock_opts opts = KL_LOCK_OPTS_INIT;
	kl_provider *provider = NULL;
	uint64_t stale = 0, newer = 0;
	kl_lock *lock = NULL;
	kl_error err;
	long total = WORKERS * ROUNDS;
	int failures = 0, res = -1, rc;
	bool ok = true;

	if (argc > 2) {
		fprintf(stderr, "usage: fenced_store [PROVIDER-URI]\n");
		return 64;
	}
	rc = argc == 2 ? kl_provider_open(&provider, argv[1], &err)
		       : kl_memory_provider_new(&provider);
	if (rc != KL_OK) {
		fprintf(stderr, "fenced_store: %s\n",
			argc == 2 ? err.message : kl_strerror(rc));
		return 1;
	}
	printf("keylock %s: %d threads deposit %d times each into %s, on %s\n",
	       kl_version(), WORKERS, ROUNDS, KEY,
	       argc == 2 ? argv[1] : "a memory provider");

	for (int i = 0; i < WORKERS; i++) {
		w[i].provider = provider;
		if (pthread_create(&w[i].th, NULL, worker_main, &w[i]) != 0) {
			fprintf(stderr, "fenced_store: pthread_create failed\n");
			return 1;
		}
	}
	for (int i = 0; i < WORKERS; i++) {
		pthread_join(w[i].th, NULL);
		if (w[i].failures > 0)
			fprintf(stderr, "  worker %d: %d deposits failed (%s)\n",
				i, w[i].failures, w[i].err.message);
		failures += w[i].failures;
	}
	printf("  balance %ld of %ld; %ld writes accepted, %ld refused\n",
	       store_read(&store), total, store.accepted, store.refused);
	ok &= failures == 0 && store_read(&store) == total &&
	      store.refused == 0;

	/* A stale holder: it got its fence, its lease ended (released here;
	 * expired, for a paused holder), the next holder wrote; its late
	 * write is refused. */
	opts.provider = provider;
	opts.key = KEY;
	opts.timeout_ms = 30000;
	if (kl_lock_new(&lock, &opts) != KL_OK) {
		fprintf(stderr, "fenced_store: kl_lock_new failed\n");
		return 1;
	}
	rc = kl_lock_run_lease(lock, NULL, remember_fence, &stale, &res, &err);
	ok &= rc == KL_OK && res == 0;
	rc = kl_lock_run_lease(lock, NULL, remember_fence, &newer, &res, &err);
	ok &= rc == KL_OK && res == 0 && newer > stale;
	res = store_write(&store, stale, 0);
	printf("  a stale holder's write with fence %" PRIu64 " after fence "
	       "%" PRIu64 ": %s\n",
	       stale, newer, res == 0 ? "ACCEPTED" : "refused");
	ok &= res == -1 && store_read(&store) == total;
	kl_lock_free(lock);
	kl_provider_free(provider);

	printf("fenced_store: %s\n", ok ? "OK" : "FAILED");
	return ok ? 0 : 1;
}
