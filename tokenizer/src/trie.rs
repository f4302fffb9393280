//! The vocabulary trie: a double array (Aoe) over *characters*, with 16-byte nodes.
//!
//! Every character that occurs in a piece gets a code `1..=alphabet` (most frequent
//! first, so the children of most nodes sit in a narrow window); a character that occurs
//! in no piece has code [`NO_CODE`] and matches nothing. Node `n`'s child for code `c`
//! lives at slot `s = n.base + c`, and it is a child of `n` exactly when
//! `nodes[s].check == n`. One transition consumes a whole character (1–4 UTF-8 bytes) and
//! touches one 16-byte node, four of which share a cache line. Construction places each
//! node's children so that their slots are free (first fit) and pads the array so that
//! `base + c < nodes.len()` for every base and every code, which is what makes the
//! unchecked indexing in [`step`] sound.
//!
//! A node that ends a piece carries everything the Viterbi pass needs from it — the
//! piece's exact `f64` score and its id — so a match reads no memory beyond the node the
//! walk has just loaded:
//!
//! ```text
//! node (16 bytes, align 16 — four to a cache line)
//! ┌────────────────────────┬────────────────────────┬──────────────┬──────────────────────┐
//! │ check: u32             │ base: u32              │ score: f32   │ tag: u32             │
//! │ 0–23: parent index     │ 0–30: children offset  │ the piece's  │ 0–7: k (i8)          │
//! │ 24–31: child filter    │ 31: ends a piece       │ score, to f32│ 8–31: piece id       │
//! └────────────────────────┴────────────────────────┴──────────────┴──────────────────────┘
//! exact score = f64::from_bits((score as f64).to_bits() + k)
//! ```
//!
//! Scores in `tokenizer.json` are `f32` values printed with 16 digits and read back as
//! `f64` (not always the `f32` itself), so they lie within a few `f64` units in the last
//! place of their `f32` rounding; `k` is that distance in bit patterns (both have the same
//! sign, so it is a count of `f64` steps; XLM-R's are −1, 0 or +1). When some piece's
//! score is not reproduced exactly this way (`k` outside `i8`: a score far from every
//! `f32`, beyond its range or below its precision) or some id needs more than 24 bits,
//! the trie is built in the [`Scores::Side`] form instead: `tag` is the whole id and the
//! exact scores live in a side array by id. Both forms give identical results;
//! [`Trie::scores`] says which one a trie uses, and construction checks every piece's
//! round trip (bit for bit) in debug builds.

use std::collections::HashMap;

use crate::pages::{PageBuf, PageKind};

/// Code of a character that occurs in no piece.
pub(crate) const NO_CODE: u32 = 0;

/// Bits of [`Node::check`] that hold the parent index.
const PARENT: u32 = (1 << 24) - 1;

/// `check` of a slot that holds no node: parent bits all ones (never a node index, all
/// of which are `< PARENT`), empty child filter.
const FREE: u32 = PARENT;

/// Bit of a node's child filter (the top byte of [`Node::check`]) for code `c`.
#[inline(always)]
const fn filter_bit(c: u32) -> u32 {
    1 << (24 + (c & 7))
}

/// Bit of [`Node::base`] set when the node ends a piece.
const TERMINAL: u32 = 1 << 31;

/// Largest id the packed form holds (in the top 24 bits of [`Node::tag`]).
const MAX_PACKED_ID: u32 = (1 << 24) - 1;

