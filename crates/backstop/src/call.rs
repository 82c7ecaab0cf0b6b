//! The call's work, once per logical call, outside the retry layer: the idempotency key (attached
//! before the retry layer copies the request, so every attempt carries it), the call's span,
//! one [`Error`] for every end, dead letters and reconciliation. As tower's pieces:
//! [`CallLayer`], [`CallService`] and [`CallFuture`].

use crate::telemetry::{Otel, Slot};
use crate::transport::{Describe, sealed::Describes};
use crate::{DeadLetter, DeadLetterSink, Error};
use backstop_core::{BoxError, Dependency, HasExtensions, Outcome, ReplaySafe};
use backstop_idempotency::{
    ActionContext, IdempotencyKey, IdempotencyLayer, Inject, MakeKey, RandomKey,
};
use backstop_retry::RetryHistory;
use pin_project::pin_project;
use std::{
    fmt,
    future::Future,
    marker::PhantomData,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll, ready},
};
use tower_layer::Layer;
use tower_service::Service;

pub(crate) type Reconcile = Arc<dyn Fn(&DeadLetter) + Send + Sync>;

/// How the composed stack makes a key when the caller gave none, as the preset chooses.
#[derive(Clone, Copy, Debug)]
pub(crate) enum KeyGenerator {
    /// A random key per logical call.
    Random,
    /// No key unless the caller or the runtime gave one.
    CallerOnly,
}

impl<Req> MakeKey<Req> for KeyGenerator {
    fn make_key(&self, req: &Req) -> Option<IdempotencyKey> {
        match self {
            KeyGenerator::Random => RandomKey.make_key(req),
            KeyGenerator::CallerOnly => None,
        }
    }
}

/// What the call's work needs, shared by every service of one stack.
pub(crate) struct CallWork<I> {
    pub(crate) dependency: Dependency,
    pub(crate) inject: I,
    /// Attaches idempotency keys (`None`: turned off).
    pub(crate) keys: Option<IdempotencyLayer<I, KeyGenerator>>,
    pub(crate) read_only: bool,
    pub(crate) sink: Option<Arc<dyn DeadLetterSink>>,
    pub(crate) reconcile: Option<Reconcile>,
    pub(crate) otel: Otel,
}

impl<I> fmt::Debug for CallWork<I> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CallWork")
            .field("dependency", &self.dependency)
            .finish_non_exhaustive()
    }
}

/// Where a failed mutating call's dead letter goes, and what it says, taken from the request
/// before it is sent.
struct Letterhead {
    run_id: Option<Arc<str>>,
    call_id: Option<Arc<str>>,
    key: Option<IdempotencyKey>,
    sink: Option<Arc<dyn DeadLetterSink>>,
    reconcile: Option<Reconcile>,
}

/// What one call keeps from its start to its end: its span, and what a dead letter would need.
pub(crate) struct CallState {
    /// The call's span when a subscriber records it, boxed: the future every call moves keeps a
    /// pointer for it, and a call no subscriber traces allocates nothing.
    span: Option<Box<tracing::Span>>,
    /// Boxed: only a mutating call that may need a dead letter carries it, and the future
    /// every call moves stays small.
    letterhead: Option<Box<Letterhead>>,
    /// The call's start, when the stack records telemetry.
    otel: Slot,
}

impl fmt::Debug for CallState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CallState")
            .field("span", &self.span)
            .field("letter", &self.letterhead.is_some())
            .finish()
    }
}

impl<I> CallWork<I> {
    /// Before the call: marks a read-only call replay-safe, attaches the key (or refuses the
    /// call, nothing sent), opens the call's span and takes what a dead letter would need (and
    /// the call's start, for telemetry; `grpc` names a gRPC call's method and target).
    pub(crate) fn begin<Req>(
        &self,
        req: &mut Req,
        grpc: fn(&Req) -> Option<(String, String)>,
    ) -> Result<CallState, Error>
    where
        Req: HasExtensions,
        I: Inject<Req>,
    {
        if self.read_only {
            req.extensions_mut().insert(ReplaySafe);
        }
        if let Some(keys) = &self.keys
            && let Err(refused) = backstop_idempotency::plumbing::attach(keys, req)
        {
            return Err(self.error(Box::new(refused)));
        }
        let span = tracing::info_span!(
            target: "backstop::call",
            "call",
            dependency = %self.dependency,
            run_id = tracing::field::Empty,
            tool_call_id = tracing::field::Empty,
            idempotency_key = tracing::field::Empty,
            attempts = tracing::field::Empty,
            outcome = tracing::field::Empty,
            error = tracing::field::Empty,
        );
        // The request's labels are looked up only when something will use them: a span that
        // is being recorded, or a dead letter a failed mutating call may need.
        let wants_letter = (self.sink.is_some() || self.reconcile.is_some())
            && !self.read_only
            && self.inject.needs_key(req);
        let mut letterhead = None;
        if wants_letter || !span.is_disabled() {
            // The key on the request as it is sent (the caller's own header too), else the one
            // in its extensions.
            let key = self
                .inject
                .carried(req)
                .or_else(|| req.extensions().get::<IdempotencyKey>().cloned());
            let ext = req.extensions();
            let action = ext.get::<ActionContext>();
            if !span.is_disabled() {
                // A call of a run: its retries (attempts - 1) are the run's spend by this call.
                if let Some(run) = backstop_core::Run::of(req) {
                    span.record("run_id", run.id());
                }
                if let Some(a) = action {
                    span.record("run_id", a.run_id());
                    if let Some(c) = a.call_id() {
                        span.record("tool_call_id", c);
                    }
                }
                if let Some(k) = &key {
                    span.record("idempotency_key", k.as_str());
                }
            }
            letterhead = wants_letter.then(|| {
                Box::new(Letterhead {
                    run_id: action.map(|a| Arc::from(a.run_id())),
                    call_id: action.and_then(|a| a.call_id()).map(Arc::from),
                    key,
                    sink: self.sink.clone(),
                    reconcile: self.reconcile.clone(),
                })
            });
        }
        let otel = self.otel.begin(&self.dependency, || grpc(req));
        Ok(CallState {
            span: (!span.is_disabled()).then(|| Box::new(span)),
            letterhead,
            otel,
        })
    }

