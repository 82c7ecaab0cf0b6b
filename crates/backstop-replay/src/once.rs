//! The claim, the run and the settling of one guarded action, apart from any protocol: what
//! the HTTP layer (`serve.rs`) and [`ReplayLayer::once`] (for tool calls, messages, anything
//! that is not an HTTP request) both stand on.

use crate::{
    ReplayLayer,
    claim::renewing,
    config::{Config, SINGLE_TENANT},
    guard::ClaimGuard,
    key::{Identity, payload_fingerprint, store_key},
    lease::Lease,
    problem::{count, is_unknown_record, unknown_record},
    store::{Claim, Fingerprint, StoreError, StoredResponse},
};
use backstop_core::Deadline;
use backstop_idempotency::IdempotencyKey;
use std::{future::Future, sync::Arc};
use tracing::Instrument;

/// An action guarded by a replay layer that is not an HTTP request (a tool call, a message):
/// what identifies it, what it does, and whom it acts for. See [`ReplayLayer::once`].
#[derive(Clone, Debug)]
pub struct Action {
    identity: Identity,
    fingerprint: Fingerprint,
    principal: Option<String>,
}

impl Action {
    /// The action `key` names, doing `payload` (its canonical bytes: a repeat with the same key
    /// and another payload is refused, [`Once::KeyReused`]).
    pub fn keyed(key: IdempotencyKey, payload: &[u8]) -> Action {
        Action {
            identity: Identity::Key(key),
            fingerprint: payload_fingerprint(payload),
            principal: None,
        }
    }

    /// The action a business identity names ("refund of order 4812"): the same action whatever
    /// its key or payload.
    pub fn business(id: impl Into<String>, payload: &[u8]) -> Action {
        Action {
            identity: Identity::Business(id.into()),
            fingerprint: payload_fingerprint(payload),
            principal: None,
        }
    }

    /// Acting for `principal`, the authenticated tenant its stored result is scoped to. Without
    /// one, only a [single-tenant](ReplayLayer::single_tenant) layer runs it.
    #[must_use]
    pub fn for_principal(mut self, principal: impl Into<String>) -> Action {
        self.principal = Some(principal.into());
        self
    }
}

/// How a run's result settles its key ([`ReplayLayer::once`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Settle {
    /// The result, stored and replayed to every repeat (its body omitted when larger than the
    /// layer's `max_stored_body`).
    Store(StoredResponse),
    /// Nothing happened (the work refused before acting): the key is free for a later try.
    Release,
    /// The work ended without a result it can vouch for: recorded as unknown, never run again.
    Unknown,
}

/// What [`ReplayLayer::once`] did.
#[derive(Debug)]
#[non_exhaustive]
pub enum Once<T> {
    /// This call ran the work: its output.
    Ran(T),
    /// A run of the same action completed: its stored result, to answer with.
    Replayed(StoredResponse),
    /// A run of the same action ended without a result (or this one's work panicked): it may
    /// or may not have taken effect, and it is not run again.
    Unknown,
    /// A run of the same action is still in progress: its result comes once it is stored.
    InFlight,
    /// The key was used for another action (another payload): nothing ran.
    KeyReused,
    /// The store could not be reached: nothing ran, since nothing could protect it.
    Unavailable(StoreError),
    /// No principal, and the layer is not single-tenant: refused, since its stored result could
    /// reach another tenant.
    PrincipalMissing,
}

/// What claiming a key found, when it was not claimed for this request (counted when the
/// caller answers: a reused key and a store unavailable by the answer's own count).
pub(crate) enum Found {
    /// A run completed: its stored result (which may record an unknown outcome).
    Done(StoredResponse),
    InFlight,
    KeyReused,
    /// The store failed, and the layer refuses rather than run unprotected.
    Unavailable(StoreError),
    /// The store failed, and the layer runs the request unprotected (`fail_open`).
    Unprotected,
}

/// Claims `key` for an action with `fingerprint`: its fencing token, or what was found.
pub(crate) async fn claim(
    cfg: &Config,
    key: &str,
    fingerprint: Fingerprint,
    is_business: bool,
) -> Result<u64, Found> {
    let same = |other: Fingerprint| other == fingerprint || is_business;
    match cfg.store.claim(key, fingerprint, cfg.lease).await {
        Ok(Claim::Claimed { token }) => Ok(token),
        Ok(Claim::Done {
            fingerprint,
            response,
        }) => {
            if !same(fingerprint) {
                return Err(Found::KeyReused);
            }
            count("replayed");
            Err(Found::Done(response))
        }
        Ok(Claim::InFlight { fingerprint }) => {
            if !same(fingerprint) {
                return Err(Found::KeyReused);
            }
            count("in_flight");
            Err(Found::InFlight)
        }
        Err(e) if cfg.fail_open => {
            tracing::warn!(target: "backstop::replay", error = %backstop_core::plumbing::CauseChain(&e), "store unavailable; running the request without deduplication (fail_open)");
            Err(Found::Unprotected)
        }
        Err(e) => {
            tracing::warn!(target: "backstop::replay", error = %backstop_core::plumbing::CauseChain(&e), "store unavailable; refusing the request");
            Err(Found::Unavailable(e))
        }
    }
}

