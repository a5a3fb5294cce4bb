#!/bin/sh
# SPDX-License-Identifier: MIT
#
# test/pkg/readme.sh: the C snippets of README.md (its ```c blocks), put
# one after another in one file in the order a reader meets them, compile
# against include/ as C99 and C11 with -pedantic -Wall -Wextra -Werror
# (unused parameters aside: a hook may ignore its arg).  So each snippet
# includes what it uses, and defines a function before it is used.
#
# Run by make check (AM_TESTS_ENVIRONMENT gives top_srcdir and KL_CC); by
# hand: test/pkg/readme.sh.  Exit 0: they compile; 1: they do not (the
# compiler's words are printed).

set -eu

me=readme.sh
here=$(cd "$(dirname "$0")" && pwd)
: "${top_srcdir:=$here/../..}"
cc=${KL_CC:-${CC:-cc}}

tmp=$(mktemp -d "${TMPDIR:-/tmp}/kl-readme.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

awk '/^```c$/ { on = 1; n++; next } /^```/ { on = 0 } on
	END { print n > "/dev/stderr" }' "$top_srcdir/README.md" \
	>"$tmp/readme.c" 2>"$tmp/count"
n=$(cat "$tmp/count")
if [ "${n:-0}" -eq 0 ]; then
	echo "$me: FAIL: no C snippet in README.md"
	exit 1
fi
fail=0
for std in c99 c11; do
	if ! $cc -std=$std -pedantic -Wall -Wextra -Wno-unused-parameter \
		-Werror -I"$top_srcdir/include" -c -o "$tmp/readme.o" \
		"$tmp/readme.c" 2>"$tmp/err"; then
		echo "$me: FAIL: README.md's C snippets do not compile as $std:"
		cat "$tmp/err"
		fail=1
	fi
done
[ "$fail" -ne 0 ] || echo "$me: $n C snippets of README.md compile (C99, C11)"
exit "$fail"
