//! A Unigram (SentencePiece) tokenizer that loads Hugging Face `tokenizer.json` files and
//! produces exactly the ids HF `tokenizers` produces, fast and without allocating.
//!
//! Main types: [`Tokenizer`] (immutable, shared across threads) and [`Scratch`]
//! (caller-owned working memory, one per thread). See `tokenizer/DESIGN.md` for the trie
//! layout, the Viterbi lattice and the normalizer.
//!
//! ```no_run
//! use trellis_tokenizer::{Scratch, Tokenizer};
//! let tok = Tokenizer::from_file("tokenizer.json").unwrap();
//! let mut scratch = Scratch::new();
//! let mut ids = Vec::new();
//! tok.encode_into("Hello, my dog is cute", true, None, &mut scratch, &mut ids).unwrap();
//! assert_eq!(tok.decode(&ids, true), "Hello, my dog is cute");
//! ```
#![deny(missing_docs)]

mod added;
mod charsmap;
mod clusters;
mod error;
mod load;
mod normalizer;
mod pages;
mod tokenizer;
mod trie;
mod unigram;
mod words;

#[cfg(feature = "python")]
mod python;

pub use error::Error;
pub use pages::PageKind;
pub use tokenizer::{longest_first, Encoding, PairLimits, Scratch, Tokenizer};
pub use unigram::{Unigram, ViterbiScratch};
pub use words::DEFAULT_WORD_CACHE;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exported_types_are_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<Tokenizer>();
        check::<Scratch>();
        check::<Unigram>();
        check::<Error>();
    }
}
