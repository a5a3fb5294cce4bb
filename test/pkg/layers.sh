#!/bin/sh
# SPDX-License-Identifier: MIT
#
# test/pkg/layers.sh: the layering rule of src/README holds.  Every file of
# src/ belongs to one layer (the table below, which src/README draws); a
# file may include a header and name a function (call it, or take its
# address) of its own layer or a lower one, never of a higher one.  A
# function's layer is the layer of the file that defines it: a .c file
# with the name at the start of a line (STYLE.md), or a header's static
# inline function (in internal.h, the layer of the module its section is
# about).  Comments and strings are not read.  A file or header missing from
# the table fails too, so that a new one gets its place.
#
# Run by make check (AM_TESTS_ENVIRONMENT gives top_srcdir); by hand:
# test/pkg/layers.sh [SRCDIR] (default: the tree's src/), e.g. against an
# older tree unpacked with git archive.
#
# Exit 0: no upward reference; 1: one or more (each printed).

set -eu

me=layers.sh
here=$(cd "$(dirname "$0")" && pwd)
: "${top_srcdir:=$here/../..}"
src=${1:-$top_srcdir/src}

# path (relative to src/) or header name, then its layer: lowest first.
# Keep in step with src/README.
table='
alloc.c 0
status.c 0
clock.c 0
siphash.c 0
klcommon.c 0
internal.h 0
annotate.h 0
siphash.h 0
klcommon.h 0
cancel.c 1
waitq.c 2
mutex.c 3
reset_event.c 3
hash.c 4
table.c 4
table_acquire.c 4
table_check.c 4
table.h 4
deadlock.c 4
registry.c 5
provider.c 6
provider_memory.c 7
local/*.c 7
local_internal.h 7
redis/*.c 7
redis_internal.h 7
pg/*.c 7
pg_fence.h 7
pg_internal.h 7
provider_open.c 8
lock.c 8
'

tmp=$(mktemp -d "${TMPDIR:-/tmp}/kl-layers.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

# layer_of NAME: NAME's layer (a path under src/, or a header's base name),
# or nothing.
layer_of() {
	echo "$table" | while read -r pat n; do
		[ -n "$pat" ] || continue
		# shellcheck disable=SC2254 # pat is a pattern on purpose
		case $1 in
		$pat)
			echo "$n"
			break
			;;
		esac
	done
}

fail=0
files=$(cd "$src" && ls ./*.c ./*.h ./*/*.c ./*/*.h 2>/dev/null |
	sed 's|^\./||' | sort)
if [ -z "$files" ]; then
	echo "$me: FAIL: no sources under $src"
	exit 1
fi

# Each file's layer; unknown files fail.
: >"$tmp/layers"
for f in $files; do
	n=$(layer_of "$f")
	[ -n "$n" ] || n=$(layer_of "${f##*/}")
	if [ -z "$n" ]; then
		echo "$me: FAIL: src/$f has no layer (add it to $me and src/README)"
		fail=1
		continue
	fi
	echo "$f $n" >>"$tmp/layers"
done

# The functions each file defines: "name layer file".  In a header, only
# static inline ones (the rest are declarations); a section of internal.h
# (after a "/* ---- */" line) that names its module ("/* waitq.c: ...")
# gives such a function that module's layer, one that names none the
# header's.
: >"$tmp/defs"
while read -r f n; do
	case $f in
	*.c)
		sed -n 's/^\(kl_[a-z0-9_]*\)(.*/\1/p' "$src/$f" |
			sed "s|\$| $n $f|" >>"$tmp/defs"
		;;
	*.h)
		awk -v n="$n" -v f="$f" -v layers="$tmp/layers" '
			BEGIN {
				n0 = n
				while ((getline l < layers) > 0) {
					split(l, v, " ")
					base = v[1]
					sub(/.*\//, "", base)
					lay[base] = v[2]
				}
			}
			/^\/\* -+ \*\/$/ { n = n0 }
			/^\/\* [a-z_\/]+\.c[: ]/ {
				m = $2
				sub(/:$/, "", m)
				sub(/.*\//, "", m)
				if (m in lay)
					n = lay[m]
			}
			/^static inline/ { inl = 1; next }
			inl && /^kl_[a-z0-9_]*\(/ {
				name = $0
				sub(/\(.*/, "", name)
				print name, n, f
			}
			{ inl = 0 }' "$src/$f" >>"$tmp/defs"
		;;
	esac
done <"$tmp/layers"

# Every file against the table: its includes, and the functions it names.
# In a header only the bodies of inline functions count (braces), not the
# prototypes it declares.
while read -r f n; do
	awk -v n="$n" -v f="$f" -v me="$me" -v defs="$tmp/defs" \
		-v layers="$tmp/layers" -v q="'" '
		BEGIN {
			while ((getline l < defs) > 0) {
				split(l, v, " ")
				dl[v[1]] = v[2]
				df[v[1]] = v[3]
			}
			while ((getline l < layers) > 0) {
				split(l, v, " ")
				base = v[1]
				sub(/.*\//, "", base)
				hl[base] = v[2]
			}
			hdr = f ~ /\.h$/
			bad = 0
			# A character constant (a double quote in single quotes) opens no string.
			charlit = q "(\\\\.|[^" q "\\\\])" q
		}
		/^[ \t]*#[ \t]*include[ \t]*"/ {
			h = $0
			sub(/^[^"]*"/, "", h)
			sub(/".*/, "", h)
			if (h == "config.h" || h ~ /^keylock(\/[a-z]+)?\.h$/)
				next
			base = h
			sub(/.*\//, "", base)
			if (!(base in hl)) {
				printf "%s: FAIL: src/%s includes \"%s\", which has no layer\n", me, f, h
				bad = 1
			} else if (hl[base] > n) {
				printf "%s: FAIL: src/%s (layer %d) includes \"%s\" (layer %d)\n", me, f, n, h, hl[base]
				bad = 1
			}
			next
		}
		{
			line = $0
			# Comments, possibly over several lines.
			out = ""
			while (line != "") {
				if (incomment) {
					i = index(line, "*/")
					if (i == 0) { line = ""; break }
					line = substr(line, i + 2)
					incomment = 0
				} else {
					i = index(line, "/*")
					if (i == 0) { out = out line; break }
					out = out substr(line, 1, i - 1) " "
					line = substr(line, i + 2)
					incomment = 1
				}
			}
			line = out
			gsub(charlit, " ", line)
			gsub(/"([^"\\]|\\.)*"/, " ", line)
			if (hdr) {
				opens = gsub(/[{]/, "{", line)
				closes = gsub(/[}]/, "}", line)
				if (depth == 0 && opens == 0) {
					depth += opens - closes
					next
				}
				depth += opens - closes
			}
			line = " " line
			while (match(line, /[^A-Za-z0-9_]kl_[A-Za-z0-9_]*/)) {
				name = substr(line, RSTART + 1, RLENGTH - 1)
				line = substr(line, RSTART + RLENGTH)
				if ((name in dl) && df[name] != f &&
				    dl[name] > n && !((f, name) in said)) {
					said[f, name] = 1
					printf "%s: FAIL: src/%s (layer %d) names %s of src/%s (layer %d)\n", me, f, n, name, df[name], dl[name]
					bad = 1
				}
			}
		}
		END { exit bad }' "$src/$f" || fail=1
done <"$tmp/layers"

if [ "$fail" -eq 0 ]; then
	echo "$me: $(wc -l <"$tmp/layers") files, $(wc -l <"$tmp/defs") functions: no upward include or call"
fi
exit "$fail"
