# SPDX-License-Identifier: MIT
# test/stages/bench.sh: stage bench of tools/test, sourced after
# test/stages/lib.sh.

# The benchmark's quick pass: it must run and find no broken invariant
# (mutual exclusion, leaked keys); it never judges speed.
stage_bench() {
	local rc=0
	ensure_plain
	"$PLAIN/tools/keylock-bench" --quick || rc=$?
	if [ "$rc" -eq 0 ]; then
		echo "0 1 0 0" >"$STAGE_RESULT"
	else
		echo "0 1 1 0" >"$STAGE_RESULT"
	fi
	return $rc
}
