//! A node's signed promise, handed to a tenant in the response itself, of the records its
//! request left in the node's log: each record's sequence number (its leaf index in the node's
//! Merkle tree), table and leaf hash, signed with the node's key as a C2SP `signed-note`
//! (issue 40). It plays the part of Certificate Transparency's SCT: before anything is sealed,
//! the tenant holds the node's word that leaf `seq` of its tree is this hash. Any later
//! checkpoint of more than `seq` records either proves it (an inclusion proof of that hash at
//! that index) or, shown a different leaf there, proves the node broke its word — a fork or a
//! rewritten record that the signed promise makes a third party's evidence.
//!
//! The note's text (`docs/audit-schema.md`, *Receipts*):
//!
//! ```text
//! custody.receipt.promise/1
//! <origin>
//! <request id>            req-<node>-<n>
//! <tenant>
//! <records>               how many lines follow
//! <seq> <table> <leaf>    leaf = base64 of the record's RFC 6962 leaf hash, by seq
//! ```
//!
//! signed under the key name `<origin>` (the checkpoint's key). A promise cannot be read as a
//! checkpoint: its second line is no tree size.

use crate::tlog::{Hash, NoteSigner, TlogError};
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as B64;

/// The note's first line.
pub const PROMISE_FORMAT: &str = "custody.receipt.promise/1";
/// Records a promise may list: what a receipt may hold (`tree_store::MAX_RECEIPT_RECORDS`).
pub const MAX_PROMISED_RECORDS: usize = 1 << 16;

/// One promised record.
#[derive(Debug, Clone, PartialEq)]
pub struct PromisedLeaf {
    /// Its sequence number: its leaf index in the node's tree.
    pub seq: u64,
    /// Its table (`requests`, `page_reads`, …).
    pub table: String,
    /// `SHA-256(0x00 ‖ record)`, the record's canonical encoding.
    pub leaf: Hash,
}

impl PromisedLeaf {
    /// The leaf hash in base64, as the note and the answer's JSON write it.
    pub fn leaf_base64(&self) -> String {
        B64.encode(self.leaf.0)
    }
}

/// What a node promises of one request.
#[derive(Debug, Clone, PartialEq)]
pub struct Promise {
    pub origin: String,
    pub request_id: String,
    pub tenant: String,
    /// By `seq`, strictly increasing.
    pub leaves: Vec<PromisedLeaf>,
}

/// Why a promise note was refused.
#[derive(Debug, thiserror::Error)]
pub enum PromiseError {
    #[error("not a {PROMISE_FORMAT} note: {0}")]
    Malformed(String),
    #[error("the promise's signature: {0}")]
    Signature(#[from] TlogError),
}

fn malformed(why: impl Into<String>) -> PromiseError {
    PromiseError::Malformed(why.into())
}

/// A word of a promise's line: non-empty, no whitespace (tenant ids and request ids are such).
fn is_word(s: &str) -> bool {
    !s.is_empty() && !s.chars().any(char::is_whitespace)
}

impl Promise {
    /// The note's text (ends with a newline, as a signed note's text must).
    pub fn text(&self) -> Result<String, PromiseError> {
        if !is_word(&self.request_id) || !is_word(&self.tenant) || !is_word(&self.origin) {
            return Err(malformed(
                "origin, request id and tenant must be single words",
            ));
        }
        if self.leaves.len() > MAX_PROMISED_RECORDS {
            return Err(malformed(format!(
                "more than {MAX_PROMISED_RECORDS} records"
            )));
        }
        if !self.leaves.windows(2).all(|w| w[0].seq < w[1].seq) {
            return Err(malformed("records must be in increasing seq order"));
        }
        let mut t = format!(
            "{PROMISE_FORMAT}\n{}\n{}\n{}\n{}\n",
            self.origin,
            self.request_id,
            self.tenant,
            self.leaves.len()
        );
        for l in &self.leaves {
            if !is_word(&l.table) {
                return Err(malformed("a table name must be one word"));
            }
            t.push_str(&format!("{} {} {}\n", l.seq, l.table, l.leaf_base64()));
        }
        Ok(t)
    }

    /// The promise as a signed note, signed by `signer` (whose name is the origin).
    pub fn sign(&self, signer: &NoteSigner) -> Result<Vec<u8>, PromiseError> {
        let text = self.text()?;
        let mut note = signed_note::Note::new(text.as_bytes(), &[]).map_err(TlogError::from)?;
        note.add_sigs(&[signer]).map_err(TlogError::from)?;
        Ok(note.to_bytes())
    }

    /// The promise in `note` if `vkey` (the node's note verifier key) signed it.
    pub fn open(note: &[u8], vkey: &str) -> Result<Self, PromiseError> {
        let verifier = signed_note::StandardVerifier::new(vkey).map_err(TlogError::from)?;
        let known = signed_note::VerifierList::new(vec![Box::new(verifier)]);
        let n = signed_note::Note::from_bytes(note).map_err(TlogError::from)?;
        n.verify(&known).map_err(TlogError::from)?;
        Self::parse(n.text())
    }

