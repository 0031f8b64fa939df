//! Several prompts generated together through the `Batch` API: every step feeds each
//! sequence's next chunk or token in one engine step, so they share the reads of the weights.
//!
//! ```sh
//! cargo run --release -p brook-core --example batch -- PATH/TO/MODEL "First prompt" "Second"
//! ```

use std::collections::HashMap;
use std::sync::Arc;

use brook_core::model::open::OpenOptions;
use brook_core::session::{GenOptions, Llm, SeqEvent};
use brook_core::text::Message;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let Some(model) = args.next() else {
        eprintln!("usage: batch MODEL PROMPT...");
        std::process::exit(2);
    };
    let prompts: Vec<String> = args.collect();
    // A step takes up to `max_seqs` sequences; the budget holds a state for each.
    let opts = OpenOptions {
        max_seqs: prompts.len().max(1),
        ..Default::default()
    };
    let llm = Arc::new(Llm::open(model.as_ref(), opts)?);
    let tok = llm.tokenizer()?.clone();
    let gen_opts = GenOptions {
        max_tokens: Some(64),
        ..Default::default()
    };
    let mut batch = llm.batch();
    let mut texts = HashMap::new();
    for p in &prompts {
        let prompt = llm.render(&[Message::new("user", p.clone())], &gen_opts, true)?;
        let id = batch.add(&tok.encode(&prompt, false)?, &gen_opts)?;
        texts.insert(id, (p.clone(), Vec::new()));
    }
    while !batch.is_empty() {
        for (id, ev) in batch.step()? {
            match ev {
                SeqEvent::Token { token, .. } => texts.get_mut(&id).expect("ours").1.push(token),
                SeqEvent::Failed(e) => eprintln!("{id:?} failed: {e}"),
                SeqEvent::Prefilled(_) => {}
            }
        }
    }
    for (prompt, tokens) in texts.values() {
        println!("> {prompt}\n{}\n", tok.decode(tokens, true)?);
    }
    Ok(())
}
