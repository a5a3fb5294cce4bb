#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# keylock -s, -x, keylock list [--json] and keylock status KEY against a
# Redis or PostgreSQL server (KEYLOCK_CLI_PROVIDER; tools/test's redis and
# pg stages run it through cli_remote): two -s commands hold a key at once,
# an -x queues behind them and runs after both; list shows that state as
# 2 shared holders and 1 exclusive waiter at position 0, each with the
# key's 1 waiter, in JSON and in the table; status counts it.
#
# Neither provider can name a key (kl_lock_info.key is NULL): Redis gives
# its Redis key name in detail and no pid, PostgreSQL "advisory lock ...,
# server process N" with that server process as pid for another client.
# So the test's entries are found by their lock name (the detail, without
# PostgreSQL's server process): the one name that was not listed before.
# Keys (and, for Redis, the prefix) are unique per run.  Orders are forced
# with files and keylock status, never slept into.
#
# Key sets on the server (-k KEY, repeated): a set holds every key while
# its command runs and none after it; a set that cannot have its second
# key holds nothing when it gives up; loops of two sets with the same keys
# in opposite orders, in parallel, all finish (each set call bounded by
# -w 30s, so a deadlock fails the test instead of hanging it) and run
# their commands one at a time.
. "$(dirname "$0")/lib.sh"
[ -n "${KEYLOCK_CLI_PROVIDER:-}" ] ||
	skip "no server: the redis and pg stages of tools/test set KEYLOCK_CLI_PROVIDER"
command -v jq >/dev/null || fail "jq is missing (tools/test installs it)"

uri=$KEYLOCK_CLI_PROVIDER
run=$$-$RANDOM-$(date +%s)
case $uri in
redis://* | rediss://*)
	kind=redis
	prefix=klmodes-$run:
	case $uri in
	*\?*) uri=$uri\&prefix=$prefix ;;
	*) uri=$uri\?prefix=$prefix ;;
	esac
	;;
postgres://* | postgresql://*) kind=pg ;;
*) skip "not a Redis or PostgreSQL URI: ${uri%%:*}" ;;
esac
P=(-p "$uri")
K=modes-$run

# name: a snapshot entry's lock name, the same on all its entries.
NAMES='def name: (.detail // "") | sub(", server process [0-9]+$"; "");'

kl "${P[@]}" list --json
expect_rc 0 "list --json before"
jq -e 'type == "array"' "$OUT" >/dev/null || fail "list --json: not an array"
jq -c "$NAMES [.[] | name] | unique" "$OUT" >"$TMP/before" ||
	fail "list --json before: no lock names"

# Two -s commands hold K at once: b's command starts while a's still runs,
# and a third -s is granted with -n beside them.
hold "$K" a -s
pid_a=$holder
hold "$K" b --shared
pid_b=$holder
[ ! -e "$TMP/a.release" ] && kill -0 "$pid_a" 2>/dev/null ||
	fail "a is not holding"
kl "${P[@]}" -s -n "$K" -- touch "$TMP/third"
expect_rc 0 "-s -n beside two -s holders"
[ -e "$TMP/third" ] || fail "the third -s command did not run"
kl "${P[@]}" -x -n "$K" -- touch "$TMP/ran"
expect_rc 75 "-x -n while two -s hold"
[ ! -e "$TMP/ran" ] || fail "-x -n ran its command beside -s holders"

# An -x queues behind them; its command checks that both were let go.
bg "$KEYLOCK" "${P[@]}" -x "$K" -- sh -c '
	[ -e "$1/a.release" ] && [ -e "$1/b.release" ] && echo x >>"$1/order"
	echo ran >>"$1/order"' sh "$TMP"
pid_x=$!
wait_queue "$K" 1
holders_is "$K" 2 || fail "status: not 2 holders"

# The JSON: the one new lock name is K's, with 2 shared holders first,
# then the exclusive waiter at the head of the queue.
kl "${P[@]}" list --json
expect_rc 0 "list --json"
cp "$OUT" "$TMP/snap.json"
jq -c --slurpfile before "$TMP/before" "$NAMES"'
	[.[] | select(name as $n | $before[0] | any(. == $n) | not)]' \
	"$TMP/snap.json" >"$TMP/mine" || fail "list --json: cannot pick K's entries"
