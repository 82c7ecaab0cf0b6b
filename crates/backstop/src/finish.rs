use crate::Generator;
use crate::{DeadLetter, DeadLetterSink, Error};
use backstop_core::{BoxError, Dependency, HasExtensions, Outcome, ReplaySafe};
use backstop_idempotency::{ActionContext, IdempotencyKey, IdempotencyLayer, Inject};
use backstop_retry::RetryHistory;
use pin_project::pin_project;
use std::{
    fmt,
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll, ready},
};
use tower_layer::Layer;
use tower_service::Service;

pub(crate) type Reconcile = Arc<dyn Fn(&DeadLetter) + Send + Sync>;

pub(crate) struct Shared<I> {
    pub(crate) dependency: Dependency,
    pub(crate) inject: I,
    /// Attaches idempotency keys (`None`: turned off).
    pub(crate) keys: Option<IdempotencyLayer<I, Generator>>,
    pub(crate) read_only: bool,
    pub(crate) sink: Option<Arc<dyn DeadLetterSink>>,
    pub(crate) reconcile: Option<Reconcile>,
}

/// The call-level layer of the composed stack: attaches the idempotency key (once per logical
/// call, before the retry layer), opens the call's span, marks read-only calls replay-safe, turns
/// every error into an [`Error`], and hands failed mutating calls to the dead-letter sink (and
/// unknown outcomes to the reconciliation hook).
///
/// One layer rather than four, because every layer a call goes through moves its whole future
/// once more.
pub struct FinishLayer<I> {
    shared: Arc<Shared<I>>,
}

impl<I> FinishLayer<I> {
    pub(crate) fn new(shared: Shared<I>) -> Self {
        FinishLayer {
            shared: Arc::new(shared),
        }
    }
}

impl<I> Clone for FinishLayer<I> {
    fn clone(&self) -> Self {
        FinishLayer {
            shared: self.shared.clone(),
        }
    }
}

impl<I> fmt::Debug for FinishLayer<I> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FinishLayer")
            .field("dependency", &self.shared.dependency)
            .finish()
    }
}

impl<S, I> Layer<S> for FinishLayer<I> {
    type Service = Finish<S, I>;
    fn layer(&self, inner: S) -> Self::Service {
        Finish {
            inner,
            shared: self.shared.clone(),
        }
    }
}

/// See [`FinishLayer`].
pub struct Finish<S, I> {
    inner: S,
    shared: Arc<Shared<I>>,
}

impl<S: Clone, I> Clone for Finish<S, I> {
    fn clone(&self) -> Self {
        Finish {
            inner: self.inner.clone(),
            shared: self.shared.clone(),
        }
    }
}

impl<S: fmt::Debug, I> fmt::Debug for Finish<S, I> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Finish")
            .field("inner", &self.inner)
            .finish()
    }
}

/// What a failed mutating call's dead letter needs, taken from the request before it is sent.
struct Letterhead {
    run_id: Option<Arc<str>>,
    call_id: Option<Arc<str>>,
    key: Option<IdempotencyKey>,
}

