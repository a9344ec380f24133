//! The NATS client protocol as pure functions over bytes, for the lean delivery connection
//! (`lean.rs`): the server's operations a subscriber receives, the header block of an `HMSG`,
//! the `CONNECT` line, and which `--nats` addresses such a connection can dial.
//!
//! Invariants:
//! - Nothing here does I/O or allocates per message: a parsed operation names byte ranges of the
//!   buffer it was parsed from, so the caller slices one frozen buffer per read (no copy of a
//!   payload, no string per subject until the fold needs the key).
//! - Everything is bounded before it is trusted: a control line longer than
//!   [`MAX_CONTROL_LINE`] without its end, a size above the server's `max_payload`, a header block
//!   longer than its message, or a size that does not parse is a [`WireError`], never a wait for
//!   bytes that will not come or an allocation the peer chose.
//! - An incomplete operation is `Ok(None)` and consumes nothing: the same bytes parse the same way
//!   once more arrive.

use std::borrow::Cow;
use std::ops::Range;

/// Longest control line accepted from the server (`MSG <subject> <sid> <reply> <size>`, `INFO`).
///
/// Not the server's own `max_control_line` (4 KiB by default): that bounds what a *client* sends,
/// so a writer may publish a key of nearly 4 KiB whose delivery line — the same subject plus an
/// 80-byte `$JS.ACK` reply — is longer. A limit of 4 KiB here refused such a delivery on every
/// attempt: the watch ended, the fold resumed at the same message and stalled for good. An
/// `INFO` naming a large cluster's `connect_urls` is longer than 4 KiB too.
pub(crate) const MAX_CONTROL_LINE: usize = 64 * 1024;

/// Largest message accepted from the server whatever its `INFO` says: nats-server refuses a
/// `max_payload` above 64 MiB. A stored message may be larger than the server's *current*
/// `max_payload` (lowered after it was written); refusing it would stall the fold at it, as the
/// client library does not.
pub(crate) const MAX_MESSAGE: usize = 64 * 1024 * 1024;

/// What the server sent that a subscriber acts on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum ServerOp {
    /// `INFO {json}`: the JSON's range.
    Info(Range<usize>),
    /// `MSG` or `HMSG`: ranges of the buffer parsed.
    Msg {
        /// The subject.
        subject: Range<usize>,
        /// The subscription id.
        sid: Range<usize>,
        /// The reply subject, when there is one.
        reply: Option<Range<usize>>,
        /// The header block (`NATS/1.0…\r\n\r\n`) of an `HMSG`.
        headers: Option<Range<usize>>,
        /// The payload.
        payload: Range<usize>,
    },
    /// `PING`: answer `PONG`.
    Ping,
    /// `PONG`.
    Pong,
    /// `+OK` (verbose mode only).
    Ok,
    /// `-ERR '<text>'`: the text.
    Err(String),
}

/// A protocol violation (the connection cannot continue).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub(crate) enum WireError {
    /// The control line exceeds [`MAX_CONTROL_LINE`].
    #[error("a control line of more than {MAX_CONTROL_LINE} bytes")]
    LineTooLong,
    /// An operation this client does not know, or malformed arguments.
    #[error("malformed server operation: {0}")]
    Malformed(String),
    /// A message larger than the server's own limit.
    #[error("a message of {size} bytes, above the server's max_payload {max}")]
    TooLarge {
        /// The announced size.
        size: usize,
        /// The limit.
        max: usize,
    },
}

