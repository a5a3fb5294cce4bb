# SPDX-License-Identifier: MIT
# test/stages/lib.sh: what the stages of tools/test share.  Sourced by
# tools/test, and by each stage's own process (tools/test runs a stage as
# bash with this file, then test/stages/STAGE.sh, sourced, and calls
# stage_STAGE with set -euo pipefail).  Settings, logging, the build trees
# and make, counting results, running commands at the stage's exit
# (servers are always stopped), and installing packages.

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT" || exit

# KL_BUILD_DIR lets several people build one tree at once.
BUILD=${KL_BUILD_DIR:-$ROOT/_build}
LOGS=$BUILD/logs
JOBS=${KL_JOBS:-2}
MAKE_TIMEOUT=${KL_MAKE_TIMEOUT:-1800}
ME=tools/test

# Debian packages the stages need, and a command or file that shows each
# (jq: the keylock list tests of make check read its JSON with it).
PACKAGES=(autoconf automake libtool pkg-config check libsubunit-dev make gcc
	clang libclang-rt-dev valgrind procps jq)

export DEBIAN_FRONTEND=noninteractive
export LC_ALL=C
# The suites print "NN%: Checks: ..." only at normal verbosity or above.
case ${CK_VERBOSITY:-normal} in
silent | minimal) export CK_VERBOSITY=normal ;;
esac
unset CC CFLAGS LDFLAGS CPPFLAGS

# -------------------------------------------------------------------
# Helpers (run inside a stage, with set -e in force)

say() {
	printf '%s: %s\n' "$ME" "$*"
}

# mk DIR ARGS...: make in DIR, bounded by KL_MAKE_TIMEOUT.
mk() {
	local dir=$1
	shift
	timeout -k 30 "$MAKE_TIMEOUT" make -C "$dir" -j"$JOBS" "$@"
}

# autoreconf once per run of tools/test (configure.ac may have changed).
ensure_autoreconf() {
	if [ -f "$ROOT/config.status" ]; then
		echo "error: $ROOT is configured in place; out-of-tree builds" \
			"need a clean tree: run 'make distclean' there" >&2
		return 1
	fi
	if [ ! -f "$LOGS/.autoreconf-done" ] || [ ! -x "$ROOT/configure" ]; then
		(cd "$ROOT" && autoreconf -fi)
		: >"$LOGS/.autoreconf-done"
	fi
}

# configure_tree DIR [CONFIGURE ARGS...]: a fresh out-of-tree build folder.
configure_tree() {
	local dir=$1
	shift
	ensure_autoreconf
	rm -rf "$dir"
	mkdir -p "$dir"
	(cd "$dir" && "$ROOT/configure" "$@")
}

# The plain build tree, shared by build, check and distcheck.
PLAIN=$BUILD/build
build_plain() {
	configure_tree "$PLAIN" --enable-werror
	mk "$PLAIN"
}
ensure_plain() {
	if [ ! -f "$PLAIN/Makefile" ] || [ ! -f "$PLAIN/src/libkeylock.la" ]; then
		build_plain
	fi
}

# tally DIR: counts the results of the test harness in DIR (its .trs and
# .log files) into the stage's result file, and lists the logs of failed
# tests.  Check suites count their tests; other programs count one each.
tally() {
	local dir=$1 trs log res line n f
	local suites=0 tests=0 failures=0 skipped=0
	: >"$STAGE_FAILED"
	while IFS= read -r trs; do
		log=${trs%.trs}.log
		res=$(sed -n 's/^:test-result: *//p' "$trs" | head -n 1)
		line=$(awk '
			match($0, /^[0-9]+%: Checks: [0-9]+, Failures: [0-9]+, Errors: [0-9]+/) {
				s = substr($0, RSTART, RLENGTH)
				gsub(/[^0-9]+/, " ", s)
				split(s, v, " ")
				n += v[2]; f += v[3]; e += v[4]; seen = 1
			}
			END { if (seen) print n, f + e }' "$log" 2>/dev/null || true)
		if [ -n "$line" ]; then
			read -r n f <<<"$line"
			suites=$((suites + 1))
			tests=$((tests + n))
			failures=$((failures + f))
			case $res in
			FAIL | ERROR | XPASS)
				# A crash or a sanitizer report after the
				# summary line.
				[ "$f" -gt 0 ] || failures=$((failures + 1))
				;;
			esac
		else
			case $res in
			SKIP) skipped=$((skipped + 1)) ;;
			FAIL | ERROR | XPASS)
				tests=$((tests + 1))
				failures=$((failures + 1))
				;;
			*) tests=$((tests + 1)) ;;
			esac
		fi
		case $res in
		FAIL | ERROR | XPASS) echo "$log" >>"$STAGE_FAILED" ;;
		esac
	done < <(find "$dir" -maxdepth 3 -name '*.trs' -newer "$STAGE_START" \
		2>/dev/null | sort)
	echo "$suites $tests $failures $skipped" >"$STAGE_RESULT"
}

# check_tree DIR: make check in DIR and count the results, pass or fail.
check_tree() {
	local dir=$1 rc=0
	mk "$dir" check || rc=$?
	tally "$dir"
	return $rc
}

# progress MESSAGE: a say that tools/test also shows while the stage runs
# (its output goes to the log otherwise), for the steps of long stages.
progress() {
	say "$*"
	[ -z "${STAGE_PROGRESS:-}" ] || say "$*" >>"$STAGE_PROGRESS"
}

