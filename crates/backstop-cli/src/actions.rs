//! The operator's actions on the journal, each recorded with who and why: resolve a step,
//! cancel a run, send a failed step again, stub a step's result, fork a run from a step.

use crate::Failure;
use crate::args::{ResolveArgs, StepRef, Who};
use crate::render::print_json;
use backstop_journal::{Journal, Resolution};

/// `resolve`: repairs a step that is not over.
pub(crate) async fn resolve(j: &Journal, json: bool, r: ResolveArgs) -> Result<u8, Failure> {
    let resolution = if r.succeeded {
        Resolution::Succeeded { result: r.result }
    } else if r.failed {
        Resolution::Failed
    } else {
        Resolution::Retry
    };
    let id = r.step.id();
    if j.runs().step(&id).await?.is_none() {
        return Err(Failure {
            code: 3,
            message: format!(
                "step {id} is not in the journal (see `backstop journal show {}`)",
                r.step.run
            ),
        });
    }
    let who = &r.who;
    let step = j
        .operator()
        .resolve(&id, resolution, &who.by, &who.why)
        .await?;
    if json {
        print_json(&step);
    } else {
        println!(
            "step {id} is now {} (by {}: {})",
            step.state, who.by, who.why
        );
    }
    Ok(0)
}

/// `cancel`: no worker runs the run again.
pub(crate) async fn cancel(j: &Journal, json: bool, run: &str, who: Who) -> Result<u8, Failure> {
    let record = j.operator().cancel(run, &who.by, &who.why).await?;
    if json {
        print_json(&record);
    } else {
        println!("run {run} is cancelled (by {}: {})", who.by, who.why);
    }
    Ok(0)
}

/// `retry`: sends a failed step again with its key.
pub(crate) async fn retry(
    j: &Journal,
    json: bool,
    step: &StepRef,
    who: Who,
) -> Result<u8, Failure> {
    let id = step.id();
    let step = j.operator().retry(&id, &who.by, &who.why).await?;
    if json {
        print_json(&step);
    } else {
        println!(
            "step {id} is {} and will be sent again with key {} (by {}: {})",
            step.state, step.key, who.by, who.why
        );
    }
    Ok(0)
}

/// `stub`: writes the result the workflow will see for a step.
pub(crate) async fn stub(
    j: &Journal,
    json: bool,
    step: &StepRef,
    result: &str,
    who: Who,
) -> Result<u8, Failure> {
    let id = step.id();
    let step = j.operator().stub(&id, result, &who.by, &who.why).await?;
    if json {
        print_json(&step);
    } else {
        println!(
            "step {id} is {} with the result you gave (by {}: {})",
            step.state, who.by, who.why
        );
    }
    Ok(0)
}

/// `fork`: a new run from `from_step` on, the steps before it kept.
pub(crate) async fn fork(
    j: &Journal,
    json: bool,
    (run, from_step, new_run): (&str, &str, &str),
    who: Who,
) -> Result<u8, Failure> {
    let record = j
        .operator()
        .fork(run, from_step, new_run, &who.by, &who.why)
        .await?;
    if json {
        print_json(&record);
    } else {
        println!(
            "run {new_run} is {}: forked from run {run} at step {from_step}; the steps before it \
             keep their results, the rest run anew (by {}: {})",
            record.state, who.by, who.why
        );
    }
    Ok(0)
}
