//! `foldhost status` and `dump`: a store's status, live from its listener or at rest, and its contents.

use super::*;

/// `foldhost status`.
#[derive(Args, Debug)]
#[command(group(clap::ArgGroup::new("source").required(true).args(["store", "listen"])))]
pub struct StatusArgs {
    /// Store directory (read-only; works beside a running host).
    #[arg(long)]
    pub store: Option<PathBuf>,
    /// A running host's `--listen` address (live figures).
    #[arg(long)]
    pub listen: Option<String>,
    /// A file holding the token `/status` needs on that listener: its query token (a listener
    /// beyond loopback has one, `STORE/query-token` unless given) or its admin token.
    #[arg(long, requires = "listen")]
    pub token_file: Option<PathBuf>,
    /// One JSON object.
    #[arg(long)]
    pub json: bool,
    /// Refresh every this many seconds (default 2, or `500ms`), one line per fold: state,
    /// positions, lag, rate, guest; under it the guest channel it follows, each state bucket and
    /// an artifact warning. On a terminal the screen is redrawn; otherwise each refresh appends
    /// its lines. Needs `--listen`.
    #[arg(long, value_name = "SECS", num_args = 0..=1, default_missing_value = "2", requires = "listen", conflicts_with = "json", value_parser = watch_period)]
    pub watch: Option<Duration>,
    /// With `--watch`: stop after this many refreshes (default: until interrupted).
    #[arg(long, value_name = "N", requires = "watch")]
    pub count: Option<u64>,
}

/// `--watch`'s period: seconds (a bare number, fractions allowed) or a `humantime` duration,
/// 100 ms to 1 h.
fn watch_period(s: &str) -> Result<Duration, String> {
    let d = match s.trim().parse::<f64>() {
        Ok(secs) if secs.is_finite() && secs >= 0.0 => Duration::from_secs_f64(secs),
        _ => humantime::parse_duration(s.trim()).map_err(|e| format!("{s:?}: {e}"))?,
    };
    if d < Duration::from_millis(100) || d > Duration::from_secs(3600) {
        return Err(format!("{s:?}: between 100ms and 1h"));
    }
    Ok(d)
}

/// One fold's line of `status --watch`: its name, state, cursor, applied_through, lag, the rate
/// its applied_through moved at since the last refresh (`None`: the first), retained records and
/// the guest. Pure.
pub(crate) fn watch_line(s: &StatusReport, rate: Option<f64>) -> String {
    let s = &StatusReport {
        bucket: terminal_safe(&s.bucket),
        guest: s.guest.as_deref().map(terminal_safe),
        ..s.clone()
    };
    let cursor = s.cursor.map_or_else(|| "-".to_string(), |c| c.to_string());
    let rate = rate.map_or_else(|| "-".to_string(), |r| format!("{r:.0}/s"));
    let behind = s
        .stream_last_sequence
        .unwrap_or(0)
        .max(s.seq)
        .saturating_sub(s.applied_through);
    format!(
        "{:<20} {:<8} cursor {:<10} applied {:<10} lag {:<8} {:>9} retained {:<5} {}",
        s.bucket,
        if s.state == "running" && !s.caught_up {
            "catching"
        } else {
            s.state.as_str()
        },
        cursor,
        s.applied_through,
        behind,
        rate,
        s.retained,
        s.guest.as_deref().unwrap_or("-")
    )
}

/// The lines under a fold's in `status --watch`: the guest channel it follows (release, rollout
/// state, this node's judgement, what it runs), each state bucket's position, and the newest
/// artifact's freshness when it is not fresh. Pure.
pub(crate) fn watch_detail(s: &StatusReport) -> Vec<String> {
    let mut out = watch_detail_raw(s);
    for line in &mut out {
        *line = format!("  {}", terminal_safe(line.trim_start()));
    }
    out
}

/// Most characters of one `status --watch` line taken from what the bus or a guest said.
const WATCH_LINE_MAX: usize = 240;

/// `s` as a terminal may print it: every control character (C0, C1, ESC) and bidirectional
/// override escaped, so a value from the bus can neither drive the terminal nor forge a line, and
/// cut at [`WATCH_LINE_MAX`] characters.
pub(crate) fn terminal_safe(s: &str) -> String {
    let mut out = String::new();
    let mut shown = 0usize;
    for c in s.chars() {
        let bidi = matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}');
        let piece: Vec<char> = if c.is_control() || bidi {
            c.escape_unicode().collect()
        } else {
            vec![c]
        };
        if shown + piece.len() > WATCH_LINE_MAX {
            out.push('…');
            break;
        }
        shown += piece.len();
        out.extend(piece);
    }
    out
}

