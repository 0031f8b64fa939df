//! What the expert cache counts ([`CacheStats`]) and how it evicts ([`Eviction`]).

use crate::error::{Error, Result};

/// hits / (hits + misses), 0 when nothing was asked for: the rate of any tier of experts.
pub fn hit_rate(hits: u64, misses: u64) -> f64 {
    let n = hits + misses;
    if n == 0 { 0.0 } else { hits as f64 / n as f64 }
}

/// Counters of the cache, cumulative since open. Take two snapshots to get a token's share.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct CacheStats {
    /// Experts a request found in memory (see [`CacheStats::hit_rate`]).
    pub hits: u64,
    /// Experts a request had to read.
    pub misses: u64,
    /// Experts read from disk (misses plus prefetches).
    pub reads: u64,
    pub bytes_read: u64,
    /// Wall time with at least one read in flight.
    pub read_busy_ns: u64,
    pub evictions: u64,
    pub prefetches: u64,
    /// Prefetched experts that a later request used.
    pub prefetch_hits: u64,
    /// Slots in use now (a cache growing on demand may not have taken them all yet).
    pub slots: u64,
    /// Slots the cache may grow to.
    pub slots_max: u64,
}

impl CacheStats {
    /// Counters accumulated between `earlier` and `self`.
    pub fn since(&self, earlier: &CacheStats) -> CacheStats {
        CacheStats {
            hits: self.hits - earlier.hits,
            misses: self.misses - earlier.misses,
            reads: self.reads - earlier.reads,
            bytes_read: self.bytes_read - earlier.bytes_read,
            read_busy_ns: self.read_busy_ns - earlier.read_busy_ns,
            evictions: self.evictions - earlier.evictions,
            prefetches: self.prefetches - earlier.prefetches,
            prefetch_hits: self.prefetch_hits - earlier.prefetch_hits,
            slots: self.slots,
            slots_max: self.slots_max,
        }
    }

    /// The demand hit rate: experts found in memory when a request asked for them (brought by
    /// a prefetch or an earlier request; one still being read counts, as it needs no new
    /// read) / experts asked for. Prefetches are neither hits nor misses.
    pub fn hit_rate(&self) -> f64 {
        hit_rate(self.hits, self.misses)
    }

    /// Achieved read bandwidth while reads were in flight, GB/s.
    pub fn read_gb_s(&self) -> f64 {
        if self.read_busy_ns == 0 {
            0.0
        } else {
            self.bytes_read as f64 / self.read_busy_ns as f64
        }
    }
}

/// Which unpinned expert a full cache gives up for a new one.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Eviction {
    /// The least recently used.
    #[default]
    Lru,
    /// The least often used since open (counts survive eviction), then the least recent.
    Lfu,
    /// The least likely to be asked for at its layer's next turn, learned while running from
    /// how each class of expert (turns since its last use, uses in the last 8 turns) came
    /// back; ties go to the one whose layer's turn is furthest, then the least recent.
    Reuse,
}

impl std::str::FromStr for Eviction {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "lru" => Ok(Eviction::Lru),
            "lfu" => Ok(Eviction::Lfu),
            "reuse" => Ok(Eviction::Reuse),
            _ => Err(Error::Invalid(format!(
                "unknown cache eviction {s:?}: use lru, lfu or reuse"
            ))),
        }
    }
}
