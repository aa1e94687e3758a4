//! Parsing and validation: attribute arguments and the annotated trait into the macro's AST.
//!
//! Every check pushes a spanned error and carries on, so that one expansion reports all the
//! problems of a trait at once.

use proc_macro2::TokenStream;
use quote::{quote, ToTokens};
use syn::ext::IdentExt;
use syn::parse::Parser;
use syn::punctuated::Punctuated;
use syn::{
    Attribute, FnArg, GenericArgument, Ident, Item, ItemTrait, Pat, PathArguments, Receiver,
    ReturnType, Signature, Token, TraitItem, TraitItemConst, TraitItemFn, TraitItemType, Type,
    TypeParamBound, Visibility,
};

/// Most arguments a method may take besides `&self`: serde implements its traits for tuples of
/// up to 16 elements, and the arguments travel as one tuple.
pub(crate) const MAX_ARGS: usize = 16;

/// The methods of the generated `<Trait>Client` that are not RPCs; a trait method with one of
/// these names would clash with them.
pub(crate) const RESERVED_CLIENT_METHODS: &[&str] =
    &["connect", "from_client", "client", "with_timeout"];

/// The arguments of `#[rdma_service(...)]`.
#[derive(Default)]
pub(crate) struct Args {
    /// `codec = path::to::Codec`; `None` selects the default codec.
    pub(crate) codec: Option<syn::Path>,
}

/// A validated service trait.
pub(crate) struct Service {
    pub(crate) attrs: Vec<Attribute>,
    pub(crate) vis: Visibility,
    pub(crate) unsafety: Option<Token![unsafe]>,
    pub(crate) trait_token: Token![trait],
    pub(crate) ident: Ident,
    pub(crate) colon_token: Option<Token![:]>,
    pub(crate) supertraits: Punctuated<TypeParamBound, Token![+]>,
    /// The trait's name without `r#`, as it appears in method names on the wire.
    pub(crate) name: String,
    pub(crate) methods: Vec<Method>,
}

/// A validated `async fn` of a service trait.
pub(crate) struct Method {
    /// All the attributes, docs and `#[cfg]` included, as written.
    pub(crate) attrs: Vec<Attribute>,
    pub(crate) async_token: Token![async],
    pub(crate) fn_token: Token![fn],
    pub(crate) ident: Ident,
    /// The `&self` receiver as written.
    pub(crate) receiver: Receiver,
    pub(crate) args: Vec<Arg>,
    /// The return type as written, `None` when there is no `->`.
    pub(crate) output: Option<Box<Type>>,
    /// The method's name without `r#`.
    pub(crate) name: String,
}

/// An argument of a service method: a plain identifier and an owned type.
pub(crate) struct Arg {
    pub(crate) ident: Ident,
    pub(crate) colon_token: Token![:],
    pub(crate) ty: Box<Type>,
}

impl Method {
    /// The attributes that must follow the method onto every generated item that belongs to
    /// it: its `#[cfg]`s.
    pub(crate) fn cfg_attrs(&self) -> impl Iterator<Item = &Attribute> {
        self.attrs.iter().filter(|attr| attr.path().is_ident("cfg"))
    }

    /// The method's doc comments.
    pub(crate) fn doc_attrs(&self) -> impl Iterator<Item = &Attribute> {
        self.attrs.iter().filter(|attr| attr.path().is_ident("doc"))
    }
}

/// Errors collected while parsing; reported together.
#[derive(Default)]
struct Errors(Option<syn::Error>);

impl Errors {
    fn push(&mut self, error: syn::Error) {
        match &mut self.0 {
            Some(errors) => errors.combine(error),
            None => self.0 = Some(error),
        }
    }

    fn spanned(&mut self, tokens: impl ToTokens, message: impl std::fmt::Display) {
        self.push(syn::Error::new_spanned(tokens, message));
    }
}

