//! tower's own tests, case by case: each behaviour that `tower/tests/` checks for its retry,
//! buffer, concurrency limit, load shedding and hedging (and its timeout's documented
//! behaviour), in Backstop's words, run against every conformance subject it applies to (the
//! subjects of `conformance.rs`: the composed stack over a leaf and with the call context, the
//! retry layer alone, each layer crate's service). Each test names the tower case it ports. The
//! inner service is `tower-test`'s mock, which panics on a `call` that no `poll_ready` answered
//! `Ready` for on the handle called, so every case also checks tower's readiness contract. The
//! paused clock keeps time.

use super::conformance::{
    Inner, Req, Res, Subject, answer, boxed, each_subject, finishes_after_the_caller_leaves,
    retries, stack_builder, status_of, within,
};
use backstop::{
    BoxError,
    backoff::{Backoff, RngSource},
    retry::{Hedging, NotCopyable, Resend, RetryLayer},
    timeout::{LatencyConfig, LatencyTimeouts},
};
use http::{Request, StatusCode};
use http_body_util::Full;
use std::{error::Error as StdError, io, iter, task::Poll, time::Duration};
use tokio_test::task;
use tower::{
    Layer, Service, ServiceExt, buffer::Buffer, limit::ConcurrencyLimit, load_shed::LoadShed,
};
use tower_test::mock::{self, Handle, SendResponse};

fn at(method: &str, path: &str) -> Req {
    Request::builder()
        .method(method)
        .uri(format!("http://conformance.local{path}"))
        .body(Full::default())
        .unwrap()
}

fn get(path: &str) -> Req {
    at("GET", path)
}

/// A connection reset: the attempt's outcome is unknown, and a `GET` may be repeated.
fn reset(text: &str) -> BoxError {
    Box::new(io::Error::new(
        io::ErrorKind::ConnectionReset,
        text.to_owned(),
    ))
}

/// An error no classifier recognises: fatal, never retried.
fn fatal(text: &str) -> BoxError {
    Box::new(io::Error::new(
        io::ErrorKind::PermissionDenied,
        text.to_owned(),
    ))
}