/// Parses one server operation at the start of `buf`: `Ok(None)` until it is complete, else the
/// operation and how many bytes it took. `max_payload` bounds a message's announced size.
pub(crate) fn parse_op(
    buf: &[u8],
    max_payload: usize,
) -> Result<Option<(ServerOp, usize)>, WireError> {
    let Some(eol) = find_crlf(buf) else {
        // A line of the longest length may have its CR here and its LF still to come.
        let cr_pending = buf.len() == MAX_CONTROL_LINE + 1 && buf.ends_with(b"\r");
        return if buf.len() > MAX_CONTROL_LINE && !cr_pending {
            Err(WireError::LineTooLong)
        } else {
            Ok(None)
        };
    };
    if eol > MAX_CONTROL_LINE {
        return Err(WireError::LineTooLong);
    }
    let line = &buf[..eol];
    let after = eol + 2;
    let (verb, args_at) = match line.iter().position(|&b| b == b' ' || b == b'\t') {
        Some(i) => (&line[..i], i + 1),
        None => (line, line.len()),
    };
    let op = |op| Ok(Some((op, after)));
    if verb.eq_ignore_ascii_case(b"MSG") {
        parse_msg(buf, args_at, eol, false, max_payload)
    } else if verb.eq_ignore_ascii_case(b"HMSG") {
        parse_msg(buf, args_at, eol, true, max_payload)
    } else if verb.eq_ignore_ascii_case(b"PING") {
        op(ServerOp::Ping)
    } else if verb.eq_ignore_ascii_case(b"PONG") {
        op(ServerOp::Pong)
    } else if verb.eq_ignore_ascii_case(b"+OK") {
        op(ServerOp::Ok)
    } else if verb.eq_ignore_ascii_case(b"-ERR") {
        let text = String::from_utf8_lossy(&line[args_at.min(line.len())..]);
        op(ServerOp::Err(text.trim().trim_matches('\'').to_string()))
    } else if verb.eq_ignore_ascii_case(b"INFO") {
        op(ServerOp::Info(args_at.min(eol)..eol))
    } else {
        Err(WireError::Malformed(
            String::from_utf8_lossy(&line[..line.len().min(64)]).into_owned(),
        ))
    }
}

/// The space- or tab-separated fields of a control line's arguments, `buf[args_at..eol]`: at most
/// five (an `HMSG` with a reply), and how many there are.
fn split_fields(
    buf: &[u8],
    args_at: usize,
    eol: usize,
) -> Result<([Range<usize>; 5], usize), WireError> {
    let mut fields: [Range<usize>; 5] = std::array::from_fn(|_| 0..0);
    let mut n = 0;
    let mut i = args_at;
    while i < eol {
        while i < eol && (buf[i] == b' ' || buf[i] == b'\t') {
            i += 1;
        }
        if i == eol {
            break;
        }
        let start = i;
        i = memchr::memchr2(b' ', b'\t', &buf[start..eol]).map_or(eol, |at| start + at);
        if n == fields.len() {
            return Err(malformed(buf, eol));
        }
        fields[n] = start..i;
        n += 1;
    }
    Ok((fields, n))
}

/// `MSG <subject> <sid> [reply] <size>` / `HMSG <subject> <sid> [reply] <hdr size> <size>`.
fn parse_msg(
    buf: &[u8],
    args_at: usize,
    eol: usize,
    with_headers: bool,
    max_payload: usize,
) -> Result<Option<(ServerOp, usize)>, WireError> {
    let (fields, n) = split_fields(buf, args_at, eol)?;
    let sizes = if with_headers { 2 } else { 1 };
    let (subject, sid, reply) = match n.checked_sub(sizes) {
        Some(2) => (fields[0].clone(), fields[1].clone(), None),
        Some(3) => (
            fields[0].clone(),
            fields[1].clone(),
            Some(fields[2].clone()),
        ),
        _ => return Err(malformed(buf, eol)),
    };
    let number = |r: &Range<usize>| -> Result<usize, WireError> {
        std::str::from_utf8(&buf[r.clone()])
            .ok()
            .and_then(|s| s.parse::<usize>().ok())
            .ok_or_else(|| malformed(buf, eol))
    };
    let total = number(&fields[n - 1])?;
    let header_len = if with_headers {
        number(&fields[n - 2])?
    } else {
        0
    };
    if total > max_payload {
        return Err(WireError::TooLarge {
            size: total,
            max: max_payload,
        });
    }
    if header_len > total {
        return Err(malformed(buf, eol));
    }
    // `total` is bounded by `max_payload`, which may be `usize::MAX` before `INFO`: checked.
    let body = eol + 2;
    let end = body
        .checked_add(total)
        .filter(|e| e.checked_add(2).is_some())
        .ok_or_else(|| malformed(buf, eol))?;
    if buf.len() < end + 2 {
        return Ok(None);
    }
    if &buf[end..end + 2] != b"\r\n" {
        return Err(WireError::Malformed(
            "a message not followed by CRLF".into(),
        ));
    }
    let headers = with_headers.then(|| body..body + header_len);
    Ok(Some((
        ServerOp::Msg {
            subject,
            sid,
            reply,
            headers,
            payload: body + header_len..end,
        },
        end + 2,
    )))
}

