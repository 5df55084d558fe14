//! The claim session: the one path from a claim to a commit. The engine's
//! single and batch paths, the HTTP layer and the broker consumers all run
//! on it: claim the key in a new transaction, let the caller work in that
//! transaction ([`Tx`]), then [`finish`](Session::finish) (record the
//! result, commit, tell the cache tier) or [`abandon`](Session::abandon).

use std::time::{Duration, Instant};

use super::crash::{Counted, Gate, Start};
use super::fence::{Stale, is_recorded_stale};
use super::tx::{Origin, Tx};
use super::{Engine, Failure};
use crate::delivery::Delivery;
use crate::fingerprint::Fingerprint;
use crate::key::{FenceValue, IdemKey, KeyError};
use crate::store::{
    Claim, ClaimRequest, ClaimTimes, ClaimTx, Completed, InfraFault, Record, SqlStore, StoreError,
    classify_existing, is_write_fault,
};

/// What to claim, for [`Engine::claim_with`]: a key, and optionally another
/// scope, a fingerprint, source coordinates and a bound on waiting for a
/// holder of the key.
#[derive(Clone, Debug)]
pub struct ClaimSpec<'a> {
    key: &'a str,
    scope: Option<&'a str>,
    fingerprint: Option<Fingerprint>,
    source: Option<&'a str>,
    lock_wait: Option<Duration>,
    traceparent: Option<&'a str>,
    suspect: bool,
    look_up_first: Option<bool>,
    fence: Option<&'a FenceValue>,
}

impl<'a> ClaimSpec<'a> {
    /// A claim of `key` in the engine's scope, without fingerprint.
    pub fn new(key: &'a IdemKey) -> Self {
        Self {
            key: key.as_str(),
            scope: None,
            fingerprint: None,
            source: None,
            lock_wait: None,
            traceparent: None,
            suspect: false,
            look_up_first: None,
            fence: None,
        }
    }

    /// The delivery's entity and order, passed through the entity's fence
    /// in the claim's transaction once the key is new (see
    /// [`EngineBuilder::fence`](crate::EngineBuilder::fence) and
    /// [`Engine::fence_of`]): a delivery older than its entity's state is
    /// [`Claimed::Stale`].
    #[must_use]
    pub fn fence(mut self, fence: Option<&'a FenceValue>) -> Self {
        self.fence = fence;
        self
    }

    /// Whether to read the key's committed record before anything else
    /// (one statement on the pool, no transaction), so that a committed
    /// duplicate or conflict is answered without a claim transaction and
    /// (on an [optimistic](crate::EngineBuilder::optimistic) engine)
    /// without running the handler. By default the engine decides: it
    /// looks up while more than one in five of its recent claims found
    /// their key taken, so a duplicate costs one read when duplicates are
    /// common and nothing is paid for the read when they are rare. The
    /// cache tier, if any, is asked first either way.
    #[must_use]
    pub fn look_up_first(mut self, look_up: bool) -> Self {
        self.look_up_first = Some(look_up);
        self
    }

    /// Claims a *suspect*: a delivery that may be a redelivery of a message
    /// whose handler was running when its process died (see
    /// [`Delivery::with_suspect`](crate::Delivery::with_suspect)). If its
    /// key is new, the start of its handler is counted durably before the
    /// claim returns, and the session runs alone among this engine's
    /// claims; once the process died under it
    /// [`max_crashes`](crate::EngineBuilder::max_crashes) times, the claim
    /// returns [`Claimed::Crashed`] instead. Healthy deliveries must not be
    /// suspects: each costs round trips and runs alone.
    #[must_use]
    pub fn suspect(mut self, suspect: bool) -> Self {
        self.suspect = suspect;
        self
    }

    /// The inbound message's W3C `traceparent`, passed on to the messages
    /// the handler sends through the [outbox](crate::outbox).
    #[must_use]
    pub fn traceparent(mut self, traceparent: Option<&'a str>) -> Self {
        self.traceparent = traceparent;
        self
    }

    /// Claims in `scope` instead of the engine's (the HTTP layer's
    /// per-principal scopes).
    #[must_use]
    pub fn scope(mut self, scope: &'a str) -> Self {
        self.scope = Some(scope);
        self
    }

