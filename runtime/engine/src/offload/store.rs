//! The offload tiers' storage: where sealed pages are kept, by chain key. A store knows bytes and
//! keys only; what a page is, and whether it may be read, is [`super::seal`]'s to check.
//!
//! [`HostArena`] (memory) and [`DiskStore`] (a directory of page files) live here; an object
//! store (`s3://…`) is a [`PageStore`] implemented outside the engine (the engine knows no
//! network and no async runtime) and handed to it at start-up.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::prefix_cache::BlockKey;

/// Which tier a store is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tier {
    /// Host memory: the CPU backend's second, larger arena (the CUDA backend's host memory).
    Host,
    /// A directory of page files on local disk.
    Disk,
    /// An object store shared by a fleet's nodes.
    Object,
}

impl Tier {
    pub fn name(self) -> &'static str {
        match self {
            Tier::Host => "host",
            Tier::Disk => "disk",
            Tier::Object => "object",
        }
    }
}

/// A store failed (I/O, the network): the page is a miss, never a read of anything.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("{tier} tier, {path}: {source}")]
    Io {
        tier: &'static str,
        path: String,
        source: std::io::Error,
    },
    #[error("{tier} tier: {reason}")]
    Remote { tier: &'static str, reason: String },
}

/// One stored page as a listing shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stored {
    pub key: BlockKey,
    pub bytes: u64,
}

/// Where a tier keeps sealed pages. Calls block; the engine makes them from its offload worker
/// (write-back, moves, prefetch) and, for a restore the prefetch did not reach, from its own
/// thread.
pub trait PageStore: Send + Sync + std::fmt::Debug {
    fn tier(&self) -> Tier;
    /// Whether other nodes write this store too (an object store a fleet shares): a key the
    /// node's index does not know may still be there.
    fn shared(&self) -> bool {
        false
    }
    /// Store `sealed` under `key` (replacing any page there), durably before returning.
    fn put(&self, key: &BlockKey, sealed: &[u8]) -> Result<(), StoreError>;
    /// The page under `key`, if any.
    fn get(&self, key: &BlockKey) -> Result<Option<Vec<u8>>, StoreError>;
    /// Remove the page under `key` (none there: not an error).
    fn delete(&self, key: &BlockKey) -> Result<(), StoreError>;
    /// Every page the store holds (a restarted node's index starts from its disk's).
    fn list(&self) -> Result<Vec<Stored>, StoreError>;
}

/// Host memory: sealed pages in a map. Its bound is the engine's index's (`host_mib`).
#[derive(Debug, Default)]
pub struct HostArena {
    pages: Mutex<HashMap<BlockKey, Vec<u8>>>,
}

