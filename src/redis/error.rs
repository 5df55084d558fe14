//! Errors of the Redis tier.

/// Why a Redis operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RedisError {
    /// Redis is unreachable or answered with an error.
    #[error("Redis error: {0}")]
    Redis(#[from] ::redis::RedisError),
    /// Fewer replicas than asked for
    /// ([`RedisStore::with_replica_acks`](super::RedisStore::with_replica_acks))
    /// acknowledged a write in time: a failover could lose it, so it does
    /// not count (a claim is not held).
    #[error("the write reached {acked} of {wanted} replicas in time")]
    NotReplicated {
        /// Replicas that acknowledged the write.
        acked: u32,
        /// Replicas asked for.
        wanted: u32,
    },
    /// A Redis Cluster node redirected a call (`MOVED`/`ASK`) made over a
    /// single-server connection: connect with `redis+cluster://` (or
    /// [`RedisConnection::builder`](super::RedisConnection::builder)`.cluster(..)`).
    #[error(
        "a Redis Cluster node redirected the call ({detail}): connect with redis+cluster://host:port,..."
    )]
    NotClusterConnection {
        /// The redirection.
        detail: String,
    },
    /// A value under one of our keys is not in our format. The Redis key
    /// is not part of the error: it holds the business key.
    #[error("unexpected value in Redis: {detail}")]
    Corrupt {
        /// What was wrong.
        detail: String,
    },
}

impl RedisError {
    /// Whether Redis is unreachable or cannot serve right now (I/O error,
    /// timeout, refused or dropped connection; a cluster that is down,
    /// electing a master or moving a slot: `CLUSTERDOWN`, `MASTERDOWN`,
    /// `TRYAGAIN`, `LOADING`, `READONLY` from a node that became a replica, a `MOVED` or `ASK` the
    /// cluster client stopped following while the topology changes, no connection to the slot's node; replicas
    /// that did not acknowledge in time), as opposed to answering with an
    /// error.
    pub fn is_infrastructure(&self) -> bool {
        use ::redis::{ErrorKind, ServerErrorKind};
        match self {
            Self::Redis(e) => {
                e.is_io_error()
                    || e.is_timeout()
                    || e.is_connection_refusal()
                    || e.is_connection_dropped()
                    || matches!(
                        e.kind(),
                        ErrorKind::ClusterConnectionNotFound
                            | ErrorKind::Server(
                                ServerErrorKind::ClusterDown
                                    | ServerErrorKind::MasterDown
                                    | ServerErrorKind::TryAgain
                                    | ServerErrorKind::BusyLoading
                                    | ServerErrorKind::ReadOnly
                                    | ServerErrorKind::Moved
                                    | ServerErrorKind::Ask
                            )
                    )
            }
            Self::NotReplicated { .. } => true,
            Self::NotClusterConnection { .. } | Self::Corrupt { .. } => false,
        }
    }

    /// A write reached a replica (`READONLY`).
    pub(crate) fn is_read_only(&self) -> bool {
        matches!(self, Self::Redis(e) if e.kind() == ::redis::ErrorKind::Server(::redis::ServerErrorKind::ReadOnly))
    }

    /// On a single-server connection, a cluster redirection becomes
    /// [`NotClusterConnection`](Self::NotClusterConnection): it will not
    /// go away by itself.
    pub(crate) fn on_single_server(self) -> Self {
        use ::redis::{ErrorKind, ServerErrorKind};
        match &self {
            Self::Redis(e)
                if matches!(
                    e.kind(),
                    ErrorKind::Server(ServerErrorKind::Moved | ServerErrorKind::Ask)
                ) =>
            {
                Self::NotClusterConnection {
                    detail: e.to_string(),
                }
            }
            _ => self,
        }
    }
}
