/* SPDX-License-Identifier: MIT */
/*
 * The Redis provider's restart guard: a server that may have lost locks
 * in a restart grants none until it has been up for the guard (see
 * provider_redis.c).  The evidence is the restart marker, kept in the
 * server itself and checked by every new connection (kl__redis_mark_server),
 * which also sets the fence floor; each attempt asks for the guard it needs
 * (kl__redis_guard_need), and the attempt script holds it against the server's
 * TIME (redis_scripts.c).  r->mu guards the server identity and the ttl
 * figures; no network I/O runs with it held.
 */
#include "config.h"

#include <pthread.h>
#include <string.h>

#include "redis_internal.h"

#define RECORD_REFRESH_MS 60000 /* how often attempts refresh the ttl
				 * record (also kept KL_R_FENCE_KEEP_MS) */

/*
 * The restart marker, PREFIX "guard" (a HASH without expiry), keeps the
 * evidence of whether the server still has every lock it granted:
 *   run    the run_id of the server run that last checked it
 *   dur    "1" while that run kept every write (appendonly yes and
 *          appendfsync always), at every connection made to it
 *   start  server ms from which locks may be missing (the run's start,
 *          or when the marker was found gone), or 0: none are
 *   floor  the server's time in microseconds when locks were last found
 *          possibly missing: every fence issued before is below it, and
 *          a fence counter not above it starts anew from the clock
 * Every new connection runs this script.  No marker: the data is lost, or
 * the server is new, which cannot be told apart: guarded from now.  Not
 * from the run's start: a server that kept running may have lost the
 * marker a moment ago (FLUSHALL, DEL), with locks whose holders renew
 * them for a ttl yet, and the first to find it gone may be a client that
 * never saw it.  A marker of another run: the server restarted with the
 * data of that run, complete only if that run kept every write (dur); we
 * ask the new run to keep every write too, or a run started without AOF
 * could have loaded an older snapshot that holds an old durable marker.
 * So the decision rests on what the old run was and what the new one
 * loaded, never on how the new run is configured alone.  A durable
 * restart keeps the old run's start while its guard may hold (by the ttl
 * record, our ttl and our guard): locks it lacked are still missing, and
 * their holders may never have met that run.  The script also raises the
 * ttl record, PREFIX "maxttl", to our longest ttl: a holder's renewal
 * thread connecting to a restarted server raises it again at once.
 *
 * KEYS: marker, ttl record.  ARGV: run_id, "1" when this run keeps every
 * write, its uptime in ms (a lower bound), our longest ttl, ms to keep the
 * record, our restart guard in ms.  Returns {start, record}.
 */
static const char script_mark[] =
	"local t = redis.call('TIME')\n"
	"local now = tonumber(t[1]) * 1000 + "
	"math.floor(tonumber(t[2]) / 1000)\n"
	"local g = { redis.call('HGET', KEYS[1], 'run'), "
	"redis.call('HGET', KEYS[1], 'dur'), "
	"redis.call('HGET', KEYS[1], 'start') }\n"
	"local floor = nil\n"
	"local start = now - tonumber(ARGV[3])\n"
	"local dur = ARGV[2]\n"
	"if start < 1 then start = 1 end\n"
	"if g[1] == ARGV[1] then\n"
	"  start = tonumber(g[3] or '1')\n"
	"  if g[2] ~= '1' then dur = '0' end\n"
	"elseif g[1] and g[1] ~= '?' and g[2] == '1' and dur == '1' then\n"
	"  start = tonumber(g[3] or '0')\n"
	"  local need = tonumber(redis.call('GET', KEYS[2]) or '0')\n"
	"  for _, v in ipairs({ARGV[4], ARGV[6]}) do\n"
	"    if need < tonumber(v) then need = tonumber(v) end\n"
	"  end\n"
	"  if start + need <= now then start = 0 end\n"
	"else\n"
	"  if not g[1] then\n"
	"    start = now\n"
	"  elseif g[1] == '?' and tonumber(g[3] or '0') > start then\n"
	"    start = tonumber(g[3])\n"
	"  end\n"
	"  floor = string.format('%.0f', tonumber(t[1]) * 1000000 + "
	"tonumber(t[2]))\n"
	"end\n"
	"start = string.format('%.0f', start)\n"
	"redis.call('HSET', KEYS[1], 'run', ARGV[1], 'dur', dur, "
	"'start', start)\n"
	"if floor then redis.call('HSET', KEYS[1], 'floor', floor) end\n"
	"local rec = tonumber(redis.call('GET', KEYS[2]) or '0')\n"
	"if rec < tonumber(ARGV[4]) then\n"
	"  rec = tonumber(ARGV[4])\n"
	"  redis.call('SET', KEYS[2], ARGV[4], 'PX', ARGV[5])\n"
	"end\n"
	"return {start, rec}\n";

