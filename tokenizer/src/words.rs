//! A per-scratch cache of the Unigram model's output for short pre-tokens.
//!
//! The Viterbi pass is a pure function of one pre-token's bytes (the lattice never looks
//! past the pre-token), and running text repeats its words: in the benchmark's multilingual
//! corpus most pre-tokens of a fresh text are words some earlier text used. A hit replaces
//! the pre-token's trie walks (one node load per character matched from every start,
//! each a likely cache miss) by one load of a 64-byte entry. HF `tokenizers` keeps a
//! per-word cache for the same reason (10,000 entries by default).
//!
//! Layout: a direct-mapped table of `capacity` (a power of two) entries, one cache line
//! each:
//!
//! ```text
//! entry (64 bytes, align 64)
//! ┌──────────┬────────┬─────────────────────────────────┬─────────────────────┐
//! │ key_len  │ n: ids │ key: [u8; 34]                   │ ids: [u32; 7]       │
//! │ 0: empty │        │ the pre-token's bytes, 0-padded │ the model's ids     │
//! └──────────┴────────┴─────────────────────────────────┴─────────────────────┘
//! slot(key) = the top log2(capacity) bits of a multiplicative hash of the key and its length
//! ```
//!
//! Invariants:
//! * An entry with `key_len > 0` holds exactly the ids [`Unigram::encode_piece`] returns
//!   for `key[..key_len]` *under the tokenizer [`WordCache::owner`] names*.
//! * Only pre-tokens of 1..=34 bytes with at most 7 ids are stored; longer ones (and an
//!   empty key, which marks a free slot) always miss.
//! * Calls that want offsets do not use the cache (they are not the hot path).
//! * A scratch used with another tokenizer than its cache's owner empties the cache first
//!   ([`WordCache::claim`]): entries are never shared across tokenizers.
//! * The table is allocated once, on the first claim with a non-zero capacity; after that
//!   nothing allocates (a miss overwrites its slot in place).
//!
//! [`Unigram::encode_piece`]: crate::Unigram::encode_piece

/// Longest pre-token (in bytes) an entry holds.
pub(crate) const KEY_BYTES: usize = 34;
/// Most ids an entry holds.
pub(crate) const MAX_IDS: usize = 7;
/// Entries in a scratch's cache unless the caller chooses (1 MiB).
pub const DEFAULT_WORD_CACHE: usize = 1 << 14;

/// One cached pre-token; see the module docs for the layout.
#[derive(Debug, Clone, Copy)]
#[repr(C, align(64))]
pub(crate) struct Entry {
    key_len: u8,
    n: u8,
    key: [u8; KEY_BYTES],
    ids: [u32; MAX_IDS],
}

const EMPTY: Entry = Entry {
    key_len: 0,
    n: 0,
    key: [0; KEY_BYTES],
    ids: [0; MAX_IDS],
};

const _: () = assert!(std::mem::size_of::<Entry>() == 64);

impl Entry {
    /// The cached ids.
    #[inline]
    pub(crate) fn ids(&self) -> &[u32] {
        &self.ids[..self.n as usize]
    }
}

/// Where a pre-token lives in the cache, if it can.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Probe {
    /// The entry at this slot holds the pre-token.
    Hit(usize),
    /// Not cached; a result may be stored at this slot.
    Miss(usize),
    /// Too long to cache, or the cache is off.
    Bypass,
}

/// The cache itself: see the module docs.
#[derive(Debug)]
pub(crate) struct WordCache {
    /// The tokenizer (its [`crate::Tokenizer`] uid) whose results the entries hold; 0: none.
    owner: u64,
    /// Entries wanted; 0 turns the cache off.
    capacity: usize,
    /// `capacity` entries once claimed, empty before.
    entries: Vec<Entry>,
}

impl Default for WordCache {
    fn default() -> Self {
        Self::with_capacity(DEFAULT_WORD_CACHE)
    }
}

impl WordCache {
    /// A cache of `capacity` entries (rounded up to a power of two; 0: off), allocated
    /// on first use.
    pub(crate) fn with_capacity(capacity: usize) -> Self {
        let capacity = if capacity == 0 {
            0
        } else {
            capacity.next_power_of_two()
        };
        Self {
            owner: 0,
            capacity,
            entries: Vec::new(),
        }
    }

    /// Number of entries (0: off).
    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    /// Makes the cache hold `owner`'s results: allocates the table on first use, and
    /// empties it when it held another tokenizer's.
    #[inline]
    pub(crate) fn claim(&mut self, owner: u64) {
        if self.owner == owner || self.capacity == 0 {
            return;
        }
        if self.entries.is_empty() {
            self.entries = vec![EMPTY; self.capacity];
        } else {
            self.entries.fill(EMPTY);
        }
        self.owner = owner;
    }

    /// The slot `key` maps to, or `None` when it cannot be cached (too long, empty, or
    /// the cache is off). Call [`Self::claim`] first.
    #[inline]
    pub(crate) fn slot(&self, key: &[u8]) -> Option<usize> {
        if key.is_empty() || key.len() > KEY_BYTES || self.entries.is_empty() {
            return None;
        }
        // The hash's top bits: `h * len / 2^64 < len`.
        let h = hash(&pad(key), key.len()) as u128;
        Some(((h * self.entries.len() as u128) >> 64) as usize)
    }

