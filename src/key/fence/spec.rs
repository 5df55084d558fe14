//! [`OrderSpec`]: where the order of a delivery comes from, built in
//! code or parsed from its string form, derived from a delivery and
//! described by its fields.

use std::fmt;
use std::sync::Arc;

use super::component::{Component, Field, Kind, too_long};
use super::parse;
use crate::delivery::Delivery;
use crate::key::{KeyError, KeySpec, KeySpecError, Order};

/// A user function deriving an order from a delivery.
type DynOrderFn = dyn Fn(&Delivery) -> Result<Order, KeyError> + Send + Sync;

/// A [`DynOrderFn`], shared by the spec's clones.
#[derive(Clone)]
pub(super) struct OrderFn(Arc<DynOrderFn>);

impl fmt::Debug for OrderFn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("OrderFn(..)")
    }
}

/// What an order is made of.
#[derive(Clone, Debug)]
pub(super) enum Source {
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
    pub(super) source: Source,
    /// Seconds east of UTC of timestamps written without an offset.
    pub(super) offset: Option<i32>,
}

impl OrderSpec {
    pub(super) fn component(kind: Kind, field: Field) -> Self {
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
        parse::parse(expr)
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
                if order.as_bytes().len() > Order::MAX_LEN {
                    return Err(too_long(order.as_bytes().len(), "custom"));
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
                Ok(Order::from_bytes(bytes))
            }
        }
    }

    /// `order` decoded by this spec, for logs and tools that have the
    /// spec at hand: each component as `field=value`, joined by `, `, e.g.
    /// `trade_status=TRADE_SUCCESS, gmt_refund|gmt_payment=2024-05-01T02:00:00.320Z`
    /// (timestamps in UTC, texts quoted). The hex of the bytes when they
    /// do not decode by this spec, or the spec is custom. Without the
    /// spec, [`Order::decode`] reads the values alone.
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
