use crate::{AsError, Classify, Verdict, classify_error, parse_retry_after};
use backstop_core::{Outcome, ReplaySafe};
use http::{HeaderName, Request, Response, StatusCode};
use std::{
    fmt,
    time::{Duration, SystemTime},
};

/// How the [`HttpClassifier`] treats one response status.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum StatusClass {
    /// Return the response as it is (2xx, 3xx and every other status not listed).
    Success,
    /// Never retry; the dependency answered definitively (most 4xx, 501, 505).
    Fatal,
    /// Retry; the dependency refused before doing anything (408, 429, 503), so the request is
    /// [`Outcome::NotSent`] and may be repeated even when it is not replay-safe.
    RetryRefused,
    /// Retry only a replay-safe request; the dependency may have acted before failing (500,
    /// 502, 504), so the outcome is [`Outcome::Unknown`].
    RetryUnknown,
}

const DEFAULT_MAX_RETRY_AFTER: Duration = Duration::from_secs(60);

/// The HTTP [`Classify`] implementation.
///
/// Defaults:
///
/// | status | verdict | outcome |
/// |---|---|---|
/// | 408, 429, 503 | retryable | not sent: the server refused before acting |
/// | 500, 502, 504 | retryable | unknown: the server (or its upstream) may have acted |
/// | 409 with `Retry-After` (a request with the same idempotency key is in flight) | retryable | not sent |
/// | other 4xx, 501, 505 and above | fatal | completed |
/// | 1xx, 2xx, 3xx | success | completed |
///
/// Errors are classified by [`classify_error`]; an unrecognised error is fatal with an
/// unknown outcome. `Retry-After` is honoured on every retryable response and capped at
/// [`max_retry_after`](Self::max_retry_after) (60 s by default).
///
/// A request is replay-safe when its method is idempotent (RFC 9110 §9.2.2: GET, HEAD,
/// OPTIONS, TRACE, PUT, DELETE), when it carries an `Idempotency-Key` header (the name is
/// configurable), or when its extensions hold the [`ReplaySafe`] marker.
#[derive(Clone)]
pub struct HttpClassifier {
    // Two bits per status 100..=599: the StatusClass, with 0 meaning "default for its range".
    overrides: [u8; 500],
    max_retry_after: Duration,
    key_header: HeaderName,
    clock: fn() -> SystemTime,
}

impl fmt::Debug for HttpClassifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let overridden: Vec<_> = (100u16..600)
            .filter(|s| self.overrides[usize::from(s - 100)] != 0)
            .map(|s| (s, self.status_class_u16(s)))
            .collect();
        f.debug_struct("HttpClassifier")
            .field("overrides", &overridden)
            .field("max_retry_after", &self.max_retry_after)
            .field("key_header", &self.key_header)
            .finish()
    }
}

impl Default for HttpClassifier {
    fn default() -> Self {
        Self::new()
    }
}

impl HttpClassifier {
    /// The classifier with the defaults in the table above.
    pub fn new() -> Self {
        HttpClassifier {
            overrides: [0; 500],
            max_retry_after: DEFAULT_MAX_RETRY_AFTER,
            key_header: HeaderName::from_static("idempotency-key"),
            clock: SystemTime::now,
        }
    }

    /// Treats `status` as `class` from now on (for example, never retry a 503 from this
    /// dependency, or retry its 409).
    #[must_use]
    pub fn status(mut self, status: StatusCode, class: StatusClass) -> Self {
        let code = status.as_u16();
        if (100..600).contains(&code) {
            self.overrides[usize::from(code - 100)] = match class {
                StatusClass::Success => 1,
                StatusClass::Fatal => 2,
                StatusClass::RetryRefused => 3,
                StatusClass::RetryUnknown => 4,
            };
        }
        self
    }

    /// The longest `Retry-After` delay honoured; longer requests are shortened to it.
    #[must_use]
    pub fn max_retry_after(mut self, max: Duration) -> Self {
        self.max_retry_after = max;
        self
    }

    /// The header whose presence makes a non-idempotent request replay-safe
    /// (`Idempotency-Key` by default).
    #[must_use]
    pub fn idempotency_header(mut self, name: HeaderName) -> Self {
        self.key_header = name;
        self
    }

    /// The wall clock used to turn `Retry-After` dates into delays (for tests).
    #[must_use]
    pub fn clock(mut self, clock: fn() -> SystemTime) -> Self {
        self.clock = clock;
        self
    }

    /// How `status` is treated.
    pub(crate) fn status_class(&self, status: StatusCode) -> StatusClass {
        self.status_class_u16(status.as_u16())
    }

