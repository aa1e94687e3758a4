#![no_main]
//! See `rdma_rpc_fuzz::codec`.
libfuzzer_sys::fuzz_target!(|data: &[u8]| rdma_rpc_fuzz::codec::run(data));
