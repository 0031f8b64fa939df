//! The driver every engine runs behind (`brook_core::engine::Forward`): chunking to the
//! engine's step size, which logits each step keeps, the context limit, refusing what an
//! engine cannot take, and starting a state afresh after a failed step. An engine here wraps
//! the reference engine, steps at most 3 tokens and can be told to fail.

mod common;

use brook_core::engine::{Caps, Engine, Forward, GivenRoutes, Part, Reference, Routing, Step};
use brook_core::model::argmax;
use brook_core::model::state::SeqState;
use brook_core::{Error, Logits, Model, Result};
use common::{fixture, rel_l2};

/// The reference engine in steps of at most 3 tokens, recording each step's length.
#[derive(Debug)]
struct Small<'m> {
    inner: Reference<'m>,
    steps: Vec<usize>,
    /// Fail the step with this index (0-based), after it has advanced the state.
    fail_at: Option<usize>,
    /// Hand back two floats for a greedy pick (neither the pick nor the logits).
    short_best: bool,
}

impl Engine for Small<'_> {
    fn name(&self) -> &'static str {
        "small"
    }
    fn model(&self) -> &Model {
        self.inner.model()
    }
    fn caps(&self) -> Caps {
        Caps {
            max_chunk: 3,
            ..self.inner.caps()
        }
    }
    fn place(&mut self, state: &mut SeqState, tokens: usize) -> Result<()> {
        self.inner.place(state, tokens)
    }
    fn step(&mut self, step: Step<'_, '_>) -> Result<()> {
        assert_eq!(step.seqs.len(), 1);
        let n = step.seqs[0].tokens.len();
        assert!(n <= 3, "the driver handed {n} tokens to a 3-token engine");
        if self.short_best && step.seqs[0].want == Logits::Best {
            step.seqs[0].logits.extend([0.0, 0.0]);
            return Ok(());
        }
        self.inner.step(step)?;
        self.steps.push(n);
        if self.fail_at == Some(self.steps.len() - 1) {
            return Err(Error::Invalid("injected step failure".into()));
        }
        Ok(())
    }
}

fn small(model: &Model) -> Small<'_> {
    Small {
        inner: Reference::new(model),
        steps: Vec::new(),
        fail_at: None,
        short_best: false,
    }
}

const TOKENS: [u32; 8] = [1, 5, 9, 2, 7, 3, 8, 4];

#[test]
fn calls_split_into_engine_steps_and_keep_the_logits_asked_for() {
    let model = Model::open(&fixture("qwen35-q4")).expect("open");
    let v = model.cfg.vocab_size;
    let whole = model
        .forward(&mut model.new_state(), &TOKENS, Logits::All, None)
        .expect("reference");
    let mut f = Forward::new(small(&model));
    let mut st = f.new_state(0);
    let all = f
        .forward(&mut st, &TOKENS, Logits::All)
        .expect("all")
        .to_vec();
    assert_eq!(all.len(), TOKENS.len() * v);
    assert!(rel_l2(&all, &whole) < 1e-5, "{}", rel_l2(&all, &whole));
    assert_eq!(st.pos, TOKENS.len());

    let mut st = f.new_state(0);
    let last = f
        .forward(&mut st, &TOKENS, Logits::Last)
        .expect("last")
        .to_vec();
    assert_eq!(last.len(), v);
    assert!(rel_l2(&last, &whole[7 * v..]) < 1e-5);
    let mut st = f.new_state(0);
    assert!(
        f.forward(&mut st, &TOKENS, Logits::None)
            .expect("none")
            .is_empty()
    );
    let s = f.stats();
    assert_eq!(
        (s.engine.as_str(), s.forward_calls, s.steps),
        ("small", 3, 9)
    );
    assert_eq!(s.tokens, 3 * TOKENS.len() as u64);
    // The model counts every engine's steps over it: the reference call above was one.
    let counts = vec![("reference".to_string(), 1), ("small".to_string(), 9)];
    assert_eq!(s.model_steps, counts);
}

