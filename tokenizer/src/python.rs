//! The Python extension module `tokenizer._native` (pyo3).
//!
//! Errors from the crate become `TokenizerError` (a `ValueError`) here and only here.
//! Batch calls release the GIL and run on the calling thread plus one scoped thread per
//! further core (`rayon::current_num_threads()`, so `RAYON_NUM_THREADS` caps them), each
//! with its own [`Scratch`]; single calls release the GIL when the input is long. Each
//! tokenizer keeps its own pool of grown scratches ([`Scratches`]), so that a scratch's
//! word cache only ever holds one tokenizer's words.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use numpy::{PyArray1, PyArrayMethods};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyList, PyString, PyTuple};

use crate::{Error, PairLimits, Scratch, Tokenizer};

pyo3::create_exception!(
    _native,
    TokenizerError,
    PyValueError,
    "A tokenizer file could not be loaded or an input could not be encoded."
);

/// Inputs at least this long (bytes) are encoded with the GIL released.
const RELEASE_GIL_BYTES: usize = 4096;

/// Batches shorter than this (bytes of text in all) are encoded on the calling thread: about
/// 10 µs of work at ~0.4 GB/s, under what starting a thread and joining it costs.
const PARALLEL_BYTES: usize = 4096;

/// One tokenizer's grown scratches, lent to whichever thread encodes with it and given
/// back after the call: as many as threads have encoded at once, each reused from call to
/// call (a thread-local scratch shared by all tokenizers would have its word cache emptied
/// every time a thread switched between two of them).
struct Scratches {
    spares: Mutex<Vec<Scratch>>,
    /// Word-cache entries of each new scratch ([`Scratch::with_word_cache`]).
    word_cache: usize,
}

impl Scratches {
    fn new(word_cache: usize) -> Self {
        Self {
            spares: Mutex::new(Vec::new()),
            // as the scratches will round it (a power of two; 0: off)
            word_cache: Scratch::with_word_cache(word_cache).word_cache_entries(),
        }
    }

    /// Runs `f` with a scratch of the pool (a new one when all are lent out).
    fn with<R>(&self, f: impl FnOnce(&mut Scratch) -> R) -> R {
        let lock = || self.spares.lock().unwrap_or_else(|e| e.into_inner());
        let popped = lock().pop();
        let mut s = popped.unwrap_or_else(|| Scratch::with_word_cache(self.word_cache));
        let r = f(&mut s);
        lock().push(s);
        r
    }
}

fn to_py(e: Error) -> PyErr {
    TokenizerError::new_err(e.to_string())
}

/// Borrows the strings of a list or tuple of `str` (anything else: `TypeError`).
fn str_items<'a, 'py>(
    seq: &'a Bound<'py, PyAny>,
    what: &str,
) -> PyResult<Vec<Bound<'py, PyString>>> {
    let items: Vec<Bound<'py, PyAny>> = if let Ok(l) = seq.cast::<PyList>() {
        l.iter().collect()
    } else if let Ok(t) = seq.cast::<PyTuple>() {
        t.iter().collect()
    } else {
        return Err(PyTypeError::new_err(format!(
            "{what} must be a list or tuple of str, not {}",
            seq.get_type().name()?
        )));
    };
    items
        .into_iter()
        .enumerate()
        .map(|(i, it)| {
            it.cast_into::<PyString>().map_err(|e| {
                PyTypeError::new_err(format!(
                    "{what}[{i}] must be str, not {}",
                    e.into_inner()
                        .get_type()
                        .name()
                        .map(|n| n.to_string())
                        .unwrap_or_default()
                ))
            })
        })
        .collect()
}

