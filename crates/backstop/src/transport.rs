//! How the composed stack wraps the client for its kind of request: the pieces between the
//! stack's attempt timeout and the client. Sealed: named by the stack's types, implemented here
//! for HTTP, tool calls and gRPC only.

use crate::{attempt_header::AttemptHeaders, box_errors::BoxErrors};
use backstop_retry::{CloneResend, HttpResend};
use backstop_timeout::{BodyTimeout, BodyTimeoutLayer};
use std::time::Duration;
use tower_layer::Layer;

/// The kinds of request a [`BackstopService`](crate::BackstopService) is built for, by the
/// copier it resends them with: HTTP ([`HttpResend`]: the attempt number under the configured
/// header, and each response's body timed to its attempt's end), tool calls ([`CloneResend`]:
/// passed as they are) and gRPC ([`StreamingResend`](backstop_retry::StreamingResend)).
///
/// Sealed: named in bounds over the stack's types, implemented by those three only.
///
/// ```
/// use backstop::{Backstop, BackstopService, Transport};
/// use bytes::Bytes;
/// use http_body_util::Full;
/// use std::convert::Infallible;
/// use tower::{Layer, service_fn};
///
/// /// Holds a stack, whatever client, classifier and kind of request it was built for.
/// struct Dependency<S, C, P: Transport<S>, I> {
///     name: &'static str,
///     stack: BackstopService<S, C, P, I>,
/// }
///
/// # fn main() -> Result<(), backstop::BoxError> {
/// let client = service_fn(|_req: http::Request<Full<Bytes>>| async {
///     Ok::<_, Infallible>(http::Response::new(Full::new(Bytes::from_static(b"ok"))))
/// });
/// let rates = Dependency {
///     name: "rates-api",
///     stack: Backstop::http("rates-api").build()?.layer(client),
/// };
/// # let _ = (rates.name, rates.stack);
/// # Ok(())
/// # }
/// ```
pub trait Transport<S>: sealed::Wraps<S> {}

impl<S, T: sealed::Wraps<S>> Transport<S> for T {}

/// What a [`BackstopService`](crate::BackstopService)'s telemetry reads of a request before its
/// call: a gRPC call's method and target; nothing for the others.
///
/// Sealed, as [`Transport`]: implemented by the same three copiers only.
pub trait Describe<Req>: sealed::Describes<Req> {}

impl<Req, T: sealed::Describes<Req>> Describe<Req> for T {}

/// What [`Transport`] and [`Describe`] stand for, which only this crate implements and calls.
pub(crate) mod sealed {
    use super::TransportSettings;

    /// How the stack wraps the client: the pieces between its attempt timeout and the client.
    /// Either way [`BoxErrors`](crate::box_errors::BoxErrors) gives the classifier every error
    /// of the client as a `BoxError`.
    #[allow(unreachable_pub)] // Public in name only: the supertrait that seals `Transport`.
    pub trait Wraps<S> {
        /// The wrapped client.
        type Client;
        /// Wraps `client` as `settings` say.
        fn wrap(&self, client: S, settings: &TransportSettings) -> Self::Client;
    }

    /// A request's gRPC method and target, for the stack's telemetry.
    #[allow(unreachable_pub)] // Public in name only: the supertrait that seals `Describe`.
    pub trait Describes<Req> {
        /// The method and target of `req` when it is a gRPC call.
        fn grpc_method(_req: &Req) -> Option<(String, String)> {
            None
        }
    }
}

impl<B> sealed::Describes<http::Request<B>> for HttpResend {}

impl<Req> sealed::Describes<Req> for CloneResend {}

/// What the stack tells its transport when it wraps the client.
#[derive(Clone, Debug, Default)]
#[allow(unreachable_pub)] // Public in name only, as `sealed::Wraps`.
pub struct TransportSettings {
    /// The header the attempt number goes under (HTTP), if any.
    pub(crate) attempt_header: Option<http::HeaderName>,
    pub(crate) time_left_header: Option<http::HeaderName>,
    /// Whether each response's quota headers are read for the pacing layer.
    #[cfg(feature = "quota")]
    pub(crate) read_quotas: bool,
    /// The stack's fixed attempt timeout (what a body or a gRPC call planned without the
    /// stack's attempt timeout outside would be given).
    pub(crate) attempt_timeout: Option<Duration>,
    /// The stack's telemetry: each attempt recorded over the client.
    #[cfg_attr(not(feature = "otel"), allow(dead_code))]
    pub(crate) otel: crate::telemetry::Otel,
}

/// The client as the retry layer calls it: with feature `otel`, every attempt passes the
/// attempt metrics (a branch when the stack has no telemetry).
/// Each response's quota headers read for the pacing layer, when the stack paces.
#[cfg(feature = "quota")]
pub(crate) type ReadQuotas<S> = tower::util::Either<backstop_quota::ReadQuotas<S>, S>;
#[cfg(not(feature = "quota"))]
pub(crate) type ReadQuotas<S> = S;

#[cfg(feature = "otel")]
pub(crate) type Attempts<S> = backstop_otel::AttemptMetrics<S>;
#[cfg(not(feature = "otel"))]
pub(crate) type Attempts<S> = S;

/// Wraps `client` in [`Attempts`].
pub(crate) fn attempts<S>(client: S, settings: &TransportSettings) -> Attempts<S> {
    #[cfg(feature = "otel")]
    return tower_layer::Layer::layer(
        &backstop_otel::AttemptMetricsLayer::new(settings.otel.telemetry.clone()),
        client,
    );
    #[cfg(not(feature = "otel"))]
    {
        let _ = settings;
        client
    }
}

impl<S> sealed::Wraps<S> for HttpResend {
    type Client = Attempts<BoxErrors<BodyTimeout<AttemptHeaders<ReadQuotas<S>>>>>;
    fn wrap(&self, client: S, settings: &TransportSettings) -> Self::Client {
        #[cfg(feature = "quota")]
        let client = match settings.read_quotas {
            true => tower::util::Either::Left(backstop_quota::ReadQuotas::new(client)),
            false => tower::util::Either::Right(client),
        };
        let client = AttemptHeaders {
            inner: client,
            attempt: settings.attempt_header.clone(),
            time_left: settings.time_left_header.clone(),
        };
        let client = BoxErrors(BodyTimeoutLayer::new(settings.attempt_timeout).layer(client));
        attempts(client, settings)
    }
}

impl<S> sealed::Wraps<S> for CloneResend {
    type Client = BoxErrors<S>;
    fn wrap(&self, client: S, _settings: &TransportSettings) -> Self::Client {
        BoxErrors(client)
    }
}
