//! One delivery, start to finish: process, then reply, retry later or
//! dead-letter (each publish confirmed), and only then ack.

use std::sync::Arc;
use std::time::Duration;

use lapin::options::BasicAckOptions;
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::headers;
use super::message::{header_text, set_int, set_text, to_delivery};
use super::publish::{Confirms, copy_properties};
use super::stats::AmqpCounters;
use super::topology::Topology;
use crate::broker::bump;
use crate::broker::pause::{Breaker, Step};
use crate::broker::shutdown::{outage_backoff, sleep_unless};
use crate::broker::wait::{InfraWait, Waits};
use crate::clock::{Clock, SystemClock};
use crate::engine::{Decision, Engine, Handler, Outcome};
use crate::store::SqlStore;

/// What every delivery task of a consumer shares.
pub(crate) struct Env<S: SqlStore, H> {
    pub(crate) engine: Engine<S>,
    pub(crate) handler: H,
    pub(crate) topology: Topology,
    pub(crate) counters: AmqpCounters,
    /// The deliveries waiting for the infrastructure.
    pub(crate) waits: Arc<Waits>,
    /// The channel's publishes: one at a time, each bounded.
    pub(crate) publishing: Confirms,
    /// Pauses the consumer while its handler keeps failing.
    pub(crate) breaker: Breaker,
}