    /// The payload fingerprint stored with the key and compared with a
    /// stored one.
    #[must_use]
    pub fn fingerprint(mut self, fingerprint: Option<Fingerprint>) -> Self {
        self.fingerprint = fingerprint;
        self
    }

    /// Source coordinates stored with the record, e.g. `payments/3@1042`.
    #[must_use]
    pub fn source(mut self, source: Option<&'a str>) -> Self {
        self.source = source;
        self
    }

    /// How long the claim may wait while another transaction holds the key
    /// (see [`ClaimRequest::lock_wait`]).
    #[must_use]
    pub fn lock_wait(mut self, wait: Duration) -> Self {
        self.lock_wait = Some(wait);
        self
    }
}

/// What a claim found.
#[non_exhaustive]
pub enum Claimed<S: SqlStore> {
    /// The key is new (or its record had expired): work in
    /// [`Session::tx`], then [`finish`](Session::finish) or
    /// [`abandon`](Session::abandon). On an
    /// [optimistic](crate::EngineBuilder::optimistic) engine the key is not
    /// claimed yet: [`finish`](Session::finish) claims it with the result,
    /// and may find it taken meanwhile.
    New(Session<S>),
    /// The key was already committed with the same payload (or without
    /// fingerprints): nothing to do.
    Duplicate {
        /// The stored result, `None` if none was recorded.
        result: Option<Vec<u8>>,
    },
    /// The key was already committed with another payload.
    Conflict {
        /// The fingerprint stored with the key.
        stored: Option<Fingerprint>,
        /// The fingerprint of this delivery.
        received: Option<Fingerprint>,
    },
    /// A [suspect](ClaimSpec::suspect) whose handler was started `crashes`
    /// times already, the process dying each time: do not run it again,
    /// dead-letter it (reason `crashed`). Nothing was claimed.
    Crashed {
        /// Starts of its handler that the process did not survive.
        crashes: u32,
    },
    /// The delivery is older than its entity's state (see
    /// [`ClaimSpec::fence`]): its key is recorded as stale, nothing else
    /// was done. Acknowledge it.
    Stale(Stale),
}

impl<S: SqlStore> std::fmt::Debug for Claimed<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            // The key as the engine shows it in spans and logs.
            Self::New(session) => f
                .debug_tuple("New")
                .field(&session.engine.key_redaction().show(session.key()))
                .finish(),
            Self::Duplicate { result } => f
                .debug_struct("Duplicate")
                .field("result_bytes", &result.as_ref().map(Vec::len))
                .finish(),
            Self::Conflict { stored, received } => f
                .debug_struct("Conflict")
                .field("stored", stored)
                .field("received", received)
                .finish(),
            Self::Crashed { crashes } => {
                f.debug_struct("Crashed").field("crashes", crashes).finish()
            }
            Self::Stale(stale) => f.debug_tuple("Stale").field(stale).finish(),
        }
    }
}

impl<S: SqlStore> Claimed<S> {
    /// The claim a store or cache tier returned, as seen by the caller.
    pub(crate) fn settled(claim: Claim, received: Option<Fingerprint>) -> Result<Self, StoreError> {
        match claim {
            Claim::Duplicate { result } => match is_recorded_stale(result.as_deref()) {
                Some(stale) => Ok(Self::Stale(stale)),
                None => Ok(Self::Duplicate { result }),
            },
            Claim::Conflict { stored } => Ok(Self::Conflict { stored, received }),
            other => Err(StoreError::Corrupt(format!(
                "unexpected claim {other:?} outside a batch"
            ))),
        }
    }
}

