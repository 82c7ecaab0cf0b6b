//! The lost-reply double refund end to end over real loopback HTTP: the Backstop client stack
//! against a server guarded by the replay layer, in memory and on a shared Redis.

use backstop::{
    BoxError,
    backoff::{Backoff, RngSource},
    idempotency::{ActionContext, IdempotencyLayer},
    replay::{MemoryStore, RedisStore, ReplayLayer, ReplayRequestBody, ReplayStore},
    retry::{RetryHistory, RetryLayer},
    timeout::{AttemptTimeoutLayer, DeadlineLayer},
};
use backstop_testkit::{RedisServer, TestServer};
use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use std::{
    convert::Infallible,
    future::Future,
    io,
    pin::Pin,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU32, Ordering},
    },
    task::{Context, Poll},
    time::Duration,
};
use tower::{Layer, Service, ServiceBuilder, ServiceExt, service_fn};

type Refunds = Arc<Mutex<Vec<String>>>;

/// The payment service's refund handler: books a refund and answers with its id.
fn refund_handler(
    refunds: Refunds,
) -> impl Service<
    Request<ReplayRequestBody>,
    Response = Response<Full<Bytes>>,
    Error = Infallible,
    Future: Send,
> + Clone
+ Send
+ 'static {
    service_fn(move |req: Request<ReplayRequestBody>| {
        let refunds = refunds.clone();
        async move {
            let body = req.into_body().collect().await.unwrap().to_bytes();
            let id = {
                let mut r = refunds.lock().unwrap();
                r.push(String::from_utf8_lossy(&body).into_owned());
                format!("R{}", r.len())
            };
            Ok(Response::builder()
                .status(201)
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from(format!(
                    r#"{{"refund_id":"{id}","amount":49.0}}"#
                ))))
                .unwrap())
        }
    })
}

/// Loses the reply to the first `n` requests *after* the inner service handled them: the
/// connection is closed without a response, as when the network drops it.
#[derive(Clone)]
struct LoseReplies<S> {
    inner: S,
    remaining: Arc<AtomicU32>,
}

impl<S, R> Service<R> for LoseReplies<S>
where
    S: Service<R> + Send,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: R) -> Self::Future {
        let fut = self.inner.call(req);
        let remaining = self.remaining.clone();
        Box::pin(async move {
            let res = fut.await.map_err(Into::into)?;
            let lose = remaining
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok();
            if lose {
                return Err(io::Error::new(io::ErrorKind::ConnectionReset, "reply lost").into());
            }
            Ok(res)
        })
    }
}

fn lose_first(n: u32) -> impl Fn(ReplayOrPlain) -> LoseReplies<ReplayOrPlain> {
    let remaining = Arc::new(AtomicU32::new(n));
    move |inner| LoseReplies {
        inner,
        remaining: remaining.clone(),
    }
}

/// The server's service, boxed so the naive and the protected server share one type.
type ReplayOrPlain = tower::util::BoxCloneSyncService<
    Request<Incoming>,
    Response<backstop::replay::ReplayResponseBody>,
    Infallible,
>;

fn protected(store: Arc<dyn ReplayStore>, refunds: Refunds) -> ReplayOrPlain {
    tower::util::BoxCloneSyncService::new(
        ReplayLayer::with_store(store)
            .single_tenant()
            .layer(refund_handler(refunds)),
    )
}

/// The Backstop client stack: key -> deadline -> retry -> attempt timeout -> hyper-util.
fn client_stack()
-> impl Service<Request<Full<Bytes>>, Response = Response<Incoming>, Error = BoxError, Future: Send>
+ Clone
+ Send {
    ServiceBuilder::new()
        .layer(IdempotencyLayer::http().vouched(true))
        .layer(DeadlineLayer::new(Duration::from_secs(5)))
        .layer(
            RetryLayer::http()
                .dependency("http-replay-payments-api")
                .backoff(
                    Backoff::full_jitter(Duration::from_millis(5), Duration::from_millis(20))
                        .unwrap(),
                )
                .rng(RngSource::seeded(42)),
        )
        .layer(AttemptTimeoutLayer::new(Duration::from_secs(2)))
        .service(Client::builder(TokioExecutor::new()).build_http())
}

