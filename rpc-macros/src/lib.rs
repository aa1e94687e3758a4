//! `#[rdma_service]`: turns a trait of `async fn`s into an rdma-rpc service.
//!
//! Use it through the facade crate, `rdma_rpc::rdma_service`; the generated code names only
//! `::core` and `::rdma_rpc` paths, so the user crate needs no other dependency or import.
//!
//! For a trait `Store` the macro emits, next to the trait and with its visibility:
//!
//! - the trait itself, each `async fn m(&self, ..) -> R` rewritten to
//!   `fn m(&self, ..) -> impl Future<Output = R> + Send` so that servers can run calls on any
//!   worker thread (implementations still write plain `async fn`);
//! - `StoreClient`, a typed stub with one method per trait method;
//! - `StoreServer<S>`, which adapts any `S: Store` to the server's dispatch trait;
//! - one method id per method (`rdma_rpc::__private::method_id("Store.m")`) and a compile-time
//!   check that the ids of the trait are distinct.
//!
//! The optional argument `#[rdma_service(codec = path::to::Codec)]` selects the codec type
//! (default `::rdma_rpc::codec::Bincode`).
//!
//! The structure follows the usual shape for attribute macros: `expand` works on
//! `proc_macro2` tokens so it can be unit tested, `parse` builds the macro's own AST and
//! collects every error at once, and `generate` emits one item per function. When the input is
//! refused, the trait is still emitted as written next to the errors, so IDEs keep working.

#![forbid(unsafe_code)]

mod generate;
mod parse;
#[cfg(test)]
mod tests;

use proc_macro2::TokenStream as TokenStream2;

/// Turns a trait of `async fn`s into an rdma-rpc service: a client stub `<Trait>Client` and a
/// server adapter `<Trait>Server<S>`.
///
/// ```text
/// use rdma_rpc::{rdma_service, Payload};
///
/// #[rdma_service]
/// pub trait Store {
///     async fn put(&self, key: String, value: Payload) -> Result<u64, StoreError>;
///     async fn get(&self, key: String) -> Option<Payload>;
///     async fn ping(&self);
/// }
/// ```
///
/// Every method must be an `async fn` taking `&self` and at most 16 arguments with plain
/// identifiers as names; argument and result types must be owned (no references, no
/// `impl Trait`, no `Self`) and implement serde's `Serialize`/`DeserializeOwned`. The trait may
/// not have generics, `where` clauses, associated items or default method bodies. Method names
/// must not clash with the generated client methods `connect`, `from_client`, `client` and
/// `with_timeout`.
///
/// `#[rdma_service(codec = path::to::Codec)]` selects the codec (default
/// `::rdma_rpc::codec::Bincode`).
#[proc_macro_attribute]
pub fn rdma_service(
    attr: proc_macro::TokenStream,
    item: proc_macro::TokenStream,
) -> proc_macro::TokenStream {
    expand(attr.into(), item.into()).into()
}

/// The macro on `proc_macro2` tokens: `attr` is the attribute's argument list, `item` the
/// annotated item.
///
/// On success returns the rewritten trait followed by the generated items. On failure returns
/// `item` unchanged followed by one `compile_error!` per problem found.
fn expand(attr: TokenStream2, item: TokenStream2) -> TokenStream2 {
    match parse::parse(attr, item.clone()) {
        Ok((args, service)) => generate::generate(&args, &service),
        Err(errors) => {
            let mut out = item;
            out.extend(errors.into_compile_error());
            out
        }
    }
}
