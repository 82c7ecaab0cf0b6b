use backstop_core::BoxError;
use bytes::Bytes;
use http::{HeaderName, HeaderValue};
use std::{error::Error, fmt, future::Future, pin::Pin, sync::Arc, time::Duration};

/// The SHA-256 fingerprint of a request: method, path and query, and a digest of the body.
pub type Fingerprint = [u8; 32];

/// A boxed future returned by a [`ReplayStore`].
pub type StoreFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, StoreError>> + Send + 'a>>;

/// A response as stored for replay.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredResponse {
    /// The status code.
    pub status: u16,
    /// The allow-listed headers (never `Set-Cookie` or `Date`).
    pub headers: Vec<(HeaderName, HeaderValue)>,
    /// The body, when it fitted the limit.
    pub body: Bytes,
    /// When the body was not stored (too large, or it failed while being read): the number of
    /// bytes read before giving up.
    pub body_omitted: Option<u64>,
}

/// What claiming a key found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Claim {
    /// The key was free and is now held by this request; `token` fences out stale owners.
    Claimed {
        /// The fencing token: only its holder may complete or release the claim.
        token: u64,
    },
    /// Another request holds the key and is still running.
    InFlight {
        /// That request's fingerprint.
        fingerprint: Fingerprint,
    },
    /// A request with this key completed; its response is stored.
    Done {
        /// That request's fingerprint.
        fingerprint: Fingerprint,
        /// Its response.
        response: StoredResponse,
    },
}

/// The store could not answer (unreachable, full, or returned something unreadable). The
/// database's own error, when there is one, is the `source()`.
#[derive(Clone, Debug)]
pub struct StoreError {
    message: String,
    source: Option<Arc<dyn Error + Send + Sync>>,
}

impl StoreError {
    /// An error with a message.
    pub fn new(message: impl Into<String>) -> Self {
        StoreError {
            message: message.into(),
            source: None,
        }
    }

    /// An error with a message, caused by `source` (the database client's error).
    pub fn with_source(message: impl Into<String>, source: impl Into<BoxError>) -> Self {
        StoreError {
            message: message.into(),
            source: Some(Arc::from(source.into())),
        }
    }
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl Error for StoreError {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        self.source.as_deref().map(|e| e as &(dyn Error + 'static))
    }
}

/// The scope of a store key: the digest of its principal. Keys are `<scope>:<digest>`, so a
/// store can bound (and evict) each principal's entries apart from the others'.
pub fn scope_of(key: &str) -> &str {
    key.split_once(':').map_or("", |(scope, _)| scope)
}

/// Where processed keys and their results live.
///
/// Keys are `<scope>:<digest>` ([`scope_of`]): the scope stands for the principal, the digest
/// for the principal and the key (neither is in clear).
///
/// Every operation on a claim carries its fencing token; a store must refuse to renew,
/// complete or release a claim whose token is not the current one, so that a request whose
/// lease expired can never overwrite the result of a newer one.
pub trait ReplayStore: Send + Sync + fmt::Debug + 'static {
    /// Claims `key` for a request with `fingerprint` for `lease`, atomically: exactly one of any
    /// number of concurrent claims of a free key succeeds.
    fn claim<'a>(
        &'a self,
        key: &'a str,
        fingerprint: Fingerprint,
        lease: Duration,
    ) -> StoreFuture<'a, Claim>;

    /// Extends a claim's lease; `false` when the claim is no longer this token's.
    fn renew<'a>(&'a self, key: &'a str, token: u64, lease: Duration) -> StoreFuture<'a, bool>;

    /// Stores the response of a claimed request for `ttl`; `false` when the claim is no longer
    /// this token's (nothing is written).
    fn complete<'a>(
        &'a self,
        key: &'a str,
        token: u64,
        response: &'a StoredResponse,
        ttl: Duration,
    ) -> StoreFuture<'a, bool>;

    /// Gives a claim up without a result; `false` when it was no longer this token's.
    fn release<'a>(&'a self, key: &'a str, token: u64) -> StoreFuture<'a, bool>;
}

