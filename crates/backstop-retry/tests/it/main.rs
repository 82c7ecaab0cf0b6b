//! The retry layer's integration tests in one binary, a module per concern.

mod attempts;
mod hedge;
mod policy;
mod retry;

/// The last cause of a call's error, as its `source()` gives it.
trait SourceCause {
    fn source_cause(&self) -> &(dyn std::error::Error + 'static);
}

impl SourceCause for backstop_retry::Error {
    fn source_cause(&self) -> &(dyn std::error::Error + 'static) {
        std::error::Error::source(self).expect("a cause")
    }
}
