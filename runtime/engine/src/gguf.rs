//! GGUF reader over a memory map.
//!
//! Spec: <https://github.com/ggml-org/ggml/blob/master/docs/gguf.md>. Versions 2 and 3, little
//! endian. Every read is bounds-checked against the file and every count is checked against the
//! bytes that remain before anything is allocated for it, so a truncated or corrupted file yields a
//! [`GgufError`] naming what is wrong — never a panic, an out-of-bounds read or a huge allocation.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use custody_kernels::DType;
use memmap2::Mmap;

pub mod write;

const MAGIC: &[u8; 4] = b"GGUF";
/// No GGUF tensor has more than 4 dimensions (ggml's `GGML_MAX_DIMS`).
const MAX_DIMS: u32 = 4;
/// Nesting bound for arrays of arrays (none of the known keys nests at all).
const MAX_ARRAY_DEPTH: usize = 2;

#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("cannot open {path}: {source}")]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("not a GGUF file: magic is {found:02x?}, expected \"GGUF\"")]
    BadMagic { found: [u8; 4] },
    #[error("unsupported GGUF version {0} (supported: 2, 3)")]
    UnsupportedVersion(u32),
    #[error("file truncated: {what} at byte {offset} needs {needed} bytes, file has {len}")]
    Truncated {
        what: String,
        offset: u64,
        needed: u64,
        len: u64,
    },
    #[error("{what} at byte {offset} is not valid UTF-8")]
    InvalidUtf8 { what: String, offset: u64 },
    #[error("metadata key {key:?}: unknown value type {ty}")]
    UnknownValueType { key: String, ty: u32 },
    #[error("metadata key {key:?}: arrays nested deeper than {MAX_ARRAY_DEPTH}")]
    ArrayTooDeep { key: String },
    #[error("tensor {name:?}: {n_dims} dimensions (at most {MAX_DIMS})")]
    TooManyDims { name: String, n_dims: u32 },
    #[error(
        "tensor {name:?}: unsupported tensor type {} (ggml type {ty}; supported: F32, F16, BF16, \
         Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)",
        ggml_type_name(*ty)
    )]
    UnsupportedTensorType { name: String, ty: u32 },
    #[error(
        "tensor {name:?}: shape {shape:?} is not a whole number of {dtype:?} blocks or overflows"
    )]
    BadShape {
        name: String,
        shape: Vec<u64>,
        dtype: DType,
    },
    #[error("tensor {name:?}: data offset {offset} is not aligned to {alignment}")]
    Misaligned {
        name: String,
        offset: u64,
        alignment: u64,
    },
    #[error("tensor {name:?}: data [{start}, {end}) lies outside the file ({len} bytes)")]
    TensorOutOfBounds {
        name: String,
        start: u64,
        end: u64,
        len: u64,
    },
    #[error("duplicate tensor name {0:?}")]
    DuplicateTensor(String),
    #[error("general.alignment {0} is not a non-zero power of two")]
    BadAlignment(u64),
    #[error("metadata key {0:?} is missing")]
    MissingKey(String),
    #[error("metadata key {key:?} has type {found}, expected {expected}")]
    WrongType {
        key: String,
        expected: &'static str,
        found: &'static str,
    },
    #[error("tensor {0:?} is missing")]
    MissingTensor(String),
}

type Result<T> = std::result::Result<T, GgufError>;

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Value {
    fn type_name(&self) -> &'static str {
        match self {
            Value::U8(_) => "u8",
            Value::I8(_) => "i8",
            Value::U16(_) => "u16",
            Value::I16(_) => "i16",
            Value::U32(_) => "u32",
            Value::I32(_) => "i32",
            Value::F32(_) => "f32",
            Value::Bool(_) => "bool",
            Value::String(_) => "string",
            Value::Array(_) => "array",
            Value::U64(_) => "u64",
            Value::I64(_) => "i64",
            Value::F64(_) => "f64",
        }
    }

    /// Any non-negative integer as u64.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }
}

