"""Unit tests of router-py, natively with fake host imports (``build.sh test``). They mirror the
Rust router's tests (guests/router/src/lib.rs) and router-c's (guests/router-c/test_native.c),
which pin what serde_json makes of a value."""

import sys
import unittest
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "sdk" / "python"))

from fake_host import FAKE  # noqa: E402  (first: it provides wit_world)

from componentize_py_types import Err  # noqa: E402
from wit_world.imports.types import Op, Update, Verdict  # noqa: E402

import router  # noqa: E402

ROUTES = [
    (b'{"upstream": "10.0.0.1:80", "extra": 1}', "10.0.0.1:80"),
    (b' \t\r\n{ "a" : [1, -2.5e+3, 0, 0.0, 1E9, true, false, null, {}, [], {"b": ["c"]}], "upstream" : "x" } \n', "x"),
    (b'{"upstream":"x","z":{"y":{"x":[[[]]]}}}', "x"),
    (b'{"skip":"\\ud800 lone surrogate and \xff bad UTF-8 are fine when ignored","upstream":"x"}', "x"),
    (b'{"upstr\\u0065am":"x"}', "x"),  # keys are compared decoded
    (b'["10.0.0.1:80"]', "10.0.0.1:80"),  # serde's struct-as-sequence form
    (b' [ "x" ] ', "x"),
    (b'{"upstream":"\\"\\\\\\/\\b\\f\\n\\r\\t"}', '"\\/\b\f\n\r\t'),
    (b'{"upstream":"\\u0041\\u00e9\\u20AC\\ud83d\\ude00"}', "Aé€😀"),
    (b'{"upstream":"a\\u0000b"}', "a\0b"),
    ('{"upstream":"é€😀\x7f"}'.encode(), "é€😀\x7f"),
]

REFUSED = [
    b"not json", b"{}", b'{"upstream": 7}', b'{"upstream": ""}', b"",
    b'{"upstream":"x","a":[1,]}', b'{"upstream":"x","a":{"b":1,}}', b'{"upstream":"x","a":01}',
    b'{"upstream":"x","a":1.}', b'{"upstream":"x","a":1e}', b'{"upstream":"x","a":-}',
    b'{"upstream":"x","a":+1}', b'{"upstream":"x","a":tru}', b'{"upstream":"x","a":[1 2]}',
    b'{"upstream":"x","a":{1:2}}', b'{"upstream":"x","a":[}', b'{"upstream":"x","a":"\\x"}',
    b'{"upstream":"x","a":"\\u12"}', b'{"upstream":"x","a":"tab\there"}', b'{"upstream":"x","a":}',
    b'{"upstream":"x","a":NaN}', b'{"upstream":"x","a":Infinity}',
    b'{"upstream":"x",}', b'{,"upstream":"x"}', b'{"upstream":"x" "a":1}', b'{"upstream" "x"}',
    b'{"upstream":"x"', b'{"upstream":"x"}}', b'{"upstream":"x"} x', b'{"upstream":"a","upstream":"b"}',
    b'{"upstream":null}', b'{"upstream":["x"]}', b'{"Upstream":"x"}', b'{"upstream ":"x"}', b'"x"', b"null",
    b'{"upstream":"a","upstr\\u0065am":"b"}', b'{"k\\ud800":1,"upstream":"x"}', b'{"k\xff":1,"upstream":"x"}',
    b"[]", b'["x",]', b'["x",1]', b"[1]",
    b'{"upstream":"\\ud83d"}', b'{"upstream":"\\ud83dx"}', b'{"upstream":"\\ud83d\\n"}',
    b'{"upstream":"\\ud83d\\u0041"}', b'{"upstream":"\\ude00"}', b'{"upstream":"\\u00g0"}',
    b'{"upstream":"\\u00"}', b'{"upstream":"\\"}', b'{"upstream":"\\', b'{"upstream":"\\a"}',
    b'{"upstream":"\xff"}', b'{"upstream":"\xc0\xaf"}', b'{"upstream":"\xed\xa0\x80"}',
    b'{"upstream":"\xf4\x90\x80\x80"}', b'{"upstream":"\xe2\x82"}', b'{"upstream":"a\nb"}',
    b'{"upstream":"x', b'\xef\xbb\xbf{"upstream":"x"}',
]


