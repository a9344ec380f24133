#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| foldhost_core::fuzzing::stored_record(data));
