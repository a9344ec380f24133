// foldhost-guest: the JavaScript SDK for foldhost WebAssembly guests.
//
// A guest is a component of the world `foldhost:guest/guest@0.1.0` (wit/guest.wit). Its raw
// exports are batch-shaped (`parse` gets a list of updates, `apply` gets nothing and must remember
// what `parse` accepted); this module turns them into the shape of the Rust SDK's `Folder` trait
// (sdk/rust), so a guest author writes only the domain logic:
//
//   import { exportFolder, accept, SKIP, text } from 'foldhost-guest';
//
//   const greetings = new Map(); // name -> greeting
//   export const folder = exportFolder({
//     manifest: { name: 'greeter', version: '0.1.0', scope: ['greeting.'] },
//     parse(key, value) {
//       const greeting = text(value);
//       return greeting === undefined ? SKIP : accept(greeting);
//     },
//     apply(changes) {
//       for (const c of changes) {
//         if (c.op === 'put') greetings.set(c.rest, c.value);
//         else greetings.delete(c.rest);
//       }
//     },
//     query(request) {
//       const name = text(request, { lossy: true });
//       if (!greetings.has(name)) throw `nobody called ${name}`;
//       return greetings.get(name);
//     },
//   });
//
// The export must be named `folder` (the WIT interface's name): componentize-js looks for it.
// `node sdk/js/build.mjs guest.js out.wasm` bundles the guest with this module and builds the
// component.
//
// What the SDK does between the host and the folder (the same as the Rust SDK):
// - Scope: updates whose key starts with none of `manifest.scope` are answered 'skip' without
//   calling `parse`. An empty scope is the whole bucket.
// - Deletes and purges never reach `parse`: in scope they are accepted and reach `apply` as
//   `{ op: 'delete', key, rest, revision }`.
// - Pending values: what the last `parse` accepted is kept in order and handed to the next `apply`,
//   then dropped, also when `apply` throws (the host retries a failed batch on a fresh instance
//   rebuilt from the fold). A second `parse` without an `apply` replaces them.
// - Errors: a throw from `init`, `apply` or `query` becomes the WIT result's error string. `parse`
//   and `onApplied` have no error channel: a throw there is logged, then traps the instance (the
//   host fails the batch and rebuilds a fresh instance).
//
// Revisions and cursors are plain Numbers (the WIT's u64 arrives as a BigInt): a stream sequence
// stays far below 2^53, and Numbers mix with arithmetic and JSON where BigInts throw.
//
// State buckets (contract 0.3.0, docs/state.md) are the other entry module's:
// `import ... from 'foldhost-guest/state'` (foldhost-guest-state.js), the same API plus the
// manifest's `state` and `reads` and the `state` verbs. This module stays the 0.1.0 contract's, and
// a guest imports one of the two. What both share, with no WIT import, is foldhost-guest-core.js.

import * as rawFold from 'foldhost:guest/fold@0.1.0';
import { log as rawLog } from 'foldhost:guest/log@0.1.0';

import { answer, checkGuest, judge, makeFold, makeLog, message } from './foldhost-guest-core.js';

export { DEFER, SKIP, accept, format, json, text, utf8 } from './foldhost-guest-core.js';

// ---- Logging and the committed fold -------------------------------------------------------------

/** Logging into the host's log, which tags each line with the guest's name. */
export const log = makeLog(rawLog);

/**
 * Read access to the host's committed fold (the raw bytes of the bucket as of the last committed
 * batch, never the batch being applied): `get(key)`, `scan(prefix, { startAfter, limit })` (one
 * page; the host caps `limit`) and `scanAll(prefix, { pageSize })` (every page).
 */
export const fold = makeFold(rawFold);

// ---- The folder export --------------------------------------------------------------------------

/**
 * Builds the `folder` export from a guest's domain logic.
 *
 * Change objects handed to `apply`: `{ op: 'put', key, rest, revision, value }` or
 * `{ op: 'delete', key, rest, revision }`, where `rest` is the key without its scope prefix (the
 * first that matches, in the manifest's order, as the Rust SDK's `Change::rest`; the whole key
 * when the scope is empty).
 *
 * @param {object} guest
 * @param {{name: string, version: string, scope?: string[]}} guest.manifest
 * @param {(config: Map<string, string>) => void} [guest.init] the operator's configuration
 * @param {(key: string, value: Uint8Array, rest: string) => import('./foldhost-guest-core.js').Verdict} guest.parse
 *   decodes one put in scope; must not change the guest's state (the host may fail the batch
 *   before `apply`)
 * @param {(changes: object[]) => void} guest.apply applies what the last parse accepted, in order
 * @param {(cursor: number) => void} [guest.onApplied] the host committed everything through cursor
 * @param {(request: Uint8Array) => Uint8Array | string} [guest.query] a string answer is sent as UTF-8
 */
export function exportFolder(guest) {
  const { name, version, scope: prefixes } = checkGuest(guest, 'exportFolder');
  let pending = [];

  return {
    manifest() {
      return { name, version, scope: [...prefixes] };
    },

    init(config) {
      try {
        guest.init?.(new Map(config));
      } catch (e) {
        throw message(e);
      }
    },

    parse(batch) {
      pending = [];
      const verdicts = new Array(batch.length);
      for (let i = 0; i < batch.length; i++) {
        const { key, value, op } = batch[i];
        verdicts[i] = judge(guest, prefixes, rawLog, pending, key, value, op, Number(batch[i].revision));
      }
      return verdicts;
    },

    apply() {
      const changes = pending;
      pending = [];
      try {
        guest.apply(changes);
      } catch (e) {
        throw message(e);
      }
    },

    onApplied(cursor) {
      try {
        guest.onApplied?.(Number(cursor));
      } catch (e) {
        rawLog('error', `onApplied threw: ${message(e)}`);
        throw e;
      }
    },

    query(request) {
      return answer(guest, request, { anyRealm: true });
    },
  };
}
