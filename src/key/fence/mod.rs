//! Per-entity fences: which entity a delivery is about ([`KeySpec`]) and
//! its order ([`OrderSpec`]), derived from the delivery alone (no I/O).
//! The engine keeps the highest order seen per (scope, entity) and calls a
//! delivery of a strictly lower order *stale*. The guide, with the
//! encoding, the string form and the providers' presets, is
//! `docs/fences.md`.

use std::fmt;
use std::sync::Arc;

use serde_json::Value;
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

use super::{IdemKey, KeyError, KeySpec, KeySpecError};
use crate::delivery::Delivery;
use crate::fingerprint::canonical_bytes;

/// Flipping the sign bit of an `i64`'s two's complement makes its
/// big-endian bytes sort as the number does (negatives first).
const SIGN: u64 = 1 << 63;

/// Beijing time, the zone of Alipay's `yyyy-MM-dd HH:mm:ss` times.
const BEIJING: i32 = 8 * 3600;

/// Where Adyen's envelope keeps its (one) notification item.
const ADYEN_ITEM: &str = "/notificationItems/0/NotificationRequestItem";

// ------------------------------------------------------------------ Order

/// An order value, encoded so that byte-wise (memcmp) comparison is the
/// order's comparison; stored as `bytea` / `VARBINARY` / `BLOB`.
///
/// The bytes are the order's components one after the other, with no
/// type tags (the [`OrderSpec`] says what each position is):
///
/// - an integer, a timestamp (milliseconds since the Unix epoch) and a
///   rank (its index in the ranked values): 8 bytes, big-endian, of the
///   `i64` with its sign bit flipped, so that negative values sort first;
/// - a text: its UTF-8 bytes with each `0x00` written `0x00 0xFF`, then
///   `0x00 0x00`, so that a text sorts before any longer text it is a
///   prefix of, whatever component follows it.
///
/// This encoding is stored and compared across versions: it never
/// changes. Orders are only comparable when built by the same spec.
/// `Display` is the lower-case hex of the bytes; [`OrderSpec::describe`]
/// decodes them by their spec.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Order(Vec<u8>);

impl Order {
    /// The longest order in bytes (the store's column size); a longer one
    /// is a [`KeyError::BadOrder`] when it is derived.
    pub const MAX_LEN: usize = 255;

    /// An order as read back from the store (not checked).
    pub fn from_bytes(bytes: Vec<u8>) -> Order {
        Order(bytes)
    }

    /// The encoded bytes, as stored and compared.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// A builder of orders in this encoding, for custom order functions
    /// ([`OrderSpec::custom`]).
    pub fn builder() -> OrderBuilder {
        OrderBuilder::default()
    }
}

impl fmt::Debug for Order {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Order({})", hex::encode(&self.0))
    }
}

impl fmt::Display for Order {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex::encode(&self.0))
    }
}

/// Builds an [`Order`] component by component, in the encoding of
/// [`Order`]: the first component compared first.
///
/// ```
/// use onceonly::Order;
///
/// let paid = Order::builder().rank(1).timestamp_ms(1_714_528_800_000).build();
/// let refunded = Order::builder().rank(2).timestamp_ms(0).build();
/// assert!(paid < refunded);
/// ```
#[derive(Clone, Debug, Default)]
#[must_use]
pub struct OrderBuilder {
    bytes: Vec<u8>,
}

impl OrderBuilder {
    /// Appends an integer.
    pub fn integer(mut self, value: i64) -> Self {
        push_i64(&mut self.bytes, value);
        self
    }

    /// Appends a timestamp, in milliseconds since the Unix epoch (encoded
    /// as an integer).
    pub fn timestamp_ms(self, millis: i64) -> Self {
        self.integer(millis)
    }

    /// Appends a rank: a position in a list of states (encoded as an
    /// integer).
    pub fn rank(self, index: u32) -> Self {
        self.integer(i64::from(index))
    }

    /// Appends a text, compared byte-wise.
    pub fn text(mut self, text: &str) -> Self {
        push_text(&mut self.bytes, text);
        self
    }

    /// The order. Its length is checked (at most [`Order::MAX_LEN`]) when
    /// a custom function returns it.
    pub fn build(self) -> Order {
        Order(self.bytes)
    }
}

fn push_i64(out: &mut Vec<u8>, value: i64) {
    out.extend_from_slice(&(value.cast_unsigned() ^ SIGN).to_be_bytes());
}

fn push_text(out: &mut Vec<u8>, text: &str) {
    for &b in text.as_bytes() {
        out.push(b);
        if b == 0 {
            out.push(0xFF);
        }
    }
    out.extend_from_slice(&[0, 0]);
}

fn take_i64(bytes: &[u8]) -> Option<(i64, &[u8])> {
    let (head, rest) = bytes.split_first_chunk::<8>()?;
    Some(((u64::from_be_bytes(*head) ^ SIGN).cast_signed(), rest))
}

fn take_text(bytes: &[u8]) -> Option<(Vec<u8>, &[u8])> {
    let mut text = Vec::new();
    let mut i = 0;
    loop {
        match (bytes.get(i)?, bytes.get(i + 1)) {
            (0, Some(0)) => return Some((text, bytes.get(i + 2..)?)),
            (0, Some(0xFF)) => {
                text.push(0);
                i += 2;
            }
            (0, _) => return None,
            (&b, _) => {
                text.push(b);
                i += 1;
            }
        }
    }
}

// -------------------------------------------------------------- OrderSpec

/// A user function deriving an order from a delivery.
type DynOrderFn = dyn Fn(&Delivery) -> Result<Order, KeyError> + Send + Sync;

/// A [`DynOrderFn`], shared by the spec's clones.
#[derive(Clone)]
struct OrderFn(Arc<DynOrderFn>);

impl fmt::Debug for OrderFn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("OrderFn(..)")
    }
}

/// What a component's value is read as.
#[derive(Clone, Debug)]
enum Kind {
    Integer,
    Timestamp,
    /// The ranked values, lowest first.
    Rank(Vec<String>),
    Text,
}

/// Where a component's value comes from.
#[derive(Clone, Debug)]
enum Field {
    /// The first of these JSON pointers whose value is present and not `null`.
    Json(Vec<String>),
    /// A metadata entry (header), by name.
    Header(String),
}

#[derive(Clone, Debug)]
struct Component {
    kind: Kind,
    field: Field,
}

#[derive(Clone, Debug)]
enum Source {
    Components(Vec<Component>),
    Custom(OrderFn),
    /// A combination that cannot work (a custom order with `then`, ...):
    /// reported by `validate`, and by `derive` as a `BadOrder`.
    Invalid(String),
}

/// Where the order of a delivery comes from: one or more components
/// compared in turn, the next one only when the previous ones are equal.
///
/// Built in code ([`OrderSpec::timestamp`], [`OrderSpec::rank`],
/// [`OrderSpec::then`], ...) or parsed from its string form
/// ([`OrderSpec::parse`]), which `Display` writes back:
///
/// ```text
/// spec      = component *( ";" item )
/// item      = "then=" component | "offset=" offset
/// component = "integer:" pointers
///           | "timestamp:" pointers
///           | "text:" pointers
///           | "rank:" pointers "=" value *( "<" value )
///           | "header:" NAME
/// pointers  = POINTER *( "|" POINTER )
/// offset    = ( "+" | "-" ) HH ":" MM [ ":" SS ] | "Z"
/// ```
///
/// `header:` is an integer in a metadata entry (a Kafka or AMQP header, an
/// HTTP header). Several pointers are alternatives: the first one present
/// (and not `null`) is read ([`OrderSpec::fallback`]). `offset=` is the
/// zone of timestamps written without one (default UTC), for every
/// timestamp component. Examples: `timestamp:/created`, `integer:/version`,
/// `header:X-Version`, `text:/id`,
/// `rank:/status=pending<succeeded<refunded;then=timestamp:/updated`,
/// `rank:/trade_status=WAIT_BUYER_PAY<TRADE_SUCCESS;then=timestamp:/gmt_refund|/gmt_payment;offset=+08:00`.
///
/// The string form splits on `;`, on `|/` between pointers, on the first
/// `=` of a rank and on `<` between ranked values (which are trimmed): a
/// pointer or a value holding those is built in code instead.
#[derive(Clone, Debug)]
pub struct OrderSpec {
    source: Source,
    /// Seconds east of UTC of timestamps written without an offset.
    offset: Option<i32>,
}

impl OrderSpec {
    fn component(kind: Kind, field: Field) -> Self {
        Self {
            source: Source::Components(vec![Component { kind, field }]),
            offset: None,
        }
    }

    fn json(kind: Kind, pointer: impl Into<String>) -> Self {
        Self::component(kind, Field::Json(vec![pointer.into()]))
    }

    /// An integer at a JSON pointer: a JSON integer (within `i64`), or a
    /// string of one (`"42"`, `"-7"`). String form `integer:/version`.
    pub fn integer(pointer: impl Into<String>) -> Self {
        Self::json(Kind::Integer, pointer)
    }

    /// An instant at a JSON pointer, compared to the millisecond:
    ///
    /// - RFC 3339 with `Z` or a `±HH:MM` offset and optional fractional
    ///   seconds (`2018-06-08T10:34:56+08:00`, `2021-01-01T01:00:00.5Z`);
    /// - `YYYY-MM-DD HH:MM:SS` or `YYYY-MM-DDTHH:MM:SS` (optional fraction)
    ///   without an offset, read at the spec's [offset](Self::with_offset)
    ///   (default UTC);
    /// - a JSON string of a number, as Unix seconds (fractions to the
    ///   millisecond, rounded down);
    /// - a JSON number since the Unix epoch, in the unit its magnitude
    ///   says (a number carries none): seconds below 10^11 (Stripe's
    ///   `created`; fractions to the millisecond), milliseconds below
    ///   10^14, microseconds below 10^17, nanoseconds above, so Avro's
    ///   `timestamp-millis`, `-micros` and `-nanos` (the [value
    ///   tree](crate::schema_registry) keeps the number stored) order like
    ///   the seconds a JSON producer wrote for the same instant.
    ///
    /// Fractions finer than a millisecond are dropped, so two instants
    /// within one millisecond are equal. String form `timestamp:/created`.
    pub fn timestamp(pointer: impl Into<String>) -> Self {
        Self::json(Kind::Timestamp, pointer)
    }

