use std::{borrow::Cow, error::Error, fmt};

/// Why a request could not be copied for another attempt (a streamed body, say): the call
/// has one attempt. Not to be confused with a request that is not *replay-safe*
/// ([`StopReason::NotReplaySafe`](crate::StopReason::NotReplaySafe)), which could be copied but
/// must not be repeated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NotCopyable {
    reason: Cow<'static, str>,
}

impl NotCopyable {
    /// A request that cannot be copied, for the given reason (lowercase, no trailing period,
    /// completing "not retried because ...").
    pub fn new(reason: impl Into<Cow<'static, str>>) -> Self {
        NotCopyable {
            reason: reason.into(),
        }
    }

    /// The reason.
    pub fn reason(&self) -> &str {
        &self.reason
    }
}

impl fmt::Display for NotCopyable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.reason)
    }
}

impl Error for NotCopyable {}

/// Makes the copy of a request that one attempt sends.
///
/// The retry layer resends requests, it never rebuilds them: the original is kept and each
/// attempt sends a copy of it, so every attempt carries the same headers, idempotency key and
/// body. (The client resends; the server side, `backstop::replay`, replays stored results.)
pub trait Resend<Req> {
    /// Readies a request to be kept for copies, once per call, before the first copy: a
    /// streaming body is set up to be copied as it is sent ([`StreamingResend`](crate::StreamingResend)).
    /// The default keeps it as it is.
    fn prepare(&self, req: Req) -> Req {
        req
    }

    /// Whether `req` can still be copied, asked before a retry is decided (so that a request
    /// that can no longer be copied ends with its last attempt's result). The default: yes.
    fn check(&self, req: &Req) -> Result<(), NotCopyable> {
        let _ = req;
        Ok(())
    }

    /// A copy of `req` for one attempt, or why there can be none.
    fn copy(&self, req: &Req) -> Result<Req, NotCopyable>;

    /// The name an attempt's span gets in OpenTelemetry (`otel.name`), as the protocol's
    /// semantic conventions name a client span: the method for HTTP, `package.Service/Method`
    /// for gRPC. Asked only when the span is recorded. The default: none (the span stays
    /// `attempt`).
    fn attempt_name(&self, req: &Req) -> Option<Cow<'static, str>> {
        let _ = req;
        None
    }
}

/// Copies any `Clone` request by cloning it (the default, for non-HTTP tool calls).
#[derive(Clone, Copy, Debug, Default)]
pub struct CloneResend;

impl<Req: Clone> Resend<Req> for CloneResend {
    fn copy(&self, req: &Req) -> Result<Req, NotCopyable> {
        Ok(req.clone())
    }
}

/// Copies an `http::Request<B>` whose body is `Clone` (`Full<Bytes>`, `Empty<Bytes>`, `String`,
/// `()`): method, URI, version, headers, extensions and body. A streaming body is copied as it
/// is sent by [`StreamingResend`](crate::StreamingResend).
#[derive(Clone, Copy, Debug, Default)]
pub struct HttpResend;

impl<B: Clone> Resend<http::Request<B>> for HttpResend {
    fn copy(&self, req: &http::Request<B>) -> Result<http::Request<B>, NotCopyable> {
        Ok(with_parts_of(req, req.body().clone()))
    }

    fn attempt_name(&self, req: &http::Request<B>) -> Option<Cow<'static, str>> {
        // The semantic conventions name a client span by its method, or `HTTP`.
        let method = backstop_core::plumbing::known_method(req.method()).unwrap_or("HTTP");
        Some(Cow::Borrowed(method))
    }
}

/// A request with `req`'s method, URI, version, headers and extensions, and `body`.
pub(crate) fn with_parts_of<B, B2>(req: &http::Request<B>, body: B2) -> http::Request<B2> {
    let mut copy = http::Request::new(body);
    *copy.method_mut() = req.method().clone();
    *copy.uri_mut() = req.uri().clone();
    *copy.version_mut() = req.version();
    *copy.headers_mut() = req.headers().clone();
    *copy.extensions_mut() = req.extensions().clone();
    copy
}

/// The caller's request, kept as the caller sent it: every attempt sends a copy.
pub(crate) enum Template<Req> {
    /// One attempt only (the policy says the call may not be retried, or an outer layer
    /// retries): nothing is kept.
    Unneeded,
    Kept(Req),
    /// It could not be copied, for this reason: the call has one attempt.
    Uncopyable(NotCopyable),
}

impl<Req> Template<Req> {
    /// Keeps `req` (prepared for copying) and returns a copy to send, or, when it cannot be
    /// copied, keeps why and returns `req` itself.
    pub(crate) fn keep(&mut self, resend: &impl Resend<Req>, req: Req) -> Req {
        let req = resend.prepare(req);
        match resend.copy(&req) {
            Ok(copy) => {
                *self = Template::Kept(req);
                copy
            }
            Err(why) => {
                *self = Template::Uncopyable(why);
                req
            }
        }
    }

    /// Why a request that was not kept cannot be sent again.
    pub(crate) const NOT_KEPT: &'static str = "the request was not kept for a retry";

    pub(crate) fn kept(&self) -> Result<&Req, NotCopyable> {
        match self {
            Template::Kept(req) => Ok(req),
            Template::Uncopyable(why) => Err(why.clone()),
            Template::Unneeded => Err(NotCopyable::new(Self::NOT_KEPT)),
        }
    }
}