fn malformed(buf: &[u8], eol: usize) -> WireError {
    WireError::Malformed(String::from_utf8_lossy(&buf[..eol.min(96)]).into_owned())
}

fn find_crlf(buf: &[u8]) -> Option<usize> {
    let limit = buf.len().min(MAX_CONTROL_LINE + 2);
    // Every control line is searched: `memchr` for the CR (a byte-pair compare at each position
    // was a visible share of a fold's profile), then the LF after it.
    let window = &buf[..limit];
    memchr::memchr_iter(b'\r', window).find(|&i| window.get(i + 1) == Some(&b'\n'))
}

/// A parsed `HMSG` header block.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct HeaderBlock<'a> {
    /// The status code (`NATS/1.0 100 Idle Heartbeat` → 100).
    pub status: Option<u16>,
    /// The text after the status code.
    pub description: Option<&'a str>,
    /// `Name: value` pairs in order (values trimmed, continuation lines joined).
    pub fields: Vec<(&'a str, Cow<'a, str>)>,
}

impl<'a> HeaderBlock<'a> {
    /// The first value of `name` (case-insensitive, as NATS compares header names on lookup).
    pub(crate) fn get(&self, name: &str) -> Option<&str> {
        self.fields
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_ref())
    }
}

/// Parses a header block: `NATS/1.0[ <status>[ <description>]]` then `<name>: <value>` lines.
///
/// Line for line the client library's reading (async-nats 0.51 `connection.rs`): lines end at
/// `\n` with an optional `\r` before it, a line starting with whitespace continues the value
/// before it, names are taken as written and values trimmed. Used for the server's own notices
/// (flow control, heartbeats, errors) only: a stored message's block (a delivery with a
/// `$JS.ACK` reply) is whatever a writer stored, and what it means is
/// [`foldhost_core::protocol::decode_stored`]'s verdict, never an error of this parser.
pub(crate) fn parse_headers(block: &[u8]) -> Result<HeaderBlock<'_>, WireError> {
    let text = std::str::from_utf8(block)
        .map_err(|_| WireError::Malformed("a header block that is not UTF-8".into()))?;
    let mut lines = text.lines().peekable();
    let first = lines.next().unwrap_or_default();
    let rest = first
        .strip_prefix("NATS/1.0")
        .ok_or_else(|| WireError::Malformed("a header block without NATS/1.0".into()))?
        .trim();
    let mut out = HeaderBlock::default();
    if !rest.is_empty() {
        let (code, desc) = rest.split_once(' ').unwrap_or((rest, ""));
        out.status = Some(
            code.trim()
                .parse()
                .map_err(|_| WireError::Malformed(format!("header status {code:?}")))?,
        );
        let desc = desc.trim();
        out.description = (!desc.is_empty()).then_some(desc);
    }
    while let Some(line) = lines.next() {
        if line.is_empty() {
            continue;
        }
        let (name, value) = line
            .split_once(':')
            .ok_or_else(|| WireError::Malformed(format!("header line {line:?}")))?;
        let mut value = Cow::Borrowed(value.trim_start());
        while let Some(more) = lines.next_if(|l| l.starts_with(char::is_whitespace)) {
            value.to_mut().push_str(more);
        }
        let value = match value {
            Cow::Borrowed(v) => Cow::Borrowed(v.trim_end()),
            Cow::Owned(v) => Cow::Owned(v.trim_end().to_string()),
        };
        out.fields.push((name, value));
    }
    Ok(out)
}

/// The header a headers-only delivery carries the stored message's payload size in.
pub(crate) const NATS_MSG_SIZE: &str = "Nats-Msg-Size";

/// The payload size a headers-only delivery's block names (`Nats-Msg-Size: N`, the last such line:
/// the server appends its own after the stored ones); `None` when no line names a decimal size.
/// Read line by line from the raw block, whatever else it holds (a writer's lines may be
/// undecodable; this one is the server's).
pub(crate) fn stored_msg_size(block: &[u8]) -> Option<u64> {
    block
        .split(|&b| b == b'\n')
        .filter_map(|line| {
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            let value = line
                .strip_prefix(NATS_MSG_SIZE.as_bytes())?
                .strip_prefix(b":")?;
            std::str::from_utf8(value).ok()?.trim().parse::<u64>().ok()
        })
        .next_back()
}

