//! The Unigram model: best segmentation of one pre-token by Viterbi over the trie.
//!
//! The lattice is one cell per byte position; `cells[j]` holds the best path ending at
//! byte `j` (its score, the start of its last piece and that piece's id). Positions are
//! visited in ascending order, trie matches from each position in ascending length, and
//! a candidate replaces a cell only when strictly better (`>`), with scores summed in
//! `f64`, which is exactly HF `tokenizers`' `encode_optimized`. A character with no
//! one-character piece gets an unknown node scored `min_score - 10`; consecutive unknown
//! nodes are fused into one token.

use crate::trie::{step, Trie, NO_ID};

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

/// One lattice cell: the best path ending at this byte position.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Cell {
    score: f64,
    /// Start of the last piece, or `u32::MAX` when no path reaches here yet.
    start: u32,
    id: u32,
}

/// Per-call working memory of the Viterbi pass, reused across calls.
#[derive(Debug, Default)]
pub struct ViterbiScratch {
    cells: Vec<Cell>,
    /// Backtracked path, last piece first: (start, end, id).
    path: Vec<(u32, u32, u32)>,
}

impl Unigram {
    /// Builds the model from `(piece, score)` in id order.
    pub fn new(vocab: &[(String, f64)], unk_id: u32) -> Self {
        let min_score = vocab.iter().map(|v| v.1).fold(f64::INFINITY, f64::min);
        let entries: Vec<(&[u8], u32, f64)> = vocab
            .iter()
            .enumerate()
            .map(|(i, (p, s))| (p.as_bytes(), i as u32, *s))
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
        self.trie.get(piece.as_bytes()).map(|(id, _)| id)
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
    /// in `piece`. Allocates nothing once `scratch` has grown to the piece's length.
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
        let nodes = self.trie.nodes();
        let cells = &mut scratch.cells;
        cells.clear();
        cells.resize(
            n + 1,
            Cell {
                score: 0.0,
                start: u32::MAX,
                id: NO_ID,
            },
        );
        cells[0].start = 0;
        let mut pos = 0usize;
        while pos < n {
            let here = cells[pos].score;
            let mblen = crate::normalizer::utf8_len(piece[pos]).min(n - pos);
            let mut has_single = false;
            let mut node = 0usize;
            let mut j = pos;
            while j < n {
                // SAFETY: `j < n == piece.len()`.
                let b = unsafe { *piece.get_unchecked(j) };
                // SAFETY: `node` is the root or was returned by `step`.
                match unsafe { step(nodes, node, b) } {
                    Some(child) => node = child,
                    None => break,
                }
                j += 1;
                // SAFETY: `step` returns in-bounds indices.
                let t = unsafe { nodes.get_unchecked(node) };
                if t.id != NO_ID {
                    let cand = here + t.score;
                    // SAFETY: `j <= n` and `cells.len() == n + 1`.
                    let c = unsafe { cells.get_unchecked_mut(j) };
                    if c.start == u32::MAX || cand > c.score {
                        *c = Cell {
                            score: cand,
                            start: pos as u32,
                            id: t.id,
                        };
                    }
                    if j - pos == mblen {
                        has_single = true;
                    }
                }
            }
            if !has_single {
                let cand = here + self.unk_score;
                let c = &mut cells[pos + mblen];
                if c.start == u32::MAX || cand > c.score {
                    *c = Cell {
                        score: cand,
                        start: pos as u32,
                        id: self.unk_id,
                    };
                }
            }
            pos += mblen;
        }
        // Backtrack, last piece first.
        let path = &mut scratch.path;
        path.clear();
        let mut end = n;
        while end > 0 {
            let c = cells[end];
            path.push((c.start, end as u32, c.id));
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
                id = self
                    .trie
                    .get(&piece[start as usize..stop as usize])
                    .map_or(self.unk_id, |(i, _)| i);
            }
            ids.push(id);
            if let Some(o) = offsets.as_deref_mut() {
                o.push((start, stop));
            }
        }
    }
}
