//! Elementwise and normalisation ops of the reference path, in f32.
//!
//! Written for clarity; each mirrors one MLX op (`mx.fast.rms_norm`, `nn.silu`,
//! `nn.softplus`, `mx.softmax(precise=True)`).

/// RMSNorm with a multiplier weight: y = x / √(mean(x²) + ε) · w (MLX's `rms_norm`).
///
/// MLX checkpoints store the zero-centred norms of these models already shifted to 1 + w,
/// so every norm in the forward pass is this plain form.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let inv = inv_rms(x, eps);
    for ((o, &xi), &wi) in out.iter_mut().zip(x).zip(w) {
        *o = xi * inv * wi;
    }
}

/// 1 / √(mean(x²) + ε).
pub fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    1.0 / (ms + eps).sqrt()
}

/// RMSNorm without weight, in place, then scaled by `scale`.
pub fn rms_norm_scaled_inplace(x: &mut [f32], eps: f32, scale: f32) {
    let inv = inv_rms(x, eps) * scale;
    x.iter_mut().for_each(|v| *v *= inv);
}

pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// log(1 + eˣ), stable for large |x|.
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.max(0.0) + (-x.abs()).exp().ln_1p()
    }
}

/// Softmax in place.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    x.iter_mut().for_each(|v| *v /= sum);
}
