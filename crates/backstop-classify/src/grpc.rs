use crate::{AsError, classify_error};
use backstop_core::{Classify, Outcome, ReplaySafe, Verdict};
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response};
use std::{fmt, time::Duration};
use tonic::Code;
use tower_http::classify::{
    ClassifiedResponse, ClassifyEos, ClassifyResponse, GrpcErrorsAsFailures, GrpcFailureClass,
};

/// The header a gRPC server sends to ask for a delay before a retry (gRPC's retry design, A6).
pub(crate) const RETRY_PUSHBACK: &str = "grpc-retry-pushback-ms";

/// Classifies gRPC calls after gRPC's retry design (A6).
///
/// A call is judged **at its response headers**, as A6 does: a response that carries
/// `grpc-status` in its headers (a trailers-only response, which is how servers answer an error
/// without messages) is classified by its code; a response that starts streaming messages is
/// committed and counts as a success here, since its status only comes in the trailers, after
/// the caller has begun to read it. [`classify_trailers`](GrpcClassifier::classify_trailers)
/// judges those trailers the same way, for code that reads them (a breaker, a metric).
///
/// | status | verdict | outcome |
/// |---|---|---|
/// | `OK`, or no `grpc-status` in the headers | success | completed |
/// | `UNAVAILABLE` (retryable by default) | retryable | **unknown**: it may come after the server processed the call; only a transport error that shows the call never left (connection refused, an HTTP/2 `REFUSED_STREAM`) is *not sent* |
/// | `RESOURCE_EXHAUSTED` (retryable by default) | retryable | not sent (refused for quota) |
/// | another code in [`retry_on`](GrpcClassifier::retry_on) | retryable | unknown |
/// | any other code (`INVALID_ARGUMENT`, `NOT_FOUND`, ...) | fatal | completed |
/// | `grpc-retry-pushback-ms: N` on a retryable status | retryable after N ms (capped) | as above |
/// | `grpc-retry-pushback-ms` negative or malformed | fatal: the server said do not retry | as above |
///
/// tower-http's `GrpcErrorsAsFailures` reads the status from headers and trailers.
///
/// ```
/// use backstop_classify::{Classify, GrpcClassifier, Verdict};
/// use backstop_core::{BoxError, Outcome};
/// use std::time::Duration;
///
/// let grpc = GrpcClassifier::new();
/// let res = |status: &str, pushback: Option<&str>| {
///     let mut b = http::Response::builder().header("grpc-status", status);
///     if let Some(p) = pushback { b = b.header("grpc-retry-pushback-ms", p); }
///     b.body(()).unwrap()
/// };
/// let v = |r| Classify::<http::Request<()>, _, BoxError>::classify(&grpc, Ok(&r));
/// assert_eq!(v(res("14", Some("250"))), Verdict::Retryable { outcome: Outcome::Unknown, after: Some(Duration::from_millis(250)) });
/// assert_eq!(v(res("14", Some("-1"))), Verdict::Fatal { outcome: Outcome::Unknown });
/// assert_eq!(v(res("3", None)), Verdict::Fatal { outcome: Outcome::Completed });
/// assert_eq!(v(res("0", None)), Verdict::Success);
/// ```
#[derive(Clone)]
pub struct GrpcClassifier {
    /// Bit n set: code n is retryable.
    retryable: u32,
    max_pushback: Duration,
    key_header: HeaderName,
}

impl fmt::Debug for GrpcClassifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let codes: Vec<u8> = (0..32).filter(|n| self.retryable & (1 << n) != 0).collect();
        f.debug_struct("GrpcClassifier")
            .field("retryable", &codes)
            .field("max_pushback", &self.max_pushback)
            .finish()
    }
}

impl Default for GrpcClassifier {
    fn default() -> Self {
        GrpcClassifier::new()
    }
}

impl GrpcClassifier {
    /// `UNAVAILABLE` and `RESOURCE_EXHAUSTED` retryable, pushback capped at 60 s, keys in the
    /// `idempotency-key` metadata.
    pub fn new() -> Self {
        GrpcClassifier {
            retryable: (1 << Code::Unavailable as u32) | (1 << Code::ResourceExhausted as u32),
            max_pushback: Duration::from_secs(60),
            key_header: HeaderName::from_static("idempotency-key"),
        }
    }

    /// The retryable codes (A6's `retryableStatusCodes`), instead of the default two.
    #[must_use]
    pub fn retry_on(mut self, codes: impl IntoIterator<Item = Code>) -> Self {
        self.retryable = codes
            .into_iter()
            .filter(|c| *c != Code::Ok)
            .fold(0, |m, c| m | (1 << c as u32));
        self
    }

    /// The longest pushback honoured (60 s); a longer one is cut to it.
    #[must_use]
    pub fn max_pushback(mut self, max: Duration) -> Self {
        self.max_pushback = max;
        self
    }

    /// The metadata key that carries an idempotency key (`idempotency-key`).
    #[must_use]
    pub fn key_header(mut self, name: HeaderName) -> Self {
        self.key_header = name;
        self
    }

