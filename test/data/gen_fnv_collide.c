/* SPDX-License-Identifier: MIT */
/*
 * Generates test/data/fnv1a32-collide16.txt, the fixture of TESTPLAN T16
 * (b): 20 000 distinct keys whose unkeyed 32-bit FNV-1a hashes agree in
 * their low 16 bits (all equal TARGET), i.e. keys that would all fall into
 * one bucket of a table of up to 65 536 buckets indexed by an unseeded
 * FNV-1a.  One key a line: "f" and 7 characters of [0-9A-Za-z].
 *
 * Not built by default (nor by make check): the fixture is committed.  To
 * make it again:
 *   cc -O2 -o gen_fnv_collide test/data/gen_fnv_collide.c
 *   ./gen_fnv_collide > test/data/fnv1a32-collide16.txt
 * The output is deterministic (keys in enumeration order).
 *
 * The low 16 bits of FNV-1a depend only on the low 16 bits of its state,
 * so the search keeps the state of every prefix and costs one step per
 * candidate: about 65 536 candidates a key.
 */
#include <stdint.h>
#include <stdio.h>

#define N_KEYS 20000
#define TARGET 0x4b4cu /* "KL" */
#define LEN 7          /* characters after the "f" */

static const char digits[] =
	"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";

static uint32_t
step(uint32_t h, unsigned char c)
{
	return (h ^ c) * 16777619u;
}

int
main(void)
{
	uint32_t h[LEN + 1];
	int idx[LEN] = { 0 };
	char key[LEN + 2];
	long found = 0;

	key[0] = 'f';
	key[LEN + 1] = '\0';
	h[0] = step(2166136261u, 'f');
	for (int i = 0; i < LEN; i++) {
		key[i + 1] = digits[0];
		h[i + 1] = step(h[i], (unsigned char)digits[0]);
	}
	while (found < N_KEYS) {
		if ((h[LEN] & 0xffffu) == TARGET) {
			puts(key);
			found++;
		}
		/* Next candidate: bump the last digit, carrying left, and
		 * recompute the states from the leftmost changed one. */
		int i = LEN - 1;

		while (i >= 0 && ++idx[i] == 62) {
			idx[i] = 0;
			i--;
		}
		if (i < 0)
			return 1; /* exhausted: cannot happen for N_KEYS */
		for (int j = i; j < LEN; j++) {
			key[j + 1] = digits[idx[j]];
			h[j + 1] = step(h[j], (unsigned char)key[j + 1]);
		}
	}
	return 0;
}
