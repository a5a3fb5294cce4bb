/* SPDX-License-Identifier: MIT */
/*
 * keylock-bench, machine output: the JSON report and the SVG plot.
 */
#include "bench.h"

/* ------------------------------------------------------------------ */
/* JSON output                                                         */

static void
jnum(double v)
{
	if (isfinite(v))
		printf("%.6g", v);
	else
		fputs("null", stdout);
}

static void
jsummary(const char *name, const double *v, int n)
{
	struct summary s = summarize(v, n);

	printf("\"%s\": {\"median\": ", name);
	jnum(s.med);
	fputs(", \"min\": ", stdout);
	jnum(s.min);
	fputs(", \"max\": ", stdout);
	jnum(s.max);
	fputs(", \"runs\": [", stdout);
	for (int i = 0; i < n; i++) {
		if (i)
			fputs(", ", stdout);
		jnum(v[i]);
	}
	fputs("]}", stdout);
}

static void
jsys(const struct sysres *s)
{
	fputs("\"futex_per_op\": ", stdout);
	jnum(sysm.ok ? s->futex : NAN);
	fputs(", \"syscalls_per_op\": ", stdout);
	jnum(sysm.ok ? s->all : NAN);
	fputs(", \"voluntary_cs_per_op\": ", stdout);
	jnum(s->vcsw);
	fputs(", \"involuntary_cs_per_op\": ", stdout);
	jnum(s->ivcsw);
	printf(", \"operations\": %llu", (unsigned long long)s->n);
}

static void
jcontended(const struct cres *c, int k, int nthreads, int sec, bool last)
{
	printf("    {\"lock\": \"%s\", \"threads\": %d, \"section\": "
	       "\"%s\", ",
	       kind_name[k], nthreads, sec_name[sec]);
	jsummary("ops_per_s", c->tput, opt.runs);
	fputs(", ", stdout);
	jsummary("owner_changes_per_acq", c->chg, opt.runs);
	fputs(", ", stdout);
	jsummary("fairness_max_min", c->fair, opt.runs);
	fputs(", ", stdout);
	jsummary("fairness_from_start", c->fair_all, opt.runs);
	fputs(", ", stdout);
	jsummary("fairness_per_cpu_time", c->fair_cpu, opt.runs);
	fputs(", \"wait_ns\": {\"p50\": ", stdout);
	jnum(hist_pct(&c->h, 0.50));
	fputs(", \"p99\": ", stdout);
	jnum(hist_pct(&c->h, 0.99));
	fputs(", \"max\": ", stdout);
	jnum(c->h.count ? (double)c->h.max : NAN);
	printf(", \"samples\": %llu}, \"operations\": %llu, "
	       "\"violations\": %ld}%s\n",
	       (unsigned long long)c->h.count, (unsigned long long)c->ops,
	       c->violations, last ? "" : ",");
}

