#!/usr/bin/env node
// Builds a JavaScript foldhost guest into a WebAssembly component, in two steps:
//
//   1. rolldown bundles the guest's entry module with this SDK (its `import ... from
//      'foldhost-guest'` resolves to foldhost-guest.js here) and any pure-JS modules it imports,
//      into one ES module. The WIT imports (`foldhost:guest/...`) stay imports.
//   2. componentize-js (StarlingMonkey, SpiderMonkey in wasm) makes that module a component of the
//      world `guest` in the WIT directory, without the http and fetch-event features: with them the
//      component imports wasi:http, which the host refuses.
//
// Why bundle: componentize-js 0.23 does load relative imports itself, but only of files inside one
// directory it maps into the build (the working directory when the source lies under it, else the
// source's own directory; and a working directory of `/` breaks its path handling). A guest project
// outside the checkout could not reach the SDK that way; a bundle is one self-contained file.
//
// Usage: node build.mjs ENTRY.js OUT.wasm [WIT_DIR]
//   WIT_DIR defaults to the checkout's wit/ (../../wit from here). Prints nothing on success.
//   When wasm-tools is on PATH, the component's imports are checked: no wasi:http, no wasi:sockets.
//
// The toolchain is pinned in package.json / package-lock.json here: `npm ci` in this directory
// (scripts/setup.sh does it).

import { execFileSync } from 'node:child_process';
import { mkdtemp, mkdir, rm, writeFile } from 'node:fs/promises';
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
  const wit = resolve(witArg ?? join(here, '..', '..', 'wit'));

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
    resolve: { alias: { 'foldhost-guest': join(here, 'foldhost-guest.js') } },
  });
  const { output } = await bundle.generate({ format: 'esm' });
  await bundle.close();
  if (output.length !== 1) throw new Error(`the bundle has ${output.length} chunks; a guest must make one`);

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
