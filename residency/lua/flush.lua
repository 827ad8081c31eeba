-- A model process writes a batch of a stream's chunks — unless its client went away: web
-- withdrew the request then (cancel flag set and reply stream deleted in one step,
-- withdraw.lua), and a write now would create the stream again for nobody to read or delete.
-- A stream this creates gets its TTL at once (and a renewal when asked), so no write leaves a
-- reply stream that never expires.
-- KEYS[1] reply stream, KEYS[2] cancel flag
-- ARGV[1] chunk message data JSON, ARGV[2] reply TTL seconds, ARGV[3] '1' to renew the TTL
-- Returns 1 when the request was cancelled (nothing written), else 0.
if redis.call('EXISTS', KEYS[2]) == 1 then return 1 end
local fresh = redis.call('EXISTS', KEYS[1]) == 0
redis.call('XADD', KEYS[1], '*', 't', 'chunk', 'd', ARGV[1])
if fresh or ARGV[3] == '1' then
  redis.call('EXPIRE', KEYS[1], tonumber(ARGV[2]))
end
return 0
