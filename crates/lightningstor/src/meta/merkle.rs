//! Per-partition hash trees of object rows, kept in step with every row
//! change, so anti-entropy compares a few hashes instead of every row.
//!
//! Only a store opened as a cluster node keeps them (it knows the partition
//! count, [`crate::Config::tree_partitions`]); a single-node store pays
//! nothing. For every key the tree holds its *row* as a replica answers it
//! (the object or the tombstone, whichever is newer: [`TreeEntry`]):
//!
//! ```text
//! tree_rows   (partition, leaf, bucket, key) -> (version, tombstone)   in redb
//! nodes       (partition, node)              -> 32-byte hash           in memory
//!
//!                     node 0 (root)                      = XOR of its 16 children
//!          node 1  ..  node 16                           = XOR of their 16 leaves
//!   node 17 .. node 272  (leaf l is node 17 + l)         = XOR of H(row) of its rows
//! ```
//!
//! A key's partition is [`position`]'s (the placement's partition, the same
//! first eight bytes of BLAKE3(bucket, 0, key)); its leaf is the next byte
//! of that hash. Every node is the XOR of the BLAKE3 hashes of the rows
//! below it, so the combination does not depend on order and a row change
//! XORs one delta into its leaf, its level-1 node and its root.
//!
//! Only the index (`tree_rows`) is stored, written in the transaction that
//! changes the row: one index write per changed row. The nodes live in
//! memory ([`Nodes`]): built from the index when the store opens ([`load`],
//! one pass over it), and changed by the deltas a writer's batch gathered
//! ([`queue`]) once that batch has committed, before its writers are
//! answered. Storing them too cost three B-tree writes per row (rows land
//! in random partitions, so a batch shares few nodes) and made a merged row
//! about 1.8 times as expensive to commit; a crash loses nothing, since
//! the index is committed with the rows and the nodes follow from it. A
//! node whose hash returns to zero is removed, so the nodes equal a rebuild
//! from the rows ([`build`]) exactly.
//!
//! XOR is linear: someone who chooses keys could make two different sets of
//! rows hash alike, but replicas do not choose their rows against each
//! other; by accident two different sets collide with probability 2^-256.

use super::types::ObjectSummary;
use super::{LEGACY_TREE_NODES, OBJECTS, TOMBSTONES, TREE_META, TREE_ROWS, Txn};
use crate::error::Result;
use redb::{ReadableTable, WriteTransaction};
use std::collections::BTreeMap;

/// A node's hash.
pub type Hash = [u8; 32];

/// Children of every inner node.
pub const FANOUT: u16 = 16;
/// Leaves per partition.
pub const LEAVES: u16 = FANOUT * FANOUT;
/// The root's node number.
pub const ROOT: u16 = 0;
/// Node number of the first leaf.
pub const FIRST_LEAF: u16 = 1 + FANOUT;

/// The key of the tree's metadata row holding the partition count.
pub const PARTITIONS_KEY: &str = "partitions";

/// A key's row as the tree sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct TreeEntry {
    /// The row's version.
    pub version: u64,
    /// The row is a tombstone.
    pub tombstone: bool,
}

impl TreeEntry {
    /// The row a replica answers for a key holding `object` and `tomb`
    /// versions: the newer of the two, as [`super::MetaStore::get_row`]
    /// answers it.
    pub fn of(object: Option<u64>, tomb: Option<u64>) -> Option<TreeEntry> {
        match (object, tomb) {
            (Some(o), Some(t)) if t > o => Some(TreeEntry { version: t, tombstone: true }),
            (Some(o), _) => Some(TreeEntry { version: o, tombstone: false }),
            (None, Some(t)) => Some(TreeEntry { version: t, tombstone: true }),
            (None, None) => None,
        }
    }
}

/// A key's partition (mod `partitions`) and leaf (0..256).
pub fn position(partitions: u32, bucket: &str, key: &[u8]) -> (u32, u8) {
    let mut h = blake3::Hasher::new();
    h.update(bucket.as_bytes());
    h.update(&[0]);
    h.update(key);
    let d = h.finalize();
    let b = d.as_bytes();
    let x = u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]);
    (u32::try_from(x % u64::from(partitions.max(1))).unwrap_or(0), b[8])
}

