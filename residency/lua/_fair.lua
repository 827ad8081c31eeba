-- Fair queueing between the users of one model (prepended by residency/lua.py to the scripts
-- that add or remove requests). Start-time fair queueing over the one queue list: a request's
-- start tag S = max(V, F[user]), where V is the smallest tag among the model's queued and
-- in-flight requests, and F[user] = S + 1/weight of that user's previous request. The list is
-- kept ordered by S from its right end (served next) to its left end, so the model process's
-- BLMOVE RIGHT takes the smallest tag, and equal tags are served in arrival order.
--
-- The users' hash (keys.queue_finish) holds two kinds of field, prefixed so that no user name
-- can collide with a request id: 'f' .. user -> the finish tag F of that user's last request,
-- and 'o' .. request id -> '<weight> <user>', the owner of each queued or in-flight request
-- (written by submit.lua in every mode: the queue's shares between users read them).

-- The id of a queued request: Request.dumps writes it first.
local function request_id(item)
  return string.match(item, '^{"id":"([^"]*)"')
end

-- Nothing queued and nothing in flight: every tag, finish tag and owner goes, so tags restart
-- at 0 (they stay small, and a stale tag or owner left by a request dropped without a finish
-- cannot hold V back or count against its user).
local function fair_reset_if_empty(tags, finish, queue, processing)
  if redis.call('LLEN', queue) == 0 and redis.call('LLEN', processing) == 0 then
    redis.call('DEL', tags, finish)
  end
end

-- A request left the model (finished, withdrawn, rejected, pushed out or failed): its tag and
-- its owner go.
local function fair_forget(tags, finish, queue, processing, item)
  redis.call('ZREM', tags, item)
  local id = request_id(item)
  if id then redis.call('HDEL', finish, 'o' .. id) end
  fair_reset_if_empty(tags, finish, queue, processing)
end

-- How many tagged candidates one insertion looks at before it gives up and queues at the end
-- of the line (in-flight requests and ties between users are all it skips in practice).
local FAIR_SCAN_MAX = 256
local FAIR_PAGE = 32

-- Queue `item` for `user` (cost = 1/weight) in its fair place; returns nothing.
local function fair_insert(tags, finish, queue, processing, item, user, cost)
  fair_reset_if_empty(tags, finish, queue, processing)
  local first = redis.call('ZRANGE', tags, 0, 0, 'WITHSCORES')
  local v = first[2] and tonumber(first[2]) or 0
  local s = math.max(v, tonumber(redis.call('HGET', finish, 'f' .. user) or '0'))
  -- %.17g round-trips a double: the exclusive bound below is exactly the stored score.
  local tag = string.format('%.17g', s)
  redis.call('HSET', finish, 'f' .. user, string.format('%.17g', s + cost))
  -- The new request goes right after (in service order) every request with tag <= S: next to
  -- the queued request that comes first among those with the smallest tag above S. In-flight
  -- ones are not in the list (LPOS: nil) and are skipped; ties in a tag are ordered by member
  -- in the sorted set, not by arrival, so the one of them nearest the right end is the pivot.
  local pivot, at, group, done = nil, -1, nil, false
  local offset = 0
  while offset < FAIR_SCAN_MAX and not done do
    local page = redis.call('ZRANGEBYSCORE', tags, '(' .. tag, '+inf', 'WITHSCORES',
      'LIMIT', offset, FAIR_PAGE)
    for i = 1, #page, 2 do
      if group ~= nil and page[i + 1] ~= group then
        done = true
        break
      end
      local idx = redis.call('LPOS', queue, page[i])
      if idx and idx > at then
        pivot, at, group = page[i], idx, page[i + 1]
      end
    end
    if #page < 2 * FAIR_PAGE then break end
    offset = offset + FAIR_PAGE
  end
  redis.call('ZADD', tags, tag, item)
  if pivot ~= nil then
    redis.call('LINSERT', queue, 'AFTER', pivot, item)
  else
    redis.call('LPUSH', queue, item)
  end
end
