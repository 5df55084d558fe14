//! librdkafka's mock cluster as the bench's Kafka broker (`--kafka-mock`):
//! a broker in this process, so that the numbers show onceonly's cost where
//! the broker is not the bound. The cluster lives on a thread of its own
//! (it is not `Send`); topics are created through this handle, since the
//! mock cluster does not serve the admin API.

use std::sync::mpsc::{Sender, channel};

use rdkafka::mocking::MockCluster;

use super::common::Res;

type Request = (String, i32, Sender<Result<(), String>>);

/// A handle to the mock cluster's thread.
#[derive(Debug)]
pub struct MockBroker {
    requests: std::sync::Mutex<Sender<Request>>,
    /// Its `bootstrap.servers`.
    pub bootstrap: String,
}

impl MockBroker {
    /// Starts a one-broker cluster that lives as long as the process.
    pub fn start() -> Res<Self> {
        let (requests, serve) = channel::<Request>();
        let (started, bootstrap) = channel();
        std::thread::Builder::new()
            .name("mock-kafka".into())
            .spawn(move || {
                let cluster = match MockCluster::new(1) {
                    Ok(c) => c,
                    Err(e) => {
                        let _ = started.send(Err(e.to_string()));
                        return;
                    }
                };
                let _ = started.send(Ok(cluster.bootstrap_servers()));
                for (topic, partitions, reply) in serve {
                    let done = cluster
                        .create_topic(&topic, partitions, 1)
                        .map_err(|e| format!("creating mock topic {topic}: {e}"));
                    let _ = reply.send(done);
                }
            })?;
        let bootstrap = bootstrap.recv()??;
        Ok(Self {
            requests: std::sync::Mutex::new(requests),
            bootstrap,
        })
    }

    /// Creates `topic` with `partitions` partitions.
    pub fn create_topic(&self, topic: &str, partitions: i32) -> Res<()> {
        let (reply, done) = channel();
        self.requests
            .lock()
            .map_err(|_| "mock cluster handle poisoned")?
            .send((topic.to_owned(), partitions, reply))
            .map_err(|_| "mock cluster thread gone")?;
        Ok(done.recv().map_err(|_| "mock cluster thread gone")??)
    }
}
