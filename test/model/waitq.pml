/* SPDX-License-Identifier: MIT */
/*
 * A Promela model of keylock's wait queue protocol (src/waitq.c) and of the
 * two objects built on it: kl_mutex (src/mutex.c: CAS fast path, QUEUED bit,
 * direct hand-off) and kl_reset_event (src/reset_event.c: auto-reset
 * budget), with timeouts, cancel tokens (src/cancel.c) and the overflow
 * strategies.  test/model/run.sh checks it exhaustively with spin
 * (-DSAFETY); TESTPLAN T20.
 *
 * Build-time choices (spin -DNAME):
 *   MUTEX or EVENT   which object the N clients use (one of them)
 *   OVERFLOW=k       the overflow strategy: 0 THIS, 1 FIRST, 2 LAST
 *   AUTO=n           EVENT: auto_reset_count (255: manual reset)
 *   MUTANT           a cancel overrides a grant that already happened
 *                    (waitq_mutant.pml): the checks must fail
 *   MUTANT_NOWAKE    a hand-off that forgets to wake the new owner
 *   MUTANT_NOPROD    a hand-off that prods the new head (marks it PRODDED)
 *                    but forgets to wake it, while its own grant leaves the
 *                    wake-up of a PRODDED waiter to the prodder
 *   MUTANT_CANCEL_TAKE  enter/wait takes a free object without looking
 *                    whether its token fired since it registered (the code
 *                    before commit d91638b)
 *   MUTANT_SPIN_PARK a spinning head that gives up parks by storing PARKED
 *                    instead of going through the compare-and-swap from
 *                    AWAKE
 *   MUTANT_HEADED_LATE  a hand-off marks an awake new head headed after
 *                    the unlock instead of under the lock, when the mark
 *                    may land on a waiter that has returned
 *   SPIN_ANY         any waiter may spin before it parks, not only the
 *                    head: the key table lets a shared request spin a few
 *                    places behind the head (waitq.c, kl__waiter.shared),
 *                    and so does an exclusive one that asks again right
 *                    after handing the lock on, in a crowd (waitq.c,
 *                    SPIN_BEHIND); the assertion that only the head spins
 *                    is off
 *   SPIN_BEHIND      with SPIN_ANY: only a waiter that queues behind the
 *                    head spins, and a prodded one does not, so that a
 *                    mutant caught here is caught through a spin behind
 *                    the head (the head's own spin is checked without it)
 *   CHECK            each waiter has a check (kl__waiter.check: the key
 *                    table's deadlock detection), due once at a timed
 *                    wake-up, that may end its wait like a timeout with a
 *                    status of its own (EDEADLK) unless an outcome came
 *                    first; granters know nothing of it
 *   LIVENESS         adds the claim "every call returns" (pan -a -f)
 *   SPURIOUS         futex waits may also end spuriously (off by default:
 *                    an ever-possible wake-up would hide a lost wake-up,
 *                    which without it shows as an invalid end state)
 *
 * What is modelled, step by step as the C code does it:
 * - the queue lock (m->lock / e->lock) as an explicit lock, the token locks
 *   likewise, so a lock-order deadlock shows as an invalid end state;
 * - every atomic of the C code (the mutex state word, the parking word) as
 *   one indivisible step; a section under the queue lock as one atomic
 *   block from the lock to the unlock.  That is Lipton's reduction (taking
 *   a lock moves right, releasing it moves left, what the lock guards moves
 *   both ways); a section touches several unguarded words only where each
 *   belongs to a waiter that cannot act before the section ends (it is
 *   asleep or not yet settled), so no interleaving is lost.  The wake after
 *   a hand-off, outside the lock in the C code, stays a step of its own;
 * - the futex: FUTEX_WAIT sleeps only while the word is PARKED (checked
 *   atomically), FUTEX_WAKE ends that sleep; a timed wait may also end when
 *   the deadline has passed, and any wait may end spuriously;
 * - time as a clock process that may, at any moment, make a waiter's
 *   deadline pass (so every deadline from "at once" to "never" is covered);
 * - a canceller that may fire any client's token at any moment, and an
 *   admin that may lower max_queue (kl_mutex_set_opts) at any moment.
 *
 * Not modelled: KL_EVENTUAL (barging, KL__RETRY, compete), KL_ERRORCHECK,
 * timeout 0 (try_enter), tokens made by kl_cancel_new_timeout, the key
 * table (which uses this queue under its shard locks), memory order (the
 * C11 orders are TSan's to judge), the spin of a reset event's waiter (it
 * only delays the CAS to PARKED).
 * The prod is modelled: a leave that hands the mutex over marks a parked
 * new head PRODDED and wakes it after the unlock, or an awake one headed
 * (kl__waiter.headed: a spinner behind the head then spins as the head,
 * which adds no way for a spin to end).
 * The mutex's spin is modelled by where it can end (waitq.c, spin): it
 * sees SETTLED, or it gives up (SPIN_NS ran out) and goes on to park; see
 * inline spin.  Any decision to stop spinning must end the same way,
 * through the CAS from AWAKE (mutant-spin-park).  A head that skips its
 * spin (waitq.c, spin_skipped: its queue's spins kept ending parked) is
 * a spin that gives up at its first step, which the model already takes;
 * the miss count only chooses between outcomes the model explores, and
 * the grant reads the waiter's word for it without changing it.
 *
 * Assertions:
 * - at most one owner, and a client's result agrees with ownership
 *   (KL_OK exactly when the mutex is its own: no lost or double grant);
 * - nobody barges: a fast-path or slow-path take finds the queue empty, and
 *   whenever the queue lock is free, a non-empty queue has a holder and the
 *   QUEUED bit set;
 * - FIFO: grants go in enqueue order among the waiters still queued;
 * - cancel: once kl_cancel_fire has returned, nothing is granted to a
 *   call using the token;
 * - reset budget: a set releases exactly AUTO waiters when at least AUTO
 *   live ones are queued, else all of them and stays signaled with the rest
 *   of the budget; signaled implies an empty queue;
 * - at the end owner == 0 && qlen == 0, and no invalid end state (no waiter
 *   left asleep, no lock left held, no deadlock);
 * - a waiter spins only as the head: while it spins, it is either settled
 *   or first in the queue (not with SPIN_ANY);
 * - the headed mark is right: made under the lock on a waiter that still
 *   waits (its frame is live), and a marked waiter that still waits is
 *   the head.
 */