/// Why [`Engine::claim`] could not claim a delivery.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClaimError {
    /// The delivery has no valid key: reject it.
    #[error(transparent)]
    BadKey(#[from] KeyError),
    /// The store failed (see [`StoreError::infra_fault`]).
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The engine's [payload decoder](crate::EngineBuilder::payload_decoder)
    /// cannot read the payload (reject it) or cannot reach its registry
    /// (wait).
    #[error(transparent)]
    Payload(#[from] super::PayloadError),
}

impl ClaimError {
    /// The infrastructure fault this is, if the delivery is not at fault
    /// and should wait (the database, or the payload decoder's registry):
    /// `None` for a delivery to reject (no valid key, a payload that does
    /// not decode) or a data exception on one of its values.
    pub fn infra_fault(&self) -> Option<InfraFault> {
        match self {
            Self::BadKey(_) => None,
            Self::Store(e) => e.infra_fault(),
            Self::Payload(super::PayloadError::Unavailable { fault, .. }) => Some(*fault),
            Self::Payload(_) => None,
        }
    }
}

/// A key claimed in an open transaction. Dropping it without
/// [`finish`](Session::finish) rolls the transaction back.
pub struct Session<S: SqlStore> {
    engine: Engine<S>,
    /// The transaction; its [`Origin`] holds the scope and the key.
    tx: Tx<S::Db>,
    fingerprint: Option<Fingerprint>,
    times: ClaimTimes,
    /// The counted start of a suspect's handler.
    counted: Option<Counted<S>>,
    /// An optimistic session's claim, made by [`finish`](Session::finish)
    /// with the result; `None` once claimed (claim-first sessions).
    pending: Option<Pending>,
    /// Held until the session ends: exclusive for a suspect.
    _gate: Gate,
}

/// A new session's claim: held (claim-first; a suspect's counted start),
/// or still to make with the result (optimistic).
enum SessionClaim<S: SqlStore> {
    Held(Option<Counted<S>>),
    Pending(Pending),
}

/// What an optimistic session claims with its result, besides the key.
struct Pending {
    source: Option<String>,
    lock_wait: Option<Duration>,
}

/// How a [`Session`] ended when its result was recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Finished {
    /// The key, its result and the work done in the session committed.
    Committed,
    /// An [optimistic](crate::EngineBuilder::optimistic) session's key was
    /// committed meanwhile by another transaction with the same payload:
    /// the session's work was rolled back; this is a duplicate.
    Duplicate {
        /// The stored result, `None` if none was recorded.
        result: Option<Vec<u8>>,
    },
    /// An optimistic session's key was committed meanwhile with another
    /// payload: the session's work was rolled back.
    Conflict {
        /// The fingerprint stored with the key.
        stored: Option<Fingerprint>,
        /// The fingerprint of this delivery.
        received: Option<Fingerprint>,
    },
    /// An optimistic session's key was recorded meanwhile as stale (see
    /// [`Claimed::Stale`]): the session's work was rolled back.
    Stale(Stale),
}

impl Finished {
    /// A claim that found the key taken, as a session's end.
    fn taken(claim: Claim, received: Option<Fingerprint>) -> Result<Self, StoreError> {
        match claim {
            Claim::Duplicate { result } => match is_recorded_stale(result.as_deref()) {
                Some(stale) => Ok(Self::Stale(stale)),
                None => Ok(Self::Duplicate { result }),
            },
            Claim::Conflict { stored } => Ok(Self::Conflict { stored, received }),
            other => Err(StoreError::Corrupt(format!(
                "unexpected claim {other:?} of a finished session"
            ))),
        }
    }
}

/// A key claimed in a new transaction, or what the claim found instead.
type Opened<DB> = Result<(ClaimTx<DB>, ClaimTimes), Claim>;

