-- Record the effective limits a pass enforces, stamped with its generation, when they changed.
-- A load commit compares the generation its load was decided under with this one.
-- KEYS[1] limits hash, KEYS[2] leader lease
-- ARGV[1] the pass generation, ARGV[2] the caller's lease token, ARGV[3..] model type / limit
-- pairs (one per type: each type is its own pool)
-- Returns the generation of the limits in force ('not_leader' / 'stale' when refused).
if redis.call('GET', KEYS[2]) ~= ARGV[2] then return 'not_leader' end
local cur = redis.call('HGET', KEYS[1], 'generation')
local same = true
for i = 3, #ARGV, 2 do
  if redis.call('HGET', KEYS[1], ARGV[i]) ~= ARGV[i + 1] then same = false end
end
if same then return cur end
if cur and tonumber(cur) > tonumber(ARGV[1]) then return 'stale' end
for i = 3, #ARGV, 2 do
  redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
end
redis.call('HSET', KEYS[1], 'generation', ARGV[1])
return ARGV[1]