fn watch_detail_raw(s: &StatusReport) -> Vec<String> {
    let mut out = Vec::new();
    if let Some(c) = &s.guest_channel {
        let judged = if c.judgement.is_empty() {
            "not judged".to_string()
        } else {
            format!("judged {}", c.judgement)
        };
        let halted = c
            .halted_by
            .as_deref()
            .map(|h| format!(" by {h}"))
            .unwrap_or_default();
        let wave = c
            .wave
            .as_deref()
            .map(|w| format!(" {w}"))
            .unwrap_or_default();
        out.push(format!(
            "  channel {} as {}: release {} {}{wave}{halted}, {judged}, runs {}{}",
            c.channel,
            c.node,
            c.release,
            c.state,
            c.running.as_deref().unwrap_or("-"),
            c.error
                .as_deref()
                .map(|e| format!(" ({e})"))
                .unwrap_or_default()
        ));
    }
    for b in &s.state_buckets {
        out.push(format!(
            "  state {:<16} {:<8} applied {:<10} lag {}{}",
            b.local,
            b.access,
            b.applied_through,
            b.lag,
            if b.declared {
                ""
            } else {
                " (no longer declared)"
            }
        ));
    }
    if let Some(w) = s.artifact.as_ref().and_then(|a| a.warning()) {
        out.push(format!("  {w}"));
    }
    out
}

/// The folds a `/status` answer describes: one report, or a listener's `{"folds": [...]}`.
fn reports(body: &[u8]) -> serde_json::Result<Vec<StatusReport>> {
    #[derive(serde::Deserialize)]
    struct Folds {
        folds: Vec<StatusReport>,
    }
    match serde_json::from_slice::<Folds>(body) {
        Ok(f) => Ok(f.folds),
        Err(_) => serde_json::from_slice::<StatusReport>(body).map(|s| vec![s]),
    }
}

/// `status --watch`: the host's status every `period`, `count` times (or until interrupted); a
/// refresh that cannot reach the host says so and the next one tries again.
pub(super) async fn cmd_status_watch(
    addr: &str,
    token_file: Option<&Path>,
    period: Duration,
    count: Option<u64>,
) -> anyhow::Result<()> {
    let token = token_file.map(crate::serve::read_token_file).transpose()?;
    let redraw = std::io::stdout().is_terminal();
    // Each fold's applied_through at the last refresh, by name, for its rate.
    let mut last: std::collections::BTreeMap<String, (std::time::Instant, u64)> =
        std::collections::BTreeMap::new();
    let mut tick = tokio::time::interval(period);
    let mut n = 0u64;
    while count.is_none_or(|c| n < c) {
        tick.tick().await;
        n += 1;
        let line = match crate::serve::call_with_token(
            addr,
            "GET",
            "/status",
            b"",
            token.as_deref(),
        )
        .await
        {
            Ok((200, body)) => match reports(&body) {
                Ok(folds) => {
                    let now = std::time::Instant::now();
                    let lines: Vec<String> = folds
                        .iter()
                        .map(|s| {
                            let rate = last.get(&s.bucket).map(|(at, applied)| {
                                s.applied_through.saturating_sub(*applied) as f64
                                    / now.duration_since(*at).as_secs_f64().max(1e-3)
                            });
                            last.insert(s.bucket.clone(), (now, s.applied_through));
                            std::iter::once(watch_line(s, rate))
                                .chain(watch_detail(s))
                                .collect::<Vec<_>>()
                                .join("\n")
                        })
                        .collect();
                    lines.join("\n")
                }
                Err(e) => format!("{addr}: unreadable status: {e}"),
            },
            Ok((401, _)) => bail!(
                "{addr}: /status needs a token: pass --token-file with the host's query token"
            ),
            Ok((code, _)) => format!("{addr}: /status answered {code}"),
            Err(e) => format!("{addr}: unreachable: {e}"),
        };
        let mut out = std::io::stdout().lock();
        if redraw {
            write!(out, "\x1b[2J\x1b[H")?;
        }
        writeln!(out, "{line}")?;
        out.flush()?;
    }
    Ok(())
}

/// `foldhost dump`.
#[derive(Args, Debug)]
pub struct DumpArgs {
    /// Store directory (read-only).
    #[arg(long)]
    pub store: PathBuf,
    /// Only keys with this prefix.
    #[arg(long, default_value = "")]
    pub prefix: String,
    /// One JSON object per line: {"key", "value_b64", "revision"}.
    #[arg(long)]
    pub json: bool,
}

