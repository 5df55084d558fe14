//! What a delivery costs, counted: database round trips and statements
//! (a counting PostgreSQL proxy on loopback) and CPU time of the process
//! under test and of the database backends serving it (`/proc/<pid>/stat`).
//!
//! - **Round trips**: the proxy sees both directions of every connection of
//!   the process under test. A round trip is a flip of the client from
//!   reading to writing: the client sends something after the server sent
//!   something since the client's last send. Pipelined statements (several
//!   in one simple query, or Parse/Bind/Execute/Sync of several statements
//!   in one write) are one round trip; a `Sync`-only ping before a pool
//!   hands out a connection is one too.
//! - **Statements**: `CommandComplete` (`C`) messages from the server, one
//!   per statement executed, `BEGIN` and `COMMIT` included, whether they
//!   came as simple queries (several per `Q` counted apart) or as extended
//!   `Execute`s.
//! - **CPU**: `utime + stime` of the child process (all its threads, dead
//!   ones included) and of every PostgreSQL backend whose
//!   `application_name` is the run's (found in `pg_stat_activity`, read
//!   from `/proc/<pid>/stat` when that pid is a local `postgres` process),
//!   before and after the measured window. PostgreSQL's shared background
//!   processes (WAL writer, checkpointer, autovacuum) are left out: on a
//!   shared server they work for every client.
//!
//! The proxy adds a hop per round trip, and onceonly makes more round trips
//! than the baseline, so a proxied run would understate onceonly's rate
//! against the baseline: by default the counts come from one extra run of
//! each variant through the proxy, and the rates, latencies and CPU from
//! the direct runs (see `Counting`).

use std::collections::HashMap;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use sqlx::PgPool;
use sqlx::postgres::PgConnectOptions;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::common::Res;

/// How the round trip and statement counts are taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Counting {
    /// One extra run per variant through the counting proxy; rates,
    /// latencies and CPU come from the direct runs.
    Separate,
    /// Every run goes through the proxy (rates include its hop, the same
    /// per round trip for the baseline and onceonly).
    Inline,
    /// No counts (the CPU columns stay).
    Off,
}

/// Counters of the proxy, over all its connections.
#[derive(Default)]
struct Counters {
    round_trips: AtomicU64,
    statements: AtomicU64,
}

/// A snapshot of the proxy's counters.
#[derive(Clone, Copy, Debug, Default)]
pub struct Counts {
    pub round_trips: u64,
    pub statements: u64,
}

/// A counting TCP proxy on 127.0.0.1 in front of the PostgreSQL server.
pub struct PgProxy {
    port: u16,
    counters: Arc<Counters>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for PgProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The PostgreSQL protocol codes of the requests a client may send before
/// its startup message (answered `N` by the proxy: no TLS, no GSS
/// encryption, so the proxy can read the messages).
const SSL_REQUEST: u32 = 80_877_103;
const GSSENC_REQUEST: u32 = 80_877_104;

impl PgProxy {
    /// Listens on a free loopback port and forwards to the server of `pg_url`.
    pub async fn start(pg_url: &str) -> Res<Self> {
        let options = PgConnectOptions::from_str(pg_url)?;
        let host = options.get_host().to_owned();
        if host.starts_with('/') {
            return Err(format!(
                "the counting proxy needs a TCP address for PostgreSQL, not the socket {host} \
                 (or run with --counts off)"
            )
            .into());
        }
        let upstream = format!("{host}:{}", options.get_port());
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let counters = Arc::new(Counters::default());
        let c = counters.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    continue;
                };
                let (c, upstream) = (c.clone(), upstream.clone());
                tokio::spawn(async move {
                    if let Err(e) = relay(client, &upstream, c).await {
                        eprintln!("counting proxy: connection to {upstream}: {e}");
                    }
                });
            }
        });
        Ok(Self {
            port,
            counters,
            task,
        })
    }

    /// `url` with its host and port replaced by the proxy's.
    pub fn url(&self, url: &str) -> Res<String> {
        with_authority(url, &format!("127.0.0.1:{}", self.port))
    }

    /// The counters now.
    pub fn counts(&self) -> Counts {
        Counts {
            round_trips: self.counters.round_trips.load(Ordering::Relaxed),
            statements: self.counters.statements.load(Ordering::Relaxed),
        }
    }
}

