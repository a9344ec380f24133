//! `hashring`: weighted rendezvous (highest-random-weight) hashing over a set of nodes.
//!
//! Keys `node.<id>` hold the node's weight as an ASCII decimal `u32` greater than 0 (digits only;
//! `0`, an empty value or anything else takes the node out of the ring). A query's request is a key (its bytes); the
//! answer is `{"node":"<id>"}` naming the node that owns it, or the error `no nodes`.
//!
//! Each node scores a key `-weight / ln(u)`, with `u` in (0, 1) drawn from a fixed 64-bit hash of
//! (node id, key); the highest score owns the key (ties: the smallest id). A key's owner depends only
//! on the nodes present, so removing a node moves only the keys it owned, and a node's share of the
//! keys is proportional to its weight.

use std::collections::BTreeMap;

use foldhost_guest::{Change, Folder, Manifest, Verdict};

const PREFIX: &str = "node.";

/// The ring: node id → weight.
#[derive(Default)]
struct HashRing {
    nodes: BTreeMap<String, u32>,
}

impl Folder for HashRing {
    /// The weight, or `None` for a value that is not one (the node leaves the ring then).
    type Value = Option<u32>;

    fn manifest() -> Manifest {
        Manifest::new("hashring", "0.1.0", [PREFIX])
    }

    fn parse(&self, key: &str, value: &[u8]) -> Verdict<Option<u32>> {
        let id = key.strip_prefix(PREFIX).unwrap_or_default();
        if id.is_empty() {
            return Verdict::Skip;
        }
        match parse_weight(value) {
            Some(weight) => Verdict::Accept(Some(weight)),
            // The key's current value is the truth: not a weight means not in the ring, exactly as
            // a ring rebuilt from the fold would have it.
            None => Verdict::Accept(None),
        }
    }

    fn apply(&mut self, changes: Vec<Change<Option<u32>>>) -> Result<(), String> {
        for change in changes {
            match change {
                Change::Put { key, value, .. } => {
                    if let Some(id) = key.strip_prefix(PREFIX) {
                        match value {
                            Some(weight) => self.nodes.insert(id.to_owned(), weight),
                            None => self.nodes.remove(id),
                        };
                    }
                }
                Change::Delete { key, .. } => {
                    if let Some(id) = key.strip_prefix(PREFIX) {
                        self.nodes.remove(id);
                    }
                }
            }
        }
        Ok(())
    }

    fn query(&self, request: &[u8]) -> Result<Vec<u8>, String> {
        let node = owner(&self.nodes, request).ok_or("no nodes")?;
        Ok(format!("{{\"node\":{}}}", json_string(node)).into_bytes())
    }
}

foldhost_guest::export_folder!(HashRing);

/// A weight: ASCII digits only, a `u32`, greater than 0.
fn parse_weight(value: &[u8]) -> Option<u32> {
    if value.is_empty() || !value.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let weight: u32 = std::str::from_utf8(value).ok()?.parse().ok()?;
    (weight > 0).then_some(weight)
}

/// The node that owns `key`: the highest score, the smallest id on a tie; `None` without nodes.
fn owner<'a>(nodes: &'a BTreeMap<String, u32>, key: &[u8]) -> Option<&'a str> {
    let mut best: Option<(&str, f64)> = None;
    for (id, &weight) in nodes {
        let s = score(weight, hash(id, key));
        if best.is_none_or(|(_, top)| s > top) {
            best = Some((id, s));
        }
    }
    best.map(|(id, _)| id)
}

/// `-weight / ln(u)` with `u` in (0, 1) taken from the hash's top 52 bits: always finite and > 0.
fn score(weight: u32, hash: u64) -> f64 {
    // (0.5 ..= 2^52 - 0.5) / 2^52: both ends exact in f64, so u is never 0 nor 1.
    let u = ((hash >> 12) as f64 + 0.5) / (1u64 << 52) as f64;
    -f64::from(weight) / u.ln()
}

