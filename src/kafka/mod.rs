//! Kafka transport (feature `kafka`): a consumer-group member whose records
//! take effect exactly once, over rdkafka's vendored librdkafka.
//!
//! # Guarantee
//!
//! For every record, the key claim and the handler's writes commit in one SQL
//! transaction; the record's offset is committed to Kafka only after that
//! transaction committed, after its key was found already committed (a
//! duplicate: the handler does not run), or after the dead-letter topic
//! acknowledged it (`acks=all`). Per partition, the committed offset is the
//! first record that is not final: a record still running, retrying or
//! abandoned holds it back, whatever finished after it. A crash at any point
//! therefore loses nothing (unfinished records are redelivered) and doubles
//! nothing (redelivered records are duplicates). Auto-commit and auto offset
//! store are forced off.
//!
//! # Flow
//!
//! One thread polls librdkafka and dispatches records; each assigned
//! partition gets one tokio task per lane ([`key_concurrency`], default one:
//! strict partition order). Partitions run in parallel. Each assigned
//! partition is read from its own librdkafka queue (split from the main
//! queue on every assignment), and a partition with [`max_in_flight`]
//! unfinished records is simply not read until its lanes catch up: its
//! records wait in librdkafka, whose prefetch is bounded per partition
//! (`queued.max.messages.kbytes`, 16 MiB here), so memory stays bounded
//! whatever the backlog, and nothing is paused, dropped or fetched again.
//! The polling thread sleeps until a queue becomes non-empty or a worker
//! finishes a record. Records that reach the main queue before their
//! partition's queue is split are handed out first, in order, with the
//! former pause-at-the-bound as the fallback.
//!
//! With [`batch_size`] above one, a lane claims up to that many records in one
//! transaction through the store's batch claim (duplicates, also within the
//! batch, are skipped); if anything in the batch fails it is rolled back and
//! redone record by record, each settled (retried, dead-lettered) before the
//! next starts, so one poison record neither blocks nor doubles the others
//! and order is kept.
//!
//! A dead letter is published before its offset is committed: a crash in
//! between publishes it again on redelivery (dead letters are at least once;
//! effects stay exactly once, and replaying both copies dedupes).
//!
//! # Failures
//!
//! What happens is decided by [`decide`](crate::engine::decide), once for
//! every transport; this consumer only translates it.
//!
//! | outcome                        | what happens                                         |
//! |--------------------------------|------------------------------------------------------|
//! | processed, duplicate           | offset committed                                     |
//! | retryable handler error, panic (handler, key function, `FromDelivery`), the message's writes refused at COMMIT (deferred constraint, constraint trigger, a transaction the handler left aborted) | retried per [`retry`] (the lane waits: order is kept), then dead-lettered (`handler_error`) |
//! | permanent handler error        | dead-lettered (`handler_error`)                      |
//! | key reused, other payload      | dead-lettered (`fingerprint_mismatch`)               |
//! | no key, undecodable payload (key not committed) | dead-lettered (`bad_key`, `decode_error`) |
//! | infrastructure fault: unreachable, read-only, missing table or column, permission, out of resources, shutdown, statement timeout, contention, corrupt dedup store (see [`InfraFault`](crate::store::InfraFault)), in the claim or the handler's own queries | the record waits in place with jittered backoff until the database takes writes again; never dead-lettered, the offset never moves past it |
//! | data exception on a value of the message in the dedup store | dead-lettered (`store_error`) |
//! | dead-letter publish fails      | retried; the offset is not committed meanwhile        |
//! | revoke or shutdown while a record runs longer than [`drain_timeout`] | the record is abandoned: its transaction rolls back, its offset stays uncommitted, the next owner processes it |
//! | the handler kills the process (abort, out of memory, segfault) on a record, every time | after [`max_crashes`] counted crashes (default 3), the next owner dead-letters it (`crashed`) without running it, and the partition moves on (see below) |
//!
//! Dead letters go to `<topic>.dlt` (or [`dead_letter_topic`]) with the
//! original payload, record key and headers, plus the headers in
//! [`headers`].
//!
//! # A record that kills the process
//!
//! A lane processes its records in order, so after an assignment the record
//! that was running when the former owner died comes first among the
//! records whose key is not committed yet (the ones before it are
//! duplicates). Each lane's records are therefore
//! [suspects](crate::Delivery::with_suspect) from the assignment until one
//! of them is processed: they go one by one (no batch), and for the first
//! whose key is new the engine counts the start of its handler durably and
//! runs it alone (see [`max_crashes`]). Once a record has crashed the
//! process `max_crashes` times it is dead-lettered with reason `crashed`.
//! Its first crash, when it was not a suspect yet, is not counted: it kills
//! the process at most `max_crashes + 1` times. Records that were
//! dead-lettered do not end a lane's suspicion (a dead letter is not in the
//! database, and its offset may not have been committed before a crash).
//!
//! With [`batch_size`] above one, a crash rolls back the whole batch it hit,
//! the records before the killer with it. A partition that runs batches is
//! therefore marked in the attempts table while it does (one statement per
//! assignment, one per clean end); a new owner that finds the mark (the
//! former owner died with batches in flight) keeps each lane suspect until
//! it processed `batch_size` records, so the killer is counted wherever it
//! sat in its batch, and the bound of `max_crashes + 1` deaths holds. After
//! a clean handoff the lanes trust the partition after one record, as
//! without batches.
//!
//! # Rebalances and shutdown
//!
//! On revoke, the revoked partitions' lanes stop taking records, records in
//! progress finish (for at most [`drain_timeout`]; what still runs then is
//! aborted and rolled back), and their offsets are committed synchronously
//! before the revoke returns; nothing of theirs runs afterwards. If the assignment was
//! *lost* (session timeout), nothing is committed: another member may own the
//! partitions already, and dedup absorbs the redelivery. [`KafkaConsumer::run`]
//! shuts down the same way on SIGINT/SIGTERM, [`KafkaConsumer::run_until`] on a
//! cancellation token, then leaves the group.
//!
//! # Observability
//!
//! Each record runs in a `onceonly.delivery` span (retries and dead letter
//! included) and is counted with `transport="kafka"`; the consumer lag per
//! partition is the gauge `onceonly_kafka_consumer_lag`, from librdkafka's
//! statistics every [`statistics_interval`] (see [`crate::telemetry`]).
//!
//! [`statistics_interval`]: KafkaConsumerBuilder::statistics_interval
//! [`key_concurrency`]: KafkaConsumerBuilder::key_concurrency
//! [`max_in_flight`]: KafkaConsumerBuilder::max_in_flight
//! [`batch_size`]: KafkaConsumerBuilder::batch_size
//! [`retry`]: KafkaConsumerBuilder::retry
//! [`dead_letter_topic`]: KafkaConsumerBuilder::dead_letter_topic
//! [`drain_timeout`]: KafkaConsumerBuilder::drain_timeout
//! [`max_crashes`]: KafkaConsumerBuilder::max_crashes

mod batch_mark;
mod builder;
mod consumer;
mod context;
mod dead_letter;
mod error;
mod message;
mod offsets;
mod partition;
mod worker;

pub use crate::consumer_stats::ConsumerStats;
pub use builder::{DEFAULT_DRAIN_TIMEOUT, DEFAULT_STATISTICS_INTERVAL, KafkaConsumerBuilder};
pub use consumer::KafkaConsumer;
pub use dead_letter::headers;
pub use error::KafkaConsumerError;
pub use tokio_util::sync::CancellationToken;
