use crate::{
    AttemptGate, CloneResend, HttpResend, Policy, Resend, RetryBudget, StandardPolicy,
    future::{Call, ResponseFuture},
    parts::{Settings, Shared},
};
use backstop_backoff::{Backoff, RngSource};
use backstop_classify::{Classify, HttpClassifier};
use backstop_core::{
    BoxError, ByAuthority, Deadline, Dependency, DependencyKey, HasExtensions, InvalidConfig,
    ReplaySafe, RetryScope,
};
use backstop_timeout::BoundLatency;
use std::{
    fmt,
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll, ready},
    time::Duration,
};
use tokio::time::{Instant, Sleep};
use tower_layer::Layer;
use tower_service::Service;

/// The default number of attempts: one call and two retries.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 3;

/// Applies [`Retry`] to a service. Configuration only: `Clone`, and every service it builds
/// shares the policy's parts (the RNG source, the budget) and the gate.
///
/// What the layer does is fixed (it copies the request, waits, polls readiness again, ends the
/// call once); whether and when it retries is its [`Policy`]'s: [`StandardPolicy`] unless
/// [`policy`](Self::policy) replaces it. `max_attempts`, `backoff`, `rng` and `budget` configure
/// the standard policy.
///
/// ```
/// use backstop_core::BoxError;
/// use backstop_retry::{RetryHistory, RetryLayer};
/// use http_body_util::Full;
/// use std::sync::{Arc, atomic::{AtomicU32, Ordering}};
/// use tower::{Layer, ServiceExt, service_fn};
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() -> Result<(), BoxError> {
/// let calls = Arc::new(AtomicU32::new(0));
/// let seen = calls.clone();
/// // Busy once (503), then it answers.
/// let search = service_fn(move |_req: http::Request<Full<bytes::Bytes>>| {
///     let status = if seen.fetch_add(1, Ordering::SeqCst) == 0 { 503 } else { 200 };
///     async move { Ok::<_, BoxError>(http::Response::builder().status(status).body(())?) }
/// });
/// let svc = RetryLayer::http().dependency("search-api").max_attempts(2)?.layer(search);
/// let res = svc.oneshot(http::Request::get("http://search.local/q").body(Full::default())?).await?;
/// assert_eq!(res.status(), 200);
/// assert_eq!(RetryHistory::of(&res).map(RetryHistory::sent), Some(2));
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct RetryLayer<C, P = CloneResend, K = Dependency, Pol = StandardPolicy> {
    classifier: C,
    resend: P,
    key: K,
    policy: Pol,
    settings: Settings,
}

impl<C: fmt::Debug, P: fmt::Debug, K: fmt::Debug, Pol: fmt::Debug> fmt::Debug
    for RetryLayer<C, P, K, Pol>
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = &self.settings;
        f.debug_struct("RetryLayer")
            .field("classifier", &self.classifier)
            .field("resend", &self.resend)
            .field("dependency", &self.key)
            .field("policy", &self.policy)
            .field("deadline", &s.deadline)
            .field("attempt_timeout", &s.attempt_timeout)
            .field("latency", &s.latency)
            .field("gate", &s.gate)
            .finish()
    }
}

impl<C> RetryLayer<C> {
    /// Retries with `classifier`, copying requests by `Clone`, for one dependency:
    /// a dependency of its own ([`Dependency::unnamed`]) until
    /// [`dependency`](Self::dependency) names it. Three attempts, full
    /// jitter from 200 ms up to 5 s, no budget: the [`StandardPolicy`].
    pub fn new(classifier: C) -> Self {
        RetryLayer {
            classifier,
            resend: CloneResend,
            key: Dependency::unnamed(),
            policy: StandardPolicy::new(),
            settings: Settings::default(),
        }
    }
}

impl RetryLayer<HttpClassifier, HttpResend, ByAuthority> {
    /// Retries HTTP requests: the default [`HttpClassifier`], [`HttpResend`], and one
    /// dependency per URI authority unless [`dependency`](Self::dependency) names it.
    pub fn http() -> Self {
        RetryLayer::new(HttpClassifier::new())
            .resend(HttpResend)
            .dependency_key(ByAuthority)
    }
}

