//! Backstop: tower middleware that makes outbound calls safe to retry.
//!
//! A network call can succeed on the server while its reply is lost; the caller sees a timeout,
//! retries, and the customer is refunded twice. Backstop retries only what is safe to retry,
//! in one place, within a deadline:
//!
//! - [`classify`]: every attempt becomes a verdict (success, retryable, fatal) together with what
//!   is known of its side effect (not sent, unknown, completed). `Retry-After` is read in both
//!   forms.
//! - [`backoff`]: full jitter by default (`random(0, min(5 s, 200 ms * 2^n))`), seedable.
//! - [`timeout`]: a per-attempt timeout and an overall deadline that covers attempts and
//!   backoff sleeps, always inside the caller's own deadline.
//! - [`retry`]: the one retry layer. A timeout means *unknown*, so a request that is not
//!   replay-safe (a POST without an idempotency key) is not repeated after one.
//! - [`budget`]: retries per dependency stay within 10 % of requests (plus 1 per second), so an
//!   outage is not multiplied by the retry count.
//! - [`breaker`]: a circuit breaker per dependency that fails fast with an honest message
//!   ("carrier-api is unavailable (circuit open); do not retry now; try again in 27 s").
//! - [`idempotency`]: one key per intended action, derived deterministically and sent on every
//!   attempt, which makes a POST replay-safe.
//! - [`replay`]: the server side of the same contract: a layer that runs a keyed request once
//!   and replays its stored result to every repeat.
//!
//! Stack them in this order, outermost first: idempotency key, deadline, retry (its policy with
//! the budget), breaker, attempt timeout, the client. Each is a tower `Layer` of its own; the
//! [`Backstop`] builder stacks them in this order behind the call's work (key, span, one error,
//! dead letters), with the breaker asked by the retry layer before each attempt. By hand:
//!
//! ```
//! use backstop::{
//!     breaker::Breaker,
//!     budget::Budget,
//!     retry::RetryLayer,
//!     timeout::{AttemptTimeoutLayer, DeadlineLayer},
//! };
//! use std::sync::Arc;
//! use bytes::Bytes;
//! use http_body_util::Full;
//! use hyper_util::{client::legacy::Client, rt::TokioExecutor};
//! use std::time::Duration;
//! use tower::{ServiceBuilder, ServiceExt};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), backstop::BoxError> {
//! # let server = backstop_testkit::TestServer::start(|_| backstop_testkit::Action::status(200)).await;
//! // One budget and one breaker for the whole process: every stack shares their state.
//! let budget = Budget::default();
//! let breaker = Breaker::default();
//!
//! let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
//! let carrier = ServiceBuilder::new()
//!     .layer(DeadlineLayer::new(Duration::from_secs(10)))
//!     .layer(RetryLayer::http().dependency("carrier-api").budget(Arc::new(budget.clone())))
//!     .layer(backstop::breaker::http_layer(breaker.clone()))
//!     .layer(AttemptTimeoutLayer::new(Duration::from_secs(3)))
//!     .service(client);
//!
//! let req = http::Request::get(server.url("/labels/4812")).body(Full::default())?;
//! let res = carrier.oneshot(req).await?;
//! assert_eq!(res.status(), 200);
//! # Ok(())
//! # }
//! ```
#![forbid(unsafe_code)]
// docs.rs (nightly, `--cfg docsrs`) badges every item behind a feature with it.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![deny(missing_docs)]

mod attempt_header;
mod box_errors;
mod build;
mod builder;
mod call;
mod dead_letter;
#[cfg(feature = "dead-letters-redis")]
mod dead_letter_stream;
mod error;
#[cfg(feature = "grpc")]
mod grpc_stack;
#[cfg(feature = "journal")]
mod journaled;
#[cfg(feature = "mcp")]
mod mcp_stack;
#[cfg(feature = "reqwest")]
mod reqwest_client;
mod service;
mod telemetry;
mod transport;

pub use builder::{Backstop, DEFAULT_ATTEMPT_TIMEOUT, DEFAULT_DEADLINE, Preset};
#[cfg(feature = "json")]
pub use dead_letter::JsonLinesSink;
pub use dead_letter::{DeadLetter, DeadLetterSink, MemorySink};
pub use error::{Error, ErrorKind};
pub use service::{BackstopLayer, BackstopService};

