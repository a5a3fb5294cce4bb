/* SPDX-License-Identifier: MIT */
/*
 * keylock(1): runs a command while holding a key of a provider (local:,
 * redis://, postgresql://), like flock(1) or `etcdctl lock`, and reports the
 * keys' state with `keylock status`.
 *
 * Threads and signals.  Every signal that can be caught (but SIGCHLD and
 * SIGCONT) is blocked in main() before anything else runs, so every thread
 * the library may start inherits the mask, and one thread (sig_main) takes
 * them with sigwaitinfo: no signal can end keylock, and so release the key,
 * while the command runs.  What it does with a signal depends on the phase,
 * which it reads under sigs.mu:
 *   WAIT  the lock is being acquired: a signal that would end a process
 *         fires the cancel token of the kl_call, the wait leaves the queue
 *         with KL_ECANCELED, and keylock dies of that signal (exit status
 *         128+N); a stop signal stops keylock; the others are ignored;
 *   IDLE  acquired, no command yet: the same, except that the key is
 *         released instead of the queue left;
 *   RUN   it sends the signal to the command's process group, but not
 *         a copy that the same sender sent twice in a row (is_echo);
 *   DONE  the command has exited: nothing changes the exit status any more.
 * The command runs in a process group of its own, so that a signal sent to
 * keylock's group reaches it once, through keylock, rather than once
 * directly and once more forwarded; and a hangup that the kernel sends to
 * keylock alone as a session leader reaches it too.  The price is job
 * control: keylock hands the terminal to the command's group while it
 * runs (as a shell's job; in a script or a pipeline, once the command
 * needs it), and
 * mirrors its stops (follow_stop).  The command is waited for
 * with WNOWAIT first and marked DONE before it is reaped, so a signal is
 * never sent to a pid that may have been reused.
 *
 * The command is started with fork and execve.  execvp is not async-signal-
 * safe (it may allocate), and the child of a threaded process may only call
 * such functions, so the PATH search, the environment and the argv for a
 * script without "#!" are all built before the fork; the child restores the
 * signal mask, tries the candidates as execvp would, and on failure writes
 * errno to a close-on-exec pipe, which is how the parent tells 126 from 127.
 */
#include "config.h"

#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <inttypes.h>
#include <pthread.h>
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
#include <time.h>
#include <unistd.h>

#include "keylock.h"

#define PROG "keylock"

/* Exit statuses: sysexits(3) values, as flock(1) uses them, and the shell's
 * for a command that could not be run. */
#define EXIT_USAGE 64        /* EX_USAGE */
#define EXIT_UNAVAILABLE 69  /* EX_UNAVAILABLE: the provider failed */
#define EXIT_SOFTWARE 70     /* EX_SOFTWARE: an unexpected library status */
#define EXIT_OSERR 71        /* EX_OSERR: fork, pipe or memory failed */
#define EXIT_NOT_ACQUIRED 75 /* EX_TEMPFAIL */
#define EXIT_CANNOT_INVOKE 126
#define EXIT_ENOENT 127

#define SHOWN_MAX 72 /* bytes of a key or scheme shown in a message */

extern char **environ;

struct options {
	const char *provider; /* the URI; never printed, only its scheme */
	int64_t wait_ms;      /* KL_FOREVER, 0 = try once */
	int64_t ttl_ms;       /* 0 = the provider's default */
	int conflict_exit;
	bool quiet;
	bool verbose;
	bool shared;     /* -s: KL_SHARED; -x (the default) clears it */
	bool status;     /* `keylock status [KEY]` */
	bool list;       /* `keylock list` */
	bool json;       /* --json, with list */
	bool key_opts;   /* -k or -c given: a KEY is meant, not list */
	const char *key; /* NULL only for a status of every key or a set */
	const char **keys; /* -k KEY ...: a set, taken all or nothing */
	size_t nkeys;
	char **command;  /* NULL-terminated tail of argv, or sh_argv */
	const char *shell_command; /* -c STRING */
	char *sh_argv[4];          /* /bin/sh -c STRING NULL */
};

/* ------------------------------------------------------------------ */
/* Messages                                                            */

static void
usage(void)
{
	fputs("Usage:\n"
	      " " PROG " [options] KEY -- COMMAND [ARG...]\n"
	      " " PROG " [options] KEY -c STRING\n"
	      " " PROG " [options] status [KEY]\n"
	      " " PROG " [options] list [--json]\n"
	      " " PROG " [options] -k KEY [-k KEY...] -- COMMAND [ARG...]\n"
	      " " PROG " [options] -k KEY [-k KEY...] -c STRING\n"
	      "\n"
	      "Run COMMAND while holding the lock KEY; processes waiting for "
	      "one key\n"
	      "get it in the order they asked.\n"
	      "\n"
	      "Options:\n"
	      " -p, --provider URI          where the locks live: local:[DIR]"
	      " (default),\n"
	      "                               redis://..., postgresql://...\n"
	      " -w, --wait, --timeout DURATION\n"
	      "                             give up after DURATION (default:"
	      " forever);\n"
	      "                               0 tries once\n"
	      " -n, --nonblock              the same as --wait 0 (also --nb,\n"
	      "                               --nonblocking)\n"
	      " -t, --ttl DURATION          lease time, for providers with "
	      "leases\n"
	      " -E, --conflict-exit-code N  exit status when KEY is not "
	      "acquired\n"
	      "                               (0 to 255, default 75)\n"
	      " -k, --key KEY               take KEY as a member of a set of "
	      "keys,\n"
	      "                               all or nothing, without deadlock"
	      " (repeat\n"
	      "                               -k for each key; no KEY before "
	      "-- then)\n"
	      " -c, --command STRING        run STRING with /bin/sh -c instead"
	      " of\n"
	      "                               -- COMMAND (KEY -c STRING also"
	      " works)\n"
	      " -s, --shared                a shared lock: shared holders of"
	      " a key hold\n"
	      "                               it together, an exclusive one"
	      " alone\n"
	      " -x, -e, --exclusive         an exclusive lock (the default)\n"
	      "     --json                  list: one JSON document for "
	      "scripts\n"
	      " -q, --quiet                 do not report a KEY not acquired\n"
	      " -v, --verbose               report waited and held times\n"
	      " -h, --help                  display this help and exit\n"
	      " -V, --version               display the version and exit\n"
	      "\n"
	      "DURATION is seconds (\"5\", \"1.5\", \".5\") or a number with a unit "
	      "(250ms, 5s,\n"
	      "1.5m, 2h, 1d), or \"forever\".\n"
	      "\n"
	      "Exit status: the command's; 75 (or -E's) KEY not acquired; 64 "
	      "usage\n"
	      "error; 69 provider unavailable; 70 internal error; 71 system "
	      "error;\n"
	      "126 COMMAND not executable; 127 COMMAND not found; 128+N "
	      "COMMAND\n"
	      "killed by signal N.\n"
	      "\n"
	      "For more details see keylock(1).\n",
	      stdout);
}

/* "keylock: MESSAGE" and a newline on stderr. */
static void
vnote(const char *fmt, va_list ap)
{
	fputs(PROG ": ", stderr);
	vfprintf(stderr, fmt, ap);
	fputc('\n', stderr);
}

static void
usage_error(const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vnote(fmt, ap);
	va_end(ap);
	fputs("Try '" PROG " --help' for more information.\n", stderr);
	exit(EXIT_USAGE);
}

static void
note(const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vnote(fmt, ap);
	va_end(ap);
}

/* s made fit for a message: control and non-ASCII bytes become '?', long
 * text is cut with "...". */
static const char *
shown(char *buf, size_t size, const char *s)
{
	size_t i, n = 0;

	for (i = 0; s[i] != '\0' && n + 4 < size; i++) {
		unsigned char ch = (unsigned char)s[i];

		buf[n++] = ch >= 0x20 && ch < 0x7f ? (char)ch : '?';
	}
	if (s[i] != '\0') {
		memcpy(buf + n, "...", 3);
		n += 3;
	}
	buf[n] = '\0';
	return buf;
}

/* The keys of a set for messages: "A, B, C", cut short like shown's. */
static const char *
shown_set(char *buf, size_t size, const struct options *o)
{
	char one[SHOWN_MAX];
	size_t n = 0;

	buf[0] = '\0';
	for (size_t i = 0; i < o->nkeys && n + 1 < size; i++) {
		int w = snprintf(buf + n, size - n, "%s%s", i > 0 ? ", " : "",
				 shown(one, sizeof one, o->keys[i]));

		if (w < 0 || (size_t)w >= size - n) {
			if (size >= 4)
				memcpy(buf + size - 4, "...", 4);
			break;
		}
		n += (size_t)w;
	}
	return buf;
}

/* The scheme of uri ("redis" of "redis://u:p@h"): the only part of a URI
 * keylock prints, since the rest may hold a password.  "?" when uri does not
 * start with a scheme. */
