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
#[cfg(feature = "reqwest-middleware")]
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
        tower_layer::Layer::layer(self, ReqwestService::new(client))
    }
}

/// The stack as a `reqwest_middleware::Middleware`, for applications (and agent frameworks)
/// that take a `reqwest_middleware::ClientWithMiddleware`. Each call runs through the whole
/// stack, whose attempts go on down the middleware chain: keys, deadline, retries, budget and
/// breaker as anywhere else. The error is a `reqwest_middleware::Error::Middleware` holding the
/// typed [`Error`](crate::Error) (`anyhow`'s `downcast_ref::<backstop::Error>()`). A request
/// whose body streams cannot be copied for a retry: it is passed down the chain once, as it is.
/// The middleware's `Extensions` (an `ActionContext`, a `Deadline`) travel with the request.
///
/// Feature `reqwest-middleware`.
///
/// ```no_run
/// use backstop::{Backstop, reqwest::BackstopMiddleware};
///
/// # fn build() -> Result<(), backstop::BoxError> {
/// let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
///     .with(BackstopMiddleware::new(Backstop::http("rates-api").build()?))
///     .build();
/// # let _ = client; Ok(()) }
/// ```
#[cfg(feature = "reqwest-middleware")]
#[derive(Clone, Debug)]
pub struct BackstopMiddleware {
    layer: BackstopLayer<HttpClassifier, HttpResend, HttpKeys>,
}

#[cfg(feature = "reqwest-middleware")]
impl BackstopMiddleware {
    /// The middleware for `layer`'s stack.
    pub fn new(layer: BackstopLayer<HttpClassifier, HttpResend, HttpKeys>) -> Self {
        BackstopMiddleware { layer }
    }
}

#[cfg(feature = "reqwest-middleware")]
#[async_trait::async_trait]
impl reqwest_middleware::Middleware for BackstopMiddleware {
    async fn handle(
        &self,
        req: reqwest::Request,
        extensions: &mut http::Extensions,
        next: reqwest_middleware::Next<'_>,
    ) -> reqwest_middleware::Result<reqwest::Response> {
        let body = match req.body().map(reqwest::Body::as_bytes) {
            None => Bytes::new(),
            Some(Some(bytes)) => Bytes::copy_from_slice(bytes),
            // A streaming body cannot be copied for another attempt: sent once, as it is.
            Some(None) => return next.run(req, extensions).await,
        };
        let mut copy = http::Request::builder()
            .method(req.method().clone())
            .uri(req.url().as_str())
            .version(req.version())
            .body(Full::new(body))
            .map_err(reqwest_middleware::Error::middleware)?;
        *copy.headers_mut() = req.headers().clone();
        *copy.extensions_mut() = extensions.clone();
        let timeout = req.timeout().copied();
        // Each attempt goes on down the chain with its own copy of the extensions.
        let chain = tower::service_fn(move |attempt: http::Request<Full<Bytes>>| {
            let next = next.clone();
            async move {
                let mut ext = attempt.extensions().clone();
                let (parts, body) = attempt.into_parts();
                // A `Full` body is one chunk, and cannot fail.
                let body = match body.collect().await {
                    Ok(collected) => collected.to_bytes(),
                    Err(never) => match never {},
                };
                // Errors boxed by hand: rustc cannot yet prove `Send` for this future with `?`
                // converting them (its higher-ranked `From` in the generator witness).
                let mut req =
                    match reqwest::Request::try_from(http::Request::from_parts(parts, body)) {
                        Ok(req) => req,
                        Err(e) => return Err(Box::new(e) as BoxError),
                    };
                *req.timeout_mut() = timeout;
                match next.run(req, &mut ext).await {
                    Ok(res) => Ok(http::Response::from(res)),
                    Err(e) => Err(Box::new(e) as BoxError),
                }
            }
        });
        match run(&self.layer, chain, copy).await {
            Ok(res) => Ok(reqwest::Response::from(res.map(reqwest::Body::wrap))),
            Err(e) => Err(reqwest_middleware::Error::middleware(e)),
        }
    }
}

/// What one call through the stack gives, over a client answering with `http::Response<B>`.
#[cfg(feature = "reqwest-middleware")]
type Called<B> = Result<http::Response<backstop_timeout::TimedBody<B>>, crate::Error>;

/// One call through `layer`'s stack over `chain`, boxed here, outside the `async fn`: there the
/// stack's future would sit in the generator's witness, where rustc cannot yet prove it `Send`
/// (its higher-ranked error conversions); coerced in a plain function, it can.
#[cfg(feature = "reqwest-middleware")]
fn run<'a, S, B>(
    layer: &BackstopLayer<HttpClassifier, HttpResend, HttpKeys>,
    chain: S,
    req: http::Request<Full<Bytes>>,
) -> Pin<Box<dyn Future<Output = Called<B>> + Send + 'a>>
where
    S: Service<http::Request<Full<Bytes>>, Response = http::Response<B>, Error = BoxError>
        + Clone
        + Send
        + 'a,
    S::Future: Send + 'a,
    B: Send + 'a,
{
    use tower::ServiceExt;
    Box::pin(layer.layer(chain).oneshot(req))
}
