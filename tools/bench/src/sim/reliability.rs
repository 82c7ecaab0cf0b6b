//! The reliability figure: agent tasks of many calls over a flaky dependency,
//! with and without Backstop, and the duplicate effects each leaves.

use crate::stacks::{Req, Res, TowerPolicy};
use backstop::{
    Backstop, BoxError, Preset,
    backoff::RngSource,
    breaker::{Breaker, BreakerConfig},
    budget::Budget,
    idempotency::ActionContext,
    replay::{MemoryStore, ReplayLayer, ReplayRequestBody},
};
use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use rand::{SeedableRng, rngs::SmallRng};
use std::{
    collections::HashMap,
    io,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};
use tower::{
    Layer, Service, ServiceBuilder, ServiceExt, retry::budget::TpsBudget, util::BoxCloneSyncService,
};

/// What happens to one attempt at the dependency.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fate {
    Ok,
    /// Refused before doing anything (a 503).
    Refused,
    /// The effect is committed, then the reply is lost.
    LostReply,
}

/// The dependency of the reliability simulation: every attempt draws its fate from a seeded RNG;
/// `effects` counts committed effects per action (the order id in the body).
#[derive(Clone)]
struct Flaky {
    rng: Arc<Mutex<SmallRng>>,
    failure_rate: f64,
    effects: Arc<Mutex<HashMap<String, u32>>>,
    attempts: Arc<AtomicU64>,
}

impl Flaky {
    fn new(seed: u64, failure_rate: f64) -> Self {
        Flaky {
            rng: Arc::new(Mutex::new(SmallRng::seed_from_u64(seed))),
            failure_rate,
            effects: Arc::default(),
            attempts: Arc::default(),
        }
    }

    fn fate(&self) -> Fate {
        self.attempts.fetch_add(1, Ordering::Relaxed);
        let u = rand::RngExt::random::<f64>(&mut *self.rng.lock().unwrap());
        if u < self.failure_rate / 2.0 {
            Fate::Refused
        } else if u < self.failure_rate {
            Fate::LostReply
        } else {
            Fate::Ok
        }
    }

    fn duplicates(&self) -> u64 {
        self.effects
            .lock()
            .unwrap()
            .values()
            .map(|n| u64::from(n.saturating_sub(1)))
            .sum()
    }

    /// The handler: commits the effect for the action named in the body.
    fn commit(&self, body: &[u8]) -> Response<Full<Bytes>> {
        let action = String::from_utf8_lossy(body).into_owned();
        *self.effects.lock().unwrap().entry(action).or_default() += 1;
        Response::new(Full::new(Bytes::from_static(b"done")))
    }

    /// The dependency as a service: `replay` puts Backstop's replay layer in front of the
    /// handler; the fate is applied outside it (the network).
    fn service(&self, replay: bool) -> BoxCloneSyncService<Req, Res, BoxError> {
        let this = self.clone();
        let handler = tower::service_fn(move |req: Request<ReplayRequestBody>| {
            let this = this.clone();
            async move {
                let body = req.into_body().collect().await.map_err(|e| e.0)?.to_bytes();
                Ok::<_, BoxError>(this.commit(&body))
            }
        });
        let inner: BoxCloneSyncService<
            Req,
            Response<backstop::replay::ReplayResponseBody>,
            BoxError,
        > = if replay {
            BoxCloneSyncService::new(
                ReplayLayer::new(MemoryStore::new(1_000_000))
                    .single_tenant()
                    .layer(handler),
            )
        } else {
            BoxCloneSyncService::new(
                handler
                    .map_request(|r: Req| r.map(|b| b.map_err(|e| match e {}).boxed_unsync()))
                    .map_response(|r: Res| r.map(|b| b.map_err(|e| match e {}).boxed_unsync())),
            )
        };
        let this = self.clone();
        BoxCloneSyncService::new(tower::service_fn(move |req: Req| {
            let fate = this.fate();
            let mut inner = inner.clone();
            async move {
                if fate == Fate::Refused {
                    return Ok(Response::builder().status(503).body(Full::default())?);
                }
                let res = inner.ready().await?.call(req).await?;
                if fate == Fate::LostReply {
                    return Err(io::Error::new(io::ErrorKind::ConnectionReset, "reply lost").into());
                }
                let (parts, body) = res.into_parts();
                let bytes = body.collect().await.map_err(|e| e.0)?.to_bytes();
                Ok(Response::from_parts(parts, Full::new(bytes)))
            }
        }))
    }
}

