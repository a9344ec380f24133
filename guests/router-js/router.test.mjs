// Unit tests of router-js under Node with fake host imports (`build.sh test`). They mirror the Rust
// router's tests (guests/router/src/lib.rs) and router-c's (guests/router-c/test_native.c), which
// pin what serde_json makes of a value.
import assert from 'node:assert/strict';
import { test } from 'node:test';

import { decodeRoute, decodeRouteFully, folder } from './router.js';

const enc = new TextEncoder();
/** A value from a string whose code points below 0x100 are bytes (so '\xff' is the byte 0xff). */
const raw = (s) => Uint8Array.from(s, (c) => c.charCodeAt(0));
const utf8 = (s) => enc.encode(s);
const dec = (b) => new TextDecoder().decode(b);

test('values serde_json decodes into a Route, and those it refuses', () => {
  const routes = [
    ['{"upstream": "10.0.0.1:80", "extra": 1}', '10.0.0.1:80'],
    [' \t\r\n{ "a" : [1, -2.5e+3, 0, 0.0, 1E9, true, false, null, {}, [], {"b": ["c"]}], "upstream" : "x" } \n', 'x'],
    ['{"upstream":"x","z":{"y":{"x":[[[]]]}}}', 'x'],
    ['{"skip":"\\ud800 lone surrogate and \xff bad UTF-8 are fine when ignored","upstream":"x"}', 'x'],
    ['{"upstr\\u0065am":"x"}', 'x'], // keys are compared decoded
    ['["10.0.0.1:80"]', '10.0.0.1:80'], // serde's struct-as-sequence form
    [' [ "x" ] ', 'x'],
    ['{"upstream":"\\"\\\\\\/\\b\\f\\n\\r\\t"}', '"\\/\b\f\n\r\t'],
    ['{"upstream":"\\u0041\\u00e9\\u20AC\\ud83d\\ude00"}', 'Aé€😀'],
    ['{"upstream":"a\\u0000b"}', 'a\0b'],
  ];
  for (const [value, upstream] of routes) assert.equal(decodeRoute(raw(value)), upstream, value);
  assert.equal(decodeRoute(utf8('{"upstream":"é€😀\x7f"}')), 'é€😀\x7f');

  const refused = [
    'not json', '{}', '{"upstream": 7}', '{"upstream": ""}', '',
    '{"upstream":"x","a":[1,]}', '{"upstream":"x","a":{"b":1,}}', '{"upstream":"x","a":01}',
    '{"upstream":"x","a":1.}', '{"upstream":"x","a":1e}', '{"upstream":"x","a":-}',
    '{"upstream":"x","a":+1}', '{"upstream":"x","a":tru}', '{"upstream":"x","a":[1 2]}',
    '{"upstream":"x","a":{1:2}}', '{"upstream":"x","a":[}', '{"upstream":"x","a":"\\x"}',
    '{"upstream":"x","a":"\\u12"}', '{"upstream":"x","a":"tab\there"}', '{"upstream":"x","a":}',
    '{"upstream":"x","a":NaN}',
    '{"upstream":"x",}', '{,"upstream":"x"}', '{"upstream":"x" "a":1}', '{"upstream" "x"}',
    '{"upstream":"x"', '{"upstream":"x"}}', '{"upstream":"x"} x', '{"upstream":"a","upstream":"b"}',
    '{"upstream":null}', '{"upstream":["x"]}', '{"Upstream":"x"}', '{"upstream ":"x"}', '"x"', 'null',
    '{"upstream":"a","upstr\\u0065am":"b"}', '{"k\\ud800":1,"upstream":"x"}', '{"k\xff":1,"upstream":"x"}',
    '[]', '["x",]', '["x",1]', '[1]',
    '{"upstream":"\\ud83d"}', '{"upstream":"\\ud83dx"}', '{"upstream":"\\ud83d\\n"}',
    '{"upstream":"\\ud83d\\u0041"}', '{"upstream":"\\ude00"}', '{"upstream":"\\u00g0"}',
    '{"upstream":"\\u00"}', '{"upstream":"\\"}', '{"upstream":"\\', '{"upstream":"\\a"}',
    '{"upstream":"\xff"}', '{"upstream":"\xc0\xaf"}', '{"upstream":"\xed\xa0\x80"}',
    '{"upstream":"\xf4\x90\x80\x80"}', '{"upstream":"\xe2\x82"}', '{"upstream":"a\nb"}',
    '{"upstream":"x', '\xef\xbb\xbf{"upstream":"x"}',
  ];
  for (const value of refused) assert.equal(decodeRoute(raw(value)), null, value);
});

