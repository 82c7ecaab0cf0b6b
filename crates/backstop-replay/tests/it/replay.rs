//! The replay layer against its in-memory store, and against a real Redis of the test's own.

use backstop_replay::{
    Claim, Fingerprint, Lease, MemoryStore, Principal, ReplayLayer, ReplayRequestBody, ReplayStore,
    StoreError, StoreFuture, StoredResponse,
};
use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use std::{
    convert::Infallible,
    sync::{
        Arc,
        atomic::{AtomicU32, Ordering},
    },
    time::Duration,
};
use tower::{Layer, Service, ServiceExt, service_fn};

/// What the handler does.
#[derive(Clone, Copy, Debug)]
enum Mode {
    Ok,
    Status(u16),
    Sleep(Duration),
    Panic,
    Big(usize),
}

/// A refund handler that counts how many times it really ran.
#[derive(Clone)]
struct Handler {
    runs: Arc<AtomicU32>,
    mode: Mode,
}

impl Handler {
    fn new(mode: Mode) -> Self {
        Handler {
            runs: Arc::default(),
            mode,
        }
    }
    fn runs(&self) -> u32 {
        self.runs.load(Ordering::SeqCst)
    }
    fn service(
        &self,
    ) -> impl Service<
        Request<ReplayRequestBody>,
        Response = Response<Full<Bytes>>,
        Error = Infallible,
        Future: Send,
    > + Clone
    + Send
    + use<> {
        let (runs, mode) = (self.runs.clone(), self.mode);
        service_fn(move |req: Request<ReplayRequestBody>| {
            let runs = runs.clone();
            async move {
                let who = req
                    .extensions()
                    .get::<Principal>()
                    .map_or("anonymous".to_owned(), |p| p.0.clone());
                let body = req.into_body().collect().await.unwrap().to_bytes();
                let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
                let mut status = 201;
                match mode {
                    Mode::Ok => {}
                    Mode::Status(s) => status = s,
                    Mode::Sleep(d) => tokio::time::sleep(d).await,
                    Mode::Panic => panic!("the handler crashed"),
                    Mode::Big(n) => {
                        return Ok(Response::new(Full::new(Bytes::from(vec![b'x'; n]))));
                    }
                }
                let text = format!(
                    r#"{{"refund_id":"R{n}","for":"{who}","body":{}}}"#,
                    String::from_utf8_lossy(&body)
                );
                Ok(Response::builder()
                    .status(status)
                    .header("content-type", "application/json")
                    .header("location", format!("/refunds/R{n}"))
                    .header("set-cookie", "session=secret")
                    .header("date", "Mon, 30 Nov 2026 10:00:00 GMT")
                    .header("x-internal", "not stored")
                    .body(Full::new(Bytes::from(text)))
                    .unwrap())
            }
        })
    }
}

fn refund(key: Option<&str>, body: &str) -> Request<Full<Bytes>> {
    let mut b = Request::post("/refunds").header("content-type", "application/json");
    if let Some(k) = key {
        b = b.header("idempotency-key", k);
    }
    b.body(Full::new(Bytes::from(body.to_owned()))).unwrap()
}