/// Whether `text` is in the error or any of its sources.
fn names(err: &BoxError, text: &str) -> bool {
    iter::successors(Some(err.as_ref() as &(dyn StdError + 'static)), |e| {
        (*e).source()
    })
    .any(|e| e.to_string().contains(text))
}

/// The next request the mock receives, checked to be for `path`.
async fn expect(handle: &mut Handle<Req, Res>, path: &str) -> SendResponse<Res> {
    let (req, reply) = handle
        .next_request()
        .await
        .unwrap_or_else(|| panic!("{path} never came"));
    assert_eq!(req.uri().path(), path);
    reply
}

/// Answers the next request, checked to be for `path`, with `status`, and checks that the
/// caller whose call is `call` gets that status.
async fn serve(
    handle: &mut Handle<Req, Res>,
    path: &str,
    status: u16,
    call: tokio::task::JoinHandle<Result<StatusCode, BoxError>>,
    name: &str,
) {
    expect(handle, path).await.send_response(answer(status));
    assert_eq!(call.await.unwrap().unwrap(), status, "{name}");
}

/// Hands every request the mock receives to `each` until `call` ends, and gives the call's
/// result.
async fn until_ended<T>(
    handle: &mut Handle<Req, Res>,
    mut call: tokio::task::JoinHandle<T>,
    mut each: impl FnMut(Req, SendResponse<Res>),
) -> T {
    loop {
        tokio::select! {
            biased;
            out = &mut call => return out.expect("the call's task"),
            Some((req, reply)) = handle.next_request() => each(req, reply),
        }
    }
}

/// Whether a request is waiting at the mock (without waiting for one).
fn nothing_waiting(handle: &mut Handle<Req, Res>) -> bool {
    !matches!(
        task::spawn(handle.next_request()).poll(),
        Poll::Ready(Some(_))
    )
}

// ---- tower/tests/retry ------------------------------------------------------------------

/// `retry_errors`: an error the policy retries, then an answer: the caller gets the answer.
/// Subjects that do not retry hand the error back.
#[tokio::test(start_paused = true)]
async fn retry_errors() {
    each_subject(
        |_| true,
        async |name, subject, mock, mut handle| {
            let call = tokio::spawn(subject(boxed(mock)).oneshot(get("/hello")));
            expect(&mut handle, "/hello")
                .await
                .send_error(reset("retry me"));
            if retries(name) {
                serve(&mut handle, "/hello", 200, call, name).await;
            } else {
                let err = call.await.unwrap().unwrap_err();
                assert!(names(&err, "retry me"), "{name}: {err}");
            }
        },
    )
    .await;
}

/// `retry_limit`: every attempt fails; after the last one allowed the call ends with the last
/// attempt's error, and no further request is sent.
#[tokio::test(start_paused = true)]
async fn retry_limit() {
    each_subject(retries, async |name, subject, mock, mut handle| {
        let call = tokio::spawn(subject(boxed(mock)).oneshot(get("/hello")));
        let mut sent = 0;
        let err = until_ended(&mut handle, call, |_, reply| {
            sent += 1;
            reply.send_error(reset(&format!("retry {sent}")));
        })
        .await
        .unwrap_err();
        assert_eq!(sent, 3, "{name}: three attempts, the stack's limit");
        assert!(
            names(&err, "retry 3"),
            "{name}: the last attempt's error: {err}"
        );
        assert!(nothing_waiting(&mut handle), "{name}");
    })
    .await;
}

/// `retry_error_inspection`: the classifier reads each error; one it does not retry ends the
/// call at once with that error.
#[tokio::test(start_paused = true)]
async fn retry_error_inspection() {
    each_subject(retries, async |name, subject, mock, mut handle| {
        let call = tokio::spawn(subject(boxed(mock)).oneshot(get("/hello")));
        expect(&mut handle, "/hello")
            .await
            .send_error(reset("retry 1"));
        expect(&mut handle, "/hello")
            .await
            .send_error(fatal("reject"));
        let err = call.await.unwrap().unwrap_err();
        assert!(names(&err, "reject"), "{name}: {err}");
        assert!(nothing_waiting(&mut handle), "{name}: not retried");
    })
    .await;
}

/// A `Resend` that can make no copy, as tower's `CannotClone` policy.
#[derive(Clone, Copy)]
struct CannotCopy;

impl Resend<Req> for CannotCopy {
    fn copy(&self, _: &Req) -> Result<Req, NotCopyable> {
        Err(NotCopyable::new("this request cannot be sent again"))
    }
}

fn cannot_copy(inner: Inner) -> Subject {
    let layer = RetryLayer::http()
        .resend(CannotCopy)
        .dependency("tower-cases-cannot-copy")
        .rng(RngSource::seeded(7))
        .backoff(Backoff::constant(Duration::from_millis(20)));
    status_of(layer.layer(inner))
}

/// `retry_cannot_clone_request`: a request that cannot be copied is sent once, and its error is
/// the call's, with no retry.
#[tokio::test(start_paused = true)]
async fn retry_cannot_clone_request() {
    within(async {
        let (mock, mut handle) = mock::pair::<Req, _>();
        let call = tokio::spawn(cannot_copy(boxed(mock)).oneshot(get("/hello")));
        expect(&mut handle, "/hello")
            .await
            .send_error(reset("retry 1"));
        let err = call.await.unwrap().unwrap_err();
        assert!(names(&err, "retry 1"), "{err}");
        assert!(nothing_waiting(&mut handle), "not retried");
    })
    .await;
}

/// `success_with_cannot_clone`: a request that cannot be copied, answered at once: the answer.
#[tokio::test(start_paused = true)]
async fn success_with_cannot_clone() {
    within(async {
        let (mock, mut handle) = mock::pair::<Req, _>();
        let call = tokio::spawn(cannot_copy(boxed(mock)).oneshot(get("/hello")));
        expect(&mut handle, "/hello")
            .await
            .send_response(answer(200));
        assert_eq!(call.await.unwrap().unwrap(), StatusCode::OK);
    })
    .await;
}

/// `retry_mutating_policy`: tower's policy may rewrite the request between attempts; Backstop
/// never does: every attempt sends the same request, its idempotency key included (the key the
/// composed stack writes on a `POST` is the one every retry carries), and when the attempts are
/// spent the call ends with the last answer.
#[tokio::test(start_paused = true)]
async fn retry_mutating_policy() {
    each_subject(retries, async |name, subject, mock, mut handle| {
        let call = tokio::spawn(subject(boxed(mock)).oneshot(at("POST", "/hello")));
        let mut seen = Vec::new();
        let last = until_ended(&mut handle, call, |req, reply| {
            seen.push((
                req.method().clone(),
                req.uri().clone(),
                req.headers().clone(),
            ));
            reply.send_response(answer(503));
        })
        .await;
        assert_eq!(last.unwrap(), 503, "{name}: the last answer");
        assert!(seen.len() >= 2, "{name}: retried ({} attempts)", seen.len());
        assert!(
            seen.windows(2).all(|w| w[0] == w[1]),
            "{name}: every attempt the same request: {seen:?}"
        );
    })
    .await;
}

// ---- tower's timeout (its documented behaviour; tower has no tests directory for it) -----

/// An answer within the limit passes through; an inner service that answers too late ends the
/// call with a timeout error, and the late answer is not waited for.
#[tokio::test(start_paused = true)]
async fn timeout_passes_an_answer_in_time_and_cuts_a_late_one() {
    each_subject(
        |name| {
            (name.starts_with("the composed stack")
                || name.contains("timeout")
                || name == "the deadline")
                && name != "the body timeout"
        },
        async |name, subject, mock, mut handle| {
            let svc = subject(boxed(mock));
            let call = tokio::spawn(svc.clone().oneshot(get("/in-time")));
            let reply = expect(&mut handle, "/in-time").await;
            tokio::time::sleep(Duration::from_millis(500)).await;
            reply.send_response(answer(200));
            assert_eq!(call.await.unwrap().unwrap(), 200, "{name}");

            let started = tokio::time::Instant::now();
            let call = tokio::spawn(svc.oneshot(get("/late")));
            let mut unanswered = Vec::new();
            let err = until_ended(&mut handle, call, |_, reply| unanswered.push(reply))
                .await
                .unwrap_err();
            assert!(
                names(&err, "did not reply within") || names(&err, "deadline"),
                "{name}: {err}"
            );
            assert!(
                started.elapsed() <= Duration::from_secs(3),
                "{name}: cut at its limit"
            );
        },
    )
    .await;
}

// ---- tower/tests/buffer (the subject behind a Buffer) -------------------------------------

/// `req_and_res`: a request through the buffer is answered.
#[tokio::test(start_paused = true)]
async fn buffer_req_and_res() {
    each_subject(
        |_| true,
        async |name, subject, mock, mut handle| {
            let mut svc = Buffer::new(subject(boxed(mock)), 10);
            let call = tokio::spawn(svc.ready().await.unwrap().call(get("/hello")));
            serve(&mut handle, "/hello", 200, call, name).await;
        },
    )
    .await;
}

/// `clears_canceled_requests`: a request dropped by its caller while it waits in the buffer is
/// never sent; the ones around it are.
#[tokio::test(start_paused = true)]
async fn buffer_clears_canceled_requests() {
    each_subject(
        |_| true,
        async |name, subject, mock, mut handle| {
            handle.allow(1);
            let mut svc = Buffer::new(subject(boxed(mock)), 10);
            let first = tokio::spawn(svc.ready().await.unwrap().call(get("/hello")));
            let reply = expect(&mut handle, "/hello").await;
            let mut second = task::spawn(svc.ready().await.unwrap().call(get("/hello2")));
            assert!(second.poll().is_pending(), "{name}");
            let third = tokio::spawn(svc.ready().await.unwrap().call(get("/hello3")));
            tokio::task::yield_now().await;
            assert!(
                nothing_waiting(&mut handle),
                "{name}: the mock allows no more"
            );
            drop(second);
            reply.send_response(answer(200));
            assert_eq!(first.await.unwrap().unwrap(), 200, "{name}");
            handle.allow(1);
            serve(&mut handle, "/hello3", 201, third, name).await;
        },
    )
    .await;
}

/// `when_inner_is_not_ready`: while the service inside is not ready nothing is sent and the
/// caller waits; once it is, the request goes out and is answered.
#[tokio::test(start_paused = true)]
async fn buffer_when_inner_is_not_ready() {
    each_subject(
        |_| true,
        async |name, subject, mock, mut handle| {
            handle.allow(0);
            let mut svc = Buffer::new(subject(boxed(mock)), 10);
            let call = tokio::spawn(svc.ready().await.unwrap().call(get("/hello")));
            tokio::time::sleep(Duration::from_millis(100)).await;
            assert!(!call.is_finished(), "{name}: waits");
            assert!(nothing_waiting(&mut handle), "{name}: nothing sent");
            handle.allow(1);
            serve(&mut handle, "/hello", 200, call, name).await;
        },
    )
    .await;
}

/// `when_inner_fails`: the service inside fails its readiness; the caller gets an error that
/// carries the service's own.
#[tokio::test(start_paused = true)]
async fn buffer_when_inner_fails() {
    each_subject(
        |_| true,
        async |name, subject, mock, mut handle| {
            handle.allow(0);
            handle.send_error("foobar");
            let mut svc = Buffer::new(subject(boxed(mock)), 10);
            let err = match svc.ready().await {
                Ok(svc) => svc.call(get("/hello")).await.unwrap_err(),
                Err(err) => err,
            };
            assert!(names(&err, "foobar"), "{name}: {err}");
        },
    )
    .await;
}

/// `response_future_when_worker_is_dropped_early` and `poll_ready_when_worker_is_dropped_early`,
/// with the buffer inside the subject: its worker gone, the call ends with the buffer's
/// `Closed` in its error, at once, and does not wait for its deadline.
#[tokio::test(start_paused = true)]
async fn buffer_inside_whose_worker_is_dropped_ends_the_call() {
    each_subject(
        |_| true,
        async |name, subject, mock, _handle| {
            let (buffer, worker) = Buffer::pair(boxed(mock), 1);
            drop(worker);
            let started = tokio::time::Instant::now();
            let err = match subject(boxed(buffer)).ready_oneshot().await {
                Ok(svc) => svc.oneshot(get("/hello")).await.unwrap_err(),
                Err(err) => err,
            };
            assert!(names(&err, "closed"), "{name}: {err}");
            assert_eq!(started.elapsed(), Duration::ZERO, "{name}: at once");
        },
    )
    .await;
}

/// `doesnt_leak_permits`, with a limit of two inside: a handle polled ready many times holds one
/// permit; two handles hold both, a third waits until one is spent and answered.
#[tokio::test(start_paused = true)]
async fn readiness_polled_again_holds_one_permit() {
    each_subject(
        |name| !finishes_after_the_caller_leaves(name),
        async |name, subject, mock, mut handle| {
            let mut s1 = subject(boxed(ConcurrencyLimit::new(mock, 2)));
            let mut s2 = s1.clone();
            let mut s3 = s1.clone();
            for _ in 0..3 {
                assert!(task::spawn(s1.ready()).poll().is_ready(), "{name}");
            }
            for _ in 0..3 {
                assert!(task::spawn(s2.ready()).poll().is_ready(), "{name}");
            }
            let mut ready3 = task::spawn(s3.ready());
            assert!(ready3.poll().is_pending(), "{name}: both permits held");
            let call = tokio::spawn(s1.call(get("/hello")));
            serve(&mut handle, "/hello", 200, call, name).await;
            assert!(ready3.is_woken(), "{name}");
            assert!(ready3.poll().is_ready(), "{name}: the spent permit is free");
        },
    )
    .await;
}

// ---- tower/tests/limit/concurrency.rs (a limit of one inside the subject) ----------------

/// `request_without_capacity`: with no capacity inside, the subject is not ready.
#[tokio::test(start_paused = true)]
async fn limit_request_without_capacity() {
    each_subject(
        |_| true,
        async |name, subject, mock, _handle| {
            let mut svc = subject(boxed(ConcurrencyLimit::new(mock, 0)));
            assert!(task::spawn(svc.ready()).poll().is_pending(), "{name}");
        },
    )
    .await;
}

/// `reserve_capacity_without_sending_request`: one handle reserves the permit, a clone cannot;
/// the clone gets it when the first call has ended, not when its answer was merely sent.
#[tokio::test(start_paused = true)]
async fn limit_reserve_capacity_without_sending_request() {
    each_subject(
        |name| !finishes_after_the_caller_leaves(name),
        async |name, subject, mock, mut handle| {
            let mut s1 = subject(boxed(ConcurrencyLimit::new(mock, 1)));
            let mut s2 = s1.clone();
            assert!(task::spawn(s1.ready()).poll().is_ready(), "{name}");
            let mut ready2 = task::spawn(s2.ready());
            assert!(ready2.poll().is_pending(), "{name}");
            let mut r1 = task::spawn(s1.call(get("/hello")));
            assert!(r1.poll().is_pending(), "{name}");
            expect(&mut handle, "/hello")
                .await
                .send_response(answer(200));
            assert!(
                ready2.poll().is_pending(),
                "{name}: the first call has not ended"
            );
            r1.await.unwrap();
            assert!(ready2.poll().is_ready(), "{name}");
        },
    )
    .await;
}

/// `service_drop_frees_capacity` and `multi_waiters`: a handle that reserved the permit and is
/// dropped frees it for one waiting clone (woken), and the next waits for that one.
#[tokio::test(start_paused = true)]
async fn limit_service_drop_frees_capacity_for_one_waiter() {
    each_subject(
        |_| true,
        async |name, subject, mock, _handle| {
            let mut s1 = subject(boxed(ConcurrencyLimit::new(mock, 1)));
            let mut s2 = s1.clone();
            let mut s3 = s1.clone();
            assert!(task::spawn(s1.ready()).poll().is_ready(), "{name}");
            let mut ready2 = task::spawn(s2.ready());
            let mut ready3 = task::spawn(s3.ready());
            assert!(ready2.poll().is_pending(), "{name}");
            assert!(ready3.poll().is_pending(), "{name}");
            drop(s1);
            assert!(ready2.is_woken(), "{name}: the first waiter is woken");
            assert!(!ready3.is_woken(), "{name}: the second is not");
            assert!(ready2.poll().is_ready(), "{name}");
            drop(ready2);
            drop(s2);
            assert!(ready3.is_woken(), "{name}: then the second");
            assert!(ready3.poll().is_ready(), "{name}");
        },
    )
    .await;
}

/// `response_error_releases_capacity`: a call that ends in an error (after the subject's own
/// retries) frees the permit.
#[tokio::test(start_paused = true)]
async fn limit_response_error_releases_capacity() {
    each_subject(
        |name| !finishes_after_the_caller_leaves(name),
        async |name, subject, mock, mut handle| {
            let mut s1 = subject(boxed(ConcurrencyLimit::new(mock, 1)));
            let mut s2 = s1.clone();
            let call = tokio::spawn(s1.ready().await.unwrap().call(get("/hello")));
            until_ended(&mut handle, call, |_, reply| {
                reply.send_error(reset("boom"))
            })
            .await
            .unwrap_err();
            assert!(task::spawn(s2.ready()).poll().is_ready(), "{name}");
        },
    )
    .await;
}

/// `response_future_drop_releases_capacity`: a call's future dropped before it is polled frees
/// the permit its handle had reserved.
#[tokio::test(start_paused = true)]
async fn limit_response_future_drop_releases_capacity() {
    each_subject(
        |name| !finishes_after_the_caller_leaves(name),
        async |name, subject, mock, _handle| {
            let mut s1 = subject(boxed(ConcurrencyLimit::new(mock, 1)));
            let mut s2 = s1.clone();
            assert!(task::spawn(s1.ready()).poll().is_ready(), "{name}");
            let r1 = s1.call(get("/hello"));
            let mut ready2 = task::spawn(s2.ready());
            assert!(ready2.poll().is_pending(), "{name}");
            drop(r1);
            assert!(ready2.poll().is_ready(), "{name}");
        },
    )
    .await;
}

// ---- tower/tests/load_shed ---------------------------------------------------------------

/// `when_ready`: `load_shed` outside a ready subject passes the call through and its answer
/// back. (`when_not_ready` is `conformance.rs`'s
/// `load_shed_outside_sheds_when_the_service_inside_is_not_ready`.)
#[tokio::test(start_paused = true)]
async fn load_shed_when_ready() {
    each_subject(
        |_| true,
        async |name, subject, mock, mut handle| {
            let mut svc = LoadShed::new(subject(boxed(mock)));
            assert!(task::spawn(svc.ready()).poll().is_ready(), "{name}");
            let call = tokio::spawn(svc.call(get("/hello")));
            serve(&mut handle, "/hello", 200, call, name).await;
        },
    )
    .await;
}

// ---- tower/tests/hedge (Backstop's hedged reads) ------------------------------------------

/// The composed stack with hedged reads, its latency record taught 10 ms answers, so that a
/// copy goes out when the first is unanswered past that.
async fn hedged() -> (Subject, Handle<Req, Res>) {
    let (mock, mut handle) = mock::pair::<Req, _>();
    let learned = LatencyConfig::default()
        .min_samples(1)
        .floor(Duration::from_secs(1));
    let layer = stack_builder("tower-cases-hedge")
        .attempt_timeout_from_latency(LatencyTimeouts::new(learned).unwrap())
        .build()
        .unwrap();
    let svc = status_of(layer.layer(layer.hedge(boxed(mock), Hedging::default()).unwrap()));
    for _ in 0..5 {
        let call = tokio::spawn(svc.clone().oneshot(get("/warm")));
        let reply = expect(&mut handle, "/warm").await;
        tokio::time::sleep(Duration::from_millis(10)).await;
        reply.send_response(answer(200));
        assert_eq!(call.await.unwrap().unwrap(), 200);
    }
    (svc, handle)
}

/// A hedged read whose two copies are both out, answered by the copy or by the first: the
/// caller gets the answer that came.
async fn answered_by(copy: bool, status: u16) {
    let (svc, mut handle) = hedged().await;
    let call = tokio::spawn(svc.oneshot(get("/read")));
    let first = expect(&mut handle, "/read").await;
    let second = expect(&mut handle, "/read").await;
    let (answers, _waits) = if copy {
        (second, first)
    } else {
        (first, second)
    };
    answers.send_response(answer(status));
    assert_eq!(call.await.unwrap().unwrap(), status, "copy: {copy}");
}

/// `hedge_orig_completes_first`: the copy went out, the first answers first: its answer.
#[tokio::test(start_paused = true)]
async fn hedge_orig_completes_first() {
    within(answered_by(false, 200)).await;
}

/// `hedge_hedge_completes_first`: the copy answers first: its answer.
#[tokio::test(start_paused = true)]
async fn hedge_hedge_completes_first() {
    within(answered_by(true, 203)).await;
}

/// `completes_before_hedge`: an answer before the hedge's delay: no copy is sent.
#[tokio::test(start_paused = true)]
async fn hedge_completes_before_hedge() {
    within(async {
        let (svc, mut handle) = hedged().await;
        let call = tokio::spawn(svc.oneshot(get("/read")));
        serve(&mut handle, "/read", 200, call, "answered in time").await;
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(nothing_waiting(&mut handle), "no copy");
    })
    .await;
}

/// `request_not_retyable`: a write is never hedged: one copy, however long it takes.
#[tokio::test(start_paused = true)]
async fn hedge_request_not_retryable() {
    within(async {
        let (svc, mut handle) = hedged().await;
        let call = tokio::spawn(svc.oneshot(at("POST", "/write")));
        let reply = expect(&mut handle, "/write").await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(nothing_waiting(&mut handle), "no copy of a write");
        reply.send_response(answer(201));
        assert_eq!(call.await.unwrap().unwrap(), 201);
    })
    .await;
}
