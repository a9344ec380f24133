//! Not an API: the entry points the fuzz targets (`fuzz/fuzz_targets/`) and the corpus replay
//! share (docs/fuzzing.md). Compiled only for this crate's tests and with the `fuzzing` feature.
//!
//! [`nats_wire`] takes any bytes as what a server sent on a lean delivery connection and panics
//! only when one of these fails:
//! - `wire::parse_op`, read op after op as the lean connection reads its buffer, is total: an
//!   operation it returns lies inside the bytes it consumed (at least one), and the same bytes
//!   parse the same way with nothing after them, while every cut before the operation's end
//!   (the last byte, the LF of its control line) is `Ok(None)`, an incomplete operation that
//!   consumes nothing. A message under a smaller `max_payload` parses the same or is too large.
//! - Differential, against the client library (async-nats 0.51) where its own parsing is public:
//!   a `MSG`/`HMSG` the library frames (its `connection.rs` framing, transcribed, over the lines a
//!   server writes: printable ASCII, CRLF after the payload) is framed by `parse_op` with the same
//!   subject, reply, header block and payload. A header block (each `HMSG`'s, and the whole
//!   input as one) is read by the library's own `HeaderName`, `HeaderValue`, `StatusCode` and
//!   `HeaderMap` along its `connection.rs` lines: where the library accepts it, `parse_headers`
//!   answers the same status, description and values, and `decode_stored_record` the operation
//!   and operation id the fold gets through the library; where the library refuses it (an error
//!   or its value assertion, a panic) or reads a status line, `decode_stored_record` answers
//!   undecodable, never another operation.
//! - The other parsers of what a server sends: a direct get's JSON answer
//!   (`catchup::parse_msg_get_reply`, which must agree with `decode_stored_record` on its header
//!   block), a stream-create reply, an `INFO`, an ACK subject (`protocol::parse_ack_subject`,
//!   whose fields survive a round trip through the subject a server writes), a headers-only
//!   size, an export lease: total, never a panic. And the addresses and `.creds` texts a node is
//!   given (`server_address`, `parse_creds`): total, and what they return is well formed.

use std::ops::Range;
use std::str::FromStr as _;

use async_nats::header::{HeaderMap, HeaderName, HeaderValue};
use foldhost_core::protocol::{self, KvOp, Undecodable};

use crate::wire::{self, ServerOp};

/// What the client library does with a header block.
#[derive(Debug)]
enum Library {
    /// Accepted: the status line's code and description, and the headers.
    Accepted {
        status: Option<u16>,
        description: Option<String>,
        headers: HeaderMap,
    },
    /// An error: the library drops its connection.
    Refused,
    /// A header value with a CR or LF left in it: the library's assertion panics in its
    /// connection task.
    Panicked,
}

/// The client library's reading of a header block: async-nats 0.51 `connection.rs`,
/// `try_read_op`, `HMSG`, line for line, through the library's own public types.
fn library_reading(block: &[u8]) -> Library {
    let Ok(text) = std::str::from_utf8(block) else {
        return Library::Refused;
    };
    let mut lines = text.lines().peekable();
    let Some(version_line) = lines.next() else {
        return Library::Refused;
    };
    let Some(suffix) = version_line.strip_prefix("NATS/1.0").map(str::trim) else {
        return Library::Refused;
    };
    let (status, description) = suffix
        .split_once(' ')
        .map(|(s, d)| (s.trim(), d.trim()))
        .unwrap_or((suffix, ""));
    let status = if status.is_empty() {
        None
    } else {
        match async_nats::StatusCode::from_str(status) {
            Ok(s) => Some(s.as_u16()),
            Err(_) => return Library::Refused,
        }
    };
    let description = (!description.is_empty()).then(|| description.to_owned());
    let mut headers = HeaderMap::new();
    while let Some(line) = lines.next() {
        if line.is_empty() {
            continue;
        }
        let Some((name, value)) = line.split_once(':') else {
            return Library::Refused;
        };
        let Ok(name) = HeaderName::from_str(name) else {
            return Library::Refused;
        };
        let mut value = value.trim_start().to_owned();
        while let Some(v) = lines.next_if(|s| s.starts_with(char::is_whitespace)) {
            value.push_str(v);
        }
        value.truncate(value.trim_end().len());
        // `into_header_value` asserts what `from_str` checks.
        let Ok(value) = HeaderValue::from_str(&value) else {
            return Library::Panicked;
        };
        headers.append(name, value);
    }
    Library::Accepted {
        status,
        description,
        headers,
    }
}

