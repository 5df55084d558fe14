//! The dedup retention against what the brokers can still deliver: Kafka
//! topics' `retention.ms`, and the oldest letter of an AMQP dead-letter
//! queue.

use std::time::Duration;

use super::finding::Finding;

/// `d` for people: `7d`, `36h`, `90s`.
fn human(d: Duration) -> String {
    humantime::format_duration(Duration::from_secs(d.as_secs())).to_string()
}

/// Compares the dedup retention with each topic's `retention.ms`.
#[cfg(feature = "kafka")]
pub async fn kafka(
    brokers: &str,
    config: &[(String, String)],
    topics: &[String],
    retention: Duration,
) -> Vec<Finding> {
    use rdkafka::admin::{AdminClient, AdminOptions, ResourceSpecifier};
    use rdkafka::client::DefaultClientContext;
    use rdkafka::config::ClientConfig;

    let mut cc = ClientConfig::new();
    cc.set("bootstrap.servers", brokers);
    for (k, v) in config {
        cc.set(k, v);
    }
    let admin: AdminClient<DefaultClientContext> = match cc.create() {
        Ok(a) => a,
        Err(e) => {
            return vec![Finding::fail(
                "kafka",
                e.to_string(),
                "check --kafka-brokers and -X",
            )];
        }
    };
    let specs: Vec<ResourceSpecifier<'_>> =
        topics.iter().map(|t| ResourceSpecifier::Topic(t)).collect();
    let options = AdminOptions::new().request_timeout(Some(Duration::from_secs(10)));
    let answer = tokio::time::timeout(
        Duration::from_secs(15),
        admin.describe_configs(specs.iter(), &options),
    )
    .await;
    let results = match answer {
        Ok(Ok(results)) => results,
        Ok(Err(e)) => {
            return vec![Finding::fail(
                "kafka",
                format!("cannot read the topics' configuration: {e}"),
                "check --kafka-brokers, -X and the DescribeConfigs ACL",
            )];
        }
        Err(_) => {
            return vec![Finding::fail(
                "kafka",
                format!("{brokers} did not answer within 15 s"),
                "check --kafka-brokers and the network",
            )];
        }
    };
    topics
        .iter()
        .zip(results)
        .map(|(topic, result)| match result {
            Ok(resource) => {
                let ms = resource
                    .get("retention.ms")
                    .and_then(|e| e.value.as_deref())
                    .and_then(|v| v.parse::<i64>().ok());
                topic_finding(topic, ms, retention)
            }
            Err(e) => Finding::fail(
                "kafka",
                format!("topic {topic}: {e}"),
                "check the topic name and the DescribeConfigs ACL",
            ),
        })
        .collect()
}

/// The finding on one topic keeping records `retention_ms` (-1: for ever).
#[cfg(feature = "kafka")]
pub fn topic_finding(topic: &str, retention_ms: Option<i64>, dedup: Duration) -> Finding {
    let dedup_ms = i64::try_from(dedup.as_millis()).unwrap_or(i64::MAX);
    match retention_ms {
        Some(ms) if ms >= 0 && ms <= dedup_ms => Finding::ok(
            "retention",
            format!(
                "topic {topic} keeps records {}, within the dedup retention {}",
                human(Duration::from_millis(ms.unsigned_abs())),
                human(dedup)
            ),
        ),
        Some(ms) => {
            let kept = if ms < 0 {
                "for ever".to_owned()
            } else {
                human(Duration::from_millis(ms.unsigned_abs()))
            };
            Finding::warn(
                "retention",
                format!(
                    "topic {topic} keeps records {kept}, longer than the dedup retention {}: a \
                     record read again after {} (offset reset, replay) runs its handler again",
                    human(dedup),
                    human(dedup)
                ),
                format!(
                    "raise the engine's .retention(..) above the topic's, or lower the topic's \
                     retention.ms to at most {dedup_ms}"
                ),
            )
        }
        None => Finding::warn(
            "retention",
            format!("topic {topic} reports no retention.ms"),
            "check the topic's configuration",
        ),
    }
}

