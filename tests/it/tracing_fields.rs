//! What the stack tells operators through `tracing`: a span per call and per attempt with the
//! fields an operator needs (dependency, run and tool-call ids, key, attempts, outcome, error),
//! and an event per retry. Each test runs in a process of its
//! own (`common::in_own_process`): tracing caches each callsite's interest per process, and a
//! test without a subscriber running in parallel could make one of these miss spans.

use crate::common;

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
};
use tracing::{
    Event, Subscriber,
    field::{Field, Visit},
    span::{Attributes, Id, Record},
};

/// Field names and their recorded values.
type FieldMap = BTreeMap<String, String>;

/// Spans (name and fields) and events (fields), as a minimal subscriber saw them, with each
/// span's parent (explicit, or the span entered when it was created).
#[derive(Clone, Default)]
struct Seen {
    spans: Arc<Mutex<Vec<(String, FieldMap)>>>,
    parents: Arc<Mutex<Vec<Option<u64>>>>,
    entered: Arc<Mutex<Vec<u64>>>,
    metadata: Arc<Mutex<Vec<&'static tracing::Metadata<'static>>>>,
    events: Arc<Mutex<Vec<BTreeMap<String, String>>>>,
}

struct Fields<'a>(&'a mut BTreeMap<String, String>);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }
}

