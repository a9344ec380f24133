;; A hostile component: it imports an interface no foldhost host provides (a way out to the
;; network). The host must refuse it at load, naming the import, before running anything.
(component
  (import "evil:net/exfil@1.0.0" (instance
    (export "send" (func (param "data" (list u8))))
  ))
)
