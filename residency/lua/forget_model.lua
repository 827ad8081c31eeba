-- The coordinator deletes the keys of a model that was deleted from the registry and holds
-- nothing: no slot, nothing queued or in flight. Refused if it was registered again, took a slot
-- or got work meanwhile.
-- KEYS[1] model hash, KEYS[2] queue, KEYS[3] processing, KEYS[4] control list,
-- KEYS[5] failure window, KEYS[6] the set of models with state, KEYS[7] registry,
-- KEYS[8] leader lease, KEYS[9] progress key, KEYS[10] service time key, KEYS[11] fair tags,
-- KEYS[12] users' finish tags, KEYS[13] its last measured footprint
-- ARGV[1] the caller's leader lease token (fencing), ARGV[2] model name, ARGV[3] the states
-- that hold a slot (csv)
-- Returns 'ok', 'registered', 'occupying', 'busy' or 'not_leader'.
if redis.call('GET', KEYS[8]) ~= ARGV[1] then return 'not_leader' end
if redis.call('HEXISTS', KEYS[7], ARGV[2]) == 1 then return 'registered' end
local state = redis.call('HGET', KEYS[1], 'state') or 'unloaded'
for s in string.gmatch(ARGV[3], '[^,]+') do
  if s == state then return 'occupying' end
end
if redis.call('LLEN', KEYS[2]) > 0 or redis.call('LLEN', KEYS[3]) > 0 then return 'busy' end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[9], KEYS[10], KEYS[11],
  KEYS[12], KEYS[13])
redis.call('SREM', KEYS[6], ARGV[2])
return 'ok'
