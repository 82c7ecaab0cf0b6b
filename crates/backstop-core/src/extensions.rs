/// Access to a request's or response's [`http::Extensions`].
///
/// Backstop reads per-call metadata a caller attaches (a [`Deadline`](crate::Deadline), a
/// [`Dependency`](crate::Dependency), replay-safety markers, an action context) from extensions
/// and puts the retry history in the response's, so every layer works on any request type that
/// implements this trait. `http::Request` and
/// `http::Response` do; a non-HTTP tool call needs one field:
///
/// ```
/// use backstop_core::HasExtensions;
///
/// #[derive(Clone, Debug)]
/// struct ToolCall {
///     tool: String,
///     args: String,
///     extensions: http::Extensions,
/// }
///
/// impl HasExtensions for ToolCall {
///     fn extensions(&self) -> &http::Extensions { &self.extensions }
///     fn extensions_mut(&mut self) -> &mut http::Extensions { &mut self.extensions }
/// }
/// ```
pub trait HasExtensions {
    /// The extensions.
    fn extensions(&self) -> &http::Extensions;
    /// The extensions, mutably.
    fn extensions_mut(&mut self) -> &mut http::Extensions;
}

impl<B> HasExtensions for http::Request<B> {
    fn extensions(&self) -> &http::Extensions {
        http::Request::extensions(self)
    }
    fn extensions_mut(&mut self) -> &mut http::Extensions {
        http::Request::extensions_mut(self)
    }
}

impl<B> HasExtensions for http::Response<B> {
    fn extensions(&self) -> &http::Extensions {
        http::Response::extensions(self)
    }
    fn extensions_mut(&mut self) -> &mut http::Extensions {
        http::Response::extensions_mut(self)
    }
}

impl HasExtensions for http::Extensions {
    fn extensions(&self) -> &http::Extensions {
        self
    }
    fn extensions_mut(&mut self) -> &mut http::Extensions {
        self
    }
}

/// Any value with [`http::Extensions`] beside it, so a foreign request or result type (an MCP
/// SDK's tool-call parameters, a gRPC message, a plain struct) goes under the stack without a
/// newtype of your own. `Clone` when the value is (the retry layer sends a copy per attempt);
/// with the idempotency crate it is also a `KeyedRequest` (the key lives in its extensions).
///
/// ```
/// use backstop_core::{Deadline, HasExtensions, WithExtensions};
/// use std::time::Duration;
///
/// #[derive(Clone, Debug, PartialEq)]
/// struct CallTool { name: String, arguments: String } // a type from another crate
///
/// let mut call = WithExtensions::new(CallTool { name: "issue_refund".into(), arguments: "{}".into() });
/// call.extensions_mut().insert(Deadline::after(Duration::from_secs(2)));
/// assert!(Deadline::of(&call).is_some());
/// assert_eq!(call.get().name, "issue_refund");
/// let (inner, _extensions) = call.into_parts();
/// assert_eq!(inner.arguments, "{}");
/// ```
#[derive(Clone, Debug, Default)]
pub struct WithExtensions<T> {
    value: T,
    extensions: http::Extensions,
}

impl<T> WithExtensions<T> {
    /// `value`, with empty extensions.
    pub fn new(value: T) -> Self {
        WithExtensions {
            value,
            extensions: http::Extensions::new(),
        }
    }

    /// `value` with `extensions`.
    pub fn from_parts(value: T, extensions: http::Extensions) -> Self {
        WithExtensions { value, extensions }
    }

    /// The value.
    pub fn get(&self) -> &T {
        &self.value
    }

    /// The value, mutably.
    pub fn get_mut(&mut self) -> &mut T {
        &mut self.value
    }

    /// The value, without its extensions.
    pub fn into_inner(self) -> T {
        self.value
    }

    /// The value and its extensions.
    pub fn into_parts(self) -> (T, http::Extensions) {
        (self.value, self.extensions)
    }
}

impl<T> From<T> for WithExtensions<T> {
    fn from(value: T) -> Self {
        WithExtensions::new(value)
    }
}

impl<T> HasExtensions for WithExtensions<T> {
    fn extensions(&self) -> &http::Extensions {
        &self.extensions
    }
    fn extensions_mut(&mut self) -> &mut http::Extensions {
        &mut self.extensions
    }
}

/// A marker in a request's extensions saying that the request may be sent more than once
/// without a second side effect.
///
/// HTTP requests are replay-safe by method (RFC 9110 §9.2.2) or by an `Idempotency-Key`
/// header; a non-HTTP tool call has neither, so the code that knows the call is safe (for
/// example, because it attached an idempotency key the tool honours) inserts this marker.
///
/// ```
/// use backstop_core::{HasExtensions, ReplaySafe};
///
/// let mut req = http::Request::new(());
/// req.extensions_mut().insert(ReplaySafe);
/// assert!(ReplaySafe::is_marked(&req));
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReplaySafe;

impl ReplaySafe {
    /// Whether the request carries the marker.
    pub fn is_marked<R: HasExtensions + ?Sized>(req: &R) -> bool {
        req.extensions().get::<ReplaySafe>().is_some()
    }
}

/// A marker in a request's extensions saying that its idempotency key was attached by the
/// stack itself (random, or derived from an `ActionContext`) and that nobody vouched that the
/// dependency honours keys.
///
/// Such a key is sent (harmless) but does not make an unknown outcome safe to repeat: a server
/// that ignores keys would act on the repeat a second time. A key the caller set itself, the
/// presets that require keys, or a dependency declared key-honouring attach no such marker
/// (they mark the request [`ReplaySafe`] instead).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UnvouchedKey;

impl UnvouchedKey {
    /// Whether the request carries the marker.
    pub fn is_marked<R: HasExtensions + ?Sized>(req: &R) -> bool {
        req.extensions().get::<UnvouchedKey>().is_some()
    }
}

/// The name of one of HTTP's own methods (RFC 9110 §9 and PATCH), as a `'static` string for
/// telemetry; `None` for any other method (the semantic conventions then say `_OTHER`).
///
/// ```
/// assert_eq!(backstop_core::plumbing::known_method(&http::Method::PATCH), Some("PATCH"));
/// assert_eq!(backstop_core::plumbing::known_method(&http::Method::from_bytes(b"PURGE").unwrap()), None);
/// ```
pub fn known_method(method: &http::Method) -> Option<&'static str> {
    use http::Method;
    Some(match *method {
        Method::GET => "GET",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::DELETE => "DELETE",
        Method::PATCH => "PATCH",
        Method::HEAD => "HEAD",
        Method::OPTIONS => "OPTIONS",
        Method::TRACE => "TRACE",
        Method::CONNECT => "CONNECT",
        _ => return None,
    })
}

/// Whether HTTP calls this method idempotent (RFC 9110 §9.2.2: GET, HEAD, OPTIONS, TRACE, PUT,
/// DELETE), so a request with it may be sent again without an idempotency key.
pub fn is_idempotent_method(method: &http::Method) -> bool {
    use http::Method;
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE | Method::PUT | Method::DELETE
    )
}
