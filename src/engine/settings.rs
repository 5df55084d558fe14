//! The engine settings every transport builder offers, written once.
//!
//! A transport builder holds an `engine: EngineBuilder<S>` field and
//! stamps the setters it forwards into its `impl` block:
//! `crate::engine::forward_engine_settings!();` for all of them (the broker
//! consumers), or a list such as
//! `crate::engine::forward_engine_settings!(key_redaction, clock);` where
//! the transport words a setting its own way (the HTTP layer's keys,
//! retention and fingerprints). Each setter has the same documentation on
//! every builder.

/// Stamps forwarding setters into a transport builder's `impl` block; see
/// the [module documentation](self).
#[allow(unused_macros)] // no transport compiled in: no user
macro_rules! forward_engine_settings {
    () => {
        $crate::engine::forward_engine_settings!(
            key,
            key_expr,
            fingerprint,
            optimistic,
            retention,
            key_redaction,
            hash_keys_in_traces,
            max_crashes,
            max_deadline_misses,
            fence,
            fence_retention,
            downstream_secret,
            payload_decoder,
            configure_engine,
        );
    };
    ($($setting:ident),+ $(,)?) => {
        $( $crate::engine::forward_engine_settings!(@ $setting); )+
    };
    (@key) => {
        /// How each message's key is derived: any core
        /// [`KeySpec`](crate::KeySpec), including
        /// [`KeySpec::message_key`](crate::KeySpec::message_key) (the
        /// broker's message key: the Kafka record key, the AMQP
        /// `message_id`) and [`KeySpec::header`](crate::KeySpec::header) (a
        /// header such as `Idempotency-Key`).
        #[must_use]
        pub fn key(mut self, key: $crate::KeySpec) -> Self {
            self.engine = self.engine.key(key);
            self
        }
    };
    (@key_expr) => {
        /// The key in string form: `json:/out_trade_no`, `message-key`,
        /// `header:Idempotency-Key`, `fingerprint`, ... (see [`KeySpec::parse`](crate::KeySpec::parse)).
        /// A malformed expression fails `build()`.
        #[must_use]
        pub fn key_expr(mut self, expr: &str) -> Self {
            self.engine = self.engine.key_expr(expr);
            self
        }
    };
    (@payload_decoder) => {
        /// Decodes payloads that are not JSON (Avro or Protobuf under a
        /// schema registry) into the value tree that key specs,
        /// fingerprints and [`Json`](crate::Json) inputs read; see
        /// [`EngineBuilder::payload_decoder`](crate::EngineBuilder::payload_decoder).
        #[must_use]
        pub fn payload_decoder(mut self, decoder: impl $crate::engine::PayloadDecoder) -> Self {
            self.engine = self.engine.payload_decoder(decoder);
            self
        }
    };
    (@fingerprint) => {
        /// What is fingerprinted to detect a key reused with another payload
        /// (default [`FingerprintSpec::Auto`](crate::FingerprintSpec::Auto)).
        #[must_use]
        pub fn fingerprint(mut self, spec: $crate::FingerprintSpec) -> Self {
            self.engine = self.engine.fingerprint(spec);
            self
        }
    };
    (@optimistic) => {
        /// Optimistic claims: the handler first, the key claimed with its
        /// result just before `COMMIT` (see [`EngineBuilder::optimistic`](crate::EngineBuilder::optimistic);
        /// only for handlers whose every effect is a database write).
        #[must_use]
        pub fn optimistic(mut self, optimistic: bool) -> Self {
            self.engine = self.engine.optimistic(optimistic);
            self
        }
    };
    (@retention) => {
        /// How long dedup records are kept (default 7 days). Must outlast the
        /// longest horizon over which a message can come back: broker
        /// retention and offset resets, and the oldest dead letter you may
        /// replay.
        #[must_use]
        pub fn retention(mut self, retention: std::time::Duration) -> Self {
            self.engine = self.engine.retention(retention);
            self
        }
    };
    (@key_redaction) => {
        /// How keys are shown in spans and logs (default: as they are);
        /// see [`EngineBuilder::key_redaction`](crate::EngineBuilder::key_redaction).
        #[must_use]
        pub fn key_redaction(mut self, redaction: $crate::KeyRedaction) -> Self {
            self.engine = self.engine.key_redaction(redaction);
            self
        }
    };
    (@hash_keys_in_traces) => {
        /// Shorthand for a [`KeyRedaction::per_process`](crate::KeyRedaction::per_process)
        /// (`true`) or plain keys (`false`, the default); see
        /// [`EngineBuilder::hash_keys_in_traces`](crate::EngineBuilder::hash_keys_in_traces).
        #[must_use]
        pub fn hash_keys_in_traces(mut self, hash: bool) -> Self {
            self.engine = self.engine.hash_keys_in_traces(hash);
            self
        }
    };
    (@max_crashes) => {
        /// How many times a delivery may kill the process (abort, out of
        /// memory, segfault) before it is parked with reason `crashed`
        /// (default 3); see
        /// [`EngineBuilder::max_crashes`](crate::EngineBuilder::max_crashes).
        #[must_use]
        pub fn max_crashes(mut self, crashes: u32) -> Self {
            self.engine = self.engine.max_crashes(crashes);
            self
        }
    };
    (@max_deadline_misses) => {
        /// How many times one delivery's handler may miss the transaction
        /// deadline before it is parked with reason `deadline` (default 3);
        /// see [`EngineBuilder::max_deadline_misses`](crate::EngineBuilder::max_deadline_misses).
        #[must_use]
        pub fn max_deadline_misses(mut self, misses: u32) -> Self {
            self.engine = self.engine.max_deadline_misses(misses);
            self
        }
    };
    (@fence) => {
        /// Fences each entity against out-of-order deliveries: a delivery
        /// older than one applied before to the same entity is acknowledged
        /// as stale without running the handler; see
        /// [`EngineBuilder::fence`](crate::EngineBuilder::fence).
        #[must_use]
        pub fn fence(mut self, fence: $crate::FenceSpec) -> Self {
            self.engine = self.engine.fence(fence);
            self
        }
    };
    (@fence_retention) => {
        /// How long an entity's fence is kept after its last delivery
        /// (default 90 days); see
        /// [`EngineBuilder::fence_retention`](crate::EngineBuilder::fence_retention).
        #[must_use]
        pub fn fence_retention(mut self, retention: std::time::Duration) -> Self {
            self.engine = self.engine.fence_retention(retention);
            self
        }
    };
    (@downstream_secret) => {
        /// The secret the handler's [downstream keys](crate::Tx::downstream_key)
        /// and [steps](crate::Tx::step) are keyed with; see
        /// [`EngineBuilder::downstream_secret`](crate::EngineBuilder::downstream_secret).
        #[must_use]
        pub fn downstream_secret(mut self, secret: impl Into<Vec<u8>>) -> Self {
            self.engine = self.engine.downstream_secret(secret);
            self
        }
    };
    (@clock) => {
        /// The clock for expiry (tests).
        #[must_use]
        pub fn clock(mut self, clock: impl $crate::Clock) -> Self {
            self.engine = self.engine.clock(clock);
            self
        }
    };
    (@configure_engine) => {
        /// Any other engine setting (clock, transient retries, ...).
        #[must_use]
        pub fn configure_engine(
            mut self,
            f: impl FnOnce($crate::EngineBuilder<S>) -> $crate::EngineBuilder<S>,
        ) -> Self {
            self.engine = f(self.engine);
            self
        }
    };
}
// Used by the transports that are compiled in; a build with none of them
// (the SQL store alone) has no user.
#[allow(unused_imports)]
pub(crate) use forward_engine_settings;
