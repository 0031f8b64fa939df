//! One module per subcommand, plus what they share.

pub mod bench;
pub mod chat;
pub mod demo;
pub mod generate;
pub mod list;
pub mod logits;
pub mod pull;
pub mod repack;
pub mod rm;
pub mod serve;
pub mod synth;
pub mod tokenize;
pub mod trace;
pub mod verify;

use anyhow::Result;
use brook_core::Error;

/// Parses a comma-separated list of token ids such as `1,2,3`.
pub fn parse_tokens(s: &str) -> Result<Vec<u32>> {
    s.split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(|t| {
            t.parse::<u32>().map_err(|_| {
                Error::Invalid(format!("`{t}` is not a token id (expected e.g. 1,2,3)"))
            })
        })
        .collect::<Result<Vec<_>, Error>>()
        .and_then(|v| {
            if v.is_empty() {
                Err(Error::Invalid("no token ids given".into()))
            } else {
                Ok(v)
            }
        })
        .map_err(Into::into)
}

/// A progress bar over bytes with rate and ETA, hidden when stderr is not a terminal.
pub fn byte_bar(total: u64, what: &str) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::with_draw_target(
        Some(total),
        indicatif::ProgressDrawTarget::stderr_with_hz(4),
    );
    let style = indicatif::ProgressStyle::with_template(
        "{msg:10} [{bar:30}] {bytes}/{total_bytes} {binary_bytes_per_sec} ETA {eta}",
    )
    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
    .progress_chars("=> ");
    bar.set_style(style);
    bar.set_message(what.to_string());
    bar
}

/// Flags shared by every command that runs a model.
#[derive(Debug, Clone, clap::Args)]
pub struct ModelArgs {
    /// Model: a brook container, an MLX checkpoint folder (loaded whole), or the name of a
    /// model in the store (`brook pull`, `brook list`).
    #[arg(long)]
    pub model: std::path::PathBuf,
    /// Hard ceiling on memory, e.g. 3GiB or 2500M; default: from the cgroup limit and free memory.
    #[arg(long, value_name = "SIZE")]
    pub memory_budget: Option<String>,
    /// Number of expert slots, overriding the budget's choice (for experiments).
    #[arg(long, value_name = "N")]
    pub expert_cache: Option<usize>,
    /// Take every expert slot the budget pays for from the start. By default the cache starts
    /// on one token's worth (top-k x layers) and takes the rest of the budget only once that
    /// would read at least a tenth fewer experts; memory it does not take stays free.
    #[arg(long)]
    pub fill_cache: bool,
    /// Longest sequence (prompt + generation) to size the state for.
    #[arg(long, default_value_t = 4096, value_parser = parse_context)]
    pub context: usize,
    /// Prompt tokens computed together (llama.cpp's --ubatch-size): each streamed expert is
    /// read once per chunk, and larger chunks run the expert products more efficiently;
    /// the budget pays for the chunk's scratch (about 330 KB a token for the 35B). The CUDA
    /// backend runs chunks of at most 256.
    #[arg(long, value_name = "N", default_value_t = brook_core::model::open::PREFILL_CHUNK,
          value_parser = parse_chunk)]
    pub prefill_chunk: usize,
    /// Do not read the next layer's likeliest experts while its mixer computes (streaming
    /// only; on by default, see docs/bench/2026-11-30-to-12-02.md "Prefetch").
    #[arg(long)]
    pub no_prefetch: bool,
    /// Which expert a full streaming cache gives up: `lru` (the least recently used), `lfu`
    /// (the least often used, then the least recent; brook's rule before 2026-12-03),
    /// `reuse` (the least likely to be asked for at its layer's next turn, learned while
    /// running; on realistic routing it read less than LRU, docs/BENCH.md) or `auto` (LRU
    /// when the cache holds at least one token's experts, else LFU).
    #[arg(long, default_value = "auto", value_parser = ["auto", "lru", "lfu", "reuse"])]
    pub cache_eviction: String,
    /// Compute backend.
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "reference", "cuda"])]
    pub backend: String,
    /// Ceiling on GPU memory for --backend cuda, e.g. 4GiB (default: what the GPU has free).
    /// Experts that do not fit stream from host memory and disk.
    #[arg(long, value_name = "SIZE")]
    pub gpu_memory_budget: Option<String>,
    /// Compute threads (default: all cores). `bench` takes a list, e.g. 1,2, and sweeps it.
    #[arg(long, value_delimiter = ',')]
    pub threads: Vec<usize>,
    /// Arithmetic of the CPU backend's 4-bit products: `exact` (equal to the f32 reference
    /// up to f32 rounding: on AVX-512 VNNI Split24's integer products, elsewhere f32 FMA),
    /// `split24` (the same as `exact`; kept for scripts), or `fast` (lossy: int8 activations
    /// per 32 values, as llama.cpp's Q8, in decode and prefill; see docs/BENCH.md for its
    /// agreement).
    #[arg(long, default_value = "exact", value_parser = ["exact", "split24", "fast"])]
    pub precision: String,
    /// Check every expert read from disk against the container's hash of it (xxh3; a few
    /// percent of one core at the disk's speed): a file changed in place or bad data from the
    /// disk is an error instead of wrong answers.
    #[arg(long)]
    pub verify_reads: bool,
}