    /// A forward-only state at a JSON pointer: its position in `ranks`
    /// (lowest first). A value not in the list is a
    /// [`KeyError::BadOrder`]; strings, numbers and booleans are compared
    /// as text. String form `rank:/status=pending<succeeded<refunded`.
    pub fn rank<I, S>(pointer: impl Into<String>, ranks: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Self::json(
            Kind::Rank(ranks.into_iter().map(Into::into).collect()),
            pointer,
        )
    }

    /// A string at a JSON pointer, compared byte-wise (UTF-8); a number is
    /// refused (`"10" < "9"` as text: use [`OrderSpec::integer`]).
    /// String form `text:/id`.
    pub fn text(pointer: impl Into<String>) -> Self {
        Self::json(Kind::Text, pointer)
    }

    /// An integer in a metadata entry (a Kafka or AMQP header, an HTTP
    /// header), e.g. a version; the name is matched case-insensitively,
    /// the value trimmed. Absent: [`KeyError::MissingMetadata`]. String
    /// form `header:X-Version`.
    pub fn header_integer(name: impl Into<String>) -> Self {
        Self::component(Kind::Integer, Field::Header(name.into()))
    }

    /// An order computed by `f`, e.g. with [`Order::builder`]. It cannot
    /// be combined with other components ([`then`](Self::then)): build
    /// the whole order in `f`. Its length is checked
    /// ([`Order::MAX_LEN`]); [`describe`](Self::describe) shows it in hex.
    pub fn custom<F>(f: F) -> Self
    where
        F: Fn(&Delivery) -> Result<Order, KeyError> + Send + Sync + 'static,
    {
        Self {
            source: Source::Custom(OrderFn(Arc::new(f))),
            offset: None,
        }
    }

    /// Adds `next`'s components after these: compared only when all the
    /// previous ones are equal (a tiebreak). A custom order cannot be
    /// combined: the result fails [`validate`](Self::validate) (and every
    /// derivation). The offsets of both must agree, or one be unset.
    /// String form `;then=COMPONENT`.
    #[must_use]
    pub fn then(self, next: OrderSpec) -> Self {
        let offset = match (self.offset, next.offset) {
            (Some(a), Some(b)) if a != b => {
                return Self::invalid("the two specs joined by `then` have different offsets");
            }
            (a, b) => a.or(b),
        };
        let source = match (self.source, next.source) {
            (Source::Invalid(reason), _) | (_, Source::Invalid(reason)) => Source::Invalid(reason),
            (Source::Custom(_), _) | (_, Source::Custom(_)) => Source::Invalid(
                "a custom order cannot be combined with other components (`then`): build the whole order in the function with `Order::builder()`".into(),
            ),
            (Source::Components(mut first), Source::Components(rest)) => {
                first.extend(rest);
                Source::Components(first)
            }
        };
        Self { source, offset }
    }

    /// Another JSON pointer for the last component, read when the ones
    /// before it are absent or `null`, e.g. an event time that lives in
    /// different fields for different events
    /// (`timestamp("/gmt_refund").fallback("/gmt_payment")`). Only for
    /// JSON components; anything else fails [`validate`](Self::validate).
    /// String form `timestamp:/gmt_refund|/gmt_payment`.
    #[must_use]
    pub fn fallback(mut self, pointer: impl Into<String>) -> Self {
        if let Source::Components(components) = &mut self.source
            && let Some(Component {
                field: Field::Json(pointers),
                ..
            }) = components.last_mut()
        {
            pointers.push(pointer.into());
            return self;
        }
        match self.source {
            Source::Invalid(_) => self,
            _ => Self::invalid("`fallback` applies to a JSON component only"),
        }
    }

    /// The zone of timestamps written without an offset (Alipay's
    /// `2024-05-01 10:00:00` is Beijing time: `8 * 3600`), in seconds east
    /// of UTC, less than a day either way; default UTC. It applies to
    /// every timestamp component of the spec, those added later by
    /// [`then`](Self::then) included; timestamps with an offset keep
    /// theirs. String form `;offset=+08:00`.
    #[must_use]
    pub fn with_offset(mut self, seconds_east: i32) -> Self {
        self.offset = Some(seconds_east);
        self
    }

    fn invalid(reason: &str) -> Self {
        Self {
            source: Source::Invalid(reason.to_owned()),
            offset: None,
        }
    }

    /// Parses the string form (see the [type's documentation](Self)), and
    /// validates it.
    pub fn parse(expr: &str) -> Result<Self, KeySpecError> {
        let mut items = expr.trim().split(';').map(str::trim);
        let mut spec = parse_component(items.next().unwrap_or_default())?;
        for item in items {
            if let Some(component) = item.strip_prefix("then=") {
                spec = spec.then(parse_component(component.trim())?);
            } else if let Some(offset) = item.strip_prefix("offset=") {
                if spec.offset.is_some() {
                    return Err(KeySpecError::InvalidOrder(format!(
                        "`offset=` given twice in {expr:?}"
                    )));
                }
                let seconds = parse_offset(offset.trim()).ok_or_else(|| {
                    KeySpecError::InvalidOrder(format!(
                        "offset {offset:?}: expected `+HH:MM`, `-HH:MM` or `Z`"
                    ))
                })?;
                spec = spec.with_offset(seconds);
            } else {
                return Err(KeySpecError::InvalidOrder(format!(
                    "unknown item {item:?}: expected `then=COMPONENT` or `offset=+HH:MM`"
                )));
            }
        }
        spec.validate()?;
        Ok(spec)
    }

    /// Checks the spec itself: JSON pointers start with `/`, header names
    /// are valid, ranked values are non-empty and distinct, no custom order
    /// is combined, the offset is less than a day. Engines call this when
    /// they are built.
    pub fn validate(&self) -> Result<(), KeySpecError> {
        if let Some(offset) = self.offset
            && offset.unsigned_abs() >= 24 * 3600
        {
            return Err(KeySpecError::InvalidOrder(format!(
                "offset of {offset} s: it must be less than a day either way"
            )));
        }
        let components = match &self.source {
            Source::Invalid(reason) => return Err(KeySpecError::InvalidOrder(reason.clone())),
            Source::Custom(_) => return Ok(()),
            Source::Components(components) => components,
        };
        if components.is_empty() {
            return Err(KeySpecError::InvalidOrder("no component".into()));
        }
        for component in components {
            match &component.field {
                Field::Json(pointers) => {
                    if pointers.is_empty() {
                        return Err(KeySpecError::InvalidPointer(String::new()));
                    }
                    if let Some(bad) = pointers.iter().find(|p| !p.starts_with('/')) {
                        return Err(KeySpecError::InvalidPointer(bad.clone()));
                    }
                }
                Field::Header(name) => KeySpec::header(name.clone()).validate()?,
            }
            if let Kind::Rank(ranks) = &component.kind {
                if ranks.is_empty() {
                    return Err(KeySpecError::InvalidOrder(format!(
                        "the rank at {} lists no value",
                        component.label()
                    )));
                }
                for (i, value) in ranks.iter().enumerate() {
                    if value.is_empty() {
                        return Err(KeySpecError::InvalidOrder(format!(
                            "the rank at {} lists an empty value",
                            component.label()
                        )));
                    }
                    if ranks[..i].contains(value) {
                        return Err(KeySpecError::InvalidOrder(format!(
                            "the rank at {} lists {value:?} twice",
                            component.label()
                        )));
                    }
                }
            }
        }
        Ok(())
    }

    /// Derives the order of `delivery`. Errors: a field absent or `null`
    /// ([`KeyError::MissingField`]; for several pointers, all of them
    /// joined by `|`), a header absent ([`KeyError::MissingMetadata`]), a
    /// payload that is not JSON ([`KeyError::NotJson`]), a value of the
    /// wrong type or an order over [`Order::MAX_LEN`] bytes
    /// ([`KeyError::BadOrder`]), or the custom function's error.
    pub fn derive(&self, delivery: &Delivery) -> Result<Order, KeyError> {
        let offset = self.offset.unwrap_or(0);
        match &self.source {
            Source::Invalid(reason) => Err(KeyError::BadOrder {
                pointer: String::new(),
                reason: format!("the order spec is invalid ({reason})"),
            }),
            Source::Custom(f) => {
                let order = (f.0)(delivery)?;
                if order.0.len() > Order::MAX_LEN {
                    return Err(too_long(order.0.len(), "custom"));
                }
                Ok(order)
            }
            Source::Components(components) => {
                let mut bytes = Vec::new();
                for component in components {
                    component.append(delivery, offset, &mut bytes)?;
                    if bytes.len() > Order::MAX_LEN {
                        return Err(too_long(bytes.len(), &component.label()));
                    }
                }
                Ok(Order(bytes))
            }
        }
    }

    /// `order` decoded by this spec, for logs and the CLI: each component
    /// as `field=value`, joined by `, `, e.g.
    /// `trade_status=TRADE_SUCCESS, gmt_refund|gmt_payment=2024-05-01T02:00:00.320Z`
    /// (timestamps in UTC, texts quoted). The hex of the bytes when they
    /// do not decode by this spec, or the spec is custom.
    pub fn describe(&self, order: &Order) -> String {
        let Source::Components(components) = &self.source else {
            return order.to_string();
        };
        let mut rest = order.as_bytes();
        let mut parts = Vec::with_capacity(components.len());
        for component in components {
            let Some((value, tail)) = component.decode(rest) else {
                return order.to_string();
            };
            parts.push(format!("{}={value}", component.label()));
            rest = tail;
        }
        if !rest.is_empty() {
            return order.to_string();
        }
        parts.join(", ")
    }
}

/// The string form ([`OrderSpec::parse`] reads it back); a custom order is
/// `custom`, an invalid one `invalid`.
impl fmt::Display for OrderSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let components = match &self.source {
            Source::Custom(_) => return f.write_str("custom"),
            Source::Invalid(_) => return f.write_str("invalid"),
            Source::Components(components) => components,
        };
        for (i, component) in components.iter().enumerate() {
            if i > 0 {
                f.write_str(";then=")?;
            }
            let fields = match &component.field {
                Field::Json(pointers) => pointers.join("|"),
                Field::Header(name) => {
                    write!(f, "header:{name}")?;
                    continue;
                }
            };
            match &component.kind {
                Kind::Integer => write!(f, "integer:{fields}")?,
                Kind::Timestamp => write!(f, "timestamp:{fields}")?,
                Kind::Text => write!(f, "text:{fields}")?,
                Kind::Rank(ranks) => write!(f, "rank:{fields}={}", ranks.join("<"))?,
            }
        }
        if let Some(offset) = self.offset {
            let sign = if offset < 0 { '-' } else { '+' };
            let abs = offset.unsigned_abs();
            write!(f, ";offset={sign}{:02}:{:02}", abs / 3600, abs / 60 % 60)?;
            if abs % 60 != 0 {
                write!(f, ":{:02}", abs % 60)?;
            }
        }
        Ok(())
    }
}

