//! The NATS permissions a node needs for its buckets (docs/grants.md) and the rules for the state
//! buckets a module declares: the names it may use, the server bucket each name is, the host's
//! caps, and the refusals a write meets before anything reaches the server.
//!
//! Invariants:
//! - **One name, one bucket.** [`state_bucket`] is injective: module and local names are lowercase
//!   letters, digits and hyphens only, and the one underscore in a server name separates them, so
//!   two declarations never share a server bucket; [`check_declarations`] also refuses a derived
//!   name equal to the node's main bucket.
//! - **Caps are the host's.** A declaration above a cap is refused at load, never trimmed
//!   ([`check_declarations`]); a value or a bucket past a cap is refused before a publish
//!   ([`admit_state_write`]).
//! - **The host refuses first.** Every write a guest's grant would not allow (an undeclared bucket,
//!   one only read) is refused here with its reason, so the server's asynchronous permission
//!   violation — a timeout to a client — is never the answer a guest gets.
//! - **Grants are composed, not written.** [`compose_grants`] derives every subject from the
//!   buckets, in one place; the live suite loads what it prints into a real server.

use std::collections::BTreeSet;

/// The largest value a guest may write to a state bucket, by default (`--state-max-value`).
pub const DEFAULT_STATE_MAX_VALUE: u64 = 256 * 1024;

/// The largest a state bucket may grow, by default (`--state-max-bucket`).
pub const DEFAULT_STATE_MAX_BUCKET: u64 = 64 * 1024 * 1024;

/// The most values per key a bucket may keep (the server's own limit for a key-value bucket).
pub const MAX_STATE_HISTORY: u8 = 64;

/// The most buckets one module may declare, owned and read together.
pub const MAX_STATE_BUCKETS: usize = 16;

/// The longest module or local name.
pub const MAX_STATE_NAME: usize = 32;

/// The prefix of every state bucket's server name.
pub const STATE_BUCKET_PREFIX: &str = "state_";

/// The host's caps on state buckets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StateCaps {
    /// The largest value a write may carry.
    pub max_value: u64,
    /// The largest a bucket may grow (and the most a declaration may ask for).
    pub max_bucket: u64,
}

impl Default for StateCaps {
    fn default() -> Self {
        StateCaps {
            max_value: DEFAULT_STATE_MAX_VALUE,
            max_bucket: DEFAULT_STATE_MAX_BUCKET,
        }
    }
}

/// A bucket a module owns, as its manifest declares it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OwnedDecl {
    /// The local name (the guest names the bucket by it).
    pub name: String,
    /// Values kept per key (1 unless the owner says more).
    pub history: u8,
    /// How long a value lives, in milliseconds; 0: for ever.
    pub max_age_ms: u64,
    /// The most the bucket may hold, in bytes; 0: the host's cap.
    pub max_bytes: u64,
    /// Whether a write may carry a time to live of its own.
    pub per_key_ttl: bool,
}

/// What a guest may do with a bucket it names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Access {
    /// Declared under `state`: every verb.
    Own,
    /// Declared under `reads`: get, keys and the fold; never a write.
    Read,
}

/// One declared bucket, checked: how the guest names it, the server bucket it is, and what the
/// guest may do with it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StateBucket {
    /// The name the guest uses: the local name for its own, `<module>.<name>` for another's.
    pub local: String,
    /// The server bucket ([`state_bucket`]).
    pub bucket: String,
    /// Own or read.
    pub access: Access,
    /// The owner's options; `None` for a bucket only read (its owner declares them).
    pub options: Option<OwnedDecl>,
}

/// Why a module's declarations are refused at load.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DeclarationError {
    /// A module or local name outside the rule.
    #[error(
        "{what} {name:?} is not a state name: 1 to {MAX_STATE_NAME} lowercase letters, digits or hyphens, starting with a letter or digit"
    )]
    BadName {
        /// Which name (`module name`, `state bucket`, `read bucket`).
        what: &'static str,
        /// The name as declared.
        name: String,
    },
    /// A read not of the form `<module>.<name>`.
    #[error("read bucket {0:?} is not `<module>.<name>`")]
    BadRead(String),
    /// A read of the module's own bucket (named by its local name instead).
    #[error("read bucket {0:?} is the module's own: name it by its local name under `state`")]
    ReadsItself(String),
    /// The same name twice.
    #[error("bucket {0:?} is declared twice")]
    Duplicate(String),
    /// More buckets than [`MAX_STATE_BUCKETS`].
    #[error("{0} buckets declared: at most {MAX_STATE_BUCKETS}")]
    TooMany(usize),
    /// An option above a cap.
    #[error("state bucket {name:?}: {what} {asked} is above the host's cap of {cap}")]
    AboveCap {
        /// The local name.
        name: String,
        /// Which option.
        what: &'static str,
        /// What was declared.
        asked: u64,
        /// The cap.
        cap: u64,
    },
    /// A history of 0.
    #[error("state bucket {0:?}: keeps 0 values per key (at least 1)")]
    NoHistory(String),
    /// An age limit ([`evicting_state_refusal`]).
    #[error("state bucket {0:?}: {EVICTING_STATE}")]
    Evicting(String),
    /// A derived server name equal to the node's main bucket.
    #[error(
        "state bucket {local:?} would be server bucket {bucket:?}, which is the node's main bucket"
    )]
    IsMainBucket {
        /// The local name.
        local: String,
        /// The server name.
        bucket: String,
    },
}

