/* SPDX-License-Identifier: MIT */
/*
 * SipHash-1-3 (src/siphash.c) keyed with a per-process random seed.  Keys
 * come from clients (servers lock by client-supplied ids), so an unkeyed
 * hash would let them pick keys that all land in one bucket; with a secret
 * seed they cannot.
 * The seed comes from getrandom(2), read once; if that fails (very old
 * kernel, seccomp) it falls back to /dev/urandom, then to the address space
 * layout and the clock, which is weaker but never fatal.
 */
#include "config.h"

#include <fcntl.h>
#include <string.h>
#include <unistd.h>
#ifdef HAVE_SYS_RANDOM_H
#include <sys/random.h>
#endif

#include "internal.h"

static uint64_t seed[2];
static pthread_once_t seed_once = PTHREAD_ONCE_INIT;

static bool
read_random(void *buf, size_t len)
{
	unsigned char *p = buf;
	size_t got = 0;

#ifdef HAVE_GETRANDOM
	while (got < len) {
		ssize_t n = getrandom(p + got, len - got, 0);
		if (n <= 0)
			break;
		got += (size_t)n;
	}
	if (got == len)
		return true;
#endif
	int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return false;
	while (got < len) {
		ssize_t n = read(fd, p + got, len - got);
		if (n <= 0)
			break;
		got += (size_t)n;
	}
	close(fd);
	return got == len;
}

static void
seed_init(void)
{
	if (!read_random(seed, sizeof seed)) {
		seed[0] = (uint64_t)(uintptr_t)&seed ^ (uint64_t)kl__now_ns();
		seed[1] = (uint64_t)(uintptr_t)&read_random * 0x9e3779b97f4a7c15u;
	}
}

#ifdef KL_TEST_HOOKS
void
kl__test_set_hash_seed(uint64_t k0, uint64_t k1)
{
	pthread_once(&seed_once, seed_init);
	seed[0] = k0;
	seed[1] = k1;
}
#endif

uint64_t
kl__hash(const void *data, size_t len)
{
	pthread_once(&seed_once, seed_init);
	return kl__siphash(seed[0], seed[1], data, len);
}

void
kl__hash_seed(uint64_t *k0, uint64_t *k1)
{
	pthread_once(&seed_once, seed_init);
	*k0 = seed[0];
	*k1 = seed[1];
}
