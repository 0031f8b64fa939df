//! Saving a session (messages, fed tokens, model state and its snapshot) to a safetensors file
//! and restoring it for the same model.

use std::path::Path;
use std::sync::Arc;

use super::{Llm, Session, Snapshot};
use crate::error::{Error, Result};
use crate::model::Model;
use crate::model::state::SeqState;

/// Fingerprint of a model's config, stored with saved sessions.
fn model_fingerprint(m: &Model) -> String {
    crate::container::hash_hex(format!("{:?}", m.cfg).as_bytes())
}

impl Session {
    /// Saves the conversation and its model state to `path` (a safetensors file).
    pub fn save(&self, path: &Path) -> Result<()> {
        use crate::dtype::DType;
        use crate::model::state::LayerState;
        use crate::safetensors::{TensorOut, f32_bytes, write};
        let mut owned: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
        let mut push_state = |prefix: &str, state: &SeqState| {
            for (i, l) in state.layers.iter().enumerate() {
                let parts: [(&str, &Vec<f32>); 2] = match l {
                    LayerState::Linear { conv, ssm } => [("conv", conv), ("ssm", ssm)],
                    LayerState::Full { keys, values } => [("keys", keys), ("values", values)],
                };
                for (name, v) in parts {
                    owned.push((
                        format!("{prefix}layer.{i}.{name}"),
                        vec![v.len()],
                        f32_bytes(v),
                    ));
                }
            }
        };
        push_state("", &self.state.host_copy()?);
        if let Some(snap) = &self.snapshot {
            push_state("snapshot.", &snap.state.host_copy()?);
        }
        let tokens: Vec<u8> = self.fed.iter().flat_map(|t| t.to_le_bytes()).collect();
        let mut outs: Vec<TensorOut<'_>> = owned
            .iter()
            .map(|(n, s, d)| TensorOut {
                name: n.clone(),
                dtype: DType::F32,
                shape: s.clone(),
                data: d,
            })
            .collect();
        outs.push(TensorOut {
            name: "tokens".into(),
            dtype: DType::U32,
            shape: vec![self.fed.len()],
            data: &tokens,
        });
        let messages = serde_json::to_string(&self.messages)
            .map_err(|e| Error::Invalid(format!("cannot encode messages: {e}")))?;
        let meta = std::collections::BTreeMap::from([
            ("format".to_string(), "brook-session".to_string()),
            ("version".to_string(), "1".to_string()),
            ("model".to_string(), model_fingerprint(&self.llm.model)),
            ("pos".to_string(), self.state.pos.to_string()),
            ("messages".to_string(), messages),
            ("text".to_string(), self.text.clone()),
        ]);
        let mut meta = meta;
        if let Some(snap) = &self.snapshot {
            meta.insert("snapshot_fed".into(), snap.fed.to_string());
            meta.insert("snapshot_pos".into(), snap.state.pos.to_string());
            meta.insert("snapshot_text".into(), snap.text.clone());
        }
        write(path, &outs, &meta)
    }
}

impl Llm {
    /// Restores a session saved by [`Session::save`] for this same model.
    pub fn restore(self: &Arc<Self>, path: &Path) -> Result<Session> {
        use crate::model::state::LayerState;
        let f = crate::safetensors::SafeFile::open(path)?;
        let bad = |reason: String| Error::Json {
            path: path.to_path_buf(),
            reason,
        };
        let meta = |k: &str| {
            f.metadata
                .get(k)
                .cloned()
                .ok_or_else(|| bad(format!("not a brook session file (no `{k}`)")))
        };
        if meta("format")? != "brook-session" || meta("version")? != "1" {
            return Err(bad("not a brook session file of version 1".into()));
        }
        if meta("model")? != model_fingerprint(&self.model) {
            return Err(bad("this session was saved with a different model".into()));
        }
        let floats = |name: &str| -> Result<Vec<f32>> {
            let info = f
                .tensors
                .get(name)
                .ok_or_else(|| bad(format!("missing `{name}`")))?;
            let mut v = Vec::with_capacity(info.numel());
            crate::dtype::floats_to_f32(info.dtype, &f.read(info)?, &mut v);
            Ok(v)
        };
        let load_state = |prefix: &str| -> Result<SeqState> {
            // The host layout, which the engine uploads when it takes the state.
            let mut state = self.model.new_state();
            for (i, l) in state.layers.iter_mut().enumerate() {
                match l {
                    LayerState::Linear { conv, ssm } => {
                        let c = floats(&format!("{prefix}layer.{i}.conv"))?;
                        let s = floats(&format!("{prefix}layer.{i}.ssm"))?;
                        if c.len() != conv.len() || s.len() != ssm.len() {
                            return Err(bad(format!("layer {i} state has the wrong size")));
                        }
                        *conv = c;
                        *ssm = s;
                    }
                    LayerState::Full { keys, values } => {
                        *keys = floats(&format!("{prefix}layer.{i}.keys"))?;
                        *values = floats(&format!("{prefix}layer.{i}.values"))?;
                    }
                }
            }
            Ok(state)
        };
        let mut state = load_state("")?;
        let snapshot = match f.metadata.get("snapshot_fed") {
            None => None,
            Some(fed) => {
                let mut st = load_state("snapshot.")?;
                st.pos = meta("snapshot_pos")?
                    .parse()
                    .map_err(|_| bad("bad `snapshot_pos`".into()))?;
                Some(Snapshot {
                    state: st,
                    fed: fed.parse().map_err(|_| bad("bad `snapshot_fed`".into()))?,
                    text: meta("snapshot_text")?,
                })
            }
        };
        let tinfo = f
            .tensors
            .get("tokens")
            .ok_or_else(|| bad("missing `tokens`".into()))?;
        let fed: Vec<u32> = crate::dtype::bytes_to_u32(&f.read(tinfo)?);
        state.pos = meta("pos")?.parse().map_err(|_| bad("bad `pos`".into()))?;
        let kv_rows = self.model.cfg.num_key_value_heads * self.model.cfg.head_dim;
        let consistent = state.pos == fed.len()
            && state.layers.iter().all(|l| match l {
                LayerState::Full { keys, values } => {
                    keys.len() == fed.len() * kv_rows && values.len() == keys.len()
                }
                LayerState::Linear { .. } => true,
            });
        if !consistent {
            return Err(bad(
                "token count and state disagree (corrupt session file)".into()
            ));
        }
        let messages = serde_json::from_str(&meta("messages")?)
            .map_err(|e| bad(format!("bad messages: {e}")))?;
        Ok(Session {
            llm: self.clone(),
            state,
            fed,
            messages,
            text: meta("text")?,
            prefilled: 0,
            snapshot,
            snapshot_at: None,
            logits: Vec::new(),
        })
    }
}
