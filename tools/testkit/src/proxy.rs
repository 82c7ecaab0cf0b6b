//! A fault-injecting HTTP proxy on loopback: real TCP from the client to the proxy and from the
//! proxy to the server, with faults drawn from a seeded RNG.

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::{body::Incoming, service::service_fn};
use hyper_util::{
    client::legacy::{Client, connect::HttpConnector},
    rt::TokioExecutor,
};
use rand::{RngExt, SeedableRng, rngs::SmallRng};
use std::{
    fmt,
    net::SocketAddr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU32, AtomicU64, Ordering},
    },
    time::Duration,
};
use tokio::{net::TcpListener, task::JoinSet};

/// How often each fault happens, per request (each a probability from 0 to 1; they are drawn
/// in this order and at most one applies).
#[derive(Clone, Debug, Default)]
pub struct FaultPlan {
    /// Close the connection before forwarding: the server never sees the request.
    pub reset_before: f64,
    /// Forward, let the server commit, then close the connection: the reply is lost.
    pub reset_after: f64,
    /// Answer 429 with `Retry-After: 1` without forwarding.
    pub throttle: f64,
    /// Start a burst of `burst_len` 503s without forwarding.
    pub burst_503: f64,
    /// Length of a 503 burst.
    pub burst_len: u32,
    /// Never answer.
    pub hang: f64,
    /// Forward, then hold the reply this long.
    pub delay: f64,
    /// How long a delayed reply is held.
    pub delay_by: Duration,
}

/// What the proxy did, counted.
#[derive(Debug, Default)]
pub struct FaultCounts {
    /// Requests received from the client.
    pub received: AtomicU64,
    /// Requests forwarded to the server.
    pub forwarded: AtomicU64,
    /// Replies dropped after the server answered.
    pub replies_lost: AtomicU64,
    /// Connections closed before forwarding.
    pub reset_before: AtomicU64,
    /// 429s sent.
    pub throttled: AtomicU64,
    /// 503s sent.
    pub unavailable: AtomicU64,
    /// Requests left hanging.
    pub hung: AtomicU64,
    /// Replies delayed.
    pub delayed: AtomicU64,
}

#[derive(Debug)]
struct Dropped;
impl fmt::Display for Dropped {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("connection dropped by the fault proxy")
    }
}
impl std::error::Error for Dropped {}

enum Fault {
    ResetBefore,
    ResetAfter,
    Throttle,
    Burst,
    Hang,
    Delay,
    None,
}

struct Shared {
    plan: FaultPlan,
    rng: Mutex<SmallRng>,
    burst_left: AtomicU32,
    upstream: SocketAddr,
    client: Client<HttpConnector, Full<Bytes>>,
    counts: Arc<FaultCounts>,
}

impl Shared {
    fn draw(&self) -> Fault {
        if self
            .burst_left
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            return Fault::Burst;
        }
        let u: f64 = self.rng.lock().expect("rng").random();
        let p = &self.plan;
        let mut edge = 0.0;
        for (rate, fault) in [
            (p.reset_before, Fault::ResetBefore),
            (p.reset_after, Fault::ResetAfter),
            (p.throttle, Fault::Throttle),
            (p.burst_503, Fault::Burst),
            (p.hang, Fault::Hang),
            (p.delay, Fault::Delay),
        ] {
            edge += rate;
            if u < edge {
                if matches!(fault, Fault::Burst) {
                    self.burst_left
                        .store(p.burst_len.saturating_sub(1), Ordering::SeqCst);
                }
                return fault;
            }
        }
        Fault::None
    }

    async fn forward(&self, req: Request<Incoming>) -> Result<Response<Full<Bytes>>, Dropped> {
        let (mut parts, body) = req.into_parts();
        let body = body.collect().await.map_err(|_| Dropped)?.to_bytes();
        let path = parts
            .uri
            .path_and_query()
            .map_or("/", |p| p.as_str())
            .to_owned();
        parts.uri = format!("http://{}{path}", self.upstream)
            .parse()
            .map_err(|_| Dropped)?;
        let res = self
            .client
            .request(Request::from_parts(parts, Full::new(body)))
            .await
            .map_err(|_| Dropped)?;
        self.counts.forwarded.fetch_add(1, Ordering::Relaxed);
        let (parts, body) = res.into_parts();
        let body = body.collect().await.map_err(|_| Dropped)?.to_bytes();
        Ok(Response::from_parts(parts, Full::new(body)))
    }

    async fn handle(&self, req: Request<Incoming>) -> Result<Response<Full<Bytes>>, Dropped> {
        self.counts.received.fetch_add(1, Ordering::Relaxed);
        let c = &self.counts;
        match self.draw() {
            Fault::ResetBefore => {
                c.reset_before.fetch_add(1, Ordering::Relaxed);
                Err(Dropped)
            }
            Fault::ResetAfter => {
                let _ = self.forward(req).await?;
                c.replies_lost.fetch_add(1, Ordering::Relaxed);
                Err(Dropped)
            }
            Fault::Throttle => {
                c.throttled.fetch_add(1, Ordering::Relaxed);
                Ok(status(StatusCode::TOO_MANY_REQUESTS, Some("1")))
            }
            Fault::Burst => {
                c.unavailable.fetch_add(1, Ordering::Relaxed);
                Ok(status(StatusCode::SERVICE_UNAVAILABLE, None))
            }
            Fault::Hang => {
                c.hung.fetch_add(1, Ordering::Relaxed);
                std::future::pending::<()>().await;
                Err(Dropped)
            }
            Fault::Delay => {
                let res = self.forward(req).await?;
                c.delayed.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(self.plan.delay_by).await;
                Ok(res)
            }
            Fault::None => self.forward(req).await,
        }
    }
}

fn status(code: StatusCode, retry_after: Option<&str>) -> Response<Full<Bytes>> {
    let mut b = Response::builder().status(code);
    if let Some(after) = retry_after {
        b = b.header("retry-after", after);
    }
    b.body(Full::default()).expect("valid response")
}

/// A running fault proxy; stops when dropped.
pub struct FaultProxy {
    addr: SocketAddr,
    counts: Arc<FaultCounts>,
    tasks: JoinSet<()>,
}

impl fmt::Debug for FaultProxy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FaultProxy")
            .field("addr", &self.addr)
            .finish()
    }
}

impl FaultProxy {
    /// A proxy on `127.0.0.1` in front of `upstream`, injecting faults per `plan`, drawn from
    /// an RNG seeded with `seed`.
    pub async fn start(upstream: SocketAddr, plan: FaultPlan, seed: u64) -> FaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind loopback");
        let addr = listener.local_addr().expect("local addr");
        let counts = Arc::new(FaultCounts::default());
        let shared = Arc::new(Shared {
            plan,
            rng: Mutex::new(SmallRng::seed_from_u64(seed)),
            burst_left: AtomicU32::new(0),
            upstream,
            client: Client::builder(TokioExecutor::new()).build_http(),
            counts: counts.clone(),
        });
        let mut tasks = JoinSet::new();
        tasks.spawn(crate::accept_loop(listener, move || {
            let shared = shared.clone();
            service_fn(move |req| {
                let shared = shared.clone();
                async move { shared.handle(req).await }
            })
        }));
        FaultProxy {
            addr,
            counts,
            tasks,
        }
    }

    /// `http://127.0.0.1:PORT{path}`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// What the proxy did so far.
    pub fn counts(&self) -> &FaultCounts {
        &self.counts
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.tasks.abort_all();
    }
}
