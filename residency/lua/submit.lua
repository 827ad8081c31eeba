-- Web submits a request: bounded queue, and a demand event when the model is not serving.
-- KEYS[1] queue, KEYS[2] model hash, KEYS[3] events
-- ARGV[1] request JSON, ARGV[2] bound (-1 = none), ARGV[3] demand event JSON, ARGV[4] '1' when
-- the caller may cause a load, '0' when the model must be resident (ready, or loading already:
-- joining a load someone else caused loads nothing)
-- Returns {1, depth} when queued, {0, depth} when the queue is full, {2, state} when the model
-- is not resident and the caller may not load it.
local state = redis.call('HGET', KEYS[2], 'state') or 'unloaded'
if ARGV[4] == '0' and state ~= 'ready' and state ~= 'loading' then return {2, state} end
local depth = redis.call('LLEN', KEYS[1])
local bound = tonumber(ARGV[2])
if bound >= 0 and depth >= bound then return {0, depth} end
redis.call('LPUSH', KEYS[1], ARGV[1])
if state ~= 'ready' then
  redis.call('RPUSH', KEYS[3], ARGV[3])
end
return {1, depth + 1}
