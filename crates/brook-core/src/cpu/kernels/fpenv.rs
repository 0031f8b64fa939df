//! Subnormal floats flushed to zero on the calling thread while a [`FlushSubnormals`] lives.
//!
//! The DeltaNet rule multiplies its state and keys by decays e^{γ} that reach 1e-38 and
//! below within a chunk, so some products land among the subnormals. Intel cores take a
//! microcode assist of about a hundred cycles for each SIMD operation that reads or writes
//! one: the resident 35B's AVX2 prefill spent as long in the chunked rule as in every
//! product of its weights (the prefill 22.7 tok/s with subnormals, 37.8 flushed; AMD cores
//! pay little). Values below 1.2e-38 next to the O(1) terms they are summed with change no
//! result beyond its last bit's rounding, and GPUs flush them too.

/// While alive, the thread's SSE/AVX arithmetic reads subnormal inputs as zero and writes
/// zero for subnormal results (MXCSR's DAZ and FTZ bits); dropping it restores the previous
/// mode. Elsewhere than x86-64 it does nothing. Create it on the thread that computes (a pool
/// job's closure), not on the one that hands out the work: the mode is per thread.
#[derive(Debug)]
pub struct FlushSubnormals {
    #[cfg(target_arch = "x86_64")]
    saved: u32,
}

/// MXCSR's flush-to-zero (bit 15) and denormals-are-zero (bit 6).
#[cfg(target_arch = "x86_64")]
const FTZ_DAZ: u32 = 0x8040;

impl FlushSubnormals {
    #[must_use = "the mode holds only while the guard lives"]
    pub fn new() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            let mut saved = 0u32;
            // SAFETY: stmxcsr stores the 32-bit control word into `saved`; ldmxcsr loads it
            // back with only FTZ and DAZ added, bits every x86-64 CPU defines.
            unsafe {
                let at = &mut saved;
                std::arch::asm!(
                    "stmxcsr [{}]",
                    in(reg) at,
                    options(nostack, preserves_flags),
                );
                let flushed = saved | FTZ_DAZ;
                let at = &flushed;
                std::arch::asm!(
                    "ldmxcsr [{}]",
                    in(reg) at,
                    options(nostack, readonly, preserves_flags),
                );
            }
            FlushSubnormals { saved }
        }
        #[cfg(not(target_arch = "x86_64"))]
        FlushSubnormals {}
    }
}

impl Default for FlushSubnormals {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for FlushSubnormals {
    fn drop(&mut self) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: restores the control word read in `new`.
        unsafe {
            let at = &self.saved;
            std::arch::asm!(
                "ldmxcsr [{}]",
                in(reg) at,
                options(nostack, readonly, preserves_flags),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subnormals_flush_inside_the_guard_only() {
        let tiny = std::hint::black_box(f32::MIN_POSITIVE);
        let half = std::hint::black_box(0.5f32);
        assert!((tiny * half) > 0.0, "subnormal results by default");
        {
            let _g = FlushSubnormals::new();
            let r = std::hint::black_box(tiny) * std::hint::black_box(half);
            if cfg!(target_arch = "x86_64") {
                assert_eq!(r, 0.0, "flushed inside the guard");
            }
        }
        assert!(
            (tiny * half) > 0.0,
            "the previous mode back after the guard"
        );
    }
}
