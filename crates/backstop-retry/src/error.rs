//! The one error a call ends in: [`Error`], its [`ErrorKind`], and the words it is told in.

use crate::{RetryHistory, StopReason};
use backstop_classify::Verdict;
use backstop_core::ReportsOutcome;
use backstop_core::plumbing::{CauseChain, DeadlineWords, HumanDuration};
use backstop_core::{
    AttemptTimedOut, BoxError, CircuitOpen, CircuitState, DeadlineExceeded, Dependency,
    InvalidConfig, Outcome, OverQuota, ReplyLost, RunSpent, Throttled,
};
use std::{error::Error as StdError, fmt, time::Duration};

/// The one error a call through Backstop ends in: made by the retry layer when it stops, and
/// by the layers around it when they refuse a call (the composed stack's `backstop::Error` is
/// this type).
///
/// Its `Display` is written for an agent's model to act on as it is: what happened, to which
/// dependency, the attempts and the time spent, the last cause, what is known about the side
/// effect and what to do next ("do not retry now; tell the user", "check its status before
/// repeating it"). The accessors say the same to code; `source()` is the last cause.
///
/// ```
/// use backstop_core::{BoxError, Outcome};
/// use backstop_retry::{ErrorKind, RetryLayer};
/// use http_body_util::Full;
/// use tower::{Layer, ServiceExt, service_fn};
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() -> Result<(), BoxError> {
/// // Nobody listens: every attempt is refused before anything is sent.
/// let refused = service_fn(|_req: http::Request<Full<bytes::Bytes>>| async {
///     Err::<http::Response<()>, _>(std::io::Error::from(std::io::ErrorKind::ConnectionRefused))
/// });
/// let rates = RetryLayer::http().dependency("rates-api").layer(refused);
/// let err = rates.oneshot(http::Request::get("http://rates.local/q").body(Full::default())?).await.unwrap_err();
/// assert_eq!(err.outcome(), Outcome::NotSent); // it did not happen: safe to try again later
/// assert_eq!((err.kind(), err.attempts()), (ErrorKind::Failed, 3));
/// assert!(err.to_string().starts_with("the call to rates-api failed (3 attempts"), "{err}");
/// assert!(err.is_retryable_later());
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct Error {
    kind: ErrorKind,
    dependency: Option<Dependency>,
    outcome: Outcome,
    retry_after: Option<Duration>,
    attempts: u32,
    elapsed: Duration,
    circuit: Option<CircuitState>,
    /// The deadline's length, when it was the deadline that ended the call.
    deadline: Option<Duration>,
    /// What the retry layer did, when it was the retry layer that ended the call.
    history: Option<Box<RetryHistory>>,
    cause: BoxError,
}

impl Error {
    /// The error of a call to `dependency` (when known) that `cause` ended before or around
    /// the retry layer's attempts: a layer around it refused the call, or the service was not
    /// ready. It is told from what Backstop's errors in the cause chain say (an open circuit,
    /// a deadline, a timeout); a cause that is already an `Error` is returned as it is (named
    /// after `dependency` if it named none).
    pub fn new(dependency: Option<&Dependency>, cause: impl Into<BoxError>) -> Error {
        let cause = match cause.into().downcast::<Error>() {
            Ok(mut made) => {
                if made.dependency.is_none() {
                    made.dependency = dependency.cloned();
                }
                return *made;
            }
            Err(cause) => cause,
        };
        let d = Diagnosis::of(&*cause);
        let kind = d.kind.unwrap_or(ErrorKind::Failed);
        let outcome = d.outcome.unwrap_or(Outcome::Unknown);
        Error {
            kind,
            dependency: d.dependency.or_else(|| dependency.cloned()),
            outcome,
            retry_after: d.retry_in,
            // A refusal before sending is no attempt.
            attempts: u32::from(outcome != Outcome::NotSent || kind == ErrorKind::Failed),
            // A deadline that passed before any attempt took its whole length.
            elapsed: match kind {
                ErrorKind::DeadlineExceeded => d.deadline.unwrap_or_default(),
                _ => Duration::ZERO,
            },
            circuit: d.circuit,
            deadline: d.deadline,
            history: None,
            cause,
        }
    }

    /// The call the retry layer ended with `history`, its last attempt judged `verdict` and
    /// failed with `cause`. A nested stack's error (one attempt of this call, made inside it)
    /// is told by its own cause: one call, one voice.
    pub(crate) fn ended(history: RetryHistory, verdict: Verdict, cause: BoxError) -> Error {
        let cause = match cause.downcast::<Error>() {
            Ok(nested) if nested.history.is_none() => nested.cause,
            Ok(whole) => whole,
            Err(cause) => cause,
        };
        let d = Diagnosis::of(&*cause);
        let kind = match history.stopped {
            StopReason::BudgetExhausted | StopReason::RunBudgetExhausted { .. } => {
                ErrorKind::BudgetExhausted
            }
            StopReason::DeadlineTooClose { .. } => ErrorKind::DeadlineExceeded,
            StopReason::NotReplaySafe | StopReason::KeyNotVouched => ErrorKind::NotRetried,
            _ => d.kind.unwrap_or(ErrorKind::Failed),
        };
        // Unknown if any attempt's effect was, else that of the last attempt.
        let unknown = history
            .attempts
            .iter()
            .any(|a| a.verdict.outcome() == Outcome::Unknown);
        Error {
            kind,
            dependency: Some(history.dependency.clone()),
            outcome: if unknown {
                Outcome::Unknown
            } else {
                verdict.outcome()
            },
            retry_after: d.retry_in.or(verdict.retry_after()),
            attempts: history.sent(),
            elapsed: history.elapsed,
            circuit: d.circuit,
            deadline: history.deadline.or(d.deadline),
            history: Some(Box::new(history)),
            cause,
        }
    }

    /// The kind of failure.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// What is known about the side effect of the call: not sent (nothing happened), unknown
    /// (it may have happened: some attempt's effect is unknown), completed (the dependency
    /// answered).
    pub fn outcome(&self) -> Outcome {
        self.outcome
    }

    /// The dependency, when known.
    pub fn dependency(&self) -> Option<&Dependency> {
        self.dependency.as_ref()
    }

    /// How long to wait before trying again, when the dependency or the breaker said.
    pub fn retry_after(&self) -> Option<Duration> {
        self.retry_after
    }

    /// How many attempts were sent (handed to the dependency's service): an attempt the
    /// breaker or the throttle refused, or one the deadline stopped before it started, does
    /// not count.
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// Time from the call to its end.
    pub fn elapsed(&self) -> Duration {
        self.elapsed
    }

    /// How long the call's deadline was, when it was the deadline that ended the call and its
    /// length is known.
    pub fn deadline(&self) -> Option<Duration> {
        self.deadline
    }

    /// Every attempt of the call, how each ended and why no further one was made, when the
    /// retry layer ended the call (a call refused around it, such as one missing a required
    /// idempotency key, has none).
    pub fn history(&self) -> Option<&RetryHistory> {
        self.history.as_deref()
    }

    /// Whether the same call may safely be tried again later: nothing happened (the side
    /// effect is *not sent*) and the failure was not a misconfiguration. An unknown outcome is
    /// never retryable later without checking first.
    pub fn is_retryable_later(&self) -> bool {
        self.outcome == Outcome::NotSent && self.kind != ErrorKind::Misconfigured
    }

    /// What the caller, or an agent's model, should do next, in a sentence.
    pub fn next_action(&self) -> String {
        let dependency = self
            .dependency
            .as_ref()
            .map_or_else(|| "the dependency".to_owned(), |d| d.to_string());
        match (self.kind, self.outcome) {
            (ErrorKind::Misconfigured, _) => {
                "the request or the stack is misconfigured: fix it before calling again".to_owned()
            }
            (ErrorKind::BudgetExhausted, _) if self.run_budget().is_some() => format!(
                "this run has used all of its retries ({dependency} kept failing): do not retry; \
                 finish without this tool, or tell the user"
            ),
            (ErrorKind::OverQuota, _) if in_chain::<RunSpent>(&*self.cause) => {
                "this run has spent what it may: do not retry; finish without this call, or tell \
                 the user"
                    .to_owned()
            }
            (ErrorKind::OverQuota, _) => match self.retry_after {
                Some(after) => format!(
                    "{dependency}'s quota is used up: try again in {}, or do less",
                    HumanDuration::rounded_up(after)
                ),
                None => format!(
                    "the request is larger than {dependency}'s whole quota: make it smaller"
                ),
            },
            (ErrorKind::Throttled, _) => format!(
                "{dependency} is overloaded and this client is shedding its calls: do not retry \
                 now; try again later, or tell the user"
            ),
            (ErrorKind::Unavailable | ErrorKind::BudgetExhausted, _) => match self.retry_after {
                Some(after) => format!(
                    "{dependency} is unavailable: do not retry now; try again in {}, or tell the user",
                    HumanDuration::rounded_up(after)
                ),
                None => format!("{dependency} is unavailable: do not retry now; tell the user"),
            },
            (_, Outcome::Unknown) => format!(
                "it may or may not have happened at {dependency}: check its status (by its idempotency key) before repeating it"
            ),
            (_, Outcome::NotSent) => {
                format!("it did not reach {dependency}: it is safe to try again later")
            }
            (_, Outcome::Completed) => format!(
                "{dependency} answered: read its answer; change the request, or tell the user"
            ),
        }
    }

    /// This error as an MCP tool result (a `CallToolResult` with `isError: true`), for an agent
    /// runtime to hand back to its model: the text is the error's own words, and
    /// `structuredContent` says the same to code: the outcome (`not_sent`, `unknown`,
    /// `completed`), whether repeating is safe, when to try again, the idempotency key (the
    /// caller's, when it has one) and the next action. Feature `json`.
    ///
    /// ```
    /// use backstop_core::BoxError;
    /// use backstop_retry::RetryLayer;
    /// use http_body_util::Full;
    /// use tower::{Layer, ServiceExt, service_fn};
    ///
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)]
    /// # async fn main() -> Result<(), BoxError> {
    /// let billing = RetryLayer::http().dependency("billing-api").layer(service_fn(
    ///     |_req: http::Request<Full<bytes::Bytes>>| async {
    ///         Err::<http::Response<()>, _>(std::io::Error::from(std::io::ErrorKind::ConnectionRefused))
    ///     },
    /// ));
    /// let req = http::Request::post("http://billing.local/refunds").body(Full::default())?;
    /// let err = billing.oneshot(req).await.unwrap_err();
    /// let result = err.to_tool_result(Some("refund-ORD-4812"));
    /// assert_eq!(result["isError"], true);
    /// assert_eq!(result["content"][0]["text"], err.to_string());
    /// let s = &result["structuredContent"];
    /// assert_eq!((s["outcome"].as_str(), s["safe_to_repeat"].as_bool()), (Some("not_sent"), Some(true)));
    /// assert_eq!(s["idempotency_key"], "refund-ORD-4812");
    /// # Ok(())
    /// # }
    /// ```
    #[cfg(feature = "json")]
    pub fn to_tool_result(&self, idempotency_key: Option<&str>) -> serde_json::Value {
        serde_json::json!({
            "content": [{ "type": "text", "text": self.to_string() }],
            "isError": true,
            "structuredContent": {
                "outcome": self.outcome.as_str(),
                "kind": self.kind.as_str(),
                "dependency": self.dependency.as_ref().map(|d| d.as_str()),
                "safe_to_repeat": self.is_retryable_later(),
                "retry_after_ms": self.retry_after.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
                "attempts": self.attempts,
                "idempotency_key": idempotency_key,
                "next_action": self.next_action(),
            }
        })
    }

    /// The run's retry budget, when it was the run's budget that stopped the retries.
    fn run_budget(&self) -> Option<u32> {
        match self.history.as_deref()?.stopped {
            StopReason::RunBudgetExhausted { retries } => Some(retries),
            _ => None,
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let stopped = self.history.as_deref().map(|h| &h.stopped);
        Told {
            kind: self.kind,
            dependency: self.dependency.as_ref(),
            outcome: self.outcome,
            attempts: self.attempts,
            elapsed: self.elapsed,
            cause: &*self.cause,
            circuit: self.circuit,
            retry_after: self.retry_after,
            deadline: self.deadline,
            unvouched_key: stopped == Some(&StopReason::KeyNotVouched),
            run_budget: self.run_budget(),
            not_retried: match stopped {
                Some(StopReason::NotCopyable(why)) => Some(why.reason()),
                Some(StopReason::Policy(why)) => Some(why),
                _ => None,
            },
        }
        .fmt(f)
    }
}