use brook_core::cpu::Precision;

fn parse_context(s: &str) -> std::result::Result<usize, String> {
    let max = brook_core::model::open::MAX_CONTEXT;
    match s.parse::<usize>() {
        Ok(n) if (1..=max).contains(&n) => Ok(n),
        _ => Err(format!(
            "`{s}` is not a context length: give a number of positions from 1 to {max}"
        )),
    }
}

fn parse_chunk(s: &str) -> std::result::Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if (1..=65536).contains(&n) => Ok(n),
        _ => Err(format!(
            "`{s}` is not a chunk size: give a token count from 1 to 65536"
        )),
    }
}

impl ModelArgs {
    /// Library open options from the flags.
    pub fn options(&self) -> Result<brook_core::model::open::OpenOptions> {
        use brook_core::model::open::Backend;
        let backend = match self.backend.as_str() {
            "reference" => Backend::Reference,
            "cuda" => Backend::Cuda,
            _ => Backend::Cpu,
        };
        let parse = |s: &Option<String>| {
            s.as_deref()
                .map(brook_core::experts::budget::parse_size)
                .transpose()
        };
        let cuda = backend == Backend::Cuda;
        let gpu_memory_budget = parse(&self.gpu_memory_budget)?;
        Ok(brook_core::model::open::OpenOptions {
            backend,
            gpu_memory_budget,
            engine: cuda.then(brook_cuda::engine_maker),
            // Where the GPU holds every expert, or the host budget holds the ones it can't
            // (the engine keeps those in mapped host memory), the host keeps a small cache to
            // stage them; otherwise that cache is the second tier, sized as the CPU backend
            // sizes its own (no --memory-budget: from the cgroup limit and free RAM).
            expert_cache: match self.expert_cache {
                Some(n) => Some(n),
                None if cuda => self
                    .cuda_host_stages(gpu_memory_budget, parse(&self.memory_budget)?)?
                    .then_some(CUDA_HOST_SLOTS),
                None => None,
            },
            threads: self.threads.first().copied(),
            memory_budget: parse(&self.memory_budget)?,
            context: self.context,
            prefill_chunk: self.prefill_chunk,
            prefetch: !self.no_prefetch,
            eviction: match self.cache_eviction.as_str() {
                "auto" => None,
                e => Some(e.parse()?),
            },
            fill_cache: self.fill_cache,
            verify_reads: self.verify_reads,
            precision: match self.precision.as_str() {
                "split24" => Precision::Split24,
                "fast" => Precision::Fast,
                _ => Precision::Exact,
            },
            ..Default::default()
        })
    }

