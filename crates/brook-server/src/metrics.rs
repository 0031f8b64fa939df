//! `GET /metrics`: the server's counters in the Prometheus text format (version 0.0.4), as
//! llama.cpp's server and vLLM offer them.
//!
//! Owns [`Metrics`], counted by the workers as requests run (lock-free counters, one small lock
//! for the last seconds' token counts), and its rendering, which adds what is read at scrape
//! time: requests running and waiting, the engine's steps and the expert cache tiers. It must
//! not block on the model: the GPU tier's counters are read only when the engine is free.

use std::fmt::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use brook_core::session::FinishReason;

/// Upper bounds (seconds) of the time-to-first-token histogram's buckets.
const TTFT_BUCKETS: [f64; 12] = [
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0,
];
/// Seconds the `tokens per second` gauge averages over.
const WINDOW_S: u64 = 10;

/// Counters the workers update.
#[derive(Debug)]
pub struct Metrics {
    started: Instant,
    /// Finished requests by how they ended: stop, length, tool_calls, cancelled, error.
    finished: [AtomicU64; 5],
    prompt_tokens: AtomicU64,
    cached_tokens: AtomicU64,
    generated: AtomicU64,
    prefill_us: AtomicU64,
    decode_us: AtomicU64,
    ttft: [AtomicU64; TTFT_BUCKETS.len() + 1],
    ttft_sum_us: AtomicU64,
    /// Tokens generated in each of the last seconds: (second since start, count).
    recent: Mutex<[(u64, u64); WINDOW_S as usize + 1]>,
}

const OUTCOMES: [&str; 5] = ["stop", "length", "tool_calls", "cancelled", "error"];

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            started: Instant::now(),
            finished: Default::default(),
            prompt_tokens: AtomicU64::new(0),
            cached_tokens: AtomicU64::new(0),
            generated: AtomicU64::new(0),
            prefill_us: AtomicU64::new(0),
            decode_us: AtomicU64::new(0),
            ttft: Default::default(),
            ttft_sum_us: AtomicU64::new(0),
            recent: Mutex::new([(u64::MAX, 0); WINDOW_S as usize + 1]),
        }
    }
}

/// What the scrape reads besides the counters.
#[derive(Debug, Default)]
pub struct Gauges {
    pub running: usize,
    pub waiting: usize,
    pub parallel: usize,
    pub engine: brook_core::engine::EngineStats,
    pub host_cache: Option<brook_core::experts::CacheStats>,
    pub gpu: Option<brook_core::engine::GpuStats>,
}

impl Metrics {
    /// A generated token, now.
    pub fn token(&self) {
        self.generated.fetch_add(1, Ordering::Relaxed);
        let sec = self.started.elapsed().as_secs();
        let mut r = self.recent.lock().unwrap_or_else(|p| p.into_inner());
        let b = &mut r[(sec % (WINDOW_S + 1)) as usize];
        if b.0 != sec {
            *b = (sec, 0);
        }
        b.1 += 1;
    }

    /// A request's first token came `s` seconds after it arrived.
    pub fn first_token(&self, s: f64) {
        let i = TTFT_BUCKETS
            .iter()
            .position(|&b| s <= b)
            .unwrap_or(TTFT_BUCKETS.len());
        self.ttft[i].fetch_add(1, Ordering::Relaxed);
        self.ttft_sum_us
            .fetch_add((s * 1e6) as u64, Ordering::Relaxed);
    }

    /// A request ended: how, and its usage where it completed.
    pub fn finished(
        &self,
        finish: Option<FinishReason>,
        usage: Option<&brook_core::session::Usage>,
    ) {
        let i = match finish {
            Some(FinishReason::Stop) => 0,
            Some(FinishReason::Length) => 1,
            Some(FinishReason::ToolCalls) => 2,
            Some(FinishReason::Cancelled) => 3,
            None => 4,
        };
        self.finished[i].fetch_add(1, Ordering::Relaxed);
        if let Some(u) = usage {
            self.prompt_tokens
                .fetch_add(u.prompt_tokens as u64, Ordering::Relaxed);
            self.cached_tokens
                .fetch_add(u.cached_tokens as u64, Ordering::Relaxed);
            self.prefill_us
                .fetch_add((u.prefill_s * 1e6) as u64, Ordering::Relaxed);
            self.decode_us
                .fetch_add((u.decode_s * 1e6) as u64, Ordering::Relaxed);
        }
    }

    /// Tokens generated per second over the last [`WINDOW_S`] whole seconds.
    fn recent_rate(&self) -> f64 {
        let now = self.started.elapsed().as_secs();
        let r = self.recent.lock().unwrap_or_else(|p| p.into_inner());
        let n: u64 = r
            .iter()
            .filter(|(s, _)| *s != u64::MAX && *s < now && now - s <= WINDOW_S)
            .map(|(_, c)| c)
            .sum();
        n as f64 / WINDOW_S.min(now.max(1)) as f64
    }