    /// Starts loading the entry at `slot` (from [`Self::slot`]) into the cache, so that
    /// probing it after the previous pre-token's Viterbi pass does not wait on memory.
    #[inline(always)]
    pub(crate) fn prefetch(&self, slot: usize) {
        #[cfg(target_arch = "x86_64")]
        {
            let p = self.entries[slot..].as_ptr() as *const i8;
            // SAFETY: a prefetch is a hint with no architectural effect; `p` points into
            // `entries` (the slice index above is bounds-checked).
            unsafe { core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(p) };
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = slot;
    }

    /// Looks `key` up: a hit, a miss at the slot a result may be stored in, or a bypass.
    /// `slot` must be [`Self::slot`]`(key)`.
    #[inline]
    pub(crate) fn probe_at(&self, slot: Option<usize>, key: &[u8]) -> Probe {
        let Some(slot) = slot else {
            return Probe::Bypass;
        };
        let e = &self.entries[slot];
        if e.key_len as usize == key.len() && e.key == pad(key) {
            Probe::Hit(slot)
        } else {
            Probe::Miss(slot)
        }
    }

    /// Looks `key` up (see [`Self::probe_at`]).
    #[cfg(test)]
    pub(crate) fn probe(&self, key: &[u8]) -> Probe {
        self.probe_at(self.slot(key), key)
    }

    /// The entry at a slot [`Self::probe`] reported as a hit.
    #[inline]
    pub(crate) fn entry(&self, slot: usize) -> &Entry {
        &self.entries[slot]
    }

    /// Stores the model's ids for `key` at `slot` (from a [`Probe::Miss`] for `key`).
    /// Results with more than [`MAX_IDS`] ids are not stored.
    pub(crate) fn store(&mut self, slot: usize, key: &[u8], ids: &[u32]) {
        if ids.len() > MAX_IDS || key.is_empty() || key.len() > KEY_BYTES {
            return;
        }
        let e = &mut self.entries[slot];
        e.key_len = key.len() as u8;
        e.n = ids.len() as u8;
        e.key = pad(key);
        e.ids[..ids.len()].copy_from_slice(ids);
    }
}

/// `key` zero-padded to an entry's key field (`key.len() <= KEY_BYTES`).
#[inline(always)]
fn pad(key: &[u8]) -> [u8; KEY_BYTES] {
    let mut k = [0u8; KEY_BYTES];
    k[..key.len()].copy_from_slice(key);
    k
}

/// A multiplicative hash of the padded key and its length (the length tells apart keys
/// that differ only in trailing zero bytes).
#[inline(always)]
fn hash(k: &[u8; KEY_BYTES], len: usize) -> u64 {
    const M: u64 = 0x9E37_79B9_7F4A_7C15;
    let word = |i: usize| {
        let mut w = [0u8; 8];
        let end = (i + 8).min(KEY_BYTES);
        w[..end - i].copy_from_slice(&k[i..end]);
        u64::from_le_bytes(w)
    };
    let mut h = (len as u64).wrapping_mul(M);
    for i in [0, 8, 16, 24, 32] {
        h = (h ^ word(i)).wrapping_mul(M).rotate_left(29);
    }
    h.wrapping_mul(M)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stores_and_finds_a_word() {
        let mut c = WordCache::with_capacity(8);
        c.claim(1);
        let Probe::Miss(slot) = c.probe(b"\xe2\x96\x81hello") else {
            panic!("an empty cache must miss")
        };
        c.store(slot, b"\xe2\x96\x81hello", &[7, 9]);
        let Probe::Hit(s) = c.probe(b"\xe2\x96\x81hello") else {
            panic!("a stored word must hit")
        };
        assert_eq!(c.entry(s).ids(), &[7, 9]);
        // A prefix (same padded bytes but for the length) is another key.
        assert!(!matches!(c.probe(b"\xe2\x96\x81hell"), Probe::Hit(_)));
    }

    #[test]
    fn long_keys_and_long_results_bypass() {
        let mut c = WordCache::with_capacity(8);
        c.claim(1);
        assert_eq!(c.probe(&[b'a'; KEY_BYTES + 1]), Probe::Bypass);
        assert_eq!(c.probe(b""), Probe::Bypass);
        let Probe::Miss(slot) = c.probe(b"abcdefgh") else {
            panic!()
        };
        let ids: Vec<u32> = (0..8).collect();
        c.store(slot, b"abcdefgh", &ids);
        assert!(matches!(c.probe(b"abcdefgh"), Probe::Miss(_)));
    }

    #[test]
    fn another_owner_empties_the_cache() {
        let mut c = WordCache::with_capacity(4);
        c.claim(1);
        let Probe::Miss(slot) = c.probe(b"word") else {
            panic!()
        };
        c.store(slot, b"word", &[3]);
        assert!(matches!(c.probe(b"word"), Probe::Hit(_)));
        c.claim(1);
        assert!(matches!(c.probe(b"word"), Probe::Hit(_)));
        c.claim(2);
        assert!(matches!(c.probe(b"word"), Probe::Miss(_)));
    }

    #[test]
    fn capacity_zero_is_off_and_never_allocates() {
        let mut c = WordCache::with_capacity(0);
        c.claim(1);
        assert_eq!(c.capacity(), 0);
        assert_eq!(c.probe(b"word"), Probe::Bypass);
        assert!(c.entries.is_empty());
    }

    #[test]
    fn capacity_rounds_up_to_a_power_of_two() {
        assert_eq!(WordCache::with_capacity(1000).capacity(), 1024);
        assert_eq!(WordCache::with_capacity(1).capacity(), 1);
        let mut c = WordCache::with_capacity(1);
        c.claim(1);
        // One slot: every key maps to it.
        assert_eq!(c.probe(b"a"), Probe::Miss(0));
        assert_eq!(c.probe(b"zzzz"), Probe::Miss(0));
    }
}
