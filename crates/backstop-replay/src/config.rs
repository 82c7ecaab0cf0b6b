//! What every service of a replay layer shares: the store, the key's header, the methods
//! guarded, the principal, the limits, the lease and the store policy.

use crate::store::ReplayStore;
use bytes::Bytes;
use http::{HeaderName, Method, StatusCode, request::Parts};
use std::{sync::Arc, time::Duration};

/// The authenticated principal (tenant, user) a request acts for, put in the request's
/// extensions by the authentication middleware that runs before the replay layer.
///
/// Stored results are scoped by it: one principal can never receive another's stored response,
/// even with the same key. It must come from authentication, never from a header the client
/// chooses.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Principal(pub String);

pub(crate) type PrincipalFn = dyn Fn(&Parts) -> Option<String> + Send + Sync;
pub(crate) type BusinessFn = dyn Fn(&Parts, &Bytes) -> Option<String> + Send + Sync;
pub(crate) type StorePolicy = dyn Fn(StatusCode) -> bool + Send + Sync;

#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) store: Arc<dyn ReplayStore>,
    pub(crate) header: HeaderName,
    pub(crate) methods: Vec<Method>,
    pub(crate) require_key: bool,
    pub(crate) principal: Arc<PrincipalFn>,
    pub(crate) business_key: Option<Arc<BusinessFn>>,
    pub(crate) max_request_body: usize,
    pub(crate) max_stored_body: usize,
    pub(crate) ttl: Duration,
    pub(crate) lease: Duration,
    pub(crate) store_status: Arc<StorePolicy>,
    pub(crate) allow_headers: Vec<HeaderName>,
    pub(crate) fail_open: bool,
    pub(crate) single_tenant: bool,
    #[cfg(feature = "postgres")]
    pub(crate) transactional: Option<crate::PgStore>,
}

impl Config {
    pub(crate) fn is_transactional(&self) -> bool {
        #[cfg(feature = "postgres")]
        return self.transactional.is_some();
        #[cfg(not(feature = "postgres"))]
        false
    }
}

/// The principal of every request of a layer built with [`ReplayLayer::single_tenant`].
pub(crate) const SINGLE_TENANT: &str = "(single tenant)";