/* Checks the restart marker on a new connection (see script_mark) and
 * records which server run c reached.  A changed run_id is a restart:
 * count it, and unless the marker shows that the server kept every lock,
 * the leases granted before it are gone. */
int
kl__redis_mark_server(struct kl__redis *r, struct kl__rconn *c, int64_t cap_ns,
		      kl_error *err)
{
	char up[24], ttl[24], keep[24], guard[24];
	const char *argv[11] = { "EVAL", script_mark, "2", r->gkey[0],
				 r->gkey[1], c->run_id,
				 c->persistent ? "1" : "0", up, ttl, keep,
				 guard };
	size_t lens[11] = { 4, sizeof script_mark - 1, 1, r->gkey_len[0],
			    r->gkey_len[1], strlen(c->run_id), 1 };
	redisReply *rep;
	int64_t deadline = kl__redis_cmd_deadline(r, KL_R_NO_DEADLINE, 0);
	bool trusted;
	int rc;

	if (cap_ns < deadline)
		deadline = cap_ns;
	pthread_mutex_lock(&r->mu);
	lens[8] = kl__redis_num(ttl, sizeof ttl, r->max_ttl_ms);
	lens[10] =
		kl__redis_num(guard, sizeof guard,
			      r->conf.restart_guard_ms != KL_R_GUARD_AUTO
				      ? r->conf.restart_guard_ms
			      : r->seen_ttl_ms > r->max_ttl_ms ? r->seen_ttl_ms
							       : r->max_ttl_ms);
	pthread_mutex_unlock(&r->mu);
	lens[7] = kl__redis_num(up, sizeof up, kl__rconn_uptime_ms(c));
	lens[9] = kl__redis_num(keep, sizeof keep, KL_R_FENCE_KEEP_MS);
	rc = kl__rconn_command(c, deadline, 11, argv, lens, &rep, err);
	if (rc != KL_OK)
		return rc;
	if (rep->type != REDIS_REPLY_ARRAY || rep->elements != 2 ||
	    rep->element[0]->type != REDIS_REPLY_STRING ||
	    rep->element[1]->type != REDIS_REPLY_INTEGER) {
		kl__error_set(err, KL_EPROVIDER,
				"redis provider: the restart marker could not "
				"be checked: %.160s",
				rep->type == REDIS_REPLY_ERROR ? rep->str
							       : "odd reply");
		freeReplyObject(rep);
		c->broken = true;
		return KL_EPROVIDER;
	}
	trusted = strcmp(rep->element[0]->str, "0") == 0;
	pthread_mutex_lock(&r->mu);
	if (rep->element[1]->integer > r->seen_ttl_ms)
		r->seen_ttl_ms = rep->element[1]->integer;
	if (r->run_id[0] == '\0') {
		memcpy(r->run_id, c->run_id, sizeof r->run_id);
	} else if (strcmp(r->run_id, c->run_id) != 0) {
		memcpy(r->run_id, c->run_id, sizeof r->run_id);
		r->epoch++;
		if (!trusted) {
			for (struct kl__rlease *l = r->leases; l != NULL;
			     l = l->next)
				if (l->epoch < r->epoch)
					l->lost = true;
			pthread_cond_broadcast(&r->cv);
		}
	}
	c->epoch = r->epoch;
	pthread_mutex_unlock(&r->mu);
	freeReplyObject(rep);
	return KL_OK;
}

/* The restart guard an attempt asks for: *ms (-1: off), whether the
 * server's ttl record also counts, and whether to refresh the record. */
void
kl__redis_guard_need(struct kl__redis *r, int64_t ttl_ms, int64_t *ms,
		     bool *use_rec, bool *refresh)
{
	int64_t now = kl__now_ns();

	pthread_mutex_lock(&r->mu);
	if (ttl_ms > r->max_ttl_ms)
		r->max_ttl_ms = ttl_ms;
	/* The record needs raising, or its expiry renewing now and then. */
	*refresh = ttl_ms > r->seen_ttl_ms || r->rec_ns == 0 ||
		   now - r->rec_ns >= RECORD_REFRESH_MS * KL_R_MS;
	if (*refresh)
		r->rec_ns = now;
	if (r->conf.restart_guard_ms == KL_R_GUARD_AUTO) {
		*ms = r->max_ttl_ms > r->seen_ttl_ms ? r->max_ttl_ms
						     : r->seen_ttl_ms;
		*use_rec = true;
	} else {
		*ms = r->conf.restart_guard_ms > 0 ? r->conf.restart_guard_ms
						   : -1;
		*use_rec = false;
	}
	pthread_mutex_unlock(&r->mu);
}
