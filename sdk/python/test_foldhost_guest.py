"""Unit tests of the Python SDK, natively with fake host imports (see fake_host.py). They mirror the
Rust SDK's (sdk/rust/src/__private.rs): the same batches give the same verdicts and changes.

The bindings are contract 0.1.0's unless ``FOLDHOST_WIT`` names another WIT (fake_host.py): a run
under 0.1.0 runs the 0.1.0 tests, then this file again under 0.3.0's bindings in a subprocess
(``OtherContractTest``), which runs the state-bucket tests (``StateTest``). The tests of what
does not depend on the contract (``CommonTest``) run under both."""

import os
import subprocess
import sys
import unittest
from pathlib import Path

from fake_host import FAKE, WIT, pack  # first: it provides wit_world

import foldhost_guest as fg
from componentize_py_types import Err
from wit_world.imports import types
from wit_world.imports.types import Op, Verdict

A, S, D = Verdict.ACCEPT, Verdict.SKIP, Verdict.DEFER
V1 = fg.CONTRACT == "0.1.0"
V3 = fg.CONTRACT == "0.3.0"


def put(key, value, revision):
    return types.Update(key, value.encode(), revision, Op.PUT)


def gone(key, op, revision):
    return types.Update(key, b"", revision, op)


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


@unittest.skipUnless(V1, "contract 0.1.0's bindings")
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

    def test_state_needs_contract_0_3_0(self):
        self.assertEqual(fg.CONTRACT, "0.1.0")
        with self.assertRaises(RuntimeError) as e:
            fg.state.get("counts", "total")
        self.assertIn("contract 0.3.0", str(e.exception))

        class Stateful(fg.Folder):
            manifest = fg.Manifest("x", "1", state=[fg.StateBucket("counts")])

        class Reader(fg.Folder):
            manifest = fg.Manifest("x", "1", reads=["catalog.items"])

        for cls in (Stateful, Reader):
            with self.assertRaises(TypeError) as e:
                fg.export(cls)
            self.assertIn("declares state buckets against contract 0.1.0", str(e.exception))


class CommonTest(unittest.TestCase):
    """What does not depend on the contract: run under both."""

    def setUp(self):
        FAKE.reset()

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


# ---- Contract 0.3.0 --------------------------------------------------------------------------------


class Stateful(fg.Folder):
    """Owns ``counts``, reads ``catalog.items``; records every call."""

    manifest = fg.Manifest(
        "stateful", "0.3.0", ["n."],
        state=[fg.StateBucket("counts"), fg.StateBucket("log", history=5, max_age_ms=60_000, max_bytes=1 << 20, per_key_ttl=True)],
        reads=["catalog.items"],
    )

    def __init__(self):
        self.events = []

    def parse(self, key, value, rest):
        return fg.accept(int(value)) if value.isdigit() else fg.SKIP

    def apply(self, changes):
        self.events.append(("apply", changes))

    def apply_state(self, bucket, changes):
        if any(c.key == "fail" for c in changes):
            raise RuntimeError(f"{bucket} failed")
        self.events.append(("apply_state", bucket, changes))

    def end_of_current(self, bucket):
        self.events.append(("end_of_current", bucket))

    def on_applied(self, cursor):
        self.events.append(("on_applied", cursor))
        fg.state.put("counts", "cursor", str(cursor))

    def on_state_applied(self, bucket, cursor):
        self.events.append(("on_state_applied", bucket, cursor))

    def query(self, request):
        verb, _, arg = fg.text(request).partition(" ")
        if verb == "get":
            bucket, _, key = arg.partition("/")
            entry = fg.state.get(bucket, key)
            return b"none" if entry is None else entry.value
        if verb == "put":
            bucket, _, key = arg.partition("/")
            return fg.state.put(bucket, key, b"q").outcome
        raise LookupError(verb)


