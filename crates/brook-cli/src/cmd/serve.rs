//! `brook serve`: the OpenAI-compatible server and web chat page (crates/brook-server) on one
//! model.
//!
//! It binds loopback by default; any other address needs `--api-key`, because the server would
//! otherwise hand the model (and the machine's time) to anyone who can reach the port.

use std::net::{SocketAddr, ToSocketAddrs};

use anyhow::{Context, Result};
use brook_core::Error;

/// Serve the model over an OpenAI-compatible HTTP API, with a chat page at /.
#[derive(Debug, clap::Args)]
#[command(
    after_help = "Examples:\n  brook serve --model ./q36.brook --memory-budget 3GiB\n  brook serve --model ./q36.brook --host 0.0.0.0 --port 8080 --api-key \"$(openssl rand -hex 16)\"\n\nThen open http://127.0.0.1:8080/ or point any OpenAI client at http://127.0.0.1:8080/v1 (docs/SERVER.md)."
)]
pub struct Args {
    #[command(flatten)]
    model: super::ModelArgs,
    /// Address to bind; anything but loopback requires --api-key.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port (0 picks a free one and prints it).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Bearer key clients must send on /v1/* (`Authorization: Bearer KEY`).
    #[arg(long, env = "BROOK_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Requests that may wait while one runs; more are answered 429.
    #[arg(long, default_value_t = 8)]
    queue: usize,
    /// Model id clients send and /v1/models lists (default: the model folder's name).
    #[arg(long)]
    model_id: Option<String>,
    /// Largest request body, e.g. 16MiB.
    #[arg(long, value_name = "SIZE", default_value = "16MiB")]
    max_body: String,
}

pub fn run(a: Args) -> Result<()> {
    let addrs: Vec<SocketAddr> = (a.host.as_str(), a.port)
        .to_socket_addrs()
        .with_context(|| format!("--host {}: cannot resolve this address", a.host))?
        .collect();
    let addr = *addrs
        .first()
        .ok_or_else(|| Error::Invalid(format!("--host {} resolves to no address", a.host)))?;
    let loopback = addrs.iter().all(|a| a.ip().is_loopback());
    let api_key = a.api_key.clone().filter(|k| !k.is_empty());
    if !loopback {
        if api_key.is_none() {
            anyhow::bail!(Error::Invalid(format!(
                "--host {} is reachable from other machines: also pass --api-key KEY (or set BROOK_API_KEY) so only clients with the key can use the model",
                a.host
            )));
        }
        eprintln!(
            "warning: serving on {addr}, reachable from other machines; requests need the API key, but traffic is plain HTTP: put a TLS proxy in front for anything beyond a trusted network"
        );
    }
    let max_body = brook_core::experts::budget::parse_size(&a.max_body)?;
    let model_id = a.model_id.clone().unwrap_or_else(|| {
        a.model
            .model
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "brook".into())
    });
    eprintln!("loading {} ...", a.model.model.display());
    let llm = a.model.open()?;
    let mut config = brook_server::Config::new(model_id.clone());
    config.queue = a.queue;
    config.api_key = api_key;
    config.max_body = usize::try_from(max_body).unwrap_or(usize::MAX);
    let router = brook_server::router(llm, config)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("cannot listen on {addr}"))?;
        let bound = listener.local_addr()?;
        // Tests and scripts read this line to find the port.
        println!("brook serve: model `{model_id}` on http://{bound}/ (API at http://{bound}/v1)");
        // Ctrl-C ends the process at once, open streams included.
        let stop = async {
            let _ = tokio::signal::ctrl_c().await;
            eprintln!("stopping");
        };
        brook_server::serve(listener, router, stop).await?;
        Ok(())
    })
}
