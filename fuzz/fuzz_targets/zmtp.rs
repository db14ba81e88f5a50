//! libFuzzer entry point: see `kvlb_fuzz::checks::zmtp` for what is checked. The allocator
//! counts the largest single allocation, which the check bounds by what the peer sent.
#![no_main]

use kvlb_fuzz::checks::LARGEST_ALLOCATION;
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::Ordering;

struct Largest;

// Safety: every call is passed on to the system allocator unchanged.
unsafe impl GlobalAlloc for Largest {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LARGEST_ALLOCATION.fetch_max(layout.size(), Ordering::Relaxed);
        System.alloc(layout)
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        LARGEST_ALLOCATION.fetch_max(layout.size(), Ordering::Relaxed);
        System.alloc_zeroed(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LARGEST_ALLOCATION.fetch_max(new_size, Ordering::Relaxed);
        System.realloc(ptr, layout, new_size)
    }
}

#[global_allocator]
static ALLOCATOR: Largest = Largest;

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvlb_fuzz::checks::zmtp(data));
