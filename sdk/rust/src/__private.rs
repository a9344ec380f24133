//! What [`export_folder!`](crate::export_folder) expands to calls into here. Not a public API.

use crate::bindings::foldhost::guest::types as raw;
use crate::{Change, Folder, Manifest, Verdict, in_scope};

pub use crate::bindings::exports::foldhost::guest::folder::Guest;
pub use raw::GuestManifest as RawManifest;
pub use raw::Update as RawUpdate;
pub use raw::Verdict as RawVerdict;

/// The manifest in the bindings' type.
pub fn manifest<F: Folder>() -> RawManifest {
    let Manifest {
        name,
        version,
        scope,
    } = F::manifest();
    RawManifest {
        name,
        version,
        scope,
    }
}

/// A guest's whole state inside the component: the folder, its scope, and what the last `parse`
/// accepted.
pub struct Runtime<F: Folder> {
    folder: F,
    scope: Vec<String>,
    pending: Vec<Change<F::Value>>,
}

impl<F: Folder> Default for Runtime<F> {
    fn default() -> Self {
        Self::new()
    }
}

impl<F: Folder> Runtime<F> {
    /// A fresh state: `F::default()`, the scope from `F::manifest()`, nothing pending.
    pub fn new() -> Self {
        let scope = F::manifest().scope;
        crate::set_scope(scope.clone());
        Runtime {
            folder: F::default(),
            scope,
            pending: Vec::new(),
        }
    }

    /// `init`: hands the configuration to the folder.
    pub fn init(&mut self, config: Vec<(String, String)>) -> Result<(), String> {
        self.folder.init(&config)
    }

    /// `parse`: one verdict per update, in order; keeps what was accepted (replacing whatever an
    /// earlier `parse` left unapplied).
    pub fn parse(&mut self, batch: Vec<RawUpdate>) -> Vec<RawVerdict> {
        self.pending.clear();
        let mut verdicts = Vec::with_capacity(batch.len());
        for update in batch {
            let verdict = if !in_scope(&self.scope, &update.key) {
                RawVerdict::Skip
            } else {
                match update.op {
                    raw::Op::Put => match self.folder.parse(&update.key, &update.value) {
                        Verdict::Accept(value) => {
                            self.pending.push(Change::Put {
                                key: update.key,
                                revision: update.revision,
                                value,
                            });
                            RawVerdict::Accept
                        }
                        Verdict::Skip => RawVerdict::Skip,
                        Verdict::Defer => RawVerdict::Defer,
                    },
                    raw::Op::Delete | raw::Op::Purge => {
                        self.pending.push(Change::Delete {
                            key: update.key,
                            revision: update.revision,
                        });
                        RawVerdict::Accept
                    }
                }
            };
            verdicts.push(verdict);
        }
        verdicts
    }

    /// `apply`: applies what the last `parse` accepted, and forgets it (also on error).
    pub fn apply(&mut self) -> Result<(), String> {
        let changes = std::mem::take(&mut self.pending);
        self.folder.apply(changes)
    }

    /// `on-applied`.
    pub fn on_applied(&mut self, cursor: u64) {
        self.folder.on_applied(cursor);
    }