/// The figures of the reliability simulation.
#[derive(Clone, Debug, PartialEq)]
pub struct Reliability {
    /// Tasks of `calls` tool calls each.
    pub tasks: u64,
    /// Tool calls per task.
    pub calls: u64,
    /// Share of tasks whose every call succeeded at the first attempt (no retries).
    pub clean_without_retries: f64,
    /// Share of tasks whose every call succeeded with the Backstop stack.
    pub clean_with_backstop: f64,
    /// Extra attempts the stack made, as a share of calls.
    pub extra_load: f64,
    /// Duplicate side effects with the Backstop stack and the replay layer.
    pub duplicates_backstop: u64,
    /// Duplicate side effects with a naive retry (any error, 3 attempts, no keys, no replay).
    pub duplicates_naive: u64,
}

fn order(task: u64, call: u64) -> Req {
    let mut req = Request::post("http://payments.local/refunds")
        .body(Full::new(Bytes::from(format!("task-{task}-call-{call}"))))
        .unwrap();
    req.extensions_mut().insert(ActionContext::tool_call(
        &format!("run-{task}"),
        &format!("step-{call}"),
        "call-1",
    ));
    req
}

/// 20 tool calls per task, `failure_rate` transient failures per attempt, half of them replies
/// lost after the effect was committed. Runs on a paused clock; call it from a runtime started
/// paused (`start_paused = true`).
pub async fn reliability(tasks: u64, calls: u64, failure_rate: f64, seed: u64) -> Reliability {
    // Without retries: one attempt each.
    let dep = Flaky::new(seed, failure_rate);
    let mut svc = dep.service(false);
    let mut clean = 0;
    for t in 0..tasks {
        let mut ok = true;
        for c in 0..calls {
            let r = svc.ready().await.unwrap().call(order(t, c)).await;
            ok &= matches!(r, Ok(ref res) if res.status().is_success());
        }
        clean += u64::from(ok);
    }
    let clean_without_retries = clean as f64 / tasks as f64;

    // The Backstop stack, keys derived from the action, replay layer on the dependency.
    let dep = Flaky::new(seed, failure_rate);
    let stack = Backstop::http("payments-api")
        .preset(Preset::Create)
        .budget(Budget::default())
        .breaker(Breaker::new(BreakerConfig::default()).unwrap())
        .rng(RngSource::seeded(seed))
        .build()
        .unwrap();
    let mut svc = stack.layer(dep.service(true));
    let mut clean = 0;
    for t in 0..tasks {
        let mut ok = true;
        for c in 0..calls {
            let r = svc.ready().await.unwrap().call(order(t, c)).await;
            ok &= matches!(r, Ok(ref res) if res.status().is_success());
        }
        clean += u64::from(ok);
    }
    let total = tasks * calls;
    let extra_load = (dep.attempts.load(Ordering::Relaxed) - total) as f64 / total as f64;
    let duplicates_backstop = dep.duplicates();

    // A naive retry: any error or 5xx, three attempts, no key, no replay layer.
    let dep = Flaky::new(seed, failure_rate);
    let naive = ServiceBuilder::new()
        .retry(TowerPolicy {
            budget: Arc::new(TpsBudget::new(Duration::from_secs(10), 1_000_000, 1000.0)),
            attempts: 2,
        })
        .service(dep.service(false));
    for t in 0..tasks {
        for c in 0..calls {
            let _ = naive.clone().oneshot(order(t, c)).await;
        }
    }
    Reliability {
        tasks,
        calls,
        clean_without_retries,
        clean_with_backstop: clean as f64 / tasks as f64,
        extra_load,
        duplicates_backstop,
        duplicates_naive: dep.duplicates(),
    }
}
