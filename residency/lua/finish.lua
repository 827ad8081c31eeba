-- The model process finished a request (served, failed or cancelled).
-- KEYS[1] processing, KEYS[2] queue, KEYS[3] model hash, KEYS[4] events, KEYS[5] idle watch,
-- KEYS[6] reply stream, KEYS[7] the model's service-time key, KEYS[8] the day's usage hash,
-- KEYS[9] fair tags, KEYS[10] users' finish tags, KEYS[11] the day's quota totals, KEYS[12] the
-- all-time usage totals, and only for a routed request's sample: KEYS[13] its policy's route
-- samples, KEYS[14] the route wait error histogram
-- ARGV[1] request JSON, ARGV[2] now, ARGV[3] idle event JSON, ARGV[4] last reply type ('' when
-- there is none: a cancelled request), ARGV[5] last reply data JSON, ARGV[6] reply TTL seconds,
-- ARGV[7] chunk message data JSON written before the last reply ('' when none: a stream's last
-- chunks ride here instead of costing a round trip of their own), ARGV[8] the model's average
-- service time ('' to leave it), ARGV[9] its TTL seconds, ARGV[10] the usage field prefix
-- ('user|model|'), ARGV[11] prompt tokens and ARGV[12] completion tokens ('' when unknown: the
-- request is counted, its tokens are not), ARGV[13] the usage hash's TTL seconds, ARGV[14] and
-- ARGV[15] the quota-totals fields of its user's and its key's tokens ('' when it has none),
-- ARGV[16] the quota totals' TTL seconds, ARGV[17] a routed request's sample JSON ('' when
-- none), ARGV[18] the samples kept, ARGV[19] their TTL seconds, ARGV[20] and ARGV[21] the error
-- histogram's bucket and sum fields, ARGV[22] the error (seconds)
-- The last reply message is written here, with the removal from the processing list: were it
-- written before, a process dying between the two would leave a request whose client already
-- read its whole reply (and deleted the stream) on the processing list, and hand_back would
-- requeue it to be generated again.
if ARGV[7] ~= '' then
  redis.call('XADD', KEYS[6], '*', 't', 'chunk', 'd', ARGV[7])
end
if ARGV[4] ~= '' then
  redis.call('XADD', KEYS[6], '*', 't', ARGV[4], 'd', ARGV[5])
end
if ARGV[4] ~= '' or ARGV[7] ~= '' then
  redis.call('EXPIRE', KEYS[6], tonumber(ARGV[6]))
end
if ARGV[8] ~= '' then
  redis.call('SET', KEYS[7], ARGV[8], 'EX', tonumber(ARGV[9]))
end
if redis.call('LREM', KEYS[1], 1, ARGV[1]) == 1 then
  -- Counted once per request: a finish retried after a lost reply removes nothing the second
  -- time, and counts nothing. The same counts go all-time (per-user metrics) and on the day's
  -- totals of its user and key.
  count_usage(KEYS[8], KEYS[12], KEYS[11], ARGV[10], ARGV[11], ARGV[12], ARGV[13],
              {ARGV[14], ARGV[15]}, ARGV[16])
  -- A routed request's predicted and actual wait, and how far apart they were: once, like
  -- its counts, and without a round trip of its own.
  if ARGV[17] ~= '' then
    redis.call('LPUSH', KEYS[13], ARGV[17])
    redis.call('LTRIM', KEYS[13], 0, tonumber(ARGV[18]) - 1)
    redis.call('EXPIRE', KEYS[13], tonumber(ARGV[19]))
    redis.call('HINCRBY', KEYS[14], ARGV[20], 1)
    redis.call('HINCRBYFLOAT', KEYS[14], ARGV[21], ARGV[22])
  end
end
fair_forget(KEYS[9], KEYS[10], KEYS[2], KEYS[1], ARGV[1])
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
