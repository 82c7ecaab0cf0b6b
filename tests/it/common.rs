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

/// Whether this process is the one to run test `name` of module `module` (`module_path!()`):
/// it runs the test binary again for that one test, on one test thread, asserts that it passed,
/// and answers `false`; in that process, `true`. For tests that read spans through a scoped
/// subscriber: in a binary whose other tests run on threads without one, a callsite those
/// threads reach first can have its interest cached as "never", and the test's spans go
/// unrecorded.
pub(crate) fn in_own_process(module: &str, name: &str) -> bool {
    const CHILD: &str = "BACKSTOP_TEST_IN_OWN_PROCESS";
    if std::env::var_os(CHILD).is_some() {
        return true;
    }
    let path = module.split_once("::").map_or(module, |(_, rest)| rest);
    let test = format!("{path}::{name}");
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", &test, "--nocapture", "--test-threads", "1"])
        .env(CHILD, "1")
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && said.contains("1 passed"),
        "{test} in a process of its own:\n{said}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    false
}