/// Compares the dedup retention with the age of the oldest letter in each
/// dead-letter queue (read with `basic.get`, requeued: nothing is consumed).
#[cfg(feature = "amqp")]
pub async fn amqp(
    url: &str,
    tls: &onceonly::amqp::AmqpTls,
    queues: &[String],
    retention: Duration,
) -> Vec<Finding> {
    use lapin::options::{BasicGetOptions, QueueDeclareOptions};
    use lapin::types::FieldTable;

    let connect = tokio::time::timeout(
        Duration::from_secs(15),
        onceonly::ops::admin::amqp_connect(url, tls),
    )
    .await;
    let conn = match connect {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => return vec![Finding::fail("amqp", e.to_string(), "check --amqp-url")],
        Err(_) => {
            return vec![Finding::fail(
                "amqp",
                "the broker did not answer within 15 s",
                "check --amqp-url and the network",
            )];
        }
    };
    let mut out = Vec::new();
    for queue in queues {
        // A channel per queue: closing it requeues the letter looked at.
        let finding = async {
            let channel = conn.create_channel().await?;
            let passive = QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            };
            let declared = channel
                .queue_declare(queue.as_str().into(), passive, FieldTable::default())
                .await?;
            let first = channel
                .basic_get(queue.as_str().into(), BasicGetOptions::default())
                .await?;
            let first_seen = first.as_ref().and_then(|m| {
                let props = &m.delivery.properties;
                let h = props.headers().as_ref();
                let header = h
                    .and_then(|h| h.inner().get(onceonly::Header::FirstSeen.name()))
                    .and_then(|v| match v {
                        lapin::types::AMQPValue::LongString(s) => {
                            std::str::from_utf8(s.as_bytes()).ok()?.parse::<i64>().ok()
                        }
                        lapin::types::AMQPValue::LongLongInt(n) => Some(*n),
                        _ => None,
                    });
                header.or_else(|| {
                    props
                        .timestamp()
                        .and_then(|s| i64::try_from(s).ok())
                        .map(|s| s.saturating_mul(1000))
                })
            });
            let _ = channel.close(200, "onceonly doctor".into()).await;
            Ok::<_, lapin::Error>(queue_finding(
                queue,
                declared.message_count(),
                first_seen,
                retention,
            ))
        }
        .await;
        out.push(finding.unwrap_or_else(|e| {
            Finding::fail(
                "amqp",
                format!("queue {queue}: {e}"),
                "check the queue name (--dlq) and the user's permissions",
            )
        }));
    }
    let _ = conn.close(200, "onceonly doctor".into()).await;
    out
}

/// The finding on a dead-letter queue of `depth` letters whose oldest was
/// first seen at `first_seen_ms`.
#[cfg(feature = "amqp")]
pub fn queue_finding(
    queue: &str,
    depth: u32,
    first_seen_ms: Option<i64>,
    retention: Duration,
) -> Finding {
    let Some(first_seen) = first_seen_ms else {
        return Finding::ok(
            "retention",
            format!("queue {queue}: {depth} letters, none dated"),
        );
    };
    let age_ms = (crate::time::now_ms() - first_seen).max(0);
    let age = Duration::from_millis(age_ms.unsigned_abs());
    if age > retention {
        Finding::warn(
            "retention",
            format!(
                "queue {queue}: the oldest of {depth} letters is {} old, older than the dedup \
                 retention {}: its record may be gone, so a replay refuses it",
                human(age),
                human(retention)
            ),
            format!(
                "replay or discard it sooner (onceonly dlq groups amqp --queue {queue}); \
                 onceonly replay --beyond-retention if you know its key was never processed"
            ),
        )
    } else {
        Finding::ok(
            "retention",
            format!(
                "queue {queue}: the oldest of {depth} letters is {} old, within the dedup \
                 retention {}",
                human(age),
                human(retention)
            ),
        )
    }
}

#[cfg(all(test, feature = "kafka"))]
mod tests {
    use super::super::finding::Status;
    use super::*;

    #[test]
    fn topics_keeping_records_longer_than_the_dedup_window_warn() {
        let week = Duration::from_secs(7 * 86_400);
        assert_eq!(
            topic_finding("t", Some(86_400_000), week).status,
            Status::Ok
        );
        assert_eq!(
            topic_finding("t", Some(30 * 86_400_000), week).status,
            Status::Warn
        );
        assert_eq!(topic_finding("t", Some(-1), week).status, Status::Warn);
    }
}
