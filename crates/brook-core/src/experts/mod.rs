//! Streaming routed experts from the SSD: the store (direct reads), the cache (slots, LFU,
//! I/O threads), when the cache grows, and the memory budget that sizes it.

pub mod budget;
pub mod cache;
pub mod grow;
mod slots;
pub mod store;

pub use cache::{CacheStats, ExpertCache};
