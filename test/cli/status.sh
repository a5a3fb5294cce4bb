#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# keylock status [KEY]: holders and waiters as the provider tells them,
# by mode where it can list its locks (test/cli/shared.sh, list.sh).
. "$(dirname "$0")/lib.sh"
need_local

kl "${P[@]}" status k
expect_rc 0 "status of a free key"
grep -qx "key: k" "$OUT" || fail "status: no key line"
grep -qx "holders: 0" "$OUT" || fail "status of a free key: holders"
grep -qx "queue: 0" "$OUT" || fail "status of a free key: queue"
grep -qx "provider: local" "$OUT" || fail "status: provider"

hold k h
kl "${P[@]}" status k
grep -qx "holders: 1" "$OUT" || fail "status of a held key: holders"
grep -qx "queue: 0" "$OUT" || fail "status of a held key: queue"
bg "$KEYLOCK" "${P[@]}" k -- true
waiter=$!
wait_queue k 1
holders_is k 1 || fail "status with a waiter: holders"
release h
wait_exit "$waiter"
expect_rc 0 "the waiter"
wait_until 20 "the key to be free" holders_is k 0
queue_is k 0 || fail "status after all left: queue"

# The modes: unknown where the provider cannot list its locks.
if can_list; then
	status_is k "shared holders" 0 || fail "status: shared holders"
	status_is k "exclusive waiters" 0 || fail "status: exclusive waiters"
	want_keys=0
else
	status_is k "shared holders" unknown || fail "status: shared holders"
	status_is k "exclusive waiters" unknown || fail "status: exclusive waiters"
	want_keys=unknown
fi

# Every key: how many, where the provider can list them.
kl "${P[@]}" status
expect_rc 0 "status without a key"
grep -qx "keys: $want_keys" "$OUT" || fail "status without a key: output"

# A key that cannot be printed as it is.
kl "${P[@]}" status "$(printf 'a\nb')"
expect_rc 0 "status of a key with a newline"
[ "$(grep -c '^key: ' "$OUT")" -eq 1 ] || fail "the newline was printed"
exit 0
