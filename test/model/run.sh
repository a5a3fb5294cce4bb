#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
#
# test/model/run.sh: model-checks the wait queue protocol with spin
# (TESTPLAN T20).  Each check generates a verifier from waitq.pml (or
# waitq_mutant.pml) with some -D choices, compiles it and searches its whole
# state space; a check of a mutant passes when the verifier FAILS, since a
# model check that cannot fail proves nothing.
#
# Usage: test/model/run.sh [-l|--list] [WORKDIR]
#   WORKDIR   where the verifiers are built (default: a temporary folder)
#
# Environment: KL_MODEL_JOBS (verifiers run at once, default: the CPUs),
# KL_MODEL_TIMEOUT (seconds for one search, default 120), KL_MODEL_ONLY
# (a name, e.g. mutex-core: run that check alone).
#
# Prints a line per check and, last, "model: N checks, M failed".  Exits 0
# when every check went as expected, 1 when one did not, 2 when spin or a C
# compiler is missing.  Checks marked "note" report a finding for the lead
# to judge and never fail the run.

set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
JOBS=${KL_MODEL_JOBS:-$(nproc 2>/dev/null || echo 2)}
LIMIT=${KL_MODEL_TIMEOUT:-120}
CC=${CC:-gcc}

# NAME|EXPECT|MODE|FILE|SPIN FLAGS
#   EXPECT: pass, fail (a mutant), note (a finding: reported, not gated)
#   MODE:   safety (-DSAFETY: assertions, invalid end states) or
#           liveness (the LTL claim "every call returns", weak fairness)
# Scenario flags (see waitq.pml): DL/TOK pick the calls with a deadline
# or a cancel token (bit i-1: client i; unset: every combination), MAXQ
# the max_queue (unset: unbounded or 1), ADMIN a set_opts lowering
# max_queue to that value (-1: none; unset: none, 1 or 0).
CHECKS=(
	# Mutex: enter (fast path, QUEUED bit), hand-off, timeout, cancel,
	# abort_pending; every mix of deadlines and tokens over 3 clients.
	"mutex-core|pass|safety|waitq.pml|-DMUTEX -DMAXQ=255 -DADMIN=-1"
	# A check that may end a wait on its own (deadlock detection of the
	# key table), racing grants, timeouts and cancels.
	"mutex-check|pass|safety|waitq.pml|-DMUTEX -DCHECK -DDL=3 -DTOK=4 -DMAXQ=255 -DADMIN=-1"
	# The same races with spurious futex wake-ups.
	"mutex-spurious|pass|safety|waitq.pml|-DMUTEX -DSPURIOUS -DDL=3 -DTOK=6 -DMAXQ=255 -DADMIN=-1"
	# Overflow on entry (max_queue 1) and eviction by set_opts (to 1 or
	# 0), for each strategy.
	"mutex-this|pass|safety|waitq.pml|-DMUTEX -DOVERFLOW=0 -DDL=3 -DTOK=4"
	"mutex-first|pass|safety|waitq.pml|-DMUTEX -DOVERFLOW=1 -DDL=3 -DTOK=4"
	"mutex-last|pass|safety|waitq.pml|-DMUTEX -DOVERFLOW=2 -DDL=3 -DTOK=4"
	# Every call returns, under weak fairness.
	"mutex-liveness|pass|liveness|waitq.pml|-DMUTEX -DLIVENESS -DDL=1 -DTOK=4 -DMAXQ=255 -DADMIN=-1"
	# Reset event: the auto-reset budget (2, 1) and manual reset.
	"event-auto2|pass|safety|waitq.pml|-DEVENT -DAUTO=2 -DDL=3 -DTOK=4"
	"event-auto1|pass|safety|waitq.pml|-DEVENT -DAUTO=1 -DDL=1 -DTOK=4"
	"event-manual|pass|safety|waitq.pml|-DEVENT -DAUTO=255 -DDL=1 -DTOK=4"
	# Mutants that must fail: a cancel overriding a grant (lost lock), a
	# hand-off that forgets the wake (a waiter asleep for ever).
	"mutant-cancel|fail|safety|waitq_mutant.pml|-DMUTEX -DMAXQ=255 -DADMIN=-1"
	"mutant-nowake|fail|safety|waitq.pml|-DMUTEX -DMUTANT_NOWAKE -DDL=0 -DTOK=0 -DMAXQ=255 -DADMIN=-1"
	# A hand-off that prods the new head (wakes it early to spin) but
	# forgets that wake-up, which the new head's own grant leaves to it.
	"mutant-noprod|fail|safety|waitq.pml|-DMUTEX -DMUTANT_NOPROD -DDL=0 -DTOK=0 -DMAXQ=255 -DADMIN=-1"
	# The code before d91638b: a call takes a free mutex or a signaled
	# event after its token fired (DESIGN: "once kl_cancel_fire has
	# returned, no later grant goes to a waiter using that token").
	"mutant-cancel-take|fail|safety|waitq.pml|-DMUTEX -DMUTANT_CANCEL_TAKE -DMAXQ=255 -DADMIN=-1 -DDL=0 -DTOK=4"
	"mutant-cancel-take-event|fail|safety|waitq.pml|-DEVENT -DMUTANT_CANCEL_TAKE -DDL=0 -DTOK=4"
	# The head's spin: giving up, it parks by a plain store of PARKED,
	# hiding a grant published meanwhile (a waiter asleep for ever).
	"mutant-spin-park|fail|safety|waitq.pml|-DMUTEX -DMUTANT_SPIN_PARK -DDL=0 -DTOK=0 -DMAXQ=255 -DADMIN=-1"
	# Any waiter may spin, not only the head (the key table's shared
	# requests spin behind it), with deadlines, tokens and spurious
	# wake-ups; and the same spin-park mutant among them.
	"mutex-spin-any|pass|safety|waitq.pml|-DMUTEX -DSPIN_ANY -DSPURIOUS -DDL=3 -DTOK=4 -DMAXQ=255 -DADMIN=-1"
	"mutant-spin-any-park|fail|safety|waitq.pml|-DMUTEX -DSPIN_ANY -DMUTANT_SPIN_PARK -DDL=0 -DTOK=0 -DMAXQ=255 -DADMIN=-1"
	# The same mutant where only waiters behind the head spin: the
	# spin-any checks reach a spin behind the head that a grant ends
	# (mutant-spin-any-park fails through the head's spin already).
	"mutant-spin-behind-park|fail|safety|waitq.pml|-DMUTEX -DSPIN_ANY -DSPIN_BEHIND -DMUTANT_SPIN_PARK -DDL=0 -DTOK=0 -DMAXQ=255 -DADMIN=-1"
	"mutex-spin-behind|pass|safety|waitq.pml|-DMUTEX -DSPIN_ANY -DSPIN_BEHIND -DSPURIOUS -DDL=3 -DTOK=4 -DMAXQ=255 -DADMIN=-1"
	# The headed mark of an awake new head (a spinner behind the head
	# then keeps its CPU) made after the unlock: it can land on a waiter
	# granted meanwhile, whose frame is gone.
	"mutant-headed-late|fail|safety|waitq.pml|-DMUTEX -DSPIN_ANY -DMUTANT_HEADED_LATE -DDL=0 -DTOK=0 -DMAXQ=255 -DADMIN=-1"
	# The key table's lock modes (modes.pml): the Web Locks rule on one
	# queue, readers and a writer, then two writers and a reader; its
	# mutants: a waiter leaving by its deadline without passing the key
	# on (the kl__waiter.left hook missing), and a reader barging past
	# the queue.
	"modes-rwr|pass|safety|modes.pml|-DMODES=5"
	"modes-wrw|pass|safety|modes.pml|-DMODES=2"
	"mutant-modes-noleft|fail|safety|modes.pml|-DMODES=5 -DMUTANT_NOLEFT"
	"mutant-modes-barge|fail|safety|modes.pml|-DMODES=5 -DMUTANT_BARGE"
)

