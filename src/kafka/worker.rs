//! One lane of one partition: takes records in order, processes them alone
//! or in batches, retries, dead-letters, and marks each final offset.

use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::FutureExt;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, Span};

use rdkafka::Message;
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::time::Instant;

use super::dead_letter::{DeadLetter, DeadLetterer, header_text, headers};
use super::message::Envelope;
use super::partition::Partition;
use crate::broker::pause::{Breaker, Pass, Step};
use crate::broker::shutdown::{outage_backoff, sleep_unless};
use crate::broker::wait::{InfraWait, Waits};
use crate::broker::{Counters, bump};
use crate::clock::{Clock, SystemClock};
use crate::engine::Telemetry;
use crate::engine::{Decision, Engine, Handler, OutcomeKind, Report};
use crate::store::SqlStore;
use crate::sync::lock;

/// What every worker of a consumer shares.
pub(crate) struct Env<S: SqlStore, H> {
    pub(crate) engine: Engine<S>,
    pub(crate) handler: H,
    pub(crate) dead_letters: DeadLetterer,
    pub(crate) batch_size: usize,
    pub(crate) linger: Duration,
    /// Cancelled to stop the whole consumer.
    pub(crate) shutdown: CancellationToken,
    /// Why the consumer stopped on its own, if it did.
    pub(crate) failure: Mutex<Option<String>>,
    /// What it did, returned by `run`.
    pub(crate) counters: Counters,
    /// The deliveries waiting for the infrastructure.
    pub(crate) waits: Arc<Waits>,
    /// Pauses the consumer while its handler keeps failing.
    pub(crate) breaker: Arc<Breaker>,
}

impl<S: SqlStore, H> Env<S, H> {
    /// Stops the consumer with an error.
    pub(crate) fn fatal(&self, why: String) {
        lock(&self.failure).get_or_insert(why);
        self.shutdown.cancel();
    }
}

/// Runs one lane until its queue closes or its partition stops.
///
/// A lane starts with an assignment, and its first records are
/// [suspects](crate::Delivery::with_suspect): the lane processes its
/// records in order, so the record that was running when a former owner
/// died comes first among the records whose key is not committed yet
/// (those before it are duplicates now). Until a record of the lane is
/// processed (committed), every record is marked suspect and processed on
/// its own, never in a batch; the engine counts the start of the first one
/// whose key is new and parks it once it crashed the process too often.
/// Records that were dead-lettered do not end suspicion: a dead letter is
/// not recorded in the database, and its offset may not have been committed
/// before the next crash, so it may come first again. A lane that takes
/// batches may stay suspect longer (see [`batch_mark`](super::batch_mark)).
pub(crate) async fn run_lane<S, H>(
    env: Arc<Env<S, H>>,
    partition: Arc<Partition>,
    rx: UnboundedReceiver<Envelope>,
) where
    S: SqlStore,
    H: Handler<S::Db>,
{
    lane(&env, &partition, rx).await;
    // Nothing of this lane is in flight any more.
    if env.batch_size > 1 {
        partition.batches.lane_ended(&env.engine).await;
    }
}

/// Whether a lane's records are still suspects, and how many it processed
/// since the assignment.
#[derive(Default)]
struct Suspicion {
    trusted: bool,
    processed: usize,
}

