//! One oversized input must not keep its memory in the scratch: every buffer is cut back to
//! a bounded capacity when the call returns, and the ids do not change.

mod common;

use trellis_tokenizer::{PairLimits, Scratch, Tokenizer};

/// Regression: one 8 MB word left the scratch ~270 MB larger for good (lattice cells,
/// characters and backtrack path of the Viterbi pass, normalizer and pre-token buffers,
/// the ids).
#[test]
fn a_huge_word_does_not_stay_in_the_scratch() {
    let tok = Tokenizer::from_file(&common::xlmr_file("tokenizer.json")).unwrap();
    let mut scratch = Scratch::new();
    let mut out = Vec::new();
    let normal = common::texts(1, 14_000).pop().unwrap();
    tok.encode_into(&normal, true, None, &mut scratch, &mut out)
        .unwrap();
    let want = out.clone();
    let grown = scratch.buffer_bytes();
    assert!(grown <= Scratch::MAX_KEPT_BYTES, "{grown} bytes");

    let huge = "a".repeat(8 << 20);
    tok.encode_into(&huge, true, None, &mut scratch, &mut out)
        .unwrap();
    assert!(out.len() > 8 << 20 >> 5, "{} ids", out.len());
    let after = scratch.buffer_bytes();
    assert!(
        after <= Scratch::MAX_KEPT_BYTES,
        "{after} bytes held after an 8 MB word (bound {})",
        Scratch::MAX_KEPT_BYTES
    );

    // The pair path, with an oversized text second and first.
    let large = &huge[..2 << 20];
    tok.encode_pair_into(
        "a query",
        large,
        true,
        PairLimits::default(),
        &mut scratch,
        &mut out,
    )
    .unwrap();
    assert!(scratch.buffer_bytes() <= Scratch::MAX_KEPT_BYTES);
    tok.encode_pair_into(
        large,
        "a document",
        true,
        PairLimits::default(),
        &mut scratch,
        &mut out,
    )
    .unwrap();
    assert!(scratch.buffer_bytes() <= Scratch::MAX_KEPT_BYTES);

    // Unchanged output afterwards.
    tok.encode_into(&normal, true, None, &mut scratch, &mut out)
        .unwrap();
    assert_eq!(out, want);
}

/// Inputs whose buffers fit the bound keep their grown capacity (the zero-allocation
/// steady state, see tests/alloc.rs, depends on it).
#[test]
fn normal_inputs_keep_their_buffers() {
    let tok = Tokenizer::from_file(&common::xlmr_file("tokenizer.json")).unwrap();
    let mut scratch = Scratch::new();
    let mut out = Vec::new();
    let text = common::texts(1, 56_000).pop().unwrap();
    tok.encode_into(&text, true, None, &mut scratch, &mut out)
        .unwrap();
    let grown = scratch.buffer_bytes();
    assert!(grown > 56_000, "{grown} bytes");
    for _ in 0..3 {
        tok.encode_into(&text, true, None, &mut scratch, &mut out)
            .unwrap();
        assert_eq!(scratch.buffer_bytes(), grown);
    }
}
