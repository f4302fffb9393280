//! Normalizers, with Hugging Face `tokenizers` semantics.
//!
//! A normalizer is a list of steps run in order over one text segment (the text between
//! two added tokens). Each step reads one buffer and writes the other, except that
//! without offsets a strip, or a replacement that finds nothing, edits the current buffer
//! in place. The precompiled map skips segmentation and look-ups for characters that are
//! clusters on their own and unmapped (see `clusters`, tokenizer/DESIGN.md). When offsets
//! are requested, every step also maps each output byte to a byte range of the original
//! segment, reproducing how HF's `NormalizedString` carries alignments (including its
//! quirks), so offsets match HF's; that path segments every grapheme.

use unicode_segmentation::UnicodeSegmentation;

use crate::charsmap::CharsMap;
use crate::clusters::Clusters;

/// An alignment: the original byte range (relative to the segment) one output byte
/// came from.
pub(crate) type Align = (u32, u32);

/// What a `Replace` normalizer looks for.
#[derive(Debug, Clone)]
pub(crate) enum Pattern {
    /// A literal string.
    Literal(Box<str>),
    /// A run of at least `min` copies of one character (the regex `"c{min,}"`).
    Run { ch: char, min: usize },
}

/// One normalization step.
#[derive(Debug, Clone)]
pub(crate) enum Step {
    /// SentencePiece's precompiled map, looked up per grapheme as HF does.
    Precompiled(Box<CharsMap>),
    /// Remove leading and/or trailing whitespace (`char::is_whitespace`).
    Strip { left: bool, right: bool },
    /// Replace every non-overlapping match of `pattern` by `content`.
    Replace { pattern: Pattern, content: Box<str> },
}

/// Buffers a normalization pass writes into, owned by the caller's scratch.
#[derive(Debug, Default)]
pub(crate) struct NormBuffers {
    /// The result of the last step.
    pub(crate) cur: Vec<u8>,
    /// Alignments of `cur` (only filled when tracking).
    pub(crate) cur_align: Vec<Align>,
    next: Vec<u8>,
    next_align: Vec<Align>,
    /// True when `cur`/`next` are swapped relative to the start of the last call; undone
    /// at the start of the next call so each buffer plays the same role in every call
    /// (otherwise a buffer could meet a larger output than it grew for in warm-up).
    flipped: bool,
}

/// Runs `steps` over `text`; the normalized text ends in `bufs.cur` (and its alignments
/// in `bufs.cur_align` when `track`).
pub(crate) fn normalize(steps: &[Step], text: &str, bufs: &mut NormBuffers, track: bool) {
    if bufs.flipped {
        bufs.swap();
    }
    bufs.cur.clear();
    bufs.cur_align.clear();
    // Without alignments the first step reads `text` itself (no copy); with them, the
    // input starts as a copy carrying identity alignments.
    let mut from_text = !track && !steps.is_empty();
    if !from_text {
        bufs.cur.extend_from_slice(text.as_bytes());
    }
    if track {
        for (i, c) in text.char_indices() {
            let a = (i as u32, (i + c.len_utf8()) as u32);
            bufs.cur_align.extend(std::iter::repeat_n(a, c.len_utf8()));
        }
    }
    for step in steps {
        if !from_text && !track && in_place(step, &mut bufs.cur) {
            continue;
        }
        bufs.next.clear();
        bufs.next_align.clear();
        {
            let input = if from_text {
                text
            } else {
                // SAFETY: `cur` holds UTF-8: a copy of `text`, or the output of a step,
                // and every step writes only whole characters taken from valid UTF-8
                // (its input, its content string, or charsmap replacements validated at
                // look-up).
                unsafe { std::str::from_utf8_unchecked(&bufs.cur) }
            };
            let out = &mut bufs.next;
            let (in_align, out_align) = (&bufs.cur_align[..], &mut bufs.next_align);
            match step {
                Step::Precompiled(map) => {
                    if track {
                        precompiled_tracked(map, input, in_align, out, out_align)
                    } else {
                        precompiled(map, input, out)
                    }
                }
                Step::Strip { left, right } => {
                    strip(input, *left, *right, in_align, out, out_align, track)
                }
                Step::Replace { pattern, content } => {
                    replace(input, pattern, content, in_align, out, out_align, track)
                }
            }
        }
        from_text = false;
        bufs.swap();
    }
    // Steps done in place leave a buffer out of some calls; keep both buffers as large as
    // the larger, so whichever one a later call writes into has grown already. Exactly as
    // large: amortized growth would overshoot, and the two would outgrow each other on
    // every call.
    let cap = bufs.cur.capacity().max(bufs.next.capacity());
    for b in [&mut bufs.cur, &mut bufs.next] {
        if b.capacity() < cap {
            b.reserve_exact(cap - b.len());
        }
    }
}

