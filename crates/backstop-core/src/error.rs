use crate::{Dependency, Outcome};
use std::{error::Error, fmt, time::Duration};

/// The boxed error type tower middleware passes around.
pub type BoxError = Box<dyn Error + Send + Sync>;

/// Formats a [`Duration`] for people and models: `350 ms`, `2 s`, `1.5 s`, `27 s`, `20 min`.
#[derive(Clone, Copy, Debug)]
pub struct HumanDuration(pub Duration);

impl fmt::Display for HumanDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d = self.0;
        let ms = d.as_millis();
        if ms < 1_000 {
            if d > Duration::ZERO && ms == 0 {
                return write!(f, "{} us", d.as_micros());
            }
            write!(f, "{ms} ms")
        } else if ms < 60_000 {
            if ms.is_multiple_of(1_000) {
                write!(f, "{} s", ms / 1_000)
            } else {
                write!(f, "{:.1} s", d.as_secs_f64())
            }
        } else if ms.is_multiple_of(60_000) {
            write!(f, "{} min", ms / 60_000)
        } else {
            write!(f, "{} s", d.as_secs())
        }
    }
}

impl HumanDuration {
    /// Whole seconds, rounded up, for delays of a second or more: a "try again in 27 s" must
    /// never be too early. Shorter delays are kept as they are.
    pub fn rounded_up(d: Duration) -> HumanDuration {
        if d < Duration::from_secs(1) {
            return HumanDuration(d);
        }
        HumanDuration(Duration::from_secs(
            d.as_secs() + u64::from(d.subsec_nanos() > 0),
        ))
    }
}

/// An error followed by each source whose text it does not already include, joined by `: `
/// (hyper-util's "client error (SendRequest)" alone does not tell a model what happened).
#[derive(Clone, Copy, Debug)]
pub struct CauseChain<'a>(pub &'a (dyn Error + 'static));

impl fmt::Display for CauseChain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut shown = self.0.to_string();
        f.write_str(&shown)?;
        let mut next = self.0.source();
        while let Some(e) = next {
            let text = e.to_string();
            if !shown.contains(&text) {
                write!(f, ": {text}")?;
                shown = text;
            }
            next = e.source();
        }
        Ok(())
    }
}

struct Named<'a>(Option<&'a Dependency>);

impl fmt::Display for Named<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(d) => write!(f, "{d}"),
            None => f.write_str("the dependency"),
        }
    }
}

/// One attempt took longer than the per-attempt timeout.
///
/// The request was sent and no reply came in time, so its side effect is
/// [`Outcome::Unknown`]. Produced by `backstop-timeout`'s attempt timeout.
#[derive(Clone, Debug)]
pub struct AttemptTimedOut {
    dependency: Option<Dependency>,
    limit: Duration,
}

impl AttemptTimedOut {
    /// An attempt to `dependency` that did not answer within `limit`.
    #[doc(hidden)] // How Backstop's layers reach each other; not for users.
    pub fn new(dependency: Option<Dependency>, limit: Duration) -> Self {
        AttemptTimedOut { dependency, limit }
    }

    /// The dependency, when known.
    pub fn dependency(&self) -> Option<&Dependency> {
        self.dependency.as_ref()
    }

    /// The limit that was exceeded.
    pub fn limit(&self) -> Duration {
        self.limit
    }
}

impl fmt::Display for AttemptTimedOut {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} did not reply within the {} attempt timeout",
            Named(self.dependency.as_ref()),
            HumanDuration(self.limit)
        )
    }
}

impl Error for AttemptTimedOut {}

/// The request was sent and its reply was lost: the connection or the transport failed after
/// the request left and before its answer arrived (a reset, a closed stream, a dropped
/// session). Its side effect is [`Outcome::Unknown`]. Its source is the transport's own error.
///
/// ```
/// use backstop_core::{Outcome, ReplyLost, ReportsOutcome};
///
/// let lost = ReplyLost::new(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
/// assert_eq!(lost.outcome(), Outcome::Unknown);
/// assert_eq!(lost.to_string(), "the request was sent and its reply was lost");
/// ```
#[derive(Debug)]
pub struct ReplyLost {
    source: BoxError,
}

