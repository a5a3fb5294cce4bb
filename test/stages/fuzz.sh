# SPDX-License-Identifier: MIT
# test/stages/fuzz.sh: stage fuzz of tools/test, sourced after
# test/stages/lib.sh.

stage_fuzz() {
	local rc=0 n f
	install_missing clang libclang-rt-dev
	ensure_plain
	"$ROOT/test/fuzz/run.sh" "$PLAIN" "$BUILD/fuzz" || rc=$?
	if [ "$rc" -eq 77 ]; then
		say "stage fuzz: skipped: clang's fuzzer runtime is missing"
		result_line 0 0 3
		return 0
	fi
	n=$(sed -n 's/^fuzz: \([0-9]*\) targets, \([0-9]*\) failed$/\1 \2/p' \
		"$STAGE_LOG" | tail -n 1)
	read -r n f <<<"${n:-1 1}"
	result_line "$n" "$f" 0
	return $rc
}
