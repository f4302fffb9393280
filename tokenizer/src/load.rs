//! Reading `tokenizer.json`: every component is checked against what this crate
//! implements, and anything else is refused with an error naming it.

use serde_json::Value;

use crate::added::AddedToken;
use crate::charsmap::CharsMap;
use crate::error::Error;
use crate::normalizer::{Pattern, Step};

/// How Metaspace adds the replacement character in front of a word.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Prepend {
    Always,
    Never,
}

/// The Metaspace pre-tokenizer / decoder settings.
#[derive(Debug, Clone)]
pub(crate) struct Metaspace {
    pub(crate) replacement: char,
    pub(crate) prepend: Prepend,
    pub(crate) split: bool,
}

/// The supported pre-tokenizer shapes: optional `WhitespaceSplit`, then optional
/// `Metaspace`.
#[derive(Debug, Clone, Default)]
pub(crate) struct PreTokenizer {
    pub(crate) whitespace_split: bool,
    pub(crate) metaspace: Option<Metaspace>,
}

/// One element of a template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum TemplateItem {
    /// The first (`A`) or second (`B`) sequence.
    Sequence(bool),
    /// Special token ids.
    Special(Vec<u32>),
}

/// Everything `tokenizer.json` says, in checked form.
#[derive(Debug)]
pub(crate) struct Spec {
    pub(crate) vocab: Vec<(String, f64)>,
    pub(crate) unk_id: u32,
    pub(crate) added: Vec<AddedToken>,
    pub(crate) normalizer: Vec<Step>,
    pub(crate) pre: PreTokenizer,
    pub(crate) single: Vec<TemplateItem>,
    pub(crate) pair: Vec<TemplateItem>,
    pub(crate) decoder: Option<Metaspace>,
}

fn ty<'a>(v: &'a Value, what: &str) -> Result<&'a str, Error> {
    v.get("type")
        .and_then(Value::as_str)
        .ok_or_else(|| Error::invalid(what, "missing \"type\""))
}

fn flag(v: &Value, key: &str, default: bool) -> bool {
    v.get(key).and_then(Value::as_bool).unwrap_or(default)
}

pub(crate) fn parse(json: &str) -> Result<Spec, Error> {
    let root: Value = serde_json::from_str(json).map_err(|e| Error::json(&e))?;
    let model = root
        .get("model")
        .ok_or_else(|| Error::invalid("model", "missing"))?;
    let model_type = model.get("type").and_then(Value::as_str).unwrap_or("");
    if model_type != "Unigram" {
        let name = if model_type.is_empty() {
            "(untyped, e.g. WordPiece/BPE)"
        } else {
            model_type
        };
        return Err(Error::unsupported(
            "model",
            format!("{name}; only Unigram is implemented"),
        ));
    }
    if flag(model, "byte_fallback", false) {
        return Err(Error::unsupported("model.Unigram.byte_fallback", "true"));
    }
    let vocab = model
        .get("vocab")
        .and_then(Value::as_array)
        .ok_or_else(|| Error::invalid("model.Unigram.vocab", "missing"))?
        .iter()
        .enumerate()
        .map(|(i, e)| {
            let piece = e.get(0).and_then(Value::as_str);
            let score = e.get(1).and_then(Value::as_f64);
            match (piece, score) {
                (Some(p), Some(s)) => Ok((p.to_owned(), s)),
                _ => Err(Error::invalid(
                    "model.Unigram.vocab",
                    format!("entry {i} is not [piece, score]"),
                )),
            }
        })
        .collect::<Result<Vec<_>, _>>()?;
    let unk_id = match model.get("unk_id") {
        Some(Value::Number(n)) => n.as_u64().filter(|&u| (u as usize) < vocab.len()),
        _ => None,
    }
    .ok_or_else(|| Error::unsupported("model.Unigram.unk_id", "missing or out of range"))?
        as u32;

    let added = match root.get("added_tokens") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => a.iter().map(added_token).collect::<Result<_, _>>()?,
        Some(_) => return Err(Error::invalid("added_tokens", "not a list")),
    };
    let normalizer = match root.get("normalizer") {
        None | Some(Value::Null) => Vec::new(),
        Some(v) => normalizer(v, "normalizer")?,
    };
    let pre = match root.get("pre_tokenizer") {
        None | Some(Value::Null) => PreTokenizer::default(),
        Some(v) => pre_tokenizer(v)?,
    };
    let (single, pair) = match root.get("post_processor") {
        None | Some(Value::Null) => (
            vec![TemplateItem::Sequence(false)],
            vec![TemplateItem::Sequence(false), TemplateItem::Sequence(true)],
        ),
        Some(v) => post_processor(v)?,
    };
    let decoder = match root.get("decoder") {
        None | Some(Value::Null) => None,
        Some(v) => match ty(v, "decoder")? {
            "Metaspace" => Some(metaspace(v, "decoder.Metaspace")?),
            other => return Err(Error::unsupported("decoder", other)),
        },
    };
    for key in ["truncation", "padding"] {
        if !matches!(root.get(key), None | Some(Value::Null)) {
            return Err(Error::unsupported(
                key,
                "set in the file (pass max_length instead)",
            ));
        }
    }
    Ok(Spec {
        vocab,
        unk_id,
        added,
        normalizer,
        pre,
        single,
        pair,
        decoder,
    })
}

