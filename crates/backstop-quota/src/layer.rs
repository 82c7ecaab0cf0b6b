//! The pacing layer: each attempt admitted against its dependency's quotas, and each response
//! read for what it says of them.

use crate::{
    Cost, Quotas,
    headers::{Advertised, Unit, advertised},
    quotas::{Admission, Answer, Asking, Refusal},
};
use backstop_core::{
    BoxError, CircuitOpen, Deadline, DeadlineExceeded, Dependency, HasExtensions, Outcome,
    OverQuota, ReportsOutcome, Run,
};
use http::{Response, StatusCode};
use pin_project::pin_project;
use std::{
    error::Error as StdError,
    fmt,
    future::Future,
    pin::Pin,
    task::{Context, Poll, ready},
    time::SystemTime,
};
use tokio::time::{Instant, Sleep, sleep_until};
use tower_layer::Layer;
use tower_service::Service;

/// Applies [`Paced`]: every attempt to a dependency waits for the quota its responses advertise
/// instead of meeting a `429`.
///
/// Place it inside the retry layer, so that every attempt is paced, and outside the breaker and
/// the attempt timeout, so that a wait for the quota is neither a failure nor part of an
/// attempt's time. For each attempt:
///
/// - the quotas its dependency advertised (requests, tokens: see [`advertised`]) are asked for
///   one request and the request's [`Cost`] in tokens; when they have enough, it goes now and
///   its cost is reserved until it is answered;
/// - when one has not, it waits for that quota's reset, within the call's deadline; callers
///   woken by one reset (or by one `Retry-After`) go at instants spread over the quotas' spread
///   after it, so that a fleet of tasks does not come back in the same millisecond;
/// - when the reset comes after the deadline, or the attempt costs more than the whole quota,
///   it ends at once, *not sent*, with an [`OverQuota`] that says when the quota comes back;
/// - what its response says of the quotas ([`Told`], read from the headers by
///   [`ReadQuotasLayer`] next to the client) replaces what was known: the server's remaining
///   figure, less what is still in flight since; a `429` or `503` that gives only `Retry-After`
///   (seconds) or `retry-after-ms` closes the dependency's requests until then.
///
/// An attempt of a call whose [`Run`] has a spend ceiling ([`Run::spend_ceiling`]) is charged
/// its cost when it goes; one that would pass the ceiling ends at once, not sent, with the run's
/// `RunSpent`.
///
/// Before the first response, nothing is known and nothing waits. Alone, each process paces
/// against what the server says is left; processes that share one quota share one account
/// through Redis with `Quotas::join_fleet` (feature `fleet`).
///
/// ```
/// use backstop_core::{BoxError, Dependency};
/// use backstop_quota::{Cost, QuotaLayer, Quotas, ReadQuotasLayer, Unit};
/// use std::time::Duration;
/// use tower::{ServiceBuilder, ServiceExt, service_fn};
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() -> Result<(), BoxError> {
/// // An LLM API that allows 3,000 tokens a minute and says so on every response.
/// let api = service_fn(|_req: http::Request<()>| async {
///     let res = http::Response::builder()
///         .header("x-ratelimit-limit-tokens", "3000")
///         .header("x-ratelimit-remaining-tokens", "1000")
///         .header("x-ratelimit-reset-tokens", "60s")
///         .body(())?;
///     Ok::<_, BoxError>(res)
/// });
/// let quotas = Quotas::seeded(Duration::ZERO, 7);
/// let svc = ServiceBuilder::new()
///     .layer(QuotaLayer::new(quotas.clone()).dependency("llm-api"))
///     .layer(ReadQuotasLayer) // right over the client: each response's quota headers
///     .service(api);
/// let prompt = |tokens| {
///     let mut req = http::Request::new(());
///     req.extensions_mut().insert(Cost::tokens(tokens));
///     req
/// };
/// svc.clone().oneshot(prompt(2000)).await?;
/// let llm = Dependency::from("llm-api");
/// assert_eq!(quotas.remaining(&llm, Unit::Tokens), Some(1000));
///
/// // 1,500 tokens do not fit in the 1,000 left: the call waits for the reset, a minute.
/// let started = tokio::time::Instant::now();
/// svc.oneshot(prompt(1500)).await?;
/// assert_eq!(started.elapsed(), Duration::from_secs(60));
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct QuotaLayer {
    quotas: Quotas,
    dependency: Dependency,
}

impl QuotaLayer {
    /// Attempts paced against `quotas`, for one dependency: a dependency of its own
    /// ([`Dependency::unnamed`]) until [`dependency`](Self::dependency) names it. A
    /// [`Dependency`] the request carries (the retry layer's) wins.
    pub fn new(quotas: Quotas) -> Self {
        QuotaLayer {
            quotas,
            dependency: Dependency::unnamed(),
        }
    }

    /// Names the dependency of requests that carry none.
    #[must_use]
    pub fn dependency(mut self, name: impl Into<Dependency>) -> Self {
        self.dependency = name.into();
        self
    }
}

impl<S> Layer<S> for QuotaLayer {
    type Service = Paced<S>;
    fn layer(&self, inner: S) -> Paced<S> {
        Paced {
            inner,
            layer: self.clone(),
        }
    }
}

/// Paces attempts to the quotas their dependency advertises: see [`QuotaLayer`].
#[derive(Clone, Debug)]
pub struct Paced<S> {
    inner: S,
    layer: QuotaLayer,
}

impl<S> Paced<S> {
    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S, Req> Service<Req> for Paced<S>
where
    S: Service<Req, Response: HasExtensions> + Clone,
    S::Error: Into<BoxError>,
    Req: HasExtensions,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = PacedFuture<S, Req>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Req) -> Self::Future {
        // The handle polled ready goes with the call; a clone stays behind.
        let clone = self.inner.clone();
        let ready = std::mem::replace(&mut self.inner, clone);
        let pacing = Pacing {
            quotas: self.layer.quotas.clone(),
            dependency: Dependency::of(&req).unwrap_or_else(|| self.layer.dependency.clone()),
            cost: req.extensions().get::<Cost>().copied().unwrap_or_default(),
            deadline: Deadline::of(&req).map(Deadline::instant),
            run: Run::of(&req).cloned(),
        };
        let state = pacing.next(ready, req, true);
        PacedFuture { pacing, state }
    }
}