/// Replaces the `host:port` of a `postgres://user@host:port/db?...` URL.
fn with_authority(url: &str, host_port: &str) -> Res<String> {
    let (scheme, rest) = url
        .split_once("://")
        .ok_or_else(|| format!("not a URL: {url}"))?;
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    let user = authority
        .rsplit_once('@')
        .map(|(u, _)| format!("{u}@"))
        .unwrap_or_default();
    Ok(format!("{scheme}://{user}{host_port}{tail}"))
}

/// `url` with `application_name=name` added.
pub fn with_application_name(url: &str, name: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}application_name={name}")
}

/// One proxied connection: answers TLS/GSS requests with `N`, then copies
/// both ways, counting flips and the server's `CommandComplete`s.
async fn relay(mut client: TcpStream, upstream: &str, counters: Arc<Counters>) -> Res<()> {
    client.set_nodelay(true)?;
    // Every packet before the startup message is at least 8 bytes: length
    // and protocol code.
    let mut first = [0u8; 8];
    let startup_len = loop {
        client.read_exact(&mut first).await?;
        let len = u32::from_be_bytes([first[0], first[1], first[2], first[3]]);
        let code = u32::from_be_bytes([first[4], first[5], first[6], first[7]]);
        if len == 8 && (code == SSL_REQUEST || code == GSSENC_REQUEST) {
            client.write_all(b"N").await?;
            continue;
        }
        break len;
    };
    let server = TcpStream::connect(upstream).await?;
    server.set_nodelay(true)?;
    let (mut cr, mut cw) = client.into_split();
    let (mut sr, mut sw) = server.into_split();
    sw.write_all(&first).await?;
    // Set when the server sent bytes since the client last sent any.
    let server_spoke = Arc::new(AtomicBool::new(false));
    let (spoke, c) = (server_spoke.clone(), counters.clone());
    let up = async move {
        let mut buf = vec![0u8; 64 * 1024];
        let mut trace = std::env::var_os("BENCH_TRACE_PG").map(|_| Trace {
            // The rest of the startup message (its first 8 bytes are sent).
            scan: ClientScan {
                remaining: (startup_len as usize).saturating_sub(8),
                ..ClientScan::default()
            },
            flight: Vec::new(),
        });
        loop {
            let n = cr.read(&mut buf).await?;
            if n == 0 {
                break;
            }
            if spoke.swap(false, Ordering::AcqRel) {
                c.round_trips.fetch_add(1, Ordering::Relaxed);
                if let Some(t) = &mut trace {
                    t.flush();
                }
            }
            if let Some(t) = &mut trace {
                t.scan.feed(&buf[..n], &mut t.flight);
            }
            sw.write_all(&buf[..n]).await?;
        }
        sw.shutdown().await?;
        Ok::<_, std::io::Error>(())
    };
    let down = async move {
        let mut buf = vec![0u8; 64 * 1024];
        let mut scan = BackendScan::default();
        loop {
            let n = sr.read(&mut buf).await?;
            if n == 0 {
                break;
            }
            scan.feed(&buf[..n], &counters);
            // Before the client can see the answer, so its next send
            // always finds the flag set.
            server_spoke.store(true, Ordering::Release);
            cw.write_all(&buf[..n]).await?;
        }
        cw.shutdown().await?;
        Ok::<_, std::io::Error>(())
    };
    let (a, b) = tokio::join!(up, down);
    // A reset by either side at the end of a connection is normal.
    for r in [a, b] {
        if let Err(e) = r
            && !matches!(
                e.kind(),
                std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::BrokenPipe
                    | std::io::ErrorKind::NotConnected
            )
        {
            return Err(e.into());
        }
    }
    Ok(())
}

