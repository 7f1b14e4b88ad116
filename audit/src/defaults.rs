//! Where a serving node records when nothing says where: the default audit root and its signing
//! key, made on first use.
//!
//! The state directory is `$XDG_STATE_HOME/custody` when `XDG_STATE_HOME` is an absolute path,
//! else `$HOME/.local/state/custody` (the XDG base directory rule for state that outlives a
//! process but is not configuration). In it:
//! - `audit/` — the default audit root ([`default_root`]);
//! - `node.key` (mode 0600) and `node.key.pub` — the signing key of every log this user's nodes
//!   record there by default, generated on first use ([`load_or_create_key`]). It lies outside
//!   the root, as a key must.

use std::path::{Path, PathBuf};

use ed25519_dalek::SigningKey;

use crate::digest::{self, DigestError};

/// Why there is no default location.
#[derive(Debug, thiserror::Error)]
pub enum DefaultsError {
    #[error(
        "no default audit location: neither XDG_STATE_HOME (absolute) nor HOME is set (pass --audit-dir and --audit-key)"
    )]
    NoHome,
    #[error("creating {}: {source}", .path.display())]
    Create {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Key(#[from] DigestError),
}

/// The state directory from the environment's values of `XDG_STATE_HOME` and `HOME`.
pub fn state_dir_from(xdg_state_home: Option<&Path>, home: Option<&Path>) -> Option<PathBuf> {
    match xdg_state_home {
        Some(x) if x.is_absolute() => Some(x.join("custody")),
        _ => home
            .filter(|h| !h.as_os_str().is_empty())
            .map(|h| h.join(".local/state/custody")),
    }
}

/// This user's state directory (see the module's documentation).
pub fn state_dir() -> Result<PathBuf, DefaultsError> {
    let xdg = std::env::var_os("XDG_STATE_HOME").map(PathBuf::from);
    let home = std::env::var_os("HOME").map(PathBuf::from);
    state_dir_from(xdg.as_deref(), home.as_deref()).ok_or(DefaultsError::NoHome)
}

/// The default audit root: `<state dir>/audit`.
pub fn default_root() -> Result<PathBuf, DefaultsError> {
    Ok(state_dir()?.join("audit"))
}

/// The default signing key: `<state dir>/node.key`.
pub fn default_key_path() -> Result<PathBuf, DefaultsError> {
    Ok(state_dir()?.join("node.key"))
}

/// The signing key at `path`; when there is none, a new one written there (mode 0600, its
/// public key in `<path>.pub`, the directory made private if it is new). The flag says whether
/// it was made now.
pub fn load_or_create_key(path: &Path) -> Result<(SigningKey, bool), DefaultsError> {
    if path.exists() {
        return Ok((digest::read_signing_key(path)?, false));
    }
    if let Some(dir) = path.parent() {
        create_private_dir(dir)?;
    }
    let create = |source| DefaultsError::Create {
        path: path.to_owned(),
        source,
    };
    let key = digest::generate_key().map_err(create)?;
    // Two nodes started together on one host (a prefill and a decode node) may both find no
    // key: each writes its own under a private name and links it into place, which is atomic
    // and fails if the name exists — so exactly one key wins, whole, and the loser reads it.
    let mut tmp = path.as_os_str().to_owned();
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    tmp.push(format!(".new-{}-{n}", std::process::id()));
    let tmp = PathBuf::from(tmp);
    let written = digest::write_key(&key, &tmp).map_err(create)?;
    let linked = std::fs::hard_link(&tmp, path);
    for stale in [tmp.as_path(), written.as_path()] {
        if let Err(e) = std::fs::remove_file(stale) {
            tracing::warn!(path = %stale.display(), error = %e, "a temporary key file stays");
        }
    }
    match linked {
        Ok(()) => {
            digest::write_public_key(&key, path).map_err(create)?;
            Ok((key, true))
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            Ok((digest::read_signing_key(path)?, false))
        }
        Err(e) => Err(create(e)),
    }
}

/// `dir` and its parents; `dir` itself mode 0700 when made here.
fn create_private_dir(dir: &Path) -> Result<(), DefaultsError> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|source| DefaultsError::Create {
            path: dir.to_owned(),
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xdg_state_home_wins_when_absolute_else_home() {
        let (x, h) = (Path::new("/x/state"), Path::new("/home/u"));
        assert_eq!(
            state_dir_from(Some(x), Some(h)),
            Some(PathBuf::from("/x/state/custody"))
        );
        assert_eq!(
            state_dir_from(Some(Path::new("rel")), Some(h)),
            Some(PathBuf::from("/home/u/.local/state/custody"))
        );
        assert_eq!(
            state_dir_from(None, Some(h)),
            Some(PathBuf::from("/home/u/.local/state/custody"))
        );
        assert_eq!(state_dir_from(None, None), None);
    }

    /// A prefill and a decode node started together both find no key: one key is made, whole,
    /// and every racer gets that one.
    #[test]
    fn racing_first_uses_agree_on_one_key() {
        let dir = std::env::temp_dir().join(format!("custody-race-{}", std::process::id()));
        let path = dir.join("node.key");
        let keys: Vec<SigningKey> = std::thread::scope(|s| {
            let racers: Vec<_> = (0..8)
                .map(|_| s.spawn(|| load_or_create_key(&path).expect("key").0))
                .collect();
            racers
                .into_iter()
                .map(|r| r.join().expect("racer"))
                .collect()
        });
        assert!(keys.iter().all(|k| k.to_bytes() == keys[0].to_bytes()));
        let left: Vec<_> = std::fs::read_dir(&dir)
            .expect("dir")
            .map(|e| e.expect("entry").file_name())
            .collect();
        assert_eq!(left.len(), 2, "the key and its .pub only: {left:?}");
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }

    #[test]
    fn a_key_is_made_once_with_mode_0600_then_read_back() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("custody-defaults-{}", std::process::id()));
        let path = dir.join("state/node.key");
        let (made, new) = load_or_create_key(&path).expect("create");
        assert!(new);
        let mode = std::fs::metadata(&path).expect("key").permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "{mode:o}");
        assert!(dir.join("state/node.key.pub").exists());
        let (read, new) = load_or_create_key(&path).expect("read");
        assert!(!new);
        assert_eq!(made.to_bytes(), read.to_bytes());
        std::fs::remove_dir_all(&dir).expect("clean up");
    }
}
