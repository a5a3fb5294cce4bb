#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
#
# test/fuzz/run.sh: builds the libFuzzer targets (TESTPLAN T19) with clang,
# ASan and UBSan, straight from the library sources, and runs each for a
# while from its committed seed corpus.
#
# Usage: test/fuzz/run.sh CONFIGURED_BUILD_DIR WORKDIR [TARGET...]
#   CONFIGURED_BUILD_DIR  a configured build tree (for its config.h)
#   WORKDIR               binaries, the growing corpora, crash artifacts
#   TARGET                fuzz_duration, fuzz_uri, fuzz_cli, fuzz_resp,
#                         fuzz_table (default: all)
#
# Environment: KL_FUZZ_SECONDS (per target, default 60), KL_FUZZ_JOBS
# (targets run at once, default: the CPUs), CLANG (default clang).
#
# Targets: test/fuzz/<target>.c; seeds: test/fuzz/corpus/<target>/ (read
# only; new inputs go to WORKDIR/corpus/<target>).  A finding reported but
# not fixed yet has its reproducer in test/fuzz/known/<target>/ and, in
# test/fuzz/known/<target>.cflags, the -D that makes the target tolerate
# it: the known inputs run once on a strict build and are reported as NOTE,
# and the fuzzing uses the tolerant build.  Once the library is fixed the
# note says so: delete both to make the target strict again.
#
# Prints a line per target and, last, "fuzz: N targets, M failed".  Exits 0
# when none crashed, leaked or broke a check; 1 otherwise; 77 when clang's
# fuzzer runtime is missing (Debian: libclang-rt-dev).  fuzz_resp compiles
# the Redis provider in and links hiredis: without hiredis it is SKIP, which
# is no failure.

