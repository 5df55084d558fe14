//! `application/x-www-form-urlencoded` bodies (Alipay-style callbacks),
//! decoded strictly: a key is derived from these bytes, so two different
//! bodies must never decode to the same text.

use std::fmt;

/// Why a form body was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum FormError {
    /// The decoded bytes are not valid in the declared (or default UTF-8)
    /// charset.
    NotUtf8,
    /// The `charset` parameter names an encoding the layer does not decode.
    UnsupportedCharset(String),
}

impl fmt::Display for FormError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NotUtf8 => f.write_str(
                "the form body does not decode as UTF-8 and its content type names no other charset",
            ),
            Self::UnsupportedCharset(c) => write!(
                f,
                "charset {c:?} is not supported: send UTF-8 (or ISO-8859-1) form bodies"
            ),
        }
    }
}

/// The charsets a form body may declare.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Charset {
    Utf8,
    Latin1,
}

fn charset_of(content_type: &str) -> Option<Result<Charset, FormError>> {
    let mut parts = content_type.split(';');
    let essence = parts.next().unwrap_or_default().trim();
    if !essence.eq_ignore_ascii_case("application/x-www-form-urlencoded") {
        return None;
    }
    let charset = parts.find_map(|p| {
        let (name, value) = p.split_once('=')?;
        name.trim()
            .eq_ignore_ascii_case("charset")
            .then(|| value.trim().trim_matches('"').to_ascii_lowercase())
    });
    Some(match charset.as_deref() {
        None | Some("utf-8" | "utf8") => Ok(Charset::Utf8),
        Some("iso-8859-1" | "latin1" | "us-ascii" | "ascii") => Ok(Charset::Latin1),
        Some(other) => Err(FormError::UnsupportedCharset(other.to_owned())),
    })
}

/// A form body as a JSON object of its fields: a field that appears once is
/// a string, a repeated one an array of strings (so `a=1&a=2` and `a=1&a=3`
/// fingerprint differently). `None` if `content_type` is not a form.
pub(crate) fn form_as_json(content_type: &str, body: &[u8]) -> Option<Result<Vec<u8>, FormError>> {
    let charset = match charset_of(content_type)? {
        Ok(c) => c,
        Err(e) => return Some(Err(e)),
    };
    Some(decode_fields(body, charset))
}

fn decode_fields(body: &[u8], charset: Charset) -> Result<Vec<u8>, FormError> {
    use serde_json::Value;
    let mut fields = serde_json::Map::new();
    for pair in body.split(|&b| b == b'&').filter(|p| !p.is_empty()) {
        let (k, v) = match pair.iter().position(|&b| b == b'=') {
            Some(i) => (&pair[..i], &pair[i + 1..]),
            None => (pair, &[][..]),
        };
        let k = decode_component(k, charset)?;
        let v = Value::String(decode_component(v, charset)?);
        match fields.get_mut(&k) {
            None => {
                fields.insert(k, v);
            }
            Some(Value::Array(values)) => values.push(v),
            Some(first) => *first = Value::Array(vec![first.take(), v]),
        }
    }
    Ok(Value::Object(fields).to_string().into_bytes())
}

/// `+` is a space, `%XX` a byte; the bytes must be valid in `charset`.
fn decode_component(raw: &[u8], charset: Charset) -> Result<String, FormError> {
    let plus_as_space: Vec<u8> = raw
        .iter()
        .map(|&b| if b == b'+' { b' ' } else { b })
        .collect();
    let bytes: Vec<u8> = percent_encoding::percent_decode(&plus_as_space).collect();
    match charset {
        Charset::Utf8 => String::from_utf8(bytes).map_err(|_| FormError::NotUtf8),
        Charset::Latin1 => Ok(bytes.into_iter().map(char::from).collect()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FORM: &str = "application/x-www-form-urlencoded";

    fn json(ct: &str, body: &[u8]) -> Result<serde_json::Value, FormError> {
        form_as_json(ct, body)
            .expect("a form")
            .map(|b| serde_json::from_slice(&b).unwrap())
    }

    #[test]
    fn fields_decode_and_repeat_as_arrays() {
        let v = json(FORM, b"out_trade_no=A%2B1&note=a+b&x=1&x=2&flag").unwrap();
        assert_eq!(v["out_trade_no"], "A+1");
        assert_eq!(v["note"], "a b");
        assert_eq!(v["x"], serde_json::json!(["1", "2"]));
        assert_eq!(v["flag"], "");
    }

    #[test]
    fn invalid_utf8_is_refused_not_replaced() {
        // %FF and %FE would both become U+FFFD with lossy decoding: one key
        // for two different callbacks.
        assert_eq!(json(FORM, b"out_trade_no=%FF"), Err(FormError::NotUtf8));
        assert_eq!(
            json(&format!("{FORM}; charset=UTF-8"), b"k=%FE"),
            Err(FormError::NotUtf8)
        );
    }

    #[test]
    fn declared_charsets() {
        let v = json(&format!("{FORM}; charset=ISO-8859-1"), b"k=%E9").unwrap();
        assert_eq!(v["k"], "\u{e9}");
        assert_eq!(
            json(&format!("{FORM}; charset=\"gbk\""), b"k=1"),
            Err(FormError::UnsupportedCharset("gbk".into()))
        );
        assert!(form_as_json("application/json", b"{}").is_none());
        assert!(json(&format!("{FORM};charset=utf-8"), b"k=%C3%A9").is_ok());
    }
}
