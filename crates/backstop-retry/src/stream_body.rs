//! A request body that is copied while it streams, so a retry can send it again without the
//! first attempt waiting for the whole body (linkerd2-proxy's retries work this way).

use crate::{NotCopyable, Resend};
use backstop_core::BoxError;
use bytes::{Buf, Bytes};
use http::{HeaderMap, Request};
use http_body::{Body, Frame, SizeHint};
use std::{
    fmt,
    pin::Pin,
    sync::{Arc, Mutex},
    task::{Context, Poll},
};

/// What every copy of one request body shares: the original body (while nobody reads it), what
/// was read of it so far (up to the limit), and whether it ended.
struct Shared<B> {
    source: Option<B>,
    /// A reader holds the source.
    taken: bool,
    chunks: Vec<Bytes>,
    len: usize,
    limit: usize,
    /// More than `limit` bytes were read: what was read is not all kept, no new copy can start.
    over: bool,
    trailers: Option<HeaderMap>,
    ended: bool,
    failed: bool,
}

/// The handle to a request body being copied as it streams, kept in the request's extensions
/// by [`StreamingResend`].
pub(crate) struct BodyTee<B> {
    shared: Arc<Mutex<Shared<B>>>,
}

impl<B> Clone for BodyTee<B> {
    fn clone(&self) -> Self {
        BodyTee {
            shared: self.shared.clone(),
        }
    }
}

impl<B> fmt::Debug for BodyTee<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = self.lock();
        f.debug_struct("BodyTee")
            .field("read", &s.len)
            .field("limit", &s.limit)
            .field("over", &s.over)
            .field("ended", &s.ended)
            .finish()
    }
}

impl<B> BodyTee<B> {
    /// Starts copying `body`, keeping at most `limit` bytes for copies.
    pub(crate) fn new(body: B, limit: usize) -> Self {
        BodyTee {
            shared: Arc::new(Mutex::new(Shared {
                source: Some(body),
                taken: false,
                chunks: Vec::new(),
                len: 0,
                limit,
                over: false,
                trailers: None,
                ended: false,
                failed: false,
            })),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Shared<B>> {
        self.shared.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A body for one more attempt: what was read so far, then the rest of the original. Fails
    /// when more than the limit was read (part of the body was sent and not kept: the request
    /// is committed) or reading the original failed.
    pub(crate) fn reader(&self) -> Result<TeeReader<B>, NotCopyable> {
        self.check()?;
        Ok(TeeReader {
            shared: self.shared.clone(),
            source: None,
            next: 0,
            trailers_sent: false,
        })
    }

    /// Whether another copy can still be made (see [`reader`](BodyTee::reader)).
    pub(crate) fn check(&self) -> Result<(), NotCopyable> {
        let s = self.lock();
        if s.over {
            return Err(NotCopyable::new(format!(
                "its body was longer than the {} bytes kept for a retry, and part of it was sent",
                s.limit
            )));
        }
        if s.failed {
            return Err(NotCopyable::new("reading its body failed"));
        }
        Ok(())
    }
}

/// One attempt's copy of a request body being copied by [`StreamingResend`]: what was read
/// so far, then the rest of the original.
pub struct TeeReader<B> {
    shared: Arc<Mutex<Shared<B>>>,
    /// The original body, while this copy reads it.
    source: Option<B>,
    /// The next kept chunk to send.
    next: usize,
    trailers_sent: bool,
}

impl<B> fmt::Debug for TeeReader<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TeeReader")
            .field("next", &self.next)
            .field("reading", &self.source.is_some())
            .finish()
    }
}

impl<B> Drop for TeeReader<B> {
    fn drop(&mut self) {
        // Hand the original back for the next copy.
        if let Some(source) = self.source.take() {
            let mut s = self.shared.lock().unwrap_or_else(|p| p.into_inner());
            s.source = Some(source);
            s.taken = false;
        }
    }
}

/// The error of a copy that needs the original body while another copy still reads it.
#[derive(Debug)]
struct StillSending;

impl fmt::Display for StillSending {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an earlier attempt is still sending this request's body")
    }
}

impl std::error::Error for StillSending {}

