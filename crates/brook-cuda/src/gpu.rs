//! The device: driver and NVRTC loaded at run time, one context and stream, the kernels
//! compiled for the device found (`nvrtc.rs`, cached on disk), device and pinned host buffers
//! that free themselves, and kernel launches with their arguments.
//!
//! Everything here goes through cudarc's thin `result`/`sys` layer: brook keeps its own
//! device pointers (the expert slot table holds raw addresses), so the safe layer's
//! per-allocation stream tracking would only add work to every launch.

use std::ffi::{CString, c_void};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use brook_core::experts::budget::fmt_bytes;
use brook_core::{Error, Result};
use cudarc::driver::{result, sys};

use crate::args::MAX_ARGS;
pub use crate::args::{Args, KernelArg};
pub use crate::buffers::{DevBuf, Pinned};
pub use crate::functions::{Kernel, Kernels, SOURCE};
use crate::nvrtc::ptx_for;

/// A GPU error as a brook error, naming what was being done.
pub fn err(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Device(format!("{what}: {e}"))
}

/// Is a CUDA driver and NVRTC loadable here? Never panics.
pub fn libraries_present() -> std::result::Result<(), String> {
    // SAFETY: these only try to dlopen the libraries and report whether that worked.
    let driver = unsafe { sys::is_culib_present() };
    if !driver {
        return Err(
            "no CUDA driver found (libcuda.so); install the NVIDIA driver or use --backend cpu"
                .into(),
        );
    }
    // SAFETY: as above.
    let nvrtc = unsafe { cudarc::nvrtc::sys::is_culib_present() };
    if !nvrtc {
        return Err("the CUDA driver is present but NVRTC (libnvrtc.so) is not; install the CUDA toolkit's NVRTC or use --backend cpu".into());
    }
    Ok(())
}

/// One device with its context, stream, compiled kernels and a running count of device
/// memory held (checked against the budget on every allocation).
#[derive(Debug)]
pub struct Gpu {
    pub(crate) ctx: sys::CUcontext,
    dev: sys::CUdevice,
    pub stream: sys::CUstream,
    pub k: Kernels,
    pub name: String,
    pub cc: (i32, i32),
    pub sms: i32,
    /// Dynamic shared memory one block may use (bytes).
    pub max_smem: u32,
    pub budget: u64,
    pub(crate) used: AtomicU64,
    module: sys::CUmodule,
    /// Seconds NVRTC took (0 when the disk cache had the kernels).
    pub compile_s: f64,
    /// Launch kernels with programmatic dependent launch (Hopper and later, unless
    /// `BROOK_CUDA_PDL=0`): a kernel may start while the one before it finishes.
    pub pdl: bool,
    /// The delta rule prepares a decoded token's q/k heads and gates in its own launch
    /// (unless `BROOK_CUDA_RULE_PREP=0`; see delta.rs).
    pub rule_prep: bool,
    /// The delta rule norms and gates a decoded token's outputs in its own launch
    /// (unless `BROOK_CUDA_RULE_NORM=0`).
    pub rule_norm: bool,
    /// Lanes a state column of the token-by-token delta rule at key width 128 is split over
    /// (`switches::rule_split`; the tests try each).
    rule_split: AtomicUsize,
    /// The most warps a tensor-core gate/up tile is split over (`BROOK_CUDA_GATEUP_SPLIT`).
    pub gateup_split: usize,
    /// Blocks an SM the grouped expert kernels' grids aim at, gate/up and down
    /// (`switches::grouped_blocks`).
    pub grouped_blocks: (usize, usize),
    /// Use the tensor-core matrix-vector kernels where they fit (Ampere and later, unless
    /// `BROOK_CUDA_TC=0`; see kernels/tensor.cu).
    tensor_cores: AtomicBool,
    /// Whether the work being queued uses it now (see [`Gpu::overlap_launches`]).
    pdl_now: AtomicBool,
    /// The last work queued on the stream was a kernel (only then may the next overlap it).
    after_kernel: AtomicBool,
    /// A second stream for work beside the main one (the experts' prefetch), forked from and
    /// joined to it by `fork` and `join` (inside a graph's capture too).
    side: sys::CUstream,
    /// Launches go to the side stream (between [`Gpu::fork`] and [`Gpu::join_record`]).
    on_side: AtomicBool,
    /// Events of the fork and of the join.
    forked: sys::CUevent,
    joined: sys::CUevent,
    /// Lets go of memory held for later (see [`Gpu::set_reclaim`]).
    reclaim: std::sync::Mutex<Option<Reclaim>>,
}

