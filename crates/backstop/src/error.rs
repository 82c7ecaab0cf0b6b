use backstop_core::{BoxError, CircuitState, Dependency, Outcome};
pub use backstop_retry::ErrorKind;
use backstop_retry::{
    RetryError, RetryHistory,
    plumbing::{Diagnosis, Told},
};
use std::{error::Error as StdError, fmt, time::Duration};

/// The one error a Backstop stack returns.
///
/// Its `Display` is written for an agent's model to act on: what happened, to which dependency,
/// what is known about the side effect, and what to do next ("do not retry now; tell the user",
/// "check its status before repeating it"). The structured accessors say the same to code.
///
/// ```
/// use backstop::{Backstop, ErrorKind, Outcome, backoff::Backoff};
/// use bytes::Bytes;
/// use http_body_util::Full;
/// use std::time::Duration;
/// use tower::{Layer, ServiceExt, service_fn};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// // Nobody listens: every attempt is refused before anything is sent.
/// let refused = service_fn(|_req: http::Request<Full<Bytes>>| async {
///     Err::<http::Response<Full<Bytes>>, _>(std::io::Error::from(std::io::ErrorKind::ConnectionRefused))
/// });
/// let rates = Backstop::http("error-example-api")
///     .backoff(Backoff::full_jitter(Duration::from_millis(1), Duration::from_millis(2)).unwrap())
///     .no_breaker()
///     .build()
///     .unwrap()
///     .layer(refused);
/// let req = http::Request::get("http://rates.local/q").body(Full::default()).unwrap();
/// let err = rates.oneshot(req).await.unwrap_err();
/// assert_eq!(err.outcome(), Outcome::NotSent); // it did not happen: safe to try again later
/// assert_eq!(err.attempts(), 3);
/// assert_eq!(err.kind(), ErrorKind::Failed);
/// assert!(err.to_string().starts_with("the call to error-example-api failed (3 attempts"), "{err}");
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
    /// The run's retry budget, when it was the run's budget that stopped the retries.
    run_budget: Option<u32>,
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
            (ErrorKind::BudgetExhausted, _) if self.run_budget.is_some() => format!(
                "this run has used all of its retries ({dependency} kept failing): do not retry; \
                 finish without this tool, or tell the user"
            ),
            (ErrorKind::Throttled, _) => format!(
                "{dependency} is overloaded and this client is shedding its calls: do not retry \
                 now; try again later, or tell the user"
            ),
            (ErrorKind::Unavailable | ErrorKind::BudgetExhausted, _) => match self.retry_after {
                Some(after) => format!(
                    "{dependency} is unavailable: do not retry now; try again in {}, or tell the user",
                    backstop_core::HumanDuration::rounded_up(after)
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
    /// use backstop::{Backstop, breaker::Breaker};
    /// use bytes::Bytes;
    /// use http_body_util::Full;
    /// use tower::{Layer, ServiceExt, service_fn};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let breaker = Breaker::new(Default::default()).unwrap();
    /// breaker.isolate(&"billing-api".into()); // an operator took billing out
    /// let billing = Backstop::http("billing-api")
    ///     .breaker(breaker)
    ///     .build()
    ///     .unwrap()
    ///     .layer(service_fn(|_req: http::Request<Full<Bytes>>| async {
    ///         Ok::<_, std::io::Error>(http::Response::new(Full::<Bytes>::default()))
    ///     }));
    /// let req = http::Request::post("http://billing.local/refunds").body(Full::default()).unwrap();
    /// let err = billing.oneshot(req).await.unwrap_err();
    /// let result = err.to_tool_result(Some("refund-ORD-4812"));
    /// assert_eq!(result["isError"], true);
    /// assert_eq!(result["content"][0]["text"], err.to_string());
    /// let s = &result["structuredContent"];
    /// assert_eq!((s["outcome"].as_str(), s["safe_to_repeat"].as_bool()), (Some("not_sent"), Some(true)));
    /// assert_eq!(s["idempotency_key"], "refund-ORD-4812");
    /// assert!(s["next_action"].as_str().unwrap().contains("tell the user"));
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

    /// Every attempt of the call, how each ended and why no further one was made, when the
    /// retry layer ended the call (an error from a layer outside it, such as a refused
    /// idempotency key, has none).
    pub fn history(&self) -> Option<&RetryHistory> {
        self.source
            .downcast_ref::<RetryError>()
            .map(RetryError::history)
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
        // A bare error (a layer's own, or the client's): what Backstop's errors in its chain say.
        let d = Diagnosis::of(&*e);
        let kind = d.kind.unwrap_or(ErrorKind::Failed);
        let outcome = d.outcome.unwrap_or(Outcome::Unknown);
        Error {
            kind,
            dependency: d.dependency,
            outcome,
            retry_after: d.retry_in,
            // A refusal before sending is no attempt.
            attempts: u32::from(outcome != Outcome::NotSent || kind == ErrorKind::Failed),
            elapsed: Duration::ZERO,
            circuit: d.circuit,
            deadline: d.deadline,
            run_budget: None,
            passing: false,
            source: e,
        }
    }

    /// The call waited at least `waited` before it ended (for readiness): an error that could
    /// not say how long the call took says that.
    pub(crate) fn waited_at_least(&mut self, waited: Duration) {
        self.elapsed = self.elapsed.max(waited);
    }

    fn from_retry(r: RetryError) -> Error {
        let told = r.told();
        Error {
            kind: told.kind,
            dependency: told.dependency.cloned(),
            outcome: told.outcome,
            retry_after: told.retry_after,
            attempts: told.attempts,
            elapsed: told.elapsed,
            circuit: told.circuit,
            deadline: told.deadline,
            run_budget: told.run_budget,
            passing: false,
            source: Box::new(r),
        }
    }
}

/// In the same words as [`RetryError`] (one voice for both): an error that came from the
/// retry layer is told by it; a bare one from what its cause chain says.
impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(r) = self.source.downcast_ref::<RetryError>() {
            return r.fmt(f);
        }
        Told {
            kind: self.kind,
            dependency: self.dependency.as_ref(),
            outcome: self.outcome,
            attempts: self.attempts,
            elapsed: self.elapsed,
            cause: &*self.source,
            circuit: self.circuit,
            retry_after: self.retry_after,
            deadline: self.deadline,
            unvouched_key: false,
            run_budget: None,
            not_retried: None,
        }
        .fmt(f)
    }
}

impl StdError for Error {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        Some(&*self.source)
    }
}

impl Error {
    pub(crate) fn set_dependency_if_missing(&mut self, d: &Dependency) {
        self.dependency.get_or_insert_with(|| d.clone());
    }
}

impl backstop_core::ReportsOutcome for Error {
    fn outcome(&self) -> Outcome {
        Error::outcome(self)
    }

    fn retry_after(&self) -> Option<Duration> {
        Error::retry_after(self)
    }
}
