#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# keylock(1) takes flock(1)'s spellings (issue 15, item 13): -x, -e and
# --exclusive, --timeout, --nb and --nonblocking, durations such as .5, 5.
# and .007, and -c STRING; -s and --shared (test/cli/shared.sh shows what
# they do).  Also:
# a KEY too long for the command's environment is a usage error before any
# provider is opened, and a URI without a scheme is named as such.
. "$(dirname "$0")/lib.sh"

# A provider that cannot be opened: what is checked first exits 64.
NOPE=(-p "local:/dev/null/nope")

kl -p /tmp/keylock-no-such-scheme k -- true
expect_usage "a provider URI without a scheme"
grep -q "no scheme" "$ERR" || fail "a URI without a scheme: message"
grep -q "provider ':'" "$ERR" && fail "a URI without a scheme: empty scheme shown"

# Linux refuses one string of the environment longer than 32 pages: a KEY
# that keylock itself can be given but that does not fit in KEYLOCK_KEY.
page=$(getconf PAGESIZE 2>/dev/null || echo 4096)
long=$(head -c $((32 * page - 8)) /dev/zero | tr '\0' k)
kl "${NOPE[@]}" "$long" -- true
expect_usage "a KEY too long for KEYLOCK_KEY"
grep -q "too long" "$ERR" || fail "a KEY too long: message"

kl "${NOPE[@]}" -c true k -- true
expect_usage "-c and a command after '--'"
kl "${NOPE[@]}" k -c
expect_usage "KEY -c without STRING"
kl "${NOPE[@]}" k -c true extra
expect_usage "KEY -c STRING with one more argument"
kl "${NOPE[@]}" -c true status k
expect_usage "-c with status"

need_local

for x in -x -e --exclusive -s --shared; do
	rm -f "$OUT.x"
	kl "${P[@]}" "$x" k -- sh -c 'echo "$KEYLOCK_KEY" >"$1"' sh "$OUT.x"
	expect_rc 0 "$x"
	[ "$(cat "$OUT.x")" = k ] || fail "$x: the command did not run"
done

# -c STRING, after KEY as with flock(1), or before it.
export KL_TEST_OUT=$TMP/c.out
kl "${P[@]}" k -c 'echo "$KEYLOCK_KEY:$0" >"$KL_TEST_OUT"; exit 5'
expect_rc 5 "KEY -c STRING"
[ "$(cat "$KL_TEST_OUT")" = "k:/bin/sh" ] ||
	fail "KEY -c STRING ran: $(cat "$KL_TEST_OUT")"
kl "${P[@]}" -x --command 'echo two >"$KL_TEST_OUT"' k
expect_rc 0 "--command STRING KEY"
[ "$(cat "$KL_TEST_OUT")" = two ] || fail "--command STRING KEY did not run"

# With the key held: the non-blocking spellings and the durations.
hold k h
for n in --nb --nonblocking -n; do
	kl "${P[@]}" "$n" k -- touch "$TMP/ran"
	expect_rc 75 "$n on a held key"
	grep -q "it is held" "$ERR" || fail "$n: message"
done
kl "${P[@]}" --timeout .007 k -- touch "$TMP/ran"
expect_rc 75 "--timeout .007"
grep -q "within 7 ms" "$ERR" || fail "--timeout .007 is not 7 ms"
kl "${P[@]}" --timeout=.5 k -- touch "$TMP/ran"
expect_rc 75 "--timeout=.5"
grep -q "within 500 ms" "$ERR" || fail "--timeout=.5 is not 500 ms"
kl "${P[@]}" -w 1. k -- touch "$TMP/ran"
expect_rc 75 "-w 1."
grep -q "within 1 s" "$ERR" || fail "-w 1. is not 1 s"
[ ! -e "$TMP/ran" ] || fail "a command ran while the key was held"
release h
wait_exit "$holder"
expect_rc 0 "the holder"
for w in . .. 1.2. .5s 5.s; do
	kl "${P[@]}" -w "$w" k -- true
	expect_usage "-w '$w'"
done
exit 0
