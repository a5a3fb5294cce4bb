/* SPDX-License-Identifier: MIT */
/*
 * sig_count DIR: a command that counts the signals it gets.  It appends a
 * line "TERM", "WINCH" or "CONT" to DIR/log for each SIGTERM, SIGWINCH or
 * SIGCONT it is delivered, writes its parent's pid to DIR/started once its
 * handlers are in place, and exits 0 once DIR/release exists (or 99 after
 * 60 s, or on a setup error).  A shell's trap may run once for two
 * signals, or not at all when another arrives during it: a handler that
 * only write(2)s runs once per delivery.
 */
#include "config.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static int log_fd = -1;

static void
on_signal(int sig)
{
	int saved = errno;
	const char *line = sig == SIGTERM ? "TERM\n" :
			   sig == SIGWINCH ? "WINCH\n" : "CONT\n";

	if (write(log_fd, line, strlen(line)) < 0)
		_exit(99);
	errno = saved;
}

int
main(int argc, char **argv)
{
	static const int sigs[] = { SIGTERM, SIGWINCH, SIGCONT };
	char path[4096], tmp[4096];
	struct timespec tick = { 0, 50000000L };
	struct sigaction sa;
	FILE *f;
	int i;

	if (argc != 2) {
		fprintf(stderr, "usage: sig_count DIR\n");
		return 99;
	}
	snprintf(path, sizeof(path), "%s/log", argv[1]);
	log_fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
	if (log_fd < 0) {
		perror(path);
		return 99;
	}
	memset(&sa, 0, sizeof(sa));
	sa.sa_handler = on_signal;
	sigemptyset(&sa.sa_mask);
	for (i = 0; i < 3; i++)
		sigaddset(&sa.sa_mask, sigs[i]);
	for (i = 0; i < 3; i++) {
		if (sigaction(sigs[i], &sa, NULL) != 0) {
			perror("sigaction");
			return 99;
		}
	}
	snprintf(tmp, sizeof(tmp), "%s/started.tmp", argv[1]);
	snprintf(path, sizeof(path), "%s/started", argv[1]);
	f = fopen(tmp, "w");
	if (f == NULL || fprintf(f, "%ld\n", (long)getppid()) < 0 ||
	    fclose(f) != 0 || rename(tmp, path) != 0) {
		perror(tmp);
		return 99;
	}
	snprintf(path, sizeof(path), "%s/release", argv[1]);
	for (i = 0; i < 1200; i++) {
		if (access(path, F_OK) == 0)
			return 0;
		nanosleep(&tick, NULL);
	}
	return 99;
}
