//! What a response says of its dependency's quotas, in the header families servers use.

use http::HeaderMap;
use std::time::{Duration, SystemTime};

/// What a quota counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Unit {
    /// Requests: every attempt costs one.
    Requests,
    /// Tokens (input and output together, as most LLM APIs count them).
    Tokens,
    /// Input tokens (Anthropic counts them apart).
    InputTokens,
    /// Output tokens (Anthropic counts them apart).
    OutputTokens,
}

impl Unit {
    /// Its name in words: "requests", "tokens", "input tokens", "output tokens".
    pub fn as_str(self) -> &'static str {
        match self {
            Unit::Requests => "requests",
            Unit::Tokens => "tokens",
            Unit::InputTokens => "input tokens",
            Unit::OutputTokens => "output tokens",
        }
    }

    /// Its name in a fleet's account (`fleet/account.lua`).
    #[cfg(feature = "fleet")]
    pub(crate) fn key(self) -> &'static str {
        match self {
            Unit::Requests => "requests",
            Unit::Tokens => "tokens",
            Unit::InputTokens => "input-tokens",
            Unit::OutputTokens => "output-tokens",
        }
    }

    /// The unit named `key` in a fleet's account.
    #[cfg(feature = "fleet")]
    pub(crate) fn from_key(key: &str) -> Option<Unit> {
        [
            Unit::Requests,
            Unit::Tokens,
            Unit::InputTokens,
            Unit::OutputTokens,
        ]
        .into_iter()
        .find(|u| u.key() == key)
    }
}

/// One quota a response reported: how many of `unit` the window allows, how many are left,
/// and when the window resets. A field the response did not give is `None`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Advertised {
    /// What it counts.
    pub unit: Unit,
    /// How many the window allows.
    pub limit: Option<u64>,
    /// How many are left in the window.
    pub remaining: Option<u64>,
    /// How long until the window resets (and `remaining` is back to `limit`).
    pub reset: Option<Duration>,
}

/// Every quota `headers` report, read as of `now` (for resets given as dates), in each family
/// servers use:
///
/// - the IETF `RateLimit-Policy` and `RateLimit` structured fields (draft-ietf-httpapi-ratelimit-
///   headers: `"default";q=100;w=60` and `"default";r=42;t=30`; a policy's `qu` names its unit);
/// - `RateLimit-Limit`, `RateLimit-Remaining`, `RateLimit-Reset` (earlier drafts) and the
///   `X-RateLimit-Limit / -Remaining / -Reset` family (GitHub's, with the reset as epoch seconds),
///   each also with a `-Requests` or `-Tokens` suffix as LLM APIs send them (a reset such as
///   `6m0s`, `1.5s` or `20ms`);
/// - Anthropic's `anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-{limit,
///   remaining,reset}` (the reset an RFC 3339 date);
/// - `retry-after-ms` on its own: nothing is left until it passes.
///
/// A value that cannot be read is left out, with a `tracing` event (target `backstop::quota`);
/// nothing here panics, whatever the headers hold.
///
/// ```
/// use backstop_quota::{Advertised, Unit, advertised};
/// use std::time::{Duration, SystemTime};
///
/// let mut headers = http::HeaderMap::new();
/// headers.insert("x-ratelimit-limit-tokens", "40000".parse().unwrap());
/// headers.insert("x-ratelimit-remaining-tokens", "1200".parse().unwrap());
/// headers.insert("x-ratelimit-reset-tokens", "6m0s".parse().unwrap());
/// assert_eq!(
///     advertised(&headers, SystemTime::now()),
///     vec![Advertised {
///         unit: Unit::Tokens,
///         limit: Some(40_000),
///         remaining: Some(1_200),
///         reset: Some(Duration::from_secs(360)),
///     }],
/// );
/// ```
pub fn advertised(headers: &HeaderMap, now: SystemTime) -> Vec<Advertised> {
    let mut found: Vec<Advertised> = Vec::new();
    let mut add = |a: Advertised| {
        let found = &mut found;
        if a.limit.is_none() && a.remaining.is_none() && a.reset.is_none() {
            return;
        }
        match found.iter_mut().find(|f| f.unit == a.unit) {
            // A second family for the same unit fills what the first left out.
            Some(f) => {
                f.limit = f.limit.or(a.limit);
                f.remaining = f.remaining.or(a.remaining);
                f.reset = f.reset.or(a.reset);
            }
            None => found.push(a),
        }
    };
    ietf(headers, &mut add);
    for &(unit, [limit, remaining, reset]) in FAMILIES {
        add(Advertised {
            unit,
            limit: count(headers, limit),
            remaining: count(headers, remaining),
            reset: text(headers, reset).and_then(|v| reset_in(v, now)),
        });
    }
    if found.is_empty()
        && let Some(ms) = count(headers, "retry-after-ms")
    {
        found.push(Advertised {
            unit: Unit::Requests,
            limit: None,
            remaining: Some(0),
            reset: Some(Duration::from_millis(ms)),
        });
    }
    found
}

