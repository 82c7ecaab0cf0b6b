use crate::NotCopyable;
use backstop_core::BoxError;
use bytes::{Buf, Bytes, BytesMut};
use http::{HeaderMap, Request};
use http_body::{Body, Frame, SizeHint};
use pin_project::pin_project;
use std::{
    fmt,
    future::Future,
    pin::Pin,
    task::{Context, Poll, ready},
};
use tower_layer::Layer;
use tower_service::Service;

/// A request body that the retry layer can replay when it fit the buffer.
///
/// Built by [`BufferBodyLayer`]: a body that ended within the limit is held in memory
/// ([`BufferedBody::is_replayable`]) and each attempt gets a cheap copy (`Bytes` is
/// reference-counted); a larger body is streamed once, the part already read first, and the
/// retry layer records why it was not retried.
pub struct BufferedBody<B> {
    kind: Kind<B>,
}

enum Kind<B> {
    Buffered {
        data: Option<Bytes>,
        trailers: Option<HeaderMap>,
    },
    Streaming {
        prefix: Option<Bytes>,
        rest: B,
        limit: usize,
    },
}

impl<B> fmt::Debug for BufferedBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            Kind::Buffered { data, .. } => f
                .debug_struct("BufferedBody::Buffered")
                .field("len", &data.as_ref().map_or(0, Bytes::len))
                .finish(),
            Kind::Streaming { limit, .. } => f
                .debug_struct("BufferedBody::Streaming")
                .field("limit", limit)
                .finish(),
        }
    }
}

impl<B> BufferedBody<B> {
    /// A replayable body holding `data`.
    pub fn full(data: impl Into<Bytes>) -> Self {
        let data = data.into();
        BufferedBody {
            kind: Kind::Buffered {
                data: (!data.is_empty()).then_some(data),
                trailers: None,
            },
        }
    }

    /// Whether the body was buffered and can be replayed.
    pub fn is_replayable(&self) -> bool {
        matches!(self.kind, Kind::Buffered { .. })
    }

    pub(crate) fn try_clone(&self) -> Result<Self, NotCopyable> {
        match &self.kind {
            Kind::Buffered { data, trailers } => Ok(BufferedBody {
                kind: Kind::Buffered {
                    data: data.clone(),
                    trailers: trailers.clone(),
                },
            }),
            Kind::Streaming { limit, .. } => Err(NotCopyable::new(format!(
                "the request body is larger than the {limit}-byte replay buffer, so it was sent once"
            ))),
        }
    }
}

impl<B> Body for BufferedBody<B>
where
    B: Body + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match &mut self.get_mut().kind {
            Kind::Buffered { data, trailers } => {
                if let Some(d) = data.take() {
                    return Poll::Ready(Some(Ok(Frame::data(d))));
                }
                Poll::Ready(trailers.take().map(|t| Ok(Frame::trailers(t))))
            }
            Kind::Streaming { prefix, rest, .. } => {
                if let Some(p) = prefix.take() {
                    return Poll::Ready(Some(Ok(Frame::data(p))));
                }
                match ready!(Pin::new(rest).poll_frame(cx)) {
                    None => Poll::Ready(None),
                    Some(Err(e)) => Poll::Ready(Some(Err(e.into()))),
                    Some(Ok(frame)) => Poll::Ready(Some(Ok(
                        frame.map_data(|mut d| d.copy_to_bytes(d.remaining()))
                    ))),
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Buffered { data, trailers } => data.is_none() && trailers.is_none(),
            Kind::Streaming { prefix, rest, .. } => prefix.is_none() && rest.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Buffered { data, .. } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            Kind::Streaming { prefix, rest, .. } => {
                let p = prefix.as_ref().map_or(0, |d| d.len() as u64);
                let r = rest.size_hint();
                let mut hint = SizeHint::new();
                hint.set_lower(r.lower().saturating_add(p));
                if let Some(u) = r.upper() {
                    hint.set_upper(u.saturating_add(p));
                }
                hint
            }
        }
    }
}

/// Buffers request bodies up to `limit` bytes so the retry layer can replay them.
///
/// Place it outside the retry layer. A body that ends within the limit becomes a replayable
/// [`BufferedBody`]; a longer one is passed on as a stream (what was read so far, then the rest),
/// sent once, and never retried; the retry layer records the reason. Reading stops at the limit,
/// so memory per request is bounded by it.
#[derive(Clone, Copy, Debug)]
pub struct BufferBodyLayer {
    limit: usize,
}

