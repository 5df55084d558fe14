//! Errors of the Redis tier.

/// Why a Redis operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RedisError {
    /// Redis is unreachable or answered with an error.
    #[error("Redis error: {0}")]
    Redis(#[from] ::redis::RedisError),
    /// A value under one of our keys is not in our format.
    #[error("unexpected value under {key}: {detail}")]
    Corrupt {
        /// The Redis key.
        key: String,
        /// What was wrong.
        detail: String,
    },
    /// The scope or key cannot be used.
    #[error("invalid scope or key: {0}")]
    Invalid(String),
}
