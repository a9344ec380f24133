//! The command line: a contract (scripts and tests outside the project use it).
//!
//! Exit codes: 0 success, 2 usage (clap), 1 anything else with one line on stderr. Only this module
//! and `main.rs` use `anyhow`; the library layers return their own error enums.

use std::io::{IsTerminal, Write};
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, anyhow, bail};
use base64::Engine as _;
use clap::{Args, Parser, Subcommand};

use crate::node::{ListenConfig, NativeApply, Node, NodeConfig};
use foldhost_core::kv::WatchScope;
use foldhost_core::protocol::{OnRecreated, RepairMode};
use foldhost_core::snapshot::SnapshotStore;
use foldhost_core::status::StatusReport;
use foldhost_core::storedir::{self, AnyStore, Backend};
use foldhost_fold::applied::BatchConfig;

mod artifacts;
mod config;
mod demo;
mod grants;
mod guest;
mod nats;
mod reference;
mod run;
mod scaffold;
mod state;
mod status;
mod swap;
mod tokens;
mod units;
mod vendored;
mod write;

pub use artifacts::*;
pub use nats::NatsArgs;
pub use run::*;
pub use status::*;
pub use swap::*;
use tokens::*;

/// foldhost: a local, durable fold of NATS JetStream KV buckets.
#[derive(Parser, Debug)]
#[command(name = "foldhost", version, about)]
pub struct Cli {
    /// The command.
    #[command(subcommand)]
    pub command: Command,
    /// How log lines are written to standard error: `text`, or `json` (one object per line,
    /// every line naming its `event`; docs/operations.md, "Log events").
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text, env = "FOLDHOST_LOG_FORMAT")]
    pub log_format: LogFormat,
}

/// Whether the process logs JSON (`--log-format json`): its last lines (a run's stop, a failed
/// command's error) are then log lines too, so that every line of standard error parses.
static JSON_LOGS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The process's log format: `--log-format` when given on the command line (or in the
/// environment), else a `run --config` file's `log_format`, else text. A file that does not
/// read is left to `run` to refuse.
pub fn log_format_of(cli: &Cli) -> LogFormat {
    use clap::CommandFactory as _;
    let given = Cli::command()
        .try_get_matches_from(std::env::args_os())
        .ok()
        .and_then(|m| m.value_source("log_format"))
        .is_some_and(|s| s != clap::parser::ValueSource::DefaultValue);
    if given {
        return cli.log_format;
    }
    match &cli.command {
        Command::Run(a) => a
            .config
            .as_deref()
            .and_then(|f| config::load(f).ok())
            .and_then(|l| l.log_format)
            .unwrap_or(cli.log_format),
        _ => cli.log_format,
    }
}

/// The first flag among `args` that carries a secret as its value (`--admin-token T`,
/// `--write-token=T`): a command line shows in `ps`, so a token is taken from a file or the
/// environment only. Pure.
pub(crate) fn secret_on_command_line(
    args: impl IntoIterator<Item = String>,
) -> Option<&'static str> {
    args.into_iter().find_map(|a| {
        ["--admin-token", "--write-token"]
            .into_iter()
            .find(|f| a == *f || a.starts_with(&format!("{f}=")))
    })
}

/// Records the process's `--log-format` (the binary calls it once its logger is set).
pub fn set_log_format(format: LogFormat) {
    JSON_LOGS.store(
        format == LogFormat::Json,
        std::sync::atomic::Ordering::Relaxed,
    );
}

fn json_logs() -> bool {
    JSON_LOGS.load(std::sync::atomic::Ordering::Relaxed)
}

/// `--log-format`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogFormat {
    /// Lines for people (coloured on a terminal).
    Text,
    /// One JSON object per line: `timestamp`, `level`, the fields (`event` first), `message`,
    /// and the spans naming the fold.
    Json,
}

