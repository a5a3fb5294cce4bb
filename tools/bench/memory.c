/* SPDX-License-Identifier: MIT */
/*
 * keylock-bench, keys and memory: nkeys leases held at once, bytes per key and
 * what is left after they go.
 */
#include "bench.h"

struct bench_mem mem;

void
run_memory(void)
{
	kl_provider *p;
	kl_lock *l = new_keyed_lock(&p);
	kl_lease **held;
	kl_call call = { .key = NULL, .cancel = NULL };
	long long in0, in1, in2, rss0, rss1, rss2;
	int64_t t0;
	int rc;

	progress("memory and a new key while all are held");
	/* Allocated and touched before the idle snapshot, so that the
	 * deltas are the library's alone. */
	held = xcalloc(opt.nkeys, sizeof *held);
	memset(held, 0, opt.nkeys * sizeof *held);
	u_kl_lock(l, 0, 1, 1);
	in0 = heap_in_use();
	rss0 = rss_bytes();
	t0 = now_ns();
	for (size_t i = 0; i < opt.nkeys; i++) {
		call.key = key_at(i);
		if ((rc = kl_lock_acquire(l, &call, &held[i], NULL)) != KL_OK)
			die("kl_lock_acquire: %s", kl_strerror(rc));
	}
	mem.fill_ns = per_op(t0, (long)opt.nkeys);
	in1 = heap_in_use();
	rss1 = rss_bytes();
	mem.size_held = kl_memory_provider_size(p);

	for (int i = 0; i < opt.runs; i++)
		ures[U_HELD][i] =
			u_kl_lock(l, opt.nkeys, opt.nfresh, (long)opt.nfresh);

	for (size_t i = 0; i < opt.nkeys; i++)
		kl_lease_release(held[i]);
	mem.size_after = kl_memory_provider_size(p);
	in2 = heap_in_use();
	rss2 = rss_bytes();

	mem.have_malloc = in0 >= 0;
	mem.have_rss = rss0 >= 0;
	mem.malloc_per_key = (double)(in1 - in0) / (double)opt.nkeys;
	mem.rss_per_key = (double)(rss1 - rss0) / (double)opt.nkeys;
	mem.inuse_after = in2 - in0;
	mem.rss_after = rss2 - rss0;
	mem.rss_idle = rss0;
	mem.rss_held = rss1;
#ifdef BENCH_MALLINFO2
	/* Shows whether what RSS kept is free memory glibc holds on to. */
	malloc_trim(0);
#endif
	mem.rss_after_trim = rss_bytes() - rss0;
	free(held);
	kl_lock_free(l);
	kl_provider_free(p);
}
