-- Web gives back what an admitted request held (admit.lua) when the request has ended:
-- answered, failed, withdrawn or its client gone. Its usage was charged before (finish.lua,
-- for a local model, writes the last reply in the step that charges it; a remote's usage is
-- charged by web before it releases).
-- KEYS[1] the quota totals hash of the day it was admitted, KEYS[2..] the in-flight sets it
-- holds a place in
-- ARGV[1] admission id, ARGV[2] the field of its reservation, ARGV[3..] the reserved-tokens
-- fields of its subjects
-- Given back once: the reservation's field goes with it, so a second release changes nothing.
for i = 2, #KEYS do
  redis.call('ZREM', KEYS[i], ARGV[1])
end
local need = redis.call('HGET', KEYS[1], ARGV[2])
if not need then return 0 end
redis.call('HDEL', KEYS[1], ARGV[2])
for i = 3, #ARGV do
  local left = redis.call('HINCRBY', KEYS[1], ARGV[i], -tonumber(need))
  if left <= 0 then redis.call('HDEL', KEYS[1], ARGV[i]) end
end
return 1