/// One tensor's description; its bytes are in [`Gguf::tensor_data`].
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order: `shape[0]` is the contiguous (column) dimension.
    pub shape: Vec<u64>,
    pub dtype: DType,
    /// Absolute byte range in the file.
    pub start: usize,
    pub len: usize,
}

/// An opened, fully validated GGUF file.
#[derive(Debug)]
pub struct Gguf {
    mmap: Mmap,
    pub version: u32,
    pub metadata: BTreeMap<String, Value>,
    pub tensors: BTreeMap<String, TensorInfo>,
    pub alignment: u64,
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: u64, what: &dyn Fn() -> String) -> Result<&'a [u8]> {
        let remaining = (self.buf.len() - self.pos) as u64;
        if n > remaining {
            return Err(GgufError::Truncated {
                what: what(),
                offset: self.pos as u64,
                needed: n,
                len: self.buf.len() as u64,
            });
        }
        let n = n as usize;
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N]> {
        let s = self.take(N as u64, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String> {
        let len = self.u64(what)?;
        let offset = self.pos as u64;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| GgufError::InvalidUtf8 {
            what: what(),
            offset,
        })
    }

    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }
}

fn read_value(c: &mut Cursor<'_>, ty: u32, key: &str, depth: usize) -> Result<Value> {
    let what = || format!("value of metadata key {key:?}");
    Ok(match ty {
        0 => Value::U8(c.array::<1>(&what)?[0]),
        1 => Value::I8(c.array::<1>(&what)?[0] as i8),
        2 => Value::U16(u16::from_le_bytes(c.array(&what)?)),
        3 => Value::I16(i16::from_le_bytes(c.array(&what)?)),
        4 => Value::U32(u32::from_le_bytes(c.array(&what)?)),
        5 => Value::I32(i32::from_le_bytes(c.array(&what)?)),
        6 => Value::F32(f32::from_le_bytes(c.array(&what)?)),
        7 => Value::Bool(c.array::<1>(&what)?[0] != 0),
        8 => Value::String(c.string(&what)?),
        9 => {
            if depth >= MAX_ARRAY_DEPTH {
                return Err(GgufError::ArrayTooDeep {
                    key: key.to_owned(),
                });
            }
            let elem_ty = c.u32(&what)?;
            let count = c.u64(&what)?;
            // Every element takes at least one byte: a count above the remaining bytes is a lie
            // (corruption), caught before allocating for it.
            if count > c.remaining() {
                return Err(GgufError::Truncated {
                    what: format!("array of {count} elements for key {key:?}"),
                    offset: c.pos as u64,
                    needed: count,
                    len: c.buf.len() as u64,
                });
            }
            let mut items = Vec::with_capacity(count as usize);
            for _ in 0..count {
                items.push(read_value(c, elem_ty, key, depth + 1)?);
            }
            Value::Array(items)
        }
        10 => Value::U64(u64::from_le_bytes(c.array(&what)?)),
        11 => Value::I64(i64::from_le_bytes(c.array(&what)?)),
        12 => Value::F64(f64::from_le_bytes(c.array(&what)?)),
        ty => {
            return Err(GgufError::UnknownValueType {
                key: key.to_owned(),
                ty,
            });
        }
    })
}

/// ggml's name for tensor type `ty` (`ggml_type` in ggml.h), for error messages.
pub fn ggml_type_name(ty: u32) -> &'static str {
    const NAMES: [&str; 40] = [
        "F32",
        "F16",
        "Q4_0",
        "Q4_1",
        "Q4_2 (removed)",
        "Q4_3 (removed)",
        "Q5_0",
        "Q5_1",
        "Q8_0",
        "Q8_1",
        "Q2_K",
        "Q3_K",
        "Q4_K",
        "Q5_K",
        "Q6_K",
        "Q8_K",
        "IQ2_XXS",
        "IQ2_XS",
        "IQ3_XXS",
        "IQ1_S",
        "IQ4_NL",
        "IQ3_S",
        "IQ2_S",
        "IQ4_XS",
        "I8",
        "I16",
        "I32",
        "I64",
        "F64",
        "IQ1_M",
        "BF16",
        "Q4_0_4_4 (removed)",
        "Q4_0_4_8 (removed)",
        "Q4_0_8_8 (removed)",
        "TQ1_0",
        "TQ2_0",
        "IQ4_NL_4_4 (removed)",
        "IQ4_NL_4_8 (removed)",
        "IQ4_NL_8_8 (removed)",
        "MXFP4",
    ];
    NAMES.get(ty as usize).copied().unwrap_or("unknown")
}

