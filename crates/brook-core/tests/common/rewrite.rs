//! Writing modified copies of fixture checkpoints for error-path tests.

use std::collections::BTreeMap;
use std::path::Path;

use brook_core::Checkpoint;
use brook_core::dtype::DType;
use brook_core::safetensors::{self, TensorOut};

/// One stored tensor, editable.
#[derive(Clone, Debug)]
pub struct Tensor {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

/// Every tensor of checkpoint `src` under its stored name.
pub fn tensors(src: &Path) -> Vec<Tensor> {
    let ck = Checkpoint::open(src).expect("open fixture");
    let mut out = Vec::new();
    for f in ck.files() {
        for (name, info) in &f.tensors {
            out.push(Tensor {
                name: name.clone(),
                dtype: info.dtype,
                shape: info.shape.clone(),
                data: f.read(info).expect("read"),
            });
        }
    }
    out
}

/// Writes `tensors` as `dst/model.safetensors` with `config` as config.json.
pub fn write(dst: &Path, tensors: &[Tensor], config: &serde_json::Value) {
    std::fs::create_dir_all(dst).expect("mkdir");
    let outs: Vec<TensorOut<'_>> = tensors
        .iter()
        .map(|t| TensorOut {
            name: t.name.clone(),
            dtype: t.dtype,
            shape: t.shape.clone(),
            data: &t.data,
        })
        .collect();
    let meta = BTreeMap::from([("format".to_string(), "mlx".to_string())]);
    safetensors::write(&dst.join("model.safetensors"), &outs, &meta).expect("write");
    std::fs::write(
        dst.join("config.json"),
        serde_json::to_vec_pretty(config).expect("json"),
    )
    .expect("write config");
}

pub fn config(src: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(src.join("config.json")).expect("read")).expect("json")
}
