/* SPDX-License-Identifier: MIT */
/*
 * keylock-bench, what deadlock detection costs where it must cost nothing:
 * uncontended kl_lock, and contended waits far shorter than deadlock_ms.
 * The same workload runs with detection on and off, alternating within
 * each repetition, so that the machine's load drifts over both alike; the
 * ratio is the median of the per-repetition ratios.  Only the uncontended
 * ratio is judged: a contended run on a shared 2-CPU machine varies by more
 * than any cost detection could add, so its ratio is shown, not judged.
 */
#include "bench.h"

struct dlres dlres;

/* The fastest of a few passes: an uncontended pair has one true cost, and
 * what the machine adds (a preemption, another process's cache misses)
 * only ever makes a pass slower. */
static double
unc_best(kl_lock *l)
{
	double best = INFINITY, v;

	for (int j = 0; j < 3; j++)
		if ((v = u_kl_lock(l, 0, 1, opt.iters_keyed)) < best)
			best = v;
	return best;
}

void
run_deadlock_cost(void)
{
	kl_lock *l = subjects[K_KL_LOCK].kl;
	int64_t saved = kl_deadlock_ms();
	struct crun r;

	progress("deadlock detection");
	/* Detection on means its default unless the environment chose a
	 * setting: with it off, "on" is measured at the default. */
	dlres.on_ms = saved == KL_FOREVER ? 1000 : saved;
	for (int m = 0; m < 2; m++) {
		dlres.unc[m] = xcalloc((size_t)opt.runs, sizeof(double));
		dlres.tput[m] = xcalloc((size_t)opt.runs, sizeof(double));
	}
	for (int i = 0; i < opt.runs; i++)
		for (int m = 0; m < 2; m++) {
			/* Odd repetitions measure off first: neither setting
			 * always gets the warmer caches. */
			int which = (i & 1) ? 1 - m : m;

			if (kl_deadlock_ms_set(which == 0 ? dlres.on_ms
							  : KL_FOREVER) !=
			    KL_OK)
				die("kl_deadlock_ms_set failed");
			dlres.unc[which][i] = unc_best(l);
			run_contended(&subjects[K_KL_LOCK], DL_THREADS,
				      DL_SEC, false, NULL, &r);
			total_violations += r.violations;
			total_sections += r.sections;
			dlres.tput[which][i] = r.tput;
		}
	if (kl_deadlock_ms_set(saved) != KL_OK)
		die("kl_deadlock_ms_set failed");
	dlres.unc_ratio = paired_ratio(dlres.unc[0], dlres.unc[1], opt.runs);
	dlres.tput_ratio = paired_ratio(dlres.tput[0], dlres.tput[1],
					opt.runs);
}

void
print_deadlock_cost(void)
{
	char a[32], b[32], c[32], d[32];

	printf("\nDeadlock detection on (deadlock_ms %lld) and off, "
	       "alternating; kl_lock/memory\n",
	       (long long)dlres.on_ms);
	printf("  %-34s %9s %9s %9s %9s\n", "workload", "on", "off",
	       "on / off", "unit");
	printf("  %-34s %9s %9s %9s %9s\n", "uncontended, 1 key",
	       fmt(a, sizeof a, summarize(dlres.unc[0], opt.runs).med),
	       fmt(b, sizeof b, summarize(dlres.unc[1], opt.runs).med),
	       fmt(c, sizeof c, dlres.unc_ratio), "ns/pair");
	snprintf(d, sizeof d, "%d thr %s", DL_THREADS, sec_name[DL_SEC]);
	printf("  %-34s %9s %9s %9s %9s\n", d,
	       fmt(a, sizeof a, summarize(dlres.tput[0], opt.runs).med),
	       fmt(b, sizeof b, summarize(dlres.tput[1], opt.runs).med),
	       fmt(c, sizeof c, dlres.tput_ratio), "ops/s");
}
