-- Publish the health record unless a newer one is already there (a stale pass never
-- overwrites a newer snapshot).
-- KEYS[1] health key; ARGV[1] generation, ARGV[2] record JSON
local cur = redis.call('HGET', KEYS[1], 'generation')
if cur and tonumber(cur) > tonumber(ARGV[1]) then return 0 end
redis.call('HSET', KEYS[1], 'generation', ARGV[1], 'record', ARGV[2])
return 1