/// What to publish before the ack.
enum Next {
    /// The RPC reply (the result's JSON, or why there is none) and whether
    /// it is a replay.
    Reply(Result<Vec<u8>, &'static str>, bool),
    /// The retry queue and the failure's reason code.
    Retry(String, &'static str),
    DeadLetter {
        reason: &'static str,
        error: String,
        attempts: u32,
    },
}

/// Handles one delivery in its `onceonly.delivery` span. Returns without
/// acking when the consumer stops or the channel dies first: the broker
/// then redelivers the message.
pub(crate) async fn handle<S, H>(
    env: &Env<S, H>,
    channel: &Channel,
    message: lapin::message::Delivery,
    stop: &CancellationToken,
) where
    S: SqlStore,
    H: Handler<S::Db>,
{
    let delivery = to_delivery(&env.topology.queue, &message);
    let span = env.engine.delivery_span(&delivery);
    handle_in_span(env, channel, message, &delivery, stop)
        .instrument(span)
        .await;
}

async fn handle_in_span<S, H>(
    env: &Env<S, H>,
    channel: &Channel,
    message: lapin::message::Delivery,
    delivery: &crate::Delivery,
    stop: &CancellationToken,
) where
    S: SqlStore,
    H: Handler<S::Db>,
{
    let first_seen = u64::try_from(SystemClock.now_ms()).unwrap_or(0);
    let props = &message.properties;
    let prior: u32 = header_text(props.headers().as_ref(), headers::ATTEMPTS)
        .and_then(|t| t.parse().ok())
        .unwrap_or(0);
    let mut attempt = prior.saturating_add(1);
    let (report, decision) = {
        let mut outage = InfraWait::new(&env.waits);
        loop {
            // Nothing starts while the consumer is paused (see
            // `PausePolicy`).
            let Some(mut pass) = env.breaker.admit(stop).await else {
                return;
            };
            if !channel.status().connected() {
                return;
            }
            let report = env.engine.process_in_span(&env.handler, delivery).await;
            let policy = env.engine.retry_policy();
            match env
                .breaker
                .step(&mut pass, &report.outcome, attempt, policy)
            {
                Step::Held => {
                    // Failed while the consumer is paused: runs again once
                    // it is admitted, not counted as an attempt; its
                    // failures were most likely the outage's, so its
                    // retries start over.
                    tracing::debug!(queue = %env.topology.queue, "held while the consumer is paused");
                    attempt = 1;
                }
                Step::Again(delay) => {
                    // Out of retries before the breaker could tell an
                    // outage from this message's own failure: try again.
                    if !sleep_unless(stop, delay).await || !channel.status().connected() {
                        return;
                    }
                }
                Step::Decided(Decision::Wait(fault)) => {
                    let error = report.outcome.error_text().unwrap_or_default();
                    if !outage.wait(stop, fault, &error).await || !channel.status().connected() {
                        return;
                    }
                }
                Step::Decided(decision) => break (report, decision),
            }
        }
    };
    let next = match (decision, &report.outcome) {
        (Decision::Ack, Outcome::Processed { result }) => {
            bump(&env.counters.consumer.processed);
            Next::Reply(reply_body(Some(result)), false)
        }
        (Decision::Ack, Outcome::Duplicate { result }) => {
            bump(&env.counters.consumer.duplicates);
            Next::Reply(reply_body(result.as_ref()), true)
        }
        // Older than its entity's state: acknowledged, never
        // dead-lettered; an RPC caller is told so.
        (Decision::Ack, Outcome::Stale(_)) => {
            bump(&env.counters.consumer.stale);
            Next::Reply(Err("stale"), true)
        }
        (Decision::Retry { reason, .. }, _) => match env.topology.retry_queue(attempt) {
            Some(queue) => Next::Retry(queue.name.clone(), reason),
            None => dead_letter(&report.outcome, attempt),
        },
        (
            Decision::DeadLetter {
                reason,
                error,
                attempts,
            },
            _,
        ) => Next::DeadLetter {
            reason,
            error,
            attempts,
        },
        // `decide` acks only processed, duplicate and stale outcomes, and
        // waits were handled above.
        (_, outcome) => dead_letter(outcome, attempt),
    };
    let key = report.key.as_ref().map(|k| k.as_str());
    let published = match next {
        Next::Reply(body, replayed) => {
            if let Some(reply_to) = props.reply_to() {
                reply(env, channel, reply_to.as_str(), props, body, replayed).await;
            }
            true
        }
        Next::Retry(queue, reason) => {
            let mut h = carried_headers(props.headers().as_ref(), &message, first_seen);
            set_int(&mut h, headers::ATTEMPTS, i64::from(attempt));
            let ok = publish_until_confirmed(
                env,
                channel,
                stop,
                "",
                &queue,
                &message.data,
                copy_properties(props, h),
            )
            .await;
            if ok {
                bump(&env.counters.consumer.retried);
                env.engine.telemetry().retried(reason);
                tracing::debug!(attempt, queue = %queue, "retry scheduled");
            }
            ok
        }
        Next::DeadLetter {
            reason,
            error,
            attempts,
        } => {
            let mut h = carried_headers(props.headers().as_ref(), &message, first_seen);
            set_text(&mut h, headers::REASON, reason);
            set_text(&mut h, headers::ERROR, &error);
            set_int(&mut h, headers::ATTEMPTS, i64::from(attempts));
            set_text(&mut h, headers::QUEUE, &env.topology.queue);
            set_text(&mut h, headers::SCOPE, env.engine.scope());
            if let Some(key) = key {
                set_text(&mut h, headers::IDEMPOTENCY_KEY, key);
            }
            let target = &env.topology.dead_letter;
            let ok = publish_until_confirmed(
                env,
                channel,
                stop,
                &target.exchange,
                &target.routing_key,
                &message.data,
                copy_properties(props, h),
            )
            .await;
            if ok {
                bump(&env.counters.consumer.dead_lettered);
                env.engine.telemetry().dead_lettered(reason);
                tracing::warn!(queue = %env.topology.queue, reason, error = %error, "message dead-lettered");
            }
            ok
        }
    };
    if !published {
        return;
    }
    match message.acker.ack(BasicAckOptions::default()).await {
        Ok(true) => bump(&env.counters.consumer.acked),
        Ok(false) => {
            bump(&env.counters.acks_lost);
            tracing::warn!(queue = %env.topology.queue, "ack not sent: the channel is gone; the broker redelivers and dedup absorbs it");
        }
        Err(e) => {
            bump(&env.counters.acks_lost);
            tracing::warn!(queue = %env.topology.queue, error = %e, "ack failed; the broker redelivers and dedup absorbs it");
        }
    }
}

/// The JSON of an RPC reply: the result, or, for a duplicate whose stored
/// result no longer decodes as the handler's output type, why not.
fn reply_body<T: serde::Serialize>(result: Option<&T>) -> Result<Vec<u8>, &'static str> {
    match result {
        Some(result) => serde_json::to_vec(result).map_err(|_| "result_unserializable"),
        None => Err("stored_result_unreadable"),
    }
}

fn dead_letter<T>(outcome: &Outcome<T>, attempts: u32) -> Next {
    Next::DeadLetter {
        reason: outcome.reason().unwrap_or("handler_error"),
        error: outcome.error_text().unwrap_or_default(),
        attempts,
    }
}

/// The message's headers, plus where it was first published to and when it
/// was first seen (both kept from an earlier retry if there was one).
fn carried_headers(
    original: Option<&FieldTable>,
    message: &lapin::message::Delivery,
    first_seen: u64,
) -> FieldTable {
    let mut h = original.cloned().unwrap_or_default();
    // The trace context of the delivery that sends the copy (feature
    // `otel`), which replaces the one the message carried.
    #[cfg(feature = "otel")]
    {
        let context = crate::otel::current();
        if !context.is_empty() {
            let kept: std::collections::BTreeMap<_, _> = h
                .inner()
                .iter()
                .filter(|(name, _)| !crate::otel::names(&context, name.as_str()))
                .map(|(name, value)| (name.clone(), value.clone()))
                .collect();
            h = FieldTable::from(kept);
            for (name, value) in &context {
                set_text(&mut h, name, value);
            }
        }
    }
    if header_text(Some(&h), headers::ORIGINAL_ROUTING_KEY).is_none() {
        set_text(
            &mut h,
            headers::ORIGINAL_EXCHANGE,
            message.exchange.as_str(),
        );
        set_text(
            &mut h,
            headers::ORIGINAL_ROUTING_KEY,
            message.routing_key.as_str(),
        );
    }
    if header_text(Some(&h), headers::FIRST_SEEN).is_none() {
        set_int(
            &mut h,
            headers::FIRST_SEEN,
            i64::try_from(first_seen).unwrap_or(i64::MAX),
        );
    }
    h
}

/// Publishes the RPC reply. Best effort: the effect is committed either
/// way, and a client that missed the reply can ask again and gets the
/// stored result. A duplicate whose stored result cannot be replayed still
/// gets a reply, an error one (`x-onceonly-error`), so the caller never
/// waits for nothing.
async fn reply<S: SqlStore, H>(
    env: &Env<S, H>,
    channel: &Channel,
    reply_to: &str,
    request: &BasicProperties,
    body: Result<Vec<u8>, &'static str>,
    replayed: bool,
) {
    let mut props = BasicProperties::default().with_content_type("application/json".into());
    if let Some(id) = request.correlation_id() {
        props = props.with_correlation_id(id.clone());
    }
    let mut h = FieldTable::default();
    set_text(
        &mut h,
        "x-onceonly-replayed",
        if replayed { "true" } else { "false" },
    );
    let body = match body {
        Ok(body) => body,
        Err(code) => {
            set_text(&mut h, "x-onceonly-error", code);
            serde_json::json!({
                "error": code,
                "detail": "the message was already processed, but its stored result cannot be replayed",
            })
            .to_string()
            .into_bytes()
        }
    };
    props = props.with_headers(h);
    match env
        .publishing
        .publish(channel, "", reply_to, &body, props)
        .await
    {
        Ok(()) => bump(&env.counters.replies),
        Err(e) => tracing::warn!(reply_to, error = %e, "RPC reply not delivered"),
    }
}

/// Publishes until confirmed; `false` if the consumer stopped or the
/// channel died first (the message stays unacked and is redelivered).
async fn publish_until_confirmed<S: SqlStore, H>(
    env: &Env<S, H>,
    channel: &Channel,
    stop: &CancellationToken,
    exchange: &str,
    routing_key: &str,
    body: &[u8],
    props: BasicProperties,
) -> bool {
    let mut backoff = outage_backoff();
    loop {
        let sent = tokio::select! {
            biased;
            () = stop.cancelled() => return false,
            sent = env.publishing.publish(channel, exchange, routing_key, body, props.clone()) => sent,
        };
        match sent {
            Ok(()) => return true,
            Err(e) => {
                tracing::error!(queue = %env.topology.queue, error = %e, "publish failed; the message stays unacked");
                let delay = backoff.next().unwrap_or(Duration::from_secs(10));
                if !channel.status().connected() || !sleep_unless(stop, delay).await {
                    return false;
                }
            }
        }
    }
}
