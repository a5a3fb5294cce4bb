#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# keylock(1) and signals: SIGTERM and SIGHUP are passed on to the command,
# the key is released only after the command has exited, and a signal
# during the wait leaves the queue without disturbing the waiters behind.
. "$(dirname "$0")/lib.sh"
need_local

# trapper DIR KEYLOCK ARGS...: on SIGTERM, records in DIR/probe whether
# `keylock -n k` can take the key (it must not: the key is still held
# while the command runs), then exits 7.
cat >"$TMP/trapper" <<'EOS'
dir=$1
shift
keylock=("$@")
on_term() {
	"${keylock[@]}" -n k -- true
	echo "$?" >"$dir/probe"
	exit 7
}
trap on_term TERM
touch "$dir/started"
. "$dir/naps"
naps 400
exit 0
EOS

# SIGTERM to keylock while the command runs.
bg "$KEYLOCK" "${P[@]}" k -- bash "$TMP/trapper" "$TMP" "$KEYLOCK" "${P[@]}"
pid=$!
wait_file "$TMP/started"
kill -TERM "$pid"
wait_exit "$pid"
expect_rc 7 "SIGTERM passed on: the command's status"
[ -e "$TMP/probe" ] || fail "the command did not get SIGTERM"
[ "$(cat "$TMP/probe")" = 75 ] ||
	fail "the key was free while the command handled SIGTERM ($(cat "$TMP/probe"))"
kl "${P[@]}" -n k -- true
expect_rc 0 "the key after the command exited"

# SIGHUP: the command dies of it, and so does keylock (128+1).
signal_ends_command HUP "SIGHUP passed on"

# SIGTERM during the wait: A leaves the queue, B and C keep their order.
hold k h
bg "$KEYLOCK" "${P[@]}" k -- touch "$TMP/A.ran"
a=$!
wait_queue k 1
bg "$KEYLOCK" "${P[@]}" k -- sh -c 'echo B >>"$1"' sh "$TMP/order"
b=$!
wait_queue k 2
bg "$KEYLOCK" "${P[@]}" k -- sh -c 'echo C >>"$1"' sh "$TMP/order"
c=$!
wait_queue k 3
start=$(now_ms)
kill -TERM "$a"
wait_exit "$a"
elapsed=$(($(now_ms) - start))
expect_rc 143 "SIGTERM during the wait"
[ "$elapsed" -lt 10000 ] || fail "SIGTERM during the wait took $elapsed ms"
wait_queue k 2
holders_is k 1 || fail "the holder lost the key when a waiter left"
release h
wait_exit "$b"
expect_rc 0 "waiter B"
wait_exit "$c"
expect_rc 0 "waiter C"
[ ! -e "$TMP/A.ran" ] || fail "the signalled waiter ran its command"
[ "$(cat "$TMP/order")" = "$(printf 'B\nC')" ] ||
	fail "order after a waiter left: $(tr '\n' ' ' <"$TMP/order")"
wait_exit "$holder"
expect_rc 0 "the holder"
exit 0