/// Whether `name` is a module or local name: 1 to [`MAX_STATE_NAME`] of `[a-z0-9-]`, starting
/// with a letter or a digit.
pub fn is_state_name(name: &str) -> bool {
    let b = name.as_bytes();
    !b.is_empty()
        && b.len() <= MAX_STATE_NAME
        && b[0] != b'-'
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
}

/// Whether `local` names a state bucket as a guest does: an owned bucket's name, or a read one's
/// `<module>.<name>`, each part a [`is_state_name`]. Such a name is one plain path component (the
/// bucket's directory under a store's `state/`).
pub fn is_state_local(local: &str) -> bool {
    match local.split_once('.') {
        None => is_state_name(local),
        Some((module, name)) => is_state_name(module) && is_state_name(name),
    }
}

/// The server bucket of `module`'s state bucket `name`: `state_<module>_<name>`. Both names obey
/// [`is_state_name`] (no underscore), so the rule is injective.
pub fn state_bucket(module: &str, name: &str) -> String {
    format!("{STATE_BUCKET_PREFIX}{module}_{name}")
}

/// The module and local name a server bucket was derived from, when it is a state bucket's.
pub fn state_bucket_owner(bucket: &str) -> Option<(&str, &str)> {
    let rest = bucket.strip_prefix(STATE_BUCKET_PREFIX)?;
    let (module, name) = rest.split_once('_')?;
    (is_state_name(module) && is_state_name(name)).then_some((module, name))
}

fn checked_name(what: &'static str, name: &str) -> Result<(), DeclarationError> {
    if is_state_name(name) {
        Ok(())
    } else {
        Err(DeclarationError::BadName {
            what,
            name: name.to_string(),
        })
    }
}

fn checked_owned(d: &OwnedDecl, caps: StateCaps) -> Result<(), DeclarationError> {
    checked_name("state bucket", &d.name)?;
    if d.history == 0 {
        return Err(DeclarationError::NoHistory(d.name.clone()));
    }
    let above = |what, asked: u64, cap: u64| DeclarationError::AboveCap {
        name: d.name.clone(),
        what,
        asked,
        cap,
    };
    if d.history > MAX_STATE_HISTORY {
        return Err(above(
            "values kept per key",
            u64::from(d.history),
            u64::from(MAX_STATE_HISTORY),
        ));
    }
    if d.max_bytes > caps.max_bucket {
        return Err(above("max bytes", d.max_bytes, caps.max_bucket));
    }
    Ok(())
}

/// Why a state bucket whose values age out is refused (docs/state.md, "Declaring buckets"): its
/// fold, like the main one, keeps a value the server aged out, and a node down longer than the
/// age finds its cursor expired — which only an artifact restore repairs, and a state bucket's
/// fold is restored only by `bootstrap` and `import`, never by a running node's repair.
pub const EVICTING_STATE: &str = "a state bucket whose values age out (max-age-ms above 0) is not folded by this host: a node down longer than the age would find its cursor expired with no artifact to restore the bucket from (declare 0, and keep an expiry in the values)";

/// Whether a state bucket the server holds with `limits` is refused at start: one whose values
/// age out ([`EVICTING_STATE`]) — an owned declaration is refused at load already; this is a read
/// bucket's (or a hand-made bucket's) case.
pub fn evicting_state_refusal(limits: BucketLimits) -> bool {
    limits.max_age_ms > 0
}

