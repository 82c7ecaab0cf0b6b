use crate::body::ReplayBody;
use std::{borrow::Cow, error::Error, fmt};

/// Why a request could not be replayed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NotReplayable {
    reason: Cow<'static, str>,
}

impl NotReplayable {
    /// A request that cannot be replayed, for the given reason (lowercase, no trailing period,
    /// completing "not retried because ...").
    pub fn new(reason: impl Into<Cow<'static, str>>) -> Self {
        NotReplayable {
            reason: reason.into(),
        }
    }

    /// The reason.
    pub fn reason(&self) -> &str {
        &self.reason
    }
}

impl fmt::Display for NotReplayable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.reason)
    }
}

impl Error for NotReplayable {}

/// Makes the copy of a request that one attempt consumes.
///
/// The retry layer replays requests, it never rebuilds them: the original is kept and each
/// attempt sends a replay of it, so every attempt carries the same headers, idempotency key and
/// body.
pub trait Replay<Req> {
    /// A copy of `req` for one attempt, or why there can be none.
    fn replay(&self, req: &Req) -> Result<Req, NotReplayable>;
}

/// Replays any `Clone` request by cloning it (the default, for non-HTTP tool calls).
#[derive(Clone, Copy, Debug, Default)]
pub struct CloneRequest;

impl<Req: Clone> Replay<Req> for CloneRequest {
    fn replay(&self, req: &Req) -> Result<Req, NotReplayable> {
        Ok(req.clone())
    }
}

/// Replays an `http::Request<B>` whose body can be replayed ([`ReplayableBody`]): method, URI,
/// version, headers, extensions and body.
#[derive(Clone, Copy, Debug, Default)]
pub struct HttpReplay;

impl<B: ReplayableBody> Replay<http::Request<B>> for HttpReplay {
    fn replay(&self, req: &http::Request<B>) -> Result<http::Request<B>, NotReplayable> {
        let mut copy = http::Request::new(req.body().replay_body()?);
        *copy.method_mut() = req.method().clone();
        *copy.uri_mut() = req.uri().clone();
        *copy.version_mut() = req.version();
        *copy.headers_mut() = req.headers().clone();
        *copy.extensions_mut() = req.extensions().clone();
        Ok(copy)
    }
}

/// A request body that can be sent again.
///
/// Every `Clone` body is (`Full<Bytes>`, `Empty<Bytes>`, `String`, `()`); a streaming body is
/// not, unless [`BufferBodyLayer`](crate::BufferBodyLayer) buffered it into a [`ReplayBody`].
pub trait ReplayableBody: Sized {
    /// A copy of the body for another attempt.
    fn replay_body(&self) -> Result<Self, NotReplayable>;
}

impl<B: Clone> ReplayableBody for B {
    fn replay_body(&self) -> Result<Self, NotReplayable> {
        Ok(self.clone())
    }
}

impl<B> ReplayableBody for ReplayBody<B> {
    fn replay_body(&self) -> Result<Self, NotReplayable> {
        self.try_clone()
    }
}