async fn text<B: http_body::Body>(res: Response<B>) -> String
where
    B::Error: std::fmt::Debug,
{
    String::from_utf8(res.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap()
}

async fn problem_type<B: http_body::Body>(res: Response<B>) -> String
where
    B::Error: std::fmt::Debug,
{
    assert_eq!(res.headers()["content-type"], "application/problem+json");
    let status = res.status().as_u16();
    let v: serde_json::Value = serde_json::from_str(&text(res).await).unwrap();
    assert_eq!(v["status"], status);
    assert!(v["detail"].as_str().is_some_and(|d| !d.is_empty()));
    v["type"]
        .as_str()
        .unwrap()
        .trim_start_matches("urn:backstop:problem:")
        .to_owned()
}

#[tokio::test]
async fn a_repeat_gets_the_stored_response_and_the_handler_runs_once() {
    let h = Handler::new(Mode::Ok);
    let svc = ReplayLayer::new(MemoryStore::default())
        .single_tenant()
        .layer(h.service());
    let first = svc.clone().oneshot(refund(Some("k1"), "49")).await.unwrap();
    assert_eq!(first.status(), 201);
    assert_eq!(
        first.headers()["set-cookie"],
        "session=secret",
        "the first caller gets everything"
    );
    let first_body = text(first).await;
    for _ in 0..3 {
        let again = svc.clone().oneshot(refund(Some("k1"), "49")).await.unwrap();
        assert_eq!(again.status(), 201);
        let hdr = again.headers();
        assert_eq!(hdr["idempotent-replayed"], "true");
        assert_eq!(hdr["location"], "/refunds/R1");
        assert_eq!(hdr["content-type"], "application/json");
        assert!(
            !hdr.contains_key("set-cookie"),
            "Set-Cookie is never stored"
        );
        assert!(!hdr.contains_key("date"), "Date is never stored");
        assert!(
            !hdr.contains_key("x-internal"),
            "only allow-listed headers are stored"
        );
        assert_eq!(text(again).await, first_body);
    }
    assert_eq!(h.runs(), 1);
    // A structured-field form of the same key is the same key.
    let sf = svc.oneshot(refund(Some("\"k1\""), "49")).await.unwrap();
    assert_eq!(sf.headers()["idempotent-replayed"], "true");
    assert_eq!(h.runs(), 1);
}

#[tokio::test]
async fn set_cookie_and_date_are_never_stored_even_when_allow_listed() {
    let h = Handler::new(Mode::Ok);
    let svc = ReplayLayer::new(MemoryStore::default())
        .single_tenant()
        .allow_header(http::header::SET_COOKIE)
        .allow_header(http::header::DATE)
        .allow_header(http::HeaderName::from_static("x-internal"))
        .layer(h.service());
    let first = svc.clone().oneshot(refund(Some("k1"), "49")).await.unwrap();
    assert_eq!(first.headers()["set-cookie"], "session=secret");
    let again = svc.oneshot(refund(Some("k1"), "49")).await.unwrap();
    let hdr = again.headers();
    assert_eq!(hdr["idempotent-replayed"], "true");
    assert_eq!(hdr["x-internal"], "not stored", "the list is honoured");
    assert!(
        !hdr.contains_key("set-cookie"),
        "one caller's session is never replayed"
    );
    assert!(
        !hdr.contains_key("date"),
        "a stored Date would lie about the reply"
    );
    assert_eq!(h.runs(), 1);
}

#[tokio::test]
async fn bad_keys_and_missing_keys_are_refused_without_running_the_handler() {
    let h = Handler::new(Mode::Ok);
    let svc = ReplayLayer::new(MemoryStore::default())
        .single_tenant()
        .layer(h.service());
    let res = svc.clone().oneshot(refund(None, "49")).await.unwrap();
    assert_eq!(res.status(), 400);
    assert_eq!(problem_type(res).await, "idempotency-key-missing");
    let mut two = refund(Some("a"), "49");
    two.headers_mut()
        .append("idempotency-key", "b".parse().unwrap());
    let res = svc.clone().oneshot(two).await.unwrap();
    assert_eq!(res.status(), 400);
    assert_eq!(problem_type(res).await, "invalid-idempotency-key");
    for bad in ["has space", "\"open", &"k".repeat(256)] {
        let res = svc.clone().oneshot(refund(Some(bad), "49")).await.unwrap();
        assert_eq!(res.status(), 400, "{bad}");
    }
    assert_eq!(h.runs(), 0);
    // Idempotent methods pass through untouched.
    let get = Request::get("/refunds/R1")
        .body(Full::new(Bytes::new()))
        .unwrap();
    assert_eq!(svc.clone().oneshot(get).await.unwrap().status(), 201);
    assert_eq!(h.runs(), 1);
    // Without require_key, a keyless POST runs unprotected.
    let open = ReplayLayer::new(MemoryStore::default())
        .single_tenant()
        .require_key(false)
        .layer(h.service());
    open.clone().oneshot(refund(None, "49")).await.unwrap();
    open.oneshot(refund(None, "49")).await.unwrap();
    assert_eq!(h.runs(), 3);
}

/// A setting that would break the layer is refused where it is made, saying what to change: a
/// `ReplayLayer` that exists is a valid one.
#[test]
fn settings_that_cannot_work_are_refused_when_made() {
    let layer = || ReplayLayer::new(MemoryStore::default());
    let err = layer().lease(Duration::from_millis(5)).unwrap_err();
    assert!(err.to_string().contains("at least 30 ms"), "{err}");
    let err = layer().ttl(Duration::from_secs(10)).unwrap_err();
    assert!(err.to_string().contains("shorter than the lease"), "{err}");
    let err = layer().methods([]).unwrap_err();
    assert!(err.to_string().contains("at least one method"), "{err}");
    // In the order that holds, the same values are accepted.
    let short = layer().lease(Duration::from_secs(1)).unwrap();
    assert!(short.ttl(Duration::from_secs(10)).is_ok());
}

/// A layer is a value: configuring a clone (one shared by two routers, say) changes that clone
/// alone, and never panics.
#[tokio::test]
async fn configuring_a_clone_changes_that_clone_alone() {
    let h = Handler::new(Mode::Ok);
    let strict = ReplayLayer::new(MemoryStore::default()).single_tenant();
    let kept = strict.clone();
    let open = strict.clone().require_key(false);
    // The clone made before keeps requiring keys; the one configured after runs a keyless POST.
    for (layer, status) in [(kept, 400), (open, 201)] {
        let svc = layer.layer(h.service());
        let res = svc.oneshot(refund(None, "49")).await.unwrap();
        assert_eq!(res.status(), status);
    }
    assert_eq!(h.runs(), 1);
}

#[tokio::test]
async fn the_same_key_for_a_different_request_gets_422() {
    let h = Handler::new(Mode::Ok);
    let svc = ReplayLayer::new(MemoryStore::default())
        .single_tenant()
        .layer(h.service());
    svc.clone().oneshot(refund(Some("k"), "49")).await.unwrap();
    let res = svc.clone().oneshot(refund(Some("k"), "50")).await.unwrap();
    assert_eq!(res.status(), 422);
    assert_eq!(problem_type(res).await, "idempotency-key-reused");
    let mut other_path = refund(Some("k"), "49");
    *other_path.uri_mut() = "/refunds?priority=high".parse().unwrap();
    assert_eq!(svc.oneshot(other_path).await.unwrap().status(), 422);
    assert_eq!(h.runs(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hundred_concurrent_requests_with_one_key_run_the_handler_once() {
    let h = Handler::new(Mode::Sleep(Duration::from_millis(200)));
    let svc = ReplayLayer::new(MemoryStore::default())
        .single_tenant()
        .layer(h.service());
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..100 {
        let svc = svc.clone();
        tasks.spawn(async move {
            let res = svc.oneshot(refund(Some("same-key"), "49")).await.unwrap();
            let replayed = res.headers().contains_key("idempotent-replayed");
            (
                res.status().as_u16(),
                replayed,
                res.headers().get("retry-after").cloned(),
            )
        });
    }
    let (mut created, mut conflict, mut replayed) = (0, 0, 0);
    while let Some(r) = tasks.join_next().await {
        match r.unwrap() {
            (201, false, _) => created += 1,
            (201, true, _) => replayed += 1,
            (409, false, Some(after)) => {
                assert_eq!(after, "1");
                conflict += 1
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(h.runs(), 1);
    assert_eq!(created, 1);
    assert_eq!(created + conflict + replayed, 100);
}

#[tokio::test]
async fn one_principal_never_receives_another_principals_response() {
    let h = Handler::new(Mode::Ok);
    // The authentication layer in front of the replay layer sets the principal.
    let auth = |tenant: &'static str| {
        move |mut req: Request<Full<Bytes>>| {
            req.extensions_mut().insert(Principal(tenant.to_owned()));
            req
        }
    };
    let svc = ReplayLayer::new(MemoryStore::default()).layer(h.service());
    let a = svc.clone().map_request(auth("tenant-a"));
    let b = svc.clone().map_request(auth("tenant-b"));
    let ra = text(
        a.clone()
            .oneshot(refund(Some("guessable-key"), "49"))
            .await
            .unwrap(),
    )
    .await;
    let rb = text(
        b.clone()
            .oneshot(refund(Some("guessable-key"), "49"))
            .await
            .unwrap(),
    )
    .await;
    assert!(ra.contains(r#""for":"tenant-a""#), "{ra}");
    assert!(rb.contains(r#""for":"tenant-b""#), "{rb}");
    assert_eq!(h.runs(), 2);
    // Each replays its own.
    let again_b = b
        .oneshot(refund(Some("guessable-key"), "49"))
        .await
        .unwrap();
    assert_eq!(text(again_b).await, rb);
    // A client-chosen header cannot pick the principal.
    let mut spoof = refund(Some("guessable-key"), "49");
    spoof
        .headers_mut()
        .insert("x-tenant", "tenant-a".parse().unwrap());
    // And a request that reaches the layer with no principal at all (the authentication
    // layer mounted inside it) is refused as a misconfiguration, never shared.
    let refused = svc.oneshot(spoof).await.unwrap();
    assert_eq!(refused.status(), 500);
    assert_eq!(problem_type(refused).await, "principal-missing");
    assert_eq!(h.runs(), 2);
}

#[tokio::test(start_paused = true)]
async fn results_expire_after_the_ttl() {
    let h = Handler::new(Mode::Ok);
    let svc = ReplayLayer::new(MemoryStore::default())
        .single_tenant()
        .ttl(Duration::from_secs(3600))
        .unwrap()
        .layer(h.service());
    svc.clone().oneshot(refund(Some("k"), "49")).await.unwrap();
    tokio::time::advance(Duration::from_secs(3599)).await;
    svc.clone().oneshot(refund(Some("k"), "49")).await.unwrap();
    assert_eq!(h.runs(), 1);
    tokio::time::advance(Duration::from_secs(2)).await;
    svc.oneshot(refund(Some("k"), "49")).await.unwrap();
    assert_eq!(h.runs(), 2);
}

#[tokio::test]
async fn oversized_requests_are_refused_and_oversized_responses_are_not_replayed() {
    let h = Handler::new(Mode::Ok);
    let svc = ReplayLayer::new(MemoryStore::default())
        .single_tenant()
        .max_request_body(16)
        .layer(h.service());
    let res = svc
        .oneshot(refund(Some("k"), &"9".repeat(17)))
        .await
        .unwrap();
    assert_eq!(res.status(), 413);
    assert_eq!(problem_type(res).await, "request-too-large");
    assert_eq!(h.runs(), 0);

    let big = Handler::new(Mode::Big(10_000));
    let svc = ReplayLayer::new(MemoryStore::default())
        .single_tenant()
        .max_stored_body(1_000)
        .layer(big.service());
    let first = svc.clone().oneshot(refund(Some("k"), "49")).await.unwrap();
    assert_eq!(
        text(first).await.len(),
        10_000,
        "the first caller gets the whole body"
    );
    let again = svc.oneshot(refund(Some("k"), "49")).await.unwrap();
    assert_eq!(again.status(), 409);
    assert_eq!(problem_type(again).await, "response-not-stored");
    assert_eq!(
        big.runs(),
        1,
        "never run twice, even when the result could not be kept"
    );
}

#[tokio::test(start_paused = true)]
async fn a_long_handler_keeps_its_claim_by_renewing_the_lease() {
    let slow = Handler::new(Mode::Sleep(Duration::from_secs(120)));
    let svc = ReplayLayer::new(MemoryStore::default())
        .single_tenant()
        .lease(Duration::from_secs(30))
        .unwrap()
        .layer(slow.service());
    let first = tokio::spawn(svc.clone().oneshot(refund(Some("k"), "49")));
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_secs(35)).await;
        let res = svc.clone().oneshot(refund(Some("k"), "49")).await.unwrap();
        assert_eq!(
            res.status(),
            409,
            "still in flight long after the first lease would have expired"
        );
    }
    assert_eq!(first.await.unwrap().unwrap().status(), 201);
    assert_eq!(slow.runs(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_client_that_gives_up_does_not_stop_the_handler_nor_free_its_key() {
    // The handler takes 1.5 s (its commit, say); the client gives up after 500 ms and retries.
    let slow = Handler::new(Mode::Sleep(Duration::from_millis(1_500)));
    let svc = ReplayLayer::new(MemoryStore::default())
        .single_tenant()
        .layer(slow.service());
    let gave_up = tokio::time::timeout(
        Duration::from_millis(500),
        svc.clone().oneshot(refund(Some("k"), "49")),
    )
    .await;
    assert!(gave_up.is_err(), "the client gave up");
    // Its retry, while the handler still runs: 409 with Retry-After, not a second run.
    let busy = svc.clone().oneshot(refund(Some("k"), "49")).await.unwrap();
    assert_eq!(busy.status(), 409);
    assert!(busy.headers().contains_key("retry-after"));
    assert_eq!(problem_type(busy).await, "request-in-flight");
    // The handler ran to completion and its result was stored.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let done = svc.oneshot(refund(Some("k"), "49")).await.unwrap();
    assert_eq!(done.status(), 201);
    assert_eq!(done.headers()["idempotent-replayed"], "true");
    assert!(text(done).await.contains(r#""refund_id":"R1""#));
    assert_eq!(slow.runs(), 1, "one refund");
}

#[tokio::test]
async fn a_handler_that_ends_without_a_response_leaves_an_unknown_outcome_not_a_free_key() {
    let crash = Handler::new(Mode::Panic);
    let layer = ReplayLayer::new(MemoryStore::default()).single_tenant();
    let first = layer
        .layer(crash.service())
        .oneshot(refund(Some("k"), "49"))
        .await
        .unwrap();
    assert_eq!(first.status(), 409);
    assert_eq!(problem_type(first).await, "outcome-unknown");
    // The record is written from the guard's drop; let it run.
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    let ok = Handler::new(Mode::Ok);
    let again = layer
        .layer(ok.service())
        .oneshot(refund(Some("k"), "49"))
        .await
        .unwrap();
    assert_eq!(again.status(), 409);
    assert_eq!(problem_type(again).await, "outcome-unknown");
    assert_eq!(ok.runs(), 0, "not a second run");
    assert_eq!(crash.runs(), 1);
}

#[tokio::test]
async fn which_outcomes_are_stored_is_a_policy() {
    let busy = Handler::new(Mode::Status(503));
    let svc = ReplayLayer::new(MemoryStore::default())
        .single_tenant()
        .layer(busy.service());
    svc.clone().oneshot(refund(Some("k"), "49")).await.unwrap();
    svc.oneshot(refund(Some("k"), "49")).await.unwrap();
    assert_eq!(
        busy.runs(),
        2,
        "a 503 said the request did not run: not stored"
    );

    let broken = Handler::new(Mode::Status(500));
    let svc = ReplayLayer::new(MemoryStore::default())
        .single_tenant()
        .layer(broken.service());
    svc.clone().oneshot(refund(Some("k"), "49")).await.unwrap();
    let again = svc.oneshot(refund(Some("k"), "49")).await.unwrap();
    assert_eq!(again.status(), 500);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(
        broken.runs(),
        1,
        "a 500 after the handler ran is replayed, as Stripe does"
    );

    let only_2xx = ReplayLayer::new(MemoryStore::default())
        .single_tenant()
        .store_status(|s| s.is_success());
    let svc = only_2xx.layer(broken.service());
    svc.clone().oneshot(refund(Some("k2"), "49")).await.unwrap();
    svc.oneshot(refund(Some("k2"), "49")).await.unwrap();
    assert_eq!(broken.runs(), 3);
}

#[tokio::test]
async fn a_business_identity_deduplicates_a_model_re_call_with_other_arguments() {
    let h = Handler::new(Mode::Ok);
    let svc = ReplayLayer::new(MemoryStore::default())
        .single_tenant()
        .business_key(|_parts, body| {
            let v: serde_json::Value = serde_json::from_slice(body).ok()?;
            Some(format!("label-for-order-{}", v["order_id"].as_str()?))
        })
        .layer(h.service());
    let first = svc
        .clone()
        .oneshot(refund(
            Some("call-1"),
            r#"{"order_id":"4812","service":"ground"}"#,
        ))
        .await
        .unwrap();
    let first = text(first).await;
    // The model calls again, new call id, slightly different arguments.
    let again = svc
        .oneshot(refund(
            Some("call-2"),
            r#"{"order_id":"4812","service":"Ground"}"#,
        ))
        .await
        .unwrap();
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(text(again).await, first);
    assert_eq!(h.runs(), 1);
}

/// A store that is down.
#[derive(Debug)]
struct Down;

impl ReplayStore for Down {
    fn claim<'a>(&'a self, _: &'a str, _: Fingerprint, _: Duration) -> StoreFuture<'a, Claim> {
        Box::pin(async { Err(StoreError::new("connection refused")) })
    }
    fn renew<'a>(&'a self, _: &'a str, _: u64, _: Duration) -> StoreFuture<'a, bool> {
        Box::pin(async { Err(StoreError::new("connection refused")) })
    }
    fn complete<'a>(
        &'a self,
        _: &'a str,
        _: u64,
        _: &'a StoredResponse,
        _: Duration,
    ) -> StoreFuture<'a, bool> {
        Box::pin(async { Err(StoreError::new("connection refused")) })
    }
    fn release<'a>(&'a self, _: &'a str, _: u64) -> StoreFuture<'a, bool> {
        Box::pin(async { Err(StoreError::new("connection refused")) })
    }
}

#[tokio::test]
async fn an_unreachable_store_fails_closed_unless_told_otherwise() {
    let h = Handler::new(Mode::Ok);
    let res = ReplayLayer::new(Down)
        .single_tenant()
        .layer(h.service())
        .oneshot(refund(Some("k"), "49"))
        .await
        .unwrap();
    assert_eq!(res.status(), 503);
    assert_eq!(res.headers()["retry-after"], "1");
    assert_eq!(problem_type(res).await, "replay-store-unavailable");
    assert_eq!(h.runs(), 0, "no handler runs without deduplication");
    let res = ReplayLayer::new(Down)
        .single_tenant()
        .fail_open(true)
        .layer(h.service())
        .oneshot(refund(Some("k"), "49"))
        .await
        .unwrap();
    assert_eq!(res.status(), 201);
    assert_eq!(h.runs(), 1);
}

mod hostile_headers {
    use super::*;
    use proptest::prelude::*;

    fn run(values: Vec<Vec<u8>>) -> (u16, Option<serde_json::Value>, u32) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let h = Handler::new(Mode::Ok);
            let svc = ReplayLayer::new(MemoryStore::default())
                .single_tenant()
                .layer(h.service());
            let mut req = refund(None, "49");
            for v in &values {
                if let Ok(v) = http::HeaderValue::from_bytes(v) {
                    req.headers_mut().append("idempotency-key", v);
                }
            }
            let res = svc.oneshot(req).await.unwrap();
            let status = res.status().as_u16();
            let problem = (res
                .headers()
                .get("content-type")
                .is_some_and(|c| c == "application/problem+json"))
            .then_some(());
            let body = text(res).await;
            let json = problem
                .map(|()| serde_json::from_str(&body).expect("problem bodies are valid JSON"));
            (status, json, h.runs())
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]

        /// Whatever arrives in the key header (control bytes, quotes, overlong values, several
        /// lines), the layer never panics; it either runs the handler once for a valid key or
        /// answers a well-formed problem without running it.
        #[test]
        fn any_key_header_gets_a_clear_answer(values in proptest::collection::vec(
            prop_oneof![
                proptest::collection::vec(any::<u8>(), 0..300),
                "[ -~]{0,300}".prop_map(String::into_bytes),
                "\"?[!-~]{1,40}\"?".prop_map(String::into_bytes),
            ],
            0..3,
        )) {
            let (status, problem, runs) = run(values);
            match status {
                201 => prop_assert_eq!(runs, 1),
                400 => {
                    prop_assert_eq!(runs, 0);
                    let p = problem.expect("a 400 is a problem response");
                    prop_assert_eq!(p["status"].as_u64(), Some(400));
                    prop_assert!(p["type"].as_str().is_some_and(|t| t.starts_with("urn:backstop:problem:")));
                    prop_assert!(p["detail"].as_str().is_some_and(|d| !d.is_empty()));
                }
                other => prop_assert!(false, "unexpected status {}", other),
            }
        }
    }
}

#[cfg(feature = "redis")]
mod redis {
    use super::*;
    use backstop_replay::{OnVolatile, Persistence, RedisStore};
    use backstop_testkit::RedisServer;

    /// A Redis that does not answer: the store's error says which store failed, and keeps
    /// the Redis client's own error as its source.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_unreachable_redis_is_a_store_error_with_the_clients_error_as_its_source() {
        let refused = backstop_testkit::refused_addr().await;
        let err = RedisStore::connect(&format!("redis://{refused}/"), OnVolatile::Warn)
            .await
            .unwrap_err();
        assert_eq!(err.to_string(), "the Redis store failed");
        let source = std::error::Error::source(&err).expect("the client's error");
        assert!(source.is::<::redis::RedisError>(), "{source:?}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_redis_that_forgets_is_found_at_start_and_refused_when_asked() {
        let mut volatile = RedisServer::start().await;
        let store = RedisStore::open(&volatile.url()).unwrap();
        assert_eq!(store.persistence().await.unwrap(), Persistence::None);
        let refused = RedisStore::connect(&volatile.url(), OnVolatile::Refuse)
            .await
            .unwrap_err();
        assert!(
            refused.to_string().contains("keeps nothing on disk"),
            "{refused}"
        );
        let warned = RedisStore::connect(&volatile.url(), OnVolatile::Warn).await;
        assert!(warned.is_ok());
        // Why it matters: restarted empty, it forgets a completed key, and the repeat runs.
        let h = Handler::new(Mode::Ok);
        let svc = ReplayLayer::new(store).single_tenant().layer(h.service());
        svc.clone().oneshot(refund(Some("k"), "49")).await.unwrap();
        volatile.restart().await;
        let again = answered(&svc, "k").await;
        assert_eq!(again.status(), 201);
        assert_eq!(
            h.runs(),
            2,
            "a Redis without persistence lets a repeat run again"
        );

        // With an append-only file, the same restart keeps the key.
        let mut durable = RedisServer::start_persistent().await;
        let store = RedisStore::connect(&durable.url(), OnVolatile::Refuse)
            .await
            .unwrap();
        assert_eq!(store.persistence().await.unwrap(), Persistence::Aof);
        let h = Handler::new(Mode::Ok);
        let svc = ReplayLayer::new(store).single_tenant().layer(h.service());
        svc.clone().oneshot(refund(Some("k"), "49")).await.unwrap();
        durable.restart().await;
        let again = answered(&svc, "k").await;
        assert_eq!(again.headers()["idempotent-replayed"], "true");
        assert_eq!(h.runs(), 1);
    }

    /// The handler's own database, on Redis: a refund is written only with a fencing token at
    /// least as large as the largest this order has seen (the check and the write one script).
    const FENCED_REFUND: &str = r"
local seen = tonumber(redis.call('GET', KEYS[1]) or '0')
if tonumber(ARGV[1]) < seen then return 0 end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('RPUSH', KEYS[2], ARGV[2])
return 1
";

    /// A refund handler that books into its own database with its claim's fencing token; with
    /// `stall`, its thread stops after the claim and before the booking (a GC pause, a suspended
    /// VM: no renewal runs either) until told to go on.
    fn fenced_refunds(
        url: String,
        who: &'static str,
        stall: Option<(std::sync::mpsc::Sender<u64>, std::sync::mpsc::Receiver<()>)>,
    ) -> impl Service<
        Request<ReplayRequestBody>,
        Response = Response<Full<Bytes>>,
        Error = Infallible,
        Future: Send,
    > + Clone
    + Send
    + use<> {
        let stall = Arc::new(std::sync::Mutex::new(stall));
        service_fn(move |req: Request<ReplayRequestBody>| {
            let (url, stall) = (url.clone(), stall.clone());
            async move {
                let token = req.extensions().get::<Lease>().unwrap().token();
                if let Some((claimed, go)) = stall.lock().unwrap().take() {
                    claimed.send(token).unwrap();
                    tokio::task::block_in_place(|| go.recv().unwrap());
                }
                let mut conn = ::redis::Client::open(url)
                    .unwrap()
                    .get_multiplexed_async_connection()
                    .await
                    .unwrap();
                let booked: i64 = ::redis::Script::new(FENCED_REFUND)
                    .key("refunds:fence:A-7")
                    .key("refunds:booked")
                    .arg(token.to_string())
                    .arg(who)
                    .invoke_async(&mut conn)
                    .await
                    .unwrap();
                let (status, body) = if booked == 1 {
                    (201, format!("refund by {who}"))
                } else {
                    (409, format!("{who} was fenced out"))
                };
                Ok(Response::builder()
                    .status(status)
                    .body(Full::from(body))
                    .unwrap())
            }
        })
    }

    /// The outage past the lease, on Redis: the first owner's thread stalls after its claim,
    /// past its lease; a repeat claims the expired key with a larger token and books the
    /// refund; the stale owner wakes and its booking is refused by its own database's fence,
    /// its result by the store. One refund, by the owner holding the claim, and the repeat's
    /// result is the one replayed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stale_owner_past_its_lease_is_fenced_out_of_its_own_database() {
        let redis = RedisServer::start().await;
        let lease = Duration::from_millis(300);
        let layer = || {
            ReplayLayer::new(RedisStore::open(&redis.url()).unwrap())
                .single_tenant()
                .lease(lease)
                .unwrap()
        };
        // Sends a refund through a handler that stalls after its claim; returns the call, the
        // claim's token once the handler holds it, and the handle that lets the handler go on.
        let (layer, url) = (&layer, redis.url());
        let start = |who: &'static str| {
            let url = url.clone();
            async move {
                let (claimed_tx, claimed) = std::sync::mpsc::channel();
                let (go, go_rx) = std::sync::mpsc::channel();
                let svc = layer().layer(fenced_refunds(url, who, Some((claimed_tx, go_rx))));
                let call = tokio::spawn(svc.oneshot(refund(Some("k-fence"), "A-7")));
                let token = tokio::task::spawn_blocking(move || claimed.recv().unwrap())
                    .await
                    .unwrap();
                (call, token, go)
            }
        };
        let (first, stale_token, go) = start("the stale owner").await;
        // Past the lease (a lower bound: a slower machine only makes it longer).
        tokio::time::sleep(lease * 2).await;
        let (repeat, owner_token, owner_go) = start("the new owner").await;
        assert!(
            owner_token > stale_token,
            "{owner_token} after {stale_token}"
        );
        owner_go.send(()).unwrap();
        let repeat = repeat.await.unwrap().unwrap();
        assert_eq!(repeat.status(), 201);
        // The stale owner wakes after the new owner booked.
        go.send(()).unwrap();
        let stale = first.await.unwrap().unwrap();
        assert_eq!(stale.status(), 409, "{}", text(stale).await);
        let mut conn = ::redis::Client::open(redis.url())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        let booked: Vec<String> = ::redis::cmd("LRANGE")
            .arg("refunds:booked")
            .arg(0)
            .arg(-1)
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(
            booked,
            ["the new owner"],
            "one refund, by the claim's holder"
        );
        let again = layer()
            .layer(Handler::new(Mode::Ok).service())
            .oneshot(refund(Some("k-fence"), "A-7"))
            .await
            .unwrap();
        assert_eq!(again.headers()["idempotent-replayed"], "true");
        assert_eq!(text(again).await, "refund by the new owner");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn two_server_instances_sharing_one_redis_run_the_handler_once() {
        let redis = RedisServer::start().await;
        let h = Handler::new(Mode::Sleep(Duration::from_millis(100)));
        // Two replicas: separate layers, separate connections, one Redis.
        let a = ReplayLayer::new(RedisStore::open(&redis.url()).unwrap())
            .single_tenant()
            .layer(h.service());
        let b = ReplayLayer::new(RedisStore::open(&redis.url()).unwrap())
            .single_tenant()
            .layer(h.service());
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..40 {
            let svc = if i % 2 == 0 { a.clone() } else { b.clone() };
            tasks.spawn(async move {
                svc.oneshot(refund(Some("shared-key"), "49"))
                    .await
                    .unwrap()
                    .status()
                    .as_u16()
            });
        }
        let mut statuses = Vec::new();
        while let Some(s) = tasks.join_next().await {
            statuses.push(s.unwrap());
        }
        assert_eq!(h.runs(), 1);
        assert!(
            statuses.iter().all(|s| *s == 201 || *s == 409),
            "{statuses:?}"
        );
        // After completion, both replicas replay the same result.
        let ra = a.oneshot(refund(Some("shared-key"), "49")).await.unwrap();
        let rb = b.oneshot(refund(Some("shared-key"), "49")).await.unwrap();
        assert_eq!(ra.headers()["idempotent-replayed"], "true");
        assert_eq!(text(ra).await, text(rb).await);
        assert_eq!(h.runs(), 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn while_redis_is_down_requests_fail_closed_and_it_recovers() {
        let mut redis = RedisServer::start().await;
        let h = Handler::new(Mode::Ok);
        let svc = ReplayLayer::new(RedisStore::open(&redis.url()).unwrap())
            .single_tenant()
            .layer(h.service());
        assert_eq!(
            svc.clone()
                .oneshot(refund(Some("k1"), "49"))
                .await
                .unwrap()
                .status(),
            201
        );
        redis.stop();
        let res = svc.clone().oneshot(refund(Some("k2"), "49")).await.unwrap();
        assert_eq!(res.status(), 503);
        assert_eq!(h.runs(), 1, "no handler ran unprotected");
        redis.restart().await;
        // Up to 30 s for the client to reconnect: a bound only so that a store that never comes
        // back fails; how soon it reconnects on a loaded machine is not what this checks.
        let mut recovered = false;
        for _ in 0..300 {
            let res = svc.clone().oneshot(refund(Some("k2"), "49")).await.unwrap();
            if res.status() == 201 {
                recovered = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(recovered, "the store reconnects once Redis is back");
        assert_eq!(h.runs(), 2);
    }
}

/// A replay layer over the test's handler, as the Redis tests call it.
#[cfg(feature = "redis")]
trait ReplaySvc:
    Service<
        Request<Full<Bytes>>,
        Response = Response<backstop_replay::ReplayResponseBody>,
        Error = Infallible,
    > + Clone
{
}

#[cfg(feature = "redis")]
impl<S> ReplaySvc for S where
    S: Service<
            Request<Full<Bytes>>,
            Response = Response<backstop_replay::ReplayResponseBody>,
            Error = Infallible,
        > + Clone
{
}

/// The first answer to a repeat of `key` that is not the 503 of a store still coming back (a
/// node restarting, a replica being promoted). Bounded at 30 s only so that a store that never
/// comes back fails the test: the client's reconnection backoff on a loaded machine has taken
/// more than 5 s, and how long it takes is not what these tests check.
#[cfg(feature = "redis")]
async fn answered(
    svc: &impl ReplaySvc,
    key: &str,
) -> Response<backstop_replay::ReplayResponseBody> {
    for _ in 0..600 {
        let res = svc.clone().oneshot(refund(Some(key), "49")).await.unwrap();
        if res.status() != 503 {
            return res;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{key}: still 503 after 30 seconds");
}

/// Sends keys `<prefix>-0` .. `<prefix>-<n-1>` once each; every one runs (201).
#[cfg(feature = "redis")]
async fn run_each(svc: &impl ReplaySvc, prefix: &str, n: usize) {
    for k in 0..n {
        let key = format!("{prefix}-{k}");
        let res = svc.clone().oneshot(refund(Some(&key), "49")).await.unwrap();
        assert_eq!(res.status(), 201, "{key}");
    }
}

/// The replay layer on a real three-node Redis Cluster (persistent nodes, no replicas, started
/// by the test on loopback).
#[cfg(feature = "redis")]
mod redis_cluster {
    use super::*;
    use backstop_replay::{OnVolatile, RedisStore};
    use backstop_testkit::RedisCluster;

    fn instance(
        cluster: &RedisCluster,
        h: &Handler,
    ) -> impl Service<
        Request<Full<Bytes>>,
        Response = Response<backstop_replay::ReplayResponseBody>,
        Error = Infallible,
        Future: Send,
    > + Clone
    + Send
    + 'static {
        ReplayLayer::new(RedisStore::cluster(&cluster.urls()).unwrap())
            .single_tenant()
            .layer(h.service())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn the_same_key_from_two_instances_runs_once_on_every_node() {
        let cluster = RedisCluster::start(3).await;
        // Its nodes persist: the checked constructor accepts them.
        RedisStore::connect_cluster(&cluster.urls(), OnVolatile::Refuse)
            .await
            .unwrap();
        let h = Handler::new(Mode::Sleep(Duration::from_millis(50)));
        let (a, b) = (instance(&cluster, &h), instance(&cluster, &h));
        let mut tasks = tokio::task::JoinSet::new();
        for k in 0..30 {
            for svc in [a.clone(), b.clone(), a.clone(), b.clone()] {
                tasks.spawn(async move {
                    let key = format!("refund-{k}");
                    svc.oneshot(refund(Some(&key), "49"))
                        .await
                        .unwrap()
                        .status()
                        .as_u16()
                });
            }
        }
        while let Some(status) = tasks.join_next().await {
            let status = status.unwrap();
            assert!(status == 201 || status == 409, "{status}");
        }
        assert_eq!(
            h.runs(),
            30,
            "each key ran once, whichever instance it reached"
        );
        // Both instances replay every key, and the keys are spread over all three nodes.
        for k in 0..30 {
            let key = format!("refund-{k}");
            for svc in [a.clone(), b.clone()] {
                let res = svc.oneshot(refund(Some(&key), "49")).await.unwrap();
                assert_eq!(res.headers()["idempotent-replayed"], "true");
            }
        }
        assert_eq!(h.runs(), 30);
        for node in 0..3 {
            assert!(cluster.keys_on(node) > 0, "node {node} holds no key");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_node_killed_fails_its_keys_closed_and_loses_nothing_it_stored() {
        let mut cluster = RedisCluster::start(3).await;
        let h = Handler::new(Mode::Ok);
        let svc = instance(&cluster, &h);
        run_each(&svc, "done", 30).await;
        cluster.kill(1);
        // Keys on the dead node are refused (503, nothing run); the others go on.
        let (mut refused, mut ran) = (Vec::new(), 0);
        for k in 0..30 {
            let key = format!("new-{k}");
            let res = svc.clone().oneshot(refund(Some(&key), "49")).await.unwrap();
            match res.status().as_u16() {
                503 => refused.push(key),
                201 => ran += 1,
                other => panic!("{key}: {other}"),
            }
        }
        assert!(
            !refused.is_empty() && ran > 0,
            "{} refused, {ran} ran",
            refused.len()
        );
        assert_eq!(h.runs(), 30 + ran, "no handler ran unprotected");
        let mut stored_refused = 0;
        for k in 0..30 {
            let res = svc
                .clone()
                .oneshot(refund(Some(&format!("done-{k}")), "49"))
                .await
                .unwrap();
            match res.status().as_u16() {
                503 => stored_refused += 1,
                200 | 201 => assert_eq!(res.headers()["idempotent-replayed"], "true"),
                other => panic!("done-{k}: {other}"),
            }
        }
        assert!(stored_refused > 0, "some stored keys live on the dead node");
        assert_eq!(h.runs(), 30 + ran, "a stored result never runs again");
        // The node comes back with its append-only file: what it stored is replayed, what it
        // refused runs now, once.
        cluster.restart(1).await;
        for k in 0..30 {
            let res = answered(&svc, &format!("done-{k}")).await;
            assert_eq!(res.headers()["idempotent-replayed"], "true", "done-{k}");
        }
        for key in &refused {
            assert_eq!(answered(&svc, key).await.status(), 201, "{key}");
        }
        assert_eq!(h.runs(), 60, "every key ran exactly once");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_node_killed_mid_request_refuses_repeats_and_loses_the_records_it_held() {
        let mut cluster = RedisCluster::start(3).await;
        let h = Handler::new(Mode::Sleep(Duration::from_millis(300)));
        let svc = ReplayLayer::new(RedisStore::cluster(&cluster.urls()).unwrap())
            .single_tenant()
            .lease(Duration::from_secs(1))
            .unwrap()
            .layer(h.service());
        // Thirty requests claimed, their handlers running, when a node dies.
        let mut tasks = tokio::task::JoinSet::new();
        for k in 0..30 {
            let svc = svc.clone();
            tasks.spawn(async move {
                let res = svc
                    .oneshot(refund(Some(&format!("mid-{k}")), "49"))
                    .await
                    .unwrap();
                res.status().as_u16()
            });
        }
        // Every handler is running before the node dies: waited for, not slept on.
        tokio::time::timeout(Duration::from_secs(30), async {
            while h.runs() < 30 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("30 handlers running");
        assert_eq!(h.runs(), 30);
        cluster.kill(1);
        // Every caller gets the answer of the handler that ran for it.
        while let Some(status) = tasks.join_next().await {
            assert_eq!(status.unwrap(), 201);
        }
        // A repeat while the node is down: replayed where the record was stored, refused (503)
        // where it was not; nothing runs again.
        let mut refused = Vec::new();
        for k in 0..30 {
            let key = format!("mid-{k}");
            let res = svc.clone().oneshot(refund(Some(&key), "49")).await.unwrap();
            match res.status().as_u16() {
                503 => refused.push(key),
                201 => assert_eq!(res.headers()["idempotent-replayed"], "true", "{key}"),
                other => panic!("{key}: {other}"),
            }
        }
        assert!(!refused.is_empty(), "some keys lived on the dead node");
        assert_eq!(h.runs(), 30, "a repeat never ran while its node was down");
        // What the node lost: the records of requests it held mid-flight (their results were
        // never stored). Back with its append-only file, it still has no result for them, so a
        // repeat runs again, once: the window between effect and record that only the
        // transactional PostgreSQL store closes.
        cluster.restart(1).await;
        for key in &refused {
            // (409 while a restored in-flight record's lease has not yet run out: a 1 s lease,
            // polled for up to 10 s.)
            let mut first = answered(&svc, key).await;
            for _ in 0..200 {
                if first.status() != 409 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
                first = answered(&svc, key).await;
            }
            assert_eq!(first.status(), 201, "{key}");
            let again = answered(&svc, key).await;
            assert_eq!(again.headers()["idempotent-replayed"], "true", "{key}");
        }
        assert_eq!(h.runs(), 30 + refused.len() as u32);
    }
}

/// The replay layer behind Redis Sentinel: a primary, its replica and three Sentinels started by
/// the test on loopback; the primary killed, the replica promoted.
#[cfg(feature = "redis")]
mod redis_sentinel {
    use super::*;
    use backstop_replay::RedisStore;
    use backstop_testkit::RedisSentinel;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn after_a_failover_the_store_follows_the_promoted_replica_and_replays() {
        let mut topology = RedisSentinel::start().await;
        let store =
            RedisStore::sentinel(&topology.sentinel_urls(), topology.primary_name()).unwrap();
        let h = Handler::new(Mode::Ok);
        let svc = ReplayLayer::new(store).single_tenant().layer(h.service());
        run_each(&svc, "before", 10).await;
        // What the replica has acknowledged survives the failover (what it had not could be
        // lost: replication is asynchronous).
        topology.replicated();
        let killed = tokio::time::Instant::now();
        topology.kill_primary();
        // With no primary, a new key is refused, and nothing runs.
        let res = svc
            .clone()
            .oneshot(refund(Some("during"), "49"))
            .await
            .unwrap();
        assert_eq!(res.status(), 503);
        assert_eq!(h.runs(), 10, "no handler ran unprotected");
        topology.promoted().await;
        let promoted = killed.elapsed();
        // The store asks Sentinel again and finds the promoted replica: every stored key is
        // replayed from it, and new keys run once.
        for k in 0..10 {
            let key = format!("before-{k}");
            let res = answered(&svc, &key).await;
            assert_eq!(res.headers()["idempotent-replayed"], "true", "{key}");
            if k == 0 {
                eprintln!(
                    "primary killed: replica promoted after {promoted:?}, the store answering \
                     again after {:?}",
                    killed.elapsed()
                );
            }
        }
        assert_eq!(answered(&svc, "during").await.status(), 201);
        assert_eq!(
            answered(&svc, "during").await.headers()["idempotent-replayed"],
            "true"
        );
        assert_eq!(h.runs(), 11, "every key ran exactly once");
    }
}

/// A memory store whose `complete` fails the first `fail_completes` times and whose `renew`
/// answers as told: a store that fails for a moment, or that lost the claim.
#[derive(Debug)]
struct Flaky {
    inner: MemoryStore,
    fail_completes: AtomicU32,
    /// 0: renew as usual; 1: the claim was taken over (`Ok(false)`); 2: unreachable.
    renew_mode: AtomicU32,
}

impl Flaky {
    fn new(fail_completes: u32, renew_mode: u32) -> Self {
        Flaky {
            inner: MemoryStore::default(),
            fail_completes: AtomicU32::new(fail_completes),
            renew_mode: AtomicU32::new(renew_mode),
        }
    }
}

impl ReplayStore for Flaky {
    fn claim<'a>(&'a self, k: &'a str, f: Fingerprint, l: Duration) -> StoreFuture<'a, Claim> {
        self.inner.claim(k, f, l)
    }
    fn renew<'a>(&'a self, k: &'a str, t: u64, l: Duration) -> StoreFuture<'a, bool> {
        match self.renew_mode.load(Ordering::SeqCst) {
            1 => Box::pin(async { Ok(false) }),
            2 => Box::pin(async { Err(StoreError::new("connection reset")) }),
            _ => self.inner.renew(k, t, l),
        }
    }
    fn complete<'a>(
        &'a self,
        k: &'a str,
        t: u64,
        r: &'a StoredResponse,
        ttl: Duration,
    ) -> StoreFuture<'a, bool> {
        let failing = self
            .fail_completes
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if failing {
            return Box::pin(async { Err(StoreError::new("connection reset")) });
        }
        self.inner.complete(k, t, r, ttl)
    }
    fn release<'a>(&'a self, k: &'a str, t: u64) -> StoreFuture<'a, bool> {
        self.inner.release(k, t)
    }
}

#[tokio::test(start_paused = true)]
async fn a_result_is_stored_once_the_store_recovers_and_repeats_wait_meanwhile() {
    let store = Arc::new(Flaky::new(5, 0));
    let h = Handler::new(Mode::Ok);
    let svc = ReplayLayer::with_store(store.clone())
        .single_tenant()
        .layer(h.service());
    let first = tokio::spawn(svc.clone().oneshot(refund(Some("k"), "49")));
    tokio::task::yield_now().await;
    // The first complete failed: the claim is still held, and a repeat waits for it.
    let busy = svc.clone().oneshot(refund(Some("k"), "49")).await.unwrap();
    assert_eq!(
        busy.status(),
        409,
        "not a second run while the result is being stored"
    );
    assert_eq!(first.await.unwrap().unwrap().status(), 201);
    assert_eq!(
        store.fail_completes.load(Ordering::SeqCst),
        0,
        "it kept trying"
    );
    let again = svc.oneshot(refund(Some("k"), "49")).await.unwrap();
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(h.runs(), 1);
}

/// A handler that works for 20 s unless it learns that its lease was lost.
fn watchful(
    lost: Arc<AtomicU32>,
) -> impl Service<
    Request<ReplayRequestBody>,
    Response = Response<Full<Bytes>>,
    Error = Infallible,
    Future: Send,
> + Clone
+ Send
+ 'static {
    service_fn(move |req: Request<ReplayRequestBody>| {
        let lost = lost.clone();
        async move {
            let mut lease = req.extensions().get::<Lease>().cloned().expect("a lease");
            assert!(lease.is_held());
            assert!(lease.token() > 0);
            tokio::select! {
                () = lease.lost() => {
                    assert!(!lease.is_held());
                    lost.fetch_add(1, Ordering::SeqCst);
                    Ok(Response::builder().status(503).body(Full::default()).unwrap())
                }
                () = tokio::time::sleep(Duration::from_secs(20)) => {
                    Ok(Response::new(Full::from("committed")))
                }
            }
        }
    })
}

#[tokio::test(start_paused = true)]
async fn a_handler_learns_that_its_lease_was_lost() {
    for (mode, within) in [(1, Duration::from_secs(2)), (2, Duration::from_secs(5))] {
        let lost = Arc::new(AtomicU32::new(0));
        let start = tokio::time::Instant::now();
        let res = ReplayLayer::with_store(Arc::new(Flaky::new(0, mode)))
            .single_tenant()
            .lease(Duration::from_secs(3))
            .unwrap()
            .layer(watchful(lost.clone()))
            .oneshot(refund(Some("k"), "49"))
            .await
            .unwrap();
        assert_eq!(res.status(), 503, "mode {mode}");
        assert_eq!(lost.load(Ordering::SeqCst), 1);
        // Taken over: told at the first renewal (1 s); unreachable: once a whole lease (3 s)
        // passed without a renewal.
        assert!(
            start.elapsed() <= within,
            "mode {mode}: {:?}",
            start.elapsed()
        );
    }
    // A lease that is renewed is never reported lost.
    let lost = Arc::new(AtomicU32::new(0));
    let res = ReplayLayer::with_store(Arc::new(Flaky::new(0, 0)))
        .single_tenant()
        .lease(Duration::from_secs(3))
        .unwrap()
        .layer(watchful(lost.clone()))
        .oneshot(refund(Some("k"), "49"))
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(lost.load(Ordering::SeqCst), 0);
}

/// A body whose sender has stalled: headers arrived, the rest never does.
struct Stalled;

impl http_body::Body for Stalled {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Infallible>>> {
        std::task::Poll::Pending
    }
}

/// The handler's capacity (a concurrency limit's permit) is taken only when the handler's turn
/// comes: a request still uploading, or waiting for its claim, holds none of it.
#[tokio::test]
async fn a_request_still_uploading_leaves_the_handler_free() {
    use std::{future::Future, task::Context};
    let h = Handler::new(Mode::Ok);
    let svc = ReplayLayer::new(MemoryStore::default())
        .single_tenant()
        .layer(tower::limit::ConcurrencyLimit::new(h.service(), 1));
    let mut cx = Context::from_waker(std::task::Waker::noop());
    let mut uploading = svc.clone();
    assert!(Service::<Request<Stalled>>::poll_ready(&mut uploading, &mut cx).is_ready());
    let slow = Request::post("/refunds")
        .header("idempotency-key", "slow")
        .body(Stalled)
        .unwrap();
    let mut slow = std::pin::pin!(uploading.call(slow));
    assert!(
        slow.as_mut().poll(&mut cx).is_pending(),
        "still reading the body"
    );
    let mut other = svc.clone();
    assert!(
        Service::<Request<Full<Bytes>>>::poll_ready(&mut other, &mut cx).is_ready(),
        "a request still uploading holds the handler's only permit"
    );
    let res = other.call(refund(Some("k-other"), "7")).await.unwrap();
    assert_eq!(res.status(), 201);
    assert_eq!(h.runs(), 1);
}

/// A handler that could not be readied was never called: its error goes back, and its key is
/// free for the retry, which runs the handler.
#[tokio::test]
async fn a_handler_that_was_never_ready_leaves_the_key_free() {
    let h = Handler::new(Mode::Ok);
    let svc = ReplayLayer::new(MemoryStore::default())
        .single_tenant()
        // Its readiness fails at the second poll: the layer's own, after the caller's.
        .layer(backstop_testkit::NotReadyAt::new(h.service(), 2));
    let first = svc.clone().oneshot(refund(Some("k-ready"), "5")).await;
    assert!(first.is_err(), "the readiness error goes back");
    assert_eq!(h.runs(), 0);
    let again = svc
        .clone()
        .oneshot(refund(Some("k-ready"), "5"))
        .await
        .unwrap();
    assert_eq!(again.status(), 201, "the key was freed, not held in flight");
    assert!(!again.headers().contains_key("idempotent-replayed"));
    assert_eq!(h.runs(), 1);
}

/// A request the layer does not guard (a `GET`) goes on as it came: on the handle polled ready,
/// keeping the permit that handle was granted, so no caller that asked later takes it first.
#[tokio::test]
async fn a_request_not_guarded_keeps_the_readiness_it_was_granted() {
    use std::{future::Future, task::Context};
    let h = Handler::new(Mode::Ok);
    let svc = ReplayLayer::new(MemoryStore::default())
        .single_tenant()
        .layer(tower::limit::ConcurrencyLimit::new(h.service(), 1));
    let mut cx = Context::from_waker(std::task::Waker::noop());
    let mut reading = svc.clone();
    assert!(Service::<Request<Full<Bytes>>>::poll_ready(&mut reading, &mut cx).is_ready());
    let get = Request::get("/refunds/R1").body(Full::default()).unwrap();
    let mut get = std::pin::pin!(reading.call(get));
    let mut later = svc.clone();
    assert!(
        Service::<Request<Full<Bytes>>>::poll_ready(&mut later, &mut cx).is_pending(),
        "the GET gave its permit away"
    );
    let res = std::future::poll_fn(|cx| get.as_mut().poll(cx))
        .await
        .unwrap();
    assert_eq!(res.status(), 201);
    assert!(Service::<Request<Full<Bytes>>>::poll_ready(&mut later, &mut cx).is_ready());
}
