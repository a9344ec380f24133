//! `foldhost new-guest NAME --lang rust|js|python|c`: a guest project that builds with one command,
//! from the templates in `templates/<lang>/` (real files, so they read and diff as what they make;
//! the live suite builds and runs one of each).
//!
//! A scaffold carries its SDK and the WIT: this binary holds them ([`super::vendored`]) and writes
//! them under the project's `foldhost/`, so the project builds wherever its language's toolchain is,
//! with no foldhost checkout. `--sdk PATH` (and `--wit PATH`) link an existing copy by absolute path
//! instead — a checkout's, whose installed JavaScript toolchain it then shares. Placeholders: `{{name}}` (the guest's name), `{{crate_file}}` (the name with `-` as
//! `_`: the Rust crate's file name, the Python module's, the output `.wasm`'s), `{{module}}` (the
//! name as a state module name: lowercase, `-` for `_`), `{{sdk}}`, `{{wit}}`. With `--state` the
//! templates are `templates/<lang>-state/`: a guest that owns one bucket and reads another's
//! (docs/state.md).

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};

use super::{NewGuestArgs, find_in_checkout, vendored};

/// The componentize-py a Python scaffold installs when none is found (the version
/// `scripts/setup.sh` pins).
pub(super) const COMPONENTIZE_PY_VERSION: &str = "0.25.1";

/// A guest language `new-guest` can scaffold.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Lang {
    /// Rust, with the SDK crate (`sdk/rust`).
    Rust,
    /// JavaScript, with the SDK module (`sdk/js`) and componentize-js.
    Js,
    /// Python, with the SDK module (`sdk/python`) and componentize-py.
    Python,
    /// C, against the raw bindings wit-bindgen generates.
    C,
}

/// One file of a scaffold.
struct Template {
    /// Its path in the project.
    path: &'static str,
    /// Its text, with placeholders.
    text: &'static str,
    /// Made executable (a build script).
    executable: bool,
}

const fn file(path: &'static str, text: &'static str) -> Template {
    Template {
        path,
        text,
        executable: false,
    }
}

const fn script(path: &'static str, text: &'static str) -> Template {
    Template {
        path,
        text,
        executable: true,
    }
}

const RUST: &[Template] = &[
    file("Cargo.toml", include_str!("templates/rust/Cargo.toml.tmpl")),
    file("src/lib.rs", include_str!("templates/rust/lib.rs.tmpl")),
    file("README.md", include_str!("templates/rust/README.md.tmpl")),
    file(".gitignore", "target/\n"),
];

const RUST_STATE: &[Template] = &[
    file(
        "Cargo.toml",
        include_str!("templates/rust-state/Cargo.toml.tmpl"),
    ),
    file(
        "src/lib.rs",
        include_str!("templates/rust-state/lib.rs.tmpl"),
    ),
    file(
        "README.md",
        include_str!("templates/rust-state/README.md.tmpl"),
    ),
    file(".gitignore", "target/\n"),
];

const JS_STATE: &[Template] = &[
    file("guest.js", include_str!("templates/js-state/guest.js.tmpl")),
    file(
        "guest.test.mjs",
        include_str!("templates/js-state/guest.test.mjs.tmpl"),
    ),
    file(
        "package.json",
        include_str!("templates/js-state/package.json.tmpl"),
    ),
    file(
        "jsconfig.json",
        include_str!("templates/js-state/jsconfig.json.tmpl"),
    ),
    script("build.sh", include_str!("templates/js-state/build.sh.tmpl")),
    file(
        "README.md",
        include_str!("templates/js-state/README.md.tmpl"),
    ),
    file(
        ".gitignore",
        include_str!("templates/js-state/gitignore.tmpl"),
    ),
];

