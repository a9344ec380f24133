//! Bucket creation, with the raw fallback hosted NATS needs (docs/operations.md, "Hosted NATS"; Synadia Cloud):
//! some providers answer `$JS.API.STREAM.CREATE` in shapes the client's `create_key_value` cannot
//! parse, or answer "maximum number of streams reached" for an account at its limit even when the
//! bucket is already there.
//!
//! Invariants:
//! - The client's own `create_key_value` is tried first. Any failure of it (a parse-shaped error
//!   or a timeout included: the providers the fallback exists for are also the slow, distant
//!   ones) that leaves the bucket absent sends the same configuration as a plain request.
//! - The raw path sends [`kv_stream_config`], the stream the client would create for the bucket,
//!   and reads the reply only through [`parse_stream_create_reply`] and
//!   [`protocol::stream_create_verdict`].
//! - A non-fatal verdict ("created", "already exists", "at the stream limit") is success only
//!   once the bucket is then found: the create never reports a bucket it cannot open.
//! - Replies are read up to [`MAX_REPLY_SHOWN`] characters into an error; nothing of a reply is
//!   trusted beyond its error fields.

use std::time::Duration;

use async_nats::jetstream::{self, kv, stream};

use super::{backend, timed};
use foldhost_core::bucket::{BucketConfig, StorageType};
use foldhost_core::kv::KvError;
use foldhost_core::protocol::{self, StreamCreateVerdict};

/// Most characters of a provider's reply quoted in an error.
pub(crate) const MAX_REPLY_SHOWN: usize = 200;

/// The JetStream stream of a KV bucket `bucket` under `config`: what `create_key_value` sends
/// (subjects `$KV.<bucket>.>`, history as the per-subject limit, rollups allowed, deletes denied,
/// direct gets allowed, new messages discarded at the size cap).
pub fn kv_stream_config(bucket: &str, config: &BucketConfig) -> stream::Config {
    stream::Config {
        name: format!("KV_{bucket}"),
        subjects: vec![format!("$KV.{bucket}.>")],
        max_messages_per_subject: config.max_history.max(1),
        max_bytes: config.max_bytes.unwrap_or(-1),
        max_age: config.max_age.unwrap_or_default(),
        storage: match config.storage {
            StorageType::File => stream::StorageType::File,
            StorageType::Memory => stream::StorageType::Memory,
        },
        num_replicas: config.num_replicas.max(1),
        allow_rollup: true,
        deny_delete: true,
        deny_purge: false,
        allow_direct: true,
        discard: stream::DiscardPolicy::New,
        ..Default::default()
    }
}

/// The client's KV configuration for the same bucket (the standard path).
fn kv_config(bucket: &str, config: &BucketConfig) -> kv::Config {
    kv::Config {
        bucket: bucket.to_string(),
        history: config.max_history,
        max_bytes: config.max_bytes.unwrap_or(-1),
        max_age: config.max_age.unwrap_or_default(),
        num_replicas: config.num_replicas,
        storage: match config.storage {
            StorageType::File => stream::StorageType::File,
            StorageType::Memory => stream::StorageType::Memory,
        },
        ..Default::default()
    }
}

/// Reads a raw stream-create reply: its verdict and, for an error, the description it gave (or
/// what the reply was, when it is not JSON at all). Providers differ in where they put the
/// JetStream code and whether numbers are strings, so both are accepted.
pub fn parse_stream_create_reply(raw: &[u8]) -> (StreamCreateVerdict, String) {
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(raw) else {
        return (
            StreamCreateVerdict::Refused,
            format!("unreadable reply: {}", shown(raw)),
        );
    };
    let Some(err) = v.get("error").filter(|e| !e.is_null()) else {
        return (protocol::stream_create_verdict(None), String::new());
    };
    let number = |field: &str| {
        err.get(field).and_then(|n| {
            n.as_u64()
                .or_else(|| n.as_str().and_then(|s| s.trim().parse().ok()))
        })
    };
    let description = err
        .get("description")
        .and_then(|d| d.as_str())
        .map(|d| d.chars().take(MAX_REPLY_SHOWN).collect::<String>())
        .unwrap_or_else(|| shown(raw));
    (
        protocol::stream_create_verdict(Some((number("code"), number("err_code"), &description))),
        description,
    )
}

fn shown(raw: &[u8]) -> String {
    String::from_utf8_lossy(raw)
        .chars()
        .take(MAX_REPLY_SHOWN)
        .collect()
}