/// What an attempt is paced by.
#[derive(Clone, Debug)]
struct Pacing {
    quotas: Quotas,
    dependency: Dependency,
    cost: Cost,
    deadline: Option<Instant>,
    /// The run the call belongs to: each attempt sent is charged to its spend ceiling.
    run: Option<Run>,
}

impl Pacing {
    /// Asks the fleet, or this process's quotas, and goes, waits or ends accordingly.
    fn next<S: Service<Req> + Clone, Req>(&self, svc: S, req: Req, spread: bool) -> State<S, Req> {
        match self.quotas.ask_fleet(&self.dependency, self.cost) {
            Some(asking) => State::Asking {
                asking,
                svc: Some((svc, req)),
                spread,
            },
            None => self.alone(svc, req, spread),
        }
    }

    /// Paced by this process's own account.
    fn alone<S: Service<Req> + Clone, Req>(&self, svc: S, req: Req, spread: bool) -> State<S, Req> {
        let now = Instant::now();
        match self
            .quotas
            .admit(&self.dependency, self.cost, now, self.deadline, spread)
        {
            Admission::Now => self.send(svc, req, None),
            Admission::At(at) => self.wait(at, svc, req),
            Admission::Refused(r) => State::Refused(Some(self.refusal(r).into())),
        }
    }

    /// Paced by the fleet's answer.
    fn answered<S: Service<Req> + Clone, Req>(
        &self,
        answer: Answer,
        svc: S,
        req: Req,
    ) -> State<S, Req> {
        match answer {
            Answer::Go { generation } => {
                self.quotas
                    .reserve(&self.dependency, self.cost, Instant::now());
                self.send(svc, req, Some(generation))
            }
            Answer::Wait(r) => {
                let reset = Instant::now() + r.after.unwrap_or_default();
                if self.deadline.is_some_and(|d| reset >= d) {
                    return State::Refused(Some(self.refusal(r).into()));
                }
                self.wait(self.quotas.spread_after(reset, self.deadline), svc, req)
            }
            Answer::Never(r) => State::Refused(Some(self.refusal(r).into())),
        }
    }

