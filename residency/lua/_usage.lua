-- Counting one request's usage (prepended by residency/lua.py to the scripts that charge it:
-- finish.lua for a local model, charge.lua for a remote one).
-- One request on the day's usage hash `day` and the all-time `totals` (fields `prefix ..
-- counter`, prefix 'user|model|'), and its `prompt` + `completion` tokens ('' when unknown:
-- the request is counted, its tokens are not) on the day's quota totals `quota` under the
-- fields `fields` (its user's and its key's; '' for none) that tokens_per_day is checked
-- against (admit.lua): one field each, not a scan of the usage hash per admission.
local function count_usage(day, totals, quota, prefix, prompt, completion, day_ttl, fields,
                           quota_ttl)
  redis.call('HINCRBY', day, prefix .. 'requests', 1)
  redis.call('HINCRBY', totals, prefix .. 'requests', 1)
  if prompt ~= '' then
    for _, h in ipairs({day, totals}) do
      redis.call('HINCRBY', h, prefix .. 'prompt_tokens', tonumber(prompt))
      redis.call('HINCRBY', h, prefix .. 'completion_tokens', tonumber(completion))
    end
    local tokens = tonumber(prompt) + tonumber(completion)
    for _, f in ipairs(fields) do
      if f ~= '' then
        redis.call('HINCRBY', quota, f, tokens)
        redis.call('EXPIRE', quota, tonumber(quota_ttl))
      end
    end
  end
  redis.call('EXPIRE', day, tonumber(day_ttl))
end
