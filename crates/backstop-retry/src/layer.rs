use crate::{
    CloneResend, Error, HttpResend, Policy, Resend, StandardPolicy, call::Call,
    future::ResponseFuture, parts::Shared,
};
use backstop_backoff::{Backoff, RngSource};
use backstop_classify::{Classify, HttpClassifier};
use backstop_core::{
    BoxError, ByAuthority, CallContext, Deadline, Dependency, DependencyKey, HasExtensions,
    InvalidConfig, RetryBudget,
};
use std::{
    fmt,
    sync::Arc,
    task::{Context, Poll},
};
use tower_layer::Layer;
use tower_service::Service;

/// The default number of attempts: one call and two retries.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 3;

/// Applies [`Retry`] to a service. Configuration only: `Clone`, and every service it builds
/// shares the policy's parts (the RNG source, the budget).
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
}

impl<C: fmt::Debug, P: fmt::Debug, K: fmt::Debug, Pol: fmt::Debug> fmt::Debug
    for RetryLayer<C, P, K, Pol>
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryLayer")
            .field("classifier", &self.classifier)
            .field("resend", &self.resend)
            .field("dependency", &self.key)
            .field("policy", &self.policy)
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
    /// the standard policy.
    #[must_use]
    pub fn budget(mut self, budget: Arc<dyn RetryBudget>) -> Self {
        self.policy = self.policy.budget(budget);
        self
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
        }
    }

    /// Replaces how requests are copied for each attempt ([`Resend`]).
    pub fn resend<P2>(self, resend: P2) -> RetryLayer<C, P2, K, Pol> {
        RetryLayer {
            classifier: self.classifier,
            resend,
            key: self.key,
            policy: self.policy,
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
        }
    }
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
            }),
        }
    }
}

/// Retries failed attempts of a call when it is safe and useful; see the crate docs.
///
/// tower's readiness contract: `poll_ready` answers what the inner service answers, and `call`
/// sends the first attempt on the very handle that was polled ready (it moves into the call's
/// future, and a fresh clone stays here for the next call). Each retry polls that handle's
/// readiness again before it is sent, within the request's [`Deadline`]: a service still not
/// ready when it passes ends the call, the retry not sent.
///
/// `Clone`: clones share the classifier, the copier and the policy's parts.
pub struct Retry<S, C, P = CloneResend, K = Dependency, Pol = StandardPolicy> {
    inner: S,
    /// How each request's dependency is found.
    key: K,
    /// Cloned for each call.
    policy: Pol,
    shared: Arc<Shared<C, P>>,
}

impl<S: Clone, C, P, K: Clone, Pol: Clone> Clone for Retry<S, C, P, K, Pol> {
    fn clone(&self) -> Self {
        Retry {
            inner: self.inner.clone(),
            key: self.key.clone(),
            policy: self.policy.clone(),
            shared: self.shared.clone(),
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
    type Error = Error;
    type Future = ResponseFuture<(S, Req, C, P, Pol)>;

    /// What the inner service answers.
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Error>> {
        self.inner.poll_ready(cx).map_err(|e| Error::new(None, e))
    }

    fn call(&mut self, req: Req) -> Self::Future {
        // An outer retry layer owns retrying: one attempt here (still gated), under
        // this layer's own dependency name, and none of the call-level work.
        let nested = CallContext::of(&req).is_some_and(|c| c.owned_by(crate::owner()));
        let shared = self.shared.clone();
        let dependency = match Dependency::on(&req) {
            Some(d) if !nested => d.clone(),
            _ => self.key.dependency(&req),
        };
        // The caller's deadline, or a deadline layer's outside.
        let deadline = Deadline::of(&req);
        // The handle polled ready goes with the call; a fresh clone stays for the next one.
        let clone = self.inner.clone();
        let svc = std::mem::replace(&mut self.inner, clone);
        let policy = self.policy.clone();
        let call = Call::new(svc, shared, policy, dependency, deadline, nested);
        ResponseFuture::new(call, req)
    }
}
