//! How a fault test stops and starts a shared service: with the host's own
//! tools (`redis-cli`, `rabbitmqctl`, `initdb`/`pg_ctl`) when the service
//! runs on this machine, or through `docker compose` when it runs in this
//! repository's Docker Compose project (`docker-compose.yml`).
//!
//! The choice, made once per service and test process:
//!
//! 1. `ONCEONLY_SERVICES=host` or `=compose` forces one mechanism (and fails
//!    loudly if it is not available); unset, empty or `auto` detects:
//! 2. the compose project runs the service (`docker compose -f
//!    docker-compose.yml ps --services --status running` lists it) → compose;
//! 3. else the host tools are installed → host;
//! 4. else the test panics with the commands that make either work. These
//!    tests never skip.
//!
//! [`choose`] is that rule as a pure function of the observed [`Facts`].

use std::collections::HashMap;
use std::io::Write;
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The environment variable that forces a mechanism: `host`, `compose` or
/// `auto` (the default).
pub const ENV: &str = "ONCEONLY_SERVICES";

/// A service a test stops and starts again.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Service {
    /// The shared Redis (6379).
    Redis,
    /// The shared RabbitMQ (5672); "stopped" means its app is stopped while
    /// the node keeps running (`rabbitmqctl stop_app`).
    RabbitMq,
    /// A test's private PostgreSQL ([`crate::private_pg::PrivatePg`]):
    /// `initdb`/`pg_ctl` on the host, service `postgres-private` under
    /// compose.
    PrivatePostgres,
}

/// How a service is driven.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mechanism {
    /// With the host's tools, on processes of this machine.
    Host,
    /// With `docker compose` on this repository's compose project.
    Compose,
}

/// What `ONCEONLY_SERVICES` asks for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Preference {
    /// Detect (unset, empty or `auto`).
    #[default]
    Auto,
    /// `host`.
    Host,
    /// `compose`.
    Compose,
}

impl Preference {
    /// Parses the value of `ONCEONLY_SERVICES` (`None`: unset).
    pub fn parse(value: Option<&str>) -> Result<Self, String> {
        match value.map(str::trim) {
            None | Some("") | Some("auto") => Ok(Self::Auto),
            Some("host") => Ok(Self::Host),
            Some("compose") => Ok(Self::Compose),
            Some(other) => Err(format!(
                "{ENV}={other:?}: expected `host`, `compose` or `auto` (or unset)"
            )),
        }
    }

    /// From the environment; panics on a value it does not know.
    pub fn from_env() -> Self {
        Self::parse(std::env::var(ENV).ok().as_deref()).unwrap_or_else(|e| panic!("{e}"))
    }
}

/// What was observed about one service on this machine.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Facts {
    /// `docker compose` answers for this repository's project (the CLI
    /// plugin is installed and the engine reachable).
    pub compose_available: bool,
    /// The compose project runs the service (for the private PostgreSQL:
    /// `postgres-private` or the shared `postgres`, since the private
    /// server goes where the shared one runs).
    pub compose_running: bool,
    /// The host tools that drive the service are installed.
    pub host_tools: bool,
}

/// The mechanism for `service` under preference `pref`, or why there is
/// none (with the commands that would make one work).
pub fn choose(service: Service, pref: Preference, facts: Facts) -> Result<Mechanism, String> {
    let compose = facts.compose_available;
    match pref {
        Preference::Compose if compose => Ok(Mechanism::Compose),
        Preference::Compose => Err(format!(
            "{ENV}=compose, but `docker compose` does not answer for {}: install Docker with \
             its compose plugin and {}",
            compose_file().display(),
            service.compose_hint()
        )),
        Preference::Host if facts.host_tools => Ok(Mechanism::Host),
        Preference::Host => Err(format!(
            "{ENV}=host, but the host tools for {service:?} are missing: {}; or {} and unset \
             {ENV}",
            service.host_hint(),
            service.compose_hint()
        )),
        Preference::Auto if compose && facts.compose_running => Ok(Mechanism::Compose),
        Preference::Auto if facts.host_tools => Ok(Mechanism::Host),
        Preference::Auto => Err(format!(
            "this test stops and starts {service:?}, but {} and its host tools are missing.\n\
             Either: {}\n\
             Or: {}\n\
             ({ENV}=host|compose forces one way.) These tests never skip.",
            if compose {
                "this repository's Docker Compose project does not run it"
            } else {
                "`docker compose` is not available"
            },
            service.compose_hint(),
            service.host_hint()
        )),
    }
}

