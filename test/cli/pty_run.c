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
 *
 * With PTY_RUN_INPUT=FILE in the environment, FILE is a script of lines
 * carried out in order while COMMAND runs: "wait PATH" waits until PATH
 * exists, "send TEXT" types TEXT on the terminal (\n, \\ and \xHH are
 * escapes: \x03 is Ctrl-C, \x1a Ctrl-Z).  The whole run then has 120 s.
 */
#include "config.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define LIMIT_S 120

static char *script; /* the PTY_RUN_INPUT file, its lines in turn */

/* The script's next step, if it can be taken now: 1 when done, 0 when it
 * must wait, -1 on an error. */
static int
step(int master)
{
	struct stat st;
	char *end, *line = script, out[512];
	size_t n = 0;

	if (line == NULL || *line == '\0')
		return 0;
	end = strchr(line, '\n');
	if (end != NULL)
		*end = '\0';
	if (strncmp(line, "wait ", 5) == 0) {
		if (stat(line + 5, &st) != 0) {
			if (end != NULL)
				*end = '\n';
			return 0;
		}
	} else if (strncmp(line, "send ", 5) == 0) {
		for (const char *p = line + 5; *p != '\0' && n < sizeof out;
		     p++) {
			unsigned int x;

			if (*p != '\\') {
				out[n++] = *p;
			} else if (p[1] == 'n') {
				out[n++] = '\n';
				p++;
			} else if (p[1] == 'x' &&
				   sscanf(p + 2, "%2x", &x) == 1) {
				out[n++] = (char)x;
				p += 3;
			} else if (p[1] != '\0') {
				out[n++] = *++p;
			}
		}
		if (write(master, out, n) != (ssize_t)n)
			return -1;
	} else if (*line != '\0') {
		fprintf(stderr, "pty_run: bad script line '%s'\n", line);
		return -1;
	}
	script = end != NULL ? end + 1 : line + strlen(line);
	return 1;
}

static char *
read_script(const char *path)
{
	FILE *f = fopen(path, "r");
	char *buf;
	size_t n;

	if (f == NULL || (buf = calloc(1, 65536)) == NULL)
		return NULL;
	n = fread(buf, 1, 65535, f);
	buf[n] = '\0';
	fclose(f);
	return buf;
}

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
	bool ready = false;
	pid_t pid;

	if (argc < 5 || strcmp(argv[3], "--") != 0) {
		fputs("usage: pty_run READY HANGUP|- -- COMMAND [ARG...]\n",
		      stderr);
		return 99;
	}
	if (getenv("PTY_RUN_INPUT") != NULL) {
		if ((script = read_script(getenv("PTY_RUN_INPUT"))) == NULL) {
			perror("pty_run: PTY_RUN_INPUT");
			return 99;
		}
		end = time(NULL) + LIMIT_S;
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
			fprintf(stderr, "pty_run: COMMAND did not end in time%s\n",
				script != NULL && *script != '\0'
					? " (the input script was waiting)"
					: "");
			if (script != NULL && *script != '\0')
				fprintf(stderr, "pty_run: at: %.80s\n", script);
			return 2;
		}
		while (master >= 0 && script != NULL) {
			int rc = step(master);

			if (rc < 0) {
				kill(pid, SIGKILL);
				waitpid(pid, &status, 0);
				return 99;
			}
			if (rc == 0)
				break;
		}
		/* After the last slave descriptor is closed the master
		 * reads EIO at once: then it only waits. */
		if (master < 0 || poll(&pfd, 1, 50) <= 0 ||
		    read(master, buf, sizeof buf) <= 0)
			poll(NULL, 0, 50);
		if (!ready && stat(argv[1], &st) == 0) {
			ready = true;
			if (end == 0)
				end = time(NULL) + LIMIT_S;
			if (strcmp(argv[2], "-") != 0) {
				close(master);
				master = -1;
			}
		}
	}
}
