//! `reqwest::Client` under the stack.

use crate::{
    BackstopLayer, BackstopService, BoxError, classify::HttpClassifier, idempotency::HttpKeys,
    retry::HttpResend,
};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use std::{
    future::Future,
    pin::Pin,
    task::{Context, Poll},
};
use tower_layer::Layer;
use tower_service::Service;

/// A `reqwest::Client` as a `Service<http::Request<Full<Bytes>>>`, the request type the HTTP
/// stack copies for its retries. reqwest's requests keep their extensions private, so the
/// stack cannot wrap `reqwest::Request` itself: it speaks `http::Request`, and this converts
/// each attempt (reqwest supports both conversions). reqwest's errors stay in the cause chain,
/// where the classifier reads them: a connect error is *not sent*, a timeout an attempt
/// timeout.
///
/// ```no_run
/// use backstop::Backstop;
/// use http_body_util::Full;
/// use tower::ServiceExt;
///
/// # async fn run() -> Result<(), backstop::BoxError> {
/// let rates = Backstop::http("rates-api").build()?.reqwest(reqwest::Client::new());
/// let res = rates.oneshot(http::Request::get("http://rates.local/q").body(Full::default())?).await?;
/// # let _ = res; Ok(()) }
/// ```
#[derive(Clone, Debug, Default)]
pub struct ReqwestService {
    client: reqwest::Client,
}

impl ReqwestService {
    /// `client` as a service.
    pub fn new(client: reqwest::Client) -> Self {
        ReqwestService { client }
    }

    /// The client inside.
    pub fn client(&self) -> &reqwest::Client {
        &self.client
    }
}

impl Service<http::Request<Full<Bytes>>> for ReqwestService {
    type Response = http::Response<reqwest::Body>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        // reqwest's client has its own pool and is always ready.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<Full<Bytes>>) -> Self::Future {
        let client = self.client.clone();
        Box::pin(async move {
            let (parts, body) = req.into_parts();
            // A `Full` body is one chunk: collecting it is a move, not a copy.
            let body = body.collect().await?.to_bytes();
            let req = reqwest::Request::try_from(http::Request::from_parts(parts, body))?;
            Ok(http::Response::from(client.execute(req).await?))
        })
    }
}

impl BackstopLayer<HttpClassifier, HttpResend, HttpKeys> {
    /// The stack over `client`: every error a typed [`Error`](crate::Error), the keys and the
    /// deadline as over any other client. Requests are `http::Request<Full<Bytes>>`; responses
    /// `http::Response` of reqwest's body, under the attempt's time limit.
    pub fn reqwest(
        &self,
        client: reqwest::Client,
    ) -> BackstopService<ReqwestService, HttpClassifier, HttpResend, HttpKeys> {
        self.layer(ReqwestService::new(client))
    }
}