/// The hash a row contributes to its leaf.
pub fn row_hash(bucket: &str, key: &[u8], e: TreeEntry) -> Hash {
    let mut h = blake3::Hasher::new();
    h.update(&(bucket.len() as u64).to_le_bytes());
    h.update(bucket.as_bytes());
    h.update(&(key.len() as u64).to_le_bytes());
    h.update(key);
    h.update(&e.version.to_le_bytes());
    h.update(&[u8::from(e.tombstone)]);
    *h.finalize().as_bytes()
}

fn xor_into(acc: &mut Hash, x: &Hash) {
    for (a, b) in acc.iter_mut().zip(x) {
        *a ^= b;
    }
}

/// The node of leaf `leaf`.
pub fn leaf_node(leaf: u8) -> u16 {
    FIRST_LEAF + u16::from(leaf)
}

/// The leaf a node is, if it is one.
pub fn node_leaf(node: u16) -> Option<u8> {
    node.checked_sub(FIRST_LEAF).and_then(|l| u8::try_from(l).ok())
}

/// The nodes from a leaf up to the root.
pub fn path(leaf: u8) -> [u16; 3] {
    [leaf_node(leaf), 1 + u16::from(leaf) / FANOUT, ROOT]
}

/// The children of an inner node (empty for a leaf or a node out of range).
pub fn children(node: u16) -> std::ops::Range<u16> {
    match node {
        ROOT => 1..1 + FANOUT,
        n if n <= FANOUT => {
            let first = FIRST_LEAF + (n - 1) * FANOUT;
            first..first + FANOUT
        }
        _ => 0..0,
    }
}

/// What one level of comparing two replicas' trees found.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Step {
    /// Children of differing inner nodes: the nodes to compare next.
    pub ask: Vec<(u32, u16)>,
    /// Differing leaves: the rows to reconcile.
    pub leaves: Vec<(u32, u8)>,
    /// Differing roots (divergent partitions).
    pub partitions: usize,
}

/// Compares the hashes `ours` and `theirs` of `nodes` (pure): equal nodes
/// are done with; differing inner nodes are descended into, differing
/// leaves are returned.
pub fn descend(nodes: &[(u32, u16)], ours: &[Hash], theirs: &[Hash]) -> Step {
    let mut step = Step::default();
    for ((&(p, n), a), b) in nodes.iter().zip(ours).zip(theirs) {
        if a == b {
            continue;
        }
        if n == ROOT {
            step.partitions += 1;
        }
        match node_leaf(n) {
            Some(leaf) => step.leaves.push((p, leaf)),
            None => step.ask.extend(children(n).map(|c| (p, c))),
        }
    }
    step
}

/// The nodes of the trees of `rows` (pure; zero hashes left out): what the
/// incremental updates must always equal.
pub fn build<'a>(
    partitions: u32,
    rows: impl IntoIterator<Item = (&'a str, &'a [u8], TreeEntry)>,
) -> BTreeMap<(u32, u16), Hash> {
    let mut nodes: BTreeMap<(u32, u16), Hash> = BTreeMap::new();
    for (bucket, key, e) in rows {
        let (p, leaf) = position(partitions, bucket, key);
        let h = row_hash(bucket, key, e);
        for n in path(leaf) {
            xor_into(nodes.entry((p, n)).or_default(), &h);
        }
    }
    nodes.retain(|_, h| *h != [0; 32]);
    nodes
}

/// Sets the tree's row of (bucket, key) to `new` (`None`: the key holds no
/// row) in `txn`: updates the index now and queues the change of its leaf
/// and their ancestors in `txn` (O(depth)), applied to the in-memory
/// [`Nodes`] once the batch has committed.
pub fn set(txn: &Txn<'_>, partitions: u32, bucket: &str, key: &[u8], new: Option<TreeEntry>) -> Result<()> {
    let (p, leaf) = position(partitions, bucket, key);
    let delta = txn.with_tree_rows(|rows| {
        let old = rows.get((p, leaf, bucket, key))?.map(|v| {
            let (version, tombstone) = v.value();
            TreeEntry { version, tombstone }
        });
        if old == new {
            return Ok(None);
        }
        let mut delta = [0u8; 32];
        if let Some(o) = old {
            xor_into(&mut delta, &row_hash(bucket, key, o));
        }
        match new {
            Some(n) => {
                xor_into(&mut delta, &row_hash(bucket, key, n));
                rows.insert((p, leaf, bucket, key), (n.version, n.tombstone))?;
            }
            None => {
                rows.remove((p, leaf, bucket, key))?;
            }
        }
        Ok(Some(delta))
    })?;
    if let Some(delta) = delta {
        txn.queue_delta(p, leaf, &delta);
    }
    Ok(())
}

