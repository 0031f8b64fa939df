//! Kernel arguments by value, packed for `cuLaunchKernel`.

pub(crate) const MAX_ARGS: usize = 24;

/// Kernel arguments by value (each up to 64 bytes), in declaration order.
#[derive(Debug)]
pub struct Args {
    pub(crate) store: [[u64; 8]; MAX_ARGS],
    pub(crate) n: usize,
}

impl Default for Args {
    fn default() -> Self {
        Args {
            store: [[0; 8]; MAX_ARGS],
            n: 0,
        }
    }
}

/// Types that may be passed to a kernel by value.
pub trait KernelArg: Copy {}
impl KernelArg for i32 {}
impl KernelArg for u32 {}
impl KernelArg for f32 {}
impl KernelArg for u64 {}
impl KernelArg for i64 {}
impl KernelArg for crate::weights::Mat {}

impl Args {
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends one argument.
    pub fn arg<T: KernelArg>(&mut self, v: T) -> &mut Self {
        assert!(std::mem::size_of::<T>() <= 64 && self.n < MAX_ARGS);
        // SAFETY: T is plain data no larger than the 64-byte, 8-aligned slot.
        unsafe {
            std::ptr::write(self.store[self.n].as_mut_ptr() as *mut T, v);
        }
        self.n += 1;
        self
    }
}
