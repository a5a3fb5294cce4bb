# SPDX-License-Identifier: MIT
# test/cli/lib.sh: sourced by the keylock(1) tests (test/cli/*.sh).
#
# Each test runs the built program ($KEYLOCK, else
# $top_builddir/tools/keylock as AM_TESTS_ENVIRONMENT exports it) against a
# private local: state directory in a fresh mktemp -d, exits 0 (pass), 1
# (fail), 77 (skip: the provider it needs is missing) or 99 (hard error).
# Orders are forced, never slept into: a test waits for a file the command
# writes, or for `keylock status` to show the queue it expects, and every
# wait has a generous deadline so that a loaded machine slows a test down
# without failing it.

set -u

: "${top_builddir:=.}"
KEYLOCK=${KEYLOCK:-$top_builddir/tools/keylock}
case $KEYLOCK in
/*) ;;
*) KEYLOCK=$PWD/$KEYLOCK ;;
esac
if [ ! -x "$KEYLOCK" ]; then
	echo "ERROR: $KEYLOCK is missing: build it first" >&2
	exit 99
fi

TMP=$(mktemp -d "${TMPDIR:-/tmp}/keylock-cli.XXXXXX") || exit 99
chmod 700 "$TMP"
STATE=$TMP/state
# KEYLOCK_CLI_PROVIDER reruns a test against another provider (the redis
# and pg stages of tools/test set it to their servers).
P=(-p "${KEYLOCK_CLI_PROVIDER:-local:$STATE}")
OUT=$TMP/out
ERR=$TMP/err
BG=()

# $TMP/naps, for the commands' scripts to source (bash): naps N [FILE]
# sleeps N times 50 ms, in the background so that a trap runs at once,
# or until FILE exists.
cat >"$TMP/naps" <<'EOS'
naps() {
	local i=0
	while [ $i -lt "$1" ] && { [ $# -lt 2 ] || [ ! -e "$2" ]; }; do
		sleep 0.05 &
		wait $!
		i=$((i + 1))
	done
}
EOS

# Background keylock processes are stopped with SIGTERM (which they pass on
# to their commands), then SIGKILL.
cleanup() {
	local pid i
	for pid in "${BG[@]}"; do
		kill -TERM "$pid" 2>/dev/null
	done
	for pid in "${BG[@]}"; do
		for i in $(seq 40); do
			kill -0 "$pid" 2>/dev/null || break
			sleep 0.05
		done
		kill -KILL "$pid" 2>/dev/null
	done
	wait 2>/dev/null
	rm -rf "$TMP"
}
trap cleanup EXIT

fail() {
	echo "FAIL: $*" >&2
	for f in "$OUT" "$ERR"; do
		[ -s "$f" ] && sed "s|^|  ${f##*/}: |" "$f" >&2
	done
	exit 1
}

skip() {
	echo "SKIP: $*"
	exit 77
}

# bg CMD...: runs CMD in the background and remembers it for cleanup; the
# pid is in $!.
bg() {
	"$@" &
	BG+=($!)
}

# kl ARGS...: runs keylock with stdout in $OUT and stderr in $ERR; the exit
# status is in $rc.
kl() {
	rc=0
	"$KEYLOCK" "$@" >"$OUT" 2>"$ERR" || rc=$?
}

# expect_rc N WHAT: fails unless the last kl exited with N.
expect_rc() {
	[ "$rc" -eq "$1" ] || fail "$2: exit status $rc, expected $1"
}

# expect_usage WHAT: the last kl was a usage error.
expect_usage() {
	expect_rc 64 "$1"
	grep -q "^keylock: " "$ERR" || fail "$1: no 'keylock: ' message"
	grep -qx "Try 'keylock --help' for more information." "$ERR" ||
		fail "$1: no usage hint"
	[ ! -s "$OUT" ] || fail "$1: output on stdout"
}

# need_local: skips the test where the local: provider is not built yet.
need_local() {
	kl "${P[@]}" status probe
	if [ "$rc" -ne 0 ]; then
		grep -q "not built" "$ERR" && skip "the local: provider is not built yet"
		fail "keylock status with a fresh local: directory"
	fi
}

