//! Per-sequence state: what a conversation carries from one call to the next.
//!
//! A DeltaNet layer keeps its last K−1 pre-activation conv inputs and its recurrent state; an
//! attention layer keeps its keys and values. With this a prompt is prefilled in one call and
//! then decoded token by token, and the next turn of a conversation pays only for new tokens.

use crate::config::{LayerKind, ModelConfig};

/// One layer's carried state.
#[derive(Debug, Clone, PartialEq)]
pub enum LayerState {
    Linear {
        conv: Vec<f32>, // [K-1, conv_dim], oldest first
        ssm: Vec<f32>,  // [nv, dk, dv]
    },
    Full {
        keys: Vec<f32>,   // [pos, nkv, hd], after k_norm and RoPE
        values: Vec<f32>, // [pos, nkv, hd]
    },
}

/// The state of one sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct SeqState {
    /// Tokens consumed so far (the next token's position).
    pub pos: usize,
    pub layers: Vec<LayerState>,
}

impl SeqState {
    /// A fresh sequence.
    pub fn new(cfg: &ModelConfig) -> Self {
        let layers = cfg
            .layer_types
            .iter()
            .map(|k| match k {
                LayerKind::Linear => LayerState::Linear {
                    conv: vec![0.0; (cfg.linear_conv_kernel_dim - 1) * cfg.conv_dim()],
                    ssm: vec![
                        0.0;
                        cfg.linear_num_value_heads
                            * cfg.linear_key_head_dim
                            * cfg.linear_value_head_dim
                    ],
                },
                LayerKind::Full => LayerState::Full {
                    keys: Vec::new(),
                    values: Vec::new(),
                },
            })
            .collect();
        SeqState { pos: 0, layers }
    }
}
