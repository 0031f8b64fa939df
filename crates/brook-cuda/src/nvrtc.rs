//! Compiling [`SOURCE`] with NVRTC for the device found, once per process and once per
//! machine (a disk cache under `BROOK_HOME/cuda`), moved unchanged out of gpu.rs.

use std::path::PathBuf;

use brook_core::{Error, Result};

use crate::gpu::{SOURCE, err};

/// The PTX of [`SOURCE`] for this device: from this process's earlier opens, the disk cache
/// (keyed by device name, compute capability, source and NVRTC version), or compiled now
/// and stored. The bool says whether NVRTC ran.
pub(crate) fn ptx_for(name: &str, cc: (i32, i32)) -> Result<(String, bool)> {
    let arch = format!("sm_{}{}{}", cc.0, cc.1, if cc.0 == 9 { "a" } else { "" });
    let nvrtc = version().unwrap_or((0, 0));
    let key = xxhash_rust::xxh3::xxh3_64(format!("{name}\n{arch}\n{nvrtc:?}\n{SOURCE}").as_bytes());
    static COMPILED: std::sync::Mutex<Vec<(u64, String)>> = std::sync::Mutex::new(Vec::new());
    let mut compiled = COMPILED.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, ptx)) = compiled.iter().find(|(k, _)| *k == key) {
        return Ok((ptx.clone(), false));
    }
    let (ptx, fresh) = ptx_from_disk_or_nvrtc(key, &arch)?;
    compiled.push((key, ptx.clone()));
    Ok((ptx, fresh))
}

/// Compiles the kernels for a GPU named `name` (as the driver names it) of compute capability
/// `cc` into the disk cache on a machine that need not have that GPU, so the GPU machine's
/// first start skips NVRTC. The cache is keyed by this NVRTC's version as well, so it serves
/// a machine with the same version only. Whether NVRTC ran (false: it was cached already).
pub fn precompile(name: &str, cc: (i32, i32)) -> Result<bool> {
    // SAFETY: only tries to dlopen NVRTC and reports whether that worked.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(Error::Device(
            "NVRTC (libnvrtc.so) not found: install the CUDA toolkit's NVRTC or put its \
             library directory on LD_LIBRARY_PATH"
                .into(),
        ));
    }
    ptx_for(name, cc).map(|(_, fresh)| fresh)
}

/// This NVRTC's (major, minor) version, part of the cache's key (`None`: not loadable).
pub fn version() -> Option<(i32, i32)> {
    // SAFETY: only tries to dlopen NVRTC.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return None;
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: NVRTC is loaded; two out-parameters.
    let _ = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    Some((major, minor))
}

/// The disk cache, else NVRTC (storing the result).
fn ptx_from_disk_or_nvrtc(key: u64, arch: &str) -> Result<(String, bool)> {
    let dir = cache_dir();
    let file = dir
        .as_ref()
        .map(|d| d.join(format!("kernels-{key:016x}.ptx")));
    if let Some(ptx) = file.as_ref().and_then(|f| std::fs::read_to_string(f).ok()) {
        return Ok((ptx, false));
    }
    let arch_static: &'static str = Box::leak(arch.to_string().into_boxed_str());
    let opts = cudarc::nvrtc::CompileOptions {
        arch: Some(arch_static),
        options: vec!["--std=c++17".into()],
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(SOURCE, opts)
        .map_err(|e| err(&format!("compiling the kernels for {arch} with NVRTC"), e))?
        .to_src();
    if let (Some(d), Some(f)) = (dir, file) {
        // A cache that cannot be written only costs the next start a compile.
        let tmp = d.join(format!(".kernels-{key:016x}.{}.tmp", std::process::id()));
        if std::fs::create_dir_all(&d).is_ok() && std::fs::write(&tmp, &ptx).is_ok() {
            let _ = std::fs::rename(&tmp, &f);
        }
    }
    Ok((ptx, true))
}

/// `BROOK_HOME/cuda` (or the default store's).
fn cache_dir() -> Option<PathBuf> {
    brook_core::store::Store::from_env()
        .ok()
        .map(|s| s.root().join("cuda"))
}
