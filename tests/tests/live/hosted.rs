//! Hosted NATS (docs/operations.md, "Hosted NATS"): bucket creation falls back to a raw `$JS.API.STREAM.CREATE`
//! request and classifies "already exists" and "stream limit reached while the bucket is present"
//! as success. Against a real nats-server: the raw path makes the same KV stream the client does,
//! an existing bucket is success, and an account at its JetStream stream limit (a server config
//! with account limits) keeps its bucket usable while a new bucket fails with one line naming the
//! bucket and the limit.

use foldhost_core::bucket::{BucketConfig, ConnectOptions};
use foldhost_core::kv::KvWriter;
use foldhost_core::protocol::StreamCreateVerdict;
use foldhost_localnats::LocalNats;
use foldhost_nats::{NatsConnection, create_bucket_raw};
use std::time::Duration;

const T: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_raw_create_makes_the_clients_kv_stream_and_takes_an_existing_bucket_as_success()
-> anyhow::Result<()> {
    let nats = LocalNats::start()?;
    let conn = NatsConnection::open(ConnectOptions::new(nats.url())).await?;
    let client = conn.client().await?;
    let config = BucketConfig {
        max_history: 3,
        ..BucketConfig::default()
    };

    // The raw path creates a bucket the client then opens and uses as a KV bucket.
    assert_eq!(
        create_bucket_raw(&client, "raw", &config, T).await?,
        StreamCreateVerdict::Created
    );
    let raw = conn.bucket("raw", &config).await?;
    raw.put("k", "v".into()).await?;
    assert_eq!(
        foldhost_core::kv::KvReader::get(raw.as_ref(), "k")
            .await?
            .map(|e| e.value),
        Some("v".into())
    );

    // Its stream is the one the client's own create makes.
    let client_made = conn.bucket("client", &config).await?;
    let js = raw.jetstream();
    let a = js.get_stream("KV_raw").await?.info().await?.config.clone();
    let b = js
        .get_stream("KV_client")
        .await?
        .info()
        .await?
        .config
        .clone();
    assert_eq!(
        (
            a.max_messages_per_subject,
            a.allow_rollup,
            a.deny_delete,
            a.allow_direct,
            a.discard,
            a.max_bytes,
            a.num_replicas
        ),
        (
            b.max_messages_per_subject,
            b.allow_rollup,
            b.deny_delete,
            b.allow_direct,
            b.discard,
            b.max_bytes,
            b.num_replicas
        )
    );
    drop(client_made);

    // The same create again succeeds; one with another configuration is "already exists".
    assert_eq!(
        create_bucket_raw(&client, "raw", &config, T).await?,
        StreamCreateVerdict::Created
    );
    let other = BucketConfig {
        max_history: 7,
        ..BucketConfig::default()
    };
    assert_eq!(
        create_bucket_raw(&client, "raw", &other, T).await?,
        StreamCreateVerdict::AlreadyExists
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_account_at_its_stream_limit_keeps_its_bucket_and_refuses_a_new_one_in_one_line()
-> anyhow::Result<()> {
    let nats = LocalNats::start_with_config(
        r#"
accounts {
  TENANT {
    jetstream { max_streams: 1, max_consumers: -1, max_mem: -1, max_file: -1 }
    users [ { user: tenant, password: secret } ]
  }
}
"#,
    )?;
    let url = format!("nats://tenant:secret@127.0.0.1:{}", nats.port());
    let conn = NatsConnection::open(ConnectOptions::new(url)).await?;
    let client = conn.client().await?;
    let config = BucketConfig::default();
    let routes = conn.bucket("routes", &config).await?;
    routes.put("k", "v".into()).await?;

    // At the limit, a second create of the bucket the account holds is not fatal.
    let other = BucketConfig {
        max_history: 4,
        ..BucketConfig::default()
    };
    let verdict = create_bucket_raw(&client, "routes", &other, T).await?;
    assert!(
        matches!(
            verdict,
            StreamCreateVerdict::AlreadyExists | StreamCreateVerdict::AtStreamLimit
        ),
        "{verdict:?}"
    );
    let again = conn.bucket("routes", &config).await?;
    assert!(
        foldhost_core::kv::KvReader::get(again.as_ref(), "k")
            .await?
            .is_some()
    );

    // A new bucket past the limit fails, through both paths, with one line that names it.
    let err = match conn.bucket("more", &config).await {
        Ok(_) => anyhow::bail!("a bucket past the account's stream limit was created"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains("more") && err.to_lowercase().contains("maximum number of streams"),
        "{err}"
    );
    assert!(!err.contains('\n'), "one line: {err}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_not_allowed_direct_gets_resumes_through_its_consumer_with_exactly_the_gap()
-> anyhow::Result<()> {
    let nats = LocalNats::start_with_config(
        r#"
accounts {
  TENANT {
    jetstream { max_streams: -1, max_consumers: -1, max_mem: -1, max_file: -1 }
    users [ { user: tenant, password: secret, permissions: { publish: { deny: ["$JS.API.DIRECT.GET.>", "$JS.API.STREAM.MSG.GET.>"] } } } ]
  }
}
"#,
    )?;
    let url = format!("nats://tenant:secret@127.0.0.1:{}", nats.port());
    let conn = NatsConnection::open(ConnectOptions::new(url)).await?;
    let kv = conn.bucket("routes", &BucketConfig::default()).await?;
    use foldhost_core::kv::{
        KvUpdate, KvWatcher as _, KvWriter as _, WatchCursor, WatchEvent, WatchScope,
    };
    for i in 0..5 {
        kv.put(&format!("k.{i}"), "before".into()).await?;
    }
    let cursor = kv.positions().await?.last_sequence;
    for i in 0..7 {
        kv.put(&format!("k.{i}"), "after".into()).await?;
    }
    let (tx, mut rx) = tokio::sync::mpsc::channel(64);
    let k = kv.clone();
    let task = tokio::spawn(async move {
        k.watch_from(&WatchScope::All, WatchCursor::at(cursor), tx)
            .await
    });
    let mut got: Vec<KvUpdate> = Vec::new();
    loop {
        match tokio::time::timeout(std::time::Duration::from_secs(120), rx.recv()).await? {
            Some(WatchEvent::Updates(us)) => got.extend(us),
            Some(WatchEvent::CaughtUp { .. }) => break,
            Some(_) => {}
            None => anyhow::bail!("watch ended: {:?}", task.await?),
        }
    }
    task.abort();
    let keys: Vec<&str> = got.iter().map(KvUpdate::key).collect();
    assert_eq!(keys, ["k.0", "k.1", "k.2", "k.3", "k.4", "k.5", "k.6"]);
    assert!(got.iter().all(|u| u.revision().is_some_and(|r| r > cursor)));
    assert_eq!(kv.direct_catch_up_reads(), 0);
    Ok(())
}
