//! Deterministic peer selection for `peers` targets: each source node probes its successor on a
//! ring of the selected nodes plus a few others drawn by a generator seeded from the test's uid, so
//! a re-run of the same test (or a restarted controller) picks exactly the same pairs.

// The most peers one node probes (`MAX_PEERS_PER_NODE`, 16, from the model): with 10,000 nodes
// that is 160,000 pairs per test, which the agents and the controller's in-memory results
// handle; more would not find more.
use nodekeeper_model::probe::MAX_PEERS_PER_NODE;

/// For each node (by index into `nodes`, which must be sorted and free of duplicates), the indices
/// of its peers: the ring successor first, then up to `per_node - 1` distinct others in ascending
/// order. A node is never its own peer; with fewer nodes than `per_node + 1` every other node is a
/// peer.
pub fn select(nodes: &[String], per_node: u32, seed: &str) -> Vec<Vec<usize>> {
    let n = nodes.len();
    let per_node = per_node.min(MAX_PEERS_PER_NODE) as usize;
    (0..n)
        .map(|i| {
            if n < 2 || per_node == 0 {
                return Vec::new();
            }
            let ring = (i + 1) % n;
            let mut peers = vec![ring];
            // The others are drawn from the n - 2 nodes that are neither this node nor its successor.
            let pool = n.saturating_sub(2);
            let extra = (per_node - 1).min(pool);
            let mut rng = SplitMix64::new(fnv1a(seed.as_bytes()) ^ fnv1a(nodes[i].as_bytes()));
            let mut picks = floyd_sample(pool, extra, &mut rng);
            picks.sort_unstable();
            peers.extend(picks.into_iter().map(|p| skip_two(p, i, ring)));
            peers
        })
        .collect()
}

/// Maps an index into the pool (all nodes but `a` and `b`) back to a node index.
fn skip_two(p: usize, a: usize, b: usize) -> usize {
    let (lo, hi) = if a < b { (a, b) } else { (b, a) };
    let mut x = p;
    if x >= lo {
        x += 1;
    }
    if x >= hi {
        x += 1;
    }
    x
}

/// `k` distinct values from `0..n` (Floyd's algorithm: exactly `k` draws, no rejection loop).
fn floyd_sample(n: usize, k: usize, rng: &mut SplitMix64) -> Vec<usize> {
    let mut chosen: Vec<usize> = Vec::with_capacity(k);
    for j in n - k..n {
        let t = rng.below(j as u64 + 1) as usize;
        if chosen.contains(&t) {
            chosen.push(j);
        } else {
            chosen.push(t);
        }
    }
    chosen
}

/// FNV-1a, 64-bit: a stable hash (std's hasher is randomly keyed and may change between releases).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// SplitMix64: a tiny generator whose output is fixed by its definition, unlike `rand`'s
/// `StdRng`, whose algorithm may change between versions and would reshuffle peers.
struct SplitMix64(u64);

impl SplitMix64 {
    fn new(seed: u64) -> Self {
        Self(seed)
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A value in `0..bound` (bound > 0); the modulo bias is below 2^-40 for the bounds used here.
    fn below(&mut self, bound: u64) -> u64 {
        self.next() % bound
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(n: usize) -> Vec<String> {
        let mut v: Vec<String> = (0..n).map(|i| format!("node-{i:05}")).collect();
        v.sort();
        v
    }

    #[test]
    fn ring_plus_random_is_bounded_distinct_and_never_self() {
        for n in [0, 1, 2, 3, 5, 17, 1000] {
            let nodes = names(n);
            let sel = select(&nodes, 4, "uid-1");
            assert_eq!(sel.len(), n);
            for (i, peers) in sel.iter().enumerate() {
                let expected = if n < 2 { 0 } else { 4.min(n - 1) };
                assert_eq!(peers.len(), expected, "n={n} node {i}: {peers:?}");
                assert!(!peers.contains(&i));
                if n >= 2 {
                    assert_eq!(peers[0], (i + 1) % n, "ring successor comes first");
                }
                let mut d = peers.clone();
                d.sort_unstable();
                d.dedup();
                assert_eq!(d.len(), peers.len(), "duplicates in {peers:?}");
                assert!(peers.iter().all(|p| *p < n));
            }
        }
    }

    #[test]
    fn same_seed_same_peers_other_seed_other_peers() {
        let nodes = names(200);
        assert_eq!(select(&nodes, 5, "uid-a"), select(&nodes, 5, "uid-a"));
        assert_ne!(select(&nodes, 5, "uid-a"), select(&nodes, 5, "uid-b"));
    }

    #[test]
    fn per_node_is_capped() {
        let nodes = names(100);
        assert!(
            select(&nodes, 1_000, "u")
                .iter()
                .all(|p| p.len() == MAX_PEERS_PER_NODE as usize)
        );
        assert!(select(&nodes, 0, "u").iter().all(Vec::is_empty));
    }

    #[test]
    fn every_node_is_probed_by_someone() {
        // The ring alone guarantees each node is someone's peer.
        let nodes = names(50);
        let sel = select(&nodes, 1, "u");
        let mut probed = [false; 50];
        for peers in &sel {
            for p in peers {
                probed[*p] = true;
            }
        }
        assert!(probed.iter().all(|x| *x));
    }

    #[test]
    fn generator_is_stable() {
        // Pinned outputs: a change here would silently reshuffle every test's peers.
        let mut r = SplitMix64::new(0);
        assert_eq!(r.next(), 0xe220_a839_7b1d_cdaf);
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
    }

    #[test]
    fn skip_two_maps_the_pool() {
        // Nodes 0..5 without 1 and 2: pool indices 0,1,2 are nodes 0,3,4.
        assert_eq!(
            (0..3).map(|p| skip_two(p, 1, 2)).collect::<Vec<_>>(),
            vec![0, 3, 4]
        );
        assert_eq!(
            (0..3).map(|p| skip_two(p, 4, 0)).collect::<Vec<_>>(),
            vec![1, 2, 3]
        );
    }
}
