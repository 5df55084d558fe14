//! One connection type for a single Redis server and a Redis Cluster, so
//! the scripts and commands are written once.

use std::time::Duration;

use ::redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use ::redis::cluster::{ClusterClient, ClusterConfig};
use ::redis::cluster_async::ClusterConnection;
use ::redis::{Cmd, Pipeline, RedisFuture, Value};

use super::error::RedisError;

/// The default connection and response timeouts.
const DEFAULT_TIMEOUT: Duration = Duration::from_millis(500);

/// A connection to Redis: one server (an auto-reconnecting
/// [`ConnectionManager`]) or a Redis Cluster (a
/// [`ClusterConnection`], which follows `MOVED`/`ASK` redirections,
/// refreshes its slot map after a failover or a resharding, and reconnects
/// to nodes by itself).
///
/// Cheap to clone: clones share the connection. [`RedisStore`] and
/// [`CachedStore`] take one with `new`, or build one from a URL with
/// `connect`:
///
/// - `redis://host:6379` (`rediss://` with TLS): one server;
/// - `redis+cluster://host1:7000,host2:7000` (`rediss+cluster://` with TLS):
///   a cluster, from one or more of its nodes (the client discovers the
///   others; give several so a node that is down at startup does not stop
///   it). User and password apply to every node.
///
/// Or with [`RedisConnection::builder`], which also sets the timeouts.
///
/// [`RedisStore`]: super::RedisStore
/// [`CachedStore`]: super::CachedStore
#[derive(Clone)]
pub struct RedisConnection {
    inner: Inner,
    /// The per-reply timeout, when this crate's builder set it.
    response_timeout: Option<Duration>,
}

#[derive(Clone)]
enum Inner {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl std::fmt::Debug for RedisConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisConnection")
            .field("cluster", &self.is_cluster())
            .finish_non_exhaustive()
    }
}

impl RedisConnection {
    /// Connects to `url` (one server or, with `redis+cluster://`, a
    /// cluster; see the type's docs) with 500 ms timeouts, waiting for the
    /// first connection.
    pub async fn connect(url: &str) -> Result<Self, RedisError> {
        Self::builder().url(url).connect().await
    }

    /// Configures a connection: where to (a URL or cluster nodes) and its
    /// timeouts.
    pub fn builder() -> RedisConnectionBuilder {
        RedisConnectionBuilder::default()
    }

    /// Whether this is a Redis Cluster connection.
    pub fn is_cluster(&self) -> bool {
        matches!(self.inner, Inner::Cluster(_))
    }

    /// The per-reply timeout, if this crate's builder made the connection.
    pub(crate) fn response_timeout(&self) -> Option<Duration> {
        self.response_timeout
    }

    fn with_response_timeout(mut self, timeout: Duration) -> Self {
        self.response_timeout = Some(timeout);
        self
    }

    /// Makes a cluster connection rebuild its slot map after a write to
    /// `key` reached a replica (`READONLY`). redis-rs sends `READONLY` on
    /// every node connection, so a node the client still takes for the
    /// slot's master, which came back from a crash as a replica of its
    /// successor, runs a script there (a script without flags is not a
    /// write command) and fails at its first write instead of redirecting
    /// it: the client never sees a `MOVED` and never learns the new
    /// master. `SETRANGE key 0 ""` is a write command that changes nothing
    /// (an empty range neither creates nor modifies a key); the replica
    /// answers it with the `MOVED` that makes the client rebuild its map.
    /// A no-op on one server.
    pub(crate) async fn refresh_slot_of(&self, key: &str) {
        let Inner::Cluster(conn) = &self.inner else {
            return;
        };
        let mut probe = ::redis::cmd("SETRANGE");
        probe.arg(key).arg(0).arg("");
        if let Err(e) = probe.query_async::<Value>(&mut conn.clone()).await {
            tracing::debug!(error = %e, "slot map refresh probe failed");
        }
    }
}

impl From<ConnectionManager> for RedisConnection {
    fn from(conn: ConnectionManager) -> Self {
        Self {
            inner: Inner::Single(conn),
            response_timeout: None,
        }
    }
}

impl From<ClusterConnection> for RedisConnection {
    fn from(conn: ClusterConnection) -> Self {
        Self {
            inner: Inner::Cluster(conn),
            response_timeout: None,
        }
    }
}

impl ConnectionLike for RedisConnection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match &mut self.inner {
            Inner::Single(c) => c.req_packed_command(cmd),
            Inner::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match &mut self.inner {
            Inner::Single(c) => c.req_packed_commands(cmd, offset, count),
            Inner::Cluster(c) => c.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match &self.inner {
            Inner::Single(c) => c.get_db(),
            Inner::Cluster(c) => c.get_db(),
        }
    }
}

