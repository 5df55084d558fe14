//! `application/x-www-form-urlencoded` bodies (Alipay-style callbacks),
//! decoded strictly: bytes that are not valid in the charset are refused,
//! never replaced, and so is a `%` that does not start an escape (`%zz`
//! would otherwise read the same as `%25zz`). Two bodies that differ only
//! in how they encode the same fields (`+` or `%20`, `%41` or `A`) are the
//! same form and decode alike; two forms with different fields never do.
//! The charset a key is read in must be one the sender signed: a
//! `charset` parameter of the (unsigned) content type is refused on a
//! signed callback unless it is UTF-8 (see [`form_as_json`]).

use std::fmt;

/// Why a form body was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum FormError {
    /// The decoded bytes are not valid in the declared (or default UTF-8)
    /// charset.
    NotUtf8,
    /// The `charset` parameter names an encoding the layer does not decode.
    UnsupportedCharset(String),
    /// A signed form whose content type names another charset than UTF-8:
    /// the charset is not signed, and the same signed bytes would read as
    /// another key in another charset.
    UnsignedCharset(String),
    /// A `%` that does not start a two-digit escape.
    BadEscape,
    /// A signed callback body that is neither JSON nor sent as a form: its
    /// signature covers the bytes, not the content type, so such a body
    /// would be read one way or another by a header nobody signed.
    SignedNotForm,
    /// More fields than 256.
    TooManyFields,
}

/// The most fields a form body may have: more is refused before anything
/// is decoded or sorted (a payment notification has a few dozen).
pub(crate) const MAX_FORM_FIELDS: usize = 256;

impl fmt::Display for FormError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NotUtf8 => f.write_str(
                "the form body does not decode in its charset (UTF-8 unless the content type or the provider's `charset` field names another)",
            ),
            Self::UnsignedCharset(c) => write!(
                f,
                "charset {c:?}: a signed form is read as UTF-8, the only charset its signature can vouch for (the content type is not signed)"
            ),
            Self::BadEscape => f.write_str("the form body has a `%` that does not start a two-digit escape"),
            Self::SignedNotForm => f.write_str(
                "a signed callback is JSON or an application/x-www-form-urlencoded form",
            ),
            Self::TooManyFields => write!(f, "the form body has more than {MAX_FORM_FIELDS} fields"),
            Self::UnsupportedCharset(c) => write!(
                f,
                "charset {c:?} is not supported: send UTF-8 (or ISO-8859-1{}) form bodies",
                if cfg!(feature = "providers") {
                    ", GBK, GB18030"
                } else {
                    ""
                }
            ),
        }
    }
}

/// The charsets a form body may declare.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Charset {
    Utf8,
    Latin1,
    /// GBK (and GB2312, which it extends), as Alipay sends with
    /// `charset=GBK`.
    #[cfg(feature = "providers")]
    Gbk,
    /// GB18030, the superset of GBK.
    #[cfg(feature = "providers")]
    Gb18030,
}

impl Charset {
    /// The charset a `charset` label names (case-insensitive).
    pub(crate) fn from_label(label: &str) -> Result<Self, FormError> {
        match label.trim().trim_matches('"').to_ascii_lowercase().as_str() {
            "utf-8" | "utf8" => Ok(Self::Utf8),
            "iso-8859-1" | "latin1" | "us-ascii" | "ascii" => Ok(Self::Latin1),
            #[cfg(feature = "providers")]
            "gbk" | "gb2312" | "cp936" => Ok(Self::Gbk),
            #[cfg(feature = "providers")]
            "gb18030" => Ok(Self::Gb18030),
            other => Err(FormError::UnsupportedCharset(other.to_owned())),
        }
    }

    /// `bytes` as text, strictly: bytes that are not valid in the charset
    /// are refused, never replaced.
    pub(crate) fn decode(self, bytes: Vec<u8>) -> Result<String, FormError> {
        match self {
            Self::Utf8 => String::from_utf8(bytes).map_err(|_| FormError::NotUtf8),
            Self::Latin1 => Ok(bytes.into_iter().map(char::from).collect()),
            #[cfg(feature = "providers")]
            Self::Gbk => strict(encoding_rs::GBK, &bytes),
            #[cfg(feature = "providers")]
            Self::Gb18030 => strict(encoding_rs::GB18030, &bytes),
        }
    }
}

