# SPDX-License-Identifier: MIT
# test/stages/static.sh: stage static of tools/test, sourced after
# test/stages/lib.sh.

stage_static() {
	local rc=0 n f
	install_missing cppcheck clang-tidy
	ensure_plain
	"$ROOT/tools/static-check" "$PLAIN" || rc=$?
	[ "$rc" -ne 2 ] || return 2
	n=$(sed -n 's/^static: \([0-9]*\) checks, \([0-9]*\) failed$/\1 \2/p' \
		"$STAGE_LOG" | tail -n 1)
	read -r n f <<<"${n:-1 1}"
	result_line "$n" "$f" 0
	return $rc
}
