-- A coordinator tries to become leader: take the lease if nobody holds it and, in the same step,
-- bump the epoch (so every term has its own number, and no two terms share one).
-- KEYS[1] leader lease, KEYS[2] leader epoch
-- ARGV[1] the new term's lease token, ARGV[2] lease TTL ms
-- Returns the new epoch, or 0 when the lease is held.
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', tonumber(ARGV[2])) then return 0 end
return redis.call('INCR', KEYS[2])
