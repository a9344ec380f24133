// foldhost-guest/state: the JavaScript SDK for foldhost guests that keep state in NATS buckets.
//
// Which contract: a guest that imports 'foldhost-guest' (foldhost-guest.js) is a component of the
// world `foldhost:guest/guest@0.1.0` (wit/guest.wit), and stays one; a guest that imports
// 'foldhost-guest/state' (this module) is one of `foldhost:guest/guest@0.3.0`
// (wit/v0.3.0/guest.wit), whose manifest may declare state buckets (docs/state.md). The choice is
// the import, nothing else: the two modules import their own contract's WIT interfaces, so a guest
// imports one of them, never both. sdk/js/build.mjs reads the contract off the bundle's imports
// (without a WIT_DIR it takes the checkout's wit/ for 0.1.0 and wit/v0.3.0 for 0.3.0; with one, it
// refuses a WIT directory of another version), and sdk/js/test/fake-host.mjs fakes both.
//
// The API is foldhost-guest's (read its header: verdicts, scope, deletes, pending values, errors,
// `log`, `fold`, `text`, `json`), plus:
//
//   import { exportFolder, accept, state, text, log, Refused } from 'foldhost-guest/state';
//
//   const items = new Map(); // catalog item -> its value (bytes)
//   export const folder = exportFolder({
//     manifest: {
//       name: 'counter', version: '0.1.0', scope: [],
//       state: [{ name: 'counts', history: 1 }], // owned: the server bucket state_counter_counts
//       reads: ['catalog.items'],                 // module catalog's bucket state_catalog_items
//     },
//     parse: (key, value) => accept(value),       // the main bucket, as with foldhost-guest
//     apply(changes) { ... },
//     applyState(bucket, changes) {               // a declared bucket's updates, values as bytes
//       if (bucket !== 'catalog.items') return;
//       for (const c of changes) c.op === 'put' ? items.set(c.key, c.value) : items.delete(c.key);
//     },
//     onApplied(cursor) {                         // the main bucket committed: writes go here
//       try {
//         state.put('counts', 'items', String(items.size)); // {outcome, opId, revision}
//       } catch (e) {
//         if (!(e instanceof Refused)) throw e;
//         log.warn(e.message);                    // 'refused (<reason>): <why>'; e.reason
//       }
//     },
//     query(request) {
//       return state.get('catalog.items', text(request, { lossy: true }))?.value ?? 'no such item';
//     },
//   });
//
// The manifest (what `folder.manifest()` hands the host):
// - `name` is the module's name: with `state` or `reads` declared, 1 to 32 of a-z, 0-9 and `-`
//   (the server buckets are named `state_<module>_<name>`). The host checks the names at load.
// - `state`: the buckets the module owns, each `{ name, history = 1, maxAgeMs = 0, maxBytes = 0,
//   perKeyTtl = false }` (0 age: for ever; 0 bytes: the host's cap) or just its name (a string)
//   for those defaults. The host creates each when absent, refuses to start when one differs.
// - `reads`: other modules' buckets, each `'<module>.<name>'`; each must exist (its owner makes it).
// - Both default to none: such a guest behaves as a 0.1.0 one, on the 0.3.0 contract.
//
// What the SDK does between the host and the folder, beyond foldhost-guest's:
// - Packed batches: `parse(bucket, batch)` gets one bucket's updates packed into bytes; the SDK
//   unpacks them (`unpack`; `pack` makes such a batch, for tests). A batch of the main bucket
//   (`""`) goes through `parse` and `apply` exactly as with foldhost-guest (scope, deletes,
//   pending values). A batch of a declared bucket skips `parse`: every update is accepted and
//   reaches `applyState(bucket, changes)` as `{ op: 'put', key, revision, value }` (value: the raw
//   bytes) or `{ op: 'delete', key, revision }`, `bucket` named as the manifest declares it (its
//   own by name, another's as `<module>.<name>`). Without `applyState` they are accepted and
//   dropped (the `state` verbs still read them).
// - Phases: per instance, each bucket's current values come first (never a delete among them),
//   then `endOfCurrent(bucket)` once (`""`: the main bucket), then its changes.
// - `onApplied(cursor)` is the main bucket's (as with foldhost-guest); a declared bucket's is
//   `onStateApplied(bucket, cursor)`. Both are optional. `endOfCurrent`, `onApplied` and
//   `onStateApplied` have no error channel: a throw is logged, then traps the instance.
//
// The verbs (`state`): `get(bucket, key)` and `keys(bucket, prefix, { startAfter, limit })` read
// this node's committed fold of a declared bucket (from any call); `put(bucket, key, value,
// options)` and `delete(bucket, key, options)` write an owned bucket through the host, from
// `onApplied`, `onStateApplied` or `query` only (the host refuses a write from `parse` or `apply`:
// those re-run on hydration and retry). A write answers `{ outcome, opId, revision }`, outcome
// 'applied' or 'pending' (durable at `revision`: do not retry) or 'unknown' (retry with the same
// `opId`); a write from inside a guest call is usually 'pending' (the fold that would apply it
// waits for the call to return).
//
// Refusals are thrown: a verb the host refuses, before anything is sent, throws a `Refused` (an
// Error) whose `.reason` is the host's one word (`undeclared`, `read_only`, `wrong_call`,
// `too_large`, `bucket_full`, `credential`, `no_ttl`, or the write path's `conflict`, `op_reused`,
// `permission`, `invalid`) and whose `.detail` is the host's explanation; its `.message` is
// `refused (<reason>): <detail>`. Uncaught, it is what any other throw is: the error of `apply`
// (the batch fails) or `query` (the query's error), a trap in `onApplied`. Catch it where a
// refusal is an expected answer: a write from `onApplied` should, or a full bucket traps the
// instance batch after batch.

