//! The Viterbi engine against a plain reference written for clarity (property tests):
//! same ids on arbitrary UTF-8, no panic, for synthetic vocabularies full of ties and
//! duplicates and for the real XLM-R vocabulary.

mod common;

use std::collections::HashMap;

use proptest::prelude::*;
use trellis_tokenizer::{Unigram, ViterbiScratch};

/// Best segmentation by the textbook dynamic programme, with HF's rules: character
/// boundaries visited left to right, candidates by ascending length, strictly better
/// replaces, unknown character scored `min - 10`, runs of unknowns fused and looked up.
fn reference(
    vocab: &[(String, f64)],
    ids: &HashMap<&str, u32>,
    unk_id: u32,
    text: &str,
) -> Vec<u32> {
    let score = |id: u32| vocab[id as usize].1;
    let min = vocab.iter().map(|v| v.1).fold(f64::INFINITY, f64::min);
    let unk_score = min - 10.0;
    let bounds: Vec<usize> = text
        .char_indices()
        .map(|(i, _)| i)
        .chain([text.len()])
        .collect();
    // best[k] = (score, start boundary, id) of the best path ending at boundary k.
    let mut best: Vec<Option<(f64, usize, u32)>> = vec![None; bounds.len()];
    best[0] = Some((0.0, 0, u32::MAX));
    for i in 0..bounds.len() - 1 {
        let here = best[i].expect("every boundary is reachable").0;
        let mut single = false;
        for j in i + 1..bounds.len() {
            if let Some(&id) = ids.get(&text[bounds[i]..bounds[j]]) {
                let cand = here + score(id);
                if best[j].is_none_or(|b| cand > b.0) {
                    best[j] = Some((cand, i, id));
                }
                single |= j == i + 1;
            }
        }
        if !single {
            let cand = here + unk_score;
            if best[i + 1].is_none_or(|b| cand > b.0) {
                best[i + 1] = Some((cand, i, unk_id));
            }
        }
    }
    let mut path = Vec::new();
    let mut k = bounds.len() - 1;
    while k > 0 {
        let (_, start, id) = best[k].unwrap();
        path.push((bounds[start], bounds[k], id));
        k = start;
    }
    path.reverse();
    let mut out = Vec::new();
    let mut i = 0;
    while i < path.len() {
        let (start, mut end, id) = path[i];
        if id == unk_id {
            while i + 1 < path.len() && path[i + 1].2 == unk_id {
                i += 1;
                end = path[i].1;
            }
            out.push(*ids.get(&text[start..end]).unwrap_or(&unk_id));
        } else {
            out.push(id);
        }
        i += 1;
    }
    out
}

/// HF's piece → id map: the last id listing a piece wins.
fn id_map(vocab: &[(String, f64)]) -> HashMap<&str, u32> {
    vocab
        .iter()
        .enumerate()
        .map(|(i, (p, _))| (p.as_str(), i as u32))
        .collect()
}

fn engine(model: &Unigram, text: &str) -> Vec<u32> {
    let mut scratch = ViterbiScratch::default();
    let mut ids = Vec::new();
    model.encode_piece(text.as_bytes(), &mut scratch, &mut ids, None);
    ids
}

const ALPHABET: &[&str] = &[
    "a",
    "b",
    "c",
    "ab",
    "é",
    "e\u{301}",
    "日",
    "本",
    "👍",
    "▁",
    "\u{0}",
    "<unk>",
    "\u{10ffff}",
];

fn vocab_strategy() -> impl Strategy<Value = Vec<(String, f64)>> {
    let piece = proptest::collection::vec(proptest::sample::select(ALPHABET), 1..4)
        .prop_map(|v| v.concat());
    // Integer-valued scores (times a few factors) make ties common; duplicates are kept on
    // purpose. Per vocabulary, scores stay `f32` values, or each moves by a few `f64`
    // steps (as a 16-digit print of an `f32` read back does; the trie packs these next to
    // the `f32`), or one moves far from any `f32` (the trie cannot pack that, so it keeps
    // exact scores in a side array): both node forms meet the reference.
    let entry = (
        piece,
        -8i32..=0,
        proptest::sample::select(vec![1.0f32, 0.3, 1.7]),
        -128i64..=127,
    );
    let nudged = |s: f64, k: i64| {
        if s == 0.0 {
            s
        } else {
            f64::from_bits((s.to_bits() as i64 + k) as u64)
        }
    };
    (proptest::collection::vec(entry, 1..40), 0..3u8).prop_map(move |(entries, form)| {
        let mut v: Vec<(String, f64)> = entries
            .into_iter()
            .map(|(p, s, scale, k)| {
                let score = (s as f32 * scale) as f64;
                (p, if form == 0 { score } else { nudged(score, k) })
            })
            .collect();
        if form == 2 {
            v[0].1 = nudged(v[0].1, 1 << 40);
        }
        v.insert(0, ("<unk>".to_owned(), 0.0));
        v
    })
}

fn text_strategy() -> impl Strategy<Value = String> {
    prop_oneof![
        proptest::collection::vec(proptest::sample::select(ALPHABET), 0..30)
            .prop_map(|v| v.concat()),
        any::<String>(),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn synthetic_vocab_matches_reference(vocab in vocab_strategy(), text in text_strategy()) {
        let model = Unigram::new(&vocab, 0);
        prop_assert_eq!(engine(&model, &text), reference(&vocab, &id_map(&vocab), 0, &text));
    }
}

#[test]
fn xlmr_vocab_matches_reference() {
    let json = std::fs::read_to_string(common::xlmr_file("tokenizer.json")).unwrap();
    let root: serde_json::Value = serde_json::from_str(&json).unwrap();
    let vocab: Vec<(String, f64)> = root["model"]["vocab"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e[0].as_str().unwrap().to_owned(), e[1].as_f64().unwrap()))
        .collect();
    let unk = root["model"]["unk_id"].as_u64().unwrap() as u32;
    let model = Unigram::new(&vocab, unk);
    let ids = id_map(&vocab);
    let words = proptest::collection::vec(
        prop_oneof![
            proptest::sample::select(common::SENTENCES).prop_map(|s| s.replace(' ', "▁")),
            any::<String>(),
        ],
        1..3,
    )
    .prop_map(|v| format!("▁{}", v.concat()));
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig::with_cases(300));
    runner
        .run(&words, |text| {
            prop_assert_eq!(engine(&model, &text), reference(&vocab, &ids, unk, &text));
            Ok(())
        })
        .unwrap();
}