/// Subcommands.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Fold a bucket into a local store and keep it current (or every fold of a `--config` file).
    Run(Box<RunArgs>),
    /// Check a config file (`run --config`) without connecting.
    #[command(subcommand)]
    Config(config::ConfigCommand),
    /// Show a store's cursor, seq, applied_through, applier and lag.
    Status(StatusArgs),
    /// Print the fold's entries in key order, one per line.
    Dump(DumpArgs),
    /// Everything local, end to end: a nats-server, a bucket, a fold, a restart that resumes.
    Demo(DemoArgs),
    /// Hot-swap the guest of a running host (`run --listen`): the fold never stops. With
    /// `--shadow N`, try the new guest beside the running one on live traffic first.
    Swap(SwapArgs),
    /// Scaffold a guest (Rust, JavaScript, Python or C) that builds with one command.
    NewGuest(NewGuestArgs),
    /// Write a verified artifact of a fold (a directory, or a `.tar`), from a store no host is
    /// running on, or from a running host (`--listen`) without stopping it.
    Export(ExportArgs),
    /// Make a store from an artifact (every file's digest and the cursor re-checked first).
    Import(ImportArgs),
    /// Publish an artifact directory to object storage (`--artifacts URL`): the payload, then the
    /// pointer, which never moves backward.
    Publish(PublishArgs),
    /// Make a store from the artifact published under a key (every file re-checked first).
    Bootstrap(BootstrapArgs),
    /// Delete a key's published payloads older than a grace, never the pointer's target.
    Prune(PruneArgs),
    /// Write a key through a running host (`--listen`): prints the outcome as one JSON line and
    /// exits 0 applied, 3 pending, 4 unknown, 5 refused.
    Put(write::PutArgs),
    /// Delete (or `--purge`) a key through a running host, answered as `put` is.
    Delete(write::DeleteArgs),
    /// Read a key from a running host's fold (`--listen`), optionally once it has applied a
    /// revision (`--min-revision`): one JSON line; exit 0 found, 6 not found, 3 behind.
    Get(write::GetArgs),
    /// Publish guests to a channel the fleet follows (`run --guest-channel`), and see its
    /// releases and every node's rollout (docs/channels.md).
    #[command(subcommand)]
    Guest(guest::GuestCommand),
    /// Print the NATS permissions a node's user needs for what its `run` flags make it do, as a
    /// block for a nats-server `authorization` section (or `--json`).
    Grants(grants::GrantsArgs),
    /// The state buckets folded under a store, declared or not (docs/state.md).
    #[command(subcommand)]
    State(state::StateCommand),
    /// Print the completion script for a shell (e.g. `foldhost completions bash >
    /// /etc/bash_completion.d/foldhost`).
    Completions {
        /// The shell.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Write the man pages (`foldhost.1`, and `foldhost-COMMAND.1` for each command) into DIR.
    Man {
        /// Where the pages go (created if missing).
        dir: PathBuf,
    },
    /// Print the command reference (docs/cli.md) as Markdown.
    #[command(hide = true)]
    CliReference,
}

/// `foldhost new-guest`.
#[derive(Args, Debug)]
pub struct NewGuestArgs {
    /// The guest's name (letters, digits, `-`, `_`, starting with a letter).
    pub name: String,
    /// The guest's language.
    #[arg(long, value_enum, default_value_t = scaffold::Lang::Rust)]
    pub lang: scaffold::Lang,
    /// Where to create it (default: ./NAME).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Link this SDK (a foldhost checkout's `sdk/rust`, `sdk/js` or `sdk/python`) instead of
    /// writing the one this binary carries into the project's `foldhost/`.
    #[arg(long)]
    pub sdk: Option<PathBuf>,
    /// Link this WIT directory (a foldhost checkout's `wit/`) instead of writing the one this
    /// binary carries.
    #[arg(long)]
    pub wit: Option<PathBuf>,
    /// A guest that keeps state on the bus (contract 0.3.0, docs/state.md): it owns one bucket and
    /// reads another module's.
    #[arg(long)]
    pub state: bool,
}

