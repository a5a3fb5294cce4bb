#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# keylock(1): a signal reaches the command exactly once, whether it was
# sent to keylock or to keylock's process group (issue 15, item 10).
#
# The command, test/cli/sig_count, counts the SIGTERMs it gets.  After
# each SIGTERM the test sends SIGWINCH to keylock and waits until the
# command has it: keylock passes signals on in the order of their numbers
# (SIGTERM before SIGWINCH), and so does the kernel to the command, so
# every SIGTERM keylock was going to pass on has arrived by then.
#
# timeout(1) sends its signal to keylock and then to its own process
# group, keylock included: the same signal twice from one sender, which
# keylock passes on once (issue 15, item 10).  test/cli/sig_twice sends
# two copies that way, back to back or a second apart.  Each case that
# depends on how the two copies meet in keylock runs KL_PGROUP_REPS times
# (20 unless told).
. "$(dirname "$0")/lib.sh"
need_local
command -v setsid >/dev/null || skip "setsid(1) is missing"
SIG_TWICE=$top_builddir/test/cli/sig_twice
SIG_COUNT=$top_builddir/test/cli/sig_count
[ -x "$SIG_TWICE" ] || skip "test/cli/sig_twice is not built"
[ -x "$SIG_COUNT" ] || skip "test/cli/sig_count is not built"
REPS=${KL_PGROUP_REPS:-20}

count() {
	grep -c "^$1\$" "$TMP/log" 2>/dev/null
}

has_log() {
	[ "$(count "$1")" -ge "$2" ]
}

# start: runs keylock as the leader of a process group of its own (as a
# shell with job control, timeout(1) or a service manager would), with
# sig_count as its command; the pid, also the group id, is in $pid.
start() {
	rm -f "$TMP/log" "$TMP/started" "$TMP/release"
	bg setsid "$KEYLOCK" "${P[@]}" k -- "$SIG_COUNT" "$TMP"
	pid=$!
	wait_file "$TMP/started"
	# setsid(1) runs keylock in its own process, the group leader.
	read -r -a stat <"/proc/$pid/stat" || fail "no /proc/$pid/stat"
	[ "${stat[4]}" = "$pid" ] || fail "keylock is not its group's leader"
}

# settle WHAT [N]: after SIGTERM was sent, waits for it to reach the
# command and for the SIGWINCH sent to keylock (pid $pid) after it; then
# no more SIGTERM can be on its way.  Fails unless the command got it N
# times (1 unless told).
settle() {
	local n=${2:-1}
	wait_until 20 "SIGTERM to reach the command ($1)" has_log TERM "$n"
	kill -WINCH "$pid"
	local end=$((SECONDS + 20))
	until has_log WINCH 1 || [ "$SECONDS" -ge "$end" ]; do
		sleep 0.05
	done
	[ "$(count TERM)" -eq "$n" ] ||
		fail "$1: the command got SIGTERM $(count TERM) times, not $n"
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

# timeout(1)'s double: to keylock, then at once to keylock's group.
for ((r = 1; r <= REPS; r++)); do
	start
	"$SIG_TWICE" 15 "$pid" "-$pid" || fail "sig_twice failed"
	settle "kill PID, kill -PGID ($r of $REPS)"
	finish "kill PID, kill -PGID"
done

# The same sender, a second apart: two signals, not one sent twice.
start
"$SIG_TWICE" 15 "$pid" "$pid" 1000 || fail "sig_twice failed"
settle "two SIGTERMs a second apart" 2
finish "two SIGTERMs a second apart"

command -v timeout >/dev/null || exit 0

# Plain timeout(1), its own group's leader with keylock in it.  SIGALRM is
# what its timer sends it when the duration is over: sent by hand, it
# times out once the command runs rather than after a guessed delay.  It
# then sends SIGTERM twice and SIGCONT twice.
for ((r = 1; r <= REPS; r++)); do
	rm -f "$TMP/log" "$TMP/started" "$TMP/release"
	bg timeout 600 "$KEYLOCK" "${P[@]}" k -- "$SIG_COUNT" "$TMP"
	tpid=$!
	wait_file "$TMP/started"
	read -r pid <"$TMP/started"
	kill -ALRM "$tpid"
	# Its SIGCONTs come after both SIGTERMs.
	wait_until 20 "SIGCONT from timeout" has_log CONT 1
	settle "timeout ($r of $REPS)"
	touch "$TMP/release"
	wait_exit "$tpid"
	expect_rc 124 "timeout"
done

# timeout --foreground sends its signal to keylock alone.
rm -f "$TMP/log" "$TMP/started" "$TMP/release"
bg timeout --foreground -s TERM 600 "$KEYLOCK" "${P[@]}" k -- \
	"$SIG_COUNT" "$TMP"
tpid=$!
wait_file "$TMP/started"
kill -TERM "$tpid"
wait_until 20 "SIGTERM to reach the command (timeout)" has_log TERM 1
touch "$TMP/release"
wait_exit "$tpid"
[ "$(count TERM)" -eq 1 ] ||
	fail "timeout: the command got SIGTERM $(count TERM) times"
exit 0