impl Subscriber for Seen {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, attrs: &Attributes<'_>) -> Id {
        let mut fields = BTreeMap::new();
        attrs.record(&mut Fields(&mut fields));
        let parent = if attrs.is_contextual() {
            self.entered.lock().unwrap().last().copied()
        } else {
            attrs.parent().map(Id::into_u64)
        };
        self.parents.lock().unwrap().push(parent);
        self.metadata.lock().unwrap().push(attrs.metadata());
        let mut spans = self.spans.lock().unwrap();
        spans.push((attrs.metadata().name().to_owned(), fields));
        Id::from_u64(spans.len() as u64)
    }
    fn record(&self, id: &Id, values: &Record<'_>) {
        let mut spans = self.spans.lock().unwrap();
        values.record(&mut Fields(&mut spans[id.into_u64() as usize - 1].1));
    }
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, event: &Event<'_>) {
        let mut fields = BTreeMap::new();
        event.record(&mut Fields(&mut fields));
        self.events.lock().unwrap().push(fields);
    }
    fn current_span(&self) -> tracing_core::span::Current {
        match self.entered.lock().unwrap().last() {
            Some(&id) => tracing_core::span::Current::new(
                Id::from_u64(id),
                self.metadata.lock().unwrap()[id as usize - 1],
            ),
            None => tracing_core::span::Current::none(),
        }
    }
    fn enter(&self, id: &Id) {
        self.entered.lock().unwrap().push(id.into_u64());
    }
    fn exit(&self, id: &Id) {
        let mut entered = self.entered.lock().unwrap();
        let at = entered.iter().rposition(|e| *e == id.into_u64());
        entered.remove(at.expect("exited a span that was entered"));
    }
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn spans_and_events_carry_the_fields_operators_need() {
    if !crate::common::in_own_process(
        module_path!(),
        "spans_and_events_carry_the_fields_operators_need",
    ) {
        return;
    }
    let seen = Seen::default();
    let _tracing = tracing::subscriber::set_default(seen.clone());

    common::label_purchase_retried_once("tracing-fields-labels-api").await;

    let spans = seen.spans.lock().unwrap().clone();
    let parents = seen.parents.lock().unwrap().clone();
    let call_at = spans
        .iter()
        .position(|(name, _)| name == "call")
        .expect("a call span");
    let call = &spans[call_at].1;
    assert_eq!(call["dependency"], "tracing-fields-labels-api");
    assert_eq!(call["run_id"], "run-91f2");
    assert_eq!(call["tool_call_id"], "call-07");
    assert_eq!(
        call["idempotency_key"],
        "62c365e88817e25626ebbb4f2483d275b4594ce9369da9139952f99edd3dcfa8"
    );
    assert_eq!(call["attempts"], "2");
    assert_eq!(call["outcome"], "completed");
    let attempts: Vec<_> = spans
        .iter()
        .filter(|(name, _)| name == "attempt")
        .map(|(_, f)| f["attempt"].clone())
        .collect();
    assert_eq!(attempts, ["1", "2"]);
    // OpenTelemetry's resend count, on resends only.
    let resends: Vec<_> = spans
        .iter()
        .filter(|(name, _)| name == "attempt")
        .map(|(_, f)| f.get("http.request.resend_count").cloned())
        .collect();
    assert_eq!(resends, [None, Some("1".to_owned())]);
    // Both attempts, the first begun in `call` and the retry begun in `poll`, sit inside the
    // call's span.
    let call_id = call_at as u64 + 1;
    for (at, (name, _)) in spans.iter().enumerate() {
        if name == "attempt" {
            assert_eq!(
                parents[at],
                Some(call_id),
                "attempt span {at} outside the call span"
            );
        }
    }
    assert!(
        seen.entered.lock().unwrap().is_empty(),
        "every span entered was exited"
    );
    let events = seen.events.lock().unwrap().clone();
    let retrying = events
        .iter()
        .find(|e| e.get("message").is_some_and(|m| m == "retrying"))
        .expect("a retrying event");
    assert_eq!(retrying["wait_ms"], "300");
    assert_eq!(retrying["outcome"], "not_sent");
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn three_nested_stacks_make_one_call_span() {
    if !crate::common::in_own_process(module_path!(), "three_nested_stacks_make_one_call_span") {
        return;
    }
    use backstop::{Backstop, BoxError};
    use tower::{Layer, ServiceExt, service_fn};
    type Req = http::Request<http_body_util::Full<bytes::Bytes>>;

    let seen = Seen::default();
    let _tracing = tracing::subscriber::set_default(seen.clone());
    let stack = || {
        Backstop::http("tracing-fields-rates-api")
            .budget(backstop::budget::Budget::default())
            .no_breaker()
            .build()
            .unwrap()
    };
    let busy = service_fn(|_req: Req| async {
        Ok::<_, BoxError>(http::Response::builder().status(503).body(()).unwrap())
    });
    let inner = stack().layer(busy);
    let middle = stack().layer(service_fn(move |req: Req| {
        let inner = inner.clone();
        async move { inner.oneshot(req).await.map_err(BoxError::from) }
    }));
    let outer = stack().layer(service_fn(move |req: Req| {
        let middle = middle.clone();
        async move { middle.oneshot(req).await.map_err(BoxError::from) }
    }));
    let res = outer
        .oneshot(
            http::Request::get("http://rates.local/")
                .body(Default::default())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(res.status(), 503);
    let spans = seen.spans.lock().unwrap().clone();
    let calls = spans.iter().filter(|(name, _)| name == "call").count();
    assert_eq!(calls, 1, "one logical call, one call span");
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_run_s_retries_are_told_with_the_run_and_the_tool_that_spent_them() {
    if !crate::common::in_own_process(
        module_path!(),
        "a_run_s_retries_are_told_with_the_run_and_the_tool_that_spent_them",
    ) {
        return;
    }
    use backstop::{
        Backstop, Run,
        backoff::RngSource,
        mcp::{ToolCall, ToolError, ToolPolicy, ToolResult},
    };
    use tower::{Layer, ServiceExt, service_fn};
    let seen = Seen::default();
    let _tracing = tracing::subscriber::set_default(seen.clone());
    let down = service_fn(|_call: ToolCall| async {
        Err::<ToolResult, _>(ToolError::NotSent(Box::new(std::io::Error::from(
            std::io::ErrorKind::ConnectionRefused,
        ))))
    });
    let carrier = Backstop::mcp("carrier-mcp")
        .no_breaker()
        .no_budget()
        .rng(RngSource::seeded(5))
        .build()
        .unwrap()
        .layer(down);
    let run = Run::new("run-spans").retry_budget(1);
    // The run alone (no action context): the call span still names it.
    let mut call = ToolCall::new("quote", serde_json::json!({}))
        .unwrap()
        .with_policy(ToolPolicy::ReadOnly);
    run.attach(&mut call);
    carrier.oneshot(call).await.unwrap_err();

    let spans = seen.spans.lock().unwrap().clone();
    let call = &spans
        .iter()
        .find(|(n, _)| n == "call")
        .expect("a call span")
        .1;
    assert_eq!(call["run_id"], "run-spans");
    assert_eq!(call["attempts"], "2", "one retry: the run's budget");
    let events = seen.events.lock().unwrap().clone();
    let retrying: Vec<_> = events
        .iter()
        .filter(|e| e.get("message").is_some_and(|m| m == "retrying"))
        .collect();
    assert_eq!(retrying.len(), 1);
    assert_eq!(retrying[0]["run"], "run-spans");
    assert_eq!(retrying[0]["dependency"], "carrier-mcp");
}

/// With telemetry, each attempt's span carries the HTTP semantic conventions' attributes (its
/// name the method, its kind client), inside the call's span.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn each_attempt_span_carries_the_http_conventions_attributes() {
    if !crate::common::in_own_process(
        module_path!(),
        "each_attempt_span_carries_the_http_conventions_attributes",
    ) {
        return;
    }
    use backstop::{Backstop, backoff::RngSource, otel::Telemetry};
    use opentelemetry::metrics::MeterProvider;
    use std::sync::atomic::{AtomicU32, Ordering};
    use tower::{Layer, ServiceExt, service_fn};
    let seen = Seen::default();
    let _tracing = tracing::subscriber::set_default(seen.clone());
    let provider = opentelemetry_sdk::metrics::SdkMeterProvider::builder().build();
    let n = Arc::new(AtomicU32::new(0));
    let flaky = service_fn(move |_req: http::Request<String>| {
        let status = if n.fetch_add(1, Ordering::SeqCst) == 0 {
            503
        } else {
            200
        };
        async move {
            Ok::<_, std::io::Error>(http::Response::builder().status(status).body(()).unwrap())
        }
    });
    let stack = Backstop::http("tracing-fields-otel-api")
        .rng(RngSource::seeded(2))
        .no_breaker()
        .no_budget()
        .telemetry(Telemetry::new(&provider.meter("backstop")))
        .build()
        .unwrap()
        .layer(flaky);
    let req = http::Request::get("https://fx.otel.test/rates")
        .body(String::new())
        .unwrap();
    assert_eq!(stack.oneshot(req).await.unwrap().status(), 200);
    let spans = seen.spans.lock().unwrap().clone();
    let attempts: Vec<&FieldMap> = spans
        .iter()
        .filter(|(name, _)| name == "attempt")
        .map(|(_, f)| f)
        .collect();
    assert_eq!(attempts.len(), 2, "{spans:?}");
    for (a, status) in attempts.iter().zip(["503", "200"]) {
        assert_eq!(a["otel.name"], "GET", "{a:?}");
        assert_eq!(a["otel.kind"], "client");
        assert_eq!(a["http.request.method"], "GET");
        assert_eq!(a["server.address"], "fx.otel.test");
        assert_eq!(a["server.port"], "443");
        assert_eq!(a["url.full"], "https://fx.otel.test/rates");
        assert_eq!(a["http.response.status_code"], status);
    }
    assert_eq!(attempts[0]["error.type"], "503");
    assert!(!attempts[1].contains_key("error.type"));
    assert_eq!(attempts[1]["http.request.resend_count"], "1");
}
