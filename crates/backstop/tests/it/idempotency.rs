//! The key layer: once per logical call, never overwritten, from the right source.

use backstop_backoff::{Backoff, RngSource};
use backstop_core::{AttemptTimedOut, BoxError, HasExtensions, ReplaySafe};
use backstop_idempotency::{
    ActionContext, IdempotencyKey, IdempotencyLayer, KeyFormat, KeyedRequest, NoKey,
};
use backstop_retry::RetryLayer;
use http::{Request, Response};
use std::{
    sync::{Arc, Mutex},
    time::Duration,
};
use tower::{Layer, Service, ServiceBuilder, ServiceExt, service_fn};

type Keys = Arc<Mutex<Vec<Option<String>>>>;

/// Records the key of every attempt; loses the reply to the first two.
fn recording(
    keys: Keys,
) -> impl Service<Request<String>, Response = Response<()>, Error = BoxError, Future: Send> + Clone
{
    service_fn(move |req: Request<String>| {
        let mut k = keys.lock().unwrap();
        k.push(
            req.headers()
                .get("idempotency-key")
                .map(|v| v.to_str().unwrap().to_owned()),
        );
        let n = k.len();
        async move {
            if n <= 2 {
                Err(Box::new(AttemptTimedOut::new(None, Duration::from_secs(1))) as BoxError)
            } else {
                Ok(Response::new(()))
            }
        }
    })
}

fn retry() -> RetryLayer<
    backstop_classify::HttpClassifier,
    backstop_retry::HttpResend,
    backstop_core::Dependency,
> {
    RetryLayer::http()
        .dependency("idempotency-payments-api")
        .backoff(Backoff::constant(Duration::from_millis(10)))
        .rng(RngSource::seeded(1))
}

#[tokio::test(start_paused = true)]
async fn every_attempt_carries_the_one_key_made_before_the_retry_loop() {
    // A key the layer generates, for a dependency nobody vouched for: sent, but the POST whose
    // reply was lost is not repeated on its strength.
    let keys = Keys::default();
    let svc = ServiceBuilder::new()
        .layer(IdempotencyLayer::http())
        .layer(retry())
        .service(recording(keys.clone()));
    let lost = svc
        .oneshot(
            Request::post("http://pay/refunds")
                .body(String::new())
                .unwrap(),
        )
        .await
        .unwrap_err();
    assert_eq!(keys.lock().unwrap().len(), 1, "{lost}");
    assert!(keys.lock().unwrap()[0].is_some(), "the key is still sent");

    // Declared key-honouring: the one key makes the lost reply safe to repeat.
    let keys = Keys::default();
    let svc = ServiceBuilder::new()
        .layer(IdempotencyLayer::http().vouched(true))
        .layer(retry())
        .service(recording(keys.clone()));
    svc.oneshot(
        Request::post("http://pay/refunds")
            .body(String::new())
            .unwrap(),
    )
    .await
    .unwrap();
    let keys = keys.lock().unwrap();
    assert_eq!(keys.len(), 3, "a keyed POST is retried after lost replies");
    let first = keys[0].clone().expect("a key was injected");
    assert_eq!(first.len(), 32);
    assert!(
        keys.iter().all(|k| k.as_deref() == Some(first.as_str())),
        "{keys:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn inside_the_retry_layer_a_generated_key_is_refused() {
    let keys = Keys::default();
    let svc = ServiceBuilder::new()
        .layer(retry())
        .layer(IdempotencyLayer::http())
        .service(recording(keys.clone()));
    let err = svc
        .oneshot(
            Request::post("http://pay/refunds")
                .body(String::new())
                .unwrap(),
        )
        .await
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("must be placed outside the retry layer"),
        "{err}"
    );
    assert!(keys.lock().unwrap().is_empty(), "nothing was sent");
}

#[tokio::test(start_paused = true)]
async fn inside_the_retry_layer_a_derived_key_is_still_the_same_on_every_attempt() {
    let keys = Keys::default();
    let svc = ServiceBuilder::new()
        .layer(retry())
        .layer(IdempotencyLayer::http())
        .service(recording(keys.clone()));
    let mut req = Request::post("http://pay/refunds")
        .body(String::new())
        .unwrap();
    req.extensions_mut()
        .insert(ActionContext::tool_call("run-91f2", "step-3", "call-07"));
    req.extensions_mut().insert(ReplaySafe); // the runtime knows the key is stable
    svc.oneshot(req).await.unwrap();
    let want = ActionContext::tool_call("run-91f2", "step-3", "call-07")
        .key()
        .to_string();
    assert_eq!(*keys.lock().unwrap(), vec![Some(want); 3]);
}

async fn key_sent(
    layer: IdempotencyLayer<
        backstop_idempotency::HttpKeys,
        impl backstop_idempotency::MakeKey<Request<String>> + Clone,
    >,
    req: Request<String>,
) -> Option<String> {
    let keys = Keys::default();
    let k = keys.clone();
    let svc = layer.layer(service_fn(move |req: Request<String>| {
        k.lock().unwrap().push(
            req.headers()
                .get("idempotency-key")
                .map(|v| v.to_str().unwrap().to_owned()),
        );
        async { Ok::<_, BoxError>(Response::new(())) }
    }));
    svc.oneshot(req).await.unwrap();
    keys.lock().unwrap()[0].clone()
}

