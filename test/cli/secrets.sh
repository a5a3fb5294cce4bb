#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# keylock(1) and the Redis password (TESTPLAN T26).  Against a private
# redis-server that requires a canary password (set in its config file,
# never on a command line), keylock runs with the password from
# KEYLOCK_REDIS_PASSWORD, then from a 0600 password_file, at default
# verbosity and with -v; while the command runs, no command line (ps -eo
# args, /proc/PID/cmdline of keylock and of its command) holds the canary,
# and with the password file neither does any environment.  The canary is
# in no message on stdout or stderr: not with the right password, not with
# a wrong one (which fails at once, exit 69, saying "authentication"), not
# with a 0644 password file (refused with exit 69, naming the mode).  A
# restricted ACL user (the commands of kl_redis_provider_open(3), or only
# those the provider sends) locks too.
#
# The environment is the user's: a password put in KEYLOCK_REDIS_PASSWORD
# is in keylock's /proc/PID/environ, readable only by the same user and
# root, and keylock passes its environment on to the command (keylock(1),
# ENVIRONMENT).  The test reports whether the command sees it and does not
# fail on it.
#
# Needs KEYLOCK_TEST_REDIS_SERVER (a redis-server binary, set by the redis
# stage of tools/test) and the redis provider; skipped (77) without them,
# so that make check starts no server.
. "$(dirname "$0")/lib.sh"

SERVER=${KEYLOCK_TEST_REDIS_SERVER:-}
[ -n "$SERVER" ] && [ -x "$SERVER" ] ||
	skip "KEYLOCK_TEST_REDIS_SERVER names no redis-server (tools/test --only redis sets it)"

CANARY=klcanary$RANDOM$RANDOM$$x$(date +%N)
WRONG=wrong-$CANARY
ACLPW=acl$CANARY
PORT=
SRV=

stop_server() {
	if [ -n "$SRV" ]; then
		kill -9 "$SRV" 2>/dev/null
		wait "$SRV" 2>/dev/null
	fi
	SRV=
}
trap 'stop_server; cleanup' EXIT

# has_canary FILE: FILE contains the canary (no process argv holds it).
has_canary() {
	local text
	text=$(tr '\0' '\n' <"$1" 2>/dev/null) || return 1
	[[ $text == *"$CANARY"* ]]
}

# redis_send CMD...: one inline command each, authenticated with the
# canary, over bash's /dev/tcp (no redis-cli, whose argv would show the
# password); prints the replies' first lines.
redis_send() {
	local cmd reply
	exec 3<>"/dev/tcp/127.0.0.1/$PORT" || return 1
	printf 'AUTH %s\r\n' "$CANARY" >&3
	IFS= read -r -t 5 reply <&3 || return 1
	for cmd in "$@"; do
		printf '%s\r\n' "$cmd" >&3
		IFS= read -r -t 5 reply <&3 || return 1
		echo "${reply%$'\r'}"
	done
	exec 3>&-
}

