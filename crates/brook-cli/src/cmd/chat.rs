//! `brook chat`: an interactive, streaming conversation in the terminal.
//!
//! Line editing and history come from rustyline when stdin is a terminal; plain lines are
//! read otherwise, and output is plain (no colours) when stdout is not a terminal. Ctrl-C
//! during an answer stops that answer (the session keeps what was generated); at the prompt
//! it clears the line; Ctrl-D or /bye leaves.

use std::io::{BufRead, IsTerminal, Write};

use anyhow::Result;
use brook_core::session::{CancelToken, Event, FinishReason, GenOptions, Session};
use brook_core::text::Message;

const HELP: &str = "Commands:
  /reset           forget the conversation
  /system TEXT     set the system prompt (and reset)
  /think [on|off]  toggle thinking (templates with enable_thinking)
  /stats           speed, tokens and each expert tier's counters (GPU slots, host cache) of the last answer
  /save FILE       save the conversation and its state
  /load FILE       restore a saved conversation
  /help            this text
  /bye             leave (also Ctrl-D)
Multi-line input: end a line with \\ to continue it, or wrap text in \"\"\".";

/// Chat with a model interactively.
#[derive(Debug, clap::Args)]
#[command(
    after_help = "Example:\n  brook chat --model ./q36.brook --memory-budget 3GiB\n\nInside the chat, /help lists the commands."
)]
pub struct Args {
    #[command(flatten)]
    model: super::ModelArgs,
    /// System prompt.
    #[arg(long)]
    system: Option<String>,
    /// Start with thinking on or off.
    #[arg(long)]
    think: Option<bool>,
    /// Most tokens per answer.
    #[arg(long, default_value_t = 2048)]
    max_tokens: usize,
    #[command(flatten)]
    sampling: super::SamplingArgs,
}

struct Ui {
    color: bool,
}

impl Ui {
    fn dim(&self, s: &str) -> String {
        if self.color {
            format!("\x1b[2m{s}\x1b[0m")
        } else {
            s.to_string()
        }
    }
}

pub fn run(a: Args) -> Result<()> {
    let llm = a.model.open()?;
    llm.tokenizer()?;
    let ui = Ui {
        color: std::io::stdout().is_terminal(),
    };
    let cancel = CancelToken::new();
    {
        let c = cancel.clone();
        // Ctrl-C while an answer streams: stop the answer, keep the program.
        ctrlc::set_handler(move || c.cancel())?;
    }
    let mut session = llm.session();
    let mut system = a.system.clone();
    let mut think = a.think;
    reset(&mut session, &system);
    let mut input = Input::new()?;
    eprintln!(
        "{}",
        ui.dim("brook chat: /help for commands, Ctrl-D to leave")
    );
    let mut last: Option<brook_core::session::Completion> = None;
    let mut last_stats = None;
    let mut last_gpu = None;
    while let Some(line) = input.read()? {
        let text = line.trim();
        if text.is_empty() {
            continue;
        }
        if let Some(cmd) = text.strip_prefix('/') {
            let (name, arg) = cmd
                .split_once(' ')
                .map_or((cmd, ""), |(n, r)| (n, r.trim()));
            match name {
                "bye" | "exit" | "quit" => break,
                "help" | "?" => println!("{HELP}"),
                "reset" | "clear" => {
                    reset(&mut session, &system);
                    println!("{}", ui.dim("(conversation reset)"));
                }
                "system" => {
                    system = (!arg.is_empty()).then(|| arg.to_string());
                    reset(&mut session, &system);
                    println!("{}", ui.dim("(system prompt set; conversation reset)"));
                }
                "think" => {
                    think = Some(match arg {
                        "on" => true,
                        "off" => false,
                        _ => !think.unwrap_or(true),
                    });
                    println!(
                        "{}",
                        ui.dim(&format!(
                            "(thinking {})",
                            if think == Some(true) { "on" } else { "off" }
                        ))
                    );
                }
                "stats" => println!(
                    "{}",
                    ui.dim(&stats_line(
                        last.as_ref(),
                        last_stats,
                        last_gpu.as_ref(),
                        &llm.engine_stats()
                    ))
                ),
                "save" if !arg.is_empty() => match session.save(std::path::Path::new(arg)) {
                    Ok(()) => println!("{}", ui.dim(&format!("(saved to {arg})"))),
                    Err(e) => eprintln!("error: {e}"),
                },
                "load" if !arg.is_empty() => match llm.restore(std::path::Path::new(arg)) {
                    Ok(s) => {
                        session = s;
                        println!(
                            "{}",
                            ui.dim(&format!(
                                "(loaded {arg}: {} messages)",
                                session.messages().len()
                            ))
                        );
                    }
                    Err(e) => eprintln!("error: {e}"),
                },
                _ => eprintln!("unknown command /{name}; /help lists them"),
            }
            continue;
        }
        cancel.reset();
        let mut opts = GenOptions {
            max_tokens: Some(a.max_tokens),
            enable_thinking: think,
            sampling: Some(a.sampling.params(&llm)),
            cancel: Some(cancel.clone()),
            ignore_eos: a.sampling.ignore_eos,
            ..Default::default()
        };
        opts.stop.clone_from(&a.sampling.stop);
        let before = llm.model.experts.stats();
        let gpu_before = llm.gpu_stats();
        let mut out = std::io::stdout();
        let mut in_reasoning = false;
        let result = session.chat(Message::new("user", text), &opts, &mut |e| {
            match e {
                Event::Reasoning(t) => {
                    in_reasoning = true;
                    let _ = write!(out, "{}", ui.dim(&t));
                }
                Event::Content(t) => {
                    if in_reasoning {
                        in_reasoning = false;
                        let _ = writeln!(out);
                    }
                    let _ = write!(out, "{t}");
                }
                Event::ToolCall(c) => {
                    let _ = write!(
                        out,
                        "\n{}",
                        ui.dim(&format!("[tool call {}({})]", c.name, c.arguments))
                    );
                }
                Event::Finish(FinishReason::Cancelled) => {
                    let _ = write!(out, "{}", ui.dim(" [stopped]"));
                }
                _ => {}
            }
            let _ = out.flush();
        });
        println!();
        match result {
            Ok(c) => {
                last_stats = match (llm.model.experts.stats(), before) {
                    (Some(a), Some(b)) => Some(a.since(&b)),
                    _ => None,
                };
                last_gpu = match (llm.gpu_stats(), &gpu_before) {
                    (Some(a), Some(b)) => Some(a.since(b)),
                    _ => None,
                };
                last = Some(c);
            }
            Err(e) => eprintln!("error: {e}"),
        }
    }
    Ok(())
}

