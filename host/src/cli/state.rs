//! `foldhost state list`: the state buckets folded under a store (docs/state.md) — each one the
//! last run declared, with its fold's position, and every one folded before whose declaration is
//! gone (kept: the host never removes one).

use super::*;

/// `foldhost state`.
#[derive(Subcommand, Debug)]
pub enum StateCommand {
    /// Lists the state buckets folded under a store.
    List(StateListArgs),
}

/// `foldhost state list`.
#[derive(Args, Debug)]
pub struct StateListArgs {
    /// The node's store directory (`run --store`).
    #[arg(long)]
    pub store: PathBuf,
    /// One JSON array of the buckets.
    #[arg(long)]
    pub json: bool,
}

pub(super) fn cmd_state(c: StateCommand) -> anyhow::Result<()> {
    let StateCommand::List(a) = c;
    if !a.store.is_dir() {
        bail!("--store {}: not a directory", a.store.display());
    }
    let last = foldhost_core::storedir::read_status(&a.store)
        .map(|s| s.state_buckets)
        .unwrap_or_default();
    let declared: Vec<&str> = last
        .iter()
        .filter(|b| b.declared)
        .map(|b| b.local.as_str())
        .collect();
    let mut rows: Vec<foldhost_core::status::StateBucketReport> =
        last.iter().filter(|b| b.declared).cloned().collect();
    rows.extend(
        crate::node::lanes::undeclared(&a.store, declared.into_iter())
            .into_iter()
            .map(|local| foldhost_core::status::StateBucketReport {
                local,
                declared: false,
                ..Default::default()
            }),
    );
    if a.json {
        println!("{}", serde_json::to_string(&rows)?);
        return Ok(());
    }
    if rows.is_empty() {
        println!("no state buckets under {}", a.store.display());
        return Ok(());
    }
    for b in rows {
        let declared = if b.declared {
            "declared"
        } else {
            "not declared by the last run (kept)"
        };
        let bucket = if b.bucket.is_empty() {
            "-"
        } else {
            b.bucket.as_str()
        };
        let access = if b.access.is_empty() {
            "-"
        } else {
            b.access.as_str()
        };
        println!(
            "{}\t{bucket}\t{access}\tapplied_through {}\t{declared}",
            b.local, b.applied_through
        );
    }
    Ok(())
}
