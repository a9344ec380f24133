#!/usr/bin/env node
// Builds a JavaScript foldhost guest into a WebAssembly component, in two steps:
//
//   1. rolldown bundles the guest's entry module with this SDK (its `import ... from
//      'foldhost-guest'` resolves to foldhost-guest.js here, `'foldhost-guest/state'` to
//      foldhost-guest-state.js) and any pure-JS modules it imports, into one ES module. The WIT
//      imports (`foldhost:guest/...@VERSION`) stay imports.
//   2. componentize-js (StarlingMonkey, SpiderMonkey in wasm) makes that module a component of the
//      world `guest` in the WIT directory, without the http and fetch-event features: with them the
//      component imports wasi:http, which the host refuses.
//
// The contract is the one the bundle's WIT imports name: 0.1.0 for a guest of 'foldhost-guest',
// 0.3.0 for one of 'foldhost-guest/state' (state buckets, docs/state.md). A guest importing both
// is refused, and so is a WIT_DIR whose package is another version than the bundle's imports.
//
// Why bundle: componentize-js 0.23 does load relative imports itself, but only of files inside one
// directory it maps into the build (the working directory when the source lies under it, else the
// source's own directory; and a working directory of `/` breaks its path handling). A guest project
// outside the checkout could not reach the SDK that way; a bundle is one self-contained file.
//
// Usage: node build.mjs ENTRY.js OUT.wasm [WIT_DIR]
//   WIT_DIR defaults to the checkout's WIT of the bundle's contract: wit/ (../../wit from here)
//   for 0.1.0, wit/vX.Y.Z/ for another (wit/v0.3.0/). Prints nothing on success.
//   When wasm-tools is on PATH, the component's imports are checked: no wasi:http, no wasi:sockets.
//
// The toolchain is pinned in package.json / package-lock.json here: `npm ci` in this directory
// (scripts/setup.sh does it).

import { execFileSync } from 'node:child_process';
import { mkdtemp, mkdir, readFile, readdir, rm, stat, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';

const here = dirname(fileURLToPath(import.meta.url));

async function main() {
  const [entryArg, outArg, witArg] = process.argv.slice(2);
  if (!entryArg || !outArg) {
    console.error('usage: node build.mjs ENTRY.js OUT.wasm [WIT_DIR]');
    process.exit(2);
  }
  const entry = resolve(entryArg);
  const out = resolve(outArg);

  let rolldown, componentize;
  try {
    ({ rolldown } = await import('rolldown'));
    ({ componentize } = await import('@bytecodealliance/componentize-js'));
  } catch (e) {
    console.error(`build.mjs: the JS toolchain is missing (${e.message}): run \`npm ci\` in ${here} (scripts/setup.sh does)`);
    process.exit(1);
  }

  // 1. One module: the guest, the SDK, and whatever else the guest imports.
  const bundle = await rolldown({
    input: entry,
    platform: 'browser', // StarlingMonkey is web-like: TextEncoder, no Node built-ins
    external: [/^foldhost:guest\//],
    // One entry module per contract (see above).
    resolve: {
      alias: {
        'foldhost-guest/state': join(here, 'foldhost-guest-state.js'),
        'foldhost-guest': join(here, 'foldhost-guest.js'),
      },
    },
  });
  const { output } = await bundle.generate({ format: 'esm' });
  await bundle.close();
  if (output.length !== 1) throw new Error(`the bundle has ${output.length} chunks; a guest must make one`);

  const contract = contractOf(output[0].code);
  const wit = resolve(witArg ?? defaultWit(contract));
  await checkWit(wit, contract);

  // 2. The component. componentize-js maps the source's directory into its build, so the bundle
  // gets a fresh directory of its own, which is also the working directory (see above).
  const work = await mkdtemp(join(tmpdir(), 'foldhost-js-'));
  const cwd = process.cwd();
  try {
    await writeFile(join(work, 'guest.js'), output[0].code);
    process.chdir(work);
    const { component } = await componentize({
      sourcePath: join(work, 'guest.js'),
      witPath: wit,
      worldName: 'guest',
      disableFeatures: ['http', 'fetch-event'],
    });
    await mkdir(dirname(out), { recursive: true });
    await writeFile(out, component);
  } finally {
    process.chdir(cwd);
    await rm(work, { recursive: true, force: true });
  }

  checkImports(out);
}

/**
 * The contract version the bundle's `foldhost:guest/...@VERSION` imports name, or `undefined` when
 * it imports none. Two versions: the guest imports both entry modules, which no world has.
 */
function contractOf(code) {
  const versions = new Set([...code.matchAll(/\b(?:from|import)\s*["']foldhost:guest\/[a-z-]+@([^"']+)["']/g)].map((m) => m[1]));
  if (versions.size > 1) {
    throw new Error(
      `the guest imports contracts ${[...versions].sort().join(' and ')} at once: import from 'foldhost-guest' ` +
        `(0.1.0) or from 'foldhost-guest/state' (0.3.0), not both`,
    );
  }
  return [...versions][0];
}

/** The checkout's WIT directory of `contract`: wit/ holds 0.1.0, wit/vX.Y.Z/ the others. */
function defaultWit(contract) {
  const root = join(here, '..', '..', 'wit');
  return contract === undefined || contract === '0.1.0' ? root : join(root, `v${contract}`);
}

/** Refuses a WIT directory (or file) whose `package foldhost:guest@VERSION` is not `contract`. */
async function checkWit(wit, contract) {
  if (contract === undefined) return;
  let files;
  try {
    files = (await stat(wit)).isDirectory()
      ? (await readdir(wit)).filter((f) => f.endsWith('.wit')).map((f) => join(wit, f))
      : [wit];
  } catch {
    return; // componentize-js names a missing WIT itself
  }
  for (const file of files) {
    const m = /^\s*package\s+foldhost:guest@([^;\s]+)\s*;/m.exec(await readFile(file, 'utf8'));
    if (m && m[1] !== contract) {
      throw new Error(
        `${wit} is the contract foldhost:guest@${m[1]}, the guest imports @${contract} ` +
          `(${contract === '0.1.0' ? "'foldhost-guest'" : "'foldhost-guest/state'"}): pass ${defaultWit(contract)}`,
      );
    }
  }
}

/** Refuses a component importing the network (the host links no wasi:http; sockets have no use). */
function checkImports(wasm) {
  let wit;
  try {
    wit = execFileSync('wasm-tools', ['component', 'wit', wasm], { encoding: 'utf8', maxBuffer: 64 << 20 });
  } catch (e) {
    if (e.code === 'ENOENT') return; // no wasm-tools: the host's own check at load still applies
    throw e;
  }
  const imports = [...wit.matchAll(/^\s*import ([^;]*);/gm)].map((m) => m[1]);
  const refused = imports.filter((i) => i.startsWith('wasi:http/') || i.startsWith('wasi:sockets/'));
  if (refused.length > 0) {
    throw new Error(`${wasm} imports ${refused.join(', ')}: a guest may not use the network`);
  }
}

main().catch((e) => {
  console.error(`build.mjs: ${e.stack ?? e}`);
  process.exit(1);
});
