/* SPDX-License-Identifier: MIT */
/*
 * Happens-before annotations for Helgrind and DRD (TESTPLAN T01, P1).
 *
 * The kl_mutex fast path and the waiter hand-off synchronise through C11
 * atomics, which Helgrind and DRD do not see as synchronisation: without
 * these, every hand-off looks like a race on the data the lock protects.
 * KL_ANNOTATE_HAPPENS_BEFORE(addr) marks a release on addr (a store or
 * successful CAS that publishes), KL_ANNOTATE_HAPPENS_AFTER(addr) the
 * matching acquire.
 * KL_ANNOTATE_ATOMIC(addr) tells them that the object at addr is only ever
 * accessed atomically, so that its own loads and stores are not reported
 * as races (they see a C11 atomic as plain memory).  Call it where the
 * object is initialised; heap and stack memory is tracked again once
 * reused.  Only ever for an atomic object: on anything else it would hide
 * real races.
 *
 * They expand to valgrind/helgrind.h's client requests when configured
 * with --enable-valgrind-annotations (a few instructions, no-ops when not
 * under Valgrind), and to nothing otherwise.
 */
#ifndef KL_ANNOTATE_H
#define KL_ANNOTATE_H

#if defined(KL_VALGRIND_ANNOTATIONS)
# include <valgrind/helgrind.h>
# define KL_ANNOTATE_HAPPENS_BEFORE(addr) \
	ANNOTATE_HAPPENS_BEFORE((const void *)(addr))
# define KL_ANNOTATE_HAPPENS_AFTER(addr) \
	ANNOTATE_HAPPENS_AFTER((const void *)(addr))
# define KL_ANNOTATE_ATOMIC(addr) \
	ANNOTATE_BENIGN_RACE_SIZED((addr), sizeof *(addr), "C11 atomic")
#else
# define KL_ANNOTATE_HAPPENS_BEFORE(addr) ((void)0)
# define KL_ANNOTATE_HAPPENS_AFTER(addr) ((void)0)
# define KL_ANNOTATE_ATOMIC(addr) ((void)0)
#endif

#endif /* KL_ANNOTATE_H */
