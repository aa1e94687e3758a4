//! Code generation for a validated service: one function per emitted item.
//!
//! Hygiene: every path the generated code names starts with `::core` or `::rdma_rpc`, so it
//! works with any imports, including under `#![no_implicit_prelude]`. The only names taken from
//! the call site are the user's own (trait, methods, arguments, types, codec), and generated
//! names that share a scope with them start with `__`.

use proc_macro2::TokenStream;
use quote::{format_ident, quote, quote_spanned, ToTokens};
use syn::spanned::Spanned;
use syn::Ident;

use crate::parse::{Args, Method, Service};

/// The macro's output for a validated service.
pub(crate) fn generate(args: &Args, service: &Service) -> TokenStream {
    ServiceGenerator::new(args, service).into_token_stream()
}

struct ServiceGenerator<'a> {
    service: &'a Service,
    /// The codec type, `::rdma_rpc::codec::Bincode` unless the attribute names another.
    codec: TokenStream,
    /// `<Trait>Client`.
    client: Ident,
    /// `<Trait>Server`.
    server: Ident,
    /// Per method: the name of its id constant, an associated const of the client.
    id_consts: Vec<Ident>,
    /// Per method: `"Trait.method"`, the name hashed into its id and used in errors.
    full_names: Vec<String>,
}

impl<'a> ServiceGenerator<'a> {
    fn new(args: &Args, service: &'a Service) -> Self {
        let codec = match &args.codec {
            Some(path) => path.to_token_stream(),
            None => quote!(::rdma_rpc::codec::Bincode),
        };
        Self {
            service,
            codec,
            client: format_ident!("{}Client", service.ident),
            server: format_ident!("{}Server", service.ident),
            id_consts: service
                .methods
                .iter()
                .map(|m| format_ident!("__ID_{}", m.name))
                .collect(),
            full_names: service
                .methods
                .iter()
                .map(|m| format!("{}.{}", service.name, m.name))
                .collect(),
        }
    }

    /// Each method with the name of its id constant and its full name.
    fn methods(&self) -> impl Iterator<Item = (&'a Method, &Ident, &str)> {
        self.service
            .methods
            .iter()
            .zip(&self.id_consts)
            .zip(&self.full_names)
            .map(|((method, id), full_name)| (method, id, full_name.as_str()))
    }

    /// The trait, each `async fn` rewritten to return `impl Future + Send`.
    fn trait_item(&self) -> TokenStream {
        let Service {
            attrs,
            vis,
            unsafety,
            trait_token,
            ident,
            colon_token,
            supertraits,
            ..
        } = self.service;
        let methods = self.service.methods.iter().map(|method| {
            let Method {
                attrs,
                fn_token,
                ident,
                receiver,
                args,
                ..
            } = method;
            let args = args.iter().map(|arg| {
                let (ident, colon_token, ty) = (&arg.ident, &arg.colon_token, &arg.ty);
                quote!(#ident #colon_token #ty)
            });
            let output = output_type(method);
            // Spanned at `async` so that a "future cannot be sent between threads" error in an
            // implementation points back at the declaration.
            let future = quote_spanned! {method.async_token.span=>
                impl ::core::future::Future<Output = #output> + ::core::marker::Send
            };
            quote! {
                #(#attrs)*
                #fn_token #ident(#receiver #(, #args)*) -> #future;
            }
        });
        quote! {
            #(#attrs)*
            #vis #unsafety #trait_token #ident #colon_token #supertraits {
                #(#methods)*
            }
        }
    }

