//! The engine-thread actor: the one thread that owns an engine — and through it the page pool,
//! and on a disaggregated node the transport's half — written once, used by the HTTP server and
//! by both nodes.
//!
//! # Rules (the same for every user)
//! - Everyone else talks to the thread through one **bounded** command queue
//!   ([`ActorLimits::queue_capacity_cmds`]): a full queue is the sender's error at once
//!   ([`MailboxError::Full`]), never a wait on the engine thread's side.
//! - Between two units of work ([`Actor::work`]: one engine step, one transport poll) the thread
//!   takes at most [`ActorLimits::cmds_per_step`] commands, so a flood of submissions cannot
//!   starve running requests.
//! - When there is nothing to do ([`Work::Idle`]) the thread **blocks** on the queue (no timer,
//!   no polling); when it must look at something that cannot wake it (a socket a transport
//!   reads without a reactor, a lease deadline) it says how long it may sleep
//!   ([`Work::PollAfter`]) and is woken early by any command.
//! - When every [`Mailbox`] is gone, or a command asked to close ([`Control::Close`]), the
//!   thread finishes its work if [`Actor::FINISH_WORK_ON_CLOSE`], then returns the actor.
//!
//! What an actor emits to its clients (tokens) goes over per-request channels bounded by the
//! most events the request can produce; those are the actor's own (see each user).

use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TryRecvError, TrySendError};
use std::thread::JoinHandle;
use std::time::Duration;

/// What a unit of work found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Work {
    /// Progress was made: run again right after the next commands.
    Busy,
    /// Nothing to do until a command arrives: block on the queue.
    Idle,
    /// Nothing now, but something outside the queue must be looked at again within this long.
    PollAfter(Duration),
}

/// What a command asks of the thread.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Control {
    Continue,
    /// Stop once the work is done (or at once, see [`Actor::FINISH_WORK_ON_CLOSE`]).
    Close,
}

/// A state machine driven by one thread.
pub trait Actor: Send + 'static {
    type Cmd: Send + 'static;

    /// After the queue closed: keep working until [`Work::Idle`] (the server drains its
    /// requests), or return at once (a node whose peers are gone).
    const FINISH_WORK_ON_CLOSE: bool;

    /// Apply one command.
    fn handle(&mut self, cmd: Self::Cmd) -> Control;

    /// One bounded unit of work.
    fn work(&mut self) -> Work;
}

/// The bounds of one actor. Both are counts of commands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ActorLimits {
    /// Commands that may wait in the queue.
    pub queue_capacity_cmds: usize,
    /// Most commands taken between two units of work.
    pub cmds_per_step: usize,
}

impl ActorLimits {
    /// The nodes' and the server's default: 64 commands between steps.
    pub const fn with_queue(queue_capacity_cmds: usize) -> Self {
        Self {
            queue_capacity_cmds,
            cmds_per_step: 64,
        }
    }
}

/// Why a command was not queued; it is handed back.
#[derive(Debug, thiserror::Error)]
pub enum MailboxError<C> {
    #[error("the engine's command queue is full ({capacity} commands)")]
    Full { cmd: C, capacity: usize },
    #[error("the engine thread has stopped")]
    Stopped(C),
}

/// The sending side of an actor's queue (cloneable).
#[derive(Debug)]
pub struct Mailbox<C> {
    tx: SyncSender<C>,
    capacity: usize,
}

impl<C> Clone for Mailbox<C> {
    fn clone(&self) -> Self {
        Self {
            tx: self.tx.clone(),
            capacity: self.capacity,
        }
    }
}

impl<C> Mailbox<C> {
    /// Queue `cmd` now or say why not; never waits.
    pub fn try_send(&self, cmd: C) -> Result<(), MailboxError<C>> {
        self.tx.try_send(cmd).map_err(|e| match e {
            TrySendError::Full(cmd) => MailboxError::Full {
                cmd,
                capacity: self.capacity,
            },
            TrySendError::Disconnected(cmd) => MailboxError::Stopped(cmd),
        })
    }

    /// Queue `cmd`, waiting for space (blocks the calling thread: not for async handlers; for
    /// rare control commands use `spawn_blocking` there).
    pub fn send_blocking(&self, cmd: C) -> Result<(), MailboxError<C>> {
        self.tx.send(cmd).map_err(|e| MailboxError::Stopped(e.0))
    }

    /// The queue's bound, in commands.
    pub fn capacity(&self) -> usize {
        self.capacity
    }
}

