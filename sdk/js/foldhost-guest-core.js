// foldhost-guest-core: what the JavaScript SDK's two entry modules share, with no WIT import of its
// own, so that it bundles into a guest of either contract:
//
//   foldhost-guest.js        (`import ... from 'foldhost-guest'`)        contract 0.1.0
//   foldhost-guest-state.js  (`import ... from 'foldhost-guest/state'`)  contract 0.3.0
//
// A guest imports one of those two, never this module: each re-exports what is here and binds
// `log` and `fold` to its own contract's imports. The behaviour documented in their headers lives
// here (verdicts, scope, one put's parse, query answers, text and JSON, log formatting).

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

/** What `parse` returns. @typedef {Accept | typeof SKIP | typeof DEFER} Verdict */

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
 * @overload
 * @param {Uint8Array} bytes
 * @param {{lossy: true}} options
 * @returns {string}
 */
/**
 * @overload
 * @param {Uint8Array} bytes
 * @param {{lossy?: boolean}} [options]
 * @returns {string | undefined}
 */
/**
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

/**
 * The `log` object over a contract's raw `log` import: logging into the host's log, which tags each
 * line with the guest's name.
 * @param {(level: string, message: string) => void} rawLog
 */
export function makeLog(rawLog) {
  return {
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
}

// ---- The committed fold -------------------------------------------------------------------------

/** A raw `entry` record with its revision as a Number. */
export function entryOf(raw) {
  return { key: raw.key, value: raw.value, revision: Number(raw.revision) };
}

/**
 * `bytes` as a Uint8Array of this realm. componentize-js's bindings hand every `list<u8>` over as a
 * Uint8Array of their own realm, which `instanceof Uint8Array` here misses (and so does anything
 * `slice`d from it): over its buffer when that is this realm's (no copy), else copied.
 */
export function ownBytes(bytes) {
  if (bytes instanceof Uint8Array) return bytes;
  if (bytes.buffer instanceof ArrayBuffer) return new Uint8Array(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  return new Uint8Array(bytes);
}

/** Whether `value` is a Uint8Array of any realm. */
export function isBytes(value) {
  return value instanceof Uint8Array || Object.prototype.toString.call(value) === '[object Uint8Array]';
}

/** The host caps a page at 10 000 entries; a smaller default keeps one page's memory modest. */
export const DEFAULT_PAGE = 1000;

/**
 * The `fold` object over a contract's raw `fold` import: read access to the host's committed fold
 * of the main bucket (the raw bytes as of the last committed batch, never the batch being applied).
 * @param {{get: Function, scan: Function}} rawFold
 * @param {(raw: object) => {key: string, value: Uint8Array, revision: number}} [entry] a raw entry
 *   as handed out
 */
export function makeFold(rawFold, entry = entryOf) {
  const fold = {
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
  return fold;
}

// ---- The folder export's pieces -----------------------------------------------------------------

/** The error string a WIT `result` carries for a thrown value. */
export function message(e) {
  return e instanceof Error ? e.message : String(e);
}

/**
 * `key` without the first scope prefix (in the manifest's order) it starts with, as the Rust SDK's
 * `Manifest::strip`; `undefined` when outside the scope. An empty scope is the whole bucket.
 */
export function stripScope(scope, key) {
  if (scope.length === 0) return key;
  const prefix = scope.find((p) => key.startsWith(p));
  return prefix === undefined ? undefined : key.slice(prefix.length);
}

/**
 * The name, version and scope of `guest.manifest`, checked; parse and apply checked to be there.
 * `who` names the caller in errors.
 */
export function checkGuest(guest, who) {
  const { name, version, scope = [] } = guest.manifest ?? {};
  if (typeof name !== 'string' || typeof version !== 'string') {
    throw new TypeError(`${who}: manifest needs a name and a version (strings)`);
  }
  if (typeof guest.parse !== 'function' || typeof guest.apply !== 'function') {
    throw new TypeError(`${who}: parse and apply are required`);
  }
  return { name, version, scope: [...scope] };
}

/**
 * One update of the main bucket: its verdict ('accept', 'skip' or 'defer'), and, when accepted, its
 * change pushed on `pending`. Outside `prefixes`: skip; a delete or purge in scope: accepted
 * without calling `guest.parse`. A throw from `guest.parse`, or a verdict that is none, is logged
 * through `rawLog` and thrown (it traps the instance).
 */
export function judge(guest, prefixes, rawLog, pending, key, value, op, revision) {
  const rest = stripScope(prefixes, key);
  if (rest === undefined) return 'skip';
  if (op !== 'put') {
    // A delete or a purge: nothing to decode.
    pending.push({ op: 'delete', key, rest, revision });
    return 'accept';
  }
  let verdict;
  try {
    verdict = guest.parse(key, value, rest);
  } catch (e) {
    rawLog('error', `parse threw on ${JSON.stringify(key)}: ${message(e)}`);
    throw e;
  }
  if (verdict instanceof Accept) {
    pending.push({ op: 'put', key, rest, revision, value: verdict.value });
    return 'accept';
  }
  if (verdict === SKIP) return 'skip';
  if (verdict === DEFER) return 'defer';
  const e = `parse returned ${String(verdict)} for ${JSON.stringify(key)}: return accept(value), SKIP or DEFER`;
  rawLog('error', e);
  throw new TypeError(e);
}

/**
 * `guest.query(request)` as the WIT's `result<list<u8>, string>`: bytes, or a thrown string. With
 * `anyRealm`, a Uint8Array of another realm (bytes the bindings handed over) is an answer too.
 */
export function answer(guest, request, { anyRealm = false } = {}) {
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
  if (anyRealm && isBytes(answer)) return ownBytes(answer);
  throw `query returned ${String(answer)}: return a Uint8Array or a string`;
}
