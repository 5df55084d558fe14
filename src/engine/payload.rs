//! Payload decoders: payloads that are not JSON (Avro, Protobuf under a
//! schema registry) turned into the value tree that key specs,
//! fingerprints and [`Json`](super::Json) inputs read.
//!
//! A decoder runs before anything else of a delivery, outside every
//! transaction (it may fetch a schema over the network), and says one of
//! four things: here is the value tree; the payload is not in its format
//! and is read as it is (plain JSON); the payload is malformed (the
//! delivery is rejected, reason `decode_error`, and dead-lettered); or what
//! it needs is unavailable (the transports wait, as for a database outage,
//! and dead-letter nothing).
//!
//! | Decoder answer | Outcome | Decision |
//! |---|---|---|
//! | `Ok(Some(tree))` | processed as if the payload were `tree` in JSON; fingerprinted in the [decoded form](crate::fingerprint) (of the [fingerprinted tree](Delivery::with_fingerprinted), if the decoder sets one) | per the rest of the table in [`decide`](super::decide) |
//! | `Ok(None)` | processed as if there were no decoder: the payload is parsed as JSON, fingerprinted as JSON | per the rest of the table |
//! | [`PayloadError::Malformed`] | [`Rejected`](super::Outcome::Rejected) (`decode_error`) | dead letter, never retried |
//! | [`PayloadError::Unavailable`] | [`Failed`](super::Outcome::Failed) with [`Failure::Decoder`](super::Failure::Decoder) | wait in place, never an attempt |

use std::borrow::Cow;

use async_trait::async_trait;

use super::handler::{BoxError, DecodeError};
use super::outcome::{Failure, Outcome, Rejection};
use crate::delivery::Delivery;
use crate::store::InfraFault;

/// Turns a payload that is not JSON into the value tree the key specs,
/// fingerprints and [`Json`](super::Json) inputs read (see
/// [`EngineBuilder::payload_decoder`](super::EngineBuilder::payload_decoder)).
#[async_trait]
pub trait PayloadDecoder: Send + Sync + 'static {
    /// The value tree of `delivery`'s payload, or `None` when the payload
    /// is not in the decoder's format and is to be read as it is (a
    /// plain JSON payload on a topic moving to Avro): exactly as without a
    /// decoder, keys, fingerprints and inputs then parse it as JSON.
    async fn decode(&self, delivery: &Delivery) -> Result<Option<serde_json::Value>, PayloadError>;

    /// `delivery` with its value tree set ([`Delivery::with_decoded`]), or
    /// `None` as for [`decode`](Self::decode): what the engine calls, so
    /// a delivery decoded by hand should come from here too (its
    /// fingerprint then reads what the consumers' does).
    /// Provided; a decoder whose schemas stand for values left out
    /// overrides it to set the tree the fingerprint reads as well
    /// ([`Delivery::with_fingerprinted`]), as the
    /// [Schema Registry](crate::schema_registry) does for Avro field
    /// defaults.
    async fn decode_delivery(&self, delivery: &Delivery) -> Result<Option<Delivery>, PayloadError> {
        Ok(self
            .decode(delivery)
            .await?
            .map(|tree| delivery.clone().with_decoded(tree)))
    }
}

/// Why a [`PayloadDecoder`] gave no value tree.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PayloadError {
    /// The payload is not in the decoder's format or does not match its
    /// schema: the delivery is rejected (`decode_error`) and dead-lettered.
    #[error("{0}")]
    Malformed(String),
    /// What the decoder needs cannot be reached or refused it (a schema
    /// registry down, slow or refusing the credentials): the message is not
    /// at fault, the transports wait for it to pass.
    #[error("{source}")]
    Unavailable {
        /// What kind of outage it is, as for a database.
        fault: InfraFault,
        /// What went wrong.
        #[source]
        source: BoxError,
    },
}

/// `delivery` with its value tree, if `decoder` gives it one: the one
/// place every entry of the engine decodes ([`Engine::claim`](super::Engine::claim)
/// with this error, the others through [`decoded`]).
pub(super) async fn decode<'d>(
    decoder: Option<&dyn PayloadDecoder>,
    delivery: &'d Delivery,
) -> Result<Cow<'d, Delivery>, PayloadError> {
    let Some(decoder) = decoder.filter(|_| !delivery.is_decoded()) else {
        return Ok(Cow::Borrowed(delivery));
    };
    Ok(match decoder.decode_delivery(delivery).await? {
        Some(decoded) => Cow::Owned(decoded),
        None => Cow::Borrowed(delivery),
    })
}

