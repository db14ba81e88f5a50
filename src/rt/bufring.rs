//! A worker's ring of provided buffers (`IORING_REGISTER_PBUF_RING`): the memory multishot
//! receives write into. A socket with a multishot receive armed costs no buffer while it is
//! idle; when bytes arrive the kernel takes the next free buffer, posts a completion naming it,
//! and the receiving task copies the bytes out and hands the buffer straight back. So the ring
//! only needs as many buffers as completions that can be waiting at once (bounded per socket,
//! see `rt::MULTISHOT_QUEUE_MAX`), not one per connection.
//!
//! Layout is the kernel's: `entries` 16-byte `io_uring_buf` records in page-aligned memory,
//! the tail (ours to advance) in the last 2 bytes of the first record; the kernel consumes from
//! the head. Buffers are `BUF_SIZE` bytes each, in one allocation.

use io_uring::types::BufRingEntry;
use io_uring::IoUring;
use std::cell::Cell;

/// Buffer group id of the worker's receive buffers.
pub const GROUP: u16 = 0;
/// Bytes per provided buffer: a request head and a typical chat body arrive in one.
pub const BUF_SIZE: usize = 16 * 1024;
/// Buffers in the ring (a power of two): 4 MiB per worker.
pub const ENTRIES: u16 = 256;

pub struct BufRing {
    /// `ENTRIES` records, page aligned (mmap), shared with the kernel.
    ring: *mut BufRingEntry,
    ring_len: usize,
    /// `ENTRIES * BUF_SIZE` bytes the kernel writes into (a leaked boxed slice, freed in
    /// `Drop`): only ever read through raw pointers, never borrowed while the kernel may write.
    mem: *mut u8,
    /// Our copy of the tail: records below it are the kernel's to take.
    tail: Cell<u16>,
}

impl BufRing {
    /// Map the ring, fill it with every buffer and register it with `ring` as [`GROUP`].
    /// Err when the kernel has no provided-buffer rings (before 5.19): receives then stay
    /// single-shot.
    pub fn register(ring: &IoUring) -> std::io::Result<BufRing> {
        let ring_len = ENTRIES as usize * std::mem::size_of::<BufRingEntry>();
        // Safety: anonymous private mapping; the result is checked.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                ring_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let br = BufRing {
            ring: addr as *mut BufRingEntry,
            ring_len,
            mem: Box::into_raw(vec![0u8; ENTRIES as usize * BUF_SIZE].into_boxed_slice())
                as *mut u8,
            tail: Cell::new(0),
        };
        for bid in 0..ENTRIES {
            br.write_entry(bid);
        }
        br.publish();
        // Safety: the ring memory is mapped, page aligned and stays mapped until `Drop`, which
        // runs only after the ring (and with it the registration) is gone: see `rt::Inner`.
        unsafe {
            ring.submitter()
                .register_buf_ring_with_flags(addr as u64, ENTRIES, GROUP, 0)?;
        }
        Ok(br)
    }

    /// The first `len` bytes of buffer `bid`, as the kernel filled them.
    /// Valid until the buffer is recycled: the kernel writes a buffer only while it is in the
    /// ring, and one named by a completion stays out of it until `recycle`.
    pub fn bytes(&self, bid: u16, len: usize) -> &[u8] {
        let start = (bid as usize % ENTRIES as usize) * BUF_SIZE;
        // Safety: inside the allocation; see above for why no write overlaps the borrow.
        unsafe { std::slice::from_raw_parts(self.mem.add(start), len.min(BUF_SIZE)) }
    }

    /// Hand buffer `bid` back to the kernel.
    pub fn recycle(&self, bid: u16) {
        self.write_entry(bid % ENTRIES);
        self.publish();
    }

    fn write_entry(&self, bid: u16) {
        let tail = self.tail.get();
        let i = (tail & (ENTRIES - 1)) as usize;
        // Safety: i < ENTRIES, inside the mapping; the kernel reads records only below the
        // published tail, and this one is at or above it until `publish`.
        let e = unsafe { &mut *self.ring.add(i) };
        e.set_addr(self.mem as u64 + bid as u64 * BUF_SIZE as u64);
        e.set_len(BUF_SIZE as u32);
        e.set_bid(bid);
        self.tail.set(tail.wrapping_add(1));
    }

    fn publish(&self) {
        // Safety: the tail field lies inside the first record of the mapping; the release
        // store orders the record writes before the kernel can see the new tail.
        unsafe {
            let tail = BufRingEntry::tail(self.ring) as *const std::sync::atomic::AtomicU16;
            (*tail).store(self.tail.get(), std::sync::atomic::Ordering::Release);
        }
    }
}

impl Drop for BufRing {
    fn drop(&mut self) {
        // Safety: unmaps exactly what `register` mapped and frees the buffers it leaked, after
        // the ring (and the kernel's use of both) is gone.
        unsafe {
            libc::munmap(self.ring as *mut libc::c_void, self.ring_len);
            drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(
                self.mem,
                ENTRIES as usize * BUF_SIZE,
            )));
        }
    }
}
