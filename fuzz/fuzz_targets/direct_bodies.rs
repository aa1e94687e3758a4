#![no_main]
//! See `rdma_rpc_fuzz::direct`.
libfuzzer_sys::fuzz_target!(|data: &[u8]| rdma_rpc_fuzz::direct::run(data));
