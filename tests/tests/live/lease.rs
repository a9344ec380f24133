//! The export lease against a real nats-server KV bucket: one holder per round, won and
//! released by compare-and-set only; an expired, dropped or corrupt lease is taken over; a holder
//! whose lease was taken over is told it lost and never overwrites the new holder. Times are passed
//! in (the expiry lives in the value), so nothing here waits on a clock.

use std::sync::Arc;
use std::time::Duration;

use foldhost_core::kv::KvWriter;
use foldhost_nats::lease::{Lease, LeaseBucket, LeaseError};
use foldhost_tests::Harness;

const TTL: Duration = Duration::from_secs(30);
const T0: u64 = 1_800_000_000_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_holder_per_round_and_an_expired_corrupt_or_dropped_lease_is_taken_over()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("leases").await?;
    let bucket: Arc<dyn LeaseBucket> = kv.clone();
    let a = Lease::new(bucket.clone(), "export.routes", "node-a", TTL);
    let b = Lease::new(bucket.clone(), "export.routes", "node-b", TTL);

    // A wins the round; B, while A's lease runs, does not.
    let held_a = a.acquire(T0).await?.expect("a free lease is won");
    assert_eq!(held_a.expires_unix_ms(), T0 + TTL.as_millis() as u64);
    assert!(b.acquire(T0 + 1_000).await?.is_none(), "held by A");

    // A is slow: its lease runs out and B takes it over; A's release is refused as lost.
    let expiry = held_a.expires_unix_ms();
    assert!(b.acquire(expiry - 1).await?.is_none(), "not yet expired");
    let held_b = b
        .acquire(expiry)
        .await?
        .expect("an expired lease is taken over");
    match a.complete(held_a, 5, expiry + 10).await {
        Err(LeaseError::Lost { holder, .. }) => assert_eq!(holder, "node-b"),
        other => panic!("A's release after the takeover: {other:?}"),
    }
    // B completes the round: the lease is free and stamped with B's cursor.
    b.complete(held_b, 7, expiry + 20).await?;
    let v = a.read().await?.expect("a lease value");
    assert_eq!(
        (v.holder.as_str(), v.last_cursor, v.expires_unix_ms),
        ("node-b", Some(7), expiry + 20)
    );

    // Two nodes racing for a free lease: exactly one wins.
    let t = expiry + 30;
    let (ra, rb) = tokio::join!(a.acquire(t), b.acquire(t));
    let (ra, rb) = (ra?, rb?);
    assert!(
        ra.is_some() != rb.is_some(),
        "exactly one winner: {ra:?} {rb:?}"
    );
    let winner = if ra.is_some() { &a } else { &b };
    let held = ra.or(rb).expect("one winner");
    // The round is abandoned: freed, the last completed cursor kept.
    winner.abandon(held, t + 1).await?;
    assert_eq!(a.read().await?.and_then(|v| v.last_cursor), Some(7));

    // A holder that is dropped without releasing (a crashed exporter): the lease runs out by
    // itself and the next round takes it.
    let dropped = a.acquire(t + 2).await?.expect("free");
    let runs_out = dropped.expires_unix_ms();
    drop(dropped);
    assert!(b.acquire(runs_out - 1).await?.is_none());
    assert!(
        b.acquire(runs_out).await?.is_some(),
        "a dropped lease expires"
    );

    // A corrupt lease (a foreign write) is taken over at once.
    kv.put("export.routes", "not a lease".into()).await?;
    assert!(a.read().await?.is_none(), "corrupt reads as none");
    assert!(
        a.acquire(runs_out).await?.is_some(),
        "a corrupt lease is taken over"
    );
    Ok(())
}
