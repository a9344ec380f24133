//! The status page (`GET /`) in a real headless Chromium (Debian's `chromium`, installed by
//! `scripts/setup.sh --test`): a node with a guest, a swap behind it and a query token, the page
//! dumped as the browser rendered it. Without the token in its address the page says `/status`
//! wants it; with `/#token=…` it shows the fold's figures as `/status` gives them, the swap, and
//! the lag history's samples as a sparkline. Every wait is on a condition (the fold level, the
//! page's first refresh rendered), bounded by a deadline that only stops a hung test.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use foldhost_core::kv::KvWriter as _;
use foldhost_core::status::StatusReport;
use foldhost_tests::*;

const BUCKET: &str = "page";

/// How long one Chromium run may take (a start, a page, a dump) before the test gives up on it.
const CHROMIUM_DEADLINE: Duration = Duration::from_secs(60);

/// Bounds every wait of the test (never reached by a passing one).
const HUNG: Duration = Duration::from_secs(120);

/// `chromium` on `PATH`, or the error that says how to install it: the test never skips.
fn chromium() -> anyhow::Result<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join("chromium"))
        .find(|p| p.is_file())
        .ok_or_else(|| {
            anyhow::anyhow!(
                "chromium is not on PATH: the status page is tested in a real headless Chromium. \
                 Install it with `scripts/setup.sh --test` (which `make test` runs), or \
                 `apt-get install chromium` on Debian"
            )
        })
}

/// A node that is killed when the test ends early (a passing test stops it cleanly first).
struct Node(std::process::Child);

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Runs headless Chromium with `args` in a profile of its own under `profiles`.
async fn run_chromium(
    browser: &Path,
    profiles: &Path,
    args: &[String],
) -> anyhow::Result<std::process::Output> {
    let profile = tempfile::tempdir_in(profiles)?;
    let mut cmd = tokio::process::Command::new(browser);
    cmd.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--no-default-browser-check",
        "--disable-extensions",
        "--disable-background-networking",
        "--disable-sync",
    ])
    .arg(format!("--user-data-dir={}", profile.path().display()))
    .args(args)
    .stdin(Stdio::null())
    .kill_on_drop(true);
    let out = tokio::time::timeout(CHROMIUM_DEADLINE, cmd.output())
        .await
        .map_err(|_| anyhow::anyhow!("chromium {args:?} took over {CHROMIUM_DEADLINE:?}"))??;
    anyhow::ensure!(
        out.status.success(),
        "chromium {args:?}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(out)
}

/// The DOM of `url` once the page's script ran for a few seconds of virtual time (its first
/// refresh included: virtual time stands still while a fetch is in flight).
async fn dump_dom(browser: &Path, profiles: &Path, url: &str) -> anyhow::Result<String> {
    let out = run_chromium(
        browser,
        profiles,
        &[
            "--virtual-time-budget=5000".into(),
            "--dump-dom".into(),
            url.into(),
        ],
    )
    .await?;
    Ok(String::from_utf8(out.stdout)?)
}

/// Dumps `url` until `rendered` holds of its DOM; returns that DOM.
async fn dump_until(
    browser: &Path,
    profiles: &Path,
    url: &str,
    rendered: impl Fn(&str) -> bool,
) -> anyhow::Result<String> {
    let deadline = Instant::now() + HUNG;
    loop {
        let dom = dump_dom(browser, profiles, url).await?;
        if rendered(&dom) {
            return Ok(dom);
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the page never rendered what was waited for; its last DOM:\n{dom}"
        );
    }
}

/// The start tag of the first element in `html` carrying `attr="value"`, and the text right after
/// it (up to the next tag), unescaped.
fn element<'a>(html: &'a str, attr: &str, value: &str) -> Option<(&'a str, String)> {
    let at = html.find(&format!("{attr}=\"{value}\""))?;
    let start = html[..at].rfind('<')?;
    let end = at + html[at..].find('>')?;
    let rest = &html[end + 1..];
    let text = &rest[..rest.find('<').unwrap_or(rest.len())];
    Some((&html[start..=end], unescape(text)))
}