fn added_token(v: &Value) -> Result<AddedToken, Error> {
    let id = v.get("id").and_then(Value::as_u64);
    let content = v.get("content").and_then(Value::as_str);
    let (Some(id), Some(content)) = (id, content) else {
        return Err(Error::invalid("added_tokens", "entry without id/content"));
    };
    Ok(AddedToken {
        id: id as u32,
        content: content.into(),
        single_word: flag(v, "single_word", false),
        lstrip: flag(v, "lstrip", false),
        rstrip: flag(v, "rstrip", false),
        normalized: flag(v, "normalized", true),
        special: flag(v, "special", false),
    })
}

fn normalizer(v: &Value, what: &str) -> Result<Vec<Step>, Error> {
    let t = ty(v, what)?;
    let here = format!("{what}.{t}");
    match t {
        "Sequence" => {
            let list = v
                .get("normalizers")
                .and_then(Value::as_array)
                .ok_or_else(|| Error::invalid(&here, "no normalizers"))?;
            let mut steps = Vec::new();
            for (i, n) in list.iter().enumerate() {
                steps.extend(normalizer(n, &format!("{here}[{i}]"))?);
            }
            Ok(steps)
        }
        "Precompiled" => {
            let b64 = v
                .get("precompiled_charsmap")
                .and_then(Value::as_str)
                .unwrap_or("");
            let blob = base64_decode(b64)
                .ok_or_else(|| Error::invalid(&here, "precompiled_charsmap is not base64"))?;
            Ok(vec![Step::Precompiled(Box::new(CharsMap::parse(&blob)?))])
        }
        "Strip" => Ok(vec![Step::Strip {
            left: flag(v, "strip_left", false),
            right: flag(v, "strip_right", false),
        }]),
        "Replace" => {
            let content = v
                .get("content")
                .and_then(Value::as_str)
                .ok_or_else(|| Error::invalid(&here, "no content"))?;
            let pat = v
                .get("pattern")
                .ok_or_else(|| Error::invalid(&here, "no pattern"))?;
            let pattern = if let Some(s) = pat.get("String").and_then(Value::as_str) {
                Pattern::Literal(s.into())
            } else if let Some(r) = pat.get("Regex").and_then(Value::as_str) {
                regex_pattern(r).ok_or_else(|| Error::unsupported(&here, format!("regex {r:?}")))?
            } else {
                return Err(Error::invalid(&here, "pattern is neither String nor Regex"));
            };
            Ok(vec![Step::Replace {
                pattern,
                content: content.into(),
            }])
        }
        other => Err(Error::unsupported(what, other)),
    }
}

/// The regexes `Replace` supports: a literal without metacharacters, or `"c{n,}"`.
fn regex_pattern(r: &str) -> Option<Pattern> {
    const META: &[char] = &[
        '\\', '.', '+', '*', '?', '(', ')', '|', '[', ']', '{', '}', '^', '$',
    ];
    if !r.is_empty() && !r.contains(META) {
        return Some(Pattern::Literal(r.into()));
    }
    let mut chars = r.chars();
    let ch = chars.next()?;
    if META.contains(&ch) {
        return None;
    }
    let rest = chars.as_str().strip_prefix('{')?.strip_suffix(",}")?;
    let min: usize = rest.parse().ok()?;
    (min >= 1).then_some(Pattern::Run { ch, min })
}

fn pre_tokenizer(v: &Value) -> Result<PreTokenizer, Error> {
    let mut steps: Vec<(&str, &Value)> = Vec::new();
    match ty(v, "pre_tokenizer")? {
        "Sequence" => {
            let list = v
                .get("pretokenizers")
                .and_then(Value::as_array)
                .ok_or_else(|| Error::invalid("pre_tokenizer.Sequence", "no pretokenizers"))?;
            for (i, p) in list.iter().enumerate() {
                steps.push((ty(p, &format!("pre_tokenizer.Sequence[{i}]"))?, p));
            }
        }
        t => steps.push((t, v)),
    }
    let mut pre = PreTokenizer::default();
    for (i, (t, p)) in steps.iter().enumerate() {
        match *t {
            "WhitespaceSplit" if i == 0 => pre.whitespace_split = true,
            "Metaspace" if pre.metaspace.is_none() => {
                pre.metaspace = Some(metaspace(p, "pre_tokenizer.Metaspace")?)
            }
            other => {
                return Err(Error::unsupported(
                    "pre_tokenizer",
                    format!("{other} at position {i} (supported: [WhitespaceSplit,] Metaspace)"),
                ))
            }
        }
    }
    Ok(pre)
}

