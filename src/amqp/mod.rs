//! AMQP 0-9-1 transport (feature `amqp`): a RabbitMQ consumer whose messages
//! take effect exactly once, over [lapin](https://docs.rs/lapin).
//!
//! # Guarantee
//!
//! For every message, the key claim and the handler's writes commit in one SQL
//! transaction, and the message is acked only after that transaction
//! committed, after its key was found already committed (a duplicate: the
//! handler does not run), or after its retry copy or dead letter was
//! confirmed by the broker (publisher confirms, `mandatory`). A crash or a
//! lost connection at any point leaves the message unacked, the broker
//! redelivers it, and dedup turns the redelivery into a duplicate if it had
//! committed. Acks are never sent twice; an ack that cannot reach the broker
//! (lapin's `Ok(false)`: the channel is gone) is counted in
//! [`ConsumerStats::acks_lost`] and logged.
//!
//! # Topology
//!
//! With the default [`QueueKind::Classic`] (or [`QueueKind::Quorum`]) the
//! consumer declares, durable and idempotently:
//! - the work queue `Q` (a quorum queue gets `x-dead-letter-exchange` /
//!   `-routing-key` pointing at the dead-letter target, so messages over its
//!   delivery limit are dead-lettered rather than dropped);
//! - one retry queue per retry delay, `Q.retry.<ms>ms`, with that TTL and
//!   dead-lettering back to `Q`: a retry waits there and never blocks `Q`;
//! - the dead-letter queue `Q.dlq` (or [`dead_letter_queue`] /
//!   [`dead_letter_exchange`]).
//!
//! # Outcomes
//!
//! What happens is decided by [`decide`](crate::engine::decide), once for
//! every transport; this consumer only translates it.
//!
//! | outcome                         | what happens                                  |
//! |---------------------------------|-----------------------------------------------|
//! | processed, duplicate            | RPC reply if `reply_to` is set (for a duplicate whose stored result no longer decodes: an error reply with `x-onceonly-error`), then ack |
//! | retryable handler error, panic (handler, key function, `FromDelivery`), the message's writes refused at COMMIT (deferred constraint, constraint trigger, a transaction the handler left aborted) | copy to the retry queue with `x-onceonly-attempts`, confirmed, then ack; once the policy is exhausted: dead letter (`handler_error`) |
//! | permanent error                 | dead letter (`handler_error`)                  |
//! | key reused with another payload | dead letter (`fingerprint_mismatch`)           |
//! | no key, undecodable body (key not committed) | dead letter (`bad_key`, `decode_error`) |
//! | infrastructure fault: unreachable, read-only, missing table or column, permission, out of resources, shutdown, statement timeout, contention, corrupt dedup store (see [`InfraFault`](crate::store::InfraFault)) | waits in place with jittered backoff until the database takes writes again; never dead-lettered, never acked meanwhile |
//! | data exception on a value of the message in the dedup store | dead letter (`store_error`) |
//! | a panic in onceonly's own code | the message is nacked with requeue, never left holding a prefetch slot |
//! | the handler kills the process (abort, out of memory, segfault) on a message, every time | after [`max_crashes`] counted crashes (default 3), the next consumer dead-letters it (`crashed`) without running it, then acks it |
//!
//! A message the broker delivered before (`redelivered`, or a quorum
//! queue's `x-delivery-count` above 0) may be one whose handler killed the
//! previous consumer: it is a [suspect](crate::Delivery::with_suspect). If
//! its key is new, the engine counts the start of its handler durably and
//! runs it alone (no other message of this consumer is handled meanwhile,
//! so a crash is never blamed on a bystander); once it crashed the process
//! [`max_crashes`] times it is dead-lettered (`crashed`). Its first
//! delivery is not `redelivered`, so its first crash is not counted: it
//! kills the process at most `max_crashes + 1` times.//!
//! Dead letters keep body and properties and add the [`headers`]:
//! `x-onceonly-reason`, `-error`, `-attempts`, `-original-exchange`,
//! `-original-routing-key`, `-queue`, `-scope`, `-first-seen` and
//! `-idempotency-key` (when a key was derived).
//!
//! # RPC
//!
//! When a message has `reply_to`, the handler's result (for a duplicate: the
//! stored result of the first run) is published there as JSON with the same
//! `correlation_id` and `x-onceonly-replayed: true|false`, before the ack.
//!
//! # Recovery and shutdown
//!
//! When the connection drops or RabbitMQ restarts, the consumer reconnects
//! with backoff ([`reconnect_backoff`]) and carries on; messages that were
//! unacked come back and dedupe. [`AmqpConsumer::run`] stops on SIGINT or
//! SIGTERM, [`AmqpConsumer::run_until`] on a cancellation token: cancel the
//! consumer, finish the messages in progress and ack them, close.
//!
//! [`dead_letter_queue`]: AmqpConsumerBuilder::dead_letter_queue
//! [`dead_letter_exchange`]: AmqpConsumerBuilder::dead_letter_exchange
//! [`reconnect_backoff`]: AmqpConsumerBuilder::reconnect_backoff
//! [`max_crashes`]: AmqpConsumerBuilder::max_crashes

mod builder;
mod connect;
mod consumer;
mod error;
pub mod headers;
pub(crate) mod message;
pub(crate) mod pipeline;
pub(crate) mod publish;
mod topology;
mod worker;

pub use crate::consumer_stats::ConsumerStats;
pub use builder::AmqpConsumerBuilder;
pub use connect::{AmqpTls, connect};
pub use consumer::AmqpConsumer;
pub use error::AmqpConsumerError;
pub use tokio_util::sync::CancellationToken;
pub use topology::QueueKind;
