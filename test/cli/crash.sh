#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# keylock(1) processes killed with SIGKILL: a dead holder's key passes to
# the next waiter, and a dead waiter does not block the ones behind it.
. "$(dirname "$0")/lib.sh"
need_local

# A holder and its command both SIGKILLed while a waiter waits.
bg "$KEYLOCK" "${P[@]}" k -- sh -c 'echo $$ >"$1.tmp"; mv "$1.tmp" "$1"; exec sleep 25' \
	sh "$TMP/child"
holder=$!
wait_file "$TMP/child"
child=$(cat "$TMP/child")
bg "$KEYLOCK" "${P[@]}" -w 20 k -- touch "$TMP/next"
waiter=$!
wait_queue k 1
start=$(now_ms)
kill -KILL "$holder" "$child"
wait_exit "$waiter"
elapsed=$(($(now_ms) - start))
expect_rc 0 "the waiter behind a killed holder"
[ -e "$TMP/next" ] || fail "the waiter's command did not run"
[ "$elapsed" -lt 5000 ] || fail "the waiter took $elapsed ms after the kill"

# A newcomer after a holder was killed with nobody waiting.
bg "$KEYLOCK" "${P[@]}" k -- sh -c 'echo $$ >"$1.tmp"; mv "$1.tmp" "$1"; exec sleep 25' \
	sh "$TMP/child2"
holder=$!
wait_file "$TMP/child2"
kill -KILL "$holder" "$(cat "$TMP/child2")"
wait "$holder" 2>/dev/null
start=$(now_ms)
kl "${P[@]}" -w 10 k -- true
elapsed=$(($(now_ms) - start))
expect_rc 0 "a newcomer after a killed holder"
[ "$elapsed" -lt 5000 ] || fail "the newcomer took $elapsed ms"

# A waiter killed in the queue: the one behind it is served next.
hold k h
bg "$KEYLOCK" "${P[@]}" k -- touch "$TMP/dead.ran"
dead=$!
wait_queue k 1
bg "$KEYLOCK" "${P[@]}" -w 20 k -- touch "$TMP/behind.ran"
behind=$!
wait_queue k 2
kill -KILL "$dead"
wait "$dead" 2>/dev/null
release h
wait_exit "$behind"
expect_rc 0 "the waiter behind a killed waiter"
[ -e "$TMP/behind.ran" ] || fail "the waiter behind did not run"
[ ! -e "$TMP/dead.ran" ] || fail "the killed waiter ran"
wait_exit "$holder"
expect_rc 0 "the holder"
exit 0
