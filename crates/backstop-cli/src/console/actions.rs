//! The operator's actions as forms: cancel a run, fork it from a step, and for a step send it
//! again, stub its result or resolve it. Each asks who and why, and records them as the CLI's
//! commands do; a refusal is shown with the journal's reason and nothing is written.

use super::{Console, ConsoleError, encode, may_act};
use crate::args::parse_json;
use axum::{
    Form,
    extract::{FromRequest, Path, Request, State},
    response::Redirect,
};
use backstop_journal::{Resolution, StepId};
use serde::{Deserialize, de::DeserializeOwned};
use std::sync::Arc;

/// The fields every action's form has.
#[derive(Deserialize)]
pub(crate) struct Who {
    token: String,
    who: String,
    why: String,
}

/// A form that carries [`Who`].
pub(crate) trait Signed {
    /// Who acts, why, and the form's token.
    fn who(&self) -> &Who;
}

impl Signed for Who {
    fn who(&self) -> &Who {
        self
    }
}

/// An action's form, once every check an action shares has passed: actions are allowed, the
/// post comes from this console (its headers, and the form's token), and it says who acts and
/// why. A handler that takes it runs only then; a refusal is the [`ConsoleError`] it gives.
pub(crate) struct Acting<T>(pub(crate) T);

impl<T> FromRequest<Arc<Console>> for Acting<T>
where
    T: Signed + DeserializeOwned + Send,
{
    type Rejection = ConsoleError;

    async fn from_request(req: Request, console: &Arc<Console>) -> Result<Self, ConsoleError> {
        may_act(console, req.headers())?;
        let Form(form) = Form::<T>::from_request(req, console)
            .await
            .map_err(|e| ConsoleError::BadRequest(e.body_text()))?;
        let who = form.who();
        if who.token != console.token {
            return Err(ConsoleError::Forbidden(
                "refused: the form's token is not this console's (reload the page)".into(),
            ));
        }
        if who.who.trim().is_empty() || who.why.trim().is_empty() {
            return Err(ConsoleError::BadRequest(
                "say who acts and why: both are recorded with the action".into(),
            ));
        }
        Ok(Acting(form))
    }
}

fn back_to(run: &str) -> Redirect {
    Redirect::to(&format!("/runs/{}", encode(run)))
}

/// `POST /runs/{run}/cancel`.
pub(crate) async fn cancel(
    State(c): State<Arc<Console>>,
    Path(run): Path<String>,
    Acting(who): Acting<Who>,
) -> Result<Redirect, ConsoleError> {
    c.journal
        .operator()
        .cancel(&run, &who.who, &who.why)
        .await?;
    Ok(back_to(&run))
}

#[derive(Deserialize)]
pub(crate) struct ForkForm {
    #[serde(flatten)]
    who: Who,
    from: String,
    new_run: String,
}

impl Signed for ForkForm {
    fn who(&self) -> &Who {
        &self.who
    }
}

/// `POST /runs/{run}/fork`: the new run's page once it is made.
pub(crate) async fn fork(
    State(c): State<Arc<Console>>,
    Path(run): Path<String>,
    Acting(f): Acting<ForkForm>,
) -> Result<Redirect, ConsoleError> {
    let new_run = f.new_run.trim();
    if new_run.is_empty() {
        return Err(ConsoleError::BadRequest("the new run needs an id".into()));
    }
    c.journal
        .operator()
        .fork(&run, &f.from, new_run, &f.who.who, &f.who.why)
        .await?;
    Ok(back_to(new_run))
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

impl Signed for StepForm {
    fn who(&self) -> &Who {
        &self.who
    }
}

/// `POST /runs/{run}/steps/{step}/retry`.
pub(crate) async fn retry(
    State(c): State<Arc<Console>>,
    Path((run, step)): Path<(String, String)>,
    Acting(f): Acting<StepForm>,
) -> Result<Redirect, ConsoleError> {
    let id = StepId::new(&run, &step, &f.call);
    c.journal
        .operator()
        .retry(&id, &f.who.who, &f.who.why)
        .await?;
    Ok(back_to(&run))
}

/// `POST /runs/{run}/steps/{step}/stub`: the result must be JSON, as on the command line.
pub(crate) async fn stub(
    State(c): State<Arc<Console>>,
    Path((run, step)): Path<(String, String)>,
    Acting(f): Acting<StepForm>,
) -> Result<Redirect, ConsoleError> {
    let result = parse_json(&f.result).map_err(ConsoleError::BadRequest)?;
    let id = StepId::new(&run, &step, &f.call);
    c.journal
        .operator()
        .stub(&id, &result, &f.who.who, &f.who.why)
        .await?;
    Ok(back_to(&run))
}

/// `POST /runs/{run}/steps/{step}/resolve`: succeeded (with an optional JSON result), failed,
/// or sent again.
pub(crate) async fn resolve(
    State(c): State<Arc<Console>>,
    Path((run, step)): Path<(String, String)>,
    Acting(f): Acting<StepForm>,
) -> Result<Redirect, ConsoleError> {
    let resolution = match f.resolution.as_str() {
        "succeeded" if f.result.trim().is_empty() => Resolution::Succeeded { result: None },
        "succeeded" => Resolution::Succeeded {
            result: Some(parse_json(&f.result).map_err(ConsoleError::BadRequest)?),
        },
        "failed" => Resolution::Failed,
        "retry" => Resolution::Retry,
        other => {
            return Err(ConsoleError::BadRequest(format!(
                "{other:?} is no resolution: succeeded, failed or retry"
            )));
        }
    };
    let id = StepId::new(&run, &step, &f.call);
    c.journal
        .operator()
        .resolve(&id, resolution, &f.who.who, &f.who.why)
        .await?;
    Ok(back_to(&run))
}
