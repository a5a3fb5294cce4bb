# SPDX-License-Identifier: MIT
# test/stages/check.sh: stage check of tools/test, sourced after
# test/stages/lib.sh.

stage_check() {
	ensure_plain
	check_tree "$PLAIN"
}