#ifndef N
#define N 3
#endif

#if !defined(MUTEX) && !defined(EVENT)
#define MUTEX
#endif

#ifndef OVERFLOW
#define OVERFLOW 0
#endif

#ifndef AUTO
#define AUTO 2
#endif

#ifndef OPS
#define OPS 2
#endif

#define UNBOUNDED 255

/* Statuses (kl_* codes, renumbered). */
#define OK 0
#define ETIMEDOUT 1
#define ECANCELED 2
#define EOVERFLOW 3
#define EDEADLK 4
#define EPENDING 9

/* Waiter states (enum kl__wstate). */
#define W_INIT 0
#define W_WAITING 1
#define W_GRANTED 2
#define W_DONE 3

/* The parking word. */
#define AWAKE 0
#define SETTLED 1
#define PARKED 2
#define PRODDED 3

#define OV_THIS 0
#define OV_FIRST 1
#define OV_LAST 2

/* Lock holder ids besides the clients 1..N. */
#define P_CANCEL (N + 1)
#define P_ADMIN (N + 2)
#define P_SETTER (N + 3)

/* The queue and its lock. */
byte qlock;
byte q[N];
byte qlen;
byte maxq = UNBOUNDED;
byte ov = OVERFLOW;

/* Per waiter (index 1..N; 0 unused). */
byte wstate[N + 1];
byte wstatus[N + 1];
byte word[N + 1];
bool sleeping[N + 1];
bool hasdl[N + 1];   /* the call has a deadline */
bool expired[N + 1]; /* ... and it has passed */
bool checked[N + 1]; /* CHECK: the waiter's check has run */
bool hastok[N + 1];  /* the call has a cancel token (one per client) */
bool fired[N + 1];
bool registered[N + 1];
bool over[N + 1];    /* the call has returned */
bool headed[N + 1];  /* marked the new head while awake (kl__waitq_prod) */
byte tlock[N + 1];

