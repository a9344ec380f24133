//! The listener's admission: reply subjects, query access, Host names.

/// Whether the host may publish a query's answer to `reply`: only to subjects under `prefix`
/// (an inbox, `_INBOX.` by default). Without this, a requester could name any subject — a
/// `$KV.<bucket>.<key>` or a `$JS.API` call — and have the host publish the answer there with its
/// own credentials.
pub fn reply_subject_allowed(reply: &str, prefix: &str) -> bool {
    !prefix.is_empty()
        && reply.len() > prefix.len()
        && reply.starts_with(prefix)
        && !reply.contains([' ', '\t', '\r', '\n', '*', '>'])
}

/// How a `--listen` endpoint opens `/status` and `/query` (the admin token opens them in every
/// case; [`query_access`] decides).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueryAccess {
    /// With the query token the operator gave (a file, or an embedder's string).
    GivenToken,
    /// With a token the host generates into a private file: a listener reachable from beyond
    /// this machine, given no token and no `--query-open`.
    GeneratedToken,
    /// To whoever reaches the listener: a loopback listener given no token.
    Open,
    /// To whoever reaches a listener beyond loopback, because the operator said so
    /// (`--query-open`); the host says the risk when it starts.
    OpenByChoice,
}

/// How `/status` and `/query` of a listener bound to an address that is (`loopback`) or is not a
/// loopback one are opened, given whether a query token was given and `--query-open` asked. A
/// listener beyond loopback (a wildcard `0.0.0.0` / `::` one included: it answers through
/// 127.0.0.1 too, where a DNS-rebound web page reaches it) never answers a query from anyone who
/// can reach it unless the operator chose that: without a token it gets a generated one. A
/// loopback listener stays open without a token, as only this machine reaches it and its `Host`
/// check keeps rebound pages out. A token and `--query-open` together are a contradiction,
/// refused rather than one of them silently ignored.
pub fn query_access(
    loopback: bool,
    token_given: bool,
    query_open: bool,
) -> Result<QueryAccess, &'static str> {
    match (token_given, query_open, loopback) {
        (true, true, _) => Err("--query-open and a query token exclude each other: give one"),
        (true, false, _) => Ok(QueryAccess::GivenToken),
        (false, _, true) => Ok(QueryAccess::Open),
        (false, true, false) => Ok(QueryAccess::OpenByChoice),
        (false, false, false) => Ok(QueryAccess::GeneratedToken),
    }
}

/// A `Host` header value (or a `--listen-host` name) split into its host and its port, if it
/// has one: `name`, `name:port`, `1.2.3.4:port`, `[::1]:port`. `None` for anything else: empty,
/// a bare IPv6 address, a bad port, or characters no host name has (space, `/`, `@`, …).
pub fn split_host_port(value: &str) -> Option<(&str, Option<u16>)> {
    let bad = |c: char| c.is_whitespace() || c.is_control() || "/\\@?#,;\"'<>".contains(c);
    if value.is_empty() || value.contains(bad) {
        return None;
    }
    let (host, port) = if value.starts_with('[') {
        let close = value.find(']')?;
        let (host, rest) = value.split_at(close + 1);
        match rest {
            "" => (host, None),
            _ => (host, Some(rest.strip_prefix(':')?)),
        }
    } else {
        match value.split_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (value, None),
        }
    };
    if host.is_empty() || host == "[]" || (!host.starts_with('[') && host.contains([':', '[', ']']))
    {
        return None;
    }
    let port = match port {
        Some(p) if !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) => Some(p.parse().ok()?),
        Some(_) => return None,
        None => None,
    };
    Some((host, port))
}

/// The IP address a `Host`'s host part spells literally (`10.0.0.5`, `[::1]`), if it is one.
fn host_ip_literal(host: &str) -> Option<std::net::IpAddr> {
    match host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        Some(v6) => v6
            .parse::<std::net::Ipv6Addr>()
            .ok()
            .map(std::net::IpAddr::V6),
        None => host
            .parse::<std::net::Ipv4Addr>()
            .ok()
            .map(std::net::IpAddr::V4),
    }
}

