//! Per-sequence state: what a conversation carries from one call to the next.
//!
//! A DeltaNet layer keeps its last K−1 pre-activation conv inputs and its recurrent state; an
//! attention layer keeps its keys and values. With this a prompt is prefilled in one call and
//! then decoded token by token, and the next turn of a conversation pays only for new tokens.

use crate::config::{LayerKind, ModelConfig};
use crate::error::{Error, Result};

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

/// A sequence state held in an accelerator's memory (the CUDA backend's KV cache and
/// recurrent state). While a [`SeqState`] carries one, its host `layers` are stale; see
/// [`SeqState::sync_host`].
pub trait DeviceState: Send + Sync + std::fmt::Debug {
    /// A copy in device memory (conversation snapshots clone states).
    fn duplicate(&self) -> Result<Box<dyn DeviceState>>;
    /// Writes the state into host `layers` (the reference layout) for `pos` tokens.
    fn download(&self, layers: &mut [LayerState], pos: usize) -> Result<()>;
    /// For the backend that made it, to find its own type again.
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any;
}

/// A device state that could not be copied: using it reports why.
#[derive(Debug)]
struct LostState(String);

impl DeviceState for LostState {
    fn duplicate(&self) -> Result<Box<dyn DeviceState>> {
        Err(Error::Device(self.0.clone()))
    }
    fn download(&self, _: &mut [LayerState], _: usize) -> Result<()> {
        Err(Error::Device(self.0.clone()))
    }
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}

/// The state of one sequence.
#[derive(Debug)]
pub struct SeqState {
    /// Tokens consumed so far (the next token's position).
    pub pos: usize,
    /// The state in the reference layout; stale while `device` holds it.
    pub layers: Vec<LayerState>,
    /// The state in an accelerator's memory, when a GPU backend holds it.
    pub device: Option<Box<dyn DeviceState>>,
}

impl Clone for SeqState {
    /// Copies device-held state on the device; if that fails the copy carries the error,
    /// which the next use of it reports.
    fn clone(&self) -> Self {
        let device = self.device.as_ref().map(|d| {
            d.duplicate().unwrap_or_else(|e| {
                Box::new(LostState(format!("copying a sequence state failed: {e}")))
                    as Box<dyn DeviceState>
            })
        });
        SeqState {
            pos: self.pos,
            layers: self.layers.clone(),
            device,
        }
    }
}

impl PartialEq for SeqState {
    /// Compares the host layout (sync device-held states first).
    fn eq(&self, other: &Self) -> bool {
        self.pos == other.pos && self.layers == other.layers
    }
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
        SeqState {
            pos: 0,
            layers,
            device: None,
        }
    }

    /// Brings a device-held state back into `layers` and lets go of the device copy, so the
    /// CPU paths can continue the sequence.
    pub fn sync_host(&mut self) -> Result<()> {
        if let Some(d) = self.device.take()
            && let Err(e) = d.download(&mut self.layers, self.pos)
        {
            self.device = Some(d);
            return Err(e);
        }
        Ok(())
    }

    /// A copy with the state in `layers` (for saving), leaving `self` as it is.
    pub fn host_copy(&self) -> Result<SeqState> {
        let mut layers = self.layers.clone();
        if let Some(d) = &self.device {
            d.download(&mut layers, self.pos)?;
        }
        Ok(SeqState {
            pos: self.pos,
            layers,
            device: None,
        })
    }
}