impl<B> Body for TeeReader<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        if this.source.is_none() {
            let mut s = this.shared.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(chunk) = s.chunks.get(this.next) {
                this.next += 1;
                return Poll::Ready(Some(Ok(Frame::data(chunk.clone()))));
            }
            if s.ended {
                if !this.trailers_sent
                    && let Some(t) = s.trailers.clone()
                {
                    this.trailers_sent = true;
                    return Poll::Ready(Some(Ok(Frame::trailers(t))));
                }
                return Poll::Ready(None);
            }
            if s.taken {
                return Poll::Ready(Some(Err(Box::new(StillSending))));
            }
            match s.source.take() {
                Some(source) => {
                    s.taken = true;
                    this.source = Some(source);
                }
                None => return Poll::Ready(None),
            }
        }
        let source = this.source.as_mut().expect("taken above");
        let frame = match Pin::new(source).poll_frame(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(frame) => frame,
        };
        let mut s = this.shared.lock().unwrap_or_else(|p| p.into_inner());
        match frame {
            None => {
                s.ended = true;
                s.taken = false;
                this.source = None;
                this.trailers_sent = true;
                Poll::Ready(None)
            }
            Some(Err(e)) => {
                s.failed = true;
                Poll::Ready(Some(Err(e.into())))
            }
            Some(Ok(frame)) => match frame.into_data() {
                Ok(mut data) => {
                    let data = data.copy_to_bytes(data.remaining());
                    if !s.over {
                        s.len += data.len();
                        if s.len > s.limit {
                            s.over = true;
                            s.chunks.clear();
                        } else {
                            s.chunks.push(data.clone());
                            this.next = s.chunks.len();
                        }
                    }
                    Poll::Ready(Some(Ok(Frame::data(data))))
                }
                Err(frame) => {
                    if let Some(t) = frame.trailers_ref() {
                        s.trailers = Some(t.clone());
                        this.trailers_sent = true;
                    }
                    Poll::Ready(Some(Ok(frame.map_data(|_: Bytes| Bytes::new()))))
                }
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        if self.source.is_some() {
            return false;
        }
        let s = self.shared.lock().unwrap_or_else(|p| p.into_inner());
        s.ended && self.next >= s.chunks.len() && (self.trailers_sent || s.trailers.is_none())
    }

    fn size_hint(&self) -> SizeHint {
        let s = self.shared.lock().unwrap_or_else(|p| p.into_inner());
        if s.ended {
            let left: usize = s.chunks.iter().skip(self.next).map(Bytes::len).sum();
            return SizeHint::with_exact(left as u64);
        }
        SizeHint::default()
    }
}

/// A request body type that a [`TeeReader`] can become: what the client under the stack takes
/// (tonic's body with the `tonic` feature, a boxed body), so the stack takes and gives the same
/// request type.
pub trait TeeableBody: Sized + Send + 'static {
    /// `reader` as this body type.
    fn from_reader(reader: TeeReader<Self>) -> Self;
    /// An empty body (what the kept request holds; its bytes are kept beside it).
    fn placeholder() -> Self;
}

impl<E> TeeableBody for http_body_util::combinators::UnsyncBoxBody<Bytes, E>
where
    E: From<BoxError> + Into<BoxError> + 'static,
{
    fn from_reader(reader: TeeReader<Self>) -> Self {
        use http_body_util::BodyExt;
        reader.map_err(E::from).boxed_unsync()
    }
    fn placeholder() -> Self {
        use http_body_util::BodyExt;
        http_body_util::Empty::new()
            .map_err(|never| match never {})
            .boxed_unsync()
    }
}

#[cfg(feature = "tonic")]
impl TeeableBody for tonic::body::Body {
    fn from_reader(reader: TeeReader<Self>) -> Self {
        tonic::body::Body::new(reader)
    }
    fn placeholder() -> Self {
        tonic::body::Body::empty()
    }
}

/// Copies requests whose bodies stream ([`TeeableBody`]), without reading the body first: the
/// first attempt sends it as it arrives while up to `limit` bytes are kept; a retry sends what
/// was kept, then the rest. Past the limit the request is committed: it is not retried, and
/// the retry layer says why.
#[derive(Clone, Copy, Debug)]
pub struct StreamingResend {
    limit: usize,
}

impl StreamingResend {
    /// Keeps up to `limit` bytes of each body for retries.
    pub const fn new(limit: usize) -> Self {
        StreamingResend { limit }
    }

    /// The limit.
    pub const fn limit(&self) -> usize {
        self.limit
    }
}

impl Default for StreamingResend {
    /// 64 KiB.
    fn default() -> Self {
        StreamingResend::new(64 * 1024)
    }
}

impl<B: TeeableBody> Resend<Request<B>> for StreamingResend {
    fn prepare(&self, req: Request<B>) -> Request<B> {
        if req.extensions().get::<BodyTee<B>>().is_some() {
            return req;
        }
        let (mut parts, body) = req.into_parts();
        parts.extensions.insert(BodyTee::new(body, self.limit));
        Request::from_parts(parts, B::placeholder())
    }

