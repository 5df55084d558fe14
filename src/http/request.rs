//! What the layer reads from a request: the engine's view of it (a
//! [`Delivery`]), the key's scope per principal, and the fingerprint bound
//! to the request line.

use axum::http::request::Parts;
use axum::http::{HeaderMap, header};
use bytes::Bytes;
use sha2::{Digest, Sha256};

use super::form::{FormError, form_as_json};
use crate::delivery::Delivery;
use crate::fingerprint::Fingerprint;

/// The header of `Idempotency-Key` mode.
pub(super) const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// Whether the request carries more than one `Idempotency-Key` header
/// (which one would be the key? Taking either could replay another
/// request's response).
pub(super) fn repeated_key(headers: &HeaderMap) -> bool {
    headers.get_all(IDEMPOTENCY_KEY).iter().nth(1).is_some()
}

/// The engine's view of the request: a form body is read as a JSON object
/// of its fields, so JSON-pointer keys and fingerprints work on both. A form
/// body that does not decode strictly is refused, and so is a `signed` one
/// (its signature checked) that declares another charset than UTF-8.
pub(super) fn delivery_of(
    parts: &Parts,
    body: &Bytes,
    principal: Option<&str>,
    signed: bool,
) -> Result<Delivery, FormError> {
    let content_type = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    // Signed bytes are read one way whatever the (unsigned) content type
    // says, or the same signature would stand for two payloads, and two
    // keys for a digest key: JSON as JSON, anything else as a form.
    let json = signed && serde_json::from_slice::<serde::de::IgnoredAny>(body).is_ok();
    let payload = match form_as_json(content_type, body, signed).filter(|_| !json) {
        None if signed && !json => return Err(FormError::SignedNotForm),
        None => body.to_vec(),
        Some(json) => json?,
    };
    let mut d = Delivery::new(payload).with_request(parts.method.as_str(), parts.uri.path());
    for (name, value) in &parts.headers {
        let value = if name.as_str() == IDEMPOTENCY_KEY {
            unquote_sf_string(value.as_bytes())
        } else {
            value.as_bytes().to_vec()
        };
        d = d.with_metadata(name.as_str(), value);
    }
    if let Some(p) = principal {
        d = d.with_principal(p);
    }
    Ok(d)
}

/// The IETF draft sends the key as a structured-field string (`"abc"`);
/// unquote it (with `\"` and `\\` escapes). A bare token is taken as is.
fn unquote_sf_string(value: &[u8]) -> Vec<u8> {
    match value {
        [b'"', inner @ .., b'"'] => {
            let mut out = Vec::with_capacity(inner.len());
            let mut escaped = false;
            for &b in inner {
                if escaped || b != b'\\' {
                    out.push(b);
                    escaped = false;
                } else {
                    escaped = true;
                }
            }
            out
        }
        _ => value.to_vec(),
    }
}

/// A key names one operation on one resource: the same key and body sent to
/// another method, path or query is another request (`422`), not a replay.
pub(super) fn bind_to_request(parts: &Parts, fp: &Fingerprint) -> Fingerprint {
    let mut h = Sha256::new();
    h.update(b"onceonly-http-request\0");
    for part in [
        parts.method.as_str().as_bytes(),
        parts.uri.path().as_bytes(),
        parts.uri.query().unwrap_or_default().as_bytes(),
        fp.as_bytes(),
    ] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part);
    }
    Fingerprint(h.finalize().into())
}