fn refund_request(url: String) -> Request<Full<Bytes>> {
    let args = serde_json::json!({"order_id": "A-7", "amount": 49.0});
    let mut req = Request::post(url)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(args.to_string())))
        .unwrap();
    // The agent runtime knows which action this is: the key is derived from it.
    req.extensions_mut()
        .insert(ActionContext::action_json("run-42", "issue_refund", &args).unwrap());
    req
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_naive_retry_refunds_twice() {
    let refunds = Refunds::default();
    let plain = tower::util::BoxCloneSyncService::new(
        refund_handler(refunds.clone())
            .map_response(|r: Response<Full<Bytes>>| {
                r.map(|b| b.map_err(|e| match e {}).boxed_unsync())
            })
            .map_request(|r: Request<Incoming>| {
                r.map(|b| {
                    b.map_err(|e| backstop::replay::BodyError(e.into()))
                        .boxed_unsync()
                })
            }),
    );
    let server = TestServer::serve(lose_first(1)(plain)).await;
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    for _ in 0..3 {
        if client
            .request(refund_request(server.url("/refunds")))
            .await
            .is_ok()
        {
            break;
        }
    }
    assert_eq!(
        refunds.lock().unwrap().len(),
        2,
        "the naive retry refunds twice"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backstop_with_the_replay_layer_refunds_once_and_returns_the_original_result() {
    let refunds = Refunds::default();
    let store: Arc<dyn ReplayStore> = Arc::new(MemoryStore::default());
    let server = TestServer::serve(lose_first(1)(protected(store, refunds.clone()))).await;
    let res = client_stack()
        .oneshot(refund_request(server.url("/refunds")))
        .await
        .unwrap();
    assert_eq!(res.status(), 201);
    assert_eq!(res.headers()["idempotent-replayed"], "true");
    assert_eq!(RetryHistory::of(&res).unwrap().attempts.len(), 2);
    let body = res.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, r#"{"refund_id":"R1","amount":49.0}"#);
    assert_eq!(refunds.lock().unwrap().len(), 1, "one refund, not two");

    // The model calls the tool again later in the same run with the same arguments: the
    // derived key is the same, so it is a replay too.
    let again = client_stack()
        .oneshot(refund_request(server.url("/refunds")))
        .await
        .unwrap();
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(refunds.lock().unwrap().len(), 1);
}

/// Sends attempt n to server n (mod the number of servers), as a load balancer might.
#[derive(Clone)]
struct RoundRobin<S> {
    inner: S,
    targets: Arc<Vec<String>>,
    next: Arc<AtomicU32>,
}

impl<S: Service<Request<Full<Bytes>>>> Service<Request<Full<Bytes>>> for RoundRobin<S> {
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }
    fn call(&mut self, mut req: Request<Full<Bytes>>) -> S::Future {
        let n = self.next.fetch_add(1, Ordering::SeqCst) as usize;
        let authority = &self.targets[n % self.targets.len()];
        *req.uri_mut() = format!("http://{authority}{}", req.uri().path())
            .parse()
            .unwrap();
        self.inner.call(req)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_sharing_redis_refund_once_when_the_retry_lands_on_the_other() {
    let redis = RedisServer::start().await;
    let refunds = Refunds::default();
    let store_a: Arc<dyn ReplayStore> = Arc::new(RedisStore::open(&redis.url()).unwrap());
    let store_b: Arc<dyn ReplayStore> = Arc::new(RedisStore::open(&redis.url()).unwrap());
    let a = TestServer::serve(lose_first(1)(protected(store_a, refunds.clone()))).await;
    let b = TestServer::serve(lose_first(0)(protected(store_b, refunds.clone()))).await;
    let targets = Arc::new(vec![a.addr().to_string(), b.addr().to_string()]);
    let svc = ServiceBuilder::new()
        .layer(IdempotencyLayer::http().vouched(true))
        .layer(
            RetryLayer::http()
                .dependency("http-replay-payments-api")
                .backoff(Backoff::constant(Duration::from_millis(5)))
                .rng(RngSource::seeded(1)),
        )
        .layer(AttemptTimeoutLayer::new(Duration::from_secs(2)))
        .service(RoundRobin {
            inner: Client::builder(TokioExecutor::new()).build_http(),
            targets,
            next: Arc::default(),
        });
    let res = svc
        .oneshot(refund_request("http://payments/refunds".to_owned()))
        .await
        .unwrap();
    assert_eq!(res.status(), 201);
    assert_eq!(
        res.headers()["idempotent-replayed"],
        "true",
        "replica B replayed replica A's result"
    );
    let body = res.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, r#"{"refund_id":"R1","amount":49.0}"#);
    assert_eq!(refunds.lock().unwrap().len(), 1);
}

/// A refund handler that books the refund, then awaits 1.5 s (its commit) before it answers.
fn slow_refunds(refunds: Refunds) -> ReplayOrPlain {
    let handler = service_fn(move |req: Request<ReplayRequestBody>| {
        let refunds = refunds.clone();
        async move {
            let body = req.into_body().collect().await.unwrap().to_bytes();
            let n = {
                let mut r = refunds.lock().unwrap();
                r.push(String::from_utf8_lossy(&body).into_owned());
                r.len()
            };
            tokio::time::sleep(Duration::from_millis(1_500)).await;
            Ok::<_, Infallible>(
                Response::builder()
                    .status(201)
                    .body(Full::new(Bytes::from(format!("R{n}"))))
                    .unwrap(),
            )
        }
    });
    tower::util::BoxCloneSyncService::new(
        ReplayLayer::new(MemoryStore::default())
            .single_tenant()
            .layer(handler),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_handler_whose_client_gives_up_refunds_once_over_hyper_util() {
    // The client's attempt timeout (500 ms) is shorter than the handler (1.5 s): hyper drops
    // the handler's request future when the client disconnects.
    let refunds = Refunds::default();
    let server = TestServer::serve(slow_refunds(refunds.clone())).await;
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let svc = backstop::Backstop::http("http-replay-payments-api")
        .honours_keys()
        .attempt_timeout(Duration::from_millis(500))
        .deadline(Duration::from_secs(8))
        .max_attempts(6)
        .budget(backstop::budget::Budget::default())
        .no_breaker()
        .rng(RngSource::seeded(5))
        .build()
        .unwrap()
        .layer(client);
    let mut req = Request::post(server.url("/refunds"))
        .body(Full::from(r#"{"order_id":"A-7"}"#))
        .unwrap();
    req.extensions_mut()
        .insert(ActionContext::tool_call("run-1", "step-1", "call-1"));
    let res = svc.oneshot(req).await.unwrap();
    assert_eq!(res.status(), 201);
    assert_eq!(res.headers()["idempotent-replayed"], "true");
    assert_eq!(res.into_body().collect().await.unwrap().to_bytes(), "R1");
    assert_eq!(refunds.lock().unwrap().len(), 1, "one refund");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_handler_whose_client_gives_up_refunds_once_over_reqwest() {
    let refunds = Refunds::default();
    let server = TestServer::serve(slow_refunds(refunds.clone())).await;
    let client = reqwest::Client::builder()
        .timeout(Duration::from_millis(500))
        .build()
        .unwrap();
    // A caller's own retry loop, with one key: time-outs, then 409 while the handler runs,
    // then the stored result.
    let mut statuses = Vec::new();
    let mut body = String::new();
    for _ in 0..20 {
        let res = client
            .post(server.url("/refunds"))
            .header("idempotency-key", "refund-A-7")
            .body(r#"{"order_id":"A-7"}"#)
            .send()
            .await;
        match res {
            Ok(r) if r.status() == 201 => {
                statuses.push(201);
                body = r.text().await.unwrap();
                break;
            }
            Ok(r) => statuses.push(r.status().as_u16()),
            Err(e) => {
                assert!(e.is_timeout(), "{e}");
                statuses.push(0);
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(
        statuses.first(),
        Some(&0),
        "the first attempt timed out: {statuses:?}"
    );
    assert!(
        statuses.contains(&409),
        "a repeat while it ran got 409: {statuses:?}"
    );
    assert_eq!(statuses.last(), Some(&201), "{statuses:?}");
    assert_eq!(body, "R1");
    assert_eq!(refunds.lock().unwrap().len(), 1, "one refund");
}
