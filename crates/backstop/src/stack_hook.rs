use crate::builder::KeyGenerator;
use crate::{DeadLetter, DeadLetterSink, Error};
use backstop_core::{BoxError, Dependency, HasExtensions, Outcome, ReplaySafe};
use backstop_idempotency::{ActionContext, IdempotencyKey, IdempotencyLayer, Inject};
use backstop_retry::{CallHook, RetryHistory};
use std::{fmt, sync::Arc};

pub(crate) type Reconcile = Arc<dyn Fn(&DeadLetter) + Send + Sync>;

pub(crate) struct Shared<I> {
    pub(crate) dependency: Dependency,
    pub(crate) inject: I,
    /// Attaches idempotency keys (`None`: turned off).
    pub(crate) keys: Option<IdempotencyLayer<I, KeyGenerator>>,
    pub(crate) read_only: bool,
    pub(crate) sink: Option<Arc<dyn DeadLetterSink>>,
    pub(crate) reconcile: Option<Reconcile>,
}

/// The call-level work of the composed stack, run by the retry layer as its [`CallHook`]:
/// attaches the idempotency key (once per logical call, before the request is copied for
/// replays), keeps the call's span, marks read-only calls replay-safe, turns every error into
/// an [`Error`], and hands failed mutating calls to the dead-letter sink (and unknown outcomes
/// to the reconciliation hook).
///
/// A hook rather than a layer of its own: every layer a call goes through moves its whole
/// future once more and polls it once more.
pub(crate) struct StackHook<I> {
    shared: Arc<Shared<I>>,
}

impl<I> StackHook<I> {
    pub(crate) fn new(shared: Shared<I>) -> Self {
        StackHook {
            shared: Arc::new(shared),
        }
    }
}

impl<I> Clone for StackHook<I> {
    fn clone(&self) -> Self {
        StackHook {
            shared: self.shared.clone(),
        }
    }
}

impl<I> fmt::Debug for StackHook<I> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StackHook")
            .field("dependency", &self.shared.dependency)
            .finish()
    }
}

/// What a failed mutating call's dead letter needs, taken from the request before it is sent.
struct Letterhead {
    run_id: Option<Arc<str>>,
    call_id: Option<Arc<str>>,
    key: Option<IdempotencyKey>,
}

/// What [`StackHook`] keeps for one call: its span, and what a dead letter would need.
pub(crate) struct StackCall {
    span: tracing::Span,
    /// Boxed: only a mutating call that may need a dead letter carries it, and the future
    /// every call moves stays small.
    letterhead: Option<Box<Letterhead>>,
}

impl fmt::Debug for StackCall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StackCall")
            .field("span", &self.span)
            .field("letter", &self.letterhead.is_some())
            .finish()
    }
}

impl<I, Req, Res> CallHook<Req, Res> for StackHook<I>
where
    Req: HasExtensions,
    Res: HasExtensions,
    I: Inject<Req>,
{
    type State = StackCall;
    type Error = Error;

    fn begin(&self, req: &mut Req, _dependency: &Dependency) -> Result<StackCall, Error> {
        let sh = &*self.shared;
        if sh.read_only {
            req.extensions_mut().insert(ReplaySafe);
        }
        if let Some(keys) = &sh.keys
            && let Err(refused) = backstop_idempotency::plumbing::attach(keys, req)
        {
            let mut err = Error::from_box(Box::new(refused));
            err.set_dependency_if_missing(&sh.dependency);
            return Err(err);
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
            && sh.inject.needs_key(req);
        let mut letterhead = None;
        if wants_letter || !span.is_disabled() {
            let ext = req.extensions();
            let action = ext.get::<ActionContext>();
            let key = ext.get::<IdempotencyKey>();
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
                if let Some(k) = key {
                    span.record("idempotency_key", k.as_str());
                }
            }
            letterhead = wants_letter.then(|| {
                Box::new(Letterhead {
                    run_id: action.map(|a| Arc::from(a.run_id())),
                    call_id: action.and_then(|a| a.call_id()).map(Arc::from),
                    key: key.cloned(),
                })
            });
        }
        Ok(StackCall { span, letterhead })
    }

    fn span<'a>(&self, state: &'a StackCall) -> Option<&'a tracing::Span> {
        Some(&state.span)
    }

    fn end(&self, state: &mut StackCall, result: Result<Res, BoxError>) -> Result<Res, Error> {
        let span = &state.span;
        let e = match result {
            Ok(res) => {
                if !span.is_disabled() {
                    let attempts = RetryHistory::of(&res).map_or(1, RetryHistory::sent);
                    span.record("attempts", attempts);
                    span.record("outcome", Outcome::Completed.as_str());
                }
                return Ok(res);
            }
            Err(e) => e,
        };
        let shared = &*self.shared;
        let mut err = Error::from_box(e);
        err.set_dependency_if_missing(&shared.dependency);
        span.record("attempts", err.attempts());
        span.record("outcome", err.outcome().as_str());
        span.record("error", err.kind().as_str());
        if let Some(head) = state.letterhead.take() {
            let head = *head;
            let letter = DeadLetter::new(&err, head.run_id, head.call_id, head.key);
            if let (Some(hook), Outcome::Unknown) = (&shared.reconcile, err.outcome()) {
                hook(&letter);
            }
            if let Some(sink) = &shared.sink {
                let _entered = span.enter();
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

    fn ready_error(&self, error: BoxError) -> Error {
        let mut err = Error::from_box(error);
        err.set_dependency_if_missing(&self.shared.dependency);
        err
    }

    fn pass(&self, error: BoxError) -> Error {
        // Another Backstop stack outside owns this call: hand it the raw error, which its
        // `BoxErrors` takes out again, so one logical call makes one `Error`.
        Error::passing(error)
    }
}