    /// The promise a signed note carries, its signature not checked (for its origin before
    /// choosing the key; [`Promise::open`] checks it).
    pub fn of_note(note: &[u8]) -> Result<Self, PromiseError> {
        Self::parse(crate::tlog::note_text(note))
    }

    /// The promise a note's text says, its signature not checked ([`Promise::open`] checks it).
    pub fn parse(text: &[u8]) -> Result<Self, PromiseError> {
        let text = std::str::from_utf8(text).map_err(|_| malformed("not UTF-8"))?;
        let body = text
            .strip_suffix('\n')
            .ok_or_else(|| malformed("no final newline"))?;
        let mut lines = body.split('\n');
        let mut next = |what: &str| lines.next().ok_or_else(|| malformed(format!("no {what}")));
        if next("format line")? != PROMISE_FORMAT {
            return Err(malformed("format line"));
        }
        let (origin, request_id, tenant) = (next("origin")?, next("request id")?, next("tenant")?);
        let count: usize = next("record count")?
            .parse()
            .map_err(|_| malformed("record count"))?;
        if count > MAX_PROMISED_RECORDS {
            return Err(malformed(format!(
                "more than {MAX_PROMISED_RECORDS} records"
            )));
        }
        let mut leaves = Vec::with_capacity(count);
        for _ in 0..count {
            leaves.push(parse_leaf(next("record line")?)?);
        }
        if lines.next().is_some() {
            return Err(malformed("more record lines than its count"));
        }
        let p = Self {
            origin: origin.to_owned(),
            request_id: request_id.to_owned(),
            tenant: tenant.to_owned(),
            leaves,
        };
        // The canonical text only: one promise, one encoding.
        if p.text()? != text {
            return Err(malformed("not in canonical form"));
        }
        Ok(p)
    }
}

fn parse_leaf(line: &str) -> Result<PromisedLeaf, PromiseError> {
    let mut w = line.split(' ');
    let (Some(seq), Some(table), Some(leaf), None) = (w.next(), w.next(), w.next(), w.next())
    else {
        return Err(malformed(format!("record line {line:?}")));
    };
    let seq = seq
        .parse()
        .map_err(|_| malformed(format!("seq in {line:?}")))?;
    let leaf: [u8; 32] = B64
        .decode(leaf)
        .ok()
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| malformed(format!("leaf hash in {line:?}")))?;
    Ok(PromisedLeaf {
        seq,
        table: table.to_owned(),
        leaf: Hash(leaf),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use ed25519_dalek::SigningKey;

    fn promise() -> Promise {
        Promise {
            origin: "custody.example/node-0".into(),
            request_id: "req-0-7".into(),
            tenant: "acme".into(),
            leaves: vec![
                PromisedLeaf {
                    seq: 3,
                    table: "requests".into(),
                    leaf: Hash([1; 32]),
                },
                PromisedLeaf {
                    seq: 9,
                    table: "page_reads".into(),
                    leaf: Hash([2; 32]),
                },
            ],
        }
    }

    fn signer(seed: u8) -> NoteSigner {
        NoteSigner::new(
            "custody.example/node-0",
            SigningKey::from_bytes(&[seed; 32]),
        )
        .unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn a_signed_promise_opens_with_its_key_only() {
        let s = signer(1);
        let note = promise().sign(&s).unwrap_or_else(|e| panic!("{e}"));
        let text = String::from_utf8_lossy(&note).into_owned();
        assert!(
            text.starts_with("custody.receipt.promise/1\ncustody.example/node-0\nreq-0-7\nacme\n2\n3 requests AQEB"),
            "{text}"
        );
        let opened = Promise::open(&note, &s.vkey()).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(opened, promise());
        // Another key with the same name: refused.
        assert!(matches!(
            Promise::open(&note, &signer(2).vkey()),
            Err(PromiseError::Signature(_))
        ));
        // One leaf changed: the signature no longer checks.
        let forged = text.replacen("3 requests AQEB", "3 requests AgEB", 1);
        assert!(Promise::open(forged.as_bytes(), &s.vkey()).is_err());
    }

    #[test]
    fn malformed_promises_are_refused_by_name() {
        let t = promise().text().unwrap_or_else(|e| panic!("{e}"));
        for (bad, why) in [
            (t.replace("\n2\n", "\n3\n"), "no record line"),
            (t.replace("\n2\n", "\n1\n"), "more record lines"),
            (t.replace("3 requests", "03 requests"), "canonical"),
            (t.replace("3 requests", "x requests"), "seq"),
            (
                t.replace("custody.receipt.promise/1", "custody.receipt.promise/2"),
                "format",
            ),
            (t.trim_end().to_owned(), "final newline"),
            // A checkpoint's text is no promise.
            ("custody.example/node-0\n5\nAAAA\n".to_owned(), "format"),
        ] {
            let e = Promise::parse(bad.as_bytes()).map(|_| ()).unwrap_err();
            assert!(e.to_string().contains(why), "{bad:?}: {e}");
        }
        let mut unordered = promise();
        unordered.leaves.swap(0, 1);
        assert!(unordered.text().is_err());
        let mut spaced = promise();
        spaced.tenant = "two words".into();
        assert!(spaced.text().is_err());
    }
}
