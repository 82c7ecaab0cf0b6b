//! Loopback HTTP servers whose behaviour a test scripts: answer, answer late, hang, or commit
//! the effect and then drop the connection without a reply (the lost-reply case).
//!
//! Every server binds `127.0.0.1:0` and stops when its [`TestServer`] is dropped. Nothing here
//! talks to any other address.
//!
//! ```
//! use backstop_testkit::{Action, TestServer};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let server = TestServer::start(|_seen| Action::status(503)).await;
//! assert!(server.url("/x").starts_with("http://127.0.0.1:"));
//! assert_eq!(server.requests(), 0);
//! # }
//! ```
#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod clock;
mod pg_wire;
mod postgres;
mod proxy;
mod redis_cluster;
mod redis_sentinel;

pub use clock::{ManualClock, fresh_dir};
pub use pg_wire::PgWireCounter;
pub use postgres::PostgresServer;
pub use proxy::{FaultCounts, FaultPlan, FaultProxy};
pub use redis_cluster::RedisCluster;
pub use redis_sentinel::RedisSentinel;

use bytes::Bytes;
use http::{HeaderMap, Method, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::{body::Incoming, server::conn::http1, service::service_fn};
use hyper_util::rt::TokioIo;
use std::{
    convert::Infallible,
    fmt,
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::Duration,
};
use tokio::{net::TcpListener, task::JoinSet};

/// One request as the server saw it.
#[derive(Clone, Debug)]
pub struct Seen {
    /// 0 for the first request the server received.
    pub index: usize,
    /// The method.
    pub method: Method,
    /// The path and query.
    pub path: String,
    /// The headers.
    pub headers: HeaderMap,
    /// The whole body.
    pub body: Bytes,
}

impl Seen {
    /// A header's value as text.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

/// What the server does with a request.
#[derive(Debug)]
pub enum Action {
    /// Answer.
    Respond(Response<Full<Bytes>>),
    /// Answer after a delay.
    Delay(Duration, Response<Full<Bytes>>),
    /// Never answer (until the client goes away or the server stops).
    Hang,
    /// Close the connection without a reply. The handler has done whatever it does first, so
    /// this is the case of a reply lost after the effect was committed.
    DropReply,
}

impl Action {
    /// An empty response with `status`.
    pub fn status(status: u16) -> Action {
        Action::Respond(response(status, &[], ""))
    }

    /// A response with a status, headers and body.
    pub fn respond(status: u16, headers: &[(&str, &str)], body: impl Into<Bytes>) -> Action {
        Action::Respond(response(status, headers, body))
    }
}

/// Builds a response.
pub fn response(
    status: u16,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> Response<Full<Bytes>> {
    let mut b = Response::builder().status(StatusCode::from_u16(status).expect("valid status"));
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    b.body(Full::new(body.into())).expect("valid response")
}

type Handler = dyn Fn(&Seen) -> Action + Send + Sync;

/// A running loopback server; stops when dropped.
pub struct TestServer {
    addr: SocketAddr,
    seen: Arc<Mutex<Vec<Seen>>>,
    tasks: JoinSet<()>,
}

impl fmt::Debug for TestServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TestServer")
            .field("addr", &self.addr)
            .finish()
    }
}

#[derive(Debug)]
struct Dropped;
impl fmt::Display for Dropped {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("reply dropped on purpose")
    }
}
impl std::error::Error for Dropped {}

impl TestServer {
    /// Starts a server on `127.0.0.1` with a free port; `handler` decides each answer.
    pub async fn start<F>(handler: F) -> TestServer
    where
        F: Fn(&Seen) -> Action + Send + Sync + 'static,
    {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind loopback");
        let addr = listener.local_addr().expect("local addr");
        let seen: Arc<Mutex<Vec<Seen>>> = Arc::default();
        let handler: Arc<Handler> = Arc::new(handler);
        let mut tasks = JoinSet::new();
        let log = seen.clone();
        tasks.spawn(accept_loop(listener, move || {
            let (handler, log) = (handler.clone(), log.clone());
            service_fn(move |req: hyper::Request<Incoming>| {
                let (handler, log) = (handler.clone(), log.clone());
                async move { serve(req, &*handler, &log).await }
            })
        }));
        TestServer { addr, seen, tasks }
    }

