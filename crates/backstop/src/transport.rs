//! How the composed stack wraps the client for its kind of request: the pieces between the
//! stack's attempt timeout and the client. Sealed: named by the stack's types, implemented here
//! for HTTP, tool calls and gRPC only.

use crate::{attempt_header::AttemptHeaders, box_errors::BoxErrors};
use backstop_retry::{CloneResend, HttpResend};
use backstop_timeout::{BodyTimeout, BodyTimeoutLayer};
use std::time::Duration;
use tower_layer::Layer;

/// How the composed stack wraps the client for its kind of request: for HTTP ([`HttpResend`])
/// the attempt number under the configured header, and the response's body timed to its
/// attempt's end; tool calls ([`CloneResend`]) are passed as they are. Either way
/// [`BoxErrors`] gives the classifier every error of the client as a `BoxError`.
#[allow(unreachable_pub)] // Sealed: public in name only, so that public types can use it.
pub trait Transport<S> {
    /// The wrapped client.
    type Client;
    /// Wraps `client` as `settings` say.
    fn wrap(&self, client: S, settings: &TransportSettings) -> Self::Client;
}

/// What the composed stack's telemetry learns of a request before its call: a gRPC call's
/// method and target (A96's `grpc.method`, `grpc.target`); nothing for the others.
#[allow(unreachable_pub)] // Sealed, as `Transport`.
pub trait Describe<Req> {
    /// The method and target of `req` when it is a gRPC call.
    fn grpc_method(_req: &Req) -> Option<(String, String)> {
        None
    }
}

impl<B> Describe<http::Request<B>> for HttpResend {}

impl<Req> Describe<Req> for CloneResend {}

/// What [`Transport::wrap`] is told.
#[derive(Clone, Debug, Default)]
#[allow(unreachable_pub)] // Sealed, as `Transport`.
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

impl<S> Transport<S> for HttpResend {
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

impl<S> Transport<S> for CloneResend {
    type Client = BoxErrors<S>;
    fn wrap(&self, client: S, _settings: &TransportSettings) -> Self::Client {
        BoxErrors(client)
    }
}
