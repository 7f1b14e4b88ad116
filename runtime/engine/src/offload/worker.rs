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
        /// The tier written (a write-back's first tier, a move's lower tier) or read.
        tier: usize,
        error: String,
        kind: Failure,
    },
}

/// Which part of a job failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Failure {
    /// The page was not stored in `tier` (sealing or the put failed); a move's page stays above.
    Write,
    /// A move's page was gone from its tier: it is nowhere now.
    Vanished,
    Delete,
    Fetch,
}

struct Worker {
    stores: Vec<Arc<dyn PageStore>>,
    keys: Arc<SealKeys>,
    layout: Layout,
}

impl Worker {
    fn run(&self, job: Job) -> Done {
        match job {
            Job::Seal { meta, body } => {
                let key = meta.key;
                let fail = |error: String| Done::Failed {
                    key,
                    tier: 0,
                    error,
                    kind: Failure::Write,
                };
                let sealed = match seal::seal(&self.keys, &self.layout, &meta, &body) {
                    Ok(s) => s,
                    Err(e) => return fail(e.to_string()),
                };
                match self.stores[0].put(&key, &sealed) {
                    Ok(()) => Done::Stored {
                        meta,
                        bytes: sealed.len() as u64,
                    },
                    Err(e) => fail(e.to_string()),
                }
            }
            Job::Move { key, from, to } => {
                let fail = |error: String, kind| Done::Failed {
                    key,
                    tier: to,
                    error,
                    kind,
                };
                let sealed = match self.stores[from].get(&key) {
                    Ok(Some(s)) => s,
                    Ok(None) => {
                        return fail("the page vanished from its tier".into(), Failure::Vanished);
                    }
                    Err(e) => return fail(e.to_string(), Failure::Write),
                };
                if let Err(e) = self.stores[to].put(&key, &sealed) {
                    return fail(e.to_string(), Failure::Write);
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
                    kind: Failure::Delete,
                },
            },
            Job::Fetch { key, tier } => match self.stores[tier].get(&key) {
                Ok(sealed) => Done::Fetched { key, tier, sealed },
                Err(e) => Done::Failed {
                    key,
                    tier,
                    error: e.to_string(),
                    kind: Failure::Fetch,
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
            // Idle class, as the grammar mask threads (`grammar::ahead`): the forward pass's
            // workers partition each section statically over every core, so a worker preempted
            // by sealing would stall the whole section; the write-back fills the gaps instead,
            // and when its queue is full the engine thread waits for it (the cores then idle).
            crate::grammar::ahead::idle_class();
            for job in rx {
                if tx.send(w.run(job)).is_err() {
                    break;
                }
            }
        })?;
    Ok((jobs, done))
}
