-- Web pushes a queued request out of its worker's places in flight (server.max_in_flight):
-- out of the queue together with its error reply, if no model process took it yet. Its web
-- thread, blocked on the reply stream, answers its client with that error at once, and
-- nothing of it is left behind.
-- KEYS[1] queue, KEYS[2] its reply stream, KEYS[3] fair tags, KEYS[4] users' hash, KEYS[5]
-- processing
-- ARGV[1] the request JSON exactly as queued, ARGV[2] error reply JSON, ARGV[3] reply TTL
-- seconds
-- Returns 1 when pushed out, 0 when it is no longer queued (taken, answered or withdrawn).
if redis.call('LREM', KEYS[1], 1, ARGV[1]) == 0 then return 0 end
fair_forget(KEYS[3], KEYS[4], KEYS[1], KEYS[5], ARGV[1])
redis.call('XADD', KEYS[2], '*', 't', 'error', 'd', ARGV[2])
redis.call('EXPIRE', KEYS[2], tonumber(ARGV[3]))
return 1
