//! `foldhost grants`: the NATS permissions a node's user needs for what its `run` flags make it do
//! (docs/state.md, "Grants"), composed by `protocol::compose_grants` and printed as a block for a
//! nats-server `authorization` section or as JSON.

use super::*;

use foldhost_core::protocol::{BucketUse, compose_grants, grants_block};

/// `foldhost grants`.
#[derive(Args, Debug)]
pub struct GrantsArgs {
    /// The bucket the node folds (`run --bucket`).
    #[arg(long)]
    pub bucket: String,
    /// The node's guest (`run --guest`): the state buckets its manifest declares are granted —
    /// each owned one created, checked and written, each read one folded (docs/state.md).
    #[arg(long, value_name = "FILE")]
    pub guest: Option<PathBuf>,
    /// The node takes no writes for it (`/write`, `put`, `--write-subject`): no publish to the
    /// bucket is granted, and a write through the node is refused by the server.
    #[arg(long)]
    pub read_only: bool,
    /// The subject the node serves queries on (`run --query-subject`).
    #[arg(long, value_name = "SUBJ")]
    pub query_subject: Option<String>,
    /// The subject the node takes writes on (`run --write-subject`).
    #[arg(long, value_name = "SUBJ")]
    pub write_subject: Option<String>,
    /// Where the node's replies to those go (`run --query-reply-prefix`).
    #[arg(long, default_value_t = crate::node::DEFAULT_QUERY_REPLY_PREFIX.to_string())]
    pub query_reply_prefix: String,
    /// The queue group the node takes those in (`run --query-group`): the subscribe grants name
    /// it, so the user may take the subjects in that group only.
    #[arg(long, value_name = "NAME", default_value_t = super::run::defaults().query_group, value_parser = super::run::parse_queue_group)]
    pub query_group: String,
    /// The node runs export rounds (`run --export-every`): the lease bucket is granted.
    #[arg(long)]
    pub exports: bool,
    /// The bucket holding export leases (`run --lease-bucket`).
    #[arg(long, default_value_t = crate::node::DEFAULT_LEASE_BUCKET.to_string())]
    pub lease_bucket: String,
    /// The channel the node follows (`run --guest-channel`): the channels bucket and the
    /// guests' object store are granted for reading, and the node's own report key for writing.
    /// The state buckets of the versions it will run come from `--guest` (give a version's file).
    #[arg(long, value_name = "NAME", requires = "node_id")]
    pub guest_channel: Option<String>,
    /// The node's name in the channel (`run --node-id`).
    #[arg(long)]
    pub node_id: Option<String>,
    /// The guests' object store (`run --guest-objects`).
    #[arg(long, default_value_t = foldhost_nats::channel::ChannelBuckets::default().objects)]
    pub guest_objects: String,
    /// The channels bucket (`run --channel-bucket`).
    #[arg(long, default_value_t = foldhost_nats::channel::ChannelBuckets::default().channels)]
    pub channel_bucket: String,
    /// The client's inbox prefix (the NATS client's default).
    #[arg(long, default_value = "_INBOX")]
    pub inbox_prefix: String,
    /// One JSON object: `{"publish": [...], "subscribe": [...]}`.
    #[arg(long)]
    pub json: bool,
}

/// The subject filter covering every reply subject under `prefix` (`_INBOX.` → `_INBOX.>`).
fn under(prefix: &str) -> String {
    format!("{}.>", prefix.trim_end_matches('.'))
}

/// The buckets `guest`'s manifest declares, as the node would fold and write them.
async fn guest_buckets(guest: &Path, main: &str) -> anyhow::Result<Vec<BucketUse>> {
    let bytes = foldhost_guest::guest::read_guest_file(guest)?;
    let engine = foldhost_guest::guest::GuestEngine::new()?;
    let what = guest.display().to_string();
    let g = foldhost_guest::guest::GuestApply::load(
        &engine,
        &what,
        &bytes,
        foldhost_guest::guest::GuestLimits::default(),
        Vec::new(),
        std::sync::Arc::new(foldhost_core::view::EmptyFold),
    )
    .await?;
    let m = g.manifest();
    let decls = foldhost_core::protocol::check_declarations(
        &m.name,
        &m.state,
        &m.reads,
        foldhost_core::protocol::StateCaps::default(),
        main,
    )
    .map_err(|e| anyhow!("--guest {what}: {e}"))?;
    Ok(decls
        .into_iter()
        .map(|d| {
            let owned = d.access == foldhost_core::protocol::Access::Own;
            BucketUse {
                bucket: d.bucket,
                asserts: owned,
                writes: owned,
            }
        })
        .collect())
}

pub(super) async fn cmd_grants(a: GrantsArgs) -> anyhow::Result<()> {
    for (what, name) in [
        ("--bucket", &a.bucket),
        ("--lease-bucket", &a.lease_bucket),
        ("--guest-objects", &a.guest_objects),
        ("--channel-bucket", &a.channel_bucket),
    ] {
        if name.is_empty()
            || !name
                .bytes()
                .all(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b'-')
        {
            bail!("{what} {name:?}: a bucket name is letters, digits, `_` and `-`");
        }
    }
    let mut buckets = vec![BucketUse {
        bucket: a.bucket.clone(),
        asserts: false,
        writes: !a.read_only,
    }];
    if let Some(guest) = &a.guest {
        buckets.extend(guest_buckets(guest, &a.bucket).await?);
    }
    if a.exports {
        buckets.push(BucketUse {
            bucket: a.lease_bucket.clone(),
            asserts: true,
            writes: true,
        });
    }
    // A queue subscription's grant: `SUBJECT GROUP` (nats-server's form for a queue group).
    let serves: Vec<String> = [&a.query_subject, &a.write_subject]
        .into_iter()
        .flatten()
        .map(|s| format!("{s} {}", a.query_group))
        .collect();
    let channel = match (&a.guest_channel, &a.node_id) {
        (Some(channel), Some(node)) => {
            for (what, name) in [("--guest-channel", channel), ("--node-id", node)] {
                if let Some(why) = foldhost_core::protocol::name_refusal(what, name) {
                    bail!("{why}");
                }
            }
            buckets.push(BucketUse {
                bucket: a.channel_bucket.clone(),
                asserts: false,
                writes: false,
            });
            foldhost_core::protocol::channel_grants(
                channel,
                node,
                &a.guest_objects,
                &a.channel_bucket,
            )
        }
        _ => Vec::new(),
    };
    let mut grants = compose_grants(&buckets, &a.inbox_prefix, &serves);
    grants.publish.extend(channel);
    grants.publish.sort();
    grants.publish.dedup();
    if !serves.is_empty() {
        // Answers go to requesters' reply subjects, only under the reply prefix.
        grants.publish.push(under(&a.query_reply_prefix));
        grants.publish.sort();
        grants.publish.dedup();
    }
    if a.json {
        println!("{}", serde_json::to_string(&grants)?);
    } else {
        print!("{}", grants_block(&grants));
    }
    Ok(())
}
