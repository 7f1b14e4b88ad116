//! The `tcp` transport's connect-time authentication: both sides prove a pairing's secret, each
//! over a nonce the other chose, before the target reads a single frame.
//!
//! Wire (little-endian), on the plain socket or inside TLS when encryption is on:
//! 1. initiator → target, *hello*: `magic "KVHI" u32 | version u32 | pairing_id u64 |
//!    nonce_i[32]` (48 bytes);
//! 2. target → initiator, *challenge*: `magic "KVCH" u32 | version u32 | nonce_t[32] |
//!    mac_t[32]` (72 bytes), `mac_t = HMAC-SHA-256(secret, "custody-kv target v1" ‖ pairing_id ‖
//!    nonce_i ‖ nonce_t)` — the target proves it holds the secret (a stranger listening on the
//!    address learns no KV bytes);
//! 3. initiator → target, *proof*: `magic "KVPR" u32 | version u32 | mac_i[32]` (40 bytes),
//!    `mac_i = HMAC-SHA-256(secret, "custody-kv initiator v1" ‖ pairing_id ‖ nonce_t ‖ nonce_i)`.
//!
//! The target answers only a hello naming a live pairing (an unknown id is closed at once, with
//! no MAC computed under any secret), checks the proof in constant time, and only then hands the
//! connection to `poll_recv` bound to that pairing. Distinct labels per direction: a MAC the
//! target computes can never serve as an initiator's proof. Fresh nonces per connection: a
//! recorded exchange cannot be replayed.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::sync::Mutex;

use ring::hmac;

use crate::TransportError;
use crate::pairing::{Pairing, fill_random};

const MAGIC_HELLO: u32 = 0x4b56_4849; // "KVHI"
const MAGIC_CHALLENGE: u32 = 0x4b56_4348; // "KVCH"
const MAGIC_PROOF: u32 = 0x4b56_5052; // "KVPR"
const VERSION: u32 = 1;
const NONCE_BYTES: usize = 32;
const MAC_BYTES: usize = 32;
const HELLO_BYTES: usize = 16 + NONCE_BYTES;
const CHALLENGE_BYTES: usize = 8 + NONCE_BYTES + MAC_BYTES;
const PROOF_BYTES: usize = 8 + MAC_BYTES;
const LABEL_TARGET: &[u8] = b"custody-kv target v1";
const LABEL_INITIATOR: &[u8] = b"custody-kv initiator v1";

/// Why the target refused a connection (each one counted and logged).
#[derive(Debug, thiserror::Error)]
pub(crate) enum Refusal {
    /// Closed before sending a byte (a reachability probe): logged, not counted.
    #[error("closed before saying anything")]
    Silent,
    #[error("not a KV transport hello (first bytes {0:#010x})")]
    NotHello(u32),
    #[error("unsupported auth version {0}")]
    Version(u32),
    #[error("no live pairing {0:#018x}")]
    UnknownPairing(u64),
    #[error("the pairing secret's proof did not verify")]
    BadProof,
    #[error("I/O during authentication: {0}")]
    Io(#[from] std::io::Error),
    #[error("the system's random source failed")]
    Entropy,
}

fn mac(secret: &[u8], label: &[u8], pairing_id: u64, first: &[u8], second: &[u8]) -> hmac::Tag {
    let key = hmac::Key::new(hmac::HMAC_SHA256, secret);
    let mut ctx = hmac::Context::with_key(&key);
    ctx.update(label);
    ctx.update(&pairing_id.to_le_bytes());
    ctx.update(first);
    ctx.update(second);
    ctx.sign()
}

fn verify(
    secret: &[u8],
    label: &[u8],
    pairing_id: u64,
    first: &[u8],
    second: &[u8],
    tag: &[u8],
) -> bool {
    let key = hmac::Key::new(hmac::HMAC_SHA256, secret);
    let mut msg = Vec::with_capacity(label.len() + 8 + first.len() + second.len());
    msg.extend_from_slice(label);
    msg.extend_from_slice(&pairing_id.to_le_bytes());
    msg.extend_from_slice(first);
    msg.extend_from_slice(second);
    // Constant time in the tag's bytes.
    hmac::verify(&key, &msg, tag).is_ok()
}

fn u32_at(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]])
}

