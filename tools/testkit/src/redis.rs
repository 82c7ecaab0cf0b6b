//! A `redis-server` of a test's own, as one Redis, a cluster node, a replica or a Sentinel.

use crate::restartable_port;
use std::time::Duration;

/// A `redis-server` of the test's own on a free loopback port, stopped when dropped.
///
/// Needs `redis-server` on the `PATH`.
#[derive(Debug)]
pub struct RedisServer {
    child: Option<std::process::Child>,
    port: u16,
    /// With a directory, every write is appended and fsynced before Redis replies, so a
    /// killed server restarts with its data.
    dir: Option<std::path::PathBuf>,
    /// What it runs as.
    role: Role,
    /// What it prints (its log), appended at every start, removed with it: a server that does
    /// not start, or does not start again, says why in the test's panic.
    log: tempfile::NamedTempFile,
}

/// What a [`RedisServer`] runs as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Role {
    /// A Redis of its own.
    Alone,
    /// A cluster node (`--cluster-enabled yes`, its cluster bus on `port + 10000`).
    ClusterNode,
    /// A replica of the Redis on this port.
    ReplicaOf(u16),
    /// A Sentinel monitoring the primary on this port as `backstop`.
    Sentinel(u16),
}

impl RedisServer {
    /// Starts one (keeping nothing on disk) and waits until it answers `PING`.
    pub async fn start() -> RedisServer {
        let mut server = RedisServer {
            child: None,
            port: restartable_port(false),
            dir: None,
            role: Role::Alone,
            log: new_log(),
        };
        server.launch_on_a_free_port().await;
        server
    }

    /// A persistent node of a Redis Cluster, not yet part of one (see [`RedisCluster`]).
    pub(crate) async fn start_cluster_node() -> RedisServer {
        Self::start_as(Role::ClusterNode).await
    }