    fn status_class_u16(&self, code: u16) -> StatusClass {
        let o = if (100..600).contains(&code) {
            self.overrides[usize::from(code - 100)]
        } else {
            0
        };
        match o {
            1 => StatusClass::Success,
            2 => StatusClass::Fatal,
            3 => StatusClass::RetryRefused,
            4 => StatusClass::RetryUnknown,
            _ => match code {
                408 | 429 | 503 => StatusClass::RetryRefused,
                500 | 502 | 504 => StatusClass::RetryUnknown,
                c if c >= 400 => StatusClass::Fatal,
                _ => StatusClass::Success,
            },
        }
    }

    /// Classifies a response by its status and `Retry-After` header.
    pub fn classify_response<B>(&self, res: &Response<B>) -> Verdict {
        let code = res.status().as_u16();
        // The headers are only looked at when the status is not already a verdict: a success
        // (the hot path) never searches them.
        let has_retry_after = || res.headers().contains_key(http::header::RETRY_AFTER);
        // The IETF Idempotency-Key draft answers 409 while a request with the same key is still
        // running; with a Retry-After it means "not processed, come back": retry it (unless the
        // user configured 409 explicitly).
        let class =
            if code == 409 && self.overrides[usize::from(code - 100)] == 0 && has_retry_after() {
                StatusClass::RetryRefused
            } else {
                self.status_class(res.status())
            };
        let outcome = match class {
            StatusClass::Success => return Verdict::Success,
            StatusClass::Fatal => {
                return Verdict::Fatal {
                    outcome: Outcome::Completed,
                };
            }
            StatusClass::RetryRefused => Outcome::NotSent,
            StatusClass::RetryUnknown => Outcome::Unknown,
        };
        let after = if has_retry_after() {
            parse_retry_after(res.headers(), (self.clock)(), self.max_retry_after)
        } else {
            None
        };
        Verdict::Retryable { outcome, after }
    }

    /// Whether the request may be sent again after an attempt with an unknown outcome: an
    /// idempotent method, a [`ReplaySafe`] marker, or an idempotency key that someone vouched
    /// for (one the stack attached on its own, marked `UnvouchedKey`, does not count).
    pub(crate) fn request_is_replay_safe<B>(&self, req: &Request<B>) -> bool {
        backstop_core::plumbing::is_idempotent_method(req.method())
            || ReplaySafe::is_marked(req)
            || (req
                .headers()
                .get(&self.key_header)
                .is_some_and(|v| !v.is_empty())
                && !backstop_core::UnvouchedKey::is_marked(req))
    }
}