    /// `query`.
    pub fn query(&self, request: &[u8]) -> Result<Vec<u8>, String> {
        self.folder.query(request)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Default)]
    struct Recorder {
        applied: Vec<Change<u32>>,
        cursor: u64,
        config: Vec<(String, String)>,
    }

    impl Folder for Recorder {
        type Value = u32;

        fn manifest() -> Manifest {
            Manifest::new("recorder", "0.1.0", ["n.", "m."])
        }

        fn init(&mut self, config: &[(String, String)]) -> Result<(), String> {
            self.config = config.to_vec();
            Ok(())
        }

        fn parse(&self, key: &str, value: &[u8]) -> Verdict<u32> {
            if key == "n.defer" {
                return Verdict::Defer;
            }
            match std::str::from_utf8(value).ok().and_then(|s| s.parse().ok()) {
                Some(n) => Verdict::Accept(n),
                None => Verdict::Skip,
            }
        }

        fn apply(&mut self, changes: Vec<Change<u32>>) -> Result<(), String> {
            if changes.iter().any(|c| c.key() == "n.fail") {
                return Err("fail".into());
            }
            self.applied.extend(changes);
            Ok(())
        }

        fn on_applied(&mut self, cursor: u64) {
            self.cursor = cursor;
        }
    }

    fn put(key: &str, value: &str, revision: u64) -> RawUpdate {
        RawUpdate {
            key: key.into(),
            value: value.as_bytes().to_vec(),
            revision,
            op: raw::Op::Put,
        }
    }

    fn del(key: &str, op: raw::Op, revision: u64) -> RawUpdate {
        RawUpdate {
            key: key.into(),
            value: Vec::new(),
            revision,
            op,
        }
    }

    #[test]
    fn a_change_gives_its_key_without_the_scope_prefix_it_matched() {
        let mut rt = Runtime::<Recorder>::new();
        rt.parse(vec![put("n.1", "7", 1), del("m.2", raw::Op::Delete, 2)]);
        rt.apply().expect("apply");
        let rest: Vec<&str> = rt.folder.applied.iter().map(Change::rest).collect();
        assert_eq!(rest, vec!["1", "2"]);
        assert_eq!(rt.folder.applied[0].key(), "n.1", "the whole key stays");
    }

    #[test]
    fn scope_prefix_match() {
        assert!(in_scope(&[], "anything"));
        let scope = vec!["route.".to_string()];
        assert!(in_scope(&scope, "route.a"));
        assert!(in_scope(&scope, "route."));
        assert!(!in_scope(&scope, "route"));
        assert!(!in_scope(&scope, "xroute.a"));
    }

    #[test]
    fn parse_then_apply_in_order() {
        let mut rt = Runtime::<Recorder>::new();
        rt.init(vec![("a".into(), "b".into())]).expect("init");
        assert_eq!(rt.folder.config, vec![("a".to_string(), "b".to_string())]);
        let verdicts = rt.parse(vec![
            put("n.1", "7", 1),
            put("out.1", "7", 2),
            put("n.bad", "x", 3),
            del("n.2", raw::Op::Delete, 4),
            del("out.2", raw::Op::Purge, 5),
            del("m.3", raw::Op::Purge, 6),
            put("n.defer", "1", 7),
            put("m.4", "9", 8),
        ]);
        assert_eq!(
            verdicts,
            vec![
                RawVerdict::Accept,
                RawVerdict::Skip,
                RawVerdict::Skip,
                RawVerdict::Accept,
                RawVerdict::Skip,
                RawVerdict::Accept,
                RawVerdict::Defer,
                RawVerdict::Accept,
            ]
        );
        rt.apply().expect("apply");
        assert_eq!(
            rt.folder.applied,
            vec![
                Change::Put {
                    key: "n.1".into(),
                    revision: 1,
                    value: 7
                },
                Change::Delete {
                    key: "n.2".into(),
                    revision: 4
                },
                Change::Delete {
                    key: "m.3".into(),
                    revision: 6
                },
                Change::Put {
                    key: "m.4".into(),
                    revision: 8,
                    value: 9
                },
            ]
        );
        // Applied changes are forgotten: a second apply applies nothing.
        rt.apply().expect("apply");
        assert_eq!(rt.folder.applied.len(), 4);
        rt.on_applied(8);
        assert_eq!(rt.folder.cursor, 8);
        assert_eq!(
            rt.query(b"x"),
            Err("this guest answers no queries".to_string())
        );
    }

    #[test]
    fn a_new_parse_replaces_unapplied_values() {
        let mut rt = Runtime::<Recorder>::new();
        rt.parse(vec![put("n.1", "1", 1)]);
        rt.parse(vec![put("n.2", "2", 2)]);
        rt.apply().expect("apply");
        assert_eq!(
            rt.folder.applied,
            vec![Change::Put {
                key: "n.2".into(),
                revision: 2,
                value: 2
            }]
        );
    }

    #[test]
    fn failed_apply_drops_the_batch() {
        let mut rt = Runtime::<Recorder>::new();
        rt.parse(vec![put("n.fail", "1", 1)]);
        assert_eq!(rt.apply(), Err("fail".to_string()));
        rt.apply().expect("nothing pending");
        assert!(rt.folder.applied.is_empty());
    }

    #[test]
    fn empty_batch() {
        let mut rt = Runtime::<Recorder>::new();
        assert!(rt.parse(Vec::new()).is_empty());
        rt.apply().expect("apply");
        assert!(rt.folder.applied.is_empty());
    }

    #[test]
    fn raw_manifest() {
        let m = manifest::<Recorder>();
        assert_eq!(m.name, "recorder");
        assert_eq!(m.version, "0.1.0");
        assert_eq!(m.scope, vec!["n.".to_string(), "m.".to_string()]);
    }
}
