//! The one voice of Backstop's errors: what a failed call is called and how it is told, shared
//! by [`RetryError`](crate::RetryError) and the facade's `backstop::Error`.

use backstop_core::{
    AttemptTimedOut, CauseChain, CircuitOpen, CircuitState, DeadlineExceeded, DeadlineWords,
    Dependency, HumanDuration, InvalidConfig, Outcome, ReplyLost, Throttled,
};
use std::{error::Error, fmt, time::Duration};

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
pub struct Diagnosis {
    /// The kind they make it (`None`: nothing of Backstop's in the chain).
    pub kind: Option<ErrorKind>,
    /// The outcome they know (a refusal: not sent; a timeout: unknown; a deadline: as recorded).
    pub outcome: Option<Outcome>,
    /// The circuit's state, for an open circuit.
    pub circuit: Option<CircuitState>,
    /// When the circuit lets calls through again.
    pub retry_in: Option<Duration>,
    /// The deadline's length, for a deadline.
    pub deadline: Option<Duration>,
    /// The dependency they name.
    pub dependency: Option<Dependency>,
}

impl Diagnosis {
    /// Walks `error`'s source chain for Backstop's own errors.
    pub fn of(error: &(dyn Error + 'static)) -> Diagnosis {
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

/// Everything the text of a failed call says, in the one voice both error types use.
#[derive(Clone, Copy, Debug)]
pub struct Told<'a> {
    /// The kind of failure.
    pub kind: ErrorKind,
    /// The dependency (`None`: "the dependency").
    pub dependency: Option<&'a Dependency>,
    /// What is known of the side effect.
    pub outcome: Outcome,
    /// Attempts sent.
    pub attempts: u32,
    /// Time from the call to its end.
    pub elapsed: Duration,
    /// The last cause, told down to the part that says what went wrong on the wire.
    pub cause: &'a (dyn Error + 'static),
    /// The circuit's state, for [`ErrorKind::Unavailable`].
    pub circuit: Option<CircuitState>,
    /// When to try again, when someone said.
    pub retry_after: Option<Duration>,
    /// The deadline's length, for [`ErrorKind::DeadlineExceeded`].
    pub deadline: Option<Duration>,
    /// For [`ErrorKind::NotRetried`]: the request had a key the stack attached itself, which
    /// nobody vouched the dependency honours.
    pub unvouched_key: bool,
    /// For [`ErrorKind::BudgetExhausted`]: the run's budget (of this many retries) refused the
    /// retry, not the dependency's.
    pub run_budget: Option<u32>,
    /// For [`ErrorKind::Failed`]: why the request was not sent again, when that was what stopped
    /// the retries (it could not be copied, or the policy said why).
    pub not_retried: Option<&'a str>,
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

/// The [`ReplyLost`] in `error`'s cause chain, if any.
fn lost_reply<'a>(error: &'a (dyn Error + 'static)) -> Option<&'a (dyn Error + 'static)> {
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
pub(crate) fn refused_before_sending(error: &(dyn Error + 'static)) -> bool {
    let d = Diagnosis::of(error);
    d.outcome == Some(Outcome::NotSent)
        && matches!(
            d.kind,
            Some(ErrorKind::Unavailable | ErrorKind::Throttled | ErrorKind::DeadlineExceeded)
        )
}
