-- Web admits one request against the quotas of its user and of its key, in one step across
-- every web process: all the checks, then (only when every one passes) the places it takes.
-- Time is Redis's own (TIME), so web processes on hosts with skewed clocks share one window.
-- KEYS[1] the day's quota totals hash, KEYS[2] the model hash, KEYS[3] the model's
-- service-time key, then per subject (user, key: those with quotas) two keys: its
-- requests-per-minute window (sorted set) and its in-flight places (sorted set)
-- ARGV[1] admission id, ARGV[2] seconds a place is held at most (the request's deadline),
-- ARGV[3] the window seconds, ARGV[4] '1' when the request may cause a load (a local model:
-- its load-seconds quota applies while the model is not ready nor loading), ARGV[5] the tokens
-- the request may use at most (its reservation), ARGV[6] the field of its reservation in the
-- totals hash, ARGV[7] the totals hash's TTL seconds, then per subject seven values: requests
-- per minute, concurrent, tokens per day, load-seconds per day ('' = no limit), its tokens
-- field, its load-seconds field and its reserved-tokens field in the totals hash
-- Returns {1} when admitted, else {0, subject index (1-based), quota, limit, used, retry
-- seconds ('' for the daily quotas spent: web knows when its day ends), state of the model, tokens
-- reserved}: the refusal whose wait is the longest (retrying sooner would only be refused
-- again).
-- tokens_per_day: a request is admitted while the day's charged tokens plus the reservations
-- of the requests in flight are below the limit, and then reserves what it may use at most, so
-- however many are admitted at once they can end the day at most one request over the limit.
-- A reservation is given back by release.lua when the request ends (its usage is charged by
-- then); one whose web process died lapses with the day's hash.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local hold = tonumber(ARGV[2])
local window = tonumber(ARGV[3])
local state = redis.call('HGET', KEYS[2], 'state') or 'unloaded'
local loads = ARGV[4] == '1' and state ~= 'ready' and state ~= 'loading'
local subjects = (#KEYS - 3) / 2
local need = tonumber(ARGV[5]) or 0
local ARGS = 7
local PER = 7

local worst = nil
local function refuse(i, quota, limit, used, retry, reserved)
  -- A daily quota ('' retry) outwaits every other refusal.
  local wait = retry == '' and math.huge or retry
  if worst == nil or wait > worst.wait then
    worst = {i = i, quota = quota, limit = limit, used = used, retry = retry, wait = wait,
             reserved = reserved or 0}
  end
end

for i = 1, subjects do
  local rate, conc = KEYS[2 + 2 * i], KEYS[3 + 2 * i]
  local a = ARGS + PER * (i - 1)
  local rpm, cmax, tmax, lmax = ARGV[a + 1], ARGV[a + 2], ARGV[a + 3], ARGV[a + 4]
  if tmax ~= '' then
    local used = tonumber(redis.call('HGET', KEYS[1], ARGV[a + 5]) or '0')
    local reserved = tonumber(redis.call('HGET', KEYS[1], ARGV[a + 7]) or '0')
    if used >= tonumber(tmax) then
      refuse(i, 'tokens_per_day', tmax, tostring(used), '', reserved)
    elseif used + reserved >= tonumber(tmax) then
      -- Over only with what its requests in flight reserved: they give back what they do not
      -- use when they end, about one request's time in its slot.
      local retry = tonumber(string.match(redis.call('GET', KEYS[3]) or '1', '^%S+') or '1') or 1
      refuse(i, 'tokens_per_day', tmax, tostring(used), retry, reserved)
    end
  end
  if lmax ~= '' and loads then
    local used = tonumber(redis.call('HGET', KEYS[1], ARGV[a + 6]) or '0')
    if used >= tonumber(lmax) then
      refuse(i, 'load_seconds_per_day', lmax, tostring(used), '')
    end
  end
  if rpm ~= '' then
    redis.call('ZREMRANGEBYSCORE', rate, '-inf', now - window)
    local n = redis.call('ZCARD', rate)
    if n >= tonumber(rpm) then
      -- A place in the window frees when its oldest admission leaves it.
      local oldest = redis.call('ZRANGE', rate, 0, 0, 'WITHSCORES')
      local retry = window
      if oldest[2] then retry = tonumber(oldest[2]) + window - now end
      refuse(i, 'requests_per_minute', rpm, tostring(n), retry)
    end
  end
  if cmax ~= '' then
    redis.call('ZREMRANGEBYSCORE', conc, '-inf', now)
    local n = redis.call('ZCARD', conc)
    if n >= tonumber(cmax) then
      -- A place frees when one of them ends: about one request's time in its slot.
      local retry = tonumber(string.match(redis.call('GET', KEYS[3]) or '1', '^%S+') or '1') or 1
      refuse(i, 'concurrent', cmax, tostring(n), retry)
    end
  end
end

if worst ~= nil then
  local retry = worst.retry
  if retry ~= '' then retry = tostring(retry) end
  return {0, worst.i, worst.quota, worst.limit, worst.used, retry, state,
          tostring(worst.reserved)}
end

local reserved_any = false
for i = 1, subjects do
  local rate, conc = KEYS[2 + 2 * i], KEYS[3 + 2 * i]
  local a = ARGS + PER * (i - 1)
  if ARGV[a + 3] ~= '' and need > 0 then
    redis.call('HINCRBY', KEYS[1], ARGV[a + 7], need)
    reserved_any = true
  end
  if ARGV[a + 1] ~= '' then
    redis.call('ZADD', rate, now, ARGV[1])
    redis.call('EXPIRE', rate, window + 1)
  end
  if ARGV[a + 2] ~= '' then
    redis.call('ZADD', conc, now + hold, ARGV[1])
    -- The set lives as long as its latest place.
    local last = redis.call('ZRANGE', conc, -1, -1, 'WITHSCORES')
    redis.call('EXPIREAT', conc, math.ceil(tonumber(last[2])) + 1)
  end
end
if reserved_any then
  -- What release.lua gives back (once: it deletes this field).
  redis.call('HSET', KEYS[1], ARGV[6], need)
  redis.call('EXPIRE', KEYS[1], tonumber(ARGV[7]))
end
return {1}