/// `foldhost demo`.
#[derive(Args, Debug)]
pub struct DemoArgs {
    /// Routes to seed.
    #[arg(long, default_value_t = 2000)]
    pub routes: u32,
    /// The router guest (default: the one `guests/build.sh` builds).
    #[arg(long)]
    pub guest: Option<PathBuf>,
}

/// Runs a parsed command line.
pub async fn run(cli: Cli) -> anyhow::Result<()> {
    if let Some(flag) = secret_on_command_line(std::env::args().skip(1)) {
        bail!(
            "{flag}: a token on the command line shows in ps; give {flag}-file FILE (or its environment variable, FOLDHOST_{}_TOKEN)",
            if flag == "--admin-token" {
                "ADMIN"
            } else {
                "WRITE"
            }
        );
    }
    match cli.command {
        Command::Run(a) => cmd_run(*a).await,
        Command::Status(a) => match a.listen.clone() {
            Some(addr) if a.watch.is_some() => {
                let period = a.watch.unwrap_or(Duration::from_secs(2));
                cmd_status_watch(&addr, a.token_file.as_deref(), period, a.count).await
            }
            Some(addr) => cmd_status_live(&addr, a.token_file.as_deref(), a.json).await,
            None => cmd_status(a),
        },
        Command::Dump(a) => cmd_dump(a),
        Command::Demo(a) => demo::cmd_demo(a).await,
        Command::Swap(a) => cmd_swap(a).await,
        Command::NewGuest(a) => scaffold::cmd_new_guest(a),
        Command::Export(a) => cmd_export(a).await,
        Command::Import(a) => cmd_import(a).await,
        Command::Publish(a) => cmd_publish(a).await,
        Command::Bootstrap(a) => cmd_bootstrap(a).await,
        Command::Prune(a) => cmd_prune(a).await,
        Command::Put(a) => write::cmd_put(a).await,
        Command::Delete(a) => write::cmd_delete(a).await,
        Command::Get(a) => write::cmd_get(a).await,
        Command::Grants(a) => grants::cmd_grants(a).await,
        Command::Guest(c) => guest::cmd_guest(c).await,
        Command::State(a) => state::cmd_state(a),
        Command::Config(c) => config::cmd_config(c),
        Command::Completions { shell } => {
            reference::completions(shell);
            Ok(())
        }
        Command::Man { dir } => reference::man(&dir),
        Command::CliReference => reference::print_markdown(),
    }
}

/// `rel` in the current directory, else in the checkout the running binary was built in
/// (`target/<profile>/foldhost` → `../../rel`).
fn find_in_checkout(rel: &Path) -> Option<PathBuf> {
    let mut candidates = vec![rel.to_path_buf()];
    if let Ok(exe) = std::env::current_exe()
        && let Some(root) = exe.parent().and_then(Path::parent).and_then(Path::parent)
    {
        candidates.push(root.join(rel));
    }
    candidates.into_iter().find(|p| p.exists())
}

/// Where each module a log directive may name under `foldhost::` lives: the layers are crates, so
/// a module's log target is its crate's path (`foldhost_fold::applied::…`), not the path the
/// `foldhost` library re-exports it under.
const LOG_TARGETS: &[(&str, &str)] = &[
    ("applied", "foldhost_fold::applied"),
    ("repair", "foldhost_fold::repair"),
    ("artifact", "foldhost_artifact::artifact"),
    ("transport", "foldhost_artifact::transport"),
    ("nats", "foldhost_nats"),
    ("lease", "foldhost_nats::lease"),
    ("guest", "foldhost_guest::guest"),
    ("localnats", "foldhost_localnats"),
    ("protocol", "foldhost_core::protocol"),
    ("kv", "foldhost_core::kv"),
    ("bucket", "foldhost_core::bucket"),
    ("snapshot", "foldhost_core::snapshot"),
    ("retained", "foldhost_core::retained"),
    ("view", "foldhost_core::view"),
    ("status", "foldhost_core::status"),
    ("storedir", "foldhost_core::storedir"),
    ("staged", "foldhost_core::staged"),
    ("crashpoint", "foldhost_core::crashpoint"),
];

