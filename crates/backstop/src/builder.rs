use crate::{DeadLetterSink, call::Reconcile};
use backstop_backoff::{Backoff, RngSource};
use backstop_breaker::Breaker;
use backstop_budget::{AdaptiveThrottle, Budget};
use backstop_classify::HttpClassifier;
use backstop_core::Dependency;
use backstop_idempotency::{HttpKeys, IdempotencyLayer, RandomKey, ToolKeys};
use backstop_retry::{CloneResend, HttpResend, StandardPolicy};
use backstop_timeout::LatencyTimeouts;
use std::{fmt, sync::Arc, time::Duration};

/// The default overall deadline of a call: 30 s.
pub const DEFAULT_DEADLINE: Duration = Duration::from_secs(30);
/// The default attempt timeout when no p99 is given: 10 s.
pub const DEFAULT_ATTEMPT_TIMEOUT: Duration = Duration::from_secs(10);

/// How the call's side effects are treated: one preset per kind of action.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Preset {
    /// Mutating calls get an idempotency key (derived when the request carries an
    /// `ActionContext`, random otherwise); the classifier decides the rest.
    #[default]
    Standard,
    /// Read-only (search, database read): retried freely, whatever the method; no key.
    ReadOnly,
    /// Record creation: a key is required, from the caller or the runtime (an `ActionContext`
    /// or `IdempotencyKey` on the request); without one the call is not sent.
    Create,
    /// Payment or transfer: a required key, as for `Create`, plus a reconciliation hook that
    /// receives every call whose outcome stayed unknown.
    Payment,
    /// Destructive action: never retried automatically (one attempt).
    Destructive,
}

/// Builds the whole Backstop stack for one dependency, in the one right order:
///
/// ```text
/// call (idempotency key, call span, errors, dead letters) -> deadline -> retry (budget) -> throttle -> pace -> breaker -> attempt timeout -> service
/// ```
///
/// The call's work, once per logical call, around tower layers of one concern each, in that
/// order.
///
/// The deadline layer sits outside the retry layer: waits never cross it, the attempt timeout
/// cuts the last attempt to fit it, and a caller's tighter deadline on the request wins.
///
/// Defaults: 3 attempts; full jitter from 200 ms to 5 s; a 30 s deadline; a 10 s attempt timeout
/// (or 2.5 x the p99 latency you give, rounded up to 100 ms: p99 1.2 s -> 3 s); the process-wide
/// retry budget (10 % of requests, at least 1/s, per dependency) and circuit breaker (5 failures in a row
/// or 50 % of 20+ calls in 30 s, 30 s cooldown), shared by every stack of the process that names
/// the same dependency unless you pass your own. Every piece can be replaced or turned off.
///
/// [`build`](Self::build) validates the configuration and says which setting to change.
///
/// ```
/// use backstop::{Backstop, Preset};
/// use std::time::Duration;
///
/// let layer = Backstop::http("carrier-api")
///     .preset(Preset::Create)
///     .p99(Duration::from_millis(1200))
///     .build()
///     .unwrap();
/// assert_eq!(layer.attempt_timeout(), Duration::from_secs(3));
///
/// let err = Backstop::http("carrier-api")
///     .deadline(Duration::from_secs(2))
///     .attempt_timeout(Duration::from_secs(5))
///     .build()
///     .unwrap_err();
/// assert!(err.to_string().contains("shorten attempt_timeout"));
/// ```
pub struct Backstop<C, P, I, Pol = StandardPolicy> {
    pub(crate) dependency: Dependency,
    pub(crate) classifier: C,
    pub(crate) resend: P,
    pub(crate) keys: IdempotencyLayer<I, RandomKey>,
    pub(crate) preset: Preset,
    pub(crate) max_attempts: Option<u32>,
    pub(crate) backoff: Backoff,
    pub(crate) rng: Option<RngSource>,
    pub(crate) deadline: Option<Duration>,
    pub(crate) attempt_timeout: Option<Duration>,
    pub(crate) latency: Option<LatencyTimeouts>,
    pub(crate) p99: Option<Duration>,
    pub(crate) budget: Option<Option<Budget>>,
    pub(crate) throttle: Option<AdaptiveThrottle>,
    #[cfg(feature = "quota")]
    pub(crate) quotas: Option<backstop_quota::Quotas>,
    pub(crate) breaker: Option<Option<Breaker>>,
    pub(crate) idempotency: bool,
    pub(crate) honours_keys: bool,
    pub(crate) attempt_header: Option<http::HeaderName>,
    pub(crate) time_left_header: Option<http::HeaderName>,
    pub(crate) sink: Option<Arc<dyn DeadLetterSink>>,
    pub(crate) reconcile: Option<Reconcile>,
    pub(crate) otel: crate::telemetry::Otel,
    /// Makes the stack's policy from the standard one the settings configure.
    pub(crate) policy: MakePolicy<Pol>,
}