    /// The verdict on a gRPC status code, with the pushback header (if any) of the same
    /// headers or trailers.
    pub(crate) fn classify_code(&self, code: Code, pushback: Option<&HeaderValue>) -> Verdict {
        if code == Code::Ok {
            return Verdict::Success;
        }
        let retryable = self.retryable & (1 << code as u32) != 0;
        if !retryable {
            return Verdict::Fatal {
                outcome: Outcome::Completed,
            };
        }
        let outcome = if code == Code::ResourceExhausted {
            Outcome::NotSent
        } else {
            Outcome::Unknown
        };
        let after = match pushback {
            None => None,
            Some(v) => match v.to_str().ok().and_then(|s| s.trim().parse::<i64>().ok()) {
                Some(ms) if ms >= 0 => {
                    Some(Duration::from_millis(ms as u64).min(self.max_pushback))
                }
                // Negative or malformed: the server asks not to be retried.
                _ => return Verdict::Fatal { outcome },
            },
        };
        Verdict::Retryable { outcome, after }
    }

    /// The verdict on a response's headers: a trailers-only response by its `grpc-status`; a
    /// response without one (messages follow) is committed, a success.
    pub(crate) fn classify_headers<B>(&self, res: &Response<B>) -> Verdict {
        match GrpcErrorsAsFailures::new().classify_response(res) {
            ClassifiedResponse::Ready(Ok(())) | ClassifiedResponse::RequiresEos(_) => {
                Verdict::Success
            }
            ClassifiedResponse::Ready(Err(failure)) => {
                self.failure(failure, res.headers().get(RETRY_PUSHBACK))
            }
        }
    }

    /// The verdict on a response's trailers (the status of a call that streamed messages).
    pub fn classify_trailers(&self, trailers: &HeaderMap) -> Verdict {
        let eos = match GrpcErrorsAsFailures::new().classify_response(&Response::new(())) {
            ClassifiedResponse::RequiresEos(eos) => eos,
            ClassifiedResponse::Ready(_) => return Verdict::Success,
        };
        match eos.classify_eos(Some(trailers)) {
            Ok(()) => Verdict::Success,
            Err(failure) => self.failure(failure, trailers.get(RETRY_PUSHBACK)),
        }
    }

    fn failure(&self, failure: GrpcFailureClass, pushback: Option<&HeaderValue>) -> Verdict {
        match failure {
            GrpcFailureClass::Code(code) => {
                self.classify_code(Code::from_i32(code.get()), pushback)
            }
            GrpcFailureClass::Error(_) => Verdict::Fatal {
                outcome: Outcome::Unknown,
            },
        }
    }

    /// Whether a request may be sent again after an unknown outcome: a [`ReplaySafe`] marker,
    /// or an idempotency key in its metadata that someone vouched for. gRPC calls are POSTs,
    /// so the method says nothing.
    pub(crate) fn request_is_replay_safe<B>(&self, req: &Request<B>) -> bool {
        ReplaySafe::is_marked(req)
            || (req
                .headers()
                .get(&self.key_header)
                .is_some_and(|v| !v.is_empty())
                && !backstop_core::UnvouchedKey::is_marked(req))
    }
}

impl<B, ResB, E: AsError> Classify<Request<B>, Response<ResB>, E> for GrpcClassifier {
    fn classify(&self, result: Result<&Response<ResB>, &E>) -> Verdict {
        match result {
            Ok(res) => self.classify_headers(res),
            Err(e) => classify_error(e.as_error()).unwrap_or(Verdict::Fatal {
                outcome: Outcome::Unknown,
            }),
        }
    }

    fn is_replay_safe(&self, req: &Request<B>) -> bool {
        self.request_is_replay_safe(req)
    }
}

/// `grpc-timeout` for `left`: at most 8 digits and a unit, rounded up so the server never
/// gets less than the caller has (`999m`, `3S`, ...).
pub fn grpc_timeout(left: Duration) -> HeaderValue {
    const MAX: u128 = 99_999_999;
    let units: [(u128, &str); 6] = [
        (left.as_nanos(), "n"),
        (
            left.as_micros() + u128::from(!left.subsec_nanos().is_multiple_of(1_000)),
            "u",
        ),
        (
            left.as_millis() + u128::from(!left.subsec_nanos().is_multiple_of(1_000_000)),
            "m",
        ),
        (
            u128::from(left.as_secs()) + u128::from(left.subsec_nanos() != 0),
            "S",
        ),
        (u128::from(left.as_secs().div_ceil(60)), "M"),
        (u128::from(left.as_secs().div_ceil(3600)), "H"),
    ];
    let (n, unit) = units
        .into_iter()
        .find(|(n, _)| *n <= MAX)
        .unwrap_or((MAX, "H"));
    HeaderValue::from_str(&format!("{n}{unit}")).expect("digits and a unit")
}

#[cfg(test)]
mod tests {
    use super::*;
    use backstop_core::BoxError;

    fn res(headers: &[(&str, &str)]) -> Response<()> {
        let mut b = Response::builder();
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(()).unwrap()
    }

