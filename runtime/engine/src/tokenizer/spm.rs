//! SentencePiece vocabularies (`tokenizer.ggml.model = "llama"`: Llama 1/2, Mistral, many
//! fine-tunes), tokenized as llama.cpp does.
//!
//! Not through the `tokenizers` crate: its BPE merges by a pair's rank, while llama.cpp's SPM
//! merges whichever adjacent pair forms the vocabulary piece of the highest *score*, ties to
//! the leftmost — the two differ when two pairs form pieces of equal score or one piece can be
//! formed from different pairs. Token ids must be llama.cpp's exactly (they are what the model
//! was trained on), so this is llama.cpp's algorithm, written from its description:
//!
//! 1. The text is cut at control/user-defined/unknown token texts, each matched whole
//!    (longest first); those become their ids.
//! 2. Each remaining run of text gets a leading space when `add_space_prefix` is set and it
//!    starts the text or follows a special token; spaces become `▁` (U+2581).
//! 3. The run starts as one symbol per character; repeatedly, the adjacent pair whose
//!    concatenation is a vocabulary piece of the highest score (leftmost on ties) is merged.
//! 4. Each final symbol is its piece's id, or — not in the vocabulary — its UTF-8 bytes as
//!    byte tokens (`<0x41>`), the byte fallback.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

use super::{TOKEN_TYPE_BYTE, TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_USER_DEFINED};
use super::{TOKEN_TYPE_NORMAL, TokenizerError};

/// SentencePiece's visible space.
const SPACE: &str = "\u{2581}";

/// A SentencePiece vocabulary.
#[derive(Debug)]
pub(crate) struct Spm {
    pieces: Vec<String>,
    scores: Vec<f32>,
    types: Vec<i64>,
    to_id: HashMap<String, u32>,
    /// Byte `b`'s fallback token, where the vocabulary has one.
    byte_ids: Vec<Option<u32>>,
    /// Texts matched whole in input, longest first (ties by id).
    specials: Vec<(String, u32)>,
    add_space_prefix: bool,
}

/// A run of input: text to tokenize, or a special token matched whole.
#[derive(Clone, Copy, Debug)]
enum Fragment<'a> {
    Text(&'a str),
    Special(u32),
}

/// One symbol of the merge: a byte range of the run, linked to its live neighbours.
#[derive(Clone, Copy, Debug)]
struct Symbol {
    start: usize,
    /// Bytes; 0 once merged into its left neighbour.
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

/// A candidate merge of two adjacent symbols into a piece of `score`.
#[derive(Clone, Copy, Debug)]
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    /// Bytes of the merged piece: a stale candidate (a side merged since) no longer adds up.
    len: usize,
}

impl PartialEq for Bigram {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for Bigram {}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Bigram {
    /// The heap's top is the highest score, then the leftmost.
    fn cmp(&self, o: &Self) -> Ordering {
        self.score
            .total_cmp(&o.score)
            .then_with(|| o.left.cmp(&self.left))
    }
}

impl Spm {
    pub(crate) fn new(
        tokens: &[&str],
        scores: Vec<f32>,
        types: Vec<i64>,
        add_space_prefix: bool,
    ) -> Result<Self, TokenizerError> {
        if scores.len() != tokens.len() || types.len() != tokens.len() {
            return Err(TokenizerError::Build(format!(
                "{} tokens, {} scores, {} token types",
                tokens.len(),
                scores.len(),
                types.len()
            )));
        }
        let pieces: Vec<String> = tokens.iter().map(|t| (*t).to_owned()).collect();
        let mut to_id = HashMap::with_capacity(pieces.len());
        for (i, p) in pieces.iter().enumerate() {
            // A duplicated text maps to its last id, as llama.cpp's table built in id order.
            to_id.insert(p.clone(), i as u32);
        }
        let byte_ids = (0..=255u8)
            .map(|b| {
                to_id
                    .get(&format!("<0x{b:02X}>"))
                    .or_else(|| to_id.get(&String::from(char::from(b))).filter(|_| b < 0x80))
                    .copied()
            })
            .collect();
        let mut specials: Vec<(String, u32)> = pieces
            .iter()
            .zip(&types)
            .enumerate()
            .filter(|(_, (_, t))| {
                matches!(
                    **t,
                    TOKEN_TYPE_CONTROL | TOKEN_TYPE_USER_DEFINED | TOKEN_TYPE_UNKNOWN
                )
            })
            .filter(|(_, (p, _))| !p.is_empty())
            .map(|(i, (p, _))| (p.clone(), i as u32))
            .collect();
        specials.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        Ok(Self {
            pieces,
            scores,
            types,
            to_id,
            byte_ids,
            specials,
            add_space_prefix,
        })
    }

    pub(crate) fn piece(&self, id: u32) -> Option<&str> {
        self.pieces.get(id as usize).map(String::as_str)
    }