/// Applies `step` to `cur` in place when that needs no second buffer — a strip (a
/// truncation and a shift), or a replacement with nothing to replace — and returns true;
/// false leaves `cur` untouched for the general path.
fn in_place(step: &Step, cur: &mut Vec<u8>) -> bool {
    match step {
        Step::Precompiled(_) => false,
        Step::Strip { left, right } => {
            // SAFETY: `cur` holds UTF-8 (see `normalize`).
            let s = unsafe { std::str::from_utf8_unchecked(cur) };
            let end = if *right {
                s.trim_end_matches(char::is_whitespace).len()
            } else {
                s.len()
            };
            let start = if *left {
                end - s[..end].trim_start_matches(char::is_whitespace).len()
            } else {
                0
            };
            cur.truncate(end);
            cur.drain(..start);
            true
        }
        Step::Replace { pattern, .. } => match pattern {
            Pattern::Literal(lit) => {
                lit.is_empty() || memchr::memmem::find(cur, lit.as_bytes()).is_none()
            }
            Pattern::Run { ch, min } => {
                let mut buf = [0u8; 4];
                find_run(cur, 0, ch.encode_utf8(&mut buf).as_bytes(), *min).is_none()
            }
        },
    }
}

/// The first run of at least `min` consecutive copies of `pat` at or after `from`, as a
/// byte range (the run extends as far as it goes).
#[inline]
fn find_run(bytes: &[u8], mut from: usize, pat: &[u8], min: usize) -> Option<(usize, usize)> {
    let at =
        |j: usize| bytes.len() >= j + pat.len() && pat.iter().zip(&bytes[j..]).all(|(a, b)| a == b);
    while let Some(k) = memchr::memchr(pat[0], &bytes[from..]) {
        let start = from + k;
        let (mut j, mut n) = (start, 0);
        while at(j) {
            j += pat.len();
            n += 1;
        }
        if n >= min.max(1) {
            return Some((start, j));
        }
        from = if n == 0 { start + 1 } else { j };
    }
    None
}

impl NormBuffers {
    fn swap(&mut self) {
        std::mem::swap(&mut self.cur, &mut self.next);
        std::mem::swap(&mut self.cur_align, &mut self.next_align);
        self.flipped = !self.flipped;
    }

    /// Cuts oversized buffers back (see `tokenizer::KEEP_BYTES`).
    pub(crate) fn trim(&mut self) {
        crate::tokenizer::trim_buffer(&mut self.cur);
        crate::tokenizer::trim_buffer(&mut self.cur_align);
        crate::tokenizer::trim_buffer(&mut self.next);
        crate::tokenizer::trim_buffer(&mut self.next_align);
    }

    /// Bytes of heap capacity held.
    pub(crate) fn bytes(&self) -> usize {
        crate::tokenizer::buffer_bytes(&self.cur)
            + crate::tokenizer::buffer_bytes(&self.cur_align)
            + crate::tokenizer::buffer_bytes(&self.next)
            + crate::tokenizer::buffer_bytes(&self.next_align)
    }
}

/// Byte length of the grapheme cluster starting at the start of `s` (non-empty, at a
/// cluster boundary).
#[inline]
fn grapheme_len(s: &str) -> usize {
    let mut chars = s.chars();
    if let Some(c) = chars.next() {
        // Fast path: a plain letter followed by a plain letter, ASCII or the end is a
        // cluster on its own (no rule joins two Grapheme_Cluster_Break=Other characters
        // when the first is not Prepend and the second not Extended_Pictographic).
        if plain(c) && chars.next().is_none_or(|n| n.is_ascii() || plain(n)) {
            return c.len_utf8();
        }
    }
    s.graphemes(true).next().map_or(s.len(), str::len)
}

