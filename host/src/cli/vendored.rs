//! The SDKs and the WIT this binary speaks, carried inside it so `foldhost new-guest` writes them
//! into a scaffold (`foldhost/` beside the guest's own files) and the scaffold builds wherever its
//! language's toolchain is, with no foldhost checkout (docs/cli.md, `new-guest`).
//!
//! Invariant: the list is every file of `sdk/` and `wit/` a guest build reads (the SDKs' own tests
//! aside) and `docs/state.md`, byte for byte as in the repository this binary was built from
//! (`every_sdk_and_wit_file_is_carried_as_it_is`).

/// `(path in the repository, contents)`, written under a scaffold's `foldhost/` at that path.
pub(super) const FILES: &[(&str, &str)] = &[
    ("docs/state.md", include_str!("../../../docs/state.md")),
    ("sdk/README.md", include_str!("../../../sdk/README.md")),
    (
        "sdk/js/build.mjs",
        include_str!("../../../sdk/js/build.mjs"),
    ),
    (
        "sdk/js/foldhost-guest-core.js",
        include_str!("../../../sdk/js/foldhost-guest-core.js"),
    ),
    (
        "sdk/js/foldhost-guest-state.js",
        include_str!("../../../sdk/js/foldhost-guest-state.js"),
    ),
    (
        "sdk/js/foldhost-guest.js",
        include_str!("../../../sdk/js/foldhost-guest.js"),
    ),
    (
        "sdk/js/package-lock.json",
        include_str!("../../../sdk/js/package-lock.json"),
    ),
    (
        "sdk/js/package.json",
        include_str!("../../../sdk/js/package.json"),
    ),
    (
        "sdk/js/test/fake-host.mjs",
        include_str!("../../../sdk/js/test/fake-host.mjs"),
    ),
    (
        "sdk/js/test/hooks.mjs",
        include_str!("../../../sdk/js/test/hooks.mjs"),
    ),
    (
        "sdk/python/fake_host.py",
        include_str!("../../../sdk/python/fake_host.py"),
    ),
    (
        "sdk/python/foldhost_guest.py",
        include_str!("../../../sdk/python/foldhost_guest.py"),
    ),
    (
        "sdk/rust/Cargo.toml",
        include_str!("../../../sdk/rust/Cargo.toml"),
    ),
    (
        "sdk/rust/src/__private.rs",
        include_str!("../../../sdk/rust/src/__private.rs"),
    ),
    (
        "sdk/rust/src/fold.rs",
        include_str!("../../../sdk/rust/src/fold.rs"),
    ),
    (
        "sdk/rust/src/json.rs",
        include_str!("../../../sdk/rust/src/json.rs"),
    ),
    (
        "sdk/rust/src/lib.rs",
        include_str!("../../../sdk/rust/src/lib.rs"),
    ),
    (
        "sdk/rust/src/log.rs",
        include_str!("../../../sdk/rust/src/log.rs"),
    ),
    (
        "sdk/rust/src/state.rs",
        include_str!("../../../sdk/rust/src/state.rs"),
    ),
    ("wit/README.md", include_str!("../../../wit/README.md")),
    ("wit/guest.wit", include_str!("../../../wit/guest.wit")),
    (
        "wit/v0.2.0/guest.wit",
        include_str!("../../../wit/v0.2.0/guest.wit"),
    ),
    (
        "wit/v0.3.0/guest.wit",
        include_str!("../../../wit/v0.3.0/guest.wit"),
    ),
];

/// The files a scaffold in a language needs: its SDK (none for C), the WIT, the state docs.
pub(super) fn for_sdk(
    sdk: Option<&str>,
) -> impl Iterator<Item = &'static (&'static str, &'static str)> {
    FILES.iter().filter(move |(path, _)| {
        path.starts_with("wit/")
            || path.starts_with("docs/")
            || *path == "sdk/README.md"
            || sdk.is_some_and(|dir| path.starts_with(dir))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Files of `dir` (relative to the repository) and below, as repository paths.
    fn walk(root: &std::path::Path, dir: &str, out: &mut Vec<String>) {
        for e in std::fs::read_dir(root.join(dir)).expect("read the directory") {
            let e = e.expect("an entry");
            let name = e.file_name().to_string_lossy().into_owned();
            let rel = format!("{dir}/{name}");
            if e.file_type().expect("a type").is_dir() {
                if !["node_modules", "target", "__pycache__"].contains(&name.as_str()) {
                    walk(root, &rel, out);
                }
            } else {
                out.push(rel);
            }
        }
    }

    #[test]
    fn every_sdk_and_wit_file_is_carried_as_it_is() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let mut on_disk = Vec::new();
        walk(&root, "sdk", &mut on_disk);
        walk(&root, "wit", &mut on_disk);
        // The SDKs' own tests and the Rust SDK's lock file (not part of the repository) stay out.
        on_disk.retain(|p| {
            !p.starts_with("sdk/python/test_")
                && !p.ends_with(".test.mjs")
                && p != "sdk/rust/Cargo.lock"
        });
        on_disk.push("docs/state.md".into());
        on_disk.sort();
        let mut carried: Vec<String> = FILES.iter().map(|(p, _)| (*p).to_string()).collect();
        carried.sort();
        assert_eq!(carried, on_disk, "carried files differ from sdk/ and wit/");
        for (path, text) in FILES {
            let disk = std::fs::read_to_string(root.join(path)).expect("read");
            assert_eq!(&disk, text, "{path} differs from the repository");
        }
    }
}
