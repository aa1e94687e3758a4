//! Unit tests on the `proc_macro2` level: accepted shapes, refused shapes and where their errors
//! point, and what is emitted in each case.
//!
//! The dev-dependency on proc-macro2 enables `span-locations`, so `Span::source_text` returns
//! the text an error points at.

use proc_macro2::{Delimiter, TokenStream, TokenTree};
use quote::ToTokens;

use crate::{expand, parse};

fn tokens(src: &str) -> TokenStream {
    src.parse()
        .unwrap_or_else(|e| panic!("test input does not lex: {e}\n{src}"))
}

/// Expands and parses the output back as a file, which also checks that it is valid syntax.
fn expand_ok(attr: &str, item: &str) -> syn::File {
    if let Err(errors) = parse::parse(tokens(attr), tokens(item)) {
        let messages: Vec<String> = errors.into_iter().map(|e| e.to_string()).collect();
        panic!("unexpected errors: {messages:#?}");
    }
    let out = expand(tokens(attr), tokens(item));
    syn::parse2(out.clone()).unwrap_or_else(|e| panic!("output does not parse: {e}\n{out}"))
}

/// The errors for `item`, as (message, source text the error points at).
fn errors_with_attr(attr: &str, item: &str) -> Vec<(String, String)> {
    match parse::parse(tokens(attr), tokens(item)) {
        Ok(_) => panic!("expected errors for:\n{item}"),
        Err(errors) => errors
            .into_iter()
            .map(|e| {
                let text = e.span().source_text().unwrap_or_default();
                (e.to_string(), text)
            })
            .collect(),
    }
}

fn errors_of(item: &str) -> Vec<(String, String)> {
    errors_with_attr("", item)
}

/// Asserts that `method` alone in a trait gives exactly one error, containing `message` and
/// pointing at `at`.
#[track_caller]
fn assert_method_error(method: &str, message: &str, at: &str) {
    let item = format!("pub trait Store {{\n    {method}\n}}");
    let errors = errors_of(&item);
    assert_eq!(
        errors.len(),
        1,
        "expected one error for `{method}`, got {errors:#?}"
    );
    let (got_message, got_at) = &errors[0];
    assert!(
        got_message.contains(message),
        "message {got_message:?} lacks {message:?}"
    );
    assert_eq!(
        got_at, at,
        "error for `{method}` points at the wrong tokens"
    );
}

fn find_item<'a, T>(file: &'a syn::File, pick: impl Fn(&'a syn::Item) -> Option<&'a T>) -> &'a T {
    file.items.iter().find_map(pick).expect("item not found")
}

fn trait_item<'a>(file: &'a syn::File, name: &str) -> &'a syn::ItemTrait {
    find_item(file, |item| match item {
        syn::Item::Trait(t) if t.ident == name => Some(t),
        _ => None,
    })
}

fn struct_item<'a>(file: &'a syn::File, name: &str) -> &'a syn::ItemStruct {
    find_item(file, |item| match item {
        syn::Item::Struct(s) if s.ident == name => Some(s),
        _ => None,
    })
}

/// The inherent (`trait_ == None`) or trait impls of `self_ty`'s name, flattened to their items.
fn impl_items<'a>(file: &'a syn::File, self_ty: &str, of_trait: bool) -> Vec<&'a syn::ImplItem> {
    file.items
        .iter()
        .filter_map(|item| match item {
            syn::Item::Impl(i) => Some(i),
            _ => None,
        })
        .filter(|i| i.trait_.is_some() == of_trait)
        .filter(|i| match &*i.self_ty {
            syn::Type::Path(p) => p.path.segments.last().unwrap().ident == self_ty,
            _ => false,
        })
        .flat_map(|i| &i.items)
        .collect()
}

fn impl_fn<'a>(items: &[&'a syn::ImplItem], name: &str) -> &'a syn::ImplItemFn {
    items
        .iter()
        .find_map(|item| match item {
            syn::ImplItem::Fn(f) if f.sig.ident == name => Some(f),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no fn `{name}`"))
}

fn impl_consts<'a>(items: &[&'a syn::ImplItem]) -> Vec<&'a syn::ImplItemConst> {
    items
        .iter()
        .filter_map(|item| match item {
            syn::ImplItem::Const(c) => Some(c),
            _ => None,
        })
        .collect()
}

