/* SPDX-License-Identifier: MIT */
/*
 * Helpers shared by the Check suites (see util.h).  The waiter threads never
 * call ck_assert*: they only store their results under the group's mutex,
 * which the test's thread takes to read them before asserting.  Lock order:
 * the group's mutex is never held while calling into the library, except
 * for the non-blocking kl_mutex_queue_size and friends.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include "internal.h"
#include "util.h"

#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <inttypes.h>
#include <limits.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <spawn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#if defined(__linux__)
#include <sys/prctl.h>
#endif
#include <time.h>
#include <unistd.h>

extern char **environ;

#define TEST_STACK_SIZE (512 * 1024)

int
test_run_suite(Suite *s)
{
	SRunner *sr = srunner_create(s);
	int failed;

	srunner_run_all(sr, CK_ENV);
	failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}

TCase *
test_tcase(Suite *s, const char *name, double timeout, void (*setup)(void),
	   void (*teardown)(void))
{
	TCase *tc = tcase_create(name);

	tcase_set_timeout(tc, timeout);
	if (setup != NULL || teardown != NULL)
		tcase_add_checked_fixture(tc, setup, teardown);
	suite_add_tcase(s, tc);
	return tc;
}

void
test_provider_dir(void)
{
	const char *top = getenv("top_builddir");
	char dir[PATH_MAX];

	if (getenv("KEYLOCK_PROVIDER_DIR") == NULL && top != NULL) {
		snprintf(dir, sizeof dir, "%s/src/.libs", top);
		setenv("KEYLOCK_PROVIDER_DIR", dir, 1);
	}
}

double
kl_test_scale(void)
{
	const char *s = getenv("KL_TEST_SCALE");
	char *end;
	double v;

	if (s == NULL || *s == '\0')
		return 1.0;
	v = strtod(s, &end);
	if (end == s || *end != '\0' || !(v > 0.0))
		return 1.0;
	return v;
}

long
kl_test_scaled(long n, long min)
{
	double v = (double)n * kl_test_scale();

	if (v < (double)min)
		return min;
	if (v > 1e12)
		return 1000000000000L;
	return (long)v;
}

int64_t
now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

int64_t
now_ms(void)
{
	return now_ns() / 1000000;
}

static int
remove_entry(const char *path, const struct stat *sb, int flag,
	     struct FTW *ftw)
{
	(void)sb;
	(void)flag;
	(void)ftw;
	return remove(path);
}

int
test_remove_tree(const char *path)
{
	return nftw(path, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
}

void
test_sleep_ms(int64_t ms)
{
	struct timespec ts = {
		.tv_sec = ms / 1000,
		.tv_nsec = (long)(ms % 1000) * 1000000,
	};

	while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
		;
}

void
test_relax(unsigned *spins)
{
	struct timespec ts = { .tv_sec = 0, .tv_nsec = 50000 };

	if (++*spins < 64)
		sched_yield();
	else
		nanosleep(&ts, NULL);
}

bool
test_poll_for(bool (*cond)(void *arg), void *arg, int64_t limit_ms)
{
	int64_t limit = now_ns() + limit_ms * 1000000;
	unsigned spins = 0;

	while (!cond(arg)) {
		if (now_ns() > limit)
			return cond(arg);
		test_relax(&spins);
	}
	return true;
}

void
test_poll(bool (*cond)(void *arg), void *arg, const char *what)
{
	if (!test_poll_for(cond, arg, TEST_POLL_LIMIT_MS))
		ck_abort_msg("still waiting for %s after %d ms", what,
			     TEST_POLL_LIMIT_MS);
}

void
test_thread_start(pthread_t *t, void *(*fn)(void *arg), void *arg)
{
	pthread_attr_t attr;
	int rc;

	ck_assert_int_eq(pthread_attr_init(&attr), 0);
	ck_assert_int_eq(pthread_attr_setstacksize(&attr, TEST_STACK_SIZE), 0);
	rc = pthread_create(t, &attr, fn, arg);
	pthread_attr_destroy(&attr);
	ck_assert_msg(rc == 0, "pthread_create: %s", strerror(rc));
}

void
test_thread_join(pthread_t t)
{
	int rc = pthread_join(t, NULL);

	ck_assert_msg(rc == 0, "pthread_join: %s", strerror(rc));
}

static void *
bg_main(void *arg)
{
	struct test_bg *b = arg;

	b->fn(b->arg);
	atomic_store(&b->done, true);
	return NULL;
}

static bool
bg_done(void *arg)
{
	return atomic_load(&((struct test_bg *)arg)->done);
}

void
test_bg_start(struct test_bg *b, void (*fn)(void *arg), void *arg)
{
	b->fn = fn;
	b->arg = arg;
	atomic_init(&b->done, false);
	test_thread_start(&b->th, bg_main, b);
}

void
test_bg_join(struct test_bg *b, const char *what)
{
	test_poll(bg_done, b, what);
	test_thread_join(b->th);
}

void
test_run_bounded(void (*fn)(void *arg), void *arg, const char *what)
{
	/* Leaked when the test fails: the thread may still use it. */
	struct test_bg *b = calloc(1, sizeof *b);

	ck_assert_ptr_nonnull(b);
	test_bg_start(b, fn, arg);
	test_bg_join(b, what);
	free(b);
}

