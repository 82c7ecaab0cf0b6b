//! gRPC through the stack against a real tonic server on loopback (HTTP/2, the real clock, short
//! durations): UNAVAILABLE with pushback, RESOURCE_EXHAUSTED, INVALID_ARGUMENT, a deadline
//! shorter than the pushback, a negative pushback, and a streaming request body over the limit.

use backstop::{
    Backstop, Deadline, Error as BackstopError, ErrorKind, Outcome,
    retry::{RetryHistory, StopReason},
    timeout::CallerDeadlineLayer,
};
use http::HeaderMap;
use std::{
    convert::Infallible,
    future::Future,
    pin::Pin,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    task::{Context, Poll},
    time::Duration,
};
use tokio::time::Instant;
use tonic::{Code, Status, codegen::http};
use tower::{Layer, Service, ServiceExt};

#[derive(Clone, PartialEq, prost::Message)]
struct RefundRequest {
    #[prost(string, tag = "1")]
    order: String,
    #[prost(bytes = "vec", tag = "2")]
    blob: Vec<u8>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct RefundReply {
    #[prost(string, tag = "1")]
    id: String,
}

type Plan = Arc<dyn Fn(usize) -> Result<RefundReply, Status> + Send + Sync>;

/// The refunds service: `Issue` (unary) and `Upload` (client streaming); each call's answer
/// comes from the plan, by call number.
#[derive(Clone)]
struct Refunds {
    plan: Plan,
    calls: Arc<AtomicUsize>,
    headers: Arc<Mutex<Vec<HeaderMap>>>,
}

/// `Issue`, answered by the plan; or, with `hangs`, never answered (tonic's server still ends
/// it when the `grpc-timeout` runs out).
struct Issue {
    refunds: Refunds,
    hangs: bool,
}

impl Service<tonic::Request<RefundRequest>> for Issue {
    type Response = tonic::Response<RefundReply>;
    type Error = Status;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Status>> + Send>>;
    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Status>> {
        Poll::Ready(Ok(()))
    }
    fn call(&mut self, _req: tonic::Request<RefundRequest>) -> Self::Future {
        let n = self.refunds.calls.fetch_add(1, Ordering::SeqCst);
        if self.hangs {
            return Box::pin(std::future::pending());
        }
        let answer = (self.refunds.plan)(n);
        Box::pin(async move { answer.map(tonic::Response::new) })
    }
}

struct Upload(Refunds);

impl Service<tonic::Request<tonic::Streaming<RefundRequest>>> for Upload {
    type Response = tonic::Response<RefundReply>;
    type Error = Status;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Status>> + Send>>;
    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Status>> {
        Poll::Ready(Ok(()))
    }
    fn call(&mut self, req: tonic::Request<tonic::Streaming<RefundRequest>>) -> Self::Future {
        let svc = self.0.clone();
        Box::pin(async move {
            let mut stream = req.into_inner();
            let mut bytes = 0;
            while let Some(part) = stream.message().await? {
                bytes += part.blob.len();
            }
            let n = svc.calls.fetch_add(1, Ordering::SeqCst);
            (svc.plan)(n).map(|mut r| {
                r.id = format!("{}:{bytes}", r.id);
                tonic::Response::new(r)
            })
        })
    }
}

impl Service<http::Request<tonic::body::Body>> for Refunds {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;
    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }
    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        let svc = self.clone();
        Box::pin(async move {
            svc.headers.lock().unwrap().push(req.headers().clone());
            let mut grpc = tonic::server::Grpc::new(tonic_prost::ProstCodec::<
                RefundReply,
                RefundRequest,
            >::default());
            Ok(match req.uri().path() {
                "/test.Refunds/Issue" => {
                    let issue = Issue {
                        refunds: svc,
                        hangs: false,
                    };
                    grpc.unary(issue, req).await
                }
                "/test.Refunds/Upload" => grpc.client_streaming(Upload(svc), req).await,
                "/test.Refunds/Hang" => {
                    let hang = Issue {
                        refunds: svc,
                        hangs: true,
                    };
                    grpc.unary(hang, req).await
                }
                _ => Status::unimplemented("no such method").into_http(),
            })
        })
    }
}