/// `BENCH_TRACE_PG=1`: prints the client's messages of each round trip
/// (`Q` simple query with its text, `P` parse, `B` bind, `E` execute,
/// `S` sync, ...), one line per round trip, to see where they go.
struct Trace {
    scan: ClientScan,
    flight: Vec<String>,
}

impl Trace {
    fn flush(&mut self) {
        if !self.flight.is_empty() {
            eprintln!(
                "pg round trip [{}]: {}",
                self.scan.application_name,
                self.flight.join(" ")
            );
            self.flight.clear();
        }
    }
}

/// Frames the client's messages after the startup message (for the trace).
#[derive(Default)]
struct ClientScan {
    header: [u8; 5],
    have: usize,
    remaining: usize,
    kind: u8,
    /// The first bytes of a `Q` or `P` body (its SQL), or of the startup
    /// message.
    text: Vec<u8>,
    /// From the startup message.
    application_name: String,
}

impl ClientScan {
    fn feed(&mut self, mut data: &[u8], out: &mut Vec<String>) {
        while !data.is_empty() {
            if self.remaining > 0 {
                let n = self.remaining.min(data.len());
                let keep = if self.kind == 0 { 1000 } else { 120 };
                if matches!(self.kind, b'Q' | b'P' | 0) && self.text.len() < keep {
                    self.text
                        .extend_from_slice(&data[..n.min(keep - self.text.len())]);
                }
                self.remaining -= n;
                data = &data[n..];
                if self.remaining == 0 {
                    self.done(out);
                }
                continue;
            }
            let n = (5 - self.have).min(data.len());
            self.header[self.have..self.have + n].copy_from_slice(&data[..n]);
            self.have += n;
            data = &data[n..];
            if self.have == 5 {
                let h = self.header;
                self.kind = h[0];
                self.remaining =
                    (u32::from_be_bytes([h[1], h[2], h[3], h[4]]) as usize).saturating_sub(4);
                self.have = 0;
                self.text.clear();
                if self.remaining == 0 {
                    self.done(out);
                }
            }
        }
    }

    fn done(&mut self, out: &mut Vec<String>) {
        if self.kind == 0 {
            // The startup message: NUL-terminated names and values.
            let mut parts = self.text.split(|b| *b == 0);
            while let (Some(k), Some(v)) = (parts.next(), parts.next()) {
                if k == b"application_name" {
                    self.application_name = String::from_utf8_lossy(v).into_owned();
                }
            }
            return;
        }
        let kind = char::from(self.kind);
        if matches!(self.kind, b'Q' | b'P') {
            // Parse starts with the statement name (NUL-terminated).
            let text = if self.kind == b'P' {
                self.text.splitn(2, |b| *b == 0).nth(1).unwrap_or_default()
            } else {
                &self.text[..]
            };
            let sql = String::from_utf8_lossy(text)
                .replace('\0', "")
                .split_whitespace()
                .collect::<Vec<_>>()
                .join(" ");
            out.push(format!("{kind}[{sql}]"));
        } else {
            out.push(kind.to_string());
        }
    }
}

/// Frames the server's messages (1-byte type, 4-byte length including
/// itself) across reads and counts `CommandComplete`s.
#[derive(Default)]
struct BackendScan {
    header: [u8; 5],
    have: usize,
    /// Body bytes of the current message still to skip.
    remaining: usize,
}

impl BackendScan {
    fn feed(&mut self, mut data: &[u8], counters: &Counters) {
        while !data.is_empty() {
            if self.remaining > 0 {
                let n = self.remaining.min(data.len());
                self.remaining -= n;
                data = &data[n..];
                continue;
            }
            let n = (5 - self.have).min(data.len());
            self.header[self.have..self.have + n].copy_from_slice(&data[..n]);
            self.have += n;
            data = &data[n..];
            if self.have == 5 {
                let h = self.header;
                let len = u32::from_be_bytes([h[1], h[2], h[3], h[4]]) as usize;
                if h[0] == b'C' {
                    counters.statements.fetch_add(1, Ordering::Relaxed);
                }
                self.remaining = len.saturating_sub(4);
                self.have = 0;
            }
        }
    }
}

