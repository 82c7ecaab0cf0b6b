//! What a call asks before each attempt and tells after it, beside the policy's decision: the
//! budget's admission (client-side throttling).

use crate::{future::Call, parts::Retryable};
use backstop_classify::Verdict;
use backstop_core::BoxError;

impl<T: Retryable> Call<T> {
    /// Before an attempt: the throttle's admission; `Err` refuses it, nothing sent.
    pub(crate) fn before_attempt(&mut self) -> Result<(), BoxError> {
        if let Some(throttle) = &self.shared.settings.throttle {
            throttle.admit(&self.dependency)?;
        }
        Ok(())
    }

    /// Tells the throttle how a sent attempt ended.
    pub(crate) fn end_attempt(&mut self, verdict: Verdict) {
        if let (true, Some(throttle)) = (self.sent, &self.shared.settings.throttle) {
            throttle.observe(&self.dependency, &verdict);
        }
    }
}
