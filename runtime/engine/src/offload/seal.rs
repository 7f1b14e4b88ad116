//! Sealed pages: what a KV page carries when it leaves the pool for an offload tier, and the one
//! way back in.
//!
//! # Spec
//! A sealed page is `header ‖ body ‖ mac`:
//! - **header**: magic `CKVO`, format version, flags (bit 0: the body is AES-256-GCM
//!   ciphertext), the sealing key's id, the page's chain key, the model fingerprint (SHA-256 of
//!   the GGUF file), the geometry (slots per page, KV heads, head dimension, KV type, layers), the
//!   namespace (tag, kind, label), the page's generation and filled slots where it was written,
//!   its writer (node, request, tenant), the body's length and the GCM nonce. Integers are
//!   little-endian; strings are length-prefixed (u16).
//! - **body**: the page's K/V in transfer order (per layer, K then V: the bytes
//!   [`crate::kv::PagePool`] exports), or their ciphertext and GCM tag, with the header as
//!   associated data.
//! - **mac**: HMAC-SHA-256(MAC key, header ‖ body).
//!
//! [`open`] believes nothing of a page before its MAC verifies (constant time, over exactly the
//! bytes it then parses); then it checks the key id, the fingerprint, the geometry, that the
//! chain key and namespace are the ones the reader looked up, and that the page is whole; then it
//! decrypts. Only [`open`] makes a [`VerifiedPage`] (private fields), and a verified page is the
//! only thing [`crate::kv::PagePool::restore`] takes: no page enters a pool unverified.
//!
//! Why not a general format (COSE, age): a page is one fixed record sealed and opened by this
//! module only, and the check order above is the point; HMAC and AES-GCM are `ring`'s.

use std::num::NonZeroU64;
use std::sync::Arc;

use custody_kernels::attention::{KvType, PageGeometry};
use ring::aead::{AES_256_GCM, Aad, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};
use ring::hmac;

use crate::prefix_cache::{BlockKey, ScopeKind};

const MAGIC: &[u8; 4] = b"CKVO";
const VERSION: u16 = 1;
const FLAG_ENCRYPTED: u16 = 1;
/// HMAC-SHA-256 output.
pub const MAC_BYTES: usize = 32;
/// Bytes of a key id.
pub const KEY_ID_BYTES: usize = 8;
/// Longest tenant or namespace label a header holds (u16 length prefix).
const MAX_LABEL_BYTES: usize = u16::MAX as usize;
/// Domain separation of the key id.
const KEY_ID_DOMAIN: &[u8] = b"custody kv offload key id v1";

/// The keys pages are sealed with: the MAC key (a fleet's nodes share it to read each other's
/// pages) and, optionally, the AES-256-GCM key that makes every sealed body ciphertext.
pub struct SealKeys {
    mac: hmac::Key,
    key_id: [u8; KEY_ID_BYTES],
    aead: Option<LessSafeKey>,
}

impl std::fmt::Debug for SealKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "SealKeys(id {}, encrypted: {})",
            hex(&self.key_id),
            self.aead.is_some()
        )
    }
}

impl SealKeys {
    /// Keys from 32 bytes of MAC key material and an optional 32-byte AES-256 key.
    pub fn new(mac_key: &[u8; 32], aes_key: Option<&[u8; 32]>) -> Self {
        let mac = hmac::Key::new(hmac::HMAC_SHA256, mac_key);
        let id = hmac::sign(&mac, KEY_ID_DOMAIN);
        let mut key_id = [0u8; KEY_ID_BYTES];
        key_id.copy_from_slice(&id.as_ref()[..KEY_ID_BYTES]);
        let aead = aes_key.map(|k| {
            let Ok(unbound) = UnboundKey::new(&AES_256_GCM, k) else {
                unreachable!("AES-256-GCM takes any 32-byte key")
            };
            LessSafeKey::new(unbound)
        });
        Self { mac, key_id, aead }
    }

