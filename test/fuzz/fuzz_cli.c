/* SPDX-License-Identifier: MIT */
/*
 * libFuzzer target for the option parser of keylock(1) (TESTPLAN T19):
 * parse_args() of tools/keylock.c, which this file includes with main()
 * renamed and exit() turned into a longjmp back here, so that a usage error
 * (exit 64) or --help/--version (exit 0) ends one input, not the fuzzer.
 * Built and run by test/fuzz/run.sh with ASan and UBSan.
 *
 * The input is split at NUL bytes into at most 16 arguments after
 * argv[0].  Checks, besides crashes and leaks: parse_args only exits with
 * 0 or 64; when it returns, the options are complete and in range (a key,
 * `status`, or `list` with no key, a command after "--", durations >= 0
 * or KL_FOREVER, an exit code 0-255).  The messages keylock prints go to
 * /dev/null.
 */
#include "config.h"

/* Every header tools/keylock.c includes, before exit and stdout/stderr are
 * redefined below, so that their declarations stay untouched. */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <inttypes.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/resource.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include "keylock.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static jmp_buf fuzz_env;
static int fuzz_armed;
static FILE *fuzz_null;

/* exit() inside parse_args: back to LLVMFuzzerTestOneInput with the
 * status (+ 1, so that 0 is told from the first return of setjmp). */
static _Noreturn void
fuzz_exit(int status)
{
	if (!fuzz_armed) {
		fprintf(stderr, "fuzz_cli: exit(%d) outside parse_args\n",
			status);
		abort();
	}
	fuzz_armed = 0;
	longjmp(fuzz_env, status + 1);
}

#define exit(status) fuzz_exit(status)
#define main keylock_main
#undef stdout
#undef stderr
#define stdout fuzz_null
#define stderr fuzz_null
#include "../../tools/keylock.c"
#undef stdout
#undef stderr
#define stdout stdout
#define stderr stderr
#undef exit
#undef main

#define MAX_ARGS 16

int
LLVMFuzzerInitialize(int *argc, char ***argv)
{
	(void)argc;
	(void)argv;
	if ((fuzz_null = fopen("/dev/null", "w")) == NULL) {
		perror("fuzz_cli: /dev/null");
		abort();
	}
	return 0;
}

static void
check(int ok, const char *what)
{
	if (!ok) {
		fprintf(stderr, "fuzz_cli: %s\n", what);
		abort();
	}
}

int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	/* volatile: read after a longjmp */
	char *volatile buf;
	char *argv[MAX_ARGS + 2];
	/* static: parse_args changes it and may leave by longjmp, after
	 * which only a non-automatic object is sure to hold what it wrote
	 * (its set of -k keys, to free). */
	static struct options o;
	volatile int argc = 1;
	size_t i, start = 0;
	int jumped;

	if ((buf = malloc(size + 1)) == NULL)
		return 0;
	memcpy(buf, data, size);
	buf[size] = '\0';
	argv[0] = (char *)"keylock";
	for (i = 0; i <= size && argc <= MAX_ARGS; i++) {
		if (buf[i] == '\0') {
			argv[argc++] = buf + start;
			start = i + 1;
		}
	}
	argv[argc] = NULL;

	memset(&o, 0, sizeof o);
	optind = 0; /* glibc: a full reset of getopt's state */
	opterr = 0; /* getopt's own messages would go to the real stderr */
	fuzz_armed = 1;
	jumped = setjmp(fuzz_env);
	if (jumped == 0) {
		parse_args(argc, argv, &o);
		fuzz_armed = 0;
		check(o.provider != NULL, "no provider");
		check(o.wait_ms >= 0 || o.wait_ms == KL_FOREVER,
		      "bad wait time");
		check(o.ttl_ms >= 0, "bad ttl");
		check(o.conflict_exit >= 0 && o.conflict_exit <= 255,
		      "bad conflict exit code");
		if (o.list) {
			/* list: no key, no set, no command */
			check(o.command == NULL && o.key == NULL &&
				      o.nkeys == 0 && !o.status,
			      "list with a key or a command");
		} else if (o.status) {
			check(o.command == NULL, "status with a command");
			check(!o.json, "--json without list");
		} else {
			check(!o.json, "--json without list");
			if (o.nkeys > 0) {
				/* a set: -k KEY ..., each one non-empty */
				check(o.key == NULL, "a KEY besides -k");
				for (size_t k = 0; k < o.nkeys; k++)
					check(o.keys[k] != NULL &&
						      o.keys[k][0] != '\0',
					      "an empty -k KEY");
			} else {
				check(o.key != NULL && o.key[0] != '\0',
				      "no key");
			}
			check(o.command != NULL && o.command[0] != NULL,
			      "no command");
		}
	} else {
		/* --help and --version exit 0, usage errors 64. */
		check(jumped - 1 == 0 || jumped - 1 == EXIT_USAGE,
		      "parse_args exited with a status other than 0 or 64");
	}
	free(o.keys);
	free(buf);
	return 0;
}
