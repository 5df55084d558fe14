//! The Lua scripts: each check-and-act runs atomically in Redis.
//!
//! Values: a claim in progress is `c\n<owner>\n<fingerprint hex>`, a
//! completed key `d\n<fingerprint hex>\n<result bytes>`.

use std::sync::LazyLock;

use ::redis::aio::ConnectionLike;
use ::redis::{Cmd, FromRedisValue, Pipeline, ServerErrorKind, ToRedisArgs, Value};

use super::conn::RedisConnection;
use super::error::RedisError;

/// A Lua script and its SHA-1.
pub(crate) struct Lua {
    source: &'static str,
    sha: String,
}

impl Lua {
    fn new(source: &'static str) -> Self {
        Self {
            source,
            sha: ::redis::Script::new(source).get_hash().to_owned(),
        }
    }

    /// `EVALSHA` (or `EVAL`, with the source) of this script on `key`.
    fn cmd(&self, by_hash: bool, key: &str, args: &[&dyn ToArg]) -> Cmd {
        let mut cmd = if by_hash {
            let mut c = ::redis::cmd("EVALSHA");
            c.arg(&self.sha);
            c
        } else {
            let mut c = ::redis::cmd("EVAL");
            c.arg(self.source);
            c
        };
        cmd.arg(1).arg(key);
        for a in args {
            a.push(&mut cmd);
        }
        cmd
    }

    /// Runs the script on `key` (its only key, so one node of a cluster
    /// runs it) and returns its reply; with `replicas`, also waits (`WAIT`,
    /// on the same connection: the write must be the one waited for) until
    /// that many replicas have the write, or the timeout passes, and
    /// returns how many acknowledged it.
    ///
    /// `EVALSHA` first; a node without the script in its cache (a restart,
    /// a replica just promoted: scripts are not replicated) gets `EVAL`
    /// with the source, on that node only, rather than a `SCRIPT LOAD` to
    /// every node of a cluster (which fails while one is down).
    pub(crate) async fn run<T: FromRedisValue>(
        &self,
        conn: &RedisConnection,
        key: &str,
        args: &[&dyn ToArg],
        replicas: Option<Replicas>,
    ) -> Result<(T, Option<i64>), RedisError> {
        let mut conn = conn.clone();
        let first = match self.try_run(&mut conn, true, key, args, replicas).await {
            // The script's first write failed on a replica: nothing was
            // written; once the client knows the slot's master, run it
            // there.
            Err(e) if e.is_read_only() && conn.is_cluster() => {
                conn.refresh_slot_of(key).await;
                self.try_run(&mut conn, true, key, args, replicas).await
            }
            other => other,
        };
        let first = first.map_err(|e| {
            if conn.is_cluster() {
                e
            } else {
                e.on_single_server()
            }
        });
        match first? {
            Some(done) => Ok(done),
            None => self
                .try_run(&mut conn, false, key, args, replicas)
                .await?
                .ok_or_else(|| RedisError::Corrupt {
                    detail: "EVAL answered NOSCRIPT".to_owned(),
                }),
        }
    }

