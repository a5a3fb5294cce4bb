# SPDX-License-Identifier: MIT
# test/stages/soak.sh: stage soak of tools/test, sourced after
# test/stages/lib.sh.

# The soak, TESTPLAN's P2 tier (T27, and T06 at length): only with --soak
# or KL_SOAK=1.  test/stress/stress_soak for KL_SOAK_MINUTES (30), then
# the T06 hunt (stress_hunt, case hunt, KL_TEST_SCALE = 3 x minutes, so
# that it runs as long), in the plain tree and then in the tsan tree
# (made when missing).  Make's timeout grows to fit.
stage_soak() {
	local rc=0 minutes=${KL_SOAK_MINUTES:-30} secs mult scale start
	local s1 t1 f1 k1 s2 t2 f2 k2
	local MAKE_TIMEOUT
	secs=$(awk -v m="$minutes" 'BEGIN { printf "%d", m * 60 }')
	scale=$(awk -v m="$minutes" 'BEGIN { print m * 3 }')
	MAKE_TIMEOUT=$((secs * 3 + 1200))
	mult=$((secs * 5 / 2 / 900 + 4))
	export KL_SOAK_MINUTES=$minutes
	say "soak: $minutes minutes each: soak and hunt, plain then tsan"
	ensure_plain
	start=$SECONDS
	mk "$PLAIN" check-stress KL_STRESS=test/stress/stress_soak || rc=$?
	CK_RUN_CASE=hunt KL_TEST_SCALE=$scale CK_TIMEOUT_MULTIPLIER=$mult \
		mk "$PLAIN" check-stress KL_STRESS=test/stress/stress_hunt ||
		rc=$?
	say "soak: plain pass: $((SECONDS - start))s"
	tally "$PLAIN/test/stress"
	read -r s1 t1 f1 k1 <"$STAGE_RESULT"
	mv "$STAGE_FAILED" "$STAGE_FAILED.plain"

	if [ ! -f "$TSAN/Makefile" ] || [ ! -f "$TSAN/src/libkeylock.la" ]; then
		(tsan_env && build_tsan) || rc=$?
	fi
	start=$SECONDS
	if [ -f "$TSAN/Makefile" ]; then
		(
			r=0
			tsan_env
			export CK_TIMEOUT_MULTIPLIER=$mult
			mk "$TSAN" check-stress \
				KL_STRESS=test/stress/stress_soak || r=$?
			CK_RUN_CASE=hunt KL_TEST_SCALE=$scale mk "$TSAN" \
				check-stress KL_STRESS=test/stress/stress_hunt ||
				r=$?
			exit $r
		) || rc=$?
	fi
	say "soak: tsan pass: $((SECONDS - start))s"
	tally "$TSAN/test/stress"
	read -r s2 t2 f2 k2 <"$STAGE_RESULT"
	cat "$STAGE_FAILED.plain" >>"$STAGE_FAILED"
	rm -f "$STAGE_FAILED.plain"
	echo "$((s1 + s2)) $((t1 + t2)) $((f1 + f2)) $((k1 + k2))" >"$STAGE_RESULT"
	return $rc
}