fn parse_component(text: &str) -> Result<OrderSpec, KeySpecError> {
    let unknown = || {
        KeySpecError::InvalidOrder(format!(
            "unknown order component {text:?}: expected `integer:/POINTER`, `timestamp:/POINTER`, `text:/POINTER`, `rank:/POINTER=A<B<...` or `header:NAME`"
        ))
    };
    let (kind, rest) = text.split_once(':').ok_or_else(unknown)?;
    let pointers = |list: &str| {
        let mut pointers = Vec::new();
        let mut rest = list;
        while let Some(at) = rest.find("|/") {
            pointers.push(rest[..at].to_owned());
            rest = &rest[at + 1..];
        }
        pointers.push(rest.to_owned());
        Field::Json(pointers)
    };
    let (kind, field) = match kind.trim() {
        "integer" => (Kind::Integer, pointers(rest)),
        "timestamp" => (Kind::Timestamp, pointers(rest)),
        "text" => (Kind::Text, pointers(rest)),
        "header" => (Kind::Integer, Field::Header(rest.to_owned())),
        "rank" => {
            let (list, values) = rest.split_once('=').ok_or_else(|| {
                KeySpecError::InvalidOrder(format!(
                    "rank {text:?} has no values: expected `rank:/POINTER=A<B<...`"
                ))
            })?;
            let ranks = values.split('<').map(|v| v.trim().to_owned()).collect();
            (Kind::Rank(ranks), pointers(list.trim_end()))
        }
        _ => return Err(unknown()),
    };
    Ok(OrderSpec::component(kind, field))
}

/// `+HH:MM`, `-HH:MM`, `+HH:MM:SS` or `Z`, in seconds east of UTC.
fn parse_offset(text: &str) -> Option<i32> {
    if text.eq_ignore_ascii_case("z") {
        return Some(0);
    }
    let (sign, rest) = match text.as_bytes().first()? {
        b'+' => (1, &text[1..]),
        b'-' => (-1, &text[1..]),
        _ => return None,
    };
    let mut parts = rest.split(':');
    let mut two_digits = |required: bool| -> Option<Option<i32>> {
        match parts.next() {
            None if !required => Some(None),
            Some(p) if p.len() == 2 && p.bytes().all(|b| b.is_ascii_digit()) => {
                Some(p.parse().ok())
            }
            _ => None,
        }
    };
    let hours = two_digits(true)??;
    let minutes = two_digits(true)??;
    let seconds = two_digits(false)?.unwrap_or(0);
    if parts.next().is_some() || minutes > 59 || seconds > 59 {
        return None;
    }
    Some(sign * (hours * 3600 + minutes * 60 + seconds))
}

fn too_long(len: usize, pointer: &str) -> KeyError {
    bad(
        pointer,
        format!(
            "the order is {len} bytes long, the maximum is {}",
            Order::MAX_LEN
        ),
    )
}

fn bad(pointer: &str, reason: impl Into<String>) -> KeyError {
    KeyError::BadOrder {
        pointer: pointer.to_owned(),
        reason: reason.into(),
    }
}

impl Component {
    /// The field(s) as `describe` and error messages name them: pointers
    /// without their leading `/`, joined by `|`; a header by its name.
    fn label(&self) -> String {
        match &self.field {
            Field::Json(pointers) => pointers
                .iter()
                .map(|p| p.strip_prefix('/').unwrap_or(p))
                .collect::<Vec<_>>()
                .join("|"),
            Field::Header(name) => name.clone(),
        }
    }

    fn append(&self, delivery: &Delivery, offset: i32, out: &mut Vec<u8>) -> Result<(), KeyError> {
        match &self.field {
            Field::Header(name) => {
                let raw = delivery
                    .metadata(name)
                    .ok_or_else(|| KeyError::MissingMetadata { name: name.clone() })?;
                let text = std::str::from_utf8(raw).map_err(|_| bad(name, "not UTF-8"))?;
                self.append_text_value(text.trim(), name, offset, out)
            }
            Field::Json(pointers) => {
                let json = delivery
                    .json()
                    .map_err(|e| KeyError::NotJson(e.to_owned()))?;
                let (pointer, value) = pointers
                    .iter()
                    .find_map(|p| json.pointer(p).filter(|v| !v.is_null()).map(|v| (p, v)))
                    .ok_or_else(|| KeyError::MissingField {
                        pointer: pointers.join("|"),
                    })?;
                match value {
                    Value::String(text) => self.append_text_value(text, pointer, offset, out),
                    Value::Number(n) => self.append_number(n, pointer, out),
                    Value::Bool(b) => match &self.kind {
                        Kind::Rank(ranks) => append_rank(ranks, &b.to_string(), pointer, out),
                        _ => Err(bad(pointer, "a boolean")),
                    },
                    _ => Err(bad(pointer, "an object or an array, not a scalar")),
                }
            }
        }
    }

    /// A string value (a JSON string, or a header's text).
    fn append_text_value(
        &self,
        text: &str,
        pointer: &str,
        offset: i32,
        out: &mut Vec<u8>,
    ) -> Result<(), KeyError> {
        match &self.kind {
            Kind::Integer => {
                let value = text
                    .parse::<i64>()
                    .map_err(|_| bad(pointer, "not an integer (or out of the i64 range)"))?;
                push_i64(out, value);
            }
            Kind::Timestamp => {
                let millis = match unix_millis(text) {
                    Some(millis) => millis.map_err(|reason| bad(pointer, reason))?,
                    None => datetime_millis(text, offset).ok_or_else(|| {
                        bad(
                            pointer,
                            "not a timestamp (RFC 3339, `YYYY-MM-DD HH:MM:SS` or Unix seconds)",
                        )
                    })?,
                };
                push_i64(out, millis);
            }
            Kind::Rank(ranks) => return append_rank(ranks, text, pointer, out),
            Kind::Text => push_text(out, text),
        }
        Ok(())
    }

    fn append_number(
        &self,
        n: &serde_json::Number,
        pointer: &str,
        out: &mut Vec<u8>,
    ) -> Result<(), KeyError> {
        match &self.kind {
            Kind::Integer => {
                let value = match (n.as_i64(), n.as_u64()) {
                    (Some(v), _) => v,
                    (None, Some(_)) => return Err(bad(pointer, "out of the i64 range")),
                    (None, None) => return Err(bad(pointer, "not an integer")),
                };
                push_i64(out, value);
            }
            Kind::Timestamp => {
                let millis = match epoch_unit(n) {
                    // Seconds, exactly as written (fractions included).
                    EpochUnit::Seconds => {
                        let text = n.to_string();
                        match unix_millis(&text) {
                            Some(millis) => millis.map_err(|reason| bad(pointer, reason))?,
                            // serde_json writes large or tiny floats with an exponent.
                            None => float_millis(n.as_f64())
                                .ok_or_else(|| bad(pointer, "out of range"))?,
                        }
                    }
                    finer => finer
                        .millis(n)
                        .ok_or_else(|| bad(pointer, "out of range"))?,
                };
                push_i64(out, millis);
            }
            Kind::Rank(ranks) => return append_rank(ranks, &n.to_string(), pointer, out),
            Kind::Text => {
                return Err(bad(
                    pointer,
                    "a number, not a string (text orders compare strings: use `integer`)",
                ));
            }
        }
        Ok(())
    }

    /// One component decoded from the front of `bytes`, and the rest.
    fn decode<'b>(&self, bytes: &'b [u8]) -> Option<(String, &'b [u8])> {
        match &self.kind {
            Kind::Integer => take_i64(bytes).map(|(v, rest)| (v.to_string(), rest)),
            Kind::Timestamp => take_i64(bytes).map(|(v, rest)| (format_millis(v), rest)),
            Kind::Rank(ranks) => take_i64(bytes).map(|(v, rest)| {
                let name = usize::try_from(v).ok().and_then(|i| ranks.get(i));
                (name.cloned().unwrap_or_else(|| format!("#{v}")), rest)
            }),
            Kind::Text => take_text(bytes)
                .map(|(text, rest)| (format!("{:?}", String::from_utf8_lossy(&text)), rest)),
        }
    }
}

fn append_rank(
    ranks: &[String],
    value: &str,
    pointer: &str,
    out: &mut Vec<u8>,
) -> Result<(), KeyError> {
    let index = ranks.iter().position(|r| r == value).ok_or_else(|| {
        bad(
            pointer,
            format!("not one of the {} ranked values", ranks.len()),
        )
    })?;
    push_i64(
        out,
        i64::try_from(index).map_err(|_| bad(pointer, "rank out of range"))?,
    );
    Ok(())
}

/// The unit of a numeric timestamp, by its magnitude: a number carries
/// none, and Avro's `timestamp-millis`, `-micros` and `-nanos` (the value
/// tree keeps the number stored) are as common as JSON's seconds. Below
/// 10^11 it is seconds (until the year 5138), below 10^14 milliseconds,
/// below 10^17 microseconds, nanoseconds above: the same instant in any
/// unit gives the same order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum EpochUnit {
    Seconds,
    Millis,
    Micros,
    Nanos,
}

fn epoch_unit(n: &serde_json::Number) -> EpochUnit {
    let magnitude = n.as_f64().map_or(f64::INFINITY, f64::abs);
    if magnitude < 1e11 {
        EpochUnit::Seconds
    } else if magnitude < 1e14 {
        EpochUnit::Millis
    } else if magnitude < 1e17 {
        EpochUnit::Micros
    } else {
        EpochUnit::Nanos
    }
}

impl EpochUnit {
    /// `n`, in this unit, as milliseconds rounded down (`None` out of
    /// range); not for seconds.
    fn millis(self, n: &serde_json::Number) -> Option<i64> {
        let per_milli: i64 = match self {
            Self::Seconds | Self::Millis => 1,
            Self::Micros => 1_000,
            Self::Nanos => 1_000_000,
        };
        if let Some(v) = n.as_i64() {
            return Some(v.div_euclid(per_milli));
        }
        if let Some(v) = n.as_u64() {
            return i64::try_from(v / per_milli.unsigned_abs()).ok();
        }
        // A fraction of the unit, or an exponent: through seconds.
        let per_second = 1_000.0 * per_milli as f64;
        float_millis(n.as_f64().map(|f| f / per_second))
    }
}

