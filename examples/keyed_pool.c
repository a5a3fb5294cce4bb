/* SPDX-License-Identifier: MIT */
/*
 * keyed_pool: the keylock quickstart.  A pool of 4 worker threads processes
 * 12 jobs for 3 customers.  Every job runs under kl_lock_run() on one shared
 * kl_lock, with its customer id as the call's key, on the embedded memory
 * provider: the jobs of one customer run one at a time in arrival order while
 * different customers run in parallel.  Then, with "customer:2" held by main
 * through kl_lock_acquire(), one job gives up after a short timeout
 * (KL_ETIMEDOUT, LockNotAcquired) and another is cancelled from main with a
 * kl_cancel token (KL_ECANCELED); an on_event hook counts the grants and
 * prints the rejections.  It checks its own results and exits 0 when they
 * hold.  Uses the public API only.
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
	atomic_int in_section; /* jobs inside the lock right now: 0 or 1 */
	atomic_int granted;    /* jobs granted so far */
	int order[NJOBS];      /* job ids in grant order */
};

struct job {
	int id, customer;
	kl_lock *lock;
	kl_cancel *cancel;
	atomic_int started; /* set just before kl_lock_run() */
	int64_t start_ms, waited_ms;
	int status, result;
	kl_error err;
};

static struct customer customers[NCUSTOMERS] = {
	{ .key = "customer:1" }, { .key = "customer:2" }, { .key = "customer:3" }
};
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

/* The lock's hook: runs with no internal lock held; key is ours until it
 * returns. */
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
	int n, now;

	j->waited_ms = now_ms() - j->start_ms;
	if (atomic_fetch_add(&c->in_section, 1) != 0)
		atomic_fetch_add(&overlaps, 1);
	if ((n = atomic_fetch_add(&c->granted, 1)) < NJOBS)
		c->order[n] = j->id;
	now = atomic_fetch_add(&active, 1) + 1;
	for (int m = atomic_load(&max_active); now > m;)
		if (atomic_compare_exchange_weak(&max_active, &m, now))
			break;
	sleep_ms(20 + 10 * (j->id % 3)); /* the "work" */
	atomic_fetch_sub(&active, 1);
	atomic_fetch_sub(&c->in_section, 1);
	atomic_fetch_add(&ran, 1);
	return j->id;
}

static void
run_job(struct job *j)
{
	kl_call call = { .key = customers[j->customer].key,
			 .cancel = j->cancel };

	j->start_ms = now_ms();
	atomic_store(&j->started, 1);
	j->status = kl_lock_run(j->lock, &call, job_work, j, &j->result,
				&j->err);
}

static void *
worker(void *arg)
{
	int i;

	(void)arg;
	while ((i = atomic_fetch_add(&next_job, 1)) < NJOBS) {
		struct job *j = &jobs[i];

		run_job(j);
		printf("  job %2d  %s  waited %3" PRId64 " ms  %s\n", j->id,
		       customers[j->customer].key, j->waited_ms,
		       kl_strerror(j->status));
	}
	return NULL;
}

static void *
job_thread(void *arg)
{
	run_job(arg);
	return NULL;
}

int
main(void)
{
	kl_lock_opts opts = KL_LOCK_OPTS_INIT;
	kl_lock *lock = NULL, *impatient = NULL;
	kl_call hold = { .key = "customer:2" };
	kl_lease *lease = NULL;
	struct job late = { .id = 100, .customer = 1 };
	struct job victim = { .id = 101, .customer = 1 };
	pthread_t tid[NWORKERS];
	bool ok = true;

	opts.timeout_ms = 10000; /* nobody should ever wait this long */
	opts.on_event = on_event;
	if (kl_lock_new(&lock, &opts) != KL_OK)
		return 1;
	opts.timeout_ms = 100; /* same memory provider: same keys */
	if (kl_lock_new(&impatient, &opts) != KL_OK ||
	    kl_cancel_new(&victim.cancel) != KL_OK)
		return 1;

	printf("keylock %s: %d jobs for %d customers on %d workers\n",
	       kl_version(), NJOBS, NCUSTOMERS, NWORKERS);
	for (int i = 0; i < NJOBS; i++)
		jobs[i] = (struct job){ .id = i, .customer = i % NCUSTOMERS,
					.lock = lock };
	for (int i = 0; i < NWORKERS; i++)
		pthread_create(&tid[i], NULL, worker, NULL);
	for (int i = 0; i < NWORKERS; i++)
		pthread_join(tid[i], NULL);

	printf("grant order per key (one at a time per key, up to %d keys at "
	       "once):\n", atomic_load(&max_active));
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

	late.lock = impatient; /* gives up after 100 ms */
	pthread_create(&tid[0], NULL, job_thread, &late);
	pthread_join(tid[0], NULL);
	printf("  impatient job: %s\n", late.status == KL_ETIMEDOUT ?
	       "LockNotAcquired (KL_ETIMEDOUT)" : kl_strerror(late.status));
	printf("    %s\n", late.err.message);

	victim.lock = lock;
	pthread_create(&tid[0], NULL, job_thread, &victim);
	while (!atomic_load(&victim.started))
		sleep_ms(1);
	sleep_ms(50); /* let it queue; a token fired earlier ends it alike */
	kl_cancel_fire(victim.cancel);
	pthread_join(tid[0], NULL);
	printf("  cancelled job: %s\n", victim.status == KL_ECANCELED ?
	       "KL_ECANCELED" : kl_strerror(victim.status));
	kl_lease_release(lease);

	/* Check the results. */
	for (int i = 0; i < NJOBS; i++)
		ok &= jobs[i].status == KL_OK && jobs[i].result == i;
	ok &= atomic_load(&overlaps) == 0 && atomic_load(&ran) == NJOBS;
	ok &= late.status == KL_ETIMEDOUT && victim.status == KL_ECANCELED;
	ok &= atomic_load(&n_acquired) == NJOBS + 1;
	ok &= atomic_load(&n_rejected) == 2;
	ok &= kl_memory_provider_size(kl_memory_provider()) == 0;
	printf("events: %d ACQUIRED, %d REJECTED; overlaps %d; jobs run %d\n",
	       atomic_load(&n_acquired), atomic_load(&n_rejected),
	       atomic_load(&overlaps), atomic_load(&ran));

	kl_cancel_free(victim.cancel);
	kl_lock_free(impatient);
	kl_lock_free(lock);
	printf("keyed_pool: %s\n", ok ? "OK" : "FAILED");
	return ok ? 0 : 1;
}