import * as rawFold from 'foldhost:guest/fold@0.3.0';
import { log as rawLog } from 'foldhost:guest/log@0.3.0';
import * as rawState from 'foldhost:guest/state@0.3.0';

import { DEFAULT_PAGE, answer, checkGuest, isBytes, judge, makeFold, makeLog, message, ownBytes, utf8 } from './foldhost-guest-core.js';

export { DEFER, SKIP, accept, format, json, text, utf8 } from './foldhost-guest-core.js';

/**
 * A change of the main bucket, handed to `apply`: `value` is what `parse` accepted.
 * @typedef {{op: 'put', key: string, rest: string, revision: number, value: any}
 *   | {op: 'delete', key: string, rest: string, revision: number}} Change
 */
/**
 * A change of a declared bucket, handed to `applyState`: `value` is the raw bytes.
 * @typedef {{op: 'put', key: string, revision: number, value: Uint8Array}
 *   | {op: 'delete', key: string, revision: number}} StateChange
 */
/**
 * How a write is made: `opId` makes a retry safe (the host mints one when absent); `ifRevision`:
 * compare-and-set (0: the key is absent); `waitMs`: from `query`, how long to wait for this node to
 * apply it; `ttlMs`: a time to live of its own (a bucket declared with `perKeyTtl`).
 * @typedef {{opId?: string, ifRevision?: number | bigint, waitMs?: number, ttlMs?: number | bigint}} WriteOptions
 */
/**
 * A write's answer: 'applied' or 'pending' (durable at `revision`: do not retry), or 'unknown'
 * (retry with the same `opId`).
 * @typedef {{outcome: 'applied'|'pending'|'unknown', opId: string, revision: number | undefined}} Written
 */

// ---- Bytes --------------------------------------------------------------------------------------

// componentize-js's bindings hand every `list<u8>` over (a batch, a request, an entry's value) as a
// Uint8Array of their own realm, which `instanceof Uint8Array` in the guest misses. This module
// hands the guest only Uint8Arrays of its own realm (`ownBytes`), and takes either.

/** A raw `entry` record: its value a Uint8Array of this realm, its revision a Number. */
function entry(raw) {
  return { key: raw.key, value: ownBytes(raw.value), revision: Number(raw.revision) };
}

// ---- Logging and the committed fold of the main bucket ------------------------------------------

/** Logging into the host's log, which tags each line with the guest's name. */
export const log = makeLog(rawLog);

/**
 * Read access to the host's committed fold of the main bucket (never the batch being applied):
 * `get(key)`, `scan(prefix, { startAfter, limit })`, `scanAll(prefix, { pageSize })`, as
 * foldhost-guest's `fold`.
 */
export const fold = makeFold(rawFold, entry);

// ---- Packed batches -----------------------------------------------------------------------------

/** Per update: key length u32, value length u32, revision u64, op u8 (little-endian). */
const HEADER = 17;
/** The op byte is the WIT enum's case index. */
const OPS = ['put', 'delete', 'purge'];
const strictUtf8 = new TextDecoder('utf-8', { fatal: true, ignoreBOM: true });

/**
 * The updates of a packed batch, in order: `{ key, value, revision, op }`, `value` a copy of its
 * bytes (empty for a delete or a purge), `revision` a Number, `op` 'put', 'delete' or 'purge'.
 * Throws a RangeError on a torn or malformed batch (a host never sends one).
 * @param {Uint8Array} packed
 * @returns {{key: string, value: Uint8Array, revision: number, op: 'put'|'delete'|'purge'}[]}
 */