impl<S, I, Req> Service<Req> for Finish<S, I>
where
    S: Service<Req>,
    S::Error: Into<BoxError>,
    S::Response: HasExtensions,
    Req: HasExtensions,
    I: Inject<Req>,
{
    type Response = S::Response;
    type Error = Error;
    type Future = FinishFuture<S::Future, I>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Error>> {
        self.inner
            .poll_ready(cx)
            .map_err(|e| Error::from_box(e.into()))
    }

    fn call(&mut self, mut req: Req) -> Self::Future {
        let sh = &self.shared;
        if sh.read_only {
            req.extensions_mut().insert(ReplaySafe);
        }
        if let Some(keys) = &sh.keys {
            if let Err(refused) = keys.attach(&mut req) {
                let mut err = Error::from_box(Box::new(refused));
                err.set_dependency_if_missing(&sh.dependency);
                return FinishFuture {
                    state: State::Refused { error: Some(err) },
                };
            }
        }
        let span = tracing::info_span!(
            target: "backstop::call",
            "call",
            dependency = %sh.dependency,
            run_id = tracing::field::Empty,
            tool_call_id = tracing::field::Empty,
            idempotency_key = tracing::field::Empty,
            attempts = tracing::field::Empty,
            outcome = tracing::field::Empty,
            error = tracing::field::Empty,
        );
        // The request's labels are looked up only when something will use them: a span that
        // is being recorded, or a dead letter a failed mutating call may need.
        let wants_letter = (sh.sink.is_some() || sh.reconcile.is_some())
            && !sh.read_only
            && sh.inject.needs_key(&req);
        let mut letterhead = None;
        if wants_letter || !span.is_disabled() {
            let ext = req.extensions();
            let action = ext.get::<ActionContext>();
            let key = ext.get::<IdempotencyKey>();
            if !span.is_disabled() {
                if let Some(a) = action {
                    span.record("run_id", a.run_id());
                    if let Some(c) = a.call_id() {
                        span.record("tool_call_id", c);
                    }
                }
                if let Some(k) = key {
                    span.record("idempotency_key", k.as_str());
                }
            }
            // Boxed: only a mutating call that may need a dead letter carries it, and the
            // future every call moves stays small.
            letterhead = wants_letter.then(|| {
                Box::new(Letterhead {
                    run_id: action.map(|a| Arc::from(a.run_id())),
                    call_id: action.and_then(|a| a.call_id()).map(Arc::from),
                    key: key.cloned(),
                })
            });
        }
        let fut = {
            let _entered = span.enter();
            self.inner.call(req)
        };
        FinishFuture {
            state: State::Running {
                fut,
                span,
                letterhead,
                shared: self.shared.clone(),
            },
        }
    }
}

/// Response future of [`Finish`].
#[pin_project]
pub struct FinishFuture<F, I> {
    #[pin]
    state: State<F, I>,
}

#[pin_project(project = StateProj)]
enum State<F, I> {
    Running {
        #[pin]
        fut: F,
        span: tracing::Span,
        letterhead: Option<Box<Letterhead>>,
        shared: Arc<Shared<I>>,
    },
    Refused {
        error: Option<Error>,
    },
}

impl<F, I> fmt::Debug for FinishFuture<F, I> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FinishFuture").finish_non_exhaustive()
    }
}

impl<F, I, T, E> Future for FinishFuture<F, I>
where
    F: Future<Output = Result<T, E>>,
    E: Into<BoxError>,
    T: HasExtensions,
{
    type Output = Result<T, Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = match self.project().state.project() {
            StateProj::Refused { error } => {
                return Poll::Ready(Err(error
                    .take()
                    .expect("FinishFuture polled after completion")));
            }
            StateProj::Running {
                fut,
                span,
                letterhead,
                shared,
            } => Running {
                fut,
                span,
                letterhead,
                shared,
            },
        };
        let result = {
            let _entered = this.span.enter();
            ready!(this.fut.poll(cx))
        };
        match result {
            Ok(res) => {
                if !this.span.is_disabled() {
                    let attempts = RetryHistory::of(&res).map_or(1, |h| h.attempts.len());
                    this.span.record("attempts", attempts);
                    this.span.record("outcome", Outcome::Completed.as_str());
                }
                Poll::Ready(Ok(res))
            }
            Err(e) => {
                let mut err = Error::from_box(e.into());
                err.set_dependency_if_missing(&this.shared.dependency);
                this.span.record("attempts", err.attempts());
                this.span.record("outcome", err.outcome().as_str());
                this.span.record("error", err.kind().as_str());
                if let Some(head) = this.letterhead.take() {
                    let head = *head;
                    let letter = DeadLetter::new(&err, head.run_id, head.call_id, head.key);
                    if let (Some(hook), Outcome::Unknown) = (&this.shared.reconcile, err.outcome())
                    {
                        hook(&letter);
                    }
                    if let Some(sink) = &this.shared.sink {
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
                Poll::Ready(Err(err))
            }
        }
    }
}

/// The running state's fields, borrowed.
struct Running<'a, F, I> {
    fut: Pin<&'a mut F>,
    span: &'a mut tracing::Span,
    letterhead: &'a mut Option<Box<Letterhead>>,
    shared: &'a mut Arc<Shared<I>>,
}
