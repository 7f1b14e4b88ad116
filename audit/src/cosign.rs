//! C2SP `tlog-cosignature` v1: a witness's signature on a log's checkpoint, saying "as of
//! `time`, this is the largest tree of this origin I have seen, and it is consistent with every
//! one I saw before".
//!
//! Key type 0x04 (Ed25519 cosignature); key id = SHA-256(name ‖ "\n" ‖ 0x04 ‖ public key)[:4];
//! the signature (after the key id, as every signed-note signature) is
//! `u64 big-endian time (POSIX seconds) ‖ Ed25519(key, "cosignature/v1\ntime <time>\n" ‖ text)`
//! where `text` is the checkpoint note's text (origin, size, root, extensions). `signed_note`
//! 0.2.0 has no cosignature type, so these are its `Signer`/`Verifier` for that type, written
//! from the spec (C2SP tlog-cosignature v1.0.1).

use ed25519_dalek::{Signer as _, SigningKey, Verifier as _, VerifyingKey};

use crate::tlog::TlogError;

/// C2SP signed-note key type of an Ed25519 cosignature (v1).
pub const ALG_COSIGNATURE_V1: u8 = 0x04;

/// A cosignature's signature bytes: the time and the Ed25519 signature.
const SIG_BYTES: usize = 8 + 64;

fn message(time_s: u64, text: &[u8]) -> Vec<u8> {
    let mut m = format!("cosignature/v1\ntime {time_s}\n").into_bytes();
    m.extend_from_slice(text);
    m
}

fn key_id(name: &str, key: &VerifyingKey) -> u32 {
    let public = [&[ALG_COSIGNATURE_V1][..], key.as_bytes()].concat();
    signed_note::key_id(name, &public)
}

/// A witness's key as a cosignature signer, at a given time.
pub struct CosignatureSigner {
    name: String,
    id: u32,
    key: SigningKey,
    time_s: u64,
}

impl std::fmt::Debug for CosignatureSigner {
    /// Name, key id and time; never the key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CosignatureSigner")
            .field("name", &self.name)
            .field("id", &format_args!("{:08x}", self.id))
            .field("time_s", &self.time_s)
            .finish()
    }
}

impl CosignatureSigner {
    /// A signer for cosignatures made at `time_s` (POSIX seconds, not 0: C2SP reserves 0).
    pub fn new(name: &str, key: SigningKey, time_s: u64) -> Result<Self, TlogError> {
        if !signed_note::is_key_name_valid(name) {
            return Err(TlogError::BadKeyName(name.to_owned()));
        }
        assert!(time_s > 0, "a cosignature's time is not 0");
        Ok(Self {
            name: name.to_owned(),
            id: key_id(name, &key.verifying_key()),
            key,
            time_s,
        })
    }

    /// The verifier key others pin: `<name>+<key id>+<base64(0x04‖public key)>`.
    pub fn vkey(&self) -> String {
        vkey(&self.name, &self.key.verifying_key())
    }
}

/// The cosignature verifier key of `key` under `name`.
pub fn vkey(name: &str, key: &VerifyingKey) -> String {
    use base64::Engine as _;
    let public = [&[ALG_COSIGNATURE_V1][..], key.as_bytes()].concat();
    format!(
        "{name}+{:08x}+{}",
        key_id(name, key),
        base64::engine::general_purpose::STANDARD.encode(public)
    )
}

impl signed_note::Signer for CosignatureSigner {
    fn name(&self) -> &str {
        &self.name
    }
    fn key_id(&self) -> u32 {
        self.id
    }
    fn sign(&self, msg: &[u8]) -> Result<Vec<u8>, ed25519_dalek::SignatureError> {
        let sig = self.key.sign(&message(self.time_s, msg));
        let mut out = self.time_s.to_be_bytes().to_vec();
        out.extend_from_slice(&sig.to_bytes());
        Ok(out)
    }
}

/// A witness's cosignature verifier, from its verifier key.
#[derive(Debug, Clone)]
pub struct CosignatureVerifier {
    name: String,
    id: u32,
    key: VerifyingKey,
}

