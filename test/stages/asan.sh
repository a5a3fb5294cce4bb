# SPDX-License-Identifier: MIT
# test/stages/asan.sh: stage asan of tools/test, sourced after
# test/stages/lib.sh.

stage_asan() {
	local dir=$BUILD/asan
	local flags="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all -g -O1"
	export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1}
	export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}
	export CK_TIMEOUT_MULTIPLIER=${CK_TIMEOUT_MULTIPLIER:-2}
	configure_tree "$dir" CC=gcc CFLAGS="$flags" LDFLAGS="$flags"
	mk "$dir"
	check_tree "$dir"
}