/// What an allocation that would fail calls first: frees memory kept for reuse and says
/// whether it freed any.
pub struct Reclaim(pub Box<dyn Fn() -> bool + Send + Sync>);

impl std::fmt::Debug for Reclaim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Reclaim")
    }
}

// SAFETY: the context, stream and module handles are plain driver handles, valid from any
// thread once the context is made current there (every entry point does so).
unsafe impl Send for Gpu {}
// SAFETY: as above; mutation happens through the driver, which is thread-safe.
unsafe impl Sync for Gpu {}

impl Gpu {
    /// Opens device `ordinal`, compiles (or loads from the disk cache) the kernels and
    /// creates the stream. `budget` caps device memory; `None` allows what is free now.
    pub fn open(ordinal: usize, budget: Option<u64>) -> Result<Arc<Gpu>> {
        libraries_present().map_err(Error::Device)?;
        result::init().map_err(|e| err("initialising the CUDA driver", e))?;
        let count = result::device::get_count().map_err(|e| err("counting GPUs", e))?;
        if count <= ordinal as i32 {
            return Err(Error::Device(format!(
                "no CUDA GPU {ordinal} (found {count}); use --backend cpu"
            )));
        }
        let dev = result::device::get(ordinal as i32).map_err(|e| err("opening the GPU", e))?;
        // SAFETY: dev is a valid device handle; the primary context is released in Drop.
        let ctx = unsafe { result::primary_ctx::retain(dev) }
            .map_err(|e| err("creating a CUDA context", e))?;
        // SAFETY: ctx was just retained.
        unsafe { result::ctx::set_current(ctx) }.map_err(|e| err("binding the context", e))?;
        let name = result::device::get_name(dev).unwrap_or_else(|_| "CUDA GPU".into());
        let attr = |a| {
            // SAFETY: a valid device and attribute enum.
            unsafe { result::device::get_attribute(dev, a) }.map_err(|e| err("device query", e))
        };
        let cc = (
            attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        );
        let sms = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        let (free, _total) = result::mem_get_info().map_err(|e| err("reading free memory", e))?;
        let budget = budget.unwrap_or(free as u64);
        let t = std::time::Instant::now();
        let (ptx, compiled) = ptx_for(&name, cc)?;
        let compile_s = if compiled {
            t.elapsed().as_secs_f64()
        } else {
            0.0
        };
        let ptx_c = CString::new(ptx).map_err(|e| err("kernel image", e))?;
        // SAFETY: a NUL-terminated PTX image; the module is unloaded in Drop.
        let module = unsafe { result::module::load_data(ptx_c.as_ptr() as *const c_void) }
            .map_err(|e| err("loading the kernels", e))?;
        // The matrix-vector kernels stage their activations in dynamic shared memory and the
        // chunked delta rule its chunk (134 KiB at dk = 128): allow them what the device
        // offers, less 1 KiB for any static shared memory of their own (the limit counts
        // both, and the attribute is refused past it).
        let max_smem =
            attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?
                - 1024;
        let k = Kernels::load(module, max_smem)?;
        let stream = result::stream::create(result::stream::StreamKind::NonBlocking)
            .map_err(|e| err("creating a stream", e))?;
        // The side stream at the highest priority: its few blocks (a prefetch's copies, which
        // mostly wait on PCIe) take SMs as they free up, beside the main stream's kernels.
        let (mut least, mut greatest) = (0, 0);
        let mut side: sys::CUstream = std::ptr::null_mut();
        // SAFETY: out-pointers to locals; the context is current.
        unsafe {
            sys::cuCtxGetStreamPriorityRange(&mut least, &mut greatest)
                .result()
                .map_err(|e| err("reading stream priorities", e))?;
            sys::cuStreamCreateWithPriority(
                &mut side,
                sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
                greatest,
            )
            .result()
            .map_err(|e| err("creating a stream", e))?;
        }
        let event = || {
            result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                .map_err(|e| err("creating an event", e))
        };
        let (forked, joined) = (event()?, event()?);
        Ok(Arc::new(Gpu {
            ctx,
            dev,
            stream,
            k,
            name,
            cc,
            sms,
            max_smem: max_smem as u32,
            budget,
            used: AtomicU64::new(0),
            module,
            compile_s,
            pdl: cc.0 >= 9 && crate::switches::pdl(),
            rule_prep: crate::switches::rule_prep(),
            rule_norm: crate::switches::rule_norm(),
            rule_split: AtomicUsize::new(crate::switches::rule_split()),
            gateup_split: crate::switches::gateup_split(),
            grouped_blocks: crate::switches::grouped_blocks(),
            tensor_cores: AtomicBool::new(cc.0 >= 8 && crate::switches::tensor_cores()),
            pdl_now: AtomicBool::new(true),
            after_kernel: AtomicBool::new(false),
            side,
            on_side: AtomicBool::new(false),
            reclaim: std::sync::Mutex::new(None),
            forked,
            joined,
        }))
    }