impl<C: fmt::Debug, P, I, Pol> fmt::Debug for Backstop<C, P, I, Pol> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Backstop")
            .field("dependency", &self.dependency)
            .field("classifier", &self.classifier)
            .field("preset", &self.preset)
            .field("max_attempts", &self.max_attempts)
            .field("deadline", &self.deadline)
            .field("attempt_timeout", &self.attempt_timeout)
            .field("p99", &self.p99)
            .finish_non_exhaustive()
    }
}

impl Backstop<HttpClassifier, HttpResend, HttpKeys> {
    /// The stack for HTTP calls to `dependency` (hyper-util's client, reqwest through tower,
    /// any `Service<http::Request<B>>` whose body can be copied).
    pub fn http(dependency: impl Into<Dependency>) -> Self {
        Self::with(
            dependency.into(),
            HttpClassifier::new(),
            HttpResend,
            IdempotencyLayer::http(),
        )
    }
}

impl<P> Backstop<HttpClassifier, P, HttpKeys> {
    /// Where the key goes: the header's name and its value's format (`Idempotency-Key`, plain,
    /// by default). The classifier reads the same header, so the key the stack sends and the
    /// header that makes a request replay-safe are always the same one.
    ///
    /// ```
    /// use backstop::{Backstop, idempotency::KeyFormat};
    /// use http::HeaderName;
    ///
    /// let stack = Backstop::http("payments-api")
    ///     .idempotency_header(HeaderName::from_static("x-idempotency-key"), KeyFormat::StructuredField)
    ///     .build()?;
    /// # Ok::<(), backstop::core::InvalidConfig>(())
    /// ```
    #[must_use]
    pub fn idempotency_header(
        mut self,
        name: http::HeaderName,
        format: backstop_idempotency::KeyFormat,
    ) -> Self {
        self.classifier = self.classifier.idempotency_header(name.clone());
        self.keys = self.keys.header(name).format(format);
        self
    }

    /// Sends each attempt's number (1 on the first) under `name`, so the server can tell a
    /// retry from a first try (as Envoy's `x-envoy-attempt-count`). Off by default. Nested
    /// stacks send the outermost layer's number.
    #[must_use]
    pub fn attempt_header(mut self, name: http::HeaderName) -> Self {
        self.attempt_header = Some(name);
        self
    }

    /// Sends each attempt's time left (until its attempt timeout cuts it, within the deadline;
    /// whole milliseconds, rounded up) under `name`, conventionally
    /// [`TIME_LEFT_HEADER`](backstop_core::TIME_LEFT_HEADER), where a server's
    /// [`CallerDeadlineLayer`](backstop_timeout::CallerDeadlineLayer) reads it: the server stops
    /// its own outbound calls when the caller's time is up, and starts nothing for a caller
    /// whose time is spent. Off by default (a header on every attempt is a cost on every call);
    /// gRPC stacks send `grpc-timeout` and MCP stacks `_meta["dev.backstop/time-left-ms"]`
    /// always.
    #[must_use]
    pub fn time_left_header(mut self, name: http::HeaderName) -> Self {
        self.time_left_header = Some(name);
        self
    }
}

