/* SPDX-License-Identifier: MIT */
/*
 * The fence sequence of the PostgreSQL provider.
 *
 * One sequence, named with its schema (never looked up through a role's
 * search_path, which gave each role with a schema of its own a sequence of
 * its own), serves every process and role that shares the keys.
 *
 * Crash safety.  A fence is drawn in a session with synchronous_commit
 * off: without that, nextval's WAL record (one per 32 values) makes its
 * commit wait for a flush, which costs a third of the throughput on a
 * stock server.  The price is that the last advances before a crash of
 * the server (or of the host) can be lost, and the sequence would hand
 * those fences out again.  Every session that draws fences dies in such a
 * crash, so each new session, before its first draw, floors the sequence
 * at the server's clock in microseconds: the recovered value, or the time
 * if that is larger.  A fence repeated after a crash would need more than
 * one fence per microsecond since the last floor (or a clock that went
 * back across the restart).
 *
 * Floor and draw must not interleave (a draw between the floor's nextval
 * and its setval would be handed out again), so a draw holds a shared
 * transaction-level advisory lock and the floor holds it exclusively.  It
 * is in the two-int4 key space (objsubid 2), apart from the bigint ids of
 * keys; a draw takes it only after its key is granted, never while it
 * waits, so a floor waits for no more than a statement.
 */
#include "config.h"

#include <stdio.h>
#include <string.h>

#include "pg_fence.h"

/* "klfe" and "nce!" as big-endian words. */
#define FLOOR_K1 "1802266213"
#define FLOOR_K2 "1851999521"
#define NAME_MAX_BYTES 63 /* NAMEDATALEN - 1 */

static int
hex(int ch)
{
	if (ch >= '0' && ch <= '9')
		return ch - '0';
	if (ch >= 'a' && ch <= 'f')
		return ch - 'a' + 10;
	if (ch >= 'A' && ch <= 'F')
		return ch - 'A' + 10;
	return -1;
}

/* Appends s (n bytes) to out (at *at, of size size), doubling each byte
 * of dup (NUL: none), between open and close.  -1 when it does not fit. */
static int
put_quoted(char *out, size_t size, size_t *at, const char *s, size_t n,
	   const char *open, char dup, char close)
{
	size_t o = *at, ol = strlen(open);

	if (o + ol >= size)
		return -1;
	memcpy(out + o, open, ol);
	o += ol;
	for (size_t i = 0; i < n; i++) {
		if (o + 3 >= size)
			return -1;
		if (s[i] == dup || (dup == '\'' && s[i] == '\\'))
			out[o++] = s[i];
		out[o++] = s[i];
	}
	if (o + 2 > size)
		return -1;
	out[o++] = close;
	out[o] = '\0';
	*at = o;
	return 0;
}

/* s as an E'' literal: ' and \ doubled, whatever
 * standard_conforming_strings says. */
static int
literal(char *out, size_t size, const char *s, size_t n)
{
	size_t at = 0;

	return put_quoted(out, size, &at, s, n, "E'", '\'', '\'');
}