static const char *
uri_scheme(char *buf, size_t size, const char *uri)
{
	static const char chars[] = "abcdefghijklmnopqrstuvwxyz"
				    "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789+-.";
	size_t n = strspn(uri, chars);

	if (n == 0 || uri[n] != ':' || n >= size)
		n = 0;
	memcpy(buf, uri, n);
	buf[n] = '\0';
	return n > 0 ? buf : "?";
}

/* Whether the query parameter name[0..len) may hold a secret. */
static bool
secret_param(const char *name, size_t len)
{
	static const char *const words[] = { "pass", "pwd", "secret",
					      "token", "auth" };

	for (size_t w = 0; w < sizeof words / sizeof words[0]; w++) {
		size_t wl = strlen(words[w]);

		for (size_t i = 0; i + wl <= len; i++)
			if (strncasecmp(name + i, words[w], wl) == 0)
				return true;
	}
	return false;
}

/* uri for a message, without what may be a secret: the password of
 * "scheme://user:PASSWORD@host" and the value of every query parameter
 * whose name holds pass, pwd, secret, token or auth become "***"; then cut
 * and made printable as shown does. */
static const char *
uri_shown(char *buf, size_t size, const char *uri)
{
	size_t len = strlen(uri), n = 0, i = 0;
	const char *auth = strstr(uri, "://");
	const char *auth_end, *at = NULL, *colon = NULL, *p;
	char *tmp = malloc(len + 1 + 3 * (len / 2 + 1));

	if (tmp == NULL)
		return uri_scheme(buf, size, uri);
	if (auth != NULL) {
		auth += 3;
		auth_end = auth + strcspn(auth, "/?#");
		for (p = auth; p < auth_end; p++)
			if (*p == '@')
				at = p;
		if (at != NULL)
			colon = memchr(auth, ':', (size_t)(at - auth));
	}
	while (i < len) {
		if (colon != NULL && uri + i == colon + 1) {
			memcpy(tmp + n, "***", 3);
			n += 3;
			i = (size_t)(at - uri);
			continue;
		}
		tmp[n++] = uri[i];
		if (uri[i] == '?' || uri[i] == '&' || uri[i] == ';') {
			/* name=value: the value hidden when the name says */
			const char *name = uri + i + 1;
			size_t nl = strcspn(name, "=&;#");

			if (name[nl] == '=' && secret_param(name, nl)) {
				memcpy(tmp + n, name, nl + 1);
				n += nl + 1;
				memcpy(tmp + n, "***", 3);
				n += 3;
				i += 1 + nl + 1;
				i += strcspn(uri + i, "&;#");
				continue;
			}
		}
		i++;
	}
	tmp[n] = '\0';
	shown(buf, size, tmp);
	free(tmp);
	return buf;
}

/* "250 ms", "5 s", "1.5 s". */
static const char *
format_ms(char *buf, size_t size, int64_t ms)
{
	int64_t frac = ms % 1000;
	int digits = 3;

	if (ms < 1000) {
		snprintf(buf, size, "%" PRId64 " ms", ms);
		return buf;
	}
	if (frac == 0) {
		snprintf(buf, size, "%" PRId64 " s", ms / 1000);
		return buf;
	}
	for (; frac % 10 == 0; frac /= 10)
		digits--;
	snprintf(buf, size, "%" PRId64 ".%0*" PRId64 " s", ms / 1000, digits,
		 frac);
	return buf;
}

/* ------------------------------------------------------------------ */
/* Options                                                             */

/* A DURATION option: as kl_duration_parse reads it, except that a bare
 * number is seconds, as in flock(1) and timeout(1). */
static int64_t
parse_duration(const char *option, const char *text, bool forever_ok)
{
	char buf[SHOWN_MAX];
	size_t len = strlen(text);
	char *with_unit = NULL;
	int64_t ms;
	int rc;

	/* flock(1) takes ".5" and "5." as well (strtod's numbers); they are
	 * given kl_duration_parse as "0.5s" and "5.0s". */
	if (len > 0 && strspn(text, "0123456789.") == len &&
	    strpbrk(text, "0123456789") != NULL) {
		if ((with_unit = malloc(len + 4)) == NULL) {
			note("out of memory");
			exit(EXIT_OSERR);
		}
		snprintf(with_unit, len + 4, "%s%s%ss",
			 text[0] == '.' ? "0" : "", text,
			 text[len - 1] == '.' ? "0" : "");
	}
	rc = kl_duration_parse(with_unit != NULL ? with_unit : text, &ms);
	free(with_unit);
	if (rc != KL_OK || (ms == KL_FOREVER && !forever_ok))
		usage_error("invalid %s '%s' (a number of seconds, or a number "
			    "with a unit: 250ms, 5s, 1.5m, 2h, 1d%s)",
			    option, shown(buf, sizeof buf, text),
			    forever_ok ? ", or forever" : "");
	return ms;
}

static int
parse_exit_code(const char *text)
{
	char buf[SHOWN_MAX];
	char *end;
	long n;

	errno = 0;
	n = strtol(text, &end, 10);
	if (text[0] < '0' || text[0] > '9' || *end != '\0' || errno != 0 ||
	    n > 255)
		usage_error("invalid exit code '%s' (0 to 255)",
			    shown(buf, sizeof buf, text));
	return (int)n;
}

/* The key reaches the command in KEYLOCK_KEY: one that execve would refuse
 * (E2BIG) is a usage error now, before anything is locked, rather than a
 * command that cannot be run once the key is held. */
static void
check_key_fits(const struct options *o, const char *key)
{
	long argmax = sysconf(_SC_ARG_MAX);
	size_t key_len, var, total;
	char **v;

	if (key == NULL)
		return;
	key_len = strlen(key);
	var = sizeof "KEYLOCK_KEY=" + key_len;
#ifdef __linux__
	{
		/* Linux's MAX_ARG_STRLEN: 32 pages for one string. */
		long page = sysconf(_SC_PAGESIZE);

		if (page > 0 && var > (size_t)page * 32)
			usage_error("the KEY is too long to pass to the "
				    "command in KEYLOCK_KEY (%zu bytes, at "
				    "most %zu)",
				    key_len,
				    (size_t)page * 32 - sizeof "KEYLOCK_KEY=");
	}
#endif
	/* Strings and pointers, as execve counts them. */
	total = var + sizeof "KEYLOCK_FENCE=18446744073709551615" +
		3 * sizeof(char *);
	for (v = o->command; v != NULL && *v != NULL; v++)
		total += strlen(*v) + 1 + sizeof(char *);
	for (v = environ; v != NULL && *v != NULL; v++)
		total += strlen(*v) + 1 + sizeof(char *);
	if (argmax > 0 && total > (size_t)argmax)
		usage_error("the KEY (%zu bytes) does not fit in the "
			    "command's environment beside its arguments and "
			    "the other variables (%zu bytes in all, at most "
			    "%ld)",
			    key_len, total, argmax);
}

static const struct option longopts[] = {
	{ "provider", required_argument, NULL, 'p' },
	{ "wait", required_argument, NULL, 'w' },
	{ "timeout", required_argument, NULL, 'w' },
	{ "nonblock", no_argument, NULL, 'n' },
	{ "nonblocking", no_argument, NULL, 'n' },
	{ "nb", no_argument, NULL, 'n' },
	{ "exclusive", no_argument, NULL, 'x' },
	{ "shared", no_argument, NULL, 's' },
	{ "command", required_argument, NULL, 'c' },
	{ "key", required_argument, NULL, 'k' },
	{ "ttl", required_argument, NULL, 't' },
	{ "conflict-exit-code", required_argument, NULL, 'E' },
	{ "quiet", no_argument, NULL, 'q' },
	{ "verbose", no_argument, NULL, 'v' },
	{ "json", no_argument, NULL, 'J' },
	{ "help", no_argument, NULL, 'h' },
	{ "version", no_argument, NULL, 'V' },
	{ NULL, 0, NULL, 0 },
};

/* The options up to the first argument that is not one; *last_arg is the
 * argument of the last option. */
static void
parse_opts(int argc, char **argv, struct options *o, const char **last_arg)
{
	int c;

	while ((c = getopt_long(argc, argv, "+p:w:nt:E:qvhVxesc:k:", longopts,
				NULL)) != -1) {
		*last_arg = optarg;
		switch (c) {
		case 'p':
			o->provider = optarg;
			break;
		case 'w':
			o->wait_ms = parse_duration("wait", optarg, true);
			break;
		case 'n':
			o->wait_ms = 0;
			break;
		case 'x':
		case 'e':
			o->shared = false; /* the last of -s and -x counts */
			break;
		case 's':
			o->shared = true;
			break;
		case 'c':
			o->shell_command = optarg;
			o->key_opts = true;
			break;
		case 'k':
			if (optarg[0] == '\0')
				usage_error("the KEY of -k is empty");
			o->keys[o->nkeys++] = optarg;
			o->key_opts = true;
			break;
		case 't':
			o->ttl_ms = parse_duration("ttl", optarg, false);
			break;
		case 'E':
			o->conflict_exit = parse_exit_code(optarg);
			break;
		case 'q':
			o->quiet = true;
			break;
		case 'v':
			o->verbose = true;
			break;
		case 'J':
			o->json = true;
			break;
		case 'h':
			usage();
			exit(EXIT_SUCCESS);
		case 'V':
			printf(PROG " %s (libkeylock %s)\n", PACKAGE_VERSION,
			       kl_version());
			exit(EXIT_SUCCESS);
		default: /* getopt has said what is wrong */
			fputs("Try '" PROG " --help' for more information.\n",
			      stderr);
			exit(EXIT_USAGE);
		}
	}
}

