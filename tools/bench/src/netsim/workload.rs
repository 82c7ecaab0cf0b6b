//! The agent host's workload: agents making refunds (keyed by run, step and call, as an agent
//! runtime derives them) and hedged reads, one agent's refunds through a Backstop stack nested
//! inside another, every stack spending one retry budget and asking one breaker.

use super::{CallRecord, Config, End, World, wire};
use crate::stacks::Req;
use backstop::{
    Backstop, BoxError, Preset,
    backoff::RngSource,
    breaker::{Breaker, BreakerConfig},
    budget::{Budget, BudgetConfig},
    idempotency::ActionContext,
    retry::Hedging,
    timeout::{LatencyConfig, LatencyTimeouts},
};
use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use rand::{RngExt, SeedableRng, rngs::SmallRng};
use std::{sync::Arc, time::Duration};
use tokio::time::Instant;
use tower::{Layer, Service, ServiceExt, util::BoxCloneService};

/// The dependency every stack names.
const DEP: &str = "netsim-api";

type Stack = BoxCloneService<Req, http::Response<Full<Bytes>>, BoxError>;

/// Every stack of the agent host, over one leaf client.
struct Stacks {
    writes: Stack,
    nested: Stack,
    reads: Stack,
    budget: Budget,
}

fn collect<S, B>(svc: S) -> Stack
where
    S: Service<Req, Response = http::Response<B>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    use http_body_util::BodyExt;
    BoxCloneService::new(
        svc.map_err(Into::into)
            .and_then(|res: http::Response<B>| async move {
                let (parts, body) = res.into_parts();
                let bytes = body.collect().await.map_err(Into::into)?.to_bytes();
                Ok::<_, BoxError>(http::Response::from_parts(parts, Full::new(bytes)))
            }),
    )
}

fn stacks(world: &Arc<World>, config: &Config, seed: u64) -> Result<Stacks, BoxError> {
    // The whole run in one window, no floor: retries and hedges are at most the ratio's share
    // of calls.
    let budget = Budget::new(
        BudgetConfig::default()
            .ratio(config.budget_ratio)
            .min_retries_per_sec(0.0)
            .window(Duration::from_secs(300)),
    )?;
    let breaker = Breaker::new(BreakerConfig::default().cooldown(Duration::from_millis(300)))?;
    let leaf = {
        let world = world.clone();
        tower::service_fn(move |req: Req| wire::send(world.clone(), req))
    };
    let write = |s: u64| {
        let b = Backstop::http(DEP)
            .budget(budget.clone())
            .breaker(breaker.clone())
            .rng(RngSource::seeded(s))
            .deadline(config.deadline)
            .attempt_timeout(config.attempt_timeout);
        if config.keys {
            b.preset(Preset::Create).build()
        } else {
            b.no_idempotency().build()
        }
    };
    let reads = Backstop::http(DEP)
        .preset(Preset::ReadOnly)
        .budget(budget.clone())
        .breaker(breaker.clone())
        .rng(RngSource::seeded(seed ^ 3))
        .deadline(config.deadline)
        .attempt_timeout_from_latency(LatencyTimeouts::new(
            LatencyConfig::default()
                .min_samples(10)
                .fallback(config.attempt_timeout),
        )?)
        .build()?;
    Ok(Stacks {
        writes: collect(write(seed)?.layer(leaf.clone())),
        nested: collect(write(seed ^ 1)?.layer(write(seed ^ 2)?.layer(leaf.clone()))),
        reads: collect(reads.layer(reads.hedge(leaf, Hedging::default())?)),
        budget,
    })
}

/// One call: a refund or a read, timed in simulated time, recorded as its caller saw it.
async fn one_call(
    world: &World,
    stack: Stack,
    id: String,
    refund: Option<(String, u32)>,
    nested: bool,
) {
    let mut req = match &refund {
        Some((action, _)) => Request::post("http://api/refunds")
            .header(wire::CALL_ID, &id)
            .body(Full::new(Bytes::from(action.clone())))
            .unwrap(),
        None => Request::get("http://api/orders/4812")
            .header(wire::CALL_ID, &id)
            .body(Full::default())
            .unwrap(),
    };
    if let Some((_, agent)) = &refund {
        req.extensions_mut().insert(ActionContext::tool_call(
            &format!("run-{agent}"),
            &id,
            "call-1",
        ));
    }
    let start = Instant::now();
    let end = match stack.oneshot(req).await {
        Ok(res) => End::Answered(res.status().as_u16()),
        Err(e) => match e.downcast::<backstop::Error>() {
            Ok(e) => End::Failed {
                outcome: e.outcome(),
                attempts: e.attempts(),
                message: e.to_string(),
            },
            Err(e) => End::Failed {
                outcome: backstop::Outcome::Unknown,
                attempts: 0,
                message: format!("not a Backstop error: {e}"),
            },
        },
    };
    world.ended(CallRecord {
        id,
        action: refund.map(|(a, _)| a),
        nested,
        end,
        elapsed: start.elapsed(),
    });
}

/// The agent host's software: the agents at once, then a quiet time for every lease and
/// every handler left running to end before the ledger is read.
pub(crate) async fn agents(world: Arc<World>, config: Config, seed: u64) -> turmoil::Result {
    let stacks = stacks(&world, &config, seed).map_err(|e| e.to_string())?;
    let mut tasks = tokio::task::JoinSet::new();
    for agent in 0..config.agents {
        let mut rng = SmallRng::seed_from_u64(seed.wrapping_add(u64::from(agent)));
        let world = world.clone();
        let (writes, reads) = if agent == 0 {
            (stacks.nested.clone(), stacks.reads.clone())
        } else {
            (stacks.writes.clone(), stacks.reads.clone())
        };
        let calls = config.calls;
        tasks.spawn_local(async move {
            for n in 0..calls {
                tokio::time::sleep(Duration::from_millis(rng.random_range(0..120))).await;
                let id = format!("a{agent}-c{n}");
                if rng.random::<bool>() {
                    let action = format!("refund {id}");
                    one_call(
                        &world,
                        writes.clone(),
                        id,
                        Some((action, agent)),
                        agent == 0,
                    )
                    .await;
                } else {
                    one_call(&world, reads.clone(), id, None, false).await;
                }
            }
        });
    }
    while tasks.join_next().await.is_some() {}
    let stats = stacks.budget.stats(&backstop::Dependency::new(DEP));
    *world.budget.lock().unwrap() = (stats.requests, stats.retries);
    tokio::time::sleep(config.lease * 2).await;
    Ok(())
}