/// Clock ticks per second of `/proc/<pid>/stat` (`USER_HZ`, 100 on Linux
/// unless `getconf` says otherwise).
fn clock_ticks() -> f64 {
    static TICKS: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *TICKS.get_or_init(|| {
        std::process::Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .and_then(|s| s.trim().parse::<f64>().ok())
            .filter(|t| *t > 0.0)
            .unwrap_or(100.0)
    })
}

/// `(command name, utime + stime in ticks)` of a process.
fn proc_cpu(pid: u32) -> std::io::Result<(String, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let bad = || std::io::Error::other(format!("unexpected /proc/{pid}/stat: {stat}"));
    // The name is in parentheses and may itself hold spaces or parentheses.
    let open = stat.find('(').ok_or_else(bad)?;
    let close = stat.rfind(')').ok_or_else(bad)?;
    let comm = stat.get(open + 1..close).ok_or_else(bad)?.to_owned();
    let fields: Vec<&str> = stat
        .get(close + 1..)
        .ok_or_else(bad)?
        .split_whitespace()
        .collect();
    // Fields 14 and 15 of proc(5); field 3 (state) is the first after ')'.
    let tick = |i: usize| fields.get(i).and_then(|v| v.parse::<u64>().ok());
    let (utime, stime) = (tick(11).ok_or_else(bad)?, tick(12).ok_or_else(bad)?);
    Ok((comm, utime + stime))
}

/// CPU ticks of the local `postgres` backends of `application_name`;
/// `None` when the server is not on this machine (a pid that is not a
/// local `postgres` process, e.g. a remote or containerized server).
async fn db_ticks(admin: &PgPool, application_name: &str) -> Res<Option<HashMap<u32, u64>>> {
    let pids: Vec<i32> =
        sqlx::query_scalar("SELECT pid FROM pg_stat_activity WHERE application_name = $1")
            .bind(application_name)
            .fetch_all(admin)
            .await?;
    let mut out = HashMap::new();
    for pid in pids {
        let pid = u32::try_from(pid).map_err(|_| format!("pg_stat_activity pid {pid}"))?;
        match proc_cpu(pid) {
            Ok((comm, ticks)) if comm == "postgres" => {
                out.insert(pid, ticks);
            }
            // Gone since the query: its CPU is lost to the window.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            _ => return Ok(None),
        }
    }
    Ok(Some(out))
}

/// What the process under test connects with: its database URL (through
/// the proxy or not) and the application name that finds its backends.
#[derive(Clone, Debug)]
pub struct DbClient {
    pub url: String,
    pub application_name: String,
    /// Through the counting proxy.
    pub counted: bool,
}

/// The costs of one run, per delivery.
#[derive(Clone, Copy, Debug, Default)]
pub struct Cost {
    /// Client CPU milliseconds per 1,000 deliveries.
    pub app_cpu: Option<f64>,
    /// Database backend CPU milliseconds per 1,000 deliveries.
    pub db_cpu: Option<f64>,
    /// Database round trips per delivery.
    pub round_trips: Option<f64>,
    /// Statements per delivery.
    pub statements: Option<f64>,
}

/// A measured window: CPU and counts at its start.
pub struct Window {
    pid: u32,
    app: u64,
    db: Option<HashMap<u32, u64>>,
    counts: Option<Counts>,
    application_name: String,
}

impl Window {
    /// Starts measuring the process `pid` and its database client `db`.
    pub async fn open(
        pid: u32,
        db: &DbClient,
        admin: &PgPool,
        proxy: Option<&PgProxy>,
    ) -> Res<Self> {
        let (_, app) = proc_cpu(pid).map_err(|e| {
            format!("cannot read the CPU time of process {pid} from /proc/{pid}/stat: {e}")
        })?;
        Ok(Self {
            pid,
            app,
            db: db_ticks(admin, &db.application_name).await?,
            counts: if db.counted {
                proxy.map(PgProxy::counts)
            } else {
                None
            },
            application_name: db.application_name.clone(),
        })
    }

