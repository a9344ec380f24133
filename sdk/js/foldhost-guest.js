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

import * as rawFold from 'foldhost:guest/fold@0.1.0';
import { log as rawLog } from 'foldhost:guest/log@0.1.0';

// ---- Verdicts -----------------------------------------------------------------------------------

/** What `parse` returns to keep `value` for the next `apply`. */
class Accept {
  constructor(value) {
    this.value = value;
  }
}

/**
 * Apply this put: `value` (what parse made of the bytes) reaches `apply` as the change's `value`.
 * @template V
 * @param {V} value
 * @returns {Accept}
 */
export function accept(value) {
  return new Accept(value);
}

/** Irrelevant or corrupt: nothing to apply (the host's cursor still moves past it). */
export const SKIP = Object.freeze({ verdict: 'skip' });

/** This version of the guest cannot decode it: the host retains it for a later version. */
export const DEFER = Object.freeze({ verdict: 'defer' });

// ---- Text and JSON ------------------------------------------------------------------------------

// ignoreBOM keeps a leading U+FEFF as text, as Rust's str::from_utf8 does (a TextDecoder strips it
// by default, so "\uFEFFa" and "a" would decode alike).
const strictUtf8 = new TextDecoder('utf-8', { fatal: true, ignoreBOM: true });
const lossyUtf8 = new TextDecoder('utf-8', { ignoreBOM: true });
const encoder = new TextEncoder();

/** UTF-8 bytes of a string. */
export function utf8(string) {
  return encoder.encode(string);
}

/**
 * `bytes` as text. Strict by default (`undefined` for bytes that are not UTF-8); with
 * `{ lossy: true }` each ill-formed sequence becomes U+FFFD, as Rust's `String::from_utf8_lossy`
 * does.
 * @param {Uint8Array} bytes
 * @param {{lossy?: boolean}} [options]
 * @returns {string | undefined}
 */
export function text(bytes, { lossy = false } = {}) {
  if (lossy) return lossyUtf8.decode(bytes);
  try {
    return strictUtf8.decode(bytes);
  } catch {
    return undefined;
  }
}

export const json = {
  /**
   * The JSON value in `bytes` (UTF-8), or `undefined` when they are not valid UTF-8 or not JSON.
   * @param {Uint8Array} bytes
   * @returns {unknown}
   */
  parse(bytes) {
    try {
      return JSON.parse(strictUtf8.decode(bytes));
    } catch {
      return undefined;
    }
  },

  /**
   * Compact JSON of `value` as UTF-8 bytes, for a query's answer.
   * @param {unknown} value
   * @returns {Uint8Array}
   */
  bytes(value) {
    return encoder.encode(JSON.stringify(value));
  },
};

// ---- Logging ------------------------------------------------------------------------------------

function show(arg) {
  if (typeof arg === 'string') return arg;
  if (arg instanceof Error) return arg.stack || String(arg);
  if (arg !== null && typeof arg === 'object') return toJson(arg);
  return String(arg);
}

function toJson(arg) {
  try {
    return JSON.stringify(arg, (_, v) => (typeof v === 'bigint' ? v.toString() : v)) ?? String(arg);
  } catch {
    return String(arg); // a cycle
  }
}

/**
 * printf-like: %s (text), %d and %i (a number), %j and %o (JSON), %% (a percent sign). Arguments
 * left over are appended, separated by spaces, and a message that is not a string is shown like
 * them, as Node's util.format does.
 */
export function format(message, ...args) {
  if (typeof message !== 'string') return [message, ...args].map(show).join(' ');
  let i = 0;
  let out = message.replace(/%[sdijoO%]/g, (spec) => {
    if (spec === '%%') return '%';
    if (i >= args.length) return spec;
    const arg = args[i++];
    switch (spec) {
      case '%s':
        return show(arg);
      case '%d':
        return typeof arg === 'bigint' ? arg.toString() : String(Number(arg));
      case '%i':
        return typeof arg === 'bigint' ? arg.toString() : String(Math.trunc(Number(arg)));
      default:
        return toJson(arg);
    }
  });
  for (; i < args.length; i++) out += ' ' + show(args[i]);
  return out;
}

const LEVELS = ['trace', 'debug', 'info', 'warn', 'error'];

/** Logging into the host's log, which tags each line with the guest's name. */
export const log = {
  /** @param {'trace'|'debug'|'info'|'warn'|'error'} level */
  log(level, message, ...args) {
    if (!LEVELS.includes(level)) throw new TypeError(`log level ${level}: one of ${LEVELS.join(', ')}`);
    rawLog(level, format(message, ...args));
  },
  trace: (message, ...args) => rawLog('trace', format(message, ...args)),
  debug: (message, ...args) => rawLog('debug', format(message, ...args)),
  info: (message, ...args) => rawLog('info', format(message, ...args)),
  warn: (message, ...args) => rawLog('warn', format(message, ...args)),
  error: (message, ...args) => rawLog('error', format(message, ...args)),
};

