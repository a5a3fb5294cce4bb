# SPDX-License-Identifier: MIT
# test/stages/helgrind.sh: stage helgrind of tools/test, sourced after
# test/stages/lib.sh.

# Helgrind (TESTPLAN T01's P1 subset): a tree with the condvar parker
# (--disable-futex: Helgrind understands pthread condvars, not futexes) and
# the happens-before annotations of src/annotate.h
# (--enable-valgrind-annotations: the C11 atomics of the kl_mutex fast path
# and the waiter hand-off are invisible to it otherwise).  Runs T01
# (stress_mutex, case exclusion) at KL_HELGRIND_SCALE (0.02) and the
# suites of HELGRIND_SUITES under valgrind --tool=helgrind, one process
# each (CK_FORK=no); a suite fails on a failed test or on any Helgrind
# report.  Not yet in the list: check_registry and check_provider_local,
# whose reports come from atomics Helgrind cannot see (the tests' own
# gates, kl_cancel's fired flag in src/cancel.c, not yet annotated).  test/helgrind.supp silences two glibc internals only.
# A last test plants a race beside a kl_mutex (a counter written outside
# the lock) and fails unless Helgrind reports it: the annotations must not
# blind it.  DRD is not run: it passes T01 too, but takes ~10 minutes.
HELGRIND_SUITES=(stress/stress_mutex:exclusion check_mutex: check_cancel:
	check_reset_event: check_status: check_oom: check_table: check_hash:
	check_provider_memory: check_lock:)
helgrind_planted() {
	cat <<'PLANTED'
#include <pthread.h>
#include <stdio.h>
#include "keylock.h"
static kl_mutex *m;
static long locked, racy;
static void *
run(void *arg)
{
	kl_token t;

	for (int i = 0; i < 200; i++) {
		if (kl_mutex_enter(m, KL_FOREVER, NULL, &t) != KL_OK)
			return arg;
		locked++;
		kl_mutex_leave(m, t, false);
		racy++; /* the planted race */
	}
	return NULL;
}
int
main(void)
{
	pthread_t a, b;

	if (kl_mutex_new(&m, NULL) != KL_OK)
		return 2;
	pthread_create(&a, NULL, run, NULL);
	pthread_create(&b, NULL, run, NULL);
	pthread_join(a, NULL);
	pthread_join(b, NULL);
	kl_mutex_free(m);
	printf("locked %ld racy %ld\n", locked, racy);
	return locked == 400 ? 0 : 3;
}
PLANTED
}
stage_helgrind() {
	local dir=$BUILD/helgrind rc=0 item prog case log res n f errs progs
	local tests=0 fails=0
	local hg=(valgrind --tool=helgrind --error-exitcode=99
		--suppressions="$ROOT/test/helgrind.supp")
	install_missing valgrind
	configure_tree "$dir" --disable-futex --enable-valgrind-annotations \
		CFLAGS="-g -O1"
	grep -q '^#define KL_VALGRIND_ANNOTATIONS 1' "$dir/config.h" || {
		say "error: configure did not turn the annotations on" >&2
		return 1
	}
	mk "$dir" src/libkeylock.la
	progs=()
	for item in "${HELGRIND_SUITES[@]}"; do
		progs+=("test/${item%%:*}")
	done
	mk "$dir" "${progs[@]}"
	for item in "${HELGRIND_SUITES[@]}"; do
		prog=${item%%:*}
		case=${item#*:}
		log=$dir/helgrind-${prog##*/}.log
		res=0
		(cd "$dir/test" && env CK_FORK=no ${case:+CK_RUN_CASE=$case} \
			top_srcdir="$ROOT" top_builddir="$dir" \
			KEYLOCK_PROVIDER_DIR="$dir/src/.libs" \
			KL_TEST_SCALE="${KL_HELGRIND_SCALE:-0.02}" \
			CK_TIMEOUT_MULTIPLIER=20 "$dir/libtool" --mode=execute \
			"${hg[@]}" "./$prog") >"$log" 2>&1 || res=$?
		read -r n f < <(awk '
			match($0, /^[0-9]+%: Checks: [0-9]+, Failures: [0-9]+, Errors: [0-9]+/) {
				s = substr($0, RSTART, RLENGTH)
				gsub(/[^0-9]+/, " ", s)
				split(s, v, " ")
				n += v[2]; f += v[3] + v[4]; seen = 1
			}
			END { print (seen ? n : 0), (seen ? f : 1) }' "$log")
		errs=$(sed -n 's/.*ERROR SUMMARY: \([0-9]*\) errors.*/\1/p' \
			"$log" | tail -n 1)
		[ "$res" -eq 0 ] && [ "${errs:-1}" -eq 0 ] || [ "$f" -gt 0 ] ||
			f=1
		progress "helgrind: $prog${case:+ ($case)}: $n tests, $f failures, ${errs:-no} Helgrind reports (exit $res)"
		tests=$((tests + n))
		fails=$((fails + f))
		if [ "$f" -gt 0 ]; then
			rc=1
			echo "$log" >>"$STAGE_FAILED"
		fi
	done
	# The planted race must be reported.
	log=$dir/helgrind-planted.log
	res=0
	helgrind_planted >"$dir/planted.c"
	(cd "$dir" && ./libtool --mode=link gcc -g -O1 -pthread \
		-I"$ROOT/include" -o planted planted.c src/libkeylock.la &&
		./libtool --mode=execute "${hg[@]}" ./planted) >"$log" 2>&1 ||
		res=$?
	tests=$((tests + 1))
	if [ "$res" -eq 99 ] && grep -q 'Possible data race' "$log" &&
		grep -q '"racy"' "$log" && ! grep -q '"locked"' "$log"; then
		progress "helgrind: planted race: reported, the locked counter not"
	else
		progress "helgrind: planted race: not reported as it should be (exit $res)"
		fails=$((fails + 1))
		rc=1
		echo "$log" >>"$STAGE_FAILED"
	fi
	echo "${#HELGRIND_SUITES[@]} $tests $fails 0" >"$STAGE_RESULT"
	return $rc
}