set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
[ $# -ge 2 ] || { sed -n '4,/^$/s/^# \{0,1\}//p' "$0" >&2; exit 64; }
BUILD=$(cd "$1" && pwd)
WORK=$2
shift 2
TARGETS=("$@")
[ ${#TARGETS[@]} -gt 0 ] || TARGETS=(fuzz_duration fuzz_uri fuzz_cli fuzz_resp fuzz_table)
SECS=${KL_FUZZ_SECONDS:-60}
JOBS=${KL_FUZZ_JOBS:-$(nproc 2>/dev/null || echo 2)}
CLANG=${CLANG:-clang}

[ -f "$BUILD/config.h" ] || { echo "fuzz: no config.h in $BUILD (configure first)" >&2; exit 2; }
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)

# The fuzzer runtime: libFuzzer's main and the sanitizers.
echo 'int LLVMFuzzerTestOneInput(const char *d, long n) { return 0; }' >"$WORK/probe.c"
if ! "$CLANG" -fsanitize=fuzzer,address,undefined "$WORK/probe.c" \
	-o "$WORK/probe" >"$WORK/probe.log" 2>&1; then
	echo "fuzz: SKIP: $CLANG cannot link -fsanitize=fuzzer (Debian: apt-get install clang libclang-rt-dev):"
	sed 's/^/    /' "$WORK/probe.log" | tail -n 5
	exit 77
fi

# The library's sources, as Makefile.am lists them (kl_sources).
mapfile -t SRCS < <(sed -n '/^kl_sources = /,/^$/p' "$ROOT/Makefile.am" |
	grep -o 'src/[A-Za-z0-9_/]*\.c' | sed "s|^|$ROOT/|")
[ ${#SRCS[@]} -gt 0 ] || { echo "fuzz: no kl_sources in Makefile.am" >&2; exit 2; }

CFLAGS=(-std=gnu11 -g -O1 -fno-omit-frame-pointer
	-fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all
	-I"$BUILD" -I"$ROOT/include" -I"$ROOT/src" -pthread)

export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}

# fuzz TARGET: build, run from the seeds; the outcome in WORK/TARGET.outcome.
fuzz() {
	local t=$1 bin=$WORK/$1 log=$WORK/$1.log corpus=$WORK/corpus/$1
	local seeds=$ROOT/test/fuzz/corpus/$1 known=$ROOT/test/fuzz/known/$1
	local extra=() tolerate=() rc=0 runs cov f notes="" maxlen=256
	local tsrcs=() tlibs=() tflags=() asan=$ASAN_OPTIONS
	if [ "$t" = fuzz_table ]; then
		# the table's invariant checks
		tflags=(-DKL_TEST_HOOKS)
		maxlen=4096 # programs of a few hundred operations
	fi
	if [ "$t" = fuzz_resp ]; then
		# the Redis provider, compiled in (every src/redis/*.c, as
		# libkeylock-redis in Makefile.am; TLS only below), and hiredis
		for f in "$ROOT"/src/redis/*.c; do
			[ "${f##*/}" = redis_tls.c ] || tsrcs+=("$f")
		done
		read -r -a tlibs <<<"$(pkg-config --cflags --libs hiredis 2>/dev/null ||
			echo -I/usr/include/hiredis -lhiredis)"
		# TLS (rediss://) when the build has it
		if grep -q '^#define HAVE_REDIS_TLS 1' "$BUILD/config.h"; then
			tsrcs+=("$ROOT"/src/redis/redis_tls.c)
			read -r -a f <<<"$(pkg-config --cflags --libs libssl libcrypto 2>/dev/null ||
				echo -lssl -lcrypto)"
			tlibs+=("${f[@]}")
		fi
		echo '#include <hiredis.h>' >"$WORK/$t.probe.c"
		if ! "$CLANG" -fsyntax-only "${tlibs[@]}" "$WORK/$t.probe.c" \
			>/dev/null 2>&1; then
			echo "SKIP (no hiredis headers; Debian: apt-get install libhiredis-dev)" >"$WORK/$t.outcome"
			return 0
		fi
		maxlen=2048 # a whole handshake is about 400 bytes
		# hiredis allocates an array reply's element vector as its
		# header announces ("*777777770"): such an allocation fails
		# (hiredis reports "Out of memory") instead of ending the run.
		asan=$asan:allocator_may_return_null=1:max_allocation_size_mb=256
	fi
	if [ -f "$known.cflags" ]; then
		read -r -a tolerate <"$known.cflags"
		# the strict build, for the known inputs
		if "$CLANG" "${CFLAGS[@]}" "${tflags[@]}" "$HERE/$t.c" "${SRCS[@]}" \
			"${tsrcs[@]}" "${tlibs[@]}" -ldl -o "$bin.strict" >"$WORK/$t.build.log" 2>&1; then
			for f in "$known"/*; do
				[ -f "$f" ] || continue
				if (cd "$WORK" && TMPDIR=$WORK ASAN_OPTIONS=$asan "$bin.strict" "$f") \
					>"$WORK/$t.known.log" 2>&1; then
					notes="$notes; known finding $(basename "$f") is fixed: delete test/fuzz/known/$t*"
				else
					notes="$notes; NOTE: known finding $(basename "$f") still reproduces (tolerated: ${tolerate[*]})"
				fi
			done
		fi
	fi
	if ! "$CLANG" "${CFLAGS[@]}" "${tflags[@]}" "${tolerate[@]}" "$HERE/$t.c" "${SRCS[@]}" \
		"${tsrcs[@]}" "${tlibs[@]}" -ldl -o "$bin" >"$WORK/$t.build.log" 2>&1; then
		echo "FAIL (does not build: $(grep -m 1 'error' "$WORK/$t.build.log" || tail -n 1 "$WORK/$t.build.log"))" >"$WORK/$t.outcome"
		return 0
	fi
	rm -rf "$corpus"
	mkdir -p "$corpus" "$WORK/artifacts"
	# keylock --version prints to the real stdout: close it.
	[ "$t" != fuzz_cli ] || extra=(-close_fd_mask=1)
	(cd "$WORK" && TMPDIR=$WORK ASAN_OPTIONS=$asan "$bin" -max_len="$maxlen" -max_total_time="$SECS" \
		-timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
		-artifact_prefix="$WORK/artifacts/$t-" "${extra[@]}" \
		"$corpus" "$seeds") >"$log" 2>&1 || rc=$?
	runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
	# no coverage line when the first input already crashed
	cov=$(grep -o 'cov: [0-9]*' "$log" | tail -n 1 | sed 's/cov: //' || true)
	if [ $rc -eq 0 ] && [ -z "$runs" ]; then
		echo "FAIL (libFuzzer printed no statistics: see $log)" >"$WORK/$t.outcome"
	elif [ $rc -eq 0 ]; then
		echo "PASS (${runs:-?} runs, ${cov:-?} edges, $(find "$corpus" -type f | wc -l) new inputs$notes)" >"$WORK/$t.outcome"
	else
		echo "FAIL (exit $rc: $(grep -m 1 -E 'ERROR:|runtime error|fuzz_[a-z]+: ' "$log" || echo 'see log'); artifacts in $WORK/artifacts$notes)" >"$WORK/$t.outcome"
	fi
}

running=0
for t in "${TARGETS[@]}"; do
	[ -f "$HERE/$t.c" ] || { echo "fuzz: no target $t" >&2; exit 64; }
	rm -f "$WORK/$t.outcome"
	(fuzz "$t") &
	running=$((running + 1))
	if [ $running -ge "$JOBS" ]; then
		wait -n || true
		running=$((running - 1))
	fi
done
wait

failed=0
for t in "${TARGETS[@]}"; do
	out=$(cat "$WORK/$t.outcome" 2>/dev/null || echo "FAIL (no outcome)")
	echo "fuzz: $t: $out"
	case $out in
	PASS* | SKIP*) ;;
	*)
		failed=$((failed + 1))
		echo "fuzz: $t: last lines of $WORK/$t.log:"
		tail -n 40 "$WORK/$t.log" 2>/dev/null | sed 's/^/    /'
		;;
	esac
done
echo "fuzz: ${#TARGETS[@]} targets, $failed failed"
[ $failed -eq 0 ]