/* Ghosts for the FIFO check. */
byte seq;
byte enq[N + 1];
byte lastgrant;

byte ndone;

#ifdef MUTEX
byte mstate; /* owner id << 1 | QUEUED (the C code shifts by 2: bit 1 is KL_EVENTUAL's WOKEN) */
byte incs;   /* clients inside the critical section */
#endif

#ifdef EVENT
bool signaled;
byte budget;
#endif

inline lock(l, who)
{
	atomic { l == 0 -> l = who }
}

inline unlock(l)
{
	l = 0
}

/* ---------------------------------------------------------------- */
/* The queue (q->lock held) */

inline append(w)
{
	d_step {
		q[qlen] = w;
		qlen++;
		wstate[w] = W_WAITING;
		seq++;
		enq[w] = seq
	}
}

inline unlink(w)
{
	d_step {
		i = 0;
		do
		:: i < qlen && q[i] != w -> i++
		:: else -> break
		od;
		assert(i < qlen);
		do
		:: i + 1 < qlen -> q[i] = q[i + 1]; i++
		:: else -> break
		od;
		qlen--;
		q[qlen] = 0;
		i = 0
	}
}

/* kl__waiter_settle: publish with an exchange; old tells whether to wake. */
inline settle(w, old)
{
	atomic { old = word[w]; word[w] = SETTLED }
}

/* The headed mark of w: only while w waits, whose frame it writes (once
 * its word is SETTLED, w may return at any step; over[w] says it did, a
 * step later than the C code's frame is gone). */
inline headed_mark(w)
{
	assert(word[w] != SETTLED);
	headed[w] = true
}

/* kl__waitq_prod: after a grant, a parked new head is marked PRODDED, to
 * be woken (pg) after the unlock, and an awake one headed.  Queue lock
 * held. */
inline prod(pg, hd)
{
	if
	:: qlen > 0 && word[q[0]] == PARKED ->
		word[q[0]] = PRODDED;
		pg = q[0]
	:: qlen > 0 && word[q[0]] != PARKED ->
		pg = 0;
#ifdef MUTANT_HEADED_LATE
		hd = q[0] /* the bug: marked after the unlock */
#else
		headed_mark(q[0])
#endif
	:: else -> pg = 0
	fi
}

/* kl__unpark: FUTEX_WAKE. */
inline unpark(w, old)
{
	if
	:: old == PARKED -> sleeping[w] = false
	:: else -> skip
	fi;
	old = 0
}

/* kl__waiter_fail: ends w with st unless it already has an outcome. */
inline waiter_fail(w, st)
{
	atomic {
	if
	:: wstate[w] == W_WAITING ->
		unlink(w);
		wstate[w] = W_DONE;
		wstatus[w] = st;
		settle(w, old);
		unpark(w, old)
	:: wstate[w] == W_INIT ->
		wstate[w] = W_DONE;
		wstatus[w] = st
#ifdef MUTANT
	/* The bug: a cancel does not see that a grant won the race. */
	:: wstate[w] == W_GRANTED && st == ECANCELED ->
		wstate[w] = W_DONE;
		wstatus[w] = st
#endif
	:: else -> skip
	fi
	}
}

/* Grant order must be enqueue order among the waiters still queued. */
inline fifo_check(g)
{
	d_step {
		assert(enq[g] > lastgrant);
		lastgrant = enq[g];
		i = 1;
		do
		:: i <= N ->
			assert(i == g || wstate[i] != W_WAITING ||
			       enq[i] > enq[g]);
			i++
		:: else -> break
		od;
		i = 0
	}
}

