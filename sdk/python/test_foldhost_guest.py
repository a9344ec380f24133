"""Unit tests of the Python SDK, natively with fake host imports (see fake_host.py). They mirror the
Rust SDK's (sdk/rust/src/__private.rs): the same batches give the same verdicts and changes."""

import unittest

from fake_host import FAKE  # first: it provides wit_world

import foldhost_guest as fg
from componentize_py_types import Err
from wit_world.imports.types import Op, Update, Verdict

A, S, D = Verdict.ACCEPT, Verdict.SKIP, Verdict.DEFER


def put(key, value, revision):
    return Update(key, value.encode(), revision, Op.PUT)


def gone(key, op, revision):
    return Update(key, b"", revision, op)


class Recorder(fg.Folder):
    """Numbers under n. and m., as the Rust tests' Recorder."""

    manifest = fg.Manifest("recorder", "0.1.0", ["n.", "m."])

    def __init__(self):
        self.applied = []
        self.cursor = 0
        self.config = None

    def init(self, config):
        if "refuse" in config:
            raise ValueError("refused")
        self.config = config

    def parse(self, key, value, rest):
        if key == "n.defer":
            return fg.DEFER
        try:
            return fg.accept(int(value))
        except ValueError:
            return fg.SKIP

    def apply(self, changes):
        if any(c.key == "n.fail" for c in changes):
            raise RuntimeError("fail")
        self.applied.extend(changes)

    def on_applied(self, cursor):
        self.cursor = cursor


