// Module resolution hooks for fake-host.mjs (they run on Node's loader thread; the fake modules'
// code runs on the main thread, where globalThis.foldhostFake lives).
const sdk = new URL('../foldhost-guest.js', import.meta.url).href;
const sdkState = new URL('../foldhost-guest-state.js', import.meta.url).href;

// As componentize-js's bindings hand them over: u64 as BigInt, option as undefined; for contract
// 0.3.0 also bytes as Uint8Arrays of another realm (the bindings' own), which `instanceof` in the
// guest misses: the 0.3.0 SDK must not rely on it. (The 0.1.0 fakes keep this realm's bytes.)
const foreign = `
    import { runInNewContext } from 'node:vm';
    const Foreign = runInNewContext('Uint8Array');
    const bytes = (b) => new Foreign(b);`;

const foldOf = (foreignBytes) => `
    ${foreignBytes ? foreign : 'const bytes = (b) => b;'}
    const fake = () => globalThis.foldhostFake;
    const raw = (key, e) => ({ key, value: bytes(e.value), revision: BigInt(e.revision) });
    export function get(key) {
      const e = fake().entries.get(key);
      return e === undefined ? undefined : raw(key, e);
    }
    export function scan(prefix, startAfter, limit) {
      const keys = [...fake().entries.keys()]
        .filter((k) => k.startsWith(prefix) && (startAfter === undefined || k > startAfter))
        .sort();
      return keys.slice(0, Math.min(limit, fake().pageCap)).map((k) => raw(k, fake().entries.get(k)));
    }`;

const log = `
    export function log(level, message) {
      globalThis.foldhostFake.logs.push([level, message]);
    }`;

// The state verbs over foldhostFake.state. A refusal is thrown as componentize-js throws a WIT
// result's error: an Error whose own property `payload` is the error value (jco's ComponentError).
const state = `
    ${foreign}
    const fake = () => globalThis.foldhostFake;
    class ComponentError extends Error {
      constructor(value) {
        super(typeof value === 'string' ? value : String(value) + ' (see error.payload)');
        Object.defineProperty(this, 'payload', { value, enumerable: typeof value !== 'string' });
      }
    }
    const refuse = (reason, message) => { throw new ComponentError({ reason, message }); };
    function folded(verb, bucket, key) {
      const refusal = fake().refuse?.(verb, bucket, key);
      if (refusal) refuse(refusal.reason, refusal.message);
      const entries = fake().state.get(bucket);
      if (entries === undefined) refuse('undeclared', 'bucket ' + JSON.stringify(bucket) + ' is not in the manifest');
      return entries;
    }
    function write(verb, bucket, key, value, options) {
      const record = { verb, bucket, key, ...(value === undefined ? {} : { value }), options };
      fake().writes.push(record);
      try {
        const entries = folded(verb, bucket, key);
        if (bucket.includes('.')) refuse('read_only', 'bucket ' + JSON.stringify(bucket) + ' is only read');
        const current = entries.get(key)?.revision ?? 0;
        if (options.ifRevision !== undefined && options.ifRevision !== BigInt(current)) {
          refuse('conflict', key + ' is at revision ' + current + ', not ' + options.ifRevision);
        }
      } catch (e) {
        record.refused = e.payload?.reason;
        throw e;
      }
      const revision = ++fake().stateRevision;
      if (value === undefined) fake().state.get(bucket).delete(key);
      else fake().state.get(bucket).set(key, { value, revision });
      return { outcome: 'applied', opId: options.opId ?? 'op-' + revision, revision: BigInt(revision) };
    }
    export function get(bucket, key) {
      const e = folded('get', bucket, key).get(key);
      return e === undefined ? undefined : { key, value: bytes(e.value), revision: BigInt(e.revision) };
    }
    export function keys(bucket, prefix, startAfter, limit) {
      return [...folded('keys', bucket, prefix).keys()]
        .filter((k) => k.startsWith(prefix) && (startAfter === undefined || k > startAfter))
        .sort()
        .slice(0, Math.min(limit, fake().pageCap));
    }
    export function put(bucket, key, value, options) {
      return write('put', bucket, key, value, options);
    }
    function del(bucket, key, options) {
      return write('delete', bucket, key, undefined, options);
    }
    export { del as delete };`;

const fakes = {
  'foldhost:guest/fold@0.1.0': foldOf(false),
  'foldhost:guest/log@0.1.0': log,
  'foldhost:guest/fold@0.3.0': foldOf(true),
  'foldhost:guest/log@0.3.0': log,
  'foldhost:guest/state@0.3.0': state,
};

export async function resolve(specifier, context, next) {
  if (Object.hasOwn(fakes, specifier)) return { url: specifier, shortCircuit: true };
  if (specifier === 'foldhost-guest') return { url: sdk, shortCircuit: true };
  if (specifier === 'foldhost-guest/state') return { url: sdkState, shortCircuit: true };
  return next(specifier, context);
}

export async function load(url, context, next) {
  if (Object.hasOwn(fakes, url)) return { format: 'module', source: fakes[url], shortCircuit: true };
  return next(url, context);
}
