//! Helpers for the integration tests: connections to the real services
//! (failing loudly with the command that starts them), unique table names and
//! the per-backend SQL of a small business table.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use onceonly::{MySqlStore, PgStore, SqlStore, SqliteStore};

/// PostgreSQL URL: `ONCEONLY_PG_URL`, default `postgres://postgres@127.0.0.1:5432/test`.
pub fn pg_url() -> String {
    std::env::var("ONCEONLY_PG_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// MySQL/MariaDB URL: `ONCEONLY_MYSQL_URL`, default `mysql://root@127.0.0.1:3306/test`.
pub fn mysql_url() -> String {
    std::env::var("ONCEONLY_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into())
}

fn unreachable_service(what: &str, url: &str, e: impl std::fmt::Display) -> ! {
    panic!(
        "{what} is not reachable at {url}: {e}\n\
         Start the services with `scripts/services` (or `docker compose up -d`), \
         or point ONCEONLY_PG_URL / ONCEONLY_MYSQL_URL at running servers. \
         These tests never skip."
    )
}

/// A TCP port on 127.0.0.1 that was free a moment ago (for a child process
/// or server that must be told its port before it binds).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

/// A name unique to this process and call, usable as an SQL identifier.
pub fn unique(prefix: &str) -> String {
    static N: AtomicUsize = AtomicUsize::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!(
        "{prefix}_{}_{}_{nanos}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    )
}

/// A PostgreSQL store at `url` on dedup table `table` (migrated).
pub async fn pg_store(url: &str, table: &str) -> PgStore {
    let store = match PgStore::connect(url).await {
        Ok(s) => s,
        Err(e) => unreachable_service("PostgreSQL", url, e),
    };
    let store = store.with_table(table).expect("valid table name");
    store.migrate().await.expect("migrate");
    store
}

/// A PostgreSQL store at `url` on dedup table `table` in the generations
/// layout (`PgStore::generations`), migrated (a plain table is upgraded).
pub async fn pg_generations_store(url: &str, table: &str) -> PgStore {
    let store = match PgStore::connect(url).await {
        Ok(s) => s,
        Err(e) => unreachable_service("PostgreSQL", url, e),
    };
    let store = store
        .with_table(table)
        .expect("valid table name")
        .generations(true);
    store
        .migrate()
        .await
        .expect("migrate the generations layout");
    store
}

/// A MariaDB/MySQL store at `url` on dedup table `table` (migrated).
pub async fn mysql_store(url: &str, table: &str) -> MySqlStore {
    let store = match MySqlStore::connect(url).await {
        Ok(s) => s,
        Err(e) => unreachable_service("MariaDB/MySQL", url, e),
    };
    let store = store.with_table(table).expect("valid table name");
    store.migrate().await.expect("migrate");
    store
}

/// An SQLite store in file `path` on dedup table `table` (migrated).
pub async fn sqlite_store(path: &std::path::Path, table: &str) -> SqliteStore {
    let store = SqliteStore::open(path)
        .await
        .expect("open sqlite")
        .with_table(table)
        .expect("valid table name");
    store.migrate().await.expect("migrate");
    store
}

pub mod amqp;
pub mod child;
pub mod cli;
pub mod demo;
pub mod handler;
pub mod kafka;
pub mod ledger;
pub mod mock;
pub mod own_db;
pub mod private_pg;
pub mod prometheus;
pub mod provider_api;
pub mod redis_cluster;
pub mod schema_registry;
pub mod services;
pub mod silent_proxy;
pub mod tls;

/// SQL of the business table `charges(id, out_trade_no, amount)` per backend.
/// `out_trade_no` has no unique constraint: dedup must come from onceonly.
pub struct BusinessSql {
    /// `CREATE TABLE`.
    pub create: String,
    /// `INSERT` with two parameters: out_trade_no, amount.
    pub insert: String,
    /// Row count.
    pub count: String,
    /// Distinct out_trade_no count.
    pub distinct: String,
    /// `DROP TABLE`.
    pub drop: String,
}

impl BusinessSql {
    fn new(table: &str, create: String, placeholders: (&str, &str)) -> Self {
        Self {
            create,
            insert: format!(
                "INSERT INTO {table} (out_trade_no, amount) VALUES ({}, {})",
                placeholders.0, placeholders.1
            ),
            count: format!("SELECT COUNT(*) FROM {table}"),
            distinct: format!("SELECT COUNT(DISTINCT out_trade_no) FROM {table}"),
            drop: format!("DROP TABLE IF EXISTS {table}"),
        }
    }

    /// PostgreSQL flavour.
    pub fn postgres(table: &str) -> Self {
        Self::new(
            table,
            format!(
                "CREATE TABLE {table} (id bigserial PRIMARY KEY, out_trade_no text NOT NULL, amount bigint NOT NULL)"
            ),
            ("$1", "$2"),
        )
    }

    /// MySQL/MariaDB flavour.
    pub fn mysql(table: &str) -> Self {
        Self::new(
            table,
            format!(
                "CREATE TABLE {table} (id BIGINT AUTO_INCREMENT PRIMARY KEY, out_trade_no VARCHAR(400) NOT NULL, amount BIGINT NOT NULL)"
            ),
            ("?", "?"),
        )
    }

    /// SQLite flavour.
    pub fn sqlite(table: &str) -> Self {
        Self::new(
            table,
            format!(
                "CREATE TABLE {table} (id INTEGER PRIMARY KEY AUTOINCREMENT, out_trade_no TEXT NOT NULL, amount INTEGER NOT NULL)"
            ),
            ("?", "?"),
        )
    }
}

/// A payment message as the tests send it, and as their handlers read it:
/// `{"out_trade_no", "account", "amount", "seq"}` in that order, `account`
/// and `seq` only when set. Built with [`pay`]; it converts into the body
/// bytes wherever a delivery, message or record takes `Into<Vec<u8>>`, and
/// prints as its JSON text.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[must_use]
pub struct Pay {
    /// The key.
    pub out_trade_no: String,
    /// The account charged (the examples' ledger needs it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub account: Option<String>,
    /// The amount.
    pub amount: i64,
    /// A sequence number (ordering checks).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq: Option<i64>,
}

/// A payment of `amount` under key `no`, without account or sequence
/// number: `{"out_trade_no":no,"amount":amount}`.
pub fn pay(no: &str, amount: i64) -> Pay {
    Pay {
        out_trade_no: no.to_owned(),
        account: None,
        amount,
        seq: None,
    }
}

impl Pay {
    /// Charges `account`.
    pub fn account(self, account: &str) -> Self {
        Self {
            account: Some(account.to_owned()),
            ..self
        }
    }

    /// Carries sequence number `seq`.
    pub fn seq(self, seq: i64) -> Self {
        Self {
            seq: Some(seq),
            ..self
        }
    }

    /// The JSON body bytes.
    pub fn body(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("serialize a payment")
    }
}

impl From<Pay> for Vec<u8> {
    fn from(p: Pay) -> Self {
        p.body()
    }
}

impl std::fmt::Display for Pay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&serde_json::to_string(self).map_err(|_| std::fmt::Error)?)
    }
}

/// Redis URL: `ONCEONLY_REDIS_URL`, default `redis://127.0.0.1:6379`.
pub fn redis_url() -> String {
    std::env::var("ONCEONLY_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

/// Fails loudly when Redis is not reachable.
pub fn redis_unreachable(e: impl std::fmt::Display) -> ! {
    panic!(
        "Redis is not reachable at {}: {e}\nStart it with `scripts/services`, or point \
         ONCEONLY_REDIS_URL at a running server. These tests never skip.",
        redis_url()
    )
}