/// The stack's future type.
pub mod future {
    pub use crate::service::BackstopFuture;
}

#[doc(inline)]
pub use backstop_core::{
    BoxError, CircuitOpen, Deadline, Dependency, DependencyKey, HasExtensions, Outcome, ReplaySafe,
    Run, Throttled, WithExtensions,
};

// Each type has one path here: the vocabulary every layer shares is at the root or in `core`,
// each extension point in the module of its concern, and nothing twice.

/// Classification: for one attempt, whether it succeeded, may be tried again or must not be,
/// and what is known of its side effect.
///
/// Retrying is safe only when two questions have answers. *Is the failure transient?* A `503` or
/// a reset may pass; a `400` fails the same way every time. *Could the attempt have taken
/// effect?* A refused connection did nothing; a timeout only says the reply was lost. A
/// [`Verdict`](classify::Verdict) answers both, and the retry layer repeats an attempt whose
/// outcome is [`Outcome::Unknown`](crate::Outcome) only for a replay-safe request (an idempotent
/// method, an idempotency key, a [`ReplaySafe`] marker).
///
/// [`HttpClassifier`](classify::HttpClassifier) retries timeouts, resets, 408, 429 and 5xx (not
/// 501), never another 4xx, and honours `Retry-After` in both forms (capped);
/// [`classify_error`](classify::classify_error) reads an error's cause chain (Backstop's own
/// errors, hyper's, reqwest's, `io::ErrorKind`s). A non-HTTP tool call implements
/// [`Classify`](classify::Classify) for its own types.
///
/// ```
/// use backstop::{Outcome, classify::{Classify, HttpClassifier, Verdict}};
///
/// let classifier = HttpClassifier::new();
/// let busy = http::Response::builder().status(503).header("retry-after", "2").body(()).unwrap();
/// let verdict = Classify::<http::Request<()>, _, backstop::BoxError>::classify(&classifier, Ok(&busy));
/// assert!(verdict.is_retryable());
/// assert_eq!(verdict.retry_after(), Some(std::time::Duration::from_secs(2)));
/// let bad = http::Response::builder().status(400).body(()).unwrap();
/// let verdict = Classify::<http::Request<()>, _, backstop::BoxError>::classify(&classifier, Ok(&bad));
/// assert_eq!(verdict, Verdict::Fatal { outcome: Outcome::Completed });
/// ```
pub mod classify {
    #[doc(inline)]
    pub use backstop_classify::{
        AsError, HttpClassifier, StatusClass, classify_error, is_attempt_timeout,
        parse_retry_after, parse_retry_after_value,
    };
    #[doc(inline)]
    pub use backstop_core::{Classify, Verdict};
}

/// Backoff schedules: how long to wait before each retry.
///
/// Clients that fail together and retry on one fixed schedule hit a recovering dependency
/// together, again and again; jitter spreads them out. The default is **full jitter**,
/// `random(0, min(cap, base * 2^n))` with a 200 ms base and a 5 s cap (the AWS Architecture
/// Blog's comparison found it does the least total work); equal and decorrelated jitter,
/// exponential and constant delays are there too. A [`Backoff`](backoff::Backoff) is validated
/// when it is built; delays are drawn from an RNG you can seed
/// ([`RngSource::seeded`](backoff::RngSource::seeded)), so tests get the same delays every run.
///
/// ```
/// use backstop::backoff::{Backoff, RngSource};
/// use std::time::Duration;
///
/// let mut rng = RngSource::seeded(7).rng();
/// let mut schedule = Backoff::default().schedule();
/// let first = schedule.next_delay(&mut rng);
/// assert!(first <= Duration::from_millis(200));
/// assert!(Backoff::full_jitter(Duration::from_secs(5), Duration::from_secs(1)).is_err());
/// ```
pub mod backoff {
    #[doc(inline)]
    pub use backstop_backoff::{Backoff, DEFAULT_BASE, DEFAULT_CAP, RngSource, Schedule};
}

