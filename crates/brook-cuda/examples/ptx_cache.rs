//! Fills the kernel cache (`BROOK_HOME/cuda`) for GPUs this machine need not have, so that a
//! GPU machine given that cache skips NVRTC on its first start (a build's kernels take tens of
//! seconds to compile there):
//!
//! ```text
//! BROOK_HOME=DIR cargo run --release -p brook-cuda --example ptx_cache -- \
//!     "NVIDIA H100 80GB HBM3=9.0" "NVIDIA H200=9.0"
//! ```
//!
//! Each argument is a device name as the driver gives it and its compute capability. The
//! cache is keyed by this machine's NVRTC version too: it serves a GPU machine whose NVRTC has
//! the same major and minor version (else that machine compiles as before).

use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.is_empty() {
        eprintln!("usage: ptx_cache \"DEVICE NAME=MAJOR.MINOR\" ...");
        return ExitCode::from(2);
    }
    let Some(v) = brook_cuda::nvrtc::version() else {
        eprintln!("NVRTC (libnvrtc.so) not found: put its library directory on LD_LIBRARY_PATH");
        return ExitCode::FAILURE;
    };
    for a in &args {
        let parsed = a.rsplit_once('=').and_then(|(name, cc)| {
            let (ma, mi) = cc.split_once('.')?;
            Some((name, (ma.parse::<i32>().ok()?, mi.parse::<i32>().ok()?)))
        });
        let Some((name, cc)) = parsed else {
            eprintln!("{a}: expected \"DEVICE NAME=MAJOR.MINOR\", e.g. \"NVIDIA H200=9.0\"");
            return ExitCode::from(2);
        };
        let t = std::time::Instant::now();
        match brook_cuda::nvrtc::precompile(name, cc) {
            Ok(fresh) => println!(
                "{name} (compute capability {}.{}), NVRTC {}.{}: {} in {:.1} s",
                cc.0,
                cc.1,
                v.0,
                v.1,
                if fresh { "compiled" } else { "cached already" },
                t.elapsed().as_secs_f64()
            ),
            Err(e) => {
                eprintln!("{name}: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    ExitCode::SUCCESS
}
