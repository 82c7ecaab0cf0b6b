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
mod not_ready;
mod pg_wire;
mod postgres;
mod proxy;
mod redis;
mod redis_cluster;
mod redis_sentinel;

pub use clock::{ManualClock, scratch_dir};
pub use not_ready::NotReadyAt;
pub use pg_wire::PgWireCounter;
pub use postgres::PostgresServer;
pub use proxy::{FaultCounts, FaultPlan, FaultProxy};
pub use redis::RedisServer;
pub(crate) use redis::Role;
pub use redis_cluster::RedisCluster;
pub use redis_sentinel::RedisSentinel;
/// A scratch directory, removed with what it holds when dropped ([`scratch_dir`]).
pub use tempfile::TempDir;

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

/// A free loopback port for a server started in another process (which binds it itself) and
/// that a test may kill and start again on the same port; with `bus`, a Redis Cluster node's
/// bus port (`port + 10000`) is free too. Both are below the range the kernel hands out for
/// outgoing connections and `bind(:0)`: while the server is down, nothing takes its port by
/// chance (a client's ephemeral port, another test's listener), so the restart finds it free.
pub(crate) fn restartable_port(bus: bool) -> u16 {
    use std::hash::{BuildHasher, RandomState};
    let low = ephemeral_low();
    let top = if bus { low.saturating_sub(10_000) } else { low };
    assert!(
        top > 10_500,
        "the kernel's ephemeral range starts too low ({low}) for a fixed port"
    );
    let free = |p: u16| std::net::TcpListener::bind(("127.0.0.1", p)).is_ok();
    for _ in 0..200 {
        let span = u64::from(top - 10_000);
        let port = 10_000 + (RandomState::new().hash_one(std::process::id()) % span) as u16;
        if free(port) && (!bus || free(port + 10_000)) {
            return port;
        }
    }
    panic!("no free loopback port below {top} for a server that restarts");
}

/// Where the kernel's ephemeral ports start (Linux's `ip_local_port_range`; 32768 when it
/// cannot be read).
fn ephemeral_low() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768)
}