impl Service {
    /// Its service name in `docker-compose.yml`.
    pub fn compose_name(self) -> &'static str {
        match self {
            Self::Redis => "redis",
            Self::RabbitMq => "rabbitmq",
            Self::PrivatePostgres => "postgres-private",
        }
    }

    /// Compose services whose running means the service is run by compose.
    fn compose_markers(self) -> &'static [&'static str] {
        match self {
            Self::Redis => &["redis"],
            Self::RabbitMq => &["rabbitmq"],
            Self::PrivatePostgres => &["postgres-private", "postgres"],
        }
    }

    fn host_tools_installed(self) -> bool {
        match self {
            Self::Redis => on_path("redis-cli") && on_path("redis-server"),
            Self::RabbitMq => on_path("rabbitmqctl"),
            Self::PrivatePostgres => on_path("runuser") && pg_server_binaries().is_some(),
        }
    }

    fn compose_hint(self) -> String {
        let services = match self {
            Self::PrivatePostgres => "postgres postgres-private",
            other => other.compose_name(),
        };
        format!(
            "run it under Docker Compose: `docker compose up -d --wait {services}` in {}",
            repo_root().display()
        )
    }

    fn host_hint(self) -> &'static str {
        match self {
            Self::Redis => {
                "install Redis on this machine (redis-server and redis-cli; Debian: \
                 `apt-get install redis-server`) and start it with `scripts/services`"
            }
            Self::RabbitMq => {
                "install RabbitMQ on this machine (rabbitmq-server, with rabbitmqctl; Debian: \
                 `apt-get install rabbitmq-server`) and start it with `scripts/services` (as root)"
            }
            Self::PrivatePostgres => {
                "install the PostgreSQL server (initdb and pg_ctl under \
                 /usr/lib/postgresql/VERSION/bin; Debian: `apt-get install postgresql`) and run \
                 the test as root (it runs them as user postgres through runuser)"
            }
        }
    }

    /// The mechanism for this service in this process: detected (or forced
    /// by `ONCEONLY_SERVICES`) on first use, then the same every time, so
    /// that a service the test stopped is started the same way. Panics,
    /// with the commands that would help, if there is none.
    pub fn mechanism(self) -> Mechanism {
        static CHOSEN: OnceLock<Mutex<HashMap<Service, Mechanism>>> = OnceLock::new();
        let mut chosen = CHOSEN
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        *chosen.entry(self).or_insert_with(|| {
            let pref = Preference::from_env();
            let running = if pref == Preference::Host {
                Err("not asked (ONCEONLY_SERVICES=host)".to_owned())
            } else {
                compose_running_services()
            };
            let facts = Facts {
                compose_available: running.is_ok(),
                compose_running: running
                    .as_ref()
                    .is_ok_and(|names| lists_any(names, self.compose_markers())),
                host_tools: self.host_tools_installed(),
            };
            choose(self, pref, facts).unwrap_or_else(|e| match &running {
                Err(why) if pref != Preference::Host => {
                    let why = why.lines().next().unwrap_or_default();
                    panic!("{e}\n(docker compose: {why})")
                }
                _ => panic!("{e}"),
            })
        })
    }

    /// Takes the service down: Redis shut down without saving (host:
    /// `redis-cli shutdown nosave`; compose: `docker compose stop redis`),
    /// RabbitMQ's app stopped (`rabbitmqctl stop_app`, inside the container
    /// under compose). Returns once it no longer answers.
    pub fn stop(self) {
        match (self, self.mechanism()) {
            (Self::Redis, Mechanism::Host) => {
                let _ = Command::new("redis-cli")
                    .args(["-u", &crate::redis_url(), "shutdown", "nosave"])
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status();
                let addr = redis_addr();
                assert!(
                    wait_until(Duration::from_secs(10), || !accepts(addr)),
                    "Redis still accepts connections on {addr} after `redis-cli shutdown nosave`"
                );
            }
            (Self::Redis, Mechanism::Compose) => run(compose().args(["stop", "redis"])),
            (Self::RabbitMq, Mechanism::Host) => run(Command::new("rabbitmqctl").arg("stop_app")),
            (Self::RabbitMq, Mechanism::Compose) => {
                run(compose().args(["exec", "-T", "rabbitmq", "rabbitmqctl", "stop_app"]))
            }
            (Self::PrivatePostgres, _) => {
                panic!("the private PostgreSQL is stopped through PrivatePg::stop_immediately")
            }
        }
    }

    /// Brings the service back after [`Service::stop`] and waits until it
    /// answers (host Redis: `scripts/services redis`; compose Redis:
    /// `docker compose up -d --wait redis`; RabbitMQ: `rabbitmqctl
    /// start_app`). Panics if that fails.
    pub fn start(self) {
        if let Err(e) = self.try_start() {
            panic!("{e}");
        }
    }

    /// [`Service::start`] without panicking, for drop guards.
    pub fn try_start(self) -> Result<(), String> {
        match (self, self.mechanism()) {
            (Self::Redis, Mechanism::Host) => {
                try_run(Command::new(repo_root().join("scripts/services")).arg("redis"))
            }
            (Self::Redis, Mechanism::Compose) => {
                try_run(compose().args(["up", "-d", "--wait", "redis"]))
            }
            (Self::RabbitMq, Mechanism::Host) => {
                try_run(Command::new("rabbitmqctl").arg("start_app"))
            }
            (Self::RabbitMq, Mechanism::Compose) => {
                try_run(compose().args(["exec", "-T", "rabbitmq", "rabbitmqctl", "start_app"]))
            }
            (Self::PrivatePostgres, _) => {
                Err("the private PostgreSQL is started through PrivatePg::start".into())
            }
        }
    }
}

