//! The engine's disaggregated roles own their sets: a prefill engine holds a prefilled prompt's
//! pages outside every queue until the transfer is over; a decode engine frees a reservation's
//! pages only with the real transport's proof that its key is dead — and a proof of another
//! key, or none, leaves them quarantined.

use custody_audit::RequestKind;
use custody_runtime::engine::{DecodeEngine, Event, ImportError, PrefillEngine, ReleaseRefused};
use custody_runtime::protocol::{ReqEvent, ReqMachine};
use custody_runtime::transport::{self, TransportKind};

use crate::disagg::req;
use crate::{engine_with, small_cfg};

fn aborted() -> RequestKind {
    RequestKind::Aborted {
        reason: "test".into(),
    }
}

const PROMPT: [u32; 20] = [
    1, 504, 3458, 282, 1, 504, 3458, 282, 1, 504, 3458, 282, 1, 504, 3458, 282, 9, 9, 9, 9,
];

#[test]
fn prefill_engine_holds_prefilled_pages_outside_every_queue() {
    let mut e = PrefillEngine::new(engine_with(small_cfg()));
    let all_free = e.core().pool().n_free();
    let ps = e.core().pool().page_size();
    let id = e
        .submit(req("acme", PROMPT.to_vec(), 64))
        .expect("admitted");
    // The reservation is the prompt only (`max_tokens` is decode's to reserve).
    let mut first = None;
    for _ in 0..8 {
        for ev in e.step() {
            if let Event::Prefilled {
                id: got,
                first_token,
                ..
            } = ev
            {
                assert_eq!(got, id);
                first = Some(first_token);
            }
        }
        if first.is_some() {
            break;
        }
    }
    assert!(first.is_some(), "the prompt was prefilled");
    assert_eq!(
        all_free - e.core().pool().n_free(),
        PROMPT.len().div_ceil(ps)
    );
    let (pages, n_cached) = e.held(id).expect("held after prefill");
    assert_eq!(n_cached, PROMPT.len());
    assert_eq!(pages.len(), PROMPT.len().div_ceil(ps));
    assert!(
        !e.has_work(),
        "a held request is in no queue: no step touches its pages"
    );
    assert_eq!(e.n_live(), 1);
    assert!(e.step().is_empty());
    assert!(e.release_held(id, aborted()));
    assert!(!e.release_held(id, aborted()), "released once");
    assert_eq!(e.n_live(), 0);
    assert_eq!(e.core().pool().n_free(), all_free, "every page back");
}

#[test]
fn decode_engine_frees_quarantined_pages_only_with_the_keys_own_proof() {
    let mut e = DecodeEngine::new(engine_with(small_cfg()));
    let all_free = e.core().pool().n_free();
    let mut t = transport::open_target(
        2,
        &TransportKind::Tcp,
        "127.0.0.1:0".parse().expect("addr"),
        Default::default(),
    )
    .expect("tcp target");
    let pairing = t.pair().expect("pair").id();
    let (id, land) = e
        .reserve_import(req("acme", PROMPT.to_vec(), 12))
        .expect("reserved");
    let pages = land.pages();
    let stride = e.core().pool().region_page_stride() as u64;
    let region = t
        .register(pages.len() as u64 * stride, pairing)
        .expect("register");
    e.bind_import_key(id, region.rkey).expect("bind");

    // A proof of another key opens neither the reservation nor, later, its quarantine.
    let other = t.register(stride, pairing).expect("register another");
    let other_proof = t.invalidate(other.rkey).expect("invalidate the other");
    let mut machine = ReqMachine::new();
    machine.on(ReqEvent::Reserve).expect("reserve");
    machine.observe_posted().expect("posted");
    machine.on(ReqEvent::AllVerified).expect("verified");
    let handed_off = machine.handoff().expect("handoff");
    assert!(matches!(
        e.activate_import(id, 7, false, &other_proof, handed_off),
        Err(ImportError::WrongKey { .. })
    ));

    assert!(e.quarantine(id, aborted(), None));
    assert_eq!(e.n_quarantined_pages(), pages.len());
    assert_eq!(
        e.release_quarantined(id, None),
        Err(ReleaseRefused::KeyStillValid {
            id,
            rkey: region.rkey
        })
    );
    assert!(e.release_quarantined(id, Some(&other_proof)).is_err());
    assert_eq!(
        e.core().pool().n_free(),
        all_free - pages.len(),
        "still quarantined"
    );
    assert_eq!(e.n_live(), 1);

    let proof = t.invalidate(region.rkey).expect("invalidate");
    e.release_quarantined(id, Some(&proof))
        .expect("released with the proof");
    assert_eq!(e.n_quarantined_pages(), 0);
    assert_eq!(e.n_live(), 0);
    assert_eq!(e.core().pool().n_free(), all_free, "every page back");
    assert_eq!(
        e.release_quarantined(id, Some(&proof)),
        Err(ReleaseRefused::NotQuarantined(id))
    );
}