/* `keylock [options] list [options]`: "list" first among the arguments
 * that are not options, not followed by "--" or "-c" (then it is a KEY, as
 * in `keylock list -- make`), and no -k or -c before it.  The options may
 * follow it (`keylock list -p URI --json`); nothing else may. */
static bool
parse_list(int argc, char **argv, struct options *o, const char **last_arg)
{
	char buf[SHOWN_MAX];
	char **rest = argv + optind;
	int n = argc - optind;

	if (o->key_opts || n == 0 || strcmp(rest[0], "list") != 0 ||
	    (n >= 2 && (strcmp(rest[1], "--") == 0 ||
			strcmp(rest[1], "-c") == 0)))
		return false;
	optind++;
	parse_opts(argc, argv, o, last_arg);
	if (o->key_opts)
		usage_error("list takes no KEY: it shows every key (no -k, "
			    "no -c)");
	if (optind < argc)
		usage_error("list takes no KEY or other argument: unexpected "
			    "'%s' (" PROG " list [-p URI] [--json])",
			    shown(buf, sizeof buf, argv[optind]));
	o->list = true;
	return true;
}

static void
parse_args(int argc, char **argv, struct options *o)
{
	char buf[SHOWN_MAX], scheme[16];
	const char *last_arg = NULL; /* the argument of the last option */
	const char *first;
	char **rest;
	int n;

	o->provider = "local:";
	o->wait_ms = KL_FOREVER;
	o->ttl_ms = 0;
	o->conflict_exit = EXIT_NOT_ACQUIRED;
	/* getopt names the program by argv[0] in its messages; the libtool
	 * wrapper of the build tree runs it as lt-keylock. */
	argv[0] = (char *)PROG;
	/* At most one key per argument. */
	if ((o->keys = calloc((size_t)argc, sizeof *o->keys)) == NULL) {
		fputs(PROG ": out of memory\n", stderr);
		exit(EXIT_OSERR);
	}
	parse_opts(argc, argv, o, &last_arg);
	parse_list(argc, argv, o, &last_arg);
	if (o->json && !o->list)
		usage_error("--json goes with list (" PROG " list --json)");

	/* A memory: lock means nothing outside this process. */
	uri_scheme(scheme, sizeof scheme, o->provider);
	if (strcasecmp(scheme, "memory") == 0)
		usage_error("the memory: provider locks within one process "
			    "only; use local: to lock across processes");
	if (o->list)
		return;

	rest = argv + optind;
	n = argc - optind;
	if (o->nkeys > 0) {
		/* The keys are -k's: getopt has taken a "--" that ends the
		 * options, and what follows it is the command, so that no
		 * command word is ever read as a KEY.  A "--" that was the
		 * argument of the last option (-k --, -c --) ends nothing. */
		bool dashes = optind > 0 && argv[optind - 1] != last_arg &&
			      strcmp(argv[optind - 1], "--") == 0;

		if (o->shell_command != NULL) {
			if (n != 0 || dashes)
				usage_error("-c STRING takes the place of -- "
					    "COMMAND: nothing may follow it "
					    "with -k");
			o->sh_argv[0] = (char *)"/bin/sh";
			o->sh_argv[1] = (char *)"-c";
			o->sh_argv[2] = (char *)o->shell_command;
			o->sh_argv[3] = NULL;
			o->command = o->sh_argv;
		} else if (!dashes) {
			usage_error(n == 0 ? "no COMMAND given (" PROG
					     " -k KEY -- COMMAND)"
					   : "'--' expected after the -k KEYs, "
					     "found '%s' (no KEY argument "
					     "with -k)",
				    n == 0 ? "" : shown(buf, sizeof buf,
							rest[0]));
		} else if (n == 0) {
			usage_error("no COMMAND given after '--'");
		} else {
			o->command = rest;
		}
		/* Only the first key in canonical order reaches the command
		 * (KEYLOCK_KEY); strcmp orders bytes as unsigned, as the
		 * canonical order does. */
		first = o->keys[0];
		for (size_t i = 1; i < o->nkeys; i++)
			if (strcmp(o->keys[i], first) < 0)
				first = o->keys[i];
		check_key_fits(o, first);
		return;
	}
	if (n == 0)
		usage_error("no KEY given");
	if (n >= 2 && strcmp(rest[1], "-c") == 0) {
		/* flock's order: KEY -c STRING */
		if (o->shell_command != NULL)
			usage_error("-c given twice");
		if (n != 3)
			usage_error(n == 2 ? "no STRING given after -c"
					   : "unexpected argument '%s' after "
					     "-c STRING",
				    n == 2 ? "" : shown(buf, sizeof buf,
							rest[3]));
		o->key = rest[0];
		o->shell_command = rest[2];
	} else if (o->shell_command != NULL) {
		if (n != 1 || strcmp(rest[0], "status") == 0)
			usage_error("-c STRING takes the place of -- COMMAND: "
				    "nothing may follow KEY");
		o->key = rest[0];
	} else if (n >= 2 && strcmp(rest[1], "--") == 0) {
		o->key = rest[0];
		o->command = rest + 2;
		if (n == 2)
			usage_error("no COMMAND given after '--'");
	} else if (strcmp(rest[0], "status") == 0) {
		o->status = true;
		if (n > 2)
			usage_error("unexpected argument '%s' after KEY",
				    shown(buf, sizeof buf, rest[2]));
		o->key = n == 2 ? rest[1] : NULL;
	} else if (n == 1) {
		usage_error("no COMMAND given (" PROG " KEY -- COMMAND)");
	} else {
		usage_error("'--' expected after KEY, found '%s' (options go "
			    "before KEY)",
			    shown(buf, sizeof buf, rest[1]));
	}
	if (o->key != NULL && o->key[0] == '\0')
		usage_error("the KEY is empty");
	if (o->shell_command != NULL) {
		o->sh_argv[0] = (char *)"/bin/sh";
		o->sh_argv[1] = (char *)"-c";
		o->sh_argv[2] = (char *)o->shell_command;
		o->sh_argv[3] = NULL;
		o->command = o->sh_argv;
	}
	if (!o->status)
		check_key_fits(o, o->key);
}

/* ------------------------------------------------------------------ */
/* Provider                                                            */

/* Opens the provider of o or exits: 64 for a URI the library cannot read,
 * 69 when the provider cannot be reached. */
static kl_provider *
open_provider(const struct options *o)
{
	kl_provider *p;
	kl_error err = { 0 };
	char scheme[16];
	int rc;

	rc = kl_provider_open(&p, o->provider, &err);
	if (rc == KL_OK)
		return p;
	if (err.message[0] == '\0')
		snprintf(err.message, sizeof err.message, "%s",
			 kl_strerror(rc));
	if (strcmp(uri_scheme(scheme, sizeof scheme, o->provider), "?") ==
	    0) {
		if (rc == KL_EINVAL)
			usage_error("the provider URI has no scheme: expected "
				    "local:[DIR], redis://... or "
				    "postgresql://...");
		note("provider: %s", err.message);
	} else if (rc == KL_EINVAL) {
		usage_error("provider '%s:': %s", scheme, err.message);
	} else {
		note("provider '%s:': %s", scheme, err.message);
	}
	exit(rc == KL_ENOMEM ? EXIT_OSERR : EXIT_UNAVAILABLE);
}

/* The exit status for a failure of the library other than not acquired. */
static int
failure_exit(int rc)
{
	switch (rc) {
	case KL_EPROVIDER:
		return EXIT_UNAVAILABLE;
	case KL_ENOMEM:
		return EXIT_OSERR;
	default:
		return EXIT_SOFTWARE;
	}
}

/* ------------------------------------------------------------------ */
/* Snapshots: keylock list, keylock status                             */

/* One entry of a snapshot, copied: the strings are valid in the callback
 * only. */
struct entry {
	char *key; /* key_len bytes and a NUL; NULL: the provider has no name */
	size_t key_len;
	char *detail; /* or NULL */
	bool waiting, shared;
	int64_t pid, tid, elapsed_ms;
	uint64_t fence;
	size_t position;
	size_t waiters; /* of the entry's key */
};

struct snap {
	struct entry *v;
	size_t n, cap;
	bool nomem;
};

static void
snap_free(struct snap *sn)
{
	for (size_t i = 0; i < sn->n; i++) {
		free(sn->v[i].key);
		free(sn->v[i].detail);
	}
	free(sn->v);
	memset(sn, 0, sizeof *sn);
}

