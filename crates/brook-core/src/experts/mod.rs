//! Streaming routed experts from the SSD: the expert files (direct reads), the contracts the model and the engines consume (`source`), the cache (slots, eviction,
//! I/O threads), when the cache grows, and the memory budget that sizes it.

pub mod budget;
pub mod cache;
pub mod files;
pub mod grow;
mod reuse;
mod slots;
pub mod source;
mod stats;

pub use cache::{CacheStats, Eviction, ExpertCache};