/// Checks `module`'s declarations — `owned` (its `state`) and `reads` (`<module>.<name>` each)
/// — against the naming rule and the host's caps, and returns the buckets in the order declared
/// (owned first). A module that declares nothing needs no valid module name.
pub fn check_declarations(
    module: &str,
    owned: &[OwnedDecl],
    reads: &[String],
    caps: StateCaps,
    main_bucket: &str,
) -> Result<Vec<StateBucket>, DeclarationError> {
    if owned.is_empty() && reads.is_empty() {
        return Ok(Vec::new());
    }
    let total = owned.len() + reads.len();
    if total > MAX_STATE_BUCKETS {
        return Err(DeclarationError::TooMany(total));
    }
    checked_name("module name", module)?;
    let mut out = Vec::with_capacity(total);
    let mut seen = BTreeSet::new();
    for d in owned {
        checked_owned(d, caps)?;
        if d.max_age_ms > 0 {
            return Err(DeclarationError::Evicting(d.name.clone()));
        }
        if !seen.insert(d.name.clone()) {
            return Err(DeclarationError::Duplicate(d.name.clone()));
        }
        let options = OwnedDecl {
            max_bytes: if d.max_bytes == 0 {
                caps.max_bucket
            } else {
                d.max_bytes
            },
            ..d.clone()
        };
        out.push(StateBucket {
            local: d.name.clone(),
            bucket: state_bucket(module, &d.name),
            access: Access::Own,
            options: Some(options),
        });
    }
    for r in reads {
        let Some((m, n)) = r.split_once('.') else {
            return Err(DeclarationError::BadRead(r.clone()));
        };
        checked_name("module name", m)?;
        checked_name("read bucket", n)?;
        if m == module {
            return Err(DeclarationError::ReadsItself(r.clone()));
        }
        if !seen.insert(r.clone()) {
            return Err(DeclarationError::Duplicate(r.clone()));
        }
        out.push(StateBucket {
            local: r.clone(),
            bucket: state_bucket(m, n),
            access: Access::Read,
            options: None,
        });
    }
    if let Some(b) = out.iter().find(|b| b.bucket == main_bucket) {
        return Err(DeclarationError::IsMainBucket {
            local: b.local.clone(),
            bucket: b.bucket.clone(),
        });
    }
    Ok(out)
}

/// The limits of a bucket's stream as the server holds them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BucketLimits {
    /// Values kept per key.
    pub history: i64,
    /// How long a value lives, in milliseconds; 0: for ever.
    pub max_age_ms: u64,
    /// The most the bucket may hold, in bytes; -1: no limit.
    pub max_bytes: i64,
}

/// What differs between an owned bucket's declaration (as [`check_declarations`] returned it:
/// `max_bytes` resolved) and the bucket the server holds under its name, in words; `None` when
/// they agree. The host never changes an existing bucket: a difference is refused at start.
pub fn state_config_mismatch(d: &OwnedDecl, actual: BucketLimits) -> Option<String> {
    let mut diffs = Vec::new();
    if actual.history != i64::from(d.history) {
        diffs.push(format!(
            "keeps {} values per key (declared {})",
            actual.history, d.history
        ));
    }
    if actual.max_age_ms != d.max_age_ms {
        diffs.push(format!(
            "max age {} ms (declared {} ms)",
            actual.max_age_ms, d.max_age_ms
        ));
    }
    if u64::try_from(actual.max_bytes).ok() != Some(d.max_bytes) {
        diffs.push(format!(
            "max bytes {} (declared {})",
            actual.max_bytes, d.max_bytes
        ));
    }
    (!diffs.is_empty()).then(|| diffs.join(", "))
}

/// The guest call a state verb is made from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GuestCall {
    /// `parse`: re-run on hydration and retry.
    Parse,
    /// `apply`: re-run on hydration and retry.
    Apply,
    /// `on-applied`: once per committed batch.
    OnApplied,
    /// `query`: once per request.
    Query,
    /// `manifest` or `init`.
    Setup,
}

impl GuestCall {
    /// The call's name in the guest contract.
    pub fn as_str(self) -> &'static str {
        match self {
            GuestCall::Parse => "parse",
            GuestCall::Apply => "apply",
            GuestCall::OnApplied => "on-applied",
            GuestCall::Query => "query",
            GuestCall::Setup => "init",
        }
    }
}

/// Why a guest's write is refused before anything reaches the server.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum StateRefusal {
    /// The bucket is not among the module's declarations.
    #[error("bucket {0:?} is not declared by this module (declare it under `state` or `reads`)")]
    Undeclared(String),
    /// The bucket is only read.
    #[error("bucket {0:?} is only read by this module: its owner writes it")]
    ReadOnly(String),
    /// A write from a call the host re-runs.
    #[error(
        "a write from `{}` is refused: `parse` and `apply` re-run on hydration and retry, so a write there would repeat; write from `on-applied` or `query`",
        .0.as_str()
    )]
    WrongCall(GuestCall),
    /// A value over the cap.
    #[error("a {bytes}-byte value is over the host's cap of {cap} bytes")]
    TooLarge {
        /// The value's size.
        bytes: u64,
        /// The cap.
        cap: u64,
    },
    /// A write that would take the bucket past its size.
    #[error("bucket {bucket:?} holds {holds} bytes: {bytes} more would pass its {cap}")]
    BucketFull {
        /// The local name.
        bucket: String,
        /// What it holds now.
        holds: u64,
        /// The write's size.
        bytes: u64,
        /// Its limit.
        cap: u64,
    },
    /// A JSON value with a field named as a credential.
    #[error(
        "the value carries a field named {0:?}: credentials are never kept in a bucket (a bucket is a stream every reader replays)"
    )]
    Credential(String),
    /// A time to live on a bucket whose owner did not allow them.
    #[error("bucket {0:?} does not allow a time to live per key")]
    NoTtl(String),
}