static int
snap_add(const kl_lock_info *info, void *arg)
{
	struct snap *sn = arg;
	struct entry *e;

	if (sn->n == sn->cap) {
		size_t cap = sn->cap > 0 ? sn->cap * 2 : 32;
		struct entry *v = realloc(sn->v, cap * sizeof *v);

		if (v == NULL)
			goto nomem;
		sn->v = v;
		sn->cap = cap;
	}
	e = &sn->v[sn->n];
	memset(e, 0, sizeof *e);
	if (info->key != NULL) {
		if ((e->key = malloc(info->key_len + 1)) == NULL)
			goto nomem;
		memcpy(e->key, info->key, info->key_len);
		e->key[info->key_len] = '\0';
		e->key_len = info->key_len;
	}
	if (info->detail != NULL &&
	    (e->detail = strdup(info->detail)) == NULL) {
		free(e->key);
		goto nomem;
	}
	e->waiting = info->waiting;
	e->shared = info->shared;
	e->pid = info->pid;
	e->tid = info->tid;
	e->elapsed_ms = info->elapsed_ms;
	e->fence = info->fence;
	e->position = info->position;
	sn->n++;
	return 0;
nomem:
	sn->nomem = true;
	return 1;
}

/* The length of the part of a detail that names the lock: the PostgreSQL
 * provider ends each entry's detail with the session's ", server process
 * N", so that the holders and waiters of one advisory lock differ there
 * only (kl_pg_provider_open(3)). */
static size_t
lock_name_len(const char *detail)
{
	static const char tail[] = ", server process ";
	const char *t = strstr(detail, tail), *d;

	while (t != NULL) {
		d = t + sizeof tail - 1;
		if (*d >= '0' && *d <= '9') {
			while (*d >= '0' && *d <= '9')
				d++;
			if (*d == '\0')
				return (size_t)(t - detail);
		}
		t = strstr(t + 1, tail);
	}
	return strlen(detail);
}

static bool
same_key(const struct entry *a, const struct entry *b)
{
	size_t n;

	if (a->key != NULL || b->key != NULL)
		return a->key != NULL && b->key != NULL &&
		       a->key_len == b->key_len &&
		       memcmp(a->key, b->key, a->key_len) == 0;
	if (a->detail == NULL || b->detail == NULL)
		return false;
	n = lock_name_len(a->detail);
	return n == lock_name_len(b->detail) &&
	       memcmp(a->detail, b->detail, n) == 0;
}

/* Takes the snapshot of p into sn and counts each key's waiters (the
 * entries of a key come together).  KL_OK, or a status with err filled. */
static int
snap_take(kl_provider *p, struct snap *sn, kl_error *err)
{
	size_t i, j, k, w;
	int rc;

	memset(sn, 0, sizeof *sn);
	rc = kl_provider_snapshot(p, snap_add, sn, err);
	if (rc == KL_OK && sn->nomem)
		rc = KL_ENOMEM;
	if (rc != KL_OK) {
		if (rc == KL_ENOMEM && err->message[0] == '\0')
			snprintf(err->message, sizeof err->message, "%s",
				 kl_strerror(rc));
		snap_free(sn);
		return rc;
	}
	for (i = 0; i < sn->n; i = j) {
		for (j = i + 1, w = sn->v[i].waiting; j < sn->n &&
		     same_key(&sn->v[i], &sn->v[j]); j++)
			w += sn->v[j].waiting;
		for (k = i; k < j; k++)
			sn->v[k].waiters = w;
	}
	return KL_OK;
}

/* Byte ch as the table writes it (see key_cell) into esc; its length. */
static size_t
cell_byte(unsigned char ch, char esc[8])
{
	if (ch == '\\')
		return (size_t)snprintf(esc, 8, "\\\\");
	if (ch == '\n')
		return (size_t)snprintf(esc, 8, "\\n");
	if (ch == '\t')
		return (size_t)snprintf(esc, 8, "\\t");
	if (ch == '\r')
		return (size_t)snprintf(esc, 8, "\\r");
	if (ch < 0x20 || ch >= 0x7f)
		return (size_t)snprintf(esc, 8, "\\x%02x", ch);
	return (size_t)snprintf(esc, 8, "%c", ch);
}

/* The key for the table: backslash, control, DEL and non-ASCII bytes as
 * C escapes (\n, \t, \r, \\, \xHH), cut at max characters with "...", so
 * that no key can break a row or talk to the terminal.  Without a key,
 * the provider's name for the lock in brackets, its head and its tail
 * kept: the tail tells apart what the head may not (Redis: the prefix,
 * then the key's digest, and with a prefix of 45 characters every row
 * looked alike; PostgreSQL: the lock's number, then the session's). */
static const char *
key_cell(char *buf, size_t max, const struct entry *e)
{
	const char *s = e->key != NULL ? e->key : e->detail;
	size_t len = e->key != NULL ? e->key_len
				    : (s != NULL ? strlen(s) : 0);
	size_t n = 0, i, j, all = 0, tail = 0, room;
	char esc[8];

	if (e->key != NULL) {
		for (i = 0; i < len; i++) {
			size_t el = cell_byte((unsigned char)s[i], esc);

			if (n + el > max - 4) {
				memcpy(buf + n, "...", 3);
				n += 3;
				break;
			}
			memcpy(buf + n, esc, el);
			n += el;
		}
		buf[n] = '\0';
		return buf;
	}
	for (i = 0; i < len; i++)
		all += cell_byte((unsigned char)s[i], esc);
	/* "[", the name or its head, "..." and its tail, "]", the NUL. */
	room = all + 3 <= max ? all : max - 6;
	j = len;
	if (room < all)
		while (j > 0 &&
		       tail + cell_byte((unsigned char)s[j - 1], esc) <=
			       room / 3) {
			tail += cell_byte((unsigned char)s[j - 1], esc);
			j--;
		}
	buf[n++] = '[';
	for (i = 0; i < j; i++) {
		size_t el = cell_byte((unsigned char)s[i], esc);

		if (room < all && n - 1 + el > room - room / 3) {
			memcpy(buf + n, "...", 3);
			n += 3;
			break;
		}
		memcpy(buf + n, esc, el);
		n += el;
	}
	for (i = j; i < len; i++)
		n += (size_t)snprintf(buf + n, max - n, "%.*s",
				      (int)cell_byte((unsigned char)s[i], esc),
				      esc);
	buf[n++] = ']';
	buf[n] = '\0';
	return buf;
}

/* "250ms", "1.2s", "3m05s", "2h03m", "4d02h"; "-" unknown. */
static const char *
age_cell(char *buf, size_t size, int64_t ms)
{
	if (ms < 0)
		snprintf(buf, size, "-");
	else if (ms < 1000)
		snprintf(buf, size, "%" PRId64 "ms", ms);
	else if (ms < 60000)
		snprintf(buf, size, "%" PRId64 ".%" PRId64 "s", ms / 1000,
			 ms % 1000 / 100);
	else if (ms < 3600000)
		snprintf(buf, size, "%" PRId64 "m%02" PRId64 "s", ms / 60000,
			 ms / 1000 % 60);
	else if (ms < 86400000)
		snprintf(buf, size, "%" PRId64 "h%02" PRId64 "m",
			 ms / 3600000, ms / 60000 % 60);
	else
		snprintf(buf, size, "%" PRId64 "d%02" PRId64 "h",
			 ms / 86400000, ms / 3600000 % 24);
	return buf;
}

#define KEY_CELL_MAX 48 /* a key in the table: 45 characters and "..." */
#define LIST_COLS 9

static const char *const list_head[LIST_COLS] = {
	"KEY", "MODE", "STATE", "POS", "PID", "TID", "TIME", "FENCE",
	"WAITERS",
};

static void
list_row(char cell[LIST_COLS][KEY_CELL_MAX + 8], const struct entry *e)
{
	key_cell(cell[0], KEY_CELL_MAX + 1, e);
	snprintf(cell[1], sizeof cell[1], "%s", e->shared ? "SHARED" : "EXCL");
	snprintf(cell[2], sizeof cell[2], "%s",
		 e->waiting ? "waiting" : "held");
	if (e->waiting)
		snprintf(cell[3], sizeof cell[3], "%zu", e->position + 1);
	else
		snprintf(cell[3], sizeof cell[3], "-");
	if (e->pid > 0)
		snprintf(cell[4], sizeof cell[4], "%" PRId64, e->pid);
	else
		snprintf(cell[4], sizeof cell[4], "-");
	if (e->tid > 0)
		snprintf(cell[5], sizeof cell[5], "%" PRId64, e->tid);
	else
		snprintf(cell[5], sizeof cell[5], "-");
	age_cell(cell[6], sizeof cell[6], e->elapsed_ms);
	if (!e->waiting && e->fence > 0)
		snprintf(cell[7], sizeof cell[7], "%" PRIu64, e->fence);
	else
		snprintf(cell[7], sizeof cell[7], "-");
	snprintf(cell[8], sizeof cell[8], "%zu", e->waiters);
}

/* The table: one row per holder and per waiter, a key's holders first and
 * then its waiters in queue order; the text columns to the left, numbers
 * to the right. */
