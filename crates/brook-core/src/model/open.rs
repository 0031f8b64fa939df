//! Opening a model under a memory budget: resident dense core, experts resident or streamed.
//!
//! The budget is split before anything large is allocated (see [`crate::experts::budget`]): a
//! budget that cannot hold the dense core is refused naming the minimum; one that holds every
//! expert loads them all and nothing streams; anything between gets a cache of as many slots
//! as fit, which starts on one token's worth of them and takes the rest once that pays
//! ([`OpenOptions::fill_cache`]).

use std::path::Path;

use crate::checkpoint::Checkpoint;
use crate::config::ModelConfig;
use crate::container::{self, Container};
use crate::error::{Error, Result};
use crate::experts::ExpertCache;
use crate::experts::budget::{self, Plan};
use crate::experts::files::ExpertFiles;
use crate::experts::source::ExpertHandle;
use crate::model::Model;
use crate::model::delta_net::DeltaMode;
use crate::model::weights::Loader;

/// How to open a model.
#[derive(Debug, Clone)]
pub struct OpenOptions {
    /// Hard ceiling on the process's memory; `None` sizes from the cgroup and free memory.
    pub memory_budget: Option<u64>,
    /// Exact number of expert slots (overrides the budget's choice).
    pub expert_cache: Option<usize>,
    /// Take every slot the budget pays for from the start. By default a streaming cache
    /// starts on one token's worth of slots (top-k x layers, at least a layer's experts) and
    /// takes the rest of the budget only once it would read a tenth fewer experts
    /// ([`ExpertCache::grow_on_demand`]); memory it does not take stays free.
    pub fill_cache: bool,
    /// Longest sequence the state is sized for.
    pub context: usize,
    /// Tokens per prefill chunk.
    pub prefill_chunk: usize,
    /// Sequences computed together in one step (a server's parallel slots); the budget holds
    /// a state for each.
    pub max_seqs: usize,
    /// Reader threads for expert misses.
    pub io_threads: usize,
    /// When experts stream, start reading the next layer's likeliest experts (routed with its
    /// router on the stream leaving this layer) while its mixer computes (docs/bench/2026-11-30-to-12-02.md,
    /// "Prefetch": on by default, it measured faster).
    pub prefetch: bool,
    /// Which expert a full streaming cache gives up ([`crate::experts::Eviction`]); `None`
    /// picks by the slots the budget pays for ([`auto_eviction`]): LFU below one token's
    /// experts (top-k x layers; under LRU such a cache evicts each expert just before it is
    /// asked for again), LRU otherwise.
    pub eviction: Option<crate::experts::Eviction>,
    /// Which forward pass runs.
    pub backend: Backend,
    /// Compute threads of the CPU backend (default: every core).
    pub threads: Option<usize>,
    /// Activation arithmetic of the CPU backend.
    pub precision: crate::engine::Precision,
    /// Ceiling on GPU memory for a GPU backend (weights, expert slots, state and scratch);
    /// `None` uses what the device has free. Separate from `memory_budget`, which is host RAM.
    pub gpu_memory_budget: Option<u64>,
    /// Builds the engine of a backend brook-core does not contain ([`Backend::Cuda`]).
    pub engine: Option<crate::engine::EngineMaker>,
    /// Check every expert read from disk against its hash in the container's manifest (an
    /// xxh3 of each blob, a few percent of one core at the disk's speed): a file changed in
    /// place or bad data from the disk is then an error instead of wrong answers.
    pub verify_reads: bool,
}

/// The compute path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Backend {
    /// SIMD kernels and threads (the default).
    #[default]
    Cpu,
    /// The plain f32 reference pass, the oracle the others are tested against.
    Reference,
    /// The CUDA backend (crate brook-cuda), given through [`OpenOptions::engine`].
    Cuda,
}

impl Default for OpenOptions {
    fn default() -> Self {
        OpenOptions {
            memory_budget: None,
            expert_cache: None,
            fill_cache: false,
            context: 4096,
            prefill_chunk: PREFILL_CHUNK,
            max_seqs: 1,
            io_threads: 8,
            prefetch: true,
            eviction: None,
            backend: Backend::Cpu,
            threads: None,
            precision: Default::default(),
            gpu_memory_budget: None,
            engine: None,
            verify_reads: false,
        }
    }
}

