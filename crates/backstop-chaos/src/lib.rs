//! A fault layer users can run: how you prove your own stack safe before production does.
//!
//! [`ChaosLayer`] wraps any service (a client, or a server's handler) and, at the rates a
//! [`FaultPlan`] gives, with a seeded draw per request:
//!
//! - **loses the reply** after the service acted: the effect happened, the caller gets a
//!   connection reset (outcome unknown), which is how a refund is made twice;
//! - **resets** the connection before the service saw the request (the caller cannot tell the
//!   two apart: its outcome is unknown too);
//! - **refuses** the connection: nothing was sent, and the caller can know it;
//! - **answers with a status** (a `503`, a `429`) without calling the service;
//! - **delays** the reply by a given time, after the service acted (a slow reply, which an
//!   attempt timeout turns into an unknown outcome).
//!
//! The errors are `std::io::Error`s of the kind a real network gives (`ConnectionReset`,
//! `ConnectionRefused`) inside a [`ChaosError`] that says it was injected, so classifiers treat
//! them as they would the real thing. The same seed gives the same faults for the same order of
//! requests; [`ChaosLayer::stats`] counts what was injected.
//!
//! ```
//! use backstop_chaos::{ChaosLayer, FaultPlan};
//! use tower::{Layer, ServiceExt, service_fn};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! let chaos = ChaosLayer::new(FaultPlan::default().lose_reply(1.0).limit(1), 7)?;
//! let refunds = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
//! let r = refunds.clone();
//! let handler = chaos.layer(service_fn(move |_req: http::Request<()>| {
//!     r.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
//!     async { Ok::<_, std::convert::Infallible>(http::Response::new(())) }
//! }));
//! // The first reply is lost after the refund was booked; the second goes through.
//! assert!(handler.clone().oneshot(http::Request::new(())).await.is_err());
//! assert!(handler.oneshot(http::Request::new(())).await.is_ok());
//! assert_eq!(refunds.load(std::sync::atomic::Ordering::SeqCst), 2);
//! assert_eq!(chaos.stats().lost_replies, 1);
//! # Ok(())
//! # }
//! ```
#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod future;

use backstop_core::{BoxError, InvalidConfig};
use backstop_state::Draws;
use future::{ChaosFuture, State};
use std::{
    fmt, io,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    task::{Context, Poll},
    time::Duration,
};
use tower_layer::Layer;
use tower_service::Service;

/// How often each fault happens, per request. The exclusive faults (reset, refuse, status,
/// lose the reply) are drawn together, so their rates add up to at most 1; the delay is drawn
/// apart and may come on top of a lost reply or a pass.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FaultPlan {
    lose_reply: f64,
    reset: f64,
    refuse: f64,
    status: f64,
    status_code: u16,
    delay: f64,
    delay_by: Duration,
    limit: Option<u64>,
}

impl FaultPlan {
    /// Lose the reply after the service acted, at `rate` (0 to 1).
    #[must_use]
    pub fn lose_reply(mut self, rate: f64) -> Self {
        self.lose_reply = rate;
        self
    }

    /// Reset the connection before the service saw the request, at `rate`.
    #[must_use]
    pub fn reset(mut self, rate: f64) -> Self {
        self.reset = rate;
        self
    }

    /// Refuse the connection (nothing sent), at `rate`.
    #[must_use]
    pub fn refuse(mut self, rate: f64) -> Self {
        self.refuse = rate;
        self
    }

    /// Answer with `status` without calling the service, at `rate`.
    #[must_use]
    pub fn status(mut self, rate: f64, status: u16) -> Self {
        self.status = rate;
        self.status_code = status;
        self
    }

    /// Hold the reply for `by` after the service answered, at `rate`.
    #[must_use]
    pub fn delay(mut self, rate: f64, by: Duration) -> Self {
        self.delay = rate;
        self.delay_by = by;
        self
    }