impl StdError for Error {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        Some(&*self.cause)
    }
}

/// Classified by its cause: a nested stack's error is judged as the attempt's own.
impl backstop_classify::AsError for Error {
    fn as_error(&self) -> &(dyn StdError + 'static) {
        self
    }
}

impl backstop_core::ReportsOutcome for Error {
    fn outcome(&self) -> Outcome {
        self.outcome
    }

    fn retry_after(&self) -> Option<Duration> {
        self.retry_after
    }
}

/// What kind of failure a call ended in.
///
/// Code branches on the kind; the model reads the error's text, which says the same:
///
/// ```
/// use backstop_retry::ErrorKind;
///
/// fn next_step(kind: ErrorKind) -> &'static str {
///     match kind {
///         ErrorKind::Unavailable | ErrorKind::BudgetExhausted => "stop calling it for now; tell the user",
///         ErrorKind::TimedOut | ErrorKind::DeadlineExceeded => "check whether it happened before repeating it",
///         ErrorKind::NotRetried | ErrorKind::Failed => "read the answer; fix the request or give up",
///         ErrorKind::Misconfigured => "fix the stack's configuration",
///         _ => "see the error's text",
///     }
/// }
/// assert_eq!(next_step(ErrorKind::Unavailable), "stop calling it for now; tell the user");
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The dependency's circuit is open (or isolated): the call was not sent.
    Unavailable,
    /// The dependency kept failing and its retry budget is exhausted.
    BudgetExhausted,
    /// The dependency has been shedding load and the client refused the call itself, before
    /// sending it (client-side adaptive throttling).
    Throttled,
    /// The call would exceed a quota the dependency advertises, which does not come back before
    /// the deadline, or its run's spend ceiling: the client did not send it.
    OverQuota,
    /// The last attempt timed out.
    TimedOut,
    /// The call's deadline passed, or the next attempt could not start before it.
    DeadlineExceeded,
    /// The outcome is unknown and the request was not repeated, since it is not replay-safe.
    NotRetried,
    /// The call failed: attempts ran out, or the failure was not one retrying fixes.
    Failed,
    /// Backstop itself is misconfigured (for example, a required idempotency key is missing).
    Misconfigured,
}

