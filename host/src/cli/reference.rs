//! What the command line says of itself, generated from the clap definitions `--help` prints:
//! shell completions (`foldhost completions SHELL`), man pages (`foldhost man DIR`) and the
//! command reference `docs/cli.md` (`foldhost cli-reference`; a test fails when the file differs).
//!
//! Invariant: every text here comes from [`super::Cli`]'s definitions, never written by hand, so
//! the reference, the man pages, the completions and `--help` cannot disagree.

use std::io::Write;
use std::path::Path;

use anyhow::Context;
use clap::CommandFactory;

use super::Cli;

/// `foldhost completions SHELL`: the completion script for `shell`, on standard output.
pub(super) fn completions(shell: clap_complete::Shell) {
    let mut cmd = Cli::command();
    clap_complete::generate(shell, &mut cmd, "foldhost", &mut std::io::stdout());
}

/// `foldhost man DIR`: `foldhost.1` and a page per command (`foldhost-run.1`, …) into `dir`.
pub(super) fn man(dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    let cmd = Cli::command();
    let mut pages = vec![("foldhost".to_string(), cmd.clone())];
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        let name = format!("foldhost-{}", sub.get_name());
        pages.push((name.clone(), sub.clone().name(name)));
    }
    for (name, page) in pages {
        let path = dir.join(format!("{name}.1"));
        let mut out = Vec::new();
        clap_mangen::Man::new(page)
            .render(&mut out)
            .with_context(|| format!("render {name}"))?;
        std::fs::write(&path, out).with_context(|| format!("write {}", path.display()))?;
    }
    Ok(())
}

/// The width the reference is wrapped at, whatever the terminal.
const WIDTH: usize = 100;

/// `docs/cli.md`: every command's `--help`, in the order `foldhost --help` lists them.
pub fn markdown() -> String {
    let mut cmd = Cli::command().term_width(WIDTH).max_term_width(WIDTH);
    cmd.build();
    let mut out = String::from(
        "# Command reference\n\n\
         Generated from the command line's own definitions (`foldhost cli-reference > docs/cli.md`;\n\
         a test fails when this file and `--help` differ). Exit codes: 0 success, 2 usage, 1 any\n\
         other failure with one line on standard error, unless a command says otherwise.\n",
    );
    section(&mut out, &mut cmd, "foldhost");
    out
}

fn section(out: &mut String, cmd: &mut clap::Command, path: &str) {
    let help = cmd.render_long_help().to_string();
    out.push_str(&format!("\n## `{path}`\n\n```text\n"));
    for line in help.lines() {
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out.push_str("```\n");
    let names: Vec<String> = cmd
        .get_subcommands()
        .filter(|s| !s.is_hide_set() && s.get_name() != "help")
        .map(|s| s.get_name().to_string())
        .collect();
    for name in names {
        if let Some(sub) = cmd.find_subcommand_mut(&name) {
            section(out, sub, &format!("{path} {name}"));
        }
    }
}

/// `foldhost cli-reference`: [`markdown`] on standard output.
pub(super) fn print_markdown() -> anyhow::Result<()> {
    std::io::stdout()
        .write_all(markdown().as_bytes())
        .context("write the reference")
}

#[cfg(test)]
mod tests {
    #[test]
    fn docs_cli_md_is_what_the_command_line_says_of_itself() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/cli.md");
        let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
        let now = super::markdown();
        if on_disk != now {
            let first = on_disk
                .lines()
                .zip(now.lines())
                .position(|(a, b)| a != b)
                .map_or(on_disk.lines().count().min(now.lines().count()), |i| i);
            panic!(
                "docs/cli.md differs from --help from line {}: regenerate it with `cargo run -p foldhost -- cli-reference > docs/cli.md`\n  file: {:?}\n  help: {:?}",
                first + 1,
                on_disk.lines().nth(first),
                now.lines().nth(first)
            );
        }
    }

    #[test]
    fn every_command_has_a_man_page() {
        let tmp = tempfile::tempdir().expect("tempdir");
        super::man(tmp.path()).expect("man pages");
        for page in [
            "foldhost.1",
            "foldhost-run.1",
            "foldhost-swap.1",
            "foldhost-grants.1",
        ] {
            let text = std::fs::read_to_string(tmp.path().join(page)).expect(page);
            assert!(text.contains(".TH"), "{page} is a man page");
        }
    }
}
