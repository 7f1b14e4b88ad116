//! Model check (`stateright`, breadth-first, exhaustive) of the disaggregated prefill/decode
//! KV-transfer, abort and release protocol — over the engine's own state machine.
//!
//! Every request state change in this model goes through `ReqMachine::on` — the value both
//! nodes hold per request, whose state is private to the protocol module — "may decode read
//! now?" is `ReqMachine::may_read`, and every page release is gated by `release_allowed` (the
//! rule `DecodeEngine::release_quarantined` applies), all imported from
//! `custody_runtime::disagg::protocol` (`runtime/engine/src/protocol.rs`), together with
//! `ReqEvent`, `KeyState` and `PageState`. Nothing is redefined here: a change to the state
//! machine the nodes run is a change to the machine checked here. The nodes cannot drive a
//! state of their own: the transition function is private to the machine, the machine is not
//! `Copy`, and decode's activation takes the `HandedOff` only `ReqMachine::handoff` makes
//! (the `compile_fail` checks in `runtime/engine/src/protocol.rs`).
//!
//! # What is modelled
//! - **One prefill node** whose pool holds `context_pages`: a prompt longer than that is
//!   *over-length* (in the incident: a 1,048,576-token context over a 681,280-token pool).
//! - **One decode node** with a pool of `pool_pages` physical pages. Each page has a `PageState`,
//!   a generation counter (bumped on every allocation), an owner, and its *content*: the in-band
//!   tag `(request, generation)` of the write that last landed in it (slots are modelled
//!   coarsely: one "written for" marker per page). Pages start never-written and are never
//!   zeroed: a released page keeps its old content.
//! - **Requests of two tenants**, one of them over-length. They arrive in any order and
//!   interleave freely.
//! - **Decode** reserves *any* set of free pages of the request's full length (any allocator
//!   policy), registers a key for them (`KeyState::Valid`) and records the `(page, generation)`
//!   pairs it expects.
//! - **Prefill** posts one-sided writes `(key, page, tag)` into a network multiset. The network
//!   delivers each write at any later time: after the request was aborted, after its pages were
//!   quarantined, released and reallocated. The transport's guarantee is modelled exactly: a
//!   write whose key is `Invalidated` is dropped; a write whose key is still `Valid` lands and
//!   overwrites the page's content, whoever owns the page now. (Prefill posting after an abort is
//!   covered by a write posted before the abort and delivered after it.)
//! - **Completion**: when none of the request's writes is in flight, decode verifies (in-band tag
//!   and checksum) that every reserved page holds content written for this request in the
//!   page's current generation (`AllVerified`, else `Fail`); then `Handoff` to `Decoding`, one
//!   `Read` over all reserved pages (after the read-time tag check; a mismatch is `Fail`), and
//!   `Finish`.
//! - **Abort** from every non-terminal state, at any time. When a request ends (finished,
//!   aborted, failed) its pages become `Quarantined`; later the transport invalidates (flushes)
//!   its key; a quarantined page returns to `Free` only when `release_allowed(key)` holds. Free
//!   pages are reallocated to later requests (generation bump).
//!
//! # Bounds (two instances, both checked)
//! - `MULTI_PAGE`: decode pool 3 pages, prefill pool (context) 2 pages; requests `r0` (tenant A,
//!   2 pages), `r1` (tenant B, 2 pages) — which cannot both fit, so the later one always reuses a
//!   page of the earlier — and `r2` (tenant B, 3 pages, over-length).
//!   Safe protocol: 62,382 reachable states (201,423 generated), depth 26.
//! - `REUSE`: decode pool 2 pages, context 1 page; `r0` (A, 1 page), `r1` (B, 1 page), `r2`
//!   (A, 1 page) — a page reaches generation 3 — and `r3` (B, 2 pages, over-length).
//!   Safe protocol: 169,872 reachable states (531,137 generated), depth 32.
//!
//! All four tests together take about 10 s single-threaded in an unoptimised debug build (the
//! exact counts are printed; run with `--nocapture`).
//!
//! # Configurations (`Defenses` flags)
//! - `Defenses::SAFE`, Custody's protocol: admission rejects an over-length prompt before any
//!   allocation or transfer; decode verifies every page before handoff; the attention read checks
//!   each page's tag; a page is freed only after its key was invalidated.
//! - `Defenses::LEGACY`, the incident's engine (SGLang PD disaggregation): the over-length prompt
//!   is "rejected" by truncating it to one page and still flows on — decode reserved pages for
//!   the full length, prefill writes one page and reports the transfer complete, decode hands
//!   off without verifying and attends over every reserved page without a tag check; a
//!   quarantined page may also be freed on a timeout, its key still valid.
//!
//! # Properties
//! - `no stale read` (safety property 1): whenever decode reads for request `r`, every page it
//!   attends is in the generation `r` expects and holds content written for `r` in that
//!   generation. What the read saw is kept as ghost state.
//! - `no cross-tenant read` (the incident's consequence; implied by property 1): no read sees
//!   content written for a request of another tenant.
//! - `no early reuse` (safety property 2): a page is never reallocated while a write for it may
//!   still land — no in-flight write whose key is `Valid` targets a page whose generation moved
//!   on since the write was posted.
//! - `no silent truncation` (safety property 3): a request that reaches `Prefilled`, `Decoding`
//!   or `Finished` had its whole prompt written.
//! - `no integrity failure`: no request ever fails a verification or tag check. Under `SAFE` the
//!   checks never fire (they are defence in depth); when they do fire elsewhere, the
//!   counterexample shows what they caught.
//! - `sometimes` properties keep the safe check from being vacuous: an over-length request is
//!   rejected, a request reads a reallocated page, a write is in flight after its request
//!   aborted, and after its page was reallocated (and is then dropped).
//!
//! # Results
//! - `SAFE`: every property holds in every reachable state of both instances, and every
//!   `sometimes` situation is reached.
//! - `SAFE` without the read-time tag check: the same — admission, verification before handoff
//!   and invalidation before release suffice for property 1; the tag check is the second line.
//! - `SAFE` with release on timeout instead of invalidation (`MULTI_PAGE`, 155,622 states):
//!   `no early reuse` fails (an aborted request's late write is still in flight with a valid key
//!   when its page is reallocated) and `no integrity failure` fails (the late write lands and
//!   the next owner's verification fails it) — but `no stale read` still holds: the checks turn
//!   the early reuse into a failed request, never a foreign read.
//! - `LEGACY` (stops at the first counterexamples): `no stale read` fails first as in the SGLang
//!   bug report's "garbage output" (the over-length request attends over never-written pages);
//!   `no cross-tenant read`, `no early reuse` and `no silent truncation` fail too. With release
//!   gated on invalidation, so that only the truncation path is open, the counterexample to
//!   `no cross-tenant read` is the incident itself: tenant A's request writes and ends, its
//!   pages are invalidated and freed, tenant B's over-length request reserves pages for its full
//!   length, prefill writes one page and reports complete, decode hands off and attends over
//!   every page — including one last written for tenant A.
//!
//! # Mapping to the implementation
//! `Reject` = admission's over-length check (HTTP 400 before any allocation); `Reserve` = decode
//! allocating pages and registering the transfer region; `PostWrites` = prefill posting
//! `KvTransport` writes; `Deliver` = a write landing, or being dropped because its region was
//! invalidated; `Complete` = decode's completion handler with the per-transfer checksum and
//! in-band tag check (`AllVerified`, else `Fail`); `Handoff` = building the `Prefilled` value;
//! `Read` = the paged-attention kernel's tag check, then the read; `Invalidate` = the transport's
//! flush/invalidate of an ended request's region; `Release` = the page pool's quarantine-to-free
//! step, gated by `release_allowed`.