const PYTHON_STATE: &[Template] = &[
    file(
        "guest.py",
        include_str!("templates/python-state/guest.py.tmpl"),
    ),
    file(
        "test_guest.py",
        include_str!("templates/python-state/test_guest.py.tmpl"),
    ),
    script(
        "build.sh",
        include_str!("templates/python-state/build.sh.tmpl"),
    ),
    file(
        "README.md",
        include_str!("templates/python-state/README.md.tmpl"),
    ),
    file(
        ".gitignore",
        include_str!("templates/python-state/gitignore.tmpl"),
    ),
];

const C: &[Template] = &[
    file("guest.c", include_str!("templates/c/guest.c.tmpl")),
    script("build.sh", include_str!("templates/c/build.sh.tmpl")),
    file("README.md", include_str!("templates/c/README.md.tmpl")),
    file(".gitignore", "bindings/\n*.wasm\n"),
];

const JS: &[Template] = &[
    file("guest.js", include_str!("templates/js/guest.js.tmpl")),
    file(
        "guest.test.mjs",
        include_str!("templates/js/guest.test.mjs.tmpl"),
    ),
    file(
        "package.json",
        include_str!("templates/js/package.json.tmpl"),
    ),
    file(
        "jsconfig.json",
        include_str!("templates/js/jsconfig.json.tmpl"),
    ),
    script("build.sh", include_str!("templates/js/build.sh.tmpl")),
    file("README.md", include_str!("templates/js/README.md.tmpl")),
    file(".gitignore", include_str!("templates/js/gitignore.tmpl")),
];

const PYTHON: &[Template] = &[
    file("guest.py", include_str!("templates/python/guest.py.tmpl")),
    file(
        "test_guest.py",
        include_str!("templates/python/test_guest.py.tmpl"),
    ),
    script("build.sh", include_str!("templates/python/build.sh.tmpl")),
    file("README.md", include_str!("templates/python/README.md.tmpl")),
    file(
        ".gitignore",
        include_str!("templates/python/gitignore.tmpl"),
    ),
];

impl Lang {
    fn templates(self) -> &'static [Template] {
        match self {
            Lang::Rust => RUST,
            Lang::Js => JS,
            Lang::Python => PYTHON,
            Lang::C => C,
        }
    }

    /// The templates of a guest that keeps state (`--state`), when the language has them.
    fn state_templates(self) -> Option<&'static [Template]> {
        match self {
            Lang::Rust => Some(RUST_STATE),
            Lang::Js => Some(JS_STATE),
            Lang::Python => Some(PYTHON_STATE),
            Lang::C => None,
        }
    }

    /// The SDK's directory in a checkout, when the language has one.
    fn sdk(self) -> Option<&'static str> {
        match self {
            Lang::Rust => Some("sdk/rust/Cargo.toml"),
            Lang::Js => Some("sdk/js/package.json"),
            Lang::Python => Some("sdk/python/foldhost_guest.py"),
            Lang::C => None,
        }
    }

    /// What to run in the project to build it, and what it makes.
    fn build_hint(self, crate_file: &str) -> String {
        match self {
            Lang::Rust => format!(
                "cargo build --release --target wasm32-wasip2 (→ target/wasm32-wasip2/release/{crate_file}.wasm)"
            ),
            Lang::Js | Lang::Python | Lang::C => format!("./build.sh (→ {crate_file}.wasm)"),
        }
    }
}

/// Every placeholder of a template, filled.
struct Fill<'a> {
    name: &'a str,
    sdk: &'a Path,
    wit: &'a Path,
}

impl Fill<'_> {
    fn apply(&self, template: &str) -> String {
        template
            .replace("{{name}}", self.name)
            .replace("{{crate_file}}", &self.name.replace('-', "_"))
            .replace(
                "{{module}}",
                &self.name.to_ascii_lowercase().replace('_', "-"),
            )
            .replace("{{sdk}}", &self.sdk.display().to_string())
            .replace("{{wit}}", &self.wit.display().to_string())
            .replace("{{componentize_py}}", COMPONENTIZE_PY_VERSION)
    }
}

/// Whether `name` is a guest name: letters, digits, `-` and `_`, starting with a letter.
fn valid_name(name: &str) -> bool {
    name.chars().next().is_some_and(|c| c.is_ascii_alphabetic())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
}