impl ErrorKind {
    /// A short name for logs and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::Unavailable => "unavailable",
            ErrorKind::BudgetExhausted => "budget_exhausted",
            ErrorKind::Throttled => "throttled",
            ErrorKind::OverQuota => "over_quota",
            ErrorKind::TimedOut => "timed_out",
            ErrorKind::DeadlineExceeded => "deadline_exceeded",
            ErrorKind::NotRetried => "not_retried",
            ErrorKind::Failed => "failed",
            ErrorKind::Misconfigured => "misconfigured",
        }
    }
}

/// What Backstop's own errors in a cause chain say about a failure: the first of them that is
/// found, outermost first.
#[derive(Clone, Debug, Default)]
struct Diagnosis {
    /// The kind they make it (`None`: nothing of Backstop's in the chain).
    kind: Option<ErrorKind>,
    /// The outcome they know (a refusal: not sent; a timeout: unknown; a deadline: as recorded).
    outcome: Option<Outcome>,
    /// The circuit's state, for an open circuit.
    circuit: Option<CircuitState>,
    /// When the circuit lets calls through again.
    retry_in: Option<Duration>,
    /// The deadline's length, for a deadline.
    deadline: Option<Duration>,
    /// The dependency they name.
    dependency: Option<Dependency>,
}