    /// The method ids, as hidden associated consts of the client (a non-generic type, so the
    /// server can match on them), and the check that they are distinct.
    fn method_ids(&self) -> TokenStream {
        let client = &self.client;
        let vis = &self.service.vis;
        let consts = self.methods().map(|(method, id, full_name)| {
            let cfgs = method.cfg_attrs();
            let doc = format!(" Method id of `{full_name}`.");
            quote! {
                #(#cfgs)*
                #[doc = #doc]
                #[doc(hidden)]
                #[allow(non_upper_case_globals)]
                #vis const #id: u32 = ::rdma_rpc::__private::method_id(#full_name);
            }
        });
        let methods = &self.service.methods;
        let mut asserts = Vec::new();
        for a in 0..methods.len() {
            for b in a + 1..methods.len() {
                let (cfgs_a, cfgs_b) = (methods[a].cfg_attrs(), methods[b].cfg_attrs());
                let (id_a, id_b) = (&self.id_consts[a], &self.id_consts[b]);
                let message = format!(
                    "#[rdma_service]: methods `{}` and `{}` have the same method id; rename one of them",
                    self.full_names[a], self.full_names[b],
                );
                // Spanned at the second method, so that the error points at a name to change.
                let span = methods[b].ident.span();
                asserts.push(quote_spanned! {span=>
                    #(#cfgs_a)* #(#cfgs_b)*
                    ::core::assert!(#client::#id_a != #client::#id_b, #message);
                });
            }
        }
        let asserts = (!asserts.is_empty()).then(|| quote!(const _: () = { #(#asserts)* };));
        quote! {
            #[allow(dead_code)]
            impl #client {
                #(#consts)*
            }
            #asserts
        }
    }

    fn struct_client(&self) -> TokenStream {
        let Self { client, .. } = self;
        let vis = &self.service.vis;
        let doc = format!(
            " Client of the `{0}` service, generated by `#[rdma_service]`.\n\n One method per \
             method of the `{0}` trait sends the call and waits for the reply. Clones share \
             the connection of the `rdma_rpc::Client` they were made from.",
            self.service.name
        );
        quote! {
            #[doc = #doc]
            #[derive(::core::clone::Clone, ::core::fmt::Debug)]
            #[allow(dead_code)]
            #vis struct #client {
                inner: ::rdma_rpc::Client,
            }
        }
    }

    fn impl_client(&self) -> TokenStream {
        let Self { client, codec, .. } = self;
        let vis = &self.service.vis;
        let name = &self.service.name;
        let connect_doc = format!(
            " Connects to the `{name}` service at `endpoint`.\n\n # Errors\n\n Fails as \
             `rdma_rpc::Client::connect` does, when the endpoint cannot be reached."
        );
        let methods = self.methods().map(|(method, id, full_name)| {
            let cfgs = method.cfg_attrs();
            let docs = method.doc_attrs();
            let separator = (method.doc_attrs().count() > 0).then(|| quote!(#[doc = ""]));
            let doc = format!(
                " Calls `{full_name}` on the server and waits for its reply.\n\n # Errors\n\n \
                     Fails with an `rdma_rpc::RpcError` when the call does not complete: the \
                     connection fails, the call times out, or the server cannot decode or \
                     dispatch it."
            );
            let Method { ident, args, .. } = method;
            let arg_idents = args.iter().map(|arg| &arg.ident);
            let arg_tys = args.iter().map(|arg| &arg.ty);
            let params = args.iter().map(|arg| {
                let (ident, colon_token, ty) = (&arg.ident, &arg.colon_token, &arg.ty);
                quote!(#ident #colon_token #ty)
            });
            let output = output_type(method);
            // Spanned at the method name: an argument type that is not `Serialize` is
            // reported there rather than at the attribute.
            let future = quote_spanned! {ident.span()=>
                impl ::core::future::Future<
                    Output = ::core::result::Result<#output, ::rdma_rpc::RpcError>,
                > + ::core::marker::Send + 'static
            };
            // Each body's path (serde, or written directly: `rpc_core::codec::direct`) is
            // picked by the probe's method resolution on the concrete types.
            let call = quote_spanned! {ident.span()=>
                {
                    // (one of the two resolves every body of some methods)
                    #[allow(unused_imports)]
                    use ::rdma_rpc::__private::{ViaDirect as _, ViaSerde as _};
                    self.inner.call_via::<_, _, _, #output>(
                        (&&::rdma_rpc::__private::Probe::<#codec, (#(#arg_tys,)*)>::new()).body(),
                        (&&::rdma_rpc::__private::Probe::<#codec, #output>::new()).body(),
                        Self::#id,
                        #full_name,
                        &(#(#arg_idents,)*),
                    )
                }
            };
            quote! {
                #(#cfgs)*
                #(#docs)*
                #separator
                #[doc = #doc]
                // Mirrors the trait method, where clippy already had its say.
                #[allow(clippy::too_many_arguments)]
                #vis fn #ident(&self #(, #params)*) -> #future {
                    #call
                }
            }
        });
        quote! {
            #[allow(dead_code)]
            impl #client {
                #[doc = #connect_doc]
                #vis async fn connect(
                    endpoint: &::rdma_rpc::Endpoint,
                ) -> ::core::result::Result<Self, ::rdma_rpc::RpcError> {
                    ::core::result::Result::map(
                        ::rdma_rpc::Client::connect(endpoint).await,
                        Self::from_client,
                    )
                }

                /// Wraps a connected `rdma_rpc::Client`.
                #vis fn from_client(client: ::rdma_rpc::Client) -> Self {
                    Self { inner: client }
                }

                /// The underlying `rdma_rpc::Client`.
                #vis fn client(&self) -> &::rdma_rpc::Client {
                    &self.inner
                }

                /// A client on the same connection whose calls time out after `timeout`.
                #[must_use]
                #vis fn with_timeout(&self, timeout: ::core::time::Duration) -> Self {
                    Self { inner: self.inner.with_timeout(timeout) }
                }

                #(#methods)*
            }
        }
    }

    fn struct_server(&self) -> TokenStream {
        let Self { server, .. } = self;
        let vis = &self.service.vis;
        let doc = format!(
            " Server side of the `{0}` service, generated by `#[rdma_service]`.\n\n Wraps an \
             implementation of `{0}`; pass it to `rdma_rpc::Server::serve`.",
            self.service.name
        );
        quote! {
            #[doc = #doc]
            #[derive(::core::clone::Clone, ::core::fmt::Debug)]
            #[allow(dead_code)]
            #vis struct #server<S> {
                service: S,
            }

            #[allow(dead_code)]
            impl<S> #server<S> {
                /// Wraps `service` to be served.
                #vis fn new(service: S) -> Self {
                    Self { service }
                }

                /// The wrapped service.
                #vis fn get_ref(&self) -> &S {
                    &self.service
                }
            }
        }
    }

    /// `impl Service for <Trait>Server<S>`: decodes the arguments, calls the method, encodes
    /// the result.
    fn impl_service(&self) -> TokenStream {
        let Self {
            client,
            server,
            codec,
            ..
        } = self;
        let trait_ident = &self.service.ident;
        let name = &self.service.name;
        let (method_name_body, dispatch_body) = if self.service.methods.is_empty() {
            (
                quote! {
                    let _ = method;
                    ::core::option::Option::None
                },
                quote! {
                    ::core::result::Result::Err(
                        ::rdma_rpc::__private::ServerError::unknown_method(method),
                    )
                },
            )
        } else {
            let names = self.methods().map(|(method, id, full_name)| {
                let cfgs = method.cfg_attrs();
                quote! {
                    #(#cfgs)*
                    #client::#id => ::core::option::Option::Some(#full_name),
                }
            });
            let arms = self.methods().map(
                |(method, id, full_name)| {
                    let cfgs = method.cfg_attrs();
                    let ident = &method.ident;
                    let tys: Vec<_> = method.args.iter().map(|arg| &arg.ty).collect();
                    let output = output_type(method);
                    // Spanned at the method name: an argument type that is not
                    // `DeserializeOwned` is reported there rather than at the attribute.
                    let span = ident.span();
                    // (each body's path picked as in the client's methods)
                    let (decode, args) = if method.args.is_empty() {
                        (
                            quote_spanned!(span=> request.decode_via::<_, ()>((&&::rdma_rpc::__private::Probe::<#codec, ()>::new()).body(), #full_name)?;),
                            Vec::new(),
                        )
                    } else {
                        let fields = (0..method.args.len()).map(syn::Index::from);
                        (
                            quote_spanned!(span=> let __args = request.decode_via::<_, (#(#tys,)*)>((&&::rdma_rpc::__private::Probe::<#codec, (#(#tys,)*)>::new()).body(), #full_name)?;),
                            fields.map(|field| quote!(__args.#field)).collect(),
                        )
                    };
                    // Spanned at the result type: one that is not `Serialize` is reported there.
                    let reply_span = method.output.as_ref().map_or(span, |ty| ty.span());
                    let reply = quote_spanned! {reply_span=>
                        ::rdma_rpc::__private::Reply::encode_via(
                            (&&::rdma_rpc::__private::Probe::<#codec, #output>::new()).body(),
                            &<__S as #trait_ident>::#ident(&self.service #(, #args)*).await,
                        )
                    };
                    quote! {
                        #(#cfgs)*
                        #client::#id => {
                            #decode
                            #reply
                        }
                    }
                },
            );
            (
                quote! {
                    match method {
                        #(#names)*
                        _ => ::core::option::Option::None,
                    }
                },
                quote! {
                    match method {
                        #(#arms)*
                        _ => ::core::result::Result::Err(
                            ::rdma_rpc::__private::ServerError::unknown_method(method),
                        ),
                    }
                },
            )
        };
        // The parameter is named `__S` and not `S`: the user's argument types appear in the
        // impl, and a type of their own named `S` must keep meaning that type.
        quote! {
            impl<__S> ::rdma_rpc::__private::Service for #server<__S>
            where
                __S: #trait_ident + ::core::marker::Send + ::core::marker::Sync + 'static,
            {
                const NAME: &'static str = #name;

                fn method_name(&self, method: u32) -> ::core::option::Option<&'static str> {
                    #method_name_body
                }

                fn dispatch(
                    &self,
                    method: u32,
                    request: ::rdma_rpc::__private::Request,
                ) -> impl ::core::future::Future<
                    Output = ::core::result::Result<
                        ::rdma_rpc::__private::Reply,
                        ::rdma_rpc::__private::ServerError,
                    >,
                > + ::core::marker::Send + '_ {
                    async move {
                        #[allow(unused_imports)]
                        use ::rdma_rpc::__private::{ViaDirect as _, ViaSerde as _};
                        #dispatch_body
                    }
                }
            }
        }
    }
}

/// The method's result type: the declared one, or `()`.
fn output_type(method: &Method) -> TokenStream {
    match &method.output {
        Some(ty) => ty.to_token_stream(),
        None => quote!(()),
    }
}

impl ToTokens for ServiceGenerator<'_> {
    fn to_tokens(&self, tokens: &mut TokenStream) {
        tokens.extend([
            self.trait_item(),
            self.method_ids(),
            self.struct_client(),
            self.impl_client(),
            self.struct_server(),
            self.impl_service(),
        ]);
    }
}
