-- Publish the health record of one enforcement pass, unless the caller lost the leader lease
-- or a newer pass already published (a stale pass is dropped, never applied).
-- KEYS[1] health hash, KEYS[2] leader lease
-- ARGV[1] the pass generation, ARGV[2] record JSON, ARGV[3] the caller's lease token,
-- ARGV[4] (optional) the same pass's route room JSON: written in the same step, so the router
-- never reads a room of another pass than the record's
-- Returns 'ok', 'stale' or 'not_leader'.
if redis.call('GET', KEYS[2]) ~= ARGV[3] then return 'not_leader' end
local cur = redis.call('HGET', KEYS[1], 'generation')
if cur and tonumber(cur) > tonumber(ARGV[1]) then return 'stale' end
if ARGV[4] then
  redis.call('HSET', KEYS[1], 'generation', ARGV[1], 'record', ARGV[2], 'route_room', ARGV[4])
else
  redis.call('HSET', KEYS[1], 'generation', ARGV[1], 'record', ARGV[2])
end
return 'ok'
