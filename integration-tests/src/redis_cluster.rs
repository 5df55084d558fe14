//! A real Redis Cluster on loopback: six `redis-server --cluster-enabled
//! yes` processes in a temporary directory, made into 3 masters and 3
//! replicas by `redis-cli --cluster create … --cluster-replicas 1`. Each
//! test starts its own and [`RedisCluster`]'s drop kills it. Without
//! `redis-server` and `redis-cli` the test fails with the command that
//! installs them; it never skips.
//!
//! The nodes run with `cluster-node-timeout 1000` (a dead master is failed
//! over within a few seconds) and `cluster-replica-validity-factor 0` (a
//! replica always stands for election), without persistence.

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::{Duration, Instant};

use crate::services::{on_path, output, wait_until};

/// How long a node may take to be failed over.
pub const NODE_TIMEOUT_MS: u64 = 1000;

/// A running Redis Cluster of six nodes on 127.0.0.1.
pub struct RedisCluster {
    dir: tempfile::TempDir,
    nodes: Mutex<BTreeMap<u16, Child>>,
    ports: Vec<u16>,
}

/// One node as `CLUSTER NODES` shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeInfo {
    /// The node id.
    pub id: String,
    /// Its client port.
    pub port: u16,
    /// A master (else a replica).
    pub master: bool,
    /// Flagged `fail` (or `fail?`).
    pub failed: bool,
    /// The master it replicates, for a replica.
    pub master_id: Option<String>,
}

/// Panics with the install command unless the Redis server and client are
/// installed.
pub fn require_redis_server() {
    for tool in ["redis-server", "redis-cli"] {
        assert!(
            on_path(tool),
            "`{tool}` is not installed, and the Redis Cluster tests start a cluster of six \
             redis-server processes on loopback with it. Install it (Debian/Ubuntu: \
             `apt-get install redis-server`, which also gives redis-cli; `scripts/build-deps` \
             does it as root). These tests never skip."
        );
    }
}

fn port_free(port: u16) -> bool {
    TcpListener::bind(("127.0.0.1", port)).is_ok()
}

/// Six consecutive ports from 7101 up whose cluster bus ports (+10000) are
/// free too.
fn free_ports() -> Vec<u16> {
    static NEXT: AtomicU16 = AtomicU16::new(7101);
    loop {
        let base = NEXT.fetch_add(10, Ordering::SeqCst);
        assert!(base < 9000, "no six free ports between 7101 and 9000");
        let ports: Vec<u16> = (base..base + 6).collect();
        if ports.iter().all(|&p| port_free(p) && port_free(p + 10000)) {
            return ports;
        }
    }
}

/// An exclusive lock, across processes, on picking a cluster's ports (a
/// file lock: released when the file is dropped, or its process dies).
fn lock_port_picking() -> std::fs::File {
    let path = std::env::temp_dir().join("onceonly-redis-cluster-ports.lock");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    file.lock()
        .unwrap_or_else(|e| panic!("lock {}: {e}", path.display()));
    file
}

fn cli(port: u16) -> Command {
    let mut cmd = Command::new("redis-cli");
    cmd.args(["-h", "127.0.0.1", "-p", &port.to_string()]);
    cmd
}

/// A field of `INFO`-style `key:value` output.
pub fn field<'a>(text: &'a str, key: &str) -> Option<&'a str> {
    text.lines().find_map(|l| {
        l.trim()
            .strip_prefix(key)
            .and_then(|rest| rest.strip_prefix(':'))
    })
}

impl RedisCluster {
    /// Starts six nodes and creates the cluster; returns once every node
    /// sees `cluster_state:ok` and every replica is in sync with its
    /// master. Panics (with the install command) without redis-server.
    pub fn start() -> Self {
        require_redis_server();
        let dir = tempfile::tempdir().expect("temp dir");
        // Test binaries run concurrently (cargo-nextest), each test in a
        // process of its own: two clusters must not pick the same free
        // ports before either binds them. The lock is held until every
        // node answers.
        let picking = lock_port_picking();
        let ports = free_ports();
        let cluster = Self {
            dir,
            nodes: Mutex::new(BTreeMap::new()),
            ports: ports.clone(),
        };
        for &port in &ports {
            cluster.spawn(port);
        }
        for &port in &ports {
            assert!(
                wait_until(Duration::from_secs(10), || {
                    cli(port)
                        .arg("ping")
                        .output()
                        .is_ok_and(|o| o.stdout.starts_with(b"PONG"))
                }),
                "redis-server on port {port} did not answer within 10 s; its log: {}",
                cluster.log(port)
            );
        }
        drop(picking);
        let mut create = Command::new("redis-cli");
        create.args(["--cluster", "create"]);
        create.args(ports.iter().map(|p| format!("127.0.0.1:{p}")));
        create.args(["--cluster-replicas", "1", "--cluster-yes"]);
        output(&mut create);
        let ready = wait_until(Duration::from_secs(30), || {
            ports.iter().all(|&p| cluster.state_ok(p))
                && cluster.nodes_info().iter().filter(|n| n.master).count() == 3
                && cluster.replicas_in_sync()
        });
        assert!(
            ready,
            "the cluster on ports {ports:?} is not ok within 30 s: {:?}",
            cluster.nodes_info()
        );
        cluster
    }