    /// Whether sealed bodies are ciphertext.
    pub fn encrypts(&self) -> bool {
        self.aead.is_some()
    }

    /// The key id every page sealed with these keys carries (hex).
    pub fn key_id_hex(&self) -> String {
        hex(&self.key_id)
    }
}

/// What a page's bytes are the K/V of: the model and the pool's page shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// SHA-256 of the model's GGUF file.
    pub fingerprint: [u8; 32],
    pub geom: PageGeometry,
    pub n_layers: u32,
}

impl Layout {
    /// Bytes of a whole page's K/V over every layer.
    pub fn body_bytes(&self) -> usize {
        2 * self.n_layers as usize * self.geom.page_words() * 2
    }
}

/// Who computed a page.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Writer {
    pub node: u32,
    pub request: u64,
    pub tenant: Arc<str>,
}

/// What travels with a page besides its bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PageMeta {
    /// The key it is stored and looked up under.
    pub key: BlockKey,
    pub namespace: NonZeroU64,
    pub kind: ScopeKind,
    pub scope: Arc<str>,
    /// The page's generation in the pool it was written in.
    pub generation: u32,
    /// Slots written (a whole page: only full pages are cached).
    pub filled: u32,
    pub writer: Writer,
}

/// What the reader looked up: a page opened for it must be exactly this.
#[derive(Clone, Copy, Debug)]
pub struct Expect<'a> {
    pub key: &'a BlockKey,
    /// The namespace the reader's chain puts this page in; `None` only under
    /// `[unsafe_reproduction] token_only_offload` (the external tier keyed on tokens alone: any
    /// namespace's page is taken — the leak it reproduces).
    pub namespace: Option<NonZeroU64>,
}

/// A sealed page that passed every check of [`open`]; the only input of
/// [`crate::kv::PagePool::restore`].
#[derive(Debug)]
pub struct VerifiedPage {
    meta: PageMeta,
    body: Vec<u8>,
}

impl VerifiedPage {
    pub fn meta(&self) -> &PageMeta {
        &self.meta
    }
    /// The page's K/V in transfer order ([`Layout::body_bytes`] long).
    pub(crate) fn body(&self) -> &[u8] {
        &self.body
    }
}

/// Why a sealed page was refused. Each is a clean miss and an `integrity_violations` row of
/// kind [`OpenError::kind`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum OpenError {
    #[error("sealed page of {got} bytes is shorter than its header and MAC")]
    Truncated { got: usize },
    #[error("MAC mismatch: the page was changed, cut, or sealed with another key")]
    Mac,
    #[error("malformed header: {0}")]
    Format(&'static str),
    #[error("sealed with key {got}, this node's is {want}")]
    KeyId { got: String, want: String },
    #[error("a page of another model (fingerprint {got}, this node's {want})")]
    Fingerprint { got: String, want: String },
    #[error("a page of another geometry ({got}; this pool's {want})")]
    Geometry { got: String, want: String },
    #[error("the page is stored under another chain key than the one it names")]
    ChainKey,
    #[error("a page of namespace {got:016x}, the reader looked up {want:016x}")]
    Namespace { got: u64, want: u64 },
    #[error("the page holds {filled} of {page_size} slots: only whole pages are offloaded")]
    Slots { filled: u32, page_size: u32 },
    #[error("the body is ciphertext and this node has no decryption key, or it failed to decrypt")]
    Decrypt,
    #[error("the body is plaintext but this node requires ciphertext")]
    Plaintext,
}

