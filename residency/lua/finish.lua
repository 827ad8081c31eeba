-- The model process finished a request (served, failed or cancelled).
-- KEYS[1] processing, KEYS[2] queue, KEYS[3] model hash, KEYS[4] events, KEYS[5] idle watch,
-- KEYS[6] reply stream
-- ARGV[1] request JSON, ARGV[2] now, ARGV[3] idle event JSON, ARGV[4] last reply type ('' when
-- there is none: a cancelled request), ARGV[5] last reply data JSON, ARGV[6] reply TTL seconds
-- The last reply message is written here, with the removal from the processing list: were it
-- written before, a process dying between the two would leave a request whose client already
-- read its whole reply (and deleted the stream) on the processing list, and hand_back would
-- requeue it to be generated again.
if ARGV[4] ~= '' then
  redis.call('XADD', KEYS[6], '*', 't', ARGV[4], 'd', ARGV[5])
  redis.call('EXPIRE', KEYS[6], tonumber(ARGV[6]))
end
redis.call('LREM', KEYS[1], 1, ARGV[1])
redis.call('HSET', KEYS[3], 'last_used', ARGV[2])
-- Emits the idle event on the busy -> idle edge, and only while the coordinator waits for one
-- (the idle-watch flag), so it can run a deferred eviction or load the moment it is possible.
-- A yielding model takes nothing from its queue: its last request in flight ending is its edge.
if redis.call('EXISTS', KEYS[5]) == 1 and redis.call('LLEN', KEYS[1]) == 0
   and (redis.call('LLEN', KEYS[2]) == 0 or redis.call('HGET', KEYS[3], 'yielding')) then
  redis.call('RPUSH', KEYS[4], ARGV[3])
  return 1
end
return 0
