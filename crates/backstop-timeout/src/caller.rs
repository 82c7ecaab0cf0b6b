//! The server's side of a deadline that crosses the wire: the time its caller has left, read
//! from each request and inherited by every Backstop stack the handler calls.

use backstop_core::{BoxError, Deadline, TIME_LEFT_HEADER};
use http::{HeaderName, HeaderValue, Request, Response, StatusCode};
use pin_project::pin_project;
use std::{
    future::Future,
    pin::Pin,
    task::{Context, Poll},
    time::Duration,
};
use tokio::task::futures::TaskLocalFuture;
use tower_layer::Layer;
use tower_service::Service;

/// Applies [`CallerDeadline`]: serves each request within the time its caller said it has left.
///
/// A Backstop client sends each attempt's time left, in milliseconds, under
/// [`TIME_LEFT_HEADER`] (Envoy's `x-envoy-expected-rq-timeout-ms` is the same idea: pass
/// [`header`](Self::header) to read it); a gRPC client sends `grpc-timeout`, which
/// [`grpc`](Self::grpc) reads. For each request the layer:
///
/// - reads the value (whole milliseconds, ASCII digits; for gRPC, 1 to 8 digits and a unit of
///   `H`, `M`, `S`, `m`, `u` or `n`); a malformed one is ignored, with a `tracing` event (target
///   `backstop::deadline`), as if there were none;
/// - caps it at the layer's `max`, so a caller cannot hand the server an absurd deadline;
/// - answers at once, without calling the service, when it is zero: the caller's time is spent,
///   the work is *not started* (`408 Request Timeout` and an empty body; for gRPC, status
///   `DEADLINE_EXCEEDED` in a trailers-only answer). Put the layer outside a replay layer, so
///   that such a request claims no idempotency key;
/// - otherwise puts the deadline on the request (a tighter one already there, the server's own,
///   is kept) and runs the service within it ([`Deadline::scope`]): every Backstop stack the
///   handler calls in its task ends by then, whatever its own deadline. It never extends a
///   deadline the server set itself.
///
/// The handler itself is not cut when the time passes (its caller has gone; whether to stop
/// half-way is the handler's choice: a `tower::timeout` inside, or `Deadline::of(&req)`).
///
/// ```
/// use backstop_core::{Deadline, TIME_LEFT_HEADER};
/// use backstop_timeout::CallerDeadlineLayer;
/// use std::time::Duration;
/// use tower::{Layer, ServiceExt, service_fn};
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() -> Result<(), backstop_core::BoxError> {
/// let handler = service_fn(|_req: http::Request<()>| async {
///     // What every Backstop stack called from here inherits.
///     let left = Deadline::current().map(Deadline::remaining);
///     Ok::<_, backstop_core::BoxError>(http::Response::new(format!("{left:?}")))
/// });
/// let server = CallerDeadlineLayer::new(Duration::from_secs(30)).layer(handler);
///
/// let req = http::Request::builder().header(TIME_LEFT_HEADER, "1500").body(())?;
/// assert_eq!(server.clone().oneshot(req).await?.body(), "Some(1.5s)");
///
/// // Its time is spent: not started.
/// let spent = http::Request::builder().header(TIME_LEFT_HEADER, "0").body(())?;
/// assert_eq!(server.oneshot(spent).await?.status(), 408);
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct CallerDeadlineLayer {
    wire: Wire,
    max: Duration,
}

/// How the time left comes.
#[derive(Clone, Debug)]
enum Wire {
    /// Whole milliseconds under this header.
    Millis(HeaderName),
    /// gRPC's `grpc-timeout`.
    Grpc,
}

impl CallerDeadlineLayer {
    /// Reads [`TIME_LEFT_HEADER`], and gives no caller more than `max`.
    pub fn new(max: Duration) -> Self {
        CallerDeadlineLayer {
            wire: Wire::Millis(TIME_LEFT_HEADER),
            max,
        }
    }

    /// Reads gRPC's `grpc-timeout` (as a Backstop gRPC stack, and every gRPC client with a
    /// deadline, sends it), and gives no caller more than `max`: for a tonic server
    /// (`Server::builder().layer(..)`), so that the Backstop stacks its handlers call end by
    /// their caller's deadline. A call whose time is spent is answered `DEADLINE_EXCEEDED`.
    pub fn grpc(max: Duration) -> Self {
        CallerDeadlineLayer {
            wire: Wire::Grpc,
            max,
        }
    }

    /// Reads the time left, in whole milliseconds, from `name` instead.
    #[must_use]
    pub fn header(mut self, name: HeaderName) -> Self {
        self.wire = Wire::Millis(name);
        self
    }
}

impl<S> Layer<S> for CallerDeadlineLayer {
    type Service = CallerDeadline<S>;
    fn layer(&self, inner: S) -> CallerDeadline<S> {
        CallerDeadline {
            inner,
            layer: self.clone(),
        }
    }
}

/// Serves each request within the time its caller has left: see [`CallerDeadlineLayer`].
#[derive(Clone, Debug)]
pub struct CallerDeadline<S> {
    inner: S,
    layer: CallerDeadlineLayer,
}

impl<S> CallerDeadline<S> {
    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

/// What a caller said of its time: nothing usable, or this much.
fn time_left<B>(req: &Request<B>, wire: &Wire, max: Duration) -> Option<Duration> {
    let header = match wire {
        Wire::Millis(name) => name,
        Wire::Grpc => &GRPC_TIMEOUT,
    };
    let value = req.headers().get(header)?;
    let left = value.to_str().ok().and_then(|v| match wire {
        Wire::Millis(_) => millis(v),
        Wire::Grpc => grpc_timeout(v),
    });
    match left {
        Some(left) => Some(left.min(max)),
        None => {
            tracing::debug!(
                target: "backstop::deadline",
                header = %header,
                value = ?value,
                "ignored a malformed time left"
            );
            None
        }
    }
}

const GRPC_TIMEOUT: HeaderName = HeaderName::from_static("grpc-timeout");

/// Whole milliseconds; a number too large for a `u64` is as long as can be.
fn millis(v: &str) -> Option<Duration> {
    if v.is_empty() || !v.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some(Duration::from_millis(v.parse().unwrap_or(u64::MAX)))
}

/// gRPC's `grpc-timeout`: 1 to 8 ASCII digits and a unit (`H`, `M`, `S`, `m`, `u`, `n`).
fn grpc_timeout(v: &str) -> Option<Duration> {
    let (digits, unit) = v.split_at(v.len().checked_sub(1)?);
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// The answer to a call whose time was spent when it arrived.
fn spent<ResB: Default>(wire: &Wire) -> Response<ResB> {
    let mut res = Response::new(ResB::default());
    match wire {
        Wire::Millis(_) => *res.status_mut() = StatusCode::REQUEST_TIMEOUT,
        Wire::Grpc => {
            // gRPC's trailers-only answer: the status in the headers, no message.
            let headers = res.headers_mut();
            headers.insert(
                http::header::CONTENT_TYPE,
                HeaderValue::from_static("application/grpc"),
            );
            headers.insert("grpc-status", HeaderValue::from_static("4"));
            headers.insert(
                "grpc-message",
                HeaderValue::from_static(
                    "the caller's deadline had passed when the call arrived; it was not started",
                ),
            );
        }
    }
    res
}

impl<S, B, ResB> Service<Request<B>> for CallerDeadline<S>
where
    S: Service<Request<B>, Response = Response<ResB>>,
    S::Error: Into<BoxError>,
    ResB: Default,
{
    type Response = Response<ResB>;
    type Error = S::Error;
    type Future = CallerDeadlineFuture<S::Future, ResB>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<B>) -> Self::Future {
        let Some(left) = time_left(&req, &self.layer.wire, self.layer.max) else {
            return CallerDeadlineFuture::new(State::Served {
                inner: self.inner.call(req),
            });
        };
        if left.is_zero() {
            return CallerDeadlineFuture::new(State::Spent {
                res: Some(spent(&self.layer.wire)),
            });
        }
        let deadline = Deadline::after(left).tighten(&mut req);
        // A service may start its work in `call` itself: that work inherits the deadline too.
        let inner = deadline.in_scope(|| self.inner.call(req));
        CallerDeadlineFuture::new(State::Within {
            inner: deadline.scope(inner),
        })
    }
}

/// Response future of [`CallerDeadline`].
#[pin_project]
#[derive(Debug)]
pub struct CallerDeadlineFuture<F, ResB> {
    #[pin]
    state: State<F, ResB>,
}

#[pin_project(project = StateProj)]
#[derive(Debug)]
enum State<F, ResB> {
    /// No time left was sent: served as it came.
    Served {
        #[pin]
        inner: F,
    },
    /// Served within the caller's deadline.
    Within {
        #[pin]
        inner: TaskLocalFuture<Deadline, F>,
    },
    /// The caller's time was spent: answered without calling the service.
    Spent { res: Option<Response<ResB>> },
}

impl<F, ResB> CallerDeadlineFuture<F, ResB> {
    fn new(state: State<F, ResB>) -> Self {
        CallerDeadlineFuture { state }
    }
}

impl<F, ResB, E> Future for CallerDeadlineFuture<F, ResB>
where
    F: Future<Output = Result<Response<ResB>, E>>,
{
    type Output = Result<Response<ResB>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().state.project() {
            StateProj::Served { inner } => inner.poll(cx),
            StateProj::Within { inner } => inner.poll(cx),
            StateProj::Spent { res } => {
                Poll::Ready(Ok(res.take().expect("polled after completion")))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tower::{ServiceExt, service_fn};

    /// What the handler saw: the deadline on its request and the one its task inherited, as
    /// time left.
    type Seen = Option<(Option<Duration>, Option<Duration>)>;

    fn echo()
    -> impl Service<Request<()>, Response = Response<Seen>, Error = BoxError, Future: Send> + Clone
    {
        service_fn(|req: Request<()>| async move {
            let on_request = Deadline::of(&req).map(Deadline::remaining);
            let inherited = Deadline::current().map(Deadline::remaining);
            Ok::<_, BoxError>(Response::new(Some((on_request, inherited))))
        })
    }

    fn with(value: &str) -> Request<()> {
        Request::builder()
            .header(TIME_LEFT_HEADER, value)
            .body(())
            .unwrap()
    }

    async fn seen(layer: CallerDeadlineLayer, req: Request<()>) -> Response<Seen> {
        layer.layer(echo()).oneshot(req).await.unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn the_time_left_is_the_requests_deadline_and_the_tasks() {
        let layer = CallerDeadlineLayer::new(Duration::from_secs(30));
        let res = seen(layer, with("1500")).await;
        let left = Some(Duration::from_millis(1500));
        assert_eq!(res.into_body(), Some((left, left)));
    }

    #[tokio::test(start_paused = true)]
    async fn an_absurd_value_is_capped_by_the_servers_maximum() {
        let layer = CallerDeadlineLayer::new(Duration::from_secs(30));
        let thirty = Some(Duration::from_secs(30));
        for absurd in ["86400000000", "99999999999999999999999999"] {
            let res = seen(layer.clone(), with(absurd)).await;
            assert_eq!(res.into_body(), Some((thirty, thirty)), "{absurd}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_malformed_or_missing_value_is_ignored() {
        let layer = CallerDeadlineLayer::new(Duration::from_secs(30));
        for bad in ["", "-5", "1.5", "1s", " 100", "0x10"] {
            let res = seen(layer.clone(), with(bad)).await;
            assert_eq!(res.status(), 200, "{bad:?}");
            assert_eq!(res.into_body(), Some((None, None)), "{bad:?}");
        }
        let res = seen(layer, Request::new(())).await;
        assert_eq!(res.into_body(), Some((None, None)));
    }

    #[tokio::test(start_paused = true)]
    async fn a_spent_caller_is_answered_at_once_and_nothing_runs() {
        let calls = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
        let seen = calls.clone();
        let svc = CallerDeadlineLayer::new(Duration::from_secs(30)).layer(service_fn(
            move |_req: Request<()>| {
                seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                async { Ok::<_, BoxError>(Response::new(String::new())) }
            },
        ));
        let res = svc.oneshot(with("0")).await.unwrap();
        assert_eq!(res.status(), StatusCode::REQUEST_TIMEOUT);
        assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn the_servers_own_deadline_is_never_extended() {
        let layer = CallerDeadlineLayer::new(Duration::from_secs(30));
        // On the request, set by a layer outside.
        let mut req = with("5000");
        Deadline::after(Duration::from_secs(1)).tighten(&mut req);
        let one = Some(Duration::from_secs(1));
        let res = seen(layer.clone(), req).await;
        assert_eq!(res.into_body().unwrap().0, one);
        // Inherited by the task the server runs the request in.
        let res = Deadline::after(Duration::from_secs(1))
            .scope(seen(layer, with("5000")))
            .await;
        assert_eq!(res.into_body().unwrap().1, one);
    }

    /// A service that starts its outbound call in `call` itself, not in its future.
    #[derive(Clone)]
    struct Eager(std::sync::Arc<std::sync::Mutex<Option<Option<Duration>>>>);

    impl Service<Request<()>> for Eager {
        type Response = Response<()>;
        type Error = BoxError;
        type Future = std::future::Ready<Result<Response<()>, BoxError>>;
        fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
            Poll::Ready(Ok(()))
        }
        fn call(&mut self, _req: Request<()>) -> Self::Future {
            *self.0.lock().unwrap() = Some(Deadline::current().map(Deadline::remaining));
            std::future::ready(Ok(Response::new(())))
        }
    }

    #[tokio::test(start_paused = true)]
    async fn work_started_in_call_inherits_it_too() {
        let seen = Eager(Default::default());
        let svc = CallerDeadlineLayer::new(Duration::from_secs(30)).layer(seen.clone());
        svc.oneshot(with("1500")).await.unwrap();
        assert_eq!(
            *seen.0.lock().unwrap(),
            Some(Some(Duration::from_millis(1500)))
        );
    }

    #[tokio::test(start_paused = true)]
    async fn another_header_can_carry_it() {
        let name = HeaderName::from_static("x-envoy-expected-rq-timeout-ms");
        let layer = CallerDeadlineLayer::new(Duration::from_secs(30)).header(name.clone());
        let req = Request::builder().header(name, "250").body(()).unwrap();
        let left = Some(Duration::from_millis(250));
        assert_eq!(seen(layer, req).await.into_body(), Some((left, left)));
    }

    fn grpc(value: &str) -> Request<()> {
        Request::builder()
            .header("grpc-timeout", value)
            .body(())
            .unwrap()
    }

    #[test]
    fn grpc_timeouts_are_read_in_their_units_and_malformed_ones_ignored() {
        let cases = [
            ("1500m", Some(Duration::from_millis(1500))),
            ("3S", Some(Duration::from_secs(3))),
            ("2M", Some(Duration::from_secs(120))),
            ("1H", Some(Duration::from_secs(3600))),
            ("250u", Some(Duration::from_micros(250))),
            ("7n", Some(Duration::from_nanos(7))),
            ("99999999S", Some(Duration::from_secs(99_999_999))),
            ("0m", Some(Duration::ZERO)),
            ("123456789S", None),
            ("m", None),
            ("15", None),
            ("1.5S", None),
            ("-1S", None),
            ("10s", None),
            ("", None),
        ];
        for (value, expected) in cases {
            assert_eq!(grpc_timeout(value), expected, "{value:?}");
        }
    }

    /// A gRPC caller's `grpc-timeout` is the call's deadline, capped by the server's maximum.
    #[tokio::test(start_paused = true)]
    async fn a_grpc_timeout_is_the_calls_deadline() {
        let layer = CallerDeadlineLayer::grpc(Duration::from_secs(30));
        let left = Some(Duration::from_millis(1500));
        let res = seen(layer.clone(), grpc("1500m")).await;
        assert_eq!(res.into_body(), Some((left, left)));
        let thirty = Some(Duration::from_secs(30));
        let res = seen(layer.clone(), grpc("2H")).await;
        assert_eq!(res.into_body(), Some((thirty, thirty)));
        // The milliseconds header means nothing to a gRPC layer.
        assert_eq!(
            seen(layer, with("1500")).await.into_body(),
            Some((None, None))
        );
    }

    /// A gRPC call whose time is spent is answered DEADLINE_EXCEEDED, trailers-only, and its
    /// handler is not called.
    #[tokio::test(start_paused = true)]
    async fn a_spent_grpc_call_is_not_started() {
        let res = seen(
            CallerDeadlineLayer::grpc(Duration::from_secs(30)),
            grpc("0n"),
        )
        .await;
        assert_eq!(res.status(), StatusCode::OK);
        assert_eq!(res.headers()["grpc-status"], "4");
        assert_eq!(res.headers()["content-type"], "application/grpc");
        assert_eq!(res.into_body(), None, "the handler was not called");
    }
}
