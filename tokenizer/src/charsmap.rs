//! SentencePiece's precompiled normalization map (`precompiled_charsmap`), read the way
//! Hugging Face `tokenizers` reads it.
//!
//! The blob is `u32 trie_bytes` (little endian), then a Darts-clone double array of
//! `trie_bytes / 4` little-endian `u32` units, then the replacement strings, each ended by
//! a NUL byte. A look-up walks the double array over the input bytes and returns the
//! *first* (shortest) key that is a prefix of the input; its value is the offset of the
//! replacement string in the tail.

use crate::clusters::Clusters;
use crate::error::Error;

/// A parsed precompiled charsmap.
#[derive(Debug, Clone)]
pub(crate) struct CharsMap {
    /// Darts-clone units. Unit layout: bits 0..8 label, bit 8 has-leaf, bit 9 offset
    /// scale, bits 10.. offset; a leaf unit's low 31 bits are the value.
    units: Vec<u32>,
    /// Replacement strings, NUL-terminated, addressed by leaf values.
    replacements: Vec<u8>,
    /// For every ASCII byte: the replacement range in `replacements`, when mapped.
    ascii: [Option<(u32, u32)>; 128],
    /// Bit `cp` is set when the map has no entry for the basic-plane character `cp` on its
    /// own (the common case), so the normalizer copies it without a trie walk. Bits of
    /// surrogates and of mapped characters are clear.
    bmp_unmapped: Box<[u64; 1024]>,
    /// Which characters end the grapheme cluster they start (shared, immutable).
    clusters: &'static Clusters,
}

impl CharsMap {
    /// Parses a charsmap blob (already base64-decoded).
    pub(crate) fn parse(blob: &[u8]) -> Result<Self, Error> {
        const WHAT: &str = "normalizer.Precompiled.precompiled_charsmap";
        if blob.len() < 4 {
            return Err(Error::invalid(WHAT, "shorter than its 4-byte header"));
        }
        let trie_bytes = u32::from_le_bytes([blob[0], blob[1], blob[2], blob[3]]) as usize;
        let rest = &blob[4..];
        if trie_bytes > rest.len() || !trie_bytes.is_multiple_of(4) {
            return Err(Error::invalid(WHAT, "trie size exceeds the blob"));
        }
        let units = rest[..trie_bytes]
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect::<Vec<_>>();
        let replacements = rest[trie_bytes..].to_vec();
        if std::str::from_utf8(&replacements).is_err() {
            return Err(Error::invalid(WHAT, "replacement strings are not UTF-8"));
        }
        if units.is_empty() {
            return Err(Error::invalid(WHAT, "empty trie"));
        }
        let mut map = Self {
            units,
            replacements,
            ascii: [None; 128],
            bmp_unmapped: Box::new([0; 1024]),
            clusters: Clusters::get(),
        };
        for b in 0u8..128 {
            map.ascii[b as usize] = map.lookup_range(&[b]);
        }
        let mut buf = [0u8; 4];
        for cp in 0x80..0x1_0000u32 {
            if let Some(c) = char::from_u32(cp) {
                if map
                    .lookup_range(c.encode_utf8(&mut buf).as_bytes())
                    .is_none()
                {
                    map.bmp_unmapped[(cp >> 6) as usize] |= 1 << (cp & 63);
                }
            }
        }
        Ok(map)
    }

    /// Replacement for the shortest key that prefixes `key`, as a range of
    /// `self.replacements`.
    fn lookup_range(&self, key: &[u8]) -> Option<(u32, u32)> {
        let units = &self.units;
        let mut pos = 0usize;
        let mut unit = *units.first()?;
        pos ^= offset(unit);
        for &c in key {
            if c == 0 {
                break;
            }
            pos ^= c as usize;
            unit = *units.get(pos)?;
            if label(unit) != c as u32 {
                return None;
            }
            pos ^= offset(unit);
            if has_leaf(unit) {
                let value = (*units.get(pos)? & ((1u32 << 31) - 1)) as usize;
                let start = value.min(self.replacements.len());
                let tail = &self.replacements[start..];
                let len = tail.iter().position(|&b| b == 0).unwrap_or(tail.len());
                // HF slices a `String` here; a range that is not UTF-8 never maps.
                std::str::from_utf8(&tail[..len]).ok()?;
                return Some((start as u32, (start + len) as u32));
            }
        }
        None
    }

    /// Replacement for the shortest key that prefixes `key` (HF's `Precompiled::transform`).
    #[inline]
    pub(crate) fn lookup(&self, key: &[u8]) -> Option<&[u8]> {
        let (s, e) = if key.len() == 1 && key[0] < 128 {
            self.ascii[key[0] as usize]?
        } else {
            self.lookup_range(key)?
        };
        Some(&self.replacements[s as usize..e as usize])
    }

    /// True when `cp` is a basic-plane, non-ASCII character the map has no entry for on its
    /// own (`lookup` of its UTF-8 bytes is `None`).
    #[inline(always)]
    pub(crate) fn bmp_unmapped(&self, cp: u32) -> bool {
        cp < 0x1_0000 && self.bmp_unmapped[(cp >> 6) as usize] >> (cp & 63) & 1 == 1
    }

    /// The grapheme-cluster tables the normalizer's fast path reads.
    #[inline(always)]
    pub(crate) fn clusters(&self) -> &'static Clusters {
        self.clusters
    }

    /// True when the map rewrites the ASCII byte `b` on its own.
    #[inline]
    pub(crate) fn maps_ascii(&self, b: u8) -> bool {
        self.ascii[(b & 0x7f) as usize].is_some()
    }

    /// Replacement for an ASCII byte, from the precomputed table.
    #[inline]
    pub(crate) fn lookup_ascii(&self, b: u8) -> Option<&[u8]> {
        let (s, e) = self.ascii[(b & 0x7f) as usize]?;
        Some(&self.replacements[s as usize..e as usize])
    }
}

#[inline]
fn has_leaf(unit: u32) -> bool {
    (unit >> 8) & 1 == 1
}

#[inline]
fn label(unit: u32) -> u32 {
    unit & ((1u32 << 31) | 0xff)
}

#[inline]
fn offset(unit: u32) -> usize {
    ((unit >> 10) << ((unit & (1u32 << 9)) >> 6)) as usize
}