use custody_runtime::disagg::protocol::{
    KeyState, PageState, ReqEvent, ReqMachine, ReqState, release_allowed,
};
use stateright::{Checker, HasDiscoveries, Model, Property};
use std::time::Instant;

type ReqId = u8;
type PageId = u8;

/// The in-band tag of a write: which request, in which page generation, it was written for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct Tag {
    req: ReqId,
    generation: u8,
}

/// A one-sided write in flight from prefill to a decode page, under the request's region key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct Write {
    /// The region key: one per request, registered at `Reserve`.
    key: ReqId,
    page: PageId,
    tag: Tag,
}

/// One physical decode page.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Page {
    state: PageState,
    generation: u8,
    owner: Option<ReqId>,
    /// Tag of the write that last landed here (never zeroed); `None` = never written.
    content: Option<Tag>,
}

/// What a read saw on one page: the page's generation and content at the time of the read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Seen {
    generation: u8,
    content: Option<Tag>,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Req {
    /// The nodes' own per-request machine (hashable): the model's request state.
    machine: ReqMachine,
    /// The request's region key; `None` until decode registered it.
    key: Option<KeyState>,
    /// The `(page, generation)` pairs decode reserved for the request and expects to read.
    pages: Vec<(PageId, u8)>,
    /// How many pages of prompt KV prefill computed and posted.
    posted: u8,
    /// Ghost: what the request's one decode read saw, page by page (aligned with `pages`).
    seen: Option<Vec<Seen>>,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct State {
    reqs: Vec<Req>,
    pages: Vec<Page>,
    /// In-flight writes, kept sorted (a multiset).
    net: Vec<Write>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Action {
    /// Admission refuses an over-length request (safe protocol).
    Reject(ReqId),
    /// Decode reserves these pages (a bit mask) for the request and registers its key.
    Reserve(ReqId, u8),
    StartPrefill(ReqId),
    /// Prefill posts its writes (all pages, or one page if the prompt was truncated).
    PostWrites(ReqId),
    /// The network delivers (or, under an invalidated key, drops) one write.
    Deliver(Write),
    /// No write of the request is in flight: decode verifies the pages (`AllVerified` / `Fail`).
    Complete(ReqId),
    Handoff(ReqId),
    /// Decode attends over all the request's pages (after the tag check, where there is one).
    Read(ReqId),
    Finish(ReqId),
    Abort(ReqId),
    /// The transport flushes/invalidates an ended request's key: none of its writes lands after.
    Invalidate(ReqId),
    /// Quarantined → Free, allowed by `release_allowed(key)`.
    Release(PageId),
    /// Quarantined → Free on a timeout, key still valid (legacy only).
    TimeoutRelease(PageId),
}

/// Which of the protocol's defences are on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Defenses {
    /// Admission rejects an over-length prompt before any allocation (else: truncate, flow on).
    admission_rejects_over_length: bool,
    /// Decode verifies every reserved page (tag + checksum) before `AllVerified`.
    verify_before_handoff: bool,
    /// The attention read checks every page's tag first and fails the request on a mismatch.
    tag_check_at_read: bool,
    /// A quarantined page is freed only after its key was invalidated (else: also on timeout).
    invalidate_before_release: bool,
}

impl Defenses {
    /// Custody's protocol.
    const SAFE: Defenses = Defenses {
        admission_rejects_over_length: true,
        verify_before_handoff: true,
        tag_check_at_read: true,
        invalidate_before_release: true,
    };
    /// The incident's engine.
    const LEGACY: Defenses = Defenses {
        admission_rejects_over_length: false,
        verify_before_handoff: false,
        tag_check_at_read: false,
        invalidate_before_release: false,
    };
}

/// A request's static description.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct ReqSpec {
    tenant: char,
    /// Pages needed for the whole prompt (decode reserves this many).
    pages: u8,
}