pub(super) async fn cmd_status_live(
    addr: &str,
    token_file: Option<&Path>,
    json: bool,
) -> anyhow::Result<()> {
    let token = token_file.map(crate::serve::read_token_file).transpose()?;
    let (code, body) = crate::serve::call_with_token(addr, "GET", "/status", b"", token.as_deref())
        .await
        .with_context(|| format!("status via {addr}"))?;
    if code == 401 {
        bail!(
            "{addr}: /status needs a token: pass --token-file with the host's query token \
             (STORE/query-token unless it was given one) or its admin token"
        );
    }
    if code != 200 {
        bail!("{addr}: /status answered {code}");
    }
    let report: StatusReport = serde_json::from_slice(&body).context("status JSON")?;
    print_status(&report, json)
}

/// The status of a store at rest (read-only: works beside a running host): the fold's own figures,
/// and what the host last wrote in `status.json`.
pub(super) fn cmd_status(a: StatusArgs) -> anyhow::Result<()> {
    let Some(dir) = a.store.clone() else {
        bail!("status needs --store or --listen");
    };
    let (store, _recovery) = AnyStore::open_read_only(&dir)?;
    let cursor = store.cursor();
    let host = storedir::read_status(&dir).unwrap_or_else(|| StatusReport {
        state: "unknown".into(),
        ..StatusReport::default()
    });
    let retained = foldhost_core::retained::RetainedIndex::load(&store)?;
    let oldest = retained.oldest();
    let applied_through = retained.applied_through(cursor.revision()).unwrap_or(0);
    let seq = host.seq.max(cursor.revision_or_zero());
    let report = StatusReport {
        store: Some(dir.display().to_string()),
        backend: store.backend().to_string(),
        cursor: cursor.revision(),
        seq,
        applied_through,
        lag: foldhost_core::status::lag(seq, applied_through),
        retained: retained.len() as u64,
        oldest_retained_revision: oldest.map(|o| o.position()),
        oldest_retained_unix_ms: oldest.map(|o| o.retained_unix_ms),
        oldest_retained_age_s: oldest.and_then(|o| {
            foldhost_core::status::age_s(o.retained_unix_ms, foldhost_core::status::now_unix_ms())
        }),
        eviction_seen: cursor.memo().is_some(),
        keys: Some(foldhost_core::snapshot::bucket_len(&store)?),
        ..host
    };
    print_status(&report, a.json)
}

/// Prints a status: one JSON line, or `field: value` lines for a person.
pub(super) fn print_status(s: &StatusReport, json: bool) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    if json {
        serde_json::to_writer(&mut out, s)?;
        writeln!(out)?;
        return Ok(());
    }
    let opt = |v: Option<u64>| v.map_or_else(|| "none".to_string(), |v| v.to_string());
    if let Some(store) = &s.store {
        writeln!(out, "store:           {store}")?;
    }
    writeln!(out, "backend:         {}", s.backend)?;
    if !s.bucket.is_empty() {
        writeln!(out, "bucket:          {} (scope {})", s.bucket, s.scope)?;
    }
    writeln!(out, "cursor:          {}", opt(s.cursor))?;
    writeln!(out, "seq:             {}", s.seq)?;
    writeln!(out, "applied_through: {}", s.applied_through)?;
    writeln!(out, "lag:             {}", s.lag)?;
    if let Some(oldest) = s.oldest_retained_revision {
        writeln!(
            out,
            "retained:        {} (oldest revision {oldest}, {} s ago)",
            s.retained,
            s.oldest_retained_age_s.unwrap_or(0)
        )?;
    }
    for w in &s.warnings {
        writeln!(out, "warning:         {w}")?;
    }
    if let Some(keys) = s.keys {
        writeln!(out, "keys:            {keys}")?;
    }
    if s.eviction_seen {
        writeln!(
            out,
            "eviction_seen:   true (retention evicted current values; the bucket's listing is never trusted)"
        )?;
    }
    writeln!(
        out,
        "guest:           {}",
        s.guest.as_deref().unwrap_or("(none recorded)")
    )?;
    writeln!(out, "state:           {}", s.state)?;
    if let Some(e) = &s.error {
        writeln!(out, "error:           {e}")?;
    }
    if let Some(l) = &s.listen {
        writeln!(out, "listen:          {l}")?;
    }
    if let Some(f) = &s.admin_token_file {
        writeln!(out, "admin_token_file: {f}")?;
    }
    Ok(())
}