fn dtype_of(ty: u32) -> Option<DType> {
    DType::from_ggml_type(ty)
}

impl Gguf {
    /// Open and validate `path`.
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(|source| GgufError::Open {
            path: path.into(),
            source,
        })?;
        // SAFETY: the mapping is read-only. The model file must not be modified while the engine
        // runs (as with llama.cpp's mmap); all accesses are bounds-checked against the map length.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|source| GgufError::Open {
            path: path.into(),
            source,
        })?;
        Self::parse(mmap)
    }

    fn parse(mmap: Mmap) -> Result<Self> {
        let (version, metadata, infos, alignment, data_start) = {
            let mut c = Cursor {
                buf: &mmap[..],
                pos: 0,
            };
            let magic: [u8; 4] = c.array(&|| "magic".into())?;
            if &magic != MAGIC {
                return Err(GgufError::BadMagic { found: magic });
            }
            let version = c.u32(&|| "version".into())?;
            if !(2..=3).contains(&version) {
                return Err(GgufError::UnsupportedVersion(version));
            }
            let n_tensors = c.u64(&|| "tensor count".into())?;
            let n_kv = c.u64(&|| "metadata count".into())?;
            let mut metadata = BTreeMap::new();
            for i in 0..n_kv {
                let key = c.string(&|| format!("key of metadata entry {i}"))?;
                let ty = c.u32(&|| format!("type of metadata key {key:?}"))?;
                let v = read_value(&mut c, ty, &key, 0)?;
                metadata.insert(key, v);
            }
            let alignment = match metadata.get("general.alignment") {
                None => 32,
                Some(v) => v
                    .as_u64()
                    .filter(|a| a.is_power_of_two())
                    .ok_or_else(|| GgufError::BadAlignment(v.as_u64().unwrap_or(0)))?,
            };
            let mut infos = Vec::new();
            for i in 0..n_tensors {
                // A tensor info takes at least 8 + 4 + 4 + 8 bytes; refuse absurd counts early.
                if c.remaining() < 24 {
                    return Err(GgufError::Truncated {
                        what: format!("tensor info {i} of {n_tensors}"),
                        offset: c.pos as u64,
                        needed: 24,
                        len: c.buf.len() as u64,
                    });
                }
                let name = c.string(&|| format!("name of tensor {i}"))?;
                let n_dims = c.u32(&|| format!("dimension count of tensor {name:?}"))?;
                if n_dims > MAX_DIMS {
                    return Err(GgufError::TooManyDims { name, n_dims });
                }
                let mut shape = Vec::with_capacity(n_dims as usize);
                for _ in 0..n_dims {
                    shape.push(c.u64(&|| format!("shape of tensor {name:?}"))?);
                }
                let ty = c.u32(&|| format!("type of tensor {name:?}"))?;
                let offset = c.u64(&|| format!("offset of tensor {name:?}"))?;
                let dtype = dtype_of(ty).ok_or_else(|| GgufError::UnsupportedTensorType {
                    name: name.clone(),
                    ty,
                })?;
                infos.push((name, shape, dtype, offset));
            }
            let data_start = (c.pos as u64).div_ceil(alignment) * alignment;
            (version, metadata, infos, alignment, data_start)
        };
        let len = mmap.len() as u64;
        let mut tensors = BTreeMap::new();
        for (name, shape, dtype, offset) in infos {
            let n_elems = shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
            let bytes = n_elems
                .and_then(|n| dtype.bytes_for(n))
                .filter(|_| shape.first().is_none_or(|&c| dtype.bytes_for(c).is_some()))
                .ok_or_else(|| GgufError::BadShape {
                    name: name.clone(),
                    shape: shape.clone(),
                    dtype,
                })?;
            if offset % alignment != 0 {
                return Err(GgufError::Misaligned {
                    name,
                    offset,
                    alignment,
                });
            }
            let start = data_start.checked_add(offset);
            let end = start.and_then(|s| s.checked_add(bytes));
            match (start, end) {
                (Some(start), Some(end)) if end <= len => {
                    let info = TensorInfo {
                        name: name.clone(),
                        shape,
                        dtype,
                        start: start as usize,
                        len: bytes as usize,
                    };
                    if tensors.insert(name.clone(), info).is_some() {
                        return Err(GgufError::DuplicateTensor(name));
                    }
                }
                _ => {
                    return Err(GgufError::TensorOutOfBounds {
                        name,
                        start: start.unwrap_or(u64::MAX),
                        end: end.unwrap_or(u64::MAX),
                        len,
                    });
                }
            }
        }
        Ok(Self {
            mmap,
            version,
            metadata,
            tensors,
            alignment,
        })
    }

    /// The bytes of tensor `name`.
    pub fn tensor(&self, name: &str) -> Result<(&TensorInfo, &[u8])> {
        let info = self
            .tensors
            .get(name)
            .ok_or_else(|| GgufError::MissingTensor(name.to_owned()))?;
        // In bounds: checked in `parse`.
        Ok((info, &self.mmap[info.start..info.start + info.len]))
    }

    /// Drop the resident pages of tensor `name` from this process (`MADV_DONTNEED`): for a
    /// tensor the engine has copied (repacked) and no longer reads, so the copy replaces the
    /// mapped original in memory instead of doubling it. A later read of the tensor is still
    /// correct: the map is a read-only shared file mapping, so its pages fault back in from the
    /// file. Pages shared with a neighbouring tensor are dropped too (and fault back the same way).
    pub fn release_tensor_pages(&self, name: &str) -> Result<()> {
        let info = self
            .tensors
            .get(name)
            .ok_or_else(|| GgufError::MissingTensor(name.to_owned()))?;
        #[cfg(unix)]
        {
            // SAFETY: DONTNEED on a read-only MAP_SHARED file mapping only unmaps pages from this
            // process; every byte reads the same afterwards (refaulted from the page cache or
            // the file), so no reference into the map observes a change. The range is in
            // bounds (checked in `parse`).
            let dropped = unsafe {
                self.mmap.unchecked_advise_range(
                    memmap2::UncheckedAdvice::DontNeed,
                    info.start,
                    info.len,
                )
            };
            if let Err(e) = dropped {
                // Only memory is at stake: the tensor stays resident, as before the repack.
                tracing::warn!(tensor = name, error = %e, "could not release a repacked tensor's mapped pages");
            }
        }
        Ok(())
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    fn require(&self, key: &str) -> Result<&Value> {
        self.get(key)
            .ok_or_else(|| GgufError::MissingKey(key.to_owned()))
    }

    fn wrong(&self, key: &str, expected: &'static str, v: &Value) -> GgufError {
        GgufError::WrongType {
            key: key.to_owned(),
            expected,
            found: v.type_name(),
        }
    }

    pub fn get_u64(&self, key: &str) -> Result<u64> {
        let v = self.require(key)?;
        v.as_u64()
            .ok_or_else(|| self.wrong(key, "unsigned integer", v))
    }

    pub fn get_f64(&self, key: &str) -> Result<f64> {
        let v = self.require(key)?;
        v.as_f64().ok_or_else(|| self.wrong(key, "number", v))
    }

    pub fn get_str(&self, key: &str) -> Result<&str> {
        match self.require(key)? {
            Value::String(s) => Ok(s),
            v => Err(self.wrong(key, "string", v)),
        }
    }

    pub fn get_array(&self, key: &str) -> Result<&[Value]> {
        match self.require(key)? {
            Value::Array(a) => Ok(a),
            v => Err(self.wrong(key, "array", v)),
        }
    }

    /// An array of strings.
    pub fn get_strings(&self, key: &str) -> Result<Vec<&str>> {
        self.get_array(key)?
            .iter()
            .map(|v| match v {
                Value::String(s) => Ok(s.as_str()),
                v => Err(self.wrong(key, "array of strings", v)),
            })
            .collect()
    }

    /// SHA-256 of the whole file, hex: the model fingerprint nodes compare in the handshake.
    pub fn sha256_hex(&self) -> String {
        self.sha256().iter().map(|b| format!("{b:02x}")).collect()
    }

    /// SHA-256 of the whole file.
    pub fn sha256(&self) -> [u8; 32] {
        use sha2::Digest;
        sha2::Sha256::digest(&self.mmap[..]).into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use custody_transport::Discard;

    /// Write a small valid GGUF (v3) with a few metadata kinds and two tensors.
    pub(crate) fn tiny_gguf() -> Vec<u8> {
        fn s(b: &mut Vec<u8>, x: &str) {
            b.extend_from_slice(&(x.len() as u64).to_le_bytes());
            b.extend_from_slice(x.as_bytes());
        }
        let mut b = Vec::new();
        b.extend_from_slice(b"GGUF");
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&2u64.to_le_bytes()); // tensors
        b.extend_from_slice(&3u64.to_le_bytes()); // kv
        s(&mut b, "general.architecture");
        b.extend_from_slice(&8u32.to_le_bytes());
        s(&mut b, "llama");
        s(&mut b, "llama.block_count");
        b.extend_from_slice(&4u32.to_le_bytes());
        b.extend_from_slice(&2u32.to_le_bytes());
        s(&mut b, "tokenizer.ggml.tokens");
        b.extend_from_slice(&9u32.to_le_bytes());
        b.extend_from_slice(&8u32.to_le_bytes());
        b.extend_from_slice(&2u64.to_le_bytes());
        s(&mut b, "a");
        s(&mut b, "b");
        // tensor 0: f32 [4] at 0; tensor 1: q8_0 [32, 1] at 32
        s(&mut b, "norm.weight");
        b.extend_from_slice(&1u32.to_le_bytes());
        b.extend_from_slice(&4u64.to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes());
        b.extend_from_slice(&0u64.to_le_bytes());
        s(&mut b, "embd.weight");
        b.extend_from_slice(&2u32.to_le_bytes());
        b.extend_from_slice(&32u64.to_le_bytes());
        b.extend_from_slice(&1u64.to_le_bytes());
        b.extend_from_slice(&8u32.to_le_bytes());
        b.extend_from_slice(&32u64.to_le_bytes());
        while b.len() % 32 != 0 {
            b.push(0);
        }
        for v in [1.0f32, 2.0, 3.0, 4.0] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b.resize(b.len() + 16, 0);
        b.extend_from_slice(&half::f16::from_f32(0.5).to_le_bytes());
        b.extend((0..32).map(|i| i as u8));
        b
    }

    fn parse_bytes(bytes: &[u8]) -> Result<Gguf> {
        use std::sync::atomic::{AtomicU64, Ordering};
        static N: AtomicU64 = AtomicU64::new(0);
        let path = std::env::temp_dir().join(format!(
            "custody-gguf-test-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::write(&path, bytes).expect("write temp file");
        let r = Gguf::open(&path);
        std::fs::remove_file(&path).discard("a leftover temporary file is harmless");
        r
    }

    #[test]
    fn a_tensor_type_the_engine_does_not_read_is_refused_by_name() {
        // embd.weight's type field (after its name, dim count and two dims) → IQ2_XS (17).
        let mut b = tiny_gguf();
        let name = b"embd.weight";
        let at = b.windows(name.len()).position(|w| w == name).expect("name") + name.len();
        let ty = at + 4 + 16;
        assert_eq!(b[ty..ty + 4], 8u32.to_le_bytes(), "the Q8_0 type field");
        b[ty..ty + 4].copy_from_slice(&17u32.to_le_bytes());
        let err = parse_bytes(&b).expect_err("IQ2_XS is not read").to_string();
        assert!(
            err.contains("\"embd.weight\"")
                && err.contains("IQ2_XS")
                && err.contains("ggml type 17"),
            "{err}"
        );
        // A K-quant is read: the same field as Q4_K (12) parses, and the size check applies
        // (32 elements are not a whole 256-element block).
        b[ty..ty + 4].copy_from_slice(&12u32.to_le_bytes());
        let err = parse_bytes(&b)
            .expect_err("32 elements of Q4_K")
            .to_string();
        assert!(err.contains("Q4_K"), "{err}");
    }

    #[test]
    fn parses_a_valid_file() {
        let g = parse_bytes(&tiny_gguf()).expect("valid");
        assert_eq!(g.version, 3);
        assert_eq!(g.get_str("general.architecture").expect("arch"), "llama");
        assert_eq!(g.get_u64("llama.block_count").expect("n"), 2);
        assert_eq!(
            g.get_strings("tokenizer.ggml.tokens").expect("tokens"),
            vec!["a", "b"]
        );
        let (info, data) = g.tensor("norm.weight").expect("tensor");
        assert_eq!(info.dtype, DType::F32);
        assert_eq!(data.len(), 16);
        assert_eq!(
            f32::from_le_bytes([data[4], data[5], data[6], data[7]]),
            2.0
        );
        let (info, data) = g.tensor("embd.weight").expect("tensor");
        assert_eq!((info.dtype, data.len()), (DType::Q8_0, 34));
        assert!(matches!(
            g.get_str("llama.block_count"),
            Err(GgufError::WrongType { .. })
        ));
        assert!(matches!(g.tensor("nope"), Err(GgufError::MissingTensor(_))));
    }

    #[test]
    fn every_truncation_is_a_clear_error() {
        let full = tiny_gguf();
        for n in 0..full.len() {
            match parse_bytes(&full[..n]) {
                Err(
                    GgufError::Truncated { .. }
                    | GgufError::TensorOutOfBounds { .. }
                    | GgufError::BadMagic { .. },
                ) => {}
                Err(e) => panic!("truncation at {n}: unexpected error kind {e}"),
                Ok(_) => panic!("truncation at {n} parsed as valid"),
            }
        }
    }

    #[test]
    fn byte_flips_never_panic() {
        let full = tiny_gguf();
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..3000 {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let mut b = full.clone();
            let i = (seed % b.len() as u64) as usize;
            b[i] ^= 1 << ((seed >> 32) % 8);
            // Either a valid parse or a typed error; a panic fails the test.
            if let Err(e) = parse_bytes(&b) {
                assert!(
                    !e.to_string().is_empty(),
                    "a typed error says what is wrong"
                );
            }
        }
    }

    #[test]
    fn specific_corruptions_name_the_problem() {
        let mut b = tiny_gguf();
        b[0] = b'X';
        assert!(matches!(parse_bytes(&b), Err(GgufError::BadMagic { .. })));
        let mut b = tiny_gguf();
        b[4] = 9;
        assert!(matches!(
            parse_bytes(&b),
            Err(GgufError::UnsupportedVersion(9))
        ));
        // huge tensor count
        let mut b = tiny_gguf();
        b[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(parse_bytes(&b), Err(GgufError::Truncated { .. })));
        // huge string length in the first key
        let mut b = tiny_gguf();
        b[24..32].copy_from_slice(&(u64::MAX - 3).to_le_bytes());
        assert!(matches!(parse_bytes(&b), Err(GgufError::Truncated { .. })));
    }
}
