/* SPDX-License-Identifier: MIT */
/*
 * The Lua scripts of the Redis provider, and how a connection runs them:
 * EVALSHA with the digest that SCRIPT LOAD gave when the connection was
 * made (redis_conn.c), and EVAL with the text when the server has lost its
 * script cache.  The data model, and the invariants the scripts keep, are
 * described above them.
 */
#include "config.h"

#include <stdio.h>
#include <string.h>

#include "redis_internal.h"

/*
 * Data of one lock key, all under PREFIX{SHA256(key)} so that a Redis
 * Cluster hash tag would keep them in one slot:
 *   PREFIX{h}        the exclusive holder's random token, with PX = its ttl
 *   PREFIX{h}:s      ZSET of shared holders' tokens, score = the server ms
 *                    at which each expires; the key expires with the last
 *   PREFIX{h}:sm     HASH shared holder's token -> "fence since-ms"
 *   PREFIX{h}:q      ZSET of waiter tokens, score = the server's time in
 *                    microseconds when each joined, kept strictly
 *                    increasing (FIFO)
 *   PREFIX{h}:hb     HASH waiter token -> heartbeat deadline (server ms)
 *   PREFIX{h}:f      the last fence handed out
 *   PREFIX{h}:w:TOK  LIST a waiter blocks on (BLPOP) to be woken
 * A token says its mode: a shared request's starts with "s", an exclusive
 * one's is hex digits only.  One queue holds both modes.
 *
 * Invariants kept by running every change as one script (atomic):
 * - the W3C Web Locks rule: an exclusive request is granted only when no
 *   token holds the key (exclusive, or shared and unexpired) and it is the
 *   first live waiter, or nobody live waits; a shared request only when no
 *   exclusive token holds the key and every live waiter ahead of it (the
 *   whole queue, for a new request) is shared: the run of shared requests
 *   at the head goes in together, and a shared request never passes a
 *   queued exclusive one; no barging;
 * - a waiter is live while its heartbeat deadline is ahead of the server
 *   clock; dead ones are removed when met at the head, and skipped
 *   elsewhere, so a waiter that died blocks the others at most for its
 *   heartbeat;
 * - only the owner's token deletes or extends a grant (compare-and-delete,
 *   compare-and-PEXPIRE, and for shared ones compare-and-ZADD on an
 *   unexpired score); a shared grant whose score has passed is gone,
 *   exactly as a key whose PX ran out, and scripts sweep such ones away;
 * - whoever changes the key (release, a waiter leaving, an attempt that
 *   queues) wakes every waiter the queue grants now (wake_next): the
 *   first live waiter when it is exclusive and nothing holds the key, the
 *   run of live shared waiters at the head when no exclusive token does;
 *   waiters also re-check on a timer, so a lost wake-up, or a holder that
 *   expired, only delays;
 * - the fence is a counter started from the server's time in microseconds,
 *   started anew from it after a restart that may have lost or rolled back
 *   counters (see NEXT_FENCE): it grows with every grant of either mode,
 *   whatever the server restored;
 * - no grant while the restart guard holds (see script_attempt);
 * - the queue, heartbeats and wake lists expire by themselves (PEXPIRE at
 *   twice the heartbeat, refreshed by live waiters), the shared holders'
 *   keys with their last holder, so nothing is left behind by clients that
 *   died.
 * Numbers are written with %.0f: Lua's default formatting would turn a
 * 16-digit microsecond count into an exponent.
 */