impl<C, P, K> RetryLayer<C, P, K, StandardPolicy> {
    /// The most attempts per logical call, the first one included (3 by default). Zero is
    /// rejected: a call is always attempted once.
    pub fn max_attempts(mut self, n: u32) -> Result<Self, InvalidConfig> {
        self.policy = self.policy.max_attempts(n)?;
        Ok(self)
    }

    /// The backoff between attempts when the dependency gives no `Retry-After`.
    #[must_use]
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.policy = self.policy.backoff(backoff);
        self
    }

    /// Where the jitter comes from; seed it for reproducible tests and simulations.
    #[must_use]
    pub fn rng(mut self, rng: RngSource) -> Self {
        self.policy = self.policy.rng(rng);
        self
    }

    /// The per-dependency retry budget: paid into once per call and asked for every retry by
    /// the standard policy. One that also admits attempts (client-side adaptive throttling) is
    /// asked before every attempt and told how each ended.
    #[must_use]
    pub fn budget(mut self, budget: Arc<dyn RetryBudget>) -> Self {
        self.settings.throttle = budget.admits().then(|| budget.clone());
        self.policy = self.policy.budget(budget);
        self
    }

    /// What the layer is configured to allow a call: attempts, attempt timeout, deadline.
    pub fn limits(&self) -> Limits {
        Limits {
            max_attempts: self.policy.attempts().get(),
            attempt_timeout: self.settings.attempt_timeout,
            deadline: self.settings.deadline,
        }
    }
}

impl<C, P, K, Pol> RetryLayer<C, P, K, Pol> {
    /// Replaces the classifier.
    pub fn classifier<C2>(self, classifier: C2) -> RetryLayer<C2, P, K, Pol> {
        RetryLayer {
            classifier,
            resend: self.resend,
            key: self.key,
            policy: self.policy,
            settings: self.settings,
        }
    }

    /// Replaces how requests are copied for each attempt ([`Resend`]).
    pub fn resend<P2>(self, resend: P2) -> RetryLayer<C, P2, K, Pol> {
        RetryLayer {
            classifier: self.classifier,
            resend,
            key: self.key,
            policy: self.policy,
            settings: self.settings,
        }
    }

    /// Names the one dependency every request goes to.
    pub fn dependency(self, name: impl Into<Dependency>) -> RetryLayer<C, P, Dependency, Pol> {
        self.dependency_key(name.into())
    }

    /// Derives the dependency from each request. A [`Dependency`] already in the request's
    /// extensions (put there by the caller) wins.
    pub fn dependency_key<K2>(self, key: K2) -> RetryLayer<C, P, K2, Pol> {
        RetryLayer {
            classifier: self.classifier,
            resend: self.resend,
            key,
            policy: self.policy,
            settings: self.settings,
        }
    }

    /// Replaces the policy that decides after each attempt whether and when to retry (see
    /// [`Policy`] for one of one's own).
    pub fn policy<Pol2>(self, policy: Pol2) -> RetryLayer<C, P, K, Pol2> {
        RetryLayer {
            classifier: self.classifier,
            resend: self.resend,
            key: self.key,
            policy,
            settings: self.settings,
        }
    }

