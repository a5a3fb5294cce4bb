/* SPDX-License-Identifier: MIT */
/*
 * keyed_pool: the keylock quickstart, on the public API only.  4 worker
 * threads process 12 jobs for 3 customers, each under kl_lock_run() on one
 * shared kl_lock with the customer id as the call's key (default memory
 * provider): one customer's jobs run one at a time in arrival order, while
 * different customers run in parallel.  With "customer:2" held by main, one
 * job gives up after a short timeout (KL_ETIMEDOUT: LockNotAcquired) and one
 * is cancelled from main with a kl_cancel token (KL_ECANCELED).  An on_event
 * hook counts grants and prints rejections.  Exits 0 when its checks hold.
 */
#ifndef _POSIX_C_SOURCE
#define _POSIX_C_SOURCE 200809L
#endif
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <time.h>

#include <keylock.h>

#define NWORKERS 4
#define NCUSTOMERS 3
#define NJOBS 12

struct customer {
	const char *key;
	atomic_int in_section; /* its jobs inside the lock now: 0 or 1 */
	atomic_int granted;    /* its jobs granted so far */
	int order[NJOBS];      /* job ids in grant order */
};

struct job {
	int id, customer;
	kl_lock *lock;
	kl_cancel *cancel;
	int64_t start_ms, waited_ms;
	int status, result;
	kl_error err;
};

static struct customer customers[NCUSTOMERS] = {
	{ .key = "customer:1" },
	{ .key = "customer:2" },
	{ .key = "customer:3" },
};
/* The customer of each job: customer:1 comes in a burst, so its jobs queue. */
static const int job_customer[NJOBS] = { 0, 0, 0, 1, 2, 0, 1, 2, 1, 2, 0, 1 };
static struct job jobs[NJOBS];
static atomic_int next_job, ran, overlaps, active, max_active;
static atomic_int n_acquired, n_rejected;

static int64_t
now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void
sleep_ms(long ms)
{
	struct timespec ts = { ms / 1000, (ms % 1000) * 1000000L };

	while (nanosleep(&ts, &ts) == -1 && errno == EINTR)
		;
}

/* The hook of both locks.  ev->key is valid during the call only. */
static void
on_event(const kl_event *ev, void *arg)
{
	(void)arg;
	if (ev->type == KL_EV_ACQUIRED) {
		atomic_fetch_add(&n_acquired, 1);
	} else if (ev->type == KL_EV_REJECTED) {
		atomic_fetch_add(&n_rejected, 1);
		printf("  [event] REJECTED %s: %s\n", ev->key,
		       kl_strerror(ev->status));
	}
}

/* The critical section: at most one job per customer may be in here. */
static int
job_work(void *arg)
{
	struct job *j = arg;
	struct customer *c = &customers[j->customer];
	int n, now, max;

	j->waited_ms = now_ms() - j->start_ms;
	if (atomic_fetch_add(&c->in_section, 1) != 0)
		atomic_fetch_add(&overlaps, 1);
	if ((n = atomic_fetch_add(&c->granted, 1)) < NJOBS)
		c->order[n] = j->id;
	now = atomic_fetch_add(&active, 1) + 1;
	max = atomic_load(&max_active);
	while (now > max &&
	       !atomic_compare_exchange_weak(&max_active, &max, now))
		;
	sleep_ms(20 + 10 * (j->id % 3)); /* the work */
	atomic_fetch_sub(&active, 1);
	atomic_fetch_sub(&c->in_section, 1);
	atomic_fetch_add(&ran, 1);
	return j->id;
}

static void *
run_job(void *arg)
{
	struct job *j = arg;
	kl_call call = { .key = customers[j->customer].key,
			 .cancel = j->cancel };

	j->start_ms = now_ms();
	j->status =
	    kl_lock_run(j->lock, &call, job_work, j, &j->result, &j->err);
	if (j->status != KL_OK)
		j->waited_ms = now_ms() - j->start_ms;
	return NULL;
}

static void *
worker(void *arg)
{
	int i;

	(void)arg;
	while ((i = atomic_fetch_add(&next_job, 1)) < NJOBS) {
		struct job *j = &jobs[i];

		run_job(j);
		printf("  job %2d  %s  waited %3" PRId64 " ms  %s\n", i,
		       customers[j->customer].key, j->waited_ms,
		       j->status == KL_OK ? "done" : kl_strerror(j->status));
	}
	return NULL;
}