#define PRELUDE                                                            \
	"local t = redis.call('TIME')\n"                                   \
	"local now = tonumber(t[1]) * 1000 + "                             \
	"math.floor(tonumber(t[2]) / 1000)\n"                              \
	"local function is_shared(tk)\n"                                   \
	"  return string.sub(tk, 1, 1) == 's'\n"                           \
	"end\n"                                                            \
	"local function live(hb, h)\n"                                     \
	"  return tonumber(redis.call('HGET', hb, h) or '0') > now\n"      \
	"end\n"                                                            \
	"local function head(lock, q, hb)\n"                               \
	"  while true do\n"                                                \
	"    local h = redis.call('ZRANGE', q, 0, 0)[1]\n"                 \
	"    if not h then return nil end\n"                               \
	"    if live(hb, h) then return h end\n"                           \
	"    redis.call('ZREM', q, h)\n"                                   \
	"    redis.call('HDEL', hb, h)\n"                                  \
	"    redis.call('DEL', lock .. ':w:' .. h)\n"                      \
	"  end\n"                                                          \
	"end\n"                                                            \
	"local function wake(lock, h, ms)\n"                               \
	"  local w = lock .. ':w:' .. h\n"                                 \
	"  if redis.call('LLEN', w) == 0 then\n"                           \
	"    redis.call('LPUSH', w, '1')\n"                                \
	"    redis.call('PEXPIRE', w, ms)\n"                               \
	"  end\n"                                                          \
	"end\n"                                                            \
	"local function nshared(s, sm)\n"                                  \
	"  for _, m in ipairs(redis.call('ZRANGEBYSCORE', s, '-inf', "     \
	"now)) do\n"                                                       \
	"    redis.call('ZREM', s, m)\n"                                   \
	"    redis.call('HDEL', sm, m)\n"                                  \
	"  end\n"                                                          \
	"  return redis.call('ZCARD', s)\n"                                \
	"end\n"                                                            \
	"local function shared_ahead(q, hb, tk)\n"                         \
	"  local r = redis.call('ZRANK', q, tk)\n"                         \
	"  local i = 0\n"                                                  \
	"  while true do\n"                                                \
	"    local last = i + 63\n"                                        \
	"    if r and last > r - 1 then last = r - 1 end\n"                \
	"    if last < i then return true end\n"                           \
	"    local ms = redis.call('ZRANGE', q, i, last)\n"                \
	"    if #ms == 0 then return true end\n"                           \
	"    for _, m in ipairs(ms) do\n"                                  \
	"      if not is_shared(m) and live(hb, m) then return false end\n" \
	"    end\n"                                                        \
	"    i = last + 1\n"                                               \
	"  end\n"                                                          \
	"end\n"                                                            \
	"local function wake_next(lock, q, hb, s, sm, ms)\n"               \
	"  if redis.call('EXISTS', lock) == 1 then return end\n"           \
	"  local h = head(lock, q, hb)\n"                                  \
	"  if not h then return end\n"                                     \
	"  if not is_shared(h) then\n"                                     \
	"    if nshared(s, sm) == 0 then wake(lock, h, ms) end\n"          \
	"    return\n"                                                     \
	"  end\n"                                                          \
	"  local i = 0\n"                                                  \
	"  while true do\n"                                                \
	"    local run = redis.call('ZRANGE', q, i, i + 63)\n"             \
	"    if #run == 0 then return end\n"                               \
	"    for _, m in ipairs(run) do\n"                                 \
	"      if live(hb, m) then\n"                                      \
	"        if not is_shared(m) then return end\n"                    \
	"        wake(lock, m, ms)\n"                                      \
	"      end\n"                                                      \
	"    end\n"                                                        \
	"    i = i + 64\n"                                                 \
	"  end\n"                                                          \
	"end\n"

/* Keeps key k (a shared holders' key) alive for at least ms. */
#define KEEP_FOR                                                           \
	"local function keep_for(k, ms)\n"                                 \
	"  if redis.call('PTTL', k) < ms then\n"                           \
	"    redis.call('PEXPIRE', k, ms)\n"                               \
	"  end\n"                                                          \
	"end\n"

