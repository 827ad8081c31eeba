-- The model process commits its finished load: loading -> ready for its own token, then the
-- capacity decision is re-checked against the limits as they are now. The load was decided
-- under the limits of generation ARGV[3]; if they changed while it loaded (an admin lowered a
-- limit, a policy went), the ready event asks for a full enforcement pass rather than leaving
-- the pool above a limit nobody re-reads.
-- KEYS[1] model hash, KEYS[2] limits hash, KEYS[3] events, KEYS[4] the day's usage hash,
-- KEYS[5] the day's quota totals, KEYS[6] the all-time usage totals
-- ARGV[1] allowed sources (csv), ARGV[2] token, ARGV[3] limits generation of the decision,
-- ARGV[4] ready event JSON, ARGV[5] recheck event JSON, ARGV[6] the load's seconds, ARGV[7] the
-- usage field its seconds are charged to ('user|model|load_seconds'; '' when nobody's request
-- caused it), ARGV[8] and ARGV[9] the quota-totals fields of that user's and key's
-- load-seconds ('' when none), ARGV[10] the usage TTL, ARGV[11] the quota totals' TTL,
-- ARGV[12..] field/value pairs
-- Returns {1, 'ok'|'recheck'} or {0, current state}.
local ok, prev = cas(KEYS[1], 'ready', ARGV[1], ARGV[2])
if not ok then return {0, prev} end
set_fields(KEYS[1], 12)
-- Charged once, by the commit that made it ready (a second commit for the token finds it ready
-- and refuses above), to the user and key whose request caused it (start_load.lua).
local secs = tonumber(ARGV[6])
if ARGV[7] ~= '' then
  redis.call('HINCRBYFLOAT', KEYS[4], ARGV[7], secs)
  redis.call('EXPIRE', KEYS[4], tonumber(ARGV[10]))
  redis.call('HINCRBYFLOAT', KEYS[6], ARGV[7], secs)
end
for i = 8, 9 do
  if ARGV[i] ~= '' then
    redis.call('HINCRBYFLOAT', KEYS[5], ARGV[i], secs)
    redis.call('EXPIRE', KEYS[5], tonumber(ARGV[11]))
  end
end
local gen = redis.call('HGET', KEYS[2], 'generation') or '0'
if gen ~= ARGV[3] then
  redis.call('RPUSH', KEYS[3], ARGV[5])
  return {1, 'recheck'}
end
redis.call('RPUSH', KEYS[3], ARGV[4])
return {1, 'ok'}
