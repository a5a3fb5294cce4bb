/* SPDX-License-Identifier: MIT */
/*
 * sig_twice SIG FIRST SECOND [DELAY_MS]: sends signal SIG with kill(2) to
 * FIRST and then to SECOND (process ids; a negative one is a process
 * group), DELAY_MS milliseconds apart, back to back when it is 0 or
 * missing.  One process sends both copies, as timeout(1) sends its signal
 * to its child and then to its own process group.  Exits 0, or 99 when an
 * argument is wrong or a kill fails.
 */
#include "config.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int
number(const char *s, long *out)
{
	char *end;

	errno = 0;
	*out = strtol(s, &end, 10);
	return errno == 0 && end != s && *end == '\0' ? 0 : -1;
}

int
main(int argc, char **argv)
{
	long sig, first, second, delay = 0;
	struct timespec ts;

	if ((argc != 4 && argc != 5) || number(argv[1], &sig) != 0 ||
	    number(argv[2], &first) != 0 || number(argv[3], &second) != 0 ||
	    (argc == 5 && (number(argv[4], &delay) != 0 || delay < 0))) {
		fputs("usage: sig_twice SIG FIRST SECOND [DELAY_MS]\n",
		      stderr);
		return 99;
	}
	if (kill((pid_t)first, (int)sig) != 0) {
		fprintf(stderr, "sig_twice: kill %ld: %s\n", first,
			strerror(errno));
		return 99;
	}
	if (delay > 0) {
		ts.tv_sec = delay / 1000;
		ts.tv_nsec = delay % 1000 * 1000000L;
		while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
			;
	}
	if (kill((pid_t)second, (int)sig) != 0) {
		fprintf(stderr, "sig_twice: kill %ld: %s\n", second,
			strerror(errno));
		return 99;
	}
	return 0;
}