fn metaspace(v: &Value, what: &str) -> Result<Metaspace, Error> {
    let mut rep = v
        .get("replacement")
        .and_then(Value::as_str)
        .unwrap_or("▁")
        .chars();
    let replacement = rep
        .next()
        .ok_or_else(|| Error::invalid(what, "empty replacement"))?;
    let mut prepend = match v.get("prepend_scheme").and_then(Value::as_str) {
        None | Some("always") => Prepend::Always,
        Some("never") => Prepend::Never,
        Some(other) => return Err(Error::unsupported(&format!("{what}.prepend_scheme"), other)),
    };
    if v.get("add_prefix_space").and_then(Value::as_bool) == Some(false) {
        prepend = Prepend::Never;
    }
    Ok(Metaspace {
        replacement,
        prepend,
        split: flag(v, "split", true),
    })
}

type Templates = (Vec<TemplateItem>, Vec<TemplateItem>);

fn post_processor(v: &Value) -> Result<Templates, Error> {
    match ty(v, "post_processor")? {
        "TemplateProcessing" => {
            let specials = v.get("special_tokens").and_then(Value::as_object);
            let items = |key: &str| -> Result<Vec<TemplateItem>, Error> {
                let what = format!("post_processor.TemplateProcessing.{key}");
                let list = v
                    .get(key)
                    .and_then(Value::as_array)
                    .ok_or_else(|| Error::invalid(&what, "missing"))?;
                list.iter()
                    .map(|it| {
                        if let Some(seq) = it.get("Sequence") {
                            match seq.get("id").and_then(Value::as_str) {
                                Some("A") => Ok(TemplateItem::Sequence(false)),
                                Some("B") => Ok(TemplateItem::Sequence(true)),
                                _ => Err(Error::invalid(&what, "sequence id is not A/B")),
                            }
                        } else if let Some(sp) = it.get("SpecialToken") {
                            let name = sp.get("id").and_then(Value::as_str).unwrap_or("");
                            let ids = specials
                                .and_then(|m| m.get(name))
                                .and_then(|s| s.get("ids"))
                                .and_then(Value::as_array)
                                .ok_or_else(|| {
                                    Error::invalid(
                                        &what,
                                        format!("special token {name:?} not declared"),
                                    )
                                })?;
                            Ok(TemplateItem::Special(
                                ids.iter()
                                    .filter_map(Value::as_u64)
                                    .map(|i| i as u32)
                                    .collect(),
                            ))
                        } else {
                            Err(Error::invalid(
                                &what,
                                "item is neither Sequence nor SpecialToken",
                            ))
                        }
                    })
                    .collect()
            };
            let single = items("single")?;
            let pair = items("pair")?;
            let seqs = |t: &[TemplateItem]| {
                t.iter()
                    .filter(|i| matches!(i, TemplateItem::Sequence(_)))
                    .cloned()
                    .collect::<Vec<_>>()
            };
            if seqs(&single) != [TemplateItem::Sequence(false)]
                || seqs(&pair) != [TemplateItem::Sequence(false), TemplateItem::Sequence(true)]
            {
                return Err(Error::unsupported(
                    "post_processor.TemplateProcessing",
                    "templates other than A / A…B",
                ));
            }
            Ok((single, pair))
        }
        other => Err(Error::unsupported("post_processor", other)),
    }
}

/// Standard base64 (with or without padding).
fn base64_decode(s: &str) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(s.len() * 3 / 4);
    let mut acc = 0u32;
    let mut bits = 0;
    for &c in s.as_bytes() {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            b'=' => break,
            _ => return None,
        };
        acc = (acc << 6) | v as u32;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_round_trip() {
        assert_eq!(base64_decode("aGVsbG8=").unwrap(), b"hello");
        assert_eq!(base64_decode("aGVsbG8").unwrap(), b"hello");
        assert!(base64_decode("a!").is_none());
    }

    #[test]
    fn regex_patterns() {
        assert!(matches!(
            regex_pattern(" {2,}"),
            Some(Pattern::Run { ch: ' ', min: 2 })
        ));
        assert!(matches!(regex_pattern("abc"), Some(Pattern::Literal(_))));
        assert!(regex_pattern("\\s+").is_none());
    }
}