static void
print_table(const struct snap *sn)
{
	char cell[LIST_COLS][KEY_CELL_MAX + 8];
	size_t width[LIST_COLS], i, c;

	for (c = 0; c < LIST_COLS; c++)
		width[c] = strlen(list_head[c]);
	for (i = 0; i < sn->n; i++) {
		list_row(cell, &sn->v[i]);
		for (c = 0; c < LIST_COLS; c++)
			if (strlen(cell[c]) > width[c])
				width[c] = strlen(cell[c]);
	}
	for (i = 0; i <= sn->n; i++) {
		if (i == 0)
			for (c = 0; c < LIST_COLS; c++)
				snprintf(cell[c], sizeof cell[c], "%s",
					 list_head[c]);
		else
			list_row(cell, &sn->v[i - 1]);
		for (c = 0; c < LIST_COLS; c++) {
			bool left = c <= 2;

			printf(c == 0 ? "%-*s" : left ? "  %-*s" : "  %*s",
			       (int)width[c], cell[c]);
		}
		putchar('\n');
	}
}

/* The length of the valid UTF-8 sequence at s[0..len), or 0 when there is
 * none (a stray byte, an overlong form, a surrogate, beyond U+10FFFF). */
static size_t
utf8_len(const unsigned char *s, size_t len, uint32_t *cp)
{
	size_t n, i;
	uint32_t c, min;

	if (s[0] < 0x80) {
		*cp = s[0];
		return 1;
	}
	if ((s[0] & 0xe0) == 0xc0) {
		n = 2, c = s[0] & 0x1f, min = 0x80;
	} else if ((s[0] & 0xf0) == 0xe0) {
		n = 3, c = s[0] & 0x0f, min = 0x800;
	} else if ((s[0] & 0xf8) == 0xf0) {
		n = 4, c = s[0] & 0x07, min = 0x10000;
	} else {
		return 0;
	}
	if (n > len)
		return 0;
	for (i = 1; i < n; i++) {
		if ((s[i] & 0xc0) != 0x80)
			return 0;
		c = c << 6 | (s[i] & 0x3f);
	}
	if (c < min || c > 0x10ffff || (c >= 0xd800 && c <= 0xdfff))
		return 0;
	*cp = c;
	return n;
}

/* s[0..len) as a JSON string.  Valid UTF-8 passes as it is but for the
 * code points that could talk to a terminal or end a JavaScript line
 * (C0, DEL, C1, U+2028, U+2029), written \uXXXX; each byte that is not
 * part of valid UTF-8 becomes U+FFFD.  Returns whether every byte was
 * valid UTF-8. */
static bool
json_string(const char *s, size_t len)
{
	const unsigned char *u = (const unsigned char *)s;
	bool valid = true;
	uint32_t cp;
	size_t i, n;

	putchar('"');
	for (i = 0; i < len; i += n) {
		n = utf8_len(u + i, len - i, &cp);
		if (n == 0) {
			fputs("\\ufffd", stdout);
			valid = false;
			n = 1;
		} else if (cp == '"' || cp == '\\') {
			printf("\\%c", (char)cp);
		} else if (cp == '\n') {
			fputs("\\n", stdout);
		} else if (cp == '\t') {
			fputs("\\t", stdout);
		} else if (cp == '\r') {
			fputs("\\r", stdout);
		} else if (cp < 0x20 || (cp >= 0x7f && cp < 0xa0) ||
			   cp == 0x2028 || cp == 0x2029) {
			printf("\\u%04" PRIx32, cp);
		} else {
			fwrite(u + i, 1, n, stdout);
		}
	}
	putchar('"');
	return valid;
}

static void
json_int(const char *name, int64_t v, bool known)
{
	if (known)
		printf(", \"%s\": %" PRId64, name, v);
	else
		printf(", \"%s\": null", name);
}

/* One JSON array, one object a line, in the order of the table. */
static void
print_json(const struct snap *sn)
{
	fputs("[", stdout);
	for (size_t i = 0; i < sn->n; i++) {
		const struct entry *e = &sn->v[i];

		fputs(i == 0 ? "\n  {\"key\": " : ",\n  {\"key\": ", stdout);
		if (e->key == NULL) {
			fputs("null", stdout);
		} else if (!json_string(e->key, e->key_len)) {
			/* the exact bytes, for a key that is not UTF-8 */
			fputs(", \"key_hex\": \"", stdout);
			for (size_t b = 0; b < e->key_len; b++)
				printf("%02x", (unsigned char)e->key[b]);
			putchar('"');
		}
		fputs(", \"detail\": ", stdout);
		if (e->detail != NULL)
			json_string(e->detail, strlen(e->detail));
		else
			fputs("null", stdout);
		printf(", \"mode\": \"%s\", \"state\": \"%s\"",
		       e->shared ? "shared" : "exclusive",
		       e->waiting ? "waiting" : "held");
		json_int("position", (int64_t)e->position, e->waiting);
		json_int("pid", e->pid, e->pid > 0);
		json_int("tid", e->tid, e->tid > 0);
		json_int("elapsed_ms", e->elapsed_ms, e->elapsed_ms >= 0);
		if (!e->waiting && e->fence > 0)
			printf(", \"fence\": %" PRIu64, e->fence);
		else
			fputs(", \"fence\": null", stdout);
		printf(", \"waiters\": %zu}", e->waiters);
	}
	fputs(sn->n > 0 ? "\n]\n" : "]\n", stdout);
}

/* `keylock list [--json]` of the open provider p (o->provider is its URI,
 * for messages). */
static int
list_locks(const struct options *o, kl_provider *p)
{
	char ubuf[SHOWN_MAX * 2];
	kl_error err = { 0 };
	struct snap sn;
	int rc;

	if ((rc = snap_take(p, &sn, &err)) != KL_OK) {
		note("cannot list the locks of provider '%s': %s",
		     uri_shown(ubuf, sizeof ubuf, o->provider),
		     err.message[0] != '\0' ? err.message : kl_strerror(rc));
		return failure_exit(rc);
	}
	if (o->json)
		print_json(&sn);
	else
		print_table(&sn);
	snap_free(&sn);
	return fflush(stdout) == 0 && !ferror(stdout) ? EXIT_SUCCESS
						      : EXIT_OSERR;
}

static int
run_list(const struct options *o)
{
	kl_provider *p = open_provider(o);
	int code = list_locks(o, p);

	kl_provider_free(p);
	return code;
}

/* `keylock status [KEY]`: one "name: value" line each, "unknown" for what
 * the provider cannot tell.  The counts come from kl_provider_status; the
 * modes, and the number of keys, from a snapshot where the provider can
 * take one (its entries of a key are of one moment, so then the counts are
 * taken from it too, to agree with the modes). */
static int
run_status(const struct options *o)
{
	char buf[SHOWN_MAX], scheme[16];
	kl_provider *p = open_provider(o);
	kl_error err = { 0 }, serr = { 0 };
	size_t holders = 0, waiters = 0, keys = 0;
	size_t by[2][2] = { { 0, 0 }, { 0, 0 } }; /* [waiting][shared] */
	bool modes = false, listed = false;
	struct snap sn;
	int rc = KL_OK;

	if (o->key != NULL)
		rc = kl_provider_status(p, o->key, &holders, &waiters, &err);
	if (rc != KL_OK) {
		note("%s",
		     err.message[0] != '\0' ? err.message : kl_strerror(rc));
		kl_provider_free(p);
		return failure_exit(rc);
	}
	if (snap_take(p, &sn, &serr) == KL_OK) {
		struct entry want = { .key = (char *)o->key,
				      .key_len = o->key != NULL
							 ? strlen(o->key)
							 : 0 };

		modes = listed = true;
		for (size_t i = 0; i < sn.n; i++) {
			/* a lock the provider cannot name may be this key */
			if (sn.v[i].key == NULL)
				modes = false;
			if (i == 0 || !same_key(&sn.v[i - 1], &sn.v[i]))
				keys++;
			if (o->key != NULL && same_key(&sn.v[i], &want))
				by[sn.v[i].waiting][sn.v[i].shared]++;
		}
		snap_free(&sn);
	}
	printf("provider: %s\n",
	       uri_scheme(scheme, sizeof scheme, o->provider));
	if (o->key != NULL) {
		if (modes) {
			holders = by[0][0] + by[0][1];
			waiters = by[1][0] + by[1][1];
		}
		printf("key: %s\n", shown(buf, sizeof buf, o->key));
		printf("holders: %zu\n", holders);
		if (modes)
			printf("shared holders: %zu\n"
			       "exclusive holders: %zu\n",
			       by[0][1], by[0][0]);
		else
			printf("shared holders: unknown\n"
			       "exclusive holders: unknown\n");
		printf("queue: %zu\n", waiters);
		if (modes)
			printf("shared waiters: %zu\n"
			       "exclusive waiters: %zu\n",
			       by[1][1], by[1][0]);
		else
			printf("shared waiters: unknown\n"
			       "exclusive waiters: unknown\n");
	} else if (listed) {
		printf("keys: %zu\n", keys);
	} else {
		printf("keys: unknown\n");
	}
	kl_provider_free(p);
	return fflush(stdout) == 0 ? EXIT_SUCCESS : EXIT_OSERR;
}

