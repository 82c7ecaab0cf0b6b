//! The journal through the stack: a call carrying an `ActionContext` is journaled without the
//! caller writing journal code.

use crate::{
    JournalError,
    journal::Journal,
    model::{NewStep, StepId},
    runner::{CallResult, ToSend},
};
use backstop_core::{Dependency, HasExtensions, Outcome, ReportsOutcome};
use backstop_idempotency::ActionContext;
use std::{
    fmt,
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
};
use tower_layer::Layer;
use tower_service::Service;

/// What a journaled call's arguments are: the bytes digested into its step's identity
/// ([`Step::args_digest`](crate::Step::args_digest)), so that a different call made under a
/// recorded step's ids is refused before it is sent.
pub trait CallArgs<Req> {
    /// The call's arguments.
    fn call_args(&self, req: &Req) -> Vec<u8>;
}

/// The arguments a caller states for a call, in the request's extensions next to its
/// `ActionContext`: a tool call's JSON arguments, a body's bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepArgs(Arc<[u8]>);

impl StepArgs {
    /// The arguments `args`.
    pub fn new(args: impl AsRef<[u8]>) -> Self {
        StepArgs(Arc::from(args.as_ref()))
    }

    /// The bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

/// The default for HTTP: the request's [`StepArgs`] when it carries them, and always its method
/// and URI (the body is the caller's to state: it is not read here).
#[derive(Clone, Copy, Debug, Default)]
pub struct RequestLine;

impl<B> CallArgs<http::Request<B>> for RequestLine {
    fn call_args(&self, req: &http::Request<B>) -> Vec<u8> {
        let mut args = format!("{} {}", req.method(), req.uri()).into_bytes();
        if let Some(stated) = req.extensions().get::<StepArgs>() {
            args.push(b'\n');
            args.extend_from_slice(stated.as_bytes());
        }
        args
    }
}

/// For any kind of request: its [`StepArgs`], or none.
#[derive(Clone, Copy, Debug, Default)]
pub struct StatedArgs;

impl<Req: HasExtensions> CallArgs<Req> for StatedArgs {
    fn call_args(&self, req: &Req) -> Vec<u8> {
        req.extensions()
            .get::<StepArgs>()
            .map(|a| a.as_bytes().to_vec())
            .unwrap_or_default()
    }
}

impl<Req, F> CallArgs<Req> for F
where
    F: Fn(&Req) -> Vec<u8>,
{
    fn call_args(&self, req: &Req) -> Vec<u8> {
        self(req)
    }
}

/// Judges how a call ended, for the journal.
pub trait Judge<T, E> {
    /// The call's end, as the journal records it.
    fn judge(&self, result: &Result<T, E>) -> CallResult;
}

/// The default judge: success is `Ok`, and an error reports its own outcome (every Backstop
/// error does, [`ReportsOutcome`]). Stores no result.
#[derive(Clone, Copy, Debug, Default)]
pub struct ByOutcome;

impl<T, E: ReportsOutcome + fmt::Display> Judge<T, E> for ByOutcome {
    fn judge(&self, result: &Result<T, E>) -> CallResult {
        CallResult::from_result(result, |_| None)
    }
}

impl<T, E, F> Judge<T, E> for F
where
    F: Fn(&Result<T, E>) -> CallResult,
{
    fn judge(&self, result: &Result<T, E>) -> CallResult {
        self(result)
    }
}

/// How a journaled call failed: the journal refused it (or could not write), or the call did.
#[derive(Debug)]
pub enum JournaledError<E> {
    /// The journal refused the call or could not record it: nothing was sent (a step already
    /// done, parked, or unknown and not yet reconciled; or the database failed before `sent`
    /// was written).
    Journal(JournalError),
    /// The call itself failed, with the stack's own error (a `backstop::Error`).
    Call(E),
}

impl<E> JournaledError<E> {
    /// The journal's refusal, if it was one.
    pub fn journal(&self) -> Option<&JournalError> {
        match self {
            JournaledError::Journal(e) => Some(e),
            JournaledError::Call(_) => None,
        }
    }

