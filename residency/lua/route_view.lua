-- What the router needs of some models, read at one instant (read only).
-- KEYS[1] the health hash (its route_room field), KEYS[2] the caller's route_prefix key ('' is
-- never passed: a key that does not exist reads nil), then per model, 6 keys: its model hash,
-- queue, processing list, service key, queue tags and queue-finish hash.
-- ARGV[1] the caller's user ('' for anonymous), ARGV[2] '1' when queues are fair.
-- Returns {route_room JSON or false, route_prefix JSON or false, then per model: state,
-- parallel, loading_since, loaded_at, last_used, queued, in flight, service, ahead}.
-- ``ahead``: the queued requests that would start before this user's next one. With fair
-- queues that is what submit.lua would place before it: every queued request whose start tag
-- is at most the new one's S = max(V, F[user]) (V the smallest tag, F the user's finish tag);
-- the in-flight ones (tagged too, and served first) are taken off that count. First come,
-- first served: the whole queue.
local out = {redis.call('HGET', KEYS[1], 'route_room'), redis.call('GET', KEYS[2])}
local user, fair = ARGV[1], ARGV[2] == '1'
local n = (#KEYS - 2) / 6
for i = 0, n - 1 do
  local k = 2 + i * 6
  local h = redis.call('HMGET', KEYS[k + 1], 'state', 'parallel', 'loading_since', 'loaded_at',
    'last_used')
  local queued = redis.call('LLEN', KEYS[k + 2])
  local in_flight = redis.call('LLEN', KEYS[k + 3])
  local service = redis.call('GET', KEYS[k + 4])
  local ahead = queued
  if fair and queued > 0 then
    local first = redis.call('ZRANGE', KEYS[k + 5], 0, 0, 'WITHSCORES')
    local v = first[2] and tonumber(first[2]) or 0
    local f = tonumber(redis.call('HGET', KEYS[k + 6], 'f' .. user) or '0')
    local s = math.max(v, f)
    local tagged = redis.call('ZCOUNT', KEYS[k + 5], '-inf', string.format('%.17g', s))
    ahead = math.max(0, math.min(queued, tagged - in_flight))
  end
  for _, x in ipairs({h[1] or '', h[2] or '', h[3] or '', h[4] or '', h[5] or '', queued,
      in_flight, service or '', ahead}) do
    out[#out + 1] = x
  end
end
return out