/// A `FOLDHOST_LOG` filter with the documented targets kept: `foldhost` names every crate of the
/// host (`foldhost=debug` is the whole host at debug), and `foldhost::MODULE…` the crate path the
/// module lives at (`foldhost::applied=debug` is `foldhost_fold::applied=debug`). Every other
/// directive is passed on as written.
pub fn log_filter(spec: &str) -> String {
    let crates = [
        "foldhost_core",
        "foldhost_artifact",
        "foldhost_nats",
        "foldhost_fold",
        "foldhost_guest",
        "foldhost_localnats",
    ];
    let mut out: Vec<String> = Vec::new();
    for directive in spec.split(',').map(str::trim).filter(|d| !d.is_empty()) {
        let (target, level) = match directive.split_once('=') {
            Some((t, l)) => (t, Some(l)),
            None => (directive, None),
        };
        let with = |t: &str| match level {
            Some(l) => format!("{t}={l}"),
            None => t.to_string(),
        };
        out.push(directive.to_string());
        if target == "foldhost" {
            out.extend(crates.iter().map(|c| with(c)));
        } else if let Some(rest) = target.strip_prefix("foldhost::") {
            let (module, tail) = rest.split_once("::").map_or((rest, ""), |(m, t)| (m, t));
            if let Some((_, path)) = LOG_TARGETS.iter().find(|(m, _)| *m == module) {
                let full = if tail.is_empty() {
                    (*path).to_string()
                } else {
                    format!("{path}::{tail}")
                };
                out.push(with(&full));
            }
        }
    }
    out.join(",")
}