    /// An overall deadline for each call, attempts and waits included, kept by this layer
    /// itself (a caller's tighter deadline on the request still wins). Waits never cross it,
    /// an attempt still in flight when it passes is cut (`DeadlineExceeded`, outcome
    /// unknown), and layers further in see it through [`Deadline::of`]. Equivalent to a
    /// `DeadlineLayer` just outside, without its own future and timer.
    #[must_use]
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.settings.deadline = Some(deadline);
        self
    }

    /// A limit on each attempt (Envoy's `per_try_timeout`): an attempt still running after it
    /// ends with `AttemptTimedOut` (outcome unknown, retryable when replay-safe). The last
    /// attempt is cut to the deadline instead when that comes first (`DeadlineExceeded`). The
    /// timer is only created for an attempt that does not finish at once. Equivalent to an
    /// `AttemptTimeoutLayer` just inside this layer.
    #[must_use]
    pub fn attempt_timeout(mut self, limit: Duration) -> Self {
        self.settings.attempt_timeout = Some(limit);
        self
    }

    /// Each attempt's limit learned from the dependency's observed latency (a high percentile
    /// of its successful attempts, doubled for each retry, within a floor and a ceiling; a
    /// fallback until enough samples exist) instead of a fixed
    /// [`attempt_timeout`](Self::attempt_timeout). Every successful attempt is recorded, and
    /// every attempt the learned limit cut is counted apart (a few leave the limit where the
    /// answers put it; more than the percentile's tail raise it); the deadline still bounds
    /// every attempt. Only replay-safe requests (an idempotent method, a key the dependency
    /// honours, [`ReplaySafe`]) are planned from and recorded in it: an attempt cut there may be
    /// sent again. Any other request keeps the fixed `attempt_timeout`, since a cut would leave
    /// its outcome unknown for good, and its latency stays out of the record its reads learn.
    #[must_use]
    pub fn attempt_timeout_from_latency(mut self, latency: BoundLatency) -> Self {
        self.settings.latency = Some(latency);
        self
    }

    /// Asks `gate` before every attempt and tells it how each ended: typically the
    /// dependency's circuit breaker. See [`AttemptGate`].
    #[must_use]
    pub fn gate(mut self, gate: Arc<dyn AttemptGate>) -> Self {
        self.settings.gate = Some(gate);
        self
    }

    /// Declares the inner service a **leaf client** (hyper-util's `Client`, a `reqwest::Client`,
    /// tonic's `Channel`, or a service of one's own that calls no Backstop layer): each
    /// attempt's request is sent without the call context (the retry-scope mark, the
    /// dependency, the deadline, the attempt's end), which nothing there would read. That
    /// spares each call the request's extension map (three allocations and about a fifth of
    /// the layer's cost per call).
    ///
    /// Only for a leaf: a retry layer further in would not see that this one retries and
    /// would retry too (three attempts each: nine in all), and a layer further in that reads
    /// the deadline would not see it. Without this, every inner service gets the context,
    /// wherever it runs (in `call`, in a future, behind a `Buffer`'s task).
    #[must_use]
    pub fn leaf_client(mut self) -> Self {
        self.settings.leaf = true;
        self
    }
}

/// What a [`RetryLayer`] allows each call, from [`RetryLayer::limits`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Limits {
    /// The most attempts per call, the first one included.
    pub max_attempts: u32,
    /// The limit on each attempt, if any.
    pub attempt_timeout: Option<Duration>,
    /// The layer's own deadline over each call, if any.
    pub deadline: Option<Duration>,
}

impl<S, C: Clone, P: Clone, K: Clone, Pol: Clone> Layer<S> for RetryLayer<C, P, K, Pol> {
    type Service = Retry<S, C, P, K, Pol>;

    fn layer(&self, inner: S) -> Self::Service {
        Retry {
            inner,
            key: self.key.clone(),
            policy: self.policy.clone(),
            shared: Arc::new(Shared {
                classifier: self.classifier.clone(),
                resend: self.resend.clone(),
                settings: self.settings.clone(),
            }),
            unready: None,
            expired: None,
        }
    }
}

/// Retries failed attempts of a call when it is safe and useful; see the crate docs.
///
/// tower's readiness contract: `poll_ready` answers what the inner service answers, and `call`
/// sends the first attempt on the very handle that was polled ready (it moves into the call's
/// future, and a fresh clone stays here for the next call). Each retry polls that handle's
/// readiness again before it is sent, within the deadline.
///
/// `Clone`: clones share the classifier, the copier and the policy's parts.
pub struct Retry<S, C, P = CloneResend, K = Dependency, Pol = StandardPolicy> {
    inner: S,
    /// How each request's dependency is found.
    key: K,
    /// Cloned for each call.
    policy: Pol,
    shared: Arc<Shared<C, P>>,
    /// The layer's deadline, running since the inner service first answered `Pending` in this
    /// wait for readiness.
    unready: Option<Pin<Box<Sleep>>>,
    /// The inner service did not become ready within the layer's deadline, waited for since
    /// this instant: the next call ends at once, not sent, and says how long it waited.
    expired: Option<Instant>,
}

