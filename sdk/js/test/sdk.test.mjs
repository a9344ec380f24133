// Unit tests of the JS SDK, under Node with fake host imports (see fake-host.mjs). They mirror the
// Rust SDK's (sdk/rust/src/__private.rs): the same batches give the same verdicts and changes.
import assert from 'node:assert/strict';
import { beforeEach, test } from 'node:test';

import { DEFER, SKIP, accept, exportFolder, fold, format, json, log, text } from '../foldhost-guest.js';

const fake = globalThis.foldhostFake;
const bytes = (s) => new TextEncoder().encode(s);
const put = (key, value, revision) => ({ key, value: bytes(value), revision: BigInt(revision), op: 'put' });
const del = (key, op, revision) => ({ key, value: new Uint8Array(), revision: BigInt(revision), op });

beforeEach(() => {
  fake.entries.clear();
  fake.logs.length = 0;
  fake.pageCap = 10_000;
});

/** A folder like the Rust tests' Recorder: numbers under n. and m. */
function recorder() {
  const state = { applied: [], cursor: 0, config: null };
  const folder = exportFolder({
    manifest: { name: 'recorder', version: '0.1.0', scope: ['n.', 'm.'] },
    init(config) {
      if (config.get('refuse')) throw new Error('refused');
      state.config = config;
    },
    parse(key, value) {
      if (key === 'n.defer') return DEFER;
      const n = Number(text(value));
      return Number.isInteger(n) && text(value) !== '' ? accept(n) : SKIP;
    },
    apply(changes) {
      if (changes.some((c) => c.key === 'n.fail')) throw 'fail';
      state.applied.push(...changes);
    },
    onApplied(cursor) {
      state.cursor = cursor;
    },
  });
  return { folder, state };
}

test('parse then apply, in order', () => {
  const { folder, state } = recorder();
  folder.init([['a', 'b']]);
  assert.deepEqual([...state.config], [['a', 'b']]);
  const verdicts = folder.parse([
    put('n.1', '7', 1),
    put('out.1', '7', 2),
    put('n.bad', 'x', 3),
    del('n.2', 'delete', 4),
    del('out.2', 'purge', 5),
    del('m.3', 'purge', 6),
    put('n.defer', '1', 7),
    put('m.4', '9', 8),
  ]);
  assert.deepEqual(verdicts, ['accept', 'skip', 'skip', 'accept', 'skip', 'accept', 'defer', 'accept']);
  folder.apply();
  assert.deepEqual(state.applied, [
    { op: 'put', key: 'n.1', rest: '1', revision: 1, value: 7 },
    { op: 'delete', key: 'n.2', rest: '2', revision: 4 },
    { op: 'delete', key: 'm.3', rest: '3', revision: 6 },
    { op: 'put', key: 'm.4', rest: '4', revision: 8, value: 9 },
  ]);
  // Applied changes are forgotten: a second apply applies nothing.
  folder.apply();
  assert.equal(state.applied.length, 4);
  folder.onApplied(8n);
  assert.equal(state.cursor, 8);
  assert.throws(() => folder.query(bytes('x')), (e) => e === 'this guest answers no queries');
});

test('a new parse replaces values not applied', () => {
  const { folder, state } = recorder();
  folder.parse([put('n.1', '1', 1)]);
  folder.parse([put('n.2', '2', 2)]);
  folder.apply();
  assert.deepEqual(state.applied, [{ op: 'put', key: 'n.2', rest: '2', revision: 2, value: 2 }]);
});

test('a failed apply is the error string and drops the batch', () => {
  const { folder, state } = recorder();
  folder.parse([put('n.fail', '1', 1)]);
  assert.throws(() => folder.apply(), (e) => e === 'fail');
  folder.apply();
  assert.deepEqual(state.applied, []);
});

test('an empty batch, the manifest, a refused init', () => {
  const { folder, state } = recorder();
  assert.deepEqual(folder.parse([]), []);
  folder.apply();
  assert.deepEqual(state.applied, []);
  assert.deepEqual(folder.manifest(), { name: 'recorder', version: '0.1.0', scope: ['n.', 'm.'] });
  assert.throws(() => folder.init([['refuse', 'yes']]), (e) => e === 'refused');
});

test('rest strips the first scope prefix that matches; an empty scope is the whole bucket', () => {
  const seen = [];
  const folder = exportFolder({
    manifest: { name: 'x', version: '1', scope: ['a.', 'a.b.'] },
    parse: (key, value, rest) => (seen.push(rest), accept(null)),
    apply: () => {},
  });
  folder.parse([put('a.b.c', '', 1), put('a.x', '', 2), put('a.', '', 3)]);
  assert.deepEqual(seen, ['b.c', 'x', '']);

  const all = exportFolder({
    manifest: { name: 'y', version: '1' },
    parse: (key, value, rest) => (seen.push(rest), SKIP),
    apply: () => {},
  });
  assert.deepEqual(all.manifest().scope, []);
  assert.deepEqual(all.parse([put('anything', '', 1)]), ['skip']);
  assert.equal(seen.at(-1), 'anything');
});

