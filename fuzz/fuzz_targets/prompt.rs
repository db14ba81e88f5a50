//! libFuzzer entry point: see `kvlb_fuzz::checks::prompt` for what is checked.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvlb_fuzz::checks::prompt(data));
