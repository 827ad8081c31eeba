-- The coordinator records one failure of a model (a failed load, a crash) in its failure window:
-- at most one entry per load token (the same failure can be reported twice: by the model
-- process and by the reaper), entries older than the window pruned, the key's TTL renewed.
-- The model hash is marked (``failure_seen`` = the load token) while it still holds that token:
-- a pass that finds a ``failed`` model without that mark knows its failure is not settled yet
-- (its event may still be on the way) and settles it before deciding anything for the model.
-- KEYS[1] the model's failure window (sorted set), KEYS[2] leader lease, KEYS[3] model hash
-- ARGV[1] the caller's leader lease token (fencing), ARGV[2] load token ('' = unknown: never
-- merged), ARGV[3] member JSON {"token", "error", "at"}, ARGV[4] now, ARGV[5] window seconds
-- Returns 'ok', 'duplicate' or 'not_leader'.
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return 'not_leader' end
local now = tonumber(ARGV[4])
local window = tonumber(ARGV[5])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. tostring(now - window))
if ARGV[2] ~= '' and redis.call('HGET', KEYS[3], 'token') == ARGV[2] then
  redis.call('HSET', KEYS[3], 'failure_seen', ARGV[2])
end
if ARGV[2] ~= '' then
  for _, member in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
    local ok, entry = pcall(cjson.decode, member)
    if ok and type(entry) == 'table' and entry['token'] == ARGV[2] then return 'duplicate' end
  end
end
redis.call('ZADD', KEYS[1], now, ARGV[3])
redis.call('EXPIRE', KEYS[1], math.ceil(window))
return 'ok'
