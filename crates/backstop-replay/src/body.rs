use crate::problem::BodyError;
use backstop_core::BoxError;
use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use std::{
    pin::Pin,
    task::{Context, Poll},
};

/// The part of a body already read, then the rest (or the error that stopped the reading).
pub(crate) struct PrefixedBody<B> {
    pub(crate) prefix: Option<Bytes>,
    pub(crate) rest: Option<B>,
    pub(crate) error: Option<BoxError>,
}

impl<B> Body for PrefixedBody<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let this = self.get_mut();
        if let Some(p) = this.prefix.take() {
            return Poll::Ready(Some(Ok(Frame::data(p))));
        }
        if let Some(e) = this.error.take() {
            return Poll::Ready(Some(Err(BodyError(e))));
        }
        match &mut this.rest {
            Some(rest) => Pin::new(rest)
                .poll_frame(cx)
                .map(|f| f.map(|r| r.map_err(|e| BodyError(e.into())))),
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.prefix.is_none()
            && self.error.is_none()
            && self.rest.as_ref().is_none_or(|r| r.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        let p = self.prefix.as_ref().map_or(0, |b| b.len() as u64);
        match &self.rest {
            None => SizeHint::with_exact(p),
            Some(r) => {
                let h = r.size_hint();
                let mut out = SizeHint::new();
                out.set_lower(h.lower().saturating_add(p));
                if let Some(u) = h.upper() {
                    out.set_upper(u.saturating_add(p));
                }
                out
            }
        }
    }
}