impl ReplyLost {
    /// A reply lost in the transport, which failed with `source`.
    pub fn new(source: impl Into<BoxError>) -> Self {
        ReplyLost {
            source: source.into(),
        }
    }
}

impl fmt::Display for ReplyLost {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("the request was sent and its reply was lost")
    }
}

impl Error for ReplyLost {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        Some(&*self.source)
    }
}

/// The overall deadline of a call passed.
///
/// When the deadline passed before the request was sent, the outcome is
/// [`Outcome::NotSent`]; when it passed while an attempt was in flight, it is
/// [`Outcome::Unknown`].
#[derive(Clone, Debug)]
pub struct DeadlineExceeded {
    dependency: Option<Dependency>,
    pub(crate) outcome: Outcome,
    length: Option<Duration>,
}

impl DeadlineExceeded {
    /// A deadline that passed with the given knowledge of the side effect.
    #[doc(hidden)] // How Backstop's layers reach each other; not for users.
    pub fn new(dependency: Option<Dependency>, outcome: Outcome) -> Self {
        DeadlineExceeded {
            dependency,
            outcome,
            length: None,
        }
    }

    /// The same, saying how long the deadline was (`None`: not known).
    #[must_use]
    #[doc(hidden)] // How Backstop's layers reach each other; not for users.
    pub fn with_length(mut self, length: Option<Duration>) -> Self {
        self.length = length;
        self
    }

    /// How long the deadline was, when known.
    pub fn length(&self) -> Option<Duration> {
        self.length
    }

    /// The dependency, when known.
    pub fn dependency(&self) -> Option<&Dependency> {
        self.dependency.as_ref()
    }
}

/// "its 2 s deadline", or "its deadline" when the length is not known.
#[derive(Clone, Copy, Debug)]
pub struct DeadlineWords(pub Option<Duration>);

impl fmt::Display for DeadlineWords {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(d) => write!(f, "its {} deadline", HumanDuration(d)),
            None => f.write_str("its deadline"),
        }
    }
}

impl fmt::Display for DeadlineExceeded {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let dep = Named(self.dependency.as_ref());
        let its = DeadlineWords(self.length);
        match self.outcome {
            Outcome::NotSent => write!(
                f,
                "the call to {dep} reached {its} before it could be sent, so it was not sent"
            ),
            _ => write!(
                f,
                "the call to {dep} reached {its} while waiting for its reply"
            ),
        }
    }
}

impl Error for DeadlineExceeded {}

/// A configuration that Backstop refuses to build, with the setting to change.
///
/// Returned when a layer, budget or breaker is built, never as a panic at run time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InvalidConfig {
    reason: std::borrow::Cow<'static, str>,
}

impl InvalidConfig {
    /// An invalid configuration; `reason` names the setting and what it must be (lowercase, no
    /// trailing period).
    pub fn new(reason: impl Into<std::borrow::Cow<'static, str>>) -> Self {
        InvalidConfig {
            reason: reason.into(),
        }
    }

    /// The reason.
    pub fn reason(&self) -> &str {
        &self.reason
    }
}

impl fmt::Display for InvalidConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.reason)
    }
}

impl Error for InvalidConfig {}

/// A circuit's state: what a breaker reports for a dependency, and, in a [`CircuitOpen`], why
/// it refused a call (never `Closed` there).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CircuitState {
    /// Calls flow.
    Closed,
    /// The dependency failed repeatedly; calls fail fast until the cooldown ends.
    Open,
    /// The cooldown ended and trial calls are in flight; other calls fail fast until a trial
    /// succeeds.
    HalfOpen,
    /// An operator isolated the dependency; calls fail fast until it is reset.
    Isolated,
}

