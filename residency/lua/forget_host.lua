-- The coordinator forgets a host that is gone: its worker record expired (no heartbeat) and no
-- model holds a slot on it any more (they were reaped). Refused if the host came back meanwhile:
-- its agent re-registers with every heartbeat, so forgetting a host early costs nothing.
-- KEYS[1] the set of hosts, KEYS[2] its worker record, KEYS[3] leader lease,
-- KEYS[4..] its other keys (agent command lists)
-- ARGV[1] the caller's leader lease token (fencing), ARGV[2] host name
-- Returns 'ok', 'alive' or 'not_leader'.
if redis.call('GET', KEYS[3]) ~= ARGV[1] then return 'not_leader' end
if redis.call('EXISTS', KEYS[2]) == 1 then return 'alive' end
redis.call('SREM', KEYS[1], ARGV[2])
for i = 4, #KEYS do redis.call('DEL', KEYS[i]) end
return 'ok'
