// Unit tests of the JS SDK's contract-0.3.0 module (foldhost-guest/state), under Node with fake host
// imports (see fake-host.mjs). The main bucket's path is the 0.1.0 module's (sdk.test.mjs); these
// cover what 0.3.0 adds: packed batches, the manifest's state and reads, the declared buckets'
// updates, end-of-current, on-applied per bucket, and the state verbs.
import assert from 'node:assert/strict';
import { beforeEach, test } from 'node:test';
import { runInNewContext } from 'node:vm';

import * as v1 from '../foldhost-guest.js';
import { DEFER, Refused, SKIP, accept, exportFolder, fold, log, pack, state, text, unpack } from '../foldhost-guest-state.js';

const fake = globalThis.foldhostFake;
const bytes = (s) => new TextEncoder().encode(s);

beforeEach(() => {
  fake.entries.clear();
  fake.logs.length = 0;
  fake.pageCap = 10_000;
  fake.state.clear();
  fake.writes.length = 0;
  fake.refuse = undefined;
  fake.stateRevision = 0;
});

/** A folder recording what it is given, over the whole main bucket but `skip.` and `defer.`. */
function recorder(manifest = {}) {
  const seen = { applied: [], state: [], eoc: [], cursors: [], stateCursors: [] };
  const folder = exportFolder({
    manifest: { name: 'rec', version: '0.3.0', scope: [], ...manifest },
    parse(key, value) {
      if (key.startsWith('skip.')) return SKIP;
      if (key.startsWith('defer.')) return DEFER;
      return accept(text(value));
    },
    apply(changes) {
      if (changes.some((c) => c.key === 'fail')) throw new Error('main failed');
      seen.applied.push(...changes);
    },
    applyState(bucket, changes) {
      if (changes.some((c) => c.key === 'fail')) throw 'state failed';
      seen.state.push([bucket, changes]);
    },
    endOfCurrent: (bucket) => seen.eoc.push(bucket),
    onApplied: (cursor) => seen.cursors.push(cursor),
    onStateApplied: (bucket, cursor) => seen.stateCursors.push([bucket, cursor]),
  });
  return { folder, seen };
}

test('pack and unpack: the 17-byte header, then key and value; revisions as Numbers', () => {
  const batch = pack([
    { key: 'a', value: 'xy', revision: 7 },
    { key: 'é', op: 'delete', revision: 2n ** 40n },
    { key: 'p', op: 'purge' },
  ]);
  assert.equal(batch.length, 3 * 17 + 1 + 2 + 2 + 1);
  // Little-endian: key length 1, value length 2, revision 7, op 0.
  assert.deepEqual([...batch.subarray(0, 18)], [1, 0, 0, 0, 2, 0, 0, 0, 7, 0, 0, 0, 0, 0, 0, 0, 0, 0x61]);
  assert.deepEqual(unpack(batch), [
    { key: 'a', value: bytes('xy'), revision: 7, op: 'put' },
    { key: 'é', value: new Uint8Array(), revision: 2 ** 40, op: 'delete' },
    { key: 'p', value: new Uint8Array(), revision: 0, op: 'purge' },
  ]);
  assert.deepEqual(unpack(new Uint8Array()), []);
  // A value is a copy, not a view of the batch.
  const [{ value }] = unpack(batch);
  assert.equal(value.buffer.byteLength, 2);
  // Torn or malformed batches.
  assert.throws(() => unpack(batch.subarray(0, 16)), RangeError);
  assert.throws(() => unpack(batch.subarray(0, 19)), RangeError);
  const badOp = batch.slice(0, 20);
  badOp[16] = 3;
  assert.throws(() => unpack(badOp), /op byte 3/);
  const badKey = pack([{ key: 'a' }]);
  badKey[17] = 0xff;
  assert.throws(() => unpack(badKey), /not UTF-8/);
  assert.throws(() => pack([{ key: 'a', op: 'upsert' }]), TypeError);
});