def put(key, value, revision=1):
    return Update(key, value.encode() if isinstance(value, str) else value, revision, Op.PUT)


class RouterTest(unittest.TestCase):
    def setUp(self):
        FAKE.reset()
        # A fresh router per test: the export class made anew, so its own runtime.
        self.ex = router.fg.export(router.Router)()

    def query(self, host):
        try:
            return self.ex.query(host.encode() if isinstance(host, str) else host).decode()
        except Err as e:
            return f"error: {e.value}"

    def test_values_serde_json_decodes_and_those_it_refuses(self):
        for value, upstream in ROUTES:
            self.assertEqual(router.decode_route(value), upstream, value)
        for value in REFUSED:
            self.assertIsNone(router.decode_route(value), value)

    def test_any_nesting_depth_in_a_skipped_value(self):
        depth = 100_000
        deep = b'{"a":' + b"[" * depth + b"]" * depth + b',"upstream":"deep"}'
        self.assertEqual(router.decode_route(deep), "deep")
        mismatched = deep[: 5 + depth] + b"}" + deep[6 + depth :]
        self.assertIsNone(router.decode_route(mismatched))

    def test_fold_and_query_as_the_rust_router(self):
        m = self.ex.manifest()
        self.assertEqual((m.name, m.version, m.scope), ("router-py", "0.1.0", ["route."]))
        A, S = Verdict.ACCEPT, Verdict.SKIP
        verdicts = self.ex.parse([
            put("route.a", '{"upstream":"1:80"}'),
            put("route.b", '{"upstream":"2:80"}'),
            put("route.", '{"upstream":"empty host"}'),
            put("other.c", '{"upstream":"3:80"}'),
        ])
        self.assertEqual(verdicts, [A, A, S, S])
        self.ex.apply()
        self.assertEqual(self.query("a"), '{"upstream":"1:80"}')
        self.assertEqual(self.query(""), "error: unknown host: ")

        self.ex.parse([Update("route.a", b"", 2, Op.DELETE), put("route.b", '{"upstream":"3\\"x"}', 3)])
        self.ex.apply()
        self.assertEqual(self.query("a"), "error: unknown host: a")
        self.assertEqual(self.query("b"), '{"upstream":"3\\"x"}')

        # A value that is not a route removes the route: the running router agrees with a rebuilt one.
        self.assertEqual(self.ex.parse([put("route.b", '{"upstream":""}', 4)]), [A])
        self.ex.apply()
        self.assertEqual(self.query("b"), "error: unknown host: b")

    def test_answers_are_escaped_as_serde_json_and_queries_read_lossily(self):
        self.ex.parse([put("route.c", '{"upstream":"\\u0001\\u001f\\u007f\\u2028é/"}')])
        self.ex.apply()
        self.assertEqual(self.query("c"), '{"upstream":"\\u0001\\u001f\x7f\u2028é/"}')
        self.assertEqual(self.query(b"c\xff"), "error: unknown host: c\ufffd")
        self.assertEqual(self.query(b"\xef\xbb\xbfc"), "error: unknown host: \ufeffc")


class FastPath(unittest.TestCase):
    def test_the_fast_path_decides_every_value_exactly_as_the_full_reader_does(self):
        # Values near the fast path's edges (whitespace, escapes, controls, other keys, a BOM,
        # bytes that are not UTF-8, the array form), assembled from pieces by a seeded generator.
        import random

        pieces = [" ", "\t", "\n", "\r", "\u00a0", "\ufeff", "{", "}", "[", "]", ":", ",", '"',
                  "\\", '\\"', "\\u0041", "\\ud800", '"upstream"', '"up"', "upstream",
                  "10.0.0.1:80", "é", "😀", "\u0001", "\u007f", "null", "1", '"x"']
        rng = random.Random(42)
        fast = 0
        for i in range(20000):
            text = '{"upstream":"' if i % 2 == 0 else ""
            text += "".join(rng.choice(pieces) for _ in range(rng.randrange(8)))
            if i % 2 == 0:
                text += '"}'
            data = text.encode("utf-8")
            if rng.randrange(10) == 0:
                data += b"\xff"
            want = router.decode_route_fully(data)
            self.assertEqual(router.decode_route(data), want, repr(data))
            if want is not None and "\\" not in text:
                fast += 1
        self.assertGreater(fast, 100)


if __name__ == "__main__":
    unittest.main()
