//! The word cache changes nothing but speed: ids through scratches with the cache off, at
//! its default size and at one or two entries (every word collides), reused across texts,
//! sizes, truncation and pairs, agree; and a scratch moved between tokenizers never hands
//! one tokenizer's cached ids to the other.

mod common;

use trellis_tokenizer::{PairLimits, Scratch, Tokenizer};

/// Texts with many repeats, words over the cache's 34-byte keys, words of more than seven
/// pieces, literal special tokens and charsmap-mapped characters.
fn texts() -> Vec<String> {
    let mut t: Vec<String> = common::SENTENCES.iter().map(|s| s.to_string()).collect();
    t.extend(common::texts(6, 1_800));
    t.extend(common::texts(2, 14_000));
    t.push("the the the cat the dog the the".into());
    t.push(format!(
        "{} internationalization",
        "Donaudampfschifffahrtsgesellschaftskapitän ".repeat(3)
    ));
    t.push(
        "xqzvkjwpfh qxzjvk xqzvkjwpfh ｆｕｌｌｗｉｄｔｈ ｆｕｌｌｗｉｄｔｈ <s> <mask> a</s>b"
            .into(),
    );
    t.push("ﬁne ﬁne ①② ①② \u{3000}日本語のテキスト 日本語のテキスト".into());
    t.push(String::new());
    t
}

#[test]
fn cache_sizes_agree_with_the_cache_off() {
    for file in ["tokenizer.json", "tokenizer-legacy.json"] {
        let tok = Tokenizer::from_file(&common::xlmr_file(file)).unwrap();
        let texts = texts();
        let mut off = Scratch::with_word_cache(0);
        let mut scratches = [
            Scratch::new(),
            Scratch::with_word_cache(1),
            Scratch::with_word_cache(2),
        ];
        assert_eq!(off.word_cache_entries(), 0);
        assert_eq!(
            scratches[0].word_cache_entries(),
            trellis_tokenizer::DEFAULT_WORD_CACHE
        );
        let (mut want, mut got) = (Vec::new(), Vec::new());
        // Twice over, so the second pass finds the first pass's words cached.
        for round in 0..2 {
            for (i, t) in texts.iter().enumerate() {
                for max_length in [None, Some(40)] {
                    tok.encode_into(t, true, max_length, &mut off, &mut want)
                        .unwrap();
                    for s in scratches.iter_mut() {
                        tok.encode_into(t, true, max_length, s, &mut got).unwrap();
                        assert_eq!(got, want, "{file}, round {round}, text {i}, {max_length:?}");
                    }
                }
                let q = &texts[(i + 3) % texts.len()];
                let a = tok.encode_pair_into(
                    q,
                    t,
                    true,
                    PairLimits {
                        max_length: Some(200),
                        ..PairLimits::default()
                    },
                    &mut off,
                    &mut want,
                );
                for s in scratches.iter_mut() {
                    let b = tok.encode_pair_into(
                        q,
                        t,
                        true,
                        PairLimits {
                            max_length: Some(200),
                            ..PairLimits::default()
                        },
                        s,
                        &mut got,
                    );
                    assert_eq!(a.is_ok(), b.is_ok());
                    assert_eq!(got, want, "{file}, round {round}, pair {i}");
                }
            }
        }
    }
}

/// XLM-R's file with the vocabulary entries of "▁the" and "▁cat" swapped: the same words
/// get each other's ids.
fn swapped_tokenizer() -> (Tokenizer, u32, u32) {
    let json = std::fs::read_to_string(common::xlmr_file("tokenizer.json")).unwrap();
    let mut doc: serde_json::Value = serde_json::from_str(&json).unwrap();
    let vocab = doc["model"]["vocab"].as_array_mut().unwrap();
    let find = |v: &Vec<serde_json::Value>, p: &str| v.iter().position(|e| e[0] == p).unwrap();
    let (a, b) = (find(vocab, "\u{2581}the"), find(vocab, "\u{2581}cat"));
    let (pa, pb) = (vocab[a][0].clone(), vocab[b][0].clone());
    vocab[a][0] = pb;
    vocab[b][0] = pa;
    let tok = Tokenizer::from_json(&doc.to_string()).unwrap();
    (tok, a as u32, b as u32)
}

#[test]
fn a_scratch_moved_between_tokenizers_keeps_them_apart() {
    let xlmr = Tokenizer::from_file(&common::xlmr_file("tokenizer.json")).unwrap();
    let (swapped, the, cat) = swapped_tokenizer();
    let mut shared = Scratch::new();
    let mut out = Vec::new();
    for _ in 0..3 {
        xlmr.encode_into("the cat", false, None, &mut shared, &mut out)
            .unwrap();
        assert_eq!(out, [the, cat]);
        swapped
            .encode_into("the cat", false, None, &mut shared, &mut out)
            .unwrap();
        assert_eq!(out, [cat, the]);
    }
}
