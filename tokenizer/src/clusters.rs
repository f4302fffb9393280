//! Which basic-plane characters end a grapheme cluster on their own: two bit tables
//! derived once from `unicode-segmentation` itself (the segmenter HF uses), so the
//! normalizer can skip segmentation for nearly every character of real text.
//!
//! A cluster boundary between `c` and the next character `n` depends on the classes of
//! `c` and `n` (UAX #29) and, for a few rules, on characters before `c`: GB9c needs `c` to
//! be an Indic linker or extender, GB11 needs `c` to be a ZWJ, GB12/13 need `c` to be a
//! regional indicator. When `c` *starts* a cluster, as it does wherever the normalizer
//! looks, none of that context can join `c` to `n` unless the pair `c n` alone would be
//! joined. So:
//!
//! ```text
//! joins(n)     = "a" n is one cluster          (n is Extend, ZWJ or SpacingMark: GB9, GB9a)
//! left_safe(c) = c r is two clusters for one r of every other class that a rule can join
//!                on the right (LF, L, V, T, LV, LVT, RI, Extended_Pictographic, an InCB
//!                consonant, a plain letter for GB9b, a control)
//! c starting a cluster is a cluster on its own  ⇐  left_safe(c) and (n is last, or !joins(n))
//! extends(x)   = joins(x), x is not ZWJ, and "क x क" is two or more clusters (x is no
//!                GB9c linker)
//! marked(c)    = left_safe(c) and "c ◌̀" is one cluster (c is no control: GB4 breaks
//!                after a control even before a mark)
//! c x₁ … xₖ is one whole cluster  ⇐  marked(c), every xᵢ extends, and the next
//!                character (if any) does not join
//! ```
//!
//! The last rule holds because after `c x₁ … xₖ` only GB9/GB9a (a joining character),
//! GB9c (needs a linker among the `xᵢ`) or GB11 (needs a ZWJ among them) could join more.
//!
//! Both tables cover U+0000..U+FFFF (8 KiB each); other characters take the general path.

use std::sync::OnceLock;

use unicode_segmentation::UnicodeSegmentation;

/// One representative of every class that some rule joins to a preceding character,
/// other than those `joins` covers: LF (GB3), L/V/T/LV/LVT jamo and syllables (GB6–8), a
/// regional indicator (GB12/13), an extended pictographic (GB11), an InCB consonant
/// (GB9c), a letter (GB9b after Prepend) and a control (GB4/5).
const RIGHT_REPS: &[char] = &[
    '\n',
    '\u{1100}',
    '\u{1160}',
    '\u{11A8}',
    '\u{AC00}',
    '\u{AC01}',
    '\u{1F1E6}',
    '\u{1F600}',
    '\u{0915}',
    'a',
    '\u{0001}',
    '\r',
];

/// The two bit tables (bit `cp` of each; basic plane only).
#[derive(Debug)]
pub(crate) struct Clusters {
    /// Set when a cluster starting with `cp` ends after it unless the next character joins.
    left_safe: Box<[u64; 1024]>,
    /// Set when `cp` joins any preceding character (Extend, ZWJ, SpacingMark).
    joins: Box<[u64; 1024]>,
    /// Set when `cp` joins, is not ZWJ and is no GB9c linker.
    extends: Box<[u64; 1024]>,
    /// Set when `cp` is left-safe and takes the marks that follow it (no control).
    marked: Box<[u64; 1024]>,
}

impl Clusters {
    fn build() -> Self {
        let mut left_safe = Box::new([0u64; 1024]);
        let mut joins = Box::new([0u64; 1024]);
        let mut extends = Box::new([0u64; 1024]);
        let mut marked = Box::new([0u64; 1024]);
        let mut s = String::with_capacity(16);
        for cp in 0..0x1_0000u32 {
            let Some(c) = char::from_u32(cp) else {
                continue;
            };
            let bit = 1u64 << (cp & 63);
            s.clear();
            s.push('a');
            s.push(c);
            if s.graphemes(true).count() == 1 {
                joins[(cp >> 6) as usize] |= bit;
                s.clear();
                s.push('\u{0915}');
                s.push(c);
                s.push('\u{0915}');
                if c != '\u{200D}' && s.graphemes(true).count() >= 2 {
                    extends[(cp >> 6) as usize] |= bit;
                }
            }
            let safe = RIGHT_REPS.iter().all(|&r| {
                s.clear();
                s.push(c);
                s.push(r);
                s.graphemes(true).count() == 2
            });
            if safe {
                left_safe[(cp >> 6) as usize] |= bit;
                s.clear();
                s.push(c);
                s.push('\u{300}');
                if s.graphemes(true).count() == 1 {
                    marked[(cp >> 6) as usize] |= bit;
                }
            }
        }
        Self {
            left_safe,
            joins,
            extends,
            marked,
        }
    }