impl Diagnosis {
    /// Walks `error`'s source chain for Backstop's own errors.
    fn of(error: &(dyn StdError + 'static)) -> Diagnosis {
        let mut next = Some(error);
        while let Some(e) = next {
            if let Some(open) = e.downcast_ref::<CircuitOpen>() {
                return Diagnosis {
                    kind: Some(ErrorKind::Unavailable),
                    outcome: Some(Outcome::NotSent),
                    circuit: Some(open.state()),
                    retry_in: open.retry_in(),
                    dependency: Some(open.dependency().clone()),
                    ..Diagnosis::default()
                };
            }
            if e.is::<RunSpent>() {
                return Diagnosis {
                    kind: Some(ErrorKind::OverQuota),
                    outcome: Some(Outcome::NotSent),
                    ..Diagnosis::default()
                };
            }
            if let Some(q) = e.downcast_ref::<OverQuota>() {
                return Diagnosis {
                    kind: Some(ErrorKind::OverQuota),
                    outcome: Some(Outcome::NotSent),
                    retry_in: q.retry_in(),
                    dependency: Some(q.dependency().clone()),
                    ..Diagnosis::default()
                };
            }
            if let Some(t) = e.downcast_ref::<Throttled>() {
                return Diagnosis {
                    kind: Some(ErrorKind::Throttled),
                    outcome: Some(Outcome::NotSent),
                    dependency: Some(t.dependency().clone()),
                    ..Diagnosis::default()
                };
            }
            if let Some(d) = e.downcast_ref::<DeadlineExceeded>() {
                return Diagnosis {
                    kind: Some(ErrorKind::DeadlineExceeded),
                    outcome: Some(d.outcome()),
                    deadline: d.length(),
                    dependency: d.dependency().cloned(),
                    ..Diagnosis::default()
                };
            }
            if let Some(t) = e.downcast_ref::<AttemptTimedOut>() {
                return Diagnosis {
                    kind: Some(ErrorKind::TimedOut),
                    outcome: Some(Outcome::Unknown),
                    dependency: t.dependency().cloned(),
                    ..Diagnosis::default()
                };
            }
            if e.is::<InvalidConfig>() {
                return Diagnosis {
                    kind: Some(ErrorKind::Misconfigured),
                    outcome: Some(Outcome::NotSent),
                    ..Diagnosis::default()
                };
            }
            // A timeout raised under the stack (tower's, tokio's, the client's).
            if backstop_classify::is_attempt_timeout(e) {
                return Diagnosis {
                    kind: Some(ErrorKind::TimedOut),
                    outcome: Some(Outcome::Unknown),
                    ..Diagnosis::default()
                };
            }
            next = e.source();
        }
        Diagnosis::default()
    }
}

/// Everything the text of a failed call says.
#[derive(Clone, Copy, Debug)]
struct Told<'a> {
    /// The kind of failure.
    kind: ErrorKind,
    /// The dependency (`None`: "the dependency").
    dependency: Option<&'a Dependency>,
    /// What is known of the side effect.
    outcome: Outcome,
    /// Attempts sent.
    attempts: u32,
    /// Time from the call to its end.
    elapsed: Duration,
    /// The last cause, told down to the part that says what went wrong on the wire.
    cause: &'a (dyn StdError + 'static),
    /// The circuit's state, for [`ErrorKind::Unavailable`].
    circuit: Option<CircuitState>,
    /// When to try again, when someone said.
    retry_after: Option<Duration>,
    /// The deadline's length, for [`ErrorKind::DeadlineExceeded`].
    deadline: Option<Duration>,
    /// For [`ErrorKind::NotRetried`]: the request had a key the stack attached itself, which
    /// nobody vouched the dependency honours.
    unvouched_key: bool,
    /// For [`ErrorKind::BudgetExhausted`]: the run's budget (of this many retries) refused the
    /// retry, not the dependency's.
    run_budget: Option<u32>,
    /// For [`ErrorKind::Failed`]: why the request was not sent again, when that was what stopped
    /// the retries (it could not be copied, or the policy said why).
    not_retried: Option<&'a str>,
}

