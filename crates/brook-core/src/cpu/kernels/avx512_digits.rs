//! The integer forms of a 32-element block of activations that `vpdpbusd` multiplies with
//! 4-bit weights (the kernels of `avx512_vnni_mm.rs` and `avx512_tiles.rs`), on AVX-512:
//! Split24's exact digits ([`super::qmatvec::Precision::Split24`]: each activation written to
//! 2^-23 of the block's largest |x| as a 24-bit integer in three signed bytes) and the lossy
//! int8 of [`super::qmatvec::Precision::Fast`] (llama.cpp's Q8 activations). No allocation, no
//! shape checks beyond the block's own.

use std::arch::x86_64::*;

/// Split24 digits of 32 activations (see [`super::qmatvec::Precision::Split24`]): with
/// 2^e > max|x| (e clamped to [−100, 127]), X = round(x·2^(22−e)) split into balanced bytes
/// X = d₂·2^16 + d₁·2^8 + d₀, in element order: `out[0..32]` d₂,
/// `[32..64]` d₁, `[64..96]` d₀ (the prefill tile's layout). Returns (2^(e−22), Σx).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
pub(super) unsafe fn split_block(x: &[f32], out: &mut [i8]) -> (f32, f32) {
    assert!(x.len() >= 32 && out.len() >= 96);
    // SAFETY: bounds asserted above.
    unsafe {
        let (a, b) = (
            _mm512_loadu_ps(x.as_ptr()),
            _mm512_loadu_ps(x.as_ptr().add(16)),
        );
        let (m, inv) = split_scale(a, b);
        for (v, off) in [(a, 0), (b, 16)] {
            for (k, dk) in split16(v, m).into_iter().enumerate() {
                _mm_storeu_si128(out.as_mut_ptr().add(off + 32 * k) as *mut __m128i, dk);
            }
        }
        (inv, _mm512_reduce_add_ps(_mm512_add_ps(a, b)))
    }
}

/// The shared power of two of the 32 activations in `a` and `b`: (2^(22−e), 2^(e−22)).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
unsafe fn split_scale(a: __m512, b: __m512) -> (__m512, f32) {
    let max = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    let e = ((max.to_bits() >> 23) as i32 - 126).clamp(-100, 127);
    (
        _mm512_set1_ps(f32::from_bits(((22 - e + 127) as u32) << 23)),
        f32::from_bits(((e - 22 + 127) as u32) << 23),
    )
}

/// The balanced digits [d₂, d₁, d₀] of round(v·m) for 16 activations, as bytes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
unsafe fn split16(v: __m512, m: __m512) -> [__m128i; 3] {
    let (c128, c255) = (_mm512_set1_epi32(128), _mm512_set1_epi32(255));
    let low =
        |v: __m512i| _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(v, c128), c255), c128);
    let big = _mm512_cvtps_epi32(_mm512_mul_ps(v, m));
    let d0 = low(big);
    let r = _mm512_srai_epi32::<8>(_mm512_sub_epi32(big, d0));
    let d1 = low(r);
    let d2 = _mm512_srai_epi32::<8>(_mm512_sub_epi32(r, d1));
    [
        _mm512_cvtepi32_epi8(d2),
        _mm512_cvtepi32_epi8(d1),
        _mm512_cvtepi32_epi8(d0),
    ]
}

/// Int8 activations of 32 elements: d = max|x| / 127, X = round(x / d) ∈ [−127, 127], in
/// element order into `out[0..32]`. Returns (d, Σx); d is NaN when the block holds a NaN or an
/// infinity.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
pub(super) unsafe fn q8_block(x: &[f32], out: &mut [i8]) -> (f32, f32) {
    assert!(x.len() >= 32 && out.len() >= 32);
    // SAFETY: bounds asserted above.
    unsafe {
        let (a, b) = (
            _mm512_loadu_ps(x.as_ptr()),
            _mm512_loadu_ps(x.as_ptr().add(16)),
        );
        let (d, m) = q8_scale(a, b);
        let q = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(a, m)));
        _mm_storeu_si128(out.as_mut_ptr() as *mut __m128i, q);
        let q = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(b, m)));
        _mm_storeu_si128(out.as_mut_ptr().add(16) as *mut __m128i, q);
        (d, _mm512_reduce_add_ps(_mm512_add_ps(a, b)))
    }
}

/// (d, 1/d as a vector) of the 32 activations in `a` and `b`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
unsafe fn q8_scale(a: __m512, b: __m512) -> (f32, __m512) {
    let max = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    // A NaN or infinity in the block makes d NaN, so the outputs turn NaN as the f32
    // kernels' would, instead of the block silently counting as zero.
    let (d, inv) = if !max.is_finite() {
        (f32::NAN, 0.0)
    } else if max > 0.0 {
        (max / 127.0, 127.0 / max)
    } else {
        (0.0, 0.0)
    };
    (d, _mm512_set1_ps(inv))
}
