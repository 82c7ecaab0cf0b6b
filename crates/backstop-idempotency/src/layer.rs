use crate::{ActionContext, IdempotencyKey, KeyFormat};
use backstop_core::{
    BoxError, CallContext, HasExtensions, InvalidConfig, ReplaySafe, UnvouchedKey,
};
use http::{HeaderName, Request};
use pin_project::pin_project;
use rand::{TryRng, rngs::SysRng};
use std::{
    fmt,
    future::Future,
    pin::Pin,
    task::{Context, Poll},
};
use tower_layer::Layer;
use tower_service::Service;

/// A non-HTTP tool call that can carry an idempotency key.
///
/// ```
/// use backstop_idempotency::{IdempotencyKey, KeyedRequest};
///
/// struct ToolCall { tool: String, key: Option<IdempotencyKey> }
///
/// impl KeyedRequest for ToolCall {
///     fn needs_key(&self) -> bool { !self.tool.starts_with("get_") }
///     fn idempotency_key(&self) -> Option<&IdempotencyKey> { self.key.as_ref() }
///     fn set_idempotency_key(&mut self, key: IdempotencyKey) { self.key = Some(key) }
/// }
/// ```
pub trait KeyedRequest {
    /// Whether repeating this call could repeat a side effect (a write tool), so it needs a key
    /// to be retried after a lost reply.
    fn needs_key(&self) -> bool;
    /// The key the call carries, if any.
    fn idempotency_key(&self) -> Option<&IdempotencyKey>;
    /// Attaches a key.
    fn set_idempotency_key(&mut self, key: IdempotencyKey);
}

/// Where a request carries its key: decides whether it needs one, whether it has one, and puts
/// it there.
pub trait Inject<Req> {
    /// Whether the request needs a key (it is not replay-safe without one).
    fn needs_key(&self, req: &Req) -> bool;
    /// Whether the request already carries a key; an existing key is never overwritten.
    fn has_key(&self, req: &Req) -> bool;
    /// The key the request carries, when it carries a valid one (what a dead letter names).
    fn carried(&self, req: &Req) -> Option<IdempotencyKey>;
    /// Puts `key` on the request.
    fn inject(&self, req: &mut Req, key: &IdempotencyKey);
}

/// Keys in an HTTP header (`Idempotency-Key` by default), for methods that are not idempotent
/// (POST, PATCH and every method outside RFC 9110's idempotent set).
#[derive(Clone, Debug)]
pub struct HttpKeys {
    header: HeaderName,
    format: KeyFormat,
}

impl Default for HttpKeys {
    fn default() -> Self {
        HttpKeys {
            header: HeaderName::from_static("idempotency-key"),
            format: KeyFormat::Plain,
        }
    }
}

impl<B> Inject<Request<B>> for HttpKeys {
    fn needs_key(&self, req: &Request<B>) -> bool {
        !backstop_core::plumbing::is_idempotent_method(req.method())
    }
    fn has_key(&self, req: &Request<B>) -> bool {
        req.headers().contains_key(&self.header)
    }
    fn carried(&self, req: &Request<B>) -> Option<IdempotencyKey> {
        IdempotencyKey::from_header(req.headers().get(&self.header)?).ok()
    }
    fn inject(&self, req: &mut Request<B>, key: &IdempotencyKey) {
        req.headers_mut()
            .insert(self.header.clone(), key.header_value(self.format));
    }
}

/// Keys on a non-HTTP tool call, through [`KeyedRequest`].
#[derive(Clone, Copy, Debug, Default)]
pub struct ToolKeys;

/// A foreign type under the stack carries its key in its extensions. Every call counts as one
/// that needs a key (a key on a read is harmless) unless it is marked [`ReplaySafe`].
impl<T> KeyedRequest for backstop_core::WithExtensions<T> {
    fn needs_key(&self) -> bool {
        !ReplaySafe::is_marked(self)
    }
    fn idempotency_key(&self) -> Option<&IdempotencyKey> {
        self.extensions().get::<IdempotencyKey>()
    }
    fn set_idempotency_key(&mut self, key: IdempotencyKey) {
        self.extensions_mut().insert(key);
    }
}

impl<Req: KeyedRequest> Inject<Req> for ToolKeys {
    fn needs_key(&self, req: &Req) -> bool {
        req.needs_key()
    }
    fn has_key(&self, req: &Req) -> bool {
        req.idempotency_key().is_some()
    }
    fn carried(&self, req: &Req) -> Option<IdempotencyKey> {
        req.idempotency_key().cloned()
    }
    fn inject(&self, req: &mut Req, key: &IdempotencyKey) {
        req.set_idempotency_key(key.clone());
    }
}

