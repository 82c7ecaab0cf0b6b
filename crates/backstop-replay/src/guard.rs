//! The guard that holds a claim while its handler runs, and settles it: the result stored,
//! the key released, or, dropped before either, the outcome recorded as unknown.

use crate::{config::Config, problem::unknown_record, store::StoredResponse};
use backstop_core::plumbing::HumanDuration;
use std::{sync::Arc, time::Duration};
use tokio::sync::watch;

/// What a guard dropped before its claim was settled does.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum OnDrop {
    /// The handler started and may have acted: record the outcome as unknown.
    RecordUnknown,
    /// Nothing can have happened (its transaction rolled back): free the key.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    Release,
}

/// Holds a claim while its handler runs (the lease is renewed beside it, by
/// `claim::renew_while_running`): stores the result (retrying while the lease holds), and, if it is
/// dropped before that (the handler panicked, or the runtime stopped its task), records the
/// outcome as unknown.
pub(crate) struct ClaimGuard {
    cfg: Arc<Config>,
    key: String,
    token: u64,
    held: Arc<watch::Sender<bool>>,
    armed: bool,
    pub(crate) on_drop: OnDrop,
}

impl ClaimGuard {
    pub(crate) fn new(
        cfg: Arc<Config>,
        key: String,
        token: u64,
        held: Arc<watch::Sender<bool>>,
    ) -> Self {
        ClaimGuard {
            cfg,
            key,
            token,
            held,
            armed: true,
            on_drop: OnDrop::RecordUnknown,
        }
    }

    /// The key the claim holds.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) fn key(&self) -> &str {
        &self.key
    }

    /// The claim's fencing token.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) fn token(&self) -> u64 {
        self.token
    }

    /// The claim was settled elsewhere (in the handler's transaction).
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) fn done(mut self) {
        self.disarm();
    }

    fn disarm(&mut self) {
        self.armed = false;
    }

    /// Stores the result. A store that fails for a moment is tried again, with the lease still
    /// renewed (repeats meanwhile get 409), for as long as the lease is held.
    pub(crate) async fn complete(mut self, stored: &StoredResponse) {
        let mut wait = Duration::from_millis(20);
        loop {
            match self
                .cfg
                .store
                .complete(&self.key, self.token, stored, self.cfg.ttl)
                .await
            {
                Ok(true) => break,
                Ok(false) => {
                    tracing::error!(
                        target: "backstop::replay",
                        "the claim expired before the handler finished (lease {}); a newer request owns the key and this result was not stored",
                        HumanDuration(self.cfg.lease)
                    );
                    break;
                }
                Err(e) if *self.held.borrow() => {
                    tracing::warn!(target: "backstop::replay", error = %backstop_core::plumbing::CauseChain(&e), "could not store a result; trying again while the claim is held");
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(self.cfg.lease / 3);
                }
                Err(e) => {
                    tracing::error!(target: "backstop::replay", error = %backstop_core::plumbing::CauseChain(&e), "could not store a result before the claim was lost; a repeat may run the handler again");
                    break;
                }
            }
        }
        self.disarm();
    }

    /// Gives the claim back: the handler refused the request before acting.
    pub(crate) async fn release(mut self) {
        self.disarm();
        if let Err(e) = self.cfg.store.release(&self.key, self.token).await {
            tracing::warn!(target: "backstop::replay", error = %backstop_core::plumbing::CauseChain(&e), "could not release a claim; it will expire with its lease");
        }
    }
}

impl Drop for ClaimGuard {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        self.disarm();
        // The handler started and ended without a response (it panicked, or its task was
        // stopped): record that its outcome is unknown, rather than free the key for a second
        // run. If the runtime is shutting down this cannot run, and the lease expires instead.
        if let Ok(h) = tokio::runtime::Handle::try_current() {
            let (store, key, token, ttl, on_drop) = (
                self.cfg.store.clone(),
                std::mem::take(&mut self.key),
                self.token,
                self.cfg.ttl,
                self.on_drop,
            );
            h.spawn(async move {
                let _ = match on_drop {
                    OnDrop::RecordUnknown => {
                        store.complete(&key, token, &unknown_record(), ttl).await
                    }
                    OnDrop::Release => store.release(&key, token).await,
                };
            });
        }
    }
}