/// Timeouts everywhere: per attempt, over the whole call, and over the response body.
///
/// [`DeadlineLayer`](timeout::DeadlineLayer) bounds the whole logical call (every attempt and
/// every backoff sleep) and records its [`Deadline`] in the request, where a
/// caller's tighter one wins; [`AttemptTimeoutLayer`](timeout::AttemptTimeoutLayer) bounds one
/// attempt by `min(attempt timeout, time left)`, so the last attempt ends at the deadline;
/// [`BodyTimeoutLayer`](timeout::BodyTimeoutLayer) keeps that same end over the response body
/// (a body that stops after the headers ends with [`BodyTimedOut`](timeout::BodyTimedOut)).
/// The composed stack ([`Backstop`]) does all three itself; these layers are
/// for stacks composed by hand.
///
/// Choose the attempt timeout from observed latency (p99 1.2 s -> 3 s with
/// [`Backstop::p99`](crate::Backstop::p99)). A timed-out attempt's side effect is *unknown*,
/// never "failed", and the errors say so.
pub mod timeout {
    #[doc(inline)]
    pub use backstop_timeout::{
        AttemptCutoff, AttemptTimeout, AttemptTimeoutLayer, BodyTimedOut, BodyTimeout,
        BodyTimeoutLayer, BoundLatency, DeadlineLayer, DeadlinePassed, Expiry, LatencyConfig,
        LatencyTimeouts, LearnedTimeout, LearnedTimeoutLayer, TimedBody, WithDeadline, future,
    };
}

