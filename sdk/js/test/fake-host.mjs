// Runs the JS SDK and JS guests under Node, outside any component: `node --import
// sdk/js/test/fake-host.mjs --test ...`. The WIT imports (foldhost:guest/fold, foldhost:guest/log)
// become fakes over globalThis.foldhostFake, and the bare specifier 'foldhost-guest' resolves to
// the SDK, as sdk/js/build.mjs resolves it when it bundles a guest.
import { register } from 'node:module';

globalThis.foldhostFake = {
  /** key -> { value: Uint8Array, revision: number }: the committed fold. */
  entries: new Map(),
  /** [level, message] pairs, as the guest logged them. */
  logs: [],
  /** The most entries one scan answers (the host caps pages too). */
  pageCap: 10_000,
};

register('./hooks.mjs', import.meta.url);