impl<S: SqlStore> Engine<S> {
    /// Claims the key of `delivery` (derived and fingerprinted as this
    /// engine is configured) in a new transaction. The building block of
    /// [`Engine::process`], for callers that run their own work:
    ///
    /// ```no_run
    /// # #[cfg(feature = "sqlite")]
    /// # async fn f(engine: onceonly::Engine<onceonly::SqliteStore>, delivery: onceonly::Delivery) -> Result<(), Box<dyn std::error::Error>> {
    /// use onceonly::engine::Claimed;
    ///
    /// match engine.claim(&delivery).await? {
    ///     Claimed::New(session) => {
    ///         let mut conn = session.tx().lock().await?;
    ///         sqlx::query("INSERT INTO ledger (out_trade_no) VALUES ('T-1')")
    ///             .execute(&mut *conn)
    ///             .await?;
    ///         drop(conn);
    ///         session.finish(b"\"ok\"").await?;
    ///     }
    ///     Claimed::Duplicate { .. } => { /* acknowledge */ }
    ///     _ => { /* a conflict, or a suspect that crashed too often: dead-letter */ }
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn claim(&self, delivery: &Delivery) -> Result<Claimed<S>, ClaimError> {
        // A suspect's stages before its claim are counted (see `crash`).
        let early = match self.count_early(delivery).await {
            Ok(early) => early,
            Err(Failure::Crashed { crashes }) => return Ok(Claimed::Crashed { crashes }),
            Err(Failure::Store(e)) => return Err(ClaimError::Store(e)),
            Err(other) => {
                return Err(ClaimError::Store(StoreError::Corrupt(other.to_string())));
            }
        };
        let decoded = super::payload::decode(self.inner.decoder.as_deref(), delivery).await?;
        let delivery = &*decoded;
        let key = self.inner.key.derive(delivery)?;
        let fingerprint = self.inner.fingerprint.compute(delivery);
        // Without an entity or order, a committed key is still a
        // duplicate (or a conflict, or stale), as in `process` and HTTP;
        // only a new one is rejected.
        let fence = match self.fence_of(delivery) {
            Ok(fence) => fence,
            Err(e) => {
                let req = ClaimRequest {
                    key: key.as_str(),
                    fingerprint: fingerprint.as_ref(),
                    source: delivery.source(),
                    lock_wait: None,
                };
                return match self.committed(&self.inner.scope, &req).await? {
                    Some(claim) => Ok(Claimed::settled(claim, fingerprint)?),
                    None => Err(ClaimError::BadKey(e)),
                };
            }
        };
        if let Some(early) = early {
            early.survived().await;
        }
        let spec = ClaimSpec::new(&key)
            .fingerprint(fingerprint)
            .source(delivery.source())
            .traceparent(traceparent_of(delivery))
            .suspect(delivery.is_suspect())
            .fence(fence.as_ref());
        Ok(self.claim_with(spec).await?)
    }

    /// The entity and order of `delivery` by this engine's
    /// [fence](crate::EngineBuilder::fence), for [`ClaimSpec::fence`]:
    /// `None` without a fence, an error when the delivery has no valid
    /// entity or order (reject it, like a delivery without a key).
    pub fn fence_of(&self, delivery: &Delivery) -> Result<Option<FenceValue>, KeyError> {
        self.inner
            .fence
            .as_ref()
            .map(|fence| fence.derive(delivery))
            .transpose()
    }

    /// Claims `spec`'s key: answered by the cache tier if it knows the key,
    /// otherwise claimed in a new transaction that stays open in the
    /// returned [`Session`] when the key is new. A
    /// [suspect](ClaimSpec::suspect) with a new key is counted first (see
    /// [`Claimed::Crashed`]).
    pub async fn claim_with(&self, spec: ClaimSpec<'_>) -> Result<Claimed<S>, StoreError> {
        let inner = &*self.inner;
        let scope = spec.scope.unwrap_or(&inner.scope);
        let req = ClaimRequest {
            key: spec.key,
            fingerprint: spec.fingerprint.as_ref(),
            source: spec.source,
            lock_wait: spec.lock_wait,
        };
        if let Some(hit) = self.cached_claim(scope, &req).await {
            tracing::debug!("answered from the cache tier");
            return Claimed::settled(hit, spec.fingerprint);
        }
        if let Some(found) = self.looked_up(scope, &spec, &req).await? {
            return Claimed::settled(found, spec.fingerprint);
        }
        if inner.optimistic && !spec.suspect {
            return self.open_optimistic(scope, &spec).await;
        }
        let gate = self.shared_gate().await;
        let opened = self.open_claim(scope, &req).await?;
        inner.recent_duplicates.note(opened.is_err());
        let (tx, times) = match opened {
            Ok(claimed) => claimed,
            Err(claim) => return Claimed::settled(claim, spec.fingerprint),
        };
        if !spec.suspect {
            let claimed = self.session(tx, scope, &spec, times, SessionClaim::Held(None), gate);
            return self.fenced(claimed, &spec).await;
        }
        // A suspect with a new key: count its start alone, with no claim
        // open (see the `crash` module), then claim again.
        self.rollback(tx).await;
        drop(gate);
        let gate = self.exclusive_gate().await;
        let times = ClaimTimes::new(inner.clock.now_ms(), inner.retention);
        let counted = match self.count_start(scope, spec.key, times).await? {
            Start::Counted(counted) => counted,
            Start::Crashed(crashes) => return Ok(Claimed::Crashed { crashes }),
        };
        match self.open_claim(scope, &req).await {
            Ok(Ok((tx, times))) => {
                let claim = SessionClaim::Held(Some(counted));
                let claimed = self.session(tx, scope, &spec, times, claim, gate);
                self.fenced(claimed, &spec).await
            }
            // Taken meanwhile: this start never ran.
            Ok(Err(claim)) => {
                counted.undo().await;
                Claimed::settled(claim, spec.fingerprint)
            }
            Err(e) => {
                counted.undo().await;
                Err(e)
            }
        }
    }

