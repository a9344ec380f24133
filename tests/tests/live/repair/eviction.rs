//! An evicting bucket: a listing diff is refused and the fold restores from an artifact, and once
//! eviction was seen the listing is never trusted again.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evicting_bucket_refuses_a_listing_diff_and_restores_from_an_artifact_like_the_exporter()
-> anyhow::Result<()> {
    let mut e = evicted("aging", 50, 10, 5).await?;
    let before = dump_store(&e.node)?;
    assert!(before.contains_key("x") && before.contains_key("k.000000"));

    // A listing diff here would delete every key: refused, fold untouched.
    let o = catch_up(&e.h, "aging", &e.node, &["--repair", "relist"])?;
    assert!(!o.status.success());
    let err = error_line(&o);
    assert!(
        err.contains("key-listing repair") && err.contains("evict"),
        "{err}"
    );
    assert_eq!(
        dump_store(&e.node)?,
        before,
        "refused: the fold is untouched"
    );
    // Auto without an artifact source: refused too, naming what is missing.
    let o = catch_up(&e.h, "aging", &e.node, &[])?;
    assert!(!o.status.success());
    assert!(
        error_line(&o).contains("--restore-from"),
        "{}",
        error_line(&o)
    );
    assert_eq!(dump_store(&e.node)?, before);

    let arts = e.artifacts.display().to_string();
    let o = catch_up(&e.h, "aging", &e.node, &["--restore-from", &arts])?;
    ok(&o, "restoring catch-up")?;
    let got = dump_store(&e.node)?;
    let want = dump_store(&e.exporter)?;
    assert_eq!(
        first_difference(&want, &got),
        None,
        "identical to the exporter"
    );
    assert!(got.contains_key("k.000049"), "an aged-out key is kept");
    assert!(
        got.contains_key("w"),
        "an aged-out write from the gap is recovered"
    );
    assert!(
        !got.contains_key("x") && !got.contains_key("k.000000"),
        "real deletes applied"
    );
    assert!(
        bucket_contents(&e.kv).await?.is_empty(),
        "NATS itself holds nothing"
    );
    let st = status_store(&e.node)?;
    assert_eq!(st.cursor, Some(e.cursor));
    assert!(st.eviction_seen);

    // An empty fold on this bucket would re-list nothing (everything aged out): with a restore
    // armed it seeds from the artifact instead.
    let fresh = e.tmp.path().join("fresh");
    ok(
        &catch_up(&e.h, "aging", &fresh, &["--restore-from", &arts])?,
        "seeding a fresh node",
    )?;
    assert_eq!(first_difference(&want, &dump_store(&fresh)?), None);

    // A later gap the artifact does not reach: the stale artifact fails the watch, fold untouched.
    e.kv.put("late", "after the artifact".into()).await?;
    wait_aged_out(&e.kv).await?;
    terminate(&mut e.host)?;
    let before = dump_store(&e.node)?;
    let o = catch_up(&e.h, "aging", &e.node, &["--restore-from", &arts])?;
    assert!(!o.status.success());
    let err = error_line(&o);
    assert!(err.contains("stale artifact"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert_eq!(dump_store(&e.node)?, before, "the fold is untouched");
    drop(e.tmp);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn once_eviction_was_seen_the_listing_is_never_trusted_again_even_with_eviction_off()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.aging_bucket("memo", Duration::from_secs(1)).await?;
    kv.put("a", "aged out before the node saw it".into())
        .await?;
    wait_aged_out(&kv).await?;
    // Still evicting, but slowly enough that `c` outlives the node's catch-up.
    set_max_age(&kv, "memo", Duration::from_secs(3600)).await?;
    kv.put("c", "c1".into()).await?;
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("node");
    ok(&catch_up(&h, "memo", &store, &[])?, "catch-up")?;
    assert!(status_store(&store)?.eviction_seen, "the memo is committed");
    // The fold still has `c`; then the operator turns eviction off.
    set_max_age(&kv, "memo", Duration::ZERO).await?;
    let r = kv
        .retention()
        .await?
        .ok_or_else(|| anyhow::anyhow!("no retention"))?;
    assert!(!r.evicts_current_values, "{r:?}");
    // The node's cursor expires by rewrites; a listing now looks like the truth, but the fold
    // remembers.
    kv.put("d", "d1".into()).await?;
    for i in 0..3 {
        kv.put("c", format!("c{i}").into()).await?;
        kv.put("d", format!("d{i}").into()).await?;
    }
    let before = dump_store(&store)?;
    let o = catch_up(&h, "memo", &store, &["--repair", "relist"])?;
    assert!(!o.status.success());
    let err = error_line(&o);
    assert!(err.contains("eviction memo"), "{err}");
    assert_eq!(dump_store(&store)?, before);
    // A fold without the memo (a fresh copy of the data at the same cursor) would be re-listed:
    // the memo, not the bucket, is what refuses.
    let bare = tmp.path().join("bare");
    {
        let (src, _) = AnyStore::open_read_only(&store)?;
        let (mut dst, _) = AnyStore::open(&bare, Backend::AppendLog)?;
        let rows = src.range("")?;
        let updates: Vec<KvUpdate> = rows.into_iter().map(KvUpdate::Put).collect();
        dst.apply(&updates, WatchCursor::at(src.cursor().revision_or_zero()))?;
    }
    ok(
        &catch_up(&h, "memo", &bare, &["--repair", "relist"])?,
        "bare fold re-list",
    )?;
    Ok(())
}
