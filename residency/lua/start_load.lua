-- The coordinator starts a load: state -> loading and the agent's command, in one step, so a
-- crash can never leave a 'loading' model that no agent was told about.
-- KEYS[1] model hash, KEYS[2] agent command list, KEYS[3] leader lease, KEYS[4] the set of
-- models with state (this is the only script that creates a model's state), KEYS[5] its queue
-- ARGV[1] allowed sources (csv), ARGV[2] new token, ARGV[3] host, ARGV[4] device, ARGV[5] now,
-- ARGV[6] command JSON, ARGV[7] the caller's leader lease token (fencing), ARGV[8] pool,
-- ARGV[9] model name
if redis.call('GET', KEYS[3]) ~= ARGV[7] then return {0, 'not_leader'} end
local ok, prev = cas(KEYS[1], 'loading', ARGV[1], '')
if not ok then return {0, prev} end
redis.call('HSET', KEYS[1], 'token', ARGV[2], 'host', ARGV[3], 'device', ARGV[4],
           'loading_since', ARGV[5], 'pool', ARGV[8])
-- A model loaded again starts not yielding (the mark of its last yield has served its turn).
redis.call('HDEL', KEYS[1], 'pid', 'error', 'loaded_at', 'load_seconds', 'yielding',
           'yielding_since', 'load_user', 'load_key', 'footprint_bytes', 'estimate_bytes')
-- The load is charged to whoever asked for it: the user (and key) of the request it is
-- started for, the next one the queue serves. Recorded here, in the step that starts it, so the
-- model process charges its load time to them when it commits (an admin's load of an empty
-- queue is nobody's).
local next = redis.call('LINDEX', KEYS[5], -1)
if next then
  local ok, req = pcall(cjson.decode, next)
  if ok and type(req) == 'table' then
    if type(req.user) == 'string' and req.user ~= '' then
      redis.call('HSET', KEYS[1], 'load_user', req.user)
    end
    if type(req.key) == 'string' and req.key ~= '' then
      redis.call('HSET', KEYS[1], 'load_key', req.key)
    end
  end
end
redis.call('SADD', KEYS[4], ARGV[9])
redis.call('RPUSH', KEYS[2], ARGV[6])
return {1, prev}
