-- A model process died: one of its in-flight requests goes back to the queue if it produced no
-- output yet (so it is served once, by the next process), else it is answered with an error
-- (its client already saw part of a reply that cannot be replayed).
-- KEYS[1] processing, KEYS[2] queue, KEYS[3] reply stream
-- ARGV[1] request JSON, ARGV[2] error field JSON, ARGV[3] reply TTL seconds
if redis.call('LREM', KEYS[1], 1, ARGV[1]) == 0 then return 'gone' end
if redis.call('EXISTS', KEYS[3]) == 0 then
  redis.call('RPUSH', KEYS[2], ARGV[1])
  return 'requeued'
end
redis.call('XADD', KEYS[3], '*', 't', 'error', 'd', ARGV[2])
redis.call('EXPIRE', KEYS[3], tonumber(ARGV[3]))
return 'failed'
