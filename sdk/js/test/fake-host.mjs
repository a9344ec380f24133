// Runs the JS SDK and JS guests under Node, outside any component: `node --import
// sdk/js/test/fake-host.mjs --test ...`. The WIT imports (foldhost:guest/fold, foldhost:guest/log,
// and for contract 0.3.0 foldhost:guest/state) become fakes over globalThis.foldhostFake, and the
// bare specifiers 'foldhost-guest' and 'foldhost-guest/state' resolve to the SDK's two entry
// modules, as sdk/js/build.mjs resolves them when it bundles a guest.
import { register } from 'node:module';

globalThis.foldhostFake = {
  /** key -> { value: Uint8Array, revision: number }: the committed fold. */
  entries: new Map(),
  /** [level, message] pairs, as the guest logged them. */
  logs: [],
  /** The most entries one scan answers (the host caps pages too). */
  pageCap: 10_000,

  // ---- The state buckets (contract 0.3.0; docs/state.md) ----
  /**
   * bucket -> (key -> { value: Uint8Array, revision: number }): the host's committed folds of the
   * buckets the guest declares, each named as the guest names it (its own by name, another
   * module's as `<module>.<name>`). A bucket absent here is refused as `undeclared`; one whose name
   * has a `.` is another module's, so a write to it is refused as `read_only`.
   */
  state: new Map(),
  /**
   * Every write the guest made, in order: { verb: 'put' | 'delete', bucket, key, value?, options }
   * (`options` as the guest's bindings lowered them: u64 as BigInt, none as undefined), refused
   * ones included (with `refused: reason`).
   */
  writes: [],
  /**
   * When set, `(verb, bucket, key) => ({ reason, message }) | undefined`: a refusal the host would
   * make (`wrong_call`, `too_large`, `bucket_full`, ...) before the fake's own checks.
   */
  refuse: undefined,
  /** The last revision a fake write took (writes are applied at once, answered `applied`). */
  stateRevision: 0,
};

register('./hooks.mjs', import.meta.url);