class SdkTest(unittest.TestCase):
    def setUp(self):
        FAKE.reset()
        self.export = fg.export(Recorder)()

    def test_parse_then_apply_in_order(self):
        ex = self.export
        ex.init([("a", "b")])
        verdicts = ex.parse([
            put("n.1", "7", 1),
            put("out.1", "7", 2),
            put("n.bad", "x", 3),
            gone("n.2", Op.DELETE, 4),
            gone("out.2", Op.PURGE, 5),
            gone("m.3", Op.PURGE, 6),
            put("n.defer", "1", 7),
            put("m.4", "9", 8),
        ])
        self.assertEqual(verdicts, [A, S, S, A, S, A, D, A])
        ex.apply()
        rec = ex.instance()
        self.assertEqual(rec.config, {"a": "b"})
        self.assertEqual(rec.applied, [
            fg.Put("n.1", "1", 1, 7),
            fg.Delete("n.2", "2", 4),
            fg.Delete("m.3", "3", 6),
            fg.Put("m.4", "4", 8, 9),
        ])
        self.assertEqual([c.op for c in rec.applied], ["put", "delete", "delete", "put"])
        # Applied changes are forgotten: a second apply applies nothing.
        ex.apply()
        self.assertEqual(len(rec.applied), 4)
        ex.on_applied(8)
        self.assertEqual(rec.cursor, 8)
        with self.assertRaises(Err) as e:
            ex.query(b"x")
        self.assertEqual(e.exception.value, "this guest answers no queries")

    def test_a_new_parse_replaces_values_not_applied(self):
        ex = self.export
        ex.parse([put("n.1", "1", 1)])
        ex.parse([put("n.2", "2", 2)])
        ex.apply()
        self.assertEqual(ex.instance().applied, [fg.Put("n.2", "2", 2, 2)])

    def test_a_failed_apply_is_the_error_and_drops_the_batch(self):
        ex = self.export
        ex.parse([put("n.fail", "1", 1)])
        with self.assertRaises(Err) as e:
            ex.apply()
        self.assertEqual(e.exception.value, "fail")
        ex.apply()
        self.assertEqual(ex.instance().applied, [])

    def test_empty_batch_manifest_refused_init(self):
        ex = self.export
        self.assertEqual(ex.parse([]), [])
        ex.apply()
        m = ex.manifest()
        self.assertEqual((m.name, m.version, m.scope), ("recorder", "0.1.0", ["n.", "m."]))
        with self.assertRaises(Err) as e:
            ex.init([("refuse", "yes")])
        self.assertEqual(e.exception.value, "refused")

    def test_rest_strips_the_first_prefix_that_matches_and_an_empty_scope_is_everything(self):
        seen = []

        class Nested(fg.Folder):
            manifest = fg.Manifest("x", "1", ["a.", "a.b."])

            def parse(self, key, value, rest):
                seen.append(rest)
                return fg.accept(None)

            def apply(self, changes):
                pass

        fg.export(Nested)().parse([put("a.b.c", "", 1), put("a.x", "", 2), put("a.", "", 3)])
        self.assertEqual(seen, ["b.c", "x", ""])

        class Whole(Nested):
            manifest = fg.Manifest("y", "1")

        whole = fg.export(Whole)()
        self.assertEqual(whole.manifest().scope, [])
        self.assertEqual(whole.parse([put("anything", "", 1)]), [A])
        self.assertEqual(seen[-1], "anything")

    def test_parse_that_raises_or_returns_no_verdict_is_logged_and_raises(self):
        class Bad(fg.Folder):
            manifest = fg.Manifest("x", "1")

            def parse(self, key, value, rest):
                if key == "boom":
                    raise KeyError("kaput")
                return None

        ex = fg.export(Bad)()
        with self.assertRaises(KeyError):
            ex.parse([put("boom", "", 1)])
        with self.assertRaises(TypeError):
            ex.parse([put("other", "", 1)])
        self.assertEqual([level for level, _ in FAKE.logs], ["error", "error"])
        self.assertEqual(FAKE.logs[0][1], "parse raised on 'boom': kaput")

    def test_query_answers(self):
        class Q(fg.Folder):
            manifest = fg.Manifest("x", "1")

            def query(self, request):
                q = fg.text(request)
                if q == "bytes":
                    return b"\x01\x02"
                if q == "json":
                    return fg.json_bytes({"a": 'é"'})
                if q == "bad":
                    return 42
                if q == "error":
                    raise LookupError("no such thing")
                return f"hello {q}"

        ex = fg.export(Q)()
        self.assertEqual(ex.query(b"bytes"), b"\x01\x02")
        self.assertEqual(ex.query(b"json"), '{"a":"é\\""}'.encode())
        self.assertEqual(ex.query("é".encode()), "hello é".encode())
        for request, message in [(b"error", "no such thing"), (b"bad", "query returned int: return bytes or str")]:
            with self.assertRaises(Err) as e:
                ex.query(request)
            self.assertEqual(e.exception.value, message)

    def test_a_manifest_is_required(self):
        class NoManifest(fg.Folder):
            manifest = ("x", "1")

        with self.assertRaises(TypeError):
            fg.export(NoManifest)().manifest()

    def test_fold_get_scan_and_scan_all_pages_until_an_empty_page(self):
        for k in ["p.a", "p.b", "p.c", "p.d", "p.e", "q.a"]:
            FAKE.entries[k] = (k.encode(), 3)
        e = fg.fold.get("p.a")
        self.assertEqual((e.key, e.value, e.revision), ("p.a", b"p.a", 3))
        self.assertIsNone(fg.fold.get("nope"))
        self.assertEqual([e.key for e in fg.fold.scan("p.", start_after="p.b", limit=2)], ["p.c", "p.d"])
        FAKE.page_cap = 2  # the host caps a page below what was asked
        self.assertEqual([e.key for e in fg.fold.scan_all("p.", page_size=100)], ["p.a", "p.b", "p.c", "p.d", "p.e"])
        self.assertEqual(list(fg.fold.scan_all("none.")), [])

    def test_log_formats_its_arguments(self):
        fg.log.info("routes: %d, host %s, %r %%", 3, "h1", [1])
        fg.log.warn("plain %d")
        fg.log.log("debug", "%s and %s", "x")
        fg.log.error("n=%d", 2)
        self.assertEqual(FAKE.logs, [
            ("info", "routes: 3, host h1, [1] %"),
            ("warn", "plain %d"),
            ("debug", "%s and %s ('x',)"),
            ("error", "n=2"),
        ])
        with self.assertRaises(KeyError):
            fg.log.log("loud", "x")

    def test_text_and_json_decode_strictly_lossy_text_is_from_utf8_lossy(self):
        self.assertEqual(fg.parse_json(b'{"a":[1,null]}'), {"a": [1, None]})
        self.assertIsNone(fg.parse_json(b"{"))
        self.assertEqual(fg.parse_json(b"{", default=0), 0)
        self.assertIsNone(fg.parse_json(b'"\xff"'))
        self.assertIsNone(fg.parse_json(b"NaN"))
        self.assertIsNone(fg.parse_json(b"\xef\xbb\xbf1"))  # a BOM is not JSON whitespace
        self.assertIsNone(fg.parse_json("1".encode("utf-16")))
        self.assertEqual(fg.text(b"\xef\xbb\xbfa"), "\ufeffa")
        self.assertIsNone(fg.text(b"a\xff"))
        # One U+FFFD per maximal ill-formed subpart, as Rust's Utf8Chunks.
        self.assertEqual(fg.text(b"a\xf0\x80\x80\xe2\x82b", lossy=True), "a\ufffd\ufffd\ufffd\ufffdb")
        self.assertEqual(fg.json_bytes({"upstream": "a\u2028\x01"}), '{"upstream":"a\u2028\\u0001"}'.encode())


if __name__ == "__main__":
    unittest.main()