void
print_json(void)
{
	printf("{\n  \"tool\": \"%s\",\n  \"version\": \"%s\",\n"
	       "  \"library\": \"%s\",\n  \"quick\": %s,\n  \"runs\": %d,\n"
	       "  \"duration_ms\": %d,\n  \"cpus\": %ld,\n"
	       "  \"load_before\": \"%s\",\n  \"load_after\": \"%s\",\n",
	       PROG, KL_VERSION_STRING, kl_version(),
	       opt.quick ? "true" : "false", opt.runs, opt.duration_ms,
	       sysconf(_SC_NPROCESSORS_ONLN), load_before, load_after);
	printf("  \"mode\": \"%s\",\n", mode_name(opt.pin));
	fputs("  \"cpus_of_process\": [", stdout);
	for (int i = 0; i < ncpus; i++)
		printf("%s%d", i ? ", " : "", cpu_list[i]);
	fputs("],\n", stdout);
	printf("  \"work_ns\": {\"inside\": %d, \"outside\": %d},\n"
	       "  \"uncontended_ns\": [\n",
	       WORK_IN_NS, WORK_OUT_NS);
	for (int r = 0; r < NUROWS; r++) {
		char label[64];

		print_urow_label(label, sizeof label, r);
		printf("    {\"id\": \"%s\", \"name\": \"%s\", ", urow_id[r],
		       label);
		jsummary("ns", ures[r], opt.runs);
		fputs(", \"x_pthread\": ", stdout);
		jnum(paired_ratio(ures[r], ures[U_PTHREAD], opt.runs));
		printf("}%s\n", r + 1 < NUROWS ? "," : "");
	}
	printf("  ],\n  \"memory\": {\"keys\": %zu, \"key_bytes\": %zu, "
	       "\"bytes_per_key_malloc\": ",
	       opt.nkeys, strlen(key_at(0)));
	jnum(mem.have_malloc ? mem.malloc_per_key : NAN);
	fputs(", \"bytes_per_key_rss\": ", stdout);
	jnum(mem.have_rss ? mem.rss_per_key : NAN);
	fputs(", \"fill_ns_per_acquire\": ", stdout);
	jnum(mem.fill_ns);
	printf(", \"provider_size_held\": %zu, \"provider_size_after\": %zu"
	       ", \"in_use_after_vs_idle\": %lld, \"rss_idle\": %lld, "
	       "\"rss_held\": %lld, \"rss_after_vs_idle\": %lld, "
	       "\"rss_after_trim_vs_idle\": %lld},\n",
	       mem.size_held, mem.size_after, mem.inuse_after, mem.rss_idle,
	       mem.rss_held, mem.rss_after, mem.rss_after_trim);

	fputs("  \"contended\": [\n", stdout);
	for (int t = 0; t < NTHR; t++)
		for (int sec = 0; sec < NSEC; sec++)
			for (int k = 0; k < NKINDS; k++)
				jcontended(&cres[k][t][sec], k,
					   thread_counts[t], sec,
					   t == NTHR - 1 && sec == NSEC - 1 &&
						   k == NKINDS - 1);
	fputs("  ],\n  \"contended_cpu_hog\": [\n", stdout);
	for (int t = 0; t < NTHR; t++)
		for (int sec = 0; sec < NSEC; sec++)
			for (int k = 0; k < NKINDS; k++)
				jcontended(&cres_hog[k][t][sec], k,
					   thread_counts[t], sec,
					   t == NTHR - 1 && sec == NSEC - 1 &&
						   k == NKINDS - 1);
	printf("  ],\n  \"contended_%s\": [\n", mode_name(!opt.pin));
	for (int k = 0; k < NKINDS; k++)
		jcontended(&cres_alt[k], k, 2, 0, k == NKINDS - 1);
	fputs("  ],\n  \"handoff_ns\": [\n", stdout);
	{
		bool first = true;

		for (int p = 0; p < NPLACE; p++)
			for (int m = 0; m < 2; m++)
				for (int k = 0; k < NHAND; k++) {
					struct hres *h = &hres[p][k][m];

					if (!h->ran)
						continue;
					printf("%s    {\"lock\": \"%s\", "
					       "\"waiter\": \"%s\", "
					       "\"placed\": \"%s\", ",
					       first ? "" : ",\n",
					       kind_name[hand_kinds[k]],
					       hand_mode[m], place_name[p]);
					first = false;
					jsummary("p50", h->p50, opt.runs);
					fputs(", ", stdout);
					jsummary("p99", h->p99, opt.runs);
					fputs(", ", stdout);
					jsummary("beside", h->beside,
						 opt.runs);
					fputs(", \"max\": ", stdout);
					jnum(h->max);
					fputs("}", stdout);
				}
		fputs("\n", stdout);
	}
	printf("  ],\n  \"readers_writers\": {\"threads\": %d, "
	       "\"shared_percent\": %d, \"section_ns\": %d, "
	       "\"kl_lock_x_rwlock\": ",
	       rw_threads, rw_shared_percent, rw_work_ns);
	jnum(rw_ratio);
	fputs(", \"locks\": [\n", stdout);
	for (int k = 0; k < RW_KINDS; k++) {
		struct rwres *r = &rwres[k];

		printf("    {\"lock\": \"%s\", ", rw_kind_name[k]);
		jsummary("ops_per_s", r->tput, opt.runs);
		for (int m = 0; m < 2; m++) {
			printf(", \"wait_ns_%s\": {\"p50\": ",
			       m ? "exclusive" : "shared");
			jnum(hist_pct(&r->h[m], 0.50));
			fputs(", \"p99\": ", stdout);
			jnum(hist_pct(&r->h[m], 0.99));
			fputs(", \"max\": ", stdout);
			jnum((double)r->h[m].max);
			printf(", \"samples\": %llu}",
			       (unsigned long long)r->h[m].count);
		}
		fputs(", \"granted_while_writer_waited\": {\"p50\": ",
		      stdout);
		jnum(hist_pct(&r->passed, 0.50));
		fputs(", \"p99\": ", stdout);
		jnum(hist_pct(&r->passed, 0.99));
		printf(", \"max\": %lld}, "
		       "\"max_readers_inside\": %d, \"operations\": %llu, "
		       "\"violations\": %ld}%s\n",
		       (long long)r->passed.max, r->max_readers,
		       (unsigned long long)r->ops, r->violations,
		       k + 1 < RW_KINDS ? "," : "");
	}
	printf("  ]},\n  \"deadlock_detection\": {\"deadlock_ms\": %lld, "
	       "\"threads\": %d, \"section\": \"%s\", ",
	       (long long)dlres.on_ms, DL_THREADS, sec_name[DL_SEC]);
	jsummary("uncontended_ns_on", dlres.unc[0], opt.runs);
	fputs(", ", stdout);
	jsummary("uncontended_ns_off", dlres.unc[1], opt.runs);
	fputs(", \"uncontended_on_x_off\": ", stdout);
	jnum(dlres.unc_ratio);
	fputs(", ", stdout);
	jsummary("ops_per_s_on", dlres.tput[0], opt.runs);
	fputs(", ", stdout);
	jsummary("ops_per_s_off", dlres.tput[1], opt.runs);
	fputs(", \"contended_on_x_off\": ", stdout);
	jnum(dlres.tput_ratio);
	printf("},\n  \"syscalls\": {\"method\": \"%s\", "
	       "\"uncontended\": [\n",
	       sysm.method);
	for (int i = 0; i < NSYSU; i++) {
		printf("    {\"id\": \"%s\", ", urow_id[sys_urows[i]]);
		jsys(&sys_un[i]);
		printf("}%s\n", i + 1 < NSYSU ? "," : "");
	}
	fputs("  ], \"contended_empty\": [\n", stdout);
	for (int t = 0; t < NSYST; t++)
		for (int k = 0; k < K_NONE; k++) {
			printf("    {\"lock\": \"%s\", \"threads\": %d, ",
			       kind_name[k], sys_threads[t]);
			jsys(&sys_ct[k][t]);
			fputs(", \"futex_per_owner_change\": ", stdout);
			jnum(sysm.ok ? sys_ct[k][t].futex_per_change : NAN);
			printf("}%s\n",
			       t == NSYST - 1 && k == K_NONE - 1 ? "" : ",");
		}
	fputs("  ]},\n  \"targets\": [\n", stdout);
	for (int i = 0; i < ntargets; i++) {
		struct target *t = &targets[i];

		printf("    {\"name\": \"%s\", \"value\": ", t->name);
		jnum(t->value);
		printf(", \"op\": \"%s\", \"unit\": \"%s\", \"limit\": ",
		       t->at_most ? "<=" : ">=", t->unit);
		jnum(t->limit);
		fputs(", \"stretch\": ", stdout);
		jnum(t->stretch);
		printf(", \"verdict\": \"%s\", \"stretch_met\": %s}%s\n",
		       verdict_name[t->v], t->stretch_met ? "true" : "false",
		       i + 1 < ntargets ? "," : "");
	}
	printf("  ],\n  \"critical_sections\": %llu,\n"
	       "  \"violations\": %ld\n}\n",
	       (unsigned long long)total_sections, total_violations);
}