    fn spawn(&self, port: u16) {
        let node_dir = self.dir.path().join(port.to_string());
        std::fs::create_dir_all(&node_dir).expect("node dir");
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string()])
            .args(["--bind", "127.0.0.1", "--protected-mode", "no"])
            .args(["--cluster-enabled", "yes"])
            .args(["--cluster-config-file", "nodes.conf"])
            .args(["--cluster-node-timeout", &NODE_TIMEOUT_MS.to_string()])
            .args(["--cluster-replica-validity-factor", "0"])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(&node_dir)
            .arg("--logfile")
            .arg(node_dir.join("redis.log"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("starting redis-server on port {port}: {e}"));
        self.nodes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(port, child);
    }

    fn log(&self, port: u16) -> String {
        std::fs::read_to_string(self.dir.path().join(port.to_string()).join("redis.log"))
            .unwrap_or_default()
    }

    /// The six client ports.
    pub fn ports(&self) -> &[u16] {
        &self.ports
    }

    /// `redis+cluster://127.0.0.1:p1,…,127.0.0.1:p6`.
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self
            .ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        format!("redis+cluster://{}", hosts.join(","))
    }

    /// `redis://127.0.0.1:p` of every node.
    pub fn node_urls(&self) -> Vec<String> {
        self.ports
            .iter()
            .map(|p| format!("redis://127.0.0.1:{p}"))
            .collect()
    }

    /// Ports of the nodes still running.
    pub fn alive(&self) -> Vec<u16> {
        self.nodes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .keys()
            .copied()
            .collect()
    }

    /// Whether the node on `port` answers `cluster_state:ok`.
    pub fn state_ok(&self, port: u16) -> bool {
        cli(port).args(["cluster", "info"]).output().is_ok_and(|o| {
            field(&String::from_utf8_lossy(&o.stdout), "cluster_state") == Some("ok")
        })
    }

    /// `CLUSTER NODES` as seen by the first running node that answers.
    pub fn nodes_info(&self) -> Vec<NodeInfo> {
        for port in self.alive() {
            let Ok(out) = cli(port).args(["cluster", "nodes"]).output() else {
                continue;
            };
            let text = String::from_utf8_lossy(&out.stdout);
            let nodes: Vec<NodeInfo> = text.lines().filter_map(parse_node_line).collect();
            if !nodes.is_empty() {
                return nodes;
            }
        }
        Vec::new()
    }

    /// Ports of the masters that are not failed.
    pub fn masters(&self) -> Vec<u16> {
        self.nodes_info()
            .into_iter()
            .filter(|n| n.master && !n.failed)
            .map(|n| n.port)
            .collect()
    }

    fn replicas_in_sync(&self) -> bool {
        let replicas: Vec<u16> = self
            .nodes_info()
            .into_iter()
            .filter(|n| !n.master)
            .map(|n| n.port)
            .collect();
        replicas.len() == 3
            && replicas.iter().all(|&p| {
                cli(p)
                    .args(["info", "replication"])
                    .output()
                    .is_ok_and(|o| {
                        field(&String::from_utf8_lossy(&o.stdout), "master_link_status")
                            == Some("up")
                    })
            })
    }

    /// Keys under `prefix` on the node at `port` (`SCAN MATCH prefix*`).
    pub fn keys_on(&self, port: u16, prefix: &str) -> usize {
        let out = output(cli(port).args(["--scan", "--pattern", &format!("{prefix}*")]));
        out.lines().filter(|l| !l.trim().is_empty()).count()
    }

    /// SIGKILLs the node on `port`.
    pub fn kill(&self, port: u16) {
        let child = self
            .nodes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&port);
        if let Some(mut child) = child {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the node on `port` again (after [`kill`](Self::kill)), with
    /// its old `nodes.conf`: a failed-over master comes back as a replica
    /// of the node that replaced it.
    pub fn restart(&self, port: u16) {
        self.spawn(port);
    }

    /// Waits until the node on `port` is a replica whose link to its
    /// master is up (in sync); how long it took. Panics after `limit`.
    pub fn wait_in_sync(&self, port: u16, limit: Duration) -> Duration {
        let start = Instant::now();
        let synced = wait_until(limit, || {
            self.nodes_info()
                .iter()
                .any(|n| n.port == port && !n.master && !n.failed)
                && cli(port)
                    .args(["info", "replication"])
                    .output()
                    .is_ok_and(|o| {
                        field(&String::from_utf8_lossy(&o.stdout), "master_link_status")
                            == Some("up")
                    })
        });
        assert!(
            synced,
            "the node on port {port} is not an in-sync replica within {limit:?}: {:?}",
            self.nodes_info()
        );
        start.elapsed()
    }

    /// The node id of the node on `port`.
    pub fn id_of(&self, port: u16) -> String {
        self.nodes_info()
            .into_iter()
            .find(|n| n.port == port)
            .map(|n| n.id)
            .unwrap_or_else(|| panic!("no node on port {port}: {:?}", self.nodes_info()))
    }

    /// Waits until the dead master `dead_id` is flagged failed, three
    /// other masters serve the slots and every running node answers
    /// `cluster_state:ok`; returns how long that took. Panics after
    /// `limit`.
    pub fn wait_failover(&self, dead_id: &str, limit: Duration) -> Duration {
        let start = Instant::now();
        let promoted = wait_until(limit, || {
            let nodes = self.nodes_info();
            let dead_out = nodes
                .iter()
                .any(|n| n.id == dead_id && (n.failed || !n.master));
            let masters = nodes
                .iter()
                .filter(|n| n.master && !n.failed && n.id != dead_id)
                .count();
            dead_out && masters == 3 && self.alive().iter().all(|&p| self.state_ok(p))
        });
        assert!(
            promoted,
            "no replica took over from the killed master within {limit:?}: {:?}",
            self.nodes_info()
        );
        start.elapsed()
    }
}

