//! A librdkafka mock cluster as a process, for running the examples (or the
//! benchmark) against a broker with faithful consumer-group semantics:
//!
//! ```text
//! cargo run -p onceonly-integration-tests --bin mock_kafka -- 3 payments:6 payments.dlt:1
//! ```
//!
//! The first argument is the number of brokers; the others are topics as
//! `name:partitions`. Prints `bootstrap=<servers>` on one line, then runs
//! until its standard input closes (or it is killed).

use std::io::{BufRead, Write};

use onceonly_integration_tests::mock::MockKafka;

fn main() {
    let mut args = std::env::args().skip(1);
    let brokers = args
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| usage("the first argument is the number of brokers"));
    let kafka = MockKafka::start(brokers);
    for topic in args {
        let (name, partitions) = topic
            .rsplit_once(':')
            .and_then(|(n, p)| Some((n, p.parse().ok()?)))
            .unwrap_or_else(|| usage(&format!("topic {topic:?} is not name:partitions")));
        kafka.create_topic(name, partitions);
    }
    let mut out = std::io::stdout();
    let _ = writeln!(out, "bootstrap={}", kafka.bootstrap());
    let _ = out.flush();
    // Lives until stdin closes: the parent owns its lifetime.
    for line in std::io::stdin().lock().lines() {
        if line.is_err() {
            break;
        }
    }
}

fn usage(why: &str) -> ! {
    eprintln!("mock_kafka: {why}\nusage: mock_kafka BROKERS [TOPIC:PARTITIONS]...");
    std::process::exit(2)
}
