//! `brook tokenize`: text (or a chat rendered through the template) to token ids.

use std::path::PathBuf;

use anyhow::{Context, Result};
use brook_core::Error;
use brook_core::text::{ChatTemplate, Message, Tokenizer};

/// Print the token ids of a text; with --chat, of a JSON message list rendered by the model's
/// chat template.
#[derive(Debug, clap::Args)]
#[command(
    after_help = "Examples:\n  brook tokenize --model ./q36.brook 'Hello, world!'\n  brook tokenize --model ./q36.brook --chat '[{\"role\":\"user\",\"content\":\"Hi\"}]'"
)]
pub struct Args {
    /// Model folder (container or checkpoint) holding tokenizer.json.
    #[arg(long)]
    model: PathBuf,
    /// Text to tokenize, or with --chat a JSON list of messages.
    text: String,
    /// Treat TEXT as a JSON message list and render it through the chat template first.
    #[arg(long)]
    chat: bool,
    /// With --chat: append the assistant generation prompt.
    #[arg(long, default_value_t = true)]
    add_generation_prompt: bool,
    /// With --chat: pass enable_thinking to the template.
    #[arg(long)]
    enable_thinking: Option<bool>,
    /// Also print each token's text.
    #[arg(long)]
    verbose: bool,
}

pub fn run(a: Args) -> Result<()> {
    let tok = Tokenizer::from_dir(&a.model)?
        .ok_or_else(|| Error::Invalid(format!("{} has no tokenizer.json", a.model.display())))?;
    let text = if a.chat {
        let messages: Vec<Message> = serde_json::from_str(&a.text)
            .map_err(|e| Error::Invalid(format!("--chat expects a JSON list of messages: {e}")))?;
        let t = ChatTemplate::from_dir(&a.model)?
            .ok_or_else(|| Error::Invalid(format!("{} has no chat template", a.model.display())))?;
        let mut extra = serde_json::Map::new();
        if let Some(th) = a.enable_thinking {
            extra.insert("enable_thinking".into(), th.into());
        }
        t.render(&messages, None, a.add_generation_prompt, &extra)
            .context("rendering the chat template")?
    } else {
        a.text.clone()
    };
    let ids = tok.encode(&text, false)?;
    if a.verbose {
        for id in &ids {
            println!("{id}\t{:?}", tok.decode(&[*id], false)?);
        }
    } else {
        let s: Vec<String> = ids.iter().map(u32::to_string).collect();
        println!("{}", s.join(" "));
    }
    Ok(())
}
