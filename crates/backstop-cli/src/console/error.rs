//! What a console request that did not do what it asked is answered with: a status, and a page
//! that says why.

use super::pages::error_page;
use axum::{
    http::StatusCode,
    response::{IntoResponse, Response},
};
use backstop_core::plumbing::CauseChain;
use backstop_journal::{ErrorKind, JournalError};

/// Why a page or an action was not served.
#[derive(Debug)]
pub(crate) enum ConsoleError {
    /// Refused before anything was read or written: a read-only console, a post from another
    /// site, a stale form.
    Forbidden(String),
    /// The request is wrong (a form field, a query parameter).
    BadRequest(String),
    /// No such run.
    NotFound(String),
    /// The journal refused the action, or failed.
    Journal(JournalError),
}

impl From<JournalError> for ConsoleError {
    fn from(e: JournalError) -> Self {
        ConsoleError::Journal(e)
    }
}

impl IntoResponse for ConsoleError {
    fn into_response(self) -> Response {
        let (status, message) = match self {
            ConsoleError::Forbidden(m) => (StatusCode::FORBIDDEN, m),
            ConsoleError::BadRequest(m) => (StatusCode::BAD_REQUEST, m),
            ConsoleError::NotFound(m) => (StatusCode::NOT_FOUND, m),
            // The status from the error's kind, as the CLI's exit code is; its words with their
            // causes.
            ConsoleError::Journal(e) => {
                let status = match e.kind() {
                    ErrorKind::NotFound => StatusCode::NOT_FOUND,
                    ErrorKind::Refused => StatusCode::CONFLICT,
                    _ => StatusCode::SERVICE_UNAVAILABLE,
                };
                (status, CauseChain(&e).to_string())
            }
        };
        (status, error_page(status, &message)).into_response()
    }
}
