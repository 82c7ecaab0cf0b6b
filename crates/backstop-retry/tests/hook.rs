//! The call hook: run once per logical call by the retry layer itself, before the first
//! attempt and with the final result. Paused clock, seeded RNGs.

use backstop_backoff::{Backoff, RngSource};
use backstop_classify::HttpClassifier;
use backstop_core::{BoxError, Dependency};
use backstop_retry::{CallHook, HttpResend, RetryBudget, RetryError, RetryLayer};
use bytes::Bytes;
use http::{HeaderValue, Request, Response};
use http_body_util::Full;
use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicU32, Ordering},
    },
    task::{Context, Poll},
    time::Duration,
};
use tokio::time::Instant;
use tower::{Layer, Service, ServiceExt, service_fn};

type Req = Request<Full<Bytes>>;
type Res = Response<&'static str>;

fn post() -> Req {
    Request::post("http://carrier.local/labels")
        .body(Full::default())
        .unwrap()
}

fn layer() -> RetryLayer<HttpClassifier, HttpResend, Dependency> {
    RetryLayer::http()
        .dependency("labels-api")
        .rng(RngSource::seeded(7))
        .backoff(Backoff::constant(Duration::from_millis(100)))
}

/// What the hook saw: the dependency at `begin`, the result at `end`.
#[derive(Clone, Debug, Default)]
struct Log {
    begun: Arc<Mutex<Vec<String>>>,
    ended: Arc<Mutex<Vec<String>>>,
}

/// Stamps a key on the request (once per call), refuses calls marked `x-refuse`, and turns
/// every error into a `String` naming the dependency.
#[derive(Clone)]
struct Stamp {
    log: Log,
    next_key: Arc<AtomicU32>,
}

impl CallHook<Req, Res> for Stamp {
    type State = Dependency;
    type Error = String;

    fn begin(&self, req: &mut Req, dependency: &Dependency) -> Result<Dependency, String> {
        self.log.begun.lock().unwrap().push(dependency.to_string());
        if req.headers().contains_key("x-refuse") {
            return Err(format!("{dependency}: refused before sending"));
        }
        let key = self.next_key.fetch_add(1, Ordering::SeqCst);
        req.headers_mut()
            .insert("idempotency-key", HeaderValue::from(key));
        // One key per call: were `begin` run per attempt, the retries would carry 42 and 43.
        Ok(dependency.clone())
    }

    fn end(
        &self,
        dependency: &mut Dependency,
        result: Result<Res, BoxError>,
    ) -> Result<Res, String> {
        let seen = match &result {
            Ok(res) => format!("ok {}", res.status().as_u16()),
            Err(e) => format!("err {e}"),
        };
        self.log.ended.lock().unwrap().push(seen);
        result.map_err(|e| format!("{dependency}: {e}"))
    }

    fn ready_error(&self, error: BoxError) -> String {
        format!("not ready: {error}")
    }
}

fn stamp(log: &Log) -> Stamp {
    Stamp {
        log: log.clone(),
        next_key: Arc::new(AtomicU32::new(41)),
    }
}

/// Answers 503 twice, then 200, recording the key each attempt carried.
fn flaky(
    keys: Arc<Mutex<Vec<Option<String>>>>,
) -> impl Service<Req, Response = Res, Error = BoxError, Future: Send> + Clone {
    service_fn(move |req: Req| {
        let mut keys = keys.lock().unwrap();
        keys.push(
            req.headers()
                .get("idempotency-key")
                .map(|v| v.to_str().unwrap().to_owned()),
        );
        let status = if keys.len() < 3 { 503 } else { 200 };
        async move { Ok::<_, BoxError>(Response::builder().status(status).body("").unwrap()) }
    })
}

