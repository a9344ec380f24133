//! `router`: a host → upstream routing table.
//!
//! Keys `route.<host>` hold JSON `{"upstream": "<addr>"}`. A query's request is a host name (UTF-8);
//! the answer is `{"upstream":"<addr>"}`, or the error `unknown host: <name>`.
//!
//! The key's current value is the truth: a put whose value is not such a route (unparseable, no
//! `upstream` string, an empty one) removes the host's route, exactly as if the router were rebuilt
//! from the fold — a running instance and a freshly hydrated one always agree. A key with an empty
//! host is skipped.

use std::collections::HashMap;

use foldhost_guest::{Change, Folder, Manifest, Verdict};
use serde::{Deserialize, Serialize};

const PREFIX: &str = "route.";

/// A route's value, as stored in the bucket and as answered by a query.
#[derive(Deserialize, Serialize)]
struct Route {
    upstream: String,
}

/// The routing table: host → upstream address. A hash map: queries are point lookups, and in wasm a
/// B-tree's string comparisons (a byte-wise `memcmp`, ~20 per insert at a million routes) cost more
/// than the whole host boundary. std's SipHash with a random seed: bucket writers are untrusted,
/// so no hash a writer can collide on purpose.
#[derive(Default)]
struct Router {
    routes: HashMap<String, String>,
}

/// `key` without the route prefix, reusing its buffer (no allocation per update).
fn host_of(mut key: String) -> Option<String> {
    if !key.starts_with(PREFIX) {
        return None;
    }
    key.drain(..PREFIX.len());
    Some(key)
}

impl Folder for Router {
    /// The upstream, or `None` for a value that is not a route (the host has no route then).
    type Value = Option<String>;

    fn manifest() -> Manifest {
        Manifest::new("router", "0.1.0", [PREFIX])
    }

    fn parse(&self, key: &str, value: &[u8]) -> Verdict<Option<String>> {
        let host = key.strip_prefix(PREFIX).unwrap_or_default();
        if host.is_empty() {
            return Verdict::Skip;
        }
        match serde_json::from_slice::<Route>(value) {
            Ok(route) if !route.upstream.is_empty() => Verdict::Accept(Some(route.upstream)),
            _ => Verdict::Accept(None),
        }
    }

    fn apply(&mut self, changes: Vec<Change<Option<String>>>) -> Result<(), String> {
        for change in changes {
            match change {
                Change::Put { key, value, .. } => {
                    if let Some(host) = host_of(key) {
                        match value {
                            Some(upstream) => self.routes.insert(host, upstream),
                            None => self.routes.remove(&host),
                        };
                    }
                }
                Change::Delete { key, .. } => {
                    if let Some(host) = key.strip_prefix(PREFIX) {
                        self.routes.remove(host);
                    }
                }
            }
        }
        Ok(())
    }

    fn query(&self, request: &[u8]) -> Result<Vec<u8>, String> {
        let host = String::from_utf8_lossy(request);
        let upstream = self
            .routes
            .get(host.as_ref())
            .ok_or_else(|| format!("unknown host: {host}"))?;
        serde_json::to_vec(&Route {
            upstream: upstream.clone(),
        })
        .map_err(|e| e.to_string())
    }
}

foldhost_guest::export_folder!(Router);

#[cfg(test)]
mod tests {
    use super::*;

    fn put(key: &str, upstream: &str) -> Change<Option<String>> {
        Change::Put {
            key: key.into(),
            revision: 1,
            value: Some(upstream.into()),
        }
    }

    #[test]
    fn parse_routes() {
        let r = Router::default();
        let ok = br#"{"upstream": "10.0.0.1:80", "extra": 1}"#;
        assert_eq!(
            r.parse("route.a.example", ok),
            Verdict::Accept(Some("10.0.0.1:80".into()))
        );
        assert_eq!(r.parse("route.", ok), Verdict::Skip);
        for bad in [
            &b"not json"[..],
            b"{}",
            br#"{"upstream": 7}"#,
            br#"{"upstream": ""}"#,
            b"",
        ] {
            assert_eq!(r.parse("route.a", bad), Verdict::Accept(None));
        }
    }

    #[test]
    fn a_value_that_is_not_a_route_removes_the_route() {
        let mut r = Router::default();
        r.apply(vec![put("route.a", "1:80")]).expect("apply");
        r.apply(vec![Change::Put {
            key: "route.a".into(),
            revision: 2,
            value: None,
        }])
        .expect("apply");
        assert_eq!(r.query(b"a"), Err("unknown host: a".into()));
    }

    #[test]
    fn fold_and_query() {
        let mut r = Router::default();
        r.apply(vec![put("route.a", "1:80"), put("route.b", "2:80")])
            .expect("apply");
        assert_eq!(r.query(b"a"), Ok(br#"{"upstream":"1:80"}"#.to_vec()));
        r.apply(vec![
            Change::Delete {
                key: "route.a".into(),
                revision: 2,
            },
            put("route.b", "3\"x"),
        ])
        .expect("apply");
        assert_eq!(r.query(b"a"), Err("unknown host: a".into()));
        assert_eq!(r.query(b"b"), Ok(br#"{"upstream":"3\"x"}"#.to_vec()));
    }
}