/// The `limit`, `remaining` and `reset` headers of each family that names them apart, with the
/// unit they count.
const FAMILIES: &[(Unit, [&str; 3])] = &[
    (
        Unit::Requests,
        ["ratelimit-limit", "ratelimit-remaining", "ratelimit-reset"],
    ),
    (
        Unit::Requests,
        [
            "x-ratelimit-limit",
            "x-ratelimit-remaining",
            "x-ratelimit-reset",
        ],
    ),
    (
        Unit::Requests,
        [
            "x-ratelimit-limit-requests",
            "x-ratelimit-remaining-requests",
            "x-ratelimit-reset-requests",
        ],
    ),
    (
        Unit::Tokens,
        [
            "x-ratelimit-limit-tokens",
            "x-ratelimit-remaining-tokens",
            "x-ratelimit-reset-tokens",
        ],
    ),
    (
        Unit::Requests,
        [
            "anthropic-ratelimit-requests-limit",
            "anthropic-ratelimit-requests-remaining",
            "anthropic-ratelimit-requests-reset",
        ],
    ),
    (
        Unit::Tokens,
        [
            "anthropic-ratelimit-tokens-limit",
            "anthropic-ratelimit-tokens-remaining",
            "anthropic-ratelimit-tokens-reset",
        ],
    ),
    (
        Unit::InputTokens,
        [
            "anthropic-ratelimit-input-tokens-limit",
            "anthropic-ratelimit-input-tokens-remaining",
            "anthropic-ratelimit-input-tokens-reset",
        ],
    ),
    (
        Unit::OutputTokens,
        [
            "anthropic-ratelimit-output-tokens-limit",
            "anthropic-ratelimit-output-tokens-remaining",
            "anthropic-ratelimit-output-tokens-reset",
        ],
    ),
];

/// A header's value as text, if it is there once and is text.
fn text<'h>(headers: &'h HeaderMap, name: &str) -> Option<&'h str> {
    let value = headers.get(name)?;
    match value.to_str() {
        Ok(v) => Some(v.trim()),
        Err(_) => {
            ignored(name, "not text");
            None
        }
    }
}

/// A header holding a whole number (its first item, where a server adds its policy after a
/// comma: `30, 30;w=1`).
fn count(headers: &HeaderMap, name: &str) -> Option<u64> {
    let v = text(headers, name)?;
    let first = v.split([',', ';']).next().unwrap_or(v).trim();
    match first.parse::<u64>() {
        Ok(n) => Some(n),
        Err(_) => {
            ignored(name, v);
            None
        }
    }
}

fn ignored(header: &str, value: &str) {
    tracing::debug!(target: "backstop::quota", header, value, "ignored a quota header it cannot read");
}

/// The longest reset believed: a value past it is a mistake, not a quota.
const ABSURD: Duration = Duration::from_secs(400 * 86_400);

/// A reset as servers write it: seconds from now (`30`), epoch seconds (`1733400000`, as GitHub
/// does), a Go-style duration (`6m0s`, `1.5s`, `20ms`) or an RFC 3339 date.
fn reset_in(value: &str, now: SystemTime) -> Option<Duration> {
    let at = |epoch: Duration| epoch.checked_sub(now.duration_since(SystemTime::UNIX_EPOCH).ok()?);
    let reset = if let Ok(n) = value.parse::<u64>() {
        // Epoch seconds are in the billions; a delay in seconds is not.
        if n >= 1_000_000_000 {
            Some(at(Duration::from_secs(n)).unwrap_or(Duration::ZERO))
        } else {
            Some(Duration::from_secs(n))
        }
    } else if let Some(d) = go_duration(value) {
        Some(d)
    } else if let Ok(date) = chrono::DateTime::parse_from_rfc3339(value) {
        let millis = u64::try_from(date.timestamp_millis()).ok()?;
        Some(at(Duration::from_millis(millis)).unwrap_or(Duration::ZERO))
    } else {
        None
    };
    match reset {
        Some(d) if d <= ABSURD => Some(d),
        _ => {
            ignored("reset", value);
            None
        }
    }
}

