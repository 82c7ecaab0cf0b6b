//! What the retry layer did for one call: its attempts and why it stopped.

use crate::NotCopyable;
use backstop_classify::Verdict;
use backstop_core::Dependency;
use backstop_core::plumbing::HumanDuration;
use std::{borrow::Cow, fmt, time::Duration};

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
/// response is returned because the layer stopped; carried by the [`Error`](crate::Error) it ends in.
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
}
