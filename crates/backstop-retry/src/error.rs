use crate::error_kind::{Diagnosis, ErrorKind, Told};
use crate::{NotCopyable, parts::Ended};
use backstop_classify::Verdict;
use backstop_core::{BoxError, Dependency, HumanDuration, Outcome};
use std::{borrow::Cow, error::Error, fmt, time::Duration};

/// Why the retry layer made no further attempt.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum StopReason {
    /// The last attempt succeeded.
    Succeeded,
    /// The classifier called the failure fatal: repeating the request will not help.
    NotRetryable,
    /// Every allowed attempt was made.
    AttemptsExhausted {
        /// The configured maximum.
        max_attempts: u32,
    },
    /// The side effect of the last attempt is unknown and the request is not replay-safe (not
    /// idempotent, no idempotency key), so repeating it could do it twice.
    NotReplaySafe,
    /// The side effect of the last attempt is unknown, and the request's only idempotency key
    /// is one the stack attached itself (`UnvouchedKey`): nobody vouched that the dependency
    /// honours it, so repeating the request could do it twice.
    KeyNotVouched,
    /// The request cannot be replayed (for example, its body exceeded the replay buffer).
    NotCopyable(NotCopyable),
    /// The dependency's retry budget refused the retry.
    BudgetExhausted,
    /// The run's retry budget (a `backstop_core::Run` on the request) refused the retry: the
    /// run's calls have spent all of it.
    RunBudgetExhausted {
        /// The run's budget.
        retries: u32,
    },
    /// A [`Policy`](crate::Policy) of one's own stopped the call, for the reason it gives.
    Policy(Cow<'static, str>),
    /// The wait before the next attempt would end at or after the deadline.
    DeadlineTooClose {
        /// The wait that was needed.
        wait: Duration,
        /// The time that was left.
        left: Duration,
    },
}

/// Why the layer stopped, in words ("gave up after the maximum of 3 attempts").
impl fmt::Display for StopReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StopReason::Succeeded => f.write_str("it succeeded"),
            StopReason::NotRetryable => f.write_str("the failure is not one that retrying can fix"),
            StopReason::AttemptsExhausted { max_attempts } => {
                write!(f, "gave up after the maximum of {max_attempts} attempts")
            }
            StopReason::NotReplaySafe => f.write_str(
                "not retried because the request is not idempotent and carries no idempotency key",
            ),
            StopReason::KeyNotVouched => f.write_str(
                "not retried because nobody vouched that the dependency honours the idempotency \
                 key the stack attached",
            ),
            StopReason::NotCopyable(r) => write!(f, "not retried because {r}"),
            StopReason::Policy(why) => write!(f, "not retried because {why}"),
            StopReason::BudgetExhausted => f.write_str("the retry budget is exhausted"),
            StopReason::RunBudgetExhausted { retries } => write!(
                f,
                "the run's retry budget is exhausted (its calls made all {retries} retries it allows)"
            ),
            StopReason::DeadlineTooClose { wait, left } => write!(
                f,
                "not retried because the next attempt could not start before the deadline \
                 (it had to wait {}, {} was left)",
                HumanDuration(*wait),
                HumanDuration(*left)
            ),
        }
    }
}

/// One attempt, as the retry layer saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct AttemptRecord {
    /// 1 for the first attempt.
    pub attempt: u32,
    /// Whether the request was handed to the dependency's service. A refusal by a layer further
    /// in (an open circuit, the throttle), a deadline that passed before the attempt, or a
    /// service that did not become ready in time is recorded, but it is no attempt sent.
    pub sent: bool,
    /// The classifier's verdict.
    pub verdict: Verdict,
    /// How long the attempt took.
    pub took: Duration,
    /// The wait before the next attempt, when there was one.
    pub wait: Option<Duration>,
}

/// What the retry layer did for one logical call.
///
/// Put in a response's extensions whenever more than one attempt was made or a retryable
/// response is returned because the layer stopped; carried by every [`RetryError`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RetryHistory {
    /// The dependency.
    pub dependency: Dependency,
    /// Every attempt, in order.
    pub attempts: Vec<AttemptRecord>,
    /// From the call to the end of the last attempt.
    pub elapsed: Duration,
    /// How long the call's deadline was, when it had one of known length.
    pub deadline: Option<Duration>,
    /// Why no further attempt was made.
    pub stopped: StopReason,
}

impl RetryHistory {
    /// How many attempts were sent (handed to the dependency's service).
    pub fn sent(&self) -> u32 {
        let n = self.attempts.iter().filter(|a| a.sent).count();
        u32::try_from(n).unwrap_or(u32::MAX)
    }

    /// The history recorded on a response, if any.
    pub fn of<R: backstop_core::HasExtensions + ?Sized>(res: &R) -> Option<&RetryHistory> {
        res.extensions().get::<RetryHistory>()
    }