void
tev_init(struct test_events *e)
{
	memset(e, 0, sizeof *e);
	pthread_mutex_init(&e->mu, NULL);
}

void
tev_record(const kl_event *ev, void *arg)
{
	struct test_events *e = arg;

	pthread_mutex_lock(&e->mu);
	if (ev->type <= KL_EV_LOST) {
		e->n[ev->type]++;
		e->status_of[ev->type] = ev->status;
	}
	if (ev->type == KL_EV_LOST && e->lost_ns == 0)
		e->lost_ns = now_ns();
	e->last_status = ev->status;
	pthread_mutex_unlock(&e->mu);
}

int
tev_count(struct test_events *e, kl_event_type t)
{
	int n;

	pthread_mutex_lock(&e->mu);
	n = e->n[t];
	pthread_mutex_unlock(&e->mu);
	return n;
}

int
tev_wait(struct test_events *e, kl_event_type t, int64_t limit_ms)
{
	int64_t limit = now_ms() + limit_ms;

	while (tev_count(e, t) == 0 && now_ms() < limit)
		test_sleep_ms(2);
	return tev_count(e, t);
}

struct queue_cond {
	kl_mutex *m;
	kl_reset_event *e;
	size_t n;
};

static bool
queue_is(void *arg)
{
	struct queue_cond *c = arg;
	size_t len = c->m != NULL ? kl_mutex_queue_size(c->m)
				  : kl_reset_event_queue_size(c->e);

	return len == c->n;
}

bool
test_poll_mutex_queue(kl_mutex *m, size_t n, int64_t limit_ms)
{
	struct queue_cond c = { .m = m, .n = n };

	return test_poll_for(queue_is, &c, limit_ms);
}

bool
test_poll_event_queue(kl_reset_event *e, size_t n, int64_t limit_ms)
{
	struct queue_cond c = { .e = e, .n = n };

	return test_poll_for(queue_is, &c, limit_ms);
}

void
test_wait_mutex_queue(kl_mutex *m, size_t n)
{
	ck_assert_msg(test_poll_mutex_queue(m, n, TEST_POLL_LIMIT_MS),
		      "still waiting for the mutex queue size after %d ms",
		      TEST_POLL_LIMIT_MS);
	ck_assert_uint_eq(kl_mutex_queue_size(m), n);
}

#ifdef KL_TEST_HOOKS /* the provider suites link the installed library */
static bool
parked_at_least(void *arg)
{
	return kl__test_parked() >= *(const long *)arg;
}

long
test_parked(void)
{
	return kl__test_parked();
}

void
test_wait_parked(long n)
{
	test_poll(parked_at_least, &n, "waiters to park");
}

long
test_prods(void)
{
	return kl__test_prods();
}

void
test_crowd(int how)
{
	kl__test_crowd(how);
}

void
test_asks_again_ns(int64_t ns)
{
	kl__test_asks_again_ns(ns);
}

void
test_behind_ns(int64_t ns)
{
	kl__test_behind_ns(ns);
}

void
test_neighbours(int how)
{
	kl__test_neighbours(how);
}

long
test_behind(void)
{
	return kl__test_behind();
}

long
test_headed(void)
{
	return kl__test_headed();
}

long
test_kept(void)
{
	return kl__test_kept();
}

void
test_head_spin_ns(int64_t ns)
{
	kl__test_head_spin_ns(ns);
}

long
test_spins_skipped(void)
{
	return kl__test_spins_skipped();
}

void
test_spin_reset(void)
{
	kl__test_crowd(-1);
	kl__test_asks_again_ns(-1);
	kl__test_behind_ns(-1);
	kl__test_head_spin_ns(-1);
	kl__test_neighbours(0);
}
#endif

void
test_wait_event_queue(kl_reset_event *e, size_t n)
{
	ck_assert_msg(test_poll_event_queue(e, n, TEST_POLL_LIMIT_MS),
		      "still waiting for the reset event queue size after "
		      "%d ms",
		      TEST_POLL_LIMIT_MS);
	ck_assert_uint_eq(kl_reset_event_queue_size(e), n);
}

/* ------------------------------------------------------------------ */
/* Waiter groups                                                       */