const FORMAT: u8 = 1;

/// Encodes a response for stores that keep bytes (the Redis store): a version byte, the status,
/// the headers as length-prefixed names and values, the omitted-body marker, then the body.
pub fn encode(r: &StoredResponse) -> Vec<u8> {
    let mut out = Vec::with_capacity(16 + r.body.len());
    out.push(FORMAT);
    out.extend_from_slice(&r.status.to_be_bytes());
    out.extend_from_slice(
        &u16::try_from(r.headers.len())
            .unwrap_or(u16::MAX)
            .to_be_bytes(),
    );
    for (name, value) in r.headers.iter().take(usize::from(u16::MAX)) {
        let n = name.as_str().as_bytes();
        out.extend_from_slice(&u16::try_from(n.len()).unwrap_or(u16::MAX).to_be_bytes());
        out.extend_from_slice(n);
        let v = value.as_bytes();
        out.extend_from_slice(&u32::try_from(v.len()).unwrap_or(u32::MAX).to_be_bytes());
        out.extend_from_slice(v);
    }
    match r.body_omitted {
        Some(n) => {
            out.push(1);
            out.extend_from_slice(&n.to_be_bytes());
        }
        None => out.push(0),
    }
    out.extend_from_slice(&r.body);
    out
}

/// Decodes what [`encode`] wrote; malformed input is an error, never a panic.
pub fn decode(bytes: &[u8]) -> Result<StoredResponse, StoreError> {
    let bad = || StoreError::new("a stored response is malformed");
    let mut rest = bytes;
    let mut take = |n: usize| -> Result<&[u8], StoreError> {
        if rest.len() < n {
            return Err(bad());
        }
        let (head, tail) = rest.split_at(n);
        rest = tail;
        Ok(head)
    };
    if take(1)?[0] != FORMAT {
        return Err(StoreError::new(
            "a stored response has an unknown format version",
        ));
    }
    let status = u16::from_be_bytes(take(2)?.try_into().map_err(|_| bad())?);
    let count = u16::from_be_bytes(take(2)?.try_into().map_err(|_| bad())?);
    let mut headers = Vec::with_capacity(usize::from(count).min(64));
    for _ in 0..count {
        let n = u16::from_be_bytes(take(2)?.try_into().map_err(|_| bad())?);
        let name = HeaderName::from_bytes(take(usize::from(n))?).map_err(|_| bad())?;
        let v = u32::from_be_bytes(take(4)?.try_into().map_err(|_| bad())?);
        let value = HeaderValue::from_bytes(take(v as usize)?).map_err(|_| bad())?;
        headers.push((name, value));
    }
    let body_omitted = match take(1)?[0] {
        0 => None,
        1 => Some(u64::from_be_bytes(take(8)?.try_into().map_err(|_| bad())?)),
        _ => return Err(bad()),
    };
    if !(100..=999).contains(&status) {
        return Err(bad());
    }
    Ok(StoredResponse {
        status,
        headers,
        body: Bytes::copy_from_slice(rest),
        body_omitted,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_garbage() {
        let r = StoredResponse {
            status: 201,
            headers: vec![
                (
                    HeaderName::from_static("content-type"),
                    HeaderValue::from_static("application/json"),
                ),
                (
                    HeaderName::from_static("location"),
                    HeaderValue::from_static("/refunds/R1"),
                ),
            ],
            body: Bytes::from_static(br#"{"refund_id":"R1"}"#),
            body_omitted: None,
        };
        assert_eq!(decode(&encode(&r)).unwrap(), r);
        let omitted = StoredResponse {
            body: Bytes::new(),
            body_omitted: Some(5_000_000),
            ..r.clone()
        };
        assert_eq!(decode(&encode(&omitted)).unwrap(), omitted);
        let full = encode(&r);
        for cut in 0..full.len() - r.body.len() {
            assert!(decode(&full[..cut]).is_err(), "cut at {cut}");
        }
        assert!(decode(&[9, 0, 200, 0, 0, 0]).is_err());
    }
}
