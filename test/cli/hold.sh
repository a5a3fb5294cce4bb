#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# keylock(1) keeps the key until the command has exited, whatever
# catchable signal keylock gets while the command runs (issue 15, item
# 11): each signal is passed on to the command, and `keylock -n` on the
# same key finds it busy until the command exits.
. "$(dirname "$0")/lib.sh"
need_local

# catcher DIR SIG: records SIG in DIR/SIG.got when it gets it, and exits 0
# once DIR/SIG.release exists (or after 60 s).
cat >"$TMP/catcher" <<'EOS'
dir=$1 sig=$2
trap 'touch "$dir/$sig.got"' "$sig"
touch "$dir/$sig.started"
. "$dir/naps"
naps 1200 "$dir/$sig.release"
exit 0
EOS

# got_or_gone SIG PID: the command got SIG, or keylock has exited.
got_or_gone() {
	[ -e "$TMP/$1.got" ] || ! kill -0 "$2" 2>/dev/null
}

for sig in USR1 USR2 QUIT INT ALRM PIPE VTALRM XCPU PWR TRAP; do
	# A background job of a shell without job control starts with
	# SIGINT and SIGQUIT ignored, which keylock and the command keep.
	bg env --default-signal "$KEYLOCK" "${P[@]}" k -- \
		bash "$TMP/catcher" "$TMP" "$sig"
	pid=$!
	wait_file "$TMP/$sig.started"
	kill -s "$sig" "$pid"
	wait_until 20 "SIG$sig to reach the command" got_or_gone "$sig" "$pid"
	kill -0 "$pid" 2>/dev/null ||
		fail "SIG$sig killed keylock while the command ran"
	kl "${P[@]}" -n k -- true
	expect_rc 75 "the key after SIG$sig, while the command runs"
	[ -e "$TMP/$sig.got" ] || fail "SIG$sig was not passed on to the command"
	touch "$TMP/$sig.release"
	wait_exit "$pid"
	expect_rc 0 "keylock after SIG$sig, once the command exited"
	kl "${P[@]}" -n k -- true
	expect_rc 0 "the key after the command that got SIG$sig exited"
done

# A signal the command does not catch ends it, and keylock reports it as
# 128+N after releasing the key.
signal_ends_command USR2 "SIGUSR2 not caught by the command"

# While keylock waits, a signal that would end a process makes it leave
# the queue and die of that signal; the holder is not disturbed.
hold k h
bg "$KEYLOCK" "${P[@]}" k -- touch "$TMP/waiter.ran"
pid=$!
wait_queue k 1
kill -USR1 "$pid"
wait_exit "$pid"
expect_rc $((128 + $(kill -l USR1))) "SIGUSR1 during the wait"
wait_queue k 0
holders_is k 1 || fail "the holder lost the key when a waiter got SIGUSR1"
[ ! -e "$TMP/waiter.ran" ] || fail "the signalled waiter ran its command"
release h
wait_exit "$holder"
expect_rc 0 "the holder"
exit 0
