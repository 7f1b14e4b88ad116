//! Progress of long work on stderr (stdout is the command's output): a bar or a spinner when
//! stderr is a terminal (`indicatif`), plain lines otherwise — at most one every
//! [`PLAIN_LINE_INTERVAL`], and one at the end — so a log collector sees progress without
//! escape codes.

use std::io::IsTerminal;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};

/// How often a plain progress line is printed when stderr is not a terminal.
const PLAIN_LINE_INTERVAL: Duration = Duration::from_secs(5);
/// How often a spinner redraws on its own.
#[cfg(feature = "forensics")]
const SPINNER_TICK: Duration = Duration::from_millis(120);

/// One piece of long work being reported.
#[derive(Debug)]
pub(crate) struct Progress {
    what: String,
    unit: &'static str,
    /// `None`: a spinner (the amount of work is not known).
    total: Option<u64>,
    bar: Option<ProgressBar>,
    t0: Instant,
    last_line: Mutex<Instant>,
}

impl Progress {
    /// Work of `total` `unit`s (e.g. "events", "files", "reps").
    pub(crate) fn counted(what: &str, total: u64, unit: &'static str) -> Self {
        let bar = std::io::stderr().is_terminal().then(|| {
            let b = ProgressBar::new(total);
            b.set_style(
                ProgressStyle::with_template(
                    "{msg} [{bar:30}] {pos}/{len} {prefix} ({per_sec}, {eta} left)",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
            );
            b.set_message(what.to_owned());
            b.set_prefix(unit);
            b
        });
        Self::new(what, unit, Some(total), bar)
    }

    /// Work whose amount is not known (a query, a verification's listing).
    #[cfg(feature = "forensics")]
    pub(crate) fn spinner(what: &str) -> Self {
        let bar = std::io::stderr().is_terminal().then(|| {
            let b = ProgressBar::new_spinner();
            b.set_message(what.to_owned());
            b.enable_steady_tick(SPINNER_TICK);
            b
        });
        if bar.is_none() {
            eprintln!("{what} ...");
        }
        Self::new(what, "", None, bar)
    }

    fn new(what: &str, unit: &'static str, total: Option<u64>, bar: Option<ProgressBar>) -> Self {
        let now = Instant::now();
        Self {
            what: what.to_owned(),
            unit,
            total,
            bar,
            t0: now,
            last_line: Mutex::new(now),
        }
    }

    /// `done` units so far (from any thread).
    pub(crate) fn set(&self, done: u64) {
        if let Some(b) = &self.bar {
            b.set_position(done);
            return;
        }
        let mut last = self.last_line.lock().unwrap_or_else(|e| e.into_inner());
        if last.elapsed() >= PLAIN_LINE_INTERVAL {
            *last = Instant::now();
            eprintln!("{}", self.line(done));
        }
    }

    /// Grow the amount of work (a listing found more).
    pub(crate) fn set_total(&mut self, total: u64) {
        self.total = Some(total);
        if let Some(b) = &self.bar {
            b.set_length(total);
        }
    }

    fn line(&self, done: u64) -> String {
        let secs = self.t0.elapsed().as_secs_f64();
        match self.total {
            Some(t) if t > 0 => {
                let t = t.max(done); // work that ends in whole units may pass its estimate
                format!(
                    "{}: {done} / {t} {} ({:.0} %), {:.1} s",
                    self.what,
                    self.unit,
                    100.0 * done as f64 / t as f64,
                    secs
                )
            }
            _ => format!("{}: {done} {}, {:.1} s", self.what, self.unit, secs),
        }
    }

    /// The work is over: the bar is cleared (the command's own output follows), a plain
    /// summary line is printed when stderr is not a terminal.
    pub(crate) fn finish(self, done: u64) {
        match &self.bar {
            Some(b) => b.finish_and_clear(),
            None if self.total.is_some() => eprintln!("{}", self.line(done)),
            None => eprintln!(
                "{}: done in {:.1} s",
                self.what,
                self.t0.elapsed().as_secs_f64()
            ),
        }
    }
}