impl<C> Backstop<C, CloneResend, ToolKeys> {
    /// The stack for non-HTTP tool calls to `dependency`: requests are copied by `Clone`,
    /// carry their key through `KeyedRequest`, and `classifier` judges their results. In the
    /// composed stack errors reach the classifier boxed (`BoxError`), so implement
    /// `Classify<Req, Res, BoxError>`, or generically over `E: AsError`.
    pub fn tools(dependency: impl Into<Dependency>, classifier: C) -> Self {
        Self::with(
            dependency.into(),
            classifier,
            CloneResend,
            IdempotencyLayer::tool_calls(),
        )
    }
}

impl<C, P, I> Backstop<C, P, I> {
    pub(crate) fn with(
        dependency: Dependency,
        classifier: C,
        resend: P,
        keys: IdempotencyLayer<I, RandomKey>,
    ) -> Self {
        Backstop {
            dependency,
            classifier,
            resend,
            keys,
            preset: Preset::Standard,
            max_attempts: None,
            backoff: Backoff::default(),
            rng: None,
            deadline: Some(DEFAULT_DEADLINE),
            attempt_timeout: None,
            latency: None,
            p99: None,
            budget: None,
            throttle: None,
            #[cfg(feature = "quota")]
            quotas: None,
            breaker: None,
            idempotency: true,
            honours_keys: false,
            attempt_header: None,
            time_left_header: None,
            sink: None,
            reconcile: None,
            otel: crate::telemetry::Otel::default(),
            policy: Box::new(|standard| standard),
        }
    }
}

impl<C, P, I, Pol> Backstop<C, P, I, Pol> {
    /// Records every attempt and every call into `telemetry`'s OpenTelemetry instruments:
    /// `http.client.request.duration` per attempt (its HTTP attributes on the attempt's span
    /// too), Backstop's per-call duration and attempts, and for a gRPC stack the per-call
    /// metrics of gRPC's A96 (the table in [`backstop::otel`](crate::otel)). Off by
    /// default: a stack without it records nothing. Feature `otel`.
    #[cfg(feature = "otel")]
    #[must_use]
    pub fn telemetry(mut self, telemetry: backstop_otel::Telemetry) -> Self {
        self.otel.telemetry = Some(telemetry);
        self
    }

    /// How side effects are treated (see [`Preset`]).
    #[must_use]
    pub fn preset(mut self, preset: Preset) -> Self {
        self.preset = preset;
        self
    }

    /// Attempts per call, the first included (3; 1 for [`Preset::Destructive`]).
    #[must_use]
    pub fn max_attempts(mut self, n: u32) -> Self {
        self.max_attempts = Some(n);
        self
    }

