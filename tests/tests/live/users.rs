//! Servers whose users hold given permissions, and what their log says of violations: shared by
//! the suites that load `foldhost grants` into a real nats-server.

use std::path::Path;

use foldhost_localnats::LocalNats;

/// A server whose users are `admin` (everything) and each `(name, permissions block)`, logging
/// to `log`.
pub(crate) fn server(log: &Path, users: &[(&str, String)]) -> anyhow::Result<LocalNats> {
    let mut conf = format!(
        "log_file: {:?}\nauthorization {{\n  users = [\n    {{ user: admin, password: admin }}\n",
        log.display().to_string()
    );
    for (name, block) in users {
        conf.push_str(&format!(
            "    {{ user: {name}, password: {name}\n{block}\n    }}\n"
        ));
    }
    conf.push_str("  ]\n}\n");
    Ok(LocalNats::start_with_config(&conf)?)
}

/// The URL of `server` as `user` (whose password is its name).
pub(crate) fn url_as(server: &LocalNats, user: &str) -> String {
    format!("nats://{user}:{user}@127.0.0.1:{}", server.port())
}

/// Server log lines that report a permission violation by `user` (the server names the
/// account and user on each: `"$G/user:NAME" - Publish Violation - Subject "…"`).
pub(crate) fn violations(log: &Path, user: &str) -> Vec<String> {
    let by = format!("/user:{user}\"");
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("Violation") && l.contains(&by))
        .map(str::to_string)
        .collect()
}
