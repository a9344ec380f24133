//! `kvstore-v2`: version 0.2.0 of `kvstore`, for the hot-swap tests. Same name and scope, so the
//! host accepts it as a replacement; it answers differently (`v2:` + the value) so a test can tell
//! which version served a query, and it refuses to apply an update twice.
//!
//! Every key's revision is remembered: a put or delete whose revision is not above the key's last
//! one fails `apply` with `applied twice`, so a host that replayed an update into the live instance
//! would stop the fold instead of passing the test. (Revision 0 marks a synthetic update and is let
//! through.)
//!
//! It decodes both value formats: plain values, and `fmt2:`-tagged ones that 0.1.0 defers (the
//! tag is stripped). The query `history:<key>` answers the revisions this instance applied to the
//! key, in order, comma-separated — how the deferral tests see that retained records were applied
//! once each, in log order.

use std::collections::BTreeMap;

use foldhost_guest::{Change, Folder, Manifest, Verdict};

/// The copy: key → (raw value, revision), plus the revisions of deleted keys.
#[derive(Default)]
struct KvStoreV2 {
    entries: BTreeMap<String, Vec<u8>>,
    revisions: BTreeMap<String, u64>,
    /// Every revision this instance applied per key, in the order applied.
    history: BTreeMap<String, Vec<u64>>,
}

impl KvStoreV2 {
    fn check(&mut self, key: &str, revision: u64) -> Result<(), String> {
        if revision == 0 {
            return Ok(());
        }
        let last = self.revisions.get(key).copied().unwrap_or(0);
        if revision <= last {
            return Err(format!(
                "applied twice: {key} at revision {revision} after {last}"
            ));
        }
        self.revisions.insert(key.to_owned(), revision);
        self.history
            .entry(key.to_owned())
            .or_default()
            .push(revision);
        Ok(())
    }
}

impl Folder for KvStoreV2 {
    type Value = Vec<u8>;

    fn manifest() -> Manifest {
        Manifest::whole_bucket("kvstore", "0.2.0")
    }

    fn parse(&self, _key: &str, value: &[u8]) -> Verdict<Vec<u8>> {
        // Both formats: `fmt2:` values (which 0.1.0 defers) are decoded to what follows the tag.
        Verdict::Accept(value.strip_prefix(b"fmt2:").unwrap_or(value).to_vec())
    }

    fn apply(&mut self, changes: Vec<Change<Vec<u8>>>) -> Result<(), String> {
        for change in changes {
            match change {
                Change::Put {
                    key,
                    value,
                    revision,
                } => {
                    self.check(&key, revision)?;
                    self.entries.insert(key, value);
                }
                Change::Delete { key, revision } => {
                    self.check(&key, revision)?;
                    self.entries.remove(&key);
                }
            }
        }
        Ok(())
    }

    fn query(&self, request: &[u8]) -> Result<Vec<u8>, String> {
        let key = std::str::from_utf8(request).map_err(|_| "missing")?;
        if let Some(key) = key.strip_prefix("history:") {
            let revisions = self.history.get(key).ok_or("missing")?;
            let text: Vec<String> = revisions.iter().map(u64::to_string).collect();
            return Ok(text.join(",").into_bytes());
        }
        let value = self.entries.get(key).ok_or("missing")?;
        let mut answer = b"v2:".to_vec();
        answer.extend_from_slice(value);
        Ok(answer)
    }
}

foldhost_guest::export_folder!(KvStoreV2);