    /// What the look-up before a claim found, if `spec` asks for one (by
    /// default: while duplicates are common, see
    /// [`ClaimSpec::look_up_first`]): the committed, unexpired record's
    /// duplicate or conflict; `None` to claim.
    async fn looked_up(
        &self,
        scope: &str,
        spec: &ClaimSpec<'_>,
        req: &ClaimRequest<'_>,
    ) -> Result<Option<Claim>, StoreError> {
        let inner = &*self.inner;
        let look_up = spec
            .look_up_first
            .unwrap_or_else(|| inner.recent_duplicates.common());
        if !look_up {
            return Ok(None);
        }
        let Some(record) = self.live_record(scope, spec.key).await? else {
            return Ok(None);
        };
        inner.recent_duplicates.note(true);
        Ok(Some(classify_existing(
            record.fingerprint,
            record.result,
            req,
        )))
    }

    /// The key's committed record if it has not expired.
    async fn live_record(&self, scope: &str, key: &str) -> Result<Option<Record>, StoreError> {
        let record = self.inner.store.get(scope, key).await?;
        Ok(record.filter(|r| r.expires_at_ms > self.inner.clock.now_ms()))
    }

    /// An optimistic session: a plain transaction; the claim comes with
    /// the result.
    async fn open_optimistic(
        &self,
        scope: &str,
        spec: &ClaimSpec<'_>,
    ) -> Result<Claimed<S>, StoreError> {
        let inner = &*self.inner;
        let gate = self.shared_gate().await;
        let began = Instant::now();
        let tx = ClaimTx::new(inner.store.begin().await?, began);
        let times = ClaimTimes::new(inner.clock.now_ms(), inner.retention);
        let pending = Pending {
            source: spec.source.map(str::to_owned),
            lock_wait: spec.lock_wait,
        };
        let claimed = self.session(tx, scope, spec, times, SessionClaim::Pending(pending), gate);
        self.fenced(claimed, spec).await
    }

