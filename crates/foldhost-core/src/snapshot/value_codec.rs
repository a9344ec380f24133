//! The value-record codec the LSM backends share: what a data key maps to on disk.
//!
//! ```text
//! [ver_len: u8][version bytes: ver_len ≤ 10][value bytes: the rest]
//! ```
//!
//! Invariants:
//! - **Pure.** No I/O, no allocation on decode (the value is a sub-slice of the input).
//! - **Total decode.** [`decode`] returns an error, never panics, on any input: an empty record, a
//!   `ver_len` above [`VersionToken::MAX_LEN`], or a record shorter than its declared version.
//! - **Exact round trip.** A version keeps its length (0 for [`VersionToken::UNKNOWN`], 8 for a NATS
//!   revision, 10 for an FDB versionstamp) and its bytes; the value is kept byte for byte, empty
//!   included.

use crate::kv::VersionToken;

/// Why a stored value record could not be decoded (the caller names the store and key).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum ValueRecordError {
    /// Zero bytes: not even the version length.
    #[error("empty value record (no version length byte)")]
    Empty,
    /// The version length byte exceeds the longest version any backend produces.
    #[error("version length {0} exceeds the maximum of {max}", max = VersionToken::MAX_LEN)]
    VersionTooLong(u8),
    /// The record ends inside the version bytes.
    #[error("value record of {len} byte(s) is shorter than its {ver_len}-byte version")]
    Truncated {
        /// Declared version length.
        ver_len: u8,
        /// Bytes present in the record.
        len: usize,
    },
}

/// Encoded size of a record holding `value_len` bytes under `version`.
pub(crate) fn encoded_len(version: &VersionToken, value_len: usize) -> usize {
    1 + version.as_bytes().len() + value_len
}

/// Appends the record for (`version`, `value`) to `out`.
pub(crate) fn encode_into(out: &mut Vec<u8>, version: &VersionToken, value: &[u8]) {
    let ver = version.as_bytes();
    out.reserve(1 + ver.len() + value.len());
    // A VersionToken is at most MAX_LEN (10) bytes, so the length always fits in one byte.
    out.push(ver.len() as u8);
    out.extend_from_slice(ver);
    out.extend_from_slice(value);
}

/// The record for (`version`, `value`) as a fresh buffer.
pub(crate) fn encode(version: &VersionToken, value: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(encoded_len(version, value.len()));
    encode_into(&mut out, version, value);
    out
}

/// Splits a stored record into its version and value (a sub-slice of `record`). Bounds-checked:
/// any malformed input is an error.
pub(crate) fn decode(record: &[u8]) -> Result<(VersionToken, &[u8]), ValueRecordError> {
    let (&ver_len, rest) = record.split_first().ok_or(ValueRecordError::Empty)?;
    if usize::from(ver_len) > VersionToken::MAX_LEN {
        return Err(ValueRecordError::VersionTooLong(ver_len));
    }
    if rest.len() < usize::from(ver_len) {
        return Err(ValueRecordError::Truncated {
            ver_len,
            len: record.len(),
        });
    }
    let (ver, value) = rest.split_at(usize::from(ver_len));
    let version = VersionToken::from_bytes(ver).ok_or(ValueRecordError::VersionTooLong(ver_len))?;
    Ok((version, value))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn versions() -> Vec<VersionToken> {
        vec![
            VersionToken::UNKNOWN,
            VersionToken::from_u64(0),
            VersionToken::from_u64(u64::MAX),
            VersionToken::from_bytes(&[1]).expect("fits"),
            VersionToken::from_bytes(&[0xff; 10]).expect("fits"),
            VersionToken::from_bytes(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]).expect("fits"),
        ]
    }

    fn values() -> Vec<Vec<u8>> {
        vec![
            Vec::new(),
            vec![0],
            b"hello".to_vec(),
            vec![0xff; 300],
            (0..=255u8).collect(),
        ]
    }

    #[test]
    fn every_version_length_and_value_round_trips_exactly() {
        for version in versions() {
            for value in values() {
                let rec = encode(&version, &value);
                assert_eq!(rec.len(), encoded_len(&version, value.len()));
                let (v, val) = decode(&rec).expect("decodes");
                assert_eq!(v.as_bytes(), version.as_bytes(), "{version:?}");
                assert_eq!(v, version);
                assert_eq!(val, value.as_slice());
            }
        }
    }

    #[test]
    fn encode_into_appends_without_touching_what_is_there() {
        let mut out = b"prefix".to_vec();
        encode_into(&mut out, &VersionToken::from_u64(7), b"v");
        assert_eq!(&out[..6], b"prefix");
        let (v, val) = decode(&out[6..]).expect("decodes");
        assert_eq!(v.as_u64(), Some(7));
        assert_eq!(val, b"v");
    }

    #[test]
    fn every_truncation_either_decodes_a_shorter_value_or_errors_never_panics() {
        for version in versions() {
            let rec = encode(&version, b"value bytes");
            let ver_len = version.as_bytes().len();
            for cut in 0..rec.len() {
                let res = decode(&rec[..cut]);
                if cut == 0 {
                    assert_eq!(res, Err(ValueRecordError::Empty));
                } else if cut < 1 + ver_len {
                    assert_eq!(
                        res,
                        Err(ValueRecordError::Truncated {
                            ver_len: ver_len as u8,
                            len: cut
                        })
                    );
                } else {
                    // A cut inside the value is indistinguishable from a shorter value: the
                    // engine's own checksums, not this codec, catch torn values.
                    let (v, val) = res.expect("version intact");
                    assert_eq!(v, version);
                    assert_eq!(val, &b"value bytes"[..cut - 1 - ver_len]);
                }
            }
        }
    }

    #[test]
    fn a_version_length_above_ten_is_an_error() {
        for ver_len in 11..=255u8 {
            let mut rec = vec![ver_len];
            rec.extend(std::iter::repeat_n(0u8, 300));
            assert_eq!(decode(&rec), Err(ValueRecordError::VersionTooLong(ver_len)));
        }
    }

    #[test]
    fn arbitrary_short_inputs_never_panic() {
        // Every input of up to 2 bytes, and a spread of 3..12-byte inputs.
        for a in 0..=255u8 {
            let _ = decode(&[a]);
            for b in 0..=255u8 {
                let _ = decode(&[a, b]);
            }
        }
        let mut x: u32 = 0x9e37_79b9;
        for len in 3..12 {
            for _ in 0..2000 {
                let rec: Vec<u8> = (0..len)
                    .map(|_| {
                        x ^= x << 13;
                        x ^= x >> 17;
                        x ^= x << 5;
                        (x % 16) as u8
                    })
                    .collect();
                if let Ok((v, val)) = decode(&rec) {
                    assert_eq!(1 + v.as_bytes().len() + val.len(), rec.len());
                }
            }
        }
    }
}
