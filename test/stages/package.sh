# SPDX-License-Identifier: MIT
# test/stages/package.sh: stage package of tools/test, sourced after
# test/stages/lib.sh.

# The Debian packages (tools/debian/), built as Debian builds them, from
# the release tarball (make dist): unpacked next to it as
# keylock_VERSION.orig.tar.gz, with the tarball's own tools/debian/ as
# debian/; the source package made (dpkg-source -b) and the binaries built
# with dpkg-buildpackage -us -uc -b (dh: autoreconf, configure with the
# triplet's --libdir and both providers, make check, the symbols files at
# dpkg-gensymbols check level 4).  Each of these is a test: the changelog
# is at the tarball's version; the tarball holds every tracked file of the
# build and the tests; the build passes, make check included, in a network
# namespace with only the loopback (as root); dpkg-gensymbols had nothing
# to say; blhc finds dpkg-buildflags' CFLAGS, CPPFLAGS and LDFLAGS in every
# compile and link; lintian on the source and binary packages reports no
# error and no warning (overrides carry their reason); the packages hold
# what they should, and libkeylock0 and keylock need neither hiredis nor
# libpq; configure with an explicit --with-redis=yes or
# --with-postgresql=yes and no such library fails with a clear message;
# test/pkg/consumer.sh against the staged install (debian/tmp, a DESTDIR
# install); libkeylock0 and keylock installed alone (dpkg -i): keylock
# --version, a command run under a local: lock, the providers reported as
# not installed; then the other packages: the providers load, consumer.sh
# against the installed packages; all purged at the end, whatever happens.
# Installing needs root (CI runs as root on a throwaway machine): as
# another user those tests are skipped.  Installs debhelper, devscripts,
# lintian, dpkg-dev, fakeroot, blhc and the build dependencies when
# missing.
DEB_BINARIES=(libkeylock0 libkeylock-redis0 libkeylock-pg0 libkeylock-dev
	keylock)