    /// Passes a new session's delivery through its entity's fence (if
    /// `spec` has one) in the session's transaction: the session when the
    /// delivery is not stale (or the fence passes stale deliveries to the
    /// handler, which reads [`Tx::fence`]); otherwise the key is recorded
    /// as stale and committed, and the answer is [`Claimed::Stale`] (an
    /// optimistic session may find its key committed meanwhile instead).
    async fn fenced(
        &self,
        claimed: Claimed<S>,
        spec: &ClaimSpec<'_>,
    ) -> Result<Claimed<S>, StoreError> {
        let (session, value) = match (claimed, spec.fence) {
            (Claimed::New(session), Some(value)) => (session, value),
            (claimed, _) => return Ok(claimed),
        };
        let now_ms = session.times.now_ms;
        let passed = match session.tx.lock().await {
            Ok(mut conn) => {
                let scope = session.tx.origin().scope();
                self.pass_fence(&mut conn, scope, value, now_ms).await
            }
            Err(_) => Err(StoreError::Corrupt(
                "a new session's transaction is gone".into(),
            )),
        };
        let check = match passed {
            Ok(check) => check,
            Err(e) => {
                session.abandon().await;
                return Err(e);
            }
        };
        let stale = check.is_stale().then(|| check.stale());
        session.tx.origin().set_fence(check);
        let Some(stale) = stale else {
            return Ok(Claimed::New(session));
        };
        if self.inner.fence.as_ref().is_some_and(|f| f.passes_stale()) {
            return Ok(Claimed::New(session));
        }
        // A key whose step ran (or started: the process may have died
        // between its call and its record) has its effect outside: never
        // closed as stale without it. Its handler runs (its steps answer
        // from their records, or call again with the same downstream key;
        // `Tx::fence` says the delivery is stale).
        match self
            .has_finished_steps(session.tx.origin().scope(), session.key(), now_ms)
            .await
        {
            Ok(false) => {}
            Ok(true) => {
                tracing::warn!(
                    entity = %stale.entity,
                    "a stale delivery's key has finished steps: running its handler to book them"
                );
                return Ok(Claimed::New(session));
            }
            Err(e) => {
                session.abandon().await;
                return Err(e);
            }
        }
        match session.finish(&stale.recorded()).await {
            Ok(Finished::Committed) => Ok(Claimed::Stale(stale)),
            Ok(Finished::Duplicate { result }) => Ok(Claimed::Duplicate { result }),
            Ok(Finished::Conflict { stored, received }) => {
                Ok(Claimed::Conflict { stored, received })
            }
            Ok(Finished::Stale(stale)) => Ok(Claimed::Stale(stale)),
            Err(Failure::Store(e)) => Err(e),
            Err(Failure::Commit(e)) => Err(StoreError::Database(e)),
            Err(other) => Err(StoreError::Corrupt(format!(
                "recording a stale delivery failed: {other}"
            ))),
        }
    }

