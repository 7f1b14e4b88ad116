//! Symbol → file offset, version-aware.
//!
//! aya resolves a uprobe's symbol to the *first* symbol of that name it finds. In a library with
//! versioned symbols that can be the wrong one: libibverbs exports `ibv_reg_mr@IBVERBS_1.0` (a
//! compatibility entry that current programs never call) before the default
//! `ibv_reg_mr@@IBVERBS_1.1`, so a probe attached by name never fires. Here a symbol is
//! resolved to the default version (or the version named with `name@VERSION`) and attached by
//! file offset.

use std::path::{Path, PathBuf};

use object::elf::{FileHeader64, SHN_UNDEF, SHT_DYNSYM, SHT_SYMTAB};
use object::read::elf::{FileHeader, SectionHeader, Sym};
use object::{Endianness, SymbolIndex};

/// Why a symbol could not be resolved.
#[derive(Debug, thiserror::Error)]
pub enum SymbolError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not a 64-bit ELF file this resolver reads: {detail}")]
    Elf { path: PathBuf, detail: String },
    #[error("{path} defines no symbol {symbol}")]
    NotFound { path: PathBuf, symbol: String },
}

/// One definition of a symbol.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SymbolDef {
    /// ELF virtual address (`st_value`).
    pub address: u64,
    /// File offset of the first instruction: what a uprobe attaches to.
    pub file_offset: u64,
    /// Version name (`IBVERBS_1.1`), if the symbol is versioned.
    pub version: Option<String>,
    /// The default version (`name@@VERSION`), or an unversioned symbol.
    pub is_default: bool,
    /// Found in `.dynsym` (exported) rather than only in `.symtab`.
    pub dynamic: bool,
}

/// Every definition of `name` in `path` (`.dynsym` first, then `.symtab`).
pub fn definitions(path: &Path, name: &str) -> Result<Vec<SymbolDef>, SymbolError> {
    let data = std::fs::read(path).map_err(|source| SymbolError::Io {
        path: path.to_owned(),
        source,
    })?;
    let elf = |e: object::Error| SymbolError::Elf {
        path: path.to_owned(),
        detail: e.to_string(),
    };
    let data = &data[..];
    let header = FileHeader64::<Endianness>::parse(data).map_err(elf)?;
    let endian = header.endian().map_err(elf)?;
    let sections = header.sections(endian, data).map_err(elf)?;
    let versions = sections.versions(endian, data).map_err(elf)?;
    let mut out = Vec::new();
    for sh_type in [SHT_DYNSYM, SHT_SYMTAB] {
        let table = sections.symbols(endian, data, sh_type).map_err(elf)?;
        for (i, sym) in table.iter().enumerate() {
            if sym.st_shndx(endian) == SHN_UNDEF || !sym.is_definition(endian, table.strings()) {
                continue;
            }
            let Ok(sym_name) = sym.name(endian, table.strings()) else {
                continue;
            };
            if sym_name != name.as_bytes() {
                continue;
            }
            let address = sym.st_value(endian);
            let (mut version, mut is_default) = (None, true);
            if sh_type == SHT_DYNSYM
                && let Some(v) = &versions
            {
                let vi = v.version_index(endian, SymbolIndex(i));
                is_default = !vi.is_hidden();
                version = v
                    .version(vi)
                    .ok()
                    .flatten()
                    .map(|v| String::from_utf8_lossy(v.name()).into_owned());
            }
            let Ok(section) =
                sections.section(object::SectionIndex(usize::from(sym.st_shndx(endian))))
            else {
                continue;
            };
            let (sh_addr, sh_offset) = (section.sh_addr(endian), section.sh_offset(endian));
            let Some(file_offset) = address
                .checked_sub(sh_addr)
                .and_then(|o| o.checked_add(sh_offset))
            else {
                continue;
            };
            out.push(SymbolDef {
                address,
                file_offset,
                version,
                is_default,
                dynamic: sh_type == SHT_DYNSYM,
            });
        }
    }
    Ok(out)
}

/// The definition a uprobe on `spec` should attach to. `spec` is `name` (the default version,
/// else the first definition) or `name@VERSION` (that version).
pub fn resolve(path: &Path, spec: &str) -> Result<SymbolDef, SymbolError> {
    let (name, want) = match spec.split_once('@') {
        Some((n, v)) => (n, Some(v.trim_start_matches('@'))),
        None => (spec, None),
    };
    let defs = definitions(path, name)?;
    let pick = match want {
        Some(v) => defs.iter().find(|d| d.version.as_deref() == Some(v)),
        None => defs
            .iter()
            .find(|d| d.dynamic && d.is_default)
            .or_else(|| defs.first()),
    };
    pick.cloned().ok_or_else(|| SymbolError::NotFound {
        path: path.to_owned(),
        symbol: spec.to_owned(),
    })
}

/// The path of a library `name` (e.g. `libibverbs.so.1`) as mapped by process `pid`.
pub fn mapped_library(pid: u32, name: &str) -> Option<PathBuf> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).ok()?;
    maps.lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| {
            Path::new(p)
                .file_name()
                .and_then(|f| f.to_str())
                .is_some_and(|f| f.starts_with(name))
        })
        .map(PathBuf::from)
}

/// The first existing path of a library in the usual directories (for `--binary` runs).
pub fn find_library(name: &str) -> Option<PathBuf> {
    [
        "/usr/lib/x86_64-linux-gnu",
        "/lib/x86_64-linux-gnu",
        "/usr/lib64",
        "/usr/lib",
    ]
    .iter()
    .map(|d| Path::new(d).join(name))
    .find(|p| p.exists())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolves_own_function() {
        // The test binary itself: a function defined here is found in .symtab at least.
        let exe = std::fs::read_link("/proc/self/exe").expect("self exe");
        let defs = definitions(&exe, "main").expect("read self");
        assert!(!defs.is_empty());
    }

    /// The libibverbs case the module exists for: the default version, not the first symbol.
    #[test]
    fn libibverbs_default_version_is_preferred() {
        let Some(lib) = find_library("libibverbs.so.1") else {
            custody_test_skip::skip(
                "ebpf::symbols::libibverbs_default_version_is_preferred",
                "libibverbs.so.1 is not installed (scripts/setup.sh installs it)",
                custody_test_skip::Need::OnCi,
            );
            return;
        };
        for name in [
            "ibv_reg_mr",
            "ibv_dereg_mr",
            "ibv_create_qp",
            "ibv_modify_qp",
            "ibv_destroy_qp",
        ] {
            let defs = definitions(&lib, name).expect("read libibverbs");
            let dynamic: Vec<_> = defs.iter().filter(|d| d.dynamic).collect();
            assert!(
                dynamic.len() >= 2,
                "{name}: expected a compat and a default version, got {defs:?}"
            );
            let r = resolve(&lib, name).expect("resolve");
            assert!(r.is_default, "{name}: {r:?}");
            assert_eq!(r.version.as_deref(), Some("IBVERBS_1.1"), "{name}");
            let compat = resolve(&lib, &format!("{name}@IBVERBS_1.0")).expect("compat");
            assert!(!compat.is_default);
            assert_ne!(compat.file_offset, r.file_offset, "{name}");
        }
    }
}
