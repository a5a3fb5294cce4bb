#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# keylock(1) with several keys taken as one set (-k KEY, repeated): the
# syntax and its usage errors, a set excludes a single-key holder of any of
# its keys and waits for one, and two sets with the same keys given in
# opposite orders, run many times in parallel, never deadlock (a watchdog
# fails the test instead of hanging) and exclude each other.
. "$(dirname "$0")/lib.sh"
need_local

# Usage: no command, a KEY argument beside -k, an empty -k KEY, -c with a
# command.
kl "${P[@]}" -k a
expect_usage "-k without a command"
kl "${P[@]}" -k a b -- true
expect_usage "-k with a KEY argument"
grep -q "'--' expected after the -k KEYs, found 'b'" "$ERR" ||
	fail "-k with a KEY argument: message"
kl "${P[@]}" -k a -k '' -- true
expect_usage "an empty -k KEY"
kl "${P[@]}" -k a -c true -- true
expect_usage "-k, -c and a command"
kl "${P[@]}" -k a --
expect_usage "-k and '--' with no command"
# A "--" that is the KEY of -k does not end the options: the command
# still needs its own "--".
kl "${P[@]}" -k a -k -- touch "$TMP/dashkey"
expect_usage "-k -- taken as the '--' before the command"
[ ! -e "$TMP/dashkey" ] || fail "-k -- COMMAND ran the command"
kl "${P[@]}" -k -- -- sh -c 'echo "$KEYLOCK_KEY"'
expect_rc 0 "the key '--' before '--'"
[ "$(cat "$OUT")" = -- ] || fail "-k -- --: KEYLOCK_KEY is '$(cat "$OUT")'"

# The command runs with every key held; KEYLOCK_KEY is the first key in
# canonical (bytewise) order; duplicates are merged.
kl "${P[@]}" -k b -k a -k b --key ab -- sh -c 'echo "$KEYLOCK_KEY"'
expect_rc 0 "a set"
[ "$(cat "$OUT")" = a ] || fail "KEYLOCK_KEY of the set is '$(cat "$OUT")'"
kl "${P[@]}" -k b -k a -c 'echo "$KEYLOCK_KEY"'
expect_rc 0 "a set with -c"
[ "$(cat "$OUT")" = a ] || fail "-c: KEYLOCK_KEY is '$(cat "$OUT")'"

# Only the first key reaches the command, so only it must fit in
# KEYLOCK_KEY: a later key longer than Linux lets one variable be (32
# pages with the name) is no usage error.
if [ "$(uname -s)" = Linux ]; then
	long=$(head -c $(($(getconf PAGESIZE) * 32 - 8)) /dev/zero | tr '\0' z)
	kl "${P[@]}" -k a -k "$long" -- sh -c 'echo "$KEYLOCK_KEY"'
	expect_rc 0 "a set with a long key after the first"
	[ "$(cat "$OUT")" = a ] || fail "long key: KEYLOCK_KEY is not a"
	kl "${P[@]}" -k "$long" -- true
	expect_usage "a long key first"
fi

# A set held excludes a single-key caller of each of its keys, not others.
bg "$KEYLOCK" "${P[@]}" -k y -k x -- sh -c '
	touch "$1.held"
	i=0
	while [ ! -e "$1.release" ] && [ $i -lt 500 ]; do
		sleep 0.05
		i=$((i + 1))
	done' sh "$TMP/set"
set_holder=$!
wait_file "$TMP/set.held"
holders_is x 1 || fail "the set does not hold x"
holders_is y 1 || fail "the set does not hold y"
kl "${P[@]}" -n x -- true
expect_rc 75 "x while the set holds it"
kl "${P[@]}" -n y -- true
expect_rc 75 "y while the set holds it"
kl "${P[@]}" -n z -- true
expect_rc 0 "z, outside the set"
release set
wait_exit "$set_holder"
expect_rc 0 "the set holder"
kl "${P[@]}" -n x -- true
expect_rc 0 "x after the set"

# A set waits for a single-key holder of one of its keys, holding none of
# them when it gives up.
hold y h
kl "${P[@]}" -n -k x -k y -- touch "$TMP/ran"
expect_rc 75 "a set with y held"
grep -q "'y'" "$ERR" || fail "the report does not name y"
[ ! -e "$TMP/ran" ] || fail "the set's command ran"
holders_is x 0 || fail "x stayed held after the set gave up"
bg "$KEYLOCK" "${P[@]}" -k y -k x -- touch "$TMP/late"
waiter=$!
wait_queue y 1
release h
wait_exit "$waiter"
expect_rc 0 "the set once y was released"
[ -e "$TMP/late" ] || fail "the waiting set's command did not run"
wait_exit "$holder"

# -v reports the wait of the whole set, not of its last key: the set waits
# for a (held) at least the second slept after it queued, then takes b
# at once.
hold a h2
bg "$KEYLOCK" "${P[@]}" -v -k b -k a -- true 2>"$TMP/v.err"
waiter=$!
wait_queue a 1
sleep 1
release h2
wait_exit "$waiter"
expect_rc 0 "the set of -v"
wait_exit "$holder"
waited=$(sed -n "s/.*acquired 'b, a' after \([0-9]*\) ms.*/\1/p" "$TMP/v.err")
[ -n "$waited" ] || fail "-v: no wait reported: $(cat "$TMP/v.err")"
[ "$waited" -ge 1000 ] || fail "-v: the set waited $waited ms, not its wait for a"

# ABBA: loops of sets {A, B} in both orders, in parallel.  Each command
# increments a counter with a read then a write, so that two commands
# inside at once would lose an increment.
echo 0 >"$TMP/count"
loops=8
rounds=6
pids=()
for i in $(seq $loops); do
	if [ $((i % 2)) -eq 0 ]; then order=(-k A -k B); else order=(-k B -k A); fi
	(
		for r in $(seq $rounds); do
			"$KEYLOCK" "${P[@]}" "${order[@]}" -- sh -c '
				n=$(cat "$1"); echo $((n + 1)) >"$1"' sh \
				"$TMP/count" || exit 1
		done
	) &
	pids+=($!)
	BG+=($!)
done
end=$((SECONDS + 240))
for pid in "${pids[@]}"; do
	while kill -0 "$pid" 2>/dev/null; do
		[ "$SECONDS" -lt "$end" ] ||
			fail "sets in opposite orders deadlocked (watchdog)"
		sleep 0.1
	done
	wait "$pid" || fail "a set call failed"
done
[ "$(cat "$TMP/count")" -eq $((loops * rounds)) ] ||
	fail "the counter is $(cat "$TMP/count"), expected $((loops * rounds))"
holders_is A 0 && holders_is B 0 || fail "A or B still held"
