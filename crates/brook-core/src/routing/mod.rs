//! Routing traces: which experts each decoded token used in each MoE layer.
//!
//! A trace is what a cache policy is judged on. Random-weight models route almost uniformly,
//! so every cache hits in proportion to its size there; real checkpoints reuse experts from
//! one token to the next. This module owns the trace format (JSON Lines, docs/FORMAT.md:
//! one line per decoded token, `{"layers": [[e, ...], ...]}`), a simulator of realistic
//! routing ([`simulate`]), and offline cache models on a trace ([`replay`]: Belady's optimum,
//! LRU, LFU) to compare the real cache against.
//!
//! It must not depend on the model's weights or on an engine: a trace is plain data.

pub mod replay;
pub mod simulate;

use std::io::{BufRead, Write};
use std::path::Path;

use crate::error::{Error, Result};

/// Most decoded tokens a trace file may hold (a trace of real generation is thousands).
pub const MAX_TRACE_TOKENS: usize = 1 << 20;
/// Longest line accepted (a 512-expert, 64-layer, top-32 line is under 100 KB).
const MAX_LINE_BYTES: usize = 1 << 20;

/// The routing of a run of decoded tokens: for each token and MoE layer, the `top_k` expert
/// ids in the router's order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutingTrace {
    pub layers: usize,
    pub top_k: usize,
    /// Experts per layer of the model the trace is for (ids are below it).
    pub num_experts: usize,
    /// [token][layer][k], flattened.
    ids: Vec<u32>,
}

impl RoutingTrace {
    /// An empty trace for a model of `layers` MoE layers of `num_experts` experts, `top_k`
    /// a token.
    pub fn new(layers: usize, num_experts: usize, top_k: usize) -> Result<Self> {
        if layers == 0 || top_k == 0 || top_k > num_experts || num_experts > u32::MAX as usize {
            return Err(Error::Invalid(format!(
                "a routing trace needs at least one layer and 1 <= top-k <= experts; got {layers} layers, top-k {top_k}, {num_experts} experts"
            )));
        }
        Ok(RoutingTrace {
            layers,
            top_k,
            num_experts,
            ids: Vec::new(),
        })
    }

    /// Decoded tokens in the trace.
    pub fn tokens(&self) -> usize {
        self.ids.len() / (self.layers * self.top_k)
    }

    /// The experts of `token` in `layer`.
    pub fn experts(&self, token: usize, layer: usize) -> &[u32] {
        let at = (token * self.layers + layer) * self.top_k;
        &self.ids[at..at + self.top_k]
    }

    /// Appends a token's routing, one list per layer; checks every id.
    pub fn push(&mut self, layers: &[Vec<u32>]) -> Result<()> {
        if self.tokens() >= MAX_TRACE_TOKENS {
            return Err(Error::Invalid(format!(
                "a routing trace holds at most {MAX_TRACE_TOKENS} tokens"
            )));
        }
        if layers.len() != self.layers {
            return Err(Error::Invalid(format!(
                "{} layer lists where the model has {} MoE layers",
                layers.len(),
                self.layers
            )));
        }
        for (l, ids) in layers.iter().enumerate() {
            if ids.len() != self.top_k {
                return Err(Error::Invalid(format!(
                    "layer {l} lists {} experts where the model routes to {}",
                    ids.len(),
                    self.top_k
                )));
            }
            for (i, &e) in ids.iter().enumerate() {
                if e as usize >= self.num_experts {
                    return Err(Error::Invalid(format!(
                        "layer {l} names expert {e}; the model has {}",
                        self.num_experts
                    )));
                }
                if ids[..i].contains(&e) {
                    return Err(Error::Invalid(format!("layer {l} names expert {e} twice")));
                }
            }
        }
        for ids in layers {
            self.ids.extend_from_slice(ids);
        }
        Ok(())
    }

    /// Reads a trace file for a model of `layers` MoE layers, `num_experts` experts and
    /// `top_k`; every line is checked against them.
    pub fn read(path: &Path, layers: usize, num_experts: usize, top_k: usize) -> Result<Self> {
        let f = std::fs::File::open(path).map_err(|e| {
            Error::Invalid(format!(
                "cannot open the routing trace {}: {e}",
                path.display()
            ))
        })?;
        Self::parse(std::io::BufReader::new(f), layers, num_experts, top_k)
            .map_err(|e| Error::Invalid(format!("routing trace {}: {e}", path.display())))
    }

