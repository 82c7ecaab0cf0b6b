//! A dependency down for minutes: the load naive retries, tower's budget and Backstop send it.

use crate::stacks::{Req, Res, TowerPolicy};
use backstop::{
    Backstop, BoxError,
    backoff::RngSource,
    breaker::{Breaker, BreakerConfig},
    budget::Budget,
};
use http::{Request, Response};
use http_body_util::Full;
use std::{
    future::ready,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};
use tower::{
    Layer, Service, ServiceBuilder, ServiceExt, retry::budget::TpsBudget, util::BoxCloneSyncService,
};

/// Attempts that reached a dependency during a total outage.
#[derive(Clone, Debug, PartialEq)]
pub struct Outage {
    /// The strategy.
    pub name: &'static str,
    /// Logical requests made.
    pub requests: u64,
    /// Attempts that reached the dependency.
    pub attempts: u64,
}

impl Outage {
    /// Attempts per logical request.
    pub fn amplification(&self) -> f64 {
        self.attempts as f64 / self.requests as f64
    }
}

fn counting_503() -> (BoxCloneSyncService<Req, Res, BoxError>, Arc<AtomicU64>) {
    let n = Arc::new(AtomicU64::new(0));
    let c = n.clone();
    let svc = tower::service_fn(move |_req: Req| {
        c.fetch_add(1, Ordering::Relaxed);
        ready(Ok::<_, BoxError>(
            Response::builder()
                .status(503)
                .body(Full::default())
                .unwrap(),
        ))
    });
    (BoxCloneSyncService::new(svc), n)
}

fn naive_policy() -> TowerPolicy {
    TowerPolicy {
        budget: Arc::new(TpsBudget::new(Duration::from_secs(10), 1_000_000, 1000.0)),
        attempts: 2,
    }
}

async fn drive_outage<S>(
    name: &'static str,
    svc: S,
    attempts: Arc<AtomicU64>,
    duration: Duration,
    every: Duration,
) -> Outage
where
    S: Service<Req> + Clone + Send + 'static,
    S::Future: Send,
    S::Response: Send,
    S::Error: Send,
{
    // Requests arrive on a fixed schedule, whatever the earlier ones are doing (as callers do),
    // so every strategy sees the same number of requests.
    let start = tokio::time::Instant::now();
    let mut requests = 0;
    let mut tasks = tokio::task::JoinSet::new();
    while start.elapsed() < duration {
        requests += 1;
        let get = Request::get("http://carrier.local/rates")
            .body(Full::default())
            .unwrap();
        let svc = svc.clone();
        tasks.spawn(async move {
            let _ = svc.oneshot(get).await;
        });
        tokio::time::sleep(every).await;
    }
    while tasks.join_next().await.is_some() {}
    Outage {
        name,
        requests,
        attempts: attempts.load(Ordering::Relaxed),
    }
}

/// A total outage of `duration`, one logical request every `every`, against each strategy.
/// Runs on a paused clock.
pub async fn outage(duration: Duration, every: Duration) -> Vec<Outage> {
    let mut out = Vec::new();

    let (dep, n) = counting_503();
    let nested = ServiceBuilder::new()
        .retry(naive_policy())
        .retry(naive_policy())
        .retry(naive_policy())
        .service(dep);
    out.push(
        drive_outage(
            "three nested naive retry layers (3 attempts each)",
            nested,
            n,
            duration,
            every,
        )
        .await,
    );

    let (dep, n) = counting_503();
    let tower_plain = ServiceBuilder::new().retry(naive_policy()).service(dep);
    out.push(
        drive_outage(
            "tower retry, 3 attempts, no budget",
            tower_plain,
            n,
            duration,
            every,
        )
        .await,
    );

    let (dep, n) = counting_503();
    let budget = Arc::new(TpsBudget::new(Duration::from_secs(10), 10, 0.2));
    let tower_budget = ServiceBuilder::new()
        .retry(TowerPolicy {
            budget,
            attempts: 2,
        })
        .service(dep);
    out.push(
        drive_outage(
            "tower retry + TpsBudget (20 %, 10/s)",
            tower_budget,
            n,
            duration,
            every,
        )
        .await,
    );

    let (dep, n) = counting_503();
    let budget_only = Backstop::http("carrier-api")
        .budget(Budget::default())
        .no_breaker()
        .rng(RngSource::seeded(1))
        .build()
        .unwrap()
        .layer(dep);
    out.push(drive_outage("Backstop, budget only", budget_only, n, duration, every).await);

    let (dep, n) = counting_503();
    let full = Backstop::http("carrier-api")
        .budget(Budget::default())
        .breaker(Breaker::new(BreakerConfig::default()).unwrap())
        .rng(RngSource::seeded(1))
        .build()
        .unwrap()
        .layer(dep);
    out.push(drive_outage("Backstop, budget + breaker", full, n, duration, every).await);
    out
}
