//! `foldhost new-guest`: a Rust guest that builds with one command, from the templates in
//! `templates/` (real files, so they read and diff as what they make; the live suite builds one).

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};

use super::{NewGuestArgs, find_in_checkout};

const CARGO_TOML: &str = include_str!("templates/Cargo.toml.tmpl");
const LIB_RS: &str = include_str!("templates/lib.rs.tmpl");
const README_MD: &str = include_str!("templates/README.md.tmpl");

/// A template with its `{{name}}`, `{{crate_file}}` and `{{sdk}}` placeholders filled.
fn fill(template: &str, name: &str, sdk: &Path) -> String {
    template
        .replace("{{name}}", name)
        .replace("{{crate_file}}", &name.replace('-', "_"))
        .replace("{{sdk}}", &sdk.display().to_string())
}

fn find_sdk() -> Option<PathBuf> {
    find_in_checkout(Path::new("sdk/rust/Cargo.toml"))
        .and_then(|p| p.parent().map(Path::to_path_buf))
}

/// Whether `name` is a guest name: letters, digits, `-` and `_`, starting with a letter.
fn valid_name(name: &str) -> bool {
    name.chars().next().is_some_and(|c| c.is_ascii_alphabetic())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
}

pub(super) fn cmd_new_guest(a: NewGuestArgs) -> anyhow::Result<()> {
    let name = a.name.as_str();
    if !valid_name(name) {
        bail!("guest name {name:?}: use letters, digits, '-' and '_', starting with a letter");
    }
    let sdk = match a.sdk.clone().or_else(find_sdk) {
        Some(p) => std::fs::canonicalize(&p).with_context(|| format!("--sdk {}", p.display()))?,
        None => bail!("the SDK (sdk/rust of a foldhost checkout) was not found: pass --sdk PATH"),
    };
    let dir = a.dir.clone().unwrap_or_else(|| PathBuf::from(name));
    if dir.exists() {
        bail!("{}: already exists; not overwriting", dir.display());
    }
    std::fs::create_dir_all(dir.join("src"))
        .with_context(|| format!("create {}", dir.display()))?;
    let write = |p: PathBuf, text: &str| {
        std::fs::write(&p, text).with_context(|| format!("write {}", p.display()))
    };
    write(dir.join("Cargo.toml"), &fill(CARGO_TOML, name, &sdk))?;
    write(dir.join("src/lib.rs"), &fill(LIB_RS, name, &sdk))?;
    write(dir.join("README.md"), &fill(README_MD, name, &sdk))?;
    write(dir.join(".gitignore"), "target/\n")?;
    println!(
        "created {}: build it with `cargo build --release --target wasm32-wasip2` (→ target/wasm32-wasip2/release/{}.wasm)",
        dir.display(),
        name.replace('-', "_")
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_are_filled_everywhere_and_names_are_checked() {
        for t in [CARGO_TOML, LIB_RS, README_MD] {
            let out = fill(t, "my-guest", Path::new("/sdk"));
            assert!(!out.contains("{{"), "a placeholder left: {out}");
        }
        assert!(fill(README_MD, "my-guest", Path::new("/sdk")).contains("my_guest.wasm"));
        assert!(valid_name("a-b_1") && !valid_name("1a") && !valid_name("") && !valid_name("a b"));
    }
}