    /// Whether the host's expert cache only stages experts for the GPU: every routed expert
    /// of the model is likely to fit in GPU memory beside its dense core, or the host budget
    /// (`host`, else the automatic one) holds the ones that don't (a container's sizes
    /// against the GPU budget, `gpu` or what is free). A checkpoint folder counts as
    /// fitting: it is loaded whole anyway.
    fn cuda_host_stages(&self, gpu: Option<u64>, host: Option<u64>) -> Result<bool> {
        let path = self.path()?;
        if !brook_core::container::is_container(&path) {
            return Ok(true);
        }
        let m = brook_core::container::Container::open(&path)?.manifest;
        let experts: u64 = m
            .experts
            .layers
            .iter()
            .map(|l| l.stride * m.experts.num_experts as u64)
            .sum();
        let stride = m.experts.layers.iter().map(|l| l.stride).max().unwrap_or(0);
        let gpu = brook_cuda::gpu::Gpu::open(0, gpu)?.budget;
        let host = host.or_else(brook_core::experts::budget::automatic_budget);
        Ok(fits_gpu(m.dense.size, experts, gpu)
            || host.is_some_and(|h| host_maps(m.dense.size, experts, stride, gpu, h)))
    }

    /// The model folder `--model` names (a store name resolved to its container).
    pub fn path(&self) -> Result<std::path::PathBuf> {
        pull::resolve_model(&self.model)
    }

    /// Opens the model for `parallel` sequences at once (`None`: as many as the backend and
    /// budget suit, see [`default_parallel`]) and says how many.
    pub fn open_parallel(
        &self,
        parallel: Option<usize>,
    ) -> Result<(std::sync::Arc<brook_core::session::Llm>, usize)> {
        if let Some(n) = parallel.filter(|n| !(1..=MAX_PARALLEL).contains(n)) {
            anyhow::bail!(brook_core::Error::Invalid(format!(
                "--parallel {n}: give 1 to {MAX_PARALLEL} requests"
            )));
        }
        let path = self.path()?;
        let mut o = self.options()?;
        let n = match parallel {
            Some(n) => n,
            None => default_parallel(&path, &o)?,
        };
        o.max_seqs = n;
        let llm = brook_core::session::Llm::open(&path, o)?;
        tracing::info!(
            "forward pass: the {} engine, {n} sequences a step",
            llm.engine_stats().engine
        );
        Ok((std::sync::Arc::new(llm), n))
    }

    /// Opens the model with its tokenizer, template and the engine the flags chose.
    pub fn open(&self) -> Result<std::sync::Arc<brook_core::session::Llm>> {
        let llm = brook_core::session::Llm::open(&self.path()?, self.options()?)?;
        tracing::info!("forward pass: the {} engine", llm.engine_stats().engine);
        Ok(std::sync::Arc::new(llm))
    }
}

/// Most requests `--parallel` runs at once.
pub const MAX_PARALLEL: usize = 64;

/// Sequences a server runs at once by default: on the CPU backend, 4 where their states take
/// at most an eighth of the memory budget (else 2, else 1), since each state's bytes come out
/// of the expert cache; on the CUDA backend, 16 where their GPU states take at most an eighth
/// of the GPU budget (else 8, 4, 2, 1), as a batched GPU step of 16 costs little more than
/// one of 2.
pub fn default_parallel(
    path: &std::path::Path,
    o: &brook_core::model::open::OpenOptions,
) -> Result<usize> {
    use brook_core::model::open::{Backend, state_bytes};
    let cfg = if brook_core::container::is_container(path) {
        brook_core::container::Container::open(path)?.config
    } else {
        brook_core::config::ModelConfig::from_dir(path)?
    };
    if o.backend == Backend::Cuda {
        let gpu = brook_cuda::gpu::Gpu::open(0, o.gpu_memory_budget)?;
        let one = brook_cuda::state::DeviceSeq::bytes(&cfg, o.context);
        return Ok([16, 8, 4, 2]
            .into_iter()
            .find(|&n| n * one <= gpu.budget / 8)
            .unwrap_or(1) as usize);
    }
    if o.backend != Backend::Cpu {
        return Ok(1);
    }
    let Some(budget) = o
        .memory_budget
        .or_else(brook_core::experts::budget::automatic_budget)
    else {
        return Ok(4);
    };
    Ok([4, 2]
        .into_iter()
        .find(|&n| state_bytes(&cfg, o.context, o.prefill_chunk, n) <= budget / 8)
        .unwrap_or(1))
}

