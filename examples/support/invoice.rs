//! An invoice workflow: create an invoice, reserve inventory, send the email, each step
//! journaled, each call through the Backstop stack over hyper-util, against three loopback
//! services.
//!
//! The services ([`World`]) run in the parent process; the workflow runs in a child process
//! ([`worker_main`], `examples/support/bin/invoice_worker.rs`) so that it can be killed with SIGKILL at any
//! point ([`KillAt`]): before the first step, between two journal writes, in the service just
//! after it acted and before it answers, between two steps, after the last one, while another
//! worker recovers the run, while the run waits for a parked step. Another worker process,
//! running the journal's [`Worker`] loop and nothing else, claims the run once the dead one's
//! lease has run out: it reconciles every step whose outcome is unknown with its service
//! (billing and the mailer by key, inventory by the order it reserved for) before sending
//! anything again, and runs the workflow from the top (done steps return their results).
//!
//! Billing honours idempotency keys; inventory and the mailer do not (each `POST` reserves or
//! sends once more), which is what makes reconciliation, not the key, the guard there.

use backstop::{Backstop, BackstopService, BoxError, Outcome};
use backstop_journal::{
    CallResult, Journal, JournalError, Reconciled, Reconcilers, Resolution, RunContext, RunEnd,
    Step, StepState, Worker, WorkflowResult,
};
use backstop_testkit::{Action, Seen, TestServer};
use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::{Client, connect::HttpConnector};
use std::{
    path::{Path, PathBuf},
    process::{Command, ExitStatus},
    sync::{Arc, Mutex},
    time::Duration,
};
use tower::ServiceExt;

/// The workflow's steps: (step, tool).
pub const STEPS: [(&str, &str); 3] = [
    ("create-invoice", "billing"),
    ("reserve-inventory", "inventory"),
    ("send-email", "mailer"),
];

/// Where a worker is killed: `run:start` (the run claimed, before its first step), or
/// `<step>:<point>`, the point one of `sent` (after the step is written as `sent`, before the
/// call), `effect` (in the service, after it acted, before it
/// answers) or `recorded` (after the outcome is written: between two steps, or after the last
/// one before the run is finished). Two more are for a worker that recovers a run:
/// `reconcile:<tool>` (in the reconcile hook, while it asks the service) and `run:deferred`
/// (the run deferred to a parked step's time, the worker waiting for it).
pub type KillAt = String;

/// Every kill point a run passes on its way, in order.
pub fn kill_points() -> Vec<KillAt> {
    let mut points = vec!["run:start".to_owned()];
    for (step, _) in STEPS {
        for point in ["sent", "effect", "recorded"] {
            points.push(format!("{step}:{point}"));
        }
    }
    points
}

/// What the services did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Effects {
    /// Invoices created.
    pub invoices: usize,
    /// Inventory reservations made.
    pub reservations: usize,
    /// Emails sent.
    pub messages: usize,
}

impl Effects {
    /// Effects beyond one of each: duplicates.
    pub fn duplicates(&self) -> usize {
        self.invoices.saturating_sub(1)
            + self.reservations.saturating_sub(1)
            + self.messages.saturating_sub(1)
    }
}

#[derive(Debug, Default)]
struct Ledger {
    /// (idempotency key, invoice id)
    invoices: Vec<(String, String)>,
    /// (order, reservation id)
    reservations: Vec<(String, String)>,
    /// (key, message id)
    messages: Vec<(String, String)>,
    /// The worker to kill after the named step's service acts.
    kill: Option<(String, u32)>,
    /// The mailer's lookup is down (503).
    mailer_lookup_down: bool,
    /// The mailer answers this many more sends with `503` and `Retry-After: 1`, doing nothing.
    mailer_busy: u32,
    /// The mailer refuses every send with `422`, doing nothing: the step fails for good.
    mailer_refuses: bool,
}

/// The billing, inventory and mailer services on 127.0.0.1.
#[derive(Debug)]
pub struct World {
    server: TestServer,
    ledger: Arc<Mutex<Ledger>>,
}

fn query<'a>(path: &'a str, name: &str) -> Option<&'a str> {
    let q = path.split_once('?')?.1;
    q.split('&')
        .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
}

fn json_field(body: &[u8], name: &str) -> Option<String> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    v.get(name)?.as_str().map(str::to_owned)
}

