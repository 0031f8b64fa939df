//! The CPU engine's blocks: a decoder layer's parts on the kernels. `exec` runs a layer's
//! projections as one pool job; `mixer` the DeltaNet and gated attention mixers; `moe` the
//! router, the shared expert and the routed experts (one token, or a chunk in `moe/chunk`).
//!
//! Blocks orchestrate and never index packed bytes (the kernels do); they mirror
//! `crate::model`'s f32 maths and are tested against it.

pub mod exec;
pub mod mixer;
pub mod moe;