/// Where a [`RedisConnectionBuilder`] connects to.
#[derive(Clone, Debug, Default)]
enum Target {
    #[default]
    Unset,
    Url(String),
    Cluster(Vec<String>),
}

/// Builds a [`RedisConnection`]:
/// `RedisConnection::builder().cluster(["redis://10.0.0.1:7000", "redis://10.0.0.2:7000"]).connect().await?`.
///
/// Every wait is bounded: connecting to a node by the connection timeout,
/// a reply by the response timeout (both 500 ms by default). On a cluster
/// a call, its redirections, reconnections and retries included, takes at
/// most twice the response timeout; retries wait 50 to 250 ms (a cluster
/// that is electing a new master answers `CLUSTERDOWN` or `TRYAGAIN` for
/// a second or two: the caller sees an error, not a stall). On one server
/// the connection reconnects once before a call fails.
#[derive(Clone, Debug)]
#[must_use]
pub struct RedisConnectionBuilder {
    target: Target,
    connection_timeout: Duration,
    response_timeout: Duration,
}

impl Default for RedisConnectionBuilder {
    fn default() -> Self {
        Self {
            target: Target::Unset,
            connection_timeout: DEFAULT_TIMEOUT,
            response_timeout: DEFAULT_TIMEOUT,
        }
    }
}

impl RedisConnectionBuilder {
    /// One URL: `redis://` or `rediss://` for one server,
    /// `redis+cluster://h1:p1,h2:p2` or `rediss+cluster://` for a cluster.
    pub fn url(mut self, url: impl Into<String>) -> Self {
        self.target = Target::Url(url.into());
        self
    }

    /// A Redis Cluster, from the URLs of some of its nodes
    /// (`redis://host:port`, or `rediss://` with TLS; all with the same
    /// user and password).
    pub fn cluster<I, S>(mut self, nodes: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.target = Target::Cluster(nodes.into_iter().map(Into::into).collect());
        self
    }

    /// How long connecting to one server or node may take (default 500 ms).
    pub fn connection_timeout(mut self, timeout: Duration) -> Self {
        self.connection_timeout = timeout.max(Duration::from_millis(1));
        self
    }

    /// How long a reply may take (default 500 ms).
    pub fn response_timeout(mut self, timeout: Duration) -> Self {
        self.response_timeout = timeout.max(Duration::from_millis(1));
        self
    }

    /// Connects and waits for the first connection (at most the connection
    /// timeout, twice on a cluster: the nodes, then the slot map).
    pub async fn connect(self) -> Result<RedisConnection, RedisError> {
        match self.resolve()? {
            Resolved::Single(url) => {
                let client = ::redis::Client::open(url.as_str())?;
                let conn = ConnectionManager::new_with_config(client, self.single_config());
                Ok(
                    RedisConnection::from(bounded(self.connection_timeout * 2, conn).await??)
                        .with_response_timeout(self.response_timeout),
                )
            }
            Resolved::Cluster(nodes) => {
                let client = self.cluster_client(&nodes)?;
                let conn = client.get_async_connection();
                Ok(
                    RedisConnection::from(bounded(self.connection_timeout * 2, conn).await??)
                        .with_response_timeout(self.response_timeout),
                )
            }
        }
    }

    /// Like [`connect`](Self::connect), without waiting for the first
    /// connection: a Redis that is down at startup makes the first calls
    /// fail (within the timeouts), not the construction.
    pub fn connect_lazy(self) -> Result<RedisConnection, RedisError> {
        match self.resolve()? {
            Resolved::Single(url) => {
                let client = ::redis::Client::open(url.as_str())?;
                Ok(
                    RedisConnection::from(ConnectionManager::new_lazy_with_config(
                        client,
                        self.single_config(),
                    )?)
                    .with_response_timeout(self.response_timeout),
                )
            }
            Resolved::Cluster(nodes) => {
                let client = self.cluster_client(&nodes)?;
                Ok(RedisConnection::from(
                    client.get_pending_async_connection_with_config(ClusterConfig::new()),
                )
                .with_response_timeout(self.response_timeout))
            }
        }
    }

    fn resolve(&self) -> Result<Resolved, RedisError> {
        match &self.target {
            Target::Unset => Err(config_error("no Redis URL or cluster nodes given")),
            Target::Url(url) => match cluster_nodes(url)? {
                Some(nodes) => Ok(Resolved::Cluster(nodes)),
                None => Ok(Resolved::Single(url.clone())),
            },
            Target::Cluster(nodes) if nodes.is_empty() => {
                Err(config_error("a Redis Cluster needs at least one node URL"))
            }
            Target::Cluster(nodes) => Ok(Resolved::Cluster(nodes.clone())),
        }
    }

