//! Deadlines that cross the wire, over real HTTP on loopback: an agent's stack sends each
//! attempt's time left; a tool server reads it (`CallerDeadlineLayer`, outside its replay
//! layer), starts nothing for a caller whose time is spent, and the tool's own outbound call
//! (a Backstop stack with a 30 s deadline of its own) ends by the agent's deadline.

use backstop::{
    Backstop, BoxError, ErrorKind, Preset, TIME_LEFT_HEADER,
    idempotency::ActionContext,
    replay::{MemoryStore, ReplayLayer, ReplayRequestBody},
    timeout::CallerDeadlineLayer,
};
use backstop_testkit::{Action, Seen, TestServer};
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicU32, Ordering},
    },
    time::Duration,
};
use tower::{Layer, ServiceBuilder, ServiceExt, service_fn};

type Body = Full<Bytes>;

/// How the tool's own outbound call ended: its error's kind and the deadline it reports.
type Outbound = (Option<ErrorKind>, Option<Duration>);

/// The tool's dependency: `/hang` never answers, anything else answers at once.
async fn dependency() -> TestServer {
    TestServer::start(|s: &Seen| {
        if s.path == "/hang" {
            Action::Hang
        } else {
            Action::status(200)
        }
    })
    .await
}

/// A tool server: the caller's deadline read first, then the replay layer, then a handler
/// that calls the dependency (the path after `/tool`) through a stack of its own with a 30 s
/// deadline, and records how that call ended.
struct ToolServer {
    server: TestServer,
    runs: Arc<AtomicU32>,
    outbound: Arc<Mutex<Vec<Outbound>>>,
}

impl ToolServer {
    async fn start(dependency: &TestServer, max: Duration) -> ToolServer {
        let client = Client::builder(TokioExecutor::new()).build_http::<Body>();
        let stack = Backstop::http("deadline-wire-dependency")
            .preset(Preset::ReadOnly)
            .no_breaker()
            .deadline(Duration::from_secs(30))
            .build()
            .unwrap()
            .layer(client);
        let runs = Arc::new(AtomicU32::new(0));
        let outbound: Arc<Mutex<Vec<Outbound>>> = Arc::default();
        let base = dependency.url("");
        let (count, record) = (runs.clone(), outbound.clone());
        let handler = service_fn(move |req: Request<ReplayRequestBody>| {
            count.fetch_add(1, Ordering::SeqCst);
            let path = req.uri().path().trim_start_matches("/tool").to_owned();
            let call = stack.clone().oneshot(
                Request::get(format!("{base}{path}"))
                    .body(Body::default())
                    .unwrap(),
            );
            let record = record.clone();
            async move {
                let ended = match call.await {
                    Ok(_) => (None, None),
                    Err(e) => (Some(e.kind()), e.deadline()),
                };
                record.lock().unwrap().push(ended);
                Ok::<_, BoxError>(Response::new(Body::from("done")))
            }
        });
        let svc = ServiceBuilder::new()
            .layer(CallerDeadlineLayer::new(max))
            .layer(ReplayLayer::new(MemoryStore::default()).single_tenant())
            .service(handler);
        ToolServer {
            server: TestServer::serve(svc).await,
            runs,
            outbound,
        }
    }

