//! What each attempt tells the server beside the request: its number, under a header the caller
//! names (as Envoy's `x-envoy-attempt-count` does), so a server can tell a retry from a first
//! try; and the time it has left, so a server can stop working for a caller that has given up.

use backstop_core::{CallContext, Deadline};
use std::task::{Context, Poll};
use tower_service::Service;

/// Sets, on each attempt's request, the configured headers: the attempt's number (1 on the
/// first) and its time left in whole milliseconds, rounded up ([`Deadline::time_left`]: until
/// the attempt timeout cuts it, within the deadline). A header that is not configured is not
/// sent.
#[derive(Clone, Debug)]
pub struct AttemptHeaders<S> {
    pub(crate) inner: S,
    pub(crate) attempt: Option<http::HeaderName>,
    pub(crate) time_left: Option<http::HeaderName>,
}

impl<S, B> Service<http::Request<B>> for AttemptHeaders<S>
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
        if let Some(name) = &self.attempt
            && let Some(n) = CallContext::attempt_of(&req)
        {
            req.headers_mut()
                .insert(name.clone(), http::HeaderValue::from(n));
        }
        if let Some(name) = &self.time_left
            && let Some(ms) = Deadline::time_left_ms(&req)
        {
            req.headers_mut()
                .insert(name.clone(), http::HeaderValue::from(ms));
        }
        self.inner.call(req)
    }
}