fn reset(session: &mut Session, system: &Option<String>) {
    session.reset();
    if let Some(s) = system {
        session.set_messages(vec![Message::new("system", s.clone())]);
    }
}

/// The `/stats` line for the last answer: its speeds, then each tier of experts (GPU slots
/// under `--backend cuda`, the host's cache, the disk's reads), peak memory and the engine.
fn stats_line(
    last: Option<&brook_core::session::Completion>,
    cache: Option<brook_core::experts::CacheStats>,
    gpu: Option<&brook_core::engine::GpuStats>,
    engine: &brook_core::engine::EngineStats,
) -> String {
    let Some(c) = last else {
        return "(no answer yet)".to_string();
    };
    let u = c.usage;
    let mut s = format!(
        "prompt {} tokens ({} reused) at {:.2} tok/s; answer {} tokens at {:.2} tok/s",
        u.prompt_tokens,
        u.cached_tokens,
        (u.prompt_tokens - u.cached_tokens) as f64 / u.prefill_s.max(1e-9),
        u.completion_tokens,
        u.completion_tokens as f64 / u.decode_s.max(1e-9)
    );
    if let Some(g) = gpu {
        if g.resident {
            s.push_str(&format!("; GPU: every expert resident ({} slots)", g.slots));
        } else if g.mapped > 0 {
            s.push_str(&format!(
                "; GPU expert slots hit rate {:.1}% on {} slots, the other {} experts in mapped host memory, {:.2} GB read from it",
                g.hit_rate() * 100.0,
                g.slots,
                g.mapped,
                g.bytes_copied as f64 / 1e9
            ));
        } else {
            s.push_str(&format!(
                "; GPU expert slots hit rate {:.1}% on {} slots, {:.2} GB copied from the host",
                g.hit_rate() * 100.0,
                g.slots,
                g.bytes_copied as f64 / 1e9
            ));
        }
    }
    if let Some(k) = cache {
        s.push_str(&format!(
            "; {}expert cache hit rate {:.1}% on {} of {} slots, {:.2} GB read ({:.2} GB/s)",
            if gpu.is_some() { "host " } else { "" },
            k.hit_rate() * 100.0,
            k.slots,
            k.slots_max,
            k.bytes_read as f64 / 1e9,
            k.read_gb_s()
        ));
    }
    let (_, peak) = brook_core::experts::budget::rss();
    s.push_str(&format!(
        "; peak RSS {}; the {} engine, {} forward calls",
        brook_core::experts::budget::fmt_bytes(peak),
        engine.engine,
        engine.forward_calls
    ));
    s
}

