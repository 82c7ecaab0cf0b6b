//! The retry policy: asked after every attempt whether the call is attempted again, and after
//! how long. The layer drives the call (copies, waits, readiness, the one exit); the policy
//! decides, as tower's `Policy` does for its `Retry`.
//!
//! [`StandardPolicy`] is Backstop's, a composition of small parts that a policy of one's own
//! can keep, swap or drop: [`MaxAttempts`], [`ReplaySafety`], [`Waits`] (the server's
//! `Retry-After`, else the backoff), [`DeadlineFit`] and [`Budgets`] (the run's, then the
//! dependency's).

use crate::{NotCopyable, StopReason};
use backstop_backoff::{Backoff, RngSource, Schedule};
use backstop_classify::Verdict;
use backstop_core::{
    AttemptLimit, Deadline, Dependency, HasExtensions, InvalidConfig, NoBudget, Outcome,
    RetryBudget, Run, UnvouchedKey,
};
use rand::rngs::SmallRng;
use std::{error::Error, fmt, sync::Arc, time::Duration};
use tokio::time::Instant;

/// Decides, after each attempt of a call, whether the call is attempted again and after how
/// long.
///
/// A retry layer clones its policy for every call and asks the clone after each attempt, the
/// successful ones included, with the [`Attempt`]: the request as kept, the response or the
/// error, the classifier's verdict and the time left. A policy can keep state for one call in
/// `&mut self` (a backoff schedule) and share the rest through `Arc`s. [`StandardPolicy`] is
/// Backstop's; a policy of one's own can wrap it and re-judge some attempts, or compose its
/// parts differently.
///
/// A policy of one's own that retries a JSON-RPC error carried inside a successful HTTP response
/// (an MCP server's internal error, `-32603`, after a worker restart), and leaves every other
/// decision to the standard policy: the attempt cap, the backoff, the deadline and the budgets,
/// and replay safety (what the server did before it failed is unknown, so only a replay-safe
/// call, here a read-only tool's, is repeated):
///
/// ```
/// use backstop_classify::Verdict;
/// use backstop_core::{BoxError, Outcome, ReplaySafe};
/// use backstop_retry::{Attempt, Policy, RetryLayer, StandardPolicy, StopReason};
/// use std::{sync::{Arc, atomic::{AtomicU32, Ordering}}, time::Duration};
/// use tower::{Layer, ServiceExt, service_fn};
///
/// /// Retries `Ok` responses whose JSON-RPC body says the server failed internally.
/// #[derive(Clone)]
/// struct JsonRpcErrors(StandardPolicy);
///
/// impl<Req: backstop_core::HasExtensions> Policy<Req, http::Response<String>> for JsonRpcErrors {
///     fn retry(&mut self, attempt: &Attempt<'_, Req, http::Response<String>>) -> Result<Duration, StopReason> {
///         let internal = attempt.response().and_then(|res| {
///             let body: serde_json::Value = serde_json::from_str(res.body()).ok()?;
///             Some(body["error"]["code"] == -32603)
///         });
///         if internal == Some(true) {
///             // Judged as a lost reply is: retryable, its effect unknown.
///             let failed = Verdict::Retryable { outcome: Outcome::Unknown, after: None };
///             return self.0.retry(&attempt.with_verdict(failed));
///         }
///         self.0.retry(attempt)
///     }
///
///     fn may_retry(&self, request: &Req) -> bool {
///         Policy::<Req, http::Response<String>>::may_retry(&self.0, request)
///     }
/// }
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() -> Result<(), BoxError> {
/// let calls = Arc::new(AtomicU32::new(0));
/// let seen = calls.clone();
/// let mcp = service_fn(move |_req: http::Request<String>| {
///     let body = if seen.fetch_add(1, Ordering::SeqCst) == 0 {
///         r#"{"jsonrpc":"2.0","id":1,"error":{"code":-32603,"message":"worker restarted"}}"#
///     } else {
///         r#"{"jsonrpc":"2.0","id":1,"result":{"content":[]}}"#
///     };
///     async move { Ok::<_, BoxError>(http::Response::new(body.to_owned())) }
/// });
/// let svc = RetryLayer::http()
///     .dependency("tools")
///     .policy(JsonRpcErrors(StandardPolicy::new()))
///     .layer(mcp);
/// let mut req = http::Request::post("http://tools.local/mcp").body(String::from("{}"))?;
/// req.extensions_mut().insert(ReplaySafe); // a read-only tool
/// let res = svc.oneshot(req).await?;
/// assert!(res.body().contains("result"));
/// assert_eq!(calls.load(Ordering::SeqCst), 2);
/// # Ok(())
/// # }
/// ```
pub trait Policy<Req, Res>: Clone {
    /// After `attempt`: `Ok(wait)` attempts the call again once `wait` has passed, `Err(why)`
    /// ends it (a success ends with [`StopReason::Succeeded`]).
    fn retry(&mut self, attempt: &Attempt<'_, Req, Res>) -> Result<Duration, StopReason>;

    /// Whether a call of `request` may be attempted more than once: the layer keeps a copy of
    /// the request only for a call that may. `true` unless a policy says otherwise.
    fn may_retry(&self, request: &Req) -> bool {
        let _ = request;
        true
    }
}

/// What a [`Policy`] is told of an attempt that just ended.
pub struct Attempt<'a, Req, Res> {
    pub(crate) request: Option<&'a Req>,
    pub(crate) copyable: Result<(), NotCopyable>,
    pub(crate) result: Result<&'a Res, &'a (dyn Error + Send + Sync + 'static)>,
    pub(crate) verdict: Verdict,
    pub(crate) number: u32,
    pub(crate) deadline: Option<Deadline>,
    pub(crate) dependency: &'a Dependency,
    pub(crate) started: Instant,
    pub(crate) replay_safe: &'a dyn Fn(&Req) -> bool,
}

impl<Req, Res> Clone for Attempt<'_, Req, Res> {
    fn clone(&self) -> Self {
        Attempt {
            copyable: self.copyable.clone(),
            ..*self
        }
    }
}

impl<Req, Res> fmt::Debug for Attempt<'_, Req, Res> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Attempt")
            .field("dependency", &self.dependency.as_str())
            .field("number", &self.number)
            .field("verdict", &self.verdict)
            .field("left", &self.left())
            .finish_non_exhaustive()
    }
}