/// Token text without spaces, to compare generated code with expectations.
fn text(tokens: impl ToTokens) -> String {
    tokens.to_token_stream().to_string().replace(' ', "")
}

const STORE: &str = r#"
    /// A key-value store.
    pub trait Store {
        /// Stores `value` under `key`.
        async fn put(&self, key: String, value: Payload) -> Result<u64, StoreError>;
        async fn get(&self, key: String) -> Option<Payload>;
        async fn ping(&self);
    }
"#;

// ---------------------------------------------------------------------------------------------
// Accepted shapes and their expansion

#[test]
fn trait_methods_become_send_futures() {
    let file = expand_ok("", STORE);
    let store = trait_item(&file, "Store");
    assert!(matches!(store.vis, syn::Visibility::Public(_)));
    assert!(
        text(&store.attrs[0]).contains("Akey-valuestore."),
        "trait docs kept"
    );
    let methods: Vec<&syn::TraitItemFn> = store
        .items
        .iter()
        .map(|item| match item {
            syn::TraitItem::Fn(f) => f,
            other => panic!("unexpected trait item {}", text(other)),
        })
        .collect();
    assert_eq!(methods.len(), 3);
    for method in &methods {
        assert!(
            method.sig.asyncness.is_none(),
            "`async` removed from {}",
            method.sig.ident
        );
        assert!(method.default.is_none());
    }
    assert!(
        text(&methods[0].attrs[0]).contains("Stores`value`under`key`."),
        "method docs kept"
    );
    assert_eq!(
        text(&methods[0].sig.inputs),
        "&self,key:String,value:Payload"
    );
    assert_eq!(
        text(&methods[0].sig.output),
        "->impl::core::future::Future<Output=Result<u64,StoreError>>+::core::marker::Send"
    );
    assert_eq!(
        text(&methods[2].sig.output),
        "->impl::core::future::Future<Output=()>+::core::marker::Send"
    );
}

#[test]
fn client_stub_calls_with_ids_names_and_argument_tuples() {
    let file = expand_ok("", STORE);
    let client = struct_item(&file, "StoreClient");
    assert!(matches!(client.vis, syn::Visibility::Public(_)));
    assert_eq!(text(&client.fields), "{inner:::rdma_rpc::Client,}");
    let derives: Vec<String> = client.attrs.iter().map(text).collect();
    assert!(derives.contains(&"#[derive(::core::clone::Clone,::core::fmt::Debug)]".to_owned()));
    assert!(
        client.attrs.iter().any(|a| a.path().is_ident("doc")),
        "client has docs"
    );

    let items = impl_items(&file, "StoreClient", false);
    for name in [
        "connect",
        "from_client",
        "client",
        "with_timeout",
        "put",
        "get",
        "ping",
    ] {
        let f = impl_fn(&items, name);
        assert!(matches!(f.vis, syn::Visibility::Public(_)), "{name} is pub");
        assert!(
            f.attrs.iter().any(|a| a.path().is_ident("doc")),
            "{name} has docs"
        );
    }
    assert!(impl_fn(&items, "connect").sig.asyncness.is_some());

    let put = impl_fn(&items, "put");
    assert_eq!(text(&put.sig.inputs), "&self,key:String,value:Payload");
    assert_eq!(
        text(&put.sig.output),
        "->impl::core::future::Future<Output=::core::result::Result<Result<u64,StoreError>,\
         ::rdma_rpc::RpcError>,>+::core::marker::Send+'static"
    );
    // each body's path picked by the probes (see `rpc_core::codec::direct`)
    assert_eq!(
        text(&put.block),
        "{{#[allow(unused_imports)]use::rdma_rpc::__private::{ViaDirectas_,ViaSerdeas_};\
         self.inner.call_via::<_,_,_,Result<u64,StoreError>>(\
         (&&::rdma_rpc::__private::Probe::<::rdma_rpc::codec::Bincode,(String,Payload,)>::new())\
         .body(),(&&::rdma_rpc::__private::Probe::<::rdma_rpc::codec::Bincode,\
         Result<u64,StoreError>>::new()).body(),Self::__ID_put,\"Store.put\",&(key,value,),)}}"
    );
    // The user's doc comes first, then the generated one.
    assert!(text(&put.attrs[0]).contains("Stores`value`under`key`."));
    let get = text(&impl_fn(&items, "get").block);
    assert!(get.contains(
        "self.inner.call_via::<_,_,_,Option<Payload>>((&&::rdma_rpc::__private::Probe::<\
         ::rdma_rpc::codec::Bincode,(String,)>::new()).body(),(&&::rdma_rpc::__private::Probe::<\
         ::rdma_rpc::codec::Bincode,Option<Payload>>::new()).body(),Self::__ID_get,\"Store.get\",\
         &(key,),)"
    ));
    let ping = text(&impl_fn(&items, "ping").block);
    assert!(ping.contains(
        "self.inner.call_via::<_,_,_,()>((&&::rdma_rpc::__private::Probe::<\
         ::rdma_rpc::codec::Bincode,()>::new()).body(),(&&::rdma_rpc::__private::Probe::<\
         ::rdma_rpc::codec::Bincode,()>::new()).body(),Self::__ID_ping,\"Store.ping\",&(),)"
    ));
}