jq -e "$NAMES"'[.[] | name] | unique | length == 1' "$TMP/mine" >/dev/null ||
	fail "list --json: K's entries are not one new lock: $(cat "$TMP/mine")"
jq -e '[.[] | [.key, .mode, .state, .position, .waiters]] ==
	[[null, "shared", "held", null, 1], [null, "shared", "held", null, 1],
	 [null, "exclusive", "waiting", 0, 1]]' "$TMP/mine" >/dev/null ||
	fail "list --json: K's entries are $(cat "$TMP/mine")"
jq -e '.[2].fence == null and all(.[]; .tid == null)' "$TMP/mine" >/dev/null ||
	fail "list --json: a waiter's fence or a tid"
if [ "$kind" = redis ]; then
	jq -e --arg p "$prefix" 'all(.[]; .detail | startswith($p + "{")) and
		all(.[]; .pid == null) and
		.[0].fence > 0 and .[1].fence > 0 and .[0].fence != .[1].fence' \
		"$TMP/mine" >/dev/null ||
		fail "list --json: Redis details, pids or fences: $(cat "$TMP/mine")"
	# Nothing else in the run's prefix.
	[ "$(jq length "$TMP/snap.json")" -eq 3 ] ||
		fail "list --json: not 3 entries under the prefix"
else
	# Other sessions: the server process as pid, no fence known.
	jq -e --argjson a "$pid_a" --argjson b "$pid_b" --argjson x "$pid_x" '
		all(.[]; .detail | test("^advisory lock -?[0-9]+ \\(classid [0-9]+, objid [0-9]+\\), server process [0-9]+$")) and
		all(.[]; .pid > 0 and .pid != $a and .pid != $b and .pid != $x and
		    (.pid as $p | .detail | endswith(", server process \($p)"))) and
		(.[0].pid != .[1].pid) and .[0].fence == null and .[1].fence == null' \
		"$TMP/mine" >/dev/null ||
		fail "list --json: PostgreSQL details, pids or fences: $(cat "$TMP/mine")"
fi

# The table: the same rows, the lock name in brackets (a long one cut in
# the middle, its head and tail kept); the columns after KEY are read from
# the header's positions.
kl "${P[@]}" list
expect_rc 0 "list"
head -n 1 "$OUT" | grep -q '^KEY  *MODE  *STATE  *POS  *PID  *TID  *TIME  *FENCE  *WAITERS$' ||
	fail "list: the header"
name=$(jq -r "$NAMES"'.[0] | name' "$TMP/mine")
if [ "$kind" = redis ]; then end="${name: -12}]"; else end=; fi
awk -v want="[${name:0:20}" -v end="$end" '
	NR == 1 { col = index($0, "MODE"); next }
	index($0, want) == 1 && (end == "" || index($0, end) > 0) {
		print substr($0, col)
	}' "$OUT" >"$TMP/rows"
awk '{ print $1, $2, $3, $8 }' "$TMP/rows" >"$TMP/cols"
printf '%s\n' "SHARED held - 1" "SHARED held - 1" "EXCL waiting 1 1" |
	cmp -s - "$TMP/cols" || fail "list: K's rows are: $(cat "$TMP/rows")"
if [ "$kind" = redis ]; then
	want='^- - [^ ]+ [0-9]+$'
	[ "$(wc -l <"$OUT")" -eq 4 ] || fail "list: not a header and 3 rows"
else
	want='^[0-9]+ - [^ ]+ -$'
fi
awk 'NR <= 2 { print $4, $5, $6, $7 }' "$TMP/rows" | grep -Evq "$want" &&
	fail "list: a holder's PID, TID, TIME or FENCE: $(cat "$TMP/rows")"
awk 'NR == 3 { print $7 }' "$TMP/rows" | grep -qx -- - ||
	fail "list: the waiter's FENCE"

# keylock status KEY: the counts of K; its modes are unknown, since the
# provider's locks carry no key to tell K's from others'.
kl "${P[@]}" status "$K"
expect_rc 0 "status KEY"
for line in "provider: ${KEYLOCK_CLI_PROVIDER%%:*}" "key: $K" "holders: 2" \
	"queue: 1" "shared holders: unknown" "exclusive holders: unknown" \
	"shared waiters: unknown" "exclusive waiters: unknown"; do
	grep -qx "$line" "$OUT" || fail "status KEY: no line '$line'"