    /// Inject faults into at most `n` requests in all, then pass every request through (with a
    /// rate of 1, the first `n` requests fail).
    #[must_use]
    pub fn limit(mut self, n: u64) -> Self {
        self.limit = Some(n);
        self
    }

    fn validate(&self) -> Result<(), InvalidConfig> {
        let rates = [
            self.lose_reply,
            self.reset,
            self.refuse,
            self.status,
            self.delay,
        ];
        if rates
            .iter()
            .any(|r| !r.is_finite() || !(0.0..=1.0).contains(r))
        {
            return Err(InvalidConfig::new(
                "every fault rate must be a number from 0 to 1 (0.1 means 10 % of requests)",
            ));
        }
        if self.lose_reply + self.reset + self.refuse + self.status > 1.0 + 1e-9 {
            return Err(InvalidConfig::new(
                "lose_reply, reset, refuse and status are one draw: their rates must add up to at most 1",
            ));
        }
        if self.status > 0.0 && !(100..=599).contains(&self.status_code) {
            return Err(InvalidConfig::new(
                "the injected status must be an HTTP status from 100 to 599",
            ));
        }
        Ok(())
    }
}

/// What a [`ChaosLayer`] injected, counted over every service it built.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ChaosStats {
    /// Requests seen.
    pub requests: u64,
    /// Replies lost after the service acted.
    pub lost_replies: u64,
    /// Connections reset before the service saw the request.
    pub resets: u64,
    /// Connections refused.
    pub refusals: u64,
    /// Statuses answered without calling the service.
    pub statuses: u64,
    /// Replies delayed.
    pub delays: u64,
}

#[derive(Debug, Default)]
struct Counts {
    requests: AtomicU64,
    faults: AtomicU64,
    lost_replies: AtomicU64,
    resets: AtomicU64,
    refusals: AtomicU64,
    statuses: AtomicU64,
    delays: AtomicU64,
}

#[derive(Debug)]
struct Shared {
    plan: FaultPlan,
    draws: Draws,
    counts: Counts,
}

impl Shared {
    /// Whether one more fault may be injected (and counts it).
    fn take_fault(&self) -> bool {
        match self.plan.limit {
            None => true,
            Some(limit) => self
                .counts
                .faults
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                    (n < limit).then_some(n + 1)
                })
                .is_ok(),
        }
    }

    fn pick(&self) -> Pick {
        let p = &self.plan;
        self.counts.requests.fetch_add(1, Ordering::Relaxed);
        let (x, y) = (self.draws.next(), self.draws.next());
        let bands = [
            (Fault::Reset, p.reset),
            (Fault::Refuse, p.refuse),
            (Fault::Status, p.status),
            (Fault::LoseReply, p.lose_reply),
        ];
        let mut edge = 0.0;
        let mut fault = None;
        for (f, rate) in bands {
            edge += rate;
            if x < edge {
                fault = Some(f);
                break;
            }
        }
        // A reply the layer answers itself is not held.
        let mut delay = y < p.delay && matches!(fault, None | Some(Fault::LoseReply));
        // A request with any fault counts once against the limit.
        if (fault.is_some() || delay) && !self.take_fault() {
            fault = None;
            delay = false;
        }
        let count = |c: &AtomicU64| {
            c.fetch_add(1, Ordering::Relaxed);
        };
        match fault {
            Some(Fault::Reset) => count(&self.counts.resets),
            Some(Fault::Refuse) => count(&self.counts.refusals),
            Some(Fault::Status) => count(&self.counts.statuses),
            Some(Fault::LoseReply) => count(&self.counts.lost_replies),
            None => {}
        }
        if delay {
            count(&self.counts.delays);
        }
        Pick { fault, delay }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    Reset,
    Refuse,
    Status,
    LoseReply,
}

struct Pick {
    fault: Option<Fault>,
    delay: bool,
}

/// An injected fault: what the caller sees instead of the reply. Its source is the
/// `std::io::Error` a real network would give, so classifiers treat it as that.
#[derive(Debug)]
pub struct ChaosError {
    what: &'static str,
    io: io::Error,
}