impl OpenError {
    /// The `integrity_violations` kind.
    pub fn kind(&self) -> &'static str {
        match self {
            OpenError::Truncated { .. } => "offload_truncated",
            OpenError::Mac => "offload_mac",
            OpenError::Format(_) => "offload_format",
            OpenError::KeyId { .. } => "offload_key",
            OpenError::Fingerprint { .. } => "offload_model",
            OpenError::Geometry { .. } => "offload_geometry",
            OpenError::ChainKey => "offload_chain_key",
            OpenError::Namespace { .. } => "offload_namespace",
            OpenError::Slots { .. } => "offload_slots",
            OpenError::Decrypt => "offload_decrypt",
            OpenError::Plaintext => "offload_plaintext",
        }
    }
}

/// A page could not be sealed.
#[derive(Debug, thiserror::Error)]
pub enum SealError {
    #[error("page body of {got} bytes, the layout's is {want}")]
    BodyLength { got: usize, want: usize },
    #[error("a label of {0} bytes does not fit a header")]
    Label(usize),
    #[error("the OS random generator failed")]
    Random,
    #[error("AES-GCM sealing failed")]
    Encrypt,
}

fn kv_code(kv: KvType) -> u8 {
    match kv {
        KvType::F16 => 0,
        KvType::Q8_0 => 1,
    }
}

fn kind_code(kind: &ScopeKind) -> u8 {
    match kind {
        ScopeKind::Tenant => 1,
        ScopeKind::Public => 2,
        ScopeKind::UnsafeGlobal => 3,
    }
}

fn describe_geometry(geom: &PageGeometry, n_layers: u32) -> String {
    format!(
        "{} slots × {} KV heads × {} dims, {}, {} layers",
        geom.page_size,
        geom.n_kv_heads,
        geom.head_dim,
        geom.kv.name(),
        n_layers
    )
}

/// Seal `body` (a page's K/V in transfer order) with `meta` for `layout`.
pub fn seal(
    keys: &SealKeys,
    layout: &Layout,
    meta: &PageMeta,
    body: &[u8],
) -> Result<Vec<u8>, SealError> {
    let want = layout.body_bytes();
    if body.len() != want {
        return Err(SealError::BodyLength {
            got: body.len(),
            want,
        });
    }
    let mut nonce = [0u8; NONCE_LEN];
    if keys.aead.is_some() {
        use ring::rand::SecureRandom;
        ring::rand::SystemRandom::new()
            .fill(&mut nonce)
            .map_err(|_| SealError::Random)?;
    }
    let body_len = body.len() + if keys.aead.is_some() { 16 } else { 0 };
    let mut out = Vec::with_capacity(512 + body_len + MAC_BYTES);
    write_header(&mut out, keys, layout, meta, body_len as u64, &nonce)?;
    let header_len = out.len();
    out.extend_from_slice(body);
    if let Some(aead) = &keys.aead {
        let (header, rest) = out.split_at_mut(header_len);
        let tag = aead
            .seal_in_place_separate_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(&*header),
                rest,
            )
            .map_err(|_| SealError::Encrypt)?;
        out.extend_from_slice(tag.as_ref());
    }
    let mac = hmac::sign(&keys.mac, &out);
    out.extend_from_slice(mac.as_ref());
    debug_assert_eq!(out.len(), header_len + body_len + MAC_BYTES);
    Ok(out)
}