/// The one retry layer, and the [`Policy`](retry::Policy) that decides for it.
///
/// The layer drives a call (it keeps a copy of the request, waits, polls readiness again, ends
/// the call once); after each attempt its policy decides whether another follows and after how
/// long. The [`StandardPolicy`](retry::StandardPolicy) retries only when the classifier calls
/// the attempt retryable, the side effect is known not to have happened **or** the request is
/// replay-safe, attempts are left, the wait (the server's `Retry-After`, else the backoff) ends
/// before the deadline, the dependency's retry budget (and a [`Run`]'s, when the call belongs to
/// one) allows it, and the request can be copied ([`Resend`](retry::Resend);
/// [`BufferBodyLayer`](retry::BufferBodyLayer) makes a streamed body copyable up to a limit).
/// Each of those rules is a part a policy of one's own can keep, swap or drop.
///
/// **Retries happen in exactly one place**: the outermost retry layer marks the call in the
/// request's extensions, and every retry layer further in makes a single attempt, so three
/// nested stacks make 3 attempts, not 27, however the inner stack is called. `poll_ready`
/// answers what the inner service answers; each retry waits for readiness again, bounded by
/// the deadline ([`DeadlineLayer`](timeout::DeadlineLayer) says what readiness does before the
/// first attempt).
///
/// When it stops it says why: a [`RetryError`](retry::RetryError) (or, for a retryable
/// response it could not retry, the response with a [`RetryHistory`](retry::RetryHistory))
/// names the dependency, the attempts, the time, the cause, the
/// [`StopReason`](retry::StopReason) and what is known of the side effect, in words a model can
/// act on. The composed stack turns it into [`Error`].
///
/// ```
/// use backstop::{backoff::RngSource, retry::RetryLayer};
/// use std::sync::{Arc, atomic::{AtomicU32, Ordering}};
/// use tower::{Layer, ServiceExt, service_fn};
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() {
/// let calls = Arc::new(AtomicU32::new(0));
/// let seen = calls.clone();
/// let flaky = service_fn(move |_req: http::Request<http_body_util::Full<bytes::Bytes>>| {
///     let status = if seen.fetch_add(1, Ordering::SeqCst) < 2 { 503 } else { 200 };
///     async move { Ok::<_, std::io::Error>(http::Response::builder().status(status).body(()).unwrap()) }
/// });
/// let svc = RetryLayer::http().dependency("rates-api").rng(RngSource::seeded(1)).layer(flaky);
/// let res = svc.oneshot(http::Request::get("http://rates.local/eur").body(Default::default()).unwrap()).await.unwrap();
/// assert_eq!((res.status().as_u16(), calls.load(Ordering::SeqCst)), (200, 3));
/// # }
/// ```
pub mod retry {
    #[doc(inline)]
    pub use backstop_core::{CallContext, Claim, RetryScope, ScopeOwner};
    #[doc(inline)]
    pub use backstop_retry::{
        Attempt, AttemptRecord, Budgets, BufferBody, BufferBodyLayer, BufferedBody, CallWaits,
        CloneResend, DEFAULT_MAX_ATTEMPTS, DeadlineFit, Hedge, HedgeLayer, Hedging, HttpResend,
        MaxAttempts, NotCopyable, Policy, ReplaySafety, Resend, ResendableBody, Retry, RetryError,
        RetryHistory, RetryLayer, StandardPolicy, StopReason, Waits, future, retried_outside,
    };
}

/// The per-dependency retry budget: retries as a share of requests.
///
/// "Three attempts" bounds the load one call adds, not the load an outage adds (3x the traffic
/// on a dependency already failing). A [`Budget`](budget::Budget) allows a retry only while
/// `retries <= max(ratio * requests, floor * window)` over a sliding window: by default **10 %
/// over 10 s, at least 1 retry per second**, after the Google SRE book's per-client budget, so
/// 1,000 calls to a dependency that always fails make at most 1,100 attempts. The counters are
/// lock-free and can never overshoot; state is kept per [`Dependency`] in a
/// bounded registry. [`Budget::process_wide`](budget::Budget::process_wide) is the one every
/// stack shares unless given its own.
///
/// ```
/// use backstop::{Dependency, budget::{Budget, BudgetConfig, RetryBudget}};
///
/// let budget = Budget::new(BudgetConfig::default().ratio(0.1).min_retries_per_sec(0.0)).unwrap();
/// let carrier = Dependency::new("carrier-api");
/// let now = tokio::time::Instant::now();
/// for _ in 0..20 { budget.deposit(&carrier, now); }
/// assert!(budget.withdraw(&carrier) && budget.withdraw(&carrier)); // 10 % of 20
/// assert!(!budget.withdraw(&carrier));
/// ```
pub mod budget {
    #[doc(inline)]
    pub use backstop_budget::{
        AdaptiveThrottle, Budget, BudgetConfig, BudgetStats, DependencyBudget, Throttle,
        ThrottleConfig, ThrottleLayer, ThrottleStats, future,
    };
    #[doc(inline)]
    pub use backstop_core::{NoBudget, RetryBudget};
}

/// The per-dependency circuit breaker: fail fast, with an honest message.
///
/// After 5 failures in a row, or 50 % of at least 20 calls in 30 s, a dependency's circuit
/// **opens**: calls fail at once, not sent, with an error a model can act on ("carrier-api is
/// unavailable (circuit open); do not retry now; try again in 27 s"). After the cooldown (30 s)
/// it turns **half-open** and lets one trial through; a success closes it, a failure opens it
/// again. A trial whose future is dropped gives its slot back. What counts comes from the
/// classifier: retryable failures count, answers (2xx to 4xx) are successes, a call never sent
/// counts for nothing. Operators can [`isolate`](breaker::Breaker::isolate) and
/// [`reset`](breaker::Breaker::reset) a dependency; every transition is traced and counted.
///
/// ```
/// use backstop::{Backstop, ErrorKind, breaker::{Breaker, BreakerConfig}};
/// use bytes::Bytes;
/// use http_body_util::Full;
/// use tower::{Layer, ServiceExt, service_fn};
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() {
/// let breaker = Breaker::new(BreakerConfig::default().consecutive_failures(2)).unwrap();
/// let down = service_fn(|_req: http::Request<Full<Bytes>>| async {
///     Ok::<_, std::io::Error>(http::Response::builder().status(503).body(Full::<Bytes>::default()).unwrap())
/// });
/// let carrier = Backstop::http("breaker-doc-api").breaker(breaker).max_attempts(1).build().unwrap().layer(down);
/// let get = || http::Request::get("http://carrier.local/rates").body(Full::default()).unwrap();
/// for _ in 0..2 { assert_eq!(carrier.clone().oneshot(get()).await.unwrap().status(), 503); }
/// let err = carrier.oneshot(get()).await.unwrap_err();
/// assert_eq!(err.kind(), ErrorKind::Unavailable);
/// # }
/// ```
pub mod breaker {
    #[doc(inline)]
    pub use backstop_breaker::{
        Breaker, BreakerConfig, BreakerLayer, CircuitBreaker, CircuitStats, CircuitTransition,
        Permit, future,
    };
    #[cfg(feature = "fleet-breaker")]
    #[doc(inline)]
    pub use backstop_breaker::{Fleet, FleetConfig, FleetStats};
    #[doc(inline)]
    pub use backstop_core::CircuitState;

    /// A breaker layer for HTTP: the default [`HttpClassifier`](crate::classify::HttpClassifier)
    /// judges each result, and each URI authority has its own circuit unless
    /// [`dependency`](BreakerLayer::dependency) names one.
    ///
    /// ```
    /// use backstop::breaker::{Breaker, BreakerConfig, http_layer};
    /// use tower::{Layer, ServiceExt, service_fn};
    ///
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)]
    /// # async fn main() {
    /// let breaker = Breaker::new(BreakerConfig::default().consecutive_failures(1)).unwrap();
    /// let down = service_fn(|_req: http::Request<()>| async {
    ///     Ok::<_, std::io::Error>(http::Response::builder().status(503).body(()).unwrap())
    /// });
    /// let svc = http_layer(breaker).dependency("carrier-api").layer(down);
    /// assert_eq!(svc.clone().oneshot(http::Request::new(())).await.unwrap().status(), 503);
    /// assert!(svc.oneshot(http::Request::new(())).await.is_err(), "open: refused");
    /// # }
    /// ```
    pub fn http_layer(
        breaker: Breaker,
    ) -> BreakerLayer<backstop_classify::HttpClassifier, backstop_core::ByAuthority> {
        BreakerLayer::new(breaker, backstop_classify::HttpClassifier::new())
            .dependency_key(backstop_core::ByAuthority)
    }
}