static struct tw_group *
tw_new(enum tw_kind kind)
{
	struct tw_group *g = calloc(1, sizeof *g);

	ck_assert_ptr_nonnull(g);
	g->kind = kind;
	atomic_init(&g->next_seq, 0);
	ck_assert_int_eq(pthread_mutex_init(&g->mu, NULL), 0);
	for (int i = 0; i < TW_MAX; i++)
		g->order[i] = -1;
	return g;
}

struct tw_group *
tw_mutex(kl_mutex *m, bool leave)
{
	struct tw_group *g = tw_new(TW_MUTEX);

	g->m = m;
	g->leave = leave;
	return g;
}

struct tw_group *
tw_event(kl_reset_event *e)
{
	struct tw_group *g = tw_new(TW_EVENT);

	g->e = e;
	return g;
}

void
tw_free(struct tw_group *g)
{
	if (g == NULL)
		return;
	tw_join_all(g);
	pthread_mutex_destroy(&g->mu);
	free(g);
}

/*
 * Records the outcome of the call.  On a grant the sequence number is taken
 * here, inside the critical section for a mutex, so it is the true grant
 * order there (for an event it only counts).
 */
static void
record(struct tw_waiter *w, int rc, kl_token tok, int64_t end_ns)
{
	struct tw_group *g = w->g;

	pthread_mutex_lock(&g->mu);
	w->end_ns = end_ns;
	w->status = rc;
	w->token = tok;
	if (rc == KL_OK) {
		long seq = atomic_fetch_add(&g->next_seq, 1);

		w->seq = seq;
		if (seq >= 0 && seq < TW_MAX)
			g->order[seq] = w->index;
		g->granted++;
	}
	pthread_mutex_unlock(&g->mu);
}

static void *
tw_main(void *arg)
{
	struct tw_waiter *w = arg;
	struct tw_group *g = w->g;
	int leave_status = 1;
	kl_token tok;
	int rc;

	memset(&tok, 0, sizeof tok);
	w->start_ns = now_ns();
	if (g->kind == TW_MUTEX)
		rc = kl_mutex_enter(g->m, w->timeout_ms, w->cancel, &tok);
	else
		rc = kl_reset_event_wait(g->e, w->timeout_ms, w->cancel);
	record(w, rc, tok, now_ns());
	if (rc == KL_OK && g->kind == TW_MUTEX && g->leave)
		leave_status = kl_mutex_leave(g->m, tok, false);

	pthread_mutex_lock(&g->mu);
	w->leave_status = leave_status;
	w->finished = true;
	g->finished++;
	pthread_mutex_unlock(&g->mu);
	return NULL;
}

int
tw_start(struct tw_group *g, int64_t timeout_ms, kl_cancel *c)
{
	struct tw_waiter *w;

	ck_assert_int_lt(g->n, TW_MAX);
	w = &g->w[g->n];
	w->g = g;
	w->index = g->n;
	w->timeout_ms = timeout_ms;
	w->cancel = c;
	w->joined = false;
	w->status = 1; /* no KL_* value: "never returned" */
	w->seq = -1;
	w->leave_status = 1;
	w->finished = false;
	test_thread_start(&w->thread, tw_main, w);
	return g->n++;
}

static size_t
tw_queue_size(struct tw_group *g)
{
	return g->kind == TW_MUTEX ? kl_mutex_queue_size(g->m)
				   : kl_reset_event_queue_size(g->e);
}

int
tw_start_queued(struct tw_group *g, int64_t timeout_ms, kl_cancel *c)
{
	size_t base = tw_queue_size(g);
	int i = tw_start(g, timeout_ms, c);

	tw_wait_queue(g, base + 1);
	return i;
}

void
tw_start_n_queued(struct tw_group *g, int n, int64_t timeout_ms,
		  kl_cancel *c)
{
	for (int i = 0; i < n; i++)
		tw_start_queued(g, timeout_ms, c);
}

void
tw_wait_queue(struct tw_group *g, size_t n)
{
	if (g->kind == TW_MUTEX)
		test_wait_mutex_queue(g->m, n);
	else
		test_wait_event_queue(g->e, n);
}

bool
tw_finished(struct tw_group *g, int i)
{
	bool done;

	pthread_mutex_lock(&g->mu);
	done = g->w[i].finished;
	pthread_mutex_unlock(&g->mu);
	return done;
}

int
tw_granted(struct tw_group *g)
{
	int n;

	pthread_mutex_lock(&g->mu);
	n = g->granted;
	pthread_mutex_unlock(&g->mu);
	return n;
}

struct count_cond {
	struct tw_group *g;
	int n;
};

static bool
count_reached(void *arg)
{
	struct count_cond *c = arg;

	return tw_granted(c->g) >= c->n;
}

