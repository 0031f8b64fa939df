//! The library API: sessions keep state between turns, stream events, cancel, limit tokens,
//! and save/restore.

mod common;

use brook_core::model::open::OpenOptions;
use brook_core::session::{CancelToken, Event, FinishReason, GenOptions, Llm};
use brook_core::text::{Message, SamplingParams};

fn greedy(max: usize) -> GenOptions {
    GenOptions {
        sampling: Some(SamplingParams::default()),
        max_tokens: Some(max),
        enable_thinking: Some(false),
        ..Default::default()
    }
}

/// The model, built and opened once per test binary. Its folder is deleted once the model is
/// open (the model holds its files open), so no run leaves a model in the temp directory.
fn llm() -> std::sync::Arc<Llm> {
    static LLM: std::sync::OnceLock<std::sync::Arc<Llm>> = std::sync::OnceLock::new();
    LLM.get_or_init(|| {
        let dir = tempfile::tempdir().expect("tmp");
        let path = common::chat_model(dir.path());
        let opts = OpenOptions {
            context: 2048,
            ..Default::default()
        };
        std::sync::Arc::new(Llm::open(&path, opts).expect("open"))
    })
    .clone()
}

#[test]
fn second_turn_prefills_only_new_tokens_and_matches_a_fresh_session() {
    let llm = llm();
    let tok = llm.tokenizer().expect("tokenizer").clone();
    let mut s = llm.session();
    let opts = greedy(6);
    let u1 = Message::new("user", "Hello! Who are you?");
    let first = s.chat(u1.clone(), &opts, &mut |_| {}).expect("turn 1");
    assert_eq!(first.tokens.len(), 6);
    let history = s.messages().to_vec();
    let u2 = Message::new("user", "Tell me more.");
    let second = s.chat(u2.clone(), &opts, &mut |_| {}).expect("turn 2");

    // What a fresh rendering of the whole conversation holds, and how much of it is new: the
    // template rewrites the previous reply (dropping its empty think block), so the reply and
    // the new message are new; everything up to the end of the first user message is not.
    let mut all = history.clone();
    all.push(u2.clone());
    let prompt = llm.render(&all, &opts, true).expect("render");
    let kept = llm.render(&history[..1], &opts, false).expect("render");
    assert!(prompt.starts_with(&kept));
    let kept_tokens = tok.encode(&kept, false).expect("encode").len();
    let total = tok.encode(&prompt, false).expect("encode").len();
    assert_eq!(second.usage.prompt_tokens, total);
    assert_eq!(second.usage.cached_tokens, kept_tokens);
    assert_eq!(
        s.last_prefill(),
        total - kept_tokens,
        "only the new tokens are prefilled"
    );
    assert!(s.last_prefill() < total);

    // A fresh session given the whole conversation answers the same.
    let mut fresh = llm.session();
    fresh.set_messages(history);
    let again = fresh.chat(u2.clone(), &opts, &mut |_| {}).expect("fresh");
    assert_eq!(fresh.last_prefill(), total);
    assert_eq!(again.tokens, second.tokens);

    // A third turn that only appends (a tool-free follow-up) reuses the snapshot again.
    let third = s
        .chat(Message::new("user", "Thanks."), &opts, &mut |_| {})
        .expect("turn 3");
    assert!(third.usage.cached_tokens > second.usage.cached_tokens);
}