/// A header block against the library (module docs).
fn check_header_block(block: &[u8]) {
    let library = library_reading(block);
    let ours = protocol::decode_stored_record(Some(block));
    let text = String::from_utf8_lossy(block);
    match &library {
        Library::Accepted {
            status: None,
            headers,
            ..
        } => {
            let op = crate::header_map_verdict(Some(headers)).expect("a verdict");
            let op_id = headers
                .get(protocol::OP_ID_HEADER)
                .and_then(|v| protocol::OpId::parse(v.as_str()).ok());
            assert_eq!(
                ours,
                Ok((op, op_id)),
                "the library reads {text:?} as {op:?} with id {op_id:?}"
            );
        }
        Library::Accepted {
            status: Some(_), ..
        } => assert_eq!(
            ours,
            Err(Undecodable::StatusLine),
            "a status line to the library: {text:?}"
        ),
        Library::Refused | Library::Panicked => assert!(
            ours.is_err(),
            "the library: {library:?} on {text:?}, the decoder: {ours:?}"
        ),
    }
    let parsed = wire::parse_headers(block);
    if let Library::Accepted {
        status,
        description,
        headers,
    } = &library
    {
        let h = parsed.unwrap_or_else(|e| panic!("the library accepts {text:?}, we: {e}"));
        assert_eq!(h.status, *status, "status of {text:?}");
        assert_eq!(
            h.description,
            description.as_deref(),
            "description of {text:?}"
        );
        let mut total = 0;
        for (name, _) in &h.fields {
            let ours: Vec<&str> = h
                .fields
                .iter()
                .filter(|(n, _)| n == name)
                .map(|(_, v)| v.as_ref())
                .collect();
            let theirs: Vec<&str> = headers.get_all(*name).map(|v| v.as_str()).collect();
            assert_eq!(ours, theirs, "values of {name:?} in {text:?}");
        }
        for (_, values) in headers.iter() {
            total += values.len();
        }
        assert_eq!(h.fields.len(), total, "header lines of {text:?}");
    }
    let _ = wire::stored_msg_size(block);
}

/// The client library's framing of a `MSG` or `HMSG` at the start of `buf` (async-nats 0.51
/// `connection.rs`, `try_read_op`), over the control lines a server writes (printable ASCII) and
/// a payload followed by CRLF; `None` where it would not frame one (an error, more bytes to
/// wait for, or outside that domain). Subject, reply, header block, payload, and bytes taken.
#[allow(clippy::type_complexity)]
fn library_frame(
    buf: &[u8],
) -> Option<(
    Range<usize>,
    Option<Range<usize>>,
    Option<Range<usize>>,
    Range<usize>,
    usize,
)> {
    let len = memchr::memmem::find(buf, b"\r\n")?;
    let line = &buf[..len];
    if !line.iter().all(|b| (0x20..0x7f).contains(b)) {
        return None;
    }
    let with_headers = if line.starts_with(b"MSG ") {
        false
    } else if line.starts_with(b"HMSG ") {
        true
    } else {
        return None;
    };
    let args_at = if with_headers { 5 } else { 4 };
    let mut args = Vec::new();
    let mut i = args_at;
    while i < len {
        if buf[i] == b' ' {
            i += 1;
            continue;
        }
        let start = i;
        while i < len && buf[i] != b' ' {
            i += 1;
        }
        args.push(start..i);
    }
    let sizes = if with_headers { 2 } else { 1 };
    let (subject, sid, reply) = match args.len().checked_sub(sizes) {
        Some(2) => (args[0].clone(), args[1].clone(), None),
        Some(3) => (args[0].clone(), args[1].clone(), Some(args[2].clone())),
        _ => return None,
    };
    let text = |r: &Range<usize>| std::str::from_utf8(&buf[r.clone()]).ok();
    text(&sid)?.parse::<u64>().ok()?;
    let total: usize = text(&args[args.len() - 1])?.parse().ok()?;
    let header_len: usize = if with_headers {
        text(&args[args.len() - 2])?.parse().ok()?
    } else {
        0
    };
    if header_len > total {
        return None;
    }
    let end = len.checked_add(total)?.checked_add(4)?;
    if end > buf.len() || &buf[end - 2..end] != b"\r\n" {
        return None;
    }
    let body = len + 2;
    let headers = with_headers.then(|| body..body + header_len);
    Some((
        subject,
        reply,
        headers,
        body + header_len..body + total,
        end,
    ))
}

