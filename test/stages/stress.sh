# SPDX-License-Identifier: MIT
# test/stages/stress.sh: stage stress of tools/test, sourced after
# test/stages/lib.sh.

# The stress suites (test/stress/: TESTPLAN's in-process stress and
# reliability tests, built and run only by make check-stress): in the plain
# tree, then in the ThreadSanitizer tree (made here when the tsan stage did
# not run) with its settings, KL_TEST_SCALE=0.25 by default.  Both passes
# run even when the first fails; their Check tests are counted together,
# and the log gives each pass's wall time.  A failure prints KL_TEST_SEED:
# rerun the suite with it to replay.
# TESTPLAN T13's random part: T01 (stress_mutex, case exclusion) at scale
# 0.05 while libfiu fails 1% of libc's allocations at random (the test
# harness's own among them), 20 runs.  A run may fail its checks (Check
# itself gives up on a failed malloc); none may die by a signal or hang.
stress_fiu() {
	local i st bad=0
	install_missing fiu-utils
	mk "$PLAIN" test/stress/stress_mutex
	for i in $(seq 1 20); do
		st=0
		(cd "$PLAIN" && CK_FORK=no CK_RUN_CASE=exclusion \
			KL_TEST_SCALE=0.05 timeout 120 fiu-run -x -f "" \
			-c 'enable_random name=libc/mm/*,probability=0.01' \
			./test/stress/stress_mutex) >"$PLAIN/test/stress/fiu.log" \
			2>&1 || st=$?
		if [ "$st" -gt 2 ]; then
			say "error: T01 under libfiu run $i: exit $st (a crash or a hang)" >&2
			tail -5 "$PLAIN/test/stress/fiu.log" >&2
			bad=$((bad + 1))
		fi
	done
	progress "stress: T13 under libfiu: 20 runs, $bad crashed or hung"
	[ "$bad" -eq 0 ]
}

stage_stress() {
	local rc=0 start s1 t1 f1 k1 s2 t2 f2 k2 why=""
	ensure_plain
	start=$SECONDS
	# TESTPLAN T29: the races of T01, T04, T05, T06 and T08 with the test
	# build's debug yields, 5 seeds at a small scale (before the main pass,
	# whose results the counts show; a failure names its seed).
	for seed in 1 2 3 4 5; do
		KL_DEBUG_YIELD=1 KL_TEST_SEED=$seed KL_TEST_SCALE=0.05 \
			mk "$PLAIN" check-stress KL_STRESS="test/stress/stress_mutex test/stress/stress_timing test/stress/stress_hunt test/stress/stress_table test/stress/stress_rw" || {
			rc=1
			why="$why debug-yield seed $seed;"
			say "error: stress with KL_DEBUG_YIELD=1 KL_TEST_SEED=$seed failed" >&2
		}
	done
	progress "stress: debug-yield seeds: $((SECONDS - start))s"
	stress_fiu || { rc=1; why="$why T13 under libfiu;"; }
	start=$SECONDS
	mk "$PLAIN" check-stress || { rc=1; why="$why plain pass;"; }
	# The soak (stage soak, TESTPLAN T27) for 12 s: its code runs in CI.
	KL_SOAK_MINUTES=0.2 mk "$PLAIN" check-stress \
		KL_STRESS=test/stress/stress_soak || { rc=1; why="$why soak;"; }
	progress "stress: plain pass: $((SECONDS - start))s"
	tally "$PLAIN/test/stress"
	read -r s1 t1 f1 k1 <"$STAGE_RESULT"
	mv "$STAGE_FAILED" "$STAGE_FAILED.plain"

	if [ ! -f "$TSAN/Makefile" ] || [ ! -f "$TSAN/src/libkeylock.la" ]; then
		(tsan_env && build_tsan) || { rc=1; why="$why tsan build;"; }
	fi
	start=$SECONDS
	if [ -f "$TSAN/Makefile" ]; then
		(tsan_env && mk "$TSAN" check-stress) ||
			{ rc=1; why="$why tsan pass;"; }
	fi
	progress "stress: tsan pass (KL_TEST_SCALE=${KL_TEST_SCALE:-0.25}): $((SECONDS - start))s"
	tally "$TSAN/test/stress"
	read -r s2 t2 f2 k2 <"$STAGE_RESULT"
	cat "$STAGE_FAILED.plain" >>"$STAGE_FAILED"
	rm -f "$STAGE_FAILED.plain"
	echo "$((s1 + s2)) $((t1 + t2)) $((f1 + f2)) $((k1 + k2))" >"$STAGE_RESULT"
	# Parts outside the Check counts fail too: name them last, where the
	# summary's tail of the log shows them.
	[ -z "$why" ] || say "error: stress: failed:$why (the log says more)" >&2
	return $rc
}