/// Characters whose Grapheme_Cluster_Break is Other, that are neither Prepend nor
/// Extended_Pictographic nor Hangul jamo: common letters of many scripts, deliberately
/// leaving out every range that holds combining marks or spacing marks.
#[inline]
fn plain(c: char) -> bool {
    matches!(c as u32,
        0x00C0..=0x024F // Latin-1 letters, Latin Extended-A/B
        | 0x0386..=0x03FF // Greek
        | 0x0400..=0x0482 | 0x048A..=0x04FF // Cyrillic without combining marks
        | 0x05D0..=0x05EA // Hebrew letters
        | 0x0621..=0x064A // Arabic letters
        | 0x3001..=0x3029 // CJK punctuation without tone marks
        | 0x3041..=0x3096 // Hiragana
        | 0x30A1..=0x30FA // Katakana
        | 0x4E00..=0x9FFF // CJK unified ideographs
        | 0xAC00..=0xD7A3 // Hangul syllables (LV/LVT: break before another syllable)
        | 0xFF01..=0xFF5E // full-width ASCII forms
    )
}

/// The code point and UTF-8 length of the character starting at byte `i` of valid UTF-8.
#[inline(always)]
fn char_at(bytes: &[u8], i: usize) -> (u32, usize) {
    let b0 = bytes[i] as u32;
    if b0 < 0x80 {
        return (b0, 1);
    }
    let b = |k: usize| (bytes[i + k] & 0x3f) as u32;
    if b0 < 0xe0 {
        ((b0 & 0x1f) << 6 | b(1), 2)
    } else if b0 < 0xf0 {
        ((b0 & 0x0f) << 12 | b(1) << 6 | b(2), 3)
    } else {
        ((b0 & 0x07) << 18 | b(1) << 12 | b(2) << 6 | b(3), 4)
    }
}

/// Byte length of the cluster starting at `i` when the tables decide it: a marked character
/// followed by extending characters, then one that does not join (see `clusters`);
/// `None` leaves it to full segmentation.
#[inline]
fn cluster_len(clusters: &Clusters, bytes: &[u8], i: usize) -> Option<usize> {
    let (c, len) = char_at(bytes, i);
    if !clusters.marked(c) {
        return None;
    }
    let mut j = i + len;
    while j < bytes.len() {
        let (x, l) = char_at(bytes, j);
        if clusters.extends(x) {
            j += l;
        } else if clusters.joins(x) {
            return None;
        } else {
            break;
        }
    }
    Some(j - i)
}

