#!/bin/sh
# SPDX-License-Identifier: MIT
#
# test/pkg/consumer.sh: build test/pkg/consumer.c against an installed
# keylock with nothing but what pkg-config says, dynamically and
# statically, and run it.
#
# Usage: test/pkg/consumer.sh [--destdir DIR] [MODULE...]
#
#   MODULE      keylock, keylock-redis, keylock-pg: each must be installed.
#               Default: keylock, and each provider module pkg-config finds.
#   --destdir   the installation is staged under DIR (make install
#               DESTDIR=DIR): pkg-config gets PKG_CONFIG_SYSROOT_DIR=DIR and
#               looks in DIR's pkgconfig folder first.
#
# For each module, two programs: dynamic, from pkg-config --cflags --libs
# MODULE, which must need libkeylock.so.0 (and the provider's library);
# static, from pkg-config --static --libs MODULE with each -lkeylock* taken
# as -l:libkeylock*.a, the library's archive, which must need no libkeylock
# shared library (the provider's client library, hiredis or libpq, stays
# shared).  ldd of the memory-only program must show neither hiredis nor
# libpq.  Every program runs and must say "ok".  Where the libraries are
# not in the loader's usual folders (a --prefix or DESTDIR install),
# LD_LIBRARY_PATH points at them.
#
# Environment: CC (default cc), CFLAGS, LDFLAGS, PKG_CONFIG (default
# pkg-config), and pkg-config's own (PKG_CONFIG_PATH).  Run by make
# installcheck (so by make distcheck, against its --prefix install) and by
# tools/test stage package (against the Debian packages).  Exit 0: every
# program built and ran; 1: one did not (its commands and output are
# printed); 99: a hard error (no pkg-config, no such module).

set -eu

me=consumer.sh
here=$(cd "$(dirname "$0")" && pwd)
src=$here/consumer.c
destdir=
modules=

while [ $# -gt 0 ]; do
	case $1 in
	--destdir) destdir=${2:?--destdir needs a folder}; shift ;;
	--destdir=*) destdir=${1#--destdir=} ;;
	-h | --help) sed -n '4,/^$/s/^# \{0,1\}//p' "$0"; exit 0 ;;
	keylock | keylock-redis | keylock-pg) modules="$modules $1" ;;
	*) echo "$me: unknown argument '$1' (try --help)" >&2; exit 99 ;;
	esac
	shift
done

cc=${CC:-cc}
pc=${PKG_CONFIG:-pkg-config}
if ! command -v "${pc%% *}" >/dev/null 2>&1; then
	echo "$me: $pc not found" >&2
	exit 99
fi

if [ -n "$destdir" ]; then
	# The staged .pc files; their paths get DIR in front.
	destdir=$(cd "$destdir" && pwd)
	dirs=$(find "$destdir" -name keylock.pc -path '*/pkgconfig/*' \
		-exec dirname {} \; | tr '\n' :)
	if [ -z "$dirs" ]; then
		echo "$me: no keylock.pc under $destdir" >&2
		exit 99
	fi
	PKG_CONFIG_PATH=$dirs${PKG_CONFIG_PATH:-}
	PKG_CONFIG_SYSROOT_DIR=$destdir
	export PKG_CONFIG_PATH PKG_CONFIG_SYSROOT_DIR
fi

if [ -z "$modules" ]; then
	modules=keylock
	for m in keylock-redis keylock-pg; do
		if $pc --exists "$m" 2>/dev/null; then
			modules="$modules $m"
		fi
	done
fi
for m in $modules; do
	if ! $pc --exists "$m"; then
		echo "$me: pkg-config does not find module $m:" >&2
		$pc --print-errors --exists "$m" >&2 || true
		exit 99
	fi
done

# pkgconf puts the sysroot in front of variables, pkg-config 0.29 does not.
libdir=$($pc --variable=libdir keylock)
case $libdir in
"$destdir"/*) ;;
*) libdir=$destdir$libdir ;;
esac
case $destdir:$libdir in
:/usr/lib | :/usr/lib/*-*-* | :/usr/lib64 | :/lib | :/lib/*-*-* | :/lib64) ;;
*)
	LD_LIBRARY_PATH=$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
	export LD_LIBRARY_PATH
	;;
esac

tmp=$(mktemp -d "${TMPDIR:-/tmp}/kl-consumer.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

fail=0
built=0
problem() {
	echo "$me: FAIL: $*"
	fail=1
}

# needed PROGRAM: its NEEDED entries, one a line.
needed() {
	if command -v readelf >/dev/null 2>&1; then
		LC_ALL=C readelf -d "$1" |
			sed -n 's/.*(NEEDED).*\[\(.*\)\].*/\1/p'
	else
		LC_ALL=C objdump -p "$1" | awk '$1 == "NEEDED" { print $2 }'
	fi
}

