//! What [`export_folder!`](crate::export_folder) expands to calls into here. Not a public API.

use crate::bindings::foldhost::guest::types as raw;
use crate::{Change, Folder, Manifest, Verdict, in_scope};

pub use crate::bindings::exports::foldhost::guest::folder::Guest;
pub use raw::GuestManifest as RawManifest;
pub use raw::Verdict as RawVerdict;

/// Bytes of one packed update's header: key length (u32), value length (u32), revision (u64),
/// op (u8), all little-endian.
const HEADER: usize = 17;

/// What happened to a key, as a packed update's op byte says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// 0: the key now holds the value.
    Put,
    /// 1: the key was deleted.
    Delete,
    /// 2: the key's history was purged.
    Purge,
}

/// One update of a packed batch, borrowed from it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Packed<'b> {
    /// The key.
    pub key: &'b str,
    /// The value (empty for delete and purge).
    pub value: &'b [u8],
    /// The bucket revision; 0 when unknown.
    pub revision: u64,
    /// What happened.
    pub op: Op,
}

/// The updates of a packed batch (`wit/v0.2.0/guest.wit`), in order. The host never sends a
/// malformed batch; one that is (a torn header, a length past the end, a key that is not UTF-8, an
/// unknown op) ends the iteration with an `Err` saying where.
pub fn unpack(batch: &[u8]) -> impl Iterator<Item = Result<Packed<'_>, String>> + '_ {
    let mut at = 0usize;
    std::iter::from_fn(move || {
        if at >= batch.len() {
            return None;
        }
        let r = unpack_one(batch, at);
        at = match &r {
            Ok((_, next)) => *next,
            Err(_) => batch.len(),
        };
        Some(r.map(|(u, _)| u))
    })
}

fn unpack_one(batch: &[u8], at: usize) -> Result<(Packed<'_>, usize), String> {
    let bad = |what: &str| format!("malformed packed batch at byte {at}: {what}");
    let header = batch
        .get(at..at + HEADER)
        .ok_or_else(|| bad("torn header"))?;
    let word =
        |i: usize| u32::from_le_bytes([header[i], header[i + 1], header[i + 2], header[i + 3]]);
    let key_len = word(0) as usize;
    let value_len = word(4) as usize;
    let mut rev = [0u8; 8];
    rev.copy_from_slice(&header[8..16]);
    let op = match header[16] {
        0 => Op::Put,
        1 => Op::Delete,
        2 => Op::Purge,
        other => return Err(bad(&format!("unknown op {other}"))),
    };
    let key_at = at + HEADER;
    let value_at = key_at
        .checked_add(key_len)
        .ok_or_else(|| bad("key length overflows"))?;
    let end = value_at
        .checked_add(value_len)
        .ok_or_else(|| bad("value length overflows"))?;
    let key = batch
        .get(key_at..value_at)
        .ok_or_else(|| bad("key past the end"))?;
    let value = batch
        .get(value_at..end)
        .ok_or_else(|| bad("value past the end"))?;
    let key = std::str::from_utf8(key).map_err(|_| bad("key is not UTF-8"))?;
    Ok((
        Packed {
            key,
            value,
            revision: u64::from_le_bytes(rev),
            op,
        },
        end,
    ))
}

/// How many updates a packed batch holds (for test guests that answer by count); a malformed
/// batch panics, as [`Runtime::parse`] does.
pub fn count_updates(batch: &[u8]) -> usize {
    let mut n = 0;
    for u in unpack(batch) {
        if let Err(e) = u {
            panic!("{e}");
        }
        n += 1;
    }
    n
}

/// The manifest in the bindings' type.
#[cfg(not(feature = "state"))]
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

/// The manifest in the bindings' type.
#[cfg(feature = "state")]
pub fn manifest<F: Folder>() -> RawManifest {
    let Manifest {
        name,
        version,
        scope,
        state,
        reads,
    } = F::manifest();
    RawManifest {
        name,
        version,
        scope,
        state: state
            .into_iter()
            .map(|b| raw::StateBucket {
                name: b.name,
                history: b.history,
                max_age_ms: b.max_age_ms,
                max_bytes: b.max_bytes,
                per_key_ttl: b.per_key_ttl,
            })
            .collect(),
        reads,
    }
}