const fn spec(tenant: char, pages: u8) -> ReqSpec {
    ReqSpec { tenant, pages }
}

/// The bounds of one model instance.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Bounds {
    name: &'static str,
    /// Decode pool size, in pages.
    pool_pages: u8,
    /// Prefill pool size = the longest prompt the pair can serve, in pages.
    context_pages: u8,
    /// The requests, in no particular order (they arrive and interleave freely).
    reqs: &'static [ReqSpec],
}

impl Bounds {
    /// Multi-page prompts: tenant A's and tenant B's 2-page requests cannot both fit the 3-page
    /// decode pool, so the second always reuses a page of the first; tenant B's 3-page request is
    /// over-length (the prefill pool holds 2).
    const MULTI_PAGE: Bounds = Bounds {
        name: "multi-page",
        pool_pages: 3,
        context_pages: 2,
        reqs: &[spec('A', 2), spec('B', 2), spec('B', 3)],
    };
    /// Repeated reuse: three 1-page requests of tenants A, B, A over a 2-page decode pool (a page
    /// reaches generation 3), and tenant B's 2-page request is over-length (the prefill pool
    /// holds 1).
    const REUSE: Bounds = Bounds {
        name: "reuse",
        pool_pages: 2,
        context_pages: 1,
        reqs: &[spec('A', 1), spec('B', 1), spec('A', 1), spec('B', 2)],
    };
}