/// Credentials a lean connection sends in its `CONNECT`. Its `Debug` names the kind and the
/// user, never a password, token or signature.
#[derive(Clone, PartialEq, Eq)]
pub(crate) enum WireAuth {
    /// None.
    None,
    /// `user` and `pass`.
    UserPass(String, String),
    /// `auth_token`.
    Token(String),
    /// A user JWT and the server's nonce signed with the user's nkey (`jwt`, `sig`: the signature
    /// base64url without padding), as a `.creds` file authenticates.
    Jwt {
        /// The user JWT.
        jwt: String,
        /// The nonce's signature, base64url without padding.
        sig: String,
    },
    /// An nkey user: its public key and the nonce signed with its seed (base64url without
    /// padding), as a server's `nkey` user authenticates.
    Nkey {
        /// The user's public key (`U…`).
        public: String,
        /// The nonce's signature, base64url without padding.
        sig: String,
    },
}

impl std::fmt::Debug for WireAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WireAuth::None => f.write_str("None"),
            WireAuth::UserPass(u, _) => write!(f, "UserPass({u:?}, <redacted>)"),
            WireAuth::Token(_) => f.write_str("Token(<redacted>)"),
            WireAuth::Jwt { .. } => f.write_str("Jwt { <redacted> }"),
            WireAuth::Nkey { public, .. } => write!(f, "Nkey {{ public: {public:?}, <redacted> }}"),
        }
    }
}

/// The `CONNECT` line (no echo of our own publishes, headers on, not verbose). `tls`: the
/// connection runs over TLS.
pub(crate) fn connect_line(auth: &WireAuth, name: Option<&str>, tls: bool) -> String {
    let mut o = serde_json::json!({
        "verbose": false,
        "pedantic": false,
        "tls_required": tls,
        "lang": "rust-foldhost",
        "version": env!("CARGO_PKG_VERSION"),
        "protocol": 1,
        "headers": true,
        "no_responders": true,
        "echo": false,
    });
    if let Some(n) = name {
        o["name"] = serde_json::Value::from(format!("{n}-delivery"));
    }
    match auth {
        WireAuth::None => {}
        WireAuth::UserPass(u, p) => {
            o["user"] = serde_json::Value::from(u.as_str());
            o["pass"] = serde_json::Value::from(p.as_str());
        }
        WireAuth::Token(t) => o["auth_token"] = serde_json::Value::from(t.as_str()),
        WireAuth::Jwt { jwt, sig } => {
            o["jwt"] = serde_json::Value::from(jwt.as_str());
            o["sig"] = serde_json::Value::from(sig.as_str());
        }
        WireAuth::Nkey { public, sig } => {
            o["nkey"] = serde_json::Value::from(public.as_str());
            o["sig"] = serde_json::Value::from(sig.as_str());
        }
    }
    format!("CONNECT {o}\r\n")
}

/// Where a lean connection dials for one `--nats` URL.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerAddress {
    /// `host:port` (`[v6]:port`), the port 4222 when the URL names none.
    pub host_port: String,
    /// The host alone (brackets removed): the name a TLS certificate is checked against.
    pub host: String,
    /// The URL asks for TLS (`tls://`); the server's `INFO` may also require it.
    pub tls: bool,
}

/// The address a lean connection dials for one `--nats` URL: `nats://` (or no scheme) and
/// `tls://`; `None` for a scheme it does not speak (websockets), which keeps the client's own
/// consumer.
pub fn server_address(url: &str) -> Option<ServerAddress> {
    let (rest, tls) = match url.split_once("://") {
        Some((scheme, rest)) if scheme.eq_ignore_ascii_case("nats") => (rest, false),
        Some((scheme, rest)) if scheme.eq_ignore_ascii_case("tls") => (rest, true),
        Some(_) => return None,
        None => (url, false),
    };
    let authority = rest.split('/').next().unwrap_or(rest);
    let host_port = authority.rsplit_once('@').map_or(authority, |(_, hp)| hp);
    if host_port.is_empty() {
        return None;
    }
    // `[v6]:port`, `[v6]`, `host:port`, `host`.
    let (host, has_port) = match host_port.rfind(']') {
        Some(close) => (
            host_port[..close].trim_start_matches('['),
            host_port[close..].contains(':'),
        ),
        None => match host_port.rsplit_once(':') {
            Some((h, _)) => (h, true),
            None => (host_port, false),
        },
    };
    if host.is_empty() {
        return None;
    }
    Some(ServerAddress {
        host_port: if has_port {
            host_port.to_string()
        } else {
            format!("{host_port}:4222")
        },
        host: host.to_string(),
        tls,
    })
}

