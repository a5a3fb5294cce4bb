/* SPDX-License-Identifier: MIT */
/*
 * keylock-bench, the command line and the order of the run.
 */
#include "bench.h"

/* ------------------------------------------------------------------ */
/* The idle thread                                                     */

static pthread_mutex_t idle_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t idle_cond = PTHREAD_COND_INITIALIZER;
static bool idle_quit;

static void *
idle_main(void *arg)
{
	(void)arg;
	pthread_mutex_lock(&idle_lock);
	while (!idle_quit)
		pthread_cond_wait(&idle_cond, &idle_lock);
	pthread_mutex_unlock(&idle_lock);
	return NULL;
}

/* ------------------------------------------------------------------ */
/* Options                                                             */

static void
usage(void)
{
	printf("Usage: %s [options]\n\n"
	       "Measure keylock against a pthread mutex, a striped mutex "
	       "table, a\nstrict-FIFO baseline and a pthread_rwlock_t in one "
	       "process, and judge the\nratios against targets.\n\n"
	       "Options:\n"
	       "  -q, --quick          a seconds-long smoke pass; never "
	       "judges speed\n"
	       "  -j, --json           print JSON instead of the table\n"
	       "  -p, --plot FILE      write throughput and fairness as an "
	       "SVG file\n"
	       "  -r, --runs N         repetitions per figure (default 5, "
	       "quick 3)\n"
	       "  -d, --duration MS    milliseconds per contended run "
	       "(default 200, quick 30)\n"
	       "      --pin            pin threads round-robin to the CPUs "
	       "(default: unpinned,\n"
	       "                       as servers run them)\n"
	       "  -s, --strict         exit 1 when a target is missed\n"
	       "  -h, --help           show this help and exit\n"
	       "  -V, --version        show the version and exit\n\n"
	       "keylock-bench provider --uri URI [--json] [--quick] "
	       "measures a Redis or\nPostgreSQL provider (see "
	       "'keylock-bench provider --help').\n\n"
	       "Exit status: 0 done, 1 a target missed with --strict, 2 a "
	       "lock invariant\nbroke, a call failed or the plot could not be "
	       "written, 64 usage error.\n",
	       PROG);
}

static void __attribute__((noreturn, format(printf, 1, 2)))
usage_error(const char *fmt, ...)
{
	va_list ap;

	fputs(PROG ": ", stderr);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fprintf(stderr, "\nTry '%s --help' for more information.\n", PROG);
	exit(EXIT_USAGE);
}

static int
parse_int(const char *s, int lo, int hi, const char *name)
{
	char *end;
	long v;

	errno = 0;
	v = strtol(s, &end, 10);
	if (errno != 0 || end == s || *end != '\0' || v < lo || v > hi)
		usage_error("invalid %s '%s' (%d to %d)", name, s, lo, hi);
	return (int)v;
}

static void
parse_options(int argc, char **argv)
{
	static const struct option longopts[] = {
		{ "quick", no_argument, NULL, 'q' },
		{ "json", no_argument, NULL, 'j' },
		{ "plot", required_argument, NULL, 'p' },
		{ "runs", required_argument, NULL, 'r' },
		{ "duration", required_argument, NULL, 'd' },
		{ "strict", no_argument, NULL, 's' },
		{ "pin", no_argument, NULL, 'P' },
		{ "help", no_argument, NULL, 'h' },
		{ "version", no_argument, NULL, 'V' },
		{ NULL, 0, NULL, 0 }
	};
	int c, runs = 0, duration = 0;

	opterr = 0; /* our own messages, prefixed with PROG */
	while ((c = getopt_long(argc, argv, "+:qjp:r:d:shV", longopts,
				NULL)) != -1) {
		switch (c) {
		case 'q':
			opt.quick = true;
			break;
		case 'j':
			opt.json = true;
			break;
		case 'p':
			opt.plot = optarg;
			break;
		case 'r':
			runs = parse_int(optarg, 1, 1000, "--runs");
			break;
		case 'd':
			duration = parse_int(optarg, 1, 600000, "--duration");
			break;
		case 's':
			opt.strict = true;
			break;
		case 'P':
			opt.pin = true;
			break;
		case 'h':
			usage();
			exit(EXIT_SUCCESS);
		case 'V':
			printf("%s (keylock) %s\n", PROG, KL_VERSION_STRING);
			exit(EXIT_SUCCESS);
		case ':':
			usage_error("option '%s' needs an argument",
				    argv[optind - 1]);
		default:
			if (optopt != 0) {
				char opt_text[3] = { '-', (char)optopt, '\0' };

				usage_error("unknown option '%s'", opt_text);
			}
			usage_error("unknown option '%s'", argv[optind - 1]);
		}
	}
	if (optind < argc)
		usage_error("unexpected argument '%s'", argv[optind]);

	if (opt.quick) {
		opt.runs = 3;
		opt.duration_ms = 30;
		opt.iters_lock = 100000;
		opt.iters_keyed = 50000;
		opt.nkeys = 100000;
		opt.nfresh = 20000;
		opt.hand_sleep = 30;
		opt.hand_spin = 200;
		opt.iters_sys = 10000;
	} else {
		opt.runs = 5;
		opt.duration_ms = 200;
		opt.iters_lock = 2000000;
		opt.iters_keyed = 1000000;
		opt.nkeys = 1000000;
		opt.nfresh = 200000;
		opt.hand_sleep = 300;
		opt.hand_spin = 2000;
		opt.iters_sys = 200000;
	}
	if (opt.strict && opt.quick)
		fprintf(stderr, PROG ": --strict has no effect with --quick, "
				"which never judges speed\n");
	if (runs > 0)
		opt.runs = runs;
	if (duration > 0)
		opt.duration_ms = duration;
}

