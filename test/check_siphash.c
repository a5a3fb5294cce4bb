/* SPDX-License-Identifier: MIT */
/*
 * Tests of the one SipHash of the tree (src/siphash.c, in the convenience
 * library src/libklcommon.la).  No server, no test hooks: pure functions.
 *
 * (a) SipHash-2-4 gives the 64 reference vectors of the SipHash paper
 *     (Aumasson and Bernstein, 2012, appendix A: key 00 01 .. 0f, message
 *     00 01 .. (n-1) for n = 0..63), so every tail length and one to seven
 *     whole words are covered.
 * (b) SipHash-1-3 gives, for the same inputs, the values the core's
 *     SipHash gave before the two copies became one: the local provider's
 *     file names are computed with it by every process of every version.
 * (c) kl_pg_key_id, public and documented as stable, gives for every
 *     prefix of one key the ids that libkeylock-pg gave when it carried its
 *     own copy of SipHash-2-4, and (NULL, 0) is the empty key (built only
 *     with the PostgreSQL provider: -DKL_CHECK_PG_KEY_ID).
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <check.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "siphash.h"
#ifdef KL_CHECK_PG_KEY_ID
#include "keylock.h"
#include "keylock/pg.h"
#endif

#define K0 0x0706050403020100ULL
#define K1 0x0f0e0d0c0b0a0908ULL

/* The paper's vectors, as little-endian words. */
static const uint64_t vectors24[64] = {
	0x726fdb47dd0e0e31ULL, 0x74f839c593dc67fdULL,
	0x0d6c8009d9a94f5aULL, 0x85676696d7fb7e2dULL,
	0xcf2794e0277187b7ULL, 0x18765564cd99a68dULL,
	0xcbc9466e58fee3ceULL, 0xab0200f58b01d137ULL,
	0x93f5f5799a932462ULL, 0x9e0082df0ba9e4b0ULL,
	0x7a5dbbc594ddb9f3ULL, 0xf4b32f46226bada7ULL,
	0x751e8fbc860ee5fbULL, 0x14ea5627c0843d90ULL,
	0xf723ca908e7af2eeULL, 0xa129ca6149be45e5ULL,
	0x3f2acc7f57c29bdbULL, 0x699ae9f52cbe4794ULL,
	0x4bc1b3f0968dd39cULL, 0xbb6dc91da77961bdULL,
	0xbed65cf21aa2ee98ULL, 0xd0f2cbb02e3b67c7ULL,
	0x93536795e3a33e88ULL, 0xa80c038ccd5ccec8ULL,
	0xb8ad50c6f649af94ULL, 0xbce192de8a85b8eaULL,
	0x17d835b85bbb15f3ULL, 0x2f2e6163076bcfadULL,
	0xde4daaaca71dc9a5ULL, 0xa6a2506687956571ULL,
	0xad87a3535c49ef28ULL, 0x32d892fad841c342ULL,
	0x7127512f72f27cceULL, 0xa7f32346f95978e3ULL,
	0x12e0b01abb051238ULL, 0x15e034d40fa197aeULL,
	0x314dffbe0815a3b4ULL, 0x027990f029623981ULL,
	0xcadcd4e59ef40c4dULL, 0x9abfd8766a33735cULL,
	0x0e3ea96b5304a7d0ULL, 0xad0c42d6fc585992ULL,
	0x187306c89bc215a9ULL, 0xd4a60abcf3792b95ULL,
	0xf935451de4f21df2ULL, 0xa9538f0419755787ULL,
	0xdb9acddff56ca510ULL, 0xd06c98cd5c0975ebULL,
	0xe612a3cb9ecba951ULL, 0xc766e62cfcadaf96ULL,
	0xee64435a9752fe72ULL, 0xa192d576b245165aULL,
	0x0a8787bf8ecb74b2ULL, 0x81b3e73d20b49b6fULL,
	0x7fa8220ba3b2eceaULL, 0x245731c13ca42499ULL,
	0xb78dbfaf3a8d83bdULL, 0xea1ad565322a1a0bULL,
	0x60e61c23a3795013ULL, 0x6606d7e446282b93ULL,
	0x6ca4ecb15c5f91e1ULL, 0x9f626da15c9625f3ULL,
	0xe51b38608ef25f57ULL, 0x958a324ceb064572ULL,
};

