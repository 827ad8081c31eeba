-- The model process finished a request (served, failed or cancelled).
-- KEYS[1] processing, KEYS[2] queue, KEYS[3] model hash, KEYS[4] events, KEYS[5] idle watch
-- ARGV[1] request JSON, ARGV[2] now, ARGV[3] idle event JSON
-- Emits the idle event on the busy -> idle edge, and only while the coordinator waits for one
-- (the idle-watch flag), so it can run a deferred eviction or load the moment it is possible.
redis.call('LREM', KEYS[1], 1, ARGV[1])
redis.call('HSET', KEYS[3], 'last_used', ARGV[2])
if redis.call('EXISTS', KEYS[5]) == 1
   and redis.call('LLEN', KEYS[1]) == 0 and redis.call('LLEN', KEYS[2]) == 0 then
  redis.call('RPUSH', KEYS[4], ARGV[3])
  return 1
end
return 0