export function unpack(packed) {
  const batch = ownBytes(packed);
  const view = new DataView(batch.buffer, batch.byteOffset, batch.byteLength);
  const updates = [];
  let at = 0;
  while (at < batch.length) {
    if (batch.length - at < HEADER) throw new RangeError(`packed batch: a torn header at byte ${at}`);
    const keyLength = view.getUint32(at, true);
    const valueLength = view.getUint32(at + 4, true);
    const revision = Number(view.getBigUint64(at + 8, true));
    const op = OPS[view.getUint8(at + 16)];
    if (op === undefined) throw new RangeError(`packed batch: op byte ${view.getUint8(at + 16)} at byte ${at + 16}`);
    at += HEADER;
    if (batch.length - at < keyLength + valueLength) throw new RangeError(`packed batch: a torn update at byte ${at - HEADER}`);
    let key;
    try {
      key = strictUtf8.decode(batch.subarray(at, at + keyLength));
    } catch {
      throw new RangeError(`packed batch: a key that is not UTF-8 at byte ${at}`);
    }
    at += keyLength;
    // A copy: a view would keep the whole batch alive as long as the guest keeps the value.
    const value = batch.slice(at, at + valueLength);
    at += valueLength;
    updates.push({ key, value, revision, op: /** @type {'put'|'delete'|'purge'} */ (op) });
  }
  return updates;
}

/**
 * A packed batch of `updates`, as the host makes one: for a guest's tests. Each update is
 * `{ key, value = '', revision = 0, op = 'put' }`, `value` bytes or a string (as UTF-8).
 * @param {{key: string, value?: Uint8Array | string, revision?: number | bigint, op?: 'put'|'delete'|'purge'}[]} updates
 * @returns {Uint8Array}
 */
export function pack(updates) {
  const parts = updates.map(({ key, value = '', revision = 0, op = 'put' }) => {
    const k = utf8(key);
    const v = typeof value === 'string' ? utf8(value) : value;
    const code = OPS.indexOf(op);
    if (code < 0) throw new TypeError(`pack: op ${op}: one of ${OPS.join(', ')}`);
    return { k, v, revision: BigInt(revision), code };
  });
  const out = new Uint8Array(parts.reduce((n, p) => n + HEADER + p.k.length + p.v.length, 0));
  const view = new DataView(out.buffer);
  let at = 0;
  for (const { k, v, revision, code } of parts) {
    view.setUint32(at, k.length, true);
    view.setUint32(at + 4, v.length, true);
    view.setBigUint64(at + 8, revision, true);
    view.setUint8(at + 16, code);
    out.set(k, at + HEADER);
    out.set(v, at + HEADER + k.length);
    at += HEADER + k.length + v.length;
  }
  return out;
}

// ---- The state verbs ----------------------------------------------------------------------------

/** A verb the host refused, before anything reached the server. */
export class Refused extends Error {
  /** @param {{reason: string, message: string}} refusal the WIT's `refusal` */
  constructor({ reason, message }) {
    super(`refused (${reason}): ${message}`);
    this.name = 'Refused';
    /** One word to branch on (see the module's header). */
    this.reason = reason;
    /** What was refused and why, for a person. */
    this.detail = message;
  }
}

/**
 * `f()`, a raw verb: componentize-js throws a result's error as an Error whose `payload` is the
 * WIT's error value, here a `refusal`; that becomes a `Refused`. Anything else is rethrown.
 */
function verb(f) {
  try {
    return f();
  } catch (e) {
    const refusal = e !== null && typeof e === 'object' ? /** @type {any} */ (e).payload : undefined;
    if (refusal !== null && typeof refusal === 'object' && typeof refusal.reason === 'string') {
      throw new Refused(refusal);
    }
    throw e;
  }
}

/** A value to write: bytes as they are, a string as UTF-8. */
function bytesOf(value) {
  if (typeof value === 'string') return utf8(value);
  if (isBytes(value)) return ownBytes(value);
  if (value instanceof ArrayBuffer) return new Uint8Array(value);
  throw new TypeError(`state.put: the value must be a Uint8Array or a string, not ${String(value)}`);
}

const u64 = (n) => (n === undefined || n === null ? undefined : BigInt(n));

/**
 * The WIT's `write-options` from `{ opId, ifRevision, waitMs, ttlMs }`.
 * @param {WriteOptions} [options]
 */
