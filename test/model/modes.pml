/* SPDX-License-Identifier: MIT */
/*
 * A Promela model of the key table's lock modes (src/table_acquire.c,
 * "Modes"): the W3C Web Locks rule on one FIFO queue per key, for N
 * clients that each take the key shared or exclusively (MODES), with
 * try-once calls and waits that end by a deadline or a cancel token at any
 * moment (the clock), then release.  test/model/run.sh checks it with spin
 * (-DSAFETY).
 *
 * Every step of the C code that runs under the shard lock is one atomic
 * block here: a take (grant at once, fail a try-once, or queue), a release
 * (then pass_on: grant from the head while the head is grantable), and a
 * waiter leaving by its deadline or token (kl__waiter.left: pass_on again).
 * A grant is made by whoever passes the key on, as the direct hand-off of
 * the C code.  The lock-free takes of a free slot (exclusive, or E_SOLO)
 * are takes of a free key with an empty queue, so they are the take step.
 * Not modelled: the wait queue's own protocol (waitq.pml checks it),
 * memory order, errorcheck.
 *
 * Build-time choices (spin -DNAME):
 *   MODES=m          bit i: client i+1 takes the key shared (default 5:
 *                    clients 1 and 3 shared, client 2 exclusive)
 *   MUTANT_NOLEFT    a waiter that leaves by its deadline does not pass
 *                    the key on (the kl__waiter.left hook missing)
 *   MUTANT_BARGE     a shared request is granted whenever nobody holds
 *                    the key exclusively, even past queued requests
 *
 * Assertions:
 * - exclusion: an exclusive holder is alone; shared holders never beside
 *   an exclusive one;
 * - no barging: a request granted at once finds the queue empty;
 * - whenever the lock is free, the head of the queue is not grantable
 *   (nobody waits for a key they could have);
 * - FIFO holds by construction: only the head is ever granted;
 * - at the end nobody holds or waits, and no invalid end state.
 */

#ifndef N
#define N 3
#endif
#ifndef MODES
#define MODES 5
#endif
#ifndef OPS
#define OPS 2
#endif

#define IS_SHARED(c) (((MODES) >> ((c) - 1)) & 1)

/* Client states. */
#define IDLE 0
#define WAITING 1
#define HOLDS 2
#define LEFT 3

byte readers = 0;    /* shared holders */
bool writer = false; /* an exclusive holder */
byte q[N];           /* client ids, q[0] the head */
byte qlen = 0;
byte state[N + 1];
bool expired[N + 1];
byte done = 0;

#define GRANTABLE(c) (!writer && (IS_SHARED(c) || readers == 0))

#define HEAD_GRANTABLE (qlen > 0 && GRANTABLE(q[0]))

inline check_inv()
{
	assert(!(writer && readers > 0));
	assert(!HEAD_GRANTABLE);
}

inline grant(c)
{
	if
	:: IS_SHARED(c) -> readers++
	:: else -> writer = true
	fi;
	state[c] = HOLDS
}

inline dequeue_head()
{
	i = 0;
	do
	:: i + 1 < qlen -> q[i] = q[i + 1]; i++
	:: else -> break
	od;
	qlen--;
	q[qlen] = 0
}

/* pass_on: grants from the head while the head is grantable. */
inline pass_on()
{
	do
	:: HEAD_GRANTABLE ->
		c = q[0];
		dequeue_head();
		grant(c)
	:: else -> break
	od
}

/* Takes client id out of the queue, wherever it stands. */
inline unqueue(id)
{
	i = 0;
	do
	:: i < qlen && q[i] != id -> i++
	:: else -> break
	od;
	assert(i < qlen);
	do
	:: i + 1 < qlen -> q[i] = q[i + 1]; i++
	:: else -> break
	od;
	qlen--;
	q[qlen] = 0
}

proctype client(byte id)
{
	byte n = 0, i, c;
	bool once;

	do
	:: n < OPS ->
		n++;
		/* A take: try-once or waiting. */
		if
		:: once = true
		:: once = false
		fi;
		atomic {
			if
			:: qlen == 0 && GRANTABLE(id) -> grant(id)
#ifdef MUTANT_BARGE
			:: qlen > 0 && IS_SHARED(id) && !writer -> grant(id)
#endif
			:: else ->
				if
				:: once -> skip
				:: else ->
					q[qlen] = id;
					qlen++;
					state[id] = WAITING
				fi
			fi;
			if
			:: state[id] == HOLDS -> assert(qlen == 0)
			:: else -> skip
			fi;
			check_inv()
		}
		/* The wait: granted, or the deadline (or token) first. */
		if
		:: state[id] == WAITING ->
			if
			:: state[id] == HOLDS
			:: atomic {
				state[id] == WAITING && expired[id] ->
				unqueue(id);
				state[id] = LEFT;
#ifndef MUTANT_NOLEFT
				pass_on();
#endif
				check_inv()
			}
			fi
		:: else -> skip
		fi;
		if
		:: state[id] == HOLDS ->
			/* The section. */
			assert((IS_SHARED(id) && !writer && readers > 0) ||
			       (!IS_SHARED(id) && writer && readers == 0));
			atomic {
				if
				:: IS_SHARED(id) -> readers--
				:: else -> writer = false
				fi;
				state[id] = IDLE;
				pass_on();
				check_inv()
			}
		:: else -> state[id] = IDLE
		fi;
		expired[id] = false
	:: else -> break
	od;
	atomic {
		done++
	}
}

/* The clock: any waiter's deadline may pass at any moment.  It only
 * moves when it has a deadline to end, so that a waiter stuck for ever
 * shows as an invalid end state. */
#define EXPIRE(c) atomic { state[c] == WAITING && !expired[c] -> expired[c] = true }

active proctype clock()
{
	do
	:: done == N -> break
	:: EXPIRE(1)
#if N >= 2
	:: EXPIRE(2)
#endif
#if N >= 3
	:: EXPIRE(3)
#endif
#if N >= 4
	:: EXPIRE(4)
#endif
	od
}

init
{
	byte i;

	atomic {
		for (i : 1 .. N) {
			run client(i)
		}
	}
	done == N;
	assert(readers == 0 && !writer && qlen == 0)
}