/// One trie node: 16 bytes, four to a cache line.
#[derive(Debug, Clone, Copy)]
#[repr(C, align(16))]
pub(crate) struct Node {
    /// Low 24 bits ([`PARENT`]): index of this slot's parent (all ones when free). Slot
    /// `s` is the child of `n` for code `c` exactly when `s == n.base + c` and
    /// `check & PARENT == n`. Top 8 bits: this node's child filter — bit `24 + c % 8` is
    /// set when the node has a child whose code is `c` modulo 8, so most failing
    /// transitions (always the ones from leaves) are decided without touching the slot.
    pub(crate) check: u32,
    /// Low 31 bits: offset of this node's children (the child for code `c` is at
    /// `base + c`); bit 31 ([`TERMINAL`]): this node ends a piece.
    pub(crate) base: u32,
    /// Score of the piece ending here rounded to `f32` (`-inf` when not terminal; unused
    /// in the [`Scores::Side`] form).
    pub(crate) score: f32,
    /// Packed form: bits 8–31 the id of the piece ending here, bits 0–7 (as `i8`) the
    /// distance `k` from `score as f64` to the exact score in `f64` bit patterns.
    /// [`Scores::Side`] form: the whole id. When not terminal: 0 in the packed form, the
    /// index of the side array's last entry (`-inf`) in the other.
    pub(crate) tag: u32,
}

impl Node {
    /// True when this node ends a vocabulary piece.
    #[inline(always)]
    pub(crate) fn is_terminal(&self) -> bool {
        self.base & TERMINAL != 0
    }

    /// The exact score of the piece ending here, in the packed form.
    #[inline(always)]
    pub(crate) fn packed_score(&self) -> f64 {
        let k = self.tag as u8 as i8 as i64;
        f64::from_bits((self.score as f64).to_bits().wrapping_add(k as u64))
    }
}

/// `(score, tag)` of the packed form for `(id, exact)`, when it reproduces both exactly.
fn pack(id: u32, exact: f64) -> Option<(f32, u32)> {
    let hi = exact as f32;
    let k = (exact.to_bits() as i64).wrapping_sub((hi as f64).to_bits() as i64);
    let k = i8::try_from(k).ok()?;
    let tag = (id << 8) | k as u8 as u32;
    let node = Node {
        check: FREE,
        base: TERMINAL,
        score: hi,
        tag,
    };
    (id <= MAX_PACKED_ID && node.packed_score().to_bits() == exact.to_bits()).then_some((hi, tag))
}

const EMPTY: Node = Node {
    check: FREE,
    base: 0,
    score: 0.0,
    tag: 0,
};

/// How a trie's terminal nodes hold their score and id; `encode_piece` picks its loop by
/// this once per piece.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Scores<'a> {
    /// Score and id packed in the node (every score of the vocabulary fits).
    Packed,
    /// `tag` is the id; exact scores by id in this slice (construction sizes it past
    /// every id, plus a last `-inf` entry that the non-terminal nodes' `tag` points at).
    Side(&'a [f64]),
}

impl Scores<'_> {
    /// Exact score of the piece ending at node `t`; `-inf` when `t` ends no piece.
    #[inline(always)]
    pub(crate) fn score(self, t: &Node) -> f64 {
        match self {
            Scores::Packed => t.packed_score(),
            // Bounds-checked: this form is the rare one, and its speed matters less.
            Scores::Side(side) => side[t.tag as usize],
        }
    }

    /// Id of the piece ending at terminal node `t` (meaningless for other nodes).
    #[inline(always)]
    pub(crate) fn id(self, t: &Node) -> u32 {
        match self {
            Scores::Packed => t.tag >> 8,
            Scores::Side(_) => t.tag,
        }
    }
}

/// Character → code map: a two-level table over code points (256 per block, blocks
/// with no coded character share the all-[`NO_CODE`] block 0).
#[derive(Debug)]
struct CharCodes {
    /// Block offset into `codes` for code point `cp >> 8`.
    index: Vec<u32>,
    /// Codes, 256 per block; block 0 is all [`NO_CODE`].
    codes: Vec<u32>,
}