    /// How the tool's outbound call ended, once the handler has finished (it runs to its end
    /// after its caller has gone).
    async fn outbound(&self) -> Outbound {
        for _ in 0..1000 {
            if let Some(ended) = self.outbound.lock().unwrap().first() {
                return *ended;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("the tool's handler never finished its outbound call");
    }
}

/// A keyed POST to the tool server, with the time left given by hand.
async fn post(url: String, key: &str, time_left: Option<&str>) -> StatusCode {
    let client = Client::builder(TokioExecutor::new()).build_http::<Body>();
    let mut req = Request::post(url).header("idempotency-key", key);
    if let Some(left) = time_left {
        req = req.header(TIME_LEFT_HEADER, left);
    }
    let res = client.request(req.body(Body::from("{}")).unwrap()).await;
    res.unwrap().status()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tools_outbound_call_ends_by_the_agents_deadline() {
    let dependency = dependency().await;
    let tool = ToolServer::start(&dependency, Duration::from_secs(60)).await;
    let agent = Backstop::http("deadline-wire-agent")
        .time_left_header(TIME_LEFT_HEADER)
        .honours_keys()
        .no_breaker()
        .deadline(Duration::from_secs(2))
        .attempt_timeout(Duration::from_secs(2))
        .build()
        .unwrap()
        .layer(Client::builder(TokioExecutor::new()).build_http::<Body>());
    let mut req = Request::post(tool.server.url("/tool/hang"))
        .body(Body::from("{}"))
        .unwrap();
    req.extensions_mut()
        .insert(ActionContext::tool_call("run-1", "step-1", "call-1"));
    // The agent's call ends at its deadline: cut there, or answered by a tool that stopped at
    // the same instant (the two timers share a millisecond).
    if let Err(err) = agent.oneshot(req).await {
        assert_eq!(err.kind(), ErrorKind::DeadlineExceeded, "{err}");
    }

    // The tool's own stack allows 30 s; the agent's deadline, carried over the wire, ended it.
    let (kind, deadline) = tool.outbound().await;
    assert_eq!(kind, Some(ErrorKind::DeadlineExceeded));
    let deadline = deadline.expect("the outbound call's deadline");
    assert!(
        deadline <= Duration::from_secs(2),
        "the outbound call had {deadline:?}, more than the agent's 2 s"
    );
    assert_eq!(tool.runs.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_whose_time_is_spent_runs_nothing_and_claims_no_key() {
    let dependency = dependency().await;
    let tool = ToolServer::start(&dependency, Duration::from_secs(60)).await;
    let url = tool.server.url("/tool/ok");
    assert_eq!(
        post(url.clone(), "spent-1", Some("0")).await,
        StatusCode::REQUEST_TIMEOUT
    );
    assert_eq!(tool.runs.load(Ordering::SeqCst), 0, "not started");
    // The key was not claimed: the same key with time to spare runs the tool, once.
    assert_eq!(
        post(url.clone(), "spent-1", Some("5000")).await,
        StatusCode::OK
    );
    assert_eq!(post(url, "spent-1", Some("5000")).await, StatusCode::OK);
    assert_eq!(tool.runs.load(Ordering::SeqCst), 1);
    assert_eq!(tool.outbound().await, (None, None));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_absurd_time_left_is_cut_to_the_servers_maximum() {
    let dependency = dependency().await;
    let tool = ToolServer::start(&dependency, Duration::from_millis(300)).await;
    let url = tool.server.url("/tool/hang");
    assert_eq!(
        post(url, "absurd-1", Some("1000000000000")).await,
        StatusCode::OK
    );
    let (kind, deadline) = tool.outbound().await;
    assert_eq!(kind, Some(ErrorKind::DeadlineExceeded));
    assert_eq!(deadline, Some(Duration::from_millis(300)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_without_a_time_left_keeps_the_servers_own_deadlines() {
    let dependency = dependency().await;
    let tool = ToolServer::start(&dependency, Duration::from_secs(60)).await;
    assert_eq!(
        post(tool.server.url("/tool/ok"), "none-1", None).await,
        StatusCode::OK
    );
    assert_eq!(tool.outbound().await, (None, None));
}

/// What the agent's stack sends: nothing by default; the time its attempt has left under
/// `backstop-time-left-ms`, or under another name, when asked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_attempt_sends_its_time_left() {
    let server = TestServer::start(|_| Action::status(200)).await;
    let client = Client::builder(TokioExecutor::new()).build_http::<Body>();
    let get = || {
        Request::get(server.url("/rates"))
            .body(Body::default())
            .unwrap()
    };
    let sent = |name: &str| -> Option<u64> {
        let seen = server.seen();
        seen.last()?.header(name)?.parse().ok()
    };

    let layer = Backstop::http("deadline-wire-sender")
        .time_left_header(TIME_LEFT_HEADER)
        .deadline(Duration::from_secs(30))
        .attempt_timeout(Duration::from_secs(2));
    layer
        .build()
        .unwrap()
        .layer(client.clone())
        .oneshot(get())
        .await
        .unwrap();
    let left = sent("backstop-time-left-ms").expect("sent when asked");
    assert!(
        left > 0 && left <= 2000,
        "the attempt's 2 s, not the deadline's 30 s: {left}"
    );

    // The caller's own deadline, tighter than the attempt's 10 s, bounds it.
    let layer = Backstop::http("deadline-wire-sender")
        .attempt_timeout(Duration::from_secs(10))
        .time_left_header(http::HeaderName::from_static(
            "x-envoy-expected-rq-timeout-ms",
        ));
    let mut req = get();
    backstop::Deadline::after(Duration::from_secs(3)).tighten(&mut req);
    layer
        .build()
        .unwrap()
        .layer(client.clone())
        .oneshot(req)
        .await
        .unwrap();
    let left = sent("x-envoy-expected-rq-timeout-ms").expect("under the name given");
    assert!(left > 0 && left <= 3000, "the caller's 3 s: {left}");
    assert_eq!(sent("backstop-time-left-ms"), None);

    let layer = Backstop::http("deadline-wire-sender");
    layer
        .build()
        .unwrap()
        .layer(client)
        .oneshot(get())
        .await
        .unwrap();
    assert_eq!(sent("backstop-time-left-ms"), None);
}

/// The handler of a server whose caller sent no time left, spawned by the replay layer into a
/// task of its own, still inherits a deadline the server put on the request itself.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn the_replay_layers_task_inherits_the_requests_deadline() {
    let handler = service_fn(|_req: Request<ReplayRequestBody>| async {
        let left = backstop::Deadline::current().map(|d| d.remaining());
        Ok::<_, BoxError>(Response::new(Body::from(format!("{left:?}"))))
    });
    let svc = CallerDeadlineLayer::new(Duration::from_secs(60)).layer(
        ReplayLayer::new(MemoryStore::default())
            .single_tenant()
            .layer(handler),
    );
    let req = Request::post("/tool")
        .header("idempotency-key", "inherit-1")
        .header(TIME_LEFT_HEADER, "1500")
        .body(Body::from("{}"))
        .unwrap();
    let res = svc.oneshot(req).await.unwrap();
    let body = http_body_util::BodyExt::collect(res.into_body())
        .await
        .unwrap()
        .to_bytes();
    assert_eq!(body, "Some(1.5s)");
}