fn put_label(out: &mut Vec<u8>, s: &str) -> Result<(), SealError> {
    if s.len() > MAX_LABEL_BYTES {
        return Err(SealError::Label(s.len()));
    }
    out.extend_from_slice(&(s.len() as u16).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
    Ok(())
}

fn write_header(
    out: &mut Vec<u8>,
    keys: &SealKeys,
    layout: &Layout,
    meta: &PageMeta,
    body_len: u64,
    nonce: &[u8; NONCE_LEN],
) -> Result<(), SealError> {
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    let flags = if keys.aead.is_some() {
        FLAG_ENCRYPTED
    } else {
        0
    };
    out.extend_from_slice(&flags.to_le_bytes());
    out.extend_from_slice(&keys.key_id);
    out.extend_from_slice(&meta.key);
    out.extend_from_slice(&layout.fingerprint);
    for v in [
        layout.geom.page_size as u32,
        layout.geom.n_kv_heads as u32,
        layout.geom.head_dim as u32,
        layout.n_layers,
    ] {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out.push(kv_code(layout.geom.kv));
    out.extend_from_slice(&meta.namespace.get().to_le_bytes());
    out.push(kind_code(&meta.kind));
    put_label(out, &meta.scope)?;
    out.extend_from_slice(&meta.generation.to_le_bytes());
    out.extend_from_slice(&meta.filled.to_le_bytes());
    out.extend_from_slice(&meta.writer.node.to_le_bytes());
    out.extend_from_slice(&meta.writer.request.to_le_bytes());
    put_label(out, &meta.writer.tenant)?;
    out.extend_from_slice(&body_len.to_le_bytes());
    out.extend_from_slice(nonce);
    Ok(())
}

/// A bounds-checked reader over an authenticated header.
struct Fields<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Fields<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], OpenError> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.b.len())
            .ok_or(OpenError::Format("header runs past the page"))?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], OpenError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, OpenError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, OpenError> {
        Ok(u16::from_le_bytes(self.array()?))
    }
    fn u32(&mut self) -> Result<u32, OpenError> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    fn u64(&mut self) -> Result<u64, OpenError> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    fn label(&mut self) -> Result<Arc<str>, OpenError> {
        let n = self.u16()? as usize;
        std::str::from_utf8(self.take(n)?)
            .map(Arc::from)
            .map_err(|_| OpenError::Format("a label is not UTF-8"))
    }
}

/// The header's fields, as sealed.
struct Header {
    flags: u16,
    key_id: [u8; KEY_ID_BYTES],
    fingerprint: [u8; 32],
    geometry: [u32; 4],
    kv: u8,
    meta: PageMeta,
    body_len: u64,
    nonce: [u8; NONCE_LEN],
}

fn read_header(f: &mut Fields<'_>) -> Result<Header, OpenError> {
    if f.take(4)? != MAGIC {
        return Err(OpenError::Format("not a sealed page (magic)"));
    }
    if f.u16()? != VERSION {
        return Err(OpenError::Format("unknown format version"));
    }
    let flags = f.u16()?;
    let key_id = f.array()?;
    let key = f.array()?;
    let fingerprint = f.array()?;
    let geometry = [f.u32()?, f.u32()?, f.u32()?, f.u32()?];
    let kv = f.u8()?;
    let namespace =
        NonZeroU64::new(f.u64()?).ok_or(OpenError::Format("namespace tag 0 is no namespace"))?;
    let kind = match f.u8()? {
        1 => ScopeKind::Tenant,
        2 => ScopeKind::Public,
        3 => ScopeKind::UnsafeGlobal,
        _ => return Err(OpenError::Format("unknown scope kind")),
    };
    let scope = f.label()?;
    let generation = f.u32()?;
    let filled = f.u32()?;
    let writer = Writer {
        node: f.u32()?,
        request: f.u64()?,
        tenant: f.label()?,
    };
    let body_len = f.u64()?;
    let nonce = f.array()?;
    Ok(Header {
        flags,
        key_id,
        fingerprint,
        geometry,
        kv,
        meta: PageMeta {
            key,
            namespace,
            kind,
            scope,
            generation,
            filled,
            writer,
        },
        body_len,
        nonce,
    })
}

