//! Steady-state encoding allocates nothing: a counting global allocator watches the
//! measured window (only on this thread, so parallel tests do not disturb it).

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use trellis_tokenizer::{PairLimits, Scratch, Tokenizer};

struct Counting;

thread_local! {
    static WATCH: Cell<bool> = const { Cell::new(false) };
    static COUNT: Cell<usize> = const { Cell::new(0) };
}

fn note() {
    // `try_with`: the allocator may run while thread-locals are being torn down.
    let _ = WATCH.try_with(|w| {
        if w.get() {
            let _ = COUNT.try_with(|c| c.set(c.get() + 1));
        }
    });
}

// SAFETY: forwards every call to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note();
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note();
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn count_allocations(f: impl FnOnce()) -> usize {
    COUNT.with(|c| c.set(0));
    WATCH.with(|w| w.set(true));
    f();
    WATCH.with(|w| w.set(false));
    COUNT.with(|c| c.get())
}

#[test]
fn counter_sees_allocations() {
    let n = count_allocations(|| {
        let v: Vec<u8> = Vec::with_capacity(100);
        std::hint::black_box(v);
    });
    assert_eq!(n, 1);
}

#[test]
fn steady_state_encoding_allocates_nothing() {
    for file in ["tokenizer.json", "tokenizer-legacy.json"] {
        let tok = Tokenizer::from_file(&common::xlmr_file(file)).unwrap();
        let mut scratch = Scratch::new();
        let mut out = Vec::new();
        // ~128, 512, 1k, 4k and 16k tokens (about 3-4 bytes per token here).
        for bytes in [450, 1_800, 3_600, 14_000, 56_000] {
            let texts = common::texts(4, bytes);
            // Warm-up: the scratch and output grow to the largest input once.
            for t in &texts {
                tok.encode_into(t, true, None, &mut scratch, &mut out)
                    .unwrap();
                tok.encode_pair_into(
                    "a query",
                    t,
                    true,
                    PairLimits::default(),
                    &mut scratch,
                    &mut out,
                )
                .unwrap();
            }
            let n = count_allocations(|| {
                for t in &texts {
                    tok.encode_into(t, true, None, &mut scratch, &mut out)
                        .unwrap();
                    assert!(out.len() > 2);
                    tok.encode_into(t, true, Some(100), &mut scratch, &mut out)
                        .unwrap();
                    assert_eq!(out.len(), 100);
                    tok.encode_into(t, false, None, &mut scratch, &mut out)
                        .unwrap();
                    tok.encode_pair_into(
                        "a query",
                        t,
                        true,
                        PairLimits {
                            max_length: Some(64),
                            ..PairLimits::default()
                        },
                        &mut scratch,
                        &mut out,
                    )
                    .unwrap();
                    // a long query against the document, both cut at their starts
                    let limits = PairLimits {
                        max_length: Some(64),
                        max_second: Some(40),
                        left: true,
                    };
                    tok.encode_pair_into(t, t, true, limits, &mut scratch, &mut out)
                        .unwrap();
                    assert!(out.len() <= 64);
                }
            });
            assert_eq!(n, 0, "{file}: {n} allocations at ~{bytes} bytes");
        }
        // Inputs that hit the normalization map everywhere.
        let heavy = common::SENTENCES[7].repeat(200) + &common::SENTENCES[8].repeat(200);
        tok.encode_into(&heavy, true, None, &mut scratch, &mut out)
            .unwrap();
        let n = count_allocations(|| {
            tok.encode_into(&heavy, true, None, &mut scratch, &mut out)
                .unwrap()
        });
        assert_eq!(n, 0, "{file}: charsmap-heavy input allocated {n} times");
    }
}

/// Regression: Strip and Replace run in place when they can, so which normalizer buffer
/// receives a step's output varies from call to call; the buffers must not keep
/// outgrowing each other (they did, one allocation per call, with amortized `reserve`).
#[test]
fn in_place_normalizer_steps_settle() {
    let tok = Tokenizer::from_file(&common::xlmr_file("tokenizer.json")).unwrap();
    let mut scratch = Scratch::new();
    let mut out = Vec::new();
    let base = common::texts(1, 60_000).pop().unwrap();
    let half = common::texts(1, 30_000).pop().unwrap();
    // With runs of spaces (Replace rewrites) and trailing spaces (Strip cuts), and without.
    let texts = [
        base.replace(". ", ".   ") + "   ",
        base.clone(),
        half.replace(", ", ",  "),
        base.replace(' ', "  "),
    ];
    for t in &texts {
        tok.encode_into(t, true, None, &mut scratch, &mut out)
            .unwrap();
    }
    let n = count_allocations(|| {
        for _ in 0..8 {
            for t in &texts {
                tok.encode_into(t, true, None, &mut scratch, &mut out)
                    .unwrap();
            }
        }
    });
    assert_eq!(n, 0, "{n} allocations over 32 steady-state calls");
}

/// A text no longer than one the scratch has already seen allocates nothing, even when one
/// of its words is longer than every word before (the unseen-text benchmark found this: the
/// Viterbi buffers used to grow with the longest word, not the longest text).
#[test]
fn unseen_text_with_a_longer_word_allocates_nothing() {
    let tok = Tokenizer::from_file(&common::xlmr_file("tokenizer.json")).unwrap();
    let mut scratch = Scratch::new();
    let mut out = Vec::new();
    let short_words = "ab cd ef ".repeat(300); // 2,700 bytes, words of 2 letters
    tok.encode_into(&short_words, true, None, &mut scratch, &mut out)
        .unwrap();
    let long_word = format!("{} {}", "internationalization".repeat(60), "ok ".repeat(50));
    assert!(long_word.len() < short_words.len());
    let n = count_allocations(|| {
        tok.encode_into(&long_word, true, None, &mut scratch, &mut out)
            .unwrap()
    });
    assert_eq!(
        n, 0,
        "{n} allocations for an unseen text with a 1,200-letter word"
    );
}

/// After an input too large for the scratch to keep (its buffers are cut back when the call
/// returns), the texts seen before it still encode without allocating.
#[test]
fn steady_state_survives_an_oversized_input() {
    let tok = Tokenizer::from_file(&common::xlmr_file("tokenizer.json")).unwrap();
    let mut scratch = Scratch::new();
    let mut out = Vec::new();
    let texts = common::texts(4, 14_000);
    for t in &texts {
        tok.encode_into(t, true, None, &mut scratch, &mut out)
            .unwrap();
        tok.encode_pair_into(
            "a query",
            t,
            true,
            PairLimits::default(),
            &mut scratch,
            &mut out,
        )
        .unwrap();
    }
    let huge = format!("{} {}", "ab".repeat(1 << 20), "word ".repeat(1 << 18));
    tok.encode_into(&huge, true, None, &mut scratch, &mut out)
        .unwrap();
    let n = count_allocations(|| {
        for t in &texts {
            tok.encode_into(t, true, None, &mut scratch, &mut out)
                .unwrap();
            tok.encode_pair_into(
                "a query",
                t,
                true,
                PairLimits::default(),
                &mut scratch,
                &mut out,
            )
            .unwrap();
        }
    });
    assert_eq!(n, 0, "{n} allocations after an oversized input");
}
