//! A PostgreSQL server of the test's own: `initdb` and `pg_ctl` on a temporary directory and a
//! free loopback port, stopped and removed when dropped.

use std::{
    path::{Path, PathBuf},
    process::Command,
    sync::OnceLock,
};

/// A PostgreSQL cluster of the test's own, on `127.0.0.1` and a free port.
///
/// Finds `initdb` and `pg_ctl` under `/usr/lib/postgresql/*/bin` (the newest version) or on the
/// `PATH`. PostgreSQL refuses to run as root, so when the tests run as root the server runs as
/// the `postgres` user (`runuser`). Fails with a message that says how to install PostgreSQL
/// when it is missing.
#[derive(Debug)]
pub struct PostgresServer {
    bin: PathBuf,
    dir: PathBuf,
    port: u16,
    as_postgres: bool,
    running: bool,
}

/// Where a test process keeps the cluster it copies for each server (its pid follows).
const TEMPLATE_PREFIX: &str = "backstop-pg-template-";

/// This process's template cluster, made by the first server it starts.
static TEMPLATE: OnceLock<PathBuf> = OnceLock::new();

/// An empty directory at `dir`, the postgres user's when the tests run as root (PostgreSQL
/// refuses to run as root, so its servers run as that user).
fn fresh_dir(dir: &Path, as_postgres: bool) {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).expect("a temporary directory");
    if as_postgres {
        let mut chown = Command::new("chown");
        chown.arg("postgres:postgres").arg(dir);
        succeed(
            chown,
            &format!("giving {} to the postgres user", dir.display()),
        );
    }
}

/// Runs `cmd` to its end; a failure stops the test with what `cmd` wrote to stderr.
fn succeed(mut cmd: Command, what: &str) {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("{what} could not start: {e}"));
    assert!(
        out.status.success(),
        "{what} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn find_bin_dir() -> Option<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join("bin"))
        .filter(|p| p.join("initdb").exists() && p.join("pg_ctl").exists())
        .collect();
    found.sort_by_key(|p| {
        p.parent()
            .and_then(Path::file_name)
            .and_then(|v| v.to_str())
            .and_then(|v| v.parse::<u32>().ok())
            .unwrap_or(0)
    });
    if let Some(newest) = found.pop() {
        return Some(newest);
    }
    let out = Command::new("pg_config").arg("--bindir").output().ok()?;
    let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    dir.join("initdb").exists().then_some(dir)
}

fn bin_dir() -> PathBuf {
    if let Some(dir) = find_bin_dir() {
        return dir;
    }
    panic!(
        "PostgreSQL is not installed: the PostgreSQL tests run their own server with initdb and \
         pg_ctl (looked in /usr/lib/postgresql/*/bin and pg_config --bindir). Install it with \
         `apt-get install postgresql` (Debian, Ubuntu) or your system's package"
    );
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

impl PostgresServer {
    /// Whether PostgreSQL's server binaries are installed (for a demo that can do without).
    pub fn available() -> bool {
        find_bin_dir().is_some()
    }

    /// Creates a cluster in a fresh temporary directory and starts it (fsync off: a test's
    /// data does not need to survive the machine, only the server's own crashes).
    pub async fn start() -> PostgresServer {
        let port = crate::restartable_port(false);
        let bin = bin_dir();
        let dir = std::env::temp_dir().join(format!("backstop-pg-{}-{port}", std::process::id()));
        let as_postgres = is_root();
        fresh_dir(&dir, as_postgres);
        let mut server = PostgresServer {
            bin,
            dir,
            port,
            as_postgres,
            running: false,
        };
        server.copy_template();
        // The port was free when it was picked, but another test may take it before the
        // server binds it: then another port.
        for _ in 0..5 {
            match server.launch() {
                Ok(()) => return server,
                Err(log) if log.contains("Address already in use") => {
                    server.port = crate::restartable_port(false);
                }
                Err(log) => panic!("PostgreSQL did not start: {log}"),
            }
        }
        panic!("PostgreSQL found no free loopback port in 5 tries");
    }

    /// Gives the server a fresh data directory: a copy of a cluster `initdb` made once per test
    /// process (on a 2-core machine initdb takes about 1.5 s; the copy about 0.15 s).
    fn copy_template(&self) {
        let template = TEMPLATE.get_or_init(|| self.make_template());
        let mut cp = Command::new("cp");
        cp.arg("-a").arg(template).arg(self.dir.join("data"));
        succeed(cp, "copying the template cluster");
    }

    /// Runs `initdb` into this process's template directory, removing the templates of test
    /// processes that have ended.
    fn make_template(&self) -> PathBuf {
        let parent = std::env::temp_dir();
        for entry in std::fs::read_dir(&parent).into_iter().flatten().flatten() {
            let name = entry.file_name();
            let Some(pid) = name.to_str().and_then(|n| n.strip_prefix(TEMPLATE_PREFIX)) else {
                continue;
            };
            if !Path::new("/proc").join(pid).exists() {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
        let dir = parent.join(format!("{TEMPLATE_PREFIX}{}", std::process::id()));
        fresh_dir(&dir, self.as_postgres);
        let data = dir.join("data");
        let mut initdb = self.command("initdb");
        initdb.arg("-D").arg(&data).args([
            "-A",
            "trust",
            "-U",
            "postgres",
            "--no-sync",
            "-E",
            "UTF8",
        ]);
        succeed(initdb, "initdb");
        data
    }

    fn command(&self, tool: &str) -> Command {
        let path = self.bin.join(tool);
        if self.as_postgres {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(path);
            c
        } else {
            Command::new(path)
        }
    }

    /// Starts the server on `self.port`; `Err`: what pg_ctl and the server's log said.
    fn launch(&mut self) -> Result<(), String> {
        let data = self.dir.join("data");
        let options = format!(
            "-p {} -c listen_addresses=127.0.0.1 -k {} -c fsync=off -c max_connections=200",
            self.port,
            self.dir.display()
        );
        let out = self
            .command("pg_ctl")
            .arg("-D")
            .arg(&data)
            .args(["-o", &options, "-l"])
            .arg(self.dir.join("log"))
            .args(["-w", "-t", "30", "start"])
            .output()
            .expect("pg_ctl runs");
        if !out.status.success() {
            return Err(format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                std::fs::read_to_string(self.dir.join("log")).unwrap_or_default()
            ));
        }
        self.running = true;
        Ok(())
    }

    /// `postgres://postgres@127.0.0.1:PORT/postgres`.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// Stops it at once (`pg_ctl stop -m immediate`: a crash, as far as the data is concerned).
    pub fn stop(&mut self) {
        if !self.running {
            return;
        }
        let _ = self
            .command("pg_ctl")
            .arg("-D")
            .arg(self.dir.join("data"))
            .args(["-m", "immediate", "-w", "stop"])
            .output();
        self.running = false;
    }

    /// Starts it again on the same port, with its data.
    pub fn restart(&mut self) {
        self.stop();
        if let Err(log) = self.launch() {
            panic!("PostgreSQL did not restart on port {}: {log}", self.port);
        }
    }
}

impl Drop for PostgresServer {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
