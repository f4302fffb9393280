//! Loads a tokenizer.json, reports load time and trie pages, and encodes the arguments.
//!
//! `cargo run --release --no-default-features --example encode -- tokenizer.json "text"`

use std::time::Instant;

use trellis_tokenizer::{Scratch, Tokenizer};

fn main() {
    let mut args = std::env::args().skip(1);
    let path = args.next().expect("usage: encode TOKENIZER_JSON [TEXT...]");
    let t0 = Instant::now();
    let tok = Tokenizer::from_file(&path).unwrap_or_else(|e| panic!("{e}"));
    eprintln!(
        "loaded in {:?}: {} trie slots ({} MiB), pages: {}",
        t0.elapsed(),
        tok.trie_nodes(),
        (tok.trie_nodes() * 16) >> 20,
        tok.page_kind()
    );
    let mut scratch = Scratch::new();
    let mut ids = Vec::new();
    for text in args {
        tok.encode_into(&text, true, None, &mut scratch, &mut ids)
            .unwrap_or_else(|e| panic!("{e}"));
        println!("{ids:?}");
    }
}