/// `scope` alone, or `scope@<hash of the principal>`: keys of different
/// principals never meet.
pub(super) fn scope_for(scope: &str, principal: Option<&str>) -> String {
    match principal {
        None => scope.to_owned(),
        Some(p) => {
            let digest = hex::encode(Sha256::digest(p.as_bytes()));
            format!("{scope}@{}", &digest[..32])
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::Request;

    fn parts(method: &str, uri: &str, headers: &[(&str, &str)]) -> Parts {
        let mut req = Request::builder().method(method).uri(uri);
        for (name, value) in headers {
            req = req.header(*name, *value);
        }
        req.body(()).expect("request").into_parts().0
    }

    #[test]
    fn structured_field_keys_are_unquoted() {
        assert_eq!(unquote_sf_string(br#""abc""#), b"abc");
        assert_eq!(unquote_sf_string(br#""a\"b\\c""#), br#"a"b\c"#);
        assert_eq!(unquote_sf_string(b"bare-token"), b"bare-token");
        assert_eq!(unquote_sf_string(br#""""#), b"");
        // A lone quote is not a string: taken as is.
        assert_eq!(unquote_sf_string(br#"""#), br#"""#);
    }

    #[test]
    fn a_repeated_key_header_is_detected() {
        let one = parts("POST", "/", &[("Idempotency-Key", "a")]);
        assert!(!repeated_key(&one.headers));
        let two = parts(
            "POST",
            "/",
            &[("Idempotency-Key", "a"), ("idempotency-key", "b")],
        );
        assert!(repeated_key(&two.headers));
    }

    #[test]
    fn the_delivery_carries_the_unquoted_key_and_the_request_line() {
        let p = parts(
            "POST",
            "/orders?x=1",
            &[("Idempotency-Key", r#""k-1""#), ("X-Other", "v")],
        );
        let d =
            delivery_of(&p, &Bytes::from_static(b"{}"), Some("tenant"), false).expect("delivery");
        assert_eq!(d.metadata("idempotency-key"), Some(&b"k-1"[..]));
        assert_eq!(d.metadata("x-other"), Some(&b"v"[..]));
        assert_eq!(d.payload(), b"{}");
    }

    #[test]
    fn form_bodies_become_json_objects() {
        let p = parts(
            "POST",
            "/notify",
            &[("Content-Type", "application/x-www-form-urlencoded")],
        );
        let d = delivery_of(
            &p,
            &Bytes::from_static(b"out_trade_no=T%201&a=2"),
            None,
            false,
        )
        .expect("delivery");
        let json: serde_json::Value = serde_json::from_slice(d.payload()).expect("json");
        assert_eq!(json["out_trade_no"], "T 1");
    }

    #[test]
    fn signed_callbacks_are_read_one_way_whatever_the_content_type() {
        let form = parts(
            "POST",
            "/notify",
            &[("Content-Type", "application/x-www-form-urlencoded")],
        );
        let text = parts("POST", "/notify", &[("Content-Type", "text/plain")]);
        // JSON stays JSON, even sent as a form.
        let json = Bytes::from_static(br#"{"out_trade_no":"T-1"}"#);
        let as_form = delivery_of(&form, &json, None, true).expect("json");
        assert_eq!(as_form.payload(), &json[..]);
        // Anything else is a form, or refused: as plain text the same
        // signed bytes would read as another payload.
        let body = Bytes::from_static(b"out_trade_no=T-1");
        assert!(delivery_of(&form, &body, None, true).is_ok());
        assert_eq!(
            delivery_of(&text, &body, None, true).err(),
            Some(FormError::SignedNotForm)
        );
        assert!(delivery_of(&text, &body, None, false).is_ok());
    }

    #[test]
    fn fingerprints_are_bound_to_method_path_and_query() {
        let fp = Fingerprint([7; 32]);
        let a = bind_to_request(&parts("POST", "/a?q=1", &[]), &fp);
        assert_eq!(a, bind_to_request(&parts("POST", "/a?q=1", &[]), &fp));
        assert_ne!(a, bind_to_request(&parts("PATCH", "/a?q=1", &[]), &fp));
        assert_ne!(a, bind_to_request(&parts("POST", "/b?q=1", &[]), &fp));
        assert_ne!(a, bind_to_request(&parts("POST", "/a?q=2", &[]), &fp));
        assert_ne!(
            a,
            bind_to_request(&parts("POST", "/a?q=1", &[]), &Fingerprint([8; 32]))
        );
    }

    #[test]
    fn principals_get_their_own_scopes() {
        assert_eq!(scope_for("orders", None), "orders");
        let a = scope_for("orders", Some("alice"));
        let b = scope_for("orders", Some("bob"));
        assert!(a.starts_with("orders@") && a.len() == "orders@".len() + 32);
        assert_ne!(a, b);
        assert_eq!(a, scope_for("orders", Some("alice")));
    }
}
