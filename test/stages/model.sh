# SPDX-License-Identifier: MIT
# test/stages/model.sh: stage model of tools/test, sourced after
# test/stages/lib.sh.

stage_model() {
	local rc=0 n f
	install_missing spin gcc
	"$ROOT/test/model/run.sh" "$BUILD/model" || rc=$?
	n=$(sed -n 's/^model: \([0-9]*\) checks, \([0-9]*\) failed$/\1 \2/p' \
		"$STAGE_LOG" | tail -n 1)
	read -r n f <<<"${n:-1 1}"
	result_line "$n" "$f" 0
	return $rc
}