async fn lane<S, H>(env: &Env<S, H>, partition: &Partition, mut rx: UnboundedReceiver<Envelope>)
where
    S: SqlStore,
    H: Handler<S::Db>,
{
    let mut suspicion = Suspicion::default();
    loop {
        let first = tokio::select! {
            biased;
            () = partition.stop.cancelled() => return,
            next = rx.recv() => match next {
                Some(envelope) => envelope,
                None => return,
            },
        };
        let mut batch = vec![first];
        // A suspect lane takes one record at a time: it goes record by
        // record anyway, and a batch gathered now would still go record by
        // record after its first one committed.
        if env.batch_size > 1 && suspicion.trusted {
            let now = Instant::now();
            let deadline = now.checked_add(env.linger).unwrap_or(now);
            while batch.len() < env.batch_size {
                let next = match rx.try_recv() {
                    Ok(envelope) => Some(envelope),
                    Err(_) => tokio::select! {
                        biased;
                        () = partition.stop.cancelled() => None,
                        () = tokio::time::sleep_until(deadline) => None,
                        next = rx.recv() => next,
                    },
                };
                match next {
                    Some(envelope) => batch.push(envelope),
                    None => break,
                }
            }
        }
        if partition.stop.is_cancelled() {
            // Revoked or shutting down: nothing new starts.
            return;
        }
        // Handler panics are caught by the engine; anything else panicking
        // here (a user `FromDelivery`, a key function) would leave records
        // in flight forever. Fail the whole consumer loudly instead.
        let work = AssertUnwindSafe(process(env, partition, batch, &mut suspicion)).catch_unwind();
        if let Err(panic) = work.await {
            let what = panic_text(panic.as_ref());
            tracing::error!(topic = %partition.topic, partition = partition.partition, panic = %what, "partition worker panicked; stopping the consumer");
            env.fatal(format!(
                "worker of {}/{} panicked: {what}",
                partition.topic, partition.partition
            ));
            return;
        }
    }
}

fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".to_owned())
}

/// Processes `batch` in order; `suspicion`: whether the lane still waits
/// for its first processed records since the assignment (see [`run_lane`]).
async fn process<S, H>(
    env: &Env<S, H>,
    partition: &Partition,
    batch: Vec<Envelope>,
    suspicion: &mut Suspicion,
) where
    S: SqlStore,
    H: Handler<S::Db>,
{
    // Copies in the retry topic wait until they are due (non-blocking
    // retries); a stop meanwhile leaves them uncommitted.
    let due = batch
        .iter()
        .filter(|e| env.dead_letters.is_retry_copy(&e.message))
        .filter_map(|e| header_text(&e.message, headers::DUE)?.parse::<u64>().ok())
        .max();
    if let Some(due) = due {
        let now = u64::try_from(SystemClock.now_ms()).unwrap_or(0);
        if due > now && !sleep_unless(&partition.stop, Duration::from_millis(due - now)).await {
            return;
        }
    }
    // Nothing starts while the consumer is paused (see `PausePolicy`).
    let Some(first_pass) = env.breaker.admit(&partition.stop).await else {
        return;
    };
    let mut gate = Some(first_pass);
    let mut deliveries: Vec<_> = batch.iter().map(Envelope::delivery).collect();
    // A suspect lane goes record by record (marked as they come, below),
    // and so does a probe.
    let probing = gate.as_ref().is_some_and(Pass::is_probe);
    let batched = if deliveries.len() > 1 && suspicion.trusted && !probing {
        partition.batches.renew(&env.engine).await;
        env.engine
            .try_process_batch(&env.handler, &deliveries)
            .await
    } else {
        None
    };
    if batched.is_some() {
        // The batch ran under the first pass; each record redone on its
        // own is admitted anew (the consumer may have paused meanwhile).
        gate = None;
    }
    let mut reports = batched.map(Vec::into_iter);
    let mut stopped = false;
    let telemetry = env.engine.telemetry();
    for (envelope, delivery) in batch.iter().zip(deliveries.iter_mut()) {
        if !suspicion.trusted {
            *delivery = std::mem::take(delivery).with_suspect(true);
        }
        let delivery = &*delivery;
        let batched = reports.as_mut().and_then(Iterator::next);
        let settled = match batched {
            // Committed in the batch, which counted it and traced it in
            // its own span: nothing left to do.
            Some(report) if report.outcome.is_done() => {
                env.breaker.observe(&report.outcome);
                env.counters.settled(report.outcome.kind());
                Some(report.outcome.kind())
            }
            None if stopped => return,
            batched => {
                let pass = match gate.take() {
                    Some(pass) => Some(pass),
                    None if stopped => None,
                    None => env.breaker.admit(&partition.stop).await,
                };
                let Some(pass) = pass else {
                    // Stopped while paused: this record and the rest stay
                    // uncommitted (those committed in the batch still
                    // count, above).
                    stopped = true;
                    continue;
                };
                // One span per record, over its processing, retries and
                // dead letter.
                let span = env.engine.delivery_span(delivery);
                async {
                    // Without a committed batch, each record is processed
                    // and settled before the next one starts: partition (or
                    // key) order holds even when a record is retried.
                    let report = match batched {
                        Some(report) => {
                            // Counted by the batch; only the span learns of it.
                            let current = Span::current();
                            if let Some(key) = &report.key {
                                telemetry.record_key(&current, key.as_str());
                            }
                            Telemetry::record_outcome(&current, report.outcome.kind());
                            report
                        }
                        None => env.engine.process_in_span(&env.handler, delivery).await,
                    };
                    // (Once the partition stopped, the records of this batch
                    // not committed in it were abandoned above: they stay
                    // uncommitted and are redelivered to the next owner.)
                    settle(env, partition, envelope, delivery, report, pass).await
                }
                .instrument(span)
                .await
            }
        };
        match settled {
            Some(kind) => {
                if kind == OutcomeKind::Processed && !suspicion.trusted {
                    suspicion.processed += 1;
                    suspicion.trusted = trusted(env, partition, suspicion.processed).await;
                }
                bump(&env.counters.acked);
                partition.finish(envelope.offset());
            }
            None => stopped = true,
        }
    }
}