/* kl__waitq_grant_head: the head as GRANTED, failing expired ones. */
inline grant_head(g)
{
	g = 0;
	do
	:: qlen == 0 -> break
	:: qlen > 0 && expired[q[0]] ->
		w = q[0];
		waiter_fail(w, ETIMEDOUT);
		w = 0
	:: qlen > 0 && !expired[q[0]] ->
		g = q[0];
		fifo_check(g);
		unlink(g);
		wstate[g] = W_GRANTED;
		break
	od
}

/* kl__waitq_reduce / the overflow victim. */
inline evict_one()
{
	if
	:: ov == OV_FIRST -> w = q[0]
	:: else -> w = q[qlen - 1]
	fi;
	waiter_fail(w, EOVERFLOW);
	w = 0
}

/* kl__waitq_wait, up to parking: the queue lock held on entry (inside the
 * caller's atomic block), released here.  rc stays EPENDING when queued. */
inline waitq_enqueue(me)
{
	if
	:: wstate[me] == W_DONE -> /* canceled before it could queue */
		unlock(qlock);
		rc = wstatus[me]
	:: else ->
		if
		:: qlen >= maxq && (maxq == 0 || ov == OV_THIS) ->
			unlock(qlock);
			rc = EOVERFLOW
		:: else ->
			if
			:: qlen >= maxq -> evict_one()
			:: else -> skip
			fi;
			append(me);
#ifdef MUTEX
#ifdef SPIN_ANY
			/* Any waiter may spin: the key table lets a shared
			 * request spin a few places behind the head. */
#ifdef SPIN_BEHIND
			spinme = qlen > 1;
#else
			if
			:: spinme = true
			:: spinme = false
			fi
#endif
#else
			spinme = qlen == 1; /* only the head spins */
#endif
#endif
			unlock(qlock)
		fi
	fi
}

/* waitq.c's spin.  Its steps only read the word or yield, which changes
 * no state of the model (nor do the inputs that decide whether it yields:
 * the crowd count and the queue's readers hint, which only choose between
 * yielding and not), so a spin reduces to its end: it sees SETTLED, or
 * it gives up (SPIN_NS ran out) and goes on to the CAS to PARKED.  Only the
 * head spins. */
inline spin(me)
{
	/* one step: what it saw (and that only the head spins) */
	atomic {
#ifndef SPIN_ANY
		assert(word[me] == SETTLED || qlen > 0 && q[0] == me);
#endif
		spinme = false
	}
#ifdef MUTANT_SPIN_PARK
	/* the bug: giving up, it parks by a plain store, which may hide
	 * a grant published since the look above */
	;
	if
	:: word[me] != SETTLED -> word[me] = PARKED
	:: else -> skip
	fi
#endif
}

/* kl__waitq_wait, the parking loop: until the outcome is published. */
inline waitq_park(me)
{
	if
	:: spinme -> spin(me)
	:: else -> skip
	fi;
	do
	:: word[me] == SETTLED -> break
	:: else ->
		/* CAS AWAKE -> PARKED, or find PARKED: then park. */
		atomic {
			if
			:: word[me] == AWAKE -> word[me] = PARKED
			:: else -> skip
			fi
		};

		/* FUTEX_WAIT: sleeps only if the word is still PARKED. */
		atomic {
			if
			:: word[me] == PARKED -> sleeping[me] = true
			:: else -> skip
			fi
		};
		if
		:: !sleeping[me] -> skip /* woken, or never slept */
		:: atomic { sleeping[me] && expired[me] -> sleeping[me] = false }
#ifdef CHECK
		:: atomic { sleeping[me] && !checked[me] -> sleeping[me] = false }
#endif
#ifdef SPURIOUS
		:: atomic { sleeping[me] -> sleeping[me] = false }
#endif
		fi;
		/* Prodded: back to AWAKE, then spins as the new head. */
		atomic {
			if
			:: word[me] == PRODDED -> word[me] = AWAKE;
#ifdef SPIN_BEHIND
				spinme = false
#else
				spinme = true
#endif
			:: else -> skip
			fi
		};
		if
		:: spinme -> spin(me)
		:: else -> skip
		fi;
		/* Never early: a timeout only once the deadline has passed. */
		if
		:: word[me] != SETTLED && expired[me] ->
			atomic {
				lock(qlock, me);
				if
				:: wstate[me] == W_WAITING ->
					unlink(me);
					wstate[me] = W_DONE;
					wstatus[me] = ETIMEDOUT;
					word[me] = SETTLED
				:: else -> skip
				fi;
				unlock(qlock)
			}
		:: else -> skip
		fi;
#ifdef CHECK
		/* The check, due (its time has come) and run without the
		 * lock: it finds nothing and the waiter goes on, or it ends
		 * the wait through the timeout's path with its own status. */
		if
		:: word[me] != SETTLED && !checked[me] ->
			checked[me] = true;
			if
			:: skip
			:: atomic {
				lock(qlock, me);
				if
				:: wstate[me] == W_WAITING ->
					unlink(me);
					wstate[me] = W_DONE;
					wstatus[me] = EDEADLK;
					word[me] = SETTLED
				:: else -> skip
				fi;
				unlock(qlock)
			   }
			fi
		:: else -> skip
		fi;
#endif
		skip
	od;
	if
	:: wstate[me] == W_GRANTED -> rc = OK
	:: else -> rc = wstatus[me]
	fi
}