test('any nesting depth in a skipped value', () => {
  const depth = 100_000;
  const deep = `{"a":${'['.repeat(depth)}${']'.repeat(depth)},"upstream":"deep"}`;
  assert.equal(decodeRoute(utf8(deep)), 'deep');
  const mismatched = deep.slice(0, 5 + depth) + '}' + deep.slice(6 + depth);
  assert.equal(decodeRoute(utf8(mismatched)), null);
});

const put = (key, value, revision = 1) => ({ key, value: utf8(value), revision: BigInt(revision), op: 'put' });
const query = (host) => {
  try {
    return dec(folder.query(typeof host === 'string' ? utf8(host) : host));
  } catch (e) {
    return `error: ${e}`;
  }
};

test('fold and query, as the Rust router', () => {
  assert.deepEqual(folder.manifest(), { name: 'router-js', version: '0.1.0', scope: ['route.'] });
  assert.deepEqual(
    folder.parse([
      put('route.a', '{"upstream":"1:80"}'),
      put('route.b', '{"upstream":"2:80"}'),
      put('route.', '{"upstream":"empty host"}'),
      put('other.c', '{"upstream":"3:80"}'),
    ]),
    ['accept', 'accept', 'skip', 'skip'],
  );
  folder.apply();
  assert.equal(query('a'), '{"upstream":"1:80"}');
  assert.equal(query(''), 'error: unknown host: ');

  folder.parse([
    { key: 'route.a', value: new Uint8Array(), revision: 2n, op: 'delete' },
    put('route.b', '{"upstream":"3\\"x"}', 3),
  ]);
  folder.apply();
  assert.equal(query('a'), 'error: unknown host: a');
  assert.equal(query('b'), '{"upstream":"3\\"x"}');

  // A value that is not a route removes the route: the running router agrees with a rebuilt one.
  assert.deepEqual(folder.parse([put('route.b', '{"upstream":""}', 4)]), ['accept']);
  folder.apply();
  assert.equal(query('b'), 'error: unknown host: b');
});

test('answers are escaped as serde_json escapes them; queries are read lossily', () => {
  folder.parse([put('route.c', '{"upstream":"\\u0001\\u001f\\u007f\\u2028é/"}')]);
  folder.apply();
  assert.equal(query('c'), '{"upstream":"\\u0001\\u001f\x7f\u2028é/"}');
  assert.equal(query(new Uint8Array([0x63, 0xff])), 'error: unknown host: c\ufffd');
  assert.equal(query(new Uint8Array([0xef, 0xbb, 0xbf, 0x63])), 'error: unknown host: \ufeffc');
});

test('the fast path decides every value exactly as the full reader does', () => {
  // Values near the fast path's edges (whitespace, escapes, controls, other keys, a BOM, bytes
  // that are not UTF-8, the array form), assembled from pieces by a seeded generator.
  const pieces = [
    ' ', '\t', '\n', '\r', '\u00a0', '\ufeff', '{', '}', '[', ']', ':', ',', '"', '\\', '\\"',
    '\\u0041', '\\ud800', '"upstream"', '"up"', 'upstream', '10.0.0.1:80', 'é', '😀', '\u0001',
    '\u007f', 'null', '1', '"x"',
  ];
  const enc = new TextEncoder();
  let seed = 42;
  const next = (n) => {
    seed = (seed * 1103515245 + 12345) % 2147483648;
    return seed % n;
  };
  let fast = 0;
  for (let i = 0; i < 20000; i++) {
    let text = i % 2 === 0 ? '{"upstream":"' : '';
    for (let j = next(8); j > 0; j--) text += pieces[next(pieces.length)];
    if (i % 2 === 0) text += '"}';
    let bytes = enc.encode(text);
    if (next(10) === 0) bytes = Uint8Array.from([...bytes, 0xff]);
    const want = decodeRouteFully(bytes);
    assert.equal(decodeRoute(bytes), want, JSON.stringify(text));
    if (want !== null && !text.includes('\\')) fast++;
  }
  assert.ok(fast > 10, `the fast path was taken (${fast})`);
});