# The server, on a free loopback port, its password in a 0600 file.
umask 077
for try in 1 2 3 4 5 6 7 8; do
	PORT=$((20000 + RANDOM % 30000))
	if (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null; then
		continue
	fi
	printf '%s\n' "port $PORT" "bind 127.0.0.1" 'save ""' "appendonly no" \
		"dir $TMP" "logfile $TMP/redis.log" "requirepass $CANARY" \
		>"$TMP/redis.conf"
	"$SERVER" "$TMP/redis.conf" </dev/null >/dev/null 2>&1 &
	SRV=$!
	for _ in $(seq 100); do
		[ "$(redis_send PING 2>/dev/null)" = "+PONG" ] && break 2
		kill -0 "$SRV" 2>/dev/null || break
		sleep 0.05
	done
	stop_server
done
[ -n "$SRV" ] || fail "redis-server did not start (try $try)"

# The detector itself: a file holding the canary is seen.
printf 'x%sx\0' "$CANARY" >"$TMP/selftest"
has_canary "$TMP/selftest" || fail "has_canary does not see the canary"

URI="redis://127.0.0.1:$PORT/0?restart_guard=0"
export KEYLOCK_REDIS_PASSWORD=
unset KEYLOCK_REDIS_PASSWORD

kl -p "$URI" -n probe -- true
if [ "$rc" -ne 0 ] && grep -q "not installed" "$ERR"; then
	skip "the redis provider is not built"
fi
# Without a password: refused, and it says so.
expect_rc 69 "no password"
grep -qi "password" "$ERR" || fail "no password: the message does not say so"

# no_canary WHAT FILE...: the canary is in none of these files.
no_canary() {
	local what=$1 f
	shift
	for f in "$@"; do
		! has_canary "$f" || fail "$what: the canary is in ${f##*/}"
	done
}

# run_held WHAT ENVCHECK ARGS...: keylock ARGS -- a command that records
# its pid and sleeps; while it runs, the command lines (and with
# ENVCHECK=1 the environments) of keylock and the command and ps -eo args
# do not hold the canary; then it exits 0 and printed no canary.
run_held() {
	local what=$1 envcheck=$2 kpid cpid fd
	shift 2
	rm -f "$TMP/cmd.pid"
	"$KEYLOCK" "$@" -- sh -c 'echo $$ >"$0.tmp"; mv "$0.tmp" "$0"; exec sleep 2' \
		"$TMP/cmd.pid" >"$OUT" 2>"$ERR" &
	kpid=$!
	BG+=("$kpid")
	for _ in $(seq 400); do
		[ -s "$TMP/cmd.pid" ] && break
		kill -0 "$kpid" 2>/dev/null || break
		sleep 0.05
	done
	[ -s "$TMP/cmd.pid" ] || {
		wait_exit "$kpid"
		fail "$what: the command did not start (keylock exit $rc)"
	}
	cpid=$(cat "$TMP/cmd.pid")
	ps -eo args >"$TMP/ps.txt"
	ps -o args= -p "$kpid" -p "$cpid" >"$TMP/ps-own.txt"
	grep -q . "$TMP/ps-own.txt" || fail "$what: ps shows neither process"
	no_canary "$what" "$TMP/ps.txt" "$TMP/ps-own.txt" \
		"/proc/$kpid/cmdline" "/proc/$cpid/cmdline"
	if [ "$envcheck" = 1 ]; then
		no_canary "$what (environment)" "/proc/$kpid/environ" \
			"/proc/$cpid/environ"
	elif has_canary "/proc/$cpid/environ"; then
		echo "NOTE: $what: the command inherits KEYLOCK_REDIS_PASSWORD (keylock passes its environment on)"
	fi
	# No descriptor of the command leads to the password file.
	for fd in "/proc/$cpid/fd/"*; do
		case $(readlink "$fd" 2>/dev/null) in
		"$TMP"/pw*) fail "$what: the command inherited the password file's descriptor" ;;
		esac
	done
	wait_exit "$kpid"
	expect_rc 0 "$what"
	no_canary "$what (output)" "$OUT" "$ERR"
}

# 1. KEYLOCK_REDIS_PASSWORD, quiet and verbose.
export KEYLOCK_REDIS_PASSWORD=$CANARY
run_held "password from the environment" 0 -p "$URI" -w 10s envkey
run_held "password from the environment, -v" 0 -p "$URI" -v -w 10s envkey
grep -q . "$ERR" || fail "-v printed nothing"
kl -p "$URI" -v status envkey
expect_rc 0 "status with the password"
no_canary "status" "$OUT" "$ERR"

# 2. A 0600 password file, with no password in the environment.
unset KEYLOCK_REDIS_PASSWORD
printf '%s\n' "$CANARY" >"$TMP/pw"
chmod 600 "$TMP/pw"
FURI="$URI&password_file=$TMP/pw"
run_held "password file" 1 -p "$FURI" -w 10s filekey
run_held "password file, -v" 1 -p "$FURI" -v -w 10s filekey

# 3. A wrong password: fails at once with an authentication error.
for how in env file; do
	for v in "" -v; do
		start=$(now_ms)
		if [ $how = env ]; then
			KEYLOCK_REDIS_PASSWORD=$WRONG kl -p "$URI" $v -w 10s k -- true
		else
			printf '%s\n' "$WRONG" >"$TMP/pw-wrong"
			chmod 600 "$TMP/pw-wrong"
			kl -p "$URI&password_file=$TMP/pw-wrong" $v -w 10s k -- true
		fi
		took=$(($(now_ms) - start))
		expect_rc 69 "wrong password ($how $v)"
		grep -qi "auth" "$ERR" || fail "wrong password ($how $v): no 'auth' in the message"
		no_canary "wrong password ($how $v)" "$OUT" "$ERR"
		[ "$took" -lt 1000 ] || fail "wrong password ($how $v): took ${took} ms"
		echo "wrong password ($how${v:+ $v}): exit $rc in ${took} ms: $(head -n 1 "$ERR")"
	done
