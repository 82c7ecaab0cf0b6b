//! Work done once per logical call, around all of its attempts, inside the retry layer's own
//! future.

use backstop_core::{BoxError, Dependency};

/// What a call layer does once per logical call, run by the retry layer itself: before the
/// first attempt ([`begin`](CallHook::begin)) and with the call's result
/// ([`end`](CallHook::end)).
///
/// A layer outside the retry layer would do the same work in a future of its own, which every
/// call then moves and polls once more; a hook costs the retry future one field. The composed
/// Backstop stack attaches idempotency keys, keeps the call's span and turns every error into
/// its own error type this way.
///
/// `begin` runs before the budget is asked and before the request is copied for replays, so
/// whatever it adds to the request (an `Idempotency-Key` header, say) is on every attempt.
///
/// ```
/// use backstop_core::BoxError;
/// use backstop_retry::{CallHook, Dependency, RetryLayer};
/// use http::{Request, Response};
/// use tower::{Layer, ServiceExt, service_fn};
///
/// /// Refuses calls without a tenant, and names the dependency in every error.
/// #[derive(Clone)]
/// struct Tenanted;
///
/// impl<B, R> CallHook<Request<B>, R> for Tenanted {
///     type State = Dependency;
///     type Error = String;
///     fn begin(&self, req: &mut Request<B>, dep: &Dependency) -> Result<Dependency, String> {
///         if !req.headers().contains_key("x-tenant") {
///             return Err(format!("{dep}: add an x-tenant header and call again"));
///         }
///         Ok(dep.clone())
///     }
///     fn end(&self, dep: &mut Dependency, result: Result<R, BoxError>) -> Result<R, String> {
///         result.map_err(|e| format!("{dep}: {e}"))
///     }
///     fn ready_error(&self, error: BoxError) -> String {
///         error.to_string()
///     }
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let svc = RetryLayer::http().dependency("rates-api").hook(Tenanted).layer(service_fn(
///     |_req: Request<String>| async { Ok::<_, BoxError>(Response::new("ok")) },
/// ));
/// let refused = svc.clone().oneshot(Request::new(String::new())).await;
/// assert_eq!(refused.unwrap_err(), "rates-api: add an x-tenant header and call again");
/// let req = Request::builder().header("x-tenant", "acme").body(String::new()).unwrap();
/// assert_eq!(svc.oneshot(req).await.unwrap().into_body(), "ok");
/// # }
/// ```
pub trait CallHook<Req, Res> {
    /// What the hook keeps for one call, from `begin` to `end`.
    type State;
    /// The error every call returns.
    type Error;

    /// Runs first, once per call, with the dependency the call goes to. An error ends the call
    /// there: nothing is sent and the budget is not asked.
    fn begin(&self, req: &mut Req, dependency: &Dependency) -> Result<Self::State, Self::Error>;

    /// The call's span, if it has one: it is entered whenever the retry future is polled, and
    /// each attempt's span is created inside it.
    fn span<'a>(&self, state: &'a Self::State) -> Option<&'a tracing::Span> {
        let _ = state;
        None
    }

    /// Runs once, with what the retry layer made of the call.
    fn end(
        &self,
        state: &mut Self::State,
        result: Result<Res, BoxError>,
    ) -> Result<Res, Self::Error>;

    /// Turns an error from the inner service's `poll_ready` into the call's error type.
    fn ready_error(&self, error: BoxError) -> Self::Error;

    /// Turns the raw error of a call that an outer retry layer owns into the error type,
    /// without any of the call-level work: that call's `begin` and `end` are the outer
    /// layer's. By default, [`ready_error`](Self::ready_error).
    fn pass(&self, error: BoxError) -> Self::Error {
        self.ready_error(error)
    }
}

/// The hook that does nothing: the retry layer's errors are [`BoxError`]s.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoHook;

impl<Req, Res> CallHook<Req, Res> for NoHook {
    type State = ();
    type Error = BoxError;

    #[inline]
    fn begin(&self, _req: &mut Req, _dependency: &Dependency) -> Result<(), BoxError> {
        Ok(())
    }

    #[inline]
    fn end(&self, _state: &mut (), result: Result<Res, BoxError>) -> Result<Res, BoxError> {
        result
    }

    #[inline]
    fn ready_error(&self, error: BoxError) -> BoxError {
        error
    }
}