done
if [ "$kind" = redis ]; then
	# One key in the run's prefix, whatever number of entries it has.
	kl "${P[@]}" status
	grep -qx "keys: 1" "$OUT" || fail "status: keys"
fi

# One -s holder leaves: the -x still waits for the other.
release a
wait_exit "$pid_a"
expect_rc 0 "holder a"
wait_until 20 "one holder left" holders_is "$K" 1
queue_is "$K" 1 || fail "the -x left the queue while an -s holder remained"
[ ! -e "$TMP/order" ] || fail "the -x ran while an -s holder remained"
# The last leaves: the -x runs, after both.
release b
wait_exit "$pid_b"
expect_rc 0 "holder b"
wait_exit "$pid_x"
expect_rc 0 "the -x waiter"
[ "$(cat "$TMP/order" 2>/dev/null)" = "$(printf 'x\nran')" ] ||
	fail "the -x command ran before both holders were let go"
wait_until 20 "K to be free" holders_is "$K" 0
queue_is "$K" 0 || fail "K still has waiters"

# Key sets.  SA < SB in the canonical (bytewise) order.
SA=$K-setA
SB=$K-setB
bg "$KEYLOCK" "${P[@]}" -k "$SB" -k "$SA" -- sh -c '
	touch "$1.held"
	i=0
	while [ ! -e "$1.release" ] && [ $i -lt 500 ]; do
		sleep 0.05
		i=$((i + 1))
	done' sh "$TMP/set"
set_holder=$!
wait_file "$TMP/set.held"
holders_is "$SA" 1 || fail "the set does not hold $SA"
holders_is "$SB" 1 || fail "the set does not hold $SB"
kl "${P[@]}" -n "$SA" -- true
expect_rc 75 "$SA while the set holds it"
kl "${P[@]}" -n "$SB" -- true
expect_rc 75 "$SB while the set holds it"
release set
wait_exit "$set_holder"
expect_rc 0 "the set holder"
wait_until 20 "the set's keys to be free" holders_is "$SA" 0
holders_is "$SB" 0 || fail "$SB still held after the set"
kl "${P[@]}" -n -k "$SA" -k "$SB" -- true
expect_rc 0 "a set try-once on free keys"

# The second key held: the set gives up (1 s) holding nothing.
hold "$SB" h
kl "${P[@]}" -w 1s -k "$SB" -k "$SA" -- touch "$TMP/setran"
expect_rc 75 "a set with its second key held"
[ ! -e "$TMP/setran" ] || fail "the set's command ran without $SB"
grep -q "$SB" "$ERR" || fail "the report does not name $SB: $(cat "$ERR")"
holders_is "$SA" 0 || fail "$SA stayed held after the set gave up"
queue_is "$SA" 0 || fail "$SA has a waiter after the set gave up"
release h
wait_exit "$holder"
expect_rc 0 "the holder of $SB"

# Opposite orders in parallel loops: all finish, one command at a time.
echo 0 >"$TMP/count"
loops=4
rounds=5
pids=()
for i in $(seq $loops); do
	if [ $((i % 2)) -eq 0 ]; then
		order=(-k "$SA" -k "$SB")
	else
		order=(-k "$SB" -k "$SA")
	fi
	(
		for r in $(seq $rounds); do
			"$KEYLOCK" "${P[@]}" -w 30s "${order[@]}" -- sh -c '
				n=$(cat "$1"); sleep 0.02; echo $((n + 1)) >"$1"' \
				sh "$TMP/count" || exit 1
		done
	) &
	pids+=($!)
	BG+=($!)
done
for pid in "${pids[@]}"; do
	wait "$pid" || fail "a set call failed (a deadlock times out after 30 s)"
done
[ "$(cat "$TMP/count")" -eq $((loops * rounds)) ] ||
	fail "the counter is $(cat "$TMP/count"), expected $((loops * rounds))"
holders_is "$SA" 0 && holders_is "$SB" 0 || fail "a set key still held"
exit 0