/// The model: one prefill node, one decode node, a network, under some bounds and defences.
#[derive(Clone, Debug)]
struct Disagg {
    bounds: Bounds,
    defenses: Defenses,
}

impl Disagg {
    fn spec(&self, r: ReqId) -> ReqSpec {
        self.bounds.reqs[usize::from(r)]
    }

    fn over_length(&self, r: ReqId) -> bool {
        self.spec(r).pages > self.bounds.context_pages
    }

    fn tenant_of(&self, r: ReqId) -> char {
        self.spec(r).tenant
    }
}

/// Apply a protocol event through the shared transition function. The model only offers events
/// for which `on` succeeds, so a failure here is a bug in the model.
fn step(req: &mut Req, event: ReqEvent) {
    req.machine
        .on(event)
        .expect("the model only offers legal transitions");
}

/// Whether the shared state machine allows `event` now.
fn allows(machine: &ReqMachine, event: ReqEvent) -> bool {
    machine.allows(event)
}

/// A request just ended: every page it still owns goes to quarantine (a write may still land).
fn quarantine_pages_of(s: &mut State, r: ReqId) {
    for page in &mut s.pages {
        if page.owner == Some(r) && matches!(page.state, PageState::Reserved | PageState::Filled) {
            page.state = PageState::Quarantined;
        }
    }
}

/// End a request with `event` (Finish / Abort / Fail) and quarantine its pages.
fn end(s: &mut State, r: ReqId, event: ReqEvent) {
    step(&mut s.reqs[usize::from(r)], event);
    quarantine_pages_of(s, r);
}

/// Whether every page of `r` is in the expected generation, owned by `r`, and holds content
/// written for `r` in that generation (the in-band tag check).
fn tags_match(s: &State, r: ReqId) -> bool {
    s.reqs[usize::from(r)].pages.iter().all(|&(p, g)| {
        let page = &s.pages[usize::from(p)];
        page.generation == g
            && page.owner == Some(r)
            && page.content
                == Some(Tag {
                    req: r,
                    generation: g,
                })
    })
}

/// The key state guarding a page: its owner's region key.
fn page_key(s: &State, page: &Page) -> Option<KeyState> {
    page.owner.and_then(|o| s.reqs[usize::from(o)].key)
}

