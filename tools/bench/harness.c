/* SPDX-License-Identifier: MIT */
/*
 * keylock-bench, the timing harness shared by every workload: options, time
 * and spinning, CPU pinning, statistics and histograms, system call
 * counters and memory readings.
 */
#include "bench.h"

struct bench_opt opt;

bool progress_on;

void
progress(const char *what)
{
	if (progress_on)
		fprintf(stderr, PROG ": %s...\n", what);
}

void __attribute__((noreturn, format(printf, 1, 2)))
die(const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vsay(stderr, "", fmt, ap);
	va_end(ap);
	exit(EXIT_BROKEN);
}

void
vsay(FILE *f, const char *part, const char *fmt, va_list ap)
{
	fprintf(f, "%s: %s", PROG, part);
	vfprintf(f, fmt, ap);
	fputc('\n', f);
}

void *
xcalloc(size_t n, size_t size)
{
	void *p = calloc(n, size);

	if (p == NULL)
		die("out of memory");
	return p;
}

/* Other processes share the cores: the load average before and after a
 * pass tells a reader how far to trust the absolute figures. */
char load_before[48], load_after[48];

void
read_load(char *buf, size_t size)
{
	FILE *f = fopen("/proc/loadavg", "r");
	double l1, l5, l15;

	snprintf(buf, size, "n/a");
	if (f == NULL)
		return;
	if (fscanf(f, "%lf %lf %lf", &l1, &l5, &l15) == 3)
		snprintf(buf, size, "%.2f %.2f %.2f", l1, l5, l15);
	fclose(f);
}

/* ------------------------------------------------------------------ */
/* Time and spinning                                                   */

int64_t
now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

void
sleep_ns(int64_t ns)
{
	struct timespec ts = { .tv_sec = ns / 1000000000,
			       .tv_nsec = ns % 1000000000 };

	while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
		;
}

/* Spins until *v == want.  Yields after a while: with more runnable
 * threads than cores the thread we wait for may need our core. */
void
wait_int(atomic_int *v, int want)
{
	for (unsigned n = 0;
	     atomic_load_explicit(v, memory_order_acquire) != want; n++) {
		if (n < 2000)
			cpu_relax();
		else
			sched_yield();
	}
}

void
wait_true(atomic_bool *v)
{
	for (unsigned n = 0; !atomic_load_explicit(v, memory_order_acquire);
	     n++) {
		if (n < 2000)
			cpu_relax();
		else
			sched_yield();
	}
}

/* The "real work" of a critical section: a spin on the clock rather than
 * a calibrated loop, because the loop's speed changes with what the other
 * hyperthread or the host does, and a calibration taken in a slow moment
 * would shorten every section of the pass.  The clock read is in the vDSO:
 * no system call. */
void
spin_for(int64_t ns)
{
	int64_t end;

	if (ns <= 0)
		return;
	end = now_ns() + ns;
	while (now_ns() < end)
		;
}

/*
 * By default no thread is pinned: servers do not pin theirs, and what the
 * scheduler then does (wake a granted waiter on its waker's CPU, let a
 * spinning waiter sit on the CPU its holder needs) is part of what users
 * get.  With --pin, threads are pinned round-robin over the CPUs the
 * process may use (the main thread takes the first CPU, worker i the (i mod
 * n)th): left to itself the scheduler may put two threads on one core,
 * where they take turns without ever contending, so a pinned run shows what
 * the lock does when every thread has a CPU of its own.
 */
int cpu_list[1024];
int ncpus;
bool pin_now;

void
cpus_init(void)
{
#ifdef __linux__
	cpu_set_t set;

	if (sched_getaffinity(0, sizeof set, &set) != 0)
		return;
	for (int i = 0; i < CPU_SETSIZE && ncpus < 1024; i++)
		if (CPU_ISSET(i, &set))
			cpu_list[ncpus++] = i;
#endif
}

#ifdef __linux__
/* CPU slot (mod n) alone when pinning, else every CPU of the process: a
 * thread inherits its creator's mask, and the main thread may be pinned. */
static void
slot_set(cpu_set_t *set, int slot)
{
	CPU_ZERO(set);
	if (pin_now) {
		CPU_SET(cpu_list[slot % ncpus], set);
		return;
	}
	for (int i = 0; i < ncpus; i++)
		CPU_SET(cpu_list[i], set);
}
#endif

/* Thread attributes placing a new thread for CPU slot (mod n). */
void
pinned_attr(pthread_attr_t *a, int slot)
{
	pthread_attr_init(a);
#ifdef __linux__
	if (ncpus > 0) {
		cpu_set_t set;

		slot_set(&set, slot);
		pthread_attr_setaffinity_np(a, sizeof set, &set);
	}
#else
	(void)slot;
#endif
}