/// Start `actor` on a thread named `name`. The join handle returns the actor when it stopped.
pub fn spawn<A: Actor>(
    name: &str,
    actor: A,
    limits: ActorLimits,
) -> std::io::Result<(Mailbox<A::Cmd>, JoinHandle<A>)> {
    assert!(limits.queue_capacity_cmds > 0 && limits.cmds_per_step > 0);
    let (tx, rx) = std::sync::mpsc::sync_channel(limits.queue_capacity_cmds);
    let join = std::thread::Builder::new()
        .name(name.into())
        .spawn(move || run(actor, &rx, limits))?;
    Ok((
        Mailbox {
            tx,
            capacity: limits.queue_capacity_cmds,
        },
        join,
    ))
}

/// The loop. Each iteration takes at most `cmds_per_step` commands, then one unit of work,
/// then waits as the work said. It ends only when the queue closed (and, if asked, the work is
/// done).
fn run<A: Actor>(mut actor: A, rx: &Receiver<A::Cmd>, limits: ActorLimits) -> A {
    let mut open = true;
    // Commands handled since the last unit of work (a blocking receive counts too).
    let mut taken_cmds = 0;
    loop {
        while taken_cmds < limits.cmds_per_step {
            match rx.try_recv() {
                Ok(cmd) => {
                    taken_cmds += 1;
                    open &= actor.handle(cmd) == Control::Continue;
                }
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    open = false;
                    break;
                }
            }
        }
        if !open && !A::FINISH_WORK_ON_CLOSE {
            return actor;
        }
        let work = actor.work();
        taken_cmds = 0;
        let waited = match work {
            Work::Busy => continue,
            Work::Idle if !open => return actor,
            Work::Idle => rx.recv().ok(),
            Work::PollAfter(d) if !open => {
                std::thread::sleep(d);
                continue;
            }
            Work::PollAfter(d) => match rx.recv_timeout(d) {
                Ok(cmd) => Some(cmd),
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => None,
            },
        };
        match waited {
            Some(cmd) => {
                taken_cmds = 1;
                open &= actor.handle(cmd) == Control::Continue;
            }
            None => open = false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Counts work units and the commands seen between them.
    struct Counter {
        work_units: Arc<AtomicUsize>,
        pending: usize,
        max_between: usize,
        since_work: usize,
    }

    impl Actor for Counter {
        type Cmd = usize;
        const FINISH_WORK_ON_CLOSE: bool = true;
        fn handle(&mut self, n: usize) -> Control {
            self.pending += n;
            self.since_work += 1;
            Control::Continue
        }
        fn work(&mut self) -> Work {
            self.max_between = self.max_between.max(self.since_work);
            self.since_work = 0;
            self.work_units.fetch_add(1, Ordering::Relaxed);
            if self.pending > 0 {
                self.pending -= 1;
                Work::Busy
            } else {
                Work::Idle
            }
        }
    }

    #[test]
    fn bounded_queue_bounded_drain_blocks_when_idle_and_finishes_work_on_close() {
        let units = Arc::new(AtomicUsize::new(0));
        let actor = Counter {
            work_units: units.clone(),
            pending: 0,
            max_between: 0,
            since_work: 0,
        };
        let limits = ActorLimits {
            queue_capacity_cmds: 200,
            cmds_per_step: 8,
        };
        let (mb, join) = spawn("test-actor", actor, limits).expect("spawn");
        // Idle: it blocks; a few milliseconds later it has done (almost) no work.
        std::thread::sleep(Duration::from_millis(30));
        let idle_units = units.load(Ordering::Relaxed);
        assert!(
            idle_units <= 2,
            "an idle actor polled: {idle_units} work units"
        );
        for _ in 0..150 {
            mb.try_send(1).expect("room in the queue");
        }
        drop(mb);
        let done = join.join().expect("actor thread");
        assert_eq!(
            done.pending, 0,
            "the work was finished after the queue closed"
        );
        assert!(
            done.max_between <= 8,
            "{} commands between two steps",
            done.max_between
        );
    }

    #[test]
    fn a_full_queue_is_refused_at_once_and_the_command_handed_back() {
        struct Stuck;
        impl Actor for Stuck {
            type Cmd = u32;
            const FINISH_WORK_ON_CLOSE: bool = false;
            fn handle(&mut self, _: u32) -> Control {
                std::thread::sleep(Duration::from_millis(200));
                Control::Continue
            }
            fn work(&mut self) -> Work {
                Work::Idle
            }
        }
        let (mb, _join) = spawn("stuck", Stuck, ActorLimits::with_queue(1)).expect("spawn");
        let mut refused = None;
        for i in 0..10 {
            if let Err(MailboxError::Full { cmd, capacity }) = mb.try_send(i) {
                refused = Some((cmd, capacity));
                break;
            }
        }
        let (cmd, capacity) = refused.expect("a 1-command queue fills");
        assert_eq!(capacity, 1);
        assert!(cmd < 10);
    }
}
