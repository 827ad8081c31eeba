-- Renew or release the coordinator leader lease, only if it is still ours.
-- KEYS[1] lease key; ARGV[1] our token, ARGV[2] 'renew' | 'release', ARGV[3] ttl ms
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if ARGV[2] == 'release' then
  redis.call('DEL', KEYS[1])
else
  redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]))
end
return 1
