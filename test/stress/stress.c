/* SPDX-License-Identifier: MIT */
/*
 * Helpers of the stress suites (see stress.h).
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include "stress.h"
#include "internal.h" /* kl__test_yield */

#include <errno.h>
#include <inttypes.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#if defined(__SANITIZE_THREAD__)
#define ST_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define ST_TSAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#define ST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define ST_ASAN 1
#endif
#endif

#define DEFAULT_STACK (256 * 1024)
#define SANITIZER_MIN_STACK (256 * 1024)

static uint64_t seed;
static bool forked = true;
/* Threads st_thread_try_start started and st_thread_join has not joined:
 * see st_fail_prepare. */
static atomic_long live_threads;
static const char *test_name = "?";
static int64_t test_start_ns;

uint64_t
st_seed(void)
{
	return seed;
}

bool
st_forked(void)
{
	return forked;
}

bool
st_tsan(void)
{
#ifdef ST_TSAN
	return true;
#else
	return false;
#endif
}

int
st_slow(void)
{
#if defined(ST_TSAN)
	return 5;
#elif defined(ST_ASAN)
	return 3;
#else
	return 1;
#endif
}

static uint64_t
splitmix64(uint64_t *x)
{
	uint64_t z = (*x += 0x9e3779b97f4a7c15ULL);

	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
	return z ^ (z >> 31);
}

/* The seed from KL_TEST_SEED, or a fresh one put into the environment so
 * that the library's debug yields use it too. */
static void
settle_seed(void)
{
	const char *s = getenv("KL_TEST_SEED");
	char buf[32];

	if (s != NULL && *s != '\0') {
		seed = strtoull(s, NULL, 0);
	} else {
		uint64_t x = (uint64_t)now_ns() ^ ((uint64_t)getpid() << 32);

		seed = splitmix64(&x) % 1000000000000ULL;
		if (seed == 0)
			seed = 1;
		snprintf(buf, sizeof buf, "%" PRIu64, seed);
		setenv("KL_TEST_SEED", buf, 1);
	}
}

int
st_run(Suite *s)
{
	SRunner *sr;
	int failed;

	settle_seed();
	sr = srunner_create(s);
	forked = srunner_fork_status(sr) != CK_NOFORK;
	fprintf(stderr,
		"stress: KL_TEST_SEED=%" PRIu64 " KL_TEST_SCALE=%g%s%s (to "
		"replay, run again with KL_TEST_SEED=%" PRIu64
		", and CK_RUN_CASE=<tcase> for one case)\n",
		seed, kl_test_scale(), st_tsan() ? " tsan" : "",
		getenv("KL_DEBUG_YIELD") != NULL ? " KL_DEBUG_YIELD set" : "",
		seed);
	srunner_run_all(sr, CK_ENV);
	failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	if (failed != 0)
		fprintf(stderr, "stress: %d test(s) failed; replay with "
				"KL_TEST_SEED=%" PRIu64 "\n",
			failed, seed);
	return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}

static bool yield_settled;

bool
st_debug_yield_on(void)
{
	if (!forked && yield_settled) {
		fprintf(stderr, "stress: CK_FORK=no: debug yields stay as "
				"the first test left them (set "
				"KL_DEBUG_YIELD=1 for the whole run)\n");
		return false;
	}
	setenv("KL_DEBUG_YIELD", "1", 1);
	return true;
}

/* Appends the test's name and seed to a failure's message. */
static void
add_seed(char *msg, size_t size)
{
	size_t len = strlen(msg);

	if (len < size)
		snprintf(msg + len, size - len,
			 " [%s; replay with KL_TEST_SEED=%" PRIu64 "]",
			 test_name, seed);
}

/* test_failing for the helpers of util.c: what st_assert does. */
static void
st_failing(const char *expr, char *msg, size_t size)
{
	add_seed(msg, size);
	st_fail_prepare(expr, msg);
}

void
st_begin(const char *name)
{
	test_name = name;
	test_failing = st_failing;
	test_start_ns = now_ns();
	fprintf(stderr, "stress: %s: start, KL_TEST_SEED=%" PRIu64
			" KL_TEST_SCALE=%g%s\n",
		name, seed, kl_test_scale(),
		getenv("KL_DEBUG_YIELD") != NULL ? " KL_DEBUG_YIELD=1" : "");
	/* The first call reads KL_DEBUG_YIELD and KL_TEST_SEED; made here,
	 * no worker thread races it. */
	kl__test_yield("st_begin");
	yield_settled = true;
}