void
tw_wait_granted(struct tw_group *g, int n)
{
	struct count_cond c = { .g = g, .n = n };

	test_poll(count_reached, &c, "waiters to be granted");
}

static bool
waiter_finished(void *arg)
{
	struct tw_waiter *w = arg;

	return tw_finished(w->g, w->index);
}

void
tw_wait_finished(struct tw_group *g, int i)
{
	ck_assert_int_lt(i, g->n);
	test_poll(waiter_finished, &g->w[i], "a waiter to finish");
}

void
tw_join(struct tw_group *g, int i)
{
	ck_assert_int_lt(i, g->n);
	if (g->w[i].joined)
		return;
	/* A bounded wait first, so a lost wake-up fails instead of hanging. */
	tw_wait_finished(g, i);
	test_thread_join(g->w[i].thread);
	g->w[i].joined = true;
}

void
tw_join_all(struct tw_group *g)
{
	for (int i = 0; i < g->n; i++)
		tw_join(g, i);
}

struct order_cond {
	struct tw_group *g;
	int seq;
};

static bool
order_known(void *arg)
{
	struct order_cond *c = arg;
	bool known;

	pthread_mutex_lock(&c->g->mu);
	known = c->g->order[c->seq] >= 0;
	pthread_mutex_unlock(&c->g->mu);
	return known;
}

int
tw_pass(struct tw_group *g)
{
	struct order_cond c = { .g = g, .seq = g->passed };
	kl_token tok;
	int i, st;

	ck_assert(g->kind == TW_MUTEX && !g->leave);
	ck_assert_int_lt(g->passed, TW_MAX);
	test_poll(order_known, &c, "the next grant");
	pthread_mutex_lock(&g->mu);
	i = g->order[g->passed];
	st = g->w[i].status;
	tok = g->w[i].token;
	pthread_mutex_unlock(&g->mu);
	ck_assert_int_eq(st, KL_OK);
	ck_assert_int_eq(kl_mutex_leave(g->m, tok, false), KL_OK);
	g->passed++;
	return i;
}

int64_t
tw_waited_ns(const struct tw_group *g, int i)
{
	return g->w[i].end_ns - g->w[i].start_ns;
}

/* ------------------------------------------------------------------ */
/* Provider status                                                     */

kl_provider *
test_provider_open(const char *uri)
{
	kl_provider *p = NULL;
	kl_error err;
	int rc;

	memset(&err, 0, sizeof err);
	rc = kl_provider_open(&p, uri, &err);
	ck_assert_msg(rc == KL_OK, "kl_provider_open(%s): %s: %s", uri,
		      kl_strerror(rc), err.message);
	ck_assert_ptr_nonnull(p);
	return p;
}

void
test_status_of(kl_provider *p, const char *key, size_t *holders,
	       size_t *waiters)
{
	kl_error err;
	int rc;

	memset(&err, 0, sizeof err);
	rc = kl_provider_status(p, key, holders, waiters, &err);
	ck_assert_msg(rc == KL_OK, "kl_provider_status: %s: %s",
		      kl_strerror(rc), err.message);
}

void
test_assert_status(kl_provider *p, const char *key, size_t holders,
		   size_t waiters)
{
	size_t h, w;

	test_status_of(p, key, &h, &w);
	ck_assert_msg(h == holders && w == waiters,
		      "key '%s': %zu holders and %zu waiters, expected %zu "
		      "and %zu",
		      key, h, w, holders, waiters);
}

void
test_wait_status(kl_provider *p, const char *key, size_t holders,
		 size_t waiters, int64_t limit_ms)
{
	int64_t limit = now_ms() + limit_ms;
	size_t last_h = SIZE_MAX, last_w = SIZE_MAX;
	unsigned spins = 0;
	size_t h, w;

	for (;;) {
		test_status_of(p, key, &h, &w);
		if (h == holders && w == waiters)
			return;
		if (h != last_h || w != last_w) {
			last_h = h;
			last_w = w;
			limit = now_ms() + limit_ms;
		}
		if (now_ms() > limit)
			ck_abort_msg("key '%s': still %zu holders and %zu "
				     "waiters after %" PRId64 " ms, expected "
				     "%zu and %zu",
				     key, h, w, limit_ms, holders, waiters);
		test_relax(&spins);
	}
}

/* ------------------------------------------------------------------ */
/* Helper processes                                                    */

#define TEST_MAX_HELPERS 16
#define TEST_MAX_HELPER_ARGS 14

static pid_t live_helpers[TEST_MAX_HELPERS];

void
test_live_add(pid_t pid)
{
	for (int i = 0; i < TEST_MAX_HELPERS; i++) {
		if (live_helpers[i] == 0) {
			live_helpers[i] = pid;
			return;
		}
	}
	kill(pid, SIGKILL);
	waitpid(pid, NULL, 0);
	ck_abort_msg("too many helper processes");
}

