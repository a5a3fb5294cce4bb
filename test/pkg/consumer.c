/* SPDX-License-Identifier: MIT */
/*
 * test/pkg/consumer.c: a program of a keylock user, built by
 * test/pkg/consumer.sh against an installed keylock with nothing but the
 * flags pkg-config gives.  Built plainly it uses libkeylock alone (the
 * memory provider: no server, no hiredis, no libpq); with
 * -DKL_CONSUMER_REDIS it also links libkeylock-redis, with
 * -DKL_CONSUMER_PG libkeylock-pg, and calls them in ways that need no
 * server.  Prints one line and exits 0 when everything answered as the
 * headers say, else says what did not and exits 1.
 */
#include <keylock.h>
#ifdef KL_CONSUMER_REDIS
#include <keylock/redis.h>
#endif
#ifdef KL_CONSUMER_PG
#include <keylock/pg.h>
#endif

#include <stdio.h>
#include <string.h>

static int failed;

static void
expect(int ok, const char *what)
{
	if (!ok) {
		fprintf(stderr, "consumer: FAIL: %s\n", what);
		failed = 1;
	}
}

static int
work(void *arg)
{
	int *count = arg;

	(*count)++;
	return 42;
}

static int
work_lease(kl_lease *lease, void *arg)
{
	uint64_t *fence = arg;

	*fence = kl_lease_valid(lease) ? kl_lease_fence(lease) : 0;
	return strcmp(kl_lease_key(lease), "consumer") == 0 ? 43 : -1;
}

int
main(void)
{
	kl_lock_opts opts = KL_LOCK_OPTS_INIT;
	kl_call call = {"consumer", NULL};
	kl_lock *lock;
	kl_mutex *m;
	kl_token t, t2;
	kl_error err;
	int count = 0, res = 0, rc;

	expect(strcmp(kl_version(), KL_VERSION_STRING) == 0,
	       "kl_version() is the header's KL_VERSION_STRING");

	opts.timeout_ms = 1000;
	rc = kl_lock_new(&lock, &opts);
	expect(rc == KL_OK, "kl_lock_new");
	if (rc == KL_OK) {
		uint64_t fence = 0;

		rc = kl_lock_run(lock, &call, work, &count, &res, &err);
		expect(rc == KL_OK && res == 42 && count == 1, "kl_lock_run");
		rc = kl_lock_run_lease(lock, &call, work_lease, &fence, &res,
				       &err);
		expect(rc == KL_OK && res == 43 && fence > 0,
		       "kl_lock_run_lease");
		kl_lock_free(lock);
	}
	expect(kl_memory_provider_size(kl_memory_provider()) == 0,
	       "the memory provider is empty afterwards");

	rc = kl_mutex_new(&m, NULL);
	expect(rc == KL_OK, "kl_mutex_new");
	if (rc == KL_OK) {
		expect(kl_mutex_enter(m, 0, NULL, &t) == KL_OK,
		       "kl_mutex_enter");
		expect(kl_mutex_is_locked(m) &&
			       kl_mutex_try_enter(m, &t2) == KL_ETIMEDOUT,
		       "a held kl_mutex is locked");
		expect(kl_mutex_leave(m, t, false) == KL_OK, "kl_mutex_leave");
		kl_mutex_free(m);
	}
	expect(strcmp(kl_strerror(KL_ETIMEDOUT), kl_strerror(KL_OK)) != 0,
	       "kl_strerror names the statuses");

#ifdef KL_CONSUMER_REDIS
	{
		kl_provider *p = NULL;

		/* An unknown option is refused before any connection. */
		rc = kl_redis_provider_open(
			&p, "redis://127.0.0.1:6379/0?no_such_option=1", &err);
		expect(rc == KL_EINVAL && p == NULL,
		       "kl_redis_provider_open refuses an unknown option");
	}
#endif
#ifdef KL_CONSUMER_PG
	{
		kl_provider *p = NULL;
		int64_t id = kl_pg_key_id("consumer", 8);

		expect(id == kl_pg_key_id("consumer", 8) &&
			       id != kl_pg_key_id("consumes", 8),
		       "kl_pg_key_id is a function of the key");
		/* A pool of 0 is refused before any connection. */
		rc = kl_pg_provider_open(&p, "postgresql://127.0.0.1/x?pool=0",
					 &err);
		expect(rc == KL_EINVAL && p == NULL,
		       "kl_pg_provider_open refuses pool=0");
	}
#endif

	if (failed)
		return 1;
	printf("consumer: keylock %s%s%s: ok\n", kl_version(),
#ifdef KL_CONSUMER_REDIS
	       " + redis",
#else
	       "",
#endif
#ifdef KL_CONSUMER_PG
	       " + pg"
#else
	       ""
#endif
	);
	return 0;
}
