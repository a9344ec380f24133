//! Stored messages the fold cannot decode (docs/design.md, "What a stored message means"): the six
//! header blocks nats-server accepts from a raw `HPUB` and stores as written, which stalled the fold
//! at the first one for good on both delivery paths. Each is a logged, counted skip whose revision
//! the cursor passes, on a cursorless start (the re-list), live, and on a resume's catch-up, with
//! the lean delivery and with the client's ordered consumer; both nodes end with the same fold.

use foldhost_core::kv::{KvReader as _, KvWriter as _};
use foldhost_tests::{Harness, dump_store, run_command, terminate, wait_status};

use crate::watch_semantics::raw_publish;

/// The six header blocks. nats-server 2.15 stores the first five as written; the status line it
/// drops, storing the message without headers: a put on every path. The line without a colon
/// comes first: on the ordered consumer it drops the client's connection and the resume's
/// catch-up reads the rest; a CR inside a value that the ordered consumer itself delivers panics
/// the client library and fails the node (docs/design.md, "What a stored message means").
const ODD: [&[u8]; 6] = [
    b"NATS/1.0\r\nbad line\r\n\r\n",
    b"NATS/1.0\r\nNats-Marker-Reason: a\rb\r\n\r\n",
    b"NATS/1.0\r\nKV-Operation: DE\rL\r\n\r\n",
    b"NATS/1.0\r\nX-Bytes: \xff\xfe\r\n\r\n",
    b"NATS/1.0\r\nKV-Operation : DEL\r\n\r\n",
    b"NATS/1.0 0100\r\n\r\n",
];

fn addr() -> anyhow::Result<String> {
    Ok(format!(
        "127.0.0.1:{}",
        foldhost_localnats::reserved_port()?
    ))
}

/// One round of writes: for each odd block an ordinary write, the odd message on a key of its
/// own, and an odd message on a key an ordinary write then overwrites (the bucket keeps one
/// message per key: a node that was not reading then never sees that odd message); an ordinary
/// write last.
async fn round(h: &Harness, kv: &foldhost_nats::NatsKv, r: &str) -> anyhow::Result<()> {
    for (i, block) in ODD.iter().enumerate() {
        kv.put(&format!("k.{r}.{i}"), format!("v{r}{i}").into())
            .await?;
        raw_publish(&h.url(), &format!("$KV.undec.odd.{r}.{i}"), block, b"x").await?;
        raw_publish(&h.url(), &format!("$KV.undec.over.{r}.{i}"), block, b"x").await?;
        kv.put(&format!("over.{r}.{i}"), "kept".into()).await?;
    }
    kv.put(&format!("k.{r}.last"), "last".into()).await?;
    Ok(())
}

/// The nodes a test started, killed when it ends however it ends (a failed wait must not leave
/// them running).
struct Nodes(Vec<std::process::Child>);