    /// Ends the window after `deliveries` deliveries.
    pub async fn close(
        self,
        deliveries: usize,
        admin: &PgPool,
        proxy: Option<&PgProxy>,
    ) -> Res<Cost> {
        let pid = self.pid;
        let (_, app) = proc_cpu(pid).map_err(|e| {
            format!("cannot read the CPU time of process {pid} from /proc/{pid}/stat: {e}")
        })?;
        let per_k = 1000.0 / deliveries.max(1) as f64;
        let ms = |ticks: u64| ticks as f64 * 1000.0 / clock_ticks() * per_k;
        let db = match (self.db, db_ticks(admin, &self.application_name).await?) {
            (Some(before), Some(after)) => Some(
                after
                    .iter()
                    .map(|(pid, t)| t.saturating_sub(before.get(pid).copied().unwrap_or(0)))
                    .sum::<u64>(),
            ),
            _ => None,
        };
        let per = 1.0 / deliveries.max(1) as f64;
        let counts = match (self.counts, proxy) {
            (Some(before), Some(proxy)) => {
                let after = proxy.counts();
                Some((
                    (after.round_trips - before.round_trips) as f64 * per,
                    (after.statements - before.statements) as f64 * per,
                ))
            }
            _ => None,
        };
        Ok(Cost {
            app_cpu: Some(ms(app.saturating_sub(self.app))),
            db_cpu: db.map(ms),
            round_trips: counts.map(|c| c.0),
            statements: counts.map(|c| c.1),
        })
    }
}

/// The column names of [`cost_cells`].
pub const COST_COLUMNS: [&str; 4] = [
    "DB round trips / delivery",
    "statements / delivery",
    "CPU ms / 1k: app",
    "CPU ms / 1k: DB",
];

/// Table cells of a cost (`–` where not measured).
pub fn cost_cells(cost: &Cost) -> Vec<String> {
    let count = |v: Option<f64>| {
        v.map_or("–".to_owned(), |v| {
            if v >= 10.0 || v == 0.0 {
                format!("{v:.1}")
            } else if v >= 0.1 {
                format!("{v:.2}")
            } else {
                format!("{v:.3}")
            }
        })
    };
    let cpu = |v: Option<f64>| v.map_or("–".to_owned(), |v| format!("{v:.0}"));
    vec![
        count(cost.round_trips),
        count(cost.statements),
        cpu(cost.app_cpu),
        cpu(cost.db_cpu),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn authority_is_replaced() {
        let got =
            with_authority("postgres://u:p@db.example:5433/test?x=1", "127.0.0.1:9").expect("url");
        assert_eq!(got, "postgres://u:p@127.0.0.1:9/test?x=1");
        let got = with_authority("postgres://db?x=1", "127.0.0.1:9").expect("url");
        assert_eq!(got, "postgres://127.0.0.1:9?x=1");
    }

    #[test]
    fn command_completes_are_counted_across_reads() {
        let c = Counters::default();
        let mut scan = BackendScan::default();
        // CommandComplete "BEGIN", ReadyForQuery 'I', CommandComplete "INSERT 0 1".
        let mut wire = Vec::new();
        for (t, body) in [
            (b'C', &b"BEGIN\0"[..]),
            (b'Z', b"I"),
            (b'C', b"INSERT 0 1\0"),
        ] {
            wire.push(t);
            wire.extend_from_slice(&(body.len() as u32 + 4).to_be_bytes());
            wire.extend_from_slice(body);
        }
        for chunk in wire.chunks(3) {
            scan.feed(chunk, &c);
        }
        assert_eq!(c.statements.load(Ordering::Relaxed), 2);
    }
}