/// Adds `delta` to the queued changes of every node from `leaf` to its root.
pub(super) fn queue(deltas: &mut BTreeMap<(u32, u16), Hash>, partition: u32, leaf: u8, delta: &Hash) {
    for n in path(leaf) {
        xor_into(deltas.entry((partition, n)).or_default(), delta);
    }
}

/// The nodes of every partition's tree, in memory: (partition, node) ->
/// hash, zero hashes left out.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Nodes(BTreeMap<(u32, u16), Hash>);

impl Nodes {
    /// A node's hash (zeros for an empty node).
    pub fn get(&self, node: (u32, u16)) -> Hash {
        self.0.get(&node).copied().unwrap_or_default()
    }

    /// XORs a committed batch's queued changes into the nodes; a node whose
    /// hash becomes zero is removed.
    pub fn apply(&mut self, deltas: &BTreeMap<(u32, u16), Hash>) {
        for (&n, d) in deltas {
            if *d == [0; 32] {
                continue;
            }
            let h = self.0.entry(n).or_default();
            xor_into(h, d);
            if *h == [0; 32] {
                self.0.remove(&n);
            }
        }
    }

    /// Every non-empty node.
    pub fn as_map(&self) -> &BTreeMap<(u32, u16), Hash> {
        &self.0
    }
}

/// The nodes of the trees whose index is `rows` ((partition, leaf, bucket,
/// key) -> (version, tombstone)): what [`MetaStore::open`] builds once, from
/// the stored index.
///
/// [`MetaStore::open`]: super::MetaStore::open
pub fn load(rows: &impl ReadableTable<super::TreeKey, (u64, bool)>) -> Result<Nodes> {
    let mut nodes: BTreeMap<(u32, u16), Hash> = BTreeMap::new();
    for row in rows.iter()? {
        let (k, v) = row?;
        let (p, leaf, bucket, key) = k.value();
        let (version, tombstone) = v.value();
        let h = row_hash(bucket, key, TreeEntry { version, tombstone });
        for n in path(leaf) {
            xor_into(nodes.entry((p, n)).or_default(), &h);
        }
    }
    nodes.retain(|_, h| *h != [0; 32]);
    Ok(Nodes(nodes))
}

/// Every key's row from the objects and tombstones tables, by (bucket, key).
pub fn current_rows(txn: &WriteTransaction) -> Result<BTreeMap<(String, Vec<u8>), TreeEntry>> {
    let mut objects: BTreeMap<(String, Vec<u8>), u64> = BTreeMap::new();
    for row in txn.open_table(OBJECTS)?.iter()? {
        let (k, v) = row?;
        let (b, key) = k.value();
        let (s, _) = postcard::take_from_bytes::<ObjectSummary>(v.value())?;
        objects.insert((b.to_owned(), key.to_vec()), s.version);
    }
    let mut out = BTreeMap::new();
    for row in txn.open_table(TOMBSTONES)?.iter()? {
        let (k, v) = row?;
        let (b, key) = k.value();
        let id = (b.to_owned(), key.to_vec());
        let object = objects.remove(&id);
        if let Some(e) = TreeEntry::of(object, Some(v.value())) {
            out.insert(id, e);
        }
    }
    for (id, v) in objects {
        out.insert(id, TreeEntry { version: v, tombstone: false });
    }
    Ok(out)
}

