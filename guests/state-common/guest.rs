//! The logic shared by the state test guests (`state-owner`, `state-reader`), against the raw
//! bindings of `foldhost:guest@0.3.0`. Each crate's `lib.rs` sets `NAME`, `OWNED` and `READS` and
//! mounts this file as its module `guest`; nothing here is a workspace member of its own.
//!
//! What it does with what the host gives it:
//!
//! - `parse` decodes the packed batch and accepts every update, keeping (bucket, key, op, value,
//!   revision) until `apply`. A batch it cannot decode gets no verdicts (the host fails it). With
//!   the config `write-in-parse=1`, a main-bucket `parse` also tries `state.put` (the host must
//!   refuse it) and logs `parse:<reason>` or `parse:written` in `refusals`.
//! - `apply` folds the pending updates into a per-bucket map and logs one event per update in the
//!   bucket's events (`cur:put:KEY`, `cur:del:KEY` before its `end-of-current`, `chg:…` after; at
//!   most 10 000 a bucket). A delete among current values is a contract violation. With
//!   `write-in-apply=1`, a main-bucket `apply` tries `state.put` and logs `apply:…`. Main-bucket
//!   changes (after `end-of-current("")`) under `mirror/` are queued.
//! - `end-of-current` marks the bucket (twice is a violation) and logs the event `eoc`.
//! - `on-applied` remembers the cursor; for the main bucket it writes the queued mirror changes
//!   (`mirror/REST` → `REST` in the first owned bucket, a delete as a delete) — or, when it is
//!   the instance's first and nothing changed since its hydration (the host calling it again for
//!   a commit whose writes may not have landed), every mirror put the owned fold lacks (with
//!   `replay-writes-all=1`, every mirror put) — and logs each (with `trap-after-first-mirror=1`,
//!   a call with queued writes traps after the first)
//!   outcome in `writes`: `REST:<applied|pending|unknown>:<revision|none>` or
//!   `REST:refused:<reason>`.
//! - `query` answers JSON (see `query`), or, for a request that is not a JSON object, the main
//!   bucket's fold value of the request as a key (`not found` when absent).
//!
//! Nothing decoded from the host or a query is unwrapped: bad input is an empty verdict list or a
//! query error, never a trap — except the query `{"op":"trap"}`, which aborts on purpose.

use std::cell::RefCell;
use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::{Map, Value, json};

use super::{NAME, OWNED, READS};

/// The generated bindings of the world `foldhost:guest/guest` at 0.3.0.
#[allow(missing_docs, unsafe_code, clippy::all)]
mod bindings {
    wit_bindgen::generate!({
        path: "../../wit/v0.3.0",
        world: "guest",
    });
}

use bindings::exports::foldhost::guest::folder::{Guest, GuestManifest, Verdict};
use bindings::foldhost::guest::log::{Level, log};
use bindings::foldhost::guest::state::{self, Outcome, Refusal, WriteOptions, Written};
use bindings::foldhost::guest::types::StateBucket;
use bindings::foldhost::guest::{fold, types::Op};

/// The most events kept per bucket, and entries per log; later ones are dropped.
const LOG_CAP: usize = 10_000;
/// The key the probe writes from `parse` and `apply` go to.
const PROBE_KEY: &str = "probe";
/// The main-bucket key prefix whose changes are mirrored into the first owned bucket.
const MIRROR_PREFIX: &str = "mirror/";

/// One update of a packed batch.
struct Update {
    key: String,
    op: Op,
    value: Vec<u8>,
    /// Checked by decoding; nothing here reports it.
    #[cfg_attr(not(test), allow(dead_code))]
    revision: u64,
}

/// What this instance was given of one bucket.
#[derive(Default)]
struct Seen {
    entries: BTreeMap<String, Vec<u8>>,
    eoc: bool,
    events: Vec<String>,
    cursor: Option<u64>,
}

/// A mirror write waiting for the main bucket's `on-applied`: the key in the first owned bucket,
/// and the value (`None`: a delete).
struct Mirror {
    key: String,
    value: Option<Vec<u8>>,
}

