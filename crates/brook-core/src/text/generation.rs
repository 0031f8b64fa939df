//! `generation_config.json`: the checkpoint's stop ids and default sampling settings.
//!
//! Owns parsing (every field optional; `eos_token_id` an int or a list) and the stop-set rule.
//! mlx-lm's `load_config` copies generation_config's `eos_token_id` over config.json's and falls
//! back to the tokenizer's `eos_token`; brook keeps generation_config's ids first and adds
//! config.json's after them, so a checkpoint whose two files disagree still stops on both. It
//! must not read config.json itself: the model loader passes its eos ids in.

use std::path::Path;

use serde::Deserialize;

use super::Result;
use super::sampler::SamplingParams;

/// The fields of `generation_config.json` brook uses; all optional.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct GenerationConfig {
    #[serde(default)]
    pub bos_token_id: Option<u32>,
    /// Stop ids, in file order (an int in the file becomes a one-element list).
    #[serde(default, deserialize_with = "de_ids")]
    pub eos_token_id: Vec<u32>,
    #[serde(default)]
    pub pad_token_id: Option<u32>,
    /// `false` means greedy decoding in transformers, whatever `temperature` says.
    #[serde(default)]
    pub do_sample: Option<bool>,
    #[serde(default)]
    pub temperature: Option<f32>,
    #[serde(default)]
    pub top_k: Option<usize>,
    #[serde(default)]
    pub top_p: Option<f32>,
    #[serde(default)]
    pub min_p: Option<f32>,
    #[serde(default)]
    pub repetition_penalty: Option<f32>,
    #[serde(default)]
    pub presence_penalty: Option<f32>,
    #[serde(default)]
    pub frequency_penalty: Option<f32>,
    #[serde(default)]
    pub max_new_tokens: Option<usize>,
}

fn de_ids<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Vec<u32>, D::Error> {
    let v = serde_json::Value::deserialize(d)?;
    eos_ids_from_value(&v).map_err(serde::de::Error::custom)
}

/// Reads an `eos_token_id`-style field: null, an int, or a list of ints.
pub fn eos_ids_from_value(v: &serde_json::Value) -> std::result::Result<Vec<u32>, String> {
    let one = |x: &serde_json::Value| {
        x.as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| format!("expected a token id, got {x}"))
    };
    match v {
        serde_json::Value::Null => Ok(Vec::new()),
        serde_json::Value::Array(items) => items.iter().map(one).collect(),
        x => one(x).map(|id| vec![id]),
    }
}

impl GenerationConfig {
    /// Parses `generation_config.json`.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        super::read_json(path.as_ref(), crate::util::MAX_CONFIG)
    }

    /// `model_dir/generation_config.json`, or `Ok(None)` when the checkpoint has none.
    pub fn from_dir(model_dir: impl AsRef<Path>) -> Result<Option<Self>> {
        let path = model_dir.as_ref().join("generation_config.json");
        if !path.is_file() {
            return Ok(None);
        }
        Self::from_file(&path).map(Some)
    }

    /// The ids generation stops on: this file's `eos_token_id` list, then `config_eos`
    /// (config.json's, or `text_config`'s for Qwen3.5) not already listed; when both are empty,
    /// the tokenizer's eos id. Qwen3-Next gives [151645, 151643], Qwen3.5/3.6 [248046, 248044].
    pub fn stop_ids(&self, config_eos: &[u32], tokenizer_eos: Option<u32>) -> Vec<u32> {
        let mut ids: Vec<u32> = Vec::with_capacity(self.eos_token_id.len() + config_eos.len());
        for &id in self.eos_token_id.iter().chain(config_eos) {
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
        if ids.is_empty() {
            ids.extend(tokenizer_eos);
        }
        ids
    }

    /// The checkpoint's recommended sampling settings over brook's defaults; `do_sample: false`
    /// forces greedy decoding as transformers does.
    pub fn sampling_params(&self) -> SamplingParams {
        let mut p = SamplingParams::default();
        if self.do_sample == Some(false) {
            return p;
        }
        if let Some(t) = self.temperature {
            p.temperature = t;
        }
        if let Some(k) = self.top_k {
            p.top_k = k;
        }
        if let Some(v) = self.top_p {
            p.top_p = v;
        }
        if let Some(v) = self.min_p {
            p.min_p = v;
        }
        if let Some(v) = self.repetition_penalty {
            p.repetition_penalty = v;
        }
        if let Some(v) = self.presence_penalty {
            p.presence_penalty = v;
        }
        if let Some(v) = self.frequency_penalty {
            p.frequency_penalty = v;
        }
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> GenerationConfig {
        serde_json::from_str(s).unwrap_or_default()
    }

    #[test]
    fn eos_list_comes_first_then_config_ids() {
        let g = parse(
            r#"{"bos_token_id": 151643, "eos_token_id": [151645, 151643], "do_sample": true,
                         "temperature": 0.7, "top_k": 20, "top_p": 0.8, "transformers_version": "4.56"}"#,
        );
        assert_eq!(g.bos_token_id, Some(151643));
        assert_eq!(g.stop_ids(&[151645], None), [151645, 151643]);
        assert_eq!(g.stop_ids(&[7], Some(1)), [151645, 151643, 7]);
        let p = g.sampling_params();
        assert_eq!((p.temperature, p.top_k, p.top_p), (0.7, 20, 0.8));
    }

    #[test]
    fn single_int_eos_and_fallbacks() {
        let g = parse(r#"{"eos_token_id": 248046}"#);
        assert_eq!(g.eos_token_id, [248046]);
        let empty = GenerationConfig::default();
        assert_eq!(empty.stop_ids(&[248044], Some(1)), [248044]);
        assert_eq!(empty.stop_ids(&[], Some(151645)), [151645]);
        assert!(empty.stop_ids(&[], None).is_empty());
    }

    #[test]
    fn do_sample_false_means_greedy() {
        let g = parse(r#"{"do_sample": false, "temperature": 0.9}"#);
        assert_eq!(g.sampling_params().temperature, 0.0);
    }

    #[test]
    fn bad_eos_is_an_error_naming_the_file() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let dir = tmp.path();
        std::fs::write(
            dir.join("generation_config.json"),
            r#"{"eos_token_id": "x"}"#,
        )
        .expect("write");
        let err = match GenerationConfig::from_dir(dir) {
            Err(e) => e.to_string(),
            Ok(g) => format!("unexpectedly parsed {g:?}"),
        };
        assert!(err.contains("generation_config.json"), "{err}");
        assert_eq!(eos_ids_from_value(&serde_json::json!(null)), Ok(vec![]));
        assert!(eos_ids_from_value(&serde_json::json!([-1])).is_err());
    }
}
