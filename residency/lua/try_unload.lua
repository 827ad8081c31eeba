-- The model process decides its own unload: it commits only if nothing is queued or in flight;
-- otherwise it refuses ("rescued") and goes back to ready, and the coordinator re-plans. A
-- yielding model is rescued only by a request in flight: its queued requests wait for its next
-- load (the slot goes to the model it yields to).
-- KEYS[1] model hash, KEYS[2] queue, KEYS[3] processing, KEYS[4] events, KEYS[5] fair tags,
-- KEYS[6] users' finish tags
-- ARGV[1] token, ARGV[2] sources for unloaded (csv), ARGV[3] sources for ready (csv),
-- ARGV[4] unloaded event JSON, ARGV[5] rescued event JSON
local queued = redis.call('LLEN', KEYS[2]) > 0 and not redis.call('HGET', KEYS[1], 'yielding')
if queued or redis.call('LLEN', KEYS[3]) > 0 then
  local ok, prev = cas(KEYS[1], 'ready', ARGV[3], ARGV[1])
  if not ok then return prev end
  redis.call('HDEL', KEYS[1], 'draining_since', 'drain_t')
  redis.call('RPUSH', KEYS[4], ARGV[5])
  return 'rescued'
end
local ok, prev = cas(KEYS[1], 'unloaded', ARGV[2], ARGV[1])
if not ok then return prev end
-- Where it ran is kept (last_host, last_device): its next load goes there when it fits.
local where = redis.call('HMGET', KEYS[1], 'host', 'device')
if where[1] and where[2] then
  redis.call('HSET', KEYS[1], 'last_host', where[1], 'last_device', where[2])
end
-- How long its unload took (the router waits that long for the room of an idle resident), on
-- Redis's clock from begin_drain.lua's drain_t.
local since = tonumber(redis.call('HGET', KEYS[1], 'drain_t') or '')
if since then
  local t = redis.call('TIME')
  local took = tonumber(t[1]) + tonumber(t[2]) / 1e6 - since
  redis.call('HSET', KEYS[1], 'unload_s', string.format('%.3f', math.max(0, took)))
end
redis.call('HDEL', KEYS[1], 'pid', 'host', 'device', 'draining_since', 'drain_t',
  'loading_since')
-- Nothing left in flight: the fair tags of requests dropped without a finish go too (a
-- yielding model's queued requests keep theirs for its next load).
if redis.call('LLEN', KEYS[2]) == 0 then redis.call('DEL', KEYS[5], KEYS[6]) end
redis.call('RPUSH', KEYS[4], ARGV[4])
return 'unloaded'
