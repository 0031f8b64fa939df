//! The CUDA backend's environment switches, read here and nowhere else. Each turns one
//! measured mechanism off or tunes it, for profilers and for measuring a change against its
//! baseline in one binary (docs/CUDA.md, docs/BENCH.md); the defaults are what was measured
//! fastest. Unset, every switch keeps its default.

/// `BROOK_CUDA_GRAPHS=0`: no CUDA graphs (for profilers that time kernels one at a time).
pub fn graphs() -> bool {
    std::env::var("BROOK_CUDA_GRAPHS").map_or(true, |v| v != "0")
}

/// `BROOK_CUDA_PDL=0`: no programmatic dependent launch (Hopper and later have it).
pub fn pdl() -> bool {
    std::env::var("BROOK_CUDA_PDL").map_or(true, |v| v != "0")
}

/// `BROOK_CUDA_TC=0`: the CUDA cores' matrix kernels instead of the tensor cores' (Ampere
/// and later have them).
pub fn tensor_cores() -> bool {
    std::env::var("BROOK_CUDA_TC").map_or(true, |v| v != "0")
}

/// `BROOK_CUDA_PREFETCH=1`: the mapped tier's prefetch of guessed experts (off: on the H200
/// its guesses named 88.7% of the mapped picks, yet decode hardly moved).
pub fn prefetch() -> bool {
    std::env::var("BROOK_CUDA_PREFETCH").is_ok_and(|v| v == "1")
}

/// Blocks of a one-token gather of mapped experts whose products run beside it, on a GPU
/// of `sms` SMs: half the SMs by default (a few dozen keep PCIe busy, as each thread has
/// four 16-byte reads in flight, and the products need the rest), `BROOK_CUDA_GATHER_BLOCKS`
/// (1 to 1024) otherwise; 0 with `BROOK_CUDA_GATHER_FLAGS=0` (the products then wait for the
/// gather's end).
pub fn gather_blocks(sms: usize) -> usize {
    if std::env::var("BROOK_CUDA_GATHER_FLAGS").is_ok_and(|v| v == "0") {
        return 0;
    }
    let default = (sms / 2).max(1);
    match std::env::var("BROOK_CUDA_GATHER_BLOCKS") {
        Ok(v) => match v.parse::<usize>() {
            Ok(n) if (1..=1024).contains(&n) => n,
            _ => {
                tracing::warn!(
                    "BROOK_CUDA_GATHER_BLOCKS={v} is not a count from 1 to 1024; using {default}"
                );
                default
            }
        },
        Err(_) => default,
    }
}