/// HF's `Precompiled::normalize`: a grapheme shorter than 6 bytes is looked up whole
/// (the shortest key prefixing it replaces the *whole* grapheme); otherwise, or when the
/// whole grapheme has no entry, each character is looked up on its own.
fn precompiled(map: &CharsMap, input: &str, out: &mut Vec<u8>) {
    let clusters = map.clusters();
    let bytes = input.as_bytes();
    let n = bytes.len();
    // `bytes[copied..i]` is output as is, written in one copy when something else must
    // be written (or at the end), so unchanged text costs no per-character copy.
    let mut copied = 0;
    let mut i = 0;
    while i < n {
        // A run of ASCII the map leaves alone (CR excluded: CR LF is one cluster). ASCII
        // never joins ASCII, so only the run's last character may start a longer cluster:
        // when a joining character follows, that one goes through the general path.
        let run = bytes[i..]
            .iter()
            .take_while(|&&b| b < 0x80 && b != b'\r' && !map.maps_ascii(b))
            .count();
        if run > 0 {
            i += run;
            if i == n {
                break;
            }
            if !clusters.joins(char_at(bytes, i).0) {
                continue;
            }
            i -= 1;
        }
        // A character that is a cluster on its own (see `clusters`): looked up alone, which
        // is what HF's whole-grapheme look-up amounts to; unmapped ones stay as they are.
        let (c, len) = char_at(bytes, i);
        if clusters.left_safe(c) && (i + len == n || !clusters.joins(char_at(bytes, i + len).0)) {
            if len > 1 && map.bmp_unmapped(c) {
                i += len;
                continue;
            }
            let part = &bytes[i..i + len];
            let r = if len == 1 {
                map.lookup_ascii(part[0])
            } else {
                map.lookup(part)
            };
            if let Some(r) = r {
                out.extend_from_slice(&bytes[copied..i]);
                out.extend_from_slice(r);
                copied = i + len;
            }
            i += len;
            continue;
        }
        out.extend_from_slice(&bytes[copied..i]);
        let g_len = cluster_len(clusters, bytes, i).unwrap_or_else(|| grapheme_len(&input[i..]));
        let g = &input[i..i + g_len];
        i += g_len;
        copied = i;
        if g_len < 6 {
            if let Some(r) = map.lookup(g.as_bytes()) {
                out.extend_from_slice(r);
                continue;
            }
        }
        for (ci, c) in g.char_indices() {
            let part = &g.as_bytes()[ci..ci + c.len_utf8()];
            match map.lookup(part) {
                Some(r) => out.extend_from_slice(r),
                None => out.extend_from_slice(part),
            }
        }
    }
    out.extend_from_slice(&bytes[copied..]);
}

/// [`precompiled`] that also carries alignments, by replaying HF's transformation list
/// (`(char, change)` pairs applied by `NormalizedString::transform`).
fn precompiled_tracked(
    map: &CharsMap,
    input: &str,
    in_align: &[Align],
    out: &mut Vec<u8>,
    out_align: &mut Vec<Align>,
) {
    let mut emu = TransformReplay::new(input.as_bytes(), in_align, out_align);
    for g in input.graphemes(true) {
        if g.len() < 6 {
            if let Some(r) = map.lookup(g.as_bytes()) {
                out.extend_from_slice(r);
                emu.replace(g.chars().count(), r);
                continue;
            }
        }
        for (ci, c) in g.char_indices() {
            let part = &g.as_bytes()[ci..ci + c.len_utf8()];
            match map.lookup(part) {
                Some(r) => {
                    out.extend_from_slice(r);
                    emu.replace(1, r);
                }
                None => {
                    out.extend_from_slice(part);
                    emu.push(part.len(), 0);
                }
            }
        }
    }
    emu.finish();
}

/// Replays HF's `NormalizedString::transform(transformations, 0)` for alignments only.
///
/// HF builds the whole list first; the last entry may still be changed by the next
/// replacement (a removal is charged to the previous character), so one entry is kept
/// pending until the next arrives.
struct TransformReplay<'a> {
    old: &'a [u8],
    old_align: &'a [Align],
    /// Byte offset in `old` of the next original character to consume.
    offset: usize,
    /// `(utf8 length, change)` of the last transformation, not yet applied.
    pending: Option<(usize, i64)>,
    out_align: &'a mut Vec<Align>,
}

impl<'a> TransformReplay<'a> {
    fn new(old: &'a [u8], old_align: &'a [Align], out_align: &'a mut Vec<Align>) -> Self {
        Self {
            old,
            old_align,
            offset: 0,
            pending: None,
            out_align,
        }
    }

    /// HF's `replace(transformations, old_part, new_part)` helper of `Precompiled`.
    fn replace(&mut self, old_chars: usize, new: &[u8]) {
        // SAFETY: replacement strings are validated UTF-8 (see `CharsMap::lookup`).
        let new = unsafe { std::str::from_utf8_unchecked(new) };
        let new_count = new.chars().count() as i64;
        let diff = new_count - old_chars as i64;
        for (k, c) in new.chars().enumerate() {
            let inserted = diff > 0 && (k as i64) >= new_count - diff;
            self.push(c.len_utf8(), i64::from(inserted));
        }
        if diff < 0 {
            if let Some(p) = &mut self.pending {
                p.1 += diff;
            }
        }
    }

