//! libFuzzer entry point: see `kvlb_fuzz::checks::http_response` for what is checked.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvlb_fuzz::checks::http_response(data));
