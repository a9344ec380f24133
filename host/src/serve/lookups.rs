//! Batched lookups: several queries in one `POST /query` (or one NATS request on
//! `--query-subject`) whose `Content-Type` is [`LOOKUPS_CONTENT_TYPE`], answered in one body of the
//! same type. Pure functions over bytes, both directions (the host decodes lookups and encodes
//! results; a client does the reverse).
//!
//! The wire format, big-endian throughout:
//! - **lookups** (the request body): each lookup a 4-byte length then that many bytes, back to
//!   back; an empty body is zero lookups. At most [`MAX_LOOKUPS`].
//! - **results** (the answer body): one per lookup, in the lookups' order: a 1-byte [`Outcome`],
//!   a 4-byte length, then that many bytes (the guest's answer, or the error text).
//!
//! Invariants: a decoder never reads past the body nor allocates more than the body holds; a
//! frame that is cut short or whose length passes the body's end is refused naming the byte
//! offset at which it starts ([`FrameError`]); the limit on lookups is checked before the
//! lookup past it is copied.

/// The `Content-Type` of a batch of lookups and of its results.
pub const LOOKUPS_CONTENT_TYPE: &str = "application/x-foldhost-lookups";

/// Most lookups one request carries.
pub const MAX_LOOKUPS: usize = 4096;

/// What became of one lookup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The guest answered: the bytes are its answer.
    Answer = 0,
    /// The guest's `query` failed: the bytes are its error text.
    GuestError = 1,
    /// Not answered (no guest instance right now, say): the bytes say why; retry.
    NotAnswered = 2,
}

impl Outcome {
    fn from_byte(b: u8) -> Option<Outcome> {
        match b {
            0 => Some(Outcome::Answer),
            1 => Some(Outcome::GuestError),
            2 => Some(Outcome::NotAnswered),
            _ => None,
        }
    }
}

/// A body that is not a sequence of frames.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// The body ends inside a frame's header (its outcome byte or its 4-byte length).
    #[error("frame at byte {offset}: the body ends inside its header ({left} of {need} bytes)")]
    Truncated {
        /// Where the frame starts.
        offset: usize,
        /// Bytes left in the body there.
        left: usize,
        /// Bytes its header takes.
        need: usize,
    },
    /// A frame's length passes the body's end.
    #[error(
        "frame at byte {offset}: its length {length} passes the body's end ({left} bytes left)"
    )]
    PastEnd {
        /// Where the frame starts.
        offset: usize,
        /// The length it declares.
        length: u32,
        /// Bytes left after its header.
        left: usize,
    },
    /// More frames than [`MAX_LOOKUPS`].
    #[error("frame at byte {offset}: more than {max} lookups in one request")]
    TooMany {
        /// Where the first frame past the limit starts.
        offset: usize,
        /// The limit.
        max: usize,
    },
    /// A result's outcome byte is none of [`Outcome`]'s.
    #[error("frame at byte {offset}: unknown outcome {byte}")]
    Outcome {
        /// Where the frame starts.
        offset: usize,
        /// The byte read.
        byte: u8,
    },
}

/// Splits `body` into frames of `header` bytes (the last 4 of which are the length) then the
/// length's bytes, at most `max` of them; each frame's header byte before the length (if any)
/// and its bytes.
fn frames(body: &[u8], header: usize, max: usize) -> Result<Vec<(u8, &[u8])>, FrameError> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < body.len() {
        if out.len() == max {
            return Err(FrameError::TooMany { offset: at, max });
        }
        let left = body.len() - at;
        let Some(head) = body.get(at..at + header) else {
            return Err(FrameError::Truncated {
                offset: at,
                left,
                need: header,
            });
        };
        let mut len = [0u8; 4];
        len.copy_from_slice(&head[header - 4..]);
        let length = u32::from_be_bytes(len);
        let start = at + header;
        let end = usize::try_from(length)
            .ok()
            .and_then(|n| start.checked_add(n))
            .filter(|&e| e <= body.len())
            .ok_or(FrameError::PastEnd {
                offset: at,
                length,
                left: body.len() - start,
            })?;
        let tag = if header > 4 { head[0] } else { 0 };
        out.push((tag, &body[start..end]));
        at = end;
    }
    Ok(out)
}

