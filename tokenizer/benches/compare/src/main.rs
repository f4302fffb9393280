//! One-thread latency of Trellis' tokenizer against HF's `tokenizers` crate on the same
//! tokenizer.json and texts, with heap allocations counted over the measured window.
//!
//! `compare TOKENIZER_JSON TEXTS_JSONL [ours|hf|both] [rounds] [WARMUP_JSONL]` prints one JSON object
//! per line: wall-clock p50/p99 per call and the same for the calling thread's CPU time
//! (`CLOCK_THREAD_CPUTIME_ID`), which leaves out the time spent preempted — on a machine
//! shared with other jobs, a call of several milliseconds is almost always preempted, so
//! its wall-clock time grows faster than its work. The warm-up pass runs over the measured
//! texts, or over `WARMUP_JSONL` when given (then nothing measured was seen before its
//! first round: per-word caches only help across documents). `TRELLIS_WORD_CACHE=N` sets
//! our scratch's word cache to N entries (0: off; default: the crate's). Under callgrind,
//! `--toggle-collect=*measured_*` counts only the encode loops.

use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use trellis_tokenizer::{Scratch, Tokenizer};

struct Counting;
static ALLOCS: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator; only counts calls.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: caller's contract.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: caller's contract.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: caller's contract.
        unsafe { System.realloc(p, l, n) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// CPU time consumed by the calling thread, in nanoseconds.
fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; the clock id is a Linux constant.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Wall-clock and thread-CPU nanoseconds per call.
#[derive(Default)]
struct Times {
    wall: Vec<u64>,
    cpu: Vec<u64>,
}

impl Times {
    #[inline(always)]
    fn time<R>(&mut self, f: impl FnOnce() -> R) -> R {
        let (c0, t0) = (thread_cpu_ns(), Instant::now());
        let r = f();
        self.wall.push(t0.elapsed().as_nanos() as u64);
        self.cpu.push(thread_cpu_ns() - c0);
        r
    }

    fn json(&mut self) -> String {
        format!(
            "\"p50_us\":{:.2},\"p99_us\":{:.2},\"cpu_p50_us\":{:.2},\"cpu_p99_us\":{:.2}",
            pct(&mut self.wall, 0.5),
            pct(&mut self.wall, 0.99),
            pct(&mut self.cpu, 0.5),
            pct(&mut self.cpu, 0.99)
        )
    }
}

#[inline(never)]
fn measured_ours(
    tok: &Tokenizer,
    texts: &[String],
    s: &mut Scratch,
    out: &mut Vec<u32>,
    times: &mut Times,
) -> usize {
    let mut n = 0;
    for t in texts {
        times.time(|| tok.encode_into(t, true, None, s, out).unwrap());
        n += black_box(out.len());
    }
    n
}

#[inline(never)]
fn measured_hf(tok: &tokenizers::Tokenizer, texts: &[String], times: &mut Times) -> usize {
    let mut n = 0;
    for t in texts {
        let e = times.time(|| tok.encode(t.as_str(), true).unwrap());
        n += black_box(e.get_ids().len());
    }
    n
}

fn pct(times: &mut [u64], p: f64) -> f64 {
    times.sort_unstable();
    let i = ((times.len() as f64 - 1.0) * p).round() as usize;
    times[i] as f64 / 1000.0
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (json, texts_path) = (&args[1], &args[2]);
    let which = args.get(3).map_or("both", String::as_str);
    let rounds: usize = args.get(4).map_or(3, |r| r.parse().unwrap());
    let read = |path: &str| -> Vec<String> {
        std::fs::read_to_string(path)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    let texts = read(texts_path);
    let warmup = args.get(5).map_or_else(|| texts.clone(), |p| read(p));
    if which != "hf" {
        let tok = Tokenizer::from_file(json).unwrap();
        let mut s = match std::env::var("TRELLIS_WORD_CACHE") {
            Ok(n) => Scratch::with_word_cache(n.parse().expect("TRELLIS_WORD_CACHE: entries")),
            Err(_) => Scratch::new(),
        };
        let mut out = Vec::new();
        let mut times = Times {
            wall: Vec::with_capacity(texts.len() * rounds),
            cpu: Vec::with_capacity(texts.len() * rounds),
        };
        // Warm-up (outside the measured functions): the scratch grows to the inputs.
        for t in &warmup {
            tok.encode_into(t, true, None, &mut s, &mut out).unwrap();
        }
        let before = ALLOCS.load(Ordering::Relaxed);
        let mut tokens = 0;
        for _ in 0..rounds {
            tokens = measured_ours(&tok, &texts, &mut s, &mut out, &mut times);
        }
        let allocs = ALLOCS.load(Ordering::Relaxed) - before;
        println!(
            "{{\"impl\":\"ours\",\"texts\":{},\"tokens\":{},{},\"allocs_per_call\":{:.3},\"pages\":\"{}\",\"word_cache\":{}}}",
            texts.len(), tokens / texts.len(), times.json(),
            allocs as f64 / (texts.len() * rounds) as f64, tok.page_kind(), s.word_cache_entries()
        );
    }
    if which != "ours" {
        let tok = tokenizers::Tokenizer::from_file(json).unwrap();
        let mut times = Times {
            wall: Vec::with_capacity(texts.len() * rounds),
            cpu: Vec::with_capacity(texts.len() * rounds),
        };
        for t in &warmup {
            black_box(tok.encode(t.as_str(), true).unwrap());
        }
        let before = ALLOCS.load(Ordering::Relaxed);
        let mut tokens = 0;
        for _ in 0..rounds {
            tokens = measured_hf(&tok, &texts, &mut times);
        }
        let allocs = ALLOCS.load(Ordering::Relaxed) - before;
        println!(
            "{{\"impl\":\"hf\",\"texts\":{},\"tokens\":{},{},\"allocs_per_call\":{:.3}}}",
            texts.len(),
            tokens / texts.len(),
            times.json(),
            allocs as f64 / (texts.len() * rounds) as f64
        );
    }
}