list=0
WORK=
while [ $# -gt 0 ]; do
	case $1 in
	-l | --list) list=1 ;;
	-h | --help) sed -n '4,/^$/s/^# \{0,1\}//p' "$0"; exit 0 ;;
	*) WORK=$1 ;;
	esac
	shift
done
if [ $list -eq 1 ]; then
	for c in "${CHECKS[@]}"; do
		IFS='|' read -r name expect mode file flags <<<"$c"
		printf '%-26s %-5s %-8s %s %s\n' "$name" "$expect" "$mode" "$file" "$flags"
	done
	exit 0
fi

for tool in spin "$CC"; do
	if ! command -v "$tool" >/dev/null 2>&1; then
		echo "model: $tool not found (Debian: apt-get install spin gcc)" >&2
		exit 2
	fi
done

if [ -z "$WORK" ]; then
	WORK=$(mktemp -d "${TMPDIR:-/tmp}/kl-model.XXXXXX")
	trap 'rm -rf "$WORK"' EXIT
fi
mkdir -p "$WORK"

# verify NAME MODE FILE FLAGS: builds and runs one verifier in WORK/NAME;
# writes WORK/NAME/outcome: "ok STATES SECONDS", "error WHAT" (the model
# failed) or "broken WHAT" (the check could not be made).
verify() {
	local name=$1 mode=$2 file=$3 flags=$4 dir=$WORK/$1 cflags panflags
	local start end secs states what rc=0
	rm -rf "$dir"
	mkdir -p "$dir"
	cd "$dir"
	# shellcheck disable=SC2086 # flags is a word list
	if ! spin $flags -a "$HERE/$file" >spin.log 2>&1; then
		echo "broken spin -a failed: $(tail -n 1 spin.log)" >outcome
		return 0
	fi
	if [ "$mode" = liveness ]; then
		cflags="-DNFAIR=3"
		panflags="-a -f"
	else
		cflags="-DSAFETY"
		panflags=""
	fi
	# shellcheck disable=SC2086
	if ! "$CC" -O2 -w $cflags -o pan pan.c >cc.log 2>&1; then
		echo "broken the verifier did not compile: $(tail -n 1 cc.log)" >outcome
		return 0
	fi
	start=$(date +%s.%N)
	# -m: search depth (the model's longest path is under 1100 steps);
	# -w26: a hash table of 2^26 slots from the start.
	# shellcheck disable=SC2086
	timeout "$LIMIT" ./pan -m200000 -w26 $panflags >pan.log 2>&1 || rc=$?
	end=$(date +%s.%N)
	secs=$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.1f", b - a }')
	states=$(sed -n 's/^ *\([0-9][0-9]*\) states, stored.*/\1/p' pan.log | head -n 1)
	if [ $rc -eq 124 ]; then
		echo "broken no verdict within ${LIMIT}s (KL_MODEL_TIMEOUT)" >outcome
	elif grep -q 'max search depth too small' pan.log; then
		echo "broken the search was cut short (max search depth too small)" >outcome
	elif grep -qE 'errors: [1-9]' pan.log; then
		what=$(grep -m 1 -E '^pan:[0-9]+: |^pan: ' pan.log | sed 's/^pan:[0-9]*: *//' || true)
		echo "error ${what:-errors reported} in ${secs}s" >outcome
	elif grep -q 'errors: 0' pan.log && [ $rc -eq 0 ]; then
		echo "ok ${states:-?} $secs" >outcome
	else
		echo "broken pan exited with $rc: $(tail -n 1 pan.log)" >outcome
	fi
}

