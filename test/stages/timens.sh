# SPDX-License-Identifier: MIT
# test/stages/timens.sh: stage timens of tools/test, sourced after
# test/stages/lib.sh.

# The timing suites with CLOCK_MONOTONIC moved far ahead in a new time
# namespace (TESTPLAN T15(a)): 2^32 seconds, and 2^32 milliseconds (a
# uint32 millisecond counter wraps there).  libfaketime is no substitute:
# it breaks monotonic waits.  Each suite runs as the check stage runs it.
stage_timens() {
	local rc=0 off suite log res n f tests=0 fails=0 skipped=0
	local suites=(check_mutex check_cancel check_reset_event)
	if [ "$(id -u)" -ne 0 ] ||
		! unshare --time --fork --monotonic 4294967296 true 2>/dev/null; then
		say "stage timens: skipped: unshare --time needs root and a kernel with time namespaces (5.6+)"
		result_line 0 0 $((2 * ${#suites[@]}))
		return 0
	fi
	ensure_plain
	mk "$PLAIN" "${suites[@]/#/test/}"
	mkdir -p "$BUILD/timens"
	for off in 4294967296 4294967; do
		for suite in "${suites[@]}"; do
			log=$BUILD/timens/$suite.$off.log
			res=0
			(cd "$PLAIN/test" && unshare --time --fork --monotonic "$off" \
				sh -c 'grep monotonic /proc/self/timens_offsets; exec "$0"' \
				"./$suite") >"$log" 2>&1 || res=$?
			read -r n f < <(awk '
				match($0, /^[0-9]+%: Checks: [0-9]+, Failures: [0-9]+, Errors: [0-9]+/) {
					s = substr($0, RSTART, RLENGTH)
					gsub(/[^0-9]+/, " ", s)
					split(s, v, " ")
					n += v[2]; f += v[3] + v[4]; seen = 1
				}
				END { print (seen ? n : 0), (seen ? f : 1) }' "$log")
			[ "$res" -eq 0 ] || [ "$f" -gt 0 ] || f=1
			progress "timens: +${off}s: $suite: $n tests, $f failures (exit $res)"
			tests=$((tests + n))
			fails=$((fails + f))
			if [ "$res" -ne 0 ]; then
				rc=1
				echo "$log" >>"$STAGE_FAILED"
			fi
		done
	done
	result_line "$tests" "$fails" "$skipped"
	return $rc
}