/// Reads user turns: rustyline on a terminal, plain lines otherwise.
enum Input {
    Editor(Box<rustyline::DefaultEditor>),
    Plain(std::io::StdinLock<'static>),
}

impl Input {
    fn new() -> Result<Self> {
        if std::io::stdin().is_terminal() {
            Ok(Input::Editor(Box::new(rustyline::DefaultEditor::new()?)))
        } else {
            Ok(Input::Plain(std::io::stdin().lock()))
        }
    }

    fn line(&mut self, prompt: &str) -> Result<Option<String>> {
        match self {
            Input::Editor(ed) => loop {
                match ed.readline(prompt) {
                    Ok(l) => {
                        let _ = ed.add_history_entry(l.as_str());
                        return Ok(Some(l));
                    }
                    Err(rustyline::error::ReadlineError::Interrupted) => continue,
                    Err(rustyline::error::ReadlineError::Eof) => return Ok(None),
                    Err(e) => return Err(e.into()),
                }
            },
            Input::Plain(r) => {
                let mut s = String::new();
                if r.read_line(&mut s)? == 0 {
                    return Ok(None);
                }
                Ok(Some(s.trim_end_matches(['\n', '\r']).to_string()))
            }
        }
    }

    /// One user turn, joining `\`-continued lines and `"""` blocks.
    fn read(&mut self) -> Result<Option<String>> {
        let Some(first) = self.line(">>> ")? else {
            return Ok(None);
        };
        if first.trim_start().starts_with("\"\"\"") {
            let mut text = first.trim_start()[3..].to_string();
            if let Some(done) = text.strip_suffix("\"\"\"") {
                return Ok(Some(done.to_string()));
            }
            while let Some(l) = self.line("... ")? {
                if let Some(end) = l.strip_suffix("\"\"\"") {
                    text.push('\n');
                    text.push_str(end);
                    return Ok(Some(text));
                }
                text.push('\n');
                text.push_str(&l);
            }
            return Ok(Some(text));
        }
        let mut text = first;
        while text.ends_with('\\') {
            text.pop();
            match self.line("... ")? {
                Some(l) => {
                    text.push('\n');
                    text.push_str(&l);
                }
                None => break,
            }
        }
        Ok(Some(text))
    }
}

#[cfg(test)]
mod tests {
    use super::stats_line;
    use brook_core::engine::{EngineStats, GpuStats};
    use brook_core::experts::CacheStats;
    use brook_core::session::Completion;

    #[test]
    fn stats_name_each_tier_of_experts() {
        let mut c = Completion::default();
        c.usage.prompt_tokens = 10;
        c.usage.completion_tokens = 5;
        c.usage.prefill_s = 1.0;
        c.usage.decode_s = 0.5;
        let engine = EngineStats::default();
        let host = CacheStats {
            hits: 3,
            misses: 1,
            slots: 8,
            slots_max: 16,
            ..Default::default()
        };
        let cpu = stats_line(Some(&c), Some(host), None, &engine);
        assert!(cpu.contains("answer 5 tokens at 10.00 tok/s"), "{cpu}");
        assert!(
            cpu.contains("; expert cache hit rate 75.0% on 8 of 16 slots"),
            "{cpu}"
        );
        let now = GpuStats {
            slots: 100,
            hits: 90,
            misses: 30,
            bytes_copied: 3_000_000_000,
            ..Default::default()
        };
        let then = GpuStats {
            hits: 30,
            misses: 10,
            bytes_copied: 1_000_000_000,
            ..now.clone()
        };
        let gpu = now.since(&then);
        let streamed = stats_line(Some(&c), Some(host), Some(&gpu), &engine);
        assert!(
            streamed.contains("GPU expert slots hit rate 75.0% on 100 slots, 2.00 GB copied"),
            "{streamed}"
        );
        assert!(
            streamed.contains("; host expert cache hit rate 75.0%"),
            "{streamed}"
        );
        let resident = GpuStats {
            resident: true,
            ..gpu
        };
        let all = stats_line(Some(&c), None, Some(&resident), &engine);
        assert!(
            all.contains("GPU: every expert resident (100 slots)"),
            "{all}"
        );
        assert_eq!(stats_line(None, None, None, &engine), "(no answer yet)");
    }
}