/// The value of `name` in the start tag `tag`.
fn attribute<'a>(tag: &'a str, name: &str) -> Option<&'a str> {
    let needle = format!(" {name}=\"");
    let at = tag.find(&needle)? + needle.len();
    let len = tag[at..].find('"')?;
    Some(&tag[at..at + len])
}

/// Text as the DOM's serializer escaped it, unescaped.
fn unescape(s: &str) -> String {
    s.replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&nbsp;", "\u{a0}")
        .replace("&amp;", "&")
}

/// The section the page rendered for the fold of `bucket` (not the template it is cloned from,
/// which carries no `data-fold`).
fn fold_section<'a>(dom: &'a str, bucket: &str) -> Option<&'a str> {
    let at = dom.find(&format!("data-fold=\"{bucket}\""))?;
    let start = dom[..at].rfind("<section")?;
    let end = at + dom[at..].find("</section>")?;
    Some(&dom[start..end])
}

/// How many refreshes the page has rendered (`data-refreshes` on its list of folds).
fn refreshes(dom: &str) -> u64 {
    element(dom, "data-field", "folds")
        .and_then(|(tag, _)| attribute(tag, "data-refreshes")?.parse().ok())
        .unwrap_or(0)
}

/// The revision a put landed at.
fn revision(v: foldhost_core::kv::VersionToken) -> anyhow::Result<u64> {
    v.as_u64()
        .ok_or_else(|| anyhow::anyhow!("a put without a revision"))
}

/// `GET /status` with the query token, once it answers 200.
async fn status(addr: &str, token: &str) -> anyhow::Result<StatusReport> {
    let (code, body) =
        foldhost::serve::call_with_token(addr, "GET", "/status", b"", Some(token)).await?;
    anyhow::ensure!(code == 200, "/status: {code}");
    Ok(serde_json::from_slice(&body)?)
}

