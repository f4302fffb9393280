//! Memory for the trie: 2 MiB pages when the system gives them.
//!
//! Order of preference: an explicit huge-page mapping (`MAP_HUGETLB`, needs a reserved
//! pool), then transparent huge pages (`madvise(MADV_HUGEPAGE)` on an aligned anonymous
//! mapping), then ordinary pages. The choice is reported by [`PageKind`]; the mapping
//! is unmapped when the owner drops.

use std::fmt;
use std::ptr::NonNull;

/// Which kind of pages back a [`PageBuf`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PageKind {
    /// `mmap(MAP_HUGETLB)`: explicit 2 MiB huge pages from the reserved pool.
    HugeTlb,
    /// Anonymous mapping advised with `MADV_HUGEPAGE` (transparent huge pages).
    TransparentHuge,
    /// Ordinary heap memory (no huge pages were available, or not on Linux).
    Normal,
}

impl fmt::Display for PageKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PageKind::HugeTlb => "hugetlb",
            PageKind::TransparentHuge => "thp",
            PageKind::Normal => "normal",
        })
    }
}

const HUGE: usize = 2 << 20;

/// A fixed-length, zero-initialised slice of `T` on the best pages available.
///
/// `T` must be plain data for which all-zero bytes are a valid value (the trie's nodes).
pub(crate) struct PageBuf<T: Copy> {
    ptr: NonNull<T>,
    len: usize,
    /// Bytes mapped with `mmap` (0 when the memory came from a `Vec`).
    mapped: usize,
    kind: PageKind,
    /// Keeps heap memory alive in the `Normal` case.
    _heap: Vec<T>,
}

// SAFETY: `PageBuf` owns its memory exclusively (like a `Box<[T]>`); sharing `&PageBuf`
// only hands out `&[T]`.
unsafe impl<T: Copy + Send> Send for PageBuf<T> {}
// SAFETY: as above; no interior mutability.
unsafe impl<T: Copy + Sync> Sync for PageBuf<T> {}

impl<T: Copy> PageBuf<T> {
    /// Copies `items` onto huge pages when possible.
    pub(crate) fn from_slice(items: &[T]) -> Self {
        let bytes = std::mem::size_of_val(items);
        if bytes >= HUGE {
            if let Some(buf) = Self::map(items, true) {
                return buf;
            }
            if let Some(buf) = Self::map(items, false) {
                return buf;
            }
        }
        let mut heap = items.to_vec();
        let ptr = NonNull::new(heap.as_mut_ptr()).unwrap_or(NonNull::dangling());
        Self {
            ptr,
            len: items.len(),
            mapped: 0,
            kind: PageKind::Normal,
            _heap: heap,
        }
    }

    #[cfg(all(target_os = "linux", not(miri)))]
    fn map(items: &[T], hugetlb: bool) -> Option<Self> {
        let bytes = std::mem::size_of_val(items);
        let len = bytes.div_ceil(HUGE) * HUGE;
        let flags =
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | if hugetlb { libc::MAP_HUGETLB } else { 0 };
        // SAFETY: an anonymous private mapping with no address hint; the result is
        // checked against MAP_FAILED before use.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                flags,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return None;
        }
        let kind = if hugetlb {
            PageKind::HugeTlb
        } else {
            // SAFETY: `p..p+len` is the mapping just created.
            let rc = unsafe { libc::madvise(p, len, libc::MADV_HUGEPAGE) };
            if rc != 0 || !thp_enabled() {
                // SAFETY: unmapping exactly the mapping created above.
                unsafe { libc::munmap(p, len) };
                return None;
            }
            PageKind::TransparentHuge
        };
        let ptr = p.cast::<T>();
        // SAFETY: the mapping is at least `bytes` long, page-aligned (so aligned for
        // `T`, whose alignment is at most 64), and does not overlap `items`.
        unsafe { std::ptr::copy_nonoverlapping(items.as_ptr(), ptr, items.len()) };
        Some(Self {
            ptr: NonNull::new(ptr)?,
            len: items.len(),
            mapped: len,
            kind,
            _heap: Vec::new(),
        })
    }

    #[cfg(not(all(target_os = "linux", not(miri))))]
    fn map(_items: &[T], _hugetlb: bool) -> Option<Self> {
        None
    }

    /// The pages backing this buffer.
    pub(crate) fn kind(&self) -> PageKind {
        self.kind
    }

    /// The elements.
    #[inline]
    pub(crate) fn as_slice(&self) -> &[T] {
        // SAFETY: `ptr` points at `len` initialised elements owned by `self` (either the
        // mapping filled in `map` or `heap`), alive until drop.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

/// Whether transparent huge pages can back an `madvise`d region.
#[cfg(all(target_os = "linux", not(miri)))]
fn thp_enabled() -> bool {
    std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
        .map(|s| !s.contains("[never]"))
        .unwrap_or(false)
}

impl<T: Copy> Drop for PageBuf<T> {
    fn drop(&mut self) {
        #[cfg(all(target_os = "linux", not(miri)))]
        if self.mapped > 0 {
            // SAFETY: `ptr..ptr+mapped` is exactly the mapping made in `map`, unmapped once.
            unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.mapped) };
        }
    }
}

impl<T: Copy> fmt::Debug for PageBuf<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PageBuf")
            .field("len", &self.len)
            .field("kind", &self.kind)
            .finish()
    }
}
