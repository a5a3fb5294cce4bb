/* SPDX-License-Identifier: MIT */
/*
 * "keylock-bench transfer": T threads move amounts between random pairs of
 * N accounts, each move under both accounts' locks.  keylock takes the pair
 * as one key set (kl_lock_run_many: canonical order, no deadlock by
 * construction); the baseline is what people write by hand, a table of 256
 * striped pthread mutexes where the two stripes are locked in address order
 * (one lock when both accounts share a stripe).  Both run in the same
 * process, repetition after repetition, and the ratio printed is the median
 * of the per-repetition throughput ratios (keylock / baseline).
 *
 * Checks: the sum of all balances is unchanged after every phase (a move
 * that ran without both locks would lose an update), and every phase ends:
 * the main thread waits for the workers with a deadline, past which it
 * reports a deadlock and exits 2.
 *
 * Threads and locking: balances are plain int64_t touched only under the
 * locks of the phase; the stop flag and op counts are atomics; the totals
 * are read after the workers are joined.
 */
#include "bench.h"

#include <limits.h>

#define ACCOUNT_START 1000
#define TRANSFER_STUCK_NS (30 * INT64_C(1000000000))

enum { T_KEYLOCK, T_STRIPES, T_KINDS };

static const char *const tkind_name[T_KINDS] = {
	"kl_lock_run_many",
	"stripes, sorted",
};

struct tbank {
	int n;
	int64_t *balance;
	char **key;
	kl_lock *lock;
	kl_provider *prov;
	atomic_bool stop;
	atomic_long ops;
	atomic_int finished;
	atomic_long errors;
};

struct tworker {
	pthread_t th;
	struct tbank *b;
	int kind;
	uint64_t rng;
};

struct move {
	struct tbank *b;
	int from, to;
	int64_t amount;
};

static uint64_t
next_rand(uint64_t *s)
{
	/* xorshift64*: cheap, and private to each worker. */
	*s ^= *s >> 12;
	*s ^= *s << 25;
	*s ^= *s >> 27;
	return *s * UINT64_C(2685821657736338717);
}

static void
do_move(struct tbank *b, int from, int to, int64_t amount)
{
	b->balance[from] -= amount;
	b->balance[to] += amount;
}

static int
move_fn(kl_lease *lease, void *arg)
{
	const struct move *m = arg;

	(void)lease;
	do_move(m->b, m->from, m->to, m->amount);
	return 0;
}

static void *
tworker_main(void *arg)
{
	struct tworker *w = arg;
	struct tbank *b = w->b;
	long ops = 0;

	while (!atomic_load_explicit(&b->stop, memory_order_relaxed)) {
		struct move m = { .b = b };
		uint64_t r = next_rand(&w->rng);

		m.from = (int)(r % (uint64_t)b->n);
		m.to = (int)((r >> 32) % (uint64_t)(b->n - 1));
		if (m.to >= m.from)
			m.to++; /* a pair of two distinct accounts */
		m.amount = (int64_t)(next_rand(&w->rng) % 100) + 1;
		if (w->kind == T_KEYLOCK) {
			const char *keys[2] = { b->key[m.from], b->key[m.to] };

			if (kl_lock_run_many(b->lock, keys, 2, NULL, move_fn, &m,
					     NULL, NULL) != KL_OK)
				atomic_fetch_add(&b->errors, 1);
		} else {
			pthread_mutex_t *x = stripe_of(b->key[m.from]);
			pthread_mutex_t *y = stripe_of(b->key[m.to]);

			if (x == y) {
				pthread_mutex_lock(x);
				do_move(b, m.from, m.to, m.amount);
				pthread_mutex_unlock(x);
			} else {
				pthread_mutex_t *lo = x < y ? x : y;
				pthread_mutex_t *hi = x < y ? y : x;

				pthread_mutex_lock(lo);
				pthread_mutex_lock(hi);
				do_move(b, m.from, m.to, m.amount);
				pthread_mutex_unlock(hi);
				pthread_mutex_unlock(lo);
			}
		}
		ops++;
	}
	atomic_fetch_add(&b->ops, ops);
	atomic_fetch_add(&b->finished, 1);
	return NULL;
}