/// Makes the tree's index match the rows unless it was built for
/// `partitions` already (a store from a build before the tree, or one a
/// single node wrote to since): drops it and builds it from every row,
/// once. Returns whether it rebuilt. Also drops the node table that builds
/// before the nodes moved to memory kept.
pub fn ensure(txn: &WriteTransaction, partitions: u32) -> Result<bool> {
    txn.delete_table(LEGACY_TREE_NODES)?;
    let built = txn.open_table(TREE_META)?.get(PARTITIONS_KEY)?.map(|v| v.value());
    if built == Some(u64::from(partitions)) {
        txn.open_table(TREE_ROWS)?;
        return Ok(false);
    }
    txn.delete_table(TREE_ROWS)?;
    let current = current_rows(txn)?;
    {
        let mut rows = txn.open_table(TREE_ROWS)?;
        for ((b, k), e) in &current {
            let (p, leaf) = position(partitions, b, k);
            rows.insert((p, leaf, b.as_str(), k.as_slice()), (e.version, e.tombstone))?;
        }
    }
    txn.open_table(TREE_META)?.insert(PARTITIONS_KEY, u64::from(partitions))?;
    Ok(true)
}

/// Forgets the tree (the store runs as a single node, which does not keep
/// it): a later open as a cluster node rebuilds it from the rows.
pub fn drop_tree(txn: &WriteTransaction) -> Result<()> {
    txn.delete_table(LEGACY_TREE_NODES)?;
    let marked = txn.open_table(TREE_META)?.remove(PARTITIONS_KEY)?.is_some();
    if marked {
        txn.delete_table(TREE_ROWS)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn children_and_paths_agree() {
        for leaf in 0..=255u8 {
            let [l, mid, root] = path(leaf);
            assert_eq!(node_leaf(l), Some(leaf));
            assert!(children(mid).contains(&l), "leaf {leaf}");
            assert!(children(root).contains(&mid));
            assert!(children(l).is_empty());
        }
        assert_eq!(children(ROOT).len(), 16);
        assert_eq!(node_leaf(16), None);
    }

    #[test]
    fn descending_two_trees_finds_exactly_the_leaves_that_differ() {
        let rows: Vec<(String, Vec<u8>, TreeEntry)> = (0..300u64)
            .map(|i| ("b".to_owned(), format!("k{i}").into_bytes(), TreeEntry { version: 7, tombstone: false }))
            .collect();
        let mut other = rows.clone();
        other[5].2.version = 8;
        other.remove(9);
        let a = build(2, rows.iter().map(|(b, k, e)| (b.as_str(), k.as_slice(), *e)));
        let b = build(2, other.iter().map(|(b, k, e)| (b.as_str(), k.as_slice(), *e)));
        let get = |t: &BTreeMap<(u32, u16), Hash>, nodes: &[(u32, u16)]| -> Vec<Hash> {
            nodes.iter().map(|n| t.get(n).copied().unwrap_or_default()).collect()
        };
        let mut ask: Vec<(u32, u16)> = vec![(0, ROOT), (1, ROOT)];
        let mut leaves = Vec::new();
        let mut partitions = 0;
        while !ask.is_empty() {
            let step = descend(&ask, &get(&a, &ask), &get(&b, &ask));
            partitions += step.partitions;
            leaves.extend(step.leaves);
            ask = step.ask;
        }
        let mut want: Vec<(u32, u8)> = [5usize, 9].iter().map(|i| position(2, "b", &rows[*i].1)).collect();
        want.sort();
        want.dedup();
        leaves.sort();
        assert_eq!(leaves, want);
        let mut parts: Vec<u32> = want.iter().map(|w| w.0).collect();
        parts.dedup();
        assert_eq!(partitions, parts.len());
    }

    #[test]
    fn a_node_is_the_xor_of_its_children() {
        let rows: Vec<(String, Vec<u8>, TreeEntry)> = (0..500u64)
            .map(|i| ("b".to_owned(), format!("k{i}").into_bytes(), TreeEntry { version: i, tombstone: i % 7 == 0 }))
            .collect();
        let nodes = build(4, rows.iter().map(|(b, k, e)| (b.as_str(), k.as_slice(), *e)));
        for p in 0..4 {
            for parent in std::iter::once(ROOT).chain(children(ROOT)) {
                let mut x = [0u8; 32];
                for c in children(parent) {
                    xor_into(&mut x, nodes.get(&(p, c)).unwrap_or(&[0; 32]));
                }
                assert_eq!(&x, nodes.get(&(p, parent)).unwrap_or(&[0; 32]), "partition {p} node {parent}");
            }
        }
    }

    mod model {
        use super::super::*;
        use crate::meta::types::{ObjectData, ObjectMeta, Row};
        use crate::meta::{BUCKETS, REFS, Txn, ops};
        use proptest::prelude::*;

        const PARTITIONS: u32 = 3;

        /// A change of rows, as the writers of the store make them.
        #[derive(Debug, Clone)]
        enum Change {
            Put { key: u8, version: u64 },
            Delete { key: u8 },
            MergeObject { key: u8, version: u64 },
            MergeTombstone { key: u8, version: u64 },
            DropTombstone { key: u8 },
            PutMissingBucket { key: u8 },
        }

        fn change() -> impl Strategy<Value = Change> {
            let key = 0u8..24;
            let version = 1u64..200;
            prop_oneof![
                (key.clone(), version.clone()).prop_map(|(key, version)| Change::Put { key, version }),
                key.clone().prop_map(|key| Change::Delete { key }),
                (key.clone(), version.clone()).prop_map(|(key, version)| Change::MergeObject { key, version }),
                (key.clone(), version).prop_map(|(key, version)| Change::MergeTombstone { key, version }),
                key.clone().prop_map(|key| Change::DropTombstone { key }),
                key.prop_map(|key| Change::PutMissingBucket { key }),
            ]
        }

        fn object(version: u64) -> ObjectMeta {
            ObjectMeta {
                version,
                size: 1,
                etag: "e".into(),
                last_modified_ms: 0,
                headers: Default::default(),
                checksum: None,
                parts: Vec::new(),
                data: ObjectData::Inline(vec![1]),
                sse_c: None,
                versioned: None,
            }
        }

        fn name(key: u8) -> String {
            format!("key-{key}")
        }

        /// Applies one change; client errors (a missing bucket) change nothing.
        fn apply(t: &Txn<'_>, c: &Change) -> crate::error::Result<()> {
            match c {
                Change::Put { key, version } => {
                    ops::put_object(t, "b", &name(*key), &object(*version), &Default::default()).map(drop)
                }
                Change::Delete { key } => ops::delete_object(t, "b", &name(*key)).map(drop),
                Change::MergeObject { key, version } => {
                    ops::apply_row(t, "b", name(*key).as_bytes(), &Row::Object(object(*version))).map(drop)
                }
                Change::MergeTombstone { key, version } => {
                    ops::apply_row(t, "b", name(*key).as_bytes(), &Row::Tombstone(*version)).map(drop)
                }
                Change::DropTombstone { key } => {
                    let held = t.open_table(TOMBSTONES)?.get(("b", name(*key).as_bytes()))?.map(|v| v.value());
                    match held {
                        Some(v) => ops::drop_tombstone(t, "b", name(*key).as_bytes(), v),
                        None => Ok(()),
                    }
                }
                Change::PutMissingBucket { key } => {
                    let r = ops::put_object(t, "nob", &name(*key), &object(1), &Default::default());
                    assert!(r.is_err(), "no such bucket");
                    Ok(())
                }
            }
        }

        type Tables = (Vec<((u32, u8, String, Vec<u8>), (u64, bool))>, BTreeMap<(u32, u16), Hash>);

        /// The stored index and the nodes kept in memory.
        fn stored(db: &redb::Database, nodes: &Nodes) -> Tables {
            let txn = db.begin_read().expect("read");
            let mut rows = Vec::new();
            for r in txn.open_table(TREE_ROWS).expect("rows").iter().expect("iter") {
                let (k, v) = r.expect("row");
                let (p, l, b, key) = k.value();
                rows.push(((p, l, b.to_owned(), key.to_vec()), v.value()));
            }
            (rows, nodes.as_map().clone())
        }

        /// The nodes as an open builds them from the stored index.
        fn loaded(db: &redb::Database) -> Nodes {
            load(&db.begin_read().expect("read").open_table(TREE_ROWS).expect("rows")).expect("load")
        }

        fn rebuilt(db: &redb::Database) -> Tables {
            let txn = db.begin_write().expect("write");
            let current = current_rows(&txn).expect("rows");
            let mut rows: Vec<_> = current
                .iter()
                .map(|((b, k), e)| {
                    let (p, l) = position(PARTITIONS, b, k);
                    ((p, l, b.clone(), k.clone()), (e.version, e.tombstone))
                })
                .collect();
            rows.sort();
            let nodes = build(PARTITIONS, current.iter().map(|((b, k), e)| (b.as_str(), k.as_slice(), *e)));
            txn.abort().expect("abort");
            (rows, nodes)
        }

        /// Runs the batches as the writer does: each one transaction, its
        /// queued node changes applied to `nodes` once it has committed.
        fn run(db: &redb::Database, tree: Option<u32>, batches: &[Vec<Change>], nodes: &mut Nodes) {
            for batch in batches {
                let w = db.begin_write().expect("write");
                let deltas = {
                    let t = Txn::new(&w, tree);
                    for c in batch {
                        apply(&t, c).expect("change");
                    }
                    t.take_deltas()
                };
                w.commit().expect("commit");
                nodes.apply(&deltas);
            }
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

            #[test]
            fn the_incrementally_kept_tree_equals_one_rebuilt_from_the_rows(
                before in proptest::collection::vec(proptest::collection::vec(change(), 1..4), 0..8),
                after in proptest::collection::vec(proptest::collection::vec(change(), 1..6), 1..30),
            ) {
                let dir = tempfile::tempdir().expect("tempdir");
                let db = redb::Database::create(dir.path().join("m.redb")).expect("db");
                let w = db.begin_write().expect("write");
                w.open_table(OBJECTS).expect("table");
                w.open_table(TOMBSTONES).expect("table");
                w.open_table(REFS).expect("table");
                w.open_table(BUCKETS).expect("table");
                ops::create_bucket(&w, "b", 0).expect("bucket");
                w.commit().expect("commit");
                // Rows written without a tree (an older build, or a single
                // node), then the tree built once at open, then kept.
                let mut untouched = Nodes::default();
                run(&db, None, &before, &mut untouched);
                prop_assert_eq!(&untouched, &Nodes::default(), "a store without a tree queues nothing");
                let w = db.begin_write().expect("write");
                prop_assert!(ensure(&w, PARTITIONS).expect("ensure"));
                prop_assert!(!ensure(&w, PARTITIONS).expect("ensure again"));
                w.commit().expect("commit");
                let mut nodes = loaded(&db);
                prop_assert_eq!(stored(&db, &nodes), rebuilt(&db));
                run(&db, Some(PARTITIONS), &after, &mut nodes);
                prop_assert_eq!(stored(&db, &nodes), rebuilt(&db));
                // What a reopened store builds equals what was kept.
                prop_assert_eq!(loaded(&db), nodes);
            }
        }

        /// The write bodies' cost with and without the tree (no fsync, so
        /// only the CPU and redb work shows): `cargo test --release -p
        /// lightningstor --lib -- --ignored tree_cost --nocapture`.
        #[test]
        #[ignore = "a measurement, not a check"]
        fn tree_cost_per_merged_row() {
            for tree in [None, Some(256)] {
                let dir = tempfile::tempdir().expect("tempdir");
                let db = redb::Database::create(dir.path().join("m.redb")).expect("db");
                let w = db.begin_write().expect("write");
                ops::create_bucket(&w, "b", 0).expect("bucket");
                w.commit().expect("commit");
                let n = 20_000u64;
                let mut nodes = Nodes::default();
                let start = std::time::Instant::now();
                for batch in 0..n / 64 {
                    let mut w = db.begin_write().expect("write");
                    w.set_durability(redb::Durability::None);
                    let deltas = {
                        let t = Txn::new(&w, tree);
                        for i in 0..64 {
                            let key = format!("some/key/{}", batch * 64 + i);
                            ops::apply_row(&t, "b", key.as_bytes(), &Row::Object(object(batch * 64 + i + 1)))
                                .expect("merge");
                        }
                        t.take_deltas()
                    };
                    w.commit().expect("commit");
                    nodes.apply(&deltas);
                }
                let per = start.elapsed() / u32::try_from(n).expect("n");
                eprintln!("tree {tree:?}: {per:?} per merged row ({n} rows, 64 per transaction, no fsync)");
            }
        }
    }
}
