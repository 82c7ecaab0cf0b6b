//! What several test binaries share.

use backstop::{
    Backstop, Preset,
    backoff::{Backoff, RngSource},
    breaker::{Breaker, BreakerConfig},
    budget::Budget,
    idempotency::ActionContext,
};
use http::{Request, Response};
use std::{
    io,
    sync::{
        Arc,
        atomic::{AtomicU32, Ordering},
    },
    time::Duration,
};
use tower::{Layer, ServiceExt, service_fn};

/// One keyed label purchase through the full stack (`Create` preset, constant 300 ms backoff)
/// against `dependency`, whose first answer is a 503: two attempts, a success.
pub(crate) async fn label_purchase_retried_once(dependency: &'static str) {
    let n = Arc::new(AtomicU32::new(0));
    let flaky = service_fn(move |_req: Request<String>| {
        let first = n.fetch_add(1, Ordering::SeqCst) == 0;
        let status = if first { 503 } else { 201 };
        async move { Ok::<_, io::Error>(Response::builder().status(status).body(()).unwrap()) }
    });
    let svc = Backstop::http(dependency)
        .preset(Preset::Create)
        .budget(Budget::default())
        .breaker(Breaker::new(BreakerConfig::default()).unwrap())
        .backoff(Backoff::constant(Duration::from_millis(300)))
        .rng(RngSource::seeded(1))
        .build()
        .unwrap()
        .layer(flaky);
    let mut req = Request::post("http://labels.local/labels")
        .body(String::new())
        .unwrap();
    req.extensions_mut()
        .insert(ActionContext::tool_call("run-91f2", "step-3", "call-07"));
    assert_eq!(svc.oneshot(req).await.unwrap().status(), 201);
}
