//! A worker's health as a state machine, with a circuit breaker.
//!
//! The router only sends work to a node it believes can take it. That belief is built from two
//! kinds of evidence the async router observes and feeds in with [`Health::observe`]: periodic
//! health probes ([`Observation::ProbeOk`], [`Observation::ProbeFailed`]) and the outcome of real
//! requests ([`Observation::RequestFailed`]). Time is the caller's `now_ms`; nothing here reads a
//! clock.
//!
//! # The specification
//!
//! States: `Pending` (new or restarted, not yet proven), `Ready` (routable), `NotReady`
//! (temporarily out: failing or draining), `Failed` (presumed dead). A *failure* is
//! `ProbeFailed` or `RequestFailed`; an *ok* is `ProbeOk { draining: false }`.
//!
//! 1. `Pending → Ready` after `ready_after_ok` consecutive oks (reason `"probe ok"`).
//! 2. A node that reports draining never becomes `Ready`: `Pending` or `Ready` with
//!    `ProbeOk { draining: true }` moves to `NotReady` at once (reason `"draining"`); a draining
//!    `NotReady` stays put. A draining probe is an answer, so it resets the failure count, but it
//!    is not an ok, so it also resets the ok count: readiness must be proven after draining ends.
//! 3. `Ready → NotReady` on the `not_ready_after_failures`-th consecutive failure (reason
//!    `"probe failed"` or `"request failed"`).
//! 4. `NotReady → Ready` after `ready_after_ok` consecutive oks (reason `"recovered"`).
//! 5. `Pending` or `NotReady → Failed` on the `failed_after_failures`-th consecutive failure
//!    since the last ok, counting the failures that moved it out of `Ready`. One observation
//!    moves at most one step, so with `failed_after_failures == not_ready_after_failures` a
//!    `Ready` node reaches `Failed` one failure after it reaches `NotReady`.
//! 6. `Failed → Pending` on the first probe that answers, draining or not (reason
//!    `"answers again"`): a restarted node is re-admitted through `Pending` and must prove itself
//!    `ready_after_ok` times again; the answering probe does not count towards that.
//! 7. Any ok resets the failure count; any failure resets the ok count. A state change returns a
//!    [`Transition`]; no change returns `None`.
//!
//! Circuit breaking: `RequestFailed` (in any state) opens the node's circuit until
//! `now_ms + circuit_open_ms`. While it is open the node is not routable even if probes say ok
//! meanwhile (a probe is cheap and can pass while real requests fail). After the cooldown the
//! circuit is *half-open*: still not routable, until the next ok closes it. So
//! [`Health::routable`] is `Ready` and circuit closed. A probe failure does not open the circuit:
//! probes already have their own thresholds.

/// Where a worker stands. See the module docs for the transitions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HealthState {
    /// New or restarted: not yet proven, not routable.
    Pending,
    /// Proven and routable (unless its circuit is open).
    Ready,
    /// Temporarily out: failing, or draining for a restart.
    NotReady,
    /// Presumed dead: consecutive failures reached `failed_after_failures`.
    Failed,
}

impl HealthState {
    /// The stable name the audit record and metrics use.
    pub fn name(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Ready => "ready",
            Self::NotReady => "not_ready",
            Self::Failed => "failed",
        }
    }
}

/// How much evidence each transition needs. Passed to every [`Health::observe`] so that a
/// configuration reload applies to all workers at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HealthThresholds {
    /// Consecutive oks that make a `Pending` or `NotReady` node `Ready`.
    pub ready_after_ok: u32,
    /// Consecutive failures that take a `Ready` node out of rotation.
    pub not_ready_after_failures: u32,
    /// Consecutive failures (since the last ok) that mark a node `Failed`.
    pub failed_after_failures: u32,
    /// How long a failed request keeps the node's circuit open.
    pub circuit_open_ms: u64,
}

impl Default for HealthThresholds {
    /// Two oks to trust, one failure to distrust, three to declare dead, one second of cooldown:
    /// quick to stop sending work, slower to resume it.
    fn default() -> Self {
        Self {
            ready_after_ok: 2,
            not_ready_after_failures: 1,
            failed_after_failures: 3,
            circuit_open_ms: 1000,
        }
    }
}