/// The repository's root directory.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("integration-tests lives in the repository")
        .to_path_buf()
}

/// `<repo>/docker-compose.yml`.
pub fn compose_file() -> PathBuf {
    repo_root().join("docker-compose.yml")
}

/// `docker compose -f <repo>/docker-compose.yml`, to which a test adds a
/// subcommand.
pub fn compose() -> Command {
    let mut cmd = Command::new("docker");
    cmd.arg("compose").arg("-f").arg(compose_file());
    cmd
}

/// The services the compose project runs, or why that could not be asked.
fn compose_running_services() -> Result<Vec<String>, String> {
    if !on_path("docker") {
        return Err("no `docker` on PATH".into());
    }
    let out = compose()
        .args(["ps", "--services", "--status", "running"])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run docker: {e}"))?;
    if !out.status.success() {
        return Err(describe("docker compose ps", &out));
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| l.trim().to_owned())
        .filter(|l| !l.is_empty())
        .collect())
}

/// Whether `listed` (output lines of `ps --services`) has one of `names`.
pub fn lists_any(listed: &[String], names: &[&str]) -> bool {
    listed.iter().any(|l| names.contains(&l.as_str()))
}

/// Runs `cmd` to completion; panics with its output if it fails.
pub fn run(cmd: &mut Command) {
    if let Err(e) = try_run(cmd) {
        panic!("{e}");
    }
}

/// Runs `cmd` to completion (standard input closed); its output if it fails.
pub fn try_run(cmd: &mut Command) -> Result<(), String> {
    try_run_with_input(cmd, None)
}

