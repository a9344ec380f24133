//! `--config FILE` and `foldhost config check FILE`: folds from one TOML file (docs/operations.md, "Several
//! folds from one file").
//!
//! Invariants:
//! - **One set of keys, the flags'.** A key is a `run` flag's long name with `_` for `-`
//!   (`defer_grace_secs`, `backend`, `tls_ca`); each fold is parsed by the very parser of `run`'s
//!   flags, so a value means in the file what it means on the command line (units included).
//!   Keys at the top are every fold's default; a fold's own key wins; flags given beside
//!   `--config` win over both (a file of one fold only).
//! - **Nothing unknown passes.** A key no flag has, a value of the wrong kind, a fold without its
//!   `bucket` or `store`, two folds sharing a name, a store or a listen address: each is refused
//!   in one line naming the file, the line and the key, before anything connects or opens.
//! - **Secrets stay out.** The file names secret files (`password_file`, `admin_token_file`, …),
//!   never holds a secret the output shows: `config check` prints every effective value with
//!   tokens and a URL's credentials redacted.

use std::collections::BTreeMap;

use clap::{CommandFactory, FromArgMatches};

use super::*;

/// `foldhost config`.
#[derive(Subcommand, Debug)]
pub enum ConfigCommand {
    /// Validate a config file without connecting and print every fold's effective configuration
    /// (secrets redacted).
    Check(ConfigCheckArgs),
}

/// `foldhost config check`.
#[derive(Args, Debug)]
pub struct ConfigCheckArgs {
    /// The config file.
    pub file: PathBuf,
}

/// `run`'s flags alone, as the file's folds are parsed (a later value of a flag replaces an
/// earlier one: the file's top, then the fold, then the command line).
#[derive(clap::Parser, Debug)]
#[command(name = "run", args_override_self = true, disable_help_flag = true)]
struct RunCli {
    #[command(flatten)]
    args: RunArgs,
}

/// Keys the file may hold beside the flags'.
const FOLDS: &str = "folds";
/// Process-wide keys that are not `run` flags.
const PROCESS_KEYS: [&str; 1] = ["log_format"];
/// Keys a fold must give itself (never a default for every fold).
const FOLD_ONLY: [&str; 3] = ["name", "bucket", "store"];
/// Keys whose values `config check` never prints.
const SECRET_KEYS: [&str; 4] = ["admin_token", "write_token", "query_token", "guest_seed"];
/// The listener's keys: with a top-level `listen`, one listener admits every fold with one set of
/// tokens, names and limits, so a fold table may not set them (the top level sets them for every
/// fold); a fold's own would silently give way to the first fold's.
const SHARED_LISTENER_KEYS: [&str; 8] = [
    "admin_token",
    "admin_token_file",
    "write_token",
    "write_token_file",
    "query_token_file",
    "query_open",
    "listen_host",
    "query_max_bytes",
];

/// One fold of the file: its name and `run`'s arguments for it.
#[derive(Debug, Clone)]
pub(crate) struct Fold {
    /// Its name (`name`, else its bucket).
    pub name: String,
    /// `run --key value …`, the file's top then the fold's own keys.
    pub argv: Vec<String>,
    /// Where each of its keys is (line numbers, 1-based), for messages.
    lines: BTreeMap<String, usize>,
}

/// The long names of `run`'s flags, as file keys.
fn flag_keys() -> BTreeMap<String, clap::Id> {
    RunCli::command()
        .get_arguments()
        .filter_map(|a| {
            a.get_long()
                .map(|l| (l.replace('-', "_"), a.get_id().clone()))
        })
        .filter(|(k, _)| k != "config")
        .collect()
}

/// The 1-based line of `key` in section `section` of `text` (`None`: the top, before the first
/// `[[folds]]`; `Some(i)`: the i-th `[[folds]]`). Plain `key = …` lines only; 0 when not found.
fn key_line(text: &str, section: Option<usize>, key: &str) -> usize {
    let mut at: Option<usize> = None;
    let mut in_table = false;
    for (n, line) in text.lines().enumerate() {
        let t = line.trim();
        if t == "[[folds]]" {
            at = Some(at.map_or(0, |i| i + 1));
            in_table = false;
            continue;
        }
        if t.starts_with('[') {
            in_table = true;
            continue;
        }
        if at == section && !in_table {
            let k = t.split('=').next().unwrap_or("").trim().trim_matches('"');
            if k == key && t.contains('=') {
                return n + 1;
            }
        }
    }
    0
}

