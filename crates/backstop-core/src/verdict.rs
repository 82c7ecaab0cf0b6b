use crate::Outcome;
use std::time::Duration;

/// The classification of one attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The attempt succeeded (or failed in a way the caller handles): return it.
    Success,
    /// The failure is transient: another attempt may succeed.
    Retryable {
        /// What is known of the side effect. The retry layer repeats an
        /// [`Outcome::Unknown`] attempt only for a replay-safe request.
        outcome: Outcome,
        /// A delay the dependency asked for (`Retry-After`), already capped.
        after: Option<Duration>,
    },
    /// The failure will not go away by repeating the same request.
    Fatal {
        /// What is known of the side effect.
        outcome: Outcome,
    },
}

impl Verdict {
    /// What is known of the side effect ([`Outcome::Completed`] for a success).
    pub const fn outcome(&self) -> Outcome {
        match *self {
            Verdict::Success => Outcome::Completed,
            Verdict::Retryable { outcome, .. } | Verdict::Fatal { outcome } => outcome,
        }
    }

    /// Whether this is [`Verdict::Retryable`].
    pub const fn is_retryable(&self) -> bool {
        matches!(self, Verdict::Retryable { .. })
    }

    /// The delay the dependency asked for, if any.
    pub const fn retry_after(&self) -> Option<Duration> {
        match *self {
            Verdict::Retryable { after, .. } => after,
            _ => None,
        }
    }
}

/// Turns one attempt's result into a [`Verdict`], and says whether a request may be sent twice.
///
/// The verdict depends on the result only; replay safety on the request only. The retry layer
/// asks [`is_replay_safe`](Classify::is_replay_safe) only after an attempt whose outcome is
/// unknown, so the success path never pays for it.
///
/// Generic over the request, response and error types: HTTP is one implementation
/// (`backstop_classify::HttpClassifier`); an agent runtime whose tool calls are not HTTP
/// implements it for its own types.
///
/// ```
/// use backstop_core::{Classify, Outcome, Verdict};
///
/// struct ToolCall { read_only: bool }
/// #[derive(Debug)]
/// enum ToolError { RateLimited, InvalidArguments, LostReply }
///
/// struct Tools;
/// impl Classify<ToolCall, String, ToolError> for Tools {
///     fn classify(&self, result: Result<&String, &ToolError>) -> Verdict {
///         match result {
///             Ok(_) => Verdict::Success,
///             Err(ToolError::RateLimited) => Verdict::Retryable { outcome: Outcome::NotSent, after: None },
///             Err(ToolError::LostReply) => Verdict::Retryable { outcome: Outcome::Unknown, after: None },
///             Err(ToolError::InvalidArguments) => Verdict::Fatal { outcome: Outcome::Completed },
///         }
///     }
///     fn is_replay_safe(&self, req: &ToolCall) -> bool {
///         req.read_only
///     }
/// }
///
/// let v = Classify::<ToolCall, _, _>::classify(&Tools, Err(&ToolError::LostReply));
/// assert!(v.is_retryable() && v.outcome().is_uncertain());
/// assert!(!Tools.is_replay_safe(&ToolCall { read_only: false }));
/// ```
pub trait Classify<Req, Res, E> {
    /// Classifies the result of one attempt.
    fn classify(&self, result: Result<&Res, &E>) -> Verdict;

    /// Whether `req` may be sent again after an attempt whose side effect is unknown: an
    /// idempotent operation, or one the dependency deduplicates (an idempotency key).
    fn is_replay_safe(&self, req: &Req) -> bool;
}

impl<Req, Res, E, C> Classify<Req, Res, E> for std::sync::Arc<C>
where
    C: Classify<Req, Res, E> + ?Sized,
{
    fn classify(&self, result: Result<&Res, &E>) -> Verdict {
        (**self).classify(result)
    }
    fn is_replay_safe(&self, req: &Req) -> bool {
        (**self).is_replay_safe(req)
    }
}
