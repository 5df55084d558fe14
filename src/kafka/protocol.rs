//! The consumer group protocol: the classic one, or KIP-848's
//! (`group.protocol=consumer`, GA in the librdkafka the crate bundles),
//! and the settings each refuses.

/// Which consumer group protocol a [`KafkaConsumer`](super::KafkaConsumer)
/// joins its group with (see
/// [`KafkaConsumerBuilder::group_protocol`](super::KafkaConsumerBuilder::group_protocol)).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum GroupProtocol {
    /// The classic protocol: the members assign partitions among
    /// themselves (`partition.assignment.strategy`), and the session and
    /// heartbeat timings are the client's.
    #[default]
    Classic,
    /// KIP-848 (`group.protocol=consumer`, Kafka 4.0 brokers): the broker
    /// assigns partitions, incrementally, and owns the session timeout,
    /// the heartbeat interval and the assignors
    /// (`group.consumer.session.timeout.ms`,
    /// `group.consumer.heartbeat.interval.ms`, `group.consumer.assignors`
    /// on the broker); `group.remote.assignor` picks one of the broker's.
    Consumer,
}

impl GroupProtocol {
    /// The `group.protocol` value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Classic => "classic",
            Self::Consumer => "consumer",
        }
    }
}

/// Client settings the broker owns under KIP-848, and where they went.
const BROKER_OWNED: [(&str, &str); 3] = [
    (
        "partition.assignment.strategy",
        "the broker assigns partitions (its group.consumer.assignors; pick one with group.remote.assignor)",
    ),
    (
        "session.timeout.ms",
        "the broker's group.consumer.session.timeout.ms applies",
    ),
    (
        "heartbeat.interval.ms",
        "the broker's group.consumer.heartbeat.interval.ms applies",
    ),
];

/// The protocol the consumer runs with: `chosen` on the builder, or the
/// `group.protocol` among `settings` (the last one wins), which must
/// agree; and the settings checked against it. The error names the
/// setting and why.
pub(super) fn resolve(
    chosen: Option<GroupProtocol>,
    settings: &[(String, String)],
) -> Result<GroupProtocol, String> {
    let set = |key: &str| {
        settings
            .iter()
            .rev()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v)
    };
    let configured = match set("group.protocol") {
        None => None,
        Some(v) if v.eq_ignore_ascii_case("classic") => Some(GroupProtocol::Classic),
        Some(v) if v.eq_ignore_ascii_case("consumer") => Some(GroupProtocol::Consumer),
        Some(v) => {
            return Err(format!(
                "group.protocol={v} is neither classic nor consumer"
            ));
        }
    };
    let protocol = match (chosen, configured) {
        (Some(a), Some(b)) if a != b => {
            return Err(format!(
                "group_protocol({}) and group.protocol={} disagree",
                a.as_str(),
                b.as_str()
            ));
        }
        (Some(p), _) | (None, Some(p)) => p,
        (None, None) => GroupProtocol::Classic,
    };
    match protocol {
        GroupProtocol::Consumer => {
            for (key, why) in BROKER_OWNED {
                if set(key).is_some() {
                    return Err(format!(
                        "{key} cannot be set with group.protocol=consumer (KIP-848): {why}"
                    ));
                }
            }
        }
        GroupProtocol::Classic => {
            if set("group.remote.assignor").is_some() {
                return Err(
                    "group.remote.assignor needs group.protocol=consumer (KIP-848)".to_owned(),
                );
            }
        }
    }
    Ok(protocol)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn the_consumer_protocol_refuses_what_the_broker_owns() {
        for key in [
            "partition.assignment.strategy",
            "session.timeout.ms",
            "heartbeat.interval.ms",
        ] {
            let err = resolve(Some(GroupProtocol::Consumer), &settings(&[(key, "1")])).unwrap_err();
            assert!(err.starts_with(key), "{err}");
            let err = resolve(
                None,
                &settings(&[("group.protocol", "consumer"), (key, "1")]),
            )
            .unwrap_err();
            assert!(err.contains("KIP-848"), "{err}");
        }
        assert_eq!(
            resolve(
                Some(GroupProtocol::Consumer),
                &settings(&[("group.remote.assignor", "uniform")])
            ),
            Ok(GroupProtocol::Consumer)
        );
    }

    #[test]
    fn the_classic_protocol_stays_the_default_and_keeps_its_settings() {
        assert_eq!(resolve(None, &[]), Ok(GroupProtocol::Classic));
        assert_eq!(
            resolve(None, &settings(&[("session.timeout.ms", "6000")])),
            Ok(GroupProtocol::Classic)
        );
        assert!(resolve(None, &settings(&[("group.remote.assignor", "uniform")])).is_err());
    }

    #[test]
    fn the_builder_and_the_settings_must_agree() {
        let consumer = settings(&[("group.protocol", "CONSUMER")]);
        assert_eq!(resolve(None, &consumer), Ok(GroupProtocol::Consumer));
        assert!(resolve(Some(GroupProtocol::Classic), &consumer).is_err());
        assert!(resolve(None, &settings(&[("group.protocol", "eager")])).is_err());
    }
}