# Runs the checks, JOBS at a time.
names=()
running=0
for c in "${CHECKS[@]}"; do
	IFS='|' read -r name expect mode file flags <<<"$c"
	if [ -n "${KL_MODEL_ONLY:-}" ] && [ "$name" != "$KL_MODEL_ONLY" ]; then
		continue
	fi
	names+=("$c")
	(verify "$name" "$mode" "$file" "$flags") &
	running=$((running + 1))
	if [ $running -ge "$JOBS" ]; then
		wait -n || true
		running=$((running - 1))
	fi
done
wait

checks=0
failed=0
for c in "${names[@]}"; do
	IFS='|' read -r name expect mode file flags <<<"$c"
	checks=$((checks + 1))
	out=$(cat "$WORK/$name/outcome" 2>/dev/null || echo "broken no outcome")
	kind=${out%% *}
	rest=${out#* }
	case $expect:$kind in
	pass:ok)
		read -r states secs <<<"$rest"
		echo "model: $name: PASS ($states states, 0 errors, ${secs}s)"
		;;
	fail:error)
		echo "model: $name: PASS (the mutant fails as it must: $rest)"
		;;
	fail:ok)
		echo "model: $name: FAIL (the mutant passed: the checks cannot see the bug it plants)"
		failed=$((failed + 1))
		;;
	note:error)
		echo "model: $name: NOTE (finding for the lead: $rest)"
		;;
	note:ok)
		read -r states secs <<<"$rest"
		echo "model: $name: PASS (the finding is gone: $states states, 0 errors, ${secs}s)"
		;;
	pass:error)
		echo "model: $name: FAIL ($rest)"
		echo "model: $name: trail (spin $flags -t -p $file, in $WORK/$name):"
		# shellcheck disable=SC2086
		(cd "$WORK/$name" && cp "$HERE"/*.pml . &&
			spin $flags -t -p -g "$file" 2>&1 | grep -E 'proc|assert|violated' |
			tail -n 60 | sed 's/^/    /') || true
		failed=$((failed + 1))
		;;
	*)
		echo "model: $name: FAIL ($rest)"
		failed=$((failed + 1))
		;;
	esac
done
echo "model: $checks checks, $failed failed"
[ $failed -eq 0 ]
