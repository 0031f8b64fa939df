//! Memory budgets: parsing sizes, reading the machine's limits, and splitting a budget between
//! the resident model and the expert cache.
//!
//! The budget covers everything the process holds: its own baseline (binary, libraries,
//! allocator), the dense weights, per-sequence state for the context asked for, scratch, and
//! expert slots. Without an explicit budget brook sizes itself from the cgroup limit (v2
//! `memory.max`, v1 `memory.limit_in_bytes`) and `MemAvailable`, whichever is smaller.

use std::path::Path;

use crate::error::{Error, Result};

/// Parses sizes like `3GiB`, `2.5G`, `512MiB`, `800M`, `1073741824`.
/// `G`/`M`/`K` alone mean GiB/MiB/KiB, as in `ulimit` and llama.cpp; `GB`/`MB` are decimal.
pub fn parse_size(s: &str) -> Result<u64> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = num
        .parse()
        .map_err(|_| Error::Invalid(format!("`{s}` is not a size (try 3GiB, 2.5G or 800MiB)")))?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "kb" => 1e3,
        "m" | "mib" => 1024.0 * 1024.0,
        "mb" => 1e6,
        "g" | "gib" => 1024.0 * 1024.0 * 1024.0,
        "gb" => 1e9,
        "t" | "tib" => 1024f64.powi(4),
        "tb" => 1e12,
        other => {
            return Err(Error::Invalid(format!(
                "`{s}`: unknown size unit `{other}` (use KiB, MiB, GiB, or K, M, G)"
            )));
        }
    };
    if !value.is_finite() || value <= 0.0 {
        return Err(Error::Invalid(format!("`{s}` must be a positive size")));
    }
    Ok((value * mult) as u64)
}

/// Human-readable bytes in GiB/MiB.
pub fn fmt_bytes(b: u64) -> String {
    if b >= 1 << 30 {
        format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
    } else {
        format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)
    }
}

/// The memory limit of this process's cgroup, if any (v2 then v1).
pub fn cgroup_limit() -> Option<u64> {
    cgroup_limit_at(
        Path::new("/sys/fs/cgroup"),
        &std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default(),
    )
}

/// [`cgroup_limit`] against a given cgroup mount and `/proc/self/cgroup` text (for tests).
pub fn cgroup_limit_at(root: &Path, proc_cgroup: &str) -> Option<u64> {
    let read = |p: &Path| -> Option<u64> {
        let s = std::fs::read_to_string(p).ok()?;
        let s = s.trim();
        if s == "max" {
            return None;
        }
        let v: u64 = s.parse().ok()?;
        // v1 reports "no limit" as a huge page-rounded number.
        (v < (1u64 << 60)).then_some(v)
    };
    for line in proc_cgroup.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        let rel = path.trim_start_matches('/');
        if controllers.is_empty() {
            // cgroup v2: walk up from our group, the tightest limit wins.
            let mut best: Option<u64> = None;
            let mut dir = root.join(rel);
            loop {
                if let Some(v) = read(&dir.join("memory.max")) {
                    best = Some(best.map_or(v, |b: u64| b.min(v)));
                }
                if dir == root || !dir.pop() {
                    break;
                }
            }
            if best.is_some() {
                return best;
            }
        } else if controllers.split(',').any(|c| c == "memory") {
            for base in [root.join("memory").join(rel), root.join("memory")] {
                if let Some(v) = read(&base.join("memory.limit_in_bytes")) {
                    return Some(v);
                }
            }
        }
    }
    read(&root.join("memory.max")).or_else(|| read(&root.join("memory/memory.limit_in_bytes")))
}

/// `MemAvailable` from /proc/meminfo.
pub fn mem_available() -> Option<u64> {
    meminfo("MemAvailable:")
}

/// The field `key` (with its colon, e.g. `AnonHugePages:`) of /proc/meminfo, in bytes.
pub fn meminfo(key: &str) -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    meminfo_field(&s, key)
}

fn meminfo_field(s: &str, key: &str) -> Option<u64> {
    let line = s.lines().find(|l| l.starts_with(key))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// CPU seconds (user and system) this process has used so far, all threads together, from
/// /proc/self/stat (0 where it cannot be read). Threads blocked on a read use none.
pub fn cpu_seconds() -> f64 {
    let Ok(s) = std::fs::read_to_string("/proc/self/stat") else {
        return 0.0;
    };
    // Fields after the command name (which may hold spaces, so split after its ')'):
    // utime and stime are the 12th and 13th, in clock ticks.
    let Some(rest) = s.rsplit_once(')').map(|(_, r)| r) else {
        return 0.0;
    };
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    // SAFETY: sysconf reads a constant of the system; no memory is passed.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let hz = if hz > 0 { hz as f64 } else { 100.0 };
    (ticks(11) + ticks(12)) as f64 / hz
}

/// This process's current and peak resident set (VmRSS, VmHWM).
pub fn rss() -> (u64, u64) {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    (
        meminfo_field(&s, "VmRSS:").unwrap_or(0),
        meminfo_field(&s, "VmHWM:").unwrap_or(0),
    )
}

/// The budget brook uses when none is given: 90% of min(cgroup limit, what the process holds
/// now + MemAvailable), leaving room for the page cache and the rest of the system.
pub fn automatic_budget() -> Option<u64> {
    let avail = mem_available().map(|a| a + rss().0);
    let limit = match (cgroup_limit(), avail) {
        (Some(c), Some(a)) => c.min(a),
        (c, a) => c.or(a)?,
    };
    Some(limit / 10 * 9)
}

/// What a model needs besides expert slots, and how many slots the rest of a budget buys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub budget: u64,
    /// Process baseline measured before loading (binary, libraries, runtime).
    pub baseline: u64,
    pub dense: u64,
    /// Per-sequence state and scratch for the context length asked for.
    pub state: u64,
    /// Fixed allowance for allocator slack, I/O threads and small structures.
    pub overhead: u64,
    /// Bytes of one expert slot (largest stride).
    pub slot_bytes: u64,
    /// Slots the budget pays for, capped at the number of experts.
    pub slots: usize,
}

