# SPDX-License-Identifier: MIT
# test/stages/build.sh: stage build of tools/test, sourced after
# test/stages/lib.sh.

stage_build() {
	build_plain
}
