//! Per-sequence state: what a conversation carries from one call to the next.
//!
//! A DeltaNet layer keeps its last K−1 pre-activation conv inputs and its recurrent state; an
//! attention layer keeps its keys and values. With this a prompt is prefilled in one call and
//! then decoded token by token, and the next turn of a conversation pays only for new tokens.

use crate::config::{LayerKind, ModelConfig};
use crate::error::{Error, Result};

/// One layer's carried state.
#[derive(Debug, PartialEq)]
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

impl Clone for LayerState {
    fn clone(&self) -> Self {
        match self {
            LayerState::Linear { conv, ssm } => LayerState::Linear {
                conv: conv.clone(),
                ssm: ssm.clone(),
            },
            LayerState::Full { keys, values } => LayerState::Full {
                keys: keys.clone(),
                values: values.clone(),
            },
        }
    }

    /// Copies into this layer's vectors where it is the same kind of layer (no new memory
    /// to fault in when they are large enough).
    fn clone_from(&mut self, src: &Self) {
        match (self, src) {
            (LayerState::Linear { conv, ssm }, LayerState::Linear { conv: c, ssm: s }) => {
                conv.clone_from(c);
                ssm.clone_from(s);
            }
            (LayerState::Full { keys, values }, LayerState::Full { keys: k, values: v }) => {
                keys.clone_from(k);
                values.clone_from(v);
            }
            (me, _) => *me = src.clone(),
        }
    }
}

impl LayerState {
    /// The same kind of layer holding nothing.
    fn empty_like(&self) -> LayerState {
        match self {
            LayerState::Linear { .. } => LayerState::Linear {
                conv: Vec::new(),
                ssm: Vec::new(),
            },
            LayerState::Full { .. } => LayerState::Full {
                keys: Vec::new(),
                values: Vec::new(),
            },
        }
    }
}

/// A sequence state held elsewhere than the host layout: in an accelerator's memory (the CUDA
/// backend's KV cache and recurrent states), or in another form (the CPU fast path's bf16
/// recurrent states, `crate::cpu::state`). While a [`SeqState`] carries one, the parts of its
/// host `layers` that the holder writes back in [`DeviceState::download`] are stale; see
/// [`SeqState::sync_host`].
pub trait DeviceState: Send + Sync + std::fmt::Debug {
    /// A copy in device memory of the state after `pos` tokens (conversation snapshots clone
    /// states; the positions past `pos` need not be copied).
    fn duplicate(&self, pos: usize) -> Result<Box<dyn DeviceState>>;
    /// Whether it holds every layer, so that all of the host `layers` are stale (a copy of
    /// the state then skips them, and `download` must write each layer whole).
    fn holds_every_layer(&self) -> bool {
        false
    }
    /// Writes the state it holds into host `layers` (the reference layout) for `pos` tokens.
    fn download(&self, layers: &mut [LayerState], pos: usize) -> Result<()>;
    /// [`DeviceState::download`] for a holder dropped right after ([`SeqState::sync_host`]):
    /// it may give its own memory back as it writes, so that the two copies are never whole
    /// at once. Afterwards the holder is only dropped; on an error it is kept, so a holder
    /// that frees as it writes must not fail after freeing.
    fn download_and_release(&mut self, layers: &mut [LayerState], pos: usize) -> Result<()> {
        self.download(layers, pos)
    }
    /// For the backend that made it, to find its own type again.
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any;
}

/// A device state that could not be copied: using it reports why.
#[derive(Debug)]
struct LostState(String);

impl DeviceState for LostState {
    fn duplicate(&self, _: usize) -> Result<Box<dyn DeviceState>> {
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
    /// The state in the reference layout; what `device` holds is stale here.
    pub layers: Vec<LayerState>,
    /// The state, or part of it, held elsewhere: a GPU backend's memory, or the CPU fast
    /// path's bf16 recurrent states.
    pub device: Option<Box<dyn DeviceState>>,
}

impl Clone for SeqState {
    /// Copies device-held state on the device; where that fails (device memory full) the copy
    /// is brought to the host instead, and if even that fails the copy carries the error,
    /// which its next use reports.
    fn clone(&self) -> Self {
        let mut layers = match &self.device {
            // Stale everywhere: only the layout is copied (the download below fills it).
            Some(d) if d.holds_every_layer() => {
                self.layers.iter().map(LayerState::empty_like).collect()
            }
            _ => self.layers.clone(),
        };
        let device = match &self.device {
            None => None,
            Some(d) => match d.duplicate(self.pos) {
                Ok(copy) => Some(copy),
                Err(e) => match d.download(&mut layers, self.pos) {
                    Ok(()) => None,
                    Err(e2) => Some(Box::new(LostState(format!(
                        "copying a sequence state failed: {e}; reading it back failed: {e2}"
                    ))) as Box<dyn DeviceState>),
                },
            },
        };
        SeqState {
            pos: self.pos,
            layers,
            device,
        }
    }