/// Per-dependency shared state: the bounded registry and sliding counters the budget and the
/// breaker keep their state in.
///
/// [`Registry`](state::Registry) maps a [`Dependency`] to its state, sharded
/// and **bounded**: past its bound a new name takes the place of the least recently used idle
/// entry, or gets state of its own that is not kept, so a million distinct hosts cannot exhaust
/// memory and no two dependencies ever share a budget or a circuit.
/// [`SlidingCount`](state::SlidingCount) counts events over a sliding window, one atomic word
/// per bucket, so no update is lost when a bucket rolls over (checked with loom), and a clock
/// advanced by years still counts.
pub mod state {
    #[doc(inline)]
    pub use backstop_state::{Registry, SlidingCount};
}

/// Idempotency keys on the client: one key per intended *action*, reused on every attempt.
///
/// A key lets the server recognise a repeat and return the original result; a new key per
/// attempt defeats it. [`IdempotencyKey`](idempotency::IdempotencyKey) is validated (1 to 255
/// visible ASCII characters, nothing that can smuggle a header line); keys are derived
/// deterministically from an [`ActionContext`](idempotency::ActionContext), from the run, step
/// and tool-call ids or from the run, the tool and its RFC 8785 canonical arguments, so the same
/// action in the same run always gets the same key; [`IdempotencyLayer`](idempotency::IdempotencyLayer)
/// injects it **once per logical call, before the retry loop** (an `Idempotency-Key` header, or
/// a [`KeyedRequest`](idempotency::KeyedRequest) for other tool calls). A key the stack minted
/// is sent but does not, alone, make a lost reply repeatable: a caller's key,
/// [`Backstop::honours_keys`](crate::Backstop::honours_keys) or the presets that require keys
/// do.
///
/// ```
/// use backstop::idempotency::ActionContext;
///
/// let a = ActionContext::tool_call("run-91f2", "step-3", "call-07").key();
/// let b = ActionContext::tool_call("run-91f2", "step-3", "call-07").key();
/// let c = ActionContext::tool_call("run-91f2", "step-4", "call-08").key();
/// assert_eq!(a, b);
/// assert_ne!(a, c);
/// ```
pub mod idempotency {
    #[doc(inline)]
    pub use backstop_idempotency::{
        ActionContext, HttpKeys, IdempotencyKey, IdempotencyLayer, Inject, InvalidKey, KeyFormat,
        KeyedRequest, MAX_KEY_LEN, MakeKey, NoKey, RandomKey, SetIdempotencyKey, ToolKeys, future,
    };
}