/// Why a [`HealthThresholds`] is unusable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HealthError {
    /// A threshold of 0 would make a transition happen without evidence.
    #[error("health threshold `{field}` must be at least 1")]
    ZeroThreshold {
        /// The offending field's name.
        field: &'static str,
    },
    /// A node must be taken out of rotation no later than it is declared dead.
    #[error("failed_after_failures ({failed}) must be >= not_ready_after_failures ({not_ready})")]
    FailedBeforeNotReady {
        /// `not_ready_after_failures`.
        not_ready: u32,
        /// `failed_after_failures`.
        failed: u32,
    },
}

impl HealthThresholds {
    /// Checks that every threshold is at least 1 and that `Failed` needs no fewer failures than
    /// `NotReady`.
    pub fn validate(&self) -> Result<(), HealthError> {
        let counts = [
            ("ready_after_ok", u64::from(self.ready_after_ok)),
            (
                "not_ready_after_failures",
                u64::from(self.not_ready_after_failures),
            ),
            (
                "failed_after_failures",
                u64::from(self.failed_after_failures),
            ),
            ("circuit_open_ms", self.circuit_open_ms),
        ];
        if let Some((field, _)) = counts.iter().find(|(_, value)| *value == 0) {
            return Err(HealthError::ZeroThreshold { field });
        }
        if self.failed_after_failures < self.not_ready_after_failures {
            return Err(HealthError::FailedBeforeNotReady {
                not_ready: self.not_ready_after_failures,
                failed: self.failed_after_failures,
            });
        }
        Ok(())
    }
}

/// One piece of evidence about a worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Observation {
    /// The health probe answered; `draining` when the node is shutting down gracefully.
    ProbeOk {
        /// The node asks not to be sent new work.
        draining: bool,
    },
    /// The health probe failed or timed out.
    ProbeFailed,
    /// A real request sent to the node failed (also opens its circuit).
    RequestFailed,
}

/// A state change, for the audit record and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transition {
    /// The state before the observation.
    pub from: HealthState,
    /// The state after it.
    pub to: HealthState,
    /// A short, stable reason: "probe ok", "probe failed", "request failed", "draining",
    /// "recovered" or "answers again".
    pub reason: &'static str,
}

/// The circuit breaker's position (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CircuitState {
    /// No recent request failure, or an ok closed it after the cooldown.
    Closed,
    /// A request failed less than `circuit_open_ms` ago.
    Open,
    /// The cooldown has passed; the next ok closes it.
    HalfOpen,
}

impl CircuitState {
    /// The stable name the audit record and metrics use.
    pub fn name(self) -> &'static str {
        match self {
            Self::Closed => "closed",
            Self::Open => "open",
            Self::HalfOpen => "half_open",
        }
    }
}

/// One worker's health: its state, the evidence streaks, and its circuit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Health {
    state: HealthState,
    consecutive_ok: u32,
    consecutive_failures: u32,
    /// `Some(t)`: the circuit is open until `t`, then half-open until the next ok.
    circuit_open_until_ms: Option<u64>,
}

impl Default for Health {
    fn default() -> Self {
        Self::new()
    }
}