/// A guest's whole state inside the component: the folder, its scope, and what the last `parse`
/// accepted.
pub struct Runtime<F: Folder> {
    folder: F,
    scope: Vec<String>,
    pending: Vec<Change<F::Value>>,
    /// What the last `parse` of a state bucket accepted: its name and its changes.
    #[cfg(feature = "state")]
    pending_state: Option<(String, Vec<Change<Vec<u8>>>)>,
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
            #[cfg(feature = "state")]
            pending_state: None,
        }
    }

    /// `init`: hands the configuration to the folder.
    pub fn init(&mut self, config: Vec<(String, String)>) -> Result<(), String> {
        self.folder.init(&config)
    }

    /// `parse`: one verdict per update of the packed `batch`, in order; keeps what was accepted
    /// (replacing whatever an earlier `parse` left unapplied). Keys and values are read in place:
    /// only an accepted update's key is copied (into its [`Change`]). A malformed batch (a host
    /// bug) panics, which traps the call.
    pub fn parse(&mut self, batch: &[u8]) -> Vec<RawVerdict> {
        self.pending.clear();
        #[cfg(feature = "state")]
        {
            self.pending_state = None;
        }
        let mut verdicts = Vec::new();
        for update in unpack(batch) {
            let update = update.unwrap_or_else(|e| panic!("{e}"));
            let verdict = if !in_scope(&self.scope, update.key) {
                RawVerdict::Skip
            } else {
                match update.op {
                    Op::Put => match self.folder.parse(update.key, update.value) {
                        Verdict::Accept(value) => {
                            self.pending.push(Change::Put {
                                key: update.key.to_owned(),
                                revision: update.revision,
                                value,
                            });
                            RawVerdict::Accept
                        }
                        Verdict::Skip => RawVerdict::Skip,
                        Verdict::Defer => RawVerdict::Defer,
                    },
                    Op::Delete | Op::Purge => {
                        self.pending.push(Change::Delete {
                            key: update.key.to_owned(),
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

    /// `parse` of a state bucket's packed `batch` (`""`: the main bucket, [`Runtime::parse`]):
    /// every update accepted, its value kept as bytes for [`Folder::apply_state`].
    #[cfg(feature = "state")]
    pub fn parse_in(&mut self, bucket: &str, batch: &[u8]) -> Vec<RawVerdict> {
        if bucket.is_empty() {
            return self.parse(batch);
        }
        self.pending.clear();
        let mut changes = Vec::new();
        for update in unpack(batch) {
            let update = update.unwrap_or_else(|e| panic!("{e}"));
            changes.push(match update.op {
                Op::Put => Change::Put {
                    key: update.key.to_owned(),
                    revision: update.revision,
                    value: update.value.to_vec(),
                },
                Op::Delete | Op::Purge => Change::Delete {
                    key: update.key.to_owned(),
                    revision: update.revision,
                },
            });
        }
        let verdicts = vec![RawVerdict::Accept; changes.len()];
        self.pending_state = Some((bucket.to_owned(), changes));
        verdicts
    }

    /// `apply`: applies what the last `parse` accepted, and forgets it (also on error).
    pub fn apply(&mut self) -> Result<(), String> {
        #[cfg(feature = "state")]
        if let Some((bucket, changes)) = self.pending_state.take() {
            return self.folder.apply_state(&bucket, changes);
        }
        let changes = std::mem::take(&mut self.pending);
        self.folder.apply(changes)
    }

    /// `end-of-current`.
    #[cfg(feature = "state")]
    pub fn end_of_current(&mut self, bucket: &str) {
        self.folder.end_of_current(bucket);
    }

    /// `on-applied` of `bucket` (`""`: the main bucket, [`Folder::on_applied`]).
    #[cfg(feature = "state")]
    pub fn on_applied_in(&mut self, bucket: &str, cursor: u64) {
        if bucket.is_empty() {
            self.folder.on_applied(cursor);
        } else {
            self.folder.on_state_applied(bucket, cursor);
        }
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
        /// What the state-bucket calls saw, in order (the `state` feature).
        #[cfg(feature = "state")]
        state_calls: Vec<String>,
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

        #[cfg(feature = "state")]
        fn apply_state(
            &mut self,
            bucket: &str,
            changes: Vec<Change<Vec<u8>>>,
        ) -> Result<(), String> {
            for c in changes {
                let what = match &c {
                    Change::Put { value, .. } => format!("put={}", String::from_utf8_lossy(value)),
                    Change::Delete { .. } => "del".into(),
                };
                self.state_calls
                    .push(format!("{bucket}:{}:{what}", c.key()));
            }
            Ok(())
        }

        #[cfg(feature = "state")]
        fn end_of_current(&mut self, bucket: &str) {
            self.state_calls.push(format!("eoc {bucket}"));
        }

        #[cfg(feature = "state")]
        fn on_state_applied(&mut self, bucket: &str, cursor: u64) {
            self.state_calls.push(format!("applied {bucket}@{cursor}"));
        }
    }

    /// One packed update, as the host packs it (`wit/v0.2.0/guest.wit`).
    fn packed(key: &str, value: &[u8], revision: u64, op: u8) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&(key.len() as u32).to_le_bytes());
        out.extend_from_slice(&(value.len() as u32).to_le_bytes());
        out.extend_from_slice(&revision.to_le_bytes());
        out.push(op);
        out.extend_from_slice(key.as_bytes());
        out.extend_from_slice(value);
        out
    }

    fn put(key: &str, value: &str, revision: u64) -> Vec<u8> {
        packed(key, value.as_bytes(), revision, 0)
    }

    fn del(key: &str, op: Op, revision: u64) -> Vec<u8> {
        let code = match op {
            Op::Put => 0,
            Op::Delete => 1,
            Op::Purge => 2,
        };
        packed(key, &[], revision, code)
    }

    /// A batch: the updates back to back.
    fn batch(updates: Vec<Vec<u8>>) -> Vec<u8> {
        updates.concat()
    }

    #[test]
    fn a_packed_batch_unpacks_in_order_borrowing_its_bytes() {
        let b = batch(vec![
            put("n.1", "7", 1),
            del("m.2", Op::Purge, u64::MAX),
            put("", "", 0),
        ]);
        let got: Vec<Packed<'_>> = unpack(&b).map(|u| u.expect("well formed")).collect();
        assert_eq!(
            got,
            vec![
                Packed {
                    key: "n.1",
                    value: b"7",
                    revision: 1,
                    op: Op::Put
                },
                Packed {
                    key: "m.2",
                    value: b"",
                    revision: u64::MAX,
                    op: Op::Purge
                },
                Packed {
                    key: "",
                    value: b"",
                    revision: 0,
                    op: Op::Put
                },
            ]
        );
        assert_eq!(count_updates(&b), 3);
        assert_eq!(unpack(&[]).count(), 0);
    }

    #[test]
    fn a_malformed_packed_batch_is_an_error_naming_where() {
        let good = put("n.1", "7", 1);
        // Torn header, value past the end, a key that is not UTF-8, an unknown op.
        let torn = [good.clone(), vec![1, 0, 0]].concat();
        let errs: Vec<String> = unpack(&torn).filter_map(Result::err).collect();
        assert_eq!(
            errs,
            vec![format!(
                "malformed packed batch at byte {}: torn header",
                good.len()
            )]
        );
        let mut short = good.clone();
        short.pop();
        assert!(unpack(&short).any(|u| u.is_err_and(|e| e.contains("value past the end"))));
        // A one-byte key (the batch's last byte, the value being empty) made 0xff.
        let mut not_utf8 = packed("k", b"", 1, 0);
        let last = not_utf8.len() - 1;
        not_utf8[last] = 0xff;
        assert!(unpack(&not_utf8).any(|u| u.is_err_and(|e| e.contains("not UTF-8"))));
        let mut bad_op = good.clone();
        bad_op[16] = 9;
        assert!(unpack(&bad_op).any(|u| u.is_err_and(|e| e.contains("unknown op 9"))));
        // An error ends the iteration: nothing after it is read.
        let after = [bad_op, good].concat();
        assert_eq!(unpack(&after).count(), 1);
    }

    #[test]
    fn a_change_gives_its_key_without_the_scope_prefix_it_matched() {
        let mut rt = Runtime::<Recorder>::new();
        rt.parse(&batch(vec![put("n.1", "7", 1), del("m.2", Op::Delete, 2)]));
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
        let verdicts = rt.parse(&batch(vec![
            put("n.1", "7", 1),
            put("out.1", "7", 2),
            put("n.bad", "x", 3),
            del("n.2", Op::Delete, 4),
            del("out.2", Op::Purge, 5),
            del("m.3", Op::Purge, 6),
            put("n.defer", "1", 7),
            put("m.4", "9", 8),
        ]));
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
        rt.parse(&put("n.1", "1", 1));
        rt.parse(&put("n.2", "2", 2));
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

    #[cfg(feature = "state")]
    #[test]
    fn a_state_bucket_batch_is_applied_raw_and_tagged_and_never_mixed_with_the_main_one() {
        let mut rt = Runtime::<Recorder>::new();
        // A state batch: every update accepted (out of the main scope too), values as bytes.
        let v = rt.parse_in(
            "catalog.items",
            &batch(vec![put("sku-1", "{}", 3), del("sku-2", Op::Purge, 4)]),
        );
        assert_eq!(v, [RawVerdict::Accept, RawVerdict::Accept]);
        rt.apply().expect("applied");
        // A main batch after it goes to `apply`, not to `apply_state`.
        let v = rt.parse_in("", &batch(vec![put("n.a", "7", 5)]));
        assert_eq!(v, [RawVerdict::Accept]);
        rt.apply().expect("applied");
        // A state parse replaces an unapplied main one (the host applies what the last parse
        // accepted).
        rt.parse_in("", &batch(vec![put("n.b", "8", 6)]));
        rt.parse_in("counts", &batch(vec![put("total", "1", 1)]));
        rt.apply().expect("applied");
        rt.end_of_current("counts");
        rt.on_applied_in("counts", 1);
        rt.on_applied_in("", 5);
        assert_eq!(
            rt.folder.state_calls,
            [
                "catalog.items:sku-1:put={}",
                "catalog.items:sku-2:del",
                "counts:total:put=1",
                "eoc counts",
                "applied counts@1",
            ]
        );
        assert_eq!(rt.folder.applied.len(), 1, "only n.a reached apply");
        assert_eq!(rt.folder.cursor, 5);
        assert_eq!(manifest::<Recorder>().state.len(), 0);
    }

    #[test]
    fn failed_apply_drops_the_batch() {
        let mut rt = Runtime::<Recorder>::new();
        rt.parse(&put("n.fail", "1", 1));
        assert_eq!(rt.apply(), Err("fail".to_string()));
        rt.apply().expect("nothing pending");
        assert!(rt.folder.applied.is_empty());
    }

    #[test]
    fn empty_batch() {
        let mut rt = Runtime::<Recorder>::new();
        assert!(rt.parse(&[]).is_empty());
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