impl Plan {
    /// Splits `budget`; refuses one that cannot hold the dense core and `min_slots` slots.
    pub fn new(
        budget: u64,
        baseline: u64,
        dense: u64,
        state: u64,
        slot_bytes: u64,
        min_slots: usize,
        max_slots: usize,
    ) -> Result<Self> {
        // Allocator slack, I/O thread stacks and transient load buffers: measured VmHWM on a
        // 100 MiB budget stays 10% under with this allowance (tests/cli.rs).
        let overhead = (16 << 20) + budget / 64;
        let fixed = baseline + dense + state + overhead;
        let minimum = fixed + slot_bytes * min_slots as u64;
        if budget < minimum {
            return Err(Error::Invalid(format!(
                "memory budget {} is too small: this model needs at least {} (dense core {}, state and scratch {}, {} expert slots {}, runtime {}); raise --memory-budget, or lower --context, --prefill-chunk or --parallel",
                fmt_bytes(budget),
                fmt_bytes(minimum),
                fmt_bytes(dense),
                fmt_bytes(state),
                min_slots,
                fmt_bytes(slot_bytes * min_slots as u64),
                fmt_bytes(baseline + overhead),
            )));
        }
        let slots = (((budget - fixed) / slot_bytes.max(1)) as usize).min(max_slots);
        Ok(Plan {
            budget,
            baseline,
            dense,
            state,
            overhead,
            slot_bytes,
            slots,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_seconds_grow_with_work() {
        let t0 = cpu_seconds();
        let start = std::time::Instant::now();
        let mut x = 0u64;
        while start.elapsed().as_millis() < 300 {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
        }
        std::hint::black_box(x);
        let used = cpu_seconds() - t0;
        assert!(
            used > 0.1 && used < 30.0,
            "{used} CPU seconds for 0.3 s of spinning"
        );
    }

    #[test]
    fn sizes_parse_like_users_write_them() {
        assert_eq!(parse_size("3GiB").ok(), Some(3 << 30));
        assert_eq!(parse_size("3G").ok(), Some(3 << 30));
        assert_eq!(parse_size("2.5GiB").ok(), Some(5 << 29));
        assert_eq!(parse_size("800MB").ok(), Some(800_000_000));
        assert_eq!(parse_size("512 MiB").ok(), Some(512 << 20));
        assert_eq!(parse_size("1024").ok(), Some(1024));
        assert!(parse_size("lots").is_err());
        assert!(parse_size("3 parsecs").is_err());
        assert!(parse_size("-1G").is_err());
        assert!(parse_size("0").is_err());
    }

    #[test]
    fn cgroup_v2_and_v1_limits_are_found() {
        let d = std::env::temp_dir().join(format!("brook-cg-{}", std::process::id()));
        let v2 = d.join("v2");
        std::fs::create_dir_all(v2.join("user.slice/app")).ok();
        std::fs::write(v2.join("user.slice/memory.max"), "4294967296\n").ok();
        std::fs::write(v2.join("user.slice/app/memory.max"), "max\n").ok();
        assert_eq!(cgroup_limit_at(&v2, "0::/user.slice/app\n"), Some(4 << 30));
        let v1 = d.join("v1");
        std::fs::create_dir_all(v1.join("memory/docker/abc")).ok();
        std::fs::write(
            v1.join("memory/docker/abc/memory.limit_in_bytes"),
            "2147483648\n",
        )
        .ok();
        let proc = "12:cpu,cpuacct:/docker/abc\n9:memory:/docker/abc\n";
        assert_eq!(cgroup_limit_at(&v1, proc), Some(2 << 30));
        std::fs::write(
            v1.join("memory/docker/abc/memory.limit_in_bytes"),
            "9223372036854771712\n",
        )
        .ok();
        assert_eq!(cgroup_limit_at(&v1, proc), None);
        std::fs::remove_dir_all(&d).ok();
    }

    #[test]
    fn a_budget_below_the_dense_core_names_the_minimum() {
        let e = Plan::new(1 << 30, 20 << 20, 1300 << 20, 50 << 20, 1 << 20, 8, 10240)
            .expect_err("too small");
        let msg = e.to_string();
        assert!(msg.contains("at least 1.38 GiB"), "{msg}");
        let p =
            Plan::new(3 << 30, 20 << 20, 1300 << 20, 50 << 20, 1 << 20, 8, 10240).expect("fits");
        assert!(p.slots > 1500);
    }
}