#[test]
fn a_greedy_pick_is_the_argmax_of_the_last_logits_in_calls_and_batched_steps() {
    let model = Model::open(&fixture("qwen35-q4")).expect("open");
    let mut f = Forward::new(small(&model));
    let mut lasts = Vec::new();
    for n in [1, 3, 8] {
        let mut st = f.new_state(0);
        let last = f
            .forward(&mut st, &TOKENS[..n], Logits::Last)
            .expect("last");
        let want = argmax(last);
        let mut st = f.new_state(0);
        let best = f
            .forward(&mut st, &TOKENS[..n], Logits::Best)
            .expect("best");
        assert_eq!(best.len(), 1);
        assert_eq!(Logits::best_id(best), want, "{n} tokens");
        assert_eq!(st.pos, n);
        lasts.push(want);
    }
    // In a step of several parts, beside parts that ask for their logits or none.
    let mut f = Forward::new(Reference::new(&model));
    let mut states: Vec<SeqState> = (0..3).map(|_| f.new_state(0)).collect();
    let mut outs = vec![Vec::new(); 3];
    let wants = [Logits::Best, Logits::Last, Logits::None];
    let mut parts: Vec<Part<'_>> = states
        .iter_mut()
        .zip(&mut outs)
        .zip(wants)
        .map(|((state, out), want)| Part {
            state,
            tokens: &TOKENS[..1],
            want,
            out,
            result: Ok(()),
        })
        .collect();
    f.step_parts(&mut parts);
    assert!(parts.iter().all(|p| p.result.is_ok()));
    drop(parts);
    assert_eq!(outs[0].len(), 1);
    assert_eq!(Logits::best_id(&outs[0]), lasts[0]);
    assert_eq!(argmax(&outs[1]), lasts[0]);
    assert!(outs[2].is_empty());

    // An engine that hands back something else is an error, not a wrong token.
    let mut broken = small(&model);
    broken.short_best = true;
    let mut f = Forward::new(broken);
    let mut st = f.new_state(0);
    let e = f
        .forward(&mut st, &TOKENS[..2], Logits::Best)
        .expect_err("two floats");
    assert!(e.to_string().contains("greedy pick"), "{e}");
}

#[test]
fn the_context_limit_and_bad_tokens_are_refused_before_any_step() {
    let model = Model::open(&fixture("qwen35-q4")).expect("open");
    let mut f = Forward::with_context(Box::new(small(&model)), 6);
    let mut st = f.new_state(0);
    let e = f
        .forward(&mut st, &TOKENS, Logits::Last)
        .expect_err("too long");
    assert!(e.to_string().contains("context"), "{e}");
    let e = f
        .forward(&mut st, &[u32::MAX], Logits::Last)
        .expect_err("bad id");
    assert!(e.to_string().contains("out of range"), "{e}");
    assert!(f.forward(&mut st, &[], Logits::Last).is_err());
    assert_eq!(st.pos, 0);
    assert_eq!(f.stats().steps, 0);
}

struct Fixed(Vec<u32>);

impl GivenRoutes for Fixed {
    fn experts(&self, _seq: usize, _token: usize, _layer: usize) -> Option<&[u32]> {
        Some(&self.0)
    }
}

#[test]
fn a_given_routing_is_refused_by_an_engine_that_cannot_replay() {
    let model = Model::open(&fixture("qwen35-q4")).expect("open");
    let mut f = Forward::new(small(&model));
    let mut st = f.new_state(0);
    let routes = Fixed(vec![0, 1]);
    let e = f
        .forward_with(
            &mut st,
            &TOKENS,
            Logits::Last,
            Routing::Given(&routes),
            None,
            &mut Vec::new(),
        )
        .expect_err("no replay");
    assert!(e.to_string().contains("cannot replay"), "{e}");
}

#[test]
fn a_failed_step_leaves_a_fresh_state_not_a_half_updated_one() {
    let model = Model::open(&fixture("qwen35-q4")).expect("open");
    let mut engine = small(&model);
    engine.fail_at = Some(1);
    let mut f = Forward::new(engine);
    let mut st = f.new_state(0);
    f.forward(&mut st, &TOKENS[..2], Logits::Last)
        .expect("first call");
    assert_eq!(st.pos, 2);
    let e = f
        .forward(&mut st, &TOKENS, Logits::Last)
        .expect_err("injected");
    assert!(e.to_string().contains("injected"), "{e}");
    assert_eq!(st, model.new_state());
}

/// The reference engine that panics on the step with this index (0-based).
#[derive(Debug)]
struct Panicky {
    inner: Reference<'static>,
    steps: usize,
    panic_at: usize,
}

impl Engine for Panicky {
    fn name(&self) -> &'static str {
        "panicky"
    }
    fn model(&self) -> &Model {
        self.inner.model()
    }
    fn caps(&self) -> Caps {
        Caps {
            max_seqs: 4,
            ..self.inner.caps()
        }
    }
    fn place(&mut self, state: &mut SeqState, tokens: usize) -> Result<()> {
        self.inner.place(state, tokens)
    }
    fn step(&mut self, step: Step<'_, '_>) -> Result<()> {
        self.steps += 1;
        if self.steps - 1 == self.panic_at {
            panic!("injected engine panic");
        }
        self.inner.step(step)
    }
}

