-- The model process commits its finished load: loading -> ready for its own token, then the
-- capacity decision is re-checked against the limits as they are now. The load was decided
-- under the limits of generation ARGV[3]; if they changed while it loaded (an admin lowered a
-- limit, a policy went), the ready event asks for a full enforcement pass rather than leaving
-- the pool above a limit nobody re-reads.
-- KEYS[1] model hash, KEYS[2] limits hash, KEYS[3] events
-- ARGV[1] allowed sources (csv), ARGV[2] token, ARGV[3] limits generation of the decision,
-- ARGV[4] ready event JSON, ARGV[5] recheck event JSON, ARGV[6..] field/value pairs
-- Returns {1, 'ok'|'recheck'} or {0, current state}.
local ok, prev = cas(KEYS[1], 'ready', ARGV[1], ARGV[2])
if not ok then return {0, prev} end
set_fields(KEYS[1], 6)
local gen = redis.call('HGET', KEYS[2], 'generation') or '0'
if gen ~= ARGV[3] then
  redis.call('RPUSH', KEYS[3], ARGV[5])
  return {1, 'recheck'}
end
redis.call('RPUSH', KEYS[3], ARGV[4])
return {1, 'ok'}
