//! The whole pipeline: added tokens → normalizer → pre-tokenizer → Unigram → template.

use crate::added::{AddedToken, Matcher, Split};
use crate::error::Error;
use crate::load::{Metaspace, PreTokenizer, Prepend, Spec, TemplateItem};
use crate::normalizer::{normalize, Align, NormBuffers, Step};
use crate::unigram::{Unigram, ViterbiScratch};
use crate::words::{Probe, WordCache};
use crate::PageKind;

/// Source of [`Tokenizer::uid`]s: every tokenizer built in this process gets its own.
static NEXT_UID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// The Viterbi scratch is sized for pieces as long as the pre-tokenized text, up to this
/// many bytes (~150 KiB of lattice), before the first piece: so a later text no longer than
/// one already seen never allocates because one of its words is longer than any before.
const VITERBI_RESERVE: usize = 4096;

/// After a call, a scratch buffer whose capacity exceeds this many bytes is cut back to
/// it (see [`Scratch::trim`]): one oversized input must not keep its memory for the life of
/// the scratch (an 8 MB word used to leave ~270 MB behind: lattice cells, characters and
/// backtrack path, normalizer and pre-token buffers, ids). Texts whose buffers fit (up to
/// about half a MiB of text, words up to ~30k characters) still allocate nothing once the
/// scratch has grown.
pub(crate) const KEEP_BYTES: usize = 1 << 20;

/// Cuts `v` back to [`KEEP_BYTES`] of capacity when it holds more; its contents are
/// dropped then (scratch buffers carry nothing from one call to the next).
#[inline]
pub(crate) fn trim_buffer<T>(v: &mut Vec<T>) {
    let keep = KEEP_BYTES / std::mem::size_of::<T>().max(1);
    if v.capacity() > keep {
        v.clear();
        v.shrink_to(keep);
    }
}

/// Bytes of heap capacity `v` holds.
pub(crate) fn buffer_bytes<T>(v: &Vec<T>) -> usize {
    v.capacity() * std::mem::size_of::<T>()
}

/// How [`Tokenizer::encode_pair_into`] cuts a pair (the default: not at all).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PairLimits {
    /// Ids in all, template tokens included, reached the way HF's default `longest_first`
    /// strategy does ([`longest_first`]): the longer sequence gives up tokens first, and
    /// when both are over half the room the shorter keeps half of it.
    pub max_length: Option<usize>,
    /// Tokens of the second sequence's own, cut to before `max_length` applies.
    pub max_second: Option<usize>,
    /// Cut sequences at their start, keeping their end (HF's `direction="left"`).
    pub left: bool,
}

/// A loaded tokenizer: immutable, shared freely across threads.
///
/// All per-call working memory lives in a [`Scratch`] the caller owns and reuses, so
/// encoding allocates nothing once the scratch has grown to the input sizes it sees.
#[derive(Debug)]
pub struct Tokenizer {
    model: Unigram,
    added: Vec<AddedToken>,
    /// Added tokens matched on the raw text (`normalized: false`).
    raw_matcher: Matcher,
    /// Added tokens matched on normalized text (`normalized: true`).
    norm_matcher: Matcher,
    normalizer: Vec<Step>,
    pre: PreTokenizer,
    single: Vec<TemplateItem>,
    pair: Vec<TemplateItem>,
    decoder: Option<Metaspace>,
    vocab_size: usize,
    /// Names this tokenizer to the word caches of the scratches it uses (never 0).
    uid: u64,
}

/// Caller-owned working memory for [`Tokenizer`] calls; reuse one per thread.
#[derive(Debug, Default)]
pub struct Scratch {
    splits: Vec<Split>,
    norm_splits: Vec<Split>,
    norm: NormBuffers,
    pre: Vec<u8>,
    pre_align: Vec<Align>,
    pieces: Vec<(u32, u32)>,
    viterbi: ViterbiScratch,
    piece_offsets: Vec<(u32, u32)>,
    first: Vec<u32>,
    second: Vec<u32>,
    words: WordCache,
}

