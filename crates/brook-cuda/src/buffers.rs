//! GPU memory that frees itself: device buffers (counted against the GPU's budget) and
//! page-locked host buffers for asynchronous copies.

use std::ffi::c_void;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use brook_core::{Error, Result};
use cudarc::driver::{result, sys};

use crate::gpu::{Gpu, err};

/// Device memory that frees itself.
#[derive(Debug)]
pub struct DevBuf {
    pub(crate) gpu: Arc<Gpu>,
    pub ptr: u64,
    pub bytes: usize,
}

impl DevBuf {
    /// Writes `data` at the start (synchronously with respect to the host).
    pub fn write<T: Copy>(&self, data: &[T]) -> Result<()> {
        self.write_at(0, data)
    }

    /// Writes `data` at byte `offset`, waiting for the stream first so earlier kernels that
    /// read this buffer are done.
    pub fn write_at<T: Copy>(&self, offset: usize, data: &[T]) -> Result<()> {
        let n = std::mem::size_of_val(data);
        if offset + n > self.bytes {
            return Err(Error::Device(format!(
                "write of {n} bytes at {offset} past a {}-byte buffer",
                self.bytes
            )));
        }
        self.gpu.sync()?;
        self.gpu.queued_other();
        // SAFETY: in bounds (checked); synchronous copy from a live host slice.
        unsafe { sys::cuMemcpyHtoD_v2(self.ptr + offset as u64, data.as_ptr() as *const c_void, n) }
            .result()
            .map_err(|e| err("copying to the GPU", e))
    }

    /// Zeroes the buffer (queued on the stream).
    pub fn zero(&self) -> Result<()> {
        self.gpu.queued_other();
        // SAFETY: the buffer's own extent.
        unsafe { result::memset_d8_async(self.ptr, 0, self.bytes, self.gpu.stream) }
            .map_err(|e| err("clearing GPU memory", e))
    }

    /// Reads the whole buffer as `T`s.
    pub fn read<T: Copy + Default>(&self) -> Result<Vec<T>> {
        let mut v = vec![T::default(); self.bytes / std::mem::size_of::<T>()];
        self.gpu.copy_out(self.ptr, &mut v)?;
        Ok(v)
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        // SAFETY: allocated by malloc_sync and freed once; pending work on it is waited for.
        unsafe {
            let _ = result::ctx::set_current(self.gpu.ctx);
            let _ = result::stream::synchronize(self.gpu.stream);
            let _ = result::free_sync(self.ptr);
        }
        self.gpu
            .used
            .fetch_sub(self.bytes as u64, Ordering::Relaxed);
    }
}

/// Page-locked host memory, so copies to the GPU run asynchronously at full PCIe speed.
#[derive(Debug)]
pub struct Pinned {
    gpu: Arc<Gpu>,
    ptr: *mut u8,
    pub bytes: usize,
    /// Allocated here and registered with the driver ([`Pinned::new_mapped_huge`]), with
    /// this layout; else the driver's own allocation.
    registered: Option<std::alloc::Layout>,
}

/// The huge page size [`Pinned::new_mapped_huge`] aligns to.
const HUGE_PAGE: usize = 2 << 20;

unsafe extern "C" {
    fn madvise(addr: *mut c_void, len: usize, advice: i32) -> i32;
}
/// Linux's MADV_HUGEPAGE.
const MADV_HUGEPAGE: i32 = 14;

// SAFETY: plain host memory owned by this value.
unsafe impl Send for Pinned {}
// SAFETY: as above; shared access is read-only.
unsafe impl Sync for Pinned {}

impl Pinned {
    pub fn new(gpu: &Arc<Gpu>, bytes: usize) -> Result<Pinned> {
        gpu.bind()?;
        // SAFETY: a plain page-locked allocation, freed in Drop.
        let ptr = unsafe { result::malloc_host(bytes.max(64), 0) }
            .map_err(|e| err("allocating pinned host memory", e))? as *mut u8;
        Ok(Pinned {
            gpu: gpu.clone(),
            ptr,
            bytes,
            registered: None,
        })
    }

    /// Page-locked host memory mapped into the GPU's address space: kernels read it over
    /// PCIe at [`Pinned::device_ptr`].
    pub fn new_mapped(gpu: &Arc<Gpu>, bytes: usize) -> Result<Pinned> {
        gpu.bind()?;
        // SAFETY: a plain page-locked allocation, freed in Drop.
        let ptr = unsafe { result::malloc_host(bytes.max(64), sys::CU_MEMHOSTALLOC_DEVICEMAP) }
            .map_err(|e| err("allocating mapped pinned host memory", e))?
            as *mut u8;
        Ok(Pinned {
            gpu: gpu.clone(),
            ptr,
            bytes,
            registered: None,
        })
    }