#[tokio::test(start_paused = true)]
async fn begin_runs_once_per_call_and_what_it_adds_is_on_every_attempt() {
    let log = Log::default();
    let keys = Arc::default();
    let svc = layer().hook(stamp(&log)).layer(flaky(Arc::clone(&keys)));
    let res = svc.oneshot(post()).await.unwrap();
    assert_eq!(res.status(), 200);
    // Three attempts, one call: one key, on all three.
    let k = Some("41".to_owned());
    assert_eq!(*keys.lock().unwrap(), [k.clone(), k.clone(), k]);
    assert_eq!(*log.begun.lock().unwrap(), ["labels-api"]);
    assert_eq!(*log.ended.lock().unwrap(), ["ok 200"]);
}

#[tokio::test(start_paused = true)]
async fn end_sees_the_final_error_and_decides_the_error_type() {
    let log = Log::default();
    let svc = layer()
        .max_attempts(2)
        .unwrap()
        .hook(stamp(&log))
        .layer(service_fn(|_req: Req| async {
            Err::<Res, BoxError>("connection reset by peer".into())
        }));
    let err: String = svc.oneshot(post()).await.unwrap_err();
    assert!(err.starts_with("labels-api: "), "{err}");
    let ended = log.ended.lock().unwrap().clone();
    assert_eq!(ended.len(), 1, "end runs once per call, not per attempt");
    assert!(ended[0].starts_with("err "), "{ended:?}");
}

/// Counts deposits: a refused call must not count as a request.
#[derive(Debug, Default)]
struct Deposits(AtomicU32);

impl RetryBudget for Deposits {
    fn deposit(&self, _dependency: &Dependency, _now: Instant) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
    fn withdraw(&self, _dependency: &Dependency) -> bool {
        true
    }
}

#[tokio::test(start_paused = true)]
async fn a_refused_call_sends_nothing_and_asks_no_budget() {
    let log = Log::default();
    let budget = Arc::new(Deposits::default());
    let sent = Arc::new(AtomicU32::new(0));
    let counter = Arc::clone(&sent);
    let svc = layer()
        .budget(budget.clone())
        .hook(stamp(&log))
        .layer(service_fn(move |_req: Req| {
            counter.fetch_add(1, Ordering::SeqCst);
            async { Ok::<_, BoxError>(Response::new("")) }
        }));
    let mut req = post();
    req.headers_mut()
        .insert("x-refuse", HeaderValue::from_static("1"));
    let err = svc.clone().oneshot(req).await.unwrap_err();
    assert_eq!(err, "labels-api: refused before sending");
    assert_eq!(sent.load(Ordering::SeqCst), 0);
    assert_eq!(budget.0.load(Ordering::SeqCst), 0);
    assert!(
        log.ended.lock().unwrap().is_empty(),
        "a refused call never ends"
    );

    // The next call goes through as usual.
    svc.oneshot(post()).await.unwrap();
    assert_eq!(sent.load(Ordering::SeqCst), 1);
    assert_eq!(budget.0.load(Ordering::SeqCst), 1);
}

/// Never ready: its readiness error is the hook's to shape.
#[derive(Clone)]
struct Closed;

impl Service<Req> for Closed {
    type Response = Res;
    type Error = BoxError;
    type Future = std::future::Ready<Result<Res, BoxError>>;
    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        Poll::Ready(Err("the pool is closed".into()))
    }
    fn call(&mut self, _req: Req) -> Self::Future {
        unreachable!("never ready")
    }
}

#[tokio::test(start_paused = true)]
async fn a_readiness_error_goes_through_the_hook() {
    let log = Log::default();
    let err = layer()
        .hook(stamp(&log))
        .layer(Closed)
        .oneshot(post())
        .await
        .unwrap_err();
    assert_eq!(err, "not ready: the pool is closed");
}

#[tokio::test(start_paused = true)]
async fn without_a_hook_errors_stay_retry_errors() {
    let err = layer()
        .max_attempts(1)
        .unwrap()
        .layer(service_fn(|_req: Req| async {
            Err::<Res, BoxError>("connection reset by peer".into())
        }))
        .oneshot(post())
        .await
        .unwrap_err();
    assert!(err.is::<RetryError>(), "{err}");
}
