#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# keylock list's output for keys no provider can be made to hold at will
# (test/cli/list_fmt feeds fixed entries to the code of keylock list): the
# table has one line per entry and every byte of it is printable ASCII (a
# newline, an escape sequence, a byte that is not UTF-8, a 300-byte key are
# escaped or cut, never printed); the JSON is one document that jq reads
# back to the exact keys, with key_hex for a key that is not UTF-8; a
# provider that cannot list is named by its URI without the password, exit
# 69.  Needs jq (tools/test installs it).
. "$(dirname "$0")/lib.sh"

LIST_FMT=$top_builddir/test/cli/list_fmt
[ -x "$LIST_FMT" ] || skip "test/cli/list_fmt is not built"
command -v jq >/dev/null || skip "jq is missing (tools/test installs it)"

rc=0
"$LIST_FMT" table >"$OUT" 2>"$ERR" || rc=$?
expect_rc 0 "the table"
[ "$(wc -l <"$OUT")" -eq 12 ] || fail "the table: $(wc -l <"$OUT") lines, expected a header and 11 rows"
LC_ALL=C grep -q '[^ -~]' "$OUT" && fail "the table holds a byte that is not printable ASCII"
head -n 1 "$OUT" | grep -q '^KEY  *MODE  *STATE  *POS  *PID  *TID  *TIME  *FENCE  *WAITERS$' ||
	fail "the table's header"
# Every row is aligned with the header: what follows the key starts where
# MODE does, and the row is as long as the header (numbers to the right).
awk 'NR == 1 { at = index($0, "MODE"); len = length($0); next }
	substr($0, at - 2, 3) !~ /^  [ES]$/ || length($0) != len { exit 1 }' "$OUT" ||
	fail "a row not aligned with the header"
grep -qF 'a\nb\tc\\d\x1b[31m ' "$OUT" || fail "the key with control bytes is not escaped"
grep -qF '\xff\xfebad ' "$OUT" || fail "the key that is not UTF-8 is not escaped"
grep -q '^LLLLLLLL*\.\.\. ' "$OUT" || fail "the long key is not cut"
[ "$(awk '{ print length($0) }' "$OUT" | sort -n | tail -n 1)" -lt 160 ] ||
	fail "a line of the table is too long"
grep -qF '[advisory lock 42\n\x1b]0;x\x07]' "$OUT" || fail "the provider's name of a lock"
# A long name of the provider's is cut in the middle: its end (Redis: the
# key's digest) tells its locks apart.
grep -q '^\[app:production:eu-.*\.\.\..*6789abcdef}\] ' "$OUT" &&
	grep -q '^\[app:production:eu-.*\.\.\..*9876543210}\] ' "$OUT" ||
	fail "a long name of the provider's is not cut in the middle"
[ "$(grep '^\[app:' "$OUT" | cut -c1-49 | sort -u | wc -l)" -eq 2 ] ||
	fail "two locks' names look alike in the table"
# The rows of key k: its holder, then its waiters with their places.
awk '$1 == "k" { print $2, $3, $4, $9 }' "$OUT" >"$TMP/k"
printf '%s\n' "EXCL held - 2" "SHARED waiting 1 2" "EXCL waiting 2 2" |
	cmp -s - "$TMP/k" || fail "the rows of k: $(cat "$TMP/k")"
awk '$1 == "k" && $3 == "held" { print $5, $6, $7, $8 }' "$OUT" | grep -qx '100 101 1.5s 7' ||
	fail "the holder's PID, TID, TIME and FENCE"

rc=0
"$LIST_FMT" json >"$OUT" 2>"$ERR" || rc=$?
expect_rc 0 "--json"
LC_ALL=C grep -q $'[\x01-\x09\x0b-\x1f\x7f]' "$OUT" && fail "--json: a raw control byte"
jq -e 'type == "array" and length == 11' "$OUT" >/dev/null || fail "--json: not an array of 11"
jq -e '.[0] == {"key": "k", "detail": null, "mode": "exclusive", "state": "held",
	"position": null, "pid": 100, "tid": 101, "elapsed_ms": 1500, "fence": 7, "waiters": 2}' \
	"$OUT" >/dev/null || fail "--json: the holder of k"
jq -e '.[1].mode == "shared" and .[1].state == "waiting" and .[1].position == 0 and .[1].fence == null' \
	"$OUT" >/dev/null || fail "--json: the shared waiter of k"
jq -e '.[2].pid == null and .[2].elapsed_ms == null and .[2].position == 1' \
	"$OUT" >/dev/null || fail "--json: what the provider does not know is null"
jq -e '.[3].key == "a\nb\tc\\d\u001b[31m"' "$OUT" >/dev/null || fail "--json: the key with control bytes"
jq -e '.[4].key == "café" and (.[4] | has("key_hex") | not)' "$OUT" >/dev/null ||
	fail "--json: a UTF-8 key"
jq -e '.[5].key == "\ufffd\ufffdbad" and .[5].key_hex == "fffe626164"' "$OUT" >/dev/null ||
	fail "--json: the key that is not UTF-8"
jq -e '.[6].key == ("L" * 300)' "$OUT" >/dev/null || fail "--json: the long key is not whole"
jq -e '.[7].key == null and .[7].detail == "advisory lock 42\n\u001b]0;x\u0007"' "$OUT" >/dev/null ||
	fail "--json: the lock the provider cannot name"
jq -e '.[8].key == "\u2028\u0085\"q\""' "$OUT" >/dev/null || fail "--json: U+2028, C1 and quotes"
grep -qF '\u2028\u0085\"q\"' "$OUT" || fail "--json: U+2028 or C1 not escaped"

# A provider that cannot list: the URI without its secrets, exit 69.
CANARY=klcanary$RANDOM$$
rc=0
"$LIST_FMT" none "redis://u:$CANARY@h/0?password=$CANARY&db=2" >"$OUT" 2>"$ERR" || rc=$?
expect_rc 69 "a provider that cannot list"
grep -qF "keylock: cannot list the locks of provider 'redis://u:***@h/0?password=***&db=2'" "$ERR" ||
	fail "a provider that cannot list: message"
grep -q "cannot list its locks" "$ERR" || fail "a provider that cannot list: the reason"
grep -q "$CANARY" "$ERR" "$OUT" && fail "the password is in a message"
[ ! -s "$OUT" ] || fail "a provider that cannot list: output on stdout"
rc=0
"$LIST_FMT" fail "local:$TMP" >"$OUT" 2>"$ERR" || rc=$?
expect_rc 69 "a snapshot that fails"
grep -qF "provider 'local:$TMP': the server refused the listing" "$ERR" ||
	fail "a snapshot that fails: message"
exit 0
