/* SPDX-License-Identifier: MIT */
/*
 * pty_run READY HANGUP -- COMMAND [ARG...]: runs COMMAND as the leader of a
 * new session whose controlling terminal is a fresh pseudo-terminal, as
 * `ssh -t host COMMAND` does.  Once the file READY exists it closes the
 * terminal's master side (a hangup: the kernel sends SIGHUP to the session
 * leader), or, when HANGUP is "-", waits without hanging up.  Prints
 * "exit N" or "signal N" for COMMAND and exits 0; exits 2 when COMMAND had
 * not ended 120 s after the hangup (it is then killed) and 99 on a setup
 * error.  What COMMAND writes to the terminal is read and dropped.
 */
#include "config.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define LIMIT_S 120

static int
report(int status)
{
	if (WIFEXITED(status))
		printf("exit %d\n", WEXITSTATUS(status));
	else
		printf("signal %d\n", WTERMSIG(status));
	return 0;
}

int
main(int argc, char **argv)
{
	struct stat st;
	char buf[256];
	const char *slave;
	int master, fd, status;
	time_t end = 0;
	pid_t pid;

	if (argc < 5 || strcmp(argv[3], "--") != 0) {
		fputs("usage: pty_run READY HANGUP|- -- COMMAND [ARG...]\n",
		      stderr);
		return 99;
	}
	master = posix_openpt(O_RDWR | O_NOCTTY);
	if (master < 0 || grantpt(master) != 0 || unlockpt(master) != 0 ||
	    (slave = ptsname(master)) == NULL) {
		perror("pty_run: pseudo-terminal");
		return 99;
	}
	pid = fork();
	if (pid < 0) {
		perror("pty_run: fork");
		return 99;
	}
	if (pid == 0) {
		close(master);
		if (setsid() < 0 || (fd = open(slave, O_RDWR)) < 0 ||
		    ioctl(fd, TIOCSCTTY, 0) != 0) {
			perror("pty_run: terminal");
			_exit(99);
		}
		dup2(fd, 0);
		dup2(fd, 1);
		dup2(fd, 2);
		if (fd > 2)
			close(fd);
		execvp(argv[4], argv + 4);
		_exit(127);
	}
	for (;;) {
		struct pollfd pfd = { .fd = master, .events = POLLIN };

		if (waitpid(pid, &status, WNOHANG) == pid)
			return report(status);
		if (end != 0 && time(NULL) > end) {
			kill(pid, SIGKILL);
			waitpid(pid, &status, 0);
			fputs("pty_run: COMMAND did not end after the hangup\n",
			      stderr);
			return 2;
		}
		/* After the last slave descriptor is closed the master
		 * reads EIO at once: then it only waits. */
		if (master < 0 || poll(&pfd, 1, 50) <= 0 ||
		    read(master, buf, sizeof buf) <= 0)
			poll(NULL, 0, 50);
		if (end == 0 && stat(argv[1], &st) == 0) {
			end = time(NULL) + LIMIT_S;
			if (strcmp(argv[2], "-") != 0) {
				close(master);
				master = -1;
			}
		}
	}
}
