//! The fence in the HTTP layer: what a request whose entity or order
//! cannot be derived is answered. The rest of a fenced route is the
//! engine's (`engine/fence.rs`): a stale request is answered like a
//! duplicate that did nothing (`answer::stale`), and only a success
//! moves its entity's fence (the layer stores 2xx answers only).

use axum::body::Body;
use axum::http::{Response, StatusCode};

use super::answer;
use super::config::Config;
use crate::engine::Claimed;
use crate::key::KeyError;
use crate::store::SqlStore;

/// The answer to a request without a valid entity or order for the
/// fence: its key's committed answer if it has one (a duplicate, a
/// conflict, a stale request), `400 invalid-fence` otherwise.
pub(super) async fn unfenceable<S: SqlStore>(
    cfg: &Config<S>,
    scope: &str,
    key: &crate::key::IdemKey,
    fingerprint: Option<&crate::fingerprint::Fingerprint>,
    error: &KeyError,
) -> Response<Body> {
    let req = crate::store::ClaimRequest {
        key: key.as_str(),
        fingerprint,
        source: None,
        lock_wait: None,
    };
    let found = cfg.engine.committed(scope, &req).await;
    match found.and_then(|c| {
        c.map(|c| Claimed::<S>::settled(c, fingerprint.copied()))
            .transpose()
    }) {
        Ok(Some(Claimed::Duplicate { result })) => answer::duplicate(cfg, result.as_deref()),
        Ok(Some(Claimed::Stale(_))) => answer::stale(cfg),
        Ok(Some(_)) => answer::conflict(cfg),
        Ok(None) => answer::refused(
            cfg,
            StatusCode::BAD_REQUEST,
            "invalid-fence",
            "Entity or order missing",
            &error.to_string(),
        ),
        Err(e) => {
            tracing::warn!(error = %e, "could not look up a request without entity or order");
            answer::unavailable(
                cfg,
                "Idempotency store unavailable",
                "the request was not processed; retry later with the same key",
            )
        }
    }
}
