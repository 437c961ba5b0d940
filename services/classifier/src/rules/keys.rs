//! A node's rule keys, in a sorted list.
//!
//! A node has some 55 rule keys (each rule, per GPU for a GPU-scoped rule), each a key of 40
//! bytes and a state of 56. In a `BTreeMap` they took about 147 bytes apiece (its nodes hold
//! eleven entries, most of them half full); in a list sorted the same way they take what they
//! are. A node's keys are found by binary search, iterate in the map's order, and are added
//! (a rule a node first matches) or removed (a recovered incident's state pruned) seldom
//! enough that moving the list's tail costs nothing measurable.

use std::borrow::Borrow;

/// Sorted, distinct keys and their values.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct SortedMap<K, V>(Vec<(K, V)>);

impl<K, V> Default for SortedMap<K, V> {
    fn default() -> Self {
        SortedMap(Vec::new())
    }
}

impl<K: Ord, V> SortedMap<K, V> {
    fn find<Q: Ord + ?Sized>(&self, key: &Q) -> Result<usize, usize>
    where
        K: Borrow<Q>,
    {
        self.0.binary_search_by(|(k, _)| k.borrow().cmp(key))
    }

    pub(crate) fn get<Q: Ord + ?Sized>(&self, key: &Q) -> Option<&V>
    where
        K: Borrow<Q>,
    {
        self.find(key).ok().map(|i| &self.0[i].1)
    }

    pub(crate) fn get_mut<Q: Ord + ?Sized>(&mut self, key: &Q) -> Option<&mut V>
    where
        K: Borrow<Q>,
    {
        self.find(key).ok().map(|i| &mut self.0[i].1)
    }

    /// The value of `key`, added as `value()` when absent: the key is copied only then (a map's
    /// `entry` takes it owned, a copy for every look-up).
    pub(crate) fn get_or_insert_with(&mut self, key: &K, value: impl FnOnce() -> V) -> &mut V
    where
        K: Clone,
    {
        let i = match self.find(key) {
            Ok(i) => i,
            Err(i) => {
                crate::tight::insert(&mut self.0, i, (key.clone(), value()));
                i
            }
        };
        &mut self.0[i].1
    }

    pub(crate) fn remove<Q: Ord + ?Sized>(&mut self, key: &Q) -> Option<V>
    where
        K: Borrow<Q>,
    {
        self.find(key).ok().map(|i| self.0.remove(i).1)
    }

    /// Keeps the entries `keep` says yes to, in order.
    pub(crate) fn retain(&mut self, mut keep: impl FnMut(&K, &mut V) -> bool) {
        self.0.retain_mut(|(k, v)| keep(k, v));
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (&K, &V)> {
        self.0.iter().map(|(k, v)| (k, v))
    }

    pub(crate) fn iter_mut(&mut self) -> impl Iterator<Item = (&K, &mut V)> {
        self.0.iter_mut().map(|(k, v)| (&*k, v))
    }

    pub(crate) fn keys(&self) -> impl Iterator<Item = &K> {
        self.0.iter().map(|(k, _)| k)
    }

    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.0.len()
    }
}

impl<K: Ord, V> FromIterator<(K, V)> for SortedMap<K, V> {
    /// The last value of a key given twice wins, as in a map.
    fn from_iter<I: IntoIterator<Item = (K, V)>>(iter: I) -> Self {
        let mut list: Vec<(K, V)> = iter.into_iter().collect();
        // Stable, so the entries of one key stay in the order given.
        list.sort_by(|a, b| a.0.cmp(&b.0));
        let mut out: Vec<(K, V)> = Vec::with_capacity(list.len());
        for (k, v) in list {
            match out.last_mut() {
                Some(last) if last.0 == k => last.1 = v,
                _ => out.push((k, v)),
            }
        }
        out.shrink_to_fit();
        SortedMap(out)
    }
}

impl<'a, K: Ord, V> IntoIterator for &'a SortedMap<K, V> {
    type Item = (&'a K, &'a V);
    type IntoIter = std::iter::Map<std::slice::Iter<'a, (K, V)>, fn(&'a (K, V)) -> (&'a K, &'a V)>;

    fn into_iter(self) -> Self::IntoIter {
        self.0.iter().map(|(k, v)| (k, v))
    }
}

impl<K: Ord + Borrow<Q>, Q: Ord + ?Sized, V> std::ops::Index<&Q> for SortedMap<K, V> {
    type Output = V;

    fn index(&self, key: &Q) -> &V {
        self.get(key).expect("no such key")
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    #[test]
    fn it_answers_as_a_btree_map_given_the_same_changes() {
        // A deterministic mix of inserts, updates, removals and retains over a small key space.
        let mut sorted: SortedMap<(String, Option<u8>), u32> = SortedMap::default();
        let mut map: BTreeMap<(String, Option<u8>), u32> = BTreeMap::new();
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        for step in 0..5_000u32 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let key = (format!("rule-{}", state % 7), (!state.is_multiple_of(3)).then_some((state % 9) as u8));
            match (state >> 8) % 10 {
                0 => assert_eq!(sorted.remove(&key), map.remove(&key)),
                1 if step % 50 == 0 => {
                    sorted.retain(|k, v| !(k.0.len() + *v as usize).is_multiple_of(3));
                    map.retain(|k, v| !(k.0.len() + *v as usize).is_multiple_of(3));
                }
                2..=5 => {
                    *sorted.get_or_insert_with(&key, || step) += 1;
                    *map.entry(key.clone()).or_insert_with(|| step) += 1;
                }
                _ => {
                    if let (Some(a), Some(b)) = (sorted.get_mut(&key), map.get_mut(&key)) {
                        *a += 7;
                        *b += 7;
                    }
                }
            }
            assert_eq!(sorted.get(&key), map.get(&key));
        }
        let as_list =
            |m: &SortedMap<(String, Option<u8>), u32>| m.iter().map(|(k, v)| (k.clone(), *v)).collect::<Vec<_>>();
        assert_eq!(as_list(&sorted), map.iter().map(|(k, v)| (k.clone(), *v)).collect::<Vec<_>>());
        assert_eq!(sorted.len(), map.len());
        assert_eq!(sorted.keys().collect::<Vec<_>>(), map.keys().collect::<Vec<_>>());
        // Built from entries in any order, the later value of a repeated key wins.
        let built: SortedMap<u8, char> = [(3, 'a'), (1, 'b'), (3, 'c'), (2, 'd')].into_iter().collect();
        assert_eq!(built.iter().map(|(k, v)| (*k, *v)).collect::<Vec<_>>(), [(1, 'b'), (2, 'd'), (3, 'c')]);
        assert_eq!(built[&3], 'c');
    }
}