    /// Token ids of `text` (no BOS).
    pub(crate) fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        self.encode_from(text, true)
    }

    /// Token ids of `text` as it continues earlier text: no space prefix before its first run
    /// (one still follows a special token inside it, as in [`Self::encode`]).
    pub(crate) fn encode_continuation(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        self.encode_from(text, false)
    }

    fn encode_from(&self, text: &str, at_start: bool) -> Result<Vec<u32>, TokenizerError> {
        let mut out = Vec::with_capacity(text.len() / 2 + 1);
        let mut prev_special = at_start;
        for f in self.partition(text) {
            match f {
                Fragment::Special(id) => {
                    out.push(id);
                    prev_special = true;
                }
                Fragment::Text(t) => {
                    let mut run = String::with_capacity(t.len() + 4);
                    if self.add_space_prefix && prev_special {
                        run.push(' ');
                    }
                    run.push_str(t);
                    self.encode_run(&run.replace(' ', SPACE), &mut out)?;
                    prev_special = false;
                }
            }
        }
        Ok(out)
    }

    /// Step 1: cut `text` at special token texts, longest first, each leftmost-first within
    /// the pieces of text left by the longer ones.
    fn partition<'a>(&self, text: &'a str) -> Vec<Fragment<'a>> {
        let mut frags = vec![Fragment::Text(text)];
        for (special, id) in &self.specials {
            let mut next = Vec::with_capacity(frags.len());
            for f in frags {
                let Fragment::Text(mut t) = f else {
                    next.push(f);
                    continue;
                };
                while let Some(at) = t.find(special.as_str()) {
                    if at > 0 {
                        next.push(Fragment::Text(&t[..at]));
                    }
                    next.push(Fragment::Special(*id));
                    t = &t[at + special.len()..];
                }
                if !t.is_empty() {
                    next.push(Fragment::Text(t));
                }
            }
            frags = next;
        }
        frags
    }

    /// Steps 3–4 on one escaped run.
    fn encode_run(&self, run: &str, out: &mut Vec<u32>) -> Result<(), TokenizerError> {
        if run.is_empty() {
            return Ok(());
        }
        let mut symbols: Vec<Symbol> = Vec::with_capacity(run.len());
        for (i, (start, ch)) in run.char_indices().enumerate() {
            symbols.push(Symbol {
                start,
                len: ch.len_utf8(),
                prev: i.checked_sub(1),
                next: Some(i + 1),
            });
        }
        if let Some(last) = symbols.last_mut() {
            last.next = None;
        }
        let mut heap = BinaryHeap::with_capacity(symbols.len());
        for i in 1..symbols.len() {
            self.push_bigram(run, &symbols, i - 1, i, &mut heap);
        }
        // Each merge empties one symbol, so the heap drains: at most one push per symbol side.
        while let Some(b) = heap.pop() {
            let (l, r) = (symbols[b.left], symbols[b.right]);
            if l.len == 0 || r.len == 0 || l.len + r.len != b.len {
                continue; // stale: a side was merged since this candidate was seen
            }
            symbols[b.left].len += r.len;
            symbols[b.right].len = 0;
            symbols[b.left].next = r.next;
            if let Some(n) = r.next {
                symbols[n].prev = Some(b.left);
            }
            if let Some(p) = l.prev {
                self.push_bigram(run, &symbols, p, b.left, &mut heap);
            }
            if let Some(n) = r.next {
                self.push_bigram(run, &symbols, b.left, n, &mut heap);
            }
        }
        let mut at = Some(0);
        while let Some(i) = at {
            let s = symbols[i];
            self.emit(&run[s.start..s.start + s.len], out)?;
            at = s.next;
        }
        Ok(())
    }

    fn push_bigram(
        &self,
        run: &str,
        symbols: &[Symbol],
        left: usize,
        right: usize,
        heap: &mut BinaryHeap<Bigram>,
    ) {
        let (l, r) = (symbols[left], symbols[right]);
        debug_assert_eq!(l.start + l.len, r.start, "bigram of non-adjacent symbols");
        let text = &run[l.start..r.start + r.len];
        if let Some(&id) = self.to_id.get(text) {
            heap.push(Bigram {
                score: self.scores[id as usize],
                left,
                right,
                len: text.len(),
            });
        }
    }

    /// A final symbol: its piece, or its bytes. (Merges only ever form vocabulary pieces, so a
    /// symbol that is not one is a single character.)
    fn emit(&self, text: &str, out: &mut Vec<u32>) -> Result<(), TokenizerError> {
        if let Some(&id) = self.to_id.get(text) {
            out.push(id);
            return Ok(());
        }
        debug_assert_eq!(text.chars().count(), 1, "a merged symbol is always a piece");
        for &b in text.as_bytes() {
            let id = self.byte_ids[usize::from(b)].ok_or_else(|| {
                TokenizerError::Encode(format!(
                    "{text:?} is not in the vocabulary and byte 0x{b:02X} has no fallback token"
                ))
            })?;
            out.push(id);
        }
        Ok(())
    }

    /// The bytes of `ids`, each token as llama.cpp's `token_to_piece` renders it with special
    /// tokens shown: normal pieces with `▁` as a space, byte tokens as their byte, control,
    /// unknown and user-defined tokens as their text, unused ones as nothing. (No leading space
    /// is stripped: streamed output is the concatenation of its tokens' pieces.)
    pub(crate) fn decode_bytes(&self, ids: &[u32]) -> Vec<u8> {
        let mut out = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            let (piece, ty) = (&self.pieces[id as usize], self.types[id as usize]);
            match ty {
                TOKEN_TYPE_NORMAL => out.extend(piece.replace(SPACE, " ").bytes()),
                TOKEN_TYPE_BYTE => out.extend(byte_of(piece)),
                TOKEN_TYPE_CONTROL | TOKEN_TYPE_UNKNOWN | TOKEN_TYPE_USER_DEFINED => {
                    out.extend(piece.bytes());
                }
                _ => {}
            }
        }
        out
    }
}

