//! Compile-fail tests of `#[rdma_service]`: every `tests/ui/*.rs` must fail to compile with
//! exactly the errors in its checked-in `.stderr`.
//!
//! After changing an error message, regenerate with `TRYBUILD=overwrite cargo test --test
//! macro_compile_fail` and read the new `.stderr` files before committing them.

#[test]
fn refused_shapes() {
    let cases = trybuild::TestCases::new();
    cases.compile_fail("tests/ui/*.rs");
}