/// The initiator's half: hello, check the target's proof, send ours.
pub(crate) fn initiator(s: &mut (impl Read + Write), p: &Pairing) -> Result<(), TransportError> {
    let mut nonce_i = [0u8; NONCE_BYTES];
    fill_random(&mut nonce_i)?;
    let mut hello = [0u8; HELLO_BYTES];
    hello[0..4].copy_from_slice(&MAGIC_HELLO.to_le_bytes());
    hello[4..8].copy_from_slice(&VERSION.to_le_bytes());
    hello[8..16].copy_from_slice(&p.id().to_le_bytes());
    hello[16..].copy_from_slice(&nonce_i);
    s.write_all(&hello)?;
    s.flush()?;
    let mut ch = [0u8; CHALLENGE_BYTES];
    s.read_exact(&mut ch).map_err(|e| {
        TransportError::Auth(format!(
            "the target closed the connection instead of answering (wrong pairing?): {e}"
        ))
    })?;
    if u32_at(&ch, 0) != MAGIC_CHALLENGE || u32_at(&ch, 4) != VERSION {
        return Err(TransportError::Auth("not a KV transport challenge".into()));
    }
    let (nonce_t, mac_t) = ch[8..].split_at(NONCE_BYTES);
    if !verify(p.secret(), LABEL_TARGET, p.id(), &nonce_i, nonce_t, mac_t) {
        return Err(TransportError::Auth(
            "the target did not prove the pairing secret".into(),
        ));
    }
    let mac_i = mac(p.secret(), LABEL_INITIATOR, p.id(), nonce_t, &nonce_i);
    let mut proof = [0u8; PROOF_BYTES];
    proof[0..4].copy_from_slice(&MAGIC_PROOF.to_le_bytes());
    proof[4..8].copy_from_slice(&VERSION.to_le_bytes());
    proof[8..].copy_from_slice(mac_i.as_ref());
    s.write_all(&proof)?;
    s.flush()?;
    Ok(())
}

/// The target's half: read the hello, answer with our proof, check the initiator's. Returns the
/// pairing id the connection proved.
pub(crate) fn target(
    s: &mut (impl Read + Write),
    pairings: &Mutex<HashMap<u64, Pairing>>,
) -> Result<u64, Refusal> {
    let mut hello = [0u8; HELLO_BYTES];
    let first = read_first(s, &mut hello)?;
    if first < 4 || u32_at(&hello, 0) != MAGIC_HELLO {
        return Err(Refusal::NotHello(u32_at(&hello, 0)));
    }
    s.read_exact(&mut hello[first..])?;
    if u32_at(&hello, 4) != VERSION {
        return Err(Refusal::Version(u32_at(&hello, 4)));
    }
    let id = u64::from_le_bytes(hello[8..16].try_into().expect("8 bytes"));
    let nonce_i = &hello[16..];
    let secret = pairings
        .lock()
        .map_err(|_| Refusal::UnknownPairing(id))?
        .get(&id)
        .map(|p| *p.secret())
        .ok_or(Refusal::UnknownPairing(id))?;
    let mut nonce_t = [0u8; NONCE_BYTES];
    fill_random(&mut nonce_t).map_err(|_| Refusal::Entropy)?;
    let mac_t = mac(&secret, LABEL_TARGET, id, nonce_i, &nonce_t);
    let mut ch = [0u8; CHALLENGE_BYTES];
    ch[0..4].copy_from_slice(&MAGIC_CHALLENGE.to_le_bytes());
    ch[4..8].copy_from_slice(&VERSION.to_le_bytes());
    ch[8..8 + NONCE_BYTES].copy_from_slice(&nonce_t);
    ch[8 + NONCE_BYTES..].copy_from_slice(mac_t.as_ref());
    s.write_all(&ch)?;
    s.flush()?;
    let mut proof = [0u8; PROOF_BYTES];
    s.read_exact(&mut proof)?;
    if u32_at(&proof, 0) != MAGIC_PROOF || u32_at(&proof, 4) != VERSION {
        return Err(Refusal::BadProof);
    }
    if !verify(&secret, LABEL_INITIATOR, id, &nonce_t, nonce_i, &proof[8..]) {
        return Err(Refusal::BadProof);
    }
    Ok(id)
}