    fn attempt_name(&self, req: &Request<B>) -> Option<std::borrow::Cow<'static, str>> {
        let path = req.uri().path();
        Some(path.strip_prefix('/').unwrap_or(path).to_owned().into())
    }

    fn check(&self, req: &Request<B>) -> Result<(), NotCopyable> {
        match req.extensions().get::<BodyTee<B>>() {
            Some(tee) => tee.check(),
            None => Err(NotCopyable::new("its body was not prepared for copying")),
        }
    }

    fn copy(&self, req: &Request<B>) -> Result<Request<B>, NotCopyable> {
        let tee = req
            .extensions()
            .get::<BodyTee<B>>()
            .ok_or_else(|| NotCopyable::new("its body was not prepared for copying"))?;
        Ok(crate::resend::with_parts_of(
            req,
            B::from_reader(tee.reader()?),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    type Boxed = http_body_util::combinators::UnsyncBoxBody<Bytes, BoxError>;

    /// A body of frames, given one at a time.
    struct Frames(std::collections::VecDeque<Frame<Bytes>>);

    impl Body for Frames {
        type Data = Bytes;
        type Error = BoxError;
        fn poll_frame(
            mut self: Pin<&mut Self>,
            _cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
            Poll::Ready(self.0.pop_front().map(Ok))
        }
    }

    fn frames(frames: Vec<Frame<Bytes>>) -> Boxed {
        Frames(frames.into()).boxed_unsync()
    }

    fn streamed(chunks: &[&'static str]) -> Boxed {
        frames(
            chunks
                .iter()
                .map(|c| Frame::data(Bytes::from_static(c.as_bytes())))
                .collect(),
        )
    }

    async fn text(body: Boxed) -> Result<String, BoxError> {
        let bytes = body.collect().await?.to_bytes();
        Ok(String::from_utf8(bytes.to_vec()).unwrap())
    }

    fn request(chunks: &[&'static str]) -> Request<Boxed> {
        Request::post("/upload").body(streamed(chunks)).unwrap()
    }

    #[tokio::test]
    async fn a_retry_sends_what_was_read_then_the_rest() {
        let resend = StreamingResend::new(1024);
        let kept = resend.prepare(request(&["ab", "cd", "ef"]));
        let first = resend.copy(&kept).unwrap();
        // The first attempt reads part of the body, then fails (its body is dropped).
        let mut body = first.into_body();
        let frame = body.frame().await.unwrap().unwrap();
        assert_eq!(frame.into_data().unwrap(), "ab");
        drop(body);
        // The retry gets all of it, in order.
        let second = resend.copy(&kept).unwrap();
        assert_eq!(text(second.into_body()).await.unwrap(), "abcdef");
        // And so does a third, from memory.
        let third = resend.copy(&kept).unwrap();
        assert_eq!(text(third.into_body()).await.unwrap(), "abcdef");
    }

    #[tokio::test]
    async fn past_the_limit_the_request_is_committed() {
        let resend = StreamingResend::new(3);
        let kept = resend.prepare(request(&["ab", "cd", "ef"]));
        let first = resend.copy(&kept).unwrap();
        assert_eq!(
            text(first.into_body()).await.unwrap(),
            "abcdef",
            "sent in full once"
        );
        let why = resend.copy(&kept).unwrap_err();
        assert!(why.to_string().contains("longer than the 3 bytes"), "{why}");
    }

    #[tokio::test]
    async fn a_copy_cannot_read_while_another_holds_the_original() {
        let resend = StreamingResend::new(1024);
        let kept = resend.prepare(request(&["ab", "cd"]));
        let mut first = resend.copy(&kept).unwrap().into_body();
        first.frame().await.unwrap().unwrap();
        let mut second = resend.copy(&kept).unwrap().into_body();
        let f = second.frame().await.unwrap().unwrap();
        assert_eq!(f.into_data().unwrap(), "ab", "what was kept");
        assert!(
            second.frame().await.unwrap().is_err(),
            "not the original's rest"
        );
        drop(first);
    }

    #[tokio::test]
    async fn trailers_are_replayed() {
        let resend = StreamingResend::new(1024);
        let mut trailers = HeaderMap::new();
        trailers.insert("x-checksum", "abc".parse().unwrap());
        let body = frames(vec![
            Frame::data(Bytes::from_static(b"xy")),
            Frame::trailers(trailers.clone()),
        ]);
        let req = Request::post("/").body(body).unwrap();
        let kept = resend.prepare(req);
        for _ in 0..2 {
            let collected = resend
                .copy(&kept)
                .unwrap()
                .into_body()
                .collect()
                .await
                .unwrap();
            assert_eq!(collected.trailers(), Some(&trailers));
            assert_eq!(collected.to_bytes(), "xy");
        }
    }
}