/* ------------------------------------------------------------------ */
/* SVG plot: a small writer of our own, no library                     */

struct panel {
	double x, y, w, h; /* the plotting area */
	double lo, hi;     /* log10 of the y range */
};

static void
svg_text(FILE *f, double x, double y, const char *anchor, int size,
	 const char *s)
{
	fprintf(f,
		"<text x=\"%.1f\" y=\"%.1f\" font-size=\"%d\" "
		"text-anchor=\"%s\">",
		x, y, size, anchor);
	for (; *s != '\0'; s++) {
		if (*s == '<')
			fputs("&lt;", f);
		else if (*s == '>')
			fputs("&gt;", f);
		else if (*s == '&')
			fputs("&amp;", f);
		else
			fputc(*s, f);
	}
	fputs("</text>\n", f);
}

static void
svg_line(FILE *f, double x1, double y1, double x2, double y2,
	 const char *color, double width)
{
	fprintf(f,
		"<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" "
		"stroke=\"%s\" stroke-width=\"%.1f\"/>\n",
		x1, y1, x2, y2, color, width);
}

/* Values off the scale (or infinite) are drawn on its edge. */
static double
panel_y(const struct panel *p, double v)
{
	double l = !(v > 0) ? p->lo : isinf(v) ? p->hi : log10(v);

	if (l < p->lo)
		l = p->lo;
	if (l > p->hi)
		l = p->hi;
	return p->y + p->h - (l - p->lo) / (p->hi - p->lo) * p->h;
}

