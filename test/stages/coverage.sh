# SPDX-License-Identifier: MIT
# test/stages/coverage.sh: stage coverage of tools/test, sourced after
# test/stages/lib.sh.


# Coverage as a gap finder (TESTPLAN T31/T32): a report, not a gate; the
# stage fails only when the build or a test fails.  Only with --coverage
# or KL_COVERAGE=1.
COVERED=(src/waitq.c src/table.c src/table.h src/table_acquire.c
	src/mutex.c src/local/provider_local.c)
stage_coverage() {
	local dir=$BUILD/coverage rc=0
	local flags="--coverage -O0 -g"
	install_missing gcovr
	configure_tree "$dir" CC=gcc CFLAGS="$flags" LDFLAGS="--coverage"
	mk "$dir"
	find "$dir" -name '*.gcda' -delete
	check_tree "$dir" || rc=$?
	# The stress suites reach what make check does not (fork, races
	# swept around the grant); small, since the tree is unoptimised.
	KL_TEST_SCALE=${KL_TEST_SCALE:-0.1} mk "$dir" check-stress || rc=$?
	say "coverage of ${COVERED[*]} (lines, then branches; TESTPLAN wants >= 90% and >= 80%):"
	(cd "$ROOT" && gcovr --root "$ROOT" --object-directory "$dir" \
		"${COVERED[@]/#/--filter=}" --exclude-unreachable-branches \
		--print-summary) | tee "$BUILD/coverage.txt"
	(cd "$ROOT" && gcovr --root "$ROOT" --object-directory "$dir" \
		"${COVERED[@]/#/--filter=}" --exclude-unreachable-branches \
		--branches) | tee -a "$BUILD/coverage.txt"
	say "coverage report: $BUILD/coverage.txt"
	return $rc
}
