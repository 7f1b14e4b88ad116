//! The offload worker: one thread that seals pages and does every tier's I/O the engine hands
//! it, so the engine's step loop never waits on a disk or a network for a write-back, a move
//! or a prefetch. Each job yields exactly one [`Done`]; the engine bounds the jobs in flight,
//! which bounds both channels.

use std::sync::Arc;
use std::sync::mpsc;

use super::seal::{self, Layout, PageMeta, SealKeys};
use super::store::PageStore;
use crate::prefix_cache::BlockKey;

#[derive(Debug)]
pub(super) enum Job {
    /// Seal an evicted page and store it in the first tier.
    Seal {
        meta: PageMeta,
        page: (u32, u32),
        body: Vec<u8>,
    },
    /// Copy a page one tier down, then delete it above.
    Move {
        key: BlockKey,
        from: usize,
        to: usize,
    },
    Delete {
        key: BlockKey,
        tier: usize,
    },
    /// Read a page into memory ahead of its restore.
    Fetch {
        key: BlockKey,
        tier: usize,
    },
}

#[derive(Debug)]
pub(super) enum Done {
    Stored {
        meta: PageMeta,
        page: (u32, u32),
        bytes: u64,
    },
    Moved {
        key: BlockKey,
        to: usize,
        bytes: u64,
    },
    Deleted,
    Fetched {
        key: BlockKey,
        tier: usize,
        sealed: Option<Vec<u8>>,
    },
    Failed {
        key: BlockKey,
        tier: usize,
        error: String,
    },
}

struct Worker {
    stores: Vec<Arc<dyn PageStore>>,
    keys: Arc<SealKeys>,
    layout: Layout,
}

impl Worker {
    fn run(&self, job: Job) -> Done {
        match job {
            Job::Seal { meta, page, body } => {
                let key = meta.key;
                let fail = |error: String| Done::Failed {
                    key,
                    tier: 0,
                    error,
                };
                let sealed = match seal::seal(&self.keys, &self.layout, &meta, &body) {
                    Ok(s) => s,
                    Err(e) => return fail(e.to_string()),
                };
                match self.stores[0].put(&key, &sealed) {
                    Ok(()) => Done::Stored {
                        meta,
                        page,
                        bytes: sealed.len() as u64,
                    },
                    Err(e) => fail(e.to_string()),
                }
            }
            Job::Move { key, from, to } => {
                let fail = |error: String| Done::Failed {
                    key,
                    tier: from,
                    error,
                };
                let sealed = match self.stores[from].get(&key) {
                    Ok(Some(s)) => s,
                    Ok(None) => return fail("the page vanished from its tier".into()),
                    Err(e) => return fail(e.to_string()),
                };
                if let Err(e) = self.stores[to].put(&key, &sealed) {
                    return fail(e.to_string());
                }
                if let Err(e) = self.stores[from].delete(&key) {
                    // Stored below, so the move stands; the copy above is unreachable (the
                    // index points below) and bounded by the tier's own listing at start-up.
                    tracing::warn!(error = %e, "offload: a moved page's old copy stays");
                }
                Done::Moved {
                    key,
                    to,
                    bytes: sealed.len() as u64,
                }
            }
            Job::Delete { key, tier } => match self.stores[tier].delete(&key) {
                Ok(()) => Done::Deleted,
                Err(e) => Done::Failed {
                    key,
                    tier,
                    error: e.to_string(),
                },
            },
            Job::Fetch { key, tier } => match self.stores[tier].get(&key) {
                Ok(sealed) => Done::Fetched { key, tier, sealed },
                Err(e) => Done::Failed {
                    key,
                    tier,
                    error: e.to_string(),
                },
            },
        }
    }
}

/// Start the worker thread; it ends when the job sender is dropped.
pub(super) fn spawn(
    stores: Vec<Arc<dyn PageStore>>,
    keys: Arc<SealKeys>,
    layout: Layout,
    queue_pages: usize,
) -> std::io::Result<(mpsc::SyncSender<Job>, mpsc::Receiver<Done>)> {
    let (jobs, rx) = mpsc::sync_channel::<Job>(queue_pages);
    // Unbounded in type only: the engine keeps at most `queue_pages` jobs in flight, and each
    // yields one completion.
    let (tx, done) = mpsc::channel::<Done>();
    let w = Worker {
        stores,
        keys,
        layout,
    };
    std::thread::Builder::new()
        .name("custody-offload".into())
        .spawn(move || {
            for job in rx {
                if tx.send(w.run(job)).is_err() {
                    break;
                }
            }
        })?;
    Ok((jobs, done))
}