void
st_note(const char *fmt, ...)
{
	char buf[1024];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(buf, sizeof buf, fmt, ap);
	va_end(ap);
	fprintf(stderr, "stress: %s: %s (%lld ms)\n", test_name, buf,
		(long long)((now_ns() - test_start_ns) / ST_MS));
}

long
st_scaled(long n, double factor, long min)
{
	double v = (double)n * kl_test_scale() * factor;

	if (v < (double)min)
		return min;
	if (v > 1e12)
		return 1000000000000L;
	return (long)v;
}

void
st_msg(char *buf, size_t size, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(buf, size, fmt, ap);
	va_end(ap);
	add_seed(buf, size);
}

void
st_fail_prepare(const char *expr, const char *msg)
{
	long live = atomic_load(&live_threads);

	if (forked || live == 0)
		return;
	fprintf(stderr,
		"stress: %s: %s\nstress: %ld worker thread(s) still running "
		"on this test's stack under CK_FORK=no: exiting with status "
		"2 instead of unwinding\n",
		expr, msg, live);
	fflush(NULL);
	_exit(2);
}

/* ------------------------------------------------------------------ */

void
st_rng_init(struct st_rng *r, uint64_t stream)
{
	uint64_t x = seed ^ (stream * 0xd1b54a32d192ed03ULL);

	r->s = splitmix64(&x);
	if (r->s == 0)
		r->s = 1;
}

uint64_t
st_rand(struct st_rng *r)
{
	/* xorshift64* */
	r->s ^= r->s >> 12;
	r->s ^= r->s << 25;
	r->s ^= r->s >> 27;
	return r->s * 0x2545f4914f6cdd1dULL;
}

uint64_t
st_below(struct st_rng *r, uint64_t n)
{
	return (st_rand(r) >> 11) % n;
}

void
st_shuffle(struct st_rng *r, int *v, int n)
{
	for (int i = 0; i < n; i++)
		v[i] = i;
	for (int i = n - 1; i > 0; i--) {
		int j = (int)st_below(r, (uint64_t)i + 1);
		int t = v[i];

		v[i] = v[j];
		v[j] = t;
	}
}

/* ------------------------------------------------------------------ */

void
st_wait_until_ns(int64_t t_ns)
{
	for (;;) {
		int64_t left = t_ns - now_ns();

		if (left <= 0)
			return;
		if (left > 200 * ST_US) {
			struct timespec ts = { 0, (long)(left - 150 * ST_US) };

			if (ts.tv_nsec >= 1000000000L) {
				ts.tv_sec = ts.tv_nsec / 1000000000L;
				ts.tv_nsec %= 1000000000L;
			}
			nanosleep(&ts, NULL);
		} else {
			sched_yield();
		}
	}
}

bool
st_poll(bool (*cond)(void *arg), void *arg, int64_t limit_ms)
{
	return test_poll_for(cond, arg, limit_ms);
}

struct count_cond {
	atomic_long *v;
	long n;
};

static bool
count_reached(void *arg)
{
	struct count_cond *c = arg;

	return atomic_load(c->v) >= c->n;
}

bool
st_poll_count(atomic_long *v, long n, int64_t limit_ms)
{
	struct count_cond c = { v, n };

	return st_poll(count_reached, &c, limit_ms);
}

bool
st_poll_queue(kl_mutex *m, size_t n, int64_t limit_ms)
{
	return test_poll_mutex_queue(m, n, limit_ms);
}

bool
st_poll_event_queue(kl_reset_event *e, size_t n, int64_t limit_ms)
{
	return test_poll_event_queue(e, n, limit_ms);
}

static int
cmp_i64(const void *a, const void *b)
{
	int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;

	return (x > y) - (x < y);
}

int64_t
st_percentile(int64_t *v, size_t n, double p)
{
	size_t i;

	if (n == 0)
		return 0;
	qsort(v, n, sizeof *v, cmp_i64);
	i = (size_t)((double)n * p / 100.0);
	if (i > 0 && (double)i == (double)n * p / 100.0)
		i--;
	if (i >= n)
		i = n - 1;
	return v[i];
}

