use std::fmt;

/// What is known about the side effect of one attempt.
///
/// A network call can succeed on the server while its reply is lost, so "the call failed" is not
/// enough to decide whether trying again is safe. Every verdict Backstop reaches carries one of
/// these three states.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// The request never reached the dependency, or the dependency refused it before doing
    /// anything: connection refused, DNS failure, an open circuit breaker, a budget refusal, a
    /// `429 Too Many Requests`. It did not happen, so repeating it is always safe.
    NotSent,
    /// The request was sent but no complete reply came back: a timeout, a connection reset
    /// mid-flight, a gateway that lost its upstream. The side effect may or may not have
    /// happened. Only a replay-safe request (idempotent, or carrying an idempotency key) may be
    /// repeated.
    Unknown,
    /// The dependency gave a definitive answer (a response, or an error it chose to return).
    Completed,
}

impl Outcome {
    /// `true` for [`Outcome::Unknown`]: the side effect may have happened.
    pub const fn is_uncertain(self) -> bool {
        matches!(self, Outcome::Unknown)
    }

    /// A short phrase for logs and metrics: `not_sent`, `unknown` or `completed`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Outcome::NotSent => "not_sent",
            Outcome::Unknown => "unknown",
            Outcome::Completed => "completed",
        }
    }

    /// What a caller (or an agent's model) should conclude, in words it can act on.
    pub const fn guidance(self) -> &'static str {
        match self {
            Outcome::NotSent => "the request did not take effect, so it is safe to try again later",
            Outcome::Unknown => {
                "the request may or may not have taken effect; check its status before repeating it"
            }
            Outcome::Completed => {
                "the dependency answered, so repeating the same request will not help"
            }
        }
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An error that knows what became of the request's side effect: every Backstop error does.
/// What a journal, a dead-letter sink or an agent runtime reads to decide whether a step may be
/// sent again.
pub trait ReportsOutcome {
    /// What is known of the side effect.
    fn outcome(&self) -> Outcome;

    /// When the dependency can be tried again, if it said.
    fn retry_after(&self) -> Option<std::time::Duration> {
        None
    }
}

impl ReportsOutcome for crate::AttemptTimedOut {
    fn outcome(&self) -> Outcome {
        Outcome::Unknown
    }
}

impl ReportsOutcome for crate::DeadlineExceeded {
    fn outcome(&self) -> Outcome {
        self.outcome
    }
}

impl ReportsOutcome for crate::ReplyLost {
    fn outcome(&self) -> Outcome {
        Outcome::Unknown
    }
}

impl ReportsOutcome for crate::CircuitOpen {
    fn outcome(&self) -> Outcome {
        Outcome::NotSent
    }

    fn retry_after(&self) -> Option<std::time::Duration> {
        self.retry_in()
    }
}