static size_t
waiting_for(const char *key)
{
	return kl_memory_provider_queue_size(kl_memory_provider(), key);
}

int
main(void)
{
	kl_lock_opts opts = KL_LOCK_OPTS_INIT;
	kl_lock *lock, *impatient;
	kl_call hold = { .key = "customer:2" };
	kl_lease *lease;
	struct job late = { .id = 100, .customer = 1 };
	struct job victim = { .id = 101, .customer = 1 };
	pthread_t tid[NWORKERS];
	bool ok = true;

	opts.on_event = on_event;
	opts.timeout_ms = 10000; /* a bound for the demo: never reached */
	if (kl_lock_new(&lock, &opts) != KL_OK)
		return 1;
	opts.timeout_ms = 100; /* same default provider, so same keys */
	if (kl_lock_new(&impatient, &opts) != KL_OK ||
	    kl_cancel_new(&victim.cancel) != KL_OK)
		return 1;

	printf("keylock %s: %d jobs for %d customers on %d workers\n",
	       kl_version(), NJOBS, NCUSTOMERS, NWORKERS);
	for (int i = 0; i < NJOBS; i++) {
		jobs[i].id = i;
		jobs[i].customer = job_customer[i];
		jobs[i].lock = lock;
	}
	for (int i = 0; i < NWORKERS; i++)
		pthread_create(&tid[i], NULL, worker, NULL);
	for (int i = 0; i < NWORKERS; i++)
		pthread_join(tid[i], NULL);
	printf("grant order per key (one job at a time per key; up to %d "
	       "jobs ran at once):\n",
	       atomic_load(&max_active));
	for (int k = 0; k < NCUSTOMERS; k++) {
		printf("  %s:", customers[k].key);
		for (int n = 0; n < atomic_load(&customers[k].granted); n++)
			printf(" job %d", customers[k].order[n]);
		printf("\n");
	}

	/* Hold customer:2 so that the next two jobs must wait for it. */
	if (kl_lock_acquire(lock, &hold, &lease, NULL) != KL_OK)
		return 1;
	printf("main holds %s (fence %" PRIu64 ")\n", kl_lease_key(lease),
	       kl_lease_fence(lease));

	late.lock = impatient;
	pthread_create(&tid[0], NULL, run_job, &late);
	pthread_join(tid[0], NULL);
	printf("  job with a 100 ms timeout: %s after %" PRId64 " ms (%s)\n",
	       late.status == KL_ETIMEDOUT ? "LockNotAcquired" : "unexpected",
	       late.waited_ms, late.err.message);

	victim.lock = lock;
	pthread_create(&tid[0], NULL, run_job, &victim);
	/* Fire once it waits; a token fired earlier would end it alike. */
	for (int i = 0; i < 1000 && waiting_for(hold.key) == 0; i++)
		sleep_ms(1);
	kl_cancel_fire(victim.cancel);
	pthread_join(tid[0], NULL);
	printf("  job cancelled from main while waiting: %s (%s)\n",
	       victim.status == KL_ECANCELED ? "KL_ECANCELED" : "unexpected",
	       kl_strerror(victim.status));
	kl_lease_release(lease);

	for (int i = 0; i < NJOBS; i++)
		ok &= jobs[i].status == KL_OK && jobs[i].result == i;
	ok &= atomic_load(&overlaps) == 0 && atomic_load(&ran) == NJOBS;
	ok &= late.status == KL_ETIMEDOUT && victim.status == KL_ECANCELED;
	ok &= atomic_load(&n_acquired) == NJOBS + 1; /* + main's acquire */
	ok &= atomic_load(&n_rejected) == 2;
	ok &= kl_memory_provider_size(kl_memory_provider()) == 0;
	printf("events: %d ACQUIRED, %d REJECTED; overlaps: %d; jobs run: %d\n",
	       atomic_load(&n_acquired), atomic_load(&n_rejected),
	       atomic_load(&overlaps), atomic_load(&ran));

	kl_cancel_free(victim.cancel);
	kl_lock_free(impatient);
	kl_lock_free(lock);
	printf("keyed_pool: %s\n", ok ? "OK" : "FAILED");
	return ok ? 0 : 1;
}
