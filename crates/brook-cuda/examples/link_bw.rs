//! How fast this GPU reads page-locked host memory, the mapped expert tier's link: the copy
//! engine, and the engine's own gather kernel (`gather_mapped`, kernels/routing.cu) at several
//! block counts, over memory the driver allocates (`cuMemHostAlloc`, as the engine's mapped
//! tier does) and over memory in transparent huge pages registered with the driver
//! (`cuMemHostRegister`: `Pinned::new_mapped_huge`, which `BROOK_CUDA_HOST_HUGE=1` gives the
//! engine's mapped tier). Hosts whose mapped-tier decode differs with the same copy bandwidth
//! (docs/bench/2026-12-06.md, "The slow hosts, narrowed") are told apart by it.
//!
//! `cargo run --release -p brook-cuda --example link_bw -- [MIB] [EXPERT_KIB]` (defaults 512
//! and 1728, about a 35B expert's image). Prints GB/s per form, the best of a few rounds, with
//! the host's transparent huge page setting and how much of the registered buffer the kernel
//! put in huge pages.

use std::sync::Arc;
use std::time::Instant;

use brook_core::{Error, Result};
use brook_cuda::gpu::{Args, DevBuf, Gpu, Pinned};

/// Picks a gather launch copies, as a one-token layer of the 35B at most.
const PICKS: usize = 8;

/// Page-locked host bytes the GPU reads at `dev`.
struct Host {
    mem: Pinned,
    dev: u64,
}

/// `bytes` of page-locked host memory as the engine's mapped tier takes it: from the driver
/// (`huge` false) or in huge pages registered with it (`BROOK_CUDA_HOST_HUGE=1`).
fn host_memory(gpu: &Arc<Gpu>, bytes: usize, huge: bool) -> Result<Host> {
    let mut mem = if huge {
        Pinned::new_mapped_huge(gpu, bytes)?
    } else {
        Pinned::new_mapped(gpu, bytes)?
    };
    fill(mem.as_mut_slice());
    let dev = mem.device_ptr()?;
    Ok(Host { mem, dev })
}

/// Distinct bytes, touched so every page is present before it is locked.
fn fill(b: &mut [u8]) {
    for (i, x) in b.iter_mut().enumerate() {
        *x = (i * 131 + (i >> 12)) as u8;
    }
}

/// Bytes of anonymous memory in huge pages (0 if unreadable).
fn anon_huge_bytes() -> u64 {
    brook_core::experts::budget::meminfo("AnonHugePages:").unwrap_or(0)
}

/// The copy engine: `bytes` from `host` into `dst`, the best GB/s of three.
fn copy_engine(gpu: &Arc<Gpu>, host: &Host, dst: &DevBuf) -> Result<f64> {
    let mut best = 0.0f64;
    for _ in 0..3 {
        let t = Instant::now();
        // SAFETY: host holds `bytes` page-locked bytes, dst as many; waited for below.
        unsafe { gpu.copy_in_async(dst.ptr, host.mem.ptr(), host.mem.bytes)? };
        gpu.sync()?;
        best = best.max(host.mem.bytes as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    Ok(best)
}

/// The gather kernel over every expert image of `host` in launches of [`PICKS`] picks with
/// `parts` blocks a pick: the best GB/s of three passes.
fn gather(gpu: &Arc<Gpu>, host: &Host, img: usize, parts: u32) -> Result<f64> {
    let experts = host.mem.bytes / img;
    let slot = img.next_multiple_of(256);
    let addrs: Vec<u64> = (0..experts).map(|e| host.dev + (e * img) as u64).collect();
    let table = gpu.upload(&addrs, "table")?;
    let scratch = gpu.alloc(PICKS * slot, "scratch")?;
    let step = gpu.zeros(experts * 8, "step")?;
    let counts = gpu.zeros(experts * 4, "counts")?;
    let hits = gpu.zeros(4, "prefetch hits")?;
    let launches = experts / PICKS;
    let sels: Vec<i32> = (0..launches * PICKS).map(|i| i as i32).collect();
    let sel = gpu.upload(&sels, "picks")?;
    let mut best = 0.0f64;
    for _ in 0..3 {
        gpu.sync()?;
        let t = Instant::now();
        for l in 0..launches {
            let mut a = Args::new();
            // No GPU slots ([0, 0) holds no address): every pick is copied.
            a.arg(table.ptr)
                .arg(0u64)
                .arg(0u64)
                .arg(sel.ptr + (l * PICKS * 4) as u64)
                .arg(PICKS as i32)
                .arg(scratch.ptr)
                .arg(slot as i32)
                .arg(img as i32)
                .arg(step.ptr)
                .arg(counts.ptr)
                .arg(0u64)
                .arg(0u64)
                .arg(0i32)
                .arg(hits.ptr)
                .arg(PICKS as i32)
                .arg(0u64);
            gpu.launch(
                gpu.k.gather_mapped,
                (parts, PICKS as u32, 1),
                256,
                0,
                &mut a,
            )?;
        }
        gpu.sync()?;
        let moved = (launches * PICKS * img) as f64;
        best = best.max(moved / t.elapsed().as_secs_f64() / 1e9);
    }
    Ok(best)
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let num = |i: usize, default: usize| -> Result<usize> {
        args.get(i).map_or(Ok(default), |s| {
            s.parse()
                .map_err(|_| Error::Invalid("usage: link_bw [MIB] [EXPERT_KIB]".into()))
        })
    };
    let bytes = num(1, 512)? << 20;
    let img = (num(2, 1728)? << 10).next_multiple_of(16);
    if img == 0 || bytes < img * PICKS {
        return Err(Error::Invalid(format!(
            "{bytes} bytes hold fewer than {PICKS} experts of {img}"
        )));
    }
    let gpu = Gpu::open(0, None)?;
    let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
        .unwrap_or_else(|_| "unknown".into());
    println!(
        "{} ({} SMs); transparent huge pages: {}; {} MiB, experts of {} KiB",
        gpu.name,
        gpu.sms,
        thp.trim(),
        bytes >> 20,
        img >> 10
    );
    let dst = gpu.alloc(bytes, "copy target")?;
    for (kind, huge) in [
        ("driver (cuMemHostAlloc)", false),
        ("huge pages (cuMemHostRegister)", true),
    ] {
        let before = anon_huge_bytes();
        let host = host_memory(&gpu, bytes, huge);
        let host = match host {
            Ok(h) => h,
            Err(e) => {
                println!("{kind}: {e}");
                continue;
            }
        };
        let huge = anon_huge_bytes().saturating_sub(before) >> 20;
        let mut line = format!(
            "{kind}: {huge} MiB more in huge pages; copy engine {:.1} GB/s; gather",
            copy_engine(&gpu, &host, &dst)?
        );
        for parts in [4u32, 8, 16, 27, 64] {
            line += &format!(" {parts}/pick {:.1}", gather(&gpu, &host, img, parts)?);
        }
        println!("{line} GB/s");
        gpu.sync()?;
    }
    Ok(())
}
