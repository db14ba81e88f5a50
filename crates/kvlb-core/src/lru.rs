//! A least-recently-used list over a slab: values live in one `Vec`, linked by `u32` indices,
//! and freed slots are reused, so a warm list allocates nothing. Callers keep their own map from
//! key to index. Used by the residency writer (blocks per replica) and the simulator's record
//! of routed blocks.

#![forbid(unsafe_code)]
#![warn(clippy::disallowed_methods, clippy::disallowed_types)]

pub const NIL: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
struct Slot<T> {
    value: T,
    newer: u32,
    older: u32,
}

#[derive(Debug, Clone)]
pub struct LruList<T: Copy> {
    slots: Vec<Slot<T>>,
    free: Vec<u32>,
    newest: u32,
    oldest: u32,
    len: usize,
}

impl<T: Copy> Default for LruList<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T: Copy> LruList<T> {
    pub fn new() -> LruList<T> {
        LruList {
            slots: Vec::new(),
            free: Vec::new(),
            newest: NIL,
            oldest: NIL,
            len: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Heap bytes held (slots and the free list).
    pub fn bytes(&self) -> usize {
        self.slots.capacity() * std::mem::size_of::<Slot<T>>() + self.free.capacity() * 4
    }

    /// Add `value` as the most recent; returns its index.
    pub fn push_newest(&mut self, value: T) -> u32 {
        let slot = Slot {
            value,
            newer: NIL,
            older: NIL,
        };
        let i = match self.free.pop() {
            Some(i) => {
                self.slots[i as usize] = slot;
                i
            }
            None => {
                self.slots.push(slot);
                (self.slots.len() - 1) as u32
            }
        };
        self.link_newest(i);
        self.len += 1;
        i
    }

    /// `push_newest`, growing the slab towards `bound` entries (the most the caller keeps)
    /// rather than doubling past it: a list kept at its bound holds about `bound` slots, not
    /// up to twice as many. Past the bound (an overshoot the caller trims) it grows by 1/64.
    pub fn push_newest_within(&mut self, value: T, bound: usize) -> u32 {
        let len = self.slots.len();
        if self.free.is_empty() && len == self.slots.capacity() {
            let target = if len < bound {
                (len * 2).max(8).min(bound)
            } else {
                len + (len / 64).max(64)
            };
            self.slots.reserve_exact(target.max(len + 1) - len);
        }
        self.push_newest(value)
    }

    /// Make `i` the most recent.
    pub fn touch(&mut self, i: u32) {
        if self.newest != i {
            self.unlink(i);
            self.link_newest(i);
        }
    }

    /// Remove `i` and return its value; its slot is reused later.
    pub fn remove(&mut self, i: u32) -> T {
        self.unlink(i);
        self.free.push(i);
        self.len -= 1;
        self.slots[i as usize].value
    }

    pub fn get(&self, i: u32) -> &T {
        &self.slots[i as usize].value
    }

    pub fn get_mut(&mut self, i: u32) -> &mut T {
        &mut self.slots[i as usize].value
    }

    /// The least recent entry's index.
    pub fn oldest(&self) -> Option<u32> {
        (self.oldest != NIL).then_some(self.oldest)
    }

    /// Values from the most recent to the least recent.
    pub fn iter(&self) -> impl Iterator<Item = &T> + '_ {
        let mut i = self.newest;
        std::iter::from_fn(move || {
            if i == NIL {
                return None;
            }
            let s = &self.slots[i as usize];
            i = s.older;
            Some(&s.value)
        })
    }

    /// Drop everything and give the memory back.
    pub fn clear(&mut self) {
        *self = LruList::new();
    }

    fn unlink(&mut self, i: u32) {
        let Slot { newer, older, .. } = self.slots[i as usize];
        match newer {
            NIL => self.newest = older,
            n => self.slots[n as usize].older = older,
        }
        match older {
            NIL => self.oldest = newer,
            o => self.slots[o as usize].newer = newer,
        }
    }

    fn link_newest(&mut self, i: u32) {
        self.slots[i as usize].newer = NIL;
        self.slots[i as usize].older = self.newest;
        match self.newest {
            NIL => self.oldest = i,
            n => self.slots[n as usize].newer = i,
        }
        self.newest = i;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order(l: &LruList<u64>) -> Vec<u64> {
        l.iter().copied().collect()
    }

    #[test]
    fn keeps_recency_order_and_reuses_slots() {
        let mut l = LruList::new();
        let a = l.push_newest(1);
        let b = l.push_newest(2);
        let c = l.push_newest(3);
        assert_eq!(order(&l), vec![3, 2, 1]);
        l.touch(a);
        assert_eq!(order(&l), vec![1, 3, 2]);
        assert_eq!(l.oldest(), Some(b));
        assert_eq!(l.remove(b), 2);
        assert_eq!(l.oldest(), Some(c));
        let d = l.push_newest(4);
        assert_eq!(d, b, "a freed slot is reused");
        assert_eq!(order(&l), vec![4, 1, 3]);
        *l.get_mut(a) = 10;
        assert_eq!(*l.get(a), 10);
        assert_eq!(l.len(), 3);
        for _ in 0..3 {
            let o = l.oldest().unwrap();
            l.remove(o);
        }
        assert!(l.is_empty());
        assert_eq!(l.oldest(), None);
        assert_eq!(order(&l), Vec::<u64>::new());
    }

    #[test]
    fn a_bounded_list_does_not_double_past_its_bound() {
        let mut l = LruList::new();
        for v in 0..1000u64 {
            l.push_newest_within(v, 1000);
        }
        assert_eq!(l.bytes(), 1000 * std::mem::size_of::<Slot<u64>>());
        l.push_newest_within(1000, 1000);
        assert!(l.bytes() <= 1064 * std::mem::size_of::<Slot<u64>>());
        assert_eq!(l.len(), 1001);
    }

    #[test]
    fn touching_the_newest_and_the_only_entry() {
        let mut l = LruList::new();
        let a = l.push_newest(7u64);
        l.touch(a);
        assert_eq!(order(&l), vec![7]);
        assert_eq!(l.oldest(), Some(a));
        l.clear();
        assert!(l.is_empty());
        assert_eq!(l.bytes(), 0);
    }
}