impl Model for Disagg {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        vec![State {
            reqs: self
                .bounds
                .reqs
                .iter()
                .map(|_| Req {
                    machine: ReqMachine::new(),
                    key: None,
                    pages: Vec::new(),
                    posted: 0,
                    seen: None,
                })
                .collect(),
            pages: (0..self.bounds.pool_pages)
                .map(|_| Page {
                    state: PageState::Free,
                    generation: 0,
                    owner: None,
                    content: None,
                })
                .collect(),
            net: Vec::new(),
        }]
    }

    fn actions(&self, s: &State, actions: &mut Vec<Action>) {
        let free_mask: u8 = s
            .pages
            .iter()
            .enumerate()
            .filter(|(_, p)| p.state == PageState::Free)
            .fold(0, |m, (i, _)| m | (1 << i));
        for (i, req) in s.reqs.iter().enumerate() {
            let r = i as ReqId;
            let st = &req.machine;
            if st.state() == ReqState::Received {
                if self.over_length(r) && self.defenses.admission_rejects_over_length {
                    if allows(st, ReqEvent::Reject) {
                        actions.push(Action::Reject(r));
                    }
                } else if allows(st, ReqEvent::Reserve) {
                    // Any set of free pages of the request's full length (any allocator policy).
                    let need = u32::from(self.spec(r).pages);
                    for mask in 1..(1u8 << self.bounds.pool_pages) {
                        if mask & !free_mask == 0 && mask.count_ones() == need {
                            actions.push(Action::Reserve(r, mask));
                        }
                    }
                }
            }
            if allows(st, ReqEvent::StartPrefill) {
                actions.push(Action::StartPrefill(r));
            }
            if allows(st, ReqEvent::PostWrites) {
                actions.push(Action::PostWrites(r));
            }
            // Completion: the request's writes all landed (none of its key is in flight).
            if allows(st, ReqEvent::AllVerified) && s.net.iter().all(|w| w.key != r) {
                actions.push(Action::Complete(r));
            }
            if allows(st, ReqEvent::Handoff) {
                actions.push(Action::Handoff(r));
            }
            if st.may_read() && req.seen.is_none() {
                actions.push(Action::Read(r));
            }
            if allows(st, ReqEvent::Finish) && req.seen.is_some() {
                actions.push(Action::Finish(r));
            }
            if allows(st, ReqEvent::Abort) {
                actions.push(Action::Abort(r));
            }
            if st.is_terminal() && req.key == Some(KeyState::Valid) {
                actions.push(Action::Invalidate(r));
            }
        }
        for w in &s.net {
            actions.push(Action::Deliver(*w));
        }
        for (p, page) in s.pages.iter().enumerate() {
            if page.state == PageState::Quarantined {
                if release_allowed(page_key(s, page)) {
                    actions.push(Action::Release(p as PageId));
                } else if !self.defenses.invalidate_before_release {
                    actions.push(Action::TimeoutRelease(p as PageId));
                }
            }
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut s = last.clone();
        match action {
            Action::Reject(r) => step(&mut s.reqs[usize::from(r)], ReqEvent::Reject),
            Action::Reserve(r, mask) => {
                let mut reserved = Vec::new();
                for (p, page) in s.pages.iter_mut().enumerate() {
                    if mask & (1 << p) != 0 {
                        page.state = PageState::Reserved;
                        page.generation += 1;
                        page.owner = Some(r);
                        reserved.push((p as PageId, page.generation));
                    }
                }
                let req = &mut s.reqs[usize::from(r)];
                req.pages = reserved;
                req.key = Some(KeyState::Valid);
                step(req, ReqEvent::Reserve);
            }
            Action::StartPrefill(r) => step(&mut s.reqs[usize::from(r)], ReqEvent::StartPrefill),
            Action::PostWrites(r) => {
                // Legacy truncation: an over-length prompt was swapped for a one-token
                // placeholder, so prefill computes and writes only the first page.
                let truncated = self.over_length(r) && !self.defenses.admission_rejects_over_length;
                let req = &mut s.reqs[usize::from(r)];
                let n = if truncated { 1 } else { req.pages.len() };
                for &(page, generation) in &req.pages[..n] {
                    s.net.push(Write {
                        key: r,
                        page,
                        tag: Tag { req: r, generation },
                    });
                }
                req.posted = n as u8;
                step(req, ReqEvent::PostWrites);
                s.net.sort();
            }
            Action::Deliver(w) => {
                let at = s.net.iter().position(|x| *x == w)?;
                s.net.remove(at);
                // The transport's guarantee: a write under an invalidated key never lands.
                if s.reqs[usize::from(w.key)].key == Some(KeyState::Valid) {
                    s.pages[usize::from(w.page)].content = Some(w.tag);
                }
            }
            Action::Complete(r) => {
                if !self.defenses.verify_before_handoff || tags_match(&s, r) {
                    step(&mut s.reqs[usize::from(r)], ReqEvent::AllVerified);
                    for page in &mut s.pages {
                        if page.owner == Some(r) {
                            page.state = PageState::Filled;
                        }
                    }
                } else {
                    end(&mut s, r, ReqEvent::Fail);
                }
            }
            Action::Handoff(r) => step(&mut s.reqs[usize::from(r)], ReqEvent::Handoff),
            Action::Read(r) => {
                if self.defenses.tag_check_at_read && !tags_match(&s, r) {
                    // Integrity error: the request fails, nothing is read or returned.
                    end(&mut s, r, ReqEvent::Fail);
                } else {
                    let seen = s.reqs[usize::from(r)]
                        .pages
                        .iter()
                        .map(|&(p, _)| {
                            let page = &s.pages[usize::from(p)];
                            Seen {
                                generation: page.generation,
                                content: page.content,
                            }
                        })
                        .collect();
                    s.reqs[usize::from(r)].seen = Some(seen);
                }
            }
            Action::Finish(r) => end(&mut s, r, ReqEvent::Finish),
            Action::Abort(r) => end(&mut s, r, ReqEvent::Abort),
            Action::Invalidate(r) => s.reqs[usize::from(r)].key = Some(KeyState::Invalidated),
            Action::Release(p) | Action::TimeoutRelease(p) => {
                let page = &mut s.pages[usize::from(p)];
                page.state = PageState::Free;
                page.owner = None;
            }
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(NO_STALE_READ, |_, s: &State| {
                s.reqs.iter().enumerate().all(|(r, req)| {
                    req.seen.as_ref().is_none_or(|seen| {
                        req.pages.iter().zip(seen).all(|(&(_, g), seen)| {
                            seen.generation == g
                                && seen.content
                                    == Some(Tag {
                                        req: r as ReqId,
                                        generation: g,
                                    })
                        })
                    })
                })
            }),
            Property::always(NO_CROSS_TENANT_READ, |m: &Disagg, s: &State| {
                s.reqs.iter().enumerate().all(|(r, req)| {
                    req.seen.iter().flatten().all(|seen| {
                        seen.content
                            .is_none_or(|t| m.tenant_of(t.req) == m.tenant_of(r as ReqId))
                    })
                })
            }),
            Property::always(NO_EARLY_REUSE, |_, s: &State| {
                s.net.iter().all(|w| {
                    s.reqs[usize::from(w.key)].key != Some(KeyState::Valid)
                        || s.pages[usize::from(w.page)].generation == w.tag.generation
                })
            }),
            Property::always(NO_SILENT_TRUNCATION, |m: &Disagg, s: &State| {
                s.reqs.iter().enumerate().all(|(r, req)| {
                    !matches!(
                        req.machine.state(),
                        ReqState::Prefilled | ReqState::Decoding | ReqState::Finished
                    ) || req.posted == m.spec(r as ReqId).pages
                })
            }),
            Property::always(NO_INTEGRITY_FAILURE, |_, s: &State| {
                s.reqs.iter().all(|r| r.machine.state() != ReqState::Failed)
            }),
            Property::sometimes("an over-length request is rejected", |_, s: &State| {
                s.reqs
                    .iter()
                    .any(|r| r.machine.state() == ReqState::Rejected)
            }),
            Property::sometimes("a request reads a reallocated page", |_, s: &State| {
                s.reqs
                    .iter()
                    .any(|r| r.seen.is_some() && r.pages.iter().any(|&(_, g)| g >= 2))
            }),
            Property::sometimes(
                "a write is in flight after its request aborted",
                |_, s: &State| {
                    s.net
                        .iter()
                        .any(|w| s.reqs[usize::from(w.key)].machine.state() == ReqState::Aborted)
                },
            ),
            Property::sometimes(
                "a write is in flight after its page was reallocated",
                |_, s: &State| {
                    s.net
                        .iter()
                        .any(|w| s.pages[usize::from(w.page)].generation != w.tag.generation)
                },
            ),
        ]
    }
}