impl Drop for Nodes {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// `r`, or its error with the nodes' logs.
fn logged<T>(tmp: &tempfile::TempDir, r: anyhow::Result<T>) -> anyhow::Result<T> {
    r.map_err(|e| {
        let logs: Vec<String> = ["lean", "ordered", "cr-lean", "cr-ordered"]
            .iter()
            .map(|n| {
                let l = std::fs::read_to_string(tmp.path().join(format!("{n}.log")));
                format!("--- {n}:\n{}", l.unwrap_or_default())
            })
            .collect();
        e.context(logs.join("\n"))
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_undecodable_message_is_skipped_and_counted_not_a_stall_on_every_path()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("undec").await?;
    round(&h, &kv, "a").await?;
    let tmp = tempfile::tempdir()?;
    // (name, lean delivery) — the default, and the client's ordered consumer.
    let nodes = [("lean", true), ("ordered", false)];
    let start = |name: &str, lean: bool, listen: &str| {
        let mut c = run_command(&h, "undec", &tmp.path().join(name), Some(listen));
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(tmp.path().join(format!("{name}.log")))?;
        c.stderr(log);
        if !lean {
            c.env(foldhost_nats::LEAN_DELIVERY_ENV, "off");
        }
        c.spawn()
    };
    let at_last = |last: u64, skipped: u64| {
        move |s: &foldhost_core::status::StatusReport| {
            s.cursor == Some(last) && s.skipped_messages >= skipped
        }
    };
    // A cursorless start: the re-list meets each odd key's last message.
    let addrs: Vec<String> = nodes.iter().map(|_| addr()).collect::<Result<_, _>>()?;
    let mut children = Nodes(Vec::new());
    for ((name, lean), a) in nodes.iter().zip(&addrs) {
        children.0.push(start(name, *lean, a)?);
    }
    let last = kv.positions().await?.last_sequence;
    for a in &addrs {
        let s = logged(&tmp, wait_status(a, at_last(last, 5)).await)?;
        let skipped = s.last_skipped.expect("a last skipped message");
        assert!(
            skipped.subject.starts_with("$KV.undec.odd.a."),
            "{skipped:?}"
        );
    }
    // Live.
    round(&h, &kv, "b").await?;
    let last = kv.positions().await?.last_sequence;
    for a in &addrs {
        let s = logged(&tmp, wait_status(a, at_last(last, 10)).await)?;
        // The last undecodable message still stored is odd.b.4 (a node that read live may have
        // met over.b.4 after it).
        let l = s.last_skipped.expect("a last skipped message");
        assert!(
            l.subject.ends_with(".b.4") && l.reason == "bad-header-name" && l.revision >= last - 7,
            "{l:?}"
        );
    }
    // A resume: stopped, odd and ordinary writes, restarted (the gap's catch-up).
    for c in &mut children.0 {
        terminate(c)?;
    }
    round(&h, &kv, "c").await?;
    let last = kv.positions().await?.last_sequence;
    let mut children = Nodes(Vec::new());
    for ((name, lean), a) in nodes.iter().zip(&addrs) {
        children.0.push(start(name, *lean, a)?);
    }
    for a in &addrs {
        let s = logged(&tmp, wait_status(a, at_last(last, 5)).await)?;
        // odd.c.0-4, each once; over.c.* were overwritten before the restart.
        assert_eq!(
            s.skipped_messages, 5,
            "each undecodable message of the gap, once"
        );
    }
    for c in &mut children.0 {
        terminate(c)?;
    }
    let lean = dump_store(&tmp.path().join("lean"))?;
    let ordered = dump_store(&tmp.path().join("ordered"))?;
    assert_eq!(lean, ordered, "the two delivery paths folded differently");
    for r in ["a", "b", "c"] {
        for i in 0..ODD.len() {
            assert!(lean.contains_key(&format!("k.{r}.{i}")), "k.{r}.{i}");
            assert_eq!(
                lean.get(&format!("over.{r}.{i}")).map(|v| v.0.as_slice()),
                Some(&b"kept"[..])
            );
            // The status line's message was stored without headers: a put.
            assert_eq!(
                lean.contains_key(&format!("odd.{r}.{i}")),
                i == 5,
                "odd.{r}.{i}"
            );
        }
        assert!(lean.contains_key(&format!("k.{r}.last")));
    }
    Ok(())
}

/// The client's ordered consumer (a TLS or credentials node takes it) meets a message its library
/// cannot read after a stop, in a gap longer than a resume's catch-up reads and full of removed
/// messages (keys overwritten): the library drops its connection there, and the next watch reads
/// past it through the stream API whatever the gap holds ([`foldhost_core::protocol::catch_up_range`]).
/// Before, the catch-up read only a short gap with few absences, so every re-created consumer met
/// the message again, for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ordered_consumer_reads_past_an_undecodable_message_in_a_long_gap_of_overwrites()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("longgap").await?;
    kv.put("k.000", "v0".into()).await?;
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("ordered");
    let listen = addr()?;
    let start = || {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(tmp.path().join("ordered.log"))?;
        run_command(&h, "longgap", &store, Some(&listen))
            .env(foldhost_nats::LEAN_DELIVERY_ENV, "off")
            .stderr(log)
            .spawn()
    };
    let mut node = Nodes(vec![start()?]);
    logged(&tmp, wait_status(&listen, |s| s.cursor == Some(1)).await)?;
    for c in &mut node.0 {
        terminate(c)?;
    }
    // The message the library cannot read right after the cursor, then eight passes over 300
    // keys: a gap of 2 401 sequences, seven eighths of them removed by the time the node
    // restarts.
    raw_publish(&h.url(), "$KV.longgap.odd", ODD[0], b"x").await?;
    let keys = 300u32;
    for pass in 0..8u32 {
        foldhost_tests::publish_all(
            kv.jetstream(),
            (0..keys).map(|i| {
                (
                    format!("$KV.longgap.k.{i:03}"),
                    bytes::Bytes::from(format!("p{pass}")),
                )
            }),
        )
        .await?;
    }
    let last = kv.positions().await?.last_sequence;
    assert!(
        last - 1 > foldhost_core::protocol::DIRECT_CATCH_UP_MAX,
        "the gap is longer than a resume's catch-up"
    );
    let mut node = Nodes(vec![start()?]);
    let s = logged(
        &tmp,
        wait_status(&listen, |s| {
            s.cursor == Some(last) && s.skipped_messages == 1
        })
        .await,
    )?;
    let skipped = s.last_skipped.expect("the undecodable message, named");
    assert_eq!(
        (skipped.revision, skipped.subject.as_str()),
        (2, "$KV.longgap.odd")
    );
    for c in &mut node.0 {
        terminate(c)?;
    }
    let fold = dump_store(&store)?;
    assert_eq!(
        fold.len(),
        keys as usize,
        "every key, nothing of the odd one"
    );
    for i in 0..keys {
        assert_eq!(
            fold.get(&format!("k.{i:03}")).map(|v| v.0.as_slice()),
            Some(&b"p7"[..]),
            "k.{i:03}"
        );
    }
    Ok(())
}

/// A CR inside a header value is the one stored block async-nats 0.51 cannot survive: its
/// connection task panics (an assertion in its header parser) and its ordered consumer then
/// polls a finished future, which failed the node for good. The ordered consumer delivers on a
/// connection of its own, the panic is caught there, and the next watch reads past the message
/// through the stream API on a new connection: both when it is the very first delivery of a
/// cursorless start (the state-sync start then reads the stream from its first sequence) and
/// live. Each ends at the stream's last sequence with the same fold as a lean node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cr_inside_a_value_delivered_by_the_ordered_consumer_fails_only_its_own_connection_and_is_read_past()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("crv").await?;
    // The stream's first message: the first delivery of a state-sync start.
    raw_publish(&h.url(), "$KV.crv.odd.first", ODD[2], b"x").await?;
    for i in 0..20 {
        kv.put(&format!("k.{i}"), format!("v{i}").into()).await?;
    }
    let tmp = tempfile::tempdir()?;
    let nodes = [("cr-lean", true), ("cr-ordered", false)];
    let addrs: Vec<String> = nodes.iter().map(|_| addr()).collect::<Result<_, _>>()?;
    let mut children = Nodes(Vec::new());
    for ((name, lean), a) in nodes.iter().zip(&addrs) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(tmp.path().join(format!("{name}.log")))?;
        let mut c = run_command(&h, "crv", &tmp.path().join(name), Some(a));
        c.stderr(log);
        if !lean {
            c.env(foldhost_nats::LEAN_DELIVERY_ENV, "off");
        }
        children.0.push(c.spawn()?);
    }
    let last = kv.positions().await?.last_sequence;
    for a in &addrs {
        let s = logged(
            &tmp,
            wait_status(a, |s| s.cursor == Some(last) || s.state == "failed").await,
        )?;
        assert_eq!(
            (s.state.as_str(), s.error.as_deref(), s.skipped_messages),
            ("running", None, 1),
            "the cursorless start passes the message"
        );
    }
    // Live, on a watch that has delivered before: both CR blocks, between ordinary writes.
    for (i, block) in [ODD[1], ODD[2]].iter().enumerate() {
        kv.put(&format!("live.{i}"), "before".into()).await?;
        raw_publish(&h.url(), &format!("$KV.crv.odd.live.{i}"), block, b"x").await?;
        kv.put(&format!("live.{i}.after"), "after".into()).await?;
    }
    let last = kv.positions().await?.last_sequence;
    for a in &addrs {
        let s = logged(
            &tmp,
            wait_status(a, |s| s.cursor == Some(last) || s.state == "failed").await,
        )?;
        assert_eq!(
            (s.state.as_str(), s.error.as_deref(), s.skipped_messages),
            ("running", None, 3),
            "each live message passed, once"
        );
    }
    for c in &mut children.0 {
        terminate(c)?;
    }
    let log = std::fs::read_to_string(tmp.path().join("cr-ordered.log"))?;
    assert!(
        log.contains("through the stream API on a new connection"),
        "the ordered node met the library's failure and said so:\n{log}"
    );
    let lean = dump_store(&tmp.path().join("cr-lean"))?;
    let ordered = dump_store(&tmp.path().join("cr-ordered"))?;
    assert_eq!(lean, ordered, "the two delivery paths folded differently");
    assert_eq!(lean.len(), 24, "k.0-19 and the four live writes: {lean:?}");
    assert!(lean.keys().all(|k| !k.starts_with("odd.")));
    Ok(())
}

