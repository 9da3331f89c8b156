//! Async locks by name, made on first use and gone with their last holder:
//! one per VM, so that the steps of one VM's operation (each a call to a
//! worker that may take up to a minute) never wait on another VM's.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use tokio::sync::OwnedMutexGuard;

type Lock = tokio::sync::Mutex<()>;

/// A set of named locks.
#[derive(Debug, Default)]
pub struct KeyedLocks {
    map: Mutex<HashMap<String, Weak<Lock>>>,
}

impl KeyedLocks {
    /// Waits for the lock called `key`; it is held until the guard drops.
    pub async fn lock(&self, key: &str) -> OwnedMutexGuard<()> {
        let lock = {
            let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
            match map.get(key).and_then(Weak::upgrade) {
                Some(l) => l,
                None => {
                    // Forget the locks nobody holds or waits for any more.
                    map.retain(|_, w| w.strong_count() > 0);
                    let l = Arc::new(Lock::default());
                    map.insert(key.to_owned(), Arc::downgrade(&l));
                    l
                }
            }
        };
        lock.lock_owned().await
    }

    /// Names with a holder or a waiter (tests).
    pub fn len(&self) -> usize {
        self.map.lock().unwrap_or_else(|e| e.into_inner()).values().filter(|w| w.strong_count() > 0).count()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn one_name_is_exclusive_and_other_names_are_free() {
        let locks = Arc::new(KeyedLocks::default());
        let held = locks.lock("vm-a").await;
        // Another name is not held up by it.
        tokio::time::timeout(Duration::from_secs(5), locks.lock("vm-b")).await.expect("vm-b waited on vm-a");
        // The same name waits until the holder lets go.
        let l2 = locks.clone();
        let waiter = tokio::spawn(async move { drop(l2.lock("vm-a").await) });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiter.is_finished(), "a second holder of vm-a got in");
        drop(held);
        tokio::time::timeout(Duration::from_secs(5), waiter).await.expect("never released").expect("join");
    }

    #[tokio::test]
    async fn locks_nobody_holds_are_forgotten() {
        let locks = KeyedLocks::default();
        for i in 0..100 {
            drop(locks.lock(&format!("vm-{i}")).await);
        }
        let _g = locks.lock("vm-x").await;
        assert_eq!(locks.len(), 1);
        assert!(locks.map.lock().expect("map").len() <= 2, "dead entries piled up");
    }
}