/// `text` as decimal Unix seconds (`1714528800`, `-1.5`,
/// `1714528800.123456`) in milliseconds, rounded down; `None` when it is
/// not such a number, `Some(Err)` when it is out of range.
fn unix_millis(text: &str) -> Option<Result<i64, &'static str>> {
    let (negative, digits) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text),
    };
    let (whole, fraction) = match digits.split_once('.') {
        Some((w, f)) => (w, f),
        None => (digits, ""),
    };
    let all_digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
    if whole.is_empty()
        || !all_digits(whole)
        || !all_digits(fraction)
        || (digits.contains('.') && fraction.is_empty())
    {
        return None;
    }
    let mut millis_part: i64 = 0;
    for i in 0..3 {
        let digit = fraction.as_bytes().get(i).map_or(0, |b| b - b'0');
        millis_part = millis_part * 10 + i64::from(digit);
    }
    let finer = fraction.bytes().skip(3).any(|b| b != b'0');
    let range = "out of range";
    let Ok(seconds) = whole.parse::<i64>() else {
        return Some(Err(range));
    };
    let Some(abs) = seconds
        .checked_mul(1000)
        .and_then(|ms| ms.checked_add(millis_part))
    else {
        return Some(Err(range));
    };
    if !negative {
        return Some(Ok(abs));
    }
    // Rounded down: -1.0005 s is -1001 ms.
    Some(
        0i64.checked_sub(abs)
            .and_then(|v| v.checked_sub(i64::from(finer)))
            .ok_or(range),
    )
}

/// Unix seconds given as a float (with an exponent) in milliseconds,
/// rounded down; `None` out of range.
fn float_millis(seconds: Option<f64>) -> Option<i64> {
    // i64::MAX is not a float; 2^63 is, and is out of range.
    const LIMIT: f64 = 9_223_372_036_854_775_808.0;
    let millis = (seconds? * 1000.0).floor();
    // In range and integral: the cast is exact.
    (millis.is_finite() && (-LIMIT..LIMIT).contains(&millis)).then_some(millis as i64)
}

/// An RFC 3339 date-time, or one without an offset read at `offset`
/// seconds east of UTC, in milliseconds since the epoch (rounded down).
fn datetime_millis(text: &str, offset: i32) -> Option<i64> {
    // `time` takes any byte between date and time; only these are dates.
    let separator = *text.as_bytes().get(10)?;
    if !matches!(separator, b'T' | b't' | b' ') {
        return None;
    }
    let normalized = if separator == b' ' {
        format!("{}T{}", text.get(..10)?, text.get(11..)?)
    } else {
        text.to_owned()
    };
    if let Ok(at) = OffsetDateTime::parse(&normalized, &Rfc3339) {
        return millis_of(at);
    }
    let at = OffsetDateTime::parse(&format!("{normalized}Z"), &Rfc3339).ok()?;
    millis_of(at)?.checked_sub(i64::from(offset) * 1000)
}

fn millis_of(at: OffsetDateTime) -> Option<i64> {
    i64::try_from(at.unix_timestamp_nanos().div_euclid(1_000_000)).ok()
}

/// Milliseconds since the epoch as RFC 3339 in UTC (`2024-05-01T02:00:00Z`,
/// `...00.320Z`), or `<n>ms` outside the years `time` represents.
fn format_millis(millis: i64) -> String {
    let Ok(at) = OffsetDateTime::from_unix_timestamp_nanos(i128::from(millis) * 1_000_000) else {
        return format!("{millis}ms");
    };
    let fraction = match millis.rem_euclid(1000) {
        0 => String::new(),
        ms => format!(".{ms:03}"),
    };
    format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}{fraction}Z",
        at.year(),
        u8::from(at.month()),
        at.day(),
        at.hour(),
        at.minute(),
        at.second()
    )
}

// -------------------------------------------------------------- FenceSpec

/// The fence of a consumer or route: which entity a delivery is about
/// ([`KeySpec`], with all its limits) and its order ([`OrderSpec`]).
///
/// The engine keeps, per scope and entity, the highest order applied; a
/// delivery whose order is strictly lower is *stale*: acknowledged without
/// running the handler (unless the fence [passes stale
/// deliveries](Self::pass_stale)). An equal order is not stale. A fence is
/// for handlers that apply the state a delivery describes; see the guide
/// (`docs/fences.md`) for the presets' fields and the retention.
///
/// ```
/// use onceonly::{Delivery, FenceSpec, KeySpec, OrderSpec};
///
/// let fence = FenceSpec::new(
///     KeySpec::json_field("/order_id"),
///     OrderSpec::parse("rank:/status=pending<paid<refunded;then=timestamp:/updated_at")?,
/// );
/// fence.validate()?;
/// let paid = fence.derive(&Delivery::new(
///     r#"{"order_id":"o-1","status":"paid","updated_at":"2024-05-01T10:00:00+08:00"}"#,
/// ))?;
/// assert_eq!(paid.entity.as_str(), "o-1");
/// assert_eq!(
///     fence.order().describe(&paid.order),
///     "status=paid, updated_at=2024-05-01T02:00:00Z"
/// );
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug)]
pub struct FenceSpec {
    entity: KeySpec,
    order: OrderSpec,
    pass_stale: bool,
}

/// What a delivery's fence is: its entity and order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FenceValue {
    /// The entity the delivery is about (a payment, an order).
    pub entity: IdemKey,
    /// The delivery's order among the entity's deliveries.
    pub order: Order,
}

impl FenceSpec {
    /// A fence on the entity `entity` derives, ordered by `order`; stale
    /// deliveries are acknowledged without running the handler.
    pub fn new(entity: KeySpec, order: OrderSpec) -> Self {
        Self {
            entity,
            order,
            pass_stale: false,
        }
    }

    /// Run the handler on stale deliveries too (it reads the fence from its
    /// transaction and decides); default: stale deliveries are
    /// acknowledged without running the handler.
    #[must_use]
    pub fn pass_stale(mut self, pass: bool) -> Self {
        self.pass_stale = pass;
        self
    }

    /// Whether stale deliveries still run the handler ([`pass_stale`](Self::pass_stale)).
    pub fn passes_stale(&self) -> bool {
        self.pass_stale
    }

    /// How the entity is derived.
    pub fn entity(&self) -> &KeySpec {
        &self.entity
    }

    /// How the order is derived.
    pub fn order(&self) -> &OrderSpec {
        &self.order
    }

    /// Checks the entity's and the order's specs.
    pub fn validate(&self) -> Result<(), KeySpecError> {
        self.entity.validate()?;
        self.order.validate()
    }

    /// The entity and the order of `delivery` (the entity's error first).
    pub fn derive(&self, delivery: &Delivery) -> Result<FenceValue, KeyError> {
        Ok(FenceValue {
            entity: self.entity.derive(delivery)?,
            order: self.order.derive(delivery)?,
        })
    }

    /// Stripe events (the event as received): the entity is the event's
    /// object (`/data/object/id`: a PaymentIntent, a Charge, a Refund),
    /// the order the event's `created` (Unix seconds). Each event carries
    /// its object as it was when the event happened, so the latest one
    /// stands for the earlier ones. Two events of the same second are
    /// equal, so neither is stale: event ids are random, not
    /// chronological, and a tiebreak on them would drop the newer of the
    /// two half of the time. Events whose object has no `id` (`balance.*`)
    /// have no entity ([`KeyError::MissingField`]).
    pub fn stripe() -> Self {
        Self::new(
            KeySpec::json_field("/data/object/id"),
            OrderSpec::timestamp("/created"),
        )
    }

    /// WeChat Pay API v3 notifications (the decrypted `resource`: a
    /// transaction or a refund). The entity is a payment or one refund:
    /// the canonical JSON array of `out_trade_no` and `out_refund_no`
    /// (`""` for a payment), e.g. `["1217752501201407033233368018",""]`.
    /// The order is the state's rank: `refund_status` (a refund), else
    /// `trade_state` (a payment), `ABNORMAL < SUCCESS < CLOSED`, so a late
    /// `ABNORMAL` of a refund that has since succeeded is stale. Not the
    /// trade alone, and not `success_time`: a refund notification carries
    /// that refund only (not the refunds before it), so ordering a trade's
    /// refunds by time would drop an earlier refund delivered late; and
    /// `success_time` is absent from `ABNORMAL` and `CLOSED` refunds, while
    /// the envelope's `create_time` is not in the payload. WeChat Pay
    /// notifies payments on `SUCCESS` only; another state is a
    /// [`KeyError::BadOrder`].
    pub fn wechat_pay() -> Self {
        Self::new(
            KeySpec::custom(wechat_entity),
            OrderSpec::rank("/refund_status", ["ABNORMAL", "SUCCESS", "CLOSED"])
                .fallback("/trade_state"),
        )
    }

    /// Alipay notifications (the signed fields as a JSON object): the
    /// entity is `out_trade_no`, the order the rank of `trade_status`
    /// (`WAIT_BUYER_PAY < TRADE_SUCCESS < TRADE_FINISHED < TRADE_CLOSED`),
    /// then the time of the event: `gmt_refund`, else `gmt_payment`, else
    /// `gmt_create`, read in Beijing time (+08:00). `TRADE_CLOSED` is
    /// final whether it closes an unpaid trade or a fully refunded one,
    /// and `TRADE_FINISHED` is final too; no trade reaches both. Partial
    /// refunds stay at `TRADE_SUCCESS` and are ordered by `gmt_refund`:
    /// each notification carries the trade as it stands (`refund_fee` is
    /// the total refunded), so the latest one stands for the earlier
    /// ones. Never `notify_time`: it is set anew on every retry of the
    /// same notification, so an old event retried late would look newer
    /// than the events after it.
    pub fn alipay() -> Self {
        Self::new(
            KeySpec::json_field("/out_trade_no"),
            OrderSpec::rank(
                "/trade_status",
                [
                    "WAIT_BUYER_PAY",
                    "TRADE_SUCCESS",
                    "TRADE_FINISHED",
                    "TRADE_CLOSED",
                ],
            )
            .then(
                OrderSpec::timestamp("/gmt_refund")
                    .fallback("/gmt_payment")
                    .fallback("/gmt_create"),
            )
            .with_offset(BEIJING),
        )
    }