/// Server-side idempotency: run a keyed request once, replay its result to every repeat.
/// Feature `replay` (Redis with `redis`, PostgreSQL with `postgres`).
///
/// Put [`ReplayLayer`](replay::ReplayLayer) in front of a non-idempotent endpoint: the key
/// (`Idempotency-Key`) is scoped by the authenticated [`Principal`](replay::Principal), the
/// request fingerprinted, and the key **claimed** atomically in the store. A completed key with
/// the same fingerprint is replayed (`Idempotent-Replayed: true`); with another, `422`; still
/// running, `409` with `Retry-After`. The claimant runs the handler **in a task of its own**, so
/// a client that gives up stops neither the handler nor its claim; the claim's lease is renewed
/// while it runs, every store write carries a fencing token, and a handler that ends without a
/// response leaves `outcome-unknown`, never a second run. An unreachable store fails closed
/// (`503`). Errors are `application/problem+json`.
///
/// Middleware cannot close one window: a crash after the effect is committed and before its
/// result is stored. [`ReplayLayer::transactional`](replay::ReplayLayer) (feature `postgres`)
/// commits the stored result in the handler's own transaction; or keep the key in a `UNIQUE`
/// column of the effect's table.
#[cfg(feature = "replay")]
pub mod replay {
    #[doc(inline)]
    pub use backstop_replay::{
        BodyError, Claim, Fingerprint, Lease, MemoryStore, Principal, Replay, ReplayLayer,
        ReplayRequestBody, ReplayResponseBody, ReplayStore, StoreError, StoreFuture,
        StoredResponse, decode, encode, future, scope_of,
    };
    #[cfg(feature = "redis")]
    #[doc(inline)]
    pub use backstop_replay::{OnVolatile, Persistence, RedisStore};
    #[cfg(feature = "postgres")]
    #[doc(inline)]
    pub use backstop_replay::{PgStore, PgTransaction};
}

/// The durable step journal: every tool call's transitions written before they matter,
/// reconcile before retry, resume after a crash, park during outages (SQLite; PostgreSQL with
/// `journal-postgres`). Feature `journal`. [`HttpJudge`](journal::HttpJudge) reads an HTTP
/// response the way the retry layer does.
#[cfg(feature = "journal")]
pub mod journal {
    pub use crate::journaled::HttpJudge;
    #[doc(inline)]
    pub use backstop_journal::{
        ByOutcome, CallArgs, CallIdentity, CallResult, Change, Clock, ForkPoint, Journal,
        JournalError, JournalLayer, Journaled, JournaledError, Judge, NewStep, Next, Reconcile,
        Reconciled, Reconcilers, RequestLine, Resolution, ResumeReport, RunContext, RunEnd,
        RunError, RunEvent, RunFilter, RunOutcome, RunRecord, RunReport, RunState, RunSummary,
        StatedArgs, Step, StepArgs, StepId, StepKind, StepState, StepTransition, UnknownState,
        Worker, WorkflowResult, digest,
    };
}

/// `reqwest::Client` under the stack: [`ReqwestService`](reqwest::ReqwestService), or
/// [`BackstopLayer::reqwest`] in one call. Feature `reqwest`.
#[cfg(feature = "reqwest")]
pub mod reqwest {
    #[cfg(feature = "reqwest-middleware")]
    pub use crate::reqwest_client::BackstopMiddleware;
    pub use crate::reqwest_client::ReqwestService;
}

/// Dead letters on a Redis stream: [`RedisStreamSink`](dead_letters_redis::RedisStreamSink)
/// writes them off the call's path (a bounded queue, drops counted), and
/// [`DeadLetterStream`](dead_letters_redis::DeadLetterStream) reads them with a consumer group
/// and acknowledges the settled ones. Feature `dead-letters-redis`.
#[cfg(feature = "dead-letters-redis")]
pub mod dead_letters_redis {
    pub use crate::dead_letter_stream::{
        DeadLetterStream, RedisStreamSink, StreamConfig, StreamLetter, StreamStats,
    };
}

