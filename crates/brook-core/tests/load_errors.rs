//! Bad checkpoints give typed errors that name the tensor or file, never a panic; odd but
//! valid layouts (symlinked snapshots, F16 weights, vision/MTP tensors) load.

mod common;

use std::path::Path;

use brook_core::dtype::DType;
use brook_core::{Error, Logits, Model};
use common::rewrite::{self, Tensor};
use common::{Reference, fixture};

fn open_err(dir: &Path) -> Error {
    Model::open(dir).expect_err("must be refused")
}

fn logits(dir: &Path) -> Vec<f32> {
    let model = Model::open(dir).expect("open");
    let tokens = Reference::open("next-q4").ids("tokens");
    model
        .forward(&mut model.new_state(), &tokens[..6], Logits::All, None)
        .expect("forward")
}

/// A copy of `src` with `edit` applied to its tensors.
fn edited(src: &str, edit: impl FnOnce(&mut Vec<Tensor>)) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut t = rewrite::tensors(&fixture(src));
    edit(&mut t);
    rewrite::write(dir.path(), &t, &rewrite::config(&fixture(src)));
    dir
}

#[test]
fn missing_tensor_is_named() {
    let name = "model.layers.0.linear_attn.A_log";
    let dir = edited("next-q4", |t| t.retain(|x| x.name != name));
    match open_err(dir.path()) {
        Error::MissingTensor { name: n, .. } => assert_eq!(n, name),
        e => panic!("wrong error: {e}"),
    }
}

#[test]
fn wrong_shape_is_named() {
    let dir = edited("next-q4", |t| {
        let x = t
            .iter_mut()
            .find(|x| x.name == "model.norm.weight")
            .expect("norm");
        x.shape = vec![127];
        x.data.truncate(127 * 2);
    });
    match open_err(dir.path()) {
        Error::Shape { name, got, .. } => {
            assert_eq!(name, "model.norm.weight");
            assert_eq!(got, vec![127]);
        }
        e => panic!("wrong error: {e}"),
    }
}

#[test]
fn unsupported_bit_width_is_refused() {
    // 7 bits: 128 inputs pack into 28 words per row.
    let dir = edited("next-q4", |t| {
        let x = t
            .iter_mut()
            .find(|x| x.name == "model.layers.0.mlp.gate.weight")
            .expect("router");
        x.shape = vec![8, 28];
        x.data = vec![0x5a; 8 * 28 * 4];
    });
    let e = open_err(dir.path());
    assert!(
        matches!(&e, Error::Quantization { name, .. } if name == "model.layers.0.mlp.gate.weight"),
        "{e}"
    );
    assert!(e.to_string().contains("7 bits"), "{e}");
}

#[test]
fn config_disagreeing_with_tensors_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cfg = rewrite::config(&fixture("next-mixed"));
    cfg["quantization"]["model.embed_tokens"]["bits"] = 4.into();
    rewrite::write(dir.path(), &rewrite::tensors(&fixture("next-mixed")), &cfg);
    let e = open_err(dir.path());
    assert!(
        matches!(&e, Error::Quantization { name, .. } if name == "model.embed_tokens.weight"),
        "{e}"
    );
}

#[test]
fn quantized_weight_of_wrong_dtype_is_refused() {
    let dir = edited("next-q4", |t| {
        let x = t
            .iter_mut()
            .find(|x| x.name == "lm_head.weight")
            .expect("head");
        x.dtype = DType::F32;
    });
    assert!(matches!(open_err(dir.path()), Error::Dtype { name, .. } if name == "lm_head.weight"));
}

#[test]
fn truncated_safetensors_names_the_file() {
    let dir = edited("next-q4", |_| {});
    let file = dir.path().join("model.safetensors");
    let len = std::fs::metadata(&file).expect("meta").len();
    for cut in [len - 1, len / 2, 100, 4] {
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&file)
            .expect("open");
        f.set_len(cut).expect("truncate");
        match open_err(dir.path()) {
            Error::Safetensors { path, reason } => {
                assert_eq!(path, file, "{reason}");
                assert!(reason.contains("truncated"), "{reason}");
            }
            e => panic!("cut {cut}: wrong error: {e}"),
        }
    }
}

