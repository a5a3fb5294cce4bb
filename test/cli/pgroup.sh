#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# keylock(1): a signal reaches the command exactly once, whether it was
# sent to keylock or to keylock's process group (issue 15, item 10).
#
# The command counts the SIGTERMs it gets.  After each SIGTERM the test
# sends SIGWINCH to keylock and waits until the command has it: keylock
# passes signals on in the order of their numbers (SIGTERM before
# SIGWINCH), so every SIGTERM it was going to pass on has arrived by then.
. "$(dirname "$0")/lib.sh"
need_local
command -v setsid >/dev/null || skip "setsid(1) is missing"

cat >"$TMP/counter" <<'EOS'
dir=$1
trap 'echo TERM >>"$dir/log"' TERM
trap 'echo WINCH >>"$dir/log"' WINCH
touch "$dir/started"
i=0
while [ ! -e "$dir/release" ] && [ $i -lt 1200 ]; do
	sleep 0.05 &
	wait $!
	i=$((i + 1))
done
exit 0
EOS

count() {
	grep -c "^$1\$" "$TMP/log" 2>/dev/null
}

has_log() {
	[ "$(count "$1")" -ge "$2" ]
}

# start: runs keylock as the leader of a process group of its own (as a
# shell with job control, timeout(1) or a service manager would), with
# the counter as its command; the pid, also the group id, is in $pid.
start() {
	rm -f "$TMP/log" "$TMP/started" "$TMP/release"
	bg setsid "$KEYLOCK" "${P[@]}" k -- bash "$TMP/counter" "$TMP"
	pid=$!
	wait_file "$TMP/started"
	# setsid(1) runs keylock in its own process, the group leader.
	read -r -a stat <"/proc/$pid/stat" || fail "no /proc/$pid/stat"
	[ "${stat[4]}" = "$pid" ] || fail "keylock is not its group's leader"
}

# settle WHAT: after a SIGTERM, waits for it and for the SIGWINCH sent to
# keylock after it; then no more SIGTERM can be on its way.
settle() {
	wait_until 20 "SIGTERM to reach the command ($1)" has_log TERM 1
	kill -WINCH "$pid"
	local end=$((SECONDS + 20))
	until has_log WINCH 1 || [ "$SECONDS" -ge "$end" ]; do
		sleep 0.05
	done
	[ "$(count TERM)" -eq 1 ] ||
		fail "$1: the command got SIGTERM $(count TERM) times"
	has_log WINCH 1 || fail "$1: SIGWINCH sent to keylock did not reach the command"
}

finish() {
	touch "$TMP/release"
	wait_exit "$pid"
	expect_rc 0 "$1: keylock once the command exited"
}

# kill -TERM -PGID: the whole group, keylock included.
start
kill -TERM -- "-$pid"
settle "kill -TERM -PGID"
finish "kill -TERM -PGID"

# kill -TERM PID: keylock alone.
start
kill -TERM "$pid"
settle "kill -TERM PID"
finish "kill -TERM PID"

# timeout --foreground sends its signal to keylock alone.
if command -v timeout >/dev/null; then
	rm -f "$TMP/log" "$TMP/started" "$TMP/release"
	bg timeout --foreground -s TERM 600 "$KEYLOCK" "${P[@]}" k -- \
		bash "$TMP/counter" "$TMP"
	tpid=$!
	wait_file "$TMP/started"
	kill -TERM "$tpid"
	wait_until 20 "SIGTERM to reach the command (timeout)" has_log TERM 1
	touch "$TMP/release"
	wait_exit "$tpid"
	[ "$(count TERM)" -eq 1 ] ||
		fail "timeout: the command got SIGTERM $(count TERM) times"
fi
exit 0