test('the manifest: state buckets with defaults, reads; none by default', () => {
  const { folder } = recorder({
    scope: ['a.'],
    state: ['counts', { name: 'log', history: 5, maxAgeMs: 60_000, maxBytes: 1 << 20, perKeyTtl: true }],
    reads: ['catalog.items'],
  });
  assert.deepEqual(folder.manifest(), {
    name: 'rec',
    version: '0.3.0',
    scope: ['a.'],
    state: [
      { name: 'counts', history: 1, maxAgeMs: 0n, maxBytes: 0n, perKeyTtl: false },
      { name: 'log', history: 5, maxAgeMs: 60_000n, maxBytes: 1_048_576n, perKeyTtl: true },
    ],
    reads: ['catalog.items'],
  });
  // The host gets fresh copies: changing one changes nothing.
  folder.manifest().state[0].name = 'x';
  assert.equal(folder.manifest().state[0].name, 'counts');

  const plain = recorder().folder;
  assert.deepEqual(plain.manifest(), { name: 'rec', version: '0.3.0', scope: [], state: [], reads: [] });

  assert.throws(() => recorder({ state: [{ history: 1 }] }), TypeError);
  assert.throws(() => recorder({ state: [{ name: 'x', history: -1 }] }), TypeError);
  assert.throws(() => recorder({ state: [{ name: 'x', perKeyTtl: 'yes' }] }), TypeError);
  assert.throws(() => recorder({ reads: [7] }), TypeError);
  assert.throws(() => exportFolder({ manifest: { name: 'x', version: '1' }, parse() {}, apply() {}, applyState: 1 }), TypeError);
  assert.throws(() => exportFolder({ manifest: { name: 'x', version: '1' }, parse() {} }), TypeError);
});

test('the main bucket ("") goes through parse and apply, with scope, as in 0.1.0', () => {
  const { folder, seen } = recorder({ scope: ['n.', 'skip.', 'defer.'] });
  const verdicts = folder.parse(
    '',
    pack([
      { key: 'n.1', value: 'one', revision: 1 },
      { key: 'out', value: 'x', revision: 2 },
      { key: 'skip.1', value: 'x', revision: 3 },
      { key: 'defer.1', value: 'x', revision: 4 },
      { key: 'n.2', op: 'delete', revision: 5 },
      { key: 'out.2', op: 'purge', revision: 6 },
      { key: 'n.3', op: 'purge', revision: 7 },
    ]),
  );
  assert.deepEqual(verdicts, ['accept', 'skip', 'skip', 'defer', 'accept', 'skip', 'accept']);
  folder.apply();
  assert.deepEqual(seen.applied, [
    { op: 'put', key: 'n.1', rest: '1', revision: 1, value: 'one' },
    { op: 'delete', key: 'n.2', rest: '2', revision: 5 },
    { op: 'delete', key: 'n.3', rest: '3', revision: 7 },
  ]);
  assert.deepEqual(seen.state, []);
  // Applied changes are forgotten; a failed apply is the error string and drops the batch.
  folder.apply();
  assert.equal(seen.applied.length, 3);
  const whole = recorder();
  whole.folder.parse('', pack([{ key: 'fail', value: '1' }]));
  assert.throws(() => whole.folder.apply(), (e) => e === 'main failed');
  whole.folder.apply();
  assert.deepEqual(whole.seen.applied, []);
});

test("a declared bucket's updates skip parse: all accepted, raw bytes, to applyState", () => {
  const { folder, seen } = recorder({ state: ['counts'], reads: ['catalog.items'] });
  const verdicts = folder.parse(
    'catalog.items',
    pack([
      { key: 'skip.1', value: new Uint8Array([0xff]), revision: 10 },
      { key: 'sku-1', op: 'delete', revision: 11 },
      { key: 'sku-2', op: 'purge', revision: 12 },
    ]),
  );
  assert.deepEqual(verdicts, ['accept', 'accept', 'accept']);
  assert.deepEqual(seen.state, []); // nothing before apply
  folder.apply();
  assert.deepEqual(seen.state, [
    [
      'catalog.items',
      [
        { op: 'put', key: 'skip.1', revision: 10, value: new Uint8Array([0xff]) },
        { op: 'delete', key: 'sku-1', revision: 11 },
        { op: 'delete', key: 'sku-2', revision: 12 },
      ],
    ],
  ]);
  assert.deepEqual(seen.applied, []);
  // The next apply without a parse is the main bucket's, with nothing.
  folder.apply();
  assert.deepEqual(seen.applied, []);
  assert.equal(seen.state.length, 1);

  // A parse replaces what the last one accepted, whichever bucket.
  folder.parse('counts', pack([{ key: 'total', value: '3' }]));
  folder.parse('', pack([{ key: 'k', value: 'v' }]));
  folder.apply();
  assert.equal(seen.state.length, 1);
  assert.equal(seen.applied.length, 1);

  folder.parse('counts', pack([{ key: 'fail', value: '1' }]));
  assert.throws(() => folder.apply(), (e) => e === 'state failed');
  folder.apply();
  assert.equal(seen.state.length, 1);

  // Without applyState: accepted and dropped.
  const bare = exportFolder({ manifest: { name: 'b', version: '1', reads: ['m.b'] }, parse: () => SKIP, apply: () => {} });
  assert.deepEqual(bare.parse('m.b', pack([{ key: 'x', value: 'y' }])), ['accept']);
  bare.apply();
  bare.endOfCurrent('m.b');
  bare.onApplied('m.b', 3n);
  bare.onApplied('', 3n);
});

