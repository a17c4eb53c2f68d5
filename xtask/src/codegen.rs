//! `cargo xtask codegen`: bindgen over the pinned `cuda.h` and `nccl.h`, committed as
//! `cuda-sys/src/bindings.rs` and `cuda-sys/src/nccl/bindings.rs`.
//!
//! bindgen's types and constants are kept as they are. Its `extern "C"` block is rewritten into one
//! `driver_functions!` invocation, so that `cuda-sys` can resolve each function from `libcuda` on
//! first use instead of linking against it. `cuda.h` maps most names to versioned symbols
//! (`#define cuMemAlloc cuMemAlloc_v2`); bindgen already sees the versioned names, and the mapping is
//! emitted as aliases so callers may use either.
//!
//! `nccl.h` gets the same treatment with `nccl_functions!` (resolved from `libnccl.so.2`), limited
//! to the functions and types the NCCL transport uses. It includes `cuda_runtime.h`,
//! `cuda_fp16.h` and `cuda_bf16.h`, but takes only `cudaStream_t` from them (the half-precision
//! headers need CUDA's C++ library, which the pinned toolchain lacks). So clang sees small stand-in
//! headers ([`CUDA_SHIM`]) that declare `cudaStream_t` exactly as `driver_types.h` does, and the
//! bindings name it as `cuda-sys`'s `CUstream`, the same C type (`struct CUstream_st *`), so the
//! driver's streams pass to NCCL without a cast.

use std::collections::BTreeSet;

use anyhow::{Context, Result, bail};
use syn::{ForeignItem, Item};

use crate::{toolchain, workspace_root};

const OUTPUT: &str = "cuda-sys/src/bindings.rs";
const NCCL_OUTPUT: &str = "cuda-sys/src/nccl/bindings.rs";

/// The NCCL functions the transport calls; nothing else of `nccl.h` is bound.
const NCCL_FUNCTIONS: &[&str] = &[
    "ncclGetVersion",
    "ncclGetUniqueId",
    "ncclCommInitRank",
    "ncclCommInitRankConfig",
    "ncclCommGetAsyncError",
    "ncclCommAbort",
    "ncclCommDestroy",
    "ncclCommFinalize",
    "ncclSend",
    "ncclRecv",
    "ncclGroupStart",
    "ncclGroupEnd",
    "ncclGetErrorString",
    "ncclGetLastError",
];

/// The NCCL types named in the task; the functions pull in nothing else.
const NCCL_TYPES: &[&str] = &["ncclUniqueId", "ncclComm_t", "ncclResult_t", "ncclDataType_t", "ncclConfig_t"];

/// The version macros (the config initializer needs the header's version) and the id's size.
const NCCL_VARS: &str = "NCCL_(MAJOR|MINOR|PATCH|VERSION_CODE|UNIQUE_ID_BYTES)";

/// The stand-ins for the CUDA runtime headers that `nccl.h` includes: file name and text.
const CUDA_SHIM: &[(&str, &str)] = &[
    (
        "cuda_runtime.h",
        "/* Stand-in for bindgen: NCCL's API takes only cudaStream_t (and size_t) from the CUDA runtime. */\n\
         #include <stddef.h>\n\
         #define CUDART_VERSION 13000\n\
         typedef struct CUstream_st *cudaStream_t;\n",
    ),
    ("cuda_fp16.h", "/* Stand-in for bindgen: NCCL's API uses no half-precision type. */\n"),
    ("cuda_bf16.h", "/* Stand-in for bindgen: NCCL's API uses no bfloat16 type. */\n"),
];

pub fn run(check: bool) -> Result<()> {
    let cuda = cuda_bindings()?;
    let nccl = nccl_bindings()?;
    let mut stale = Vec::new();
    for (output, generated) in [(OUTPUT, cuda), (NCCL_OUTPUT, nccl)] {
        let path = workspace_root().join(output);
        if check {
            let committed = std::fs::read_to_string(&path).unwrap_or_default();
            if committed == generated {
                println!("xtask codegen: {output} is up to date");
            } else {
                stale.push(output);
            }
        } else {
            std::fs::write(&path, generated)?;
            println!("xtask codegen: wrote {output}");
        }
    }
    if !stale.is_empty() {
        bail!("{} stale: run `cargo xtask codegen` and commit the result", stale.join(" and "));
    }
    Ok(())
}

fn cuda_bindings() -> Result<String> {
    let include = toolchain::cuda_include_dir()?;
    let header = include.join("cuda.h");
    let header_text = std::fs::read_to_string(&header).with_context(|| format!("reading {}", header.display()))?;
    let raw = bindgen::Builder::default()
        .header(header.to_string_lossy())
        .clang_arg(format!("-I{}", include.display()))
        .allowlist_function("cu.*")
        .allowlist_type("CU.*|cuuint.*")
        .allowlist_var("CU.*")
        .default_enum_style(bindgen::EnumVariation::NewType { is_bitfield: false, is_global: false })
        .derive_default(true)
        .layout_tests(false)
        .generate_comments(false)
        .generate()
        .context("bindgen failed on cuda.h (is libclang installed? `cargo xtask setup`)")?
        .to_string();
    rewrite(&raw, &header_text)
}