/// `rel` (a file of the checkout) found beside this binary, as the absolute path of its directory.
fn checkout_dir(rel: &str) -> Option<PathBuf> {
    find_in_checkout(Path::new(rel))
        .and_then(|p| p.parent().map(Path::to_path_buf))
        .and_then(|p| std::fs::canonicalize(p).ok())
}

/// Where a scaffold's own copy of the SDK and the WIT goes, in the project.
const CARRIED_DIR: &str = "foldhost";

/// The SDK `--sdk` names (or, with only `--wit` given, the checkout's beside this binary), as an
/// absolute path; none for C.
fn linked_sdk(a: &NewGuestArgs, lang: Lang) -> anyhow::Result<PathBuf> {
    Ok(match (a.sdk.clone(), lang.sdk()) {
        (Some(p), _) => {
            std::fs::canonicalize(&p).with_context(|| format!("--sdk {}", p.display()))?
        }
        (None, Some(rel)) => checkout_dir(rel).with_context(|| {
            format!(
                "the SDK ({} of a foldhost checkout) was not found: pass --sdk PATH, or neither --sdk nor --wit for the SDK this binary carries",
                Path::new(rel).parent().unwrap_or(Path::new(rel)).display()
            )
        })?,
        (None, None) => PathBuf::new(),
    })
}

/// The WIT `--wit` names (or the checkout's beside this binary), as an absolute path.
fn linked_wit(a: &NewGuestArgs) -> anyhow::Result<PathBuf> {
    match a.wit.clone() {
        Some(p) => std::fs::canonicalize(&p).with_context(|| format!("--wit {}", p.display())),
        None => checkout_dir("wit/guest.wit").context(
            "the WIT (wit/ of a foldhost checkout) was not found: pass --wit PATH, or neither --sdk nor --wit for the WIT this binary carries",
        ),
    }
}

