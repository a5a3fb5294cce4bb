#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# keylock(1) run by a shell script on a terminal, where keylock shares the
# script's process group (no job control): the terminal stays with that
# group, so that Ctrl-C still reaches the script and ends it, and a keylock
# in the script's background does not take the terminal from it; a command
# that reads the terminal gets it when it does.  In a pipeline of an
# interactive shell (keylock ... | less), the terminal stays with the
# pipeline's group, where the pager reads it.  And keylock started with
# SIGCHLD ignored still reports its command's exit status.
. "$(dirname "$0")/lib.sh"
need_local
need_pty_run
command -v perl >/dev/null || skip "perl is missing"

# An ignored SIGCHLD has the kernel reap the command: keylock used to exit
# 71 ("cannot wait for the command") and lose 3 and 127.
kl_ign() {
	rc=0
	perl -e '$SIG{CHLD} = "IGNORE"; exec @ARGV or exit 99' \
		"$KEYLOCK" "$@" >"$OUT" 2>"$ERR" || rc=$?
}
kl_ign "${P[@]}" k -- sh -c 'exit 3'
expect_rc 3 "the command's status with SIGCHLD ignored"
kl_ign "${P[@]}" k -- "$TMP/missing"
expect_rc 127 "a missing command with SIGCHLD ignored"
# The command still starts with SIGCHLD ignored, as without keylock.
kl_ign "${P[@]}" k -- grep '^SigIgn:' /proc/self/status
expect_rc 0 "grep"
read -r _ ign <"$OUT"
(((0x$ign >> ($(kill -l CHLD) - 1)) & 1)) || fail "SIGCHLD was not ignored for the command ($ign)"

KL="$KEYLOCK ${P[*]}"
T=$TMP
# s1: Ctrl-C while keylock runs in the foreground of a script ends the
# script (bash ends a script whose command died of SIGINT only when it got
# SIGINT too): "after" must not be written.
cat >"$TMP/s1" <<EOS
$KL k -- sh -c 'touch $T/s1.started; sleep 120'
touch $T/s1.after
EOS
# s2: keylock in the background of a script; the terminal's foreground
# group (field 8 of stat) must stay the script's (field 5).
cat >"$TMP/s2" <<EOS
$KL k2 -- sh -c 'touch $T/s2.started; sleep 120' &
while [ ! -e $T/s2.started ]; do sleep 0.05; done
read -r -a st </proc/\$\$/stat
echo "\${st[4]} \${st[7]}" >$T/s2.pg
kill \$!
wait
EOS
# s3: a command of a script that reads the terminal gets it.
cat >"$TMP/s3" <<EOS
$KL k3 -- sh -c 'read -r x; echo "\$x" >$T/s3.got'
echo \$? >$T/s3.rc
EOS
# p1 | p2: p2 reads a line from the pipe, then one from the terminal; p1
# waits for it (at most 30 s).  Were the terminal given to p1's group, p2
# would stop (SIGTTIN to keylock's group too) and the job with it: 148.
cat >"$TMP/p1" <<EOS
echo out
touch $T/p1.started
i=0
while [ ! -e $T/p2.got ] && [ \$i -lt 600 ]; do sleep 0.05; i=\$((i + 1)); done
EOS
cat >"$TMP/p2" <<EOS
read -r y
read -r x </dev/tty
echo "\$x" >$T/p2.got
EOS
cat >"$TMP/input" <<EOF2
send bash $T/s1\\n
wait $T/s1.started
send \\x03
send echo \$? >$T/s1.rc\\n
wait $T/s1.rc
send bash $T/s2; touch $T/s2.done\\n
wait $T/s2.done
send bash $T/s3\\n
send hello\\n
wait $T/s3.rc
send $KL k4 -- sh $T/p1 | sh $T/p2\\n
wait $T/p1.started
send piped\\n
send echo \$? >$T/p.rc\\n
wait $T/p.rc
send kill -KILL %1 2>/dev/null; wait; exit\\n
EOF2

rc=0
PTY_RUN_INPUT=$TMP/input PS1='$ ' "$PTY_RUN" "$TMP/never" - -- \
	env --default-signal bash --norc --noprofile -i >"$OUT" 2>"$ERR" ||
	rc=$?
[ "$(cat "$TMP/s1.rc")" = 130 ] || fail "Ctrl-C: the script exited $(cat "$TMP/s1.rc"), expected 130"
[ ! -e "$TMP/s1.after" ] || fail "Ctrl-C did not reach the script: it went on after keylock"
read -r pg tpg <"$TMP/s2.pg"
[ "$pg" = "$tpg" ] || fail "a background keylock took the script's terminal (group $pg, terminal's $tpg)"
[ "$(cat "$TMP/s3.got" 2>/dev/null)" = hello ] || fail "the command of a script did not read the terminal"
[ "$(cat "$TMP/s3.rc")" = 0 ] || fail "s3: keylock exited $(cat "$TMP/s3.rc")"
[ "$(cat "$TMP/p.rc")" = 0 ] || fail "keylock ... | reader of the terminal: exit $(cat "$TMP/p.rc") (148: stopped)"
[ "$(cat "$TMP/p2.got" 2>/dev/null)" = piped ] || fail "the pipeline's reader did not read the terminal"
[ "$rc" -eq 0 ] || fail "pty_run exited with $rc"
kl "${P[@]}" -n k -- true
expect_rc 0 "the key after Ctrl-C"
exit 0
