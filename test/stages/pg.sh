# SPDX-License-Identifier: MIT
# test/stages/pg.sh: stage pg of tools/test, sourced after
# test/stages/lib.sh.

# The PostgreSQL provider's suite (test/pg/check_provider_pg, which the check
# stage skips for want of a server) against a throwaway cluster: made with
# initdb in a temporary folder as the unprivileged user postgres (or
# nobody), listening on 127.0.0.1 only, on a free port, with trust
# authentication except for one role that must give its password (scram),
# for the authentication tests.  The EXIT trap of the stage's subshell
# stops the server and removes the folder whatever happens.  The stage
# fails when the suite did not run and pass, and when libkeylock-pg.so
# exports anything but src/libkeylock-pg.sym.
PG_BIN=/usr/lib/postgresql/15/bin
PG_TMP=
PG_USER=postgres
pg_as() {
	if [ "$(id -u)" -eq 0 ]; then
		runuser -u "$PG_USER" -- "$@"
	else
		"$@"
	fi
}
pg_stop() {
	[ -n "$PG_TMP" ] || return 0
	if [ -f "$PG_TMP/data/postmaster.pid" ]; then
		pg_as "$PG_BIN/pg_ctl" -D "$PG_TMP/data" -m immediate -w -t 30 \
			stop >/dev/null 2>&1 ||
			kill -9 "$(head -n 1 "$PG_TMP/data/postmaster.pid")" \
				2>/dev/null || true
	fi
	rm -rf "$PG_TMP"
	PG_TMP=
}
# pg_tls_files DIR: ca.crt, server.crt and server.key (signed by that CA,
# for 127.0.0.1 and localhost), and wrong-ca.crt, a CA that signed nothing.
pg_tls_files() {
	local d=$1 ca="-addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign"
	# shellcheck disable=SC2086
	openssl req -x509 -newkey rsa:2048 -nodes -days 2 $ca \
		-subj "/CN=keylock test CA" -keyout "$d/ca.key" -out "$d/ca.crt" &&
	openssl req -x509 -newkey rsa:2048 -nodes -days 2 $ca \
		-subj "/CN=keylock test CA" -keyout "$d/wrong-ca.key" \
		-out "$d/wrong-ca.crt" &&
	openssl req -newkey rsa:2048 -nodes -subj "/CN=localhost" \
		-keyout "$d/server.key" -out "$d/server.csr" &&
	printf '%s\n' 'subjectAltName=DNS:localhost,IP:127.0.0.1' \
		'basicConstraints=CA:FALSE' 'extendedKeyUsage=serverAuth' \
		>"$d/server.ext" &&
	openssl x509 -req -in "$d/server.csr" -CA "$d/ca.crt" \
		-CAkey "$d/ca.key" -CAcreateserial -days 2 \
		-extfile "$d/server.ext" -out "$d/server.crt" &&
	chmod 600 "$d/server.key"
}
stage_pg() {
	local port="" try pw=keylock-auth-test base want got rc=0
	local psql_args opts start
	if [ ! -x "$PG_BIN/initdb" ] || ! command -v openssl >/dev/null ||
		! dpkg-query -W -f='${Status}' \
		libpq-dev 2>/dev/null | grep -q 'install ok installed'; then
		if [ "$(id -u)" -ne 0 ]; then
			say "error: stage pg needs postgresql, libpq-dev and openssl; as root: apt-get install postgresql postgresql-contrib libpq-dev openssl" >&2
			return 1
		fi
		apt-get update -q </dev/null
		apt-get install -y -q postgresql postgresql-contrib libpq-dev \
			openssl </dev/null
	fi
	ensure_plain
	# A tree configured before libpq-dev was there has no provider.
	[ -f "$PLAIN/src/libkeylock-pg.la" ] || build_plain
	mk "$PLAIN" src/libkeylock.la src/libkeylock-pg.la
	want=$(sed '/^$/d' "$ROOT/src/libkeylock-pg.sym" | LC_ALL=C sort -u)
	got=$(nm -D --defined-only "$PLAIN/src/.libs/libkeylock-pg.so" |
		awk '$2 ~ /^[TDBR]$/ { sub(/@.*/, "", $3); print $3 }' |
		LC_ALL=C sort -u)
	if [ "$want" != "$got" ]; then
		say "error: libkeylock-pg.so does not export exactly src/libkeylock-pg.sym:" >&2
		diff <(echo "$want") <(echo "$got") >&2 || true
		return 1
	fi

	id -u "$PG_USER" >/dev/null 2>&1 || PG_USER=nobody
	PG_TMP=$(mktemp -d "${TMPDIR:-/tmp}/keylock-pg.XXXXXX")
	at_exit pg_stop
	chmod 700 "$PG_TMP"
	[ "$(id -u)" -ne 0 ] || chown "$PG_USER" "$PG_TMP"
	if ! pg_as "$PG_BIN/initdb" -D "$PG_TMP/data" -U postgres -A trust \
		--no-sync >"$PG_TMP/initdb.log" 2>&1; then
		cat "$PG_TMP/initdb.log"
		return 1
	fi
	# A throwaway CA and a server certificate for 127.0.0.1 and
	# localhost, for the sslmode=verify-full test; and a CA that did
	# not sign it, which must be refused.
	if ! pg_tls_files "$PG_TMP" >"$PG_TMP/openssl.log" 2>&1; then
		cat "$PG_TMP/openssl.log" >&2
		return 1
	fi
	[ "$(id -u)" -ne 0 ] || chown "$PG_USER" "$PG_TMP/server.key"
	printf '%s\n' 'local all all trust' \
		'host all keylock_auth 127.0.0.1/32 scram-sha-256' \
		'host all all 127.0.0.1/32 trust' >"$PG_TMP/data/pg_hba.conf"
	for try in 1 2 3 4 5 6 7 8; do
		port=$((20000 + RANDOM % 30000))
		# Something answers there already: try another.
		if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
			port=""
			continue
		fi
		# wal_writer_delay 10 s: advances of the fence sequence
		# drawn without a flush stay unwritten until a crash test
		# loses them.
		opts="-c listen_addresses=127.0.0.1 -p $port -k $PG_TMP -c fsync=off -c full_page_writes=off -c max_connections=200 -c wal_writer_delay=10000 -c ssl=on -c ssl_cert_file=$PG_TMP/server.crt -c ssl_key_file=$PG_TMP/server.key"
		pg_as "$PG_BIN/pg_ctl" -D "$PG_TMP/data" -l "$PG_TMP/server.log" \
			-w -t 60 -o "$opts" start >/dev/null && break
		port=""
	done
	if [ -z "$port" ]; then
		say "error: the PostgreSQL server did not start (try $try):" >&2
		tail -n 20 "$PG_TMP/server.log" >&2 || true
		return 1
	fi
	say "$("$PG_BIN/postgres" --version) on 127.0.0.1:$port in $PG_TMP"
	psql_args=(-h 127.0.0.1 -p "$port" -U postgres -v ON_ERROR_STOP=1 -qAt)
	"$PG_BIN/psql" "${psql_args[@]}" -d postgres \
		-c "CREATE DATABASE keylock" \
		-c "CREATE ROLE keylock_auth LOGIN PASSWORD '$pw'"
	# The fence sequence made as kl_pg_provider_open(3) says, for the
	# role with a password too.
	"$PG_BIN/psql" "${psql_args[@]}" -d keylock \
		-c "GRANT CREATE ON SCHEMA public TO keylock_auth" \
		-c "CREATE SEQUENCE public.keylock_fence" \
		-c "GRANT USAGE, UPDATE ON SEQUENCE public.keylock_fence TO keylock_auth"
	base=127.0.0.1:$port/keylock
	export KEYLOCK_TEST_PG_URI=postgresql://postgres@$base
	export KEYLOCK_TEST_PG_AUTH_URI=postgresql://keylock_auth:$pw@$base
	export KEYLOCK_TEST_PG_SSL_CA=$PG_TMP/ca.crt
	export KEYLOCK_TEST_PG_SSL_WRONG_CA=$PG_TMP/wrong-ca.crt
	# For the suite's server restart (TESTPLAN T24 f): pg_ctl stop -m
	# immediate, then start with the same options, as the user the
	# server runs as (empty: this one).
	export KEYLOCK_TEST_PG_CTL=$PG_BIN/pg_ctl
	export KEYLOCK_TEST_PG_DATA=$PG_TMP/data
	export KEYLOCK_TEST_PG_LOG=$PG_TMP/server.log
	export KEYLOCK_TEST_PG_OPTS=$opts
	KEYLOCK_TEST_PG_RUNAS=
	[ "$(id -u)" -ne 0 ] || KEYLOCK_TEST_PG_RUNAS=$PG_USER
	export KEYLOCK_TEST_PG_RUNAS

	# Only what the suite needs, so that another suite that does not
	# build does not stop this one (the check stage reports it).
	mk "$PLAIN" src/libkeylock.la src/libkeylock-pg.la \
		test/pg/check_provider_pg test/pg/pg_helper || rc=$?
	# The harness's rule for the one log (check-TESTS would build every
	# check program); the .trs tells the result.
	rm -f "$PLAIN/test/pg/check_provider_pg.log" \
		"$PLAIN/test/pg/check_provider_pg.trs"
	start=$SECONDS
	progress "pg: test/pg/check_provider_pg: started"
	[ "$rc" -ne 0 ] || mk "$PLAIN" test/pg/check_provider_pg.log || rc=$?
	cat "$PLAIN/test/pg/check_provider_pg.log" 2>/dev/null || true
	progress_done "pg: test/pg/check_provider_pg" \
		"$PLAIN/test/pg/check_provider_pg.trs" "$start"
	tally "$PLAIN"
	if ! grep -q '^:test-result: PASS' \
		"$PLAIN/test/pg/check_provider_pg.trs" 2>/dev/null; then
		say "error: test/pg/check_provider_pg did not run and pass" >&2
		[ "$rc" -ne 0 ] || rc=1
	fi
	progress "pg: test/cli/conflict.sh, fifo.sh and remote_modes.sh, keylock-bench provider --quick"
	cli_remote "$KEYLOCK_TEST_PG_URI" || rc=1
	bench_provider "$KEYLOCK_TEST_PG_URI" || rc=1
	return $rc
}