/// Whether a suspect lane that processed `processed` records since the
/// assignment may trust its records now: after one without batches; with
/// batches, after as many as the partition's [`BatchMark`] says.
///
/// [`BatchMark`]: super::batch_mark::BatchMark
async fn trusted<S: SqlStore, H>(env: &Env<S, H>, partition: &Partition, processed: usize) -> bool {
    if env.batch_size <= 1 {
        return true;
    }
    let window = partition.batches.window(&env.engine, env.batch_size).await;
    let trusted = window.is_some_and(|window| processed >= window);
    if trusted {
        partition.batches.lane_trusted();
    }
    trusted
}

/// Drives one record to a final outcome, doing what
/// [`decide`](crate::engine::decide) says, unless the consumer's breaker
/// holds it (its attempt under `pass` failed while the consumer is
/// paused: it runs again once the breaker admits it, not counted as an
/// attempt). The kind of its last outcome once it is final (processed,
/// duplicate, or dead-letter or retry copy acknowledged); `None` if the
/// partition stopped first.
async fn settle<S, H>(
    env: &Env<S, H>,
    partition: &Partition,
    envelope: &Envelope,
    delivery: &crate::Delivery,
    mut report: Report<H::Output>,
    mut pass: Pass<'_>,
) -> Option<OutcomeKind>
where
    S: SqlStore,
    H: Handler<S::Db>,
{
    // A copy in the retry topic carries the attempts made before it.
    let mut attempts: u32 = if env.dead_letters.is_retry_copy(&envelope.message) {
        header_text(&envelope.message, headers::ATTEMPTS)
            .and_then(|a| a.parse::<u32>().ok())
            .unwrap_or(0)
            .saturating_add(1)
    } else {
        1
    };
    let mut outage = InfraWait::new(&env.waits);
    loop {
        let policy = env.engine.retry_policy();
        match env
            .breaker
            .step(&mut pass, &report.outcome, attempts, policy)
        {
            Step::Held => {
                tracing::debug!(
                    topic = %partition.topic,
                    partition = partition.partition,
                    offset = envelope.offset(),
                    "held while the consumer is paused"
                );
                // Its failures were most likely the outage's: its retries
                // start over when it runs again.
                attempts = 1;
            }
            Step::Again(delay) => {
                // Out of retries before the breaker could tell an outage
                // from this record's own failure: try again.
                tracing::debug!(
                    attempts,
                    ?delay,
                    "retries ran out before the pause policy could judge; trying again"
                );
                if !sleep_unless(&partition.stop, delay).await {
                    return None;
                }
            }
            Step::Decided(Decision::Ack) => {
                env.counters.settled(report.outcome.kind());
                return Some(report.outcome.kind());
            }
            Step::Decided(Decision::Wait(fault)) => {
                let error = report.outcome.error_text().unwrap_or_default();
                tracing::debug!(topic = %partition.topic, partition = partition.partition, offset = envelope.offset(), %fault, %error, "waiting for the database");
                if !outage.wait(&partition.stop, fault, &error).await {
                    return None;
                }
            }
            Step::Decided(Decision::Retry { delay, reason })
                if env.dead_letters.retry_topic().is_some() =>
            {
                // Non-blocking: a copy waits in the retry topic, the
                // partition moves on.
                let due = u64::try_from(SystemClock.now_ms())
                    .unwrap_or(0)
                    .saturating_add(u64::try_from(delay.as_millis()).unwrap_or(u64::MAX));
                let sent = republish(partition, "retry copy", || {
                    env.dead_letters.publish_retry(envelope, attempts, due)
                })
                .await;
                if sent {
                    bump(&env.counters.retried);
                    env.engine.telemetry().retried(reason);
                    tracing::debug!(attempts, ?delay, reason, "retry copy published");
                }
                return sent.then_some(report.outcome.kind());
            }
            Step::Decided(Decision::Retry { delay, reason }) => {
                bump(&env.counters.retried);
                env.engine.telemetry().retried(reason);
                tracing::debug!(attempts, ?delay, reason, "retrying the record");
                if !sleep_unless(&partition.stop, delay).await {
                    return None;
                }
                attempts += 1;
            }
            Step::Decided(Decision::DeadLetter {
                reason,
                error,
                attempts,
            }) => {
                let letter = DeadLetter {
                    reason,
                    error,
                    attempts,
                    key: report.key.as_ref().map(|k| k.as_str()),
                };
                let sent = publish(env, partition, envelope, &letter).await;
                return sent.then_some(report.outcome.kind());
            }
        }
        pass = env.breaker.admit(&partition.stop).await?;
        report = env.engine.process_in_span(&env.handler, delivery).await;
    }
}

