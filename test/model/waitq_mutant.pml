/* SPDX-License-Identifier: MIT */
/*
 * The mutant of waitq.pml that test/model/run.sh must see fail: a cancel
 * that races a grant ignores it (kl__waiter_fail without its state check),
 * so the granted waiter reports KL_ECANCELED while the mutex is its own and
 * the lock is lost.  A check that passes this model proves nothing.
 */
#define MUTANT
#include "waitq.pml"