/// The lookups of a request body: at most [`MAX_LOOKUPS`]; an empty body is none.
pub fn decode_lookups(body: &[u8]) -> Result<Vec<Vec<u8>>, FrameError> {
    Ok(frames(body, 4, MAX_LOOKUPS)?
        .into_iter()
        .map(|(_, b)| b.to_vec())
        .collect())
}

/// The request body of `lookups` (a client's side). Each lookup must be under 4 GiB.
pub fn encode_lookups<B: AsRef<[u8]>>(lookups: &[B]) -> Vec<u8> {
    let total = lookups.iter().map(|l| 4 + l.as_ref().len()).sum();
    let mut out = Vec::with_capacity(total);
    for l in lookups {
        put_frame(&mut out, l.as_ref());
    }
    out
}

/// The answer body of `results`, in order.
pub fn encode_results<B: AsRef<[u8]>>(results: &[(Outcome, B)]) -> Vec<u8> {
    let total = results.iter().map(|(_, b)| 5 + b.as_ref().len()).sum();
    let mut out = Vec::with_capacity(total);
    for (outcome, bytes) in results {
        out.push(*outcome as u8);
        put_frame(&mut out, bytes.as_ref());
    }
    out
}

/// The results of an answer body (a client's side), at most [`MAX_LOOKUPS`].
pub fn decode_results(body: &[u8]) -> Result<Vec<(Outcome, Vec<u8>)>, FrameError> {
    let mut out = Vec::new();
    let mut at = 0;
    for (tag, bytes) in frames(body, 5, MAX_LOOKUPS)? {
        let outcome = Outcome::from_byte(tag).ok_or(FrameError::Outcome {
            offset: at,
            byte: tag,
        })?;
        at += 5 + bytes.len();
        out.push((outcome, bytes.to_vec()));
    }
    Ok(out)
}

/// What a lookup's result is on the wire: the guest's answer (0), its error's text (1), or —
/// when the guest had no instance to answer with (it is being rebuilt) — not answered (2), with
/// why.
pub(crate) fn outcome_of(looked: &super::Looked) -> (Outcome, std::borrow::Cow<'_, [u8]>) {
    match looked {
        Ok(answer) => (Outcome::Answer, answer.as_slice().into()),
        Err(e) if e.is_rebuilding() => (Outcome::NotAnswered, e.to_string().into_bytes().into()),
        Err(e) => (Outcome::GuestError, e.to_string().into_bytes().into()),
    }
}

/// The answer body of a batch's results ([`outcome_of`] each, in order).
pub(crate) fn encode_looked(results: &[super::Looked]) -> Vec<u8> {
    let framed: Vec<_> = results.iter().map(outcome_of).collect();
    encode_results(&framed)
}

/// Appends `bytes` as one frame: its length (4 bytes, big-endian), then the bytes. A length past
/// `u32::MAX` cannot be framed; the callers' bodies are bounded far below it.
fn put_frame(out: &mut Vec<u8>, bytes: &[u8]) {
    let len = u32::try_from(bytes.len()).unwrap_or(u32::MAX);
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(&bytes[..len as usize]);
}