    /// The call's own error, if it was one.
    pub fn call(&self) -> Option<&E> {
        match self {
            JournaledError::Call(e) => Some(e),
            JournaledError::Journal(_) => None,
        }
    }
}

impl<E: fmt::Display> fmt::Display for JournaledError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            JournaledError::Journal(e) => e.fmt(f),
            JournaledError::Call(e) => e.fmt(f),
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for JournaledError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            JournaledError::Journal(e) => Some(e),
            JournaledError::Call(e) => Some(e),
        }
    }
}

impl<E: ReportsOutcome> ReportsOutcome for JournaledError<E> {
    fn outcome(&self) -> Outcome {
        match self {
            // Done before: it happened, and it was not sent again.
            JournaledError::Journal(JournalError::AlreadyDone(_)) => Outcome::Completed,
            JournaledError::Journal(JournalError::NeedsReconciliation(_)) => Outcome::Unknown,
            // Refused before anything was sent.
            JournaledError::Journal(_) => Outcome::NotSent,
            JournaledError::Call(e) => e.outcome(),
        }
    }

    fn retry_after(&self) -> Option<std::time::Duration> {
        match self {
            JournaledError::Call(e) => e.retry_after(),
            JournaledError::Journal(_) => None,
        }
    }
}

/// Journals every call that carries an [`ActionContext::ToolCall`] (run, step and call ids):
/// `pending` and then `sent` are written before the call goes on, how it ended after. Place it
/// outside the Backstop stack, so that one logical call (all its attempts) is one journaled
/// step. A step already over is not sent again ([`JournalError::AlreadyDone`]); one whose
/// outcome is unknown is refused until it is reconciled; a parked one until its time. A call
/// without a tool-call context passes through unjournaled.
///
/// The step's key is the one the idempotency layer derives from the same ids, so a resumed
/// run sends the key the crashed one did. The call's arguments ([`CallArgs`]; for HTTP its
/// method, URI and any [`StepArgs`]) are part of the step's identity: a different call under a
/// recorded step's ids is refused ([`JournalError::ArgsChanged`]) and not sent.
#[derive(Clone)]
pub struct JournalLayer<J = ByOutcome, A = RequestLine> {
    journal: Journal,
    tool: Option<Arc<str>>,
    judge: J,
    args: A,
}

impl fmt::Debug for JournalLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JournalLayer")
            .field("journal", &self.journal)
            .field("tool", &self.tool)
            .finish_non_exhaustive()
    }
}

impl JournalLayer {
    /// Journals into `journal`; the tool is the request's dependency unless [`tool`](Self::tool)
    /// names it.
    pub fn new(journal: Journal) -> Self {
        JournalLayer {
            journal,
            tool: None,
            judge: ByOutcome,
            args: RequestLine,
        }
    }
}

impl<J, A> JournalLayer<J, A> {
    /// Names the tool the steps call.
    #[must_use]
    pub fn tool(mut self, tool: &str) -> Self {
        self.tool = Some(Arc::from(tool));
        self
    }

    /// Judges results with `judge` (an HTTP 5xx is an `Ok` response, say; or to store the
    /// result).
    pub fn judge<J2>(self, judge: J2) -> JournalLayer<J2, A> {
        JournalLayer {
            journal: self.journal,
            tool: self.tool,
            judge,
            args: self.args,
        }
    }

    /// Reads each call's arguments with `args` ([`StatedArgs`] for requests that are not
    /// HTTP, or a function of the request).
    pub fn args<A2>(self, args: A2) -> JournalLayer<J, A2> {
        JournalLayer {
            journal: self.journal,
            tool: self.tool,
            judge: self.judge,
            args,
        }
    }
}

impl<S, J: Clone, A: Clone> Layer<S> for JournalLayer<J, A> {
    type Service = Journaled<S, J, A>;