impl CircuitState {
    /// `closed`, `open`, `half_open` or `isolated`.
    pub fn as_str(self) -> &'static str {
        match self {
            CircuitState::Closed => "closed",
            CircuitState::Open => "open",
            CircuitState::HalfOpen => "half_open",
            CircuitState::Isolated => "isolated",
        }
    }
}

impl fmt::Display for CircuitState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A circuit breaker failed the call at once, without sending it.
///
/// The side effect is [`Outcome::NotSent`], and the retry layer does not retry it: the point of
/// an open circuit is that nobody calls the dependency for a while.
#[derive(Clone, Debug)]
pub struct CircuitOpen {
    dependency: Dependency,
    state: CircuitState,
    retry_in: Option<Duration>,
}

impl CircuitOpen {
    /// A refusal for `dependency` in `state`; `retry_in` is the time until the next trial call,
    /// when known.
    #[doc(hidden)] // How Backstop's layers reach each other; not for users.
    pub fn new(dependency: Dependency, state: CircuitState, retry_in: Option<Duration>) -> Self {
        CircuitOpen {
            dependency,
            state,
            retry_in,
        }
    }

    /// The dependency.
    pub fn dependency(&self) -> &Dependency {
        &self.dependency
    }

    /// The breaker's state.
    pub fn state(&self) -> CircuitState {
        self.state
    }

    /// The time until a trial call may go through, when known.
    pub fn retry_in(&self) -> Option<Duration> {
        self.retry_in
    }
}

impl fmt::Display for CircuitOpen {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d = &self.dependency;
        match self.state {
            // A refusal is never made while closed; a breaker that says so is read as open.
            CircuitState::Open | CircuitState::Closed => {
                write!(f, "{d} is unavailable (circuit open); do not retry now")?;
                match self.retry_in {
                    Some(t) => write!(f, "; try again in {}", HumanDuration::rounded_up(t)),
                    None => f.write_str("; try again later"),
                }
            }
            CircuitState::HalfOpen => write!(
                f,
                "{d} is unavailable (circuit half-open, a trial call is in progress); \
                 do not retry now; try again in a few seconds"
            ),
            CircuitState::Isolated => write!(
                f,
                "{d} is unavailable (circuit isolated by an operator); do not retry now; tell the user"
            ),
        }
    }
}

impl Error for CircuitOpen {}

/// The client refused an attempt itself, before sending it: the dependency has been shedding
/// load, and client-side adaptive throttling sheds this attempt first (`backstop-budget`'s
/// `AdaptiveThrottle`). The side effect is [`Outcome::NotSent`], and the retry layer does not
/// retry it.
#[derive(Clone, Debug)]
pub struct Throttled {
    dependency: Dependency,
    requests: u64,
    accepts: u64,
    probability: f64,
}

impl Throttled {
    /// A refusal for `dependency`, which accepted `accepts` of the last `requests` attempts;
    /// `probability` is the share of attempts refused now.
    #[doc(hidden)] // How Backstop's layers reach each other; not for users.
    pub fn new(dependency: Dependency, requests: u64, accepts: u64, probability: f64) -> Self {
        Throttled {
            dependency,
            requests,
            accepts,
            probability,
        }
    }

    /// The dependency.
    pub fn dependency(&self) -> &Dependency {
        &self.dependency
    }
}

impl fmt::Display for Throttled {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} is shedding load (it accepted {} of the last {} attempts), so this client \
             refused the call itself, without sending it (adaptive throttling refuses {:.0} % of \
             calls now)",
            self.dependency,
            self.accepts,
            self.requests,
            self.probability * 100.0
        )
    }
}

impl Error for Throttled {}