#[test]
fn method_ids_come_from_core_and_are_checked_distinct() {
    let file = expand_ok("", STORE);
    let items = impl_items(&file, "StoreClient", false);
    let consts = impl_consts(&items);
    let ids: Vec<(String, String)> = consts
        .iter()
        .map(|c| (c.ident.to_string(), text(&c.expr)))
        .collect();
    assert_eq!(
        ids,
        [
            (
                "__ID_put",
                "::rdma_rpc::__private::method_id(\"Store.put\")"
            ),
            (
                "__ID_get",
                "::rdma_rpc::__private::method_id(\"Store.get\")"
            ),
            (
                "__ID_ping",
                "::rdma_rpc::__private::method_id(\"Store.ping\")"
            ),
        ]
        .map(|(a, b)| (a.to_owned(), b.to_owned()))
    );
    for c in consts {
        assert!(
            c.attrs.iter().any(|a| text(a) == "#[doc(hidden)]"),
            "id consts are hidden"
        );
        assert_eq!(text(&c.ty), "u32");
    }

    let check = find_item(&file, |item| match item {
        syn::Item::Const(c) if c.ident == "_" => Some(c),
        _ => None,
    });
    let check = text(&check.expr);
    // One assertion per pair of methods.
    assert_eq!(check.matches("::core::assert!").count(), 3);
    assert!(check.contains(
        "::core::assert!(StoreClient::__ID_put!=StoreClient::__ID_get,\"#[rdma_service]:methods\
         `Store.put`and`Store.get`havethesamemethodid;renameoneofthem\");"
    ));
    assert!(check.contains("StoreClient::__ID_get!=StoreClient::__ID_ping"));
}

