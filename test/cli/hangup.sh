#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# keylock(1) as the leader of a session on a terminal (`ssh -t host
# keylock ...`): when the terminal hangs up, the kernel sends SIGHUP to
# keylock alone; the command must get it too, as it would under flock(1),
# and the key must be free once the command has exited (issue 15, item 9).
. "$(dirname "$0")/lib.sh"
need_local
need_pty_run

# The command records whether it is in the terminal's foreground, then a
# SIGHUP, and exits 3; without one it gives up after 60 s and exits 0.
cat >"$TMP/hupper" <<'EOS'
dir=$1
trap 'touch "$dir/hup"; exit 3' HUP
# Fields 5 and 8 of stat: the process group and the terminal's foreground
# process group.
read -r -a st <"/proc/$$/stat"
if [ "${st[4]}" = "${st[7]}" ]; then echo yes; else echo no; fi >"$dir/fg"
touch "$dir/started"
. "$dir/naps"
naps 1200
exit 0
EOS

# env --default-signal: a background job of a shell without job control
# would start with SIGINT and SIGQUIT ignored.
rc=0
"$PTY_RUN" "$TMP/started" hangup -- env --default-signal \
	"$KEYLOCK" "${P[@]}" k -- bash "$TMP/hupper" "$TMP" >"$OUT" 2>"$ERR" ||
	rc=$?
[ "$rc" -eq 0 ] || fail "pty_run exited with $rc"
[ -e "$TMP/hup" ] || fail "the command did not get SIGHUP on hangup ($(cat "$OUT"))"
[ "$(cat "$OUT")" = "exit 3" ] ||
	fail "keylock after the hangup: $(cat "$OUT"), expected exit 3"
kl "${P[@]}" -n k -- true
expect_rc 0 "the key after the hangup"

# The command had the terminal (its process group in the foreground), so
# that it can read it: keylock hands it over.
[ "$(cat "$TMP/fg")" = yes ] || fail "the command was not in the terminal's foreground"
exit 0