/* The next fence of KEYS[4], whose key lives ARGV[5] ms from its creation:
 * the counter's next value, or the server's time in microseconds when
 * there was no counter (new key, expired) or the counter is not above the
 * marker's floor.  A counter started from the clock at T counts at most
 * one per grant, and a grant takes two scripts, far more than a
 * microsecond of the server's time, so the value stays below the clock.
 * The floor is the server's time in microseconds when locks were found
 * possibly missing (see script_mark in redis_guard.c): a restart that
 * lost data or rolled it back to a snapshot, a marker gone.  Every fence
 * issued before that is below the floor, so a counter the server restored
 * (older, or none) is drawn anew from the clock, above every fence before
 * it, as long as the clock does not go back.  INCR keeps the key's
 * expiry, so the fast path costs one command; only a new counter pays
 * TIME and SET.  Shared and exclusive grants draw from the one counter. */
#define NEXT_FENCE                                                         \
	"  local fence = redis.call('INCR', KEYS[4])\n"                     \
	"  if fence == 1 or fence <= floor then\n"                          \
	"    local ft = redis.call('TIME')\n"                               \
	"    fence = string.format('%.0f', tonumber(ft[1]) * 1000000 + "    \
	"tonumber(ft[2]))\n"                                                \
	"    redis.call('SET', KEYS[4], fence, 'PX', ARGV[5])\n"            \
	"  end\n"

/* KEYS: lock, q, hb, f, own wake list, the restart marker, the ttl
 * record, shared holders, their fences.  ARGV: token (a shared request's
 * starts with "s"), ttl ms, heartbeat ms, mode ("try": never queue;
 * "join": join the queue, a first attempt; "wait": stay in the queue, the
 * caller may have joined it before), ms to keep the fence and the ttl
 * record, the restart guard in ms (-1: off), "1" when the guard is at
 * least the ttl record, "1" to raise the ttl record to our ttl and renew
 * its expiry (the client does so now and then: it spares the fast path
 * two commands).  Returns {1, fence, record} when granted (also when the
 * key is already ours: a retry after a lost reply), else {0, rank or -1,
 * record, ms the restart guard still holds}; the record is 0 when it was
 * not read.  A retry sets the ttl again: the caller counts the lease from
 * when it sent the retry, so the key must not expire a ttl after the
 * first, unanswered attempt.
 *
 * The ttl record is the longest ttl any client asked for, kept for a day
 * after the last refresh; it is read whenever the guard may hold.  The
 * restart marker (HASH run, dur, start, floor; see redis_guard.c) says
 * since when, in server ms, the server may lack locks that old holders
 * still believe they hold (0: it lacks none), and the fence floor.  While
 * start + the guard is ahead of the server clock nothing is granted, in
 * either mode: the caller queues and waits as behind a holder.  A marker
 * that vanished while the server ran (FLUSHALL, DEL) took the locks with
 * it: the guard and the floor run from now.
 *
 * Fast path, the uncontended exclusive case: no queue key means nobody
 * waits (Redis deletes a queue emptied by its last ZREM, and a queue that
 * expired had only dead waiters), and no shared holders' key means none
 * holds, so a free key is granted by SET NX at once, without the queue,
 * heartbeat and wake keys.  Only a "wait" caller (its queue expired
 * meanwhile) also drops its heartbeat and wake list.  Anything else
 * (held, ours already, a queue, shared holders, a shared request, the
 * guard) takes the full way below. */