    /// Whether `key` has a live [step](crate::Tx::step) in `scope` at
    /// `now_ms`, finished or only started (its call may have taken
    /// effect): a stale delivery of such a key is not closed as stale (its
    /// step's effect happened, or may have, and must be booked). A store
    /// without steps, or without its steps table, has none.
    pub(super) async fn has_finished_steps(
        &self,
        scope: &str,
        key: &str,
        now_ms: i64,
    ) -> Result<bool, StoreError> {
        let store = &self.inner.store;
        if !store.records_steps() {
            return Ok(false);
        }
        match store.steps(scope, key).await {
            Ok(steps) => Ok(steps.iter().any(|s| s.expires_at_ms > now_ms)),
            Err(e) if e.is_missing_table() => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// What the store holds for `key` in `scope` now, for an optimistic
    /// session whose handler failed: a duplicate or conflict if a
    /// concurrent copy committed the key meanwhile (its row may be what
    /// failed this handler), `None` otherwise (or if unreadable now).
    async fn committed_meanwhile(
        &self,
        scope: &str,
        key: &str,
        fingerprint: Option<Fingerprint>,
    ) -> Option<Finished> {
        let record = self.live_record(scope, key).await.ok()??;
        let req = ClaimRequest {
            key,
            fingerprint: fingerprint.as_ref(),
            source: None,
            lock_wait: None,
        };
        let found = classify_existing(record.fingerprint, record.result, &req);
        Finished::taken(found, fingerprint).ok()
    }

    /// Claims `req` in a new transaction (see [`SqlStore::open_claim`]):
    /// the open transaction and its claim times when the key is new, what
    /// the claim found otherwise (the transaction ended).
    async fn open_claim(
        &self,
        scope: &str,
        req: &ClaimRequest<'_>,
    ) -> Result<Opened<S::Db>, StoreError> {
        let inner = &*self.inner;
        let times = ClaimTimes::new(inner.clock.now_ms(), inner.retention);
        let began = Instant::now();
        let opened = inner.store.open_claim(scope, times, req).await?;
        inner.telemetry.claim_time(began.elapsed());
        Ok(opened.map(|tx| (tx, times)))
    }

    fn session(
        &self,
        tx: ClaimTx<S::Db>,
        scope: &str,
        spec: &ClaimSpec<'_>,
        times: ClaimTimes,
        claim: SessionClaim<S>,
        gate: Gate,
    ) -> Claimed<S> {
        let (counted, pending) = match claim {
            SessionClaim::Held(counted) => (counted, None),
            SessionClaim::Pending(pending) => (None, Some(pending)),
        };
        let deadline = self.inner.store.deadlines().transaction_deadline();
        let began = tx.began();
        let origin = Origin::new(scope, spec.key, spec.traceparent, times.now_ms)
            .with_fingerprint(spec.fingerprint);
        let steps = std::sync::Arc::clone(&self.inner.steps);
        Claimed::New(Session {
            engine: self.clone(),
            tx: Tx::new(tx, origin, began, deadline, steps),
            fingerprint: spec.fingerprint,
            times,
            counted,
            pending,
            _gate: gate,
        })
    }

    /// What the cache tier in front of the store knows of `req.key`: a
    /// completed key's claim (duplicate or conflict) without any SQL.
    pub(super) async fn cached_claim(&self, scope: &str, req: &ClaimRequest<'_>) -> Option<Claim> {
        let tier = self.inner.store.tier()?;
        Some(tier.cached(scope, req.key).await?.classify(req))
    }

    /// Commits `tx` (of a batch: begun by sqlx), timing it; bounded by the
    /// statement deadline.
    pub(super) async fn commit(&self, tx: ClaimTx<S::Db>) -> Result<(), StoreError> {
        let started = Instant::now();
        let bound = self.inner.store.deadlines().statement_deadline();
        let committed = tx.commit(bound).await;
        self.inner.telemetry.commit_time(started.elapsed());
        committed
    }

    /// Rolls back `tx` within the statement deadline (or just drops it
    /// when its connection is being discarded).
    pub(super) async fn rollback(&self, tx: ClaimTx<S::Db>) {
        let bound = self.inner.store.deadlines().statement_deadline();
        tx.rollback(bound).await;
    }

    /// Tells the cache tier, if any, of a committed key.
    pub(super) async fn tell_tier(&self, done: &Completed<'_>) {
        if let Some(tier) = self.inner.store.tier() {
            tier.committed(done).await;
        }
    }
}

impl<S: SqlStore> Session<S> {
    /// The claim's open transaction, to work in.
    pub fn tx(&self) -> Tx<S::Db> {
        self.tx.clone()
    }

    /// The claimed key.
    pub fn key(&self) -> &str {
        self.tx.origin().key()
    }

    /// Records `result` with the key, commits the claim with everything
    /// written through [`tx`](Session::tx), and tells the cache tier. A
    /// failed commit is ambiguous (it may have reached the database):
    /// report it as a failure, and a redelivery's claim tells whether it
    /// had committed. An [optimistic](crate::EngineBuilder::optimistic)
    /// session claims the key here, with the result, and may find it
    /// committed meanwhile by another transaction: then everything written
    /// through [`tx`](Session::tx) is rolled back and the answer is
    /// [`Finished::Duplicate`] or [`Finished::Conflict`]. A claim-first
    /// session always ends [`Finished::Committed`] or fails.
    pub async fn finish(mut self, result: &[u8]) -> Result<Finished, Failure> {
        let counted = self.counted.take();
        let finished = self.commit_result(result, counted.is_some()).await;
        if self.pending.is_some()
            && let Ok(end) = &finished
        {
            let taken = *end != Finished::Committed;
            self.engine.inner.recent_duplicates.note(taken);
        }
        if let Some(counted) = counted {
            match finished {
                Ok(Finished::Committed) => counted.finished(),
                // The handler returned: not a crash.
                _ => counted.undo().await,
            }
        }
        finished
    }

    /// Records the result (an optimistic session: claims the key with
    /// it), deletes a suspect's attempts counter, commits.
    async fn commit_result(&self, result: &[u8], counted: bool) -> Result<Finished, Failure> {
        let engine = &self.engine;
        let Some(tx) = self.tx.take(Tx::<S::Db>::RETURN_TIMEOUT).await else {
            return Err(Failure::TxHeld);
        };
        let origin = self.tx.origin();
        let (scope, key) = (origin.scope(), origin.key());
        match &self.pending {
            None => {
                let started = Instant::now();
                let finished = engine
                    .inner
                    .store
                    .finish_claim(tx, scope, key, result, counted)
                    .await;
                engine.inner.telemetry.commit_time(started.elapsed());
                finished.map_err(ending_failure)?;
            }
            Some(pending) => {
                if let Some(taken) = self.claim_completed(tx, pending, result).await? {
                    return Ok(taken);
                }
            }
        }
        engine
            .tell_tier(&Completed {
                scope,
                key,
                fingerprint: self.fingerprint.as_ref(),
                result,
                now_ms: self.times.now_ms,
                expires_at_ms: self.times.expires_at_ms,
            })
            .await;
        Ok(Finished::Committed)
    }

    /// An optimistic session's claim with its result, then `COMMIT`:
    /// `None` when committed, what the claim found when the key was taken
    /// meanwhile (rolled back).
    async fn claim_completed(
        &self,
        mut tx: ClaimTx<S::Db>,
        pending: &Pending,
        result: &[u8],
    ) -> Result<Option<Finished>, Failure> {
        let engine = &self.engine;
        let origin = self.tx.origin();
        let req = ClaimRequest {
            key: origin.key(),
            fingerprint: self.fingerprint.as_ref(),
            source: pending.source.as_deref(),
            lock_wait: pending.lock_wait,
        };
        let started = Instant::now();
        let claim = engine
            .inner
            .store
            .claim_completed(&mut tx, origin.scope(), self.times, &req, result)
            .await;
        engine.inner.telemetry.claim_time(started.elapsed());
        match claim {
            Ok(Claim::Claimed) => {}
            Ok(found) => {
                engine.rollback(tx).await;
                let taken = Finished::taken(found, self.fingerprint).map_err(Failure::Store)?;
                return Ok(Some(taken));
            }
            Err(e) => {
                engine.rollback(tx).await;
                return Err(ending_failure(e));
            }
        }
        engine.commit(tx).await.map_err(ending_failure)?;
        Ok(None)
    }

    /// Rolls the claim and everything written through
    /// [`tx`](Session::tx) back: the key stays free for a redelivery.
    pub async fn abandon(mut self) {
        if let Some(tx) = self.tx.take(Tx::<S::Db>::RETURN_TIMEOUT).await {
            self.engine.rollback(tx).await;
        }
        if let Some(counted) = self.counted.take() {
            counted.undo().await;
        }
    }

    /// [`abandon`](Session::abandon)s a session whose work failed, then,
    /// for an [optimistic](crate::EngineBuilder::optimistic) session,
    /// reads whether a concurrent copy committed the key meanwhile (its
    /// row may be what failed this one's writes): `Some` duplicate or
    /// conflict if so, to be answered as such instead of the failure.
    /// Claim-first sessions held the key: always `None`.
    pub async fn abandon_failed(self) -> Option<Finished> {
        let check = self.pending.is_some().then(|| {
            let origin = self.tx.origin();
            (
                origin.scope().to_owned(),
                origin.key().to_owned(),
                self.fingerprint,
            )
        });
        let engine = self.engine.clone();
        self.abandon().await;
        let (scope, key, fingerprint) = check?;
        let taken = engine.committed_meanwhile(&scope, &key, fingerprint).await;
        if taken.is_some() {
            engine.inner.recent_duplicates.note(true);
        }
        taken
    }
}

/// A store error as a claim's transaction ends (recording the result,
/// `COMMIT`): the message's own writes refused (a deferred constraint or
/// trigger, a transaction the handler left aborted) are the message's
/// fault, anything else the store's.
pub(super) fn ending_failure(e: StoreError) -> Failure {
    match e {
        StoreError::Database(e) if is_write_fault(&e) => Failure::Commit(e),
        e => Failure::Store(e),
    }
}

/// `d` in whole milliseconds, saturating.
pub(crate) fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// The W3C `traceparent` header of a delivery, if it has a readable one.
pub(crate) fn traceparent_of(delivery: &Delivery) -> Option<&str> {
    delivery
        .metadata("traceparent")
        .and_then(|v| std::str::from_utf8(v).ok())
}
