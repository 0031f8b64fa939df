//! Cancelling a generation from another thread, limiting tokens, and saving/restoring a
//! session's state.
//!
//! ```sh
//! cargo run --release -p brook-core --example cancel_and_save -- PATH/TO/MODEL
//! ```

use std::sync::Arc;
use std::time::Duration;

use brook_core::model::open::OpenOptions;
use brook_core::session::{CancelToken, GenOptions, Llm};
use brook_core::text::Message;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let Some(model) = std::env::args().nth(1) else {
        eprintln!("usage: cancel_and_save MODEL");
        std::process::exit(2);
    };
    let llm = Arc::new(Llm::open(model.as_ref(), OpenOptions::default())?);
    let mut session = llm.session();

    // Stop a long answer after half a second, from another thread.
    let cancel = CancelToken::new();
    let stopper = {
        let c = cancel.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(500));
            c.cancel();
        })
    };
    let opts = GenOptions {
        max_tokens: Some(100_000),
        cancel: Some(cancel),
        ..Default::default()
    };
    let c = session.chat(
        Message::new("user", "Write a long story."),
        &opts,
        &mut |_| {},
    )?;
    stopper.join().ok();
    println!("stopped after {} tokens: {:?}", c.tokens.len(), c.finish);

    // Save the conversation with its state, restore it, and continue with a token limit.
    let file = std::env::temp_dir().join("brook-example-session.safetensors");
    session.save(&file)?;
    let mut restored = llm.restore(&file)?;
    let opts = GenOptions {
        max_tokens: Some(16),
        ..Default::default()
    };
    let c = restored.chat(Message::new("user", "Continue."), &opts, &mut |_| {})?;
    println!(
        "restored session answered {} tokens, prefilling only {} new ones",
        c.tokens.len(),
        restored.last_prefill()
    );
    std::fs::remove_file(&file).ok();
    Ok(())
}
