use http::{HeaderMap, HeaderValue, header::RETRY_AFTER};
use std::time::{Duration, SystemTime};

/// A server asking for more than this is misconfigured; its value is ignored rather than
/// merely capped, and the retry layer falls back to its own backoff.
const ABSURD: Duration = Duration::from_secs(366 * 24 * 60 * 60);

/// Reads the `Retry-After` header (RFC 9110 §10.2.3) from `headers`.
///
/// - `delay-seconds` (one or more ASCII digits, surrounding spaces or tabs allowed): that many
///   seconds.
/// - An HTTP-date in any of the three forms RFC 9110 accepts (IMF-fixdate, obsolete RFC 850,
///   asctime), parsed by `httpdate`: the time from `now` until then, or zero for a date in the
///   past.
///
/// The result is capped at `max`. A missing header, one that appears more than once
/// (ambiguous), or anything else (signs, fractions, garbage, a number that overflows, a delay
/// of more than a year) yields `None`; it never panics.
///
/// ```
/// use backstop_classify::parse_retry_after;
/// use http::HeaderMap;
/// use std::time::{Duration, SystemTime};
///
/// let retry_after = |value: &'static str| {
///     let mut headers = HeaderMap::new();
///     headers.insert("retry-after", value.parse().unwrap());
///     headers
/// };
/// let max = Duration::from_secs(300);
/// assert_eq!(parse_retry_after(&retry_after("120"), SystemTime::UNIX_EPOCH, max), Some(Duration::from_secs(120)));
/// assert_eq!(parse_retry_after(&retry_after("900"), SystemTime::UNIX_EPOCH, max), Some(max));
///
/// let now = SystemTime::UNIX_EPOCH + Duration::from_secs(784_111_717); // Sun, 06 Nov 1994 08:48:37 GMT
/// let date = retry_after("Sun, 06 Nov 1994 08:49:37 GMT");
/// assert_eq!(parse_retry_after(&date, now, max), Some(Duration::from_secs(60)));
/// assert_eq!(parse_retry_after(&retry_after("-1"), now, max), None);
/// ```
pub fn parse_retry_after(headers: &HeaderMap, now: SystemTime, max: Duration) -> Option<Duration> {
    let mut values = headers.get_all(RETRY_AFTER).iter();
    let first = values.next()?;
    if values.next().is_some() {
        return None;
    }
    parse_retry_after_value(first, now, max)
}

/// One `Retry-After` value, by the rules of [`parse_retry_after`].
pub(crate) fn parse_retry_after_value(
    value: &HeaderValue,
    now: SystemTime,
    max: Duration,
) -> Option<Duration> {
    let text = value.to_str().ok()?.trim_matches([' ', '\t']);
    if text.is_empty() {
        return None;
    }
    let delay = if text.bytes().all(|b| b.is_ascii_digit()) {
        Duration::from_secs(text.parse::<u64>().ok()?)
    } else {
        let at = httpdate::parse_http_date(text).ok()?;
        at.duration_since(now).unwrap_or(Duration::ZERO)
    };
    if delay > ABSURD {
        return None;
    }
    Some(delay.min(max))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    // Sun, 06 Nov 1994 08:49:37 GMT, the example date of RFC 9110.
    const EXAMPLE: u64 = 784_111_777;

    fn now() -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(EXAMPLE - 30)
    }

    fn parse(s: &str) -> Option<Duration> {
        let max = Duration::from_secs(120);
        parse_retry_after_value(&HeaderValue::from_str(s).unwrap(), now(), max)
    }

    #[test]
    fn table() {
        let secs = |s| Some(Duration::from_secs(s));
        let cases: &[(&str, Option<Duration>)] = &[
            ("0", secs(0)),
            ("5", secs(5)),
            (" 5\t", secs(5)),
            ("007", secs(7)),
            ("120", secs(120)),
            ("121", secs(120)),
            ("86400", secs(120)),
            // the three date formats, all 30 s after `now`
            ("Sun, 06 Nov 1994 08:49:37 GMT", secs(30)),
            ("Sunday, 06-Nov-94 08:49:37 GMT", secs(30)),
            ("Sun Nov  6 08:49:37 1994", secs(30)),
            // in the past
            ("Sun, 06 Nov 1994 08:00:00 GMT", secs(0)),
            ("Thu, 01 Jan 1970 00:00:00 GMT", secs(0)),
            // far future: more than a year is absurd and ignored
            ("Fri, 31 Dec 9999 23:59:59 GMT", None),
            ("99999999999", None),
            ("18446744073709551616", None),
            ("-5", None),
            ("+5", None),
            ("1.5", None),
            ("5s", None),
            ("", None),
            ("   ", None),
            ("soon", None),
            ("Sun, 06 Nov 1994 25:49:37 GMT", None),
        ];
        for (input, want) in cases {
            assert_eq!(parse(input), *want, "Retry-After: {input:?}");
        }
    }

    #[test]
    fn duplicate_headers_are_ambiguous() {
        let mut h = HeaderMap::new();
        h.append(RETRY_AFTER, HeaderValue::from_static("1"));
        assert_eq!(
            parse_retry_after(&h, now(), Duration::MAX),
            Some(Duration::from_secs(1))
        );
        h.append(RETRY_AFTER, HeaderValue::from_static("100"));
        assert_eq!(parse_retry_after(&h, now(), Duration::MAX), None);
        assert_eq!(
            parse_retry_after(&HeaderMap::new(), now(), Duration::MAX),
            None
        );
    }

    #[test]
    fn non_ascii_is_ignored() {
        let v = HeaderValue::from_bytes(b"\xff5").unwrap();
        assert_eq!(parse_retry_after_value(&v, now(), Duration::MAX), None);
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic_and_respect_the_cap(
            bytes in proptest::collection::vec(any::<u8>(), 0..64),
            max_ms in 0u64..10_000_000,
            now_s in 0u64..10_000_000_000,
        ) {
            if let Ok(v) = HeaderValue::from_bytes(&bytes) {
                let max = Duration::from_millis(max_ms);
                let now = SystemTime::UNIX_EPOCH + Duration::from_secs(now_s);
                if let Some(d) = parse_retry_after_value(&v, now, max) {
                    prop_assert!(d <= max);
                }
            }
        }

        #[test]
        fn delay_seconds_round_trip(secs in 0u64..=31_000_000, max_s in 0u64..100_000) {
            let v = HeaderValue::from_str(&secs.to_string()).unwrap();
            let max = Duration::from_secs(max_s);
            prop_assert_eq!(
                parse_retry_after_value(&v, now(), max),
                Some(Duration::from_secs(secs).min(max))
            );
        }

        #[test]
        fn dates_round_trip(offset in 0u64..1_000_000, max_s in 0u64..2_000_000) {
            let at = now() + Duration::from_secs(offset);
            let v = HeaderValue::from_str(&httpdate::fmt_http_date(at)).unwrap();
            let max = Duration::from_secs(max_s);
            prop_assert_eq!(
                parse_retry_after_value(&v, now(), max),
                Some(Duration::from_secs(offset).min(max))
            );
        }
    }
}
