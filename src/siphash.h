/* SPDX-License-Identifier: MIT */
/*
 * SipHash (Aumasson and Bernstein), the one copy in the tree.  It lives in
 * the convenience library src/libklcommon.la, linked into each shared
 * library (the ones that hash: libkeylock, libkeylock-pg), so that no
 * library has to export it to another: the functions are hidden in each.
 */
#ifndef KL_SIPHASH_H
#define KL_SIPHASH_H

#include <stddef.h>
#include <stdint.h>

#ifndef KL_HIDDEN
#define KL_HIDDEN __attribute__((visibility("hidden")))
#endif

/* SipHash-1-3 with an explicit key: the core's tables (kl__hash) and names
 * that other processes must compute alike (the local provider's files). */
KL_HIDDEN uint64_t kl__siphash(uint64_t k0, uint64_t k1, const void *data,
			       size_t len);

/* SipHash-2-4, the variant of the paper and its test vectors: the
 * PostgreSQL provider's lock ids, whose values are an interface
 * (kl_pg_key_id) and must never change. */
KL_HIDDEN uint64_t kl__siphash24(uint64_t k0, uint64_t k1, const void *data,
				 size_t len);

#endif