    /// An error of this stack's (a refusal, a `poll_ready` error) as the call's [`Error`].
    pub(crate) fn error(&self, error: BoxError) -> Error {
        Error::new(Some(&self.dependency), error)
    }
}

impl CallState {
    /// Enters the call's span, when it is recorded.
    pub(crate) fn enter(&self) -> Option<tracing::span::Entered<'_>> {
        self.span.as_deref().map(tracing::Span::enter)
    }

    /// After the call, once: the span's fields, the one [`Error`], the dead letter and the
    /// reconciliation of a failed mutating call.
    pub(crate) fn end<Res: HasExtensions>(
        &mut self,
        result: Result<Res, BoxError>,
    ) -> Result<Res, Error> {
        let span = self.span.as_deref();
        let e = match result {
            Ok(res) => {
                if span.is_some() || self.otel.is_some() {
                    let history = RetryHistory::of(&res);
                    let attempts = history.map_or(1, RetryHistory::sent);
                    if let Some(span) = span {
                        span.record("attempts", attempts);
                        span.record("outcome", Outcome::Completed.as_str());
                    }
                    if let Some(otel) = self.otel.take() {
                        otel.end(attempts, history, Outcome::Completed, None);
                    }
                }
                return Ok(res);
            }
            Err(e) => e,
        };
        // The retry layer's error, or (when a layer around it ended the call) one told by the
        // cause, which names the dependency.
        let err = Error::new(None, e);
        if let Some(otel) = self.otel.take() {
            let kind = err.kind().as_str();
            otel.end(err.attempts(), err.history(), err.outcome(), Some(kind));
        }
        if let Some(span) = span {
            span.record("attempts", err.attempts());
            span.record("outcome", err.outcome().as_str());
            span.record("error", err.kind().as_str());
        }
        if let Some(head) = self.letterhead.take() {
            let head = *head;
            let letter = DeadLetter::new(&err, head.run_id, head.call_id, head.key);
            if let (Some(hook), Outcome::Unknown) = (&head.reconcile, err.outcome()) {
                hook(&letter);
            }
            if let Some(sink) = &head.sink {
                let _entered = span.map(tracing::Span::enter);
                tracing::warn!(
                    target: "backstop::dead_letter",
                    dependency = ?letter.dependency,
                    run_id = ?letter.run_id,
                    outcome = letter.outcome.as_str(),
                    "a mutating call failed for good"
                );
                sink.record(letter);
            }
        }
        Err(err)
    }
}

/// The call's work of a [`BackstopLayer`](crate::BackstopLayer) as a tower `Layer` of its own
/// ([`BackstopLayer::call_layer`](crate::BackstopLayer::call_layer)), for a stack whose other
/// layers are composed by hand: once per logical call it attaches the idempotency key (so every
/// attempt the retry layer under it sends carries the same one), opens the call's span, makes
/// every end one [`Error`], and writes a failed mutating call's dead letter.
///
/// Place it outside the retry layer, as the builder does. Under a retry layer the call belongs
/// to the stack outside, and this layer stands aside (no key, span or letter of its own; the
/// error is told by its cause), as a [`BackstopService`](crate::BackstopService) nested in
/// another one does.
///
/// `I` is where the key goes, `P` the kind of request (what the call's telemetry reads of it).
///
/// ```
/// use backstop::{Backstop, retry::RetryLayer};
/// use bytes::Bytes;
/// use http_body_util::Full;
/// use std::convert::Infallible;
/// use tower::{ServiceBuilder, ServiceExt, service_fn};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), backstop::BoxError> {
/// let client = service_fn(|req: http::Request<Full<Bytes>>| async move {
///     // Every attempt carries the call's one key.
///     assert!(req.headers().contains_key("idempotency-key"));
///     Ok::<_, Infallible>(http::Response::new(Full::new(Bytes::from_static(b"ok"))))
/// });
/// let stack = Backstop::http("payments-api").honours_keys().build()?;
/// let payments = ServiceBuilder::new()
///     .layer(stack.call_layer())
///     .layer(RetryLayer::http().dependency("payments-api"))
///     .service(client);
/// let req = http::Request::post("http://payments.test/refunds").body(Full::default())?;
/// let res = payments.oneshot(req).await?;
/// assert_eq!(res.status(), 200);
/// # Ok(())
/// # }
/// ```
pub struct CallLayer<I, P> {
    work: Arc<CallWork<I>>,
    kind: PhantomData<fn() -> P>,
}