impl Scratch {
    /// An empty scratch; it grows on first use, its word cache (see
    /// [`Scratch::with_word_cache`]) to [`DEFAULT_WORD_CACHE`](crate::DEFAULT_WORD_CACHE)
    /// entries.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty scratch whose word cache holds `entries` pre-tokens (rounded up to a power
    /// of two, 64 bytes each; 0 turns it off). The cache keeps the model's ids for short
    /// pre-tokens (up to 32 bytes and 7 ids), so a word seen before skips the Viterbi
    /// pass; it is allocated on first use and emptied when the scratch moves to another
    /// tokenizer. Output is identical with any size.
    pub fn with_word_cache(entries: usize) -> Self {
        Self {
            words: WordCache::with_capacity(entries),
            ..Self::default()
        }
    }

    /// Entries in this scratch's word cache (0: off).
    pub fn word_cache_entries(&self) -> usize {
        self.words.capacity()
    }

    /// Gives back what an oversized input made the buffers grow past [`KEEP_BYTES`] each;
    /// called at the end of every encode (a few capacity compares when nothing is over).
    fn trim(&mut self) {
        trim_buffer(&mut self.splits);
        trim_buffer(&mut self.norm_splits);
        self.norm.trim();
        trim_buffer(&mut self.pre);
        trim_buffer(&mut self.pre_align);
        trim_buffer(&mut self.pieces);
        self.viterbi.trim();
        trim_buffer(&mut self.piece_offsets);
        trim_buffer(&mut self.first);
        trim_buffer(&mut self.second);
    }

    /// Bytes of heap capacity held by the growable buffers (the fixed-size word cache
    /// left out). For tests that check a scratch does not stay large.
    #[doc(hidden)]
    pub fn buffer_bytes(&self) -> usize {
        buffer_bytes(&self.splits)
            + buffer_bytes(&self.norm_splits)
            + self.norm.bytes()
            + buffer_bytes(&self.pre)
            + buffer_bytes(&self.pre_align)
            + buffer_bytes(&self.pieces)
            + self.viterbi.bytes()
            + buffer_bytes(&self.piece_offsets)
            + buffer_bytes(&self.first)
            + buffer_bytes(&self.second)
    }

    /// The most [`Scratch::buffer_bytes`] can be after an encode call returns.
    #[doc(hidden)]
    pub const MAX_KEPT_BYTES: usize = 15 * KEEP_BYTES;
}

/// Token ids with byte offsets into the original text (`(0, 0)` for template tokens).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Encoding {
    /// Token ids.
    pub ids: Vec<u32>,
    /// Byte range of each token in the input text.
    pub offsets: Vec<(usize, usize)>,
}

/// Output sinks and settings of one content encoding.
struct Sink<'a> {
    ids: &'a mut Vec<u32>,
    offsets: Option<&'a mut Vec<(usize, usize)>>,
    budget: usize,
    /// Special added tokens written in the text are plain text (not matched).
    split_special: bool,
}

impl Sink<'_> {
    fn full(&self) -> bool {
        self.ids.len() >= self.budget
    }
}

/// Gives the added tokens the ids HF gives them when it loads a file, which ignores the
/// ids written there: in file order, a token takes the id of an earlier added token with
/// the same content, else the model's id of its content, else the next id after the
/// model's vocabulary (a file whose added tokens leave a gap after the vocabulary is
/// renumbered without it).
fn assign_added_ids(model: &Unigram, added: &mut [AddedToken]) {
    let mut next = model.len() as u32;
    let mut seen: std::collections::HashMap<Box<str>, u32> = std::collections::HashMap::new();
    for t in added {
        t.id = match seen.get(&t.content) {
            Some(&id) => id,
            None => {
                let id = model.piece_id(&t.content).unwrap_or_else(|| {
                    next += 1;
                    next - 1
                });
                seen.insert(t.content.clone(), id);
                id
            }
        };
    }
}

impl Tokenizer {
    /// Loads a Hugging Face `tokenizer.json` file.
    pub fn from_file(path: &str) -> Result<Self, Error> {
        let json = std::fs::read_to_string(path).map_err(|e| Error::io(path, &e))?;
        Self::from_json(&json)
    }

