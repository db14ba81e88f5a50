//! Deadlines of pending operations, kept in user space: a hashed timing wheel of millisecond
//! ticks with intrusive lists indexed by operation slot.
//!
//! Every request arms two or three deadlines (idle wait, request read, replica answer) and
//! almost all of them are disarmed long before they expire. A kernel linked timeout costs an
//! extra submission, an extra completion and an hrtimer arm and cancel each time; here arming
//! and disarming are a few stores, and only a deadline that really expires costs anything (an
//! async cancel of its operation). The executor sleeps no longer than the next occupied tick.
//!
//! Pure: time comes in as milliseconds since the executor's epoch.

#![forbid(unsafe_code)]

/// Ticks in one turn of the wheel; a deadline further out waits in its bucket for later turns.
const BUCKETS: usize = 4096;
const MASK: u64 = BUCKETS as u64 - 1;
const NIL: u32 = u32::MAX;

#[derive(Clone, Copy)]
struct Link {
    prev: u32,
    next: u32,
    /// Absolute tick (ms since epoch) at which the deadline expires.
    at: u64,
    armed: bool,
}

const UNLINKED: Link = Link {
    prev: NIL,
    next: NIL,
    at: 0,
    armed: false,
};

pub struct Wheel {
    links: Vec<Link>,
    heads: Box<[u32; BUCKETS]>,
    /// One bit per bucket that holds at least one deadline.
    occupied: [u64; BUCKETS / 64],
    /// Every tick up to and including this one has been processed.
    done_through: u64,
    armed: usize,
}

impl Wheel {
    pub fn new(now_ms: u64) -> Wheel {
        Wheel {
            links: Vec::new(),
            heads: Box::new([NIL; BUCKETS]),
            occupied: [0; BUCKETS / 64],
            done_through: now_ms,
            armed: 0,
        }
    }

    /// Deadlines currently armed.
    pub fn armed(&self) -> usize {
        self.armed
    }

    /// Arm (or move) the deadline of `slot` to tick `at_ms`. A deadline at or before a tick
    /// already processed fires at the next `expire`.
    pub fn arm(&mut self, slot: u32, at_ms: u64) {
        self.disarm(slot);
        let i = slot as usize;
        if self.links.len() <= i {
            self.links.resize(i + 1, UNLINKED);
        }
        let at = at_ms.max(self.done_through + 1);
        let b = (at & MASK) as usize;
        let head = self.heads[b];
        self.links[i] = Link {
            prev: NIL,
            next: head,
            at,
            armed: true,
        };
        if head != NIL {
            self.links[head as usize].prev = slot;
        }
        self.heads[b] = slot;
        self.occupied[b / 64] |= 1 << (b % 64);
        self.armed += 1;
    }

    /// Forget the deadline of `slot`, if it has one.
    pub fn disarm(&mut self, slot: u32) {
        let i = slot as usize;
        let Some(link) = self.links.get(i).copied() else {
            return;
        };
        if !link.armed {
            return;
        }
        let b = (link.at & MASK) as usize;
        if link.prev == NIL {
            self.heads[b] = link.next;
            if link.next == NIL {
                self.occupied[b / 64] &= !(1 << (b % 64));
            }
        } else {
            self.links[link.prev as usize].next = link.next;
        }
        if link.next != NIL {
            self.links[link.next as usize].prev = link.prev;
        }
        self.links[i] = UNLINKED;
        self.armed -= 1;
    }

    /// Disarm and append to `fired` every deadline at or before `now_ms`.
    pub fn expire(&mut self, now_ms: u64, fired: &mut Vec<u32>) {
        if now_ms <= self.done_through {
            return;
        }
        let first = self.done_through + 1;
        // More than a whole turn has passed: every bucket is looked at once.
        let last = now_ms.min(first + MASK);
        for tick in first..=last {
            let b = (tick & MASK) as usize;
            if self.occupied[b / 64] & (1 << (b % 64)) == 0 {
                continue;
            }
            let mut cur = self.heads[b];
            while cur != NIL {
                let link = self.links[cur as usize];
                if link.at <= now_ms {
                    self.disarm(cur);
                    fired.push(cur);
                }
                cur = link.next;
            }
        }
        self.done_through = now_ms;
    }