const NO_STALE_READ: &str = "no stale read";
const NO_CROSS_TENANT_READ: &str = "no cross-tenant read";
const NO_EARLY_REUSE: &str = "no early reuse";
const NO_SILENT_TRUNCATION: &str = "no silent truncation";
const NO_INTEGRITY_FAILURE: &str = "no integrity failure";

/// Runs the breadth-first check of one instance and reports its size and time.
fn check(bounds: Bounds, defenses: Defenses, finish_when: HasDiscoveries) -> impl Checker<Disagg> {
    let start = Instant::now();
    let checker = Disagg { bounds, defenses }
        .checker()
        .finish_when(finish_when.clone())
        .spawn_bfs()
        .join();
    let found = checker.discoveries().into_keys().collect();
    let how = if finish_when.matches(&found, &checker.model().properties()) {
        "stopped once the counterexamples asked for were found"
    } else {
        "exhaustive"
    };
    println!(
        "[{} bounds, {defenses:?}] {} unique states ({} generated), max depth {}, {how}, in \
         {:.2?}",
        bounds.name,
        checker.unique_state_count(),
        checker.state_count(),
        checker.max_depth(),
        start.elapsed(),
    );
    checker
}

/// A counterexample to `name`: the actions up to the first state on the discovered path that
/// violates it, and that state. (Stateright keeps the last violating state it visited; the
/// prefix up to the first violation is the readable part.)
fn counterexample(
    checker: &impl Checker<Disagg>,
    name: &'static str,
) -> Option<(Vec<Action>, State)> {
    let model = checker.model();
    let property = model.property(name);
    let mut actions = Vec::new();
    for (state, action) in checker.discovery(name)?.into_vec() {
        if !(property.condition)(model, &state) {
            return Some((actions, state));
        }
        actions.extend(action);
    }
    None
}

