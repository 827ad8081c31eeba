-- The coordinator evicts: only an idle, ready model of the expected load token is moved to
-- draining, and its model process is told to unload, in one step. A yielding model (it gives its
-- slot to a waiting model and takes nothing from its queue) may go with requests queued: they
-- stay queued for its next load. Never with a request in flight.
-- KEYS[1] model hash, KEYS[2] queue, KEYS[3] processing, KEYS[4] control list, KEYS[5] leader
-- ARGV[1] allowed sources (csv), ARGV[2] token, ARGV[3] control JSON, ARGV[4] now,
-- ARGV[5] the caller's leader lease token (fencing)
-- Returns 'ok', 'busy', 'not_leader' or the refusing state.
if redis.call('GET', KEYS[5]) ~= ARGV[5] then return 'not_leader' end
if redis.call('LLEN', KEYS[3]) > 0 then return 'busy' end
if redis.call('LLEN', KEYS[2]) > 0 and not redis.call('HGET', KEYS[1], 'yielding') then
  return 'busy'
end
local ok, prev = cas(KEYS[1], 'draining', ARGV[1], ARGV[2])
if not ok then return prev end
-- drain_t: the same moment on Redis's clock, which try_unload.lua measures the unload by (the
-- coordinator's clock may be another host's).
local t = redis.call('TIME')
redis.call('HSET', KEYS[1], 'draining_since', ARGV[4],
  'drain_t', string.format('%.6f', tonumber(t[1]) + tonumber(t[2]) / 1e6))
redis.call('RPUSH', KEYS[4], ARGV[3])
return 'ok'
