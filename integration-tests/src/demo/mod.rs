//! The demo applications' shared code (`examples/kafka_payments.rs`,
//! `amqp_orders.rs`, `payment_webhook.rs` of this package), also used by
//! the tests: the payments ledger, the HTTP app, the Prometheus endpoint,
//! the outbox drain and the logs and traces setup.

pub mod ledger;
pub mod metrics;
pub mod relay;
pub mod tracing_setup;
pub mod webhook_app;