/// A Go-style duration: one or more numbers (a fraction allowed), each with a unit of `h`, `m`,
/// `s`, `ms`, `us` or `ns`.
fn go_duration(value: &str) -> Option<Duration> {
    let mut rest = value;
    let mut total = 0f64;
    if rest.is_empty() {
        return None;
    }
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let number: f64 = rest[..digits].parse().ok()?;
        rest = &rest[digits..];
        let letters = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let seconds = match &rest[..letters] {
            "h" => 3600.0,
            "m" => 60.0,
            "s" => 1.0,
            "ms" => 1e-3,
            "us" | "µs" => 1e-6,
            "ns" => 1e-9,
            _ => return None,
        };
        rest = &rest[letters..];
        total += number * seconds;
    }
    Duration::try_from_secs_f64(total).ok()
}

/// The IETF fields: each policy of `RateLimit-Policy` with the matching item of `RateLimit`.
fn ietf(headers: &HeaderMap, add: &mut impl FnMut(Advertised)) {
    let policies = text(headers, "ratelimit-policy")
        .map(items)
        .unwrap_or_default();
    let states = text(headers, "ratelimit").map(items).unwrap_or_default();
    for (name, state) in &states {
        let policy = policies.iter().find(|(n, _)| n == name).map(|(_, p)| p);
        let unit = match policy.and_then(|p| p.unit.as_deref()) {
            None | Some("requests") => Unit::Requests,
            Some("tokens") => Unit::Tokens,
            Some(other) => {
                ignored("ratelimit-policy", other);
                continue;
            }
        };
        add(Advertised {
            unit,
            limit: policy.and_then(|p| p.q),
            remaining: state.r,
            reset: state.t.map(Duration::from_secs),
        });
    }
}

/// The parameters of one IETF item.
#[derive(Debug, Default)]
struct Params {
    q: Option<u64>,
    r: Option<u64>,
    t: Option<u64>,
    unit: Option<String>,
}