/// The fields of an ACK subject survive the subject a server writes for them.
fn check_ack_subject(reply: &[u8]) {
    let Ok(reply) = std::str::from_utf8(reply) else {
        return;
    };
    if let Some(m) = protocol::parse_ack_subject(reply) {
        let again = format!(
            "$JS.ACK.KV_b.c.1.{}.{}.{}.{}",
            m.stream_sequence, m.consumer_sequence, m.timestamp_unix_ns, m.pending
        );
        assert_eq!(protocol::parse_ack_subject(&again), Some(m), "{reply:?}");
    }
}

/// One operation at `buf`'s start, parsed under `max_payload`: checked as the module docs say.
/// Returns the bytes it took (0: none could be parsed).
fn check_op(buf: &[u8], max_payload: usize) -> usize {
    let parsed = wire::parse_op(buf, max_payload);
    check_library_frame(buf, max_payload, &parsed);
    let Ok(Some((op, n))) = parsed else {
        return 0;
    };
    check_prefixes(buf, max_payload, &op, n);
    match &op {
        ServerOp::Msg { .. } => check_msg(buf, &op, n),
        ServerOp::Info(r) => {
            assert!(r.end <= n);
            let _ = serde_json::from_slice::<serde_json::Value>(&buf[r.clone()]);
        }
        ServerOp::Ping | ServerOp::Pong | ServerOp::Ok | ServerOp::Err(_) => {}
    }
    n
}

/// Where the library frames a message at `buf`'s start, `parsed` is the same message.
fn check_library_frame(
    buf: &[u8],
    max_payload: usize,
    parsed: &Result<Option<(ServerOp, usize)>, wire::WireError>,
) {
    if let Some((subject, reply, headers, payload, n)) = library_frame(buf)
        && payload.end - headers.as_ref().map_or(payload.start, |h| h.start) <= max_payload
    {
        match &parsed {
            Ok(Some((
                ServerOp::Msg {
                    subject: s,
                    reply: r,
                    headers: h,
                    payload: p,
                    ..
                },
                took,
            ))) => assert_eq!(
                (s, r, h, p, *took),
                (&subject, &reply, &headers, &payload, n),
                "the library frames {:?} otherwise",
                String::from_utf8_lossy(&buf[..n])
            ),
            other => panic!(
                "the library frames {:?}, parse_op answers {other:?}",
                String::from_utf8_lossy(&buf[..n])
            ),
        }
    }
}

/// The operation `op`, `n` bytes at `buf`'s start: the same alone, incomplete when cut short.
fn check_prefixes(buf: &[u8], max_payload: usize, op: &ServerOp, n: usize) {
    assert!(n > 0 && n <= buf.len(), "took {n} of {}", buf.len());
    assert_eq!(
        wire::parse_op(&buf[..n], max_payload),
        Ok(Some((op.clone(), n))),
        "the same operation alone parses otherwise"
    );
    assert_eq!(
        wire::parse_op(&buf[..n - 1], max_payload),
        Ok(None),
        "an operation without its last byte is not incomplete"
    );
    if let Some(eol) = memchr::memmem::find(&buf[..n], b"\r\n")
        && eol + 1 < n
    {
        assert_eq!(
            wire::parse_op(&buf[..eol + 1], max_payload),
            Ok(None),
            "a control line cut before its LF is not incomplete"
        );
    }
}