static const char script_attempt[] =
	"local tok = ARGV[1]\n"
	"local rec = 0\n"
	"if ARGV[8] == '1' then\n"
	"  rec = tonumber(redis.call('GET', KEYS[7]) or '0')\n"
	"  if rec < tonumber(ARGV[2]) then\n"
	"    rec = tonumber(ARGV[2])\n"
	"    redis.call('SET', KEYS[7], ARGV[2], 'PX', ARGV[5])\n"
	"  elseif redis.call('PTTL', KEYS[7]) < tonumber(ARGV[5]) / 2 then\n"
	"    redis.call('PEXPIRE', KEYS[7], ARGV[5])\n"
	"  end\n"
	"end\n"
	"local left = 0\n"
	"local need = tonumber(ARGV[6])\n"
	"local mk = redis.call('HMGET', KEYS[6], 'start', 'floor')\n"
	"local gs = mk[1]\n"
	"local floor = tonumber(mk[2] or '0')\n"
	"if not gs or (need > 0 and gs ~= '0') then\n"
	"  local gt = redis.call('TIME')\n"
	"  local gnow = tonumber(gt[1]) * 1000 + "
	"math.floor(tonumber(gt[2]) / 1000)\n"
	"  if not gs then\n"
	"    gs = string.format('%.0f', gnow)\n"
	"    floor = tonumber(gt[1]) * 1000000 + tonumber(gt[2])\n"
	"    redis.call('HSET', KEYS[6], 'run', '?', 'dur', '0', 'start', gs,\n"
	"               'floor', string.format('%.0f', floor))\n"
	"  end\n"
	"  if ARGV[7] == '1' then\n"
	"    if ARGV[8] ~= '1' then\n"
	"      rec = tonumber(redis.call('GET', KEYS[7]) or '0')\n"
	"    end\n"
	"    if rec > need then need = rec end\n"
	"  end\n"
	"  if need > 0 then left = tonumber(gs) + need - gnow end\n"
	"end\n"
	"local sh = string.sub(tok, 1, 1) == 's'\n"
	"if left <= 0 and not sh and redis.call('EXISTS', KEYS[2]) == 0 and\n"
	"   redis.call('EXISTS', KEYS[8]) == 0 and\n"
	"   redis.call('SET', KEYS[1], tok, 'NX', 'PX', ARGV[2]) then\n"
	NEXT_FENCE
	"  if ARGV[4] == 'wait' then\n"
	"    redis.call('HDEL', KEYS[3], tok)\n"
	"    redis.call('DEL', KEYS[5])\n"
	"  end\n"
	"  return {1, fence, rec}\n"
	"end\n"
	"if left < 0 then left = 0 end\n"
	PRELUDE
	KEEP_FOR
	"local hbms = tonumber(ARGV[3])\n"
	"local ttl = tonumber(ARGV[2])\n"
	"local holder = redis.call('GET', KEYS[1])\n"
	"if sh then\n"
	"  local e = redis.call('ZSCORE', KEYS[8], tok)\n"
	"  if e and tonumber(e) > now then\n"
	"    redis.call('ZADD', KEYS[8], string.format('%.0f', now + ttl), "
	"tok)\n"
	"    keep_for(KEYS[8], ttl)\n"
	"    keep_for(KEYS[9], ttl)\n"
	"    local m = redis.call('HGET', KEYS[9], tok) or '0'\n"
	"    return {1, string.match(m, '^%d+') or '0', rec}\n"
	"  end\n"
	"elseif holder == tok then\n"
	"  redis.call('PEXPIRE', KEYS[1], ARGV[2])\n"
	"  return {1, redis.call('GET', KEYS[4]) or '0', rec}\n"
	"end\n"
	"local h = head(KEYS[1], KEYS[2], KEYS[3])\n"
	"local ok = false\n"
	"if not holder and left == 0 then\n"
	"  if sh then\n"
	"    ok = shared_ahead(KEYS[2], KEYS[3], tok)\n"
	"  else\n"
	"    ok = (not h or h == tok) and nshared(KEYS[8], KEYS[9]) == 0\n"
	"  end\n"
	"end\n"
	"if ok then\n"
	NEXT_FENCE
	"  if sh then\n"
	/* Sweeps holders that expired: nothing else does while only shared
	 * requests come, and each grant pushes the keys' expiry back, so
	 * the entries of holders that died would pile up for ever. */
	"    nshared(KEYS[8], KEYS[9])\n"
	"    redis.call('ZADD', KEYS[8], string.format('%.0f', now + ttl), "
	"tok)\n"
	"    redis.call('HSET', KEYS[9], tok, "
	"string.format('%.0f %.0f', fence, now))\n"
	"    keep_for(KEYS[8], ttl)\n"
	"    keep_for(KEYS[9], ttl)\n"
	"  else\n"
	"    redis.call('SET', KEYS[1], tok, 'PX', ARGV[2])\n"
	"  end\n"
	"  redis.call('ZREM', KEYS[2], tok)\n"
	"  redis.call('HDEL', KEYS[3], tok)\n"
	"  redis.call('DEL', KEYS[5])\n"
	"  return {1, fence, rec}\n"
	"end\n"
	"if ARGV[4] == 'try' then return {0, -1, rec, left} end\n"
	"if not redis.call('ZSCORE', KEYS[2], tok) then\n"
	"  local last = redis.call('ZRANGE', KEYS[2], -1, -1, 'WITHSCORES')\n"
	"  local score = tonumber(t[1]) * 1000000 + tonumber(t[2])\n"
	"  if last[2] and tonumber(last[2]) >= score then\n"
	"    score = tonumber(last[2]) + 1\n"
	"  end\n"
	"  redis.call('ZADD', KEYS[2], string.format('%.0f', score), tok)\n"
	"end\n"
	"redis.call('HSET', KEYS[3], tok, string.format('%.0f', now + hbms))\n"
	"local keep = hbms * 2\n"
	"for _, k in ipairs({KEYS[2], KEYS[3]}) do\n"
	"  keep_for(k, keep)\n"
	"end\n"
	"if left == 0 then\n"
	"  wake_next(KEYS[1], KEYS[2], KEYS[3], KEYS[8], KEYS[9], keep)\n"
	"end\n"
	"return {0, redis.call('ZRANK', KEYS[2], tok), rec, left}\n";

