//! What a call asks before each attempt and tells after it, beside the policy's decision: the
//! budget's admission (client-side throttling), the learned attempt limit, and the gate.

use crate::{future::Call, parts::Retryable};
use backstop_classify::Verdict;
use backstop_core::BoxError;
use std::time::Duration;

impl<T: Retryable> Call<T> {
    /// Before an attempt: the budget's admission (client-side throttling) and the learned
    /// limit (the fixed one otherwise); `Err` refuses it, nothing sent.
    pub(crate) fn before_attempt(&mut self) -> Result<Option<Duration>, BoxError> {
        let settings = &self.shared.settings;
        if let Some(throttle) = &settings.throttle {
            throttle.admit(&self.dependency)?;
        }
        let Some(latency) = settings.latency.as_ref().filter(|_| self.learned) else {
            return Ok(settings.attempt_timeout);
        };
        let limit = latency.timeout(&self.dependency, self.attempt);
        crate::obs::attempt_timeout(&self.dependency, limit);
        if let Some(span) = self.span.get() {
            span.record("attempt_timeout_ms", limit.as_millis() as u64);
        }
        Ok(Some(limit))
    }

    /// Tells the gate, the throttle and the latency record how the attempt ended (`None`:
    /// cancelled), once.
    pub(crate) fn end_attempt(&mut self, verdict: Option<Verdict>) {
        let settings = &self.shared.settings;
        if let (Some(ticket), Some(gate)) = (self.ticket.take(), &settings.gate) {
            gate.complete(&self.dependency, ticket, verdict, self.attempt_started);
        }
        if !self.sent {
            return;
        }
        if let (Some(throttle), Some(verdict)) = (&settings.throttle, verdict) {
            throttle.observe(&self.dependency, &verdict);
        }
        if let Some(latency) = &settings.latency
            && self.learned
            && verdict == Some(Verdict::Success)
        {
            latency.record(&self.dependency, self.attempt_started.elapsed());
        }
    }
}
