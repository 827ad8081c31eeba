-- The coordinator starts a load: state -> loading and the agent's command, in one step, so a
-- crash can never leave a 'loading' model that no agent was told about.
-- KEYS[1] model hash, KEYS[2] agent command list, KEYS[3] leader lease, KEYS[4] the set of
-- models with state (this is the only script that creates a model's state)
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
           'yielding_since')
redis.call('SADD', KEYS[4], ARGV[9])
redis.call('RPUSH', KEYS[2], ARGV[6])
return {1, prev}