/* ------------------------------------------------------------------ */

int
st_thread_try_start(pthread_t *t, size_t stack, void *(*fn)(void *arg),
		    void *arg)
{
	pthread_attr_t attr;
	int rc;

	if (stack == 0)
		stack = DEFAULT_STACK;
	if (st_slow() > 1 && stack < SANITIZER_MIN_STACK)
		stack = SANITIZER_MIN_STACK;
	if ((rc = pthread_attr_init(&attr)) != 0)
		return rc;
	rc = pthread_attr_setstacksize(&attr, stack);
	if (rc == 0)
		rc = pthread_create(t, &attr, fn, arg);
	pthread_attr_destroy(&attr);
	if (rc == 0)
		atomic_fetch_add(&live_threads, 1);
	return rc;
}

void
st_thread_start(pthread_t *t, size_t stack, void *(*fn)(void *arg),
		void *arg)
{
	int rc = st_thread_try_start(t, stack, fn, arg);

	st_assert(rc == 0, "pthread_create: %s", strerror(rc));
}

void
st_thread_join(pthread_t t)
{
	int rc = pthread_join(t, NULL);

	if (rc == 0)
		atomic_fetch_sub(&live_threads, 1);
	st_assert(rc == 0, "pthread_join: %s", strerror(rc));
}

bool
st_drain(atomic_int *exited, int n, atomic_bool *tripped,
	 kl_reset_event *const *ev, int nev)
{
	int64_t limit = now_ns() + 20000 * ST_MS * st_slow();

	while (atomic_load(exited) < n && !atomic_load(tripped)) {
		if (now_ns() > limit)
			return false;
		for (int e = 0; e < nev; e++)
			kl_reset_event_set(ev[e]);
		test_sleep_ms(1);
	}
	return true;
}

struct crew_member {
	struct st_crew *c;
	int i;
};

static void *
crew_main(void *arg)
{
	struct crew_member *me = arg;
	struct st_crew *c = me->c;
	int i = me->i;

	free(me);
	for (;;) {
		while (sem_wait(&c->go[i]) != 0 && errno == EINTR)
			;
		if (atomic_load(&c->stop))
			break;
		c->job(c, i);
		atomic_fetch_add(&c->done, 1);
	}
	return NULL;
}

void
st_crew_start(struct st_crew *c, int n, size_t stack,
	      void (*job)(struct st_crew *c, int i), void *arg)
{
	c->n = n;
	c->th = calloc((size_t)n, sizeof *c->th);
	c->go = calloc((size_t)n, sizeof *c->go);
	st_assert(c->th != NULL && c->go != NULL, "out of memory");
	atomic_init(&c->done, 0);
	atomic_init(&c->stop, false);
	c->job = job;
	c->arg = arg;
	for (int i = 0; i < n; i++)
		st_assert(sem_init(&c->go[i], 0, 0) == 0, "sem_init");
	for (int i = 0; i < n; i++) {
		struct crew_member *me = malloc(sizeof *me);

		st_assert(me != NULL, "out of memory");
		me->c = c;
		me->i = i;
		st_thread_start(&c->th[i], stack, crew_main, me);
	}
}

void
st_crew_go(struct st_crew *c, int i)
{
	sem_post(&c->go[i]);
}

void
st_crew_go_all(struct st_crew *c)
{
	for (int i = 0; i < c->n; i++)
		sem_post(&c->go[i]);
}

void
st_crew_wait(struct st_crew *c, long n, int64_t limit_ms, const char *what)
{
	bool ok = st_poll_count(&c->done, n, limit_ms);

	st_assert(ok, "%s: %ld of %ld jobs done after %lld ms", what,
		  atomic_load(&c->done), n, (long long)limit_ms);
}

void
st_crew_stop(struct st_crew *c)
{
	atomic_store(&c->stop, true);
	st_crew_go_all(c);
	for (int i = 0; i < c->n; i++)
		st_thread_join(c->th[i]);
	for (int i = 0; i < c->n; i++)
		sem_destroy(&c->go[i]);
	free(c->th);
	free(c->go);
	c->th = NULL;
	c->go = NULL;
}

/* ------------------------------------------------------------------ */

static cpu_set_t saved_affinity;
static bool affinity_saved;

