use backstop_core::{
    AttemptTimedOut, BoxError, CauseChain, CircuitOpen, CircuitState, DeadlineExceeded,
    DeadlineWords, Dependency, HumanDuration, InvalidConfig, Outcome,
};
use backstop_retry::{RetryError, StopReason};
use std::{error::Error as StdError, fmt, time::Duration};

/// What kind of failure an [`Error`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The dependency's circuit is open (or isolated): the call was not sent.
    Unavailable,
    /// The dependency kept failing and its retry budget is exhausted.
    BudgetExhausted,
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
            ErrorKind::TimedOut => "timed_out",
            ErrorKind::DeadlineExceeded => "deadline_exceeded",
            ErrorKind::NotRetried => "not_retried",
            ErrorKind::Failed => "failed",
            ErrorKind::Misconfigured => "misconfigured",
        }
    }
}

/// The one error a Backstop stack returns.
///
/// Its `Display` is written for an agent's model to act on: what happened, to which dependency,
/// what is known about the side effect, and what to do next ("do not retry now; tell the user",
/// "check its status before repeating it"). The structured accessors say the same to code.
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
    /// The key was attached by the stack and nobody vouched that the dependency honours it.
    unvouched_key: bool,
    /// A nested stack's raw error, on its way to the stack outside that owns the call.
    passing: bool,
    source: BoxError,
}

/// Takes the raw error back out of an [`Error`] a nested stack passed out; anything else is
/// boxed as it is.
pub(crate) fn unpass<E: Into<BoxError>>(e: E) -> BoxError {
    let e: BoxError = e.into();
    if e.downcast_ref::<Error>().is_some_and(|e| e.passing) {
        if let Ok(err) = e.downcast::<Error>() {
            return err.source;
        }
        unreachable!("checked above");
    }
    e
}

impl Error {
    /// A raw error that a nested stack hands to the stack outside, which owns the call.
    pub(crate) fn passing(source: BoxError) -> Error {
        let mut err = Error::from_box(source);
        err.passing = true;
        err
    }

    /// The kind of failure.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// What is known about the side effect: not sent (nothing happened), unknown (it may have
    /// happened), completed.
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

    /// Whether the same call may safely be tried again later: nothing happened (the side
    /// effect is *not sent*) and the failure was not a misconfiguration. An unknown outcome is
    /// never retryable later without checking first.
    pub fn is_retryable_later(&self) -> bool {
        self.outcome == Outcome::NotSent && self.kind != ErrorKind::Misconfigured
    }

    /// How many attempts were made (0 when the call was refused before the first).
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// How long the call's deadline was, when it was the deadline that ended the call and its
    /// length is known.
    pub fn deadline(&self) -> Option<Duration> {
        self.deadline
    }

    /// Time from the call to its end, when the retry layer measured it.
    pub fn elapsed(&self) -> Duration {
        self.elapsed
    }

    /// Classifies any error a Backstop layer produced.
    pub fn from_box(e: BoxError) -> Error {
        let e = match e.downcast::<Error>() {
            Ok(done) => return *done,
            Err(e) => e,
        };
        let e = match e.downcast::<RetryError>() {
            Ok(r) => return Self::from_retry(*r),
            Err(e) => e,
        };
        let mut err = Error {
            kind: ErrorKind::Failed,
            dependency: None,
            outcome: Outcome::Unknown,
            retry_after: None,
            attempts: 1,
            elapsed: Duration::ZERO,
            circuit: None,
            deadline: None,
            unvouched_key: false,
            passing: false,
            source: e,
        };
        err.refine_from_cause(false);
        err
    }

    fn from_retry(r: RetryError) -> Error {
        let kind = match r.stop_reason() {
            StopReason::BudgetExhausted => ErrorKind::BudgetExhausted,
            StopReason::DeadlineTooClose { .. } => ErrorKind::DeadlineExceeded,
            StopReason::NotReplaySafe => ErrorKind::NotRetried,
            _ => ErrorKind::Failed,
        };
        let mut err = Error {
            kind,
            dependency: Some(r.dependency().clone()),
            outcome: r.side_effect(),
            retry_after: r.retry_after(),
            attempts: r.attempts(),
            elapsed: r.elapsed(),
            circuit: None,
            deadline: r.history().deadline,
            unvouched_key: false,
            passing: false,
            source: Box::new(r),
        };
        if kind == ErrorKind::Failed {
            err.refine_from_cause(true);
        }
        err
    }