function writeOptions({ opId, ifRevision, waitMs = 0, ttlMs } = {}) {
  return { opId: opId ?? undefined, ifRevision: u64(ifRevision), waitMs, ttlMs: u64(ttlMs) };
}

/**
 * A raw `written` with its revision as a Number (or `undefined` when not known).
 * @returns {Written}
 */
function written(raw) {
  const revision = raw.revision === undefined || raw.revision === null ? undefined : Number(raw.revision);
  return { outcome: raw.outcome, opId: raw.opId, revision };
}

/**
 * The module's state buckets, each named as the manifest declares it: its own by name, another
 * module's as `<module>.<name>`. A refusal throws a `Refused` (see the module's header).
 */
export const state = {
  /**
   * The live entry for `key` in `bucket`, from this node's committed fold of it, or `undefined`.
   * @param {string} bucket
   * @param {string} key
   * @returns {{key: string, value: Uint8Array, revision: number} | undefined}
   */
  get(bucket, key) {
    const raw = verb(() => rawState.get(bucket, key));
    return raw === undefined || raw === null ? undefined : entry(raw);
  },

  /**
   * One page of the keys of `bucket` starting with `prefix`, in key order, strictly after
   * `startAfter` when given. The host caps `limit` (10 000): page on with the last key until a page
   * comes back empty (or use `keysAll`).
   * @param {string} bucket
   * @param {string} [prefix]
   * @param {{startAfter?: string, limit?: number}} [options]
   * @returns {string[]}
   */
  keys(bucket, prefix = '', { startAfter, limit = DEFAULT_PAGE } = {}) {
    return verb(() => rawState.keys(bucket, prefix, startAfter, limit));
  },

  /**
   * Every key of `bucket` starting with `prefix`, in key order, a page at a time.
   * @param {string} bucket
   * @param {string} [prefix]
   * @param {{pageSize?: number}} [options]
   */
  *keysAll(bucket, prefix = '', { pageSize = DEFAULT_PAGE } = {}) {
    let startAfter;
    for (;;) {
      const page = state.keys(bucket, prefix, { startAfter, limit: pageSize });
      if (page.length === 0) return;
      yield* page;
      startAfter = page[page.length - 1];
    }
  },

  /**
   * Writes `value` (bytes, or a string as UTF-8) at `key` of an owned bucket; from `onApplied`,
   * `onStateApplied` or `query` only.
   * @param {string} bucket
   * @param {string} key
   * @param {Uint8Array | string} value
   * @param {WriteOptions} [options]
   * @returns {Written}
   */
  put(bucket, key, value, options) {
    const bytes = bytesOf(value);
    return written(verb(() => rawState.put(bucket, key, bytes, writeOptions(options))));
  },

  /**
   * Deletes `key` of an owned bucket (the same rules and options as `put`).
   * @param {string} bucket
   * @param {string} key
   * @param {WriteOptions} [options]
   * @returns {Written}
   */
  delete(bucket, key, options) {
    return written(verb(() => rawState.delete(bucket, key, writeOptions(options))));
  },
};

// ---- The folder export --------------------------------------------------------------------------

/** An owned bucket's declaration (a name, or `{ name, ... }`) as the WIT's `state-bucket`. */
function stateBucket(declared) {
  const d = typeof declared === 'string' ? { name: declared } : (declared ?? {});
  const { name, history = 1, maxAgeMs = 0, maxBytes = 0, perKeyTtl = false } = d;
  const count = (n) => (typeof n === 'number' && Number.isInteger(n) && n >= 0) || (typeof n === 'bigint' && n >= 0n);
  if (typeof name !== 'string' || !count(history) || !count(maxAgeMs) || !count(maxBytes) || typeof perKeyTtl !== 'boolean') {
    throw new TypeError(
      `exportFolder: manifest.state: ${JSON.stringify(declared, (_, v) => (typeof v === 'bigint' ? `${v}` : v))}: ` +
        'each a name or { name, history, maxAgeMs, maxBytes, perKeyTtl } (integers >= 0, perKeyTtl a boolean)',
    );
  }
  return { name, history: Number(history), maxAgeMs: BigInt(maxAgeMs), maxBytes: BigInt(maxBytes), perKeyTtl };
}