    /// Copies `src` into this state's memory where both are held on the host: a restored or
    /// retaken conversation snapshot then costs a copy, not fresh pages (183 ms for the 35B's
    /// 60 MB of recurrent state on the 2-core development VM, 6 ms into pages in use).
    fn clone_from(&mut self, src: &Self) {
        if self.device.is_some() || src.device.is_some() {
            *self = src.clone();
            return;
        }
        self.pos = src.pos;
        self.layers.clone_from(&src.layers);
    }
}

impl PartialEq for SeqState {
    /// Compares the host layout (sync device-held states first).
    fn eq(&self, other: &Self) -> bool {
        self.pos == other.pos && self.layers == other.layers
    }
}

/// `cfg`'s layers with each DeltaNet layer's conv and recurrent states from `recurrent(len)`
/// and each attention layer's caches empty.
fn layers_of(cfg: &ModelConfig, recurrent: impl Fn(usize) -> Vec<f32>) -> Vec<LayerState> {
    (cfg.layer_types.iter())
        .map(|k| match k {
            LayerKind::Linear => LayerState::Linear {
                conv: recurrent(cfg.conv_state_len()),
                ssm: recurrent(cfg.ssm_state_len()),
            },
            LayerKind::Full => LayerState::Full {
                keys: Vec::new(),
                values: Vec::new(),
            },
        })
        .collect()
}

/// `n` zeros with every page already written. A large zeroed vector is a mapping of the
/// shared zero page; the recurrent states are read before they are written, so each of their
/// pages would otherwise fault twice during the first token (a read maps the zero page, the
/// write copies it and must flush the TLB of every other thread: with the 35B's 60 MB of
/// state, the first decoded token spent tens of ms in those faults).
fn written_zeros(n: usize) -> Vec<f32> {
    let mut v = vec![0.0f32; n];
    let per_page = crate::aligned::ALIGN / std::mem::size_of::<f32>();
    for x in v.iter_mut().step_by(per_page) {
        // SAFETY: `x` is a valid, aligned element of `v`; a volatile write is not elided.
        unsafe { std::ptr::write_volatile(x, 0.0) };
    }
    v
}

impl SeqState {
    /// A state of no layers, holding nothing: a placeholder while a state is lent out (it
    /// fits no model, so an engine refuses it).
    pub fn empty() -> Self {
        SeqState {
            pos: 0,
            layers: Vec::new(),
            device: None,
        }
    }

    /// A fresh sequence.
    pub fn new(cfg: &ModelConfig) -> Self {
        SeqState {
            pos: 0,
            layers: layers_of(cfg, written_zeros),
            device: None,
        }
    }

    /// A fresh sequence whose (cleared) state `device` holds: the host layers are only the
    /// layout, as in any device-held state, so nothing is written on the host.
    pub fn held(cfg: &ModelConfig, device: Box<dyn DeviceState>) -> Self {
        SeqState {
            pos: 0,
            layers: layers_of(cfg, |_| Vec::new()),
            device: Some(device),
        }
    }

    /// Makes this a fresh sequence again in place where the host holds the state: the
    /// recurrent states zeroed in the pages they already have and the caches emptied with
    /// their room kept, instead of a new state's fresh pages. Says whether it could; a
    /// device-held state is left as it is.
    pub fn clear_host(&mut self) -> bool {
        let sized = self.layers.iter().all(|l| match l {
            LayerState::Linear { conv, ssm } => !conv.is_empty() && !ssm.is_empty(),
            LayerState::Full { .. } => true,
        });
        if self.device.is_some() || !sized {
            return false;
        }
        for l in &mut self.layers {
            match l {
                LayerState::Linear { conv, ssm } => {
                    conv.fill(0.0);
                    ssm.fill(0.0);
                }
                LayerState::Full { keys, values } => {
                    keys.clear();
                    values.clear();
                }
            }
        }
        self.pos = 0;
        true
    }