void
test_live_remove(pid_t pid)
{
	for (int i = 0; i < TEST_MAX_HELPERS; i++)
		if (live_helpers[i] == pid)
			live_helpers[i] = 0;
}

void
test_helpers_kill(void)
{
	for (int i = 0; i < TEST_MAX_HELPERS; i++) {
		if (live_helpers[i] > 0) {
			kill(live_helpers[i], SIGKILL);
			waitpid(live_helpers[i], NULL, 0);
			live_helpers[i] = 0;
		}
	}
}

const char *
test_helper_path(const char *dir, const char *name, bool beside_self)
{
	static char path[PATH_MAX];
	char self[PATH_MAX], *slash;
	const char *top = getenv("top_builddir");
	ssize_t n;
	int len;

	if (beside_self) {
		n = readlink("/proc/self/exe", self, sizeof self - 1);
		if (n > 0) {
			self[n] = '\0';
			if ((slash = strrchr(self, '/')) != NULL) {
				*slash = '\0';
				len = snprintf(path, sizeof path, "%s/%s",
					       self, name);
				if (len > 0 && (size_t)len < sizeof path &&
				    access(path, X_OK) == 0)
					return path;
			}
		}
	}
	len = snprintf(path, sizeof path, "%s/%s/%s",
		       top != NULL ? top : ".", dir, name);
	ck_assert(len > 0 && (size_t)len < sizeof path);
	return path;
}

void
test_helper_spawn(struct test_helper *h, const char *path,
		  const char *const *args, char *const *envp)
{
	posix_spawn_file_actions_t fa;
	char *argv[TEST_MAX_HELPER_ARGS + 2];
	const char *base = strrchr(path, '/');
	int in[2], out[2], rc, n = 0;

	argv[n++] = (char *)(base != NULL ? base + 1 : path);
	while (args[n - 1] != NULL) {
		ck_assert_int_le(n, TEST_MAX_HELPER_ARGS);
		argv[n] = (char *)args[n - 1];
		n++;
	}
	argv[n] = NULL;
	/* Close-on-exec, so that no other helper inherits these ends. */
	ck_assert_int_eq(pipe2(in, O_CLOEXEC), 0);
	ck_assert_int_eq(pipe2(out, O_CLOEXEC), 0);
	ck_assert_int_eq(posix_spawn_file_actions_init(&fa), 0);
	ck_assert_int_eq(posix_spawn_file_actions_adddup2(&fa, in[0], 0), 0);
	ck_assert_int_eq(posix_spawn_file_actions_adddup2(&fa, out[1], 1), 0);
	rc = posix_spawn(&h->pid, path, &fa, NULL, argv,
			 envp != NULL ? envp : environ);
	posix_spawn_file_actions_destroy(&fa);
	close(in[0]);
	close(out[1]);
	if (rc != 0) {
		close(in[1]);
		close(out[0]);
		ck_abort_msg("posix_spawn %s: %s", path, strerror(rc));
	}
	test_live_add(h->pid);
	h->to = in[1];
	h->from = out[0];
}

bool
test_helper_line(struct test_helper *h, char *buf, size_t size,
		 int64_t limit_ms)
{
	int64_t limit = now_ms() + limit_ms;
	struct pollfd pfd = { .fd = h->from, .events = POLLIN };
	size_t n = 0;
	ssize_t r;
	char c;

	for (;;) {
		int64_t left = limit - now_ms();

		ck_assert_msg(left > 0,
			      "no line from helper %d after %" PRId64 " ms",
			      (int)h->pid, limit_ms);
		if (poll(&pfd, 1, (int)left) <= 0)
			continue;
		r = read(h->from, &c, 1);
		if (r < 0 && errno == EINTR)
			continue;
		ck_assert_msg(r >= 0, "read from helper: %s", strerror(errno));
		if (r == 0) {
			buf[n] = '\0';
			return false;
		}
		if (c == '\n')
			break;
		if (n + 1 < size)
			buf[n++] = c;
	}
	buf[n] = '\0';
	return true;
}

uint64_t
test_helper_granted(struct test_helper *h, int64_t limit_ms)
{
	char line[300];
	uint64_t fence = 0;

	ck_assert_msg(test_helper_line(h, line, sizeof line, limit_ms),
		      "helper %d ended without a grant", (int)h->pid);
	ck_assert_msg(sscanf(line, "G %" SCNu64, &fence) == 1,
		      "helper %d: %s", (int)h->pid, line);
	return fence;
}