impl StateRefusal {
    /// The one word a caller branches on.
    pub fn reason(&self) -> &'static str {
        match self {
            StateRefusal::Undeclared(_) => "undeclared",
            StateRefusal::ReadOnly(_) => "read_only",
            StateRefusal::WrongCall(_) => "wrong_call",
            StateRefusal::TooLarge { .. } => "too_large",
            StateRefusal::BucketFull { .. } => "bucket_full",
            StateRefusal::Credential(_) => "credential",
            StateRefusal::NoTtl(_) => "no_ttl",
        }
    }
}

/// A state write, as the host sees it before deciding.
#[derive(Clone, Copy, Debug)]
pub struct StateWrite<'a> {
    /// The bucket as the guest named it.
    pub local: &'a str,
    /// The call it is made from.
    pub call: GuestCall,
    /// The value of a put; `None` for a delete.
    pub value: Option<&'a [u8]>,
    /// Whether it asks for a time to live of its own.
    pub ttl: bool,
}

/// Decides a guest's state write before anything is published: the call it comes from, the
/// bucket's declaration and access, the value's size and credential fields, and the bucket's size
/// with it (`holds`: what the bucket holds now, in bytes).
pub fn admit_state_write(
    w: StateWrite<'_>,
    bucket: Option<&StateBucket>,
    holds: u64,
    caps: StateCaps,
) -> Result<(), StateRefusal> {
    if !matches!(w.call, GuestCall::OnApplied | GuestCall::Query) {
        return Err(StateRefusal::WrongCall(w.call));
    }
    let Some(b) = bucket else {
        return Err(StateRefusal::Undeclared(w.local.to_string()));
    };
    let Some(options) = b.options.as_ref().filter(|_| b.access == Access::Own) else {
        return Err(StateRefusal::ReadOnly(w.local.to_string()));
    };
    if w.ttl && !options.per_key_ttl {
        return Err(StateRefusal::NoTtl(w.local.to_string()));
    }
    let Some(value) = w.value else {
        return Ok(());
    };
    let bytes = value.len() as u64;
    if bytes > caps.max_value {
        return Err(StateRefusal::TooLarge {
            bytes,
            cap: caps.max_value,
        });
    }
    let cap = options.max_bytes.min(caps.max_bucket);
    if holds.saturating_add(bytes) > cap {
        return Err(StateRefusal::BucketFull {
            bucket: w.local.to_string(),
            holds,
            bytes,
            cap,
        });
    }
    if let Some(field) = credential_field(value) {
        return Err(StateRefusal::Credential(field));
    }
    Ok(())
}

/// Field names that say a credential, compared after lowercasing and dropping `-` and `_`; a name
/// that is one of them or ends with one (`db_password`, `accessToken`) is a credential's.
const CREDENTIAL_WORDS: &[&str] = &[
    "password",
    "passwd",
    "passphrase",
    "secret",
    "token",
    "authorization",
    "apikey",
    "privatekey",
    "credential",
    "credentials",
    "accesskey",
    "cookie",
    "bearer",
];

/// Whether the field name `name` says it holds a credential.
pub fn is_credential_name(name: &str) -> bool {
    let folded: String = name
        .chars()
        .filter(|c| *c != '-' && *c != '_')
        .flat_map(char::to_lowercase)
        .collect();
    CREDENTIAL_WORDS.iter().any(|w| folded.ends_with(w))
}

/// The first field, at any depth, of the JSON `value` whose name says it is a credential
/// ([`is_credential_name`]); `None` when there is none or `value` is not JSON. This catches the
/// ordinary mistake (a header or a config object stored whole), not a determined one: an encoded
/// or renamed secret passes.
pub fn credential_field(value: &[u8]) -> Option<String> {
    let first = value.iter().find(|b| !b.is_ascii_whitespace())?;
    if *first != b'{' && *first != b'[' {
        return None;
    }
    let parsed: serde_json::Value = serde_json::from_slice(value).ok()?;
    let mut stack = vec![&parsed];
    while let Some(v) = stack.pop() {
        match v {
            serde_json::Value::Object(m) => {
                for (k, inner) in m {
                    if is_credential_name(k) {
                        return Some(k.clone());
                    }
                    stack.push(inner);
                }
            }
            serde_json::Value::Array(items) => stack.extend(items.iter()),
            _ => {}
        }
    }
    None
}

