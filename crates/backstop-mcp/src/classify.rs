use crate::{
    ToolResult,
    call::ToolCall,
    error::{RpcError, ToolError, codes},
    policy::ToolPolicy,
};
use backstop_classify::{AsError, classify_error};
use backstop_core::{Classify, Outcome, ReportsOutcome, Verdict};
use std::{error::Error, time::Duration};

/// Classifies MCP tool calls.
///
/// | result | verdict | outcome |
/// |---|---|---|
/// | a result (`isError: false`) | success | completed |
/// | a result with `isError: true` | success: the tool answered, and the text goes back to the model as it is | completed |
/// | a result with `isError: true` carrying a JSON-RPC error under [`META_ERROR`](crate::META_ERROR) | as that error (below) | |
/// | [`ToolError::NotSent`] (connection refused, no session) | retryable | not sent |
/// | [`ToolError::Lost`] (reset, lost reply, timeout) | retryable | unknown |
/// | JSON-RPC parse error, invalid request, method not found, invalid params; MCP's resource not found (-32002), header mismatch, missing capability, unsupported protocol version (-32020 to -32022); any other code outside -32099 to -32000 | fatal | completed (the server answered; nothing to repeat) |
/// | JSON-RPC internal error (-32603), or an implementation-defined server error (-32099 to -32000) not listed here | retryable | unknown (the handler may have run part of it) |
/// | overloaded ([`codes::OVERLOADED`]), replay store unavailable ([`codes::REPLAY_UNAVAILABLE`]), a call with the key still running ([`codes::KEY_IN_FLIGHT`]) | retryable, after `data.retryAfterMs` | not sent (this attempt did not run the tool) |
/// | key reused for a different call ([`codes::KEY_REUSED`]); the replay layer misconfigured ([`codes::REPLAY_MISCONFIGURED`]); the caller's time spent when the call arrived ([`codes::DEADLINE_SPENT`]) | fatal | not sent |
/// | outcome unknown ([`codes::OUTCOME_UNKNOWN`]) | fatal | unknown |
/// | anything else in the error's cause chain: as `backstop_classify::classify_error` says (attempt timeouts: unknown; an open circuit: not sent) | | |
///
/// A retryable verdict with an unknown outcome is repeated only for a replay-safe call: a
/// read-only tool, one whose server honours keys, or one whose key the caller gave (see
/// [`ToolPolicy`]).
///
/// ```
/// use backstop_core::{Classify, Outcome, ReportsOutcome, Verdict};
/// use backstop_mcp::{McpClassifier, RpcError, ToolCall, ToolError, ToolResult, codes};
///
/// let c = McpClassifier;
/// let verdict = |r: Result<&ToolResult, &ToolError>| Classify::<ToolCall, _, _>::classify(&c, r);
/// let invalid = ToolError::Rpc(RpcError::new(codes::INVALID_PARAMS, "eur must be positive"));
/// assert!(matches!(verdict(Err(&invalid)), Verdict::Fatal { .. }));
/// let lost = ToolError::Lost("connection reset".into());
/// assert_eq!(verdict(Err(&lost)), Verdict::Retryable { outcome: Outcome::Unknown, after: None });
/// assert_eq!(verdict(Ok(&ToolResult::error_text("no such order"))), Verdict::Success);
/// ```
#[derive(Clone, Copy, Debug, Default)]
pub struct McpClassifier;

/// The verdict on one JSON-RPC error.
pub fn verdict_of_rpc(e: &RpcError) -> Verdict {
    let after = e.retry_after();
    match e.code {
        codes::OVERLOADED | codes::REPLAY_UNAVAILABLE | codes::KEY_IN_FLIGHT => {
            Verdict::Retryable {
                outcome: Outcome::NotSent,
                after,
            }
        }
        codes::KEY_REUSED | codes::REPLAY_MISCONFIGURED | codes::DEADLINE_SPENT => Verdict::Fatal {
            outcome: Outcome::NotSent,
        },
        codes::OUTCOME_UNKNOWN => Verdict::Fatal {
            outcome: Outcome::Unknown,
        },
        // MCP's own: resource not found; header mismatch, missing client capability,
        // unsupported protocol version. The server refused before running anything.
        codes::RESOURCE_NOT_FOUND | -32022..=-32020 => Verdict::Fatal {
            outcome: Outcome::Completed,
        },
        codes::INTERNAL_ERROR | -32099..=-32000 => Verdict::Retryable {
            outcome: Outcome::Unknown,
            after,
        },
        _ => Verdict::Fatal {
            outcome: Outcome::Completed,
        },
    }
}