#[test]
fn server_dispatches_every_method() {
    let file = expand_ok("", STORE);
    let server = struct_item(&file, "StoreServer");
    assert_eq!(text(&server.generics), "<S>");
    assert_eq!(text(&server.fields), "{service:S,}");
    let inherent = impl_items(&file, "StoreServer", false);
    assert_eq!(
        text(&impl_fn(&inherent, "new").sig),
        "fnnew(service:S)->Self"
    );
    assert_eq!(
        text(&impl_fn(&inherent, "get_ref").sig),
        "fnget_ref(&self)->&S"
    );

    let service_impl = find_item(&file, |item| match item {
        syn::Item::Impl(i) if i.trait_.is_some() => Some(i),
        _ => None,
    });
    assert_eq!(
        text(&service_impl.trait_.as_ref().unwrap().1),
        "::rdma_rpc::__private::Service"
    );
    assert_eq!(
        text(&service_impl.generics.where_clause),
        "where__S:Store+::core::marker::Send+::core::marker::Sync+'static,"
    );
    let items: Vec<&syn::ImplItem> = service_impl.items.iter().collect();
    let name = items.iter().find_map(|i| match i {
        syn::ImplItem::Const(c) => Some(text(&c.expr)),
        _ => None,
    });
    assert_eq!(name.as_deref(), Some("\"Store\""));

    let method_name = text(&impl_fn(&items, "method_name").block);
    assert!(
        method_name.contains("StoreClient::__ID_put=>::core::option::Option::Some(\"Store.put\"),")
    );
    assert!(method_name.contains("_=>::core::option::Option::None,"));

    let dispatch = impl_fn(&items, "dispatch");
    assert_eq!(
        text(&dispatch.sig.output),
        "->impl::core::future::Future<Output=::core::result::Result<::rdma_rpc::__private::Reply,\
         ::rdma_rpc::__private::ServerError,>,>+::core::marker::Send+'_"
    );
    let body = text(&dispatch.block);
    assert!(
        body.starts_with(
            "{asyncmove{#[allow(unused_imports)]use::rdma_rpc::__private::{ViaDirectas_,\
             ViaSerdeas_};matchmethod{"
        ),
        "{body}"
    );
    assert!(body.contains(
        "StoreClient::__ID_put=>{let__args=request.decode_via::<_,(String,Payload,)>((&&\
         ::rdma_rpc::__private::Probe::<::rdma_rpc::codec::Bincode,(String,Payload,)>::new())\
         .body(),\"Store.put\")?;::rdma_rpc::__private::Reply::encode_via((&&\
         ::rdma_rpc::__private::Probe::<::rdma_rpc::codec::Bincode,Result<u64,StoreError>>::new())\
         .body(),&<__SasStore>::put(&self.service,__args.0,__args.1).await,)}"
    ));
    assert!(body.contains(
        "StoreClient::__ID_ping=>{request.decode_via::<_,()>((&&::rdma_rpc::__private::Probe::<\
         ::rdma_rpc::codec::Bincode,()>::new()).body(),\"Store.ping\")?;\
         ::rdma_rpc::__private::Reply::encode_via((&&::rdma_rpc::__private::Probe::<\
         ::rdma_rpc::codec::Bincode,()>::new()).body(),&<__SasStore>::ping(&self.service).await,)}"
    ));
    assert!(body.contains(
        "_=>::core::result::Result::Err(::rdma_rpc::__private::ServerError::unknown_method(method),),"
    ));
}

#[test]
fn codec_argument_selects_the_codec_everywhere() {
    let file = expand_ok("codec = my::Codec", STORE);
    let out = text(file);
    assert!(!out.contains("Bincode"), "default codec still used");
    // each method: the client's two probes (arguments, result), the server's two
    assert_eq!(out.matches("Probe::<my::Codec,").count(), 12);
}

/// Every name the generated code uses on its own is a full path, so that it does not depend on
/// the user's imports or prelude.
#[test]
fn generated_names_are_fully_qualified() {
    // Only user names that cannot be confused with the ones checked.
    let item = r#"
        pub trait Store {
            async fn put(&self, key: Key, value: Val) -> Outcome;
            async fn ping(&self);
        }
    "#;
    let out = expand(TokenStream::new(), tokens(item));
    const NEED_PATH: &[&str] = &[
        "Option",
        "Some",
        "None",
        "Result",
        "Ok",
        "Err",
        "Future",
        "Send",
        "Sync",
        "Clone",
        "Debug",
        "Duration",
        "assert",
        "Client",
        "Endpoint",
        "RpcError",
        "Request",
        "Reply",
        "ServerError",
        "Service",
        "Bincode",
        "method_id",
        "String",
        "Vec",
        "Box",
    ];
    /// Collects unqualified uses of `NEED_PATH` names and the first segments of global paths.
    fn walk(stream: TokenStream, unqualified: &mut Vec<String>, roots: &mut Vec<String>) {
        let tokens: Vec<TokenTree> = stream.into_iter().collect();
        let is_colon = |i: usize| matches!(&tokens[i], TokenTree::Punct(p) if p.as_char() == ':');
        for (i, token) in tokens.iter().enumerate() {
            match token {
                TokenTree::Group(group) => walk(group.stream(), unqualified, roots),
                TokenTree::Ident(ident)
                    if NEED_PATH.contains(&ident.to_string().as_str())
                        && !(i >= 2 && is_colon(i - 1) && is_colon(i - 2)) =>
                {
                    unqualified.push(ident.to_string());
                }
                TokenTree::Punct(p)
                    if p.as_char() == ':' && i + 1 < tokens.len() && is_colon(i + 1) =>
                {
                    // A `::` that does not continue a path (`a::b`, `T<..>::b`) starts one.
                    let continues = i > 0
                        && (matches!(&tokens[i - 1], TokenTree::Ident(_))
                            || matches!(&tokens[i - 1], TokenTree::Punct(p) if p.as_char() == '>' || p.as_char() == ':'));
                    if !continues {
                        roots.push(tokens.get(i + 2).map_or(String::new(), |t| t.to_string()));
                    }
                }
                _ => {}
            }
        }
    }
    let (mut unqualified, mut roots) = (Vec::new(), Vec::new());
    walk(out.clone(), &mut unqualified, &mut roots);
    assert_eq!(
        unqualified,
        Vec::<String>::new(),
        "unqualified names in:\n{out}"
    );
    assert!(roots.len() > 20, "{roots:?}");
    assert!(
        roots.iter().all(|r| r == "core" || r == "rdma_rpc"),
        "{roots:?}"
    );
    let flat = text(&out);
    assert!(
        flat.contains("::core::result::Result::map(::rdma_rpc::Client::connect(endpoint).await,")
    );
}