    /// The backoff between attempts (full jitter, 200 ms to 5 s).
    #[must_use]
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = backoff;
        self
    }

    /// The jitter's random source; seed it for reproducible tests and simulations.
    #[must_use]
    pub fn rng(mut self, rng: RngSource) -> Self {
        self.rng = Some(rng);
        self
    }

    /// The overall deadline of a call, attempts and waits included (30 s). A tighter deadline
    /// the caller puts on the request wins.
    #[must_use]
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.deadline = Some(deadline);
        self
    }

    /// No deadline of the stack's own (a caller's deadline on the request still applies to the
    /// retry waits and attempt timeouts).
    #[must_use]
    pub fn no_deadline(mut self) -> Self {
        self.deadline = None;
        self
    }

    /// Each attempt's timeout (10 s unless [`p99`](Self::p99) is given).
    #[must_use]
    pub fn attempt_timeout(mut self, timeout: Duration) -> Self {
        self.attempt_timeout = Some(timeout);
        self
    }

    /// Each attempt's timeout learned from the dependency's observed latency instead of a fixed
    /// one: `factor` x a high percentile of its successful attempts (2 x p99 by default),
    /// doubled for each retry, within a floor and a ceiling, and a fallback until enough
    /// samples exist ([`LatencyConfig`](backstop_timeout::LatencyConfig)). Only replay-safe
    /// calls (reads, keys the dependency honours) are timed by it and teach it: a write that is
    /// not replay-safe keeps the fixed attempt timeout (`attempt_timeout`, `p99`), since a cut
    /// would leave its outcome unknown for good, and its latency does not pull its reads'
    /// limit. The deadline bounds every attempt either way.
    /// One `LatencyTimeouts` given to several stacks learns from all their calls; its current
    /// value is on each attempt's span (`attempt_timeout_ms`) and, with `metrics`, in
    /// `backstop_attempt_timeout_seconds`.
    #[must_use]
    pub fn attempt_timeout_from_latency(mut self, timeouts: LatencyTimeouts) -> Self {
        self.latency = Some(timeouts);
        self
    }

    /// The dependency's observed p99 latency: the attempt timeout becomes 2.5 x p99, rounded up
    /// to 100 ms (p99 1.2 s -> 3 s), unless [`attempt_timeout`](Self::attempt_timeout) is set.
    #[must_use]
    pub fn p99(mut self, p99: Duration) -> Self {
        self.p99 = Some(p99);
        self
    }

    /// The retry budget ([`Budget::process_wide`] otherwise).
    #[must_use]
    pub fn budget(mut self, budget: Budget) -> Self {
        self.budget = Some(Some(budget));
        self
    }

    /// No retry budget: only the attempt count bounds retries.
    #[must_use]
    pub fn no_budget(mut self) -> Self {
        self.budget = Some(None);
        self
    }

    /// Client-side adaptive throttling beside the retry budget: every attempt, first or retry,
    /// is refused here with the probability the throttle gives when the dependency has been
    /// shedding load (its accepts fall below half of the attempts, with the default K of 2),
    /// and the call stops with an error of kind `Throttled`, nothing sent. Retries are still
    /// bounded by the retry budget (unless `no_budget`). One throttle given to several stacks
    /// learns from all their calls.
    #[must_use]
    pub fn adaptive_throttle(mut self, throttle: AdaptiveThrottle) -> Self {
        self.throttle = Some(throttle);
        self
    }

    /// Paces every attempt, first or retry, to the quotas the dependency advertises in its
    /// responses' headers (requests and tokens per window: `backstop::quota`), inside the retry
    /// layer and outside the breaker: an attempt the quota has no room for waits for its reset
    /// within the deadline, spread with the other callers of that reset, or ends at once with
    /// an error of kind `OverQuota`, nothing sent, saying when the quota comes back. A request's
    /// `Cost` (tokens) is charged beside its one request. One `Quotas` given to several stacks
    /// paces them against one account. Feature `quota`; HTTP stacks read the headers, others
    /// pace only to what a layer of theirs puts in the responses' extensions (`Told`).
    #[cfg(feature = "quota")]
    #[must_use]
    pub fn pace(mut self, quotas: backstop_quota::Quotas) -> Self {
        self.quotas = Some(quotas);
        self
    }

    /// The circuit breaker ([`Breaker::process_wide`] otherwise).
    #[must_use]
    pub fn breaker(mut self, breaker: Breaker) -> Self {
        self.breaker = Some(Some(breaker));
        self
    }

    /// No circuit breaker.
    #[must_use]
    pub fn no_breaker(mut self) -> Self {
        self.breaker = Some(None);
        self
    }

    /// Declares that the dependency honours idempotency keys (it runs a keyed request once and
    /// replays the stored result to repeats, as Backstop's `ReplayLayer` does): then a key the
    /// stack derives or generates makes a lost reply safe to repeat. Without it only a key the
    /// caller set, or the `Create` and `Payment` presets (which require keys), do; a key the
    /// stack minted on its own is still sent, but a mutating call whose outcome is unknown is
    /// not repeated on its strength, and its error says how to declare this.
    #[must_use]
    pub fn honours_keys(mut self) -> Self {
        self.honours_keys = true;
        self
    }

    /// No idempotency keys: mutating requests are sent as they are (and not repeated after a
    /// lost reply unless they carry a key of their own).
    #[must_use]
    pub fn no_idempotency(mut self) -> Self {
        self.idempotency = false;
        self
    }

    /// Where failed mutating calls go (with run id, key and cause): every mutating call that
    /// ends in an [`Error`](crate::Error). A final 5xx or 429 returned as a response (with its
    /// `RetryHistory`) writes no letter.
    #[must_use]
    pub fn dead_letters(mut self, sink: Arc<dyn DeadLetterSink>) -> Self {
        self.sink = Some(sink);
        self
    }

    /// Called for every mutating call whose outcome stayed unknown, to start reconciliation
    /// (ask the provider what happened, using the key). Required by [`Preset::Payment`].
    #[must_use]
    pub fn reconcile(mut self, hook: impl Fn(&crate::DeadLetter) + Send + Sync + 'static) -> Self {
        self.reconcile = Some(Arc::new(hook));
        self
    }

    /// The stack's retry policy: `wrap` gets the [`StandardPolicy`] this builder's settings
    /// configure (attempts, backoff, budget) and returns the policy the retry layer asks after
    /// every attempt, typically one of one's own around it (see [`Policy`](crate::retry::Policy)).
    ///
    /// ```
    /// use backstop::{Backstop, classify::Verdict, retry::{Attempt, Policy, StandardPolicy, StopReason}};
    /// use std::time::Duration;
    ///
    /// /// Never waits longer than a second between attempts.
    /// #[derive(Clone)]
    /// struct Impatient(StandardPolicy);
    ///
    /// impl<Req: backstop::HasExtensions, Res> Policy<Req, Res> for Impatient {
    ///     fn retry(&mut self, attempt: &Attempt<'_, Req, Res>) -> Result<Duration, StopReason> {
    ///         self.0.retry(attempt).map(|wait| wait.min(Duration::from_secs(1)))
    ///     }
    /// }
    ///
    /// let layer = Backstop::http("search-api").policy(Impatient).build().unwrap();
    /// assert_eq!(layer.max_attempts(), 3);
    /// ```
    pub fn policy<Pol2>(
        self,
        wrap: impl FnOnce(StandardPolicy) -> Pol2 + Send + 'static,
    ) -> Backstop<C, P, I, Pol2> {
        self.with_parts(|classifier, _| (classifier, Box::new(wrap)))
    }

    /// Replaces the classifier.
    pub fn classifier<C2>(self, classifier: C2) -> Backstop<C2, P, I, Pol> {
        self.with_parts(|_, policy| (classifier, policy))
    }
}

