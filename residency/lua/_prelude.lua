-- Shared by every script that changes a model's state (prepended by residency/lua.py).
-- The allowed source states come from Python (residency.states.sources_for), so the transition
-- table has one definition.
local function in_csv(csv, v)
  for s in string.gmatch(csv, '[^,]+') do
    if s == v then return true end
  end
  return false
end

local function state_of(key)
  return redis.call('HGET', key, 'state') or 'unloaded'
end

-- Compare-and-set: move `key` to state `to` if its state is in `sources` (csv) and, unless
-- `token` is empty, its owning load token matches. Returns ok, previous state.
local function cas(key, to, sources, token)
  local cur = state_of(key)
  if not in_csv(sources, cur) then return false, cur end
  if token ~= '' and redis.call('HGET', key, 'token') ~= token then return false, cur end
  redis.call('HSET', key, 'state', to)
  return true, cur
end

-- Set the field/value pairs ARGV[first], ARGV[first + 1], ... on `key`; an empty value deletes
-- its field.
local function set_fields(key, first)
  for i = first, #ARGV, 2 do
    if ARGV[i + 1] == '' then
      redis.call('HDEL', key, ARGV[i])
    else
      redis.call('HSET', key, ARGV[i], ARGV[i + 1])
    end
  end
end
