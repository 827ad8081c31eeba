-- Publish the health record of one enforcement pass, unless the caller lost the leader lease
-- or a newer pass already published (a stale pass is dropped, never applied).
-- KEYS[1] health hash, KEYS[2] leader lease
-- ARGV[1] the pass generation, ARGV[2] record JSON, ARGV[3] the caller's lease token
-- Returns 'ok', 'stale' or 'not_leader'.
if redis.call('GET', KEYS[2]) ~= ARGV[3] then return 'not_leader' end
local cur = redis.call('HGET', KEYS[1], 'generation')
if cur and tonumber(cur) > tonumber(ARGV[1]) then return 'stale' end
redis.call('HSET', KEYS[1], 'generation', ARGV[1], 'record', ARGV[2])
return 'ok'
