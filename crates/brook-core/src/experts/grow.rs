//! Growing an expert cache on demand: whether a cache on part of its slots should take all
//! of them, decided by replaying the demand requests through two shadow caches (as large as
//! the slots in use, and as large as all of them) and comparing what each would have read.

/// Reads a growing cache must save to take the rest of its slots: a tenth of what the slots in
/// use read over the same requests (docs/bench/2026-11-30-to-12-02.md, "Session 18: the cache grows on demand").
pub const GROW_MIN_SAVING: f64 = 0.10;

/// Tokens of requests (top-k x layers each) behind each decision to grow.
pub const GROW_WINDOW_TOKENS: u64 = 8;

/// Whether a cache on part of its slots should take all of them, decided from what two shadow
/// caches read over the same demand requests.
#[derive(Debug)]
pub(crate) struct Growth {
    small: Shadow,
    large: Shadow,
    /// Experts one token requests (top-k x layers).
    per_token: u64,
    /// Experts requested, and read by each shadow, in the current window.
    seen: u64,
    small_reads: u64,
    large_reads: u64,
}

impl Growth {
    /// The shadows evict as the cache does (LRU standing in for the learned reuse rule, which
    /// reads about as LRU does from four tokens' worth of slots up).
    pub(crate) fn set_eviction(&mut self, e: crate::experts::cache::Eviction) {
        self.small.lfu = e == crate::experts::cache::Eviction::Lfu;
        self.large.lfu = self.small.lfu;
    }

    /// Shadows of `small` and `large` slots over `layers` x `experts`; a token requests
    /// `per_token` experts.
    pub(crate) fn new(
        small: usize,
        large: usize,
        layers: usize,
        experts: usize,
        per_token: usize,
    ) -> Self {
        Growth {
            small: Shadow::new(small, layers, experts),
            large: Shadow::new(large, layers, experts),
            per_token: per_token.max(1) as u64,
            seen: 0,
            small_reads: 0,
            large_reads: 0,
        }
    }

    /// The slots in use grew to `n` without growing all the way.
    pub(crate) fn resize_small(&mut self, n: usize) {
        self.small.size = n;
    }

    /// Replays a request (use counts already counted) and says whether the window just
    /// closed with the larger cache reading at least [`GROW_MIN_SAVING`] less, and at least
    /// one expert a token less.
    pub(crate) fn request(
        &mut self,
        layer: usize,
        ids: &[usize],
        counts: &[Vec<u32>],
        tick: u64,
    ) -> bool {
        self.small_reads += self.small.request(layer, ids, counts, tick);
        self.large_reads += self.large.request(layer, ids, counts, tick);
        self.seen += ids.len() as u64;
        let window = GROW_WINDOW_TOKENS * self.per_token;
        if self.seen < window {
            return false;
        }
        let saved = self.small_reads.saturating_sub(self.large_reads);
        // The window holds at least GROW_WINDOW_TOKENS tokens' requests.
        let tokens = self.seen / self.per_token;
        let grow = saved as f64 >= GROW_MIN_SAVING * self.small_reads as f64 && saved >= tokens;
        (self.seen, self.small_reads, self.large_reads) = (0, 0, 0);
        grow
    }
}

/// The experts a cache of `size` slots would hold after the requests it was shown, under the
/// cache's eviction (least recent use, or lowest use count then least recent use; a request
/// never evicts its own experts). It holds no expert data.
#[derive(Debug)]
struct Shadow {
    size: usize,
    lfu: bool,
    /// (layer, expert, last use) of each held expert.
    held: Vec<(u32, u32, u64)>,
    /// [layer][expert] → index into `held`, or `u32::MAX`.
    at: Vec<Vec<u32>>,
}

impl Shadow {
    fn new(size: usize, layers: usize, experts: usize) -> Self {
        Shadow {
            size,
            lfu: false,
            held: Vec::with_capacity(size),
            at: vec![vec![u32::MAX; experts]; layers],
        }
    }