struct Tries(u32, Duration);

impl fmt::Display for Tries {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} attempt{} in {}",
            self.0,
            if self.0 == 1 { "" } else { "s" },
            HumanDuration(self.1)
        )
    }
}

impl fmt::Display for Told<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let dep = self
            .dependency
            .map_or_else(|| "the dependency".to_owned(), |d| d.to_string());
        let tries = Tries(self.attempts, self.elapsed);
        let cause = CauseChain(self.cause);
        let guidance = self.outcome.guidance();
        match self.kind {
            ErrorKind::Unavailable => {
                let state = match self.circuit {
                    Some(CircuitState::Isolated) => "circuit isolated by an operator",
                    Some(CircuitState::HalfOpen) => {
                        "circuit half-open, a trial call is in progress"
                    }
                    _ => "circuit open",
                };
                write!(f, "{dep} is unavailable ({state}); do not retry now")?;
                if let Some(t) = self.retry_after.filter(|t| *t >= Duration::from_secs(1)) {
                    write!(
                        f,
                        "; it can be tried again in {}",
                        HumanDuration::rounded_up(t)
                    )?;
                }
                // The side effect in the outcome's words: a circuit that opened during the
                // call may follow an attempt whose effect is unknown.
                write!(f, "; {guidance}; tell the user")
            }
            ErrorKind::BudgetExhausted if self.run_budget.is_some() => write!(
                f,
                "{dep} is failing ({cause}) after {tries}, and this run has spent all {} of its \
                 retries; do not retry now; {guidance}",
                self.run_budget.unwrap_or(0)
            ),
            ErrorKind::BudgetExhausted => write!(
                f,
                "{dep} is failing ({cause}) and its retry budget is exhausted after {tries}; \
                 do not retry now; {guidance}"
            ),
            ErrorKind::Throttled => {
                write!(f, "{cause}; do not retry now; {guidance}; tell the user")
            }
            ErrorKind::OverQuota => write!(f, "{cause}; {guidance}"),
            ErrorKind::TimedOut => write!(
                f,
                "{dep} did not reply in time ({tries}: {cause}); {guidance}"
            ),
            ErrorKind::DeadlineExceeded => write!(
                f,
                "the call to {dep} reached {} ({tries}); {guidance}",
                DeadlineWords(self.deadline)
            ),
            ErrorKind::NotRetried if self.unvouched_key => write!(
                f,
                "the call to {dep} may or may not have taken effect ({cause}); it was not repeated \
                 because nobody declared that {dep} honours idempotency keys (its key was \
                 generated by Backstop); check its status before repeating it (if {dep} honours \
                 keys, build its stack with honours_keys(), or set the key yourself)"
            ),
            ErrorKind::NotRetried => write!(
                f,
                "the call to {dep} may or may not have taken effect ({cause}); it was not repeated \
                 because it is not idempotent and has no idempotency key; check its status before \
                 repeating it"
            ),
            // A reply lost in the transport: said first, then the transport's own words.
            ErrorKind::Failed if lost_reply(self.cause).is_some() => {
                let lost = lost_reply(self.cause).map(CauseChain);
                write!(
                    f,
                    "the reply from {dep} was lost ({tries}): {}; {guidance}",
                    lost.expect("checked above")
                )
            }
            ErrorKind::Failed => {
                write!(f, "the call to {dep} failed ({tries}): {cause}; ")?;
                if let Some(why) = self.not_retried {
                    write!(f, "it was not retried because {why}; ")?;
                }
                f.write_str(guidance)
            }
            ErrorKind::Misconfigured => write!(
                f,
                "the call to {dep} was not sent because the tool runtime is misconfigured: {cause}"
            ),
        }
    }
}

/// Whether an error of type `E` is in `error`'s cause chain.
fn in_chain<E: StdError + 'static>(error: &(dyn StdError + 'static)) -> bool {
    let mut next = Some(error);
    while let Some(e) = next {
        if e.is::<E>() {
            return true;
        }
        next = e.source();
    }
    false
}

/// The [`ReplyLost`] in `error`'s cause chain, if any.
fn lost_reply<'a>(error: &'a (dyn StdError + 'static)) -> Option<&'a (dyn StdError + 'static)> {
    let mut next = Some(error);
    while let Some(e) = next {
        if e.is::<ReplyLost>() {
            return Some(e);
        }
        next = e.source();
    }
    None
}

/// Whether a Backstop layer further in refused the attempt before sending it (an open circuit,
/// a deadline already passed).
pub(crate) fn refused_before_sending(error: &(dyn StdError + 'static)) -> bool {
    let d = Diagnosis::of(error);
    d.outcome == Some(Outcome::NotSent)
        && matches!(
            d.kind,
            Some(
                ErrorKind::Unavailable
                    | ErrorKind::Throttled
                    | ErrorKind::OverQuota
                    | ErrorKind::DeadlineExceeded
            )
        )
}