done

# 3b. A password in the URI (which the user's own command line shows, as
# keylock(1) warns): still in no message, right, wrong or malformed.
for v in "" -v; do
	kl -p "redis://:$CANARY@127.0.0.1:$PORT/0?restart_guard=0" $v -w 10s urikey -- true
	expect_rc 0 "password in the URI $v"
	no_canary "password in the URI $v" "$OUT" "$ERR"
	kl -p "redis://:$WRONG@127.0.0.1:$PORT/0?restart_guard=0" $v -w 10s urikey -- true
	expect_rc 69 "wrong password in the URI $v"
	no_canary "wrong password in the URI $v" "$OUT" "$ERR"
	kl -p "redis://:$CANARY@127.0.0.1:x$PORT/0" $v -w 10s urikey -- true
	expect_rc 64 "malformed URI with a password $v"
	no_canary "malformed URI with a password $v" "$OUT" "$ERR"
	kl -p "redis://:$CANARY@127.0.0.1:$PORT/0?nosuchoption=$CANARY" $v status urikey
	[ "$rc" -ne 0 ] || fail "an unknown URI option was accepted"
	no_canary "unknown URI option $v" "$OUT" "$ERR"
done
echo "unknown URI option: $(head -n 1 "$ERR")"

# 4. A 0644 password file: refused, naming the problem, in any case.
printf '%s\n' "$CANARY" >"$TMP/pw-open"
chmod 644 "$TMP/pw-open"
for v in "" -v; do
	kl -p "$URI&password_file=$TMP/pw-open" $v -w 10s k -- touch "$TMP/ran"
	expect_rc 69 "0644 password file $v"
	grep -q "password file.*mode 0644" "$ERR" ||
		fail "0644 password file: the message does not name the mode"
	no_canary "0644 password file" "$OUT" "$ERR"
	[ ! -e "$TMP/ran" ] || fail "0644 password file: the command ran"
done
echo "0644 password file: $(head -n 1 "$ERR")"

# 5. Restricted ACL users: the rule of kl_redis_provider_open(3), then only
# the commands the provider sends (src/redis/redis_conn.c, redis_scripts.c,
# redis_guard.c, redis_wait.c) and its key prefix.
acl_user() {
	local user=$1 rules=$2 reply
	reply=$(redis_send "ACL SETUSER $user reset on >$ACLPW $rules") ||
		fail "ACL SETUSER $user: no reply"
	[ "$reply" = "+OK" ] || fail "ACL SETUSER $user: $reply"
}
acl_user locker "~keylock:* +@read +@write +@scripting +info +time +select"
acl_user minimal "~keylock:* -@all +auth +hello +select +info +eval +evalsha +script|load +blpop +time +get +set +incr +del +exists +hget +hmget +hset +hdel +llen +lpush +pexpire +pttl +zadd +zrange +zrank +zrem +zscore"
acl_user nokeys "resetkeys ~other:* +@all"
unset KEYLOCK_REDIS_PASSWORD
printf '%s\n' "$ACLPW" >"$TMP/pw-acl"
for user in locker minimal; do
	AURI="redis://$user@127.0.0.1:$PORT/0?restart_guard=0&password_file=$TMP/pw-acl"
	kl -p "$AURI" -w 10s aclkey -- true
	expect_rc 0 "ACL user $user"
	kl -p "$AURI" -n aclkey -- true
	expect_rc 0 "ACL user $user, -n"
	# A held key makes a second one give up: the scripts run.
	run_held "ACL user $user" 1 -p "$AURI" -w 10s aclheld
	no_canary "ACL user $user" "$OUT" "$ERR"
done
# A user whose keys do not include the prefix: refused, no canary.
kl -p "redis://nokeys@127.0.0.1:$PORT/0?restart_guard=0&password_file=$TMP/pw-acl" \
	-w 2s aclkey -- touch "$TMP/ran"
[ "$rc" -ne 0 ] || fail "an ACL user without the key prefix could lock"
[ ! -e "$TMP/ran" ] || fail "ACL user without the keys: the command ran"
no_canary "ACL user without the keys" "$OUT" "$ERR"
echo "ACL user without the keys: exit $rc: $(head -n 1 "$ERR")"

# The server's log holds no canary either (it never logs passwords).
no_canary "redis.log" "$TMP/redis.log"
echo "PASS: secrets"
exit 0
