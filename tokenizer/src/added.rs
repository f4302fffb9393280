//! Added tokens (special tokens such as `<s>`, `<mask>`): found in the text before the
//! model sees it, with HF's `AddedVocabulary::find_matches` rules.

/// One added token from `tokenizer.json`'s `added_tokens`.
#[derive(Debug, Clone)]
pub(crate) struct AddedToken {
    pub(crate) id: u32,
    pub(crate) content: Box<str>,
    pub(crate) single_word: bool,
    pub(crate) lstrip: bool,
    pub(crate) rstrip: bool,
    pub(crate) normalized: bool,
    pub(crate) special: bool,
}

/// A piece of a text after splitting on added tokens: a byte range and, for a token,
/// its id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Split {
    pub(crate) start: u32,
    pub(crate) end: u32,
    /// `Some(id)` for an added token, `None` for text to tokenize.
    pub(crate) id: Option<u32>,
}

/// A set of added tokens matched leftmost-longest, like HF's Aho-Corasick matcher.
#[derive(Debug, Clone, Default)]
pub(crate) struct Matcher {
    /// Patterns (the token's content, or its normalized form), longest first.
    patterns: Vec<(Box<[u8]>, usize)>,
    /// Bit set of the first bytes of all patterns.
    first: [u64; 4],
    /// The first byte shared by every pattern, when there is just one (XLM-R: `<`),
    /// so candidates are found with `memchr`.
    only_first: Option<u8>,
}

impl Matcher {
    /// Builds a matcher over `(pattern, token index)` pairs.
    pub(crate) fn new(mut patterns: Vec<(Box<[u8]>, usize)>) -> Self {
        patterns.retain(|p| !p.0.is_empty());
        patterns.sort_by_key(|p| std::cmp::Reverse(p.0.len()));
        let mut first = [0u64; 4];
        for (p, _) in &patterns {
            first[(p[0] >> 6) as usize] |= 1 << (p[0] & 63);
        }
        let only_first = match patterns.first() {
            Some((p0, _)) if patterns.iter().all(|(p, _)| p[0] == p0[0]) => Some(p0[0]),
            _ => None,
        };
        Self {
            patterns,
            first,
            only_first,
        }
    }

    /// True when there is nothing to match.
    pub(crate) fn is_empty(&self) -> bool {
        self.patterns.is_empty()
    }

    /// Leftmost-longest match starting at or after `from`: `(start, end, token index)`.
    #[inline]
    fn next_match(&self, hay: &[u8], from: usize) -> Option<(usize, usize, usize)> {
        let mut i = from;
        while i < hay.len() {
            if let Some(f) = self.only_first {
                i += memchr::memchr(f, &hay[i..])?;
            }
            let b = hay[i];
            if (self.first[(b >> 6) as usize] >> (b & 63)) & 1 == 1 {
                for (p, t) in &self.patterns {
                    if hay[i..].starts_with(p) {
                        return Some((i, i + p.len(), *t));
                    }
                }
            }
            i += 1;
        }
        None
    }

    /// Splits `text` into added tokens and text between them, appending to `out` (HF's
    /// `find_matches`, including `single_word`, `lstrip` and `rstrip`). With
    /// `skip_special`, a match of a special token is dropped and its text stays text
    /// (HF's `encode_special_tokens`: matching goes on after it, so no token is found
    /// inside it either).
    pub(crate) fn split(
        &self,
        text: &str,
        tokens: &[AddedToken],
        skip_special: bool,
        out: &mut Vec<Split>,
    ) {
        let hay = text.as_bytes();
        if hay.is_empty() {
            out.push(Split {
                start: 0,
                end: 0,
                id: None,
            });
            return;
        }
        let mut start_offset = 0usize;
        let mut from = 0usize;
        while let Some((mut start, mut stop, t)) = self.next_match(hay, from) {
            from = stop;
            let tok = &tokens[t];
            if skip_special && tok.special {
                continue;
            }
            if tok.single_word {
                let start_space = start == 0 || !ends_with_word(&text[..start]);
                let stop_space = stop == hay.len() || !starts_with_word(&text[stop..]);
                if !start_space || !stop_space {
                    continue;
                }
            }
            if tok.lstrip {
                let trimmed = text[..start].trim_end_matches(char::is_whitespace).len();
                start = trimmed.max(start_offset);
            }
            if tok.rstrip {
                let rest = &text[stop..];
                stop += rest.len() - rest.trim_start_matches(char::is_whitespace).len();
            }
            if start_offset < start {
                out.push(Split {
                    start: start_offset as u32,
                    end: start as u32,
                    id: None,
                });
            }
            out.push(Split {
                start: start as u32,
                end: stop as u32,
                id: Some(tok.id),
            });
            start_offset = stop;
        }
        if start_offset != hay.len() {
            out.push(Split {
                start: start_offset as u32,
                end: hay.len() as u32,
                id: None,
            });
        }
    }
}

fn is_word_char(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

fn ends_with_word(s: &str) -> bool {
    s.chars().next_back().is_some_and(is_word_char)
}

fn starts_with_word(s: &str) -> bool {
    s.chars().next().is_some_and(is_word_char)
}
