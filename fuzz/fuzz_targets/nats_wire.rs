#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| foldhost_nats::fuzzing::nats_wire(data));