#[test]
fn raw_identifiers_keep_raw_idents_and_unraw_names() {
    let item = r#"
        pub trait r#Loop {
            async fn r#type(&self, r#in: u8, r#match: String) -> u8;
        }
    "#;
    let file = expand_ok("", item);
    trait_item(&file, "r#Loop");
    struct_item(&file, "LoopClient");
    struct_item(&file, "LoopServer");
    let items = impl_items(&file, "LoopClient", false);
    let method = impl_fn(&items, "r#type");
    assert_eq!(text(&method.sig.inputs), "&self,r#in:u8,r#match:String");
    assert!(text(&method.block).contains("Self::__ID_type,\"Loop.type\",&(r#in,r#match,),)"));
    assert_eq!(impl_consts(&items)[0].ident, "__ID_type");
    assert!(text(&file).contains("<__Sasr#Loop>::r#type(&self.service,__args.0,__args.1)"));
    assert!(text(&file).contains("constNAME:&'staticstr=\"Loop\";"));
}

#[test]
fn cfg_follows_the_method_and_docs_reach_the_client() {
    let item = r#"
        pub trait Store {
            /// Only with the feature.
            #[cfg(feature = "extra")]
            async fn extra(&self);
            async fn always(&self);
        }
    "#;
    let file = expand_ok("", item);
    let out = text(&file);
    // trait method, id const, id assertion, client method, method_name arm, dispatch arm
    assert_eq!(out.matches("#[cfg(feature=\"extra\")]").count(), 6, "{out}");
    let items = impl_items(&file, "StoreClient", false);
    let extra = impl_fn(&items, "extra");
    assert_eq!(text(&extra.attrs[0]), "#[cfg(feature=\"extra\")]");
    assert_eq!(text(&extra.attrs[1]), "#[doc=\"Onlywiththefeature.\"]");
    assert_eq!(
        text(&extra.attrs[2]),
        "#[doc=\"\"]",
        "blank line between user and generated docs"
    );
    let always = impl_fn(&items, "always");
    let attrs: Vec<String> = always.attrs.iter().map(text).collect();
    assert_eq!(attrs.len(), 2, "{attrs:?}");
    assert!(
        attrs[0].starts_with("#[doc=\"Calls`Store.always`"),
        "no separator without user docs"
    );
    assert_eq!(attrs[1], "#[allow(clippy::too_many_arguments)]");
}