impl<'a, Req, Res> Attempt<'a, Req, Res> {
    /// The request as the caller sent it, when the layer kept a copy of it (every call its
    /// policy [may retry](Policy::may_retry)).
    pub fn request(&self) -> Option<&'a Req> {
        self.request
    }

    /// `Err` when the request cannot be sent again (not kept, or its body is gone).
    pub fn copyable(&self) -> Result<(), NotCopyable> {
        self.copyable.clone()
    }

    /// The attempt's response, when it answered one (`None` for an error).
    pub fn response(&self) -> Option<&'a Res> {
        self.result.ok()
    }

    /// The attempt's error, when it failed (`None` for a response): the inner service's,
    /// boxed, or the layer's own (the request could not be copied again, or the service did
    /// not get ready before the deadline). A policy finds an error type of its own in it with
    /// `downcast_ref`, or in its chain of sources.
    pub fn error(&self) -> Option<&'a (dyn Error + Send + Sync + 'static)> {
        self.result.err()
    }

    /// How the attempt was judged by the layer's classifier.
    pub fn verdict(&self) -> Verdict {
        self.verdict
    }

    /// The attempt's number: 1 for the call's first.
    pub fn number(&self) -> u32 {
        self.number
    }

    /// The dependency the call goes to.
    pub fn dependency(&self) -> &'a Dependency {
        self.dependency
    }

    /// The call's deadline, if it has one.
    pub fn deadline(&self) -> Option<Deadline> {
        self.deadline
    }

    /// The time left before the call's deadline (`None`: no deadline).
    pub fn left(&self) -> Option<Duration> {
        self.deadline.map(Deadline::remaining)
    }

    /// Whether the request is safe to send again when an attempt's outcome is unknown: a
    /// [`ReplaySafe`](backstop_core::ReplaySafe) mark, or what the layer's classifier knows
    /// (an idempotent method, an idempotency key the dependency honours).
    pub fn is_replay_safe(&self) -> bool {
        self.request.is_some_and(self.replay_safe)
    }

    /// The same attempt judged `verdict`: for a policy that re-judges an attempt and hands the
    /// rest of the decision on.
    pub fn with_verdict(&self, verdict: Verdict) -> Self {
        Attempt {
            verdict,
            ..self.clone()
        }
    }
}

