-- Shares of one model's queue bound between its users (prepended to submit.lua, after
-- _fair.lua). A user's share is bound x its weight / the sum of the weights of the users with
-- requests queued, the newcomer included. A newcomer who finds the queue full is admitted when
-- its requests, the new one included, stay within its share: the newest queued request of the
-- user furthest above its share makes room. The owner records ('o' .. id in the users' hash,
-- see _fair.lua) say whose each request is; the processing list says which are in flight.

-- Tolerance of the comparisons of counts (integers) with shares (fractions).
local SHARE_EPS = 1e-9
-- Items read per LRANGE while looking for the victim from the queue's left end.
local SHARE_PAGE = 16

-- {id -> {weight, user}} of the requests queued (not in flight). When the records do not
-- account for exactly `depth` requests (some request was dropped without a finish, or was
-- queued before owners were recorded), the queue itself is read once and the records mended.
local function share_owners(finish, queue, processing, depth)
  local owners, n = {}, 0
  local flat = redis.call('HGETALL', finish)
  for i = 1, #flat, 2 do
    if string.sub(flat[i], 1, 1) == 'o' then
      local w, u = string.match(flat[i + 1], '^(%S+) (.*)$')
      if w then
        owners[string.sub(flat[i], 2)] = {tonumber(w), u}
        n = n + 1
      end
    end
  end
  for _, it in ipairs(redis.call('LRANGE', processing, 0, -1)) do
    local id = request_id(it)
    if id and owners[id] then
      owners[id] = nil
      n = n - 1
    end
  end
  if n == depth then return owners end
  local queued = {}
  for _, it in ipairs(redis.call('LRANGE', queue, 0, -1)) do
    local id = request_id(it)
    if id then
      if not owners[id] then
        local ok, req = pcall(cjson.decode, it)
        local u = (ok and type(req) == 'table' and type(req.user) == 'string') and req.user or ''
        owners[id] = {1, u}
        redis.call('HSET', finish, 'o' .. id, '1 ' .. u)
      end
      queued[id] = owners[id]
    end
  end
  for id, _ in pairs(owners) do
    if not queued[id] then redis.call('HDEL', finish, 'o' .. id) end
  end
  return queued
end

-- The queued request to push out so that `user` (of `weight`) gets a place in a full queue of
-- `depth` requests under `bound`, or nil when its requests would then be above its share (or
-- nobody is above theirs). Of the users furthest above their share (in places), the one whose
-- newest request is newest loses it: the request nearest the queue's left end, which is the
-- one served last (the end new requests join, and in fair queueing the user's largest tag).
local function share_victim(finish, queue, processing, depth, bound, user, weight)
  local owners = share_owners(finish, queue, processing, depth)
  local counts, weights = {}, {}
  for _, o in pairs(owners) do
    counts[o[2]] = (counts[o[2]] or 0) + 1
    -- A weight changed while requests were queued: the largest of its requests' weights.
    weights[o[2]] = math.max(weights[o[2]] or 0, o[1])
  end
  weights[user] = weight
  local sum = weight
  for u, _ in pairs(counts) do
    if u ~= user then sum = sum + weights[u] end
  end
  if (counts[user] or 0) + 1 > bound * weight / sum + SHARE_EPS then return nil end
  local worst, over = nil, nil
  for u, n in pairs(counts) do
    local excess = n - bound * weights[u] / sum
    if u ~= user and excess > SHARE_EPS then
      if worst == nil or excess > worst + SHARE_EPS then
        worst, over = excess, {[u] = true}
      elseif excess >= worst - SHARE_EPS then
        over[u] = true
      end
    end
  end
  if not over then return nil end
  local offset = 0
  while offset < depth do
    local page = redis.call('LRANGE', queue, offset, offset + SHARE_PAGE - 1)
    for _, it in ipairs(page) do
      local o = owners[request_id(it) or '']
      if o and over[o[2]] then return it end
    end
    if #page < SHARE_PAGE then break end
    offset = offset + SHARE_PAGE
  end
  return nil
end
