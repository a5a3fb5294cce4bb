#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# keylock(1): usage errors exit 64 with the usage hint on stderr, before
# any provider is opened; --help and --version print on stdout and exit 0.
. "$(dirname "$0")/lib.sh"

# A provider that cannot be opened: usage errors must come first.
NOPE=(-p "local:/dev/null/nope")

kl
expect_usage "no arguments"
grep -q "no KEY" "$ERR" || fail "no arguments: message does not name KEY"
kl "${NOPE[@]}" k
expect_usage "KEY without a command"
kl "${NOPE[@]}" k --
expect_usage "KEY -- without a command"
kl "${NOPE[@]}" k true
expect_usage "no '--' between KEY and the command"
kl "${NOPE[@]}" k -n -- true
expect_usage "an option after KEY"
kl "${NOPE[@]}" "" -- true
expect_usage "an empty KEY"
kl "${NOPE[@]}" status a b
expect_usage "status with two keys"

for w in abc -1 "" 1x 5sec 1.5.2 ' 5' 1e3 . .s; do
	kl "${NOPE[@]}" -w "$w" k -- true
	expect_usage "-w '$w'"
	grep -q "invalid wait" "$ERR" || fail "-w '$w': message does not say wait"
done
kl "${NOPE[@]}" --wait=abc k -- true
expect_usage "--wait=abc"
for t in forever abc -5; do
	kl "${NOPE[@]}" -t "$t" k -- true
	expect_usage "-t '$t'"
done
for e in 256 -1 x "" 1.5 999999999999999999999; do
	kl "${NOPE[@]}" -E "$e" k -- true
	expect_usage "-E '$e'"
	grep -q "invalid exit code" "$ERR" || fail "-E '$e': message"
done

kl "${NOPE[@]}" --bogus k -- true
expect_usage "an unknown long option"
grep -q "'--bogus'" "$ERR" || fail "unknown option not named"
kl "${NOPE[@]}" -j k -- true
expect_usage "an unknown short option"
kl -p
expect_usage "-p without a value"
kl --provider
expect_usage "--provider without a value"
kl --conflict-exit-code
expect_usage "--conflict-exit-code without a value"

for uri in memory: memory:// MEMORY:; do
	kl -p "$uri" k -- true
	expect_usage "-p $uri"
	grep -q "memory" "$ERR" || fail "-p $uri: message"
	kl -p "$uri" status k
	expect_usage "-p $uri status"
done

# An option after '--' belongs to the command, not to keylock.
kl "${NOPE[@]}" k -- --bogus
expect_rc 69 "an option-like command after '--' (provider refused)"

for h in --help -h; do
	kl "$h"
	expect_rc 0 "$h"
	grep -q "^Usage:" "$OUT" || fail "$h: no Usage on stdout"
	grep -q -- "--conflict-exit-code" "$OUT" || fail "$h: options not listed"
	[ ! -s "$ERR" ] || fail "$h: output on stderr"
done
# --help wins over what follows, as with getopt everywhere.
kl --help --bogus
expect_rc 0 "--help --bogus"

for v in --version -V; do
	kl "$v"
	expect_rc 0 "$v"
	grep -Eq "^keylock [0-9]+\.[0-9]+\.[0-9]+" "$OUT" || fail "$v: no version"
	[ ! -s "$ERR" ] || fail "$v: output on stderr"
done
exit 0