/* kl__waiter_prepare: INIT, and registered on the token unless it fired
 * (then rc = ECANCELED).  The token lock guards fired and registered. */
inline prepare(me)
{
	wstate[me] = W_INIT;
	if
	:: hastok[me] ->
		atomic {
			lock(tlock[me], me);
			if
			:: fired[me] -> rc = ECANCELED
			:: else -> registered[me] = true
			fi;
			unlock(tlock[me])
		}
	:: else -> skip
	fi
}

/* kl__waiter_finish: unregister. */
inline finish(me)
{
	if
	:: registered[me] ->
		atomic {
			lock(tlock[me], me);
			registered[me] = false;
			unlock(tlock[me])
		}
	:: else -> skip
	fi
}

/* DESIGN: "once kl_cancel_fire has returned, no later grant goes to a
 * waiter using that token".  Checked where a registered call takes the
 * object without queueing (a grant from the queue cannot break it: fire
 * settles a queued waiter under the queue lock): fire has returned when the
 * token is fired and its lock is free again. */
inline strict_cancel(me)
{
	assert(!(hastok[me] && fired[me] && tlock[me] == 0))
}

/* ---------------------------------------------------------------- */
/* The scenario.  By default every combination is explored: k of the calls
 * have a deadline (clients 1..k) and j have a cancel token (clients
 * N-j+1..N); which client ids carry them does not matter, since arrival
 * order is free.  -DDL=mask / -DTOK=mask fix them instead (bit i-1 for
 * client i), -DMAXQ=n fixes max_queue, -DADMIN=n makes set_opts lower it to
 * n (-DADMIN=-1: no set_opts). */

inline choose_calls()
{
#if defined(DL)
	hasdl[1] = (DL & 1) != 0;
	hasdl[2] = (DL & 2) != 0;
	hasdl[3] = (DL & 4) != 0;
#else
	if
	:: skip
	:: hasdl[1] = true
	:: hasdl[1] = true; hasdl[2] = true
#if N > 2
	:: hasdl[1] = true; hasdl[2] = true; hasdl[3] = true
#endif
	fi;
#endif
#if defined(TOK)
	hastok[1] = (TOK & 1) != 0;
	hastok[2] = (TOK & 2) != 0;
	hastok[3] = (TOK & 4) != 0
#else
	if
	:: skip
	:: hastok[N] = true
	:: hastok[N] = true; hastok[N - 1] = true
#if N > 2
	:: hastok[N] = true; hastok[N - 1] = true; hastok[N - 2] = true
#endif
	fi
#endif
}

/* max_queue: unbounded, or 1 so that a second waiter overflows. */
inline choose_maxq()
{
#if defined(MAXQ)
	maxq = MAXQ
#else
	if
	:: maxq = UNBOUNDED
	:: maxq = 1
	fi
#endif
}

