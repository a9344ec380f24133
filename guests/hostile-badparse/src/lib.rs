//! `hostile-badparse`: breaks the `parse` contract — one verdict fewer than the batch has updates.
//!
//! It implements the raw generated bindings (not [`foldhost_guest::Folder`], which cannot get
//! this wrong). For an empty batch it answers an empty list; otherwise one accept fewer than the
//! packed batch holds updates. The other calls succeed and do nothing; every query answers the
//! error `missing`.

use foldhost_guest::bindings::exports::foldhost::guest::folder::{Guest, GuestManifest, Verdict};

/// The raw export.
struct HostileBadParse;

impl Guest for HostileBadParse {
    fn manifest() -> GuestManifest {
        GuestManifest {
            name: "hostile-badparse".into(),
            version: "0.1.0".into(),
            scope: Vec::new(),
        }
    }

    fn init(_config: Vec<(String, String)>) -> Result<(), String> {
        Ok(())
    }

    fn parse(batch: Vec<u8>) -> Vec<Verdict> {
        let updates = foldhost_guest::__private::count_updates(&batch);
        vec![Verdict::Accept; updates.saturating_sub(1)]
    }

    fn apply() -> Result<(), String> {
        Ok(())
    }

    fn on_applied(_cursor: u64) {}

    fn query(_request: Vec<u8>) -> Result<Vec<u8>, String> {
        Err("missing".into())
    }
}

foldhost_guest::bindings::export!(HostileBadParse);
