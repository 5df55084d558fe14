//! The shipped alert rules and Grafana dashboard (`deploy/`), tested for
//! real: `promtool check rules` and `promtool test rules` (a unit test per
//! alert), every metric a panel or rule names is one the code records, every
//! panel's PromQL parses, and a real Prometheus on loopback scrapes the
//! `amqp_orders` example while its PostgreSQL database turns read-only, until
//! `OnceonlyWaitingOnInfrastructure` is `firing` in Prometheus's API.
//!
//! The e2e test runs the shipped rules with one change: the waiting alert's
//! `for: 2m` becomes `for: 5s` (templated here), so it fires within seconds:
//! not before its `for` has passed since it went pending, and no later than
//! that plus an evaluation and a scrape interval (and the test's polling).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::{Duration, Instant};

use onceonly_integration_tests::amqp::{Msg, connect, declare_queue, publish, url};
use onceonly_integration_tests::child::Logged;
use onceonly_integration_tests::ledger::rows;
use onceonly_integration_tests::own_db::OwnDb;
use onceonly_integration_tests::prometheus::{Prometheus, deploy_dir, promtool};
use onceonly_integration_tests::{free_port, pay};
use sqlx::PgPool;

const RULES: &str = "prometheus/onceonly.rules.yml";
const RULE_TESTS: &str = "prometheus/onceonly.rules.test.yml";
const DASHBOARD: &str = "grafana/onceonly.json";
const WAITING_ALERT: &str = "OnceonlyWaitingOnInfrastructure";

/// The e2e test's Prometheus: how often it scrapes and evaluates the
/// rules, and the waiting alert's shortened `for` (whole seconds, as the
/// config is written from them).
const SCRAPE_INTERVAL: Duration = Duration::from_secs(1);
const EVALUATION_INTERVAL: Duration = Duration::from_secs(1);
const WAITING_FOR: Duration = Duration::from_secs(5);
/// How often the e2e test asks Prometheus for the alert's state.
const POLL: Duration = Duration::from_millis(250);

/// The metrics of RabbitMQ's own Prometheus plugin (`rabbitmq_prometheus`,
/// per-object) that the AMQP queue alerts read: recorded by RabbitMQ, not by
/// onceonly, so the check that rules name only metrics the code records
/// leaves exactly these out (and fails on any other `rabbitmq_*` name).
const RABBITMQ_PROMETHEUS_METRICS: &[&str] = &[
    "rabbitmq_channel_messages_acked_total",
    "rabbitmq_queue_consumers",
    "rabbitmq_queue_messages_ready",
    "rabbitmq_queue_messages_unacked",
];