impl CharCodes {
    /// Codes `1..` by descending count (ties by code point).
    fn build(counts: &HashMap<char, u64>) -> Self {
        let mut chars: Vec<(char, u64)> = counts.iter().map(|(&c, &k)| (c, k)).collect();
        chars.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        let mut index = vec![0u32; (char::MAX as usize >> 8) + 1];
        let mut codes = vec![NO_CODE; 256];
        for (code, &(c, _)) in chars.iter().enumerate() {
            let hi = c as usize >> 8;
            if index[hi] == 0 {
                index[hi] = codes.len() as u32;
                codes.resize(codes.len() + 256, NO_CODE);
            }
            codes[index[hi] as usize + (c as usize & 255)] = code as u32 + 1;
        }
        Self { index, codes }
    }

    /// The code of code point `cp` ([`NO_CODE`] when no piece uses it, or `cp` is not a
    /// code point); never more than the alphabet size.
    #[inline(always)]
    fn code(&self, cp: u32) -> u32 {
        match self.index.get((cp >> 8) as usize) {
            Some(&block) => self.codes[block as usize + (cp & 255) as usize],
            None => NO_CODE,
        }
    }
}

/// A finished trie.
#[derive(Debug)]
pub(crate) struct Trie {
    /// Nodes; index 0 is the root. Invariant: for every node `n` and every code
    /// `c <= alphabet`, `(n.base & !TERMINAL) as usize + c < nodes.len()`.
    nodes: PageBuf<Node>,
    /// Exact scores by id when the vocabulary does not fit the packed form (see
    /// [`Scores`]); `None` in the packed form.
    side: Option<Box<[f64]>>,
    /// Character codes (`1..=alphabet`).
    codes: CharCodes,
}