    /// Makes this GPU's context current on the calling thread.
    pub fn bind(&self) -> Result<()> {
        // SAFETY: ctx stays retained while self lives.
        unsafe { result::ctx::set_current(self.ctx) }.map_err(|e| err("binding the context", e))
    }

    /// Whether one-token products use the tensor-core kernels where they fit.
    pub fn tensor_cores(&self) -> bool {
        self.tensor_cores.load(Ordering::Relaxed)
    }

    /// Turns the tensor-core kernels off (or back on, where the GPU has them): the tests
    /// check both paths against the reference.
    pub fn use_tensor_cores(&self, on: bool) {
        self.tensor_cores
            .store(on && self.cc.0 >= 8, Ordering::Relaxed);
    }

    /// Lanes a state column of the token-by-token delta rule at key width 128 is split over:
    /// 1, 2 or 4 (`switches::rule_split`).
    pub fn rule_split(&self) -> usize {
        self.rule_split.load(Ordering::Relaxed)
    }

    /// Sets [`Self::rule_split`] (1, 2 or 4; anything else is taken as 1): the tests check
    /// each against the reference. Not while a model's step is being captured or run.
    pub fn split_rule(&self, lanes: usize) {
        let lanes = if matches!(lanes, 2 | 4) { lanes } else { 1 };
        self.rule_split.store(lanes, Ordering::Relaxed);
    }

    /// Device memory held through this handle.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }

    /// Sets what [`Gpu::alloc`] calls before it fails (past the budget or out of device
    /// memory), then tries once more if that freed anything.
    pub fn set_reclaim(&self, r: Reclaim) {
        *self.reclaim.lock().unwrap_or_else(|p| p.into_inner()) = Some(r);
    }

    /// Allocates `bytes` of device memory, refusing past the budget.
    pub fn alloc(self: &Arc<Self>, bytes: usize, what: &str) -> Result<DevBuf> {
        match self.alloc_once(bytes, what) {
            Err(e) => {
                let r = self.reclaim.lock().unwrap_or_else(|p| p.into_inner());
                if r.as_ref().is_some_and(|r| (r.0)()) {
                    drop(r);
                    return self.alloc_once(bytes, what);
                }
                Err(e)
            }
            ok => ok,
        }
    }

    fn alloc_once(self: &Arc<Self>, bytes: usize, what: &str) -> Result<DevBuf> {
        let bytes = bytes.max(4);
        let now = self.used.fetch_add(bytes as u64, Ordering::Relaxed) + bytes as u64;
        if now > self.budget {
            self.used.fetch_sub(bytes as u64, Ordering::Relaxed);
            return Err(Error::Device(format!(
                "GPU memory budget {} is too small: {what} needs {} more ({} held); raise --gpu-memory-budget",
                fmt_bytes(self.budget),
                fmt_bytes(bytes as u64),
                fmt_bytes(now - bytes as u64)
            )));
        }
        // SAFETY: the context is current on this thread (callers bind first).
        match unsafe { result::malloc_sync(bytes) } {
            Ok(ptr) => Ok(DevBuf {
                gpu: self.clone(),
                ptr,
                bytes,
            }),
            Err(e) => {
                self.used.fetch_sub(bytes as u64, Ordering::Relaxed);
                Err(err(
                    &format!("allocating {} for {what}", fmt_bytes(bytes as u64)),
                    e,
                ))
            }
        }
    }