fn read(relative: &str) -> String {
    let path = deploy_dir().join(relative);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn assert_ran(what: &str, out: &std::process::Output) {
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The alert names of a rules file, in order.
fn alert_names(rules: &str) -> Vec<String> {
    rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert:"))
        .map(|name| name.trim().to_owned())
        .collect()
}

#[test]
fn alert_rules_pass_promtool_and_every_alert_has_unit_tests() {
    let dir = deploy_dir().join("prometheus");
    let check = promtool(&dir, &["check", "rules", "onceonly.rules.yml"]);
    assert_ran("promtool check rules", &check);
    let test = promtool(&dir, &["test", "rules", "onceonly.rules.test.yml"]);
    assert_ran("promtool test rules", &test);
    assert!(
        String::from_utf8_lossy(&test.stdout).contains("SUCCESS"),
        "{test:?}"
    );

    // Every alert has a case where it fires and one where it is quiet.
    let tests = read(RULE_TESTS);
    let mut cases: BTreeMap<String, (u32, u32)> = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in tests.lines().map(str::trim) {
        if let Some(name) = line.strip_prefix("alertname:") {
            current = Some(name.trim().to_owned());
        } else if let Some(name) = &current {
            let entry = cases.entry(name.clone()).or_default();
            if line == "exp_alerts: []" {
                entry.1 += 1;
                current = None;
            } else if line.starts_with("- exp_labels:") {
                entry.0 += 1;
                current = None;
            }
        }
    }
    let names = alert_names(&read(RULES));
    assert!(names.len() >= 11, "alerts: {names:?}");
    for name in &names {
        let (firing, quiet) = cases.get(name).copied().unwrap_or_default();
        assert!(
            firing > 0 && quiet > 0,
            "{name} needs a unit test where it fires and one where it does not \
             (has {firing} firing, {quiet} quiet) in {RULE_TESTS}"
        );
    }
    for tested in cases.keys() {
        assert!(
            names.contains(tested),
            "{RULE_TESTS} tests {tested}, which is no alert"
        );
    }
}

// ------------------------------------------------------- exported metrics

/// How a metric is recorded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Counter,
    Gauge,
    Histogram,
}

/// Every metric the library records, by name: the first argument of each
/// `counter!`, `gauge!` and `histogram!` in `src/` (a string literal or a
/// constant of `src/telemetry.rs`).
fn exported_metrics() -> BTreeMap<String, Kind> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .join("src");
    let telemetry = std::fs::read_to_string(src.join("telemetry.rs")).expect("telemetry.rs");
    let consts: BTreeMap<String, String> = telemetry
        .lines()
        .filter_map(|l| {
            let rest = l.trim().strip_prefix("pub const ")?;
            let (name, value) = rest.split_once(": &str = \"")?;
            Some((name.to_owned(), value.strip_suffix("\";")?.to_owned()))
        })
        .collect();
    let mut files = Vec::new();
    let mut dirs = vec![src];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("read src") {
            let path = entry.expect("dir entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                files.push(path);
            }
        }
    }
    let mut out = BTreeMap::new();
    for file in files {
        let text = std::fs::read_to_string(&file).expect("source file");
        for (macro_name, kind) in [
            ("counter!(", Kind::Counter),
            ("gauge!(", Kind::Gauge),
            ("histogram!(", Kind::Histogram),
        ] {
            for (at, _) in text.match_indices(macro_name) {
                if text[..at].ends_with('_') {
                    continue; // describe_counter!(...)
                }
                let args = text[at + macro_name.len()..].trim_start();
                let first = args.split([',', ')']).next().unwrap_or("").trim();
                let name = if let Some(literal) = first.strip_prefix('"') {
                    literal.trim_end_matches('"').to_owned()
                } else {
                    let ident = first.rsplit("::").next().unwrap_or(first);
                    match consts.get(ident) {
                        Some(value) => value.clone(),
                        None => continue,
                    }
                };
                if name.starts_with("onceonly_") {
                    let previous = out.insert(name.clone(), kind);
                    assert!(
                        previous.is_none_or(|p| p == kind),
                        "{name} is recorded as {previous:?} and {kind:?}"
                    );
                }
            }
        }
    }
    out
}

/// The identifiers of `text` outside string literals that start with
/// `prefix`.
fn identifiers(text: &str, prefix: &str) -> Vec<String> {
    let mut outside = String::new();
    let mut in_string = false;
    for c in text.chars() {
        if c == '"' {
            in_string = !in_string;
        } else if !in_string {
            outside.push(c);
        }
    }
    let is_ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    outside
        .match_indices(prefix)
        .filter(|(at, _)| !outside[..*at].chars().next_back().is_some_and(is_ident))
        .map(|(at, _)| outside[at..].chars().take_while(|c| is_ident(*c)).collect())
        .collect()
}

/// The metric names a PromQL expression (or a rules file) reads, with the
/// histogram suffixes of Prometheus's exposition removed: the
/// `onceonly_*` identifiers outside string literals.
fn metrics_named(text: &str, exported: &BTreeMap<String, Kind>) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for name in identifiers(text, "onceonly_") {
        let base = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|suffix| {
                let base = name.strip_suffix(suffix)?;
                (exported.get(base) == Some(&Kind::Histogram)).then(|| base.to_owned())
            })
            .unwrap_or(name);
        names.insert(base);
    }
    names
}