    /// Looks through the cause chain for Backstop's own errors. `counted`: the attempts and
    /// the side effect come from the retry layer's history and stay as they are.
    fn refine_from_cause(&mut self, counted: bool) {
        let mut next: Option<&(dyn StdError + 'static)> = Some(&*self.source);
        while let Some(e) = next {
            if let Some(open) = e.downcast_ref::<CircuitOpen>() {
                self.kind = ErrorKind::Unavailable;
                if !counted {
                    // A breaker layer's own refusal: nothing was sent.
                    self.outcome = Outcome::NotSent;
                    self.attempts = 0;
                }
                self.retry_after = open.retry_in();
                self.circuit = Some(open.state());
                self.dependency
                    .get_or_insert_with(|| open.dependency().clone());
                return;
            }
            if let Some(d) = e.downcast_ref::<DeadlineExceeded>() {
                self.kind = ErrorKind::DeadlineExceeded;
                self.deadline = d.length();
                if !counted {
                    self.outcome = d.outcome();
                    if d.outcome() == Outcome::NotSent {
                        self.attempts = 0;
                    }
                }
                if let Some(dep) = d.dependency() {
                    self.dependency.get_or_insert_with(|| dep.clone());
                }
                return;
            }
            if let Some(t) = e.downcast_ref::<AttemptTimedOut>() {
                self.kind = ErrorKind::TimedOut;
                self.outcome = Outcome::Unknown;
                if let Some(dep) = t.dependency() {
                    self.dependency.get_or_insert_with(|| dep.clone());
                }
                return;
            }
            if e.is::<InvalidConfig>() {
                self.kind = ErrorKind::Misconfigured;
                self.outcome = Outcome::NotSent;
                self.attempts = 0;
                return;
            }
            next = e.source();
        }
    }

    /// The cause as text, down to the part that says what went wrong on the wire.
    fn root_cause(&self) -> CauseChain<'_> {
        match self.source.downcast_ref::<RetryError>() {
            Some(r) => CauseChain(r.cause()),
            None => CauseChain(&*self.source),
        }
    }
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

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let dep = self
            .dependency
            .as_ref()
            .map_or_else(|| "the dependency".to_owned(), |d| d.to_string());
        let tries = Tries(self.attempts, self.elapsed);
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
                f.write_str("; tell the user")
            }
            ErrorKind::BudgetExhausted => write!(
                f,
                "{dep} is failing ({}) and its retry budget is exhausted after {tries}; do not retry now; {}",
                self.root_cause(),
                self.outcome.guidance()
            ),
            ErrorKind::TimedOut => write!(
                f,
                "{dep} did not reply in time ({tries}: {}); {}",
                self.root_cause(),
                self.outcome.guidance()
            ),
            ErrorKind::DeadlineExceeded => write!(
                f,
                "the call to {dep} reached {} ({tries}); {}",
                DeadlineWords(self.deadline),
                self.outcome.guidance()
            ),
            ErrorKind::NotRetried if self.unvouched_key => write!(
                f,
                "the call to {dep} may or may not have taken effect ({}); it was not repeated \
                 because nobody declared that {dep} honours idempotency keys (its key was \
                 generated by Backstop); check its status before repeating it (if {dep} honours \
                 keys, build its stack with honours_keys(), or set the key yourself)",
                self.root_cause()
            ),
            ErrorKind::NotRetried => write!(
                f,
                "the call to {dep} may or may not have taken effect ({}); it was not repeated because \
                 it is not idempotent and has no idempotency key; check its status before repeating it",
                self.root_cause()
            ),
            ErrorKind::Failed => write!(
                f,
                "the call to {dep} failed ({tries}): {}; {}",
                self.root_cause(),
                self.outcome.guidance()
            ),
            ErrorKind::Misconfigured => write!(
                f,
                "the call to {dep} was not sent because the tool runtime is misconfigured: {}",
                self.root_cause()
            ),
        }
    }
}

impl StdError for Error {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        Some(&*self.source)
    }
}

impl Error {
    pub(crate) fn set_unvouched_key(&mut self) {
        self.unvouched_key = true;
    }

    pub(crate) fn set_dependency_if_missing(&mut self, d: &Dependency) {
        self.dependency.get_or_insert_with(|| d.clone());
    }
}
