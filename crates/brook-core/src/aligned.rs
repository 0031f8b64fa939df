//! Heap buffers aligned for direct I/O and SIMD loads, and huge pages for dense weights.
//!
//! `O_DIRECT` reads need the destination, offset and length aligned to the device's logical
//! block (4 KiB covers every disk brook meets); expert slots are allocated here once and reused.
//!
//! Weights are read whole every token. On 4 KiB pages each 4 KiB of them costs a TLB miss
//! whose page-table walk itself misses the cache (1.3 GB of weights need 2.6 MB of page
//! tables; under a hypervisor the walk is two-dimensional), and the hardware prefetchers start
//! over at each page. So large buffers ask for 2 MiB transparent huge pages (`MADV_HUGEPAGE`,
//! which Debian's default `madvise` THP mode waits for) before they are written: expert slots
//! ([`AlignedBuf`] from 2 MiB on), dense tensors ([`zeroed_vec`]), and in the `brook` binary
//! every allocation from 2 MiB on ([`HugePageAlloc`]). Where the kernel has no THP the advice
//! fails and is ignored.

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

/// Maps `size` bytes (a multiple of [`ALIGN`]) of zeros that start on a 2 MiB boundary and
/// are advised for transparent huge pages, so every whole 2 MiB of them can be one page;
/// null when the system refuses. Nothing is resident until written. Free with [`unmap`].
pub fn map_huge(size: usize) -> *mut u8 {
    let Some(over) = size.checked_add(HUGE) else {
        return std::ptr::null_mut();
    };
    // SAFETY: a fresh private anonymous mapping; no existing memory is involved.
    let raw = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            over,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if raw == libc::MAP_FAILED {
        return std::ptr::null_mut();
    }
    let start = raw as usize;
    let aligned = start.next_multiple_of(HUGE);
    let (head, tail) = (aligned - start, start + over - (aligned + size));
    // SAFETY: the head and tail lie inside the mapping just made and nothing uses them; the
    // advice changes only how [aligned, aligned + size) is backed (failure: no THP, ignored).
    unsafe {
        if head > 0 {
            libc::munmap(raw, head);
        }
        if tail > 0 {
            libc::munmap((aligned + size) as *mut libc::c_void, tail);
        }
        libc::madvise(aligned as *mut libc::c_void, size, libc::MADV_HUGEPAGE);
    }
    aligned as *mut u8
}

/// Unmaps what [`map_huge`] (or [`HugePageAlloc`]'s growth) mapped.
///
/// # Safety
/// `ptr` and `size` are exactly a live mapping of this module's, and nothing uses it after.
pub unsafe fn unmap(ptr: *mut u8, size: usize) {
    // SAFETY: the caller's promise.
    unsafe { libc::munmap(ptr.cast(), size) };
}

/// A global allocator that puts every allocation of 2 MiB or more ([`HUGE`]) on memory from
/// [`map_huge`] (2 MiB aligned, advised for transparent huge pages) and leaves the rest to the
/// system allocator. For binaries: `#[global_allocator] static A: HugePageAlloc =
/// HugePageAlloc;`. Everything large brook holds then sits on huge pages: the dense weights
/// (the system allocator's blocks start 16 bytes into their mapping, so only their interior
/// whole 2 MiB could be advised), the recurrent states, the attention cache and scratch.
/// Under a hypervisor each 4 KiB page's TLB miss walks two page tables: the 4-bit head's
/// product ran 17-53% faster on huge pages at 2 threads (docs/bench/2026-11-30-to-12-02.md, "session 12").
#[derive(Debug, Clone, Copy, Default)]
pub struct HugePageAlloc;

impl HugePageAlloc {
    fn mapped(layout: Layout) -> bool {
        layout.size() >= HUGE && layout.align() <= ALIGN
    }
}