/// Whether a `Content-Type` value names a batch of lookups (its media type, case aside;
/// parameters ignored).
pub(crate) fn is_lookups(content_type: &str) -> bool {
    content_type
        .split(';')
        .next()
        .is_some_and(|t| t.trim().eq_ignore_ascii_case(LOOKUPS_CONTENT_TYPE))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookups_and_results_round_trip_in_order_empty_ones_included() {
        let lookups: Vec<Vec<u8>> = vec![b"route.a".to_vec(), Vec::new(), vec![0, 255, 7]];
        let body = encode_lookups(&lookups);
        assert_eq!(body.len(), 4 * 3 + 7 + 3);
        assert_eq!(&body[..4], &7u32.to_be_bytes());
        assert_eq!(decode_lookups(&body), Ok(lookups));
        let results = vec![
            (Outcome::Answer, b"{\"upstream\":\"1\"}".to_vec()),
            (
                Outcome::GuestError,
                b"kvstore@0.1.0: query failed: missing".to_vec(),
            ),
            (Outcome::NotAnswered, b"guest rebuilding".to_vec()),
            (Outcome::Answer, Vec::new()),
        ];
        let body = encode_results(&results);
        assert_eq!(body[0], 0);
        assert_eq!(&body[1..5], &16u32.to_be_bytes());
        assert_eq!(decode_results(&body), Ok(results));
    }

    #[test]
    fn an_empty_body_is_zero_lookups() {
        assert_eq!(decode_lookups(b""), Ok(Vec::new()));
        assert_eq!(encode_lookups::<&[u8]>(&[]), Vec::<u8>::new());
        assert_eq!(decode_results(b""), Ok(Vec::new()));
    }

    #[test]
    fn a_truncated_frame_is_refused_naming_its_offset() {
        let mut body = encode_lookups(&[b"ab"]);
        // A second frame whose length is cut after two bytes.
        body.extend_from_slice(&[0, 0]);
        assert_eq!(
            decode_lookups(&body),
            Err(FrameError::Truncated {
                offset: 6,
                left: 2,
                need: 4
            })
        );
        // A length past the body's end: 9 declared, 3 there.
        let mut body = encode_lookups(&[b"ab"]);
        body.extend_from_slice(&9u32.to_be_bytes());
        body.extend_from_slice(b"xyz");
        let e = decode_lookups(&body).expect_err("past the end");
        assert_eq!(
            e,
            FrameError::PastEnd {
                offset: 6,
                length: 9,
                left: 3
            }
        );
        assert!(e.to_string().starts_with("frame at byte 6:"), "{e}");
        // The largest length there is: refused, nothing allocated for it.
        assert!(matches!(
            decode_lookups(&u32::MAX.to_be_bytes()),
            Err(FrameError::PastEnd { offset: 0, .. })
        ));
        // A result cut inside its header, or with an outcome no one defined.
        assert!(matches!(
            decode_results(&[0, 0, 0]),
            Err(FrameError::Truncated {
                offset: 0,
                need: 5,
                ..
            })
        ));
        assert_eq!(
            decode_results(&[9, 0, 0, 0, 0]),
            Err(FrameError::Outcome { offset: 0, byte: 9 })
        );
    }

    #[test]
    fn more_lookups_than_the_limit_are_refused_at_the_first_past_it() {
        let at_limit = vec![b"k".to_vec(); MAX_LOOKUPS];
        let body = encode_lookups(&at_limit);
        assert_eq!(decode_lookups(&body).map(|l| l.len()), Ok(MAX_LOOKUPS));
        let over = encode_lookups(&vec![b"k".to_vec(); MAX_LOOKUPS + 1]);
        assert_eq!(
            decode_lookups(&over),
            Err(FrameError::TooMany {
                offset: MAX_LOOKUPS * 5,
                max: MAX_LOOKUPS
            })
        );
    }

    #[test]
    fn an_answer_a_guest_error_and_a_lost_instance_each_have_their_outcome() {
        use foldhost_fold::applied::ApplyError;
        let error = ApplyError {
            applier: "kvstore@0.1.0".into(),
            call: "query",
            message: "missing".into(),
        };
        let results = vec![
            Ok(b"v".to_vec()),
            Err(error.clone()),
            Err(ApplyError::rebuilding("kvstore@0.1.0".into(), "a trap")),
        ];
        let decoded = decode_results(&encode_looked(&results)).expect("framed");
        assert_eq!(decoded[0], (Outcome::Answer, b"v".to_vec()));
        assert_eq!(
            decoded[1],
            (Outcome::GuestError, error.to_string().into_bytes())
        );
        assert_eq!(decoded[2].0, Outcome::NotAnswered);
    }

    #[test]
    fn only_the_lookups_media_type_names_a_batch() {
        assert!(is_lookups("application/x-foldhost-lookups"));
        assert!(is_lookups("Application/X-Foldhost-Lookups; charset=binary"));
        assert!(!is_lookups("application/octet-stream"));
        assert!(!is_lookups("application/x-foldhost-lookupsx"));
    }
}