#[cfg(feature = "providers")]
fn strict(encoding: &'static encoding_rs::Encoding, bytes: &[u8]) -> Result<String, FormError> {
    encoding
        .decode_without_bom_handling_and_without_replacement(bytes)
        .map(std::borrow::Cow::into_owned)
        .ok_or(FormError::NotUtf8)
}

fn charset_of(content_type: &str) -> Option<Result<Charset, FormError>> {
    let mut parts = content_type.split(';');
    let essence = parts.next().unwrap_or_default().trim();
    if !essence.eq_ignore_ascii_case("application/x-www-form-urlencoded") {
        return None;
    }
    Some(match content_type_charset(parts) {
        None => Ok(Charset::Utf8),
        Some(label) => Charset::from_label(&label),
    })
}

/// The `charset` parameter among a content type's parameters.
fn content_type_charset<'a>(mut params: impl Iterator<Item = &'a str>) -> Option<String> {
    params.find_map(|p| {
        let (name, value) = p.split_once('=')?;
        name.trim()
            .eq_ignore_ascii_case("charset")
            .then(|| value.trim().trim_matches('"').to_owned())
    })
}

/// Whether `content_type` is a form, and the charset it declares, if any.
#[cfg(feature = "providers")]
pub(crate) fn form_content_type(content_type: &str) -> Option<Option<String>> {
    let mut parts = content_type.split(';');
    let essence = parts.next().unwrap_or_default().trim();
    essence
        .eq_ignore_ascii_case("application/x-www-form-urlencoded")
        .then(|| content_type_charset(parts))
}

/// A form field, name and value, as unescaped bytes.
pub(crate) type RawPair = (Vec<u8>, Vec<u8>);

/// The fields of a form body as raw bytes: `+` is a space and `%XX` a
/// byte, nothing decoded into text yet (a signature may cover these bytes
/// in the body's own charset). At most 256, counted before
/// anything is decoded.
pub(crate) fn raw_pairs(body: &[u8]) -> Result<Vec<RawPair>, FormError> {
    if body.split(|&b| b == b'&').nth(MAX_FORM_FIELDS).is_some() {
        return Err(FormError::TooManyFields);
    }
    body.split(|&b| b == b'&')
        .filter(|p| !p.is_empty())
        .map(|pair| {
            let (k, v) = match pair.iter().position(|&b| b == b'=') {
                Some(i) => (&pair[..i], &pair[i + 1..]),
                None => (pair, &[][..]),
            };
            Ok((unescape(k)?, unescape(v)?))
        })
        .collect()
}

/// `+` as a space and `%XX` as a byte; a `%` without two hex digits after
/// it is refused.
fn unescape(raw: &[u8]) -> Result<Vec<u8>, FormError> {
    let mut out = Vec::with_capacity(raw.len());
    let mut i = 0;
    while i < raw.len() {
        match raw[i] {
            b'+' => out.push(b' '),
            b'%' => {
                let hex = raw.get(i + 1..i + 3).ok_or(FormError::BadEscape)?;
                let digit = |b: u8| char::from(b).to_digit(16).ok_or(FormError::BadEscape);
                let byte = digit(hex[0])? * 16 + digit(hex[1])?;
                out.push(u8::try_from(byte).map_err(|_| FormError::BadEscape)?);
                i += 2;
            }
            b => out.push(b),
        }
        i += 1;
    }
    Ok(out)
}