/* SipHash-1-3 of the same inputs, as src/hash.c computed it. */
static const uint64_t pinned13[64] = {
	0xabac0158050fc4dcULL, 0xc9f49bf37d57ca93ULL,
	0x82cb9b024dc7d44dULL, 0x8bf80ab8e7ddf7fbULL,
	0xcf75576088d38328ULL, 0xdef9d52f49533b67ULL,
	0xc50d2b50c59f22a7ULL, 0xd3927d989bb11140ULL,
	0x369095118d299a8eULL, 0x25a48eb36c063de4ULL,
	0x79de85ee92ff097fULL, 0x70c118c1f94dc352ULL,
	0x78a384b157b4d9a2ULL, 0x306f760c1229ffa7ULL,
	0x605aa111c0f95d34ULL, 0xd320d86d2a519956ULL,
	0xcc4fdd1a7d908b66ULL, 0x9cf2689063dbd80cULL,
	0x8ffc389cb473e63eULL, 0xf21f9de58d297d1cULL,
	0xc0dc2f46a6cce040ULL, 0xb992abfe2b45f844ULL,
	0x7ffe7b9ba320872eULL, 0x525a0e7fdae6c123ULL,
	0xf464aeb267349c8cULL, 0x45cd5928705b0979ULL,
	0x3a3e35e3ca9913a5ULL, 0xa91dc74e4ade3b35ULL,
	0xfb0bed02ef6cd00dULL, 0x88d93cb44ab1e1f4ULL,
	0x540f11d643c5e663ULL, 0x2370dd1f8c21d1bcULL,
	0x81157b6c16a7b60dULL, 0x4d54b9e57a8ff9bfULL,
	0x759f12781f2a753eULL, 0xcea1a3bebf186b91ULL,
	0x2cf508d3ada26206ULL, 0xb6101c2da3c33057ULL,
	0xb3f47496ae3a36a1ULL, 0x626b57547b108392ULL,
	0xc1d2363299e41531ULL, 0x667cc1923f1ad944ULL,
	0x65704ffec8138825ULL, 0x24f280d1c28949a6ULL,
	0xc2ca1cedfaf8876bULL, 0xc2164bfc9f042196ULL,
	0xa16e9c9368b1d623ULL, 0x49fb169c8b5114fdULL,
	0x9f3143f8df074c46ULL, 0xc6fdaf2412cc86b3ULL,
	0x7eaf49d10a52098fULL, 0x1cf313559d292f9aULL,
	0xc44a30dda2f41f12ULL, 0x36fae98943a71ed0ULL,
	0x318fb34c73f0bce6ULL, 0xa27abf3670a7e980ULL,
	0xb4bcc0db243c6d75ULL, 0x23f8d852fdb71513ULL,
	0x8f035f4da67d8a08ULL, 0xd89cd0e5b7e8f148ULL,
	0xf6f4e6bcf7a644eeULL, 0xaec59ad80f1837f2ULL,
	0xc3b2f6154b6694e0ULL, 0x9d199062b7bbb3a8ULL,
};

static void
fill(unsigned char *in, size_t n)
{
	for (size_t i = 0; i < n; i++)
		in[i] = (unsigned char)i;
}

START_TEST(test_siphash24_paper_vectors)
{
	unsigned char in[64];

	fill(in, sizeof in);
	/* _i is the loop test's index: the message length. */
	ck_assert_msg(kl__siphash24(K0, K1, in, (size_t)_i) == vectors24[_i],
		      "SipHash-2-4 of %d bytes", _i);
}
END_TEST

