//! Which SIMD instruction set the CPU kernels use: detected once, forcible for tests.
//!
//! Owns run-time feature detection (`is_x86_feature_detected!`, evaluated once and cached) and
//! the [`SimdLevel`] every kernel entry takes, so a test can run the same input through every
//! level the CPU supports. It must not hold kernels. There is no reference to mirror: a level
//! only changes speed, never the result beyond f32 summation order.

use std::sync::OnceLock;

/// An instruction set the kernels are written for, from slowest to fastest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SimdLevel {
    /// Plain Rust that the compiler vectorizes for the build target; runs on every CPU.
    Portable,
    /// x86-64 AVX2 + FMA + F16C (Haswell, Zen 1 and later).
    Avx2,
    /// x86-64 AVX-512 F, BW, VL and VBMI (Ice Lake, Zen 4 and later). VBMI's byte permutes
    /// unpack 2, 3, 5 and 6 bit weights; a CPU with AVX-512 but without VBMI (Skylake-X) runs
    /// the AVX2 kernels.
    Avx512,
}

impl SimdLevel {
    /// Every level, slowest first.
    pub const ALL: [SimdLevel; 3] = [SimdLevel::Portable, SimdLevel::Avx2, SimdLevel::Avx512];

    /// The fastest level this CPU runs, detected on the first call and cached; the
    /// environment variable `BROOK_SIMD` (`portable`, `avx2`, `avx2vnni`, `avx512`) caps it,
    /// so a machine can run (and benchmark) the kernels of a lower level, as users' CPUs
    /// without AVX-512 do. The features of a higher level (VNNI, BF16) go with it; `avx2`
    /// also leaves out AVX-VNNI (an AVX2-only CPU), `avx2vnni` keeps it where present.
    pub fn detect() -> SimdLevel {
        static LEVEL: OnceLock<SimdLevel> = OnceLock::new();
        *LEVEL.get_or_init(|| {
            let best = Self::ALL
                .into_iter()
                .rev()
                .find(|l| l.probe())
                .unwrap_or(SimdLevel::Portable);
            match requested() {
                Some(want) => match Self::from_name(want) {
                    Some(l) if l <= best => l,
                    Some(l) => {
                        tracing::warn!(
                            "BROOK_SIMD={want}: this CPU has no {}; using {}",
                            l.name(),
                            best.name()
                        );
                        best
                    }
                    None => {
                        tracing::warn!(
                            "BROOK_SIMD={want} is not a level (portable, avx2, avx2vnni, avx512); using {}",
                            best.name()
                        );
                        best
                    }
                },
                _ => best,
            }
        })
    }

    /// The level named `name` (`portable`, `avx2`, `avx2vnni`, `avx512`).
    pub fn from_name(name: &str) -> Option<SimdLevel> {
        if name.trim().eq_ignore_ascii_case("avx2vnni") {
            return Some(SimdLevel::Avx2);
        }
        Self::ALL
            .into_iter()
            .find(|l| l.name().eq_ignore_ascii_case(name.trim()))
    }

    /// Whether this CPU can run kernels of this level.
    pub fn is_supported(self) -> bool {
        self <= Self::detect()
    }

    /// The levels this CPU can run, slowest first (for tests that force each one).
    pub fn supported() -> impl Iterator<Item = SimdLevel> {
        Self::ALL.into_iter().filter(|l| l.is_supported())
    }

    /// Whether this CPU has AVX-512 VNNI (`vpdpbusd`), used by [`crate::cpu::Precision::Split24`].
    pub fn has_vnni() -> bool {
        static VNNI: OnceLock<bool> = OnceLock::new();
        *VNNI.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            {
                SimdLevel::Avx512.is_supported() && is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(not(target_arch = "x86_64"))]
            {
                false
            }
        })
    }

    /// Whether this CPU has AVX-VNNI (`vpdpbusd` on 256-bit registers: Alder Lake, Zen 4 and
    /// later), which the AVX2 level's integer 4-bit kernels use in place of
    /// `vpmaddubsw` + `vpmaddwd`. `BROOK_SIMD=avx2` leaves it out (an AVX2-only CPU).
    pub fn has_avx_vnni() -> bool {
        static VNNI: OnceLock<bool> = OnceLock::new();
        *VNNI.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            {
                let plain = requested().is_some_and(|v| v.trim().eq_ignore_ascii_case("avx2"));
                !plain && SimdLevel::Avx2.is_supported() && is_x86_feature_detected!("avxvnni")
            }
            #[cfg(not(target_arch = "x86_64"))]
            {
                false
            }
        })
    }

    /// Whether this CPU has AVX-512 BF16 (`vcvtneps2bf16`), used by the fast path's bf16
    /// recurrent states ([`crate::cpu::kernels::delta::step_bf16`]).
    pub fn has_avx512_bf16() -> bool {
        static BF16: OnceLock<bool> = OnceLock::new();
        *BF16.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            {
                SimdLevel::Avx512.is_supported() && is_x86_feature_detected!("avx512bf16")
            }
            #[cfg(not(target_arch = "x86_64"))]
            {
                false
            }
        })
    }

    /// Short lowercase name, as used in benchmark ids.
    pub fn name(self) -> &'static str {
        match self {
            SimdLevel::Portable => "portable",
            SimdLevel::Avx2 => "avx2",
            SimdLevel::Avx512 => "avx512",
        }
    }

    #[cfg(target_arch = "x86_64")]
    fn probe(self) -> bool {
        match self {
            SimdLevel::Portable => true,
            SimdLevel::Avx2 => {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            SimdLevel::Avx512 => {
                SimdLevel::Avx2.probe()
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512vbmi")
            }
        }
    }

    #[cfg(not(target_arch = "x86_64"))]
    fn probe(self) -> bool {
        self == SimdLevel::Portable
    }
}

/// `BROOK_SIMD` as set (read once), unless empty.
fn requested() -> Option<&'static str> {
    static WANT: OnceLock<Option<String>> = OnceLock::new();
    WANT.get_or_init(|| std::env::var("BROOK_SIMD").ok().filter(|v| !v.is_empty()))
        .as_deref()
}