    /// The call's result with this history: on the response, or in the [`RetryError`] of the
    /// attempt that ended it with `verdict`.
    pub(crate) fn attach<R, E>(self, ended: Ended<R, E>, verdict: Verdict) -> Result<R, BoxError>
    where
        R: backstop_core::HasExtensions,
        E: Into<BoxError>,
    {
        let cause = match ended.into_result() {
            Ok(mut res) => {
                res.extensions_mut().insert(self);
                return Ok(res);
            }
            Err(e) => e,
        };
        Err(Box::new(RetryError::new(self, verdict, cause)))
    }
}

/// A logical call that ended in an error, after the retry layer did what it safely could.
///
/// Its `Display` is written to be handed to an agent's model as it is: it names the dependency,
/// the attempts and the time spent, the last cause, why no further attempt was made, and what
/// is known about the side effect (with what to do about it). `source()` is the last cause.
#[derive(Debug)]
pub struct RetryError {
    history: RetryHistory,
    outcome: Outcome,
    retry_after: Option<Duration>,
    cause: BoxError,
}

impl RetryError {
    pub(crate) fn new(history: RetryHistory, verdict: Verdict, cause: BoxError) -> Self {
        RetryError {
            outcome: verdict.outcome(),
            retry_after: verdict.retry_after(),
            history,
            cause,
        }
    }

    /// The dependency.
    pub fn dependency(&self) -> &Dependency {
        &self.history.dependency
    }

    /// How many attempts were sent (handed to the dependency's service): an attempt the breaker
    /// or the throttle refused, or one the deadline stopped before it started, does not count.
    pub fn attempts(&self) -> u32 {
        self.history.sent()
    }

    /// From the call to the end of the last attempt.
    pub fn elapsed(&self) -> Duration {
        self.history.elapsed
    }

    /// What is known about the side effect of the last attempt. If any attempt's outcome was
    /// unknown, so is the call's: see [`RetryError::side_effect`].
    pub fn outcome(&self) -> Outcome {
        self.outcome
    }

    /// What is known about the side effect of the call as a whole: unknown if any attempt's
    /// was, else that of the last attempt.
    pub fn side_effect(&self) -> Outcome {
        if self
            .history
            .attempts
            .iter()
            .any(|a| a.verdict.outcome() == Outcome::Unknown)
        {
            Outcome::Unknown
        } else {
            self.outcome
        }
    }

    /// Why no further attempt was made.
    pub fn stop_reason(&self) -> &StopReason {
        &self.history.stopped
    }

    /// The delay the dependency asked for on its last answer, if any.
    pub fn retry_after(&self) -> Option<Duration> {
        self.retry_after
    }

    /// The full history.
    pub fn history(&self) -> &RetryHistory {
        &self.history
    }

    /// The last cause.
    pub fn cause(&self) -> &(dyn Error + Send + Sync + 'static) {
        &*self.cause
    }

    /// Takes the last cause out.
    pub fn into_cause(self) -> BoxError {
        self.cause
    }
}

impl RetryError {
    /// What kind of failure the call ended in: from why the retry layer stopped, else from
    /// Backstop's own errors in the cause chain (an open circuit, a timeout, a deadline).
    pub fn kind(&self) -> ErrorKind {
        match self.history.stopped {
            StopReason::BudgetExhausted | StopReason::RunBudgetExhausted { .. } => {
                ErrorKind::BudgetExhausted
            }
            StopReason::DeadlineTooClose { .. } => ErrorKind::DeadlineExceeded,
            StopReason::NotReplaySafe | StopReason::KeyNotVouched => ErrorKind::NotRetried,
            _ => Diagnosis::of(&*self.cause)
                .kind
                .unwrap_or(ErrorKind::Failed),
        }
    }

    /// The text's parts: what `Display` says, and what `backstop::Error` says the same way.
    #[doc(hidden)]
    pub fn told(&self) -> Told<'_> {
        let kind = self.kind();
        let diagnosis = Diagnosis::of(&*self.cause);
        Told {
            kind,
            dependency: Some(&self.history.dependency),
            outcome: self.side_effect(),
            attempts: self.attempts(),
            elapsed: self.history.elapsed,
            cause: &*self.cause,
            circuit: diagnosis.circuit,
            retry_after: diagnosis.retry_in.or(self.retry_after),
            deadline: self.history.deadline.or(diagnosis.deadline),
            unvouched_key: self.history.stopped == StopReason::KeyNotVouched,
            run_budget: match self.history.stopped {
                StopReason::RunBudgetExhausted { retries } => Some(retries),
                _ => None,
            },
            not_retried: match &self.history.stopped {
                StopReason::NotCopyable(why) => Some(why.reason()),
                StopReason::Policy(why) => Some(why),
                _ => None,
            },
        }
    }
}

/// In the same words as `backstop::Error`.
impl fmt::Display for RetryError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.told().fmt(f)
    }
}

impl Error for RetryError {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        Some(&*self.cause)
    }
}

impl backstop_core::ReportsOutcome for RetryError {
    fn outcome(&self) -> Outcome {
        RetryError::outcome(self)
    }

    fn retry_after(&self) -> Option<Duration> {
        RetryError::retry_after(self)
    }
}