    /// Waits until `at`. The handle polled ready is dropped meanwhile, so that what its
    /// readiness holds (a concurrency limit's permit, a buffer's slot) serves other calls; a
    /// clone of it is readied once the wait is over.
    fn wait<S: Service<Req> + Clone, Req>(&self, at: Instant, svc: S, req: Req) -> State<S, Req> {
        State::Waiting {
            sleep: Box::pin(sleep_until(at)),
            svc: Some((svc.clone(), req)),
        }
    }

    /// Sends the attempt, its cost reserved (in the fleet's `generation` when the fleet let it
    /// go), unless the run has spent what it may.
    fn send<S: Service<Req>, Req>(
        &self,
        mut svc: S,
        req: Req,
        generation: Option<i64>,
    ) -> State<S, Req> {
        let reservation = Reservation {
            pacing: Some(self.clone()),
            generation,
        };
        if let Some(run) = &self.run
            && let Err(spent) = run.spend(self.cost.tokens)
        {
            reservation.end(false, &[]);
            return State::Refused(Some(spent.into()));
        }
        State::Calling {
            fut: svc.call(req),
            reservation: Some(reservation),
        }
    }

    fn refusal(&self, r: Refusal) -> OverQuota {
        OverQuota::new(
            self.dependency.clone(),
            r.unit.as_str(),
            r.limit,
            r.remaining,
            r.cost,
            r.after,
        )
    }
}

/// An attempt's cost, reserved until it is answered: released as spent (its outcome unknown)
/// if the attempt is dropped first.
#[derive(Debug)]
struct Reservation {
    pacing: Option<Pacing>,
    /// The generation of the fleet's windows the cost was taken in, when the fleet let it go.
    generation: Option<i64>,
}

impl Reservation {
    fn end(mut self, sent: bool, advertised: &[Advertised]) {
        if let Some(p) = self.pacing.take() {
            p.quotas
                .ended(&p.dependency, p.cost, Instant::now(), sent, advertised);
            if let (false, Some(generation)) = (sent, self.generation) {
                p.quotas.give_back(&p.dependency, p.cost, generation);
            }
        }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if let Some(p) = self.pacing.take() {
            p.quotas
                .ended(&p.dependency, p.cost, Instant::now(), true, &[]);
        }
    }
}

/// Response future of [`Paced`].
#[pin_project]
pub struct PacedFuture<S: Service<Req>, Req> {
    pacing: Pacing,
    #[pin]
    state: State<S, Req>,
}

impl<S: Service<Req>, Req> fmt::Debug for PacedFuture<S, Req> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PacedFuture")
            .field("dependency", &self.pacing.dependency)
            .finish_non_exhaustive()
    }
}

#[pin_project(project = StateProj)]
enum State<S: Service<Req>, Req> {
    /// Waiting for the fleet's answer, with the handle polled ready and the request. The
    /// handle keeps its readiness for that one round trip (unlike a wait, which gives it back):
    /// the fleet's "go" reserves quota every process shares, so the attempt is sent at once
    /// rather than holding that reservation while the service readies again.
    Asking {
        asking: Asking,
        svc: Option<(S, Req)>,
        spread: bool,
    },
    /// Waiting for the quota, with a handle not polled ready and the request.
    Waiting {
        sleep: Pin<Box<Sleep>>,
        svc: Option<(S, Req)>,
    },
    /// The wait over: the handle getting ready before the quota is asked again.
    Readying { svc: Option<(S, Req)> },
    /// Sent, its cost reserved.
    Calling {
        #[pin]
        fut: S::Future,
        reservation: Option<Reservation>,
    },
    /// Not sent: the quota does not come back in time ([`OverQuota`]), or the run has spent
    /// what it may (`RunSpent`).
    Refused(Option<BoxError>),
}