/// Prompt tokens per prefill chunk by default. 512 rather than 256: on the 35B each of 256
/// experts then sees about 16 tokens a chunk instead of 8, and a streamed prompt reads each
/// expert half as often (docs/bench/2026-11-30-to-12-02.md, "Prefill chunk"); the scratch costs about 330 KB a
/// token of budget.
pub const PREFILL_CHUNK: usize = 512;

/// Most compute threads (each holds scratch sized by the model; more than the machine has
/// cores only slows a pass down).
pub const MAX_THREADS: usize = 1024;

/// Longest context a model is opened for: 16M positions, 64 times the longest these models
/// were trained for; the state is sized from it, so a larger value only overflows.
pub const MAX_CONTEXT: usize = 1 << 24;

/// Bytes of the states of `seqs` sequences of `context` tokens and the scratch of steps of
/// prefill chunks of `chunk` (beside the other sequences' single tokens).
pub fn state_bytes(cfg: &ModelConfig, context: usize, chunk: usize, seqs: usize) -> u64 {
    let seqs = seqs.max(1);
    let chunk = chunk + seqs - 1;
    let full = cfg.attention_layers();
    let linear = cfg.num_hidden_layers - full;
    let kv = full * context * 2 * cfg.num_key_value_heads * cfg.head_dim * 4;
    let delta = linear * (cfg.ssm_state_len() + cfg.conv_state_len()) * 4;
    let (h, conv) = (cfg.hidden_size, cfg.conv_dim());
    let vd = cfg.linear_num_value_heads * cfg.linear_value_head_dim;
    let qd = cfg.num_attention_heads * cfg.head_dim * 3;
    let k = cfg.num_experts_per_tok;
    let per_token = 8 * h + 4 * conv + 5 * vd + qd + context.min(chunk + 1) + cfg.num_experts;
    // Prefill keeps every routed expert's output (k·H per token, in place of one expert's
    // input and output), and each thread one expert's 64 tokens (cpu/blocks/moe.rs, `Lane`) and
    // attention scores for the query heads of one kv head.
    let routed = chunk * k.saturating_sub(2) * h;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let lanes = threads * 64 * (h + 2 * cfg.moe_intermediate_size);
    // Attention scores: per thread, one row per query head of a kv head (cpu/blocks/mixer.rs).
    let group = cfg.num_attention_heads / cfg.num_key_value_heads.max(1);
    let scores = threads * group.max(1) * context;
    // Tokens prepared one at a time for the one-token kernels (up to `ONE_TOKEN_ROWS_TILED`
    // of a chunk): per thread an expert's inputs and its down projection's, and for the dense
    // products their widest inputs. A prepared token takes up to 11 bytes an element (f32
    // copy, f32 lanes, three digit bytes).
    let one = crate::cpu::blocks::exec::ONE_TOKEN_ROWS_TILED.min(chunk);
    let is = cfg.shared_expert_intermediate_size;
    let preps = one * 11 * (threads * (h + cfg.moe_intermediate_size) + 3 * h + vd + is);
    let scratch =
        (chunk * per_token + routed + lanes + scores) * 4 + 3 * cfg.vocab_size * 4 + preps;
    ((kv + delta) * seqs + scratch) as u64
}