/// Read the hello's first 4 bytes at least (its magic): a connection closed before any byte is
/// [`Refusal::Silent`]. Returns how many bytes were read.
fn read_first(s: &mut impl Read, buf: &mut [u8; HELLO_BYTES]) -> Result<usize, Refusal> {
    let mut got = 0;
    while got < 4 {
        match s.read(&mut buf[got..]) {
            Ok(0) if got == 0 => return Err(Refusal::Silent),
            Ok(0) => return Err(Refusal::NotHello(u32_at(buf, 0))),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(got)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream};

    fn table(p: &Pairing) -> Mutex<HashMap<u64, Pairing>> {
        Mutex::new(HashMap::from([(p.id(), p.clone())]))
    }

    fn run(
        target_has: Pairing,
        initiator_has: Pairing,
    ) -> (Result<u64, Refusal>, Result<(), TransportError>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            target(&mut s, &table(&target_has))
        });
        let mut c = TcpStream::connect(addr).unwrap();
        let i = initiator(&mut c, &initiator_has);
        drop(c);
        (t.join().unwrap(), i)
    }

    #[test]
    fn the_right_secret_is_accepted_a_wrong_one_refused_both_ways() {
        let p = Pairing::generate().unwrap();
        let (t, i) = run(p.clone(), p.clone());
        assert_eq!(t.unwrap(), p.id());
        i.unwrap();
        // Same id, another secret: the initiator notices the target's proof is wrong first.
        let forged = Pairing::from_parts(p.id(), &[7u8; 32]).unwrap();
        let (t, i) = run(p.clone(), forged);
        assert!(matches!(i, Err(TransportError::Auth(_))), "{i:?}");
        assert!(t.is_err());
        // Unknown id: closed without a challenge.
        let (t, i) = run(p, Pairing::generate().unwrap());
        assert!(matches!(t, Err(Refusal::UnknownPairing(_))), "{t:?}");
        assert!(i.is_err());
    }

    #[test]
    fn the_target_refuses_a_wrong_proof_after_a_valid_hello() {
        let p = Pairing::generate().unwrap();
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let tp = p.clone();
        let t = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            target(&mut s, &table(&tp))
        });
        let mut c = TcpStream::connect(addr).unwrap();
        let mut hello = [0u8; HELLO_BYTES];
        hello[0..4].copy_from_slice(&MAGIC_HELLO.to_le_bytes());
        hello[4..8].copy_from_slice(&VERSION.to_le_bytes());
        hello[8..16].copy_from_slice(&p.id().to_le_bytes());
        c.write_all(&hello).unwrap();
        let mut ch = [0u8; CHALLENGE_BYTES];
        c.read_exact(&mut ch).unwrap();
        // A proof with the right framing and the wrong MAC (e.g. replayed from another
        // connection, whose nonces differ).
        let mut proof = [0u8; PROOF_BYTES];
        proof[0..4].copy_from_slice(&MAGIC_PROOF.to_le_bytes());
        proof[4..8].copy_from_slice(&VERSION.to_le_bytes());
        proof[8..].copy_from_slice(&ch[8 + NONCE_BYTES..]); // the target's own MAC, reflected
        c.write_all(&proof).unwrap();
        assert!(matches!(t.join().unwrap(), Err(Refusal::BadProof)));
    }

    #[test]
    fn a_target_mac_is_not_an_initiator_proof() {
        let p = Pairing::generate().unwrap();
        let (a, b) = ([1u8; 32], [2u8; 32]);
        let t = mac(p.secret(), LABEL_TARGET, p.id(), &a, &b);
        assert!(!verify(
            p.secret(),
            LABEL_INITIATOR,
            p.id(),
            &a,
            &b,
            t.as_ref()
        ));
        assert!(verify(p.secret(), LABEL_TARGET, p.id(), &a, &b, t.as_ref()));
    }
}
