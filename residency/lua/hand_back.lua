-- A model process died: one of its in-flight requests goes back to the queue if it produced no
-- output yet (so it is served once, by the next process), else it is answered with an error
-- (its client already saw part of a reply that cannot be replayed). A request that has crashed
-- its model too often is not requeued but answered with the crash error.
-- KEYS[1] processing, KEYS[2] queue, KEYS[3] reply stream, KEYS[4] fair tags, KEYS[5] users'
-- finish tags, KEYS[6] leader lease (only when fenced: the coordinator reaping; the agent holds
-- no lease)
-- ARGV[1] request JSON, ARGV[2] error field JSON (partial output), ARGV[3] reply TTL seconds,
-- ARGV[4] the request JSON to requeue (its attempt count updated; '' = do not requeue),
-- ARGV[5] error field JSON when it is not requeued
-- ARGV[6] the caller's leader lease token (when fenced)
-- Returns 'requeued', 'refused', 'failed', 'gone' or 'not_leader' (fenced, lease not ours).
if KEYS[6] and redis.call('GET', KEYS[6]) ~= ARGV[6] then return 'not_leader' end
if redis.call('LREM', KEYS[1], 1, ARGV[1]) == 0 then return 'gone' end
if redis.call('EXISTS', KEYS[3]) == 0 then
  if ARGV[4] ~= '' then
    -- Requeued at the front, keeping its fair tag (under its new text: the attempt count).
    local tag = redis.call('ZSCORE', KEYS[4], ARGV[1])
    if tag and ARGV[4] ~= ARGV[1] then
      redis.call('ZREM', KEYS[4], ARGV[1])
      redis.call('ZADD', KEYS[4], tag, ARGV[4])
    end
    redis.call('RPUSH', KEYS[2], ARGV[4])
    return 'requeued'
  end
  fair_forget(KEYS[4], KEYS[5], KEYS[2], KEYS[1], ARGV[1])
  redis.call('XADD', KEYS[3], '*', 't', 'error', 'd', ARGV[5])
  redis.call('EXPIRE', KEYS[3], tonumber(ARGV[3]))
  return 'refused'
end
fair_forget(KEYS[4], KEYS[5], KEYS[2], KEYS[1], ARGV[1])
redis.call('XADD', KEYS[3], '*', 't', 'error', 'd', ARGV[2])
redis.call('EXPIRE', KEYS[3], tonumber(ARGV[3]))
return 'failed'
