//! The Unigram model: best segmentation of one pre-token by Viterbi over the trie.
//!
//! The lattice is one cell per character position (pieces start and end on character
//! boundaries, and the trie consumes one character per step); `cells[j]` holds the best
//! path ending before character `j` (its score, the start of its last piece and that
//! piece's id, read from the trie node the walk has just loaded, so backtracking reads no
//! trie memory). Positions are visited in ascending order, trie matches from each
//! position in ascending length, and a candidate replaces a cell only when strictly
//! better (`>`), with scores summed in `f64`, which is exactly HF `tokenizers`'
//! `encode_optimized`. A character with no one-character piece gets an unknown node
//! scored `min_score - 10`; consecutive unknown nodes are fused into one token.

use crate::trie::{step, Scores, Trie, NO_CODE};

/// Score penalty HF and SentencePiece give an unknown character below the lowest score.
const UNK_PENALTY: f64 = 10.0;

/// A Unigram vocabulary with its trie.
#[derive(Debug)]
pub struct Unigram {
    trie: Trie,
    /// Pieces by id (for decoding and `id_to_token`).
    pieces: Vec<Box<str>>,
    unk_id: u32,
    unk_score: f64,
}

/// One lattice cell: the best path ending at this character position.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Cell {
    /// Score of the best path; `-inf` when no path reaches here yet.
    score: f64,
    /// Start (character index) of the last piece, or `u32::MAX` when no path reaches
    /// here yet.
    start: u32,
    /// Id of the last piece (the unknown id for an unknown node).
    id: u32,
}

/// Per-call working memory of the Viterbi pass, reused across calls.
#[derive(Debug, Default)]
pub struct ViterbiScratch {
    cells: Vec<Cell>,
    /// Backtracked path, last piece first: (start, end, id) in bytes.
    path: Vec<(u32, u32, u32)>,
    /// The piece's characters: (byte start, trie code), then an end sentinel.
    chars: Vec<(u32, u32)>,
}

impl ViterbiScratch {
    /// Makes room for pieces of up to `chars` characters, so that no piece that long
    /// allocates.
    pub(crate) fn reserve(&mut self, chars: usize) {
        // `Vec::reserve` counts from the length, which is the last piece's.
        self.cells
            .reserve((chars + 1).saturating_sub(self.cells.len()));
        self.chars
            .reserve((chars + 1).saturating_sub(self.chars.len()));
        self.path.reserve(chars.saturating_sub(self.path.len()));
    }

    /// Cuts oversized buffers back (see `tokenizer::KEEP_BYTES`).
    pub(crate) fn trim(&mut self) {
        crate::tokenizer::trim_buffer(&mut self.cells);
        crate::tokenizer::trim_buffer(&mut self.path);
        crate::tokenizer::trim_buffer(&mut self.chars);
    }

    /// Bytes of heap capacity held.
    pub(crate) fn bytes(&self) -> usize {
        crate::tokenizer::buffer_bytes(&self.cells)
            + crate::tokenizer::buffer_bytes(&self.path)
            + crate::tokenizer::buffer_bytes(&self.chars)
    }
}

impl Unigram {
    /// Builds the model from `(piece, score)` in id order.
    pub fn new(vocab: &[(String, f64)], unk_id: u32) -> Self {
        let min_score = vocab.iter().map(|v| v.1).fold(f64::INFINITY, f64::min);
        let entries: Vec<(&str, u32, f64)> = vocab
            .iter()
            .enumerate()
            .map(|(i, (p, s))| (p.as_str(), i as u32, *s))
            .collect();
        let trie = Trie::build(&entries);
        Self {
            trie,
            pieces: vocab.iter().map(|v| v.0.clone().into_boxed_str()).collect(),
            unk_id,
            unk_score: min_score - UNK_PENALTY,
        }
    }

    /// Number of pieces.
    pub fn len(&self) -> usize {
        self.pieces.len()
    }

    /// True when the vocabulary is empty.
    pub fn is_empty(&self) -> bool {
        self.pieces.is_empty()
    }

    /// The piece with id `id`.
    pub fn piece(&self, id: u32) -> Option<&str> {
        self.pieces.get(id as usize).map(|p| &**p)
    }

    /// The id HF would give the string `piece` (the last id listing it).
    pub fn piece_id(&self, piece: &str) -> Option<u32> {
        self.trie.get(piece).map(|(id, _)| id)
    }

    /// The unknown token's id.
    pub fn unk_id(&self) -> u32 {
        self.unk_id
    }

    /// Node slots in the trie and the pages they live on.
    pub fn trie_stats(&self) -> (usize, crate::PageKind) {
        (self.trie.len(), self.trie.page_kind())
    }