/* ------------------------------------------------------------------ */
/* Signals                                                             */

enum phase { PHASE_WAIT, PHASE_IDLE, PHASE_RUN, PHASE_DONE };

static struct {
	pthread_mutex_t mu;
	sigset_t set;      /* the signals handled, blocked in every thread */
	sigset_t old_mask; /* the mask keylock started with, for the command */
	enum phase phase;
	kl_cancel *cancel; /* fired in PHASE_WAIT */
	pid_t child;       /* valid in PHASE_RUN; also its process group */
	/* The command's group may have the terminal whenever keylock's group
	 * is in the foreground: keylock leads its group (a shell's job), or
	 * the command needed the terminal (see follow_stop). */
	bool tty;
	int pending;       /* first signal before the command ran, or 0 */
	bool chld_ignored; /* SIGCHLD was ignored: so it is for the command */
	/* By signal number, who sent the copy last forwarded, and when: see
	 * is_echo.  Used by sig_main alone. */
	struct sent {
		bool valid;
		pid_t pid;
		uid_t uid;
		struct timespec at;
	} sent[NSIG];
} sigs = { .mu = PTHREAD_MUTEX_INITIALIZER };

/* A second copy of a signal from the same sender within this window is
 * one signal sent twice, not two signals.  timeout(1) sends its signal to
 * keylock and then at once to keylock's group, which holds keylock: both
 * kill(2) calls come back to back, so the second copy is only delivered
 * apart (not merged by the kernel) if sig_main took the first one in
 * between, and then it is taken again as soon as sig_main has forwarded
 * the first.  The gap is keylock's own work plus whatever time the
 * scheduler takes from it: milliseconds, tens of them on a loaded machine.
 * 250 ms leaves room for that and is still shorter than a person or a
 * supervisor takes to send a signal again on purpose; and two copies of a
 * signal sent closer than that never were sure to arrive twice, since
 * the kernel merges those still pending. */
#define ECHO_WINDOW_NS 250000000LL

/* What a signal does by default, for the phases without a command. */
enum sig_default { SD_TERMINATE, SD_IGNORE, SD_STOP };

static enum sig_default
sig_default(int sig)
{
	switch (sig) {
	case SIGCONT:
	case SIGURG:
	case SIGWINCH:
		return SD_IGNORE;
	case SIGTSTP:
	case SIGTTIN:
	case SIGTTOU:
		return SD_STOP;
	default:
		return SD_TERMINATE;
	}
}

/* The controlling terminal, when keylock's process group is in its
 * foreground (keylock then hands it to the command's group), else -1. */
static int
foreground_tty(void)
{
	int fd = open("/dev/tty", O_RDWR | O_NOCTTY | O_CLOEXEC);

	if (fd >= 0 && tcgetpgrp(fd) != getpgrp()) {
		close(fd);
		fd = -1;
	}
	return fd;
}

/* Passes sig on to the command's process group (the command and what it
 * started), or to the command alone when it has left its group. */
static void
forward(pid_t child, int sig)
{
	if (kill(-child, sig) != 0 && errno == ESRCH)
		kill(child, sig);
}

/* Whether info, taken at now, repeats the copy of the same signal that the
 * same process sent last and keylock forwarded less than ECHO_WINDOW_NS
 * before, such as timeout(1)'s copy sent to keylock's group after the one
 * sent to keylock; if not, it is recorded as the last one forwarded.  Only
 * signals sent with kill(2) or sigqueue(3) can be echoes: those the kernel
 * sends (a hangup, SIGWINCH, a terminal's Ctrl-C) come once per event.
 * SIGCONT never is: an extra one does nothing to a running command, but a
 * dropped one could leave it stopped for good. */
static bool
is_echo(const siginfo_t *info, const struct timespec *now)
{
	struct sent *last = &sigs.sent[info->si_signo];
	long long ns;

	if (info->si_signo == SIGCONT ||
	    (info->si_code != SI_USER && info->si_code != SI_QUEUE))
		return false;
	if (last->valid && last->pid == info->si_pid &&
	    last->uid == info->si_uid) {
		ns = (long long)(now->tv_sec - last->at.tv_sec) * 1000000000LL +
		     (now->tv_nsec - last->at.tv_nsec);
		if (ns >= 0 && ns < ECHO_WINDOW_NS)
			return true;
	}
	last->valid = true;
	last->pid = info->si_pid;
	last->uid = info->si_uid;
	last->at = *now;
	return false;
}

static void *
sig_main(void *arg)
{
	enum sig_default sd;
	struct timespec now;
	siginfo_t info;
	int sig;

	(void)arg;
	for (;;) {
		while ((sig = sigwaitinfo(&sigs.set, &info)) < 0)
			;
		/* At once: the window is measured between two takes. */
		clock_gettime(CLOCK_MONOTONIC, &now);
		sd = sig_default(sig);
		pthread_mutex_lock(&sigs.mu);
		switch (sigs.phase) {
		case PHASE_WAIT:
		case PHASE_IDLE:
			/* No command yet: what the signal would do to a
			 * process without a handler, except that keylock
			 * leaves the queue or releases the key first. */
			if (sd == SD_STOP) {
				kill(getpid(), SIGSTOP);
				break;
			}
			if (sd == SD_IGNORE)
				break;
			if (sigs.pending == 0)
				sigs.pending = sig;
			if (sigs.phase == PHASE_WAIT)
				kl_cancel_fire(sigs.cancel);
			break;
		case PHASE_RUN:
			/* keylock was continued: after a stop it followed
			 * (follow_stop), or after a start in the background
			 * (the command then stopped when it touched the
			 * terminal).  In the foreground now, it hands the
			 * terminal to the command before continuing it. */
			if (sig == SIGCONT && sigs.tty) {
				int fd = foreground_tty();

				if (fd >= 0) {
					tcsetpgrp(fd, sigs.child);
					close(fd);
				}
			}
			if (is_echo(&info, &now))
				break;
			forward(sigs.child, sig);
			break;
		case PHASE_DONE:
			break;
		}
		pthread_mutex_unlock(&sigs.mu);
	}
	return NULL;
}

/* Blocks every signal keylock can catch in this thread, so in every thread
 * started later: a signal must never end keylock while the command runs,
 * since that would release the key early.  Left alone: SIGKILL and SIGSTOP
 * (they cannot be caught) and SIGCHLD (the command's end is waited for;
 * an ignored one is made default, see below).
 * A blocked SIGCONT still continues keylock.  A signal ignored when keylock
 * started stays ignored (as nohup(1) or a shell's background job set it),
 * for keylock and the command. */
static void
block_signals(void)
{
	struct sigaction sa;
	int sig;

	/* An ignored SIGCHLD would have the command reaped by the kernel as
	 * it exits: its status lost, and its pid free for reuse while
	 * signals are still forwarded to it. */
	if (sigaction(SIGCHLD, NULL, &sa) == 0 && sa.sa_handler == SIG_IGN) {
		sa.sa_handler = SIG_DFL;
		sa.sa_flags = 0;
		sigaction(SIGCHLD, &sa, NULL);
		sigs.chld_ignored = true;
	}
	sigemptyset(&sigs.set);
	for (sig = 1; sig < NSIG; sig++) {
		if (sig == SIGKILL || sig == SIGSTOP || sig == SIGCHLD)
			continue;
		/* Fails for the signals the C library keeps for itself. */
		if (sigaction(sig, NULL, &sa) == 0 &&
		    sa.sa_handler != SIG_IGN)
			sigaddset(&sigs.set, sig);
	}
	pthread_sigmask(SIG_BLOCK, &sigs.set, &sigs.old_mask);
}

/* Ends keylock the way a signal would, so that the shell sees it (as
 * timeout(1) does); exits 128+sig where that is not possible.  Our own core
 * dump is prevented first: the command's is the one that matters. */
static void
exit_by_signal(int sig)
{
	struct rlimit no_core = { 0, 0 };
	struct sigaction sa;
	sigset_t set;

	fflush(NULL);
	if (setrlimit(RLIMIT_CORE, &no_core) == 0) {
		memset(&sa, 0, sizeof sa);
		sa.sa_handler = SIG_DFL;
		sigemptyset(&sa.sa_mask);
		sigaction(sig, &sa, NULL);
		sigemptyset(&set);
		sigaddset(&set, sig);
		pthread_sigmask(SIG_UNBLOCK, &set, NULL);
		raise(sig);
	}
	exit(128 + sig);
}

/* ------------------------------------------------------------------ */
/* The command                                                         */

/* Everything the child needs, built before the fork. */
struct command {
	char **argv;
	char **envp;   /* environ with KEYLOCK_KEY and KEYLOCK_FENCE */
	char *env_key; /* the two strings envp adds */
	char *env_fence;
	char **paths; /* execvp's candidates, in its order */
	size_t npaths;
	char **sh_argv; /* /bin/sh PATH ARG..., for ENOEXEC */
};