    /// A persistent server in `role`, on a free port (and, for a cluster node, a free bus port).
    pub(crate) async fn start_as(role: Role) -> RedisServer {
        let pick = || restartable_port(role == Role::ClusterNode);
        let port = pick();
        let dir =
            std::env::temp_dir().join(format!("backstop-redis-{}-{port}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temporary directory");
        let mut server = RedisServer {
            child: None,
            port,
            dir: Some(dir),
            role,
            log: new_log(),
        };
        for _ in 0..5 {
            if server.launch().await {
                return server;
            }
            server.port = pick();
        }
        panic!(
            "redis-server found no free loopback port for a {role:?} in 5 tries; it said:\n{}",
            server.log_tail()
        );
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Starts one that persists every write to an append-only file in a fresh temporary
    /// directory (`appendfsync always`), so [`kill`](Self::kill) and [`restart`](Self::restart)
    /// keep its data, as a production Redis holding idempotency records must.
    pub async fn start_persistent() -> RedisServer {
        Self::start_as(Role::Alone).await
    }

    /// The port was free when it was picked, but another test may take it before the server
    /// binds it: then another port.
    async fn launch_on_a_free_port(&mut self) {
        for _ in 0..5 {
            if self.launch().await {
                return;
            }
            self.port = restartable_port(false);
        }
        panic!(
            "redis-server found no free loopback port in 5 tries; it said:\n{}",
            self.log_tail()
        );
    }

    /// Starts redis-server on `self.port` and waits until it answers; `false`: it exited at
    /// once (its port was taken).
    async fn launch(&mut self) -> bool {
        let mut cmd = std::process::Command::new("redis-server");
        if let Role::Sentinel(primary) = self.role {
            // A Sentinel reads (and rewrites) a configuration file of its own.
            let dir = self.dir.as_ref().expect("a Sentinel has a directory");
            let conf = dir.join("sentinel.conf");
            std::fs::write(
                &conf,
                format!(
                    "port {}\nbind 127.0.0.1\ndir {}\n\
                     sentinel monitor backstop 127.0.0.1 {primary} 2\n\
                     sentinel down-after-milliseconds backstop 1000\n\
                     sentinel failover-timeout backstop 5000\n\
                     sentinel parallel-syncs backstop 1\n",
                    self.port,
                    dir.display()
                ),
            )
            .expect("sentinel.conf");
            cmd.arg(&conf).arg("--sentinel");
        } else {
            cmd.args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"]);
        }
        match &self.dir {
            _ if matches!(self.role, Role::Sentinel(_)) => {}
            Some(dir) => {
                cmd.args(["--save", "", "--protected-mode", "yes"]);
                cmd.args(["--appendonly", "yes", "--appendfsync", "always", "--dir"])
                    .arg(dir);
            }
            None => {
                cmd.args(["--save", "", "--protected-mode", "yes"]);
                cmd.args(["--appendonly", "no"]);
            }
        }
        if let Role::ReplicaOf(primary) = self.role {
            cmd.args(["--replicaof", "127.0.0.1", &primary.to_string()]);
        }
        if self.role == Role::ClusterNode {
            cmd.args(["--cluster-enabled", "yes", "--cluster-node-timeout", "2000"])
                .args(["--cluster-require-full-coverage", "no"])
                .args([
                    "--cluster-config-file",
                    &format!("nodes-{}.conf", self.port),
                ]);
        }
        let log = || {
            std::fs::OpenOptions::new()
                .append(true)
                .open(self.log.path())
                .expect("redis-server's log file")
        };
        let child = cmd
            .stdout(log())
            .stderr(log())
            .spawn()
            .expect("redis-server must be installed to run the Redis tests: `apt-get install redis-server` (Debian, Ubuntu), or run `scripts/test`, which installs it");
        let pid = child.id();
        self.child = Some(child);
        // A bound a loaded machine does not reach: redis-server answers within milliseconds.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while tokio::time::Instant::now() < deadline {
            // Our own server, not another test's on the same port (nor a listener of another
            // kind there, which may never answer).
            let answer = tokio::time::timeout(Duration::from_millis(500), self.process_id());
            if answer.await.ok().flatten() == Some(pid) {
                return true;
            }
            if let Some(child) = &mut self.child
                && child.try_wait().is_ok_and(|exited| exited.is_some())
            {
                self.child = None;
                return false;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!(
            "redis-server on port {} did not start within 10 s; it said:\n{}",
            self.port,
            self.log_tail()
        );
    }

    /// The `process_id` that the server on the port reports (`INFO server`), once it answers.
    async fn process_id(&self) -> Option<u32> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", self.port))
            .await
            .ok()?;
        s.write_all(b"INFO server\r\n").await.ok()?;
        let mut reply = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            let n = s.read(&mut buf).await.ok()?;
            if n == 0 {
                return None;
            }
            reply.extend_from_slice(&buf[..n]);
            let text = String::from_utf8_lossy(&reply);
            if let Some(line) = text
                .split("\r\n")
                .find_map(|l| l.strip_prefix("process_id:"))
                && text.contains("run_id:")
            {
                return line.trim().parse().ok();
            }
            if reply.len() > 64 * 1024 {
                return None;
            }
        }
    }

    /// `redis://127.0.0.1:PORT/`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// Kills it (`SIGKILL`): without persistence the data is gone.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Freezes it (`SIGSTOP`): its connections stay open and nothing on them is answered, as a
    /// Redis that hangs; [`thaw`](Self::thaw) lets it go on.
    pub fn freeze(&self) {
        self.signal("-STOP");
    }

    /// Lets a frozen server go on (`SIGCONT`).
    pub fn thaw(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, signal: &str) {
        let child = self.child.as_ref().expect("the server runs");
        let sent = std::process::Command::new("kill")
            .args([signal, &child.id().to_string()])
            .status()
            .expect("kill runs");
        assert!(sent.success(), "kill {signal} {}", child.id());
    }

    /// The same as [`stop`](Self::stop): a crash, not a shutdown.
    pub fn kill(&mut self) {
        self.stop();
    }

    /// Starts it again on the same port (with its data, when persistent).
    pub async fn restart(&mut self) {
        self.stop();
        assert!(
            self.launch().await,
            "redis-server did not restart on port {}; it said:\n{}",
            self.port,
            self.log_tail()
        );
    }

    /// The last lines it printed, over all its starts.
    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(self.log.path()).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }
}

/// A log file for a server, removed when the server is dropped.
fn new_log() -> tempfile::NamedTempFile {
    tempfile::Builder::new()
        .prefix("backstop-redis-log-")
        .tempfile()
        .expect("a temporary file for redis-server's log")
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
        if let Some(dir) = &self.dir {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}