int
st_pin_one_cpu(void)
{
	cpu_set_t one;
	int cpu = -1;

	if (sched_getaffinity(0, sizeof saved_affinity, &saved_affinity) != 0)
		return -1;
	for (int i = 0; i < CPU_SETSIZE; i++)
		if (CPU_ISSET(i, &saved_affinity)) {
			cpu = i;
			break;
		}
	if (cpu < 0)
		return -1;
	CPU_ZERO(&one);
	CPU_SET(cpu, &one);
	if (sched_setaffinity(0, sizeof one, &one) != 0)
		return -1;
	affinity_saved = true;
	return cpu;
}

void
st_unpin(void)
{
	if (affinity_saved)
		sched_setaffinity(0, sizeof saved_affinity, &saved_affinity);
	affinity_saved = false;
}

/* ------------------------------------------------------------------ */

int
st_child(int (*fn)(void *arg), void *arg, int64_t limit_ms)
{
	fflush(NULL);
	return st_child_quiet(fn, arg, limit_ms);
}

int
st_child_quiet(int (*fn)(void *arg), void *arg, int64_t limit_ms)
{
	int64_t limit;
	int status;
	pid_t pid, r;

	pid = fork();
	if (pid < 0)
		return -2;
	if (pid == 0)
		_exit(fn(arg));
	limit = now_ns() + limit_ms * ST_MS;
	for (;;) {
		r = waitpid(pid, &status, WNOHANG);
		if (r == pid)
			return status;
		if (r < 0 && errno != EINTR)
			return -2;
		if (now_ns() > limit) {
			kill(pid, SIGKILL);
			while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
				;
			return -1;
		}
		test_sleep_ms(2);
	}
}

void
st_describe_status(int status, char *buf, size_t size)
{
	if (status == -1)
		snprintf(buf, size, "hung (killed after its time limit)");
	else if (status < -1)
		snprintf(buf, size, "could not fork or wait: %s",
			 strerror(errno));
	else if (WIFEXITED(status))
		snprintf(buf, size, "exit %d", WEXITSTATUS(status));
	else if (WIFSIGNALED(status))
		snprintf(buf, size, "killed by signal %d (%s)",
			 WTERMSIG(status), strsignal(WTERMSIG(status)));
	else
		snprintf(buf, size, "wait status %#x", (unsigned)status);
}

long
st_rss_kib(void)
{
	FILE *f = fopen("/proc/self/statm", "r");
	long size = 0, rss = 0;

	if (f == NULL)
		return 0;
	if (fscanf(f, "%ld %ld", &size, &rss) != 2)
		rss = 0;
	fclose(f);
	return rss * (sysconf(_SC_PAGESIZE) / 1024);
}

/* ------------------------------------------------------------------ */

int
st_outcome(int rc)
{
	switch (rc) {
	case KL_OK:
		return 0;
	case KL_ETIMEDOUT:
		return 1;
	case KL_ECANCELED:
		return 2;
	case KL_EOVERFLOW:
		return 3;
	default:
		return -1;
	}
}

void
st_slot_init(struct st_slot *s)
{
	pthread_mutex_init(&s->mu, NULL);
	s->c = NULL;
}

void
st_slot_fini(struct st_slot *s)
{
	kl_cancel_free(s->c);
	s->c = NULL;
	pthread_mutex_destroy(&s->mu);
}

kl_cancel *
st_slot_token(struct st_slot *s, struct st_rng *r)
{
	kl_cancel *c;

	if (st_below(r, 2) == 0)
		return NULL;
	pthread_mutex_lock(&s->mu);
	if (s->c == NULL || kl_cancel_fired(s->c)) {
		kl_cancel_free(s->c);
		s->c = NULL;
		if (st_below(r, 4) == 0) {
			int64_t ms = 1 + (int64_t)st_below(r, 20);

			if (kl_cancel_new_timeout(&s->c, ms) != KL_OK)
				s->c = NULL;
		} else if (kl_cancel_new(&s->c) != KL_OK) {
			s->c = NULL;
		}
	}
	c = s->c;
	pthread_mutex_unlock(&s->mu);
	return c;
}

void
st_slot_fire(struct st_slot *s)
{
	pthread_mutex_lock(&s->mu);
	if (s->c != NULL)
		kl_cancel_fire(s->c);
	pthread_mutex_unlock(&s->mu);
}