impl ChaosError {
    fn new(kind: io::ErrorKind, what: &'static str) -> Self {
        ChaosError {
            what,
            io: io::Error::new(kind, what),
        }
    }

    /// Whether the service acted before the fault (a lost reply).
    pub fn service_acted(&self) -> bool {
        self.what == LOST
    }
}

pub(crate) const LOST: &str = "the reply was lost after the service acted";

impl fmt::Display for ChaosError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "injected fault (chaos layer): {}", self.what)
    }
}

impl std::error::Error for ChaosError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.io)
    }
}

/// A response the chaos layer can answer with itself (an injected status). Implemented for
/// `http::Response<B>`; implement it for another protocol's response to inject its failures.
pub trait StatusReply: Sized {
    /// A response with `status` and an empty body (a `429` or a `503` with `Retry-After: 1`).
    fn with_status(status: u16) -> Self;
}

impl<B: Default> StatusReply for http::Response<B> {
    fn with_status(status: u16) -> Self {
        let mut res = http::Response::new(B::default());
        *res.status_mut() =
            http::StatusCode::from_u16(status).unwrap_or(http::StatusCode::SERVICE_UNAVAILABLE);
        if matches!(status, 429 | 503) {
            res.headers_mut().insert(
                http::header::RETRY_AFTER,
                http::HeaderValue::from_static("1"),
            );
        }
        res
    }
}

/// Injects the faults of a [`FaultPlan`], seeded. `Clone`: clones share the draw and the counts.
#[derive(Clone, Debug)]
pub struct ChaosLayer {
    shared: Arc<Shared>,
}

impl ChaosLayer {
    /// A layer injecting `plan`'s faults with the draws of `seed`, or why the plan is invalid.
    pub fn new(plan: FaultPlan, seed: u64) -> Result<Self, InvalidConfig> {
        plan.validate()?;
        Ok(ChaosLayer {
            shared: Arc::new(Shared {
                plan,
                draws: Draws::new(seed),
                counts: Counts::default(),
            }),
        })
    }

    /// What has been injected so far.
    pub fn stats(&self) -> ChaosStats {
        let c = &self.shared.counts;
        let get = |a: &AtomicU64| a.load(Ordering::SeqCst);
        ChaosStats {
            requests: get(&c.requests),
            lost_replies: get(&c.lost_replies),
            resets: get(&c.resets),
            refusals: get(&c.refusals),
            statuses: get(&c.statuses),
            delays: get(&c.delays),
        }
    }
}

impl<S> Layer<S> for ChaosLayer {
    type Service = Chaos<S>;

    fn layer(&self, inner: S) -> Chaos<S> {
        Chaos {
            inner,
            shared: self.shared.clone(),
        }
    }
}

/// See [`ChaosLayer`].
#[derive(Clone, Debug)]
pub struct Chaos<S> {
    inner: S,
    shared: Arc<Shared>,
}

impl<S, Req> Service<Req> for Chaos<S>
where
    S: Service<Req>,
    S::Error: Into<BoxError>,
    S::Response: StatusReply,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = ChaosFuture<S::Future, S::Response>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Req) -> Self::Future {
        let pick = self.shared.pick();
        let delay = pick.delay.then_some(self.shared.plan.delay_by);
        let now = |r| ChaosFuture::new(State::Now { result: Some(r) });
        match pick.fault {
            Some(Fault::Reset) => now(Err(ChaosError::new(
                io::ErrorKind::ConnectionReset,
                "the connection was reset before the service saw the request",
            )
            .into())),
            Some(Fault::Refuse) => now(Err(ChaosError::new(
                io::ErrorKind::ConnectionRefused,
                "the connection was refused: nothing was sent",
            )
            .into())),
            Some(Fault::Status) => now(Ok(S::Response::with_status(self.shared.plan.status_code))),
            lose => ChaosFuture::new(State::Calling {
                fut: self.inner.call(req),
                lose: lose == Some(Fault::LoseReply),
                delay,
            }),
        }
    }
}