impl<B, ResB, E> Classify<Request<B>, Response<ResB>, E> for HttpClassifier
where
    E: AsError,
{
    fn classify(&self, result: Result<&Response<ResB>, &E>) -> Verdict {
        match result {
            Ok(res) => self.classify_response(res),
            Err(e) => classify_error(e.as_error()).unwrap_or(Verdict::Fatal {
                outcome: Outcome::Unknown,
            }),
        }
    }

    fn is_replay_safe(&self, req: &Request<B>) -> bool {
        self.request_is_replay_safe(req)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use backstop_core::BoxError;
    use std::io;

    fn res(status: u16) -> Response<()> {
        Response::builder().status(status).body(()).unwrap()
    }

    fn classify(c: &HttpClassifier, r: &Response<()>) -> Verdict {
        Classify::<Request<()>, _, BoxError>::classify(c, Ok(r))
    }

    #[test]
    fn default_status_table() {
        let c = HttpClassifier::new();
        for s in [200, 201, 204, 301, 304, 101] {
            assert_eq!(classify(&c, &res(s)), Verdict::Success, "{s}");
        }
        for s in [408, 429, 503] {
            assert_eq!(
                classify(&c, &res(s)),
                Verdict::Retryable {
                    outcome: Outcome::NotSent,
                    after: None
                },
                "{s}"
            );
        }
        for s in [500, 502, 504] {
            assert_eq!(
                classify(&c, &res(s)),
                Verdict::Retryable {
                    outcome: Outcome::Unknown,
                    after: None
                },
                "{s}"
            );
        }
        for s in [400, 401, 403, 404, 409, 422, 501, 505, 511, 599] {
            assert_eq!(
                classify(&c, &res(s)),
                Verdict::Fatal {
                    outcome: Outcome::Completed
                },
                "{s}"
            );
        }
    }

    #[test]
    fn overrides() {
        let c = HttpClassifier::new()
            .status(StatusCode::SERVICE_UNAVAILABLE, StatusClass::Fatal)
            .status(StatusCode::CONFLICT, StatusClass::RetryRefused);
        assert!(!classify(&c, &res(503)).is_retryable());
        assert!(classify(&c, &res(409)).is_retryable());
        assert!(format!("{c:?}").contains("409"));
    }

    #[test]
    fn retry_after_is_read_and_capped() {
        let c = HttpClassifier::new().max_retry_after(Duration::from_secs(10));
        let r = Response::builder()
            .status(429)
            .header("retry-after", "3")
            .body(())
            .unwrap();
        assert_eq!(classify(&c, &r).retry_after(), Some(Duration::from_secs(3)));
        let r = Response::builder()
            .status(503)
            .header("retry-after", "3600")
            .body(())
            .unwrap();
        assert_eq!(
            classify(&c, &r).retry_after(),
            Some(Duration::from_secs(10))
        );
        let r = Response::builder()
            .status(503)
            .header("retry-after", "tomorrow")
            .body(())
            .unwrap();
        assert_eq!(classify(&c, &r).retry_after(), None);
        // Retry-After on a fatal response does not make it retryable.
        let r = Response::builder()
            .status(400)
            .header("retry-after", "1")
            .body(())
            .unwrap();
        assert!(!classify(&c, &r).is_retryable());
    }

    #[test]
    fn a_409_with_retry_after_is_an_in_flight_duplicate_to_retry() {
        let c = HttpClassifier::new();
        let busy = Response::builder()
            .status(409)
            .header("retry-after", "1")
            .body(())
            .unwrap();
        assert_eq!(
            classify(&c, &busy),
            Verdict::Retryable {
                outcome: Outcome::NotSent,
                after: Some(Duration::from_secs(1))
            }
        );
        assert!(!classify(&c, &res(409)).is_retryable());
        let strict = HttpClassifier::new().status(StatusCode::CONFLICT, StatusClass::Fatal);
        assert!(!classify(&strict, &busy).is_retryable());
    }

    #[test]
    fn retry_after_dates_use_the_clock() {
        fn fixed() -> SystemTime {
            SystemTime::UNIX_EPOCH + Duration::from_secs(784_111_777)
        }
        let c = HttpClassifier::new().clock(fixed);
        let r = Response::builder()
            .status(503)
            .header("retry-after", "Sun, 06 Nov 1994 08:49:47 GMT")
            .body(())
            .unwrap();
        assert_eq!(
            classify(&c, &r).retry_after(),
            Some(Duration::from_secs(10))
        );
    }

    #[test]
    fn replay_safety() {
        let c = HttpClassifier::new();
        for m in ["GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"] {
            let r = Request::builder().method(m).body(()).unwrap();
            assert!(c.request_is_replay_safe(&r), "{m}");
        }
        for m in ["POST", "PATCH", "CONNECT"] {
            let r = Request::builder().method(m).body(()).unwrap();
            assert!(!c.request_is_replay_safe(&r), "{m}");
        }
        let keyed = Request::post("/")
            .header("Idempotency-Key", "k1")
            .body(())
            .unwrap();
        assert!(c.request_is_replay_safe(&keyed));
        let empty = Request::post("/")
            .header("Idempotency-Key", "")
            .body(())
            .unwrap();
        assert!(!c.request_is_replay_safe(&empty));
        let mut marked = Request::post("/").body(()).unwrap();
        marked.extensions_mut().insert(ReplaySafe);
        assert!(c.request_is_replay_safe(&marked));
        let custom =
            HttpClassifier::new().idempotency_header(HeaderName::from_static("x-request-key"));
        let r = Request::post("/")
            .header("x-request-key", "a")
            .body(())
            .unwrap();
        assert!(custom.request_is_replay_safe(&r));
        assert!(!custom.request_is_replay_safe(&keyed));
    }

    #[test]
    fn errors() {
        let c = HttpClassifier::new();
        let refused: BoxError = Box::new(io::Error::from(io::ErrorKind::ConnectionRefused));
        let v = Classify::<Request<()>, Response<()>, _>::classify(&c, Err(&refused));
        assert_eq!(
            v,
            Verdict::Retryable {
                outcome: Outcome::NotSent,
                after: None
            }
        );
        let odd: BoxError = "something else".into();
        let v = Classify::<Request<()>, Response<()>, _>::classify(&c, Err(&odd));
        assert_eq!(
            v,
            Verdict::Fatal {
                outcome: Outcome::Unknown
            }
        );
    }
}
