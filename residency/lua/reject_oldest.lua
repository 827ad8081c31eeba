-- Answer the oldest queued request with an error, in one step: it leaves the queue only
-- together with its error reply, so a crash in between cannot lose it.
-- KEYS[1] queue, KEYS[2] its reply stream, KEYS[3] fair tags, KEYS[4] users' finish tags,
-- KEYS[5] processing, KEYS[6] leader lease (only when fenced)
-- ARGV[1] the request JSON seen at the queue's right end, ARGV[2] error field JSON,
-- ARGV[3] reply TTL seconds, ARGV[4] the caller's leader lease token (when fenced: the
-- coordinator; the agent holds no lease)
-- Returns 1 when answered, 0 when the queue's oldest item is no longer that request,
-- 'not_leader' when fenced and the lease is not the caller's.
if KEYS[6] and redis.call('GET', KEYS[6]) ~= ARGV[4] then return 'not_leader' end
if redis.call('LINDEX', KEYS[1], -1) ~= ARGV[1] then return 0 end
redis.call('RPOP', KEYS[1])
fair_forget(KEYS[3], KEYS[4], KEYS[1], KEYS[5], ARGV[1])
redis.call('XADD', KEYS[2], '*', 't', 'error', 'd', ARGV[2])
redis.call('EXPIRE', KEYS[2], tonumber(ARGV[3]))
return 1