/// Host expert slots staging copies to the GPU when --backend cuda runs without a host
/// budget and the GPU holds every expert: enough for a full layer of the largest supported
/// models.
const CUDA_HOST_SLOTS: usize = 512;

/// Whether a model of `dense` and `experts` bytes fits a GPU budget of `budget` bytes with
/// room for its sequence states (default `--parallel` keeps them within an eighth of the
/// budget), the scratch of a prefill chunk and slack (1 GiB): the engine then makes every
/// expert resident, which it decides exactly once open.
fn fits_gpu(dense: u64, experts: u64, budget: u64) -> bool {
    dense + experts + budget / 8 + (1 << 30) <= budget
}

/// Whether a host budget of `host` bytes holds, beside the dense core's host copy, the
/// staging cache ([`CUDA_HOST_SLOTS`] of `stride`) and 2 GiB of slack, the experts (of
/// `experts` bytes) a GPU budget of `gpu` bytes leaves out, as the CUDA engine keeps them in
/// mapped host memory (it decides exactly once open: this only sizes the host cache).
fn host_maps(dense: u64, experts: u64, stride: u64, gpu: u64, host: u64) -> bool {
    let on_gpu = gpu.saturating_sub(dense + gpu / 8 + (1 << 30));
    let rest = experts.saturating_sub(on_gpu);
    dense + rest + CUDA_HOST_SLOTS as u64 * stride + (2 << 30) <= host
}

/// Rates of plain reads of memory, in GB/s, and their summary.
#[derive(Debug, Clone, Default)]
pub struct MemReads {
    pub rates: Vec<f64>,
}

impl MemReads {
    /// The median read: the rate a sustained reader gets (0 without reads).
    pub fn median(&self) -> f64 {
        let mut v = self.rates.clone();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(0.0)
    }

    /// The fastest read (0 without reads).
    pub fn best(&self) -> f64 {
        self.rates.iter().copied().fold(0.0, f64::max)
    }

    pub fn extend(&mut self, other: &MemReads) {
        self.rates.extend_from_slice(&other.rates);
    }
}