@unittest.skipUnless(V3, "contract 0.3.0's bindings")
class StateTest(unittest.TestCase):
    def setUp(self):
        FAKE.reset()
        FAKE.declare(Stateful.manifest)
        self.export = fg.export(Stateful)()

    def test_the_contract_is_the_bindings(self):
        self.assertEqual(fg.CONTRACT, "0.3.0")
        self.assertEqual(self.export.__class__.__name__, "StatefulExport")

    def test_the_manifest_declares_owned_and_read_buckets(self):
        m = self.export.manifest()
        self.assertEqual((m.name, m.version, m.scope, m.reads), ("stateful", "0.3.0", ["n."], ["catalog.items"]))
        self.assertEqual(m.state, [
            types.StateBucket("counts", 1, 0, 0, False),
            types.StateBucket("log", 5, 60_000, 1 << 20, True),
        ])

    def test_a_0_1_0_folder_builds_unchanged_and_sees_the_main_bucket_as_under_0_1_0(self):
        ex = fg.export(Recorder)()
        m = ex.manifest()
        self.assertEqual((m.name, m.scope, m.state, m.reads), ("recorder", ["n.", "m."], [], []))
        verdicts = ex.parse("", pack([
            ("n.1", "7", 1), ("out.1", "7", 2), ("n.bad", "x", 3), ("n.2", None, 4, "delete"),
            ("out.2", None, 5, "purge"), ("m.3", None, 6, "purge"), ("n.defer", "1", 7), ("m.4", "9", 8),
        ]))
        self.assertEqual(verdicts, [A, S, S, A, S, A, D, A])
        ex.apply()
        self.assertEqual(ex.instance().applied, [
            fg.Put("n.1", "1", 1, 7), fg.Delete("n.2", "2", 4), fg.Delete("m.3", "3", 6), fg.Put("m.4", "4", 8, 9),
        ])
        # Its on_applied is the main bucket's; the defaults of the others do nothing.
        ex.on_applied("", 8)
        ex.on_applied("counts", 9)
        ex.end_of_current("")
        ex.parse("counts", pack([("k", "v", 1)]))
        ex.apply()
        self.assertEqual(ex.instance().cursor, 8)
        self.assertEqual(ex.parse("", b""), [])

    def test_batches_are_tagged_with_their_bucket(self):
        ex = self.export
        rec = ex.instance()
        verdicts = ex.parse("catalog.items", pack([
            ("apple", b"\xffred", 3), ("pear", None, 4, "delete"), ("plum", "x", 5, "purge"), ("", "", 6),
        ]))
        self.assertEqual(verdicts, [A, A, A, A])
        ex.apply()
        self.assertEqual(rec.events, [("apply_state", "catalog.items", [
            fg.Put("apple", "apple", 3, b"\xffred"), fg.Delete("pear", "pear", 4),
            fg.Delete("plum", "plum", 5), fg.Put("", "", 6, b""),
        ])])
        # The main bucket: scope, parse and apply as in 0.1.0.
        self.assertEqual(ex.parse("", pack([("n.a", "1", 7), ("x.a", "1", 8), ("n.b", "no", 9)])), [A, S, S])
        ex.apply()
        self.assertEqual(rec.events[-1], ("apply", [fg.Put("n.a", "a", 7, 1)]))
        # A second parse replaces what the first accepted, its bucket too.
        ex.parse("counts", pack([("k", "v", 1)]))
        ex.parse("", pack([("n.c", "3", 10)]))
        ex.apply()
        self.assertEqual(rec.events[-1], ("apply", [fg.Put("n.c", "c", 10, 3)]))
        # A failed apply_state is apply's error and drops the batch.
        ex.parse("counts", pack([("fail", "v", 2)]))
        with self.assertRaises(Err) as e:
            ex.apply()
        self.assertEqual(e.exception.value, "counts failed")
        ex.apply()
        self.assertEqual(rec.events[-1], ("apply_state", "counts", []))

    def test_end_of_current_and_on_applied_name_their_bucket(self):
        ex = self.export
        ex.end_of_current("")
        ex.end_of_current("catalog.items")
        ex.on_applied("catalog.items", 6)
        ex.on_applied("", 41)
        self.assertEqual(ex.instance().events, [
            ("end_of_current", ""), ("end_of_current", "catalog.items"),
            ("on_state_applied", "catalog.items", 6), ("on_applied", 41),
        ])
        # The main bucket's on_applied wrote the cursor into the owned bucket.
        (verb, bucket, key, value, options), = FAKE.writes
        self.assertEqual((verb, bucket, key, value), ("put", "counts", "cursor", b"41"))
        self.assertEqual((options.op_id, options.if_revision, options.wait_ms, options.ttl_ms), (None, None, 0, None))
        self.assertEqual(ex.query(b"get counts/cursor"), b"41")

    def test_the_verbs_read_and_write_declared_buckets(self):
        FAKE.packed("catalog.items", [("b", "2", 2), ("a", "1", 1), ("c", "3", 3), ("x", "9", 4)])
        e = fg.state.get("catalog.items", "a")
        self.assertEqual((e.key, e.value, e.revision), ("a", b"1", 1))
        self.assertIsNone(fg.state.get("counts", "nope"))
        self.assertEqual(fg.state.keys("catalog.items"), ["a", "b", "c", "x"])
        self.assertEqual(fg.state.keys("catalog.items", "", start_after="a", limit=2), ["b", "c"])
        FAKE.page_cap = 1
        self.assertEqual(list(fg.state.keys_all("catalog.items", page_size=100)), ["a", "b", "c", "x"])
        self.assertEqual(list(fg.state.keys_all("counts")), [])

        w = fg.state.put("counts", "k", "é", op_id="op-1", if_revision=0)
        self.assertEqual(w, fg.Written("applied", "op-1", 1))
        self.assertEqual(fg.state.get("counts", "k").value, "é".encode())
        w = fg.state.put("counts", "k", b"v2", if_revision=1, wait_ms=50, ttl_ms=1000)
        self.assertEqual((w.outcome, w.revision), ("applied", 2))
        options = FAKE.writes[-1][-1]
        self.assertEqual((options.if_revision, options.wait_ms, options.ttl_ms), (1, 50, 1000))
        self.assertEqual(fg.state.delete("counts", "k", op_id="op-3").op_id, "op-3")
        self.assertIsNone(fg.state.get("counts", "k"))
        self.assertEqual([w[:3] for w in FAKE.writes], [("put", "counts", "k"), ("put", "counts", "k"), ("delete", "counts", "k")])

    def test_a_refusal_raises_refused_with_its_reason_and_message(self):
        cases = [
            (lambda: fg.state.get("other.bucket", "k"), "undeclared"),
            (lambda: fg.state.keys("nope"), "undeclared"),
            (lambda: fg.state.put("catalog.items", "k", b"v"), "read_only"),
            (lambda: fg.state.delete("catalog.items", "k"), "read_only"),
            (lambda: fg.state.put("counts", "k", b"v", if_revision=7), "conflict"),
        ]
        for call, reason in cases:
            with self.assertRaises(fg.Refused) as e:
                call()
            self.assertEqual(e.exception.reason, reason)
            self.assertTrue(e.exception.message)
            self.assertEqual(str(e.exception), f"refused ({reason}): {e.exception.message}")
        FAKE.refuse = lambda verb, bucket, key: ("bucket_full", "counts would pass its max bytes") if verb == "put" else None
        with self.assertRaises(fg.Refused) as e:
            fg.state.put("counts", "k", b"v")
        self.assertEqual((e.exception.reason, e.exception.message), ("bucket_full", "counts would pass its max bytes"))
        self.assertEqual(FAKE.writes, [])
        # Out of a query: the error answer. Out of on_applied: logged, then it traps.
        with self.assertRaises(Err) as e:
            self.export.query(b"put counts/k")
        self.assertEqual(e.exception.value, "refused (bucket_full): counts would pass its max bytes")
        with self.assertRaises(fg.Refused):
            self.export.on_applied("", 3)
        self.assertEqual(FAKE.logs[-1], ("error", "on_applied('') raised: refused (bucket_full): counts would pass its max bytes"))
        self.assertEqual(fg.state.delete("counts", "k").outcome, "applied")  # only puts refused

    def test_a_malformed_batch_is_logged_and_raises(self):
        good = pack([("k", "v", 1)])
        for batch in [good[:10], good[:-1], good[:16] + b"\x03" + good[17:], pack([("k", "v", 1)]).replace(b"k", b"\xff")]:
            with self.assertRaises(ValueError):
                self.export.parse("", batch)
        self.assertEqual([level for level, _ in FAKE.logs], ["error"] * 4)
        self.assertEqual(FAKE.logs[0][1], "parse of bucket '': packed batch torn at byte 0: a header needs 17 bytes")

    def test_end_of_current_that_raises_is_logged_and_raises(self):
        class Bad(fg.Folder):
            manifest = fg.Manifest("x", "1")

            def end_of_current(self, bucket):
                raise KeyError("kaput")

        with self.assertRaises(KeyError):
            fg.export(Bad)().end_of_current("")
        self.assertEqual(FAKE.logs, [("error", "end_of_current('') raised: kaput")])

    def test_state_and_reads_must_be_declared_with_their_types(self):
        class Loose(fg.Folder):
            manifest = fg.Manifest("x", "1", state=["counts"])

        class Loose2(fg.Folder):
            manifest = fg.Manifest("x", "1", reads=[("catalog", "items")])

        for cls in (Loose, Loose2):
            with self.assertRaises(TypeError):
                fg.export(cls)().manifest()


@unittest.skipUnless(V1 and "FOLDHOST_WIT" not in os.environ, "the run under 0.1.0's bindings")
class OtherContractTest(unittest.TestCase):
    def test_this_file_under_contract_0_3_0s_bindings(self):
        here = Path(__file__).resolve().parent
        env = dict(os.environ, FOLDHOST_WIT=str(WIT / "v0.3.0"), PYTHONDONTWRITEBYTECODE="1")
        run = subprocess.run(
            [sys.executable, "-m", "unittest", "-v", "test_foldhost_guest"],
            cwd=here, env=env, capture_output=True, text=True,
        )
        self.assertEqual(run.returncode, 0, run.stderr)
        self.assertIn("test_batches_are_tagged_with_their_bucket (test_foldhost_guest.StateTest", run.stderr)
        self.assertNotIn("FAIL", run.stderr)


if __name__ == "__main__":
    unittest.main()