fn parse_node_line(line: &str) -> Option<NodeInfo> {
    let fields: Vec<&str> = line.split_whitespace().collect();
    if fields.len() < 8 {
        return None;
    }
    // `127.0.0.1:7101@17101[,hostname]`
    let port = fields[1]
        .split('@')
        .next()?
        .rsplit_once(':')?
        .1
        .parse()
        .ok()?;
    let flags: Vec<&str> = fields[2].split(',').collect();
    Some(NodeInfo {
        id: fields[0].to_owned(),
        port,
        master: flags.contains(&"master"),
        failed: flags.contains(&"fail") || flags.contains(&"fail?"),
        master_id: (fields[3] != "-").then(|| fields[3].to_owned()),
    })
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        let mut nodes = self.nodes.lock().unwrap_or_else(|e| e.into_inner());
        for (_, child) in nodes.iter_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
        nodes.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_nodes_lines_parse() {
        let m = parse_node_line(
            "07c37dfeb235213a872192d90877d0cd55635b91 127.0.0.1:7104@17104 master - 0 1426238317239 4 connected 0-5460",
        )
        .unwrap();
        assert_eq!(m.port, 7104);
        assert!(m.master && !m.failed && m.master_id.is_none());
        let r = parse_node_line(
            "67ed2db8d677e59ec4a4cefb06858cf2a1a89fa1 127.0.0.1:7102@17102,host myself,slave 07c37dfeb235213a872192d90877d0cd55635b91 0 0 2 connected",
        )
        .unwrap();
        assert_eq!(r.port, 7102);
        assert!(!r.master);
        assert_eq!(
            r.master_id.as_deref(),
            Some("07c37dfeb235213a872192d90877d0cd55635b91")
        );
        let f = parse_node_line(
            "e7d1eecce10fd6bb5eb35b9f99a514335d9ba9ca 127.0.0.1:7103@17103 master,fail - 1426238316232 1426238313000 3 connected",
        )
        .unwrap();
        assert!(f.master && f.failed);
        assert_eq!(
            field(
                "cluster_state:ok\r\ncluster_slots_ok:16384",
                "cluster_state"
            ),
            Some("ok")
        );
    }
}
