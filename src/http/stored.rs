//! The response stored with a claim, and its byte-exact replay.
//!
//! Encoding: `onceonly-http/1\n`, a one-line JSON head (status, replayed
//! headers, whether the body was stored), `\n`, then the body bytes as they
//! were sent.

use axum::body::Body;
use axum::http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode};
use bytes::Bytes;
use serde::{Deserialize, Serialize};

const MAGIC: &[u8] = b"onceonly-http/1\n";

#[derive(Serialize, Deserialize)]
struct Head {
    status: u16,
    headers: Vec<(String, String)>,
    body_stored: bool,
}

/// A response as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StoredResponse {
    pub(crate) status: u16,
    pub(crate) headers: Vec<(String, String)>,
    /// `None`: the body was over the storage limit and was not kept.
    pub(crate) body: Option<Bytes>,
}

impl StoredResponse {
    /// Keeps `status`, the allow-listed headers with text values, and the
    /// body if it is at most `max_body` bytes.
    pub(crate) fn capture(
        status: StatusCode,
        headers: &HeaderMap,
        allow: &[HeaderName],
        body: &Bytes,
        max_body: usize,
    ) -> Self {
        let headers = allow
            .iter()
            .flat_map(|name| {
                headers.get_all(name).iter().filter_map(move |v| {
                    v.to_str()
                        .ok()
                        .map(|v| (name.as_str().to_owned(), v.to_owned()))
                })
            })
            .collect();
        Self {
            status: status.as_u16(),
            headers,
            body: (body.len() <= max_body).then(|| body.clone()),
        }
    }

    pub(crate) fn encode(&self) -> Vec<u8> {
        let head = Head {
            status: self.status,
            headers: self.headers.clone(),
            body_stored: self.body.is_some(),
        };
        let head = serde_json::to_vec(&head).unwrap_or_default();
        let body = self.body.as_deref().unwrap_or_default();
        let mut out = Vec::with_capacity(MAGIC.len() + head.len() + 1 + body.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&head);
        out.push(b'\n');
        out.extend_from_slice(body);
        out
    }

    pub(crate) fn decode(bytes: &[u8]) -> Option<Self> {
        let rest = bytes.strip_prefix(MAGIC)?;
        let end = rest.iter().position(|&b| b == b'\n')?;
        let head: Head = serde_json::from_slice(&rest[..end]).ok()?;
        let body = &rest[end + 1..];
        Some(Self {
            status: head.status,
            headers: head.headers,
            body: head.body_stored.then(|| Bytes::copy_from_slice(body)),
        })
    }

    /// The replay: stored status, headers and body, plus
    /// `Idempotent-Replayed: true`. A body that was not stored replays as
    /// empty, with `Idempotent-Replay-Body: omitted`.
    pub(crate) fn replay(&self) -> Response<Body> {
        let mut response = Response::new(Body::from(self.body.clone().unwrap_or_default()));
        *response.status_mut() = StatusCode::from_u16(self.status).unwrap_or(StatusCode::OK);
        let h = response.headers_mut();
        for (name, value) in &self.headers {
            let omitted = self.body.is_none()
                && (name.eq_ignore_ascii_case("content-type")
                    || name.eq_ignore_ascii_case("content-length"));
            if omitted {
                continue;
            }
            if let (Ok(n), Ok(v)) = (
                HeaderName::from_bytes(name.as_bytes()),
                HeaderValue::from_str(value),
            ) {
                h.append(n, v);
            }
        }
        h.insert("idempotent-replayed", HeaderValue::from_static("true"));
        if self.body.is_none() {
            h.insert(
                "idempotent-replay-body",
                HeaderValue::from_static("omitted"),
            );
        }
        response
    }
}

/// Reads `body` until it ends (`rest` is `None`) or more than `max` bytes
/// were read (`rest` is the unread remainder).
pub(crate) async fn read_up_to(
    mut body: Body,
    max: usize,
) -> Result<(Bytes, Option<Body>), String> {
    use http_body_util::BodyExt as _;
    let mut buf = bytes::BytesMut::new();
    loop {
        match body.frame().await {
            None => return Ok((buf.freeze(), None)),
            Some(Err(e)) => return Err(e.to_string()),
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    buf.extend_from_slice(&data);
                    if buf.len() > max {
                        return Ok((buf.freeze(), Some(body)));
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binary_bodies_round_trip_byte_for_byte() {
        let mut headers = HeaderMap::new();
        headers.insert(
            "content-type",
            HeaderValue::from_static("application/octet-stream"),
        );
        headers.insert("x-internal", HeaderValue::from_static("not replayed"));
        let body = Bytes::from(vec![0u8, 10, 255, 13, 10, b'{']);
        let allow = [HeaderName::from_static("content-type")];
        let stored = StoredResponse::capture(StatusCode::CREATED, &headers, &allow, &body, 1024);
        let back = StoredResponse::decode(&stored.encode()).unwrap();
        assert_eq!(back, stored);
        assert_eq!(back.body.as_deref(), Some(&body[..]));
        assert_eq!(
            back.headers,
            [(
                "content-type".to_owned(),
                "application/octet-stream".to_owned()
            )]
        );
    }

    #[test]
    fn oversized_bodies_keep_status_and_a_marker() {
        let body = Bytes::from(vec![b'x'; 11]);
        let stored = StoredResponse::capture(StatusCode::OK, &HeaderMap::new(), &[], &body, 10);
        let back = StoredResponse::decode(&stored.encode()).unwrap();
        assert_eq!(back.body, None);
        let replay = back.replay();
        assert_eq!(replay.status(), StatusCode::OK);
        assert_eq!(replay.headers()["idempotent-replay-body"], "omitted");
        assert!(StoredResponse::decode(b"garbage").is_none());
    }
}