#[test]
fn a_panicking_step_fails_its_calls_and_the_batcher_goes_on() {
    use brook_core::engine::batch::Batcher;
    let model = std::sync::Arc::new(Model::open(&fixture("qwen35-q4")).expect("open"));
    let engine = Panicky {
        inner: Reference::shared(model.clone()),
        steps: 0,
        panic_at: 1,
    };
    let fw = std::sync::Arc::new(std::sync::Mutex::new(Forward::new(engine)));
    let b = Batcher::spawn(fw).expect("batcher");
    let mut st = model.new_state();
    let mut out = Vec::new();
    b.forward_into(&mut st, &TOKENS[..3], Logits::Last, &mut out)
        .expect("step 0 runs");
    assert_eq!(st.pos, 3);
    let e = b
        .forward_into(&mut st, &TOKENS[3..5], Logits::Last, &mut out)
        .expect_err("step 1 panics");
    assert!(e.to_string().contains("injected engine panic"), "{e}");
    // The state starts afresh, and the scheduler still answers.
    assert_eq!(st.pos, 0);
    b.forward_into(&mut st, &TOKENS[..2], Logits::Last, &mut out)
        .expect("step 2 runs");
    assert_eq!(out.len(), model.cfg.vocab_size);
}

/// The reference engine handing back a row's most likely candidates where they decide the
/// pick (`Logits::Top`), as the CUDA engine does, else the row.
#[derive(Debug)]
struct Candidates<'m> {
    inner: Reference<'m>,
    /// Steps whose candidates went back instead of the row.
    short: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl Engine for Candidates<'_> {
    fn name(&self) -> &'static str {
        "candidates"
    }
    fn model(&self) -> &Model {
        self.inner.model()
    }
    fn caps(&self) -> Caps {
        Caps {
            max_seqs: 1,
            ..self.inner.caps()
        }
    }
    fn place(&mut self, state: &mut SeqState, tokens: usize) -> Result<()> {
        self.inner.place(state, tokens)
    }
    fn step(&mut self, step: Step<'_, '_>) -> Result<()> {
        let s = &mut step.seqs[0];
        let (want, start) = (s.want, s.logits.len());
        let mut row = Vec::new();
        let mut one = [brook_core::engine::SeqStep {
            state: &mut *s.state,
            tokens: s.tokens,
            want,
            logits: &mut row,
        }];
        self.inner.step(Step {
            seqs: &mut one,
            routing: Routing::Router,
            trace: None,
        })?;
        let out = &mut *s.logits;
        if let Logits::Top(w) = want {
            let mut cands = Vec::new();
            let whole = brook_core::model::top_candidates(&row, &mut cands);
            if brook_core::model::top_decides(&cands, whole, w) {
                self.short
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                out.truncate(start);
                for (l, id) in cands {
                    out.extend([l, f32::from_bits(id)]);
                }
                return Ok(());
            }
        }
        out.extend_from_slice(&row);
        Ok(())
    }
}

#[test]
fn a_sampler_draws_the_same_tokens_from_candidates_as_from_rows() {
    use brook_core::text::{Sampler, SamplingParams};
    let model = Model::open(&fixture("qwen35-q4")).expect("open");
    let v = model.cfg.vocab_size;
    let params = SamplingParams {
        temperature: 0.9,
        top_k: 20,
        top_p: 0.9,
        min_p: 0.02,
        seed: 17,
        ..Default::default()
    };
    let run = |top: bool| -> (Vec<u32>, usize) {
        let mut sampler = Sampler::new(params.clone(), v).expect("sampler");
        let want = if top { sampler.want() } else { Logits::Last };
        assert!(!top || matches!(want, Logits::Top(_)));
        let short = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let mut f = Forward::new(Candidates {
            inner: Reference::new(&model),
            short: short.clone(),
        });
        let mut st = f.new_state(0);
        let mut out = f.forward(&mut st, &TOKENS, want).expect("prompt").to_vec();
        let mut ids = Vec::new();
        for _ in 0..24 {
            let id = sampler.pick(&mut out, v, &[]);
            ids.push(id);
            out = f.forward(&mut st, &[id], want).expect("decode").to_vec();
        }
        (ids, short.load(std::sync::atomic::Ordering::Relaxed))
    };
    let (rows, _) = run(false);
    let (cands, short) = run(true);
    assert_eq!(rows, cands);
    assert!(short >= 20, "{short} of 25 steps handed back candidates");
}