test('end-of-current and on-applied reach the guest per bucket; a throw there is logged and traps', () => {
  const { folder, seen } = recorder({ state: ['counts'] });
  folder.endOfCurrent('');
  folder.endOfCurrent('counts');
  folder.onApplied('', 42n);
  folder.onApplied('counts', 7n);
  assert.deepEqual(seen.eoc, ['', 'counts']);
  assert.deepEqual(seen.cursors, [42]);
  assert.deepEqual(seen.stateCursors, [['counts', 7]]);

  const thrower = exportFolder({
    manifest: { name: 'x', version: '1' },
    parse: () => SKIP,
    apply: () => {},
    endOfCurrent: () => {
      throw new Error('eoc kaput');
    },
    onStateApplied: () => {
      throw 'state kaput';
    },
  });
  assert.throws(() => thrower.endOfCurrent('b'), /eoc kaput/);
  assert.throws(() => thrower.onApplied('b', 1n), (e) => e === 'state kaput');
  assert.deepEqual(fake.logs, [
    ['error', 'endOfCurrent("b") threw: eoc kaput'],
    ['error', 'onStateApplied("b") threw: state kaput'],
  ]);
  // A malformed batch is logged and traps too.
  assert.throws(() => thrower.parse('', new Uint8Array([1, 2, 3])), RangeError);
  assert.match(fake.logs[2][1], /parse of bucket "": packed batch: a torn header/);
});

test('state.get and state.keys read the declared buckets; an undeclared one is refused', () => {
  fake.state.set('catalog.items', new Map([
    ['sku-1', { value: bytes('lamp'), revision: 4 }],
    ['sku-2', { value: bytes('desk'), revision: 5 }],
    ['sku-3', { value: bytes('sofa'), revision: 6 }],
    ['other', { value: bytes('x'), revision: 7 }],
  ]));
  assert.deepEqual(state.get('catalog.items', 'sku-1'), { key: 'sku-1', value: bytes('lamp'), revision: 4 });
  assert.equal(state.get('catalog.items', 'nope'), undefined);
  assert.deepEqual(state.keys('catalog.items', 'sku-', { startAfter: 'sku-1', limit: 1 }), ['sku-2']);
  assert.deepEqual(state.keys('catalog.items'), ['other', 'sku-1', 'sku-2', 'sku-3']);
  fake.pageCap = 2;
  assert.deepEqual([...state.keysAll('catalog.items', 'sku-')], ['sku-1', 'sku-2', 'sku-3']);

  assert.throws(
    () => state.get('nope', 'k'),
    (e) => e instanceof Refused && e instanceof Error && e.reason === 'undeclared' &&
      e.detail === 'bucket "nope" is not in the manifest' &&
      e.message === 'refused (undeclared): bucket "nope" is not in the manifest',
  );
  assert.throws(() => [...state.keysAll('nope')], (e) => e instanceof Refused && e.reason === 'undeclared');
  // The main bucket's fold is apart.
  assert.equal(fold.get('sku-1'), undefined);
});

test('state.put and state.delete write an owned bucket; options and answers; refusals thrown', () => {
  fake.state.set('counts', new Map());
  fake.state.set('catalog.items', new Map());
  assert.deepEqual(state.put('counts', 'total', '3'), { outcome: 'applied', opId: 'op-1', revision: 1 });
  assert.deepEqual(state.get('counts', 'total').value, bytes('3'));
  assert.deepEqual(state.put('counts', 'raw', new Uint8Array([0, 1]), { opId: 'mine', ifRevision: 0, waitMs: 50, ttlMs: 1000 }), {
    outcome: 'applied',
    opId: 'mine',
    revision: 2,
  });
  assert.deepEqual(fake.writes[1], {
    verb: 'put',
    bucket: 'counts',
    key: 'raw',
    value: new Uint8Array([0, 1]),
    options: { opId: 'mine', ifRevision: 0n, waitMs: 50, ttlMs: 1000n },
  });
  assert.deepEqual(fake.writes[0].options, { opId: undefined, ifRevision: undefined, waitMs: 0, ttlMs: undefined });
  assert.throws(() => state.put('counts', 'total', '4', { ifRevision: 9 }), (e) => e.reason === 'conflict');
  assert.deepEqual(state.delete('counts', 'total', { ifRevision: 1 }), { outcome: 'applied', opId: 'op-3', revision: 3 });
  assert.equal(state.get('counts', 'total'), undefined);

  assert.throws(() => state.put('catalog.items', 'k', 'v'), (e) => e instanceof Refused && e.reason === 'read_only');
  assert.throws(() => state.delete('nope', 'k'), (e) => e instanceof Refused && e.reason === 'undeclared');
  fake.refuse = (verb) => (verb === 'put' ? { reason: 'wrong_call', message: 'a write from apply' } : undefined);
  assert.throws(() => state.put('counts', 'k', 'v'), (e) => e.reason === 'wrong_call' && e.detail === 'a write from apply');
  assert.throws(() => state.put('counts', 'k', 42), TypeError);
  assert.deepEqual(
    fake.writes.map((w) => w.refused),
    [undefined, undefined, 'conflict', undefined, 'read_only', 'undeclared', 'wrong_call'],
  );
});

