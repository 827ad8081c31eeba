-- Fair queueing between the users of one model (prepended by residency/lua.py to the scripts
-- that add or remove requests). Start-time fair queueing over the one queue list: a request's
-- start tag S = max(V, F[user]), where V is the smallest tag among the model's queued and
-- in-flight requests, and F[user] = S + 1/weight of that user's previous request. The list is
-- kept ordered by S from its right end (served next) to its left end, so the model process's
-- BLMOVE RIGHT takes the smallest tag, and equal tags are served in arrival order.

-- A request left the model (finished, withdrawn, rejected or failed): its tag goes, and when
-- the model has nothing queued and nothing in flight, every tag goes with the users' finish
-- tags, so tags restart at 0 (they stay small, and a stale tag cannot hold V back).
local function fair_forget(tags, finish, queue, processing, item)
  redis.call('ZREM', tags, item)
  if redis.call('LLEN', queue) == 0 and redis.call('LLEN', processing) == 0 then
    redis.call('DEL', tags, finish)
  end
end

-- How many tagged candidates one insertion looks at before it gives up and queues at the end
-- of the line (in-flight requests and ties between users are all it skips in practice).
local FAIR_SCAN_MAX = 256
local FAIR_PAGE = 32

-- Queue `item` for `user` (cost = 1/weight) in its fair place; returns nothing.
local function fair_insert(tags, finish, queue, processing, item, user, cost)
  if redis.call('LLEN', queue) == 0 and redis.call('LLEN', processing) == 0 then
    redis.call('DEL', tags, finish)
  end
  local first = redis.call('ZRANGE', tags, 0, 0, 'WITHSCORES')
  local v = first[2] and tonumber(first[2]) or 0
  local s = math.max(v, tonumber(redis.call('HGET', finish, user) or '0'))
  -- %.17g round-trips a double: the exclusive bound below is exactly the stored score.
  local tag = string.format('%.17g', s)
  redis.call('HSET', finish, user, string.format('%.17g', s + cost))
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