// ---- The committed fold -------------------------------------------------------------------------

function entry(raw) {
  return { key: raw.key, value: raw.value, revision: Number(raw.revision) };
}

/** The host caps a page at 10 000 entries; a smaller default keeps one page's memory modest. */
const DEFAULT_PAGE = 1000;

/**
 * Read access to the host's committed fold (the raw bytes of the bucket as of the last committed
 * batch, never the batch being applied).
 */
export const fold = {
  /**
   * The live entry for `key`, or `undefined`.
   * @param {string} key
   * @returns {{key: string, value: Uint8Array, revision: number} | undefined}
   */
  get(key) {
    const raw = rawFold.get(key);
    return raw === undefined || raw === null ? undefined : entry(raw);
  },

  /**
   * One page of the entries whose key starts with `prefix`, in key order, strictly after
   * `startAfter` when given. The host caps `limit`, so a short page is not the end: page on with
   * the last key as `startAfter` until a page comes back empty (or use `scanAll`).
   * @param {string} prefix
   * @param {{startAfter?: string, limit?: number}} [options]
   */
  scan(prefix, { startAfter, limit = DEFAULT_PAGE } = {}) {
    return rawFold.scan(prefix, startAfter, limit).map(entry);
  },

  /**
   * Every entry whose key starts with `prefix`, in key order, a page at a time.
   * @param {string} prefix
   * @param {{pageSize?: number}} [options]
   */
  *scanAll(prefix, { pageSize = DEFAULT_PAGE } = {}) {
    let startAfter;
    for (;;) {
      const page = fold.scan(prefix, { startAfter, limit: pageSize });
      if (page.length === 0) return;
      yield* page;
      startAfter = page[page.length - 1].key;
    }
  },
};

// ---- The folder export --------------------------------------------------------------------------

/** The error string a WIT `result` carries for a thrown value. */
function message(e) {
  return e instanceof Error ? e.message : String(e);
}

/**
 * `key` without the first scope prefix (in the manifest's order) it starts with, as the Rust SDK's
 * `Manifest::strip`; `undefined` when outside the scope. An empty scope is the whole bucket.
 */
function stripScope(scope, key) {
  if (scope.length === 0) return key;
  const prefix = scope.find((p) => key.startsWith(p));
  return prefix === undefined ? undefined : key.slice(prefix.length);
}

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
 * @param {(key: string, value: Uint8Array, rest: string) => Accept | typeof SKIP | typeof DEFER} guest.parse
 *   decodes one put in scope; must not change the guest's state (the host may fail the batch
 *   before `apply`)
 * @param {(changes: object[]) => void} guest.apply applies what the last parse accepted, in order
 * @param {(cursor: number) => void} [guest.onApplied] the host committed everything through cursor
 * @param {(request: Uint8Array) => Uint8Array | string} [guest.query] a string answer is sent as UTF-8
 */
export function exportFolder(guest) {
  const { name, version, scope = [] } = guest.manifest ?? {};
  if (typeof name !== 'string' || typeof version !== 'string') {
    throw new TypeError('exportFolder: manifest needs a name and a version (strings)');
  }
  if (typeof guest.parse !== 'function' || typeof guest.apply !== 'function') {
    throw new TypeError('exportFolder: parse and apply are required');
  }
  const prefixes = [...scope];
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
        const revision = Number(batch[i].revision);
        const rest = stripScope(prefixes, key);
        if (rest === undefined) {
          verdicts[i] = 'skip';
        } else if (op !== 'put') {
          // A delete or a purge: nothing to decode.
          pending.push({ op: 'delete', key, rest, revision });
          verdicts[i] = 'accept';
        } else {
          let verdict;
          try {
            verdict = guest.parse(key, value, rest);
          } catch (e) {
            rawLog('error', `parse threw on ${JSON.stringify(key)}: ${message(e)}`);
            throw e;
          }
          if (verdict instanceof Accept) {
            pending.push({ op: 'put', key, rest, revision, value: verdict.value });
            verdicts[i] = 'accept';
          } else if (verdict === SKIP) {
            verdicts[i] = 'skip';
          } else if (verdict === DEFER) {
            verdicts[i] = 'defer';
          } else {
            const e = `parse returned ${String(verdict)} for ${JSON.stringify(key)}: return accept(value), SKIP or DEFER`;
            rawLog('error', e);
            throw new TypeError(e);
          }
        }
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
      if (typeof guest.query !== 'function') throw 'this guest answers no queries';
      let answer;
      try {
        answer = guest.query(request);
      } catch (e) {
        throw message(e);
      }
      if (typeof answer === 'string') return encoder.encode(answer);
      if (answer instanceof Uint8Array) return answer;
      if (answer instanceof ArrayBuffer) return new Uint8Array(answer);
      throw `query returned ${String(answer)}: return a Uint8Array or a string`;
    },
  };
}
