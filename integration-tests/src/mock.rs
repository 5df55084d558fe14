//! librdkafka's mock cluster, for the tests that need faithful consumer-group
//! semantics or injected broker faults.
//!
//! tansu 0.6.0 (the broker of `scripts/services`) never expires a member
//! that died without leaving the group: a member that joins after a SIGKILL
//! gets an empty assignment for good. The mock cluster built into the
//! vendored librdkafka expires members after their session timeout, moves
//! group coordinators, and injects request errors, broker outages and
//! latency. Its brokers listen on real loopback sockets, so example processes
//! can connect to it as to any broker.

use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::mocking::{MockCluster, MockCoordinator};
use rdkafka::producer::{BaseProducer, DefaultProducerContext, Producer};
use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};

/// A mock Kafka cluster living as long as this value. Not `Send`: keep it
/// on the test's own task.
pub struct MockKafka {
    cluster: Cluster,
    bootstrap: String,
}

/// Who owns the mock cluster.
enum Cluster {
    /// rdkafka's own handle.
    Owned(MockCluster<'static, DefaultProducerContext>),
    /// A producer created with `test.mock.num.brokers`, whose cluster
    /// librdkafka's settings (KIP-848 session timeout) can be reached on.
    Producer(BaseProducer),
}

impl MockKafka {
    /// Starts a cluster of `brokers` brokers (ids `1..=brokers`).
    pub fn start(brokers: i32) -> Self {
        let cluster = MockCluster::new(brokers).expect("librdkafka mock cluster");
        let bootstrap = cluster.bootstrap_servers();
        Self {
            cluster: Cluster::Owned(cluster),
            bootstrap,
        }
    }

    /// Starts a cluster of `brokers` brokers whose KIP-848 consumer groups
    /// (`group.protocol=consumer`) expire a member that stopped
    /// heartbeating after `session` (the broker's
    /// `group.consumer.session.timeout.ms`; the mock's default is 30 s),
    /// heartbeating every `session / 10`.
    pub fn start_kip848(brokers: i32, session: Duration) -> Self {
        let producer: BaseProducer = ClientConfig::new()
            .set("test.mock.num.brokers", brokers.to_string())
            .create()
            .expect("librdkafka mock cluster");
        let native = producer.client().native_ptr();
        let session_ms = i32::try_from(session.as_millis()).expect("session in ms");
        // SAFETY: `native` is the live handle of `producer`, which owns the
        // mock cluster and outlives these calls; librdkafka returns null
        // when the handle has no mock cluster, checked before use.
        unsafe {
            let cluster = rdkafka::bindings::rd_kafka_handle_mock_cluster(native);
            assert!(!cluster.is_null(), "the producer has no mock cluster");
            rdkafka::bindings::rd_kafka_mock_set_group_consumer_session_timeout_ms(
                cluster, session_ms,
            );
            rdkafka::bindings::rd_kafka_mock_set_group_consumer_heartbeat_interval_ms(
                cluster,
                (session_ms / 10).max(100),
            );
        }
        let bootstrap = producer
            .client()
            .mock_cluster()
            .expect("mock cluster")
            .bootstrap_servers();
        Self {
            cluster: Cluster::Producer(producer),
            bootstrap,
        }
    }

    /// Runs `f` on the cluster's handle.
    fn with<R>(&self, f: impl FnOnce(&MockCluster<'_, DefaultProducerContext>) -> R) -> R {
        match &self.cluster {
            Cluster::Owned(cluster) => f(cluster),
            Cluster::Producer(producer) => {
                f(&producer.client().mock_cluster().expect("mock cluster"))
            }
        }
    }

    /// The `bootstrap.servers` list.
    pub fn bootstrap(&self) -> &str {
        &self.bootstrap
    }

    /// Creates `topic` with `partitions` partitions, replication factor 1.
    pub fn create_topic(&self, topic: &str, partitions: i32) {
        self.with(|c| c.create_topic(topic, partitions, 1))
            .expect("mock topic");
    }

    /// Fails the next `n` requests of `api` with `error`.
    pub fn fail_requests(&self, api: RDKafkaApiKey, error: RDKafkaRespErr, n: usize) {
        self.with(|c| c.request_errors(api, &vec![error; n]));
    }

    /// Takes broker `id` down (connections closed, new ones refused).
    pub fn broker_down(&self, id: i32) {
        self.with(|c| c.broker_down(id)).expect("broker down");
    }

    /// Brings broker `id` back.
    pub fn broker_up(&self, id: i32) {
        self.with(|c| c.broker_up(id)).expect("broker up");
    }

    /// Delays every response of broker `id` by `rtt`.
    pub fn round_trip_time(&self, id: i32, rtt: Duration) {
        self.with(|c| c.broker_round_trip_time(id, rtt))
            .expect("round trip time");
    }

    /// Makes broker `id` the coordinator of `group`.
    pub fn move_coordinator(&self, group: &str, id: i32) {
        self.with(|c| c.coordinator(MockCoordinator::Group(group.to_owned()), id))
            .expect("coordinator");
    }
}
