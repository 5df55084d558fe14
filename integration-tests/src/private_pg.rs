//! A throwaway PostgreSQL server of a test's own (its own data directory and
//! port, so stopping or reconfiguring it disturbs no other test). Where it
//! runs is decided by [`crate::services`]:
//!
//! - on the host: the host's `initdb` and `pg_ctl`, run as the `postgres`
//!   user (through `runuser`, so as root), data in a temporary directory;
//! - under Docker Compose: service `postgres-private` of `docker-compose.yml`
//!   (127.0.0.1:54329), replaced by a fresh container (and volume) on every
//!   start, so it begins as empty as after `initdb`.
//!
//! Settings, `pg_hba.conf` lines and files given to the builder are applied
//! in both cases: under compose they are written into the container's data
//! directory (`docker compose exec`) and the container is restarted, and
//! the loopback addresses of `hba` lines are rewritten for the container
//! ([`crate::services::hba_for_container`]).
//!
//! Extension point for a server that needs more than that under compose
//! (another port, an image with other extensions, files mounted from the
//! repository): add a service to `docker-compose.yml` that publishes
//! `127.0.0.1:PORT:5432` and pass its name to
//! [`PrivatePgBuilder::compose_service`]. The builder checks that the
//! service publishes the builder's port, and fails loudly if not.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::services::{self, Mechanism, Service, compose};
use crate::unique;

/// A private PostgreSQL server, stopped and deleted on drop.
pub struct PrivatePg {
    port: u16,
    data: PathBuf,
    how: How,
}

enum How {
    Host { bin: PathBuf, log: PathBuf },
    Compose { service: String },
}

/// Settings of a [`PrivatePg`] before it starts.
pub struct PrivatePgBuilder {
    port: u16,
    settings: Vec<(String, String)>,
    hba: Option<Vec<String>>,
    files: Vec<(String, Vec<u8>)>,
    compose_service: Option<String>,
}

/// The compose service used when the builder names none.
pub const DEFAULT_COMPOSE_SERVICE: &str = "postgres-private";

impl PrivatePg {
    /// A server on 127.0.0.1 with trust auth. Under Docker Compose it
    /// listens on `port`, which must be the one its compose service
    /// publishes (54329 for `postgres-private`). On the host it listens on a
    /// free port below the kernel's ephemeral range instead, so that no
    /// client socket of a concurrent test can take it between a stop and a
    /// restart: read it with [`PrivatePg::port`] or [`PrivatePg::url`].
    pub fn builder(port: u16) -> PrivatePgBuilder {
        PrivatePgBuilder {
            port,
            settings: Vec::new(),
            hba: None,
            files: Vec::new(),
            compose_service: None,
        }
    }

    /// The URL of database `postgres` as user `postgres` on 127.0.0.1.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The data directory (where [`PrivatePgBuilder::file`] puts files).
    /// Under Docker Compose, a path inside the container.
    pub fn data_dir(&self) -> &Path {
        &self.data
    }

    /// How it runs: on the host or under Docker Compose.
    pub fn mechanism(&self) -> Mechanism {
        match self.how {
            How::Host { .. } => Mechanism::Host,
            How::Compose { .. } => Mechanism::Compose,
        }
    }

    fn ctl(bin: &Path, data: &Path, args: &[&str]) -> bool {
        Command::new("runuser")
            .args(["-u", "postgres", "--"])
            .arg(bin.join("pg_ctl"))
            .arg("-D")
            .arg(data)
            .args(args)
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }

    /// Starts the server and waits until it accepts connections.
    pub fn start(&self) {
        if let Err(why) = self.try_start() {
            panic!("{why}");
        }
    }

    /// Starts the server; on the host, what its log says if it did not.
    fn try_start(&self) -> Result<(), String> {
        match &self.how {
            How::Host { bin, log } => {
                let opts = format!(
                    "-p {} -k /tmp -c listen_addresses=127.0.0.1 -c fsync=off",
                    self.port
                );
                let path = log.to_string_lossy().into_owned();
                if !Self::ctl(bin, &self.data, &["-w", "-l", &path, "-o", &opts, "start"]) {
                    let text = std::fs::read_to_string(log).unwrap_or_default();
                    return Err(format!(
                        "private PostgreSQL on port {} did not start; {path}:\n{text}",
                        self.port
                    ));
                }
                Ok(())
            }
            How::Compose { service } => {
                compose_up(service);
                Ok(())
            }
        }
    }