static double
panel_x(const struct panel *p, int i)
{
	return p->x + (i + 0.5) * p->w / NTHR;
}

static void
tick_label(char *buf, size_t size, double v)
{
	if (v >= 1e9)
		snprintf(buf, size, "%gG", v / 1e9);
	else if (v >= 1e6)
		snprintf(buf, size, "%gM", v / 1e6);
	else if (v >= 1e3)
		snprintf(buf, size, "%gk", v / 1e3);
	else
		snprintf(buf, size, "%g", v);
}

static void
svg_panel(FILE *f, const struct panel *p, const char *title,
	  double y[NKINDS][NTHR])
{
	char buf[32];
	/* Mantissas of the grid lines: denser as the range narrows, so a
	 * fairness axis from 1 to 2 still shows 1.1. */
	static const double fine[] = { 1, 1.1, 1.2, 1.5, 2, 3, 5 };
	static const double mid[] = { 1, 2, 5 };
	static const double coarse[] = { 1 };
	const double *ms = coarse;
	double last = INFINITY;
	int nm = 1;

	fprintf(f,
		"<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" "
		"fill=\"none\" stroke=\"#444\"/>\n",
		p->x, p->y, p->w, p->h);
	svg_text(f, p->x + p->w / 2, p->y - 10, "middle", 14, title);
	if (p->hi - p->lo <= 1) {
		ms = fine;
		nm = 7;
	} else if (p->hi - p->lo <= 3) {
		ms = mid;
		nm = 3;
	}
	for (int e = (int)floor(p->lo); e <= (int)ceil(p->hi); e++)
		for (int m = 0; m < nm; m++) {
			double v = ms[m] * pow(10, e), py;

			if (log10(v) < p->lo - 1e-9 || log10(v) > p->hi + 1e-9)
				continue;
			py = panel_y(p, v);
			if (fabs(py - last) < 14) /* labels would overlap */
				continue;
			last = py;
			svg_line(f, p->x, py, p->x + p->w, py, "#ddd", 1);
			tick_label(buf, sizeof buf, v);
			svg_text(f, p->x - 6, py + 4, "end", 11, buf);
		}
	for (int i = 0; i < NTHR; i++) {
		snprintf(buf, sizeof buf, "%d", thread_counts[i]);
		svg_text(f, panel_x(p, i), p->y + p->h + 16, "middle", 11,
			 buf);
	}
	svg_text(f, p->x + p->w / 2, p->y + p->h + 32, "middle", 11,
		 "threads");
	for (int k = 0; k < NKINDS; k++) {
		if (isnan(y[k][0])) /* not drawn in this panel */
			continue;
		fprintf(f, "<polyline fill=\"none\" stroke=\"%s\" "
			   "stroke-width=\"2\" points=\"",
			kind_color[k]);
		for (int i = 0; i < NTHR; i++)
			fprintf(f, "%s%.1f,%.1f", i ? " " : "",
				panel_x(p, i), panel_y(p, y[k][i]));
		fputs("\"/>\n", f);
		for (int i = 0; i < NTHR; i++)
			fprintf(f,
				"<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3\" "
				"fill=\"%s\"/>\n",
				panel_x(p, i), panel_y(p, y[k][i]),
				kind_color[k]);
	}
}