    /// The process-wide tables (built on first use, about 10 ms; immutable after).
    pub(crate) fn get() -> &'static Self {
        static TABLES: OnceLock<Clusters> = OnceLock::new();
        TABLES.get_or_init(Self::build)
    }

    /// True when `c` is a basic-plane character that ends a cluster it starts unless the
    /// next character [`joins`](Self::joins).
    #[inline(always)]
    pub(crate) fn left_safe(&self, c: u32) -> bool {
        c < 0x1_0000 && self.left_safe[(c >> 6) as usize] >> (c & 63) & 1 == 1
    }

    /// True when `c` is [left-safe](Self::left_safe) and no control: a cluster it starts
    /// takes the [extending](Self::extends) characters that follow.
    #[inline(always)]
    pub(crate) fn marked(&self, c: u32) -> bool {
        c < 0x1_0000 && self.marked[(c >> 6) as usize] >> (c & 63) & 1 == 1
    }

    /// True when `c` is a basic-plane character that joins the character before it, is
    /// not ZWJ and is no GB9c linker.
    #[inline(always)]
    pub(crate) fn extends(&self, c: u32) -> bool {
        c < 0x1_0000 && self.extends[(c >> 6) as usize] >> (c & 63) & 1 == 1
    }

    /// True when `c` may join the character before it (and for every character outside
    /// the basic plane, which the tables do not cover).
    #[inline(always)]
    pub(crate) fn joins(&self, c: u32) -> bool {
        c >= 0x1_0000 || self.joins[(c >> 6) as usize] >> (c & 63) & 1 == 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every pair `c n` the tables call a boundary is one by full segmentation, over a
    /// sample of every basic-plane block (and the classes are not empty).
    #[test]
    fn table_boundaries_agree_with_segmentation() {
        let t = Clusters::get();
        let mut safe = 0;
        let mut joining = 0;
        let nexts: Vec<char> = (0..0x1_0000u32)
            .step_by(37)
            .filter_map(char::from_u32)
            .chain(RIGHT_REPS.iter().copied())
            .chain(['\u{300}', '\u{200D}', '\u{903}', '\u{94D}', '\u{1F3FD}'])
            .collect();
        let mut s = String::new();
        for cp in (0..0x1_0000u32).step_by(7) {
            let Some(c) = char::from_u32(cp) else {
                continue;
            };
            if !t.left_safe(cp) {
                continue;
            }
            safe += 1;
            for &n in &nexts {
                if t.joins(n as u32) {
                    joining += 1;
                    continue;
                }
                s.clear();
                s.push(c);
                s.push(n);
                assert_eq!(s.graphemes(true).count(), 2, "{c:?} {n:?}");
            }
        }
        assert!(safe > 5_000 && joining > 0);
        // A safe character, then extenders, then a non-joining character: the first two
        // parts make one cluster, the last starts another.
        let ext: Vec<char> = (0..0x1_0000u32)
            .filter(|&cp| t.extends(cp))
            .step_by(11)
            .filter_map(char::from_u32)
            .collect();
        assert!(ext.len() > 50);
        for (k, cp) in (0..0x1_0000u32).step_by(101).enumerate() {
            let Some(c) = char::from_u32(cp) else {
                continue;
            };
            if !t.marked(cp) {
                continue;
            }
            let x1 = ext[k % ext.len()];
            let x2 = ext[(k * 7 + 3) % ext.len()];
            for &n in &nexts {
                if t.joins(n as u32) {
                    continue;
                }
                s.clear();
                s.extend([c, x1, x2, n]);
                let g: Vec<&str> = s.graphemes(true).collect();
                assert_eq!(g.len(), 2, "{c:?} {x1:?} {x2:?} {n:?}");
                assert_eq!(g[1].chars().next(), Some(n));
            }
        }
        for c in ['\u{200D}', '\u{94D}', '\u{9CD}'] {
            assert!(t.joins(c as u32) && !t.extends(c as u32), "{c:?}");
        }
        for c in ['\u{300}', '\u{93E}', '\u{93C}'] {
            assert!(t.extends(c as u32), "{c:?}");
        }
        for c in ['\0', '\u{1}', '\n', '\u{85}', '\u{200B}'] {
            assert!(!t.marked(c as u32), "{c:?}");
        }
        assert!(t.marked('a' as u32) && t.marked('\u{915}' as u32));
        for c in ['\r', '\u{600}', '\u{1100}', '\u{AC00}', '\u{1F1E6}'] {
            assert!(!t.left_safe(c as u32), "{c:?}");
        }
        for c in ['\u{300}', '\u{200D}', '\u{903}', '\u{94D}'] {
            assert!(t.joins(c as u32), "{c:?}");
        }
        for c in ['a', ' ', '\u{0915}', 'я', '中'] {
            assert!(t.left_safe(c as u32) && !t.joins(c as u32), "{c:?}");
        }
    }
}
