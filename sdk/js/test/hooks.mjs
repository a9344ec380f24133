// Module resolution hooks for fake-host.mjs (they run on Node's loader thread; the fake modules'
// code runs on the main thread, where globalThis.foldhostFake lives).
const sdk = new URL('../foldhost-guest.js', import.meta.url).href;

const fakes = {
  'foldhost:guest/fold@0.1.0': `
    const fake = () => globalThis.foldhostFake;
    // As the host's bindings hand them over: u64 as BigInt, option as undefined.
    const raw = (key, e) => ({ key, value: e.value, revision: BigInt(e.revision) });
    export function get(key) {
      const e = fake().entries.get(key);
      return e === undefined ? undefined : raw(key, e);
    }
    export function scan(prefix, startAfter, limit) {
      const keys = [...fake().entries.keys()]
        .filter((k) => k.startsWith(prefix) && (startAfter === undefined || k > startAfter))
        .sort();
      return keys.slice(0, Math.min(limit, fake().pageCap)).map((k) => raw(k, fake().entries.get(k)));
    }`,
  'foldhost:guest/log@0.1.0': `
    export function log(level, message) {
      globalThis.foldhostFake.logs.push([level, message]);
    }`,
};

export async function resolve(specifier, context, next) {
  if (Object.hasOwn(fakes, specifier)) return { url: specifier, shortCircuit: true };
  if (specifier === 'foldhost-guest') return { url: sdk, shortCircuit: true };
  return next(specifier, context);
}

export async function load(url, context, next) {
  if (Object.hasOwn(fakes, url)) return { format: 'module', source: fakes[url], shortCircuit: true };
  return next(url, context);
}
