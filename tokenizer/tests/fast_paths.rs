//! The normalizer's fast paths (single-character clusters looked up from bit tables, text
//! copied in runs, Strip and Replace done in place, one-pass Metaspace) against its plain
//! path: `encode_with_offsets` segments every grapheme with `unicode-segmentation` and
//! copies step by step, so its ids are the reference for `encode`'s.

mod common;

use proptest::prelude::*;
use trellis_tokenizer::{Scratch, Tokenizer};

/// Characters that exercise cluster rules and the charsmap: combining marks, ZWJ and
/// emoji, regional indicators, Hangul jamo and syllables, an Indic consonant, virama and
/// vowel sign, CR/LF/NEL, spaces and ideographic space, full-width forms, ligatures,
/// mapped symbols, prepend and control characters, and plain letters of several scripts.
const PARTS: &[&str] = &[
    "a",
    "Z",
    " ",
    "  ",
    "\t",
    "\r",
    "\n",
    "\r\n",
    "\u{85}",
    "\u{a0}",
    "\u{3000}",
    "\u{301}",
    "\u{300}",
    "\u{200d}",
    "\u{200b}",
    "👍",
    "🏽",
    "👨",
    "🇫",
    "🇷",
    "\u{1100}",
    "\u{1161}",
    "\u{11a8}",
    "한",
    "\u{ac00}",
    "क",
    "\u{94d}",
    "\u{93e}",
    "ष",
    "é",
    "e",
    "ё",
    "я",
    "日",
    "ｶ",
    "ﾞ",
    "Ａ",
    "ﬁ",
    "½",
    "①",
    "㍿",
    "\u{600}",
    "\u{1}",
    "▁",
    "<s>",
    "ـ",
    "ि",
    "ก",
    "\u{e31}",
    "\u{fe0f}",
    "x\u{308}",
    "\u{1f3f4}",
    "\u{e0067}",
];

fn tokenizers() -> Vec<Tokenizer> {
    ["tokenizer.json", "tokenizer-legacy.json"]
        .iter()
        .map(|f| Tokenizer::from_file(&common::xlmr_file(f)).unwrap())
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn fast_normalizer_matches_the_grapheme_path(
        parts in proptest::collection::vec(
            prop_oneof![
                4 => proptest::sample::select(PARTS).prop_map(str::to_owned),
                1 => any::<String>(),
            ],
            0..24,
        )
    ) {
        thread_local! {
            static TOKS: Vec<Tokenizer> = tokenizers();
        }
        let text = parts.concat();
        TOKS.with(|toks| {
            for tok in toks {
                let mut out = Vec::new();
                tok.encode_into(&text, true, None, &mut Scratch::new(), &mut out).unwrap();
                prop_assert_eq!(&out, &tok.encode_with_offsets(&text, true).ids, "{:?}", text);
            }
            Ok(())
        })?;
    }
}

#[test]
fn sample_sentences_match_the_grapheme_path() {
    for tok in tokenizers() {
        for s in common::SENTENCES {
            assert_eq!(
                tok.encode(s, true),
                tok.encode_with_offsets(s, true).ids,
                "{s:?}"
            );
        }
    }
}
