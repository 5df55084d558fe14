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

use rdkafka::mocking::{MockCluster, MockCoordinator};
use rdkafka::producer::DefaultProducerContext;
use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};

/// A mock Kafka cluster living as long as this value. Not `Send`: keep it
/// on the test's own task.
pub struct MockKafka {
    cluster: MockCluster<'static, DefaultProducerContext>,
    bootstrap: String,
}

impl MockKafka {
    /// Starts a cluster of `brokers` brokers (ids `1..=brokers`).
    pub fn start(brokers: i32) -> Self {
        let cluster = MockCluster::new(brokers).expect("librdkafka mock cluster");
        let bootstrap = cluster.bootstrap_servers();
        Self { cluster, bootstrap }
    }

    /// The `bootstrap.servers` list.
    pub fn bootstrap(&self) -> &str {
        &self.bootstrap
    }

    /// Creates `topic` with `partitions` partitions, replication factor 1.
    pub fn create_topic(&self, topic: &str, partitions: i32) {
        self.cluster
            .create_topic(topic, partitions, 1)
            .expect("mock topic");
    }

    /// Fails the next `n` requests of `api` with `error`.
    pub fn fail_requests(&self, api: RDKafkaApiKey, error: RDKafkaRespErr, n: usize) {
        self.cluster.request_errors(api, &vec![error; n]);
    }

    /// Takes broker `id` down (connections closed, new ones refused).
    pub fn broker_down(&self, id: i32) {
        self.cluster.broker_down(id).expect("broker down");
    }

    /// Brings broker `id` back.
    pub fn broker_up(&self, id: i32) {
        self.cluster.broker_up(id).expect("broker up");
    }

    /// Delays every response of broker `id` by `rtt`.
    pub fn round_trip_time(&self, id: i32, rtt: Duration) {
        self.cluster
            .broker_round_trip_time(id, rtt)
            .expect("round trip time");
    }

    /// Makes broker `id` the coordinator of `group`.
    pub fn move_coordinator(&self, group: &str, id: i32) {
        self.cluster
            .coordinator(MockCoordinator::Group(group.to_owned()), id)
            .expect("coordinator");
    }
}