/// Whether a request's `Host` names this listener, so that it was addressed to the host and not
/// to a name a DNS-rebinding page made point here. `listen` is the bound address, `arrived_on`
/// the local address the connection came in on (on a wildcard listener, one of the machine's
/// concrete addresses), `names` the `--listen-host` names (with a port: that port exactly;
/// without: no port or the listener's). Besides those names:
/// - a loopback listener is named by `localhost`, `127.0.0.1`, `[::1]` or its own address, with
///   its port;
/// - a wildcard listener (`0.0.0.0`, `::`) by the IP literal of the address the connection
///   arrived on (and `localhost`, or the wildcard address itself, when that is loopback), with
///   its port: an IP literal cannot be rebound, and no other name is known to be the host's;
/// - any other listener by its own address.
///
/// A missing `Host`, a `Host` without a port (port 80) on another port, or any other name is
/// refused.
pub fn host_names_listener(
    host: Option<&str>,
    listen: std::net::SocketAddr,
    arrived_on: std::net::SocketAddr,
    names: &[String],
) -> bool {
    let Some((h, p)) = host.and_then(split_host_port) else {
        return false;
    };
    let port = p.unwrap_or(80);
    let named = names
        .iter()
        .filter_map(|n| split_host_port(n))
        .any(|(nh, np)| {
            nh.eq_ignore_ascii_case(h)
                && match np {
                    Some(np) => np == port,
                    None => p.is_none() || port == listen.port(),
                }
        });
    if named {
        return true;
    }
    if port != listen.port() {
        return false;
    }
    let ip = host_ip_literal(h).map(|ip| ip.to_canonical());
    let loopback_name = |on: std::net::IpAddr| {
        on.to_canonical().is_loopback()
            && (h.eq_ignore_ascii_case("localhost") || ip.is_some_and(|ip| ip.is_loopback()))
    };
    if listen.ip().is_unspecified() {
        ip == Some(arrived_on.ip().to_canonical())
            || loopback_name(arrived_on.ip())
            // `0.0.0.0:P` as the address, which this machine's clients reach through loopback.
            || (ip == Some(listen.ip().to_canonical()) && arrived_on.ip().to_canonical().is_loopback())
    } else {
        ip == Some(listen.ip().to_canonical()) || loopback_name(listen.ip())
    }
}

/// A fold's figures as readiness judges them ([`fold_unready`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Readiness<'a> {
    /// `running`, `stopped`, `failed`.
    pub state: &'a str,
    /// Whether the fold has been level with its stream since the host started.
    pub caught_up: bool,
    /// Everything at or below it is applied and committed.
    pub applied_through: u64,
    /// Highest revision delivered.
    pub seq: u64,
    /// The stream's last sequence as last read (`None`: not read yet).
    pub stream_last: Option<u64>,
}

/// Why a fold is not ready to answer (`GET /readyz`), or `None` when it is: it runs, has been
/// level with its stream since the host started, and is at most `max_lag` records behind — behind
/// the stream's last sequence or what it was delivered, whichever is further (a deferred record
/// holds `applied_through` back, so a fold held behind is not ready). Pure.
pub fn fold_unready(f: Readiness<'_>, max_lag: u64) -> Option<String> {
    if f.state != "running" {
        return Some(format!("it is {}", f.state));
    }
    if !f.caught_up {
        return Some(format!(
            "catching up: applied through {} of {}",
            f.applied_through,
            f.stream_last.unwrap_or(f.seq).max(f.seq)
        ));
    }
    let head = f.stream_last.unwrap_or(0).max(f.seq);
    let behind = head.saturating_sub(f.applied_through);
    (behind > max_lag).then(|| {
        format!(
            "applied through {}, {behind} records behind {head} (the limit is {max_lag})",
            f.applied_through
        )
    })
}
