//! `backstop journal serve`: the journal in a browser. Server-rendered pages (runs, one run,
//! what needs a person) with no external assets, everything from a run escaped; the operator's
//! actions as forms that ask who and why and record them as the CLI does, refused unless the
//! console was started with `--allow-actions`, and guarded against cross-site requests (a
//! token per server in every form, and the browser's `Origin` and `Sec-Fetch-Site` checked).

mod actions;
mod error;
mod forms;
mod pages;

use crate::Failure;
use axum::{
    Router,
    http::{HeaderMap, HeaderValue, header},
    response::Response,
    routing::{get, post},
};
use backstop_journal::Journal;
use error::ConsoleError;
use std::{net::SocketAddr, sync::Arc};

/// What every page and action shares.
pub(crate) struct Console {
    pub(crate) journal: Journal,
    /// Whether the forms are shown and their posts accepted.
    pub(crate) allow_actions: bool,
    /// The token every form carries: a page of another site cannot know it.
    pub(crate) token: String,
}

/// The console's routes over `console`.
pub(crate) fn router(console: Arc<Console>) -> Router {
    Router::new()
        .route("/", get(pages::runs))
        .route("/stuck", get(pages::stuck))
        .route("/runs/{run}", get(pages::run))
        .route("/runs/{run}/cancel", post(actions::cancel))
        .route("/runs/{run}/fork", post(actions::fork))
        .route("/runs/{run}/steps/{step}/retry", post(actions::retry))
        .route("/runs/{run}/steps/{step}/stub", post(actions::stub))
        .route("/runs/{run}/steps/{step}/resolve", post(actions::resolve))
        .layer(axum::middleware::map_response(secure))
        .with_state(console)
}

/// Every answer: nothing loaded from elsewhere, nothing framed, nothing sniffed.
async fn secure(mut res: Response) -> Response {
    let h = res.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; \
             frame-ancestors 'none'; base-uri 'none'",
        ),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    // `same-origin`: the console's own forms carry its origin (with `no-referrer` a browser
    // sends `Origin: null`), and nothing leaves for another site.
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("same-origin"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    res
}

/// A token no other page can guess, from the operating system's randomness.
fn token() -> String {
    use rand::TryRng;
    let mut bytes = [0u8; 16];
    rand::rngs::SysRng
        .try_fill_bytes(&mut bytes)
        .expect("the operating system's randomness");
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Serves the console for `journal` on `listen` until the process is stopped.
pub(crate) async fn serve(
    journal: Journal,
    listen: SocketAddr,
    allow_actions: bool,
) -> Result<u8, Failure> {
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| Failure {
            code: 1,
            message: format!("cannot listen on {listen}: {e}"),
        })?;
    let addr = listener.local_addr().map_err(|e| Failure {
        code: 1,
        message: format!("cannot read the address listened on: {e}"),
    })?;
    let console = Arc::new(Console {
        journal,
        allow_actions,
        token: token(),
    });
    let mode = if allow_actions {
        "actions allowed"
    } else {
        "read-only; start with --allow-actions to act"
    };
    println!("the journal's console is on http://{addr}/ ({mode})");
    axum::serve(listener, router(console))
        .await
        .map_err(|e| Failure {
            code: 1,
            message: format!("the console stopped: {e}"),
        })?;
    Ok(0)
}

/// Whether a post may act at all, from what its headers say: actions allowed, and a browser
/// that says the request comes from this site (when it says where it comes from). The form's
/// token is checked with the form ([`actions::Acting`]).
pub(crate) fn may_act(console: &Console, headers: &HeaderMap) -> Result<(), ConsoleError> {
    if !console.allow_actions {
        return Err(ConsoleError::Forbidden(
            "this console is read-only: start it with --allow-actions to act on runs".into(),
        ));
    }
    let site = headers.get("sec-fetch-site").and_then(|v| v.to_str().ok());
    if site.is_some_and(|s| s != "same-origin" && s != "none") {
        return Err(ConsoleError::Forbidden(
            "refused: the request came from another site".into(),
        ));
    }
    if let (Some(origin), Some(host)) = (
        headers.get(header::ORIGIN).and_then(|v| v.to_str().ok()),
        headers.get(header::HOST).and_then(|v| v.to_str().ok()),
    ) && origin != format!("http://{host}")
    {
        return Err(ConsoleError::Forbidden(format!(
            "refused: the request came from {origin}, not from this console"
        )));
    }
    Ok(())
}

/// A run's id as one path segment.
pub(crate) fn encode(segment: &str) -> String {
    percent_encoding::utf8_percent_encode(segment, percent_encoding::NON_ALPHANUMERIC).to_string()
}
