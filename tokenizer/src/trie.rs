//! The vocabulary trie: a double array whose check array is replaced by a 256-bit child
//! bitmap, one 64-byte cache line per node.
//!
//! Node `n`'s child for byte `b` exists when bit `b` of `n.bitmap` is set, and then lives
//! at index `n.base + b`. Construction places each node's children so that those slots
//! are free (first fit), and guarantees `base + b < nodes.len()` for every set bit, which
//! is what makes the unchecked indexing in [`Trie::step`] sound. A node that ends a
//! vocabulary piece stores that piece's id and score, so the Viterbi loop never builds a
//! string or hashes one.

use crate::pages::{PageBuf, PageKind};

/// Id stored in nodes that end no piece.
pub(crate) const NO_ID: u32 = u32::MAX;

/// One trie node, exactly one cache line.
#[derive(Debug, Clone, Copy)]
#[repr(C, align(64))]
pub(crate) struct Node {
    /// Bit `b` set: a child for byte `b` exists at `base + b`.
    pub(crate) bitmap: [u64; 4],
    /// Score of the piece ending here (meaningless when `id == NO_ID`).
    pub(crate) score: f64,
    /// Offset of this node's children: the child for byte `b` lives at `base + b`.
    pub(crate) base: u32,
    /// Id of the piece ending here, or [`NO_ID`].
    pub(crate) id: u32,
}

const EMPTY: Node = Node {
    bitmap: [0; 4],
    score: 0.0,
    base: 0,
    id: NO_ID,
};

/// A finished trie.
#[derive(Debug)]
pub(crate) struct Trie {
    /// Nodes; index 0 is the root. Invariant: for every node `n` and every set bit `b`
    /// of `n.bitmap`, `n.base as usize + b < nodes.len()`.
    nodes: PageBuf<Node>,
}

impl Trie {
    /// Builds the trie from `(piece, id, score)`; for a piece listed twice the later
    /// entry wins (as in HF, whose piece→id map keeps the last id).
    pub(crate) fn build(pieces: &[(&[u8], u32, f64)]) -> Self {
        let mut order: Vec<usize> = (0..pieces.len()).collect();
        // Stable: equal keys keep vocabulary order, so the last one is the later entry.
        order.sort_by(|&a, &b| pieces[a].0.cmp(pieces[b].0));
        let mut keys: Vec<(&[u8], u32, f64)> = Vec::with_capacity(order.len());
        for i in order {
            let p = pieces[i];
            match keys.last_mut() {
                Some(last) if last.0 == p.0 => *last = p,
                _ => keys.push(p),
            }
        }
        let mut nodes: Vec<Node> = vec![EMPTY];
        // `free.find(i)`: the lowest free slot >= i (slot 0, the root, is taken).
        let mut free = FreeSlots::default();
        free.take(0);
        // Work list: (node index, depth, key range).
        let mut stack: Vec<(usize, usize, usize, usize)> = vec![(0, 0, 0, keys.len())];
        let mut labels: Vec<(u8, usize, usize)> = Vec::new();
        while let Some((node, depth, mut lo, hi)) = stack.pop() {
            if lo < hi && keys[lo].0.len() == depth {
                nodes[node].id = keys[lo].1;
                nodes[node].score = keys[lo].2;
                lo += 1;
            }
            if lo == hi {
                continue;
            }
            labels.clear();
            let mut i = lo;
            while i < hi {
                let b = keys[i].0[depth];
                let mut j = i + 1;
                while j < hi && keys[j].0[depth] == b {
                    j += 1;
                }
                labels.push((b, i, j));
                i = j;
            }
            // First fit: the lowest base whose slots for all labels are free.
            let first_label = labels[0].0 as usize;
            let mut pos = free.find(first_label);
            let base = loop {
                let base = pos - first_label;
                if labels[1..]
                    .iter()
                    .all(|&(b, _, _)| free.is_free(base + b as usize))
                {
                    break base;
                }
                pos = free.find(pos + 1);
            };
            let top = base + labels.last().map_or(0, |l| l.0 as usize) + 1;
            if nodes.len() < top {
                nodes.resize(top, EMPTY);
            }
            nodes[node].base = base as u32;
            for &(b, _, _) in &labels {
                nodes[node].bitmap[(b >> 6) as usize] |= 1u64 << (b & 63);
                free.take(base + b as usize);
            }
            for &(b, l, h) in labels.iter().rev() {
                stack.push((base + b as usize, depth + 1, l, h));
            }
        }
        Self {
            nodes: PageBuf::from_slice(&nodes),
        }
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

    /// Id and score of exactly `key`, if it is a piece.
    pub(crate) fn get(&self, key: &[u8]) -> Option<(u32, f64)> {
        let nodes = self.nodes();
        let mut n = 0usize;
        for &b in key {
            // SAFETY: `n` is the root or an index returned by `step`.
            n = unsafe { step(nodes, n, b) }?;
        }
        let node = &nodes[n];
        (node.id != NO_ID).then_some((node.id, node.score))
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

/// The child of node `n` for byte `b`, if any. The returned index is in bounds.
///
/// # Safety
/// `nodes` must be a [`Trie`]'s nodes and `n < nodes.len()` (the root, 0, or an index
/// returned by `step`). The returned index then satisfies the same condition, by the
/// trie invariant (a set bitmap bit `b` implies `base + b < nodes.len()`).
#[inline(always)]
pub(crate) unsafe fn step(nodes: &[Node], n: usize, b: u8) -> Option<usize> {
    debug_assert!(n < nodes.len());
    // SAFETY: the caller guarantees `n < nodes.len()`.
    let node = unsafe { nodes.get_unchecked(n) };
    if (node.bitmap[(b >> 6) as usize] >> (b & 63)) & 1 == 0 {
        return None;
    }
    let child = node.base as usize + b as usize;
    debug_assert!(child < nodes.len());
    Some(child)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_is_one_cache_line() {
        assert_eq!(std::mem::size_of::<Node>(), 64);
        assert_eq!(std::mem::align_of::<Node>(), 64);
    }

    #[test]
    fn finds_exact_pieces_and_last_duplicate_wins() {
        let pieces: Vec<(&[u8], u32, f64)> = vec![
            (b"ab", 0, -1.0),
            (b"a", 1, -2.0),
            (b"abc", 2, -3.0),
            (b"ab", 3, -4.0),
            (b"\xff", 4, 0.5),
        ];
        let trie = Trie::build(&pieces);
        assert_eq!(trie.get(b"a"), Some((1, -2.0)));
        assert_eq!(trie.get(b"ab"), Some((3, -4.0)));
        assert_eq!(trie.get(b"abc"), Some((2, -3.0)));
        assert_eq!(trie.get(b"\xff"), Some((4, 0.5)));
        assert_eq!(trie.get(b"b"), None);
        assert_eq!(trie.get(b"abcd"), None);
        assert_eq!(trie.get(b""), None);
    }
}
