//! What a stored message means (docs/design.md, "What a stored message means"), and which keys are readable and foldable.

/// What a delivered message does to its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvOp {
    /// The key now holds the message's payload.
    Put,
    /// The key is deleted.
    Delete,
    /// The key is purged (deleted, its history gone).
    Purge,
}

/// The fold's rule for a message's operation, from its `KV-Operation` header and the server's
/// `Nats-Marker-Reason` (NATS 2.11+: the marker the server writes when a subject's last message
/// goes by age, per-message TTL, or purge). A marker carries no `KV-Operation`; read as a put, it
/// would leave every expired key in the fold as an empty value. So: `KV-Operation` `DEL` → delete,
/// `PURGE` → purge; otherwise a marker is a removal — `MaxAge` and `Purge` purge, `Remove` and any
/// reason this host does not know delete (a marker never carries a value); otherwise a put.
pub fn kv_op(kv_operation: Option<&str>, marker_reason: Option<&str>) -> KvOp {
    match (kv_operation, marker_reason) {
        (Some("DEL"), _) => KvOp::Delete,
        (Some("PURGE"), _) => KvOp::Purge,
        (_, Some("MaxAge" | "Purge")) => KvOp::Purge,
        (_, Some(_)) => KvOp::Delete,
        _ => KvOp::Put,
    }
}

/// Why a stored message's header block is undecodable ([`decode_stored`]): each is a block the
/// client library (async-nats 0.51, `connection.rs`) refuses — an error that drops its connection,
/// or a panic in its connection task — or takes as a server notice rather than a stored message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Undecodable {
    /// An empty header block (no `NATS/1.0` line at all).
    Empty,
    /// Bytes that are not UTF-8.
    NotUtf8,
    /// A first line that does not start with `NATS/1.0`.
    NoVersionLine,
    /// A status line: a code the library cannot parse (an error), or one it can (the message is
    /// then a server notice to it: the ordered consumer drops it, a direct get reports it).
    StatusLine,
    /// A header line without a `:`.
    LineWithoutColon,
    /// A header name with a byte that is not ASCII graphic (a space, a control byte).
    BadName,
    /// A header value with a CR left inside (the library asserts on it: a panic).
    CrInValue,
}

impl Undecodable {
    /// A short name without spaces (logs, `/status`).
    pub fn as_str(self) -> &'static str {
        match self {
            Undecodable::Empty => "empty-header-block",
            Undecodable::NotUtf8 => "header-block-not-utf8",
            Undecodable::NoVersionLine => "no-nats-version-line",
            Undecodable::StatusLine => "status-line",
            Undecodable::LineWithoutColon => "header-line-without-colon",
            Undecodable::BadName => "bad-header-name",
            Undecodable::CrInValue => "cr-inside-header-value",
        }
    }

    /// The reason named by [`Undecodable::as_str`].
    pub(crate) fn from_name(name: &str) -> Option<Undecodable> {
        [
            Undecodable::Empty,
            Undecodable::NotUtf8,
            Undecodable::NoVersionLine,
            Undecodable::StatusLine,
            Undecodable::LineWithoutColon,
            Undecodable::BadName,
            Undecodable::CrInValue,
        ]
        .into_iter()
        .find(|u| u.as_str() == name)
    }
}