#[test]
fn visibility_supertraits_and_unsafety_are_kept() {
    let item = "pub(crate) unsafe trait Store: Send + Sync + 'static { async fn ping(&self); }";
    let file = expand_ok("", item);
    let store = trait_item(&file, "Store");
    assert_eq!(text(&store.vis), "pub(crate)");
    assert!(store.unsafety.is_some());
    assert_eq!(text(&store.supertraits), "Send+Sync+'static");
    assert_eq!(text(&struct_item(&file, "StoreClient").vis), "pub(crate)");
    assert_eq!(text(&struct_item(&file, "StoreServer").vis), "pub(crate)");
    let items = impl_items(&file, "StoreClient", false);
    assert_eq!(text(&impl_fn(&items, "ping").vis), "pub(crate)");

    let private = expand_ok("", "trait Store { async fn ping(&self); }");
    assert!(matches!(
        struct_item(&private, "StoreClient").vis,
        syn::Visibility::Inherited
    ));
}

#[test]
fn sixteen_arguments_are_accepted() {
    let args: Vec<String> = (0..16)
        .map(|i| format!("a{i}: u{}", 8 << (i % 4)))
        .collect();
    let item = format!(
        "pub trait Wide {{ async fn wide(&self, {}) -> u8; }}",
        args.join(", ")
    );
    let file = expand_ok("", &item);
    let out = text(&file);
    assert!(out.contains(
        "Probe::<::rdma_rpc::codec::Bincode,(u8,u16,u32,u64,u8,u16,u32,u64,u8,u16,u32,u64,u8,u16,\
         u32,u64,)>"
    ));
    assert!(out.contains("__args.15)"));
    assert!(out.contains("&(a0,a1,a2,a3,a4,a5,a6,a7,a8,a9,a10,a11,a12,a13,a14,a15,)"));
}

#[test]
fn a_trait_without_methods_has_no_match_and_no_id_check() {
    let file = expand_ok("", "pub trait Empty {}");
    assert!(trait_item(&file, "Empty").items.is_empty());
    let out = text(&file);
    assert!(!out.contains("match"), "{out}");
    assert!(!out.contains("const_"), "{out}");
    assert!(out.contains("let_=method;::core::option::Option::None"));
}

#[test]
fn explicit_unit_return_and_nested_owned_types_are_accepted() {
    let item = r#"
        pub trait Store {
            async fn unit(&self) -> ();
            async fn nested(&self, a: Vec<Option<(u8, [u16; 4])>>) -> Result<Vec<Payload>, String>;
            async fn fully(&self, a: ::std::collections::HashMap<String, Vec<u8>>) -> <u8 as Trait>::Out;
        }
    "#;
    expand_ok("", item);
}

// ---------------------------------------------------------------------------------------------
// Refused shapes: the message and the tokens the error points at

#[test]
fn methods_must_be_async() {
    assert_method_error(
        "fn put(&self, key: String);",
        "must be `async fn`",
        "fn put",
    );
}

#[test]
fn receiver_must_be_shared_self() {
    assert_method_error("async fn put(&mut self);", "not `&mut self`", "&mut self");
    assert_method_error("async fn put(self);", "not `self` by value", "self");
    assert_method_error("async fn put(mut self);", "not `self` by value", "mut self");
    assert_method_error(
        "async fn put(key: String);",
        "must take `&self`",
        "key: String",
    );
    assert_method_error("async fn put();", "must take `&self`", "()");
    assert_method_error(
        "async fn put(self: Box<Self>);",
        "typed receivers are not supported",
        "self: Box<Self>",
    );
    assert_method_error("async fn put(&'a self);", "lifetimes", "'a");
}

#[test]
fn generics_lifetimes_and_where_clauses_are_refused() {
    let errors = errors_of("pub trait Store<T, 'a> where T: Send { async fn put(&self); }");
    assert_eq!(errors.len(), 2, "{errors:#?}");
    assert!(errors[0].0.contains("generic parameters and lifetimes"));
    assert_eq!(errors[0].1, "<T, 'a>");
    assert!(errors[1].0.contains("`where` clauses"));
    assert_eq!(errors[1].1, "where T: Send");

    assert_method_error("async fn put<T>(&self, t: T);", "generic parameters", "<T>");
    assert_method_error(
        "async fn put(&self) where Self: Sized;",
        "`where` clauses",
        "where Self: Sized",
    );
}

