# SPDX-License-Identifier: MIT
# test/stages/redis.sh: stage redis of tools/test, sourced after
# test/stages/lib.sh.

# cli_secrets: test/cli/secrets.sh (TESTPLAN T26: the Redis password in no
# command line or message, wrong password, 0644 file, ACL users) against
# its own redis-server (KEYLOCK_TEST_REDIS_SERVER); one test, added to the
# stage's counts.
cli_secrets() {
	local rc=0 s1 t1 f1 k1
	mk "$PLAIN" tools/keylock src/libkeylock-redis.la
	(cd "$PLAIN" && top_builddir=$PLAIN bash "$ROOT/test/cli/secrets.sh") ||
		rc=$?
	[ "$rc" -eq 0 ] || say "error: test/cli/secrets.sh failed (exit $rc)" >&2
	read -r s1 t1 f1 k1 <"$STAGE_RESULT"
	echo "$s1 $((t1 + 1)) $((f1 + (rc != 0))) $k1" >"$STAGE_RESULT"
	return $rc
}

# The Redis provider's suite (test/redis/check_provider_redis, which the check
# stage skips for want of a server) against a throwaway redis-server: no
# persistence, 127.0.0.1 only, a free port, a temporary folder.  The suite
# kills the server and starts it again on the same port (its restart
# test), so the stage also stops whatever server the pidfile names, after
# checking that it is a redis-server on that port.  The EXIT trap of the
# stage's subshell stops the server and removes the folder whatever
# happens.  The stage fails when the suite did not run and pass.
REDIS_TMP=
REDIS_PID=
REDIS_PORT=
redis_stop() {
	local pid i
	[ -n "$REDIS_TMP" ] || return 0
	for pid in "$REDIS_PID" "$(cat "$REDIS_TMP/redis.pid" 2>/dev/null)"; do
		[ -n "$pid" ] || continue
		grep -qa "redis-server.*:$REDIS_PORT" "/proc/$pid/cmdline" \
			2>/dev/null || continue
		kill -9 "$pid" 2>/dev/null || true
	done
	for i in $(seq 100); do
		[ -n "$REDIS_PID" ] && [ -d "/proc/$REDIS_PID" ] || break
		sleep 0.05
	done
	rm -rf "$REDIS_TMP"
	REDIS_TMP=
}
# redis_ping PORT: whether a Redis server answers PING there.
redis_ping() {
	(
		exec 3<>"/dev/tcp/127.0.0.1/$1" || exit 1
		printf 'PING\r\n' >&3
		IFS= read -r -t 2 reply <&3 || exit 1
		[ "${reply%$'\r'}" = "+PONG" ]
	) 2>/dev/null
}
stage_redis() {
	local server try i rc=0 brc=0 log suite start
	if ! command -v redis-server >/dev/null 2>&1 ||
		! command -v openssl >/dev/null 2>&1 ||
		! dpkg-query -W -f='${Status}' libhiredis-dev libssl-dev \
			2>/dev/null | grep -c 'install ok installed' |
			grep -qx 2; then
		if [ "$(id -u)" -ne 0 ]; then
			say "error: stage redis needs redis-server, libhiredis-dev, libssl-dev and openssl; as root: apt-get install redis-server libhiredis-dev libssl-dev openssl" >&2
			return 1
		fi
		apt-get update -q </dev/null
		apt-get install -y -q redis-server libhiredis-dev libssl-dev \
			openssl </dev/null
	fi
	server=$(command -v redis-server)
	ensure_plain
	# A tree configured before libhiredis-dev (or libssl-dev: TLS) was
	# there has no provider (or no TLS in it).
	[ -f "$PLAIN/src/libkeylock-redis.la" ] &&
		grep -q '^#define HAVE_REDIS_TLS 1' "$PLAIN/config.h" ||
		build_plain

	REDIS_TMP=$(mktemp -d "${TMPDIR:-/tmp}/keylock-redis.XXXXXX")
	at_exit redis_stop
	chmod 700 "$REDIS_TMP"
	for try in 1 2 3 4 5 6 7 8; do
		REDIS_PORT=$((20000 + RANDOM % 30000))
		# Something answers there already: try another.
		if (exec 3<>"/dev/tcp/127.0.0.1/$REDIS_PORT") 2>/dev/null; then
			continue
		fi
		"$server" --port "$REDIS_PORT" --bind 127.0.0.1 --save '' \
			--appendonly no --daemonize no --dir "$REDIS_TMP" \
			--pidfile "$REDIS_TMP/redis.pid" \
			--logfile "$REDIS_TMP/redis.log" </dev/null \
			>/dev/null 2>&1 &
		REDIS_PID=$!
		# The suite kills it: no job report of that in the log.
		disown "$REDIS_PID"
		for i in $(seq 100); do
			redis_ping "$REDIS_PORT" && break 2
			kill -0 "$REDIS_PID" 2>/dev/null || break
			sleep 0.05
		done
		kill -9 "$REDIS_PID" 2>/dev/null || true
		REDIS_PID=
	done
	if [ -z "$REDIS_PID" ]; then
		say "error: redis-server did not start (try $try):" >&2
		tail -n 20 "$REDIS_TMP/redis.log" >&2 || true
		return 1
	fi
	say "$("$server" --version | head -n 1) on 127.0.0.1:$REDIS_PORT in $REDIS_TMP"
	export KEYLOCK_TEST_REDIS_URI=redis://127.0.0.1:$REDIS_PORT/0
	export KEYLOCK_TEST_REDIS_PORT=$REDIS_PORT
	export KEYLOCK_TEST_REDIS_SERVER=$server
	export KEYLOCK_TEST_REDIS_DIR=$REDIS_TMP

	# Only what the suite needs; the harness's rule for its one log
	# (AM_TESTS_ENVIRONMENT sets KEYLOCK_PROVIDER_DIR), whose .trs tells
	# the result.
	# check_redis_chaos (TESTPLAN T21-T23) and check_redis_tls run
	# redis-servers of their own (KEYLOCK_TEST_REDIS_SERVER) on free
	# ports in folders of their own.
	mk "$PLAIN" src/libkeylock.la src/libkeylock-redis.la \
		test/redis/check_provider_redis test/redis/check_redis_chaos \
		test/redis/check_redis_tls test/redis/redis_helper || brc=$?
	rc=$brc
	for suite in check_provider_redis check_redis_chaos check_redis_tls; do
		log=$PLAIN/test/redis/$suite
		rm -f "$log.log" "$log.trs"
		start=$SECONDS
		progress "redis: test/redis/$suite: started"
		[ "$brc" -ne 0 ] || mk "$PLAIN" "test/redis/$suite.log" || rc=1
		cat "$log.log" 2>/dev/null || true
		progress_done "redis: test/redis/$suite" "$log.trs" "$start"
	done
	tally "$PLAIN"
	for suite in check_provider_redis check_redis_chaos check_redis_tls; do
		if ! grep -q '^:test-result: PASS' \
			"$PLAIN/test/redis/$suite.trs" 2>/dev/null; then
			say "error: test/redis/$suite did not run and pass" >&2
			[ "$rc" -ne 0 ] || rc=1
		fi
	done
	progress "redis: test/cli/conflict.sh, fifo.sh and remote_modes.sh, keylock-bench provider --quick, test/cli/secrets.sh"
	cli_remote "$KEYLOCK_TEST_REDIS_URI?restart_guard=0" || rc=1
	bench_provider "$KEYLOCK_TEST_REDIS_URI?restart_guard=0" || rc=1
	cli_secrets || rc=1
	return $rc
}
