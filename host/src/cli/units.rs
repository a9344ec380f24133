//! Durations and sizes as people write them, for flags: `30s`, `5m`, `1h30m` (`humantime`),
//! `64MiB`, `1.5GB` (`bytesize`). A bare number keeps the unit the flag names (`--defer-grace-secs
//! 1800` is 1 800 seconds, `--guest-deadline-ms 250` 250 milliseconds), so every value that
//! parsed before parses to the same thing. Each parser answers in the flag's own unit and refuses
//! a value it would have to round (`--batch-window-ms 1.5ms`) rather than guess.

use std::time::Duration;

/// A duration: a bare number of `unit`s, or a `humantime` duration.
fn duration(s: &str, unit: Duration) -> Result<Duration, String> {
    let s = s.trim();
    if let Ok(n) = s.parse::<u64>() {
        return n
            .checked_mul(unit.as_nanos() as u64)
            .map(Duration::from_nanos)
            .ok_or_else(|| format!("{s}: too long"));
    }
    humantime::parse_duration(s)
        .map_err(|e| format!("{s:?}: not a duration ({e}); write 30s, 5m, 1h, or a bare number"))
}

/// A flag in whole seconds (a bare number is seconds).
pub(crate) fn secs(s: &str) -> Result<u64, String> {
    let d = duration(s, Duration::from_secs(1))?;
    if d.subsec_nanos() != 0 {
        return Err(format!("{s:?}: this flag takes whole seconds"));
    }
    Ok(d.as_secs())
}

/// [`secs`] within `LO..=HI` seconds.
pub(crate) fn secs_within<const LO: u64, const HI: u64>(s: &str) -> Result<u64, String> {
    let v = secs(s)?;
    if !(LO..=HI).contains(&v) {
        return Err(format!("{s:?}: between {LO} and {HI} seconds"));
    }
    Ok(v)
}

/// A flag in whole milliseconds (a bare number is milliseconds).
pub(crate) fn millis(s: &str) -> Result<u64, String> {
    let d = duration(s, Duration::from_millis(1))?;
    if d.subsec_nanos() % 1_000_000 != 0 {
        return Err(format!("{s:?}: this flag takes whole milliseconds"));
    }
    u64::try_from(d.as_millis()).map_err(|_| format!("{s:?}: too long"))
}

/// A size in bytes: a bare number of bytes, or `64MiB`, `512KB`, `1.5GiB`.
pub(crate) fn bytes(s: &str) -> Result<u64, String> {
    s.trim()
        .parse::<bytesize::ByteSize>()
        .map(|b| b.as_u64())
        .map_err(|e| {
            format!("{s:?}: not a size ({e}); write 64MiB, 512KB, or a bare number of bytes")
        })
}

/// [`bytes`] for a `usize` flag.
pub(crate) fn bytes_usize(s: &str) -> Result<usize, String> {
    usize::try_from(bytes(s)?).map_err(|_| format!("{s:?}: too large"))
}

/// A size in whole MiB (a bare number is MiB; `1GiB` is 1 024).
pub(crate) fn mebibytes(s: &str) -> Result<usize, String> {
    let t = s.trim();
    if let Ok(n) = t.parse::<usize>() {
        return Ok(n);
    }
    let b = bytes(t)?;
    if b % (1 << 20) != 0 {
        return Err(format!("{s:?}: this flag takes whole MiB"));
    }
    usize::try_from(b >> 20).map_err(|_| format!("{s:?}: too large"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bare_number_keeps_the_flags_unit_and_a_written_unit_is_converted() {
        assert_eq!(secs("1800"), Ok(1800));
        assert_eq!(secs("30m"), Ok(1800));
        assert_eq!(secs("1h 30m"), Ok(5400));
        assert_eq!(millis("250"), Ok(250));
        assert_eq!(millis("2s"), Ok(2000));
        assert_eq!(millis("1500ms"), Ok(1500));
        assert_eq!(bytes("1048576"), Ok(1 << 20));
        assert_eq!(bytes("64MiB"), Ok(64 << 20));
        assert_eq!(bytes("256 KiB"), Ok(256 << 10));
        assert_eq!(bytes("1MB"), Ok(1_000_000));
        assert_eq!(mebibytes("256"), Ok(256));
        assert_eq!(mebibytes("1GiB"), Ok(1024));
        assert_eq!(secs_within::<1, 60>("5s"), Ok(5));
    }

    #[test]
    fn a_value_that_would_round_or_is_out_of_range_or_unreadable_is_refused_naming_it() {
        for bad in [
            secs("1500ms"),
            secs("ten"),
            secs_within::<1, 60>("2m"),
            secs("-1"),
        ] {
            let e = bad.expect_err("refused");
            assert!(e.contains('"') || e.contains("seconds"), "{e}");
        }
        assert!(millis("1.5ms").is_err());
        assert!(bytes("64 parsecs").is_err());
        assert!(mebibytes("1536KiB").is_err());
        assert!(secs_within::<1, 3600>("0").is_err());
    }
}