/// Memory read bandwidth: sums the model's own largest resident weight (the output head) with
/// `threads` threads, so the test allocates nothing, back to back at least `min_reads` times
/// and for at least `min_secs`. One read of the 35B's head takes under 10 ms, and on a shared
/// host single reads range from a fifth to 1.6x their median (docs/bench/2026-11-30-to-12-02.md, "session 12"):
/// callers take the median of many, not the best of a few.
pub fn memory_reads(
    model: &brook_core::Model,
    threads: usize,
    min_reads: usize,
    min_secs: f64,
) -> MemReads {
    use brook_core::linear::Weights;
    let bytes: &[u8] = match &model.dense.lm_head.weights {
        Weights::Float { data, .. } => data,
        Weights::Affine { packed, .. } => packed,
    };
    let threads = threads.max(1);
    let part = bytes.len().div_ceil(threads).max(1);
    let read_once = || {
        let t = std::time::Instant::now();
        let sum: u64 = std::thread::scope(|s| {
            let handles: Vec<_> = bytes
                .chunks(part)
                .map(|c| {
                    s.spawn(move || {
                        let mut acc = 0u64;
                        for w in c.chunks_exact(8) {
                            acc = acc.wrapping_add(u64::from_le_bytes([
                                w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7],
                            ]));
                        }
                        acc
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or(0))
                .fold(0, u64::wrapping_add)
        });
        std::hint::black_box(sum);
        bytes.len() as f64 / t.elapsed().as_secs_f64().max(1e-9) / 1e9
    };
    let start = std::time::Instant::now();
    let mut rates = Vec::new();
    while rates.len() < min_reads
        || (start.elapsed().as_secs_f64() < min_secs && rates.len() < 10_000)
    {
        rates.push(read_once());
    }
    MemReads { rates }
}

/// Sampling flags shared by `generate` and `chat`.
#[derive(Debug, Clone, clap::Args)]
pub struct SamplingArgs {
    /// Temperature; 0 is greedy (default: the model's generation_config.json, else greedy).
    #[arg(long)]
    pub temperature: Option<f32>,
    #[arg(long)]
    pub top_k: Option<usize>,
    #[arg(long)]
    pub top_p: Option<f32>,
    #[arg(long)]
    pub min_p: Option<f32>,
    #[arg(long)]
    pub repeat_penalty: Option<f32>,
    #[arg(long)]
    pub presence_penalty: Option<f32>,
    #[arg(long)]
    pub frequency_penalty: Option<f32>,
    /// Seed that makes sampling reproducible.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Stop strings (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
    /// Keep generating past the model's end-of-sequence ids (llama.cpp's --ignore-eos; for
    /// benchmarks: exactly --max-tokens tokens).
    #[arg(long)]
    pub ignore_eos: bool,
}

impl SamplingArgs {
    /// The model's defaults overridden by the flags given.
    pub fn params(&self, llm: &brook_core::session::Llm) -> brook_core::text::SamplingParams {
        let mut p = llm.generation.sampling_params();
        if let Some(t) = self.temperature {
            p.temperature = t;
        }
        if let Some(v) = self.top_k {
            p.top_k = v;
        }
        if let Some(v) = self.top_p {
            p.top_p = v;
        }
        if let Some(v) = self.min_p {
            p.min_p = v;
        }
        if let Some(v) = self.repeat_penalty {
            p.repetition_penalty = v;
        }
        if let Some(v) = self.presence_penalty {
            p.presence_penalty = v;
        }
        if let Some(v) = self.frequency_penalty {
            p.frequency_penalty = v;
        }
        if let Some(v) = self.seed {
            p.seed = v;
        }
        p
    }
}

#[cfg(test)]
mod tests {
    use super::{fits_gpu, host_maps};

    #[test]
    fn the_host_is_a_second_tier_only_where_the_gpu_cannot_hold_every_expert() {
        const GIB: u64 = 1 << 30;
        // q36-synth's container: 1.39 GB of dense tensors, 18.12 GB of expert strides.
        let (dense, experts) = (1_389_560_104, 18_119_393_280);
        assert!(fits_gpu(dense, experts, 139 * GIB), "an H200 holds the 35B");
        assert!(
            fits_gpu(dense, experts, 24 * GIB),
            "so does a 24 GB card, barely"
        );
        assert!(!fits_gpu(dense, experts, 16 * GIB));
        assert!(
            !fits_gpu(dense, experts, 8 * GIB),
            "#30's 35B at 8 GiB streams"
        );
        // next80-synth: 44.84 GB in all; 22 GiB of a 24 GB card does not hold it.
        assert!(!fits_gpu(3_000_000_000, 41_840_000_000, 22 * GIB));
        assert!(fits_gpu(3_000_000_000, 41_840_000_000, 139 * GIB));
    }

    #[test]
    fn host_memory_holds_what_the_gpu_cannot_where_the_budget_allows() {
        const GIB: u64 = 1 << 30;
        let (dense, experts, stride) = (1_389_560_104, 18_119_393_280, 1_769_472);
        // #30's rows: the 35B at 8 GiB of GPU memory on a 128 GiB host, the 80B at 22 GiB
        // with 48 GiB of host memory.
        assert!(host_maps(dense, experts, stride, 8 * GIB, 100 * GIB));
        assert!(host_maps(
            3_000_000_000,
            41_840_000_000,
            1_702_000,
            22 * GIB,
            48 * GIB
        ));
        // A 16 GiB laptop with an 8 GiB card can't keep the 35B's other 12 GB: it streams.
        assert!(!host_maps(dense, experts, stride, 8 * GIB, 14 * GIB));
        assert!(!host_maps(dense, experts, stride, 0, 16 * GIB));
    }
}