# build NAME FLAGS...: compiles consumer.c into $tmp/NAME; prints the
# command and the compiler's words on failure.
build() {
	name=$1
	shift
	# shellcheck disable=SC2086 # CFLAGS and LDFLAGS are word lists
	if ! $cc ${CFLAGS:-} -Wall -Wextra -o "$tmp/$name" "$src" "$@" \
		${LDFLAGS:-} >"$tmp/$name.out" 2>&1; then
		problem "$name did not build: $cc ${CFLAGS:-} -Wall -Wextra -o $name consumer.c $* ${LDFLAGS:-}"
		sed 's/^/    /' "$tmp/$name.out"
		return 1
	fi
	built=$((built + 1))
}

# run NAME: runs $tmp/NAME, which must print "...: ok".
run() {
	if ! "$tmp/$1" >"$tmp/$1.run" 2>&1 ||
		! grep -q ': ok$' "$tmp/$1.run"; then
		problem "$1 did not run to the end:"
		sed 's/^/    /' "$tmp/$1.run"
		return 1
	fi
	echo "$me: $1: $(cat "$tmp/$1.run")"
}

for m in $modules; do
	case $m in
	keylock) def= ; lib=libkeylock.so.0 ;;
	keylock-redis) def=-DKL_CONSUMER_REDIS; lib=libkeylock-redis.so.0 ;;
	keylock-pg) def=-DKL_CONSUMER_PG; lib=libkeylock-pg.so.0 ;;
	esac
	cflags=$($pc --cflags "$m")
	libs=$($pc --libs "$m")
	slibs=$($pc --static --libs "$m")
	echo "$me: $m: --cflags: $cflags"
	echo "$me: $m: --libs: $libs"
	echo "$me: $m: --static --libs: $slibs"

	# Dynamic.
	# shellcheck disable=SC2086
	if build "$m-dynamic" $def $cflags $libs; then
		need=$(needed "$tmp/$m-dynamic")
		for l in libkeylock.so.0 $lib; do
			echo "$need" | grep -q -x -F "$l" ||
				problem "$m-dynamic does not need $l (NEEDED: $(echo "$need" | tr '\n' ' '))"
		done
		run "$m-dynamic" || true
		if [ "$m" = keylock ] && command -v ldd >/dev/null 2>&1; then
			ldd "$tmp/$m-dynamic" >"$tmp/ldd" 2>&1 || true
			if grep -E 'hiredis|libpq|not found' "$tmp/ldd" >/dev/null; then
				problem "ldd of the memory-only program shows hiredis, libpq or a missing library:"
				sed 's/^/    /' "$tmp/ldd"
			else
				echo "$me: $m-dynamic: ldd shows neither hiredis nor libpq"
			fi
		fi
	fi

	# Static: keylock's archives, the rest as pkg-config says.
	archives=yes
	for l in $slibs; do
		case $l in
		-lkeylock | -lkeylock-redis | -lkeylock-pg)
			a=lib${l#-l}.a
			[ -f "$libdir/$a" ] || archives=no
			;;
		esac
	done
	if [ $archives = no ]; then
		problem "$m: no static archive in $libdir (built with --disable-static?)"
		continue
	fi
	slibs=$(echo " $slibs " | sed -e 's/ -l\(keylock\(-redis\|-pg\)\{0,1\}\) / -l:lib\1.a /g' \
		-e 's/ -l\(keylock\(-redis\|-pg\)\{0,1\}\) / -l:lib\1.a /g')
	# shellcheck disable=SC2086
	if build "$m-static" $def $cflags $slibs; then
		if needed "$tmp/$m-static" | grep -q '^libkeylock'; then
			problem "$m-static needs a keylock shared library: $(needed "$tmp/$m-static" | tr '\n' ' ')"
		fi
		run "$m-static" || true
	fi
done

if [ $fail -eq 0 ]; then
	echo "$me: PASS: $built programs built with pkg-config (${modules# }) and run"
fi
exit $fail