pub(super) fn cmd_new_guest(a: NewGuestArgs) -> anyhow::Result<()> {
    let name = a.name.as_str();
    if !valid_name(name) {
        bail!("guest name {name:?}: use letters, digits, '-' and '_', starting with a letter");
    }
    let lang = a.lang;
    let templates = if a.state {
        let module = name.to_ascii_lowercase().replace('_', "-");
        if !foldhost_core::protocol::is_state_name(&module) {
            bail!(
                "guest name {name:?}: a guest that keeps state needs a module name of at most {} letters, digits and hyphens (it is {module:?})",
                foldhost_core::protocol::MAX_STATE_NAME
            );
        }
        lang.state_templates().with_context(|| {
            format!(
                "--state: no {lang:?} scaffold of a guest that keeps state (rust, js and python have one)"
            )
        })?
    } else {
        lang.templates()
    };
    let dir = a.dir.clone().unwrap_or_else(|| PathBuf::from(name));
    if dir.exists() {
        bail!("{}: already exists; not overwriting", dir.display());
    }
    let sdk_dir = lang
        .sdk()
        .and_then(|f| Path::new(f).parent())
        .map(Path::to_path_buf);
    let (sdk, wit, carried) = if a.sdk.is_none() && a.wit.is_none() {
        // Relative to the project: its files refer to `foldhost/…` from their own directory.
        let root = Path::new(CARRIED_DIR);
        let sdk = sdk_dir.as_ref().map_or_else(PathBuf::new, |d| root.join(d));
        (sdk, root.join("wit"), true)
    } else {
        (linked_sdk(&a, lang)?, linked_wit(&a)?, false)
    };
    let fill = Fill {
        name,
        sdk: &sdk,
        wit: &wit,
    };
    if carried {
        let sdk = sdk_dir.as_ref().and_then(|d| d.to_str());
        for (path, text) in vendored::for_sdk(sdk) {
            let path = dir.join(CARRIED_DIR).join(path);
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent)
                    .with_context(|| format!("create {}", parent.display()))?;
            }
            std::fs::write(&path, text).with_context(|| format!("write {}", path.display()))?;
        }
    }
    for t in templates {
        let path = dir.join(t.path);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)
                .with_context(|| format!("create {}", parent.display()))?;
        }
        std::fs::write(&path, fill.apply(t.text))
            .with_context(|| format!("write {}", path.display()))?;
        if t.executable {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))
                .with_context(|| format!("chmod {}", path.display()))?;
        }
    }
    println!(
        "created {}: build it with {}",
        dir.display(),
        lang.build_hint(&name.replace('-', "_"))
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_are_filled_everywhere_and_names_are_checked() {
        let fill = Fill {
            name: "my-guest",
            sdk: Path::new("/sdk"),
            wit: Path::new("/wit"),
        };
        for lang in [Lang::Rust, Lang::Js, Lang::Python, Lang::C] {
            assert!(!lang.templates().is_empty());
            for t in lang
                .templates()
                .iter()
                .chain(lang.state_templates().into_iter().flatten())
            {
                let out = fill.apply(t.text);
                assert!(
                    !out.contains("{{"),
                    "{lang:?} {}: a placeholder left",
                    t.path
                );
            }
            let readme = lang
                .templates()
                .iter()
                .find(|t| t.path == "README.md")
                .expect("every scaffold has a README");
            assert!(
                fill.apply(readme.text).contains("my_guest.wasm"),
                "{lang:?}"
            );
        }
        assert!(valid_name("a-b_1") && !valid_name("1a") && !valid_name("") && !valid_name("a b"));
        let state = fill.apply(RUST_STATE[1].text);
        assert!(
            state.contains("Manifest::whole_bucket(\"my-guest\"") && state.contains(".owns("),
            "the state scaffold names its module by the rule: {state}"
        );
    }

    #[test]
    fn a_python_scaffold_installs_the_componentize_py_the_setup_pins() {
        let setup = include_str!("../../../scripts/setup.sh");
        let pinned = setup
            .lines()
            .find_map(|l| l.strip_prefix("COMPONENTIZE_PY_VERSION=\"${COMPONENTIZE_PY_VERSION:-"))
            .and_then(|rest| rest.strip_suffix("}\""))
            .expect("setup.sh pins componentize-py");
        assert_eq!(COMPONENTIZE_PY_VERSION, pinned);
    }

    #[test]
    fn a_scaffold_made_without_sdk_or_wit_carries_its_sdk_and_wit_and_refers_to_them_relatively() {
        let tmp = tempfile::tempdir().expect("tempdir");
        for (lang, sdk) in [
            (Lang::Rust, Some("sdk/rust/src/lib.rs")),
            (Lang::Python, Some("sdk/python/foldhost_guest.py")),
            (Lang::Js, Some("sdk/js/build.mjs")),
            (Lang::C, None),
        ] {
            let dir = tmp.path().join(format!("{lang:?}"));
            cmd_new_guest(NewGuestArgs {
                name: "my-guest".into(),
                lang,
                dir: Some(dir.clone()),
                sdk: None,
                wit: None,
                state: false,
            })
            .expect("scaffolded");
            assert!(
                dir.join("foldhost/wit/v0.3.0/guest.wit").is_file(),
                "{lang:?}"
            );
            assert!(dir.join("foldhost/docs/state.md").is_file(), "{lang:?}");
            if let Some(f) = sdk {
                assert!(dir.join("foldhost").join(f).is_file(), "{lang:?}: {f}");
            }
            // No file refers to where this binary was built.
            let checkout = env!("CARGO_MANIFEST_DIR").trim_end_matches("/host");
            for t in lang.templates() {
                let text = std::fs::read_to_string(dir.join(t.path)).expect("read");
                assert!(
                    !text.contains(checkout),
                    "{lang:?} {} names {checkout}",
                    t.path
                );
            }
        }
        let cargo = std::fs::read_to_string(tmp.path().join("Rust/Cargo.toml")).expect("read");
        assert!(cargo.contains("path = \"foldhost/sdk/rust\""), "{cargo}");
    }
}