int
test_helper_reap(struct test_helper *h, int64_t limit_ms)
{
	int64_t limit = now_ms() + limit_ms;
	unsigned spins = 0;
	int status = 0;
	pid_t r;

	while ((r = waitpid(h->pid, &status, WNOHANG)) == 0) {
		if (now_ms() > limit)
			ck_abort_msg("helper %d still running after %" PRId64
				     " ms",
				     (int)h->pid, limit_ms);
		test_relax(&spins);
	}
	ck_assert_msg(r == h->pid, "waitpid: %s", strerror(errno));
	test_live_remove(h->pid);
	return status;
}

void
test_helper_kill(struct test_helper *h)
{
	int status = 0;

	ck_assert_int_eq(kill(h->pid, SIGKILL), 0);
	ck_assert_int_eq(waitpid(h->pid, &status, 0), h->pid);
	test_live_remove(h->pid);
	ck_assert(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
}

void
test_helper_close(struct test_helper *h)
{
	close(h->to);
	close(h->from);
	h->to = h->from = -1;
}

/* ------------------------------------------------------------------ */
/* Servers of a suite's own                                            */

int
test_free_port(void)
{
	FILE *f = fopen("/proc/sys/net/ipv4/ip_local_port_range", "r");
	int low = 32768, high = 60999, lo, span;

	if (f != NULL) {
		if (fscanf(f, "%d %d", &low, &high) != 2) {
			low = 32768;
			high = 60999;
		}
		fclose(f);
	}
	if (low >= 21000) {
		lo = 20000; /* below the range */
		span = low - lo;
	} else {
		lo = high + 1; /* above it */
		span = 65000 - lo;
	}
	if (span < 100)
		return -1;
	for (int i = 0; i < 200; i++) {
		struct sockaddr_in a = { .sin_family = AF_INET };
		int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
		int port = lo + (int)(random() % span);
		bool ok;

		if (fd < 0)
			return -1;
		a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
		a.sin_port = htons((uint16_t)port);
		ok = bind(fd, (struct sockaddr *)&a, sizeof a) == 0;
		close(fd);
		if (ok)
			return port;
	}
	return -1;
}

pid_t
test_server_spawn(char *const *argv, bool (*ready)(void *arg), void *arg,
		  int64_t limit_ms)
{
	int64_t limit;
	pid_t pid;

	pid = fork();
	if (pid < 0)
		return -1;
	if (pid == 0) {
		/* Only async-signal-safe calls until exec. */
		int nul = open("/dev/null", O_RDWR);
		sigset_t none;

		sigemptyset(&none);
		sigprocmask(SIG_SETMASK, &none, NULL);
#if defined(__linux__)
		prctl(PR_SET_PDEATHSIG, SIGKILL);
#endif
		if (nul >= 0) {
			dup2(nul, 0);
			dup2(nul, 1);
			dup2(nul, 2);
		}
		execv(argv[0], argv);
		_exit(127);
	}
	limit = now_ms() + limit_ms;
	while (now_ms() < limit) {
		if (ready(arg))
			return pid;
		if (waitpid(pid, NULL, WNOHANG) == pid)
			return -1;
		test_sleep_ms(10);
	}
	kill(pid, SIGKILL);
	waitpid(pid, NULL, 0);
	return -1;
}

/* ------------------------------------------------------------------ */
/* A user provider                                                     */

static int
test_up_acquire(void *impl, const char *key, size_t key_len,
		kl_cancel *cancel, int64_t timeout_ms, int64_t ttl_ms,
		unsigned flags, void **lease, uint64_t *fence, kl_error *err)
{
	struct test_up *u = impl;
	int rc = KL_OK;

	pthread_mutex_lock(&u->mu);
	u->acquires++;
	u->key_len = key_len;
	snprintf(u->key, sizeof u->key, "%.*s", (int)key_len, key);
	u->cancel = cancel;
	u->timeout_ms = timeout_ms;
	u->ttl_ms = ttl_ms;
	u->flags = flags;
	if (u->acquire_status != KL_OK) {
		rc = u->acquire_status;
		if (err != NULL) {
			err->status = rc;
			snprintf(err->message, sizeof err->message,
				 "up: server on fire");
		}
	} else if (u->held && timeout_ms == 0) {
		rc = KL_ETIMEDOUT;
	} else {
		while (u->held)
			pthread_cond_wait(&u->cv, &u->mu);
		u->held = true;
		*lease = &u->lease_cookie;
		*fence = ++u->fence;
	}
	pthread_mutex_unlock(&u->mu);
	return rc;
}

static int
test_up_release(void *impl, void *lease, kl_error *err)
{
	struct test_up *u = impl;
	int rc;

	pthread_mutex_lock(&u->mu);
	u->releases++;
	u->released_lease = lease;
	u->held = false;
	pthread_cond_broadcast(&u->cv);
	rc = u->release_status;
	pthread_mutex_unlock(&u->mu);
	if (rc != KL_OK && err != NULL) {
		err->status = rc;
		snprintf(err->message, sizeof err->message, "up: lost it");
	}
	return rc;
}

static bool
test_up_valid(void *impl, void *lease)
{
	struct test_up *u = impl;
	bool v;

	(void)lease;
	pthread_mutex_lock(&u->mu);
	v = u->valid;
	pthread_mutex_unlock(&u->mu);
	return v;
}

static void
test_up_destroy(void *impl)
{
	struct test_up *u = impl;

	pthread_mutex_lock(&u->mu);
	u->destroys++;
	pthread_mutex_unlock(&u->mu);
}

const kl_provider_ops test_up_ops = {
	.struct_size = sizeof(kl_provider_ops),
	.name = "up",
	.acquire = test_up_acquire,
	.release = test_up_release,
	.valid = test_up_valid,
	.destroy = test_up_destroy,
};

void
test_up_init(struct test_up *u, uint64_t fence)
{
	memset(u, 0, sizeof *u);
	pthread_mutex_init(&u->mu, NULL);
	pthread_cond_init(&u->cv, NULL);
	u->valid = true;
	u->fence = fence;
}

void
test_up_set_valid(struct test_up *u, bool valid)
{
	pthread_mutex_lock(&u->mu);
	u->valid = valid;
	pthread_mutex_unlock(&u->mu);
}

void
test_up_fini(struct test_up *u)
{
	pthread_cond_destroy(&u->cv);
	pthread_mutex_destroy(&u->mu);
}

kl_provider *
test_up_provider(struct test_up *u, const kl_provider_ops *ops)
{
	kl_provider *p = NULL;

	ck_assert_int_eq(kl_provider_new(&p, ops, u), KL_OK);
	ck_assert_ptr_nonnull(p);
	return p;
}

/* ------------------------------------------------------------------ */
/* Failures                                                            */

void (*test_failing)(const char *expr, char *msg, size_t size);

#ifdef KL_TEST_HOOKS /* only the sweeps use it */
/* ck_assert_msg that lets test_failing see the message first. */
#define test_check(expr, ...)                                          \
	do {                                                           \
		if (!(expr))                                           \
			test_fail(#expr, __VA_ARGS__);                 \
	} while (0)

static void __attribute__((format(printf, 2, 3)))
test_fail(const char *expr, const char *fmt, ...)
{
	char msg[768];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(msg, sizeof msg, fmt, ap);
	va_end(ap);
	if (test_failing != NULL)
		test_failing(expr, msg, sizeof msg);
	ck_abort_msg("%s: %s", expr, msg);
}

/* ------------------------------------------------------------------ */
/* Allocation-failure sweeps                                           */

/* One run of s on a fresh context, with the k-th allocation failing (0:
 * none); stores the allocations it made. */
static int
oom_run(const struct oom_scenario *s, struct oom_ctx *x, size_t ctx_size,
	long k, long *allocs)
{
	int rc;

	memset(x, 0, ctx_size);
	if (s->setup != NULL)
		s->setup(x);
	kl__test_fail_alloc_at(k);
	rc = s->run(x);
	*allocs = kl__test_fail_alloc_at(0);
	return rc;
}

void
test_oom_sweep(const struct oom_scenario *s, size_t ctx_size, long max_k,
	       long *allocs, long *failures)
{
	struct oom_ctx *x = calloc(1, ctx_size);
	long k, n = 0, unused;
	int rc, first;

	ck_assert_ptr_nonnull(x);
	*failures = 0;
	if (s->no_alloc) {
		rc = oom_run(s, x, ctx_size, 1, &n);
		test_check(rc == KL_OK,
			   "%s: %s with the first allocation failing",
			   s->name, kl_strerror(rc));
		test_check(n == 0, "%s: %ld allocations, none expected",
			   s->name, n);
		s->teardown(x);
		free(x);
		*allocs = 0;
		return;
	}
	for (k = 1; k <= max_k; k++) {
		rc = first = oom_run(s, x, ctx_size, k, &n);
		test_check(rc == KL_OK || rc == KL_ENOMEM, "%s, k=%ld: %s",
			   s->name, k, kl_strerror(rc));
		if (rc == KL_ENOMEM) {
			test_check(n >= k,
				   "%s, k=%ld: KL_ENOMEM after %ld "
				   "allocations, none failed",
				   s->name, k, n);
			(*failures)++;
			if (s->check_failed != NULL)
				s->check_failed(x);
		}
		s->teardown(x);

		/* The same again with no failure succeeds. */
		rc = oom_run(s, x, ctx_size, 0, &unused);
		test_check(rc == KL_OK, "%s, k=%ld: the repeat gave %s",
			   s->name, k, kl_strerror(rc));
		s->teardown(x);

		if (first == KL_OK && n < k)
			break;
	}
	free(x);
	test_check(k <= max_k, "%s: no success within %ld allocations",
		   s->name, max_k);
	/* Not vacuous: every scenario allocates, so at least k = 1 failed. */
	test_check(*failures > 0, "%s: no allocation was ever failed",
		   s->name);
	*allocs = n;
}
#endif

/* ------------------------------------------------------------------ */
/* Key sets from several clients                                      */

kl_lock *
test_set_lock(kl_provider *p, int64_t timeout_ms, unsigned flags,
	      struct test_events *ev)
{
	kl_lock_opts o = KL_LOCK_OPTS_INIT;
	kl_lock *l = NULL;

	tev_init(ev);
	o.provider = p;
	o.timeout_ms = timeout_ms;
	o.flags = flags;
	o.on_event = tev_record;
	o.event_arg = ev;
	ck_assert_int_eq(kl_lock_new(&l, &o), KL_OK);
	return l;
}

struct set_client {
	kl_provider *p;
	const char *keys[3];
	long rounds;
	atomic_int *inside;
	atomic_int *overlaps;
	long *count; /* plain: the sets must exclude each other */
	pthread_t t;
	int rc; /* outputs, read after join */
	long done;
	char message[256];
};

static int
set_count(kl_lease *lease, void *arg)
{
	struct set_client *w = arg;

	(void)lease;
	if (atomic_fetch_add(w->inside, 1) != 0)
		atomic_fetch_add(w->overlaps, 1);
	(*w->count)++;
	sched_yield();
	atomic_fetch_sub(w->inside, 1);
	return 0;
}

static void *
set_client_main(void *arg)
{
	struct set_client *w = arg;
	struct test_events ev;
	kl_lock *l = test_set_lock(w->p, 20000, 0, &ev);
	kl_error err;

	memset(&err, 0, sizeof err);
	w->rc = KL_OK;
	for (w->done = 0; w->done < w->rounds; w->done++) {
		w->rc = kl_lock_run_many(l, w->keys, 3, NULL, set_count, w,
					 NULL, &err);
		if (w->rc != KL_OK)
			break;
	}
	memcpy(w->message, err.message, sizeof w->message);
	kl_lock_free(l);
	return NULL;
}

void
test_sets_in_orders(kl_provider *const *p, int n, const char *const keys[3],
		    long rounds)
{
	static const int order[4][3] = {
		{ 0, 1, 2 }, { 2, 1, 0 }, { 1, 2, 0 }, { 0, 2, 1 },
	};
	struct set_client w[4];
	atomic_int inside = 0, overlaps = 0;
	long count = 0;

	ck_assert(n > 0 && n <= 4);
	for (int i = 0; i < n; i++) {
		memset(&w[i], 0, sizeof w[i]);
		w[i].p = p[i];
		for (int k = 0; k < 3; k++)
			w[i].keys[k] = keys[order[i][k]];
		w[i].rounds = rounds;
		w[i].inside = &inside;
		w[i].overlaps = &overlaps;
		w[i].count = &count;
	}
	for (int i = 0; i < n; i++)
		test_thread_start(&w[i].t, set_client_main, &w[i]);
	for (int i = 0; i < n; i++)
		test_thread_join(w[i].t);
	for (int i = 0; i < n; i++)
		ck_assert_msg(w[i].rc == KL_OK, "client %d, round %ld: %s: %s",
			      i, w[i].done, kl_strerror(w[i].rc),
			      w[i].message);
	ck_assert_int_eq(atomic_load(&overlaps), 0);
	ck_assert_int_eq(count, n * rounds);
}

/* ------------------------------------------------------------------ */
/* Private state trees for local: tests                               */

void
test_private_root(char *root, const char *name)
{
	int n = snprintf(root, PATH_MAX, "/tmp/%s.XXXXXX", name);

	ck_assert(n > 0 && n < PATH_MAX);
	ck_assert_ptr_nonnull(mkdtemp(root));
	ck_assert_int_eq(chmod(root, 0700), 0);
}

void
test_private_state(const char *root, char *parent, char *dir)
{
	int n;

	n = snprintf(parent, PATH_MAX, "%s/t.XXXXXX", root);
	ck_assert(n > 0 && n < PATH_MAX);
	ck_assert_ptr_nonnull(mkdtemp(parent));
	ck_assert_int_eq(chmod(parent, 0700), 0);
	n = snprintf(dir, PATH_MAX, "%s/state", parent);
	ck_assert(n > 0 && n < PATH_MAX);
	ck_assert_int_eq(mkdir(dir, 0700), 0);
	ck_assert_int_eq(chmod(dir, 0700), 0);
}
