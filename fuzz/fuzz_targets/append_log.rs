#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| foldhost_core::fuzzing::append_log(data));
