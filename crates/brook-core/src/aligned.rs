//! Heap buffers aligned for direct I/O and SIMD loads, and huge pages for dense weights.
//!
//! `O_DIRECT` reads need the destination, offset and length aligned to the device's logical
//! block (4 KiB covers every disk brook meets); expert slots are allocated here once and reused.
//!
//! Dense weights are read whole every token. On 4 KiB pages each 4 KiB of them costs a TLB
//! miss whose page-table walk itself misses the cache (1.3 GB of weights need 2.6 MB of page
//! tables), and the hardware prefetchers start over at each page, so [`zeroed_vec`] advises
//! the kernel to back them with 2 MiB transparent huge pages (`MADV_HUGEPAGE`, which
//! Debian's default `madvise` THP mode waits for) before they are read in. Where the kernel
//! has no THP the advice fails and is ignored.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::ptr::NonNull;

/// Alignment of every buffer: one 4 KiB page, enough for O_DIRECT and any SIMD width.
pub const ALIGN: usize = 4096;

/// One transparent huge page; [`AlignedBuf`]s of at least this size are mapped directly.
pub const HUGE: usize = 2 << 20;

/// Advises the kernel to back `buf`'s whole 2 MiB pages with transparent huge pages. Call it
/// before the memory is first written (a fresh `vec![0u8; n]` of this size is an untouched
/// mapping): pages already faulted in stay small until the kernel's background collapse.
pub fn advise_huge_pages(buf: &mut [u8]) {
    let (start, end) = (
        buf.as_mut_ptr() as usize,
        buf.as_mut_ptr() as usize + buf.len(),
    );
    let (a, b) = (start.next_multiple_of(HUGE), end / HUGE * HUGE);
    if b > a {
        // SAFETY: [a, b) lies inside `buf`, which this process owns; the advice changes how
        // the pages are backed, never their contents. Failure (no THP) leaves them as they are.
        unsafe {
            libc::madvise(a as *mut libc::c_void, b - a, libc::MADV_HUGEPAGE);
        }
    }
}

/// `len` zero bytes in a vector, on huge pages where it is large enough (see
/// [`advise_huge_pages`]); for weights read from a file.
pub fn zeroed_vec(len: usize) -> Vec<u8> {
    // Large zeroed allocations are fresh anonymous mappings, untouched until written.
    let mut v = vec![0u8; len];
    advise_huge_pages(&mut v);
    v
}

/// A zero-initialised, page-aligned, fixed-size byte buffer.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: AlignedBuf owns its allocation exclusively, like Box<[u8]>.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only reads; mutation needs &mut.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// Allocates `len` zero bytes (at least one page is reserved so the pointer is real).
    /// From [`HUGE`] bytes on, a private anonymous mapping: nothing is resident until written
    /// (the allocator would zero an over-aligned block by writing it).
    pub fn zeroed(len: usize) -> Self {
        let layout = Self::layout(len);
        if layout.size() >= HUGE {
            // SAFETY: a fresh private anonymous mapping; no existing memory is involved.
            let raw = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    layout.size(),
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            if raw == libc::MAP_FAILED {
                std::alloc::handle_alloc_error(layout);
            }
            let ptr = NonNull::new(raw.cast::<u8>())
                .unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
            return AlignedBuf { ptr, len };
        }
        // SAFETY: the layout has non-zero size and a power-of-two alignment.
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        AlignedBuf { ptr, len }
    }

    fn layout(len: usize) -> Layout {
        let size = len.max(1).div_ceil(ALIGN) * ALIGN;
        Layout::from_size_align(size, ALIGN)
            .unwrap_or_else(|_| panic!("buffer of {len} bytes is too large"))
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes reserved, rounded up to whole pages (what the allocator really holds).
    pub fn capacity(&self) -> usize {
        Self::layout(self.len).size()
    }
}

impl std::ops::Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: ptr is valid for len initialised bytes for the life of self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        let layout = Self::layout(self.len);
        if layout.size() >= HUGE {
            // SAFETY: mapped in `zeroed` with this same size, and unmapped only here.
            unsafe { libc::munmap(self.ptr.as_ptr().cast(), layout.size()) };
        } else {
            // SAFETY: allocated in `zeroed` with this same layout.
            unsafe { dealloc(self.ptr.as_ptr(), layout) }
        }
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedBuf({} bytes)", self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_small_and_mapped_are_zeroed_aligned_and_writable() {
        for len in [0, 1, 4095, 4097, HUGE - 1, HUGE, 3 * HUGE + 12345] {
            let mut b = AlignedBuf::zeroed(len);
            assert_eq!(b.len(), len);
            assert!((b.as_ptr() as usize).is_multiple_of(ALIGN), "len {len}");
            assert!(b.capacity() >= len && b.capacity().is_multiple_of(ALIGN));
            assert!(b.iter().all(|&v| v == 0), "len {len}");
            for (i, v) in b.iter_mut().enumerate() {
                *v = i as u8;
            }
            assert!(b.iter().enumerate().all(|(i, &v)| v == i as u8));
        }
        let mut v = zeroed_vec(HUGE * 2 + 3);
        assert!(v.iter().all(|&x| x == 0));
        v[HUGE] = 7;
        advise_huge_pages(&mut v[1..10]); // less than a huge page: nothing to advise
        assert_eq!(v[HUGE], 7);
    }
}
