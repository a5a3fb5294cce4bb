#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# keylock(1) in an interactive shell on a terminal.  The command runs in a
# process group of its own (so that a signal sent to keylock's group
# reaches it once, issue 15 item 10), so keylock must do what a shell does
# for it: hand it the terminal, follow Ctrl-Z, fg and bg, and give the
# terminal back.  Every step waits for a file, never for a time.
. "$(dirname "$0")/lib.sh"
need_local
need_pty_run

KL="$KEYLOCK ${P[*]}"

# c1 reads a line from the terminal (it can only if it has it), then
# sleeps; it records a SIGCONT, and exits 130 on SIGINT (a trap, so that
# a SIGINT during the other trap is not lost).
cat >"$TMP/c1" <<'EOS'
dir=$1
trap 'touch "$dir/c1.cont"' CONT
trap 'kill $! 2>/dev/null; exit 130' INT
touch "$dir/c1.started"
read -r x
echo "$x" >"$dir/c1.got"
sleep 120 &
while :; do wait $!; done
EOS
# c2 reads the terminal only once told to, when keylock is in the
# background: it is stopped (SIGTTIN), and keylock with it.
cat >"$TMP/c2" <<'EOS'
dir=$1
touch "$dir/c2.started"
while [ ! -e "$dir/c2.go" ]; do sleep 0.05; done
read -r x
echo "$x" >"$dir/c2.got"
EOS

T=$TMP
cat >"$TMP/input" <<EOF2
send $KL k -- bash $T/c1 $T\\n
wait $T/c1.started
send hello\\n
wait $T/c1.got
send \\x1a
send jobs -l >$T/jobs1; touch $T/jobs1.done\\n
wait $T/jobs1.done
wait $T/probe1.done
send fg\\n
wait $T/c1.cont
send \\x03
send echo \$? >$T/rc1\\n
wait $T/rc1
wait $T/probe2.done
send $KL k -- bash $T/c2 $T & echo \$! >$T/kpid\\n
wait $T/c2.started
wait $T/kpid
wait $T/stopped2
send fg\\n
send world\\n
wait $T/c2.got
send echo \$? >$T/rc2\\n
wait $T/rc2
send exit\\n
EOF2

state() {
	local st
	read -r -a st <"/proc/$1/stat" 2>/dev/null || return 1
	[ "${st[2]}" = "$2" ]
}

rc=0
PTY_RUN_INPUT=$TMP/input PS1='$ ' "$PTY_RUN" "$TMP/never" - -- \
	env --default-signal bash --norc --noprofile -i >"$OUT" 2>"$ERR" &
BG+=($!)
ptyrun=$!

# Ctrl-Z stopped the job: keylock still holds the key.
wait_file "$TMP/jobs1.done"
grep -q Stopped "$TMP/jobs1" || fail "Ctrl-Z: the job is not stopped: $(cat "$TMP/jobs1")"
[ "$(cat "$TMP/c1.got")" = hello ] || fail "the command did not read the terminal"
kl "${P[@]}" -n k -- true
expect_rc 75 "the key while the job is stopped"
touch "$TMP/probe1.done"

# fg continued the command, Ctrl-C ended it: 130, and the key is free.
wait_file "$TMP/rc1"
[ "$(cat "$TMP/rc1")" = 130 ] || fail "Ctrl-C: keylock exited $(cat "$TMP/rc1"), expected 130"
kl "${P[@]}" -n k -- true
expect_rc 0 "the key after Ctrl-C"
touch "$TMP/probe2.done"

# Started in the background, the command stops when it reads the
# terminal, and keylock stops with it; fg gives it the terminal.
wait_file "$TMP/kpid"
touch "$TMP/c2.go"
wait_until 20 "keylock to stop with its command" state "$(cat "$TMP/kpid")" T
touch "$TMP/stopped2"
wait_file "$TMP/rc2"
[ "$(cat "$TMP/c2.got")" = world ] || fail "fg: the command did not read the terminal"
[ "$(cat "$TMP/rc2")" = 0 ] || fail "fg: keylock exited $(cat "$TMP/rc2")"

wait_exit "$ptyrun"
expect_rc 0 "pty_run"
[ "$(cat "$OUT")" = "exit 0" ] || fail "the shell: $(cat "$OUT")"
exit 0