/// The byte a byte token (`<0x41>`) stands for.
fn byte_of(piece: &str) -> Option<u8> {
    let hex = piece.strip_prefix("<0x")?.strip_suffix('>')?;
    u8::from_str_radix(hex, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A vocabulary of `(piece, score, type)`.
    fn vocab(extra: &[(&str, f32, i64)]) -> Spm {
        let mut t: Vec<(String, f32, i64)> = vec![
            ("<unk>".into(), 0.0, TOKEN_TYPE_UNKNOWN),
            ("<s>".into(), 0.0, TOKEN_TYPE_CONTROL),
            ("</s>".into(), 0.0, TOKEN_TYPE_CONTROL),
        ];
        t.extend((0..=255u8).map(|b| (format!("<0x{b:02X}>"), 0.0, TOKEN_TYPE_BYTE)));
        t.extend(extra.iter().map(|(p, s, ty)| ((*p).to_owned(), *s, *ty)));
        let tokens: Vec<&str> = t.iter().map(|x| x.0.as_str()).collect();
        Spm::new(
            &tokens,
            t.iter().map(|x| x.1).collect(),
            t.iter().map(|x| x.2).collect(),
            true,
        )
        .expect("vocab")
    }

    const N: i64 = TOKEN_TYPE_NORMAL;

    #[test]
    fn the_highest_scoring_piece_is_merged_first_and_ties_go_left() {
        // "▁abc": ▁a (score -1) beats bc (-2), then ▁abc needs ▁a+bc? Not a piece: stays.
        let v = vocab(&[
            ("▁", -9.0, N),
            ("a", -9.0, N),
            ("b", -9.0, N),
            ("c", -9.0, N),
            ("▁a", -1.0, N),
            ("bc", -2.0, N),
            ("ab", -0.5, N),
        ]);
        let id = |p: &str| v.to_id[p];
        // ab (-0.5) outranks ▁a (-1): "▁" "ab" "c".
        assert_eq!(
            v.encode("abc").expect("encode"),
            [id("▁"), id("ab"), id("c")]
        );
        // Equal scores: the leftmost pair merges first.
        let v = vocab(&[("x", -5.0, N), ("xx", -1.0, N), ("▁", -5.0, N)]);
        let id = |p: &str| v.to_id[p];
        assert_eq!(
            v.encode("xxx").expect("encode"),
            [id("▁"), id("xx"), id("x")]
        );
    }

    #[test]
    fn unknown_characters_fall_back_to_their_utf8_bytes() {
        let v = vocab(&[("▁", -1.0, N), ("h", -1.0, N), ("i", -1.0, N)]);
        let ids = v.encode("hi é").expect("encode");
        let bytes: Vec<u32> = "é".bytes().map(|b| 3 + u32::from(b)).collect();
        let want: Vec<u32> = [v.to_id["▁"], v.to_id["h"], v.to_id["i"], v.to_id["▁"]]
            .into_iter()
            .chain(bytes)
            .collect();
        assert_eq!(ids, want);
        assert_eq!(
            String::from_utf8(v.decode_bytes(&ids)).expect("utf8"),
            " hi é"
        );
    }

    #[test]
    fn special_texts_are_matched_whole_and_the_text_after_gets_the_space_prefix() {
        let v = vocab(&[("▁", -1.0, N), ("a", -1.0, N), ("▁a", -0.1, N)]);
        let ids = v.encode("a</s>a<s>").expect("encode");
        assert_eq!(ids, [v.to_id["▁a"], 2, v.to_id["▁a"], 1]);
        assert_eq!(v.encode("").expect("encode"), Vec::<u32>::new());
    }
}
