//! Lists that grow by a quarter, not by doubling.
//!
//! The classifier holds many short lists per node: some 55 rule keys' latest events or counter
//! samples (80 and 48 bytes each, most lists with one to three of them: a counter that does not
//! move keeps two) and, per node and open period, the rollups of each GPU and kind (some 80) with
//! the readings of each. `Vec` and `VecDeque` double when full, from at least four entries, so
//! about half of what those lists allocated stood unused: measured with `classifier-state`, some
//! 10 KB of a node's state after a day in the engine alone (1 GB at 100,000 nodes). These grow by
//! a quarter of their length, at least one. A list grows only to the most it held at once, so
//! the copies this costs are few, and come early in its life.

use std::collections::VecDeque;

/// The room to add to a full list of `len` entries.
fn step(len: usize) -> usize {
    (len / 4).max(1)
}

/// Appends `item` to `list`.
pub(crate) fn push_back<T>(list: &mut VecDeque<T>, item: T) {
    if list.len() == list.capacity() {
        list.reserve_exact(step(list.len()));
    }
    list.push_back(item);
}

/// Appends `item` to `list`.
pub(crate) fn push<T>(list: &mut Vec<T>, item: T) {
    insert(list, list.len(), item);
}

/// Inserts `item` into `list` at `at`.
pub(crate) fn insert<T>(list: &mut Vec<T>, at: usize, item: T) {
    if list.len() == list.capacity() {
        list.reserve_exact(step(list.len()));
    }
    list.insert(at, item);
}

/// Appends `item` to `list`, which then holds exactly what it held and `item` (a boxed slice is
/// 8 bytes smaller than a `Vec`, for lists that grow rarely and by one: a rollup's fields).
pub(crate) fn push_boxed<T>(list: &mut Box<[T]>, item: T) {
    let mut grown = std::mem::take(list).into_vec();
    grown.reserve_exact(1);
    grown.push(item);
    *list = grown.into_boxed_slice();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_list_grows_by_a_quarter_of_its_length_at_least_one() {
        let mut v = Vec::new();
        let mut d = VecDeque::new();
        for i in 0..100 {
            push(&mut v, i);
            push_back(&mut d, i);
            assert!(v.capacity() <= (v.len() - 1) + step(v.len() - 1), "{} for {}", v.capacity(), v.len());
            assert_eq!(d.capacity(), v.capacity());
        }
        assert_eq!(v, d.iter().copied().collect::<Vec<_>>());
        // The first three entries take a place each, where `Vec` would take four at once.
        let mut three = Vec::new();
        for i in 0..3 {
            push(&mut three, i);
        }
        assert_eq!(three.capacity(), 3);
        let mut boxed: Box<[u32]> = Box::default();
        for i in 0..3 {
            push_boxed(&mut boxed, i);
        }
        assert_eq!(*boxed, [0, 1, 2]);
    }
}