    /// Appends the ids of `piece` to `ids`; with `offsets`, also each token's byte range
    /// in `piece`. `piece` is UTF-8 (other bytes give memory-safe but meaningless ids).
    /// Allocates nothing once `scratch` has grown to the piece's length.
    pub fn encode_piece(
        &self,
        piece: &[u8],
        scratch: &mut ViterbiScratch,
        ids: &mut Vec<u32>,
        mut offsets: Option<&mut Vec<(u32, u32)>>,
    ) {
        let n = piece.len();
        if n == 0 {
            return;
        }
        // Characters: byte start and trie code of each, plus an end sentinel.
        let chars = &mut scratch.chars;
        chars.clear();
        let mut p = 0usize;
        while p < n {
            let len = crate::normalizer::utf8_len(piece[p]).min(n - p);
            chars.push((p as u32, self.trie.code(decode(&piece[p..p + len]))));
            p += len;
        }
        chars.push((n as u32, NO_CODE));
        match self.trie.scores() {
            Scores::Packed => self.lattice(scratch, Scores::Packed),
            side => self.lattice(scratch, side),
        }
        // Backtrack, last piece first, in byte positions.
        let path = &mut scratch.path;
        path.clear();
        let (cells, chars) = (&scratch.cells, &scratch.chars);
        let mut end = chars.len() - 1;
        while end > 0 {
            let c = cells[end];
            path.push((chars[c.start as usize].0, chars[end].0, c.id));
            end = c.start as usize;
        }
        // Emit in order, fusing runs of unknown nodes; a fused run takes the id HF's
        // piece→id map gives its text (usually unknown).
        let mut k = path.len();
        while k > 0 {
            k -= 1;
            let (start, mut stop, id) = path[k];
            let mut id = id;
            if id == self.unk_id {
                while k > 0 && path[k - 1].2 == self.unk_id {
                    k -= 1;
                    stop = path[k].1;
                }
                id = std::str::from_utf8(&piece[start as usize..stop as usize])
                    .ok()
                    .and_then(|s| self.trie.get(s))
                    .map_or(self.unk_id, |(i, _)| i);
            }
            ids.push(id);
            if let Some(o) = offsets.as_deref_mut() {
                o.push((start, stop));
            }
        }
    }

    /// Fills `scratch.cells` from `scratch.chars` (the characters' codes and an end
    /// sentinel): the Viterbi forward pass. Called with the trie's [`Scores`] form and
    /// inlined once per form, so that the packed form's loop has no test of the form.
    ///
    /// The lattice is updated without a branch on loaded data: every node a walk reaches
    /// offers `here + score` to its cell (a node that ends no piece scores `-inf`, which
    /// never wins), cells start at `-inf`, and a strictly better candidate wins through
    /// selects. A branch there was mispredicted often enough, and waited on the node's
    /// load when it was, to cost ~8% of an encode at ~512 tokens. The unknown node
    /// competes at every position: when a one-character piece starts there, the cell
    /// already holds a path scoring at least that piece's score, which the unknown's lower
    /// score never beats — so this is HF's `has_single_node` rule.
    #[inline(always)]
    fn lattice(&self, scratch: &mut ViterbiScratch, scores: Scores<'_>) {
        let chars = &scratch.chars;
        let m = chars.len() - 1;
        let nodes = self.trie.nodes();
        let cells = &mut scratch.cells;
        cells.clear();
        cells.resize(
            m + 1,
            Cell {
                score: f64::NEG_INFINITY,
                start: u32::MAX,
                id: self.unk_id,
            },
        );
        cells[0] = Cell {
            score: 0.0,
            start: 0,
            id: self.unk_id,
        };
        for pos in 0..m {
            // SAFETY: `pos < m < cells.len()`.
            let here = unsafe { cells.get_unchecked(pos) }.score;
            let mut node = 0usize;
            let mut j = pos;
            loop {
                // SAFETY: `j <= m < chars.len()` (the sentinel at `m` has `NO_CODE`, which
                // ends the loop before `j` can pass `m`).
                let code = unsafe { chars.get_unchecked(j) }.1;
                if code == NO_CODE {
                    break;
                }
                // SAFETY: `node` is the root or was returned by `step`; `code` comes from
                // this trie's map.
                match unsafe { step(nodes, node, code) } {
                    Some(child) => node = child,
                    None => break,
                }
                j += 1;
                // SAFETY: `step` returns in-bounds indices; `j <= m` and
                // `cells.len() == m + 1`.
                let (t, c) = unsafe { (nodes.get_unchecked(node), cells.get_unchecked_mut(j)) };
                offer(c, here + scores.score(t), pos, scores.id(t));
            }
            // SAFETY: `pos + 1 <= m`.
            let c = unsafe { cells.get_unchecked_mut(pos + 1) };
            offer(c, here + self.unk_score, pos, self.unk_id);
        }
    }
}

/// HF's lattice update without a branch: the candidate path (score `cand`, last piece
/// `id` from character `start`) replaces the cell only when strictly better.
#[inline(always)]
fn offer(c: &mut Cell, cand: f64, start: usize, id: u32) {
    let better = cand > c.score;
    c.score = core::hint::select_unpredictable(better, cand, c.score);
    c.start = core::hint::select_unpredictable(better, start as u32, c.start);
    c.id = core::hint::select_unpredictable(better, id, c.id);
}

/// The code point of one UTF-8 sequence (`s` is 1–4 bytes; malformed input gives some
/// value, never a panic).
#[inline(always)]
fn decode(s: &[u8]) -> u32 {
    let b = |i: usize| (s[i] & 0x3f) as u32;
    match s.len() {
        1 => s[0] as u32,
        2 => ((s[0] & 0x1f) as u32) << 6 | b(1),
        3 => ((s[0] & 0x0f) as u32) << 12 | b(1) << 6 | b(2),
        _ => ((s[0] & 0x07) as u32) << 18 | b(1) << 12 | b(2) << 6 | b(3),
    }
}
