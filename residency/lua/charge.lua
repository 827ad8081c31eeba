-- Web charges the usage of one request it forwarded to a remote model (no model process
-- counts it), before it releases the request's reservation (release.lua).
-- KEYS[1] the day's usage hash, KEYS[2] the all-time usage totals, KEYS[3] the day's quota totals
-- ARGV[1] the usage field prefix ('user|model|'), ARGV[2] prompt and ARGV[3] completion
-- tokens, ARGV[4] the usage hash's TTL seconds, ARGV[5] and ARGV[6] the quota-totals fields
-- of its user's and its key's tokens ('' when it has none), ARGV[7] the quota totals' TTL
count_usage(KEYS[1], KEYS[2], KEYS[3], ARGV[1], ARGV[2], ARGV[3], ARGV[4], {ARGV[5], ARGV[6]},
            ARGV[7])
return 1