    /// Device buffer holding `data`.
    pub fn upload<T: Copy>(self: &Arc<Self>, data: &[T], what: &str) -> Result<DevBuf> {
        let b = self.alloc(std::mem::size_of_val(data), what)?;
        b.write(data)?;
        Ok(b)
    }

    /// A zeroed device buffer.
    pub fn zeros(self: &Arc<Self>, bytes: usize, what: &str) -> Result<DevBuf> {
        let b = self.alloc(bytes, what)?;
        b.zero()?;
        Ok(b)
    }

    /// Waits for all work queued on the stream.
    pub fn sync(&self) -> Result<()> {
        // SAFETY: a live stream.
        unsafe { result::stream::synchronize(self.stream) }.map_err(|e| err("running kernels", e))
    }

    /// Launches `f` on the stream.
    pub fn launch(
        &self,
        f: Kernel,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        args: &mut Args,
    ) -> Result<()> {
        let mut ptrs = [std::ptr::null_mut::<c_void>(); MAX_ARGS];
        for (i, p) in ptrs.iter_mut().enumerate().take(args.n) {
            *p = args.store[i].as_mut_ptr() as *mut c_void;
        }
        // The side stream's launches never overlap; on the main stream, only a kernel that
        // follows a kernel does (copies and events keep full ordering).
        let side = self.on_side.load(Ordering::Relaxed);
        let after = !side && self.after_kernel.swap(true, Ordering::Relaxed);
        if self.pdl && after && self.pdl_now.load(Ordering::Relaxed) {
            // SAFETY: plain data; every field used is set below.
            let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
            attr.id =
                sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attr.value.programmaticStreamSerializationAllowed = 1;
            let cfg = sys::CUlaunchConfig {
                gridDimX: grid.0,
                gridDimY: grid.1,
                gridDimZ: grid.2,
                blockDimX: block,
                blockDimY: 1,
                blockDimZ: 1,
                sharedMemBytes: smem,
                hStream: self.stream,
                attrs: &mut attr,
                numAttrs: 1,
            };
            // SAFETY: as below; every kernel of the module waits (PDL_SYNC) before it reads
            // what the previous one wrote, so overlapping their launches is allowed.
            return unsafe {
                sys::cuLaunchKernelEx(&cfg, f.0, ptrs.as_mut_ptr(), std::ptr::null_mut())
            }
            .result()
            .map_err(|e| err("launching a kernel", e));
        }
        let stream = if side { self.side } else { self.stream };
        // SAFETY: f is a kernel of our module; every argument was pushed in the order and
        // with the type the kernel declares (kernels/*.cu), and lives in `args` for the call.
        unsafe {
            result::launch_kernel(f.0, grid, (block, 1, 1), smem, stream, &mut ptrs[..args.n])
        }
        .map_err(|e| err("launching a kernel", e))
    }

    /// Turns programmatic dependent launch on or off for the launches that follow (where the
    /// device has it). The engine keeps it for one-token steps, where launch latency
    /// dominates, and turns it off for prefill chunks, which it slowed (H200, 35B pp512:
    /// 466 tok/s with it, 526 without; decode 161 with, 158 without, same run).
    pub fn overlap_launches(&self, on: bool) {
        self.pdl_now.store(on, Ordering::Relaxed);
    }

    /// Forks the side stream from the main one here: launches go to the side stream, after
    /// everything queued so far, until [`Gpu::join_record`].
    pub fn fork(&self) -> Result<()> {
        self.queued_other();
        // SAFETY: live event and stream.
        unsafe { result::event::record(self.forked, self.stream) }
            .map_err(|e| err("recording an event", e))?;
        self.wait_event(self.side, self.forked)?;
        self.on_side.store(true, Ordering::Relaxed);
        Ok(())
    }

    /// Ends the side stream's work since [`Gpu::fork`]; launches go to the main stream again.
    /// [`Gpu::join_wait`] makes the main stream wait for that work.
    pub fn join_record(&self) -> Result<()> {
        self.on_side.store(false, Ordering::Relaxed);
        // SAFETY: live event and stream.
        unsafe { result::event::record(self.joined, self.side) }
            .map_err(|e| err("recording an event", e))
    }