pub(super) fn cmd_dump(a: DumpArgs) -> anyhow::Result<()> {
    let (store, _recovery) = AnyStore::open_read_only(&a.store)?;
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    let mut err: Option<std::io::Error> = None;
    store.for_each_in_range(&a.prefix, &mut |e| {
        if foldhost_core::retained::is_reserved(&e.key) {
            return ControlFlow::Continue(());
        }
        let r = if a.json {
            let line = serde_json::json!({
                "key": e.key,
                "value_b64": base64::engine::general_purpose::STANDARD.encode(&e.value),
                "revision": e.version.as_u64(),
            });
            writeln!(out, "{line}")
        } else {
            writeln!(
                out,
                "{}\t{}\t{}",
                e.key,
                printable(&e.value),
                e.version
                    .as_u64()
                    .map_or("-".to_string(), |r| r.to_string())
            )
        };
        match r {
            Ok(()) => ControlFlow::Continue(()),
            Err(e) => {
                err = Some(e);
                ControlFlow::Break(())
            }
        }
    })?;
    if let Some(e) = err {
        // A closed pipe (`dump | head`) is not a failure of the dump.
        if e.kind() != std::io::ErrorKind::BrokenPipe {
            return Err(e.into());
        }
        return Ok(());
    }
    match out.flush() {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(()),
    }
}

/// Text form of a value: as-is when it is printable UTF-8, else `b64:` + base64.
pub(super) fn printable(v: &[u8]) -> String {
    match std::str::from_utf8(v) {
        Ok(s) if !s.chars().any(|c| c.is_control()) => s.to_string(),
        _ => format!(
            "b64:{}",
            base64::engine::general_purpose::STANDARD.encode(v)
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_watch_shows_the_channel_each_state_bucket_and_an_artifact_at_risk_under_its_fold() {
        let s = StatusReport {
            guest_channel: Some(foldhost_core::status::GuestChannelReport {
                channel: "edge".into(),
                node: "n1".into(),
                release: 7,
                state: "rolling".into(),
                judgement: "clean".into(),
                running: Some("kvstore@0.2.0".into()),
                ..Default::default()
            }),
            state_buckets: vec![foldhost_core::status::StateBucketReport {
                local: "notes".into(),
                bucket: "state_owner_notes".into(),
                access: "own".into(),
                declared: true,
                applied_through: 12,
                lag: 3,
                ..Default::default()
            }],
            artifact: Some(foldhost_core::status::ArtifactFreshnessReport {
                state: "stale".into(),
                key: "routes".into(),
                cursor: Some(10),
                stream_first_sequence: 20,
                ..Default::default()
            }),
            ..StatusReport::default()
        };
        let lines = watch_detail(&s);
        assert_eq!(
            lines[0],
            "  channel edge as n1: release 7 rolling, judged clean, runs kvstore@0.2.0"
        );
        assert!(
            lines[1].contains("notes")
                && lines[1].contains("applied 12")
                && lines[1].ends_with("lag 3"),
            "{lines:?}"
        );
        assert!(lines[2].contains("artifact routes: stale"), "{lines:?}");
        assert!(watch_detail(&StatusReport::default()).is_empty());
        // What the bus says cannot drive the terminal, forge a line or run on.
        let hostile = StatusReport {
            guest_channel: Some(foldhost_core::status::GuestChannelReport {
                channel: "edge".into(),
                running: Some("x\u{1b}]52;c;AAAA\u{7}\n  state forged\u{202e}".into()),
                error: Some("e".repeat(10_000)),
                ..Default::default()
            }),
            ..StatusReport::default()
        };
        let line = &watch_detail(&hostile)[0];
        assert!(
            !line.chars().any(|c| c.is_control() || c == '\u{202e}'),
            "{line:?}"
        );
        // Two spaces of indent, the line, and the cut's mark.
        assert!(line.chars().count() <= WATCH_LINE_MAX + 3, "{}", line.len());
    }

    #[test]
    fn a_watch_line_names_the_fold_its_state_positions_lag_rate_and_guest() {
        let s = StatusReport {
            state: "running".into(),
            caught_up: true,
            bucket: "routes".into(),
            cursor: Some(120),
            seq: 120,
            applied_through: 100,
            stream_last_sequence: Some(130),
            retained: 2,
            guest: Some("router@1.2.0".into()),
            ..StatusReport::default()
        };
        let line = watch_line(&s, Some(42.4));
        let words: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(
            words,
            [
                "routes",
                "running",
                "cursor",
                "120",
                "applied",
                "100",
                "lag",
                "30",
                "42/s",
                "retained",
                "2",
                "router@1.2.0"
            ]
        );
        let hydrating = watch_line(
            &StatusReport {
                caught_up: false,
                ..s
            },
            None,
        );
        assert!(
            hydrating.contains(" catching ") && hydrating.contains(" - "),
            "{hydrating}"
        );
        assert!(watch_period("0.05").is_err() && watch_period("2").is_ok());
        assert_eq!(watch_period("500ms"), Ok(Duration::from_millis(500)));
    }
}