/// Backstop's policy: an attempt is retried when all its parts agree, in this order.
///
/// 1. The verdict is retryable (a timeout, a reset, a 429 or 5xx; never a validation error).
/// 2. [`MaxAttempts`]: attempts are left (3 by default, lower when the request carries an
///    [`AttemptLimit`]).
/// 3. The request can be copied ([`Attempt::copyable`]).
/// 4. [`ReplaySafety`]: an attempt whose outcome is unknown is repeated only for a replay-safe
///    request.
/// 5. [`Waits`]: the server's `Retry-After`, else full jitter from 200 ms up to 5 s.
/// 6. [`DeadlineFit`]: the wait ends before the call's deadline.
/// 7. [`Budgets`]: the run's retry budget, then the dependency's, allow another retry.
///
/// `Clone` is cheap: the parts are shared, and each clone (one per call) keeps its own backoff
/// schedule.
#[derive(Clone, Debug)]
pub struct StandardPolicy {
    parts: Arc<StandardParts>,
    /// The call's backoff, made at its first wait: only a call that retries pays for it.
    schedule: Option<Box<CallWaits>>,
}

#[derive(Debug)]
struct StandardParts {
    attempts: MaxAttempts,
    waits: Waits,
    budgets: Budgets,
}

impl Default for StandardPolicy {
    fn default() -> Self {
        StandardPolicy::new()
    }
}

impl StandardPolicy {
    /// Three attempts, full jitter from 200 ms up to 5 s with entropy for its seed, and no
    /// dependency budget.
    pub fn new() -> Self {
        StandardPolicy::of(
            MaxAttempts::default(),
            Waits::default(),
            Budgets::new(Arc::new(NoBudget)),
        )
    }

    /// The policy composed of these parts.
    pub fn of(attempts: MaxAttempts, waits: Waits, budgets: Budgets) -> Self {
        StandardPolicy {
            parts: Arc::new(StandardParts {
                attempts,
                waits,
                budgets,
            }),
            schedule: None,
        }
    }

    fn with(self, change: impl FnOnce(&mut StandardParts)) -> Self {
        let parts = &*self.parts;
        let mut parts = StandardParts {
            attempts: parts.attempts,
            waits: parts.waits.clone(),
            budgets: parts.budgets.clone(),
        };
        change(&mut parts);
        StandardPolicy {
            parts: Arc::new(parts),
            schedule: None,
        }
    }

    /// The most attempts per call, the first included. Zero is rejected.
    pub fn max_attempts(self, n: u32) -> Result<Self, InvalidConfig> {
        let attempts = MaxAttempts::new(n)?;
        Ok(self.with(|p| p.attempts = attempts))
    }

    /// The backoff between attempts when the dependency gives no `Retry-After`.
    #[must_use]
    pub fn backoff(self, backoff: Backoff) -> Self {
        self.with(|p| p.waits.backoff = backoff)
    }

    /// Where the jitter comes from; seed it for reproducible tests and simulations.
    #[must_use]
    pub fn rng(self, rng: RngSource) -> Self {
        self.with(|p| p.waits.rng = rng)
    }

    /// The dependency's retry budget: paid into once per call, asked for every retry.
    #[must_use]
    pub fn budget(self, budget: Arc<dyn RetryBudget>) -> Self {
        self.with(|p| p.budgets = Budgets::new(budget))
    }
}

impl<Req: HasExtensions, Res> Policy<Req, Res> for StandardPolicy {
    fn retry(&mut self, attempt: &Attempt<'_, Req, Res>) -> Result<Duration, StopReason> {
        let parts = &*self.parts;
        if attempt.number == 1 {
            parts.budgets.deposit(attempt);
        }
        let after = match attempt.verdict {
            Verdict::Success => return Err(StopReason::Succeeded),
            Verdict::Fatal { .. } => return Err(StopReason::NotRetryable),
            Verdict::Retryable { after, .. } => after,
        };
        parts.attempts.check(attempt)?;
        attempt.copyable().map_err(StopReason::NotCopyable)?;
        ReplaySafety.check(attempt)?;
        let wait = match after {
            Some(after) => after,
            None => self
                .schedule
                .get_or_insert_with(|| Box::new(parts.waits.for_call()))
                .next_wait(),
        };
        DeadlineFit.check(attempt, wait)?;
        parts.budgets.withdraw(attempt)?;
        Ok(wait)
    }

    fn may_retry(&self, _request: &Req) -> bool {
        self.parts.attempts.0 > 1
    }
}

/// The most attempts per call, the first included; a request's own [`AttemptLimit`] lowers
/// it (a destructive tool: one attempt).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MaxAttempts(u32);

impl Default for MaxAttempts {
    /// [`DEFAULT_MAX_ATTEMPTS`](crate::DEFAULT_MAX_ATTEMPTS): one call and two retries.
    fn default() -> Self {
        MaxAttempts(crate::DEFAULT_MAX_ATTEMPTS)
    }
}

