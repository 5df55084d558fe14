//! Crash safety of the AMQP example, `amqp_orders`, run as a child process
//! and killed with SIGKILL while it works, then restarted until the queue is
//! drained: every key charged exactly once, nothing left in the queue,
//! nothing unacked.

use std::time::{Duration, Instant};

use onceonly_integration_tests::amqp::{Msg, connect, declare_queue, depth, publish, url};
use onceonly_integration_tests::child::Logged;
use onceonly_integration_tests::kafka::pg_schema;
use onceonly_integration_tests::ledger::{assert_exact, crash_stream, rows};
use onceonly_integration_tests::unique;
use sqlx::PgPool;
use tokio::process::Child;

const DISTINCT: usize = 4_800;
const KILLS: usize = 6;

struct Run {
    queue: String,
    url: String,
    child: Logged,
}

impl Run {
    fn spawn(&self, prefetch: u16, exit_when_idle: Option<u64>) -> Child {
        let mut args: Vec<String> = vec![
            "--amqp-url".into(),
            url(),
            "--queue".into(),
            self.queue.clone(),
            "--database-url".into(),
            self.url.clone(),
            "--prefetch".into(),
            prefetch.to_string(),
        ];
        if let Some(secs) = exit_when_idle {
            args.extend(["--exit-when-idle".to_owned(), secs.to_string()]);
        }
        self.child.spawn("amqp_orders", &args)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_at_random_moments_loses_and_doubles_nothing() {
    let queue = unique("acrash");
    let url = pg_schema("acrash").await;
    let pool = PgPool::connect(&url).await.expect("postgres");
    let (_conn, channel) = connect().await;
    declare_queue(&channel, &queue).await;

    let stream = crash_stream("M", DISTINCT);
    assert!(stream.messages.len() >= 5_000 && stream.duplicates() * 5 >= stream.messages.len());
    let messages: Vec<Msg> = stream
        .messages
        .iter()
        .map(|(_, body)| Msg::new(body.clone()))
        .collect();
    publish(&channel, &queue, &messages).await;

    let run = Run {
        queue,
        url,
        child: Logged::new("amqp_orders"),
    };
    let mut rng = fastrand::Rng::new();
    let deadline = Instant::now() + Duration::from_secs(300);
    for kill in 1..=KILLS {
        let before = rows(&pool).await;
        let prefetch = if kill % 2 == 0 { 8 } else { 64 };
        let child = run.spawn(prefetch, None);
        run.child
            .kill_after_progress(
                child,
                async || rows(&pool).await > before,
                deadline,
                Duration::from_millis(400),
                &mut rng,
            )
            .await;
        eprintln!(
            "kill {kill}: ledger rows {} (prefetch {prefetch})",
            rows(&pool).await
        );
    }
    let before_final = rows(&pool).await;
    assert!(
        (before_final as usize) < DISTINCT,
        "the kills must land before the backlog is drained ({before_final} rows)"
    );

    run.child
        .finishes(run.spawn(32, Some(3)), Duration::from_secs(240))
        .await;

    assert_exact(&pool, &stream.expected).await;
    // The final consumer closed its channel, so anything unacked would be
    // back in the queue: empty means nothing is left and nothing unacked.
    assert_eq!(depth(&channel, &run.queue).await, 0, "queue empty");
    assert_eq!(
        depth(&channel, &format!("{}.dlq", run.queue)).await,
        0,
        "nothing dead-lettered"
    );
}
