//! The layer: its builder, which sets which requests it guards, where results are stored, for
//! how long, and what a request must carry (the [`Config`](crate::config::Config) every
//! service of it shares).

use crate::{
    config::{Config, Principal},
    service::Replay,
    store::ReplayStore,
};
use backstop_core::InvalidConfig;
use bytes::Bytes;
use http::{HeaderName, Method, StatusCode, request::Parts};
use std::{fmt, sync::Arc, time::Duration};
use tower_layer::Layer;

/// Makes non-idempotent endpoints safe to call twice; see the crate docs.
///
/// ```
/// use backstop_core::BoxError;
/// use backstop_replay::{MemoryStore, ReplayLayer, ReplayRequestBody};
/// use http_body_util::Full;
/// use std::sync::{Arc, atomic::{AtomicU32, Ordering}};
/// use tower::{Layer, ServiceExt, service_fn};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), BoxError> {
/// let refunds = Arc::new(AtomicU32::new(0));
/// let booked = refunds.clone();
/// let handler = service_fn(move |_req: http::Request<ReplayRequestBody>| {
///     booked.fetch_add(1, Ordering::SeqCst);
///     async { Ok::<_, BoxError>(http::Response::builder().status(201).body(Full::<bytes::Bytes>::from("{\"refund\":\"rf_1\"}"))?) }
/// });
/// let svc = ReplayLayer::new(MemoryStore::default()).single_tenant().layer(handler);
/// let refund = || {
///     http::Request::post("http://payments.local/refunds")
///         .header("idempotency-key", "refund-ORD-4812")
///         .body(Full::<bytes::Bytes>::from("{\"eur\":40}"))
///         .unwrap()
/// };
/// let first = svc.clone().oneshot(refund()).await?;
/// let repeat = svc.oneshot(refund()).await?; // the client lost the first reply and asks again
/// assert_eq!((first.status().as_u16(), repeat.status().as_u16()), (201, 201));
/// assert_eq!(refunds.load(Ordering::SeqCst), 1, "refunded once; the repeat got the stored result");
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct ReplayLayer {
    cfg: Arc<Config>,
}

impl fmt::Debug for ReplayLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.cfg;
        f.debug_struct("ReplayLayer")
            .field("store", &c.store)
            .field("header", &c.header)
            .field("methods", &c.methods)
            .field("require_key", &c.require_key)
            .field("max_request_body", &c.max_request_body)
            .field("max_stored_body", &c.max_stored_body)
            .field("ttl", &c.ttl)
            .field("lease", &c.lease)
            .field("fail_open", &c.fail_open)
            .finish()
    }
}

/// By default a response is stored unless its status says the request was refused before it
/// ran (408, 425, 429, 503): those are worth retrying with the same key.
fn default_store_status(s: StatusCode) -> bool {
    !matches!(s.as_u16(), 408 | 425 | 429 | 503)
}

fn default_principal(parts: &Parts) -> Option<String> {
    parts.extensions.get::<Principal>().map(|p| p.0.clone())
}

impl ReplayLayer {
    /// What its services share.
    pub(crate) fn cfg(&self) -> &Arc<Config> {
        &self.cfg
    }

    /// A replay layer over `store` with the defaults: keys required on POST and PATCH in the
    /// `Idempotency-Key` header, results kept 24 h, claims leased for 30 s (renewed while the
    /// handler runs), request and stored response bodies up to 1 MiB.
    pub fn new(store: impl ReplayStore) -> Self {
        Self::with_store(Arc::new(store))
    }

    /// The same, with a shared store.
    pub fn with_store(store: Arc<dyn ReplayStore>) -> Self {
        ReplayLayer {
            cfg: Arc::new(Config {
                store,
                header: HeaderName::from_static("idempotency-key"),
                methods: vec![Method::POST, Method::PATCH],
                require_key: true,
                principal: Arc::new(default_principal),
                business_key: None,
                max_request_body: 1 << 20,
                max_stored_body: 1 << 20,
                ttl: Duration::from_secs(24 * 60 * 60),
                lease: Duration::from_secs(30),
                store_status: Arc::new(default_store_status),
                allow_headers: [
                    "content-type",
                    "content-language",
                    "content-location",
                    "location",
                    "etag",
                    "last-modified",
                    "cache-control",
                ]
                .into_iter()
                .map(HeaderName::from_static)
                .collect(),
                fail_open: false,
                single_tenant: false,
                #[cfg(feature = "postgres")]
                transactional: None,
            }),
        }
    }

    /// A replay layer whose handler runs in a database transaction shared with the store: it
    /// finds a [`PgTransaction`](crate::PgTransaction) in its request's extensions, writes its
    /// business rows through it, and the layer writes the stored response in the same
    /// transaction and commits both. The key is then stored atomically with the effect: a
    /// crash between them leaves neither, and a retry runs the handler once more, for the
    /// first time as far as the database is concerned. A handler whose lease was lost before
    /// the commit commits nothing (409 `lease-lost`). Effects outside the transaction (an
    /// e-mail, another service's API) are not covered: give those the key.
    #[cfg(feature = "postgres")]
    pub fn transactional(store: crate::PgStore) -> Self {
        let layer = Self::with_store(Arc::new(store.clone()));
        layer.edit(|c| c.transactional = Some(store))
    }

