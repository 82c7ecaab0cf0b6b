//! The guide's sample error texts (and the README's, a part of them) are the real ones: each is
//! produced here and compared with the guide's block.

use backstop::{
    Backstop, BoxError, Error, HasExtensions, Outcome,
    breaker::{Breaker, BreakerConfig},
    budget::Budget,
    classify::{AsError, Classify, Verdict},
};
use backstop_testkit::{Action, Seen, TestServer};
use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use std::{
    task::{Context, Poll},
    time::Duration,
};
use tower::{Layer, Service, ServiceExt, service_fn};

type Body = Full<Bytes>;

/// The paragraphs of the `text` block under `heading` in `doc`, each on one line.
fn samples(doc: &str, heading: &str) -> Vec<String> {
    let start = doc.find(heading).expect("the section");
    let block = &doc[start..];
    let block = &block[block.find("```text\n").expect("the block") + 8..];
    let block = &block[..block.find("```").expect("its end")];
    block
        .split("\n\n")
        .map(|p| p.split_whitespace().collect::<Vec<_>>().join(" "))
        .filter(|p| !p.is_empty())
        .collect()
}

/// The guide's sample error texts: each test below produces one.
fn guide_samples() -> Vec<String> {
    samples(
        include_str!("../../docs/guide/01-http-clients.md"),
        "## What your code, or the model, is told",
    )
}

/// The error's text.
fn told(err: &Error) -> String {
    err.to_string()
}

fn assert_in_guide(text: &str) {
    let samples = guide_samples();
    assert!(
        samples.iter().any(|s| s == text),
        "not in the guide's samples:\n{text}\nsamples:\n{samples:#?}"
    );
}

fn client() -> Client<hyper_util::client::legacy::connect::HttpConnector, Body> {
    Client::builder(TokioExecutor::new()).build_http()
}

#[test]
fn the_guide_has_five_samples_and_the_readme_two_of_them() {
    let guide = guide_samples();
    assert_eq!(guide.len(), 5);
    let readme = samples(include_str!("../../README.md"), "## One screen");
    assert_eq!(readme.len(), 2);
    for text in readme {
        assert!(
            guide.contains(&text),
            "the README's sample is not a real one: {text}"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn an_open_circuit() {
    let breaker = Breaker::new(BreakerConfig::default().consecutive_failures(1)).unwrap();
    let failing = service_fn(|_req: Request<Body>| async {
        Ok::<_, BoxError>(
            Response::builder()
                .status(503)
                .body(Body::default())
                .unwrap(),
        )
    });
    let svc = Backstop::http("carrier-api")
        .breaker(breaker)
        .budget(Budget::default())
        .max_attempts(1)
        .build()
        .unwrap()
        .layer(failing);
    let get = || {
        Request::get("http://carrier.local/")
            .body(Body::default())
            .unwrap()
    };
    let _ = svc.clone().oneshot(get()).await;
    let err = svc.oneshot(get()).await.unwrap_err();
    assert_in_guide(&told(&err));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_reply_without_a_key() {
    let server = TestServer::start(|_: &Seen| Action::DropReply).await;
    let svc = Backstop::http("payments-api")
        .no_idempotency()
        .budget(Budget::default())
        .no_breaker()
        .build()
        .unwrap()
        .layer(client());
    let post = Request::post(server.url("/refunds"))
        .body(Body::from("{}"))
        .unwrap();
    let err = svc.oneshot(post).await.unwrap_err();
    assert_in_guide(&told(&err));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_reply_with_a_key_nobody_vouched_for() {
    let server = TestServer::start(|_: &Seen| Action::DropReply).await;
    let svc = Backstop::http("payments-api")
        .budget(Budget::default())
        .no_breaker()
        .build()
        .unwrap()
        .layer(client());
    let post = Request::post(server.url("/refunds"))
        .body(Body::from("{}"))
        .unwrap();
    let err = svc.oneshot(post).await.unwrap_err();
    assert_in_guide(&told(&err));
}

#[derive(Clone, Debug)]
struct ToolCall {
    extensions: http::Extensions,
}

impl HasExtensions for ToolCall {
    fn extensions(&self) -> &http::Extensions {
        &self.extensions
    }
    fn extensions_mut(&mut self) -> &mut http::Extensions {
        &mut self.extensions
    }
}

impl backstop::idempotency::KeyedRequest for ToolCall {
    fn needs_key(&self) -> bool {
        false
    }
    fn idempotency_key(&self) -> Option<&backstop::idempotency::IdempotencyKey> {
        None
    }
    fn set_idempotency_key(&mut self, _key: backstop::idempotency::IdempotencyKey) {}
}

#[derive(Debug)]
struct ToolResult(http::Extensions);

impl HasExtensions for ToolResult {
    fn extensions(&self) -> &http::Extensions {
        &self.0
    }
    fn extensions_mut(&mut self) -> &mut http::Extensions {
        &mut self.0
    }
}

/// The tool answered: its error goes back to the model.
#[derive(Clone, Debug)]
struct Answered;

impl<E: AsError> Classify<ToolCall, ToolResult, E> for Answered {
    fn classify(&self, result: Result<&ToolResult, &E>) -> Verdict {
        match result {
            Ok(_) => Verdict::Success,
            Err(_) => Verdict::Fatal {
                outcome: Outcome::Completed,
            },
        }
    }
    fn is_replay_safe(&self, _call: &ToolCall) -> bool {
        true
    }
}

#[tokio::test(start_paused = true)]
async fn a_tool_that_answered_with_an_error() {
    let tool = service_fn(|_call: ToolCall| async {
        Err::<ToolResult, BoxError>("invalid arguments: amount must be positive".into())
    });
    let svc = Backstop::tools("payments-tool", Answered)
        .budget(Budget::default())
        .no_breaker()
        .build()
        .unwrap()
        .layer(tool);
    let call = ToolCall {
        extensions: http::Extensions::new(),
    };
    let err = svc.oneshot(call).await.unwrap_err();
    assert_in_guide(&told(&err));
}

/// A client that is never ready.
#[derive(Clone)]
struct NeverReady;

impl Service<Request<Body>> for NeverReady {
    type Response = Response<Body>;
    type Error = BoxError;
    type Future = std::future::Ready<Result<Response<Body>, BoxError>>;
    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        Poll::Pending
    }
    fn call(&mut self, _req: Request<Body>) -> Self::Future {
        unreachable!("never ready")
    }
}

#[tokio::test(start_paused = true)]
async fn a_deadline() {
    let svc = Backstop::http("rates-api")
        .deadline(Duration::from_millis(500))
        .attempt_timeout(Duration::from_millis(200))
        .budget(Budget::default())
        .no_breaker()
        .build()
        .unwrap()
        .layer(NeverReady);
    let get = Request::get("http://rates.local/")
        .body(Body::default())
        .unwrap();
    // Bounded, so that a stack the deadline no longer bounds fails here instead of hanging.
    let err = tokio::time::timeout(Duration::from_secs(10), svc.oneshot(get))
        .await
        .expect("ended by the deadline")
        .unwrap_err();
    assert_in_guide(&told(&err));
}