impl std::fmt::Display for Undecodable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a stored message means, from its header block as nats-server stored it (`None`: a
/// message without headers) — the one rule every path folds by (docs/design.md, "What a stored
/// message means"): a put, a delete, a purge ([`kv_op`] over the first `KV-Operation` and the
/// first `Nats-Marker-Reason`, names compared exactly), or [`Undecodable`].
///
/// The block is read line for line as the client library reads a delivery (async-nats 0.51
/// `connection.rs`, `try_read_op`, `HMSG`): UTF-8; lines split by `str::lines` (a bare LF ends a
/// line, one CR before it goes with it); the first line `NATS/1.0` with nothing after it but
/// whitespace; then, skipping empty lines, `name:value` lines, a line starting with whitespace
/// continuing the value before it, values trimmed. The library's lookup is exact
/// (`HeaderMap::get` hashes the name as written), so `kv-operation: DEL` is a header named
/// otherwise: a put. Where the library accepts a block this verdict is the operation the fold
/// gets through it; where it refuses one (an error, a panic) or takes it for a server notice (a
/// status line), the verdict is undecodable: a skip on every path, never a different operation
/// (the proptest `the_decoder_agrees_with_the_client_library` checks this against the library's
/// own parser).
pub fn decode_stored(block: Option<&[u8]>) -> Result<KvOp, Undecodable> {
    decode_stored_record(block).map(|(op, _)| op)
}

/// [`decode_stored`], and the operation id the record carries in its
/// [`super::OP_ID_HEADER`] (`None` when absent, or when its value is not a UUIDv7: a record some
/// other writer made, which no write through a host can be answered by).
pub fn decode_stored_record(
    block: Option<&[u8]>,
) -> Result<(KvOp, Option<super::OpId>), Undecodable> {
    let Some(block) = block else {
        return Ok((KvOp::Put, None));
    };
    let text = std::str::from_utf8(block).map_err(|_| Undecodable::NotUtf8)?;
    let mut lines = text.lines().peekable();
    let first = lines.next().ok_or(Undecodable::Empty)?;
    let status = first
        .strip_prefix("NATS/1.0")
        .ok_or(Undecodable::NoVersionLine)?
        .trim();
    if !status.is_empty() {
        return Err(Undecodable::StatusLine);
    }
    let (mut op, mut reason, mut op_id): (Option<String>, Option<String>, Option<String>) =
        (None, None, None);
    while let Some(line) = lines.next() {
        if line.is_empty() {
            continue;
        }
        let (name, value) = line.split_once(':').ok_or(Undecodable::LineWithoutColon)?;
        if name.contains(|c: char| !c.is_ascii_graphic() || c == ':') {
            return Err(Undecodable::BadName);
        }
        let mut value = value.trim_start().to_string();
        while let Some(more) = lines.next_if(|l| l.starts_with(char::is_whitespace)) {
            value.push_str(more);
        }
        value.truncate(value.trim_end().len());
        if value.contains(['\r', '\n']) {
            return Err(Undecodable::CrInValue);
        }
        // The library keeps every value of a name; a lookup answers the first.
        let slot = match name {
            "KV-Operation" => &mut op,
            "Nats-Marker-Reason" => &mut reason,
            super::OP_ID_HEADER => &mut op_id,
            _ => continue,
        };
        slot.get_or_insert(value);
    }
    let op_id = op_id.and_then(|v| super::OpId::parse(&v).ok());
    Ok((kv_op(op.as_deref(), reason.as_deref()), op_id))
}

/// The update standing for an undecodable stored message of `subject`: a key in the host's
/// reserved space (so the fold skips it as [`bucket_key_admitted`] says, its revision moving the
/// cursor), naming the reason and the subject. Nothing a writer stores can look like it: a
/// delivered subject never holds a space.
pub fn undecodable_key(subject: &str, reason: Undecodable) -> String {
    format!("{UNDECODABLE_KEY_PREFIX}{} {subject}", reason.as_str())
}

const UNDECODABLE_KEY_PREFIX: &str = "\u{1} undecodable ";

/// The subject and reason an [`undecodable_key`] names; `None` for any other key.
pub fn parse_undecodable_key(key: &str) -> Option<(&str, Undecodable)> {
    let rest = key.strip_prefix(UNDECODABLE_KEY_PREFIX)?;
    let (reason, subject) = rest.split_once(' ')?;
    Some((subject, Undecodable::from_name(reason)?))
}

/// Whether `key` is a key a NATS KV client may read or write: letters, digits and `-/_=.`, not
/// starting or ending with `.` (the rule the nats clients check, so no wildcard, space or empty
/// token reaches a subject).
pub fn kv_key_valid(key: &str) -> bool {
    !key.is_empty()
        && !key.starts_with('.')
        && !key.ends_with('.')
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-/_=.".contains(&b))
}

/// Whether a key delivered from the bucket may be folded. Keys starting with `\x01` are the
/// host's own record space (retained records live there); NATS accepts such a subject on a raw
/// publish, and folding one would put a forged host record — a fake base, a deleted deferred
/// update — where the host keeps its own, or make the store undecodable. The rule: such a key is
/// skipped with a warning, never stored and never shown to a guest; its revision still moves the
/// cursor, like a key a guest skips. A key starting with `\x00` is skipped the same way: it would
/// sort before the host's record space, where every scan of the whole fold starts past it
/// (`snapshot::scan_start`), so a guest's scan, `dump` and the state buckets' size would miss it.
pub fn bucket_key_admitted(key: &str) -> bool {
    !key.starts_with(['\u{0}', '\u{1}'])
}
