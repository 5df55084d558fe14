//! The Lua scripts: each check-and-act runs atomically in Redis.
//!
//! Values: a claim in progress is `c\n<owner>\n<fingerprint hex>`, a
//! completed key `d\n<fingerprint hex>\n<result bytes>`.

use std::sync::LazyLock;

use ::redis::Script;

/// `KEYS[1]`; `ARGV`: owner, lease ms, fingerprint hex (may be empty).
/// Returns `{"claimed"}`, `{"done", result}`, `{"conflict", stored fp}` or
/// `{"busy", pttl}`.
pub(crate) fn claim() -> &'static Script {
    static SCRIPT: LazyLock<Script> = LazyLock::new(|| {
        Script::new(
            r#"
local ok = redis.call('SET', KEYS[1], 'c\n' .. ARGV[1] .. '\n' .. ARGV[3], 'NX', 'PX', ARGV[2])
if ok then return {'claimed'} end
local v = redis.call('GET', KEYS[1])
if string.sub(v, 1, 2) == 'd\n' then
  local nl = string.find(v, '\n', 3, true)
  if not nl then return {'corrupt'} end
  local fp = string.sub(v, 3, nl - 1)
  if fp ~= '' and ARGV[3] ~= '' and fp ~= ARGV[3] then return {'conflict', fp} end
  return {'done', string.sub(v, nl + 1)}
end
return {'busy', tostring(redis.call('PTTL', KEYS[1]))}
"#,
        )
    });
    &SCRIPT
}

/// `KEYS[1]`; `ARGV`: owner, retention ms, result. Completes only if
/// `owner` still holds the claim (fencing). Returns 1 or 0.
pub(crate) fn complete() -> &'static Script {
    static SCRIPT: LazyLock<Script> = LazyLock::new(|| {
        Script::new(
            r#"
local v = redis.call('GET', KEYS[1])
local prefix = 'c\n' .. ARGV[1] .. '\n'
if not v or string.sub(v, 1, string.len(prefix)) ~= prefix then return 0 end
local fp = string.sub(v, string.len(prefix) + 1)
redis.call('SET', KEYS[1], 'd\n' .. fp .. '\n' .. ARGV[3], 'PX', ARGV[2])
return 1
"#,
        )
    });
    &SCRIPT
}

/// `KEYS[1]`; `ARGV`: owner, lease ms. Extends the lease only if `owner`
/// still holds the claim. Returns 1 or 0.
pub(crate) fn renew() -> &'static Script {
    static SCRIPT: LazyLock<Script> = LazyLock::new(|| {
        Script::new(
            r#"
local v = redis.call('GET', KEYS[1])
local prefix = 'c\n' .. ARGV[1] .. '\n'
if not v or string.sub(v, 1, string.len(prefix)) ~= prefix then return 0 end
return redis.call('PEXPIRE', KEYS[1], ARGV[2])
"#,
        )
    });
    &SCRIPT
}

/// `KEYS[1]`; `ARGV`: owner. Deletes the claim only if `owner` still holds
/// it. Returns 1 or 0.
pub(crate) fn release() -> &'static Script {
    static SCRIPT: LazyLock<Script> = LazyLock::new(|| {
        Script::new(
            r#"
local v = redis.call('GET', KEYS[1])
local prefix = 'c\n' .. ARGV[1] .. '\n'
if not v or string.sub(v, 1, string.len(prefix)) ~= prefix then return 0 end
return redis.call('DEL', KEYS[1])
"#,
        )
    });
    &SCRIPT
}
