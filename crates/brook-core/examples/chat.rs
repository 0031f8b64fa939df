//! A two-turn conversation through the library API, streaming the reply.
//!
//! ```sh
//! cargo run --release -p brook-core --example chat -- PATH/TO/MODEL "Why is the sky blue?"
//! ```
//!
//! PATH is a brook container (or an MLX checkpoint folder) with tokenizer files.

use std::io::Write;
use std::sync::Arc;

use brook_core::model::open::OpenOptions;
use brook_core::session::{Event, GenOptions, Llm};
use brook_core::text::Message;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let (Some(model), question) = (args.next(), args.next()) else {
        eprintln!("usage: chat MODEL [QUESTION]");
        std::process::exit(2);
    };
    let question = question.unwrap_or_else(|| "Hello! Who are you?".into());
    let options = OpenOptions {
        memory_budget: Some(brook_core::experts::budget::parse_size("3GiB")?),
        context: 4096,
        ..Default::default()
    };
    let llm = Arc::new(Llm::open(model.as_ref(), options)?);
    let mut session = llm.session();
    let opts = GenOptions {
        max_tokens: Some(64),
        ..Default::default()
    };
    let mut print = |e: Event| match e {
        Event::Content(t) | Event::Reasoning(t) => {
            print!("{t}");
            let _ = std::io::stdout().flush();
        }
        Event::ToolCall(c) => println!("\n[tool call {}({})]", c.name, c.arguments),
        Event::Usage(u) => println!(
            "\n[{} prompt tokens ({} reused), {} generated]",
            u.prompt_tokens, u.cached_tokens, u.completion_tokens
        ),
        Event::Finish(f) => println!("[finish: {f:?}]"),
        // Token ids come before their text; this example prints text only.
        Event::Token(_) => {}
    };
    session.chat(Message::new("user", question), &opts, &mut print)?;
    // The second turn reuses the state: only the new tokens are prefilled.
    session.chat(
        Message::new("user", "Say that in one sentence."),
        &opts,
        &mut print,
    )?;
    Ok(())
}
