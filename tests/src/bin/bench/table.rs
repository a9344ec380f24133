//! The one table `make bench` prints: every figure beside its baseline from the same run, the ratio
//! and the target, under the machine's core count and the date.
//!
//! The benchmarks add rows as they measure ([`row`]); `foldhost-bench table` prints them all at the
//! end ([`print`]). Rows are kept in a process-wide list so a benchmark needs no extra parameter.

use std::sync::Mutex;

/// One figure of the table.
struct Row {
    figure: String,
    value: String,
    baseline: String,
    ratio: f64,
    target: String,
}

static ROWS: Mutex<Vec<Row>> = Mutex::new(Vec::new());

/// Adds a row: `figure` measured as `value`, against `baseline` (what it is and its value, same
/// run), `ratio` (figure ÷ baseline, or as the row says), and the figure's `target` ("" for none).
pub fn row(
    figure: impl Into<String>,
    value: impl Into<String>,
    baseline: impl Into<String>,
    ratio: f64,
    target: &str,
) {
    if let Ok(mut rows) = ROWS.lock() {
        rows.push(Row {
            figure: figure.into(),
            value: value.into(),
            baseline: baseline.into(),
            ratio,
            target: target.to_string(),
        });
    }
}

/// Formats a rate (per second) with thousands grouped by a thin space.
pub fn rate(x: f64) -> String {
    let n = x.round() as u64;
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push('\u{202f}');
        }
        out.push(c);
    }
    out
}

/// Prints every row as one Markdown table, headed by the date, the cores and `command`.
pub fn print(command: &str) {
    let cores = std::thread::available_parallelism().map_or(0, std::num::NonZero::get);
    let date = std::process::Command::new("date")
        .args(["-u", "+%Y-%m-%d %H:%M UTC"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    println!();
    println!("## foldhost benchmarks — {date}, {cores} cores — `{command}`");
    println!();
    println!("| figure | value | baseline (same run) | ratio | target |");
    println!("|---|---|---|---|---|");
    let Ok(rows) = ROWS.lock() else { return };
    for r in rows.iter() {
        let ratio = if r.ratio.is_finite() {
            format!("{:.3}", r.ratio)
        } else {
            "—".into()
        };
        println!(
            "| {} | {} | {} | {ratio} | {} |",
            r.figure, r.value, r.baseline, r.target
        );
    }
}