/* kl_mutex_set_opts may lower max_queue to 1 or 0 at any moment. */
inline choose_admin()
{
#if defined(ADMIN)
#if ADMIN >= 0
	run admin(ADMIN)
#else
	skip
#endif
#else
	if
	:: run admin(1)
	:: run admin(0)
	:: skip
	fi
#endif
}

/* ---------------------------------------------------------------- */
/* Time, cancellation */

/* The clock: a waiter's deadline may pass at any moment while it waits. */
active proctype clock()
{
end_clock:
	do
	:: atomic { hasdl[1] && !expired[1] && wstate[1] == W_WAITING -> expired[1] = true }
	:: atomic { hasdl[2] && !expired[2] && wstate[2] == W_WAITING -> expired[2] = true }
#if N > 2
	:: atomic { hasdl[3] && !expired[3] && wstate[3] == W_WAITING -> expired[3] = true }
#endif
	od
}

/* kl_cancel_fire on client t's token: token lock, then the queue lock
 * (cancel.c's lock order) for the registered waiter. */
inline fire(t)
{
	atomic {
		lock(tlock[t], P_CANCEL);
		if
		:: !fired[t] ->
			fired[t] = true;
			if
			:: registered[t] ->
				lock(qlock, P_CANCEL);
				waiter_fail(t, ECANCELED);
				unlock(qlock)
			:: else -> skip
			fi
		:: else -> skip
		fi;
		unlock(tlock[t])
	}
}

/* Fires any of the tokens, in any order, at any moment, or none: firing
 * the token of a finished call changes nothing, so it is not explored. */
proctype canceller()
{
	byte t, w, old, i;

end_cancel:
	do
	:: hastok[1] && !fired[1] && !over[1] -> t = 1; fire(t); t = 0
	:: hastok[2] && !fired[2] && !over[2] -> t = 2; fire(t); t = 0
#if N > 2
	:: hastok[3] && !fired[3] && !over[3] -> t = 3; fire(t); t = 0
#endif
	od
}

#ifdef MUTEX
/* ---------------------------------------------------------------- */
/* kl_mutex */

/* kl_mutex_set_opts lowering max_queue to lim (strategy unchanged). */
proctype admin(byte lim)
{
	byte w, old, i;

	atomic {
		lock(qlock, P_ADMIN);
		maxq = lim;
		do
		:: qlen > maxq -> evict_one()
		:: else -> break
		od;
		unlock(qlock)
	}
}

