//! An agent runtime whose tool calls are not HTTP, under the same Backstop stack.
//!
//! The runtime's tools are a `tower::Service<ToolCall>`. A scripted model asks for a refund,
//! the first reply is lost on the way back (the refund was booked), and later the model
//! "helpfully" calls the same write tool again with the same arguments. The runtime derives one
//! idempotency key per action, sha256(run id, tool, RFC 8785 arguments), the stack retries the
//! lost reply with that key, and the payments tool recognises both repeats: one refund.
//!
//! Run it with `cargo run --example agent_tools`.

use backstop::{
    Backstop, BoxError, HasExtensions, Outcome, Preset,
    backoff::RngSource,
    classify::{AsError, Classify, Verdict},
    idempotency::{ActionContext, IdempotencyKey, KeyedRequest},
};
use std::{
    collections::HashMap,
    error::Error as StdError,
    fmt,
    sync::{Arc, Mutex},
};
use tower::{Layer, ServiceExt, service_fn};

/// One tool call, as the runtime passes it to its tools.
#[derive(Clone, Debug)]
struct ToolCall {
    run_id: String,
    step_id: String,
    call_id: String,
    tool: String,
    args: serde_json::Value,
    key: Option<IdempotencyKey>,
    extensions: http::Extensions,
}

impl ToolCall {
    fn new(run: &str, step: &str, call: &str, tool: &str, args: serde_json::Value) -> Self {
        let mut c = ToolCall {
            run_id: run.into(),
            step_id: step.into(),
            call_id: call.into(),
            tool: tool.into(),
            args,
            key: None,
            extensions: http::Extensions::new(),
        };
        // The runtime knows what action this is; the key is derived from it, once.
        let action =
            ActionContext::action_json(&c.run_id, &c.tool, &c.args).expect("JSON arguments");
        c.extensions.insert(action);
        c
    }
}

impl HasExtensions for ToolCall {
    fn extensions(&self) -> &http::Extensions {
        &self.extensions
    }
    fn extensions_mut(&mut self) -> &mut http::Extensions {
        &mut self.extensions
    }
}

impl KeyedRequest for ToolCall {
    fn needs_key(&self) -> bool {
        !self.tool.starts_with("get_")
    }
    fn idempotency_key(&self) -> Option<&IdempotencyKey> {
        self.key.as_ref()
    }
    fn set_idempotency_key(&mut self, key: IdempotencyKey) {
        self.key = Some(key);
    }
}

/// What a tool can fail with.
#[derive(Debug)]
enum ToolError {
    /// The reply was lost: the tool may have acted.
    LostReply,
    /// The arguments were rejected.
    Invalid(String),
}

impl fmt::Display for ToolError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ToolError::LostReply => f.write_str("the tool's reply was lost"),
            ToolError::Invalid(why) => write!(f, "invalid arguments: {why}"),
        }
    }
}

impl StdError for ToolError {}

#[derive(Debug)]
struct ToolResult {
    text: String,
    extensions: http::Extensions,
}

impl HasExtensions for ToolResult {
    fn extensions(&self) -> &http::Extensions {
        &self.extensions
    }
    fn extensions_mut(&mut self) -> &mut http::Extensions {
        &mut self.extensions
    }
}

/// The runtime's rules: a lost reply is retryable with an unknown outcome (so only with a key);
/// invalid arguments go back to the model.
#[derive(Clone, Debug)]
struct ToolRules;

impl<E: AsError> Classify<ToolCall, ToolResult, E> for ToolRules {
    fn classify(&self, result: Result<&ToolResult, &E>) -> Verdict {
        let Err(e) = result else {
            return Verdict::Success;
        };
        match e.as_error().downcast_ref::<ToolError>() {
            Some(ToolError::LostReply) => Verdict::Retryable {
                outcome: Outcome::Unknown,
                after: None,
            },
            Some(ToolError::Invalid(_)) => Verdict::Fatal {
                outcome: Outcome::Completed,
            },
            None => backstop::classify::classify_error(e.as_error()).unwrap_or(Verdict::Fatal {
                outcome: Outcome::Unknown,
            }),
        }
    }
    fn is_replay_safe(&self, call: &ToolCall) -> bool {
        call.key.is_some() || !call.needs_key()
    }
}

#[tokio::main(flavor = "current_thread", start_paused = true)]
pub(crate) async fn main() -> Result<(), BoxError> {
    // The payments tool: books refunds, remembers keys and replays results for repeats, and
    // loses its very first reply.
    let refunds: Arc<Mutex<Vec<String>>> = Arc::default();
    let results: Arc<Mutex<HashMap<IdempotencyKey, String>>> = Arc::default();
    let replies = Arc::new(Mutex::new(0u32));
    let (booked, stored) = (refunds.clone(), results.clone());
    let tools = service_fn(move |call: ToolCall| {
        let (booked, stored, replies) = (booked.clone(), stored.clone(), replies.clone());
        async move {
            if call.args["amount"].as_f64().is_none_or(|a| a <= 0.0) {
                return Err::<ToolResult, BoxError>(Box::new(ToolError::Invalid(
                    "amount must be positive".into(),
                )));
            }
            let key = call.key.clone().expect("write tools carry a key");
            let known = stored.lock().unwrap().get(&key).cloned();
            let text = match known {
                Some(text) => format!("{text} (replayed)"),
                None => {
                    let mut r = booked.lock().unwrap();
                    r.push(call.args.to_string());
                    let text = format!(
                        "refund R{} of {} issued for order {}",
                        r.len(),
                        call.args["amount"],
                        call.args["order_id"]
                    );
                    stored.lock().unwrap().insert(key, text.clone());
                    text
                }
            };
            let mut n = replies.lock().unwrap();
            *n += 1;
            if *n == 1 {
                return Err(Box::new(ToolError::LostReply) as BoxError);
            }
            Ok(ToolResult {
                text,
                extensions: http::Extensions::new(),
            })
        }
    });
    let runtime = Backstop::tools("payments-tool", ToolRules)
        .preset(Preset::Create)
        .rng(RngSource::seeded(7))
        .build()?
        .layer(tools);

    // The scripted model: refund, an invalid call, then the same refund again.
    let script = [
        ToolCall::new(
            "run-42",
            "step-1",
            "call-1",
            "issue_refund",
            serde_json::json!({"order_id": "A-7", "amount": 49.0}),
        ),
        ToolCall::new(
            "run-42",
            "step-2",
            "call-2",
            "issue_refund",
            serde_json::json!({"order_id": "A-7", "amount": -5}),
        ),
        ToolCall::new(
            "run-42",
            "step-3",
            "call-3",
            "issue_refund",
            serde_json::json!({"amount": 49, "order_id": "A-7"}),
        ),
    ];
    for call in script {
        let label = format!(
            "{}/{} {} {}",
            call.step_id, call.call_id, call.tool, call.args
        );
        match runtime.clone().oneshot(call).await {
            Ok(r) => println!("{label}\n   -> model sees: {}", r.text),
            Err(e) => println!("{label}\n   -> model sees: {e}"),
        }
    }
    let n = refunds.lock().unwrap().len();
    println!(
        "\nrefunds booked: {n} (the lost reply was retried with the same key; the model's repeat was a replay)"
    );
    assert_eq!(n, 1, "one refund");
    Ok(())
}
