//! Puts the commit brook was built from into `BROOK_COMMIT` (`brook --version`, bench rows),
//! so a figure measured with a binary names the code it ran, wherever the binary went. A
//! build outside a git checkout (or without git) says `unknown`.

use std::path::PathBuf;
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    let s = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (out.status.success() && !s.is_empty()).then_some(s)
}

fn main() {
    let commit = git(&["rev-parse", "--short=7", "HEAD"]).unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=BROOK_COMMIT={commit}");
    // Build again when HEAD moves: HEAD itself, the branch it names, the packed refs.
    if let Some(dir) = git(&["rev-parse", "--absolute-git-dir"]).map(PathBuf::from) {
        println!("cargo:rerun-if-changed={}", dir.join("HEAD").display());
        if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
            let f = dir.join(branch);
            if f.exists() {
                println!("cargo:rerun-if-changed={}", f.display());
            }
        }
        let packed = dir.join("packed-refs");
        if packed.exists() {
            println!("cargo:rerun-if-changed={}", packed.display());
        }
    }
    println!("cargo:rerun-if-changed=build.rs");
}
