#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# keylock(1) grants one key in arrival order: eight processes queue one at
# a time behind a holder, each confirmed queued before the next starts, and
# their commands run in that order.
. "$(dirname "$0")/lib.sh"
need_local

N=8
hold k h
pids=()
for i in $(seq "$N"); do
	bg "$KEYLOCK" "${P[@]}" k -- sh -c 'echo "$2" >>"$1"' sh "$TMP/order" "$i"
	pids+=($!)
	wait_queue k "$i"
done
release h
for i in $(seq "$N"); do
	wait_exit "${pids[$((i - 1))]}"
	expect_rc 0 "waiter $i"
done
want=$(seq "$N")
got=$(cat "$TMP/order")
[ "$got" = "$want" ] || fail "grant order $(echo $got), expected $(echo $want)"
wait_exit "$holder"
expect_rc 0 "the holder"
queue_is k 0 || fail "waiters left in the queue"
exit 0