impl CosignatureVerifier {
    /// Parses `<name>+<hex id>+<base64(0x04‖key)>`, checking the id and the key type.
    pub fn new(vkey: &str) -> Result<Self, TlogError> {
        use base64::Engine as _;
        let bad = || TlogError::BadVerifierKey(vkey.to_owned());
        let mut parts = vkey.splitn(3, '+');
        let (Some(name), Some(id), Some(key)) = (parts.next(), parts.next(), parts.next()) else {
            return Err(bad());
        };
        let id = u32::from_str_radix(id, 16).map_err(|_| bad())?;
        let raw = base64::engine::general_purpose::STANDARD
            .decode(key)
            .map_err(|_| bad())?;
        let (&alg, public) = raw.split_first().ok_or_else(bad)?;
        if alg != ALG_COSIGNATURE_V1 || !signed_note::is_key_name_valid(name) {
            return Err(bad());
        }
        let key =
            VerifyingKey::from_bytes(&public.try_into().map_err(|_| bad())?).map_err(|_| bad())?;
        if key_id(name, &key) != id {
            return Err(bad());
        }
        Ok(Self {
            name: name.to_owned(),
            id,
            key,
        })
    }

    /// The time a valid cosignature `sig` (time ‖ signature) of `text` states.
    pub fn time_of(&self, text: &[u8], sig: &[u8]) -> Option<u64> {
        if sig.len() != SIG_BYTES {
            return None;
        }
        let time_s = u64::from_be_bytes(sig[..8].try_into().ok()?);
        let sig = ed25519_dalek::Signature::from_bytes(sig[8..].try_into().ok()?);
        (time_s > 0 && self.key.verify(&message(time_s, text), &sig).is_ok()).then_some(time_s)
    }
}

impl signed_note::Verifier for CosignatureVerifier {
    fn name(&self) -> &str {
        &self.name
    }
    fn key_id(&self) -> u32 {
        self.id
    }
    fn verify(&self, msg: &[u8], sig: &[u8]) -> bool {
        self.time_of(msg, sig).is_some()
    }
}

/// A cosignature that checks: the witness's name and the time it states.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cosigned {
    pub witness: String,
    pub time_s: u64,
}

/// The cosignatures on `note` by the witnesses `witness_vkeys` that check (each witness once;
/// lines of keys not listed are ignored). A listed witness's line that does not check is an
/// error: someone altered the note or the line (C2SP: a known key's bad signature rejects).
pub fn cosignatures(note: &[u8], witness_vkeys: &[String]) -> Result<Vec<Cosigned>, TlogError> {
    let verifiers = witness_vkeys
        .iter()
        .map(|v| CosignatureVerifier::new(v))
        .collect::<Result<Vec<_>, _>>()?;
    let parsed = signed_note::Note::from_bytes(note)?;
    let mut out: Vec<Cosigned> = Vec::new();
    for v in &verifiers {
        let lines: Vec<signed_note::Signature> = parsed_sigs(&parsed)
            .into_iter()
            .filter(|s| s.name() == v.name && s.id() == v.id)
            .collect();
        for s in &lines {
            let time_s = v
                .time_of(parsed.text(), s.signature())
                .ok_or_else(|| TlogError::BadCosignature(v.name.clone()))?;
            if !out.iter().any(|c| c.witness == v.name) {
                out.push(Cosigned {
                    witness: v.name.clone(),
                    time_s,
                });
            }
        }
    }
    Ok(out)
}

/// The signature lines of a note (`signed_note` 0.2.0 has no getter for them): the lines after
/// the text's blank line, as `Note::from_bytes` already accepted them.
fn parsed_sigs(note: &signed_note::Note) -> Vec<signed_note::Signature> {
    let bytes = note.to_bytes();
    bytes[note.text().len() + 1..]
        .split(|&b| b == b'\n')
        .filter(|l| !l.is_empty())
        .filter_map(|l| signed_note::Signature::from_bytes(l).ok())
        .collect()
}