/// An attempt was not sent: it would exceed a quota its dependency advertises (requests or
/// tokens per window, as `backstop-quota` reads them), and the quota does not come back before
/// the call's deadline, or the attempt costs more than the whole quota. The side effect is
/// [`Outcome::NotSent`]; [`retry_in`](Self::retry_in) says when the quota comes back.
#[derive(Clone, Debug)]
pub struct OverQuota {
    dependency: Dependency,
    unit: &'static str,
    limit: Option<u64>,
    remaining: u64,
    cost: u64,
    retry_in: Option<Duration>,
}

impl OverQuota {
    /// A refusal for `dependency`: the attempt costs `cost` of `unit` (`"tokens"`), of which
    /// `remaining` are left of `limit`; the quota comes back in `retry_in` (`None`: the attempt
    /// costs more than the whole quota).
    #[doc(hidden)] // How Backstop's layers reach each other; not for users.
    pub fn new(
        dependency: Dependency,
        unit: &'static str,
        limit: Option<u64>,
        remaining: u64,
        cost: u64,
        retry_in: Option<Duration>,
    ) -> Self {
        OverQuota {
            dependency,
            unit,
            limit,
            remaining,
            cost,
            retry_in,
        }
    }

    /// The dependency.
    pub fn dependency(&self) -> &Dependency {
        &self.dependency
    }

    /// When the quota comes back; `None` when the attempt costs more than the whole quota.
    pub fn retry_in(&self) -> Option<Duration> {
        self.retry_in
    }
}

impl fmt::Display for OverQuota {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (dependency, unit, cost) = (&self.dependency, self.unit, self.cost);
        match (self.retry_in, self.limit) {
            (None, Some(limit)) => write!(
                f,
                "the call needs {cost} {unit}, more than the whole quota {dependency} allows                  ({limit} {unit} a window), so it was not sent: make it smaller"
            ),
            (retry_in, limit) => {
                write!(
                    f,
                    "the call needs {cost} {unit} and {dependency}'s quota has {} left",
                    self.remaining
                )?;
                if let Some(limit) = limit {
                    write!(f, " of {limit}")?;
                }
                write!(f, ", so it was not sent")?;
                if let Some(t) = retry_in {
                    write!(
                        f,
                        " (the quota comes back in {}, after this call's deadline)",
                        HumanDuration::rounded_up(t)
                    )?;
                }
                Ok(())
            }
        }
    }
}

impl Error for OverQuota {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn human_durations() {
        let cases = [
            (Duration::from_millis(350), "350 ms"),
            (Duration::from_secs(2), "2 s"),
            (Duration::from_millis(1500), "1.5 s"),
            (Duration::from_secs(27), "27 s"),
            (Duration::from_secs(1200), "20 min"),
            (Duration::from_secs(61), "61 s"),
            (Duration::from_micros(5), "5 us"),
            (Duration::ZERO, "0 ms"),
        ];
        for (d, want) in cases {
            assert_eq!(HumanDuration(d).to_string(), want);
        }
    }

    #[test]
    fn circuit_open_messages_tell_the_model_what_to_do() {
        let e = CircuitOpen::new(
            "carrier-api".into(),
            CircuitState::Open,
            Some(Duration::from_millis(26_200)),
        );
        assert_eq!(
            e.to_string(),
            "carrier-api is unavailable (circuit open); do not retry now; try again in 27 s"
        );
        let e = CircuitOpen::new("billing-api".into(), CircuitState::Isolated, None);
        assert!(
            e.to_string().ends_with("do not retry now; tell the user"),
            "{e}"
        );
        let e = CircuitOpen::new("x".into(), CircuitState::HalfOpen, None);
        assert!(e.to_string().contains("trial call is in progress"), "{e}");
    }

    #[test]
    fn messages_name_the_dependency() {
        let e = AttemptTimedOut::new(Some("carrier-api".into()), Duration::from_secs(3));
        assert_eq!(
            e.to_string(),
            "carrier-api did not reply within the 3 s attempt timeout"
        );
        let e = DeadlineExceeded::new(None, Outcome::NotSent);
        assert!(e.to_string().contains("the dependency"), "{e}");
    }
}