/// Every page read that saw content written for a request of another tenant:
/// `(reader, page, writer)`.
fn cross_tenant_reads(m: &Disagg, s: &State) -> Vec<(ReqId, PageId, ReqId)> {
    let mut out = Vec::new();
    for (r, req) in s.reqs.iter().enumerate() {
        let r = r as ReqId;
        for (&(page, _), seen) in req.pages.iter().zip(req.seen.iter().flatten()) {
            if let Some(tag) = seen.content
                && m.tenant_of(tag.req) != m.tenant_of(r)
            {
                out.push((r, page, tag.req));
            }
        }
    }
    out
}

/// Prints a counterexample: its actions (Debug), what each read saw, and the final state.
fn print_counterexample(m: &Disagg, name: &str, actions: &[Action], last: &State) {
    println!(
        "counterexample to `{name}` [{} bounds, {:?}], {} steps:",
        m.bounds.name,
        m.defenses,
        actions.len()
    );
    for (i, action) in actions.iter().enumerate() {
        println!("  {:>2}. {action:?}", i + 1);
    }
    for (r, req) in last.reqs.iter().enumerate() {
        let r = r as ReqId;
        for (&(page, generation), seen) in req.pages.iter().zip(req.seen.iter().flatten()) {
            let content = match seen.content {
                Some(t) => format!(
                    "written for r{} (tenant {}) in generation {}",
                    t.req,
                    m.tenant_of(t.req),
                    t.generation
                ),
                None => "never written".to_owned(),
            };
            println!(
                "  => r{r} (tenant {}) read page {page} (expects generation {generation}, page at \
                 {}): {content}",
                m.tenant_of(r),
                seen.generation
            );
        }
    }
    for w in &last.net {
        let page = &last.pages[usize::from(w.page)];
        if last.reqs[usize::from(w.key)].key == Some(KeyState::Valid)
            && page.generation != w.tag.generation
        {
            println!(
                "  => write of r{} for page {} generation {} is in flight with a valid key; the \
                 page is now generation {}, owned by {:?}",
                w.key, w.page, w.tag.generation, page.generation, page.owner
            );
        }
    }
    println!("  final state: {last:?}");
}

const ALL_BOUNDS: [Bounds; 2] = [Bounds::MULTI_PAGE, Bounds::REUSE];