/// Parses and validates the attribute arguments and the annotated item.
///
/// Returns all the problems found as one combined error.
pub(crate) fn parse(attr: TokenStream, item: TokenStream) -> syn::Result<(Args, Service)> {
    let mut errors = Errors::default();
    let args = parse_args(attr).unwrap_or_else(|error| {
        errors.push(error);
        Args::default()
    });
    let service = match syn::parse2::<Item>(item) {
        Ok(Item::Trait(item)) => Some(parse_trait(item, &mut errors)),
        Ok(other) => {
            errors.spanned(
                item_head(&other),
                "#[rdma_service] can only be applied to a trait",
            );
            None
        }
        Err(error) => {
            errors.push(error);
            None
        }
    };
    match (errors.0, service) {
        (None, Some(service)) => Ok((args, service)),
        (Some(errors), _) => Err(errors),
        // Not reached: an item that was not parsed always records an error.
        (None, None) => Err(syn::Error::new(
            proc_macro2::Span::call_site(),
            "#[rdma_service] can only be applied to a trait",
        )),
    }
}

/// The keyword and name of an item that is not a trait, to point an error at.
fn item_head(item: &Item) -> TokenStream {
    match item {
        Item::Struct(item) => {
            let (struct_token, ident) = (&item.struct_token, &item.ident);
            quote!(#struct_token #ident)
        }
        Item::Enum(item) => {
            let (enum_token, ident) = (&item.enum_token, &item.ident);
            quote!(#enum_token #ident)
        }
        Item::Fn(item) => {
            let (fn_token, ident) = (&item.sig.fn_token, &item.sig.ident);
            quote!(#fn_token #ident)
        }
        Item::Impl(item) => {
            let (impl_token, self_ty) = (&item.impl_token, &item.self_ty);
            quote!(#impl_token #self_ty)
        }
        other => other.to_token_stream(),
    }
}

fn parse_args(attr: TokenStream) -> syn::Result<Args> {
    let mut args = Args::default();
    let parser = syn::meta::parser(|meta| {
        if meta.path.is_ident("codec") {
            if args.codec.is_some() {
                return Err(meta.error("duplicate `codec` argument"));
            }
            if !meta.input.peek(Token![=]) {
                return Err(meta.error("expected `codec = path::to::Codec`"));
            }
            args.codec = Some(meta.value()?.parse()?);
            Ok(())
        } else {
            let name = meta.path.to_token_stream().to_string().replace(' ', "");
            Err(meta.error(format_args!(
                "unknown #[rdma_service] argument `{name}`; the only argument is `codec = path::to::Codec`"
            )))
        }
    });
    parser.parse2(attr)?;
    Ok(args)
}

fn parse_trait(item: ItemTrait, errors: &mut Errors) -> Service {
    if let Some(auto_token) = &item.auto_token {
        errors.spanned(auto_token, "an rdma_service trait cannot be an auto trait");
    }
    if !item.generics.params.is_empty() {
        errors.spanned(
            &item.generics,
            "generic parameters and lifetimes are not supported on an rdma_service trait: \
             every method call must have one concrete wire type",
        );
    }
    if let Some(where_clause) = &item.generics.where_clause {
        errors.spanned(
            where_clause,
            "`where` clauses are not supported on an rdma_service trait",
        );
    }

    let mut methods: Vec<Method> = Vec::new();
    for trait_item in item.items {
        match trait_item {
            TraitItem::Fn(method) => {
                if let Some(method) = parse_method(method, errors) {
                    if let Some(first) = methods.iter().find(|m| m.name == method.name) {
                        errors.spanned(
                            &method.ident,
                            format_args!("duplicate method name `{}`", first.name),
                        );
                    } else {
                        methods.push(method);
                    }
                }
            }
            TraitItem::Type(TraitItemType {
                type_token, ident, ..
            }) => errors.spanned(
                quote!(#type_token #ident),
                "associated types are not supported in an rdma_service trait; \
                 use concrete types in the method signatures",
            ),
            TraitItem::Const(TraitItemConst {
                const_token, ident, ..
            }) => errors.spanned(
                quote!(#const_token #ident),
                "associated consts are not supported in an rdma_service trait",
            ),
            TraitItem::Macro(item) => errors.spanned(
                &item.mac,
                "macro invocations are not supported in an rdma_service trait: \
                 the macro cannot see the methods they would expand to",
            ),
            other => errors.spanned(other, "unsupported item in an rdma_service trait"),
        }
    }

    Service {
        name: item.ident.unraw().to_string(),
        attrs: item.attrs,
        vis: item.vis,
        unsafety: item.unsafety,
        trait_token: item.trait_token,
        ident: item.ident,
        colon_token: item.colon_token,
        supertraits: item.supertraits,
        methods,
    }
}

/// Validates one trait method; `None` when it was refused (its errors are in `errors`).
fn parse_method(method: TraitItemFn, all_errors: &mut Errors) -> Option<Method> {
    let mut errors = Errors::default();
    let errors = &mut errors;
    let TraitItemFn {
        attrs,
        sig,
        default,
        ..
    } = method;
    let Signature {
        constness,
        asyncness,
        unsafety,
        abi,
        fn_token,
        ident,
        generics,
        paren_token,
        inputs,
        variadic,
        output,
    } = sig;
    let name = ident.unraw().to_string();

    if let Some(constness) = &constness {
        errors.spanned(
            constness,
            "`const fn` is not supported; rdma_service methods are `async fn`",
        );
    }
    if asyncness.is_none() {
        errors.spanned(
            quote!(#fn_token #ident),
            format_args!("rdma_service methods must be `async fn`: write `async fn {ident}`"),
        );
    }
    if let Some(unsafety) = &unsafety {
        errors.spanned(
            unsafety,
            "`unsafe fn` is not supported in an rdma_service trait",
        );
    }
    if let Some(abi) = &abi {
        errors.spanned(abi, "`extern fn` is not supported in an rdma_service trait");
    }
    if RESERVED_CLIENT_METHODS.contains(&name.as_str()) {
        errors.spanned(
            &ident,
            format_args!(
                "method name `{name}` conflicts with the generated client method of the same \
                 name; rename the method"
            ),
        );
    }
    if !generics.params.is_empty() {
        errors.spanned(
            &generics,
            "generic parameters and lifetimes are not supported on rdma_service methods: \
             every method call must have one concrete wire type",
        );
    }
    if let Some(where_clause) = &generics.where_clause {
        errors.spanned(
            where_clause,
            "`where` clauses are not supported on rdma_service methods",
        );
    }
    if let Some(variadic) = &variadic {
        errors.spanned(
            variadic,
            "variadic arguments are not supported in an rdma_service trait",
        );
    }
    if let Some(default) = &default {
        errors.spanned(
            default,
            "default method bodies are not supported in an rdma_service trait; \
             declare the method and implement it in the server's `impl`",
        );
    }

    let mut inputs = inputs.into_iter();
    let receiver = match inputs.next() {
        Some(FnArg::Receiver(receiver)) => check_receiver(receiver, errors),
        Some(FnArg::Typed(arg)) => {
            errors.spanned(
                &arg,
                "rdma_service methods must take `&self` as their first argument",
            );
            None
        }
        None => {
            errors.push(syn::Error::new(
                paren_token.span.join(),
                "rdma_service methods must take `&self` as their first argument",
            ));
            None
        }
    };

    let inputs: Vec<FnArg> = inputs.collect();
    if inputs.len() > MAX_ARGS {
        let extra = &inputs[MAX_ARGS..];
        errors.spanned(
            quote!(#(#extra),*),
            format_args!(
                "too many arguments: an rdma_service method takes at most {MAX_ARGS} besides \
                 `&self`, this one takes {}; the arguments travel as one tuple, and serde \
                 supports tuples of up to 16 elements: group them in a struct",
                inputs.len()
            ),
        );
    }
    let mut args = Vec::new();
    for input in inputs {
        let FnArg::Typed(arg) = input else {
            errors.spanned(input, "`self` must be the first argument");
            continue;
        };
        if let Some(attr) = arg.attrs.first() {
            errors.spanned(
                attr,
                "attributes on rdma_service method arguments are not supported",
            );
        }
        check_type(&arg.ty, errors);
        match *arg.pat {
            Pat::Ident(pat)
                if pat.by_ref.is_none() && pat.mutability.is_none() && pat.subpat.is_none() =>
            {
                args.push(Arg {
                    ident: pat.ident,
                    colon_token: arg.colon_token,
                    ty: arg.ty,
                });
            }
            pat => errors.spanned(
                pat,
                "argument patterns are not supported in an rdma_service trait; \
                 name each argument with a plain identifier",
            ),
        }
    }

    let output = match output {
        ReturnType::Default => None,
        ReturnType::Type(_, ty) => {
            check_type(&ty, errors);
            Some(ty)
        }
    };

    if let Some(error) = errors.0.take() {
        all_errors.push(error);
        return None;
    }
    Some(Method {
        attrs,
        async_token: asyncness?,
        fn_token,
        ident,
        receiver: receiver?,
        args,
        output,
        name,
    })
}

const RECEIVER: &str = "rdma_service methods must take `&self`: the server runs calls \
                        concurrently on a shared service";

fn check_receiver(receiver: Receiver, errors: &mut Errors) -> Option<Receiver> {
    match &receiver.reference {
        _ if receiver.colon_token.is_some() => {
            errors.spanned(
                &receiver,
                format_args!("{RECEIVER}; typed receivers are not supported"),
            );
        }
        None => errors.spanned(&receiver, format_args!("{RECEIVER}, not `self` by value")),
        Some(_) if receiver.mutability.is_some() => {
            errors.spanned(&receiver, format_args!("{RECEIVER}, not `&mut self`"));
        }
        Some((_, Some(lifetime))) => errors.spanned(
            lifetime,
            "lifetimes are not supported on rdma_service methods; write `&self`",
        ),
        Some((_, None)) => return Some(receiver),
    }
    None
}

/// Refuses the types that cannot travel on the wire as written: references (arguments and
/// results are decoded into owned values), `impl Trait` (the wire needs a concrete type) and
/// `Self` (which would mean the client or server type in the generated code).
fn check_type(ty: &Type, errors: &mut Errors) {
    match ty {
        Type::Reference(reference) => errors.spanned(
            reference,
            "reference types are not supported in rdma_service methods: arguments and results \
             are sent by value; use an owned type (`String`, `Vec<u8>`, `Payload`, ...)",
        ),
        Type::ImplTrait(impl_trait) => errors.spanned(
            impl_trait,
            "`impl Trait` is not supported in rdma_service methods: the wire needs a concrete type",
        ),
        Type::Array(array) => check_type(&array.elem, errors),
        Type::Group(group) => check_type(&group.elem, errors),
        Type::Paren(paren) => check_type(&paren.elem, errors),
        Type::Ptr(ptr) => check_type(&ptr.elem, errors),
        Type::Slice(slice) => check_type(&slice.elem, errors),
        Type::Tuple(tuple) => tuple.elems.iter().for_each(|elem| check_type(elem, errors)),
        Type::Path(path) => {
            if let Some(qself) = &path.qself {
                check_type(&qself.ty, errors);
            } else if path
                .path
                .segments
                .first()
                .is_some_and(|s| s.ident == "Self")
            {
                errors.spanned(
                    path,
                    "`Self` is not supported in rdma_service methods: name the concrete type",
                );
            }
            check_path(&path.path, errors);
        }
        Type::TraitObject(object) => {
            for bound in &object.bounds {
                if let TypeParamBound::Trait(bound) = bound {
                    check_path(&bound.path, errors);
                }
            }
        }
        _ => {}
    }
}

/// Checks the types in the generic arguments of `path`.
fn check_path(path: &syn::Path, errors: &mut Errors) {
    for segment in &path.segments {
        match &segment.arguments {
            PathArguments::None => {}
            PathArguments::AngleBracketed(args) => {
                for arg in &args.args {
                    match arg {
                        GenericArgument::Type(ty) => check_type(ty, errors),
                        GenericArgument::AssocType(assoc) => check_type(&assoc.ty, errors),
                        _ => {}
                    }
                }
            }
            PathArguments::Parenthesized(args) => {
                args.inputs.iter().for_each(|ty| check_type(ty, errors));
                if let ReturnType::Type(_, ty) = &args.output {
                    check_type(ty, errors);
                }
            }
        }
    }
}
