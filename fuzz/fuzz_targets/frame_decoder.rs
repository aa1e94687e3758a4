#![no_main]
//! See `rdma_rpc_fuzz::frame`.
libfuzzer_sys::fuzz_target!(|data: &[u8]| rdma_rpc_fuzz::frame::run(data));