/// The instance's whole state.
#[derive(Default)]
struct State {
    write_in_parse: bool,
    write_in_apply: bool,
    /// The bucket of the last `parse`, and what it accepted (kept until `apply`).
    pending_bucket: String,
    pending: Vec<Update>,
    buckets: BTreeMap<String, Seen>,
    mirrors: Vec<Mirror>,
    /// A main-bucket change was applied since this instance was hydrated.
    main_changed: bool,
    /// Config `replay-writes-all=1`: a call made again writes every mirror put, whether the owned
    /// fold holds it or not (a guest that leaves the collapsing of repeats to the host).
    replay_writes_all: bool,
    /// Config `trap-after-first-mirror=1`: an `on-applied` with queued mirror writes traps right
    /// after making the first (a call made again by the host does not).
    trap_after_first_mirror: bool,
    refusals: Vec<String>,
    writes: Vec<String>,
    violations: Vec<String>,
}

impl State {
    fn seen(&mut self, bucket: &str) -> &mut Seen {
        self.buckets.entry(bucket.to_owned()).or_default()
    }

    /// The mirror puts the first owned bucket's fold lacks: every `mirror/REST` of the main fold
    /// whose `REST` holds another value or none. (A delete is not reconstructed: a key without a
    /// `mirror/` source may have been written otherwise.)
    fn missing_mirrors(&self) -> Vec<Mirror> {
        let owned = self.buckets.get(first_owned());
        let main = self.buckets.get("");
        let mut missing = Vec::new();
        for (key, value) in main.map(|m| &m.entries).into_iter().flatten() {
            let Some(rest) = key.strip_prefix(MIRROR_PREFIX) else {
                continue;
            };
            if self.replay_writes_all || owned.and_then(|o| o.entries.get(rest)) != Some(value) {
                missing.push(Mirror {
                    key: rest.to_owned(),
                    value: Some(value.clone()),
                });
            }
        }
        missing
    }

    fn violation(&mut self, message: String) {
        push_capped(&mut self.violations, message);
    }
}

thread_local! {
    static STATE: RefCell<State> = RefCell::new(State::default());
}

fn with_state<R>(f: impl FnOnce(&mut State) -> R) -> R {
    STATE.with(|state| f(&mut state.borrow_mut()))
}

fn push_capped(list: &mut Vec<String>, item: String) {
    if list.len() < LOG_CAP {
        list.push(item);
    }
}

/// The bucket this guest's own writes go to.
fn first_owned() -> &'static str {
    OWNED.first().copied().unwrap_or("")
}

/// Default write options: a minted op id, no compare-and-set, no wait, no TTL.
fn default_options() -> WriteOptions {
    WriteOptions {
        op_id: None,
        if_revision: None,
        wait_ms: 0,
        ttl_ms: None,
    }
}

fn outcome_name(outcome: Outcome) -> &'static str {
    match outcome {
        Outcome::Applied => "applied",
        Outcome::Pending => "pending",
        Outcome::Unknown => "unknown",
    }
}

/// Decodes a packed batch, or `None` if it is malformed (a torn header or body, a key that is not
/// UTF-8, an op byte above 2).
fn decode(batch: &[u8]) -> Option<Vec<Update>> {
    let mut updates = Vec::new();
    let mut rest = batch;
    while !rest.is_empty() {
        let (header, body) = rest.split_at_checked(17)?;
        let key_len =
            usize::try_from(u32::from_le_bytes(header.get(0..4)?.try_into().ok()?)).ok()?;
        let value_len =
            usize::try_from(u32::from_le_bytes(header.get(4..8)?.try_into().ok()?)).ok()?;
        let revision = u64::from_le_bytes(header.get(8..16)?.try_into().ok()?);
        let op = match header.get(16)? {
            0 => Op::Put,
            1 => Op::Delete,
            2 => Op::Purge,
            _ => return None,
        };
        let (key, body) = body.split_at_checked(key_len)?;
        let (value, body) = body.split_at_checked(value_len)?;
        let key = std::str::from_utf8(key).ok()?.to_owned();
        updates.push(Update {
            key,
            op,
            value: value.to_vec(),
            revision,
        });
        rest = body;
    }
    Some(updates)
}

