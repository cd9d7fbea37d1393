//! The CPU device's arenas: where buffers get their memory.
//!
//! An arena is a few large segments carved into regions, best fit, with
//! neighbouring free regions merged when a buffer is dropped. The executor
//! gives the micro-batches one arena, shared by those in flight, and every
//! step issues the same work, so the arena sees about the same sequence of
//! allocations in every step; its segments grow during the first step
//! (each growth adds a quarter of what it holds, so buffers whose size
//! varies a little from step to step, such as the rows an expert receives,
//! or whose order varies with how two lanes interleave, still fit) and the
//! steps after it allocate nothing. The tests count it. Arena 0, the
//! parameters' and optimizer state's, grows by each request alone
//! ([`ArenaGrowth`]).
//!
//! On the CPU a kernel has finished with a buffer when its call returns, so a
//! region is reusable as soon as its buffer is dropped. A GPU arena must also
//! wait for the events of the region's last users (CUDA's stream-ordered
//! pools do).

use crate::backend::ArenaGrowth;
use crate::error::{Result, RuntimeError};
use crate::view::DType;
use std::cell::UnsafeCell;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Mutex, PoisonError};

/// Regions start on multiples of this many 8-byte words (64 bytes).
const GRANULE: usize = 8;
/// The smallest segment an arena adds, in words (1 MiB).
const MIN_SEGMENT: usize = 1 << 17;

/// Host memory in `u64` words, so every dtype is aligned.
pub(crate) type Storage = Box<[UnsafeCell<u64>]>;

/// What a region taken from an arena holds: zeros ([`crate::Backend::alloc`]),
/// or all bits set ([`crate::Backend::alloc_uninit`]): NaN in every float
/// dtype and an out-of-range u32 index, so a kernel that reads an element
/// nobody wrote shows it in the CPU backend's results.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Fill {
    Zero,
    Poison,
}

/// `words` zeroed words, or an error when the host has no memory for them.
pub(crate) fn new_storage(words: usize, what: impl FnOnce() -> String) -> Result<Storage> {
    let mut storage: Vec<UnsafeCell<u64>> = Vec::new();
    storage.try_reserve_exact(words).map_err(|_| {
        RuntimeError::Numeric(format!(
            "out of memory allocating {} bytes for {} on the CPU",
            words * 8,
            what()
        ))
    })?;
    storage.resize_with(words, || UnsafeCell::new(0));
    Ok(storage.into_boxed_slice())
}

/// Words for `len` elements of `dtype`.
pub(crate) fn words_for(len: usize, dtype: DType) -> Result<usize> {
    len.checked_mul(dtype.bytes())
        .map(|bytes| bytes.div_ceil(8))
        .ok_or_else(|| {
            RuntimeError::InvalidArgument(format!("{len} elements of {dtype} overflow usize"))
        })
}

/// A region of an arena, owned by one buffer.
#[derive(Debug)]
pub(crate) struct Region {
    pub(crate) segment: usize,
    pub(crate) offset: usize,
    pub(crate) words: usize,
    /// The segment's first word; stable, since segments never move or shrink
    /// while the arena lives.
    pub(crate) base: *mut u64,
}

// SAFETY: a region is a handle to words only its owning buffer touches.
unsafe impl Send for Region {}
unsafe impl Sync for Region {}

#[derive(Default)]
struct Free {
    segments: Vec<Storage>,
    /// Words handed out and not yet taken back, and the most ever.
    in_use: usize,
    peak: usize,
    /// Free regions by (segment, offset) -> words.
    by_place: BTreeMap<(usize, usize), usize>,
    /// The same regions by size, for best fit.
    by_size: BTreeSet<(usize, usize, usize)>,
    total: usize,
}

impl Free {
    fn insert(&mut self, segment: usize, offset: usize, words: usize) {
        self.by_place.insert((segment, offset), words);
        self.by_size.insert((words, segment, offset));
    }

    fn remove(&mut self, segment: usize, offset: usize, words: usize) {
        self.by_place.remove(&(segment, offset));
        self.by_size.remove(&(words, segment, offset));
    }
}

/// One arena.
pub struct CpuArena {
    free: Mutex<Free>,
    growth: ArenaGrowth,
}

impl std::fmt::Debug for CpuArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CpuArena({} words)", self.total_words())
    }
}

// SAFETY: the segments' words are only reached through regions, each owned
// by one buffer, which registers kernel accesses (`super::buffer`); the
// arena itself only reads and writes its bookkeeping under its lock, and
// zeroes a region before handing it out, when no buffer owns it.
unsafe impl Sync for CpuArena {}
unsafe impl Send for CpuArena {}

impl CpuArena {
    /// An empty arena that grows as `growth` says.
    pub(crate) fn new(growth: ArenaGrowth) -> Self {
        CpuArena {
            free: Mutex::default(),
            growth,
        }
    }