// SAFETY: large blocks are fresh mappings of at least the layout's size and page alignment
// (which covers every alignment routed to them), released only in `dealloc`/`realloc` with
// the size they were made with; everything else is the system allocator's.
unsafe impl std::alloc::GlobalAlloc for HugePageAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if Self::mapped(layout) {
            map_huge(layout.size().next_multiple_of(ALIGN))
        } else {
            // SAFETY: forwarded with the caller's guarantees.
            unsafe { std::alloc::System.alloc(layout) }
        }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if Self::mapped(layout) {
            // Fresh anonymous memory is zero and untouched.
            map_huge(layout.size().next_multiple_of(ALIGN))
        } else {
            // SAFETY: forwarded with the caller's guarantees.
            unsafe { std::alloc::System.alloc_zeroed(layout) }
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if Self::mapped(layout) {
            // SAFETY: made by `alloc` for this layout, so this is its whole mapping.
            unsafe { unmap(ptr, layout.size().next_multiple_of(ALIGN)) }
        } else {
            // SAFETY: forwarded with the caller's guarantees.
            unsafe { std::alloc::System.dealloc(ptr, layout) }
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller guarantees `new_size` with this alignment forms a valid layout.
        let new = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        match (Self::mapped(layout), Self::mapped(new)) {
            (true, true) => {
                let (old_len, new_len) = (
                    layout.size().next_multiple_of(ALIGN),
                    new_size.next_multiple_of(ALIGN),
                );
                if old_len == new_len {
                    return ptr;
                }
                // SAFETY: ptr/old_len is one of our mappings; the kernel moves or resizes it
                // whole and keeps its huge-page advice.
                let moved =
                    unsafe { libc::mremap(ptr.cast(), old_len, new_len, libc::MREMAP_MAYMOVE) };
                if moved == libc::MAP_FAILED {
                    std::ptr::null_mut()
                } else {
                    moved.cast()
                }
            }
            (false, false) => {
                // SAFETY: forwarded with the caller's guarantees.
                unsafe { std::alloc::System.realloc(ptr, layout, new_size) }
            }
            _ => {
                // Across the threshold: a new block of the other kind, the bytes copied.
                // SAFETY: `new` is a valid non-zero layout (the caller's guarantee).
                let to = unsafe { self.alloc(new) };
                if !to.is_null() {
                    // SAFETY: both blocks hold at least the smaller size; they are distinct.
                    unsafe {
                        std::ptr::copy_nonoverlapping(ptr, to, layout.size().min(new_size));
                        self.dealloc(ptr, layout);
                    }
                }
                to
            }
        }
    }
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
    /// From [`HUGE`] bytes on, a [`map_huge`] mapping: on huge pages, and nothing resident
    /// until written (the allocator would zero an over-aligned block by writing it).
    pub fn zeroed(len: usize) -> Self {
        let layout = Self::layout(len);
        if layout.size() >= HUGE {
            let ptr = NonNull::new(map_huge(layout.size()))
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
            unsafe { unmap(self.ptr.as_ptr(), layout.size()) };
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

    #[test]
    fn huge_page_allocator_keeps_bytes_across_every_resize() {
        use std::alloc::GlobalAlloc;
        let a = HugePageAlloc;
        let fill = |p: *mut u8, n: usize, seed: u8| {
            for i in 0..n {
                // SAFETY: p holds at least n bytes (the test's own allocation).
                unsafe { *p.add(i) = (i as u8).wrapping_mul(31).wrapping_add(seed) };
            }
        };
        let same = |p: *const u8, n: usize, seed: u8| {
            // SAFETY: as above.
            (0..n).all(|i| unsafe { *p.add(i) } == (i as u8).wrapping_mul(31).wrapping_add(seed))
        };
        let layout_of = |size: usize, align: usize| {
            Layout::from_size_align(size, align).expect("a valid test layout")
        };
        // SAFETY: every layout below is non-zero with a power-of-two alignment, and each
        // block is used within its size, resized and freed with the layout it has.
        unsafe {
            let big = layout_of(HUGE + 5, 8);
            let p = a.alloc_zeroed(big);
            assert!(!p.is_null() && (p as usize).is_multiple_of(HUGE));
            assert!((0..big.size()).all(|i| *p.add(i) == 0));
            a.dealloc(p, big);

            // small → big → bigger → smaller but still big → small, contents kept each time.
            let mut layout = layout_of(1000, 16);
            let mut p = a.alloc(layout);
            fill(p, 1000, 3);
            for new_size in [HUGE + 100, 5 * HUGE + 7, 3 * HUGE, 3 * HUGE, 2000, 40] {
                let keep = layout.size().min(new_size);
                let q = a.realloc(p, layout, new_size);
                assert!(!q.is_null(), "realloc to {new_size}");
                assert!(same(q, keep, 3), "bytes lost resizing to {new_size}");
                layout = layout_of(new_size, 16);
                fill(q, new_size, 3);
                p = q;
            }
            a.dealloc(p, layout);

            // Alignments above a page go to the system allocator, and still hold.
            let odd = layout_of(HUGE * 2, 2 * ALIGN);
            let p = a.alloc(odd);
            assert!(!p.is_null() && (p as usize).is_multiple_of(2 * ALIGN));
            fill(p, odd.size(), 9);
            assert!(same(p, odd.size(), 9));
            a.dealloc(p, odd);
        }
    }
}