# progress_done WHAT TRS START: a progress line for WHAT with the result in
# TRS (the harness's .trs file) and the seconds since START.
progress_done() {
	local res
	res=$(sed -n 's/^:test-result: *//p' "$2" 2>/dev/null | head -n 1)
	progress "$1: ${res:-did not run} in $((SECONDS - $3))s"
}

# at_exit COMMAND: runs COMMAND (a function name and words, split) when the
# stage's process exits, however it exits: the last one registered first.
# A SIGINT, SIGTERM or SIGHUP makes the stage exit, and so run them: a
# server a stage started is always stopped.
AT_EXIT=()
at_exit() {
	AT_EXIT=("$1" "${AT_EXIT[@]}")
	trap run_at_exit EXIT
	trap 'exit 129' HUP
	trap 'exit 130' INT
	trap 'exit 143' TERM
}
run_at_exit() {
	local c
	for c in "${AT_EXIT[@]}"; do
		$c || true
	done
	AT_EXIT=()
}

# result_line TESTS FAILURES SKIPPED: the counts for the summary line.
result_line() {
	echo "0 $1 $2 $3" >"$STAGE_RESULT"
}

# cli_remote URI: the command's conflict and FIFO tests once more, and its
# shared mode, list and status (remote_modes.sh, run only here), against
# the server the stage runs; added to the stage's counts.
cli_remote() {
	local uri=$1 t rc=0 n=0 f=0 s1 t1 f1 k1
	mk "$PLAIN" tools/keylock
	for t in conflict fifo remote_modes; do
		n=$((n + 1))
		if ! (cd "$PLAIN" && top_builddir=$PLAIN \
			KEYLOCK_CLI_PROVIDER=$uri bash "$ROOT/test/cli/$t.sh"); then
			say "error: test/cli/$t.sh failed against ${uri%%:*}" >&2
			f=$((f + 1))
			rc=1
		fi
	done
	read -r s1 t1 f1 k1 <"$STAGE_RESULT"
	echo "$s1 $((t1 + n)) $((f1 + f)) $k1" >"$STAGE_RESULT"
	return $rc
}

# bench_provider URI: the quick pass of "keylock-bench provider" against
# the server the stage runs (redis, pg): round trips beside the raw client
# calls and release-to-grant across processes, as one test added to the
# stage's counts.  Like stage bench, it never judges speed: it fails only
# when a call fails or a grant came before its release.  A full run, for
# the figures: keylock-bench provider --uri URI [--json] (man
# keylock-bench, PROVIDER MODE).
bench_provider() {
	local uri=$1 rc=0 s1 t1 f1 k1
	mk "$PLAIN" tools/keylock-bench
	KEYLOCK_PROVIDER_DIR=$PLAIN/src/.libs \
		"$PLAIN/tools/keylock-bench" provider --quick --uri "$uri" ||
		rc=$?
	read -r s1 t1 f1 k1 <"$STAGE_RESULT"
	case $rc in
	0) echo "$s1 $((t1 + 1)) $f1 $k1" >"$STAGE_RESULT" ;;
	77) echo "$s1 $t1 $f1 $((k1 + 1))" >"$STAGE_RESULT" ;;
	*)
		say "error: keylock-bench provider failed (exit $rc) against ${uri%%:*}" >&2
		echo "$s1 $((t1 + 1)) $((f1 + 1)) $k1" >"$STAGE_RESULT"
		return 1
		;;
	esac
}

# The ThreadSanitizer tree, shared by tsan, stress and soak, and its
# settings.
TSAN=$BUILD/tsan
build_tsan() {
	local flags="-fsanitize=thread -g -O1"
	configure_tree "$TSAN" CC=clang CFLAGS="$flags" LDFLAGS="$flags"
	mk "$TSAN"
}
tsan_env() {
	export TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1}
	export KL_TEST_SCALE=${KL_TEST_SCALE:-0.25}
	export CK_TIMEOUT_MULTIPLIER=${CK_TIMEOUT_MULTIPLIER:-4}
}

# install_missing [PACKAGE...]: apt-get install the packages (default:
# PACKAGES) that are not installed.  Stages call it for their own tools.
install_missing() {
	local missing=() p want=("$@")
	[ $# -gt 0 ] || want=("${PACKAGES[@]}")
	if ! command -v dpkg-query >/dev/null 2>&1; then
		for p in autoreconf libtoolize pkg-config make gcc clang; do
			command -v "$p" >/dev/null 2>&1 ||
				say "warning: $p not found (not a Debian system: install it yourself)"
		done
		return 0
	fi
	for p in "${want[@]}"; do
		dpkg-query -W -f='${Status}' "$p" 2>/dev/null |
			grep -q 'install ok installed' || missing+=("$p")
	done
	[ ${#missing[@]} -gt 0 ] || return 0
	say "installing missing packages: ${missing[*]}"
	local sudo=()
	if [ "$(id -u)" -ne 0 ]; then
		if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
			sudo=(sudo -n)
		else
			say "error: missing packages ${missing[*]}; as root: apt-get install ${missing[*]}" >&2
			exit 1
		fi
	fi
	"${sudo[@]}" apt-get update -q </dev/null
	"${sudo[@]}" apt-get install -y -q "${missing[@]}" </dev/null
}
