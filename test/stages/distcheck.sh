# SPDX-License-Identifier: MIT
# test/stages/distcheck.sh: stage distcheck of tools/test, sourced after
# test/stages/lib.sh.

# make distcheck, twice: with both providers, and with neither
# (DISTCHECK_CONFIGURE_FLAGS --with-redis=yes --with-postgresql=yes, then
# --without-redis --without-postgresql; as root hiredis and libpq are
# installed when missing, else a missing one is left to configure's
# check).  Each makes the tarball, builds it out of tree with a read-only
# source, runs make check, make install and make installcheck
# (test/pkg/consumer.sh against the --prefix install) and checks that
# everything is uninstalled and cleaned.  make distcheck removes its tree,
# logs included, when it passes: count the harness's summaries then (one
# test per program, Check tests are not seen); when it fails, count its
# logs.
stage_distcheck() {
	local rc=0 version distdir total fail error skip suites flags
	local redis=yes pg=yes
	[ "$(id -u)" -ne 0 ] || install_missing libhiredis-dev libssl-dev libpq-dev
	pkg-config --exists 'hiredis >= 0.14' || redis=check
	pkg-config --exists libpq || pg=check
	ensure_plain
	for flags in "--with-redis=$redis --with-postgresql=$pg" \
		"--without-redis --without-postgresql"; do
		say "distcheck with DISTCHECK_CONFIGURE_FLAGS='--enable-werror $flags'"
		mk "$PLAIN" distcheck \
			DISTCHECK_CONFIGURE_FLAGS="--enable-werror $flags" || {
			rc=$?
			break
		}
	done
	version=$(sed -n 's/^PACKAGE_VERSION = //p' "$PLAIN/Makefile")
	distdir=$PLAIN/keylock-$version/_build/sub
	if [ $rc -ne 0 ] && [ -d "$distdir" ]; then
		tally "$distdir"
	else
		total=$(sed -n 's/^# TOTAL: *//p' "$STAGE_LOG" |
			awk '{ n += $1 } END { print n + 0 }')
		fail=$(sed -n 's/^# FAIL: *//p' "$STAGE_LOG" |
			awk '{ n += $1 } END { print n + 0 }')
		error=$(sed -n 's/^# ERROR: *//p' "$STAGE_LOG" |
			awk '{ n += $1 } END { print n + 0 }')
		skip=$(sed -n 's/^# SKIP: *//p' "$STAGE_LOG" |
			awk '{ n += $1 } END { print n + 0 }')
		suites=$(grep -cE '^(PASS|FAIL|ERROR|XPASS): test/check_' \
			"$STAGE_LOG" || true)
		echo "$suites $((total - skip)) $((fail + error)) $skip" >"$STAGE_RESULT"
	fi
	return $rc
}