    /// Serves a tower service (for example, a handler behind Backstop's replay layer) on
    /// `127.0.0.1` with a free port. [`TestServer::requests`] stays 0: the service counts for
    /// itself.
    pub async fn serve<S, B>(svc: S) -> TestServer
    where
        S: tower_service::Service<hyper::Request<Incoming>, Response = Response<B>>
            + Clone
            + Send
            + 'static,
        S::Future: Send + 'static,
        S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
        B: http_body::Body + Send + 'static,
        B::Data: Send,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind loopback");
        let addr = listener.local_addr().expect("local addr");
        let mut tasks = JoinSet::new();
        tasks.spawn(accept_loop(listener, move || {
            hyper_util::service::TowerToHyperService::new(svc.clone())
        }));
        TestServer {
            addr,
            seen: Arc::default(),
            tasks,
        }
    }

    /// The server's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:PORT{path}`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// How many requests arrived.
    pub fn requests(&self) -> usize {
        self.seen.lock().expect("lock").len()
    }

    /// Every request that arrived, in order.
    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().expect("lock").clone()
    }

    /// Stops the server and closes its connections.
    pub fn stop(mut self) {
        self.tasks.abort_all();
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.tasks.abort_all();
    }
}

async fn serve(
    req: hyper::Request<Incoming>,
    handler: &Handler,
    log: &Mutex<Vec<Seen>>,
) -> Result<Response<Full<Bytes>>, Dropped> {
    let (parts, body) = req.into_parts();
    let body = body
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let seen = {
        let mut log = log.lock().expect("lock");
        let seen = Seen {
            index: log.len(),
            method: parts.method,
            path: parts
                .uri
                .path_and_query()
                .map_or_else(|| "/".to_owned(), |p| p.as_str().to_owned()),
            headers: parts.headers,
            body,
        };
        log.push(seen.clone());
        seen
    };
    match handler(&seen) {
        Action::Respond(r) => Ok(r),
        Action::Delay(d, r) => {
            tokio::time::sleep(d).await;
            Ok(r)
        }
        Action::Hang => {
            let never = std::future::pending::<Infallible>().await;
            match never {}
        }
        Action::DropReply => Err(Dropped),
    }
}

type BoxErr = Box<dyn std::error::Error + Send + Sync>;

/// Accepts connections until aborted, serving each with HTTP/1 and a fresh service from `make`.
/// Finished connections are reaped as it goes, so a long run does not grow.
pub(crate) async fn accept_loop<S, B, M>(listener: TcpListener, make: M)
where
    M: Fn() -> S + Send + 'static,
    S: hyper::service::Service<hyper::Request<Incoming>, Response = Response<B>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxErr>,
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxErr>,
{
    let mut conns = JoinSet::new();
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let svc = make();
        conns.spawn(async move {
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
        while conns.try_join_next().is_some() {}
    }
}

/// A loopback address on which nothing listens (connections to it are refused), for as long as
/// the test process runs: its port stays bound to a socket that never listens, so no other test
/// can start a server on it in the meantime.
pub async fn refused_addr() -> SocketAddr {
    static HELD: Mutex<Vec<tokio::net::TcpSocket>> = Mutex::new(Vec::new());
    let socket = tokio::net::TcpSocket::new_v4().expect("a TCP socket");
    socket
        .bind(SocketAddr::from(([127, 0, 0, 1], 0)))
        .expect("bind loopback");
    let addr = socket.local_addr().expect("local addr");
    HELD.lock().unwrap_or_else(|e| e.into_inner()).push(socket);
    addr
}

/// A loopback port that was free a moment ago, for a server started in another process (which
/// must bind it itself). Another test may take it first: the caller retries on a bind failure.
pub(crate) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("bind loopback")
        .port()
}

/// A loopback port free a moment ago whose cluster bus port (`port + 10000`) is free too.
fn free_cluster_port() -> u16 {
    for _ in 0..100 {
        let port = free_port();
        if port < 55_000 && std::net::TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return port;
        }
    }
    panic!("no free loopback port pair for a Redis Cluster node");
}

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
            port: free_port(),
            dir: None,
            role: Role::Alone,
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
        let pick = || {
            if role == Role::ClusterNode {
                free_cluster_port()
            } else {
                free_port()
            }
        };
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
        };
        for _ in 0..5 {
            if server.launch().await {
                return server;
            }
            server.port = pick();
        }
        panic!("redis-server found no free loopback port for a {role:?} in 5 tries");
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
            self.port = free_port();
        }
        panic!("redis-server found no free loopback port in 5 tries");
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
        let child = cmd
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("redis-server must be installed to run the Redis tests: `apt-get install redis-server` (Debian, Ubuntu), or run `bash .ci/run`, which installs it");
        let pid = child.id();
        self.child = Some(child);
        for _ in 0..200 {
            // Our own server, not another test's on the same port.
            if self.process_id().await == Some(pid) {
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
            "redis-server on port {} did not start within 5 s",
            self.port
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

    /// The same as [`stop`](Self::stop): a crash, not a shutdown.
    pub fn kill(&mut self) {
        self.stop();
    }

    /// Starts it again on the same port (with its data, when persistent).
    pub async fn restart(&mut self) {
        self.stop();
        assert!(
            self.launch().await,
            "redis-server did not restart on port {}",
            self.port
        );
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
        if let Some(dir) = &self.dir {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}
