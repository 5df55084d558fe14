//! RFC 9457 `application/problem+json` responses for every error the layer
//! answers itself.

use axum::body::Body;
use axum::http::{HeaderValue, Response, StatusCode, header};

/// A problem document: `type` is `urn:onceonly:problem:<code>`.
pub(crate) fn problem(status: StatusCode, code: &str, title: &str, detail: &str) -> Response<Body> {
    let body = serde_json::json!({
        "type": format!("urn:onceonly:problem:{code}"),
        "title": title,
        "status": status.as_u16(),
        "detail": detail,
    });
    let mut response = Response::new(Body::from(body.to_string()));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    response
}

/// The same, with `Retry-After: <secs>`.
pub(crate) fn problem_retry_after(
    status: StatusCode,
    code: &str,
    title: &str,
    detail: &str,
    retry_after_secs: u64,
) -> Response<Body> {
    let mut response = problem(status, code, title, detail);
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from(retry_after_secs));
    response
}