    /// Loads a Hugging Face `tokenizer.json` document.
    pub fn from_json(json: &str) -> Result<Self, Error> {
        let mut spec: Spec = crate::load::parse(json)?;
        let model = Unigram::new(&spec.vocab, spec.unk_id);
        assign_added_ids(&model, &mut spec.added);
        let mut scratch = NormBuffers::default();
        let mut raw = Vec::new();
        let mut norm = Vec::new();
        for (i, t) in spec.added.iter().enumerate() {
            if t.normalized {
                normalize(&spec.normalizer, &t.content, &mut scratch, false);
                norm.push((scratch.cur.clone().into_boxed_slice(), i));
            } else {
                raw.push((t.content.as_bytes().into(), i));
            }
        }
        let mut names: std::collections::HashSet<&str> =
            spec.vocab.iter().map(|v| v.0.as_str()).collect();
        names.extend(spec.added.iter().map(|t| &*t.content));
        let vocab_size = names.len();
        Ok(Self {
            model,
            raw_matcher: Matcher::new(raw),
            norm_matcher: Matcher::new(norm),
            added: spec.added,
            normalizer: spec.normalizer,
            pre: spec.pre,
            single: spec.single,
            pair: spec.pair,
            decoder: spec.decoder,
            vocab_size,
            uid: NEXT_UID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        })
    }

    /// Number of distinct tokens, added tokens included (HF's `get_vocab_size()`).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Pages backing the trie (huge pages when the system gives them).
    pub fn page_kind(&self) -> PageKind {
        self.model.trie_stats().1
    }

    /// Number of node slots in the trie (16 bytes each, four to a cache line).
    pub fn trie_nodes(&self) -> usize {
        self.model.trie_stats().0
    }

    /// The Unigram model.
    pub fn model(&self) -> &Unigram {
        &self.model
    }