/* One phase: threads workers of kind for ms; returns moves per second, or
 * -1 when the phase did not end (a deadlock: the workers are left). */
static double
tphase(struct tbank *b, int kind, int threads, int ms, uint64_t seed)
{
	struct tworker *w = xcalloc((size_t)threads, sizeof *w);
	int64_t start, end, limit;
	double tput;
	int rc;

	atomic_store(&b->stop, false);
	atomic_store(&b->ops, 0);
	atomic_store(&b->finished, 0);
	start = now_ns();
	for (int i = 0; i < threads; i++) {
		w[i].b = b;
		w[i].kind = kind;
		w[i].rng = seed * 0x9e3779b97f4a7c15u + (uint64_t)i * 7919u + 1;
		if ((rc = pthread_create(&w[i].th, NULL, tworker_main, &w[i])) !=
		    0)
			die("pthread_create: %s", strerror(rc));
	}
	sleep_ns((int64_t)ms * 1000000);
	atomic_store(&b->stop, true);
	limit = now_ns() + TRANSFER_STUCK_NS;
	while (atomic_load(&b->finished) < threads && now_ns() < limit)
		sleep_ns(1000000);
	end = now_ns();
	if (atomic_load(&b->finished) < threads)
		return -1; /* the workers and w stay: the process exits */
	for (int i = 0; i < threads; i++)
		pthread_join(w[i].th, NULL);
	free(w);
	tput = (double)atomic_load(&b->ops) / ((double)(end - start) / 1e9);
	return tput;
}

static int64_t
tbank_total(const struct tbank *b)
{
	int64_t t = 0;

	for (int i = 0; i < b->n; i++)
		t += b->balance[i];
	return t;
}

/* A positive int option, or die. */
static int
int_arg(const char *name, const char *text)
{
	char *end;
	long v;

	errno = 0;
	v = strtol(text, &end, 10);
	if (errno != 0 || end == text || *end != '\0' || v < 1 ||
	    v > INT_MAX)
		die("transfer: invalid %s '%s'", name, text);
	return (int)v;
}

static void
transfer_usage(FILE *f)
{
	fprintf(f,
		"Usage: " PROG " transfer [options]\n"
		"\n"
		"T threads move amounts between random pairs of N accounts:\n"
		"kl_lock_run_many against 256 striped pthread mutexes locked\n"
		"in address order, in the same run.\n"
		"\n"
		" -t, --threads T     worker threads (default 4)\n"
		" -a, --accounts N    an account count; repeat for several\n"
		"                       (default: 16 and 10000)\n"
		" -d, --duration MS   milliseconds per phase (default 500)\n"
		" -r, --runs R        repetitions (default 5)\n"
		" -h, --help          display this help and exit\n");
}