PKG_TESTS=0
PKG_FAILS=0
PKG_SKIPS=0
# pkg_check NAME COMMAND...: runs one test, counts it, prints its result.
# COMMAND runs with set -e off (it is in a || list): it returns non-zero
# itself when it fails.
pkg_check() {
	local name=$1 rc=0
	shift
	"$@" || rc=$?
	PKG_TESTS=$((PKG_TESTS + 1))
	if [ "$rc" -eq 0 ]; then
		say "package: $name: ok"
	else
		say "package: $name: FAIL"
		PKG_FAILS=$((PKG_FAILS + 1))
	fi
	result_line "$PKG_TESTS" "$PKG_FAILS" "$PKG_SKIPS"
	return "$rc"
}
# pkg_purge: purges whichever of our packages dpkg knows (installed, or
# configuration left).
pkg_purge() {
	local p present=()
	command -v dpkg-query >/dev/null 2>&1 || return 0
	for p in "${DEB_BINARIES[@]}"; do
		case $(dpkg-query -W -f='${db:Status-Abbrev}' "$p" 2>/dev/null) in
		"" | un* | pn*) ;;
		*) present+=("$p") ;;
		esac
	done
	[ ${#present[@]} -eq 0 ] || dpkg --purge "${present[@]}" </dev/null
}
# pkg_debs PACKAGE...: the .deb files of these binary packages.
pkg_debs() {
	local p
	for p in "$@"; do
		echo "$PKG_WORK/${p}_${PKG_DEBVERSION}_${PKG_ARCH}.deb"
	done
}
# pkg_install_tools PACKAGE...: apt-get update and install the missing
# ones, without their Recommends.
pkg_install_tools() {
	local p missing=()
	for p in "$@"; do
		dpkg-query -W -f='${Status}' "$p" 2>/dev/null |
			grep -q 'install ok installed' || missing+=("$p")
	done
	[ ${#missing[@]} -gt 0 ] || return 0
	say "installing missing packages: ${missing[*]}"
	apt-get update -q </dev/null
	apt-get install -y -q --no-install-recommends "${missing[@]}" </dev/null
}
pkg_changelog_version() {
	[ "${PKG_DEBVERSION%-*}" = "$PKG_VERSION" ] && return 0
	say "error: tools/debian/changelog is at $PKG_DEBVERSION, the tarball at $PKG_VERSION: add an entry (dch -v $PKG_VERSION-1 in a copy as debian/) and update the symbols files"
	return 1
}
# pkg_tarball_complete TARBALL: every file git tracks in the folders and
# files the build and the tests use is in TARBALL (else: EXTRA_DIST).
pkg_tarball_complete() {
	local missing
	if ! git -C "$ROOT" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
		say "package: $ROOT is not a git work tree: tarball contents not compared"
		return 0
	fi
	missing=$(git -C "$ROOT" ls-files -- configure.ac Makefile.am \
		'*.pc.in' autogen.sh src include man test tools examples m4 .ci |
		LC_ALL=C sort | LC_ALL=C comm -23 - <(tar -tzf "$1" |
			sed "s|^keylock-$PKG_VERSION/||" | LC_ALL=C sort))
	[ -n "$missing" ] || return 0
	say "error: tracked but not in the tarball (add them to EXTRA_DIST):" \
		"$(echo "$missing" | tr '\n' ' ')"
	return 1
}
pkg_gensymbols_clean() {
	if grep -n 'dpkg-gensymbols' "$PKG_WORK/build.log" |
		grep -iE 'warning|error|diff'; then
		say "error: dpkg-gensymbols found the exports and tools/debian/*.symbols apart (see above)"
		return 1
	fi
	return 0
}
pkg_blhc() {
	# PIE is the compiler's default on Debian: dpkg-buildflags no
	# longer passes -fPIE, which blhc 0.13 still looks for.
	blhc --all --ignore-flag -fPIE --ignore-flag -pie "$PKG_WORK/build.log"
}
pkg_lintian() {
	local rc=0 files
	files=("$PKG_WORK"/keylock_"$PKG_DEBVERSION".dsc
		"$PKG_WORK"/keylock_"$PKG_DEBVERSION"_"$PKG_ARCH".changes)
	say "lintian $(lintian --print-version) on ${files[*]##*/}:"
	lintian --fail-on error,warning --display-info --pedantic \
		"${files[@]}" >"$PKG_WORK/lintian.log" 2>&1 || rc=$?
	# The overrides in use, apart: with --show-overrides, lintian 2.116
	# fails on the overridden tags too.
	lintian --show-overrides "${files[@]}" 2>&1 | grep '^O:' \
		>>"$PKG_WORK/lintian.log" || true
	grep -v 'running with root privileges' "$PKG_WORK/lintian.log" |
		sed 's/^/    /'
	say "lintian: $(grep -c '^E:' "$PKG_WORK/lintian.log") errors, $(grep -c '^W:' "$PKG_WORK/lintian.log") warnings, $(grep -c '^[IP]:' "$PKG_WORK/lintian.log") info or pedantic, $(grep -c '^O:' "$PKG_WORK/lintian.log") overridden (exit $rc)"
	return $rc
}
# pkg_contents: each package holds its files; no library but the
# providers needs hiredis or libpq.
pkg_contents() {
	local ok=0 p f deb list deps
	local -A want=(
		[libkeylock0]="usr/lib/$PKG_MULTIARCH/libkeylock.so.0"
		[libkeylock-redis0]="usr/lib/$PKG_MULTIARCH/libkeylock-redis.so.0"
		[libkeylock-pg0]="usr/lib/$PKG_MULTIARCH/libkeylock-pg.so.0"
		[libkeylock-dev]="usr/include/keylock.h usr/include/keylock/redis.h usr/include/keylock/pg.h usr/lib/$PKG_MULTIARCH/libkeylock.so usr/lib/$PKG_MULTIARCH/libkeylock.a usr/lib/$PKG_MULTIARCH/libkeylock-redis.a usr/lib/$PKG_MULTIARCH/libkeylock-pg.a usr/lib/$PKG_MULTIARCH/pkgconfig/keylock.pc usr/lib/$PKG_MULTIARCH/pkgconfig/keylock-redis.pc usr/lib/$PKG_MULTIARCH/pkgconfig/keylock-pg.pc usr/share/man/man3/kl_mutex.3.gz usr/share/man/man3/kl_redis_provider_open.3.gz usr/share/doc/libkeylock-dev/examples/keyed_pool.c"
		[keylock]="usr/bin/keylock usr/bin/keylock-bench usr/share/man/man1/keylock.1.gz usr/share/man/man1/keylock-bench.1.gz usr/lib/tmpfiles.d/keylock.conf"
	)
	for p in "${DEB_BINARIES[@]}"; do
		deb=$(pkg_debs "$p")
		if [ ! -f "$deb" ]; then
			say "error: $p was not built (no ${deb##*/})"
			ok=1
			continue
		fi
		list=$(dpkg-deb -c "$deb" | awk '{ print $6 }' | sed 's|^\./||')
		for f in ${want[$p]}; do
			grep -qx -F "$f" <<<"$list" || {
				say "error: $p lacks /$f"
				ok=1
			}
		done
		deps=$(dpkg-deb -f "$deb" Depends)
		say "$p: $(grep -c -v '/$' <<<"$list") files; Depends: $deps"
		case $p in
		libkeylock0 | keylock | libkeylock-dev)
			if grep -qE 'hiredis|libpq' <<<"$deps"; then
				say "error: $p depends on hiredis or libpq"
				ok=1
			fi
			;;
		esac
	done
	return $ok
}
# pkg_configure_refuses OPTION MESSAGE: configure OPTION, with pkg-config
# finding nothing, fails and says MESSAGE.
pkg_configure_refuses() {
	local opt=$1 msg=$2 dir rc=0
	dir=$PKG_WORK/configure${opt%%=*}
	rm -rf "$dir"
	mkdir -p "$dir/no-pkgconfig"
	(cd "$dir" && PKG_CONFIG_LIBDIR=$dir/no-pkgconfig PKG_CONFIG_PATH='' \
		"$PKG_CLEAN/configure" "$opt") >"$dir/log" 2>&1 || rc=$?
	if [ "$rc" -eq 0 ]; then
		say "error: configure $opt succeeded without the library"
		return 1
	fi
	if ! grep -q -F -e "$msg" "$dir/log"; then
		say "error: configure $opt failed (exit $rc) without saying '$msg':"
		tail -n 5 "$dir/log"
		return 1
	fi
	say "configure $opt: $(grep -F -e "$msg" "$dir/log" | head -n 1)"
}
pkg_consumer_destdir() {
	sh "$PKG_SRC/test/pkg/consumer.sh" --destdir "$PKG_SRC/debian/tmp" \
		keylock keylock-redis keylock-pg
}
pkg_install_core() {
	pkg_purge || return 1
	# shellcheck disable=SC2046
	dpkg -i $(pkg_debs libkeylock0 keylock) </dev/null
}
pkg_keylock_runs() {
	local out dir
	out=$(/usr/bin/keylock --version) || return 1
	say "keylock --version: $out"
	case $out in
	"keylock $PKG_VERSION "*) ;;
	*) say "error: not keylock $PKG_VERSION"; return 1 ;;
	esac
	dir=$(mktemp -d "$PKG_WORK/locks.XXXXXX")
	out=$(/usr/bin/keylock -p "local:$dir" -w 5s pkg-test -- \
		sh -c 'echo "held $KEYLOCK_KEY"') || return 1
	[ "$out" = "held pkg-test" ] || {
		say "error: keylock -p local: ran the command with: $out"
		return 1
	}
}
# pkg_provider URI EXPECTED: keylock -p URI exits 69, saying EXPECTED.
pkg_provider() {
	local rc=0 err
	err=$(/usr/bin/keylock -p "$1" -w 0 pkg-test -- true 2>&1) || rc=$?
	say "keylock -p '$1': exit $rc: $err"
	[ "$rc" -eq 69 ] && grep -q -F "$2" <<<"$err"
}
pkg_providers_missing() {
	pkg_provider 'redis://127.0.0.1:1/0' 'which is not installed' &&
		pkg_provider 'postgresql://127.0.0.1:1/x' 'which is not installed'
}
pkg_install_rest() {
	# shellcheck disable=SC2046
	dpkg -i $(pkg_debs libkeylock-redis0 libkeylock-pg0 libkeylock-dev) \
		</dev/null
}
pkg_providers_load() {
	pkg_provider 'redis://127.0.0.1:1/0?connect_timeout=1s' 'cannot connect' &&
		pkg_provider 'rediss://127.0.0.1:1/0?connect_timeout=1s' 'cannot connect' &&
		pkg_provider 'postgresql://127.0.0.1:1/x?connect_timeout=1' 'cannot connect'
}
pkg_consumer_installed() {
	sh "$PKG_SRC/test/pkg/consumer.sh" keylock keylock-redis keylock-pg
}
pkg_purged() {
	local p left=()
	pkg_purge || return 1
	for p in "${DEB_BINARIES[@]}"; do
		case $(dpkg-query -W -f='${db:Status-Abbrev}' "$p" 2>/dev/null) in
		"" | un* | pn*) ;;
		*) left+=("$p") ;;
		esac
	done
	[ ${#left[@]} -eq 0 ] || {
		say "error: still known to dpkg: ${left[*]}"
		return 1
	}
	[ ! -e "/usr/lib/$PKG_MULTIARCH/libkeylock.so.0" ]
}

