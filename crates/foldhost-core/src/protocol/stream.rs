//! The server and the bucket's stream: features by version, stream creation, a recreated bucket, stream limits.

/// The JetStream features a server of `version` (`"2.11.3"`, `"v2.10.0-beta"`) offers, as
/// `(message TTL with delete markers, conditional publish, direct get)`. An unreadable version
/// offers none (the host then assumes the least and says so).
pub fn server_features(version: &str) -> (bool, bool, bool) {
    let v = version.trim().trim_start_matches('v');
    let mut parts = v.split(|c: char| !c.is_ascii_digit());
    let major = parts.next().and_then(|p| p.parse::<u32>().ok());
    let minor = parts.next().and_then(|p| p.parse::<u32>().ok());
    match (major, minor) {
        (Some(major), Some(minor)) => {
            let at_least = |a: u32, b: u32| major > a || (major == a && minor >= b);
            (at_least(2, 11), at_least(2, 6), at_least(2, 9))
        }
        _ => (false, false, false),
    }
}

/// How a raw `$JS.API.STREAM.CREATE` reply is taken (docs/operations.md, "Hosted NATS").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamCreateVerdict {
    /// The server created the stream (or found it already there with the same configuration).
    Created,
    /// JetStream error 10058: a stream of that name exists. Not fatal: the bucket is checked.
    AlreadyExists,
    /// The account's stream limit is reached. Not fatal when the bucket is already there (a
    /// provider answers this even for a bucket it holds): the bucket is checked.
    AtStreamLimit,
    /// Anything else: the create failed.
    Refused,
}

/// JetStream's error code for "stream name already in use".
pub(crate) const JS_STREAM_NAME_IN_USE: u64 = 10058;

/// Decides a raw stream-create reply from its error fields (`None` when the reply carries no
/// error). 10058 in either `code` or `err_code` (providers differ in which) is "already exists";
/// a 400 whose description says the maximum number of streams is reached is the at-limit answer;
/// any other error refuses. The two non-fatal verdicts are only half of the decision: the caller
/// must then find the bucket, or fail.
pub fn stream_create_verdict(
    error: Option<(Option<u64>, Option<u64>, &str)>,
) -> StreamCreateVerdict {
    let Some((code, err_code, description)) = error else {
        return StreamCreateVerdict::Created;
    };
    if code == Some(JS_STREAM_NAME_IN_USE) || err_code == Some(JS_STREAM_NAME_IN_USE) {
        return StreamCreateVerdict::AlreadyExists;
    }
    if code == Some(400)
        && description
            .to_ascii_lowercase()
            .contains("maximum number of streams")
    {
        return StreamCreateVerdict::AtStreamLimit;
    }
    StreamCreateVerdict::Refused
}

/// What a run does when the identity check finds the stream recreated (`--on-recreated`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OnRecreated {
    /// Refuse with one line naming the bucket, both identities and what to do; the fold is
    /// untouched (the default: a recreated bucket is an operator's act worth a look).
    #[default]
    Refuse,
    /// Repair as a cursor-less start: the key-listing diff against the new stream, the cursor
    /// and the old stream's retained records and eviction memo dropped, the new identity
    /// recorded, then a state-sync re-list.
    Relist,
}

/// The parts of a stream's config that decide what its retention removes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamLimits {
    /// Age limit (zero: none).
    pub max_age: std::time::Duration,
    /// Size limit in bytes (≤ 0: none).
    pub max_bytes: i64,
    /// Message count limit (≤ 0: none).
    pub max_messages: i64,
    /// A full stream discards its oldest messages (`discard: old`) rather than refusing writes.
    pub discard_old: bool,
    /// Messages may carry their own TTL.
    pub message_ttl: bool,
}

impl StreamLimits {
    /// A size or count limit that discards the oldest messages.
    fn oldest_first(&self) -> bool {
        self.discard_old && (self.max_bytes > 0 || self.max_messages > 0)
    }

    /// Whether retention can remove a key's *current* value (not only superseded ones): an age
    /// limit or an oldest-first size/count limit. A per-key history limit only drops superseded
    /// revisions, and `discard: new` refuses writes rather than evicting, so neither counts.
    ///
    /// Per-message TTLs do not count either — TTL buckets are deliberately not classed with
    /// `max_age` ones (docs/design.md, "Delete markers"): a message expires by its TTL because its
    /// writer asked for it, so the expiry is the writer's own delete. A key absent from the listing
    /// was deleted or expired — both deletes — so the listing stays the truth and the re-list
    /// repair is allowed. (The Python client creates every KV stream with `allow_msg_ttl`; classing
    /// those as evicting made them impossible to re-list.)
    pub fn evicts_current_values(&self) -> bool {
        !self.max_age.is_zero() || self.oldest_first()
    }

    /// Whether age is the only way to evict a current value (the precondition of the
    /// supersession-only resume: only then does "every later message is younger" mean "none aged
    /// out").
    pub fn age_only(&self) -> bool {
        !self.max_age.is_zero() && !self.oldest_first() && !self.message_ttl
    }
}

impl std::fmt::Display for OnRecreated {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            OnRecreated::Refuse => "refuse",
            OnRecreated::Relist => "relist",
        })
    }
}

impl std::str::FromStr for OnRecreated {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "refuse" => Ok(OnRecreated::Refuse),
            "relist" => Ok(OnRecreated::Relist),
            other => Err(format!(
                "{other:?} is not what to do with a recreated bucket (refuse, relist)"
            )),
        }
    }
}
