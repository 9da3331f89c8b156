//! One test suite run against every [`BlockStore`] implementation.

use super::{BlockHash, BlockStore};
use crate::error::LightningError;

/// Exercises put/get/delete/list/flush semantics.
pub(crate) fn run(store: &dyn BlockStore) {
    let a = vec![1u8; 3000];
    let b: Vec<u8> = (0..70_000u32).map(|i| (i % 251) as u8).collect();
    let ha = BlockHash::of(&a);
    let hb = BlockHash::of(&b);

    assert!(!store.contains(&ha).expect("contains"));
    assert!(matches!(store.get(&ha), Err(LightningError::MissingBlock { .. })));

    store.put(&ha, &a).expect("put a");
    store.put(&ha, &a).expect("put a again is a no-op");
    store.put(&hb, &b).expect("put b");
    store.flush().expect("flush");

    assert_eq!(store.get(&ha).expect("get a").as_ref(), &a[..]);
    assert_eq!(store.get(&hb).expect("get b").as_ref(), &b[..]);
    let mut listed = store.list().expect("list");
    listed.sort();
    let mut want = vec![ha, hb];
    want.sort();
    assert_eq!(listed, want);

    store.delete(&ha).expect("delete");
    store.delete(&ha).expect("deleting twice is fine");
    store.flush().expect("flush");
    assert!(!store.contains(&ha).expect("contains"));
    assert_eq!(store.list().expect("list"), vec![hb]);
}