# need_pty_run: sets $PTY_RUN to test/cli/pty_run (absolute), which runs a
# command as the leader of a session on a new terminal; skips the test
# where it is not built.
need_pty_run() {
	PTY_RUN=$top_builddir/test/cli/pty_run
	case $PTY_RUN in
	/*) ;;
	*) PTY_RUN=$PWD/$PTY_RUN ;;
	esac
	[ -x "$PTY_RUN" ] || skip "test/cli/pty_run is not built"
}

now_ms() {
	date +%s%3N
}

# wait_until SECONDS WHAT CMD...: polls CMD until it succeeds.
wait_until() {
	local limit=$1 what=$2 end
	shift 2
	end=$((SECONDS + limit))
	until "$@"; do
		[ "$SECONDS" -lt "$end" ] || fail "timed out waiting for $what"
		sleep 0.05
	done
}

# wait_file FILE: waits until a command has made FILE.
wait_file() {
	wait_until 20 "$1" test -e "$1"
}

# queue_is KEY N: `keylock status KEY` shows N waiters.
queue_is() {
	local q
	q=$("$KEYLOCK" "${P[@]}" status "$1" 2>/dev/null | sed -n 's/^queue: //p')
	[ "$q" = "$2" ]
}

# holders_is KEY N: `keylock status KEY` shows N holders.
holders_is() {
	local h
	h=$("$KEYLOCK" "${P[@]}" status "$1" 2>/dev/null | sed -n 's/^holders: //p')
	[ "$h" = "$2" ]
}

# status_is KEY NAME VALUE: `keylock status KEY` shows the line
# "NAME: VALUE".
status_is() {
	"$KEYLOCK" "${P[@]}" status "$1" 2>/dev/null | grep -qx "$2: $3"
}

# can_list: `keylock list` works on the provider (kl_provider_snapshot).
can_list() {
	"$KEYLOCK" "${P[@]}" list >/dev/null 2>&1
}

# wait_queue KEY N: waits until N processes wait for KEY.
wait_queue() {
	wait_until 20 "$2 waiters on '$1'" queue_is "$1" "$2"
}

# hold KEY NAME [OPTION...]: starts a background keylock (with the
# OPTIONs, such as -s) holding KEY whose command touches $TMP/NAME.held once
# it runs and exits when $TMP/NAME.release appears (or after 25 s).  Returns
# once the key is held; the keylock pid is in $holder.
hold() {
	local key=$1 name=$2
	shift 2
	bg "$KEYLOCK" "${P[@]}" "$@" "$key" -- sh -c '
		touch "$1.held"
		i=0
		while [ ! -e "$1.release" ] && [ $i -lt 500 ]; do
			sleep 0.05
			i=$((i + 1))
		done' sh "$TMP/$name"
	holder=$!
	wait_file "$TMP/$name.held"
}

# release NAME: lets the command started by hold NAME exit.
release() {
	touch "$TMP/$1.release"
}

# wait_exit PID: waits for a background keylock and sets $rc to its status.
wait_exit() {
	rc=0
	wait "$1" || rc=$?
}

# signal_ends_command SIG WHAT: SIG to keylock while it runs a command on
# key k that does not catch SIG: the command dies of it, keylock exits
# with 128+N, and the key is free then.
signal_ends_command() {
	local sig=$1 what=$2 pid
	# The signal at its default: a caller's ignored SIGHUP (nohup) is
	# inherited, and keylock rightly leaves the command ignoring it.
	bg env --default-signal="$sig" "$KEYLOCK" "${P[@]}" k -- \
		sh -c 'touch "$1"; exec sleep 60' sh "$TMP/$sig.cmd"
	pid=$!
	wait_file "$TMP/$sig.cmd"
	kill -s "$sig" "$pid"
	wait_exit "$pid"
	expect_rc $((128 + $(kill -l "$sig"))) "$what"
	kl "${P[@]}" -n k -- true
	expect_rc 0 "the key after $what"
}
