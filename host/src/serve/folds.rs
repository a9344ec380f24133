//! One listen address for every fold of a process (`run --config` with a top-level `listen`:
//! docs/operations.md, "Several folds from one file"): each fold's routes under `/folds/NAME/…`, the process's
//! `/healthz`, `/readyz` and `/metrics` across every fold, `/status` listing them; a process of
//! one fold keeps the plain routes too.
//!
//! Invariants:
//! - **A fold is reached only by its name.** `/folds/NAME/route` goes to the fold registered as
//!   NAME or is answered 404; a plain fold route (`/query`, `/swap`, …) reaches a fold only when
//!   the process has exactly one.
//! - **One policy.** The listener admits every request with the process's tokens and names, as a
//!   fold's own listener does (`admit`), before any fold is looked up.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};

use super::{Reply, ServeState};

/// The folds one listener serves, by name. A fold registers when its node starts.
#[derive(Debug, Default)]
pub struct FoldRegistry {
    folds: RwLock<BTreeMap<String, Arc<ServeState>>>,
    /// Every fold the process runs, registered or not yet (or never: one that failed first).
    expected: RwLock<Vec<String>>,
}

impl FoldRegistry {
    /// The folds the process runs: `/readyz` is not ready while one of them has not registered.
    pub(crate) fn expect(&self, names: Vec<String>) {
        if let Ok(mut e) = self.expected.write() {
            *e = names;
        }
    }

    /// Registers `state` as the fold `name` (a fold started again replaces its entry).
    pub(crate) fn insert(&self, name: &str, state: Arc<ServeState>) {
        if let Ok(mut f) = self.folds.write() {
            f.insert(name.to_string(), state);
        }
    }

    /// The fold named `name`.
    pub(crate) fn get(&self, name: &str) -> Option<Arc<ServeState>> {
        self.folds.read().ok()?.get(name).cloned()
    }

    /// Every fold, by name.
    pub(crate) fn all(&self) -> Vec<(String, Arc<ServeState>)> {
        self.folds
            .read()
            .map(|f| f.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
            .unwrap_or_default()
    }

    /// The fold, when there is exactly one.
    pub(crate) fn only(&self) -> Option<Arc<ServeState>> {
        let f = self.folds.read().ok()?;
        (f.len() == 1).then(|| f.values().next().cloned()).flatten()
    }
}

impl std::fmt::Debug for ServeState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServeState")
            .field("scope", &self.scope)
            .finish_non_exhaustive()
    }
}

/// `GET /status` of a process serving several folds: `{"folds": [each fold's status],
/// "updated_unix_ms"}` (the page reads it so).
pub(crate) fn status(registry: &FoldRegistry) -> Reply {
    let folds: Vec<foldhost_core::status::StatusReport> = registry
        .all()
        .into_iter()
        .map(|(_, s)| (s.status)())
        .collect();
    let v = serde_json::json!({
        "folds": folds,
        "updated_unix_ms": foldhost_core::status::now_unix_ms(),
    });
    let mut b = serde_json::to_vec(&v).unwrap_or_default();
    b.push(b'\n');
    Reply::new(200, "application/json", b)
}

/// `GET /readyz` across every fold: 200 `ready: fold A, fold B` when each is, else 503 naming
/// every fold that is not and why (and `no fold` before any registered).
pub(crate) fn ready(registry: &FoldRegistry) -> Reply {
    let folds = registry.all();
    if folds.is_empty() {
        return Reply::new(503, "text/plain", b"not ready: no fold has started\n");
    }
    let mut ready = Vec::new();
    let mut not: Vec<String> = registry
        .expected
        .read()
        .map(|e| e.clone())
        .unwrap_or_default()
        .into_iter()
        .filter(|n| !folds.iter().any(|(f, _)| f == n))
        .map(|n| format!("fold {n}: not running (it did not start)"))
        .collect();
    for (name, s) in &folds {
        match super::unready(s) {
            None => match (s.status)().artifact.as_ref().and_then(|a| a.warning()) {
                Some(w) => ready.push(format!("fold {name} ({w})")),
                None => ready.push(format!("fold {name}")),
            },
            Some(why) => not.push(why),
        }
    }
    if !not.is_empty() {
        Reply::new(
            503,
            "text/plain",
            format!("not ready: {}\n", not.join("; ")),
        )
    } else {
        Reply::new(200, "text/plain", format!("ready: {}\n", ready.join(", ")))
    }
}

/// `GET /metrics` across every fold.
pub(crate) fn metrics(registry: &FoldRegistry) -> Reply {
    let sources: Vec<crate::metrics::FoldSource> = registry
        .all()
        .into_iter()
        .flat_map(|(_, s)| s.folds.clone())
        .collect();
    super::metrics_of(&sources)
}

/// The fold a request names (`/folds/NAME/rest` → `NAME`, `/rest`), or none (`None`, the path as
/// it is). A name is 1 to 64 of `[A-Za-z0-9._-]`. Pure.
pub(crate) fn split_fold(path: &str) -> Result<(Option<&str>, &str), &'static str> {
    let Some(rest) = path.strip_prefix("/folds/") else {
        return Ok((None, path));
    };
    let (name, route) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    if let Some(why) = fold_name_refusal(name) {
        return Err(why);
    }
    Ok((Some(name), route))
}

/// Why `name` cannot be a fold's `/folds/NAME` segment (`None`: it can).
pub(crate) fn fold_name_refusal(name: &str) -> Option<&'static str> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    (!ok).then_some("a fold's name is 1 to 64 letters, digits, '.', '_' or '-'")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> crate::serve::AccessPolicy {
        crate::serve::AccessPolicy {
            admin_token: "a".into(),
            write_token: "w".into(),
            query_token: None,
            listen: "127.0.0.1:1".parse().expect("addr"),
            hosts: Vec::new(),
            query_open: false,
            limits: crate::serve::Limits::default(),
        }
    }

    #[test]
    fn the_process_is_ready_only_when_every_fold_it_runs_is_registered_and_ready() {
        let r = Arc::new(FoldRegistry::default());
        r.expect(vec!["a".into(), "b".into()]);
        assert_eq!(ready(&r).status, 503, "no fold yet");
        // A fold whose status is not `running` (this stand-in's is empty), and one never started.
        r.insert(
            "a",
            Arc::new(ServeState::process(
                policy(),
                Arc::new(FoldRegistry::default()),
                0,
            )),
        );
        let reply = ready(&r);
        let text = String::from_utf8_lossy(&reply.body);
        assert_eq!(reply.status, 503);
        assert!(text.contains("fold b: not running"), "{text}");
        assert!(r.only().is_some() && r.get("b").is_none());
    }

    #[test]
    fn a_fold_route_names_its_fold_and_any_other_path_is_the_process_own() {
        assert_eq!(
            split_fold("/folds/routes/query"),
            Ok((Some("routes"), "/query"))
        );
        assert_eq!(
            split_fold("/folds/a.b-c_d/status"),
            Ok((Some("a.b-c_d"), "/status"))
        );
        assert_eq!(split_fold("/folds/routes"), Ok((Some("routes"), "/")));
        assert_eq!(split_fold("/status"), Ok((None, "/status")));
        assert_eq!(
            split_fold("/foldsx/a/status"),
            Ok((None, "/foldsx/a/status"))
        );
        for bad in ["/folds//status", "/folds/a%2F/status", "/folds/é/x"] {
            assert!(split_fold(bad).is_err(), "{bad}");
        }
        assert!(split_fold(&format!("/folds/{}/status", "a".repeat(65))).is_err());
    }
}
