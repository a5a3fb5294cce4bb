# SPDX-License-Identifier: MIT
# test/stages/tsan.sh: stage tsan of tools/test, sourced after
# test/stages/lib.sh.

stage_tsan() {
	tsan_env
	build_tsan
	check_tree "$TSAN"
}
