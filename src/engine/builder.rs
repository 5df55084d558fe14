//! Configuration of an [`Engine`].

use std::sync::Arc;
use std::time::Duration;

use super::Telemetry;
use super::{Engine, Inner, RetryPolicy};
use crate::clock::{Clock, SystemClock};
use crate::fingerprint::FingerprintSpec;
use crate::key::{FenceSpec, KeySpec, KeySpecError};
use crate::redact::KeyRedaction;
use crate::store::{SqlStore, StoreError, validate_scope};

/// The default retention of dedup records: 7 days (Kafka's default log
/// retention). It must outlast the longest redelivery or replay horizon.
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);

/// How long an entity's [fence](EngineBuilder::fence) is kept after its
/// last delivery by default: 90 days. It must outlive the dedup records
/// (a redelivery whose key record expired is stopped only by its fence),
/// and cover how late an old event can still arrive: providers retry for
/// up to 3 days (Stripe) and dead-letter queues are replayed weeks later.
pub(crate) const DEFAULT_FENCE_RETENTION: Duration = Duration::from_secs(90 * 24 * 3600);

/// A configuration that cannot work. Returned by [`EngineBuilder::build`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BuildError {
    /// No scope was set.
    #[error("the engine needs a scope (consumer group, queue or handler name)")]
    MissingScope,
    /// No key spec was set.
    #[error("the engine needs a key spec, e.g. `json:/out_trade_no`")]
    MissingKey,
    /// The key spec is invalid.
    #[error("invalid key spec: {0}")]
    Key(#[from] KeySpecError),
    /// The scope is invalid.
    #[error(transparent)]
    Scope(#[from] StoreError),
    /// The retention is zero.
    #[error("retention must be longer than zero")]
    ZeroRetention,
    /// [`EngineBuilder::max_crashes`] is zero.
    #[error("max_crashes must be at least 1")]
    ZeroMaxCrashes,
    /// [`EngineBuilder::max_deadline_misses`] is zero.
    #[error("max_deadline_misses must be at least 1")]
    ZeroMaxDeadlineMisses,
    /// The fence would expire before the dedup records (see
    /// [`EngineBuilder::fence_retention`]).
    #[error("the fence retention ({fence:?}) must be at least the record retention ({records:?})")]
    FenceRetention {
        /// The fence retention asked for.
        fence: Duration,
        /// The records' retention.
        records: Duration,
    },
    /// The downstream secret is shorter than
    /// 16 bytes.
    #[error("the downstream secret must be at least {min} bytes long")]
    DownstreamSecret {
        /// The shortest secret taken.
        min: usize,
    },
    /// A downstream secret (for [steps](crate::Tx::step)) on a store that
    /// cannot record a step beside an open claim (SQLite: one writer).
    #[error(
        "steps need a store that can record them beside an open claim (PostgreSQL, MySQL); SQLite has one writer"
    )]
    StepsUnsupported,
}

/// Builds an [`Engine`]: `Engine::builder(store).scope(..).key(..).build()`.
pub struct EngineBuilder<S> {
    store: S,
    scope: Option<String>,
    key: Option<Result<KeySpec, KeySpecError>>,
    fingerprint: Option<FingerprintSpec>,
    retention: Option<Duration>,
    retry: RetryPolicy,
    transient_retries: u32,
    clock: Arc<dyn Clock>,
    transport: &'static str,
    redaction: KeyRedaction,
    max_crashes: u32,
    max_deadline_misses: u32,
    optimistic: bool,
    fence: Option<FenceSpec>,
    fence_retention: Duration,
    downstream_secret: Option<Vec<u8>>,
    decoder: Option<Arc<dyn super::PayloadDecoder>>,
}

impl<S: SqlStore> EngineBuilder<S> {
    pub(super) fn new(store: S) -> Self {
        Self {
            store,
            scope: None,
            key: None,
            fingerprint: None,
            retention: None,
            retry: RetryPolicy::default(),
            transient_retries: 3,
            clock: Arc::new(SystemClock),
            transport: crate::telemetry::TRANSPORT_ENGINE,
            redaction: KeyRedaction::plain(),
            max_crashes: super::DEFAULT_MAX_CRASHES,
            max_deadline_misses: super::DEFAULT_MAX_DEADLINE_MISSES,
            optimistic: false,
            fence: None,
            fence_retention: DEFAULT_FENCE_RETENTION,
            downstream_secret: None,
            decoder: None,
        }
    }

