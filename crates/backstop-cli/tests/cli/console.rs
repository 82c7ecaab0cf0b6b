//! `backstop journal serve` in a real headless browser (Debian's Chromium through its
//! ChromeDriver, driven over WebDriver): the pages render a journal with runs in each state, a
//! cancel taken through its form shows in the run's events, a step named with HTML shows as
//! text, the read-only console offers no forms and refuses posts, and a post without the
//! console's token (another site's form) is refused. A screenshot of each page is written to
//! `target/console/`.

use backstop_core::Outcome;
use backstop_journal::{
    CallResult, Journal, Reconciled, Reconcilers, RunContext, RunError, Step, StepId, Worker,
};
use fantoccini::{ClientBuilder, Locator};
use std::{
    io::{BufRead, BufReader, Read, Write},
    net::TcpStream,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::Duration,
};

const HTML_STEP: &str = "<img src=x onerror=alert(1)><b>bold</b>";

/// A journal with a run in each state, one of them with a step named in HTML.
async fn write_runs(db: &Path) {
    let j = Journal::sqlite(db).await.unwrap();
    let ok = || async {
        CallResult::Succeeded {
            result: Some("{\"ok\":true}".into()),
            provider_ref: None,
        }
    };
    // succeeded, and failed with its step named in HTML: what their worker made of them
    for run in ["run-done", "run-failed"] {
        j.start_run(run, "invoice", Some("{}")).await.unwrap();
    }
    let worker =
        Worker::new(j.clone(), "worker-1").workflow("invoice", move |ctx: RunContext| async move {
            if ctx.run_id() == "run-done" {
                ctx.step("create-invoice", "billing", b"{}", |_| ok())
                    .await?;
                return Ok(Some("{\"invoice\":\"inv_1\"}".to_owned()));
            }
            ctx.step(HTML_STEP, "mailer", b"{}", |_| async {
                CallResult::Failed {
                    outcome: Outcome::Completed,
                    error: "mailer answered 422: <script>bounced</script>".into(),
                    retry_after: None,
                }
            })
            .await
            .map_err(|_| RunError::failed("the email bounced"))?;
            Ok(None)
        });
    assert_eq!(worker.run_until_idle().await.unwrap().len(), 2);
    // cancelled
    j.start_run("run-cancelled", "invoice", Some("{}"))
        .await
        .unwrap();
    j.operator()
        .cancel("run-cancelled", "ana", "a duplicate order")
        .await
        .unwrap();
    // needs a person: a step nobody can tell about
    j.start_run("run-human", "invoice", Some("{}"))
        .await
        .unwrap();
    j.execute(
        &StepId::new("run-human", "reserve", ""),
        "inventory",
        b"{}",
        |_| async {
            CallResult::Failed {
                outcome: Outcome::Unknown,
                error: "inventory did not answer within 2 s".into(),
                retry_after: None,
            }
        },
    )
    .await
    .unwrap();
    let hooks = Reconcilers::new().tool("inventory", |_: &Step| async {
        Reconciled::CannotTell {
            why: "inventory has no lookup by key".into(),
        }
    });
    j.reconcile_run("run-human", &hooks).await.unwrap();
    // pending
    j.start_run("run-pending", "invoice", Some("{}"))
        .await
        .unwrap();
    // pending, of another workflow
    j.start_run("run-shipping", "ship", Some("{}"))
        .await
        .unwrap();
}

