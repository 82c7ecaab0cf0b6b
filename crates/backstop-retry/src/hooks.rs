//! What a call asks before each attempt and tells after it, beside the policy's decision: the
//! budget's admission (client-side throttling) and the gate.

use crate::{future::Call, parts::Retryable};
use backstop_classify::Verdict;
use backstop_core::BoxError;

impl<T: Retryable> Call<T> {
    /// Before an attempt: the throttle's admission, then the gate's; `Err` refuses it, nothing
    /// sent.
    pub(crate) fn before_attempt(&mut self) -> Result<(), BoxError> {
        let settings = &self.shared.settings;
        if let Some(throttle) = &settings.throttle {
            throttle.admit(&self.dependency)?;
        }
        if let Some(gate) = &settings.gate {
            self.ticket = Some(gate.admit(&self.dependency)?);
        }
        Ok(())
    }

    /// Tells the gate and the throttle how the attempt ended (`None`: cancelled), once.
    pub(crate) fn end_attempt(&mut self, verdict: Option<Verdict>) {
        let settings = &self.shared.settings;
        if let (Some(ticket), Some(gate)) = (self.ticket.take(), &settings.gate) {
            gate.complete(&self.dependency, ticket, verdict, self.attempt_started);
        }
        if let (true, Some(throttle), Some(verdict)) = (self.sent, &settings.throttle, verdict) {
            throttle.observe(&self.dependency, &verdict);
        }
    }
}