#[tokio::test]
async fn sources_in_order() {
    let post = || {
        Request::post("http://pay/refunds")
            .body(String::new())
            .unwrap()
    };

    // 1. A key already on the request is never overwritten.
    let mut req = post();
    req.headers_mut()
        .insert("idempotency-key", "caller-chose-this".parse().unwrap());
    req.extensions_mut()
        .insert(IdempotencyKey::new("from-extensions").unwrap());
    assert_eq!(
        key_sent(IdempotencyLayer::http(), req).await.as_deref(),
        Some("caller-chose-this")
    );

    // 2. A key in the extensions.
    let mut req = post();
    req.extensions_mut()
        .insert(IdempotencyKey::new("from-extensions").unwrap());
    req.extensions_mut()
        .insert(ActionContext::tool_call("r", "s", "c"));
    assert_eq!(
        key_sent(IdempotencyLayer::http(), req).await.as_deref(),
        Some("from-extensions")
    );

    // 3. Derived from the action context.
    let mut req = post();
    req.extensions_mut()
        .insert(ActionContext::tool_call("run-91f2", "step-3", "call-07"));
    assert_eq!(
        key_sent(IdempotencyLayer::http(), req).await.as_deref(),
        Some("62c365e88817e25626ebbb4f2483d275b4594ce9369da9139952f99edd3dcfa8")
    );

    // 4. The generator; with NoKey, none.
    assert_eq!(
        key_sent(IdempotencyLayer::http(), post())
            .await
            .map(|k| k.len()),
        Some(32)
    );
    assert_eq!(
        key_sent(IdempotencyLayer::http().generator(NoKey), post()).await,
        None
    );

    // Idempotent methods need no key.
    let get = Request::get("http://pay/refunds/1")
        .body(String::new())
        .unwrap();
    assert_eq!(key_sent(IdempotencyLayer::http(), get).await, None);

    // Structured-field format.
    let mut req = post();
    req.extensions_mut()
        .insert(IdempotencyKey::new("k1").unwrap());
    let layer = IdempotencyLayer::http().format(KeyFormat::StructuredField);
    assert_eq!(key_sent(layer, req).await.as_deref(), Some("\"k1\""));
}

#[derive(Clone, Debug)]
struct ToolCall {
    tool: &'static str,
    key: Option<IdempotencyKey>,
    extensions: http::Extensions,
}

impl KeyedRequest for ToolCall {
    fn needs_key(&self) -> bool {
        !self.tool.starts_with("get_")
    }
    fn idempotency_key(&self) -> Option<&IdempotencyKey> {
        self.key.as_ref()
    }
    fn set_idempotency_key(&mut self, key: IdempotencyKey) {
        self.key = Some(key);
    }
}

impl HasExtensions for ToolCall {
    fn extensions(&self) -> &http::Extensions {
        &self.extensions
    }
    fn extensions_mut(&mut self) -> &mut http::Extensions {
        &mut self.extensions
    }
}

/// The key a tool call arrived with, and whether it was marked replay-safe.
type Seen = (Option<IdempotencyKey>, bool);

#[tokio::test]
async fn non_http_tool_calls_carry_their_key_and_are_marked_replay_safe() {
    let seen: Arc<Mutex<Vec<Seen>>> = Arc::default();
    let s = seen.clone();
    let svc = IdempotencyLayer::tool_calls()
        .generator(NoKey)
        .vouched(true)
        .layer(service_fn(move |call: ToolCall| {
            s.lock()
                .unwrap()
                .push((call.key.clone(), ReplaySafe::is_marked(&call)));
            async { Ok::<_, BoxError>(()) }
        }));
    let mut write = ToolCall {
        tool: "issue_refund",
        key: None,
        extensions: http::Extensions::new(),
    };
    write
        .extensions
        .insert(ActionContext::tool_call("run-1", "step-1", "call-1"));
    svc.clone().oneshot(write).await.unwrap();
    let read = ToolCall {
        tool: "get_order",
        key: None,
        extensions: http::Extensions::new(),
    };
    svc.oneshot(read).await.unwrap();
    let seen = seen.lock().unwrap();
    assert_eq!(
        seen[0],
        (
            Some(ActionContext::tool_call("run-1", "step-1", "call-1").key()),
            true
        )
    );
    assert_eq!(seen[1], (None, false));
}

#[tokio::test]
async fn a_required_key_that_nobody_gave_stops_the_call() {
    let sent = Arc::new(Mutex::new(0));
    let s = sent.clone();
    let svc = IdempotencyLayer::http()
        .generator(NoKey)
        .require_key()
        .layer(service_fn(move |_req: Request<String>| {
            *s.lock().unwrap() += 1;
            async { Ok::<_, BoxError>(Response::new(())) }
        }));
    let err = svc
        .clone()
        .oneshot(
            Request::post("http://pay/refunds")
                .body(String::new())
                .unwrap(),
        )
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("needs an idempotency key"),
        "{err}"
    );
    assert_eq!(*sent.lock().unwrap(), 0);
    let mut ok = Request::post("http://pay/refunds")
        .body(String::new())
        .unwrap();
    ok.extensions_mut()
        .insert(ActionContext::tool_call("r", "s", "c"));
    svc.oneshot(ok).await.unwrap();
    assert_eq!(*sent.lock().unwrap(), 1);
}