/// Listings (`keys`, `scan`: the CLI's and the re-list repair's) and single reads (`entry`)
/// meet each of the six odd blocks as the fold does, through the decoder: an undecodable latest
/// message lists nothing for its key, and reading that key says why, in one error. The node's
/// client survives them all (a CR block used to panic its connection task under a listing).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listings_and_single_reads_decode_every_odd_block_and_the_client_survives_them()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("undec").await?;
    round(&h, &kv, "a").await?;
    let keys = kv.keys("").await?;
    let scanned: Vec<String> = kv.scan("").await?.into_iter().map(|e| e.key).collect();
    assert_eq!(keys, scanned);
    let mut want: Vec<String> = (0..ODD.len())
        .flat_map(|i| [format!("k.a.{i}"), format!("over.a.{i}")])
        .chain(["k.a.last".to_string(), "odd.a.5".to_string()])
        .collect();
    want.sort();
    assert_eq!(keys, want, "the decodable live keys, nothing of an odd one");
    for i in 0..ODD.len() - 1 {
        let key = format!("odd.a.{i}");
        let e = kv.entry(&key).await;
        assert!(
            matches!(&e, Err(foldhost_core::kv::KvError::Backend { reason, .. }) if reason.contains("undecodable")),
            "{key}: {e:?}"
        );
    }
    let e = kv.entry("k.a.0").await?.expect("an entry");
    assert_eq!(e.value.as_ref(), b"va0");
    assert!(kv.entry("absent.key").await?.is_none());
    // The client still works.
    kv.put("after", "ok".into()).await?;
    assert_eq!(
        kv.entry("after").await?.map(|e| e.value),
        Some(bytes::Bytes::from("ok"))
    );
    Ok(())
}