/// Runs `cmd` with `input` on its standard input; panics with its output
/// if it fails.
pub fn run_with_input(cmd: &mut Command, input: &[u8]) {
    if let Err(e) = try_run_with_input(cmd, Some(input)) {
        panic!("{e}");
    }
}

fn try_run_with_input(cmd: &mut Command, input: Option<&[u8]>) -> Result<(), String> {
    let shown = show(cmd);
    let mut child = cmd
        .stdin(if input.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("`{shown}` could not run: {e}"))?;
    if let (Some(input), Some(mut stdin)) = (input, child.stdin.take()) {
        stdin
            .write_all(input)
            .map_err(|e| format!("`{shown}`: writing its input: {e}"))?;
    }
    let out = child
        .wait_with_output()
        .map_err(|e| format!("`{shown}`: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(describe(&shown, &out))
    }
}

/// Runs `cmd` and returns its standard output; panics if it fails.
pub fn output(cmd: &mut Command) -> String {
    let shown = show(cmd);
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("`{shown}` could not run: {e}"));
    assert!(out.status.success(), "{}", describe(&shown, &out));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn show(cmd: &Command) -> String {
    std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|a| a.to_string_lossy())
        .collect::<Vec<_>>()
        .join(" ")
}

fn describe(what: &str, out: &Output) -> String {
    format!(
        "`{what}` failed ({}): {}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout).trim(),
        String::from_utf8_lossy(&out.stderr).trim()
    )
}

/// Whether `program` is an executable file in a directory of `PATH`.
pub fn on_path(program: &str) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::env::var_os("PATH").is_some_and(|path| {
        std::env::split_paths(&path).any(|dir| {
            std::fs::metadata(dir.join(program))
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
    })
}

/// The directory of `initdb` and `pg_ctl` of the installed PostgreSQL
/// server, if there is one.
pub fn pg_server_binaries() -> Option<PathBuf> {
    let mut bins: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .flatten()
        .map(|v| v.path().join("bin"))
        .filter(|b| b.join("initdb").exists() && b.join("pg_ctl").exists())
        .collect();
    // The newest version (numeric directory names).
    bins.sort_by_key(|b| {
        b.parent()
            .and_then(|v| v.file_name())
            .and_then(|v| v.to_str())
            .and_then(|v| v.parse::<u32>().ok())
            .unwrap_or(0)
    });
    bins.pop()
}

/// The port in `docker compose port SERVICE PORT` output
/// (`127.0.0.1:54329`, `[::1]:54329`, `0.0.0.0:54329`).
pub fn published_port(output: &str) -> Option<u16> {
    output
        .lines()
        .find_map(|l| l.trim().rsplit_once(':')?.1.parse().ok())
}

/// The lines of a `pg_hba.conf` written for a server on the host, for the
/// same server in a container: its clients come through the port Docker
/// publishes on the host's 127.0.0.1, so PostgreSQL sees them from the
/// Docker network instead. The address of a `host*` line that means "this
/// machine" (`127.0.0.1/32`, `127.0.0.0/8`, `::1/128`, `localhost`,
/// `samehost`, or `127.0.0.1` with mask `255.255.255.255`) becomes `all`;
/// every other line stays as it is (those addresses match nothing there
/// either).
pub fn hba_for_container(lines: &[String]) -> Vec<String> {
    const LOOPBACK: &[&str] = &[
        "127.0.0.1/32",
        "127.0.0.0/8",
        "::1/128",
        "localhost",
        "samehost",
    ];
    lines
        .iter()
        .map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let is_host = fields.first().is_some_and(|t| t.starts_with("host"));
            if !is_host || fields.len() < 5 {
                return line.clone();
            }
            let mut rest = 4;
            if fields[3] == "127.0.0.1" && fields[4] == "255.255.255.255" {
                rest = 5;
            } else if !LOOPBACK.contains(&fields[3]) {
                return line.clone();
            }
            let mut out = fields[..3].to_vec();
            out.push("all");
            out.extend_from_slice(&fields[rest..]);
            out.join(" ")
        })
        .collect()
}

