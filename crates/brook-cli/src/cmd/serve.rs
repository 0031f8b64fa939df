//! `brook serve`: the OpenAI-compatible server and web chat page (crates/brook-server) on one
//! model.
//!
//! It binds loopback by default; any other address needs `--api-key`, because the server would
//! otherwise hand the model (and the machine's time) to anyone who can reach the port.

use std::net::{SocketAddr, ToSocketAddrs};
use std::time::Duration;

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
    /// Requests that may wait while --parallel run; more are answered 429.
    #[arg(long, default_value_t = 8)]
    queue: usize,
    /// Requests generating at once, each with its own conversation state; their decode steps
    /// are batched, so each reads the dense weights once for all. Default: 4 on the CPU
    /// backend when four states take at most an eighth of the memory budget (else 2 or 1);
    /// 16 on CUDA when sixteen GPU states take at most an eighth of the GPU budget (else 8,
    /// 4, 2 or 1).
    #[arg(long, value_name = "N")]
    parallel: Option<usize>,
    /// Model id clients send and /v1/models lists (default: the model folder's name).
    #[arg(long)]
    model_id: Option<String>,
    /// Largest request body, e.g. 16MiB.
    #[arg(long, value_name = "SIZE", default_value = "16MiB")]
    max_body: String,
    /// Host name clients may use besides localhost and loopback addresses when no API key is
    /// set (the Host header; repeat for more, `*` for any). Other hosts get 403: that is what
    /// a web page reaching a loopback server through DNS rebinding sends.
    #[arg(long = "allowed-host", value_name = "NAME")]
    allowed_hosts: Vec<String>,
    /// Most tokens one request may generate; requests asking for more (or for no limit) are
    /// held to it. Default: the context.
    #[arg(long, value_name = "N")]
    max_tokens: Option<usize>,
    /// Seconds a request may take from arrival, waiting included; past it a waiting request is
    /// answered 503 and a generating one stops (finish_reason "length"). 0: no limit.
    #[arg(long, value_name = "SECONDS", default_value_t = 1800)]
    request_timeout: u64,
    /// Connections served at once; a new one beyond closes the oldest idle one, or is answered
    /// 503 when every connection has a request in flight.
    #[arg(long, value_name = "N", default_value_t = 1024)]
    max_connections: usize,
    /// Seconds a connection has to send a request's headers, from opening or from its previous
    /// response (idle keep-alive connections close after this too).
    #[arg(long, value_name = "SECONDS", default_value_t = 15)]
    header_timeout: u64,
    /// Seconds a request has to send its whole body; slower ones get 408.
    #[arg(long, value_name = "SECONDS", default_value_t = 60)]
    body_timeout: u64,
    /// Leave `timings` and `cached_tokens` out of responses, so clients cannot tell whether a
    /// prompt was cached for someone.
    #[arg(long)]
    hide_timings: bool,
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
    let (llm, parallel) = a.model.open_parallel(a.parallel)?;
    let mut config = brook_server::Config::new(model_id.clone());
    config.queue = a.queue;
    config.parallel = parallel;
    config.api_key = api_key;
    config.max_body = usize::try_from(max_body).unwrap_or(usize::MAX);
    config.allowed_hosts = a.allowed_hosts.clone();
    if a.max_tokens == Some(0) {
        anyhow::bail!(Error::Invalid("--max-tokens must be at least 1".into()));
    }
    config.max_tokens = a.max_tokens;
    config.request_timeout =
        (a.request_timeout > 0).then(|| Duration::from_secs(a.request_timeout));
    config.hide_timings = a.hide_timings;
    if a.max_connections == 0 || a.header_timeout == 0 || a.body_timeout == 0 {
        anyhow::bail!(Error::Invalid(
            "--max-connections, --header-timeout and --body-timeout must be at least 1".into()
        ));
    }
    config.transport = brook_server::transport::Limits {
        max_connections: a.max_connections,
        header_timeout: Duration::from_secs(a.header_timeout),
        body_timeout: Duration::from_secs(a.body_timeout),
    };
    let fds = raise_open_files();
    if fds < a.max_connections as u64 + 64 {
        eprintln!(
            "warning: this process may open {fds} files, fewer than --max-connections {} needs; raise `ulimit -n` or lower --max-connections",
            a.max_connections
        );
    }
    eprintln!("{parallel} request(s) at once, {} more may wait", a.queue);
    let router = brook_server::router(llm, config)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    rt.block_on(async move {
        let listener = brook_server::transport::bind(addr)
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

/// Raises the soft limit on open files to the hard one (each connection is a descriptor; the
/// usual soft limit of 1024 would cap the server below --max-connections) and returns it.
fn raise_open_files() -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit only read and write the struct passed.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return 1024;
        }
        if lim.rlim_cur < lim.rlim_max {
            let want = libc::rlimit {
                rlim_cur: lim.rlim_max,
                rlim_max: lim.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &want) == 0 {
                lim.rlim_cur = lim.rlim_max;
            }
        }
    }
    lim.rlim_cur
}