test('parse that throws or returns no verdict is logged and traps', () => {
  const folder = exportFolder({
    manifest: { name: 'x', version: '1' },
    parse: (key) => {
      if (key === 'boom') throw new Error('kaput');
      return undefined;
    },
    apply: () => {},
  });
  assert.throws(() => folder.parse([put('boom', '', 1)]), /kaput/);
  assert.throws(() => folder.parse([put('other', '', 1)]), TypeError);
  assert.deepEqual(
    fake.logs.map(([level]) => level),
    ['error', 'error'],
  );
  assert.match(fake.logs[0][1], /parse threw on "boom": kaput/);
});

test('query answers: bytes as they are, a string as UTF-8, a throw as the error', () => {
  const folder = exportFolder({
    manifest: { name: 'x', version: '1' },
    parse: () => SKIP,
    apply: () => {},
    query(request) {
      const q = text(request);
      if (q === 'bytes') return new Uint8Array([1, 2]);
      if (q === 'json') return json.bytes({ a: 'é"' });
      if (q === 'bad') return 42;
      if (q === 'error') throw new Error('no such thing');
      return `hello ${q}`;
    },
  });
  assert.deepEqual(folder.query(bytes('bytes')), new Uint8Array([1, 2]));
  assert.equal(text(folder.query(bytes('json'))), '{"a":"é\\""}');
  assert.equal(text(folder.query(bytes('é'))), 'hello é');
  assert.throws(() => folder.query(bytes('error')), (e) => e === 'no such thing');
  assert.throws(() => folder.query(bytes('bad')), (e) => typeof e === 'string' && /Uint8Array/.test(e));
});

test('exportFolder refuses an incomplete guest', () => {
  assert.throws(() => exportFolder({ parse() {}, apply() {} }), TypeError);
  assert.throws(() => exportFolder({ manifest: { name: 'x', version: '1' }, parse() {} }), TypeError);
});

test('fold.get and fold.scan read the committed fold; scanAll pages until an empty page', () => {
  for (const k of ['p.a', 'p.b', 'p.c', 'p.d', 'p.e', 'q.a']) fake.entries.set(k, { value: bytes(k), revision: 3 });
  assert.deepEqual(fold.get('p.a'), { key: 'p.a', value: bytes('p.a'), revision: 3 });
  assert.equal(fold.get('nope'), undefined);
  assert.deepEqual(
    fold.scan('p.', { startAfter: 'p.b', limit: 2 }).map((e) => e.key),
    ['p.c', 'p.d'],
  );
  fake.pageCap = 2; // the host caps a page below what was asked
  assert.deepEqual(
    [...fold.scanAll('p.', { pageSize: 100 })].map((e) => e.key),
    ['p.a', 'p.b', 'p.c', 'p.d', 'p.e'],
  );
  assert.deepEqual([...fold.scanAll('none.')], []);
});

test('log formats its arguments', () => {
  log.info('routes: %d, host %s, %j %% %i', 3, 'h1', { a: [1] }, 7.9, 'extra', 5);
  log.warn('plain');
  log.log('debug', '%s', 12n);
  log.error('left %s %d', 'x');
  assert.deepEqual(fake.logs, [
    ['info', 'routes: 3, host h1, {"a":[1]} % 7 extra 5'],
    ['warn', 'plain'],
    ['debug', '12'],
    ['error', 'left x %d'],
  ]);
  assert.throws(() => log.log('loud', 'x'), TypeError);
  assert.equal(format('%d', 12n), '12');
  assert.equal(format({ a: 1 }, '%s', 2), '{"a":1} %s 2');
  const cyclic = {};
  cyclic.self = cyclic;
  assert.equal(format('%j', cyclic), '[object Object]');
});

test('text and json decode strictly; lossy text is from_utf8_lossy', () => {
  assert.deepEqual(json.parse(bytes('{"a":[1,null]}')), { a: [1, null] });
  assert.equal(json.parse(bytes('{')), undefined);
  assert.equal(json.parse(new Uint8Array([0x22, 0xff, 0x22])), undefined);
  // A byte order mark is not JSON whitespace (serde_json refuses it too), and text keeps it.
  assert.equal(json.parse(new Uint8Array([0xef, 0xbb, 0xbf, 0x31])), undefined);
  assert.equal(text(new Uint8Array([0xef, 0xbb, 0xbf, 0x61])), '\ufeffa');
  assert.equal(text(new Uint8Array([0x61, 0xff])), undefined);
  // One U+FFFD per maximal ill-formed subpart, as Rust's Utf8Chunks.
  assert.equal(text(new Uint8Array([0x61, 0xf0, 0x80, 0x80, 0xe2, 0x82, 0x62]), { lossy: true }), 'a\ufffd\ufffd\ufffd\ufffdb');
  assert.deepEqual(json.bytes({ upstream: 'a\u2028\u0001' }), bytes('{"upstream":"a\u2028\\u0001"}'));
});