/// `--key value` arguments for one key's TOML value.
fn key_args(key: &str, value: &toml::Value, out: &mut Vec<String>) -> Result<(), String> {
    let flag = format!("--{}", key.replace('_', "-"));
    match value {
        toml::Value::String(s) => out.extend([flag, s.clone()]),
        toml::Value::Integer(i) => out.extend([flag, i.to_string()]),
        toml::Value::Float(f) => out.extend([flag, f.to_string()]),
        toml::Value::Boolean(true) => out.push(flag),
        toml::Value::Boolean(false) => {}
        toml::Value::Array(items) => {
            for item in items {
                if matches!(item, toml::Value::Array(_) | toml::Value::Table(_)) {
                    return Err("a list of strings, numbers or booleans".into());
                }
                key_args(key, item, out)?;
            }
        }
        // `guest_config = { region = "eu" }`: one `--guest-config K=V` per entry.
        toml::Value::Table(t) if key == "guest_config" => {
            for (k, v) in t {
                let toml::Value::String(v) = v else {
                    return Err(format!("guest_config.{k}: a string"));
                };
                out.extend([flag.clone(), format!("{k}={v}")]);
            }
        }
        toml::Value::Table(_) | toml::Value::Datetime(_) => {
            return Err("a string, a number, a boolean or a list of them".into());
        }
    }
    Ok(())
}

/// What a config file says.
#[derive(Debug)]
pub(crate) struct Loaded {
    /// Its folds.
    pub folds: Vec<Fold>,
    /// `log_format`, when it says.
    pub log_format: Option<LogFormat>,
    /// A top-level `listen`: one address serving every fold under `/folds/NAME/…`.
    pub listen: Option<String>,
}

/// Reads `path`: the folds it describes, each checked for unknown keys and for its `bucket` and
/// `store`, their names, stores and listen addresses distinct; its `log_format`; its process-wide
/// `listen`.
pub(crate) fn load(path: &Path) -> anyhow::Result<Loaded> {
    let file = path.display().to_string();
    let text = std::fs::read_to_string(path).with_context(|| file.clone())?;
    let doc: toml::Table = text.parse().map_err(|e: toml::de::Error| {
        let line = e.span().map_or(0, |s| {
            text[..s.start.min(text.len())].lines().count().max(1)
        });
        anyhow!("{file}:{line}: {}", e.message())
    })?;
    let keys = flag_keys();
    let (top, folds_value) = read_top(&file, &text, &doc, &keys)?;
    let Some(folds_value) = folds_value else {
        bail!("{file}: no [[folds]]: the file describes no fold");
    };
    let Some(tables) = folds_value.as_array() else {
        bail!("{file}: `folds` is a list of [[folds]] tables");
    };
    let mut folds = Vec::with_capacity(tables.len());
    for (i, t) in tables.iter().enumerate() {
        folds.push(read_fold(&file, &text, &keys, &top, i, t)?);
    }
    check_distinct(&file, &folds, &doc)?;
    check_claims(&file, &folds)?;
    Ok(Loaded {
        folds,
        log_format: top.log_format,
        listen: top.listen,
    })
}

/// The file's top level: the flags every fold takes (as `run` arguments, with their lines),
/// `log_format`, and the process-wide `listen`.
struct Top {
    argv: Vec<String>,
    lines: BTreeMap<String, usize>,
    log_format: Option<LogFormat>,
    listen: Option<String>,
}

