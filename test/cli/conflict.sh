#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# keylock(1) on a key another process holds: -n and -w give up with 75,
# or -E's status, without running the command; -q silences the report.
. "$(dirname "$0")/lib.sh"
need_local

hold k h
holders_is k 1 || fail "status does not show the holder"

kl "${P[@]}" -n k -- touch "$TMP/ran"
expect_rc 75 "-n on a held key"
grep -q "^keylock: 'k' not acquired" "$ERR" || fail "-n: no report"
[ ! -e "$TMP/ran" ] || fail "-n: the command ran"
kl "${P[@]}" --nonblock -E 3 k -- touch "$TMP/ran"
expect_rc 3 "-E 3"
kl "${P[@]}" -n -E 0 k -- touch "$TMP/ran"
expect_rc 0 "-E 0"
[ ! -e "$TMP/ran" ] || fail "-E 0: the command ran"
kl "${P[@]}" -n -q k -- true
expect_rc 75 "-n -q"
[ ! -s "$ERR" ] || fail "-q: something was printed"
kl "${P[@]}" -w 0 k -- true
expect_rc 75 "-w 0"
# Another key is independent.
kl "${P[@]}" -n other -- true
expect_rc 0 "another key"

start=$(now_ms)
kl "${P[@]}" -w 300ms k -- touch "$TMP/ran"
elapsed=$(($(now_ms) - start))
expect_rc 75 "-w 300ms"
grep -q "^keylock: 'k' not acquired within 300 ms$" "$ERR" ||
	fail "-w 300ms: report"
[ "$elapsed" -ge 300 ] || fail "-w 300ms gave up after $elapsed ms"
[ "$elapsed" -lt 10000 ] || fail "-w 300ms took $elapsed ms"
[ ! -e "$TMP/ran" ] || fail "-w 300ms: the command ran"

# A bare number is seconds.
start=$(now_ms)
kl "${P[@]}" -w 1 -E 9 k -- true
elapsed=$(($(now_ms) - start))
expect_rc 9 "-w 1"
grep -q "within 1 s$" "$ERR" || fail "-w 1: report"
[ "$elapsed" -ge 1000 ] || fail "-w 1 gave up after $elapsed ms"
[ "$elapsed" -lt 15000 ] || fail "-w 1 took $elapsed ms"

# The waits that gave up left the queue.
queue_is k 0 || fail "a waiter that gave up is still queued"

# A waiter with a deadline gets the key when it is released in time.
bg "$KEYLOCK" "${P[@]}" -w 20 k -- touch "$TMP/late"
waiter=$!
wait_queue k 1
release h
wait_exit "$waiter"
expect_rc 0 "-w 20 with a release in time"
[ -e "$TMP/late" ] || fail "the waiter's command did not run"
wait_exit "$holder"
expect_rc 0 "the holder"
kl "${P[@]}" -n k -- true
expect_rc 0 "-n on the released key"
exit 0