/// Sends the bucket's stream configuration as a plain `$JS.API.STREAM.CREATE` request and returns
/// the verdict with the reply's description. `Refused` is returned as an error naming the bucket.
pub async fn create_bucket_raw(
    client: &async_nats::Client,
    bucket: &str,
    config: &BucketConfig,
    timeout: Duration,
) -> Result<StreamCreateVerdict, KvError> {
    let stream_config = kv_stream_config(bucket, config);
    let body = serde_json::to_vec(&stream_config).map_err(|e| backend("raw create bucket", e))?;
    let subject = format!("$JS.API.STREAM.CREATE.{}", stream_config.name);
    let reply = timed("raw create bucket", timeout, async {
        client
            .request(subject, body.into())
            .await
            .map_err(|e| backend("raw create bucket", e))
    })
    .await?;
    match parse_stream_create_reply(&reply.payload) {
        (StreamCreateVerdict::Refused, why) => Err(KvError::Backend {
            op: "create bucket",
            reason: format!("bucket {bucket}: the server refused the stream: {why}"),
        }),
        (verdict, _) => Ok(verdict),
    }
}

/// Creates `bucket`: the client's path first, then the raw request (see the module invariants).
pub(super) async fn create_bucket(
    client: &async_nats::Client,
    js: &jetstream::Context,
    bucket: &str,
    config: &BucketConfig,
    timeout: Duration,
) -> Result<kv::Store, KvError> {
    let standard = timed("create bucket", timeout, async {
        js.create_key_value(kv_config(bucket, config))
            .await
            .map_err(|e| backend("create bucket", e))
    })
    .await;
    let first = match standard {
        Ok(kv) => return Ok(kv),
        Err(e) => e,
    };
    // Another node may have created it between our look and our create (a fleet starts
    // together): the bucket being there is success.
    if let Ok(kv) = js.get_key_value(bucket).await {
        tracing::info!(event = "bucket_create_raced", bucket, error = %first, "bucket create answered an error, but the bucket is there: using it");
        return Ok(kv);
    }
    let verdict = create_bucket_raw(client, bucket, config, timeout)
        .await
        .map_err(|raw| KvError::Backend {
            op: "create bucket",
            reason: format!("{first}; the raw create then failed too: {raw}"),
        })?;
    match timed("get bucket", timeout, async {
        js.get_key_value(bucket)
            .await
            .map_err(|e| backend("get bucket", e))
    })
    .await
    {
        Ok(kv) => {
            tracing::info!(event = "bucket_created_raw", bucket, ?verdict, error = %first, "bucket created through the raw stream API");
            Ok(kv)
        }
        Err(e) => Err(KvError::Backend {
            op: "create bucket",
            reason: format!(
                "bucket {bucket}: {first}; the raw create answered {verdict:?} but the bucket is not there: {e}"
            ),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_of_the_server_and_of_providers_read_to_their_verdicts() {
        use StreamCreateVerdict::*;
        let ok = br#"{"type":"io.nats.jetstream.api.v1.stream_create_response","config":{"name":"KV_a"}}"#;
        assert_eq!(parse_stream_create_reply(ok).0, Created);
        let null_error = br#"{"error":null,"config":{}}"#;
        assert_eq!(parse_stream_create_reply(null_error).0, Created);
        let in_use = br#"{"error":{"code":400,"err_code":10058,"description":"stream name already in use with a different configuration"}}"#;
        assert_eq!(parse_stream_create_reply(in_use).0, AlreadyExists);
        let as_strings = br#"{"error":{"code":"10058","description":"exists"}}"#;
        assert_eq!(parse_stream_create_reply(as_strings).0, AlreadyExists);
        let limit = br#"{"error":{"code":400,"description":"maximum number of streams reached"}}"#;
        assert_eq!(parse_stream_create_reply(limit).0, AtStreamLimit);
        let other =
            br#"{"error":{"code":500,"err_code":10049,"description":"insufficient resources"}}"#;
        assert_eq!(
            parse_stream_create_reply(other),
            (Refused, "insufficient resources".to_string())
        );
        let garbage = b"<html>bad gateway</html>";
        let (v, why) = parse_stream_create_reply(garbage);
        assert_eq!(v, Refused);
        assert!(why.contains("bad gateway"), "{why}");
        let huge = vec![b'x'; 10_000];
        assert!(parse_stream_create_reply(&huge).1.len() < MAX_REPLY_SHOWN + 32);
    }

    #[test]
    fn the_raw_stream_is_the_clients_kv_stream() {
        let c = BucketConfig {
            max_history: 5,
            max_bytes: Some(1 << 20),
            max_age: Some(Duration::from_secs(60)),
            num_replicas: 3,
            ..BucketConfig::default()
        };
        let s = kv_stream_config("routes", &c);
        assert_eq!(s.name, "KV_routes");
        assert_eq!(s.subjects, vec!["$KV.routes.>".to_string()]);
        assert_eq!(
            (s.max_messages_per_subject, s.max_bytes, s.num_replicas),
            (5, 1 << 20, 3)
        );
        assert!(s.allow_rollup && s.deny_delete && s.allow_direct && !s.deny_purge);
        assert_eq!(s.discard, stream::DiscardPolicy::New);
    }
}