/// Publishes a dead letter until acknowledged; `false` if the partition
/// stopped first.
async fn publish<S: SqlStore, H>(
    env: &Env<S, H>,
    partition: &Partition,
    envelope: &Envelope,
    letter: &DeadLetter<'_>,
) -> bool {
    let sent = republish(partition, "dead letter", || {
        env.dead_letters.publish(envelope, letter)
    })
    .await;
    if sent {
        bump(&env.counters.dead_lettered);
        env.engine.telemetry().dead_lettered(letter.reason);
        tracing::warn!(
            topic = %partition.topic,
            partition = partition.partition,
            offset = envelope.message.offset(),
            reason = letter.reason,
            error = %letter.error,
            "record dead-lettered"
        );
    }
    sent
}

/// Runs `send` until the broker acknowledges it, backing off between
/// failures; `false` if the partition stopped first (the record stays
/// uncommitted).
async fn republish<F, Fut>(partition: &Partition, what: &str, mut send: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(), super::KafkaConsumerError>>,
{
    let mut backoff = outage_backoff();
    loop {
        match send().await {
            Ok(()) => return true,
            Err(e) => {
                tracing::error!(error = %e, what, "publish failed; the record stays uncommitted and is retried");
                let delay = backoff.next().unwrap_or(Duration::from_secs(10));
                if !sleep_unless(&partition.stop, delay).await {
                    return false;
                }
            }
        }
    }
}