    /// [`RoutingTrace::read`] from any reader.
    pub fn parse(r: impl BufRead, layers: usize, num_experts: usize, top_k: usize) -> Result<Self> {
        #[derive(serde::Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Line {
            layers: Vec<Vec<u32>>,
        }
        let mut t = RoutingTrace::new(layers, num_experts, top_k)?;
        let mut r = r;
        let mut buf = Vec::new();
        let mut n = 0usize;
        loop {
            buf.clear();
            // One line at most MAX_LINE_BYTES: a hostile file cannot make it allocate more.
            let got = std::io::Read::take(&mut r, MAX_LINE_BYTES as u64 + 1)
                .read_until(b'\n', &mut buf)
                .map_err(|e| Error::Invalid(format!("reading line {}: {e}", n + 1)))?;
            if got == 0 {
                break;
            }
            n += 1;
            if buf.len() > MAX_LINE_BYTES {
                return Err(Error::Invalid(format!(
                    "line {n} is longer than {MAX_LINE_BYTES} bytes"
                )));
            }
            let text = std::str::from_utf8(&buf)
                .map_err(|_| Error::Invalid(format!("line {n} is not UTF-8")))?
                .trim();
            if text.is_empty() {
                continue;
            }
            let line: Line = serde_json::from_str(text).map_err(|e| {
                Error::Invalid(format!(
                    "line {n} is not {{\"layers\": [[expert, ...], ...]}}: {e}"
                ))
            })?;
            t.push(&line.layers)
                .map_err(|e| Error::Invalid(format!("line {n}: {e}")))?;
        }
        if t.tokens() == 0 {
            return Err(Error::Invalid("the trace holds no tokens".into()));
        }
        Ok(t)
    }

    /// Writes the trace as JSON Lines.
    pub fn write(&self, w: &mut impl Write) -> std::io::Result<()> {
        for t in 0..self.tokens() {
            let layers: Vec<&[u32]> = (0..self.layers).map(|l| self.experts(t, l)).collect();
            serde_json::to_writer(&mut *w, &serde_json::json!({ "layers": layers }))?;
            w.write_all(b"\n")?;
        }
        Ok(())
    }

    /// Writes the trace to `path` atomically (a temporary file renamed into place).
    pub fn save(&self, path: &Path) -> Result<()> {
        let tmp = path.with_extension("partial");
        let write = || -> std::io::Result<()> {
            let mut f = std::io::BufWriter::new(std::fs::File::create(&tmp)?);
            self.write(&mut f)?;
            f.into_inner().map_err(|e| e.into_error())?.sync_all()?;
            std::fs::rename(&tmp, path)
        };
        write().map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            Error::Invalid(format!(
                "cannot write the routing trace {}: {e}",
                path.display()
            ))
        })
    }

    /// Reuse statistics of the trace, per layer and expert, pooled over layers.
    pub fn reuse(&self) -> Reuse {
        let (mut picks, mut next, mut within8) = (0u64, 0u64, 0u64);
        let mut dists = Vec::new();
        let mut last = vec![usize::MAX; self.layers * self.num_experts];
        for t in 0..self.tokens() {
            for l in 0..self.layers {
                for &e in self.experts(t, l) {
                    let at = &mut last[l * self.num_experts + e as usize];
                    if *at != usize::MAX {
                        let d = t - *at;
                        dists.push(d);
                        next += (d == 1) as u64;
                        within8 += (d <= 8) as u64;
                    }
                    picks += 1;
                    *at = t;
                }
            }
        }
        dists.sort_unstable();
        let frac = |n: u64| n as f64 / picks.max(1) as f64;
        Reuse {
            at_next_token: frac(next),
            within_8_tokens: frac(within8),
            median_distance: dists.get(dists.len() / 2).copied().unwrap_or(0),
        }
    }
}

/// How often a trace's picks repeat an earlier pick of the same expert in the same layer.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Reuse {
    /// Share of picks whose expert the layer also picked at the previous token.
    pub at_next_token: f64,
    /// Share of picks whose expert the layer picked within the 8 tokens before.
    pub within_8_tokens: f64,
    /// Median tokens since the same layer last picked the expert (repeats only).
    pub median_distance: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trace_round_trips_and_bad_lines_are_named() {
        let mut t = RoutingTrace::new(2, 8, 2).expect("new");
        t.push(&[vec![1, 2], vec![7, 0]]).expect("push");
        t.push(&[vec![2, 3], vec![0, 5]]).expect("push");
        let mut out = Vec::new();
        t.write(&mut out).expect("write");
        let text = String::from_utf8(out).expect("utf8");
        assert_eq!(text.lines().next(), Some(r#"{"layers":[[1,2],[7,0]]}"#));
        let back = RoutingTrace::parse(text.as_bytes(), 2, 8, 2).expect("parse");
        assert_eq!(back, t);
        let bad = |s: &str| {
            RoutingTrace::parse(s.as_bytes(), 2, 8, 2)
                .expect_err(s)
                .to_string()
        };
        assert!(bad("{\"layers\":[[1,2]]}\n").contains("line 1: 1 layer lists"));
        assert!(bad("{\"layers\":[[1,2],[3,9]]}").contains("names expert 9"));
        assert!(bad("{\"layers\":[[1,1],[3,4]]}").contains("twice"));
        assert!(bad("{\"layers\":[[1,2,3],[3,4]]}").contains("lists 3 experts"));
        assert!(bad("\n{\"layers\":[[1,2],[3,4]]}\nnot json").contains("line 3 is not"));
        assert!(bad("{\"layers\":[[1,2],[3,-4]]}").contains("line 1"));
        assert!(bad("").contains("no tokens"));
        let long = format!("{}\n", " ".repeat(MAX_LINE_BYTES + 10));
        assert!(bad(&long).contains("longer than"));
    }

    #[test]
    fn reuse_counts_repeats_per_layer() {
        let mut t = RoutingTrace::new(1, 8, 2).expect("new");
        for ids in [[0, 1], [0, 2], [3, 4], [0, 1]] {
            t.push(&[ids.to_vec()]).expect("push");
        }
        let r = t.reuse();
        // Picks: 8; repeats: 0 at distance 1 (token 1), 0 at 2 and 1 at 3 (token 3).
        assert!((r.at_next_token - 1.0 / 8.0).abs() < 1e-12);
        assert!((r.within_8_tokens - 3.0 / 8.0).abs() < 1e-12);
        assert_eq!(r.median_distance, 2);
    }
}