    /// The exposition text.
    pub fn render(&self, g: &Gauges) -> String {
        let mut o = String::new();
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut metric = |name: &str, kind: &str, help: &str, samples: &[(String, f64)]| {
            let _ = writeln!(o, "# HELP brook_{name} {help}");
            let _ = writeln!(o, "# TYPE brook_{name} {kind}");
            for (labels, v) in samples {
                let _ = writeln!(o, "brook_{name}{labels} {v}");
            }
        };
        let one = |v: f64| vec![(String::new(), v)];
        metric(
            "requests_running",
            "gauge",
            "Requests generating now.",
            &one(g.running as f64),
        );
        metric(
            "requests_waiting",
            "gauge",
            "Requests waiting for a slot.",
            &one(g.waiting as f64),
        );
        metric(
            "parallel_slots",
            "gauge",
            "Requests that may generate at once (--parallel).",
            &one(g.parallel as f64),
        );
        let fin: Vec<_> = OUTCOMES
            .iter()
            .zip(&self.finished)
            .map(|(k, a)| (format!("{{finish_reason=\"{k}\"}}"), load(a) as f64))
            .collect();
        metric(
            "requests_total",
            "counter",
            "Requests finished, by how they ended (error: failed before finishing).",
            &fin,
        );
        metric(
            "prompt_tokens_total",
            "counter",
            "Prompt tokens of finished requests.",
            &one(load(&self.prompt_tokens) as f64),
        );
        metric(
            "prompt_tokens_cached_total",
            "counter",
            "Prompt tokens whose state was reused from an earlier turn.",
            &one(load(&self.cached_tokens) as f64),
        );
        metric(
            "generation_tokens_total",
            "counter",
            "Tokens generated.",
            &one(load(&self.generated) as f64),
        );
        metric(
            "generation_tokens_per_second",
            "gauge",
            "Tokens generated per second, all requests together, over the last 10 s.",
            &one(self.recent_rate()),
        );
        metric(
            "prefill_seconds_total",
            "counter",
            "Time finished requests spent reading their prompts.",
            &one(load(&self.prefill_us) as f64 / 1e6),
        );
        metric(
            "decode_seconds_total",
            "counter",
            "Time finished requests spent generating.",
            &one(load(&self.decode_us) as f64 / 1e6),
        );
        let mut cum = 0;
        let mut ttft: Vec<(String, f64)> = Vec::new();
        for (i, a) in self.ttft.iter().enumerate() {
            cum += load(a);
            let le = TTFT_BUCKETS
                .get(i)
                .map_or("+Inf".to_string(), |b| b.to_string());
            ttft.push((format!("_bucket{{le=\"{le}\"}}"), cum as f64));
        }
        ttft.push(("_sum".into(), load(&self.ttft_sum_us) as f64 / 1e6));
        ttft.push(("_count".into(), cum as f64));
        metric(
            "time_to_first_token_seconds",
            "histogram",
            "Seconds from a request's arrival to its first token, waiting included.",
            &ttft,
        );
        metric(
            "engine_steps_total",
            "counter",
            "Forward steps the engine ran (a step may hold several sequences).",
            &one(g.engine.steps as f64),
        );
        metric(
            "engine_busy_seconds_total",
            "counter",
            "Time spent inside engine steps; against wall time, how busy the engine was.",
            &one(g.engine.busy_us as f64 / 1e6),
        );
        metric(
            "engine_gather_seconds_total",
            "counter",
            "Time the engine waited between steps for the sequences generating to hand in their next tokens (sampling, text and streaming on their threads).",
            &one(g.engine.gather_us as f64 / 1e6),
        );
        metric(
            "engine_tokens_total",
            "counter",
            "Tokens the engine fed (prompts and generated).",
            &one(g.engine.tokens as f64),
        );
        let tier = |t: &str| format!("{{tier=\"{t}\"}}");
        let (mut hits, mut misses, mut slots) = (Vec::new(), Vec::new(), Vec::new());
        if let Some(c) = g.host_cache {
            hits.push((tier("host"), c.hits as f64));
            misses.push((tier("host"), c.misses as f64));
            slots.push((tier("host"), c.slots as f64));
        }
        if let Some(c) = &g.gpu {
            hits.push((tier("gpu"), c.hits as f64));
            misses.push((tier("gpu"), c.misses as f64));
            slots.push((tier("gpu"), c.slots as f64));
            if c.mapped > 0 {
                // Every expert the GPU slots miss is in mapped host memory.
                hits.push((tier("mapped"), c.misses as f64));
                misses.push((tier("mapped"), 0.0));
                slots.push((tier("mapped"), c.mapped as f64));
            }
        }
        metric(
            "expert_cache_hits_total",
            "counter",
            "Routed experts found in a tier's cache (host: RAM, gpu: GPU memory, mapped: page-locked host memory the GPU reads).",
            &hits,
        );
        metric(
            "expert_cache_misses_total",
            "counter",
            "Routed experts a tier had to fetch (host: from disk; gpu: from the host).",
            &misses,
        );
        metric(
            "expert_cache_slots",
            "gauge",
            "Expert slots a tier holds now.",
            &slots,
        );
        if let Some(c) = g.host_cache {
            metric(
                "expert_disk_read_bytes_total",
                "counter",
                "Expert bytes read from disk.",
                &one(c.bytes_read as f64),
            );
        }
        o
    }
}

#[cfg(test)]
mod tests {
    use super::{Gauges, Metrics};

    #[test]
    fn each_expert_tier_has_its_line() {
        let gpu = brook_core::engine::GpuStats {
            slots: 3837,
            mapped: 6403,
            hits: 30,
            misses: 50,
            ..Default::default()
        };
        let g = Gauges {
            gpu: Some(gpu.clone()),
            ..Default::default()
        };
        let text = Metrics::default().render(&g);
        for line in [
            "brook_expert_cache_hits_total{tier=\"gpu\"} 30",
            "brook_expert_cache_misses_total{tier=\"gpu\"} 50",
            "brook_expert_cache_slots{tier=\"gpu\"} 3837",
            "brook_expert_cache_hits_total{tier=\"mapped\"} 50",
            "brook_expert_cache_slots{tier=\"mapped\"} 6403",
        ] {
            assert!(text.lines().any(|l| l == line), "no {line:?} in\n{text}");
        }
        // Without mapped experts there is no mapped tier.
        let g = Gauges {
            gpu: Some(brook_core::engine::GpuStats { mapped: 0, ..gpu }),
            ..Default::default()
        };
        assert!(!Metrics::default().render(&g).contains("tier=\"mapped\""));
    }
}
