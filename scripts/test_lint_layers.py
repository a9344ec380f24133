#!/usr/bin/env python3
"""scripts/lint-layers.py's own tests: each check is fed a planted violation and must report it,
and the code beside it that keeps the rule must pass. Run by `make lint-sources`."""
import importlib.util
import pathlib
import shutil
import subprocess
import tempfile
import unittest

HERE = pathlib.Path(__file__).resolve().parent
spec = importlib.util.spec_from_file_location("lint_layers", HERE / "lint-layers.py")
lint = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lint)


def fn_of(name: str, body_lines: int, indent: str = "") -> list:
    """A function whose `fn` line to closing brace spans body_lines + 2 lines."""
    return [f"{indent}fn {name}() {{"] + [f"{indent}    let _ = {i};" for i in range(body_lines)] + [f"{indent}}}"]


class Aliases(unittest.TestCase):
    def found(self, text: str) -> list:
        return list(lint.alias_findings("x.rs", text))

    def test_a_crate_re_exporting_another_crates_module_is_refused(self):
        for text in [
            "pub(crate) use foldhost_core::kv;\n",
            "pub use foldhost_core::{kv, protocol};\n",
            "pub(crate) use foldhost_core::{\n    crashpoint, kv,\n};\n",
            "pub use foldhost_nats::*;\n",
            "pub(super) use foldhost_fold::applied::Fold;\n",
            "    pub use ::foldhost_core::status::FoldStatus;\n",
        ]:
            self.assertEqual(len(self.found(text)), 1, text)

    def test_the_host_re_exported_by_the_tests_crate_is_refused_and_a_local_foldhost_module_is_not(self):
        self.assertEqual(len(list(lint.alias_findings("tests/src/lib.rs", "pub use foldhost::serve;\n"))), 1)
        bindings = "pub use foldhost::guest::types::{Entry, Op};\n"
        self.assertEqual(list(lint.alias_findings("crates/foldhost-guest/src/b.rs", bindings)), [])

    def test_a_crate_renamed_is_refused(self):
        self.assertEqual(len(self.found("use foldhost_nats as nats;\n")), 1)
        self.assertEqual(len(self.found("extern crate foldhost_core as core2;\n")), 1)

    def test_a_path_naming_its_crate_passes(self):
        for text in [
            "use foldhost_core::kv;\n",
            "use foldhost_core::kv::{KvEntry, KvUpdate};\n",
            "use foldhost_core::kv::KvEntry as Entry;\n",
            "pub use crate::kv::WatchScope;\n",
            "pub use self::inner::Thing;\n",
            "// pub use foldhost_core::kv;\n",
            "/// pub(crate) use foldhost_core::kv;\n",
        ]:
            self.assertEqual(self.found(text), [], text)

    def test_the_finding_names_the_line(self):
        (finding,) = self.found("//! doc\n\npub(crate) use foldhost_core::kv;\n")
        self.assertTrue(finding.startswith("x.rs:3: "), finding)


class Sizes(unittest.TestCase):
    def test_a_function_of_81_lines_is_found_and_one_of_80_is_not(self):
        self.assertEqual([(n, l) for n, _, l in lint.long_functions(fn_of("long", 79))], [("long", 81)])
        self.assertEqual(list(lint.long_functions(fn_of("fits", 78))), [])

    def test_every_kind_of_function_is_measured(self):
        for head in ["pub(crate) async fn", "pub(in crate::a) fn", "const fn", "unsafe fn", "pub async unsafe fn"]:
            lines = [f"    {head} f() {{"] + ["        x();"] * 90 + ["    }"]
            self.assertEqual(len(list(lint.long_functions(lines))), 1, head)

    def test_a_test_function_counts_like_any_other(self):
        lines = ["#[cfg(test)]", "mod tests {", "    #[test]"] + fn_of("a_long_test", 90, "    ") + ["}"]
        found = lint.size_findings("t.rs", "\n".join(lines))
        self.assertIn("fn t.rs::a_long_test", found)

    def test_a_file_of_801_lines_is_found_and_one_of_800_is_not(self):
        self.assertIn("file f.rs", lint.size_findings("f.rs", "\n".join(["x();"] * 801)))
        self.assertNotIn("file f.rs", lint.size_findings("f.rs", "\n".join(["x();"] * 800)))

    def test_a_file_is_counted_up_to_its_inline_tests_not_up_to_a_declared_module(self):
        inline = ["x();"] * 700 + ["#[cfg(test)]", "mod tests {"] + ["y();"] * 200 + ["}"]
        self.assertNotIn("file f.rs", lint.size_findings("f.rs", "\n".join(inline)))
        declared = ["x();"] * 10 + ["#[cfg(test)]", "mod tests;"] + ["x();"] * 800
        self.assertIn("file f.rs", lint.size_findings("f.rs", "\n".join(declared)))

    def test_two_long_functions_of_one_name_in_a_file_are_two_findings(self):
        lines = fn_of("run", 90, "    ") + fn_of("run", 85, "    ")
        found = lint.size_findings("f.rs", "\n".join(lines))
        self.assertEqual(sorted(found), ["fn f.rs::run", "fn f.rs::run#2"])


class Ratchet(unittest.TestCase):
    found = {"fn a.rs::f": (90, "a.rs:1: fn f is 90 lines")}

    def test_a_finding_the_list_allows_at_its_size_passes(self):
        self.assertEqual(lint.ratchet(self.found, {"fn a.rs::f": 90}), [])

    def test_a_new_finding_fails(self):
        self.assertEqual(len(lint.ratchet(self.found, {})), 1)

    def test_a_finding_grown_past_its_allowance_fails(self):
        (f,) = lint.ratchet(self.found, {"fn a.rs::f": 85})
        self.assertIn("grown", f)

    def test_an_allowance_no_longer_needed_or_larger_than_needed_fails(self):
        (f,) = lint.ratchet({}, {"fn a.rs::f": 90})
        self.assertIn("remove its line", f)
        (f,) = lint.ratchet(self.found, {"fn a.rs::f": 95})
        self.assertIn("lower its line", f)

    def test_the_allow_file_reads_kind_path_and_size_and_skips_comments(self):
        text = "# why\nfn a.rs::f 90\nfile b.rs 900  # to split\n\n"
        self.assertEqual(lint.parse_allow(text), {"fn a.rs::f": 90, "file b.rs": 900})


class Machete(unittest.TestCase):
    def test_a_dependency_nothing_uses_is_found(self):
        if shutil.which("cargo-machete") is None:
            self.fail("cargo-machete is not installed (scripts/setup.sh --test installs it)")
        with tempfile.TemporaryDirectory() as d:
            root = pathlib.Path(d)
            (root / "src").mkdir()
            (root / "Cargo.toml").write_text(
                '[package]\nname = "planted"\nversion = "0.1.0"\nedition = "2024"\n\n'
                '[dependencies]\nmemchr = "2"\nbytes = "1"\n'
            )
            (root / "src" / "lib.rs").write_text("pub fn f() -> bytes::Bytes { bytes::Bytes::new() }\n")
            found = lint.machete_findings(root)
        self.assertEqual(len(found), 1, found)
        self.assertIn("memchr", found[0])


class TheTree(unittest.TestCase):
    def test_no_source_of_the_workspace_re_exports_another_crate(self):
        root = HERE.parent
        found = [f for p in lint.sources(root) for f in lint.alias_findings(str(p.relative_to(root)), p.read_text())]
        self.assertEqual(found, [])


if __name__ == "__main__":
    result = unittest.main(exit=False, verbosity=1).result
    raise SystemExit(0 if result.wasSuccessful() else 1)