impl Trie {
    /// Builds the trie from `(piece, id, score)`; for a piece listed twice the later
    /// entry wins (as in HF, whose piece→id map keeps the last id).
    pub(crate) fn build(pieces: &[(&str, u32, f64)]) -> Self {
        let mut counts: HashMap<char, u64> = HashMap::new();
        for p in pieces {
            for c in p.0.chars() {
                *counts.entry(c).or_default() += 1;
            }
        }
        let codes = CharCodes::build(&counts);
        let alphabet = counts.len();
        // Room past the highest base for every code.
        let pad = alphabet + 1;
        let coded: Vec<Vec<u32>> = pieces
            .iter()
            .map(|p| p.0.chars().map(|c| codes.code(c as u32)).collect())
            .collect();
        let mut order: Vec<usize> = (0..pieces.len()).collect();
        // Stable: equal keys keep vocabulary order, so the last one is the later entry.
        order.sort_by(|&a, &b| coded[a].cmp(&coded[b]));
        let mut keys: Vec<(&[u32], u32, f64)> = Vec::with_capacity(order.len());
        for i in order {
            let p = (&coded[i][..], pieces[i].1, pieces[i].2);
            match keys.last_mut() {
                Some(last) if last.0 == p.0 => *last = p,
                _ => keys.push(p),
            }
        }
        // The packed form only if every piece fits it; else the whole id in `tag` and the
        // exact scores in a side array by id.
        let packed = keys.iter().all(|k| pack(k.1, k.2).is_some());
        // Padded from the start, so the root's `base + c` is in bounds even with no keys.
        let mut nodes: Vec<Node> = vec![EMPTY; pad];
        // `free.find(i)`: the lowest free slot >= i (slot 0, the root, is taken).
        let mut free = FreeSlots::default();
        free.take(0);
        // Work list: (node index, depth, key range).
        let mut stack: Vec<(usize, usize, usize, usize)> = vec![(0, 0, 0, keys.len())];
        let mut labels: Vec<(u32, usize, usize)> = Vec::new();
        while let Some((node, depth, mut lo, hi)) = stack.pop() {
            if lo < hi && keys[lo].0.len() == depth {
                let (id, score) = (keys[lo].1, keys[lo].2);
                let (hi, tag) = if packed {
                    pack(id, score).expect("every piece was checked to pack")
                } else {
                    (score as f32, id)
                };
                nodes[node].score = hi;
                nodes[node].tag = tag;
                nodes[node].base |= TERMINAL;
                lo += 1;
            }
            if lo == hi {
                continue;
            }
            labels.clear();
            let mut i = lo;
            while i < hi {
                let c = keys[i].0[depth];
                let mut j = i + 1;
                while j < hi && keys[j].0[depth] == c {
                    j += 1;
                }
                labels.push((c, i, j));
                i = j;
            }
            // First fit: the lowest base whose slots for all labels are free.
            let first_label = labels[0].0 as usize;
            let mut pos = free.find(first_label);
            let base = loop {
                let base = pos - first_label;
                if labels[1..]
                    .iter()
                    .all(|&(c, _, _)| free.is_free(base + c as usize))
                {
                    break base;
                }
                pos = free.find(pos + 1);
            };
            assert!(
                base + pad < PARENT as usize,
                "trie too large for 24-bit indices"
            );
            if nodes.len() < base + pad {
                nodes.resize(base + pad, EMPTY);
            }
            nodes[node].base |= base as u32;
            for &(c, _, _) in &labels {
                let slot = &mut nodes[base + c as usize].check;
                *slot = (*slot & !PARENT) | node as u32;
                nodes[node].check |= filter_bit(c);
                free.take(base + c as usize);
            }
            for &(c, l, h) in labels.iter().rev() {
                stack.push((base + c as usize, depth + 1, l, h));
            }
        }
        // Every node that ends no piece scores `-inf` (`score` in the packed form, a last
        // side entry in the other), so the lattice adds any node's score without testing
        // whether it ends a piece.
        let side = (!packed).then(|| {
            let len = keys.iter().map(|k| k.1 as usize + 1).max().unwrap_or(0);
            let mut side = vec![0.0; len + 1];
            for k in &keys {
                side[k.1 as usize] = k.2;
            }
            side[len] = f64::NEG_INFINITY;
            side.into_boxed_slice()
        });
        for n in nodes.iter_mut().filter(|n| !n.is_terminal()) {
            n.score = f32::NEG_INFINITY;
            n.tag = side.as_ref().map_or(0, |s| s.len() as u32 - 1);
        }
        let trie = Self {
            nodes: PageBuf::from_slice(&nodes),
            side,
            codes,
        };
        #[cfg(debug_assertions)]
        for k in &keys {
            debug_assert_eq!(
                trie.get_coded(k.0.iter().copied())
                    .map(|(i, s)| (i, s.to_bits())),
                Some((k.1, k.2.to_bits()))
            );
        }
        trie
    }

    /// Number of node slots (used or not).
    pub(crate) fn len(&self) -> usize {
        self.nodes.as_slice().len()
    }

    /// The pages the nodes live on.
    pub(crate) fn page_kind(&self) -> PageKind {
        self.nodes.kind()
    }

    /// The node slice (index 0 is the root).
    #[inline]
    pub(crate) fn nodes(&self) -> &[Node] {
        self.nodes.as_slice()
    }

    /// The code of code point `cp` ([`NO_CODE`] if no piece contains it).
    #[inline(always)]
    pub(crate) fn code(&self, cp: u32) -> u32 {
        self.codes.code(cp)
    }

    /// How terminal nodes hold their score and id.
    #[inline]
    pub(crate) fn scores(&self) -> Scores<'_> {
        match &self.side {
            None => Scores::Packed,
            Some(side) => Scores::Side(side),
        }
    }

    /// Id and score of exactly `key`, if it is a piece.
    pub(crate) fn get(&self, key: &str) -> Option<(u32, f64)> {
        self.get_coded(key.chars().map(|c| self.code(c as u32)))
    }

    /// Id and score of the piece whose characters have the codes `key`, if any.
    fn get_coded(&self, key: impl IntoIterator<Item = u32>) -> Option<(u32, f64)> {
        let nodes = self.nodes();
        let mut n = 0usize;
        for code in key {
            // SAFETY: `n` is the root or an index returned by `step`; every code comes
            // from this trie's map.
            n = unsafe { step(nodes, n, code) }?;
        }
        let node = &nodes[n];
        let scores = self.scores();
        node.is_terminal()
            .then(|| (scores.id(node), scores.score(node)))
    }
}