static void
command_free(struct command *c)
{
	size_t i;

	for (i = 0; i < c->npaths; i++)
		free(c->paths[i]);
	free(c->paths);
	free(c->sh_argv);
	free(c->envp);
	free(c->env_key);
	free(c->env_fence);
}

static char *
concat(const char *a, const char *b, const char *c)
{
	size_t la = strlen(a), lb = strlen(b), lc = strlen(c);
	char *s = malloc(la + lb + lc + 1);

	if (s != NULL) {
		memcpy(s, a, la);
		memcpy(s + la, b, lb);
		memcpy(s + la + lb, c, lc + 1);
	}
	return s;
}

static bool
has_name(const char *entry, const char *name)
{
	size_t n = strlen(name);

	return strncmp(entry, name, n) == 0 && entry[n] == '=';
}

static int
build_env(struct command *c, const char *key, uint64_t fence)
{
	char num[24];
	size_t i, n = 0, count = 0;

	snprintf(num, sizeof num, "%" PRIu64, fence);
	c->env_key = concat("KEYLOCK_KEY", "=", key);
	c->env_fence = concat("KEYLOCK_FENCE", "=", num);
	while (environ != NULL && environ[count] != NULL)
		count++;
	c->envp = calloc(count + 3, sizeof *c->envp);
	if (c->env_key == NULL || c->env_fence == NULL || c->envp == NULL)
		return -1;
	for (i = 0; i < count; i++)
		if (!has_name(environ[i], "KEYLOCK_KEY") &&
		    !has_name(environ[i], "KEYLOCK_FENCE"))
			c->envp[n++] = environ[i];
	c->envp[n++] = c->env_key;
	c->envp[n++] = c->env_fence;
	c->envp[n] = NULL;
	return 0;
}

/* The files execvp would try for file, in order: file itself when it has a
 * '/', else each directory of PATH (an empty one is the current directory;
 * no PATH is confstr's default path). */
static int
build_paths(struct command *c, const char *file)
{
	const char *path = getenv("PATH"), *p, *end;
	char *deflt = NULL;
	size_t n, max = 1;
	int rc = 0;

	if (strchr(file, '/') != NULL) {
		if ((c->paths = calloc(1, sizeof *c->paths)) == NULL ||
		    (c->paths[0] = strdup(file)) == NULL)
			return -1;
		c->npaths = 1;
		return 0;
	}
	if (file[0] == '\0')
		return 0; /* ENOENT, as execvp */
	if (path == NULL) {
		n = confstr(_CS_PATH, NULL, 0);
		if (n == 0 || (deflt = malloc(n)) == NULL)
			return -1;
		confstr(_CS_PATH, deflt, n);
		path = deflt;
	}
	for (p = path; *p != '\0'; p++)
		max += *p == ':';
	if ((c->paths = calloc(max, sizeof *c->paths)) == NULL) {
		free(deflt);
		return -1;
	}
	for (p = path;; p = end + 1) {
		char *dir;

		end = strchr(p, ':');
		if (end == NULL)
			end = p + strlen(p);
		n = (size_t)(end - p);
		if ((dir = n > 0 ? strndup(p, n) : strdup(".")) == NULL ||
		    (c->paths[c->npaths] = concat(dir, "/", file)) == NULL) {
			free(dir);
			rc = -1;
			break;
		}
		free(dir);
		c->npaths++;
		if (*end == '\0')
			break;
	}
	free(deflt);
	return rc;
}

static int
command_init(struct command *c, char **argv, const char *key, uint64_t fence)
{
	size_t argc = 0;

	memset(c, 0, sizeof *c);
	c->argv = argv;
	while (argv[argc] != NULL)
		argc++;
	/* "/bin/sh" PATH ARG[1]... NULL */
	if ((c->sh_argv = calloc(argc + 2, sizeof *c->sh_argv)) == NULL)
		return -1;
	c->sh_argv[0] = (char *)"/bin/sh";
	memcpy(c->sh_argv + 2, argv + 1, argc * sizeof *argv);
	if (build_env(c, key, fence) != 0 || build_paths(c, argv[0]) != 0)
		return -1;
	return 0;
}

/* In the child of fork: async-signal-safe calls only.  Moves to a process
 * group of its own (and takes the terminal when keylock had it), then tries
 * the candidates as execvp does (a permission error is remembered while
 * the search goes on; a file that is not an executable format is run by
 * /bin/sh), then writes errno to errfd and exits. */
static void
child_exec(struct command *c, int ttyfd, int errfd)
{
	bool eacces = false;
	int err = ENOENT;
	size_t i;

	/* Done here as well as in the parent, so that the command never runs
	 * in keylock's group or without the terminal, whichever is first.
	 * SIGTTOU is still blocked, so tcsetpgrp works from the new group. */
	setpgid(0, 0);
	if (ttyfd >= 0)
		tcsetpgrp(ttyfd, getpid());
	/* The dispositions are the ones keylock started with (it sets no
	 * handler) but SIGCHLD's, which is restored; the mask changed. */
	if (sigs.chld_ignored) {
		struct sigaction sa;

		memset(&sa, 0, sizeof sa);
		sa.sa_handler = SIG_IGN;
		sigemptyset(&sa.sa_mask);
		sigaction(SIGCHLD, &sa, NULL);
	}
	sigprocmask(SIG_SETMASK, &sigs.old_mask, NULL);
	for (i = 0; i < c->npaths; i++) {
		execve(c->paths[i], c->argv, c->envp);
		err = errno;
		if (err == ENOEXEC) {
			c->sh_argv[1] = c->paths[i];
			execve("/bin/sh", c->sh_argv, c->envp);
			err = errno;
			break;
		}
		if (err == EACCES) {
			eacces = true;
			continue;
		}
		if (err != ENOENT && err != ENOTDIR && err != ENODEV &&
		    err != ETIMEDOUT
#ifdef ESTALE
		    && err != ESTALE
#endif
		)
			break;
	}
	if (i == c->npaths && eacces)
		err = EACCES;
	while (write(errfd, &err, sizeof err) < 0 && errno == EINTR)
		;
	_exit(err == ENOENT ? EXIT_ENOENT : EXIT_CANNOT_INVOKE);
}

/* The command was stopped by stop_sig.  When that is a terminal's stop
 * signal (Ctrl-Z, or reading or writing the terminal from the background)
 * and keylock is a job of a shell (its parent is in its session, in
 * another process group), keylock stops too, so that the shell sees its
 * job stop, taking the terminal back first if the command had it; the
 * SIGCONT that continues keylock (fg or bg) is passed on by sig_main, which
 * hands the terminal over again when keylock is in the foreground.
 * Otherwise (cron, a service, a stop sent to the command alone) keylock
 * does not stop: nothing would continue it. */
static void
follow_stop(pid_t pid, int stop_sig)
{
	siginfo_t info;
	pid_t parent = getppid();
	int fd;

	memset(&info, 0, sizeof info);
	/* Consumes the report of this stop (the command is not reaped). */
	waitid(P_PID, pid, &info, WSTOPPED | WNOHANG);
	if ((stop_sig == SIGTTIN || stop_sig == SIGTTOU) &&
	    (fd = foreground_tty()) >= 0) {
		/* The command needs the terminal that keylock's group has
		 * (it was not handed over, see run_command): it gets it
		 * from now on, and goes on. */
		pthread_mutex_lock(&sigs.mu);
		sigs.tty = true;
		tcsetpgrp(fd, pid);
		pthread_mutex_unlock(&sigs.mu);
		close(fd);
		forward(pid, SIGCONT);
		return;
	}
	if (stop_sig != SIGTSTP && stop_sig != SIGTTIN && stop_sig != SIGTTOU)
		return;
	if (getsid(parent) != getsid(0) || getpgid(parent) == getpgrp())
		return;
	fd = open("/dev/tty", O_RDWR | O_NOCTTY | O_CLOEXEC);
	if (fd < 0)
		return;
	if (tcgetpgrp(fd) == pid)
		tcsetpgrp(fd, getpgrp());
	close(fd);
	kill(getpid(), SIGSTOP);
}

/* The command has ended: the terminal goes back to keylock's group if the
 * command's had it, as the shell that started keylock expects. */
static void
restore_tty(pid_t pid)
{
	int fd = open("/dev/tty", O_RDWR | O_NOCTTY | O_CLOEXEC);

	if (fd < 0)
		return;
	if (tcgetpgrp(fd) == pid)
		tcsetpgrp(fd, getpgrp());
	close(fd);
}

/* Runs the command and returns its exit status; *sig is set when it died
 * of a signal or was never started because keylock got one.  The caller
 * holds the key and releases it afterwards. */