    fn push(&mut self, len: usize, change: i64) {
        self.flush();
        self.pending = Some((len, change));
    }

    fn consume_char(&mut self) {
        if let Some(&b) = self.old.get(self.offset) {
            self.offset += utf8_len(b);
        }
    }

    fn flush(&mut self) {
        let Some((len, change)) = self.pending.take() else {
            return;
        };
        let idx = self.offset;
        let align = if change > 0 {
            if idx < 1 {
                (0, 0)
            } else {
                self.old_align.get(idx - 1).copied().unwrap_or((0, 0))
            }
        } else {
            self.old_align.get(idx).copied().unwrap_or((0, 0))
        };
        if change <= 0 {
            self.consume_char();
        }
        for _ in 0..(-change).max(0) {
            self.consume_char();
        }
        self.out_align.extend(std::iter::repeat_n(align, len));
    }

    fn finish(mut self) {
        self.flush();
    }
}

/// Length of the UTF-8 sequence that starts with `b`.
#[inline]
pub(crate) fn utf8_len(b: u8) -> usize {
    match b {
        0x00..=0x7f => 1,
        0xc0..=0xdf => 2,
        0xe0..=0xef => 3,
        _ => 4,
    }
}

fn strip(
    input: &str,
    left: bool,
    right: bool,
    in_align: &[Align],
    out: &mut Vec<u8>,
    out_align: &mut Vec<Align>,
    track: bool,
) {
    let mut s = input;
    if left {
        s = s.trim_start_matches(char::is_whitespace);
    }
    if right {
        s = s.trim_end_matches(char::is_whitespace);
    }
    let start = s.as_ptr() as usize - input.as_ptr() as usize;
    out.extend_from_slice(s.as_bytes());
    if track {
        out_align.extend_from_slice(&in_align[start..start + s.len()]);
    }
}

fn replace(
    input: &str,
    pattern: &Pattern,
    content: &str,
    in_align: &[Align],
    out: &mut Vec<u8>,
    out_align: &mut Vec<Align>,
    track: bool,
) {
    let bytes = input.as_bytes();
    let mut last = 0;
    let mut emit = |start: usize, end: usize, out: &mut Vec<u8>, out_align: &mut Vec<Align>| {
        out.extend_from_slice(&bytes[last..start]);
        out.extend_from_slice(content.as_bytes());
        if track {
            out_align.extend_from_slice(&in_align[last..start]);
            out_align.extend(std::iter::repeat_n(in_align[end - 1], content.len()));
        }
        last = end;
    };
    match pattern {
        Pattern::Literal(lit) if !lit.is_empty() => {
            for (start, m) in input.match_indices(&**lit) {
                emit(start, start + m.len(), out, out_align);
            }
        }
        Pattern::Literal(_) => {}
        Pattern::Run { ch, min } => {
            let mut buf = [0u8; 4];
            let pat = ch.encode_utf8(&mut buf).as_bytes();
            let mut from = 0;
            while let Some((start, end)) = find_run(bytes, from, pat, *min) {
                emit(start, end, out, out_align);
                from = end;
            }
        }
    }
    out.extend_from_slice(&bytes[last..]);
    if track {
        out_align.extend_from_slice(&in_align[last..]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fast path of `grapheme_len` agrees with full segmentation at every boundary.
    #[test]
    fn grapheme_fast_path_matches_segmentation() {
        let samples = [
            "日本語のテキスト、カタカナ。한국어 문장",
            "Привет мир е\u{301}ё",
            "שלום עולם עִבְרִית",
            "مرحبا بالعالم مَرْحَبًا",
            "ｆｕｌｌ　ｗｉｄｔｈ！ｶﾞ",
            "Ελληνικά ά\u{301} àé\u{300}\u{301}",
            "\u{600}1 \u{1100}\u{ac00}\u{ac00}\u{11a8} 👨‍👩‍👧 🇫🇷🇩🇪 a\u{200d}b",
        ];
        for s in samples {
            let mut i = 0;
            for g in s.graphemes(true) {
                assert_eq!(grapheme_len(&s[i..]), g.len(), "at {i} in {s:?}");
                i += g.len();
            }
        }
    }
}