#[test]
fn events_stream_content_usage_and_finish_and_max_tokens_limits() {
    let llm = llm();
    let mut s = llm.session();
    let mut events = Vec::new();
    let c = s
        .chat(
            Message::new("user", "Count to ten."),
            &greedy(5),
            &mut |e| events.push(e),
        )
        .expect("chat");
    assert_eq!(c.usage.completion_tokens, 5);
    assert_eq!(c.finish, Some(FinishReason::Length));
    assert!(matches!(
        events.last(),
        Some(Event::Finish(FinishReason::Length))
    ));
    assert!(
        events
            .iter()
            .any(|e| matches!(e, Event::Usage(u) if u.completion_tokens == 5))
    );
    let streamed: String = events
        .iter()
        .filter_map(|e| match e {
            Event::Content(t) => Some(t.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(streamed, c.content);
}

#[test]
fn cancel_from_another_thread_stops_generation() {
    let llm = llm();
    let mut s = llm.session();
    let cancel = CancelToken::new();
    let opts = GenOptions {
        cancel: Some(cancel.clone()),
        ..greedy(100_000)
    };
    let c2 = cancel.clone();
    let t = std::thread::spawn(move || {
        // Well inside the ~2,000 tokens the context allows, even on a fast machine.
        std::thread::sleep(std::time::Duration::from_millis(100));
        c2.cancel();
    });
    let mut finish = None;
    let out = s
        .generate(&[9707, 11, 1879], &opts, None, &mut |e| {
            if let Event::Finish(f) = e {
                finish = Some(f);
            }
        })
        .expect("generate");
    t.join().expect("join");
    assert_eq!(out.finish, Some(FinishReason::Cancelled));
    assert_eq!(finish, Some(FinishReason::Cancelled));
    assert!(out.tokens.len() < 100_000);
}

#[test]
fn saved_session_restores_and_continues_identically() {
    let llm = llm();
    let dir = tempfile::tempdir().expect("tmp");
    let file = dir.path().join("s.safetensors");
    let mut a = llm.session();
    a.chat(
        Message::new("user", "Remember the number 42."),
        &greedy(4),
        &mut |_| {},
    )
    .expect("t1");
    a.save(&file).expect("save");
    let next = Message::new("user", "Which number?");
    let want = a.chat(next.clone(), &greedy(6), &mut |_| {}).expect("t2");
    let mut b = llm.restore(&file).expect("restore");
    assert_eq!(b.messages().len(), 2);
    let got = b.chat(next, &greedy(6), &mut |_| {}).expect("t2 restored");
    assert_eq!(got.tokens, want.tokens);
    assert_eq!(b.last_prefill(), a.last_prefill());
    // A corrupt file is refused with a message.
    std::fs::write(&file, b"not a session").expect("write");
    assert!(llm.restore(&file).is_err());
}

/// Regression test for "one door to the forward pass": `Session::feed` ran the f32 reference
/// pass whatever backend was asked for, so every face computed on the slowest engine.
#[test]
fn sessions_run_the_engine_asked_for_and_no_other() {
    // Models of their own: the shared one counts the other tests' calls too.
    let dir = tempfile::tempdir().expect("tmp");
    let path = common::chat_model(dir.path());
    let open = |backend| {
        let opts = OpenOptions {
            backend,
            context: 2048,
            ..Default::default()
        };
        std::sync::Arc::new(Llm::open(&path, opts).expect("open"))
    };
    let llm = open(brook_core::model::open::Backend::Cpu);
    let before = llm.engine_stats();
    assert_eq!(before.engine, "cpu");
    let mut s = llm.session();
    let opts = GenOptions {
        ignore_eos: true,
        ..greedy(5)
    };
    let c = s
        .chat(
            Message::new("user", "Which engine runs?"),
            &opts,
            &mut |_| {},
        )
        .expect("chat");
    assert_eq!(c.tokens.len(), 5);
    let after = llm.engine_stats();
    // One prefill call split at the snapshot point (the end of the messages, then the
    // generation prompt), then one call per generated token.
    let calls = after.forward_calls - before.forward_calls;
    assert_eq!(calls, 2 + 5, "{after:?}");
    assert!(
        after.model_steps.iter().all(|(name, _)| name == "cpu"),
        "another engine ran over the model: {after:?}"
    );
    assert_eq!(after.model_steps, vec![("cpu".to_string(), after.steps)]);

    // The reference backend is an engine like the others, and gives the same greedy tokens.
    let reference = open(brook_core::model::open::Backend::Reference);
    let mut r = reference.session();
    let rc = r
        .chat(
            Message::new("user", "Which engine runs?"),
            &opts,
            &mut |_| {},
        )
        .expect("chat");
    assert_eq!(rc.tokens, c.tokens);
    let st = reference.engine_stats();
    assert_eq!(st.engine, "reference");
    assert_eq!(st.forward_calls, 2 + 5);
    assert_eq!(st.model_steps, vec![("reference".to_string(), st.steps)]);
}

#[test]
fn a_token_event_comes_for_every_generated_token() {
    let llm = llm();
    let mut s = llm.session();
    let mut seen = Vec::new();
    let c = s
        .generate(&[1, 2, 3], &greedy(4), None, &mut |e| {
            if let Event::Token(t) = e {
                seen.push(t);
            }
        })
        .expect("generate");
    assert_eq!(seen, c.tokens);
}

#[test]
fn a_deadline_stops_a_prefill_with_an_error_and_a_generation_with_length() {
    let llm = llm();
    let past = Some(std::time::Instant::now());
    let mut s = llm.session();
    let opts = GenOptions {
        deadline: past,
        ..greedy(20)
    };
    let e = s
        .generate(&[1, 2, 3, 4], &opts, None, &mut |_| {})
        .expect_err("prefill past its deadline");
    assert!(matches!(e, brook_core::Error::Stopped(_)), "{e}");
    assert!(e.to_string().contains("time limit"), "{e}");

    // One prompt token is read whatever the deadline; decoding then stops before any token.
    let mut s = llm.session();
    let c = s
        .generate(&[1], &opts, None, &mut |_| {})
        .expect("generate");
    assert_eq!(c.tokens.len(), 0);
    assert_eq!(c.finish, Some(FinishReason::Length));

    // A deadline far off changes nothing.
    let far = GenOptions {
        deadline: Some(std::time::Instant::now() + std::time::Duration::from_secs(3600)),
        ..greedy(5)
    };
    let mut s = llm.session();
    let c = s
        .generate(&[1, 2, 3], &far, None, &mut |_| {})
        .expect("generate");
    assert_eq!(c.tokens.len(), 5);
}

/// A reset session (its state cleared in place) answers as a new session does, and as it did
/// itself before anything was fed.
#[test]
fn a_reset_session_answers_as_a_new_one() {
    let llm = llm();
    let opts = greedy(12);
    let ask = Message::new("user", "Name three colours.");
    let want = llm.session().chat(ask.clone(), &opts, &mut |_| {});
    let want = want.expect("new session").tokens;
    let mut s = llm.session();
    s.chat(Message::new("user", "Count to ten."), &opts, &mut |_| {})
        .expect("first turn");
    for round in 0..2 {
        s.reset();
        let got = s
            .chat(ask.clone(), &opts, &mut |_| {})
            .expect("after reset");
        assert_eq!(got.usage.cached_tokens, 0, "round {round}: nothing kept");
        assert_eq!(got.tokens, want, "round {round}");
    }
}