static int
run_command(struct command *c, int *sig)
{
	char buf[SHOWN_MAX];
	siginfo_t info;
	int fds[2], err, status, ttyfd;
	bool own_job;
	ssize_t n;
	pid_t pid;

	*sig = 0;
	if (pipe(fds) != 0) {
		note("cannot create a pipe: %s", strerror(errno));
		return EXIT_OSERR;
	}
	/* No other thread forks, so nothing can inherit the pipe between
	 * pipe() and these. */
	fcntl(fds[0], F_SETFD, FD_CLOEXEC);
	fcntl(fds[1], F_SETFD, FD_CLOEXEC);
	/* keylock leads its group and has the terminal on both ends when a
	 * shell started it as a job of its own: the command gets the job's
	 * terminal now.  Otherwise the group is that of a script or of a
	 * pipeline, whose other members (the shell, which Ctrl-C must reach;
	 * a pager reading keys) keep the terminal, and a keylock in a
	 * script's background does not take it from them, unless the
	 * command needs it (follow_stop). */
	own_job = getpgrp() == getpid() && isatty(STDIN_FILENO) &&
		  isatty(STDOUT_FILENO);
	ttyfd = own_job ? foreground_tty() : -1;

	/* The fork happens under sigs.mu, so a signal is either seen before
	 * (the command does not start) or forwarded to the child. */
	pthread_mutex_lock(&sigs.mu);
	if (sigs.pending != 0) {
		*sig = sigs.pending;
		sigs.phase = PHASE_DONE;
		pthread_mutex_unlock(&sigs.mu);
		close(fds[0]);
		close(fds[1]);
		if (ttyfd >= 0)
			close(ttyfd);
		return 128 + *sig;
	}
	sigs.tty = own_job;
	pid = fork();
	err = errno;
	if (pid == 0)
		child_exec(c, ttyfd, fds[1]);
	if (pid > 0) {
		/* Before a signal can be forwarded to the group. */
		setpgid(pid, pid);
		if (ttyfd >= 0)
			tcsetpgrp(ttyfd, pid);
		sigs.child = pid;
		sigs.phase = PHASE_RUN;
	}
	pthread_mutex_unlock(&sigs.mu);
	close(fds[1]);
	if (ttyfd >= 0)
		close(ttyfd);
	if (pid < 0) {
		close(fds[0]);
		note("cannot fork: %s", strerror(err));
		return EXIT_OSERR;
	}

	while ((n = read(fds[0], &err, sizeof err)) < 0 && errno == EINTR)
		;
	close(fds[0]);

	for (;;) {
		memset(&info, 0, sizeof info);
		if (waitid(P_PID, pid, &info, WEXITED | WSTOPPED | WNOWAIT) !=
		    0) {
			if (errno == EINTR)
				continue;
			break;
		}
		if (info.si_code != CLD_STOPPED)
			break;
		follow_stop(pid, info.si_status);
	}
	pthread_mutex_lock(&sigs.mu);
	sigs.phase = PHASE_DONE;
	pthread_mutex_unlock(&sigs.mu);
	/* While the command's group still exists (it is not reaped yet). */
	restore_tty(pid);
	while (waitpid(pid, &status, 0) < 0)
		if (errno != EINTR) {
			note("cannot wait for the command: %s",
			     strerror(errno));
			return EXIT_OSERR;
		}

	if (n == (ssize_t)sizeof err) {
		note("failed to execute '%s': %s",
		     shown(buf, sizeof buf, c->argv[0]), strerror(err));
		return err == ENOENT ? EXIT_ENOENT : EXIT_CANNOT_INVOKE;
	}
	if (WIFSIGNALED(status)) {
		*sig = WTERMSIG(status);
		return 128 + *sig;
	}
	return WEXITSTATUS(status);
}

/* ------------------------------------------------------------------ */
/* Locking                                                             */

struct report {
	const struct options *o;
	int64_t waited_ms;
	int64_t held_ms;
	int release_status; /* KL_OK, or why releasing failed */
};

/* Raised in the thread that acquires or releases, or for a lost lease in
 * whichever thread noticed: only the loss is printed here. */
static void
on_event(const kl_event *ev, void *arg)
{
	struct report *r = arg;
	char buf[SHOWN_MAX];

	switch (ev->type) {
	case KL_EV_ACQUIRED:
		/* A set raises one per key, each with its own wait, and
		 * waits for them one after the other: the sum is its wait. */
		r->waited_ms += ev->waited_ms;
		break;
	case KL_EV_RELEASED:
		r->held_ms = ev->held_ms;
		break;
	case KL_EV_RELEASE_FAILED:
		r->held_ms = ev->held_ms;
		r->release_status = ev->status;
		break;
	case KL_EV_LOST:
		note("warning: the lease on '%s' was lost while the command "
		     "ran",
		     shown(buf, sizeof buf, ev->key));
		break;
	case KL_EV_REJECTED:
		r->waited_ms = ev->waited_ms;
		break;
	}
}

static int
run_locked(const struct options *o)
{
	char kbuf[SHOWN_MAX], tbuf[32], ubuf[SHOWN_MAX * 2];
	kl_lock_opts lo = KL_LOCK_OPTS_INIT;
	struct report rep = { .o = o };
	kl_error err = { 0 };
	struct command cmd;
	kl_call call = { 0 };
	kl_lease *lease = NULL;
	kl_provider *p;
	kl_lock *lock = NULL;
	pthread_t thread;
	int rc, code, sig = 0;

	if (o->nkeys > 0)
		shown_set(kbuf, sizeof kbuf, o);
	else
		shown(kbuf, sizeof kbuf, o->key);
	if ((rc = kl_cancel_new(&sigs.cancel)) != KL_OK) {
		note("%s", kl_strerror(rc));
		return failure_exit(rc);
	}
	sigs.phase = PHASE_WAIT;
	if ((rc = pthread_create(&thread, NULL, sig_main, NULL)) != 0) {
		note("cannot start a thread: %s", strerror(rc));
		kl_cancel_free(sigs.cancel);
		return EXIT_OSERR;
	}
	pthread_detach(thread);

	p = open_provider(o);
	lo.provider = p;
	lo.key = o->key;
	lo.timeout_ms = o->wait_ms;
	lo.ttl_ms = o->ttl_ms;
	lo.flags = o->shared ? KL_SHARED : 0;
	lo.on_event = on_event;
	lo.event_arg = &rep;
	call.cancel = sigs.cancel;
	if ((rc = kl_lock_new(&lock, &lo)) != KL_OK)
		;
	else if (o->nkeys > 0)
		rc = kl_lock_acquire_many(lock, o->keys, o->nkeys, call.cancel,
					  &lease, &err);
	else
		rc = kl_lock_acquire(lock, &call, &lease, &err);

	/* The token is not fired after this, and may be freed. */
	pthread_mutex_lock(&sigs.mu);
	sigs.phase = rc == KL_OK ? PHASE_IDLE : PHASE_DONE;
	sig = sigs.pending;
	pthread_mutex_unlock(&sigs.mu);

	if (rc == KL_OK) {
		if (o->verbose)
			note("acquired '%s' after %" PRId64
			     " ms (fence %" PRIu64 "%s)",
			     kbuf, rep.waited_ms, kl_lease_fence(lease),
			     o->shared ? ", shared" : "");
		/* A set passes its first key in canonical order. */
		if (command_init(&cmd, o->command, kl_lease_key(lease),
				 kl_lease_fence(lease)) != 0) {
			note("out of memory");
			code = EXIT_OSERR;
		} else {
			code = run_command(&cmd, &sig);
		}
		command_free(&cmd);
		kl_lease_release(lease);
		if (rep.release_status != KL_OK)
			note("warning: releasing '%s' failed: %s", kbuf,
			     kl_strerror(rep.release_status));
		else if (o->verbose)
			note("released '%s' (held %" PRId64 " ms)", kbuf,
			     rep.held_ms);
	} else if (rc == KL_ECANCELED && sig != 0) {
		code = 128 + sig;
	} else if (rc == KL_ETIMEDOUT || rc == KL_EOVERFLOW) {
		if (!o->quiet && (rc == KL_EOVERFLOW || o->nkeys > 0))
			note("%s", err.message);
		else if (!o->quiet && o->wait_ms == 0)
			note("'%s' not acquired: it is held", kbuf);
		else if (!o->quiet)
			note("'%s' not acquired within %s", kbuf,
			     format_ms(tbuf, sizeof tbuf, o->wait_ms));
		code = o->conflict_exit;
	} else if (rc == KL_EINVAL && o->shared) {
		/* What a provider that cannot take keys shared answers. */
		note("provider '%s': %s (-s, --shared)",
		     uri_shown(ubuf, sizeof ubuf, o->provider),
		     err.message[0] != '\0' ? err.message : kl_strerror(rc));
		code = EXIT_UNAVAILABLE;
	} else {
		note("%s",
		     err.message[0] != '\0' ? err.message : kl_strerror(rc));
		code = failure_exit(rc);
	}

	kl_lock_free(lock);
	kl_provider_free(p);
	kl_cancel_free(sigs.cancel);
	if (sig != 0)
		exit_by_signal(sig);
	return code;
}

int
main(int argc, char **argv)
{
	struct options o = { 0 };
	int code;

	/* Before any thread exists: every thread inherits the mask. */
	block_signals();

	parse_args(argc, argv, &o);
	code = o.list	  ? run_list(&o)
	       : o.status ? run_status(&o)
			  : run_locked(&o);
	free(o.keys);
	return code;
}