/* KEYS: lock, q, hb, shared holders, their fences.  ARGV: token,
 * heartbeat ms.  Ends the token's grant only if it still holds (an
 * exclusive key that is the token's; a shared score not yet passed) and
 * wakes the waiters the queue grants now; returns 1, else 0.  An
 * exclusive release with no queue key (nobody waits) is GET, DEL and
 * EXISTS, with no wake-up work. */
static const char script_release[] =
	"local tok = ARGV[1]\n"
	"local sh = string.sub(tok, 1, 1) == 's'\n"
	"if not sh then\n"
	"  if redis.call('GET', KEYS[1]) ~= tok then return 0 end\n"
	"  redis.call('DEL', KEYS[1])\n"
	"  if redis.call('EXISTS', KEYS[2]) == 0 then return 1 end\n"
	"end\n"
	PRELUDE
	"local r = 1\n"
	"if sh then\n"
	"  r = 0\n"
	"  local e = redis.call('ZSCORE', KEYS[4], tok)\n"
	"  if e then\n"
	"    redis.call('ZREM', KEYS[4], tok)\n"
	"    redis.call('HDEL', KEYS[5], tok)\n"
	"    if tonumber(e) > now then r = 1 end\n"
	"  end\n"
	"  if redis.call('EXISTS', KEYS[2]) == 0 then return r end\n"
	"end\n"
	"wake_next(KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], "
	"tonumber(ARGV[2]) * 2)\n"
	"return r\n";

/* KEYS: lock, q, hb, own wake list, shared holders, their fences.  ARGV:
 * token, heartbeat ms.  A waiter giving up: leaves the queue and, if the
 * key came to it after all (a lost reply), releases it; wakes the waiters
 * the queue grants now (a shared run behind a leaving exclusive one).
 * Returns 1 when it released a grant, else 0. */