proctype client(byte me)
{
	byte rc = EPENDING, old, w, g, i, pg, hd;
	bool took, abort, spinme;

	/* kl_mutex_enter: a token fired before the call */
	if
	:: hastok[me] && fired[me] -> rc = ECANCELED; goto entered
	:: else -> skip
	fi;
	/* the fast path: CAS 0 -> id */
	atomic {
		if
		:: mstate == 0 -> mstate = me * 2; rc = OK; assert(qlen == 0)
		:: else -> skip
		fi
	};
	if
	:: rc == OK -> goto entered
	:: else -> skip
	fi;
	prepare(me);
	if
	:: rc == ECANCELED -> goto entered
	:: else -> skip
	fi;
	atomic {
		lock(qlock, me);
		/* take_or_mark: take a free mutex, else set QUEUED */
		if
#ifndef MUTANT_CANCEL_TAKE
		:: wstate[me] == W_DONE -> /* canceled since it registered */
			unlock(qlock);
			rc = wstatus[me]
		:: wstate[me] != W_DONE && mstate == 0 ->
#else
		:: mstate == 0 ->
#endif
			strict_cancel(me);
			mstate = me * 2;
			assert(qlen == 0);
			unlock(qlock);
			rc = OK
		:: else ->
			mstate = mstate | 1;
			waitq_enqueue(me)
		fi
	};
	if
	:: rc == EPENDING -> waitq_park(me)
	:: else -> skip
	fi;
	finish(me);
entered:
	/* exactly one outcome: KL_OK if and only if it owns the mutex */
	assert((rc == OK) == ((mstate >> 1) == me));
	if
	:: rc == OK ->
		incs++;
		assert(incs == 1 && (mstate >> 1) == me);
		incs--;
		/* kl_mutex_leave; client 1 may leave with abort_pending */
		if
		:: me == 1 -> abort = true
		:: atomic {
			if
			:: mstate == me * 2 -> mstate = 0; took = true
			:: else -> skip
			fi
		   }
		fi;
		if
		:: !took ->
			atomic {
				lock(qlock, me);
				assert((mstate >> 1) == me);
				if
				:: abort ->
					do
					:: qlen > 0 -> w = q[0]; waiter_fail(w, ECANCELED); w = 0
					:: else -> break
					od
				:: else -> skip
				fi;
				grant_head(g);
				if
				:: g != 0 ->
					if
					:: qlen != 0 -> mstate = g * 2 | 1
					:: else -> mstate = g * 2
					fi;
					settle(g, old);
					prod(pg, hd)
				:: else -> mstate = 0
				fi;
				unlock(qlock)
			};
			/* the wake, after the unlock */
#ifdef MUTANT_NOWAKE
			old = 0; /* the bug: the hand-off forgets the wake */
#endif
			unpark(g, old);
			g = 0;
#ifdef MUTANT_HEADED_LATE
			if
			:: hd != 0 -> headed_mark(hd); hd = 0
			:: else -> skip
			fi;
#endif
			/* and the prodded new head's */
			if
			:: pg != 0 ->
#ifdef MUTANT_NOPROD
				old = 0; /* the bug: the prod forgets the wake */
#else
				old = PARKED;
#endif
				unpark(pg, old);
				pg = 0
			:: else -> skip
			fi
		:: else -> skip
		fi
	:: else -> skip
	fi;
	/* forget the locals: a finished client is one state */
	d_step { rc = 0; took = false; abort = false; over[me] = true; ndone++ }
}

/* A waiter marked headed that still waits but is not the head. */
#define MISMARKED(i) (headed[i] && word[i] != SETTLED && !(qlen > 0 && q[0] == i))
#if N > 2
#define ANY_MISMARKED (MISMARKED(1) || MISMARKED(2) || MISMARKED(3))
#else
#define ANY_MISMARKED (MISMARKED(1) || MISMARKED(2))
#endif

/* Checked in every state: with the queue lock free, a waiter in the queue
 * implies a holder and the QUEUED bit (so no newcomer can barge and no
 * leave can skip the hand-off); a waiter marked headed that still waits
 * is the head (so that it keeps its CPU only for the next grant). */
active proctype monitor()
{
end_monitor:
	atomic {
		(!(qlock != 0 || qlen == 0 || ((mstate & 1) && (mstate >> 1) != 0)) ||
		 ANY_MISMARKED) ->
		assert(false)
	}
}

init {
	choose_calls();
	atomic {
		choose_maxq();
		run client(1);
		run client(2);
#if N > 2
		run client(3);
#endif
		run canceller();
		choose_admin()
	};
	ndone == N;
	assert(mstate == 0 && qlen == 0 && incs == 0)
}
#endif /* MUTEX */

#ifdef EVENT
/* ---------------------------------------------------------------- */
/* kl_reset_event with auto_reset_count AUTO */

/* One release while signaled (lock held). */
inline spend()
{
	if
	:: AUTO != UNBOUNDED ->
		budget--;
		if
		:: budget == 0 -> signaled = false
		:: else -> skip
		fi
	:: else -> skip
	fi
}

/* Unlocking the event checks its invariant: signaled means nobody waits. */
inline eunlock()
{
	assert(!signaled || qlen == 0);
	unlock(qlock)
}