/// A write refused or made, as a query answers it.
fn write_answer(result: Result<Written, Refusal>) -> Value {
    match result {
        Ok(written) => json!({"ok": {
            "outcome": outcome_name(written.outcome),
            "op_id": written.op_id,
            "revision": written.revision,
        }}),
        Err(refusal) => refused(refusal),
    }
}

fn refused(refusal: Refusal) -> Value {
    json!({"refused": {"reason": refusal.reason, "message": refusal.message}})
}

/// `{"op":"get","bucket":B,"key":K}`
#[derive(Deserialize)]
struct GetRequest {
    bucket: String,
    key: String,
}

/// `{"op":"keys","bucket":B,"prefix":P,"limit":N}`
#[derive(Deserialize)]
struct KeysRequest {
    bucket: String,
    #[serde(default)]
    prefix: String,
    #[serde(default = "default_limit")]
    limit: u32,
}

fn default_limit() -> u32 {
    1000
}

/// `{"op":"put"|"delete","bucket":B,"key":K,"value":V,...options}` (no value for a delete).
#[derive(Deserialize)]
struct WriteRequest {
    bucket: String,
    key: String,
    #[serde(default)]
    value: Option<String>,
    #[serde(default)]
    op_id: Option<String>,
    #[serde(default)]
    if_revision: Option<u64>,
    #[serde(default)]
    ttl_ms: Option<u64>,
    #[serde(default)]
    wait_ms: u32,
}

impl WriteRequest {
    fn options(&self) -> WriteOptions {
        WriteOptions {
            op_id: self.op_id.clone(),
            if_revision: self.if_revision,
            wait_ms: self.wait_ms,
            ttl_ms: self.ttl_ms,
        }
    }
}

/// `{"op":"seen","bucket":B}`
#[derive(Deserialize)]
struct SeenRequest {
    bucket: String,
}

fn from_value<T: serde::de::DeserializeOwned>(op: &str, request: Value) -> Result<T, String> {
    serde_json::from_value(request).map_err(|error| format!("bad {op} request: {error}"))
}