    /// The main stream waits, from here, for the side stream's work up to the last
    /// [`Gpu::join_record`].
    pub fn join_wait(&self) -> Result<()> {
        self.queued_other();
        self.wait_event(self.stream, self.joined)
    }

    /// `stream` waits, from here, for `event` (one of this GPU's streams and events).
    fn wait_event(&self, stream: sys::CUstream, event: sys::CUevent) -> Result<()> {
        // SAFETY: live event and stream, both this GPU's.
        unsafe {
            result::stream::wait_event(
                stream,
                event,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .map_err(|e| err("waiting for an event", e))
    }

    /// Notes that work other than a kernel (a copy, an event, a graph) was queued: the next
    /// kernel launches with full ordering.
    pub fn queued_other(&self) {
        self.after_kernel.store(false, Ordering::Relaxed);
    }

    /// Copies `bytes` from host memory into device memory asynchronously. The host memory
    /// must stay untouched until the stream passes this point (pinned memory for overlap).
    ///
    /// # Safety
    /// `src` must be valid for `bytes` until the copy has run; `dst` must be device memory of
    /// at least `bytes`.
    pub unsafe fn copy_in_async(&self, dst: u64, src: *const u8, bytes: usize) -> Result<()> {
        self.queued_other();
        // SAFETY: by the caller's contract.
        unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src as *const c_void, bytes, self.stream) }
            .result()
            .map_err(|e| err("copying to the GPU", e))
    }

    /// Copies device memory to the host, waiting for the stream first.
    pub fn copy_out<T: Copy>(&self, src: u64, dst: &mut [T]) -> Result<()> {
        self.queued_other();
        // SAFETY: dst is a valid host slice; src holds at least that many bytes (callers).
        unsafe {
            sys::cuMemcpyDtoHAsync_v2(
                dst.as_mut_ptr() as *mut c_void,
                src,
                std::mem::size_of_val(dst),
                self.stream,
            )
        }
        .result()
        .map_err(|e| err("copying from the GPU", e))?;
        self.sync()
    }

    /// Device-to-device copy on the stream.
    pub fn copy_dd(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        self.queued_other();
        // SAFETY: both are device allocations of at least `bytes` (callers).
        unsafe { result::memcpy_dtod_async(dst, src, bytes, self.stream) }
            .map_err(|e| err("copying on the GPU", e))
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        // SAFETY: handles created in open, destroyed once; errors at teardown are ignored.
        unsafe {
            let _ = result::ctx::set_current(self.ctx);
            let _ = result::stream::synchronize(self.stream);
            let _ = result::stream::synchronize(self.side);
            let _ = result::stream::destroy(self.stream);
            let _ = result::stream::destroy(self.side);
            let _ = result::event::destroy(self.forked);
            let _ = result::event::destroy(self.joined);
            let _ = result::module::unload(self.module);
            let _ = result::primary_ctx::release(self.dev);
        }
    }
}

/// Device copy bandwidth (bytes read plus written) and pinned host-to-device bandwidth,
/// GB/s: the best of a few 512 MiB copies each.
pub fn measure_bandwidth(gpu: &Arc<Gpu>) -> Result<(f64, f64)> {
    const N: usize = 512 << 20;
    let a = gpu.zeros(N, "bandwidth test")?;
    let b = gpu.zeros(N, "bandwidth test")?;
    let host = Pinned::new(gpu, N)?;
    gpu.sync()?;
    let (mut dd, mut hd) = (0.0f64, 0.0f64);
    for _ in 0..5 {
        let t = std::time::Instant::now();
        gpu.copy_dd(b.ptr, a.ptr, N)?;
        gpu.sync()?;
        dd = dd.max(2.0 * N as f64 / t.elapsed().as_secs_f64() / 1e9);
        let t = std::time::Instant::now();
        // SAFETY: pinned buffer of N bytes, waited for below.
        unsafe { gpu.copy_in_async(a.ptr, host.ptr(), N)? };
        gpu.sync()?;
        hd = hd.max(N as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    Ok((dd, hd))
}
