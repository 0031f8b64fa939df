//! The expert cache's slot memory: one mapping, a slot every `pitch` bytes, and who may touch
//! a slot's bytes when (the protocol [`crate::experts::cache`] keeps under its state mutex).

use crate::aligned::AlignedBuf;

/// Slot memory: one mapping for every slot, `pitch` bytes apart, on huge pages
/// ([`AlignedBuf`]), resident only as slots are first read into (or populated by the grower).
/// A slot's bytes are written only by the I/O thread that owns it while Loading, or, before
/// the slot is in use, by the grower.
pub(crate) struct SlotBufs {
    /// Owns the mapping; never borrowed after `base` was taken from it.
    _arena: AlignedBuf,
    base: *mut u8,
    pitch: usize,
    len: usize,
    pub(crate) count: usize,
}

// SAFETY: access follows the slot protocol: a slot's bytes are written only while its slot is
// Loading (by exactly one I/O thread) or before the slot is in use (by the grower), and read
// only while Ready and pinned, all decided under the state mutex, so no reader and writer of
// one slot ever overlap, and slots are disjoint.
unsafe impl Sync for SlotBufs {}
// SAFETY: as above; the pointer is into the mapping the struct owns.
unsafe impl Send for SlotBufs {}

impl SlotBufs {
    /// `count` slots of `len` bytes, each starting on a page.
    pub(crate) fn new(count: usize, len: usize) -> Self {
        let pitch = len.max(1).next_multiple_of(crate::aligned::ALIGN);
        let mut arena = AlignedBuf::zeroed(count * pitch);
        let base = arena.as_mut_ptr();
        SlotBufs {
            _arena: arena,
            base,
            pitch,
            len,
            count,
        }
    }

    /// Slot `i`'s bytes, to write.
    ///
    /// # Safety
    /// The caller owns slot `i` (Loading, popped by this I/O thread): no other reference to
    /// its bytes exists while the result lives.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn slot_mut(&self, i: usize) -> &mut [u8] {
        assert!(i < self.count);
        // SAFETY: slot i lies inside the mapping; exclusivity is the caller's promise.
        unsafe { std::slice::from_raw_parts_mut(self.base.add(i * self.pitch), self.len) }
    }

    /// Brings slot `i`'s pages into memory (their content stays zero).
    ///
    /// # Safety
    /// Slot `i` is not in use (at or past the cache's `active`): nothing reads or writes it.
    pub(crate) unsafe fn populate(&self, i: usize) {
        assert!(i < self.count);
        // SAFETY: slot i lies inside the mapping and, by the caller's promise, nobody uses
        // it; madvise only faults its pages in, and the fallback writes the zeros they hold.
        unsafe {
            let p = self.base.add(i * self.pitch);
            if libc::madvise(p.cast(), self.pitch, libc::MADV_POPULATE_WRITE) != 0 {
                // Kernels before 5.14: touch every page.
                for off in (0..self.pitch).step_by(crate::aligned::ALIGN) {
                    std::ptr::write_volatile(p.add(off), 0);
                }
            }
        }
    }

    /// Slot `i`'s bytes, to read.
    ///
    /// # Safety
    /// Slot `i` is pinned and not Loading: nothing writes it while the result lives.
    pub(crate) unsafe fn slot(&self, i: usize) -> &[u8] {
        assert!(i < self.count);
        // SAFETY: as in `slot_mut`.
        unsafe { std::slice::from_raw_parts(self.base.add(i * self.pitch), self.len) }
    }
}