/// A fixed 64-bit hash of (node id, key): FNV-1a over `id`, a 0xff separator (never in UTF-8, so
/// the pair is unambiguous) and `key`, then the SplitMix64 finalizer to spread FNV's high bits.
fn hash(id: &str, key: &[u8]) -> u64 {
    const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut h = FNV_OFFSET;
    for &byte in id.as_bytes().iter().chain(&[0xff]).chain(key) {
        h ^= u64::from(byte);
        h = h.wrapping_mul(FNV_PRIME);
    }
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

/// `s` as a JSON string literal.
fn json_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if u32::from(c) < 0x20 => out.push_str(&format!("\\u{:04x}", u32::from(c))),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ring(nodes: &[(&str, u32)]) -> BTreeMap<String, u32> {
        nodes.iter().map(|&(id, w)| (id.to_owned(), w)).collect()
    }

    fn keys() -> impl Iterator<Item = String> {
        (0..4000).map(|i| format!("key-{i}"))
    }

    #[test]
    fn weights() {
        assert_eq!(parse_weight(b"1"), Some(1));
        assert_eq!(parse_weight(b"4294967295"), Some(u32::MAX));
        for bad in [
            &b""[..],
            b"0",
            b"00",
            b"-1",
            b"+1",
            b" 1",
            b"1\n",
            b"x",
            b"4294967296",
        ] {
            assert_eq!(parse_weight(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn scores_are_finite_and_positive() {
        for h in [0, 1, u64::MAX, u64::MAX >> 1, 1 << 63] {
            for w in [1, 7, u32::MAX] {
                let s = score(w, h);
                assert!(s.is_finite() && s > 0.0, "{w} {h} {s}");
            }
        }
    }

    #[test]
    fn no_nodes() {
        assert_eq!(owner(&BTreeMap::new(), b"k"), None);
        let r = HashRing::default();
        assert_eq!(r.query(b"k"), Err("no nodes".to_string()));
    }

    #[test]
    fn removing_a_node_moves_only_its_keys() {
        let all = ring(&[("a", 1), ("b", 2), ("c", 3), ("d", 1)]);
        let mut less = all.clone();
        less.remove("c");
        let mut moved = 0;
        for k in keys() {
            let before = owner(&all, k.as_bytes());
            let after = owner(&less, k.as_bytes());
            if before == Some("c") {
                moved += 1;
                assert_ne!(after, Some("c"));
            } else {
                assert_eq!(before, after, "{k}");
            }
        }
        assert!(moved > 0);
    }

    #[test]
    fn shares_follow_weights() {
        let r = ring(&[("a", 1), ("b", 3)]);
        let b = keys()
            .filter(|k| owner(&r, k.as_bytes()) == Some("b"))
            .count();
        let share = b as f64 / 4000.0;
        assert!((0.71..0.79).contains(&share), "{share}");
    }

    #[test]
    fn fold_and_query() {
        let mut r = HashRing::default();
        assert_eq!(r.parse("node.a", b"2"), Verdict::Accept(Some(2)));
        assert_eq!(r.parse("node.", b"2"), Verdict::Skip);
        assert_eq!(r.parse("node.a", b"0"), Verdict::Accept(None));
        let put = |id: &str, w| Change::Put {
            key: format!("node.{id}"),
            revision: 1,
            value: Some(w),
        };
        r.apply(vec![put("a", 1), put("b\"q", 1)]).expect("apply");
        let answers: Vec<_> = keys()
            .take(50)
            .map(|k| r.query(k.as_bytes()).expect("query"))
            .collect();
        assert!(answers.contains(&br#"{"node":"a"}"#.to_vec()));
        assert!(answers.contains(&br#"{"node":"b\"q"}"#.to_vec()));
        r.apply(vec![Change::Delete {
            key: "node.b\"q".into(),
            revision: 2,
        }])
        .expect("apply");
        assert_eq!(r.query(b"anything"), Ok(br#"{"node":"a"}"#.to_vec()));
    }

    #[test]
    fn json_escapes() {
        assert_eq!(json_string("a\"b\\c\n"), r#""a\"b\\c\u000a""#);
    }
}