fn nccl_bindings() -> Result<String> {
    let include = toolchain::nccl_include_dir()?;
    let header = include.join("nccl.h");
    let shim = workspace_root().join("target/xtask-nccl-shim");
    std::fs::create_dir_all(&shim)?;
    for (name, text) in CUDA_SHIM {
        std::fs::write(shim.join(name), text)?;
    }
    let raw = bindgen::Builder::default()
        .header(header.to_string_lossy())
        .clang_arg(format!("-I{}", include.display()))
        .clang_arg(format!("-I{}", shim.display()))
        .allowlist_function(NCCL_FUNCTIONS.join("|"))
        .allowlist_type(NCCL_TYPES.join("|"))
        .allowlist_var(NCCL_VARS)
        .blocklist_type("cudaStream_t|CUstream_st")
        .default_enum_style(bindgen::EnumVariation::NewType { is_bitfield: false, is_global: false })
        .derive_default(true)
        // A zeroed config is refused by NCCL; `ncclConfig_t::initializer()` is the default.
        .no_default("ncclConfig_.*")
        .layout_tests(false)
        .generate_comments(false)
        .generate()
        .context("bindgen failed on nccl.h (is libclang installed? `cargo xtask setup`)")?
        .to_string();
    let (types, function_list, _) = split(&raw)?;
    let mut out = String::from(
        "// Generated by `cargo xtask codegen` from the pinned NCCL 2.28.3 `nccl.h`. Do not edit.\n\n\
         /// `cudaStream_t` of `cuda_runtime.h`: the driver's `CUstream`, the same C type.\n\
         pub type cudaStream_t = crate::CUstream;\n\n",
    );
    out.push_str(&types);
    out.push_str("\nnccl_functions! {");
    out.push_str(&function_list);
    Ok(out)
}

/// Renders `cuda-sys/src/bindings.rs` from bindgen's output over `cuda.h`.
fn rewrite(raw: &str, header_text: &str) -> Result<String> {
    let (types, function_list, names) = split(raw)?;
    let mut out =
        String::from("// Generated by `cargo xtask codegen` from the pinned CUDA 13.0 `cuda.h`. Do not edit.\n\n");
    out.push_str(&types);
    out.push_str("\ndriver_functions! {");
    out.push_str(&function_list);
    out.push_str("\n// The unversioned names that `cuda.h` maps to versioned symbols.\n");
    for (alias, target) in versioned_aliases(header_text) {
        if names.contains(&target) && !names.contains(&alias) {
            out.push_str(&format!("pub use self::{target} as {alias};\n"));
        }
    }
    Ok(out)
}

/// Splits bindgen's output into its types and constants (rendered) and its functions, rendered as
/// the body of an `extern "C"` block sorted by name (closing brace included), and their names.
fn split(raw: &str) -> Result<(String, String, BTreeSet<String>)> {
    let file = syn::parse_file(raw).context("bindgen output did not parse")?;
    let mut items = Vec::new();
    let mut functions = Vec::new();
    for item in file.items {
        match item {
            Item::ForeignMod(block) => {
                for foreign in block.items {
                    match foreign {
                        ForeignItem::Fn(function) => functions.push(function),
                        _ => bail!("bindgen emitted a foreign item that is not a function"),
                    }
                }
            }
            other => items.push(other),
        }
    }
    functions.sort_by_key(|f| f.sig.ident.to_string());
    let names: BTreeSet<String> = functions.iter().map(|f| f.sig.ident.to_string()).collect();

    let types = prettyplease::unparse(&syn::File { shebang: None, attrs: vec![], items });
    let block = syn::ItemForeignMod {
        attrs: vec![],
        unsafety: None,
        abi: syn::parse_quote!(extern "C"),
        brace_token: Default::default(),
        items: functions.into_iter().map(ForeignItem::Fn).collect(),
    };
    let block_text =
        prettyplease::unparse(&syn::File { shebang: None, attrs: vec![], items: vec![Item::ForeignMod(block)] });
    let function_list =
        block_text.strip_prefix("extern \"C\" {").context("unexpected rendering of the function block")?;
    Ok((types, function_list.to_string(), names))
}

/// `#define cuName cuName_vN` lines of `cuda.h`, first definition of each name only.
fn versioned_aliases(header_text: &str) -> Vec<(String, String)> {
    let mut seen = BTreeSet::new();
    let mut aliases = Vec::new();
    for line in header_text.lines() {
        let mut words = line.split_whitespace();
        let (Some("#define"), Some(alias), Some(target), None) =
            (words.next(), words.next(), words.next(), words.next())
        else {
            continue;
        };
        let is_versioned =
            target.rsplit_once("_v").is_some_and(|(base, version)| base == alias && version.parse::<u32>().is_ok());
        if alias.starts_with("cu") && is_versioned && seen.insert(alias.to_string()) {
            aliases.push((alias.to_string(), target.to_string()));
        }
    }
    aliases
}
