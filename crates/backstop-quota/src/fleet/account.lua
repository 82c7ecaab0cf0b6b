-- One dependency's quotas, shared by the processes of a fleet: the hash KEYS[1].
--
-- Per unit u ('requests', 'tokens', 'input-tokens', 'output-tokens'):
--   u:l  the window's limit        u:r  what is left of it (less what the fleet took since)
--   u:t  when it resets            u:p  when it last reset
--   u:w  the longest reset seen (the window's length, as near as the fleet knows it)
-- and 'gen', counted up each time a window resets. Times are milliseconds on this server's
-- clock, so the processes' own clocks never meet.
--
-- ARGV[1] is the operation:
--   take <tokens>            -> {0, '', 0, 0, 0, gen}                 go: taken
--                               {1, unit, limit, left, wait_ms, gen}  wait for that unit's reset
--                               {2, unit, limit, left, 0, gen}        never: more than the limit
--   give <tokens> <gen>      an attempt taken and never sent gives its cost back, if no window
--                            has reset since
--   learn (<unit> <limit> <left> <reset_ms>)...  what a response said (-1: not said)

local h = KEYS[1]
local op = ARGV[1]
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local units = { 'requests', 'tokens', 'input-tokens', 'output-tokens' }

local function num(field)
  local v = redis.call('HGET', h, field)
  if v then
    return tonumber(v)
  end
  return nil
end

-- A window past its reset starts again: full when its limit is known, unknown otherwise.
local function roll(u)
  local t = num(u .. ':t')
  if t and t <= now then
    local l = num(u .. ':l')
    if l then
      redis.call('HSET', h, u .. ':r', l)
    else
      redis.call('HDEL', h, u .. ':r')
    end
    redis.call('HSET', h, u .. ':p', t)
    redis.call('HDEL', h, u .. ':t')
    redis.call('HINCRBY', h, 'gen', 1)
  end
end

local function need(u, tokens)
  if u == 'requests' then
    return 1
  end
  return tokens
end

if op == 'take' then
  local tokens = tonumber(ARGV[2])
  local wait, short = 0, nil
  for _, u in ipairs(units) do
    roll(u)
    local n = need(u, tokens)
    if n > 0 then
      local l, r, t = num(u .. ':l'), num(u .. ':r'), num(u .. ':t')
      if l and n > l then
        return { 2, u, l, r or -1, 0, num('gen') or 0 }
      end
      -- Not enough left: wait for the reset. A window whose reset is unknown cannot be
      -- waited for; the server says no if it must.
      if r and n > r and t and t - now > wait then
        wait = t - now
        short = { u, l or -1, r }
      end
    end
  end
  local gen = num('gen') or 0
  if short then
    return { 1, short[1], short[2], short[3], wait, gen }
  end
  for _, u in ipairs(units) do
    local n = need(u, tokens)
    local r = num(u .. ':r')
    if n > 0 and r then
      redis.call('HSET', h, u .. ':r', math.max(0, r - n))
    end
  end
  return { 0, '', 0, 0, 0, gen }
end

if op == 'give' then
  local tokens, gen = tonumber(ARGV[2]), tonumber(ARGV[3])
  if (num('gen') or 0) ~= gen then
    return 0
  end
  for _, u in ipairs(units) do
    local n = need(u, tokens)
    local r = num(u .. ':r')
    if n > 0 and r then
      local l = num(u .. ':l')
      local back = r + n
      if l then
        back = math.min(l, back)
      end
      redis.call('HSET', h, u .. ':r', back)
    end
  end
  return 1
end

if op == 'learn' then
  local longest = 0
  for i = 2, #ARGV, 4 do
    local u = ARGV[i]
    local l, r, reset = tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3])
    roll(u)
    local fresh = true
    if reset >= 0 then
      local at = now + reset
      local w = math.max(num(u .. ':w') or 0, reset)
      redis.call('HSET', h, u .. ':w', w)
      longest = math.max(longest, w)
      -- A reply the server made before the window the fleet has rolled to: what it says of
      -- the ended window must not close the new one, nor reset it a second time.
      local p = num(u .. ':p')
      if p and at <= p + math.min(w / 2, 2000) then
        fresh = false
      else
        local t = num(u .. ':t')
        if not t or at > t then
          redis.call('HSET', h, u .. ':t', at)
        end
      end
    end
    if fresh then
      if l >= 0 then
        redis.call('HSET', h, u .. ':l', l)
      end
      if r >= 0 then
        -- Within a window what is left only falls: the server's figure does not count the
        -- fleet's attempts still in flight, the fleet's own does.
        local known = num(u .. ':r')
        if reset < 0 or not known or r < known then
          redis.call('HSET', h, u .. ':r', r)
        end
      end
    end
  end
  redis.call('PEXPIRE', h, math.max(redis.call('PTTL', h), 2 * longest + 60000))
  return 1
end

return redis.error_reply('unknown operation ' .. tostring(op))