    /// Stops the server the way a crash would: `pg_ctl stop -m immediate`
    /// on the host, `docker compose kill -s KILL` under compose.
    pub fn stop_immediately(&self) {
        match &self.how {
            How::Host { bin, .. } => assert!(
                Self::ctl(bin, &self.data, &["-m", "immediate", "stop"]),
                "pg_ctl stop failed"
            ),
            How::Compose { service } => {
                services::run(compose().args(["kill", "-s", "KILL", service]))
            }
        }
    }
}

impl PrivatePgBuilder {
    /// A `postgresql.conf` setting (`value` is written as given, so quote
    /// strings: `"'server.crt'"`).
    pub fn setting(mut self, name: &str, value: &str) -> Self {
        self.settings.push((name.into(), value.into()));
        self
    }

    /// Replaces `pg_hba.conf` with these lines.
    pub fn hba(mut self, lines: &[&str]) -> Self {
        self.hba = Some(lines.iter().map(|l| l.to_string()).collect());
        self
    }

    /// A file in the data directory, owned by `postgres` with mode 0600
    /// (what PostgreSQL demands of a TLS key).
    pub fn file(mut self, name: &str, contents: impl Into<Vec<u8>>) -> Self {
        self.files.push((name.into(), contents.into()));
        self
    }

    /// Under Docker Compose, run this service of `docker-compose.yml`
    /// instead of `postgres-private` (it must publish `127.0.0.1:PORT:5432`
    /// with the builder's port). No effect on the host.
    pub fn compose_service(mut self, name: &str) -> Self {
        self.compose_service = Some(name.into());
        self
    }

    /// Creates the server (`initdb`, or a fresh container), writes the
    /// configuration and starts it.
    pub fn start(self) -> PrivatePg {
        match Service::PrivatePostgres.mechanism() {
            Mechanism::Host => self.start_on_host(),
            Mechanism::Compose => self.start_in_compose(),
        }
    }

    fn start_on_host(self) -> PrivatePg {
        let bin = services::pg_server_binaries().expect(
            "PostgreSQL server binaries (initdb, pg_ctl) under /usr/lib/postgresql: \
             install the postgresql package (scripts/services uses it too)",
        );
        let data = std::env::temp_dir().join(unique("onceonly-pg"));
        std::fs::create_dir_all(&data).expect("private PostgreSQL data directory");
        chown_postgres(&data);
        let ok = Command::new("runuser")
            .args(["-u", "postgres", "--"])
            .arg(bin.join("initdb"))
            .args(["-A", "trust", "-U", "postgres", "-D"])
            .arg(&data)
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        assert!(
            ok,
            "initdb failed (the test runs it as the postgres user through runuser)"
        );
        for (name, contents) in &self.files {
            let path = data.join(name);
            std::fs::write(&path, contents).expect("file in the data directory");
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
                .expect("chmod 0600");
            chown_postgres(&path);
        }
        if !self.settings.is_empty() {
            append(&data.join("postgresql.conf"), &self.conf());
        }
        if let Some(hba) = &self.hba {
            std::fs::write(data.join("pg_hba.conf"), hba.join("\n") + "\n").expect("pg_hba.conf");
        }
        let log = std::env::temp_dir().join(format!("{}.log", unique("onceonly-private-pg")));
        let mut pg = PrivatePg {
            port: host_port(),
            data,
            how: How::Host { bin, log },
        };
        // Another process may bind the port between the choice and the
        // start: choose again.
        for attempt in 1.. {
            match pg.try_start() {
                Ok(()) => break,
                Err(why) if attempt < 3 && why.contains("already in use") => {
                    pg.port = host_port();
                }
                Err(why) => panic!("{why}"),
            }
        }
        pg
    }