fn as_strs<'a>(items: &'a [Bound<'_, PyString>]) -> PyResult<Vec<&'a str>> {
    items.iter().map(|s| s.to_str()).collect()
}

/// Ids and lengths of a packed batch.
type Packed = (Vec<u32>, Vec<u32>);
/// A packed uint32 numpy array.
type U32Array<'py> = Bound<'py, PyArray1<u32>>;

/// Runs `job(i, scratch)` for every `i < n` on the calling thread plus one scoped thread
/// per further core (`rayon::current_num_threads()`), each taking the next index from a
/// shared counter; results come back in index order.
///
/// Why not the rayon pool: with the caller blocked and both pool workers asleep, the second
/// worker was often woken onto the core already busy, so about half of the 256-text batches
/// ran on one core from start to end (16 ms wall = 16 ms CPU against 8 ms / 16 ms when both
/// worked). Here the caller starts at once and a fresh thread is placed on an idle core, so
/// a batch is never slower than one thread doing it all. Spawning costs tens of µs, which
/// batches that need several cores dwarf; `bytes` (the batch's text length) below
/// [`PARALLEL_BYTES`] runs everything on the calling thread instead. Every thread borrows
/// a grown scratch from the tokenizer's pool and puts it back, so a steady stream of
/// batches does not regrow scratch every call.
fn on_all_cores<T: Send>(
    n: usize,
    bytes: usize,
    scratches: &Scratches,
    job: impl Fn(usize, &mut Scratch) -> T + Sync,
) -> Vec<T> {
    if bytes < PARALLEL_BYTES {
        return scratches.with(|s| (0..n).map(|i| job(i, s)).collect());
    }
    let slots: Vec<Mutex<Option<T>>> = (0..n).map(|_| Mutex::new(None)).collect();
    let next = AtomicUsize::new(0);
    let run = |s: &mut Scratch| loop {
        let i = next.fetch_add(1, Ordering::Relaxed);
        if i >= n {
            break;
        }
        let out = job(i, s);
        *slots[i].lock().unwrap_or_else(|e| e.into_inner()) = Some(out);
    };
    std::thread::scope(|scope| {
        for _ in 1..rayon::current_num_threads().min(n) {
            scope.spawn(|| scratches.with(run));
        }
        scratches.with(run);
    });
    slots
        .into_iter()
        .map(|m| {
            m.into_inner()
                .unwrap_or_else(|e| e.into_inner())
                .expect("every index ran")
        })
        .collect()
}

/// Splits `items` into about 16 chunks per core (so that when a neighbour slows one core
/// the others take over at a fine grain).
fn chunks_of<T>(items: &[T]) -> Vec<&[T]> {
    let chunk = items
        .len()
        .div_ceil(rayon::current_num_threads() * 16)
        .max(1);
    items.chunks(chunk).collect()
}

fn total_bytes(texts: &[&str]) -> usize {
    texts.iter().map(|t| t.len()).sum()
}

/// `encode_into`, or `encode_split_special_into` when `split_special_tokens`.
fn encode_one(
    tok: &Tokenizer,
    text: &str,
    add_special_tokens: bool,
    max_length: Option<usize>,
    split_special_tokens: bool,
    scratch: &mut Scratch,
    out: &mut Vec<u32>,
) -> Result<(), Error> {
    if split_special_tokens {
        tok.encode_split_special_into(text, add_special_tokens, max_length, scratch, out)
    } else {
        tok.encode_into(text, add_special_tokens, max_length, scratch, out)
    }
}

/// Encodes `texts` in parallel into one flat id buffer plus per-text lengths.
fn encode_packed(
    tok: &Tokenizer,
    scratches: &Scratches,
    texts: &[&str],
    add_special_tokens: bool,
    max_length: Option<usize>,
    split_special_tokens: bool,
) -> Result<(Vec<u32>, Vec<u32>), Error> {
    let chunks = chunks_of(texts);
    let parts: Vec<Result<Packed, Error>> =
        on_all_cores(chunks.len(), total_bytes(texts), scratches, |i, s| {
            let mut ids = Vec::new();
            let mut lengths = Vec::with_capacity(chunks[i].len());
            let mut one = Vec::new();
            for t in chunks[i] {
                let (add, max, split) = (add_special_tokens, max_length, split_special_tokens);
                encode_one(tok, t, add, max, split, s, &mut one)?;
                ids.extend_from_slice(&one);
                lengths.push(one.len() as u32);
            }
            Ok((ids, lengths))
        });
    let mut ids = Vec::new();
    let mut lengths = Vec::with_capacity(texts.len());
    for p in parts {
        let (i, l) = p?;
        ids.extend_from_slice(&i);
        lengths.extend_from_slice(&l);
    }
    Ok((ids, lengths))
}

/// A Unigram tokenizer loaded from a Hugging Face `tokenizer.json`.
#[pyclass(name = "Tokenizer", module = "tokenizer._native", frozen)]
struct PyTokenizer {
    inner: Arc<Tokenizer>,
    scratches: Scratches,
}

#[pymethods]
impl PyTokenizer {
    /// Loads `path`; raises TokenizerError naming any unsupported component.
    /// `word_cache`: entries (64 bytes each) of each scratch's cache of short words'
    /// ids; 0 turns it off. Output is the same with any value.
    #[staticmethod]
    #[pyo3(signature = (path, word_cache=crate::DEFAULT_WORD_CACHE))]
    fn from_file(py: Python<'_>, path: &str, word_cache: usize) -> PyResult<Self> {
        let path = path.to_owned();
        let tok = py
            .detach(move || Tokenizer::from_file(&path))
            .map_err(to_py)?;
        Ok(Self {
            inner: Arc::new(tok),
            scratches: Scratches::new(word_cache),
        })
    }

    /// Entries of each scratch's word cache (a power of two; 0: off).
    #[getter]
    fn word_cache(&self) -> usize {
        self.scratches.word_cache
    }

    /// Number of distinct tokens, added tokens included.
    #[getter]
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }

    /// Which pages back the trie: "hugetlb", "thp" or "normal".
    #[getter]
    fn page_kind(&self) -> String {
        self.inner.page_kind().to_string()
    }

    /// The special added tokens (`<s>`, `<mask>`, ...): content -> id.
    #[getter]
    fn special_tokens(&self) -> std::collections::HashMap<String, u32> {
        self.inner
            .special_tokens()
            .map(|(t, id)| (t.to_owned(), id))
            .collect()
    }

    /// Bytes held by the growable buffers of this tokenizer's idle scratches (their word
    /// caches left out); for tests that check one oversized input does not stay in them.
    fn _scratch_bytes(&self) -> usize {
        let spares = self
            .scratches
            .spares
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        spares.iter().map(Scratch::buffer_bytes).sum()
    }

    fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id).map(str::to_owned)
    }

    /// `split_special_tokens`: special added tokens written in the text (`<s>`, ...)
    /// are tokenized as plain text instead of becoming their ids.
    #[pyo3(signature = (text, add_special_tokens=true, max_length=None, split_special_tokens=false))]
    fn encode(
        &self,
        py: Python<'_>,
        text: &str,
        add_special_tokens: bool,
        max_length: Option<usize>,
        split_special_tokens: bool,
    ) -> PyResult<Vec<u32>> {
        let tok = &*self.inner;
        let run = || {
            self.scratches.with(|s| {
                let mut out = Vec::new();
                let (add, max, split) = (add_special_tokens, max_length, split_special_tokens);
                encode_one(tok, text, add, max, split, s, &mut out).map(|()| out)
            })
        };
        let r = if text.len() >= RELEASE_GIL_BYTES {
            py.detach(run)
        } else {
            run()
        };
        r.map_err(to_py)
    }

    #[pyo3(signature = (texts, add_special_tokens=true, max_length=None, split_special_tokens=false))]
    fn encode_batch(
        &self,
        py: Python<'_>,
        texts: &Bound<'_, PyAny>,
        add_special_tokens: bool,
        max_length: Option<usize>,
        split_special_tokens: bool,
    ) -> PyResult<Vec<Vec<u32>>> {
        let items = str_items(texts, "texts")?;
        let strs = as_strs(&items)?;
        let tok = &*self.inner;
        let chunks = chunks_of(&strs);
        type Part = Result<Vec<Vec<u32>>, Error>;
        let parts: Vec<Part> = py.detach(|| {
            on_all_cores(chunks.len(), total_bytes(&strs), &self.scratches, |i, s| {
                chunks[i]
                    .iter()
                    .map(|t| {
                        let mut out = Vec::new();
                        let (add, max, split) =
                            (add_special_tokens, max_length, split_special_tokens);
                        encode_one(tok, t, add, max, split, s, &mut out).map(|()| out)
                    })
                    .collect()
            })
        });
        let mut all = Vec::with_capacity(strs.len());
        for p in parts {
            all.extend(p.map_err(to_py)?);
        }
        Ok(all)
    }

    #[pyo3(signature = (texts, add_special_tokens=true, max_length=None, split_special_tokens=false))]
    fn encode_batch_packed<'py>(
        &self,
        py: Python<'py>,
        texts: &Bound<'py, PyAny>,
        add_special_tokens: bool,
        max_length: Option<usize>,
        split_special_tokens: bool,
    ) -> PyResult<(U32Array<'py>, U32Array<'py>)> {
        let items = str_items(texts, "texts")?;
        let strs = as_strs(&items)?;
        let tok = &*self.inner;
        let (add, max, split) = (add_special_tokens, max_length, split_special_tokens);
        let (ids, lengths) = py
            .detach(|| encode_packed(tok, &self.scratches, &strs, add, max, split))
            .map_err(to_py)?;
        Ok((PyArray1::from_vec(py, ids), PyArray1::from_vec(py, lengths)))
    }

    #[pyo3(signature = (a, b, add_special_tokens=true, max_length=None))]
    fn encode_pair(
        &self,
        py: Python<'_>,
        a: &str,
        b: &str,
        add_special_tokens: bool,
        max_length: Option<usize>,
    ) -> PyResult<Vec<u32>> {
        let tok = &*self.inner;
        let run = || {
            self.scratches.with(|s| {
                let mut out = Vec::new();
                let limits = PairLimits {
                    max_length,
                    ..PairLimits::default()
                };
                tok.encode_pair_into(a, b, add_special_tokens, limits, s, &mut out)
                    .map(|_| out)
            })
        };
        let r = if a.len() + b.len() >= RELEASE_GIL_BYTES {
            py.detach(run)
        } else {
            run()
        };
        r.map_err(to_py)
    }

    #[pyo3(signature = (query, documents, max_length=None, max_second=None, left=false))]
    fn encode_pairs_packed<'py>(
        &self,
        py: Python<'py>,
        query: &str,
        documents: &Bound<'py, PyAny>,
        max_length: Option<usize>,
        max_second: Option<usize>,
        left: bool,
    ) -> PyResult<(U32Array<'py>, U32Array<'py>, U32Array<'py>)> {
        let items = str_items(documents, "documents")?;
        let docs = as_strs(&items)?;
        let tok = &*self.inner;
        let limits = PairLimits {
            max_length,
            max_second,
            left,
        };
        let chunks = chunks_of(&docs);
        let bytes = total_bytes(&docs) + query.len() * docs.len();
        type Part = Result<(Vec<u32>, Vec<u32>, Vec<u32>), Error>;
        let parts: Vec<Part> = py.detach(|| {
            on_all_cores(chunks.len(), bytes, &self.scratches, |i, s| {
                let (mut ids, mut lens, mut firsts) = (Vec::new(), Vec::new(), Vec::new());
                let mut one = Vec::new();
                for d in chunks[i] {
                    let first = tok.encode_pair_into(query, d, true, limits, s, &mut one)?;
                    ids.extend_from_slice(&one);
                    lens.push(one.len() as u32);
                    firsts.push(first as u32);
                }
                Ok((ids, lens, firsts))
            })
        });
        let (mut ids, mut lens, mut firsts) = (Vec::new(), Vec::new(), Vec::new());
        for p in parts {
            let (i, l, f) = p.map_err(to_py)?;
            ids.extend_from_slice(&i);
            lens.extend_from_slice(&l);
            firsts.extend_from_slice(&f);
        }
        Ok((
            PyArray1::from_vec(py, ids),
            PyArray1::from_vec(py, lens),
            PyArray1::from_vec(py, firsts),
        ))
    }

    #[pyo3(signature = (text, add_special_tokens=true))]
    fn encode_with_offsets(
        &self,
        py: Python<'_>,
        text: &str,
        add_special_tokens: bool,
    ) -> (Vec<u32>, Vec<(usize, usize)>) {
        let tok = &*self.inner;
        py.detach(|| {
            let enc = tok.encode_with_offsets(text, add_special_tokens);
            // Byte offsets → character offsets (Python indexes str by code point).
            let mut char_at = vec![0usize; text.len() + 1];
            let mut n = 0;
            for (i, _) in text.char_indices() {
                char_at[i] = n;
                n += 1;
            }
            char_at[text.len()] = n;
            let offsets = enc
                .offsets
                .iter()
                .map(|&(s, e)| (char_at[s], char_at[e]))
                .collect();
            (enc.ids, offsets)
        })
    }

    #[pyo3(signature = (ids, skip_special_tokens=true))]
    fn decode(&self, ids: &Bound<'_, PyAny>, skip_special_tokens: bool) -> PyResult<String> {
        if ids.is_instance_of::<PyString>() {
            return Err(PyTypeError::new_err(
                "ids must be a sequence of int, not str",
            ));
        }
        let ids: Vec<u32> = if let Ok(arr) = ids.cast::<PyArray1<u32>>() {
            arr.to_vec()
                .map_err(|e| PyTypeError::new_err(e.to_string()))?
        } else {
            ids.extract()?
        };
        Ok(self.inner.decode(&ids, skip_special_tokens))
    }

    fn __repr__(&self) -> String {
        format!(
            "Tokenizer(vocab_size={}, pages={})",
            self.inner.vocab_size(),
            self.inner.page_kind()
        )
    }
}

/// The Python extension module `tokenizer._native`.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<PyTokenizer>()?;
    m.add("TokenizerError", m.py().get_type::<TokenizerError>())?;
    Ok(())
}
