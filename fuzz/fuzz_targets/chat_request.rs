#![no_main]
libfuzzer_sys::fuzz_target!(init: brook_fuzz::init(), |data: &[u8]| brook_fuzz::chat_request(data));