/// The fault layer: lose replies after the service acted, reset or refuse connections, answer
/// with a status, delay replies, at seeded rates (`backstop-chaos`). Feature `chaos`.
#[cfg(feature = "chaos")]
pub mod chaos {
    #[doc(inline)]
    pub use backstop_chaos::{
        Chaos, ChaosError, ChaosLayer, ChaosStats, FaultPlan, StatusReply, future,
    };
}

/// MCP tool calls both ways: [`Backstop::mcp`] builds the stack for a tool server's calls
/// ([`McpClassifier`](mcp::McpClassifier), keys in `_meta`, each tool's policy from its
/// annotations), and [`ToolReplayLayer`](mcp::ToolReplayLayer) (with feature `replay`) runs a keyed call once on the
/// server. Feature `mcp`; with `rmcp`, the official SDK's client and server handler
/// ([`mcp::rmcp`]).
#[cfg(feature = "mcp")]
pub mod mcp {
    #[doc(inline)]
    pub use backstop_mcp::{
        META_ERROR, META_KEY, META_KEY_ALIAS, META_REPLAYED, McpClassifier, RpcError, ToolCall,
        ToolCatalog, ToolError, ToolHints, ToolPolicy, ToolResult, codes, trace, verdict_of,
        verdict_of_rpc,
    };
    /// The tool servers' replay (feature `replay`).
    #[cfg(feature = "replay")]
    #[doc(inline)]
    pub use backstop_mcp::{ToolReplay, ToolReplayLayer};

    /// tower-mcp's router under the stack, and its per-tool replay layer. Feature `tower-mcp`.
    #[cfg(feature = "tower-mcp")]
    pub mod tower_mcp {
        #[doc(inline)]
        pub use backstop_mcp::tower_mcp::{
            KeyFromHeader, KeyFromHeaderLayer, RouterClient, from_result, to_result,
        };
        #[cfg(feature = "replay")]
        #[doc(inline)]
        pub use backstop_mcp::tower_mcp::{PerToolReplay, PerToolReplayError, PerToolReplayLayer};
    }

    /// rmcp's client and server handler under the stack. Feature `rmcp`.
    #[cfg(feature = "rmcp")]
    pub mod rmcp {
        pub use crate::mcp_stack::error_result;
        #[doc(inline)]
        #[cfg(feature = "replay")]
        #[doc(inline)]
        pub use backstop_mcp::rmcp::ReplayHandler;
        #[doc(inline)]
        pub use backstop_mcp::rmcp::{
            KeyHeader, RmcpClient, from_error_data, from_rmcp_response, from_rmcp_result,
            from_service_error, hints_of, to_error_data, to_params, to_rmcp_response,
            to_rmcp_result,
        };
    }
}

/// OpenTelemetry's instruments for the stack (`backstop-otel`): give a [`Telemetry`](otel::Telemetry)
/// to [`Backstop::telemetry`], and install [`OtelRecorder`](otel::OtelRecorder) for the counts
/// kept through `metrics`. Feature `otel`.
#[cfg(feature = "otel")]
pub mod otel {
    #[doc(inline)]
    pub use backstop_otel::{
        AttemptMetrics, AttemptMetricsLayer, CallRecord, INSTRUMENTS, OtelRecorder, Telemetry,
        future,
    };
}

/// The rest of the vocabulary every layer shares (the most used of it is at the crate root).
pub mod core {
    #[doc(inline)]
    pub use backstop_core::{
        AttemptLimit, AttemptTimedOut, ByAuthority, CauseChain, DeadlineExceeded, DeadlineWords,
        HumanDuration, InvalidConfig, ReportsOutcome, UnvouchedKey, is_idempotent_method,
        known_method,
    };
}

/// gRPC under the stack: [`Backstop::grpc`], the [`GrpcClassifier`](grpc::GrpcClassifier)
/// (gRPC's retry design, A6) and request bodies copied while they stream. Feature `grpc`.
#[cfg(feature = "grpc")]
pub mod grpc {
    #[doc(inline)]
    pub use backstop_classify::{GrpcClassifier, GrpcCode, RETRY_PUSHBACK, grpc_timeout};
    #[doc(inline)]
    pub use backstop_retry::{BodyTee, StreamingResend, TeeReader, TeeableBody};
}
