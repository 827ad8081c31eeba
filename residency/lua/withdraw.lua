-- Web withdraws a request nobody will read (its client went away) or whose deadline passed
-- while it waited: out of the queue if it is still there; otherwise a model process took it,
-- and (when asked) the cancel flag tells that process to stop at its next token. One step, so
-- the request is either removed before any process takes it or flagged for the one that did.
-- KEYS[1] queue, KEYS[2] cancel flag, KEYS[3] reply stream, KEYS[4] fair tags, KEYS[5] users'
-- finish tags, KEYS[6] processing
-- ARGV[1] the request JSON exactly as queued, ARGV[2] '1' to set the cancel flag when it was
-- taken already, ARGV[3] cancel flag TTL seconds
-- Returns 1 when it was removed from the queue, 0 when a model process had taken it.
if redis.call('LREM', KEYS[1], 1, ARGV[1]) == 1 then
  redis.call('DEL', KEYS[3])
  fair_forget(KEYS[4], KEYS[5], KEYS[1], KEYS[6], ARGV[1])
  return 1
end
if ARGV[2] == '1' then
  redis.call('SET', KEYS[2], '1', 'EX', tonumber(ARGV[3]))
  redis.call('DEL', KEYS[3])
end
return 0
