#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# keylock list [--json] against known states of the local: provider
# (issue 17, item 5): nothing held, then a key held exclusively with an -s
# and an -x waiting behind it, and a key with a newline held -s.  The
# table shows one row per holder and waiter in queue order, with the
# key's number of waiters; the JSON (read back with jq) names the same
# entries with the holder's pid and fence.  keylock status agrees by mode.
#
# Needs kl_provider_snapshot in the local: provider (branch h-local): a
# provider that cannot list gives exit 69 and a message naming it (checked),
# and the rest is skipped then.  -s waiters need KL_SHARED there as well.
. "$(dirname "$0")/lib.sh"
need_local
command -v jq >/dev/null || skip "jq is missing (tools/test installs it)"

kl "${P[@]}" list
if [ "$rc" -ne 0 ]; then
	expect_rc 69 "list on a provider that cannot list"
	grep -qF "keylock: cannot list the locks of provider '${P[1]}'" "$ERR" ||
		fail "list on a provider that cannot list: message"
	skip "the local: provider cannot list its locks (kl_provider_snapshot comes with branch h-local)"
fi
[ "$(wc -l <"$OUT")" -eq 1 ] || fail "list with nothing held: more than the header"
grep -q '^KEY  *MODE  *STATE  *POS  *PID  *TID  *TIME  *FENCE  *WAITERS$' "$OUT" ||
	fail "list: the header"
kl "${P[@]}" list --json
expect_rc 0 "list --json with nothing held"
jq -e '. == []' "$OUT" >/dev/null || fail "list --json with nothing held is not []"

hold k h
pid_h=$holder
bg "$KEYLOCK" "${P[@]}" -s k -- true
pid_s=$!
wait_queue k 1
bg "$KEYLOCK" "${P[@]}" -x k -- true
pid_x=$!
wait_queue k 2
odd=$(printf 'odd\nkey')
hold "$odd" o -s
pid_o=$holder

kl "${P[@]}" list
expect_rc 0 "list"
[ "$(wc -l <"$OUT")" -eq 5 ] || fail "list: $(wc -l <"$OUT") lines, expected a header and 4 rows"
awk '$1 == "k" { print $2, $3, $4, $5, $9 }' "$OUT" >"$TMP/k"
printf '%s\n' "EXCL held - $pid_h 2" "SHARED waiting 1 $pid_s 2" "EXCL waiting 2 $pid_x 2" |
	cmp -s - "$TMP/k" || fail "list: the rows of k are: $(cat "$TMP/k")"
grep -q '^odd\\nkey  *SHARED  *held ' "$OUT" || fail "list: the key with a newline"

kl "${P[@]}" --json list
expect_rc 0 "--json list"
jq -e --argjson h "$pid_h" --argjson s "$pid_s" --argjson x "$pid_x" '
	[.[] | select(.key == "k") | [.mode, .state, .position, .pid, .waiters]] ==
	[["exclusive", "held", null, $h, 2], ["shared", "waiting", 0, $s, 2],
	 ["exclusive", "waiting", 1, $x, 2]]' "$OUT" >/dev/null ||
	fail "--json: the entries of k"
jq -e '[.[] | select(.key == "k" and .state == "held")][0].fence > 0' "$OUT" >/dev/null ||
	fail "--json: the holder's fence"
jq -e --argjson o "$pid_o" '[.[] | select(.key == "odd\nkey")] |
	length == 1 and .[0].mode == "shared" and .[0].pid == $o' "$OUT" >/dev/null ||
	fail "--json: the key with a newline"
kl list "${P[@]}" --json
expect_rc 0 "list -p URI --json"
jq -e 'length == 4' "$OUT" >/dev/null || fail "list -p URI --json: not 4 entries"

status_is k "exclusive holders" 1 || fail "status: exclusive holders"
status_is k "shared holders" 0 || fail "status: shared holders"
status_is k "shared waiters" 1 || fail "status: shared waiters"
status_is k "exclusive waiters" 1 || fail "status: exclusive waiters"
kl "${P[@]}" status
grep -qx "keys: 2" "$OUT" || fail "status without a key: keys"

release h
release o
for p in "$pid_h" "$pid_s" "$pid_x" "$pid_o"; do
	wait_exit "$p"
	expect_rc 0 "keylock $p"
done
kl "${P[@]}" list --json
jq -e '. == []' "$OUT" >/dev/null || fail "list --json after all left is not []"
exit 0