    /// As [`Pinned::new_mapped`], but allocated here on 2 MiB boundaries, advised into
    /// transparent huge pages (where the kernel gives them) and registered with the driver,
    /// so the GPU's reads of it cross fewer page translations (`BROOK_CUDA_HOST_HUGE=1`; an
    /// experiment for the hosts whose kernels read mapped memory slower than the copy engine
    /// does, docs/bench/2026-12-06.md).
    pub fn new_mapped_huge(gpu: &Arc<Gpu>, bytes: usize) -> Result<Pinned> {
        gpu.bind()?;
        let size = bytes.max(64).next_multiple_of(HUGE_PAGE);
        let layout = std::alloc::Layout::from_size_align(size, HUGE_PAGE)
            .map_err(|e| Error::Invalid(format!("page-locking {bytes} bytes: {e}")))?;
        // SAFETY: a non-zero size; freed in Drop with the same layout.
        let ptr = unsafe { std::alloc::alloc(layout) };
        if ptr.is_null() {
            return Err(Error::Invalid(format!(
                "could not allocate {bytes} bytes of host memory to page-lock"
            )));
        }
        // SAFETY: the range is this allocation; the advice is a hint (ignored where huge
        // pages are off), and the zeroing faults every page in after it.
        unsafe {
            madvise(ptr as *mut c_void, size, MADV_HUGEPAGE);
            std::ptr::write_bytes(ptr, 0, size);
        }
        // SAFETY: a live allocation of `size` bytes of this process, unregistered in Drop.
        let r = unsafe {
            sys::cuMemHostRegister_v2(ptr as *mut c_void, size, sys::CU_MEMHOSTREGISTER_DEVICEMAP)
        }
        .result();
        if let Err(e) = r {
            // SAFETY: allocated above with this layout, never registered.
            unsafe { std::alloc::dealloc(ptr, layout) };
            return Err(err("registering huge-page host memory", e));
        }
        Ok(Pinned {
            gpu: gpu.clone(),
            ptr,
            bytes,
            registered: Some(layout),
        })
    }

    /// The GPU's address of this memory (allocated by [`Pinned::new_mapped`]).
    pub fn device_ptr(&self) -> Result<u64> {
        let mut d: sys::CUdeviceptr = 0;
        // SAFETY: ptr is a live page-locked allocation of this context.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut d, self.ptr as *mut c_void, 0) }
            .result()
            .map_err(|e| err("mapping pinned host memory into the GPU", e))?;
        Ok(d)
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr holds `bytes` bytes owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr, self.bytes) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, exclusively borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.bytes) }
    }

    pub fn ptr(&self) -> *const u8 {
        self.ptr
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: allocated by malloc_host, or here and registered (with this layout); copies
        // from it are waited for first.
        unsafe {
            let _ = result::ctx::set_current(self.gpu.ctx);
            let _ = result::stream::synchronize(self.gpu.stream);
            match self.registered {
                Some(layout) => {
                    let _ = sys::cuMemHostUnregister(self.ptr as *mut c_void);
                    std::alloc::dealloc(self.ptr, layout);
                }
                None => {
                    let _ = result::free_host(self.ptr as *mut c_void);
                }
            }
        }
    }
}

/// Logits read back from the GPU through page-locked staging: one DMA at full PCIe speed,
/// then one host copy into the caller's vectors. A copy into pageable memory goes through the
/// driver's own staging in pieces, and the batched step's fresh vector for 16 sequences also
/// paged in and zeroed 16 MB every step. Grown on demand up to [`HostLogits::MAX_PINNED`];
/// beyond that (a prompt's logits for every token), or where memory can't be page-locked, a
/// plain copy through a vector of the call's own, so nothing that large stays held.
#[derive(Debug, Default)]
pub struct HostLogits {
    pinned: Option<Pinned>,
    /// Page-locking failed once: plain copies from then on.
    unpinned: bool,
}

impl HostLogits {
    /// The most staging kept page-locked.
    pub const MAX_PINNED: usize = 64 << 20;