impl<I, P> CallLayer<I, P> {
    pub(crate) fn new(work: Arc<CallWork<I>>) -> Self {
        CallLayer {
            work,
            kind: PhantomData,
        }
    }
}

impl<I, P> Clone for CallLayer<I, P> {
    fn clone(&self) -> Self {
        CallLayer::new(self.work.clone())
    }
}

impl<I, P> fmt::Debug for CallLayer<I, P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("CallLayer").field(&self.work).finish()
    }
}

impl<S, I, P> Layer<S> for CallLayer<I, P> {
    type Service = CallService<S, I, P>;

    fn layer(&self, inner: S) -> Self::Service {
        CallService {
            inner,
            work: self.work.clone(),
            kind: PhantomData,
        }
    }
}

/// The service a [`CallLayer`] builds: the call's work around `S`, every error an [`Error`].
///
/// `poll_ready` answers what `S` answers, and each call is sent on the handle polled ready; a
/// call refused before it is sent (a required key missing) leaves that readiness for the next.
pub struct CallService<S, I, P> {
    inner: S,
    work: Arc<CallWork<I>>,
    kind: PhantomData<fn() -> P>,
}

impl<S: Clone, I, P> Clone for CallService<S, I, P> {
    fn clone(&self) -> Self {
        CallService {
            inner: self.inner.clone(),
            work: self.work.clone(),
            kind: PhantomData,
        }
    }
}

impl<S: fmt::Debug, I, P> fmt::Debug for CallService<S, I, P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CallService")
            .field("inner", &self.inner)
            .field("work", &self.work)
            .finish()
    }
}

impl<S, I, P, Req> Service<Req> for CallService<S, I, P>
where
    S: Service<Req, Response: HasExtensions>,
    S::Error: Into<BoxError>,
    Req: HasExtensions,
    I: Inject<Req>,
    P: Describe<Req>,
{
    type Response = S::Response;
    type Error = Error;
    type Future = CallFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Error>> {
        self.inner
            .poll_ready(cx)
            .map_err(|e| self.work.error(e.into()))
    }

    fn call(&mut self, mut req: Req) -> Self::Future {
        // A retry layer outside owns this call: its work is the stack's outside, which tells
        // this attempt's error in its own words.
        if backstop_retry::retried_outside(&req) {
            let inner = self.inner.call(req);
            return CallFuture(Calling::Passed { inner });
        }
        match self
            .work
            .begin(&mut req, <P as Describes<Req>>::grpc_method)
        {
            Ok(state) => {
                // The first attempt is sent from here: its span is the call's child.
                let inner = {
                    let _entered = state.enter();
                    self.inner.call(req)
                };
                CallFuture(Calling::Owned { inner, state })
            }
            // Nothing is sent: the ready handle stays here for the next call.
            Err(refused) => CallFuture(Calling::Refused {
                error: Some(refused),
            }),
        }
    }
}

/// Response future of [`CallService`].
#[pin_project]
pub struct CallFuture<F>(#[pin] Calling<F>);

#[pin_project(project = CallingProj)]
enum Calling<F> {
    /// This stack owns the call.
    Owned {
        #[pin]
        inner: F,
        state: CallState,
    },
    /// A stack outside owns it.
    Passed {
        #[pin]
        inner: F,
    },
    /// Refused before anything was sent (a required key missing).
    Refused { error: Option<Error> },
}

impl<F: fmt::Debug> fmt::Debug for CallFuture<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Calling::Owned { inner, .. } | Calling::Passed { inner } => {
                f.debug_tuple("CallFuture").field(inner).finish()
            }
            Calling::Refused { .. } => f.write_str("CallFuture(refused)"),
        }
    }
}

impl<F, Res, E> Future for CallFuture<F>
where
    F: Future<Output = Result<Res, E>>,
    E: Into<BoxError>,
    Res: HasExtensions,
{
    type Output = Result<Res, Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().0.project() {
            CallingProj::Owned { inner, state } => {
                let result = {
                    let _entered = state.enter();
                    ready!(inner.poll(cx))
                };
                Poll::Ready(state.end(result.map_err(Into::into)))
            }
            CallingProj::Passed { inner } => {
                Poll::Ready(ready!(inner.poll(cx)).map_err(|e| Error::new(None, e.into())))
            }
            CallingProj::Refused { error } => Poll::Ready(Err(error
                .take()
                .expect("CallFuture polled after completion"))),
        }
    }
}
