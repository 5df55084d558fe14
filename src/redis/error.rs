//! Errors of the Redis tier.

/// Why a Redis operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RedisError {
    /// Redis is unreachable or answered with an error.
    #[error("Redis error: {0}")]
    Redis(#[from] ::redis::RedisError),
    /// A value under one of our keys is not in our format. The Redis key
    /// is not part of the error: it holds the business key.
    #[error("unexpected value in Redis: {detail}")]
    Corrupt {
        /// What was wrong.
        detail: String,
    },
}

impl RedisError {
    /// Whether Redis is unreachable (I/O error, timeout, refused or dropped
    /// connection), as opposed to answering with an error.
    pub fn is_infrastructure(&self) -> bool {
        match self {
            Self::Redis(e) => {
                e.is_io_error()
                    || e.is_timeout()
                    || e.is_connection_refusal()
                    || e.is_connection_dropped()
            }
            Self::Corrupt { .. } => false,
        }
    }
}