/// [`decode`], with a payload that has no value tree as its outcome.
pub(super) async fn decoded<'d, T>(
    decoder: Option<&dyn PayloadDecoder>,
    delivery: &'d Delivery,
) -> Result<Cow<'d, Delivery>, Outcome<T>> {
    decode(decoder, delivery).await.map_err(|e| match e {
        PayloadError::Malformed(why) => Outcome::Rejected(Rejection::Decode(DecodeError(why))),
        PayloadError::Unavailable { fault, source } => {
            Outcome::Failed(Failure::Decoder { fault, source })
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{Decision, RetryPolicy, decide};

    struct Fixed(fn() -> Result<Option<serde_json::Value>, PayloadError>);

    #[async_trait]
    impl PayloadDecoder for Fixed {
        async fn decode(&self, _: &Delivery) -> Result<Option<serde_json::Value>, PayloadError> {
            (self.0)()
        }
    }

    async fn run(decoder: &Fixed) -> Result<Delivery, Outcome<()>> {
        let d = Delivery::new(b"\0\0\0\0\x01avro".to_vec());
        decoded(Some(decoder), &d).await.map(Cow::into_owned)
    }

    #[tokio::test]
    async fn a_tree_replaces_the_payload_for_keys_and_inputs() {
        let d = run(&Fixed(|| {
            Ok(Some(serde_json::json!({"out_trade_no": "T-1"})))
        }))
        .await
        .unwrap();
        assert!(d.is_decoded());
        assert_eq!(d.json().unwrap()["out_trade_no"], "T-1");
        assert_eq!(
            d.payload(),
            b"\0\0\0\0\x01avro",
            "the raw bytes stay for dead letters"
        );
    }

    #[tokio::test]
    async fn malformed_is_a_decode_error_dead_letter() {
        let outcome = run(&Fixed(|| {
            Err(PayloadError::Malformed("unknown magic byte 1".into()))
        }))
        .await
        .unwrap_err();
        assert_eq!(outcome.reason(), Some("decode_error"));
        assert!(matches!(
            decide(&outcome, 0, &RetryPolicy::default()),
            Decision::DeadLetter { .. }
        ));
    }

    #[tokio::test]
    async fn unavailable_waits_like_a_database_outage() {
        let outcome = run(&Fixed(|| {
            Err(PayloadError::Unavailable {
                fault: InfraFault::Unreachable,
                source: "registry down".into(),
            })
        }))
        .await
        .unwrap_err();
        assert_eq!(
            decide(&outcome, 1, &RetryPolicy::default()),
            Decision::Wait(InfraFault::Unreachable)
        );
    }

    #[test]
    fn claim_errors_say_whether_to_wait() {
        use crate::engine::ClaimError;
        let wait = ClaimError::Payload(PayloadError::Unavailable {
            fault: InfraFault::Timeout,
            source: "registry".into(),
        });
        assert_eq!(wait.infra_fault(), Some(InfraFault::Timeout));
        let reject = ClaimError::Payload(PayloadError::Malformed("magic byte 1".into()));
        assert_eq!(reject.infra_fault(), None);
        let no_key = ClaimError::BadKey(crate::key::KeyError::Empty);
        assert_eq!(no_key.infra_fault(), None);
    }

    #[tokio::test]
    async fn a_payload_not_in_the_format_is_read_as_it_is() {
        let d = Delivery::new(br#"{"out_trade_no":"T-1"}"#.to_vec());
        let plain = Fixed(|| Ok(None));
        let read = decoded::<()>(Some(&plain), &d).await.unwrap();
        assert!(matches!(read, Cow::Borrowed(_)));
        assert!(
            !read.is_decoded(),
            "fingerprinted as JSON, as without a decoder"
        );
    }

    #[tokio::test]
    async fn no_decoder_or_a_decoded_delivery_is_left_alone() {
        let d = Delivery::new(b"{}".to_vec());
        assert!(matches!(
            decoded::<()>(None, &d).await,
            Ok(Cow::Borrowed(_))
        ));
        let d = d.with_decoded(serde_json::json!({"a": 1}));
        let never = Fixed(|| Err(PayloadError::Malformed("decoded twice".into())));
        assert!(matches!(
            decoded::<()>(Some(&never), &d).await,
            Ok(Cow::Borrowed(_))
        ));
    }
}