impl Model {
    /// Opens a container (streaming experts as the budget requires) or an MLX checkpoint
    /// (every expert resident; repack it to stream).
    pub fn open_with(dir: &Path, opts: &OpenOptions) -> Result<Self> {
        if opts.context == 0 || opts.context > MAX_CONTEXT {
            return Err(Error::Invalid(format!(
                "context {} is out of range: give 1 to {MAX_CONTEXT} positions (--context)",
                opts.context
            )));
        }
        if let Some(t) = opts.threads
            && t > MAX_THREADS
        {
            return Err(Error::Invalid(format!(
                "{t} threads is out of range: give 1 to {MAX_THREADS} (--threads; by default every core)"
            )));
        }
        if opts.prefill_chunk == 0 || opts.prefill_chunk > 1 << 16 {
            return Err(Error::Invalid(format!(
                "prefill chunk {} is out of range: give 1 to 65536 tokens (--prefill-chunk)",
                opts.prefill_chunk
            )));
        }
        let baseline = budget::rss().0;
        if !container::is_container(dir) {
            let ck = Checkpoint::open(dir)?;
            if let Some(b) = opts.memory_budget {
                let need = baseline
                    + ck.files()
                        .iter()
                        .map(|f| f.file_len().unwrap_or(0))
                        .sum::<u64>();
                if need > b {
                    return Err(Error::Invalid(format!(
                        "{} is an MLX checkpoint, which brook loads whole ({} > budget {}); run `brook repack {} OUT` and open the container to stream experts under a budget",
                        dir.display(),
                        budget::fmt_bytes(need),
                        budget::fmt_bytes(b),
                        dir.display()
                    )));
                }
            }
            let mut m = Model::load_resident(&ck, ck.config.clone())?;
            if crate::engine::tiles_dense(opts) {
                m.dense.tile();
            }
            // Every expert is resident: `load_resident` leaves prefetch off (nothing to read
            // ahead; guessing would cost a router product a layer).
            m.prefill_chunk = opts.prefill_chunk;
            return Ok(m);
        }
        let c = Container::open(dir)?;
        let cfg = c.config.clone();
        let ex = &c.manifest.experts;
        let total = cfg.num_hidden_layers * cfg.num_experts;
        let stride = ex.layers.iter().map(|l| l.stride).max().unwrap_or(0);
        let budget = opts.memory_budget.or_else(budget::automatic_budget);
        let on_disk = Loader::new(&c, &cfg).embedding_on_disk_bytes()?;
        let state = state_bytes(&cfg, opts.context, opts.prefill_chunk, opts.max_seqs);
        // What `budget` buys with the dense core (2% slack) and, or not, the embedding table.
        let plan = |b: u64, with_table: bool| {
            let resident = c.manifest.dense.size.saturating_sub(on_disk)
                + if with_table { on_disk } else { 0 };
            let dense = resident + resident / 50;
            let k = cfg.num_experts_per_tok;
            Plan::new(b, baseline, dense, state, stride, k, total)
        };
        let slots = match (opts.expert_cache, budget) {
            (Some(n), _) => n.clamp(cfg.num_experts_per_tok.min(total), total),
            (None, Some(b)) => plan(b, false)?.slots,
            (None, None) => total,
        };
        // Where the budget holds the whole model, the embedding table is resident too, so
        // nothing streams: a row read from the file costs a random read per token, which a
        // busy disk made 19 ms (docs/bench/2026-11-30-to-12-02.md, "session 12"). Otherwise its bytes buy slots.
        let table_resident = slots >= total
            && match (opts.expert_cache, budget) {
                (None, Some(b)) => plan(b, true).is_ok_and(|p| p.slots >= total),
                _ => true,
            };
        if slots < cfg.num_experts_per_tok {
            tracing::warn!(
                "{slots} expert slots is fewer than top-k {}: every layer will read in several batches",
                cfg.num_experts_per_tok
            );
        }
        let rows_in = (!table_resident).then(|| c.dense_path());
        let mut dense = Loader::new(&c, &cfg).dense_with(rows_in.as_deref())?;
        if crate::engine::tiles_dense(opts) {
            let n = dense.tile();
            tracing::debug!("{n} dense matrices in 16-row tiles for the VNNI kernels");
        }
        let store = ExpertFiles::open(&c)?.verifying(&c, opts.verify_reads)?;
        let experts: Box<dyn crate::experts::source::ExpertSource> = if slots >= total {
            tracing::info!("budget holds every expert: loading all {total} resident");
            let cache = ExpertCache::new(
                store,
                c.layouts.clone(),
                stride as usize,
                cfg.num_experts,
                total,
                opts.io_threads,
            );
            if crate::engine::tiles_dense(opts) {
                cache.tile_experts();
            }
            // Load everything through the cache once; with a slot per expert nothing is evicted.
            let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
            for l in 0..cfg.num_hidden_layers {
                let ids: Vec<usize> = (0..cfg.num_experts).collect();
                let handles = crate::experts::source::ExpertSource::fetch(&cache, l, &ids)?;
                for h in &handles {
                    h.wait()?;
                }
                layers.push(handles);
            }
            let held = crate::experts::source::ResidentExperts { layers };
            Box::new(ResidentCache {
                cache,
                held,
                asked: Default::default(),
            })
        } else {
            // Streamed experts stay in rows: the one-token kernels read both orders at the
            // same speed class and to the same bits, and the I/O threads only read.
            let cache = ExpertCache::new(
                store,
                c.layouts.clone(),
                stride as usize,
                cfg.num_experts,
                slots,
                opts.io_threads,
            );
            let k = cfg.num_experts_per_tok;
            cache.set_eviction(
                opts.eviction
                    .unwrap_or_else(|| auto_eviction(slots, k * cfg.num_hidden_layers)),
            );
            cache.set_top_k(k);
            if !opts.fill_cache && opts.expert_cache.is_none() {
                let start = (k * cfg.num_hidden_layers).max(cfg.num_experts + k);
                cache.grow_on_demand(start, k * cfg.num_hidden_layers);
            }
            tracing::info!(
                "streaming experts through {} of up to {slots} slots of {} ({total} experts)",
                cache.slots(),
                budget::fmt_bytes(stride),
            );
            Box::new(cache)
        };
        Ok(Model {
            cfg,
            dense,
            experts,
            delta_mode: DeltaMode::Auto,
            // Guesses only pay where experts stream (a router product a layer otherwise).
            prefetch: opts.prefetch && slots < total,
            prefill_chunk: opts.prefill_chunk,
            steps: Default::default(),
        })
    }
}