/// The items of an IETF field, by name: a List (`"name";q=1`) or, as earlier drafts wrote it, a
/// Dictionary (`name;q=1`).
fn items(value: &str) -> Vec<(String, Params)> {
    let params = |p: &sfv::Parameters| {
        let number = |k: &str| {
            p.get(k)
                .and_then(sfv::BareItem::as_integer)
                .and_then(|i| u64::try_from(i).ok())
        };
        Params {
            q: number("q"),
            r: number("r"),
            t: number("t"),
            unit: p.get("qu").and_then(|v| match v {
                sfv::BareItem::String(s) => Some(s.as_str().to_owned()),
                sfv::BareItem::Token(t) => Some(t.as_str().to_owned()),
                _ => None,
            }),
        }
    };
    if let Ok(list) = sfv::Parser::new(value).parse::<sfv::List>() {
        return list
            .iter()
            .filter_map(|entry| match entry {
                sfv::ListEntry::Item(item) => {
                    let name = match &item.bare_item {
                        sfv::BareItem::String(s) => s.as_str().to_owned(),
                        sfv::BareItem::Token(t) => t.as_str().to_owned(),
                        _ => return None,
                    };
                    Some((name, params(&item.params)))
                }
                sfv::ListEntry::InnerList(_) => None,
            })
            .collect();
    }
    if let Ok(dict) = sfv::Parser::new(value).parse::<sfv::Dictionary>() {
        return dict
            .iter()
            .filter_map(|(key, entry)| match entry {
                sfv::ListEntry::Item(item) => Some((key.as_str().to_owned(), params(&item.params))),
                sfv::ListEntry::InnerList(_) => None,
            })
            .collect();
    }
    ignored("ratelimit", value);
    Vec::new()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        h
    }

    fn at(epoch_secs: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(epoch_secs)
    }

    #[test]
    fn the_ietf_fields() {
        let h = headers(&[
            (
                "ratelimit-policy",
                r#""burst";q=100;w=60, "tokens";q=40000;w=60;qu="tokens""#,
            ),
            ("ratelimit", r#""burst";r=42;t=30, "tokens";r=1000;t=12"#),
        ]);
        assert_eq!(
            advertised(&h, SystemTime::now()),
            vec![
                Advertised {
                    unit: Unit::Requests,
                    limit: Some(100),
                    remaining: Some(42),
                    reset: Some(Duration::from_secs(30)),
                },
                Advertised {
                    unit: Unit::Tokens,
                    limit: Some(40_000),
                    remaining: Some(1000),
                    reset: Some(Duration::from_secs(12)),
                },
            ]
        );
        // An earlier draft's dictionary.
        let h = headers(&[("ratelimit", "default;r=5;t=2")]);
        assert_eq!(advertised(&h, SystemTime::now())[0].remaining, Some(5));
    }

    #[test]
    fn a_limit_followed_by_its_policy_is_read() {
        let h = headers(&[
            ("x-ratelimit-limit", "30, 30;w=1"),
            ("x-ratelimit-remaining", "12"),
            ("x-ratelimit-reset", "1"),
        ]);
        assert_eq!(advertised(&h, SystemTime::now())[0].limit, Some(30));
    }

    #[test]
    fn githubs_reset_is_an_epoch_second() {
        let h = headers(&[
            ("x-ratelimit-limit", "5000"),
            ("x-ratelimit-remaining", "0"),
            ("x-ratelimit-reset", "1733400060"),
        ]);
        assert_eq!(
            advertised(&h, at(1_733_400_000)),
            vec![Advertised {
                unit: Unit::Requests,
                limit: Some(5000),
                remaining: Some(0),
                reset: Some(Duration::from_secs(60)),
            }]
        );
    }

    #[test]
    fn llm_apis_requests_and_tokens() {
        let h = headers(&[
            ("x-ratelimit-limit-requests", "60"),
            ("x-ratelimit-remaining-requests", "59"),
            ("x-ratelimit-reset-requests", "1s"),
            ("x-ratelimit-limit-tokens", "40000"),
            ("x-ratelimit-remaining-tokens", "38500"),
            ("x-ratelimit-reset-tokens", "2.25s"),
        ]);
        let found = advertised(&h, SystemTime::now());
        assert_eq!(found[0].unit, Unit::Requests);
        assert_eq!(found[0].reset, Some(Duration::from_secs(1)));
        assert_eq!(found[1].unit, Unit::Tokens);
        assert_eq!(found[1].remaining, Some(38_500));
        assert_eq!(found[1].reset, Some(Duration::from_millis(2250)));
        assert_eq!(go_duration("6m0s"), Some(Duration::from_secs(360)));
        assert_eq!(go_duration("1h2m3s"), Some(Duration::from_secs(3723)));
        assert_eq!(go_duration("20ms"), Some(Duration::from_millis(20)));
        assert_eq!(go_duration("6x"), None);
        assert_eq!(go_duration(""), None);
    }

    #[test]
    fn anthropics_reset_is_a_date() {
        let h = headers(&[
            ("anthropic-ratelimit-input-tokens-limit", "80000"),
            ("anthropic-ratelimit-input-tokens-remaining", "79000"),
            (
                "anthropic-ratelimit-input-tokens-reset",
                "2024-12-05T12:00:30Z",
            ),
            ("anthropic-ratelimit-requests-remaining", "49"),
        ]);
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_733_400_000); // 12:00:00Z
        let found = advertised(&h, now);
        assert_eq!(found[0].unit, Unit::Requests);
        assert_eq!(found[0].remaining, Some(49));
        assert_eq!(found[1].unit, Unit::InputTokens);
        assert_eq!(found[1].reset, Some(Duration::from_secs(30)));
    }

    #[test]
    fn retry_after_ms_alone_means_nothing_left_until_then() {
        let h = headers(&[("retry-after-ms", "1500")]);
        assert_eq!(
            advertised(&h, SystemTime::now()),
            vec![Advertised {
                unit: Unit::Requests,
                limit: None,
                remaining: Some(0),
                reset: Some(Duration::from_millis(1500)),
            }]
        );
    }

    #[test]
    fn what_cannot_be_read_is_left_out() {
        let h = headers(&[
            ("x-ratelimit-limit", "-5"),
            ("x-ratelimit-remaining", "lots"),
            ("x-ratelimit-reset", "99999999999999999999"),
            ("ratelimit", "((("),
            ("ratelimit-policy", r#""p";qu="furlongs""#),
            ("anthropic-ratelimit-tokens-reset", "tomorrow"),
        ]);
        assert_eq!(advertised(&h, SystemTime::now()), vec![]);
    }

    proptest! {
        /// Whatever the headers hold, reading them never panics, and whatever is read is within
        /// reason.
        #[test]
        fn any_value_is_read_or_ignored(
            name in prop::sample::select(vec![
                "ratelimit", "ratelimit-policy", "ratelimit-limit", "ratelimit-remaining",
                "ratelimit-reset", "x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens",
                "x-ratelimit-reset-tokens", "x-ratelimit-reset", "anthropic-ratelimit-tokens-reset",
                "anthropic-ratelimit-requests-remaining", "retry-after-ms",
            ]),
            value in "[ -~]{0,40}",
            epoch in 0u64..4_000_000_000,
        ) {
            let mut h = HeaderMap::new();
            if let Ok(v) = http::HeaderValue::from_str(&value) {
                h.insert(name, v);
            }
            for a in advertised(&h, at(epoch)) {
                prop_assert!(a.reset.is_none_or(|r| r <= ABSURD));
            }
        }
    }
}
