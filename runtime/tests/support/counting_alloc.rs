//! A counting global allocator for the tests that hold a memory estimate
//! against what a run really allocates (the CPU backend's buffers are heap
//! `Vec`s, every thread rank's in one process). A test file that uses it
//! holds a single test, so nothing else allocates in the process meanwhile.

use hybridgen_runtime::train::{TrainConfig, TrainSummary, train};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grew(by: usize) {
    let live = LIVE.fetch_add(by, Ordering::Relaxed) + by;
    PEAK.fetch_max(live, Ordering::Relaxed);
}

// SAFETY: every call is forwarded to the system allocator unchanged; the
// counters only observe sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        grew(layout.size());
        // SAFETY: the caller upholds `alloc`'s contract.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        grew(layout.size());
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: `ptr` came from this allocator with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > layout.size() {
            grew(new_size - layout.size());
        } else {
            LIVE.fetch_sub(layout.size() - new_size, Ordering::Relaxed);
        }
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// The most heap a run of `config` held above what was live before it.
#[allow(dead_code)] // not every test file that includes this module uses both
pub fn peak_of(config: &TrainConfig) -> usize {
    measure(config).0
}

/// [`peak_of`], and the run's summary (its arenas' figures).
#[allow(dead_code)]
pub fn measure(config: &TrainConfig) -> (usize, TrainSummary) {
    let before = LIVE.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    let summary = train(config, &mut |_| {}).unwrap_or_else(|e| panic!("{e}"));
    (PEAK.load(Ordering::Relaxed) - before, summary)
}