START_TEST(test_siphash13_pinned)
{
	unsigned char in[64];

	fill(in, sizeof in);
	ck_assert_msg(kl__siphash(K0, K1, in, (size_t)_i) == pinned13[_i],
		      "SipHash-1-3 of %d bytes", _i);
}
END_TEST

/* An unaligned message hashes as the same bytes aligned. */
START_TEST(test_siphash_unaligned)
{
	unsigned char buf[64 + 8];

	for (size_t off = 1; off < 8; off++) {
		fill(buf + off, 64);
		for (size_t n = 0; n < 64; n++) {
			ck_assert(kl__siphash24(K0, K1, buf + off, n) ==
				  vectors24[n]);
			ck_assert(kl__siphash(K0, K1, buf + off, n) ==
				  pinned13[n]);
		}
	}
}
END_TEST

START_TEST(test_siphash_null_empty)
{
	ck_assert(kl__siphash24(K0, K1, NULL, 0) == vectors24[0]);
	ck_assert(kl__siphash(K0, K1, NULL, 0) == pinned13[0]);
}
END_TEST

#ifdef KL_CHECK_PG_KEY_ID
static const char pg_key[] = "orders/2026/customer-000017";

/* kl_pg_key_id(pg_key, n) for n = 0..27, as its own copy of SipHash-2-4
 * computed them before src/siphash.c. */
static const int64_t pinned_pg[28] = {
	INT64_C(-670436540291247412),
	INT64_C(7711770491293719309),
	INT64_C(5505316457185705476),
	INT64_C(-3053006446154319775),
	INT64_C(4233402541879516928),
	INT64_C(6711814476789839649),
	INT64_C(7230926441644535891),
	INT64_C(-2609600470640338061),
	INT64_C(-5723216699859492970),
	INT64_C(8219019723229462804),
	INT64_C(2073909378564363519),
	INT64_C(829986575723929572),
	INT64_C(-632188903488915915),
	INT64_C(7317468852757385659),
	INT64_C(4881455449265277232),
	INT64_C(3413406930939097307),
	INT64_C(-1058610808637942307),
	INT64_C(-3655165987347051569),
	INT64_C(6300897452015338425),
	INT64_C(2062575564803228107),
	INT64_C(-3309786897986388434),
	INT64_C(-909123416182732621),
	INT64_C(-3962748083285815181),
	INT64_C(3881057036630423218),
	INT64_C(-4791478606493006789),
	INT64_C(1663728173113766713),
	INT64_C(8452212919119614672),
	INT64_C(9177687430108969617),
};

START_TEST(test_pg_key_id_pinned)
{
	ck_assert_uint_eq(strlen(pg_key) + 1,
			  sizeof pinned_pg / sizeof pinned_pg[0]);
	for (size_t n = 0; n <= strlen(pg_key); n++)
		ck_assert_msg(kl_pg_key_id(pg_key, n) == pinned_pg[n],
			      "kl_pg_key_id of %zu bytes", n);
	ck_assert(kl_pg_key_id("hello", 5) ==
		  INT64_C(-1861698501393448245));
	ck_assert(kl_pg_key_id(NULL, 0) == pinned_pg[0]);
	ck_assert(kl_pg_key_id(NULL, 5) == pinned_pg[0]);
}
END_TEST
#endif

static Suite *
siphash_suite(void)
{
	Suite *s = suite_create("siphash");
	TCase *tc = tcase_create("vectors");

	tcase_add_loop_test(tc, test_siphash24_paper_vectors, 0, 64);
	tcase_add_loop_test(tc, test_siphash13_pinned, 0, 64);
	tcase_add_test(tc, test_siphash_unaligned);
	tcase_add_test(tc, test_siphash_null_empty);
#ifdef KL_CHECK_PG_KEY_ID
	tcase_add_test(tc, test_pg_key_id_pinned);
#endif
	suite_add_tcase(s, tc);
	return s;
}

int
main(void)
{
	SRunner *sr = srunner_create(siphash_suite());
	int failed;

	srunner_run_all(sr, CK_ENV);
	failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
