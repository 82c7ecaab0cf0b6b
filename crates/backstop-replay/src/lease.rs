//! What the running handler can know of its claim: the fencing token, and whether the lease is
//! still held.

use std::fmt;
use tokio::sync::watch;

/// The claim a handler runs under, in its request's extensions.
///
/// While the handler runs, the layer renews the claim's lease (every third of it). If the store
/// refuses a renewal (another request now owns the key, after this lease expired) or no renewal
/// succeeds for a whole lease (the store is unreachable), the lease is **lost**: from then on a
/// repeat of the request may run a second time. A handler about to commit an effect can check
/// [`is_held`](Lease::is_held) first, wait on [`lost`](Lease::lost) beside its work, or pass
/// the [`token`](Lease::token) to its system of record as a fencing token (a store that keeps
/// the highest token seen per key refuses a write from an older one).
///
/// ```
/// use backstop_replay::{Lease, ReplayRequestBody};
///
/// fn book_refund(req: &http::Request<ReplayRequestBody>) -> Result<(), &'static str> {
///     match req.extensions().get::<Lease>() {
///         Some(lease) if !lease.is_held() => Err("the claim was lost: do not commit"),
///         _ => Ok(()),
///     }
/// }
/// ```
#[derive(Clone)]
pub struct Lease {
    token: u64,
    held: watch::Receiver<bool>,
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("token", &self.token)
            .field("held", &self.is_held())
            .finish()
    }
}

impl Lease {
    /// A lease for the claim with `token`, and the sender that reports its loss.
    pub(crate) fn new(token: u64) -> (Lease, watch::Sender<bool>) {
        let (tx, held) = watch::channel(true);
        (Lease { token, held }, tx)
    }

    /// The claim's fencing token. The store refuses to complete a claim whose token is not the
    /// current one, and a newer claim of the same key always has a larger token on the stores
    /// Backstop ships (a sequence in memory and on PostgreSQL, the server's clock on Redis), so
    /// a handler's own database can refuse a write whose token is lower than the highest it
    /// has seen for the key: a stale owner past its lease then changes nothing there either.
    pub fn token(&self) -> u64 {
        self.token
    }

    /// Whether the lease is still held (renewed in time, not taken over).
    pub fn is_held(&self) -> bool {
        *self.held.borrow()
    }

    /// Resolves when the lease is lost (at once if it already is). Never resolves while it is
    /// held; if the layer stops renewing because the request completed, it stays pending.
    pub async fn lost(&mut self) {
        // `wait_for` ends with an error only when the sender is gone, which happens once the
        // claim is completed or released: then the lease was not lost.
        if self.held.wait_for(|held| !held).await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}
