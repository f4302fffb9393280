//! Shared helpers for the integration tests: where the XLM-R files are, and text.

#![allow(dead_code)]

use std::path::PathBuf;

/// `$TRELLIS_MODELS_DIR/xlmr-tokenizer/NAME` (default `~/.cache/trellis/models`); the
/// files come from `trellis models pull xlmr-tokenizer` (`make models`).
pub fn xlmr_file(name: &str) -> String {
    let root = std::env::var_os("TRELLIS_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").expect("HOME is set"))
                .join(".cache/trellis/models")
        });
    let path = root.join("xlmr-tokenizer").join(name);
    assert!(
        path.exists(),
        "{} is missing: run `make models` (trellis models pull xlmr-tokenizer)",
        path.display()
    );
    path.to_string_lossy().into_owned()
}

/// Multilingual sample sentences, including characters the charsmap rewrites
/// (full-width forms, NFD marks, CR LF, ligatures, U+3000, emoji sequences).
pub const SENTENCES: &[&str] = &[
    "The quick brown fox jumps over the lazy dog, again and again.",
    "Der schnelle braune Fuchs springt über den faulen Hund – schon wieder!",
    "Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "日本語のテキストはスペースなしで長く続きます。東京は晴れです。",
    "中文文本没有空格，分词器必须处理长片段。",
    "النص العربي يُكتب من اليمين إلى اليسار، وفيه تشكيل أحياناً.",
    "हिन्दी में लिखा गया वाक्य, जिसमें संयुक्ताक्षर हैं।",
    "ＦＵＬＬ　ｗｉｄｔｈ　ｆｏｒｍｓ １２３！ ｶﾀｶﾅ ﬁﬂ ½ ㍿",
    "Cafe\u{301} Zu\u{308}rich\r\nnext line\u{85}nbsp\u{a0}here\tTab",
    "emoji 👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇩🇪 <mask> and <s> inside",
    "Ελληνικά κείμενα και 한국어 문장 그리고 ไทย ภาษา",
    "Supercalifragilisticexpialidocious Donaudampfschifffahrtsgesellschaftskapitän",
];

/// Distinct texts of roughly `target_bytes` bytes, glued from [`SENTENCES`].
pub fn texts(count: usize, target_bytes: usize) -> Vec<String> {
    (0..count)
        .map(|k| {
            let mut s = String::new();
            let mut i = k;
            while s.len() < target_bytes {
                s.push_str(SENTENCES[i % SENTENCES.len()]);
                s.push_str(&format!(" {k}-{i} "));
                i = i.wrapping_mul(7).wrapping_add(3);
            }
            s
        })
        .collect()
}
