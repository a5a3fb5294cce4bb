#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# keylock(1) running a command: the exit status passes through, 126/127
# for a command that cannot be run, 128+N for one killed by a signal, the
# arguments, stdin and environment reach it, and the fence grows.
. "$(dirname "$0")/lib.sh"
need_local

kl "${P[@]}" k -- true
expect_rc 0 "true"
kl "${P[@]}" k -- sh -c 'exit 42'
expect_rc 42 "exit 42"
kl "${P[@]}" k -- false
expect_rc 1 "false"
[ ! -s "$ERR" ] || fail "false: keylock printed something"

# Arguments verbatim, options after '--' included.
kl "${P[@]}" k -- printf '%s|' "a b" "" -x --help '$HOME' -- '*'
expect_rc 0 "printf"
[ "$(cat "$OUT")" = 'a b||-x|--help|$HOME|--|*|' ] || fail "arguments changed"
# stdin reaches the command.
rc=0
got=$(echo hello | "$KEYLOCK" "${P[@]}" k -- cat) || rc=$?
expect_rc 0 "cat"
[ "$got" = hello ] || fail "stdin: got '$got'"

# Not found: 127, by name (PATH search) and by path.
kl "${P[@]}" k -- keylock-no-such-command-here
expect_rc 127 "a missing command"
grep -q "keylock-no-such-command-here" "$ERR" || fail "missing command not named"
kl "${P[@]}" k -- "$TMP/no-such-file"
expect_rc 127 "a missing path"
# Found but not executable: 126 (a plain file, a directory, a file in PATH).
: >"$TMP/plain"
chmod 644 "$TMP/plain"
kl "${P[@]}" k -- "$TMP/plain"
expect_rc 126 "a file without x permission"
kl "${P[@]}" k -- "$TMP"
expect_rc 126 "a directory"
mkdir "$TMP/bin"
cp "$TMP/plain" "$TMP/bin/plaincmd"
PATH="$TMP/bin:$PATH" kl "${P[@]}" k -- plaincmd
expect_rc 126 "a non-executable file found in PATH"
# A script without "#!" is run by /bin/sh, as execvp does.
printf 'echo "script:$1"\n' >"$TMP/bin/script"
chmod 755 "$TMP/bin/script"
kl "${P[@]}" k -- "$TMP/bin/script" arg
expect_rc 0 "a script without #!"
[ "$(cat "$OUT")" = "script:arg" ] || fail "script without #!: output"
# The lock was released after each of these.
kl "${P[@]}" -n k -- true
expect_rc 0 "the key is free after the failed runs"

# Killed by a signal: 128+N, and keylock dies of the same signal.
rc=0
"$KEYLOCK" "${P[@]}" k -- sh -c 'kill -TERM $$' 2>"$ERR" || rc=$?
expect_rc 143 "a command killing itself with SIGTERM"
rc=0
"$KEYLOCK" "${P[@]}" k -- sh -c 'kill -KILL $$' 2>"$ERR" || rc=$?
expect_rc 137 "a command killing itself with SIGKILL"
# The parent shell sees the signal itself: bash reports "Terminated" only
# for a child killed by a signal, not for one that exited with 143.
got=$(bash -c '"$@"; echo "status $?"' _ "$KEYLOCK" "${P[@]}" k -- \
	sh -c 'kill -TERM $$' 2>&1)
case $got in
*Terminated*"status 143") ;;
*) fail "killed by SIGTERM: the parent shell saw '$got'" ;;
esac
kl "${P[@]}" -n k -- true
expect_rc 0 "the key is free after the command was killed"

# The environment: KEYLOCK_KEY and KEYLOCK_FENCE, replacing inherited ones;
# the rest is passed on.
env_of() {
	KEYLOCK_KEY=stale KEYLOCK_FENCE=stale KL_OTHER=kept \
		kl "${P[@]}" "$1" -- sh -c \
		'printf "%s\n" "$KEYLOCK_KEY" "$KEYLOCK_FENCE" "$KL_OTHER"'
	expect_rc 0 "the environment for '$1'"
	key=$(sed -n 1p "$OUT")
	fence=$(sed -n 2p "$OUT")
	[ "$key" = "$1" ] || fail "KEYLOCK_KEY is '$key', expected '$1'"
	[ "$(sed -n 3p "$OUT")" = kept ] || fail "the environment was not passed on"
	case $fence in
	'' | *[!0-9]*) fail "KEYLOCK_FENCE '$fence' is not a number" ;;
	esac
}
env_of "a key=with spaces"
env_of envkey
first=$fence
env_of envkey
[ "$fence" -gt "$first" ] || fail "the fence did not grow: $first then $fence"

# -v reports the times and the fence on stderr, nothing on stdout.
kl "${P[@]}" -v k -- true
expect_rc 0 "-v"
grep -Eq "^keylock: acquired 'k' after [0-9]+ ms \(fence [0-9]+\)$" "$ERR" ||
	fail "-v: no acquired line"
grep -Eq "^keylock: released 'k' \(held [0-9]+ ms\)$" "$ERR" ||
	fail "-v: no released line"
[ ! -s "$OUT" ] || fail "-v: output on stdout"

# Every DURATION form on a free key.
for w in 0 1 1.5 250ms 5s 1.5m 2h 1d forever; do
	kl "${P[@]}" -w "$w" k -- true
	expect_rc 0 "-w $w"
done
kl "${P[@]}" -t 30 -w 1 k -- true
expect_rc 0 "-t 30"
kl "${P[@]}" --ttl=0 --wait=1 --nonblock --quiet --verbose --conflict-exit-code=3 k -- true
expect_rc 0 "long options"
exit 0
