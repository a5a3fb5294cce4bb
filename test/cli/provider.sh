#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# keylock(1): provider failures exit 69 and never print a password; a URI
# the library cannot read is a usage error (64).
. "$(dirname "$0")/lib.sh"

SECRET=Zq7secretPw

kl -p "nosuch:thing" k -- true
expect_usage "an unknown scheme"
grep -q "nosuch" "$ERR" || fail "unknown scheme: not named"
kl -p "no scheme at all" k -- true
expect_usage "a URI without a scheme"

# Not built, not installed or not reachable (port 1 refuses): 69 in every
# case, with the scheme named and the password nowhere.
for uri in "redis://user:$SECRET@127.0.0.1:1/0" \
	"postgresql://user:$SECRET@127.0.0.1:1/db?connect_timeout=2"; do
	scheme=${uri%%:*}
	for args in "k -- true" "status k"; do
		# shellcheck disable=SC2086
		KEYLOCK_REDIS_PASSWORD=$SECRET kl -p "$uri" -w 2 $args
		expect_rc 69 "$scheme ($args)"
		grep -q "$scheme" "$ERR" || fail "$scheme ($args): scheme not named"
		if grep -q "$SECRET" "$OUT" "$ERR"; then
			fail "$scheme ($args): the password was printed"
		fi
	done
done

# A local: directory that cannot be made.
kl -p "local:/dev/null/state" k -- true
expect_rc 69 "local: under a file"
grep -q "^keylock: " "$ERR" || fail "local: under a file: no message"
exit 0