/// Each panel of the dashboard (rows' children included) with its queries.
fn panels(dashboard: &serde_json::Value) -> Vec<serde_json::Value> {
    let mut out = Vec::new();
    let mut stack: Vec<serde_json::Value> =
        dashboard["panels"].as_array().cloned().unwrap_or_default();
    while let Some(panel) = stack.pop() {
        if panel["type"] == "row" {
            stack.extend(panel["panels"].as_array().cloned().unwrap_or_default());
        } else {
            out.push(panel);
        }
    }
    out
}

fn exprs(panel: &serde_json::Value) -> Vec<String> {
    panel["targets"]
        .as_array()
        .map(|targets| {
            targets
                .iter()
                .filter_map(|t| t["expr"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// A panel's query as Prometheus gets it from Grafana.
fn substituted(expr: &str, scope: &str) -> String {
    expr.replace("$__rate_interval", "1m")
        .replace("$scope", scope)
}

#[test]
fn dashboard_and_rules_name_only_metrics_the_code_records() {
    let exported = exported_metrics();
    for expected in [
        "onceonly_deliveries_total",
        "onceonly_claim_duration_seconds",
        "onceonly_waiting_on_infrastructure",
        "onceonly_outbox_backlog",
        "onceonly_outbox_dead_rows",
        "onceonly_purge_last_success_timestamp_seconds",
    ] {
        assert!(
            exported.contains_key(expected),
            "the scan of src/ misses {expected}: {exported:?}"
        );
    }

    let rules = read(RULES);
    for name in metrics_named(&rules, &exported) {
        assert!(
            exported.contains_key(&name),
            "{RULES} reads {name}, which no code records (recorded: {:?})",
            exported.keys()
        );
    }
    // The only other metrics the rules read: RabbitMQ's own, by name (the
    // comments name the plugin, not metrics).
    let uncommented: Vec<&str> = rules
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .collect();
    let external: BTreeSet<String> = identifiers(&uncommented.join("\n"), "rabbitmq_")
        .into_iter()
        .collect();
    assert_eq!(
        external,
        RABBITMQ_PROMETHEUS_METRICS
            .iter()
            .map(|m| (*m).to_owned())
            .collect::<BTreeSet<_>>(),
        "{RULES} reads RabbitMQ metrics other than the rabbitmq_prometheus ones listed here"
    );

    let dashboard: serde_json::Value =
        serde_json::from_str(&read(DASHBOARD)).expect("the dashboard is JSON");
    let panels = panels(&dashboard);
    assert!(panels.len() >= 20, "{} panels", panels.len());
    let mut shown = BTreeSet::new();
    let mut syntax = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for panel in &panels {
        let title = panel["title"].as_str().unwrap_or_default();
        assert!(!title.is_empty(), "a panel without a title: {panel}");
        assert!(
            panel["description"].as_str().is_some_and(|d| d.len() > 20),
            "panel {title:?} does not say what it means (description)"
        );
        assert_eq!(
            panel["datasource"]["uid"], "${datasource}",
            "panel {title:?} must use the dashboard's data source variable"
        );
        let exprs = exprs(panel);
        assert!(!exprs.is_empty(), "panel {title:?} has no query");
        for expr in exprs {
            for name in metrics_named(&expr, &exported) {
                assert!(
                    exported.contains_key(&name),
                    "panel {title:?} queries {name}, which no code records \
                     (recorded: {:?})",
                    exported.keys()
                );
                shown.insert(name);
            }
            let query = substituted(&expr, ".*");
            assert!(
                !query.contains('$'),
                "panel {title:?}: unknown variable in {expr}"
            );
            syntax.push_str(&format!(
                "      - record: dashboard:panel_{}\n        expr: '{}'\n",
                syntax.matches("record:").count(),
                query.replace('\'', "''")
            ));
        }
    }
    for name in exported.keys() {
        assert!(
            shown.contains(name),
            "no dashboard panel shows {name}: add one to {DASHBOARD}"
        );
    }
    // Every query parses (promtool checks recording rules' PromQL).
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("dashboard.rules.yml"), syntax).unwrap();
    let check = promtool(dir.path(), &["check", "rules", "dashboard.rules.yml"]);
    assert_ran("promtool check rules on the dashboard's queries", &check);
}

// ------------------------------------------------------------------ e2e

/// The shipped rules with the waiting alert's `for` shortened to `for`.
fn rules_with_waiting_for(for_: &str) -> String {
    let rules = read(RULES);
    let at = rules
        .find(&format!("alert: {WAITING_ALERT}"))
        .expect("the waiting alert");
    let (head, tail) = rules.split_at(at);
    let tail = tail.replacen("for: 2m", &format!("for: {for_}"), 1);
    assert_ne!(
        format!("{head}{tail}"),
        rules,
        "the waiting alert's for: 2m"
    );
    format!("{head}{tail}")
}

/// The alert `name` of `scope` among `alerts`, if any: its state.
fn state_of(alerts: &[serde_json::Value], name: &str, scope: &str) -> Option<String> {
    alerts
        .iter()
        .find(|a| a["labels"]["alertname"] == name && a["labels"]["scope"] == scope)
        .and_then(|a| a["state"].as_str().map(str::to_owned))
}

async fn wait_for_rows(pool: &PgPool, n: i64, what: &str, log: &Logged) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while rows(pool).await < n {
        assert!(
            Instant::now() < deadline,
            "{what}: fewer than {n} ledger rows after 60 s; consumer log:\n{}",
            log.tail()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_alert_fires_in_prometheus_when_the_database_turns_read_only() {
    let db = OwnDb::create("prom_ro").await;
    let queue = onceonly_integration_tests::unique("prom_ro");
    let (_conn, channel) = connect().await;
    declare_queue(&channel, &queue).await;

    let metrics_port = free_port();
    let log = Logged::new("prom_ro");
    let _consumer = log.spawn(
        "amqp_orders",
        &[
            "--amqp-url".into(),
            url(),
            "--queue".into(),
            queue.clone(),
            "--database-url".into(),
            db.url.clone(),
            "--metrics-addr".into(),
            format!("127.0.0.1:{metrics_port}"),
            "--concurrency".into(),
            "2".into(),
        ],
    );
    let config = format!(
        "global:\n  scrape_interval: {}s\n  evaluation_interval: {}s\n\
         rule_files: [onceonly.rules.yml]\n\
         scrape_configs:\n  - job_name: onceonly\n    static_configs:\n      \
         - targets: ['127.0.0.1:{metrics_port}']\n",
        SCRAPE_INTERVAL.as_secs(),
        EVALUATION_INTERVAL.as_secs(),
    );
    let prometheus = Prometheus::start(
        &config,
        &[(
            "onceonly.rules.yml",
            rules_with_waiting_for(&format!("{}s", WAITING_FOR.as_secs())),
        )],
    )
    .await;

    // Healthy first: payments flow, Prometheus scrapes the consumer.
    let payment = |i: i64| Msg::new(pay(&format!("RO-{i}"), i).account("acct"));
    publish(&channel, &queue, &(1..=5).map(payment).collect::<Vec<_>>()).await;
    // Ledger tables exist once the example started.
    let pool = loop {
        if let Ok(pool) = PgPool::connect(&db.url).await
            && sqlx::query("SELECT 1 FROM ledger LIMIT 1")
                .execute(&pool)
                .await
                .is_ok()
        {
            break pool;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    wait_for_rows(&pool, 5, "before the failover", &log).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while prometheus.target_health().await != ["up"] {
        assert!(
            Instant::now() < deadline,
            "prometheus never scraped the consumer: {:?}\n{}\nconsumer:\n{}",
            prometheus.target_health().await,
            prometheus.log(),
            log.tail()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(
        state_of(&prometheus.alerts().await, WAITING_ALERT, &queue),
        None,
        "no alert while the database takes writes"
    );

    // The database fails over to read-only; new payments wait in place.
    db.fail_over_read_only().await;
    let failed_over = Instant::now();
    publish(&channel, &queue, &(6..=10).map(payment).collect::<Vec<_>>()).await;
    // `pending_at`: when a reply first said pending (the alert went
    // pending at or before it). The reply that said firing: `firing_at`,
    // when it came (the alert fired before it); `asked_at`, when it was
    // asked for (the previous reply said not yet, and came at most a poll
    // interval earlier).
    let mut pending_at = None;
    let (asked_at, firing_at) = loop {
        let asked = failed_over.elapsed();
        let state = state_of(&prometheus.alerts().await, WAITING_ALERT, &queue);
        match state.as_deref() {
            Some("firing") => break (asked, failed_over.elapsed()),
            Some("pending") => {
                pending_at.get_or_insert(failed_over.elapsed());
            }
            _ => {}
        }
        assert!(
            failed_over.elapsed() < Duration::from_secs(60),
            "{WAITING_ALERT} not firing 60 s after the failover (state {state:?}, pending \
             since {pending_at:?}); alerts: {:?}\nprometheus:\n{}\nconsumer:\n{}",
            prometheus.alerts().await,
            prometheus.log(),
            log.tail()
        );
        tokio::time::sleep(POLL).await;
    };
    let pending_at = pending_at.expect("the alert was pending before it fired (its `for`)");
    assert!(
        firing_at + EVALUATION_INTERVAL >= pending_at + WAITING_FOR,
        "fired {firing_at:?} after the failover, pending since {pending_at:?}: the `for` of \
         {WAITING_FOR:?} was not honoured"
    );
    // Prometheus fires at the first evaluation at least `for` after the one
    // that made it pending: at most one evaluation interval late, seen at
    // most one poll later; a scrape interval of slack on top.
    let latest = WAITING_FOR + EVALUATION_INTERVAL + SCRAPE_INTERVAL + POLL;
    assert!(
        asked_at <= pending_at + latest,
        "firing when asked {asked_at:?} after the failover, pending since {pending_at:?}: \
         more than \
         {latest:?} (for {WAITING_FOR:?}, evaluation {EVALUATION_INTERVAL:?}, scrape \
         {SCRAPE_INTERVAL:?}, poll {POLL:?}) from pending to firing"
    );
    eprintln!(
        "{WAITING_ALERT}: pending {pending_at:?} and firing (asked {asked_at:?}, answered \
         {firing_at:?}) after the failover, at most {latest:?} allowed from pending to firing"
    );
    assert_eq!(rows(&pool).await, 5, "nothing was written while read-only");

    // The dashboard's queries run against the live data; the AMQP row shows
    // this consumer.
    let dashboard: serde_json::Value = serde_json::from_str(&read(DASHBOARD)).unwrap();
    let client = reqwest::Client::new();
    let mut amqp_outcomes = 0;
    for panel in panels(&dashboard) {
        for expr in exprs(&panel) {
            let answer: serde_json::Value = client
                .get(prometheus.url("/api/v1/query"))
                .query(&[("query", substituted(&expr, &queue))])
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            assert_eq!(answer["status"], "success", "{expr}: {answer}");
            if panel["title"]
                .as_str()
                .is_some_and(|t| t.starts_with("AMQP: processed"))
            {
                let series = answer["data"]["result"].as_array().map_or(0, Vec::len);
                amqp_outcomes += series;
            }
        }
    }
    assert!(
        amqp_outcomes > 0,
        "the AMQP outcome panel shows nothing for {queue}"
    );

    // Writable again: the backlog drains and the alert resolves by itself.
    db.set_read_only(false).await;
    db.terminate_connections().await;
    wait_for_rows(&pool, 10, "after the database is writable again", &log).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while state_of(&prometheus.alerts().await, WAITING_ALERT, &queue).is_some() {
        assert!(
            Instant::now() < deadline,
            "{WAITING_ALERT} still active 30 s after the database took writes again"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}