impl<S, Req> Future for PacedFuture<S, Req>
where
    S: Service<Req, Response: HasExtensions> + Clone,
    S::Error: Into<BoxError>,
{
    type Output = Result<S::Response, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Asking {
                    asking,
                    svc,
                    spread,
                } => {
                    let answer = ready!(asking.as_mut().poll(cx));
                    let (svc, req) = svc.take().expect("polled after completion");
                    let next = match answer {
                        Some(answer) => this.pacing.answered(answer, svc, req),
                        None => this.pacing.alone(svc, req, *spread),
                    };
                    this.state.set(next);
                }
                StateProj::Waiting { sleep, svc } => {
                    ready!(sleep.as_mut().poll(cx));
                    let svc = svc.take();
                    this.state.set(State::Readying { svc });
                }
                StateProj::Readying { svc } => {
                    let (handle, _) = svc.as_mut().expect("polled after completion");
                    if let Err(e) = ready!(handle.poll_ready(cx)) {
                        return Poll::Ready(Err(e.into()));
                    }
                    let (svc, req) = svc.take().expect("polled after completion");
                    let next = this.pacing.next(svc, req, false);
                    this.state.set(next);
                }
                StateProj::Calling { fut, reservation } => {
                    let result = ready!(fut.poll(cx));
                    let reservation = reservation.take().expect("polled after completion");
                    return Poll::Ready(match result {
                        Ok(res) => {
                            let told = res.extensions().get::<Told>();
                            reservation.end(true, told.map_or(&[], |t| &t.0));
                            Ok(res)
                        }
                        Err(e) => {
                            let e = e.into();
                            reservation.end(!refused(&*e), &[]);
                            Err(e)
                        }
                    });
                }
                StateProj::Refused(refusal) => {
                    let refusal = refusal.take().expect("polled after completion");
                    return Poll::Ready(Err(refusal));
                }
            }
        }
    }
}

/// What a response said of its dependency's quotas, as [`ReadQuotas`] read them from its
/// headers: the response's extension that [`Paced`] learns from.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Told(pub Vec<Advertised>);

impl Told {
    /// What `res` says of its dependency's quotas: its headers as [`advertised`] reads them, and
    /// for a `429` or `503` that gives only `Retry-After` (in seconds), no requests until then.
    pub fn of<B>(res: &Response<B>) -> Told {
        let headers = res.headers();
        let mut found = advertised(headers, SystemTime::now());
        let refused = matches!(
            res.status(),
            StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE
        );
        if refused && found.iter().all(|a| a.remaining != Some(0)) {
            let after = headers
                .get(http::header::RETRY_AFTER)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.trim().parse::<u64>().ok())
                .map(std::time::Duration::from_secs);
            if let Some(after) = after {
                found.retain(|a| a.unit != Unit::Requests);
                found.push(Advertised {
                    unit: Unit::Requests,
                    limit: None,
                    remaining: Some(0),
                    reset: Some(after),
                });
            }
        }
        Told(found)
    }
}

/// Applies [`ReadQuotas`]: each HTTP response's quota headers read into its extensions
/// ([`Told`]), where a [`Paced`] service outside learns from them. Put it right over the
/// client (a Backstop stack built with `pace` does).
#[derive(Clone, Copy, Debug, Default)]
pub struct ReadQuotasLayer;

impl<S> Layer<S> for ReadQuotasLayer {
    type Service = ReadQuotas<S>;
    fn layer(&self, inner: S) -> ReadQuotas<S> {
        ReadQuotas { inner }
    }
}

/// Reads each response's quota headers into its extensions: see [`ReadQuotasLayer`].
#[derive(Clone, Debug)]
pub struct ReadQuotas<S> {
    inner: S,
}

impl<S> ReadQuotas<S> {
    /// Reads `inner`'s responses.
    pub fn new(inner: S) -> Self {
        ReadQuotas { inner }
    }
}

impl<S, Req, B> Service<Req> for ReadQuotas<S>
where
    S: Service<Req, Response = Response<B>>,
{
    type Response = Response<B>;
    type Error = S::Error;
    type Future = ReadQuotasFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Req) -> Self::Future {
        ReadQuotasFuture {
            inner: self.inner.call(req),
        }
    }
}