/// Exit code for an error: 1 (clap's usage errors exit 2 on their own).
pub fn report_error(e: &anyhow::Error) -> i32 {
    // An outcome already printed as the answer: only its exit code.
    if let Some(write::OutcomeExit(code)) = e.downcast_ref::<write::OutcomeExit>() {
        return *code;
    }
    // One line: the chain joined, no backtrace.
    let mut line = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        // thiserror messages often embed their source already; don't say it twice.
        if line.contains(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    let line = line.replace('\n', " ");
    if json_logs() {
        tracing::error!(event = "command_failed", error = %line, "foldhost: error: {line}");
    } else {
        let _ = writeln!(std::io::stderr(), "foldhost: error: {line}");
    }
    1
}

#[cfg(test)]
mod tests {

    #[test]
    fn log_directives_naming_foldhost_or_its_modules_reach_the_crates_they_live_in() {
        assert_eq!(log_filter("info,async_nats=warn"), "info,async_nats=warn");
        let all = log_filter("warn,foldhost=debug");
        for c in [
            "foldhost=debug",
            "foldhost_fold=debug",
            "foldhost_nats=debug",
            "foldhost_core=debug",
        ] {
            assert!(all.split(',').any(|d| d == c), "{c} in {all}");
        }
        assert_eq!(
            log_filter("foldhost::applied=debug"),
            "foldhost::applied=debug,foldhost_fold::applied=debug"
        );
        assert_eq!(
            log_filter("foldhost::nats::lean=trace"),
            "foldhost::nats::lean=trace,foldhost_nats::lean=trace"
        );
        assert_eq!(log_filter("foldhost::node=debug"), "foldhost::node=debug");
    }

    use super::*;

    #[test]
    fn a_token_given_as_a_flag_value_is_refused_and_a_token_file_is_not() {
        let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            secret_on_command_line(args(&["swap", "--admin-token", "t"])),
            Some("--admin-token")
        );
        assert_eq!(
            secret_on_command_line(args(&["put", "--write-token=t"])),
            Some("--write-token")
        );
        assert_eq!(
            secret_on_command_line(args(&[
                "swap",
                "--admin-token-file",
                "/f",
                "--write-token-file=/g"
            ])),
            None
        );
    }

    #[test]
    fn a_token_file_is_followed_only_for_a_loopback_listener_its_own_store_says_is_its_host() {
        let file = Path::new("/srv/a/admin-token");
        let running = |listen: &str| StatusReport {
            state: "running".into(),
            listen: Some(listen.into()),
            admin_token_file: Some(file.display().to_string()),
            ..StatusReport::default()
        };
        let ok = running("127.0.0.1:7000");
        assert_eq!(
            token_file_followable("127.0.0.1:7000", file, Some(&ok)),
            Ok(())
        );
        // A listener squatting another port that names the store's token file.
        let squat = token_file_followable("127.0.0.1:7001", file, Some(&ok)).expect_err("refused");
        assert!(squat.contains("listens at 127.0.0.1:7000"), "{squat}");
        for (listen, status, words) in [
            (
                "10.0.0.5:7000",
                Some(running("10.0.0.5:7000")),
                "not on a loopback",
            ),
            ("host:7000", Some(ok.clone()), "not a literal IP"),
            ("127.0.0.1:7000", None, "no readable status.json"),
            (
                "127.0.0.1:7000",
                Some(StatusReport {
                    state: "stopped".into(),
                    ..ok.clone()
                }),
                "not of a running host",
            ),
            (
                "127.0.0.1:7000",
                Some(StatusReport {
                    admin_token_file: Some("/srv/b/admin-token".into()),
                    ..ok.clone()
                }),
                "not of a running host",
            ),
        ] {
            let why = token_file_followable(listen, file, status.as_ref()).expect_err(listen);
            assert!(why.contains(words), "{listen}: {why}");
        }
    }

    #[test]
    fn a_config_file_is_a_json_object_of_strings_and_the_command_line_overrides_it() {
        let file = config_from_json(br#"{"region": "eu", "tier": "edge"}"#).expect("parses");
        let cli = ["tier=core", "x=1"]
            .map(|kv| parse_config_item(kv).expect("parses"))
            .to_vec();
        assert_eq!(
            merge_config(file, cli),
            [("region", "eu"), ("tier", "core"), ("x", "1")]
                .map(|(k, v)| (k.to_string(), v.to_string()))
        );
        for (bad, why) in [
            (&br#"{"n": 3}"#[..], "is not a string"),
            (b"[\"a\"]", "JSON object"),
            (b"{", "not JSON"),
        ] {
            let e = config_from_json(bad).expect_err("refused");
            assert!(e.contains(why), "{e}");
        }
    }

    /// The README's limit tables name a default beside each flag; they must be the defaults the
    /// command line really has (one definition: `NodeConfig::new` and the types it holds).
    #[test]
    fn the_readme_states_the_defaults_the_command_line_has() {
        use clap::CommandFactory as _;
        let readme = include_str!("../../../README.md");
        let cli = Cli::command();
        let run = cli.find_subcommand("run").expect("run exists");
        let default_of = |flag: &str| -> String {
            let arg = run
                .get_arguments()
                .find(|a| a.get_long() == Some(flag))
                .unwrap_or_else(|| panic!("--{flag} exists"));
            arg.get_default_values()
                .iter()
                .map(|v| v.to_string_lossy().into_owned())
                .collect()
        };
        // (flag, the README's words for its default, the default as clap prints it)
        let stated = [
            ("guest-deadline-ms", "1 000 ms", "1000"),
            ("guest-memory-mb", "256 MiB", "256"),
            ("guest-max-batch-bytes", "16 MiB", "16777216"),
            ("query-max-bytes", "1 MiB", "1048576"),
            ("batch-max", "100 updates", "100"),
        ];
        for (flag, words, value) in stated {
            let row = format!("| {words} | `--{flag}` |");
            assert!(
                readme.contains(&row),
                "the README states no `{row}` for --{flag}"
            );
            assert_eq!(default_of(flag), value, "--{flag}'s default");
        }
    }
}