impl HostArena {
    pub fn new() -> Self {
        Self::default()
    }

    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<BlockKey, Vec<u8>>> {
        // A panic while holding the lock left a whole map (every operation is one map call).
        self.pages
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl PageStore for HostArena {
    fn tier(&self) -> Tier {
        Tier::Host
    }
    fn put(&self, key: &BlockKey, sealed: &[u8]) -> Result<(), StoreError> {
        self.map().insert(*key, sealed.to_vec());
        Ok(())
    }
    fn get(&self, key: &BlockKey) -> Result<Option<Vec<u8>>, StoreError> {
        Ok(self.map().get(key).cloned())
    }
    fn delete(&self, key: &BlockKey) -> Result<(), StoreError> {
        self.map().remove(key);
        Ok(())
    }
    fn list(&self) -> Result<Vec<Stored>, StoreError> {
        Ok(self
            .map()
            .iter()
            .map(|(k, v)| Stored {
                key: *k,
                bytes: v.len() as u64,
            })
            .collect())
    }
}

/// Suffix of a page file.
const PAGE_SUFFIX: &str = ".kvpage";

/// Local disk: one file per page, `<hex chain key>.kvpage`, written to a temporary name, fsync'd
/// and renamed into place: a crash leaves a page whole or absent (a torn file is only ever a
/// `.tmp`, removed at start-up). The directory is not fsync'd per page: a rename a crash loses
/// is a page the tier no longer has — a miss, as for any cache — and a page's contents are
/// checked by its MAC whatever the disk did.
#[derive(Debug)]
pub struct DiskStore {
    dir: PathBuf,
}

impl DiskStore {
    /// The store in `dir` (created if missing); leftover temporary files are removed.
    pub fn open(dir: &Path) -> Result<Self, StoreError> {
        let io = |source| StoreError::Io {
            tier: "disk",
            path: dir.display().to_string(),
            source,
        };
        std::fs::create_dir_all(dir).map_err(io)?;
        for e in std::fs::read_dir(dir).map_err(io)? {
            let p = e.map_err(io)?.path();
            if p.extension().is_some_and(|x| x == "tmp") {
                std::fs::remove_file(&p).map_err(io)?;
            }
        }
        Ok(Self {
            dir: dir.to_path_buf(),
        })
    }

    fn path(&self, key: &BlockKey) -> PathBuf {
        self.dir
            .join(format!("{}{PAGE_SUFFIX}", super::seal::hex(key)))
    }

    fn io(&self, path: &Path, source: std::io::Error) -> StoreError {
        StoreError::Io {
            tier: "disk",
            path: path.display().to_string(),
            source,
        }
    }
}

/// The key a page file or object named `<64 hex digits>.kvpage` holds (any other name: none).
pub fn key_from_file_name(name: &str) -> Option<BlockKey> {
    let h = name.strip_suffix(PAGE_SUFFIX)?;
    if h.len() != 64 {
        return None;
    }
    let mut k = [0u8; 32];
    for (i, out) in k.iter_mut().enumerate() {
        *out = u8::from_str_radix(h.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(k)
}

impl PageStore for DiskStore {
    fn tier(&self) -> Tier {
        Tier::Disk
    }
    fn put(&self, key: &BlockKey, sealed: &[u8]) -> Result<(), StoreError> {
        let path = self.path(key);
        let tmp = path.with_extension("tmp");
        let mut f = std::fs::File::create(&tmp).map_err(|e| self.io(&tmp, e))?;
        f.write_all(sealed).map_err(|e| self.io(&tmp, e))?;
        f.sync_all().map_err(|e| self.io(&tmp, e))?;
        std::fs::rename(&tmp, &path).map_err(|e| self.io(&path, e))
    }
    fn get(&self, key: &BlockKey) -> Result<Option<Vec<u8>>, StoreError> {
        let path = self.path(key);
        match std::fs::read(&path) {
            Ok(b) => Ok(Some(b)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(self.io(&path, e)),
        }
    }
    fn delete(&self, key: &BlockKey) -> Result<(), StoreError> {
        let path = self.path(key);
        match std::fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(self.io(&path, e)),
        }
    }
    fn list(&self) -> Result<Vec<Stored>, StoreError> {
        let mut out = Vec::new();
        for e in std::fs::read_dir(&self.dir).map_err(|e| self.io(&self.dir, e))? {
            let e = e.map_err(|e| self.io(&self.dir, e))?;
            let Some(key) = e.file_name().to_str().and_then(key_from_file_name) else {
                continue;
            };
            let bytes = e.metadata().map_err(|x| self.io(&e.path(), x))?.len();
            out.push(Stored { key, bytes });
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip(s: &dyn PageStore) {
        let (a, b) = ([1u8; 32], [2u8; 32]);
        assert_eq!(s.get(&a).unwrap(), None);
        s.put(&a, b"one").unwrap();
        s.put(&b, b"two!").unwrap();
        assert_eq!(s.get(&a).unwrap().as_deref(), Some(&b"one"[..]));
        let mut l = s.list().unwrap();
        l.sort_by_key(|x| x.key);
        assert_eq!(
            l,
            vec![Stored { key: a, bytes: 3 }, Stored { key: b, bytes: 4 }]
        );
        s.delete(&a).unwrap();
        s.delete(&a).unwrap();
        assert_eq!(s.get(&a).unwrap(), None);
        assert_eq!(s.list().unwrap().len(), 1);
    }

    #[test]
    fn host_and_disk_stores_keep_pages_by_key() {
        roundtrip(&HostArena::new());
        let dir = std::env::temp_dir().join(format!("custody-disk-store-{}", std::process::id()));
        if dir.exists() {
            std::fs::remove_dir_all(&dir).unwrap();
        }
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("x.tmp"), b"torn").unwrap();
        std::fs::write(dir.join("notes.txt"), b"not a page").unwrap();
        let d = DiskStore::open(&dir).unwrap();
        assert!(!dir.join("x.tmp").exists(), "a torn write is removed");
        roundtrip(&d);
        // A restarted store lists what is on disk.
        let again = DiskStore::open(&dir).unwrap();
        assert_eq!(again.list().unwrap().len(), 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
