// router-js: the router guest (guests/router) in JavaScript, with the same answers byte for byte.
//
// Keys `route.<host>` hold JSON `{"upstream": "<addr>"}`. A query's request is a host name (UTF-8);
// the answer is `{"upstream":"<addr>"}`, or the error `unknown host: <name>`.
//
// The key's current value is the truth: a put whose value is not such a route (unparseable, no
// `upstream` string, an empty one) removes the host's route, exactly as if the router were rebuilt
// from the fold. A key with an empty host (`route.`) is skipped.
//
// Why a hand-written decoder instead of JSON.parse: the Rust router decodes with serde_json into
// `struct Route { upstream: String }`, and a host may run either guest over the same bucket, so the
// two must agree on every value. serde_json differs from JSON.parse at the edges: it refuses a
// duplicate "upstream" (JSON.parse keeps the last), takes the one-element array form
// `["<addr>"]`, refuses lone surrogate escapes and ill-formed UTF-8 in the strings it decodes (the
// keys and the upstream) but not in the values it skips. decodeRoute reproduces that, as
// guests/router-c/router.c does in C.

import { exportFolder, accept, SKIP, text, json } from 'foldhost-guest';

const PREFIX = 'route.';

/** host -> upstream. */
const routes = new Map();

export const folder = exportFolder({
  manifest: { name: 'router-js', version: '0.1.0', scope: [PREFIX] },

  // The value is the upstream, or null for a value that is not a route (the host has no route).
  parse(key, value, host) {
    return host === '' ? SKIP : accept(decodeRoute(value));
  },

  apply(changes) {
    for (const change of changes) {
      if (change.op === 'put' && change.value !== null) routes.set(change.rest, change.value);
      else routes.delete(change.rest);
    }
  },

  query(request) {
    // Lossy, as the Rust router's String::from_utf8_lossy: the error names what was asked.
    const host = text(request, { lossy: true });
    const upstream = routes.get(host);
    if (upstream === undefined) throw `unknown host: ${host}`;
    // JSON.stringify escapes a well-formed string exactly as serde_json does (\" \\ \b \f \n \r
    // \t, \u00xx for the other controls, nothing else), and decodeRoute only keeps well-formed ones.
    return json.bytes({ upstream });
  },
});

// ---- serde_json's reading of a route value ------------------------------------------------------

const NOT_A_ROUTE = Symbol('not a route');
const strictUtf8 = new TextDecoder('utf-8', { fatal: true, ignoreBOM: true });

function fail() {
  throw NOT_A_ROUTE;
}

/** A read position in the value's bytes; past the end, peek() is -1. */
class Reader {
  constructor(bytes) {
    this.b = bytes;
    this.i = 0;
  }
  peek() {
    return this.i < this.b.length ? this.b[this.i] : -1;
  }
  eat(c) {
    if (this.peek() !== c) return false;
    this.i++;
    return true;
  }
  expect(c) {
    if (!this.eat(c)) fail();
  }
  /** JSON's four whitespace bytes. */
  ws() {
    for (let c = this.peek(); c === 0x20 || c === 0x0a || c === 0x09 || c === 0x0d; c = this.peek()) this.i++;
  }
}

/** Four hex digits (either case) after `\u`. */
function hex4(r) {
  let v = 0;
  for (let k = 0; k < 4; k++) {
    const c = r.peek();
    const d =
      c >= 0x30 && c <= 0x39 ? c - 0x30
      : c >= 0x61 && c <= 0x66 ? c - 0x57
      : c >= 0x41 && c <= 0x46 ? c - 0x37
      : -1;
    if (d < 0) fail();
    r.i++;
    v = v * 16 + d;
  }
  return v;
}

/** One escape, after its backslash. Strict: decoded (surrogates must pair); else only checked. */
function readEscape(r, strict) {
  const c = r.peek();
  r.i++;
  switch (c) {
    case 0x22: return '"';
    case 0x5c: return '\\';
    case 0x2f: return '/';
    case 0x62: return '\b';
    case 0x66: return '\f';
    case 0x6e: return '\n';
    case 0x72: return '\r';
    case 0x74: return '\t';
    case 0x75: {
      const u = hex4(r);
      if (!strict) return ''; // serde_json's ignore_str takes any four hex digits
      if (u >= 0xdc00 && u <= 0xdfff) fail(); // a low surrogate first
      if (u < 0xd800 || u > 0xdbff) return String.fromCharCode(u);
      r.expect(0x5c);
      r.expect(0x75);
      const low = hex4(r);
      if (low < 0xdc00 || low > 0xdfff) fail();
      return String.fromCharCode(u, low);
    }
    default:
      return fail(); // not one of JSON's escapes (or the end)
  }
}

/**
 * A string's body, the reader just past its opening quote, through the closing quote. Strict (as
 * serde_json's parse_str, for what it decodes): raw bytes must be well-formed UTF-8, and the text
 * is returned. Not strict (its ignore_str, for skipped values): any raw bytes but controls.
 * Controls U+0000..U+001F are refused raw in both.
 */
function readString(r, strict) {
  let out = '';
  let run = r.i; // the start of the current run of raw bytes
  for (;;) {
    const c = r.peek();
    if (c < 0x20) fail(); // a control, or the end inside the string
    if (c !== 0x22 && c !== 0x5c) {
      r.i++;
      continue;
    }
    // An escape decodes to whole characters, so each raw run is checked on its own.
    if (strict) {
      try {
        out += strictUtf8.decode(r.b.subarray(run, r.i));
      } catch {
        fail();
      }
    }
    r.i++;
    if (c === 0x22) return out;
    out += readEscape(r, strict);
    run = r.i;
  }
}