void
pin_self(int slot)
{
#ifdef __linux__
	if (ncpus > 0) {
		cpu_set_t set;

		slot_set(&set, slot);
		pthread_setaffinity_np(pthread_self(), sizeof set, &set);
	}
#else
	(void)slot;
#endif
}

/* ------------------------------------------------------------------ */
/* The background CPU hog                                              */

/*
 * One busy thread of another process, as on a machine that does other work
 * besides the program that locks: a child that spins, never pinned.  It is
 * killed by hog_stop, by exit (atexit), and by the kernel when this process
 * dies any other way (PR_SET_PDEATHSIG), so it never outlives the bench.
 */
static pid_t hog_pid;
static bool hog_registered;

void
hog_stop(void)
{
	if (hog_pid <= 0)
		return;
	kill(hog_pid, SIGKILL);
	while (waitpid(hog_pid, NULL, 0) < 0 && errno == EINTR)
		;
	hog_pid = 0;
}

void
hog_start(void)
{
	pid_t parent = getpid();
	pid_t pid;

	if (hog_pid > 0)
		return;
	if (!hog_registered) {
		if (atexit(hog_stop) != 0)
			die("atexit failed");
		hog_registered = true;
	}
	fflush(NULL); /* the child must not write our buffers twice */
	pid = fork();
	if (pid < 0)
		die("fork for the CPU hog: %s", strerror(errno));
	if (pid == 0) {
		/* Async-signal-safe calls only: the parent has threads. */
		volatile unsigned long spins = 0;

#ifdef __linux__
		cpu_set_t set;

		(void)prctl(PR_SET_PDEATHSIG, SIGKILL);
		if (getppid() != parent)
			_exit(0);
		CPU_ZERO(&set);
		for (int i = 0; i < ncpus; i++)
			CPU_SET(cpu_list[i], &set);
		if (ncpus > 0)
			(void)sched_setaffinity(0, sizeof set, &set);
#else
		(void)parent;
#endif
		for (;;)
			spins++;
	}
	hog_pid = pid;
}

/* ------------------------------------------------------------------ */
/* Statistics                                                          */

int
cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;

	/* NaN sorts last so that it never becomes a median by accident. */
	if (isnan(x) || isnan(y))
		return (isnan(x) != 0) - (isnan(y) != 0);
	return (x > y) - (x < y);
}

struct summary
summarize(const double *v, int n)
{
	struct summary s = { NAN, NAN, NAN };
	double *c;
	int k = 0;

	if (n <= 0)
		return s;
	c = xcalloc((size_t)n, sizeof *c);
	for (int i = 0; i < n; i++)
		if (!isnan(v[i]))
			c[k++] = v[i];
	if (k > 0) {
		qsort(c, (size_t)k, sizeof *c, cmp_double);
		s.min = c[0];
		s.max = c[k - 1];
		s.med = k % 2 ? c[k / 2] : (c[k / 2 - 1] + c[k / 2]) / 2;
	}
	free(c);
	return s;
}

/* The median of a[i] / b[i]: both measured in the same repetition. */
double
paired_ratio(const double *a, const double *b, int n)
{
	double *r = xcalloc((size_t)n, sizeof *r);
	double m;

	for (int i = 0; i < n; i++)
		r[i] = a[i] / b[i];
	m = summarize(r, n).med;
	free(r);
	return m;
}

void
hist_add(struct hist *h, int64_t v)
{
	uint64_t u = v > 0 ? (uint64_t)v : 0;
	int i, e;

	if (u < HSUB) {
		i = (int)u;
	} else {
		e = 63 - __builtin_clzll(u);
		i = (e - 3) * HSUB + (int)((u >> (e - 4)) & (HSUB - 1));
	}
	h->n[i]++;
	h->count++;
	if (v > h->max)
		h->max = v;
}

void
hist_merge(struct hist *into, const struct hist *h)
{
	for (int i = 0; i < HBUCKETS; i++)
		into->n[i] += h->n[i];
	into->count += h->count;
	if (h->max > into->max)
		into->max = h->max;
}

double
hist_pct(const struct hist *h, double q)
{
	uint64_t rank, seen = 0;

	if (h->count == 0)
		return NAN;
	rank = (uint64_t)ceil(q * (double)h->count);
	if (rank == 0)
		rank = 1;
	for (int i = 0; i < HBUCKETS; i++) {
		double width, v;

		seen += h->n[i];
		if (seen < rank)
			continue;
		if (i < HSUB)
			return i;
		width = ldexp(1.0, i / HSUB - 1);
		v = (HSUB + i % HSUB) * width + width / 2;
		return v > (double)h->max ? (double)h->max : v;
	}
	return (double)h->max;
}

struct bench_sysm sysm;