    /// Milliseconds from `now_ms` until the next occupied tick (0 if one is due), or None when
    /// nothing is armed. The deadline found there may belong to a later turn: waking early is
    /// harmless, `expire` just finds nothing due.
    pub fn next_wait_ms(&self, now_ms: u64) -> Option<u64> {
        if self.armed == 0 {
            return None;
        }
        if now_ms > self.done_through {
            return Some(0);
        }
        let start = self.done_through + 1;
        let mut d = 0;
        while d < BUCKETS as u64 {
            let b = ((start + d) & MASK) as usize;
            let word = self.occupied[b / 64] >> (b % 64);
            if word != 0 {
                let d = d + word.trailing_zeros() as u64;
                return Some((start + d).saturating_sub(now_ms));
            }
            // Nothing in the rest of this word: go to the next one.
            d += 64 - (b % 64) as u64;
        }
        Some(BUCKETS as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fire(w: &mut Wheel, now: u64) -> Vec<u32> {
        let mut v = Vec::new();
        w.expire(now, &mut v);
        v.sort();
        v
    }

    #[test]
    fn fires_at_deadline_not_before() {
        let mut w = Wheel::new(0);
        w.arm(3, 10);
        w.arm(7, 25);
        assert_eq!(fire(&mut w, 9), Vec::<u32>::new());
        assert_eq!(w.next_wait_ms(9), Some(1));
        assert_eq!(fire(&mut w, 10), vec![3]);
        assert_eq!(w.next_wait_ms(10), Some(15));
        assert_eq!(fire(&mut w, 30), vec![7]);
        assert_eq!(w.armed(), 0);
        assert_eq!(w.next_wait_ms(30), None);
    }

    #[test]
    fn disarm_and_rearm() {
        let mut w = Wheel::new(0);
        for s in 0..5 {
            w.arm(s, 100);
        }
        w.disarm(2);
        w.disarm(2);
        w.arm(4, 300);
        assert_eq!(w.armed(), 4);
        assert_eq!(fire(&mut w, 100), vec![0, 1, 3]);
        assert_eq!(fire(&mut w, 299), Vec::<u32>::new());
        assert_eq!(fire(&mut w, 300), vec![4]);
    }

    #[test]
    fn deadlines_beyond_one_turn_wait_their_turn() {
        let mut w = Wheel::new(0);
        let far = 3 * BUCKETS as u64 + 17;
        w.arm(1, far);
        w.arm(2, 17);
        assert_eq!(fire(&mut w, 17), vec![2]);
        // The far deadline shares a bucket index with tick 17 of later turns.
        for now in [BUCKETS as u64 + 17, 2 * BUCKETS as u64 + 17, far - 1] {
            assert_eq!(fire(&mut w, now), Vec::<u32>::new(), "at {now}");
            assert!(w.next_wait_ms(now).unwrap() <= BUCKETS as u64);
        }
        assert_eq!(fire(&mut w, far), vec![1]);
    }

    #[test]
    fn a_long_jump_processes_every_bucket_once() {
        let mut w = Wheel::new(5);
        for s in 0..100u32 {
            w.arm(s, 10 + s as u64 * 97);
        }
        assert_eq!(fire(&mut w, 1_000_000), (0..100).collect::<Vec<_>>());
        assert_eq!(w.armed(), 0);
    }

    #[test]
    fn a_past_deadline_fires_on_the_next_expire() {
        let mut w = Wheel::new(0);
        assert_eq!(fire(&mut w, 50), Vec::<u32>::new());
        w.arm(9, 20);
        assert_eq!(w.next_wait_ms(50), Some(1));
        assert_eq!(fire(&mut w, 51), vec![9]);
    }

    #[test]
    fn next_wait_scans_across_words() {
        let mut w = Wheel::new(0);
        w.arm(1, 1000);
        assert_eq!(w.next_wait_ms(0), Some(1000));
        w.arm(2, 65);
        assert_eq!(w.next_wait_ms(0), Some(65));
        w.arm(3, 64);
        assert_eq!(w.next_wait_ms(0), Some(64));
        w.arm(4, 1);
        assert_eq!(w.next_wait_ms(0), Some(1));
    }

    #[test]
    fn many_deadlines_in_one_bucket_keep_their_links() {
        let mut w = Wheel::new(0);
        for s in 0..50u32 {
            w.arm(s, 7 + (s as u64 % 3) * BUCKETS as u64);
        }
        for s in (0..50u32).step_by(5) {
            w.disarm(s);
        }
        let first: Vec<u32> = (0..50).filter(|s| s % 5 != 0 && s % 3 == 0).collect();
        assert_eq!(fire(&mut w, 7), first);
        let rest = w.armed();
        assert_eq!(fire(&mut w, 10 * BUCKETS as u64).len(), rest);
    }
}