/// How a builder makes its stack's policy.
type MakePolicy<Pol> = Box<dyn FnOnce(StandardPolicy) -> Pol + Send>;

impl<C, P, I, Pol> Backstop<C, P, I, Pol> {
    /// This builder's settings with the classifier and the policy `parts` makes from its own.
    fn with_parts<C2, Pol2>(
        self,
        parts: impl FnOnce(C, MakePolicy<Pol>) -> (C2, MakePolicy<Pol2>),
    ) -> Backstop<C2, P, I, Pol2> {
        let (classifier, policy) = parts(self.classifier, self.policy);
        Backstop {
            dependency: self.dependency,
            classifier,
            resend: self.resend,
            keys: self.keys,
            preset: self.preset,
            max_attempts: self.max_attempts,
            backoff: self.backoff,
            rng: self.rng,
            deadline: self.deadline,
            attempt_timeout: self.attempt_timeout,
            latency: self.latency,
            p99: self.p99,
            budget: self.budget,
            throttle: self.throttle,
            #[cfg(feature = "quota")]
            quotas: self.quotas,
            breaker: self.breaker,
            idempotency: self.idempotency,
            honours_keys: self.honours_keys,
            attempt_header: self.attempt_header,
            time_left_header: self.time_left_header,
            sink: self.sink,
            reconcile: self.reconcile,
            otel: self.otel,
            policy,
        }
    }
}