#ifdef BENCH_PERF
/* The id of a tracepoint, or -1 with errno telling why. */
static int
tracepoint_id(const char *event)
{
	static const char *const roots[] = { "/sys/kernel/tracing",
					     "/sys/kernel/debug/tracing" };
	char path[256];
	int err = ENOENT;

	for (size_t i = 0; i < sizeof roots / sizeof roots[0]; i++) {
		FILE *f;
		int id = -1;

		snprintf(path, sizeof path, "%s/events/%s/id", roots[i], event);
		if ((f = fopen(path, "r")) == NULL) {
			if (errno != ENOENT)
				err = errno; /* EACCES says more */
			continue;
		}
		if (fscanf(f, "%d", &id) != 1)
			id = -1;
		fclose(f);
		if (id >= 0)
			return id;
	}
	errno = err;
	return -1;
}

static int
counter_open(int id)
{
	struct perf_event_attr a;

	if (id < 0)
		return -1;
	memset(&a, 0, sizeof a);
	a.type = PERF_TYPE_TRACEPOINT;
	a.size = sizeof a;
	a.config = (__u64)id;
	return (int)syscall(SYS_perf_event_open, &a, 0, -1, -1,
			    PERF_FLAG_FD_CLOEXEC);
}
#else
static int
counter_open(int id)
{
	(void)id;
	return -1;
}
#endif

static uint64_t
counter_read(int fd)
{
	uint64_t v = 0;

	if (fd < 0 || read(fd, &v, sizeof v) != (ssize_t)sizeof v)
		return 0;
	return v;
}

void
counters_open(struct counters *c)
{
	c->futex_fd = c->all_fd = -1;
	if (!sysm.ok)
		return;
	c->futex_fd = counter_open(sysm.futex_id);
	c->all_fd = counter_open(sysm.all_id);
}

void
counters_close(struct counters *c)
{
	if (c->futex_fd >= 0)
		close(c->futex_fd);
	if (c->all_fd >= 0)
		close(c->all_fd);
	c->futex_fd = c->all_fd = -1;
}

void
counters_sample(const struct counters *c, struct csample *s)
{
	struct rusage ru;

	s->futex = counter_read(c->futex_fd);
	s->all = counter_read(c->all_fd);
#ifdef RUSAGE_THREAD
	getrusage(RUSAGE_THREAD, &ru);
#else
	getrusage(RUSAGE_SELF, &ru);
#endif
	s->vcsw = ru.ru_nvcsw;
	s->ivcsw = ru.ru_nivcsw;
}

/* System calls between two samples, less those the sampling made. */
uint64_t
since(uint64_t before, uint64_t after)
{
	uint64_t d = after - before;

	return d > sysm.all_overhead ? d - sysm.all_overhead : 0;
}

void
syscalls_detect(void)
{
	struct counters c;
	struct csample a, b;
	int err = 0;

	sysm.futex_id = sysm.all_id = -1;
	err = ENOSYS;
#ifdef BENCH_PERF
	if ((sysm.futex_id = tracepoint_id("syscalls/sys_enter_futex")) < 0 ||
	    (sysm.all_id = tracepoint_id("raw_syscalls/sys_enter")) < 0)
		err = errno;
#endif
	if (sysm.futex_id < 0 || sysm.all_id < 0) {
		snprintf(sysm.method, sizeof sysm.method,
			 "getrusage context switches; futex counts n/a: "
			 "syscall tracepoint ids: %s (needs root and tracefs "
			 "on /sys/kernel/tracing)",
			 strerror(err));
		return;
	}
	c.futex_fd = counter_open(sysm.futex_id);
	err = errno;
	c.all_fd = counter_open(sysm.all_id);
	if (c.futex_fd < 0 || c.all_fd < 0) {
		counters_close(&c);
		snprintf(sysm.method, sizeof sysm.method,
			 "getrusage context switches; futex counts n/a "
			 "(perf_event_open: %s)",
			 strerror(err));
		return;
	}
	/* What sampling costs by itself, subtracted from every delta. */
	counters_sample(&c, &a);
	counters_sample(&c, &b);
	sysm.all_overhead = b.all - a.all;
	counters_close(&c);
	sysm.ok = true;
	snprintf(sysm.method, sizeof sysm.method,
		 "perf_event_open on tracepoints syscalls:sys_enter_futex "
		 "and raw_syscalls:sys_enter, per thread");
}

/* ------------------------------------------------------------------ */
/* Memory                                                              */

long long
rss_bytes(void)
{
#ifdef __linux__
	FILE *f = fopen("/proc/self/statm", "r");
	long long size, res = -1;

	if (f == NULL)
		return -1;
	if (fscanf(f, "%lld %lld", &size, &res) != 2)
		res = -1;
	fclose(f);
	return res < 0 ? -1 : res * sysconf(_SC_PAGESIZE);
#else
	return -1;
#endif
}

/* Bytes malloc hands out now, chunk headers included, over all arenas. */
long long
heap_in_use(void)
{
#ifdef BENCH_MALLINFO2
	struct mallinfo2 mi = mallinfo2();

	return (long long)(mi.uordblks + mi.hblkhd);
#else
	return -1;
#endif
}
