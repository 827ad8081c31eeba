-- KEYS[1] model hash; KEYS[2] leader lease (only when fenced)
-- ARGV[1] target state, ARGV[2] allowed sources (csv), ARGV[3] token to match ('' = any),
-- ARGV[4] the caller's leader lease token ('' = not fenced: the agent and model processes hold
-- no lease; the coordinator always fences), ARGV[5..] field/value pairs to set with the state
-- ('' deletes the field)
-- Returns {1, previous} on success, {0, current} when refused, {0, 'not_leader'} when fenced and
-- the lease is not the caller's.
if ARGV[4] ~= '' and redis.call('GET', KEYS[2]) ~= ARGV[4] then return {0, 'not_leader'} end
local ok, prev = cas(KEYS[1], ARGV[1], ARGV[2], ARGV[3])
if not ok then return {0, prev} end
set_fields(KEYS[1], 5)
return {1, prev}
