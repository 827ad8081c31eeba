-- A batch of coordinator-leader writes applied only while the caller still holds the leader
-- lease: the fence for the leader's plain writes (explicit wishes, the idle watch, autosize
-- state, seeding the registry and policies, its inbox, counters). A leader paused past its lease
-- (a stall, SIGSTOP, a long pass) that wakes up and writes is refused here, atomically with the
-- check, so it can never overwrite what the new leader did.
-- KEYS[1] leader lease, KEYS[2..] the keys written
-- ARGV[1] the caller's lease token, ARGV[2] JSON list of operations
--   [command, index into KEYS, arg...] (args as strings)
-- Returns false (nil) when the lease is not the caller's, else the replies of the operations.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return false end
local allowed = {
  HSET = true, HDEL = true, HINCRBY = true, HINCRBYFLOAT = true, INCR = true, SET = true,
  DEL = true, RPUSH = true, LPOP = true, LREM = true, SADD = true, SREM = true, EXPIRE = true,
}
local ops = cjson.decode(ARGV[2])
-- Every operation is checked before any runs, so a bad batch writes nothing.
for _, op in ipairs(ops) do
  if not allowed[op[1]] or KEYS[op[2]] == nil or op[2] < 2 then
    return redis.error_reply('fenced: operation not allowed: ' .. tostring(op[1]))
  end
end
local out = {}
for i, op in ipairs(ops) do
  out[i] = redis.call(op[1], KEYS[op[2]], unpack(op, 3))
end
return out