    fn single_config(&self) -> ConnectionManagerConfig {
        ConnectionManagerConfig::new()
            .set_connection_timeout(Some(self.connection_timeout))
            .set_response_timeout(Some(self.response_timeout))
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_secs(1))
    }

    fn cluster_client(&self, nodes: &[String]) -> Result<ClusterClient, RedisError> {
        Ok(ClusterClient::builder(nodes.iter().map(String::as_str))
            .connection_timeout(self.connection_timeout)
            .response_timeout(self.response_timeout)
            .overall_response_timeout(Some(self.response_timeout * 2))
            .retries(3)
            .min_retry_wait(50)
            .max_retry_wait(250)
            .build()?)
    }
}

enum Resolved {
    Single(String),
    Cluster(Vec<String>),
}

async fn bounded<F: std::future::Future>(limit: Duration, f: F) -> Result<F::Output, RedisError> {
    tokio::time::timeout(limit, f).await.map_err(|_| {
        RedisError::Redis(::redis::RedisError::from(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "connecting to Redis timed out",
        )))
    })
}

fn config_error(detail: &'static str) -> RedisError {
    RedisError::Redis(::redis::RedisError::from((
        ::redis::ErrorKind::InvalidClientConfig,
        detail,
    )))
}

/// The node URLs of a `redis+cluster://` or `rediss+cluster://` URL, `None`
/// for any other scheme. `redis+cluster://user:pw@h1:7000,h2:7001/?protocol=3`
/// gives `redis://user:pw@h1:7000/?protocol=3` and
/// `redis://user:pw@h2:7001/?protocol=3`.
pub(crate) fn cluster_nodes(url: &str) -> Result<Option<Vec<String>>, RedisError> {
    let Some((scheme, rest)) = url.split_once("://") else {
        return Ok(None);
    };
    let node_scheme = match scheme.to_ascii_lowercase().as_str() {
        "redis+cluster" => "redis",
        "rediss+cluster" => "rediss",
        _ => return Ok(None),
    };
    let (authority, tail) = match rest.find(['/', '?']) {
        Some(at) => rest.split_at(at),
        None => (rest, ""),
    };
    let (userinfo, hosts) = match authority.rsplit_once('@') {
        Some((user, hosts)) => (Some(user), hosts),
        None => (None, authority),
    };
    let nodes: Vec<String> = hosts
        .split(',')
        .map(str::trim)
        .filter(|h| !h.is_empty())
        .map(|host| match userinfo {
            Some(user) => format!("{node_scheme}://{user}@{host}{tail}"),
            None => format!("{node_scheme}://{host}{tail}"),
        })
        .collect();
    if nodes.is_empty() {
        return Err(config_error(
            "a redis+cluster:// URL needs at least one host:port",
        ));
    }
    Ok(Some(nodes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_urls_expand_to_one_url_per_node() {
        assert_eq!(cluster_nodes("redis://127.0.0.1:6379").unwrap(), None);
        assert_eq!(cluster_nodes("rediss://h:6380/0").unwrap(), None);
        assert_eq!(
            cluster_nodes("redis+cluster://10.0.0.1:7000,10.0.0.2:7001").unwrap(),
            Some(vec![
                "redis://10.0.0.1:7000".to_owned(),
                "redis://10.0.0.2:7001".to_owned()
            ])
        );
        assert_eq!(
            cluster_nodes("rediss+cluster://app:s%40cret@a:7000, b:7000/?protocol=3").unwrap(),
            Some(vec![
                "rediss://app:s%40cret@a:7000/?protocol=3".to_owned(),
                "rediss://app:s%40cret@b:7000/?protocol=3".to_owned()
            ])
        );
        assert_eq!(
            cluster_nodes("REDIS+CLUSTER://h:1").unwrap(),
            Some(vec!["redis://h:1".to_owned()])
        );
        assert!(cluster_nodes("redis+cluster://").is_err());
        assert!(cluster_nodes("redis+cluster://u:p@,/").is_err());
    }

    #[test]
    fn a_builder_without_a_target_is_a_configuration_error() {
        let err = RedisConnection::builder().connect_lazy().unwrap_err();
        assert!(!err.is_infrastructure(), "{err}");
        let err = RedisConnection::builder()
            .cluster(Vec::<String>::new())
            .connect_lazy()
            .unwrap_err();
        assert!(err.to_string().contains("at least one node"), "{err}");
    }

    #[tokio::test]
    async fn urls_choose_the_connection_kind() {
        let single = RedisConnection::builder()
            .url("redis://127.0.0.1:1")
            .connect_lazy()
            .unwrap();
        assert!(!single.is_cluster());
        let cluster = RedisConnection::builder()
            .url("redis+cluster://127.0.0.1:1,127.0.0.1:2")
            .connect_lazy()
            .unwrap();
        assert!(cluster.is_cluster());
    }
}