    /// `None`: the node does not know the script (`NOSCRIPT`).
    async fn try_run<T: FromRedisValue>(
        &self,
        conn: &mut RedisConnection,
        by_hash: bool,
        key: &str,
        args: &[&dyn ToArg],
        replicas: Option<Replicas>,
    ) -> Result<Option<(T, Option<i64>)>, RedisError> {
        let cmd = self.cmd(by_hash, key, args);
        let Some(wait) = replicas else {
            return match cmd.query_async::<T>(conn).await {
                Ok(v) => Ok(Some((v, None))),
                Err(e) if e.kind() == ::redis::ErrorKind::Server(ServerErrorKind::NoScript) => {
                    Ok(None)
                }
                Err(e) => Err(e.into()),
            };
        };
        // The WAIT must answer before the reply times out: a timed-out
        // claim is one the caller does not know it holds, and nobody
        // releases it.
        let timeout = match conn.response_timeout() {
            Some(reply) => wait.timeout.min(reply * 4 / 5),
            None => wait.timeout,
        };
        let mut pipe = Pipeline::new();
        pipe.add_command(cmd).cmd("WAIT").arg(wait.count).arg(
            u64::try_from(timeout.as_millis())
                .unwrap_or(u64::MAX)
                .max(1),
        );
        let mut replies = conn.req_packed_commands(&pipe, 0, 2).await?.into_iter();
        let (Some(reply), Some(acked)) = (replies.next(), replies.next()) else {
            return Err(RedisError::Corrupt {
                detail: "a pipeline of two commands answered fewer replies".to_owned(),
            });
        };
        if let Value::ServerError(e) = &reply
            && e.kind() == Some(ServerErrorKind::NoScript)
        {
            return Ok(None);
        }
        let reply =
            T::from_redis_value(reply.extract_error()?).map_err(::redis::RedisError::from)?;
        let acked =
            i64::from_redis_value(acked.extract_error()?).map_err(::redis::RedisError::from)?;
        Ok(Some((reply, Some(acked))))
    }
}

/// How many replicas must have a write, and how long to wait for them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Replicas {
    pub(crate) count: u32,
    pub(crate) timeout: std::time::Duration,
}

/// A script argument.
pub(crate) trait ToArg: Sync {
    fn push(&self, cmd: &mut Cmd);
}

impl<T: ToRedisArgs + Sync> ToArg for T {
    fn push(&self, cmd: &mut Cmd) {
        cmd.arg(self);
    }
}

/// `KEYS[1]`; `ARGV`: owner, lease ms, fingerprint hex (may be empty).
/// Returns `{"claimed"}`, `{"done", result}`, `{"conflict", stored fp}` or
/// `{"busy", pttl}`. Idempotent for one owner token: a cluster client
/// resends a call whose reply it did not get (a timeout, a dropped
/// connection), and the second run of a claim that the first run took
/// must answer `claimed`, not `busy` with the caller's own claim.
pub(crate) fn claim() -> &'static Lua {
    static SCRIPT: LazyLock<Lua> = LazyLock::new(|| {
        Lua::new(
            r#"
local mine = 'c\n' .. ARGV[1] .. '\n' .. ARGV[3]
local ok = redis.call('SET', KEYS[1], mine, 'NX', 'PX', ARGV[2])
if ok then return {'claimed'} end
local v = redis.call('GET', KEYS[1])
if v == mine then return {'claimed'} end
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

/// `KEYS[1]`; `ARGV`: owner, retention ms, result, fingerprint hex of the
/// claim. Completes only if `owner` still holds the claim (fencing).
/// Returns 1 or 0; 1 also when the key already holds exactly this
/// completion (the resent second run of a completion that the first run
/// recorded).
pub(crate) fn complete() -> &'static Lua {
    static SCRIPT: LazyLock<Lua> = LazyLock::new(|| {
        Lua::new(
            r#"
local v = redis.call('GET', KEYS[1])
local prefix = 'c\n' .. ARGV[1] .. '\n'
if v and v == 'd\n' .. ARGV[4] .. '\n' .. ARGV[3] then return 1 end
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
pub(crate) fn renew() -> &'static Lua {
    static SCRIPT: LazyLock<Lua> = LazyLock::new(|| {
        Lua::new(
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
pub(crate) fn release() -> &'static Lua {
    static SCRIPT: LazyLock<Lua> = LazyLock::new(|| {
        Lua::new(
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

/// `KEYS[1]`; no `ARGV`. Returns `{}` for a missing key, else `{value,
/// pttl}` (a read of the earlier key layout during an upgrade).
pub(crate) fn peek() -> &'static Lua {
    static SCRIPT: LazyLock<Lua> = LazyLock::new(|| {
        Lua::new(
            r#"
local v = redis.call('GET', KEYS[1])
if not v then return {} end
return {v, tostring(redis.call('PTTL', KEYS[1]))}
"#,
        )
    });
    &SCRIPT
}
