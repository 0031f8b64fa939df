//! Sequences run alone and together through [`Forward::step_parts`]: the steps the batch
//! tests of every engine (CPU, reference, CUDA) compare bit for bit.

use brook_core::Logits;
use brook_core::engine::{Forward, Part};

use super::argmax;

/// Tokens per chunk of the engines these steps run on.
pub const CHUNK: usize = 4;

/// Each sequence's prompt: lengths around the chunk (one token, exactly a chunk, several
/// chunks with a remainder).
pub fn prompts() -> Vec<Vec<u32>> {
    vec![
        vec![11, 4, 7],
        vec![9],
        vec![3, 1, 4, 1, 5, 9, 2, 6, 5, 3],
        vec![2, 7, 1, 8],
    ]
}

pub const DECODE: usize = 5;

/// What a sequence feeds next: its prompt in chunks of `CHUNK` (logits of the last only),
/// then its greedy tokens one at a time. Returns every step's logits.
#[derive(Debug)]
struct Seq {
    prompt: Vec<u32>,
    fed: usize,
    decoded: usize,
    next: Option<u32>,
    logits: Vec<Vec<f32>>,
}

impl Seq {
    fn new(prompt: Vec<u32>) -> Self {
        Seq {
            prompt,
            fed: 0,
            decoded: 0,
            next: None,
            logits: Vec::new(),
        }
    }
    fn done(&self) -> bool {
        self.decoded == DECODE
    }
    /// The tokens of the next part and the logits it wants.
    fn part(&self) -> (Vec<u32>, Logits) {
        if self.fed < self.prompt.len() {
            let end = (self.fed + CHUNK).min(self.prompt.len());
            let want = if end == self.prompt.len() {
                Logits::Last
            } else {
                Logits::None
            };
            (self.prompt[self.fed..end].to_vec(), want)
        } else {
            (vec![self.next.expect("a sampled token")], Logits::Last)
        }
    }
    fn advance(&mut self, n: usize, out: &[f32]) {
        if self.fed < self.prompt.len() {
            self.fed += n;
        } else {
            self.decoded += 1;
        }
        if !out.is_empty() {
            self.next = Some(argmax(out));
            self.logits.push(out.to_vec());
        }
    }
}

/// Runs every sequence to the end, `together` (sequence i joins at step i) or each alone.
pub fn run(fw: &mut Forward<'_>, together: bool) -> Vec<Vec<Vec<f32>>> {
    let mut seqs: Vec<Seq> = prompts().into_iter().map(Seq::new).collect();
    let mut states: Vec<_> = seqs.iter().map(|_| fw.new_state(64)).collect();
    if !together {
        for (s, st) in seqs.iter_mut().zip(&mut states) {
            while !s.done() {
                let (tokens, want) = s.part();
                let mut out = Vec::new();
                let mut p = [Part {
                    state: st,
                    tokens: &tokens,
                    want,
                    out: &mut out,
                    result: Ok(()),
                }];
                fw.step_parts(&mut p);
                let [p] = p;
                p.result.expect("step alone");
                s.advance(tokens.len(), &out);
            }
        }
    } else {
        let mut step = 0;
        while seqs.iter().any(|s| !s.done()) {
            let live: Vec<usize> = (0..seqs.len())
                .filter(|&i| i <= step && !seqs[i].done())
                .collect();
            let parts_in: Vec<(Vec<u32>, Logits)> = live.iter().map(|&i| seqs[i].part()).collect();
            let mut outs: Vec<Vec<f32>> = live.iter().map(|_| Vec::new()).collect();
            {
                let mut states_live: Vec<_> = states
                    .iter_mut()
                    .enumerate()
                    .filter(|(i, _)| live.contains(i))
                    .map(|(_, s)| s)
                    .collect();
                let mut parts: Vec<Part<'_>> = states_live
                    .iter_mut()
                    .zip(&parts_in)
                    .zip(&mut outs)
                    .map(|((st, (tokens, want)), out)| Part {
                        state: st,
                        tokens,
                        want: *want,
                        out,
                        result: Ok(()),
                    })
                    .collect();
                fw.step_parts(&mut parts);
                for p in parts {
                    p.result.expect("step together");
                }
            }
            for ((&i, (tokens, _)), out) in live.iter().zip(&parts_in).zip(&outs) {
                seqs[i].advance(tokens.len(), out);
            }
            step += 1;
        }
    }
    seqs.into_iter().map(|s| s.logits).collect()
}

pub fn assert_same_bits(alone: &[Vec<Vec<f32>>], together: &[Vec<Vec<f32>>], what: &str) {
    for (i, (a, b)) in alone.iter().zip(together).enumerate() {
        assert_eq!(a.len(), b.len(), "{what}: sequence {i}'s steps");
        for (j, (x, y)) in a.iter().zip(b).enumerate() {
            let same =
                x.len() == y.len() && x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits());
            assert!(
                same,
                "{what}: sequence {i}, logits {j} differ beside other sequences"
            );
        }
    }
}