int
kl_bench_transfer_main(int argc, char **argv)
{
	static const struct option longopts[] = {
		{ "threads", required_argument, NULL, 't' },
		{ "accounts", required_argument, NULL, 'a' },
		{ "duration", required_argument, NULL, 'd' },
		{ "runs", required_argument, NULL, 'r' },
		{ "help", no_argument, NULL, 'h' },
		{ NULL, 0, NULL, 0 },
	};
	int threads = 4, ms = 500, runs = 5, nsizes = 0, c;
	int sizes[8];
	bool broken = false;

	while ((c = getopt_long(argc, argv, "+t:a:d:r:h", longopts, NULL)) !=
	       -1) {
		switch (c) {
		case 't':
			threads = int_arg("--threads", optarg);
			break;
		case 'a':
			if (nsizes == 8)
				die("at most 8 account counts");
			sizes[nsizes++] = int_arg("--accounts", optarg);
			break;
		case 'd':
			ms = int_arg("--duration", optarg);
			break;
		case 'r':
			runs = int_arg("--runs", optarg);
			break;
		case 'h':
			transfer_usage(stdout);
			return EXIT_SUCCESS;
		default:
			transfer_usage(stderr);
			return 64;
		}
	}
	if (nsizes == 0) {
		sizes[nsizes++] = 16;
		sizes[nsizes++] = 10000;
	}
	if (threads < 1 || ms < 1 || runs < 1 || optind != argc)
		die("transfer: bad arguments (try --help)");
	for (int s = 0; s < nsizes; s++)
		if (sizes[s] < 2)
			die("transfer: at least 2 accounts");
	stripes_init();

	printf("transfer: %d threads, %d ms per phase, %d runs\n", threads,
	       ms, runs);
	printf("%8s %20s %14s %14s %8s %10s\n", "accounts", "subject",
	       "moves/s", "baseline/s", "ratio", "deadlocks");
	for (int s = 0; s < nsizes; s++) {
		struct tbank b = { .n = sizes[s] };
		double *ratio = xcalloc((size_t)runs, sizeof(double));
		double *tk = xcalloc((size_t)runs, sizeof(double));
		double *ts = xcalloc((size_t)runs, sizeof(double));
		kl_lock_opts lo = KL_LOCK_OPTS_INIT;
		int64_t want;
		struct summary rs, ks, ss;
		int rc;

		b.balance = xcalloc((size_t)b.n, sizeof *b.balance);
		b.key = xcalloc((size_t)b.n, sizeof *b.key);
		for (int i = 0; i < b.n; i++) {
			b.balance[i] = ACCOUNT_START;
			b.key[i] = xcalloc(24, 1);
			snprintf(b.key[i], 24, "account:%d", i);
		}
		want = (int64_t)b.n * ACCOUNT_START;
		if ((rc = kl_memory_provider_new(&b.prov)) != KL_OK)
			die("kl_memory_provider_new: %s", kl_strerror(rc));
		lo.provider = b.prov;
		if ((rc = kl_lock_new(&b.lock, &lo)) != KL_OK)
			die("kl_lock_new: %s", kl_strerror(rc));
		for (int r = 0; r < runs; r++) {
			/* Alternate which goes first, so that neither always
			 * meets the machine in the same phase. */
			for (int k = 0; k < T_KINDS; k++) {
				int kind = (r % 2 == 0) ? k : T_KINDS - 1 - k;
				double t = tphase(&b, kind, threads, ms,
						 (uint64_t)r * 2 + (uint64_t)kind + 1);

				if (t < 0) {
					printf("%8d %20s %14s %14s %8s %10d\n",
					       b.n, tkind_name[kind], "-", "-",
					       "-", 1);
					fflush(stdout);
					fprintf(stderr,
						PROG " transfer: %s deadlocked"
						" (no end %lld s after the "
						"stop)\n",
						tkind_name[kind],
						(long long)(TRANSFER_STUCK_NS /
							    1000000000));
					_exit(EXIT_BROKEN);
				}
				if (tbank_total(&b) != want) {
					fprintf(stderr,
						PROG " transfer: %s: the total "
						"is %lld, expected %lld\n",
						tkind_name[kind],
						(long long)tbank_total(&b),
						(long long)want);
					broken = true;
				}
				(kind == T_KEYLOCK ? tk : ts)[r] = t;
			}
			ratio[r] = ts[r] > 0 ? tk[r] / ts[r] : 0;
		}
		if (atomic_load(&b.errors) != 0) {
			fprintf(stderr, PROG " transfer: %ld calls failed\n",
				atomic_load(&b.errors));
			broken = true;
		}
		if (kl_memory_provider_size(b.prov) != 0) {
			fprintf(stderr, PROG " transfer: keys left held\n");
			broken = true;
		}
		rs = summarize(ratio, runs);
		ks = summarize(tk, runs);
		ss = summarize(ts, runs);
		printf("%8d %20s %14.0f %14.0f %7.2fx %10d\n", b.n,
		       tkind_name[T_KEYLOCK], ks.med, ss.med, rs.med,
		       0);
		printf("%8s %20s total %lld of %lld: %s\n", "", "",
		       (long long)tbank_total(&b), (long long)want,
		       tbank_total(&b) == want ? "ok" : "WRONG");
		kl_lock_free(b.lock);
		kl_provider_free(b.prov);
		for (int i = 0; i < b.n; i++)
			free(b.key[i]);
		free(b.key);
		free(b.balance);
		free(ratio);
		free(tk);
		free(ts);
	}
	return broken ? EXIT_BROKEN : EXIT_SUCCESS;
}