    fn start_in_compose(self) -> PrivatePg {
        let service = self
            .compose_service
            .clone()
            .unwrap_or_else(|| DEFAULT_COMPOSE_SERVICE.into());
        // A new container and anonymous volume: as empty as after initdb.
        services::run(compose().args(["rm", "--stop", "--force", "--volumes", &service]));
        compose_up(&service);
        let mut pg = PrivatePg {
            port: self.port,
            data: PathBuf::new(),
            how: How::Compose {
                service: service.clone(),
            },
        };
        // From here on, a failure drops `pg`, which removes the container.
        let published = services::output(compose().args(["port", &service, "5432"]));
        assert_eq!(
            services::published_port(&published),
            Some(self.port),
            "compose service {service} publishes PostgreSQL on {published:?}, but the test asked \
             for port {}: add a service publishing \"127.0.0.1:{}:5432\" to docker-compose.yml \
             and name it with PrivatePgBuilder::compose_service",
            self.port,
            self.port
        );
        let data = services::output(compose().args(["exec", "-T", &service, "printenv", "PGDATA"]))
            .trim()
            .to_owned();
        assert!(
            data.starts_with('/'),
            "PGDATA of compose service {service}: {data:?}"
        );
        pg.data = PathBuf::from(data);
        if self.files.is_empty() && self.settings.is_empty() && self.hba.is_none() {
            return pg;
        }
        // `sh -c SCRIPT sh ARG`: the argument is $1, never parsed by a shell.
        let write = |script: &str, arg: &str, input: &[u8]| {
            services::run_with_input(
                compose().args(["exec", "-T", &service, "sh", "-c", script, "sh", arg]),
                input,
            );
        };
        for (name, contents) in &self.files {
            write(
                "f=\"$PGDATA/$1\" && cat > \"$f\" && chown postgres:postgres \"$f\" \
                 && chmod 0600 \"$f\"",
                name,
                contents,
            );
        }
        if !self.settings.is_empty() {
            write(
                "cat >> \"$PGDATA/$1\"",
                "postgresql.conf",
                self.conf().as_bytes(),
            );
        }
        if let Some(hba) = &self.hba {
            let lines = services::hba_for_container(hba);
            write(
                "cat > \"$PGDATA/$1\"",
                "pg_hba.conf",
                (lines.join("\n") + "\n").as_bytes(),
            );
        }
        // Restart to load them (some, like ssl files, need a reload at
        // least; a restart covers every setting).
        services::run(compose().args(["stop", &service]));
        compose_up(&service);
        pg
    }

    fn conf(&self) -> String {
        self.settings
            .iter()
            .map(|(k, v)| format!("{k} = {v}\n"))
            .collect()
    }
}

/// `docker compose up -d --wait SERVICE`: starts it (creating it if need be)
/// and waits for its health check (`pg_isready` over TCP).
fn compose_up(service: &str) {
    if let Err(e) = services::try_run(compose().args(["up", "-d", "--wait", service])) {
        let logs = compose()
            .args(["logs", "--tail", "30", service])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        panic!("private PostgreSQL (compose service {service}) did not start: {e}\n{logs}");
    }
}

impl Drop for PrivatePg {
    fn drop(&mut self) {
        match &self.how {
            How::Host { bin, .. } => {
                Self::ctl(bin, &self.data, &["-m", "immediate", "stop"]);
                let _ = std::fs::remove_dir_all(&self.data);
            }
            How::Compose { service } => {
                let _ = services::try_run(compose().args([
                    "rm",
                    "--stop",
                    "--force",
                    "--volumes",
                    service,
                ]));
            }
        }
    }
}

fn append(path: &Path, text: &str) {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    f.write_all(text.as_bytes()).expect("append");
}

/// A port below the ephemeral range (32768 and up on Linux) that nothing
/// listens on now. Ephemeral ports are what the kernel gives outgoing and
/// `:0` sockets, so a fixed or `:0`-chosen port in that range can be taken by
/// any test's client between a server's stop and its restart; a port below
/// it can only be taken by another explicit bind, which the random start
/// makes unlikely and the bind check rules out at the moment of choosing.
fn host_port() -> u16 {
    const LOW: u16 = 20_000;
    const HIGH: u16 = 32_000;
    let start = fastrand::u16(LOW..HIGH);
    (start..HIGH)
        .chain(LOW..start)
        .find(|&port| std::net::TcpListener::bind(("127.0.0.1", port)).is_ok())
        .expect("a free port between 20000 and 32000 for a private PostgreSQL")
}

fn chown_postgres(path: &Path) {
    let ok = Command::new("chown")
        .args(["postgres:postgres"])
        .arg(path)
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "chown postgres {}", path.display());
}