impl<S: Clone, C, P, K: Clone, Pol: Clone> Clone for Retry<S, C, P, K, Pol> {
    fn clone(&self) -> Self {
        Retry {
            inner: self.inner.clone(),
            key: self.key.clone(),
            policy: self.policy.clone(),
            shared: self.shared.clone(),
            unready: None,
            expired: None,
        }
    }
}

impl<S: fmt::Debug, C, P, K, Pol: fmt::Debug> fmt::Debug for Retry<S, C, P, K, Pol> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Retry")
            .field("inner", &self.inner)
            .field("policy", &self.policy)
            .finish()
    }
}

impl<S, C, P, K, Pol> Retry<S, C, P, K, Pol> {
    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }
    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, Req, C, P, K, Pol> Service<Req> for Retry<S, C, P, K, Pol>
where
    S: Service<Req, Error: Into<BoxError>, Response: HasExtensions> + Clone,
    Req: HasExtensions,
    C: Classify<Req, S::Response, S::Error>,
    P: Resend<Req>,
    K: DependencyKey<Req>,
    Pol: Policy<Req, S::Response>,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = ResponseFuture<(S, Req, C, P, Pol)>;

    /// What the inner service answers: `Pending` while it is not ready. With a
    /// [`deadline`](RetryLayer::deadline), a wait longer than the deadline answers `Ready`
    /// instead, and the call that follows ends at once with `DeadlineExceeded`, not sent: a
    /// client that never becomes ready does not hold its caller past the deadline.
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        if let Poll::Ready(ready) = self.inner.poll_ready(cx) {
            // Ready after all (or failed): whatever the wait did is over, and a call sent now
            // goes out on this handle.
            self.unready = None;
            self.expired = None;
            return Poll::Ready(ready.map_err(Into::into));
        }
        // Readiness already answered stays answered until the call.
        if self.expired.is_some() {
            return Poll::Ready(Ok(()));
        }
        let Some(limit) = self.shared.settings.deadline else {
            return Poll::Pending;
        };
        let timer = self
            .unready
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        ready!(timer.as_mut().poll(cx));
        self.expired = Some(timer.deadline() - limit);
        self.unready = None;
        Poll::Ready(Ok(()))
    }

    #[inline]
    fn call(&mut self, req: Req) -> Self::Future {
        // An outer retry layer owns retrying: one attempt here (still gated and timed), under
        // this layer's own dependency name, and none of the call-level work.
        let nested = RetryScope::is_owned_by(&req, crate::owner());
        let shared = self.shared.clone();
        let dependency = match Dependency::on(&req) {
            Some(d) if !nested => d.clone(),
            _ => self.key.dependency(&req),
        };
        // The clock is read once per call: the budget and the deadline share the reading. A call
        // whose service never became ready started when the wait for it did.
        let expired = self.expired.take();
        let now = expired.unwrap_or_else(Instant::now);
        // The earlier of the request's deadline (the caller's, or an outer layer's) and this
        // layer's own.
        let own = shared
            .settings
            .deadline
            .map(|budget| Deadline::after_from(now, budget));
        let deadline = match (Deadline::of(&req), own) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        // The handle polled ready goes with the call; a fresh clone stays for the next one.
        let clone = self.inner.clone();
        let svc = std::mem::replace(&mut self.inner, clone);
        let ready = expired.is_none();
        // A learned limit plans only attempts that may be sent again once cut.
        let learned = shared.settings.latency.is_some()
            && (ReplaySafe::is_marked(&req) || shared.classifier.is_replay_safe(&req));
        let policy = self.policy.clone();
        let call = Call::new(
            svc, shared, policy, dependency, deadline, nested, learned, now,
        );
        ResponseFuture::new(call, req, ready)
    }
}
