//! The short form of the fuzzing, run by `cargo test`: every target on its committed corpus
//! (fuzz/corpus/TARGET, which libFuzzer's long runs extend), then on seeded mutations of it for
//! a fixed count, so a run is repeatable and bounded. A panic fails the test and names the
//! input's bytes (written to target/fuzz-failures/ for `cargo fuzz run TARGET FILE`).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Mutated inputs per target, and a time cap per target for slow machines.
const MUTATIONS: usize = 3000;
const CAP: Duration = Duration::from_secs(20);

fn corpus(target: &str) -> Vec<Vec<u8>> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/corpus")
        .join(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("entry").path())
        .collect();
    files.sort();
    files
        .iter()
        .map(|p| std::fs::read(p).expect("read"))
        .collect()
}

/// xorshift64*: the same mutations on every run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// Bytes that matter to these parsers, inserted or overwritten as a whole.
const TOKENS: &[&[u8]] = &[
    b"{",
    b"}",
    b"[",
    b"]",
    b"\"",
    b":",
    b",",
    b"null",
    b"-1",
    b"1e308",
    b"18446744073709551615",
    b"4294967296",
    b"\"data_offsets\"",
    b"\"shape\"",
    b"\"dtype\":\"U32\"",
    b"{%",
    b"%}",
    b"{{",
    b"}}",
    b"namespace(",
    b"range(",
    b"\\u0000",
    b"\xff\xfe",
    b"<think>",
    b"</tool_call>",
    b"\"role\"",
    b"\"content\"",
    b"../",
    b"\"stride\":",
];

fn mutate(rng: &mut Rng, seeds: &[Vec<u8>]) -> Vec<u8> {
    let mut d = seeds[rng.below(seeds.len())].clone();
    for _ in 0..1 + rng.below(4) {
        let at = rng.below(d.len() + 1);
        match rng.below(8) {
            0 if !d.is_empty() => {
                let i = rng.below(d.len());
                d[i] ^= 1 << rng.below(8);
            }
            1 if !d.is_empty() => {
                let i = rng.below(d.len());
                d[i] = rng.next() as u8;
            }
            2 => {
                let t = TOKENS[rng.below(TOKENS.len())];
                d.splice(at..at, t.iter().copied());
            }
            3 if !d.is_empty() => {
                let end = (at + 1 + rng.below(64)).min(d.len());
                d.drain(at.min(end)..end);
            }
            4 if !d.is_empty() => {
                let start = rng.below(d.len());
                let end = (start + 1 + rng.below(256)).min(d.len());
                let piece = d[start..end].to_vec();
                d.splice(at..at, piece);
            }
            5 => d.truncate(at),
            6 => {
                let other = &seeds[rng.below(seeds.len())];
                let from = rng.below(other.len() + 1);
                d.truncate(at);
                d.extend_from_slice(&other[from..]);
            }
            _ if !d.is_empty() => {
                // An 8-byte little-endian integer somewhere (a safetensors length, an id).
                let i = rng.below(d.len());
                let v = [0u64, 1, 7, 1 << 32, u64::MAX, rng.next()][rng.below(6)];
                for (k, b) in v.to_le_bytes().iter().enumerate() {
                    if let Some(x) = d.get_mut(i + k) {
                        *x = *b;
                    }
                }
            }
            _ => d.push(rng.next() as u8),
        }
    }
    d
}

fn run(name: &str, target: fn(&[u8]), data: &[u8]) {
    let r = std::panic::catch_unwind(|| target(data));
    if r.is_err() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/fuzz-failures");
        let _ = std::fs::create_dir_all(&dir);
        let file = dir.join(format!("{name}-{:016x}", fxhash(data)));
        let _ = std::fs::write(&file, data);
        panic!(
            "fuzz target `{name}` panicked on {} bytes, saved to {}",
            data.len(),
            file.display()
        );
    }
}

fn fxhash(d: &[u8]) -> u64 {
    d.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

#[test]
fn every_target_survives_its_corpus_and_seeded_mutations() {
    for &(name, target) in brook_fuzz::TARGETS {
        let seeds = corpus(name);
        assert!(!seeds.is_empty(), "{name}: no corpus");
        let start = Instant::now();
        for s in &seeds {
            run(name, target, s);
        }
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ fxhash(name.as_bytes()));
        let mut n = 0;
        while n < MUTATIONS && start.elapsed() < CAP {
            run(name, target, &mutate(&mut rng, &seeds));
            n += 1;
        }
        eprintln!(
            "{name}: {} corpus inputs and {n} mutations in {:.1} s",
            seeds.len(),
            start.elapsed().as_secs_f64()
        );
    }
}
