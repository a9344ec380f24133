;; hostile-four-memories: four linear memories; `init` grows each by 9 MiB. Under a 32 MiB cap the
;; fourth grow passes the cap only counted across memories: the host must refuse it (a trap naming
;; the memory cap), where a per-memory cap would let it hold 4 × the cap.
;;
;; A core module implementing the canonical ABI of foldhost:guest/folder@0.1.0 (wit/guest.wit) by
;; hand; guests/hostile-wat/build.sh makes it a component. Everything but `init` is inert.
(module
  (memory (export "memory") 1)
  (memory $m1 1)
  (memory $m2 1)
  (memory $m3 1)
  (global $bump (mut i32) (i32.const 4096))
  ;; name "hostile-4-memories" at 16, version "0.1.0" at 48
  (data (i32.const 16) "hostile-4-memories")
  (data (i32.const 48) "0.1.0")
  ;; guest-manifest record at 64: name (16, 18), version (48, 5), scope (0, 0)
  (data (i32.const 64) "\10\00\00\00\12\00\00\00\30\00\00\00\05\00\00\00\00\00\00\00\00\00\00\00")
  ;; 128..: zeroes — an ok result<_, string>, an empty list<verdict>
  (func (export "cabi_realloc") (param i32 i32 i32 i32) (result i32)
    (local $p i32)
    ;; align up, bump
    (local.set $p
      (i32.and
        (i32.add (global.get $bump) (i32.sub (local.get 2) (i32.const 1)))
        (i32.xor (i32.sub (local.get 2) (i32.const 1)) (i32.const -1))))
    (global.set $bump (i32.add (local.get $p) (local.get 3)))
    (if (i32.gt_u (global.get $bump) (i32.mul (memory.size) (i32.const 65536)))
      (then (drop (memory.grow (i32.add (i32.div_u (local.get 3) (i32.const 65536)) (i32.const 1))))))
    (local.get $p))
  (func (export "foldhost:guest/folder@0.1.0#manifest") (result i32)
    (i32.const 64))
  (func (export "foldhost:guest/folder@0.1.0#init") (param i32 i32) (result i32)
    (drop (memory.grow $m1 (i32.const 144)))
    (drop (memory.grow $m2 (i32.const 144)))
    (drop (memory.grow $m3 (i32.const 144)))
    (drop (memory.grow 0 (i32.const 144)))
    (i32.const 128))
  (func (export "foldhost:guest/folder@0.1.0#parse") (param i32 i32) (result i32)
    (i32.const 128))
  (func (export "foldhost:guest/folder@0.1.0#apply") (result i32)
    (i32.const 128))
  (func (export "foldhost:guest/folder@0.1.0#on-applied") (param i64))
  (func (export "foldhost:guest/folder@0.1.0#query") (param i32 i32) (result i32)
    (i32.const 128))
)