    /// Brings a device-held state back into `layers` and lets go of the device copy, so the
    /// CPU paths can continue the sequence.
    pub fn sync_host(&mut self) -> Result<()> {
        if let Some(mut d) = self.device.take()
            && let Err(e) = d.download_and_release(&mut self.layers, self.pos)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A device state whose copy fails (device memory full) and whose download writes `fill`.
    #[derive(Debug)]
    struct Full(Option<f32>);

    impl DeviceState for Full {
        fn duplicate(&self, _: usize) -> Result<Box<dyn DeviceState>> {
            Err(Error::Device("out of memory".into()))
        }
        fn download(&self, layers: &mut [LayerState], _pos: usize) -> Result<()> {
            let fill = self.0.ok_or_else(|| Error::Device("device lost".into()))?;
            for l in layers {
                if let LayerState::Linear { ssm, .. } = l {
                    ssm.iter_mut().for_each(|v| *v = fill);
                }
            }
            Ok(())
        }
        fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
            self
        }
    }

    fn state(dev: Full) -> SeqState {
        SeqState {
            pos: 3,
            layers: vec![LayerState::Linear {
                conv: vec![0.0; 2],
                ssm: vec![0.0; 4],
            }],
            device: Some(Box::new(dev)),
        }
    }

    #[test]
    fn a_clone_that_cannot_stay_on_the_device_comes_to_the_host() {
        let c = state(Full(Some(7.0))).clone();
        assert!(c.device.is_none());
        assert_eq!(c.pos, 3);
        match &c.layers[0] {
            LayerState::Linear { ssm, .. } => assert_eq!(ssm, &vec![7.0; 4]),
            _ => unreachable!(),
        }
    }

    #[test]
    fn a_clone_that_cannot_be_copied_at_all_reports_why_when_used() {
        let mut c = state(Full(None)).clone();
        let e = c.sync_host().expect_err("lost");
        let msg = e.to_string();
        assert!(
            msg.contains("out of memory") && msg.contains("device lost"),
            "{msg}"
        );
    }

    /// A device state holding every layer: copies on the device, downloads whole layers.
    #[derive(Debug)]
    struct Whole(f32);

    impl DeviceState for Whole {
        fn duplicate(&self, _: usize) -> Result<Box<dyn DeviceState>> {
            Ok(Box::new(Whole(self.0)))
        }
        fn holds_every_layer(&self) -> bool {
            true
        }
        fn download(&self, layers: &mut [LayerState], _pos: usize) -> Result<()> {
            for l in layers {
                if let LayerState::Linear { conv, ssm } = l {
                    *conv = vec![self.0; 2];
                    *ssm = vec![self.0; 4];
                }
            }
            Ok(())
        }
        fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
            self
        }
    }

    #[test]
    fn a_clone_of_a_state_held_whole_elsewhere_skips_the_stale_host_copy() {
        let mut s = SeqState {
            pos: 3,
            layers: vec![LayerState::Linear {
                conv: vec![0.0; 2],
                ssm: vec![0.0; 4],
            }],
            device: Some(Box::new(Whole(5.0))),
        };
        let mut c = s.clone();
        assert!(c.device.is_some());
        assert_eq!(
            c.layers[0],
            LayerState::Linear {
                conv: vec![],
                ssm: vec![]
            }
        );
        c.sync_host().expect("downloads");
        s.sync_host().expect("downloads");
        assert_eq!(c, s);
        assert_eq!(
            c.layers[0],
            LayerState::Linear {
                conv: vec![5.0; 2],
                ssm: vec![5.0; 4]
            }
        );
    }

    #[test]
    fn a_host_state_clears_in_place_and_a_device_held_one_does_not() {
        let mut s = SeqState {
            pos: 2,
            layers: vec![
                LayerState::Linear {
                    conv: vec![1.0; 2],
                    ssm: vec![2.0; 4],
                },
                LayerState::Full {
                    keys: vec![3.0; 8],
                    values: vec![4.0; 8],
                },
            ],
            device: None,
        };
        assert!(s.clear_host());
        assert_eq!(s.pos, 0);
        assert_eq!(
            s.layers,
            vec![
                LayerState::Linear {
                    conv: vec![0.0; 2],
                    ssm: vec![0.0; 4],
                },
                LayerState::Full {
                    keys: vec![],
                    values: vec![],
                },
            ]
        );
        let mut held = state(Full(Some(1.0)));
        assert!(!held.clear_host());
        assert_eq!(held.pos, 3, "left as it is");
        // Only the layout on the host (a device-held state's copy): nothing to clear into.
        held.device = None;
        held.layers = vec![LayerState::Linear {
            conv: vec![],
            ssm: vec![],
        }];
        assert!(!held.clear_host());
    }
}