struct Server {
    url: String,
    calls: Arc<AtomicUsize>,
    headers: Arc<Mutex<Vec<HeaderMap>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve(
    plan: impl Fn(usize) -> Result<RefundReply, Status> + Send + Sync + 'static,
) -> Server {
    serve_with(None, plan).await
}

/// A refunds server, behind `CallerDeadlineLayer::grpc` when `caller_deadline` is set.
async fn serve_with(
    caller_deadline: Option<CallerDeadlineLayer>,
    plan: impl Fn(usize) -> Result<RefundReply, Status> + Send + Sync + 'static,
) -> Server {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let svc = Refunds {
        plan: Arc::new(plan),
        calls: Arc::default(),
        headers: Arc::default(),
    };
    let (calls, headers) = (svc.calls.clone(), svc.headers.clone());
    let incoming = tonic::transport::server::TcpIncoming::from(listener);
    let task = tokio::spawn(async move {
        tonic::transport::Server::builder()
            .layer(tower::util::option_layer(caller_deadline))
            .serve_with_incoming(svc, incoming)
            .await
            .unwrap();
    });
    Server {
        url,
        calls,
        headers,
        task,
    }
}

fn reply(id: &str) -> Result<RefundReply, Status> {
    Ok(RefundReply { id: id.to_owned() })
}

fn with_pushback(mut status: Status, ms: &str) -> Status {
    status
        .metadata_mut()
        .insert("grpc-retry-pushback-ms", ms.parse().unwrap());
    status
}

type Stack = backstop::BackstopService<
    tonic::transport::Channel,
    backstop::classify::GrpcClassifier,
    backstop::retry::StreamingResend,
    backstop::idempotency::HttpKeys,
>;

/// The builder of a gRPC stack.
type GrpcBackstop = Backstop<
    backstop::classify::GrpcClassifier,
    backstop::retry::StreamingResend,
    backstop::idempotency::HttpKeys,
>;

async fn stack(
    server: &Server,
    configure: impl FnOnce(GrpcBackstop) -> GrpcBackstop,
) -> tonic::client::Grpc<Stack> {
    let channel = tonic::transport::Endpoint::from_shared(server.url.clone())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let layer = configure(
        Backstop::grpc("refunds-grpc")
            .no_breaker()
            .backoff(
                backstop::backoff::Backoff::full_jitter(
                    Duration::from_millis(5),
                    Duration::from_millis(20),
                )
                .unwrap(),
            )
            .attempt_timeout(Duration::from_secs(2))
            .deadline(Duration::from_secs(5)),
    )
    .build()
    .unwrap();
    tonic::client::Grpc::new(layer.layer(channel))
}

async fn issue(client: &mut tonic::client::Grpc<Stack>) -> Result<RefundReply, Status> {
    unary(client, "/test.Refunds/Issue").await
}

async fn unary<T>(
    client: &mut tonic::client::Grpc<T>,
    path: &'static str,
) -> Result<RefundReply, Status>
where
    T: tonic::client::GrpcService<tonic::body::Body>,
    T::Error: Into<backstop::BoxError>,
    T::ResponseBody: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    <T::ResponseBody as http_body::Body>::Error: Into<backstop::BoxError>,
{
    client
        .ready()
        .await
        .map_err(|e| Status::unknown(e.into().to_string()))?;
    let codec = tonic_prost::ProstCodec::<RefundRequest, RefundReply>::default();
    let req = tonic::Request::new(RefundRequest {
        order: "ORD-4812".into(),
        blob: Vec::new(),
    });
    client
        .unary(req, path.parse().unwrap(), codec)
        .await
        .map(tonic::Response::into_inner)
}

/// The typed Backstop error inside tonic's `Status`, when the stack produced one.
fn backstop_error(status: &Status) -> Option<&BackstopError> {
    let mut source = std::error::Error::source(status);
    while let Some(e) = source {
        if let Some(b) = e.downcast_ref::<BackstopError>() {
            return Some(b);
        }
        source = e.source();
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unavailable_with_pushback_is_retried_after_it_with_the_attempt_metadata() {
    let server = serve(|n| match n {
        0 | 1 => Err(with_pushback(Status::unavailable("draining"), "150")),
        _ => reply("R1"),
    })
    .await;
    // UNAVAILABLE is an unknown outcome: a keyed (vouched) call may repeat it.
    let mut client = stack(&server, |b| b.honours_keys()).await;
    let started = Instant::now();
    let got = issue(&mut client).await.unwrap();
    assert_eq!(got.id, "R1");
    assert!(
        started.elapsed() >= Duration::from_millis(300),
        "two pushbacks of 150 ms"
    );
    assert_eq!(server.calls.load(Ordering::SeqCst), 3);
    let headers = server.headers.lock().unwrap().clone();
    let timeout = |h: &HeaderMap| h["grpc-timeout"].to_str().unwrap().to_owned();
    assert!(
        timeout(&headers[0]).ends_with('u') || timeout(&headers[0]).ends_with('m'),
        "{}",
        timeout(&headers[0])
    );
    assert!(!headers[0].contains_key("grpc-previous-rpc-attempts"));
    assert_eq!(headers[1]["grpc-previous-rpc-attempts"], "1");
    assert_eq!(headers[2]["grpc-previous-rpc-attempts"], "2");
    let key = headers[0]["idempotency-key"].clone();
    assert!(
        headers.iter().all(|h| h["idempotency-key"] == key),
        "one key on every attempt"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unavailable_on_a_call_nobody_vouched_for_is_not_repeated() {
    let server = serve(|_| Err(Status::unavailable("draining"))).await;
    let mut client = stack(&server, |b| b).await;
    let status = issue(&mut client).await.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable);
    assert_eq!(
        server.calls.load(Ordering::SeqCst),
        1,
        "unknown outcome, unvouched key"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resource_exhausted_is_retried_and_invalid_argument_is_not() {
    let server = serve(|n| match n {
        0 => Err(Status::resource_exhausted("quota")),
        _ => reply("R2"),
    })
    .await;
    let mut client = stack(&server, |b| b).await;
    assert_eq!(issue(&mut client).await.unwrap().id, "R2");
    assert_eq!(
        server.calls.load(Ordering::SeqCst),
        2,
        "refused for quota: not sent, retried"
    );

    let server = serve(|_| Err(Status::invalid_argument("eur must be positive"))).await;
    let mut client = stack(&server, |b| b.honours_keys()).await;
    let status = issue(&mut client).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert_eq!(status.message(), "eur must be positive");
    assert_eq!(server.calls.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pushback_longer_than_the_deadline_ends_the_call_at_once() {
    let server = serve(|_| Err(with_pushback(Status::unavailable("maintenance"), "10000"))).await;
    let channel = tonic::transport::Endpoint::from_shared(server.url.clone())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let layer = Backstop::grpc("refunds-grpc")
        .no_breaker()
        .honours_keys()
        .attempt_timeout(Duration::from_secs(2))
        .deadline(Duration::from_secs(3))
        .build()
        .unwrap();
    // The stack's decision rides on its final answer (a response, which tonic turns into the
    // `Status`): read where the stack hands it over.
    let stopped = Arc::new(Mutex::new(None));
    let seen = stopped.clone();
    let watched = layer
        .layer(channel)
        .map_response(move |res: http::Response<_>| {
            *seen.lock().unwrap() = RetryHistory::of(&res).map(|h| h.stopped.clone());
            res
        });
    let status = unary(
        &mut tonic::client::Grpc::new(watched),
        "/test.Refunds/Issue",
    )
    .await
    .unwrap_err();
    assert_eq!(status.code(), Code::Unavailable);
    assert_eq!(server.calls.load(Ordering::SeqCst), 1);
    // No waiting for a retry that cannot happen: the wait the server asked for does not fit in
    // the deadline, so the call ends with the pushback's answer instead of waiting the deadline
    // out.
    let stopped = stopped.lock().unwrap().clone();
    assert!(
        matches!(
            stopped,
            Some(StopReason::DeadlineTooClose { wait, .. }) if wait == Duration::from_secs(10)
        ),
        "{stopped:?}"
    );

    // A negative pushback means "do not retry".
    let server = serve(|_| Err(with_pushback(Status::unavailable("go away"), "-1"))).await;
    let mut client = stack(&server, |b| b.honours_keys()).await;
    issue(&mut client).await.unwrap_err();
    assert_eq!(server.calls.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_connection_is_not_sent_and_the_typed_error_is_inside_the_status() {
    let refused = backstop_testkit::refused_addr().await;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{refused}"))
        .unwrap()
        .connect_lazy();
    let layer = Backstop::grpc("refunds-grpc")
        .no_breaker()
        .backoff(
            backstop::backoff::Backoff::full_jitter(
                Duration::from_millis(5),
                Duration::from_millis(20),
            )
            .unwrap(),
        )
        .build()
        .unwrap();
    let mut client = tonic::client::Grpc::new(layer.layer(channel));
    let status = issue(&mut client).await.unwrap_err();
    let err = backstop_error(&status).expect("the Backstop error is the status's source");
    assert_eq!(err.outcome(), Outcome::NotSent, "{err}");
    assert_eq!(err.attempts(), 3, "{err}");
    assert_eq!(err.kind(), ErrorKind::Failed);
}

async fn upload(
    client: &mut tonic::client::Grpc<Stack>,
    parts: usize,
) -> Result<RefundReply, Status> {
    client
        .ready()
        .await
        .map_err(|e| Status::unknown(e.to_string()))?;
    let codec = tonic_prost::ProstCodec::<RefundRequest, RefundReply>::default();
    let messages = (0..parts).map(|_| RefundRequest {
        order: "ORD-4812".into(),
        blob: vec![7; 1024],
    });
    let req = tonic::Request::new(tokio_stream::iter(messages));
    client
        .client_streaming(req, "/test.Refunds/Upload".parse().unwrap(), codec)
        .await
        .map(tonic::Response::into_inner)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_body_is_retried_within_the_limit_and_committed_past_it() {
    // Within the limit (8 parts of ~1 KiB under 64 KiB): the retry sends the whole stream again.
    let server = serve(|n| match n {
        0 => Err(Status::resource_exhausted("quota")),
        _ => reply("U"),
    })
    .await;
    let mut client = stack(&server, |b| b.honours_keys()).await;
    assert_eq!(
        upload(&mut client, 8).await.unwrap().id,
        format!("U:{}", 8 * 1024)
    );
    assert_eq!(server.calls.load(Ordering::SeqCst), 2);

    // Past the limit (8 KiB of a 4 KiB limit): sent once, not retried.
    let server = serve(|_| Err(Status::resource_exhausted("quota"))).await;
    let mut client = stack(&server, |b| b.honours_keys().body_limit(4 * 1024)).await;
    let status = upload(&mut client, 8).await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted);
    assert_eq!(
        server.calls.load(Ordering::SeqCst),
        1,
        "committed past the limit"
    );
}

/// The stack of the report: a hung server behind `connect_lazy`, 300 ms attempts in a 1 s
/// deadline, five attempts allowed.
fn hung_stack(
    server: &Server,
    configure: impl FnOnce(GrpcBackstop) -> GrpcBackstop,
) -> tonic::client::Grpc<Stack> {
    let channel = tonic::transport::Endpoint::from_shared(server.url.clone())
        .unwrap()
        .connect_lazy();
    let layer = configure(
        Backstop::grpc("refunds-grpc")
            .attempt_timeout(Duration::from_millis(300))
            .deadline(Duration::from_secs(1))
            .max_attempts(5)
            .no_budget()
            .no_breaker(),
    )
    .build()
    .unwrap();
    tonic::client::Grpc::new(layer.layer(channel))
}

/// Every attempt of `err` ended by the stack's own limits: an attempt timeout (retryable,
/// outcome unknown) or, for the last, the deadline (which may also have passed during the
/// last backoff wait, so that the last attempt was never sent).
fn every_attempt_timed_out(err: &BackstopError) {
    let history = err.history().expect("a history");
    for (i, a) in history.attempts.iter().enumerate() {
        let last = i + 1 == history.attempts.len();
        if last && !a.sent {
            assert_eq!(err.kind(), ErrorKind::DeadlineExceeded, "{history:?}");
            assert!(i > 0, "the first attempt is sent: {history:?}");
            continue;
        }
        assert!(a.sent, "attempt {} was sent: {history:?}", i + 1);
        assert_eq!(
            a.verdict.outcome(),
            Outcome::Unknown,
            "attempt {}: {history:?}",
            i + 1
        );
        if !last {
            assert!(
                matches!(a.verdict, backstop::classify::Verdict::Retryable { .. }),
                "attempt {} is an attempt timeout: {history:?}",
                i + 1
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_server_is_ended_by_the_stacks_own_limits_and_repeated_when_keyed() {
    let server = serve(|_| reply("never")).await;
    let mut client = hung_stack(&server, |b| b.honours_keys());
    let started = Instant::now();
    let status = unary(&mut client, "/test.Refunds/Hang").await.unwrap_err();
    let took = started.elapsed();
    let err = backstop_error(&status)
        .unwrap_or_else(|| panic!("the Backstop error is the status's source: {status:?}"));
    // The deadline ends the call: attempts at 0, ~300+ and ~600+ ms fit in it.
    assert_eq!(err.kind(), ErrorKind::DeadlineExceeded, "{err}");
    assert_eq!(err.outcome(), Outcome::Unknown, "{err}");
    assert!(err.attempts() >= 2, "{err}");
    every_attempt_timed_out(err);
    assert_eq!(
        server.calls.load(Ordering::SeqCst),
        err.attempts() as usize,
        "{err}"
    );
    assert!(
        status.message().contains("deadline"),
        "{}",
        status.message()
    );
    // Never before the deadline: each attempt waits its full 300 ms, and the backoff waits are
    // inside the deadline. (That the call ends at its deadline and not later is a question for
    // the paused clock, which the timeout crate's tests answer; here, load could move it.)
    assert!(took >= Duration::from_millis(600), "{took:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_call_nobody_vouched_for_times_out_once_and_says_so() {
    let server = serve(|_| reply("never")).await;
    let mut client = hung_stack(&server, |b| b);
    let status = unary(&mut client, "/test.Refunds/Hang").await.unwrap_err();
    let err = backstop_error(&status)
        .unwrap_or_else(|| panic!("the Backstop error is the status's source: {status:?}"));
    assert_eq!(err.kind(), ErrorKind::NotRetried, "{err}");
    assert_eq!(err.outcome(), Outcome::Unknown, "{err}");
    assert_eq!(err.attempts(), 1, "outcome unknown, not replay-safe: {err}");
    assert!(
        err.to_string()
            .contains("did not reply within the 300 ms attempt timeout"),
        "{err}"
    );
    every_attempt_timed_out(err);
    assert_eq!(
        err.history().unwrap().stopped,
        backstop::retry::StopReason::KeyNotVouched,
        "{err}"
    );
    assert_eq!(server.calls.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_call_cut_by_its_deadline_ends_with_the_deadline() {
    let server = serve(|_| reply("never")).await;
    // The second attempt (after at most 200 ms of backoff) has less time than its timeout: the `grpc-timeout` it sends is what
    // is left of the deadline.
    let mut client = hung_stack(&server, |b| {
        b.honours_keys().attempt_timeout(Duration::from_millis(600))
    });
    let status = unary(&mut client, "/test.Refunds/Hang").await.unwrap_err();
    let err = backstop_error(&status)
        .unwrap_or_else(|| panic!("the Backstop error is the status's source: {status:?}"));
    assert_eq!(err.kind(), ErrorKind::DeadlineExceeded, "{err}");
    assert_eq!(err.outcome(), Outcome::Unknown, "{err}");
    assert_eq!(err.attempts(), 2, "{err}");
    every_attempt_timed_out(err);
    assert_eq!(server.calls.load(Ordering::SeqCst), 2);
}

/// A client under the stack, on the paused clock, that ends each call when its `grpc-timeout`
/// runs out the way the client or server timer it starts would: `answer` is what comes back.
async fn ends_at_its_grpc_timeout(
    answer: fn() -> Result<http::Response<tonic::body::Body>, tower::BoxError>,
    honours_keys: bool,
    seed: u64,
) -> (BackstopError, usize) {
    use tower::ServiceExt;
    let calls = Arc::new(AtomicUsize::new(0));
    let seen = calls.clone();
    let client = tower::service_fn(move |req: http::Request<tonic::body::Body>| {
        seen.fetch_add(1, Ordering::SeqCst);
        let left = grpc_timeout(&req.headers()["grpc-timeout"]);
        async move {
            tokio::time::sleep(left).await;
            answer()
        }
    });
    let mut stack = Backstop::grpc("refunds-grpc")
        .rng(backstop::backoff::RngSource::seeded(seed))
        .attempt_timeout(Duration::from_millis(300))
        .deadline(Duration::from_secs(1))
        .max_attempts(5)
        .no_budget()
        .no_breaker();
    if honours_keys {
        stack = stack.honours_keys();
    }
    let svc = stack.build().unwrap().layer(client);
    let req = http::Request::post("http://refunds/test.Refunds/Issue")
        .body(tonic::body::Body::empty())
        .unwrap();
    let err = svc.oneshot(req).await.unwrap_err();
    (err, calls.load(Ordering::SeqCst))
}

/// A `grpc-timeout` value as a duration.
fn grpc_timeout(value: &http::HeaderValue) -> Duration {
    let value = value.to_str().unwrap();
    let (n, unit) = value.split_at(value.len() - 1);
    let n: u64 = n.parse().unwrap();
    match unit {
        "n" => Duration::from_nanos(n),
        "u" => Duration::from_micros(n),
        "m" => Duration::from_millis(n),
        "S" => Duration::from_secs(n),
        other => panic!("unit {other}"),
    }
}

fn trailers_only(code: Code) -> Result<http::Response<tonic::body::Body>, tower::BoxError> {
    let mut res = http::Response::new(tonic::body::Body::empty());
    res.headers_mut()
        .insert("grpc-status", (code as i32).to_string().parse().unwrap());
    Ok(res)
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn the_clients_own_timer_from_the_grpc_timeout_sent_is_the_stacks_timeout() {
    // tonic's channel ends the call with `TimeoutExpired` on the same tick as the stack's
    // timer, and is polled first.
    let timer = || Err(tonic::TimeoutExpired(()).into());
    for seed in 0..20 {
        let (err, calls) = ends_at_its_grpc_timeout(timer, true, seed).await;
        assert_eq!(err.kind(), ErrorKind::DeadlineExceeded, "{err}");
        assert!(calls >= 2 && calls == err.attempts() as usize, "{err}");
        every_attempt_timed_out(&err);
    }
    let (err, calls) = ends_at_its_grpc_timeout(timer, false, 0).await;
    assert_eq!(err.kind(), ErrorKind::NotRetried, "{err}");
    assert!(err.to_string().contains("300 ms attempt timeout"), "{err}");
    assert_eq!(calls, 1, "{err}");
    // The typed error, not tonic's: tonic's `Status::from_error` finds no `TimeoutExpired`
    // in its cause chain to make a bare CANCELLED of.
    let status = tonic::Status::from_error(Box::new(err));
    assert_eq!(status.code(), Code::Unknown);
    assert!(backstop_error(&status).is_some(), "{status:?}");
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_servers_cancelled_or_deadline_exceeded_at_the_grpc_timeout_sent_is_the_stacks_timeout() {
    for answer in [(|| trailers_only(Code::Cancelled)) as fn() -> _, || {
        trailers_only(Code::DeadlineExceeded)
    }] {
        for seed in 0..20 {
            let (err, calls) = ends_at_its_grpc_timeout(answer, true, seed).await;
            assert_eq!(err.kind(), ErrorKind::DeadlineExceeded, "{err}");
            assert!(calls >= 2 && calls == err.attempts() as usize, "{err}");
            every_attempt_timed_out(&err);
        }
        let (err, calls) = ends_at_its_grpc_timeout(answer, false, 0).await;
        assert_eq!(err.kind(), ErrorKind::NotRetried, "{err}");
        assert!(err.to_string().contains("300 ms attempt timeout"), "{err}");
        assert_eq!(err.outcome(), Outcome::Unknown, "{err}");
        assert_eq!(calls, 1, "{err}");
    }
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_cancelled_before_the_grpc_timeout_is_the_servers_own_answer() {
    use tower::ServiceExt;
    // The server cancels on its own, well inside the time sent: its answer, not a timeout.
    let client = tower::service_fn(|_req: http::Request<tonic::body::Body>| async {
        tokio::time::sleep(Duration::from_millis(10)).await;
        trailers_only(Code::Cancelled)
    });
    let svc = Backstop::grpc("refunds-grpc")
        .honours_keys()
        .attempt_timeout(Duration::from_millis(300))
        .no_breaker()
        .build()
        .unwrap()
        .layer(client);
    let req = http::Request::post("http://refunds/test.Refunds/Issue")
        .body(tonic::body::Body::empty())
        .unwrap();
    let res = svc.oneshot(req).await.unwrap();
    assert_eq!(res.headers()["grpc-status"], "1");
}

#[tokio::test(start_paused = true)]
async fn duration_max_and_no_deadline_never_panic() {
    use tower::ServiceExt;
    let client = tower::service_fn(|req: http::Request<tonic::body::Body>| async move {
        let left = req.headers().get("grpc-timeout").cloned();
        tokio::time::sleep(Duration::from_millis(5)).await;
        let mut res = http::Response::new(tonic::body::Body::empty());
        if let Some(left) = left {
            res.headers_mut().insert("x-left", left);
        }
        Ok::<_, tower::BoxError>(res)
    });
    for b in [
        Backstop::grpc("refunds-grpc")
            .no_deadline()
            .attempt_timeout(Duration::MAX),
        Backstop::grpc("refunds-grpc")
            .deadline(Duration::MAX)
            .attempt_timeout(Duration::MAX),
    ] {
        let svc = b.no_breaker().build().unwrap().layer(client);
        let req = http::Request::post("http://refunds/test.Refunds/Issue")
            .body(tonic::body::Body::empty())
            .unwrap();
        let res = svc.oneshot(req).await.unwrap();
        // "Never" is 30 years ahead: the header says so, rounded up.
        let left = grpc_timeout_long(&res.headers()["x-left"]);
        assert!(left >= Duration::from_secs(86_400 * 365 * 30), "{left:?}");
    }
}

/// A long `grpc-timeout` (minutes or hours) as a duration.
fn grpc_timeout_long(value: &http::HeaderValue) -> Duration {
    let value = value.to_str().unwrap();
    let (n, unit) = value.split_at(value.len() - 1);
    let n: u64 = n.parse().unwrap();
    match unit {
        "M" => Duration::from_secs(n * 60),
        "H" => Duration::from_secs(n * 3600),
        _ => grpc_timeout(&http::HeaderValue::from_str(value).unwrap()),
    }
}

/// A tonic server behind `CallerDeadlineLayer::grpc`: a call from a Backstop gRPC stack with a
/// 2 s deadline runs within it (what a Backstop stack called by the handler inherits), and a
/// call whose `grpc-timeout` is spent runs nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_callers_deadline_is_the_handlers() {
    let seen: Arc<Mutex<Vec<Option<Duration>>>> = Arc::default();
    let saw = seen.clone();
    let server = serve_with(
        Some(CallerDeadlineLayer::grpc(Duration::from_secs(30))),
        move |_| {
            saw.lock()
                .unwrap()
                .push(Deadline::current().map(Deadline::remaining));
            reply("R1")
        },
    )
    .await;
    let mut client = stack(&server, |b| b.deadline(Duration::from_secs(2))).await;
    issue(&mut client).await.unwrap();
    let inherited = seen.lock().unwrap()[0].expect("the handler runs within a deadline");
    assert!(
        inherited > Duration::ZERO && inherited <= Duration::from_secs(2),
        "{inherited:?}"
    );

    // A plain tonic client whose time is spent.
    let channel = tonic::transport::Endpoint::from_shared(server.url.clone())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut plain = tonic::client::Grpc::new(channel);
    plain.ready().await.unwrap();
    let mut req = tonic::Request::new(RefundRequest {
        order: "ORD-4812".into(),
        blob: Vec::new(),
    });
    req.metadata_mut()
        .insert("grpc-timeout", "0n".parse().unwrap());
    let codec = tonic_prost::ProstCodec::<RefundRequest, RefundReply>::default();
    let status = plain
        .unary(req, "/test.Refunds/Issue".parse().unwrap(), codec)
        .await
        .unwrap_err();
    // tonic's server ends a call at its `grpc-timeout` too, and may answer first (CANCELLED);
    // either way nothing ran.
    assert!(
        matches!(status.code(), Code::DeadlineExceeded | Code::Cancelled),
        "{status:?}"
    );
    assert_eq!(
        server.calls.load(Ordering::SeqCst),
        1,
        "the spent call ran nothing"
    );
}