/// What a node does with one bucket, for its grants.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BucketUse {
    /// The server bucket.
    pub bucket: String,
    /// Whether the node creates it when absent and checks its configuration.
    pub asserts: bool,
    /// Whether the node writes to it.
    pub writes: bool,
}

/// The subjects a node may publish to and subscribe on.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Grants {
    /// Subjects the node publishes to (requests included).
    pub publish: Vec<String>,
    /// Subjects the node subscribes on.
    pub subscribe: Vec<String>,
}

/// The permissions a node needs for `buckets` (each folded), with its inbox prefix and the
/// subjects it serves queries and writes on (each as its subscribe grant: `SUBJECT QUEUE` for a
/// queue subscription): to fold a bucket — its stream's info, ordered and
/// listing consumers created and deleted, direct and stream gets, flow-control replies —, to
/// assert one, and to write one. The lists are sorted and without repeats.
pub fn compose_grants(buckets: &[BucketUse], inbox_prefix: &str, serves: &[String]) -> Grants {
    let mut publish = BTreeSet::new();
    let mut subscribe = BTreeSet::new();
    for b in buckets {
        let stream = format!("KV_{}", b.bucket);
        publish.insert(format!("$JS.API.STREAM.INFO.{stream}"));
        publish.insert(format!("$JS.API.CONSUMER.CREATE.{stream}"));
        publish.insert(format!("$JS.API.CONSUMER.CREATE.{stream}.>"));
        publish.insert(format!("$JS.API.CONSUMER.DELETE.{stream}.>"));
        publish.insert(format!("$JS.API.DIRECT.GET.{stream}"));
        publish.insert(format!("$JS.API.DIRECT.GET.{stream}.>"));
        publish.insert(format!("$JS.API.STREAM.MSG.GET.{stream}"));
        publish.insert(format!("$JS.FC.{stream}.>"));
        if b.asserts {
            publish.insert(format!("$JS.API.STREAM.CREATE.{stream}"));
            // The client reads the account's limits before it creates a bucket.
            publish.insert("$JS.API.INFO".to_string());
        }
        if b.writes {
            publish.insert(format!("$KV.{}.>", b.bucket));
        }
    }
    subscribe.insert(format!("{inbox_prefix}.>"));
    for s in serves {
        subscribe.insert(s.clone());
    }
    Grants {
        publish: publish.into_iter().collect(),
        subscribe: subscribe.into_iter().collect(),
    }
}

/// `grants` as the `permissions` block of a nats-server `authorization` user, ready to paste.
pub fn grants_block(grants: &Grants) -> String {
    let list = |xs: &[String]| {
        xs.iter()
            .map(|s| format!("    {s:?}"))
            .collect::<Vec<_>>()
            .join(",\n")
    };
    format!(
        "permissions: {{\n  publish: {{ allow: [\n{}\n  ] }}\n  subscribe: {{ allow: [\n{}\n  ] }}\n}}\n",
        list(&grants.publish),
        list(&grants.subscribe)
    )
}

/// What a server's permission violation denied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Denied {
    /// A publish (a request included).
    Publish,
    /// A subscription.
    Subscribe,
}

impl Denied {
    /// How a message names it.
    pub fn as_str(self) -> &'static str {
        match self {
            Denied::Publish => "publish",
            Denied::Subscribe => "subscribe",
        }
    }
}

/// The subject a server's error message says was denied: nats-server reports a permission
/// violation asynchronously, on the connection (`-ERR 'Permissions Violation for Publish to
/// "SUBJ"'`, or `for Subscription to`), and the client that published waits out its deadline.
/// `None` for any other error.
pub fn permission_violation(message: &str) -> Option<(Denied, &str)> {
    let m = message.trim().trim_matches('\'').trim();
    const HEAD: &str = "permissions violation for ";
    let head = m.get(..HEAD.len())?;
    if !head.eq_ignore_ascii_case(HEAD) {
        return None;
    }
    let rest = &m[HEAD.len()..];
    let (denied, rest) = if let Some(r) = strip_prefix_ignore_case(rest, "publish to ") {
        (Denied::Publish, r)
    } else if let Some(r) = strip_prefix_ignore_case(rest, "subscription to ") {
        (Denied::Subscribe, r)
    } else {
        return None;
    };
    let quoted = rest.strip_prefix('"')?;
    let end = quoted.find('"')?;
    let subject = &quoted[..end];
    (!subject.is_empty()).then_some((denied, subject))
}

