//! A per-scratch cache of the Unigram model's output for short pre-tokens.
//!
//! The Viterbi pass is a pure function of one pre-token's bytes (the lattice never looks
//! past the pre-token), and text repeats its words: within a document, across the documents
//! a reranker scores for many queries, across queries. A hit replaces the pre-token's trie
//! walks (one node load per character matched from every start, each a likely cache miss)
//! by one load of a 64-byte entry. HF `tokenizers` keeps a per-word cache for the same
//! reason (10,000 entries by default). On fresh multilingual text, where only about a third
//! of the words were seen before, the cache costs nothing on a miss beyond its own line: a
//! cache simulation counts 7% fewer instructions than without it and 2% more last-level
//! misses (DESIGN.md, seventh and ninth rounds).
//!
//! Layout: a direct-mapped table of `capacity` (a power of two) entries, one cache line
//! each:
//!
//! ```text
//! entry (64 bytes, align 64)
//! ┌──────────┬────────┬─────────────────────────────────┬───────┬─────────────────────┐
//! │ key_len  │ n: ids │ key: [u8; 32]                   │ 2 B   │ ids: [u32; 7]       │
//! │ 0: empty │        │ the pre-token's bytes (key_len) │ pad   │ the model's ids (n) │
//! └──────────┴────────┴─────────────────────────────────┴───────┴─────────────────────┘
//! slot(key) = the top log2(capacity) bits of a hash of the key and its length, read as
//!             (overlapping) 4- or 8-byte words: a miss costs a few dozen instructions
//! ```
//!
//! Invariants:
//! * An entry with `key_len > 0` holds exactly the ids [`Unigram::encode_piece`] returns
//!   for `key[..key_len]` *under the tokenizer [`WordCache::owner`] names*.
//! * Only pre-tokens of 1..=32 bytes with at most 7 ids are stored; longer ones (and an
//!   empty key, which marks a free slot) always miss.
//! * Calls that want offsets do not use the cache (they are not the hot path).
//! * A scratch used with another tokenizer than its cache's owner empties the cache first
//!   ([`WordCache::claim`]): entries are never shared across tokenizers.
//! * The table is allocated once, on the first claim with a non-zero capacity; after that
//!   nothing allocates (a miss overwrites its slot in place).
//!
//! [`Unigram::encode_piece`]: crate::Unigram::encode_piece

/// Longest pre-token (in bytes) an entry holds.
pub(crate) const KEY_BYTES: usize = 32;
/// Most ids an entry holds.
pub(crate) const MAX_IDS: usize = 7;
/// Entries in a scratch's cache unless the caller chooses (4 MiB). ~61k tokens of distinct
/// multilingual text have ~17k distinct words, of which a direct-mapped table of 16K
/// entries kept about a third between passes (DESIGN.md, eighth round).
pub const DEFAULT_WORD_CACHE: usize = 1 << 16;

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
const _: () = assert!(std::mem::offset_of!(Entry, ids) == 36);

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
        let h = hash(key) as u128;
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
        if e.key_len as usize == key.len() && same(&e.key, key) {
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
        e.key[..key.len()].copy_from_slice(key);
        e.ids[..ids.len()].copy_from_slice(ids);
    }
}

/// Little-endian word of `k` at `i` (8 bytes; `i + 8 <= k.len()`).
#[inline(always)]
fn word8(k: &[u8], i: usize) -> u64 {
    u64::from_le_bytes(k[i..i + 8].try_into().expect("8 bytes"))
}

/// Little-endian word of `k` at `i` (4 bytes; `i + 4 <= k.len()`).
#[inline(always)]
fn word4(k: &[u8], i: usize) -> u64 {
    u32::from_le_bytes(k[i..i + 4].try_into().expect("4 bytes")) as u64
}

/// Two words that every byte of `k` (1..=32 bytes) contributes to, read as overlapping
/// loads from both ends (for `n > 16` the middle words are mixed in).
#[inline(always)]
fn words(k: &[u8]) -> (u64, u64) {
    let n = k.len();
    match n {
        0..=3 => {
            let (a, b, c) = (k[0] as u64, k[n / 2] as u64, k[n - 1] as u64);
            (a | b << 8 | c << 16, 0)
        }
        4..=7 => (word4(k, 0), word4(k, n - 4)),
        8..=16 => (word8(k, 0), word8(k, n - 8)),
        _ => (
            word8(k, 0) ^ mix(word8(k, 8), 0xA076_1D64_78BD_642F),
            word8(k, n - 8) ^ mix(word8(k, n - 16), 0xE703_7ED1_A0B4_28DB),
        ),
    }
}

/// 64 x 64 → 128-bit product, folded.
#[inline(always)]
fn mix(a: u64, b: u64) -> u64 {
    let r = a as u128 * b as u128;
    (r as u64) ^ (r >> 64) as u64
}

/// A hash of the key and its length (keys of 1..=32 bytes).
#[inline(always)]
fn hash(k: &[u8]) -> u64 {
    let (a, b) = words(k);
    mix(
        a ^ 0x8EBC_6AF0_9C88_C6E3 ^ k.len() as u64,
        b ^ 0x5899_65CC_7537_4CC3,
    )
}

/// Whether `stored[..key.len()] == key` (`key` is 1..=32 bytes), with the same
/// overlapping loads as the hash.
#[inline(always)]
fn same(stored: &[u8; KEY_BYTES], key: &[u8]) -> bool {
    let n = key.len();
    let s = &stored[..n];
    match n {
        0..=7 => s == key,
        8..=16 => word8(s, 0) == word8(key, 0) && word8(s, n - 8) == word8(key, n - 8),
        _ => {
            word8(s, 0) == word8(key, 0)
                && word8(s, 8) == word8(key, 8)
                && word8(s, n - 16) == word8(key, n - 16)
                && word8(s, n - 8) == word8(key, n - 8)
        }
    }
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
    fn keys_differing_in_any_one_byte_are_different() {
        for n in 1..=KEY_BYTES {
            let key: Vec<u8> = (0..n as u8)
                .map(|i| i.wrapping_mul(37).wrapping_add(1))
                .collect();
            let mut stored = [0u8; KEY_BYTES];
            stored[..n].copy_from_slice(&key);
            assert!(same(&stored, &key), "{n} bytes");
            for i in 0..n {
                let mut other = key.clone();
                other[i] ^= 0x40;
                assert!(!same(&stored, &other), "{n} bytes, byte {i}");
                assert_ne!(hash(&key), hash(&other), "{n} bytes, byte {i}");
            }
        }
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
