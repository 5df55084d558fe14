//! A throwaway PostgreSQL server of a test's own (its own data directory and
//! port, so stopping or reconfiguring it disturbs no other test), run as the
//! `postgres` user with the host's `initdb` and `pg_ctl`.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::unique;

/// A private PostgreSQL server, stopped and deleted on drop.
pub struct PrivatePg {
    bin: PathBuf,
    data: PathBuf,
    port: u16,
    log: PathBuf,
}

/// Settings of a [`PrivatePg`] before it starts.
pub struct PrivatePgBuilder {
    port: u16,
    settings: Vec<(String, String)>,
    hba: Option<Vec<String>>,
    files: Vec<(String, Vec<u8>)>,
}

impl PrivatePg {
    /// A server on `port` (127.0.0.1, trust auth, socket in /tmp).
    pub fn builder(port: u16) -> PrivatePgBuilder {
        PrivatePgBuilder {
            port,
            settings: Vec::new(),
            hba: None,
            files: Vec::new(),
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
    pub fn data_dir(&self) -> &Path {
        &self.data
    }

    fn ctl(&self, args: &[&str]) -> bool {
        Command::new("runuser")
            .args(["-u", "postgres", "--"])
            .arg(self.bin.join("pg_ctl"))
            .arg("-D")
            .arg(&self.data)
            .args(args)
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }

    /// Starts the server and waits until it accepts connections.
    pub fn start(&self) {
        let opts = format!(
            "-p {} -k /tmp -c listen_addresses=127.0.0.1 -c fsync=off",
            self.port
        );
        let log = self.log.to_string_lossy().into_owned();
        assert!(
            self.ctl(&["-w", "-l", &log, "-o", &opts, "start"]),
            "private PostgreSQL did not start; see {log}"
        );
    }

    /// Stops the server the way a crash would (`pg_ctl stop -m immediate`).
    pub fn stop_immediately(&self) {
        assert!(self.ctl(&["-m", "immediate", "stop"]), "pg_ctl stop failed");
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

    /// Runs `initdb`, writes the configuration and starts the server.
    pub fn start(self) -> PrivatePg {
        let bin = server_binaries();
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
            let conf: String = self
                .settings
                .iter()
                .map(|(k, v)| format!("{k} = {v}\n"))
                .collect();
            append(&data.join("postgresql.conf"), &conf);
        }
        if let Some(hba) = &self.hba {
            std::fs::write(data.join("pg_hba.conf"), hba.join("\n") + "\n").expect("pg_hba.conf");
        }
        let log = std::env::temp_dir().join(format!("{}.log", unique("onceonly-private-pg")));
        let pg = PrivatePg {
            bin,
            data,
            port: self.port,
            log,
        };
        pg.start();
        pg
    }
}

impl Drop for PrivatePg {
    fn drop(&mut self) {
        self.ctl(&["-m", "immediate", "stop"]);
        let _ = std::fs::remove_dir_all(&self.data);
    }
}

/// The directory of `initdb` and `pg_ctl` of the installed server.
fn server_binaries() -> PathBuf {
    std::fs::read_dir("/usr/lib/postgresql")
        .ok()
        .and_then(|versions| {
            versions
                .flatten()
                .map(|v| v.path().join("bin"))
                .find(|b| b.join("initdb").exists())
        })
        .expect(
            "PostgreSQL server binaries (initdb, pg_ctl) under /usr/lib/postgresql: \
             install the postgresql package (scripts/services uses it too)",
        )
}

fn append(path: &Path, text: &str) {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    f.write_all(text.as_bytes()).expect("append");
}

fn chown_postgres(path: &Path) {
    let ok = Command::new("chown")
        .args(["postgres:postgres"])
        .arg(path)
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "chown postgres {}", path.display());
}
