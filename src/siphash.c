/* SPDX-License-Identifier: MIT */
/*
 * SipHash-c-d (Aumasson and Bernstein, "SipHash: a fast short-input PRF",
 * 2012): c compression rounds per 8-byte word, d finalization rounds.  One
 * body serves both variants the tree uses; each wrapper passes constants,
 * so the compiler unrolls the round loops as if they were written out.
 * Words are read little-endian on every host, so that hosts of either byte
 * order agree (the pg lock ids and the local file names are shared across
 * hosts and processes).
 */
#include "config.h"

#include "internal.h"

#define ROTL(x, b) (((x) << (b)) | ((x) >> (64 - (b))))

#define SIPROUND                                                           \
	do {                                                               \
		v0 += v1;                                                  \
		v1 = ROTL(v1, 13);                                         \
		v1 ^= v0;                                                  \
		v0 = ROTL(v0, 32);                                         \
		v2 += v3;                                                  \
		v3 = ROTL(v3, 16);                                         \
		v3 ^= v2;                                                  \
		v0 += v3;                                                  \
		v3 = ROTL(v3, 21);                                         \
		v3 ^= v0;                                                  \
		v2 += v1;                                                  \
		v1 = ROTL(v1, 17);                                         \
		v1 ^= v2;                                                  \
		v2 = ROTL(v2, 32);                                         \
	} while (0)

static inline __attribute__((always_inline)) uint64_t
siphash_cd(int c, int d, uint64_t k0, uint64_t k1, const void *data,
	   size_t len)
{
	const unsigned char *p = data;
	size_t w, end = len & ~(size_t)7;
	uint64_t v0, v1, v2, v3, m, b;
	int i;

	v0 = k0 ^ 0x736f6d6570736575ULL;
	v1 = k1 ^ 0x646f72616e646f6dULL;
	v2 = k0 ^ 0x6c7967656e657261ULL;
	v3 = k1 ^ 0x7465646279746573ULL;
	/* Indexes, not a moving pointer: kl_pg_key_id hashes (NULL, 0), and
	 * even NULL + 0 is undefined behaviour. */
	for (w = 0; w < end; w += 8) {
		m = kl__load_le64(p + w);
		v3 ^= m;
		for (i = 0; i < c; i++)
			SIPROUND;
		v0 ^= m;
	}
	b = (uint64_t)len << 56;
	switch (len & 7) {
	case 7:
		b |= (uint64_t)p[end + 6] << 48; /* fall through */
	case 6:
		b |= (uint64_t)p[end + 5] << 40; /* fall through */
	case 5:
		b |= (uint64_t)p[end + 4] << 32; /* fall through */
	case 4:
		b |= (uint64_t)p[end + 3] << 24; /* fall through */
	case 3:
		b |= (uint64_t)p[end + 2] << 16; /* fall through */
	case 2:
		b |= (uint64_t)p[end + 1] << 8; /* fall through */
	case 1:
		b |= (uint64_t)p[end];
		break;
	default:
		break;
	}
	v3 ^= b;
	for (i = 0; i < c; i++)
		SIPROUND;
	v0 ^= b;
	v2 ^= 0xff;
	for (i = 0; i < d; i++)
		SIPROUND;
	return v0 ^ v1 ^ v2 ^ v3;
}

uint64_t
kl__siphash(uint64_t k0, uint64_t k1, const void *data, size_t len)
{
	return siphash_cd(1, 3, k0, k1, data, len);
}

uint64_t
kl__siphash24(uint64_t k0, uint64_t k1, const void *data, size_t len)
{
	return siphash_cd(2, 4, k0, k1, data, len);
}
