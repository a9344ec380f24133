//! The log's event names against the table in docs/operations.md ("Log events"): every `info`,
//! `warn` and `error` line the host's crates emit names its `event`, every event is in the table at
//! the level it is emitted at, and every event in the table is emitted somewhere.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The repository's root (this crate is `host/`).
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from(".."))
}

/// Every Rust source of the host's crates that ships (no test files, no test-support crates).
fn sources() -> Vec<PathBuf> {
    let root = root();
    let mut dirs = vec![root.join("host/src")];
    for c in [
        "foldhost-core",
        "foldhost-nats",
        "foldhost-fold",
        "foldhost-guest",
        "foldhost-artifact",
    ] {
        dirs.push(root.join("crates").join(c).join("src"));
    }
    let mut out = Vec::new();
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap_or_else(|e| panic!("{}: {e}", d.display())) {
            let p = e.expect("entry").path();
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            if p.is_dir() {
                if name != "testkit" && name != "tests" {
                    dirs.push(p);
                }
            } else if name.ends_with(".rs") && name != "tests.rs" && !name.ends_with("_tests.rs") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// The end (exclusive) of the macro arguments opening at `start` (just after its `(`).
fn close_paren(s: &[u8], start: usize) -> usize {
    let (mut i, mut depth) = (start, 1);
    while depth > 0 && i < s.len() {
        match s[i] {
            b'(' => depth += 1,
            b')' => depth -= 1,
            b'"' => {
                i += 1;
                while i < s.len() && s[i] != b'"' {
                    if s[i] == b'\\' {
                        i += 1;
                    }
                    i += 1;
                }
            }
            _ => {}
        }
        i += 1;
    }
    i - 1
}

/// `(file:line, level, event)` for every `tracing::{info,warn,error}!` outside test modules;
/// `event` is `None` where the line names none.
fn emitted() -> Vec<(String, &'static str, Option<String>)> {
    let mut out = Vec::new();
    for path in sources() {
        let text = std::fs::read_to_string(&path).expect("read source");
        let code = match text.find("#[cfg(test)]\nmod tests") {
            Some(i) => &text[..i],
            None => text.as_str(),
        };
        let bytes = code.as_bytes();
        for level in ["info", "warn", "error"] {
            let needle = format!("tracing::{level}!(");
            let mut from = 0;
            while let Some(at) = code[from..].find(&needle) {
                let open = from + at + needle.len();
                let args = &code[open..close_paren(bytes, open)];
                let event = args
                    .split_once("event = \"")
                    .and_then(|(_, rest)| rest.split_once('"'))
                    .map(|(name, _)| name.to_string());
                let line = code[..open].lines().count();
                let shown = path.strip_prefix(root()).unwrap_or(&path).display();
                out.push((format!("{shown}:{line}"), level, event));
                from = open;
            }
        }
    }
    out
}

/// The table of events in docs/operations.md ("Log events"): name → the levels it lists.
fn table() -> BTreeMap<String, BTreeSet<String>> {
    let doc =
        std::fs::read_to_string(root().join("docs/operations.md")).expect("docs/operations.md");
    let section = doc
        .split_once("### Log events")
        .map(|(_, rest)| rest)
        .expect("docs/operations.md has a \"### Log events\" section");
    let mut rows = BTreeMap::new();
    for line in section.lines().skip_while(|l| !l.starts_with('|')) {
        if !line.starts_with('|') {
            break;
        }
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        let (Some(name), Some(levels)) = (cells.get(1), cells.get(2)) else {
            continue;
        };
        let Some(name) = name.strip_prefix('`').and_then(|n| n.strip_suffix('`')) else {
            continue;
        };
        let levels = levels.split(',').map(|l| l.trim().to_string()).collect();
        rows.insert(name.to_string(), levels);
    }
    rows
}

#[test]
fn every_state_change_the_host_logs_names_an_event_the_log_events_table_documents_at_its_level() {
    let emitted = emitted();
    assert!(emitted.len() > 50, "the scan found the host's log lines");
    let unnamed: Vec<&String> = emitted
        .iter()
        .filter(|(_, _, e)| e.is_none())
        .map(|(at, _, _)| at)
        .collect();
    assert!(
        unnamed.is_empty(),
        "info, warn and error lines without an `event = \"…\"`: {unnamed:?}"
    );
    let table = table();
    let mut missing = Vec::new();
    for (at, level, event) in &emitted {
        let Some(event) = event else { continue };
        match table.get(event) {
            Some(levels) if levels.contains(*level) => {}
            Some(levels) => missing.push(format!(
                "{at}: {event} at {level}, the table says {levels:?}"
            )),
            None => missing.push(format!("{at}: {event} is not in the table")),
        }
    }
    assert!(
        missing.is_empty(),
        "docs/operations.md \"Log events\": {missing:#?}"
    );
    let used: BTreeSet<&str> = emitted
        .iter()
        .filter_map(|(_, _, e)| e.as_deref())
        .collect();
    let stale: Vec<&String> = table
        .keys()
        .filter(|k| !used.contains(k.as_str()))
        .collect();
    assert!(
        stale.is_empty(),
        "events in the table no line emits: {stale:?}"
    );
}