    /// Id of a token string (added tokens first, then the model's pieces).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.added
            .iter()
            .find(|t| &*t.content == token)
            .map(|t| t.id)
            .or_else(|| self.model.piece_id(token))
    }

    /// Token string of an id (added tokens first, then the model's pieces).
    pub fn id_to_token(&self, id: u32) -> Option<&str> {
        self.added
            .iter()
            .find(|t| t.id == id)
            .map(|t| &*t.content)
            .or_else(|| self.model.piece(id))
    }

    /// The special added tokens (`"special": true` in the file): content and id, in file
    /// order.
    pub fn special_tokens(&self) -> impl Iterator<Item = (&str, u32)> {
        self.added
            .iter()
            .filter(|t| t.special)
            .map(|t| (&*t.content, t.id))
    }

    /// Number of template tokens added to one sequence (`pair = false`) or a pair.
    pub fn num_special_tokens(&self, pair: bool) -> usize {
        let t = if pair { &self.pair } else { &self.single };
        t.iter()
            .map(|i| {
                if let TemplateItem::Special(ids) = i {
                    ids.len()
                } else {
                    0
                }
            })
            .sum()
    }

    /// Encodes `text` into `out` (cleared first).
    ///
    /// `max_length` truncates on the right and counts template tokens, like HF's
    /// `enable_truncation(max_length)`; work stops once enough tokens are produced.
    pub fn encode_into(
        &self,
        text: &str,
        add_special_tokens: bool,
        max_length: Option<usize>,
        scratch: &mut Scratch,
        out: &mut Vec<u32>,
    ) -> Result<(), Error> {
        self.encode_text_into(text, add_special_tokens, max_length, false, scratch, out)
    }

    /// Encodes `text` into `out` like [`Tokenizer::encode_into`], except that special
    /// added tokens (`"special": true` in the file, e.g. `<s>`, `<mask>`) written in the
    /// text are not matched: their characters are tokenized as ordinary text, so a text
    /// can never produce their ids. This is HF `tokenizers`' `encode_special_tokens`
    /// (transformers' `split_special_tokens`); added tokens that are not special still
    /// match, and `add_special_tokens` still applies the template.
    pub fn encode_split_special_into(
        &self,
        text: &str,
        add_special_tokens: bool,
        max_length: Option<usize>,
        scratch: &mut Scratch,
        out: &mut Vec<u32>,
    ) -> Result<(), Error> {
        self.encode_text_into(text, add_special_tokens, max_length, true, scratch, out)
    }

    fn encode_text_into(
        &self,
        text: &str,
        add_special_tokens: bool,
        max_length: Option<usize>,
        split_special: bool,
        scratch: &mut Scratch,
        out: &mut Vec<u32>,
    ) -> Result<(), Error> {
        out.clear();
        let budget = self.budget(max_length, add_special_tokens, false)?;
        let mut first = std::mem::take(&mut scratch.first);
        first.clear();
        self.encode_content(
            text,
            &mut Sink {
                ids: &mut first,
                offsets: None,
                budget,
                split_special,
            },
            scratch,
        );
        first.truncate(budget);
        if add_special_tokens {
            self.apply_template(&self.single, &first, &[], out);
        } else {
            out.extend_from_slice(&first);
        }
        scratch.first = first;
        scratch.trim();
        Ok(())
    }

    /// Encodes `text`, allocating the result.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Vec<u32> {
        let mut out = Vec::new();
        self.encode_into(
            text,
            add_special_tokens,
            None,
            &mut Scratch::with_word_cache(0),
            &mut out,
        )
        .expect("no truncation requested");
        out
    }

    /// Encodes the pair `(a, b)` with the pair template into `out`; returns how many of
    /// the leading ids belong to the first segment (its template tokens included, i.e.
    /// everything before the second sequence's tokens).
    ///
    /// `limits` cut the pair ([`PairLimits`]).
    pub fn encode_pair_into(
        &self,
        a: &str,
        b: &str,
        add_special_tokens: bool,
        limits: PairLimits,
        scratch: &mut Scratch,
        out: &mut Vec<u32>,
    ) -> Result<usize, Error> {
        out.clear();
        let PairLimits {
            max_length,
            max_second,
            left,
        } = limits;
        let room = self.budget(max_length, add_special_tokens, true)?;
        let mut first = std::mem::take(&mut scratch.first);
        let mut second = std::mem::take(&mut scratch.second);
        first.clear();
        second.clear();
        self.encode_content(
            a,
            &mut Sink {
                ids: &mut first,
                offsets: None,
                budget: usize::MAX,
                split_special: false,
            },
            scratch,
        );
        // Enough of `b` to tell which sequence is the shorter and, when `b` is, its length
        // (all of it when its end is kept).
        let budget = if left {
            usize::MAX
        } else {
            max_second.unwrap_or(usize::MAX).min(room.max(first.len()))
        };
        self.encode_content(
            b,
            &mut Sink {
                ids: &mut second,
                offsets: None,
                budget,
                split_special: false,
            },
            scratch,
        );
        keep(
            &mut second,
            max_second.unwrap_or(usize::MAX).min(budget),
            left,
        );
        if max_length.is_some() {
            let (n1, n2) = longest_first(first.len(), second.len(), room);
            keep(&mut first, n1, left);
            keep(&mut second, n2, left);
        }
        let split = if add_special_tokens {
            self.apply_template(&self.pair, &first, &second, out)
        } else {
            out.extend_from_slice(&first);
            out.extend_from_slice(&second);
            first.len()
        };
        scratch.first = first;
        scratch.second = second;
        scratch.trim();
        Ok(split)
    }

    /// Encodes `text` with byte offsets into it (allocating; not the hot path).
    pub fn encode_with_offsets(&self, text: &str, add_special_tokens: bool) -> Encoding {
        let mut scratch = Scratch::with_word_cache(0);
        let mut ids = Vec::new();
        let mut offsets = Vec::new();
        self.encode_content(
            text,
            &mut Sink {
                ids: &mut ids,
                offsets: Some(&mut offsets),
                budget: usize::MAX,
                split_special: false,
            },
            &mut scratch,
        );
        if !add_special_tokens {
            return Encoding { ids, offsets };
        }
        let mut enc = Encoding::default();
        for item in &self.single {
            match item {
                TemplateItem::Special(s) => {
                    enc.ids.extend_from_slice(s);
                    enc.offsets.extend(std::iter::repeat_n((0, 0), s.len()));
                }
                TemplateItem::Sequence(_) => {
                    enc.ids.extend_from_slice(&ids);
                    enc.offsets.extend_from_slice(&offsets);
                }
            }
        }
        enc
    }

    /// Decodes ids to text, as HF's `decode` (unknown ids are skipped).
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> String {
        let mut out = String::new();
        let mut index = 0usize;
        for &id in ids {
            let Some(token) = self.id_to_token(id) else {
                continue;
            };
            if skip_special_tokens && self.added.iter().any(|t| t.special && &*t.content == token) {
                continue;
            }
            match &self.decoder {
                Some(m) => {
                    for c in token.chars() {
                        if c == m.replacement {
                            if !(index == 0 && m.prepend != Prepend::Never) {
                                out.push(' ');
                            }
                        } else {
                            out.push(c);
                        }
                    }
                }
                None => {
                    if index > 0 {
                        out.push(' ');
                    }
                    out.push_str(token);
                }
            }
            index += 1;
        }
        out
    }

    fn budget(
        &self,
        max_length: Option<usize>,
        add_special: bool,
        pair: bool,
    ) -> Result<usize, Error> {
        let Some(max) = max_length else {
            return Ok(usize::MAX);
        };
        let specials = if add_special {
            self.num_special_tokens(pair)
        } else {
            0
        };
        max.checked_sub(specials).ok_or_else(|| {
            Error::truncation(format!(
                "max_length {max} is below the {specials} template tokens"
            ))
        })
    }

    /// Appends the template around `a` (and `b`); returns the number of ids before `b`.
    fn apply_template(
        &self,
        t: &[TemplateItem],
        a: &[u32],
        b: &[u32],
        out: &mut Vec<u32>,
    ) -> usize {
        let mut before_b = 0;
        for item in t {
            match item {
                TemplateItem::Special(s) => out.extend_from_slice(s),
                TemplateItem::Sequence(false) => out.extend_from_slice(a),
                TemplateItem::Sequence(true) => {
                    before_b = out.len();
                    out.extend_from_slice(b);
                }
            }
        }
        if before_b == 0 {
            before_b = out.len();
        }
        before_b
    }

    /// Tokenizes `text` without a template: split on added tokens, then normalize,
    /// pre-tokenize and segment each stretch of text in between.
    fn encode_content(&self, text: &str, sink: &mut Sink<'_>, scratch: &mut Scratch) {
        let mut splits = std::mem::take(&mut scratch.splits);
        splits.clear();
        if self.raw_matcher.is_empty() {
            splits.push(Split {
                start: 0,
                end: text.len() as u32,
                id: None,
            });
        } else {
            self.raw_matcher
                .split(text, &self.added, sink.split_special, &mut splits);
        }
        for s in &splits {
            if sink.full() {
                break;
            }
            let (start, end) = (s.start as usize, s.end as usize);
            match s.id {
                Some(id) => {
                    sink.ids.push(id);
                    if let Some(o) = sink.offsets.as_deref_mut() {
                        o.push((start, end));
                    }
                }
                None => self.encode_segment(&text[start..end], start, sink, scratch),
            }
        }
        scratch.splits = splits;
        if sink.ids.len() > sink.budget {
            sink.ids.truncate(sink.budget);
            if let Some(o) = sink.offsets.as_deref_mut() {
                o.truncate(sink.budget);
            }
        }
    }

    fn encode_segment(
        &self,
        seg: &str,
        seg_start: usize,
        sink: &mut Sink<'_>,
        scratch: &mut Scratch,
    ) {
        let track = sink.offsets.is_some();
        let mut norm = std::mem::take(&mut scratch.norm);
        normalize(&self.normalizer, seg, &mut norm, track);
        if self.norm_matcher.is_empty() {
            self.encode_normalized(&norm.cur, &norm.cur_align, seg_start, sink, scratch);
        } else {
            let mut splits = std::mem::take(&mut scratch.norm_splits);
            splits.clear();
            // SAFETY: normalizer output is UTF-8 (see `normalize`).
            let text = unsafe { std::str::from_utf8_unchecked(&norm.cur) };
            self.norm_matcher
                .split(text, &self.added, sink.split_special, &mut splits);
            for s in &splits {
                if sink.full() {
                    break;
                }
                let (a, b) = (s.start as usize, s.end as usize);
                match s.id {
                    Some(id) => {
                        sink.ids.push(id);
                        if let Some(o) = sink.offsets.as_deref_mut() {
                            o.push(span(&norm.cur_align, a, b, seg_start));
                        }
                    }
                    None => {
                        let al = if track {
                            &norm.cur_align[a..b]
                        } else {
                            &[][..]
                        };
                        self.encode_normalized(&norm.cur[a..b], al, seg_start, sink, scratch)
                    }
                }
            }
            scratch.norm_splits = splits;
        }
        scratch.norm = norm;
    }

    /// Pre-tokenizes normalized text and runs the model over each piece.
    fn encode_normalized(
        &self,
        text: &[u8],
        align: &[Align],
        seg_start: usize,
        sink: &mut Sink<'_>,
        scratch: &mut Scratch,
    ) {
        let track = sink.offsets.is_some();
        let Scratch {
            pre,
            pre_align,
            pieces,
            viterbi,
            piece_offsets,
            words,
            ..
        } = scratch;
        pre.clear();
        pre_align.clear();
        pieces.clear();
        // SAFETY: normalizer output is UTF-8 (see `normalize`).
        let s = unsafe { std::str::from_utf8_unchecked(text) };
        if self.pre.whitespace_split {
            let mut word_start = None;
            for (i, c) in s.char_indices() {
                if c.is_whitespace() {
                    if let Some(w) = word_start.take() {
                        self.word(
                            &text[w..i],
                            if track { &align[w..i] } else { &[] },
                            track,
                            pre,
                            pre_align,
                            pieces,
                        );
                    }
                } else if word_start.is_none() {
                    word_start = Some(i);
                }
            }
            if let Some(w) = word_start {
                self.word(
                    &text[w..],
                    if track { &align[w..] } else { &[] },
                    track,
                    pre,
                    pre_align,
                    pieces,
                );
            }
        } else {
            self.word(text, align, track, pre, pre_align, pieces);
        }
        viterbi.reserve(pre.len().min(VITERBI_RESERVE));
        if track {
            // Calls that want offsets skip the word cache (its entries hold ids only).
            for &(ps, pe) in pieces.iter() {
                if sink.full() {
                    break;
                }
                let piece = &pre[ps as usize..pe as usize];
                piece_offsets.clear();
                self.model
                    .encode_piece(piece, viterbi, sink.ids, Some(piece_offsets));
                if let Some(o) = sink.offsets.as_deref_mut() {
                    for &(a, b) in piece_offsets.iter() {
                        o.push(span(
                            pre_align,
                            (ps + a) as usize,
                            (ps + b) as usize,
                            seg_start,
                        ));
                    }
                }
            }
            return;
        }
        words.claim(self.uid);
        let key = |k: usize| pieces.get(k).map(|&(a, b)| &pre[a as usize..b as usize]);
        let mut next_slot = key(0).and_then(|p| words.slot(p));
        for (k, &(ps, pe)) in pieces.iter().enumerate() {
            if sink.full() {
                break;
            }
            let piece = &pre[ps as usize..pe as usize];
            let slot = next_slot;
            // The next pre-token's entry loads while this one is encoded.
            next_slot = key(k + 1).and_then(|p| words.slot(p));
            if let Some(s) = next_slot {
                words.prefetch(s);
            }
            match words.probe_at(slot, piece) {
                Probe::Hit(slot) => sink.ids.extend_from_slice(words.entry(slot).ids()),
                Probe::Miss(slot) => {
                    let first = sink.ids.len();
                    self.model.encode_piece(piece, viterbi, sink.ids, None);
                    words.store(slot, piece, &sink.ids[first..]);
                }
                Probe::Bypass => self.model.encode_piece(piece, viterbi, sink.ids, None),
            }
        }
    }

    /// Applies Metaspace (when configured) to one word and records its pieces.
    fn word(
        &self,
        w: &[u8],
        wa: &[Align],
        track: bool,
        pre: &mut Vec<u8>,
        pre_align: &mut Vec<Align>,
        pieces: &mut Vec<(u32, u32)>,
    ) {
        if w.is_empty() {
            return;
        }
        let start = pre.len();
        let Some(m) = &self.pre.metaspace else {
            pre.extend_from_slice(w);
            if track {
                pre_align.extend_from_slice(wa);
            }
            pieces.push((start as u32, pre.len() as u32));
            return;
        };
        let mut buf = [0u8; 4];
        let rep = m.replacement.encode_utf8(&mut buf).as_bytes();
        let starts_with_rep = w[0] == b' ' || w.starts_with(rep);
        if m.prepend == Prepend::Always && !starts_with_rep {
            pre.extend_from_slice(rep);
            if track {
                pre_align.extend(std::iter::repeat_n(wa[0], rep.len()));
            }
        }
        // One pass: copy runs between spaces in bulk, each space becoming the replacement;
        // with `split`, a piece starts at every replacement in the output (the inserted
        // ones and those already in the text — a whole character's bytes occur in UTF-8
        // only where that character is).
        let mut piece_start = start;
        let mut cut = |at: usize, pieces: &mut Vec<(u32, u32)>| {
            if m.split {
                if at > piece_start {
                    pieces.push((piece_start as u32, at as u32));
                }
                piece_start = at;
            }
        };
        let mut last = 0;
        for i in memchr::memchr2_iter(b' ', rep[0], w) {
            if w[i] == b' ' {
                pre.extend_from_slice(&w[last..i]);
                if track {
                    pre_align.extend_from_slice(&wa[last..i]);
                    pre_align.extend(std::iter::repeat_n(wa[i], rep.len()));
                }
                cut(pre.len(), pieces);
                pre.extend_from_slice(rep);
                last = i + 1;
            } else if w.len() >= i + rep.len() && w[i..i + rep.len()] == *rep {
                pre.extend_from_slice(&w[last..i]);
                if track {
                    pre_align.extend_from_slice(&wa[last..i]);
                }
                cut(pre.len(), pieces);
                last = i;
            }
        }
        pre.extend_from_slice(&w[last..]);
        if track {
            pre_align.extend_from_slice(&wa[last..]);
        }
        if pre.len() > piece_start {
            pieces.push((piece_start as u32, pre.len() as u32));
        }
    }
}

