-- Web submits a request: bounded queue, and a demand event when the model is not serving.
-- KEYS[1] queue, KEYS[2] model hash, KEYS[3] events, KEYS[4] fair tags, KEYS[5] users' finish
-- tags, KEYS[6] processing
-- ARGV[1] request JSON, ARGV[2] bound (-1 = none), ARGV[3] demand event JSON, ARGV[4] '1' when
-- the caller may cause a load, '0' when the model must be resident (ready, or loading already:
-- joining a load someone else caused loads nothing), ARGV[5] '1' to queue it in its fair place
-- among the users (see _fair.lua), '0' at the end of the line (plain FIFO), ARGV[6] its user,
-- ARGV[7] its cost in fair queueing (1 / the user's weight)
-- Returns {1, depth} when queued, {0, depth} when the queue is full, {2, state} when the model
-- is not resident and the caller may not load it.
local state = redis.call('HGET', KEYS[2], 'state') or 'unloaded'
if ARGV[4] == '0' and state ~= 'ready' and state ~= 'loading' then return {2, state} end
local depth = redis.call('LLEN', KEYS[1])
local bound = tonumber(ARGV[2])
if bound >= 0 and depth >= bound then return {0, depth} end
if ARGV[5] == '1' then
  fair_insert(KEYS[4], KEYS[5], KEYS[1], KEYS[6], ARGV[1], ARGV[6], tonumber(ARGV[7]))
else
  redis.call('LPUSH', KEYS[1], ARGV[1])
end
if state ~= 'ready' then
  redis.call('RPUSH', KEYS[3], ARGV[3])
end
return {1, depth + 1}
