-- Web resolves a user key: its record and its user's, in one call (read-only).
-- KEYS[1] api keys hash, KEYS[2] users hash; ARGV[1] key id
-- Returns {key JSON, user JSON or false}, or false when no such key (never issued, revoked).
local rec = redis.call('HGET', KEYS[1], ARGV[1])
if not rec then return false end
local user = cjson.decode(rec)['user']
return {rec, redis.call('HGET', KEYS[2], user)}