/// Check `sealed` for `layout` and the reader's lookup `expect`, and return its page. See the
/// module's spec for the order of the checks.
pub fn open(
    keys: &SealKeys,
    layout: &Layout,
    sealed: &[u8],
    expect: Expect<'_>,
) -> Result<VerifiedPage, OpenError> {
    let Some(signed_len) = sealed.len().checked_sub(MAC_BYTES) else {
        return Err(OpenError::Truncated { got: sealed.len() });
    };
    let (signed, mac) = sealed.split_at(signed_len);
    hmac::verify(&keys.mac, signed, mac).map_err(|_| OpenError::Mac)?;
    let mut f = Fields { b: signed, at: 0 };
    let h = read_header(&mut f)?;
    let header_len = f.at;
    if h.key_id != keys.key_id {
        return Err(OpenError::KeyId {
            got: hex(&h.key_id),
            want: hex(&keys.key_id),
        });
    }
    if h.fingerprint != layout.fingerprint {
        return Err(OpenError::Fingerprint {
            got: hex(&h.fingerprint[..8]),
            want: hex(&layout.fingerprint[..8]),
        });
    }
    let g = &layout.geom;
    let ours = [
        g.page_size as u32,
        g.n_kv_heads as u32,
        g.head_dim as u32,
        layout.n_layers,
    ];
    if h.geometry != ours || h.kv != kv_code(g.kv) {
        let kv = if h.kv == 0 { "f16" } else { "q8_0" };
        return Err(OpenError::Geometry {
            got: format!(
                "{} slots × {} KV heads × {} dims, {kv}, {} layers",
                h.geometry[0], h.geometry[1], h.geometry[2], h.geometry[3]
            ),
            want: describe_geometry(g, layout.n_layers),
        });
    }
    if &h.meta.key != expect.key {
        return Err(OpenError::ChainKey);
    }
    if let Some(want) = expect.namespace
        && h.meta.namespace != want
    {
        return Err(OpenError::Namespace {
            got: h.meta.namespace.get(),
            want: want.get(),
        });
    }
    if h.meta.filled != g.page_size as u32 {
        return Err(OpenError::Slots {
            filled: h.meta.filled,
            page_size: g.page_size as u32,
        });
    }
    let body = &signed[header_len..];
    if body.len() as u64 != h.body_len {
        return Err(OpenError::Format("body length differs from the header's"));
    }
    let encrypted = h.flags & FLAG_ENCRYPTED != 0;
    let plain = match (encrypted, &keys.aead) {
        (true, Some(aead)) => {
            let mut buf = body.to_vec();
            let n = aead
                .open_in_place(
                    Nonce::assume_unique_for_key(h.nonce),
                    Aad::from(&signed[..header_len]),
                    &mut buf,
                )
                .map_err(|_| OpenError::Decrypt)?
                .len();
            buf.truncate(n);
            buf
        }
        (true, None) => return Err(OpenError::Decrypt),
        (false, Some(_)) => return Err(OpenError::Plaintext),
        (false, None) => body.to_vec(),
    };
    if plain.len() != layout.body_bytes() {
        return Err(OpenError::Format("body is not one page of this layout"));
    }
    Ok(VerifiedPage {
        meta: h.meta,
        body: plain,
    })
}