/// A form body as a JSON object of its fields: a field that appears once is
/// a string, a repeated one an array of strings (so `a=1&a=2` and `a=1&a=3`
/// fingerprint differently). `None` if `content_type` is not a form. A
/// `signed` body (its bytes verified, not its content type) is read as
/// UTF-8 only: another declared charset is [`FormError::UnsignedCharset`].
pub(crate) fn form_as_json(
    content_type: &str,
    body: &[u8],
    signed: bool,
) -> Option<Result<Vec<u8>, FormError>> {
    let charset = match charset_of(content_type)? {
        Ok(Charset::Utf8) => Charset::Utf8,
        Ok(_) if signed => {
            let label = content_type_charset(content_type.split(';').skip(1)).unwrap_or_default();
            return Some(Err(FormError::UnsignedCharset(label)));
        }
        Ok(c) => c,
        Err(e) => return Some(Err(e)),
    };
    Some(decode_fields(body, charset))
}

fn decode_fields(body: &[u8], charset: Charset) -> Result<Vec<u8>, FormError> {
    use serde_json::Value;
    let mut fields = serde_json::Map::new();
    for (k, v) in raw_pairs(body)? {
        let k = charset.decode(k)?;
        let v = Value::String(charset.decode(v)?);
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

#[cfg(test)]
mod tests {
    use super::*;

    const FORM: &str = "application/x-www-form-urlencoded";

    fn json(ct: &str, body: &[u8]) -> Result<serde_json::Value, FormError> {
        form_as_json(ct, body, false)
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
            json(&format!("{FORM}; charset=\"koi8-r\""), b"k=1"),
            Err(FormError::UnsupportedCharset("koi8-r".into()))
        );
        assert!(form_as_json("application/json", b"{}", false).is_none());
        assert!(json(&format!("{FORM};charset=utf-8"), b"k=%C3%A9").is_ok());
    }

    #[test]
    fn a_signed_form_is_read_in_utf8_only() {
        let latin1 = format!("{FORM}; charset=ISO-8859-1");
        // The same signed bytes: as UTF-8 `é`, as ISO-8859-1 `Ã©`.
        assert!(matches!(
            form_as_json(&latin1, b"k=%C3%A9", true),
            Some(Err(FormError::UnsignedCharset(_)))
        ));
        assert!(matches!(
            form_as_json(&latin1, b"k=%C3%A9", false),
            Some(Ok(_))
        ));
        let utf8 = format!("{FORM}; charset=utf-8");
        assert!(matches!(
            form_as_json(&utf8, b"k=%C3%A9", true),
            Some(Ok(_))
        ));
        assert!(matches!(form_as_json(FORM, b"k=%C3%A9", true), Some(Ok(_))));
    }

    #[test]
    fn a_percent_that_starts_no_escape_is_refused() {
        // `%zz` would otherwise read as `%25zz` does.
        assert_eq!(json(FORM, b"k=%zz"), Err(FormError::BadEscape));
        assert_eq!(json(FORM, b"k=%2"), Err(FormError::BadEscape));
        assert_eq!(json(FORM, b"k=%+1"), Err(FormError::BadEscape));
        assert_eq!(json(FORM, b"k=%25zz").unwrap()["k"], "%zz");
    }

    #[test]
    fn too_many_fields_are_refused_before_decoding() {
        let body = "a=&".repeat(MAX_FORM_FIELDS + 1);
        assert_eq!(json(FORM, body.as_bytes()), Err(FormError::TooManyFields));
        let body = "a=1&".repeat(MAX_FORM_FIELDS - 1);
        assert!(json(FORM, body.as_bytes()).is_ok());
    }

    #[cfg(feature = "providers")]
    #[test]
    fn gbk_forms_decode_strictly() {
        // "中文" in GBK is D6 D0 CE C4.
        let v = json(&format!("{FORM}; charset=GBK"), b"subject=%D6%D0%CE%C4").unwrap();
        assert_eq!(v["subject"], "中文");
        let v = json(&format!("{FORM}; charset=gb18030"), b"subject=%D6%D0%CE%C4").unwrap();
        assert_eq!(v["subject"], "中文");
        // A lead byte without its trail byte is refused, not replaced.
        assert_eq!(
            json(&format!("{FORM}; charset=GBK"), b"subject=%D6"),
            Err(FormError::NotUtf8)
        );
    }
}