/// `note` with the signature lines of `extra` (another copy of the same checkpoint text: the
/// cosignatures a witness returned, or a note holding them) added after its own, each line once.
pub fn merge_signatures(note: &[u8], lines: &[u8]) -> Result<Vec<u8>, TlogError> {
    let mut out = note.to_vec();
    let have: Vec<Vec<u8>> = note.split(|&b| b == b'\n').map(<[u8]>::to_vec).collect();
    for l in lines.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
        signed_note::Signature::from_bytes(l)?;
        if !have.iter().any(|h| h == l) {
            out.extend_from_slice(l);
            out.push(b'\n');
        }
    }
    signed_note::Note::from_bytes(&out)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tlog::{Hash, NoteSigner, open_checkpoint, sign_checkpoint};

    fn key(seed: u8) -> SigningKey {
        SigningKey::from_bytes(&[seed; 32])
    }

    /// A checkpoint cosigned by two witnesses checks for each; the message is the spec's
    /// (`cosignature/v1`, the time line, the checkpoint text); an altered time, text or key
    /// does not check, and the log's own signature still does.
    #[test]
    fn cosignatures_are_c2sp_v1() {
        let log = NoteSigner::new("example.com/log", key(1)).expect("log");
        let note = sign_checkpoint(&log, 7, Hash([9; 32])).expect("note");
        let w1 = CosignatureSigner::new("w1.example", key(2), 1_700_000_000).expect("w1");
        let w2 = CosignatureSigner::new("w2.example", key(3), 1_700_000_001).expect("w2");
        let mut n = signed_note::Note::from_bytes(&note).expect("note");
        n.add_sigs(&[&w1, &w2]).expect("cosign");
        let cosigned = n.to_bytes();
        let got = cosignatures(&cosigned, &[w1.vkey(), w2.vkey()]).expect("check");
        assert_eq!(
            got,
            [
                Cosigned {
                    witness: "w1.example".into(),
                    time_s: 1_700_000_000
                },
                Cosigned {
                    witness: "w2.example".into(),
                    time_s: 1_700_000_001
                }
            ]
        );
        open_checkpoint(&cosigned, &log.vkey()).expect("the log's signature still checks");
        // The signature is over the spec's message, with the time in front.
        let v = CosignatureVerifier::new(&w1.vkey()).expect("vkey");
        let text = n.text().to_vec();
        let sig = signed_note::Signer::sign(&w1, &text).expect("sign");
        assert_eq!(&sig[..8], &1_700_000_000u64.to_be_bytes());
        let raw = ed25519_dalek::Signature::from_bytes(sig[8..].try_into().expect("64"));
        key(2)
            .verifying_key()
            .verify(
                &[b"cosignature/v1\ntime 1700000000\n".as_slice(), &text].concat(),
                &raw,
            )
            .expect("the spec's message");
        let mut later = sig.clone();
        later[7] ^= 1;
        assert!(v.time_of(&text, &later).is_none(), "another time");
        assert!(
            v.time_of(b"example.com/log\n8\n", &sig).is_none(),
            "another text"
        );
        // A key with the wrong type byte is not a cosignature key.
        assert!(CosignatureVerifier::new(&log.vkey()).is_err());
        // An altered cosignature line of a listed witness is an error, not a missing one.
        let s = String::from_utf8(cosigned.clone()).expect("utf-8");
        let line_start = s.find("— w1.example ").expect("w1 line") + "— w1.example ".len();
        let mut bad = s.into_bytes();
        bad[line_start + 10] = if bad[line_start + 10] == b'A' {
            b'B'
        } else {
            b'A'
        };
        assert!(cosignatures(&bad, &[w1.vkey()]).is_err());
        // Merging a witness's reply into the log's note.
        let w1_line: Vec<u8> = String::from_utf8(cosigned.clone())
            .expect("utf-8")
            .lines()
            .find(|l| l.starts_with("— w1.example "))
            .map(|l| format!("{l}\n").into_bytes())
            .expect("line");
        let merged = merge_signatures(&note, &w1_line).expect("merge");
        assert_eq!(
            cosignatures(&merged, &[w1.vkey(), w2.vkey()])
                .expect("check")
                .len(),
            1
        );
        assert_eq!(merge_signatures(&merged, &w1_line).expect("again"), merged);
    }
}
