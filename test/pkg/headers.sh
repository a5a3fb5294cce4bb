#!/bin/sh
# SPDX-License-Identifier: MIT
#
# test/pkg/headers.sh: every installed header (include/keylock.h and
# include/keylock/*.h) compiles on its own, twice in one unit (include
# guards), as C99 and C11 with -pedantic, and as C++11, each with -Wall
# -Wextra -Werror; the C units also expand every *_INIT macro.  The headers
# include only <stdbool.h>, <stddef.h>, <stdint.h> and <keylock.h>, never
# config.h, and KL_VERSION_STRING is the package version.
#
# Run by make check (AM_TESTS_ENVIRONMENT gives top_srcdir, KL_CC, KL_CXX
# and KL_PACKAGE_VERSION); by hand: test/pkg/headers.sh.  The C++ compiler
# is KL_CXX, else g++, clang++ or c++; without any the C++ part is skipped
# with a note (the C part still counts).
#
# Exit 0: all good; 1: a header failed (the compiler's words are printed).

set -eu

me=headers.sh
here=$(cd "$(dirname "$0")" && pwd)
: "${top_srcdir:=$here/../..}"
cc=${KL_CC:-${CC:-cc}}
cxx=${KL_CXX:-}
if [ -z "$cxx" ]; then
	for c in g++ clang++ c++; do
		if command -v "$c" >/dev/null 2>&1; then
			cxx=$c
			break
		fi
	done
fi
warn="-Wall -Wextra -Werror"

tmp=$(mktemp -d "${TMPDIR:-/tmp}/kl-headers.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

fail=0
n=0
headers="keylock.h"
for h in "$top_srcdir"/include/keylock/*.h; do
	[ -f "$h" ] || continue
	headers="$headers keylock/${h##*/}"
done

for h in $headers; do
	path=$top_srcdir/include/$h

	# Includes: the three standard headers, or keylock.h itself.
	bad=$(sed -n 's/^[ \t]*#[ \t]*include[ \t]*//p' "$path" |
		grep -v -x -e '<stdbool.h>' -e '<stddef.h>' -e '<stdint.h>' \
			-e '<keylock.h>' || true)
	if [ -n "$bad" ]; then
		echo "$me: FAIL: $h includes $(echo "$bad" | tr '\n' ' ')(only <stdbool.h> <stddef.h> <stdint.h> <keylock.h>)"
		fail=1
	fi
	if grep -n 'config\.h' "$path" | grep -q include; then
		echo "$me: FAIL: $h includes config.h"
		fail=1
	fi

	# A unit that uses the header: twice included, every *_INIT macro
	# expanded (C only: C++11 has no designated initializers).
	base=$(echo "$h" | tr '/.' '__')
	{
		echo "#include <$h>"
		echo "#include <$h>"
		echo "int kl_headers_test(void);"
		echo "int kl_headers_test(void) { return KL_OK; }"
	} >"$tmp/$base.cpp"
	cp "$tmp/$base.cpp" "$tmp/$base.c"
	i=0
	for m in $(sed -n 's/^[ \t]*#[ \t]*define[ \t]*\(KL_[A-Z0-9_]*_INIT\)\b.*/\1/p' "$path"); do
		i=$((i + 1))
		t=$(echo "$m" | sed 's/^KL_\(.*\)_INIT$/kl_\1/' | tr '[:upper:]' '[:lower:]')
		echo "$t kl_headers_init_$i = $m;" >>"$tmp/$base.c"
	done

	for std in c99 c11; do
		n=$((n + 1))
		# shellcheck disable=SC2086 # cc may be "gcc -m32"
		if ! $cc -std=$std -pedantic $warn -I"$top_srcdir/include" \
			-c "$tmp/$base.c" -o "$tmp/$base.o" >"$tmp/out" 2>&1; then
			echo "$me: FAIL: $h as $std ($cc -std=$std -pedantic $warn):"
			cat "$tmp/out"
			fail=1
		fi
	done
	if [ -n "$cxx" ]; then
		n=$((n + 1))
		# shellcheck disable=SC2086
		if ! $cxx -std=c++11 -pedantic $warn -I"$top_srcdir/include" \
			-c "$tmp/$base.cpp" -o "$tmp/$base.o" >"$tmp/out" 2>&1; then
			echo "$me: FAIL: $h as C++11 ($cxx -std=c++11 -pedantic $warn):"
			cat "$tmp/out"
			fail=1
		fi
	fi
done
[ -n "$cxx" ] || echo "$me: note: no C++ compiler (KL_CXX, g++, clang++, c++): C++11 not checked"

# The version macros against the package's.
if [ -n "${KL_PACKAGE_VERSION:-}" ]; then
	v=$(sed -n 's/^#define KL_VERSION_STRING "\(.*\)"$/\1/p' \
		"$top_srcdir/include/keylock.h")
	if [ "$v" != "$KL_PACKAGE_VERSION" ]; then
		echo "$me: FAIL: KL_VERSION_STRING is \"$v\", the package is $KL_PACKAGE_VERSION (configure.ac)"
		fail=1
	fi
	mmp=$(sed -n 's/^#define KL_VERSION_\(MAJOR\|MINOR\|PATCH\) \([0-9]*\)$/\2/p' \
		"$top_srcdir/include/keylock.h" | tr '\n' . | sed 's/\.$//')
	if [ "$mmp" != "$v" ]; then
		echo "$me: FAIL: KL_VERSION_MAJOR.MINOR.PATCH is $mmp, KL_VERSION_STRING \"$v\""
		fail=1
	fi
fi

if [ $fail -eq 0 ]; then
	echo "$me: PASS: $(echo "$headers" | wc -w) headers, $n compilations"
fi
exit $fail