/// Answers a JSON request (an object with `op`).
fn json_query(request: &[u8]) -> Result<Value, String> {
    let request: Value =
        serde_json::from_slice(request).map_err(|error| format!("bad request: {error}"))?;
    let op = request
        .get("op")
        .and_then(Value::as_str)
        .ok_or("bad request: no op")?
        .to_owned();
    match op.as_str() {
        "get" => {
            let GetRequest { bucket, key } = from_value(&op, request)?;
            Ok(match state::get(&bucket, &key) {
                Ok(None) => json!({"ok": null}),
                Ok(Some(entry)) => json!({"ok": {
                    "value": String::from_utf8_lossy(&entry.value),
                    "revision": entry.revision,
                }}),
                Err(refusal) => refused(refusal),
            })
        }
        "keys" => {
            let KeysRequest {
                bucket,
                prefix,
                limit,
            } = from_value(&op, request)?;
            Ok(match state::keys(&bucket, &prefix, None, limit) {
                Ok(keys) => json!({ "ok": keys }),
                Err(refusal) => refused(refusal),
            })
        }
        "put" => {
            let write: WriteRequest = from_value(&op, request)?;
            let value = write.value.clone().ok_or("bad put request: no value")?;
            Ok(write_answer(state::put(
                &write.bucket,
                &write.key,
                value.as_bytes(),
                &write.options(),
            )))
        }
        "delete" => {
            let write: WriteRequest = from_value(&op, request)?;
            Ok(write_answer(state::delete(
                &write.bucket,
                &write.key,
                &write.options(),
            )))
        }
        "seen" => {
            let SeenRequest { bucket } = from_value(&op, request)?;
            Ok(with_state(|state| {
                let violations = state.violations.clone();
                let seen = state.buckets.get(&bucket);
                let entries: Map<String, Value> = seen
                    .map(|seen| {
                        seen.entries
                            .iter()
                            .map(|(key, value)| {
                                (
                                    key.clone(),
                                    Value::String(String::from_utf8_lossy(value).into_owned()),
                                )
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                json!({
                    "entries": entries,
                    "eoc": seen.is_some_and(|seen| seen.eoc),
                    "events": seen.map(|seen| seen.events.clone()).unwrap_or_default(),
                    "violations": violations,
                    "cursor": seen.and_then(|seen| seen.cursor),
                })
            }))
        }
        "log" => Ok(with_state(|state| {
            json!({
                "refusals": state.refusals,
                "writes": state.writes,
                "violations": state.violations,
            })
        })),
        // A trap on request: the host drops this instance and hydrates a fresh one from its folds
        // (how the suite checks that a rebuild sees every bucket).
        "trap" => std::process::abort(),
        other => Err(format!("unknown op {other:?}")),
    }
}

/// The exported `folder`.
struct StateGuest;

impl Guest for StateGuest {
    fn manifest() -> GuestManifest {
        GuestManifest {
            name: NAME.into(),
            version: "0.3.0".into(),
            scope: Vec::new(),
            state: OWNED
                .iter()
                .map(|name| StateBucket {
                    name: (*name).into(),
                    history: 1,
                    max_age_ms: 0,
                    max_bytes: 0,
                    per_key_ttl: false,
                })
                .collect(),
            reads: READS.iter().map(|name| (*name).into()).collect(),
        }
    }

    fn init(config: Vec<(String, String)>) -> Result<(), String> {
        with_state(|state| {
            for (key, value) in &config {
                match key.as_str() {
                    "write-in-parse" => state.write_in_parse = value == "1",
                    "write-in-apply" => state.write_in_apply = value == "1",
                    "replay-writes-all" => state.replay_writes_all = value == "1",
                    "trap-after-first-mirror" => state.trap_after_first_mirror = value == "1",
                    _ => {}
                }
            }
        });
        log(Level::Info, &format!("state guest {NAME} ready"));
        Ok(())
    }

    fn parse(bucket: String, batch: Vec<u8>) -> Vec<Verdict> {
        let updates = decode(&batch);
        let verdicts = match &updates {
            Some(updates) => vec![Verdict::Accept; updates.len()],
            None => Vec::new(),
        };
        let write_in_parse = with_state(|state| {
            state.pending_bucket.clone_from(&bucket);
            state.pending = updates.unwrap_or_default();
            state.write_in_parse
        });
        if write_in_parse && bucket.is_empty() {
            let result = state::put(first_owned(), PROBE_KEY, b"x", &default_options());
            let entry = match result {
                Ok(_) => "parse:written".to_owned(),
                Err(refusal) => format!("parse:{}", refusal.reason),
            };
            with_state(|state| push_capped(&mut state.refusals, entry));
        }
        verdicts
    }

    fn apply() -> Result<(), String> {
        let (bucket, write_in_apply) = with_state(|state| {
            let bucket = std::mem::take(&mut state.pending_bucket);
            let pending = std::mem::take(&mut state.pending);
            let eoc = state.seen(&bucket).eoc;
            for Update { key, op, value, .. } in pending {
                let put = matches!(op, Op::Put);
                let event = format!(
                    "{}:{}:{key}",
                    if eoc { "chg" } else { "cur" },
                    if put { "put" } else { "del" }
                );
                if !put && !eoc {
                    state.violation(format!("deletion among current values of {bucket}: {key}"));
                }
                if bucket.is_empty() && eoc {
                    state.main_changed = true;
                }
                if bucket.is_empty()
                    && eoc
                    && let Some(rest) = key.strip_prefix(MIRROR_PREFIX)
                {
                    state.mirrors.push(Mirror {
                        key: rest.to_owned(),
                        value: put.then(|| value.clone()),
                    });
                }
                let seen = state.seen(&bucket);
                push_capped(&mut seen.events, event);
                if put {
                    seen.entries.insert(key, value);
                } else {
                    seen.entries.remove(&key);
                }
            }
            (bucket, state.write_in_apply)
        });
        if write_in_apply && bucket.is_empty() {
            let result = state::put(first_owned(), PROBE_KEY, b"x", &default_options());
            let entry = match result {
                Ok(_) => "apply:written".to_owned(),
                Err(refusal) => format!("apply:{}", refusal.reason),
            };
            with_state(|state| push_capped(&mut state.refusals, entry));
        }
        Ok(())
    }

    fn end_of_current(bucket: String) {
        with_state(|state| {
            if state.seen(&bucket).eoc {
                state.violation(format!("end-of-current twice for {bucket}"));
            }
            let seen = state.seen(&bucket);
            seen.eoc = true;
            push_capped(&mut seen.events, "eoc".to_owned());
        });
    }

    fn on_applied(bucket: String, cursor: u64) {
        let (mirrors, trap_after_one) = with_state(|state| {
            let first = state.seen(&bucket).cursor.is_none();
            state.seen(&bucket).cursor = Some(cursor);
            if !bucket.is_empty() {
                return (Vec::new(), false);
            }
            if first && !state.main_changed {
                // The host calls `on-applied` again for a commit whose writes may not have
                // landed, on an instance hydrated at that commit: what `apply` queued is gone,
                // so write what the folds say is missing instead.
                return (state.missing_mirrors(), false);
            }
            (
                std::mem::take(&mut state.mirrors),
                state.trap_after_first_mirror,
            )
        });
        for Mirror { key, value } in mirrors {
            let result = match &value {
                Some(value) => state::put(first_owned(), &key, value, &default_options()),
                None => state::delete(first_owned(), &key, &default_options()),
            };
            let entry = match result {
                Ok(written) => format!(
                    "{key}:{}:{}",
                    outcome_name(written.outcome),
                    written
                        .revision
                        .map_or_else(|| "none".to_owned(), |revision| revision.to_string())
                ),
                Err(refusal) => format!("{key}:refused:{}", refusal.reason),
            };
            with_state(|state| push_capped(&mut state.writes, entry));
            if trap_after_one {
                std::process::abort();
            }
        }
    }

    fn query(request: Vec<u8>) -> Result<Vec<u8>, String> {
        if request.trim_ascii_start().starts_with(b"{") {
            let answer = json_query(&request)?;
            return serde_json::to_vec(&answer).map_err(|error| error.to_string());
        }
        // A plain key, as the host's generic tests ask: the main bucket's committed fold.
        let key = String::from_utf8_lossy(&request);
        match fold::get(&key) {
            Some(entry) => Ok(entry.value),
            None => Err("not found".into()),
        }
    }
}

bindings::export!(StateGuest with_types_in bindings);

#[cfg(test)]
mod tests {
    use super::*;

    fn update(key: &str, value: &[u8], revision: u64, op: u8) -> Vec<u8> {
        let mut bytes = Vec::new();
        bytes.extend_from_slice(&u32::try_from(key.len()).unwrap().to_le_bytes());
        bytes.extend_from_slice(&u32::try_from(value.len()).unwrap().to_le_bytes());
        bytes.extend_from_slice(&revision.to_le_bytes());
        bytes.push(op);
        bytes.extend_from_slice(key.as_bytes());
        bytes.extend_from_slice(value);
        bytes
    }

    #[test]
    fn decodes_a_batch() {
        let mut batch = update("a", b"1", 7, 0);
        batch.extend(update("b", b"", 8, 1));
        batch.extend(update("c", b"", 9, 2));
        let updates = decode(&batch).unwrap();
        assert_eq!(updates.len(), 3);
        assert_eq!(updates[0].key, "a");
        assert!(matches!(updates[0].op, Op::Put));
        assert_eq!(updates[0].value, b"1");
        assert_eq!(updates[0].revision, 7);
        assert!(matches!(updates[1].op, Op::Delete));
        assert_eq!(updates[2].key, "c");
        assert!(matches!(updates[2].op, Op::Purge));
        assert_eq!(updates[2].revision, 9);
        assert_eq!(decode(&[]).unwrap().len(), 0);
    }

    #[test]
    fn refuses_a_malformed_batch() {
        let batch = update("key", b"value", 1, 0);
        for cut in 1..batch.len() {
            assert!(decode(&batch[..cut]).is_none(), "cut at {cut}");
        }
        assert!(decode(&update("k", b"", 1, 3)).is_none());
        let mut bad_utf8 = update("k", b"", 1, 0);
        *bad_utf8.last_mut().unwrap() = 0xff;
        assert!(decode(&bad_utf8).is_none());
        let mut huge = update("k", b"", 1, 0);
        huge[0..4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(decode(&huge).is_none());
    }
}