/// The verdict on one [`ToolError`].
pub fn verdict_of(e: &ToolError) -> Verdict {
    match e {
        ToolError::NotSent(_) => Verdict::Retryable {
            outcome: Outcome::NotSent,
            after: None,
        },
        ToolError::Lost(_) => Verdict::Retryable {
            outcome: Outcome::Unknown,
            after: None,
        },
        ToolError::Rpc(rpc) => verdict_of_rpc(rpc),
        ToolError::Status {
            status,
            retry_after,
        } => {
            // The status as the HTTP stack judges it: 429 and 503 not sent, after their
            // Retry-After; other 5xx unknown; 4xx final.
            let mut res = http::Response::new(());
            *res.status_mut() = *status;
            if let Some(after) = retry_after.as_deref().and_then(|a| a.parse().ok()) {
                res.headers_mut().insert(http::header::RETRY_AFTER, after);
            }
            backstop_classify::HttpClassifier::new().classify_response(&res)
        }
    }
}

fn verdict_of_chain(error: &(dyn Error + 'static)) -> Verdict {
    // The tool call's own error wherever it is in the chain: the transport adapter that made
    // it knew whether the call left.
    let mut current = Some(error);
    while let Some(e) = current {
        if let Some(t) = e.downcast_ref::<ToolError>() {
            return match t {
                // A "lost" call whose cause shows it never left (a refused connection).
                ToolError::Lost(inner) => match classify_error(&**inner) {
                    Some(
                        v @ Verdict::Retryable {
                            outcome: Outcome::NotSent,
                            ..
                        },
                    ) => v,
                    _ => verdict_of(t),
                },
                _ => verdict_of(t),
            };
        }
        if let Some(r) = e.downcast_ref::<RpcError>() {
            return verdict_of_rpc(r);
        }
        current = e.source();
    }
    // Backstop's own errors and the transports' (a timeout around the call is unknown, an
    // open circuit not sent).
    classify_error(error).unwrap_or(Verdict::Fatal {
        outcome: Outcome::Unknown,
    })
}

impl<E: AsError> Classify<ToolCall, ToolResult, E> for McpClassifier {
    fn classify(&self, result: Result<&ToolResult, &E>) -> Verdict {
        match result {
            // A refusal of Backstop's that a transport could only send as a result.
            Ok(result) if result.is_error => match result.carried_error() {
                Some(e) => verdict_of_rpc(&e),
                None => Verdict::Success,
            },
            // `isError: true` is the tool's answer: final, and the model reads it.
            Ok(_) => Verdict::Success,
            Err(e) => verdict_of_chain(e.as_error()),
        }
    }

    fn is_replay_safe(&self, req: &ToolCall) -> bool {
        matches!(
            req.policy(),
            ToolPolicy::ReadOnly | ToolPolicy::KeyHonouring
        )
    }
}

impl AsError for ToolError {
    fn as_error(&self) -> &(dyn Error + 'static) {
        self
    }
}

/// What a tool call's failure says of its side effect, as the classifier reads it.
impl ReportsOutcome for ToolError {
    fn outcome(&self) -> Outcome {
        verdict_of(self).outcome()
    }

    fn retry_after(&self) -> Option<Duration> {
        self.rpc().and_then(RpcError::retry_after)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use backstop_core::{AttemptTimedOut, BoxError, CircuitOpen, CircuitState, Dependency};
    use serde_json::json;
    use std::time::Duration;

    fn rpc(code: i64) -> ToolError {
        ToolError::Rpc(RpcError::new(code, "x"))
    }

    fn verdict(e: ToolError) -> Verdict {
        let boxed: BoxError = Box::new(e);
        Classify::<ToolCall, ToolResult, BoxError>::classify(&McpClassifier, Err(&boxed))
    }

    #[test]
    fn each_verdict() {
        let fatal = |outcome| Verdict::Fatal { outcome };
        let retry = |outcome| Verdict::Retryable {
            outcome,
            after: None,
        };
        for code in [
            codes::PARSE_ERROR,
            codes::INVALID_REQUEST,
            codes::METHOD_NOT_FOUND,
            codes::INVALID_PARAMS,
            codes::RESOURCE_NOT_FOUND,
            -32022,
            -32100,
            1,
        ] {
            assert_eq!(verdict(rpc(code)), fatal(Outcome::Completed), "{code}");
        }
        assert_eq!(verdict(rpc(codes::INTERNAL_ERROR)), retry(Outcome::Unknown));
        assert_eq!(verdict(rpc(-32000)), retry(Outcome::Unknown));
        assert_eq!(verdict(rpc(codes::OVERLOADED)), retry(Outcome::NotSent));
        assert_eq!(verdict(rpc(codes::KEY_IN_FLIGHT)), retry(Outcome::NotSent));
        assert_eq!(
            verdict(rpc(codes::REPLAY_UNAVAILABLE)),
            retry(Outcome::NotSent)
        );
        assert_eq!(verdict(rpc(codes::KEY_REUSED)), fatal(Outcome::NotSent));
        assert_eq!(
            verdict(rpc(codes::REPLAY_MISCONFIGURED)),
            fatal(Outcome::NotSent)
        );
        assert_eq!(
            verdict(rpc(codes::OUTCOME_UNKNOWN)),
            fatal(Outcome::Unknown)
        );
        assert_eq!(
            verdict(ToolError::NotSent("refused".into())),
            retry(Outcome::NotSent)
        );
        assert_eq!(
            verdict(ToolError::Lost("reset".into())),
            retry(Outcome::Unknown)
        );
        // A refused connection under a transport error is not sent, whatever wraps it.
        let io: BoxError = Box::new(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        assert_eq!(verdict(ToolError::Lost(io)), retry(Outcome::NotSent));
    }

    #[test]
    fn the_server_s_pushback_is_honoured() {
        let busy =
            RpcError::new(codes::OVERLOADED, "busy").with_data(json!({"retryAfterMs": 1500}));
        assert_eq!(
            verdict(ToolError::Rpc(busy)),
            Verdict::Retryable {
                outcome: Outcome::NotSent,
                after: Some(Duration::from_millis(1500))
            }
        );
        let secs =
            RpcError::new(codes::KEY_IN_FLIGHT, "busy").with_data(json!({"retryAfter": 7200}));
        assert_eq!(
            secs.retry_after(),
            Some(Duration::from_secs(3600)),
            "capped"
        );
    }

    #[test]
    fn backstop_s_own_errors_and_answers() {
        let timeout: BoxError = Box::new(AttemptTimedOut::new(None, Duration::from_secs(1)));
        assert_eq!(
            Classify::<ToolCall, ToolResult, BoxError>::classify(&McpClassifier, Err(&timeout)),
            Verdict::Retryable {
                outcome: Outcome::Unknown,
                after: None
            }
        );
        let open: BoxError = Box::new(CircuitOpen::new(
            Dependency::new("billing"),
            CircuitState::Open,
            None,
        ));
        assert_eq!(
            Classify::<ToolCall, ToolResult, BoxError>::classify(&McpClassifier, Err(&open)),
            Verdict::Fatal {
                outcome: Outcome::NotSent
            }
        );
        let answer = ToolResult::error_text("order not found");
        assert_eq!(
            Classify::<ToolCall, ToolResult, BoxError>::classify(&McpClassifier, Ok(&answer)),
            Verdict::Success
        );
        let other: BoxError = "something".into();
        assert_eq!(
            Classify::<ToolCall, ToolResult, BoxError>::classify(&McpClassifier, Err(&other)),
            Verdict::Fatal {
                outcome: Outcome::Unknown
            }
        );
    }

    #[test]
    fn replay_safety_follows_the_policy() {
        let call = |p| ToolCall::new("t", json!({})).unwrap().with_policy(p);
        let safe = |c: &ToolCall| {
            Classify::<ToolCall, ToolResult, BoxError>::is_replay_safe(&McpClassifier, c)
        };
        assert!(safe(&call(ToolPolicy::ReadOnly)));
        assert!(safe(&call(ToolPolicy::KeyHonouring)));
        assert!(!safe(&call(ToolPolicy::Standard)));
        assert!(!safe(&call(ToolPolicy::NeverRetry)));
    }
}