/// The largest `.creds` text read (a user JWT and a seed are well under 8 KiB).
pub(crate) const MAX_CREDS: usize = 64 * 1024;

/// The user JWT and nkey seed of a `.creds` text: the first and second blocks framed by
/// dash-decorated lines (`-----BEGIN NATS USER JWT-----` … `------END NATS USER JWT------`), as
/// the nats tools write them. `None` when either is missing or a block is not one token.
pub(crate) fn parse_creds(text: &str) -> Option<(String, String)> {
    let decorated = |l: &str| l.starts_with("---") && l.ends_with("---") && l.len() >= 6;
    let mut blocks = Vec::new();
    let mut lines = text.lines().map(str::trim);
    while let Some(l) = lines.next() {
        if decorated(l) && l.contains("BEGIN") {
            let body = lines.next()?;
            let end = lines.next()?;
            if !decorated(end)
                || body.is_empty()
                || !body
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_.=".contains(&b))
            {
                return None;
            }
            blocks.push(body.to_string());
            if blocks.len() == 2 {
                break;
            }
        }
    }
    let mut b = blocks.into_iter();
    Some((b.next()?, b.next()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at<'a>(buf: &'a [u8], r: &Range<usize>) -> &'a [u8] {
        &buf[r.clone()]
    }

    #[test]
    fn a_msg_with_a_reply_names_its_subject_reply_and_payload() {
        let buf = b"MSG $KV.b.k 1 $JS.ACK.KV_b.c.1.7.7.1.0 5\r\nhello\r\nPING\r\n";
        let (op, n) = parse_op(buf, 1024).unwrap().unwrap();
        let ServerOp::Msg {
            subject,
            sid,
            reply,
            headers,
            payload,
        } = op
        else {
            panic!("{op:?}")
        };
        assert_eq!(at(buf, &subject), b"$KV.b.k");
        assert_eq!(at(buf, &sid), b"1");
        assert_eq!(at(buf, &reply.unwrap()), b"$JS.ACK.KV_b.c.1.7.7.1.0");
        assert!(headers.is_none());
        assert_eq!(at(buf, &payload), b"hello");
        assert_eq!(
            parse_op(&buf[n..], 1024).unwrap(),
            Some((ServerOp::Ping, 6))
        );
    }

    #[test]
    fn an_hmsg_splits_its_header_block_from_its_payload() {
        let hdr = b"NATS/1.0\r\nKV-Operation: DEL\r\n\r\n";
        let mut buf = format!("HMSG $KV.b.k 9 {} {}\r\n", hdr.len(), hdr.len() + 2).into_bytes();
        buf.extend_from_slice(hdr);
        buf.extend_from_slice(b"ab\r\n");
        let (op, n) = parse_op(&buf, 1024).unwrap().unwrap();
        assert_eq!(n, buf.len());
        let ServerOp::Msg {
            reply,
            headers,
            payload,
            ..
        } = op
        else {
            panic!()
        };
        assert!(reply.is_none());
        let h = parse_headers(at(&buf, &headers.unwrap())).unwrap();
        assert_eq!(h.status, None);
        assert_eq!(h.get("kv-operation"), Some("DEL"));
        assert_eq!(at(&buf, &payload), b"ab");
    }

    #[test]
    fn every_prefix_of_an_operation_is_incomplete_and_consumes_nothing() {
        let buf = b"MSG a.b 1 r.s 3\r\nxyz\r\n";
        for cut in 0..buf.len() {
            assert_eq!(parse_op(&buf[..cut], 1024).unwrap(), None, "cut at {cut}");
        }
        assert!(parse_op(buf, 1024).unwrap().is_some());
    }

    #[test]
    fn a_size_above_max_payload_is_refused_before_any_byte_of_it_is_awaited() {
        let buf = b"MSG a 1 999999999999\r\n";
        assert!(matches!(
            parse_op(buf, 1 << 20),
            Err(WireError::TooLarge { .. })
        ));
    }

    #[test]
    fn an_endless_control_line_is_an_error_not_a_wait() {
        let buf = vec![b'M'; MAX_CONTROL_LINE + 3];
        assert_eq!(parse_op(&buf, 1024), Err(WireError::LineTooLong));
    }

    #[test]
    fn a_delivery_line_longer_than_the_servers_client_limit_parses() {
        // A key the server accepted in a 4 KiB PUB line comes back with a $JS.ACK reply added.
        let key = "k".repeat(4100);
        let buf = format!(
            "MSG $KV.b.{key} 1 $JS.ACK.KV_b.abcdefghijklmnopqrstuv.1.9.9.1700000000000000000.0 1\r\nv\r\n"
        );
        assert!(buf.len() > 4096);
        let (op, n) = parse_op(buf.as_bytes(), 1024).unwrap().unwrap();
        assert_eq!(n, buf.len());
        let ServerOp::Msg { subject, .. } = op else {
            panic!("{op:?}")
        };
        assert_eq!(subject.len(), "$KV.b.".len() + 4100);
    }

    #[test]
    fn a_size_that_would_overflow_is_an_error_not_a_panic() {
        for line in [
            format!("MSG a 1 {}\r\n", usize::MAX),
            format!("MSG a 1 {}\r\n", usize::MAX - 10),
            format!("HMSG a 1 0 {}\r\n", usize::MAX - 1),
        ] {
            assert!(parse_op(line.as_bytes(), usize::MAX).is_err(), "{line}");
        }
    }

    #[test]
    fn header_lines_are_read_as_the_client_library_reads_them() {
        // A bare LF ends a line, a line starting with whitespace continues the value before it:
        // async-nats reads this block as a delete, so the lean path must too.
        let h =
            parse_headers(b"NATS/1.0\r\nKV-Operation: DEL\nX: y\r\nY: a\r\n  b\r\n\r\n").unwrap();
        assert_eq!(h.status, None);
        assert_eq!(h.get("KV-Operation"), Some("DEL"));
        assert_eq!(h.get("X"), Some("y"));
        assert_eq!(h.get("Y"), Some("a  b"));
        assert_eq!(h.fields.len(), 3);
    }

    #[test]
    fn malformed_messages_are_errors() {
        for bad in [
            &b"MSG a\r\n"[..],
            b"MSG a 1 x\r\n",
            b"MSG a 1 b c d e f\r\n",
            b"HMSG a 1 9 3\r\nabc\r\n",
            b"MSG a 1 3\r\nabcd\r\n",
            b"WHAT\r\n",
        ] {
            assert!(
                parse_op(bad, 1024).is_err(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn status_headers_carry_code_description_and_fields() {
        let h = parse_headers(
            b"NATS/1.0 100 Idle Heartbeat\r\nNats-Last-Consumer: 42\r\nNats-Last-Stream: 7\r\n\r\n",
        )
        .unwrap();
        assert_eq!(h.status, Some(100));
        assert_eq!(h.description, Some("Idle Heartbeat"));
        assert_eq!(h.get("Nats-Last-Consumer"), Some("42"));
        assert!(parse_headers(b"HTTP/1.1 200\r\n\r\n").is_err());
    }

    #[test]
    fn server_errors_and_info_are_recognised() {
        let (op, _) = parse_op(b"-ERR 'Authorization Violation'\r\n", 1)
            .unwrap()
            .unwrap();
        assert_eq!(op, ServerOp::Err("Authorization Violation".into()));
        let buf = b"INFO {\"max_payload\":1}\r\n";
        let (op, n) = parse_op(buf, 1).unwrap().unwrap();
        assert_eq!(n, buf.len());
        let ServerOp::Info(r) = op else { panic!() };
        assert_eq!(at(buf, &r), b"{\"max_payload\":1}");
    }

    #[test]
    fn nats_and_tls_urls_are_dialled_by_address_and_websockets_are_not() {
        let a = |u| server_address(u).map(|a| (a.host_port, a.host, a.tls));
        let s = |hp: &str, h: &str, tls| Some((hp.to_string(), h.to_string(), tls));
        assert_eq!(
            a("nats://127.0.0.1:4222"),
            s("127.0.0.1:4222", "127.0.0.1", false)
        );
        assert_eq!(a("localhost"), s("localhost:4222", "localhost", false));
        assert_eq!(a("nats://u:p@h:5"), s("h:5", "h", false));
        assert_eq!(a("nats://[::1]:7"), s("[::1]:7", "::1", false));
        assert_eq!(a("nats://[::1]"), s("[::1]:4222", "::1", false));
        assert_eq!(
            a("tls://h.example:4443"),
            s("h.example:4443", "h.example", true)
        );
        assert_eq!(a("TLS://tok@h"), s("h:4222", "h", true));
        assert_eq!(a("ws://h:80"), None);
        assert_eq!(a("nats://"), None);
        assert_eq!(a("nats://:4222"), None);
    }

    #[test]
    fn a_headers_only_size_is_the_last_decimal_size_line_of_the_block() {
        assert_eq!(
            stored_msg_size(b"NATS/1.0\r\nKV-Operation: DEL\r\nNats-Msg-Size: 0\r\n\r\n"),
            Some(0)
        );
        assert_eq!(
            stored_msg_size(
                b"NATS/1.0\r\nNats-Msg-Size: 7\r\nbad line\r\nNats-Msg-Size: 12\r\n\r\n"
            ),
            Some(12)
        );
        assert_eq!(
            stored_msg_size(b"NATS/1.0\r\nNats-Msg-Size: x\r\n\r\n"),
            None
        );
        assert_eq!(stored_msg_size(b"NATS/1.0\r\n\r\n"), None);
    }

    #[test]
    fn a_creds_text_yields_its_jwt_and_seed_and_anything_else_nothing() {
        let creds = "-----BEGIN NATS USER JWT-----\neyJ0eXAi.eyJqdGki.sig-_x\n------END NATS USER JWT------\n\n\
            ************************* IMPORTANT *************************\nNKEY Seed printed below.\n\n\
            -----BEGIN USER NKEY SEED-----\nSUAIO3FHUX5PNV2LQIIP7TZ3N4L7TX3W53MQGEIVYFIGA635OZCKEYHFLM\n\
            ------END USER NKEY SEED------\n";
        assert_eq!(
            parse_creds(creds),
            Some((
                "eyJ0eXAi.eyJqdGki.sig-_x".to_string(),
                "SUAIO3FHUX5PNV2LQIIP7TZ3N4L7TX3W53MQGEIVYFIGA635OZCKEYHFLM".to_string()
            ))
        );
        assert_eq!(
            parse_creds(&creds.replace("\n", "\r\n")),
            parse_creds(creds)
        );
        assert_eq!(parse_creds(""), None);
        // The seed block missing.
        let jwt_only = creds.split("\n\n").next().unwrap_or_default();
        assert_eq!(parse_creds(jwt_only), None);
        // A body with a space is not one token.
        assert_eq!(parse_creds(&creds.replace("eyJ0eXAi.", "eyJ0 eXAi.")), None);
    }

    #[test]
    fn the_connect_line_carries_the_credentials_and_never_echoes() {
        let l = connect_line(
            &WireAuth::UserPass("a".into(), "b\"c".into()),
            Some("n"),
            false,
        );
        assert!(l.starts_with("CONNECT {") && l.ends_with("}\r\n"));
        let v: serde_json::Value = serde_json::from_str(&l[8..l.len() - 2]).unwrap();
        assert_eq!(v["user"], "a");
        assert_eq!(v["pass"], "b\"c");
        assert_eq!(v["echo"], false);
        assert_eq!(v["headers"], true);
        assert_eq!(v["tls_required"], false);
        let l = connect_line(
            &WireAuth::Jwt {
                jwt: "j".into(),
                sig: "s".into(),
            },
            None,
            true,
        );
        let v: serde_json::Value = serde_json::from_str(&l[8..l.len() - 2]).unwrap();
        assert_eq!(
            (&v["jwt"], &v["sig"], &v["tls_required"]),
            (&"j".into(), &"s".into(), &true.into())
        );
    }

    #[test]
    fn an_nkey_user_sends_its_public_key_and_signature_and_no_credential_shows_in_debug() {
        let l = connect_line(
            &WireAuth::Nkey {
                public: "UABC".into(),
                sig: "s1".into(),
            },
            None,
            true,
        );
        let v: serde_json::Value = serde_json::from_str(&l[8..l.len() - 2]).unwrap();
        assert_eq!((&v["nkey"], &v["sig"]), (&"UABC".into(), &"s1".into()));
        let shown = format!(
            "{:?} {:?} {:?}",
            WireAuth::UserPass("u".into(), "pw-1".into()),
            WireAuth::Token("tok-1".into()),
            WireAuth::Nkey {
                public: "UABC".into(),
                sig: "sig-1".into()
            }
        );
        for secret in ["pw-1", "tok-1", "sig-1"] {
            assert!(!shown.contains(secret), "{shown}");
        }
    }
}
