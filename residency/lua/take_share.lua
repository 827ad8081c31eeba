-- A model process with slot shares on takes the first queued request (from the right end, the
-- next in fair order) whose user is not capped at its share of the slots, into processing; it
-- looks at most ARGV[1] requests deep. One step: the request is taken, or nothing is.
-- KEYS[1] queue, KEYS[2] processing, KEYS[3] users' finish tags and owners ('o' .. id ->
-- '<weight> <user>', written by submit)
-- ARGV[1] how many requests from the right end to look at, ARGV[2..] the capped users
-- Returns the request JSON taken, or false when none of those looked at may take a slot.
local capped = {}
for i = 2, #ARGV do
  capped[ARGV[i]] = true
end
for i = 1, tonumber(ARGV[1]) do
  local item = redis.call('LINDEX', KEYS[1], -i)
  if not item then
    return false
  end
  local user = nil
  local id = string.match(item, '^{"id":"([^"]*)"')
  local owner = id and redis.call('HGET', KEYS[3], 'o' .. id)
  if owner then
    user = string.match(owner, '^%S+ (.*)$')
  end
  if user == nil then
    -- No owner record (queued before they were kept): the request's own field.
    local ok, req = pcall(cjson.decode, item)
    user = (ok and type(req) == 'table' and type(req.user) == 'string') and req.user or ''
  end
  if not capped[user] then
    redis.call('LREM', KEYS[1], -1, item)
    redis.call('LPUSH', KEYS[2], item)
    return item
  end
end
return false