/// A message's ranges, its header block, its reply, and its parse under a smaller limit.
fn check_msg(buf: &[u8], op: &ServerOp, n: usize) {
    let ServerOp::Msg {
        subject,
        sid,
        reply,
        headers,
        payload,
    } = op
    else {
        return;
    };
    for r in [Some(subject), Some(sid), reply.as_ref(), Some(payload)]
        .into_iter()
        .flatten()
        .chain(headers)
    {
        assert!(r.start <= r.end && r.end <= n, "{r:?} outside {n}");
    }
    assert!(!subject.is_empty() && !sid.is_empty());
    assert_eq!(payload.end + 2, n);
    if let Some(h) = headers {
        assert_eq!(h.end, payload.start);
        check_header_block(&buf[h.clone()]);
    }
    if let Some(r) = reply {
        check_ack_subject(&buf[r.clone()]);
    }
    // Under a smaller limit: the same message, or too large.
    let small = (payload.end - headers.as_ref().map_or(payload.start, |h| h.start)) / 2;
    match wire::parse_op(buf, small) {
        Ok(Some((o, m))) => assert_eq!((&o, m), (op, n)),
        Err(wire::WireError::TooLarge { .. }) => {}
        other => panic!("under max_payload {small}: {other:?}"),
    }
}

/// What a server sent on a lean delivery connection, and the other parsers of what a server or
/// an operator hands a node (module docs).
pub fn nats_wire(data: &[u8]) {
    let mut at = 0;
    while at < data.len() {
        let n = check_op(&data[at..], wire::MAX_MESSAGE);
        if n == 0 {
            break;
        }
        at += n;
    }
    check_header_block(data);

    if let Ok(Some(m)) = crate::catchup::parse_msg_get_reply(data) {
        let v: serde_json::Value = serde_json::from_slice(data).expect("parsed once");
        use base64::Engine as _;
        let hdrs = v["message"]["hdrs"].as_str().map(|s| {
            base64::engine::general_purpose::STANDARD
                .decode(s)
                .expect("decoded once")
        });
        let want = protocol::decode_stored_record(hdrs.as_deref().filter(|h| !h.is_empty()));
        assert_eq!(
            (m.verdict, m.op_id),
            match want {
                Ok((op, id)) => (Ok(op), id),
                Err(e) => (Err(e), None),
            }
        );
        let _: Result<KvOp, Undecodable> = m.verdict;
    }
    let _ = crate::parse_stream_create_reply(data);
    if let Some(lease) = crate::lease::LeaseValue::from_bytes(data) {
        let again = serde_json::to_vec(&lease).expect("a lease encodes");
        assert!(crate::lease::LeaseValue::from_bytes(&again).is_some());
    }
    let text = String::from_utf8_lossy(data);
    if let Some(a) = wire::server_address(&text) {
        assert!(!a.host.is_empty() && a.host_port.contains(':'), "{a:?}");
    }
    if let Some((jwt, seed)) = wire::parse_creds(&text) {
        for token in [jwt, seed] {
            assert!(
                !token.is_empty()
                    && token
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b"-_.=".contains(&b))
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::{Path, PathBuf};

    fn corpus_dirs() -> [PathBuf; 2] {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz");
        [
            root.join("corpus/nats_wire"),
            root.join("regressions/nats_wire"),
        ]
    }

    #[test]
    fn every_server_byte_stream_in_the_fuzz_corpus_parses_as_the_client_library_reads_it() {
        let [corpus, regressions] = corpus_dirs();
        let mut files = Vec::new();
        for dir in [&corpus, &regressions] {
            for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
                files.push(e.path());
            }
        }
        files.sort();
        assert!(
            files.iter().any(|f| f.starts_with(&corpus)),
            "no corpus at {}",
            corpus.display()
        );
        for f in files {
            eprintln!("replay {}", f.display());
            nats_wire(&std::fs::read(&f).expect("read a corpus file"));
        }
    }

    #[test]
    fn a_control_line_of_the_longest_length_cut_before_its_lf_is_incomplete() {
        // The longest control line, cut after its CR: more bytes will come.
        let mut line = b"MSG ".to_vec();
        line.resize(wire::MAX_CONTROL_LINE - 4, b'a');
        line.extend_from_slice(b" 1 1");
        assert_eq!(line.len(), wire::MAX_CONTROL_LINE);
        line.extend_from_slice(b"\r\nv\r\n");
        check_op(&line, wire::MAX_MESSAGE);
        assert!(matches!(
            wire::parse_op(&line, wire::MAX_MESSAGE),
            Ok(Some(_))
        ));
    }

    /// Writes the seeds of `fuzz/corpus/nats_wire/` (docs/fuzzing.md, "Seeds"): the bytes a real
    /// nats-server (`NATS_SERVER_BIN`) sends a client through KV puts, deletes, purges, gets, a
    /// watch (with its heartbeat) and direct gets, captured by a proxy between them and cut at
    /// operation boundaries; and the header blocks of the client library's known readings.
    /// `NATS_SERVER_BIN=… cargo test -p foldhost-nats --features fuzzing write_the_seed_corpus
    /// -- --ignored`.
    #[test]
    #[ignore = "writes fuzz/corpus: run by hand, with NATS_SERVER_BIN, to regenerate the seeds"]
    fn write_the_seed_corpus() {
        let [dir, _] = corpus_dirs();
        std::fs::create_dir_all(&dir).expect("corpus directory");
        let write = |bytes: &[u8]| {
            let name = blake3::hash(bytes).to_hex();
            std::fs::write(dir.join(&name[..40]), bytes).expect("write a seed");
        };
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        let (captured, replies) = rt.block_on(capture::session());
        // Cut at operation boundaries into seeds of at most 2 KiB (an operation longer alone).
        let mut at = 0;
        let mut start = 0;
        while at < captured.len() {
            match wire::parse_op(&captured[at..], wire::MAX_MESSAGE) {
                Ok(Some((_, n))) => {
                    if at + n - start > 2048 && at > start {
                        write(&captured[start..at]);
                        start = at;
                    }
                    at += n;
                }
                _ => break,
            }
        }
        if at > start {
            write(&captured[start..at]);
        }
        for r in replies {
            write(&r);
        }
        for block in [
            &b"NATS/1.0\r\nbad line\r\n\r\n"[..],
            b"NATS/1.0\r\nNats-Marker-Reason: a\rb\r\n\r\n",
            b"NATS/1.0\r\nKV-Operation : DEL\r\n\r\n",
            b"NATS/1.0 100 FlowControl Request\r\n\r\n",
            b"NATS/1.0\r\nkv-operation: DEL\r\n\r\n",
            b"NATS/1.0\nKV-Operation: DEL\nX: y\r\n\r\n",
            b"NATS/1.0\r\nKV-Operation:\r\n DEL\r\n\r\n",
            b"NATS/1.0\r\nX: a\r\r\n\r\n",
        ] {
            write(block);
        }
        write(b"-----BEGIN NATS USER JWT-----\neyJ0eXAi.eyJqdGki.sig-_x\n------END NATS USER JWT------\n\n-----BEGIN USER NKEY SEED-----\nSUAIO3FHUX5PNV2LQIIP7TZ3N4L7TX3W53MQGEIVYFIGA635OZCKEYHFLM\n------END USER NKEY SEED------\n");
        write(b"tls://user:pass@[::1]:4443");
    }

    mod capture {
        use std::sync::{Arc, Mutex};
        use std::time::Duration;

        use futures::StreamExt as _;
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        use tokio::net::{TcpListener, TcpStream};

        /// A nats-server of its own, in a directory of its own, killed when dropped.
        struct Server {
            child: std::process::Child,
            dir: std::path::PathBuf,
            port: u16,
        }

        impl Drop for Server {
            fn drop(&mut self) {
                let _ = self.child.kill();
                let _ = self.child.wait();
                let _ = std::fs::remove_dir_all(&self.dir);
            }
        }

        async fn server() -> Server {
            let bin = std::env::var("NATS_SERVER_BIN").unwrap_or_else(|_| "nats-server".into());
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .expect("a free port")
                .port();
            let dir = std::env::temp_dir().join(format!("foldhost-seed-nats-{port}"));
            std::fs::create_dir_all(&dir).expect("store dir");
            let child = std::process::Command::new(bin)
                .args(["-js", "-a", "127.0.0.1", "-p", &port.to_string(), "-sd"])
                .arg(&dir)
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .expect("start nats-server");
            for _ in 0..100 {
                if TcpStream::connect(("127.0.0.1", port)).await.is_ok() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Server { child, dir, port }
        }

        /// A proxy to `port` recording what the server sends.
        async fn proxy(port: u16, seen: Arc<Mutex<Vec<u8>>>) -> u16 {
            let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
            let local = listener.local_addr().expect("addr").port();
            tokio::spawn(async move {
                while let Ok((client, _)) = listener.accept().await {
                    let seen = seen.clone();
                    tokio::spawn(async move {
                        let Ok(upstream) = TcpStream::connect(("127.0.0.1", port)).await else {
                            return;
                        };
                        let (mut cr, mut cw) = client.into_split();
                        let (mut ur, mut uw) = upstream.into_split();
                        tokio::spawn(async move {
                            let _ = tokio::io::copy(&mut cr, &mut uw).await;
                        });
                        let mut buf = vec![0u8; 64 * 1024];
                        while let Ok(n) = ur.read(&mut buf).await {
                            if n == 0 {
                                break;
                            }
                            seen.lock().expect("capture").extend_from_slice(&buf[..n]);
                            if cw.write_all(&buf[..n]).await.is_err() {
                                break;
                            }
                        }
                    });
                }
            });
            local
        }

        /// The server's bytes of one KV session, and the direct-get answers' payloads.
        pub(super) async fn session() -> (Vec<u8>, Vec<Vec<u8>>) {
            let server = server().await;
            let seen = Arc::new(Mutex::new(Vec::new()));
            let port = proxy(server.port, seen.clone()).await;
            let client = async_nats::connect(format!("nats://127.0.0.1:{port}"))
                .await
                .expect("connect through the proxy");
            let js = async_nats::jetstream::new(client.clone());
            let kv = js
                .create_key_value(async_nats::jetstream::kv::Config {
                    bucket: "fz".into(),
                    history: 5,
                    ..Default::default()
                })
                .await
                .expect("create the bucket");
            kv.put("a", "1".into()).await.expect("put");
            kv.put("b.c", "two".into()).await.expect("put");
            kv.put("a", "3".into()).await.expect("put");
            kv.delete("b.c").await.expect("delete");
            kv.purge("a").await.expect("purge");
            let mut headers = async_nats::HeaderMap::new();
            headers.insert("Foldhost-Op-Id", "0190b2f6-4e3c-7a1b-8c2d-3e4f5a6b7c8d");
            headers.insert("Nats-Msg-Id", "0190b2f6-4e3c-7a1b-8c2d-3e4f5a6b7c8d");
            js.publish_with_headers("$KV.fz.d", headers, "with-id".into())
                .await
                .expect("publish")
                .await
                .expect("ack");
            let _ = kv.get("d").await.expect("get");
            let mut watch = kv.watch_all().await.expect("watch");
            for _ in 0..3 {
                let _ = tokio::time::timeout(Duration::from_secs(2), watch.next()).await;
            }
            // Long enough for the watch's idle heartbeat.
            let _ = tokio::time::timeout(Duration::from_secs(7), watch.next()).await;
            let mut replies = Vec::new();
            for seq in [1u64, 4, 6, 99] {
                let r = client
                    .request(
                        "$JS.API.STREAM.MSG.GET.KV_fz",
                        format!("{{\"seq\":{seq}}}").into(),
                    )
                    .await
                    .expect("a direct get");
                replies.push(r.payload.to_vec());
            }
            client.flush().await.expect("flush");
            tokio::time::sleep(Duration::from_millis(200)).await;
            drop(watch);
            drop(client);
            let captured = seen.lock().expect("capture").clone();
            drop(server);
            (captured, replies)
        }
    }
}
