//! The composed stack with the step journal outside it.

use crate::BackstopLayer;
use backstop_classify::HttpClassifier;
use backstop_core::{Classify, Outcome, ReportsOutcome, Verdict};
use backstop_journal::{CallResult, Journal, JournalLayer, Judge};
use tower::layer::util::Stack;

/// Judges an HTTP call for the journal as the retry layer judges it: a success status is a
/// success; a `429` or a `503` with `Retry-After` was not acted on (the step parks until then);
/// other statuses are what [`HttpClassifier`] says of them (a `4xx` a final answer, a `5xx` an
/// unknown outcome); an error reports its own outcome.
#[derive(Clone, Debug, Default)]
pub struct HttpJudge {
    classifier: HttpClassifier,
}

impl<B, E> Judge<http::Response<B>, E> for HttpJudge
where
    E: ReportsOutcome + std::fmt::Display,
{
    fn judge(&self, result: &Result<http::Response<B>, E>) -> CallResult {
        let res = match result {
            Ok(res) => res,
            Err(_) => return CallResult::from_result(result, |_| None),
        };
        let verdict = Classify::<http::Request<()>, _, backstop_core::BoxError>::classify(
            &self.classifier,
            Ok(res),
        );
        let (outcome, retry_after) = match verdict {
            Verdict::Success => {
                return CallResult::Succeeded {
                    result: None,
                    provider_ref: None,
                };
            }
            Verdict::Retryable { outcome, after } => (outcome, after),
            Verdict::Fatal { outcome } => (outcome, None),
        };
        let outcome = if outcome == Outcome::Completed && res.status().is_server_error() {
            Outcome::Unknown
        } else {
            outcome
        };
        CallResult::Failed {
            outcome,
            error: format!("the dependency answered {}", res.status()),
            retry_after,
        }
    }
}

impl<P, I> BackstopLayer<HttpClassifier, P, I> {
    /// This stack with `journal` outside it: every call that carries a tool-call
    /// `ActionContext` (run, step and call ids) is one journaled step (`pending`, then `sent`
    /// before it goes, then its end, judged by [`HttpJudge`]), without the caller writing
    /// journal code. The step's key is the one the stack sends, so a resumed run sends the same.
    /// Errors are a [`JournaledError`](backstop_journal::JournaledError): the stack's own
    /// typed [`Error`](crate::Error), or the journal's refusal (a step already done, parked,
    /// or unknown and not yet reconciled).
    pub fn journaled(self, journal: Journal) -> Stack<Self, JournalLayer<HttpJudge>> {
        let journal = JournalLayer::new(journal)
            .tool(self.dependency().as_str())
            .judge(HttpJudge::default());
        Stack::new(self, journal)
    }
}