/// Every expert loaded once into a cache with a slot each, and held (pinned) for good.
#[derive(Debug)]
struct ResidentCache {
    cache: ExpertCache,
    held: crate::experts::source::ResidentExperts,
    /// Experts asked for since open: every one a hit.
    asked: std::sync::atomic::AtomicU64,
}

impl crate::experts::source::ExpertSource for ResidentCache {
    fn fetch(&self, layer: usize, ids: &[usize]) -> Result<Vec<ExpertHandle>> {
        let mut out = Vec::with_capacity(ids.len());
        self.fetch_into(layer, ids, &mut out)?;
        Ok(out)
    }
    fn fetch_into(&self, layer: usize, ids: &[usize], out: &mut Vec<ExpertHandle>) -> Result<()> {
        self.held.fetch_into(layer, ids, out)?;
        let n = ids.len() as u64;
        self.asked
            .fetch_add(n, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }
    /// The cache's counters with the requests since open as hits and no misses (the load's
    /// reads stay in `reads` and `bytes_read`): a resident store hits every time, and says so
    /// instead of the 0 % the load's own requests would give.
    fn stats(&self) -> Option<crate::experts::CacheStats> {
        let s = crate::experts::source::ExpertSource::stats(&self.cache)?;
        Some(crate::experts::CacheStats {
            hits: self.asked.load(std::sync::atomic::Ordering::Relaxed),
            misses: 0,
            ..s
        })
    }
}

/// The eviction rule `--cache-eviction auto` takes for a cache of up to `slots` slots when a
/// token asks for `per_token` experts: below one token's worth least-frequently-used (LRU
/// there evicts each expert just before its layer asks again), otherwise least-recently-used.
/// The learned reuse rule decoded 5-14 % faster than LRU on realistic traces replayed
/// through the bench (prefetch off), but 10-12 % slower on the routers with prefetch on at
/// equal hit rates (docs/bench/2026-12-04.md, "Reuse against LRU after the fix"), so it stays
/// a choice (`--cache-eviction reuse`) until that is understood.
pub fn auto_eviction(slots: usize, per_token: usize) -> crate::experts::Eviction {
    use crate::experts::Eviction;
    if slots < per_token {
        Eviction::Lfu
    } else {
        Eviction::Lru
    }
}