/// Polls `/status` until the fold is level with the stream through `last` (its last sequence read
/// too) and `more` holds.
async fn level(
    addr: &str,
    token: &str,
    last: u64,
    more: impl Fn(&StatusReport) -> bool,
) -> anyhow::Result<StatusReport> {
    let deadline = Instant::now() + HUNG;
    let mut seen = None;
    loop {
        if let Ok(s) = status(addr, token).await {
            if s.caught_up
                && s.lag == 0
                && s.applied_through == last
                && s.stream_last_sequence == Some(last)
                && !s.lag_history.is_empty()
                && more(&s)
            {
                return Ok(s);
            }
            seen = Some(s);
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the fold never got level through {last}: {seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// What the page shows in the fold's section, checked against `/status` read before the dump
/// (`before`) and after it (`after`): the figures equal (the fold is level and nothing is written
/// meanwhile), the sparkline draws the samples the page was given — a prefix of the later
/// history, at least as long as the earlier one.
fn check_fold(section: &str, before: &StatusReport, after: &StatusReport) -> anyhow::Result<()> {
    let text = |field: &str| -> anyhow::Result<String> {
        element(section, "data-field", field)
            .map(|(_, t)| t)
            .ok_or_else(|| anyhow::anyhow!("no data-field={field:?} in the fold's section"))
    };
    let shown = |v: Option<u64>| v.map_or_else(|| "\u{2014}".to_string(), |n| n.to_string());
    for (field, a, b) in [
        ("cursor", shown(before.cursor), shown(after.cursor)),
        ("lag", before.lag.to_string(), after.lag.to_string()),
        (
            "applied_through",
            before.applied_through.to_string(),
            after.applied_through.to_string(),
        ),
        ("seq", before.seq.to_string(), after.seq.to_string()),
        (
            "stream_last_sequence",
            shown(before.stream_last_sequence),
            shown(after.stream_last_sequence),
        ),
    ] {
        anyhow::ensure!(
            a == b,
            "{field} moved while the page was read: {a} then {b}"
        );
        anyhow::ensure!(
            text(field)? == a,
            "{field}: the page shows {:?}, /status says {a}",
            text(field)?
        );
    }
    anyhow::ensure!(text("bucket")? == BUCKET, "bucket: {:?}", text("bucket")?);
    anyhow::ensure!(text("state")? == "running", "state: {:?}", text("state")?);
    anyhow::ensure!(
        text("caught_up")? == "yes",
        "caught_up: {:?}",
        text("caught_up")?
    );
    let guest = after.guest.clone().unwrap_or_default();
    anyhow::ensure!(
        text("guest")? == guest,
        "guest: {:?}, /status: {guest:?}",
        text("guest")?
    );
    let contract = after.guest_contract.clone().unwrap_or_default();
    anyhow::ensure!(
        text("guest_contract")? == contract,
        "guest_contract: {:?}, /status: {contract:?}",
        text("guest_contract")?
    );
    // The swap, listed newest first: from the first guest to the second.
    let swaps = section
        .find("data-field=\"last_swaps\"")
        .map(|at| &section[at..])
        .and_then(|s| s.find("</ol>").map(|end| &s[..end]))
        .ok_or_else(|| anyhow::anyhow!("no list of swaps"))?;
    anyhow::ensure!(
        swaps.matches("<li").count() == after.last_swaps.len(),
        "the page lists {} swaps, /status {}: {swaps}",
        swaps.matches("<li").count(),
        after.last_swaps.len()
    );
    for s in &after.last_swaps {
        anyhow::ensure!(
            swaps.contains(&format!("{} \u{2192} {}", s.from, s.to)),
            "the swap {s:?} is not listed: {swaps}"
        );
    }
    // The sparkline: the samples it was given, one point each.
    let (svg, _) = element(section, "data-field", "lag_history")
        .ok_or_else(|| anyhow::anyhow!("no sparkline"))?;
    anyhow::ensure!(svg.starts_with("<svg"), "the sparkline is no SVG: {svg}");
    let samples: Vec<u64> = attribute(svg, "data-samples")
        .ok_or_else(|| anyhow::anyhow!("the sparkline has no samples: {svg}"))?
        .split(',')
        .filter(|s| !s.is_empty())
        .map(str::parse)
        .collect::<Result<_, _>>()?;
    anyhow::ensure!(
        samples.len() >= before.lag_history.len()
            && after.lag_history.starts_with(&samples)
            && !samples.is_empty(),
        "the sparkline's samples {samples:?}, /status's before {:?} and after {:?}",
        before.lag_history,
        after.lag_history
    );
    let period = attribute(svg, "data-period-s").unwrap_or_default();
    anyhow::ensure!(
        period == after.lag_history_period_s.to_string(),
        "sampled every {period} s, /status says {}",
        after.lag_history_period_s
    );
    let (line, _) = element(section, "data-field", "lag_line")
        .ok_or_else(|| anyhow::anyhow!("the sparkline has no line"))?;
    let points = attribute(line, "points").unwrap_or_default();
    anyhow::ensure!(
        points.split_whitespace().count() == samples.len(),
        "{} points for {} samples: {line}",
        points.split_whitespace().count(),
        samples.len()
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_status_page_shows_what_status_says_in_a_real_browser() -> anyhow::Result<()> {
    let browser = chromium()?;
    let h = Harness::start().await?;
    let kv = h.bucket_with_history(BUCKET, 10).await?;
    for i in 0..20 {
        kv.put(&format!("k.{i:02}"), format!("v{i}").into()).await?;
    }
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("fold");
    let profiles = tmp.path().join("chromium");
    std::fs::create_dir(&profiles)?;
    let addr = format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?);
    // A query token on loopback: `/status` wants it, the page reads it from its fragment.
    let token = "7".repeat(64);
    let token_file = tmp.path().join("query-token");
    std::fs::write(&token_file, &token)?;
    let mut node = Node(
        run_command(&h, BUCKET, &store, Some(&addr))
            .arg("--guest")
            .arg(guest_wasm("kvstore"))
            .arg("--query-token-file")
            .arg(&token_file)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?,
    );
    let first = revision(kv.put("k.last", "v".into()).await?)?;
    level(&addr, &token, first, |_| true).await?;
    // A swap, so the page has one to list.
    swap_to(&addr, "kvstore_v2", Some(&store.join("admin-token")))?;
    let last = revision(kv.put("k.after-swap", "v".into()).await?)?;
    let before = level(&addr, &token, last, |s| s.last_swaps.len() == 1).await?;

    // Without the token: the page loads (it holds no data) and says /status wants the token.
    let url = format!("http://{addr}/");
    let refused = dump_until(&browser, &profiles, &url, |dom| {
        element(dom, "data-field", "notice")
            .is_some_and(|(tag, _)| attribute(tag, "data-state") == Some("unauthorized"))
    })
    .await?;
    let (_, notice) = element(&refused, "data-field", "notice")
        .ok_or_else(|| anyhow::anyhow!("no notice: {refused}"))?;
    anyhow::ensure!(
        notice.contains("query token") && notice.contains("/#token="),
        "the notice: {notice}"
    );
    anyhow::ensure!(
        fold_section(&refused, BUCKET).is_none() && refreshes(&refused) == 0,
        "figures shown without the token: {refused}"
    );

    // With the token in the fragment: the figures, as /status gives them.
    let with_token = format!("http://{addr}/#token={token}");
    let dom = dump_until(&browser, &profiles, &with_token, |dom| {
        refreshes(dom) >= 1 && fold_section(dom, BUCKET).is_some()
    })
    .await?;
    let after = status(&addr, &token).await?;
    let artifacts = foldhost_bin().with_file_name("page-artifacts");
    std::fs::create_dir_all(&artifacts)?;
    let shot = artifacts.join("status-page.png");
    let screenshot = run_chromium(
        &browser,
        &profiles,
        &[
            "--virtual-time-budget=5000".into(),
            "--window-size=1280,1000".into(),
            format!("--screenshot={}", shot.display()),
            with_token.clone(),
        ],
    )
    .await;
    let checked = fold_section(&dom, BUCKET)
        .ok_or_else(|| anyhow::anyhow!("no section for the fold"))
        .and_then(|section| check_fold(section, &before, &after));
    if let Err(e) = checked {
        anyhow::bail!(
            "{e}\nscreenshot: {} ({})\nthe page's DOM:\n{dom}",
            shot.display(),
            screenshot.map_or_else(|e| format!("not taken: {e}"), |_| "taken".into())
        );
    }
    anyhow::ensure!(
        !dom.contains(&token),
        "the token is written into the page's DOM"
    );
    terminate(&mut node.0)?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_of_a_listener_serving_several_folds_shows_each_as_its_status_says()
-> anyhow::Result<()> {
    let browser = chromium()?;
    let h = Harness::start().await?;
    let buckets = ["page_one", "page_two"];
    let mut last = Vec::new();
    for (i, b) in buckets.iter().enumerate() {
        let kv = h.bucket(b).await?;
        for k in 0..=(3 * i + 2) {
            kv.put(&format!("k.{k}"), "v".into()).await?;
        }
        last.push(kv.positions().await?.last_sequence);
    }
    let tmp = tempfile::tempdir()?;
    let profiles = tmp.path().join("chromium");
    std::fs::create_dir(&profiles)?;
    let addr = format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?);
    let file = tmp.path().join("foldhost.toml");
    let mut text = format!("nats = \"{}\"\nlisten = \"{addr}\"\n", h.url());
    for b in buckets {
        text.push_str(&format!(
            "\n[[folds]]\nbucket = \"{b}\"\nstore = \"{}\"\n",
            tmp.path().join(b).display()
        ));
    }
    std::fs::write(&file, text)?;
    let mut node = Node(
        foldhost()
            .args(["run", "--config"])
            .arg(&file)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?,
    );
    let mut statuses = Vec::new();
    for (b, last) in buckets.iter().zip(&last) {
        let at = format!("{addr}/folds/{b}");
        statuses.push(
            wait_status(&at, |s| {
                s.caught_up && s.applied_through == *last && s.stream_last_sequence == Some(*last)
            })
            .await?,
        );
    }
    let dom = dump_until(&browser, &profiles, &format!("http://{addr}/"), |dom| {
        refreshes(dom) >= 1 && buckets.iter().all(|b| fold_section(dom, b).is_some())
    })
    .await?;
    for (b, s) in buckets.iter().zip(&statuses) {
        let section = fold_section(&dom, b).ok_or_else(|| anyhow::anyhow!("no {b}"))?;
        for (field, want) in [
            (
                "cursor",
                s.cursor.map(|c| c.to_string()).unwrap_or_default(),
            ),
            ("lag", s.lag.to_string()),
            ("applied_through", s.applied_through.to_string()),
        ] {
            let shown = element(section, "data-field", field).map(|(_, t)| t);
            anyhow::ensure!(
                shown.as_deref() == Some(want.as_str()),
                "{b} {field}: the page shows {shown:?}, /folds/{b}/status says {want}\n{dom}"
            );
        }
    }
    terminate(&mut node.0)?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_shows_the_followed_channel_and_every_state_bucket_as_status_says()
-> anyhow::Result<()> {
    let browser = chromium()?;
    let h = Harness::start().await?;
    let kv = h.bucket("page_channel").await?;
    kv.put("k.0", "v".into()).await?;
    let tmp = tempfile::tempdir()?;
    let profiles = tmp.path().join("chromium");
    std::fs::create_dir(&profiles)?;
    // The state-owning guest (two owned buckets), shipped on a channel.
    let out = foldhost()
        .args(["guest", "publish"])
        .arg(guest_wasm("state_owner"))
        .args(["--channel", "edge", "--nats", &h.url()])
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "publish: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let addr = format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?);
    let mut node = Node(
        run_command(&h, "page_channel", &tmp.path().join("fold"), Some(&addr))
            .args(["--guest-channel", "edge", "--node-id", "p1"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?,
    );
    let s = wait_status(&addr, |s| {
        s.caught_up
            && s.state_buckets.len() == 2
            && s.guest_channel
                .as_ref()
                .is_some_and(|c| c.state == "rolling" && c.judgement == "clean")
    })
    .await?;
    let c = s
        .guest_channel
        .clone()
        .ok_or_else(|| anyhow::anyhow!("no channel"))?;
    let dom = dump_until(&browser, &profiles, &format!("http://{addr}/"), |dom| {
        fold_section(dom, "page_channel").is_some_and(|f| {
            element(f, "data-field", "channel_state").is_some_and(|(_, t)| t == "rolling")
                && f.contains("data-bucket=\"tally\"")
        })
    })
    .await?;
    let section = fold_section(&dom, "page_channel").ok_or_else(|| anyhow::anyhow!("no fold"))?;
    let running = c.running.clone().unwrap_or_default();
    let release = c.release.to_string();
    for (field, want) in [
        ("channel_name", "edge"),
        ("channel_node", "p1"),
        ("channel_release", release.as_str()),
        ("channel_judgement", "clean"),
        ("channel_running", running.as_str()),
    ] {
        let shown = element(section, "data-field", field).map(|(_, t)| t);
        anyhow::ensure!(
            shown.as_deref() == Some(want),
            "{field}: shown {shown:?}, /status says {want:?}\n{section}"
        );
    }
    let (card, _) = element(section, "data-field", "channel_card")
        .ok_or_else(|| anyhow::anyhow!("no channel card"))?;
    anyhow::ensure!(
        !card.contains("hidden"),
        "the channel card is hidden: {card}"
    );
    for b in &s.state_buckets {
        let (_, text) = element(section, "data-bucket", &b.local)
            .ok_or_else(|| anyhow::anyhow!("no line for state bucket {}", b.local))?;
        let want = format!(
            "{} ({}, {}): applied {}, {} behind",
            b.local, b.bucket, b.access, b.applied_through, b.lag
        );
        anyhow::ensure!(
            text == want,
            "{}: shown {text:?}, /status says {want:?}",
            b.local
        );
    }
    terminate(&mut node.0)?;
    Ok(())
}
