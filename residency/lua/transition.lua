-- KEYS[1] model hash
-- ARGV[1] target state, ARGV[2] allowed sources (csv), ARGV[3] token to match ('' = any),
-- ARGV[4..] field/value pairs to set with the state ('' deletes the field)
-- Returns {1, previous} on success, {0, current} when refused.
local ok, prev = cas(KEYS[1], ARGV[1], ARGV[2], ARGV[3])
if not ok then return {0, prev} end
set_fields(KEYS[1], 4)
return {1, prev}