static void
cres_alloc(struct cres *c, size_t n)
{
	c->tput = xcalloc(n, sizeof(double));
	c->fair = xcalloc(n, sizeof(double));
	c->fair_all = xcalloc(n, sizeof(double));
	c->chg = xcalloc(n, sizeof(double));
	c->fair_cpu = xcalloc(n, sizeof(double));
}

static void
alloc_results(void)
{
	size_t n = (size_t)opt.runs;

	for (int r = 0; r < NUROWS; r++)
		ures[r] = xcalloc(n, sizeof(double));
	for (int k = 0; k < NKINDS; k++) {
		for (int t = 0; t < NTHR; t++)
			for (int s = 0; s < NSEC; s++) {
				cres_alloc(&cres[k][t][s], n);
				cres_alloc(&cres_hog[k][t][s], n);
			}
		cres_alloc(&cres_alt[k], n);
	}
	for (int p = 0; p < NPLACE; p++)
		for (int k = 0; k < NHAND; k++)
			for (int m = 0; m < 2; m++) {
				struct hres *h = &hres[p][k][m];

				h->p50 = xcalloc(n, sizeof(double));
				h->p99 = xcalloc(n, sizeof(double));
				h->beside = xcalloc(n, sizeof(double));
			}
}

int
main(int argc, char **argv)
{
	pthread_t idle;
	bool broken, missed = false, plot_failed = false;
	int rc;

	if (argc > 1 && strcmp(argv[1], "provider") == 0)
		return kl_bench_provider_main(argc - 1, argv + 1);
	if (argc > 1 && strcmp(argv[1], "transfer") == 0)
		return kl_bench_transfer_main(argc - 1, argv + 1);
	parse_options(argc, argv);
	progress_on = isatty(STDERR_FILENO);
	read_load(load_before, sizeof load_before);
	if ((rc = pthread_create(&idle, NULL, idle_main, NULL)) != 0)
		die("pthread_create: %s", strerror(rc));
	cpus_init();
	pin_now = opt.pin;
	pin_self(0);
	alloc_results();
	stripes_init();
	subjects_init();
	syscalls_detect();
	keys_build();

	run_uncontended();
	run_memory();
	run_contended_all();
	run_handoff_all();
	run_rwlock();
	run_deadlock_cost();
	run_syscalls();
	evaluate();
	read_load(load_after, sizeof load_after);

	broken = total_violations != 0 || mem.size_held != opt.nkeys ||
		 mem.size_after != 0 || rw_left != 0 ||
		 kl_memory_provider_size(subjects[K_KL_LOCK].prov) != 0;
	for (int i = 0; i < ntargets; i++)
		missed |= targets[i].v == V_MISS;
	if (opt.json)
		print_json();
	else
		print_table();
	fflush(stdout);
	if (opt.plot != NULL && write_plot(opt.plot) != 0)
		plot_failed = true;

	pthread_mutex_lock(&idle_lock);
	idle_quit = true;
	pthread_cond_signal(&idle_cond);
	pthread_mutex_unlock(&idle_lock);
	pthread_join(idle, NULL);
	subjects_free();
	free(keybuf);

	if (broken) {
		fprintf(stderr, PROG ": a lock invariant broke (%ld mutual "
				"exclusion violations, %zu keys left)\n",
			total_violations, mem.size_after + rw_left);
		return EXIT_BROKEN;
	}
	if (plot_failed)
		return EXIT_BROKEN;
	if (opt.strict && missed && !opt.quick)
		return EXIT_MISS;
	return EXIT_SUCCESS;
}
