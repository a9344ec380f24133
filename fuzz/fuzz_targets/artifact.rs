#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| foldhost_artifact::fuzzing::artifact(data));