/// Response future of [`ReadQuotas`].
#[pin_project]
#[derive(Debug)]
pub struct ReadQuotasFuture<F> {
    #[pin]
    inner: F,
}

impl<F, B, E> Future for ReadQuotasFuture<F>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<B>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut res = ready!(self.project().inner.poll(cx))?;
        let told = Told::of(&res);
        if !told.0.is_empty() {
            res.extensions_mut().insert(told);
        }
        Poll::Ready(Ok(res))
    }
}

/// Whether a layer further in refused the attempt before sending it: an open circuit, or a
/// deadline that had passed before the attempt could start.
fn refused(error: &(dyn StdError + 'static)) -> bool {
    let mut next = Some(error);
    while let Some(e) = next {
        if e.is::<CircuitOpen>() {
            return true;
        }
        if let Some(d) = e.downcast_ref::<DeadlineExceeded>() {
            return d.outcome() == Outcome::NotSent;
        }
        next = e.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Advertised;
    use std::time::Duration;
    use tower::{ServiceExt, service_fn};

    /// An attempt refused before it left gives its cost back; one that may have reached the
    /// server keeps it spent.
    #[tokio::test(start_paused = true)]
    async fn a_refused_attempt_gives_its_cost_back() {
        let quotas = Quotas::seeded(Duration::ZERO, 1);
        let llm = Dependency::from("llm");
        quotas.learn(
            &llm,
            &[Advertised {
                unit: Unit::Tokens,
                limit: Some(10_000),
                remaining: Some(1_000),
                reset: Some(Duration::from_secs(60)),
            }],
        );
        let failing = |error: fn() -> BoxError| {
            QuotaLayer::new(quotas.clone())
                .dependency("llm")
                .layer(service_fn(move |_req: http::Request<()>| async move {
                    Err::<http::Response<()>, _>(error())
                }))
        };
        let prompt = || {
            let mut req = http::Request::new(());
            req.extensions_mut().insert(Cost::tokens(600));
            req
        };
        let not_sent = || DeadlineExceeded::new(None, Outcome::NotSent).into();
        assert!(failing(not_sent).oneshot(prompt()).await.is_err());
        assert_eq!(quotas.remaining(&llm, Unit::Tokens), Some(1_000));
        let cut = || DeadlineExceeded::new(None, Outcome::Unknown).into();
        assert!(failing(cut).oneshot(prompt()).await.is_err());
        assert_eq!(quotas.remaining(&llm, Unit::Tokens), Some(400));
    }

    /// An attempt waiting for its quota holds no readiness of the service under it: under a
    /// concurrency limit of one, a call to another dependency goes through while it waits,
    /// and the waiting attempt is sent once its quota comes back.
    #[tokio::test(start_paused = true)]
    async fn an_attempt_waiting_for_its_quota_leaves_the_service_free() {
        let quotas = Quotas::seeded(Duration::ZERO, 1);
        quotas.learn(
            &Dependency::from("llm"),
            &[Advertised {
                unit: Unit::Tokens,
                limit: Some(10_000),
                remaining: Some(0),
                reset: Some(Duration::from_secs(1)),
            }],
        );
        let client = service_fn(|_req: http::Request<()>| async {
            tokio::time::sleep(Duration::from_millis(10)).await;
            Ok::<_, BoxError>(http::Response::new(()))
        });
        let svc = QuotaLayer::new(quotas.clone())
            .dependency("llm")
            .layer(tower::limit::ConcurrencyLimit::new(client, 1));
        let started = Instant::now();
        let mut prompt = http::Request::new(());
        prompt.extensions_mut().insert(Cost::tokens(600));
        let waiting = tokio::spawn(svc.clone().oneshot(prompt));
        tokio::time::sleep(Duration::from_millis(50)).await;
        let mut search = http::Request::new(());
        Dependency::from("search").attach(&mut search);
        svc.clone().oneshot(search).await.unwrap();
        let took = started.elapsed();
        assert!(
            took < Duration::from_millis(500),
            "the other call waited {took:?} for the permit a paced attempt kept"
        );
        waiting.await.unwrap().unwrap();
        assert!(
            started.elapsed() >= Duration::from_secs(1),
            "the prompt waited for its quota"
        );
    }
}
