//! The attempt number sent onward, under a header the caller names (as Envoy's
//! `x-envoy-attempt-count` does), so a server can tell a retry from a first try.

use backstop_core::CallContext;
use std::task::{Context, Poll};
use tower_service::Service;

/// Sets the configured header to the attempt's number (1 on the first) on each attempt's
/// request; does nothing when no header is configured.
#[derive(Clone, Debug)]
pub struct AttemptCount<S> {
    pub(crate) inner: S,
    pub(crate) header: Option<http::HeaderName>,
}

impl<S, B> Service<http::Request<B>> for AttemptCount<S>
where
    S: Service<http::Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<B>) -> S::Future {
        if let Some(name) = &self.header
            && let Some(n) = CallContext::attempt_of(&req)
        {
            req.headers_mut()
                .insert(name.clone(), http::HeaderValue::from(n));
        }
        self.inner.call(req)
    }
}