    /// A zeroed region of at least `words` words, and whether the arena had
    /// to grow (a device allocation) to find it.
    pub(crate) fn take(
        &self,
        words: usize,
        fill: Fill,
        what: impl FnOnce() -> String,
    ) -> Result<(Region, bool)> {
        let want = words.max(1).div_ceil(GRANULE) * GRANULE;
        let mut free = self.free.lock().unwrap_or_else(PoisonError::into_inner);
        let mut grew = false;
        let fit = match free.by_size.range((want, 0, 0)..).next().copied() {
            Some(fit) => fit,
            None => {
                let size = self.growth.segment(want, free.total, MIN_SEGMENT);
                let segment = free.segments.len();
                free.segments.push(new_storage(size, what)?);
                free.total += size;
                free.insert(segment, 0, size);
                grew = true;
                (size, segment, 0)
            }
        };
        let (size, segment, offset) = fit;
        free.remove(segment, offset, size);
        free.in_use += want;
        free.peak = free.peak.max(free.in_use);
        if size > want {
            free.insert(segment, offset + want, size - want);
        }
        let storage = &free.segments[segment];
        let word_value = match fill {
            Fill::Zero => 0,
            Fill::Poison => u64::MAX,
        };
        for word in &storage[offset..offset + want] {
            // SAFETY: the region belongs to no buffer yet.
            unsafe { *word.get() = word_value };
        }
        let base = UnsafeCell::raw_get(storage.as_ptr());
        Ok((
            Region {
                segment,
                offset,
                words: want,
                base,
            },
            grew,
        ))
    }

    /// Takes a region back, merging it with free neighbours.
    pub(crate) fn give(&self, region: &Region) {
        let mut free = self.free.lock().unwrap_or_else(PoisonError::into_inner);
        let (segment, mut offset, mut words) = (region.segment, region.offset, region.words);
        free.in_use -= words;
        if let Some((&(s, o), &w)) = free.by_place.range(..(segment, offset)).next_back()
            && s == segment
            && o + w == offset
        {
            free.remove(s, o, w);
            offset = o;
            words += w;
        }
        if let Some(&w) = free.by_place.get(&(segment, offset + words)) {
            free.remove(segment, offset + words, w);
            words += w;
        }
        free.insert(segment, offset, words);
    }

    /// Words in use now, and the most in use at once so far.
    pub fn use_words(&self) -> (usize, usize) {
        let free = self.free.lock().unwrap_or_else(PoisonError::into_inner);
        (free.in_use, free.peak)
    }

    /// Words the arena holds, used or not.
    pub fn total_words(&self) -> usize {
        self.free
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .total
    }

    /// Words free for reuse.
    #[cfg(test)]
    fn free_words(&self) -> usize {
        self.free
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .by_place
            .values()
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn what() -> String {
        "a test".into()
    }

    #[test]
    fn regions_are_best_fit_merged_and_zeroed() {
        let arena = CpuArena::new(ArenaGrowth::Quarter);
        let (a, grew) = arena.take(100, Fill::Zero, what).unwrap();
        assert!(grew);
        let (b, grew) = arena.take(200, Fill::Zero, what).unwrap();
        assert!(!grew, "one segment holds both");
        assert_eq!((a.offset, a.words), (0, 104));
        assert_eq!(b.offset, 104);
        // SAFETY (test): the region is ours.
        unsafe { *a.base.add(a.offset) = 7 };
        arena.give(&a);
        arena.give(&b);
        // Everything merged back into one free region.
        assert_eq!(arena.free_words(), arena.total_words());
        let (c, grew) = arena.take(300, Fill::Zero, what).unwrap();
        assert!(!grew);
        assert_eq!(c.offset, 0);
        // SAFETY (test): the region is ours.
        assert_eq!(unsafe { *c.base.add(c.offset) }, 0, "handed out zeroed");
    }

    #[test]
    fn the_state_arena_grows_by_the_request_the_others_by_a_quarter() {
        let grown = |growth| {
            let arena = CpuArena::new(growth);
            let kept: Vec<_> = [3 * MIN_SEGMENT, 5 * MIN_SEGMENT, 8]
                .into_iter()
                .map(|words| arena.take(words, Fill::Zero, what).unwrap().0)
                .collect();
            (arena.total_words(), kept.len())
        };
        // 3 + 5 segments' words, then the minimum segment for the 8 words.
        assert_eq!(grown(ArenaGrowth::Exact).0, 9 * MIN_SEGMENT);
        // The 5-segment request fits no quarter of 3; the 8 words take a
        // quarter of 8 segments.
        assert_eq!(grown(ArenaGrowth::Quarter).0, 10 * MIN_SEGMENT);
    }

    #[test]
    fn a_request_larger_than_any_gap_grows_the_arena() {
        let arena = CpuArena::new(ArenaGrowth::Quarter);
        let (a, _) = arena.take(MIN_SEGMENT, Fill::Zero, what).unwrap();
        let (b, grew) = arena.take(10, Fill::Zero, what).unwrap();
        assert!(grew);
        assert_eq!(b.segment, 1);
        arena.give(&a);
        // Best fit: the rest of the second segment is the smaller gap.
        let (c, grew) = arena.take(MIN_SEGMENT / 2, Fill::Zero, what).unwrap();
        assert!(!grew);
        assert_eq!(c.segment, 1);
        let (d, grew) = arena.take(MIN_SEGMENT - 8, Fill::Zero, what).unwrap();
        assert!(!grew, "the first segment is free again");
        assert_eq!(d.segment, 0);
    }
}