    /// Decodes payloads that are not JSON (Avro or Protobuf in the
    /// Confluent wire format: a
    /// [`SchemaRegistry`](crate::schema_registry::SchemaRegistry) with
    /// feature `schema-registry`) into the value tree that key specs
    /// (`json:/out_trade_no`), fingerprints and [`Json`](crate::Json)
    /// inputs then read, before anything else of the delivery and outside
    /// every transaction. A payload it cannot read is rejected
    /// (`decode_error`); a decoder that cannot reach its registry makes
    /// the transports wait. See [`PayloadDecoder`](super::PayloadDecoder).
    /// The HTTP layer does not use it.
    #[must_use]
    pub fn payload_decoder(mut self, decoder: impl super::PayloadDecoder) -> Self {
        self.decoder = Some(Arc::new(decoder));
        self
    }

    /// Fences each entity against out-of-order deliveries: `fence` says
    /// which entity a delivery is about and its order. In the claim's
    /// transaction, once the key is new, the entity's fence moves forward
    /// to the delivery's order; a delivery whose order is lower than one
    /// applied before is [`Outcome::Stale`](crate::Outcome::Stale): its
    /// key is recorded as stale, it is acknowledged, and the handler does
    /// not run (unless the fence [passes stale deliveries](FenceSpec::pass_stale)).
    /// A delivery without a valid entity or order is rejected like one
    /// without a key. See the [fences guide](crate::key#fences).
    #[must_use]
    pub fn fence(mut self, fence: FenceSpec) -> Self {
        self.fence = Some(fence);
        self
    }

    /// How long an entity's fence is kept after its last delivery
    /// (default 90 days; at least the record
    /// [`retention`](Self::retention)). Once it is purged, the entity's
    /// next delivery starts a new fence, whatever its order.
    #[must_use]
    pub fn fence_retention(mut self, retention: Duration) -> Self {
        self.fence_retention = retention;
        self
    }

    /// The secret [downstream keys](crate::Tx::downstream_key) are keyed
    /// with (at least 16 bytes; keep it like a signing secret and the same
    /// on every instance: a redelivery to another process must derive the
    /// same key). Without it, [`Tx::step`](crate::Tx::step) and
    /// [`Tx::downstream_key`](crate::Tx::downstream_key) fail with
    /// [`StepError::NoSecret`](crate::engine::StepError::NoSecret).
    #[must_use]
    pub fn downstream_secret(mut self, secret: impl Into<Vec<u8>>) -> Self {
        self.downstream_secret = Some(secret.into());
        self
    }

    /// The scope keys are unique in: the consumer group, queue or handler
    /// name. Two scopes processing the same message each process it once.
    #[must_use]
    pub fn scope(mut self, scope: impl Into<String>) -> Self {
        self.scope = Some(scope.into());
        self
    }

    /// The key spec.
    #[must_use]
    pub fn key(mut self, key: KeySpec) -> Self {
        self.key = Some(Ok(key));
        self
    }

    /// The key spec in string form, e.g. `json:/out_trade_no`; a bad
    /// expression fails [`EngineBuilder::build`].
    #[must_use]
    pub fn key_expr(mut self, expr: &str) -> Self {
        self.key = Some(KeySpec::parse(expr));
        self
    }

    /// What the payload fingerprint covers (default: canonical JSON or raw bytes).
    #[must_use]
    pub fn fingerprint(mut self, spec: FingerprintSpec) -> Self {
        self.fingerprint = Some(spec);
        self
    }