/// Lower-case hex.
pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> Layout {
        Layout {
            fingerprint: [7; 32],
            geom: PageGeometry {
                page_size: 4,
                n_kv_heads: 2,
                head_dim: 8,
                kv: KvType::F16,
            },
            n_layers: 3,
        }
    }

    fn meta() -> PageMeta {
        PageMeta {
            key: [9; 32],
            namespace: NonZeroU64::new(1 << 63 | 5).unwrap(),
            kind: ScopeKind::Tenant,
            scope: "tenant".into(),
            generation: 3,
            filled: 4,
            writer: Writer {
                node: 2,
                request: 41,
                tenant: "acme".into(),
            },
        }
    }

    fn body(l: &Layout) -> Vec<u8> {
        (0..l.body_bytes()).map(|i| (i * 31 % 251) as u8).collect()
    }

    fn expect(m: &PageMeta) -> Expect<'_> {
        Expect {
            key: &m.key,
            namespace: Some(m.namespace),
        }
    }

    #[test]
    fn a_sealed_page_opens_to_its_bytes_and_meta_plain_and_encrypted() {
        let (l, m) = (layout(), meta());
        for keys in [
            SealKeys::new(&[1; 32], None),
            SealKeys::new(&[1; 32], Some(&[2; 32])),
        ] {
            let s = seal(&keys, &l, &m, &body(&l)).unwrap();
            let v = open(&keys, &l, &s, expect(&m)).unwrap();
            assert_eq!(v.body(), &body(&l)[..]);
            assert_eq!(v.meta(), &m);
            // Ciphertext: the body's bytes do not appear in the sealed page.
            if keys.encrypts() {
                let b = body(&l);
                assert!(!s.windows(64).any(|w| w == &b[..64]));
            }
        }
    }

    #[test]
    fn every_change_cut_or_foreign_page_is_refused_by_name() {
        let (l, m) = (layout(), meta());
        let keys = SealKeys::new(&[1; 32], None);
        let s = seal(&keys, &l, &m, &body(&l)).unwrap();
        // Any flipped bit anywhere: the MAC.
        for at in [0, 20, s.len() / 2, s.len() - 1] {
            let mut f = s.clone();
            f[at] ^= 0x10;
            assert_eq!(open(&keys, &l, &f, expect(&m)).unwrap_err(), OpenError::Mac);
        }
        // Cut: the MAC (or too short for one).
        assert_eq!(
            open(&keys, &l, &s[..s.len() - 100], expect(&m)).unwrap_err(),
            OpenError::Mac
        );
        assert!(matches!(
            open(&keys, &l, &s[..10], expect(&m)).unwrap_err(),
            OpenError::Truncated { .. }
        ));
        // Another MAC key: the MAC.
        let other = SealKeys::new(&[3; 32], None);
        assert_eq!(
            open(&other, &l, &s, expect(&m)).unwrap_err(),
            OpenError::Mac
        );
        // Another model, another geometry: named.
        let l2 = Layout {
            fingerprint: [8; 32],
            ..l
        };
        assert!(matches!(
            open(&keys, &l2, &s, expect(&m)).unwrap_err(),
            OpenError::Fingerprint { .. }
        ));
        let mut g = l;
        g.geom.kv = KvType::Q8_0;
        assert!(matches!(
            open(&keys, &g, &s, expect(&m)).unwrap_err(),
            OpenError::Geometry { .. }
        ));
        // Looked up under another key, or for another namespace.
        let k2 = [1u8; 32];
        assert_eq!(
            open(
                &keys,
                &l,
                &s,
                Expect {
                    key: &k2,
                    namespace: Some(m.namespace)
                }
            )
            .unwrap_err(),
            OpenError::ChainKey
        );
        let ns = NonZeroU64::new(1 << 63 | 6).unwrap();
        assert!(matches!(
            open(
                &keys,
                &l,
                &s,
                Expect {
                    key: &m.key,
                    namespace: Some(ns)
                }
            )
            .unwrap_err(),
            OpenError::Namespace { .. }
        ));
        // A partial page.
        let part = PageMeta {
            filled: 3,
            ..m.clone()
        };
        let sp = seal(&keys, &l, &part, &body(&l)).unwrap();
        assert!(matches!(
            open(&keys, &l, &sp, expect(&m)).unwrap_err(),
            OpenError::Slots { .. }
        ));
        // Plaintext where ciphertext is required, and the reverse.
        let enc = SealKeys::new(&[1; 32], Some(&[2; 32]));
        assert_eq!(
            open(&enc, &l, &s, expect(&m)).unwrap_err(),
            OpenError::Plaintext
        );
        let se = seal(&enc, &l, &m, &body(&l)).unwrap();
        assert_eq!(
            open(&keys, &l, &se, expect(&m)).unwrap_err(),
            OpenError::Decrypt
        );
        // The unsafe token-only lookup takes another namespace's page (the reproduction).
        let any = Expect {
            key: &m.key,
            namespace: None,
        };
        assert!(open(&keys, &l, &s, any).is_ok());
    }
}