    /// Changes this layer's configuration; a clone made earlier keeps its own.
    fn edit(mut self, f: impl FnOnce(&mut Config)) -> Self {
        f(Arc::make_mut(&mut self.cfg));
        self
    }

    /// The key header (`Idempotency-Key`).
    #[must_use]
    pub fn header(self, name: HeaderName) -> Self {
        self.edit(|c| c.header = name)
    }

    /// The methods that are deduplicated (POST and PATCH). Others pass through untouched. An
    /// empty list is refused: it would deduplicate nothing.
    pub fn methods(self, methods: impl IntoIterator<Item = Method>) -> Result<Self, InvalidConfig> {
        let m = methods.into_iter().collect();
        self.edit(|c| c.methods = m).checked()
    }

    /// Whether a request to a deduplicated method without a key is refused with 400 (the
    /// default) or passed through unprotected.
    #[must_use]
    pub fn require_key(self, required: bool) -> Self {
        self.edit(|c| c.require_key = required)
    }

    /// How to find the request's principal. The default reads the [`Principal`] extension. A
    /// keyed request with no principal is refused (500, `principal-missing`: the server is
    /// misconfigured, most often because the authentication layer sits inside this one),
    /// unless the layer is built for a [`single_tenant`](Self::single_tenant) service.
    #[must_use]
    pub fn principal(self, f: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static) -> Self {
        self.edit(|c| c.principal = Arc::new(f))
    }

    /// The service has one tenant: requests without a principal share one scope instead of
    /// being refused. Do not use it for a service with several tenants: their stored results
    /// would be shared.
    #[must_use]
    pub fn single_tenant(self) -> Self {
        self.edit(|c| c.single_tenant = true)
    }

    /// A business identity for a request ("label for order 4812"): requests with the same one
    /// are the same action even when their keys or arguments differ, so a model re-calling a
    /// tool with slightly different arguments still gets the original result instead of a
    /// second effect.
    #[must_use]
    pub fn business_key(
        self,
        f: impl Fn(&Parts, &Bytes) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.edit(|c| c.business_key = Some(Arc::new(f)))
    }

    /// How long results are kept (24 h). Refused when shorter than the lease: a result must
    /// outlive the claim that made it.
    pub fn ttl(self, ttl: Duration) -> Result<Self, InvalidConfig> {
        self.edit(|c| c.ttl = ttl).checked()
    }

    /// How long a claim lasts without renewal (30 s). The layer renews it every third of that
    /// while the handler runs, so it only expires when the process stops or hangs. Refused
    /// under 30 ms (renewals every 10 ms would be all the store does) or longer than the ttl.
    pub fn lease(self, lease: Duration) -> Result<Self, InvalidConfig> {
        self.edit(|c| c.lease = lease).checked()
    }

    /// The largest request body read (1 MiB); larger requests get 413.
    #[must_use]
    pub fn max_request_body(self, bytes: usize) -> Self {
        self.edit(|c| c.max_request_body = bytes)
    }

    /// The largest response body stored (1 MiB). A larger response is returned to its caller in
    /// full, but only its status is kept; a repeat gets a 409 problem saying the request was
    /// processed and its response cannot be replayed.
    #[must_use]
    pub fn max_stored_body(self, bytes: usize) -> Self {
        self.edit(|c| c.max_stored_body = bytes)
    }

    /// Which statuses are stored. By default every status except 408, 425, 429 and 503 (the
    /// request was refused before it ran). Storing 5xx follows Stripe: once the handler ran,
    /// its effect may be partial, and running it again is worse than replaying the error.
    #[must_use]
    pub fn store_status(self, f: impl Fn(StatusCode) -> bool + Send + Sync + 'static) -> Self {
        self.edit(|c| c.store_status = Arc::new(f))
    }

    /// Adds a response header to the stored allow-list (content type, language and location,
    /// `Location`, `ETag`, `Last-Modified`, `Cache-Control` by default). `Set-Cookie` and `Date`
    /// are never stored, whatever the list says.
    #[must_use]
    pub fn allow_header(self, name: HeaderName) -> Self {
        self.edit(|c| c.allow_headers.push(name))
    }

    /// When the store is unreachable, run requests without deduplication instead of answering
    /// 503 (off: the layer fails closed).
    #[must_use]
    pub fn fail_open(self, open: bool) -> Self {
        self.edit(|c| c.fail_open = open)
    }

    /// This layer, when its configuration holds together: every setter that could break it
    /// checks it, so a `ReplayLayer` that exists is a valid one.
    fn checked(self) -> Result<Self, InvalidConfig> {
        let c = &self.cfg;
        if c.lease < Duration::from_millis(30) {
            return Err(InvalidConfig::new("replay lease must be at least 30 ms"));
        }
        if c.ttl < c.lease {
            return Err(InvalidConfig::new(
                "replay ttl must not be shorter than the lease",
            ));
        }
        if c.methods.is_empty() {
            return Err(InvalidConfig::new(
                "replay methods must name at least one method",
            ));
        }
        Ok(self)
    }
}

impl<S> Layer<S> for ReplayLayer {
    type Service = Replay<S>;
    fn layer(&self, inner: S) -> Self::Service {
        Replay::new(inner, self.cfg.clone())
    }
}