/**
 * Builds the `folder` export (contract 0.3.0) from a guest's domain logic.
 *
 * Change objects handed to `apply` (the main bucket's) are foldhost-guest's:
 * `{ op: 'put', key, rest, revision, value }` or `{ op: 'delete', key, rest, revision }`. Those
 * handed to `applyState` (a declared bucket's): `{ op: 'put', key, revision, value }` (value: the
 * raw bytes) or `{ op: 'delete', key, revision }`.
 *
 * @param {object} guest
 * @param {{name: string, version: string, scope?: string[],
 *   state?: (string | {name: string, history?: number, maxAgeMs?: number, maxBytes?: number, perKeyTtl?: boolean})[],
 *   reads?: string[]}} guest.manifest
 * @param {(config: Map<string, string>) => void} [guest.init] the operator's configuration
 * @param {(key: string, value: Uint8Array, rest: string) => import('./foldhost-guest-core.js').Verdict} guest.parse
 *   decodes one put of the main bucket in scope; must not change the guest's state
 * @param {(changes: Change[]) => void} guest.apply applies what the last parse of the main bucket
 *   accepted, in order
 * @param {(bucket: string, changes: StateChange[]) => void} [guest.applyState] applies a declared
 *   bucket's updates, in order
 * @param {(bucket: string) => void} [guest.endOfCurrent] every current value of `bucket` (`""`:
 *   the main bucket) has been given; what follows are changes
 * @param {(cursor: number) => void} [guest.onApplied] the host committed the main bucket through
 *   cursor
 * @param {(bucket: string, cursor: number) => void} [guest.onStateApplied] the host committed a
 *   declared bucket through cursor
 * @param {(request: Uint8Array) => Uint8Array | string} [guest.query] a string answer is sent as UTF-8
 */
export function exportFolder(guest) {
  const { name, version, scope: prefixes } = checkGuest(guest, 'exportFolder');
  const owned = [...(guest.manifest.state ?? [])].map(stateBucket);
  const reads = [...(guest.manifest.reads ?? [])];
  if (!reads.every((r) => typeof r === 'string')) {
    throw new TypeError("exportFolder: manifest.reads: each a string '<module>.<name>'");
  }
  for (const hook of ['applyState', 'endOfCurrent', 'onStateApplied', 'onApplied', 'init', 'query']) {
    const f = /** @type {Record<string, unknown>} */ (guest)[hook];
    if (f !== undefined && typeof f !== 'function') {
      throw new TypeError(`exportFolder: ${hook} must be a function`);
    }
  }
  /** The bucket of the last `parse` and what it accepted, until `apply`. */
  let pendingBucket = '';
  let pending = [];

  /** Calls `f`; a throw is logged as `what threw`, then rethrown (a trap: no error channel). */
  const trapping = (what, f) => {
    try {
      f();
    } catch (e) {
      rawLog('error', `${what} threw: ${message(e)}`);
      throw e;
    }
  };

  return {
    manifest() {
      return {
        name,
        version,
        scope: [...prefixes],
        state: owned.map((b) => ({ ...b })),
        reads: [...reads],
      };
    },

    init(config) {
      try {
        guest.init?.(new Map(config));
      } catch (e) {
        throw message(e);
      }
    },

    parse(bucket, batch) {
      pending = [];
      pendingBucket = bucket;
      let updates;
      try {
        updates = unpack(batch);
      } catch (e) {
        rawLog('error', `parse of bucket ${JSON.stringify(bucket)}: ${message(e)}`);
        throw e;
      }
      const verdicts = new Array(updates.length);
      if (bucket === '') {
        for (let i = 0; i < updates.length; i++) {
          const { key, value, op, revision } = updates[i];
          verdicts[i] = judge(guest, prefixes, rawLog, pending, key, value, op, revision);
        }
      } else {
        for (let i = 0; i < updates.length; i++) {
          const { key, value, op, revision } = updates[i];
          pending.push(op === 'put' ? { op, key, revision, value } : { op: 'delete', key, revision });
          verdicts[i] = 'accept';
        }
      }
      return verdicts;
    },

    apply() {
      const changes = pending;
      const bucket = pendingBucket;
      pending = [];
      pendingBucket = '';
      try {
        if (bucket === '') guest.apply(changes);
        else guest.applyState?.(bucket, changes);
      } catch (e) {
        throw message(e);
      }
    },

    endOfCurrent(bucket) {
      trapping(`endOfCurrent(${JSON.stringify(bucket)})`, () => guest.endOfCurrent?.(bucket));
    },

    onApplied(bucket, cursor) {
      if (bucket === '') trapping('onApplied', () => guest.onApplied?.(Number(cursor)));
      else trapping(`onStateApplied(${JSON.stringify(bucket)})`, () => guest.onStateApplied?.(bucket, Number(cursor)));
    },

    query(request) {
      return answer(guest, ownBytes(request), { anyRealm: true });
    },
  };
}