#[test]
fn borrowed_and_opaque_types_are_refused() {
    assert_method_error("async fn put(&self, key: &str);", "reference types", "&str");
    assert_method_error(
        "async fn put(&self, keys: Vec<&'static str>);",
        "reference types",
        "&'static str",
    );
    assert_method_error(
        "async fn get(&self) -> &'static [u8];",
        "reference types",
        "&'static [u8]",
    );
    assert_method_error(
        "async fn put(&self, key: impl Into<String>);",
        "`impl Trait`",
        "impl Into<String>",
    );
    assert_method_error(
        "async fn get(&self) -> Box<impl Send>;",
        "`impl Trait`",
        "impl Send",
    );
    assert_method_error("async fn get(&self) -> Option<Self>;", "`Self`", "Self");
    assert_method_error(
        "async fn get(&self) -> <Self as Tr>::Out;",
        "`Self`",
        "Self",
    );
    assert_method_error(
        "async fn put(&self, f: Box<dyn Fn(&u8) -> u8>);",
        "reference types",
        "&u8",
    );
}

#[test]
fn argument_patterns_are_refused() {
    assert_method_error(
        "async fn put(&self, (a, b): (u8, u8));",
        "argument patterns",
        "(a, b)",
    );
    assert_method_error("async fn put(&self, _: u8);", "argument patterns", "_");
    assert_method_error(
        "async fn put(&self, mut a: u8);",
        "argument patterns",
        "mut a",
    );
    assert_method_error(
        "async fn put(&self, ref a: u8);",
        "argument patterns",
        "ref a",
    );
    assert_method_error(
        "async fn put(&self, #[allow(unused)] a: u8);",
        "attributes on rdma_service method arguments",
        "#[allow(unused)]",
    );
}

#[test]
fn more_than_sixteen_arguments_are_refused() {
    let args: Vec<String> = (0..18).map(|i| format!("a{i}: u8")).collect();
    let method = format!("async fn wide(&self, {});", args.join(", "));
    assert_method_error(
        &method,
        "at most 16 besides `&self`, this one takes 18",
        "a16: u8, a17: u8",
    );
}

#[test]
fn other_function_kinds_are_refused() {
    assert_method_error("async fn put(&self) {}", "default method bodies", "{}");
    assert_method_error("async unsafe fn put(&self);", "`unsafe fn`", "unsafe");
    assert_method_error(
        "async extern \"C\" fn put(&self);",
        "`extern fn`",
        "extern \"C\"",
    );
    assert_method_error("const async fn put(&self);", "`const fn`", "const");
    assert_method_error("async fn put(&self, args: ...);", "variadic", "args: ...");
}

#[test]
fn associated_items_are_refused() {
    assert_method_error("type Key;", "associated types", "type Key");
    assert_method_error("const N: u32;", "associated consts", "const N");
    assert_method_error("methods!();", "macro invocations", "methods!()");
}

#[test]
fn names_of_generated_client_methods_are_refused() {
    for name in [
        "connect",
        "from_client",
        "client",
        "with_timeout",
        "r#connect",
    ] {
        assert_method_error(
            &format!("async fn {name}(&self);"),
            &format!(
                "method name `{}` conflicts with the generated client method",
                name.trim_start_matches("r#")
            ),
            name,
        );
    }
}

#[test]
fn duplicate_method_names_are_refused() {
    let errors =
        errors_of("pub trait Store { async fn put(&self); async fn r#put(&self, a: u8); }");
    assert_eq!(errors.len(), 1, "{errors:#?}");
    assert!(errors[0].0.contains("duplicate method name `put`"));
    assert_eq!(errors[0].1, "r#put");
}

#[test]
fn attribute_arguments_are_checked() {
    let errors = errors_with_attr("codek = my::Codec", STORE);
    assert_eq!(errors.len(), 1, "{errors:#?}");
    assert!(errors[0]
        .0
        .contains("unknown #[rdma_service] argument `codek`"));
    assert_eq!(errors[0].1, "codek");

    let errors = errors_with_attr("codec = a::A, codec = b::B", STORE);
    assert!(errors[0].0.contains("duplicate `codec` argument"));
    assert_eq!(errors[0].1, "codec");

    let errors = errors_with_attr("codec", STORE);
    assert_eq!(errors.len(), 1, "{errors:#?}");
    assert!(
        errors[0].0.contains("expected `codec = path::to::Codec`"),
        "{}",
        errors[0].0
    );
    assert_eq!(errors[0].1, "codec");

    let errors = errors_with_attr("codec = \"bincode\"", STORE);
    assert_eq!(errors.len(), 1, "{errors:#?}");
}