/// Free slots during construction: a union-find "next free slot" forest.
#[derive(Default)]
struct FreeSlots {
    /// `next[i] == i` when slot `i` is free, else a larger index to look at.
    next: Vec<u32>,
}

impl FreeSlots {
    fn grow(&mut self, len: usize) {
        while self.next.len() < len {
            self.next.push(self.next.len() as u32);
        }
    }

    fn is_free(&self, i: usize) -> bool {
        self.next.get(i).is_none_or(|&n| n as usize == i)
    }

    /// Lowest free slot `>= i`.
    fn find(&mut self, mut i: usize) -> usize {
        self.grow(i + 1);
        while self.next[i] as usize != i {
            let n = self.next[i] as usize;
            self.grow(n + 1);
            // Path halving.
            self.next[i] = self.next[n];
            i = n;
        }
        i
    }

    fn take(&mut self, i: usize) {
        self.grow(i + 2);
        self.next[i] = (i + 1) as u32;
    }
}

/// The child of node `n` for character code `code`, if any. The returned index is in
/// bounds.
///
/// # Safety
/// `nodes` must be a [`Trie`]'s nodes, `n < nodes.len()` (the root, 0, or an index
/// returned by `step`), and `code` a value returned by that trie's [`Trie::code`]. The
/// returned index then satisfies the same condition, and so does `base + code`, by the
/// trie invariant (every base lies at least `alphabet + 1` slots below the end).
#[inline(always)]
pub(crate) unsafe fn step(nodes: &[Node], n: usize, code: u32) -> Option<usize> {
    debug_assert!(n < nodes.len());
    // SAFETY: the caller guarantees `n < nodes.len()`.
    let parent = unsafe { nodes.get_unchecked(n) };
    if parent.check & filter_bit(code) == 0 {
        return None;
    }
    let child = (parent.base & !TERMINAL) as usize + code as usize;
    debug_assert!(child < nodes.len());
    // SAFETY: `code <= alphabet`, so `base + code < nodes.len()` by the trie invariant.
    let c = unsafe { nodes.get_unchecked(child) };
    (c.check & PARENT == n as u32).then_some(child)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn four_nodes_per_cache_line() {
        assert_eq!(std::mem::size_of::<Node>(), 16);
        assert_eq!(std::mem::align_of::<Node>(), 16);
    }

    #[test]
    fn finds_exact_pieces_and_last_duplicate_wins() {
        let pieces: Vec<(&str, u32, f64)> = vec![
            ("ab", 0, -1.0),
            ("a", 1, -2.0),
            ("abc", 2, -3.0),
            ("ab", 3, -4.0),
            ("\u{10ffff}", 4, 0.5),
            ("▁日本", 5, -1.5),
        ];
        let trie = Trie::build(&pieces);
        assert_eq!(trie.get("a"), Some((1, -2.0)));
        assert_eq!(trie.get("ab"), Some((3, -4.0)));
        assert_eq!(trie.get("abc"), Some((2, -3.0)));
        assert_eq!(trie.get("\u{10ffff}"), Some((4, 0.5)));
        assert_eq!(trie.get("▁日本"), Some((5, -1.5)));
        assert_eq!(trie.get("▁日"), None);
        assert_eq!(trie.get("b"), None);
        assert_eq!(trie.get("abcd"), None);
        assert_eq!(trie.get("x"), None);
        assert_eq!(trie.get(""), None);
        assert_eq!(trie.get("\0"), None);
    }

    #[test]
    fn codes_are_dense_and_most_frequent_first() {
        let pieces: Vec<(&str, u32, f64)> = vec![("aab", 0, -1.0), ("ba", 1, -1.0), ("é", 2, -1.0)];
        let trie = Trie::build(&pieces);
        assert_eq!(trie.code('a' as u32), 1);
        assert_eq!(trie.code('b' as u32), 2);
        assert_eq!(trie.code('é' as u32), 3);
        assert_eq!(trie.code('z' as u32), NO_CODE);
        assert_eq!(trie.code(0x11_0000), NO_CODE);
        assert_eq!(trie.code(u32::MAX), NO_CODE);
    }

    /// Walks `key` code by code; `Some(node)` when every step exists.
    fn walk(trie: &Trie, key: &str) -> Option<usize> {
        let mut n = 0;
        for c in key.chars() {
            // SAFETY: `n` is the root or came from `step`; the code from the trie's map.
            n = unsafe { step(trie.nodes(), n, trie.code(c as u32)) }?;
        }
        Some(n)
    }

    #[test]
    fn transitions_exist_exactly_for_prefixes_of_pieces() {
        // More than 8 codes, so the child filter (code % 8) has collisions to get right.
        let words = [
            "▁the",
            "▁then",
            "▁them",
            "▁日本",
            "▁日本語",
            "本",
            "abcdefghijk",
            "kjihgfedcba",
            "ab",
            "ba",
            "\u{10ffff}x",
            "x\u{10ffff}",
            "é",
            "e\u{301}",
        ];
        let pieces: Vec<(&str, u32, f64)> = words
            .iter()
            .enumerate()
            .map(|(i, w)| (*w, i as u32, -(i as f64)))
            .collect();
        let trie = Trie::build(&pieces);
        let mut prefixes = std::collections::HashSet::new();
        for w in words {
            for (i, _) in w.char_indices().chain([(w.len(), ' ')]) {
                prefixes.insert(&w[..i]);
            }
        }
        let alphabet: Vec<char> = "▁thenm日本語abcdefghijkx\u{10ffff}é\u{301}z"
            .chars()
            .collect();
        for p in &prefixes {
            assert!(walk(&trie, p).is_some(), "{p:?} is a prefix");
            for &c in &alphabet {
                let longer = format!("{p}{c}");
                let want = prefixes.contains(longer.as_str());
                assert_eq!(walk(&trie, &longer).is_some(), want, "{longer:?}");
            }
        }
        for (i, w) in words.iter().enumerate() {
            assert_eq!(trie.get(w), Some((i as u32, -(i as f64))));
        }
    }

    #[test]
    fn every_base_leaves_room_for_any_code() {
        let pieces: Vec<(&str, u32, f64)> = vec![
            ("\u{10ffff}\u{10ffff}", 0, -1.0),
            ("\0", 1, -1.0),
            ("z", 2, -1.0),
        ];
        let trie = Trie::build(&pieces);
        let nodes = trie.nodes();
        for n in nodes {
            assert!((n.base & !TERMINAL) as usize + 3 < nodes.len());
        }
    }

    /// Builds a trie and checks that every piece (the last of duplicates) comes back
    /// with its id and its score bit for bit; returns the trie.
    fn exact(pieces: &[(&str, u32, f64)]) -> Trie {
        let trie = Trie::build(pieces);
        let mut want: HashMap<&str, (u32, u64)> = HashMap::new();
        for &(p, id, score) in pieces {
            want.insert(p, (id, score.to_bits()));
        }
        for (p, w) in want {
            let got = trie.get(p).map(|(id, s)| (id, s.to_bits()));
            assert_eq!(got, Some(w), "{p:?}");
        }
        trie
    }

    #[test]
    fn packing_keeps_scores_within_an_i8_of_their_f32_exact() {
        let near = |x: f32, k: i64| f64::from_bits(((x as f64).to_bits() as i64 + k) as u64);
        assert_eq!(pack(7, -2.5), Some((-2.5, 7 << 8)));
        assert_eq!(pack(MAX_PACKED_ID, 0.0), Some((0.0, MAX_PACKED_ID << 8)));
        assert_eq!(pack(MAX_PACKED_ID + 1, 0.0), None);
        for k in [-128, -3, -1, 1, 2, 127] {
            for x in [-9.123_457_f32, -1.0, 0.75, -1e-30] {
                let (hi, tag) = pack(5, near(x, k)).unwrap();
                assert_eq!((hi, tag >> 8, tag as u8 as i8), (x, 5, k as i8));
            }
        }
        // Too far from any f32, beyond f32 range, below f32 precision.
        for s in [near(-1.0, 128), near(-1.0, -129), 0.1, -1e300, 1e-320] {
            assert_eq!(pack(5, s), None, "{s:e}");
        }
    }

    #[test]
    fn scores_near_f32s_are_packed_in_the_node() {
        let near = |x: f32, k: i64| f64::from_bits(((x as f64).to_bits() as i64 + k) as u64);
        let pieces: Vec<(&str, u32, f64)> = vec![
            ("a", 0, near(-3.25, 3)),
            ("ab", 1, near(-10.1, -2)),
            ("b", 2, near(0.5, 127)),
            ("ba", 3, -0.0),
            ("ab", 4, near(-10.1, -128)),
        ];
        let trie = exact(&pieces);
        assert!(matches!(trie.scores(), Scores::Packed));
        // The root ends no piece.
        assert_eq!(trie.scores().score(&trie.nodes()[0]), f64::NEG_INFINITY);
    }

    #[test]
    fn scores_that_do_not_pack_use_the_side_form() {
        for odd in [0.1, -1e300, near_one_ulp_off()] {
            let pieces: Vec<(&str, u32, f64)> = vec![
                ("a", 0, -3.25),
                ("ab", 1, odd),
                ("b", 2, -1.5),
                ("a", 3, -2.0),
            ];
            let trie = exact(&pieces);
            // Ids 0..=3, then the `-inf` that nodes ending no piece point at.
            assert!(matches!(trie.scores(), Scores::Side(s)
                if s.len() == 5 && s[4] == f64::NEG_INFINITY));
            // The root ends no piece.
            assert_eq!(trie.scores().score(&trie.nodes()[0]), f64::NEG_INFINITY);
        }
    }

    /// A score 129 `f64` steps above an `f32`: one more than `k` holds.
    fn near_one_ulp_off() -> f64 {
        f64::from_bits((-4.0f32 as f64).to_bits() - 129)
    }

    /// The real XLM-R vocabulary (read as HF reads it: serde_json's default float
    /// parser), whose scores are `f32`s printed with 16 digits: every one must pack.
    #[test]
    fn xlmr_vocabulary_packs_exactly() {
        let root = std::env::var_os("TRELLIS_MODELS_DIR")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|| {
                std::path::PathBuf::from(std::env::var_os("HOME").expect("HOME is set"))
                    .join(".cache/trellis/models")
            });
        let path = root.join("xlmr-tokenizer/tokenizer.json");
        let json = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("{}: {e} (run `make models`)", path.display()));
        let root: serde_json::Value = serde_json::from_str(&json).unwrap();
        let vocab: Vec<(String, f64)> = root["model"]["vocab"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| (e[0].as_str().unwrap().to_owned(), e[1].as_f64().unwrap()))
            .collect();
        assert_eq!(vocab.len(), 250_002);
        let not_f32 = vocab.iter().filter(|v| v.1 as f32 as f64 != v.1).count();
        assert!(not_f32 > 60_000, "{not_f32} scores are not f32s");
        let pieces: Vec<(&str, u32, f64)> = vocab
            .iter()
            .enumerate()
            .map(|(i, (p, s))| (p.as_str(), i as u32, *s))
            .collect();
        let trie = exact(&pieces);
        assert!(matches!(trie.scores(), Scores::Packed));
    }
}
