-- Web submits a request: bounded queue shared fairly between its users, and a demand event
-- when the model is not serving.
-- KEYS[1] queue, KEYS[2] model hash, KEYS[3] events, KEYS[4] fair tags, KEYS[5] users' hash
-- (finish tags and owners, see _fair.lua), KEYS[6] processing, KEYS[7] the reply stream of the
-- request to push out (only on the second call, see below)
-- ARGV[1] request JSON, ARGV[2] bound (-1 = none), ARGV[3] demand event JSON, ARGV[4] '1' when
-- the caller may cause a load, '0' when the model must be resident (ready, or loading already:
-- joining a load someone else caused loads nothing), ARGV[5] '1' to queue it in its fair place
-- among the users (see _fair.lua), '0' at the end of the line (plain FIFO), ARGV[6] its user,
-- ARGV[7] its cost in fair queueing (1 / the user's weight), ARGV[8] the user's weight, ARGV[9]
-- its request id, ARGV[10] the id of the request to push out ('' on the first call), ARGV[11]
-- that request's error reply JSON, ARGV[12] the reply TTL seconds
-- Returns {1, depth} when queued ({1, depth, pushed out id} when a request made room for it),
-- {0, depth} when the queue is full, {2, state} when the model is not resident and the caller
-- may not load it, {3, depth, id} when the queue is full but the caller is within its share
-- and request `id` should make room: the caller calls again with that request's reply stream
-- (a script cannot name a key it was not given) and its id, and this script pushes it out if
-- it is still the one to go — else it answers 3 again with the one that is.
local state = redis.call('HGET', KEYS[2], 'state') or 'unloaded'
if ARGV[4] == '0' and state ~= 'ready' and state ~= 'loading' then return {2, state} end
local depth = redis.call('LLEN', KEYS[1])
local bound = tonumber(ARGV[2])
local pushed = nil
if bound >= 0 and depth >= bound then
  local victim = share_victim(KEYS[5], KEYS[1], KEYS[6], depth, bound, ARGV[6],
    tonumber(ARGV[8]))
  if not victim then return {0, depth} end
  pushed = request_id(victim)
  if pushed ~= ARGV[10] or not KEYS[7] then return {3, depth, pushed} end
  -- Out of the queue together with its 429, like reject_oldest.lua: its web thread, blocked on
  -- its reply stream, answers its client at once.
  redis.call('LREM', KEYS[1], 1, victim)
  fair_forget(KEYS[4], KEYS[5], KEYS[1], KEYS[6], victim)
  redis.call('XADD', KEYS[7], '*', 't', 'error', 'd', ARGV[11])
  redis.call('EXPIRE', KEYS[7], tonumber(ARGV[12]))
end
if ARGV[5] == '1' then
  fair_insert(KEYS[4], KEYS[5], KEYS[1], KEYS[6], ARGV[1], ARGV[6], tonumber(ARGV[7]))
else
  fair_reset_if_empty(KEYS[4], KEYS[5], KEYS[1], KEYS[6])
  redis.call('LPUSH', KEYS[1], ARGV[1])
end
redis.call('HSET', KEYS[5], 'o' .. ARGV[9], ARGV[8] .. ' ' .. ARGV[6])
if state ~= 'ready' then
  redis.call('RPUSH', KEYS[3], ARGV[3])
end
if pushed then return {1, depth, pushed} end
return {1, depth + 1}
