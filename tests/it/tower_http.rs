//! tower-http's `TraceLayer` and `SetRequestId` around and inside the stack, with the
//! subscriber an operator typically runs (`info,tower_http=debug`: Backstop's own debug-level
//! attempt spans off). Alone in its test binary: tracing caches callsite interest per process.
//!
//! - Inside the stack: one request id and one `request` span per attempt, every one of them a
//!   child of the logical call's span (the first attempt's too).
//! - Outside: one request id and one span per logical call, whatever the attempts.

use backstop::Backstop;
use http::{HeaderValue, Request, Response};
use std::sync::{
    Arc, Mutex,
    atomic::{AtomicU32, AtomicU64, Ordering},
};
use tower::{Layer, ServiceBuilder, ServiceExt, service_fn};
use tower_http::{
    request_id::{MakeRequestId, RequestId, SetRequestIdLayer},
    trace::TraceLayer,
};
use tracing::{
    Subscriber,
    span::{Attributes, Id, Record},
};

/// Span names and parents as a subscriber filtering `info,tower_http=debug` sees them.
#[derive(Clone, Default)]
struct Spans {
    names: Arc<Mutex<Vec<String>>>,
    parents: Arc<Mutex<Vec<Option<u64>>>>,
    entered: Arc<Mutex<Vec<u64>>>,
}

impl Spans {
    fn ids_named(&self, name: &str) -> Vec<u64> {
        let names = self.names.lock().unwrap();
        (0..names.len())
            .filter(|i| names[*i] == name)
            .map(|i| i as u64 + 1)
            .collect()
    }
    fn parent(&self, id: u64) -> Option<u64> {
        self.parents.lock().unwrap()[id as usize - 1]
    }
}

impl Subscriber for Spans {
    fn enabled(&self, m: &tracing::Metadata<'_>) -> bool {
        m.target().starts_with("tower_http") || *m.level() <= tracing::Level::INFO
    }
    fn new_span(&self, attrs: &Attributes<'_>) -> Id {
        let parent = if attrs.is_contextual() {
            self.entered.lock().unwrap().last().copied()
        } else {
            attrs.parent().map(Id::into_u64)
        };
        self.parents.lock().unwrap().push(parent);
        let mut names = self.names.lock().unwrap();
        names.push(attrs.metadata().name().to_owned());
        Id::from_u64(names.len() as u64)
    }
    fn record(&self, _: &Id, _: &Record<'_>) {}
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, _: &tracing::Event<'_>) {}
    fn enter(&self, id: &Id) {
        self.entered.lock().unwrap().push(id.into_u64());
    }
    fn exit(&self, id: &Id) {
        let mut entered = self.entered.lock().unwrap();
        if let Some(at) = entered.iter().rposition(|e| *e == id.into_u64()) {
            entered.remove(at);
        }
    }
}

/// Request ids `req-1`, `req-2`, ...
#[derive(Clone, Default)]
struct Counter(Arc<AtomicU64>);

impl MakeRequestId for Counter {
    fn make_request_id<B>(&mut self, _: &Request<B>) -> Option<RequestId> {
        let n = self.0.fetch_add(1, Ordering::SeqCst) + 1;
        Some(RequestId::new(
            HeaderValue::from_str(&format!("req-{n}")).unwrap(),
        ))
    }
}

type Body = http_body_util::Full<bytes::Bytes>;

/// Busy twice, then answers; records the request id each attempt carried.
fn flaky(
    ids: Arc<Mutex<Vec<String>>>,
) -> impl tower::Service<Request<Body>, Response = Response<Body>, Error = std::io::Error, Future: Send>
+ Clone
+ Send
+ 'static {
    let n = Arc::new(AtomicU32::new(0));
    service_fn(move |req: Request<Body>| {
        let id = req
            .headers()
            .get("x-request-id")
            .map(|v| v.to_str().unwrap().to_owned());
        ids.lock().unwrap().push(id.unwrap_or_default());
        let status = if n.fetch_add(1, Ordering::SeqCst) < 2 {
            503
        } else {
            200
        };
        async move {
            Ok(Response::builder()
                .status(status)
                .body(Body::default())
                .unwrap())
        }
    })
}

fn get() -> Request<Body> {
    Request::get("http://rates.local/q")
        .body(Body::default())
        .unwrap()
}

fn stack() -> backstop::BackstopLayer<
    backstop::classify::HttpClassifier,
    backstop::retry::HttpResend,
    backstop::idempotency::HttpKeys,
> {
    Backstop::http("tower-http-rates-api")
        .rng(backstop::backoff::RngSource::seeded(3))
        .no_breaker()
        .no_budget()
        .build()
        .unwrap()
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn inside_the_stack_each_attempt_has_its_id_and_its_span_all_in_the_call_span() {
    if !crate::common::in_own_process(
        module_path!(),
        "inside_the_stack_each_attempt_has_its_id_and_its_span_all_in_the_call_span",
    ) {
        return;
    }
    let spans = Spans::default();
    let _guard = tracing::subscriber::set_default(spans.clone());
    let ids = Arc::new(Mutex::new(Vec::new()));
    let inner = ServiceBuilder::new()
        .layer(SetRequestIdLayer::x_request_id(Counter::default()))
        .layer(TraceLayer::new_for_http())
        .service(flaky(ids.clone()));
    let res = stack().layer(inner).oneshot(get()).await.unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(
        *ids.lock().unwrap(),
        ["req-1", "req-2", "req-3"],
        "one id per attempt"
    );
    let calls = spans.ids_named("call");
    assert_eq!(calls.len(), 1);
    let requests = spans.ids_named("request");
    assert_eq!(requests.len(), 3, "one span per attempt");
    for r in requests {
        assert_eq!(
            spans.parent(r),
            Some(calls[0]),
            "every attempt's span is in the call's, the first's too"
        );
    }
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn outside_the_stack_one_id_and_one_span_per_logical_call() {
    if !crate::common::in_own_process(
        module_path!(),
        "outside_the_stack_one_id_and_one_span_per_logical_call",
    ) {
        return;
    }
    let spans = Spans::default();
    let _guard = tracing::subscriber::set_default(spans.clone());
    let ids = Arc::new(Mutex::new(Vec::new()));
    let svc = ServiceBuilder::new()
        .layer(SetRequestIdLayer::x_request_id(Counter::default()))
        .layer(TraceLayer::new_for_http())
        .layer(stack())
        .service(flaky(ids.clone()));
    let res = svc.oneshot(get()).await.unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(
        *ids.lock().unwrap(),
        ["req-1", "req-1", "req-1"],
        "every attempt carries the call's id"
    );
    let requests = spans.ids_named("request");
    assert_eq!(requests.len(), 1);
    let calls = spans.ids_named("call");
    assert_eq!(
        spans.parent(calls[0]),
        Some(requests[0]),
        "the call's span inside tower-http's"
    );
}