/// The protocol Custody implements: every safety property holds in every reachable state, the
/// integrity checks never even fire, and the interesting situations (rejection, reuse, late
/// writes after abort and after reallocation) are all reached.
#[test]
fn model_check_safe_protocol_has_no_stale_read_or_early_reuse() {
    for bounds in ALL_BOUNDS {
        check(bounds, Defenses::SAFE, HasDiscoveries::All).assert_properties();
    }
}

/// Property 1 does not rest on the read-time tag check alone: without it, admission,
/// verification before handoff and invalidation before release still prevent every stale read.
#[test]
fn model_check_safe_protocol_without_read_tag_check_still_has_no_stale_read() {
    let defenses = Defenses {
        tag_check_at_read: false,
        ..Defenses::SAFE
    };
    for bounds in ALL_BOUNDS {
        check(bounds, defenses, HasDiscoveries::All).assert_properties();
    }
}

/// Releasing a quarantined page on a timeout, without invalidating its key, breaks property 2
/// (a late write of an aborted request lands in the page's next owner), and the integrity checks
/// are then what keeps property 1: the victim request fails instead of reading foreign KV.
#[test]
fn model_check_release_on_timeout_reuses_early_but_tag_check_prevents_stale_read() {
    let defenses = Defenses {
        invalidate_before_release: false,
        ..Defenses::SAFE
    };
    let checker = check(Bounds::MULTI_PAGE, defenses, HasDiscoveries::All);
    let m = checker.model();
    for name in [NO_EARLY_REUSE, NO_INTEGRITY_FAILURE] {
        let (actions, last) = counterexample(&checker, name)
            .unwrap_or_else(|| panic!("release on timeout must violate `{name}`"));
        print_counterexample(m, name, &actions, &last);
    }
    for name in [NO_STALE_READ, NO_CROSS_TENANT_READ, NO_SILENT_TRUNCATION] {
        checker.assert_no_discovery(name);
    }
}

/// The incident's engine (over-length prompts truncated and passed on, no verification before
/// handoff, no tag check at read, release on timeout) violates properties 1, 2 and 3; and the
/// truncation alone — even with release gated on invalidation — reproduces the incident: decode
/// attends over pages last written for another tenant.
#[test]
fn model_check_legacy_protocol_reproduces_the_incident() {
    let violated = [
        NO_STALE_READ,
        NO_CROSS_TENANT_READ,
        NO_EARLY_REUSE,
        NO_SILENT_TRUNCATION,
    ];
    let checker = check(
        Bounds::MULTI_PAGE,
        Defenses::LEGACY,
        HasDiscoveries::AllOf(violated.into_iter().collect()),
    );
    for name in violated {
        let (actions, last) = counterexample(&checker, name)
            .unwrap_or_else(|| panic!("the legacy protocol must violate `{name}`"));
        print_counterexample(checker.model(), name, &actions, &last);
    }

    let truncation_only = Defenses {
        invalidate_before_release: true,
        ..Defenses::LEGACY
    };
    for bounds in ALL_BOUNDS {
        let checker = check(
            bounds,
            truncation_only,
            HasDiscoveries::AnyOf([NO_CROSS_TENANT_READ].into_iter().collect()),
        );
        let m = checker.model();
        let (actions, last) = counterexample(&checker, NO_CROSS_TENANT_READ)
            .expect("truncating an over-length prompt must leak another tenant's KV");
        print_counterexample(m, NO_CROSS_TENANT_READ, &actions, &last);
        // The reader is the over-length request: truncated to one page by prefill, it attends
        // over every page decode reserved for its full length.
        let leaks = cross_tenant_reads(m, &last);
        assert!(!leaks.is_empty());
        for (reader, _, _) in leaks {
            let req = &last.reqs[usize::from(reader)];
            assert!(m.over_length(reader), "{reader} is the over-length request");
            assert_eq!(req.posted, 1, "prefill wrote one page");
            assert_eq!(req.pages.len(), usize::from(m.spec(reader).pages));
        }
    }
}