    fn layer(&self, inner: S) -> Self::Service {
        Journaled {
            inner,
            journal: self.journal.clone(),
            tool: self.tool.clone(),
            judge: self.judge.clone(),
            args: self.args.clone(),
        }
    }
}

/// See [`JournalLayer`].
#[derive(Clone)]
pub struct Journaled<S, J = ByOutcome, A = RequestLine> {
    inner: S,
    journal: Journal,
    tool: Option<Arc<str>>,
    judge: J,
    args: A,
}

impl<S: fmt::Debug, J, A> fmt::Debug for Journaled<S, J, A> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Journaled")
            .field("inner", &self.inner)
            .field("tool", &self.tool)
            .finish_non_exhaustive()
    }
}

impl<S, Req, J, A> Service<Req> for Journaled<S, J, A>
where
    A: CallArgs<Req>,
    S: Service<Req> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Response: Send + 'static,
    S::Error: Send + 'static,
    Req: HasExtensions + Send + 'static,
    J: Judge<S::Response, S::Error> + Clone + Send + Sync + 'static,
{
    type Response = S::Response;
    type Error = JournaledError<S::Error>;
    type Future =
        Pin<Box<dyn Future<Output = Result<S::Response, JournaledError<S::Error>>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(JournaledError::Call)
    }

    fn call(&mut self, req: Req) -> Self::Future {
        // The readied service goes with the call; its clone stays for the next one.
        let clone = self.inner.clone();
        let mut ready = std::mem::replace(&mut self.inner, clone);
        let context = req.extensions().get::<ActionContext>().cloned();
        let Some(ActionContext::ToolCall {
            run_id,
            step_id,
            call_id,
        }) = context
        else {
            let fut = ready.call(req);
            return Box::pin(async move { fut.await.map_err(JournaledError::Call) });
        };
        // A journaled call reaches the service only after the journal's round trip, or never
        // (a step already done): the readiness granted goes back at once, and a clone is
        // readied when the step is sent.
        let mut inner = self.inner.clone();
        drop(ready);
        let tool = match (&self.tool, Dependency::of(&req)) {
            (Some(tool), _) => tool.to_string(),
            (None, Some(dep)) => dep.as_str().to_owned(),
            (None, None) => "tool".to_owned(),
        };
        let journal = self.journal.clone();
        let judge = self.judge.clone();
        let args = self.args.call_args(&req);
        Box::pin(async move {
            let id = StepId::new(&run_id, &step_id, &call_id);
            let new = NewStep::action(&id, &tool, &args);
            let refused = JournaledError::Journal;
            let step = match journal.to_send(&new).await.map_err(refused)? {
                ToSend::Send(step) => step,
                ToSend::Done(step) => {
                    return Err(refused(JournalError::AlreadyDone(Box::new(step))));
                }
                ToSend::Parked(step) => return Err(refused(JournalError::Parked(Box::new(step)))),
            };
            if let Err(e) = std::future::poll_fn(|cx| inner.poll_ready(cx)).await {
                // Not sent: the step may be sent again.
                let not_sent = CallResult::Failed {
                    outcome: Outcome::NotSent,
                    error: "the service failed before the call was sent".into(),
                    retry_after: None,
                };
                if let Err(e) = journal.record(&step.id, not_sent).await {
                    tracing::warn!(
                        target: "backstop::journal",
                        step = %step.id,
                        error = %backstop_core::plumbing::CauseChain(&e),
                        "a call not sent could not be journaled as such"
                    );
                }
                return Err(JournaledError::Call(e));
            }
            let result = inner.call(req).await;
            if let Err(e) = journal.record(&step.id, judge.judge(&result)).await {
                // The call's result is real and goes back; the step stays `sent`, which a
                // resume reconciles.
                tracing::warn!(
                    target: "backstop::journal",
                    step = %step.id,
                    error = %backstop_core::plumbing::CauseChain(&e),
                    "the call's end could not be journaled"
                );
            }
            result.map_err(JournaledError::Call)
        })
    }
}