impl MaxAttempts {
    /// At most `n` attempts; zero is rejected (a call is always attempted once).
    pub fn new(n: u32) -> Result<Self, InvalidConfig> {
        if n == 0 {
            return Err(InvalidConfig::new(
                "max_attempts must be at least 1 (the first attempt counts)",
            ));
        }
        Ok(MaxAttempts(n))
    }

    /// `Err` when `attempt` was the last one allowed.
    pub fn check<Req: HasExtensions, Res>(
        self,
        attempt: &Attempt<'_, Req, Res>,
    ) -> Result<(), StopReason> {
        let max_attempts = match attempt.request.and_then(AttemptLimit::of) {
            Some(limit) => limit.min(self.0),
            None => self.0,
        };
        if attempt.number >= max_attempts {
            return Err(StopReason::AttemptsExhausted { max_attempts });
        }
        Ok(())
    }
}

/// An attempt whose side effect is unknown (a timeout, a lost reply) is repeated only for a
/// replay-safe request: a timeout means *unknown*, not *failed*.
#[derive(Clone, Copy, Debug, Default)]
pub struct ReplaySafety;

impl ReplaySafety {
    /// `Err` when repeating `attempt` could do its effect twice.
    pub fn check<Req: HasExtensions, Res>(
        self,
        attempt: &Attempt<'_, Req, Res>,
    ) -> Result<(), StopReason> {
        if attempt.verdict.outcome() != Outcome::Unknown || attempt.is_replay_safe() {
            return Ok(());
        }
        Err(match attempt.request {
            Some(req) if UnvouchedKey::is_marked(req) => StopReason::KeyNotVouched,
            _ => StopReason::NotReplaySafe,
        })
    }
}

/// The wait before a retry: the server's `Retry-After` when it gave one (in the verdict), else
/// the backoff's next delay, drawn from the random source.
#[derive(Clone, Debug, Default)]
pub struct Waits {
    backoff: Backoff,
    rng: RngSource,
}

impl Waits {
    /// Waits drawn from `backoff` with `rng`.
    pub fn new(backoff: Backoff, rng: RngSource) -> Self {
        Waits { backoff, rng }
    }

    /// One call's waits: a schedule of its own, and a random stream of its own.
    pub fn for_call(&self) -> CallWaits {
        CallWaits(self.backoff.schedule(), self.rng.rng())
    }
}

/// One call's backoff schedule and random stream, from [`Waits::for_call`].
#[derive(Clone, Debug)]
pub struct CallWaits(Schedule, SmallRng);

impl CallWaits {
    /// The wait before the next retry.
    pub fn next_wait(&mut self) -> Duration {
        self.0.next_delay(&mut self.1)
    }
}

/// A retry is made only if its wait ends before the call's deadline: a wait that would cross
/// it could only end in `DeadlineExceeded`.
#[derive(Clone, Copy, Debug, Default)]
pub struct DeadlineFit;

impl DeadlineFit {
    /// `Err` when `wait` ends at or after `attempt`'s deadline.
    pub fn check<Req, Res>(
        self,
        attempt: &Attempt<'_, Req, Res>,
        wait: Duration,
    ) -> Result<(), StopReason> {
        match attempt.left() {
            Some(left) if wait >= left => Err(StopReason::DeadlineTooClose { wait, left }),
            _ => Ok(()),
        }
    }
}

/// The retry budgets: the run's (a [`Run`] on the request) first, whose refusal takes nothing
/// from the dependency's, then the dependency's; a retry the dependency refuses goes back to
/// the run.
#[derive(Clone, Debug)]
pub struct Budgets(Arc<dyn RetryBudget>);

impl Budgets {
    /// The run's budget, and `dependency`'s.
    pub fn new(dependency: Arc<dyn RetryBudget>) -> Self {
        Budgets(dependency)
    }

    /// Pays in for `attempt`'s call, once (at its first attempt).
    pub fn deposit<Req, Res>(&self, attempt: &Attempt<'_, Req, Res>) {
        self.0.deposit(attempt.dependency, attempt.started);
    }

    /// Takes one retry for `attempt`'s call, or says which budget refused it.
    pub fn withdraw<Req: HasExtensions, Res>(
        &self,
        attempt: &Attempt<'_, Req, Res>,
    ) -> Result<(), StopReason> {
        let dependency = attempt.dependency;
        let run = attempt.request.and_then(Run::of);
        if let Some(run) = run
            && !run.take_retry(dependency)
        {
            return Err(StopReason::RunBudgetExhausted {
                retries: run.budget().unwrap_or(0),
            });
        }
        if !self.0.withdraw(dependency) {
            if let Some(run) = run {
                run.give_back(dependency);
            }
            return Err(StopReason::BudgetExhausted);
        }
        Ok(())
    }
}