static const char script_leave[] =
	PRELUDE
	"local tok = ARGV[1]\n"
	"redis.call('ZREM', KEYS[2], tok)\n"
	"redis.call('HDEL', KEYS[3], tok)\n"
	"redis.call('DEL', KEYS[4])\n"
	"local r = 0\n"
	"if is_shared(tok) then\n"
	"  local e = redis.call('ZSCORE', KEYS[5], tok)\n"
	"  if e then\n"
	"    redis.call('ZREM', KEYS[5], tok)\n"
	"    redis.call('HDEL', KEYS[6], tok)\n"
	"    if tonumber(e) > now then r = 1 end\n"
	"  end\n"
	"elseif redis.call('GET', KEYS[1]) == tok then\n"
	"  redis.call('DEL', KEYS[1])\n"
	"  r = 1\n"
	"end\n"
	"wake_next(KEYS[1], KEYS[2], KEYS[3], KEYS[5], KEYS[6], "
	"tonumber(ARGV[2]) * 2)\n"
	"return r\n";

/* KEYS: lock, shared holders, their fences.  ARGV: token, ttl ms.
 * Extends the grant only if the token holds it (a shared score not yet
 * passed): 1, else 0. */
static const char script_renew[] =
	"local tok = ARGV[1]\n"
	"if string.sub(tok, 1, 1) ~= 's' then\n"
	"  if redis.call('GET', KEYS[1]) == tok then\n"
	"    redis.call('PEXPIRE', KEYS[1], ARGV[2])\n"
	"    return 1\n"
	"  end\n"
	"  return 0\n"
	"end\n"
	"local t = redis.call('TIME')\n"
	"local now = tonumber(t[1]) * 1000 + "
	"math.floor(tonumber(t[2]) / 1000)\n"
	KEEP_FOR
	"local ttl = tonumber(ARGV[2])\n"
	"local e = redis.call('ZSCORE', KEYS[2], tok)\n"
	"if not e or tonumber(e) <= now then return 0 end\n"
	"redis.call('ZADD', KEYS[2], string.format('%.0f', now + ttl), tok)\n"
	"keep_for(KEYS[2], ttl)\n"
	"keep_for(KEYS[3], ttl)\n"
	"return 1\n";

/* KEYS: lock, q, hb, shared holders.  Returns {holders (the exclusive one
 * and every unexpired shared one), live waiters}; changes nothing. */
static const char script_status[] =
	"local t = redis.call('TIME')\n"
	"local now = tonumber(t[1]) * 1000 + "
	"math.floor(tonumber(t[2]) / 1000)\n"
	"local w = 0\n"
	"for _, m in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do\n"
	"  if tonumber(redis.call('HGET', KEYS[3], m) or '0') > now then\n"
	"    w = w + 1\n"
	"  end\n"
	"end\n"
	"return {redis.call('EXISTS', KEYS[1]) + redis.call('ZCOUNT', "
	"KEYS[4], '(' .. string.format('%.0f', now), '+inf'), w}\n";

/* KEYS: lock, q, hb, f, shared holders, their fences.  Returns the state
 * of one key at one moment, changing nothing: {holders, waiters, then per
 * holder: "s" or "x", fence, ms held (-1: unknown), then per live waiter
 * in queue order: "s" or "x", ms waited}.  The exclusive holder's fence is
 * the counter: no grant can follow it while it holds. */