    fn verdict(c: &GrpcClassifier, headers: &[(&str, &str)]) -> Verdict {
        Classify::<Request<()>, _, BoxError>::classify(c, Ok(&res(headers)))
    }

    #[test]
    fn each_code_and_pushback() {
        let c = GrpcClassifier::new();
        let retry = |outcome, after| Verdict::Retryable { outcome, after };
        assert_eq!(
            verdict(&c, &[]),
            Verdict::Success,
            "messages follow: committed"
        );
        assert_eq!(verdict(&c, &[("grpc-status", "0")]), Verdict::Success);
        assert_eq!(
            verdict(&c, &[("grpc-status", "14")]),
            retry(Outcome::Unknown, None)
        );
        assert_eq!(
            verdict(&c, &[("grpc-status", "8")]),
            retry(Outcome::NotSent, None)
        );
        for code in ["1", "2", "3", "4", "5", "7", "9", "12", "13", "16"] {
            assert_eq!(
                verdict(&c, &[("grpc-status", code)]),
                Verdict::Fatal {
                    outcome: Outcome::Completed
                },
                "{code}"
            );
        }
        assert_eq!(
            verdict(&c, &[("grpc-status", "14"), (RETRY_PUSHBACK, "1500")]),
            retry(Outcome::Unknown, Some(Duration::from_millis(1500)))
        );
        assert_eq!(
            verdict(&c, &[("grpc-status", "14"), (RETRY_PUSHBACK, "999999999")]),
            retry(Outcome::Unknown, Some(Duration::from_secs(60))),
            "capped"
        );
        for bad in ["-1", "soon", "1.5", ""] {
            assert_eq!(
                verdict(&c, &[("grpc-status", "14"), (RETRY_PUSHBACK, bad)]),
                Verdict::Fatal {
                    outcome: Outcome::Unknown
                },
                "{bad:?}"
            );
        }
        // The retryable codes are configurable.
        let c = GrpcClassifier::new().retry_on([Code::Aborted]);
        assert_eq!(
            verdict(&c, &[("grpc-status", "10")]),
            retry(Outcome::Unknown, None)
        );
        assert!(matches!(
            verdict(&c, &[("grpc-status", "14")]),
            Verdict::Fatal { .. }
        ));
    }

    #[test]
    fn trailers_say_the_same() {
        let c = GrpcClassifier::new();
        let mut t = HeaderMap::new();
        assert_eq!(c.classify_trailers(&t), Verdict::Success);
        t.insert("grpc-status", HeaderValue::from_static("14"));
        t.insert(RETRY_PUSHBACK, HeaderValue::from_static("20"));
        assert_eq!(
            c.classify_trailers(&t),
            Verdict::Retryable {
                outcome: Outcome::Unknown,
                after: Some(Duration::from_millis(20))
            }
        );
    }

    #[test]
    fn a_refused_connection_is_not_sent_and_keys_vouch() {
        let c = GrpcClassifier::new();
        let refused: BoxError =
            Box::new(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        assert_eq!(
            Classify::<Request<()>, Response<()>, BoxError>::classify(&c, Err(&refused)),
            Verdict::Retryable {
                outcome: Outcome::NotSent,
                after: None
            }
        );
        let plain = Request::post("/pkg.Svc/M").body(()).unwrap();
        assert!(!c.request_is_replay_safe(&plain));
        let keyed = Request::post("/pkg.Svc/M")
            .header("idempotency-key", "k")
            .body(())
            .unwrap();
        assert!(c.request_is_replay_safe(&keyed));
    }

    #[test]
    fn a_refused_stream_never_left_and_other_resets_are_unknown() {
        let c = GrpcClassifier::new();
        let v =
            |e: BoxError| Classify::<Request<()>, Response<()>, BoxError>::classify(&c, Err(&e));
        assert_eq!(
            v(Box::new(h2::Error::from(h2::Reason::REFUSED_STREAM))),
            Verdict::Retryable {
                outcome: Outcome::NotSent,
                after: None
            }
        );
        // Any other reset: the server may have processed the stream.
        assert_eq!(
            v(Box::new(h2::Error::from(h2::Reason::INTERNAL_ERROR))),
            Verdict::Fatal {
                outcome: Outcome::Unknown
            }
        );
    }

    #[test]
    fn grpc_timeout_is_at_most_eight_digits_and_never_shorter() {
        let t = |d| grpc_timeout(d).to_str().unwrap().to_owned();
        assert_eq!(t(Duration::from_nanos(999)), "999n");
        assert_eq!(t(Duration::from_millis(250)), "250000u");
        assert_eq!(t(Duration::from_secs(3)), "3000000u");
        assert_eq!(t(Duration::from_secs(200)), "200000m");
        assert_eq!(t(Duration::from_millis(100_000_001)), "100001S");
        assert_eq!(t(Duration::from_secs(200_000_000)), "3333334M");
        assert_eq!(t(Duration::from_secs(86_400 * 365 * 30_000)), "99999999H");
        // Rounded up, never down.
        assert_eq!(t(Duration::new(100_000, 1)), "100001S");
        assert_eq!(t(Duration::new(1, 1)), "1000001u");
    }
}