int
kl__pg_fence_init(struct kl__pg_fence *f, const char *value, size_t len)
{
	char name[2 * NAME_MAX_BYTES + 2] = { 0 };
	char schema_lit[2 * NAME_MAX_BYTES + 4];
	char rel_lit[2 * NAME_MAX_BYTES + 4];
	const char *dot;
	size_t n = 0, at = 0, slen;
	int hi, lo, w;

	if (value == NULL) {
		value = KL__PG_FENCE_DEFAULT;
		len = strlen(value);
	}
	for (size_t i = 0; i < len; i++) {
		if (n + 1 >= sizeof name)
			return -1;
		if (value[i] == '%') {
			if (i + 2 >= len || (hi = hex(value[i + 1])) < 0 ||
			    (lo = hex(value[i + 2])) < 0 || (hi | lo) == 0)
				return -1;
			name[n++] = (char)(hi << 4 | lo);
			i += 2;
		} else {
			name[n++] = value[i];
		}
	}
	name[n] = '\0';
	if ((dot = memchr(name, '.', n)) == NULL)
		return -1;
	slen = (size_t)(dot - name);
	if (slen < 1 || slen > NAME_MAX_BYTES || n - slen - 1 < 1 ||
	    n - slen - 1 > NAME_MAX_BYTES)
		return -1;
	memcpy(f->name, name, n + 1);
	if (put_quoted(f->ident, sizeof f->ident, &at, name, slen, "\"", '"',
		       '"') != 0 ||
	    put_quoted(f->ident, sizeof f->ident, &at, dot + 1, n - slen - 1,
		       ".\"", '"', '"') != 0 ||
	    literal(f->lit, sizeof f->lit, f->ident, at) != 0 ||
	    literal(schema_lit, sizeof schema_lit, name, slen) != 0 ||
	    literal(rel_lit, sizeof rel_lit, dot + 1, n - slen - 1) != 0)
		return -1;

	w = snprintf(f->draw, sizeof f->draw,
		     "(SELECT pg_catalog.nextval(%s) FROM "
		     "pg_catalog.pg_advisory_xact_lock_shared(" FLOOR_K1
		     ", " FLOOR_K2 "))",
		     f->lit);
	if (w < 0 || (size_t)w >= sizeof f->draw)
		return -1;
	/* nextval, not last_value: it needs USAGE only, and under the
	 * exclusive lock nothing else draws. */
	w = snprintf(f->floor, sizeof f->floor,
		     "SELECT pg_catalog.pg_advisory_xact_lock(" FLOOR_K1
		     ", " FLOOR_K2 "); "
		     "SELECT pg_catalog.setval(%s, s.t) FROM "
		     "(SELECT pg_catalog.nextval(%s) AS n, "
		     "(EXTRACT(epoch FROM pg_catalog.clock_timestamp()) "
		     "* 1000000)::bigint AS t OFFSET 0) s WHERE s.n < s.t; ",
		     f->lit, f->lit);
	if (w < 0 || (size_t)w >= sizeof f->floor)
		return -1;
	/* CASE goes in order: has_sequence_privilege only on a sequence.
	 * CACHE 1 and no cycle: cached or wrapped values of different
	 * sessions would not come out in order. */
	w = snprintf(f->check, sizeof f->check,
		     "SELECT CASE WHEN c.relkind <> 'S' THEN 1 "
		     "WHEN c.relpersistence = 't' THEN 5 "
		     "WHEN NOT pg_catalog.has_schema_privilege(s.oid, "
		     "'USAGE') THEN 6 "
		     "WHEN NOT pg_catalog.has_sequence_privilege(c.oid, "
		     "'USAGE') THEN 2 "
		     "WHEN NOT pg_catalog.has_sequence_privilege(c.oid, "
		     "'UPDATE') THEN 3 "
		     "WHEN NOT EXISTS (SELECT FROM pg_catalog.pg_sequence q "
		     "WHERE q.seqrelid = c.oid AND q.seqtypid = "
		     "'pg_catalog.int8'::pg_catalog.regtype AND "
		     "q.seqincrement > 0 AND q.seqcache = 1 AND NOT q.seqcycle "
		     "AND q.seqmax >= 4611686018427387904) THEN 4 "
		     "ELSE 0 END, (EXTRACT(epoch FROM "
		     "pg_catalog.clock_timestamp()) * 1000000)::bigint "
		     "FROM pg_catalog.pg_class c "
		     "JOIN pg_catalog.pg_namespace s ON s.oid = c.relnamespace "
		     "WHERE s.nspname = %s AND c.relname = %s",
		     schema_lit, rel_lit);
	if (w < 0 || (size_t)w >= sizeof f->check)
		return -1;
	return 0;
}

const char *
kl__pg_fence_problem(int code)
{
	switch (code) {
	case KL__PG_FENCE_NOT_SEQUENCE:
		return "is not a sequence";
	case KL__PG_FENCE_NO_USAGE:
		return "is not usable by this role (GRANT USAGE, UPDATE ON "
		       "SEQUENCE)";
	case KL__PG_FENCE_NO_UPDATE:
		return "cannot be floored by this role (GRANT UPDATE ON "
		       "SEQUENCE)";
	case KL__PG_FENCE_SHAPE:
		return "must be a bigint sequence with INCREMENT > 0, CACHE 1, "
		       "NO CYCLE and the default MAXVALUE";
	case KL__PG_FENCE_NO_SCHEMA:
		return "is in a schema this role may not use (GRANT USAGE ON "
		       "SCHEMA)";
	case KL__PG_FENCE_TEMP:
		return "is a temporary sequence, which no other session sees";
	default:
		return "is unusable";
	}
}
