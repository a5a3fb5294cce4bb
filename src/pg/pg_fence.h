/* SPDX-License-Identifier: MIT */
/*
 * The fence sequence of the PostgreSQL provider (src/pg/pg_fence.c): its
 * schema-qualified name and the SQL that checks it at open, floors it when
 * a session starts and draws a fence from it.  Private to libkeylock-pg.
 */
#ifndef KL_PG_FENCE_H
#define KL_PG_FENCE_H

#include <stddef.h>

#define KL__PG_FENCE_DEFAULT "public.keylock_fence"

struct kl__pg_fence {
	char name[130];   /* "schema.name" as given, for messages */
	char ident[270];  /* "schema"."name", quoted */
	char lit[560];    /* ident as an SQL string literal */
	/* An expression that draws the next fence; run it only once the
	 * advisory lock of the key is held. */
	char draw[700];
	/* Statements, each ending in "; ", that start a session: taken
	 * once per session before its first draw. */
	char floor[1400];
	/* One row: a KL__PG_FENCE_* code and the server's clock in
	 * microseconds; no row: the sequence does not exist. */
	char check[1600];
};

/* The answers of check. */
#define KL__PG_FENCE_OK 0
#define KL__PG_FENCE_NOT_SEQUENCE 1
#define KL__PG_FENCE_NO_USAGE 2
#define KL__PG_FENCE_NO_UPDATE 3
#define KL__PG_FENCE_SHAPE 4
#define KL__PG_FENCE_TEMP 5
#define KL__PG_FENCE_NO_SCHEMA 6

/* Sets f from a fence_sequence value (len bytes, percent-encoded as in a
 * URI query), or from KL__PG_FENCE_DEFAULT when value is NULL.  0, or -1
 * when the value is not "schema.name" with both parts 1 to 63 bytes. */
int kl__pg_fence_init(struct kl__pg_fence *f, const char *value, size_t len);

/* Why check answered code (a KL__PG_FENCE_* other than OK). */
const char *kl__pg_fence_problem(int code);

#endif