/// A state to move to and why.
type Step = Option<(HealthState, &'static str)>;

impl Health {
    /// A newly registered worker: `Pending`, no evidence, circuit closed.
    pub fn new() -> Self {
        Self {
            state: HealthState::Pending,
            consecutive_ok: 0,
            consecutive_failures: 0,
            circuit_open_until_ms: None,
        }
    }

    /// The current state.
    pub fn state(&self) -> HealthState {
        self.state
    }

    /// Applies one observation made at `now_ms`; returns the state change, if any.
    pub fn observe(
        &mut self,
        obs: Observation,
        now_ms: u64,
        t: &HealthThresholds,
    ) -> Option<Transition> {
        debug_assert!(t.validate().is_ok(), "invalid thresholds {t:?}");
        let from = self.state;
        let step = match obs {
            Observation::ProbeOk { draining: false } => self.on_ok(now_ms, t),
            Observation::ProbeOk { draining: true } => self.on_draining(),
            Observation::ProbeFailed => self.on_failure("probe failed", t),
            Observation::RequestFailed => {
                self.open_circuit(now_ms, t);
                self.on_failure("request failed", t)
            }
        };
        if let Some((to, _)) = step {
            self.state = to;
        }
        self.debug_check_invariants(t);
        step.map(|(to, reason)| Transition { from, to, reason })
    }

    /// Whether the router may send this worker new work at `now_ms`: `Ready` and circuit closed.
    pub fn routable(&self, now_ms: u64) -> bool {
        self.state == HealthState::Ready && self.circuit(now_ms) == CircuitState::Closed
    }

    /// The circuit breaker's position at `now_ms`.
    pub fn circuit(&self, now_ms: u64) -> CircuitState {
        match self.circuit_open_until_ms {
            None => CircuitState::Closed,
            Some(until_ms) if now_ms < until_ms => CircuitState::Open,
            Some(_) => CircuitState::HalfOpen,
        }
    }

    fn on_ok(&mut self, now_ms: u64, t: &HealthThresholds) -> Step {
        self.consecutive_failures = 0;
        self.consecutive_ok = self.consecutive_ok.saturating_add(1);
        if self.circuit(now_ms) == CircuitState::HalfOpen {
            self.circuit_open_until_ms = None;
        }
        let proven = self.consecutive_ok >= t.ready_after_ok;
        match self.state {
            HealthState::Pending if proven => Some((HealthState::Ready, "probe ok")),
            HealthState::NotReady if proven => Some((HealthState::Ready, "recovered")),
            HealthState::Failed => self.restart(),
            HealthState::Pending | HealthState::NotReady | HealthState::Ready => None,
        }
    }

    fn on_draining(&mut self) -> Step {
        self.consecutive_failures = 0;
        self.consecutive_ok = 0;
        match self.state {
            HealthState::Pending | HealthState::Ready => Some((HealthState::NotReady, "draining")),
            HealthState::NotReady => None,
            HealthState::Failed => self.restart(),
        }
    }

    /// A dead node answered: it restarted, and its streak starts from nothing.
    fn restart(&mut self) -> Step {
        self.consecutive_ok = 0;
        Some((HealthState::Pending, "answers again"))
    }

    fn on_failure(&mut self, reason: &'static str, t: &HealthThresholds) -> Step {
        self.consecutive_ok = 0;
        self.consecutive_failures = self.consecutive_failures.saturating_add(1);
        let failures = self.consecutive_failures;
        match self.state {
            HealthState::Ready if failures >= t.not_ready_after_failures => {
                Some((HealthState::NotReady, reason))
            }
            HealthState::Pending | HealthState::NotReady if failures >= t.failed_after_failures => {
                Some((HealthState::Failed, reason))
            }
            HealthState::Pending
            | HealthState::NotReady
            | HealthState::Ready
            | HealthState::Failed => None,
        }
    }

    /// Opens (or extends) the circuit: a later failure restarts the cooldown.
    fn open_circuit(&mut self, now_ms: u64, t: &HealthThresholds) {
        let until_ms = now_ms.saturating_add(t.circuit_open_ms);
        let extended = self
            .circuit_open_until_ms
            .map_or(until_ms, |u| u.max(until_ms));
        self.circuit_open_until_ms = Some(extended);
    }

    fn debug_check_invariants(&self, t: &HealthThresholds) {
        debug_assert!(
            self.consecutive_ok == 0 || self.consecutive_failures == 0,
            "ok and failure streaks at once: {self:?}"
        );
        match self.state {
            HealthState::Ready => debug_assert!(
                self.consecutive_failures < t.not_ready_after_failures,
                "Ready past its failure threshold: {self:?}"
            ),
            HealthState::Pending => debug_assert!(
                self.consecutive_ok < t.ready_after_ok
                    && self.consecutive_failures < t.failed_after_failures,
                "Pending past a threshold: {self:?}"
            ),
            HealthState::NotReady => debug_assert!(
                self.consecutive_failures <= t.failed_after_failures,
                "NotReady past the failed threshold: {self:?}"
            ),
            HealthState::Failed => {
                debug_assert!(
                    self.consecutive_ok == 0,
                    "Failed with an ok streak: {self:?}"
                )
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use HealthState::{Failed, NotReady, Pending, Ready};

    const OK: Observation = Observation::ProbeOk { draining: false };
    const DRAIN: Observation = Observation::ProbeOk { draining: true };
    const PFAIL: Observation = Observation::ProbeFailed;
    const RFAIL: Observation = Observation::RequestFailed;

    /// A state with no streaks, as if just entered.
    fn health_in(state: HealthState) -> Health {
        Health {
            state,
            ..Health::new()
        }
    }

    /// One observation and when it was made.
    struct At {
        ms: u64,
        obs: Observation,
    }

    const fn at(ms: u64, obs: Observation) -> At {
        At { ms, obs }
    }

    /// Whether the node is routable at a given time, checked after all observations.
    struct RoutableAt {
        ms: u64,
        routable: bool,
    }

    struct Case {
        name: &'static str,
        thresholds: HealthThresholds,
        start: HealthState,
        observations: &'static [At],
        transitions: &'static [(HealthState, HealthState, &'static str)],
        end: HealthState,
        routable: &'static [RoutableAt],
    }

    const DEFAULT: HealthThresholds = HealthThresholds {
        ready_after_ok: 2,
        not_ready_after_failures: 1,
        failed_after_failures: 3,
        circuit_open_ms: 1000,
    };
    const PATIENT: HealthThresholds = HealthThresholds {
        ready_after_ok: 1,
        not_ready_after_failures: 2,
        failed_after_failures: 2,
        circuit_open_ms: 1000,
    };
    const TOLERANT: HealthThresholds = HealthThresholds {
        not_ready_after_failures: 5,
        failed_after_failures: 5,
        ..DEFAULT
    };

    const CASES: &[Case] = &[
        Case {
            name: "pending needs two oks",
            thresholds: DEFAULT,
            start: Pending,
            observations: &[at(0, OK)],
            transitions: &[],
            end: Pending,
            routable: &[RoutableAt {
                ms: 0,
                routable: false,
            }],
        },
        Case {
            name: "pending becomes ready after two oks",
            thresholds: DEFAULT,
            start: Pending,
            observations: &[at(0, OK), at(10, OK)],
            transitions: &[(Pending, Ready, "probe ok")],
            end: Ready,
            routable: &[RoutableAt {
                ms: 10,
                routable: true,
            }],
        },
        Case {
            name: "a failure resets the ok streak",
            thresholds: DEFAULT,
            start: Pending,
            observations: &[at(0, OK), at(1, PFAIL), at(2, OK)],
            transitions: &[],
            end: Pending,
            routable: &[],
        },
        Case {
            name: "ready_after_ok of one admits at once",
            thresholds: PATIENT,
            start: Pending,
            observations: &[at(0, OK)],
            transitions: &[(Pending, Ready, "probe ok")],
            end: Ready,
            routable: &[],
        },
        Case {
            name: "pending fails after three failures",
            thresholds: DEFAULT,
            start: Pending,
            observations: &[at(0, PFAIL), at(1, PFAIL), at(2, PFAIL)],
            transitions: &[(Pending, Failed, "probe failed")],
            end: Failed,
            routable: &[],
        },
        Case {
            name: "a draining pending node never becomes ready",
            thresholds: DEFAULT,
            start: Pending,
            observations: &[at(0, OK), at(1, DRAIN), at(2, DRAIN), at(3, OK)],
            transitions: &[(Pending, NotReady, "draining")],
            end: NotReady,
            routable: &[RoutableAt {
                ms: 3,
                routable: false,
            }],
        },
        Case {
            name: "draining ends, two oks recover",
            thresholds: DEFAULT,
            start: NotReady,
            observations: &[at(0, DRAIN), at(1, OK), at(2, OK)],
            transitions: &[(NotReady, Ready, "recovered")],
            end: Ready,
            routable: &[],
        },
        Case {
            name: "ready stays ready on oks",
            thresholds: DEFAULT,
            start: Ready,
            observations: &[at(0, OK), at(1, OK), at(2, OK)],
            transitions: &[],
            end: Ready,
            routable: &[RoutableAt {
                ms: 2,
                routable: true,
            }],
        },
        Case {
            name: "ready drains at once",
            thresholds: DEFAULT,
            start: Ready,
            observations: &[at(0, DRAIN)],
            transitions: &[(Ready, NotReady, "draining")],
            end: NotReady,
            routable: &[RoutableAt {
                ms: 0,
                routable: false,
            }],
        },
        Case {
            name: "ready out on the first probe failure",
            thresholds: DEFAULT,
            start: Ready,
            observations: &[at(0, PFAIL)],
            transitions: &[(Ready, NotReady, "probe failed")],
            end: NotReady,
            routable: &[],
        },
        Case {
            name: "ready out on the first request failure",
            thresholds: DEFAULT,
            start: Ready,
            observations: &[at(0, RFAIL)],
            transitions: &[(Ready, NotReady, "request failed")],
            end: NotReady,
            routable: &[],
        },
        Case {
            name: "failures count across ready to not ready",
            thresholds: DEFAULT,
            start: Ready,
            observations: &[at(0, PFAIL), at(1, RFAIL), at(2, PFAIL)],
            transitions: &[
                (Ready, NotReady, "probe failed"),
                (NotReady, Failed, "probe failed"),
            ],
            end: Failed,
            routable: &[],
        },
        Case {
            name: "an ok resets the failure streak",
            thresholds: DEFAULT,
            start: Ready,
            observations: &[
                at(0, PFAIL),
                at(1, PFAIL),
                at(2, OK),
                at(3, PFAIL),
                at(4, PFAIL),
            ],
            transitions: &[(Ready, NotReady, "probe failed")],
            end: NotReady,
            routable: &[],
        },
        Case {
            name: "a draining answer also resets the failure streak",
            thresholds: DEFAULT,
            start: NotReady,
            observations: &[at(0, PFAIL), at(1, PFAIL), at(2, DRAIN), at(3, PFAIL)],
            transitions: &[],
            end: NotReady,
            routable: &[],
        },
        Case {
            name: "ready tolerates failures below its threshold",
            thresholds: PATIENT,
            start: Ready,
            observations: &[at(0, PFAIL), at(1, OK), at(2, PFAIL)],
            transitions: &[],
            end: Ready,
            routable: &[RoutableAt {
                ms: 2,
                routable: true,
            }],
        },
        Case {
            name: "equal thresholds: failed one step after not ready",
            thresholds: PATIENT,
            start: Ready,
            observations: &[at(0, PFAIL), at(1, PFAIL), at(2, PFAIL)],
            transitions: &[
                (Ready, NotReady, "probe failed"),
                (NotReady, Failed, "probe failed"),
            ],
            end: Failed,
            routable: &[],
        },
        Case {
            name: "failed stays failed on failures",
            thresholds: DEFAULT,
            start: Failed,
            observations: &[at(0, PFAIL), at(1, RFAIL)],
            transitions: &[],
            end: Failed,
            routable: &[],
        },
        Case {
            name: "failed restarts through pending and proves itself again",
            thresholds: DEFAULT,
            start: Failed,
            observations: &[at(0, OK), at(1, OK), at(2, OK)],
            transitions: &[
                (Failed, Pending, "answers again"),
                (Pending, Ready, "probe ok"),
            ],
            end: Ready,
            routable: &[],
        },
        Case {
            name: "a restart's answering probe does not count",
            thresholds: DEFAULT,
            start: Failed,
            observations: &[at(0, OK), at(1, OK)],
            transitions: &[(Failed, Pending, "answers again")],
            end: Pending,
            routable: &[],
        },
        Case {
            name: "a draining restarted node goes pending then not ready",
            thresholds: DEFAULT,
            start: Failed,
            observations: &[at(0, DRAIN), at(1, DRAIN)],
            transitions: &[
                (Failed, Pending, "answers again"),
                (Pending, NotReady, "draining"),
            ],
            end: NotReady,
            routable: &[],
        },
        Case {
            name: "open circuit: ready but not routable until cooldown and an ok",
            thresholds: TOLERANT,
            start: Ready,
            observations: &[at(0, RFAIL), at(500, OK)],
            transitions: &[],
            end: Ready,
            routable: &[
                RoutableAt {
                    ms: 999,
                    routable: false,
                },
                // Half-open: the ok at 500 came during the cooldown and does not count.
                RoutableAt {
                    ms: 1000,
                    routable: false,
                },
                RoutableAt {
                    ms: 5000,
                    routable: false,
                },
            ],
        },
        Case {
            name: "half-open circuit closes on the first ok after the cooldown",
            thresholds: TOLERANT,
            start: Ready,
            observations: &[at(0, RFAIL), at(500, OK), at(1000, OK)],
            transitions: &[],
            end: Ready,
            routable: &[RoutableAt {
                ms: 1000,
                routable: true,
            }],
        },
        Case {
            name: "a second request failure extends the cooldown",
            thresholds: TOLERANT,
            start: Ready,
            observations: &[at(0, RFAIL), at(800, RFAIL), at(1200, OK)],
            transitions: &[],
            end: Ready,
            routable: &[RoutableAt {
                ms: 1200,
                routable: false,
            }],
        },
        Case {
            name: "a probe failure does not open the circuit",
            thresholds: TOLERANT,
            start: Ready,
            observations: &[at(0, PFAIL)],
            transitions: &[],
            end: Ready,
            routable: &[RoutableAt {
                ms: 0,
                routable: true,
            }],
        },
        Case {
            name: "recovered during the cooldown stays unroutable until it ends",
            thresholds: DEFAULT,
            start: Ready,
            observations: &[at(0, RFAIL), at(100, OK), at(200, OK)],
            transitions: &[
                (Ready, NotReady, "request failed"),
                (NotReady, Ready, "recovered"),
            ],
            end: Ready,
            routable: &[
                RoutableAt {
                    ms: 200,
                    routable: false,
                },
                RoutableAt {
                    ms: 1100,
                    routable: false,
                },
            ],
        },
    ];

    #[test]
    fn the_health_table() {
        for case in CASES {
            let mut health = health_in(case.start);
            let seen: Vec<_> = case
                .observations
                .iter()
                .filter_map(|o| health.observe(o.obs, o.ms, &case.thresholds))
                .map(|t| (t.from, t.to, t.reason))
                .collect();
            assert_eq!(seen, case.transitions, "{}: transitions", case.name);
            assert_eq!(health.state(), case.end, "{}: end state", case.name);
            for check in case.routable {
                assert_eq!(
                    health.routable(check.ms),
                    check.routable,
                    "{}: routable at {} ms",
                    case.name,
                    check.ms
                );
            }
        }
    }

    #[test]
    fn transitions_name_their_states_consistently() {
        // Every transition's `from` is the state before it: replay a long mixed sequence.
        let sequence = [
            OK, PFAIL, RFAIL, DRAIN, OK, OK, PFAIL, PFAIL, PFAIL, PFAIL, OK, DRAIN,
        ];
        let mut health = Health::new();
        for (ms, obs) in (0u64..).zip(sequence.iter().cycle().take(200)) {
            let before = health.state();
            if let Some(t) = health.observe(*obs, ms * 100, &DEFAULT) {
                assert_eq!(t.from, before);
                assert_eq!(t.to, health.state());
                assert_ne!(t.from, t.to);
            } else {
                assert_eq!(health.state(), before);
            }
        }
    }

    #[test]
    fn circuit_positions() {
        let mut health = health_in(Ready);
        assert_eq!(health.circuit(0), CircuitState::Closed);
        health.observe(RFAIL, 100, &TOLERANT);
        assert_eq!(health.circuit(1099), CircuitState::Open);
        assert_eq!(health.circuit(1100), CircuitState::HalfOpen);
        health.observe(OK, 1100, &TOLERANT);
        assert_eq!(health.circuit(1100), CircuitState::Closed);
        assert_eq!(CircuitState::HalfOpen.name(), "half_open");
    }

    #[test]
    fn state_names() {
        let names: Vec<_> = [Pending, Ready, NotReady, Failed]
            .map(HealthState::name)
            .into();
        assert_eq!(names, ["pending", "ready", "not_ready", "failed"]);
    }

    #[test]
    fn thresholds_validate() {
        let cases = [
            (DEFAULT, Ok(())),
            (PATIENT, Ok(())),
            (
                HealthThresholds {
                    ready_after_ok: 0,
                    ..DEFAULT
                },
                Err(HealthError::ZeroThreshold {
                    field: "ready_after_ok",
                }),
            ),
            (
                HealthThresholds {
                    not_ready_after_failures: 0,
                    ..DEFAULT
                },
                Err(HealthError::ZeroThreshold {
                    field: "not_ready_after_failures",
                }),
            ),
            (
                HealthThresholds {
                    circuit_open_ms: 0,
                    ..DEFAULT
                },
                Err(HealthError::ZeroThreshold {
                    field: "circuit_open_ms",
                }),
            ),
            (
                HealthThresholds {
                    not_ready_after_failures: 4,
                    ..DEFAULT
                },
                Err(HealthError::FailedBeforeNotReady {
                    not_ready: 4,
                    failed: 3,
                }),
            ),
        ];
        for (thresholds, expected) in cases {
            assert_eq!(thresholds.validate(), expected, "{thresholds:?}");
        }
        assert_eq!(HealthThresholds::default(), DEFAULT);
    }
}