    /// Shows the shadow a request; returns the experts it would have read.
    fn request(&mut self, layer: usize, ids: &[usize], counts: &[Vec<u32>], tick: u64) -> u64 {
        for &e in ids {
            if let Some(h) = self.held.get_mut(self.at[layer][e] as usize) {
                h.2 = tick;
            }
        }
        let mut reads = 0;
        for &e in ids {
            if self.at[layer][e] != u32::MAX {
                continue;
            }
            reads += 1;
            let slot = if self.held.len() < self.size {
                self.held.push((0, 0, 0));
                self.held.len() - 1
            } else {
                // Experts used at `tick` belong to this request: they stay, as pinned ones do.
                let victim = self
                    .held
                    .iter()
                    .enumerate()
                    .filter(|(_, h)| h.2 != tick)
                    .min_by_key(|(i, h)| {
                        let c = if self.lfu {
                            counts[h.0 as usize][h.1 as usize]
                        } else {
                            0
                        };
                        (c, h.2, *i)
                    })
                    .map(|(i, _)| i);
                let Some(v) = victim else {
                    continue; // a request larger than the shadow: read, not kept
                };
                let (ol, oe, _) = self.held[v];
                self.at[ol as usize][oe as usize] = u32::MAX;
                v
            };
            self.held[slot] = (layer as u32, e as u32, tick);
            self.at[layer][e] = slot as u32;
        }
        reads
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Use counts and the tick for requests in layer 0, kept as the cache keeps them.
    struct Replay {
        counts: Vec<Vec<u32>>,
        tick: u64,
    }

    impl Replay {
        fn new(experts: usize) -> Self {
            Replay {
                counts: vec![vec![0; experts]],
                tick: 0,
            }
        }

        /// Counts a request's uses and starts its tick.
        fn ask(&mut self, ids: &[usize]) -> (&[Vec<u32>], u64) {
            self.tick += 1;
            for &e in ids {
                self.counts[0][e] += 1;
            }
            (&self.counts, self.tick)
        }
    }

    #[test]
    fn a_shadow_reads_what_an_lfu_cache_of_its_size_would() {
        let mut r = Replay::new(16);
        let mut s = Shadow::new(4, 1, 16);
        s.lfu = true;
        // A working set that fits is read once.
        let mut reads = 0;
        for i in 0..30 {
            let (c, t) = r.ask(&[i % 3]);
            reads += s.request(0, &[i % 3], c, t);
        }
        assert_eq!(reads, 3);
        // A popular expert survives a scan of cold ones: counts outlive recency.
        let mut reads = 0;
        for e in 4..12 {
            let (c, t) = r.ask(&[e]);
            reads += s.request(0, &[e], c, t);
        }
        assert_eq!(reads, 8);
        let (c, t) = r.ask(&[0, 1, 2]);
        assert_eq!(s.request(0, &[0, 1, 2], c, t), 0, "the hot three stayed");
        // A request never evicts its own experts, even one larger than the shadow.
        let ids = [12, 13, 14, 15, 3];
        let (c, t) = r.ask(&ids);
        assert_eq!(s.request(0, &ids, c, t), 5);
        assert_eq!(s.held.len(), 4);
    }

    #[test]
    fn growth_is_decided_by_what_the_larger_cache_would_save() {
        // A token asks for 2 experts; the cache uses 4 slots of 8.
        let run = |stream: &dyn Fn(u64) -> [usize; 2]| {
            let mut r = Replay::new(64);
            let mut g = Growth::new(4, 8, 1, 64, 2);
            (0..200u64).position(|i| {
                let ids = stream(i);
                let (c, t) = r.ask(&ids);
                g.request(0, &ids, c, t)
            })
        };
        // Cycling over 6 experts: 4 slots read every one, 8 read none once warm.
        let at = run(&|i| [(2 * i % 6) as usize, (2 * i % 6 + 1) as usize]);
        assert!(
            at.is_some_and(|i| i < 3 * GROW_WINDOW_TOKENS as usize),
            "{at:?}"
        );
        // Cycling over 4: the slots in use hold it; nothing to gain.
        assert_eq!(
            run(&|i| [(2 * i % 4) as usize, (2 * i % 4 + 1) as usize]),
            None
        );
        // Never the same expert twice: both caches read everything.
        assert_eq!(
            run(&|i| [(2 * i % 64) as usize, (2 * i % 64 + 1) as usize]),
            None
        );
    }
}