/// The work of a claimed action panicked (or its task was stopped): its guard settled the key.
pub(crate) struct Panicked;

/// Runs the work of a claimed action in a task of its own, decoupled from the caller's future:
/// a caller that gives up (and drops it) can stop neither work that has started nor the
/// claim. The lease is renewed beside the work until it settles the claim through its guard;
/// the task continues the caller's span and inherits `deadline`.
pub(crate) async fn run_detached<T, W, Fut>(
    cfg: Arc<Config>,
    key: String,
    token: u64,
    deadline: Option<Deadline>,
    work: W,
) -> Result<T, Panicked>
where
    W: FnOnce(Lease, ClaimGuard) -> Fut + Send + 'static,
    Fut: Future<Output = T> + Send,
    T: Send + 'static,
{
    let (lease, held) = Lease::new(token);
    let claimed = async move {
        // The guard is made in the task: a task that never started settles nothing.
        let held = Arc::new(held);
        let guard = ClaimGuard::new(cfg.clone(), key.clone(), token, held.clone());
        renewing(cfg, key, token, held, deadline, || work(lease, guard)).await
    };
    tokio::spawn(claimed.in_current_span())
        .await
        .map_err(|_| Panicked)
}

impl ReplayLayer {
    /// Runs `work` at most once for `action`, with this layer's store, lease, TTL and
    /// policies, as the layer runs a keyed HTTP request: for a tool call, a message, anything
    /// that is not one. The first call claims the action and runs `work` in a task of its own
    /// (a caller that gives up stops neither the work nor the claim), with the claim's
    /// [`Lease`] renewed beside it; the [`Settle`] it returns stores its result, frees the key,
    /// or records the outcome as unknown, as does work that panics. Every other call is told
    /// what was found: the stored result, a run in flight, a key used for another action, a
    /// store that cannot be reached. The work gets no lease when the store failed and the layer
    /// is [`fail_open`](ReplayLayer::fail_open): it then runs unprotected.
    ///
    /// ```
    /// use backstop_idempotency::IdempotencyKey;
    /// use backstop_replay::{Action, MemoryStore, Once, ReplayLayer, Settle, StoredResponse};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let replay = ReplayLayer::new(MemoryStore::default()).single_tenant();
    /// let refund = || Action::keyed(IdempotencyKey::new("refund-4812").unwrap(), b"eur=40");
    /// let book = |_lease| async {
    ///     let receipt = StoredResponse { status: 200, headers: vec![], body: "R1".into(), body_omitted: None };
    ///     (Settle::Store(receipt), "R1 booked")
    /// };
    /// assert!(matches!(replay.once(refund(), book).await, Once::Ran("R1 booked")));
    /// // The reply was lost and the caller asks again: the stored result, nothing booked twice.
    /// let Once::Replayed(stored) = replay.once(refund(), book).await else { panic!() };
    /// assert_eq!(stored.body, "R1");
    /// # }
    /// ```
    pub async fn once<T, W, Fut>(&self, action: Action, work: W) -> Once<T>
    where
        W: FnOnce(Option<Lease>) -> Fut + Send + 'static,
        Fut: Future<Output = (Settle, T)> + Send + 'static,
        T: Send + 'static,
    {
        let cfg = self.cfg();
        let principal = match action.principal {
            Some(p) => p,
            None if cfg.single_tenant => SINGLE_TENANT.to_owned(),
            None => {
                count("no_principal");
                return Once::PrincipalMissing;
            }
        };
        let key = store_key(&principal, &action.identity);
        let is_business = matches!(action.identity, Identity::Business(_));
        let token = match claim(cfg, &key, action.fingerprint, is_business).await {
            Ok(token) => token,
            Err(Found::Done(stored)) if is_unknown_record(&stored) => return Once::Unknown,
            Err(Found::Done(stored)) => return Once::Replayed(stored),
            Err(Found::InFlight) => return Once::InFlight,
            Err(Found::KeyReused) => {
                count("mismatch");
                return Once::KeyReused;
            }
            Err(Found::Unavailable(e)) => {
                count("store_unavailable");
                return Once::Unavailable(e);
            }
            Err(Found::Unprotected) => return Once::Ran(work(None).await.1),
        };
        let max_stored = cfg.max_stored_body;
        let ran = run_detached(
            cfg.clone(),
            key,
            token,
            Deadline::current(),
            move |lease, guard| async move {
                let (settle, out) = work(Some(lease)).await;
                match settle {
                    Settle::Store(mut stored) => {
                        if stored.body.len() > max_stored {
                            stored.body_omitted = Some(stored.body.len() as u64);
                            stored.body = Default::default();
                        }
                        guard.complete(&stored).await;
                    }
                    Settle::Release => guard.release().await,
                    Settle::Unknown => guard.complete(&unknown_record()).await,
                }
                out
            },
        )
        .await;
        ran.map_or(Once::Unknown, Once::Ran)
    }
}