test('a refusal from query is the query error; from onApplied, a trap unless caught', () => {
  fake.state.set('counts', new Map());
  const folder = exportFolder({
    manifest: { name: 'q', version: '1', state: ['counts'] },
    parse: () => SKIP,
    apply: () => {},
    onApplied(cursor) {
      try {
        state.put('counts', 'cursor', String(cursor));
      } catch (e) {
        if (!(e instanceof Refused)) throw e;
        log.warn(e.message);
      }
    },
    onStateApplied() {
      state.put('counts', 'again', 'x');
    },
    query: (request) => state.get(text(request), 'k')?.value ?? 'none',
  });
  assert.equal(text(folder.query(bytes('counts'))), 'none');
  assert.throws(() => folder.query(bytes('other')), (e) => e === 'refused (undeclared): bucket "other" is not in the manifest');
  folder.onApplied('', 5n);
  assert.deepEqual(state.get('counts', 'cursor').value, bytes('5'));
  fake.refuse = () => ({ reason: 'bucket_full', message: 'counts is full' });
  folder.onApplied('', 6n);
  assert.deepEqual(fake.logs, [['warn', 'refused (bucket_full): counts is full']]);
  assert.throws(() => folder.onApplied('counts', 1n), Refused);
  assert.match(fake.logs[1][1], /onStateApplied\("counts"\) threw: refused \(bucket_full\)/);
});

test('both entry modules share the verdicts, text and json; each has its own log and fold', () => {
  assert.equal(v1.SKIP, SKIP);
  assert.equal(v1.DEFER, DEFER);
  assert.equal(v1.text, text);
  assert.ok(v1.accept(1) instanceof accept(2).constructor);
  assert.notEqual(v1.log, log);
  fake.entries.set('k', { value: bytes('v'), revision: 1 });
  assert.deepEqual(fold.get('k'), v1.fold.get('k'));
});

test("bytes of the bindings' realm: the guest gets its own realm's, and may answer either", () => {
  // componentize-js hands every list<u8> over as a Uint8Array of its bindings' realm.
  const Foreign = runInNewContext('Uint8Array');
  const foreign = (b) => new Foreign(b);
  assert.equal(foreign(bytes('x')) instanceof Uint8Array, false);

  const seen = {};
  const folder = exportFolder({
    manifest: { name: 'r', version: '1', reads: ['m.b'] },
    parse: (key, value) => ((seen.parsed = value), accept(value)),
    apply: ([change]) => (seen.applied = change.value),
    applyState: (bucket, [change]) => (seen.state = change.value),
    query(request) {
      seen.request = request;
      const q = text(request);
      if (q === 'foreign') return foreign(bytes('raw'));
      if (q === 'kept') return seen.applied;
      return state.get('m.b', q)?.value ?? fold.get(q)?.value ?? 'none';
    },
  });
  folder.parse('', foreign(pack([{ key: 'k', value: 'v' }])));
  folder.apply();
  folder.parse('m.b', foreign(pack([{ key: 's', value: 'w' }])));
  folder.apply();
  for (const v of [seen.parsed, seen.applied, seen.state]) assert.ok(v instanceof Uint8Array);
  assert.deepEqual([seen.applied, seen.state], [bytes('v'), bytes('w')]);

  assert.deepEqual(folder.query(foreign(bytes('kept'))), bytes('v'));
  assert.ok(seen.request instanceof Uint8Array);
  assert.deepEqual(folder.query(bytes('foreign')), bytes('raw'));

  // The fake's 0.3.0 imports hand over foreign bytes, as the bindings do.
  fake.state.set('m.b', new Map([['s', { value: bytes('w'), revision: 1 }]]));
  fake.entries.set('f', { value: bytes('main'), revision: 2 });
  assert.ok(state.get('m.b', 's').value instanceof Uint8Array);
  assert.ok(fold.get('f').value instanceof Uint8Array);
  assert.ok([...fold.scanAll('')][0].value instanceof Uint8Array);
  assert.deepEqual(folder.query(bytes('s')), bytes('w'));
  assert.deepEqual(folder.query(bytes('f')), bytes('main'));

  // A write takes either realm's bytes.
  fake.state.set('own', new Map());
  state.put('own', 'k', foreign(bytes('z')));
  assert.ok(fake.writes.at(-1).value instanceof Uint8Array);
  assert.deepEqual(fake.writes.at(-1).value, bytes('z'));
});