    /// Adyen notification items (in Adyen's envelope,
    /// `/notificationItems/0/NotificationRequestItem`, or a bare item):
    /// the entity is the item's `pspReference` (a payment, or one
    /// modification of it: each partial refund and each capture has its
    /// own, so that one is never stale behind another), the order its
    /// `eventDate` (RFC 3339): an older event of a reference delivered
    /// after a newer one of the same reference is stale.
    ///
    /// **`eventDate` is not signed** by Adyen's HMAC, and the `providers`
    /// route's payload holds signed fields only: on that route every
    /// delivery fails with [`KeyError::MissingField`]. This preset is for
    /// items whose `eventDate` can be trusted (an item forwarded whole by
    /// a service that received it directly from Adyen): a replayed item
    /// with a forged `eventDate` in the future would make every later
    /// event of its reference stale.
    pub fn adyen() -> Self {
        Self::new(
            KeySpec::custom(adyen_entity),
            OrderSpec::timestamp(format!("{ADYEN_ITEM}/eventDate")).fallback("/eventDate"),
        )
    }
}

/// The scalar at `pointer` as text; `None` when absent or `null`.
fn scalar(json: &Value, pointer: &str) -> Result<Option<String>, KeyError> {
    match json.pointer(pointer) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Number(n)) => Ok(Some(n.to_string())),
        Some(Value::Bool(b)) => Ok(Some(b.to_string())),
        Some(Value::Array(_) | Value::Object(_)) => Err(KeyError::NotScalar {
            pointer: pointer.to_owned(),
        }),
    }
}

/// WeChat Pay: `[out_trade_no, out_refund_no or ""]` as canonical JSON.
fn wechat_entity(delivery: &Delivery) -> Result<String, KeyError> {
    let json = delivery
        .json()
        .map_err(|e| KeyError::NotJson(e.to_owned()))?;
    let trade = scalar(json, "/out_trade_no")?.ok_or_else(|| KeyError::MissingField {
        pointer: "/out_trade_no".into(),
    })?;
    let refund = scalar(json, "/out_refund_no")?.unwrap_or_default();
    String::from_utf8(canonical_bytes(&[trade, refund])).map_err(|_| KeyError::NotUtf8)
}