/// The last source of a key, when the request carries none and its extensions hold neither a
/// key nor an [`ActionContext`].
pub trait MakeKey<Req> {
    /// A key for this logical call, or `None` to send it without one (it will then not be
    /// retried after a lost reply).
    fn make_key(&self, req: &Req) -> Option<IdempotencyKey>;
}

/// A random 128-bit key per logical call, from the operating system's generator. It protects
/// the retries of one call; it cannot recognise a model calling the same tool twice, which needs
/// a derived key ([`ActionContext`]).
#[derive(Clone, Copy, Debug, Default)]
pub struct RandomKey;

impl<Req> MakeKey<Req> for RandomKey {
    fn make_key(&self, _req: &Req) -> Option<IdempotencyKey> {
        let mut bytes = [0u8; 16];
        SysRng.try_fill_bytes(&mut bytes).ok()?;
        IdempotencyKey::new(hex::encode(bytes)).ok()
    }
}

/// Never makes a key: only keys the caller or the runtime provided are used.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoKey;

impl<Req> MakeKey<Req> for NoKey {
    fn make_key(&self, _req: &Req) -> Option<IdempotencyKey> {
        None
    }
}

impl<Req, F> MakeKey<Req> for F
where
    F: Fn(&Req) -> Option<IdempotencyKey>,
{
    fn make_key(&self, req: &Req) -> Option<IdempotencyKey> {
        self(req)
    }
}

/// Attaches an idempotency key to every request that needs one, once per logical call.
///
/// Place it **outside** the retry layer, so the key exists before the first attempt and every
/// attempt replays it. Sources, in order:
///
/// 1. a key already on the request (never overwritten);
/// 2. an [`IdempotencyKey`] in the request's extensions (an agent runtime put it there);
/// 3. an [`ActionContext`] in the extensions, from which the key is derived;
/// 4. the generator ([`RandomKey`] by default).
///
/// A keyed request is marked [`ReplaySafe`] and the key is also put in its extensions. If the
/// layer finds itself inside a retry layer and would have to generate a key, it fails the call
/// with an [`InvalidConfig`] error instead: a key generated per attempt is exactly the bug an
/// idempotency key exists to prevent.
#[derive(Clone, Debug)]
pub struct IdempotencyLayer<I, G = RandomKey> {
    inject: I,
    make: G,
    require: bool,
    vouched: bool,
}

impl IdempotencyLayer<HttpKeys> {
    /// Keys in the `Idempotency-Key` header, plain format, random keys as the last resort.
    pub fn http() -> Self {
        IdempotencyLayer {
            inject: HttpKeys::default(),
            make: RandomKey,
            require: false,
            vouched: false,
        }
    }

    /// The header name (`Idempotency-Key` by default).
    #[must_use]
    pub fn header(mut self, name: HeaderName) -> Self {
        self.inject.header = name;
        self
    }

    /// The header value's format ([`KeyFormat::Plain`] by default).
    #[must_use]
    pub fn format(mut self, format: KeyFormat) -> Self {
        self.inject.format = format;
        self
    }
}

impl IdempotencyLayer<ToolKeys> {
    /// Keys on non-HTTP tool calls ([`KeyedRequest`]), random keys as the last resort.
    pub fn tool_calls() -> Self {
        IdempotencyLayer {
            inject: ToolKeys,
            make: RandomKey,
            require: false,
            vouched: false,
        }
    }
}

impl<I, G> IdempotencyLayer<I, G> {
    /// Where and how the keys go (the header's name and format, for HTTP).
    pub fn injector(&self) -> &I {
        &self.inject
    }

    /// Replaces the last-resort generator ([`NoKey`] to never invent one).
    pub fn generator<G2>(self, make: G2) -> IdempotencyLayer<I, G2> {
        IdempotencyLayer {
            inject: self.inject,
            make,
            require: self.require,
            vouched: self.vouched,
        }
    }

    /// Refuses to send a request that needs a key when no source gives one (with [`NoKey`]:
    /// when neither the caller nor the runtime attached one), instead of sending it unprotected.
    /// The call fails with an [`InvalidConfig`] error and nothing is sent.
    #[must_use]
    pub fn require_key(mut self) -> Self {
        self.require = true;
        self
    }
}

impl<S, I: Clone, G: Clone> Layer<S> for IdempotencyLayer<I, G> {
    type Service = SetIdempotencyKey<S, I, G>;
    fn layer(&self, inner: S) -> Self::Service {
        SetIdempotencyKey {
            inner,
            keys: self.clone(),
        }
    }
}