stage_package() {
	local tarball start netns
	local root=0
	[ "$(id -u)" -ne 0 ] || root=1
	# Without their Recommends: devscripts' (debian-keyring and a
	# hundred more) are not needed here.
	[ $root -eq 0 ] || pkg_install_tools debhelper devscripts lintian \
		build-essential dpkg-dev fakeroot blhc pkgconf check \
		libhiredis-dev libssl-dev libpq-dev
	ensure_plain
	PKG_WORK=$BUILD/package
	rm -rf "$PKG_WORK"
	mkdir -p "$PKG_WORK"
	export PKG_WORK
	mk "$PLAIN" dist-gzip
	PKG_VERSION=$(sed -n 's/^PACKAGE_VERSION = //p' "$PLAIN/Makefile")
	tarball=$PLAIN/keylock-$PKG_VERSION.tar.gz
	cp "$tarball" "$PKG_WORK/keylock_$PKG_VERSION.orig.tar.gz"
	PKG_SRC=$PKG_WORK/keylock-$PKG_VERSION
	PKG_CLEAN=$PKG_WORK/clean/keylock-$PKG_VERSION
	mkdir -p "$PKG_WORK/clean"
	tar -C "$PKG_WORK" -xzf "$tarball"
	tar -C "$PKG_WORK/clean" -xzf "$tarball"
	# The packaging of the tarball itself (EXTRA_DIST), as a Debian
	# maintainer would take it.
	cp -r "$PKG_SRC/tools/debian" "$PKG_SRC/debian"
	PKG_DEBVERSION=$(dpkg-parsechangelog -l "$PKG_SRC/debian/changelog" \
		-S Version)
	PKG_ARCH=$(dpkg --print-architecture)
	PKG_MULTIARCH=$(dpkg-architecture -qDEB_HOST_MULTIARCH)
	pkg_check "tools/debian/changelog at the tarball's version" \
		pkg_changelog_version || return 1

	pkg_check "the tarball holds every tracked file of the build and tests" \
		pkg_tarball_complete "$tarball" || true

	(cd "$PKG_WORK" && dpkg-source -b "keylock-$PKG_VERSION")
	# As Debian's build daemons do: no network but the loopback, which
	# also shows that make check in the tarball never needs it.
	netns=()
	if [ $root -eq 1 ] && unshare -n true 2>/dev/null; then
		netns=(unshare -n sh -c \
			'ip link set lo up 2>/dev/null || true; exec "$@"' sh)
		say "package: building in a network namespace (loopback only)"
	fi
	start=$SECONDS
	if ! (cd "$PKG_SRC" && DEB_BUILD_OPTIONS="parallel=$JOBS" \
		"${netns[@]}" dpkg-buildpackage -us -uc -b) \
		>"$PKG_WORK/build.log" 2>&1; then
		tail -n 80 "$PKG_WORK/build.log"
		pkg_check "dpkg-buildpackage -us -uc -b" false
		return 1
	fi
	grep -E '^# (TOTAL|PASS|SKIP|FAIL|ERROR):' "$PKG_WORK/build.log" |
		sed 's/^/    make check in dh_auto_test: /'
	pkg_check "dpkg-buildpackage -us -uc -b ($((SECONDS - start))s; log $PKG_WORK/build.log)" true
	pkg_check "dpkg-gensymbols clean" pkg_gensymbols_clean || true
	if command -v blhc >/dev/null 2>&1; then
		pkg_check "blhc: the build honours CFLAGS, CPPFLAGS, LDFLAGS" pkg_blhc || true
	else
		say "package: blhc is not installed: build flags not checked"
		PKG_SKIPS=$((PKG_SKIPS + 1))
	fi
	pkg_check "lintian" pkg_lintian || true
	pkg_check "package contents and dependencies" pkg_contents || true
	pkg_check "configure --with-redis=yes without hiredis fails clearly" \
		pkg_configure_refuses --with-redis=yes \
		'--with-redis was given but hiredis' || true
	pkg_check "configure --with-postgresql=yes without libpq fails clearly" \
		pkg_configure_refuses --with-postgresql=yes \
		'--with-postgresql was given but libpq' || true
	pkg_check "consumer.sh against the DESTDIR install (debian/tmp)" \
		pkg_consumer_destdir || true

	if [ $root -eq 0 ]; then
		say "package: not root: the packages are not installed (4 tests skipped)"
		PKG_SKIPS=$((PKG_SKIPS + 4))
		result_line "$PKG_TESTS" "$PKG_FAILS" "$PKG_SKIPS"
		return $((PKG_FAILS > 0))
	fi
	trap pkg_purge EXIT
	if pkg_check "dpkg -i libkeylock0 keylock" pkg_install_core; then
		pkg_check "keylock --version and a local: lock" pkg_keylock_runs || true
		pkg_check "providers reported missing without their packages" \
			pkg_providers_missing || true
		if pkg_check "dpkg -i libkeylock-redis0 libkeylock-pg0 libkeylock-dev" \
			pkg_install_rest; then
			pkg_check "providers load from their packages" \
				pkg_providers_load || true
			pkg_check "consumer.sh against the installed packages" \
				pkg_consumer_installed || true
		fi
	fi
	pkg_check "dpkg --purge" pkg_purged || true
	trap - EXIT
	return $((PKG_FAILS > 0))
}