/// A process the test started, killed when the test ends however it ends.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `backstop journal --db DB serve` on a free loopback port, and its base URL.
fn console(db: &Path, allow_actions: bool) -> (Running, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_backstop"));
    cmd.args(["journal", "--db"])
        .arg(db)
        .args(["serve", "--listen", "127.0.0.1:0"]);
    if allow_actions {
        cmd.arg("--allow-actions");
    }
    let mut child = cmd
        .stdout(Stdio::piped())
        .spawn()
        .expect("the console starts");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let url = line
        .split_whitespace()
        .find(|w| w.starts_with("http://"))
        .unwrap_or_else(|| panic!("no address in {line:?}"))
        .trim_end_matches('/')
        .to_owned();
    (Running(child), url)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// ChromeDriver on a free port, once it answers.
async fn chromedriver(tmp: &Path) -> (Running, String) {
    let port = free_port();
    let child = Command::new("chromedriver")
        .arg(format!("--port={port}"))
        .env("TMPDIR", tmp)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("chromedriver is installed (`scripts/test` installs it)");
    let running = Running(child);
    for _ in 0..200 {
        if TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return (running, format!("http://127.0.0.1:{port}"));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("chromedriver did not listen on {port}");
}

async fn browser(webdriver: &str) -> fantoccini::Client {
    let mut caps = serde_json::Map::new();
    caps.insert(
        "goog:chromeOptions".into(),
        serde_json::json!({
            "binary": "/usr/bin/chromium",
            "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     "--window-size=1400,1000"],
        }),
    );
    ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
        .capabilities(caps)
        .connect(webdriver)
        .await
        .expect("a headless Chromium session")
}

fn shots() -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/console");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

async fn shoot(b: &fantoccini::Client, name: &str) {
    let png = b.screenshot().await.unwrap();
    assert!(png.starts_with(b"\x89PNG"), "a PNG");
    std::fs::write(shots().join(format!("{name}.png")), png).unwrap();
}

/// The text of the page's first `css` element.
async fn text_of(b: &fantoccini::Client, css: &str) -> String {
    b.find(Locator::Css(css))
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// The page's text once it holds `needle` (a submitted form's answer arrives after the click
/// returns), or the text it holds after ten seconds.
async fn text_with(b: &fantoccini::Client, needle: &str) -> String {
    let mut text = String::new();
    for _ in 0..100 {
        // While the next page loads, the old body goes stale: read again.
        if let Ok(body) = b.find(Locator::Css("body")).await
            && let Ok(t) = body.text().await
        {
            text = t;
            if text.contains(needle) {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    text
}

/// A raw POST with the header `from` (`Origin: ...`, `Sec-Fetch-Site: ...`), as another
/// site's page would send it; its status.
fn post(base: &str, path: &str, body: &str, from: &str) -> u16 {
    let addr = base.trim_start_matches("http://");
    let mut s = TcpStream::connect(addr).unwrap();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\n{from}\r\n\
         Content-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    answer.split_whitespace().nth(1).unwrap().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_in_a_headless_browser() {
    let dir = backstop_testkit::scratch_dir("console");
    let db = dir.path().join("journal.db");
    write_runs(&db).await;
    let (_server, base) = console(&db, true);
    // Chromium keeps its profile and scoped directories under TMPDIR: this test's own.
    let browser_tmp = backstop_testkit::scratch_dir("console-chromium");
    let (_driver, webdriver) = chromedriver(browser_tmp.path()).await;
    let b = browser(&webdriver).await;

    // The runs, one in each state.
    b.goto(&format!("{base}/")).await.unwrap();
    let text = text_of(&b, "body").await;
    for want in [
        "run-done",
        "run-failed",
        "run-cancelled",
        "run-human",
        "run-pending",
    ] {
        assert!(text.contains(want), "{want} in\n{text}");
    }
    for state in ["succeeded", "failed", "cancelled", "needs_human", "pending"] {
        assert!(text.contains(state), "{state} in\n{text}");
    }
    shoot(&b, "runs").await;
    b.goto(&format!("{base}/?state=failed")).await.unwrap();
    let text = text_of(&b, "table").await;
    assert!(
        text.contains("run-failed") && !text.contains("run-done"),
        "{text}"
    );
    b.goto(&format!("{base}/?workflow=ship")).await.unwrap();
    let text = text_of(&b, "table").await;
    assert!(
        text.contains("run-shipping") && !text.contains("run-pending"),
        "{text}"
    );
    b.goto(&format!("{base}/?state=pending&workflow=invoice"))
        .await
        .unwrap();
    let text = text_of(&b, "table").await;
    assert!(
        text.contains("run-pending") && !text.contains("run-shipping"),
        "{text}"
    );

    // A step named in HTML, and an error holding a script, are text.
    b.goto(&format!("{base}/runs/run-failed")).await.unwrap();
    let text = text_of(&b, "body").await;
    assert!(text.contains(HTML_STEP), "the step's name as text:\n{text}");
    assert!(text.contains("<script>bounced</script>"), "{text}");
    assert!(
        b.find(Locator::Css("td b")).await.is_err(),
        "no <b> element made"
    );
    assert!(
        b.find(Locator::Css("td img")).await.is_err(),
        "no <img> element made"
    );
    shoot(&b, "run-failed").await;

    // What needs a person.
    b.goto(&format!("{base}/stuck")).await.unwrap();
    let text = text_of(&b, "body").await;
    assert!(
        text.contains("run-human") && text.contains("inventory has no lookup"),
        "{text}"
    );
    shoot(&b, "stuck").await;

    // The pending run cancelled through its form: it shows in the run's events.
    b.goto(&format!("{base}/runs/run-pending")).await.unwrap();
    let form = b
        .form(Locator::Css("form[action$='/cancel']"))
        .await
        .unwrap();
    form.set_by_name("who", "ana").await.unwrap();
    form.set_by_name("why", "the customer called it off")
        .await
        .unwrap();
    form.submit().await.unwrap();
    let text = text_with(&b, "cancelled by ana").await;
    assert!(
        text.contains("cancelled by ana: the customer called it off"),
        "the action in the run's events:\n{text}"
    );
    let record = Journal::sqlite(&db)
        .await
        .unwrap()
        .runs()
        .get("run-pending")
        .await
        .unwrap();
    assert_eq!(record.unwrap().state, backstop_journal::RunState::Cancelled);
    shoot(&b, "run-cancelled-through-the-form").await;

    // The failed run forked through its form, from its failed step.
    b.goto(&format!("{base}/runs/run-failed")).await.unwrap();
    let form = b.form(Locator::Css("form[action$='/fork']")).await.unwrap();
    form.set_by_name("new_run", "run-failed-again")
        .await
        .unwrap();
    form.set_by_name("who", "ana").await.unwrap();
    form.set_by_name("why", "the address is fixed")
        .await
        .unwrap();
    form.submit().await.unwrap();
    let text = text_with(&b, "Run run-failed-again").await;
    assert!(
        text.contains("Run run-failed-again") && text.contains("forked from run-failed"),
        "{text}"
    );
    shoot(&b, "run-forked").await;

    // Another site's page: with the console's token (read off this page) but another origin,
    // or a browser saying it comes from another site, and with this origin but no token: each
    // refused, nothing written. The same post from the console's own origin acts.
    b.goto(&format!("{base}/runs/run-human")).await.unwrap();
    let token = b
        .find(Locator::Css("input[name='token']"))
        .await
        .unwrap()
        .attr("value")
        .await
        .unwrap()
        .expect("the form carries the token");
    let cancel = "/runs/run-human/cancel";
    let with_token = format!("token={token}&who=eve&why=x");
    let origin = format!("Origin: {base}");
    for (body, from) in [
        (with_token.as_str(), "Origin: http://evil.example"),
        (with_token.as_str(), "Sec-Fetch-Site: cross-site"),
        ("token=guess&who=eve&why=x", origin.as_str()),
    ] {
        assert_eq!(post(&base, cancel, body, from), 403, "{from} {body}");
    }
    let state = |db: PathBuf| async move {
        let j = Journal::sqlite(&db).await.unwrap();
        j.runs().get("run-human").await.unwrap().unwrap().state
    };
    assert_eq!(
        state(db.clone()).await,
        backstop_journal::RunState::NeedsHuman
    );
    let ok = format!("token={token}&who=ana&why=the+order+is+void");
    assert_eq!(
        post(&base, cancel, &ok, &origin),
        303,
        "the console's own origin"
    );
    assert_eq!(
        state(db.clone()).await,
        backstop_journal::RunState::Cancelled
    );
    // The journal refuses a second cancel (the run is over): 409, as the CLI exits 4; a form
    // that does not say who and why is refused before the journal is asked.
    assert_eq!(
        post(&base, cancel, &ok, &origin),
        409,
        "refused by the journal"
    );
    let unsigned = format!("token={token}&who=&why=");
    assert_eq!(
        post(&base, cancel, &unsigned, &origin),
        400,
        "who and why are required"
    );
    b.close().await.unwrap();

    // Read-only: no forms, and a post is refused.
    let (_ro, ro) = console(&db, false);
    let b = browser(&webdriver).await;
    b.goto(&format!("{ro}/runs/run-human")).await.unwrap();
    assert!(
        b.find(Locator::Css("form[method='post']")).await.is_err(),
        "no forms"
    );
    let text = text_of(&b, "body").await;
    assert!(text.contains("Read-only"), "{text}");
    shoot(&b, "run-read-only").await;
    b.close().await.unwrap();
    assert_eq!(
        post(
            &ro,
            "/runs/run-human/cancel",
            "token=x&who=a&why=b",
            &format!("Origin: {ro}")
        ),
        403
    );
}
