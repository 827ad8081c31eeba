-- The coordinator forgets a host that is gone: its worker record expired (no heartbeat), no model
-- holds a slot on it any more (they were reaped) and it was last seen long enough ago
-- (worker.forget_after_s). Refused if the host came back meanwhile (its record exists), or beat
-- after the cutoff the decision was made with (a host that came back and went again is listed
-- as gone anew): its agent re-registers with every heartbeat, so forgetting early costs nothing.
-- KEYS[1] the set of hosts, KEYS[2] its worker record, KEYS[3] leader lease,
-- KEYS[4] hash host -> last heartbeat time, KEYS[5..] its other keys (agent command lists)
-- ARGV[1] the caller's leader lease token (fencing), ARGV[2] host name,
-- ARGV[3] latest last heartbeat that may be forgotten ('' = any)
-- Returns 'ok', 'alive', 'seen' or 'not_leader'.
if redis.call('GET', KEYS[3]) ~= ARGV[1] then return 'not_leader' end
if redis.call('EXISTS', KEYS[2]) == 1 then return 'alive' end
if ARGV[3] ~= '' then
  local seen = tonumber(redis.call('HGET', KEYS[4], ARGV[2]))
  if seen and seen > tonumber(ARGV[3]) then return 'seen' end
end
redis.call('SREM', KEYS[1], ARGV[2])
redis.call('HDEL', KEYS[4], ARGV[2])
for i = 5, #KEYS do redis.call('DEL', KEYS[i]) end
return 'ok'