/* The log10 range covering every finite positive value, at least lo_min
 * to lo_min + 1 decade wide. */
static void
panel_range(struct panel *p, double y[NKINDS][NTHR], bool from_one)
{
	double lo = INFINITY, hi = -INFINITY;

	for (int k = 0; k < NKINDS; k++)
		for (int i = 0; i < NTHR; i++)
			if (y[k][i] > 0 && isfinite(y[k][i])) {
				lo = fmin(lo, log10(y[k][i]));
				hi = fmax(hi, log10(y[k][i]));
			}
	if (!isfinite(lo)) {
		lo = 0;
		hi = 1;
	}
	p->lo = from_one ? 0 : floor(lo);
	p->hi = ceil(hi);
	if (from_one && hi < log10(2.0))
		p->hi = log10(2.0); /* a fair lock still gets an axis */
	if (p->hi <= p->lo)
		p->hi = p->lo + 1;
}

int
write_plot(const char *path)
{
	static const char *const titles[4] = {
		"throughput, empty section (ops/s)",
		"throughput, 0.4 us held / 4 us out (ops/s)",
		"fairness max/min ops per thread, empty",
		"fairness max/min ops per thread, work"
	};
	double y[NKINDS][NTHR];
	FILE *f = fopen(path, "w");
	char buf[160];

	if (f == NULL) {
		fprintf(stderr, PROG ": %s: %s\n", path, strerror(errno));
		return -1;
	}
	fputs("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
	      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"960\" "
	      "height=\"760\" viewBox=\"0 0 960 760\" "
	      "font-family=\"sans-serif\">\n"
	      "<rect width=\"960\" height=\"760\" fill=\"white\"/>\n",
	      f);
	snprintf(buf, sizeof buf,
		 "%s %s: one key, median of %d runs of %d ms, %ld CPUs%s",
		 PROG, KL_VERSION_STRING, opt.runs, opt.duration_ms,
		 sysconf(_SC_NPROCESSORS_ONLN), opt.quick ? " (quick)" : "");
	svg_text(f, 480, 28, "middle", 16, buf);
	for (int q = 0; q < 4; q++) {
		struct panel p = { .x = 90 + (q % 2) * 460,
				   .y = 70 + (q / 2) * 320,
				   .w = 360,
				   .h = 230 };
		int sec = q % 2;

		for (int k = 0; k < NKINDS; k++)
			for (int i = 0; i < NTHR; i++) {
				struct cres *c = &cres[k][i][sec];

				/* The no-lock loop's rate counts loops, not
				 * grants. */
				y[k][i] = q < 2 && k == K_NONE
						  ? NAN
						  : summarize(q < 2 ? c->tput
								    : c->fair,
							      opt.runs)
							    .med;
			}
		panel_range(&p, y, q >= 2);
		svg_panel(f, &p, titles[q], y);
	}
	/* Seven entries of up to 17 characters at 11 px fit in 135 px each. */
	for (int k = 0; k < NKINDS; k++) {
		double x = 12 + k * 135;

		svg_line(f, x, 735, x + 24, 735, kind_color[k], 3);
		svg_text(f, x + 30, 739, "start", 11, kind_label[k]);
	}
	svg_text(f, 480, 756, "middle", 10,
		 "log scales; values above an axis (inf: a thread starved) "
		 "are drawn on its edge");
	fputs("</svg>\n", f);
	if (fclose(f) != 0) {
		fprintf(stderr, PROG ": %s: %s\n", path, strerror(errno));
		return -1;
	}
	return 0;
}