    /// How long records are kept (default 7 days). Must outlast the longest
    /// redelivery or replay horizon: a duplicate arriving after its record
    /// expired is processed again.
    #[must_use]
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = Some(retention);
        self
    }

    /// The retry policy for retryable failures.
    #[must_use]
    pub fn retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = retry;
        self
    }

    /// How many times a transaction that hit a transient database error
    /// (deadlock, serialization failure, busy) is retried at once within one
    /// attempt (default 3).
    #[must_use]
    pub fn transient_retries(mut self, retries: u32) -> Self {
        self.transient_retries = retries;
        self
    }

    /// How many times a message may kill the process before it is parked
    /// (default 3; at
    /// least 1).
    ///
    /// A handler that aborts, is killed for memory or segfaults on one
    /// particular message would get it redelivered after every restart,
    /// and its partition or queue would crash-loop forever. For a
    /// delivery that may be such a redelivery (a
    /// [suspect](crate::Delivery::with_suspect): AMQP's `redelivered`,
    /// Kafka's first records of a lane after an assignment), the engine
    /// counts the start of its handler durably before running it, alone;
    /// once the process died under it `max_crashes` times it is not run
    /// again but dead-lettered with reason `crashed`
    /// ([`Failure::Crashed`](super::Failure::Crashed)), and the partition
    /// or queue moves on. Healthy messages pay nothing for it.
    ///
    /// A message's first crash usually happens before it is suspect (it
    /// was a fresh delivery then), and is not counted: such a message kills
    /// the process up to `max_crashes + 1` times.
    #[must_use]
    pub fn max_crashes(mut self, crashes: u32) -> Self {
        self.max_crashes = crashes;
        self
    }

    /// How many times one key's handler may keep its transaction past the
    /// [transaction deadline](crate::store::Deadlines::transaction) before
    /// the delivery is parked (default 3, at least 1).
    ///
    /// A missed deadline rolls the attempt back and is a timeout: the
    /// transports wait in place and try again, as for a silent database.
    /// A handler that is always slower than the deadline would wait so
    /// for ever. So each miss is counted for the key (in the attempts
    /// table, as crashes are, by a statement that also shows the database
    /// answers: while it does not, misses are not counted and the delivery
    /// waits), and once a key missed `max_deadline_misses` times it fails
    /// with [`Failure::Deadline`](super::Failure::Deadline): dead-lettered
    /// with reason `deadline` by the consumers (the counter starts over, so
    /// a replay gets its own misses), `500` over HTTP. Each miss counts in
    /// `onceonly_deadline_misses_total`.
    #[must_use]
    pub fn max_deadline_misses(mut self, misses: u32) -> Self {
        self.max_deadline_misses = misses;
        self
    }

    /// Optimistic claims (default `false`): the handler runs first, in a
    /// plain transaction, and the key is claimed after it, by the statement
    /// that also records its result, sent just before `COMMIT`. A new key
    /// then costs one statement instead of two (the claim's insert and the
    /// result's update), and no claim lock is held while the handler runs.
    /// A key committed already is found by that insert: the transaction,
    /// the handler's writes with it, rolls back and the delivery is a
    /// duplicate (or a conflict) as usual, its stored result returned. A
    /// cache tier still answers known keys before the handler runs, and
    /// suspects ([`max_crashes`](Self::max_crashes)) are claimed first.
    ///
    /// Only for handlers whose every effect is a write in the transaction
    /// (the outbox included) or goes through a [step](crate::Tx::step): a
    /// duplicate runs the handler again before it is found out, and two
    /// concurrent copies of one key both run it (the second one's writes
    /// are rolled back). That is why it is off by default: onceonly cannot
    /// see a handler's direct calls to other systems, which claiming first
    /// keeps from every copy of a committed or in-flight key (see
    /// [the guide](crate::engine#optimistic-claims)). A handler that fails
    /// is checked against the dedup table before the failure counts: a key
    /// committed meanwhile (a concurrent copy's writes made the handler's
    /// own insert fail) is a duplicate. Either way, while more than one in
    /// five of the recent claims found their key taken (duplicates,
    /// conflicts), each key is looked up first (one read, no transaction),
    /// so duplicates cost that read (see [`ClaimSpec::look_up_first`](crate::engine::ClaimSpec::look_up_first));
    /// the look-up stops again when they become rare.
    ///
    /// Batches ([`Engine::process_batch`], the Kafka consumer's
    /// `batch_size`) look their keys up in one statement first, so keys
    /// committed already are answered without their handlers, run the
    /// handlers of the others, and claim them all with their results in
    /// one insert before `COMMIT`; a key committed meanwhile by another
    /// transaction rolls the batch back, and its deliveries go one by one.
    /// [Sessions](Engine::claim_with) of an optimistic engine claim their
    /// key in [`Session::finish`](crate::engine::Session::finish). The
    /// HTTP layer follows the engine builder it is given, with the same
    /// look-up while retries are common.
    ///
    /// On MySQL and MariaDB, a deadlock (1213) that the handler swallowed
    /// has rolled the whole transaction back: the claim checks that the
    /// transaction the handler started is still open (a savepoint taken
    /// with `BEGIN` must still exist) and fails the attempt as contention
    /// otherwise, so it is retried instead of committing the claim without
    /// the handler's writes.
    #[must_use]
    pub fn optimistic(mut self, optimistic: bool) -> Self {
        self.optimistic = optimistic;
        self
    }

    /// The clock (default: system time).
    #[must_use]
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// The `transport` label of this engine's metrics and spans (default
    /// `engine`). The Kafka, AMQP and HTTP builders set their own; set it
    /// when you drive the engine from a transport of yours.
    #[must_use]
    pub fn transport(mut self, name: &'static str) -> Self {
        self.transport = name;
        self
    }

    /// How keys are shown in the delivery span, and so in every line
    /// logged about a delivery (default [`KeyRedaction::plain`]: the key
    /// itself). Keys such as e-mail addresses or account numbers are
    /// personal data: [`KeyRedaction::hmac`] with a secret shared by the
    /// deployment shows `hmac:` and 16 hex digits of a keyed hash, which
    /// still correlates the lines of one key and which an operator can
    /// compute for a known key. See [`redact`](crate::redact).
    #[must_use]
    pub fn key_redaction(mut self, redaction: KeyRedaction) -> Self {
        self.redaction = redaction;
        self
    }

    /// The scope, unless one was set (the transports' defaults: the
    /// consumer group, the queue).
    #[cfg(feature = "_broker")] // the consumers' defaults
    pub(crate) fn or_scope(mut self, scope: impl FnOnce() -> String) -> Self {
        if self.scope.is_none() {
            self.scope = Some(scope());
        }
        self
    }

    /// Whether a scope was set.
    #[cfg(feature = "http")]
    pub(crate) fn has_scope(&self) -> bool {
        self.scope.is_some()
    }

    /// The key, unless one was set.
    #[cfg(feature = "http")]
    pub(crate) fn or_key(mut self, key: impl FnOnce() -> Result<KeySpec, KeySpecError>) -> Self {
        if self.key.is_none() {
            self.key = Some(key());
        }
        self
    }

    /// The fingerprint spec, unless one was set.
    #[cfg(feature = "http")]
    pub(crate) fn or_fingerprint(mut self, spec: impl FnOnce() -> FingerprintSpec) -> Self {
        if self.fingerprint.is_none() {
            self.fingerprint = Some(spec());
        }
        self
    }

    /// The retention set, if any.
    #[cfg(feature = "http")]
    pub(crate) fn retention_set(&self) -> Option<Duration> {
        self.retention
    }

    /// The key set, if any (the HTTP layer checks what a provider signs).
    #[cfg(feature = "http")]
    pub(crate) fn key_set(&self) -> Option<&Result<KeySpec, KeySpecError>> {
        self.key.as_ref()
    }

    /// Checks the configuration and builds the engine. Metric handles are
    /// resolved here: install the metrics recorder before.
    pub fn build(self) -> Result<Engine<S>, BuildError> {
        let scope = self.scope.ok_or(BuildError::MissingScope)?;
        validate_scope(&scope)?;
        let key = self.key.ok_or(BuildError::MissingKey)??;
        key.validate()?;
        let retention = self.retention.unwrap_or(DEFAULT_RETENTION);
        if retention.is_zero() {
            return Err(BuildError::ZeroRetention);
        }
        if self.max_crashes == 0 {
            return Err(BuildError::ZeroMaxCrashes);
        }
        if self.max_deadline_misses == 0 {
            return Err(BuildError::ZeroMaxDeadlineMisses);
        }
        if let Some(fence) = &self.fence {
            fence.validate()?;
        }
        if self.fence.is_some() && self.fence_retention < retention {
            return Err(BuildError::FenceRetention {
                fence: self.fence_retention,
                records: retention,
            });
        }
        let min = super::steps::MIN_DOWNSTREAM_SECRET;
        if self
            .downstream_secret
            .as_ref()
            .is_some_and(|s| s.len() < min)
        {
            return Err(BuildError::DownstreamSecret { min });
        }
        if self.downstream_secret.is_some() && !self.store.records_steps() {
            return Err(BuildError::StepsUnsupported);
        }
        let telemetry = Telemetry::new(&scope, self.transport, self.redaction);
        let steps = super::steps::StepLog::new(
            self.store.clone(),
            Arc::clone(&self.clock),
            retention,
            self.downstream_secret.map(Arc::from),
        );
        Ok(Engine {
            inner: Arc::new(Inner {
                store: self.store,
                telemetry,
                scope,
                key,
                fingerprint: self.fingerprint.unwrap_or_default(),
                retention,
                retry: self.retry,
                transient_retries: self.transient_retries,
                clock: self.clock,
                max_crashes: self.max_crashes,
                max_deadline_misses: self.max_deadline_misses,
                crashes: super::crash::Crashes::default(),
                optimistic: self.optimistic,
                recent_duplicates: super::DuplicateShare::default(),
                fence: self.fence,
                fence_retention: self.fence_retention,
                steps: Arc::new(steps),
                decoder: self.decoder,
            }),
        })
    }
}

/// A store with every engine setting at its default: what a transport
/// builder takes when it needs no engine setting, e.g.
/// `IdempotencyLayer::idempotency_key(store, "orders")`; otherwise pass
/// `Engine::builder(store).key_expr(..)` (the consumers need a key).
impl<S: SqlStore> From<S> for EngineBuilder<S> {
    fn from(store: S) -> Self {
        Self::new(store)
    }
}
