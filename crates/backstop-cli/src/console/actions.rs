//! The operator's actions as forms: cancel a run, fork it from a step, and for a step send it
//! again, stub its result or resolve it. Each asks who and why, and records them as the CLI's
//! commands do; a refusal is shown with the journal's reason and nothing is written.

use super::{Console, encode, failed, may_act};
use crate::args::parse_json;
use axum::{
    Form,
    extract::{Path, State},
    http::{HeaderMap, StatusCode},
    response::{IntoResponse, Redirect, Response},
};
use backstop_journal::{JournalError, Resolution, StepId};
use serde::Deserialize;
use std::sync::Arc;

/// The fields every action's form has.
#[derive(Deserialize)]
pub(crate) struct Who {
    token: String,
    who: String,
    why: String,
}

impl Who {
    /// Both are said: each is recorded with the action.
    fn given(&self) -> bool {
        !self.who.trim().is_empty() && !self.why.trim().is_empty()
    }
}

/// A journal's refusal as the page an operator sees.
fn refused(e: JournalError) -> Response {
    super::journal_failed(&e)
}

fn back_to(run: &str) -> Response {
    Redirect::to(&format!("/runs/{}", encode(run))).into_response()
}

/// Runs the checks every action shares, then `act`.
async fn acting<F, Fut>(c: &Console, headers: &HeaderMap, who: &Who, act: F) -> Response
where
    F: FnOnce() -> Fut,
    Fut: Future<Output = Result<Response, Response>>,
{
    if let Err((status, message)) = may_act(c, headers, &who.token) {
        return failed(status, &message);
    }
    if !who.given() {
        return failed(
            StatusCode::BAD_REQUEST,
            "say who acts and why: both are recorded with the action",
        );
    }
    act().await.unwrap_or_else(|e| e)
}

/// `POST /runs/{run}/cancel`.
pub(crate) async fn cancel(
    State(c): State<Arc<Console>>,
    Path(run): Path<String>,
    headers: HeaderMap,
    Form(who): Form<Who>,
) -> Response {
    acting(&c, &headers, &who, || async {
        c.journal
            .cancel_run(&run, &who.who, &who.why)
            .await
            .map_err(refused)?;
        Ok(back_to(&run))
    })
    .await
}

#[derive(Deserialize)]
pub(crate) struct ForkForm {
    #[serde(flatten)]
    who: Who,
    from: String,
    new_run: String,
}

/// `POST /runs/{run}/fork`: the new run's page once it is made.
pub(crate) async fn fork(
    State(c): State<Arc<Console>>,
    Path(run): Path<String>,
    headers: HeaderMap,
    Form(f): Form<ForkForm>,
) -> Response {
    acting(&c, &headers, &f.who, || async {
        if f.new_run.trim().is_empty() {
            return Err(failed(StatusCode::BAD_REQUEST, "the new run needs an id"));
        }
        c.journal
            .fork_run(&run, &f.from, f.new_run.trim(), &f.who.who, &f.who.why)
            .await
            .map_err(refused)?;
        Ok(back_to(f.new_run.trim()))
    })
    .await
}

#[derive(Deserialize)]
pub(crate) struct StepForm {
    #[serde(flatten)]
    who: Who,
    #[serde(default)]
    call: String,
    #[serde(default)]
    result: String,
    #[serde(default)]
    resolution: String,
}

/// `POST /runs/{run}/steps/{step}/retry`.
pub(crate) async fn retry(
    State(c): State<Arc<Console>>,
    Path((run, step)): Path<(String, String)>,
    headers: HeaderMap,
    Form(f): Form<StepForm>,
) -> Response {
    acting(&c, &headers, &f.who, || async {
        let id = StepId::new(&run, &step, &f.call);
        c.journal
            .retry_step(&id, &f.who.who, &f.who.why)
            .await
            .map_err(refused)?;
        Ok(back_to(&run))
    })
    .await
}

/// `POST /runs/{run}/steps/{step}/stub`: the result must be JSON, as on the command line.
pub(crate) async fn stub(
    State(c): State<Arc<Console>>,
    Path((run, step)): Path<(String, String)>,
    headers: HeaderMap,
    Form(f): Form<StepForm>,
) -> Response {
    acting(&c, &headers, &f.who, || async {
        let result = parse_json(&f.result).map_err(|e| failed(StatusCode::BAD_REQUEST, &e))?;
        let id = StepId::new(&run, &step, &f.call);
        c.journal
            .stub_step(&id, &result, &f.who.who, &f.who.why)
            .await
            .map_err(refused)?;
        Ok(back_to(&run))
    })
    .await
}

/// `POST /runs/{run}/steps/{step}/resolve`: succeeded (with an optional JSON result), failed,
/// or sent again.
pub(crate) async fn resolve(
    State(c): State<Arc<Console>>,
    Path((run, step)): Path<(String, String)>,
    headers: HeaderMap,
    Form(f): Form<StepForm>,
) -> Response {
    acting(&c, &headers, &f.who, || async {
        let resolution = match f.resolution.as_str() {
            "succeeded" if f.result.trim().is_empty() => Resolution::Succeeded { result: None },
            "succeeded" => Resolution::Succeeded {
                result: Some(
                    parse_json(&f.result).map_err(|e| failed(StatusCode::BAD_REQUEST, &e))?,
                ),
            },
            "failed" => Resolution::Failed,
            "retry" => Resolution::Retry,
            other => {
                return Err(failed(
                    StatusCode::BAD_REQUEST,
                    &format!("{other:?} is no resolution: succeeded, failed or retry"),
                ));
            }
        };
        let id = StepId::new(&run, &step, &f.call);
        c.journal
            .resolve(&id, resolution, &f.who.who, &f.who.why)
            .await
            .map_err(refused)?;
        Ok(back_to(&run))
    })
    .await
}
