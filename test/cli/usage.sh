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

# keylock list: no KEY, no -k or -c, --json with list only; options may
# come before or after the word list.
kl "${NOPE[@]}" list k
expect_usage "list with a KEY"
grep -q "list takes no KEY" "$ERR" || fail "list with a KEY: message"
grep -q "'k'" "$ERR" || fail "list with a KEY: the argument is not named"
kl "${NOPE[@]}" list --json k
expect_usage "list --json with a KEY"
kl list "${NOPE[@]}" -k a
expect_usage "list -k KEY"
grep -q "list takes no KEY" "$ERR" || fail "list -k KEY: message"
kl "${NOPE[@]}" list --bogus
expect_usage "list with an unknown option"
grep -q "'--bogus'" "$ERR" || fail "list --bogus: the option is not named"
kl "${NOPE[@]}" --json status k
expect_usage "--json with status"
grep -q -- "--json goes with list" "$ERR" || fail "--json with status: message"
kl "${NOPE[@]}" --json k -- true
expect_usage "--json with a command"
kl "${NOPE[@]}" --shred k -- true
expect_usage "--shred (not --shared)"
kl -p memory: list
expect_usage "-p memory: list"
# "list" followed by "--" or -c is a KEY like any other: the provider is
# opened (and refused) rather than a usage error.
kl "${NOPE[@]}" list -- true
expect_rc 69 "list -- COMMAND (list is the KEY)"
kl "${NOPE[@]}" list -c true
expect_rc 69 "list -c STRING (list is the KEY)"
kl list "${NOPE[@]}" --json
expect_rc 69 "list -p URI --json (options after list)"

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