/* kl_reset_event_set, with the budget rule checked. */
inline ev_set()
{
	atomic {
		lock(qlock, P_SETTER);
		if
		:: !signaled ->
			signaled = true;
			budget = AUTO;
			queued = qlen;
			do
			:: signaled ->
				/* grant_head, counting the expired waiters it
				 * skips */
				g = 0;
				do
				:: qlen == 0 -> break
				:: qlen > 0 && expired[q[0]] ->
					w = q[0];
					waiter_fail(w, ETIMEDOUT);
					w = 0;
					queued--
				:: qlen > 0 && !expired[q[0]] ->
					g = q[0];
					fifo_check(g);
					unlink(g);
					wstate[g] = W_GRANTED;
					break
				od;
				if
				:: g == 0 -> break
				:: else ->
					settle(g, old);
					unpark(g, old);
					spend();
					nrel++
				fi
			:: else -> break
			od;
			/* exactly AUTO released when at least AUTO live
			 * waiters were queued; else all of them, and the rest
			 * of the budget stays */
			if
			:: AUTO != UNBOUNDED ->
				assert(queued < AUTO || nrel == AUTO);
				assert(nrel == AUTO && !signaled ||
				       nrel < AUTO && nrel == queued &&
				       signaled && budget == AUTO - nrel &&
				       qlen == 0)
			:: else ->
				assert(signaled && qlen == 0 && nrel == queued)
			fi;
			queued = 0;
			nrel = 0;
			g = 0
		:: else -> skip
		fi;
		eunlock()
	}
}

inline ev_reset()
{
	atomic {
		lock(qlock, P_SETTER);
		signaled = false;
		budget = 0;
		eunlock()
	}
}

proctype setter()
{
	byte k, g, w, old, i, queued, nrel;

	/* a few sets and resets in any order ... */
	do
	:: k < OPS ->
		k++;
		if
		:: ev_set()
		:: ev_reset()
		fi
	:: k == OPS -> k = 0; break
	od;
	/* ... then sets until every waiter is done; a set on a signaled
	 * event does nothing, so the model skips it.  A waiter left asleep
	 * on a signaled event shows as an invalid end state. */
	do
	:: ndone == N -> break
	:: !signaled -> ev_set()
	od
}

proctype ewaiter(byte me)
{
	byte rc = EPENDING, old, w, i;
	bool spinme;

	/* kl_reset_event_wait: a token fired before the call */
	if
	:: hastok[me] && fired[me] -> rc = ECANCELED; goto out
	:: else -> skip
	fi;
	atomic {
		lock(qlock, me);
		if
		:: signaled -> spend(); eunlock(); rc = OK
		:: !signaled && hastok[me] ->
			/* token lock before ours: register unlocked, then
			 * look again */
			eunlock()
		:: !signaled && !hastok[me] ->
			wstate[me] = W_INIT;
			waitq_enqueue(me)
		fi
	};
	if
	:: rc == EPENDING && hastok[me] && wstate[me] != W_WAITING ->
		prepare(me);
		if
		:: rc == ECANCELED -> goto out
		:: else -> skip
		fi;
		atomic {
			lock(qlock, me);
			if
#ifndef MUTANT_CANCEL_TAKE
			:: wstate[me] == W_DONE -> eunlock(); rc = wstatus[me]
			:: wstate[me] != W_DONE && signaled ->
#else
			:: signaled ->
#endif
				strict_cancel(me);
				spend();
				eunlock();
				rc = OK
			:: else -> waitq_enqueue(me)
			fi
		}
	:: else -> skip
	fi;
	if
	:: rc == EPENDING -> waitq_park(me)
	:: else -> skip
	fi;
	finish(me);
out:
	assert(rc != EPENDING);
	d_step { rc = 0; over[me] = true; ndone++ }
}

init {
	choose_calls();
	atomic {
		/* created signaled (with the full budget) or not */
		if
		:: signaled = true; budget = AUTO
		:: skip
		fi;
		run ewaiter(1);
		run ewaiter(2);
#if N > 2
		run ewaiter(3);
#endif
		run canceller();
		run setter()
	};
	ndone == N;
	assert(qlen == 0)
}
#endif /* EVENT */

#ifdef LIVENESS
/* Under weak fairness every call returns (-DLIVENESS, pan -a -f): no waiter
 * is left behind while the others go on, e.g. parked on a free mutex. */
ltl returns { <> (ndone == N) }
#endif