/// Adyen: the item's `pspReference`.
fn adyen_entity(delivery: &Delivery) -> Result<String, KeyError> {
    let json = delivery
        .json()
        .map_err(|e| KeyError::NotJson(e.to_owned()))?;
    let prefix = if json.get("notificationItems").is_some() {
        ADYEN_ITEM
    } else {
        ""
    };
    // Each item is one event of its own `pspReference` (a payment, or one
    // modification of it): a partial refund never stales another one.
    match scalar(json, &format!("{prefix}/pspReference"))? {
        Some(reference) if !reference.is_empty() => Ok(reference),
        _ => Err(KeyError::MissingField {
            pointer: format!("{prefix}/pspReference"),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn delivery(json: &str) -> Delivery {
        Delivery::new(json.as_bytes().to_vec())
    }

    fn order(spec: &OrderSpec, json: &str) -> Order {
        spec.derive(&delivery(json)).unwrap()
    }

    fn err(spec: &OrderSpec, json: &str) -> KeyError {
        spec.derive(&delivery(json)).unwrap_err()
    }

    fn ms(millis: i64) -> Order {
        Order::builder().timestamp_ms(millis).build()
    }

    /// 2024-05-01T02:00:00Z.
    const MAY_FIRST: i64 = 1_714_528_800_000;

    /// Issue 44, defect 5: a numeric timestamp in seconds (JSON) and the
    /// same instant as Avro's `timestamp-millis`, `-micros` and `-nanos`
    /// give one order (nanos no longer overflow into `bad_key`), and a
    /// later instant in any unit is later.
    #[test]
    fn numeric_timestamps_carry_their_unit_by_magnitude() {
        let spec = OrderSpec::timestamp("/at");
        let s = MAY_FIRST / 1000;
        for at in [
            s.to_string(),
            MAY_FIRST.to_string(),
            (MAY_FIRST * 1_000).to_string(),
            (MAY_FIRST * 1_000_000).to_string(),
            format!("{s}.0004"),
        ] {
            assert_eq!(
                order(&spec, &format!(r#"{{"at":{at}}}"#)),
                ms(MAY_FIRST),
                "{at}"
            );
        }
        let later_seconds = order(&spec, &format!(r#"{{"at":{}}}"#, s + 1));
        let millis = order(&spec, &format!(r#"{{"at":{}}}"#, MAY_FIRST + 1));
        let nanos = order(
            &spec,
            &format!(r#"{{"at":{}}}"#, (MAY_FIRST + 2) * 1_000_000),
        );
        assert!(millis < later_seconds && nanos < later_seconds && millis < nanos);
        assert_eq!(order(&spec, r#"{"at":1.7145288e12}"#), ms(MAY_FIRST));
    }

    // ---------------------------------------------------------- encoding

    #[test]
    fn integers_sort_bytewise_across_the_sign_and_the_encoding_is_fixed() {
        let values = [i64::MIN, -1_000_000, -256, -1, 0, 1, 255, 256, i64::MAX];
        let orders: Vec<Order> = values
            .iter()
            .map(|&v| Order::builder().integer(v).build())
            .collect();
        for pair in orders.windows(2) {
            assert!(pair[0] < pair[1], "{pair:?}");
            assert!(pair[0].as_bytes() < pair[1].as_bytes());
        }
        // Stored forever: the exact bytes.
        assert_eq!(orders[4].as_bytes(), [0x80, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(
            orders[3].as_bytes(),
            [0x7F, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF]
        );
        assert_eq!(orders[0].as_bytes(), [0; 8]);
        assert_eq!(orders[8].as_bytes(), [0xFF; 8]);
        assert_eq!(
            Order::builder()
                .rank(2)
                .text("a\0")
                .integer(1)
                .build()
                .as_bytes(),
            [
                0x80, 0, 0, 0, 0, 0, 0, 2, //
                b'a', 0, 0xFF, 0, 0, //
                0x80, 0, 0, 0, 0, 0, 0, 1,
            ]
        );
        // What the store gives back compares the same.
        let back = Order::from_bytes(orders[2].as_bytes().to_vec());
        assert_eq!(back, orders[2]);
        assert_eq!(back.to_string(), "7fffffffffffff00");
        assert_eq!(format!("{back:?}"), "Order(7fffffffffffff00)");

        let spec = OrderSpec::integer("/v");
        assert!(order(&spec, r#"{"v":-5}"#) < order(&spec, r#"{"v":"3"}"#));
        assert!(order(&spec, r#"{"v":"-10"}"#) < order(&spec, r#"{"v":-9}"#));
        assert_eq!(order(&spec, r#"{"v":"42"}"#), order(&spec, r#"{"v":42}"#));
    }

    #[test]
    fn texts_sort_bytewise_with_nuls_and_prefixes_even_before_another_component() {
        let text = |t: &str| Order::builder().text(t).build();
        assert!(text("") < text("\0"));
        assert!(text("a") < text("a\0"));
        assert!(text("a\0") < text("a\0\0"));
        assert!(text("a\0\0") < text("a\u{1}"));
        assert!(text("a\0") < text("ab"));
        assert!(text("ab") < text("b"));
        // (text, integer): the text decides whatever the integer.
        let pair = |t: &str, i: i64| Order::builder().text(t).integer(i).build();
        assert!(pair("a", i64::MAX) < pair("a\0", i64::MIN));
        assert!(pair("a\0", i64::MAX) < pair("ab", i64::MIN));
        assert!(pair("a", 1) < pair("a", 2));
        assert!(pair("a", -1) < pair("ab", -100));

        let spec = OrderSpec::text("/id").then(OrderSpec::integer("/n"));
        let a = order(&spec, r#"{"id":"a","n":9}"#);
        let a_nul = order(&spec, "{\"id\":\"a\\u0000\",\"n\":-9}");
        let ab = order(&spec, r#"{"id":"ab","n":1}"#);
        assert!(a < a_nul && a_nul < ab);
        assert_eq!(spec.describe(&a_nul), r#"id="a\0", n=-9"#);
    }

    // -------------------------------------------------------- timestamps

    #[test]
    fn one_instant_in_every_form_is_one_order() {
        let spec = OrderSpec::timestamp("/t");
        for form in [
            r#""2024-05-01T10:00:00+08:00""#,
            r#""2024-05-01T02:00:00Z""#,
            r#""2024-05-01T03:00:00+01:00""#,
            r#""2024-04-30T21:00:00-05:00""#,
            r#""2024-05-01t02:00:00z""#,
            r#""2024-05-01 02:00:00Z""#,
            r#""2024-05-01T02:00:00.000Z""#,
            r#""2024-05-01 02:00:00""#,
            r#""2024-05-01T02:00:00""#,
            "1714528800",
            "1714528800.0",
            r#""1714528800""#,
        ] {
            assert_eq!(
                order(&spec, &format!(r#"{{"t":{form}}}"#)),
                ms(MAY_FIRST),
                "{form}"
            );
        }
        // Naive times at the spec's offset; times with one keep theirs.
        let beijing = OrderSpec::timestamp("/t").with_offset(8 * 3600);
        assert_eq!(
            order(&beijing, r#"{"t":"2024-05-01 10:00:00"}"#),
            ms(MAY_FIRST)
        );
        assert_eq!(
            order(&beijing, r#"{"t":"2024-05-01T02:00:00Z"}"#),
            ms(MAY_FIRST)
        );
        assert_eq!(order(&beijing, r#"{"t":1714528800}"#), ms(MAY_FIRST));
        assert_eq!(
            spec.describe(&order(&spec, r#"{"t":1714528800}"#)),
            "t=2024-05-01T02:00:00Z"
        );
    }

    #[test]
    fn a_later_instant_with_an_earlier_clock_reading_sorts_later() {
        let spec = OrderSpec::timestamp("/t");
        let beijing_ten = order(&spec, r#"{"t":"2024-05-01T10:00:00+08:00"}"#);
        let utc_three = order(&spec, r#"{"t":"2024-05-01T03:00:00Z"}"#);
        assert!(beijing_ten < utc_three);
        // A day boundary crossed by the offset.
        let late_new_york = order(&spec, r#"{"t":"2024-04-30T23:30:00-05:00"}"#);
        let early_utc = order(&spec, r#"{"t":"2024-05-01T03:00:00Z"}"#);
        assert!(early_utc < late_new_york);
        // Before the epoch too.
        assert!(order(&spec, r#"{"t":"1969-12-31T23:59:59Z"}"#) < order(&spec, r#"{"t":0}"#));
        assert_eq!(order(&spec, r#"{"t":"1969-12-31T23:59:59Z"}"#), ms(-1000));
    }

    #[test]
    fn fractions_of_seconds_are_kept_to_the_millisecond_rounded_down() {
        let spec = OrderSpec::timestamp("/t");
        let half = ms(MAY_FIRST + 500);
        assert_eq!(order(&spec, r#"{"t":"2024-05-01T02:00:00.5Z"}"#), half);
        assert_eq!(order(&spec, r#"{"t":1714528800.5}"#), half);
        assert_eq!(order(&spec, r#"{"t":"1714528800.500"}"#), half);
        assert_eq!(order(&spec, r#"{"t":"2024-05-01T02:00:00.5009Z"}"#), half);
        assert_eq!(order(&spec, r#"{"t":"2024-05-01 02:00:00.500"}"#), half);
        assert!(order(&spec, r#"{"t":"2024-05-01T02:00:00.001Z"}"#) > ms(MAY_FIRST));
        assert_eq!(unix_millis("-1.0005"), Some(Ok(-1001)));
        assert_eq!(unix_millis("-1.5"), Some(Ok(-1500)));
        assert_eq!(unix_millis("1.9999"), Some(Ok(1999)));
        assert_eq!(unix_millis("99999999999999999"), Some(Err("out of range")));
        assert_eq!(unix_millis("1."), None);
        assert_eq!(unix_millis(".5"), None);
        assert_eq!(unix_millis("1e9"), None);
        assert_eq!(
            spec.describe(&half),
            "t=2024-05-01T02:00:00.500Z",
            "describe keeps the milliseconds"
        );
    }

    #[test]
    fn bad_timestamps_are_bad_orders_without_their_value() {
        let spec = OrderSpec::timestamp("/t");
        for bad_value in [
            r#""2024-13-01T00:00:00Z""#,
            r#""2024-02-30T00:00:00Z""#,
            r#""2024-05-01x02:00:00Z""#,
            r#""2024-05-01T02:00Z""#,
            r#""2024-05-01T02:00:00+0800""#,
            r#""2024-05-01T02:00:00+08:00Z""#,
            r#""secret-customer-4711""#,
            r#""""#,
            "1e300",
            "true",
            "{}",
            "[1]",
        ] {
            let e = err(&spec, &format!(r#"{{"t":{bad_value}}}"#));
            let KeyError::BadOrder { pointer, .. } = &e else {
                panic!("{bad_value}: {e:?}");
            };
            assert_eq!(pointer, "/t");
            assert!(!e.to_string().contains("secret"), "{e}");
            assert_eq!(e.reason(), "bad_key");
        }
        assert_eq!(
            err(&spec, r#"{"t":null}"#),
            KeyError::MissingField {
                pointer: "/t".into()
            }
        );
        assert_eq!(
            err(&spec, r#"{"other":1}"#),
            KeyError::MissingField {
                pointer: "/t".into()
            }
        );
        assert!(matches!(err(&spec, "not json"), KeyError::NotJson(_)));
    }

    // ------------------------------------------------------ other kinds

    #[test]
    fn ranks_are_positions_and_unknown_values_are_refused() {
        let spec = OrderSpec::rank("/s", ["pending", "succeeded", "refunded"]);
        let pending = order(&spec, r#"{"s":"pending"}"#);
        let succeeded = order(&spec, r#"{"s":"succeeded"}"#);
        let refunded = order(&spec, r#"{"s":"refunded"}"#);
        assert!(pending < succeeded && succeeded < refunded);
        assert_eq!(refunded, Order::builder().rank(2).build());
        assert_eq!(spec.describe(&refunded), "s=refunded");
        assert_eq!(spec.describe(&Order::builder().rank(7).build()), "s=#7");
        let e = err(&spec, r#"{"s":"chargeback-of-alice"}"#);
        assert!(matches!(&e, KeyError::BadOrder { pointer, .. } if pointer == "/s"));
        assert!(!e.to_string().contains("alice"), "{e}");
        assert!(matches!(
            err(&spec, r#"{"s":"Pending"}"#),
            KeyError::BadOrder { .. }
        ));
        // Scalars compare as text.
        let numeric = OrderSpec::rank("/s", ["1", "2", "true"]);
        assert!(order(&numeric, r#"{"s":1}"#) < order(&numeric, r#"{"s":"2"}"#));
        assert_eq!(
            order(&numeric, r#"{"s":true}"#),
            Order::builder().rank(2).build()
        );
    }

    #[test]
    fn integers_and_texts_refuse_other_types() {
        let integer = OrderSpec::integer("/v");
        for bad_value in [
            "1.5",
            "18446744073709551615",
            r#""7x""#,
            r#""""#,
            "true",
            "[]",
        ] {
            let e = err(&integer, &format!(r#"{{"v":{bad_value}}}"#));
            assert!(matches!(e, KeyError::BadOrder { .. }), "{bad_value}: {e:?}");
        }
        let text = OrderSpec::text("/id");
        assert!(matches!(
            err(&text, r#"{"id":10}"#),
            KeyError::BadOrder { .. }
        ));
        assert!(matches!(
            err(&text, r#"{"id":{}}"#),
            KeyError::BadOrder { .. }
        ));
        assert_eq!(
            order(&text, r#"{"id":""}"#),
            Order::builder().text("").build()
        );
    }

    #[test]
    fn header_integers_come_from_metadata() {
        let spec = OrderSpec::header_integer("X-Version");
        let d = Delivery::new(b"not json".to_vec()).with_metadata("x-version", " 42 ");
        assert_eq!(
            spec.derive(&d).unwrap(),
            Order::builder().integer(42).build()
        );
        assert_eq!(
            spec.derive(&Delivery::new(b"{}".to_vec())).unwrap_err(),
            KeyError::MissingMetadata {
                name: "X-Version".into()
            }
        );
        let bad_value = Delivery::new(b"{}".to_vec()).with_metadata("X-Version", "v2");
        assert!(matches!(
            spec.derive(&bad_value),
            Err(KeyError::BadOrder { .. })
        ));
        let not_utf8 = Delivery::new(b"{}".to_vec()).with_metadata("X-Version", vec![0xFF]);
        assert!(matches!(
            spec.derive(&not_utf8),
            Err(KeyError::BadOrder { .. })
        ));
        assert_eq!(
            spec.describe(&Order::builder().integer(42).build()),
            "X-Version=42"
        );
    }

    #[test]
    fn then_breaks_ties_only() {
        let spec = OrderSpec::rank("/s", ["a", "b"]).then(OrderSpec::timestamp("/t"));
        let a_late = order(&spec, r#"{"s":"a","t":"2024-05-01T12:00:00Z"}"#);
        let a_early = order(&spec, r#"{"s":"a","t":"2024-05-01T01:00:00Z"}"#);
        let b_early = order(&spec, r#"{"s":"b","t":"2024-05-01T00:00:00Z"}"#);
        assert!(a_early < a_late, "same rank: the time decides");
        assert!(a_late < b_early, "the rank decides first");
        assert_eq!(
            a_late,
            order(&spec, r#"{"s":"a","t":"2024-05-01T12:00:00+00:00"}"#)
        );
        assert_eq!(spec.describe(&b_early), "s=b, t=2024-05-01T00:00:00Z");
        // The second component is read only... but it must be present.
        assert_eq!(
            err(&spec, r#"{"s":"a"}"#),
            KeyError::MissingField {
                pointer: "/t".into()
            }
        );
    }

    #[test]
    fn fallbacks_read_the_first_field_present() {
        let spec = OrderSpec::timestamp("/a").fallback("/b").fallback("/c");
        assert_eq!(order(&spec, r#"{"a":1,"b":2}"#), ms(1000));
        assert_eq!(order(&spec, r#"{"a":null,"b":2}"#), ms(2000));
        assert_eq!(order(&spec, r#"{"c":3}"#), ms(3000));
        assert_eq!(
            err(&spec, r#"{"d":4}"#),
            KeyError::MissingField {
                pointer: "/a|/b|/c".into()
            }
        );
        // A present but unusable field is an error, not a reason to fall back.
        assert!(matches!(
            err(&spec, r#"{"a":"soon","b":2}"#),
            KeyError::BadOrder { pointer, .. } if pointer == "/a"
        ));
    }

    #[test]
    fn custom_orders_and_length_limits() {
        let spec = OrderSpec::custom(|d: &Delivery| {
            Ok(Order::builder().integer(d.payload().len() as i64).build())
        });
        spec.validate().unwrap();
        assert_eq!(order(&spec, "{}"), Order::builder().integer(2).build());
        assert_eq!(spec.describe(&order(&spec, "{}")), "8000000000000002");
        assert_eq!(spec.to_string(), "custom");
        let long = OrderSpec::custom(|_: &Delivery| Ok(Order::from_bytes(vec![1; 256])));
        assert!(matches!(
            err(&long, "{}"),
            KeyError::BadOrder { pointer, .. } if pointer == "custom"
        ));
        let refusing = OrderSpec::custom(|_: &Delivery| Err(KeyError::Custom("no".into())));
        assert_eq!(err(&refusing, "{}"), KeyError::Custom("no".into()));

        // 255 bytes pass, 256 do not: a text of 253 bytes plus its terminator.
        let text = OrderSpec::text("/id");
        let fits = format!(r#"{{"id":"{}"}}"#, "x".repeat(253));
        assert_eq!(order(&text, &fits).as_bytes().len(), Order::MAX_LEN);
        let over = format!(r#"{{"id":"{}"}}"#, "x".repeat(254));
        let e = err(&text, &over);
        assert!(
            matches!(&e, KeyError::BadOrder { pointer, .. } if pointer == "id"),
            "{e:?}"
        );
        assert!(e.to_string().contains("256 bytes"), "{e}");
    }

    // ---------------------------------------------------- string form

    #[test]
    fn string_forms_round_trip() {
        for expr in [
            "timestamp:/created",
            "integer:/version",
            "header:X-Version",
            "text:/id",
            "rank:/status=pending<succeeded<refunded;then=timestamp:/updated",
            "rank:/trade_status=WAIT_BUYER_PAY<TRADE_SUCCESS;then=timestamp:/gmt_refund|/gmt_payment;offset=+08:00",
            "timestamp:/t;offset=-05:30",
            "timestamp:/t;offset=+00:00",
            "text:/a/b~1c|/d;then=integer:/n;then=header:X-Seq",
        ] {
            let spec = OrderSpec::parse(expr).unwrap();
            assert_eq!(spec.to_string(), expr);
        }
        // Spaces around items and ranked values, `Z`, and builders.
        let spec = OrderSpec::parse(" rank:/s = a < b ; then=timestamp:/t ; offset=Z ").unwrap();
        assert_eq!(
            spec.to_string(),
            "rank:/s=a<b;then=timestamp:/t;offset=+00:00"
        );
        let built = OrderSpec::rank("/s", ["a", "b"])
            .then(OrderSpec::timestamp("/t").fallback("/u"))
            .with_offset(-(3 * 3600 + 1800 + 15));
        assert_eq!(
            built.to_string(),
            "rank:/s=a<b;then=timestamp:/t|/u;offset=-03:30:15"
        );
        let parsed = OrderSpec::parse(&built.to_string()).unwrap();
        let json = r#"{"s":"b","u":"2024-05-01 00:00:00"}"#;
        assert_eq!(order(&parsed, json), order(&built, json));
        // The presets' orders are string forms too.
        for fence in [
            FenceSpec::stripe(),
            FenceSpec::wechat_pay(),
            FenceSpec::alipay(),
            FenceSpec::adyen(),
        ] {
            let expr = fence.order().to_string();
            assert_eq!(OrderSpec::parse(&expr).unwrap().to_string(), expr);
        }
        assert_eq!(
            FenceSpec::alipay().order().to_string(),
            "rank:/trade_status=WAIT_BUYER_PAY<TRADE_SUCCESS<TRADE_FINISHED<TRADE_CLOSED;then=timestamp:/gmt_refund|/gmt_payment|/gmt_create;offset=+08:00"
        );
    }

    #[test]
    fn malformed_string_forms_and_specs_are_refused() {
        let invalid_order = |expr: &str| {
            assert!(
                matches!(OrderSpec::parse(expr), Err(KeySpecError::InvalidOrder(_))),
                "{expr}: {:?}",
                OrderSpec::parse(expr)
            );
        };
        for expr in [
            "",
            "created",
            "json:/created",
            "timestamp",
            "rank:/s",
            "rank:/s=",
            "rank:/s=a<<b",
            "rank:/s=a<b<a",
            "timestamp:/t;offset=+8",
            "timestamp:/t;offset=+08:60",
            "timestamp:/t;offset=08:00",
            "timestamp:/t;offset=+08:00;offset=+08:00",
            "timestamp:/t;then=",
            "timestamp:/t;bogus",
            "timestamp:/t;then=custom",
        ] {
            invalid_order(expr);
        }
        assert_eq!(
            OrderSpec::parse("timestamp:created").unwrap_err(),
            KeySpecError::InvalidPointer("created".into())
        );
        // Split on `|/` only: `/a|b` is one pointer (a property named `a|b`).
        let one = OrderSpec::parse("timestamp:/a|b").unwrap();
        assert_eq!(order(&one, r#"{"a|b":1,"b":2}"#), ms(1000));
        assert_eq!(
            OrderSpec::timestamp("/a")
                .fallback("b")
                .validate()
                .unwrap_err(),
            KeySpecError::InvalidPointer("b".into()),
            "a fallback pointer must start with `/`"
        );
        assert_eq!(
            OrderSpec::parse("integer:").unwrap_err(),
            KeySpecError::InvalidPointer(String::new())
        );
        assert_eq!(
            OrderSpec::parse("header:X Version").unwrap_err(),
            KeySpecError::InvalidName("X Version".into())
        );
        // Builders: the same checks in `validate`.
        let custom = || OrderSpec::custom(|_: &Delivery| Ok(Order::builder().build()));
        for spec in [
            custom().then(OrderSpec::integer("/v")),
            OrderSpec::integer("/v").then(custom()),
            custom().fallback("/v"),
            OrderSpec::header_integer("X-V").fallback("/v"),
            OrderSpec::rank("/s", Vec::<String>::new()),
            OrderSpec::timestamp("/t").with_offset(24 * 3600),
            OrderSpec::timestamp("/t")
                .with_offset(3600)
                .then(OrderSpec::timestamp("/u").with_offset(7200)),
        ] {
            assert!(
                matches!(spec.validate(), Err(KeySpecError::InvalidOrder(_))),
                "{spec:?}"
            );
        }
        // An invalid spec never derives.
        let combined = custom().then(OrderSpec::integer("/v"));
        assert!(matches!(
            err(&combined, r#"{"v":1}"#),
            KeyError::BadOrder { .. }
        ));
        assert_eq!(combined.to_string(), "invalid");
        // Agreeing offsets, or one unset, combine.
        OrderSpec::timestamp("/t")
            .with_offset(3600)
            .then(OrderSpec::timestamp("/u").with_offset(3600))
            .then(OrderSpec::timestamp("/v"))
            .validate()
            .unwrap();
    }

    #[test]
    fn bad_order_errors_say_bad_key() {
        let e = KeyError::BadOrder {
            pointer: "/t".into(),
            reason: "not a timestamp".into(),
        };
        assert_eq!(e.reason(), "bad_key");
        assert_eq!(
            e.to_string(),
            r#"order field "/t" is unusable: not a timestamp"#
        );
    }

    // ------------------------------------------------------- FenceSpec

    #[test]
    fn fence_specs_derive_entity_then_order() {
        let fence = FenceSpec::new(KeySpec::json_field("/id"), OrderSpec::integer("/v"));
        assert!(!fence.passes_stale());
        assert!(fence.clone().pass_stale(true).passes_stale());
        fence.validate().unwrap();
        assert_eq!(
            fence.derive(&delivery(r#"{"id":"o-1","v":3}"#)).unwrap(),
            FenceValue {
                entity: IdemKey::new("o-1").unwrap(),
                order: Order::builder().integer(3).build(),
            }
        );
        // The entity's error comes first, with all of KeySpec's limits.
        assert_eq!(
            fence.derive(&delivery(r#"{"v":"x"}"#)).unwrap_err(),
            KeyError::MissingField {
                pointer: "/id".into()
            }
        );
        let long = format!(r#"{{"id":"{}","v":1}}"#, "x".repeat(300));
        assert!(matches!(
            fence.derive(&delivery(&long)),
            Err(KeyError::TooLong { .. })
        ));
        let bad_entity = FenceSpec::new(KeySpec::json_field("id"), OrderSpec::integer("/v"));
        assert_eq!(
            bad_entity.validate().unwrap_err(),
            KeySpecError::InvalidPointer("id".into())
        );
        let bad_order = FenceSpec::new(KeySpec::json_field("/id"), OrderSpec::integer("v"));
        assert_eq!(
            bad_order.validate().unwrap_err(),
            KeySpecError::InvalidPointer("v".into())
        );
        for preset in [
            FenceSpec::stripe(),
            FenceSpec::wechat_pay(),
            FenceSpec::alipay(),
            FenceSpec::adyen(),
        ] {
            preset.validate().unwrap();
            assert!(!preset.passes_stale());
        }
    }

    // Stripe: the event as received (`src/http/providers/stripe.rs`).
    fn stripe_event(id: &str, kind: &str, created: i64, status: &str) -> String {
        serde_json::json!({
            "id": id,
            "object": "event",
            "api_version": "2024-04-10",
            "created": created,
            "data": {"object": {
                "id": "pi_3P9f2aLkdIwHu7ix0eT1uVb8",
                "object": "payment_intent",
                "amount": 2000,
                "currency": "usd",
                "status": status,
            }},
            "livemode": false,
            "pending_webhooks": 1,
            "request": {"id": null, "idempotency_key": null},
            "type": kind,
        })
        .to_string()
    }

    #[test]
    fn stripe_orders_an_object_by_its_events_created() {
        let fence = FenceSpec::stripe();
        let created = fence
            .derive(&delivery(&stripe_event(
                "evt_3P9f2aLkdIwHu7ix0Kx1q2Bq",
                "payment_intent.created",
                1_714_528_800,
                "requires_payment_method",
            )))
            .unwrap();
        let succeeded = fence
            .derive(&delivery(&stripe_event(
                "evt_3P9f2aLkdIwHu7ix0Z8aJtLm",
                "payment_intent.succeeded",
                1_714_528_805,
                "succeeded",
            )))
            .unwrap();
        assert_eq!(created.entity.as_str(), "pi_3P9f2aLkdIwHu7ix0eT1uVb8");
        assert_eq!(created.entity, succeeded.entity);
        assert_eq!(created.order, ms(MAY_FIRST));
        assert!(created.order < succeeded.order);
        assert_eq!(
            fence.order().describe(&created.order),
            "created=2024-05-01T02:00:00Z"
        );
        // Two events of one second are equal: neither is stale.
        let same_second = fence
            .derive(&delivery(&stripe_event(
                "evt_0000000000000000000000aa",
                "payment_intent.processing",
                1_714_528_805,
                "processing",
            )))
            .unwrap();
        assert_eq!(same_second.order, succeeded.order);
        // An event whose object has no id has no entity.
        let balance = r#"{"id":"evt_1","object":"event","created":1714528800,"data":{"object":{"object":"balance","available":[]}},"type":"balance.available"}"#;
        assert_eq!(
            fence.derive(&delivery(balance)).unwrap_err(),
            KeyError::MissingField {
                pointer: "/data/object/id".into()
            }
        );
    }

    // WeChat Pay: the decrypted resource (`src/http/providers/wechat.rs`).
    const WECHAT_PAYMENT: &str = r#"{"mchid":"1900000100","appid":"wxd678efh567hg6787","out_trade_no":"1217752501201407033233368018","transaction_id":"1217752501201407033233368018","trade_type":"JSAPI","trade_state":"SUCCESS","trade_state_desc":"支付成功","bank_type":"CMC","success_time":"2018-06-08T10:34:56+08:00","amount":{"total":100,"payer_total":100,"currency":"CNY","payer_currency":"CNY"},"payer":{"openid":"oUpF8uMuAJO_M2pxb1Q9zNjWeS6o"}}"#;

    fn wechat_refund(out_refund_no: &str, status: &str) -> String {
        let mut refund = serde_json::json!({
            "mchid": "1900000100",
            "transaction_id": "1217752501201407033233368018",
            "out_trade_no": "1217752501201407033233368018",
            "refund_id": "50200207182018070300011301001",
            "out_refund_no": out_refund_no,
            "refund_status": status,
            "user_received_account": "招商银行信用卡0403",
            "amount": {"total": 100, "refund": 30, "payer_total": 100, "payer_refund": 30},
        });
        if status == "SUCCESS" {
            refund["success_time"] = "2018-06-09T10:34:56+08:00".into();
        }
        refund.to_string()
    }

    #[test]
    fn wechat_pay_fences_a_payment_and_each_refund_by_state() {
        let fence = FenceSpec::wechat_pay();
        let payment = fence.derive(&delivery(WECHAT_PAYMENT)).unwrap();
        assert_eq!(
            payment.entity.as_str(),
            r#"["1217752501201407033233368018",""]"#
        );
        assert_eq!(
            fence.order().describe(&payment.order),
            "refund_status|trade_state=SUCCESS"
        );

        let abnormal = fence
            .derive(&delivery(&wechat_refund("R1", "ABNORMAL")))
            .unwrap();
        let succeeded = fence
            .derive(&delivery(&wechat_refund("R1", "SUCCESS")))
            .unwrap();
        assert_eq!(
            abnormal.entity.as_str(),
            r#"["1217752501201407033233368018","R1"]"#
        );
        assert_eq!(abnormal.entity, succeeded.entity);
        assert!(abnormal.order < succeeded.order, "a late ABNORMAL is stale");
        // ABNORMAL and CLOSED refunds carry no success_time: still ordered.
        let closed = fence
            .derive(&delivery(&wechat_refund("R1", "CLOSED")))
            .unwrap();
        assert!(abnormal.order < closed.order);
        // Another refund of the same trade is another entity: a late
        // refund is never stale because of another one.
        let other = fence
            .derive(&delivery(&wechat_refund("R2", "ABNORMAL")))
            .unwrap();
        assert_ne!(other.entity, succeeded.entity);
        assert_ne!(payment.entity, succeeded.entity);

        let not_paid =
            WECHAT_PAYMENT.replace(r#""trade_state":"SUCCESS""#, r#""trade_state":"NOTPAY""#);
        assert!(matches!(
            fence.derive(&delivery(&not_paid)),
            Err(KeyError::BadOrder { pointer, .. }) if pointer == "/trade_state"
        ));
        assert_eq!(
            fence
                .derive(&delivery(r#"{"trade_state":"SUCCESS"}"#))
                .unwrap_err(),
            KeyError::MissingField {
                pointer: "/out_trade_no".into()
            }
        );
        assert_eq!(
            fence
                .derive(&delivery(r#"{"out_trade_no":"T1"}"#))
                .unwrap_err(),
            KeyError::MissingField {
                pointer: "/refund_status|/trade_state".into()
            }
        );
    }

    // Alipay: the signed form fields as a JSON object of strings
    // (`src/http/providers/alipay.rs`; fields of its tests).
    fn alipay(status: &str, extra: &[(&str, &str)]) -> String {
        let mut fields = serde_json::json!({
            "notify_time": "2026-12-01 20:00:05",
            "notify_type": "trade_status_sync",
            "notify_id": "ac05099524730693a8b330c5ecf72da9786",
            "app_id": "2014072300007148",
            "charset": "utf-8",
            "version": "1.0",
            "trade_no": "2013112011001004330000121536",
            "out_trade_no": "6823789339978248",
            "trade_status": status,
            "total_amount": "88.88",
            "subject": "中文 商品",
            "gmt_create": "2026-12-01 19:59:00",
        });
        for (k, v) in extra {
            fields[*k] = (*v).into();
        }
        fields.to_string()
    }

    #[test]
    fn alipay_ranks_trade_states_then_event_times_in_beijing_time() {
        let fence = FenceSpec::alipay();
        let derive = |json: String| fence.derive(&delivery(&json)).unwrap();
        let paid_at = [("gmt_payment", "2026-12-01 20:00:00")];
        let waiting = derive(alipay("WAIT_BUYER_PAY", &[]));
        let paid = derive(alipay("TRADE_SUCCESS", &paid_at));
        let refund_1 = derive(alipay(
            "TRADE_SUCCESS",
            &[
                ("gmt_payment", "2026-12-01 20:00:00"),
                ("gmt_refund", "2026-12-02 09:30:00.320"),
                ("out_biz_no", "HZRF001"),
                ("refund_fee", "10.00"),
            ],
        ));
        let refund_2 = derive(alipay(
            "TRADE_SUCCESS",
            &[
                ("gmt_payment", "2026-12-01 20:00:00"),
                ("gmt_refund", "2026-12-03 11:00:00.000"),
                ("out_biz_no", "HZRF002"),
                ("refund_fee", "20.00"),
            ],
        ));
        let closed = derive(alipay(
            "TRADE_CLOSED",
            &[
                ("gmt_payment", "2026-12-01 20:00:00"),
                ("gmt_refund", "2026-12-02 08:00:00"),
                ("gmt_close", "2026-12-02 08:00:00"),
                ("refund_fee", "88.88"),
            ],
        ));
        assert_eq!(paid.entity.as_str(), "6823789339978248");
        for later in [&paid, &refund_1, &refund_2, &closed] {
            assert_eq!(later.entity, waiting.entity);
        }
        assert!(waiting.order < paid.order);
        assert!(
            paid.order < refund_1.order,
            "partial refunds stay at TRADE_SUCCESS"
        );
        assert!(refund_1.order < refund_2.order);
        assert!(
            refund_2.order < closed.order,
            "TRADE_CLOSED is final, whatever its time"
        );
        // Naive times are Beijing time: 20:00 +08:00 is 12:00 UTC.
        assert_eq!(
            paid.order,
            Order::builder()
                .rank(1)
                .timestamp_ms(1_796_126_400_000)
                .build()
        );
        assert_eq!(
            fence.order().describe(&refund_1.order),
            "trade_status=TRADE_SUCCESS, gmt_refund|gmt_payment|gmt_create=2026-12-02T01:30:00.320Z"
        );
        // A retry of the same notification (a new notify_time) is the same order.
        let retried = derive(alipay("TRADE_SUCCESS", &paid_at).replace("20:00:05", "20:04:05"));
        assert_eq!(retried.order, paid.order);
        // An unpaid trade closed on timeout is final too.
        let timed_out = derive(alipay(
            "TRADE_CLOSED",
            &[("gmt_close", "2026-12-01 20:15:00")],
        ));
        assert!(waiting.order < timed_out.order);
        let finished = derive(alipay("TRADE_FINISHED", &paid_at));
        assert!(refund_2.order < finished.order);

        assert!(matches!(
            fence.derive(&delivery(&alipay("TRADE_PENDING", &paid_at))),
            Err(KeyError::BadOrder { pointer, .. }) if pointer == "/trade_status"
        ));
        let no_times = alipay("TRADE_SUCCESS", &[]).replace("gmt_create", "gmt_other");
        assert_eq!(
            fence.derive(&delivery(&no_times)).unwrap_err(),
            KeyError::MissingField {
                pointer: "/gmt_refund|/gmt_payment|/gmt_create".into()
            }
        );
    }

    // Adyen: the route's payload (`signed_only` in
    // `src/http/providers/adyen.rs`) and whole items.
    const ADYEN_ROUTE_PAYLOAD: &str = r#"{"notificationItems":[{"NotificationRequestItem":{"pspReference":"7914073381342284","merchantAccountCode":"TestMerchant","merchantReference":"TestPayment-1407325143704","eventCode":"AUTHORISATION","success":"true","amount":{"value":1130,"currency":"EUR"}}}]}"#;

    fn adyen_item(psp: &str, original: Option<&str>, code: &str, date: &str) -> serde_json::Value {
        let mut item = serde_json::json!({
            "pspReference": psp,
            "merchantAccountCode": "TestMerchant",
            "merchantReference": "TestPayment-1407325143704",
            "amount": {"value": 1130, "currency": "EUR"},
            "eventCode": code,
            "eventDate": date,
            "success": "true",
            "additionalData": {"hmacSignature": "coqCmt/IZ4E3CzPvMY8zTjQVL5hYJUiBRg8UU+iCWo0="},
        });
        if let Some(original) = original {
            item["originalReference"] = original.into();
        }
        item
    }

    fn adyen_envelope(item: serde_json::Value) -> String {
        serde_json::json!({"live": "false", "notificationItems": [{"NotificationRequestItem": item}]})
            .to_string()
    }

    #[test]
    fn adyen_fences_the_payment_by_event_date_where_it_is_delivered() {
        let fence = FenceSpec::adyen();
        let authorised = fence
            .derive(&delivery(&adyen_envelope(adyen_item(
                "7914073381342284",
                None,
                "AUTHORISATION",
                "2021-01-01T01:00:00+01:00",
            ))))
            .unwrap();
        let refunded = fence
            .derive(&delivery(&adyen_envelope(adyen_item(
                "8825408195409505",
                Some("7914073381342284"),
                "REFUND",
                "2021-01-01T00:30:00Z",
            ))))
            .unwrap();
        assert_eq!(authorised.entity.as_str(), "7914073381342284");
        assert_eq!(
            refunded.entity.as_str(),
            "8825408195409505",
            "a refund is an event of its own: never stale behind another refund or the capture"
        );
        assert!(authorised.order < refunded.order, "00:00Z before 00:30Z");
        // A bare item reads the same.
        let bare = fence
            .derive(&delivery(
                &adyen_item(
                    "8825408195409505",
                    Some("7914073381342284"),
                    "REFUND",
                    "2021-01-01T00:30:00Z",
                )
                .to_string(),
            ))
            .unwrap();
        assert_eq!(bare, refunded);
        // An empty originalReference is no reference.
        let empty_original = fence
            .derive(&delivery(&adyen_envelope(adyen_item(
                "7914073381342284",
                Some(""),
                "AUTHORISATION",
                "2021-01-01T01:00:00+01:00",
            ))))
            .unwrap();
        assert_eq!(empty_original, authorised);

        // The providers route keeps signed fields only: no eventDate.
        assert_eq!(
            fence.derive(&delivery(ADYEN_ROUTE_PAYLOAD)).unwrap_err(),
            KeyError::MissingField {
                pointer: "/notificationItems/0/NotificationRequestItem/eventDate|/eventDate".into()
            }
        );
        assert_eq!(
            fence
                .entity()
                .derive(&delivery(ADYEN_ROUTE_PAYLOAD))
                .unwrap()
                .as_str(),
            "7914073381342284"
        );
        assert_eq!(
            fence
                .derive(&delivery(r#"{"notificationItems":[]}"#))
                .unwrap_err(),
            KeyError::MissingField {
                pointer: "/notificationItems/0/NotificationRequestItem/pspReference".into()
            }
        );
    }
}