/// Reads the file's top-level keys, and its `folds` value if any: a key that belongs in a fold,
/// or no flag of `run`, is refused.
fn read_top<'a>(
    file: &str,
    text: &str,
    doc: &'a toml::Table,
    keys: &BTreeMap<String, clap::Id>,
) -> anyhow::Result<(Top, Option<&'a toml::Value>)> {
    let mut argv = Vec::new();
    let mut lines = BTreeMap::new();
    let mut log_format = None;
    let mut listen = None;
    let mut folds_value = None;
    for (k, v) in doc {
        let line = key_line(text, None, k);
        if k == FOLDS {
            folds_value = Some(v);
        } else if k == "log_format" {
            log_format = Some(
                v.as_str()
                    .and_then(|s| <LogFormat as clap::ValueEnum>::from_str(s, false).ok())
                    .ok_or_else(|| anyhow!("{file}:{line}: log_format: `text` or `json`"))?,
            );
        } else if k == "listen" {
            listen = Some(
                v.as_str()
                    .ok_or_else(|| anyhow!("{file}:{line}: listen: an address, \"HOST:PORT\""))?
                    .to_string(),
            );
        } else if FOLD_ONLY.contains(&k.as_str()) {
            bail!("{file}:{line}: `{k}` belongs in each [[folds]] table, not at the top");
        } else if keys.contains_key(k) {
            key_args(k, v, &mut argv).map_err(|e| anyhow!("{file}:{line}: {k}: {e}"))?;
            lines.insert(k.clone(), line);
        } else {
            bail!("{file}:{line}: unknown key `{k}` (a key is one of run's flags, `_` for `-`)");
        }
    }
    let top = Top {
        argv,
        lines,
        log_format,
        listen,
    };
    Ok((top, folds_value))
}

/// The `i`-th `[[folds]]` table: the top's flags then its own (each a flag of `run`, none the
/// process's nor, under a top-level `listen`, the one listener's), its `bucket` and `store`,
/// and its name (one a top-level `listen` can serve under `/folds/NAME/`).
fn read_fold(
    file: &str,
    text: &str,
    keys: &BTreeMap<String, clap::Id>,
    top: &Top,
    i: usize,
    t: &toml::Value,
) -> anyhow::Result<Fold> {
    let Some(t) = t.as_table() else {
        bail!("{file}: folds[{i}] is not a table");
    };
    let header = key_line_of_fold(text, i);
    let mut argv = vec!["run".to_string()];
    argv.extend(top.argv.iter().cloned());
    let mut lines = top.lines.clone();
    for (k, v) in t {
        let line = key_line(text, Some(i), k);
        if !keys.contains_key(k) || PROCESS_KEYS.contains(&k.as_str()) {
            bail!(
                "{file}:{line}: unknown key `{k}` in fold {} (a key is one of run's flags, `_` for `-`)",
                i + 1
            );
        }
        if k == "listen" && top.listen.is_some() {
            bail!(
                "{file}:{line}: fold {} has its own `listen` beside the process's: with a top-level listen every fold is served there, under /folds/NAME/",
                i + 1
            );
        }
        if top.listen.is_some() && SHARED_LISTENER_KEYS.contains(&k.as_str()) {
            bail!(
                "{file}:{line}: fold {} sets `{k}`, which the one listener of the top-level listen holds for every fold: set it at the top",
                i + 1
            );
        }
        key_args(k, v, &mut argv).map_err(|e| anyhow!("{file}:{line}: {k}: {e}"))?;
        lines.insert(k.clone(), line);
    }
    for needed in ["bucket", "store"] {
        if !t.contains_key(needed) {
            bail!("{file}:{header}: fold {} has no `{needed}`", i + 1);
        }
    }
    let name = t
        .get("name")
        .or_else(|| t.get("bucket"))
        .and_then(toml::Value::as_str)
        .unwrap_or_default()
        .to_string();
    if top.listen.is_some()
        && let Some(why) = crate::serve::fold_name_refusal(&name)
    {
        let at = lines.get("name").or_else(|| lines.get("bucket"));
        bail!(
            "{file}:{}: fold {}: name {name:?} cannot be served under /folds/NAME/ of the top-level listen: {why}",
            at.copied().unwrap_or(header),
            i + 1
        );
    }
    Ok(Fold { name, argv, lines })
}

/// The line of the i-th `[[folds]]` header.
fn key_line_of_fold(text: &str, i: usize) -> usize {
    text.lines()
        .enumerate()
        .filter(|(_, l)| l.trim() == "[[folds]]")
        .nth(i)
        .map_or(0, |(n, _)| n + 1)
}

