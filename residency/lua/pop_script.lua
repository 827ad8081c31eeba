-- A model process takes the next scripted text of a fault script (POST /admin/faults
-- script_text) as its generation starts: exactly one generation gets each text, in order.
-- KEYS[1] the faults hash
-- ARGV[1] the field (script_text:<model>), a JSON list of texts
-- Returns the first text (nil when there is none); the field goes with its last text.
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw then return false end
local ok, texts = pcall(cjson.decode, raw)
if not ok or type(texts) ~= 'table' or #texts == 0 then
  redis.call('HDEL', KEYS[1], ARGV[1])
  return false
end
local first = table.remove(texts, 1)
if #texts == 0 then
  redis.call('HDEL', KEYS[1], ARGV[1])
else
  redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(texts))
end
return first