impl BufferBodyLayer {
    /// Buffers bodies of at most `limit` bytes.
    pub const fn new(limit: usize) -> Self {
        BufferBodyLayer { limit }
    }
}

impl<S> Layer<S> for BufferBodyLayer {
    type Service = BufferBody<S>;
    fn layer(&self, inner: S) -> Self::Service {
        BufferBody {
            inner,
            limit: self.limit,
        }
    }
}

/// See [`BufferBodyLayer`].
#[derive(Clone, Debug)]
pub struct BufferBody<S> {
    inner: S,
    limit: usize,
}

impl<S, B> Service<Request<B>> for BufferBody<S>
where
    S: Service<Request<BufferedBody<B>>> + Clone,
    S::Error: Into<BoxError>,
    B: Body + Unpin,
    B::Error: Into<BoxError>,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = BufferBodyFuture<S, B>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let clone = self.inner.clone();
        let svc = std::mem::replace(&mut self.inner, clone);
        let (parts, body) = req.into_parts();
        BufferBodyFuture {
            state: BufState::Reading {
                svc: Some(svc),
                parts: Some(parts),
                body: Some(body),
                buf: BytesMut::new(),
                trailers: None,
                limit: self.limit,
            },
        }
    }
}

/// Response future of [`BufferBody`].
#[pin_project]
pub struct BufferBodyFuture<S, B>
where
    S: Service<Request<BufferedBody<B>>>,
{
    #[pin]
    state: BufState<S, B>,
}

impl<S, B> fmt::Debug for BufferBodyFuture<S, B>
where
    S: Service<Request<BufferedBody<B>>>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BufferBodyFuture").finish_non_exhaustive()
    }
}

// Boxing the request parts to shrink the reading state would cost an allocation per call.
#[allow(clippy::large_enum_variant)]
#[pin_project(project = BufProj)]
enum BufState<S, B>
where
    S: Service<Request<BufferedBody<B>>>,
{
    Reading {
        svc: Option<S>,
        parts: Option<http::request::Parts>,
        body: Option<B>,
        buf: BytesMut,
        trailers: Option<HeaderMap>,
        limit: usize,
    },
    Calling {
        #[pin]
        fut: S::Future,
    },
}

impl<S, B> Future for BufferBodyFuture<S, B>
where
    S: Service<Request<BufferedBody<B>>>,
    S::Error: Into<BoxError>,
    B: Body + Unpin,
    B::Error: Into<BoxError>,
{
    type Output = Result<S::Response, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            let next = match this.state.as_mut().project() {
                BufProj::Calling { fut } => return fut.poll(cx).map_err(Into::into),
                BufProj::Reading {
                    svc,
                    parts,
                    body,
                    buf,
                    trailers,
                    limit,
                } => {
                    let b = body.as_mut().expect("body present while reading");
                    let over = loop {
                        if b.is_end_stream() {
                            break false;
                        }
                        match ready!(Pin::new(&mut *b).poll_frame(cx)) {
                            None => break false,
                            Some(Err(e)) => return Poll::Ready(Err(e.into())),
                            Some(Ok(frame)) => match frame.into_data() {
                                Ok(mut data) => {
                                    buf.extend_from_slice(&data.copy_to_bytes(data.remaining()));
                                    if buf.len() > *limit {
                                        break true;
                                    }
                                }
                                Err(frame) => {
                                    if let Ok(t) = frame.into_trailers() {
                                        *trailers = Some(t);
                                    }
                                }
                            },
                        }
                    };
                    let data = std::mem::take(buf).freeze();
                    let kind = if over {
                        Kind::Streaming {
                            prefix: Some(data),
                            rest: body.take().expect("body present while reading"),
                            limit: *limit,
                        }
                    } else {
                        Kind::Buffered {
                            data: (!data.is_empty()).then_some(data),
                            trailers: trailers.take(),
                        }
                    };
                    let req = Request::from_parts(
                        parts.take().expect("parts present while reading"),
                        BufferedBody { kind },
                    );
                    let mut svc = svc.take().expect("service present while reading");
                    BufState::Calling { fut: svc.call(req) }
                }
            };
            this.state.set(next);
        }
    }
}