    /// Hands `take` the `floats` values at `src` on the GPU, once the stream has reached them.
    pub fn read(
        &mut self,
        gpu: &Arc<Gpu>,
        src: u64,
        floats: usize,
        take: impl FnOnce(&[f32]),
    ) -> Result<()> {
        let bytes = floats * 4;
        let pin = bytes <= Self::MAX_PINNED && !self.unpinned;
        if pin && self.pinned.as_ref().is_none_or(|p| p.bytes < bytes) {
            self.pinned = None;
            match Pinned::new(gpu, bytes) {
                Ok(p) => self.pinned = Some(p),
                Err(e) => {
                    tracing::debug!("page-locked staging for logits: {e}; copying plainly");
                    self.unpinned = true;
                }
            }
        }
        if let Some(p) = self.pinned.as_mut().filter(|_| pin) {
            gpu.copy_out(src, &mut p.as_mut_slice()[..bytes])?;
            // SAFETY: page-locked allocations are page-aligned and hold `bytes` bytes, just
            // written; any bits are a float.
            take(unsafe { std::slice::from_raw_parts(p.ptr() as *const f32, floats) });
            return Ok(());
        }
        let mut plain = vec![0.0f32; floats];
        gpu.copy_out(src, &mut plain)?;
        take(&plain);
        Ok(())
    }
}

/// Appends row i of `all` (rows of `v` floats) to `outs[i]` where it is `Some`. Many rows
/// (a batched step's logits: 16 MB for 16 sequences of a 248k vocabulary) are copied on
/// several threads: one thread copies out of page-locked memory at a few GB/s, and that copy
/// took 2.4 of a 15.1 ms step of 16 sequences on the H200's host (docs/BENCH.md).
pub fn spread_rows(all: &[f32], v: usize, outs: &mut [Option<&mut Vec<f32>>]) {
    let rows = outs.iter().filter(|o| o.is_some()).count();
    let threads = if rows * v * 4 < SPREAD_MIN_BYTES {
        1
    } else {
        std::thread::available_parallelism()
            .map_or(1, |p| p.get() / 2)
            .clamp(1, SPREAD_MAX_THREADS)
            .min(rows)
    };
    copy_rows(all, v, outs, threads);
}

/// [`spread_rows`] on `threads` threads (the caller's among them).
fn copy_rows(all: &[f32], v: usize, outs: &mut [Option<&mut Vec<f32>>], threads: usize) {
    let copy = |outs: &mut [Option<&mut Vec<f32>>], all: &[f32]| {
        for (o, row) in outs.iter_mut().zip(all.chunks_exact(v)) {
            if let Some(o) = o {
                o.extend_from_slice(row);
            }
        }
    };
    if threads <= 1 {
        copy(outs, all);
        return;
    }
    let per = outs.len().div_ceil(threads);
    std::thread::scope(|sc| {
        let mut parts = outs.chunks_mut(per).zip(all.chunks(per * v));
        let first = parts.next();
        for (o, a) in parts {
            sc.spawn(move || copy(o, a));
        }
        if let Some((o, a)) = first {
            copy(o, a);
        }
    });
}

/// Below this many bytes [`spread_rows`] copies on the calling thread.
const SPREAD_MIN_BYTES: usize = 4 << 20;
/// The most threads [`spread_rows`] copies on.
const SPREAD_MAX_THREADS: usize = 8;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_spread_to_each_wanted_vector_on_one_thread_or_several() {
        // Small and past SPREAD_MIN_BYTES; rows skipped; vectors that already hold values.
        for (n, v) in [(3, 5), (9, 200_003)] {
            let all: Vec<f32> = (0..n * v).map(|i| i as f32).collect();
            for threads in [0, 1, 3, 8, 20] {
                let mut vecs: Vec<Vec<f32>> = (0..n).map(|i| vec![-1.0; i % 2]).collect();
                let mut outs: Vec<Option<&mut Vec<f32>>> = vecs
                    .iter_mut()
                    .enumerate()
                    .map(|(i, o)| (i % 3 != 1).then_some(o))
                    .collect();
                if threads == 0 {
                    spread_rows(&all, v, &mut outs);
                } else {
                    copy_rows(&all, v, &mut outs, threads);
                }
                for (i, o) in vecs.iter().enumerate() {
                    let mut want = vec![-1.0; i % 2];
                    if i % 3 != 1 {
                        want.extend_from_slice(&all[i * v..(i + 1) * v]);
                    }
                    assert!(*o == want, "row {i} of {n} on {threads} threads");
                }
            }
        }
    }
}