/// Whether `addr` accepts a TCP connection (within a second).
pub fn accepts(addr: SocketAddr) -> bool {
    TcpStream::connect_timeout(&addr, Duration::from_secs(1)).is_ok()
}

/// Polls `cond` every 100 ms until it holds (true) or `limit` passes (false).
pub fn wait_until(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Host and port of `ONCEONLY_REDIS_URL`.
fn redis_addr() -> SocketAddr {
    let url = crate::redis_url();
    let rest = url.split_once("://").map_or(url.as_str(), |(_, r)| r);
    let authority = rest.split('/').next().unwrap_or(rest);
    let hostport = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    let hostport = if hostport.contains(':') {
        hostport.to_owned()
    } else {
        format!("{hostport}:6379")
    };
    hostport
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .unwrap_or_else(|| panic!("cannot resolve the Redis address in {url}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: [Preference; 3] = [Preference::Auto, Preference::Host, Preference::Compose];

    fn facts(compose_available: bool, compose_running: bool, host_tools: bool) -> Facts {
        Facts {
            compose_available,
            compose_running,
            host_tools,
        }
    }

    #[test]
    fn preference_parses_the_documented_values_only() {
        assert_eq!(Preference::parse(None), Ok(Preference::Auto));
        assert_eq!(Preference::parse(Some("")), Ok(Preference::Auto));
        assert_eq!(Preference::parse(Some("auto")), Ok(Preference::Auto));
        assert_eq!(Preference::parse(Some("host")), Ok(Preference::Host));
        assert_eq!(
            Preference::parse(Some(" compose ")),
            Ok(Preference::Compose)
        );
        let err = Preference::parse(Some("docker")).unwrap_err();
        assert!(
            err.contains("ONCEONLY_SERVICES") && err.contains("compose"),
            "{err}"
        );
    }

    #[test]
    fn auto_prefers_a_running_compose_service_over_host_tools() {
        for service in [Service::Redis, Service::RabbitMq, Service::PrivatePostgres] {
            assert_eq!(
                choose(service, Preference::Auto, facts(true, true, true)),
                Ok(Mechanism::Compose)
            );
            assert_eq!(
                choose(service, Preference::Auto, facts(true, true, false)),
                Ok(Mechanism::Compose)
            );
        }
    }

    #[test]
    fn auto_uses_the_host_when_compose_does_not_run_it() {
        // Docker present but the service is not in the running project, and
        // Docker absent or its engine unreachable (this shape of machine).
        for (available, running) in [(true, false), (false, false), (false, true)] {
            assert_eq!(
                choose(
                    Service::Redis,
                    Preference::Auto,
                    facts(available, running, true)
                ),
                Ok(Mechanism::Host),
                "available={available} running={running}"
            );
        }
    }

    #[test]
    fn auto_without_either_fails_with_both_commands() {
        for available in [true, false] {
            let err = choose(
                Service::RabbitMq,
                Preference::Auto,
                facts(available, false, false),
            )
            .unwrap_err();
            assert!(
                err.contains("docker compose up -d --wait rabbitmq"),
                "{err}"
            );
            assert!(err.contains("apt-get install rabbitmq-server"), "{err}");
            assert!(err.contains("never skip"), "{err}");
        }
        let err = choose(
            Service::PrivatePostgres,
            Preference::Auto,
            facts(false, false, false),
        )
        .unwrap_err();
        assert!(
            err.contains("docker compose up -d --wait postgres postgres-private"),
            "{err}"
        );
        assert!(err.contains("initdb"), "{err}");
    }

    #[test]
    fn forced_compose_needs_only_a_working_docker_compose() {
        assert_eq!(
            choose(
                Service::Redis,
                Preference::Compose,
                facts(true, false, true)
            ),
            Ok(Mechanism::Compose)
        );
        let err = choose(
            Service::Redis,
            Preference::Compose,
            facts(false, false, true),
        )
        .unwrap_err();
        assert!(err.contains("ONCEONLY_SERVICES=compose"), "{err}");
        assert!(err.contains("docker compose up -d --wait redis"), "{err}");
    }

    #[test]
    fn forced_host_ignores_compose_and_needs_the_tools() {
        assert_eq!(
            choose(Service::RabbitMq, Preference::Host, facts(true, true, true)),
            Ok(Mechanism::Host)
        );
        let err = choose(
            Service::RabbitMq,
            Preference::Host,
            facts(true, true, false),
        )
        .unwrap_err();
        assert!(err.contains("ONCEONLY_SERVICES=host"), "{err}");
        assert!(err.contains("rabbitmqctl"), "{err}");
    }

    #[test]
    fn every_preference_yields_a_mechanism_or_an_explanation() {
        for pref in ALL {
            for bits in 0..8u8 {
                let f = facts(bits & 1 != 0, bits & 2 != 0, bits & 4 != 0);
                match choose(Service::Redis, pref, f) {
                    Ok(Mechanism::Compose) => assert!(f.compose_available, "{pref:?} {f:?}"),
                    Ok(Mechanism::Host) => assert!(f.host_tools, "{pref:?} {f:?}"),
                    Err(e) => assert!(e.contains("docker compose up"), "{pref:?} {f:?}: {e}"),
                }
            }
        }
    }

    #[test]
    fn the_private_server_follows_the_shared_postgres() {
        let listed = ["mariadb".to_owned(), "postgres".to_owned()];
        assert!(lists_any(
            &listed,
            Service::PrivatePostgres.compose_markers()
        ));
        assert!(!lists_any(&listed, Service::Redis.compose_markers()));
        assert!(!lists_any(&[], Service::RabbitMq.compose_markers()));
    }

    #[test]
    fn published_port_reads_docker_compose_port_output() {
        assert_eq!(published_port("127.0.0.1:54329\n"), Some(54329));
        assert_eq!(published_port("[::1]:54329"), Some(54329));
        assert_eq!(published_port("0.0.0.0:5432\n[::]:5432\n"), Some(5432));
        assert_eq!(published_port(""), None);
        assert_eq!(published_port(":0\n"), Some(0));
    }

    #[test]
    fn hba_loopback_addresses_become_all_in_a_container() {
        let lines: Vec<String> = [
            "local all all trust",
            "hostssl all all 127.0.0.1/32 cert clientcert=verify-full",
            "hostnossl all all 127.0.0.1/32 reject",
            "host all all ::1/128 trust",
            "host  all  postgres  127.0.0.1  255.255.255.255  trust",
            "host all all samehost scram-sha-256",
            "host all all 10.0.0.0/8 reject",
            "# host all all 127.0.0.1/32 trust",
            "",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        assert_eq!(
            hba_for_container(&lines),
            [
                "local all all trust",
                "hostssl all all all cert clientcert=verify-full",
                "hostnossl all all all reject",
                "host all all all trust",
                "host all postgres all trust",
                "host all all all scram-sha-256",
                "host all all 10.0.0.0/8 reject",
                "# host all all 127.0.0.1/32 trust",
                "",
            ]
        );
    }

    #[test]
    fn compose_commands_name_this_repositorys_file() {
        let cmd = compose();
        let args: Vec<_> = cmd.get_args().map(|a| a.to_owned()).collect();
        assert_eq!(cmd.get_program(), "docker");
        assert_eq!(args[0], "compose");
        assert_eq!(args[1], "-f");
        assert!(Path::new(&args[2]).ends_with("docker-compose.yml"));
        assert!(
            Path::new(&args[2])
                .parent()
                .unwrap()
                .join("Cargo.toml")
                .exists()
        );
    }
}
