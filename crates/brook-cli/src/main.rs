//! The `brook` command-line tool: a thin layer over brook-core, one file per subcommand.
//!
//! Errors from the library arrive typed and are mapped to exit codes here (see [`exit_code`]);
//! logging goes through `RUST_LOG`.

mod cmd;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Allocations from 2 MiB on (weights, states, caches) go on transparent huge pages.
#[global_allocator]
static ALLOC: brook_core::aligned::HugePageAlloc = brook_core::aligned::HugePageAlloc;

/// Run huge Mixture-of-Experts models (Qwen3-Next, Qwen3.5/3.6 MoE) with a few GB of RAM.
#[derive(Debug, Parser)]
#[command(name = "brook", version = concat!(env!("CARGO_PKG_VERSION"), " (", env!("BROOK_COMMIT"), ")"), about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    Logits(cmd::logits::Args),
    Generate(cmd::generate::Args),
    Repack(cmd::repack::Args),
    Verify(cmd::verify::Args),
    Synth(cmd::synth::Args),
    Bench(cmd::bench::Args),
    Tokenize(cmd::tokenize::Args),
    Trace(cmd::trace::Args),
    Chat(cmd::chat::Args),
    Demo(cmd::demo::Args),
    Pull(cmd::pull::Args),
    List(cmd::list::Args),
    Rm(cmd::rm::Args),
    Serve(cmd::serve::Args),
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Logits(a) => cmd::logits::run(a),
        Command::Generate(a) => cmd::generate::run(a),
        Command::Repack(a) => cmd::repack::run(a),
        Command::Verify(a) => cmd::verify::run(a),
        Command::Synth(a) => cmd::synth::run(a),
        Command::Bench(a) => cmd::bench::run(a),
        Command::Tokenize(a) => cmd::tokenize::run(a),
        Command::Trace(a) => cmd::trace::run(a),
        Command::Chat(a) => cmd::chat::run(a),
        Command::Demo(a) => cmd::demo::run(a),
        Command::Pull(a) => cmd::pull::run(a),
        Command::List(a) => cmd::list::run(a),
        Command::Rm(a) => cmd::rm::run(a),
        Command::Serve(a) => cmd::serve::run(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", message(&e));
            ExitCode::from(exit_code(&e))
        }
    }
}

/// The error and its causes, each cause left out when the text before already says it (brook's
/// errors name their source in their own message: `path: No space left on device`).
fn message(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if !out.contains(&text) {
            if !out.is_empty() {
                out.push_str(": ");
            }
            out.push_str(&text);
        }
    }
    out
}

/// Exit status by error kind: 2 bad usage or input, 3 bad model files, 4 I/O, 5 network or
/// Hub, 1 anything else.
fn exit_code(e: &anyhow::Error) -> u8 {
    use brook_core::Error as E;
    if let Some(h) = e.downcast_ref::<brook_hub::Error>() {
        return cmd::pull::exit_code(h);
    }
    match e.downcast_ref::<E>() {
        Some(E::Invalid(_) | E::Text(_)) => 2,
        Some(
            E::Safetensors { .. }
            | E::Json { .. }
            | E::Config { .. }
            | E::UnknownModelType(_)
            | E::MissingTensor { .. }
            | E::Shape { .. }
            | E::Dtype { .. }
            | E::Quantization { .. }
            | E::Checkpoint { .. },
        ) => 3,
        Some(E::Io { .. }) => 4,
        Some(E::Device(_) | E::Stopped(_)) | None => 1,
    }
}