static const char script_snapshot[] =
	"local t = redis.call('TIME')\n"
	"local now = tonumber(t[1]) * 1000 + "
	"math.floor(tonumber(t[2]) / 1000)\n"
	"local nowus = tonumber(t[1]) * 1000000 + tonumber(t[2])\n"
	"local out = {0, 0}\n"
	"if redis.call('EXISTS', KEYS[1]) == 1 then\n"
	"  out[1] = 1\n"
	"  table.insert(out, 'x')\n"
	"  table.insert(out, redis.call('GET', KEYS[4]) or '0')\n"
	"  table.insert(out, -1)\n"
	"end\n"
	"local s = redis.call('ZRANGEBYSCORE', KEYS[5], '(' .. "
	"string.format('%.0f', now), '+inf')\n"
	"for _, m in ipairs(s) do\n"
	"  local v = redis.call('HGET', KEYS[6], m) or ''\n"
	"  local f, since = string.match(v, '^(%d+) (%d+)$')\n"
	"  out[1] = out[1] + 1\n"
	"  table.insert(out, 's')\n"
	"  table.insert(out, f or '0')\n"
	"  if since then\n"
	"    local e = now - tonumber(since)\n"
	"    if e < 0 then e = 0 end\n"
	"    table.insert(out, e)\n"
	"  else\n"
	"    table.insert(out, -1)\n"
	"  end\n"
	"end\n"
	"local q = redis.call('ZRANGE', KEYS[2], 0, -1, 'WITHSCORES')\n"
	"for i = 1, #q, 2 do\n"
	"  if tonumber(redis.call('HGET', KEYS[3], q[i]) or '0') > now then\n"
	"    local e = math.floor((nowus - tonumber(q[i + 1])) / 1000)\n"
	"    if e < 0 then e = 0 end\n"
	"    out[2] = out[2] + 1\n"
	"    if string.sub(q[i], 1, 1) == 's' then\n"
	"      table.insert(out, 's')\n"
	"    else\n"
	"      table.insert(out, 'x')\n"
	"    end\n"
	"    table.insert(out, e)\n"
	"  end\n"
	"end\n"
	"return out\n";


const char *const kl__redis_scripts[KL_RS_COUNT] = {
	[KL_RS_ATTEMPT] = script_attempt,
	[KL_RS_RELEASE] = script_release,
	[KL_RS_LEAVE] = script_leave,
	[KL_RS_RENEW] = script_renew,
	[KL_RS_STATUS] = script_status,
	[KL_RS_SNAPSHOT] = script_snapshot,
};

#define MAX_SCRIPT_ARGS 24

int
kl__rconn_script(struct kl__rconn *c, int64_t deadline_ns,
		 enum kl__redis_script id, int nkeys, const char **keys,
		 const size_t *klens, int nargs, const char **args,
		 const size_t *alens, redisReply **reply, kl_error *err)
{
	const char *argv[3 + MAX_SCRIPT_ARGS];
	size_t lens[3 + MAX_SCRIPT_ARGS];
	char nk[12];
	int argc = 0, rc;

	*reply = NULL;
	if (nkeys + nargs > MAX_SCRIPT_ARGS)
		return KL_EINVAL;
	snprintf(nk, sizeof nk, "%d", nkeys);
	argv[argc] = "EVALSHA";
	lens[argc++] = 7;
	argv[argc] = c->sha[id];
	lens[argc++] = strlen(c->sha[id]);
	argv[argc] = nk;
	lens[argc++] = strlen(nk);
	for (int i = 0; i < nkeys; i++, argc++) {
		argv[argc] = keys[i];
		lens[argc] = klens[i];
	}
	for (int i = 0; i < nargs; i++, argc++) {
		argv[argc] = args[i];
		lens[argc] = alens[i];
	}
	rc = kl__rconn_command(c, deadline_ns, argc, argv, lens, reply, err);
	if (rc == KL_OK && (*reply)->type == REDIS_REPLY_ERROR &&
	    strncmp((*reply)->str, "NOSCRIPT", 8) == 0) {
		/* The server lost its script cache (SCRIPT FLUSH): send the
		 * text, which also caches it again. */
		freeReplyObject(*reply);
		argv[0] = "EVAL";
		lens[0] = 4;
		argv[1] = kl__redis_scripts[id];
		lens[1] = strlen(kl__redis_scripts[id]);
		rc = kl__rconn_command(c, deadline_ns, argc, argv, lens, reply,
				       err);
	}
	if (rc == KL_OK && (*reply)->type == REDIS_REPLY_ERROR) {
		kl__error_set(err, KL_EPROVIDER,
				"redis provider: the server refused a "
				"script: %.160s",
				(*reply)->str);
		freeReplyObject(*reply);
		*reply = NULL;
		return KL_EPROVIDER;
	}
	return rc;
}
