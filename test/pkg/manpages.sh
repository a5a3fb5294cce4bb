#!/bin/sh
# SPDX-License-Identifier: MIT
#
# test/pkg/manpages.sh: the manual is complete and renders cleanly.
#
#  - every KL_API function of include/keylock.h and include/keylock/*.h has
#    its page man/<function>.3 (the object's page, or a one-line .so page
#    pointing at it), and every command installed (keylock, keylock-bench)
#    its man/<command>.1;
#  - man/local.mk lists every man/*.[1-8] in dist_man_MANS, and every page
#    it lists exists (so each one is installed and distributed);
#  - each .so page names a page of man/ in the installed layout (manN/x.N);
#  - each page renders with groff -ww -z -man -Tutf8 without a single
#    warning (what man -l shows), and, where mandoc is installed, mandoc
#    -T lint reports nothing but the ".so is fragile" style remark.
#
# The pages are copied laid out as installed (man1/, man3/), so that .so
# requests resolve as they do under /usr/share/man.  Without
# groff the rendering is skipped with a note (the lists still count).
# Run by make check (top_srcdir from AM_TESTS_ENVIRONMENT); by hand:
# test/pkg/manpages.sh.  Exit 0: all good; 1: something is missing or
# warns (each is printed).

set -eu

me=manpages.sh
here=$(cd "$(dirname "$0")" && pwd)
: "${top_srcdir:=$here/../..}"
export top_srcdir
man=$top_srcdir/man
mk=$man/local.mk

tmp=$(mktemp -d "${TMPDIR:-/tmp}/kl-man.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

fail=0
problem() {
	echo "$me: FAIL: $*"
	fail=1
}

# The pages man/local.mk lists.
sed -n 's|.*\(man/[A-Za-z0-9_.-]*\.[1-8]\).*|\1|p' "$mk" | sed 's|^man/||' |
	LC_ALL=C sort -u >"$tmp/listed"
(cd "$man" && ls) | grep -E '\.[1-8]$' | LC_ALL=C sort -u >"$tmp/present"
for p in $(LC_ALL=C comm -13 "$tmp/listed" "$tmp/present"); do
	problem "man/$p is not listed in man/local.mk (dist_man_MANS): it would be neither installed nor distributed"
done
for p in $(LC_ALL=C comm -23 "$tmp/listed" "$tmp/present"); do
	problem "man/local.mk lists man/$p, which does not exist"
done

# A page for every public function and every installed command.
fns=0
for lib in libkeylock libkeylock-redis libkeylock-pg; do
	for f in $(sh "$top_srcdir/tools/check-exports" --header "$lib"); do
		fns=$((fns + 1))
		[ -f "$man/$f.3" ] ||
			problem "$f ($lib) has no page man/$f.3 (add it, or a '.so man3/<object>.3' page, to man/ and man/local.mk)"
	done
done
[ "$fns" -gt 0 ] || problem "no KL_API function found in the headers"
for c in keylock keylock-bench; do
	[ -f "$man/$c.1" ] || problem "the command $c has no page man/$c.1"
done

# The installed layout, and the .so targets.
pages=0
while IFS= read -r p; do
	[ -f "$man/$p" ] || continue
	sec=${p##*.}
	mkdir -p "$tmp/man/man$sec"
	cp "$man/$p" "$tmp/man/man$sec/$p"
	pages=$((pages + 1))
done <"$tmp/listed"
: >"$tmp/real"
for f in "$tmp"/man/man*/*; do
	target=$(sed -n '1s/^\.so[ \t]*//p' "$f")
	if [ -z "$target" ]; then
		echo "${f#"$tmp"/man/}" >>"$tmp/real"
		continue
	fi
	case $target in
	man[1-8]/*.[1-8]) ;;
	*)
		problem "${f##*/}: '.so $target' is not of the form manN/page.N"
		continue
		;;
	esac
	[ -f "$tmp/man/$target" ] ||
		problem "${f##*/}: '.so $target' names a page man/local.mk does not install"
done

# Rendering: the pages themselves (a .so page shows its target, checked
# above).
cd "$tmp/man"
if command -v groff >/dev/null 2>&1; then
	for f in $(cat "$tmp/real"); do
		# A first line '\" t (or e, p, ...) asks man for preprocessors.
		pre=$(sed -n "1s/^'\\\\\" *\\([tepgrv]*\\).*/\\1/p" "$f" |
			sed 's/\(.\)/-\1 /g')
		# shellcheck disable=SC2086
		if ! groff -ww -z -man -Tutf8 $pre "$f" >"$tmp/out" 2>&1 ||
			[ -s "$tmp/out" ]; then
			problem "groff -ww -z -man -Tutf8 $pre$f:"
			sed 's/^/    /' "$tmp/out"
		fi
	done
	rendered="groff"
else
	echo "$me: note: groff not found: pages not rendered"
	rendered=""
fi
if command -v mandoc >/dev/null 2>&1; then
	# Exit status ignored: it is non-zero for the .so remark alone.
	# shellcheck disable=SC2046
	mandoc -T lint $(cat "$tmp/real") >"$tmp/lint" 2>&1 || true
	if grep -v -e '\.so is fragile' "$tmp/lint" >"$tmp/lint.rest"; then
		problem "mandoc -T lint:"
		sed 's/^/    /' "$tmp/lint.rest"
	fi
	rendered="${rendered:+$rendered, }mandoc"
fi

if [ $fail -eq 0 ]; then
	echo "$me: PASS: $fns functions, $pages pages${rendered:+, rendered by $rendered}"
fi
exit $fail