#[test]
fn malformed_headers_are_refused() {
    let dir = edited("next-q4", |_| {});
    let file = dir.path().join("model.safetensors");
    let good = std::fs::read(&file).expect("read");
    let header_len = u64::from_le_bytes(good[..8].try_into().expect("8 bytes")) as usize;
    let mut cases: Vec<(&str, Vec<u8>)> = Vec::new();
    let mut not_json = good.clone();
    not_json[8] = b'[';
    not_json[9] = b'!';
    cases.push(("not valid JSON", not_json));
    let mut huge = good.clone();
    huge[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    cases.push(("header length", huge));
    let header = String::from_utf8(good[8..8 + header_len].to_vec()).expect("utf8");
    let bad_offsets = header.replacen("\"data_offsets\":[0,", "\"data_offsets\":[1,", 1);
    cases.push(("spans bytes", swap_header(&good, header_len, &bad_offsets)));
    let bad_dtype = header.replacen("\"BF16\"", "\"Q9\"", 1);
    cases.push(("dtype", swap_header(&good, header_len, &bad_dtype)));
    // Extents that do not tile the data section (Hugging Face's parser refuses these too).
    let edit = |f: &dyn Fn(&mut serde_json::Map<String, serde_json::Value>)| {
        let mut v: serde_json::Value = serde_json::from_str(&header).expect("header");
        f(v.as_object_mut().expect("object"));
        v.to_string()
    };
    let spans = |m: &serde_json::Map<String, serde_json::Value>| {
        let mut s: Vec<(u64, String)> = m
            .iter()
            .filter(|(k, _)| *k != "__metadata__")
            .map(|(k, v)| (v["data_offsets"][0].as_u64().expect("offset"), k.clone()))
            .collect();
        s.sort();
        s
    };
    let shift = |m: &mut serde_json::Map<String, serde_json::Value>, name: &str, by: i64| {
        let o = &mut m[name]["data_offsets"];
        for i in 0..2 {
            o[i] = ((o[i].as_u64().expect("offset") as i64) + by).into();
        }
    };
    let overlap = edit(&|m| {
        let second = spans(m)[1].1.clone();
        shift(m, &second, -1);
    });
    cases.push(("overlaps", swap_header(&good, header_len, &overlap)));
    let gap = edit(&|m| {
        for (_, name) in spans(m) {
            shift(m, &name, 16);
        }
    });
    let mut with_gap = swap_header(&good, header_len, &gap);
    let at = with_gap.len() - (good.len() - 8 - header_len);
    with_gap.splice(at..at, [0u8; 16]);
    cases.push(("belong to no tensor", with_gap));
    let mut trailing = good.clone();
    trailing.extend_from_slice(b"extra");
    cases.push(("trailing bytes", trailing));
    for (want, bytes) in cases {
        std::fs::write(&file, &bytes).expect("write");
        match open_err(dir.path()) {
            Error::Safetensors { reason, .. } => assert!(reason.contains(want), "{want}: {reason}"),
            e => panic!("{want}: wrong error: {e}"),
        }
    }
}

fn swap_header(file: &[u8], old_len: usize, header: &str) -> Vec<u8> {
    let mut h = header.as_bytes().to_vec();
    while h.len() < old_len {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    out.extend_from_slice(&file[8 + old_len..]);
    out
}

#[test]
fn missing_shard_is_named() {
    let dir = tempfile::tempdir().expect("tempdir");
    for f in std::fs::read_dir(fixture("next-q4")).expect("ls") {
        let f = f.expect("entry").path();
        if f.file_name()
            .is_some_and(|n| n != "model-00002-of-00003.safetensors")
        {
            std::fs::copy(&f, dir.path().join(f.file_name().expect("name"))).expect("copy");
        }
    }
    match open_err(dir.path()) {
        Error::Checkpoint { path, .. } => {
            assert!(path.ends_with("model-00002-of-00003.safetensors"))
        }
        e => panic!("wrong error: {e}"),
    }
}

#[test]
fn hugging_face_cache_snapshot_of_symlinks_loads() {
    // The Hub cache layout: snapshots/<rev>/<file> -> ../../blobs/<hash>.
    let root = tempfile::tempdir().expect("tempdir");
    let blobs = root.path().join("blobs");
    let snap = root.path().join("snapshots/0123abcd");
    std::fs::create_dir_all(&blobs).expect("mkdir");
    std::fs::create_dir_all(&snap).expect("mkdir");
    for (i, f) in std::fs::read_dir(fixture("next-q4"))
        .expect("ls")
        .enumerate()
    {
        let f = f.expect("entry").path();
        let blob = blobs.join(format!("{i:040x}"));
        std::fs::copy(&f, &blob).expect("copy");
        let link = snap.join(f.file_name().expect("name"));
        std::os::unix::fs::symlink(format!("../../blobs/{i:040x}"), &link).expect("symlink");
    }
    assert_eq!(logits(&snap), logits(&fixture("next-q4")));
}

#[test]
fn vision_and_mtp_tensors_are_ignored() {
    let extra = |name: &str| Tensor {
        name: name.into(),
        dtype: DType::F32,
        shape: vec![2, 3],
        data: vec![0; 24],
    };
    let dir = edited("next-q4", |t| {
        t.push(extra("mtp.fc.weight"));
        t.push(extra("mtp.layers.0.mlp.experts.0.gate_proj.weight"));
        t.push(extra("vision_tower.blocks.0.attn.qkv.weight"));
        t.push(extra("model.visual.patch_embed.proj.weight"));
    });
    assert_eq!(logits(dir.path()), logits(&fixture("next-q4")));
}

#[test]
fn f16_weights_load_exactly() {
    // Two copies of the f32 model: one stored as F16, one as F32 holding the same f16-rounded
    // values. Widening F16 is exact, so both must give bit-identical logits.
    let to_f16 = |t: &mut Vec<Tensor>, keep_f32: bool| {
        for x in t.iter_mut().filter(|x| x.dtype == DType::F32) {
            let vals = x
                .data
                .chunks_exact(4)
                .map(|c| half::f16::from_f32(f32::from_le_bytes([c[0], c[1], c[2], c[3]])));
            x.data = if keep_f32 {
                vals.flat_map(|v| v.to_f32().to_le_bytes()).collect()
            } else {
                x.dtype = DType::F16;
                vals.flat_map(|v| v.to_bits().to_le_bytes()).collect()
            };
        }
    };
    let a = edited("next-f32", |t| to_f16(t, false));
    let b = edited("next-f32", |t| to_f16(t, true));
    let la = logits(a.path());
    assert_eq!(la, logits(b.path()));
    assert!(la.iter().all(|v| v.is_finite()));
}

#[test]
fn hugging_face_layout_is_refused_with_advice() {
    let dir = edited("next-q4", |t| {
        for x in t
            .iter_mut()
            .filter(|x| x.name.contains("switch_mlp.gate_proj.weight"))
        {
            x.name = x
                .name
                .replace("switch_mlp.gate_proj", "experts.0.gate_proj");
        }
    });
    let e = open_err(dir.path());
    assert!(e.to_string().contains("mlx_lm.convert"), "{e}");
}

#[test]
fn not_a_folder_and_no_weights_are_clear() {
    let e = open_err(Path::new("/nonexistent/brook-model"));
    assert!(e.to_string().contains("not a folder"), "{e}");
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::copy(
        fixture("next-q4/config.json"),
        dir.path().join("config.json"),
    )
    .expect("copy");
    let e = open_err(dir.path());
    assert!(e.to_string().contains("no model*.safetensors"), "{e}");
}

#[test]
fn a_context_or_chunk_out_of_range_is_refused_before_anything_is_sized() {
    use brook_core::model::open::OpenOptions;
    for (context, chunk, want) in [
        (usize::MAX, 512, "context"),
        (0, 512, "context"),
        (4096, 0, "prefill chunk"),
        (4096, usize::MAX, "prefill chunk"),
        (4096, 512, "threads"),
    ] {
        let opts = OpenOptions {
            context,
            prefill_chunk: chunk,
            threads: (want == "threads").then_some(100_000),
            ..Default::default()
        };
        match Model::open_with(&fixture("next-q4"), &opts) {
            Err(Error::Invalid(m)) => assert!(m.contains(want), "{m}"),
            Err(e) => panic!("wrong error: {e}"),
            Ok(_) => panic!("context {context} chunk {chunk} accepted"),
        }
    }
}
