#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# keylock -s/--shared and -x/-e/--exclusive (issue 17, item 4), on one FIFO
# queue per key (DESIGN.md, lock modes): two -s commands hold a key at
# once; an -x waits for the -s holders; an -s behind a queued -x waits
# too (no reader barging) and runs after it; the last of -s and -x counts,
# as in flock(1); keylock status shows holders and waiters by mode.  Orders
# are forced with files and `keylock status`, never with sleeps.
#
# Needs KL_SHARED in the local: provider (branch h-local).  A local:
# provider that can neither take keys shared nor list its locks is that
# branch not merged yet: skipped; one that lists its locks but grants -s
# alone fails.
. "$(dirname "$0")/lib.sh"
need_local

# The probe: one -s holder, and a second -s that must not wait.
hold k probe -s
kl "${P[@]}" -s -n k -- true
if [ "$rc" -eq 75 ] && ! can_list; then
	release probe
	wait_exit "$holder"
	skip "the local: provider grants -s exclusively (KL_SHARED comes with branch h-local)"
fi
expect_rc 0 "-s -n while another -s holds"
release probe
wait_exit "$holder"
expect_rc 0 "the probe's holder"
wait_until 20 "the probe's key to be free" holders_is k 0

# Two -s commands at once: b's command starts while a's still runs.
hold k a -s
pid_a=$holder
hold k b --shared
pid_b=$holder
[ -e "$TMP/a.held" ] && [ ! -e "$TMP/a.release" ] || fail "a is not holding"
holders_is k 2 || fail "two -s holders: status does not show 2 holders"
if can_list; then
	status_is k "shared holders" 2 || fail "status: shared holders"
	status_is k "exclusive holders" 0 || fail "status: exclusive holders"
fi

# An -x waits for the -s holders.
kl "${P[@]}" -x -n k -- touch "$TMP/ran"
expect_rc 75 "-x -n while -s holders hold"
grep -q "it is held" "$ERR" || fail "-x -n: message"
bg "$KEYLOCK" "${P[@]}" -x k -- sh -c 'echo x >>"$1"' sh "$TMP/order"
pid_x=$!
wait_queue k 1

# An -s behind the queued -x waits, although only -s holders hold.
kl "${P[@]}" -s -n k -- touch "$TMP/ran"
expect_rc 75 "-s -n behind a queued -x"
bg "$KEYLOCK" "${P[@]}" -s k -- sh -c 'echo s >>"$1"' sh "$TMP/order"
pid_s=$!
wait_queue k 2
[ ! -e "$TMP/ran" ] || fail "a command ran that had to wait"
if can_list; then
	status_is k "shared waiters" 1 || fail "status: shared waiters"
	status_is k "exclusive waiters" 1 || fail "status: exclusive waiters"
	status_is k "queue" 2 || fail "status: queue"
fi

# One -s holder leaves: the -x still waits for the other.
release a
wait_exit "$pid_a"
expect_rc 0 "holder a"
wait_until 20 "one holder left" holders_is k 1
queue_is k 2 || fail "the queue changed while an -s holder remained"
[ ! -e "$TMP/order" ] || fail "a waiter ran while an -s holder remained"

# The last holder leaves: the -x runs first, then the -s behind it.
release b
wait_exit "$pid_b"
expect_rc 0 "holder b"
wait_exit "$pid_x"
expect_rc 0 "the -x waiter"
wait_exit "$pid_s"
expect_rc 0 "the -s waiter"
[ "$(cat "$TMP/order")" = "$(printf 'x\ns')" ] ||
	fail "the order was $(echo $(cat "$TMP/order")), expected x s"
wait_until 20 "the key to be free" holders_is k 0

# flock(1)'s spellings: the last of -s and -x (-e, --exclusive) counts, and
# -s goes with --nb, -w and -c.
hold k c -s
for x in "-s -x" "--shared -e" "-s --exclusive"; do
	kl "${P[@]}" $x -n k -- touch "$TMP/ran"
	expect_rc 75 "$x: exclusive (the last) while -s holds"
done
for s in "-x -s" "-e --shared"; do
	kl "${P[@]}" $s --nb k -- true
	expect_rc 0 "$s: shared (the last) while -s holds"
done
export KL_TEST_OUT=$TMP/c.out
kl "${P[@]}" -s -w .5 k -c 'echo "$KEYLOCK_KEY" >"$KL_TEST_OUT"'
expect_rc 0 "-s -w .5 KEY -c STRING"
[ "$(cat "$TMP/c.out")" = k ] || fail "-s KEY -c STRING did not run"
rm -f "$TMP/c.out"
kl "${P[@]}" --shared --timeout=5 -c 'echo two >"$KL_TEST_OUT"' k
expect_rc 0 "--shared --timeout=5 -c STRING KEY"
[ "$(cat "$TMP/c.out")" = two ] || fail "--shared -c STRING KEY did not run"
# -v says the lock is shared.
kl "${P[@]}" -v -s -n k -- true
expect_rc 0 "-v -s while -s holds"
grep -Eq "^keylock: acquired 'k' after [0-9]+ ms \(fence [0-9]+, shared\)$" "$ERR" ||
	fail "-v -s: the acquired line does not say shared"
# A set taken shared: k is held -s, so both keys are granted.
kl "${P[@]}" -s -n -k k -k k2 -- true
expect_rc 0 "-s -k k -k k2 while k is held -s"
kl "${P[@]}" -n -k k -k k2 -- touch "$TMP/ran"
expect_rc 75 "-k k -k k2 (exclusive) while k is held -s"
[ ! -e "$TMP/ran" ] || fail "an exclusive command ran beside an -s holder"
release c
wait_exit "$holder"
expect_rc 0 "holder c"
exit 0