/// See [`IdempotencyLayer`].
#[derive(Clone, Debug)]
pub struct SetIdempotencyKey<S, I, G> {
    inner: S,
    keys: IdempotencyLayer<I, G>,
}

impl<S, I, G> SetIdempotencyKey<S, I, G> {
    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }
    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, Req, I, G> Service<Req> for SetIdempotencyKey<S, I, G>
where
    S: Service<Req>,
    S::Error: Into<BoxError>,
    Req: HasExtensions,
    I: Inject<Req>,
    G: MakeKey<Req>,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = KeyFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, mut req: Req) -> Self::Future {
        match attach_key(&self.keys, &mut req) {
            Ok(()) => KeyFuture::inner(self.inner.call(req)),
            Err(refused) => KeyFuture::refused(refused),
        }
    }
}

/// Gives `req` the key `keys` says it needs (see [`IdempotencyLayer`] for the sources and their
/// order), or says why it must not be sent: what the layer's service does, and what the
/// facade's call hook does through `plumbing::attach`.
pub fn attach_key<Req, I, G>(
    keys: &IdempotencyLayer<I, G>,
    req: &mut Req,
) -> Result<(), InvalidConfig>
where
    Req: HasExtensions,
    I: Inject<Req>,
    G: MakeKey<Req>,
{
    let inject = &keys.inject;
    if !inject.needs_key(req) {
        return Ok(());
    }
    if inject.has_key(req) {
        req.extensions_mut().insert(ReplaySafe);
        return Ok(());
    }
    let ext = req.extensions();
    // A key the caller gave itself is its word that the dependency honours it.
    let mut vouched = keys.vouched;
    let key = match ext.get::<IdempotencyKey>() {
        Some(k) => {
            vouched = true;
            Some(k.clone())
        }
        None => match ext.get::<ActionContext>() {
            Some(action) => Some(action.key()),
            None if CallContext::of(req).is_some_and(CallContext::in_retry_scope) => {
                return Err(InvalidConfig::new(
                    "the idempotency layer must be placed outside the retry layer: inside it, \
                     each attempt would get a new key and a lost reply could be acted on twice",
                ));
            }
            None => keys.make.make_key(req),
        },
    };
    match key {
        Some(key) => {
            inject.inject(req, &key);
            let ext = req.extensions_mut();
            ext.insert(key);
            if vouched {
                ext.insert(ReplaySafe);
            } else {
                // Sent, but a lost reply is not repeated on its strength alone.
                ext.insert(UnvouchedKey);
            }
            Ok(())
        }
        None if keys.require => Err(InvalidConfig::new(
            "this tool call needs an idempotency key and none was given: attach an \
             ActionContext (run, step and call ids) or an IdempotencyKey to the request; \
             it was not sent",
        )),
        None => Ok(()),
    }
}

impl<I, G> IdempotencyLayer<I, G> {
    /// Declares that the dependency honours idempotency keys (it runs a keyed request once and
    /// answers repeats with the stored result), so a key this layer attaches makes an unknown
    /// outcome safe to repeat. Without it only a key the caller set itself does; a key derived
    /// or generated here is still sent.
    #[must_use]
    pub fn vouched(mut self, yes: bool) -> Self {
        self.vouched = yes;
        self
    }
}

/// Response future of [`SetIdempotencyKey`]: the inner future, or the refusal to send.
#[pin_project]
pub struct KeyFuture<F> {
    #[pin]
    state: KeyState<F>,
}

#[pin_project(project = KeyStateProj)]
enum KeyState<F> {
    /// The inner service's future.
    Inner(#[pin] F),
    /// The call was not sent: the layer is misplaced, or a required key is missing.
    Refused(Option<InvalidConfig>),
}

impl<F> KeyFuture<F> {
    fn inner(fut: F) -> Self {
        KeyFuture {
            state: KeyState::Inner(fut),
        }
    }

    fn refused(why: InvalidConfig) -> Self {
        KeyFuture {
            state: KeyState::Refused(Some(why)),
        }
    }
}

impl<F> fmt::Debug for KeyFuture<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.state {
            KeyState::Inner(_) => f.write_str("KeyFuture(sending)"),
            KeyState::Refused(e) => f.debug_tuple("KeyFuture").field(e).finish(),
        }
    }
}

impl<F, T, E> Future for KeyFuture<F>
where
    F: Future<Output = Result<T, E>>,
    E: Into<BoxError>,
{
    type Output = Result<T, BoxError>;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().state.project() {
            KeyStateProj::Inner(f) => f.poll(cx).map_err(Into::into),
            KeyStateProj::Refused(e) => Poll::Ready(Err(e
                .take()
                .expect("KeyFuture polled after completion")
                .into())),
        }
    }
}