/// Original byte range (absolute) of normalized bytes `a..b` of a segment.
fn span(align: &[Align], a: usize, b: usize, seg_start: usize) -> (usize, usize) {
    if a >= b {
        return (seg_start, seg_start);
    }
    (
        seg_start + align[a].0 as usize,
        seg_start + align[b - 1].1 as usize,
    )
}

/// Cuts `ids` to its first `n` (or, `left`, its last `n`) ids; allocates nothing.
fn keep(ids: &mut Vec<u32>, n: usize, left: bool) {
    if left {
        ids.drain(..ids.len().saturating_sub(n));
    } else {
        ids.truncate(n);
    }
}

/// The lengths HF's `longest_first` truncation keeps of a pair of `n1` and `n2` tokens in
/// `room` tokens (the maximum length less the template's). Nothing is cut when both fit.
/// Else the longer is cut to the room the shorter leaves, unless the shorter takes more
/// than half of it: then the shorter keeps `room / 2` and the longer the rest (a tie counts
/// the first sequence as the shorter). Invariant: each result is at most its input, and
/// their sum is `room` whenever `n1 + n2 > room`.
pub fn longest_first(n1: usize, n2: usize, room: usize) -> (usize, usize) {
    if n1.saturating_add(n2) <= room {
        return (n1, n2);
    }
    let short = n1.min(n2).min(room / 2);
    if n1 > n2 {
        (room - short, short)
    } else {
        (short, room - short)
    }
}