function word(r, rest) {
  for (let k = 0; k < rest.length; k++) r.expect(rest.charCodeAt(k));
}

function digits(r) {
  const start = r.i;
  for (let c = r.peek(); c >= 0x30 && c <= 0x39; c = r.peek()) r.i++;
  return r.i > start;
}

/** A number without its '-': no leading zeros; a fraction and an exponent need a digit each. */
function skipNumber(r) {
  if (r.eat(0x30)) {
    const c = r.peek();
    if (c >= 0x30 && c <= 0x39) fail();
  } else if (!digits(r)) {
    fail();
  }
  if (r.eat(0x2e) && !digits(r)) fail();
  if (r.eat(0x65) || r.eat(0x45)) {
    if (!r.eat(0x2b)) r.eat(0x2d);
    if (!digits(r)) fail();
  }
}

/**
 * Skips one value the router ignores, as serde_json's ignore_value: iteratively (it has no nesting
 * limit, so neither has this), strings checked leniently.
 */
function skipValue(r) {
  const open = []; // the enclosing brackets, innermost last
  for (;;) {
    r.ws();
    const c = r.peek();
    let opened = false;
    if (c >= 0x30 && c <= 0x39) {
      skipNumber(r);
    } else {
      r.i++;
      switch (c) {
        case 0x6e: word(r, 'ull'); break;
        case 0x74: word(r, 'rue'); break;
        case 0x66: word(r, 'alse'); break;
        case 0x22: readString(r, false); break;
        case 0x2d: skipNumber(r); break;
        case 0x5b:
        case 0x7b:
          open.push(c);
          opened = true;
          break;
        default:
          fail(); // not the start of a value
      }
    }
    if (open.length === 0) return; // a scalar
    // After a value: a comma, or closers. Right after an opener: a closer, or a first member.
    let wantComma = !opened;
    for (;;) {
      r.ws();
      const next = r.peek();
      const top = open[open.length - 1];
      if (next === 0x2c && wantComma) {
        r.i++;
        break;
      }
      if ((next === 0x5d && top === 0x5b) || (next === 0x7d && top === 0x7b)) {
        r.i++;
        open.pop();
        if (open.length === 0) return;
        wantComma = true;
        continue;
      }
      if (next < 0 || wantComma) fail();
      break;
    }
    if (open[open.length - 1] === 0x7b) {
      r.ws();
      r.expect(0x22);
      readString(r, false);
      r.ws();
      r.expect(0x3a);
    }
  }
}

/** A strict string value where the reader is (after whitespace). */
function stringValue(r) {
  r.ws();
  r.expect(0x22);
  return readString(r, true);
}

/**
 * The upstream of a route value, or null when serde_json would not decode it into the Rust router's
 * `Route` or the upstream is empty.
 * @param {Uint8Array} bytes
 * @returns {string | null}
 */
// The common case, decided exactly without the reader below: one object holding only the key
// "upstream" with a string that has no escape and no control character, nothing but JSON's
// whitespace around. serde_json reads such a value as exactly the characters between the quotes.
// Everything else — escapes, other keys, the array form, a BOM, bytes that are not UTF-8 — takes
// the full reader. (The reader runs byte by byte in an interpreter; the pattern in the engine.)
const SIMPLE_ROUTE =
  /^[ \t\n\r]*\{[ \t\n\r]*"upstream"[ \t\n\r]*:[ \t\n\r]*"([^"\\\u0000-\u001f]*)"[ \t\n\r]*\}[ \t\n\r]*$/;

function simpleRoute(bytes) {
  let text;
  try {
    text = strictUtf8.decode(bytes);
  } catch {
    return undefined;
  }
  const m = SIMPLE_ROUTE.exec(text);
  return m === null ? undefined : m[1];
}

export function decodeRoute(bytes) {
  const simple = simpleRoute(bytes);
  if (simple !== undefined) return simple === '' ? null : simple;
  return decodeRouteFully(bytes);
}

/** decodeRoute without the fast path: the reader alone (the tests hold the two to agreement). */
export function decodeRouteFully(bytes) {
  const r = new Reader(bytes);
  try {
    let upstream;
    r.ws();
    if (r.eat(0x5b)) {
      // serde's derived visit_seq: exactly one element, the upstream string.
      upstream = stringValue(r);
      r.ws();
      r.expect(0x5d);
    } else if (r.eat(0x7b)) {
      for (let first = true; ; first = false) {
        r.ws();
        if (r.eat(0x7d)) break;
        if (!first) {
          r.expect(0x2c);
          r.ws();
        }
        r.expect(0x22);
        const key = readString(r, true); // keys are decoded (escapes too) before the comparison
        r.ws();
        r.expect(0x3a);
        if (key !== 'upstream') {
          skipValue(r);
        } else if (upstream !== undefined) {
          fail(); // serde: duplicate field
        } else {
          upstream = stringValue(r);
        }
      }
      if (upstream === undefined) fail(); // serde: missing field
    } else {
      fail();
    }
    r.ws();
    if (r.i !== bytes.length) fail(); // serde_json: trailing characters
    return upstream === '' ? null : upstream;
  } catch (e) {
    if (e === NOT_A_ROUTE) return null;
    throw e;
  }
}
