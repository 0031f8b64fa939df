//! The fast path's recurrent states in bf16: half the bytes a decoded token reads and writes.
//!
//! Owns [`Bf16Ssm`], the DeltaNet layers' states [nv, dk, dv] as bf16 bits, carried in a
//! [`SeqState`]'s `device` slot while [`crate::cpu::CpuModel`] decodes at
//! [`crate::cpu::Precision::Fast`]. Every other reader of a state (a prefill, the exact path,
//! the reference, a save, another backend) gets f32 back through [`DeviceState::download`]
//! (`SeqState::sync_host`, `host_copy`), as it would from a GPU; `sync_host` frees the bf16
//! layers as it goes. While a holder is in place the
//! host `ssm` vectors are empty (their memory is given back) and everything else in the host
//! layers (conv windows, keys and values) stays live. It must not change any state's f32
//! layout or what the exact path computes.

use crate::cpu::kernels::delta::{bf16_bits, bf16_to_f32};
use crate::error::Result;
use crate::model::state::{DeviceState, LayerState, SeqState};

/// Each DeltaNet layer's state as bf16 bits (empty for attention layers).
#[derive(Debug, Clone)]
pub struct Bf16Ssm {
    pub layers: Vec<Vec<u16>>,
}

impl Bf16Ssm {
    /// The holder in a state's `device` slot, if it holds one.
    pub fn in_slot(device: &mut Option<Box<dyn DeviceState>>) -> Option<&mut Bf16Ssm> {
        device
            .as_mut()
            .and_then(|d| d.as_any_mut().downcast_mut::<Bf16Ssm>())
    }

    /// Makes sure `state`'s recurrent states are held in bf16: brings any other device's copy
    /// back first, then rounds the host f32 states (to nearest even) into a new holder and
    /// frees them. Does nothing when the holder is already there.
    pub fn hold(state: &mut SeqState) -> Result<()> {
        if Self::in_slot(&mut state.device).is_some() {
            return Ok(());
        }
        state.sync_host()?;
        let layers = state
            .layers
            .iter_mut()
            .map(|l| match l {
                LayerState::Linear { ssm, .. } => {
                    let bits = ssm.iter().map(|&v| bf16_bits(v)).collect();
                    *ssm = Vec::new();
                    bits
                }
                LayerState::Full { .. } => Vec::new(),
            })
            .collect();
        state.device = Some(Box::new(Bf16Ssm { layers }));
        Ok(())
    }
}

impl DeviceState for Bf16Ssm {
    fn duplicate(&self, _pos: usize) -> Result<Box<dyn DeviceState>> {
        Ok(Box::new(self.clone()))
    }

    /// Writes each DeltaNet layer's state back as f32 (exactly the held bf16 values); the
    /// other layers' host state is live and left alone.
    fn download(&self, layers: &mut [LayerState], _pos: usize) -> Result<()> {
        for (l, bits) in layers.iter_mut().zip(&self.layers) {
            write_f32(l, bits);
        }
        Ok(())
    }

    /// As `download`, giving each layer's bf16 memory back once its f32 state is written, so
    /// the state never holds much more than its f32 size (a budget counts that).
    fn download_and_release(&mut self, layers: &mut [LayerState], _pos: usize) -> Result<()> {
        for (l, bits) in layers.iter_mut().zip(&mut self.layers) {
            write_f32(l, &std::mem::take(bits));
        }
        Ok(())
    }

    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}

/// A DeltaNet layer's host state set to the f32 values of `bits` (other layers untouched).
fn write_f32(l: &mut LayerState, bits: &[u16]) {
    if let LayerState::Linear { ssm, .. } = l {
        ssm.clear();
        ssm.extend(bits.iter().map(|&b| bf16_to_f32(b)));
    }
}