#[test]
fn only_traits_are_accepted() {
    let errors = errors_of("pub struct Store { a: u8 }");
    assert_eq!(errors.len(), 1);
    assert!(errors[0].0.contains("can only be applied to a trait"));
    assert_eq!(errors[0].1, "struct Store");

    let errors = errors_of("fn store() {}");
    assert_eq!(errors[0].1, "fn store");
}

/// All the problems of a trait are reported at once, in source order, attribute first.
#[test]
fn errors_accumulate() {
    let item = r#"
        pub trait Store<T> {
            fn a(&self);
            async fn b(&mut self, x: &str);
            type C;
            async fn d(&self, (x, y): (u8, u8)) -> impl Send;
            async fn e(&self, a: u8);
        }
    "#;
    let errors = errors_with_attr("bogus", item);
    let at: Vec<&str> = errors.iter().map(|(_, at)| at.as_str()).collect();
    assert_eq!(
        at,
        [
            "bogus",
            "<T>",
            "fn a",
            "&mut self",
            "&str",
            "type C",
            "(x, y)",
            "impl Send"
        ]
    );
}

// ---------------------------------------------------------------------------------------------
// What is emitted on error

/// Counts `compile_error!` invocations in the output.
fn compile_errors(stream: &TokenStream) -> Vec<String> {
    let tokens: Vec<TokenTree> = stream.clone().into_iter().collect();
    let mut found = Vec::new();
    for (i, token) in tokens.iter().enumerate() {
        if let TokenTree::Ident(ident) = token {
            if ident == "compile_error" {
                if let Some(TokenTree::Group(args)) = tokens.get(i + 2) {
                    assert!(matches!(
                        args.delimiter(),
                        Delimiter::Brace | Delimiter::Parenthesis
                    ));
                    found.push(args.stream().to_string());
                }
            }
        }
        if let TokenTree::Group(group) = token {
            found.extend(compile_errors(&group.stream()));
        }
    }
    found
}

#[test]
fn refused_trait_is_emitted_as_written_with_all_errors() {
    let item = r#"
        pub trait Store {
            async fn put(&mut self, key: String);
            fn get(&self) -> Option<u8>;
            async fn ping(&self);
        }
    "#;
    let out = expand(TokenStream::new(), tokens(item));
    let errors = compile_errors(&out);
    assert_eq!(errors.len(), 2, "{out}");
    assert!(errors[0].contains("not `&mut self`"));
    assert!(errors[1].contains("must be `async fn`"));
    // The input, untouched, comes first, then the errors; nothing else is generated.
    let item_tokens = tokens(item);
    let prefix: TokenStream = out
        .clone()
        .into_iter()
        .take(item_tokens.clone().into_iter().count())
        .collect();
    assert_eq!(prefix.to_string(), item_tokens.to_string());
    assert!(!out.to_string().contains("StoreClient"));
    // And it still parses as the trait followed by macro invocations.
    let file: syn::File = syn::parse2(out).unwrap();
    assert!(matches!(file.items[0], syn::Item::Trait(_)));
    assert!(file.items[1..]
        .iter()
        .all(|item| matches!(item, syn::Item::Macro(_))));
}

#[test]
fn unparsable_input_is_emitted_with_the_error() {
    let item = "pub trait Store { async fn put(&self) -> ; }";
    let out = expand(TokenStream::new(), tokens(item));
    assert!(out.to_string().starts_with(&tokens(item).to_string()));
    assert_eq!(compile_errors(&out).len(), 1);
}

#[test]
fn an_unknown_attribute_argument_alone_still_emits_the_trait() {
    let out = expand(tokens("timeout = 5"), tokens(STORE));
    let errors = compile_errors(&out);
    assert_eq!(errors.len(), 1);
    assert!(errors[0].contains("unknown #[rdma_service] argument `timeout`"));
    assert!(out.to_string().starts_with(&tokens(STORE).to_string()));
}