/// Two folds never share a name, a store or a listen address.
fn check_distinct(file: &str, folds: &[Fold], doc: &toml::Table) -> anyhow::Result<()> {
    let tables = doc
        .get(FOLDS)
        .and_then(toml::Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default();
    for key in ["name", "store", "listen"] {
        let mut seen: BTreeMap<String, usize> = BTreeMap::new();
        for (i, f) in folds.iter().enumerate() {
            let value = match key {
                "name" => Some(f.name.clone()),
                // A top-level store is refused; a top-level listen is the process's own.
                _ => tables
                    .get(i)
                    .and_then(|t| t.get(key))
                    .and_then(toml::Value::as_str)
                    .map(str::to_string),
            };
            let Some(v) = value else { continue };
            if let Some(first) = seen.insert(v.clone(), i) {
                bail!(
                    "{file}: folds {} and {} share the {key} {v:?} (each fold needs its own)",
                    first + 1,
                    i + 1
                );
            }
        }
    }
    Ok(())
}

/// Refuses two folds that would follow one channel under one node name (docs/channels.md, "One
/// name, one node"): both would claim one name, and the second would never start. Flags given
/// beside `--config` count, as they do at the run. A fold whose flags do not parse is left to
/// [`fold_args`], which names the key.
fn check_claims(file: &str, folds: &[Fold]) -> anyhow::Result<()> {
    let overrides = run_overrides();
    let mut seen: BTreeMap<(String, String, String), usize> = BTreeMap::new();
    for (i, f) in folds.iter().enumerate() {
        let argv: Vec<String> = f.argv.iter().chain(&overrides).cloned().collect();
        let Ok(args) = parse(&argv) else { continue };
        let Some(channel) = args.guest_channel else {
            continue;
        };
        let node = args.node_id.unwrap_or_else(crate::node::default_node_name);
        if let Some(first) = seen.insert((args.channel_bucket, channel.clone(), node.clone()), i) {
            bail!(
                "{file}: folds {} and {} both follow guest channel {channel:?} as node {node:?} (one name is one node: give each fold its own node_id)",
                first + 1,
                i + 1
            );
        }
    }
    Ok(())
}

/// The fold's `run` arguments, with `overrides` (flags given beside `--config`) last, parsed by
/// `run`'s own parser; an error names the file, the key and its line.
pub(crate) fn fold_args(file: &Path, fold: &Fold, overrides: &[String]) -> anyhow::Result<RunArgs> {
    let argv: Vec<String> = fold.argv.iter().chain(overrides).cloned().collect();
    let mut args = parse(&argv).map_err(|e| {
        let flag = match e.get(clap::error::ContextKind::InvalidArg) {
            Some(clap::error::ContextValue::String(s)) => {
                s.split_whitespace().next().unwrap_or("").to_string()
            }
            _ => String::new(),
        };
        let key = flag.trim_start_matches('-').replace('-', "_");
        let line = fold.lines.get(&key).copied().unwrap_or(0);
        let what = e.to_string();
        let what = what
            .lines()
            .next()
            .unwrap_or("")
            .trim_start_matches("error: ");
        anyhow!("{}:{line}: fold {}: {what}", file.display(), fold.name)
    })?;
    if args.name.is_none() {
        args.name = Some(fold.name.clone());
    }
    Ok(args)
}

fn parse(argv: &[String]) -> Result<RunArgs, clap::Error> {
    let matches = RunCli::command().try_get_matches_from(argv)?;
    RunCli::from_arg_matches(&matches).map(|c| c.args)
}

/// Every effective value of the fold, as its key and a `key = value` line in the type the file
/// takes (defaults marked; secrets redacted).
fn effective(fold: &Fold, overrides: &[String]) -> anyhow::Result<Vec<(String, String)>> {
    let argv: Vec<String> = fold.argv.iter().chain(overrides).cloned().collect();
    let cmd = RunCli::command();
    let matches = cmd.clone().try_get_matches_from(&argv)?;
    let mut out = Vec::new();
    for arg in cmd.get_arguments() {
        let (Some(long), id) = (arg.get_long(), arg.get_id()) else {
            continue;
        };
        let key = long.replace('-', "_");
        if key == "config" {
            continue;
        }
        let Some(raw) = matches.get_raw(id.as_str()) else {
            continue;
        };
        let values: Vec<String> = raw.map(|v| v.to_string_lossy().into_owned()).collect();
        let numeric = is_integer(arg.get_value_parser().type_id());
        let shown = shown_values(&key, &values, numeric);
        let source = matches.value_source(id.as_str());
        let default = source == Some(clap::parser::ValueSource::DefaultValue);
        // A secret, a URL's credentials or a value from the environment is said in a comment,
        // never as a value: a copy of the output must not pin a placeholder or an environment's
        // value into a file (a token of "<redacted>" would be a token anyone knows).
        let redacted = SECRET_KEYS.contains(&key.as_str());
        if key == "nats" && values.iter().any(|v| redact_url(v) != *v) {
            // The servers without their credentials, which a copy must give another way.
            let bare: Vec<String> = values.iter().map(|v| strip_credentials(v)).collect();
            let line = format!(
                "{key} = {}  # credentials not shown: give them with user and password_file, or creds_file",
                toml::Value::String(bare.join(","))
            );
            out.push((key.clone(), line));
            continue;
        }
        if redacted || source == Some(clap::parser::ValueSource::EnvVariable) {
            let why = if redacted {
                "set, not shown".to_string()
            } else {
                let var = arg
                    .get_env()
                    .map_or(String::new(), |e| e.to_string_lossy().into_owned());
                format!("from the environment ({var}), not pinned here")
            };
            let value = if SECRET_KEYS.contains(&key.as_str()) {
                String::new()
            } else {
                format!(" = {}", shown.join(", "))
            };
            out.push((key.clone(), format!("# {key}{value}  # {why}")));
            continue;
        }
        let value = if shown.len() == 1 && !arg.get_action().takes_values() {
            values[0].clone()
        } else if shown.len() == 1 {
            shown[0].clone()
        } else {
            format!("[{}]", shown.join(", "))
        };
        let line = format!(
            "{key} = {value}{}",
            if default { "  # default" } else { "" }
        );
        out.push((key, line));
    }
    Ok(out)
}

/// `key`'s values as the file writes them: a secret redacted, a URL without its credentials, an
/// integer as one (when the flag is `numeric`), else a string.
fn shown_values(key: &str, values: &[String], numeric: bool) -> Vec<String> {
    values
        .iter()
        .map(|v| {
            if SECRET_KEYS.contains(&key) {
                toml::Value::String("<redacted>".into())
            } else if key == "nats" {
                toml::Value::String(redact_url(v))
            } else if let (true, Ok(n)) = (numeric, v.parse::<i64>()) {
                toml::Value::Integer(n)
            } else {
                toml::Value::String(v.clone())
            }
        })
        .map(|v| v.to_string())
        .collect()
}

/// Whether a flag's value parser yields an integer: its value is written as one (a value in
/// units, `1MiB` or `30s`, stays a string, which the file takes too).
fn is_integer(parsed: impl PartialEq<std::any::TypeId>) -> bool {
    use std::any::TypeId;
    [
        TypeId::of::<u64>(),
        TypeId::of::<u32>(),
        TypeId::of::<u16>(),
        TypeId::of::<u8>(),
        TypeId::of::<usize>(),
        TypeId::of::<i64>(),
        TypeId::of::<i32>(),
    ]
    .iter()
    .any(|t| parsed == *t)
}

/// `nats://user:pass@host` → `nats://<redacted>@host` (each of a list).
fn redact_url(urls: &str) -> String {
    urls.split(',')
        .map(|u| match (u.find("://"), u.rfind('@')) {
            (Some(s), Some(at)) if at > s + 3 => format!("{}<redacted>{}", &u[..s + 3], &u[at..]),
            _ => u.to_string(),
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// `nats://user:pass@host` → `nats://host` (each of a list).
fn strip_credentials(urls: &str) -> String {
    urls.split(',')
        .map(|u| match (u.find("://"), u.rfind('@')) {
            (Some(s), Some(at)) if at > s + 3 => format!("{}{}", &u[..s + 3], &u[at + 1..]),
            _ => u.to_string(),
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// `foldhost config check FILE`.
pub(super) fn cmd_config(c: ConfigCommand) -> anyhow::Result<()> {
    let ConfigCommand::Check(a) = c;
    let Loaded {
        folds,
        log_format,
        listen,
    } = load(&a.file)?;
    // Each fold as run takes it: with a top-level listen, parsed with it.
    let extra: Vec<String> = listen
        .iter()
        .flat_map(|l| ["--listen".to_string(), l.clone()])
        .collect();
    let mut tables = Vec::with_capacity(folds.len());
    for fold in &folds {
        // Every value as run would take it: parsed, then checked as run checks it.
        fold_args(&a.file, fold, &extra)?
            .into_config()
            .with_context(|| format!("{}: fold {}", a.file.display(), fold.name))?;
        tables.push(effective(fold, &extra)?);
    }
    let mut out = std::io::stdout().lock();
    if let Some(f) = log_format {
        writeln!(out, "log_format = {:?}", format!("{f:?}").to_lowercase())?;
    }
    // Under a top-level listen, its keys once at the top (every fold has the same), and in no
    // fold's table: the output is a file `run` takes.
    let listener_key =
        |k: &str| listen.is_some() && (k == "listen" || SHARED_LISTENER_KEYS.contains(&k));
    if let Some(l) = &listen {
        writeln!(out, "listen = {}", toml::Value::String(l.clone()))?;
        for (k, line) in tables.first().into_iter().flatten() {
            if SHARED_LISTENER_KEYS.contains(&k.as_str()) {
                writeln!(out, "{line}")?;
            }
        }
    }
    for table in &tables {
        writeln!(out, "\n[[folds]]")?;
        for (_, line) in table.iter().filter(|(k, _)| !listener_key(k)) {
            writeln!(out, "{line}")?;
        }
    }
    Ok(())
}

/// The arguments given to `run` beside `--config FILE` (the process's own, after `run`): they
/// override the file's.
pub(crate) fn run_overrides() -> Vec<String> {
    let args: Vec<String> = std::env::args().collect();
    let Some(at) = args.iter().position(|a| a == "run") else {
        return Vec::new();
    };
    let mut out = Vec::new();
    let mut it = args[at + 1..].iter();
    while let Some(a) = it.next() {
        if a == "--config" || a == "--log-format" {
            it.next();
        } else if !a.starts_with("--config=") && !a.starts_with("--log-format=") {
            out.push(a.clone());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(text: &str) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("foldhost.toml");
        std::fs::write(&p, text).expect("write");
        (dir, p)
    }

    const TWO: &str = r#"
nats = "nats://127.0.0.1:4222"
backend = "fjall"
defer_grace_secs = "30m"

[[folds]]
name = "routes"
bucket = "routes"
store = "/var/lib/foldhost/routes"
guest = "router.wasm"
guest_config = { region = "eu" }

[[folds]]
bucket = "hosts"
store = "/var/lib/foldhost/hosts"
backend = "append-log"
listen = "127.0.0.1:8081"
"#;

    #[test]
    fn every_key_is_a_run_flag_the_top_a_default_and_a_fold_its_own_key_wins() {
        let (_d, p) = write(TWO);
        let folds = load(&p).expect("loads").folds;
        assert_eq!(folds.len(), 2);
        let routes = fold_args(&p, &folds[0], &[]).expect("parses");
        assert_eq!(routes.name.as_deref(), Some("routes"));
        assert_eq!(routes.backend.as_str(), "fjall");
        assert_eq!(
            routes.defer_grace_secs, 1800,
            "units as on the command line"
        );
        assert_eq!(routes.guest_config, vec![("region".into(), "eu".into())]);
        let hosts = fold_args(&p, &folds[1], &[]).expect("parses");
        assert_eq!(
            hosts.name.as_deref(),
            Some("hosts"),
            "the bucket by default"
        );
        assert_eq!(
            hosts.backend.as_str(),
            "append-log",
            "the fold's own key wins"
        );
        let over = fold_args(&p, &folds[1], &["--backend".into(), "fjall".into()]).expect("parses");
        assert_eq!(
            over.backend.as_str(),
            "fjall",
            "a flag beside --config wins"
        );
    }

    #[test]
    fn an_unknown_key_a_bad_value_or_a_shared_store_is_refused_naming_the_file_line_and_key() {
        for (text, line, words) in [
            (
                "[[folds]]\nbucket = \"a\"\nstore = \"s\"\nbakend = \"fjall\"\n",
                4,
                "unknown key `bakend`",
            ),
            (
                "bakend = 1\n[[folds]]\nbucket = \"a\"\nstore = \"s\"\n",
                1,
                "unknown key `bakend`",
            ),
            (
                "bucket = \"a\"\n[[folds]]\nstore = \"s\"\n",
                1,
                "`bucket` belongs in each",
            ),
            ("[[folds]]\nstore = \"s\"\n", 1, "has no `bucket`"),
            (
                "[[folds]]\nbucket = \"a\"\nstore = \"s\"\n[[folds]]\nbucket = \"b\"\nstore = \"s\"\n",
                0,
                "share the store",
            ),
            (
                "[[folds]]\nbucket = \"a\"\nstore = \"s\"\nnats = [[1]]\n",
                4,
                "nats",
            ),
        ] {
            let (_d, p) = write(text);
            let e = load(&p).expect_err(text).to_string();
            assert!(e.contains(words), "{text}: {e}");
            if line > 0 {
                assert!(e.contains(&format!("foldhost.toml:{line}:")), "{text}: {e}");
            }
        }
        let (_d, p) =
            write("[[folds]]\nbucket = \"a\"\nstore = \"s\"\ndefer_grace_secs = \"soon\"\n");
        let folds = load(&p).expect("loads").folds;
        let e = fold_args(&p, &folds[0], &[])
            .expect_err("bad value")
            .to_string();
        assert!(e.contains("foldhost.toml:4:") && e.contains("soon"), "{e}");
    }

    #[test]
    fn folds_that_would_follow_one_channel_under_one_node_name_are_refused_and_distinct_names_load()
    {
        for (text, refused) in [
            // A top-level name applies to every fold.
            (
                "node_id = \"n1\"\nguest_channel = \"edge\"\n[[folds]]\nbucket = \"a\"\nstore = \"s1\"\n[[folds]]\nbucket = \"b\"\nstore = \"s2\"\n",
                true,
            ),
            // Both default to the host's name.
            (
                "guest_channel = \"edge\"\n[[folds]]\nbucket = \"a\"\nstore = \"s1\"\n[[folds]]\nbucket = \"b\"\nstore = \"s2\"\n",
                true,
            ),
            (
                "guest_channel = \"edge\"\n[[folds]]\nbucket = \"a\"\nstore = \"s1\"\nnode_id = \"n1\"\n[[folds]]\nbucket = \"b\"\nstore = \"s2\"\nnode_id = \"n2\"\n",
                false,
            ),
            // One name on two channels is two claims.
            (
                "node_id = \"n1\"\n[[folds]]\nbucket = \"a\"\nstore = \"s1\"\nguest_channel = \"edge\"\n[[folds]]\nbucket = \"b\"\nstore = \"s2\"\nguest_channel = \"core\"\n",
                false,
            ),
        ] {
            let (_d, p) = write(text);
            match load(&p) {
                Err(e) if refused => {
                    let e = e.to_string();
                    assert!(
                        e.contains("folds 1 and 2 both follow guest channel \"edge\""),
                        "{text}: {e}"
                    );
                }
                Err(e) => panic!("{text}: refused: {e}"),
                Ok(_) => assert!(!refused, "{text}: loaded"),
            }
        }
    }

    #[test]
    fn config_check_prints_every_effective_value_with_secrets_redacted() {
        let (_d, p) = write(
            "nats = \"nats://alice:hunter2@127.0.0.1:4222\"\n[[folds]]\nbucket = \"a\"\nstore = \"s\"\nadmin_token = \"s3cret\"\n",
        );
        let folds = load(&p).expect("loads").folds;
        let lines = effective(&folds[0], &[])
            .expect("effective")
            .into_iter()
            .map(|(_, l)| l)
            .collect::<Vec<_>>()
            .join("\n");
        assert!(
            !lines.contains("hunter2") && !lines.contains("s3cret"),
            "{lines}"
        );
        assert!(
            lines
                .lines()
                .any(|l| l.starts_with("nats = \"nats://127.0.0.1:4222\"  # credentials not shown")),
            "{lines}"
        );
        assert!(
            lines.contains("# admin_token  # set, not shown") && !lines.contains("\nadmin_token"),
            "{lines}"
        );
        assert!(
            lines.contains("backend = \"append-log\"  # default"),
            "{lines}"
        );
        assert!(lines.contains("bucket = \"a\"\n"), "{lines}");
    }
}