fn strip_prefix_ignore_case<'a>(s: &'a str, prefix: &str) -> Option<&'a str> {
    let head = s.get(..prefix.len())?;
    head.eq_ignore_ascii_case(prefix)
        .then(|| &s[prefix.len()..])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owned(name: &str) -> OwnedDecl {
        OwnedDecl {
            name: name.into(),
            history: 1,
            max_age_ms: 0,
            max_bytes: 0,
            per_key_ttl: false,
        }
    }

    #[test]
    fn the_naming_rule_gives_two_declarations_two_buckets_and_names_its_owner_back() {
        let names = ["a", "b", "a-b", "b-a", "ab", "a1", "1a", "servers"];
        let mut seen = BTreeSet::new();
        for m in names {
            for n in names {
                let b = state_bucket(m, n);
                assert!(seen.insert(b.clone()), "{m}/{n} collides as {b}");
                assert_eq!(state_bucket_owner(&b), Some((m, n)));
            }
        }
        assert_eq!(state_bucket_owner("routes"), None);
        assert_eq!(state_bucket_owner("state_a_b_c"), None, "not from the rule");
        for bad in [
            "",
            "A",
            "a_b",
            "a.b",
            "-a",
            "é",
            &"a".repeat(MAX_STATE_NAME + 1),
        ] {
            assert!(!is_state_name(bad), "{bad:?}");
        }
        assert!(is_state_name(&"a".repeat(MAX_STATE_NAME)));
    }

    #[test]
    fn a_state_local_name_is_a_name_or_module_dot_name_and_one_path_component() {
        for ok in ["notes", "agent.servers", "a-1.b-2"] {
            assert!(is_state_local(ok), "{ok:?}");
        }
        for bad in [
            "", ".", "..", "a.", ".a", "a.b.c", "a/b", "a..b", "A.b", "a._b",
        ] {
            assert!(!is_state_local(bad), "{bad:?}");
        }
    }

    #[test]
    fn declarations_are_checked_against_the_rule_and_the_caps_and_never_trimmed() {
        let caps = StateCaps::default();
        valid_declarations_become_buckets(caps);
        declarations_above_the_caps_or_evicting_are_refused(caps);
        declarations_against_the_naming_rule_are_refused(caps);
    }

    /// `agent`'s declarations checked against `caps`, with `state_agent_main` its main bucket.
    fn declared(
        caps: StateCaps,
        owned_: &[OwnedDecl],
        reads: &[&str],
    ) -> Result<Vec<StateBucket>, DeclarationError> {
        let reads: Vec<String> = reads.iter().map(|s| s.to_string()).collect();
        check_declarations("agent", owned_, &reads, caps, "state_agent_main")
    }

    fn valid_declarations_become_buckets(caps: StateCaps) {
        let ok = check_declarations(
            "agent",
            &[owned("servers")],
            &["licence.binding".into()],
            caps,
            "routes",
        )
        .expect("valid");
        assert_eq!(ok.len(), 2);
        assert_eq!(ok[0].bucket, "state_agent_servers");
        assert_eq!(ok[0].access, Access::Own);
        assert_eq!(
            ok[0].options.as_ref().map(|o| o.max_bytes),
            Some(caps.max_bucket),
            "0 is the cap"
        );
        assert_eq!(ok[1].local, "licence.binding");
        assert_eq!(ok[1].bucket, "state_licence_binding");
        assert_eq!(ok[1].access, Access::Read);
        assert_eq!(
            check_declarations("Agent", &[], &[], caps, "routes"),
            Ok(vec![]),
            "nothing declared: the name does not matter"
        );
    }

    fn declarations_above_the_caps_or_evicting_are_refused(caps: StateCaps) {
        let refused = |owned_: &[OwnedDecl], reads: &[&str]| declared(caps, owned_, reads);
        let big = OwnedDecl {
            max_bytes: caps.max_bucket + 1,
            ..owned("big")
        };
        let deep = OwnedDecl {
            history: MAX_STATE_HISTORY + 1,
            ..owned("deep")
        };
        let none = OwnedDecl {
            history: 0,
            ..owned("none")
        };
        assert!(matches!(
            refused(&[big], &[]),
            Err(DeclarationError::AboveCap {
                what: "max bytes",
                ..
            })
        ));
        assert!(matches!(
            refused(&[deep], &[]),
            Err(DeclarationError::AboveCap { .. })
        ));
        assert!(matches!(
            refused(&[none], &[]),
            Err(DeclarationError::NoHistory(_))
        ));
        let ageing = OwnedDecl {
            max_age_ms: 60_000,
            ..owned("ageing")
        };
        assert!(matches!(
            refused(&[ageing], &[]),
            Err(DeclarationError::Evicting(n)) if n == "ageing"
        ));
        assert!(evicting_state_refusal(BucketLimits {
            history: 1,
            max_age_ms: 1,
            max_bytes: -1
        }));
    }

    fn declarations_against_the_naming_rule_are_refused(caps: StateCaps) {
        let refused = |owned_: &[OwnedDecl], reads: &[&str]| declared(caps, owned_, reads);
        assert!(matches!(
            refused(&[owned("a_b")], &[]),
            Err(DeclarationError::BadName { .. })
        ));
        assert!(matches!(
            refused(&[owned("x"), owned("x")], &[]),
            Err(DeclarationError::Duplicate(_))
        ));
        assert!(matches!(
            refused(&[], &["nodot"]),
            Err(DeclarationError::BadRead(_))
        ));
        assert!(matches!(
            refused(&[], &["agent.x"]),
            Err(DeclarationError::ReadsItself(_))
        ));
        assert!(matches!(
            refused(&[], &["o.x", "o.x"]),
            Err(DeclarationError::Duplicate(_))
        ));
        assert!(matches!(
            refused(&[owned("main")], &[]),
            Err(DeclarationError::IsMainBucket { .. })
        ));
        let many: Vec<OwnedDecl> = (0..=MAX_STATE_BUCKETS)
            .map(|i| owned(&format!("b{i}")))
            .collect();
        assert!(matches!(
            refused(&many, &[]),
            Err(DeclarationError::TooMany(_))
        ));
    }

    #[test]
    fn a_write_is_refused_before_a_publish_naming_its_reason() {
        let w = Writes::new();
        a_write_is_made_from_a_query_or_on_applied_only(&w);
        a_write_names_a_bucket_the_module_owns(&w);
        a_write_fits_the_caps_and_carries_no_credential_nor_ttl(&w);
    }

    /// The buckets a write names: `own` (owned) and `o.theirs` (read), under caps of 100-byte
    /// values and 1000-byte buckets.
    struct Writes {
        caps: StateCaps,
        buckets: Vec<StateBucket>,
    }

    impl Writes {
        fn new() -> Self {
            let caps = StateCaps {
                max_value: 100,
                max_bucket: 1000,
            };
            let buckets =
                check_declarations("m", &[owned("own")], &["o.theirs".into()], caps, "main")
                    .expect("valid");
            Self { caps, buckets }
        }

        fn own(&self) -> Option<&StateBucket> {
            Some(&self.buckets[0])
        }

        fn theirs(&self) -> Option<&StateBucket> {
            Some(&self.buckets[1])
        }
    }

    fn put<'a>(local: &'a str, call: GuestCall, value: &'a [u8]) -> StateWrite<'a> {
        StateWrite {
            local,
            call,
            value: Some(value),
            ttl: false,
        }
    }

    fn reason(r: Result<(), StateRefusal>) -> Option<&'static str> {
        r.err().map(|e| e.reason())
    }

    fn a_write_is_made_from_a_query_or_on_applied_only(w: &Writes) {
        let (own, caps) = (w.own(), w.caps);
        assert_eq!(
            admit_state_write(put("own", GuestCall::Query, b"v"), own, 0, caps),
            Ok(())
        );
        assert_eq!(
            admit_state_write(put("own", GuestCall::OnApplied, b"v"), own, 0, caps),
            Ok(())
        );
        for call in [GuestCall::Parse, GuestCall::Apply, GuestCall::Setup] {
            assert_eq!(
                reason(admit_state_write(put("own", call, b"v"), own, 0, caps)),
                Some("wrong_call")
            );
        }
    }

    fn a_write_names_a_bucket_the_module_owns(w: &Writes) {
        let (theirs, caps) = (w.theirs(), w.caps);
        assert_eq!(
            reason(admit_state_write(
                put("nope", GuestCall::Query, b"v"),
                None,
                0,
                caps
            )),
            Some("undeclared")
        );
        assert_eq!(
            reason(admit_state_write(
                put("o.theirs", GuestCall::Query, b"v"),
                theirs,
                0,
                caps
            )),
            Some("read_only")
        );
        let delete = StateWrite {
            value: None,
            ..put("o.theirs", GuestCall::Query, b"")
        };
        assert_eq!(
            reason(admit_state_write(delete, theirs, 0, caps)),
            Some("read_only")
        );
    }

    fn a_write_fits_the_caps_and_carries_no_credential_nor_ttl(w: &Writes) {
        let (own, caps) = (w.own(), w.caps);
        assert_eq!(
            reason(admit_state_write(
                put("own", GuestCall::Query, &[b'x'; 101]),
                own,
                0,
                caps
            )),
            Some("too_large")
        );
        assert_eq!(
            reason(admit_state_write(
                put("own", GuestCall::Query, &[b'x'; 100]),
                own,
                900,
                caps
            )),
            None,
            "exactly full"
        );
        assert_eq!(
            reason(admit_state_write(
                put("own", GuestCall::Query, &[b'x'; 100]),
                own,
                901,
                caps
            )),
            Some("bucket_full")
        );
        assert_eq!(
            reason(admit_state_write(
                put(
                    "own",
                    GuestCall::Query,
                    br#"{"url":"x","headers":{"Authorization":"Bearer y"}}"#
                ),
                own,
                0,
                caps
            )),
            Some("credential")
        );
        let ttl = StateWrite {
            ttl: true,
            ..put("own", GuestCall::Query, b"v")
        };
        assert_eq!(reason(admit_state_write(ttl, own, 0, caps)), Some("no_ttl"));
    }

    #[test]
    fn a_credential_is_found_by_its_field_name_at_any_depth_and_only_in_json() {
        assert_eq!(
            credential_field(br#"{"password":"x"}"#).as_deref(),
            Some("password")
        );
        assert_eq!(
            credential_field(br#"[{"a":{"b":[{"DB_Password":1}]}}]"#).as_deref(),
            Some("DB_Password")
        );
        assert_eq!(
            credential_field(br#"{"accessToken":"x"}"#).as_deref(),
            Some("accessToken")
        );
        assert_eq!(
            credential_field(br#"{"api-key":"x"}"#).as_deref(),
            Some("api-key")
        );
        assert_eq!(
            credential_field(br#"{"private_key":"x"}"#).as_deref(),
            Some("private_key")
        );
        assert_eq!(
            credential_field(br#"{"client_secret":"x"}"#).as_deref(),
            Some("client_secret")
        );
        assert_eq!(
            credential_field(br#"{"url":"x","token_count":3,"tokens":2}"#),
            None
        );
        assert_eq!(
            credential_field(br#"{"note":"my password is x"}"#),
            None,
            "values are not read"
        );
        assert_eq!(credential_field(b"password=x"), None, "not JSON");
        assert_eq!(
            credential_field(br#"{"password":"#),
            None,
            "torn JSON is opaque bytes"
        );
    }

    #[test]
    fn grants_give_a_reader_no_write_and_an_owner_its_stream_creation() {
        let g = compose_grants(
            &[
                BucketUse {
                    bucket: "state_m_own".into(),
                    asserts: true,
                    writes: true,
                },
                BucketUse {
                    bucket: "state_o_theirs".into(),
                    asserts: false,
                    writes: false,
                },
            ],
            "_INBOX_node",
            &["q.routes".into()],
        );
        assert!(g.publish.contains(&"$KV.state_m_own.>".to_string()));
        assert!(
            !g.publish
                .iter()
                .any(|s| s.starts_with("$KV.state_o_theirs"))
        );
        assert!(
            g.publish
                .contains(&"$JS.API.STREAM.CREATE.KV_state_m_own".to_string())
        );
        assert!(
            !g.publish
                .iter()
                .any(|s| s.contains("STREAM.CREATE.KV_state_o_theirs"))
        );
        assert!(
            g.publish
                .contains(&"$JS.API.CONSUMER.DELETE.KV_state_o_theirs.>".to_string())
        );
        assert_eq!(g.subscribe, ["_INBOX_node.>", "q.routes"]);
        let mut sorted = g.publish.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted, g.publish);
        let block = grants_block(&g);
        assert!(block.starts_with("permissions: {"), "{block}");
        assert!(block.contains("\"$KV.state_m_own.>\""), "{block}");
    }

    #[test]
    fn a_permission_violation_names_what_was_denied_and_nothing_else_does() {
        assert_eq!(
            permission_violation(r#"'Permissions Violation for Publish to "$KV.b.k"'"#),
            Some((Denied::Publish, "$KV.b.k"))
        );
        assert_eq!(
            permission_violation(
                r#"permissions violation for subscription to "q.x" using queue "w""#
            ),
            Some((Denied::Subscribe, "q.x"))
        );
        for other in [
            "Authorization Violation",
            "Permissions Violation for Publish to",
            r#"Permissions Violation for Publish to """#,
            r#"Permissions Violation for Publish with Reply of "x""#,
            "Maximum Payload Violation",
            "",
        ] {
            assert_eq!(permission_violation(other), None, "{other:?}");
        }
    }

    #[test]
    fn an_existing_bucket_that_differs_from_its_declaration_is_named_field_by_field() {
        let d = OwnedDecl {
            name: "notes".into(),
            history: 1,
            max_age_ms: 0,
            max_bytes: 1024,
            per_key_ttl: false,
        };
        let same = BucketLimits {
            history: 1,
            max_age_ms: 0,
            max_bytes: 1024,
        };
        assert_eq!(state_config_mismatch(&d, same), None);
        let other = BucketLimits {
            history: 5,
            max_age_ms: 60_000,
            max_bytes: -1,
        };
        let why = state_config_mismatch(&d, other).expect("differs");
        assert_eq!(
            why,
            "keeps 5 values per key (declared 1), max age 60000 ms (declared 0 ms), max bytes -1 (declared 1024)"
        );
    }
}