impl World {
    /// Starts the services.
    pub async fn start() -> World {
        let ledger: Arc<Mutex<Ledger>> = Arc::default();
        let l = ledger.clone();
        let server = TestServer::start(move |s: &Seen| World::answer(&l, s)).await;
        World { server, ledger }
    }

    fn answer(ledger: &Mutex<Ledger>, s: &Seen) -> Action {
        let mut l = ledger.lock().expect("ledger");
        let key = s.header("idempotency-key").unwrap_or_default().to_owned();
        let found = |id: Option<&String>, field: &str| match id {
            Some(id) => Action::respond(200, &[], format!(r#"{{"{field}":"{id}"}}"#)),
            None => Action::respond(404, &[], "{}"),
        };
        let path = s.path.as_str();
        let (acted, reply) = match (s.method.as_str(), path.split('?').next().unwrap_or("")) {
            ("POST", "/invoices") => {
                // Billing honours keys: a repeat gets the invoice the key made.
                let existing = l
                    .invoices
                    .iter()
                    .find(|(k, _)| !key.is_empty() && *k == key);
                let id = match existing {
                    Some((_, id)) => id.clone(),
                    None => {
                        let id = format!("inv_{}", l.invoices.len() + 1);
                        l.invoices.push((key.clone(), id.clone()));
                        id
                    }
                };
                (
                    "create-invoice",
                    Action::respond(201, &[], format!(r#"{{"invoice":"{id}"}}"#)),
                )
            }
            ("GET", "/invoices") => {
                let k = query(path, "key").unwrap_or_default();
                return found(
                    l.invoices.iter().find(|(kk, _)| kk == k).map(|(_, id)| id),
                    "invoice",
                );
            }
            ("POST", "/reservations") => {
                // Inventory reserves again on every POST: no key support.
                let order = json_field(&s.body, "order").unwrap_or_default();
                let id = format!("res_{}", l.reservations.len() + 1);
                l.reservations.push((order, id.clone()));
                (
                    "reserve-inventory",
                    Action::respond(201, &[], format!(r#"{{"reservation":"{id}"}}"#)),
                )
            }
            ("GET", "/reservations") => {
                let o = query(path, "order").unwrap_or_default();
                return found(
                    l.reservations
                        .iter()
                        .find(|(oo, _)| oo == o)
                        .map(|(_, id)| id),
                    "reservation",
                );
            }
            ("POST", "/messages") if l.mailer_refuses => {
                return Action::respond(422, &[], r#"{"error":"the address bounced"}"#);
            }
            ("POST", "/messages") if l.mailer_busy > 0 => {
                l.mailer_busy -= 1;
                return Action::respond(503, &[("retry-after", "1")], "{}");
            }
            ("POST", "/messages") => {
                // The mailer sends again on every POST; it keeps the key for lookups only.
                let id = format!("msg_{}", l.messages.len() + 1);
                l.messages.push((key.clone(), id.clone()));
                (
                    "send-email",
                    Action::respond(202, &[], format!(r#"{{"message":"{id}"}}"#)),
                )
            }
            ("GET", "/messages") if l.mailer_lookup_down => return Action::status(503),
            ("GET", "/messages") => {
                let k = query(path, "key").unwrap_or_default();
                return found(
                    l.messages.iter().find(|(kk, _)| kk == k).map(|(_, id)| id),
                    "message",
                );
            }
            _ => return Action::status(404),
        };
        if let Some((step, pid)) = l.kill.clone()
            && step == acted
        {
            // It acted; the worker dies before it hears so.
            l.kill = None;
            drop(l);
            kill(pid);
        }
        reply
    }

    /// The services' base URL.
    pub fn url(&self) -> String {
        self.server.url("")
    }

    /// Kills worker `pid` with SIGKILL right after `step`'s service has acted, before it
    /// answers.
    pub fn kill_after_effect(&self, step: &str, pid: u32) {
        self.ledger.lock().expect("ledger").kill = Some((step.to_owned(), pid));
    }

    /// The mailer turns the next `sends` emails away with `503` and `Retry-After: 1`.
    pub fn make_mailer_busy(&self, sends: u32) {
        self.ledger.lock().expect("ledger").mailer_busy = sends;
    }

    /// The mailer refuses every send (`422`, nothing sent) while `refuses` holds.
    pub fn make_mailer_refuse(&self, refuses: bool) {
        self.ledger.lock().expect("ledger").mailer_refuses = refuses;
    }

    /// Takes the mailer's lookup down: a step it must reconcile goes to a person.
    pub fn take_mailer_lookup_down(&self) {
        self.ledger.lock().expect("ledger").mailer_lookup_down = true;
    }

    /// What the services did so far.
    pub fn effects(&self) -> Effects {
        let l = self.ledger.lock().expect("ledger");
        Effects {
            invoices: l.invoices.len(),
            reservations: l.reservations.len(),
            messages: l.messages.len(),
        }
    }
}

/// SIGKILL, from outside the process's own control, as an operator or the OOM killer would.
pub fn kill(pid: u32) {
    // Once kill(2) has run, the process executes no more of its own code: it cannot read a
    // reply sent after this.
    let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
}

/// Starts a worker process (`exe worker DB URL RUN [KILL_AT|-] [naive]`; DB a SQLite path or a
/// `postgres://` URL) and returns it.
pub fn spawn_worker(
    exe: &Path,
    db: &str,
    url: &str,
    run: &str,
    kill_at: Option<&str>,
    naive: bool,
) -> std::process::Child {
    let mut cmd = Command::new(exe);
    cmd.arg("worker")
        .arg(db)
        .arg(url)
        .arg(run)
        .arg(kill_at.unwrap_or("-"));
    if naive {
        cmd.arg("naive");
    }
    cmd.spawn().expect("the worker starts")
}

/// How a worker ended, from its exit status: 0 done, 4 a step needs a person.
pub fn worker_exit(status: ExitStatus) -> Result<i32, String> {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => Ok(code),
        (None, Some(9)) => Err("killed".into()),
        (None, sig) => Err(format!("ended by signal {sig:?}")),
    }
}

/// A fresh journal file.
pub fn fresh_db(dir: &Path) -> PathBuf {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).expect("a directory for the journal");
    dir.join("journal.db")
}

/// The worker's entry: `worker DB URL RUN KILL_AT [naive]` (after the program name): starts
/// the run (again: the same start is the same run) and runs a [`Worker`] until it has handled
/// it. Exit codes: 0 the run succeeded, 3 it could not be claimed within 20 s, 4 it waits for
/// a person, 5 it failed, 6 it was cancelled, 1 anything else.
pub fn worker_main(args: &[String]) -> i32 {
    let [db, url, run, kill_at, rest @ ..] = args else {
        eprintln!("usage: worker DB URL RUN KILL_AT|- [naive]");
        return 2;
    };
    let kill_at = (kill_at != "-").then(|| kill_at.clone());
    let naive = rest.first().is_some_and(|a| a == "naive");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    match rt.block_on(work(db, url, run, kill_at.as_deref(), naive)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("worker: {e}");
            1
        }
    }
}

fn checkpoint(kill_at: Option<&str>, step: &str, point: &str) {
    if kill_at == Some(&format!("{step}:{point}")) {
        kill(std::process::id());
        // Not reached: the signal is taken on the way back from waiting for `kill`. Were it
        // not, the test would see SIGABRT instead of SIGKILL and say so.
        std::process::abort();
    }
}

type Stack = BackstopService<
    Client<HttpConnector, Full<Bytes>>,
    backstop::classify::HttpClassifier,
    backstop::retry::HttpResend,
    backstop::idempotency::HttpKeys,
>;

struct Tools {
    billing: Stack,
    inventory: Stack,
    mailer: Stack,
    url: String,
}

impl Tools {
    fn new(url: &str) -> Result<Tools, BoxError> {
        let client =
            Client::builder(hyper_util::rt::TokioExecutor::new()).build_http::<Full<Bytes>>();
        let stack = |name: &str, honours_keys: bool| -> Result<Stack, BoxError> {
            let mut b = Backstop::http(name)
                .p99(Duration::from_millis(200))
                .deadline(Duration::from_secs(5));
            if honours_keys {
                b = b.honours_keys();
            }
            Ok(tower::Layer::layer(&b.build()?, client.clone()))
        };
        Ok(Tools {
            billing: stack("billing", true)?,
            inventory: stack("inventory", false)?,
            mailer: stack("mailer", false)?,
            url: url.trim_end_matches('/').to_owned(),
        })
    }

    fn stack(&self, tool: &str) -> Stack {
        match tool {
            "billing" => self.billing.clone(),
            "inventory" => self.inventory.clone(),
            _ => self.mailer.clone(),
        }
    }

    /// Sends a step's request, with its key, and says how it ended.
    async fn call(&self, step: &Step, path: &str, body: String, id_field: &str) -> CallResult {
        let req = Request::post(format!("{}{path}", self.url))
            .header("content-type", "application/json")
            .header("idempotency-key", &step.key)
            .body(Full::new(Bytes::from(body)))
            .expect("a request");
        match self.stack(&step.tool).oneshot(req).await {
            Ok(res) if res.status().is_success() => {
                let body = match res.into_body().collect().await {
                    Ok(b) => b.to_bytes(),
                    Err(e) => {
                        return CallResult::Failed {
                            outcome: Outcome::Unknown,
                            error: format!("the reply's body was lost: {e}"),
                            retry_after: None,
                        };
                    }
                };
                CallResult::Succeeded {
                    provider_ref: json_field(&body, id_field),
                    result: Some(String::from_utf8_lossy(&body).into_owned()),
                }
            }
            Ok(res) => {
                // A 429 or 503 that says when to come back was not acted on: the step parks.
                let retry_after = res
                    .headers()
                    .get(http::header::RETRY_AFTER)
                    .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
                    .map(Duration::from_secs)
                    .filter(|_| matches!(res.status().as_u16(), 429 | 503));
                CallResult::Failed {
                    outcome: match retry_after {
                        Some(_) => Outcome::NotSent,
                        None if res.status().is_server_error() => Outcome::Unknown,
                        None => Outcome::Completed,
                    },
                    error: format!("{} answered {}", step.tool, res.status()),
                    retry_after,
                }
            }
            Err(e) => CallResult::from_result::<(), _>(&Err(e), |_| None),
        }
    }

    /// Asks a service what became of a step: billing and the mailer by key, inventory by the
    /// order (its business identity, from the run's input).
    async fn lookup(&self, step: &Step, order: &str) -> Reconciled {
        let path = match step.tool.as_str() {
            "billing" => format!("/invoices?key={}", step.key),
            "inventory" => format!("/reservations?order={order}"),
            _ => format!("/messages?key={}", step.key),
        };
        let req = Request::get(format!("{}{path}", self.url))
            .body(Full::default())
            .expect("a request");
        match self.stack(&step.tool).oneshot(req).await {
            Ok(res) if res.status() == 404 => Reconciled::NotHappened,
            Ok(res) if res.status().is_success() => {
                let body = res
                    .into_body()
                    .collect()
                    .await
                    .map(|b| b.to_bytes())
                    .unwrap_or_default();
                let field = match step.tool.as_str() {
                    "billing" => "invoice",
                    "inventory" => "reservation",
                    _ => "message",
                };
                Reconciled::Happened {
                    provider_ref: json_field(&body, field),
                    result: Some(String::from_utf8_lossy(&body).into_owned()),
                }
            }
            Ok(res) => Reconciled::CannotTell {
                why: format!("{} answered {} to the lookup", step.tool, res.status()),
            },
            Err(e) => Reconciled::CannotTell {
                why: format!("the lookup failed: {e}"),
            },
        }
    }
}

/// How long a worker's claim on its run lasts without renewal: a run whose worker died is
/// free for another after this (short, for the demo and the crash test).
pub const LEASE: Duration = Duration::from_millis(800);

/// The workflow's name in the journal.
pub const WORKFLOW: &str = "invoice";

/// The order a run is for: its input's `order` (a run forked from another is for the same one).
fn order_of(input: Option<&str>) -> String {
    input
        .and_then(|i| json_field(i.as_bytes(), "order"))
        .unwrap_or_default()
}

/// The arguments of `step` for `order` (the email names the invoice, which a resumed run reads
/// back from the journal).
fn step_args(order: &str, step: &str, invoice: &str) -> String {
    match step {
        "create-invoice" => format!(r#"{{"order":"{order}","eur":40}}"#),
        "reserve-inventory" => format!(r#"{{"order":"{order}","sku":"sku-7","qty":1}}"#),
        _ => format!(r#"{{"to":"ana@example.com","invoice":"{invoice}"}}"#),
    }
}

/// The workflow: three journaled steps, each through the Backstop stack; `kill_at` names where
/// this process kills itself.
async fn invoice_workflow(
    ctx: RunContext,
    tools: Arc<Tools>,
    kill_at: Option<String>,
) -> WorkflowResult {
    let kill_at = kill_at.as_deref();
    checkpoint(kill_at, "run", "start");
    let order = order_of(ctx.input());
    let mut invoice = String::new();
    for (step, tool) in STEPS {
        let args = step_args(&order, step, &invoice);
        let (path, field) = match step {
            "create-invoice" => ("/invoices", "invoice"),
            "reserve-inventory" => ("/reservations", "reservation"),
            _ => ("/messages", "message"),
        };
        let (t, body) = (tools.clone(), args.clone());
        let done = ctx
            .step(step, tool, args.as_bytes(), |sent| async move {
                checkpoint(kill_at, step, "sent");
                t.call(&sent, path, body, field).await
            })
            .await?;
        checkpoint(kill_at, step, "recorded");
        if step == "create-invoice" {
            invoice = done.provider_ref.unwrap_or_default();
        }
    }
    Ok(Some(format!(r#"{{"invoice":"{invoice}"}}"#)))
}

/// What a runtime without reconciliation does with a resumed run: every step whose outcome is
/// unknown is sent again, without asking.
async fn resend_without_asking(journal: &Journal, run: &str) -> Result<(), JournalError> {
    for step in journal.runs().steps(run).await? {
        let unknown = matches!(
            step.state,
            StepState::Sent | StepState::Unknown | StepState::RequiresReconciliation
        );
        if unknown || step.attention.is_some() {
            journal
                .operator()
                .resolve(
                    &step.id,
                    Resolution::Retry,
                    "naive",
                    "resend without asking",
                )
                .await?;
        }
    }
    Ok(())
}

async fn work(
    db: &str,
    url: &str,
    run: &str,
    kill_at: Option<&str>,
    naive: bool,
) -> Result<i32, BoxError> {
    let journal = Journal::open(db).await?;
    let tools = Arc::new(Tools::new(url)?);
    // A run made by an operator (a fork) exists already, with its own input.
    if journal.runs().get(run).await?.is_none() {
        journal
            .start_run(run, WORKFLOW, Some(&format!(r#"{{"order":"ord-{run}"}}"#)))
            .await?;
    }
    let mut hooks = Reconcilers::new();
    if naive {
        resend_without_asking(&journal, run).await?;
    } else {
        for (_, tool) in STEPS {
            let (t, kill) = (tools.clone(), kill_at.map(str::to_owned));
            let j = journal.clone();
            hooks = hooks.tool(tool, move |s: &Step| {
                let (t, s, kill, j) = (t.clone(), s.clone(), kill.clone(), j.clone());
                async move {
                    // Killed while it recovers another worker's run.
                    checkpoint(kill.as_deref(), "reconcile", &s.tool);
                    let order = match j.runs().get(&s.id.run).await {
                        Ok(run) => order_of(run.and_then(|r| r.input).as_deref()),
                        Err(e) => {
                            return Reconciled::CannotTell {
                                why: format!("the run's order could not be read: {e}"),
                            };
                        }
                    };
                    t.lookup(&s, &order).await
                }
            });
        }
    }
    let (t, kill) = (tools.clone(), kill_at.map(str::to_owned));
    let worker = Worker::new(journal, &format!("worker-{}", std::process::id()))
        .workflow(WORKFLOW, move |ctx| {
            invoice_workflow(ctx, t.clone(), kill.clone())
        })
        .reconcilers(hooks)
        .lease(LEASE)
        .poll_interval(Duration::from_millis(50));
    // The worker loop is the only recovery: it claims the run once the dead worker's lease has
    // run out (or once a parked step is due), reconciles, and runs the workflow again.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        match worker.run_once().await? {
            Some(report) if report.run == run => match report.end {
                RunEnd::Succeeded { .. } => return Ok(0),
                RunEnd::NeedsHuman { why } => {
                    eprintln!("worker: {why}");
                    return Ok(4);
                }
                RunEnd::Deferred { why, .. } => {
                    eprintln!("worker: {why}; waiting for its time");
                    checkpoint(kill_at, "run", "deferred");
                }
                RunEnd::Released { why } => eprintln!("worker: {why}"),
                RunEnd::Failed { error } => {
                    eprintln!("worker: the run failed: {error}");
                    return Ok(5);
                }
                RunEnd::Cancelled => return Ok(6),
                other => eprintln!("worker: {other:?}"),
            },
            Some(_) => {}
            None if tokio::time::Instant::now() > deadline => return Ok(3),
            None => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

/// The operator's table for `run`, as `backstop journal show` prints it.
pub async fn show(db: &Path, run: &str) {
    let db = db.to_string_lossy().into_owned();
    backstop_cli::run(["backstop", "journal", "--db", &db, "show", run]).await;
}
