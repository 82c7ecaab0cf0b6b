//! What a stored result is filed under: the key header read, the store key (scoped by
//! principal, hashed), and the request's fingerprint.

use crate::store::Fingerprint;
use backstop_idempotency::IdempotencyKey;
use bytes::Bytes;
use http::{HeaderName, request::Parts};
use sha2::{Digest, Sha256};

fn field(h: &mut Sha256, bytes: &[u8]) {
    h.update(u32::try_from(bytes.len()).unwrap_or(u32::MAX).to_be_bytes());
    h.update(bytes);
}

/// Where the key of a stored result comes from.
#[derive(Clone, Debug)]
pub(crate) enum Identity {
    Key(IdempotencyKey),
    Business(String),
}

/// The store key, `<scope>:<digest>`: the scope stands for the principal alone (16 hex digits,
/// so a store can bound each principal's entries; a 64-bit FNV-1a of it, which hides nothing
/// that a SHA-256 of a guessable name would), the digest is a SHA-256 of the principal and the
/// identity. Keys and principals are never stored in clear.
pub(crate) fn store_key(principal: &str, id: &Identity) -> String {
    let mut scope: u64 = 0xcbf2_9ce4_8422_2325;
    for b in b"backstop-replay-scope/v2\0"
        .iter()
        .chain(principal.as_bytes())
    {
        scope = (scope ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    let mut h = Sha256::new();
    h.update(b"backstop-replay-key/v2\0");
    field(&mut h, principal.as_bytes());
    match id {
        Identity::Key(k) => {
            field(&mut h, b"key");
            field(&mut h, k.as_str().as_bytes());
        }
        Identity::Business(b) => {
            field(&mut h, b"business");
            field(&mut h, b.as_bytes());
        }
    }
    let mut out = [0u8; 16 + 1 + 64];
    hex::encode_to_slice(scope.to_be_bytes(), &mut out[..16]).expect("16 hex digits");
    out[16] = b':';
    hex::encode_to_slice(h.finalize(), &mut out[17..]).expect("64 hex digits");
    String::from_utf8(out.to_vec()).expect("hex is ASCII")
}

/// The request's fingerprint: method, path and query, and body, in one pass over the body.
pub(crate) fn fingerprint(parts: &Parts, body: &Bytes) -> Fingerprint {
    let mut h = Sha256::new();
    h.update(b"backstop-replay-fingerprint/v2\0");
    field(&mut h, parts.method.as_str().as_bytes());
    field(
        &mut h,
        parts
            .uri
            .path_and_query()
            .map_or("/", |p| p.as_str())
            .as_bytes(),
    );
    field(&mut h, body);
    h.finalize().into()
}

/// The fingerprint of an action that is not an HTTP request: its payload's canonical bytes.
pub(crate) fn payload_fingerprint(payload: &[u8]) -> Fingerprint {
    let mut h = Sha256::new();
    h.update(b"backstop-replay-action/v1\0");
    field(&mut h, payload);
    h.finalize().into()
}

/// Reads the key header: exactly one line, a valid key (bare or as a structured-field string).
pub(crate) fn read_key(parts: &Parts, name: &HeaderName) -> Result<Option<IdempotencyKey>, String> {
    let mut values = parts.headers.get_all(name).iter();
    let Some(v) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(format!(
            "the request has more than one {name} header; send exactly one"
        ));
    }
    IdempotencyKey::from_header(v)
        .map(Some)
        .map_err(|why| format!("the {name} header is invalid: {why}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::Request;

    fn parts(headers: &[(&str, &str)]) -> Parts {
        let mut b = Request::post("/refunds");
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(()).unwrap().into_parts().0
    }

    #[test]
    fn key_header_rules() {
        let h = HeaderName::from_static("idempotency-key");
        assert_eq!(read_key(&parts(&[]), &h), Ok(None));
        assert_eq!(
            read_key(&parts(&[("idempotency-key", "abc")]), &h),
            Ok(Some(IdempotencyKey::new("abc").unwrap()))
        );
        assert_eq!(
            read_key(&parts(&[("idempotency-key", "\"abc\"")]), &h),
            Ok(Some(IdempotencyKey::new("abc").unwrap()))
        );
        for bad in ["\"abc", "a b", "\"\"", "a\"b"] {
            assert!(
                read_key(&parts(&[("idempotency-key", bad)]), &h).is_err(),
                "{bad}"
            );
        }
        let long = "k".repeat(256);
        assert!(read_key(&parts(&[("idempotency-key", &long)]), &h).is_err());
        let two = parts(&[("idempotency-key", "a"), ("idempotency-key", "a")]);
        assert!(read_key(&two, &h).unwrap_err().contains("more than one"));
    }

    #[test]
    fn store_keys_are_scoped_hashed_and_distinct() {
        let k = || Identity::Key(IdempotencyKey::new("k").unwrap());
        let a = store_key("tenant-a", &k());
        let b = store_key("tenant-b", &k());
        let c = store_key("tenant-a", &Identity::Business("k".into()));
        assert_ne!(a, b);
        assert_ne!(a, c);
        assert_eq!(a.len(), 16 + 1 + 64);
        let (scope, digest) = a.split_once(':').unwrap();
        assert_eq!(crate::store::scope_of(&a), scope);
        assert_eq!(
            scope,
            crate::store::scope_of(&c),
            "one principal, one scope"
        );
        assert_ne!(scope, crate::store::scope_of(&b));
        assert!(
            (scope.to_owned() + digest)
                .chars()
                .all(|ch| ch.is_ascii_hexdigit()),
            "stored as a hash: {a}"
        );
    }

    #[test]
    fn fingerprints_cover_method_path_and_body() {
        let p = |m: &str, u: &str| {
            Request::builder()
                .method(m)
                .uri(u)
                .body(())
                .unwrap()
                .into_parts()
                .0
        };
        let body = Bytes::from_static(b"{}");
        let base = fingerprint(&p("POST", "/refunds"), &body);
        assert_eq!(base, fingerprint(&p("POST", "/refunds"), &body));
        assert_ne!(base, fingerprint(&p("PATCH", "/refunds"), &body));
        assert_ne!(base, fingerprint(&p("POST", "/refunds?x=1"), &body));
        assert_ne!(
            base,
            fingerprint(&p("POST", "/refunds"), &Bytes::from_static(b"{ }"))
        );
    }
}
